//! Initial vCPU registers for the two boot protocols forkvm supports.

use kvm_bindings::{kvm_fpu, kvm_regs, kvm_sregs};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

use super::gdt::{gdt_entry, kvm_segment_from_gdt};
use super::layout::{
    BOOT_STACK_POINTER, GDT_START, IDT_START, PDE_START, PDPTE_START, PML4_START, PVH_INFO_START,
    ZERO_PAGE_START,
};

/// How the guest kernel is entered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BootProtocol {
    /// PVH: 32-bit protected mode, paging off, `rbx` = `hvm_start_info`.
    Pvh,
    /// Linux 64-bit boot protocol: long mode on identity page tables, `rsi` = zero page.
    Linux64,
}

/// Where and how a vCPU starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EntryPoint {
    /// Guest physical address of the first instruction.
    pub addr: u64,
    /// Boot protocol.
    pub protocol: BootProtocol,
}

/// Errors setting up registers.
#[derive(Debug, thiserror::Error)]
pub enum RegsError {
    /// Writing GDT or page tables into guest memory failed.
    #[error("cannot write boot tables to guest memory: {0}")]
    Memory(vm_memory::GuestMemoryError),
}

const X86_CR0_PE: u64 = 0x1;
const X86_CR0_ET: u64 = 0x10;
const X86_CR0_PG: u64 = 0x8000_0000;
const X86_CR4_PAE: u64 = 0x20;
const EFER_LME: u64 = 0x100;
const EFER_LMA: u64 = 0x400;

/// The boot GDT: null, 32-bit code (PVH CS, 0x08), 64-bit code (Linux __BOOT_CS, 0x10),
/// data (__BOOT_DS, 0x18), TSS (0x20).
pub const BOOT_GDT: [u64; 5] = [
    0,
    gdt_entry(0xc09b, 0, 0xfffff),
    gdt_entry(0xa09b, 0, 0xfffff),
    gdt_entry(0xc093, 0, 0xfffff),
    gdt_entry(0x808b, 0, 0xfffff),
];

/// General-purpose registers at entry.
pub fn boot_regs(entry: EntryPoint) -> kvm_regs {
    let mut regs = kvm_regs {
        rflags: 0x2,
        rip: entry.addr,
        ..Default::default()
    };
    match entry.protocol {
        BootProtocol::Pvh => regs.rbx = PVH_INFO_START,
        BootProtocol::Linux64 => {
            regs.rsp = BOOT_STACK_POINTER;
            regs.rbp = BOOT_STACK_POINTER;
            regs.rsi = ZERO_PAGE_START;
        }
    }
    regs
}

/// The FPU state at reset.
pub fn boot_fpu() -> kvm_fpu {
    kvm_fpu {
        fcw: 0x37f,
        mxcsr: 0x1f80,
        ..Default::default()
    }
}

/// Writes the GDT (and, for Linux64, identity page tables covering the first GiB) and
/// sets segment and control registers in `sregs` for `protocol`.
pub fn setup_sregs(
    mem: &GuestMemoryMmap,
    protocol: BootProtocol,
    sregs: &mut kvm_sregs,
) -> Result<(), RegsError> {
    for (i, e) in BOOT_GDT.iter().enumerate() {
        mem.write_obj(*e, GuestAddress(GDT_START + i as u64 * 8))
            .map_err(RegsError::Memory)?;
    }
    mem.write_obj(0u64, GuestAddress(IDT_START))
        .map_err(RegsError::Memory)?;
    sregs.gdt.base = GDT_START;
    sregs.gdt.limit = (BOOT_GDT.len() * 8 - 1) as u16;
    sregs.idt.base = IDT_START;
    sregs.idt.limit = 7;

    let code_index = match protocol {
        BootProtocol::Pvh => 1,
        BootProtocol::Linux64 => 2,
    };
    sregs.cs = kvm_segment_from_gdt(BOOT_GDT[code_index], code_index as u8);
    let data = kvm_segment_from_gdt(BOOT_GDT[3], 3);
    sregs.ds = data;
    sregs.es = data;
    sregs.fs = data;
    sregs.gs = data;
    sregs.ss = data;
    sregs.tr = kvm_segment_from_gdt(BOOT_GDT[4], 4);

    match protocol {
        BootProtocol::Pvh => {
            sregs.cr0 = X86_CR0_PE | X86_CR0_ET;
            sregs.cr4 = 0;
            sregs.efer = 0;
        }
        BootProtocol::Linux64 => {
            write_identity_page_tables(mem)?;
            sregs.cr3 = PML4_START;
            sregs.cr4 |= X86_CR4_PAE;
            sregs.cr0 |= X86_CR0_PE | X86_CR0_ET | X86_CR0_PG;
            sregs.efer |= EFER_LME | EFER_LMA;
        }
    }
    Ok(())
}

fn write_identity_page_tables(mem: &GuestMemoryMmap) -> Result<(), RegsError> {
    let w = |v: u64, a: u64| mem.write_obj(v, GuestAddress(a)).map_err(RegsError::Memory);
    w(PDPTE_START | 0x3, PML4_START)?;
    w(PDE_START | 0x3, PDPTE_START)?;
    for i in 0..512u64 {
        w((i << 21) | 0x83, PDE_START + i * 8)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10_0000)]).unwrap()
    }

    #[test]
    fn linux64_long_mode_with_identity_map() {
        let m = mem();
        let mut s = kvm_sregs::default();
        setup_sregs(&m, BootProtocol::Linux64, &mut s).unwrap();
        assert_eq!(s.cs.selector, 0x10);
        assert_eq!(s.cs.l, 1);
        assert_eq!(s.ds.selector, 0x18);
        assert_eq!(s.cr3, PML4_START);
        assert_ne!(s.cr0 & X86_CR0_PG, 0);
        assert_eq!(s.efer & (EFER_LME | EFER_LMA), EFER_LME | EFER_LMA);
        let pml4: u64 = m.read_obj(GuestAddress(PML4_START)).unwrap();
        assert_eq!(pml4, PDPTE_START | 3);
        let last: u64 = m.read_obj(GuestAddress(PDE_START + 511 * 8)).unwrap();
        assert_eq!(last, (511 << 21) | 0x83);
        let gdt2: u64 = m.read_obj(GuestAddress(GDT_START + 16)).unwrap();
        assert_eq!(gdt2, BOOT_GDT[2]);
        let r = boot_regs(EntryPoint {
            addr: 0x100_0200,
            protocol: BootProtocol::Linux64,
        });
        assert_eq!(
            (r.rip, r.rsi, r.rsp),
            (0x100_0200, ZERO_PAGE_START, BOOT_STACK_POINTER)
        );
    }

    #[test]
    fn pvh_protected_mode_paging_off() {
        let m = mem();
        let mut s = kvm_sregs::default();
        setup_sregs(&m, BootProtocol::Pvh, &mut s).unwrap();
        assert_eq!(s.cs.selector, 0x08);
        assert_eq!((s.cs.l, s.cs.db), (0, 1));
        assert_eq!(s.cs.limit, 0xffff_ffff);
        assert_eq!(s.cr0 & X86_CR0_PG, 0);
        assert_eq!(s.cr0 & X86_CR0_PE, X86_CR0_PE);
        assert_eq!(s.efer, 0);
        let r = boot_regs(EntryPoint {
            addr: 0x100_0000,
            protocol: BootProtocol::Pvh,
        });
        assert_eq!(r.rbx, PVH_INFO_START);
        assert_eq!(r.rflags, 2);
    }
}
