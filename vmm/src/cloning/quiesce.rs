//! Stage 2, quiesce: every vCPU is kicked out of KVM_RUN and parks (completing any port
//! or MMIO exit in flight, see `vstate::vcpu`); every device worker parks between two
//! requests, holding no lock (done as the state is captured, `capture.rs`). A guest
//! whose vCPU read the clone port is parked already, and is released with its result.
//!
//! Next: the state is captured (`capture.rs`). After the fork the VM is resumed here.

use crate::microvm::Microvm;
use crate::vstate::vcpu::{VcpuError, VcpuEvent};

/// Parks every vCPU; on failure the ones already parked run again.
pub(super) fn pause_all(vm: &Microvm) -> Result<(), VcpuError> {
    let vcpus = vm.vcpus();
    for (i, v) in vcpus.iter().enumerate() {
        if let Err(e) = v.pause() {
            for p in &vcpus[..i] {
                let _ = p.resume();
            }
            return Err(e);
        }
    }
    Ok(())
}

/// The vCPUs other than `requester` that read the clone port and wait, parked, for
/// their turn: they stay parked through this clone (their copies in the clones read
/// [`super::CLONE_FAILED`]; the guest may retry).
pub(super) fn waiting_requesters(vm: &mut Microvm, requester: Option<u8>) -> Vec<u8> {
    vm.drain_vcpu_events();
    vm.pending_events()
        .iter()
        .filter_map(|(id, e)| matches!(e, VcpuEvent::CloneRequest(_)).then_some(*id))
        .filter(|id| Some(*id) != requester)
        .collect()
}

/// Resumes the devices and every vCPU but those in `keep_parked`.
pub(super) fn resume_all(vm: &Microvm, keep_parked: &[u8]) -> Result<(), VcpuError> {
    vm.devices().resume_virtio();
    resume_vcpus(vm, keep_parked)
}

/// Resumes the vCPUs, except those in `keep_parked`; the device workers stay parked
/// (a running VM's resume once its first clone is up).
pub(super) fn resume_vcpus(vm: &Microvm, keep_parked: &[u8]) -> Result<(), VcpuError> {
    vm.vcpus()
        .iter()
        .filter(|v| !keep_parked.contains(&v.id()))
        .try_for_each(|v| v.resume())
}

/// Sets the clone-port result of the parked guest `requester` without letting it run.
pub(super) fn answer_requester(vm: &Microvm, requester: Option<u8>, value: u64) {
    let Some(v) = requester.and_then(|id| vm.vcpus().get(usize::from(id))) else {
        return;
    };
    if let Err(e) = v.set_rax(value) {
        tracing::error!("cannot return the clone result to vCPU {}: {e}", v.id());
    }
}

/// Answers a guest requester that is still parked and, unless the whole VM is paused,
/// lets it run.
pub(super) fn release_requester(vm: &Microvm, requester: Option<u8>, value: u64) {
    answer_requester(vm, requester, value);
    let Some(v) = requester.and_then(|id| vm.vcpus().get(usize::from(id))) else {
        return;
    };
    if vm.state() == api_types::VmState::Running {
        if let Err(e) = v.resume() {
            tracing::error!("cannot resume vCPU {}: {e}", v.id());
        }
    }
}
