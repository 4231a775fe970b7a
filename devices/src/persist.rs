//! Saving a device's state and making the device again from it.
//!
//! Every stateful device implements [`Persist`]: `save` is mandatory (there is no
//! default that would save nothing), and `restore` makes the device from its saved
//! state plus what the new VM gives it (an interrupt line, an output sink, an open file:
//! the `ConstructorArgs`). A fresh device is the restore of its fresh state, so that
//! making and restoring a device share one path.
//!
//! A VM's device state is a list (`DeviceStates`, in `saved.rs`) that the VMM's device
//! manager builds from its devices in bus order and reads back in the same order.

/// A component whose state can be saved and restored.
pub trait Persist: Sized {
    /// What is saved: plain data, carried into a clone.
    type State;
    /// What making the component again needs besides its state: the new VM's host
    /// resources.
    type ConstructorArgs;
    /// Why a state cannot be restored.
    type Error;

    /// The component's state. A device with a worker thread must be paused first.
    fn save(&self) -> Self::State;

    /// The component again, from `state` and `args`.
    fn restore(args: Self::ConstructorArgs, state: &Self::State) -> Result<Self, Self::Error>;
}
