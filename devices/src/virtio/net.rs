//! virtio-net over a host tap device: frames the guest sends go to the tap, frames the
//! tap delivers go to the guest. No offloads are offered (no checksum or segmentation
//! features), so every frame is a plain Ethernet frame of at most MTU size on both sides
//! and the tap is opened without a vnet header. Each direction may be rate limited.
//!
//! A clone gets its own tap (created by its VMM when it is restored, see the VMM's
//! device manager): the device is rebuilt around the new tap and keeps the queues'
//! state, so the guest's driver carries on without noticing.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueOwnedT, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::epoll::EventSet;

use super::worker::{QueueHandler, WorkerContext, FIRST_HANDLER_TOKEN};
use super::{ActivateError, VirtioDevice, VirtioDeviceState, VirtioInterrupt, VIRTIO_F_VERSION_1};
use crate::persist::Persist;
use crate::rate_limiter::{LimiterStats, RateLimit, RateLimiter};

/// virtio device id of a network card.
pub const TYPE_NET: u32 = virtio_bindings::virtio_ids::VIRTIO_ID_NET;
/// Feature: the device has a MAC address in its configuration space.
pub const VIRTIO_NET_F_MAC: u64 = 1 << virtio_bindings::virtio_net::VIRTIO_NET_F_MAC;
const QUEUE_SIZE: u16 = 256;
const RX: usize = 0;
const TX: usize = 1;
/// `struct virtio_net_hdr_v1` (virtio 1.x always has `num_buffers`).
const HDR_LEN: usize = 12;
/// Largest frame taken from either side (Ethernet with a VLAN tag and a 64 KiB MTU).
const MAX_FRAME: usize = 65_536 + 18;
const TOKEN_TAP: u64 = FIRST_HANDLER_TOKEN;
const TOKEN_RX_LIMITER: u64 = FIRST_HANDLER_TOKEN + 1;
const TOKEN_TX_LIMITER: u64 = FIRST_HANDLER_TOKEN + 2;

/// Errors opening a tap device.
#[derive(Debug, thiserror::Error)]
pub enum TapError {
    /// The name does not fit an interface name (1 to 15 bytes, no '/', ':' or spaces).
    #[error("invalid tap name {0:?}: 1 to 15 characters, none of '/', ':' or white space")]
    Name(String),
    /// `/dev/net/tun` could not be opened.
    #[error("cannot open /dev/net/tun: {0}")]
    Open(std::io::Error),
    /// TUNSETIFF failed (no CAP_NET_ADMIN to create it, or it is in use).
    #[error("cannot attach to tap {name:?}: {source}")]
    Attach {
        /// The tap's name.
        name: String,
        /// The kernel's answer.
        source: std::io::Error,
    },
}

pub use api_types::net::valid_ifname;

/// Opens (creating it if it does not exist, which needs CAP_NET_ADMIN) the tap device
/// `name`, non-blocking, without packet information or a vnet header. A tap the VMM
/// created disappears when the last descriptor to it closes.
pub fn open_tap(name: &str) -> Result<OwnedFd, TapError> {
    if !valid_ifname(name) {
        return Err(TapError::Name(name.to_string()));
    }
    let tun = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_CLOEXEC)
        .open("/dev/net/tun")
        .map_err(TapError::Open)?;
    // SAFETY: an all-zero ifreq is valid.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (d, s) in req.ifr_name.iter_mut().zip(name.bytes()) {
        *d = s as libc::c_char;
    }
    req.ifr_ifru.ifru_flags = (libc::IFF_TAP | libc::IFF_NO_PI) as libc::c_short;
    // SAFETY: TUNSETIFF reads and writes an ifreq, which `req` is, for the duration of
    // the call.
    let r = unsafe { libc::ioctl(tun.as_raw_fd(), libc::TUNSETIFF as _, &mut req) };
    if r < 0 {
        return Err(TapError::Attach {
            name: name.to_string(),
            source: std::io::Error::last_os_error(),
        });
    }
    Ok(tun.into())
}

/// A network card whose other end is `backend` (a tap, or any descriptor that reads and
/// writes one frame per call, such as a datagram socket).
pub struct Net {
    backend: Option<OwnedFd>,
    /// A tap to open by [`VirtioDevice::open_host`] (see [`Net::deferred_tap`]).
    deferred_tap: Option<String>,
    mac: [u8; 6],
    limit: Option<RateLimit>,
    /// The rx and tx limiters' counters (each worker's limiters count into them).
    stats: [Arc<LimiterStats>; 2],
    queue_sizes: [u16; 2],
}

impl Net {
    /// A card with MAC address `mac` over `backend`, each direction limited by `limit`.
    pub fn new(backend: OwnedFd, mac: [u8; 6], limit: Option<RateLimit>) -> Self {
        Self {
            backend: Some(backend),
            deferred_tap: None,
            mac,
            limit,
            stats: Default::default(),
            queue_sizes: [QUEUE_SIZE; 2],
        }
    }

