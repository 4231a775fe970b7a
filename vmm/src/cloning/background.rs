//! A warm clone's preparation, in the background.
//!
//! A warm clone rebuilds its VM, writes its template's working set ahead and primes its
//! runtime before any request needs it. That is work for later: on a host whose CPUs are
//! all busy it competes with the handlers of requests in flight, whose vCPUs then wait
//! for a CPU while a clone nobody asked for yet is being made. So the clone's thread
//! runs that part at the lowest priority (`--warm-nice`, 19 by default; the prime's vCPU
//! thread, which it spawns, inherits it) and takes back the template's priority when it
//! is launched, before its request's threads start. On an idle host nothing changes.
//!
//! Taking a priority back needs `CAP_SYS_NICE` or an `RLIMIT_NICE` that allows it; a VMM
//! that may not (a jailed one, by default) prepares its warm clones at its own
//! priority, as before: never a request run at nice 19.

use std::sync::OnceLock;

/// The nice value the trial of [`available`] takes, the lowest priority.
const NICE: i32 = 19;

/// The calling thread's nice value.
fn nice() -> std::io::Result<i32> {
    // getpriority may return -1 as a value: errno tells.
    nix::errno::Errno::clear();
    // SAFETY: reads the calling thread's nice value; no memory is passed.
    let n = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    match n == -1 && nix::errno::Errno::last_raw() != 0 {
        true => Err(std::io::Error::last_os_error()),
        false => Ok(n),
    }
}

/// Sets the calling thread's nice value (Linux keeps one per thread).
fn set_nice(n: i32) -> std::io::Result<()> {
    // SAFETY: changes the calling thread's nice value; no memory is passed.
    match unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, n) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

/// Whether this process may lower its priority and take it back: tried once,
/// on a thread of its own that ends with the trial.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(|| {
        let trial = std::thread::Builder::new()
            .name("nice-trial".into())
            .spawn(|| {
                let before = nice()?;
                set_nice(NICE)?;
                set_nice(before)
            });
        let ok = matches!(trial.map(|t| t.join()), Ok(Ok(Ok(()))));
        if !ok {
            tracing::info!(
                "warm clones are prepared at the VMM's own priority: it may not take a \
                 priority back (no CAP_SYS_NICE, RLIMIT_NICE too low)"
            );
        }
        ok
    })
}

/// The calling thread at a lower priority until [`Background::leave`].
#[derive(Debug)]
pub struct Background {
    before: i32,
}

impl Background {
    /// Lowers the calling thread's priority to nice value `to`, where that is lower
    /// than its own and [`available`] says it can be taken back; None otherwise (the
    /// thread keeps its priority).
    pub fn enter(to: i32) -> Option<Self> {
        let before = nice().ok()?;
        if to <= before || !available() {
            return None;
        }
        set_nice(to).ok()?;
        Some(Self { before })
    }

    /// Takes the calling thread's priority back.
    pub fn leave(self) -> std::io::Result<()> {
        set_nice(self.before)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_thread_in_the_background_takes_its_priority_back() {
        // On a thread of its own: the test harness's threads keep theirs.
        std::thread::spawn(|| {
            let before = nice().unwrap();
            // No lower than its own: nothing to do.
            assert!(Background::enter(before).is_none());
            match Background::enter(NICE) {
                Some(b) => {
                    assert_eq!(nice().unwrap(), NICE);
                    // A thread spawned now inherits it (the prime's vCPU thread).
                    let inherited = std::thread::spawn(|| nice().unwrap()).join().unwrap();
                    assert_eq!(inherited, NICE);
                    b.leave().unwrap();
                    assert_eq!(nice().unwrap(), before);
                }
                // Without the right to take it back, nothing changes.
                None => {
                    assert!(!available());
                    assert_eq!(nice().unwrap(), before);
                }
            }
        })
        .join()
        .unwrap();
    }
}
