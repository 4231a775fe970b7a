//! `vmm exec`: run a command in the guest through its vsock device and `forkvm-agent`.
//!
//! The VM's vsock socket is found with `GET /vm`; the exchange is the agent's protocol
//! (docs/guest-abi.md): `CONNECT <port>\n` to the device, then `<cmdlen> <stdinlen>\n`,
//! the command and the input; the agent answers `<status> <outlen>\n` and the output.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use api_types::vm::VirtioKind;

use super::client::{self, ClientError};

/// What the command did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Exit status (128+N when killed by signal N; 255 when the agent could not run it).
    pub status: i32,
    /// stdout and stderr, interleaved as written.
    pub output: Vec<u8>,
}

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
    /// The agent's answer was not in its protocol.
    #[error("unexpected answer from the guest agent: {0:?}")]
    Protocol(String),
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
    s.write_all(format!("CONNECT {port}\n").as_bytes())?;
    let mut r = BufReader::new(s.try_clone()?);
    let mut line = String::new();
    if r.read_line(&mut line)? == 0 {
        return Err(ExecError::Refused(port));
    }
    if !line.starts_with("OK ") {
        return Err(ExecError::Protocol(line));
    }
    s.write_all(format!("{} {}\n", command.len(), stdin.len()).as_bytes())?;
    s.write_all(command.as_bytes())?;
    s.write_all(stdin)?;
    line.clear();
    r.read_line(&mut line)?;
    let mut fields = line.split_whitespace().map(str::parse::<u64>);
    let (Some(Ok(status)), Some(Ok(len)), None) = (fields.next(), fields.next(), fields.next())
    else {
        return Err(ExecError::Protocol(line));
    };
    let mut output = vec![0u8; len as usize];
    r.read_exact(&mut output)?;
    Ok(ExecOutput {
        status: status as i32,
        output,
    })
}
