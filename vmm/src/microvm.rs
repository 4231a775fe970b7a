//! A running microVM: its KVM objects, guest memory, devices and vCPU threads, and its
//! lifecycle (running, paused, stopped).
//!
//! A [`Microvm`] is made in one place, [`Microvm::new`], from the [`VmParts`] the
//! builder (a booted VM) or a clone's rebuild (`cloning::child`) produces. It knows
//! nothing of clones or of the control API: the cloning stages work on it through its
//! accessors, and the controller (`controller.rs`) drives it from the event loop.

use std::collections::VecDeque;
use std::os::fd::RawFd;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Instant;

use api_types::cgroup::CgroupsReport;
use api_types::invoke::InvokeReport;
use api_types::vm::{HostReport, ProbeReport, TargetState, VmInfo, VmState, WarmReport};
use clone::vcpu::CaptureSpec;
use kvm_ioctls::VmFd;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use crate::config::VmConfig;
use crate::device_manager::DeviceManager;
use crate::vstate::kvm::KvmContext;
use crate::vstate::vcpu::{StartedVcpus, Vcpu, VcpuError, VcpuEvent, VcpuExitReason, VcpuHandle};

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
    /// The VM served its invocation and ended (a clone made for one).
    Invoked,
    /// A fork source its template let go ended, its clones gone (`cloning::sources`).
    Retired,
}

impl RunOutcome {
    /// The process exit status for this outcome.
    pub fn exit_code(&self) -> i32 {
        match self {
            RunOutcome::GuestPowerOff
            | RunOutcome::ApiShutdown
            | RunOutcome::Invoked
            | RunOutcome::Retired => 0,
            RunOutcome::Signal(s) => 128 + s,
            RunOutcome::GuestDone(code) => (*code & 0xff) as i32,
            RunOutcome::Error(_) => 1,
        }
    }

    /// How vCPU `id`'s `event` ends the VM, if it does (clone and invoke requests do
    /// not: the controller hands them on).
    pub fn of_vcpu_event(id: u8, event: &VcpuEvent) -> Option<Self> {
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
            VcpuEvent::Exited(VcpuExitReason::Stopped)
            | VcpuEvent::CloneRequest(_)
            | VcpuEvent::InvokeWait
            | VcpuEvent::InvokeReply(_) => None,
            VcpuEvent::Done(code) => {
                tracing::info!("guest signalled done with status {code}");
                Some(RunOutcome::GuestDone(*code))
            }
        }
    }
}

/// Errors pausing or resuming the VM.
#[derive(Debug, thiserror::Error)]
pub enum StateError {
    /// The lifecycle does not allow it (pausing a paused VM, ...).
    #[error("cannot go from {from} to {to}")]
    Transition {
        /// The state now.
        from: &'static str,
        /// The state asked for.
        to: &'static str,
    },
    /// A vCPU did not park or resume.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
}

fn state_name(s: VmState) -> &'static str {
    match s {
        VmState::Running => "running",
        VmState::Paused => "paused",
        VmState::Stopped => "stopped",
    }
}

/// Everything a VM is made of, as the builder or a clone's rebuild hands it over.
pub struct VmParts {
    /// The configuration it was made from (a clone's: its template's, with its own
    /// sockets, console, tap and limits).
    pub config: VmConfig,
    /// Where its invocation mailbox lies (`builder::mailbox`).
    pub mailbox: devices::mailbox::MailboxWindow,
    /// The VM: owns the irqchip, the PIT and the memory slots.
    pub vm: VmFd,
    /// Guest RAM.
    pub mem: GuestMemoryMmap,
    /// /dev/kvm, kept open for clones (see [`KvmContext::inherited`]).
    pub kvm: KvmContext,
    /// The devices and buses.
    pub devices: DeviceManager,
    /// The running vCPU threads.
    pub vcpus: StartedVcpus,
    /// How the host was handled.
    pub host: HostReport,
    /// The full command line the guest got.
    pub cmdline: String,
    /// What capturing vCPU state needs (found once, at build).
    pub capture_spec: Arc<CaptureSpec>,
    /// Size of a vCPU's kvm_run mapping.
    pub kvm_run_size: usize,
}

/// What a rewound clone keeps of its VM ([`Microvm::into_kept`]): the KVM objects,
/// restored in place for its next request.
pub struct Kept {
    /// The KVM VM, its memory slots, irqchip and PIT.
    pub vm: VmFd,
    /// Its vCPUs, their threads joined.
    pub vcpus: Vec<Vcpu>,
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// /dev/kvm.
    pub kvm: KvmContext,
    /// Its virtio devices' queue eventfds, registered in the VM, per device.
    pub queue_evts: Vec<Vec<EventFd>>,
}

