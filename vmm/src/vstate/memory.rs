//! Guest RAM: anonymous MAP_PRIVATE mappings (so fork() shares them copy-on-write),
//! with transparent huge pages advised; and the invocation mailbox, one more such
//! mapping in the MMIO gap (`devices::mailbox`), left out of the guest's memory map.

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

use devices::mailbox::MailboxWindow;

use crate::arch::x86_64::layout::ram_ranges;

/// Errors creating guest memory.
#[derive(Debug, thiserror::Error)]
pub enum MemoryError {
    /// mmap failed.
    #[error("cannot map {mib} MiB of guest memory: {source}")]
    Map {
        /// Requested size.
        mib: u64,
        /// Why.
        source: vm_memory::mmap::FromRangesError,
    },
    /// Populating guest memory failed (out of memory, or a kernel before 5.14).
    #[error("cannot prefault guest memory: {0}")]
    Prefault(std::io::Error),
}

pub use api_types::vm::MemoryInfo;

const HUGE_PAGE: usize = 2 << 20;

/// Maps `mem_bytes` of guest RAM around the MMIO gap, advising huge pages when `thp`,
/// and with `prefault` populating every page up front (as if the guest had touched it);
/// then the mailbox (none when `mailbox` has size 0), with 4 KiB pages so that a clone
/// writing a small request copies little of it.
pub fn create_guest_memory(
    mem_bytes: u64,
    thp: bool,
    prefault: bool,
    mailbox: MailboxWindow,
) -> Result<(GuestMemoryMmap, MemoryInfo), MemoryError> {
    let mut ranges: Vec<(GuestAddress, usize)> = ram_ranges(mem_bytes)
        .into_iter()
        .map(|(start, size)| (GuestAddress(start), size as usize))
        .collect();
    let ram_regions = ranges.len();
    if mailbox.size > 0 {
        ranges.push((GuestAddress(u64::from(mailbox.addr)), mailbox.size as usize));
        ranges.sort_by_key(|r| r.0);
    }
    let mem = GuestMemoryMmap::from_ranges(&ranges).map_err(|source| MemoryError::Map {
        mib: mem_bytes >> 20,
        source,
    })?;
    let mut info = MemoryInfo {
        thp_advised: thp,
        huge_aligned: true,
    };
    let mailbox_start = GuestAddress(u64::from(mailbox.addr));
    for region in mem.iter() {
        if mailbox.size > 0 && region.start_addr() == mailbox_start {
            continue;
        }
        let Ok(host) = region.get_host_address(vm_memory::MemoryRegionAddress(0)) else {
            info.huge_aligned = false;
            continue;
        };
        info.huge_aligned &= (host as usize) % HUGE_PAGE == 0;
        if thp {
            // SAFETY: `host` and `len` describe a mapping owned by `mem`, alive here;
            // MADV_HUGEPAGE only changes how the kernel backs it.
            let rc =
                unsafe { libc::madvise(host.cast(), region.len() as usize, libc::MADV_HUGEPAGE) };
            if rc != 0 {
                info.thp_advised = false;
                tracing::warn!(
                    "MADV_HUGEPAGE failed: {}; guest RAM uses 4 KiB pages",
                    std::io::Error::last_os_error()
                );
            }
        }
        if prefault {
            // SAFETY: as above; MADV_POPULATE_WRITE faults the pages in writable.
            let rc = unsafe {
                libc::madvise(
                    host.cast(),
                    region.len() as usize,
                    libc::MADV_POPULATE_WRITE,
                )
            };
            if rc != 0 {
                return Err(MemoryError::Prefault(std::io::Error::last_os_error()));
            }
        }
    }
    debug_assert_eq!(
        mem.num_regions(),
        ram_regions + usize::from(mailbox.size > 0)
    );
    Ok((mem, info))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn maps_ranges_and_is_usable() {
        let (mem, info) =
            create_guest_memory(64 << 20, true, true, MailboxWindow::default()).unwrap();
        assert_eq!(mem.num_regions(), 1);
        assert!(info.thp_advised);
        mem.write_obj(0xdead_beefu32, GuestAddress(0x100_0000))
            .unwrap();
        let v: u32 = mem.read_obj(GuestAddress(0x100_0000)).unwrap();
        assert_eq!(v, 0xdead_beef);
    }

    #[test]
    fn the_mailbox_is_a_region_of_its_own_in_the_mmio_gap() {
        let window = MailboxWindow::of_size(1 << 20);
        let (mem, _) = create_guest_memory(64 << 20, true, false, window).unwrap();
        assert_eq!(mem.num_regions(), 2);
        let r = mem.find_region(GuestAddress(0xc000_0000)).unwrap();
        assert_eq!(r.len(), 1 << 20);
        assert!(mem.find_region(GuestAddress(64 << 20)).is_none());
        // Above 3 GiB of RAM, the mailbox still sits between the two RAM ranges.
        let (mem, _) = create_guest_memory(4 << 30, false, false, window).unwrap();
        assert_eq!(mem.num_regions(), 3);
        assert!(mem
            .find_region(GuestAddress(0xc000_0000 + (1 << 20)))
            .is_none());
    }
}
