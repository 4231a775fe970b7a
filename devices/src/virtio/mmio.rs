//! The virtio-mmio transport (virtio 1.x, version 2 register layout).

use std::sync::Arc;

use serde::{Deserialize, Serialize};
use virtio_queue::{Queue, QueueState, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::worker::{Worker, WorkerError};
use super::{VirtioDevice, VirtioDeviceState, VirtioInterrupt};
use crate::bus::BusDevice;
use crate::persist::Persist;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x4b46_5646; // "FVFK"
/// Offset of the queue-notify register (where ioeventfds are registered).
pub const NOTIFY_REG_OFFSET: u64 = reg(mm::VIRTIO_MMIO_QUEUE_NOTIFY);
const CONFIG_SPACE_OFFSET: u64 = reg(mm::VIRTIO_MMIO_CONFIG);

use virtio_bindings::virtio_mmio as mm;

/// A register's offset, as the bus gives it.
const fn reg(offset: u32) -> u64 {
    offset as u64
}

const MAGIC_VALUE: u64 = reg(mm::VIRTIO_MMIO_MAGIC_VALUE);
const VERSION_REG: u64 = reg(mm::VIRTIO_MMIO_VERSION);
const DEVICE_ID: u64 = reg(mm::VIRTIO_MMIO_DEVICE_ID);
const VENDOR_ID_REG: u64 = reg(mm::VIRTIO_MMIO_VENDOR_ID);
const DEVICE_FEATURES: u64 = reg(mm::VIRTIO_MMIO_DEVICE_FEATURES);
const DEVICE_FEATURES_SEL: u64 = reg(mm::VIRTIO_MMIO_DEVICE_FEATURES_SEL);
const DRIVER_FEATURES: u64 = reg(mm::VIRTIO_MMIO_DRIVER_FEATURES);
const DRIVER_FEATURES_SEL: u64 = reg(mm::VIRTIO_MMIO_DRIVER_FEATURES_SEL);
const QUEUE_SEL: u64 = reg(mm::VIRTIO_MMIO_QUEUE_SEL);
const QUEUE_NUM_MAX: u64 = reg(mm::VIRTIO_MMIO_QUEUE_NUM_MAX);
const QUEUE_NUM: u64 = reg(mm::VIRTIO_MMIO_QUEUE_NUM);
const QUEUE_READY: u64 = reg(mm::VIRTIO_MMIO_QUEUE_READY);
const INTERRUPT_STATUS: u64 = reg(mm::VIRTIO_MMIO_INTERRUPT_STATUS);
const INTERRUPT_ACK: u64 = reg(mm::VIRTIO_MMIO_INTERRUPT_ACK);
const STATUS: u64 = reg(mm::VIRTIO_MMIO_STATUS);
const QUEUE_DESC_LOW: u64 = reg(mm::VIRTIO_MMIO_QUEUE_DESC_LOW);
const QUEUE_DESC_HIGH: u64 = reg(mm::VIRTIO_MMIO_QUEUE_DESC_HIGH);
const QUEUE_AVAIL_LOW: u64 = reg(mm::VIRTIO_MMIO_QUEUE_AVAIL_LOW);
const QUEUE_AVAIL_HIGH: u64 = reg(mm::VIRTIO_MMIO_QUEUE_AVAIL_HIGH);
const QUEUE_USED_LOW: u64 = reg(mm::VIRTIO_MMIO_QUEUE_USED_LOW);
const QUEUE_USED_HIGH: u64 = reg(mm::VIRTIO_MMIO_QUEUE_USED_HIGH);
const CONFIG_GENERATION: u64 = reg(mm::VIRTIO_MMIO_CONFIG_GENERATION);

use virtio_bindings::virtio_config::{
    VIRTIO_CONFIG_S_ACKNOWLEDGE as STATUS_ACKNOWLEDGE, VIRTIO_CONFIG_S_DRIVER as STATUS_DRIVER,
    VIRTIO_CONFIG_S_DRIVER_OK as STATUS_DRIVER_OK, VIRTIO_CONFIG_S_FAILED as STATUS_FAILED,
    VIRTIO_CONFIG_S_FEATURES_OK as STATUS_FEATURES_OK,
};

/// A virtio device on the MMIO bus.
pub struct MmioTransport {
    device: Box<dyn VirtioDevice>,
    mem: GuestMemoryMmap,
    queues: Vec<Queue>,
    queue_evts: Vec<EventFd>,
    interrupt: Arc<VirtioInterrupt>,
    features_select: u32,
    acked_features_select: u32,
    acked_features: u64,
    queue_select: u32,
    status: u32,
    config_generation: u32,
    /// The running device's worker (None until DRIVER_OK and after a reset).
    worker: Option<Worker>,
    /// Restored as running, its worker not started yet ([`MmioTransport::start_restored`]).
    pending_start: bool,
    /// The queues as the worker reported them when it parked (None: not parked).
    parked: Option<Vec<QueueState>>,
    /// Activations refused (a driver may retry forever).
    refusals: crate::util::LogThrottle,
}

/// `virtio_queue::QueueState` for serde (the crate has no serde support).
#[derive(Serialize, Deserialize)]
#[serde(remote = "QueueState")]
struct QueueStateDef {
    max_size: u16,
    next_avail: u16,
    next_used: u16,
    event_idx_enabled: bool,
    size: u16,
    ready: bool,
    desc_table: u64,
    avail_ring: u64,
    used_ring: u64,
}

/// One queue's state: sizes, ring addresses and ring positions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedQueue(#[serde(with = "QueueStateDef")] pub QueueState);

/// Everything a virtio-mmio device carries into a clone: the transport registers, the
/// interrupt status, each queue's state, and the device's own state (from which the VMM
/// makes the device again, with the new VM's host resources).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct MmioTransportState {
    /// The device's own state.
    pub device: VirtioDeviceState,
    /// virtio device id, checked on restore.
    pub device_type: u32,
    /// Feature word the driver reads next.
    pub features_select: u32,
    /// Feature word the driver acknowledges next.
    pub acked_features_select: u32,
    /// Features the driver accepted.
    pub acked_features: u64,
    /// Selected queue.
    pub queue_select: u32,
    /// Device status register.
    pub status: u32,
    /// Configuration generation counter.
    pub config_generation: u32,
    /// Interrupt status register.
    pub interrupt_status: u32,
    /// Whether the device was running (DRIVER_OK and activated).
    pub activated: bool,
    /// Every queue, in order.
    pub queues: Vec<SavedQueue>,
}

