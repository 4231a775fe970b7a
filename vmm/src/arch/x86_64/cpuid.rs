//! CPUID for each vCPU: KVM's supported set, with topology and identity filled in per
//! vCPU, and on hosts that need it, features hidden from the guest.

use kvm_bindings::{kvm_cpuid_entry2, CpuId};

/// A CPUID register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reg {
    /// EAX
    Eax,
    /// EBX
    Ebx,
    /// ECX
    Ecx,
    /// EDX
    Edx,
}

/// One feature bit of CPUID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FeatureBit {
    /// Leaf (EAX input).
    pub leaf: u32,
    /// Subleaf (ECX input).
    pub subleaf: u32,
    /// Output register.
    pub reg: Reg,
    /// Bit number.
    pub bit: u8,
    /// The name Linux uses for it (also its `clearcpuid=` name where one exists).
    pub name: &'static str,
}

const fn f(leaf: u32, subleaf: u32, reg: Reg, bit: u8, name: &'static str) -> FeatureBit {
    FeatureBit {
        leaf,
        subleaf,
        reg,
        bit,
        name,
    }
}

/// Features a guest must not use on a PVM host: its instruction emulator stops the VM on
/// them (CMPXCHG16B, which SLUB uses when `cx16` is present; POPCNT; XRSTOR; ...), or
/// they touch state it does not virtualise (docs/guest-kernel.md). And two it had better
/// not: with `erms` and `fsrm` Linux clears and copies pages with byte-wise `rep stosb`
/// and `rep movsb`, which the emulator runs 4,096 iterations a page; without them it
/// uses `rep stosq` and `rep movsq` (512), and a guest page fault or a 4 KiB copy to or
/// from user memory costs about a third (measured in docs/invoke.md).
pub const PVM_HIDDEN_FEATURES: &[FeatureBit] = &[
    f(1, 0, Reg::Ecx, 13, "cx16"),
    f(1, 0, Reg::Ecx, 17, "pcid"),
    f(1, 0, Reg::Ecx, 23, "popcnt"),
    f(1, 0, Reg::Ecx, 26, "xsave"),
    f(1, 0, Reg::Ecx, 27, "osxsave"),
    f(1, 0, Reg::Ecx, 30, "rdrand"),
    f(7, 0, Reg::Ebx, 0, "fsgsbase"),
    f(7, 0, Reg::Ebx, 7, "smep"),
    f(7, 0, Reg::Ebx, 9, "erms"),
    f(7, 0, Reg::Ebx, 10, "invpcid"),
    f(7, 0, Reg::Ebx, 18, "rdseed"),
    f(7, 0, Reg::Ebx, 20, "smap"),
    f(7, 0, Reg::Ebx, 23, "clflushopt"),
    f(7, 0, Reg::Ebx, 24, "clwb"),
    f(7, 0, Reg::Ecx, 2, "umip"),
    f(7, 0, Reg::Ecx, 3, "pku"),
    f(7, 0, Reg::Ecx, 22, "rdpid"),
    f(7, 0, Reg::Edx, 4, "fsrm"),
];

/// KVM's paravirtual feature leaf.
pub const KVM_CPUID_FEATURES: u32 = 0x4000_0001;

/// KVM paravirtual features no forkvm guest is offered, on any host: asynchronous page
/// faults. KVM answers a vCPU's enabling of them (which every clone's MSR restore
/// repeats) with a "wake all" interrupt, so each clone would start with a guest-kernel
/// trip before its first instruction (about 4,000 emulated instructions, 3-5 ms, on a PVM
/// host; docs/design.md). They only help when the host swaps guest memory out.
pub const ALWAYS_HIDDEN_FEATURES: &[FeatureBit] = &[
    f(KVM_CPUID_FEATURES, 0, Reg::Eax, 4, "kvm-asyncpf"),
    f(KVM_CPUID_FEATURES, 0, Reg::Eax, 10, "kvm-asyncpf-vmexit"),
    f(KVM_CPUID_FEATURES, 0, Reg::Eax, 14, "kvm-asyncpf-int"),
];

