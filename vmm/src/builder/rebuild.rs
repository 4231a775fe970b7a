//! A VM rebuilt from captured state, on memory it did not map itself: a clone's
//! inherited guest RAM, or a snapshot's memory file. The clone child (`cloning/child.rs`)
//! and `vmm restore` (`snapshot/restore.rs`) both call it; neither knows the other.
//!
//! 1. [`prepare`]: the VM on that memory (memory slots first, then TSS, irqchip, PIT) and
//!    every vCPU restored from the state, not started;
//! 2. [`start_rebuilt`]: the devices from their saved states, the guest kernel's RNG
//!    reseeded, the VM-wide state, the vCPU threads, and once vCPU 0 is in the guest the
//!    devices' host sides.

use std::fs::File;
use std::os::fd::RawFd;
use std::time::Duration;

use clone::MicrovmState;
use devices::virtio::block::overlay::OverlaySnapshot;
use kvm_ioctls::VmFd;
use vm_memory::GuestMemoryMmap;

use crate::config::VmConfig;
use crate::device_manager::{DeviceError, DeviceManager, Inserted, VirtioRestore};
use crate::logging::StageTimer;
use crate::vstate::kvm::KvmContext;
use crate::vstate::vcpu::{start_vcpus, FirstEntry, StartedVcpus, Vcpu, VcpuError};
use crate::vstate::vm::{create_vm, VmError};

