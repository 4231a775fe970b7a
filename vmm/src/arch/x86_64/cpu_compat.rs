//! Whether a VM saved on one host can run on this one (a snapshot's restore checks):
//! every CPUID feature the guest was shown must be one this host's KVM offers, and
//! every MSR the snapshot holds one this host's KVM can set. A guest that saw AVX-512
//! at boot would otherwise fault (or worse, compute wrongly) the first time it uses it
//! after the restore, long after the restore "worked".

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

use super::cpuid::{Reg, KVM_CPUID_FEATURES};

/// The feature words compared: (leaf, subleaf, register).
const FEATURE_WORDS: &[(u32, u32, Reg)] = &[
    (1, 0, Reg::Ecx),
    (1, 0, Reg::Edx),
    (7, 0, Reg::Ebx),
    (7, 0, Reg::Ecx),
    (7, 0, Reg::Edx),
    (7, 1, Reg::Eax),
    (0xd, 1, Reg::Eax),
    (0x8000_0001, 0, Reg::Ecx),
    (0x8000_0001, 0, Reg::Edx),
    (KVM_CPUID_FEATURES, 0, Reg::Eax),
];

/// Bits forkvm sets itself, whatever the host offers (`cpuid::vcpu_cpuid`): hypervisor
/// present (leaf 1 ECX 31) and multi-core (leaf 1 EDX 28).
const SET_BY_FORKVM: &[(u32, u32, Reg, u8)] = &[(1, 0, Reg::Ecx, 31), (1, 0, Reg::Edx, 28)];

/// Names of the feature bits a guest is most likely to depend on (Linux's names).
const NAMES: &[(u32, u32, Reg, u8, &str)] = &[
    (1, 0, Reg::Ecx, 0, "sse3"),
    (1, 0, Reg::Ecx, 1, "pclmulqdq"),
    (1, 0, Reg::Ecx, 9, "ssse3"),
    (1, 0, Reg::Ecx, 12, "fma"),
    (1, 0, Reg::Ecx, 13, "cx16"),
    (1, 0, Reg::Ecx, 19, "sse4_1"),
    (1, 0, Reg::Ecx, 20, "sse4_2"),
    (1, 0, Reg::Ecx, 21, "x2apic"),
    (1, 0, Reg::Ecx, 22, "movbe"),
    (1, 0, Reg::Ecx, 23, "popcnt"),
    (1, 0, Reg::Ecx, 24, "tsc_deadline_timer"),
    (1, 0, Reg::Ecx, 25, "aes"),
    (1, 0, Reg::Ecx, 26, "xsave"),
    (1, 0, Reg::Ecx, 28, "avx"),
    (1, 0, Reg::Ecx, 29, "f16c"),
    (1, 0, Reg::Ecx, 30, "rdrand"),
    (1, 0, Reg::Edx, 25, "sse"),
    (1, 0, Reg::Edx, 26, "sse2"),
    (7, 0, Reg::Ebx, 0, "fsgsbase"),
    (7, 0, Reg::Ebx, 3, "bmi1"),
    (7, 0, Reg::Ebx, 5, "avx2"),
    (7, 0, Reg::Ebx, 7, "smep"),
    (7, 0, Reg::Ebx, 8, "bmi2"),
    (7, 0, Reg::Ebx, 9, "erms"),
    (7, 0, Reg::Ebx, 10, "invpcid"),
    (7, 0, Reg::Ebx, 16, "avx512f"),
    (7, 0, Reg::Ebx, 17, "avx512dq"),
    (7, 0, Reg::Ebx, 18, "rdseed"),
    (7, 0, Reg::Ebx, 19, "adx"),
    (7, 0, Reg::Ebx, 20, "smap"),
    (7, 0, Reg::Ebx, 23, "clflushopt"),
    (7, 0, Reg::Ebx, 24, "clwb"),
    (7, 0, Reg::Ebx, 29, "sha_ni"),
    (7, 0, Reg::Ebx, 30, "avx512bw"),
    (7, 0, Reg::Ebx, 31, "avx512vl"),
    (7, 0, Reg::Ecx, 2, "umip"),
    (7, 0, Reg::Ecx, 3, "pku"),
    (7, 0, Reg::Ecx, 9, "vaes"),
    (7, 0, Reg::Ecx, 10, "vpclmulqdq"),
    (7, 0, Reg::Ecx, 22, "rdpid"),
    (7, 0, Reg::Edx, 4, "fsrm"),
    (0xd, 1, Reg::Eax, 0, "xsaveopt"),
    (0xd, 1, Reg::Eax, 1, "xsavec"),
    (0xd, 1, Reg::Eax, 3, "xsaves"),
    (0x8000_0001, 0, Reg::Ecx, 0, "lahf_lm"),
    (0x8000_0001, 0, Reg::Ecx, 5, "abm"),
    (0x8000_0001, 0, Reg::Ecx, 8, "3dnowprefetch"),
    (0x8000_0001, 0, Reg::Edx, 11, "syscall"),
    (0x8000_0001, 0, Reg::Edx, 20, "nx"),
    (0x8000_0001, 0, Reg::Edx, 26, "pdpe1gb"),
    (0x8000_0001, 0, Reg::Edx, 27, "rdtscp"),
    (0x8000_0001, 0, Reg::Edx, 29, "lm"),
];

