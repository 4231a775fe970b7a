//! Model-specific registers: the boot set, and writing a set while skipping, per MSR,
//! what the host refuses (PVM refuses IA32_ARCH_CAPABILITIES, for one).

use kvm_bindings::kvm_msr_entry;

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
pub use clone::msrs::MSR_IA32_TSC;
/// IA32_MISC_ENABLE
pub const MSR_IA32_MISC_ENABLE: u32 = 0x1a0;
/// IA32_MTRR_DEF_TYPE
pub const MSR_MTRR_DEF_TYPE: u32 = 0x2ff;

const MISC_ENABLE_FAST_STRING: u64 = 1;
/// MTRRs enabled, default memory type write-back.
const MTRR_ENABLE_WB: u64 = (1 << 11) | 6;

pub use clone::msrs::{set_msrs_skipping, MsrAccess, MsrError};

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

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::Msrs;
    use std::cell::RefCell;

    /// Accepts every MSR except the refused ones, like KVM: stops at the first refusal.
    struct FakeVcpu {
        refuse: Vec<u32>,
        written: RefCell<Vec<u32>>,
    }
    impl MsrAccess for FakeVcpu {
        fn get_msrs(&self, _: &mut Msrs) -> Result<usize, kvm_ioctls::Error> {
            Ok(0)
        }
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
