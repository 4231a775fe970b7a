//! Warm clones: pre-built clones of a paused template, launched on request.
//!
//! While a template is paused its memory and vCPU state cannot change, so a clone
//! forked now is the same as one forked when the request comes. With `--warm-clones N`
//! a paused VM keeps N such children ready: each has forked, created its VM, registered
//! guest memory and restored its vCPUs, and waits on a pipe. A request hands a warm
//! clone its identity (id, socket, console); it re-times its clocks to the launch, adds
//! its devices and VM-wide state, and starts its vCPUs. This takes VM creation — on a
//! PVM host the costliest step, and the one that grows with guest memory (the memory
//! slot's shadow-paging metadata) — and fork itself off the request path. The pool is
//! refilled from the event loop when it is idle.
//!
//! Resuming the template discards every warm clone (they hold the paused memory, not
//! what the running guest does next), and so does anything that changes device state
//! while paused (host input to the serial port). Warm clones die with the template
//! (`PR_SET_PDEATHSIG`).

use std::collections::VecDeque;
use std::fs::File;
use std::io::Write;
use std::os::fd::AsRawFd;
use std::sync::Arc;

use serde::Serialize;

use clone::MicrovmState;

use super::cgroups::CloneCgroup;
use super::child::{Identity, Start};
use super::{pipe, CloneError};
use crate::microvm::{Microvm, VmState};

/// Most warm clones a VM may keep.
pub const MAX_WARM_CLONES: usize = 256;

/// A forked, prepared clone waiting for its identity.
struct WarmClone {
    pid: i32,
    /// Write end of its go pipe.
    go: File,
    /// Read end of its ready pipe.
    ready: File,
    /// The cgroup (of the first class) it already sits in, with cgroup pools.
    cgroup: Option<CloneCgroup>,
}

/// The warm clones of one paused VM, and the state they were made from.
#[derive(Default)]
pub struct WarmPool {
    /// How many to keep ready while paused.
    target: usize,
    /// The paused VM's captured state, valid until it resumes.
    pub(super) epoch: Option<Arc<MicrovmState>>,
    clones: VecDeque<WarmClone>,
    /// Warm clones launched since start.
    launched: u64,
    /// Warm clones discarded unused.
    discarded: u64,
    /// When clones were last requested.
    last_request: Option<std::time::Instant>,
}

/// What `GET /vm` reports about the pool.
#[derive(Debug, Serialize)]
pub struct WarmReport {
    /// Kept ready while the VM is paused.
    pub target: usize,
    /// Forked and waiting now.
    pub ready: usize,
    /// Launched on requests so far.
    pub launched: u64,
    /// Discarded unused so far (the template resumed or changed).
    pub discarded: u64,
}

impl WarmPool {
    /// A pool that keeps `target` warm clones while the VM is paused.
    pub fn new(target: usize) -> Self {
        let mut pool = Self::default();
        pool.target = target.min(MAX_WARM_CLONES);
        pool
    }

    /// The figures for `GET /vm`.
    pub fn report(&self) -> WarmReport {
        WarmReport {
            target: self.target,
            ready: self.clones.len(),
            launched: self.launched,
            discarded: self.discarded,
        }
    }

    /// Time since clones were last requested (long ago if never).
    pub fn since_last_launch(&self) -> std::time::Duration {
        self.last_request
            .map_or(std::time::Duration::MAX, |t| t.elapsed())
    }

    /// Records a clone request (the refill waits a moment after one).
    pub(super) fn note_request(&mut self) {
        self.last_request = Some(std::time::Instant::now());
    }

    /// Whether `pid` was a warm clone (it died: forget it).
    pub fn reaped(&mut self, pid: i32) -> bool {
        let before = self.clones.len();
        self.clones.retain(|c| c.pid != pid);
        before != self.clones.len()
    }

