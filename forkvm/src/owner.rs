//! Who owns a template's VMM process, and how it is stopped.
//!
//! A template the library started ([`Kind::Spawned`]) is its child: a `vmm run` process
//! with `PR_SET_PDEATHSIG`, its files in a private directory. A derived template
//! ([`Kind::Derived`]) is a clone of another template's VMM: the library holds a pidfd
//! of it (which cannot name a process that reused its pid) and keeps its parent alive
//! while it lives, since a clone dies with its parent VMM. Either is stopped when its
//! last handle goes: SIGTERM (the VMM shuts down: its clones stopped, its cgroups given
//! back), up to 2 s, then SIGKILL. A jailed template's process is its jailer, which
//! forwards the signal to the VMM; a jail whose jailer had to be killed is cleaned up
//! here.
//!
//! A drop does not block: it sends SIGTERM and hands the rest (the wait, SIGKILL, the
//! reaping, the jail's and the directory's removal, then the parent's handle) to a
//! thread of its own, so that no tokio worker waits seconds in a destructor.
//! [`wait_stopped`] waits for every such stop, for a process about to exit.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use std::process::Child;
use tokio::io::unix::AsyncFd;

use crate::jail::{Jail, CONSOLE};
use crate::Error;

/// How long a dropped template's VMM has to shut down after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(2);

/// A template's VMM process.
#[derive(Debug)]
pub(crate) struct Owner {
    pid: u32,
    pidfd: OwnedFd,
    pub kind: Kind,
    /// The jail the process runs in (a derived template's: its root template's).
    jail: Option<Arc<Jail>>,
}

/// Whose process it is.
#[derive(Debug)]
pub(crate) enum Kind {
    /// Handed to a stopping thread (in a drop).
    Gone,
    /// This library's child, with its directory (socket, console, log).
    Spawned {
        child: Mutex<Child>,
        dir: tempfile::TempDir,
    },
    /// A clone of `parent`'s VMM (a derived template): `id` in its parent's clone
    /// table, its console in `console`.
    Derived {
        parent: Arc<Owner>,
        id: String,
        console: PathBuf,
    },
    /// A clone `id` of a template another process owns (and reaps it), its console in
    /// `console`.
    Attached { id: String, console: PathBuf },
}

/// A pidfd for `pid` (`pidfd_open`).
fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new descriptor this call owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

