//! The tokio client of the guest agent (its framing is `forkvm_client::agent::wire`,
//! docs/guest-abi.md): one command answered at its end ([`agent_exchange`]), or a process whose
//! output streams and which takes signals ([`AgentProcess`]).

use std::path::{Path, PathBuf};

pub use forkvm_client::agent::wire::StreamMode;
use forkvm_client::agent::wire::{self, ExecOutput, Frame};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

use crate::Error;

fn socket_error(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Socket {
        path: path.to_path_buf(),
        source,
    }
}

fn protocol_error(e: wire::AgentProtocolError) -> Error {
    Error::Agent(e.to_string())
}

/// Connects to guest port `port` through the vsock device's host socket `vsock` and
/// sends the request: `head`, the command and its input.
async fn request(
    vsock: &Path,
    port: u32,
    head: &str,
    command: &str,
    stdin: &[u8],
) -> Result<(BufReader<OwnedReadHalf>, OwnedWriteHalf), Error> {
    let io = socket_error(vsock);
    let stream = UnixStream::connect(vsock).await.map_err(&io)?;
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    write
        .write_all(wire::connect_line(port).as_bytes())
        .await
        .map_err(&io)?;
    let mut line = String::new();
    if read.read_line(&mut line).await.map_err(&io)? == 0 {
        return Err(Error::Agent(format!(
            "nothing in the guest accepted on vsock port {port} (is forkvm-agent running?)"
        )));
    }
    wire::accepted(&line).map_err(protocol_error)?;
    for part in [head.as_bytes(), command.as_bytes(), stdin] {
        write.write_all(part).await.map_err(&io)?;
    }
    Ok((read, write))
}

/// Runs `command` with `stdin` through the agent on `port` and reads its answer.
pub(crate) async fn agent_exchange(
    vsock: &Path,
    port: u32,
    command: &str,
    stdin: &[u8],
) -> Result<ExecOutput, Error> {
    let head = wire::request_head(command, stdin);
    let (mut read, _write) = request(vsock, port, &head, command, stdin).await?;
    let io = socket_error(vsock);
    let mut line = String::new();
    read.read_line(&mut line).await.map_err(&io)?;
    let (status, len) = wire::parse_answer_head(&line).map_err(protocol_error)?;
    let mut output = vec![0u8; len as usize];
    read.read_exact(&mut output).await.map_err(io)?;
    Ok(ExecOutput { status, output })
}

/// What a streaming command did next ([`AgentOutput::next`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum ProcessEvent {
    /// It wrote this to its stdout.
    Stdout(Vec<u8>),
    /// It wrote this to its stderr.
    Stderr(Vec<u8>),
    /// It ended with this status (128+N when killed by signal N; 255 when the agent
    /// could not run it). Nothing follows.
    Exit(i32),
}

/// A command running in a clone through its agent, streaming
/// ([`crate::VmClone::spawn`]): read its output with [`AgentProcess::output`], send it
/// signals with [`AgentProcess::control`]. The two halves may be split up and moved
/// apart; **dropping the control half kills the command** (its whole process group in
/// the guest): the agent takes a closed connection for a client that has gone.
#[derive(Debug)]
pub struct AgentProcess {
    /// Its output and its end.
    pub output: AgentOutput,
    /// Its signals.
    pub control: AgentControl,
}

/// The output half of an [`AgentProcess`].
#[derive(Debug)]
pub struct AgentOutput {
    read: BufReader<OwnedReadHalf>,
    vsock: PathBuf,
    ended: bool,
}

/// The control half of an [`AgentProcess`]: dropping it kills the command.
#[derive(Debug)]
pub struct AgentControl {
    write: OwnedWriteHalf,
    vsock: PathBuf,
}

