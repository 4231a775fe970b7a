//! What a clone carries over: the VM's KVM state, every vCPU's, and the devices'.

use kvm_bindings::{
    kvm_clock_data, kvm_debugregs, kvm_irqchip, kvm_lapic_state, kvm_mp_state, kvm_msr_entry,
    kvm_pit_state2, kvm_regs, kvm_sregs, kvm_vcpu_events, kvm_xcrs, CpuId, Xsave,
};
use serde::{Deserialize, Serialize};

use devices::legacy::SerialConsoleState;

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

/// Device state carried into a clone.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct DeviceStates {
    /// The serial console's registers and unread input.
    pub serial: SerialConsoleState,
}

/// Everything a clone needs besides guest memory, which it inherits copy-on-write.
#[derive(Clone, Serialize, Deserialize)]
pub struct MicrovmState {
    /// VM-wide state.
    pub vm: VmState,
    /// Per-vCPU state, by index.
    pub vcpus: Vec<VcpuState>,
    /// Device state.
    pub devices: DeviceStates,
}
