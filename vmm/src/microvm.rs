//! A running microVM and its event loop: guest power-off, vCPU exits, API requests and
//! host signals, with an explicit lifecycle state machine.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::mpsc::Receiver;
use std::time::Instant;

use std::sync::Arc;

use clone::vcpu::CaptureSpec;
use kvm_ioctls::VmFd;
use serde::Serialize;
use serde_json::json;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

use crate::api::server::ApiServer;
use crate::api::{ApiReply, ApiRequest, TargetState};
use crate::cloning::CloneError;
use crate::config::{ConsoleSink, VmConfig};
use crate::device_manager::DeviceManager;
use crate::vstate::kvm::HostKind;
use crate::vstate::memory::MemoryInfo;
use crate::vstate::vcpu::{VcpuEvent, VcpuExitReason, VcpuHandle};

/// Lifecycle states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// vCPUs run guest code.
    Running,
    /// vCPUs are parked outside KVM_RUN; memory and devices keep their state.
    Paused,
    /// Stopping for good.
    Stopped,
}

impl VmState {
    /// Whether the lifecycle allows going from `self` to `to`.
    pub fn valid_transition(self, to: VmState) -> bool {
        matches!(
            (self, to),
            (VmState::Running, VmState::Paused)
                | (VmState::Paused, VmState::Running)
                | (VmState::Running, VmState::Stopped)
                | (VmState::Paused, VmState::Stopped)
        )
    }
}

/// How the host was handled, reported in logs and `GET /vm`.
#[derive(Debug, Clone, Serialize)]
pub struct HostReport {
    /// What provides KVM.
    pub kvm: HostKind,
    /// Whether host quirks were applied.
    pub quirks_applied: bool,
    /// CPUID features hidden from the guest.
    pub hidden_cpuid: Vec<&'static str>,
    /// Kernel switches the VMM added.
    pub kernel_switches: String,
    /// MSRs the host refused at boot.
    pub skipped_msrs: Vec<u32>,
    /// Guest memory backing.
    pub memory: MemoryInfo,
}

/// Why the VMM stopped.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RunOutcome {
    /// The guest powered off or reset (i8042 reset, KVM system event).
    GuestPowerOff,
    /// `PUT /actions {"action_type":"shutdown"}`.
    ApiShutdown,
    /// SIGINT, SIGTERM or SIGHUP.
    Signal(i32),
    /// The guest wrote this status to the done port.
    GuestDone(u32),
    /// The guest or KVM failed.
    Error(String),
}

impl RunOutcome {
    /// The process exit status for this outcome.
    pub fn exit_code(&self) -> i32 {
        match self {
            RunOutcome::GuestPowerOff | RunOutcome::ApiShutdown => 0,
            RunOutcome::Signal(s) => 128 + s,
            RunOutcome::GuestDone(code) => (*code & 0xff) as i32,
            RunOutcome::Error(_) => 1,
        }
    }
}

/// Errors in the event loop itself.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// epoll or signalfd failed.
    #[error("event loop failure: {0}")]
    EventLoop(std::io::Error),
}

/// A running VM.
pub struct Microvm {
    pub(crate) config: VmConfig,
    /// Kept alive for the VM's lifetime: the VM fd owns irqchip, PIT and memory slots.
    pub(crate) _vm: VmFd,
    /// Guest RAM, mapped for as long as the VM exists.
    pub(crate) _mem: GuestMemoryMmap,
    /// /dev/kvm, kept open for the clones (see [`KvmContext::inherited`]).
    pub(crate) kvm: crate::vstate::kvm::KvmContext,
    pub(crate) devices: DeviceManager,
    pub(crate) vcpus: Vec<VcpuHandle>,
    pub(crate) vcpu_events: Receiver<(u8, VcpuEvent)>,
    pub(crate) vcpu_exit_evt: EventFd,
    pub(crate) host: HostReport,
    /// The full command line the guest got.
    pub(crate) cmdline: String,
    pub(crate) state: VmState,
    pub(crate) started: Instant,
    /// What capturing vCPU state needs (found once, at build).
    pub(crate) capture_spec: Arc<CaptureSpec>,
    /// Clones made from this VM.
    pub(crate) clones: crate::cloning::CloneTable,
    /// Clones prepared ahead of requests while paused.
    pub(crate) warm: crate::cloning::warm::WarmPool,
    /// Pooled cgroups for clones (`--cgroup-class`); None in clones.
    pub(crate) cgroups: Option<crate::cloning::cgroups::ClonePools>,
    /// This VM's clone id: "" for an original, "2", "2.1", ... for clones.
    pub(crate) clone_id: String,
    /// Size of a vCPU's kvm_run mapping.
    pub(crate) kvm_run_size: usize,
    /// vCPU events read from the channel but not handled yet.
    pub(crate) pending_events: std::collections::VecDeque<(u8, VcpuEvent)>,
}

