//! The CRNG registration port: forkvm's guest kernel (a patch to Linux's random.c,
//! `buildroot/kernel/patches`) tells the VMM at boot where its CRNG's base key and
//! generation counter live, so that every clone's VMM reseeds the guest kernel's RNG
//! before the clone runs, with no guest code: it writes a fresh key from the host and
//! bumps the generation, and Linux derives every per-CPU key and entropy batch again
//! from the new key on its next use (docs/clone-uniqueness.md).
//!
//! | port  | read (32-bit)                 | write (32-bit)                                  |
//! |-------|-------------------------------|-------------------------------------------------|
//! | 0xf90 | 1 once registered, else 0     | the descriptor's guest-physical address, low half |
//! | 0xf94 | 0                             | its high half: reads the descriptor, registers  |
//!
//! The descriptor, little-endian, 40 bytes: magic `FKRN` (u32), version (u32, 1), the
//! key's address (u64), the generation's address (u64), the address of a u32 the
//! kernel holds non-zero while it derives or installs a key or draws output from one
//! (u64), the key's length (u32), the generation's length (u32, 8). The VMM does not
//! stop a vCPU while that counter is non-zero (a key being installed from the old state
//! would overwrite the fresh one; output drawn from it would be every clone's).

use std::sync::{Arc, RwLock};

use serde::{Deserialize, Serialize};
use vm_memory::{Bytes, GuestAddress, GuestMemory, GuestMemoryMmap};

use crate::bus::BusDevice;
use crate::persist::Persist;
use crate::util::{fill_le, host_random, read_le};

/// Port base.
pub const CRNG_BASE: u64 = 0xf90;
/// Ports decoded.
pub const CRNG_LEN: u64 = 8;
/// "FKRN": a CRNG descriptor.
pub const DESCRIPTOR_MAGIC: u32 = u32::from_le_bytes(*b"FKRN");
/// The descriptor layout's version.
pub const DESCRIPTOR_VERSION: u32 = 1;
/// Bytes of a descriptor.
pub const DESCRIPTOR_BYTES: usize = 40;
/// The largest key the VMM writes.
pub const MAX_KEY_BYTES: u32 = 64;

/// Why a registration or a reseed failed.
#[derive(Debug, thiserror::Error)]
pub enum CrngError {
    /// Guest memory could not be read or written there.
    #[error("guest memory at {addr:#x} ({what}): {why}")]
    Memory {
        /// What was read or written.
        what: &'static str,
        /// Its guest-physical address.
        addr: u64,
        /// Why.
        why: String,
    },
    /// The descriptor is not one.
    #[error("the CRNG descriptor has magic {0:#010x}, not FKRN")]
    Magic(u32),
    /// The descriptor's version is unknown.
    #[error("CRNG descriptor version {0} is not supported (1 is)")]
    Version(u32),
    /// The key or generation length is not one the VMM writes.
    #[error("CRNG {what} of {len} bytes is not supported")]
    Length {
        /// Key or generation.
        what: &'static str,
        /// Its length.
        len: u32,
    },
    /// The host has no random bytes to give.
    #[error("no host entropy: {0}")]
    Entropy(std::io::Error),
}

/// Where a registered guest kernel keeps its CRNG state (guest-physical addresses).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CrngLayout {
    /// The base key.
    pub key: u64,
    /// Its length in bytes.
    pub key_len: u32,
    /// The generation counter (u64).
    pub generation: u64,
    /// The u32 the kernel holds non-zero while it derives or uses a key.
    pub busy: u64,
}

