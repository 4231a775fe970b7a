//! The forkvm control ports, one set per vCPU: the clone port, through which a guest
//! asks to be cloned, and the done port, through which it reports a status
//! (docs/guest-abi.md).
//!
//! | port  | read (32-bit)                                         | write (32-bit)             |
//! |-------|-------------------------------------------------------|----------------------------|
//! | 0xf48 | clone: the vCPU parks until the clones exist; reads 0 in the parent, the clone's sequence number in each clone, `0xffffffff` on failure | how many clones the next read asks for (1 until written) |
//! | 0xf4c | all ones (as an unmapped port)                        | done, with this status     |
//!
//! The ports belong to the vCPU that uses them: the count a guest writes is that vCPU's,
//! and only the vCPU's own thread can park it. So each vCPU thread owns a
//! [`ControlPorts`] and hands it its port exits before the shared bus; what the device
//! asks for ([`ControlRequest`]) the thread turns into a parked vCPU and an event.

use serde::{Deserialize, Serialize};

use crate::persist::Persist;
use crate::util::{fill_le, read_le};

/// Port a guest reads to be cloned (and writes to set the count).
pub const CLONE_PORT: u16 = 0xf48;
/// Port a guest writes its completion status to.
pub const DONE_PORT: u16 = 0xf4c;
/// Value a clone-port read holds while the request is in progress; the guest never sees
/// it, because the VMM sets the result before the vCPU runs again.
pub const CLONE_PENDING: u32 = 0xffff_fffe;

/// What a guest asked through a control port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlRequest {
    /// This many clones: the vCPU must park until they exist.
    Clone(u32),
    /// The guest is done, with this status.
    Done(u32),
}

/// One vCPU's control ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlPorts {
    /// Clones the next clone-port read asks for.
    clone_count: u32,
}

impl Default for ControlPorts {
    fn default() -> Self {
        Self { clone_count: 1 }
    }
}

impl ControlPorts {
    /// Whether `port` is one of these.
    pub fn decodes(port: u16) -> bool {
        matches!(port, CLONE_PORT | DONE_PORT)
    }

    /// A read of `port` (one of these): fills `data`, and returns what the guest asks.
    pub fn read(&mut self, port: u16, data: &mut [u8]) -> Option<ControlRequest> {
        match port {
            CLONE_PORT => {
                fill_le(data, CLONE_PENDING);
                Some(ControlRequest::Clone(self.clone_count))
            }
            _ => {
                data.fill(0xff);
                None
            }
        }
    }

    /// A write of `data` to `port` (one of these): returns what the guest asks.
    pub fn write(&mut self, port: u16, data: &[u8]) -> Option<ControlRequest> {
        match port {
            CLONE_PORT => {
                self.clone_count = read_le(data);
                None
            }
            DONE_PORT => Some(ControlRequest::Done(read_le(data))),
            _ => None,
        }
    }
}

/// The control ports' state: the clone count the guest wrote (a clone made between its
/// guest's write of the count and its read keeps the count).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlState {
    /// Clones the next clone-port read asks for.
    pub clone_count: u32,
}

impl Default for ControlState {
    fn default() -> Self {
        ControlPorts::default().save()
    }
}

impl Persist for ControlPorts {
    type State = ControlState;
    type ConstructorArgs = ();
    type Error = std::convert::Infallible;

    fn save(&self) -> ControlState {
        ControlState {
            clone_count: self.clone_count,
        }
    }

    fn restore(_: (), state: &ControlState) -> Result<Self, Self::Error> {
        Ok(Self {
            clone_count: state.clone_count,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_clone_port_asks_for_the_count_written_and_the_done_port_reports() {
        let mut p = ControlPorts::default();
        let mut data = [0u8; 4];
        assert_eq!(
            p.read(CLONE_PORT, &mut data),
            Some(ControlRequest::Clone(1))
        );
        assert_eq!(u32::from_le_bytes(data), CLONE_PENDING);
        assert_eq!(p.write(CLONE_PORT, &3u32.to_le_bytes()), None);
        // The count survives a save and restore (a clone made between the two).
        let q = ControlPorts::restore((), &p.save()).unwrap();
        assert_eq!(
            q.clone().read(CLONE_PORT, &mut data),
            Some(ControlRequest::Clone(3))
        );
        assert_eq!(
            p.write(DONE_PORT, &7u32.to_le_bytes()),
            Some(ControlRequest::Done(7))
        );
        assert_eq!(p.read(DONE_PORT, &mut data), None);
        assert_eq!(data, [0xff; 4]);
        assert!(ControlPorts::decodes(0xf48) && ControlPorts::decodes(0xf4c));
        assert!(!ControlPorts::decodes(0xf40));
    }
}
