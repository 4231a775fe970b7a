//! The forkvm control ports, one set per vCPU: the clone port, through which a guest
//! asks to be cloned, the done port, through which it reports a status, and the invoke
//! ports, through which a runtime waits for requests and replies (docs/guest-abi.md,
//! docs/invoke.md).
//!
//! | port  | read (32-bit)                                         | write (32-bit)             |
//! |-------|-------------------------------------------------------|----------------------------|
//! | 0xf48 | clone: the vCPU parks until the clones exist; reads 0 in the parent, the clone's sequence number in each clone, `0xffffffff` on failure | how many clones the next read asks for (1 until written) |
//! | 0xf4c | all ones (as an unmapped port)                        | done, with this status     |
//! | 0xf80 | wait: the vCPU parks until a request is in the mailbox; reads its payload length (all ones without a mailbox) | reply: the reply's payload length; the vCPU parks until the VMM took it |
//! | 0xf84 | the mailbox's guest-physical address (0: none)        | ignored                    |
//! | 0xf88 | the mailbox's size in bytes (0: none)                 | ignored                    |
//! | 0xf8c | the mailbox layout's version                          | ignored                    |
//!
//! The ports belong to the vCPU that uses them: the count a guest writes is that vCPU's,
//! and only the vCPU's own thread can park it. So each vCPU thread owns a
//! [`ControlPorts`] and hands it its port exits before the shared bus; what the device
//! asks for ([`ControlRequest`]) the thread turns into a parked vCPU and an event.

use serde::{Deserialize, Serialize};

use crate::mailbox::{MailboxWindow, VERSION};
use crate::persist::Persist;
use crate::util::{fill_le, read_le};

/// Port a guest reads to be cloned (and writes to set the count).
pub const CLONE_PORT: u16 = 0xf48;
/// Port a guest writes its completion status to.
pub const DONE_PORT: u16 = 0xf4c;
/// Value a clone-port read holds while the request is in progress; the guest never sees
/// it, because the VMM sets the result before the vCPU runs again.
pub const CLONE_PENDING: u32 = 0xffff_fffe;
/// Port a runtime reads to wait for a request, and writes to reply.
pub const INVOKE_PORT: u16 = 0xf80;
/// Port that reads the mailbox's guest-physical address.
pub const MAILBOX_ADDR_PORT: u16 = 0xf84;
/// Port that reads the mailbox's size.
pub const MAILBOX_SIZE_PORT: u16 = 0xf88;
/// Port that reads the mailbox layout's version.
pub const INVOKE_VERSION_PORT: u16 = 0xf8c;
/// What an invoke-port read returns in a VM without a mailbox (and, in a template's
/// captured state, until a clone's VMM sets the request's length).
pub const INVOKE_NONE: u32 = 0xffff_ffff;

/// What a guest asked through a control port.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ControlRequest {
    /// This many clones: the vCPU must park until they exist.
    Clone(u32),
    /// The guest is done, with this status.
    Done(u32),
    /// The runtime waits for a request: the vCPU must park until one is in the mailbox.
    Wait,
    /// The runtime replied, with this payload length: the vCPU must park until the VMM
    /// took the reply.
    Reply(u32),
}

/// One vCPU's control ports.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ControlPorts {
    /// Clones the next clone-port read asks for.
    clone_count: u32,
    /// The VM's mailbox.
    mailbox: MailboxWindow,
}

impl Default for ControlPorts {
    fn default() -> Self {
        Self::new(MailboxWindow::default())
    }
}

impl ControlPorts {
    /// The ports of a vCPU in a VM with `mailbox`.
    pub fn new(mailbox: MailboxWindow) -> Self {
        Self {
            clone_count: 1,
            mailbox,
        }
    }

    /// Whether `port` is one of these.
    pub fn decodes(port: u16) -> bool {
        matches!(
            port,
            CLONE_PORT
                | DONE_PORT
                | INVOKE_PORT
                | MAILBOX_ADDR_PORT
                | MAILBOX_SIZE_PORT
                | INVOKE_VERSION_PORT
        )
    }

    /// A read of `port` (one of these): fills `data`, and returns what the guest asks.
    pub fn read(&mut self, port: u16, data: &mut [u8]) -> Option<ControlRequest> {
        match port {
            CLONE_PORT => {
                fill_le(data, CLONE_PENDING);
                Some(ControlRequest::Clone(self.clone_count))
            }
            INVOKE_PORT => {
                fill_le(data, INVOKE_NONE);
                self.mailbox.exists().then_some(ControlRequest::Wait)
            }
            // A VM without a mailbox has the empty window: address and size 0.
            MAILBOX_ADDR_PORT => {
                fill_le(data, self.mailbox.addr);
                None
            }
            MAILBOX_SIZE_PORT => {
                fill_le(data, self.mailbox.size);
                None
            }
            INVOKE_VERSION_PORT => {
                fill_le(data, u32::from(VERSION));
                None
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
            INVOKE_PORT if self.mailbox.exists() => Some(ControlRequest::Reply(read_le(data))),
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
    /// The VM's mailbox (configuration, not state).
    type ConstructorArgs = MailboxWindow;
    type Error = std::convert::Infallible;

    fn save(&self) -> ControlState {
        ControlState {
            clone_count: self.clone_count,
        }
    }

    fn restore(mailbox: MailboxWindow, state: &ControlState) -> Result<Self, Self::Error> {
        Ok(Self {
            clone_count: state.clone_count,
            mailbox,
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
        let q = ControlPorts::restore(MailboxWindow::default(), &p.save()).unwrap();
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

    #[test]
    fn the_invoke_ports_wait_reply_and_describe_the_mailbox() {
        let mut data = [0u8; 4];
        let read = |p: &mut ControlPorts, port: u16, data: &mut [u8; 4]| {
            let r = p.read(port, data);
            (r, u32::from_le_bytes(*data))
        };
        // Without a mailbox: nothing parks, the read says so.
        let mut none = ControlPorts::default();
        assert_eq!(read(&mut none, INVOKE_PORT, &mut data), (None, INVOKE_NONE));
        assert_eq!(read(&mut none, MAILBOX_SIZE_PORT, &mut data), (None, 0));
        assert_eq!(none.write(INVOKE_PORT, &3u32.to_le_bytes()), None);
        let mut p = ControlPorts::new(MailboxWindow::of_size(1 << 20));
        assert_eq!(
            read(&mut p, INVOKE_PORT, &mut data),
            (Some(ControlRequest::Wait), INVOKE_NONE)
        );
        assert_eq!(
            read(&mut p, MAILBOX_ADDR_PORT, &mut data),
            (None, 0xc000_0000)
        );
        assert_eq!(read(&mut p, MAILBOX_SIZE_PORT, &mut data), (None, 1 << 20));
        assert_eq!(read(&mut p, INVOKE_VERSION_PORT, &mut data), (None, 1));
        assert_eq!(
            p.write(INVOKE_PORT, &9u32.to_le_bytes()),
            Some(ControlRequest::Reply(9))
        );
        assert_eq!(p.write(MAILBOX_ADDR_PORT, &9u32.to_le_bytes()), None);
    }
}
