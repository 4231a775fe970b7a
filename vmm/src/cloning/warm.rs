//! Stage 6, warm clones: for a paused template, stages 4 and 5 are done ahead of the
//! request; the request only hands a clone its identity. The spare overlay files each
//! clone of a writable disk needs are made ahead here too.
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
use std::os::fd::AsRawFd;
use std::sync::Arc;

use std::time::{Duration, Instant};

use api_types::vm::{VmState, WarmReport};
use api_types::CloneCgroup;
use clone::MicrovmState;
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;
use vmm_sys_util::epoll::Epoll;

use super::capture::capture;
use super::cgroups::{placement_of, started_in, ClonePools};
use super::child::{Lineage, Start, PRIME_TIMEOUT_EXIT};
use super::fork::{fork_child, pipe};
use super::request::{give_back, Identity};
use super::wire::{go_channel, prime_report, send_go, PrimeReport};

mod back;
use super::working::{prime_pages, ForChild, PageSet, PAGE};
use super::CloneError;
use crate::config::MAX_WARM_CLONES;
use crate::microvm::Microvm;
use back::{Held, Out};

/// How long after a clone request the event loop waits before preparing the next clone
/// (forking a warm clone, making spare overlay files): work done at once would compete
/// with the clone just made and with the answer to its request.
pub const REFILL_DELAY: Duration = Duration::from_millis(5);

/// How long a pool grown past its target by rewound clones (`take_back`: up to four
/// times it, under many requests at once) waits after the last launch before it ends
/// the surplus, one clone per pass of the event loop.
pub const SURPLUS_IDLE: Duration = Duration::from_secs(2);

/// How often the event loop looks whether a stale warm clone's replacement is ready.
const STALE_POLL: Duration = Duration::from_millis(2);

/// A forked, prepared clone waiting for its identity.
struct WarmClone {
    pid: i32,
    /// The parent's end of its go channel.
    go: std::os::unix::net::UnixStream,
    /// Read end of its ready pipe; None for a rewound clone (a new pipe goes with its
    /// launch message).
    ready: Option<File>,
    /// The cgroup (of the first class) it already sits in, with cgroup pools.
    cgroup: Option<CloneCgroup>,
    /// Whether it primes itself (the hooks' `prime`).
    primed: bool,
    /// Whether it said its prime is done (a byte on its go channel).
    prime_done: bool,
    /// Made before its template learned its working set (it copied nothing ahead) or
    /// was refreshed (its clock is older): replaced once a clone made since is ready.
    stale: bool,
    /// With cgroup pools, what its cgroup is charged for besides its requests.
    held: Held,
}

/// Whether a warm clone can be launched now.
enum Launchable {
    Yes,
    /// Its prime runs still.
    Priming,
    /// It ended before its launch (its prime failed).
    Ended,
}

impl WarmClone {
    /// Whether it could be launched now (a primed one: its prime is done), without
    /// taking its report off its channel.
    fn ready_now(&self) -> bool {
        !self.primed || self.prime_done || matches!(prime_report(&self.go, true), PrimeReport::Done)
    }

    fn launchable(&mut self) -> Launchable {
        if !self.primed || self.prime_done {
            return Launchable::Yes;
        }
        match prime_report(&self.go, false) {
            PrimeReport::Done => {
                self.prime_done = true;
                Launchable::Yes
            }
            PrimeReport::Pending => Launchable::Priming,
            PrimeReport::Ended => Launchable::Ended,
        }
    }
}

