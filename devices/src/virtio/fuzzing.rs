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
//!
//! Devices with a worker of their own (net, vsock) run as their worker would: started,
//! each queue notified, then the events of their host descriptors (a socket standing in
//! for the tap; vsock's Unix sockets) served until none is left, with the fuzzed queue
//! in one role and, for vsock, a well-formed receive queue of [`HELPER_BUFFERS`] at
//! [`HELPER`] so that what the device answers is delivered.

use std::fs::File;
use std::io::Write;
use std::os::fd::OwnedFd;
use std::os::unix::net::{UnixDatagram, UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::{Bytes, GuestAddress, GuestMemoryMmap};
use vmm_sys_util::epoll::{Epoll, EpollEvent};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use super::block::overlay::Overlay;
use super::worker::{QueueHandler, WorkerContext};
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
/// Where the helper queue lives (over the top of the data): its descriptor table, then
/// its available ring at +0x100, its used ring at +0x200, its buffers from +0x1000.
pub const HELPER: u64 = 0xe000;
/// Buffers of the helper queue, 512 bytes each, all offered.
pub const HELPER_BUFFERS: u16 = 8;

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

    /// The rig again after a worker had its queue: the queue rebuilt from `state`.
    fn again(
        mem: GuestMemoryMmap,
        interrupt: Arc<VirtioInterrupt>,
        state: QueueState,
    ) -> Option<Self> {
        Some(Self {
            mem,
            queue: Queue::try_from(state).ok()?,
            interrupt,
        })
    }

    /// The available ring's index (how many chains the driver offered, mod 2^16).
    pub fn avail_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(AVAIL_RING + 2)).unwrap_or(0)
    }

    /// The driver's side of the queue as it stands: the descriptor table and the available
    /// ring (all memory below [`USED_RING`]). A device changes it only where a
    /// device-writable buffer the driver gave points into it.
    pub fn driver_area(&self) -> Vec<u8> {
        let mut area = vec![0u8; USED_RING as usize];
        self.mem
            .read_slice(&mut area, GuestAddress(DESC_TABLE))
            .map(|()| area)
            .unwrap_or_default()
    }

    /// The used ring's index (how many chains the device returned, mod 2^16).
    pub fn used_idx(&self) -> u16 {
        self.mem.read_obj(GuestAddress(USED_RING + 2)).unwrap_or(0)
    }

    /// Hands the queue to a device's queue work and takes it back.
    fn process(
        self,
        work: impl FnOnce(&GuestMemoryMmap, Queue, &Arc<VirtioInterrupt>) -> Queue,
    ) -> Self {
        let queue = work(&self.mem, self.queue, &self.interrupt);
        Rig { queue, ..self }
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
    rig.process(|mem, queue, interrupt| {
        super::block::fuzz_process(Some(file), overlay, DISK_SECTORS, mem, queue, interrupt)
    })
}

/// Runs virtio-rng's queue work once over `rig`.
pub fn rng(rig: Rig) -> Rig {
    rig.process(super::rng::fuzz_process)
}

/// A well-formed queue at [`HELPER`]: [`HELPER_BUFFERS`] device-writable 512-byte
/// buffers, all offered.
fn helper_queue(mem: &GuestMemoryMmap) -> Option<Queue> {
    const WRITE: u16 = 2;
    for i in 0..HELPER_BUFFERS {
        let addr = HELPER + 0x1000 + 512 * u64::from(i);
        let mut d = [0u8; 16];
        d[..8].copy_from_slice(&addr.to_le_bytes());
        d[8..12].copy_from_slice(&512u32.to_le_bytes());
        d[12..14].copy_from_slice(&WRITE.to_le_bytes());
        mem.write_slice(&d, GuestAddress(HELPER + 16 * u64::from(i)))
            .ok()?;
        mem.write_obj(i, GuestAddress(HELPER + 0x104 + 2 * u64::from(i)))
            .ok()?;
    }
    mem.write_obj(0u16, GuestAddress(HELPER + 0x100)).ok()?;
    mem.write_obj(HELPER_BUFFERS, GuestAddress(HELPER + 0x102))
        .ok()?;
    mem.write_slice(&[0; 4], GuestAddress(HELPER + 0x200))
        .ok()?;
    let mut q = Queue::new(256).ok()?;
    q.set_size(HELPER_BUFFERS);
    q.set_desc_table_address(Some(HELPER as u32), Some(0));
    q.set_avail_ring_address(Some(HELPER as u32 + 0x100), Some(0));
    q.set_used_ring_address(Some(HELPER as u32 + 0x200), Some(0));
    q.set_ready(true);
    q.is_valid(mem).then_some(q)
}

/// A queue the driver never set up.
fn unready() -> Option<Queue> {
    Queue::new(256).ok()
}

