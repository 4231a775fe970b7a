//! Clones in pooled cgroups: one [`CgroupPool`] per resource class, leased per clone.
//!
//! A VMM started with `--cgroup-class` keeps, for each class, a pool of ready cgroups
//! under its own parent (`<cgroup parent>/vmm-<pid>`). Each clone takes one when it is
//! made and gives it back when it is reaped, with its usage (CPU time, peak memory, OOM
//! kills) read on the way and kept for `GET /clones`.
//!
//! Placement happens before the clone runs guest code:
//! - cgroup v2, clone forked on request: `clone3(CLONE_INTO_CGROUP)`, so the child is
//!   born inside its cgroup and nothing migrates;
//! - cgroup v1, and warm clones (forked before their class was known): the child, while
//!   it is still its process's only thread, writes "0" to the cgroup's `tasks` file in
//!   every hierarchy (v1; `cgroup.procs` on v2), moving itself, before it rebuilds the VM
//!   or starts a thread. Moving one thread does not take the cgroup core's thread-group
//!   lock for writing, so no RCU grace period is waited for. Memory a warm clone
//!   allocated before a move stays charged to where it was (v1 does not move charges).
//!
//! Pools live in the template: a clone has none of its own, so its clones stay in its
//! cgroup (a request naming a class on a clone is refused).

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub(crate) use jailer::cgroup::fork_into;
use jailer::cgroup::pool::Lease;
use jailer::cgroup::{CgroupFs, CgroupPool, CgroupVersion, PoolConfig, Usage, WhenExhausted};
use serde::{Deserialize, Serialize};

use crate::config::CgroupConfig;

/// How often the event loop refills and shrinks the pools.
pub(crate) const UPKEEP_PERIOD: Duration = Duration::from_millis(20);
/// Idle cgroups beyond the pool size are removed after this long.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);

/// Errors setting up the pools (at VM start).
#[derive(Debug, thiserror::Error)]
pub enum CgroupSetupError {
    /// No usable hierarchy, or a cgroup operation failed.
    #[error("cgroups: {0}")]
    Cgroup(#[from] jailer::cgroup::CgroupError),
    /// A pool could not be made.
    #[error("cgroup pool for class {class}: {source}")]
    Pool {
        /// The class.
        class: String,
        /// Why.
        source: jailer::cgroup::PoolError,
    },
}

/// Errors placing one clone.
#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    /// The VMM has no pools (no `--cgroup-class`, or it is a clone).
    #[error("resource class {0:?} requested, but this VMM has no cgroup pools (start it with --cgroup-class; a clone's clones stay in its cgroup)")]
    NoPools(String),
    /// No such class.
    #[error("unknown resource class {class:?}; this VMM has {known:?}")]
    UnknownClass {
        /// Asked for.
        class: String,
        /// Configured.
        known: Vec<String>,
    },
    /// The pool gave no cgroup (exhausted, or a cgroup operation failed).
    #[error(transparent)]
    Pool(#[from] jailer::cgroup::PoolError),
    /// The cgroup directory could not be opened for `clone3`.
    #[error(transparent)]
    Open(jailer::cgroup::CgroupError),
}

/// Where a clone goes, as the child is told.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Placement {
    /// The files the child's only thread writes "0" to (v1 `tasks`, v2
    /// `cgroup.procs`); empty when it is born inside (`clone3(CLONE_INTO_CGROUP)`).
    pub files: Vec<PathBuf>,
}

/// A clone's cgroup, as `GET /clones` reports it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CloneCgroup {
    /// Resource class.
    pub class: String,
    /// Cgroup path below each hierarchy's root.
    pub path: String,
    /// How it was placed: "clone3" (born inside, v2), "tasks" (moved its only thread in,
    /// v1) or "procs" (moved itself in through `cgroup.procs`, v2).
    pub placed_by: &'static str,
    /// What it used: so far while it runs, in total once it exited.
    pub usage: Option<Usage>,
}

