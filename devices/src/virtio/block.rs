//! virtio-blk: a disk image backed by a host file, served by the transport's worker
//! thread. Read-only, or writable through a private copy-on-write [`overlay`] (the
//! image itself is never written). A **disk slot** is a disk with no medium (0
//! sectors, every read an I/O error) into which a clone's VMM inserts an image as it
//! makes the clone ([`Medium::Inserted`]), or a running VM's VMM through its
//! [`MediumHandle`] (which also ejects it); the guest learns of it from a
//! configuration-change interrupt (`MmioTransport::notify_config_change`).

pub mod overlay;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::{Arc, Mutex, RwLock};

use overlay::Overlay;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueOwnedT, QueueT};
use vm_memory::{ByteValued, GuestMemoryMmap};

use super::worker::QueueHandler;
use super::{ActivateError, VirtioDevice, VirtioDeviceState, VirtioInterrupt, VIRTIO_F_VERSION_1};
use crate::persist::Persist;
use crate::rate_limiter::{LimiterReport, LimiterStats, RateLimit, RateLimiter};

/// virtio device id of a block device.
pub const TYPE_BLOCK: u32 = virtio_bindings::virtio_ids::VIRTIO_ID_BLOCK;
const SECTOR_SIZE: u64 = 512;
const QUEUE_SIZE: u16 = 256;
use virtio_bindings::virtio_blk::{
    VIRTIO_BLK_T_FLUSH, VIRTIO_BLK_T_GET_ID, VIRTIO_BLK_T_IN, VIRTIO_BLK_T_OUT,
};
const VIRTIO_BLK_F_RO: u64 = 1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_RO;
const VIRTIO_BLK_F_FLUSH: u64 = 1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_FLUSH;
const VIRTIO_BLK_F_SEG_MAX: u64 = 1 << virtio_bindings::virtio_blk::VIRTIO_BLK_F_SEG_MAX;
/// The most data segments a request may have (`seg_max`). Without it the guest's driver
/// sends one segment a request: a 128 KiB readahead became 32 requests, and each costs
/// an interrupt in the guest kernel (reading a 2 MB binary took 407 requests and about
/// a second on the PVM host). The device reads any chain; two descriptors of the queue
/// go to the header and the status.
const SEG_MAX: u32 = QUEUE_SIZE as u32 - 2;
const VIRTIO_BLK_S_OK: u8 = virtio_bindings::virtio_blk::VIRTIO_BLK_S_OK as u8;
const VIRTIO_BLK_S_IOERR: u8 = virtio_bindings::virtio_blk::VIRTIO_BLK_S_IOERR as u8;
const VIRTIO_BLK_S_UNSUPP: u8 = virtio_bindings::virtio_blk::VIRTIO_BLK_S_UNSUPP as u8;
const ID_BYTES: usize = 20;

/// Errors opening a disk image.
#[derive(Debug, thiserror::Error)]
pub enum BlockError {
    /// The image cannot be opened or measured.
    #[error("cannot open disk image {path}: {source}")]
    Open {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Its size is not a whole number of 512-byte sectors.
    #[error("disk image {path} is {size} bytes, not a multiple of 512")]
    Size {
        /// The path.
        path: String,
        /// Its size.
        size: u64,
    },
    /// The image is not the one the saved state was of.
    #[error("disk image {path} does not match the saved disk: {why}")]
    Changed {
        /// The path.
        path: String,
        /// What differs.
        why: String,
    },
}

/// A disk's own state (its queue is its transport's; a writable disk's overlay is
/// copied for a clone apart from this, while the disk is parked).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockState {
    /// The serial the guest reads (`forkvm-disk<N>`).
    pub id: String,
    /// Capacity in 512-byte sectors, as the guest's driver read it.
    pub sectors: u64,
    /// Whether the guest's writes go to an overlay (else they are refused).
    pub writable: bool,
    /// A disk slot the guest was shown as writable (its VM has a slot overlay
    /// directory): its media may be writable, and a read-only one refuses writes.
    #[serde(default)]
    pub writable_slot: bool,
}

/// The medium a restored disk is made with.
pub enum Medium {
    /// The saved disk's own image, open (a clone's inherited descriptor): it must be
    /// as large as the saved one.
    Saved(File),
    /// None: a disk slot left empty (the saved one must have been empty too).
    Empty,
    /// A new image for a disk slot, of any whole number of sectors: read-only, or
    /// writable through an overlay in a writable slot.
    Inserted(File),
}

/// What a disk is made with.
pub struct BlockArgs {
    /// Its medium.
    pub medium: Medium,
    /// The image's name in errors.
    pub shown: String,
    /// The writable disk's overlay (a clone's copy of its parent's).
    pub overlay: Option<Overlay>,
    /// The disk's rate limit (a clone's may differ from its template's).
    pub limit: Option<RateLimit>,
}

impl BlockState {
    /// Capacity in bytes.
    pub fn size(&self) -> u64 {
        self.sectors * SECTOR_SIZE
    }
}

impl Persist for Block {
    type State = BlockState;
    type ConstructorArgs = BlockArgs;
    type Error = BlockError;

    fn save(&self) -> BlockState {
        let end = self.id.iter().position(|b| *b == 0).unwrap_or(ID_BYTES);
        BlockState {
            id: String::from_utf8_lossy(&self.id[..end]).into_owned(),
            sectors: self.sectors(),
            writable: self.overlay().is_some(),
            writable_slot: self.writable_slot,
        }
    }

