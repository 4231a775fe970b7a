//! Both ends of the two channels between a template and each clone it forks, so that
//! each protocol is written once.
//!
//! - **The ready pipe** (clone to parent): vCPU 0 writes the CLOCK_MONOTONIC time it
//!   first enters the guest (`vstate::vcpu::FirstEntry`); the clone's control thread
//!   writes [`READY_MARK`] once its control socket is up ([`ReadyMark::send`]), or a
//!   failure record ([`FAIL_MARK`], the host error number, the reason) if it failed
//!   first; the parent reads both in either order ([`wait_ready`]) and answers once the
//!   pipe is closed.
//! - **The go channel** (a socket pair, for a warm clone): the clone reports a finished
//!   prime with one byte ([`report_primed`], [`prime_report`]); the parent sends the
//!   launch message ([`send_go`]: the identity, a handover's stream attached, its
//!   payload) and the clone reads it ([`wait_for_go`]); a channel closed without
//!   a message discards the warm clone.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

use super::request::Identity;

/// A launch message the clone could not read.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct LaunchError(String);

impl LaunchError {
    /// An error saying `why`.
    pub(super) fn new(why: &str) -> Self {
        Self(why.to_string())
    }
}

// The ready pipe.

/// What a clone that failed before it was ready writes to its ready pipe, followed by
/// the error number and the reason's length (u64 each) and the reason.
pub(super) const FAIL_MARK: u64 = u64::MAX - 1;

/// What a clone's control thread writes to the ready pipe once its devices' host sides
/// and its control socket are up (no CLOCK_MONOTONIC time vCPU 0 writes is this).
pub(super) const READY_MARK: u64 = u64::MAX;

/// The clone's end of its ready pipe, held until its control socket is up; until then
/// a failure of the clone is reported through it too (a failure record).
pub struct ReadyMark(Arc<Mutex<Option<File>>>);

impl ReadyMark {
    /// The mark on the ready pipe's write end `f`.
    pub(super) fn new(f: File) -> Self {
        ReadyMark(Arc::new(Mutex::new(Some(f))))
    }

    /// A second handle on the same mark (whichever is used first writes).
    pub(super) fn share(&self) -> Self {
        ReadyMark(self.0.clone())
    }

    /// Tells the parent the clone's control socket and host endpoints are up (the
    /// parent answers once vCPU 0's time and this mark are in and the pipe is closed).
    pub fn send(self) -> std::io::Result<()> {
        use std::io::Write;
        match lock(&self.0).take() {
            Some(mut f) => f.write_all(&READY_MARK.to_le_bytes()),
            None => Ok(()),
        }
    }

    /// Tells the parent why the clone failed, if it was not ready yet: `FAIL_MARK`, the
    /// host error number behind it (0 if none) and the reason, in one write.
    pub(super) fn fail(&self, errno: i32, reason: &str) {
        use std::io::Write;
        if let Some(mut f) = lock(&self.0).take() {
            let text = &reason.as_bytes()[..reason.len().min(MAX_REASON)];
            let mut record = Vec::with_capacity(24 + text.len());
            record.extend_from_slice(&FAIL_MARK.to_le_bytes());
            record.extend_from_slice(&(errno.max(0) as u64).to_le_bytes());
            record.extend_from_slice(&(text.len() as u64).to_le_bytes());
            record.extend_from_slice(text);
            let _ = f.write_all(&record);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The longest reason a failed clone reports (the record fits in one atomic pipe write).
const MAX_REASON: usize = 400;

/// Why a clone never reported ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct NotReady {
    /// What the clone said before it ended, if it said anything.
    pub reason: Option<String>,
    /// The host error number behind it (0: none, or not a host error).
    pub errno: i32,
}

impl std::fmt::Display for NotReady {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.reason {
            Some(r) => f.write_str(r),
            None => f.write_str("it ended before it was ready, without saying why (killed?)"),
        }
    }
}

/// Reads what a clone writes to its ready pipe, in either order: the 8-byte
/// CLOCK_MONOTONIC time its vCPU 0 first entered the guest, and `READY_MARK` (its host
/// endpoints and control socket are up); then waits for the end of the pipe. Returns
/// the time; why not on timeout, or if the clone died or failed before both (a clone
/// that failed writes `FAIL_MARK`, its error number and its reason).
pub(super) fn wait_ready(f: &mut File, timeout: Duration) -> Result<u64, NotReady> {
    use std::io::Read;
    let deadline = Instant::now() + timeout;
    let mut got = Vec::with_capacity(16);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut fds = [PollFd::new(f.as_fd(), PollFlags::POLLIN)];
        let wait = PollTimeout::try_from(left).unwrap_or(PollTimeout::MAX);
        if poll(&mut fds, wait) != Ok(1) {
            let reason = format!("it did not report ready within {} s", timeout.as_secs());
            return Err(split_failure(&got).1.unwrap_or(NotReady {
                reason: Some(reason),
                errno: 0,
            }));
        }
        let mut b = [0u8; 512];
        match f.read(&mut b) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(_) => break,
        }
    }
    parse_ready(&got)
}