/// The warm clones of one paused VM, and the state they were made from.
#[derive(Default)]
pub struct WarmPool {
    /// How many to keep ready while paused.
    target: usize,
    /// The paused VM's captured state, valid until it resumes.
    epoch: Option<Arc<MicrovmState>>,
    clones: VecDeque<WarmClone>,
    /// Warm clones launched since start.
    launched: u64,
    /// Warm clones discarded unused.
    discarded: u64,
    /// When clones were last requested.
    last_request: Option<Instant>,
    /// Whether the last warm clone made was to be primed.
    priming: bool,
    /// Warm clones made to be primed.
    primed: u64,
    /// Primed warm clones whose prime failed (not by running out of time) since one
    /// was launched.
    prime_failures: u32,
    /// [`PRIME_FAILURES`] did in a row: no more are primed.
    prime_failed: bool,
    /// Primed warm clones whose prime ran out of time since one was launched or
    /// priming was paused.
    prime_timeouts: u32,
    /// Priming paused until then: [`PRIME_FAILURES`] primes in a row ran out of time.
    prime_paused_until: Option<Instant>,
    /// How long the last pause was (zero: none since a primed clone was launched).
    prime_pause: Duration,
    /// Warm clones killed or ended and not reaped yet, and whether each counts as a
    /// primed one that ended before its launch. Never waited for here: the host kernel
    /// can take seconds to tear a VM down when it is busy (an SRCU grace period in KVM's
    /// VM teardown), and the event loop's reaping takes them when they are gone (their
    /// cgroups go back to the pool then).
    dying: Vec<(i32, bool)>,
    /// Warm clones that could not be made in a row (a cgroup pool exhausted, the host
    /// out of memory or processes).
    add_failures: u32,
    /// No warm clone is tried until then, after such a failure.
    add_retry_at: Option<Instant>,
    /// Launched clones that may come back rewound (`rewind.rs`), by pid.
    out: Vec<Out>,
    /// Watches the go channels of `out` (made when the event loop asks for it).
    back: Option<Epoll>,
    /// Bumped whenever the template is to run: a clone launched in an older one
    /// copied its memory back from memory that changed, and is ended when it comes
    /// back.
    generation: u64,
    /// Clones that came back rewound and joined the pool.
    rewound: u64,
    /// The template's memory as its clones read it, when they are rewound
    /// (`rewind::open_own_memory`; None: not rewound).
    rewind_from: Option<File>,
    /// The prime request's pages for the paused state `epoch`: found for this working
    /// set and vCPU (`working::prime_pages`, a walk of the runtime's page tables), once
    /// rather than in each warm clone and each rewound life; None: not yet.
    touch: Option<(Arc<PageSet>, u8, Arc<[u8]>)>,
}

/// How long the pool waits to try again after a warm clone could not be made, the first
/// time; each failure in a row doubles it, up to [`ADD_RETRY_MAX`]. A failure is most
/// often passing (every cgroup of the pool in use, the host short of memory): the pool
/// keeps its target and grows back when it can.
pub const ADD_RETRY_FIRST: Duration = Duration::from_secs(1);
/// See [`ADD_RETRY_FIRST`].
pub const ADD_RETRY_MAX: Duration = Duration::from_secs(60);

/// Primed warm clones that may end before their launch in a row before priming is
/// turned off. More than one: a runtime that fails its prime once may have been unlucky.
pub const PRIME_FAILURES: u32 = 3;

/// The first pause of priming after [`PRIME_FAILURES`] primes in a row ran out of time,
/// and the longest (each pause in a row doubles the last). Running out of time says the
/// host is busy (seen on a 2-CPU PVM host under load), not that the runtime is wrong:
/// priming is tried again after the pause, where a failed prime turns it off for good.
pub const PRIME_PAUSE_FIRST: Duration = Duration::from_secs(10);
/// See [`PRIME_PAUSE_FIRST`].
pub const PRIME_PAUSE_MAX: Duration = Duration::from_secs(600);

/// Whether a warm clone that exited with `status` ended because its prime ran out of
/// time.
fn prime_timed_out(status: &WaitStatus) -> bool {
    matches!(status, WaitStatus::Exited(_, code) if *code == PRIME_TIMEOUT_EXIT)
}

impl WarmPool {
    /// A pool that keeps `target` warm clones while the VM is paused.
    pub fn new(target: usize) -> Self {
        let mut pool = Self::default();
        pool.target = target.min(MAX_WARM_CLONES);
        pool
    }

    /// Makes this pool, a clone's, its VM's as a template's (`derive`): `target` warm
    /// clones, and the watch of rewound clones coming back that the event loop
    /// registered when the clone started.
    pub(super) fn renew(&mut self, target: usize) {
        let back = self.back.take();
        *self = Self::new(target);
        self.back = back;
    }

    /// The figures for `GET /vm`.
    pub fn report(&self) -> WarmReport {
        WarmReport {
            target: self.target,
            ready: self.clones.iter().filter(|c| c.ready_now()).count(),
            launched: self.launched,
            discarded: self.discarded,
            priming: self.priming && self.may_prime(Instant::now()),
            primed: self.primed,
        }
    }