    /// The disk over `args.medium`: the saved image, which must be as large as the
    /// saved one and writable (with an overlay) if it was; an empty slot, which must
    /// have been empty; or a new image inserted into a slot, read-only, or writable
    /// (with an overlay) in a writable slot.
    fn restore(args: BlockArgs, state: &BlockState) -> Result<Self, BlockError> {
        let changed = |why: String| BlockError::Changed {
            path: args.shown.clone(),
            why,
        };
        let slot = state.writable_slot;
        let file = match args.medium {
            Medium::Saved(file) => file,
            Medium::Empty if state.sectors == 0 && !state.writable => {
                let block = Self::empty(&state.id).with_writable_slot(slot);
                return Ok(block.with_rate_limit(args.limit));
            }
            Medium::Empty => return Err(changed("the saved disk had a medium".into())),
            Medium::Inserted(file) => {
                if args.overlay.is_some() && !slot {
                    return Err(changed("the slot is read-only (no slot overlays)".into()));
                }
                let block = Self::from_file(file, &args.shown, &state.id)?;
                let block = block.with_writable_slot(slot).with_rate_limit(args.limit);
                return Ok(match args.overlay {
                    Some(o) => block.with_overlay(o),
                    None => block,
                });
            }
        };
        let block = Self::from_file(file, &args.shown, &state.id)?.with_writable_slot(slot);
        if block.sectors() != state.sectors {
            return Err(changed(format!(
                "{} sectors, the saved disk had {}",
                block.sectors(),
                state.sectors
            )));
        }
        if state.writable != args.overlay.is_some() {
            return Err(changed(format!("saved writable: {}", state.writable)));
        }
        let block = block.with_rate_limit(args.limit);
        Ok(match args.overlay {
            Some(o) => block.with_overlay(o),
            None => block,
        })
    }
}

/// The sectors of the image open as `file` (`shown` names it in errors): its size must
/// be a whole number of 512-byte sectors.
pub fn image_sectors(file: &File, shown: &str) -> Result<u64, BlockError> {
    let size = file
        .metadata()
        .map_err(|source| BlockError::Open {
            path: shown.to_string(),
            source,
        })?
        .len();
    if size % SECTOR_SIZE != 0 {
        return Err(BlockError::Size {
            path: shown.to_string(),
            size,
        });
    }
    Ok(size / SECTOR_SIZE)
}

#[derive(Clone, Copy, Default)]
#[repr(C)]
struct RequestHeader {
    type_: u32,
    _reserved: u32,
    sector: u64,
}
// SAFETY: plain old data with no padding (u32, u32, u64), valid for any bit pattern.
unsafe impl ByteValued for RequestHeader {}

/// What a disk has in it: the image, its overlay if writable, its capacity.
#[derive(Clone, Default)]
struct Loaded {
    /// The image (None: an empty slot, of 0 sectors).
    file: Option<Arc<File>>,
    overlay: Option<Arc<Mutex<Overlay>>>,
    sectors: u64,
}

fn read(m: &RwLock<Loaded>) -> std::sync::RwLockReadGuard<'_, Loaded> {
    m.read().unwrap_or_else(|p| p.into_inner())
}

fn write(m: &RwLock<Loaded>) -> std::sync::RwLockWriteGuard<'_, Loaded> {
    m.write().unwrap_or_else(|p| p.into_inner())
}

/// Why a medium cannot be inserted into or ejected from a running slot.
#[derive(Debug, thiserror::Error)]
pub enum MediumError {
    /// The slot holds a medium already.
    #[error("the slot holds a medium already (eject it first)")]
    Full,
    /// The slot is empty.
    #[error("the slot is empty")]
    Empty,
    /// A writable medium in a slot the guest was shown as read-only.
    #[error("the slot is read-only (the VM has no slot overlay directory)")]
    ReadOnlySlot,
    /// The image has no sectors, or not a whole number of them.
    #[error("{0}")]
    Image(#[from] BlockError),
    /// An empty image.
    #[error("{0} is empty (0 sectors)")]
    EmptyImage(String),
}

/// The handle a VMM changes a disk slot's medium through while the VM runs: the
/// device's worker takes the new medium with its next requests. The guest is told by a
/// configuration-change interrupt, which is the caller's to raise.
#[derive(Clone)]
pub struct MediumHandle {
    medium: Arc<RwLock<Loaded>>,
    writable_slot: bool,
}

impl MediumHandle {
    /// Puts `file` (named `shown` in errors) into the empty slot: read-only, or
    /// writable through `overlay` in a slot shown as writable.
    pub fn insert(
        &self,
        file: File,
        shown: &str,
        overlay: Option<Overlay>,
    ) -> Result<(), MediumError> {
        if overlay.is_some() && !self.writable_slot {
            return Err(MediumError::ReadOnlySlot);
        }
        let sectors = image_sectors(&file, shown)?;
        if sectors == 0 {
            return Err(MediumError::EmptyImage(shown.to_string()));
        }
        let mut m = write(&self.medium);
        if m.file.is_some() {
            return Err(MediumError::Full);
        }
        *m = Loaded {
            file: Some(Arc::new(file)),
            overlay: overlay.map(|o| Arc::new(Mutex::new(o))),
            sectors,
        };
        Ok(())
    }

    /// Empties the slot: requests from now on fail, as an empty slot's do. Requests a
    /// worker is serving finish on the old medium.
    pub fn eject(&self) -> Result<(), MediumError> {
        let mut m = write(&self.medium);
        if m.file.is_none() {
            return Err(MediumError::Empty);
        }
        *m = Loaded::default();
        Ok(())
    }

    /// The medium's image and overlay, if any.
    pub fn current(&self) -> (Option<Arc<File>>, Option<Arc<Mutex<Overlay>>>) {
        let m = read(&self.medium);
        (m.file.clone(), m.overlay.clone())
    }
}

/// A virtio-blk device: read-only, or writable through an overlay; or a disk slot
/// with no medium.
pub struct Block {
    /// The medium, shared with the worker (a slot's may change while the VM runs:
    /// [`MediumHandle`]).
    medium: Arc<RwLock<Loaded>>,
    /// A slot shown as writable ([`Block::with_writable_slot`]).
    writable_slot: bool,
    id: [u8; ID_BYTES],
    queue_sizes: [u16; 1],
    limit: Option<RateLimit>,
    /// Its limiter's counters (each worker's limiter counts into them).
    stats: Arc<LimiterStats>,
}

impl Block {
    /// Opens `path` read-only. `id` (up to 20 bytes) is what the guest reads as serial.
    pub fn open(path: &Path, id: &str) -> Result<Self, BlockError> {
        let file = File::open(path).map_err(|source| BlockError::Open {
            path: path.display().to_string(),
            source,
        })?;
        Self::from_file(file, &path.display().to_string(), id)
    }

