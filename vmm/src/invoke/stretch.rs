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
//! So where the VMM can read a thread's scheduling counters
//! (`/proc/self/task/TID/schedstat` and `stat`), the deferral at delivery reaches
//! [`ROOM`] further, and the VMM brings the deadline back once the vCPU has had its N ms.
//! From N ms after the delivery it checks, each time the vCPU could have had them: the
//! vCPU's wait for a CPU since the delivery (W, at most [`ROOM`]) is what the kernel
//! counted (`run_delay`, which grows only when a wait ends) plus a wait still going on
//! (the thread runnable and not run since the previous check, or not started yet); while
//! delivery + N + W lies ahead, it checks again then, the deadline left where it is;
//! once it has passed, the deadline is set to now. Time the vCPU idled (a handler's
//! sleep, in the guest's HLT) is no wait: such a handler gets its interrupt N ms after
//! delivery as before, plus however late the check runs. Once the deadline itself has
//! passed (the interrupt may have been taken), it is left alone. A request whose clone
//! ends sooner never pays for any of it.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::microvm::Microvm;

/// How much further than `--tick-defer-ms` a deferral reaches while the vCPU waits
/// for a host CPU.
pub const ROOM: Duration = Duration::from_millis(250);

/// A thread's scheduling counters, as its `/proc` files report them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Sched {
    /// Time it ran on a CPU, in ns (`schedstat`'s first field).
    ran_ns: u64,
    /// Time it waited for a CPU while runnable, in ns, counted when each wait ends
    /// (`schedstat`'s second field).
    waited_ns: u64,
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
        let (ran_ns, waited_ns, slices) = (fields.next()??, fields.next()??, fields.next()??);
        // The state follows the command name, which may hold spaces and parentheses.
        let state = stat
            .get(stat.rfind(')')? + 1..)?
            .split_whitespace()
            .next()?;
        Some(Self {
            ran_ns,
            waited_ns,
            slices,
            runnable: state == "R",
        })
    }

    /// The counters of `vm`'s vCPU `vcpu`'s thread; None before it starts.
    fn of_vcpu(vm: &Microvm, vcpu: u8) -> Option<Self> {
        let tid = vm.vcpus().get(usize::from(vcpu))?.thread_id()?;
        Self::read(&format!("/proc/self/task/{tid}"))
    }

    /// Whether a thread whose counters were `before` (None: not started) and are `self`
    /// now (None: not started yet) waited for a CPU all the time in between: it is
    /// runnable and was not put on a CPU. A thread running all along whose run time
    /// the kernel did not bring up to date in between reads the same; with checks N
    /// ms apart and the scheduler's tick shorter, that is rare, and costs the handler
    /// nothing.
    fn waited_throughout(before: Option<Self>, now: Option<Self>) -> bool {
        match (before, now) {
            (_, None) => true,
            (None, Some(n)) => n.runnable && n.slices == 0,
            (Some(b), Some(n)) => n.runnable && (b.ran_ns, b.slices) == (n.ran_ns, n.slices),
        }
    }
}