    /// Time since clones were last requested (long ago if never).
    pub fn since_last_launch(&self) -> Duration {
        self.last_request.map_or(Duration::MAX, |t| t.elapsed())
    }

    /// Records a clone request (the refill waits a moment after one).
    pub(super) fn note_request(&mut self) {
        self.last_request = Some(Instant::now());
    }

    /// Whether `pid`, which exited with `status`, was a warm clone (it died: forget it).
    /// [`PRIME_FAILURES`] primed ones in a row whose primes failed turn priming off for
    /// good (their stderr says why), so that the pool does not fork one failing prime
    /// after another; as many that ran out of time pause it ([`PRIME_PAUSE_FIRST`]).
    pub(super) fn reaped(&mut self, pid: i32, status: &WaitStatus) -> bool {
        // A launched clone that ended instead of coming back: its record is the
        // table's.
        if let Some(i) = self.out.iter().position(|o| o.pid == pid) {
            drop(self.forget_out(i));
            return false;
        }
        if let Some(i) = self.dying.iter().position(|&(p, _)| p == pid) {
            if self.dying.swap_remove(i).1 {
                self.prime_ended(pid, prime_timed_out(status), Instant::now());
            }
            return true;
        }
        let Some(i) = self.clones.iter().position(|c| c.pid == pid) else {
            return false;
        };
        if self.clones.remove(i).is_some_and(|c| c.primed) {
            self.prime_ended(pid, prime_timed_out(status), Instant::now());
        }
        true
    }

    /// Whether a warm clone made at `now` is primed (when its runtime takes primes).
    fn may_prime(&self, now: Instant) -> bool {
        !self.prime_failed && self.prime_paused_until.is_none_or(|until| now >= until)
    }

    /// A primed warm clone (`pid`) ended before its launch, `timed_out` or not.
    fn prime_ended(&mut self, pid: i32, timed_out: bool, now: Instant) {
        if timed_out {
            self.prime_timeouts += 1;
            if self.prime_timeouts < PRIME_FAILURES {
                return;
            }
            self.prime_timeouts = 0;
            self.prime_pause = (self.prime_pause * 2).clamp(PRIME_PAUSE_FIRST, PRIME_PAUSE_MAX);
            self.prime_paused_until = Some(now + self.prime_pause);
            tracing::warn!(
                "{PRIME_FAILURES} primes in a row (the last pid {pid}) ran out of time: the \
                 host is busy; warm clones are not primed for the next {} s",
                self.prime_pause.as_secs()
            );
            return;
        }
        self.prime_failures += 1;
        if self.prime_failed {
            return;
        }
        if self.prime_failures < PRIME_FAILURES {
            tracing::warn!(
                "a primed warm clone (pid {pid}) ended before its launch ({} of {PRIME_FAILURES} \
                 in a row before priming is turned off)",
                self.prime_failures
            );
            return;
        }
        tracing::warn!(
            "{PRIME_FAILURES} primed warm clones in a row (the last pid {pid}) ended before \
             their launch; warm clones are no longer primed"
        );
        self.prime_failed = true;
    }

    /// Discards every warm clone (the template changed): each is killed and not waited
    /// for (it is reaped when it is gone, its cgroup going back then); the captured
    /// state is forgotten.
    pub(super) fn discard(&mut self) {
        self.epoch = None;
        self.generation += 1;
        for c in std::mem::take(&mut self.clones) {
            self.discard_one(c.pid);
        }
    }

    /// Ends warm clone `pid`, unlaunched (or rewound and not taken back): SIGKILL, not
    /// waited for (the event loop reaps it when it is gone).
    fn discard_one(&mut self, pid: i32) {
        let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
        self.discarded += 1;
        self.dying.push((pid, false));
    }

    /// Forgets the captured state (the template is to run): the next warm clone is made
    /// from the state it pauses with next.
    pub(super) fn forget_epoch(&mut self) {
        self.epoch = None;
        self.touch = None;
        self.generation += 1;
    }

    /// Rewinds the invocation clones launched from now on (`rewind.rs`), when `why_not`
    /// says nothing against it; logs why not once otherwise.
    pub(super) fn rewind_clones(&mut self, why_not: Option<&str>) {
        if self.rewind_from.is_some() {
            return;
        }
        if let Some(why) = why_not {
            tracing::warn!("--rewind: invocation clones end as before: {why}");
            return;
        }
        match super::rewind::open_own_memory() {
            Ok(f) => self.rewind_from = Some(f),
            Err(e) => tracing::warn!("--rewind: cannot open this process's memory: {e}"),
        }
    }

