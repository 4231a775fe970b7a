//! What can go wrong configuring or running a vCPU.

use crate::arch::x86_64::msr::MsrError;
use crate::arch::x86_64::regs::RegsError;

/// Errors configuring or running a vCPU.
#[derive(Debug, thiserror::Error)]
pub enum VcpuError {
    /// KVM_CREATE_VCPU failed.
    #[error("cannot create vCPU {id}: {source}")]
    Create {
        /// vCPU index.
        id: u8,
        /// Why.
        source: kvm_ioctls::Error,
    },
    /// A register or CPUID ioctl failed.
    #[error("cannot configure vCPU {id} ({what}): {source}")]
    Configure {
        /// vCPU index.
        id: u8,
        /// Which step.
        what: &'static str,
        /// Why.
        source: kvm_ioctls::Error,
    },
    /// Writing boot MSRs failed.
    #[error("cannot set vCPU {id} MSRs: {source}")]
    Msrs {
        /// vCPU index.
        id: u8,
        /// Why.
        source: MsrError,
    },
    /// Writing boot tables failed.
    #[error("cannot set vCPU {id} registers: {source}")]
    Regs {
        /// vCPU index.
        id: u8,
        /// Why.
        source: RegsError,
    },
    /// The vCPU thread could not be started.
    #[error("cannot start vCPU {id} thread: {source}")]
    Spawn {
        /// vCPU index.
        id: u8,
        /// Why.
        source: std::io::Error,
    },
    /// The kick signal handler could not be installed.
    #[error("cannot install the vCPU kick signal handler: {0}")]
    Signal(vmm_sys_util::errno::Error),
    /// Saved state could not be written into a new vCPU.
    #[error(transparent)]
    Restore(#[from] clone::vcpu::VcpuStateError),
    /// The vCPU could not read its state.
    #[error("vCPU {id}: capture failed: {msg}")]
    Capture {
        /// vCPU index.
        id: u8,
        /// Why.
        msg: String,
    },
    /// The vCPU thread did not answer a command in time.
    #[error("vCPU {id} did not answer a {what} request within {ms} ms")]
    Timeout {
        /// vCPU index.
        id: u8,
        /// The command.
        what: &'static str,
        /// Time waited.
        ms: u64,
    },
    /// The vCPU thread is gone.
    #[error("vCPU {0} thread has exited")]
    Gone(u8),
    /// The eventfd vCPU threads report on could not be made.
    #[error("cannot create an eventfd for vCPU events: {0}")]
    EventFd(std::io::Error),
}
