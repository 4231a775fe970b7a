//! forkvm's virtual machine monitor: boots microVM guests on KVM and serves the control API.
#![deny(missing_docs)]

pub mod arch;
