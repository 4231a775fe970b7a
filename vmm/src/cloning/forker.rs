//! The forker (cgroup v1): a thread of the VMM that waits inside the cgroup the next
//! clone goes to, and forks that clone there, so it is born inside, as `clone3` with
//! `CLONE_INTO_CGROUP` gives on v2, instead of moving itself in.
//!
//! On v1 a cgroup is a property of each thread, and a forked child starts in the
//! cgroups of the thread that forked it. A clone that moves itself into its four
//! hierarchies (cpu, cpuacct, memory, pids) pays about 0.1 ms of kernel migrations on
//! its way to the guest; the forker pays them off the clone path instead, after the
//! clone before is up. Only one thread moves: the VMM's main thread, and with it the
//! owner of the VMM's memory for the memory controller, stays where it is.
//!
//! Jobs run one at a time, in order; the main thread hands them over and either
//! waits for the result (the fork, a move it depends on) or not (a move ahead).
//! The cgroups the forker may be in are tracked, so that none of them is released
//! (emptied by SIGKILL) while it is inside: `kill` of its thread id would end the
//! whole VMM. While it sits in a clone's cgroup its thread counts against `pids.max`
//! and the fork's CPU time against the clone: the pools raise a seat's `pids.max` by
//! one and restore it once the forker has left.
//!
//! A child of the forker has the forker as its parent *thread*: its
//! `PR_SET_PDEATHSIG` fires when the forker ends. The forker therefore lives as long as
//! the pools do, which are dropped after every clone has been stopped.

