//! The virtio-mmio transport (virtio 1.x, version 2 register layout).

use std::sync::Arc;

use virtio_queue::{Queue, QueueT};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::{VirtioDevice, VirtioInterrupt};
use crate::bus::BusDevice;

const MAGIC: u32 = 0x7472_6976; // "virt"
const VERSION: u32 = 2;
const VENDOR_ID: u32 = 0x4b46_5646; // "FVFK"
/// Offset of the queue-notify register (where ioeventfds are registered).
pub const NOTIFY_REG_OFFSET: u64 = 0x50;
const CONFIG_SPACE_OFFSET: u64 = 0x100;

const STATUS_ACKNOWLEDGE: u32 = 1;
const STATUS_DRIVER: u32 = 2;
const STATUS_DRIVER_OK: u32 = 4;
const STATUS_FEATURES_OK: u32 = 8;
const STATUS_FAILED: u32 = 0x80;

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
    activated: bool,
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
            activated: false,
        })
    }

    /// The eventfds guest notifications for each queue should signal.
    pub fn queue_evts(&self) -> &[EventFd] {
        &self.queue_evts
    }

    fn selected_queue(&mut self) -> Option<&mut Queue> {
        self.queues.get_mut(self.queue_select as usize)
    }

    fn reset(&mut self) {
        if self.activated {
            self.device.reset();
            self.activated = false;
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
        if !self.activated && status & ready == ready && status & STATUS_FAILED == 0 {
            self.activate();
        }
    }

    fn activate(&mut self) {
        if let Some(i) = self
            .queues
            .iter()
            .position(|q| q.ready() && !q.is_valid(&self.mem))
        {
            tracing::warn!("virtio: driver made queue {i} ready with an invalid layout");
            self.status |= STATUS_FAILED;
            return;
        }
        let evts = match self
            .queue_evts
            .iter()
            .map(EventFd::try_clone)
            .collect::<std::io::Result<Vec<_>>>()
        {
            Ok(e) => e,
            Err(e) => {
                tracing::error!("virtio: cannot clone queue eventfds: {e}");
                self.status |= STATUS_FAILED;
                return;
            }
        };
        // The queues move into the device; reset() makes fresh ones.
        let queues = std::mem::take(&mut self.queues);
        match self.device.activate(
            self.mem.clone(),
            self.acked_features,
            queues,
            evts,
            self.interrupt.clone(),
        ) {
            Ok(()) => self.activated = true,
            Err(e) => {
                tracing::error!("virtio device activation failed: {e}");
                self.status |= STATUS_FAILED;
            }
        }
    }

    fn read_reg(&mut self, offset: u64) -> u32 {
        match offset {
            0x00 => MAGIC,
            0x04 => VERSION,
            0x08 => self.device.device_type(),
            0x0c => VENDOR_ID,
            0x10 => {
                let f = self.device.avail_features();
                match self.features_select {
                    0 => f as u32,
                    1 => (f >> 32) as u32,
                    _ => 0,
                }
            }
            0x34 => self.selected_queue().map_or(0, |q| u32::from(q.max_size())),
            0x44 => self.selected_queue().map_or(0, |q| u32::from(q.ready())),
            0x60 => self.interrupt.status(),
            0x70 => self.status,
            0xfc => self.config_generation,
            _ => 0,
        }
    }

    fn write_reg(&mut self, offset: u64, v: u32) {
        // Queue and feature setup is only allowed before the device runs.
        let setup = !self.activated;
        let low = |q: &mut Queue, f: fn(&mut Queue, Option<u32>, Option<u32>)| f(q, Some(v), None);
        let high = |q: &mut Queue, f: fn(&mut Queue, Option<u32>, Option<u32>)| f(q, None, Some(v));
        match offset {
            0x14 => self.features_select = v,
            0x20 if setup => {
                let shift = match self.acked_features_select {
                    0 => 0,
                    1 => 32,
                    _ => return,
                };
                let offered = self.device.avail_features();
                self.acked_features |= (u64::from(v) << shift) & offered;
            }
            0x24 => self.acked_features_select = v,
            0x30 => self.queue_select = v,
            0x38 if setup => {
                if let Some(q) = self.selected_queue() {
                    q.set_size(v as u16);
                }
            }
            0x44 if setup => {
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
            0x64 => self.interrupt.ack(v),
            0x70 => self.set_status(v),
            0x80 | 0x84 | 0x90 | 0x94 | 0xa0 | 0xa4 if setup => {
                if let Some(q) = self.queues.get_mut(self.queue_select as usize) {
                    let f: fn(&mut Queue, Option<u32>, Option<u32>) = match offset {
                        0x80 | 0x84 => QueueT::set_desc_table_address,
                        0x90 | 0x94 => QueueT::set_avail_ring_address,
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