impl AgentProcess {
    /// Starts the program `argv` with `stdin` through the agent on `port` (the vsock
    /// device's host socket `vsock`).
    pub(crate) async fn start(
        vsock: &Path,
        port: u32,
        argv: &[String],
        stdin: &[u8],
        mode: StreamMode,
    ) -> Result<Self, Error> {
        let command = wire::argv_command(argv).map_err(|e| Error::Command(e.to_string()))?;
        let head = wire::stream_request_head(&command, stdin, mode);
        let (read, write) = request(vsock, port, &head, &command, stdin).await?;
        Ok(Self {
            output: AgentOutput {
                read,
                vsock: vsock.to_path_buf(),
                ended: false,
            },
            control: AgentControl {
                write,
                vsock: vsock.to_path_buf(),
            },
        })
    }
}

impl AgentOutput {
    /// What the command did next: a piece of its output, or its end. After its end
    /// (or an error), `None`.
    pub async fn next(&mut self) -> Option<Result<ProcessEvent, Error>> {
        if self.ended {
            return None;
        }
        let r = self.read_event().await;
        self.ended = !matches!(r, Ok(ProcessEvent::Stdout(_)) | Ok(ProcessEvent::Stderr(_)));
        Some(r)
    }

    /// Waits, after the command's end, until the agent closes the connection: the
    /// guest process that served it has ended (its files closed at its exit). What
    /// comes before the close is dropped.
    pub async fn closed(&mut self) -> Result<(), Error> {
        let mut rest = Vec::new();
        let read = self.read.read_to_end(&mut rest).await;
        read.map_err(socket_error(&self.vsock))?;
        self.ended = true;
        Ok(())
    }

    async fn read_event(&mut self) -> Result<ProcessEvent, Error> {
        let io = socket_error(&self.vsock);
        let mut line = String::new();
        if self.read.read_line(&mut line).await.map_err(&io)? == 0 {
            return Err(Error::Agent(
                "the guest agent closed the connection before the command's end (the VM \
                 stopped?)"
                    .into(),
            ));
        }
        let (len, stdout) = match wire::parse_frame_head(&line).map_err(protocol_error)? {
            Frame::Exit(status) => return Ok(ProcessEvent::Exit(status)),
            Frame::Stdout(len) => (len, true),
            Frame::Stderr(len) => (len, false),
        };
        let mut bytes = vec![0u8; len as usize];
        self.read.read_exact(&mut bytes).await.map_err(io)?;
        Ok(match stdout {
            true => ProcessEvent::Stdout(bytes),
            false => ProcessEvent::Stderr(bytes),
        })
    }
}

impl AgentControl {
    /// Sends signal `signal` to the command's process group in the guest. Once the
    /// command has ended (or the VM has), an error.
    pub async fn signal(&mut self, signal: u32) -> Result<(), Error> {
        let line = wire::signal_line(signal);
        (self.write.write_all(line.as_bytes()).await).map_err(socket_error(&self.vsock))
    }

    /// Feeds `bytes` to the command's input (one started with [`StreamMode::stdin`] or
    /// [`StreamMode::tty`]; otherwise the agent drops them). Waits while the command
    /// has not taken what came before.
    pub async fn write_input(&mut self, bytes: &[u8]) -> Result<(), Error> {
        let io = socket_error(&self.vsock);
        for chunk in bytes.chunks(wire::MAX_INPUT_FRAME) {
            let head = wire::input_head(chunk.len());
            self.write.write_all(head.as_bytes()).await.map_err(&io)?;
            self.write.write_all(chunk).await.map_err(&io)?;
        }
        Ok(())
    }

    /// Ends the command's input (on a terminal: types its end-of-file character).
    pub async fn close_input(&mut self) -> Result<(), Error> {
        let eof = wire::EOF_LINE.as_bytes();
        (self.write.write_all(eof).await).map_err(socket_error(&self.vsock))
    }

    /// Sets the command's terminal to `rows` by `cols` (a command started with
    /// [`StreamMode::tty`]).
    pub async fn resize(&mut self, rows: u16, cols: u16) -> Result<(), Error> {
        let line = wire::winch_line(rows, cols);
        (self.write.write_all(line.as_bytes()).await).map_err(socket_error(&self.vsock))
    }
}
