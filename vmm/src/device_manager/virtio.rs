//! The virtio devices of a VM: attached in a fixed order (disks, entropy, vsock, network
//! card), each on its own MMIO window and interrupt line, made fresh or, in a clone,
//! restored from its saved state; their workers paused, resumed and described; the disks'
//! overlays copied for clones and kept when a VM ends.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::{Arc, Mutex};

use api_types::vm::{VirtioDeviceInfo, VirtioKind};
use devices::virtio::block::overlay::{Overlay, OverlayError, OverlaySnapshot};
use devices::virtio::block::{Block, BlockArgs, Medium};
use devices::virtio::mmio::{TransportArgs, NOTIFY_REG_OFFSET};
use devices::virtio::net::{open_tap, Net, NetArgs};
use devices::virtio::rng::Rng;
use devices::virtio::vsock::Vsock;
use devices::virtio::{
    ActivateError, MmioTransport, MmioTransportState, VirtioDevice, VirtioInterrupt, VirtioPersist,
};
use devices::{DeviceStates, Persist};
use kvm_ioctls::{IoEventAddress, VmFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use super::{lock, DeviceError, DeviceManager};
use crate::arch::x86_64::layout::{VIRTIO_MMIO_SIZE, VIRTIO_MMIO_START};
use crate::arch::x86_64::mptable::{IOAPIC_PINS, VIRTIO_FIRST_GSI};
use crate::config::{DiskConfig, VmConfig};

/// The device's own state in `state`, which must be a `D`'s (None: not restoring).
pub(super) fn device_state<D: VirtioPersist>(
    state: Option<&MmioTransportState>,
) -> Result<Option<&D::State>, DeviceError> {
    match state {
        None => Ok(None),
        Some(s) => D::unwrap(&s.device)
            .map(Some)
            .ok_or(DeviceError::DeviceKind { want: D::KIND }),
    }
}

/// What a clone needs to rebuild its parent's virtio devices.
pub struct VirtioRestore<'a> {
    /// Every device's saved state (the virtio devices' are read, in bus order).
    pub states: &'a DeviceStates,
    /// The parent's open disk images, inherited by fork, in device order.
    pub disk_fds: &'a [RawFd],
    /// The copies of the parent's disk overlays made for this clone, in disk order, then
    /// its slots' (None for a read-only disk or slot; their descriptors inherited by
    /// fork).
    pub overlays: &'a [Option<OverlaySnapshot>],
    /// The parent's disk slots' media, in slot order (their descriptors inherited by
    /// fork; `DeviceManager::slot_media`).
    pub slots: &'a [Option<(RawFd, std::path::PathBuf)>],
    /// The images this clone's request inserts into its slots.
    pub media: &'a [super::Inserted],
}

impl DeviceManager {
    /// A copy of each writable disk's overlay for a clone, in disk order, then each
    /// slot's (None for a read-only disk or slot). Call it while the disks' workers are
    /// parked.
    pub fn snapshot_overlays(&self) -> Result<Vec<Option<OverlaySnapshot>>, OverlayError> {
        self.overlays
            .iter()
            .map(|o| {
                o.as_ref()
                    .map(|o| o.lock().unwrap_or_else(|p| p.into_inner()).snapshot())
                    .transpose()
            })
            .collect()
    }

    /// Writes a copy of each writable disk's overlay to the path `path_of` gives its
    /// index ([`Overlay::save_copy`]); returns the bytes of each (their length). Call
    /// it while the disks' workers are parked (a paused VM).
    pub fn save_overlays(
        &self,
        path_of: impl Fn(usize) -> std::path::PathBuf,
    ) -> Result<u64, OverlayError> {
        let mut bytes = 0;
        for (i, o) in self.overlays.iter().enumerate() {
            if let Some(o) = o {
                let o = lock(o);
                o.save_copy(&path_of(i))?;
                bytes += o.size();
            }
        }
        Ok(bytes)
    }

    /// Whether a writable disk may have no spare overlay file made for the next clone.
    /// The event loop asks: an overlay its disk's worker holds (during a request, a
    /// flush may take milliseconds) is not waited for and counts as wanting one.
    pub fn wants_spare_overlays(&self) -> bool {
        self.overlays
            .iter()
            .flatten()
            .any(|o| o.try_lock().map_or(true, |o| o.wants_spare().is_some()))
    }

