//! HTTP/1.1 for the control API, over `httparse`: a request reader fed as bytes arrive
//! ([`RequestReader`], for the server's non-blocking connections; one request per
//! connection, bodies sized by Content-Length), a response writer, and a response reader
//! for clients (the `vmm` CLI and the tests).

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
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Request {
    /// GET, PUT, PATCH, POST, DELETE, ...
    pub method: String,
    /// Path without query string.
    pub path: String,
    /// The query string, without the `?` ("" without one).
    pub query: String,
    /// Body bytes.
    pub body: Vec<u8>,
}

/// The largest body a request to `path` may have: [`MAX_BODY_BYTES`], or for
/// invocations what the mailbox holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyLimits {
    /// `POST /invocations`.
    pub invocation: usize,
}

impl Default for BodyLimits {
    fn default() -> Self {
        Self {
            invocation: MAX_BODY_BYTES,
        }
    }
}

impl BodyLimits {
    fn of(&self, path: &str) -> usize {
        match path {
            "/invocations" => self.invocation,
            _ => MAX_BODY_BYTES,
        }
    }
}

/// The parts of a complete header block that matter here.
#[derive(Debug)]
struct Head {
    method: String,
    path: String,
    query: String,
    content_length: usize,
    /// Bytes of the buffer the header block took.
    len: usize,
}

/// Parses the header block at the start of `buf`; None while it is incomplete.
fn parse_head(buf: &[u8], limits: &BodyLimits) -> Result<Option<Head>, HttpError> {
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
    let target = req.path.unwrap_or("");
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let max_body = limits.of(path);
    for h in req.headers.iter() {
        if h.name.eq_ignore_ascii_case("content-length") {
            let value = String::from_utf8_lossy(h.value);
            content_length = value
                .trim()
                .parse()
                .map_err(|_| HttpError::Malformed(format!("bad Content-Length {value:?}")))?;
            if content_length > max_body {
                return Err(HttpError::TooLarge(format!(
                    "body of {content_length} bytes; at most {max_body}"
                )));
            }
        } else if h.name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::Malformed(
                "Transfer-Encoding is not supported; send Content-Length".into(),
            ));
        }
    }
    Ok(Some(Head {
        method: req.method.unwrap_or("").to_string(),
        path: path.to_string(),
        query: query.to_string(),
        content_length,
        len,
    }))
}

/// Reads one request from `stream`, bodies within the default limits.
pub fn read_request<R: Read>(stream: R) -> Result<Request, HttpError> {
    read_request_within(stream, &BodyLimits::default())
}

/// Reads one request from `stream`, its body within `limits`.
pub fn read_request_within<R: Read>(
    mut stream: R,
    limits: &BodyLimits,
) -> Result<Request, HttpError> {
    let mut reader = RequestReader::default();
    let mut chunk = [0u8; 16 * 1024];
    loop {
        let n = stream.read(&mut chunk)?;
        if n == 0 {
            return Err(reader.closed());
        }
        if let Some(req) = reader.feed(&chunk[..n], limits)? {
            return Ok(req);
        }
    }
}

/// One request read a piece at a time, as the bytes arrive (the server's connections do
/// not block). Bytes after the request are dropped: one request per connection.
#[derive(Debug, Default)]
pub struct RequestReader {
    /// The header block so far, then the body so far.
    buf: Vec<u8>,
    /// The header block, once complete (the body follows in `buf`).
    head: Option<Head>,
}

impl RequestReader {
    /// Takes the next `bytes`; the request once it is whole.
    pub fn feed(
        &mut self,
        bytes: &[u8],
        limits: &BodyLimits,
    ) -> Result<Option<Request>, HttpError> {
        self.buf.extend_from_slice(bytes);
        // A header block ends with a line feed: parse again only when one arrived.
        if self.head.is_none() && (bytes.contains(&b'\n') || self.buf.len() > MAX_HEADER_BYTES) {
            let head = parse_head(&self.buf, limits)?;
            if head.as_ref().map_or(self.buf.len(), |h| h.len) > MAX_HEADER_BYTES {
                return Err(HttpError::TooLarge(format!(
                    "headers over {MAX_HEADER_BYTES} bytes"
                )));
            }
            let Some(head) = head else { return Ok(None) };
            self.buf.drain(..head.len);
            self.buf
                .reserve_exact(head.content_length.saturating_sub(self.buf.len()));
            self.head = Some(head);
        }
        let Some(head) = &self.head else {
            return Ok(None);
        };
        if self.buf.len() < head.content_length {
            return Ok(None);
        }
        let mut body = std::mem::take(&mut self.buf);
        body.truncate(head.content_length);
        let head = self.head.take().expect("checked above");
        Ok(Some(Request {
            method: head.method,
            path: head.path,
            query: head.query,
            body,
        }))
    }

    /// The body's length, once the header block is complete.
    pub fn body_len(&self) -> Option<usize> {
        self.head.as_ref().map(|h| h.content_length)
    }

