//! Fork sources (`--fork-sources N`): clones of a paused template that are templates
//! themselves, each with its own warm pool, sharing the template's memory copy on
//! write, so that one template's clones are forked by several processes at once.
//!
//! A fork holds the forking process's memory map, so one process forks one clone at a
//! time, and a template's event loop spent about 0.6-0.7 ms of its thread per fresh
//! invocation (the fork, its copy-on-write faults after it, launching and reaping), a
//! ceiling of about 1,500 fresh clones a second whatever the cores. With sources, the
//! template (the root) forwards each invocation in turn to itself or to one of its
//! sources: a message on the source's channel with the caller's connection attached,
//! the request's options and its payload. The source serves it as the root would
//! (`controller`), and its clone answers the caller.
//!
//! The root makes its sources once it paused as a template, forked from the state its
//! warm clones are made from (never one of them: a warm clone may have been primed),
//! and makes again any that ended. A source runs its runtime once (it reads "no
//! request" and waits again), pauses there as a template, and says so with a byte on
//! its channel; only then is it sent requests. When the root's paused state changes (it
//! resumed, its serial port took input, a disk slot changed) it discards its warm clones
//! and lets its sources go: it closes their channels, and each source, told so by the
//! end of its channel, takes no more requests, discards its warm clones and ends once
//! the clones it made have (a request in flight is answered in full). New ones are made
//! at the root's next pause. A source's channel that closes is a source that ended: it
//! is sent nothing more; one that cannot take a message (stuck for 2 s) is stopped.
//!
//! The channels are watched by an epoll of their own, whose descriptor the controller's
//! event loop watches in turn ([`Sources::fd`]).

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::{Duration, Instant};

use api_types::vm::VmState;
use api_types::{CloneStatus, CreateClones};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::wire::go_channel;
use super::{request, Cloner};

/// How long the root waits before it tries again to make sources after it failed to.
const RETRY: Duration = Duration::from_secs(1);

/// How long a source's write on its channel may block before it is given up (the
/// root's end gives up after as long: `wire::go_channel`).
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// What a source writes on its channel once it paused as a template.
const READY: u8 = b'R';

/// The message header: the note's length (u32) and the payload's (u64).
const HEADER: usize = 12;

/// The epoll token of a source's own channel (in a source; a root's tokens are pids).
const INBOX: u64 = u64::MAX;

/// Why a forwarded request could not be read.
#[derive(Debug, thiserror::Error)]
pub enum InboxError {
    /// The channel failed or closed within a message.
    #[error("the fork source's channel: {0}")]
    Io(#[from] std::io::Error),
    /// The message is not one the root sends.
    #[error("a malformed forwarded request: {0}")]
    Malformed(String),
}

/// A request the root forwarded to this source: what the layer above made of it (its
/// note), its payload, and the caller's connection.
#[derive(Debug)]
pub struct Forwarded {
    /// What the layer above sent with it.
    pub note: serde_json::Value,
    /// The payload.
    pub payload: Vec<u8>,
    /// The caller's connection.
    pub stream: UnixStream,
}

/// A source as its root sees it.
struct Source {
    id: String,
    pid: i32,
    channel: UnixStream,
    ready: bool,
}

/// A template's fork sources (in the root), or this source's channel to its root.
#[derive(Default)]
pub(super) struct Sources {
    /// `--fork-sources`: a VM whose configuration has more than one may become a
    /// template with sources (a derived template), so its channels are watched from
    /// the start.
    configured: usize,
    /// Sources to keep besides the root (`--fork-sources` less one, in a template).
    target: usize,
    /// None until the event loop asks for it ([`Sources::fd`]).
    epoll: Option<Epoll>,
    live: Vec<Source>,
    /// Where the round robin over the root and its ready sources stands.
    turn: usize,
    /// No source is made before then (a failure to make them).
    not_before: Option<Instant>,
    /// In a source: its channel to the root.
    inbox: Option<UnixStream>,
    /// In a source: whether it told the root it is ready.
    announced: bool,
    /// Sources dropped for a broken channel, to be stopped ([`Sources::take_dropped`]).
    dropped: Vec<String>,
    /// In a source: its template let it go.
    retiring: bool,
}

impl Sources {
    /// The sources of a VM configured with `configured` (`--fork-sources`), none kept
    /// until it is a template ([`Sources::become_template`]).
    pub fn new(configured: usize) -> Self {
        Self {
            configured,
            ..Self::default()
        }
    }

