//! vCPUs: configuration, and one thread per vCPU running KVM_RUN and dispatching exits.
//!
//! A vCPU thread is stopped ("kicked") race-free: the kicker sets `immediate_exit` in the
//! vCPU's shared `kvm_run` page, then signals the thread. If the thread is inside KVM_RUN
//! the signal ends it with EINTR; if it is about to enter, `immediate_exit` makes KVM
//! return EINTR at once, after completing any port or MMIO exit in flight. Either way the
//! thread then reads its command channel.

use std::sync::atomic::{AtomicI32, AtomicU64, AtomicU8, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_mp_state, CpuId, KVM_MP_STATE_RUNNABLE};
use kvm_ioctls::{VcpuExit, VcpuFd, VmFd};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};
use vmm_sys_util::signal::{register_signal_handler, SIGRTMIN};

use clone::vcpu::{restore_vcpu, save_vcpu, CaptureSpec};
use clone::VcpuState;
use devices::control::{ControlPorts, ControlRequest};
use devices::crng::CrngWatch;
use devices::mailbox::MailboxWindow;
pub use devices::util::monotonic_ns;
use devices::util::thread_cpu_ns;
use devices::Bus;
use devices::Persist;

use crate::arch::x86_64::msr::{boot_msr_entries, set_msrs_skipping};
use crate::arch::x86_64::regs::{boot_fpu, boot_regs, setup_sregs, EntryPoint};
use crate::kept::KeptThread;

mod error;
mod handle;
mod prime;
pub use error::VcpuError;
pub use handle::VcpuHandle;
pub use prime::PrimeError;

/// Why a vCPU stopped running guest code for good.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuExitReason {
    /// The guest asked to shut down or reset (KVM system event).
    SystemEvent(u32),
    /// Triple fault.
    TripleFault,
    /// KVM could not run or emulate the guest.
    Failed(String),
    /// Told to stop by the VMM.
    Stopped,
}

/// What a vCPU thread reports to the VMM's event loop.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VcpuEvent {
    /// The vCPU stopped for good.
    Exited(VcpuExitReason),
    /// The guest asked for `count` clones through the clone port; the vCPU has parked
    /// itself and waits for the VMM (see docs/guest-abi.md).
    CloneRequest(u32),
    /// The guest signalled it is done, with this status.
    Done(u32),
    /// A runtime waits on the invoke port for a request; the vCPU has parked itself
    /// (docs/invoke.md).
    InvokeWait,
    /// A runtime replied through the invoke port with this payload length; the vCPU has
    /// parked itself until the VMM took the reply.
    InvokeReply(u32),
}

/// Commands to a vCPU thread.
enum Command {
    Pause,
    Resume,
    /// Read this vCPU's state (only while paused).
    Capture(Arc<CaptureSpec>),
    /// Set RAX (only while paused): the result of a port read; and defer a due timer
    /// interrupt by the ns given (0: not; `clone::timer`).
    SetRax(u64, u64),
    /// Re-time a deferred timer interrupt due within the second ns given to the first
    /// ns from now (running or paused; no reply): `invoke::stretch`.
    Retime(u64, u64),
    Stop,
}

/// Replies from a vCPU thread.
enum Reply {
    Paused,
    Resumed,
    Captured(Result<(Box<VcpuState>, Vec<u32>), String>),
    RaxSet(Result<(), String>),
}

/// How a vCPU starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StartMode {
    /// Registers set to the kernel entry and runnable (the boot vCPU, or any vCPU the
    /// VMM starts itself).
    Entry(EntryPoint),
    /// Waits in the in-kernel LAPIC for INIT/SIPI from the boot vCPU.
    WaitForSipi,
}

/// Where a clone's vCPU 0 reports that it is about to enter the guest for the first time.
pub struct FirstEntry {
    /// The parent's ready pipe: gets the CLOCK_MONOTONIC time in nanoseconds (8 bytes),
    /// then is closed.
    pub pipe: std::fs::File,
    /// Then told: the clone's main thread waits for it before the rest of its start-up,
    /// so that the vCPU has a CPU first.
    pub entered: std::sync::mpsc::SyncSender<()>,
}