    /// Why the request is not whole when its connection closed.
    pub fn closed(&self) -> HttpError {
        match self.head {
            None => HttpError::Malformed("connection closed mid-request".into()),
            Some(_) => HttpError::Io(std::io::ErrorKind::UnexpectedEof.into()),
        }
    }
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
        408 => "Request Timeout",
        413 => "Payload Too Large",
        422 => "Unprocessable Content",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        504 => "Gateway Timeout",
        _ => "Unknown",
    }
}

/// Writes a response with an optional JSON body and closes the exchange.
pub fn write_response<W: Write>(w: W, status: u16, body: Option<&str>) -> std::io::Result<()> {
    let body = body.unwrap_or("");
    let kind = (!body.is_empty()).then_some("application/json");
    write_response_with(w, status, &[], kind, body.as_bytes())
}

/// Writes a response with extra `headers`, a body of type `content_type` (None: no
/// Content-Type) and closes the exchange.
pub fn write_response_with<W: Write>(
    mut w: W,
    status: u16,
    headers: &[(&str, String)],
    content_type: Option<&str>,
    body: &[u8],
) -> std::io::Result<()> {
    let head = response_head(status, headers, content_type, body.len());
    w.write_all(head.as_bytes())?;
    w.write_all(body)?;
    w.flush()
}

/// The head of a response with `status`, `headers`, `content_type` and a body of `len`
/// bytes (`Connection: close`), for a writer that sends the body itself.
pub fn response_head(
    status: u16,
    headers: &[(&str, String)],
    content_type: Option<&str>,
    len: usize,
) -> String {
    let mut head = format!("HTTP/1.1 {status} {}\r\n", reason(status));
    if let Some(kind) = content_type {
        head.push_str(&format!("Content-Type: {kind}\r\n"));
    }
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(&format!(
        "Content-Length: {len}\r\nConnection: close\r\n\r\n"
    ));
    head
}

/// The head of a request for `method path` with a body of `len` bytes of type
/// `content_type` (None: no `Content-Type`).
pub fn request_head(method: &str, path: &str, content_type: Option<&str>, len: usize) -> String {
    let kind = content_type.map_or(String::new(), |k| format!("Content-Type: {k}\r\n"));
    format!("{method} {path} HTTP/1.1\r\nHost: localhost\r\n{kind}Content-Length: {len}\r\n\r\n")
}

/// A parsed response (used by the CLI client).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Response {
    /// Status code.
    pub status: u16,
    /// Body text (bytes that are not UTF-8 replaced).
    pub body: String,
    /// The body's bytes.
    pub bytes: Vec<u8>,
    /// Headers, names in lower case, in order.
    pub headers: Vec<(String, String)>,
}

impl Response {
    /// The value of header `name` (lower case), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        (self.headers.iter())
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
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
    let headers = (resp.headers.iter())
        .map(|h| {
            let value = String::from_utf8_lossy(h.value).into_owned();
            (h.name.to_ascii_lowercase(), value)
        })
        .collect();
    Ok(Response {
        status: resp.code.unwrap_or(0),
        body: String::from_utf8_lossy(&raw[len..]).into_owned(),
        bytes: raw[len..].to_vec(),
        headers,
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
        assert_eq!(r.query, "x=1");
        assert_eq!(r.body, b"{\"state\":\"paused\"}");
    }

    #[test]
    fn invocations_take_bodies_up_to_the_mailbox() {
        let limits = BodyLimits {
            invocation: 1 << 20,
        };
        let head =
            |path: &str, n: usize| format!("POST {path} HTTP/1.1\r\nContent-Length: {n}\r\n\r\n");
        let body = vec![7u8; 100_000];
        let mut raw = head("/invocations?keep_alive=true", body.len()).into_bytes();
        raw.extend_from_slice(&body);
        let r = read_request_within(&raw[..], &limits).unwrap();
        assert_eq!(
            (r.path.as_str(), r.query.as_str()),
            ("/invocations", "keep_alive=true")
        );
        assert_eq!(r.body, body);
        // Elsewhere the limit stays, and past the mailbox it is refused unread.
        let raw = head("/clones", 100_000);
        assert!(matches!(
            read_request_within(raw.as_bytes(), &limits),
            Err(HttpError::TooLarge(_))
        ));
        let raw = head("/invocations", (1 << 20) + 1);
        assert!(matches!(
            read_request_within(raw.as_bytes(), &limits),
            Err(HttpError::TooLarge(_))
        ));
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
        let mut out = Vec::new();
        let headers = [("X-Forkvm-Outcome", "ok".to_string())];
        write_response_with(&mut out, 200, &headers, None, &[0, 159, 146, 150]).unwrap();
        let r = read_response(&out[..]).unwrap();
        assert_eq!(r.bytes, [0, 159, 146, 150]);
        assert_eq!(r.header("x-forkvm-outcome"), Some("ok"));
    }
}