    /// This VM is a template: it keeps its configured sources besides itself.
    pub fn become_template(&mut self) {
        if self.inbox.is_none() {
            self.target = self.configured.saturating_sub(1);
        }
    }

    /// The descriptor that is readable while a channel has something to read; made on
    /// the first call. None where there is nothing to watch (no sources configured, no
    /// inbox).
    pub fn fd(&mut self) -> std::io::Result<Option<RawFd>> {
        if self.configured <= 1 && self.inbox.is_none() {
            return Ok(None);
        }
        if self.epoll.is_none() {
            let epoll = Epoll::new()?;
            if let Some(inbox) = &self.inbox {
                let event = EpollEvent::new(EventSet::IN, INBOX);
                epoll.ctl(ControlOperation::Add, inbox.as_raw_fd(), event)?;
            }
            self.epoll = Some(epoll);
        }
        Ok(self.epoll.as_ref().map(|e| e.as_raw_fd()))
    }

    /// This process is a source: `channel` goes to its root. It makes no sources of
    /// its own. Call before [`Sources::fd`].
    pub fn become_source(&mut self, channel: OwnedFd) {
        let channel = UnixStream::from(channel);
        let _ = channel.set_write_timeout(Some(SEND_TIMEOUT));
        self.inbox = Some(channel);
        self.target = 0;
    }

    /// In a source that just paused as a template: tells the root (once) it may send
    /// requests. A source whose root is gone cannot tell; it dies with the root.
    pub fn announce_ready(&mut self) {
        if let (Some(mut inbox), false) = (self.inbox.as_ref(), self.announced) {
            self.announced = true;
            if let Err(e) = inbox.write_all(&[READY]) {
                tracing::warn!("cannot tell the root template this fork source is ready: {e}");
            }
        }
    }

    /// How many sources to make now (a paused root template with fewer than it keeps).
    pub fn wanted(&self) -> usize {
        let waiting = self.not_before.is_some_and(|t| t > Instant::now());
        match waiting {
            true => 0,
            false => self.target.saturating_sub(self.live.len()),
        }
    }

    /// Time until sources are due to be made, given the root could make them now.
    pub fn due_in(&self) -> Option<Duration> {
        if self.target <= self.live.len() {
            return None;
        }
        // Only while it is ahead: once passed, making them is up to the root's state
        // (a paused template), or the event loop would spin.
        let left = self.not_before?.checked_duration_since(Instant::now())?;
        (!left.is_zero()).then_some(left)
    }

    /// Watches `channel` to source `id` (process `pid`), made just now.
    pub fn add(&mut self, id: String, pid: i32, channel: UnixStream) {
        self.not_before = None;
        let event = EpollEvent::new(EventSet::IN, pid as u64);
        match &self.epoll {
            Some(e)
                if e.ctl(ControlOperation::Add, channel.as_raw_fd(), event)
                    .is_ok() =>
            {
                self.live.push(Source {
                    id,
                    pid,
                    channel,
                    ready: false,
                });
            }
            // Unwatched, it would never be ready: its channel's end closes here, so
            // the source, let go, ends.
            _ => {
                tracing::warn!("cannot watch fork source {id}'s channel: it is sent nothing");
                self.failed();
            }
        }
    }

    /// Making sources failed: none is tried again for a while.
    pub fn failed(&mut self) {
        self.not_before = Some(Instant::now() + RETRY);
    }