    /// Makes each writable disk's spare overlay file for the next clone (off the clone
    /// path; the file is made without holding the overlay, and an overlay its worker
    /// holds is skipped rather than waited for: its next clone makes its own file). A
    /// failure is logged, with the same effect, and the answer is false (try again
    /// later: a full directory may have room once a clone's overlay is gone).
    pub fn make_spare_overlays(&self) -> bool {
        let mut made_all = true;
        for o in self.overlays.iter().flatten() {
            let Some((dir, size)) = o.try_lock().ok().and_then(|o| o.wants_spare()) else {
                continue;
            };
            match Overlay::new_spare(&dir, size) {
                Ok(f) => {
                    if let Ok(mut o) = o.try_lock() {
                        o.set_spare(f);
                    }
                }
                Err(e) => {
                    tracing::warn!("spare overlay file: {e}");
                    made_all = false;
                }
            }
        }
        made_all
    }

    /// Descriptors of the open disk images (kept open across fork for clones).
    pub fn disk_fds(&self) -> &[RawFd] {
        &self.disk_fds
    }

    /// Attaches the virtio devices `config` asks for, in a fixed order: the disks
    /// (virtio-blk, `/dev/vda`, `/dev/vdb`, ...), the entropy device, the socket device,
    /// the network card. With `restore` (a clone), each continues from its saved state
    /// and disks use the inherited descriptors.
    pub fn add_virtio_devices(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemoryMmap,
        config: &VmConfig,
        restore: Option<&VirtioRestore<'_>>,
    ) -> Result<(), DeviceError> {
        let saved: Option<Vec<&MmioTransportState>> = restore.map(|r| r.states.virtio().collect());
        for (i, disk) in config.machine.disks.iter().enumerate() {
            let state = self.next_saved(saved.as_deref())?;
            let block = self.open_disk(i, disk, restore, state)?;
            let info = VirtioKind::Block {
                path: disk.path.clone(),
                read_only: disk.cow_dir.is_none(),
                cow_dir: disk.cow_dir.clone(),
                keep: disk.keep,
                rate_limit: disk.rate_limit,
            };
            self.add_virtio(vm, mem, Box::new(block), info, state)?;
        }
        for slot in 0..config.machine.disk_slots {
            let state = self.next_saved(saved.as_deref())?;
            let cow = config.machine.slot_cow_dir.as_deref();
            let (block, medium) = self.open_slot(slot, cow, restore, state)?;
            let writable = block.overlay().is_some();
            let info = VirtioKind::Slot {
                slot,
                medium,
                writable,
            };
            self.add_virtio(vm, mem, Box::new(block), info, state)?;
        }
        if let Some(rng) = &config.machine.rng {
            let state = self.next_saved(saved.as_deref())?;
            let device = match device_state::<Rng>(state)? {
                Some(s) => {
                    let Ok(rng) = Rng::restore(rng.rate_limit, s);
                    rng
                }
                None => Rng::new(rng.rate_limit),
            };
            let info = VirtioKind::Rng {
                rate_limit: rng.rate_limit,
            };
            self.add_virtio(vm, mem, Box::new(device), info, state)?;
        }
        // A clone's host sides (socket, tap) are opened once its vCPUs run
        // (open_host_endpoints).
        if let Some(v) = &config.machine.vsock {
            let state = self.next_saved(saved.as_deref())?;
            let vsock = match device_state::<Vsock>(state)? {
                Some(s) => Vsock::restore(v.uds_path.clone(), s)?,
                None => Vsock::new(v.cid, &v.uds_path, false)?,
            };
            let info = VirtioKind::Vsock {
                cid: v.cid,
                uds_path: v.uds_path.clone(),
            };
            self.add_virtio(vm, mem, Box::new(vsock), info, state)?;
        }
        if let Some(n) = &config.machine.net {
            let state = self.next_saved(saved.as_deref())?;
            let net = match device_state::<Net>(state)? {
                Some(s) => {
                    let args = NetArgs {
                        tap: n.tap.clone(),
                        mac: n.mac.0,
                        limit: n.rate_limit,
                    };
                    Net::restore(args, s)?
                }
                None => Net::new(open_tap(&n.tap)?, n.mac.0, n.rate_limit),
            };
            let info = VirtioKind::Net {
                tap: n.tap.clone(),
                mac: n.mac,
                rate_limit: n.rate_limit,
            };
            self.add_virtio(vm, mem, Box::new(net), info, state)?;
        }
        if let Some(saved) = &saved {
            if saved.len() != self.virtio.len() {
                return Err(DeviceError::DeviceCount {
                    saved: saved.len(),
                    configured: self.virtio.len(),
                });
            }
        }
        Ok(())
    }