/// The words of the ready pipe's contents before a failure record, and the record.
fn split_failure(got: &[u8]) -> (Vec<u64>, Option<NotReady>) {
    let mut words = Vec::new();
    let mut at = 0;
    while at + 8 <= got.len() {
        let w = u64::from_le_bytes(got[at..at + 8].try_into().expect("8 bytes"));
        at += 8;
        if w == FAIL_MARK && at + 16 <= got.len() {
            let errno = u64::from_le_bytes(got[at..at + 8].try_into().expect("8 bytes"));
            let len = u64::from_le_bytes(got[at + 8..at + 16].try_into().expect("8 bytes"));
            let text = &got[at + 16..];
            let text = &text[..text.len().min(len as usize)];
            let reason = String::from_utf8_lossy(text).into_owned();
            let errno = i32::try_from(errno).unwrap_or(0);
            return (
                words,
                Some(NotReady {
                    reason: Some(reason),
                    errno,
                }),
            );
        }
        words.push(w);
    }
    (words, None)
}

/// The vCPU's time from the ready pipe's contents, if they are the time and the mark.
pub(super) fn parse_ready(got: &[u8]) -> Result<u64, NotReady> {
    let (words, failure) = split_failure(got);
    let ended = NotReady {
        reason: None,
        errno: 0,
    };
    if let Some(f) = failure {
        return Err(f);
    }
    if got.len() != 16 {
        return Err(ended);
    }
    match (words[0] == READY_MARK, words[1] == READY_MARK) {
        (true, false) => Ok(words[1]),
        (false, true) => Ok(words[0]),
        _ => Err(ended),
    }
}

// The go channel.

/// A warm clone's go channel, or a fork source's channel to its template
/// (`sources.rs`), both ends close-on-exec: (the child's end, the parent's).
/// A socket, so that a handover's stream can travel with the launch message;
/// the parent's end gives up on a write after two seconds (a stuck child).
pub(super) fn go_channel() -> std::io::Result<(OwnedFd, std::os::unix::net::UnixStream)> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    let (child, parent) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC,
    )?;
    let parent = std::os::unix::net::UnixStream::from(parent);
    parent.set_write_timeout(Some(Duration::from_secs(2)))?;
    Ok((child, parent))
}

