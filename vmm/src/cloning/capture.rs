//! Stage 3, capture: every device worker parks (all at once), then each vCPU reads its
//! own state on its own thread (all at once), then the VM-wide state (PIT, clock,
//! irqchips) is read. The device workers stay parked until the VM resumes.
//!
//! Devices park first so that nothing changes the guest between the reads: a worker
//! that finished a request after its vCPU's state was read would raise an interrupt
//! into a LAPIC already read (the clone would get it only through the interrupt status
//! its transport re-raises at restore). Parking them first costs nothing: the two
//! steps ran one after the other before too.
//!
//! Next: the fork (`fork.rs`).

use clone::MicrovmState;

use super::CloneError;
use crate::microvm::Microvm;

/// Parks the devices and reads their state, then every vCPU's, then the VM's. Every
/// vCPU must be parked; the virtio workers are parked here and stay so until the VM
/// resumes.
pub(super) fn capture(vm: &mut Microvm) -> Result<MicrovmState, CloneError> {
    vm.devices().pause_virtio()?;
    let devices = vm.devices().save();
    let spec = vm.capture_spec().clone();
    for v in vm.vcpus() {
        v.request_capture(spec.clone())?;
    }
    let mut vcpus = Vec::with_capacity(vm.vcpus().len());
    let mut unreadable = Vec::new();
    for v in vm.vcpus() {
        let (state, skipped) = v.collect_capture()?;
        unreadable.extend(skipped);
        vcpus.push(state);
    }
    // MSRs KVM lists but this vCPU model cannot read are dropped from the list once,
    // so later captures need a single KVM_GET_MSRS per vCPU.
    if !unreadable.is_empty() {
        let mut spec = (*spec).clone();
        spec.msr_indices.retain(|i| !unreadable.contains(i));
        tracing::debug!("MSRs listed by KVM but not readable, no longer saved: {unreadable:#x?}");
        vm.set_capture_spec(spec);
    }
    let vm_state = clone::vm::save_vm(vm.vm_fd())?;
    Ok(MicrovmState {
        captured_at_ns: crate::vstate::vcpu::monotonic_ns(),
        vm: vm_state,
        vcpus,
        devices,
    })
}
