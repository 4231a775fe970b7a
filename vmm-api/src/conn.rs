//! One connection of the control socket, moved along as its socket becomes readable or
//! writable, its answer arrives or its deadline passes. It never blocks: the API thread
//! serves every connection (`server`).
//!
//! A connection carries one request: it is read (within [`REQUEST_TIMEOUT`] of the
//! accept, headers and body), its action waits for the VMM (within [`ANSWER_TIMEOUT`],
//! longer for many clones),
//! and the answer is written (within [`WRITE_TIMEOUT`]) with `Connection: close`; then
//! the socket is shut down and closed. An invocation's connection is handed to the VM
//! that runs it, which answers it.

use std::io::{ErrorKind, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use api_types::snapshot::SNAPSHOT_TIMEOUT;
use vmm_sys_util::eventfd::EventFd;

use crate::{reply, route, ApiReply};
use forkvm_client::http::{write_response_with, BodyLimits, HttpError, RequestReader};
use vmm::rpc::{ActionSender, Reply, VmmAction, VmmData};

/// How long a client may take to send its whole request, from its connection's accept.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// How long a request's action may wait for the VMM's answer; a clone request
/// 100 ms longer for each clone it asks for.
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(10);
/// What each clone of a request adds to its answer's deadline (1,000 clones of a busy
/// guest took 24 s on a saturated 2-CPU host).
const PER_CLONE: Duration = Duration::from_millis(100);
/// How long `action` may wait for the VMM's answer.
fn answer_timeout(action: &VmmAction) -> Duration {
    match action {
        VmmAction::CreateClones { request, .. } => {
            let count = u32::try_from(request.count).unwrap_or(u32::MAX);
            ANSWER_TIMEOUT.saturating_add(PER_CLONE.saturating_mul(count))
        }
        VmmAction::Snapshot(_) => SNAPSHOT_TIMEOUT,
        _ => ANSWER_TIMEOUT,
    }
}
/// How long a client may take to read its answer.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
/// Most a refused request's remainder is read for, and for how long, before the
/// connection is closed (closing a socket with unread bytes resets it, and the client
/// could lose the answer).
const DRAIN_BYTES: usize = 256 << 20;
const DRAIN_TIME: Duration = Duration::from_secs(2);

/// What the connections share: where actions go, the eventfd their answers write, the
/// body limits and the bytes of request bodies all connections may hold at once.
pub struct Shared<'a> {
    actions: &'a ActionSender,
    answers: Arc<EventFd>,
    limits: BodyLimits,
    /// Body bytes held by connections now.
    buffered: usize,
    /// Most body bytes held at once.
    max_buffered: usize,
}

impl<'a> Shared<'a> {
    /// Actions go to `actions`, their answers write `answers`; bodies within `limits`,
    /// at most `max_buffered` bytes of them held at once.
    pub fn new(
        actions: &'a ActionSender,
        answers: Arc<EventFd>,
        limits: BodyLimits,
        max_buffered: usize,
    ) -> Self {
        Self {
            actions,
            answers,
            limits,
            buffered: 0,
            max_buffered,
        }
    }

    /// The eventfd answers write.
    pub fn answers(&self) -> &EventFd {
        &self.answers
    }

    /// Gives back the body bytes `conn` held, as it closes.
    pub fn release(&mut self, conn: &Conn) {
        self.buffered -= conn.reserved;
    }
}

enum Phase {
    /// Reading the request.
    Reading(RequestReader),
    /// Its action is with the VMM; an invocation's, when `invocation`.
    Waiting { reply: Reply, invocation: bool },
    /// Writing `out[at..]`, then draining what the client still sends, or not.
    Writing {
        out: Vec<u8>,
        at: usize,
        drain: bool,
    },
    /// Reading and dropping what the client still sends (`read` bytes so far).
    Draining { read: usize },
}

/// Whether a connection goes on after it moved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// It waits for its socket, its answer or its deadline.
    Open,
    /// It is done (answered, handed to a VM or given up): close it.
    Done,
}

/// One connection.
pub struct Conn {
    stream: UnixStream,
    phase: Phase,
    deadline: Instant,
    /// Body bytes counted in its [`Shared`]'s bytes held.
    reserved: usize,
    /// Refused at once (the server is at its limit).
    refusal: bool,
    /// An invocation's: a VM holds a copy of the socket.
    shared: bool,
}

impl Conn {
    /// A connection just accepted (non-blocking).
    pub fn new(stream: UnixStream, now: Instant) -> Self {
        Self {
            stream,
            phase: Phase::Reading(RequestReader::default()),
            deadline: now + REQUEST_TIMEOUT,
            reserved: 0,
            refusal: false,
            shared: false,
        }
    }

