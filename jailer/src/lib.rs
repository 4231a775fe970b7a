//! The forkvm jailer: a pool of ready cgroups per resource class, for placing clones.
//!
//! Implemented so far: the cgroup driver (v1 and v2, on the host or a fake root) and
//! the pool ([`cgroup::pool`]). Not yet: placing clones from the VMM, the `jailer`
//! binary (chroot, namespaces, seccomp, privilege drop) — see docs/jailer.md.
#![deny(missing_docs)]

pub mod cgroup;