impl Owner {
    /// Owns `child`, started by this library, with its directory (and its jail, when
    /// `child` is a jailer).
    pub fn spawned(
        mut child: Child,
        dir: tempfile::TempDir,
        jail: Option<Jail>,
    ) -> Result<Self, Error> {
        let pid = child.id();
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => fd,
            Err(e) => {
                // Not owned: it would outlive this call.
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::Process(e));
            }
        };
        if let Some(j) = &jail {
            j.started(pid);
        }
        Ok(Self {
            pid,
            pidfd,
            kind: Kind::Spawned {
                child: Mutex::new(child),
                dir,
            },
            jail: jail.map(Arc::new),
        })
    }

    /// Owns the derived template or clone `id` of `parent`'s VMM, as its parent's
    /// clone table names it: process `pid`, console `console` (in a jail, the jail's
    /// pid and path).
    pub fn derived(
        parent: Arc<Owner>,
        id: String,
        pid: u32,
        console: &Path,
    ) -> Result<Self, Error> {
        let jail = parent.jail.clone();
        let pid = match &jail {
            Some(j) => j.host_pid(pid)?,
            None => pid,
        };
        let pidfd = pidfd_open(pid).map_err(Error::Process)?;
        let console = parent.host_path(console);
        Ok(Self {
            pid,
            pidfd,
            kind: Kind::Derived {
                parent,
                id,
                console,
            },
            jail,
        })
    }

    /// Owns clone `id` of a template another process owns: process `pid`, console
    /// `console` (host paths).
    pub fn attached(id: String, pid: u32, console: PathBuf) -> Result<Self, Error> {
        Ok(Self {
            pid,
            pidfd: pidfd_open(pid).map_err(Error::Process)?,
            kind: Kind::Attached { id, console },
            jail: None,
        })
    }

    /// The host's path of a path the VMM named (in a jail, a jail path).
    pub fn host_path(&self, p: &Path) -> PathBuf {
        match &self.jail {
            Some(j) => j.host_path(p),
            None => p.to_path_buf(),
        }
    }

    /// The process id.
    pub fn pid(&self) -> u32 {
        self.pid
    }

    /// The template's console file.
    pub fn console(&self) -> PathBuf {
        match &self.kind {
            Kind::Spawned { .. } if self.jail.is_some() => self.host_path(CONSOLE.as_ref()),
            Kind::Spawned { dir, .. } => dir.path().join("console"),
            Kind::Derived { console, .. } | Kind::Attached { console, .. } => console.clone(),
            Kind::Gone => PathBuf::new(),
        }
    }

    /// The log (standard error) of the VMM this template descends from: a clone writes
    /// to its parent's.
    pub fn log_file(&self) -> PathBuf {
        match &self.kind {
            Kind::Spawned { dir, .. } => dir.path().join("stderr"),
            Kind::Derived { parent, .. } => parent.log_file(),
            // Its template's owner has the log.
            Kind::Attached { .. } | Kind::Gone => PathBuf::new(),
        }
    }

    /// Whether the process has ended (its pidfd is readable).
    pub fn ended(&self) -> bool {
        wait_pidfd(&self.pidfd, Duration::ZERO)
    }

    /// Waits until the process has ended.
    pub async fn wait(&self) -> Result<(), Error> {
        let fd = self.pidfd.try_clone().map_err(Error::Process)?;
        // SAFETY: an OwnedFd: open, and the same descriptor, for as long as the AsyncFd
        // owns it.
        let fd = unsafe { AsyncFd::register(fd) }.map_err(|e| Error::Process(e.into()))?;
        let _ = fd.readable().await.map_err(Error::Process)?;
        Ok(())
    }

    /// How it ended, as far as this library can tell: the exit status of a child, or
    /// that a derived template's VMM ended.
    pub fn exit_status(&self) -> String {
        match &self.kind {
            Kind::Spawned { child, .. } => {
                let mut child = child.lock().unwrap_or_else(|p| p.into_inner());
                match child.try_wait() {
                    Ok(Some(s)) => s.to_string(),
                    Ok(None) => "still running".into(),
                    Err(e) => format!("unknown ({e})"),
                }
            }
            Kind::Derived { id, .. } => format!("clone {id} of its parent template ended"),
            Kind::Attached { id, .. } => format!("clone {id} ended"),
            Kind::Gone => "stopped".into(),
        }
    }

    /// Sends `signal` to the process (through its pidfd: never another process).
    pub fn signal(&self, signal: i32) {
        send_signal(&self.pidfd, signal);
    }
}

/// Stops handed to threads and not finished yet, and the signal that one finished.
static STOPPING: (Mutex<usize>, Condvar) = (Mutex::new(0), Condvar::new());

/// Waits, blocking, until every template and clone dropped so far has stopped: its VMM
/// ended and reaped, its files and jail removed. Returns whether they all had within
/// `limit`. A process that drops templates and then exits calls it first (a VMM not
/// waited for still ends with the process, `PR_SET_PDEATHSIG`; its files are then
/// removed by the next process that starts a template).
pub fn wait_stopped(limit: Duration) -> bool {
    let (count, done) = &STOPPING;
    let count = count.lock().unwrap_or_else(|p| p.into_inner());
    let (count, _) = done
        .wait_timeout_while(count, limit, |n| *n > 0)
        .unwrap_or_else(|p| p.into_inner());
    *count == 0
}

/// What a dropped owner's stop needs, off the dropping thread.
struct Stop {
    /// The process (a second descriptor of the owner's pidfd).
    pidfd: OwnedFd,
    kind: Kind,
    jail: Option<Arc<Jail>>,
}

impl Stop {
    /// [`finish`], then the rest dropped (the directory, the parent's handle).
    fn finish(self) {
        finish(&self.pidfd, &self.kind, self.jail.as_ref());
    }
}

