//! The API thread: serves every connection of the control socket at once, none able to
//! hold up another.
//!
//! One thread (no async runtime: the VMM forks) waits in epoll on the listening socket,
//! every connection (non-blocking, edge-triggered) and an eventfd the VMM's answers
//! write. Each connection moves on its own (`conn`): a slow or stalled client costs only
//! its own deadline. At [`MAX_CONNECTIONS`] open connections, new ones are answered 503
//! and closed; request bodies held at once are bounded (`max_buffered`).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

use nix::errno::Errno;
use slab::Slab;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::conn::{Conn, Next, Shared};
use crate::ApiReply;
use forkvm_client::http::BodyLimits;
use vmm::gate::Pass;
use vmm::kept::KeptThread;
use vmm::rpc::ActionSender;

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

/// Most connections served at once; beyond them, 64 more (`MAX_REFUSING`) are answered
/// 503 at once, and the rest wait in the socket's backlog until one closes.
pub const MAX_CONNECTIONS: usize = 1024;
/// Most connections being refused at once.
const MAX_REFUSING: usize = 64;
/// How long accepting pauses when the process is out of descriptors or memory.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);
/// Most request body bytes the connections hold at once: four of the largest, and at
/// least 64 MiB.
fn max_buffered(limits: &BodyLimits) -> usize {
    (4 * limits.invocation).max(64 << 20)
}

/// The running API server. Dropping it stops the thread and removes the socket;
/// [`ApiServer::into_thread`] stops it and gives the thread back, idle.
pub struct ApiServer {
    path: PathBuf,
    listener_fd: i32,
    thread: Option<KeptThread>,
    /// Tells when the thread stopped serving.
    served: Option<Receiver<()>>,
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
    /// `actions`; bodies within `limits`. Serves on `thread` when given (a rewound
    /// clone's, kept from its life before), else on a new one.
    pub fn start(
        path: &Path,
        actions: ActionSender,
        limits: BodyLimits,
        thread: Option<KeptThread>,
    ) -> Result<Self, ApiServerError> {
        Self::launch(path, actions, limits, MAX_CONNECTIONS, thread)
    }

    /// As [`Self::start`], serving at most `max_connections` at once.
    fn launch(
        path: &Path,
        actions: ActionSender,
        limits: BodyLimits,
        max_connections: usize,
        thread: Option<KeptThread>,
    ) -> Result<Self, ApiServerError> {
        let err = |source| ApiServerError::Bind {
            path: path.display().to_string(),
            source,
        };
        let listener = bind(path)?;
        listener.set_nonblocking(true).map_err(err)?;
        let listener_fd = listener.as_raw_fd();
        let epoll = Epoll::new().map_err(err)?;
        let answers = Arc::new(EventFd::new(EFD_NONBLOCK).map_err(err)?);
        let watch = |fd, token| {
            let events = EventSet::IN | EventSet::EDGE_TRIGGERED;
            epoll.ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
        };
        watch(listener_fd, TOKEN_LISTENER).map_err(err)?;
        watch(answers.as_raw_fd(), TOKEN_ANSWERS).map_err(err)?;
        let thread = match thread {
            Some(t) => t,
            None => KeptThread::spawn("api".into()).map_err(err)?,
        };
        let (done, served) = channel();
        let job = move || {
            match vmm::sandbox::enter(vmm::sandbox::ThreadKind::Api) {
                Ok(()) => {
                    let shared = Shared::new(&actions, answers, limits, max_buffered(&limits));
                    serve(listener, epoll, shared, max_connections)
                }
                Err(e) => tracing::error!("API thread: {e}; the control socket is not served"),
            }
            let _ = done.send(());
        };
        if !thread.run(job) {
            // Its job before panicked (the process would have aborted, but for tests).
            let _ = std::fs::remove_file(path);
            return Err(err(std::io::Error::other("the API thread is gone")));
        }
        Ok(Self {
            path: path.to_path_buf(),
            listener_fd,
            thread: Some(thread),
            served: Some(served),
        })
    }

    /// Stops serving (as dropping it does) and gives the thread back, idle, for the
    /// next [`ApiServer::start`]; None if it ended.
    pub fn into_thread(mut self) -> Option<KeptThread> {
        self.stop_serving();
        self.thread.take()
    }

