//! Rewound clones coming back to their template's warm pool (`rewind.rs`): the
//! launched clones it watches, and what it does when one says its life ended or it is
//! back.

use std::os::fd::{AsRawFd, RawFd};

use api_types::vm::VmState;
use api_types::CloneCgroup;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use super::{WarmClone, WarmPool};
use crate::cloning::cgroups::ClonePools;
use crate::cloning::wire::{back_report, BackReport};
use crate::microvm::Microvm;

/// With cgroup pools, what a clone's cgroup is charged for besides its requests, by
/// which its memory limit is raised (`ClonePools::allow_ahead`, [`Held::allow`]).
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Held {
    /// The working set it wrote ahead, in bytes (its limit is raised by as much before
    /// its fork).
    pub ahead: u64,
    /// A clone to be rewound: the memory charged to its cgroup at its first launch.
    pub at_launch: Option<u64>,
    /// What its limit was last raised by beyond its class's, in bytes.
    pub allowed: u64,
}

impl Held {
    /// Clone `pid` came back rewound, its cgroup charged `first` bytes at its first
    /// launch: it holds what it held then and the pages its earlier requests wrote (the
    /// template's contents again, still its own and charged), so its memory limit is
    /// raised by those beyond what it wrote ahead, rounded up to a MiB (written only
    /// when that changed), and its next request may use what a fresh clone's may.
    /// False when it keeps more than its class's whole limit: it is to end.
    ///
    /// A warm clone that is not primed may be launched while it still writes ahead
    /// (it finishes before its request runs): `first`, read at the launch, then lacks
    /// the rest of those pages, which would count as kept (the whole set, in a clone
    /// launched at once: one that wrote nothing of its own ended for keeping its
    /// working set). Once written ahead it holds at least them: `first` is taken as at
    /// least `ahead` (what it counts too much then is the little it holds besides).
    fn allow(&mut self, pools: &ClonePools, pid: i32, first: u64) -> bool {
        let first = first.max(self.ahead);
        let now = pools.memory_now(pid).unwrap_or(first);
        let kept = now.saturating_sub(first);
        if pools.keeps_too_much(pid, kept) {
            return false;
        }
        let extra = self.ahead.saturating_add(kept).next_multiple_of(1 << 20);
        if extra != self.allowed && pools.allow_extra(pid, extra) {
            self.allowed = extra;
        }
        true
    }
}

/// A launched clone that may come back rewound.
pub(super) struct Out {
    pub pid: i32,
    pub go: std::os::unix::net::UnixStream,
    /// The generation it was launched in.
    pub generation: u64,
    pub primed: bool,
    /// Whether it said the life it served ended (its request's record ended then).
    pub life_ended: bool,
    /// Its cgroup, which it keeps from one life to the next (cgroup pools).
    pub cgroup: Option<CloneCgroup>,
    pub held: Held,
}

impl WarmPool {
    /// The descriptor that is readable while a launched clone says it is back (or
    /// ended); made on the first call.
    pub(in crate::cloning) fn back_fd(&mut self) -> std::io::Result<RawFd> {
        let epoll = match &self.back {
            Some(e) => e,
            None => self.back.insert(Epoll::new()?),
        };
        Ok(epoll.as_raw_fd())
    }

    /// Stops watching launched clone `i` and returns it.
    pub(super) fn forget_out(&mut self, i: usize) -> Out {
        let o = self.out.swap_remove(i);
        if let Some(e) = &self.back {
            let _ = e.ctl(
                ControlOperation::Delete,
                o.go.as_raw_fd(),
                EpollEvent::default(),
            );
        }
        o
    }

    /// Takes back the launched clones that say they are rewound: those launched in
    /// this generation of a paused template join the pool, the others are killed (and
    /// one in a cgroup pool that keeps more memory than its class allows a request).
    /// Returns the pids whose lives ended (their requests' records end): those that
    /// said so, and those that came back without saying it first.
    pub(in crate::cloning) fn take_back(
        &mut self,
        vm: &Microvm,
        pools: Option<&ClonePools>,
    ) -> Vec<i32> {
        let mut ended = Vec::new();
        let mut i = 0;
        while i < self.out.len() {
            match back_report(&self.out[i].go) {
                Ok(BackReport::Nothing) => i += 1,
                Ok(BackReport::LifeEnded) => {
                    let o = &mut self.out[i];
                    tracing::debug!("clone pid {}: its life ended, it rewinds", o.pid);
                    if !std::mem::replace(&mut o.life_ended, true) {
                        ended.push(o.pid);
                    }
                    // It may have said it is back too: read on.
                }
                Ok(BackReport::Back) => {
                    let mut o = self.forget_out(i);
                    if !o.life_ended {
                        ended.push(o.pid);
                    }
                    let current = o.generation == self.generation && vm.state() == VmState::Paused;
                    let fits = match pools.zip(o.held.at_launch) {
                        Some((p, first)) => o.held.allow(p, o.pid, first),
                        None => true,
                    };
                    // The pool grows with the requests in flight (their clones were
                    // replaced while out), up to four times its target.
                    if !current || !fits || self.clones.len() >= 4 * self.target.max(1) {
                        self.discard_one(o.pid);
                        continue;
                    }
                    self.rewound += 1;
                    tracing::debug!(
                        "clone pid {} back, rewound ({} so far)",
                        o.pid,
                        self.rewound
                    );
                    self.clones.push_back(WarmClone {
                        pid: o.pid,
                        go: o.go,
                        ready: None,
                        cgroup: o.cgroup,
                        primed: o.primed,
                        prime_done: true,
                        stale: false,
                        held: o.held,
                    });
                }
                // Ended (or said something else): the reaping takes it.
                Err(()) => {
                    let o = self.forget_out(i);
                    tracing::debug!("clone pid {} ended instead of coming back", o.pid);
                }
            }
        }
        ended
    }

    /// Watches launched clone `pid`'s go channel for its coming back rewound.
    pub(super) fn watch_out(
        &mut self,
        pid: i32,
        go: std::os::unix::net::UnixStream,
        primed: bool,
        cgroup: Option<CloneCgroup>,
        held: Held,
    ) {
        let watched = self.back.as_ref().is_some_and(|e| {
            let event = EpollEvent::new(EventSet::IN, pid as u64);
            e.ctl(ControlOperation::Add, go.as_raw_fd(), event).is_ok()
        });
        if watched {
            let generation = self.generation;
            self.out.push(Out {
                pid,
                go,
                generation,
                primed,
                life_ended: false,
                cgroup,
                held,
            });
        }
    }
}
