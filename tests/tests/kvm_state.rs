//! vCPU and VM state through KVM and back: a vCPU and a VM are given distinctive state,
//! saved with `clone::vcpu::save_vcpu` / `clone::vm::save_vm`, written to a snapshot
//! state file and read back (`clone::state_file`), restored into a fresh VM,
//! saved again, and the two saves compared. Whole-guest tests clone running guests;
//! these check each piece of state on its own.

use std::time::Instant;

use clone::msrs::{MSR_IA32_TSC, MSR_IA32_TSC_DEADLINE};
use clone::vcpu::{restore_vcpu, save_vcpu, CaptureSpec};
use clone::{VcpuState, VmState};
use kvm_bindings::{
    kvm_msr_entry, kvm_pit_config, Msrs, KVM_IRQCHIP_IOAPIC, KVM_MAX_CPUID_ENTRIES,
    KVM_MP_STATE_HALTED, KVM_PIT_SPEAKER_DUMMY,
};
use kvm_ioctls::{Cap, Kvm, VcpuFd, VmFd};
use serde::Serialize;
use tests::kvm_available;

const MSR_IA32_SYSENTER_CS: u32 = 0x174;
const MSR_LSTAR: u32 = 0xc000_0082;
const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
const APIC_TPR: usize = 0x80;
const APIC_SVR: usize = 0xf0;
const APIC_LVTT: usize = 0x320;
const APIC_LVT0: usize = 0x350;

/// A VM with its in-kernel irqchip and PIT (as forkvm makes them) and one vCPU with
/// the host's CPUID.
fn new_vm(kvm: &Kvm) -> (VmFd, VcpuFd) {
    let vm = kvm.create_vm().expect("KVM_CREATE_VM");
    vm.set_tss_address(0xfffb_d000).expect("KVM_SET_TSS_ADDR");
    vm.create_irq_chip().expect("KVM_CREATE_IRQCHIP");
    let pit = kvm_pit_config {
        flags: KVM_PIT_SPEAKER_DUMMY,
        ..Default::default()
    };
    vm.create_pit2(pit).expect("KVM_CREATE_PIT2");
    let vcpu = vm.create_vcpu(0).expect("KVM_CREATE_VCPU");
    let cpuid = kvm
        .get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)
        .expect("KVM_GET_SUPPORTED_CPUID");
    vcpu.set_cpuid2(&cpuid).expect("KVM_SET_CPUID2");
    (vm, vcpu)
}

fn spec(kvm: &Kvm, vm: &VmFd) -> CaptureSpec {
    CaptureSpec {
        msr_indices: kvm.get_msr_index_list().unwrap().as_slice().to_vec(),
        xsave_size: match vm.check_extension_int(Cap::Xsave2) {
            n if n > 0 => Some(n as usize),
            _ if vm.check_extension(Cap::Xsave) => Some(4096),
            _ => None,
        },
        xcrs: vm.check_extension(Cap::Xcrs),
    }
}

fn lapic_reg(regs: &[std::os::raw::c_char], off: usize) -> u32 {
    u32::from_le_bytes(std::array::from_fn(|i| regs[off + i] as u8))
}

fn set_lapic_reg(regs: &mut [std::os::raw::c_char], off: usize, v: u32) {
    for (i, b) in v.to_le_bytes().iter().enumerate() {
        regs[off + i] = *b as std::os::raw::c_char;
    }
}

fn msr(state: &VcpuState, index: u32) -> Option<u64> {
    state.msrs.iter().find(|m| m.index == index).map(|m| m.data)
}

fn json(v: &impl Serialize) -> serde_json::Value {
    serde_json::to_value(v).unwrap()
}