    /// Makes the thread's epoll report a hang-up of the listener and waits until it
    /// stopped serving.
    fn stop_serving(&mut self) {
        let Some(served) = self.served.take() else {
            return;
        };
        // SAFETY: the listener fd is owned by the serving job, which is still running
        // (we wait for it below); shutdown() only makes its epoll report a hang-up.
        unsafe { libc::shutdown(self.listener_fd, libc::SHUT_RDWR) };
        // The event loop dropped its end of the action queue before (refusing what was
        // queued), so the thread is not waiting out ANSWER_TIMEOUT.
        let _ = served.recv();
    }

    /// The socket path.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ApiServer {
    fn drop(&mut self) {
        self.stop_serving();
        // Joined when dropped (idle now).
        drop(self.thread.take());
        let _ = std::fs::remove_file(&self.path);
    }
}

const TOKEN_LISTENER: u64 = 0;
const TOKEN_ANSWERS: u64 = 1;
/// Connection `k` of the slab has token `k + TOKEN_CONN`.
const TOKEN_CONN: u64 = 2;

/// The API thread's state: its epoll, listener and connections.
struct Server<'a> {
    epoll: Epoll,
    listener: UnixListener,
    conns: Slab<Conn>,
    /// How many of `conns` are being refused.
    refusing: usize,
    /// Most connections served at once.
    max_connections: usize,
    shared: Shared<'a>,
    /// When accepting, paused for lack of descriptors or at the limit, is tried again.
    accept_again: Option<Instant>,
}

/// The epoll events a connection is watched for: edge-triggered, so that a connection
/// waiting for the VMM is not reported again and again.
fn conn_events() -> EventSet {
    EventSet::IN | EventSet::OUT | EventSet::READ_HANG_UP | EventSet::EDGE_TRIGGERED
}

fn serve(listener: UnixListener, epoll: Epoll, shared: Shared<'_>, max_connections: usize) {
    let mut server = Server {
        epoll,
        listener,
        conns: Slab::new(),
        refusing: 0,
        max_connections,
        shared,
        accept_again: None,
    };
    let mut events = vec![EpollEvent::default(); 64];
    // Waiting in epoll without a pass: a clone may be forked meanwhile (see
    // `vmm::gate`). Everything else holds it; the sockets do not block.
    let mut pass = Pass::take();
    loop {
        let timeout = server.next_deadline().map_or(-1, |at| {
            let d = at.saturating_duration_since(Instant::now());
            i32::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
        });
        let n = match pass.released(|| server.epoll.wait(timeout, &mut events)) {
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => {
                tracing::error!("API thread: epoll failed: {e}; the control socket is not served");
                return;
            }
        };
        for ev in &events[..n] {
            match ev.data() {
                TOKEN_LISTENER => {
                    // shutdown() from Drop: the listener hangs up.
                    if ev.event_set().contains(EventSet::HANG_UP) {
                        return;
                    }
                    server.accept();
                }
                TOKEN_ANSWERS => {
                    let _ = server.shared.answers().read();
                    server.take_answers();
                }
                token => server.advance(token),
            }
            // A fork waiting for the gate goes first.
            pass.released(|| ());
        }
        server.expire();
        if server.accept_again.is_some_and(|at| at <= Instant::now()) {
            server.accept_again = None;
            server.accept();
        }
    }
}

