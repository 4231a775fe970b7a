//! The guest agent's protocol (`forkvm-agent`, docs/guest-abi.md), written once for
//! every client (`vmm exec`, the `forkvm` library's `VmClone::exec`): the framing only,
//! each client doing its own I/O, blocking or async.
//!
//! 1. The client connects to the VM's vsock socket and writes [`connect_line`]; the
//!    device answers `OK <host port>\n` ([`accepted`]) once something in the guest
//!    accepted on the port, or closes the connection.
//! 2. The client writes [`request_head`], the command line and its input.
//! 3. The agent runs the command and answers `<status> <output length>\n`
//!    ([`parse_answer_head`]) and the output (stdout and stderr, interleaved).

/// The most output a client takes from one command.
pub const MAX_OUTPUT: u64 = 64 << 20;

/// What a command run through the agent did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecOutput {
    /// Its exit status (128+N when killed by signal N; 255 when the agent could not run
    /// it).
    pub status: i32,
    /// Its stdout and stderr, interleaved as written.
    pub output: Vec<u8>,
}

/// An answer outside the protocol.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AgentProtocolError {
    /// The device's answer to the connect line was not `OK <port>`.
    #[error("the vsock device answered {0:?}, not OK <port>")]
    NotAccepted(String),
    /// The agent's answer head was not `<status> <length>`.
    #[error("unexpected answer from the guest agent: {0:?}")]
    BadHead(String),
    /// The output is longer than a client takes.
    #[error("an output of {0} bytes (most taken: {MAX_OUTPUT})")]
    TooLong(u64),
}

/// What the client writes first: which guest port to reach.
pub fn connect_line(port: u32) -> String {
    format!("CONNECT {port}\n")
}

/// Whether the device's answer to the connect line says the guest accepted.
pub fn accepted(line: &str) -> Result<(), AgentProtocolError> {
    match line.starts_with("OK ") {
        true => Ok(()),
        false => Err(AgentProtocolError::NotAccepted(line.to_string())),
    }
}

/// The request's first line, before the command and the input.
pub fn request_head(command: &str, stdin: &[u8]) -> String {
    format!("{} {}\n", command.len(), stdin.len())
}

/// The agent's answer head: the exit status and the output's length (at most
/// [`MAX_OUTPUT`]).
pub fn parse_answer_head(line: &str) -> Result<(i32, u64), AgentProtocolError> {
    let mut fields = line.split_whitespace().map(str::parse::<i64>);
    let (Some(Ok(status)), Some(Ok(len)), None) = (fields.next(), fields.next(), fields.next())
    else {
        return Err(AgentProtocolError::BadHead(line.to_string()));
    };
    let (Ok(status), Ok(len)) = (i32::try_from(status), u64::try_from(len)) else {
        return Err(AgentProtocolError::BadHead(line.to_string()));
    };
    if len > MAX_OUTPUT {
        return Err(AgentProtocolError::TooLong(len));
    }
    Ok((status, len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_framing_reads_what_it_writes_and_refuses_the_rest() {
        assert_eq!(connect_line(1024), "CONNECT 1024\n");
        assert_eq!(accepted("OK 1073741824\n"), Ok(()));
        assert!(accepted("").is_err() && accepted("NO\n").is_err());
        assert_eq!(request_head("uname -a", b"in"), "8 2\n");
        assert_eq!(parse_answer_head("0 12\n"), Ok((0, 12)));
        assert_eq!(parse_answer_head("137 0\n"), Ok((137, 0)));
        for bad in ["", "0\n", "0 1 2\n", "x 1\n", "0 -1\n", "99999999999 0\n"] {
            assert!(parse_answer_head(bad).is_err(), "{bad:?}");
        }
        let over = format!("0 {}\n", MAX_OUTPUT + 1);
        assert_eq!(
            parse_answer_head(&over),
            Err(AgentProtocolError::TooLong(MAX_OUTPUT + 1))
        );
    }
}
