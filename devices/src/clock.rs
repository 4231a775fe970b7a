//! The forkvm host clock port: the host's wall clock, read by a guest tool to set the
//! guest's (docs/guest-abi.md).
//!
//! A guest kernel that boots slowly loses wall-clock time before its first real
//! clocksource takes over (its early timekeeping counts timer ticks, and a slow kernel
//! misses some): on this project's PVM hosts a Linux guest comes up seconds behind.
//! Clones inherit that error with the memory. `forkvm-clone --sync-clock` reads this
//! port and shifts the guest's clock by the difference.
//!
//! | port  | read                                                                     | write   |
//! |-------|--------------------------------------------------------------------------|---------|
//! | 0xf58 | latches the host's CLOCK_REALTIME (u64 nanoseconds since the Unix epoch), then returns bytes 0.. of it | ignored |
//! | 0xf59-0xf5f | byte N.. of the latched value (e.g. a 32-bit read at 0xf5c: the high half) | ignored |
//!
//! Little endian, any width: `inl(0xf58)` then `inl(0xf5c)`, or eight byte reads from
//! 0xf58 upwards (as `/dev/port` does).

use serde::{Deserialize, Serialize};

use crate::bus::BusDevice;
use crate::persist::Persist;

/// Port base.
pub const CLOCK_BASE: u64 = 0xf58;
/// Ports decoded.
pub const CLOCK_LEN: u64 = 8;

/// The host clock port.
#[derive(Debug)]
pub struct ClockPort {
    latched: u64,
    now: fn() -> u64,
}

/// The host's CLOCK_REALTIME in nanoseconds since the Unix epoch (0 if the clock is
/// before it).
pub fn realtime_ns() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
}

impl Default for ClockPort {
    fn default() -> Self {
        Self::with_clock(realtime_ns)
    }
}

impl ClockPort {
    /// A port reading the host's wall clock.
    pub fn new() -> Self {
        Self::default()
    }

    /// A port reading `now` (for tests).
    pub fn with_clock(now: fn() -> u64) -> Self {
        Self { latched: 0, now }
    }
}

/// The clock port's state: the time latched by the last read of its base, which reads
/// of its other bytes return (a clone made between a guest's two reads gives it the
/// same value its parent would).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClockState {
    /// Latched CLOCK_REALTIME, ns.
    pub latched: u64,
}

impl Persist for ClockPort {
    type State = ClockState;
    type ConstructorArgs = ();
    type Error = std::convert::Infallible;

    fn save(&self) -> ClockState {
        ClockState {
            latched: self.latched,
        }
    }

    fn restore(_: (), state: &ClockState) -> Result<Self, Self::Error> {
        Ok(Self {
            latched: state.latched,
            now: realtime_ns,
        })
    }
}

impl BusDevice for ClockPort {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        if offset == 0 {
            self.latched = (self.now)();
        }
        let bytes = self.latched.to_le_bytes();
        for (i, b) in data.iter_mut().enumerate() {
            let at = offset as usize + i;
            *b = bytes.get(at).copied().unwrap_or(0);
        }
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU64, Ordering};

    static NOW: AtomicU64 = AtomicU64::new(0);

    fn fake() -> u64 {
        NOW.load(Ordering::SeqCst)
    }

    #[test]
    fn a_read_at_the_base_latches_and_the_rest_read_the_latched_value() {
        let mut p = ClockPort::with_clock(fake);
        NOW.store(0x1122_3344_5566_7788, Ordering::SeqCst);
        let mut low = [0u8; 4];
        p.read(0, &mut low);
        // The clock moves on between the two halves: the high half is the latched one.
        NOW.store(0xaabb_ccdd_eeff_0011, Ordering::SeqCst);
        let mut high = [0u8; 4];
        p.read(4, &mut high);
        assert_eq!(u32::from_le_bytes(low), 0x5566_7788);
        assert_eq!(u32::from_le_bytes(high), 0x1122_3344);
        // Byte-wide, as /dev/port reads.
        let mut bytes = [0u8; 8];
        for (i, b) in bytes.iter_mut().enumerate() {
            p.read(i as u64, std::slice::from_mut(b));
        }
        assert_eq!(u64::from_le_bytes(bytes), 0xaabb_ccdd_eeff_0011);
        // A wide read past the end fills zeros.
        let mut past = [0xffu8; 4];
        p.read(6, &mut past);
        assert_eq!(past, [0xbb, 0xaa, 0, 0]);
    }

    #[test]
    fn the_real_clock_is_the_hosts_wall_clock() {
        let mut p = ClockPort::new();
        let before = realtime_ns();
        let mut v = [0u8; 8];
        p.read(0, &mut v);
        let after = realtime_ns();
        let got = u64::from_le_bytes(v);
        assert!(before <= got && got <= after, "{before} {got} {after}");
    }
}