/// A cgroup taken for a clone that is about to be forked.
pub(crate) struct Taken {
    pool: usize,
    lease: Lease,
    /// The v2 directory, open for `clone3(CLONE_INTO_CGROUP)`.
    pub dir: Option<OwnedFd>,
}

/// The pools of one VMM and the cgroups its clones hold.
pub struct ClonePools {
    fs: CgroupFs,
    pools: Vec<CgroupPool>,
    /// Cgroups of live clones, by pid.
    leases: HashMap<i32, (usize, Lease)>,
    last_upkeep: Instant,
}

impl ClonePools {
    /// Finds the hierarchy and pre-creates every class's pool under
    /// `<parent>/vmm-<pid>`.
    pub fn new(cfg: &CgroupConfig) -> Result<Self, CgroupSetupError> {
        let parent = format!("{}/vmm-{}", cfg.parent, std::process::id());
        let fs = CgroupFs::host(cfg.version, &parent)?;
        let pool_cfg = PoolConfig {
            size: cfg.pool_size,
            low_water: cfg.pool_size.div_ceil(2),
            max: cfg.pool_max,
            idle_timeout: IDLE_TIMEOUT,
            when_exhausted: if cfg.wait_ms == 0 {
                WhenExhausted::Fail
            } else {
                WhenExhausted::Wait(Duration::from_millis(cfg.wait_ms))
            },
        };
        // Pools made before one fails are removed when `made` drops.
        let mut made = Self {
            fs,
            pools: Vec::with_capacity(cfg.classes.len()),
            leases: HashMap::new(),
            last_upkeep: Instant::now(),
        };
        for (name, class) in &cfg.classes {
            let pool = CgroupPool::new(made.fs.clone(), name, class.clone(), pool_cfg).map_err(
                |source| CgroupSetupError::Pool {
                    class: name.clone(),
                    source,
                },
            )?;
            made.pools.push(pool);
        }
        tracing::info!(
            "cgroup pools ({:?}) under {parent}: {}",
            made.fs.version(),
            cfg.classes
                .iter()
                .map(|(n, _)| n.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(made)
    }

    /// The hierarchy's version.
    pub fn version(&self) -> CgroupVersion {
        self.fs.version()
    }

    fn class_index(&self, class: Option<&str>) -> Result<usize, PlacementError> {
        let Some(class) = class else { return Ok(0) };
        self.pools
            .iter()
            .position(|p| p.class_name() == class)
            .ok_or_else(|| PlacementError::UnknownClass {
                class: class.to_string(),
                known: self.pools.iter().map(|p| p.class_name().into()).collect(),
            })
    }

    /// Whether `class` is the default (first) class.
    pub(crate) fn is_default(&self, class: Option<&str>) -> bool {
        self.class_index(class).is_ok_and(|i| i == 0)
    }

    /// Takes a cgroup of `class` (the first class when None); on v2 its directory is
    /// opened for `clone3(CLONE_INTO_CGROUP)`.
    pub(crate) fn take(&self, class: Option<&str>) -> Result<Taken, PlacementError> {
        let pool = self.class_index(class)?;
        let lease = self.pools[pool].acquire()?;
        let dir = match self.fs.open_v2_dir(&lease.name) {
            Ok(dir) => dir,
            Err(e) => {
                self.give_back(Taken {
                    pool,
                    lease,
                    dir: None,
                });
                return Err(PlacementError::Open(e));
            }
        };
        Ok(Taken { pool, lease, dir })
    }

    /// What the child is told (nothing to do when it is born inside, v2) and what
    /// `GET /clones` shows for a clone in `taken`.
    pub(crate) fn placement(&self, taken: &Taken) -> (Placement, CloneCgroup) {
        let born_inside = taken.dir.is_some();
        let placement = Placement {
            files: if born_inside {
                Vec::new()
            } else {
                self.fs.self_move_files(&taken.lease.name)
            },
        };
        let shown = CloneCgroup {
            class: self.pools[taken.pool].class_name().to_string(),
            path: format!("{}/{}", self.fs.parent(), taken.lease.name),
            placed_by: match (born_inside, self.fs.version()) {
                (true, _) => "clone3",
                (false, CgroupVersion::V1) => "tasks",
                (false, CgroupVersion::V2) => "procs",
            },
            usage: None,
        };
        (placement, shown)
    }

    /// Returns a cgroup whose clone was never started.
    pub(crate) fn give_back(&self, taken: Taken) {
        if let Err(e) = self.pools[taken.pool].release(taken.lease) {
            tracing::warn!("cgroup pool: {e}");
        }
    }

    /// Records that clone `pid` holds `taken`.
    pub(crate) fn started(&mut self, pid: i32, taken: Taken) {
        self.leases.insert(pid, (taken.pool, taken.lease));
    }

    /// Clone `pid` is gone (reaped): its cgroup goes back to the pool. Returns its usage.
    pub(crate) fn exited(&mut self, pid: i32) -> Option<Usage> {
        let (pool, lease) = self.leases.remove(&pid)?;
        match self.pools[pool].release(lease) {
            Ok(u) => Some(u),
            Err(e) => {
                tracing::warn!("cgroup of clone pid {pid}: {e}");
                None
            }
        }
    }

    /// What clone `pid` has used so far.
    pub(crate) fn usage(&self, pid: i32) -> Option<Usage> {
        let (pool, lease) = self.leases.get(&pid)?;
        self.pools[*pool].usage(lease).ok()
    }

    /// Refills and shrinks the pools when `UPKEEP_PERIOD` has passed (event loop).
    pub(crate) fn upkeep(&mut self) {
        if self.upkeep_due_in() != Some(Duration::ZERO) {
            return;
        }
        self.last_upkeep = Instant::now();
        for p in &self.pools {
            if let Err(e) = p.maintain() {
                tracing::warn!("cgroup pool {}: {e}", p.class_name());
            }
        }
    }

    /// Time until the next upkeep is due; None while no pool needs one (the event
    /// loop then sleeps until something happens).
    pub(crate) fn upkeep_due_in(&self) -> Option<Duration> {
        self.pools
            .iter()
            .any(CgroupPool::needs_maintenance)
            .then(|| UPKEEP_PERIOD.saturating_sub(self.last_upkeep.elapsed()))
    }

    /// Pool counters for `GET /vm`.
    pub fn report(&self) -> serde_json::Value {
        let pools: serde_json::Map<String, serde_json::Value> = self
            .pools
            .iter()
            .map(|p| {
                (
                    p.class_name().to_string(),
                    serde_json::json!({ "class": p.class(), "stats": p.stats() }),
                )
            })
            .collect();
        serde_json::json!({
            "version": self.fs.version(),
            "parent": self.fs.parent(),
            "pools": pools,
        })
    }
}

impl Drop for ClonePools {
    /// Kills whatever is left in this VMM's cgroups and removes them and its parent
    /// (live clones are stopped and reaped before, at shutdown).
    fn drop(&mut self) {
        for pid in self.leases.keys().copied().collect::<Vec<_>>() {
            self.exited(pid);
        }
        for p in &self.pools {
            if let Err(e) = p.destroy() {
                tracing::warn!("cgroup pool {}: {e}", p.class_name());
            }
        }
        if let Err(e) = self.fs.remove_parent() {
            tracing::warn!("removing cgroup parent {}: {e}", self.fs.parent());
        }
    }
}

/// Moves the calling process into a cgroup by writing "0" to each of its files. Called
/// by a clone before it runs guest code, while the calling thread is its process's only
/// one (on v1 only the calling thread moves; threads started afterwards follow it).
pub(crate) fn place_self(placement: &Placement) -> std::io::Result<()> {
    for path in &placement.files {
        std::fs::write(path, "0")
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())))?;
    }
    Ok(())
}