/// Runs `handler` as its worker would: start, every queue notified once, then its own
/// descriptors' events (and every queue again after each batch) until none is ready, at
/// most `rounds` batches.
fn drive(handler: &mut impl QueueHandler, queues: usize, rounds: usize) {
    let Ok(epoll) = Epoll::new() else { return };
    let ctx = WorkerContext::new(&epoll);
    handler.start(&ctx);
    let notify_all = |handler: &mut dyn QueueHandler| {
        for q in 0..queues {
            handler.queue_event(q, &ctx);
        }
    };
    notify_all(handler);
    for _ in 0..rounds {
        let mut events = [EpollEvent::default(); 16];
        let n = epoll.wait(0, &mut events).unwrap_or(0);
        if n == 0 {
            break;
        }
        for e in &events[..n] {
            handler.handler_event(e.data(), e.event_set(), &ctx);
        }
        notify_all(handler);
    }
}

/// Runs virtio-net's worker over `rig`'s memory with the fuzzed queue as the receive
/// queue (`rx`) or the transmit queue, its tap a datagram socket that already holds
/// `frames` for the guest. Returns `rig`.
pub fn net(rig: Rig, rx: bool, frames: &[&[u8]]) -> Option<Rig> {
    let (tap, wire) = UnixDatagram::pair().ok()?;
    tap.set_nonblocking(true).ok()?;
    wire.set_nonblocking(true).ok()?;
    for f in frames {
        let _ = wire.send(f);
    }
    let other = unready()?;
    let fuzzed = usize::from(!rx);
    let Rig {
        mem,
        queue,
        interrupt,
    } = rig;
    let queues = if rx { [queue, other] } else { [other, queue] };
    let worker =
        super::net::fuzz_worker(mem.clone(), queues, interrupt.clone(), OwnedFd::from(tap));
    let mut worker = worker?;
    drive(&mut worker, 2, 8);
    Rig::again(mem, interrupt, worker.queue_states().swap_remove(fuzzed))
}

/// What the host side of a fuzzed vsock device does before the worker runs.
#[derive(Debug, Default, Clone, Copy)]
pub struct VsockHost<'a> {
    /// Bytes a host program writes after connecting to the device's socket (a
    /// `CONNECT <port>` line and data, or garbage); None: no host connects.
    pub connects: Option<&'a [u8]>,
    /// The host closes its end after writing.
    pub closes: bool,
    /// The device is a clone's (it owes the driver a transport reset first).
    pub restored: bool,
}

/// The host port a program listens on for the guest: port [`VSOCK_PORT`] reaches it.
pub const VSOCK_PORT: u32 = 1234;

fn vsock_paths() -> PathBuf {
    static RUN: AtomicU64 = AtomicU64::new(0);
    let n = RUN.fetch_add(1, Ordering::Relaxed);
    std::env::temp_dir().join(format!("forkvm-fuzz-vsock-{}-{n}", std::process::id()))
}

/// Removes the socket files of one run.
struct Unlink(Vec<PathBuf>);

impl Drop for Unlink {
    fn drop(&mut self) {
        for p in &self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn listen(path: &Path) -> Option<UnixListener> {
    let l = UnixListener::bind(path).ok()?;
    l.set_nonblocking(true).ok()?;
    Some(l)
}

/// Runs virtio-vsock's worker over `rig`'s memory with the fuzzed queue as the receive
/// queue (`rx`; nothing is sent) or the transmit queue (the receive queue is the
/// helper's), a host program listening on port [`VSOCK_PORT`] and `host` as the host
/// side. Returns `rig`.
pub fn vsock(rig: Rig, rx: bool, host: VsockHost<'_>) -> Option<Rig> {
    let path = vsock_paths();
    let port_path = PathBuf::from(format!("{}_{VSOCK_PORT}", path.display()));
    let _unlink = Unlink(vec![path.clone(), port_path.clone()]);
    let listener = listen(&path)?;
    let program = listen(&port_path)?;
    let client = host.connects.and_then(|bytes| {
        let mut c = UnixStream::connect(&path).ok()?;
        c.set_nonblocking(true).ok()?;
        let _ = c.write_all(bytes);
        if host.closes {
            let _ = c.shutdown(std::net::Shutdown::Write);
        }
        Some(c)
    });
    let Rig {
        mem,
        queue,
        interrupt,
    } = rig;
    let fuzzed = usize::from(!rx);
    let [q_rx, q_tx] = if rx {
        [queue, unready()?]
    } else {
        [helper_queue(&mem)?, queue]
    };
    let mut worker = super::vsock::fuzz_worker(
        path.clone(),
        listener,
        mem.clone(),
        [q_rx, q_tx, unready()?],
        interrupt.clone(),
        host.restored,
    );
    drive(&mut worker, 3, 16);
    // The connections the program was offered, and the host's end, close here.
    while program.accept().is_ok() {}
    drop(client);
    Rig::again(mem, interrupt, worker.queue_states().swap_remove(fuzzed))
}
