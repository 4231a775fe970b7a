//! A small blocking HTTP/1.1 request parser and response writer, enough for the control
//! API: one request per connection, bodies sized by Content-Length.

use std::io::{BufRead, BufReader, Read, Write};

/// Largest header block accepted.
pub const MAX_HEADER_BYTES: usize = 8 * 1024;
/// Largest body accepted.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

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

/// Reads one request from `stream`.
pub fn read_request<R: Read>(stream: R) -> Result<Request, HttpError> {
    let mut reader = BufReader::new(stream.take((MAX_HEADER_BYTES + MAX_BODY_BYTES + 1) as u64));
    let mut header_bytes = 0usize;
    let mut line = String::new();
    let mut read_line = |reader: &mut BufReader<_>, line: &mut String| -> Result<(), HttpError> {
        line.clear();
        let n = reader.read_line(line)?;
        if n == 0 {
            return Err(HttpError::Malformed("connection closed mid-request".into()));
        }
        header_bytes += n;
        if header_bytes > MAX_HEADER_BYTES {
            return Err(HttpError::TooLarge(format!(
                "headers over {MAX_HEADER_BYTES} bytes"
            )));
        }
        Ok(())
    };

    read_line(&mut reader, &mut line)?;
    let mut parts = line.split_whitespace();
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::Malformed(format!(
            "bad request line {:?}",
            line.trim_end()
        )));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::Malformed(format!(
            "unsupported version {version}"
        )));
    }
    let method = method.to_string();
    let path = target.split('?').next().unwrap_or("").to_string();

    let mut content_length = 0usize;
    loop {
        read_line(&mut reader, &mut line)?;
        let l = line.trim_end_matches(['\r', '\n']);
        if l.is_empty() {
            break;
        }
        let Some((name, value)) = l.split_once(':') else {
            return Err(HttpError::Malformed(format!("bad header {l:?}")));
        };
        let name = name.trim().to_ascii_lowercase();
        let value = value.trim();
        if name == "content-length" {
            content_length = value
                .parse()
                .map_err(|_| HttpError::Malformed(format!("bad Content-Length {value:?}")))?;
            if content_length > MAX_BODY_BYTES {
                return Err(HttpError::TooLarge(format!(
                    "body of {content_length} bytes; at most {MAX_BODY_BYTES}"
                )));
            }
        } else if name == "transfer-encoding" {
            return Err(HttpError::Malformed(
                "Transfer-Encoding is not supported; send Content-Length".into(),
            ));
        }
    }
    let mut body = vec![0u8; content_length];
    reader.read_exact(&mut body)?;
    Ok(Request { method, path, body })
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
    let text = String::from_utf8_lossy(&raw);
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| HttpError::Malformed("response without header end".into()))?;
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| HttpError::Malformed(format!("bad status line in {head:?}")))?;
    Ok(Response {
        status,
        body: body.to_string(),
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
