//! Creates the guest's devices, puts them on the buses and wires their interrupts.

use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use devices::clock::{ClockPort, CLOCK_BASE, CLOCK_LEN};
use devices::entropy::{EntropyPort, ENTROPY_BASE, ENTROPY_LEN};
use devices::identity::{
    IdentityBlock, IdentityPort, IDENTITY_BASE, IDENTITY_BLOCK_BASE, IDENTITY_BLOCK_LEN,
    IDENTITY_LEN,
};
use devices::legacy::{
    SerialConsole, SerialConsoleState, SerialRestoreError, COM1_BASE, COM1_GSI, COM1_LEN, I8042,
};
use devices::probe::{ProbePort, ProbeStats, PROBE_BASE, PROBE_LEN};
use devices::trigger::EventFdTrigger;
use devices::virtio::block::overlay::{Overlay, OverlayError, OverlaySnapshot};
use devices::virtio::block::{Block, BlockError};
use devices::virtio::mmio::{TransportRestoreError, NOTIFY_REG_OFFSET};
use devices::virtio::net::{open_tap, Net, TapError};
use devices::virtio::rng::Rng;
use devices::virtio::vsock::{Vsock, VsockError};
use devices::virtio::{
    ActivateError, MmioTransport, MmioTransportState, VirtioDevice, VirtioInterrupt, WorkerError,
};
use devices::{Bus, BusError};

use api_types::vm::{VirtioDeviceInfo, VirtioKind};

use crate::arch::x86_64::layout::{VIRTIO_MMIO_SIZE, VIRTIO_MMIO_START};
use crate::arch::x86_64::mptable::{IOAPIC_PINS, VIRTIO_FIRST_GSI};
use crate::config::{ConsoleSink, DiskConfig, NetConfig, VmConfig};

