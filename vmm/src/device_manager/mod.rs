//! Creates the guest's devices, puts them on the buses and wires their interrupts: the
//! port devices here, the virtio devices in `virtio.rs`. Every device's state is saved
//! into one list ([`DeviceManager::save`]) that a clone's devices are made from again.

mod slots;
mod virtio;

pub use slots::{open_image, Inserted, SlotChangeError};
pub use virtio::VirtioRestore;

use std::fs::File;
use std::io::Write;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

use kvm_ioctls::VmFd;
use vm_memory::GuestMemoryMmap;

use devices::clock::{ClockPort, ClockState, CLOCK_BASE, CLOCK_LEN};
use devices::crng::{CrngPort, CrngState, CrngWatch, CRNG_BASE, CRNG_LEN};
use devices::entropy::{EntropyPort, EntropyState, ENTROPY_BASE, ENTROPY_LEN};
use devices::identity::{
    IdentityBlock, IdentityBlockState, IdentityPort, IdentityState, IDENTITY_BASE,
    IDENTITY_BLOCK_BASE, IDENTITY_BLOCK_LEN, IDENTITY_LEN,
};
use devices::legacy::{
    I8042State, SerialArgs, SerialConsole, SerialConsoleState, COM1_BASE, COM1_GSI, COM1_LEN, I8042,
};
use devices::probe::{ProbePort, ProbeState, ProbeStats, PROBE_BASE, PROBE_LEN};
use devices::saved::{Restoring, SavedAs, StatefulDevice, StatesError};
use devices::trigger::EventFdTrigger;
use devices::virtio::block::overlay::{Overlay, OverlayError};
use devices::virtio::block::BlockError;
use devices::virtio::mmio::TransportRestoreError;
use devices::virtio::net::TapError;
use devices::virtio::vsock::VsockError;
use devices::virtio::{MmioTransport, WorkerError};
use devices::{Bus, BusDevice, BusError, DeviceStates};

use api_types::vm::VirtioDeviceInfo;

use crate::config::{ConsoleSink, NetConfig, VmConfig};

/// Errors creating devices.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// An eventfd could not be created.
    #[error("cannot create an eventfd: {0}")]
    EventFd(std::io::Error),
    /// A clone's inherited disk image descriptor could not be copied.
    #[error("cannot copy the disk image's descriptor: {0}")]
    DiskCopy(std::io::Error),
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
    /// A saved virtio device is of another kind than the one configured there.
    #[error("saved device state is not a {want}'s")]
    DeviceKind {
        /// The device configured.
        want: &'static str,
    },
    /// Saved device state does not fit this VM's devices.
    #[error("saved device state: {0}")]
    States(#[from] StatesError),
    /// A port device could not be made from its saved state.
    #[error("cannot restore the {device}: {why}")]
    PortRestore {
        /// The device.
        device: &'static str,
        /// Why.
        why: String,
    },
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
    /// A writable medium in a slot of a VM without a slot overlay directory.
    #[error("disk slot {0}'s medium is writable, but the VM has no slot overlay directory")]
    SlotCowDir(u8),
    /// A disk slot's image could not be taken up, or its guest not told of it.
    #[error("disk slot: {0}")]
    Slot(std::io::Error),
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
    /// Where the guest kernel keeps its CRNG key, once it registered.
    pub crng: CrngWatch,
    /// The serial console, for host input.
    pub serial: Arc<Mutex<SerialConsole>>,
    /// The port devices, in bus order, whose state [`DeviceManager::save`] lists.
    ports: Vec<Arc<Mutex<dyn StatefulDevice>>>,
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
    /// The disk slots, in slot order (`slots.rs`).
    slots: Vec<slots::Slot>,
    /// Each disk slot's medium, its open image's descriptor and path (None: empty), in
    /// slot order (a clone inherits them).
    slot_media: Vec<Option<(RawFd, std::path::PathBuf)>>,
    /// Queue eventfds registered in the VM already, by virtio device index: the next
    /// devices made take them instead of registering new ones (a rewound clone's,
    /// [`DeviceManager::reuse_queue_evts`]).
    reused_evts: Vec<Vec<vmm_sys_util::eventfd::EventFd>>,
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

/// The port bus as it is filled, with the saved states the devices continue from.
struct Ports<'a> {
    pio: Bus,
    list: Vec<Arc<Mutex<dyn StatefulDevice>>>,
    saved: Option<Restoring<'a>>,
}

impl Ports<'_> {
    /// Makes a `D` from its saved state, or from `fresh` without one, with `args`, and
    /// puts it on the bus at `base`.
    fn add<D>(
        &mut self,
        args: D::ConstructorArgs,
        fresh: D::State,
        base: u64,
        len: u64,
    ) -> Result<Arc<Mutex<D>>, DeviceError>
    where
        D: SavedAs + BusDevice + 'static,
        D::Error: std::fmt::Display,
    {
        let state = match self.saved.as_mut() {
            Some(r) => r.take::<D>()?,
            None => &fresh,
        };
        let device = D::restore(args, state).map_err(|e| DeviceError::PortRestore {
            device: D::KIND,
            why: e.to_string(),
        })?;
        let device = Arc::new(Mutex::new(device));
        self.pio.insert(device.clone(), base, len)?;
        self.list.push(device.clone());
        Ok(device)
    }
}

