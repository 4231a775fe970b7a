//! One HTTP/1.1 exchange with a VMM on its control socket (hyper over a Unix stream):
//! a call of `forkvm_client::call` sent, its answer read.

use std::path::Path;

use forkvm_client::call::{Answer, Call};
use http_body_util::{BodyExt, Full};
use hyper::Request;
use hyper_util::rt::TokioIo;
use tokio::net::UnixStream;

use crate::Error;

/// Sends `call` to the VMM on `sock` and reads the answer, whatever its status; one
/// connection per exchange (dropping the future closes it).
pub(crate) async fn exchange<T>(sock: &Path, call: &Call<T>) -> Result<Answer, Error> {
    let socket = |source| Error::Socket {
        path: sock.to_path_buf(),
        source,
    };
    let stream = UnixStream::connect(sock).await.map_err(socket)?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(http)?;
    let driver = tokio::spawn(conn);
    let mut request = Request::builder()
        .method(call.method)
        .uri(&call.path)
        .header("host", "forkvm")
        .header("content-length", call.body.len());
    if let Some(kind) = call.content_type {
        request = request.header("content-type", kind);
    }
    let request = request
        .body(Full::new(call.body.clone()))
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