    /// A card over the tap `name`, opened (and created if need be) later by
    /// [`VirtioDevice::open_host`] or on activation. The name is checked now.
    pub fn deferred_tap(
        name: &str,
        mac: [u8; 6],
        limit: Option<RateLimit>,
    ) -> Result<Self, TapError> {
        if !valid_ifname(name) {
            return Err(TapError::Name(name.to_string()));
        }
        Ok(Self {
            backend: None,
            deferred_tap: Some(name.to_string()),
            mac,
            limit,
            stats: Default::default(),
            queue_sizes: [QUEUE_SIZE; 2],
        })
    }
}

/// The network card's own state: its MAC address. A restored card takes the new VM's
/// (a clone has its own), over the new VM's tap.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NetState {
    /// The saved card's MAC address.
    pub mac: [u8; 6],
}

/// What a card is made with.
pub struct NetArgs {
    /// The tap (opened, and created if need be, later by `open_host`).
    pub tap: String,
    /// Its MAC address.
    pub mac: [u8; 6],
    /// Its rate limit, each direction.
    pub limit: Option<RateLimit>,
}

impl Persist for Net {
    type State = NetState;
    type ConstructorArgs = NetArgs;
    type Error = TapError;

    fn save(&self) -> NetState {
        NetState { mac: self.mac }
    }

    fn restore(args: NetArgs, _: &NetState) -> Result<Self, TapError> {
        Self::deferred_tap(&args.tap, args.mac, args.limit)
    }
}

impl VirtioDevice for Net {
    fn state(&self) -> VirtioDeviceState {
        VirtioDeviceState::Net(self.save())
    }

    fn name(&self) -> &'static str {
        "virtio-net"
    }

    fn device_type(&self) -> u32 {
        TYPE_NET
    }

    fn avail_features(&self) -> u64 {
        VIRTIO_F_VERSION_1 | VIRTIO_NET_F_MAC
    }

    fn queue_max_sizes(&self) -> &[u16] {
        &self.queue_sizes
    }

    fn read_config(&self, offset: u64, data: &mut [u8]) {
        // struct virtio_net_config: mac[6], then fields for features not offered.
        for (i, b) in data.iter_mut().enumerate() {
            *b = usize::try_from(offset)
                .ok()
                .and_then(|o| self.mac.get(o + i))
                .copied()
                .unwrap_or(0);
        }
    }

    fn write_config(&mut self, offset: u64, _data: &[u8]) {
        // The MAC is read-only once VIRTIO_F_VERSION_1 is negotiated.
        tracing::debug!("virtio-net: guest wrote config at {offset:#x}; ignored");
    }

    fn open_host(&mut self) -> Result<(), ActivateError> {
        if let Some(name) = self.deferred_tap.as_deref() {
            let tap = open_tap(name).map_err(|e| ActivateError::Host {
                device: "virtio-net",
                source: e.into(),
            })?;
            self.backend = Some(tap);
            self.deferred_tap = None;
        }
        Ok(())
    }

    fn limiter_reports(&self) -> Vec<crate::rate_limiter::LimiterReport> {
        match self.limit {
            Some(_) => vec![self.stats[0].report("rx"), self.stats[1].report("tx")],
            None => Vec::new(),
        }
    }

    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        _acked_features: u64,
        queues: Vec<Queue>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError> {
        self.open_host()?;
        let [rx, tx]: [Queue; 2] = queues
            .try_into()
            .map_err(|q: Vec<Queue>| ActivateError::BadQueue(format!("{} queues", q.len())))?;
        // The worker gets its own descriptor of the tap: the card keeps one, so the driver
        // can reset it and start it again (each reset ends the worker and closes its).
        let backend = self
            .backend
            .as_ref()
            .ok_or_else(|| ActivateError::BadQueue("no tap".into()))?
            .try_clone()
            .map_err(|e| super::WorkerError::Spawn("virtio-net", e))?;
        let limit = self.limit.as_ref().map(|l| (l, &self.stats));
        let worker = NetWorker::new(mem, [rx, tx], interrupt, backend, limit)?;
        Ok(Box::new(worker))
    }
}

pub(crate) struct NetWorker {
    mem: GuestMemoryMmap,
    rx: Queue,
    tx: Queue,
    interrupt: Arc<VirtioInterrupt>,
    backend: File,
    /// False once the backend failed (the tap vanished): frames are dropped.
    backend_ok: bool,
    /// Whether the backend is in the worker's epoll set.
    registered: bool,
    /// Whether the worker waits for the backend to be readable.
    watching: bool,
    /// A frame read from the backend that no rx buffer has taken yet.
    pending: Option<Vec<u8>>,
    rx_limiter: Option<RateLimiter>,
    tx_limiter: Option<RateLimiter>,
    frame: Vec<u8>,
}