/// Sends a warm clone its launch message: the identity's length (4 bytes) and the
/// payload's (8 bytes), the identity (JSON) with a handover's stream attached, then the
/// handover's payload. The lengths delimit it: the channel stays open after it (a
/// rewound clone comes back on it, `rewind.rs`). The identity fits the socket's buffer;
/// a payload larger than it is written as the clone reads it (it waits for this
/// message), within the channel's send timeout.
pub(super) fn send_go(
    go: &std::os::unix::net::UnixStream,
    identity: &Identity,
) -> std::io::Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let json = serde_json::to_vec(identity).map_err(std::io::Error::other)?;
    let payload = identity
        .carried
        .as_ref()
        .map_or(&[][..], |c| &c.payload[..]);
    let mut len = [0u8; HEADER];
    len[..4].copy_from_slice(&(json.len() as u32).to_le_bytes());
    len[4..].copy_from_slice(&(payload.len() as u64).to_le_bytes());
    let ready = identity.ready.as_ref().map(|f| f.as_raw_fd());
    let conn = identity.carried.as_ref().map(|c| c.stream.as_raw_fd());
    // A new ready pipe first (a rewound clone's), the handover's stream, then the
    // slots' images in order, then the writable ones' overlay files.
    let media = identity.media_files.iter().map(|f| f.as_raw_fd());
    let overlays = identity.overlay_files.iter().map(|f| f.as_raw_fd());
    let fds: Vec<i32> = (ready.into_iter().chain(conn).chain(media).chain(overlays)).collect();
    let cmsgs: Vec<ControlMessage<'_>> = match fds.is_empty() {
        true => Vec::new(),
        false => vec![ControlMessage::ScmRights(&fds)],
    };
    let iov = [std::io::IoSlice::new(&len), std::io::IoSlice::new(&json)];
    let sent = sendmsg::<()>(go.as_raw_fd(), &iov, &cmsgs, MsgFlags::MSG_NOSIGNAL, None)?;
    let mut w = go;
    let whole: Vec<u8> = len.iter().chain(json.iter()).copied().collect();
    w.write_all(&whole[sent..])?;
    w.write_all(payload)?;
    Ok(())
}

/// The launch message's header: the identity's length (u32) and the payload's (u64).
const HEADER: usize = 12;

/// What a warm clone receives: its identity, and a handover's payload (the bytes that
/// came with the identity, and how many more are still on the go channel) and stream.
pub(super) type Go = (Identity, Option<(Vec<u8>, usize, OwnedFd)>);

