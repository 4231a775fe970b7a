//! Reading and writing MSR lists through KVM, skipping per MSR what the host refuses.
//!
//! KVM_GET_MSRS and KVM_SET_MSRS stop at the first MSR they cannot handle and return how
//! many they did; the refused one is skipped and the rest retried.

use kvm_bindings::{kvm_msr_entry, Msrs};
use kvm_ioctls::VcpuFd;

/// IA32_TSC.
pub const MSR_IA32_TSC: u32 = 0x10;
/// IA32_TSC_DEADLINE: restored after IA32_TSC, or the deadline is relative to a stale TSC.
pub const MSR_IA32_TSC_DEADLINE: u32 = 0x6e0;

/// Errors reading or writing MSRs.
#[derive(Debug, thiserror::Error)]
pub enum MsrError {
    /// The list could not be built (too many entries for one call).
    #[error("cannot build an MSR list: {0}")]
    Build(String),
    /// The ioctl failed outright.
    #[error("KVM MSR access failed: {0}")]
    Kvm(kvm_ioctls::Error),
}

/// What takes or fills a batch of MSRs and reports how many leading entries it handled.
pub trait MsrAccess {
    /// Writes `msrs`, like KVM_SET_MSRS.
    fn set_msrs(&self, msrs: &Msrs) -> Result<usize, kvm_ioctls::Error>;
    /// Reads into `msrs`, like KVM_GET_MSRS.
    fn get_msrs(&self, msrs: &mut Msrs) -> Result<usize, kvm_ioctls::Error>;
}

impl MsrAccess for VcpuFd {
    fn set_msrs(&self, msrs: &Msrs) -> Result<usize, kvm_ioctls::Error> {
        VcpuFd::set_msrs(self, msrs)
    }
    fn get_msrs(&self, msrs: &mut Msrs) -> Result<usize, kvm_ioctls::Error> {
        VcpuFd::get_msrs(self, msrs)
    }
}

fn msrs(entries: &[kvm_msr_entry]) -> Result<Msrs, MsrError> {
    Msrs::from_entries(entries).map_err(|e| MsrError::Build(format!("{e:?}")))
}

/// Writes `entries` in order, skipping refused ones. Returns the indices skipped.
pub fn set_msrs_skipping<A: MsrAccess>(
    vcpu: &A,
    entries: &[kvm_msr_entry],
) -> Result<Vec<u32>, MsrError> {
    let mut skipped = Vec::new();
    let mut rest = entries;
    while !rest.is_empty() {
        let written = vcpu.set_msrs(&msrs(rest)?).map_err(MsrError::Kvm)?;
        if written >= rest.len() {
            break;
        }
        skipped.push(rest[written].index);
        rest = &rest[written + 1..];
    }
    Ok(skipped)
}

/// Reads the MSRs `indices`, skipping refused ones. Returns the values read (in order)
/// and the indices skipped.
pub fn get_msrs_skipping<A: MsrAccess>(
    vcpu: &A,
    indices: &[u32],
) -> Result<(Vec<kvm_msr_entry>, Vec<u32>), MsrError> {
    let mut read = Vec::with_capacity(indices.len());
    let mut skipped = Vec::new();
    let mut rest = indices;
    while !rest.is_empty() {
        let entries: Vec<kvm_msr_entry> = rest
            .iter()
            .map(|i| kvm_msr_entry {
                index: *i,
                ..Default::default()
            })
            .collect();
        let mut batch = msrs(&entries)?;
        let n = vcpu.get_msrs(&mut batch).map_err(MsrError::Kvm)?;
        read.extend_from_slice(&batch.as_slice()[..n.min(rest.len())]);
        if n >= rest.len() {
            break;
        }
        skipped.push(rest[n]);
        rest = &rest[n + 1..];
    }
    Ok((read, skipped))
}

/// Puts IA32_TSC_DEADLINE after IA32_TSC (KVM computes the deadline against the TSC).
pub fn order_for_restore(entries: &mut [kvm_msr_entry]) {
    entries.sort_by_key(|e| e.index == MSR_IA32_TSC_DEADLINE);
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// Behaves like KVM: handles MSRs in order and stops at the first refused one.
    struct FakeVcpu {
        refuse: Vec<u32>,
        regs: RefCell<Vec<(u32, u64)>>,
    }

    impl MsrAccess for FakeVcpu {
        fn set_msrs(&self, m: &Msrs) -> Result<usize, kvm_ioctls::Error> {
            let mut n = 0;
            for e in m.as_slice() {
                if self.refuse.contains(&e.index) {
                    break;
                }
                self.regs.borrow_mut().push((e.index, e.data));
                n += 1;
            }
            Ok(n)
        }
        fn get_msrs(&self, m: &mut Msrs) -> Result<usize, kvm_ioctls::Error> {
            let mut n = 0;
            for e in m.as_mut_slice() {
                if self.refuse.contains(&e.index) {
                    break;
                }
                e.data = u64::from(e.index) * 2;
                n += 1;
            }
            Ok(n)
        }
    }

    fn e(index: u32, data: u64) -> kvm_msr_entry {
        kvm_msr_entry {
            index,
            data,
            ..Default::default()
        }
    }

    #[test]
    fn set_skips_refused_and_keeps_order() {
        let v = FakeVcpu {
            refuse: vec![0x10a, 0x3],
            regs: RefCell::new(vec![]),
        };
        let skipped = set_msrs_skipping(&v, &[e(1, 1), e(0x10a, 2), e(2, 3), e(0x3, 4)]).unwrap();
        assert_eq!(skipped, vec![0x10a, 0x3]);
        assert_eq!(*v.regs.borrow(), vec![(1, 1), (2, 3)]);
    }

    #[test]
    fn get_skips_refused_and_returns_values() {
        let v = FakeVcpu {
            refuse: vec![5],
            regs: RefCell::new(vec![]),
        };
        let (read, skipped) = get_msrs_skipping(&v, &[4, 5, 6, 7]).unwrap();
        assert_eq!(skipped, vec![5]);
        let got: Vec<(u32, u64)> = read.iter().map(|e| (e.index, e.data)).collect();
        assert_eq!(got, vec![(4, 8), (6, 12), (7, 14)]);
        let (read, skipped) = get_msrs_skipping(&v, &[5]).unwrap();
        assert!(read.is_empty());
        assert_eq!(skipped, vec![5]);
    }

    #[test]
    fn tsc_deadline_goes_after_tsc() {
        let mut m = [
            e(MSR_IA32_TSC_DEADLINE, 1),
            e(0x1, 0),
            e(MSR_IA32_TSC, 2),
            e(0x4b564d01, 3),
        ];
        order_for_restore(&mut m);
        let idx: Vec<u32> = m.iter().map(|e| e.index).collect();
        assert_eq!(
            idx,
            vec![0x1, MSR_IA32_TSC, 0x4b564d01, MSR_IA32_TSC_DEADLINE]
        );
    }
}
