//! HTTP/1.1 for the control API, over `httparse`: a blocking request reader and response
//! writer for the server (one request per connection, bodies sized by Content-Length),
//! and a response reader for clients (the `vmm` CLI and the tests).

use std::io::{Read, Write};

/// Largest header block accepted.
pub const MAX_HEADER_BYTES: usize = 8 * 1024;
/// Largest body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;
/// Most headers a request may have.
const MAX_HEADERS: usize = 64;

/// Errors reading a request; each maps to a 4xx answer.
#[derive(Debug, thiserror::Error)]
pub enum HttpError {
    /// Connection closed or I/O failed before a whole request arrived.
    #[error("connection error: {0}")]
    Io(#[from] std::io::Error),
    /// Not a valid HTTP/1.x request.
    #[error("malformed request: {0}")]
    Malformed(String),
    /// Headers or body too large.
    #[error("request too large: {0}")]
    TooLarge(String),
}

/// A parsed request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// GET, PUT, PATCH, POST, DELETE, ...
    pub method: String,
    /// Path without query string.
    pub path: String,
    /// Body bytes.
    pub body: Vec<u8>,
}

/// The parts of a complete header block that matter here.
struct Head {
    method: String,
    path: String,
    content_length: usize,
    /// Bytes of the buffer the header block took.
    len: usize,
}

/// Parses the header block at the start of `buf`; None while it is incomplete.
fn parse_head(buf: &[u8]) -> Result<Option<Head>, HttpError> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let len = match req.parse(buf) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(HttpError::TooLarge(format!(
                "more than {MAX_HEADERS} headers"
            )))
        }
        Err(e) => return Err(HttpError::Malformed(e.to_string())),
    };
    let mut content_length = 0usize;
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let value = String::from_utf8_lossy(h.value);
            content_length = value
                .trim()
                .parse()
                .map_err(|_| HttpError::Malformed(format!("bad Content-Length {value:?}")))?;
            if content_length > MAX_BODY_BYTES {
                return Err(HttpError::TooLarge(format!(
                    "body of {content_length} bytes; at most {MAX_BODY_BYTES}"
                )));
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::Malformed(
                "Transfer-Encoding is not supported; send Content-Length".into(),
            ));
        }
    }
    let target = req.path.unwrap_or("");
    Ok(Some(Head {
        method: req.method.unwrap_or("").to_string(),
        path: target.split('?').next().unwrap_or("").to_string(),
        content_length,
        len,
    }))
}

/// Reads one request from `stream`.
pub fn read_request<R: Read>(mut stream: R) -> Result<Request, HttpError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    let head = loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(HttpError::Malformed("connection closed mid-request".into()));
        }
        buf.extend_from_slice(&chunk[..n]);
        let head = parse_head(&buf)?;
        if head.as_ref().map_or(buf.len(), |h| h.len) > MAX_HEADER_BYTES {
            return Err(HttpError::TooLarge(format!(
                "headers over {MAX_HEADER_BYTES} bytes"
            )));
        }
        if let Some(head) = head {
            break head;
        }
    };
    let mut body = buf.split_off(head.len);
    body.truncate(head.content_length);
    if body.len() < head.content_length {
        let got = body.len();
        body.resize(head.content_length, 0);
        stream.read_exact(&mut body[got..])?;
    }
    Ok(Request {
        method: head.method,
        path: head.path,
        body,
    })
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        201 => "Created",
        204 => "No Content",
        400 => "Bad Request",
        404 => "Not Found",
        405 => "Method Not Allowed",
        409 => "Conflict",
        413 => "Payload Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Unknown",
    }
}

/// Writes a response with an optional JSON body and closes the exchange.
pub fn write_response<W: Write>(mut w: W, status: u16, body: Option<&str>) -> std::io::Result<()> {
    let body = body.unwrap_or("");
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    if !body.is_empty() {
        head.push_str("Content-Type: application/json\r\n");
    }
    head.push_str(&format!(
        "Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    ));
    w.write_all(head.as_bytes())?;
    w.write_all(body.as_bytes())?;
    w.flush()
}

/// A parsed response (used by the CLI client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Body text.
    pub body: String,
}

/// Reads a whole response (the server closes the connection after it).
pub fn read_response<R: Read>(mut r: R) -> Result<Response, HttpError> {
    let mut raw = Vec::new();
    r.read_to_end(&mut raw)?;
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut resp = httparse::Response::new(&mut headers);
    let len = match resp.parse(&raw) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) => {
            return Err(HttpError::Malformed("response without header end".into()))
        }
        Err(e) => return Err(HttpError::Malformed(format!("bad response: {e}"))),
    };
    Ok(Response {
        status: resp.code.unwrap_or(0),
        body: String::from_utf8_lossy(&raw[len..]).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_request_with_body() {
        let raw = b"PATCH /vm?x=1 HTTP/1.1\r\nHost: x\r\nContent-Length: 18\r\n\r\n{\"state\":\"paused\"}";
        let r = read_request(&raw[..]).unwrap();
        assert_eq!(r.method, "PATCH");
        assert_eq!(r.path, "/vm");
        assert_eq!(r.body, b"{\"state\":\"paused\"}");
    }

    #[test]
    fn rejects_garbage_and_oversize() {
        assert!(matches!(
            read_request(&b"hello\r\n\r\n"[..]),
            Err(HttpError::Malformed(_))
        ));
        assert!(matches!(
            read_request(&b"GET / SPDY/3\r\n\r\n"[..]),
            Err(HttpError::Malformed(_))
        ));
        let big = format!(
            "PUT / HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
            MAX_BODY_BYTES + 1
        );
        assert!(matches!(
            read_request(big.as_bytes()),
            Err(HttpError::TooLarge(_))
        ));
        let long = format!(
            "GET / HTTP/1.1\r\nX: {}\r\n\r\n",
            "a".repeat(MAX_HEADER_BYTES)
        );
        assert!(matches!(
            read_request(long.as_bytes()),
            Err(HttpError::TooLarge(_))
        ));
        assert!(matches!(
            read_request(&b"GET / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab"[..]),
            Err(HttpError::Io(_))
        ));
        assert!(matches!(
            read_request(&b"GET / HTTP/1.1\r\nContent-Length: x\r\n\r\n"[..]),
            Err(HttpError::Malformed(_))
        ));
    }

    #[test]
    fn response_round_trip() {
        let mut out = Vec::new();
        write_response(&mut out, 409, Some("{\"error\":\"x\"}")).unwrap();
        let r = read_response(&out[..]).unwrap();
        assert_eq!(r.status, 409);
        assert_eq!(r.body, "{\"error\":\"x\"}");
        let mut out = Vec::new();
        write_response(&mut out, 204, None).unwrap();
        assert_eq!(read_response(&out[..]).unwrap().status, 204);
    }
}
