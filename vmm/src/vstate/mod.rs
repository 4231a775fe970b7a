//! KVM state: the KVM handle and host checks, guest memory, the VM and its vCPUs.

pub mod kvm;
pub mod memory;
pub mod memory_file;
pub mod vcpu;
pub mod vm;
pub mod written;
