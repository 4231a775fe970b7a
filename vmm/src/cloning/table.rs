//! The clone table: every clone a VM made, from its start to its end (reaped when it
//! exits, stopped on `DELETE /clones/{id}` or when the VM stops). A clone's cgroup goes
//! back to its pool when it is reaped, with its usage kept in its record.

use std::collections::HashMap;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use api_types::{CloneInfo, CloneStatus};
use nix::sys::signal::{kill, Signal};
use nix::sys::wait::{waitid, waitpid, Id, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use super::cgroups::ClonePools;
use jailer::cgroup::Usage;

/// How long a clone has to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(3);

/// How long a VMM that shuts down waits for its killed clones to be gone.
const EXIT_TIMEOUT: Duration = Duration::from_secs(3);

/// How many records of clones that ended a VM keeps (the oldest go first): a template
/// that runs for weeks does not hold every clone it ever made.
pub const ENDED_KEPT: usize = 1024;

/// Why a clone failed to start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StartFailure {
    /// What it said, or what became of it.
    pub reason: String,
    /// The host error number behind it (0: none).
    pub errno: i32,
}

/// How an invocation's clone that ended without answering ended.
#[derive(Debug)]
pub enum OrphanEnd {
    /// It ended (how: "was killed by SIGKILL", "exited with status 1").
    Ended(String),
    /// It failed to start.
    NotStarted(StartFailure),
}

/// An invocation's clone that ended: its caller's stream, to be answered if the clone
/// had not answered it, its id and how it ended.
#[derive(Debug)]
pub struct Orphan {
    /// The caller's connection.
    pub conn: Arc<UnixStream>,
    /// The clone's id.
    pub id: String,
    /// How it ended.
    pub end: OrphanEnd,
}

