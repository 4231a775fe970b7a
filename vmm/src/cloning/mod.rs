//! Flash cloning: quiesce -> capture -> fork -> rebuild.
//!
//! The parent pauses every vCPU (each parks outside KVM_RUN, holding no lock), has each
//! vCPU read its own state on its own thread, reads the VM-wide state and the devices',
//! then `fork()`s once per clone from the event-loop thread and resumes. Guest RAM is
//! anonymous `MAP_PRIVATE` memory, so every child shares it copy-on-write. The child
//! side is in `child.rs`.
//!
//! A paused VM's state cannot change, so it is captured once per pause and reused by
//! every request, and with `--warm-clones` clones are forked and prepared ahead of the
//! requests (`warm.rs`).
//!
//! Virtio device workers are parked with the vCPUs; each device's transport and queue
//! state is captured and the child rebuilds the devices from the VM's configuration.

pub mod cgroups;
mod child;
mod forker;
pub mod gate;
pub mod warm;

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use clone::{DeviceStates, MicrovmState};

use cgroups::{CloneCgroup, PlacementError, Taken};
pub use child::ChildError;
use child::{child_main, ChildPlan, Identity, Start};

use crate::api::CloneConsole;
use crate::config::ConsoleSink;
use crate::microvm::{Microvm, VmState};
use crate::vstate::vcpu::{VcpuError, VcpuEvent};

/// Most clones one request may ask for.
pub const MAX_CLONES_PER_REQUEST: u32 = 1000;
/// Most live clones one VM may have (each clone may have its own).
pub const MAX_LIVE_CLONES: usize = 2000;
/// What a guest reads from the clone port when its request failed.
pub const CLONE_FAILED: u64 = 0xffff_ffff;
/// How long the parent waits for a clone's vCPU 0 to enter the guest.
const READY_TIMEOUT: Duration = Duration::from_secs(10);
/// How long a clone has to exit after SIGTERM before it is killed.
const STOP_TIMEOUT: Duration = Duration::from_secs(3);
/// Longest Unix socket path (sun_path holds 108 bytes with the terminating NUL).
const MAX_SOCK_PATH: usize = 107;

