//! Flash cloning: quiesce -> capture -> fork -> rebuild.
//!
//! The parent pauses every vCPU (each parks outside KVM_RUN, holding no lock), has each
//! vCPU read its own state on its own thread, reads the VM-wide state and the devices',
//! then `fork()`s once per clone from the event-loop thread and resumes. Guest RAM is
//! anonymous `MAP_PRIVATE` memory, so every child shares it copy-on-write.
//!
//! A child starts with only the forking thread. It dies with its parent
//! (`PR_SET_PDEATHSIG`), unmaps the parent's `kvm_run` pages, closes every inherited file
//! descriptor, and never drops the parent's objects (their threads do not exist in the
//! child). It then creates a new VM on the inherited guest memory (memory slots first),
//! restores vCPUs, VM and devices, starts new threads, a new console sink and control
//! socket, and runs its own event loop until it exits. vCPU 0 of the child writes the
//! time it first enters the guest into a pipe, which gives the clone latency.
//!
//! Not yet: guest-initiated clones (the clone port), virtio devices in clones (a VM with
//! any is refused), and clone identity beyond id, socket and console (entropy, wall
//! clock) — see docs/cloning.md.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;
use vm_memory::GuestMemoryMmap;

use clone::vcpu::CaptureSpec;
use clone::{DeviceStates, MicrovmState};

use crate::api::server::ApiServer;
use crate::api::CloneConsole;
use crate::builder::{start_vcpus, BuildError};
use crate::config::{ConsoleSink, VmConfig};
use crate::device_manager::DeviceManager;
use crate::microvm::{block_shutdown_signals, HostReport, Microvm, RunOutcome, VmState};
use crate::vstate::kvm::KvmContext;
use crate::vstate::vcpu::{Vcpu, VcpuError, VcpuEvent};
use crate::vstate::vm::create_vm;

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
    /// The VM has devices that cannot be cloned yet.
    #[error("cannot clone this VM yet: {0}")]
    Unsupported(&'static str),
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
    /// From the request reaching the VMM to the clone's vCPU 0 entering the guest.
    pub latency_us: Option<u64>,
    /// What became of it.
    pub status: CloneStatus,
}

/// Clones made by this VM.
#[derive(Debug, Default)]
pub struct CloneTable {
    made: u32,
    clones: Vec<CloneInfo>,
}

impl CloneTable {
    /// Every clone, oldest first.
    pub fn list(&self) -> &[CloneInfo] {
        &self.clones
    }

    /// Records the exit of `pid`, from waitpid's `status`.
    fn reaped(&mut self, pid: i32, status: i32) {
        if let Some(c) = self.clones.iter_mut().find(|c| c.pid == pid) {
            c.status = if libc::WIFSIGNALED(status) {
                CloneStatus::Killed(libc::WTERMSIG(status))
            } else {
                CloneStatus::Exited(libc::WEXITSTATUS(status))
            };
            // A clone that dies without its own cleanup (SIGKILL) leaves its socket.
            let _ = std::fs::remove_file(&c.api_sock);
        }
    }

    /// Reaps every exited child without blocking.
    pub fn reap(&mut self) {
        loop {
            let mut status = 0;
            // SAFETY: waitpid with WNOHANG on our own children; `status` is a valid int.
            let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
            if pid <= 0 {
                break;
            }
            self.reaped(pid, status);
        }
    }

    fn live(&self) -> impl Iterator<Item = &CloneInfo> {
        self.clones
            .iter()
            .filter(|c| matches!(c.status, CloneStatus::Running | CloneStatus::Failed))
    }

    /// Stops clone `id`: SIGTERM, then SIGKILL after a grace period; reaps it.
    pub fn stop(&mut self, id: &str) -> Option<CloneInfo> {
        let pid = self.live().find(|c| c.id == id)?.pid;
        stop_pid(pid, STOP_TIMEOUT);
        let mut status = 0;
        // SAFETY: `pid` is our child; blocking wait after it was told to exit.
        if unsafe { libc::waitpid(pid, &mut status, 0) } == pid {
            self.reaped(pid, status);
        }
        self.clones.iter().find(|c| c.id == id).cloned()
    }

