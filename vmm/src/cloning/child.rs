//! The child side of a clone: rebuild the VM around the inherited guest RAM and run it.
//!
//! A child starts with only the forking thread. It dies with its parent
//! (`PR_SET_PDEATHSIG`), unmaps the parent's `kvm_run` pages, closes every inherited file
//! descriptor but its pipes, and never drops the parent's objects (their threads do not
//! exist in the child). It then creates a new VM on the inherited guest memory (memory
//! slots first) and restores its vCPUs ([`prepare`]), then gets its identity, devices,
//! VM-wide state, threads and control socket ([`launch`]).
//!
//! A clone made on request does both at once. A warm clone (see `warm.rs`) is forked
//! ahead of time from a paused template: it prepares, then blocks on its `go` pipe until
//! a request gives it an identity, re-times its clocks and launches. Its vCPU 0 writes
//! the time it first enters the guest into the `ready` pipe, which gives the latency;
//! its control thread writes [`READY_MARK`] once the devices' host sides (tap, vsock
//! socket) and the control socket are up, after the guest runs.

use std::fs::File;
use std::os::fd::{FromRawFd, RawFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvm_ioctls::VmFd;
use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;

use clone::vcpu::CaptureSpec;
use clone::MicrovmState;

use super::cgroups::{place_self, Placement};
use super::CloneTable;
use crate::api::server::ApiServer;
use crate::builder::{start_vcpus, BuildError};
use crate::config::{ConsoleSink, VmConfig};
use crate::device_manager::{DeviceManager, VirtioRestore};
use crate::logging::raw_eprintln;
use crate::microvm::{block_shutdown_signals, HostReport, Microvm, RunOutcome, VmState};
use crate::vstate::kvm::KvmContext;
use crate::vstate::vcpu::{monotonic_ns, FirstEntry, Vcpu, VcpuError};
use crate::vstate::vm::create_vm;

/// What a clone is told about itself when it is launched.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Identity {
    /// Clone id.
    pub id: String,
    /// Its control socket.
    pub api_sock: PathBuf,
    /// Its console sink.
    pub console: PathBuf,
    /// Its vsock socket (with a vsock device).
    pub vsock: Option<PathBuf>,
    /// Rate limits replacing the template's (checked against its devices).
    #[serde(default)]
    pub rate_limits: crate::config::DeviceRateLimits,
    /// Its own tap and guest addresses (None: its own new tap, the template's addresses).
    #[serde(default)]
    pub net: crate::config::CloneNetSpec,
    /// Whether it keeps its writable disks' overlays (None: as its template's disks).
    #[serde(default)]
    pub keep_overlays: Option<bool>,
    /// The vCPU that read the clone port, and the value it reads in this clone.
    pub guest_result: Option<(u8, u64)>,
    /// The cgroup it moves itself into before running guest code.
    pub cgroup: Option<Placement>,
}

/// How a child starts.
pub(crate) enum Start {
    /// Launch at once with this identity.
    Now(Box<Identity>),
    /// Prepare, then wait for an identity on this pipe (a warm clone).
    Warm {
        /// Read end of the `go` pipe.
        go: RawFd,
        /// The cgroup it moves itself into at once (the first class's).
        cgroup: Option<Placement>,
    },
}

/// Everything a child needs from its parent, gathered before fork.
pub(crate) struct ChildPlan<'a> {
    pub parent_pid: i32,
    /// Write end of the ready pipe.
    pub ready: RawFd,
    pub start: Start,
    pub state: &'a MicrovmState,
    pub mem: &'a GuestMemoryMmap,
    /// The parent's /dev/kvm: the clone creates its VM through it.
    pub kvm: &'a KvmContext,
    pub config: &'a VmConfig,
    pub host: &'a HostReport,
    pub cmdline: &'a str,
    pub spec: &'a Arc<CaptureSpec>,
    pub run_bases: &'a [usize],
    pub run_size: usize,
    /// The parent's open disk images: kept open, so every clone shares them.
    pub disk_fds: &'a [RawFd],
    /// The copies of the parent's disk overlays made for this child, in disk order.
    pub overlays: &'a [Option<devices::virtio::block::overlay::OverlaySnapshot>],
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
    /// The parent's launch message could not be read.
    #[error("bad launch message from the parent: {0}")]
    Go(String),
    /// The clone could not move itself into its cgroup (it does not run unconfined).
    #[error("cannot enter its cgroup: {0}")]
    Cgroup(std::io::Error),
}

/// Closes every descriptor from 3 up except those in `keep`.
fn close_all_but(keep: &[RawFd]) {
    let mut keep: Vec<u32> = keep.iter().map(|&fd| fd as u32).collect();
    keep.sort_unstable();
    let mut from = 3u32;
    for fd in keep {
        if fd > from {
            // SAFETY: closes inherited descriptors; the objects that own them in this
            // process belong to the parent's threads and are never used or dropped here.
            unsafe { libc::close_range(from, fd - 1, 0) };
        }
        from = from.max(fd + 1);
    }
    // SAFETY: as above.
    unsafe { libc::close_range(from, u32::MAX, 0) };
}

