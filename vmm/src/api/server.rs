//! The API thread: accepts connections on the control socket and relays requests.

use std::cell::RefCell;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::http::{read_request, write_response, HttpError};
use super::{route, ApiReply, ApiRequest};
use crate::cloning::gate::Pass;

/// A request with the slot its answer goes back in.
pub type PendingRequest = (ApiRequest, Replier);

/// Where the VMM leaves its answer to one request. The API thread waits on it without
/// allocating (a channel's receiver allocates as it starts to wait), so that it never
/// is inside malloc while a clone may be forked (see `cloning::gate`).
pub struct Replier(Arc<(Mutex<Option<ApiReply>>, Condvar)>);

impl Replier {
    /// Hands the answer to the waiting API thread (dropped if it gave up waiting); the
    /// thread is woken as `self` drops.
    pub fn send(self, reply: ApiReply) {
        *self.0 .0.lock().unwrap_or_else(|p| p.into_inner()) = Some(reply);
    }
}

impl Drop for Replier {
    /// Wakes the waiting API thread. A request dropped unanswered (the VMM stopped with
    /// it queued, or it could not be queued) is answered at once, so its client and the
    /// API thread do not wait out the timeout.
    fn drop(&mut self) {
        let (slot, ready) = &*self.0;
        let mut answer = slot.lock().unwrap_or_else(|p| p.into_inner());
        if answer.is_none() {
            *answer = Some(ApiReply::error(503, "the VMM is shutting down"));
        }
        ready.notify_one();
    }
}

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
    /// Written once per request queued on `requests`.
    pub evt: EventFd,
    /// Requests for the VMM to answer.
    pub requests: Receiver<PendingRequest>,
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
    /// Binds `path` and starts the API thread.
    pub fn start(path: &Path) -> Result<Self, ApiServerError> {
        let err = |source| ApiServerError::Bind {
            path: path.display().to_string(),
            source,
        };
        let listener = bind(path)?;
        let evt = EventFd::new(EFD_NONBLOCK).map_err(err)?;
        let thread_evt = evt.try_clone().map_err(err)?;
        let (tx, rx) = channel();
        let listener_fd = listener.as_raw_fd();
        let thread = std::thread::Builder::new()
            .name("api".into())
            .spawn(
                move || match crate::sandbox::enter(crate::sandbox::ThreadKind::Api) {
                    Ok(()) => serve(listener, tx, thread_evt),
                    Err(e) => tracing::error!("API thread: {e}; the control socket is not served"),
                },
            )
            .map_err(err)?;
        Ok(Self {
            path: path.to_path_buf(),
            listener_fd,
            thread: Some(thread),
            evt,
            requests: rx,
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
        // Requests queued now will not be answered: dropping the receiver drops them (each
        // answered "shutting down" by its Replier) and refuses any sent later, so the
        // thread ends at once instead of waiting out ANSWER_TIMEOUT.
        drop(std::mem::replace(&mut self.requests, channel().1));
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

fn serve(listener: UnixListener, tx: Sender<PendingRequest>, evt: EventFd) {
    // Blocked in accept() without a pass: a clone may be forked meanwhile (see
    // `cloning::gate`).
    for conn in listener.incoming() {
        // Held from here to the end of the connection, but for its blocking calls.
        let pass = RefCell::new(Pass::take());
        match conn {
            Ok(stream) => {
                if let Err(e) = handle(stream, &tx, &evt, &pass) {
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
    tx: &Sender<PendingRequest>,
    evt: &EventFd,
    pass: &RefCell<Pass>,
) -> std::io::Result<()> {
    stream.set_read_timeout(Some(CLIENT_TIMEOUT))?;
    stream.set_write_timeout(Some(CLIENT_TIMEOUT))?;
    let io = Gated {
        stream: &stream,
        pass,
    };
    let reply = match read_request(io) {
        Ok(req) => match route(&req) {
            Ok(api_req) => relay(api_req, tx, evt, pass),
            Err(reply) => reply,
        },
        Err(HttpError::TooLarge(m)) => ApiReply::error(413, m),
        Err(HttpError::Malformed(m)) => ApiReply::error(400, m),
        Err(HttpError::Io(e)) => return Err(e),
    };
    write_response(io, reply.status, reply.body.as_deref())
}

fn relay(
    req: ApiRequest,
    tx: &Sender<PendingRequest>,
    evt: &EventFd,
    pass: &RefCell<Pass>,
) -> ApiReply {
    let answer = Arc::new((Mutex::new(None), Condvar::new()));
    // Not queued (the VMM is stopping): the Replier, dropped with the error, answered.
    if tx.send((req, Replier(answer.clone()))).is_ok() {
        let _ = evt.write(1);
    }
    // The main thread answers, and may fork meanwhile: wait without the pass.
    let (slot, ready) = &*answer;
    pass.borrow_mut()
        .released(|| {
            let guard = slot.lock().unwrap_or_else(|p| p.into_inner());
            ready
                .wait_timeout_while(guard, ANSWER_TIMEOUT, |a| a.is_none())
                .unwrap_or_else(|p| p.into_inner())
                .0
                .take()
        })
        .unwrap_or_else(|| ApiReply::error(503, "the VMM did not answer in time"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn relay_answered_by(answer: impl FnOnce(Replier) + Send + 'static) -> ApiReply {
        let (tx, rx) = channel::<PendingRequest>();
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let vmm = std::thread::spawn(move || {
            let (_req, replier) = rx.recv().unwrap();
            answer(replier);
        });
        let pass = RefCell::new(Pass::take());
        let reply = relay(ApiRequest::GetVm, &tx, &evt, &pass);
        vmm.join().unwrap();
        reply
    }

    #[test]
    fn an_answer_reaches_the_waiting_api_thread() {
        let reply = relay_answered_by(|r| {
            std::thread::sleep(Duration::from_millis(20));
            r.send(ApiReply::error(409, "busy"));
        });
        assert_eq!(reply.status, 409);
    }

    #[test]
    fn stopping_the_server_answers_a_queued_request() {
        let dir = std::env::temp_dir().join(format!("forkvm-api-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("api.sock");
        let server = ApiServer::start(&path).unwrap();
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
        while server.evt.read().is_err() {
            std::thread::sleep(Duration::from_millis(1));
        }
        drop(server);
        let answer = client.join().unwrap();
        // Not "did not answer in time" (after ANSWER_TIMEOUT, with the drop waiting).
        assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
        assert!(answer.contains("shutting down"), "{answer}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_request_the_vmm_no_longer_takes_is_refused() {
        let (tx, rx) = channel::<PendingRequest>();
        drop(rx);
        let evt = EventFd::new(EFD_NONBLOCK).unwrap();
        let pass = RefCell::new(Pass::take());
        let reply = relay(ApiRequest::GetVm, &tx, &evt, &pass);
        assert_eq!(reply.status, 503);
        assert!(reply.body.unwrap().contains("shutting down"));
        // Nothing was queued, so nothing was signalled.
        assert!(evt.read().is_err());
    }

    #[test]
    fn a_request_dropped_unanswered_is_refused_not_timed_out() {
        // Without an answer the API thread would wait out ANSWER_TIMEOUT and say "did not
        // answer in time".
        let reply = relay_answered_by(drop);
        assert_eq!(reply.status, 503);
        assert!(reply.body.unwrap().contains("shutting down"));
    }
}