    /// Stops every live clone (the parent is shutting down).
    pub fn stop_all(&mut self) {
        let ids: Vec<String> = self.live().map(|c| c.id.clone()).collect();
        for id in ids {
            self.stop(&id);
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

/// Everything a child needs, gathered before fork.
struct ChildPlan<'a> {
    id: String,
    api_sock: PathBuf,
    console: PathBuf,
    parent_pid: i32,
    ready: RawFd,
    state: &'a MicrovmState,
    mem: &'a GuestMemoryMmap,
    config: &'a VmConfig,
    host: &'a HostReport,
    cmdline: &'a str,
    spec: &'a Arc<CaptureSpec>,
    run_bases: &'a [usize],
    run_size: usize,
    /// The vCPU that read the clone port, and the value it reads in this clone.
    guest_result: Option<(u8, u64)>,
}

impl Microvm {
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
        if self.devices.virtio_count() > 0 {
            return Err(CloneError::Unsupported(
                "virtio devices are not cloned yet (start the template without --rootfs)",
            ));
        }
        self.clones.reap();
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
        match self.make_clones(u64::from(count), requested, Some(vcpu), CloneConsole::File) {
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
    /// parent's reads 0, or [`CLONE_FAILED`]. `console` says where the clones' consoles
    /// go.
    pub fn make_clones(
        &mut self,
        count: u64,
        requested_ns: u64,
        requester: Option<u8>,
        console: CloneConsole,
    ) -> Result<Vec<CloneInfo>, CloneError> {
        if let Err(e) = self.check_clone_request(count) {
            self.release_requester(requester, CLONE_FAILED);
            return Err(e);
        }
        let base = self.clone_base();
        let mut plans = Vec::with_capacity(count as usize);
        for n in 0..count as u32 {
            let seq = self.clones.made + n + 1;
            let id = if self.clone_id().is_empty() {
                seq.to_string()
            } else {
                format!("{}.{seq}", self.clone_id())
            };
            let sock = PathBuf::from(format!("{}.{seq}", base.display()));
            if sock.as_os_str().len() > MAX_SOCK_PATH {
                return Err(CloneError::PathTooLong(sock.display().to_string()));
            }
            let console = match (&self.config.console, console) {
                (ConsoleSink::Null, _) | (_, CloneConsole::Null) => PathBuf::from("/dev/null"),
                _ => PathBuf::from(format!("{}.console", sock.display())),
            };
            plans.push((id, sock, console, seq));
        }

        let t0 = Instant::now();
        let was_running = self.state == VmState::Running;
        if was_running {
            if let Err(e) = self.pause_all() {
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
        let result = captured.and_then(|state| self.fork_all(&state, plans, requester));
        let t_fork = t0.elapsed();
        if let Some(v) = requester.and_then(|id| self.vcpus.get(usize::from(id))) {
            let value = if result.is_ok() { 0 } else { CLONE_FAILED };
            if let Err(e) = v.set_rax(value) {
                tracing::error!("cannot return the clone result to vCPU {}: {e}", v.id());
            }
        }
        if was_running {
            if let Err(e) = self.resume_all(&waiting) {
                tracing::error!("resuming after cloning failed: {e}");
            }
        }
        tracing::debug!(
            "clone: paused {} us, captured {} us, forked {} us, resumed {} us (cumulative)",
            t_pause.as_micros(),
            t_capture.as_micros(),
            t_fork.as_micros(),
            t0.elapsed().as_micros()
        );
        let mut made = result?;
        for (info, ready) in made.iter_mut() {
            match wait_ready(ready, READY_TIMEOUT) {
                Some(t) => {
                    info.latency_us = Some(t.saturating_sub(requested_ns) / 1000);
                    info.status = CloneStatus::Running;
                }
                None => info.status = CloneStatus::Failed,
            }
        }
        let infos: Vec<CloneInfo> = made.into_iter().map(|(i, _)| i).collect();
        self.clones.made += count as u32;
        self.clones.clones.extend(infos.iter().cloned());
        Ok(infos)
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

    /// Resumes every vCPU but those in `keep_parked`.
    fn resume_all(&self, keep_parked: &[u8]) -> Result<(), VcpuError> {
        self.vcpus
            .iter()
            .filter(|v| !keep_parked.contains(&v.id()))
            .try_for_each(|v| v.resume())
    }

    /// Reads every vCPU's state (each on its own thread, all at once), then the VM's and
    /// the devices'.
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
            devices: DeviceStates { serial },
        })
    }

    fn fork_all(
        &mut self,
        state: &MicrovmState,
        plans: Vec<(String, PathBuf, PathBuf, u32)>,
        requester: Option<u8>,
    ) -> Result<Vec<(CloneInfo, File)>, CloneError> {
        let run_bases: Vec<usize> = self.vcpus.iter().map(|v| v.kvm_run_base()).collect();
        let run_size = self.kvm_run_size;
        // SAFETY: getpid has no preconditions.
        let parent_pid = unsafe { libc::getpid() };
        let mut made = Vec::with_capacity(plans.len());
        for (id, api_sock, console, seq) in plans {
            let (read_end, write_end) = pipe().map_err(CloneError::Os)?;
            let plan = ChildPlan {
                id: id.clone(),
                api_sock: api_sock.clone(),
                console: console.clone(),
                parent_pid,
                ready: write_end.as_raw_fd(),
                state,
                mem: &self._mem,
                config: &self.config,
                host: &self.host,
                cmdline: &self.cmdline,
                spec: &self.capture_spec,
                run_bases: &run_bases,
                run_size,
                guest_result: requester.map(|v| (v, u64::from(seq))),
            };
            // SAFETY: every other thread is parked holding no lock (vCPUs paused in their
            // command channel, the API thread waiting for this request's answer, no
            // virtio workers), so the child, which only has this thread, finds no lock
            // held; glibc makes malloc usable after fork.
            let pid = unsafe { libc::fork() };
            match pid {
                -1 => return Err(CloneError::Os(std::io::Error::last_os_error())),
                0 => child_main(plan),
                pid => {
                    drop(write_end);
                    made.push((
                        CloneInfo {
                            id,
                            pid,
                            api_sock,
                            console,
                            latency_us: None,
                            status: CloneStatus::Failed,
                        },
                        File::from(read_end),
                    ));
                }
            }
        }
        Ok(made)
    }
}

fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors pipe2 returns.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: pipe2 returned two new descriptors that nothing else owns.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// Reads the 8-byte CLOCK_MONOTONIC timestamp a clone's vCPU 0 writes when it first
/// enters the guest, then waits for the end of the pipe (the clone's control socket is
/// up). None on timeout or if the clone died first.
fn wait_ready(f: &mut File, timeout: Duration) -> Option<u64> {
    use std::io::Read;
    let deadline = Instant::now() + timeout;
    let mut got = Vec::with_capacity(8);
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
    let bytes: [u8; 8] = got.get(..8)?.try_into().ok()?;
    Some(u64::from_le_bytes(bytes))
}

/// The child side of fork(). Never returns.
fn child_main(plan: ChildPlan<'_>) -> ! {
    // SAFETY: prctl/getppid have no memory-safety preconditions.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        if libc::getppid() != plan.parent_pid {
            libc::_exit(1);
        }
    }
    for base in plan.run_bases {
        // SAFETY: these are the parent's vCPU kvm_run mappings, inherited by fork; no
        // thread of this process uses them (their owners exist only in the parent).
        unsafe { libc::munmap(*base as *mut libc::c_void, plan.run_size) };
    }
    // SAFETY: closes inherited descriptors; the objects that own them in this process
    // belong to the parent's threads and are never used or dropped here.
    unsafe {
        libc::close_range(3, (plan.ready - 1) as u32, 0);
        libc::close_range((plan.ready + 1) as u32, u32::MAX, 0);
    }
    // SAFETY: the ready pipe's write end, kept open above, owned from here on.
    let ready = unsafe { File::from_raw_fd(plan.ready) };
    let code = match run_clone(&plan, ready) {
        Ok(outcome) => {
            if let RunOutcome::Error(msg) = &outcome {
                eprintln!("vmm: clone {}: guest stopped: {msg}", plan.id);
            }
            outcome.exit_code()
        }
        Err(e) => {
            eprintln!("vmm: clone {}: {e}", plan.id);
            1
        }
    };
    std::process::exit(code)
}

/// Errors rebuilding a VM in a clone.
#[derive(Debug, thiserror::Error)]
pub enum ChildError {
    /// Building the VM failed.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// Restoring vCPU state failed.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// Restoring VM state failed.
    #[error(transparent)]
    VmState(#[from] clone::vm::VmStateError),
    /// The control socket could not be served.
    #[error(transparent)]
    Api(#[from] crate::api::server::ApiServerError),
    /// Running failed.
    #[error(transparent)]
    Run(#[from] crate::microvm::RunError),
    /// Signal routing failed.
    #[error("cannot set up signal handling: {0}")]
    Signals(std::io::Error),
    /// The pipe that tells the parent the clone is ready failed.
    #[error("ready pipe: {0}")]
    ReadyPipe(std::io::Error),
}

fn run_clone(plan: &ChildPlan<'_>, ready: File) -> Result<RunOutcome, ChildError> {
    let started = Instant::now();
    let mut marks: Vec<(&str, u128)> = Vec::new();
    let mut mark = |what| marks.push((what, started.elapsed().as_micros()));
    let signals = block_shutdown_signals().map_err(ChildError::Signals)?;
    let mut config = plan.config.clone();
    config.api_sock = Some(plan.api_sock.clone());
    config.console = ConsoleSink::File(plan.console.clone());
    mark("signals");
    let kvm = KvmContext::open().map_err(BuildError::from)?;
    mark("kvm");
    let vm = create_vm(&kvm, plan.mem).map_err(BuildError::from)?;
    mark("vm");
    let devices = DeviceManager::new(
        &vm,
        &config.console,
        config.vcpus,
        Some(&plan.state.devices.serial),
    )
    .map_err(BuildError::from)?;
    mark("devices");
    // The guest's clocks continue from the capture as if it had kept running.
    let mut state = plan.state.clone();
    let elapsed = crate::vstate::vcpu::monotonic_ns().saturating_sub(state.captured_at_ns);
    state.advance_clocks(elapsed);
    // The vCPU that read the clone port reads this clone's sequence number.
    if let Some((id, value)) = plan.guest_result {
        if let Some(v) = state.vcpus.iter_mut().find(|v| v.id == id) {
            v.regs.rax = value;
        }
    }
    let mut vcpus = Vec::with_capacity(state.vcpus.len());
    for s in &state.vcpus {
        let (v, skipped) = Vcpu::from_state(&vm, s)?;
        if !skipped.is_empty() {
            tracing::debug!("clone {}: host refused MSRs {skipped:#x?}", plan.id);
        }
        vcpus.push(v);
    }
    mark("vcpus");
    clone::vm::restore_vm(&vm, &state.vm)?;
    mark("vm state");
    // The parent answers once every write end of the ready pipe is closed: vCPU 0's
    // (after it wrote its timestamp) and this one (after the control socket is up).
    let api_ready = ready.try_clone().map_err(ChildError::ReadyPipe)?;
    let started_vcpus = start_vcpus(vcpus, &devices, Some(ready))?;
    mark("started");
    // The control socket comes up once the guest runs: it is off the latency path.
    let api = ApiServer::start(&plan.api_sock)?;
    drop(api_ready);
    mark("api");
    tracing::info!(
        "clone {} (pid {}) running in {} us",
        plan.id,
        std::process::id(),
        started.elapsed().as_micros()
    );
    tracing::debug!("clone {} stages (cumulative us): {marks:?}", plan.id);
    let microvm = Microvm {
        config,
        _vm: vm,
        _mem: plan.mem.clone(),
        devices,
        vcpus: started_vcpus.handles,
        vcpu_events: started_vcpus.events,
        vcpu_exit_evt: started_vcpus.exit_evt,
        host: plan.host.clone(),
        cmdline: plan.cmdline.to_string(),
        state: VmState::Running,
        started: Instant::now(),
        capture_spec: plan.spec.clone(),
        clones: CloneTable::default(),
        clone_id: plan.id.clone(),
        kvm_run_size: plan.run_size,
        pending_events: Default::default(),
    };
    Ok(microvm.run(Some(&api), Some(&signals))?)
}