/// The child side of fork(). Never returns.
pub(crate) fn child_main(plan: ChildPlan<'_>) -> ! {
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
    let mut keep = plan.disk_fds.to_vec();
    keep.extend(
        plan.overlays
            .iter()
            .flatten()
            .map(|o| std::os::fd::AsRawFd::as_raw_fd(&o.file)),
    );
    keep.push(plan.ready);
    keep.push(std::os::fd::AsRawFd::as_raw_fd(&plan.kvm.kvm));
    match &plan.start {
        Start::Warm { go, .. } => keep.push(*go),
        Start::Now(id) => keep.extend(id.cgroup.iter().flat_map(|p| p.fds.iter().copied())),
    }
    close_all_but(&keep);
    // SAFETY: the ready pipe's write end, kept open above, owned from here on.
    let ready = unsafe { File::from_raw_fd(plan.ready) };
    let mut name = String::from("(warm)");
    // A panic must end the clone here: unwinding further would run the destructors of
    // the parent's objects this process inherited (its control socket's, which removes
    // the parent's socket file, among them).
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        run_clone(&plan, ready, &mut name)
    }));
    let code = match run {
        Ok(Ok(outcome)) => {
            if let RunOutcome::Error(msg) = &outcome {
                raw_eprintln(&format!("vmm: clone {name}: guest stopped: {msg}"));
            }
            outcome.exit_code()
        }
        Ok(Err(e)) => {
            raw_eprintln(&format!("vmm: clone {name}: {e}"));
            1
        }
        Err(_) => {
            raw_eprintln(&format!("vmm: clone {name}: panicked (reported above)"));
            PANIC_EXIT
        }
    };
    // Exit without running the parent's atexit handlers or flushing its stdio buffers.
    // SAFETY: _exit has no preconditions.
    unsafe { libc::_exit(code) }
}

/// A clone's exit status after a panic on its main thread (as a Rust program's).
const PANIC_EXIT: i32 = 101;

/// What a clone's control thread writes to the ready pipe once its devices' host sides
/// and its control socket are up (no CLOCK_MONOTONIC time vCPU 0 writes is this).
pub(super) const READY_MARK: u64 = u64::MAX;

/// A VM rebuilt from captured state, its vCPUs restored but not started.
struct Prepared {
    vm: VmFd,
    vcpus: Vec<Vcpu>,
}

/// Creates the VM on the inherited memory and restores every vCPU from `state`.
fn prepare(
    kvm: &KvmContext,
    state: &MicrovmState,
    mem: &GuestMemoryMmap,
) -> Result<Prepared, ChildError> {
    let vm = create_vm(kvm, mem).map_err(BuildError::from)?;
    let mut vcpus = Vec::with_capacity(state.vcpus.len());
    for s in &state.vcpus {
        let (v, skipped) = Vcpu::from_state(&vm, s)?;
        if !skipped.is_empty() {
            tracing::debug!("clone: host refused MSRs {skipped:#x?}");
        }
        vcpus.push(v);
    }
    Ok(Prepared { vm, vcpus })
}

/// Reads the launch message (one JSON document) from the `go` pipe; None when the
/// parent closed it without launching (the warm clone is discarded).
fn wait_for_go(go: RawFd) -> Result<Option<Identity>, ChildError> {
    use std::io::Read;
    // SAFETY: the go pipe's read end, kept open by close_all_but, owned from here on.
    let mut f = unsafe { File::from_raw_fd(go) };
    let mut buf = Vec::new();
    f.read_to_end(&mut buf)
        .map_err(|e| ChildError::Go(e.to_string()))?;
    if buf.is_empty() {
        return Ok(None);
    }
    serde_json::from_slice(&buf)
        .map(Some)
        .map_err(|e| ChildError::Go(e.to_string()))
}

/// `state` with the guest's clocks moved on to now, as if it had kept running since the
/// capture.
fn advanced(state: &MicrovmState) -> MicrovmState {
    let mut state = state.clone();
    state.advance_clocks(monotonic_ns().saturating_sub(state.captured_at_ns));
    state
}