    /// The warm clones there are now would be made otherwise now (their template
    /// learned its working set, or was refreshed): each is replaced, one at a time, once
    /// a clone made since is ready (the pool keeps one more than its target meanwhile,
    /// so a request never finds fewer ready than before). Those launched first are not
    /// replaced.
    pub(super) fn mark_stale(&mut self) {
        self.clones.iter_mut().for_each(|c| c.stale = true);
    }

    fn has_stale(&self) -> bool {
        self.clones.iter().any(|c| c.stale)
    }

    /// Discards one stale warm clone (`mark_stale`) when the pool is over its target
    /// and a clone made since is ready.
    pub(super) fn retire_stale(&mut self) {
        let fresh_ready = || self.clones.iter().any(|c| !c.stale && c.ready_now());
        if self.clones.len() <= self.target || !fresh_ready() {
            return;
        }
        if let Some(i) = self.clones.iter().position(|c| c.stale) {
            let c = self.clones.remove(i).expect("a position in the pool");
            self.discard_one(c.pid);
        }
    }

    /// The warm clones killed or ended and not reaped yet.
    pub(super) fn dying(&self) -> impl Iterator<Item = i32> + '_ {
        self.dying.iter().map(|&(pid, _)| pid)
    }

    /// Reaps `pid`, a warm clone that ended, if it is gone; else leaves it to the event
    /// loop's reaping. `primed`: it counts as a primed one that ended before its launch.
    fn reap_or_leave(&mut self, pid: i32, primed: bool, pools: Option<&mut ClonePools>) {
        match waitpid(Pid::from_raw(pid), Some(WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => self.dying.push((pid, primed)),
            status => {
                if let Some(p) = pools {
                    p.exited(pid);
                }
                if primed {
                    let timed_out = status.as_ref().is_ok_and(prime_timed_out);
                    self.prime_ended(pid, timed_out, Instant::now());
                }
            }
        }
    }

    /// Takes the first warm clone that can be launched, if any: a primed one once it
    /// said its prime is done. Those still priming stay in the pool; one that ended is
    /// reaped (its cgroup given back) and priming turned off.
    fn take(&mut self, mut pools: Option<&mut ClonePools>) -> Option<WarmClone> {
        let mut priming = VecDeque::new();
        let found = loop {
            let Some(mut c) = self.clones.pop_front() else {
                break None;
            };
            match c.launchable() {
                Launchable::Yes => {
                    if c.primed {
                        self.prime_failures = 0;
                        self.prime_timeouts = 0;
                        self.prime_pause = Duration::ZERO;
                    }
                    break Some(c);
                }
                Launchable::Priming => priming.push_back(c),
                Launchable::Ended => self.reap_or_leave(c.pid, true, pools.as_deref_mut()),
            }
        };
        while let Some(c) = priming.pop_back() {
            self.clones.push_front(c);
        }
        self.launched += u64::from(found.is_some());
        found
    }

    /// Whether the event loop should add a warm clone to `vm`'s pool (once a failure's
    /// wait is over). Launched clones that will come back rewound count toward the
    /// target (one request at a time then forks none), unless fewer than half the
    /// target are ready: with more requests at once than the pool holds, it grows (the
    /// clones coming back are kept, up to four times the target: `take_back`).
    pub(super) fn wants_clone(&self, vm: &Microvm) -> bool {
        let target = self.target + usize::from(self.has_stale());
        let short =
            self.clones.len() + self.out.len() < target || self.clones.len() * 2 < self.target;
        vm.state() == VmState::Paused && short && vm.pending_events().is_empty()
    }

    /// How long until a warm clone may be tried again after a failure (zero: now).
    fn add_wait(&self, now: Instant) -> Duration {
        (self.add_retry_at).map_or(Duration::ZERO, |t| t.saturating_duration_since(now))
    }

    /// A warm clone could not be made at `now`: the next try waits (doubling in a
    /// row). Returns the wait.
    fn add_failed(&mut self, now: Instant) -> Duration {
        let wait = ADD_RETRY_FIRST
            .saturating_mul(1 << self.add_failures.min(16))
            .min(ADD_RETRY_MAX);
        self.add_failures = self.add_failures.saturating_add(1);
        self.add_retry_at = Some(now + wait);
        wait
    }

    /// Time until a warm clone is to be made (zero: now); None when none is wanted. A
    /// pool down to less than half its target is refilled at once: under a steady
    /// stream of requests, closer together than [`REFILL_DELAY`], it would never be, and
    /// every request would wait for a clone forked and rebuilt for it.
    pub(super) fn refill_due_in(&self, vm: &Microvm) -> Option<Duration> {
        self.wants_clone(vm).then(|| {
            let due = match self.clones.len() * 2 < self.target {
                true => Duration::ZERO,
                false => REFILL_DELAY.saturating_sub(self.since_last_launch()),
            };
            due.max(self.add_wait(Instant::now()))
        })
    }

    /// Time until the pool has work (zero: now): a warm clone to make, a stale one to
    /// retire, a surplus to end; None: nothing.
    pub(super) fn due_in(&self, vm: &Microvm) -> Option<Duration> {
        // A stale clone waits for the one made to replace it to be ready.
        let retire = (self.has_stale() && self.clones.len() > self.target).then_some(STALE_POLL);
        // Rewound clones beyond the target go once requests have stopped a while.
        let surplus = (self.clones.len() > self.target && !self.has_stale())
            .then(|| SURPLUS_IDLE.saturating_sub(self.since_last_launch()));
        [self.refill_due_in(vm), retire, surplus]
            .into_iter()
            .flatten()
            .min()
    }

    /// Ends one warm clone beyond the target (a rewound clone that came back while the
    /// pool was full: `take_back`) once no clone was launched for [`SURPLUS_IDLE`]. Not
    /// while stale clones are replaced: the one made to replace them, over the target
    /// until it is ready, is no surplus (ending it, the pool would make another at once,
    /// and so on: a template refreshed while idle forked hundreds a second).
    pub(super) fn trim_surplus(&mut self) {
        let idle = self.since_last_launch() >= SURPLUS_IDLE;
        if self.clones.len() <= self.target || !idle || self.has_stale() {
            return;
        }
        if let Some(c) = self.clones.pop_back() {
            self.discard_one(c.pid);
        }
    }

    /// The paused VM's state, captured once per pause.
    pub(super) fn epoch_state(
        &mut self,
        vm: &mut Microvm,
    ) -> Result<Arc<MicrovmState>, CloneError> {
        if let Some(s) = &self.epoch {
            return Ok(s.clone());
        }
        let s = Arc::new(capture(vm)?);
        self.epoch = Some(s.clone());
        self.touch = None;
        Ok(s)
    }

    /// The prime request's pages for a warm clone of paused state `state` primed on
    /// `vcpu`, made with `working` (empty without a working set).
    fn touch(
        &mut self,
        vm: &Microvm,
        state: &MicrovmState,
        working: Option<&ForChild>,
        vcpu: u8,
    ) -> Arc<[u8]> {
        let Some(set) = working.map(|w| &w.set).filter(|s| !s.is_empty()) else {
            return Arc::from([]);
        };
        match &self.touch {
            Some((s, v, t)) if Arc::ptr_eq(s, set) && *v == vcpu => t.clone(),
            _ => {
                let t0 = Instant::now();
                let t: Arc<[u8]> = prime_pages(vm.memory(), state, vcpu, set).into();
                tracing::debug!(
                    "the prime's pages: {} runs found in {} us",
                    t.len() / 16,
                    t0.elapsed().as_micros()
                );
                self.touch = Some((set.clone(), vcpu, t.clone()));
                t
            }
        }
    }

    /// Forks one warm clone, to be primed on vCPU `prime` (where the template's
    /// runtime waits) when given. Errors are logged, and the next is tried later
    /// ([`ADD_RETRY_FIRST`]).
    pub(super) fn add(
        &mut self,
        vm: &mut Microvm,
        pools: Option<&mut ClonePools>,
        lineage: &Lineage,
        prime: Option<u8>,
    ) {
        let prime = prime.filter(|_| self.may_prime(Instant::now()));
        self.priming = prime.is_some();
        match self.try_add(vm, pools, lineage, prime) {
            Ok(()) => {
                self.add_failures = 0;
                self.add_retry_at = None;
            }
            Err(e) => {
                let wait = self.add_failed(Instant::now());
                tracing::warn!(
                    "cannot make a warm clone: {e}; keeping {}, trying again in {wait:?}",
                    self.clones.len()
                );
            }
        }
    }

    fn try_add(
        &mut self,
        vm: &mut Microvm,
        pools: Option<&mut ClonePools>,
        lineage: &Lineage,
        prime: Option<u8>,
    ) -> Result<(), CloneError> {
        let state = self.epoch_state(vm)?;
        let (ready_read, ready_write) = pipe().map_err(CloneError::Os)?;
        let (go_read, go_write) = go_channel().map_err(CloneError::Os)?;
        // A cgroup of the first class, entered now, off any request's path.
        let taken = match pools.as_deref() {
            Some(p) => Some(p.take(None)?),
            None => None,
        };
        let (placement, cgroup) = placement_of(pools.as_deref(), taken.as_ref());
        let ahead = (lineage.working.as_ref()).map_or(0, |w| w.set.pages() * PAGE);
        if let Some((p, t)) = pools.as_deref().zip(taken.as_ref()) {
            p.allow_ahead(t, ahead);
        }
        let touch = match prime {
            Some(vcpu) => self.touch(vm, &state, lineage.working.as_ref(), vcpu),
            None => Arc::from([]),
        };
        let start = Start::Warm {
            go: go_read.as_raw_fd(),
            cgroup: placement,
            prime,
            touch,
            rewind: self.rewind_from.as_ref().map(AsRawFd::as_raw_fd),
        };
        // The VM is paused: every vCPU is parked.
        let forked = fork_child(
            vm,
            pools.as_deref(),
            lineage,
            &state,
            &ready_write,
            start,
            taken.as_ref(),
        );
        let pid = match forked {
            Ok((pid, _)) => pid,
            Err(e) => {
                give_back(pools.as_deref(), [taken]);
                return Err(e);
            }
        };
        started_in(pools, pid, taken);
        self.clones.push_back(WarmClone {
            pid,
            go: go_write,
            ready: Some(File::from(ready_read)),
            cgroup,
            primed: prime.is_some(),
            prime_done: false,
            stale: false,
            held: Held {
                ahead,
                at_launch: None,
                allowed: ahead,
            },
        });
        self.primed += u64::from(prime.is_some());
        Ok(())
    }

    /// Launches a warm clone with `identity`; returns its pid, ready pipe and cgroup, or
    /// None when no warm clone is ready.
    pub(super) fn launch(
        &mut self,
        identity: &Identity,
        mut pools: Option<&mut ClonePools>,
    ) -> Option<(i32, File, Option<CloneCgroup>)> {
        loop {
            let c = self.take(pools.as_deref_mut())?;
            let WarmClone {
                pid,
                go,
                ready,
                cgroup,
                primed,
                mut held,
                ..
            } = c;
            // A rewound clone's launch brings it a new ready pipe.
            let launched = match ready {
                Some(ready) => send_go(&go, identity).map(|()| ready),
                None => pipe().and_then(|(read_end, write_end)| {
                    let mut id = identity.clone();
                    id.ready = Some(Arc::new(File::from(write_end)));
                    id.ready_attached = true;
                    send_go(&go, &id).map(|()| File::from(read_end))
                }),
            };
            if let Ok(ready) = launched {
                if self.rewind_from.is_some() {
                    if held.at_launch.is_none() {
                        held.at_launch = pools.as_deref().and_then(|p| p.memory_now(pid));
                    }
                    self.watch_out(pid, go, primed, cgroup.clone(), held);
                }
                return Some((pid, ready, cgroup));
            }
            // The warm clone died: reap it (or leave it to be) and try the next.
            let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
            self.reap_or_leave(pid, false, pools.as_deref_mut());
        }
    }
}

