//! The fork gate: no other thread of the VMM is inside malloc (or holds any lock) when
//! the main thread forks a clone.
//!
//! When a clone is forked, its vCPU threads and virtio workers are parked at points
//! where they hold no lock. The API thread is not: it parses requests and formats
//! answers while the main thread works. glibc's `fork()` takes malloc's locks around
//! the fork, so a child never inherits a locked arena from it; but a clone born into
//! its v2 cgroup comes from the raw `clone3` system call, which glibc knows nothing
//! of. A clone forked while the API thread was in `malloc` or `free` on the main
//! arena hung at its first allocation, forever (a warm clone refilled while a client
//! polled `GET /vm`: 1 in 15-30 launches here).
//!
//! The API thread therefore holds a [`Pass`] while it runs its own code, and gives it
//! up only around system calls that may block (reading a request, writing an answer,
//! waiting for the main thread's answer). The main thread forks inside [`closed`],
//! which waits until no pass is held. An API thread that waits for a slow client holds
//! no pass, so it never delays a clone by more than a few microseconds of parsing.

use std::sync::{RwLock, RwLockReadGuard};

static GATE: RwLock<()> = RwLock::new(());

/// Held by a thread beside the forking one while it may allocate or take locks.
pub struct Pass(Option<RwLockReadGuard<'static, ()>>);

fn enter() -> RwLockReadGuard<'static, ()> {
    GATE.read().unwrap_or_else(|p| p.into_inner())
}

impl Pass {
    /// Waits for any fork under way, then holds the gate open.
    pub fn take() -> Self {
        Self(Some(enter()))
    }

    /// Runs `f` without the pass: `f` must not allocate, free or take a lock another
    /// process could need (in practice: one blocking system call).
    pub fn released<T>(&mut self, f: impl FnOnce() -> T) -> T {
        self.0 = None;
        let r = f();
        self.0 = Some(enter());
        r
    }
}

/// Runs `f` (the fork) once no [`Pass`] is held; passes wait meanwhile. In a child
/// forked inside, the gate opens again as `closed` returns, as it does in the parent.
pub fn closed<T>(f: impl FnOnce() -> T) -> T {
    let _shut = GATE.write().unwrap_or_else(|p| p.into_inner());
    f()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_fork_waits_for_a_held_pass_and_not_for_a_released_one() {
        let inside = Arc::new(AtomicBool::new(false));
        let (held_tx, held_rx) = std::sync::mpsc::channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let flag = inside.clone();
        let t = std::thread::spawn(move || {
            let mut pass = Pass::take();
            held_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(100));
            flag.store(true, Ordering::SeqCst);
            // Released while blocked: a fork may run now.
            pass.released(|| go_rx.recv().unwrap());
        });
        held_rx.recv().unwrap();
        // The gate waits for the pass above to be released.
        closed(|| assert!(inside.load(Ordering::SeqCst), "ran beside a held pass"));
        go_tx.send(()).unwrap();
        t.join().unwrap();
        // With no pass held, the gate does not wait.
        closed(|| ());
    }
}