/// How long after a clone request the event loop waits before preparing the next clone
/// (forking a warm clone, making spare overlay files): work done at once would compete
/// with the clone just made and with the answer to its request.
pub(crate) const REFILL_DELAY: std::time::Duration = std::time::Duration::from_millis(5);

/// An epoll timeout for `d`, rounded up: rounded down, the loop would wake before the
/// time and spin with timeout 0 until it.
fn wait_ms(d: std::time::Duration) -> i32 {
    i32::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
}

const TOKEN_RESET: u64 = 1;
const TOKEN_VCPU_EXIT: u64 = 2;
const TOKEN_API: u64 = 3;
const TOKEN_SIGNAL: u64 = 4;
const TOKEN_STDIN: u64 = 5;

/// Signals the VMM turns into a clean shutdown.
pub const SHUTDOWN_SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];
/// Signals the event loop reads: the shutdown ones and SIGCHLD (clones exiting).
const LOOP_SIGNALS: [i32; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGCHLD];

/// Blocks the shutdown signals and SIGCHLD in the calling thread (and so in every thread
/// it spawns afterwards) and returns a signalfd that reads them. Call before starting
/// threads.
pub fn block_shutdown_signals() -> std::io::Result<OwnedFd> {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for s in LOOP_SIGNALS {
        // SAFETY: `set` is valid and `s` a valid signal number.
        unsafe { libc::sigaddset(&mut set, s) };
    }
    // SAFETY: `set` is initialised; the old mask is not needed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    // SAFETY: `set` is initialised; -1 asks for a new fd.
    let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: signalfd returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn read_signal(fd: RawFd) -> Option<i32> {
    // SAFETY: signalfd_siginfo is plain data.
    let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::signalfd_siginfo>();
    // SAFETY: reading at most `size` bytes into `info`, which is that large.
    let n = unsafe { libc::read(fd, std::ptr::addr_of_mut!(info).cast(), size) };
    (n == size as isize).then_some(info.ssi_signo as i32)
}

impl Microvm {
    /// The lifecycle state.
    pub fn state(&self) -> VmState {
        self.state
    }

    /// What `GET /vm` returns.
    pub fn describe(&self) -> serde_json::Value {
        json!({
            "state": self.state,
            "vcpus": self.config.vcpus,
            "memory_mib": self.config.mem_mib,
            "kernel": self.config.kernel.display().to_string(),
            "cmdline": self.cmdline,
            "ap_boot": self.config.ap_boot,
            "uptime_ms": self.started.elapsed().as_millis() as u64,
            "clone_id": self.clone_id,
            "warm_clones": self.warm.report(),
            "cgroups": self.cgroups.as_ref().map(|c| c.report()),
            "host": self.host,
            "devices": self.devices.describe_virtio(),
            "probe": {
                "writes": self.devices.probe.writes(),
                "last": self.devices.probe.last(),
                "first_write_ns": self.devices.probe.first_write_ns(),
            },
        })
    }

    /// Pauses or resumes every vCPU.
    pub fn set_state(&mut self, target: TargetState) -> Result<(), ApiReply> {
        let to = match target {
            TargetState::Paused => VmState::Paused,
            TargetState::Running => VmState::Running,
        };
        if !self.state.valid_transition(to) {
            return Err(ApiReply::error(
                409,
                format!("cannot go from {:?} to {:?}", self.state, to).to_lowercase(),
            ));
        }
        for v in &self.vcpus {
            let r = match to {
                VmState::Paused => v.pause(),
                _ => v.resume(),
            };
            r.map_err(|e| ApiReply::error(500, e))?;
        }
        // A paused VM's devices are parked too, so its state (and what clones capture)
        // cannot change until it resumes.
        match to {
            VmState::Paused => {
                if let Err(e) = self.devices.pause_virtio() {
                    tracing::error!("pausing devices failed: {e}");
                }
            }
            _ => self.devices.resume_virtio(),
        }
        tracing::info!("VM {:?}", to);
        self.state = to;
        if to == VmState::Running {
            // The guest runs on: what was captured and forked while paused is stale.
            self.discard_warm_clones();
        }
        Ok(())
    }

    fn answer(&mut self, req: ApiRequest) -> (ApiReply, Option<RunOutcome>) {
        match req {
            ApiRequest::GetVm => (ApiReply::ok(self.describe()), None),
            ApiRequest::SetState(t) => match self.set_state(t) {
                Ok(()) => (ApiReply::no_content(), None),
                Err(reply) => (reply, None),
            },
            ApiRequest::Shutdown => (ApiReply::no_content(), Some(RunOutcome::ApiShutdown)),
            ApiRequest::CreateClones {
                count,
                received_ns,
                console,
                resource_class,
                rate_limits,
                addresses,
                taps,
                keep_overlays,
            } => {
                let made = self.make_clones(
                    count,
                    received_ns,
                    None,
                    &crate::cloning::CloneOptions {
                        console,
                        class: resource_class.as_deref(),
                        rate_limits: &rate_limits,
                        addresses: &addresses,
                        taps: &taps,
                        keep_overlays,
                    },
                );
                match made {
                    Ok(made) => (
                        ApiReply {
                            status: 201,
                            body: Some(json!({ "clones": made }).to_string()),
                        },
                        None,
                    ),
                    Err(e) => {
                        use crate::cloning::cgroups::PlacementError as P;
                        let status = match e {
                            CloneError::Count(_)
                            | CloneError::PathTooLong(_)
                            | CloneError::RateLimit(_)
                            | CloneError::NoCard
                            | CloneError::NoOverlay
                            | CloneError::Cgroup(P::UnknownClass { .. } | P::NoPools(_)) => 400,
                            CloneError::State(_) | CloneError::TooMany { .. } => 409,
                            CloneError::Cgroup(P::Pool(jailer::cgroup::PoolError::Exhausted {
                                ..
                            })) => 503,
                            _ => 500,
                        };
                        (ApiReply::error(status, e), None)
                    }
                }
            }
            ApiRequest::ListClones => (ApiReply::ok(json!({ "clones": self.list_clones() })), None),
            ApiRequest::DeleteClone(id) => match self.stop_clone(&id) {
                Some(info) => (ApiReply::ok(json!(info)), None),
                None => (
                    ApiReply::error(404, format!("no running clone with id {id:?}")),
                    None,
                ),
            },
        }
    }

    /// Moves available host input into the serial port. Returns false at end of input.
    fn forward_input(&mut self, fd: RawFd) -> bool {
        let mut buf = [0u8; 64];
        // SAFETY: reading at most buf.len() bytes into `buf` from an fd we do not own
        // but that stays open (the process's stdin).
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            return false;
        }
        // The serial port's state changes: a paused VM's captured state is stale.
        self.discard_warm_clones();
        let mut serial = self
            .devices
            .serial
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // The UART's receive FIFO is small; bytes that do not fit are dropped, as a real
        // UART drops them on overrun.
        if let Err(e) = serial.enqueue_input(&buf[..n as usize]) {
            tracing::debug!("serial input dropped: {e}");
        }
        true
    }

    /// Moves every event waiting in the vCPU channel to `pending_events`.
    pub(crate) fn drain_vcpu_events(&mut self) {
        while let Ok(e) = self.vcpu_events.try_recv() {
            self.pending_events.push_back(e);
        }
    }

    /// Handles one vCPU event; returns how the VM ends when it does.
    fn vcpu_event(&mut self, id: u8, event: VcpuEvent) -> Option<RunOutcome> {
        match event {
            VcpuEvent::Exited(VcpuExitReason::SystemEvent(kind)) => {
                tracing::info!("vCPU {id}: guest system event {kind}: powering off");
                Some(RunOutcome::GuestPowerOff)
            }
            VcpuEvent::Exited(VcpuExitReason::TripleFault) => {
                Some(RunOutcome::Error(format!("vCPU {id}: guest triple fault")))
            }
            VcpuEvent::Exited(VcpuExitReason::Failed(msg)) => {
                Some(RunOutcome::Error(format!("vCPU {id}: {msg}")))
            }
            VcpuEvent::Exited(VcpuExitReason::Stopped) => None,
            VcpuEvent::Done(code) => {
                tracing::info!("guest signalled done with status {code}");
                Some(RunOutcome::GuestDone(code))
            }
            VcpuEvent::CloneRequest(count) => {
                self.guest_clone_request(id, count);
                None
            }
        }
    }

    /// Runs the event loop until the VM stops, then stops every vCPU thread.
    pub fn run(
        mut self,
        api: Option<&ApiServer>,
        signals: Option<&OwnedFd>,
    ) -> Result<RunOutcome, RunError> {
        let epoll = Epoll::new().map_err(RunError::EventLoop)?;
        let add = |fd: RawFd, token: u64| {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, token),
                )
                .map_err(RunError::EventLoop)
        };
        add(self.devices.reset_evt.as_raw_fd(), TOKEN_RESET)?;
        add(self.vcpu_exit_evt.as_raw_fd(), TOKEN_VCPU_EXIT)?;
        if let Some(api) = api {
            add(api.evt.as_raw_fd(), TOKEN_API)?;
        }
        if let Some(s) = signals {
            add(s.as_raw_fd(), TOKEN_SIGNAL)?;
        }
        // Host input reaches the guest's serial port when the console is the terminal
        // (or pipe) the VMM runs on. Lines arrive as the terminal delivers them; stdin
        // is not switched to raw mode.
        let stdin_fd = std::io::stdin().as_raw_fd();
        if self.config.console == ConsoleSink::Stdout {
            // epoll refuses regular files and /dev/null (EPERM): then there is no input.
            let _ = epoll.ctl(
                ControlOperation::Add,
                stdin_fd,
                EpollEvent::new(EventSet::IN, TOKEN_STDIN),
            );
        }

        let mut events = vec![EpollEvent::default(); 8];
        let outcome = 'run: loop {
            // Warm clones are added a moment after the last clone request: fork()
            // holds this process's memory map, so the answer to that request, still
            // being written by the API thread, would wait for it.
            let due = [
                self.wants_warm_clone()
                    .then(|| REFILL_DELAY.saturating_sub(self.warm.since_last_launch())),
                self.cgroups.as_ref().and_then(|c| c.upkeep_due_in()),
                self.spares_due_in(),
            ];
            let timeout = due.into_iter().flatten().min().map_or(-1, wait_ms);
            let n = match epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(RunError::EventLoop(e)),
            };
            if self.wants_warm_clone() && self.warm.since_last_launch() >= REFILL_DELAY {
                self.add_warm_clone();
            }
            if self.spares_due_in() == Some(std::time::Duration::ZERO) {
                self.make_spares();
            }
            if let Some(c) = self.cgroups.as_mut() {
                c.upkeep();
            }
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_RESET => {
                        let _ = self.devices.reset_evt.eventfd().read();
                        tracing::info!("guest reset through the i8042: powering off");
                        break 'run RunOutcome::GuestPowerOff;
                    }
                    TOKEN_VCPU_EXIT => {
                        let _ = self.vcpu_exit_evt.read();
                        self.drain_vcpu_events();
                        while let Some((id, event)) = self.pending_events.pop_front() {
                            if let Some(outcome) = self.vcpu_event(id, event) {
                                break 'run outcome;
                            }
                        }
                    }
                    TOKEN_API => {
                        let Some(api) = api else { continue };
                        let _ = api.evt.read();
                        while let Ok((req, reply_tx)) = api.requests.try_recv() {
                            let (reply, outcome) = self.answer(req);
                            reply_tx.send(reply);
                            if let Some(o) = outcome {
                                break 'run o;
                            }
                        }
                    }
                    TOKEN_STDIN => {
                        let open = self.forward_input(stdin_fd);
                        if !open {
                            // End of input or an error: stop watching stdin.
                            let _ = epoll.ctl(
                                ControlOperation::Delete,
                                stdin_fd,
                                EpollEvent::default(),
                            );
                        }
                    }
                    TOKEN_SIGNAL => {
                        while let Some(sig) = signals.and_then(|s| read_signal(s.as_raw_fd())) {
                            if sig == libc::SIGCHLD {
                                self.reap_children();
                                continue;
                            }
                            tracing::info!("signal {sig}: shutting down");
                            break 'run RunOutcome::Signal(sig);
                        }
                    }
                    _ => {}
                }
            }
        };
        self.state = VmState::Stopped;
        self.discard_warm_clones();
        for v in &mut self.vcpus {
            v.stop();
        }
        self.devices.keep_overlays(&self.config.disks);
        // Clones would die with this process anyway (PR_SET_PDEATHSIG); stopping them
        // first lets each remove its socket.
        self.stop_all_clones();
        // Removes this VMM's cgroups.
        drop(self.cgroups.take());
        Ok(outcome)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_transitions() {
        use VmState::*;
        assert!(Running.valid_transition(Paused));
        assert!(Paused.valid_transition(Running));
        assert!(!Running.valid_transition(Running));
        assert!(!Paused.valid_transition(Paused));
        assert!(!Stopped.valid_transition(Running));
        assert!(Paused.valid_transition(Stopped));
    }

    #[test]
    fn exit_codes() {
        assert_eq!(RunOutcome::GuestPowerOff.exit_code(), 0);
        assert_eq!(RunOutcome::ApiShutdown.exit_code(), 0);
        assert_eq!(RunOutcome::Signal(15).exit_code(), 143);
        assert_eq!(RunOutcome::Error("x".into()).exit_code(), 1);
        assert_eq!(RunOutcome::GuestDone(7).exit_code(), 7);
        assert_eq!(RunOutcome::GuestDone(0x107).exit_code(), 7);
    }
}