/// Reads the launch message from the go channel (`send_go`): the identity's and the
/// payload's lengths, the identity (JSON) with a handover's stream attached, and of
/// the handover's payload what came with them: the rest is left on the channel for
/// the handover's taker to read where it wants it (an invocation's into the mailbox,
/// with no buffer between: in a clone every page of a new buffer is a page fault).
/// None when the parent closed the channel without launching (the warm clone is
/// discarded). The channel stays open.
pub(super) fn wait_for_go(go: RawFd) -> Result<Option<Go>, LaunchError> {
    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
    use std::io::Read;
    let bad = |e: &dyn std::fmt::Display| LaunchError(e.to_string());
    // SAFETY: the go channel's end, kept open by close_all_but; borrowed for this call
    // (ManuallyDrop: its owner closes it).
    let mut f =
        std::mem::ManuallyDrop::new(unsafe { std::os::unix::net::UnixStream::from_raw_fd(go) });
    // The first part on the stack, the rest read into a vector of the size the header
    // says, not a 64 KiB zeroed buffer on the heap: a clone's heap is its template's,
    // copied on write, so every heap page it touches is a page fault (the zeroing took
    // 12 of about 90 a launch; some of them moved to the next large allocation).
    let mut first = [0u8; 4096];
    let mut space = nix::cmsg_space!([RawFd; 2 + 2 * api_types::MAX_DISK_SLOTS]);
    let (got, mut fds) = loop {
        let mut iov = [std::io::IoSliceMut::new(&mut first)];
        let msg = match recvmsg::<()>(go, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC) {
            Err(nix::errno::Errno::EINTR) => continue,
            r => r.map_err(|e| bad(&e))?,
        };
        let mut fds = Vec::new();
        for c in msg.cmsgs().map_err(|e| bad(&e))? {
            if let ControlMessageOwned::ScmRights(got) = c {
                for fd in got {
                    // SAFETY: a descriptor just received, owned by nobody else.
                    fds.push(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        break (msg.bytes, fds.into_iter());
    };
    if got == 0 {
        return Ok(None);
    }
    let mut buf = first[..got].to_vec();
    if buf.len() < HEADER {
        let mut rest = vec![0u8; HEADER - buf.len()];
        f.read_exact(&mut rest).map_err(|e| bad(&e))?;
        buf.extend_from_slice(&rest);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]) as usize;
    let mut payload_len = [0u8; 8];
    payload_len.copy_from_slice(&buf[4..HEADER]);
    let payload_len = usize::try_from(u64::from_le_bytes(payload_len))
        .map_err(|_| bad(&"a payload too large"))?;
    let identity_end = HEADER + len;
    if buf.len() < identity_end {
        let have = buf.len();
        buf.resize(identity_end, 0);
        f.read_exact(&mut buf[have..]).map_err(|e| bad(&e))?;
    }
    let unread = payload_len
        .checked_sub(buf.len() - identity_end)
        .ok_or_else(|| bad(&"more payload than the header says"))?;
    let json = buf
        .get(HEADER..HEADER + len)
        .ok_or_else(|| bad(&"identity cut short"))?;
    let mut identity: Identity = serde_json::from_slice(json).map_err(|e| bad(&e))?;
    let payload = buf.split_off(HEADER + len);
    // A new ready pipe comes first, then the handover's stream, then the slots'
    // images, then the overlays.
    if identity.ready_attached {
        let fd = fds
            .next()
            .ok_or_else(|| bad(&"a ready pipe said to be attached is not"))?;
        identity.ready = Some(Arc::new(std::fs::File::from(fd)));
    }
    let carried = match identity.note {
        Some(_) => {
            let missing = || LaunchError("a handover without its stream".into());
            Some((payload, unread, fds.next().ok_or_else(missing)?))
        }
        None if payload_len > 0 => return Err(bad(&"a payload without a handover")),
        None => None,
    };
    let mut files = fds.map(|fd| Arc::new(std::fs::File::from(fd)));
    identity.media_files = files.by_ref().take(identity.media.len()).collect();
    identity.overlay_files = files.collect();
    let writable = identity.media.iter().filter(|m| m.2).count();
    if identity.media_files.len() != identity.media.len()
        || identity.overlay_files.len() != writable
    {
        return Err(LaunchError(format!(
            "{} disk slot images and {} overlays for {} slots, {writable} writable",
            identity.media_files.len(),
            identity.overlay_files.len(),
            identity.media.len()
        )));
    }
    Ok(Some((identity, carried)))
}

/// Tells the parent, on the go channel, that this warm clone's prime is done.
pub(super) fn report_primed(go: RawFd) -> nix::Result<()> {
    nix::sys::socket::send(go, &[1], nix::sys::socket::MsgFlags::MSG_NOSIGNAL).map(drop)
}

/// Tells the parent, on the go channel, that this clone is rewound and may be launched
/// again (`rewind.rs`).
pub(super) fn report_back(go: RawFd) -> nix::Result<()> {
    let back = [super::rewind::BACK];
    nix::sys::socket::send(go, &back, nix::sys::socket::MsgFlags::MSG_NOSIGNAL).map(drop)
}

/// Tells the parent, on the go channel, that the life this clone served ended and it
/// rewinds now (`rewind.rs`).
pub(super) fn report_life_ended(go: RawFd) -> nix::Result<()> {
    let ended = [super::rewind::ENDED];
    nix::sys::socket::send(go, &ended, nix::sys::socket::MsgFlags::MSG_NOSIGNAL).map(drop)
}

/// Where a primed warm clone's prime stands, as its go channel says (without waiting).
pub(super) enum PrimeReport {
    /// Done: it may be launched.
    Done,
    /// Still running.
    Pending,
    /// The clone is gone (the channel ended or failed).
    Ended,
}

/// Reads a warm clone's prime report from the parent's end of its go channel (with
/// `peek`, leaves it there).
pub(super) fn prime_report(go: &UnixStream, peek: bool) -> PrimeReport {
    match report_byte(go, peek) {
        Ok(Some(_)) => PrimeReport::Done,
        Ok(None) => PrimeReport::Pending,
        Err(()) => PrimeReport::Ended,
    }
}

/// What a launched clone to be rewound said last on its go channel.
pub(super) enum BackReport {
    /// Nothing new.
    Nothing,
    /// The life it served ended; it rewinds ([`report_life_ended`]).
    LifeEnded,
    /// It is rewound and may be launched again ([`report_back`]).
    Back,
}

/// What a launched clone says next, on the parent's end of its go channel (without
/// waiting); Err: it ended (or said something else).
pub(super) fn back_report(go: &UnixStream) -> Result<BackReport, ()> {
    match report_byte(go, false)? {
        Some(b) if b == super::rewind::BACK => Ok(BackReport::Back),
        Some(b) if b == super::rewind::ENDED => Ok(BackReport::LifeEnded),
        Some(_) => Err(()),
        None => Ok(BackReport::Nothing),
    }
}

/// The next byte a clone wrote on its go channel without waiting (with `peek`, left
/// there): None when there is none yet, Err when the channel ended or failed.
fn report_byte(go: &UnixStream, peek: bool) -> Result<Option<u8>, ()> {
    use nix::sys::socket::{recv, MsgFlags};
    let mut byte = [0u8; 1];
    let flags = match peek {
        true => MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_PEEK,
        false => MsgFlags::MSG_DONTWAIT,
    };
    match recv(go.as_raw_fd(), &mut byte, flags) {
        Ok(1) => Ok(Some(byte[0])),
        Err(nix::errno::Errno::EAGAIN) => Ok(None),
        _ => Err(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_launch_leaves_the_payloads_rest_on_the_channel_for_the_taker() {
        use super::super::request::Carried;
        use std::io::Read;
        let (child, parent) = go_channel().unwrap();
        let payload: Vec<u8> = (0..300_000u32).map(|i| (i % 253) as u8).collect();
        let (ours, _theirs) = UnixStream::pair().unwrap();
        let mut id: Identity = serde_json::from_value(serde_json::json!({
            "id": "1.7", "api_sock": "/nonexistent", "console": "/dev/null", "note": {}
        }))
        .unwrap();
        id.carried = Some(Arc::new(Carried {
            payload: payload.clone(),
            stream: Arc::new(ours),
        }));
        // Larger than the socket's buffer: the sender waits for the taker's reads.
        let sender = std::thread::spawn(move || send_go(&parent, &id).map(|()| parent));
        let (got, carried) = wait_for_go(child.as_raw_fd()).unwrap().unwrap();
        let (first, unread, _stream) = carried.unwrap();
        assert_eq!(got.id, "1.7");
        assert!(unread > 0 && first.len() + unread == payload.len());
        let mut rest = vec![0u8; unread];
        let mut from = File::from(child);
        from.read_exact(&mut rest).unwrap();
        assert_eq!([first, rest].concat(), payload);
        let _parent = sender.join().unwrap().unwrap();
    }

    fn ready_bytes(parts: &[u64]) -> Vec<u8> {
        parts.iter().flat_map(|p| p.to_le_bytes()).collect()
    }

    #[test]
    fn ready_pipe_needs_the_time_and_the_mark_in_either_order() {
        let mark = READY_MARK;
        let ended = Err(NotReady {
            reason: None,
            errno: 0,
        });
        assert_eq!(parse_ready(&ready_bytes(&[42, mark])), Ok(42));
        assert_eq!(parse_ready(&ready_bytes(&[mark, 42])), Ok(42));
        // The vCPU ran but the clone failed before its control socket was up.
        assert_eq!(parse_ready(&ready_bytes(&[42])), ended);
        // The control thread finished but vCPU 0 never entered the guest.
        assert_eq!(parse_ready(&ready_bytes(&[mark])), ended);
        assert_eq!(parse_ready(&ready_bytes(&[mark, mark])), ended);
        assert_eq!(parse_ready(&ready_bytes(&[1, 2])), ended);
        assert_eq!(parse_ready(&[]), ended);
        assert_eq!(parse_ready(&ready_bytes(&[42, mark])[..15]), ended);
    }

    #[test]
    fn a_clone_that_failed_says_why_with_its_error_number() {
        let mut got = ready_bytes(&[42, FAIL_MARK, libc::ENOSPC as u64, 5]);
        got.extend_from_slice(b"full!ignored");
        let why = parse_ready(&got).unwrap_err();
        assert_eq!(why.reason.as_deref(), Some("full!"));
        assert_eq!(why.errno, libc::ENOSPC);
        assert_eq!(why.to_string(), "full!");
        // A record cut short is a clone that ended without a word.
        let cut = ready_bytes(&[FAIL_MARK, 0]);
        assert_eq!(parse_ready(&cut).unwrap_err().reason, None);
    }
}