/// A running VM.
pub struct Microvm {
    config: VmConfig,
    mailbox: devices::mailbox::MailboxWindow,
    vm: VmFd,
    mem: GuestMemoryMmap,
    kvm: KvmContext,
    devices: DeviceManager,
    vcpus: Vec<VcpuHandle>,
    vcpu_events: Receiver<(u8, VcpuEvent)>,
    vcpu_exit_evt: EventFd,
    host: HostReport,
    cmdline: String,
    state: VmState,
    started: Instant,
    capture_spec: Arc<CaptureSpec>,
    kvm_run_size: usize,
    /// vCPU events read from the channel but not handled yet.
    pending_events: VecDeque<(u8, VcpuEvent)>,
}

/// What became of host input offered to the serial console.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Input {
    /// Bytes reached the serial port (its state changed).
    Forwarded,
    /// End of input, or an error: stop watching it.
    Closed,
}

impl Microvm {
    /// The VM made of `parts`, running.
    pub fn new(parts: VmParts) -> Self {
        Self {
            config: parts.config,
            mailbox: parts.mailbox,
            vm: parts.vm,
            mem: parts.mem,
            kvm: parts.kvm,
            devices: parts.devices,
            vcpus: parts.vcpus.handles,
            vcpu_events: parts.vcpus.events,
            vcpu_exit_evt: parts.vcpus.exit_evt,
            host: parts.host,
            cmdline: parts.cmdline,
            state: VmState::Running,
            started: Instant::now(),
            capture_spec: parts.capture_spec,
            kvm_run_size: parts.kvm_run_size,
            pending_events: VecDeque::new(),
        }
    }

    /// The lifecycle state.
    pub fn state(&self) -> VmState {
        self.state
    }

    /// The configuration.
    pub fn mailbox(&self) -> devices::mailbox::MailboxWindow {
        self.mailbox
    }

    /// The configuration it was made from.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// This VM (a clone) is a template from now on (a derived one): its configuration
    /// says so, as a template started with `--template` does, so that its snapshot
    /// restores as a template.
    pub fn become_template(&mut self) {
        self.config.invoke.template = true;
    }

    /// The KVM VM.
    pub fn vm_fd(&self) -> &VmFd {
        &self.vm
    }

    /// Guest RAM.
    pub fn memory(&self) -> &GuestMemoryMmap {
        &self.mem
    }

    /// The open /dev/kvm.
    pub fn kvm(&self) -> &KvmContext {
        &self.kvm
    }

    /// The devices.
    pub fn devices(&self) -> &DeviceManager {
        &self.devices
    }

    /// Puts an image into an empty disk slot of the running VM (`PUT /slots/{k}`).
    pub fn insert_medium(
        &mut self,
        medium: &api_types::InsertMedium,
    ) -> Result<(), crate::device_manager::SlotChangeError> {
        (self.devices).insert_medium(medium, self.config.machine.slot_cow_dir.as_deref())
    }

    /// Takes the image out of disk slot `slot` of the running VM (`DELETE /slots/{k}`).
    pub fn eject_medium(&mut self, slot: u8) -> Result<(), crate::device_manager::SlotChangeError> {
        self.devices.eject_medium(slot)
    }

    /// The vCPU threads, by index.
    pub fn vcpus(&self) -> &[VcpuHandle] {
        &self.vcpus
    }

    /// How the host was handled.
    pub fn host(&self) -> &HostReport {
        &self.host
    }

    /// The full command line the guest got.
    pub fn cmdline(&self) -> &str {
        &self.cmdline
    }

    /// What capturing vCPU state needs.
    pub fn capture_spec(&self) -> &Arc<CaptureSpec> {
        &self.capture_spec
    }

    /// Replaces what capturing vCPU state needs (MSRs found unreadable are dropped).
    pub fn set_capture_spec(&mut self, spec: CaptureSpec) {
        self.capture_spec = Arc::new(spec);
    }

    /// Size of a vCPU's kvm_run mapping.
    pub fn kvm_run_size(&self) -> usize {
        self.kvm_run_size
    }

    /// Written whenever a vCPU reports an event.
    pub fn vcpu_exit_evt(&self) -> &EventFd {
        &self.vcpu_exit_evt
    }

    /// Pauses or resumes every vCPU, and parks or lets go every device worker with them
    /// (a paused VM's state, and what clones capture, cannot change until it resumes).
    pub fn set_state(&mut self, target: TargetState) -> Result<(), StateError> {
        let to = VmState::from(target);
        if !self.state.valid_transition(to) {
            return Err(StateError::Transition {
                from: state_name(self.state),
                to: state_name(to),
            });
        }
        for v in &self.vcpus {
            match to {
                VmState::Paused => v.pause()?,
                _ => v.resume()?,
            }
        }
        match to {
            VmState::Paused => {
                if let Err(e) = self.devices.pause_virtio() {
                    tracing::error!("pausing devices failed: {e}");
                }
            }
            _ => self.devices.resume_virtio(),
        }
        tracing::info!("VM {}", state_name(to));
        self.state = to;
        Ok(())
    }