impl DeviceManager {
    /// Creates the port devices (serial, i8042, the probe, entropy, identity and clock
    /// ports, the identity block, the CRNG registration port) for a VM configured by
    /// `config` whose clone sequence number is `clone_seq` (0 for an original VM). With
    /// `saved` (a clone), each continues from its saved state, read in order; the virtio
    /// devices' follow, for [`DeviceManager::add_virtio_devices`].
    pub fn new(
        vm: &VmFd,
        config: &VmConfig,
        mem: &GuestMemoryMmap,
        clone_seq: u32,
        saved: Option<&DeviceStates>,
    ) -> Result<Self, DeviceError> {
        let mut ports = Ports {
            pio: Bus::new(),
            list: Vec::new(),
            saved: saved.map(Restoring::new),
        };
        let serial_irq = EventFdTrigger::new().map_err(DeviceError::EventFd)?;
        vm.register_irqfd(serial_irq.eventfd(), COM1_GSI)
            .map_err(|source| DeviceError::Irqfd {
                gsi: COM1_GSI,
                source,
            })?;
        let serial_args = SerialArgs {
            interrupt: serial_irq,
            out: console_writer(&config.host.console)?,
        };
        let serial = ports.add(
            serial_args,
            SerialConsoleState::default(),
            COM1_BASE,
            COM1_LEN,
        )?;
        let reset_evt = EventFdTrigger::new().map_err(DeviceError::EventFd)?;
        let reset = reset_evt.try_clone().map_err(DeviceError::EventFd)?;
        ports.add::<I8042>(reset, I8042State {}, I8042::BASE, I8042::LEN)?;
        let probe = Arc::new(ProbeStats::default());
        let vcpus = ProbeState {
            vcpus: u32::from(config.machine.vcpus),
        };
        ports.add::<ProbePort>(probe.clone(), vcpus, PROBE_BASE, PROBE_LEN)?;
        let fresh = EntropyState::default();
        ports.add::<EntropyPort>((), fresh, ENTROPY_BASE, ENTROPY_LEN)?;
        let seq = IdentityState { seq: clone_seq };
        ports.add::<IdentityPort>(clone_seq, seq, IDENTITY_BASE, IDENTITY_LEN)?;
        ports.add::<ClockPort>((), ClockState::default(), CLOCK_BASE, CLOCK_LEN)?;
        let net = config.machine.net.as_ref().map(NetConfig::identity);
        let block = IdentityBlockState::default();
        ports.add::<IdentityBlock>(net, block, IDENTITY_BLOCK_BASE, IDENTITY_BLOCK_LEN)?;
        let crng = CrngWatch {
            registration: Arc::default(),
            mem: mem.clone(),
        };
        ports.add::<CrngPort>(crng.clone(), CrngState::default(), CRNG_BASE, CRNG_LEN)?;
        // The rest of a saved list is the virtio devices' (add_virtio_devices).
        if let Some(states) = saved {
            let rest = states.0.len().saturating_sub(ports.list.len());
            let unknown = rest.saturating_sub(states.virtio().count());
            if unknown != 0 {
                return Err(StatesError::Left(unknown).into());
            }
        }
        Ok(Self {
            pio: ports.pio,
            mmio: Bus::new(),
            reset_evt,
            probe,
            crng,
            serial,
            ports: ports.list,
            cmdline_extra: Vec::new(),
            virtio: Vec::new(),
            virtio_info: Vec::new(),
            disk_fds: Vec::new(),
            overlays: Vec::new(),
            slots: Vec::new(),
            slot_media: Vec::new(),
            reused_evts: Vec::new(),
        })
    }

    /// The virtio devices added next take these queue eventfds (per device, in bus
    /// order), registered in the VM by devices before them (a rewound clone's:
    /// [`DeviceManager::keep_queue_evts`]): removing an ioeventfd from a VM and adding it
    /// again each waits for an SRCU grace period (3-5 ms each here).
    pub fn reuse_queue_evts(&mut self, evts: Vec<Vec<vmm_sys_util::eventfd::EventFd>>) {
        self.reused_evts = evts;
    }

    /// Every device's state, in bus order: the port devices', then the virtio devices'
    /// (whose workers must be parked, [`DeviceManager::pause_virtio`]).
    pub fn save(&self) -> DeviceStates {
        let ports = self.ports.iter().map(|d| lock(d).device_state());
        let virtio = self.virtio.iter().map(|t| lock(t).device_state());
        DeviceStates(ports.chain(virtio).collect())
    }

    /// Parks every virtio device's worker (all at once); [`DeviceManager::save`] then
    /// reads their state. On failure every worker is let go again.
    pub fn pause_virtio(&self) -> Result<(), WorkerError> {
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
        for t in &self.virtio[..requested] {
            let parked = lock(t).wait_parked();
            result = result.and(parked);
        }
        if result.is_err() {
            self.resume_virtio();
        }
        result
    }
}

fn lock<T: ?Sized>(t: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    t.lock().unwrap_or_else(|p| p.into_inner())
}
