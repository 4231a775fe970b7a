//! The forkvm clone protocol: everything KVM holds for an x86_64 VM, as serde types, and
//! how to read it from live KVM fds and write it into new ones.
//!
//! The quiesce -> capture -> fork -> rebuild sequence itself lives in the `vmm` crate
//! (`vmm::cloning`), because the rebuild needs the VMM's devices and vCPU threads; this
//! crate has no dependency on the VMM.
#![deny(missing_docs)]

pub mod msrs;
pub mod state;
pub mod state_file;
pub mod timer;
pub mod vcpu;
pub mod vm;

pub use state::{DeviceStates, MicrovmState, VcpuState, VmState};