    /// A connection refused at once with `answer` (the server is at its limit).
    pub fn refused(stream: UnixStream, answer: ApiReply, now: Instant) -> Self {
        let mut conn = Self::new(stream, now);
        conn.answer(answer, true, now);
        conn.refusal = true;
        conn
    }

    /// Whether it was refused at once.
    pub fn is_refusal(&self) -> bool {
        self.refusal
    }

    /// Its socket.
    pub fn fd(&self) -> i32 {
        self.stream.as_raw_fd()
    }

    /// When it is given up on.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Whether it waits for the VMM.
    pub fn waiting(&self) -> bool {
        matches!(self.phase, Phase::Waiting { .. })
    }

    /// Moves it as far as its socket lets it.
    pub fn advance(&mut self, shared: &mut Shared<'_>, now: Instant) -> Next {
        while let Phase::Reading(_) = self.phase {
            match self.read(shared, now) {
                Step::Moved => continue,
                Step::Blocked => return Next::Open,
                Step::Done => return Next::Done,
            }
        }
        self.finish(now)
    }

    /// Writes the answer and drains what the client still sends, as far as the socket
    /// lets it (nothing when the request is still with the VMM).
    fn finish(&mut self, now: Instant) -> Next {
        loop {
            let step = match self.phase {
                Phase::Writing { .. } => self.write(now),
                Phase::Draining { .. } => self.drain(),
                Phase::Reading(_) | Phase::Waiting { .. } => return Next::Open,
            };
            match step {
                Step::Moved => continue,
                Step::Blocked => return Next::Open,
                Step::Done => return Next::Done,
            }
        }
    }

    /// Answers `answer` at once, as far as the socket lets it (`drain`: then reads and
    /// drops what the client still sends). The socket of an `invocation` was shared with
    /// the VM that was to answer on it, which may have left it blocking: it is made
    /// non-blocking again first.
    fn answer_now(
        &mut self,
        answer: ApiReply,
        drain: bool,
        invocation: bool,
        now: Instant,
    ) -> Next {
        if invocation && set_nonblocking(&self.stream, true).is_err() {
            return Next::Done;
        }
        self.answer(answer, drain, now);
        self.finish(now)
    }

    /// Takes the VMM's answer if it is there.
    pub fn answered(&mut self, now: Instant) -> Next {
        let Phase::Waiting {
            reply: pending,
            invocation,
        } = &self.phase
        else {
            return Next::Open;
        };
        let invocation = *invocation;
        match pending.try_take() {
            None => Next::Open,
            // The VM that runs the invocation answers on its copy of the socket.
            Some(Ok(VmmData::Invoked)) => Next::Done,
            Some(response) => self.answer_now(reply(response), false, invocation, now),
        }
    }

    /// Past its deadline: answers what it can (408 for a request not read in time, 503
    /// for an answer the VMM did not give in time) or gives up.
    pub fn expired(&mut self, now: Instant) -> Next {
        match &self.phase {
            Phase::Reading(_) => {
                let why = format!(
                    "the request did not arrive within {} s",
                    REQUEST_TIMEOUT.as_secs()
                );
                self.answer_now(ApiReply::error(408, why), true, false, now)
            }
            Phase::Waiting { invocation, .. } => {
                let why = "the VMM did not answer in time";
                self.answer_now(ApiReply::error(503, why), false, *invocation, now)
            }
            Phase::Writing { .. } | Phase::Draining { .. } => Next::Done,
        }
    }

    /// Queues `answer` to be written, then closes (after draining the client's
    /// remaining bytes when `drain`).
    fn answer(&mut self, answer: ApiReply, drain: bool, now: Instant) {
        let mut out = Vec::with_capacity(256);
        let body = answer.body.as_deref().unwrap_or("");
        let kind = (!body.is_empty()).then_some("application/json");
        // Writing to a Vec does not fail.
        let _ = write_response_with(
            &mut out,
            answer.status,
            &answer.headers,
            kind,
            body.as_bytes(),
        );
        self.phase = Phase::Writing { out, at: 0, drain };
        self.deadline = now + WRITE_TIMEOUT;
    }

