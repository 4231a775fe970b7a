//! virtio devices over the virtio-mmio transport (virtio 1.x, "modern" register layout).

pub mod block;
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod mmio;
pub mod net;
pub mod rng;
pub mod vsock;
pub mod worker;

use std::sync::atomic::{AtomicU32, Ordering};

use serde::{Deserialize, Serialize};
use virtio_queue::Queue;
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

pub use mmio::{MmioTransport, MmioTransportState};
pub use worker::{QueueHandler, Worker, WorkerContext, WorkerError};

/// Run by every device worker thread before it serves its queues (the VMM installs the
/// thread's seccomp filter); a worker whose hook fails does not serve.
pub type WorkerStart = fn() -> Result<(), String>;

static WORKER_START: std::sync::OnceLock<WorkerStart> = std::sync::OnceLock::new();

/// Sets the hook every device worker thread runs first (the first call wins).
pub fn set_worker_start(hook: WorkerStart) {
    let _ = WORKER_START.set(hook);
}

/// Runs the worker-start hook on the calling worker thread.
pub(crate) fn worker_started(device: &str) -> bool {
    match WORKER_START.get().map_or(Ok(()), |h| h()) {
        Ok(()) => true,
        Err(e) => {
            tracing::error!("{device} worker: {e}; the device will not serve");
            false
        }
    }
}

/// Feature bit every modern device offers: VIRTIO_F_VERSION_1.
pub const VIRTIO_F_VERSION_1: u64 = 1 << virtio_bindings::virtio_config::VIRTIO_F_VERSION_1;
/// Interrupt status bit: a used buffer was added to a queue.
pub const VIRTIO_MMIO_INT_VRING: u32 = virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_VRING;
/// Interrupt status bit: the configuration changed.
pub const VIRTIO_MMIO_INT_CONFIG: u32 = virtio_bindings::virtio_mmio::VIRTIO_MMIO_INT_CONFIG;

/// Errors activating a device.
#[derive(Debug, thiserror::Error)]
pub enum ActivateError {
    /// The driver set up queues the device cannot use.
    #[error("invalid queue configuration: {0}")]
    BadQueue(String),
    /// The device's worker could not be started.
    #[error(transparent)]
    Worker(#[from] WorkerError),
    /// The device's host side (its tap, its listening socket) could not be opened.
    #[error("{device}: {source}")]
    Host {
        /// The device.
        device: &'static str,
        /// Why.
        source: Box<dyn std::error::Error + Send + Sync>,
    },
}

/// The interrupt line of one virtio-mmio device: the status register the driver reads
/// and the irqfd that raises the GSI.
#[derive(Debug)]
pub struct VirtioInterrupt {
    status: AtomicU32,
    irq: EventFd,
}

impl VirtioInterrupt {
    /// An interrupt raised through `irq` (registered with KVM as an irqfd).
    pub fn new(irq: EventFd) -> Self {
        Self {
            status: AtomicU32::new(0),
            irq,
        }
    }

    /// Sets the status register (restoring a device) and, when a bit is set, raises
    /// the line again: the driver reads the status and finds the cause. A spurious
    /// raise is harmless (the driver sees status 0 and ignores it).
    pub fn restore(&self, status: u32) -> std::io::Result<()> {
        self.status.store(status, Ordering::Release);
        if status != 0 {
            self.irq.write(1)?;
        }
        Ok(())
    }

    /// Tells the driver that used buffers are ready.
    pub fn signal_used_queue(&self) -> std::io::Result<()> {
        self.status
            .fetch_or(VIRTIO_MMIO_INT_VRING, Ordering::AcqRel);
        self.irq.write(1)
    }

    /// Tells the driver that the device's configuration changed (a disk slot's new
    /// medium and capacity): it reads the configuration again.
    pub fn signal_config_change(&self) -> std::io::Result<()> {
        self.status
            .fetch_or(VIRTIO_MMIO_INT_CONFIG, Ordering::AcqRel);
        self.irq.write(1)
    }

    /// The interrupt status register.
    pub fn status(&self) -> u32 {
        self.status.load(Ordering::Acquire)
    }

