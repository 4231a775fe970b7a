//! Entry points for the fuzz targets (`fuzz/`, feature `fuzzing`): a device's queue work
//! run once, synchronously, on guest memory and a split queue that the fuzzer's input
//! laid out. Not part of the crate's API otherwise.
//!
//! Layout: guest memory of [`MEM_BYTES`], the input's bytes from address 0 (the rest
//! zero); the descriptor table at [`DESC_TABLE`], the available ring at [`AVAIL_RING`],
//! the used ring at [`USED_RING`], buffers anywhere (descriptors may point outside
//! memory, loop, or claim any length).

use std::fs::File;
use std::sync::{Arc, Mutex, OnceLock};

use virtio_queue::{Queue, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::block::overlay::Overlay;
use super::VirtioInterrupt;

/// Bytes of guest memory.
pub const MEM_BYTES: usize = 64 << 10;
/// The descriptor table's address.
pub const DESC_TABLE: u64 = 0;
/// The available ring's address.
pub const AVAIL_RING: u64 = 0x1000;
/// The used ring's address.
pub const USED_RING: u64 = 0x2000;

/// Guest memory and a queue on it, as a driver left them.
pub struct Rig {
    /// The guest's memory.
    pub mem: GuestMemoryMmap,
    /// The queue, ready.
    pub queue: Queue,
    pub(crate) interrupt: Arc<VirtioInterrupt>,
}

impl Rig {
    /// Memory from `image` and a queue of `size` entries (with `VIRTIO_F_EVENT_IDX` when
    /// `event_idx`); None when the queue is not one a transport would accept (a size
    /// that is no power of two up to 256, rings outside memory).
    pub fn new(image: &[u8], size: u16, event_idx: bool) -> Option<Self> {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_BYTES)]).ok()?;
        mem.write_slice(&image[..image.len().min(MEM_BYTES)], GuestAddress(0))
            .ok()?;
        let mut queue = Queue::new(256).ok()?;
        queue.set_size(size);
        queue.set_desc_table_address(Some(DESC_TABLE as u32), Some(0));
        queue.set_avail_ring_address(Some(AVAIL_RING as u32), Some(0));
        queue.set_used_ring_address(Some(USED_RING as u32), Some(0));
        queue.set_event_idx(event_idx);
        queue.set_ready(true);
        if !queue.is_valid(&mem) {
            return None;
        }
        let irq = EventFd::new(EFD_NONBLOCK).ok()?;
        Some(Self {
            mem,
            queue,
            interrupt: Arc::new(VirtioInterrupt::new(irq)),
        })
    }

    /// The available ring's index (how many chains the driver offered, mod 2^16).
    pub fn avail_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(AVAIL_RING + 2)).unwrap_or(0)
    }

    /// The used ring's index (how many chains the device returned, mod 2^16).
    pub fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED_RING + 2)).unwrap_or(0)
    }
}

/// Sectors of the fuzzed disk.
pub const DISK_SECTORS: u64 = 64;

fn disk() -> Option<Arc<File>> {
    static DISK: OnceLock<Option<Arc<File>>> = OnceLock::new();
    DISK.get_or_init(|| {
        let path = std::env::temp_dir().join(format!("forkvm-fuzz-disk-{}", std::process::id()));
        std::fs::write(&path, vec![0x5a; (DISK_SECTORS * 512) as usize]).ok()?;
        let file = File::open(&path).ok();
        let _ = std::fs::remove_file(&path);
        file.map(Arc::new)
    })
    .clone()
}

fn overlay() -> Option<Arc<Mutex<Overlay>>> {
    static OVERLAY: OnceLock<Option<Arc<Mutex<Overlay>>>> = OnceLock::new();
    OVERLAY
        .get_or_init(|| {
            let o = Overlay::create(&std::env::temp_dir(), DISK_SECTORS * 512).ok()?;
            Some(Arc::new(Mutex::new(o)))
        })
        .clone()
}

/// Runs virtio-blk's queue work once over `rig` (a 64-sector disk, read-only, or
/// writable through a copy-on-write overlay when `writable`).
pub fn blk(rig: Rig, writable: bool) -> Rig {
    let Some(file) = disk() else { return rig };
    let overlay = if writable { overlay() } else { None };
    super::block::fuzz_process(file, overlay, rig)
}

/// Runs virtio-rng's queue work once over `rig`.
pub fn rng(rig: Rig) -> Rig {
    super::rng::fuzz_process(rig)
}