    /// A device over an image already open (a clone's inherited descriptor); `shown`
    /// names it in errors.
    pub fn from_file(file: File, shown: &str, id: &str) -> Result<Self, BlockError> {
        let sectors = image_sectors(&file, shown)?;
        let block = Self::empty(id);
        *write(&block.medium) = Loaded {
            file: Some(Arc::new(file)),
            overlay: None,
            sectors,
        };
        Ok(block)
    }

    /// A disk slot with no medium: 0 sectors, read-only; `id` as in [`Block::open`].
    pub fn empty(id: &str) -> Self {
        let mut idb = [0u8; ID_BYTES];
        let n = id.len().min(ID_BYTES);
        idb[..n].copy_from_slice(&id.as_bytes()[..n]);
        Self {
            medium: Arc::default(),
            id: idb,
            queue_sizes: [QUEUE_SIZE],
            limit: None,
            stats: Arc::default(),
            writable_slot: false,
        }
    }

    /// Shows a disk slot to the guest as writable (no read-only feature), so that a
    /// medium inserted later may be writable (the guest's driver reads the feature
    /// once, when it probes the device); a read-only medium in it refuses writes.
    pub fn with_writable_slot(mut self, writable: bool) -> Self {
        self.writable_slot = writable;
        self
    }

    /// Makes the disk writable: writes go to `overlay`, never to the image.
    pub fn with_overlay(self, overlay: Overlay) -> Self {
        write(&self.medium).overlay = Some(Arc::new(Mutex::new(overlay)));
        self
    }

    /// The overlay, if the disk is writable (the VMM snapshots it for clones while
    /// the device is parked).
    pub fn overlay(&self) -> Option<Arc<Mutex<Overlay>>> {
        read(&self.medium).overlay.clone()
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.sectors() * SECTOR_SIZE
    }

    /// Limits the device's requests (bytes read, and requests of any kind).
    pub fn with_rate_limit(mut self, limit: Option<RateLimit>) -> Self {
        self.limit = limit;
        self
    }

    /// Capacity in 512-byte sectors.
    pub fn sectors(&self) -> u64 {
        read(&self.medium).sectors
    }

    /// The open image (a clone keeps this descriptor instead of opening the file again);
    /// None for an empty slot.
    pub fn file(&self) -> Option<Arc<File>> {
        read(&self.medium).file.clone()
    }

    /// The handle that changes a slot's medium while the VM runs.
    pub fn medium_handle(&self) -> MediumHandle {
        MediumHandle {
            medium: self.medium.clone(),
            writable_slot: self.writable_slot,
        }
    }
}

impl VirtioDevice for Block {
    fn state(&self) -> VirtioDeviceState {
        VirtioDeviceState::Block(self.save())
    }

    fn name(&self) -> &'static str {
        "virtio-blk"
    }

    fn device_type(&self) -> u32 {
        TYPE_BLOCK
    }

    fn avail_features(&self) -> u64 {
        let ro = if self.overlay().is_some() || self.writable_slot {
            0
        } else {
            VIRTIO_BLK_F_RO
        };
        VIRTIO_F_VERSION_1 | ro | VIRTIO_BLK_F_FLUSH | VIRTIO_BLK_F_SEG_MAX
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // `capacity` (u64 at offset 0) and `seg_max` (u32 at 12); `size_max` (8) is not
        // offered and reads 0.
        let mut cfg = [0u8; 16];
        cfg[..8].copy_from_slice(&self.sectors().to_le_bytes());
        cfg[12..].copy_from_slice(&SEG_MAX.to_le_bytes());
        for (i, b) in data.iter_mut().enumerate() {
            *b = (offset as usize)
                .checked_add(i)
                .and_then(|o| cfg.get(o))
                .copied()
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        tracing::debug!("virtio-blk: guest wrote read-only config at {offset:#x}");
    }

    fn limiter_reports(&self) -> Vec<LimiterReport> {
        super::request_limiter_report(self.limit.as_ref(), &self.stats)
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        _acked_features: u64,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        let queue = super::single_queue(queues, "virtio-blk")?;
        let limiter = super::new_limiter(self.limit.as_ref(), "virtio-blk", &self.stats)?;
        Ok(Box::new(super::Limited(Worker {
            medium: self.medium.clone(),
            cur: Loaded::default(),
            id: self.id,
            mem,
            queue,
            interrupt,
            limiter,
            write_failures: std::cell::Cell::new(0),
        })))
    }
}

struct Worker {
    /// The device's medium.
    medium: Arc<RwLock<Loaded>>,
    /// The medium as the current batch of requests found it.
    cur: Loaded,
    id: [u8; ID_BYTES],
    mem: GuestMemoryMmap,
    queue: Queue,
    interrupt: Arc<VirtioInterrupt>,
    limiter: Option<RateLimiter>,
    /// Writes that failed in the host (a full overlay file system): the first is
    /// logged as a warning, the rest at debug level.
    write_failures: std::cell::Cell<u64>,
}

/// The queue work once over a fuzzer's memory and queue (the fuzzing module's rig), a
/// disk of `sectors`; hands the queue back.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_process(
    file: Option<Arc<File>>,
    overlay: Option<Arc<Mutex<Overlay>>>,
    sectors: u64,
    mem: &GuestMemoryMmap,
    queue: Queue,
    interrupt: &Arc<VirtioInterrupt>,
) -> Queue {
    let mut w = Worker {
        medium: Arc::new(RwLock::new(Loaded {
            file,
            overlay,
            sectors,
        })),
        cur: Loaded::default(),
        id: [b'f'; ID_BYTES],
        mem: mem.clone(),
        queue,
        interrupt: interrupt.clone(),
        limiter: None,
        write_failures: std::cell::Cell::new(0),
    };
    w.process_queue();
    w.queue
}

impl super::LimitedQueue for Worker {
    const NAME: &'static str = "virtio-blk";

