//! Stage 4, fork: one child per clone, each forked through the fork gate
//! (`crate::gate`: no other thread holds a lock or is inside malloc) into its cgroup
//! where it has one: born inside with `clone3(CLONE_INTO_CGROUP)` on v2, forked by the
//! forker thread waiting inside on v1 (`forker.rs`), or moving itself in first
//! (`cgroups.rs`). Guest RAM is anonymous `MAP_PRIVATE` memory, so every child shares
//! it copy-on-write; each writable disk's overlay is copied for it first.
//!
//! The parent then waits on each child's ready pipe (below) for the time its vCPU 0
//! first entered the guest and the mark that its sockets are up.
//!
//! Next, in the child: the rebuild (`child.rs`).

use std::fs::File;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use std::time::{Duration, Instant};

use api_types::cgroup::PlacedBy;
use api_types::CloneInfo;
use clone::MicrovmState;

use super::cgroups::{self, ClonePools, Taken};
use super::child::{child_main, ChildPlan, ServeClone, Start, FAIL_MARK, READY_MARK};
use super::request::{give_back, starting_info, NewClone};
use super::CloneError;
use crate::microvm::Microvm;

/// How long the parent waits for a clone's vCPU 0 to enter the guest.
pub(super) const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Forks one child that rebuilds `vm` from `state` and starts per `start`; `ready` is
/// the write end of its ready pipe; `taken` its cgroup: the child is born in it when
/// it is a v2 one (`clone3`) or the forker's seat with the forker inside (v1). Returns
/// the child's pid and whether it was born inside its cgroup that way. Every vCPU
/// must be parked.
pub(super) fn fork_child(
    vm: &Microvm,
    pools: Option<&ClonePools>,
    serve: ServeClone,
    state: &MicrovmState,
    ready: &OwnedFd,
    start: Start,
    taken: Option<&Taken>,
) -> Result<(i32, bool), CloneError> {
    let run_bases: Vec<usize> = vm.vcpus().iter().map(|v| v.kvm_run_base()).collect();
    // The child's copies of the disk overlays: the disks' workers are parked, so each
    // overlay holds exactly what the guest wrote up to the clone point. The parent
    // closes its descriptors of the copies when this returns.
    let t0 = Instant::now();
    let overlays = vm.devices().snapshot_overlays()?;
    let t_overlays = t0.elapsed();
    let plan = ChildPlan {
        parent_pid: nix::unistd::getpid().as_raw(),
        ready: ready.as_raw_fd(),
        start,
        state,
        template: vm,
        serve,
        run_bases: &run_bases,
        overlays: &overlays,
    };
    let into = taken.and_then(|t| t.dir.as_ref());
    let fork = |mut plan: ChildPlan<'_>, born_inside: bool| {
        if let (true, Start::Now(id)) = (born_inside, &mut plan.start) {
            id.cgroup = None;
        }
        // SAFETY: every vCPU and virtio worker is parked holding no lock, the API
        // thread holds none while the gate is closed (see `gate`), and on the forker
        // the main thread waits for this without holding one: so neither fork() nor
        // clone3 (which skips glibc's fork handling, see `fork_into`) leaves the child a
        // lock or a malloc arena that nobody will release.
        match crate::gate::closed(|| unsafe { cgroups::fork_into(into) }) {
            // Read on the thread that forked.
            -1 => Err(CloneError::Os(std::io::Error::last_os_error())),
            0 => child_main(plan),
            pid => Ok(pid),
        }
    };
    let forker = pools
        .zip(taken)
        .and_then(|(p, t)| Some((p.forker_for(t)?, t.name())));
    let mut plan = Some(plan);
    let on_forker = forker.and_then(|(f, name)| {
        f.run(|seated| {
            let born = seated == Some(name);
            plan.take().map(|p| (fork(p, born), born))
        })
        .flatten()
    });
    let (forked, born_inside) = match (on_forker, plan) {
        (Some(done), _) => done,
        // No forker, or it is gone: from this thread (the clone moves itself in).
        (None, Some(plan)) => (fork(plan, false), false),
        (None, None) => unreachable!("the plan is taken only by a fork"),
    };
    let pid = forked?;
    tracing::debug!(
        "clone {pid}: overlay copies {} us, fork {} us{}",
        t_overlays.as_micros(),
        (t0.elapsed() - t_overlays).as_micros(),
        if born_inside { " (forker)" } else { "" }
    );
    Ok((pid, born_inside))
}

/// Forks a child for each of `clones` (identity and cgroup), launching each at once.
/// Returns each clone's record and the read end of its ready pipe. On failure the
/// cgroups of the clones not started go back to their pools, and the clones started
/// come back with the error ([`Partial`]).
pub(super) fn fork_all(
    vm: &Microvm,
    mut pools: Option<&mut ClonePools>,
    serve: ServeClone,
    state: &MicrovmState,
    clones: Vec<NewClone>,
) -> Result<Vec<Made>, Partial> {
    let mut made = Vec::with_capacity(clones.len());
    let mut clones = clones.into_iter();
    while let Some((mut identity, taken)) = clones.next() {
        let (placement, mut cgroup) = cgroups::placement_of(pools.as_deref(), taken.as_ref());
        identity.cgroup = placement;
        let forked = pipe()
            .map_err(CloneError::Os)
            .and_then(|(read_end, write_end)| {
                let start = Start::Now(Box::new(identity.clone()));
                let forked = fork_child(
                    vm,
                    pools.as_deref(),
                    serve,
                    state,
                    &write_end,
                    start,
                    taken.as_ref(),
                )?;
                Ok((forked, read_end))
            });
        match forked {
            Ok(((pid, born_inside), read_end)) => {
                if born_inside {
                    identity.cgroup = None;
                    if let Some(c) = cgroup.as_mut() {
                        c.placed_by = PlacedBy::Forker;
                    }
                }
                cgroups::started_in(pools.as_deref_mut(), pid, taken);
                made.push((
                    starting_info(identity, pid, cgroup, vm.config()),
                    File::from(read_end),
                ));
            }
            Err(error) => {
                give_back(
                    pools.as_deref(),
                    std::iter::once(taken).chain(clones.map(|(_, t)| t)),
                );
                let made = made.into_iter().map(|(info, _)| info).collect();
                return Err(Partial { made, error });
            }
        }
    }
    Ok(made)
}

/// A clone started, with the read end of its ready pipe.
pub(super) type Made = (CloneInfo, File);

/// A request that failed after it had started some clones: those (to be ended: the
/// caller learns of none) and the error.
pub(super) struct Partial {
    /// The clones started before the failure.
    pub made: Vec<CloneInfo>,
    /// The failure.
    pub error: CloneError,
}

/// A warm clone's go channel, both ends close-on-exec: (the child's end, the parent's).
/// A socket, so that an invocation's connection can travel with the launch message;
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

/// A new pipe, both ends close-on-exec: (read end, write end).
pub(super) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?)
}

/// Why a clone never reported ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NotReady {
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
fn parse_ready(got: &[u8]) -> Result<u64, NotReady> {
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

#[cfg(test)]
mod tests {
    use super::*;

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
