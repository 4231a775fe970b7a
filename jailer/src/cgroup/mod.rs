//! Cgroups for clones: resource classes, a file-level driver for cgroup v1 and v2, and
//! a pool of ready cgroups per class (`pool`).
//!
//! The driver works on paths under a root so that the same code runs on the host's
//! hierarchy and on a fake root in tests (see [`CgroupFs::fake`]).

pub mod fs;
mod held;
pub mod pool;

pub use fs::{CgroupFs, CgroupVersion};
pub use pool::{CgroupPool, PoolConfig, PoolError, WhenExhausted};

use std::os::fd::{AsRawFd, OwnedFd};

pub use api_types::cgroup::{ResourceClass, Usage};

/// Errors from cgroup files.
#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    /// A cgroup file or directory operation failed.
    #[error("cgroup {path}: {source}")]
    Io {
        /// The file or directory.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A cgroup file held something unexpected.
    #[error("cgroup {path}: cannot parse {text:?}")]
    Parse {
        /// The file.
        path: String,
        /// What it held.
        text: String,
    },
    /// No usable hierarchy.
    #[error("no cgroup hierarchy found: {0}")]
    NoHierarchy(String),
    /// A class sets a limit whose controller this hierarchy does not offer.
    #[error("cannot write {value:?} to {file}: the controller is not enabled here")]
    NoController {
        /// The interface file that is missing.
        file: String,
        /// The limit.
        value: String,
    },
    /// A cgroup still had processes when it had to be empty.
    #[error("cgroup {name} still has processes {pids:?}")]
    Busy {
        /// The cgroup.
        name: String,
        /// Its processes.
        pids: Vec<i32>,
    },
}

/// `fork()`, or with `cgroup` (an open v2 cgroup directory) `clone3(CLONE_INTO_CGROUP)`
/// so the child starts inside that cgroup. Returns what fork returns.
///
/// # Safety
/// As for fork(). With `cgroup`, the child also starts without glibc's fork handling:
/// malloc's locks are not taken around the call (another thread inside malloc or free at
/// that moment leaves its arena locked in the child, which then hangs when it allocates
/// from that arena) and the child's thread descriptor keeps the parent's thread id. The
/// caller must keep every other thread out of malloc across the call (the VMM's fork
/// gate does); the child must not rely on the cached thread id (raise() and Rust's std
/// do not).
pub unsafe fn fork_into(cgroup: Option<&OwnedFd>) -> i32 {
    let Some(dir) = cgroup else {
        // SAFETY: the caller upholds fork()'s contract.
        return unsafe { libc::fork() };
    };
    const CLONE_INTO_CGROUP: u64 = 0x2_0000_0000;
    // SAFETY: clone_args is plain data; zero is "unused" for every field.
    let mut args: libc::clone_args = unsafe { std::mem::zeroed() };
    args.flags = CLONE_INTO_CGROUP;
    args.exit_signal = libc::SIGCHLD as u64;
    args.cgroup = dir.as_raw_fd() as u64;
    // SAFETY: clone3 with no stack behaves like fork (the child continues on a copy of
    // this stack); `args` is valid for the size given. The caller upholds the rest.
    unsafe {
        libc::syscall(
            libc::SYS_clone3,
            &args as *const libc::clone_args,
            std::mem::size_of::<libc::clone_args>(),
        ) as i32
    }
}
