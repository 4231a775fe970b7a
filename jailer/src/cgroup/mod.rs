//! Cgroups for clones: resource classes, a file-level driver for cgroup v1 and v2, and
//! a pool of ready cgroups per class (`pool`).
//!
//! The driver works on paths under a root so that the same code runs on the host's
//! hierarchy and on a fake root in tests (see [`CgroupFs::fake`]).

pub mod fs;
pub mod pool;

pub use fs::{CgroupFs, CgroupVersion};
pub use pool::{CgroupPool, PoolConfig, PoolError, WhenExhausted};

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

/// What one clone used while it held a cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
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
    /// A cgroup still had processes when it had to be empty.
    #[error("cgroup {name} still has processes {pids:?}")]
    Busy {
        /// The cgroup.
        name: String,
        /// Its processes.
        pids: Vec<i32>,
    },
}
