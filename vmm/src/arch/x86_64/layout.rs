//! Guest physical memory layout.
//!
//! ```text
//! 0x0000_0500  GDT                      0x0000_7000  Linux zero page (boot_params)
//! 0x0000_0520  IDT (empty)              0x0000_8ff0  boot stack top (64-bit Linux entry)
//! 0x0000_6000  PVH start_info           0x0000_9000  PML4, then PDPT, PD (identity map)
//! 0x0000_6040  PVH module list          0x0002_0000  kernel command line
//! 0x0000_6100  PVH memory map           0x0009_fc00  EBDA: MP table
//! 0x0010_0000  kernel (high memory)     0xc000_0000  MMIO gap start (virtio-mmio, IOAPIC, LAPIC)
//! 0x1_0000_0000 RAM above 4 GiB when the guest has more than 3 GiB
//! ```

/// GDT location.
pub const GDT_START: u64 = 0x500;
/// IDT location (left empty; guests install their own).
pub const IDT_START: u64 = 0x520;
/// PVH `hvm_start_info`.
pub const PVH_INFO_START: u64 = 0x6000;
/// PVH module list (the initrd).
pub const PVH_MODLIST_START: u64 = 0x6040;
/// PVH memory map.
pub const PVH_MEMMAP_START: u64 = 0x6100;
/// Linux boot protocol zero page.
pub const ZERO_PAGE_START: u64 = 0x7000;
/// Initial stack for the 64-bit Linux entry.
pub const BOOT_STACK_POINTER: u64 = 0x8ff0;
/// Identity-map page tables: PML4, PDPT and one PD (first GiB, 2 MiB pages).
pub const PML4_START: u64 = 0x9000;
/// Page directory pointer table.
pub const PDPTE_START: u64 = 0xa000;
/// Page directory.
pub const PDE_START: u64 = 0xb000;
/// Kernel command line.
pub const CMDLINE_START: u64 = 0x20000;
/// Longest command line accepted (Linux x86 COMMAND_LINE_SIZE).
pub const CMDLINE_MAX_SIZE: usize = 2048;
/// Extended BIOS data area: the MP table lives here.
pub const EBDA_START: u64 = 0x9fc00;
/// First byte of high memory; kernels load here.
pub const HIMEM_START: u64 = 0x10_0000;
/// Start of the 32-bit MMIO gap (no RAM from here to 4 GiB).
pub const MMIO_GAP_START: u64 = 0xc000_0000;
/// End of the 32-bit MMIO gap.
pub const MMIO_GAP_END: u64 = 1 << 32;
/// First virtio-mmio device window.
pub const VIRTIO_MMIO_START: u64 = 0xd000_0000;
/// Size of one virtio-mmio device window.
pub const VIRTIO_MMIO_SIZE: u64 = 0x1000;
/// IOAPIC MMIO base.
pub const IOAPIC_START: u64 = 0xfec0_0000;
/// Local APIC MMIO base.
pub const APIC_START: u64 = 0xfee0_0000;
/// Address KVM needs for its TSS (three pages), inside the gap.
pub const KVM_TSS_ADDRESS: u64 = 0xfffb_d000;
/// Smallest guest memory accepted: room for the kernel above 1 MiB.
pub const MIN_MEM_MIB: u64 = 16;
/// Largest guest memory accepted.
pub const MAX_MEM_MIB: u64 = 1 << 20;

/// The RAM ranges `(start, size)` for a guest of `mem_bytes`, split around the MMIO gap.
pub fn ram_ranges(mem_bytes: u64) -> Vec<(u64, u64)> {
    if mem_bytes <= MMIO_GAP_START {
        vec![(0, mem_bytes)]
    } else {
        vec![
            (0, MMIO_GAP_START),
            (MMIO_GAP_END, mem_bytes - MMIO_GAP_START),
        ]
    }
}

/// The kind of an e820 / PVH memory map entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum E820Kind {
    /// Usable RAM.
    Ram = 1,
    /// Reserved (EBDA, legacy ROM area).
    Reserved = 2,
}

/// The memory map the guest is told about: `(start, size, kind)`.
pub fn e820_map(mem_bytes: u64) -> Vec<(u64, u64, E820Kind)> {
    let mut map = vec![
        (0, EBDA_START, E820Kind::Ram),
        (EBDA_START, HIMEM_START - EBDA_START, E820Kind::Reserved),
    ];
    for (start, size) in ram_ranges(mem_bytes) {
        let (start, size) = if start == 0 {
            (HIMEM_START, size - HIMEM_START)
        } else {
            (start, size)
        };
        map.push((start, size, E820Kind::Ram));
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_guest_is_one_range() {
        assert_eq!(ram_ranges(128 << 20), vec![(0, 128 << 20)]);
    }

    #[test]
    fn large_guest_skips_the_mmio_gap() {
        let r = ram_ranges(4 << 30);
        assert_eq!(r, vec![(0, 3 << 30), (4 << 30, 1 << 30)]);
        let total: u64 = r.iter().map(|(_, s)| s).sum();
        assert_eq!(total, 4 << 30);
    }

    #[test]
    fn e820_reserves_ebda_and_covers_ram() {
        let m = e820_map(4 << 30);
        assert_eq!(m[0], (0, EBDA_START, E820Kind::Ram));
        assert_eq!(m[1].2, E820Kind::Reserved);
        assert_eq!(m[2], (HIMEM_START, (3 << 30) - HIMEM_START, E820Kind::Ram));
        assert_eq!(m[3], (4 << 30, 1 << 30, E820Kind::Ram));
        // No overlaps, ascending.
        for w in m.windows(2) {
            assert!(w[0].0 + w[0].1 <= w[1].0);
        }
    }
}
