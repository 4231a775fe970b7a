//! Cgroups for clones: resource classes, a file-level driver for cgroup v1 and v2, and
//! a pool of ready cgroups per class (`pool`).
//!
//! The driver works on paths under a root so that the same code runs on the host's
//! hierarchy and on a fake root in tests (see [`CgroupFs::fake`]).

pub mod fs;
pub mod pool;

pub use fs::{CgroupFs, CgroupVersion};
pub use pool::{CgroupPool, PoolConfig, PoolError, WhenExhausted};

use std::os::fd::{AsRawFd, OwnedFd};

use serde::{Deserialize, Serialize};

/// Limits shared by every cgroup of one pool.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ResourceClass {
    /// CPU time per period, in CPUs (0.5: half a CPU). None: unlimited.
    pub cpu_quota: Option<f64>,
    /// Memory limit in bytes. None: unlimited.
    pub memory_limit: Option<u64>,
    /// Most tasks. None: unlimited.
    pub pids_max: Option<u64>,
}

impl std::str::FromStr for ResourceClass {
    type Err = String;

    /// Parses `cpu=0.5,memory=64M,pids=100` (any subset, in any order; memory takes
    /// K, M or G suffixes, powers of 1024). An empty string is the unlimited class.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut class = ResourceClass::default();
        for item in s.split(',').map(str::trim).filter(|i| !i.is_empty()) {
            let (key, value) = item
                .split_once('=')
                .ok_or_else(|| format!("{item:?}: expected key=value"))?;
            let bad = |what: &str| format!("{item:?}: {what}");
            match key {
                "cpu" => {
                    let q: f64 = value.parse().map_err(|_| bad("not a number of CPUs"))?;
                    if !(0.01..=1024.0).contains(&q) {
                        return Err(bad("CPUs must be 0.01 to 1024"));
                    }
                    class.cpu_quota = Some(q);
                }
                "memory" => {
                    let (digits, shift) = match value.as_bytes().last() {
                        Some(b'K' | b'k') => (&value[..value.len() - 1], 10),
                        Some(b'M' | b'm') => (&value[..value.len() - 1], 20),
                        Some(b'G' | b'g') => (&value[..value.len() - 1], 30),
                        _ => (value, 0),
                    };
                    let n: u64 = digits.parse().map_err(|_| bad("not a size"))?;
                    let bytes = n
                        .checked_mul(1 << shift)
                        .filter(|b| *b >= 4 << 20)
                        .ok_or_else(|| bad("memory must be at least 4M and fit 64 bits"))?;
                    class.memory_limit = Some(bytes);
                }
                "pids" => {
                    let n: u64 = value.parse().map_err(|_| bad("not a count"))?;
                    if n == 0 {
                        return Err(bad("pids must be at least 1"));
                    }
                    class.pids_max = Some(n);
                }
                _ => return Err(bad("unknown limit; use cpu, memory or pids")),
            }
        }
        Ok(class)
    }
}

/// What one clone used while it held a cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    /// CPU time, microseconds.
    pub cpu_us: u64,
    /// Peak memory, bytes (v2 without `memory.peak`: memory at release).
    pub memory_peak: u64,
    /// OOM kills in the cgroup.
    pub oom_kills: u64,
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_resource_classes() {
        let c: ResourceClass = "cpu=0.5, memory=64M,pids=32".parse().unwrap();
        assert_eq!(
            c,
            ResourceClass {
                cpu_quota: Some(0.5),
                memory_limit: Some(64 << 20),
                pids_max: Some(32),
            }
        );
        assert_eq!("".parse::<ResourceClass>(), Ok(ResourceClass::default()));
        assert_eq!(
            "memory=1G".parse::<ResourceClass>().unwrap().memory_limit,
            Some(1 << 30)
        );
        for bad in [
            "cpu",
            "cpu=0",
            "cpu=x",
            "cpu=NaN",
            "memory=1K",
            "memory=99999999999G",
            "memory=-1",
            "pids=0",
            "disk=1",
        ] {
            assert!(bad.parse::<ResourceClass>().is_err(), "{bad} accepted");
        }
    }
}
