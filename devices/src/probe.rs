//! The forkvm probe port: a tiny test device guests use to identify the VMM, learn the
//! vCPU count and report values to the host (see docs/guest-abi.md).
//!
//! | port   | read                     | write (32-bit)            |
//! |--------|--------------------------|---------------------------|
//! | 0xf40  | magic `FKVM` (0x4d564b46) | record a value            |
//! | 0xf44  | number of vCPUs          | ignored                   |

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::bus::BusDevice;
use crate::persist::Persist;
use crate::util::{fill_le, monotonic_ns, read_le};

/// Port base.
pub const PROBE_BASE: u64 = 0xf40;
/// Number of ports decoded.
pub const PROBE_LEN: u64 = 8;
/// Value read from the magic register: the bytes "FKVM".
pub const PROBE_MAGIC: u32 = u32::from_le_bytes(*b"FKVM");

/// What the guest reported, readable by the VMM from any thread.
#[derive(Debug, Default)]
pub struct ProbeStats {
    writes: AtomicU64,
    last: AtomicU32,
    first_write_ns: AtomicU64,
}

impl ProbeStats {
    /// Number of values the guest wrote.
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Acquire)
    }
    /// The last value the guest wrote.
    pub fn last(&self) -> u32 {
        self.last.load(Ordering::Acquire)
    }
    /// Host CLOCK_MONOTONIC (ns) of the first write, 0 before any: in a clone, when its
    /// guest code first ran after the clone point (benchmarks use it).
    pub fn first_write_ns(&self) -> u64 {
        self.first_write_ns.load(Ordering::Acquire)
    }
}

/// The probe device.
pub struct ProbePort {
    vcpus: u32,
    stats: Arc<ProbeStats>,
}

impl ProbePort {
    /// A probe reporting `vcpus` vCPUs and recording writes into `stats`.
    pub fn new(vcpus: u32, stats: Arc<ProbeStats>) -> Self {
        Self { vcpus, stats }
    }
}

/// The probe's state: the vCPU count it reports. What the guest wrote is not carried:
/// a clone counts its own writes (its first one times its start).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProbeState {
    /// vCPUs reported.
    pub vcpus: u32,
}

impl Persist for ProbePort {
    type State = ProbeState;
    /// Where the new VM's probe records writes.
    type ConstructorArgs = Arc<ProbeStats>;
    type Error = std::convert::Infallible;

    fn save(&self) -> ProbeState {
        ProbeState { vcpus: self.vcpus }
    }

    fn restore(stats: Arc<ProbeStats>, state: &ProbeState) -> Result<Self, Self::Error> {
        Ok(Self::new(state.vcpus, stats))
    }
}

impl BusDevice for ProbePort {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let value = match offset {
            0 => PROBE_MAGIC,
            4 => self.vcpus,
            _ => u32::MAX,
        };
        fill_le(data, value);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if offset != 0 {
            return;
        }
        let value = read_le(data);
        if self.stats.writes.fetch_add(1, Ordering::AcqRel) == 0 {
            self.stats
                .first_write_ns
                .store(monotonic_ns(), Ordering::Release);
        }
        self.stats.last.store(value, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn magic_count_and_writes() {
        let stats = Arc::new(ProbeStats::default());
        let mut p = ProbePort::new(4, stats.clone());
        let mut d = [0u8; 4];
        p.read(0, &mut d);
        assert_eq!(&d, b"FKVM");
        p.read(4, &mut d);
        assert_eq!(u32::from_le_bytes(d), 4);
        p.write(0, &0x101u32.to_le_bytes());
        p.write(0, &[0x7]);
        p.write(4, &[0x9]);
        assert_eq!(stats.writes(), 2);
        assert_eq!(stats.last(), 7);
        let first = stats.first_write_ns();
        assert!(first > 0 && first <= monotonic_ns());
        p.write(0, &[0x8]);
        assert_eq!(
            stats.first_write_ns(),
            first,
            "only the first write is timed"
        );
    }
}