impl NetWorker {
    fn new(
        mem: GuestMemoryMmap,
        [rx, tx]: [Queue; 2],
        interrupt: Arc<VirtioInterrupt>,
        backend: OwnedFd,
        limit: Option<(&RateLimit, &[Arc<LimiterStats>; 2])>,
    ) -> Result<Self, super::WorkerError> {
        let limiter = |i: usize| {
            limit
                .map(|(l, stats)| RateLimiter::with_stats(l, stats[i].clone()))
                .transpose()
                .map_err(|e| super::WorkerError::Spawn("virtio-net", e))
        };
        Ok(Self {
            mem,
            rx,
            tx,
            interrupt,
            backend: File::from(backend),
            backend_ok: true,
            registered: false,
            watching: false,
            pending: None,
            rx_limiter: limiter(0)?,
            tx_limiter: limiter(1)?,
            frame: vec![0u8; MAX_FRAME],
        })
    }

    /// Sends what the guest queued on tx to the backend.
    fn process_tx(&mut self) {
        let mut used_any = false;
        if self
            .tx_limiter
            .as_ref()
            .is_some_and(RateLimiter::is_blocked)
        {
            return;
        }
        while let Some(chain) = self.tx.pop_descriptor_chain(&self.mem) {
            let head = chain.head_index();
            let mut reader = match chain.reader(&self.mem) {
                Ok(r) => r,
                Err(e) => {
                    tracing::debug!("virtio-net: bad tx chain {head}: {e:?}");
                    self.add_used(TX, head);
                    used_any = true;
                    continue;
                }
            };
            let len = reader.available_bytes();
            if let Some(l) = self.tx_limiter.as_mut() {
                if !l.consume(len.saturating_sub(HDR_LEN) as u64) {
                    self.tx.go_to_previous_position();
                    break;
                }
            }
            if !(HDR_LEN..=HDR_LEN + MAX_FRAME).contains(&len) {
                tracing::debug!("virtio-net: dropped a {len}-byte tx chain");
            } else {
                let n = len - HDR_LEN;
                let mut hdr = [0u8; HDR_LEN];
                let read = reader
                    .read_exact(&mut hdr)
                    .and_then(|_| reader.read_exact(&mut self.frame[..n]));
                match read {
                    Ok(()) => self.send(n),
                    Err(e) => tracing::debug!("virtio-net: unreadable tx chain {head}: {e}"),
                }
            }
            self.add_used(TX, head);
            used_any = true;
        }
        if used_any {
            super::notify_used(&mut self.tx, &self.mem, &self.interrupt, "virtio-net");
        }
    }

