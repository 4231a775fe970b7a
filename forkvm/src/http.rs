//! One HTTP/1.1 exchange with a VMM on its control socket (hyper over a Unix stream).

use std::collections::HashMap;
use std::path::Path;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use crate::Error;

/// An answer: status, headers (lower-case names), body.
#[derive(Debug)]
pub(crate) struct Answer {
    pub status: u16,
    pub headers: HashMap<String, String>,
    pub body: Bytes,
}

impl Answer {
    /// A header's value.
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).map(String::as_str)
    }

    /// The error text of a JSON error body (or the body as text).
    pub fn error_text(&self) -> String {
        self.error_body().error
    }

    /// The JSON error body (or one whose error is the body as text).
    pub fn error_body(&self) -> api_types::ErrorBody {
        serde_json::from_slice::<api_types::ErrorBody>(&self.body).unwrap_or_else(|_| {
            api_types::ErrorBody::new(String::from_utf8_lossy(&self.body).into_owned())
        })
    }
}

/// Sends `method path` with `body` to the VMM on `sock`; one connection per exchange
/// (dropping the future closes it).
pub(crate) async fn exchange(
    sock: &Path,
    method: &str,
    path: &str,
    body: Bytes,
) -> Result<Answer, Error> {
    let socket = |source| Error::Socket {
        path: sock.to_path_buf(),
        source,
    };
    let stream = UnixStream::connect(sock).await.map_err(socket)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(http)?;
    let driver = tokio::spawn(conn);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "forkvm")
        .header("content-length", body.len())
        .body(Full::new(body))
        .map_err(|e| Error::Protocol(e.to_string()))?;
    let result = async {
        let response = sender.send_request(request).await.map_err(http)?;
        let status = response.status().as_u16();
        let headers = (response.headers().iter())
            .filter_map(|(k, v)| Some((k.as_str().to_string(), v.to_str().ok()?.to_string())))
            .collect();
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(http)?
            .to_bytes();
        Ok::<_, Error>(Answer {
            status,
            headers,
            body,
        })
    }
    .await;
    driver.abort();
    result
}

/// The library's error for an HTTP client error.
fn http(e: hyper::Error) -> Error {
    Error::Http(crate::error::HttpError::new(e))
}