impl Server<'_> {
    /// The earliest deadline of a connection or of the paused accept.
    fn next_deadline(&self) -> Option<Instant> {
        let conns = self.conns.iter().map(|(_, c)| c.deadline());
        conns.chain(self.accept_again).min()
    }

    /// Accepts every pending connection: served, refused (at [`MAX_CONNECTIONS`]), or
    /// left in the backlog (also at [`MAX_REFUSING`], or out of descriptors).
    fn accept(&mut self) {
        use nix::sys::socket::{accept4, SockFlag};
        loop {
            let served = self.conns.len() - self.refusing;
            if served >= self.max_connections && self.refusing >= MAX_REFUSING {
                // Taken again as a connection closes.
                self.accept_again = Some(Instant::now() + ACCEPT_PAUSE);
                return;
            }
            let flags = SockFlag::SOCK_NONBLOCK | SockFlag::SOCK_CLOEXEC;
            let fd = match accept4(self.listener.as_raw_fd(), flags) {
                Ok(fd) => fd,
                Err(Errno::EAGAIN) => return,
                Err(Errno::EINTR | Errno::ECONNABORTED) => continue,
                Err(e) => {
                    // EMFILE, ENFILE, ENOBUFS, ENOMEM: the client waits in the backlog.
                    tracing::warn!("API accept failed: {e}; accepting again in a moment");
                    self.accept_again = Some(Instant::now() + ACCEPT_PAUSE);
                    return;
                }
            };
            // SAFETY: accept4 returned a new descriptor that nothing else owns.
            let stream = UnixStream::from(unsafe { OwnedFd::from_raw_fd(fd) });
            let now = Instant::now();
            let refused = served >= self.max_connections;
            let conn = match refused {
                false => Conn::new(stream, now),
                true => {
                    let why = format!(
                        "too many connections to the control socket (at most {})",
                        self.max_connections
                    );
                    Conn::refused(stream, ApiReply::error(503, why), now)
                }
            };
            let entry = self.conns.vacant_entry();
            let token = entry.key() as u64 + TOKEN_CONN;
            let watched = (self.epoll).ctl(
                ControlOperation::Add,
                conn.fd(),
                EpollEvent::new(conn_events(), token),
            );
            if let Err(e) = watched {
                tracing::warn!("API connection not served: {e}");
                continue;
            }
            entry.insert(conn);
            self.refusing += usize::from(refused);
            self.advance(token);
        }
    }

    /// Moves connection `token` as far as its socket lets it.
    fn advance(&mut self, token: u64) {
        let key = (token - TOKEN_CONN) as usize;
        let now = Instant::now();
        let Some(conn) = self.conns.get_mut(key) else {
            return;
        };
        if conn.advance(&mut self.shared, now) == Next::Done {
            self.close(key);
        }
    }

    /// Takes every answer the VMM gave.
    fn take_answers(&mut self) {
        let now = Instant::now();
        let done: Vec<usize> = (self.conns.iter_mut())
            .filter(|(_, c)| c.waiting())
            .filter_map(|(k, c)| (c.answered(now) == Next::Done).then_some(k))
            .collect();
        for key in done {
            self.close(key);
        }
    }

    /// Gives up on, or answers, connections past their deadline.
    fn expire(&mut self) {
        let now = Instant::now();
        let done: Vec<usize> = (self.conns.iter_mut())
            .filter(|(_, c)| c.deadline() <= now)
            .filter_map(|(k, c)| (c.expired(now) == Next::Done).then_some(k))
            .collect();
        for key in done {
            self.close(key);
        }
    }

    fn close(&mut self, key: usize) {
        let conn = self.conns.remove(key);
        // Explicitly: a forked clone may still hold a copy of the socket, which keeps
        // it in this epoll after the close.
        let _ = (self.epoll).ctl(ControlOperation::Delete, conn.fd(), EpollEvent::default());
        self.shared.release(&conn);
        if conn.is_refusal() {
            self.refusing -= 1;
        }
        if self.accept_again.is_some() {
            // A place is free: what waits in the backlog is accepted now.
            self.accept_again = Some(Instant::now());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};

    #[test]
    fn stopping_the_vmm_answers_a_queued_request() {
        let dir = std::env::temp_dir().join(format!("forkvm-api-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("api.sock");
        let (tx, actions) = vmm::rpc::channel().unwrap();
        let server = ApiServer::start(&path, tx, BodyLimits::default(), None).unwrap();
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

    /// A server on a fresh socket whose VMM answers every action with 204, as long as
    /// the returned guard lives.
    struct Fixture {
        dir: PathBuf,
        path: PathBuf,
        server: Option<ApiServer>,
        vmm: Option<std::thread::JoinHandle<()>>,
        stop: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Fixture {
        fn new(name: &str, max_connections: usize) -> Self {
            let dir =
                std::env::temp_dir().join(format!("forkvm-api-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("api.sock");
            let (tx, actions) = vmm::rpc::channel().unwrap();
            let server =
                ApiServer::launch(&path, tx, BodyLimits::default(), max_connections, None).unwrap();
            let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let halt = stop.clone();
            let vmm = std::thread::spawn(move || {
                while !halt.load(std::sync::atomic::Ordering::SeqCst) {
                    let _ = actions.evt().read();
                    while let Some((_, replier)) = actions.try_recv() {
                        replier.send(Ok(vmm::rpc::VmmData::Empty));
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
            Self {
                dir,
                path,
                server: Some(server),
                vmm: Some(vmm),
                stop,
            }
        }

        fn connect(&self) -> UnixStream {
            UnixStream::connect(&self.path).unwrap()
        }

        /// The answer to `raw` on a new connection.
        fn ask(&self, raw: &[u8]) -> crate::http::Response {
            let mut s = self.connect();
            s.write_all(raw).unwrap();
            crate::http::read_response(&s).unwrap()
        }
    }

    impl Drop for Fixture {
        fn drop(&mut self) {
            self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
            self.vmm.take().unwrap().join().unwrap();
            drop(self.server.take());
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// Whether the server still holds `s` open (it has neither answered nor closed it).
    fn still_open(s: &UnixStream) -> bool {
        s.set_nonblocking(true).unwrap();
        let mut b = [0u8; 1];
        let open =
            matches!((&*s).read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
        s.set_nonblocking(false).unwrap();
        open
    }

    #[test]
    fn a_half_sent_request_and_idle_connections_do_not_hold_up_another_request() {
        let f = Fixture::new("stall", MAX_CONNECTIONS);
        let mut stalled = f.connect();
        stalled
            .write_all(b"PATCH /vm HTTP/1.1\r\nContent-Length: 100\r\n\r\n{")
            .unwrap();
        let idle: Vec<UnixStream> = (0..200).map(|_| f.connect()).collect();
        assert_eq!(f.ask(b"GET /vm HTTP/1.1\r\n\r\n").status, 204);
        // Answered while the others are still waiting for their deadline.
        assert!(still_open(&stalled));
        assert!(idle.iter().all(still_open));
        // The stalled request is answered 408 at its deadline.
        let r = crate::http::read_response(&stalled).unwrap();
        assert_eq!(r.status, 408, "{}", r.body);
        assert!(r.body.contains("did not arrive within 5 s"), "{}", r.body);
    }

    #[test]
    fn connections_beyond_the_limit_are_refused_with_503_and_served_once_others_close() {
        let f = Fixture::new("limit", 4);
        let held: Vec<UnixStream> = (0..4).map(|_| f.connect()).collect();
        let r = f.ask(b"GET /vm HTTP/1.1\r\n\r\n");
        assert_eq!(r.status, 503, "{}", r.body);
        assert!(r.body.contains("too many connections"), "{}", r.body);
        assert_eq!(r.header("connection"), Some("close"));
        drop(held);
        // Closed on the client's side; the server notices at its next read.
        let mut tries = 0;
        loop {
            let r = f.ask(b"GET /vm HTTP/1.1\r\n\r\n");
            if r.status == 204 {
                break;
            }
            tries += 1;
            assert!(tries < 100, "still refused: {}", r.body);
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn a_405_names_the_methods_allowed() {
        let f = Fixture::new("allow", MAX_CONNECTIONS);
        for (raw, allowed) in [
            (&b"DELETE /vm HTTP/1.1\r\n\r\n"[..], "GET, PATCH"),
            (b"GET /clones/c1 HTTP/1.1\r\n\r\n", "DELETE"),
            (b"GET /invocations HTTP/1.1\r\n\r\n", "POST"),
        ] {
            let r = f.ask(raw);
            assert_eq!(
                (r.status, r.header("allow")),
                (405, Some(allowed)),
                "{}",
                r.body
            );
        }
        assert_eq!(f.ask(b"GET /nope HTTP/1.1\r\n\r\n").status, 404);
    }

    #[test]
    fn a_request_sent_a_byte_at_a_time_is_served() {
        let f = Fixture::new("bytes", MAX_CONNECTIONS);
        let mut s = f.connect();
        for b in b"PUT /actions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}" {
            s.write_all(&[*b]).unwrap();
            std::thread::sleep(Duration::from_micros(200));
        }
        let r = crate::http::read_response(&s).unwrap();
        // Parsed whole: the body is read as JSON (and refused as an action, by type).
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(r.body.contains("invalid JSON body"), "{}", r.body);
    }
}