    fn send(&mut self, n: usize) {
        if !self.backend_ok {
            return;
        }
        match self.backend.write(&self.frame[..n]) {
            Ok(_) => {}
            // A full tap queue or a tap that is down drops the frame, as a wire would.
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EAGAIN | libc::ENOBUFS | libc::EIO | libc::ENETDOWN)
                ) => {}
            Err(e) => self.backend_failed(&e),
        }
    }

    fn backend_failed(&mut self, e: &std::io::Error) {
        tracing::warn!("virtio-net: the tap failed ({e}); frames are dropped from now on");
        self.backend_ok = false;
    }

    /// Moves frames from the backend into rx buffers until either runs out; returns
    /// whether the backend should be watched (a frame could be taken now).
    fn process_rx(&mut self) -> bool {
        let mut used_any = false;
        let want = loop {
            if self.pending.is_none() {
                if !self.backend_ok {
                    break false;
                }
                match self.backend.read(&mut self.frame) {
                    Ok(n) => self.pending = Some(self.frame[..n].to_vec()),
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break true,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        self.backend_failed(&e);
                        break false;
                    }
                }
            }
            let Some(frame) = self.pending.take() else {
                continue;
            };
            if let Some(l) = self.rx_limiter.as_mut() {
                if !l.consume(frame.len() as u64) {
                    // The limiter's timer resumes.
                    self.pending = Some(frame);
                    break false;
                }
            }
            match self.deliver(&frame) {
                Delivery::Done => used_any = true,
                Delivery::Dropped => {}
                Delivery::NoBuffer => {
                    // The driver's next rx notification resumes.
                    self.pending = Some(frame);
                    break false;
                }
            }
        };
        if used_any {
            super::notify_used(&mut self.rx, &self.mem, &self.interrupt, "virtio-net");
        }
        want
    }

    /// Writes one frame, behind a header, into the next rx buffer.
    fn deliver(&mut self, frame: &[u8]) -> Delivery {
        let Some(chain) = self.rx.pop_descriptor_chain(&self.mem) else {
            return Delivery::NoBuffer;
        };
        let head = chain.head_index();
        let mut writer = match chain.writer(&self.mem) {
            Ok(w) => w,
            Err(e) => {
                tracing::debug!("virtio-net: bad rx chain {head}: {e:?}");
                self.add_used(RX, head);
                return Delivery::Dropped;
            }
        };
        if writer.available_bytes() < HDR_LEN + frame.len() {
            // Too small for this frame: the frame is lost (as on a real card), the
            // buffer stays for the next one.
            tracing::debug!(
                "virtio-net: dropped a {}-byte frame for a {}-byte rx buffer",
                frame.len(),
                writer.available_bytes()
            );
            self.rx.go_to_previous_position();
            return Delivery::Dropped;
        }
        let mut hdr = [0u8; HDR_LEN];
        // num_buffers: one buffer per frame.
        hdr[10] = 1;
        let written = writer.write_all(&hdr).and_then(|_| writer.write_all(frame));
        let len = match written {
            Ok(()) => (HDR_LEN + frame.len()) as u32,
            Err(e) => {
                tracing::debug!("virtio-net: rx chain {head} unwritable: {e}");
                0
            }
        };
        super::add_used(&mut self.rx, &self.mem, head, len, "virtio-net");
        Delivery::Done
    }

    fn add_used(&mut self, q: usize, head: u16) {
        let queue = if q == RX { &mut self.rx } else { &mut self.tx };
        super::add_used(queue, &self.mem, head, 0, "virtio-net");
    }

    /// Runs rx and watches the backend only while a frame could be taken.
    fn rx_and_watch(&mut self, ctx: &WorkerContext<'_>) {
        let want = self.process_rx();
        if !self.backend_ok {
            if self.registered {
                // A failed descriptor may report errors even with no events asked for.
                let _ = ctx.remove(self.backend.as_raw_fd());
                self.registered = false;
            }
            return;
        }
        if want != self.watching {
            let events = if want {
                EventSet::IN
            } else {
                EventSet::empty()
            };
            match ctx.modify(self.backend.as_raw_fd(), TOKEN_TAP, events) {
                Ok(()) => self.watching = want,
                Err(e) => tracing::error!("virtio-net: cannot watch the tap: {e}"),
            }
        }
    }
}

/// The worker over a fuzzer's memory and queues (the fuzzing module's rig), its tap a datagram
/// socket.
#[cfg(feature = "fuzzing")]
pub(crate) fn fuzz_worker(
    mem: GuestMemoryMmap,
    queues: [Queue; 2],
    interrupt: Arc<VirtioInterrupt>,
    backend: OwnedFd,
) -> Option<NetWorker> {
    NetWorker::new(mem, queues, interrupt, backend, None).ok()
}

enum Delivery {
    Done,
    Dropped,
    NoBuffer,
}

impl QueueHandler for NetWorker {
    fn start(&mut self, ctx: &WorkerContext<'_>) {
        let fds = [
            Some((self.backend.as_raw_fd(), TOKEN_TAP, EventSet::empty())),
            self.rx_limiter
                .as_ref()
                .map(|l| (l.as_raw_fd(), TOKEN_RX_LIMITER, EventSet::IN)),
            self.tx_limiter
                .as_ref()
                .map(|l| (l.as_raw_fd(), TOKEN_TX_LIMITER, EventSet::IN)),
        ];
        for (fd, token, events) in fds.into_iter().flatten() {
            match ctx.add(fd, token, events) {
                Ok(()) => self.registered |= token == TOKEN_TAP,
                Err(e) => tracing::error!("virtio-net: cannot watch descriptor {fd}: {e}"),
            }
        }
        // Restored devices serve what was queued before the clone point.
        self.process_tx();
        self.rx_and_watch(ctx);
    }

    fn queue_event(&mut self, index: usize, ctx: &WorkerContext<'_>) {
        match index {
            RX => self.rx_and_watch(ctx),
            TX => self.process_tx(),
            _ => {}
        }
    }

    fn handler_event(&mut self, token: u64, _events: EventSet, ctx: &WorkerContext<'_>) {
        match token {
            TOKEN_TAP => self.rx_and_watch(ctx),
            TOKEN_RX_LIMITER => {
                if let Some(l) = self.rx_limiter.as_mut() {
                    l.timer_fired();
                }
                self.rx_and_watch(ctx);
            }
            TOKEN_TX_LIMITER => {
                if let Some(l) = self.tx_limiter.as_mut() {
                    l.timer_fired();
                }
                self.process_tx();
            }
            _ => {}
        }
    }

    fn queue_states(&self) -> Vec<QueueState> {
        vec![self.rx.state(), self.tx.state()]
    }
}

#[cfg(test)]
mod tests;
