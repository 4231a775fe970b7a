//! Opening /dev/kvm, checking what forkvm needs, and recognising the host hypervisor.

use std::os::fd::{AsRawFd, FromRawFd};
use std::path::Path;

use kvm_ioctls::{Cap, Kvm};

/// Errors opening and checking KVM.
#[derive(Debug, thiserror::Error)]
pub enum KvmError {
    /// /dev/kvm is missing or not accessible.
    #[error(
        "cannot open /dev/kvm: {0} (is the kvm module loaded and is /dev/kvm readable and writable by this user?)"
    )]
    Open(kvm_ioctls::Error),
    /// A capability forkvm relies on is absent.
    #[error("KVM lacks a required capability: {0}")]
    MissingCap(&'static str),
    /// The kvm_run mapping size could not be read.
    #[error("cannot read the vCPU mmap size: {0}")]
    MmapSize(kvm_ioctls::Error),
    /// The saveable MSR list could not be read.
    #[error("cannot read KVM's MSR index list: {0}")]
    MsrList(kvm_ioctls::Error),
    /// The supported CPUID could not be read.
    #[error("cannot read KVM's supported CPUID: {0}")]
    Cpuid(kvm_ioctls::Error),
}

pub use api_types::vm::HostKind;

/// Reads the host kind from sysfs.
pub fn detect_host() -> HostKind {
    detect_host_at(Path::new("/sys/module"))
}

/// Reads the host kind from a sysfs module directory (tests use a fake root).
pub fn detect_host_at(sys_module: &Path) -> HostKind {
    if sys_module.join("kvm_pvm").exists() {
        HostKind::Pvm
    } else {
        HostKind::Hardware
    }
}

/// Capabilities a VM cannot boot without, with the name shown when one is missing.
pub const REQUIRED_CAPS: &[(Cap, &str)] = &[
    (Cap::Irqchip, "KVM_CAP_IRQCHIP"),
    (Cap::Pit2, "KVM_CAP_PIT2"),
    (Cap::Irqfd, "KVM_CAP_IRQFD"),
    (Cap::Ioeventfd, "KVM_CAP_IOEVENTFD"),
    (Cap::UserMemory, "KVM_CAP_USER_MEMORY"),
    (Cap::SetTssAddr, "KVM_CAP_SET_TSS_ADDR"),
    (Cap::ExtCpuid, "KVM_CAP_EXT_CPUID"),
    (Cap::MpState, "KVM_CAP_MP_STATE"),
    (Cap::ImmediateExit, "KVM_CAP_IMMEDIATE_EXIT"),
    (Cap::VcpuEvents, "KVM_CAP_VCPU_EVENTS"),
];

/// An open, checked KVM.
pub struct KvmContext {
    /// The /dev/kvm handle.
    pub kvm: Kvm,
    /// Most vCPUs one VM may have on this host.
    pub max_vcpus: usize,
    /// What provides KVM.
    pub host: HostKind,
}

impl KvmContext {
    /// Opens /dev/kvm and checks every required capability.
    pub fn open() -> Result<Self, KvmError> {
        let kvm = Kvm::new().map_err(KvmError::Open)?;
        for (cap, name) in REQUIRED_CAPS {
            if !kvm.check_extension(*cap) {
                return Err(KvmError::MissingCap(name));
            }
        }
        let max_vcpus = kvm.get_max_vcpus();
        Ok(Self {
            kvm,
            max_vcpus,
            host: detect_host(),
        })
    }

    /// The same /dev/kvm descriptor in a new owner, for a forked child: KVM binds a VM
    /// to the process that creates it, not to this descriptor, so a clone creates its VM
    /// through the one it inherited (opening /dev/kvm and checking it again cost a clone
    /// about 40 us here).
    ///
    /// # Safety
    /// `self` must never be dropped in this process (a clone's copy of its parent's
    /// objects is not: it ends with `_exit`), so the new value is the only owner.
    pub unsafe fn inherited(&self) -> Self {
        Self {
            // SAFETY: an open /dev/kvm descriptor, owned by the new value alone (above).
            kvm: unsafe { Kvm::from_raw_fd(self.kvm.as_raw_fd()) },
            max_vcpus: self.max_vcpus,
            host: self.host,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detects_pvm_from_sysfs() {
        let root = std::env::temp_dir().join(format!("forkvm-sysmod-{}", std::process::id()));
        std::fs::create_dir_all(root.join("kvm_intel")).unwrap();
        assert_eq!(detect_host_at(&root), HostKind::Hardware);
        std::fs::create_dir_all(root.join("kvm_pvm")).unwrap();
        assert_eq!(detect_host_at(&root), HostKind::Pvm);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
