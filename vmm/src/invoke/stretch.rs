//! A request's timer deferral, counted in the time its vCPU could run.
//!
//! On delivery a timer interrupt due soon is deferred (`clone::timer`), so that a
//! handler shorter than `--tick-defer-ms` N runs before the guest kernel catches up. A
//! fixed deadline N ms on is wall-clock time, but what it stands for is the vCPU's own
//! time: on a host whose CPUs are oversubscribed the vCPU waits for a CPU, the deadline
//! passes while it waits, and the clone pays the catch-up after all (on a
//! software-virtualised host tens of milliseconds of emulated kernel work per clone,
//! which lengthens every other clone's wait: throughput fell from 64 to 26 invocations
//! per second between 1 and 8 clients).
//!
//! So where the VMM can read how long a thread waited on the host's run queue
//! (`/proc/self/task/TID/schedstat`), the deferral at delivery reaches [`ROOM`] further,
//! and the VMM moves the deadline back once the vCPU has had its N ms: at N ms after the
//! delivery, and then at each deadline it sets, it reads how long the vCPU's thread
//! waited for a CPU since the delivery (W, at most [`ROOM`]) and sets the deadline to
//! delivery + N + W, or to now when that has passed. Time the vCPU idled (a handler's
//! sleep, in the guest's HLT) is no wait: such a handler gets its interrupt N ms after
//! delivery as before. Once a deadline the VMM set has passed (the interrupt may have
//! been taken), it is left alone. A request whose clone ends sooner never pays for any of
//! it.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::microvm::Microvm;
use crate::vstate::vcpu::run_queue_wait_ns;

/// How much further than `--tick-defer-ms` a deferral reaches while the vCPU waits
/// for a host CPU.
pub const ROOM: Duration = Duration::from_millis(250);

/// Whether this host reports threads' run-queue waits.
fn waits_readable() -> bool {
    static READABLE: OnceLock<bool> = OnceLock::new();
    *READABLE.get_or_init(|| run_queue_wait_ns("/proc/thread-self/schedstat").is_some())
}

/// How far a due timer interrupt is deferred at a delivery, in ns, with `--tick-defer-ms`
/// of `tick_defer_ns` (0: none).
pub fn initial_ns(tick_defer_ns: u64) -> u64 {
    match tick_defer_ns > 0 && waits_readable() {
        true => tick_defer_ns.saturating_add(ROOM.as_nanos() as u64),
        false => tick_defer_ns,
    }
}

/// The deferral of one request in flight.
#[derive(Debug)]
pub(super) struct Stretch {
    vcpu: u8,
    delivered: Instant,
    defer: Duration,
    /// The vCPU thread's run-queue wait when the watch began (ns).
    wait0: u64,
    /// The deadline the VMM set last.
    deadline: Instant,
    /// How far beyond `delivered + defer` it was moved.
    stretched: Duration,
    /// The next check.
    next: Option<Instant>,
}

impl Stretch {
    /// Watches the deferral of a request delivered to `vcpu` at `delivered`, deferred
    /// by [`initial_ns`]; None when waits cannot be read (the deferral is then `defer`
    /// alone). `fresh`: the vCPU's thread started after the delivery (a clone's), so
    /// all its wait counts.
    pub fn watch(
        vm: &Microvm,
        vcpu: u8,
        delivered: Instant,
        defer: Duration,
        fresh: bool,
    ) -> Option<Self> {
        if !waits_readable() {
            return None;
        }
        let wait0 = match fresh {
            true => 0,
            false => vm.vcpus().get(usize::from(vcpu))?.run_queue_wait_ns()?,
        };
        Some(Self {
            vcpu,
            delivered,
            defer,
            wait0,
            deadline: delivered + defer + ROOM,
            stretched: Duration::ZERO,
            next: Some(delivered + defer),
        })
    }

    /// When to check next.
    pub fn due(&self) -> Option<Instant> {
        self.next
    }

    /// How far the deadline was moved beyond `--tick-defer-ms`, in microseconds.
    pub fn stretched_us(&self) -> u64 {
        u64::try_from(self.stretched.as_micros()).unwrap_or(u64::MAX)
    }

    /// If a check is due: sets every vCPU's deferred deadline to delivery + N + the
    /// vCPU's wait for a CPU, or to now once that has passed ([`decide`]).
    pub fn check(&mut self, vm: &Microvm, now: Instant) {
        if self.next.is_none_or(|n| now < n) {
            return;
        }
        let waited = (vm.vcpus().get(usize::from(self.vcpu)))
            .and_then(|h| h.run_queue_wait_ns())
            .map(|w| Duration::from_nanos(w.saturating_sub(self.wait0)))
            .unwrap_or_default();
        let Some(target) = decide(self.delivered + self.defer, self.deadline, waited, now) else {
            self.next = None;
            return;
        };
        let ns = |d: Duration| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        let within = ns(self.deadline - now);
        for h in vm.vcpus() {
            let _ = h.retime_timer(ns(target - now), within);
        }
        self.stretched = target - (self.delivered + self.defer);
        self.deadline = target;
        self.next = (target > now).then_some(target);
    }
}

/// The deadline a check at `now` sets: `due` (delivery + N) moved on by the vCPU's wait
/// for a CPU (`waited`, at most [`ROOM`]), and now at the earliest; None when the
/// deadline set last (`set`) has passed, so the interrupt may have been taken.
fn decide(due: Instant, set: Instant, waited: Duration, now: Instant) -> Option<Instant> {
    (set > now).then(|| (due + waited.min(ROOM)).max(now))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_vcpu_that_waited_for_a_cpu_gets_its_deferral_in_running_time() {
        let t0 = Instant::now();
        let due = t0 + 10 * MS;
        let set = due + ROOM;
        // Never kept from running: the interrupt is due now, N after delivery (a
        // sleeping handler is woken as without the room).
        assert_eq!(decide(due, set, Duration::ZERO, due), Some(due));
        assert_eq!(
            decide(due, set, Duration::ZERO, due + 2 * MS),
            Some(due + 2 * MS)
        );
        // Kept waiting for 7 ms: 7 ms more.
        assert_eq!(decide(due, set, 7 * MS, due), Some(due + 7 * MS));
        // At most the room.
        assert_eq!(decide(due, set, 10 * ROOM, due), Some(due + ROOM));
        // A deadline set that has passed is left to the guest.
        assert_eq!(decide(due, due + 3 * MS, 7 * MS, due + 3 * MS), None);
        assert_eq!(decide(due, due + 3 * MS, 7 * MS, due + 4 * MS), None);
    }
}