/// Errors rebuilding a device from its saved state.
#[derive(Debug, thiserror::Error)]
pub enum TransportRestoreError {
    /// The saved state is of another kind of device or queue layout.
    #[error("saved state is for device type {saved} with {saved_queues} queues, not {device} with {queues}")]
    Mismatch {
        /// Saved device type.
        saved: u32,
        /// Saved queue count.
        saved_queues: usize,
        /// This device's type.
        device: u32,
        /// This device's queue count.
        queues: usize,
    },
    /// A saved queue is not valid.
    #[error("saved queue {index} is invalid: {reason}")]
    Queue {
        /// Queue index.
        index: usize,
        /// Why.
        reason: String,
    },
    /// An eventfd could not be made, or the interrupt raised.
    #[error("cannot restore the device: {0}")]
    Io(#[from] std::io::Error),
    /// The running device could not be started again.
    #[error(transparent)]
    Activate(#[from] super::ActivateError),
}

fn new_queues(device: &dyn VirtioDevice) -> std::io::Result<Vec<Queue>> {
    device
        .queue_max_sizes()
        .iter()
        .map(|s| Queue::new(*s).map_err(|e| std::io::Error::other(format!("{e:?}"))))
        .collect()
}

impl MmioTransport {
    /// Wraps `device`. `interrupt` raises its GSI; one queue eventfd per queue is made
    /// here for the VMM to register as ioeventfds on the notify register.
    pub fn new(
        mem: GuestMemoryMmap,
        device: Box<dyn VirtioDevice>,
        interrupt: Arc<VirtioInterrupt>,
    ) -> std::io::Result<Self> {
        let queues = new_queues(device.as_ref())?;
        let queue_evts = (0..queues.len())
            .map(|_| EventFd::new(0))
            .collect::<std::io::Result<Vec<_>>>()?;
        Ok(Self {
            device,
            mem,
            queues,
            queue_evts,
            interrupt,
            features_select: 0,
            acked_features_select: 0,
            acked_features: 0,
            queue_select: 0,
            status: 0,
            config_generation: 0,
            worker: None,
            pending_start: false,
            parked: None,
            refusals: Default::default(),
        })
    }

    /// Tells the driver that the device's configuration changed: the configuration
    /// generation moves on and the configuration-change interrupt is raised.
    pub fn notify_config_change(&mut self) -> std::io::Result<()> {
        self.config_generation = self.config_generation.wrapping_add(1);
        self.interrupt.signal_config_change()
    }

    /// Starts the worker of a device restored as running (no-op otherwise).
    pub fn start_restored(&mut self) -> Result<(), super::ActivateError> {
        if std::mem::take(&mut self.pending_start) {
            self.start_worker()?;
        }
        Ok(())
    }

    /// Whether the device runs (or will, once restored): its queue setup is locked.
    fn running(&self) -> bool {
        self.worker.is_some() || self.pending_start
    }

    /// Parks the device's worker (if it runs) and returns the device's state; the
    /// worker holds no lock until [`MmioTransport::resume`]. Pausing twice is allowed.
    pub fn pause(&mut self) -> Result<MmioTransportState, WorkerError> {
        self.request_pause()?;
        self.wait_parked()?;
        Ok(self.save())
    }

    /// The first half of [`MmioTransport::pause`]: asks the worker to park without
    /// waiting, so several devices park at once. Must be followed by
    /// [`MmioTransport::wait_parked`].
    pub fn request_pause(&mut self) -> Result<(), WorkerError> {
        self.worker.as_ref().map_or(Ok(()), Worker::request_pause)
    }

    /// The second half of [`MmioTransport::pause`]: waits for the worker to park and
    /// keeps the queue state it reports, for [`Persist::save`].
    pub fn wait_parked(&mut self) -> Result<(), WorkerError> {
        if let Some(w) = &self.worker {
            self.parked = Some(w.paused_state()?);
        }
        Ok(())
    }

    /// Lets a paused worker go on.
    pub fn resume(&mut self) -> Result<(), WorkerError> {
        self.parked = None;
        self.worker.as_ref().map_or(Ok(()), Worker::resume)
    }

    /// The device's name.
    pub fn name(&self) -> &'static str {
        self.device.name()
    }

    /// Opens the device's deferred host side (see [`VirtioDevice::open_host`]).
    pub fn open_host(&mut self) -> Result<(), super::ActivateError> {
        self.device.open_host()
    }

    /// The device's rate limiters' counters ([`VirtioDevice::limiter_reports`]).
    pub fn limiter_reports(&self) -> Vec<crate::rate_limiter::LimiterReport> {
        self.device.limiter_reports()
    }

    /// Whether the driver started the device (its worker runs, or will once restored).
    pub fn is_active(&self) -> bool {
        self.running()
    }

    /// Hands the queues to the device and starts its worker.
    fn start_worker(&mut self) -> Result<(), super::ActivateError> {
        let evts = self
            .queue_evts
            .iter()
            .map(EventFd::try_clone)
            .collect::<std::io::Result<Vec<_>>>()
            .map_err(|e| WorkerError::Spawn(self.device.name(), e))?;
        // The queues move into the worker; reset() makes fresh ones.
        let queues = std::mem::take(&mut self.queues);
        let handler = self.device.activate(
            self.mem.clone(),
            self.acked_features,
            queues,
            self.interrupt.clone(),
        )?;
        self.worker = Some(Worker::spawn(self.device.name(), handler, evts)?);
        Ok(())
    }

    /// The eventfds guest notifications for each queue should signal.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    /// The transport with `evts` as its queue eventfds instead of those it made: the
    /// ones a transport before it had in the same VM, registered there already. As
    /// many as it has queues; a notification left in one reaches the new worker, which
    /// finds nothing new in its queue.
    pub fn with_queue_evts(mut self, evts: Vec<EventFd>) -> Result<Self, TransportRestoreError> {
        if evts.len() != self.queue_evts.len() {
            return Err(TransportRestoreError::Queue {
                index: evts.len(),
                reason: format!(
                    "{} queue eventfds for {} queues",
                    evts.len(),
                    self.queue_evts.len()
                ),
            });
        }
        self.queue_evts = evts;
        Ok(self)
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    fn reset(&mut self) {
        self.pending_start = false;
        if let Some(mut w) = self.worker.take() {
            w.stop();
        }
        match new_queues(self.device.as_ref()) {
            Ok(q) => self.queues = q,
            Err(e) => tracing::error!("virtio: cannot recreate queues on reset: {e}"),
        }
        self.status = 0;
        self.acked_features = 0;
        self.features_select = 0;
        self.acked_features_select = 0;
        self.queue_select = 0;
        self.interrupt.ack(u32::MAX);
    }

    fn set_status(&mut self, status: u32) {
        if status == 0 {
            self.reset();
            return;
        }
        self.status = status;
        let ready = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK;
        if !self.running() && status & ready == ready && status & STATUS_FAILED == 0 {
            self.activate();
        }
    }

    fn activate(&mut self) {
        if let Some(i) = self
            .queues
            .iter()
            .position(|q| q.ready() && !q.is_valid(&self.mem))
        {
            if let Some(n) = self.refusals.hit() {
                tracing::warn!(
                    "{}: driver made queue {i} ready with an invalid layout ({n} so far)",
                    self.device.name()
                );
            }
            self.status |= STATUS_FAILED;
            return;
        }
        if let Err(e) = self.start_worker() {
            // A driver can reset and start the device again without end.
            if let Some(n) = self.refusals.hit() {
                tracing::error!("{} activation failed: {e} ({n} so far)", self.device.name());
            }
            self.status |= STATUS_FAILED;
        }
    }

    fn read_reg(&mut self, offset: u64) -> u32 {
        match offset {
            MAGIC_VALUE => MAGIC,
            VERSION_REG => VERSION,
            DEVICE_ID => self.device.device_type(),
            VENDOR_ID_REG => VENDOR_ID,
            DEVICE_FEATURES => {
                let f = self.device.avail_features();
                match self.features_select {
                    0 => f as u32,
                    1 => (f >> 32) as u32,
                    _ => 0,
                }
            }
            QUEUE_NUM_MAX => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            QUEUE_READY => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            INTERRUPT_STATUS => self.interrupt.status(),
            STATUS => self.status,
            CONFIG_GENERATION => self.config_generation,
            _ => 0,
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        // Queue and feature setup is only allowed before the device runs.
        let setup = !self.running();
        let low = |q: &mut Queue, f: fn(&mut Queue, Option<u32>, Option<u32>)| f(q, Some(v), None);
        let high = |q: &mut Queue, f: fn(&mut Queue, Option<u32>, Option<u32>)| f(q, None, Some(v));
        match offset {
            DEVICE_FEATURES_SEL => self.features_select = v,
            DRIVER_FEATURES if setup => {
                let shift = match self.acked_features_select {
                    0 => 0,
                    1 => 32,
                    _ => return,
                };
                let offered = self.device.avail_features();
                self.acked_features |= (u64::from(v) << shift) & offered;
            }
            DRIVER_FEATURES_SEL => self.acked_features_select = v,
            QUEUE_SEL => self.queue_select = v,
            QUEUE_NUM if setup => {
                if let Some(q) = self.selected_queue() {
                    q.set_size(v as u16);
                }
            }
            QUEUE_READY if setup => {
                if let Some(q) = self.selected_queue() {
                    q.set_ready(v == 1);
                }
            }
            NOTIFY_REG_OFFSET => {
                // Normally caught by the ioeventfd before reaching userspace.
                if let Some(evt) = self.queue_evts.get(v as usize) {
                    let _ = evt.write(1);
                }
            }
            INTERRUPT_ACK => self.interrupt.ack(v),
            STATUS => self.set_status(v),
            QUEUE_DESC_LOW | QUEUE_DESC_HIGH | QUEUE_AVAIL_LOW | QUEUE_AVAIL_HIGH
            | QUEUE_USED_LOW | QUEUE_USED_HIGH
                if setup =>
            {
                if let Some(q) = self.queues.get_mut(self.queue_select as usize) {
                    let f: fn(&mut Queue, Option<u32>, Option<u32>) = match offset {
                        QUEUE_DESC_LOW | QUEUE_DESC_HIGH => QueueT::set_desc_table_address,
                        QUEUE_AVAIL_LOW | QUEUE_AVAIL_HIGH => QueueT::set_avail_ring_address,
                        _ => QueueT::set_used_ring_address,
                    };
                    if offset & 0x4 == 0 {
                        low(q, f)
                    } else {
                        high(q, f)
                    }
                }
            }
            _ => tracing::debug!("virtio-mmio: ignored write {v:#x} at {offset:#x}"),
        }
    }
}

/// What a transport is made with.
pub struct TransportArgs {
    /// Guest memory.
    pub mem: GuestMemoryMmap,
    /// The device, made (or restored) already.
    pub device: Box<dyn VirtioDevice>,
    /// Raises its interrupt line.
    pub interrupt: Arc<VirtioInterrupt>,
}

impl Persist for MmioTransport {
    type State = MmioTransportState;
    type ConstructorArgs = TransportArgs;
    type Error = TransportRestoreError;

    /// The registers, the interrupt status, the queues and the device's own state. A
    /// running device's queues are its worker's: pause it first
    /// ([`MmioTransport::request_pause`] and [`MmioTransport::wait_parked`]); unpaused, the
    /// state has no queues, which a restore refuses.
    fn save(&self) -> MmioTransportState {
        let queues = match (&self.parked, &self.worker) {
            (Some(parked), _) => parked.clone(),
            (None, Some(_)) => Vec::new(),
            (None, None) => self.queues.iter().map(Queue::state).collect(),
        };
        MmioTransportState {
            device: self.device.state(),
            device_type: self.device.device_type(),
            features_select: self.features_select,
            acked_features_select: self.acked_features_select,
            acked_features: self.acked_features,
            queue_select: self.queue_select,
            status: self.status,
            config_generation: self.config_generation,
            interrupt_status: self.interrupt.status(),
            activated: self.running(),
            queues: queues.into_iter().map(SavedQueue).collect(),
        }
    }

    /// Rebuilds the device as it was when `state` was saved (in a clone): registers,
    /// queues and interrupt status. A device that was running gets a new worker when
    /// [`MmioTransport::start_restored`] is called (a clone does that once its vCPUs
    /// run, off the clone's latency path); the worker first serves whatever the driver
    /// queued, notifications meanwhile included (they wait in the queue eventfds).
    fn restore(
        args: TransportArgs,
        state: &MmioTransportState,
    ) -> Result<Self, TransportRestoreError> {
        let mut t = Self::new(args.mem, args.device, args.interrupt)?;
        if state.device_type != t.device.device_type() || state.queues.len() != t.queues.len() {
            return Err(TransportRestoreError::Mismatch {
                saved: state.device_type,
                saved_queues: state.queues.len(),
                device: t.device.device_type(),
                queues: t.queues.len(),
            });
        }
        for (index, (q, saved)) in t.queues.iter_mut().zip(&state.queues).enumerate() {
            let max = t.device.queue_max_sizes()[index];
            if saved.0.max_size != max {
                return Err(TransportRestoreError::Queue {
                    index,
                    reason: format!("max size {} (this device: {max})", saved.0.max_size),
                });
            }
            *q = Queue::try_from(saved.0).map_err(|e| TransportRestoreError::Queue {
                index,
                reason: format!("{e:?}"),
            })?;
        }
        t.features_select = state.features_select;
        t.acked_features_select = state.acked_features_select;
        t.acked_features = state.acked_features & t.device.avail_features();
        t.queue_select = state.queue_select;
        t.status = state.status;
        t.config_generation = state.config_generation;
        t.pending_start = state.activated;
        t.interrupt.restore(state.interrupt_status)?;
        Ok(t)
    }
}

impl BusDevice for MmioTransport {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            self.device.read_config(offset - CONFIG_SPACE_OFFSET, data);
            return;
        }
        if data.len() != 4 {
            data.fill(0);
            return;
        }
        data.copy_from_slice(&self.read_reg(offset).to_le_bytes());
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset >= CONFIG_SPACE_OFFSET {
            self.device.write_config(offset - CONFIG_SPACE_OFFSET, data);
            self.config_generation = self.config_generation.wrapping_add(1);
            return;
        }
        if let Ok(bytes) = <[u8; 4]>::try_from(data) {
            self.write_reg(offset, u32::from_le_bytes(bytes));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::virtio::block::Block;
    use crate::virtio::rng::Rng;
    use virtio_queue::desc::{split::Descriptor as SplitDescriptor, RawDescriptor};
    use virtio_queue::mock::MockSplitQueue;
    use vm_memory::GuestAddress;

    const WRITE: u16 = 2;

    fn mem() -> GuestMemoryMmap {
        GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x100_0000)]).unwrap()
    }