    /// Kills and reaps every warm clone and forgets the captured state. Returns the
    /// pids it reaped.
    pub fn discard(&mut self) -> Vec<i32> {
        self.epoch = None;
        let mut pids = Vec::with_capacity(self.clones.len());
        for c in self.clones.drain(..) {
            // SAFETY: signalling and reaping our own child by pid.
            unsafe {
                libc::kill(c.pid, libc::SIGKILL);
                libc::waitpid(c.pid, std::ptr::null_mut(), 0);
            }
            self.discarded += 1;
            pids.push(c.pid);
        }
        pids
    }

    /// Takes a warm clone, if one is ready.
    fn take(&mut self) -> Option<WarmClone> {
        let c = self.clones.pop_front()?;
        self.launched += 1;
        Some(c)
    }
}

impl Drop for WarmPool {
    fn drop(&mut self) {
        self.discard();
    }
}

impl Microvm {
    /// Discards every warm clone (see [`WarmPool::discard`]) and returns their cgroups
    /// to the pool.
    pub(crate) fn discard_warm_clones(&mut self) {
        for pid in self.warm.discard() {
            if let Some(c) = self.cgroups.as_mut() {
                c.exited(pid);
            }
        }
    }

    /// Whether the event loop should add a warm clone now.
    pub(crate) fn wants_warm_clone(&self) -> bool {
        self.state == VmState::Paused
            && self.warm.clones.len() < self.warm.target
            && self.pending_events.is_empty()
    }

    /// The paused VM's state, captured once per pause.
    pub(super) fn epoch_state(&mut self) -> Result<Arc<MicrovmState>, CloneError> {
        if let Some(s) = &self.warm.epoch {
            return Ok(s.clone());
        }
        let s = Arc::new(self.capture()?);
        self.warm.epoch = Some(s.clone());
        Ok(s)
    }

    /// Forks one warm clone. Errors are logged; the pool stops growing until the VM
    /// is paused again.
    pub(crate) fn add_warm_clone(&mut self) {
        if let Err(e) = self.try_add_warm_clone() {
            tracing::warn!(
                "cannot make a warm clone: {e}; keeping {}",
                self.warm.clones.len()
            );
            self.warm.target = self.warm.clones.len();
        }
    }

    fn try_add_warm_clone(&mut self) -> Result<(), CloneError> {
        let state = self.epoch_state()?;
        let (ready_read, ready_write) = pipe().map_err(CloneError::Os)?;
        let (go_read, go_write) = pipe().map_err(CloneError::Os)?;
        // A cgroup of the first class, entered now, off any request's path.
        let taken = match &self.cgroups {
            Some(p) => Some(p.take(None)?),
            None => None,
        };
        let (placement, cgroup) = self.placement(taken.as_ref());
        let start = Start::Warm {
            go: go_read.as_raw_fd(),
            cgroup: placement,
        };
        // The VM is paused: every vCPU is parked.
        let pid = match self.fork_child(&state, &ready_write, start, taken.as_ref()) {
            Ok((pid, _)) => pid,
            Err(e) => {
                self.give_back([taken]);
                return Err(e);
            }
        };
        self.started_in(pid, taken);
        self.warm.clones.push_back(WarmClone {
            pid,
            go: File::from(go_write),
            ready: File::from(ready_read),
            cgroup,
        });
        Ok(())
    }

    /// Launches a warm clone with `identity`; returns its pid, ready pipe and cgroup, or
    /// None when no warm clone is ready.
    pub(super) fn launch_warm_clone(
        &mut self,
        identity: &Identity,
    ) -> Option<(i32, File, Option<CloneCgroup>)> {
        loop {
            let mut c = self.warm.take()?;
            let msg = serde_json::to_vec(identity).expect("an identity serializes");
            // The go pipe is new and holds far less than a pipe buffer: this does not
            // block. The child reads to end of file, so closing the pipe sends it.
            if c.go.write_all(&msg).is_ok() {
                return Some((c.pid, c.ready, c.cgroup));
            }
            // The warm clone died: reap it and try the next.
            // SAFETY: reaping our own child by pid.
            unsafe { libc::waitpid(c.pid, std::ptr::null_mut(), 0) };
            if let Some(p) = self.cgroups.as_mut() {
                p.exited(c.pid);
            }
        }
    }
}
