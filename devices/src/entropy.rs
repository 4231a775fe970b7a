//! The forkvm entropy port: each read returns fresh random bytes from the host's
//! getrandom(), so a clone can reseed its kernel RNG (docs/clone-uniqueness.md).
//!
//! | port  | read (any width)      | write   |
//! |-------|-----------------------|---------|
//! | 0xf50 | host random bytes     | ignored |

use serde::{Deserialize, Serialize};

use crate::bus::BusDevice;
use crate::persist::Persist;

/// Port base.
pub const ENTROPY_BASE: u64 = 0xf50;
/// Ports decoded.
pub const ENTROPY_LEN: u64 = 4;

/// The entropy port device.
#[derive(Debug, Default)]
pub struct EntropyPort {
    failures: u64,
}

impl EntropyPort {
    /// A new entropy port.
    pub fn new() -> Self {
        Self::default()
    }
}

/// The entropy port's state: how many reads failed (only the first is logged).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct EntropyState {
    /// Failed reads so far.
    pub failures: u64,
}

impl Persist for EntropyPort {
    type State = EntropyState;
    type ConstructorArgs = ();
    type Error = std::convert::Infallible;

    fn save(&self) -> EntropyState {
        EntropyState {
            failures: self.failures,
        }
    }

    fn restore(_: (), state: &EntropyState) -> Result<Self, Self::Error> {
        Ok(Self {
            failures: state.failures,
        })
    }
}

impl BusDevice for EntropyPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        if let Err(e) = crate::util::host_random(data) {
            // Never hand out predictable bytes: all ones tells the guest it failed.
            data.fill(0xff);
            if self.failures == 0 {
                tracing::warn!("entropy port: getrandom failed: {e}");
            }
            self.failures += 1;
        }
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_differ() {
        let mut p = EntropyPort::new();
        let mut a = [0u8; 4];
        let mut b = [0u8; 4];
        let mut same = 0;
        for _ in 0..8 {
            p.read(0, &mut a);
            p.read(0, &mut b);
            same += usize::from(a == b);
        }
        // Eight equal 32-bit pairs in a row would mean the port is not random.
        assert!(same < 8);
    }
}
