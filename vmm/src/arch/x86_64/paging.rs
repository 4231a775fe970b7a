//! The guest's page tables, as the host reads them from guest memory: which guest
//! pages hold the tables reachable from a CR3 (a rewound clone on a host with shadow
//! paging asks whether it rewrote any, `cloning/rewind.rs`).

use std::collections::HashSet;

use kvm_bindings::kvm_sregs;
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};

const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_LA57: u64 = 1 << 12;
const EFER_LMA: u64 = 1 << 10;
const PRESENT: u64 = 1;
/// A PDPT or PD entry that maps a 1 GiB or 2 MiB page, not a table.
const PAGE_SIZE_BIT: u64 = 1 << 7;
/// Bits 12-51: a table's (or page's) physical address.
const ADDRESS: u64 = 0x000f_ffff_ffff_f000;

/// Most tables one walk collects before it gives up (a guest's tables are far fewer).
pub const MAX_TABLES: usize = 1 << 20;

/// The guest-physical page numbers of every page-table page reachable from `sregs`'s
/// CR3 in 4-level long mode: the PML4, PDPTs, page directories and page tables. An
/// empty set when paging is off; None when the paging mode is another (32-bit, PAE
/// without long mode, 5-level), a table lies outside `mem`, or there are more than
/// [`MAX_TABLES`]: the caller then assumes any page may be one.
pub fn table_pages(mem: &GuestMemoryMmap, sregs: &kvm_sregs) -> Option<HashSet<u64>> {
    let mut tables = HashSet::new();
    if sregs.cr0 & CR0_PG == 0 {
        return Some(tables);
    }
    let long_mode = sregs.efer & EFER_LMA != 0 && sregs.cr4 & CR4_PAE != 0;
    if !long_mode || sregs.cr4 & CR4_LA57 != 0 {
        return None;
    }
    // (table address, its level: 4 = PML4 ... 1 = page table)
    let mut todo = vec![(sregs.cr3 & ADDRESS, 4u8)];
    while let Some((table, level)) = todo.pop() {
        if !tables.insert(table >> 12) {
            continue;
        }
        if tables.len() > MAX_TABLES {
            return None;
        }
        if level == 1 {
            continue;
        }
        let mut entries = [0u64; 512];
        for (i, e) in entries.iter_mut().enumerate() {
            *e = mem.read_obj(GuestAddress(table + 8 * i as u64)).ok()?;
        }
        for e in entries {
            let leaf = level < 4 && e & PAGE_SIZE_BIT != 0;
            if e & PRESENT != 0 && !leaf {
                todo.push((e & ADDRESS, level - 1));
            }
        }
    }
    Some(tables)
}

/// A user-accessible entry (the U/S bit): every level of a user page's walk has it.
const USER: u64 = 1 << 2;

