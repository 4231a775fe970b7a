//! A blocking client for the control socket, used by the `vmm` CLI subcommands and the
//! tests: one function per endpoint, taking and returning `api_types`.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use api_types::invoke::InvokeOptions;
use api_types::{
    Action, ActionType, CloneInfo, CloneList, CreateClones, CreateSnapshot, ErrorBody,
    SnapshotInfo, TargetState, VmInfo, VmUpdate,
};
use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::http::{read_response, HttpError, Response};

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
    /// The VMM refused or failed the request.
    #[error("error {status}: {message}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The VMM's message.
        message: String,
    },
    /// The answer was not what the API describes.
    #[error("unexpected answer ({status}): {reason}: {body}")]
    Decode {
        /// The HTTP status.
        status: u16,
        /// Why it did not decode.
        reason: String,
        /// The body.
        body: String,
    },
}

/// Sends one request and reads the answer, whatever its status.
pub fn request(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<&str>,
) -> Result<Response, ClientError> {
    let body = body.unwrap_or("").as_bytes();
    let json = Some("application/json");
    request_bytes(sock, method, path, json, body, Duration::from_secs(30))
}

/// Sends one request with a body of `content_type` and reads the answer within
/// `timeout`, whatever its status.
pub fn request_bytes(
    sock: &Path,
    method: &str,
    path: &str,
    content_type: Option<&str>,
    body: &[u8],
    timeout: Duration,
) -> Result<Response, ClientError> {
    let mut s = UnixStream::connect(sock).map_err(|source| ClientError::Connect {
        path: sock.display().to_string(),
        source,
    })?;
    s.set_read_timeout(Some(timeout)).map_err(HttpError::Io)?;
    s.set_write_timeout(Some(timeout)).map_err(HttpError::Io)?;
    let kind = content_type.map_or(String::new(), |k| format!("Content-Type: {k}\r\n"));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\n{kind}Content-Length: {}\r\n\r\n",
        body.len()
    );
    let sent = s
        .write_all(head.as_bytes())
        .and_then(|()| s.write_all(body));
    match sent {
        Ok(()) => Ok(read_response(&s)?),
        // The VMM answered without reading the whole body (413): its answer waits.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            read_response(&s).map_err(|_| HttpError::Io(e).into())
        }
        Err(e) => Err(HttpError::Io(e).into()),
    }
}

/// `POST /invocations`: runs the handler on `payload`; the answer, whatever its status
/// (its `x-forkvm-outcome` header says how the handler ended). Waits for the options'
/// timeout and 10 s more.
pub fn invoke(
    sock: &Path,
    options: &InvokeOptions,
    payload: &[u8],
) -> Result<Response, ClientError> {
    let query = serde_urlencoded::to_string(options).map_err(|e| ClientError::Decode {
        status: 0,
        reason: e.to_string(),
        body: String::new(),
    })?;
    let path = match query.as_str() {
        "" => "/invocations".to_string(),
        q => format!("/invocations?{q}"),
    };
    let wait = Duration::from_millis(options.timeout_ms()) + Duration::from_secs(10);
    let kind = Some("application/octet-stream");
    request_bytes(sock, "POST", &path, kind, payload, wait)
}

/// The answer's body as `T` if its status is a success, else the VMM's error.
fn decode<T: DeserializeOwned>(r: Response) -> Result<T, ClientError> {
    if !(200..300).contains(&r.status) {
        let message = serde_json::from_str::<ErrorBody>(&r.body).map_or(r.body, |e| e.error);
        return Err(ClientError::Refused {
            status: r.status,
            message,
        });
    }
    // No body (204) reads as JSON null.
    let text = if r.body.is_empty() { "null" } else { &r.body };
    serde_json::from_str(text).map_err(|e| ClientError::Decode {
        status: r.status,
        reason: e.to_string(),
        body: r.body.clone(),
    })
}

fn call<T: DeserializeOwned>(
    sock: &Path,
    method: &str,
    path: &str,
    body: Option<&impl Serialize>,
) -> Result<T, ClientError> {
    let text = body.map(|b| serde_json::to_string(b).expect("API bodies serialize"));
    decode(request(sock, method, path, text.as_deref())?)
}

const NO_BODY: Option<&()> = None;

/// `GET /vm`.
pub fn describe_vm(sock: &Path) -> Result<VmInfo, ClientError> {
    call(sock, "GET", "/vm", NO_BODY)
}

/// `PATCH /vm`: pause or resume.
pub fn set_state(sock: &Path, state: TargetState) -> Result<(), ClientError> {
    call(sock, "PATCH", "/vm", Some(&VmUpdate { state }))
}

/// `PUT /actions` shutdown.
pub fn shutdown(sock: &Path) -> Result<(), ClientError> {
    let action = Action {
        action_type: ActionType::Shutdown,
    };
    call(sock, "PUT", "/actions", Some(&action))
}

/// `POST /clones`.
pub fn create_clones(sock: &Path, request: &CreateClones) -> Result<CloneList, ClientError> {
    call(sock, "POST", "/clones", Some(request))
}

/// `GET /clones`.
pub fn list_clones(sock: &Path) -> Result<CloneList, ClientError> {
    call(sock, "GET", "/clones", NO_BODY)
}

/// `PUT /snapshot`: writes a snapshot of the paused VM to the new directory `dir`.
/// Waits as long as the VMM may take ([`api_types::snapshot::SNAPSHOT_TIMEOUT`]).
pub fn snapshot(sock: &Path, dir: &str) -> Result<SnapshotInfo, ClientError> {
    let body = serde_json::to_vec(&CreateSnapshot {
        dir: dir.to_string(),
    })
    .expect("API bodies serialize");
    let wait = api_types::snapshot::SNAPSHOT_TIMEOUT + Duration::from_secs(5);
    let json = Some("application/json");
    decode(request_bytes(sock, "PUT", "/snapshot", json, &body, wait)?)
}

/// `DELETE /clones/{id}`.
pub fn delete_clone(sock: &Path, id: &str) -> Result<CloneInfo, ClientError> {
    call(sock, "DELETE", &format!("/clones/{id}"), NO_BODY)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(status: u16, body: &str) -> Response {
        Response {
            status,
            body: body.into(),
            bytes: body.as_bytes().to_vec(),
            headers: Vec::new(),
        }
    }

    #[test]
    fn answers_decode_and_errors_carry_the_vmms_message() {
        let list: CloneList = decode(response(200, r#"{"clones":[]}"#)).unwrap();
        assert!(list.clones.is_empty());
        decode::<()>(response(204, "")).unwrap();
        match decode::<CloneList>(response(409, r#"{"error":"busy"}"#)) {
            Err(ClientError::Refused { status, message }) => {
                assert_eq!((status, message.as_str()), (409, "busy"))
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            decode::<CloneList>(response(200, r#"{"clones":7}"#)),
            Err(ClientError::Decode { status: 200, .. })
        ));
    }
}