    fn process_queue(&mut self) {
        Worker::process_queue(self);
    }

    fn queue(&self) -> &Queue {
        &self.queue
    }

    fn limiter(&mut self) -> Option<&mut RateLimiter> {
        self.limiter.as_mut()
    }
}

impl Worker {
    fn process_queue(&mut self) {
        // A slot's medium may have changed since the last batch.
        self.cur = read(&self.medium).clone();
        let mut used_any = false;
        while let Some(chain) = self.queue.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            if let Some(l) = self.limiter.as_mut() {
                // The request's data: its writable bytes less the status byte (a
                // read), or its readable bytes less the header (a write).
                let written = chain
                    .clone()
                    .writer(&self.mem)
                    .map_or(0, |w| w.available_bytes().saturating_sub(1));
                let read = chain.clone().reader(&self.mem).map_or(0, |r| {
                    r.available_bytes()
                        .saturating_sub(std::mem::size_of::<RequestHeader>())
                });
                let bytes = written + read;
                if !l.consume(bytes as u64) {
                    self.queue.go_to_previous_position();
                    break;
                }
            }
            let written = self.handle(chain);
            super::add_used(&mut self.queue, &self.mem, head, written, "virtio-blk");
            used_any = true;
        }
        if used_any {
            super::notify_used(&mut self.queue, &self.mem, &self.interrupt, "virtio-blk");
        }
    }

    /// Serves one request; returns the bytes written into guest memory.
    fn handle(&self, chain: virtio_queue::DescriptorChain<&GuestMemoryMmap>) -> u32 {
        let Ok(mut reader) = chain.clone().reader(&self.mem) else {
            return 0;
        };
        let Ok(mut writer) = chain.writer(&self.mem) else {
            return 0;
        };
        // The last writable byte is the status; a chain without one cannot be answered.
        let Some(data_len) = writer.available_bytes().checked_sub(1) else {
            return 0;
        };
        let Ok(mut status_writer) = writer.split_at(data_len) else {
            return 0;
        };
        let status = match reader.read_obj::<RequestHeader>() {
            Ok(hdr) => self.execute(hdr, &mut reader, &mut writer, data_len),
            Err(_) => VIRTIO_BLK_S_IOERR,
        };
        let _ = status_writer.write_obj(status);
        (writer.bytes_written() + status_writer.bytes_written()) as u32
    }

    /// The medium (an empty slot has none, and 0 sectors: no request in range reaches
    /// here with data).
    fn medium(&self) -> std::io::Result<&File> {
        (self.cur.file.as_deref()).ok_or_else(|| std::io::Error::other("no medium in the slot"))
    }

    /// Whether `len` bytes at `sector` lie inside the disk.
    fn in_range(&self, sector: u64, len: usize) -> bool {
        sector
            .checked_mul(SECTOR_SIZE)
            .and_then(|o| o.checked_add(len as u64))
            .is_some_and(|e| e <= self.cur.sectors * SECTOR_SIZE)
    }

    fn execute(
        &self,
        hdr: RequestHeader,
        reader: &mut virtio_queue::Reader<'_, ()>,
        writer: &mut virtio_queue::Writer<'_, ()>,
        data_len: usize,
    ) -> u8 {
        use std::io::{Read, Write};
        let ok = |r: std::io::Result<()>| match r {
            Ok(()) => VIRTIO_BLK_S_OK,
            Err(e) => {
                tracing::debug!("virtio-blk: request failed: {e}");
                VIRTIO_BLK_S_IOERR
            }
        };
        match hdr.type_ {
            VIRTIO_BLK_T_IN => {
                if !self.in_range(hdr.sector, data_len) {
                    return VIRTIO_BLK_S_IOERR;
                }
                let mut buf = vec![0u8; data_len.min(DATA_CHUNK)];
                let start = hdr.sector * SECTOR_SIZE;
                ok(in_chunks(start, data_len, |off, len| {
                    let chunk = &mut buf[..len];
                    let file = self.medium()?;
                    match &self.cur.overlay {
                        Some(o) => lock(o).read_at(file, chunk, off),
                        None => file.read_exact_at(chunk, off),
                    }?;
                    writer.write_all(chunk)
                }))
            }
            VIRTIO_BLK_T_OUT => {
                // Read-only device: writes fail.
                let Some(o) = &self.cur.overlay else {
                    return VIRTIO_BLK_S_IOERR;
                };
                let len = reader.available_bytes();
                if !self.in_range(hdr.sector, len) {
                    return VIRTIO_BLK_S_IOERR;
                }
                let mut buf = vec![0u8; len.min(DATA_CHUNK)];
                let written = in_chunks(hdr.sector * SECTOR_SIZE, len, |off, n| {
                    let chunk = &mut buf[..n];
                    reader.read_exact(chunk)?;
                    lock(o).write_at(self.medium()?, chunk, off)
                });
                if let Err(e) = &written {
                    let n = self.write_failures.get() + 1;
                    self.write_failures.set(n);
                    if n == 1 {
                        tracing::warn!(
                            "virtio-blk {}: a write to the overlay failed, the guest gets an \
                             I/O error: {e} (further failures are logged at debug level)",
                            String::from_utf8_lossy(&self.id).trim_end_matches('\0')
                        );
                    }
                }
                ok(written)
            }
            // Flushes make the overlay's writes durable (a read-only disk has none).
            VIRTIO_BLK_T_FLUSH => match &self.cur.overlay {
                Some(o) => ok(lock(o).flush()),
                None => VIRTIO_BLK_S_OK,
            },
            VIRTIO_BLK_T_GET_ID => {
                let n = data_len.min(ID_BYTES);
                match writer.write_all(&self.id[..n]) {
                    Ok(()) => VIRTIO_BLK_S_OK,
                    Err(_) => VIRTIO_BLK_S_IOERR,
                }
            }
            _ => VIRTIO_BLK_S_UNSUPP,
        }
    }
}

/// The most of a request's data the device holds at once: a read or write goes through
/// in pieces of this size. Whole, a guest could have the VMM allocate as much as the
/// disk (its chain's descriptors may cover up to 4 GiB each).
const DATA_CHUNK: usize = 1 << 20;