fn field(b: &[u8; DESCRIPTOR_BYTES], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

fn half(b: &[u8; DESCRIPTOR_BYTES], at: usize) -> u32 {
    read_le(&b[at..at + 4])
}

fn memory(what: &'static str, addr: u64, e: vm_memory::GuestMemoryError) -> CrngError {
    CrngError::Memory {
        what,
        addr,
        why: e.to_string(),
    }
}

impl CrngLayout {
    /// Reads and checks the descriptor at `addr`: every place it names must be guest
    /// memory.
    pub fn read<M: GuestMemory>(mem: &M, addr: u64) -> Result<Self, CrngError> {
        let mut b = [0u8; DESCRIPTOR_BYTES];
        mem.read_slice(&mut b, GuestAddress(addr))
            .map_err(|e| memory("descriptor", addr, e))?;
        if half(&b, 0) != DESCRIPTOR_MAGIC {
            return Err(CrngError::Magic(half(&b, 0)));
        }
        if half(&b, 4) != DESCRIPTOR_VERSION {
            return Err(CrngError::Version(half(&b, 4)));
        }
        let layout = Self {
            key: field(&b, 8),
            generation: field(&b, 16),
            busy: field(&b, 24),
            key_len: half(&b, 32),
        };
        if !(16..=MAX_KEY_BYTES).contains(&layout.key_len) {
            return Err(CrngError::Length {
                what: "key",
                len: layout.key_len,
            });
        }
        if half(&b, 36) != 8 {
            return Err(CrngError::Length {
                what: "generation",
                len: half(&b, 36),
            });
        }
        // Every place it names is readable now: a bad address fails the registration,
        // not a clone.
        let mut key = [0u8; MAX_KEY_BYTES as usize];
        let key = &mut key[..layout.key_len as usize];
        mem.read_slice(key, GuestAddress(layout.key))
            .map_err(|e| memory("key", layout.key, e))?;
        mem.read_obj::<u64>(GuestAddress(layout.generation))
            .map_err(|e| memory("generation", layout.generation, e))?;
        mem.read_obj::<u32>(GuestAddress(layout.busy))
            .map_err(|e| memory("busy counter", layout.busy, e))?;
        Ok(layout)
    }

    /// Whether the guest kernel is deriving or using a key now (a vCPU stopped there
    /// would install a key from the old state after a reseed, or return output drawn
    /// from it). False when the counter cannot be read (checked at registration).
    pub fn busy<M: GuestMemory>(&self, mem: &M) -> bool {
        mem.read_obj::<u32>(GuestAddress(self.busy))
            .map(|n| n != 0)
            .unwrap_or(false)
    }

    /// Writes a fresh base key from the host and bumps the generation (never to
    /// `u64::MAX`, which Linux reserves for per-CPU state not derived yet); returns the
    /// new generation. Only with every vCPU stopped.
    pub fn reseed<M: GuestMemory>(&self, mem: &M) -> Result<u64, CrngError> {
        let mut key = [0u8; MAX_KEY_BYTES as usize];
        let key = &mut key[..self.key_len as usize];
        host_random(key).map_err(CrngError::Entropy)?;
        mem.write_slice(key, GuestAddress(self.key))
            .map_err(|e| memory("key", self.key, e))?;
        let old: u64 = mem
            .read_obj(GuestAddress(self.generation))
            .map_err(|e| memory("generation", self.generation, e))?;
        let mut next = old.wrapping_add(1);
        if next == u64::MAX {
            next = next.wrapping_add(1);
        }
        mem.write_obj(next, GuestAddress(self.generation))
            .map_err(|e| memory("generation", self.generation, e))?;
        Ok(next)
    }
}

/// The VM's registration, shared by the port device (which sets it) and the VMM (which
/// reads it to reseed and to avoid stopping vCPUs mid-key).
#[derive(Debug, Default)]
pub struct CrngRegistration(RwLock<Option<CrngLayout>>);

impl CrngRegistration {
    /// The registered layout, if the guest registered.
    pub fn layout(&self) -> Option<CrngLayout> {
        *self.0.read().unwrap_or_else(|p| p.into_inner())
    }

    fn set(&self, layout: Option<CrngLayout>) {
        *self.0.write().unwrap_or_else(|p| p.into_inner()) = layout;
    }
}

/// A VM's registration with the guest memory it points into: what the port device
/// fills (reading descriptors from the memory), and what a vCPU thread checks before it
/// stops, whether the guest kernel is in the middle of its key code (then the vCPU
/// runs on to its end).
#[derive(Debug, Clone)]
pub struct CrngWatch {
    /// The VM's registration.
    pub registration: Arc<CrngRegistration>,
    /// The VM's guest memory.
    pub mem: GuestMemoryMmap,
}

impl CrngWatch {
    /// Whether a registered kernel is deriving or using a key now.
    pub fn mid_key(&self) -> bool {
        (self.registration.layout()).is_some_and(|l| l.busy(&self.mem))
    }
}

/// The CRNG registration port device.
#[derive(Debug)]
pub struct CrngPort {
    args: CrngWatch,
    low: u32,
    failures: u64,
}

/// The port's state: the registration (a clone's kernel registered in its template).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CrngState {
    /// The registered layout.
    pub layout: Option<CrngLayout>,
}

impl Persist for CrngPort {
    type State = CrngState;
    type ConstructorArgs = CrngWatch;
    type Error = std::convert::Infallible;

    fn save(&self) -> CrngState {
        CrngState {
            layout: self.args.registration.layout(),
        }
    }

    fn restore(args: CrngWatch, state: &CrngState) -> Result<Self, Self::Error> {
        args.registration.set(state.layout);
        Ok(Self {
            args,
            low: 0,
            failures: 0,
        })
    }
}