impl Drop for WarmPool {
    fn drop(&mut self) {
        self.discard();
    }
}

/// The spare overlay files of a VM's writable disks, made ahead so that each clone
/// takes a file made off its path instead of creating one.
#[derive(Debug, Default)]
pub(super) struct Spares {
    /// The clone count when they were last made (None: never).
    made_at: Option<u32>,
    /// When to try again, after a spare could not be made.
    retry_at: Option<Instant>,
}

/// How long after a spare overlay file could not be made (its directory full, say) it
/// is tried again, until the next clone request: room comes back when a clone's
/// overlay goes, which is not waited for.
const SPARE_RETRY: Duration = Duration::from_millis(500);

impl Spares {
    /// Time until they are to be made (zero: now), None when none is to be made. They
    /// are made once a moment after each clone request ([`REFILL_DELAY`], as warm
    /// clones), and once at start by a VM that is not a clone (a clone makes them only
    /// once it has been cloned itself). `made` is the VM's clone count.
    pub(super) fn due_in(
        &self,
        vm: &Microvm,
        made: u32,
        is_clone: bool,
        warm: &WarmPool,
    ) -> Option<Duration> {
        if self.made_at == Some(made) {
            let retry = self
                .retry_at
                .filter(|_| vm.devices().wants_spare_overlays());
            return retry.map(|t| t.saturating_duration_since(Instant::now()));
        }
        let since = match made {
            0 if !is_clone => Duration::MAX,
            0 => return None,
            _ => warm.since_last_launch(),
        };
        vm.devices()
            .wants_spare_overlays()
            .then(|| REFILL_DELAY.saturating_sub(since))
    }