/// Waits up to [`STOP_GRACE`] for the process behind `pidfd`, SIGKILLs it past that,
/// reaps a child, cleans its jail.
fn finish(pidfd: &OwnedFd, kind: &Kind, jail: Option<&Arc<Jail>>) {
    if !wait_pidfd(pidfd, STOP_GRACE) {
        send_signal(pidfd, libc::SIGKILL);
        wait_pidfd(pidfd, STOP_GRACE);
    }
    if let Kind::Spawned { child, .. } = kind {
        let mut child = child.lock().unwrap_or_else(|p| p.into_inner());
        let _ = child.wait();
        if let Some(j) = jail {
            j.clean_up();
        }
    }
}

/// Waits up to `limit` for the process behind `pidfd` to end, blocking; whether it did.
fn wait_pidfd(pidfd: &OwnedFd, limit: Duration) -> bool {
    let mut pfd = libc::pollfd {
        fd: pidfd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = i32::try_from(limit.as_millis()).unwrap_or(i32::MAX);
    // SAFETY: one valid pollfd, for the duration of the call.
    let n = unsafe { libc::poll(&mut pfd, 1, ms) };
    n > 0
}

/// Sends `signal` to the process behind `pidfd` (never another process).
fn send_signal(pidfd: &OwnedFd, signal: i32) {
    // SAFETY: pidfd_send_signal on an open pidfd; no siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            signal,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        )
    };
}

/// Runs the stop in `slot` unless another thread took it, and counts it as finished.
fn run_stop(slot: &Mutex<Option<Stop>>) {
    let taken = slot.lock().unwrap_or_else(|p| p.into_inner()).take();
    taken.into_iter().for_each(Stop::finish);
    let (count, done) = &STOPPING;
    let mut n = count.lock().unwrap_or_else(|p| p.into_inner());
    *n = n.saturating_sub(1);
    done.notify_all();
}

impl Drop for Owner {
    /// Stops the VMM if it still runs, without blocking: SIGTERM now; a thread of its
    /// own waits up to 2 s for it, then SIGKILLs it, reaps a child, cleans its jail and
    /// removes its directory, and drops a derived one's parent handle last (all of it
    /// here when the VMM has ended already, and, blocking, if no thread or descriptor
    /// can be had). [`wait_stopped`] waits for those threads.
    fn drop(&mut self) {
        let running = !self.ended();
        if running {
            self.signal(libc::SIGTERM);
        }
        let kind = std::mem::replace(&mut self.kind, Kind::Gone);
        let jail = self.jail.take();
        let pidfd = match self.pidfd.try_clone() {
            Ok(fd) if running => fd,
            // Ended already (after `shutdown`, say): nothing to wait for, so the rest
            // is done here, as the caller expects. Out of descriptors: the same, blocking.
            _ => return finish(&self.pidfd, &kind, jail.as_ref()),
        };
        *STOPPING.0.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        let stop = Arc::new(Mutex::new(Some(Stop { pidfd, kind, jail })));
        let theirs = stop.clone();
        let spawned = std::thread::Builder::new()
            .name("forkvm-stop".into())
            .spawn(move || run_stop(&theirs));
        if spawned.is_err() {
            run_stop(&stop);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_drop_does_not_wait_for_a_process_that_ignores_sigterm() {
        // A process that ignores SIGTERM: the stop waits the grace, then kills it.
        let child = std::process::Command::new("sh")
            .args(["-c", "trap '' TERM; while :; do sleep 1; done"])
            // Its `sleep` outlives it by up to a second: not on the test's output.
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().to_path_buf();
        let owner = Owner::spawned(child, dir, None).unwrap();
        let pid = owner.pid();
        // Let the shell set its trap.
        std::thread::sleep(Duration::from_millis(200));
        drop(owner);
        // Back at once: the process still runs (a blocking drop would have killed it).
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        assert!(
            !stat.is_empty() && !stat.contains(") Z "),
            "the drop waited for the process: {stat:?}"
        );
        // The stop finishes on its own thread: killed past the grace, reaped, files gone.
        assert!(wait_stopped(Duration::from_secs(10)));
        assert!(!std::path::Path::new(&format!("/proc/{pid}")).exists());
        assert!(!path.exists());
    }
}