/// Errors rebuilding a VM from captured state.
#[derive(Debug, thiserror::Error)]
pub enum RebuildError {
    /// Creating the VM failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// Creating or restoring the devices failed.
    #[error(transparent)]
    Devices(#[from] DeviceError),
    /// Restoring or starting a vCPU failed.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// Restoring VM-wide state failed.
    #[error(transparent)]
    VmState(#[from] clone::vm::VmStateError),
    /// The guest kernel's RNG could not be reseeded (the VM does not run).
    #[error("cannot reseed the guest kernel's RNG: {0}")]
    Crng(#[from] devices::crng::CrngError),
}

/// A VM rebuilt from captured state, its vCPUs restored but not started.
pub struct Prepared {
    /// The VM, its memory slots, TSS, irqchip and PIT set up.
    pub vm: VmFd,
    /// Its vCPUs, restored.
    pub vcpus: Vec<Vcpu>,
    /// MSRs the host refused to restore (vCPU 0's).
    pub skipped_msrs: Vec<u32>,
    /// Queue eventfds its virtio devices registered in it before (a rewound clone's VM:
    /// `DeviceManager::reuse_queue_evts`); empty for a new VM.
    pub queue_evts: Vec<Vec<vmm_sys_util::eventfd::EventFd>>,
}

/// Creates the VM on `mem` (a clone's inherited memory, or a snapshot's) and restores
/// every vCPU from `state`.
pub fn prepare(
    kvm: &KvmContext,
    state: &MicrovmState,
    mem: &GuestMemoryMmap,
    mailbox: devices::mailbox::MailboxWindow,
) -> Result<Prepared, RebuildError> {
    let vm = create_vm(kvm, mem)?;
    let mut vcpus = Vec::with_capacity(state.vcpus.len());
    let mut skipped_msrs = Vec::new();
    for s in &state.vcpus {
        let (v, skipped) = Vcpu::from_state(&vm, s, mailbox)?;
        if !skipped.is_empty() {
            tracing::debug!("restore: host refused MSRs {skipped:#x?}");
            if vcpus.is_empty() {
                skipped_msrs = skipped;
            }
        }
        vcpus.push(v);
    }
    Ok(Prepared {
        vm,
        vcpus,
        skipped_msrs,
        queue_evts: Vec::new(),
    })
}

/// [`prepare`], or with `reuse`, a rewound clone's VM (`cloning/rewind.rs`): its
/// vCPUs restored from `state` in place.
pub fn prepare_or_reuse(
    kvm: &KvmContext,
    state: &MicrovmState,
    mem: &GuestMemoryMmap,
    mailbox: devices::mailbox::MailboxWindow,
    reuse: Option<Prepared>,
) -> Result<Prepared, RebuildError> {
    let Some(mut prepared) = reuse else {
        return prepare(kvm, state, mem, mailbox);
    };
    for (i, (v, s)) in prepared.vcpus.iter_mut().zip(&state.vcpus).enumerate() {
        let skipped = v.restore(s, mailbox)?;
        if i == 0 {
            prepared.skipped_msrs = skipped;
        }
    }
    Ok(prepared)
}

/// What a rebuilt VM's devices and vCPUs start from.
pub struct StartFrom<'a> {
    /// Its guest memory.
    pub mem: &'a GuestMemoryMmap,
    /// Its configuration.
    pub config: &'a VmConfig,
    /// Its sequence number in its clone tree, what the guest reads from the identity
    /// port (0 for a VM restored from a snapshot).
    pub seq: u32,
    /// The captured state.
    pub state: &'a MicrovmState,
    /// Its disk images, open, in device order.
    pub disk_fds: &'a [RawFd],
    /// Its writable disks' overlays, in disk order (None for a read-only disk).
    pub overlays: &'a [Option<OverlaySnapshot>],
    /// Its parent's disk slots' media, open, in slot order (None: empty).
    pub slots: &'a [Option<(RawFd, std::path::PathBuf)>],
    /// The images inserted into its disk slots: the guest is told once it runs.
    pub media: &'a [Inserted],
}

/// What a clone and a VM restored from a snapshot do once their VM and vCPUs exist
/// ([`prepare`]): devices from their saved states, the guest kernel's RNG reseeded
/// before any of its code runs (every vCPU is stopped: none is mid-key, the pause that
/// captured the state saw to it), the VM-wide state, the vCPU threads (vCPU 0 writes the
/// time it first enters the guest to `ready`). Returns once vCPU 0 is in the guest (or
/// 20 ms have passed) and the devices' host sides are open.
pub fn start_rebuilt(
    prepared: &mut Prepared,
    from: &StartFrom<'_>,
    ready: File,
    marks: &mut StageTimer,
) -> Result<(DeviceManager, StartedVcpus), RebuildError> {
    let StartFrom {
        mem,
        config,
        seq,
        state,
        ..
    } = *from;
    let restore = VirtioRestore {
        states: &state.devices,
        disk_fds: from.disk_fds,
        overlays: from.overlays,
        slots: from.slots,
        media: from.media,
    };
    let vm = &prepared.vm;
    let mut devices = DeviceManager::new(vm, config, mem, seq, Some(&state.devices))?;
    devices.reuse_queue_evts(std::mem::take(&mut prepared.queue_evts));
    devices.add_virtio_devices(vm, mem, config, Some(&restore))?;
    marks.done("devices");
    if let Some(layout) = devices.crng.registration.layout() {
        layout.reseed(mem)?;
        marks.done("crng reseed");
    }
    clone::vm::restore_vm(vm, &state.vm)?;
    marks.done("vm state");
    let (entered, vcpu0_entered) = std::sync::mpsc::sync_channel(1);
    let first_entry = FirstEntry {
        pipe: ready,
        entered,
    };
    let vcpus = start_vcpus(
        std::mem::take(&mut prepared.vcpus),
        &devices.pio,
        &devices.mmio,
        Some(first_entry),
        &devices.crng,
    )?;
    marks.done("started");
    // The rest waits until vCPU 0 is in the guest: this thread's work (sockets, device
    // workers) took the CPU the new vCPU thread needed (0.5 ms later into the guest with
    // every device, on 2 CPUs shared with the parent).
    let _ = vcpu0_entered.recv_timeout(Duration::from_millis(20));
    marks.done("vcpu 0 entered");
    // The devices' host sides (tap, vsock socket) come up once the guest runs: they are
    // off the latency path, and there when the parent answers.
    devices.open_host_endpoints()?;
    marks.done("host endpoints");
    devices.announce_inserted_media()?;
    Ok((devices, vcpus))
}