use std::os::fd::{AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;

/// Stack of the forker thread: a clone it forks runs its whole life (event loop, VM
/// rebuild) on a copy of this stack.
const STACK_SIZE: usize = 8 << 20;

/// Errors starting the forker.
#[derive(Debug, thiserror::Error)]
pub enum ForkerError {
    /// The files it moves back home with could not be opened.
    #[error("cgroup forker: {0}")]
    Home(#[from] jailer::cgroup::CgroupError),
    /// The thread could not be started.
    #[error("cgroup forker: cannot start its thread: {0}")]
    Spawn(std::io::Error),
}

/// A file written once a move is done: `(path, value)`.
pub(crate) type Restore = (PathBuf, String);

/// A borrowed closure with its lifetime erased (see [`Forker::run`]).
struct Borrowed(*mut (dyn FnMut(Option<&str>) + 'static));

// SAFETY: the closure is only called on the forker thread while the thread that lent
// it waits in `Forker::run` and touches nothing it borrows (see there).
unsafe impl Send for Borrowed {}

enum Job {
    /// Move into cgroup `name` through its files (one per hierarchy), then write
    /// `restore`.
    Seat {
        name: String,
        files: Vec<OwnedFd>,
        restore: Vec<Restore>,
    },
    /// Move back to the cgroups the forker started in.
    Home,
    /// Call a lent closure with the cgroup the forker is wholly inside.
    Run(Borrowed),
    /// Go home and end.
    Quit,
}

#[derive(Default)]
struct State {
    job: Option<Job>,
    busy: bool,
    /// Jobs finished.
    done: u64,
    /// Jobs handed over.
    given: u64,
    /// The cgroup the forker is wholly inside (None: home, or in part elsewhere).
    seated: Option<String>,
    /// Every cgroup it may be in, in part or whole (a move that failed part way
    /// leaves it in several).
    inside: Vec<String>,
    /// The thread ended (a job panicked, or Quit).
    gone: bool,
}

struct Shared {
    state: Mutex<State>,
    cv: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The forker thread and its job slot.
pub(crate) struct Forker {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

/// Writes "0" to each file (moving the calling thread on v1); whether all took it.
fn move_self(files: &[OwnedFd]) -> bool {
    files.iter().fold(true, |ok, f| {
        // SAFETY: writes one byte from a static buffer to an open descriptor.
        let n = unsafe { libc::write(f.as_raw_fd(), b"0".as_ptr().cast(), 1) };
        ok && n == 1
    })
}

fn write_restores(restore: &[Restore]) {
    for (path, value) in restore {
        if let Err(e) = std::fs::write(path, value) {
            tracing::warn!("cgroup forker: restoring {}: {e}", path.display());
        }
    }
}

impl Forker {
    /// Starts the forker in the calling thread's cgroups, which are its home (`home`:
    /// their `tasks` files, see `CgroupFs::open_own_move_files`). It installs the
    /// event loop's seccomp filter: its children become VMMs.
    pub(crate) fn start(home: Vec<OwnedFd>) -> Result<Self, ForkerError> {
        let shared = Arc::new(Shared {
            state: Mutex::new(State::default()),
            cv: Condvar::new(),
        });
        let inner = shared.clone();
        let thread = std::thread::Builder::new()
            .name("cgroup-forker".into())
            .stack_size(STACK_SIZE)
            .spawn(move || {
                // Marks the forker gone however it ends, so no caller waits forever.
                struct Gone(Arc<Shared>);
                impl Drop for Gone {
                    fn drop(&mut self) {
                        let mut st = self.0.lock();
                        st.gone = true;
                        st.busy = false;
                        self.0.cv.notify_all();
                    }
                }
                let _gone = Gone(inner.clone());
                if let Err(e) = crate::sandbox::enter(crate::sandbox::ThreadKind::Vmm) {
                    tracing::error!("cgroup forker: {e}");
                    return;
                }
                serve(&inner, &home);
            })
            .map_err(ForkerError::Spawn)?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Waits until no job is pending or running; false when the forker is gone.
    fn wait_idle<'a>(&'a self, mut st: MutexGuard<'a, State>) -> Option<MutexGuard<'a, State>> {
        while !st.gone && (st.job.is_some() || st.busy) {
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        (!st.gone).then_some(st)
    }

    /// Hands `job` over once the slot is free; returns its ticket (None: gone).
    fn give(&self, job: Job) -> Option<u64> {
        let mut st = self.wait_idle(self.shared.lock())?;
        st.job = Some(job);
        st.given += 1;
        self.shared.cv.notify_all();
        Some(st.given)
    }

    /// Waits until job `ticket` is done; false when the forker ended first.
    fn wait_done(&self, ticket: u64) -> bool {
        let mut st = self.shared.lock();
        while !st.gone && st.done < ticket {
            st = self.shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
        }
        st.done >= ticket
    }

    /// Moves the forker into cgroup `name` (through `files`), without waiting; then
    /// writes `restore`.
    pub(crate) fn seat(&self, name: &str, files: Vec<OwnedFd>, restore: Vec<Restore>) {
        let given = self.give(Job::Seat {
            name: name.to_string(),
            files,
            restore,
        });
        if given.is_none() {
            tracing::warn!("cgroup forker is gone: clones move themselves in");
        }
    }

    /// Makes sure the forker is not in cgroup `name` (it is about to be emptied):
    /// when it may be, moves it home and waits. False if it may still be inside.
    pub(crate) fn leave(&self, name: &str) -> bool {
        let Some(st) = self.wait_idle(self.shared.lock()) else {
            // Its thread is gone, and with it from every cgroup.
            return true;
        };
        if !st.inside.iter().any(|n| n == name) {
            return true;
        }
        drop(st);
        let done = self.give(Job::Home).is_some_and(|t| self.wait_done(t));
        let st = self.shared.lock();
        st.gone || (done && !st.inside.iter().any(|n| n == name))
    }

    /// Runs `f` on the forker thread, after the jobs before it, and returns what it
    /// returns; `f` learns the cgroup the forker is wholly inside. None when the
    /// forker is gone (then `f` was not called). A fork inside `f` gives a child whose
    /// only thread is a copy of the forker, running on in `f`.
    pub(crate) fn run<R>(&self, f: impl FnOnce(Option<&str>) -> R) -> Option<R> {
        let mut f = Some(f);
        let mut out = None;
        let mut call = |seated: Option<&str>| {
            if let Some(f) = f.take() {
                out = Some(f(seated));
            }
        };
        let lent: &mut (dyn FnMut(Option<&str>) + '_) = &mut call;
        // SAFETY: only the lifetime is erased. The forker calls the closure in its
        // job, and this thread waits below until that job is done (or the forker is
        // gone, having never started it: a job is taken and finished under `busy`,
        // which the thread's exit guard clears only as the thread ends), touching
        // nothing the closure borrows meanwhile. In a child forked by the closure,
        // the borrowed memory is the child's own copy, which nothing else uses.
        let lent: *mut (dyn FnMut(Option<&str>) + 'static) =
            unsafe { std::mem::transmute(lent as *mut (dyn FnMut(Option<&str>) + '_)) };
        let ticket = self.give(Job::Run(Borrowed(lent)))?;
        self.wait_done(ticket);
        out
    }

    /// Whether the forker thread still runs.
    pub(crate) fn is_alive(&self) -> bool {
        !self.shared.lock().gone
    }
}

/// The forker thread's loop.
fn serve(shared: &Shared, home: &[OwnedFd]) {
    loop {
        let (job, seated) = {
            let mut st = shared.lock();
            while st.job.is_none() {
                st = shared.cv.wait(st).unwrap_or_else(|p| p.into_inner());
            }
            st.busy = true;
            (st.job.take().expect("checked"), st.seated.clone())
        };
        let quit = matches!(job, Job::Quit);
        // Where a move took the forker (None: home), and whether wholly.
        let moved = match job {
            Job::Seat {
                name,
                files,
                restore,
            } => {
                let whole = move_self(&files);
                write_restores(&restore);
                Some((Some(name), whole))
            }
            Job::Home | Job::Quit => Some((None, move_self(home))),
            Job::Run(Borrowed(f)) => {
                // SAFETY: see `Forker::run`: the lender waits until this job is done.
                unsafe { (*f)(seated.as_deref()) };
                None
            }
        };
        let mut st = shared.lock();
        if let Some((to, whole)) = moved {
            st.seated = to.clone().filter(|_| whole);
            match (to, whole) {
                // Wholly in one cgroup, or wholly home.
                (Some(name), true) => st.inside = vec![name],
                (None, true) => st.inside.clear(),
                // In part: it may be in the new one too.
                (Some(name), false) => st.inside.push(name),
                (None, false) => {}
            }
        }
        st.busy = false;
        st.done += 1;
        shared.cv.notify_all();
        if quit {
            return;
        }
    }
}

impl Drop for Forker {
    /// Moves the forker home and ends it.
    fn drop(&mut self) {
        self.give(Job::Quit);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