    fn read(&mut self, shared: &mut Shared<'_>, now: Instant) -> Step {
        let Phase::Reading(reader) = &mut self.phase else {
            return Step::Moved;
        };
        let mut chunk = [0u8; 16 * 1024];
        let n = match (&self.stream).read(&mut chunk) {
            Ok(0) => {
                tracing::debug!("API connection: {}", reader.closed());
                return Step::Done;
            }
            Ok(n) => n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Blocked,
            Err(e) if e.kind() == ErrorKind::Interrupted => return Step::Moved,
            Err(e) => {
                tracing::debug!("API connection: {e}");
                return Step::Done;
            }
        };
        let had_head = reader.body_len().is_some();
        match reader.feed(&chunk[..n], &shared.limits) {
            Ok(Some(req)) => {
                self.dispatch(req, shared, now);
                Step::Moved
            }
            Ok(None) => {
                if let (false, Some(len)) = (had_head, reader.body_len()) {
                    if shared.buffered + len > shared.max_buffered {
                        let why = format!(
                            "too many request bodies are being received ({} bytes held, \
                             at most {}); retry",
                            shared.buffered, shared.max_buffered
                        );
                        self.answer(ApiReply::error(503, why), true, now);
                        return Step::Moved;
                    }
                    shared.buffered += len;
                    self.reserved = len;
                }
                Step::Moved
            }
            Err(HttpError::TooLarge(m)) => {
                self.answer(ApiReply::error(413, m), true, now);
                Step::Moved
            }
            Err(e) => {
                self.answer(ApiReply::error(400, e), true, now);
                Step::Moved
            }
        }
    }

    /// Sends the whole request's action to the VMM, or answers it at once.
    fn dispatch(&mut self, req: forkvm_client::http::Request, shared: &Shared<'_>, now: Instant) {
        let invocation = req.path == "/invocations";
        let mut conn = None;
        if invocation {
            match self.stream.try_clone() {
                Ok(s) => conn = Some(vmm::invoke::Connection::new(s)),
                Err(e) => {
                    let why = format!("cannot keep the connection for the answer: {e}");
                    return self.answer(ApiReply::error(503, why), false, now);
                }
            }
        }
        let action = match route(req, conn) {
            Ok(action) => action,
            Err(answer) => return self.answer(answer, false, now),
        };
        // The VM that runs an invocation writes its answer with blocking writes and a
        // timeout of its own.
        if matches!(action, VmmAction::Invoke(_)) {
            if let Err(e) = set_nonblocking(&self.stream, false) {
                let why = format!("cannot hand the connection over: {e}");
                return self.answer(ApiReply::error(500, why), false, now);
            }
            self.shared = true;
        }
        let timeout = answer_timeout(&action);
        let reply = shared.actions.send_waking(action, &shared.answers);
        self.phase = Phase::Waiting { reply, invocation };
        self.deadline = now + timeout;
    }

    fn write(&mut self, now: Instant) -> Step {
        let Phase::Writing { out, at, drain } = &mut self.phase else {
            return Step::Moved;
        };
        while *at < out.len() {
            match (&self.stream).write(&out[*at..]) {
                Ok(0) => return Step::Done,
                Ok(n) => *at += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Blocked,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) => {
                    tracing::debug!("API connection: cannot write the answer: {e}");
                    return Step::Done;
                }
            }
        }
        if !*drain && !self.shared {
            // Closed at once: the client sees the end of the answer as it is gone.
            return Step::Done;
        }
        // The end of the answer now, for a client that still sends, or whose socket a VM
        // holds too (an invocation's).
        let _ = self.stream.shutdown(std::net::Shutdown::Write);
        if !*drain {
            return Step::Done;
        }
        self.phase = Phase::Draining { read: 0 };
        self.deadline = now + DRAIN_TIME;
        Step::Moved
    }

    fn drain(&mut self) -> Step {
        let Phase::Draining { read } = &mut self.phase else {
            return Step::Moved;
        };
        let mut buf = [0u8; 16 * 1024];
        loop {
            if *read >= DRAIN_BYTES {
                return Step::Done;
            }
            match (&self.stream).read(&mut buf) {
                Ok(0) => return Step::Done,
                Ok(n) => *read += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Step::Blocked,
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(_) => return Step::Done,
            }
        }
    }
}

/// How one step of a connection went.
enum Step {
    /// Into another phase (or on in this one): go on.
    Moved,
    /// Its socket has nothing more for now.
    Blocked,
    /// Done.
    Done,
}

/// Sets or clears O_NONBLOCK on the socket's open file (shared by its copies) with
/// fcntl (std's `set_nonblocking` uses an ioctl, which the API thread's seccomp filter
/// refuses).
pub fn set_nonblocking(stream: &UnixStream, on: bool) -> std::io::Result<()> {
    use nix::fcntl::{fcntl, FcntlArg, OFlag};
    let flags = OFlag::from_bits_truncate(fcntl(stream, FcntlArg::F_GETFL)?);
    let flags = match on {
        true => flags | OFlag::O_NONBLOCK,
        false => flags - OFlag::O_NONBLOCK,
    };
    fcntl(stream, FcntlArg::F_SETFL(flags))?;
    Ok(())
}