/// Gives the vCPU state no freshly created vCPU has.
fn distinctive_vcpu(vcpu: &VcpuFd, xsave_size: Option<usize>) -> u64 {
    let mut regs = vcpu.get_regs().unwrap();
    (regs.rax, regs.rbx, regs.rsp, regs.rip) = (0x1111, 0x2222, 0x8ff0, 0x10_0000);
    regs.r15 = 0xdead_beef;
    vcpu.set_regs(&regs).unwrap();
    let mut sregs = vcpu.get_sregs().unwrap();
    (sregs.gdt.base, sregs.gdt.limit) = (0x1000, 0xff);
    (sregs.idt.base, sregs.idt.limit) = (0x2000, 0x7ff);
    vcpu.set_sregs(&sregs).unwrap();
    if let Some(size) = xsave_size {
        let mut x = kvm_bindings::Xsave::new(size.saturating_sub(4096) / 4).unwrap();
        // SAFETY: `x` has room for the `size` bytes KVM_CAP_XSAVE2 reported.
        unsafe { vcpu.get_xsave2(&mut x) }.unwrap();
        // SAFETY: the xsave struct's header is plain data.
        let region = unsafe { &mut x.as_mut_fam_struct().xsave.region };
        region[0] = (region[0] & !0xffff) | 0x27f; // x87 control word
        region[6] = 0x1fa0; // MXCSR
        region[128] |= 0x3; // XSTATE_BV: x87 and SSE state present, not in init state
                            // SAFETY: `x` came from KVM_GET_XSAVE2 at this host's size.
        unsafe { vcpu.set_xsave2(&x) }.unwrap();
    }
    let mut dbg = vcpu.get_debug_regs().unwrap();
    dbg.db[0] = 0x1000;
    dbg.db[1] = 0x2000;
    vcpu.set_debug_regs(&dbg).unwrap();
    let mut lapic = vcpu.get_lapic().unwrap();
    set_lapic_reg(&mut lapic.regs, APIC_SVR, 0x1ff);
    set_lapic_reg(&mut lapic.regs, APIC_TPR, 0x20);
    // TSC-deadline timer mode, vector 0xec.
    set_lapic_reg(&mut lapic.regs, APIC_LVTT, (2 << 17) | 0xec);
    set_lapic_reg(&mut lapic.regs, APIC_LVT0, 0x700);
    vcpu.set_lapic(&lapic).unwrap();
    let tsc: u64 = 1 << 40;
    let deadline = tsc + (1 << 50);
    let entries = [
        (MSR_IA32_TSC, tsc),
        (MSR_IA32_TSC_DEADLINE, deadline),
        (MSR_IA32_SYSENTER_CS, 0x10),
        (MSR_LSTAR, 0xffff_ffff_8100_0000),
        (MSR_KERNEL_GS_BASE, 0xffff_8880_0000_0000),
    ]
    .map(|(index, data)| kvm_msr_entry {
        index,
        data,
        ..Default::default()
    });
    let n = vcpu
        .set_msrs(&Msrs::from_entries(&entries).unwrap())
        .unwrap();
    assert_eq!(n, entries.len(), "the host refused one of the test's MSRs");
    let mut events = vcpu.get_vcpu_events().unwrap();
    events.nmi.masked = 1;
    vcpu.set_vcpu_events(&events).unwrap();
    vcpu.set_mp_state(kvm_bindings::kvm_mp_state {
        mp_state: KVM_MP_STATE_HALTED,
    })
    .unwrap();
    deadline
}

/// Gives the VM state a fresh VM does not have.
fn distinctive_vm(vm: &VmFd) {
    let mut pit = vm.get_pit2().unwrap();
    pit.channels[0].count = 0x1234;
    pit.channels[0].mode = 2;
    vm.set_pit2(&pit).unwrap();
    let mut clock = vm.get_clock().unwrap();
    clock.clock = 1_000_000_000_000;
    clock.flags = 0;
    vm.set_clock(&clock).unwrap();
    let mut chip = kvm_bindings::kvm_irqchip {
        chip_id: KVM_IRQCHIP_IOAPIC,
        ..Default::default()
    };
    vm.get_irqchip(&mut chip).unwrap();
    // SAFETY: chip_id IOAPIC selects the ioapic member of the union.
    unsafe {
        let ioapic = &mut chip.chip.ioapic;
        ioapic.redirtbl[4].bits = 0x24; // vector 0x24, unmasked, edge
        ioapic.id = 0;
    }
    vm.set_irqchip(&chip).unwrap();
}

