//! A VM's device state as one list, [`DeviceStates`]: the VMM's device manager builds it
//! from its devices in bus order and reads it back in the same order when a clone makes
//! its own. A new device needs its [`Persist`] impl, a [`DeviceState`] variant with its
//! line in `saved_as!` below, and one line in the device manager.

use serde::{Deserialize, Serialize};

use crate::bus::BusDevice;
use crate::clock::{ClockPort, ClockState};
use crate::crng::{CrngPort, CrngState};
use crate::entropy::{EntropyPort, EntropyState};
use crate::identity::{IdentityBlock, IdentityBlockState, IdentityPort, IdentityState};
use crate::legacy::{I8042State, SerialConsole, SerialConsoleState, I8042};
use crate::persist::Persist;
use crate::probe::{ProbePort, ProbeState};
use crate::virtio::{MmioTransport, MmioTransportState};

/// One device's saved state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceState {
    /// The 8250 console.
    Serial(SerialConsoleState),
    /// The i8042 reset line.
    I8042(I8042State),
    /// The probe port.
    Probe(ProbeState),
    /// The entropy port.
    Entropy(EntropyState),
    /// The identity port.
    Identity(IdentityState),
    /// The host clock port.
    Clock(ClockState),
    /// The identity block.
    IdentityBlock(IdentityBlockState),
    /// The CRNG registration port.
    Crng(CrngState),
    /// A virtio device: its transport's state, its device's inside.
    Virtio(Box<MmioTransportState>),
}

/// A device whose saved state is one [`DeviceState`] variant.
pub trait SavedAs: Persist {
    /// The kind of device, for messages.
    const KIND: &'static str;
    /// Its state as a list entry.
    fn wrap(state: Self::State) -> DeviceState;
    /// Its state in a list entry, if the entry is of its kind.
    fn unwrap(state: &DeviceState) -> Option<&Self::State>;
}

macro_rules! saved_as {
    ($($device:ty => $variant:ident, $kind:literal;)*) => {$(
        impl SavedAs for $device {
            const KIND: &'static str = $kind;

            fn wrap(state: Self::State) -> DeviceState {
                DeviceState::$variant(state.into())
            }

            fn unwrap(state: &DeviceState) -> Option<&Self::State> {
                match state {
                    DeviceState::$variant(s) => Some(s),
                    _ => None,
                }
            }
        }
    )*};
}

saved_as! {
    SerialConsole => Serial, "serial console";
    I8042 => I8042, "i8042";
    ProbePort => Probe, "probe port";
    EntropyPort => Entropy, "entropy port";
    IdentityPort => Identity, "identity port";
    ClockPort => Clock, "clock port";
    IdentityBlock => IdentityBlock, "identity block";
    CrngPort => Crng, "CRNG registration port";
    MmioTransport => Virtio, "virtio device";
}

/// A device on a bus whose state the VMM saves: any [`SavedAs`] bus device.
pub trait StatefulDevice: BusDevice {
    /// Its state as a list entry.
    fn device_state(&self) -> DeviceState;
}

impl<T: SavedAs + BusDevice> StatefulDevice for T {
    fn device_state(&self) -> DeviceState {
        T::wrap(self.save())
    }
}

/// Every device's saved state, in bus order (port devices, then virtio devices).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceStates(pub Vec<DeviceState>);

impl DeviceStates {
    /// The virtio devices' states, in bus order.
    pub fn virtio(&self) -> impl Iterator<Item = &MmioTransportState> {
        self.0.iter().filter_map(|s| match s {
            DeviceState::Virtio(t) => Some(&**t),
            _ => None,
        })
    }
}

/// Saved state that does not fit the devices being restored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StatesError {
    /// The list holds no state for a device the VM has.
    #[error("no saved state for the {0}")]
    Missing(&'static str),
    /// The list holds states for devices the VM does not have.
    #[error("saved state for {0} port devices this VM does not have")]
    Left(usize),
}

/// Reads a [`DeviceStates`] back in order, device by device.
pub struct Restoring<'a> {
    states: std::slice::Iter<'a, DeviceState>,
}

impl<'a> Restoring<'a> {
    /// Reads `states` from the start.
    pub fn new(states: &'a DeviceStates) -> Self {
        Self {
            states: states.0.iter(),
        }
    }

    /// The next state, which must be a `D`'s.
    pub fn take<D: SavedAs>(&mut self) -> Result<&'a D::State, StatesError> {
        self.states
            .next()
            .and_then(D::unwrap)
            .ok_or(StatesError::Missing(D::KIND))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::identity::NetIdentity;
    use crate::trigger::EventFdTrigger;

    #[test]
    fn a_list_reads_back_in_order_and_refuses_another_device_in_a_place() {
        let clock = ClockPort::restore((), &ClockState { latched: 42 }).unwrap();
        let entropy = EntropyPort::restore((), &EntropyState { failures: 3 }).unwrap();
        let reset = EventFdTrigger::new().unwrap();
        let i8042 = I8042::restore(reset, &I8042State {}).unwrap();
        let states = DeviceStates(vec![
            clock.device_state(),
            entropy.device_state(),
            i8042.device_state(),
        ]);
        // Through serde, as a clone's launch message or a snapshot would carry it.
        let states: DeviceStates =
            serde_json::from_str(&serde_json::to_string(&states).unwrap()).unwrap();
        let mut r = Restoring::new(&states);
        assert_eq!(r.take::<ClockPort>().unwrap().latched, 42);
        assert_eq!(r.take::<EntropyPort>().unwrap().failures, 3);
        // The third is the i8042's, not an identity block's.
        assert_eq!(
            r.take::<IdentityBlock>().unwrap_err(),
            StatesError::Missing("identity block")
        );
        assert_eq!(
            r.take::<ClockPort>().unwrap_err(),
            StatesError::Missing("clock port")
        );
    }

    #[test]
    fn a_restored_vm_gets_its_own_identity() {
        let net = NetIdentity {
            mac: [6, 0, 0, 0, 0, 1],
            ipv4: None,
            gateway: None,
        };
        let parent = IdentityBlock::new(Some(&net));
        let saved = parent.save();
        let mine = NetIdentity {
            mac: [6, 0, 0, 0, 0, 2],
            ..net
        };
        let child = IdentityBlock::restore(Some(mine), &saved).unwrap();
        let bytes = child.save().bytes;
        assert_ne!(bytes[..8], saved.bytes[..8], "a new generation");
        assert_eq!(bytes[8..14], mine.mac);
        let port = IdentityPort::restore(7, &IdentityPort::new(2).save()).unwrap();
        assert_eq!(port.save().seq, 7);
    }
}