/// Errors creating devices.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// An eventfd could not be created.
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    /// The console file could not be created.
    #[error("cannot open console sink {path}: {source}")]
    Console {
        /// The path.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A device did not fit on its bus.
    #[error("cannot place a device on the bus: {0}")]
    Bus(#[from] BusError),
    /// The serial console state could not be restored.
    #[error(transparent)]
    SerialState(#[from] SerialRestoreError),
    /// A disk image could not be opened.
    #[error(transparent)]
    Block(#[from] BlockError),
    /// No interrupt line is left for another virtio device.
    #[error("too many virtio devices: no IOAPIC pin left")]
    NoIrq,
    /// KVM_IOEVENTFD failed.
    #[error("cannot register a virtio notification with KVM: {0}")]
    Ioeventfd(kvm_ioctls::Error),
    /// The vsock device could not be made.
    #[error(transparent)]
    Vsock(#[from] VsockError),
    /// The disk's overlay could not be made.
    #[error(transparent)]
    Overlay(#[from] OverlayError),
    /// The network card's tap could not be opened.
    #[error(transparent)]
    Tap(#[from] TapError),
    /// A clone's saved device state does not fit its devices.
    #[error("cannot restore {device}: {source}")]
    Restore {
        /// The device.
        device: &'static str,
        /// Why.
        source: TransportRestoreError,
    },
    /// The saved state lists a different set of virtio devices than the configuration.
    #[error("saved state has {saved} virtio devices, the configuration {configured}")]
    DeviceCount {
        /// Devices in the saved state.
        saved: usize,
        /// Devices the configuration makes.
        configured: usize,
    },
    /// The parent passed fewer disk descriptors than the configuration has disks.
    #[error("parent passed {saved} disk descriptors, the configuration has {configured} disks")]
    DiskCount {
        /// Descriptors passed.
        saved: usize,
        /// Disks configured.
        configured: usize,
    },
    /// A writable disk in a clone without the copy of its parent's overlay.
    #[error("no copy of disk {0}'s overlay for this clone")]
    NoOverlayCopy(usize),
    /// KVM_IRQFD failed.
    #[error("cannot register interrupt GSI {gsi} with KVM: {source}")]
    Irqfd {
        /// The GSI.
        gsi: u32,
        /// Why.
        source: kvm_ioctls::Error,
    },
}

/// The devices of one VM.
pub struct DeviceManager {
    /// Port I/O bus.
    pub pio: Bus,
    /// MMIO bus.
    pub mmio: Bus,
    /// Signalled when the guest pulses the i8042 reset line.
    pub reset_evt: EventFdTrigger,
    /// What the guest wrote to the probe port.
    pub probe: Arc<ProbeStats>,
    /// The serial console, for host input.
    pub serial: Arc<Mutex<SerialConsole>>,
    /// Kernel command-line switches the devices need.
    pub cmdline_extra: Vec<String>,
    /// The virtio devices, in bus order.
    virtio: Vec<Arc<Mutex<MmioTransport>>>,
    /// What `GET /vm` says of each virtio device (type, place, limits), in bus order.
    virtio_info: Vec<VirtioDeviceInfo>,
    /// Descriptors of the open disk images, in device order (a clone inherits them).
    disk_fds: Vec<RawFd>,
    /// Each disk's overlay (a writable disk's) or None (a read-only one), in disk order.
    overlays: Vec<Option<Arc<Mutex<Overlay>>>>,
}

/// What a clone needs to rebuild its parent's virtio devices.
pub struct VirtioRestore<'a> {
    /// Each device's saved state, in bus order.
    pub states: &'a [MmioTransportState],
    /// The parent's open disk images, inherited by fork, in device order.
    pub disk_fds: &'a [RawFd],
    /// The copies of the parent's disk overlays made for this clone, in disk order
    /// (None for a read-only disk; their descriptors inherited by fork).
    pub overlays: &'a [Option<OverlaySnapshot>],
}

fn console_writer(sink: &ConsoleSink) -> Result<Box<dyn Write + Send>, DeviceError> {
    Ok(match sink {
        ConsoleSink::Stdout => Box::new(std::io::stdout()),
        ConsoleSink::Null => Box::new(std::io::sink()),
        ConsoleSink::File(path) => {
            Box::new(File::create(path).map_err(|source| DeviceError::Console {
                path: path.display().to_string(),
                source,
            })?)
        }
    })
}

impl DeviceManager {
    /// Creates the legacy devices (serial, i8042, the probe, entropy, identity and
    /// clock ports, the identity block) for a VM configured by `config` whose clone
    /// sequence number is `clone_seq` (0 for an original VM); with `serial_state`, the
    /// console continues from it (a clone).
    pub fn new(
        vm: &VmFd,
        config: &VmConfig,
        clone_seq: u32,
        serial_state: Option<&SerialConsoleState>,
    ) -> Result<Self, DeviceError> {
        let (console, vcpus) = (&config.console, config.vcpus);
        let mut pio = Bus::new();

        let serial_irq = EventFdTrigger::new().map_err(DeviceError::EventFd)?;
        vm.register_irqfd(serial_irq.eventfd(), COM1_GSI)
            .map_err(|source| DeviceError::Irqfd {
                gsi: COM1_GSI,
                source,
            })?;
        let out = console_writer(console)?;
        let serial = match serial_state {
            None => SerialConsole::new(serial_irq, out),
            Some(state) => SerialConsole::restore(state, serial_irq, out)?,
        };
        let serial = Arc::new(Mutex::new(serial));
        pio.insert(serial.clone(), COM1_BASE, COM1_LEN)?;

        let reset_evt = EventFdTrigger::new().map_err(DeviceError::EventFd)?;
        let i8042 = I8042::new(reset_evt.try_clone().map_err(DeviceError::EventFd)?);
        pio.insert(Arc::new(Mutex::new(i8042)), I8042::BASE, I8042::LEN)?;

        let probe = Arc::new(ProbeStats::default());
        pio.insert(
            Arc::new(Mutex::new(ProbePort::new(u32::from(vcpus), probe.clone()))),
            PROBE_BASE,
            PROBE_LEN,
        )?;

        pio.insert(
            Arc::new(Mutex::new(EntropyPort::new())),
            ENTROPY_BASE,
            ENTROPY_LEN,
        )?;
        pio.insert(
            Arc::new(Mutex::new(IdentityPort::new(clone_seq))),
            IDENTITY_BASE,
            IDENTITY_LEN,
        )?;
        pio.insert(
            Arc::new(Mutex::new(ClockPort::new())),
            CLOCK_BASE,
            CLOCK_LEN,
        )?;
        let net = config.net.as_ref().map(NetConfig::identity);
        pio.insert(
            Arc::new(Mutex::new(IdentityBlock::new(net.as_ref()))),
            IDENTITY_BLOCK_BASE,
            IDENTITY_BLOCK_LEN,
        )?;

        Ok(Self {
            pio,
            mmio: Bus::new(),
            reset_evt,
            probe,
            serial,
            cmdline_extra: Vec::new(),
            virtio: Vec::new(),
            virtio_info: Vec::new(),
            disk_fds: Vec::new(),
            overlays: Vec::new(),
        })
    }

    /// A copy of each writable disk's overlay for a clone, in disk order (None for a
    /// read-only disk). Call it while the disks' workers are parked.
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
    /// failure is logged, with the same effect.
    pub fn make_spare_overlays(&self) {
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
                Err(e) => tracing::warn!("spare overlay file: {e}"),
            }
        }
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
        for (i, disk) in config.disks.iter().enumerate() {
            let block = self.open_disk(i, disk, restore)?;
            let info = VirtioKind::Block {
                path: disk.path.clone(),
                read_only: disk.cow_dir.is_none(),
                cow_dir: disk.cow_dir.clone(),
                keep: disk.keep,
                rate_limit: disk.rate_limit,
            };
            self.add_virtio(vm, mem, Box::new(block), info, restore)?;
        }
        if let Some(rng) = &config.rng {
            let info = VirtioKind::Rng {
                rate_limit: rng.rate_limit,
            };
            self.add_virtio(vm, mem, Box::new(Rng::new(rng.rate_limit)), info, restore)?;
        }
        // A clone's host sides (socket, tap) are opened once its vCPUs run
        // (open_host_endpoints).
        if let Some(v) = &config.vsock {
            let vsock = match restore {
                Some(_) => Vsock::deferred(v.cid, &v.uds_path, true)?,
                None => Vsock::new(v.cid, &v.uds_path, false)?,
            };
            let info = VirtioKind::Vsock {
                cid: v.cid,
                uds_path: v.uds_path.clone(),
            };
            self.add_virtio(vm, mem, Box::new(vsock), info, restore)?;
        }
        if let Some(n) = &config.net {
            let net = match restore {
                Some(_) => Net::deferred_tap(&n.tap, n.mac.0, n.rate_limit)?,
                None => Net::new(open_tap(&n.tap)?, n.mac.0, n.rate_limit),
            };
            let info = VirtioKind::Net {
                tap: n.tap.clone(),
                mac: n.mac,
                rate_limit: n.rate_limit,
            };
            self.add_virtio(vm, mem, Box::new(net), info, restore)?;
        }
        if let Some(r) = restore {
            if r.states.len() != self.virtio.len() {
                return Err(DeviceError::DeviceCount {
                    saved: r.states.len(),
                    configured: self.virtio.len(),
                });
            }
        }
        Ok(())
    }

    /// Disk `i` (serial `forkvm-disk<i>`): its image opened, or a clone's inherited
    /// descriptor taken over, and its overlay made, or a clone's copy taken over.
    fn open_disk(
        &mut self,
        i: usize,
        disk: &DiskConfig,
        restore: Option<&VirtioRestore<'_>>,
    ) -> Result<Block, DeviceError> {
        let id = format!("forkvm-disk{i}");
        let block = match restore {
            Some(r) => {
                let fd = *r.disk_fds.get(i).ok_or(DeviceError::DiskCount {
                    saved: r.disk_fds.len(),
                    configured: i + 1,
                })?;
                // SAFETY: a descriptor of the parent's open disk image, kept open across
                // fork by the clone; the parent's object owning it is never used or
                // dropped in the child, so this is its only owner here.
                let file = unsafe { File::from_raw_fd(fd) };
                Block::from_file(file, &disk.path.display().to_string(), &id)?
            }
            None => Block::open(&disk.path, &id)?,
        };
        let mut block = block.with_rate_limit(disk.rate_limit);
        if let Some(dir) = &disk.cow_dir {
            let snapshot = restore.map(|r| r.overlays.get(i).and_then(Option::as_ref));
            let overlay = match snapshot {
                Some(Some(s)) => {
                    // SAFETY: the snapshot's descriptor, made by the parent for this
                    // clone and kept open across fork; the parent's object owning it is
                    // never used or dropped here, so this is its only owner.
                    let file = unsafe { File::from_raw_fd(s.file.as_raw_fd()) };
                    Overlay::from_snapshot(s.inherited(file), dir, block.size())
                }
                Some(None) => return Err(DeviceError::NoOverlayCopy(i)),
                None => Overlay::create(dir, block.size())?,
            };
            block = block.with_overlay(overlay);
        }
        self.overlays.push(block.overlay());
        self.disk_fds.push(block.file().as_raw_fd());
        Ok(block)
    }

    /// Parks every virtio device's worker (all at once) and returns the devices' state
    /// (bus order). On failure every worker is let go again.
    pub fn pause_virtio(&self) -> Result<Vec<MmioTransportState>, WorkerError> {
        let mut requested = 0;
        let mut result = Ok(());
        for t in &self.virtio {
            result = lock(t).request_pause();
            if result.is_err() {
                break;
            }
            requested += 1;
        }
        // Every request is answered (even after a failure), so no stale state is left
        // for the next pause to read.
        let states: Vec<_> = self.virtio[..requested]
            .iter()
            .map(|t| lock(t).paused_state())
            .collect();
        let states = result.and_then(|()| states.into_iter().collect());
        if states.is_err() {
            self.resume_virtio();
        }
        states
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

    /// The virtio devices as `GET /vm` shows them: type, MMIO base, GSI, whether the
    /// driver started it, and its own settings.
    pub fn describe_virtio(&self) -> Vec<VirtioDeviceInfo> {
        self.virtio
            .iter()
            .zip(&self.virtio_info)
            .map(|(t, info)| VirtioDeviceInfo {
                active: lock(t).is_active(),
                ..info.clone()
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
        restore: Option<&VirtioRestore<'_>>,
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
        let transport = match restore {
            None => {
                MmioTransport::new(mem.clone(), device, interrupt).map_err(DeviceError::EventFd)?
            }
            Some(r) => {
                let state = r.states.get(index).ok_or(DeviceError::DeviceCount {
                    saved: r.states.len(),
                    configured: index + 1,
                })?;
                MmioTransport::restore(mem.clone(), device, interrupt, state).map_err(|source| {
                    DeviceError::Restore {
                        device: name,
                        source,
                    }
                })?
            }
        };
        for (i, evt) in transport.queue_evts().iter().enumerate() {
            vm.register_ioevent(
                evt,
                &IoEventAddress::Mmio(base + NOTIFY_REG_OFFSET),
                i as u32,
            )
            .map_err(DeviceError::Ioeventfd)?;
        }
        let transport = Arc::new(Mutex::new(transport));
        self.mmio
            .insert(transport.clone(), base, VIRTIO_MMIO_SIZE)?;
        self.virtio.push(transport);
        self.virtio_info.push(VirtioDeviceInfo {
            mmio_base: format!("{base:#x}"),
            gsi,
            active: false,
            kind,
        });
        self.cmdline_extra
            .push(format!("virtio_mmio.device=4K@{base:#x}:{gsi}"));
        Ok(())
    }
}

fn lock(t: &Mutex<MmioTransport>) -> std::sync::MutexGuard<'_, MmioTransport> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}