/// A created, configured vCPU that has not started running.
pub struct Vcpu {
    id: u8,
    fd: VcpuFd,
    /// This vCPU's forkvm control ports (clone, done, invoke).
    control: ControlPorts,
    /// The thread it ran on last, idle, for its next run ([`crate::kept`]).
    thread: Option<KeptThread>,
}

fn kick_signal() -> i32 {
    SIGRTMIN()
}

extern "C" fn noop_handler(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {}

static SIGNAL_INIT: Once = Once::new();

fn install_kick_handler() -> Result<(), VcpuError> {
    let mut result = Ok(());
    SIGNAL_INIT.call_once(|| {
        result = register_signal_handler(kick_signal(), noop_handler).map_err(VcpuError::Signal);
    });
    result
}

impl Vcpu {
    fn new(id: u8, fd: VcpuFd, control: ControlPorts) -> Self {
        Self {
            id,
            fd,
            control,
            thread: None,
        }
    }

    /// The thread this vCPU runs on: the one it ran on last, or a new one.
    fn take_thread(&mut self) -> Result<KeptThread, VcpuError> {
        match self.thread.take() {
            Some(t) => Ok(t),
            None => {
                KeptThread::spawn(format!("vcpu{}", self.id)).map_err(|source| VcpuError::Spawn {
                    id: self.id,
                    source,
                })
            }
        }
    }

    /// Creates vCPU `id` and configures CPUID, MSRs, LAPIC LINTs and, for
    /// [`StartMode::Entry`], registers at the kernel entry.
    ///
    /// Returns the vCPU and the MSRs the host refused (skipped).
    pub fn create(
        vm: &VmFd,
        mem: &vm_memory::GuestMemoryMmap,
        id: u8,
        cpuid: &CpuId,
        start: StartMode,
        mailbox: MailboxWindow,
    ) -> Result<(Self, Vec<u32>), VcpuError> {
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(|source| VcpuError::Create { id, source })?;
        let cfg = |what| move |source| VcpuError::Configure { id, what, source };
        fd.set_cpuid2(cpuid).map_err(cfg("cpuid"))?;
        let skipped = set_msrs_skipping(&fd, &boot_msr_entries())
            .map_err(|source| VcpuError::Msrs { id, source })?;
        set_lint(&fd).map_err(cfg("lapic"))?;
        if let StartMode::Entry(entry) = start {
            fd.set_regs(&boot_regs(entry)).map_err(cfg("regs"))?;
            fd.set_fpu(&boot_fpu()).map_err(cfg("fpu"))?;
            let mut sregs = fd.get_sregs().map_err(cfg("sregs"))?;
            setup_sregs(mem, entry.protocol, &mut sregs)
                .map_err(|source| VcpuError::Regs { id, source })?;
            fd.set_sregs(&sregs).map_err(cfg("sregs"))?;
            if id != 0 {
                fd.set_mp_state(kvm_mp_state {
                    mp_state: KVM_MP_STATE_RUNNABLE,
                })
                .map_err(cfg("mp_state"))?;
            }
        }
        Ok((Self::new(id, fd, ControlPorts::new(mailbox)), skipped))
    }

    /// Creates a vCPU from saved state (a clone's), in a VM with `mailbox`. Returns it
    /// and the MSRs the host refused.
    pub fn from_state(
        vm: &VmFd,
        state: &VcpuState,
        mailbox: MailboxWindow,
    ) -> Result<(Self, Vec<u32>), VcpuError> {
        let id = state.id;
        let fd = vm
            .create_vcpu(u64::from(id))
            .map_err(|source| VcpuError::Create { id, source })?;
        let skipped = restore_vcpu(&fd, state)?;
        let Ok(control) = ControlPorts::restore(mailbox, &state.control);
        Ok((Self::new(id, fd, control), skipped))
    }

    /// Restores this vCPU, which has run, to `state` (a rewound clone's vCPU, its
    /// thread joined: `VcpuHandle::into_vcpu`); returns the MSRs the host refused.
    pub fn restore(
        &mut self,
        state: &VcpuState,
        mailbox: MailboxWindow,
    ) -> Result<Vec<u32>, VcpuError> {
        self.fd.set_kvm_immediate_exit(0);
        let skipped = restore_vcpu(&self.fd, state)?;
        let Ok(control) = ControlPorts::restore(mailbox, &state.control);
        self.control = control;
        Ok(skipped)
    }

    /// The page-table base the vCPU runs with now (its CR3; it is stopped).
    pub fn cr3(&self) -> Result<u64, VcpuError> {
        let id = self.id;
        let sregs = (self.fd.get_sregs()).map_err(|source| VcpuError::Configure {
            id,
            what: "sregs",
            source,
        })?;
        Ok(sregs.cr3)
    }

    /// The CPUID this vCPU has in effect (`KVM_GET_CPUID2`): what was set, except on a
    /// host that does not fully honour it (PVM, where the host CPU's own features show).
    pub fn effective_cpuid(&self) -> Result<kvm_bindings::CpuId, kvm_ioctls::Error> {
        self.fd.get_cpuid2(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
    }

    /// This vCPU's state (not running: paused, or not started) and the MSRs the host
    /// would not read.
    pub fn save(&self, spec: &CaptureSpec) -> Result<(VcpuState, Vec<u32>), String> {
        let control = self.control.save();
        save_vcpu(&self.fd, self.id, spec)
            .map(|(state, skipped)| (VcpuState { control, ..state }, skipped))
            .map_err(|e| e.to_string())
    }

    /// Re-times a restored vCPU that has not run yet: writes the TSC, then the TSC
    /// deadline, from `state` (a pre-built clone launched later than it was restored,
    /// with its clocks advanced to the launch), and the registers with `rax` when given.
    pub fn retime(&self, state: &VcpuState, rax: Option<u64>) -> Result<(), VcpuError> {
        let id = self.id;
        let pick = |index| state.msrs.iter().find(|m| m.index == index).copied();
        let entries: Vec<_> = [
            clone::msrs::MSR_IA32_TSC,
            clone::msrs::MSR_IA32_TSC_DEADLINE,
        ]
        .into_iter()
        .filter_map(pick)
        .collect();
        set_msrs_skipping(&self.fd, &entries).map_err(|source| VcpuError::Msrs { id, source })?;
        if let Some(rax) = rax {
            let mut regs = state.regs;
            regs.rax = rax;
            self.fd
                .set_regs(&regs)
                .map_err(|source| VcpuError::Configure {
                    id,
                    what: "regs",
                    source,
                })?;
        }
        Ok(())
    }

    /// Starts the vCPU thread. It reports its final exit on `exits` and signals
    /// `exit_evt`. With `first_entry`, the thread reports there just before it first
    /// enters the guest.
    pub fn start(
        mut self,
        pio: Bus,
        mmio: Bus,
        events: Sender<(u8, VcpuEvent)>,
        event_evt: EventFd,
        first_entry: Option<FirstEntry>,
        crng: CrngWatch,
    ) -> Result<VcpuHandle, VcpuError> {
        install_kick_handler()?;
        let id = self.id;
        let immediate_exit = ImmediateExit::new(&mut self.fd);
        let run_base = std::ptr::from_mut(self.fd.get_kvm_run()) as usize;
        let (cmd_tx, cmd_rx) = channel();
        let (reply_tx, reply_rx) = channel();
        let tid = Arc::new(AtomicI32::new(0));
        let my_tid = tid.clone();
        let cpu_at_start = Arc::new(AtomicU64::new(u64::MAX));
        let my_cpu_at_start = cpu_at_start.clone();
        let thread = self.take_thread()?;
        let (done_tx, done) = channel();
        let job = move || {
            my_cpu_at_start.store(thread_cpu_ns(), Ordering::Release);
            // SAFETY: gettid has no arguments and cannot fail.
            my_tid.store(unsafe { libc::gettid() }, Ordering::Relaxed);
            if let Some(FirstEntry { mut pipe, entered }) = first_entry {
                use std::io::Write;
                let _ = pipe.write_all(&monotonic_ns().to_le_bytes());
                drop(pipe);
                let _ = entered.send(());
            }
            let reason = self.run_loop(
                (&pio, &mmio),
                &cmd_rx,
                &reply_tx,
                (&events, &event_evt),
                &crng,
            );
            let _ = events.send((id, VcpuEvent::Exited(reason)));
            let _ = event_evt.write(1);
            // Everything of the run goes before the vCPU is sent back: the buses hold
            // the devices, whose last owner must not be this thread (a device's drop
            // does what the vCPU filter forbids: the vsock device unlinks its socket).
            drop((pio, mmio, cmd_rx, reply_tx, events, event_evt, crng));
            // Sent back, not dropped: the kvm_run mapping the handle's kicker writes to
            // stays mapped until the handle has it.
            let _ = done_tx.send(self);
        };
        if !thread.run(job) {
            return Err(VcpuError::Gone(id));
        }
        Ok(VcpuHandle {
            id,
            thread: Some((thread, done)),
            cmd_tx,
            reply_rx,
            immediate_exit,
            run_base,
            tid,
            cpu_at_start,
        })
    }

    fn run_loop(
        &mut self,
        (pio, mmio): (&Bus, &Bus),
        cmds: &Receiver<Command>,
        replies: &Sender<Reply>,
        (events, event_evt): (&Sender<(u8, VcpuEvent)>, &EventFd),
        crng: &CrngWatch,
    ) -> VcpuExitReason {
        let id = self.id;
        let mut kick = Kick {
            cmds,
            replies,
            crng,
            deferred: None,
        };
        let report = |e: VcpuEvent| {
            let _ = events.send((id, e));
            let _ = event_evt.write(1);
        };
        // Set when this vCPU parked itself for a guest clone request.
        let mut parked = false;
        // The vCPU filter is installed when KVM_RUN first returns, before this thread
        // handles anything the guest controls: until then it has only run forkvm's own
        // code (under the VMM filter in a clone). Installing costs about 0.1 ms here,
        // which a clone's vCPU would otherwise spend before entering the guest.
        let mut filtered = false;
        loop {
            let result = self.fd.run();
            if !filtered {
                if let Err(e) = crate::sandbox::enter(crate::sandbox::ThreadKind::Vcpu) {
                    return VcpuExitReason::Failed(e.to_string());
                }
                filtered = true;
            }
            match result {
                Ok(exit) => match exit {
                    VcpuExit::IoIn(port, data) if ControlPorts::decodes(port) => {
                        let event = match self.control.read(port, data) {
                            Some(ControlRequest::Clone(count)) => VcpuEvent::CloneRequest(count),
                            Some(ControlRequest::Wait) => VcpuEvent::InvokeWait,
                            _ => continue,
                        };
                        report(event);
                        // Complete the IN, then stop before the next guest instruction
                        // and wait, parked, for the VMM to resume us (with the result
                        // in RAX).
                        self.fd.set_kvm_immediate_exit(1);
                        parked = true;
                    }
                    VcpuExit::IoIn(port, data) => {
                        pio.read(u64::from(port), data);
                    }
                    VcpuExit::IoOut(port, data) if ControlPorts::decodes(port) => {
                        match self.control.write(port, data) {
                            Some(ControlRequest::Done(code)) => report(VcpuEvent::Done(code)),
                            Some(ControlRequest::Reply(len)) => {
                                report(VcpuEvent::InvokeReply(len));
                                // As above: parked until the VMM took the reply.
                                self.fd.set_kvm_immediate_exit(1);
                                parked = true;
                            }
                            _ => {}
                        }
                    }
                    VcpuExit::IoOut(port, data) => {
                        pio.write(u64::from(port), data);
                    }
                    VcpuExit::MmioRead(addr, data) => {
                        mmio.read(addr, data);
                    }
                    VcpuExit::MmioWrite(addr, data) => {
                        mmio.write(addr, data);
                    }
                    VcpuExit::SystemEvent(kind, _) => return VcpuExitReason::SystemEvent(kind),
                    VcpuExit::Shutdown => return VcpuExitReason::TripleFault,
                    VcpuExit::Hlt => {
                        // With the in-kernel LAPIC, HLT is handled by KVM; a HLT exit
                        // means interrupts are off for good.
                        return VcpuExitReason::Failed("guest halted with interrupts off".into());
                    }
                    VcpuExit::FailEntry(reason, cpu) => {
                        return VcpuExitReason::Failed(format!(
                            "KVM entry failed: hardware reason {reason:#x} on host cpu {cpu}"
                        ))
                    }
                    VcpuExit::InternalError => {
                        return VcpuExitReason::Failed(self.internal_error())
                    }
                    VcpuExit::Intr => {
                        if let Some(reason) = self.handle_kick(&mut kick, parked) {
                            return reason;
                        }
                        parked = false;
                    }
                    other => {
                        return VcpuExitReason::Failed(format!("unexpected KVM exit: {other:?}"))
                    }
                },
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    if let Some(reason) = self.handle_kick(&mut kick, parked) {
                        return reason;
                    }
                    parked = false;
                }
                Err(e) => return VcpuExitReason::Failed(format!("KVM_RUN failed: {e}")),
            }
        }
    }

    /// Handles pending commands after a kick. Blocks while paused (from the start when
    /// the vCPU parked itself). Returns a reason when the vCPU must stop.
    ///
    /// A pause that finds the guest kernel inside its CRNG key code is deferred: the
    /// vCPU runs on (the handle kicks again until it is paused), so no clone starts
    /// from a state that would install a key from before the clone point over its
    /// fresh one, or return output drawn from it (`devices::crng`).
    fn handle_kick(&mut self, kick: &mut Kick<'_>, parked: bool) -> Option<VcpuExitReason> {
        let Kick {
            cmds,
            replies,
            crng,
            deferred,
        } = kick;
        self.fd.set_kvm_immediate_exit(0);
        let mut paused = parked;
        if let Some(since) = *deferred {
            if !parked && crng.mid_key() && since.elapsed() < MAX_PAUSE_DEFERRAL {
                return None;
            }
            if since.elapsed() >= MAX_PAUSE_DEFERRAL {
                tracing::warn!(
                    "vCPU {} paused inside the guest kernel's CRNG key code after {} ms",
                    self.id,
                    MAX_PAUSE_DEFERRAL.as_millis()
                );
            }
            *deferred = None;
            paused = true;
            let _ = replies.send(Reply::Paused);
        }
        loop {
            let cmd = if paused {
                cmds.recv().ok()
            } else {
                match cmds.try_recv() {
                    Ok(c) => Some(c),
                    Err(std::sync::mpsc::TryRecvError::Empty) => return None,
                    Err(std::sync::mpsc::TryRecvError::Disconnected) => None,
                }
            };
            match cmd {
                Some(Command::Pause) => {
                    if !paused && crng.mid_key() {
                        *deferred = Some(Instant::now());
                        return None;
                    }
                    paused = true;
                    let _ = replies.send(Reply::Paused);
                }
                Some(Command::Resume) => {
                    let _ = replies.send(Reply::Resumed);
                    if paused {
                        return None;
                    }
                }
                Some(Command::Capture(spec)) => {
                    let r = (self.save(&spec)).map(|(state, skipped)| (Box::new(state), skipped));
                    let _ = replies.send(Reply::Captured(r));
                }
                Some(Command::SetRax(v, defer_ns)) => {
                    let mut r = self
                        .fd
                        .get_regs()
                        .and_then(|mut regs| {
                            regs.rax = v;
                            self.fd.set_regs(&regs)
                        })
                        .map_err(|e| e.to_string());
                    if defer_ns > 0 && r.is_ok() {
                        r = (self.fd.get_tsc_khz().map_err(|e| e.to_string()))
                            .and_then(|khz| {
                                clone::timer::defer_live(&self.fd, khz, defer_ns)
                                    .map_err(|e| e.to_string())
                            })
                            .map(|_| ());
                    }
                    let _ = replies.send(Reply::RaxSet(r));
                }
                Some(Command::Retime(ns, within)) => {
                    // Best effort: a vCPU whose timer cannot be read keeps its deadline.
                    if let Ok(khz) = self.fd.get_tsc_khz() {
                        let _ = clone::timer::retime_live(&self.fd, khz, ns, within);
                    }
                }
                Some(Command::Stop) | None => return Some(VcpuExitReason::Stopped),
            }
        }
    }

    fn internal_error(&mut self) -> String {
        let rip = self.fd.get_regs().map(|r| r.rip).unwrap_or(0);
        let run = self.fd.get_kvm_run();
        // SAFETY: KVM filled the `internal` member of the exit union for this exit reason.
        let internal = unsafe { run.__bindgen_anon_1.internal };
        let what = match internal.suberror {
            1 => "emulation failure",
            2 => "simultaneous exception",
            3 => "delivery event failed",
            _ => "unknown",
        };
        let n = (internal.ndata as usize).min(internal.data.len());
        format!(
            "KVM internal error: suberror {} ({what}) at guest rip {rip:#x}, data {:x?}",
            internal.suberror,
            &internal.data[..n]
        )
    }
}

/// Writes the vCPU's `immediate_exit` flag from another thread.
#[derive(Clone)]
struct ImmediateExit(Arc<AtomicPtr>);

struct AtomicPtr(*mut u8);
// SAFETY: the pointer targets the vCPU's kvm_run mapping, which lives as long as the
// VcpuFd. The vCPU thread returns its Vcpu (with the VcpuFd) as the thread result, so the
// mapping outlives the thread until VcpuHandle joins it; the handle kicks only while it
// has not joined. The byte is only written with atomic stores.
unsafe impl Send for AtomicPtr {}
// SAFETY: see above; shared access only performs atomic byte stores.
unsafe impl Sync for AtomicPtr {}

impl ImmediateExit {
    fn new(fd: &mut VcpuFd) -> Self {
        let run = fd.get_kvm_run();
        Self(Arc::new(AtomicPtr(std::ptr::addr_of_mut!(
            run.immediate_exit
        ))))
    }

    fn set(&self) {
        // SAFETY: the pointer is valid and aligned for a u8 while the vCPU exists (see
        // AtomicPtr); KVM reads this byte on entry to KVM_RUN.
        let flag = unsafe { AtomicU8::from_ptr(self.0 .0) };
        flag.store(1, Ordering::SeqCst);
    }
}

/// How long a pause waits for the guest kernel to leave its CRNG key code.
const MAX_PAUSE_DEFERRAL: Duration = Duration::from_millis(500);

/// What a vCPU thread handles a kick with.
struct Kick<'a> {
    cmds: &'a Receiver<Command>,
    replies: &'a Sender<Reply>,
    crng: &'a CrngWatch,
    /// Since when a pause waits for the guest kernel to leave its CRNG key code.
    deferred: Option<Instant>,
}

