//! What a clone carries over: the VM's KVM state, every vCPU's, and the devices'.

use kvm_bindings::{
    kvm_clock_data, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry,
    kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, CpuId, Xsave,
};
use serde::{Deserialize, Serialize};

use devices::control::ControlState;
pub use devices::DeviceStates;

/// One vCPU's architectural and KVM state.
#[derive(Clone, Serialize, Deserialize)]
pub struct VcpuState {
    /// vCPU index (= APIC id).
    pub id: u8,
    /// The CPUID the vCPU was given.
    pub cpuid: CpuId,
    /// Run state (runnable, halted, waiting for SIPI, ...).
    pub mp_state: kvm_mp_state,
    /// General-purpose registers.
    pub regs: kvm_regs,
    /// Segment, control and descriptor-table registers.
    pub sregs: kvm_sregs,
    /// Extended FPU state, sized by KVM_CAP_XSAVE2 (None where the host has no XSAVE).
    pub xsave: Option<Xsave>,
    /// Extended control registers (None where the host has no XCRS).
    pub xcrs: Option<kvm_xcrs>,
    /// Debug registers.
    pub debug_regs: kvm_debugregs,
    /// Local APIC registers.
    pub lapic: kvm_lapic_state,
    /// Every MSR KVM lists as saveable that this vCPU could read (kvmclock and paravirt
    /// MSRs included).
    pub msrs: Vec<kvm_msr_entry>,
    /// Pending exceptions, interrupts, NMIs and SMIs.
    pub vcpu_events: kvm_vcpu_events,
    /// TSC frequency in kHz, when KVM reports it.
    pub tsc_khz: Option<u32>,
    /// The vCPU's forkvm control ports (`devices::control`).
    #[serde(default)]
    pub control: ControlState,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState")
            .field("id", &self.id)
            .field("rip", &format_args!("{:#x}", self.regs.rip))
            .field("mp_state", &self.mp_state.mp_state)
            .field("msrs", &self.msrs.len())
            .finish_non_exhaustive()
    }
}

/// VM-wide KVM state: in-kernel PIT, kvmclock and interrupt controllers.
#[derive(Clone, Serialize, Deserialize)]
pub struct VmState {
    /// The i8254 PIT.
    pub pit: kvm_pit_state2,
    /// kvmclock.
    pub clock: kvm_clock_data,
    /// PIC master (irqchip 0).
    pub pic_master: kvm_irqchip,
    /// PIC slave (irqchip 1).
    pub pic_slave: kvm_irqchip,
    /// IOAPIC (irqchip 2).
    pub ioapic: kvm_irqchip,
}

/// Everything a clone needs besides guest memory, which it inherits copy-on-write.
#[derive(Clone, Serialize, Deserialize)]
pub struct MicrovmState {
    /// Host CLOCK_MONOTONIC (ns) when the state was read: a clone restored later
    /// advances the guest's clocks by the difference ([`MicrovmState::advance_clocks`]).
    pub captured_at_ns: u64,
    /// VM-wide state.
    pub vm: VmState,
    /// Per-vCPU state, by index.
    pub vcpus: Vec<VcpuState>,
    /// Every device's state, in bus order (the device manager's list).
    pub devices: DeviceStates,
}

impl MicrovmState {
    /// Moves the guest's clocks forward by `elapsed_ns` of host time, as if the guest had
    /// kept running meanwhile: kvmclock by `elapsed_ns`, every vCPU's TSC by the cycles
    /// its TSC frequency gives for that time (vCPUs with an unknown frequency keep their
    /// TSC). Deadlines stay absolute, so a timer due meanwhile fires at once.
    pub fn advance_clocks(&mut self, elapsed_ns: u64) {
        self.vm.clock.clock = self.vm.clock.clock.wrapping_add(elapsed_ns);
        for v in &mut self.vcpus {
            let Some(khz) = v.tsc_khz else { continue };
            let cycles = (u128::from(elapsed_ns) * u128::from(khz) / 1_000_000) as u64;
            for m in v
                .msrs
                .iter_mut()
                .filter(|m| m.index == crate::msrs::MSR_IA32_TSC)
            {
                m.data = m.data.wrapping_add(cycles);
            }
        }
    }
}

/// A one-vCPU state for tests: TSC 1,000, TSC deadline 5,000, APIC base 7, kvmclock
/// 10,000 ns.
#[cfg(test)]
pub(crate) fn sample_state(tsc_khz: Option<u32>) -> MicrovmState {
    tests::state(tsc_khz)
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_msr_entry;

    pub(super) fn state(tsc_khz: Option<u32>) -> MicrovmState {
        let msr = |index, data| kvm_msr_entry {
            index,
            data,
            ..Default::default()
        };
        let vcpu = VcpuState {
            id: 0,
            cpuid: CpuId::new(0).unwrap(),
            mp_state: Default::default(),
            regs: Default::default(),
            sregs: Default::default(),
            xsave: None,
            xcrs: None,
            debug_regs: Default::default(),
            lapic: Default::default(),
            msrs: vec![
                msr(crate::msrs::MSR_IA32_TSC, 1_000),
                msr(0x6e0, 5_000),
                msr(0x1b, 7),
            ],
            vcpu_events: Default::default(),
            tsc_khz,
            control: Default::default(),
        };
        MicrovmState {
            captured_at_ns: 0,
            vm: VmState {
                pit: Default::default(),
                clock: kvm_clock_data {
                    clock: 10_000,
                    ..Default::default()
                },
                pic_master: Default::default(),
                pic_slave: Default::default(),
                ioapic: Default::default(),
            },
            vcpus: vec![vcpu],
            devices: DeviceStates::default(),
        }
    }

    #[test]
    fn clocks_advance_by_elapsed_time() {
        // 2.5 GHz TSC, 3 ms later.
        let mut s = state(Some(2_500_000));
        s.advance_clocks(3_000_000);
        assert_eq!(s.vm.clock.clock, 10_000 + 3_000_000);
        let tsc = s.vcpus[0]
            .msrs
            .iter()
            .find(|m| m.index == 0x10)
            .unwrap()
            .data;
        assert_eq!(tsc, 1_000 + 7_500_000);
        // Other MSRs, the TSC deadline included, are untouched.
        let others: Vec<u64> = s.vcpus[0].msrs[1..].iter().map(|m| m.data).collect();
        assert_eq!(others, vec![5_000, 7]);
    }

    #[test]
    fn unknown_tsc_frequency_keeps_the_tsc() {
        let mut s = state(None);
        s.advance_clocks(1_000_000_000);
        assert_eq!(s.vcpus[0].msrs[0].data, 1_000);
        assert_eq!(s.vm.clock.clock, 1_000_010_000);
    }
}