/// Whether this host reports threads' scheduling counters.
fn waits_readable() -> bool {
    static READABLE: OnceLock<bool> = OnceLock::new();
    *READABLE.get_or_init(|| Sched::read("/proc/thread-self").is_some())
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
    /// The vCPU thread's counted wait when the watch began (ns).
    wait0: u64,
    /// The deadline set at delivery: delivery + N + [`ROOM`].
    deadline: Instant,
    /// When the counters were read last, and what they were.
    last: (Instant, Option<Sched>),
    /// A wait going on since before the last check, not yet in the counted wait.
    ongoing: Duration,
    /// How far beyond `delivered + defer` the interrupt was deferred.
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
        let now = Sched::of_vcpu(vm, vcpu);
        let (wait0, last) = match fresh {
            true => (0, None),
            false => (now?.waited_ns, now),
        };
        Some(Self {
            vcpu,
            delivered,
            defer,
            wait0,
            deadline: delivered + defer + ROOM,
            last: (delivered, last),
            ongoing: Duration::ZERO,
            stretched: Duration::ZERO,
            next: Some(delivered + defer),
        })
    }

    /// When to check next.
    pub fn due(&self) -> Option<Instant> {
        self.next
    }

    /// How far the interrupt was deferred beyond `--tick-defer-ms`, in microseconds.
    pub fn stretched_us(&self) -> u64 {
        u64::try_from(self.stretched.as_micros()).unwrap_or(u64::MAX)
    }

    /// If a check is due: reads the vCPU's wait for a CPU and either checks again
    /// later or sets every vCPU's deferred deadline to now ([`decide`]).
    pub fn check(&mut self, vm: &Microvm, now: Instant) {
        if self.next.is_none_or(|n| now < n) {
            return;
        }
        let counters = Sched::of_vcpu(vm, self.vcpu);
        self.ongoing = match Sched::waited_throughout(self.last.1, counters) {
            true => self.ongoing + now.saturating_duration_since(self.last.0),
            false => Duration::ZERO,
        };
        self.last = (now, counters);
        let counted = counters.map_or(0, |c| c.waited_ns.saturating_sub(self.wait0));
        let waited = Duration::from_nanos(counted) + self.ongoing;
        let due = self.delivered + self.defer;
        match decide(due, self.deadline, waited, now) {
            Decision::Later(at) => {
                self.stretched = at - due;
                self.next = Some(at);
            }
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
    /// Checks again at this instant; the deadline stays.
    Later(Instant),
    /// The vCPU has had its N ms: the interrupt is due now.
    Now,
    /// The deadline set at delivery has passed: the interrupt may have been taken.
    Passed,
}

/// What a check at `now` does: the interrupt is due at `due` (delivery + N) moved on by
/// the vCPU's wait for a CPU (`waited`, at most [`ROOM`]); `set` is the deadline set at
/// delivery.
fn decide(due: Instant, set: Instant, waited: Duration, now: Instant) -> Decision {
    let at = due + waited.min(ROOM);
    match (set > now, at > now) {
        (false, _) => Decision::Passed,
        (true, true) if at < set => Decision::Later(at),
        (true, true) => Decision::Passed,
        (true, false) => Decision::Now,
    }
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
        assert_eq!(decide(due, set, Duration::ZERO, due), Decision::Now);
        assert_eq!(
            decide(due, set, Duration::ZERO, due + 2 * MS),
            Decision::Now
        );
        // Kept waiting for 7 ms: checked again 7 ms on, then due.
        assert_eq!(decide(due, set, 7 * MS, due), Decision::Later(due + 7 * MS));
        assert_eq!(decide(due, set, 7 * MS, due + 7 * MS), Decision::Now);
        // At most the room: the deadline set at delivery stands.
        assert_eq!(decide(due, set, 10 * ROOM, due), Decision::Passed);
        // A deadline set that has passed is left to the guest.
        assert_eq!(
            decide(due, due + 3 * MS, 7 * MS, due + 3 * MS),
            Decision::Passed
        );
        assert_eq!(
            decide(due, due + 3 * MS, 7 * MS, due + 4 * MS),
            Decision::Passed
        );
    }

    fn sched(ran_ns: u64, slices: u64, runnable: bool) -> Option<Sched> {
        Some(Sched {
            ran_ns,
            waited_ns: 0,
            slices,
            runnable,
        })
    }

    #[test]
    fn a_wait_in_progress_is_a_runnable_thread_not_put_on_a_cpu() {
        // Not started yet, or started and never run: waiting.
        assert!(Sched::waited_throughout(None, None));
        assert!(Sched::waited_throughout(None, sched(0, 0, true)));
        assert!(!Sched::waited_throughout(None, sched(5, 1, true)));
        // Runnable, the same run time and slices: still waiting.
        assert!(Sched::waited_throughout(
            sched(5, 3, true),
            sched(5, 3, true)
        ));
        // It ran in between, or it sleeps (a parked thread, HLT): no wait.
        assert!(!Sched::waited_throughout(
            sched(5, 3, true),
            sched(9, 3, true)
        ));
        assert!(!Sched::waited_throughout(
            sched(5, 3, true),
            sched(5, 4, true)
        ));
        assert!(!Sched::waited_throughout(
            sched(5, 3, false),
            sched(5, 3, false)
        ));
    }

    #[test]
    fn the_counters_come_from_schedstat_and_the_state_after_the_command_name() {
        let stat = "4242 (vcpu 0 (x)) R 1 2 3";
        let s = Sched::parse("1500 700 12\n", stat).unwrap();
        assert_eq!(
            (s.ran_ns, s.waited_ns, s.slices, s.runnable),
            (1500, 700, 12, true)
        );
        let s = Sched::parse("1500 700 12\n", "4242 (fc_vcpu) S 1").unwrap();
        assert!(!s.runnable);
        assert!(Sched::parse("1500 700\n", stat).is_none());
        assert!(Sched::parse("1500 x 12\n", stat).is_none());
        assert!(Sched::parse("1 2 3", "no state").is_none());
        // This thread's own files parse.
        assert!(Sched::read("/proc/thread-self").is_some_and(|s| s.runnable));
    }
}
