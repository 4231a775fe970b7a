//! A client for the control socket, used by the `vmm` CLI subcommands and tests.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use super::http::{read_response, HttpError, Response};

/// Errors talking to a VMM.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// Nobody is serving on the socket.
    #[error("cannot connect to {path}: {source} (is a VMM running with --api-sock {path}?)")]
    Connect {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The exchange failed.
    #[error("API exchange failed: {0}")]
    Exchange(#[from] HttpError),
}

/// Sends one request and reads the answer.
pub fn request(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<Response, ClientError> {
    let mut s = UnixStream::connect(sock).map_err(|source| ClientError::Connect {
        path: sock.display().to_string(),
        source,
    })?;
    let timeout = Some(Duration::from_secs(30));
    s.set_read_timeout(timeout).map_err(HttpError::Io)?;
    s.set_write_timeout(timeout).map_err(HttpError::Io)?;
    let body = body.unwrap_or("");
    let msg = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    );
    s.write_all(msg.as_bytes()).map_err(HttpError::Io)?;
    Ok(read_response(&s)?)
}
