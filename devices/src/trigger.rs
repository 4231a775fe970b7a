//! Interrupt and event triggers backed by eventfds.

use std::io;
use std::os::fd::{AsRawFd, RawFd};

use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

/// An eventfd that devices signal to raise an interrupt or report an event.
///
/// The VMM registers the same eventfd with KVM (irqfd) or polls it (reset, exit).
#[derive(Debug)]
pub struct EventFdTrigger(EventFd);

impl EventFdTrigger {
    /// Creates a new non-blocking trigger.
    pub fn new() -> io::Result<Self> {
        Ok(Self(EventFd::new(EFD_NONBLOCK)?))
    }

    /// Another handle to the same eventfd.
    pub fn try_clone(&self) -> io::Result<Self> {
        Ok(Self(self.0.try_clone()?))
    }

    /// The underlying eventfd.
    pub fn eventfd(&self) -> &EventFd {
        &self.0
    }
}

impl AsRawFd for EventFdTrigger {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl vm_superio::Trigger for EventFdTrigger {
    type E = io::Error;

    fn trigger(&self) -> io::Result<()> {
        self.0.write(1)
    }
}
