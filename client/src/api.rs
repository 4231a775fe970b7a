//! A blocking client for the control socket, used by the `vmm` CLI subcommands and the
//! tests: one function per endpoint, taking and returning `api_types`.

use std::io::Write;
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use api_types::invoke::InvokeOptions;
use api_types::{
    CloneInfo, CloneList, CreateClones, SlotMedium, SnapshotInfo, TargetState, VmInfo,
};

use bytes::Bytes;

use crate::call::{self, Answer, Call, CallError};
use crate::http::{read_response, HttpError, Response};

/// How long a call may take unless it says it takes longer ([`Call::limit`]).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(30);

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
    /// The VMM refused or failed the request, or answered what the API does not
    /// describe.
    #[error(transparent)]
    Call(#[from] CallError),
}

impl From<Response> for Answer {
    fn from(r: Response) -> Self {
        Self {
            status: r.status,
            headers: r.headers,
            body: r.bytes.into(),
        }
    }
}

/// Sends `call` and reads the answer within its limit, whatever its status.
pub fn exchange<T>(sock: &Path, call: &Call<T>) -> Result<Response, ClientError> {
    let mut s = UnixStream::connect(sock).map_err(|source| ClientError::Connect {
        path: sock.display().to_string(),
        source,
    })?;
    let timeout = call.limit(CALL_TIMEOUT);
    s.set_read_timeout(Some(timeout)).map_err(HttpError::Io)?;
    s.set_write_timeout(Some(timeout)).map_err(HttpError::Io)?;
    let head =
        crate::http::request_head(call.method, &call.path, call.content_type, call.body.len());
    let sent = s
        .write_all(head.as_bytes())
        .and_then(|()| s.write_all(&call.body));
    match sent {
        Ok(()) => Ok(read_response(&s)?),
        // The VMM answered without reading the whole body (413): its answer waits.
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => {
            read_response(&s).map_err(|_| HttpError::Io(e).into())
        }
        Err(e) => Err(HttpError::Io(e).into()),
    }
}

/// Sends `call` and decodes its answer.
pub fn send<T>(sock: &Path, call: Call<T>) -> Result<T, ClientError> {
    let answer = exchange(sock, &call)?;
    Ok(call.decode(answer.into())?)
}

/// `POST /invocations`: runs the handler on `payload`; the answer, whatever its status
/// (its `x-forkvm-outcome` header says how the handler ended). Waits for the options'
/// timeout and [`CALL_TIMEOUT`] more.
pub fn invoke(
    sock: &Path,
    options: &InvokeOptions,
    payload: &[u8],
) -> Result<Response, ClientError> {
    exchange(
        sock,
        &call::invoke(options, Bytes::copy_from_slice(payload)),
    )
}

/// `GET /vm`.
pub fn describe_vm(sock: &Path) -> Result<VmInfo, ClientError> {
    send(sock, call::describe_vm())
}

/// `PATCH /vm`: pause or resume.
pub fn set_state(sock: &Path, state: TargetState) -> Result<(), ClientError> {
    send(sock, call::set_state(state))
}

/// `PUT /actions` shutdown.
pub fn shutdown(sock: &Path) -> Result<(), ClientError> {
    send(sock, call::shutdown())
}

/// `POST /clones`.
pub fn create_clones(sock: &Path, request: &CreateClones) -> Result<CloneList, ClientError> {
    send(sock, call::create_clones(request))
}

/// `GET /clones`.
pub fn list_clones(sock: &Path) -> Result<CloneList, ClientError> {
    send(sock, call::list_clones())
}

/// `PUT /snapshot`: writes a snapshot of the paused VM to the new directory `dir`.
/// Waits as long as the VMM may take ([`api_types::snapshot::SNAPSHOT_TIMEOUT`]) and
/// [`CALL_TIMEOUT`] more.
pub fn snapshot(sock: &Path, dir: &str) -> Result<SnapshotInfo, ClientError> {
    send(sock, call::snapshot(dir))
}

/// `DELETE /clones/{id}`.
pub fn delete_clone(sock: &Path, id: &str) -> Result<CloneInfo, ClientError> {
    send(sock, call::delete_clone(id))
}

/// `PUT /slots/{slot}`: inserts `medium` into the running VM's disk slot.
pub fn insert_medium(sock: &Path, slot: u8, medium: &SlotMedium) -> Result<(), ClientError> {
    send(sock, call::insert_medium(slot, medium))
}

/// `DELETE /slots/{slot}`: ejects the slot's medium.
pub fn eject_medium(sock: &Path, slot: u8) -> Result<(), ClientError> {
    send(sock, call::eject_medium(slot))
}
