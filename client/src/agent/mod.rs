//! The guest agent: its protocol ([`wire`], both ends' framing, with no I/O) and a
//! blocking client of it (`vmm exec`: one command run in the guest through its vsock
//! device and `forkvm-agent`). The `forkvm` library's tokio client frames its requests
//! and reads its answers with [`wire`] too.
//!
//! The VM's vsock socket is found with `GET /vm` (docs/guest-abi.md).

pub mod wire;

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use api_types::vm::VirtioKind;
use wire::AgentProtocolError;

use crate::api::{self as client, ClientError};

pub use wire::ExecOutput;

/// Errors running a command in the guest.
#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    /// The control socket did not answer.
    #[error(transparent)]
    Api(#[from] ClientError),
    /// The VM has no vsock device.
    #[error("the VM has no vsock device (start it with --vsock PATH)")]
    NoVsock,
    /// The vsock socket could not be reached.
    #[error("cannot connect to the VM's vsock socket {path}: {source}")]
    Connect {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Nothing in the guest accepted on the port.
    #[error("nothing in the guest accepted on vsock port {0} (is forkvm-agent running? forkvm.agent={0} on the kernel command line starts it)")]
    Refused(u32),
    /// The exchange broke off or timed out.
    #[error("vsock exchange failed: {0}")]
    Io(#[from] std::io::Error),
    /// The answer was not in the agent's protocol.
    #[error(transparent)]
    Protocol(#[from] AgentProtocolError),
}

/// The host path of the VM's vsock socket, from `GET /vm`.
pub fn vsock_path(api_sock: &Path) -> Result<PathBuf, ExecError> {
    let vm = client::describe_vm(api_sock)?;
    vm.devices
        .into_iter()
        .find_map(|d| match d.kind {
            VirtioKind::Vsock { uds_path, .. } => Some(uds_path),
            _ => None,
        })
        .ok_or(ExecError::NoVsock)
}

/// Runs `command` (a shell command line) in the guest of the VM at `api_sock` through
/// the agent on vsock `port`, with `stdin` as its input.
pub fn exec(
    api_sock: &Path,
    port: u32,
    command: &str,
    stdin: &[u8],
    timeout: Duration,
) -> Result<ExecOutput, ExecError> {
    let path = vsock_path(api_sock)?;
    exec_at(&path, port, command, stdin, timeout)
}

/// As [`exec`], given the vsock socket path.
pub fn exec_at(
    vsock: &Path,
    port: u32,
    command: &str,
    stdin: &[u8],
    timeout: Duration,
) -> Result<ExecOutput, ExecError> {
    let mut s = UnixStream::connect(vsock).map_err(|source| ExecError::Connect {
        path: vsock.display().to_string(),
        source,
    })?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    s.write_all(wire::connect_line(port).as_bytes())?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(ExecError::Refused(port));
    }
    wire::accepted(&line)?;
    s.write_all(wire::request_head(command, stdin).as_bytes())?;
    s.write_all(command.as_bytes())?;
    s.write_all(stdin)?;
    line.clear();
    r.read_line(&mut line)?;
    let (status, len) = wire::parse_answer_head(&line)?;
    let mut output = vec![0u8; len as usize];
    r.read_exact(&mut output)?;
    Ok(ExecOutput { status, output })
}