/// The virtual page numbers (address >> 12) of the user-accessible 4 KiB pages in the
/// lower half of `sregs`'s address space (4-level long mode) whose guest frame `wanted`
/// takes, in ascending order; a 2 MiB or 1 GiB page counts as its 4 KiB pages. At most
/// `max` (the lowest). None as for [`table_pages`] (another paging mode, a table outside
/// `mem`), or with paging off. What the VMM can hand a runtime so that it reads, in a
/// warm clone's prime, the pages of its address space that a learned working set holds:
/// the guest maps them in the clone's new VM before the request, with no guest kernel
/// work.
pub fn user_pages_of(
    mem: &GuestMemoryMmap,
    sregs: &kvm_sregs,
    wanted: impl Fn(u64) -> bool,
    max: usize,
) -> Option<Vec<u64>> {
    let long_mode = sregs.efer & EFER_LMA != 0 && sregs.cr4 & CR4_PAE != 0;
    if sregs.cr0 & CR0_PG == 0 || !long_mode || sregs.cr4 & CR4_LA57 != 0 {
        return None;
    }
    let mut out = Vec::new();
    // (table address, its level, the first virtual page it maps).
    let mut todo = vec![(sregs.cr3 & ADDRESS, 4u8, 0u64)];
    let mut walked = 0usize;
    while let Some((table, level, vpn0)) = todo.pop() {
        walked += 1;
        if walked > MAX_TABLES {
            return None;
        }
        // The lower half only: the PML4's first 256 entries.
        let entries = if level == 4 { 256 } else { 512 };
        let span = 1u64 << (9 * (u32::from(level) - 1));
        let mut below = Vec::new();
        for i in 0..entries {
            let e: u64 = mem.read_obj(GuestAddress(table + 8 * i as u64)).ok()?;
            if e & PRESENT == 0 || e & USER == 0 {
                continue;
            }
            let vpn = vpn0 + i as u64 * span;
            if level == 1 || (level < 4 && e & PAGE_SIZE_BIT != 0) {
                // A page of `span` 4 KiB frames (its low frame bits past bit 12 are
                // the attribute bits of a large page: the frame is 4 KiB-aligned to it).
                let frame0 = (e & ADDRESS) >> 12 & !(span - 1);
                for k in 0..span {
                    if wanted(frame0 + k) {
                        out.push(vpn + k);
                    }
                }
            } else {
                below.push((e & ADDRESS, level - 1, vpn));
            }
        }
        todo.extend(below);
    }
    out.sort_unstable();
    out.truncate(max);
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sregs(cr3: u64) -> kvm_sregs {
        kvm_sregs {
            cr0: CR0_PG | 1,
            cr3,
            cr4: CR4_PAE,
            efer: EFER_LMA | (1 << 8),
            ..Default::default()
        }
    }

    #[test]
    fn the_tables_reachable_from_cr3_are_found_and_large_pages_end_a_walk() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let put =
            |table: u64, i: u64, e: u64| mem.write_obj(e, GuestAddress(table + 8 * i)).unwrap();
        // PML4 at 0x1000 -> PDPT at 0x2000 -> PD at 0x3000 -> PT at 0x4000; the PDPT
        // also maps a 1 GiB page, the PD a 2 MiB page (whose address is no table).
        put(0x1000, 0, 0x2000 | PRESENT);
        put(0x2000, 0, 0x3000 | PRESENT);
        put(0x2000, 1, 0x9000 | PRESENT | PAGE_SIZE_BIT);
        put(0x3000, 5, 0x4000 | PRESENT);
        put(0x3000, 6, 0xa000 | PRESENT | PAGE_SIZE_BIT);
        // Not present: not followed.
        put(0x3000, 7, 0xb000);
        let tables = table_pages(&mem, &sregs(0x1000)).unwrap();
        let want: HashSet<u64> = [1, 2, 3, 4].into_iter().collect();
        assert_eq!(tables, want);
        // Paging off: no tables; 5-level paging, or a table outside memory: unknown.
        let off = kvm_sregs {
            cr0: 1,
            ..sregs(0x1000)
        };
        assert_eq!(table_pages(&mem, &off), Some(HashSet::new()));
        let la57 = kvm_sregs {
            cr4: CR4_PAE | CR4_LA57,
            ..sregs(0x1000)
        };
        assert_eq!(table_pages(&mem, &la57), None);
        put(0x1000, 1, 0x4000_0000 | PRESENT);
        assert_eq!(table_pages(&mem, &sregs(0x1000)), None);
    }

    #[test]
    fn user_pages_whose_frames_are_wanted_are_listed_by_virtual_page() {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 8 << 20)]).unwrap();
        let put =
            |table: u64, i: u64, e: u64| mem.write_obj(e, GuestAddress(table + 8 * i)).unwrap();
        let u = PRESENT | USER;
        // PML4 0x1000 -> PDPT 0x2000 -> PD 0x3000 -> PT 0x4000.
        put(0x1000, 0, 0x2000 | u);
        put(0x2000, 0, 0x3000 | u);
        put(0x3000, 1, 0x4000 | u);
        // Virtual page 512 + 3 -> frame 0x100; 512 + 4 -> frame 0x101, not a user page;
        // 512 + 5 -> frame 0x102, not present.
        put(0x4000, 3, 0x10_0000 | u);
        put(0x4000, 4, 0x10_1000 | PRESENT);
        put(0x4000, 5, 0x10_2000 | USER);
        // A 2 MiB page at virtual page 2 * 512 -> frames 0x200.. (one wanted: 0x201).
        put(0x3000, 2, 0x20_0000 | u | PAGE_SIZE_BIT);
        // The upper half (the kernel's) is not walked, user bit or not.
        put(0x1000, 256, 0x5000 | u);
        put(0x5000, 0, 0x3000 | u);
        let wanted = |f: u64| [0x100, 0x101, 0x102, 0x201].contains(&f);
        let pages = user_pages_of(&mem, &sregs(0x1000), wanted, usize::MAX).unwrap();
        assert_eq!(pages, vec![512 + 3, 1024 + 1]);
        // At most `max`, the lowest.
        assert_eq!(
            user_pages_of(&mem, &sregs(0x1000), wanted, 1).unwrap(),
            vec![515]
        );
        // Paging off, 5-level paging or a table outside memory: unknown.
        let off = kvm_sregs {
            cr0: 1,
            ..sregs(0x1000)
        };
        assert_eq!(user_pages_of(&mem, &off, wanted, 8), None);
        put(0x2000, 1, 0x4000_0000 | u);
        assert_eq!(user_pages_of(&mem, &sregs(0x1000), wanted, 8), None);
    }
}