/// Running vCPU threads and where they report their exits.
pub struct StartedVcpus {
    /// One handle per vCPU thread, by index.
    pub handles: Vec<VcpuHandle>,
    /// Where the threads report their events.
    pub events: Receiver<(u8, VcpuEvent)>,
    /// Written whenever an event is reported.
    pub exit_evt: EventFd,
}

/// Starts one thread per vCPU (the build's last stage, and a clone's launch).
/// `first_entry` goes to vCPU 0 (see [`Vcpu::start`]).
pub fn start_vcpus(
    vcpus: Vec<Vcpu>,
    pio: &Bus,
    mmio: &Bus,
    mut first_entry: Option<FirstEntry>,
    crng: &CrngWatch,
) -> Result<StartedVcpus, VcpuError> {
    let exit_evt = EventFd::new(EFD_NONBLOCK).map_err(VcpuError::EventFd)?;
    let (event_tx, events) = channel();
    let mut handles = Vec::with_capacity(vcpus.len());
    for vcpu in vcpus {
        let evt = exit_evt.try_clone().map_err(VcpuError::EventFd)?;
        handles.push(vcpu.start(
            pio.clone(),
            mmio.clone(),
            event_tx.clone(),
            evt,
            first_entry.take(),
            crng.clone(),
        )?);
    }
    Ok(StartedVcpus {
        handles,
        events,
        exit_evt,
    })
}

/// LAPIC local interrupt pins: LINT0 as ExtINT (the PIC), LINT1 as NMI.
fn set_lint(fd: &VcpuFd) -> Result<(), kvm_ioctls::Error> {
    const APIC_LVT0: usize = 0x350;
    const APIC_LVT1: usize = 0x360;
    const APIC_MODE_NMI: u32 = 0x4;
    const APIC_MODE_EXTINT: u32 = 0x7;
    let mut lapic = fd.get_lapic()?;
    let mut rw = |off: usize, mode: u32| {
        let bytes: [u8; 4] = std::array::from_fn(|i| lapic.regs[off + i] as u8);
        let v = u32::from_le_bytes(bytes);
        let v = (v & !0x700) | (mode << 8);
        for (i, b) in v.to_le_bytes().iter().enumerate() {
            lapic.regs[off + i] = *b as libc::c_char;
        }
    };
    rw(APIC_LVT0, APIC_MODE_EXTINT);
    rw(APIC_LVT1, APIC_MODE_NMI);
    fd.set_lapic(&lapic)
}