    /// Makes them (those that cannot be made are tried again [`SPARE_RETRY`] later).
    pub(super) fn make(&mut self, vm: &Microvm, made: u32) {
        self.made_at = Some(made);
        let made_all = vm.devices().make_spare_overlays();
        self.retry_at = (!made_all).then(|| Instant::now() + SPARE_RETRY);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_warm_clone_that_cannot_be_made_is_tried_again_later_and_later() {
        let mut pool = WarmPool::new(2);
        let t0 = Instant::now();
        assert_eq!(pool.add_wait(t0), Duration::ZERO);
        assert_eq!(pool.add_failed(t0), ADD_RETRY_FIRST);
        assert_eq!(pool.add_wait(t0), ADD_RETRY_FIRST);
        assert_eq!(pool.add_wait(t0 + ADD_RETRY_FIRST), Duration::ZERO);
        assert_eq!(pool.add_failed(t0), 2 * ADD_RETRY_FIRST);
        for _ in 0..40 {
            pool.add_failed(t0);
        }
        assert_eq!(pool.add_wait(t0), ADD_RETRY_MAX);
        // The target stays: the pool grows back once a clone can be made.
        assert_eq!(pool.report().target, 2);
    }

    #[test]
    fn primes_that_run_out_of_time_pause_priming_and_failed_ones_end_it() {
        let mut pool = WarmPool::new(4);
        let t0 = Instant::now();
        assert!(pool.may_prime(t0));
        // Two primes out of time: still priming.
        pool.prime_ended(1, true, t0);
        pool.prime_ended(2, true, t0);
        assert!(pool.may_prime(t0));
        // The third pauses it.
        pool.prime_ended(3, true, t0);
        let ms = Duration::from_millis(1);
        assert!(!pool.may_prime(t0 + PRIME_PAUSE_FIRST - ms));
        assert!(pool.may_prime(t0 + PRIME_PAUSE_FIRST));
        // Three more after that pause: twice as long.
        let t1 = t0 + PRIME_PAUSE_FIRST;
        for pid in 4..7 {
            pool.prime_ended(pid, true, t1);
        }
        assert!(!pool.may_prime(t1 + 2 * PRIME_PAUSE_FIRST - ms));
        assert!(pool.may_prime(t1 + 2 * PRIME_PAUSE_FIRST));
        // Never longer than the most.
        let mut t = t1 + 2 * PRIME_PAUSE_FIRST;
        for _ in 0..20 {
            for pid in 0..3 {
                pool.prime_ended(pid, true, t);
            }
            t += PRIME_PAUSE_MAX;
        }
        assert_eq!(pool.prime_pause, PRIME_PAUSE_MAX);
        assert!(pool.may_prime(t));
        // Primes that failed otherwise turn it off for good.
        for pid in 0..3 {
            pool.prime_ended(pid, false, t);
        }
        assert!(!pool.may_prime(t + Duration::from_secs(86_400)));
    }

    #[test]
    fn a_prime_that_ran_out_of_time_is_told_by_its_exit_status() {
        let pid = Pid::from_raw(1);
        assert!(prime_timed_out(&WaitStatus::Exited(
            pid,
            PRIME_TIMEOUT_EXIT
        )));
        assert!(!prime_timed_out(&WaitStatus::Exited(pid, 1)));
        assert!(!prime_timed_out(&WaitStatus::Signaled(
            pid,
            Signal::SIGKILL,
            false
        )));
    }
}