fn reg_mut(e: &mut kvm_cpuid_entry2, reg: Reg) -> &mut u32 {
    match reg {
        Reg::Eax => &mut e.eax,
        Reg::Ebx => &mut e.ebx,
        Reg::Ecx => &mut e.ecx,
        Reg::Edx => &mut e.edx,
    }
}

/// Hypervisor-present bit (leaf 1 ECX bit 31).
const HYPERVISOR_BIT: u32 = 1 << 31;
/// Hyper-threading / multi-core bit (leaf 1 EDX bit 28).
const HTT_BIT: u32 = 1 << 28;
/// Leaf 0xb level types.
const LEVEL_SMT: u32 = 1;
const LEVEL_CORE: u32 = 2;

/// Fills in what differs per vCPU and hides `hidden` features and
/// [`ALWAYS_HIDDEN_FEATURES`].
///
/// Topology: `num_vcpus` single-threaded cores in one package, APIC id = vCPU index.
pub fn vcpu_cpuid(base: &CpuId, vcpu_id: u8, num_vcpus: u8, hidden: &[FeatureBit]) -> CpuId {
    let mut cpuid = base.clone();
    let core_bits = u32::BITS - u32::from(num_vcpus.saturating_sub(1)).leading_zeros();
    for e in cpuid.as_mut_slice() {
        match e.function {
            1 => {
                e.ebx = (e.ebx & 0x0000_ffff)
                    | (u32::from(vcpu_id) << 24)
                    | (u32::from(num_vcpus) << 16);
                e.ecx |= HYPERVISOR_BIT;
                if num_vcpus > 1 {
                    e.edx |= HTT_BIT;
                } else {
                    e.edx &= !HTT_BIT;
                }
            }
            4 => {
                // Deterministic cache parameters: cores per package - 1 in EAX[31:26],
                // one logical CPU per cache in EAX[25:14] (no SMT).
                let cores = u32::from(num_vcpus.saturating_sub(1)).min(63);
                e.eax = (e.eax & 0x3fff) | (cores << 26);
            }
            // Extended topology, v1 (0xb) and v2 (0x1f): same layout, and Linux prefers
            // 0x1f when present, so both must describe the same topology.
            0xb | 0x1f => {
                e.edx = u32::from(vcpu_id);
                match e.index {
                    0 => {
                        e.eax = 0;
                        e.ebx = 1;
                        e.ecx = (LEVEL_SMT << 8) | e.index;
                    }
                    1 => {
                        e.eax = core_bits;
                        e.ebx = u32::from(num_vcpus);
                        e.ecx = (LEVEL_CORE << 8) | e.index;
                    }
                    _ => {
                        e.eax = 0;
                        e.ebx = 0;
                        e.ecx = e.index;
                    }
                }
            }
            _ => {}
        }
        for h in hidden.iter().chain(ALWAYS_HIDDEN_FEATURES) {
            if e.function == h.leaf && e.index == h.subleaf {
                *reg_mut(e, h.reg) &= !(1u32 << h.bit);
            }
        }
    }
    cpuid
}