    /// Lets every source go (the root's paused state changed): their channels close,
    /// and each ends once its clones have ([`Cloner::retired`]), so that a request one
    /// serves is not cut short.
    pub fn let_go(&mut self) {
        self.turn = 0;
        for s in std::mem::take(&mut self.live) {
            if let Some(e) = &self.epoll {
                let _ = e.ctl(
                    ControlOperation::Delete,
                    s.channel.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
            tracing::info!("fork source {} (pid {}) let go", s.id, s.pid);
        }
    }

    /// In a source: whether its template let it go (its channel closed or broke).
    pub fn retiring(&self) -> bool {
        self.retiring
    }

    /// Reads what the channels have: in the root, sources that became ready or ended;
    /// in a source, one forwarded request (the next, if more are queued, when the event
    /// loop comes back: the epoll is level-triggered).
    pub fn take_events(&mut self) -> Option<Result<Forwarded, InboxError>> {
        let mut events = [EpollEvent::default(); 16];
        let n = self.epoll.as_ref()?.wait(0, &mut events).ok()?;
        let mut forwarded = None;
        for ev in &events[..n] {
            match ev.data() {
                INBOX => forwarded = self.inbox.as_ref().map(receive),
                pid => self.source_spoke(pid as i32),
            }
        }
        if let Some(Err(InboxError::Io(_))) = &forwarded {
            // The root let this source go, or the channel broke: nothing more can come
            // on it. It ends once its clones have.
            self.retiring = true;
            if let (Some(e), Some(inbox)) = (&self.epoll, &self.inbox) {
                let _ = e.ctl(
                    ControlOperation::Delete,
                    inbox.as_raw_fd(),
                    EpollEvent::default(),
                );
            }
        }
        forwarded
    }

    /// Source `pid`'s channel is readable: its ready byte, or its end (it is dropped).
    fn source_spoke(&mut self, pid: i32) {
        let Some(i) = self.live.iter().position(|s| s.pid == pid) else {
            return;
        };
        let mut byte = [0u8; 16];
        match (&self.live[i].channel).read(&mut byte) {
            Ok(n) if n > 0 && byte[..n].contains(&READY) => {
                tracing::info!("fork source {} ready", self.live[i].id);
                self.live[i].ready = true;
            }
            Ok(n) if n > 0 => {}
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            _ => self.drop_source(i, "its channel closed"),
        }
    }

    fn drop_source(&mut self, i: usize, why: &str) {
        let s = self.live.remove(i);
        tracing::info!("fork source {} (pid {}) gone: {why}", s.id, s.pid);
        if !s.ready {
            // It never served: made again only after a while.
            self.failed();
        }
        self.dropped.push(s.id);
        if let Some(e) = &self.epoll {
            let _ = e.ctl(
                ControlOperation::Delete,
                s.channel.as_raw_fd(),
                EpollEvent::default(),
            );
        }
    }

    /// The sources dropped since last asked (their channel closed or broke): the root
    /// stops them, should they still run.
    pub fn take_dropped(&mut self) -> Vec<String> {
        std::mem::take(&mut self.dropped)
    }

    /// Forwards a request to the next ready source in turn: its `note`, `payload` and
    /// the caller's `stream`. False: the root's turn (or no source is ready, or the one
    /// whose turn it was could not take it and was dropped): the root serves it.
    pub fn forward(
        &mut self,
        note: impl FnOnce() -> Vec<u8>,
        payload: &[u8],
        stream: &UnixStream,
    ) -> bool {
        // No allocation here: after each fork, a heap page the template writes is a
        // page fault (a copy on write).
        let ready = self.live.iter().filter(|s| s.ready).count();
        if ready == 0 {
            return false;
        }
        self.turn = (self.turn + 1) % (ready + 1);
        let nth = |k| {
            (self.live.iter().enumerate())
                .filter(|(_, s)| s.ready)
                .nth(k)
        };
        let Some((i, _)) = self.turn.checked_sub(1).and_then(nth) else {
            return false;
        };
        match send(&self.live[i].channel, &note(), payload, stream.as_raw_fd()) {
            Ok(()) => true,
            Err(e) => {
                self.drop_source(i, &format!("a request could not be forwarded: {e}"));
                false
            }
        }
    }
}

/// The clone side's part in fork sources.
impl Cloner {
    /// This VM (a clone just made) is a fork source of its template (`sources.rs`): a
    /// template of its own, told requests on `channel`.
    pub fn become_source(
        &mut self,
        config: &crate::config::VmConfig,
        channel: std::os::fd::OwnedFd,
    ) {
        self.sources.become_source(channel);
        self.become_template(config);
    }

    /// The descriptor the event loop watches for its fork sources' channels, or a
    /// source's channel to its template ([`Cloner::take_forwarded`]); None where there
    /// are none.
    pub fn sources_fd(&mut self) -> std::io::Result<Option<std::os::fd::RawFd>> {
        self.sources.fd()
    }

    /// In a fork source that just paused as a template: tells its template it may
    /// forward requests.
    pub fn announce_ready(&mut self) {
        self.sources.announce_ready();
    }

    /// In a template with fork sources: forwards a request to the next ready source in
    /// turn (`note` makes what the layer above tells the source, as JSON, called only
    /// when a source takes it; its `payload`, the caller's `stream`). False: this
    /// template serves it itself.
    pub fn forward(
        &mut self,
        note: impl FnOnce() -> Vec<u8>,
        payload: &[u8],
        stream: &std::os::unix::net::UnixStream,
    ) -> bool {
        let sent = self.sources.forward(note, payload, stream);
        self.stop_dropped_sources();
        sent
    }

    /// Stops the fork sources dropped for a broken channel (those that ended are gone).
    fn stop_dropped_sources(&mut self) {
        for id in self.sources.take_dropped() {
            self.table.begin_stop(&id);
        }
    }

    /// What the channels have: in a template, sources that became ready or ended; in a
    /// fork source, a request its template forwarded.
    pub fn take_forwarded(&mut self) -> Option<Result<Forwarded, InboxError>> {
        let was_retiring = self.sources.retiring();
        let events = self.sources.take_events();
        self.stop_dropped_sources();
        if self.sources.retiring() && !was_retiring {
            // No request comes any more: no warm clone is kept for one.
            self.warm.discard();
        }
        events
    }

    /// In a fork source its template let go: whether it may end now (no clone of its
    /// runs, but warm ones).
    pub fn retired(&mut self) -> bool {
        if !self.sources.retiring() {
            return false;
        }
        self.reap();
        self.table.live().next().is_none()
    }

    /// Makes the fork sources a paused template lacks, from its paused state (never
    /// from a warm clone, which may have run a prime); each becomes a template of its
    /// own and says when it is ready.
    pub(super) fn make_sources(&mut self, vm: &mut crate::microvm::Microvm) {
        let wanted = self.sources.wanted();
        let channels: std::io::Result<Vec<_>> = (0..wanted).map(|_| go_channel()).collect();
        let channels = match channels {
            Ok(c) => c,
            Err(e) => {
                tracing::warn!("cannot make fork sources: {e}");
                return self.sources.failed();
            }
        };
        let (ends, roots): (Vec<_>, Vec<_>) = channels.into_iter().unzip();
        let mut ends = ends.into_iter();
        let req = CreateClones {
            count: wanted as u64,
            ..CreateClones::default()
        };
        let now = crate::vstate::vcpu::monotonic_ns();
        let prepare = |identity: &mut request::Identity| {
            identity.source = ends.next().map(std::sync::Arc::new);
            // Its guest prints nothing of its own, and a file per source made would
            // stay behind (the records of clones that ended keep theirs).
            identity.console = "/dev/null".into();
        };
        match self.make_clones_with(vm, &req, now, None, true, prepare) {
            Ok(made) => {
                for (info, root) in made.into_iter().zip(roots) {
                    match info.status {
                        CloneStatus::Failed => self.sources.failed(),
                        _ => self.sources.add(info.id, info.pid, root),
                    }
                }
            }
            Err(e) => {
                tracing::warn!("cannot make fork sources: {e}");
                self.sources.failed();
            }
        }
    }

    /// Whether fork sources are to be made now: a paused template, nothing pending,
    /// fewer sources than it keeps.
    pub(super) fn sources_wanted(&self, vm: &crate::microvm::Microvm) -> bool {
        self.sources.wanted() > 0
            && vm.state() == VmState::Paused
            && vm.pending_events().is_empty()
            && vm.config().invoke.template
    }
}

/// Writes one forwarded request on `channel`: the header, the note (`json`) with the
/// caller's connection `conn` attached, then the payload.
fn send(channel: &UnixStream, json: &[u8], payload: &[u8], conn: RawFd) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let mut head = Vec::with_capacity(HEADER + json.len());
    head.extend_from_slice(&(json.len() as u32).to_le_bytes());
    head.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    head.extend_from_slice(json);
    let fds = [conn];
    let cmsgs = [ControlMessage::ScmRights(&fds)];
    let iov = [std::io::IoSlice::new(&head)];
    let sent = loop {
        match sendmsg::<()>(
            channel.as_raw_fd(),
            &iov,
            &cmsgs,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            r => break r?,
        }
    };
    let mut w = channel;
    w.write_all(&head[sent..])?;
    w.write_all(payload)
}

/// Reads one forwarded request from `channel` ([`send`]'s message).
fn receive(channel: &UnixStream) -> Result<Forwarded, InboxError> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    let mut head = [0u8; HEADER];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let (got, conn) = loop {
        let mut iov = [std::io::IoSliceMut::new(&mut head)];
        let msg = match recvmsg::<()>(
            channel.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        ) {
            Err(nix::errno::Errno::EINTR) => continue,
            r => r.map_err(std::io::Error::from)?,
        };
        let mut conn = None;
        for c in msg.cmsgs().map_err(std::io::Error::from)? {
            if let ControlMessageOwned::ScmRights(fds) = c {
                for fd in fds {
                    // SAFETY: a descriptor just received, owned by nobody else.
                    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
                    conn.get_or_insert(owned);
                }
            }
        }
        break (msg.bytes, conn);
    };
    if got == 0 {
        return Err(std::io::Error::from(std::io::ErrorKind::UnexpectedEof).into());
    }
    let mut r = channel;
    r.read_exact(&mut head[got..])?;
    let conn = conn.ok_or_else(|| InboxError::Malformed("no connection attached".into()))?;
    let note_len = u32::from_le_bytes([head[0], head[1], head[2], head[3]]) as usize;
    let mut len = [0u8; 8];
    len.copy_from_slice(&head[4..]);
    let payload_len = usize::try_from(u64::from_le_bytes(len))
        .map_err(|_| InboxError::Malformed("a payload too large".into()))?;
    let mut note = vec![0u8; note_len];
    r.read_exact(&mut note)?;
    let mut payload = vec![0u8; payload_len];
    r.read_exact(&mut payload)?;
    let note = serde_json::from_slice(&note).map_err(|e| InboxError::Malformed(e.to_string()))?;
    Ok(Forwarded {
        note,
        payload,
        stream: UnixStream::from(conn),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_forwarded_request_arrives_whole_with_its_connection() {
        let (child, parent) = go_channel().unwrap();
        let inbox = UnixStream::from(child);
        let (caller, conn) = UnixStream::pair().unwrap();
        let note = serde_json::json!({"timeout_ms": 5});
        let payload: Vec<u8> = (0..300_000u32).map(|i| i as u8).collect();
        let writer = {
            let payload = payload.clone();
            let note = note.clone();
            let json = serde_json::to_vec(&note).unwrap();
            std::thread::spawn(move || send(&parent, &json, &payload, conn.as_raw_fd()))
        };
        let got = receive(&inbox).unwrap();
        writer.join().unwrap().unwrap();
        assert_eq!(got.note, note);
        assert_eq!(got.payload, payload);
        // The attached connection is the caller's other end.
        (&got.stream).write_all(b"answer").unwrap();
        let mut back = [0u8; 6];
        (&caller).read_exact(&mut back).unwrap();
        assert_eq!(&back, b"answer");
    }

    #[test]
    fn a_closed_channel_is_an_io_error_and_garbage_is_malformed() {
        let (child, parent) = go_channel().unwrap();
        let inbox = UnixStream::from(child);
        drop(parent);
        assert!(matches!(receive(&inbox), Err(InboxError::Io(_))));
        let (child, parent) = go_channel().unwrap();
        let inbox = UnixStream::from(child);
        (&parent).write_all(&[0u8; HEADER]).unwrap();
        assert!(matches!(receive(&inbox), Err(InboxError::Malformed(_))));
    }

    #[test]
    fn the_root_takes_its_turn_and_no_source_is_sent_a_request_before_it_is_ready() {
        let mut sources = Sources::new(3);
        assert_eq!(sources.wanted(), 0);
        sources.become_template();
        sources.fd().unwrap();
        let (c1, p1) = go_channel().unwrap();
        let (c2, p2) = go_channel().unwrap();
        sources.add("1".into(), 101, p1);
        sources.add("2".into(), 102, p2);
        let (_caller, conn) = UnixStream::pair().unwrap();
        let note = || b"{}".to_vec();
        // None ready: the root serves.
        assert!(!sources.forward(note, b"x", &conn));
        // Source 1 says it is ready.
        let mut s1 = UnixStream::from(c1);
        s1.write_all(&[READY]).unwrap();
        assert!(sources.take_events().is_none());
        let turns: Vec<bool> = (0..4).map(|_| sources.forward(note, b"x", &conn)).collect();
        assert_eq!(turns, [true, false, true, false]);
        // Source 2 ends before it was ready: dropped, never sent anything.
        drop(c2);
        sources.take_events();
        assert_eq!(sources.live.len(), 1);
        assert_eq!(sources.take_dropped(), vec!["2".to_string()]);
        // Made again only after a while, since it never served.
        assert_eq!(sources.wanted(), 0);
        assert!(sources.due_in().is_some());
        sources.not_before = None;
        assert_eq!(sources.wanted(), 1);
        // Two requests reached source 1.
        for _ in 0..2 {
            let f = receive(&s1).unwrap();
            assert_eq!(f.payload, b"x");
        }
        sources.let_go();
        assert!(sources.live.is_empty());
        assert_eq!(sources.wanted(), 2);
        // The source sees its channel close: it retires.
        let mut source = Sources::default();
        source.become_source(s1.into());
        source.fd().unwrap();
        assert!(!source.retiring());
        assert!(matches!(source.take_events(), Some(Err(InboxError::Io(_)))));
        assert!(source.retiring());
    }
}
