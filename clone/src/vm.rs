//! Reading the VM-wide state (PIT, kvmclock, PIC master and slave, IOAPIC) and writing it
//! into a new VM.

use kvm_bindings::{
    kvm_irqchip, KVM_IRQCHIP_IOAPIC, KVM_IRQCHIP_PIC_MASTER, KVM_IRQCHIP_PIC_SLAVE,
};
use kvm_ioctls::VmFd;

use crate::state::VmState;

/// Errors reading or writing VM state.
#[derive(Debug, thiserror::Error)]
#[error("{what} failed: {source}")]
pub struct VmStateError {
    /// Which step.
    pub what: &'static str,
    /// Why.
    pub source: kvm_ioctls::Error,
}

fn chip(vm: &VmFd, chip_id: u32, what: &'static str) -> Result<kvm_irqchip, VmStateError> {
    let mut c = kvm_irqchip {
        chip_id,
        ..Default::default()
    };
    vm.get_irqchip(&mut c)
        .map_err(|source| VmStateError { what, source })?;
    Ok(c)
}

/// Reads PIT, kvmclock, PIC master, PIC slave, IOAPIC, in that order. The vCPUs must be
/// paused.
pub fn save_vm(vm: &VmFd) -> Result<VmState, VmStateError> {
    let err = |what| move |source| VmStateError { what, source };
    let pit = vm.get_pit2().map_err(err("KVM_GET_PIT2"))?;
    let clock = vm.get_clock().map_err(err("KVM_GET_CLOCK"))?;
    Ok(VmState {
        pit,
        clock,
        pic_master: chip(vm, KVM_IRQCHIP_PIC_MASTER, "KVM_GET_IRQCHIP (PIC master)")?,
        pic_slave: chip(vm, KVM_IRQCHIP_PIC_SLAVE, "KVM_GET_IRQCHIP (PIC slave)")?,
        ioapic: chip(vm, KVM_IRQCHIP_IOAPIC, "KVM_GET_IRQCHIP (IOAPIC)")?,
    })
}

/// Writes `state` into a VM that has its irqchip and PIT (after its vCPUs are restored).
pub fn restore_vm(vm: &VmFd, state: &VmState) -> Result<(), VmStateError> {
    let err = |what| move |source| VmStateError { what, source };
    vm.set_pit2(&state.pit).map_err(err("KVM_SET_PIT2"))?;
    // Only the clock value carries over; the flags describe how the source read it.
    let mut clock = state.clock;
    clock.flags = 0;
    vm.set_clock(&clock).map_err(err("KVM_SET_CLOCK"))?;
    vm.set_irqchip(&state.pic_master)
        .map_err(err("KVM_SET_IRQCHIP (PIC master)"))?;
    vm.set_irqchip(&state.pic_slave)
        .map_err(err("KVM_SET_IRQCHIP (PIC slave)"))?;
    vm.set_irqchip(&state.ioapic)
        .map_err(err("KVM_SET_IRQCHIP (IOAPIC)"))?;
    Ok(())
}