/// The kernel command-line switches that hide the same features from a Linux guest,
/// for hosts that do not fully honour the CPUID filter (PVM).
pub fn linux_hide_switches(hidden: &[FeatureBit]) -> String {
    let mut switches = Vec::new();
    let mut clear = Vec::new();
    for h in hidden {
        match h.name {
            "xsave" => switches.push("noxsave"),
            "fsgsbase" => switches.push("nofsgsbase"),
            "pku" => switches.push("nopku"),
            "osxsave" => {}
            name => clear.push(name),
        }
    }
    if !clear.is_empty() {
        switches.push("clearcpuid=");
    }
    let mut out = switches.join(" ");
    out.push_str(&clear.join(","));
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(function: u32, index: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 {
            function,
            index,
            eax: 0xffff_ffff,
            ebx: 0xffff_ffff,
            ecx: 0xffff_ffff,
            edx: 0xffff_ffff,
            ..Default::default()
        }
    }

    fn base() -> CpuId {
        CpuId::from_entries(&[
            entry(0, 0),
            entry(1, 0),
            entry(4, 0),
            entry(7, 0),
            entry(0xb, 0),
            entry(0xb, 1),
            entry(0x1f, 0),
            entry(0x1f, 1),
            entry(0x1f, 2),
            entry(KVM_CPUID_FEATURES, 0),
        ])
        .unwrap()
    }

    fn find(c: &CpuId, function: u32, index: u32) -> kvm_cpuid_entry2 {
        *c.as_slice()
            .iter()
            .find(|e| e.function == function && e.index == index)
            .unwrap()
    }

    #[test]
    fn apic_id_and_topology_per_vcpu() {
        let c = vcpu_cpuid(&base(), 3, 4, &[]);
        let l1 = find(&c, 1, 0);
        assert_eq!(l1.ebx >> 24, 3);
        assert_eq!((l1.ebx >> 16) & 0xff, 4);
        assert_ne!(l1.ecx & HYPERVISOR_BIT, 0);
        assert_ne!(l1.edx & HTT_BIT, 0);
        let smt = find(&c, 0xb, 0);
        let core = find(&c, 0xb, 1);
        assert_eq!((smt.edx, smt.ebx, smt.ecx >> 8), (3, 1, LEVEL_SMT));
        assert_eq!((core.eax, core.ebx, core.ecx >> 8), (2, 4, LEVEL_CORE));
        for leaf in [0xb, 0x1f] {
            let e = find(&c, leaf, 1);
            let regs = |e: kvm_cpuid_entry2| (e.eax, e.ebx, e.ecx, e.edx);
            assert_eq!(regs(e), regs(core), "leaf {leaf:#x} matches 0xb");
        }
        let die = find(&c, 0x1f, 2);
        assert_eq!(
            (die.eax, die.ebx, die.ecx & 0xff00),
            (0, 0, 0),
            "no levels above core"
        );
        assert_eq!(find(&c, 4, 0).eax >> 26, 3, "cores per package - 1");
        assert_eq!(find(&c, 4, 0).eax & 0x3fff, 0x3fff, "cache type bits kept");
        let single = vcpu_cpuid(&base(), 0, 1, &[]);
        assert_eq!(find(&single, 1, 0).edx & HTT_BIT, 0);
        assert_eq!(find(&single, 0xb, 1).eax, 0);
    }

    #[test]
    fn hides_pvm_features_and_only_those() {
        let c = vcpu_cpuid(&base(), 0, 1, PVM_HIDDEN_FEATURES);
        let l1 = find(&c, 1, 0);
        let l7 = find(&c, 7, 0);
        for h in PVM_HIDDEN_FEATURES {
            let e = if h.leaf == 1 { l1 } else { l7 };
            let v = match h.reg {
                Reg::Eax => e.eax,
                Reg::Ebx => e.ebx,
                Reg::Ecx => e.ecx,
                Reg::Edx => e.edx,
            };
            assert_eq!(v & (1 << h.bit), 0, "{} still visible", h.name);
        }
        // An unrelated bit (SSE2, leaf 1 EDX 26) is untouched.
        assert_ne!(l1.edx & (1 << 26), 0);
        assert_eq!(find(&c, 0, 0).ebx, 0xffff_ffff);
    }

    #[test]
    fn no_guest_is_offered_async_page_faults() {
        for hidden in [&[][..], PVM_HIDDEN_FEATURES] {
            let kvm = find(&vcpu_cpuid(&base(), 0, 1, hidden), KVM_CPUID_FEATURES, 0);
            assert_eq!(kvm.eax & ((1 << 4) | (1 << 10) | (1 << 14)), 0);
            // Other KVM features (kvmclock, bit 3) stay.
            assert_ne!(kvm.eax & (1 << 3), 0);
        }
    }

    #[test]
    fn linux_switches_for_pvm() {
        let s = linux_hide_switches(PVM_HIDDEN_FEATURES);
        assert!(s.starts_with("noxsave nofsgsbase nopku clearcpuid=cx16,pcid,popcnt,rdrand,"));
        assert!(s.contains("smap") && s.contains("umip") && s.contains("rdpid"));
        assert!(!s.contains("osxsave"));
        assert_eq!(linux_hide_switches(&[]), "");
    }
}
