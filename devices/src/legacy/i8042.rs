//! The i8042 keyboard controller, reduced to what a microVM needs: its CPU reset
//! command, which the guest uses to reboot or power off.

use vm_superio::I8042Device;

use serde::{Deserialize, Serialize};

use crate::bus::BusDevice;
use crate::persist::Persist;
use crate::trigger::EventFdTrigger;

/// i8042 decoding ports 0x60-0x64. A reset command (0xfe to port 0x64) signals the
/// trigger given at creation, which the VMM treats as a guest power-off.
pub struct I8042 {
    dev: I8042Device<EventFdTrigger>,
}

impl I8042 {
    /// Port base.
    pub const BASE: u64 = 0x60;
    /// Number of ports decoded (0x60..=0x64).
    pub const LEN: u64 = 5;

    /// A controller that signals `reset` when the guest pulses the reset line.
    pub fn new(reset: EventFdTrigger) -> Self {
        Self {
            dev: I8042Device::new(reset),
        }
    }
}

/// The i8042's state: none. It keeps no registers (every read returns 0) and acts on
/// one command alone, the CPU reset; the line it signals is the new VM's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct I8042State {}

impl Persist for I8042 {
    type State = I8042State;
    type ConstructorArgs = EventFdTrigger;
    type Error = std::convert::Infallible;

    fn save(&self) -> I8042State {
        I8042State {}
    }

    /// A controller that signals `reset`.
    fn restore(reset: EventFdTrigger, _: &I8042State) -> Result<Self, Self::Error> {
        Ok(Self::new(reset))
    }
}

impl BusDevice for I8042 {
    fn read(&mut self, offset: u64, data: &mut [u8]) {
        data.fill(0);
        data[0] = self.dev.read(offset as u8);
    }

    fn write(&mut self, offset: u64, data: &[u8]) {
        if let Err(e) = self.dev.write(offset as u8, data[0]) {
            tracing::error!("i8042 reset signal failed: {e}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reset_command_signals() {
        let reset = EventFdTrigger::new().unwrap();
        let mut dev = I8042::new(reset.try_clone().unwrap());
        dev.write(0, &[0xfe]);
        assert!(reset.eventfd().read().is_err(), "data port must not reset");
        dev.write(4, &[0xfe]);
        assert_eq!(reset.eventfd().read().unwrap(), 1);
    }
}
