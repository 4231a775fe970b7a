//! The KVM VM: memory slots, in-kernel irqchip and PIT, TSS.

use kvm_bindings::{kvm_pit_config, kvm_userspace_memory_region, KVM_PIT_SPEAKER_DUMMY};
use kvm_ioctls::VmFd;
use vm_memory::{GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use super::kvm::KvmContext;
use crate::arch::x86_64::layout::KVM_TSS_ADDRESS;

/// Errors creating and configuring the VM.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// KVM_CREATE_VM failed.
    #[error("cannot create the VM: {0}")]
    Create(kvm_ioctls::Error),
    /// KVM_SET_TSS_ADDR failed.
    #[error("cannot set the TSS address: {0}")]
    Tss(kvm_ioctls::Error),
    /// KVM_CREATE_IRQCHIP failed.
    #[error("cannot create the in-kernel irqchip: {0}")]
    Irqchip(kvm_ioctls::Error),
    /// KVM_CREATE_PIT2 failed.
    #[error("cannot create the in-kernel PIT: {0}")]
    Pit(kvm_ioctls::Error),
    /// KVM_SET_USER_MEMORY_REGION failed.
    #[error("cannot register guest memory slot {slot}: {source}")]
    MemorySlot {
        /// The slot.
        slot: u32,
        /// Why.
        source: kvm_ioctls::Error,
    },
}

/// Creates a VM: memory slots, then TSS, irqchip (PIC + IOAPIC + LAPICs) and PIT.
///
/// The order matters for speed: registering the first memory slot after the in-kernel
/// irqchip exists costs about 7 ms on a PVM host, against about 0.1 ms before it (measured,
/// docs/guest-kernel.md). KVM only requires the irqchip before the vCPUs.
pub fn create_vm(ctx: &KvmContext, mem: &GuestMemoryMmap) -> Result<VmFd, VmError> {
    let vm = ctx.kvm.create_vm().map_err(VmError::Create)?;
    register_memory(&vm, mem)?;
    vm.set_tss_address(KVM_TSS_ADDRESS as usize)
        .map_err(VmError::Tss)?;
    vm.create_irq_chip().map_err(VmError::Irqchip)?;
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).map_err(VmError::Pit)?;
    Ok(vm)
}

/// Registers every region of `mem` as a KVM memory slot at its host address.
pub fn register_memory(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<(), VmError> {
    for (slot, region) in mem.iter().enumerate() {
        let slot = slot as u32;
        let host = region
            .get_host_address(vm_memory::MemoryRegionAddress(0))
            .expect("a region's first byte has a host address") as u64;
        let r = kvm_userspace_memory_region {
            slot,
            guest_phys_addr: region.start_addr().0,
            memory_size: region.len(),
            userspace_addr: host,
            flags: 0,
        };
        // SAFETY: the region is a live mapping owned by `mem`, which the VM keeps alive
        // for as long as the slot exists.
        unsafe { vm.set_user_memory_region(r) }
            .map_err(|source| VmError::MemorySlot { slot, source })?;
    }
    Ok(())
}

/// Removes every memory slot of `mem` and registers it again: KVM drops every mapping
/// it built for the guest (shadow pages included), as a rewound clone on a host with
/// shadow paging needs (`cloning/rewind.rs`: its guest page tables were rewritten from
/// the host, which shadow paging does not notice). About 70 us here for 256 MiB; the
/// first removal in a VM about 5.7 ms.
pub fn reregister_memory(vm: &VmFd, mem: &GuestMemoryMmap) -> Result<(), VmError> {
    for (slot, region) in mem.iter().enumerate() {
        let slot = slot as u32;
        let r = kvm_userspace_memory_region {
            slot,
            guest_phys_addr: region.start_addr().0,
            memory_size: 0,
            userspace_addr: 0,
            flags: 0,
        };
        // SAFETY: a slot of size 0 removes the slot; no memory is mapped.
        unsafe { vm.set_user_memory_region(r) }
            .map_err(|source| VmError::MemorySlot { slot, source })?;
    }
    register_memory(vm, mem)
}
