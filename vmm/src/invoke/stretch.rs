//! A request's timer deferral, counted in the time its vCPU runs.
//!
//! On delivery a due timer interrupt is deferred (`clone::timer`), so that a handler runs
//! before the guest kernel catches up on the time that passed (on a software-virtualised
//! host tens of milliseconds of emulated kernel work per clone, more when the host is
//! busy). What the deferral stands for is the handler's own time, N ms of it
//! (`--tick-defer-ms`): not wall-clock time, which passes while the vCPU waits for a host
//! CPU (the deadline would pass while it waits, and the clone pay the catch-up after all:
//! throughput fell from 64 to 26 invocations per second between 1 and 8 clients), and not
//! time the vCPU idles, when the guest waits for a timer of its own (a handler's sleep),
//! which a deferral would only hold back.
//!
//! So where the VMM can read a thread's scheduling counters
//! (`/proc/self/task/TID/schedstat` and `stat`), the deferral at delivery reaches
//! [`ROOM`] further than N, and the VMM's main thread checks the vCPU every [`CHECK`]: it
//! ends the deferral (sets the deadline to now) once the vCPU's thread has run N ms since
//! the delivery, or once it idles (asleep, and not put on a CPU since the previous
//! check). Time it waits for a CPU counts for nothing. Once the deadline set at delivery
//! has passed (the interrupt may have been taken), it is left alone. A request whose
//! clone ends sooner never pays for any of it.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::microvm::Microvm;

/// How much further than `--tick-defer-ms` a deferral reaches, in wall-clock time, while
/// the vCPU waits for a host CPU.
pub const ROOM: Duration = Duration::from_millis(250);

/// How often the VMM looks at a vCPU whose interrupt it defers.
pub const CHECK: Duration = Duration::from_millis(2);

/// A thread's scheduling counters, as its `/proc` files report them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sched {
    /// Time it ran on a CPU, in ns (`schedstat`'s first field; brought up to date for a
    /// running thread at the scheduler's ticks).
    ran_ns: u64,
    /// How many times it was put on a CPU (`schedstat`'s third field).
    slices: u64,
    /// Whether it is runnable (running, or waiting for a CPU: `stat`'s state `R`).
    runnable: bool,
}

impl Sched {
    /// The counters of the thread whose `/proc` directory is `dir`.
    fn read(dir: &str) -> Option<Self> {
        let schedstat = std::fs::read_to_string(format!("{dir}/schedstat")).ok()?;
        let stat = std::fs::read_to_string(format!("{dir}/stat")).ok()?;
        Self::parse(&schedstat, &stat)
    }

    fn parse(schedstat: &str, stat: &str) -> Option<Self> {
        let mut fields = schedstat.split_whitespace().map(|f| f.parse::<u64>().ok());
        let (ran_ns, _waited_ns, slices) = (fields.next()??, fields.next()??, fields.next()??);
        // The state follows the command name, which may hold spaces and parentheses.
        let state = stat
            .get(stat.rfind(')')? + 1..)?
            .split_whitespace()
            .next()?;
        Some(Self {
            ran_ns,
            slices,
            runnable: state == "R",
        })
    }

    /// The counters of `vm`'s vCPU `vcpu`'s thread; None before it starts.
    fn of_vcpu(vm: &Microvm, vcpu: u8) -> Option<Self> {
        let tid = vm.vcpus().get(usize::from(vcpu))?.thread_id()?;
        Self::read(&format!("/proc/self/task/{tid}"))
    }

    /// Whether a thread whose counters were `before` and are `now` idled in between: it
    /// sleeps (a vCPU in the guest's HLT, waiting for an interrupt) and was not put on a
    /// CPU since. Not known before it started.
    fn idled(before: Option<Self>, now: Option<Self>) -> bool {
        match (before, now) {
            (Some(b), Some(n)) => !n.runnable && (b.ran_ns, b.slices) == (n.ran_ns, n.slices),
            _ => false,
        }
    }
}