    /// The driver acknowledges `bits`.
    pub fn ack(&self, bits: u32) {
        self.status.fetch_and(!bits, Ordering::AcqRel);
    }
}

/// The one queue of a single-queue device, or why the driver's setup does not fit.
pub(crate) fn single_queue(mut queues: Vec<Queue>, device: &str) -> Result<Queue, ActivateError> {
    match (queues.pop(), queues.is_empty()) {
        (Some(q), true) => Ok(q),
        _ => Err(ActivateError::BadQueue(format!("{device} needs one queue"))),
    }
}

/// A rate limiter for `limit` (None: unlimited), or why its timer cannot be made.
pub(crate) fn new_limiter(
    limit: Option<&crate::rate_limiter::RateLimit>,
    device: &'static str,
    stats: &std::sync::Arc<crate::rate_limiter::LimiterStats>,
) -> Result<Option<crate::rate_limiter::RateLimiter>, WorkerError> {
    limit
        .map(|l| crate::rate_limiter::RateLimiter::with_stats(l, stats.clone()))
        .transpose()
        .map_err(|e| WorkerError::Spawn(device, e))
}

/// The report of a single-queue device's limiter (`requests`), when it has a limit.
pub(crate) fn request_limiter_report(
    limit: Option<&crate::rate_limiter::RateLimit>,
    stats: &crate::rate_limiter::LimiterStats,
) -> Vec<crate::rate_limiter::LimiterReport> {
    limit
        .map(|_| stats.report("requests"))
        .into_iter()
        .collect()
}

/// A single-queue worker whose requests an optional rate limiter holds back
/// (virtio-rng, virtio-blk). [`Limited`] gives it the event handling.
pub(crate) trait LimitedQueue: Send + 'static {
    /// The device's name, for messages.
    const NAME: &'static str;
    /// Serves what the queue holds (stopping where the limiter says so).
    fn process_queue(&mut self);
    /// The queue.
    fn queue(&self) -> &Queue;
    /// The limiter, if the device has one.
    fn limiter(&mut self) -> Option<&mut crate::rate_limiter::RateLimiter>;
}

/// The worker's token for a [`LimitedQueue`]'s limiter timer.
const TOKEN_LIMITER: u64 = worker::FIRST_HANDLER_TOKEN;

/// A [`LimitedQueue`] as its worker thread runs it: the queue is served on every
/// notification, unless the limiter holds a request back; then its timer resumes.
pub(crate) struct Limited<W>(pub W);

impl<W: LimitedQueue> QueueHandler for Limited<W> {
    fn start(&mut self, ctx: &WorkerContext<'_>) {
        use std::os::fd::AsRawFd;
        if let Some(l) = self.0.limiter() {
            let fd = l.as_raw_fd();
            if let Err(e) = ctx.add(fd, TOKEN_LIMITER, vmm_sys_util::epoll::EventSet::IN) {
                tracing::error!("{}: cannot watch the rate limiter: {e}", W::NAME);
            }
        }
    }

    fn queue_event(&mut self, _index: usize, _ctx: &WorkerContext<'_>) {
        // While blocked, the limiter's timer retries.
        if !self.0.limiter().is_some_and(|l| l.is_blocked()) {
            self.0.process_queue();
        }
    }

    fn handler_event(
        &mut self,
        token: u64,
        _events: vmm_sys_util::epoll::EventSet,
        _ctx: &WorkerContext<'_>,
    ) {
        if token == TOKEN_LIMITER {
            if let Some(l) = self.0.limiter() {
                l.timer_fired();
            }
            self.0.process_queue();
        }
    }

    fn queue_states(&self) -> Vec<virtio_queue::QueueState> {
        vec![self.0.queue().state()]
    }
}

/// Reads `data` at `offset` of a configuration space that is one little-endian u64 at
/// offset 0 (virtio-blk's capacity, virtio-vsock's guest CID); the rest reads as zero.
pub(crate) fn read_u64_config(value: u64, offset: u64, data: &mut [u8]) {
    let cfg = value.to_le_bytes();
    for (i, b) in data.iter_mut().enumerate() {
        *b = cfg.get(offset as usize + i).copied().unwrap_or(0);
    }
}

/// Chains the devices could not return (a head beyond the queue, a used ring outside
/// guest memory): a driver can offer them without end, so the log is thinned.
static BAD_RETURNS: crate::util::SharedLogThrottle = crate::util::SharedLogThrottle::new();

