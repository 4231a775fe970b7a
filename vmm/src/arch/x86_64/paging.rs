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
}
