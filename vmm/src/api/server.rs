//! The API thread: accepts connections on the control socket and relays requests.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::Duration;

use super::http::{read_request_within, write_response, BodyLimits, HttpError};
use super::{reply, route, ApiReply};
use crate::gate::Pass;
use crate::rpc::{ActionSender, VmmAction, VmmData};

/// Errors starting the API server.
#[derive(Debug, thiserror::Error)]
pub enum ApiServerError {
    /// Another process is serving on this path.
    #[error("control socket {0} is in use by another process")]
    InUse(String),
    /// The path exists and is not a socket; it is left alone.
    #[error("control socket path {0} exists and is not a socket")]
    NotASocket(String),
    /// Binding or spawning failed.
    #[error("cannot serve on control socket {path}: {source}")]
    Bind {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
}

/// How long the API thread waits for the VMM to answer one request.
const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a client may take to send its request.
const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

/// The running API server. Dropping it stops the thread and removes the socket.
pub struct ApiServer {
    path: PathBuf,
    listener_fd: i32,
    thread: Option<JoinHandle<()>>,
}

fn bind(path: &Path) -> Result<UnixListener, ApiServerError> {
    let shown = path.display().to_string();
    if let Ok(meta) = std::fs::symlink_metadata(path) {
        if !meta.file_type().is_socket() {
            return Err(ApiServerError::NotASocket(shown));
        }
        if UnixStream::connect(path).is_ok() {
            return Err(ApiServerError::InUse(shown));
        }
        // A stale socket left by a VMM that died: safe to replace.
        let _ = std::fs::remove_file(path);
    }
    UnixListener::bind(path).map_err(|source| ApiServerError::Bind {
        path: shown,
        source,
    })
}

impl ApiServer {
    /// Binds `path` and starts the API thread, which queues each request's action on
    /// `actions`; bodies within `limits`.
    pub fn start(
        path: &Path,
        actions: ActionSender,
        limits: BodyLimits,
    ) -> Result<Self, ApiServerError> {
        let err = |source| ApiServerError::Bind {
            path: path.display().to_string(),
            source,
        };
        let listener = bind(path)?;
        let listener_fd = listener.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("api".into())
            .spawn(
                move || match crate::sandbox::enter(crate::sandbox::ThreadKind::Api) {
                    Ok(()) => serve(listener, &actions, &limits),
                    Err(e) => tracing::error!("API thread: {e}; the control socket is not served"),
                },
            )
            .map_err(err)?;
        Ok(Self {
            path: path.to_path_buf(),
            listener_fd,
            thread: Some(thread),
        })
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        // SAFETY: the listener fd is owned by the API thread, which is still running (we
        // join it below); shutdown() only wakes its accept() with an error.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        // The event loop dropped its end of the action queue before (refusing what was
        // queued), so the thread is not waiting out ANSWER_TIMEOUT.
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(listener: UnixListener, actions: &ActionSender, limits: &BodyLimits) {
    // Blocked in accept() without a pass: a clone may be forked meanwhile (see
    // `cloning::gate`).
    for conn in listener.incoming() {
        // Held from here to the end of the connection, but for its blocking calls.
        let pass = RefCell::new(Pass::take());
        match conn {
            Ok(stream) => {
                if let Err(e) = handle(stream, actions, &pass, limits) {
                    tracing::debug!("API connection: {e}");
                }
            }
            // shutdown() from Drop ends accept() with EINVAL: stop serving.
            Err(e) if e.raw_os_error() == Some(libc::EINVAL) => break,
            Err(e) => {
                tracing::warn!("API accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// The connection's stream, read and written without the thread's pass (a client may
/// take its time; a fork must not wait for it). Everything else the API thread does
/// holds the pass.
#[derive(Clone, Copy)]
struct Gated<'a> {
    stream: &'a UnixStream,
    pass: &'a RefCell<Pass>,
}

impl Read for Gated<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let mut s = self.stream;
        self.pass.borrow_mut().released(|| s.read(buf))
    }
}

impl Write for Gated<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let mut s = self.stream;
        self.pass.borrow_mut().released(|| s.write(buf))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn handle(
    stream: UnixStream,
    actions: &ActionSender,
    pass: &RefCell<Pass>,
    limits: &BodyLimits,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let io = Gated {
        stream: &stream,
        pass,
    };
    let reply = match read_request_within(io, limits) {
        Ok(mut req) => {
            if req.path == "/invocations" {
                // The VM that runs the handler answers on its own copy.
                req.conn = Some(crate::invoke::Connection::new(stream.try_clone()?));
            }
            match route(req) {
                Ok(action) => match relay(action, actions, pass) {
                    Some(reply) => reply,
                    None => return Ok(()),
                },
                Err(reply) => reply,
            }
        }
        Err(HttpError::TooLarge(m)) => {
            let reply = ApiReply::error(413, m);
            write_response(io, reply.status, reply.body.as_deref())?;
            // The client may still be sending the body: closing with it unread would
            // reset the connection before the client reads the answer.
            stream.shutdown(std::net::Shutdown::Write)?;
            drain(io);
            return Ok(());
        }
        Err(HttpError::Malformed(m)) => ApiReply::error(400, m),
        Err(HttpError::Io(e)) => return Err(e),
    };
    write_response(io, reply.status, reply.body.as_deref())
}

/// Most a refused body is read for, and for how long, before the connection is closed.
const DRAIN_BYTES: usize = 256 << 20;
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// Reads and drops what the client still sends, within [`DRAIN_BYTES`] and
/// [`DRAIN_TIME`].
fn drain(mut io: Gated<'_>) {
    let start = std::time::Instant::now();
    let mut buf = [0u8; 16 * 1024];
    let mut read = 0;
    while read < DRAIN_BYTES && start.elapsed() < DRAIN_TIME {
        match io.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => read += n,
        }
    }
}

/// Queues `action` for the event loop and waits for its answer; None when another VM
/// answers the caller (an invocation on its way).
fn relay(action: VmmAction, actions: &ActionSender, pass: &RefCell<Pass>) -> Option<ApiReply> {
    let answer = actions.send(action);
    // The main thread answers, and may fork meanwhile: wait without the pass.
    match pass.borrow_mut().released(|| answer.wait(ANSWER_TIMEOUT)) {
        Some(Ok(VmmData::Invoked)) => None,
        Some(response) => Some(reply(response)),
        None => Some(ApiReply::error(503, "the VMM did not answer in time")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stopping_the_vmm_answers_a_queued_request() {
        let dir = std::env::temp_dir().join(format!("forkvm-api-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("api.sock");
        let (tx, actions) = crate::rpc::channel().unwrap();
        let server = ApiServer::start(&path, tx, BodyLimits::default()).unwrap();
        let client = {
            let path = path.clone();
            std::thread::spawn(move || {
                let mut s = UnixStream::connect(&path).unwrap();
                s.write_all(b"GET /vm HTTP/1.1\r\n\r\n").unwrap();
                let mut answer = String::new();
                s.read_to_string(&mut answer).unwrap();
                answer
            })
        };
        // Queued (the API thread signals each request), never taken by a VMM.
        while actions.evt().read().is_err() {
            std::thread::sleep(Duration::from_millis(1));
        }
        // The event loop ends: its end of the queue goes first, then the server.
        drop(actions);
        drop(server);
        let answer = client.join().unwrap();
        // Not "did not answer in time" (after ANSWER_TIMEOUT).
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("shutting down"), "{answer}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
