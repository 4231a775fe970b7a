//! Model-specific registers: the boot set, and writing a set while skipping, per MSR,
//! what the host refuses (PVM refuses IA32_ARCH_CAPABILITIES, for one).

use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::VcpuFd;

/// IA32_SYSENTER_CS
pub const MSR_IA32_SYSENTER_CS: u32 = 0x174;
/// IA32_SYSENTER_ESP
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
/// IA32_SYSENTER_EIP
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
/// STAR
pub const MSR_STAR: u32 = 0xc000_0081;
/// LSTAR
pub const MSR_LSTAR: u32 = 0xc000_0082;
/// CSTAR
pub const MSR_CSTAR: u32 = 0xc000_0083;
/// SYSCALL_MASK
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
/// KERNEL_GS_BASE
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
/// IA32_TSC
pub const MSR_IA32_TSC: u32 = 0x10;
/// IA32_MISC_ENABLE
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// IA32_MTRR_DEF_TYPE
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;
/// IA32_TSC_DEADLINE: must be restored after IA32_TSC.
pub const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default memory type write-back.
const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

/// Errors writing MSRs.
#[derive(Debug, thiserror::Error)]
pub enum MsrError {
    /// The MSR list could not be built.
    #[error("too many MSRs for one KVM call: {0}")]
    Build(String),
    /// KVM_SET_MSRS failed outright.
    #[error("KVM_SET_MSRS failed: {0}")]
    Set(kvm_ioctls::Error),
}

fn entry(index: u32, data: u64) -> kvm_msr_entry {
    kvm_msr_entry {
        index,
        data,
        ..Default::default()
    }
}

/// The MSRs a vCPU starts with.
pub fn boot_msr_entries() -> Vec<kvm_msr_entry> {
    vec![
        entry(MSR_IA32_SYSENTER_CS, 0),
        entry(MSR_IA32_SYSENTER_ESP, 0),
        entry(MSR_IA32_SYSENTER_EIP, 0),
        entry(MSR_STAR, 0),
        entry(MSR_CSTAR, 0),
        entry(MSR_KERNEL_GS_BASE, 0),
        entry(MSR_SYSCALL_MASK, 0),
        entry(MSR_LSTAR, 0),
        entry(MSR_IA32_TSC, 0),
        entry(MSR_IA32_MISC_ENABLE, MISC_ENABLE_FAST_STRING),
        entry(MSR_MTRR_DEF_TYPE, MTRR_ENABLE_WB),
    ]
}

/// Something that takes a batch of MSRs and reports how many it wrote, in order,
/// like KVM_SET_MSRS.
pub trait MsrSink {
    /// Writes `msrs`, returning how many leading entries were written.
    fn set_msrs(&self, msrs: &Msrs) -> Result<usize, kvm_ioctls::Error>;
}

impl MsrSink for VcpuFd {
    fn set_msrs(&self, msrs: &Msrs) -> Result<usize, kvm_ioctls::Error> {
        VcpuFd::set_msrs(self, msrs)
    }
}

/// Writes `entries` in order. KVM stops at the first MSR it refuses; that one is
/// skipped and the rest written. Returns the indices skipped, so the caller can say so.
pub fn set_msrs_skipping<S: MsrSink>(
    sink: &S,
    entries: &[kvm_msr_entry],
) -> Result<Vec<u32>, MsrError> {
    let mut skipped = Vec::new();
    let mut rest = entries;
    while !rest.is_empty() {
        let msrs = Msrs::from_entries(rest).map_err(|e| MsrError::Build(format!("{e:?}")))?;
        let written = sink.set_msrs(&msrs).map_err(MsrError::Set)?;
        if written >= rest.len() {
            break;
        }
        skipped.push(rest[written].index);
        rest = &rest[written + 1..];
    }
    Ok(skipped)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Accepts every MSR except the refused ones, like KVM: stops at the first refusal.
    struct FakeVcpu {
        refuse: Vec<u32>,
        written: RefCell<Vec<u32>>,
    }
    impl MsrSink for FakeVcpu {
        fn set_msrs(&self, msrs: &Msrs) -> Result<usize, kvm_ioctls::Error> {
            let mut n = 0;
            for e in msrs.as_slice() {
                if self.refuse.contains(&e.index) {
                    break;
                }
                self.written.borrow_mut().push(e.index);
                n += 1;
            }
            Ok(n)
        }
    }

    #[test]
    fn skips_refused_msrs_and_writes_the_rest_in_order() {
        let fake = FakeVcpu {
            refuse: vec![MSR_STAR, MSR_IA32_TSC],
            written: RefCell::new(vec![]),
        };
        let entries = boot_msr_entries();
        let skipped = set_msrs_skipping(&fake, &entries).unwrap();
        assert_eq!(skipped, vec![MSR_STAR, MSR_IA32_TSC]);
        let expect: Vec<u32> = entries
            .iter()
            .map(|e| e.index)
            .filter(|i| !skipped.contains(i))
            .collect();
        assert_eq!(*fake.written.borrow(), expect);
    }

    #[test]
    fn refused_last_entry_terminates() {
        let fake = FakeVcpu {
            refuse: vec![MSR_MTRR_DEF_TYPE],
            written: RefCell::new(vec![]),
        };
        let skipped = set_msrs_skipping(&fake, &boot_msr_entries()).unwrap();
        assert_eq!(skipped, vec![MSR_MTRR_DEF_TYPE]);
    }
}
