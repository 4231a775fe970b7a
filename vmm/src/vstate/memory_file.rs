//! Guest memory in a snapshot (docs/snapshots.md). [`write_memory_file`] stores every
//! region of a VM's memory in one sparse file, region after region, writing only pages
//! that hold something (a page of zeros is a hole, which reads back as zeros);
//! [`map_memory_file`] maps such a file back as guest memory `MAP_PRIVATE`: pages come
//! from the page cache on first touch, shared by every VM mapped from the same file,
//! and a guest's writes go to its own copies, never to the file.
//!
//! The file holds the guest's memory, secrets included: it is created owner-only (0600).

use std::fs::File;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use vm_memory::mmap::MmapRegionBuilder;
use vm_memory::{
    Bytes, FileOffset, GuestAddress, GuestMemoryBackend, GuestMemoryMmap, GuestMemoryRegion,
    GuestRegionMmap,
};

/// Page size the file is written in.
const PAGE: usize = 4096;
/// Bytes read from guest memory at a time.
const CHUNK: usize = 1 << 20;

/// Where one region of guest memory is in a memory file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryFileRegion {
    /// Its guest-physical address.
    pub guest_addr: u64,
    /// Its size in bytes.
    pub size: u64,
    /// Its offset in the file.
    pub file_offset: u64,
}

/// A memory file's layout, and what writing it cost.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemoryFileLayout {
    /// The regions, in guest address order.
    pub regions: Vec<MemoryFileRegion>,
    /// Bytes of pages written (the rest of the file is holes).
    pub bytes_written: u64,
}

impl MemoryFileLayout {
    /// The file's length: every region, holes included.
    pub fn file_len(&self) -> u64 {
        self.regions
            .iter()
            .map(|r| r.file_offset + r.size)
            .max()
            .unwrap_or(0)
    }
}

