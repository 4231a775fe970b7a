//! An address bus (port I/O or MMIO) that routes guest accesses to devices.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

/// A device that answers guest reads and writes on a bus.
///
/// `offset` is relative to the base address the device was inserted at.
pub trait BusDevice: Send {
    /// Guest reads `data.len()` bytes at `offset`.
    fn read(&mut self, offset: u64, data: &mut [u8]);
    /// Guest writes `data` at `offset`.
    fn write(&mut self, offset: u64, data: &[u8]);
}

/// Errors from building a bus.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum BusError {
    /// The range overlaps a device already on the bus.
    #[error("bus range {base:#x}+{len:#x} overlaps an existing device")]
    Overlap {
        /// Base of the rejected range.
        base: u64,
        /// Length of the rejected range.
        len: u64,
    },
    /// A zero-length or wrapping range.
    #[error("invalid bus range {base:#x}+{len:#x}")]
    InvalidRange {
        /// Base of the rejected range.
        base: u64,
        /// Length of the rejected range.
        len: u64,
    },
}

#[derive(Clone)]
struct Entry {
    len: u64,
    device: Arc<Mutex<dyn BusDevice>>,
}

/// Maps address ranges to devices. Cloning shares the devices.
#[derive(Clone, Default)]
pub struct Bus {
    ranges: BTreeMap<u64, Entry>,
}

impl Bus {
    /// An empty bus.
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts `device` at `[base, base + len)`.
    pub fn insert(
        &mut self,
        device: Arc<Mutex<dyn BusDevice>>,
        base: u64,
        len: u64,
    ) -> Result<(), BusError> {
        let end = base
            .checked_add(len)
            .filter(|_| len > 0)
            .ok_or(BusError::InvalidRange { base, len })?;
        let overlaps_prev = self
            .ranges
            .range(..end)
            .next_back()
            .is_some_and(|(b, e)| b + e.len > base);
        if overlaps_prev {
            return Err(BusError::Overlap { base, len });
        }
        self.ranges.insert(base, Entry { len, device });
        Ok(())
    }

    fn find(&self, addr: u64, size: usize) -> Option<(u64, &Entry)> {
        let (base, entry) = self.ranges.range(..=addr).next_back()?;
        let offset = addr - base;
        (offset + size as u64 <= entry.len).then_some((offset, entry))
    }

    /// Dispatches a read. Returns false (and fills `data` with 0xff, as an open bus
    /// reads) when no device covers the access.
    pub fn read(&self, addr: u64, data: &mut [u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((offset, entry)) => {
                lock(&entry.device).read(offset, data);
                true
            }
            None => {
                data.fill(0xff);
                false
            }
        }
    }

    /// Dispatches a write. Returns false when no device covers the access.
    pub fn write(&self, addr: u64, data: &[u8]) -> bool {
        match self.find(addr, data.len()) {
            Some((offset, entry)) => {
                lock(&entry.device).write(offset, data);
                true
            }
            None => false,
        }
    }
}

/// Locks a device, recovering it if another thread panicked while holding the lock:
/// device state is plain data and stays usable, and one vCPU's panic must not take
/// every other vCPU down with it.
fn lock(device: &Mutex<dyn BusDevice>) -> std::sync::MutexGuard<'_, dyn BusDevice + 'static> {
    device
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Echo {
        last: Vec<(u64, Vec<u8>)>,
    }
    impl BusDevice for Echo {
        fn read(&mut self, offset: u64, data: &mut [u8]) {
            data.fill(offset as u8);
        }
        fn write(&mut self, offset: u64, data: &[u8]) {
            self.last.push((offset, data.to_vec()));
        }
    }

    #[test]
    fn routes_by_range_and_offset() {
        let dev = Arc::new(Mutex::new(Echo::default()));
        let mut bus = Bus::new();
        bus.insert(dev.clone(), 0x3f8, 8).unwrap();
        let mut b = [0u8; 1];
        assert!(bus.read(0x3fa, &mut b));
        assert_eq!(b[0], 2);
        assert!(bus.write(0x3ff, &[7]));
        assert_eq!(dev.lock().unwrap().last, vec![(7, vec![7])]);
        assert!(!bus.read(0x400, &mut b));
        assert_eq!(b[0], 0xff);
        // An access that starts inside but runs past the end is not routed.
        let mut w = [0u8; 4];
        assert!(!bus.read(0x3fe, &mut w));
    }

    #[test]
    fn rejects_overlaps_and_bad_ranges() {
        let mut bus = Bus::new();
        let d = || Arc::new(Mutex::new(Echo::default())) as Arc<Mutex<dyn BusDevice>>;
        bus.insert(d(), 0x100, 0x10).unwrap();
        assert_eq!(
            bus.insert(d(), 0x10f, 1),
            Err(BusError::Overlap {
                base: 0x10f,
                len: 1
            })
        );
        assert_eq!(
            bus.insert(d(), 0xf8, 0x10),
            Err(BusError::Overlap {
                base: 0xf8,
                len: 0x10
            })
        );
        assert!(bus.insert(d(), 0x110, 1).is_ok());
        assert!(bus.insert(d(), 0xf0, 0x10).is_ok());
        assert_eq!(
            bus.insert(d(), 0x200, 0),
            Err(BusError::InvalidRange {
                base: 0x200,
                len: 0
            })
        );
        assert!(bus.insert(d(), u64::MAX, 2).is_err());
    }
}