    fn interrupt() -> Arc<VirtioInterrupt> {
        Arc::new(VirtioInterrupt::new(EventFd::new(0).unwrap()))
    }

    fn w(t: &mut MmioTransport, offset: u64, v: u32) {
        t.write(offset, &v.to_le_bytes());
    }

    fn r(t: &mut MmioTransport, offset: u64) -> u32 {
        let mut b = [0u8; 4];
        t.read(offset, &mut b);
        u32::from_le_bytes(b)
    }

    /// Drives the registers as a driver does: features, queue 0 at the mock queue's
    /// addresses, DRIVER_OK.
    fn bring_up(t: &mut MmioTransport, vq: &MockSplitQueue<'_, GuestMemoryMmap>) {
        w(t, 0x70, STATUS_ACKNOWLEDGE | STATUS_DRIVER);
        w(t, 0x24, 1);
        w(t, 0x20, 1); // VIRTIO_F_VERSION_1 (bit 32)
        w(
            t,
            0x70,
            STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK,
        );
        w(t, 0x30, 0);
        w(t, 0x38, 16);
        for (reg, addr) in [
            (0x80, vq.desc_table_addr()),
            (0x90, vq.avail_addr()),
            (0xa0, vq.used_addr()),
        ] {
            w(t, reg, addr.0 as u32);
            w(t, reg + 4, (addr.0 >> 32) as u32);
        }
        w(t, 0x44, 1);
        let all = STATUS_ACKNOWLEDGE | STATUS_DRIVER | STATUS_FEATURES_OK | STATUS_DRIVER_OK;
        w(t, 0x70, all);
        assert_eq!(r(t, 0x70), all, "device accepted the driver");
    }

