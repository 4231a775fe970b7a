//! Entry points for the fuzz targets (`fuzz/`, feature `fuzzing`): a device's queue work
//! run once, synchronously, on guest memory and a split queue that the fuzzer's input
//! laid out. Not part of the crate's API otherwise.
//!
//! Layout: guest memory of [`MEM_BYTES`] with the descriptor table at [`DESC_TABLE`], the
//! available ring at [`AVAIL_RING`], the used ring at [`USED_RING`] and buffers from
//! [`DATA`]. The input fills them in this order, so that a short input already offers
//! chains: the available ring's index (u16), its entries (u16 each, one per queue
//! entry), the descriptors (16 bytes each: address, length, flags, next), then the data.
//! A descriptor's address is taken modulo twice the memory, so half of them point
//! outside it; lengths, flags and links are as given (chains may loop or claim any
//! length).

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
/// Where the data goes.
pub const DATA: u64 = 0x3000;

/// Guest memory and a queue on it, as a driver left them.
pub struct Rig {
    /// The guest's memory.
    pub mem: GuestMemoryMmap,
    /// The queue, ready.
    pub queue: Queue,
    pub(crate) interrupt: Arc<VirtioInterrupt>,
}

impl Rig {
    /// Memory laid out from `input` (see the module) and a queue of `size` entries (with
    /// `VIRTIO_F_EVENT_IDX` when `event_idx`); None when the queue is not one a transport
    /// would accept (a size that is no power of two up to 256).
    pub fn new(input: &[u8], size: u16, event_idx: bool) -> Option<Self> {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), MEM_BYTES)]).ok()?;
        let mut input = input;
        let mut take = |n: usize| {
            let (head, rest) = input.split_at(n.min(input.len()));
            input = rest;
            head
        };
        let idx = take(2);
        mem.write_slice(idx, GuestAddress(AVAIL_RING + 2)).ok()?;
        let ring = take(2 * usize::from(size));
        mem.write_slice(ring, GuestAddress(AVAIL_RING + 4)).ok()?;
        for i in 0..u64::from(size) {
            let d = take(16);
            if d.is_empty() {
                break;
            }
            let mut raw = [0u8; 16];
            raw[..d.len()].copy_from_slice(d);
            let addr = u64::from_le_bytes(raw[..8].try_into().ok()?) % (2 * MEM_BYTES as u64);
            raw[..8].copy_from_slice(&addr.to_le_bytes());
            mem.write_slice(&raw, GuestAddress(DESC_TABLE + 16 * i))
                .ok()?;
        }
        let data = take(MEM_BYTES - DATA as usize);
        mem.write_slice(data, GuestAddress(DATA)).ok()?;
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