/// Returns a served chain to the driver with `len` bytes written. A head the driver
/// offered beyond its queue is not returned (there is no such entry), and neither is
/// one whose used ring is not in guest memory; both are logged, thinned.
pub(crate) fn add_used(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    head: u16,
    len: u32,
    device: &str,
) {
    use virtio_queue::QueueT;
    let why = if head >= queue.size() {
        format!(
            "the driver offered head {head} of a {}-entry queue",
            queue.size()
        )
    } else {
        match queue.add_used(mem, head, len) {
            Ok(()) => return,
            Err(e) => format!("{e:?}"),
        }
    };
    if let Some(n) = BAD_RETURNS.hit() {
        tracing::warn!("{device}: cannot return descriptor {head}: {why} ({n} so far)");
    }
}

/// After a device returned used buffers: raises the interrupt unless the driver asked
/// not to be notified (VIRTIO_F_EVENT_IDX); an unreadable ring notifies.
pub(crate) fn notify_used(
    queue: &mut Queue,
    mem: &GuestMemoryMmap,
    interrupt: &VirtioInterrupt,
    device: &str,
) {
    use virtio_queue::QueueT;
    if queue.needs_notification(mem).unwrap_or(true) {
        if let Err(e) = interrupt.signal_used_queue() {
            tracing::warn!("{device}: interrupt failed: {e}");
        }
    }
}

/// A virtio device's own state, beside its transport's: each device's [`crate::persist::Persist`] state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum VirtioDeviceState {
    /// virtio-blk.
    Block(block::BlockState),
    /// virtio-rng.
    Rng(rng::RngState),
    /// virtio-vsock.
    Vsock(vsock::VsockState),
    /// virtio-net.
    Net(net::NetState),
}

/// A virtio device whose own state is one [`VirtioDeviceState`] variant.
pub trait VirtioPersist: crate::persist::Persist {
    /// The kind of device, for messages.
    const KIND: &'static str;
    /// Its state in a saved transport's, if the transport's device is of its kind.
    fn unwrap(state: &VirtioDeviceState) -> Option<&Self::State>;
}

macro_rules! virtio_persist {
    ($($device:ty => $variant:ident, $kind:literal;)*) => {$(
        impl VirtioPersist for $device {
            const KIND: &'static str = $kind;

            fn unwrap(state: &VirtioDeviceState) -> Option<&Self::State> {
                match state {
                    VirtioDeviceState::$variant(s) => Some(s),
                    _ => None,
                }
            }
        }
    )*};
}

virtio_persist! {
    block::Block => Block, "virtio-blk";
    rng::Rng => Rng, "virtio-rng";
    vsock::Vsock => Vsock, "virtio-vsock";
    net::Net => Net, "virtio-net";
}

/// A virtio device model, driven by a transport. The transport owns the device's
/// worker thread: [`VirtioDevice::activate`] hands it the handler that serves the queues.
pub trait VirtioDevice: Send {
    /// The device's own state, its [`crate::persist::Persist::save`]; the transport saves its queues and
    /// registers beside it.
    fn state(&self) -> VirtioDeviceState;
    /// Short name, used for the worker thread and in messages ("virtio-blk", ...).
    fn name(&self) -> &'static str;
    /// virtio device id (2 = block, ...).
    fn device_type(&self) -> u32;
    /// Features offered.
    fn avail_features(&self) -> u64;
    /// Largest size of each queue; the length is the number of queues.
    fn queue_max_sizes(&self) -> &[u16];
    /// Reads the device-specific configuration space.
    fn read_config(&self, offset: u64, data: &mut [u8]);
    /// Writes the device-specific configuration space.
    fn write_config(&mut self, offset: u64, data: &[u8]);
    /// Opens the device's host side (a tap, a listening socket) if it was deferred and
    /// is not open yet. A clone builds its devices with it deferred and calls this once
    /// its vCPUs run, before it reports ready: that takes it off the clone's latency
    /// path. Activation opens it too, should the driver start the device first.
    fn open_host(&mut self) -> Result<(), ActivateError> {
        Ok(())
    }
    /// Its rate limiters' counters, named (`rx` and `tx` for the network card,
    /// `requests` for the disk's and the entropy device's queue), when it has a limit.
    fn limiter_reports(&self) -> Vec<crate::rate_limiter::LimiterReport> {
        Vec::new()
    }
    /// Starts the device: the driver is ready (DRIVER_OK) with these queues, or a clone
    /// restores a running device. Returns what the worker thread runs.
    fn activate(
        &mut self,
        mem: GuestMemoryMmap,
        acked_features: u64,
        queues: Vec<Queue>,
        interrupt: std::sync::Arc<VirtioInterrupt>,
    ) -> Result<Box<dyn QueueHandler>, ActivateError>;
}