impl BusDevice for CrngPort {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        let registered = offset == 0 && self.args.registration.layout().is_some();
        fill_le(data, u32::from(registered));
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        match offset {
            0 => self.low = read_le(data),
            4 => {
                let addr = u64::from(read_le(data)) << 32 | u64::from(self.low);
                match CrngLayout::read(&self.args.mem, addr) {
                    Ok(layout) => {
                        tracing::info!("guest kernel registered its CRNG: {layout:?}");
                        self.args.registration.set(Some(layout));
                    }
                    Err(e) => {
                        if self.failures == 0 {
                            tracing::warn!("guest CRNG registration refused: {e}");
                        }
                        self.failures += 1;
                    }
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const DESC: u64 = 0x1000;
    const KEY: u64 = 0x2000;
    const GEN: u64 = 0x2040;
    const BUSY: u64 = 0x3000;

    fn guest() -> GuestMemoryMmap {
        let mem = GuestMemoryMmap::from_ranges(&[(GuestAddress(0), 0x10000)]).unwrap();
        let mut d = Vec::new();
        d.extend(DESCRIPTOR_MAGIC.to_le_bytes());
        d.extend(DESCRIPTOR_VERSION.to_le_bytes());
        d.extend(KEY.to_le_bytes());
        d.extend(GEN.to_le_bytes());
        d.extend(BUSY.to_le_bytes());
        d.extend(32u32.to_le_bytes());
        d.extend(8u32.to_le_bytes());
        mem.write_slice(&d, GuestAddress(DESC)).unwrap();
        mem.write_obj(7u64, GuestAddress(GEN)).unwrap();
        mem
    }

    fn port(mem: &GuestMemoryMmap) -> (CrngPort, Arc<CrngRegistration>) {
        let registration = Arc::new(CrngRegistration::default());
        let args = CrngWatch {
            mem: mem.clone(),
            registration: registration.clone(),
        };
        (
            CrngPort::restore(args, &CrngState::default()).unwrap(),
            registration,
        )
    }

    fn register(p: &mut CrngPort, addr: u64) {
        p.write(0, &(addr as u32).to_le_bytes());
        p.write(4, &((addr >> 32) as u32).to_le_bytes());
    }

    #[test]
    fn a_registered_kernel_gets_a_fresh_key_and_the_next_generation() {
        let mem = guest();
        let (mut p, reg) = port(&mem);
        let mut data = [0u8; 4];
        p.read(0, &mut data);
        assert_eq!(data, [0; 4]);
        register(&mut p, DESC);
        p.read(0, &mut data);
        assert_eq!(u32::from_le_bytes(data), 1);
        let layout = reg.layout().unwrap();
        assert_eq!((layout.key, layout.key_len), (KEY, 32));
        assert!(!layout.busy(&mem));
        mem.write_obj(1u32, GuestAddress(BUSY)).unwrap();
        assert!(layout.busy(&mem));

        let mut keys = Vec::new();
        for expected in 8..11u64 {
            assert_eq!(layout.reseed(&mem).unwrap(), expected);
            let mut key = [0u8; 32];
            mem.read_slice(&mut key, GuestAddress(KEY)).unwrap();
            keys.push(key);
        }
        assert!(keys[0] != keys[1] && keys[1] != keys[2] && keys[0] != [0; 32]);
        // The byte after the key is the guest's, untouched.
        assert_eq!(mem.read_obj::<u8>(GuestAddress(KEY + 32)).unwrap(), 0);

        // u64::MAX is skipped: Linux's per-CPU state starts there.
        mem.write_obj(u64::MAX - 1, GuestAddress(GEN)).unwrap();
        assert_eq!(layout.reseed(&mem).unwrap(), 0);

        // A clone's port continues with its template's registration.
        let (q, reg2) = port(&mem);
        let q = CrngPort::restore(q.args.clone(), &p.save()).unwrap();
        assert_eq!(reg2.layout(), Some(layout));
        assert_eq!(q.save().layout, Some(layout));
    }

    #[test]
    fn bad_descriptors_are_refused() {
        let mem = guest();
        let refused = |edit: &dyn Fn(&GuestMemoryMmap), addr: u64| {
            let mem = guest();
            edit(&mem);
            let (mut p, reg) = port(&mem);
            register(&mut p, addr);
            reg.layout().is_none()
        };
        assert!(refused(&|_| {}, 0x10_0000_0000));
        assert!(refused(
            &|m| m.write_obj(0u32, GuestAddress(DESC)).unwrap(),
            DESC
        ));
        assert!(refused(
            &|m| m.write_obj(2u32, GuestAddress(DESC + 4)).unwrap(),
            DESC
        ));
        assert!(refused(
            &|m| m.write_obj(0x10_0000u64, GuestAddress(DESC + 8)).unwrap(),
            DESC
        ));
        assert!(refused(
            &|m| m.write_obj(4u32, GuestAddress(DESC + 36)).unwrap(),
            DESC
        ));
        assert!(refused(
            &|m| m.write_obj(200u32, GuestAddress(DESC + 32)).unwrap(),
            DESC
        ));
        assert!(!refused(&|_| {}, DESC));
        let e = CrngLayout::read(&mem, DESC + 1).unwrap_err();
        assert!(matches!(e, CrngError::Magic(_)), "{e}");
    }
}
