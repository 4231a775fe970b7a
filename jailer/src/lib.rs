//! The forkvm jailer: the sandbox a VMM runs in, the seccomp filters its threads install,
//! and a pool of ready cgroups per resource class for placing clones.
//!
//! - [`jail`]: `jailer --id ... -- <vmm args>`: pivot_root into a jail directory with only
//!   the files the VMM needs, new mount, pid and cgroup namespaces, a delegated cgroup,
//!   resource limits, an unprivileged user.
//! - [`seccomp`]: one filter per VMM thread kind.
//! - [`cgroup`]: the cgroup driver (v1 and v2, on the host or a fake root), the pool (used
//!   by the VMM to place every clone) and `jailer cleanup`.
//!
//! See docs/jailer.md.
#![deny(missing_docs)]

pub mod cgroup;
pub mod jail;
pub mod seccomp;