/// Errors making clones. The parent keeps running (or stays paused) after any of them.
#[derive(Debug, thiserror::Error)]
pub enum CloneError {
    /// Count out of range.
    #[error("clone count must be 1 to {MAX_CLONES_PER_REQUEST}, not {0}")]
    Count(u64),
    /// Too many live clones.
    #[error("{live} clones are running; at most {MAX_LIVE_CLONES} may be")]
    TooMany {
        /// Live clones now.
        live: usize,
    },
    /// The VM is not in a state that can be cloned.
    #[error("cannot clone a VM that is {0:?}")]
    State(VmState),
    /// A virtio device's worker could not be paused.
    #[error("pausing devices failed: {0}")]
    Devices(#[from] devices::virtio::WorkerError),
    /// Pausing or capturing a vCPU failed.
    #[error("capturing vCPU state failed: {0}")]
    Vcpu(#[from] VcpuError),
    /// Reading VM state failed.
    #[error("capturing VM state failed: {0}")]
    VmState(#[from] clone::vm::VmStateError),
    /// A clone's socket path would be too long.
    #[error(
        "clone socket path {0} is longer than {MAX_SOCK_PATH} bytes; use a shorter --api-sock"
    )]
    PathTooLong(String),
    /// pipe() or fork() failed.
    #[error("cannot start a clone process: {0}")]
    Os(std::io::Error),
    /// The copy of the disk overlay for a clone could not be made.
    #[error("cannot copy the disk overlay for a clone: {0}")]
    Overlay(#[from] devices::virtio::block::overlay::OverlayError),
    /// A per-clone rate limit names a device the VM does not have.
    #[error(transparent)]
    RateLimit(crate::config::NoSuchDevice),
    /// Keeping overlays asked for a VM without a writable disk.
    #[error("keep_overlays given for clones of a VM without a writable disk")]
    NoOverlay,
    /// Taps or addresses for clones of a VM without a network card.
    #[error("taps or addresses given for clones of a VM without a network card")]
    NoCard,
    /// No cgroup for the clone.
    #[error(transparent)]
    Cgroup(#[from] PlacementError),
}

/// How to make clones, beyond how many.
#[derive(Debug, Clone, Copy)]
pub struct CloneOptions<'a> {
    /// Where the clones' consoles go.
    pub console: CloneConsole,
    /// The resource class whose pooled cgroups the clones go in (None: the first
    /// class, when the VMM has cgroup pools).
    pub class: Option<&'a str>,
    /// Limits replacing the template's for the clones' devices.
    pub rate_limits: &'a crate::config::DeviceRateLimits,
    /// Each clone's guest addresses, in order (empty: the template's).
    pub addresses: &'a [crate::config::CloneAddresses],
    /// Each clone's tap, made by the caller, in order (empty: each creates its own).
    pub taps: &'a [String],
    /// Whether the clones keep their writable disks' overlays when they end (None: as
    /// the template's disks say).
    pub keep_overlays: Option<bool>,
}

/// What became of a clone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case", tag = "state", content = "code")]
pub enum CloneStatus {
    /// Running (its vCPU 0 entered the guest).
    Running,
    /// Started but its vCPU 0 never reported entering the guest.
    Failed,
    /// Exited with this status.
    Exited(i32),
    /// Killed by this signal.
    Killed(i32),
    /// Killed by the OOM killer at its cgroup's memory limit.
    OomKilled,
}

impl CloneStatus {
    /// Not reaped yet (a clone that failed to report may still run).
    fn is_live(&self) -> bool {
        matches!(self, CloneStatus::Running | CloneStatus::Failed)
    }
}

/// One clone, as `POST /clones` and `GET /clones` report it.
#[derive(Debug, Clone, Serialize)]
pub struct CloneInfo {
    /// Clone id: the parent's id (if it is itself a clone), a dot, and a counter.
    pub id: String,
    /// Process id.
    pub pid: i32,
    /// The clone's own control socket.
    pub api_sock: PathBuf,
    /// The clone's console sink.
    pub console: PathBuf,
    /// The clone's vsock socket (with a vsock device).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub vsock: Option<PathBuf>,
    /// The clone's tap and MAC address (with a network card).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub net: Option<CloneNet>,
    /// Where the clone keeps its disks' overlays when it ends (not after SIGKILL).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub kept_overlays: Vec<PathBuf>,
    /// From the request reaching the VMM to the clone's vCPU 0 entering the guest.
    pub latency_us: Option<u64>,
    /// What became of it.
    pub status: CloneStatus,
    /// Its pooled cgroup and usage (None when the VMM has no cgroup pools).
    pub cgroup: Option<CloneCgroup>,
}

/// A clone's network card, as `POST /clones` reports it: the host configures the tap
/// (address, bridge, namespace) and may give the guest the MAC (docs/clone-network.md).
#[derive(Debug, Clone, Serialize)]
pub struct CloneNet {
    /// The tap the clone created (`fkvm<pid>`); it disappears when the clone exits.
    pub tap: String,
    /// The MAC address in the clone's device configuration and identity block.
    pub mac: crate::config::MacAddr,
    /// The address its identity block gives the guest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<crate::config::Ipv4Cidr>,
    /// The gateway its identity block gives the guest.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gateway: Option<std::net::Ipv4Addr>,
}

impl CloneInfo {
    /// A clone just forked or launched, not yet known to run.
    fn starting(
        identity: Identity,
        pid: i32,
        cgroup: Option<CloneCgroup>,
        template: &crate::config::VmConfig,
    ) -> Self {
        let net = (template.net.as_ref()).map(|n| n.for_clone(pid, &identity.net));
        let kept_overlays = crate::config::keep_overlays(&template.disks, identity.keep_overlays)
            .iter()
            .enumerate()
            .filter_map(|(i, d)| d.kept_path(i, pid))
            .collect();
        Self {
            id: identity.id,
            pid,
            api_sock: identity.api_sock,
            console: identity.console,
            vsock: identity.vsock,
            net: net.map(|n| CloneNet {
                tap: n.tap,
                mac: n.mac,
                ipv4: n.ipv4,
                gateway: n.gateway,
            }),
            kept_overlays,
            latency_us: None,
            status: CloneStatus::Failed,
            cgroup,
        }
    }
}

/// Clones made by this VM.
#[derive(Debug, Default)]
pub struct CloneTable {
    made: u32,
    clones: Vec<CloneInfo>,
    /// `made` when spare overlay files were last made (None: never).
    spares_at: Option<u32>,
}

impl CloneTable {
    /// Every clone, oldest first.
    pub fn list(&self) -> &[CloneInfo] {
        &self.clones
    }

    /// Records the exit of `pid`, from waitpid's `status`, with its cgroup usage.
    pub(crate) fn reaped(&mut self, pid: i32, status: i32, usage: Option<jailer::cgroup::Usage>) {
        if let Some(c) = self.clones.iter_mut().find(|c| c.pid == pid) {
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
    }

    fn live(&self) -> impl Iterator<Item = &CloneInfo> {
        self.clones.iter().filter(|c| c.status.is_live())
    }

    /// Pids of the live clones.
    fn live_pids(&self) -> Vec<i32> {
        self.live().map(|c| c.pid).collect()
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

impl Microvm {
    /// Reaps every exited child (clone or warm clone) without blocking.
    pub(crate) fn reap_children(&mut self) {
        loop {
            let mut status = 0;
            // SAFETY: waitpid with WNOHANG on our own children; `status` is a valid int.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            if !self.warm.reaped(pid) {
                self.clone_reaped(pid, status);
            } else if let Some(c) = self.cgroups.as_mut() {
                c.exited(pid);
            }
        }
    }

    /// A clone exited: its cgroup goes back to the pool, its record gets the status.
    fn clone_reaped(&mut self, pid: i32, status: i32) {
        let usage = self.cgroups.as_mut().and_then(|c| c.exited(pid));
        self.clones.reaped(pid, status, usage);
    }

    /// Stops the live clone with pid `pid`: SIGTERM, then SIGKILL after a grace
    /// period; reaps it.
    fn stop_pid_and_reap(&mut self, pid: i32) {
        stop_pid(pid, STOP_TIMEOUT);
        let mut status = 0;
        // SAFETY: `pid` is our child; blocking wait after it was told to exit.
        if unsafe { libc::waitpid(pid, &mut status, 0) } == pid {
            self.clone_reaped(pid, status);
        }
    }

    /// Time until this VM makes its disks' spare overlay files (zero: now), None when
    /// none is to be made. They are made once a moment after each clone request
    /// ([`crate::microvm::REFILL_DELAY`], as warm clones), and once at start by a VM
    /// that is not a clone (a clone makes them only once it has been cloned itself):
    /// each clone then takes a file made ahead instead of creating one on its path.
    pub(crate) fn spares_due_in(&self) -> Option<Duration> {
        if self.clones.spares_at == Some(self.clones.made) {
            return None;
        }
        let since = match self.clones.made {
            0 if self.clone_id().is_empty() => Duration::MAX,
            0 => return None,
            _ => self.warm.since_last_launch(),
        };
        self.devices
            .wants_spare_overlays()
            .then(|| crate::microvm::REFILL_DELAY.saturating_sub(since))
    }

    /// Makes the spare overlay files ([`Microvm::spares_due_in`]).
    pub(crate) fn make_spares(&mut self) {
        self.clones.spares_at = Some(self.clones.made);
        self.devices.make_spare_overlays();
    }

    /// Stops clone `id` and reaps it; None if no live clone has that id.
    pub fn stop_clone(&mut self, id: &str) -> Option<CloneInfo> {
        let pid = self.clones.live().find(|c| c.id == id)?.pid;
        self.stop_pid_and_reap(pid);
        self.clones.clones.iter().find(|c| c.id == id).cloned()
    }

    /// Stops every live clone (the parent is shutting down).
    pub fn stop_all_clones(&mut self) {
        for pid in self.clones.live_pids() {
            self.stop_pid_and_reap(pid);
        }
    }

    /// Every clone, with live clones' cgroup usage read now.
    pub fn list_clones(&mut self) -> Vec<CloneInfo> {
        self.reap_children();
        let mut list = self.clones.list().to_vec();
        if let Some(pools) = &self.cgroups {
            for c in list.iter_mut().filter(|c| c.status.is_live()) {
                if let Some(cg) = c.cgroup.as_mut() {
                    cg.usage = pools.usage(c.pid);
                }
            }
        }
        list
    }

    /// This VM's clone id ("" for an original VM).
    fn clone_id(&self) -> &str {
        &self.clone_id
    }

    /// Where clone files go: the control socket path, or a per-process one.
    fn clone_base(&self) -> PathBuf {
        self.config.api_sock.clone().unwrap_or_else(|| {
            std::env::temp_dir().join(format!("forkvm-{}.sock", std::process::id()))
        })
    }

    fn check_clone_request(&mut self, count: u64) -> Result<(), CloneError> {
        if count == 0 || count > u64::from(MAX_CLONES_PER_REQUEST) {
            return Err(CloneError::Count(count));
        }
        if !matches!(self.state, VmState::Running | VmState::Paused) {
            return Err(CloneError::State(self.state));
        }
        self.reap_children();
        let live = self.clones.live().count();
        if live + count as usize > MAX_LIVE_CLONES {
            return Err(CloneError::TooMany { live });
        }
        Ok(())
    }

    /// A guest read the clone port on vCPU `vcpu` (which parked itself) asking for
    /// `count` clones. Failures are logged and reported to the guest.
    pub(crate) fn guest_clone_request(&mut self, vcpu: u8, count: u32) {
        let requested = crate::vstate::vcpu::monotonic_ns();
        let made = self.make_clones(
            u64::from(count),
            requested,
            Some(vcpu),
            &CloneOptions {
                console: CloneConsole::File,
                class: None,
                rate_limits: &Default::default(),
                addresses: &[],
                taps: &[],
                keep_overlays: None,
            },
        );
        match made {
            Ok(made) => tracing::info!(
                "guest on vCPU {vcpu} made {} clone(s): {}",
                made.len(),
                made.iter()
                    .map(|c| c.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Err(e) => tracing::warn!("guest clone request on vCPU {vcpu} failed: {e}"),
        }
    }

    /// Answers a guest requester that is still parked: sets its clone-port result and,
    /// unless the whole VM is paused, lets it run.
    fn release_requester(&self, requester: Option<u8>, value: u64) {
        let Some(v) = requester.and_then(|id| self.vcpus.get(usize::from(id))) else {
            return;
        };
        if let Err(e) = v.set_rax(value) {
            tracing::error!("cannot return the clone result to vCPU {}: {e}", v.id());
        }
        if self.state == VmState::Running {
            if let Err(e) = v.resume() {
                tracing::error!("cannot resume vCPU {}: {e}", v.id());
            }
        }
    }

    /// Makes `count` clones. `requested_ns` is when the request reached the VMM
    /// (CLOCK_MONOTONIC), for the latency figures. `requester` is the parked vCPU of a
    /// guest request: each clone's copy of it reads the clone's sequence number, the
    /// parent's reads 0, or [`CLONE_FAILED`].
    pub fn make_clones(
        &mut self,
        count: u64,
        requested_ns: u64,
        requester: Option<u8>,
        options: &CloneOptions<'_>,
    ) -> Result<Vec<CloneInfo>, CloneError> {
        let CloneOptions {
            console,
            class,
            rate_limits,
            addresses,
            taps,
            keep_overlays,
        } = *options;
        let checked = self.check_clone_request(count).and_then(|()| {
            if !(addresses.is_empty() && taps.is_empty()) && self.config.net.is_none() {
                return Err(CloneError::NoCard);
            }
            if keep_overlays == Some(true) && self.config.disks.iter().all(|d| d.cow_dir.is_none())
            {
                return Err(CloneError::NoOverlay);
            }
            self.config
                .clone()
                .apply_rate_limits(rate_limits)
                .map_err(CloneError::RateLimit)
        });
        if let Err(e) = checked {
            self.release_requester(requester, CLONE_FAILED);
            return Err(e);
        }
        let base = self.clone_base();
        let mut identities = Vec::with_capacity(count as usize);
        for n in 0..count as u32 {
            let seq = self.clones.made + n + 1;
            let id = if self.clone_id().is_empty() {
                seq.to_string()
            } else {
                format!("{}.{seq}", self.clone_id())
            };
            let sock = PathBuf::from(format!("{}.{seq}", base.display()));
            let vsock = self
                .config
                .vsock
                .as_ref()
                .map(|_| PathBuf::from(format!("{}.vsock", sock.display())));
            for p in std::iter::once(&sock).chain(vsock.as_ref()) {
                if p.as_os_str().len() > MAX_SOCK_PATH {
                    return Err(CloneError::PathTooLong(p.display().to_string()));
                }
            }
            let console = match (&self.config.console, console) {
                (ConsoleSink::Null, _) | (_, CloneConsole::Null) => PathBuf::from("/dev/null"),
                _ => PathBuf::from(format!("{}.console", sock.display())),
            };
            identities.push(Identity {
                id,
                api_sock: sock,
                console,
                vsock,
                rate_limits: *rate_limits,
                net: crate::config::CloneNetSpec {
                    tap: taps.get(n as usize).cloned(),
                    addresses: addresses.get(n as usize).copied(),
                },
                keep_overlays,
                guest_result: requester.map(|v| (v, u64::from(seq))),
                cgroup: None,
            });
        }

        let t0 = Instant::now();
        let was_running = self.state == VmState::Running;
        let mut made = if self.state == VmState::Paused
            && requester.is_none()
            && self.pending_events.is_empty()
        {
            // Nothing can change a paused VM: reuse its state and its warm clones.
            let result = self
                .epoch_state()
                .and_then(|state| self.launch_or_fork(&state, identities, class));
            tracing::debug!("clone (paused VM): {} us", t0.elapsed().as_micros());
            result?
        } else {
            self.clone_now(identities, requester, class, t0)?
        };
        // A running VM's device workers were left parked by clone_now until its first
        // clone is up: woken at once, they took the CPUs the clone starts on (0.5-0.9 ms
        // more here with five of them). Meanwhile the guest's requests wait in their
        // queues; not for all of a large batch, though.
        let mut devices_parked = was_running;
        for (info, ready) in made.iter_mut() {
            match wait_ready(ready, READY_TIMEOUT) {
                Some(t) => {
                    info.latency_us = Some(t.saturating_sub(requested_ns) / 1000);
                    info.status = CloneStatus::Running;
                }
                None => info.status = CloneStatus::Failed,
            }
            if std::mem::take(&mut devices_parked) {
                self.devices.resume_virtio();
            }
        }
        if devices_parked {
            self.devices.resume_virtio();
        }
        // The clones are up: the forker may move on to the next one's cgroup.
        if let Some(p) = &self.cgroups {
            p.reseat();
        }
        let infos: Vec<CloneInfo> = made.into_iter().map(|(i, _)| i).collect();
        self.warm.note_request();
        self.clones.made += count as u32;
        self.clones.clones.extend(infos.iter().cloned());
        Ok(infos)
    }

    /// Pairs each identity with a cgroup from the pool of `class` (none without pools).
    fn take_cgroups(
        &self,
        identities: Vec<Identity>,
        class: Option<&str>,
    ) -> Result<Vec<NewClone>, CloneError> {
        let Some(pools) = &self.cgroups else {
            if let Some(c) = class {
                return Err(PlacementError::NoPools(c.to_string()).into());
            }
            return Ok(identities.into_iter().map(|i| (i, None)).collect());
        };
        let mut clones = Vec::with_capacity(identities.len());
        for identity in identities {
            // The first may be the forker's (v1): born inside its cgroup.
            let seat = clones.is_empty().then(|| pools.take_seat(class)).flatten();
            match seat.map_or_else(|| pools.take(class), Ok) {
                Ok(t) => clones.push((identity, Some(t))),
                Err(e) => {
                    self.give_back(clones.into_iter().map(|(_, t)| t));
                    return Err(e.into());
                }
            }
        }
        Ok(clones)
    }

    /// Returns the cgroups of clones that were not started.
    pub(super) fn give_back(&self, taken: impl IntoIterator<Item = Option<Taken>>) {
        if let Some(pools) = &self.cgroups {
            taken.into_iter().flatten().for_each(|t| pools.give_back(t));
        }
    }

    /// Pauses (if running), captures, forks one child per identity, and resumes.
    fn clone_now(
        &mut self,
        identities: Vec<Identity>,
        requester: Option<u8>,
        class: Option<&str>,
        t0: Instant,
    ) -> Result<Vec<(CloneInfo, File)>, CloneError> {
        let clones = match self.take_cgroups(identities, class) {
            Ok(c) => c,
            Err(e) => {
                self.release_requester(requester, CLONE_FAILED);
                return Err(e);
            }
        };
        let was_running = self.state == VmState::Running;
        if was_running {
            if let Err(e) = self.pause_all() {
                self.give_back(clones.into_iter().map(|(_, t)| t));
                self.release_requester(requester, CLONE_FAILED);
                return Err(e);
            }
        }
        let t_pause = t0.elapsed();
        // Every vCPU is parked now, so any other vCPU that read the clone port has
        // queued its request: it stays parked here (served next, in turn) and its copy
        // in these clones reads CLONE_FAILED (the guest may retry).
        self.drain_vcpu_events();
        let waiting: Vec<u8> = self
            .pending_events
            .iter()
            .filter_map(|(id, e)| matches!(e, VcpuEvent::CloneRequest(_)).then_some(*id))
            .filter(|id| Some(*id) != requester)
            .collect();
        let captured = self.capture().map(|mut state| {
            for v in state.vcpus.iter_mut().filter(|v| waiting.contains(&v.id)) {
                v.regs.rax = CLONE_FAILED;
            }
            state
        });
        let t_capture = t0.elapsed();
        let result = match captured {
            Ok(state) => self.fork_all(&state, clones),
            Err(e) => {
                self.give_back(clones.into_iter().map(|(_, t)| t));
                Err(e)
            }
        };
        let t_fork = t0.elapsed();
        if let Some(v) = requester.and_then(|id| self.vcpus.get(usize::from(id))) {
            let value = if result.is_ok() { 0 } else { CLONE_FAILED };
            if let Err(e) = v.set_rax(value) {
                tracing::error!("cannot return the clone result to vCPU {}: {e}", v.id());
            }
        }
        // The device workers of a running VM resume once its first clone is up
        // (make_clones), unless cloning failed.
        if was_running {
            let resumed = if result.is_ok() {
                self.resume_vcpus(&waiting)
            } else {
                self.resume_all(&waiting)
            };
            if let Err(e) = resumed {
                tracing::error!("resuming after cloning failed: {e}");
            }
        }
        if let Some(pools) = self.cgroups.as_mut() {
            pools.close_spent();
        }
        tracing::debug!(
            "clone: paused {} us, captured {} us, forked {} us, resumed {} us (cumulative)",
            t_pause.as_micros(),
            t_capture.as_micros(),
            t_fork.as_micros(),
            t0.elapsed().as_micros()
        );
        result
    }

    /// For a paused VM: launches warm clones while there are any, forks the rest.
    /// Warm clones sit in a cgroup of the first class already: they serve requests
    /// for that class (or any request without pools); others are forked.
    fn launch_or_fork(
        &mut self,
        state: &MicrovmState,
        identities: Vec<Identity>,
        class: Option<&str>,
    ) -> Result<Vec<(CloneInfo, File)>, CloneError> {
        let warm_fits = self
            .cgroups
            .as_ref()
            .map_or(class.is_none(), |p| p.is_default(class));
        let mut made = Vec::with_capacity(identities.len());
        let mut rest = Vec::new();
        for identity in identities {
            let launched = if warm_fits {
                self.launch_warm_clone(&identity)
            } else {
                None
            };
            match launched {
                Some((pid, ready, cgroup)) => made.push((
                    CloneInfo::starting(identity, pid, cgroup, &self.config),
                    ready,
                )),
                None => rest.push(identity),
            }
        }
        if !rest.is_empty() {
            let clones = self.take_cgroups(rest, class)?;
            made.extend(self.fork_all(state, clones)?);
        }
        Ok(made)
    }

    fn pause_all(&mut self) -> Result<(), CloneError> {
        for (i, v) in self.vcpus.iter().enumerate() {
            if let Err(e) = v.pause() {
                for p in &self.vcpus[..i] {
                    let _ = p.resume();
                }
                return Err(e.into());
            }
        }
        Ok(())
    }

    /// Resumes the devices and every vCPU but those in `keep_parked`.
    fn resume_all(&self, keep_parked: &[u8]) -> Result<(), VcpuError> {
        self.devices.resume_virtio();
        self.resume_vcpus(keep_parked)
    }

    /// Resumes the vCPUs, except those in `keep_parked`.
    fn resume_vcpus(&self, keep_parked: &[u8]) -> Result<(), VcpuError> {
        self.vcpus
            .iter()
            .filter(|v| !keep_parked.contains(&v.id()))
            .try_for_each(|v| v.resume())
    }

    /// Reads every vCPU's state (each on its own thread, all at once), then the VM's and
    /// the devices'. Every vCPU must be parked; the virtio workers are parked here and
    /// stay so until the VM resumes (`resume_all`, or the API's resume).
    fn capture(&mut self) -> Result<MicrovmState, CloneError> {
        for v in &self.vcpus {
            v.request_capture(self.capture_spec.clone())?;
        }
        let mut vcpus = Vec::with_capacity(self.vcpus.len());
        let mut unreadable = Vec::new();
        for v in &self.vcpus {
            let (state, skipped) = v.collect_capture()?;
            unreadable.extend(skipped);
            vcpus.push(state);
        }
        // MSRs KVM lists but this vCPU model cannot read are dropped from the list once,
        // so later captures need a single KVM_GET_MSRS per vCPU.
        if !unreadable.is_empty() {
            let mut spec = (*self.capture_spec).clone();
            spec.msr_indices.retain(|i| !unreadable.contains(i));
            tracing::debug!(
                "MSRs listed by KVM but not readable, no longer saved: {unreadable:#x?}"
            );
            self.capture_spec = Arc::new(spec);
        }
        let virtio = self.devices.pause_virtio()?;
        let vm = clone::vm::save_vm(&self._vm)?;
        let serial = self
            .devices
            .serial
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .save();
        Ok(MicrovmState {
            captured_at_ns: crate::vstate::vcpu::monotonic_ns(),
            vm,
            vcpus,
            devices: DeviceStates { serial, virtio },
        })
    }

    /// Where a clone in `taken` goes and what `GET /clones` shows (both None without
    /// cgroup pools).
    pub(super) fn placement(
        &self,
        taken: Option<&Taken>,
    ) -> (Option<cgroups::Placement>, Option<CloneCgroup>) {
        match self.cgroups.as_ref().zip(taken) {
            Some((pools, t)) => {
                let (placement, shown) = pools.placement(t);
                (Some(placement), Some(shown))
            }
            None => (None, None),
        }
    }

    /// Clone `pid` was started in cgroup `taken`.
    pub(super) fn started_in(&mut self, pid: i32, taken: Option<Taken>) {
        if let (Some(pools), Some(t)) = (self.cgroups.as_mut(), taken) {
            pools.started(pid, t);
        }
    }

    fn fork_all(
        &mut self,
        state: &MicrovmState,
        clones: Vec<NewClone>,
    ) -> Result<Vec<(CloneInfo, File)>, CloneError> {
        let mut made = Vec::with_capacity(clones.len());
        let mut clones = clones.into_iter();
        while let Some((mut identity, taken)) = clones.next() {
            let (placement, mut cgroup) = self.placement(taken.as_ref());
            identity.cgroup = placement;
            let forked = pipe()
                .map_err(CloneError::Os)
                .and_then(|(read_end, write_end)| {
                    let start = Start::Now(Box::new(identity.clone()));
                    let forked = self.fork_child(state, &write_end, start, taken.as_ref())?;
                    Ok((forked, read_end))
                });
            match forked {
                Ok(((pid, born_inside), read_end)) => {
                    if born_inside {
                        identity.cgroup = None;
                        if let Some(c) = cgroup.as_mut() {
                            c.placed_by = "forker";
                        }
                    }
                    self.started_in(pid, taken);
                    made.push((
                        CloneInfo::starting(identity, pid, cgroup, &self.config),
                        File::from(read_end),
                    ));
                }
                Err(e) => {
                    self.give_back(std::iter::once(taken).chain(clones.map(|(_, t)| t)));
                    return Err(e);
                }
            }
        }
        Ok(made)
    }

    /// Forks one child that rebuilds this VM from `state` and starts per `start`;
    /// `ready` is the write end of its ready pipe; `taken` its cgroup: the child is born
    /// in it when it is a v2 one (`clone3`) or the forker's seat with the forker
    /// inside (v1). Returns the child's pid and whether it was born inside its cgroup
    /// that way. Every vCPU must be parked.
    pub(super) fn fork_child(
        &self,
        state: &MicrovmState,
        ready: &OwnedFd,
        start: Start,
        taken: Option<&Taken>,
    ) -> Result<(i32, bool), CloneError> {
        let run_bases: Vec<usize> = self.vcpus.iter().map(|v| v.kvm_run_base()).collect();
        // The child's copies of the disk overlays: the disks' workers are parked, so
        // each overlay holds exactly what the guest wrote up to the clone point. The
        // parent closes its descriptors of the copies when this returns.
        let t0 = Instant::now();
        let overlays = self.devices.snapshot_overlays()?;
        let t_overlays = t0.elapsed();
        let plan = ChildPlan {
            // SAFETY: getpid has no preconditions.
            parent_pid: unsafe { libc::getpid() },
            ready: ready.as_raw_fd(),
            start,
            state,
            mem: &self._mem,
            kvm: &self.kvm,
            config: &self.config,
            host: &self.host,
            cmdline: &self.cmdline,
            spec: &self.capture_spec,
            run_bases: &run_bases,
            run_size: self.kvm_run_size,
            disk_fds: self.devices.disk_fds(),
            overlays: &overlays,
        };
        let into = taken.and_then(|t| t.dir.as_ref());
        let fork = |mut plan: ChildPlan<'_>, born_inside: bool| {
            if let (true, Start::Now(id)) = (born_inside, &mut plan.start) {
                id.cgroup = None;
            }
            // SAFETY: every vCPU and virtio worker is parked holding no lock, the API
            // thread holds none while the gate is closed (see `gate`), and on the
            // forker the main thread waits for this without holding one: so neither
            // fork() nor clone3 (which skips glibc's fork handling, see `fork_into`)
            // leaves the child a lock or a malloc arena that nobody will release.
            match gate::closed(|| unsafe { cgroups::fork_into(into) }) {
                // Read on the thread that forked.
                -1 => Err(CloneError::Os(std::io::Error::last_os_error())),
                0 => child_main(plan),
                pid => Ok(pid),
            }
        };
        let forker = self
            .cgroups
            .as_ref()
            .zip(taken)
            .and_then(|(p, t)| Some((p.forker_for(t)?, t.name())));
        let mut plan = Some(plan);
        let on_forker = forker.and_then(|(f, name)| {
            f.run(|seated| {
                let born = seated == Some(name);
                plan.take().map(|p| (fork(p, born), born))
            })
            .flatten()
        });
        let (forked, born_inside) = match (on_forker, plan) {
            (Some(done), _) => done,
            // No forker, or it is gone: from this thread (the clone moves itself in).
            (None, Some(plan)) => (fork(plan, false), false),
            (None, None) => unreachable!("the plan is taken only by a fork"),
        };
        let pid = forked?;
        tracing::debug!(
            "clone {pid}: overlay copies {} us, fork {} us{}",
            t_overlays.as_micros(),
            (t0.elapsed() - t_overlays).as_micros(),
            if born_inside { " (forker)" } else { "" }
        );
        Ok((pid, born_inside))
    }
}

/// A clone about to be made: its identity and its cgroup (with cgroup pools).
type NewClone = (Identity, Option<Taken>);

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 returns.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two new descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Reads what a clone writes to its ready pipe, in either order: the 8-byte
/// CLOCK_MONOTONIC time its vCPU 0 first entered the guest, and `READY_MARK` (its host
/// endpoints and control socket are up); then waits for the end of the pipe. Returns
/// the time; None on timeout, or if the clone died or failed before both.
fn wait_ready(f: &mut File, timeout: Duration) -> Option<u64> {
    use std::io::Read;
    let deadline = Instant::now() + timeout;
    let mut got = Vec::with_capacity(16);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let mut pfd = libc::pollfd {
            fd: f.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd.
        if unsafe { libc::poll(&mut pfd, 1, left.as_millis() as i32) } != 1 {
            return None;
        }
        let mut b = [0u8; 8];
        match f.read(&mut b) {
            Ok(0) => break,
            Ok(n) => got.extend_from_slice(&b[..n]),
            Err(_) => return None,
        }
    }
    parse_ready(&got)
}

/// The vCPU's time from the ready pipe's contents, if they are the time and the mark.
fn parse_ready(got: &[u8]) -> Option<u64> {
    if got.len() != 16 {
        return None;
    }
    let first = u64::from_le_bytes(got[..8].try_into().ok()?);
    let second = u64::from_le_bytes(got[8..].try_into().ok()?);
    match (first == child::READY_MARK, second == child::READY_MARK) {
        (true, false) => Some(second),
        (false, true) => Some(first),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ready_bytes(parts: &[u64]) -> Vec<u8> {
        parts.iter().flat_map(|p| p.to_le_bytes()).collect()
    }

    #[test]
    fn ready_pipe_needs_the_time_and_the_mark_in_either_order() {
        let mark = child::READY_MARK;
        assert_eq!(parse_ready(&ready_bytes(&[42, mark])), Some(42));
        assert_eq!(parse_ready(&ready_bytes(&[mark, 42])), Some(42));
        // The vCPU ran but the clone failed before its control socket was up.
        assert_eq!(parse_ready(&ready_bytes(&[42])), None);
        // The control thread finished but vCPU 0 never entered the guest.
        assert_eq!(parse_ready(&ready_bytes(&[mark])), None);
        assert_eq!(parse_ready(&ready_bytes(&[mark, mark])), None);
        assert_eq!(parse_ready(&ready_bytes(&[1, 2])), None);
        assert_eq!(parse_ready(&[]), None);
        assert_eq!(parse_ready(&ready_bytes(&[42, mark])[..15]), None);
    }
}
