//! Reading a vCPU's state from its fd, and writing it into a new one.

use kvm_bindings::{Xsave, KVM_MAX_CPUID_ENTRIES};
use kvm_ioctls::VcpuFd;

use crate::msrs::{get_msrs_skipping, order_for_restore, set_msrs_skipping, MsrError};
use crate::state::VcpuState;

/// Errors reading or writing vCPU state.
#[derive(Debug, thiserror::Error)]
pub enum VcpuStateError {
    /// A KVM ioctl failed.
    #[error("vCPU {id}: {what} failed: {source}")]
    Kvm {
        /// vCPU index.
        id: u8,
        /// Which step.
        what: &'static str,
        /// Why.
        source: kvm_ioctls::Error,
    },
    /// MSR access failed outright.
    #[error("vCPU {id}: {source}")]
    Msrs {
        /// vCPU index.
        id: u8,
        /// Why.
        source: MsrError,
    },
}

/// What capture needs to know about the host, found once per VM.
#[derive(Debug, Clone, Default)]
pub struct CaptureSpec {
    /// MSR indices to save (KVM_GET_MSR_INDEX_LIST).
    pub msr_indices: Vec<u32>,
    /// KVM_CAP_XSAVE2 size in bytes (0: use the 4 KiB legacy area; None: no XSAVE).
    pub xsave_size: Option<usize>,
    /// The host supports KVM_GET_XCRS.
    pub xcrs: bool,
}

/// Reads vCPU `id`'s state: mp_state first, vcpu_events last. The vCPU must be out of
/// KVM_RUN with no port or MMIO exit in flight. Returns the state and the MSRs that
/// could not be read.
pub fn save_vcpu(
    fd: &VcpuFd,
    id: u8,
    spec: &CaptureSpec,
) -> Result<(VcpuState, Vec<u32>), VcpuStateError> {
    let kvm = |what| move |source| VcpuStateError::Kvm { id, what, source };
    let mp_state = fd.get_mp_state().map_err(kvm("KVM_GET_MP_STATE"))?;
    let regs = fd.get_regs().map_err(kvm("KVM_GET_REGS"))?;
    let sregs = fd.get_sregs().map_err(kvm("KVM_GET_SREGS"))?;
    let xsave = match spec.xsave_size {
        None => None,
        Some(size) => {
            let extra = size.saturating_sub(4096) / 4;
            let mut x = Xsave::new(extra).map_err(|e| VcpuStateError::Msrs {
                id,
                source: MsrError::Build(format!("xsave buffer: {e:?}")),
            })?;
            // SAFETY: `x` has room for `size` bytes, the size KVM_CAP_XSAVE2 reported,
            // which is what KVM_GET_XSAVE2 writes.
            unsafe { fd.get_xsave2(&mut x) }.map_err(kvm("KVM_GET_XSAVE2"))?;
            Some(x)
        }
    };
    let xcrs = if spec.xcrs {
        Some(fd.get_xcrs().map_err(kvm("KVM_GET_XCRS"))?)
    } else {
        None
    };
    let debug_regs = fd.get_debug_regs().map_err(kvm("KVM_GET_DEBUGREGS"))?;
    let lapic = fd.get_lapic().map_err(kvm("KVM_GET_LAPIC"))?;
    let (msrs, skipped) = get_msrs_skipping(fd, &spec.msr_indices)
        .map_err(|source| VcpuStateError::Msrs { id, source })?;
    let cpuid = fd
        .get_cpuid2(KVM_MAX_CPUID_ENTRIES)
        .map_err(kvm("KVM_GET_CPUID2"))?;
    let tsc_khz = fd.get_tsc_khz().ok();
    let vcpu_events = fd.get_vcpu_events().map_err(kvm("KVM_GET_VCPU_EVENTS"))?;
    Ok((
        VcpuState {
            id,
            cpuid,
            mp_state,
            regs,
            sregs,
            xsave,
            xcrs,
            debug_regs,
            lapic,
            msrs,
            vcpu_events,
            tsc_khz,
            control: Default::default(),
        },
        skipped,
    ))
}

/// Writes `state` into a new vCPU in the order KVM honours: CPUID, TSC frequency,
/// mp_state, regs,
/// sregs, xsave, xcrs, debug registers, LAPIC, MSRs (TSC_DEADLINE after TSC), events.
/// Returns the MSRs the host refused.
pub fn restore_vcpu(fd: &VcpuFd, state: &VcpuState) -> Result<Vec<u32>, VcpuStateError> {
    let id = state.id;
    let kvm = |what| move |source| VcpuStateError::Kvm { id, what, source };
    fd.set_cpuid2(&state.cpuid).map_err(kvm("KVM_SET_CPUID2"))?;
    // The TSC frequency the guest calibrated, where this host's differs (a snapshot
    // taken on another host; TSC scaling must be there, or KVM refuses).
    if let Some(khz) = state.tsc_khz {
        if fd.get_tsc_khz().ok() != Some(khz) {
            fd.set_tsc_khz(khz).map_err(kvm("KVM_SET_TSC_KHZ"))?;
        }
    }
    fd.set_mp_state(state.mp_state)
        .map_err(kvm("KVM_SET_MP_STATE"))?;
    fd.set_regs(&state.regs).map_err(kvm("KVM_SET_REGS"))?;
    fd.set_sregs(&state.sregs).map_err(kvm("KVM_SET_SREGS"))?;
    if let Some(x) = &state.xsave {
        // SAFETY: `x` was filled by KVM_GET_XSAVE2 with the size this host reports, so it
        // is as large as KVM_SET_XSAVE reads.
        unsafe { fd.set_xsave2(x) }.map_err(kvm("KVM_SET_XSAVE"))?;
    }
    if let Some(x) = &state.xcrs {
        fd.set_xcrs(x).map_err(kvm("KVM_SET_XCRS"))?;
    }
    fd.set_debug_regs(&state.debug_regs)
        .map_err(kvm("KVM_SET_DEBUGREGS"))?;
    fd.set_lapic(&state.lapic).map_err(kvm("KVM_SET_LAPIC"))?;
    let mut msrs = state.msrs.clone();
    order_for_restore(&mut msrs);
    let skipped =
        set_msrs_skipping(fd, &msrs).map_err(|source| VcpuStateError::Msrs { id, source })?;
    fd.set_vcpu_events(&state.vcpu_events)
        .map_err(kvm("KVM_SET_VCPU_EVENTS"))?;
    Ok(skipped)
}