/// Why guest memory could not be written to or mapped from a file.
#[derive(Debug, thiserror::Error)]
pub enum MemoryFileError {
    /// The file could not be created or written.
    #[error("cannot write guest memory to {path}: {source}")]
    Write {
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Guest memory could not be read.
    #[error("cannot read guest memory at {addr:#x}: {reason}")]
    Read {
        /// Where.
        addr: u64,
        /// Why.
        reason: String,
    },
    /// The file could not be opened or is not the layout's.
    #[error("cannot map guest memory from {path}: {reason}")]
    Map {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
}

/// Writes every region of `mem` to a new file at `path` (owner-only; an existing file
/// is replaced) and returns its layout.
pub fn write_memory_file(
    mem: &GuestMemoryMmap,
    path: &Path,
) -> Result<MemoryFileLayout, MemoryFileError> {
    let err = |source| MemoryFileError::Write {
        path: path.display().to_string(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .map_err(err)?;
    let mut layout = MemoryFileLayout {
        regions: Vec::with_capacity(mem.num_regions()),
        bytes_written: 0,
    };
    let mut at = 0u64;
    for region in mem.iter() {
        let r = MemoryFileRegion {
            guest_addr: region.start_addr().0,
            size: region.len(),
            file_offset: at,
        };
        layout.regions.push(r);
        at += r.size.next_multiple_of(PAGE as u64);
    }
    file.set_len(layout.file_len()).map_err(err)?;
    let mut buf = vec![0u8; CHUNK];
    for r in &layout.regions {
        let mut off = 0u64;
        while off < r.size {
            let n = (r.size - off).min(CHUNK as u64) as usize;
            let addr = r.guest_addr + off;
            mem.read_slice(&mut buf[..n], GuestAddress(addr))
                .map_err(|e| MemoryFileError::Read {
                    addr,
                    reason: e.to_string(),
                })?;
            layout.bytes_written +=
                write_pages(&file, &buf[..n], r.file_offset + off).map_err(err)?;
            off += n as u64;
        }
    }
    file.sync_all().map_err(err)?;
    Ok(layout)
}

/// Writes the runs of pages of `data` that are not all zeros at `at` onward; returns
/// the bytes written.
fn write_pages(file: &File, data: &[u8], at: u64) -> std::io::Result<u64> {
    let mut written = 0;
    let mut run: Option<usize> = None;
    let pages = data.len().div_ceil(PAGE);
    for p in 0..=pages {
        let page = (p < pages).then(|| &data[p * PAGE..((p + 1) * PAGE).min(data.len())]);
        let full = page.is_some_and(|pg| pg.iter().any(|&b| b != 0));
        match (full, run) {
            (true, None) => run = Some(p * PAGE),
            (false, Some(start)) => {
                let end = (p * PAGE).min(data.len());
                file.write_all_at(&data[start..end], at + start as u64)?;
                written += (end - start) as u64;
                run = None;
            }
            _ => {}
        }
    }
    Ok(written)
}

/// Guest memory mapped `MAP_PRIVATE` from the memory file at `path` with `layout`
/// (which must be the file's: its length is checked).
pub fn map_memory_file(
    path: &Path,
    layout: &MemoryFileLayout,
) -> Result<GuestMemoryMmap, MemoryFileError> {
    let err = |reason: String| MemoryFileError::Map {
        path: path.display().to_string(),
        reason,
    };
    let file = File::open(path).map_err(|e| err(e.to_string()))?;
    let len = file.metadata().map_err(|e| err(e.to_string()))?.len();
    if len != layout.file_len() {
        return Err(err(format!(
            "it is {len} bytes long, the snapshot's memory is {} bytes",
            layout.file_len()
        )));
    }
    let file = Arc::new(file);
    let mut regions = Vec::with_capacity(layout.regions.len());
    for r in &layout.regions {
        let mapping = MmapRegionBuilder::new(r.size as usize)
            .with_file_offset(FileOffset::from_arc(file.clone(), r.file_offset))
            .with_mmap_prot(libc::PROT_READ | libc::PROT_WRITE)
            .with_mmap_flags(libc::MAP_PRIVATE | libc::MAP_NORESERVE)
            .build()
            .map_err(|e| err(format!("region at {:#x}: {e}", r.guest_addr)))?;
        let region = GuestRegionMmap::new(mapping, GuestAddress(r.guest_addr))
            .ok_or_else(|| err(format!("region at {:#x} overflows", r.guest_addr)))?;
        regions.push(region);
    }
    GuestMemoryMmap::from_regions(regions).map_err(|e| err(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    fn path(name: &str) -> std::path::PathBuf {
        std::env::temp_dir().join(format!("forkvm-memfile-{name}-{}", std::process::id()))
    }

    #[test]
    fn memory_written_maps_back_the_same_and_only_touched_pages_take_room() {
        // Two regions around a gap, as guest RAM around the MMIO hole; the second ends in
        // a partial page.
        let ranges = [
            (GuestAddress(0), 8 << 20),
            (GuestAddress(0x1000_0000), (4 << 20) + 100),
        ];
        let mem = GuestMemoryMmap::<()>::from_ranges(&ranges).unwrap();
        let marks: [(u64, &[u8]); 5] = [
            (0, b"first byte"),
            (0x1234, b"inside a page"),
            ((8 << 20) - 3, b"end"),
            (0x1000_0000, b"second region"),
            (0x1000_0000 + (4 << 20) + 90, b"last bytes"),
        ];
        for (addr, bytes) in marks {
            mem.write_slice(bytes, GuestAddress(addr)).unwrap();
        }
        let p = path("roundtrip");
        let layout = write_memory_file(&mem, &p).unwrap();
        let meta = std::fs::metadata(&p).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        assert_eq!(meta.len(), layout.file_len());
        assert_eq!(layout.regions.len(), 2);
        // Written: pages 0, 1 and the last of region one, the first of region two and
        // its last, partial one (100 bytes).
        assert_eq!(layout.bytes_written, 4 * 4096 + 100);
        assert!(meta.blocks() * 512 < 64 << 10, "{} blocks", meta.blocks());

        let back = map_memory_file(&p, &layout).unwrap();
        for (addr, bytes) in marks {
            let mut got = vec![0u8; bytes.len()];
            back.read_slice(&mut got, GuestAddress(addr)).unwrap();
            assert_eq!(got, bytes, "at {addr:#x}");
        }
        let mut zeros = vec![1u8; 4096];
        back.read_slice(&mut zeros, GuestAddress(0x10_0000))
            .unwrap();
        assert!(zeros.iter().all(|&b| b == 0));
        // A write to the mapping is the mapping's own: the file and a second mapping
        // keep the snapshot's bytes.
        back.write_slice(b"changed", GuestAddress(0)).unwrap();
        let again = map_memory_file(&p, &layout).unwrap();
        let mut got = [0u8; 10];
        again.read_slice(&mut got, GuestAddress(0)).unwrap();
        assert_eq!(&got, b"first byte");
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn a_file_that_is_not_the_layouts_is_refused() {
        let mem = GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 20)]).unwrap();
        let p = path("short");
        let layout = write_memory_file(&mem, &p).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let e = map_memory_file(&p, &layout).unwrap_err().to_string();
        assert!(
            e.contains("4096 bytes long") && e.contains("1048576"),
            "{e}"
        );
        let _ = std::fs::remove_file(&p);
        let e = map_memory_file(&p, &layout).unwrap_err().to_string();
        assert!(e.contains("No such file"), "{e}");
    }
}
