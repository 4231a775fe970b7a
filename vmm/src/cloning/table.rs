//! The clone table: every clone a VM made, from its start to its end (reaped when it
//! exits, stopped on `DELETE /clones/{id}` or when the VM stops). A clone's cgroup goes
//! back to its pool when it is reaped, with its usage kept in its record.

use std::time::{Duration, Instant};

use api_types::{CloneInfo, CloneStatus};

use super::cgroups::ClonePools;

/// How long a clone has to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(3);

/// Clones made by this VM.
#[derive(Debug, Default)]
pub struct CloneTable {
    /// Clones made so far (their ids count from it).
    made: u32,
    clones: Vec<CloneInfo>,
}

impl CloneTable {
    /// How many clones this VM has made.
    pub fn made(&self) -> u32 {
        self.made
    }

    /// Every clone, oldest first.
    pub fn list(&self) -> &[CloneInfo] {
        &self.clones
    }

    /// Records the clones of one request (live or failed).
    pub(super) fn record(&mut self, count: u32, infos: &[CloneInfo]) {
        self.made += count;
        self.clones.extend(infos.iter().cloned());
    }

    /// The clones not reaped yet.
    pub(super) fn live(&self) -> impl Iterator<Item = &CloneInfo> {
        self.clones.iter().filter(|c| c.status.is_live())
    }

    /// Records the exit of `pid`, from waitpid's `status`, with its cgroup's usage (its
    /// cgroup goes back to the pool).
    fn reaped(&mut self, pools: Option<&mut ClonePools>, pid: i32, status: i32) {
        let usage = pools.and_then(|p| p.exited(pid));
        let Some(c) = self.clones.iter_mut().find(|c| c.pid == pid) else {
            return;
        };
        let oom = usage.is_some_and(|u| u.oom_kills > 0);
        c.status = if libc::WIFSIGNALED(status) {
            match libc::WTERMSIG(status) {
                libc::SIGKILL if oom => CloneStatus::OomKilled,
                sig => CloneStatus::Killed(sig),
            }
        } else {
            CloneStatus::Exited(libc::WEXITSTATUS(status))
        };
        if let Some(cg) = c.cgroup.as_mut() {
            cg.usage = usage;
        }
        // A clone that dies without its own cleanup (SIGKILL) leaves its sockets.
        let _ = std::fs::remove_file(&c.api_sock);
        if let Some(v) = &c.vsock {
            let _ = std::fs::remove_file(v);
        }
    }

    /// Reaps every exited child without blocking: a clone's record gets its status; a
    /// child that is no clone (a warm clone, which `is_warm` takes back) only returns
    /// its cgroup.
    pub(super) fn reap(
        &mut self,
        mut pools: Option<&mut ClonePools>,
        mut is_warm: impl FnMut(i32) -> bool,
    ) {
        loop {
            let mut status = 0;
            // SAFETY: waitpid with WNOHANG on our own children; `status` is a valid int.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if !is_warm(pid) {
                self.reaped(pools.as_deref_mut(), pid, status);
            } else if let Some(p) = pools.as_deref_mut() {
                p.exited(pid);
            }
        }
    }

    /// Stops the live clone `id` and reaps it; None if no live clone has that id.
    pub(super) fn stop(&mut self, pools: Option<&mut ClonePools>, id: &str) -> Option<CloneInfo> {
        let pid = self.live().find(|c| c.id == id)?.pid;
        self.stop_and_reap(pools, pid);
        self.clones.iter().find(|c| c.id == id).cloned()
    }

    /// Stops every live clone (the parent is shutting down).
    pub(super) fn stop_all(&mut self, mut pools: Option<&mut ClonePools>) {
        let pids: Vec<i32> = self.live().map(|c| c.pid).collect();
        for pid in pids {
            self.stop_and_reap(pools.as_deref_mut(), pid);
        }
    }

    /// Every clone, with live clones' cgroup usage read now.
    pub(super) fn with_usage(&self, pools: Option<&ClonePools>) -> Vec<CloneInfo> {
        let mut list = self.clones.clone();
        if let Some(pools) = pools {
            for c in list.iter_mut().filter(|c| c.status.is_live()) {
                if let Some(cg) = c.cgroup.as_mut() {
                    cg.usage = pools.usage(c.pid);
                }
            }
        }
        list
    }

    /// SIGTERM, then SIGKILL after a grace period; reaps.
    fn stop_and_reap(&mut self, pools: Option<&mut ClonePools>, pid: i32) {
        stop_pid(pid, STOP_TIMEOUT);
        let mut status = 0;
        // SAFETY: `pid` is our child; blocking wait after it was told to exit.
        if unsafe { libc::waitpid(pid, &mut status, 0) } == pid {
            self.reaped(pools, pid, status);
        }
    }
}

/// SIGTERM, wait up to `grace` for the process to exit, then SIGKILL. Does not reap.
fn stop_pid(pid: i32, grace: Duration) {
    // SAFETY: signalling our own child by pid.
    unsafe { libc::kill(pid, libc::SIGTERM) };
    let start = Instant::now();
    while start.elapsed() < grace {
        // SAFETY: siginfo_t is plain data that waitid fills.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: waits on our own child; WNOWAIT leaves it for the caller to reap.
        let r = unsafe {
            libc::waitid(
                libc::P_PID,
                pid as libc::id_t,
                &mut info,
                libc::WEXITED | libc::WNOHANG | libc::WNOWAIT,
            )
        };
        // SAFETY: after a successful waitid the si_pid field is initialised (0 when the
        // child has not exited yet).
        if r != 0 || unsafe { info.si_pid() } != 0 {
            return;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    // SAFETY: as above.
    unsafe { libc::kill(pid, libc::SIGKILL) };
}