    fn wait_used(vq: &MockSplitQueue<'_, GuestMemoryMmap>, n: u16) {
        let start = std::time::Instant::now();
        while vq.used().idx().load() != n {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "used index {} never reached {n}",
                vq.used().idx().load()
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
    }

    fn request(vq: &MockSplitQueue<'_, GuestMemoryMmap>, slot: u16) {
        let d = SplitDescriptor::new(0x10_0000 + u64::from(slot) * 0x1000, 32, WRITE, 0);
        vq.add_desc_chains(&[RawDescriptor::from(d)], slot).unwrap();
    }

    #[test]
    fn a_limited_entropy_device_reports_what_its_limiter_passed_and_held() {
        let m = mem();
        let unlimited = MmioTransport::new(m.clone(), Box::new(Rng::new(None)), interrupt());
        assert!(unlimited.unwrap().limiter_reports().is_empty());
        let vq = MockSplitQueue::new(&m, 16);
        // 64 bytes every 4 s: two 32-byte requests at once, the third held for 2 s
        // (long enough that the counters are read while it waits).
        let limit = "bytes=64/4000".parse().unwrap();
        let mut t =
            MmioTransport::new(m.clone(), Box::new(Rng::new(Some(limit))), interrupt()).unwrap();
        let idle = t.limiter_reports();
        assert_eq!(idle.len(), 1, "{idle:?}");
        assert_eq!(
            (idle[0].name.as_str(), idle[0].passed_bytes),
            ("requests", 0)
        );
        bring_up(&mut t, &vq);
        for slot in 0..3 {
            request(&vq, slot);
        }
        w(&mut t, NOTIFY_REG_OFFSET, 0);
        wait_used(&vq, 2);
        let start = std::time::Instant::now();
        while t.limiter_reports()[0].throttled == 0 {
            assert!(
                start.elapsed() < std::time::Duration::from_secs(5),
                "never held"
            );
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        assert_eq!(t.limiter_reports()[0].passed_bytes, 64);
        // The held request goes once the bucket has refilled.
        wait_used(&vq, 3);
        assert_eq!(t.limiter_reports()[0].passed_bytes, 96);
    }

    #[test]
    fn a_paused_device_restores_into_a_new_transport_and_serves_on() {
        let m = mem();
        let vq = MockSplitQueue::new(&m, 16);
        let mut parent =
            MmioTransport::new(m.clone(), Box::new(Rng::new(None)), interrupt()).unwrap();
        bring_up(&mut parent, &vq);
        request(&vq, 0);
        w(&mut parent, NOTIFY_REG_OFFSET, 0);
        wait_used(&vq, 1);

        // Paused: a request the driver queues now is not served by the parent...
        let state = parent.pause().unwrap();
        request(&vq, 1);
        w(&mut parent, NOTIFY_REG_OFFSET, 0);
        std::thread::sleep(std::time::Duration::from_millis(20));
        assert_eq!(
            vq.used().idx().load(),
            1,
            "a paused worker served a request"
        );
        assert!(state.activated);
        assert_eq!(state.queues[0].0.next_avail, 1);
        assert_eq!(state.queues[0].0.next_used, 1);
        assert_eq!(state.acked_features, crate::virtio::VIRTIO_F_VERSION_1);
        // ...and pausing again gives the same state.
        assert_eq!(parent.pause().unwrap(), state);

        // ...the restored device serves it when it starts, then serves new ones.
        let json = serde_json::to_string(&state).unwrap();
        let back: MmioTransportState = serde_json::from_str(&json).unwrap();
        let args = TransportArgs {
            mem: m.clone(),
            device: Box::new(Rng::new(None)),
            interrupt: interrupt(),
        };
        let mut child = MmioTransport::restore(args, &back).unwrap();
        assert!(child.is_active(), "restored as running");
        assert_eq!(
            child.pause().unwrap(),
            state,
            "state before its worker starts"
        );
        child.start_restored().unwrap();
        wait_used(&vq, 2);
        assert_eq!(r(&mut child, 0x70), state.status);
        assert_eq!(
            r(&mut child, 0x44),
            0,
            "queue setup is locked while running"
        );
        request(&vq, 2);
        w(&mut child, NOTIFY_REG_OFFSET, 0);
        wait_used(&vq, 3);
        assert_eq!(child.pause().unwrap().queues[0].0.next_used, 3);
        child.resume().unwrap();
        parent.resume().unwrap();
    }

    #[test]
    fn restore_refuses_state_of_another_device_or_a_bad_queue() {
        let m = mem();
        let mut rng = MmioTransport::new(m.clone(), Box::new(Rng::new(None)), interrupt()).unwrap();
        let state = rng.pause().unwrap();
        assert!(!state.activated);
        let disk = std::env::temp_dir().join(format!("forkvm-mmio-{}", std::process::id()));
        std::fs::write(&disk, [0u8; 512]).unwrap();
        let block = Block::open(&disk, "d").unwrap();
        std::fs::remove_file(&disk).unwrap();
        let args = |device: Box<dyn VirtioDevice>| TransportArgs {
            mem: m.clone(),
            device,
            interrupt: interrupt(),
        };
        let e = MmioTransport::restore(args(Box::new(block)), &state)
            .err()
            .unwrap();
        assert!(
            matches!(e, TransportRestoreError::Mismatch { saved: 4, .. }),
            "{e}"
        );

        let mut bad = state.clone();
        bad.queues[0].0.size = 3; // not a power of two
        bad.queues[0].0.ready = true;
        let e = MmioTransport::restore(args(Box::new(Rng::new(None))), &bad)
            .err()
            .unwrap();
        assert!(
            matches!(e, TransportRestoreError::Queue { index: 0, .. }),
            "{e}"
        );
    }

    #[test]
    fn a_configuration_change_raises_its_interrupt_and_moves_the_generation_on() {
        let irq = EventFd::new(vmm_sys_util::eventfd::EFD_NONBLOCK).unwrap();
        let int = Arc::new(VirtioInterrupt::new(irq.try_clone().unwrap()));
        let slot = Block::empty("forkvm-slot0");
        let mut t = MmioTransport::new(mem(), Box::new(slot), int).unwrap();
        let before = r(&mut t, CONFIG_GENERATION);
        t.notify_config_change().unwrap();
        assert_eq!(r(&mut t, CONFIG_GENERATION), before.wrapping_add(1));
        assert_eq!(
            r(&mut t, INTERRUPT_STATUS),
            super::super::VIRTIO_MMIO_INT_CONFIG
        );
        assert_eq!(irq.read().unwrap(), 1, "the line was raised");
        w(&mut t, INTERRUPT_ACK, super::super::VIRTIO_MMIO_INT_CONFIG);
        assert_eq!(r(&mut t, INTERRUPT_STATUS), 0, "acknowledged");
        // An empty slot's capacity: 0 sectors.
        assert_eq!(r(&mut t, CONFIG_SPACE_OFFSET), 0);
    }
}