/// A CPUID feature the guest was shown that this host does not offer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MissingFeature {
    /// Leaf (EAX input).
    pub leaf: u32,
    /// Subleaf (ECX input).
    pub subleaf: u32,
    /// Output register.
    pub reg: Reg,
    /// Bit number.
    pub bit: u8,
}

impl MissingFeature {
    /// Linux's name for it, when forkvm knows it.
    pub fn name(&self) -> Option<&'static str> {
        NAMES
            .iter()
            .find(|n| (n.0, n.1, n.2, n.3) == (self.leaf, self.subleaf, self.reg, self.bit))
            .map(|n| n.4)
    }
}

impl std::fmt::Display for MissingFeature {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let place = format!(
            "CPUID {:#x}.{} {:?} bit {}",
            self.leaf, self.subleaf, self.reg, self.bit
        );
        match self.name() {
            Some(name) => write!(f, "{name} ({place})"),
            None => f.write_str(&place),
        }
    }
}

fn word(cpuid: &CpuId, leaf: u32, subleaf: u32, reg: Reg) -> u32 {
    let pick = |e: &kvm_cpuid_entry2| match reg {
        Reg::Eax => e.eax,
        Reg::Ebx => e.ebx,
        Reg::Ecx => e.ecx,
        Reg::Edx => e.edx,
    };
    cpuid
        .as_slice()
        .iter()
        .find(|e| e.function == leaf && e.index == subleaf)
        .map_or(0, pick)
}

/// The features of `guest` (the CPUID a saved vCPU was given) that `host` (this host's
/// `KVM_GET_SUPPORTED_CPUID`) does not offer, in leaf order; empty when the guest can
/// run here. Bits forkvm sets whatever the host offers are not compared.
pub fn missing_features(guest: &CpuId, host: &CpuId) -> Vec<MissingFeature> {
    let mut missing = Vec::new();
    for &(leaf, subleaf, reg) in FEATURE_WORDS {
        let lacking = word(guest, leaf, subleaf, reg) & !word(host, leaf, subleaf, reg);
        for bit in 0..32u8 {
            let ours = SET_BY_FORKVM.contains(&(leaf, subleaf, reg, bit));
            if lacking & (1 << bit) != 0 && !ours {
                missing.push(MissingFeature {
                    leaf,
                    subleaf,
                    reg,
                    bit,
                });
            }
        }
    }
    missing
}

/// The MSRs of `saved` (the indices a snapshot holds values for) that `host` (this
/// host's `KVM_GET_MSR_INDEX_LIST`) cannot save or restore, in order.
pub fn missing_msrs(saved: &[u32], host: &[u32]) -> Vec<u32> {
    let mut missing: Vec<u32> = saved
        .iter()
        .copied()
        .filter(|m| !host.contains(m))
        .collect();
    missing.sort_unstable();
    missing.dedup();
    missing
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cpuid(entries: &[(u32, u32, [u32; 4])]) -> CpuId {
        let e: Vec<kvm_cpuid_entry2> = entries
            .iter()
            .map(
                |&(function, index, [eax, ebx, ecx, edx])| kvm_cpuid_entry2 {
                    function,
                    index,
                    eax,
                    ebx,
                    ecx,
                    edx,
                    ..Default::default()
                },
            )
            .collect();
        CpuId::from_entries(&e).unwrap()
    }

    #[test]
    fn a_guest_shown_only_what_the_host_offers_can_run_here() {
        let host = cpuid(&[(1, 0, [0, 0, 0x1234_5678, 0xffff]), (7, 0, [0, 0x20, 0, 0])]);
        let guest = cpuid(&[
            // forkvm's own bits (hypervisor, multi-core) on top of the host's.
            (1, 0, [0, 0, 0x1234_5678 | 1 << 31, 0xffff | 1 << 28]),
            (7, 0, [0, 0x20, 0, 0]),
        ]);
        assert_eq!(missing_features(&guest, &host), []);
        // Fewer features than the host is fine.
        let fewer = cpuid(&[(1, 0, [0, 0, 0x0000_0008, 0])]);
        assert_eq!(missing_features(&fewer, &host), []);
    }

    #[test]
    fn every_feature_the_host_lacks_is_named() {
        // The guest saw AVX2 (7.0 EBX 5), AVX-512F (7.0 EBX 16) and an unnamed bit the
        // host lacks; the host has no leaf 7 at all.
        let host = cpuid(&[(1, 0, [0, 0, 1 << 28, 0])]);
        let guest = cpuid(&[
            (1, 0, [0, 0, 1 << 28, 0]),
            (7, 0, [0, 1 << 5 | 1 << 16 | 1 << 1, 0, 0]),
        ]);
        let missing = missing_features(&guest, &host);
        let text: Vec<String> = missing.iter().map(ToString::to_string).collect();
        assert_eq!(
            text,
            [
                "CPUID 0x7.0 Ebx bit 1",
                "avx2 (CPUID 0x7.0 Ebx bit 5)",
                "avx512f (CPUID 0x7.0 Ebx bit 16)"
            ]
        );
    }

    #[test]
    fn msrs_the_host_cannot_set_are_listed_once() {
        assert_eq!(
            missing_msrs(&[0x10, 0x174, 0x10a, 0x10a], &[0x10, 0x174]),
            [0x10a]
        );
        assert_eq!(missing_msrs(&[0x10], &[0x10, 0x11]), Vec::<u32>::new());
    }
}