fn run_clone(
    plan: &ChildPlan<'_>,
    ready: File,
    name: &mut String,
) -> Result<RunOutcome, ChildError> {
    let signals = block_shutdown_signals().map_err(ChildError::Signals)?;
    // SAFETY: the parent's KvmContext in this process is never dropped (see child_main).
    let kvm = unsafe { plan.kvm.inherited() };
    let started = Instant::now();
    let mut marks: Vec<(&str, u128)> = Vec::new();
    let mut mark = |what, at: Instant| marks.push((what, at.elapsed().as_micros()));
    let mut state;
    let prepared;
    let identity;
    match &plan.start {
        Start::Now(id) => {
            // First, while this is the process's only thread (see place_self).
            if let Some(p) = &id.cgroup {
                place_self(p).map_err(ChildError::Cgroup)?;
                mark("placed", started);
            }
            state = advanced(plan.state);
            if let Some((vcpu, value)) = id.guest_result {
                if let Some(v) = state.vcpus.iter_mut().find(|v| v.id == vcpu) {
                    v.regs.rax = value;
                }
            }
            prepared = prepare(&kvm, &state, plan.mem)?;
            identity = Identity::clone(id);
        }
        Start::Warm { go, cgroup } => {
            if let Some(p) = cgroup {
                place_self(p).map_err(ChildError::Cgroup)?;
            }
            prepared = prepare(&kvm, plan.state, plan.mem)?;
            mark("prepared", started);
            let Some(id) = wait_for_go(*go)? else {
                return Ok(RunOutcome::ApiShutdown);
            };
            mark("go", started);
            if let Some(p) = &id.cgroup {
                place_self(p).map_err(ChildError::Cgroup)?;
                mark("placed", started);
            }
            state = advanced(plan.state);
            for (v, s) in prepared.vcpus.iter().zip(&state.vcpus) {
                let rax = id
                    .guest_result
                    .and_then(|(vcpu, value)| (vcpu == s.id).then_some(value));
                v.retime(s, rax)?;
            }
            identity = id;
        }
    }
    *name = identity.id.clone();
    let launched = Instant::now();
    mark("vcpus", started);
    let mut config = plan.config.clone();
    config.api_sock = Some(identity.api_sock.clone());
    config.console = ConsoleSink::File(identity.console.clone());
    if let (Some(v), Some(path)) = (config.vsock.as_mut(), &identity.vsock) {
        v.uds_path = path.clone();
    }
    config
        .apply_rate_limits(&identity.rate_limits)
        .map_err(|e| ChildError::Go(e.to_string()))?;
    // Its own tap and MAC (the tap is created here; it goes when the clone exits).
    let pid = std::process::id() as i32;
    config.disks = crate::config::keep_overlays(&config.disks, identity.keep_overlays);
    config.net = config.net.map(|n| n.for_clone(pid, &identity.net));
    // The guest reads the last part of its id ("2.1" -> 1) from the identity port.
    let seq = identity
        .id
        .rsplit('.')
        .next()
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    let mut devices = DeviceManager::new(&prepared.vm, &config, seq, Some(&state.devices.serial))
        .map_err(BuildError::from)?;
    devices
        .add_virtio_devices(
            &prepared.vm,
            plan.mem,
            &config,
            Some(&VirtioRestore {
                states: &state.devices.virtio,
                disk_fds: plan.disk_fds,
                overlays: plan.overlays,
            }),
        )
        .map_err(BuildError::from)?;
    mark("devices", started);
    clone::vm::restore_vm(&prepared.vm, &state.vm)?;
    mark("vm state", started);
    // The parent answers once every write end of the ready pipe is closed: vCPU 0's
    // (after it wrote its timestamp) and this one (after it wrote READY_MARK); a pipe
    // that ends without the mark is a clone that failed.
    let mut api_ready = ready.try_clone().map_err(ChildError::ReadyPipe)?;
    let (entered, vcpu0_entered) = std::sync::mpsc::sync_channel(1);
    let first_entry = FirstEntry {
        pipe: ready,
        entered,
    };
    let started_vcpus = start_vcpus(prepared.vcpus, &devices, Some(first_entry))?;
    mark("started", started);
    // The rest waits until vCPU 0 is in the guest: this thread's work (sockets, device
    // workers) took the CPU the new vCPU thread needed (0.5 ms later into the guest with
    // every device, on 2 CPUs shared with the parent).
    let _ = vcpu0_entered.recv_timeout(Duration::from_millis(20));
    mark("vcpu 0 entered", started);
    // The devices' host sides (tap, vsock socket) and the control socket come up once
    // the guest runs: they are off the latency path, and there when the parent answers.
    devices.open_host_endpoints().map_err(BuildError::from)?;
    mark("host endpoints", started);
    let api = ApiServer::start(&identity.api_sock)?;
    {
        use std::io::Write;
        api_ready
            .write_all(&READY_MARK.to_le_bytes())
            .map_err(ChildError::ReadyPipe)?;
    }
    drop(api_ready);
    mark("api", started);
    // Then the device workers (threads that install their seccomp filters first): the
    // guest's notifications wait in the queue eventfds and host vsock connections in
    // the listening socket's backlog meanwhile.
    devices.start_restored_virtio().map_err(BuildError::from)?;
    mark("device workers", started);
    tracing::info!(
        "clone {} (pid {}) running {} us after launch",
        identity.id,
        std::process::id(),
        launched.elapsed().as_micros()
    );
    tracing::debug!("clone {} stages (cumulative us): {marks:?}", identity.id);
    let microvm = Microvm {
        config,
        _vm: prepared.vm,
        _mem: plan.mem.clone(),
        kvm,
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
        warm: Default::default(),
        // Pools belong to the template; a clone's clones stay in its cgroup.
        cgroups: None,
        clone_id: identity.id,
        kvm_run_size: plan.run_size,
        pending_events: Default::default(),
    };
    Ok(microvm.run(Some(&api), Some(&signals))?)
}
