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
//!
//! Streaming instead ([`stream_request_head`]): the agent sends the command's output as
//! it comes, each piece a frame ([`parse_frame_head`]: `out <len>\n` or `err <len>\n`
//! and the bytes), then `exit <status>\n` and closes; the client may send
//! [`signal_line`] meanwhile, and closing its side kills the command.

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
    /// The output (or one frame of it) is longer than a client takes.
    #[error("an output of {0} bytes (more than a client takes)")]
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

/// Why an argv cannot be a streaming request's command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ArgvError {
    /// No words.
    #[error("no program")]
    Empty,
    /// A word holds a NUL byte, which ends words in the request.
    #[error("a word holds a NUL byte")]
    Nul,
}

/// A streaming request's command: the program's words, each ended by a NUL byte.
pub fn argv_command(argv: &[String]) -> Result<String, ArgvError> {
    if argv.is_empty() {
        return Err(ArgvError::Empty);
    }
    let mut command = String::new();
    for word in argv {
        if word.contains('\0') {
            return Err(ArgvError::Nul);
        }
        command.push_str(word);
        command.push('\0');
    }
    Ok(command)
}

/// How a streamed command takes its input, and whether it has a terminal.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StreamMode {
    /// Its stdin is fed by the client while it runs ([`input_head`], [`EOF_LINE`]).
    pub stdin: bool,
    /// It runs on a new pseudo-terminal in the guest: its output comes as stdout
    /// frames, input is typed on it, [`winch_line`] sets its size.
    pub tty: bool,
}

/// The first line of a streaming request (the command, [`argv_command`], and its
/// input follow): its input is `stdin`, unless `mode` has the client feed it or run
/// the command on a terminal (then `stdin` must be empty).
pub fn stream_request_head(command: &str, stdin: &[u8], mode: StreamMode) -> String {
    let fed = if mode.stdin { " stdin" } else { "" };
    let tty = if mode.tty { " tty" } else { "" };
    format!("{} {} stream{fed}{tty}\n", command.len(), stdin.len())
}

/// The most bytes one input frame carries.
pub const MAX_INPUT_FRAME: usize = 65536;

/// The head of an input frame of `len` bytes (at most [`MAX_INPUT_FRAME`]); the bytes
/// follow.
pub fn input_head(len: usize) -> String {
    format!("in {len}\n")
}

/// Ends the command's input (on a terminal: types its end-of-file character).
pub const EOF_LINE: &str = "eof\n";

/// Sets the command's terminal to `rows` by `cols`.
pub fn winch_line(rows: u16, cols: u16) -> String {
    format!("winch {rows} {cols}\n")
}

/// What a streaming client sends to have signal `signal` delivered to the command's
/// process group.
pub fn signal_line(signal: u32) -> String {
    format!("sig {signal}\n")
}

/// The most bytes one output frame of a streaming answer carries.
pub const MAX_FRAME: u64 = 1 << 20;

/// The head of one frame of a streaming answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Frame {
    /// `len` bytes of the command's stdout follow.
    Stdout(u64),
    /// `len` bytes of its stderr follow.
    Stderr(u64),
    /// The command ended with this status (128+N when killed by signal N; 255 when the
    /// agent could not run it); the answer ends.
    Exit(i32),
}

/// A streaming answer's frame head (the line, newline or not).
pub fn parse_frame_head(line: &str) -> Result<Frame, AgentProtocolError> {
    let bad = || AgentProtocolError::BadHead(line.to_string());
    let mut fields = line.split_whitespace();
    let (Some(kind), Some(value), None) = (fields.next(), fields.next(), fields.next()) else {
        return Err(bad());
    };
    let len = || match value.parse::<u64>() {
        Ok(n) if n <= MAX_FRAME => Ok(n),
        Ok(n) => Err(AgentProtocolError::TooLong(n)),
        Err(_) => Err(bad()),
    };
    match kind {
        "out" => Ok(Frame::Stdout(len()?)),
        "err" => Ok(Frame::Stderr(len()?)),
        "exit" => value.parse().map(Frame::Exit).map_err(|_| bad()),
        _ => Err(bad()),
    }
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
        let mode = |stdin, tty| StreamMode { stdin, tty };
        assert_eq!(
            stream_request_head("ls", b"", mode(false, false)),
            "2 0 stream\n"
        );
        assert_eq!(
            stream_request_head("ls", b"hi", mode(false, false)),
            "2 2 stream\n"
        );
        assert_eq!(
            stream_request_head("ls", b"", mode(true, false)),
            "2 0 stream stdin\n"
        );
        assert_eq!(
            stream_request_head("ls", b"", mode(true, true)),
            "2 0 stream stdin tty\n"
        );
        assert_eq!(
            stream_request_head("ls", b"", mode(false, true)),
            "2 0 stream tty\n"
        );
        assert_eq!(
            (input_head(5), winch_line(24, 80)),
            ("in 5\n".into(), "winch 24 80\n".into())
        );
        let argv = |w: &[&str]| w.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(
            argv_command(&argv(&["ls", "-l", ""])),
            Ok("ls\0-l\0\0".into())
        );
        assert_eq!(argv_command(&[]), Err(ArgvError::Empty));
        assert_eq!(argv_command(&argv(&["a\0b"])), Err(ArgvError::Nul));
        assert_eq!(signal_line(15), "sig 15\n");
        assert_eq!(parse_frame_head("out 12\n"), Ok(Frame::Stdout(12)));
        assert_eq!(parse_frame_head("err 0"), Ok(Frame::Stderr(0)));
        assert_eq!(parse_frame_head("exit 137\n"), Ok(Frame::Exit(137)));
        for bad in ["", "out\n", "out -1\n", "in 3\n", "exit x\n", "out 1 2\n"] {
            assert!(parse_frame_head(bad).is_err(), "{bad:?}");
        }
        assert!(parse_frame_head(&format!("out {}", MAX_FRAME + 1)).is_err());
        let over = format!("0 {}\n", MAX_OUTPUT + 1);
        assert_eq!(
            parse_answer_head(&over),
            Err(AgentProtocolError::TooLong(MAX_OUTPUT + 1))
        );
    }
}