/// Clones made by this VM.
#[derive(Debug, Default)]
pub struct CloneTable {
    /// Clones made so far (their ids count from it).
    made: u32,
    clones: Vec<CloneInfo>,
    /// Clones whose record goes when they end (clones made with a handover: a template
    /// makes one per invocation), with their console file; with the handover's stream
    /// (an invocation's caller's connection, which the clone shuts down once it
    /// answered).
    transient: HashMap<i32, Arc<UnixStream>>,
    /// Streams of such clones that ended, with how they ended: answered by the
    /// controller, if the clone had not (`Cloner::take_orphans`).
    orphans: Vec<Orphan>,
    /// Why the clones of `transient` that failed to start did, until they are reaped.
    not_started: HashMap<i32, StartFailure>,
    /// Clones told to stop (SIGTERM) and not reaped yet, with when they get SIGKILL
    /// (None: sent).
    stopping: Vec<(i32, Option<Instant>)>,
    /// The final records of clones told to stop that were reaped since last asked
    /// (`Cloner::take_stopped`).
    stopped: Vec<(i32, CloneInfo)>,
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
        let ended = self.clones.iter().filter(|c| !c.status.is_live()).count();
        let mut drop = ended.saturating_sub(ENDED_KEPT);
        if drop > 0 {
            self.clones.retain(|c| {
                let gone = drop > 0 && !c.status.is_live();
                drop -= usize::from(gone);
                !gone
            });
        }
    }

    /// Records how the start of clone `pid` (made [`CloneStatus::Starting`]) ended:
    /// the time its vCPU 0 entered the guest, or why it failed. Returns whether it was
    /// still starting and not reaped (so that its pid is still its own).
    pub(super) fn started(
        &mut self,
        pid: i32,
        entered: Result<u64, StartFailure>,
        since_ns: u64,
    ) -> bool {
        let Some(c) =
            (self.clones.iter_mut()).find(|c| c.pid == pid && c.status == CloneStatus::Starting)
        else {
            return false;
        };
        match entered {
            Ok(t) => {
                c.latency_us = Some(t.saturating_sub(since_ns) / 1000);
                c.status = CloneStatus::Running;
            }
            Err(why) => {
                c.status = CloneStatus::Failed;
                c.error = Some(why.reason.clone());
                self.not_started.insert(pid, why);
            }
        }
        true
    }

    /// Forgets clone `pid`, made with a handover, once it ends (its record and console
    /// file), and hands `conn` on then, in case it died without answering.
    pub(super) fn forget_when_reaped(&mut self, pid: i32, conn: Arc<UnixStream>) {
        self.transient.insert(pid, conn);
    }

    /// The streams of clones made with a handover that ended: (stream, clone id, how).
    pub(super) fn take_orphans(&mut self) -> Vec<Orphan> {
        std::mem::take(&mut self.orphans)
    }

    /// The clones not reaped yet.
    pub(super) fn live(&self) -> impl Iterator<Item = &CloneInfo> {
        self.clones.iter().filter(|c| c.status.is_live())
    }

    /// Records the exit of `pid` as `status` says, with its cgroup's usage (its cgroup
    /// goes back to the pool); returns the clone's final record.
    fn reaped(
        &mut self,
        pools: Option<&mut ClonePools>,
        pid: i32,
        status: WaitStatus,
    ) -> Option<CloneInfo> {
        let usage = pools.and_then(|p| p.exited(pid));
        self.ended(pid, status, usage)
    }

    /// Records the end of `pid`'s record as `status` says, with `usage`; returns the
    /// clone's final record.
    fn ended(&mut self, pid: i32, status: WaitStatus, usage: Option<Usage>) -> Option<CloneInfo> {
        let record = self.record_end(pid, status, usage);
        if let Some(i) = self.stopping.iter().position(|&(p, _)| p == pid) {
            self.stopping.swap_remove(i);
            if let Some(r) = &record {
                self.stopped.push((pid, r.clone()));
            }
        }
        record
    }

    /// [`CloneTable::ended`]'s bookkeeping of the clone's end.
    fn record_end(
        &mut self,
        pid: i32,
        status: WaitStatus,
        usage: Option<Usage>,
    ) -> Option<CloneInfo> {
        super::tree::release(pid);
        // The live record: an ended clone's pid may have been given to a newer one.
        let at = (self.clones.iter()).position(|c| c.pid == pid && c.status.is_live())?;
        let c = &mut self.clones[at];
        let oom = usage.is_some_and(|u| u.oom_kills > 0);
        c.status = match status {
            WaitStatus::Signaled(_, Signal::SIGKILL, _) if oom => CloneStatus::OomKilled,
            WaitStatus::Signaled(_, sig, _) => CloneStatus::Killed(sig as i32),
            WaitStatus::Exited(_, code) => CloneStatus::Exited(code),
            // Stopped, continued: not an end (waitpid without WUNTRACED does not report it).
            _ => return None,
        };
        if let Some(cg) = c.cgroup.as_mut() {
            cg.usage = usage;
        }
        // A clone that dies without its own cleanup (SIGKILL) leaves its sockets.
        let _ = std::fs::remove_file(&c.api_sock);
        if let Some(v) = &c.vsock {
            let _ = std::fs::remove_file(v);
        }
        if let Some(conn) = self.transient.remove(&pid) {
            let end = match (self.not_started.remove(&pid), status) {
                (Some(why), _) => OrphanEnd::NotStarted(why),
                (None, WaitStatus::Signaled(_, sig, _)) => {
                    OrphanEnd::Ended(format!("was killed by {sig}"))
                }
                (None, WaitStatus::Exited(_, code)) => {
                    OrphanEnd::Ended(format!("exited with status {code}"))
                }
                (None, _) => OrphanEnd::Ended("ended".into()),
            };
            let id = c.id.clone();
            self.orphans.push(Orphan { conn, id, end });
            remove_console(c);
            return Some(self.clones.remove(at));
        }
        Some(c.clone())
    }

    /// Ends the record of clone `pid`, whose life ended (`rewind.rs`), as at an exit
    /// with status 0, with `usage`, its cgroup's for that life: the process lives on,
    /// in the same cgroup, as a warm clone.
    pub(super) fn rewound(&mut self, pid: i32, usage: Option<Usage>) {
        self.ended(pid, WaitStatus::Exited(Pid::from_raw(pid), 0), usage);
    }

    /// Reaps every exited child without blocking: a clone's record gets its status; a
    /// child that is no clone (a warm clone, which `is_warm` takes back with its exit
    /// status) only returns its cgroup.
    pub(super) fn reap(
        &mut self,
        mut pools: Option<&mut ClonePools>,
        mut is_warm: impl FnMut(i32, &WaitStatus) -> bool,
    ) {
        loop {
            let status = match waitpid(None, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) | Err(_) => break,
                Ok(status) => status,
            };
            let Some(pid) = status.pid().map(Pid::as_raw) else {
                break;
            };
            if !is_warm(pid, &status) {
                self.reaped(pools.as_deref_mut(), pid, status);
            } else if let Some(p) = pools.as_deref_mut() {
                p.exited(pid);
            }
        }
    }

    /// Tells the live clone `id` to stop (SIGTERM; SIGKILL [`STOP_TIMEOUT`] later if it
    /// is still there) without waiting for it: its final record comes from
    /// [`CloneTable::take_stopped`] once it is reaped. Returns its pid; None if no live
    /// clone has that id.
    pub(super) fn begin_stop(&mut self, id: &str) -> Option<i32> {
        let pid = self.live().find(|c| c.id == id)?.pid;
        if !self.stopping.iter().any(|&(p, _)| p == pid) {
            let _ = kill(Pid::from_raw(pid), Signal::SIGTERM);
            self.stopping
                .push((pid, Some(Instant::now() + STOP_TIMEOUT)));
        }
        Some(pid)
    }

    /// Time until a clone told to stop is due its SIGKILL (zero: now).
    pub(super) fn kill_due_in(&self) -> Option<Duration> {
        let at = self.stopping.iter().filter_map(|&(_, at)| at).min()?;
        Some(at.saturating_duration_since(Instant::now()))
    }

    /// Sends SIGKILL to the clones told to stop whose time is up.
    pub(super) fn kill_overdue(&mut self) {
        let now = Instant::now();
        for (pid, at) in &mut self.stopping {
            if at.is_some_and(|t| t <= now) {
                tracing::warn!(
                    "clone (pid {pid}) still running {} s after SIGTERM: SIGKILL",
                    STOP_TIMEOUT.as_secs()
                );
                let _ = kill(Pid::from_raw(*pid), Signal::SIGKILL);
                *at = None;
            }
        }
    }

    /// The final records of clones told to stop that were reaped since last asked,
    /// with their pids.
    pub(super) fn take_stopped(&mut self) -> Vec<(i32, CloneInfo)> {
        std::mem::take(&mut self.stopped)
    }

    /// Stops every live clone (the parent is shutting down): SIGTERM to all at once,
    /// SIGKILL to those still running [`STOP_TIMEOUT`] later, then reaps them and the
    /// children already `killed` (warm clones), waiting at most [`EXIT_TIMEOUT`] for the
    /// host to tear their VMs down. So a thousand clones stop in about the time the
    /// slowest takes, not their sum; those still exiting then are left to the init
    /// process (they die with this one: `PR_SET_PDEATHSIG`).
    pub(super) fn stop_all(&mut self, mut pools: Option<&mut ClonePools>, killed: &[i32]) {
        let live: Vec<Pid> = self.live().map(|c| Pid::from_raw(c.pid)).collect();
        if live.is_empty() && killed.is_empty() {
            return;
        }
        tracing::info!("stopping {} clones", live.len());
        for &pid in &live {
            let _ = kill(pid, Signal::SIGTERM);
        }
        let start = Instant::now();
        let mut running = live.clone();
        while !running.is_empty() && start.elapsed() < STOP_TIMEOUT {
            running.retain(|&pid| still_running(pid));
            if !running.is_empty() {
                std::thread::sleep(Duration::from_millis(2));
            }
        }
        if !running.is_empty() {
            tracing::warn!(
                "{} clones still running {} s after SIGTERM: SIGKILL",
                running.len(),
                STOP_TIMEOUT.as_secs()
            );
        }
        for &pid in &running {
            let _ = kill(pid, Signal::SIGKILL);
        }
        let mut left: Vec<Pid> = (live.into_iter())
            .chain(killed.iter().map(|&p| Pid::from_raw(p)))
            .collect();
        let reaping = Instant::now();
        loop {
            left.retain(|&pid| match waitpid(pid, Some(WaitPidFlag::WNOHANG)) {
                Ok(WaitStatus::StillAlive) => true,
                Ok(status) => {
                    if self
                        .reaped(pools.as_deref_mut(), pid.as_raw(), status)
                        .is_none()
                    {
                        if let Some(p) = pools.as_deref_mut() {
                            p.exited(pid.as_raw());
                        }
                    }
                    false
                }
                Err(_) => false,
            });
            if left.is_empty() || reaping.elapsed() >= EXIT_TIMEOUT {
                break;
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        if !left.is_empty() {
            tracing::warn!(
                "{} clones still exiting {} s after they were killed (the host is slow to \
                 tear their VMs down): left to the init process to reap",
                left.len(),
                EXIT_TIMEOUT.as_secs()
            );
        }
        tracing::info!("every clone stopped in {} ms", start.elapsed().as_millis());
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

    /// Ends the clones a failed request had made before it failed (its caller learns of
    /// none): each is recorded with its id (not given again), killed, and its console
    /// removed; it is reaped on SIGCHLD.
    pub(super) fn abandon(&mut self, made: impl IntoIterator<Item = CloneInfo>) {
        let mut made: Vec<CloneInfo> = made.into_iter().collect();
        if made.is_empty() {
            return;
        }
        tracing::warn!("stopping {} clones of a request that failed", made.len());
        for c in &mut made {
            c.error = Some("stopped: another clone of its request failed".into());
        }
        self.record(made.len() as u32, &made);
        // Not waited for: a killed VM's teardown in the host kernel can take seconds on
        // a busy host. Each is reaped, and its record ended, on SIGCHLD.
        for c in made {
            let _ = kill(Pid::from_raw(c.pid), Signal::SIGKILL);
            remove_console(&c);
        }
    }
}

/// Removes a clone's console file (not a discarded console's `/dev/null`).
fn remove_console(c: &CloneInfo) {
    if c.console != std::path::Path::new("/dev/null") {
        let _ = std::fs::remove_file(&c.console);
    }
}

/// Whether the child `pid` has not exited yet (it is left for the caller to reap).
fn still_running(pid: Pid) -> bool {
    let flags = WaitPidFlag::WEXITED | WaitPidFlag::WNOHANG | WaitPidFlag::WNOWAIT;
    matches!(waitid(Id::Pid(pid), flags), Ok(WaitStatus::StillAlive))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info(n: i32, status: CloneStatus) -> CloneInfo {
        CloneInfo {
            id: n.to_string(),
            pid: n,
            api_sock: format!("/nonexistent/{n}.sock").into(),
            console: "/dev/null".into(),
            vsock: None,
            net: None,
            kept_overlays: vec![],
            latency_us: None,
            status,
            error: None,
            cgroup: None,
        }
    }

    #[test]
    fn the_oldest_records_of_ended_clones_go_first_and_live_ones_stay() {
        let mut t = CloneTable::default();
        t.record(1, &[info(1, CloneStatus::Running)]);
        for n in 2..=1100 {
            t.record(1, &[info(n, CloneStatus::Exited(0))]);
        }
        t.record(1, &[info(1101, CloneStatus::Running)]);
        assert_eq!(t.made(), 1101);
        let list = t.list();
        assert_eq!(list.len(), ENDED_KEPT + 2);
        assert_eq!(list[0].id, "1", "a live clone is never dropped");
        assert_eq!(list[1].id, (1100 - ENDED_KEPT + 1).to_string());
        assert_eq!(list.last().unwrap().id, "1101");
    }

    #[test]
    fn a_reused_pid_ends_the_live_clone_not_an_old_record() {
        let mut t = CloneTable::default();
        t.record(1, &[info(7, CloneStatus::Killed(15))]);
        t.record(1, &[info(7, CloneStatus::Running)]);
        t.reaped(None, 7, WaitStatus::Exited(Pid::from_raw(7), 3));
        let status: Vec<_> = t.list().iter().map(|c| c.status).collect();
        assert_eq!(status, [CloneStatus::Killed(15), CloneStatus::Exited(3)]);
        // No live clone has that pid any more: a second report changes nothing.
        assert!(t
            .reaped(None, 7, WaitStatus::Exited(Pid::from_raw(7), 4))
            .is_none());
    }

    #[test]
    fn a_starting_clone_runs_or_fails_and_its_caller_learns_why_once_it_is_reaped() {
        let mut t = CloneTable::default();
        let (a, _a) = UnixStream::pair().unwrap();
        let (b, _b) = UnixStream::pair().unwrap();
        t.record(
            2,
            &[
                info(5, CloneStatus::Starting),
                info(6, CloneStatus::Starting),
            ],
        );
        t.forget_when_reaped(5, Arc::new(a));
        t.forget_when_reaped(6, Arc::new(b));
        // Clone 5 entered the guest 2 ms after its request.
        assert!(t.started(5, Ok(3_000_000), 1_000_000));
        let why = StartFailure {
            reason: "cannot open its console: No space left on device".into(),
            errno: libc::ENOSPC,
        };
        assert!(t.started(6, Err(why), 1_000_000));
        let listed = t.list();
        assert_eq!(listed[0].status, CloneStatus::Running);
        assert_eq!(listed[0].latency_us, Some(2000));
        assert_eq!(listed[1].status, CloneStatus::Failed);
        assert!(listed[1]
            .error
            .as_deref()
            .unwrap()
            .contains("No space left"));
        // Only a clone still starting is told (not one reported before, or reaped).
        assert!(!t.started(5, Ok(4_000_000), 1_000_000));
        t.reaped(
            None,
            6,
            WaitStatus::Signaled(Pid::from_raw(6), Signal::SIGKILL, false),
        );
        t.reaped(
            None,
            5,
            WaitStatus::Signaled(Pid::from_raw(5), Signal::SIGKILL, false),
        );
        let orphans = t.take_orphans();
        assert_eq!(orphans.len(), 2);
        match &orphans[0].end {
            OrphanEnd::NotStarted(e) => {
                assert_eq!(e.errno, libc::ENOSPC);
                assert!(e.reason.contains("No space left"), "{e:?}");
            }
            other => panic!("{other:?}"),
        }
        match &orphans[1].end {
            OrphanEnd::Ended(how) => assert_eq!(how, "was killed by SIGKILL"),
            other => panic!("{other:?}"),
        }
        assert!(t.list().is_empty(), "transient records go when reaped");
        assert!(!t.started(6, Ok(1), 0));
    }
}
