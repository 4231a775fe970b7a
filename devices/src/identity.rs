//! The forkvm identity port: tells the guest which clone it is, so a guest agent can
//! learn its identity after the clone point even when the host, not the guest, asked
//! for the clone (docs/guest-abi.md).
//!
//! | port  | read (any width, little endian)                                  | write   |
//! |-------|------------------------------------------------------------------|---------|
//! | 0xf54 | this VM's clone sequence number: 0 in an original VM, N in clone `….N` | ignored |

use crate::bus::BusDevice;
use crate::util::fill_le;

/// Port base.
pub const IDENTITY_BASE: u64 = 0xf54;
/// Ports decoded.
pub const IDENTITY_LEN: u64 = 4;

/// The identity port device.
#[derive(Debug)]
pub struct IdentityPort {
    seq: u32,
}

impl IdentityPort {
    /// The port of a VM whose clone sequence number is `seq` (0: not a clone).
    pub fn new(seq: u32) -> Self {
        Self { seq }
    }
}

impl BusDevice for IdentityPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        fill_le(data, self.seq);
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_sequence_number_at_any_width() {
        let mut p = IdentityPort::new(0x1234);
        let mut four = [0u8; 4];
        p.read(0, &mut four);
        assert_eq!(u32::from_le_bytes(four), 0x1234);
        let mut one = [0u8; 1];
        p.read(0, &mut one);
        assert_eq!(one[0], 0x34);
    }
}
