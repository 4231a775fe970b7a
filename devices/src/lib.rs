//! Device models for forkvm, with no KVM dependency.
//!
//! Devices here are plain state machines driven through a [`bus::Bus`] by the VMM's vCPU
//! threads. Interrupts leave a device through a [`trigger::EventFdTrigger`] (an eventfd) that the
//! VMM wires to KVM as an irqfd, so nothing here knows about KVM.
#![deny(missing_docs)]

pub mod bus;
pub mod clock;
pub mod control;
pub mod crng;
pub mod entropy;
pub mod identity;
pub mod legacy;
pub mod mailbox;
pub mod persist;
pub mod probe;
pub mod rate_limiter;
pub mod saved;
pub mod trigger;
pub mod util;
pub mod virtio;

pub use bus::{Bus, BusDevice, BusError};
pub use persist::Persist;
pub use saved::{DeviceState, DeviceStates};