/// Calls `step(offset, len)` for each [`DATA_CHUNK`] of `len` bytes from disk offset
/// `start` on, until one fails.
fn in_chunks(
    start: u64,
    len: usize,
    mut step: impl FnMut(u64, usize) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let mut done = 0;
    while done < len {
        let n = (len - done).min(DATA_CHUNK);
        step(start + done as u64, n)?;
        done += n;
    }
    Ok(())
}

fn lock(o: &Mutex<Overlay>) -> std::sync::MutexGuard<'_, Overlay> {
    // A panic while holding it leaves the overlay as consistent as the last write.
    o.lock().unwrap_or_else(|p| p.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::{Bytes, GuestAddress};
    use vmm_sys_util::eventfd::EventFd;

    const NEXT: u16 = 1;
    const WRITE: u16 = 2;
    const HDR: u64 = 0x10_0000;
    const DATA: u64 = 0x20_0000;
    const STATUS: u64 = 0x30_0000;

    fn desc(addr: u64, len: u32, flags: u16, next: u16) -> RawDescriptor {
        RawDescriptor::from(SplitDescriptor::new(addr, len, flags, next))
    }

    /// A file removed on drop.
    struct TempFile(std::path::PathBuf);

    impl Drop for TempFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    struct Rig {
        mem: GuestMemoryMmap,
        _disk: TempFile,
        file: Option<Arc<File>>,
        irq: EventFd,
        overlay: Option<Arc<Mutex<Overlay>>>,
    }

    fn rig(sectors: u64) -> Rig {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "forkvm-blk-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        // Sector n is filled with byte n.
        let data: Vec<u8> = (0..sectors * SECTOR_SIZE)
            .map(|i| (i / SECTOR_SIZE) as u8)
            .collect();
        std::fs::write(&path, data).unwrap();
        let block = Block::open(&path, "test-disk").unwrap();
        assert_eq!(block.sectors(), sectors);
        Rig {
            mem: GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x40_0000)]).unwrap(),
            file: block.file(),
            _disk: TempFile(path),
            irq: EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap(),
            overlay: None,
        }
    }

    /// Runs one request chain through a worker; returns (status byte, used length).
    fn run(rig: &Rig, hdr: RequestHeader, descs: &[RawDescriptor]) -> (u8, u32) {
        let medium = Arc::new(RwLock::new(Loaded {
            file: rig.file.clone(),
            overlay: rig.overlay.clone(),
            sectors: (rig.file.as_ref()).map_or(0, |f| f.metadata().unwrap().len() / SECTOR_SIZE),
        }));
        run_on(rig, medium, hdr, descs)
    }

    /// Runs one request chain through a worker over `medium`.
    fn run_on(
        rig: &Rig,
        medium: Arc<RwLock<Loaded>>,
        hdr: RequestHeader,
        descs: &[RawDescriptor],
    ) -> (u8, u32) {
        rig.mem.write_obj(hdr, GuestAddress(HDR)).unwrap();
        rig.mem.write_obj(0xffu8, GuestAddress(STATUS)).unwrap();
        let vq = MockSplitQueue::new(&rig.mem, 16);
        vq.add_desc_chains(descs, 0).unwrap();
        let queue: Queue = vq.create_queue().unwrap();
        let mut w = Worker {
            medium,
            cur: Loaded::default(),
            id: *b"test-disk\0\0\0\0\0\0\0\0\0\0\0",
            mem: rig.mem.clone(),
            queue,
            interrupt: Arc::new(VirtioInterrupt::new(rig.irq.try_clone().unwrap())),
            limiter: None,
            write_failures: Default::default(),
        };
        w.process_queue();
        assert_eq!(w.interrupt.status() & 1, 1, "used-buffer interrupt raised");
        let used = vq.used().ring().ref_at(0).unwrap().load();
        (rig.mem.read_obj(GuestAddress(STATUS)).unwrap(), used.len())
    }

    fn hdr(type_: u32, sector: u64) -> RequestHeader {
        RequestHeader {
            type_,
            _reserved: 0,
            sector,
        }
    }

    #[test]
    fn the_rate_limit_holds_reads_until_the_bucket_refills() {
        let rig = rig(64);
        let vq = MockSplitQueue::new(&rig.mem, 16);
        // Three 1 KiB reads, each: header, data, status.
        let mut descs = Vec::new();
        for i in 0..3u64 {
            let base = 0x10_0000 + i * 0x1_0000;
            rig.mem
                .write_obj(hdr(VIRTIO_BLK_T_IN, 2 * i), GuestAddress(base))
                .unwrap();
            let at = 3 * i as u16;
            descs.push(desc(base, 16, NEXT, at + 1));
            descs.push(desc(base + 0x1000, 1024, NEXT | WRITE, at + 2));
            descs.push(desc(base + 0x2000, 1, WRITE, 0));
        }
        vq.add_desc_chains(&descs, 0).unwrap();
        let mut w = Worker {
            medium: Arc::new(RwLock::new(Loaded {
                file: rig.file.clone(),
                overlay: None,
                sectors: 64,
            })),
            cur: Loaded::default(),
            id: [0; ID_BYTES],
            mem: rig.mem.clone(),
            queue: vq.create_queue().unwrap(),
            interrupt: Arc::new(VirtioInterrupt::new(rig.irq.try_clone().unwrap())),
            limiter: Some(RateLimiter::new(&"bytes=2K/50".parse().unwrap()).unwrap()),
            write_failures: Default::default(),
        };
        w.process_queue();
        assert_eq!(vq.used().idx().load(), 2, "2 KiB at once, then blocked");
        assert!(w.limiter.as_ref().unwrap().is_blocked());
        std::thread::sleep(std::time::Duration::from_millis(40));
        w.limiter.as_mut().unwrap().timer_fired();
        w.process_queue();
        assert_eq!(vq.used().idx().load(), 3);
        // The held request was served whole: sector 4 is filled with 4s.
        let mut data = [0u8; 1024];
        rig.mem
            .read_slice(&mut data, GuestAddress(0x12_1000))
            .unwrap();
        assert_eq!(data[..512], [4u8; 512]);
        assert_eq!(data[512..], [5u8; 512]);
    }

    #[test]
    fn reads_sectors_into_guest_memory() {
        let r = rig(8);
        let chain = [
            desc(HDR, 16, NEXT, 1),
            desc(DATA, 1024, NEXT | WRITE, 2),
            desc(STATUS, 1, WRITE, 0),
        ];
        let (status, len) = run(&r, hdr(VIRTIO_BLK_T_IN, 3), &chain);
        assert_eq!(status, VIRTIO_BLK_S_OK);
        assert_eq!(len, 1025);
        let mut buf = [0u8; 1024];
        r.mem.read_slice(&mut buf, GuestAddress(DATA)).unwrap();
        assert!(buf[..512].iter().all(|b| *b == 3));
        assert!(buf[512..].iter().all(|b| *b == 4));
    }

    #[test]
    fn out_of_range_read_is_an_io_error() {
        let r = rig(4);
        let chain = [
            desc(HDR, 16, NEXT, 1),
            desc(DATA, 1024, NEXT | WRITE, 2),
            desc(STATUS, 1, WRITE, 0),
        ];
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_IN, 3), &chain).0,
            VIRTIO_BLK_S_IOERR
        );
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_IN, u64::MAX), &chain).0,
            VIRTIO_BLK_S_IOERR
        );
    }

    #[test]
    fn writes_are_refused_and_the_image_is_untouched() {
        let r = rig(4);
        r.mem.write_slice(&[0xaa; 512], GuestAddress(DATA)).unwrap();
        let chain = [
            desc(HDR, 16, NEXT, 1),
            desc(DATA, 512, NEXT, 2),
            desc(STATUS, 1, WRITE, 0),
        ];
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_OUT, 0), &chain).0,
            VIRTIO_BLK_S_IOERR
        );
        let mut first = [0u8; 512];
        r.file
            .as_ref()
            .unwrap()
            .read_exact_at(&mut first, 0)
            .unwrap();
        assert!(first.iter().all(|b| *b == 0));
    }

    #[test]
    fn with_an_overlay_writes_land_there_and_reads_see_them_not_the_image() {
        let mut r = rig(16);
        let image = std::fs::read(&r._disk.0).unwrap();
        let o = Overlay::create(&std::env::temp_dir(), 16 * SECTOR_SIZE).unwrap();
        r.overlay = Some(Arc::new(Mutex::new(o)));
        r.mem
            .write_slice(&[0xaa; 1024], GuestAddress(DATA))
            .unwrap();
        let write = [
            desc(HDR, 16, NEXT, 1),
            desc(DATA, 1024, NEXT, 2),
            desc(STATUS, 1, WRITE, 0),
        ];
        assert_eq!(run(&r, hdr(VIRTIO_BLK_T_OUT, 3), &write).0, VIRTIO_BLK_S_OK);
        // Past the end: refused, nothing written.
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_OUT, 15), &write).0,
            VIRTIO_BLK_S_IOERR
        );
        let read = [
            desc(HDR, 16, NEXT, 1),
            desc(DATA, 2048, NEXT | WRITE, 2),
            desc(STATUS, 1, WRITE, 0),
        ];
        r.mem.write_slice(&[0u8; 2048], GuestAddress(DATA)).unwrap();
        assert_eq!(run(&r, hdr(VIRTIO_BLK_T_IN, 2), &read).0, VIRTIO_BLK_S_OK);
        let mut got = vec![0u8; 2048];
        r.mem.read_slice(&mut got, GuestAddress(DATA)).unwrap();
        assert_eq!(got[..512], [2u8; 512], "sector 2 from the image");
        assert_eq!(got[512..1536], [0xaa; 1024], "sectors 3-4 from the overlay");
        assert_eq!(got[1536..], [5u8; 512]);
        let flush = [desc(HDR, 16, NEXT, 1), desc(STATUS, 1, WRITE, 0)];
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_FLUSH, 0), &flush).0,
            VIRTIO_BLK_S_OK
        );
        assert_eq!(std::fs::read(&r._disk.0).unwrap(), image, "image untouched");
    }

    #[test]
    fn requests_longer_than_a_chunk_go_through_in_pieces_whole() {
        // 1.5 MiB over two descriptors: more than DATA_CHUNK, so two pieces each way.
        let mut r = rig(4096);
        let image = std::fs::read(&r._disk.0).unwrap();
        let o = Overlay::create(&std::env::temp_dir(), 4096 * SECTOR_SIZE).unwrap();
        r.overlay = Some(Arc::new(Mutex::new(o)));
        const SECOND: u64 = 0x31_0000;
        let (first_len, second_len) = (1usize << 20, 1usize << 19);
        let data: Vec<u8> = (0..first_len + second_len)
            .map(|i| (i % 251) as u8)
            .collect();
        r.mem
            .write_slice(&data[..first_len], GuestAddress(DATA))
            .unwrap();
        r.mem
            .write_slice(&data[first_len..], GuestAddress(SECOND))
            .unwrap();
        let chain = |flags: u16| {
            [
                desc(HDR, 16, NEXT, 1),
                desc(DATA, first_len as u32, NEXT | flags, 2),
                desc(SECOND, second_len as u32, NEXT | flags, 3),
                desc(STATUS, 1, WRITE, 0),
            ]
        };
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_OUT, 100), &chain(0)).0,
            VIRTIO_BLK_S_OK
        );
        r.mem
            .write_slice(&vec![0u8; first_len], GuestAddress(DATA))
            .unwrap();
        r.mem
            .write_slice(&vec![0u8; second_len], GuestAddress(SECOND))
            .unwrap();
        let (status, used) = run(&r, hdr(VIRTIO_BLK_T_IN, 100), &chain(WRITE));
        assert_eq!((status, used as usize), (VIRTIO_BLK_S_OK, data.len() + 1));
        let mut got = vec![0u8; data.len()];
        r.mem
            .read_slice(&mut got[..first_len], GuestAddress(DATA))
            .unwrap();
        r.mem
            .read_slice(&mut got[first_len..], GuestAddress(SECOND))
            .unwrap();
        assert!(got == data, "the data read back differs");
        // Around it, the image's sectors.
        let around = [
            desc(HDR, 16, NEXT, 1),
            desc(DATA, 1024, NEXT | WRITE, 2),
            desc(STATUS, 1, WRITE, 0),
        ];
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_IN, 99), &around).0,
            VIRTIO_BLK_S_OK
        );
        let mut edge = vec![0u8; 1024];
        r.mem.read_slice(&mut edge, GuestAddress(DATA)).unwrap();
        assert_eq!(edge[..512], [99u8; 512]);
        assert_eq!(edge[512..], data[..512]);
        assert_eq!(std::fs::read(&r._disk.0).unwrap(), image, "image untouched");
    }

    #[test]
    fn in_chunks_covers_the_range_once_in_order_and_stops_at_a_failure() {
        let mut seen = Vec::new();
        in_chunks(10, 2 * DATA_CHUNK + 3, |off, len| {
            seen.push((off, len));
            Ok(())
        })
        .unwrap();
        let c = DATA_CHUNK as u64;
        assert_eq!(
            seen,
            [(10, DATA_CHUNK), (10 + c, DATA_CHUNK), (10 + 2 * c, 3)]
        );
        assert!(in_chunks(0, 0, |_, _| panic!("no chunk of nothing")).is_ok());
        let mut calls = 0;
        let r = in_chunks(0, 3 * DATA_CHUNK, |_, _| {
            calls += 1;
            Err(std::io::Error::other("disk gone"))
        });
        assert!(r.is_err());
        assert_eq!(calls, 1);
    }

    #[test]
    fn flush_get_id_and_unknown_types() {
        let r = rig(1);
        let status_only = [desc(HDR, 16, NEXT, 1), desc(STATUS, 1, WRITE, 0)];
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_FLUSH, 0), &status_only).0,
            VIRTIO_BLK_S_OK
        );
        assert_eq!(run(&r, hdr(99, 0), &status_only).0, VIRTIO_BLK_S_UNSUPP);
        let id_chain = [
            desc(HDR, 16, NEXT, 1),
            desc(DATA, 20, NEXT | WRITE, 2),
            desc(STATUS, 1, WRITE, 0),
        ];
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_GET_ID, 0), &id_chain).0,
            VIRTIO_BLK_S_OK
        );
        let mut id = [0u8; 9];
        r.mem.read_slice(&mut id, GuestAddress(DATA)).unwrap();
        assert_eq!(&id, b"test-disk");
    }

    #[test]
    fn malformed_chains_do_not_panic() {
        let r = rig(1);
        // No writable status byte at all.
        let (status, len) = run(&r, hdr(VIRTIO_BLK_T_IN, 0), &[desc(HDR, 16, 0, 0)]);
        assert_eq!((status, len), (0xff, 0));
        // A header shorter than a request header.
        let short = [desc(HDR, 4, NEXT, 1), desc(STATUS, 1, WRITE, 0)];
        assert_eq!(
            run(&r, hdr(VIRTIO_BLK_T_IN, 0), &short).0,
            VIRTIO_BLK_S_IOERR
        );
        // A descriptor pointing outside guest memory.
        let outside = [
            desc(HDR, 16, NEXT, 1),
            desc(0x1000_0000, 512, NEXT | WRITE, 2),
            desc(STATUS, 1, WRITE, 0),
        ];
        let (_, len) = run(&r, hdr(VIRTIO_BLK_T_IN, 0), &outside);
        assert_eq!(len, 0);
    }

    #[test]
    fn rejects_images_that_are_not_whole_sectors() {
        let path = std::env::temp_dir().join(format!("forkvm-blk-odd-{}", std::process::id()));
        std::fs::write(&path, [0u8; 513]).unwrap();
        let e = Block::open(&path, "x").err().unwrap();
        assert!(matches!(e, BlockError::Size { size: 513, .. }), "{e}");
        std::fs::remove_file(&path).unwrap();
        assert!(matches!(
            Block::open(std::path::Path::new("/nonexistent/disk"), "x"),
            Err(BlockError::Open { .. })
        ));
    }

    #[test]
    fn config_offers_the_capacity_and_seg_max() {
        let rig = rig(8);
        let b =
            Block::from_file(rig.file.as_deref().unwrap().try_clone().unwrap(), "t", "t").unwrap();
        assert_ne!(b.avail_features() & VIRTIO_BLK_F_SEG_MAX, 0);
        let mut cfg = [0xffu8; 24];
        b.read_config(0, &mut cfg);
        assert_eq!(u64::from_le_bytes(cfg[..8].try_into().unwrap()), 8);
        assert_eq!(u32::from_le_bytes(cfg[8..12].try_into().unwrap()), 0);
        assert_eq!(u32::from_le_bytes(cfg[12..16].try_into().unwrap()), SEG_MAX);
        assert_eq!(&cfg[16..], &[0; 8]);
        let mut seg = [0u8; 4];
        b.read_config(12, &mut seg);
        assert_eq!(u32::from_le_bytes(seg), SEG_MAX);
        b.read_config(u64::MAX, &mut seg);
        assert_eq!(seg, [0; 4]);
    }

    #[test]
    fn an_empty_slot_has_no_sectors_answers_its_id_and_fails_reads() {
        let slot = Block::empty("forkvm-slot0");
        assert_eq!((slot.sectors(), slot.file().is_none()), (0, true));
        assert_ne!(slot.avail_features() & VIRTIO_BLK_F_RO, 0, "read-only");
        let mut rig = rig(4);
        rig.file = None;
        // A read of sector 0: out of range.
        let (status, _) = run(
            &rig,
            hdr(VIRTIO_BLK_T_IN, 0),
            &[
                desc(HDR, 16, NEXT, 1),
                desc(DATA, 512, NEXT | WRITE, 2),
                desc(STATUS, 1, WRITE, 0),
            ],
        );
        assert_eq!(status, VIRTIO_BLK_S_IOERR);
        let (status, _) = run(
            &rig,
            hdr(VIRTIO_BLK_T_GET_ID, 0),
            &[
                desc(HDR, 16, NEXT, 1),
                desc(DATA, 20, NEXT | WRITE, 2),
                desc(STATUS, 1, WRITE, 0),
            ],
        );
        assert_eq!(status, VIRTIO_BLK_S_OK);
    }

    #[test]
    fn a_running_slot_takes_a_medium_serves_it_and_gives_it_up() {
        let r = rig(8);
        let image = || r.file.as_ref().unwrap().try_clone().unwrap();
        let slot = Block::empty("forkvm-slot1").with_writable_slot(true);
        let handle = slot.medium_handle();
        let chain = [
            desc(HDR, 16, NEXT, 1),
            desc(DATA, 512, NEXT | WRITE, 2),
            desc(STATUS, 1, WRITE, 0),
        ];
        let read5 = || run_on(&r, slot.medium.clone(), hdr(VIRTIO_BLK_T_IN, 5), &chain).0;
        assert_eq!(read5(), VIRTIO_BLK_S_IOERR, "empty");
        assert!(matches!(handle.eject(), Err(MediumError::Empty)));
        handle.insert(image(), "img", None).unwrap();
        assert_eq!((slot.sectors(), slot.file().is_some()), (8, true));
        assert_eq!(read5(), VIRTIO_BLK_S_OK);
        let mut buf = [0u8; 512];
        r.mem.read_slice(&mut buf, GuestAddress(DATA)).unwrap();
        assert!(buf.iter().all(|b| *b == 5));
        assert!(matches!(
            handle.insert(image(), "img", None),
            Err(MediumError::Full)
        ));
        handle.eject().unwrap();
        assert_eq!((slot.sectors(), slot.file().is_none()), (0, true));
        assert_eq!(read5(), VIRTIO_BLK_S_IOERR, "ejected");
        // Writable: through an overlay, only in a slot shown as writable.
        let overlay = || Overlay::create(&std::env::temp_dir(), 8 * SECTOR_SIZE).unwrap();
        handle.insert(image(), "img", Some(overlay())).unwrap();
        assert!(slot.overlay().is_some() && slot.save().writable);
        let ro = Block::empty("forkvm-slot2").medium_handle();
        assert!(matches!(
            ro.insert(image(), "img", Some(overlay())),
            Err(MediumError::ReadOnlySlot)
        ));
        let empty = tempfile_of(0);
        assert!(matches!(
            ro.insert(empty, "nothing", None),
            Err(MediumError::EmptyImage(_))
        ));
    }

    /// An anonymous file of `len` bytes.
    fn tempfile_of(len: u64) -> File {
        let path = std::env::temp_dir().join(format!("forkvm-blk-empty-{}", std::process::id()));
        let f = File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .unwrap();
        std::fs::remove_file(&path).unwrap();
        f.set_len(len).unwrap();
        f
    }

    #[test]
    fn a_slot_restores_empty_or_with_an_inserted_medium_of_its_own_size() {
        let rig = rig(8);
        let image = || rig.file.as_ref().unwrap().try_clone().unwrap();
        let args = |medium| BlockArgs {
            medium,
            shown: "img".into(),
            overlay: None,
            limit: None,
        };
        let empty = Block::empty("forkvm-slot0").save();
        assert_eq!((empty.sectors, empty.writable), (0, false));
        let b = Block::restore(args(Medium::Empty), &empty).unwrap();
        assert_eq!((b.sectors(), b.save().id.as_str()), (0, "forkvm-slot0"));
        // An inserted medium: its own size, the slot's serial, read-only.
        let b = Block::restore(args(Medium::Inserted(image())), &empty).unwrap();
        assert_eq!((b.sectors(), b.save().id.as_str()), (8, "forkvm-slot0"));
        assert_ne!(b.avail_features() & VIRTIO_BLK_F_RO, 0);
        // The saved disk's own image must keep its size; an empty medium is no image.
        let full = b.save();
        assert!(Block::restore(args(Medium::Saved(image())), &full).is_ok());
        assert!(matches!(
            Block::restore(args(Medium::Saved(image())), &empty),
            Err(BlockError::Changed { .. })
        ));
        assert!(matches!(
            Block::restore(args(Medium::Empty), &full),
            Err(BlockError::Changed { .. })
        ));
        // A writable medium (its overlay) only in a slot shown as writable, which the
        // guest sees without the read-only feature whatever its medium.
        let dir = std::env::temp_dir();
        let overlaid = |medium| BlockArgs {
            overlay: Some(Overlay::create(&dir, 8 * SECTOR_SIZE).unwrap()),
            ..args(medium)
        };
        assert!(matches!(
            Block::restore(overlaid(Medium::Inserted(image())), &empty),
            Err(BlockError::Changed { .. })
        ));
        let rw = Block::empty("forkvm-slot0").with_writable_slot(true).save();
        assert!(rw.writable_slot && !rw.writable);
        let b = Block::restore(args(Medium::Empty), &rw).unwrap();
        assert_eq!(b.avail_features() & VIRTIO_BLK_F_RO, 0);
        let b = Block::restore(overlaid(Medium::Inserted(image())), &rw).unwrap();
        assert!(b.overlay().is_some() && b.save().writable && b.save().writable_slot);
        assert_eq!(b.avail_features() & VIRTIO_BLK_F_RO, 0);
        // A clone of it: the saved medium with its overlay's copy; without a copy the
        // saved state does not match.
        let saved = b.save();
        assert!(Block::restore(overlaid(Medium::Saved(image())), &saved).is_ok());
        assert!(Block::restore(args(Medium::Saved(image())), &saved).is_err());
        // A read-only medium in a writable slot: no overlay, writes refused.
        let b = Block::restore(args(Medium::Inserted(image())), &saved).unwrap();
        assert!(b.overlay().is_none() && b.save().writable_slot);
    }
}
