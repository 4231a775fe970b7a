//! Creates the guest's devices, puts them on the buses and wires their interrupts.

use std::fs::File;
use std::io::Write;
use std::sync::{Arc, Mutex};

use kvm_ioctls::{IoEventAddress, VmFd};
use vm_memory::GuestMemoryMmap;
use vmm_sys_util::eventfd::EventFd;

use devices::entropy::{EntropyPort, ENTROPY_BASE, ENTROPY_LEN};
use devices::legacy::{
    SerialConsole, SerialConsoleState, SerialRestoreError, COM1_BASE, COM1_GSI, COM1_LEN, I8042,
};
use devices::probe::{ProbePort, ProbeStats, PROBE_BASE, PROBE_LEN};
use devices::trigger::EventFdTrigger;
use devices::virtio::block::{Block, BlockError};
use devices::virtio::mmio::NOTIFY_REG_OFFSET;
use devices::virtio::{MmioTransport, VirtioDevice, VirtioInterrupt};
use devices::{Bus, BusError};

use crate::arch::x86_64::layout::{VIRTIO_MMIO_SIZE, VIRTIO_MMIO_START};
use crate::arch::x86_64::mptable::IOAPIC_PINS;
use crate::config::ConsoleSink;

/// First GSI (IOAPIC pin) for virtio-mmio devices; 0-4 are the PIT, keyboard, cascade,
/// and the serial ports.
const VIRTIO_FIRST_GSI: u32 = 5;

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
    virtio_count: u32,
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
    /// Creates the legacy devices (serial, i8042, probe) for a VM with `vcpus` vCPUs;
    /// with `serial_state`, the console continues from it (a clone).
    pub fn new(
        vm: &VmFd,
        console: &ConsoleSink,
        vcpus: u8,
        serial_state: Option<&SerialConsoleState>,
    ) -> Result<Self, DeviceError> {
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

        Ok(Self {
            pio,
            mmio: Bus::new(),
            reset_evt,
            probe,
            serial,
            cmdline_extra: Vec::new(),
            virtio_count: 0,
        })
    }

    /// Number of virtio devices attached.
    pub fn virtio_count(&self) -> u32 {
        self.virtio_count
    }

    /// Attaches the read-only disk image at `path` as virtio-blk (`/dev/vda` for the first).
    pub fn add_block(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemoryMmap,
        path: &std::path::Path,
        id: &str,
    ) -> Result<(), DeviceError> {
        let block = Block::open(path, id)?;
        self.add_virtio(vm, mem, Box::new(block))
    }

    fn add_virtio(
        &mut self,
        vm: &VmFd,
        mem: &GuestMemoryMmap,
        device: Box<dyn VirtioDevice>,
    ) -> Result<(), DeviceError> {
        let gsi = VIRTIO_FIRST_GSI + self.virtio_count;
        if gsi >= u32::from(IOAPIC_PINS) {
            return Err(DeviceError::NoIrq);
        }
        let base = VIRTIO_MMIO_START + u64::from(self.virtio_count) * VIRTIO_MMIO_SIZE;
        let irq = EventFd::new(0).map_err(DeviceError::EventFd)?;
        vm.register_irqfd(&irq, gsi)
            .map_err(|source| DeviceError::Irqfd { gsi, source })?;
        let transport =
            MmioTransport::new(mem.clone(), device, Arc::new(VirtioInterrupt::new(irq)))
                .map_err(DeviceError::EventFd)?;
        for (i, evt) in transport.queue_evts().iter().enumerate() {
            vm.register_ioevent(
                evt,
                &IoEventAddress::Mmio(base + NOTIFY_REG_OFFSET),
                i as u32,
            )
            .map_err(DeviceError::Ioeventfd)?;
        }
        self.mmio
            .insert(Arc::new(Mutex::new(transport)), base, VIRTIO_MMIO_SIZE)?;
        self.cmdline_extra
            .push(format!("virtio_mmio.device=4K@{base:#x}:{gsi}"));
        self.virtio_count += 1;
        Ok(())
    }
}