    /// What `GET /vm` shows, with the clone-side parts the caller has.
    pub fn describe(
        &self,
        clone_id: &str,
        warm_clones: WarmReport,
        cgroups: Option<CgroupsReport>,
        invoke: InvokeReport,
    ) -> VmInfo {
        let probe = &self.devices.probe;
        VmInfo {
            state: self.state,
            vcpus: self.config.machine.vcpus,
            memory_mib: self.config.machine.mem_mib,
            kernel: self.config.machine.kernel.display().to_string(),
            cmdline: self.cmdline.clone(),
            ap_boot: self.config.machine.ap_boot,
            uptime_ms: self.started.elapsed().as_millis() as u64,
            clone_id: clone_id.to_string(),
            warm_clones,
            invoke,
            cgroups,
            // The clone side's, filled in by the controller.
            clone_tree: Default::default(),
            host: self.host.clone(),
            devices: self.devices.describe_virtio(),
            probe: ProbeReport {
                writes: probe.writes(),
                last: probe.last(),
                first_write_ns: probe.first_write_ns(),
            },
        }
    }

    /// Moves available host input on `fd` into the serial port.
    pub fn forward_input(&mut self, fd: RawFd) -> Input {
        let mut buf = [0u8; 64];
        // SAFETY: reading at most buf.len() bytes into `buf` from an fd we do not own
        // but that stays open (the process's stdin).
        let n = unsafe { libc::read(fd, buf.as_mut_ptr().cast(), buf.len()) };
        if n <= 0 {
            return Input::Closed;
        }
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
        Input::Forwarded
    }

    /// Moves every event waiting in the vCPU channel to the pending queue.
    pub fn drain_vcpu_events(&mut self) {
        while let Ok(e) = self.vcpu_events.try_recv() {
            self.pending_events.push_back(e);
        }
    }

    /// vCPU events read but not handled yet, oldest first.
    pub fn pending_events(&self) -> &VecDeque<(u8, VcpuEvent)> {
        &self.pending_events
    }

    /// Takes the oldest pending vCPU event.
    pub fn next_event(&mut self) -> Option<(u8, VcpuEvent)> {
        self.pending_events.pop_front()
    }

    /// Takes the stopped VM apart for a rewind (`cloning/rewind.rs`): every vCPU
    /// thread is stopped and joined and its vCPU kept, with the KVM VM, /dev/kvm and
    /// guest memory; the devices leave the VM and are dropped, with everything else.
    /// None if a vCPU thread was gone (it panicked) or a device could not leave.
    pub fn into_kept(self) -> Option<Kept> {
        let Self {
            vm,
            mem,
            kvm,
            vcpus,
            devices,
            ..
        } = self;
        let t0 = Instant::now();
        let vcpus: Option<Vec<Vcpu>> = vcpus.into_iter().map(VcpuHandle::into_vcpu).collect();
        let t1 = Instant::now();
        let queue_evts = match devices.keep_queue_evts() {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!("cannot keep the devices' queue eventfds: {e}");
                return None;
            }
        };
        let t2 = Instant::now();
        drop(devices);
        tracing::debug!(
            "taken apart: vCPUs {} us, queue eventfds kept {} us, devices dropped {} us",
            (t1 - t0).as_micros(),
            (t2 - t1).as_micros(),
            t2.elapsed().as_micros()
        );
        Some(Kept {
            vm,
            vcpus: vcpus?,
            mem,
            kvm,
            queue_evts,
        })
    }

    /// Stops the VM for good: every vCPU thread is stopped and joined, and the disks
    /// that keep their overlays keep them.
    pub fn stop(&mut self) {
        self.state = VmState::Stopped;
        for v in &mut self.vcpus {
            v.stop();
        }
        self.devices.keep_overlays(&self.config.machine.disks);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes() {
        assert_eq!(RunOutcome::GuestPowerOff.exit_code(), 0);
        assert_eq!(RunOutcome::ApiShutdown.exit_code(), 0);
        assert_eq!(RunOutcome::Signal(15).exit_code(), 143);
        assert_eq!(RunOutcome::Error("x".into()).exit_code(), 1);
        assert_eq!(RunOutcome::GuestDone(7).exit_code(), 7);
        assert_eq!(RunOutcome::GuestDone(0x107).exit_code(), 7);
    }

    #[test]
    fn vcpu_events_that_end_the_vm() {
        let ends = |e: VcpuEvent| RunOutcome::of_vcpu_event(0, &e);
        assert_eq!(ends(VcpuEvent::CloneRequest(2)), None);
        assert_eq!(ends(VcpuEvent::Exited(VcpuExitReason::Stopped)), None);
        assert_eq!(ends(VcpuEvent::Done(3)), Some(RunOutcome::GuestDone(3)));
        assert_eq!(
            ends(VcpuEvent::Exited(VcpuExitReason::SystemEvent(1))),
            Some(RunOutcome::GuestPowerOff)
        );
        assert!(matches!(
            ends(VcpuEvent::Exited(VcpuExitReason::TripleFault)),
            Some(RunOutcome::Error(_))
        ));
    }
}