    /// The saved state of the virtio device added next (None: not restoring).
    fn next_saved<'s>(
        &self,
        saved: Option<&[&'s MmioTransportState]>,
    ) -> Result<Option<&'s MmioTransportState>, DeviceError> {
        let Some(saved) = saved else { return Ok(None) };
        let index = self.virtio.len();
        match saved.get(index) {
            Some(s) => Ok(Some(*s)),
            None => Err(DeviceError::DeviceCount {
                saved: saved.len(),
                configured: index + 1,
            }),
        }
    }

    /// Disk `i` (serial `forkvm-disk<i>`): its image opened and its overlay made, or,
    /// restoring (`state`), a clone's inherited descriptor and overlay copy taken over.
    fn open_disk(
        &mut self,
        i: usize,
        disk: &DiskConfig,
        restore: Option<&VirtioRestore<'_>>,
        state: Option<&MmioTransportState>,
    ) -> Result<Block, DeviceError> {
        let saved = device_state::<Block>(state)?;
        let block = match (restore, saved) {
            (Some(r), Some(saved)) => {
                let fd = *r.disk_fds.get(i).ok_or(DeviceError::DiskCount {
                    saved: r.disk_fds.len(),
                    configured: i + 1,
                })?;
                // A copy of the descriptor: the inherited one stays open for the devices
                // a rewound clone makes at its next launch (`cloning/rewind.rs`).
                // SAFETY: a descriptor of the parent's open disk image, kept open across
                // fork by the clone for as long as it lives; borrowed for the copy.
                let file = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }
                    .try_clone_to_owned()
                    .map(File::from)
                    .map_err(DeviceError::DiskCopy)?;
                let overlay = match (&disk.cow_dir, r.overlays.get(i).and_then(Option::as_ref)) {
                    (Some(dir), Some(s)) => {
                        // SAFETY: the snapshot's descriptor, made by the parent for this
                        // clone and kept open across fork; the parent's object owning it
                        // is never used or dropped here, so this is its only owner.
                        let file = unsafe { File::from_raw_fd(s.file.as_raw_fd()) };
                        Some(Overlay::from_snapshot(s.inherited(file), dir, saved.size()))
                    }
                    (Some(_), None) => return Err(DeviceError::NoOverlayCopy(i)),
                    (None, _) => None,
                };
                let args = BlockArgs {
                    medium: Medium::Saved(file),
                    shown: disk.path.display().to_string(),
                    overlay,
                    limit: disk.rate_limit,
                };
                Block::restore(args, saved)?
            }
            _ => {
                let block = Block::open(&disk.path, &format!("forkvm-disk{i}"))?;
                let block = block.with_rate_limit(disk.rate_limit);
                match &disk.cow_dir {
                    Some(dir) => {
                        let overlay = Overlay::create(dir, block.size())?;
                        block.with_overlay(overlay)
                    }
                    None => block,
                }
            }
        };
        self.overlays.push(block.overlay());
        // A configured disk always has its image (only a disk slot can be empty).
        if let Some(f) = block.file() {
            self.disk_fds.push(f.as_raw_fd());
        }
        Ok(block)
    }

    /// For a VM that has ended: parks the device workers and names the overlays of the
    /// `disks` (the configuration these devices were made from) that keep theirs
    /// ([`DiskConfig::kept_path`]). Failures are logged; nothing else can be done about
    /// them at this point.
    pub fn keep_overlays(&self, disks: &[DiskConfig]) {
        let pid = std::process::id() as i32;
        let kept: Vec<_> = (disks.iter().enumerate())
            .map(|(i, d)| d.kept_path(i, pid))
            .collect();
        if kept.iter().all(Option::is_none) {
            return;
        }
        if let Err(e) = self.pause_virtio() {
            tracing::warn!("keeping overlays: a device worker did not park: {e}");
        }
        for (overlay, path) in self.overlays.iter().zip(&kept) {
            let (Some(o), Some(path)) = (overlay, path) else {
                continue;
            };
            match o.lock().unwrap_or_else(|p| p.into_inner()).keep(path) {
                Ok(()) => tracing::info!("kept a disk overlay as {}", path.display()),
                Err(e) => tracing::error!("{e}"),
            }
        }
    }

    /// Opens the host sides (tap, vsock socket) of a clone's devices: called once its
    /// vCPUs run and before it reports ready, so they are off the clone's latency path
    /// and there when its parent answers.
    pub fn open_host_endpoints(&self) -> Result<(), DeviceError> {
        self.each_restored(MmioTransport::open_host)
    }

    /// Starts the workers of devices a clone restored as running: called once its
    /// vCPUs run, so starting threads is off the clone's latency path.
    pub fn start_restored_virtio(&self) -> Result<(), DeviceError> {
        self.each_restored(MmioTransport::start_restored)
    }

    /// Runs one step of a clone's device restore on every virtio device, in bus order;
    /// the first failure names its device.
    fn each_restored(
        &self,
        mut step: impl FnMut(&mut MmioTransport) -> Result<(), ActivateError>,
    ) -> Result<(), DeviceError> {
        for t in &self.virtio {
            let mut t = lock(t);
            let device = t.name();
            step(&mut t).map_err(|e| DeviceError::Restore {
                device,
                source: e.into(),
            })?;
        }
        Ok(())
    }

    /// Copies of every virtio device's queue eventfds, registered in the VM, per device
    /// in bus order: the devices a rewound clone makes at its next launch take them
    /// ([`DeviceManager::reuse_queue_evts`], `cloning/rewind.rs`). Their interrupts'
    /// irqfds go when their eventfds close, with the devices.
    pub fn keep_queue_evts(&self) -> Result<Vec<Vec<EventFd>>, DeviceError> {
        let copies = self.virtio.iter().map(|t| {
            let t = lock(t);
            t.queue_evts()
                .iter()
                .map(EventFd::try_clone)
                .collect::<Result<Vec<_>, _>>()
        });
        copies
            .collect::<Result<Vec<_>, _>>()
            .map_err(DeviceError::EventFd)
    }

    /// Whether the VM has any virtio device.
    pub fn has_virtio(&self) -> bool {
        !self.virtio.is_empty()
    }

    /// The virtio devices as `GET /vm` shows them: type, MMIO base, GSI, whether the
    /// driver started it, and its own settings.
    pub fn describe_virtio(&self) -> Vec<VirtioDeviceInfo> {
        self.virtio
            .iter()
            .zip(&self.virtio_info)
            .map(|(t, info)| {
                let t = lock(t);
                VirtioDeviceInfo {
                    active: t.is_active(),
                    rate_limiters: t.limiter_reports(),
                    ..info.clone()
                }
            })
            .collect()
    }

    /// Lets every virtio device's worker go on.
    pub fn resume_virtio(&self) {
        for t in &self.virtio {
            let mut t = lock(t);
            if let Err(e) = t.resume() {
                tracing::error!("cannot resume {}: {e}", t.name());
            }
        }
    }

    fn add_virtio(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemoryMmap,
        device: Box<dyn VirtioDevice>,
        kind: VirtioKind,
        saved: Option<&MmioTransportState>,
    ) -> Result<(), DeviceError> {
        let index = self.virtio.len();
        let gsi = VIRTIO_FIRST_GSI + index as u32;
        if gsi >= u32::from(IOAPIC_PINS) {
            return Err(DeviceError::NoIrq);
        }
        let base = VIRTIO_MMIO_START + index as u64 * VIRTIO_MMIO_SIZE;
        let irq = EventFd::new(0).map_err(DeviceError::EventFd)?;
        vm.register_irqfd(&irq, gsi)
            .map_err(|source| DeviceError::Irqfd { gsi, source })?;
        let interrupt = Arc::new(VirtioInterrupt::new(irq));
        let name = device.name();
        let transport = match saved {
            None => {
                MmioTransport::new(mem.clone(), device, interrupt).map_err(DeviceError::EventFd)?
            }
            Some(state) => {
                let args = TransportArgs {
                    mem: mem.clone(),
                    device,
                    interrupt,
                };
                MmioTransport::restore(args, state).map_err(|source| DeviceError::Restore {
                    device: name,
                    source,
                })?
            }
        };
        let reused = (self.reused_evts.get_mut(index)).map(std::mem::take);
        let transport = match reused.filter(|e| !e.is_empty()) {
            Some(evts) => {
                transport
                    .with_queue_evts(evts)
                    .map_err(|source| DeviceError::Restore {
                        device: name,
                        source,
                    })?
            }
            None => {
                for (i, evt) in transport.queue_evts().iter().enumerate() {
                    vm.register_ioevent(
                        evt,
                        &IoEventAddress::Mmio(base + NOTIFY_REG_OFFSET),
                        i as u32,
                    )
                    .map_err(DeviceError::Ioeventfd)?;
                }
                transport
            }
        };
        let transport = Arc::new(Mutex::new(transport));
        self.mmio
            .insert(transport.clone(), base, VIRTIO_MMIO_SIZE)?;
        self.virtio.push(transport);
        self.virtio_info.push(VirtioDeviceInfo {
            mmio_base: format!("{base:#x}"),
            gsi,
            active: false,
            kind,
            rate_limiters: Vec::new(),
        });
        self.cmdline_extra
            .push(format!("virtio_mmio.device=4K@{base:#x}:{gsi}"));
        Ok(())
    }
}
