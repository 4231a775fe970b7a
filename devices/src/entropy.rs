//! The forkvm entropy port: each read returns fresh random bytes from the host's
//! getrandom(), so a clone can reseed its kernel RNG (docs/clone-uniqueness.md).
//!
//! | port  | read (any width)      | write   |
//! |-------|-----------------------|---------|
//! | 0xf50 | host random bytes     | ignored |

use crate::bus::BusDevice;

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

fn getrandom(buf: &mut [u8]) -> bool {
    // SAFETY: getrandom writes at most buf.len() bytes into `buf`.
    let n = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    n == buf.len() as isize
}

impl BusDevice for EntropyPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        if !getrandom(data) {
            // Never hand out predictable bytes: all ones tells the guest it failed.
            data.fill(0xff);
            if self.failures == 0 {
                tracing::warn!(
                    "entropy port: getrandom failed: {}",
                    std::io::Error::last_os_error()
                );
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
