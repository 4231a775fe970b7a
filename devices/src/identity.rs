//! The forkvm identity port: tells the guest which clone it is, so a guest agent can
//! learn its identity after the clone point even when the host, not the guest, asked
//! for the clone (docs/guest-abi.md).
//!
//! | port  | read (any width, little endian)                                  | write   |
//! |-------|------------------------------------------------------------------|---------|
//! | 0xf54 | this VM's clone sequence number: 0 in an original VM, N in clone `….N` | ignored |
//! | 0xf60-0xf7f | the identity block (below), bytes at their offsets         | ignored |
//!
//! The identity block, 32 bytes (multi-byte fields in network byte order):
//!
//! | offset | bytes | what |
//! |--------|-------|------|
//! | 0      | 8     | generation: random, different in every VM process (every clone) |
//! | 8      | 6     | the network card's MAC address (all zero: no card) |
//! | 14     | 1     | IPv4 prefix length (0: no address given) |
//! | 15     | 1     | 0 |
//! | 16     | 4     | IPv4 address for the card |
//! | 20     | 4     | IPv4 default gateway (0.0.0.0: none) |
//! | 24     | 8     | 0 |

use serde::{Deserialize, Serialize};

use crate::bus::BusDevice;
use crate::persist::Persist;
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

/// The identity port's state: the sequence number it reads. A restored VM is a new
/// one, so its own number comes from the constructor, not from here.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityState {
    /// The saved VM's clone sequence number.
    pub seq: u32,
}

impl Persist for IdentityPort {
    type State = IdentityState;
    /// The new VM's clone sequence number.
    type ConstructorArgs = u32;
    type Error = std::convert::Infallible;

    fn save(&self) -> IdentityState {
        IdentityState { seq: self.seq }
    }

    fn restore(seq: u32, _: &IdentityState) -> Result<Self, Self::Error> {
        Ok(Self::new(seq))
    }
}

impl BusDevice for IdentityPort {
    fn read(&mut self, _offset: u64, data: &mut [u8]) {
        fill_le(data, self.seq);
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

/// Base of the identity block.
pub const IDENTITY_BLOCK_BASE: u64 = 0xf60;
/// Bytes in the identity block.
pub const IDENTITY_BLOCK_LEN: u64 = 32;

/// What the guest should configure on its network card.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NetIdentity {
    /// The card's MAC address.
    pub mac: [u8; 6],
    /// Address and prefix length.
    pub ipv4: Option<(std::net::Ipv4Addr, u8)>,
    /// Default gateway.
    pub gateway: Option<std::net::Ipv4Addr>,
}

/// The identity block: the VM's generation and its card's identity.
#[derive(Debug)]
pub struct IdentityBlock {
    bytes: [u8; IDENTITY_BLOCK_LEN as usize],
}

impl IdentityBlock {
    /// The block of a VM with a new random generation (from the host's getrandom, or
    /// the time and pid should that fail) and `net` (None: no card).
    pub fn new(net: Option<&NetIdentity>) -> Self {
        let mut generation = [0u8; 8];
        if crate::util::host_random(&mut generation).is_err() {
            let t = crate::util::monotonic_ns() ^ (u64::from(std::process::id()) << 40);
            generation = t.to_be_bytes();
        }
        Self::with_generation(generation, net)
    }

    fn with_generation(generation: [u8; 8], net: Option<&NetIdentity>) -> Self {
        let mut bytes = [0u8; IDENTITY_BLOCK_LEN as usize];
        bytes[..8].copy_from_slice(&generation);
        if let Some(n) = net {
            bytes[8..14].copy_from_slice(&n.mac);
            if let Some((addr, prefix)) = n.ipv4 {
                bytes[14] = prefix;
                bytes[16..20].copy_from_slice(&addr.octets());
            }
            if let Some(gw) = n.gateway {
                bytes[20..24].copy_from_slice(&gw.octets());
            }
        }
        Self { bytes }
    }
}

/// The identity block's state: its bytes. A restored VM is a new one, with a new
/// generation and its own card's identity, so they are made again from the
/// constructor's, not from here.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct IdentityBlockState {
    /// The saved VM's block.
    pub bytes: Vec<u8>,
}

impl Persist for IdentityBlock {
    type State = IdentityBlockState;
    /// The new VM's card identity (None: no card).
    type ConstructorArgs = Option<NetIdentity>;
    type Error = std::convert::Infallible;

    fn save(&self) -> IdentityBlockState {
        IdentityBlockState {
            bytes: self.bytes.to_vec(),
        }
    }

    fn restore(net: Option<NetIdentity>, _: &IdentityBlockState) -> Result<Self, Self::Error> {
        Ok(Self::new(net.as_ref()))
    }
}

impl BusDevice for IdentityBlock {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        for (i, b) in data.iter_mut().enumerate() {
            let at = offset as usize + i;
            *b = self.bytes.get(at).copied().unwrap_or(0);
        }
    }

    fn write(&mut self, _offset: u64, _data: &[u8]) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_block_layout() {
        let net = NetIdentity {
            mac: [6, 0, 0xac, 1, 2, 3],
            ipv4: Some(("10.0.0.5".parse().unwrap(), 24)),
            gateway: Some("10.0.0.1".parse().unwrap()),
        };
        let mut b = IdentityBlock::with_generation([1, 2, 3, 4, 5, 6, 7, 8], Some(&net));
        let mut all = [0u8; 32];
        for (i, chunk) in all.chunks_mut(4).enumerate() {
            b.read(i as u64 * 4, chunk);
        }
        assert_eq!(&all[..8], &[1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(&all[8..14], &net.mac);
        assert_eq!(all[14..16], [24, 0]);
        assert_eq!(all[16..24], [10, 0, 0, 5, 10, 0, 0, 1]);
        assert_eq!(all[24..], [0; 8]);
        let mut tail = [0xffu8; 4];
        b.read(30, &mut tail);
        assert_eq!(tail, [0; 4], "bytes past the block read 0");
        let mut none = IdentityBlock::with_generation([9; 8], None);
        none.read(8, &mut tail);
        assert_eq!(tail, [0; 4], "no card: no MAC");
        let (a, c) = (IdentityBlock::new(None), IdentityBlock::new(None));
        assert_ne!(a.bytes[..8], c.bytes[..8], "generations repeat");
    }

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
