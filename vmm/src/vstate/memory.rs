//! Guest RAM: anonymous MAP_PRIVATE mappings (so fork() shares them copy-on-write),
//! with transparent huge pages advised.

use vm_memory::{GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion};

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
/// and with `prefault` populating every page up front (as if the guest had touched it).
pub fn create_guest_memory(
    mem_bytes: u64,
    thp: bool,
    prefault: bool,
) -> Result<(GuestMemoryMmap, MemoryInfo), MemoryError> {
    let ranges: Vec<(GuestAddress, usize)> = ram_ranges(mem_bytes)
        .into_iter()
        .map(|(start, size)| (GuestAddress(start), size as usize))
        .collect();
    let mem = GuestMemoryMmap::from_ranges(&ranges).map_err(|source| MemoryError::Map {
        mib: mem_bytes >> 20,
        source,
    })?;
    let mut info = MemoryInfo {
        thp_advised: thp,
        huge_aligned: true,
    };
    for region in mem.iter() {
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
    Ok((mem, info))
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::Bytes;

    #[test]
    fn maps_ranges_and_is_usable() {
        let (mem, info) = create_guest_memory(64 << 20, true, true).unwrap();
        assert_eq!(mem.num_regions(), 1);
        assert!(info.thp_advised);
        mem.write_obj(0xdead_beefu32, GuestAddress(0x100_0000))
            .unwrap();
        let v: u32 = mem.read_obj(GuestAddress(0x100_0000)).unwrap();
        assert_eq!(v, 0xdead_beef);
    }
}