/// Whether this host reports threads' scheduling counters.
fn counters_readable() -> bool {
    static READABLE: OnceLock<bool> = OnceLock::new();
    *READABLE.get_or_init(|| Sched::read("/proc/thread-self").is_some())
}

/// How far a due timer interrupt is deferred at a delivery, in ns, with `--tick-defer-ms`
/// of `tick_defer_ns` (0: none).
pub fn initial_ns(tick_defer_ns: u64) -> u64 {
    match tick_defer_ns > 0 && counters_readable() {
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
    /// The vCPU thread's run time when the request's run began (ns); for a clone's,
    /// taken from its run's start at the first check that finds it begun.
    ran0: Option<u64>,
    /// The deadline set at delivery: delivery + N + [`ROOM`].
    deadline: Instant,
    /// When the counters were read last, and what they were.
    last: (Instant, Option<Sched>),
    /// How far beyond `delivered + defer` the interrupt was deferred.
    stretched: Duration,
    /// The next check.
    next: Option<Instant>,
}

impl Stretch {
    /// Watches the deferral of a request delivered to `vcpu` at `delivered`, deferred
    /// by [`initial_ns`]; None when the counters cannot be read (the deferral is then
    /// `defer` of wall-clock time). `fresh`: the vCPU's run began after the delivery (a
    /// clone's), so its run time counts from the run's start: not all the thread's,
    /// which a kept thread spent on other runs before (a warm clone's prime, a rewound
    /// clone's earlier lives: counted, they ended the deferral at its first check).
    pub fn watch(
        vm: &Microvm,
        vcpu: u8,
        delivered: Instant,
        defer: Duration,
        fresh: bool,
    ) -> Option<Self> {
        if !counters_readable() {
            return None;
        }
        let now = Sched::of_vcpu(vm, vcpu);
        // Unreadable now (it should not be): counted from 0, so the first check that
        // reads the thread's run time ends the deferral rather than leaving it long.
        let (ran0, last) = match fresh {
            true => (None, None),
            false => (Some(now.map_or(0, |c| c.ran_ns)), now),
        };
        Some(Self {
            vcpu,
            delivered,
            defer,
            ran0,
            deadline: delivered + defer + ROOM,
            last: (delivered, last),
            stretched: Duration::ZERO,
            next: Some(delivered + CHECK.min(defer)),
        })
    }

    /// When to check next.
    pub fn due(&self) -> Option<Instant> {
        self.next
    }

    /// How far the interrupt was deferred beyond `--tick-defer-ms` after delivery, in
    /// microseconds.
    pub fn stretched_us(&self) -> u64 {
        u64::try_from(self.stretched.as_micros()).unwrap_or(u64::MAX)
    }

    /// If a check is due: reads the vCPU's counters and either checks again later or
    /// sets every vCPU's deferred deadline to now ([`decide`]).
    pub fn check(&mut self, vm: &Microvm, now: Instant) {
        if self.next.is_none_or(|n| now < n) {
            return;
        }
        let counters = Sched::of_vcpu(vm, self.vcpu);
        let idle = Sched::idled(self.last.1, counters);
        self.last = (now, counters);
        if self.ran0.is_none() {
            let vcpu = vm.vcpus().get(usize::from(self.vcpu));
            self.ran0 = vcpu.and_then(|h| h.cpu_at_start_ns());
        }
        // A run not begun yet has run nothing.
        let ran0 = self.ran0.or(counters.map(|c| c.ran_ns)).unwrap_or(0);
        let ran = Duration::from_nanos(counters.map_or(0, |c| c.ran_ns.saturating_sub(ran0)));
        let due = self.delivered + self.defer;
        match decide(ran, idle, self.defer, self.deadline, now) {
            Decision::Later(after) => self.next = Some(now + after),
            Decision::Now => {
                self.stretched = now.saturating_duration_since(due);
                self.next = None;
                // The deadline written at delivery may lie a little past `deadline`
                // (measured from the delivery's clock reading, before the write).
                let within = (self.deadline + SLACK).saturating_duration_since(now);
                let within = u64::try_from(within.as_nanos()).unwrap_or(u64::MAX);
                for h in vm.vcpus() {
                    let _ = h.retime_timer(0, within);
                }
            }
            Decision::Passed => {
                self.stretched = self.deadline - due;
                self.next = None;
            }
        }
    }
}

/// How far past the deadline set at delivery a deadline is still taken for it.
const SLACK: Duration = Duration::from_millis(5);

/// What a check does.
#[derive(Debug, PartialEq, Eq)]
enum Decision {
    /// Checks again after this long; the deadline stays.
    Later(Duration),
    /// The vCPU has had its N ms, or idles: the interrupt is due now.
    Now,
    /// The deadline set at delivery has passed: the interrupt may have been taken.
    Passed,
}

/// What a check at `now` does, the vCPU having run for `ran` since the delivery and
/// `idle` since the previous check, its interrupt deferred by `defer` of its run time;
/// `set` is the deadline set at delivery.
fn decide(ran: Duration, idle: bool, defer: Duration, set: Instant, now: Instant) -> Decision {
    if set <= now {
        Decision::Passed
    } else if idle || ran >= defer {
        Decision::Now
    } else {
        Decision::Later(CHECK.min(defer - ran))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn the_deferral_lasts_the_vcpus_run_time_or_until_it_idles() {
        let now = Instant::now();
        let set = now + ROOM;
        let defer = 10 * MS;
        // Running, short of N: checked again, at most CHECK on.
        assert_eq!(
            decide(3 * MS, false, defer, set, now),
            Decision::Later(CHECK)
        );
        assert_eq!(decide(9 * MS, false, defer, set, now), Decision::Later(MS));
        // Kept waiting for a CPU (no run time): still deferred.
        assert_eq!(
            decide(Duration::ZERO, false, defer, set, now),
            Decision::Later(CHECK)
        );
        // It had its N ms, or it idles (a sleeping handler): due now.
        assert_eq!(decide(defer, false, defer, set, now), Decision::Now);
        assert_eq!(decide(MS, true, defer, set, now), Decision::Now);
        // The deadline set at delivery has passed: left to the guest.
        assert_eq!(decide(MS, false, defer, now, now), Decision::Passed);
        assert_eq!(decide(MS, true, defer, now - MS, now), Decision::Passed);
    }

    fn sched(ran_ns: u64, slices: u64, runnable: bool) -> Option<Sched> {
        Some(Sched {
            ran_ns,
            slices,
            runnable,
        })
    }

    #[test]
    fn idling_is_sleeping_without_being_put_on_a_cpu() {
        // Asleep, and not run since: idle (a vCPU in HLT).
        assert!(Sched::idled(sched(5, 3, false), sched(5, 3, false)));
        // It ran in between, or it is runnable (running, or waiting for a CPU): not.
        assert!(!Sched::idled(sched(5, 3, true), sched(9, 3, false)));
        assert!(!Sched::idled(sched(5, 3, false), sched(5, 4, false)));
        assert!(!Sched::idled(sched(5, 3, true), sched(5, 3, true)));
        // Not known before the thread started.
        assert!(!Sched::idled(None, sched(0, 0, false)));
        assert!(!Sched::idled(sched(5, 3, false), None));
    }

    #[test]
    fn the_counters_come_from_schedstat_and_the_state_after_the_command_name() {
        let stat = "4242 (vcpu 0 (x)) R 1 2 3";
        let s = Sched::parse("1500 700 12\n", stat).unwrap();
        assert_eq!((s.ran_ns, s.slices, s.runnable), (1500, 12, true));
        let s = Sched::parse("1500 700 12\n", "4242 (fc_vcpu) S 1").unwrap();
        assert!(!s.runnable);
        assert!(Sched::parse("1500 700\n", stat).is_none());
        assert!(Sched::parse("1500 x 12\n", stat).is_none());
        assert!(Sched::parse("1 2 3", "no state").is_none());
        // This thread's own files parse.
        assert!(Sched::read("/proc/thread-self").is_some_and(|s| s.runnable));
    }
}
