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

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
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
            Kind::Derived { console, .. } => console.clone(),
        }
    }

    /// The log (standard error) of the VMM this template descends from: a clone writes
    /// to its parent's.
    pub fn log_file(&self) -> PathBuf {
        match &self.kind {
            Kind::Spawned { dir, .. } => dir.path().join("stderr"),
            Kind::Derived { parent, .. } => parent.log_file(),
        }
    }

    /// Whether the process has ended (its pidfd is readable).
    pub fn ended(&self) -> bool {
        self.wait_for(Duration::ZERO)
    }

    /// Waits up to `limit` for the process to end, blocking; whether it did.
    fn wait_for(&self, limit: Duration) -> bool {
        let mut pfd = libc::pollfd {
            fd: self.pidfd.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = i32::try_from(limit.as_millis()).unwrap_or(i32::MAX);
        // SAFETY: one valid pollfd, for the duration of the call.
        let n = unsafe { libc::poll(&mut pfd, 1, ms) };
        n > 0
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
        }
    }

    /// Sends `signal` to the process (through its pidfd: never another process).
    pub fn signal(&self, signal: i32) {
        // SAFETY: pidfd_send_signal on a pidfd this owner holds; no siginfo.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                self.pidfd.as_raw_fd(),
                signal,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            )
        };
    }
}

impl Drop for Owner {
    /// Stops the VMM if it still runs: SIGTERM, up to 2 s, then SIGKILL; a child is
    /// reaped. Blocks the calling thread that long at most.
    fn drop(&mut self) {
        if !self.ended() {
            self.signal(libc::SIGTERM);
            if !self.wait_for(STOP_GRACE) {
                self.signal(libc::SIGKILL);
                self.wait_for(STOP_GRACE);
            }
        }
        if let Kind::Spawned { child, .. } = &self.kind {
            let mut child = child.lock().unwrap_or_else(|p| p.into_inner());
            let _ = child.try_wait();
            if let Some(j) = &self.jail {
                j.clean_up();
            }
        }
    }
}
