//! Clones whose start the template does not wait for: an invocation's clone answers its
//! caller itself, so the template goes back to its next request as soon as the clone is
//! launched (a warm one) or forked, and watches the clone's ready pipe from its event
//! loop instead of blocking on it (`wire::wait_ready` reads the same pipe for clone
//! requests, whose answer lists the clones as they started).
//!
//! Waiting made a template serial: it served one request per launch and, with its
//! warm pool empty, per fork and rebuild of a clone (about 2 ms each), however many
//! cores the host had.
//!
//! The pipes are watched by an epoll of their own, whose descriptor the controller's
//! event loop watches in turn ([`Starting::fd`]).

use std::collections::HashMap;
use std::fs::File;
use std::io::Read;
use std::os::fd::{AsRawFd, RawFd};
use std::time::{Duration, Instant};

use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::fork::READY_TIMEOUT;
use super::wire::{parse_ready, NotReady};

/// One clone not reported ready yet.
struct Pending {
    ready: File,
    /// When its request arrived (CLOCK_MONOTONIC ns).
    since_ns: u64,
    got: Vec<u8>,
    deadline: Instant,
}

/// How a watched clone's start ended.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct Started {
    /// The clone.
    pub pid: i32,
    /// When its request arrived (CLOCK_MONOTONIC ns).
    pub since_ns: u64,
    /// When its vCPU 0 first entered the guest (CLOCK_MONOTONIC ns), or why it never
    /// reported that.
    pub entered: Result<u64, NotReady>,
}

/// The ready pipes of clones not reported ready yet.
#[derive(Default)]
pub(super) struct Starting {
    /// None until the event loop asks for it ([`Starting::fd`]); without it, a start is
    /// waited for as a clone request's is.
    epoll: Option<Epoll>,
    pending: HashMap<i32, Pending>,
}

impl Starting {
    /// The descriptor that is readable while a watched pipe has something to read;
    /// made on the first call. Until it is asked for, nothing is watched.
    pub fn fd(&mut self) -> std::io::Result<RawFd> {
        let epoll = match &self.epoll {
            Some(e) => e,
            None => self.epoll.insert(Epoll::new()?),
        };
        Ok(epoll.as_raw_fd())
    }

    /// Watches the ready pipe `ready` of clone `pid`, requested at `since_ns`; gives it
    /// back when nothing watches (then the caller waits for it).
    pub fn watch(&mut self, pid: i32, ready: File, since_ns: u64) -> Result<(), File> {
        let Some(epoll) = &self.epoll else {
            return Err(ready);
        };
        use nix::fcntl::{fcntl, OFlag, F_SETFL};
        let nonblocking = fcntl(&ready, F_SETFL(OFlag::O_NONBLOCK));
        let fd = ready.as_raw_fd();
        let event = EpollEvent::new(EventSet::IN, pid as u64);
        if nonblocking.is_err() || epoll.ctl(ControlOperation::Add, fd, event).is_err() {
            return Err(ready);
        }
        let deadline = Instant::now() + READY_TIMEOUT;
        let got = Vec::with_capacity(16);
        let p = Pending {
            ready,
            since_ns,
            got,
            deadline,
        };
        self.pending.insert(pid, p);
        Ok(())
    }

    /// Time until the first watched clone runs out of time to report.
    pub fn due_in(&self) -> Option<Duration> {
        let first = self.pending.values().map(|p| p.deadline).min()?;
        Some(first.saturating_duration_since(Instant::now()))
    }

    /// The starts that ended since last asked: pipes read to their end, and clones
    /// that ran out of time.
    pub fn take_ended(&mut self) -> Vec<Started> {
        let mut ended = Vec::new();
        if let Some(epoll) = &self.epoll {
            let mut events = [EpollEvent::default(); 32];
            loop {
                let n = epoll.wait(0, &mut events).unwrap_or(0);
                for ev in &events[..n] {
                    let pid = ev.data() as i32;
                    if let Some(p) = self.pending.get_mut(&pid) {
                        if read_available(&mut p.ready, &mut p.got) {
                            let p = self.pending.remove(&pid).expect("present");
                            let entered = parse_ready(&p.got);
                            let since_ns = p.since_ns;
                            ended.push(Started {
                                pid,
                                since_ns,
                                entered,
                            });
                        }
                    }
                }
                if n < events.len() {
                    break;
                }
            }
        }
        let now = Instant::now();
        let late: Vec<i32> = (self.pending.iter())
            .filter(|(_, p)| p.deadline <= now)
            .map(|(&pid, _)| pid)
            .collect();
        for pid in late {
            let Some(p) = self.pending.remove(&pid) else {
                continue;
            };
            let reason = format!(
                "it did not report ready within {} s",
                READY_TIMEOUT.as_secs()
            );
            let entered = Err(NotReady {
                reason: Some(reason),
                errno: 0,
            });
            ended.push(Started {
                pid,
                since_ns: p.since_ns,
                entered,
            });
        }
        ended
    }
}

/// Reads what `f` holds now into `got`; true once the pipe has ended (or failed).
fn read_available(f: &mut File, got: &mut Vec<u8>) -> bool {
    let mut b = [0u8; 512];
    loop {
        match f.read(&mut b) {
            Ok(0) => return true,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    use super::super::wire::READY_MARK;

    fn pipe() -> (File, File) {
        let (r, w) = super::super::fork::pipe().unwrap();
        (File::from(r), File::from(w))
    }

    #[test]
    fn a_start_ends_when_its_pipe_does_with_the_time_or_the_failure() {
        let mut s = Starting::default();
        let (r, w) = pipe();
        // Nothing watches before the event loop asks: the pipe comes back.
        let r = s.watch(7, r, 1).unwrap_err();
        let fd = s.fd().unwrap();
        assert!(fd >= 0);
        s.watch(7, r, 1).unwrap();
        let (r2, w2) = pipe();
        s.watch(8, r2, 1).unwrap();
        assert_eq!(s.pending.len(), 2);
        assert!(s.take_ended().is_empty());
        // Clone 7: the vCPU's time and the mark, in two writes, then the end.
        let mut w = w;
        w.write_all(&42u64.to_le_bytes()).unwrap();
        assert!(s.take_ended().is_empty(), "half a report is no end");
        w.write_all(&READY_MARK.to_le_bytes()).unwrap();
        drop(w);
        // Clone 8 ended without a word.
        drop(w2);
        let mut ended = s.take_ended();
        ended.sort_by_key(|e| e.pid);
        assert_eq!(ended.len(), 2);
        assert_eq!(
            ended[0],
            Started {
                pid: 7,
                since_ns: 1,
                entered: Ok(42)
            }
        );
        assert_eq!(ended[1].pid, 8);
        assert!(ended[1].entered.as_ref().unwrap_err().reason.is_none());
        assert_eq!(s.pending.len(), 0);
        assert_eq!(s.due_in(), None);
    }

    #[test]
    fn a_start_that_outlives_its_deadline_ends_as_a_failure() {
        let mut s = Starting::default();
        s.fd().unwrap();
        let (r, _w) = pipe();
        s.watch(9, r, 1).unwrap();
        assert!(s.due_in().unwrap() > Duration::from_secs(1));
        s.pending.get_mut(&9).unwrap().deadline = Instant::now();
        let ended = s.take_ended();
        assert_eq!(ended.len(), 1);
        let why = ended[0].entered.as_ref().unwrap_err();
        assert!(why
            .reason
            .as_deref()
            .unwrap()
            .contains("did not report ready"));
        assert_eq!(s.pending.len(), 0);
    }
}
