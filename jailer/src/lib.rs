//! The forkvm jailer: a pool of ready cgroups per resource class, for placing clones.
//!
//! Implemented so far: the cgroup driver (v1 and v2, on the host or a fake root), the
//! pool ([`cgroup::pool`], used by the VMM to place every clone) and `jailer cleanup`.
//! Not yet: the sandbox (chroot, namespaces, seccomp, privilege drop) — see
//! docs/jailer.md.
#![deny(missing_docs)]

pub mod cgroup;