#[test]
fn vcpu_and_vm_state_survive_a_save_and_restore_into_a_fresh_vm() {
    if !kvm_available("vcpu_and_vm_state_survive_a_save_and_restore_into_a_fresh_vm") {
        return;
    }
    let kvm = Kvm::new().unwrap();
    let (vm_a, vcpu_a) = new_vm(&kvm);
    let spec = spec(&kvm, &vm_a);
    let deadline = distinctive_vcpu(&vcpu_a, spec.xsave_size);
    distinctive_vm(&vm_a);
    let (saved, unreadable) = save_vcpu(&vcpu_a, 0, &spec).expect("save the vCPU");
    let saved_vm: VmState = clone::vm::save_vm(&vm_a).expect("save the VM");
    let saved_at = Instant::now();
    eprintln!("MSRs KVM lists but could not read here: {unreadable:#x?}");
    // Through a snapshot state file, as a snapshot carries them (checksummed, versioned).
    let scratch = tests::Scratch::new("kvm-state");
    let file = scratch.path("state");
    clone::state_file::write(&file, &(&saved, &saved_vm)).expect("write the state file");
    let bytes = std::fs::metadata(&file).unwrap().len();
    let (saved, saved_vm): (VcpuState, VmState) =
        clone::state_file::read(&file).expect("read the state file");
    eprintln!("a vCPU's and the VM's state in a state file: {bytes} bytes");

    let (vm_b, vcpu_b) = new_vm(&kvm);
    let refused = restore_vcpu(&vcpu_b, &saved).expect("restore the vCPU");
    eprintln!("MSRs the host refused on restore: {refused:#x?}");
    clone::vm::restore_vm(&vm_b, &saved_vm).expect("restore the VM");
    let (again, _) = save_vcpu(&vcpu_b, 0, &spec).expect("save the restored vCPU");
    let again_vm = clone::vm::save_vm(&vm_b).expect("save the restored VM");
    let elapsed_ns = saved_at.elapsed().as_nanos() as u64;

    // vCPU: exactly what was saved.
    assert_eq!(json(&again.regs), json(&saved.regs), "registers");
    assert_eq!(again.regs.r15, 0xdead_beef);
    assert_eq!(
        json(&again.sregs),
        json(&saved.sregs),
        "segment and control registers"
    );
    assert_eq!(again.sregs.idt.base, 0x2000);
    assert_eq!(
        json(&again.debug_regs),
        json(&saved.debug_regs),
        "debug registers"
    );
    assert_eq!(again.debug_regs.db[1], 0x2000);
    assert_eq!(json(&again.xcrs), json(&saved.xcrs), "XCRs");
    match (&again.xsave, &saved.xsave) {
        (Some(a), Some(s)) => {
            assert_eq!(json(a), json(s), "xsave area");
            // FCW and MXCSR in the legacy area.
            let legacy = &s.as_fam_struct_ref().xsave.region;
            assert_eq!(legacy[0] & 0xffff, 0x27f, "x87 control word");
            assert_eq!(legacy[6], 0x1fa0, "MXCSR");
        }
        (a, s) => assert_eq!(a.is_some(), s.is_some(), "xsave present in both"),
    }
    assert_eq!(
        saved.mp_state.mp_state, KVM_MP_STATE_HALTED,
        "mp_state saved"
    );
    assert_eq!(again.mp_state.mp_state, KVM_MP_STATE_HALTED, "mp_state");
    assert_eq!(json(&again.vcpu_events), json(&saved.vcpu_events), "events");
    assert_eq!(again.vcpu_events.nmi.masked, 1);
    for off in [APIC_TPR, APIC_SVR, APIC_LVTT, APIC_LVT0] {
        assert_eq!(
            lapic_reg(&again.lapic.regs, off),
            lapic_reg(&saved.lapic.regs, off),
            "LAPIC register {off:#x}"
        );
    }
    assert_eq!(lapic_reg(&again.lapic.regs, APIC_TPR), 0x20);
    assert_eq!(json(&again.cpuid), json(&saved.cpuid), "CPUID");
    // MSRs: every one saved comes back (but those the host refused), the TSC moved on
    // only by the time between the two saves, the deadline exactly.
    for m in &saved.msrs {
        if refused.contains(&m.index) || m.index == MSR_IA32_TSC {
            continue;
        }
        assert_eq!(msr(&again, m.index), Some(m.data), "MSR {:#x}", m.index);
    }
    assert_eq!(msr(&again, MSR_IA32_TSC_DEADLINE), Some(deadline));
    assert_eq!(msr(&again, MSR_LSTAR), Some(0xffff_ffff_8100_0000));
    let (tsc_a, tsc_b) = (
        msr(&saved, MSR_IA32_TSC).unwrap(),
        msr(&again, MSR_IA32_TSC).unwrap(),
    );
    let khz = u64::from(saved.tsc_khz.unwrap_or(10_000_000));
    let allowed = (elapsed_ns + 1_000_000) * khz / 1_000_000;
    assert!(
        tsc_b >= tsc_a && tsc_b - tsc_a <= allowed,
        "TSC {tsc_a:#x} -> {tsc_b:#x} in {elapsed_ns} ns"
    );

    // VM: the PIT's programming, the irqchips exactly, the clock moved on only by the
    // time between the saves.
    let (pa, pb) = (&saved_vm.pit.channels[0], &again_vm.pit.channels[0]);
    assert_eq!((pb.count, pb.mode), (0x1234, 2), "PIT channel 0");
    assert_eq!(
        (pb.count, pb.mode, pb.rw_mode),
        (pa.count, pa.mode, pa.rw_mode)
    );
    assert_eq!(
        json(&again_vm.pic_master),
        json(&saved_vm.pic_master),
        "PIC master"
    );
    assert_eq!(
        json(&again_vm.pic_slave),
        json(&saved_vm.pic_slave),
        "PIC slave"
    );
    assert_eq!(json(&again_vm.ioapic), json(&saved_vm.ioapic), "IOAPIC");
    // SAFETY: the IOAPIC chip's union member is the ioapic.
    let pin4 = unsafe { again_vm.ioapic.chip.ioapic.redirtbl[4].bits };
    assert_eq!(pin4 & 0x1_00ff, 0x24, "IOAPIC pin 4");
    let (ca, cb) = (saved_vm.clock.clock, again_vm.clock.clock);
    assert!(
        cb >= ca && cb - ca <= elapsed_ns + 1_000_000,
        "kvmclock {ca} -> {cb} in {elapsed_ns} ns"
    );
}

#[test]
fn the_cpuid_forkvm_gives_a_vcpu_passes_the_restore_check_on_the_same_host() {
    // A snapshot restored on the host that took it must never be refused: every bit
    // forkvm shows a guest is one this host's KVM offers, or one forkvm sets itself.
    if !kvm_available("the_cpuid_forkvm_gives_a_vcpu_passes_the_restore_check") {
        return;
    }
    use vmm::arch::x86_64::{cpu_compat, cpuid};
    let kvm = Kvm::new().unwrap();
    let host = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
    for hidden in [&[][..], cpuid::PVM_HIDDEN_FEATURES] {
        for (id, n) in [(0, 1), (1, 2), (3, 4)] {
            let guest = cpuid::vcpu_cpuid(&host, id, n, hidden);
            let missing = cpu_compat::missing_features(&guest, &host);
            assert!(missing.is_empty(), "vCPU {id} of {n}: {missing:?}");
        }
    }
    let msrs = kvm.get_msr_index_list().unwrap();
    assert!(cpu_compat::missing_msrs(msrs.as_slice(), msrs.as_slice()).is_empty());
}
