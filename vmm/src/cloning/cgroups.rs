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
//! - cgroup v1, the first clone of a request of the default class: forked by the
//!   forker (`cloning::forker`), a thread parked ahead in the cgroup set aside for it
//!   (the seat), so the child is born inside;
//! - cgroup v1 otherwise, and warm clones (forked before their class was known): the
//!   child, while it is still its process's only thread, writes "0" to the cgroup's
//!   `tasks` file in
//!   every hierarchy (v1; `cgroup.procs` on v2), moving itself, before it rebuilds the VM
//!   or starts a thread. Moving one thread does not take the cgroup core's thread-group
//!   lock for writing, so no RCU grace period is waited for. Memory a warm clone
//!   allocated before a move stays charged to where it was (v1 does not move charges).
//!
//! Pools live in the template: a clone has none of its own, so its clones stay in its
//! cgroup (a request naming a class on a clone is refused).

use std::collections::HashMap;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use api_types::cgroup::{CgroupsReport, PlacedBy, PoolReport};
use api_types::CloneCgroup;
pub(crate) use jailer::cgroup::fork_into;
use jailer::cgroup::pool::Lease;
use jailer::cgroup::{CgroupFs, CgroupPool, CgroupVersion, PoolConfig, Usage, WhenExhausted};
use serde::{Deserialize, Serialize};

use super::forker::{Forker, Restore};
use crate::config::CgroupConfig;

/// How often the event loop refills and shrinks the pools.
pub(crate) const UPKEEP_PERIOD: Duration = Duration::from_millis(20);
/// How often a VMM with pools sweeps the pools that killed VMMs left ([`sweep_dead_vmms`]),
/// besides once at its start: a VMM that started while a killed one's clones were still
/// ending found those pools busy, and no other VMM may start after it.
pub(crate) const SWEEP_PERIOD: Duration = Duration::from_secs(60);
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
    /// The same files opened ahead by the parent and inherited (a clone forked on
    /// request; empty for a warm clone's launch message): writing them spares the
    /// clone opening each file on its way. A path is used when its file fails.
    #[serde(skip)]
    pub fds: Vec<RawFd>,
}

/// A cgroup taken for a clone that is about to be forked.
pub(crate) struct Taken {
    pool: usize,
    lease: Lease,
    /// The v2 directory, open for `clone3(CLONE_INTO_CGROUP)`.
    pub dir: Option<OwnedFd>,
    /// v1: its files the clone moves itself in with, when opened ahead.
    files: Vec<OwnedFd>,
    /// The forker's seat: forked by the forker, born inside when it sits there.
    seat: bool,
}

impl Taken {
    /// The cgroup's name under the pools' parent.
    pub(crate) fn name(&self) -> &str {
        &self.lease.name
    }
}

/// The pools of one VMM and the cgroups its clones hold.
pub struct ClonePools {
    fs: CgroupFs,
    pools: Vec<CgroupPool>,
    /// Cgroups of live clones, by pid.
    leases: HashMap<i32, (usize, Lease)>,
    last_upkeep: Instant,
    /// The hierarchy and the directory every VMM's pools are under (`vmm-<pid>`), and
    /// when they were last swept of killed VMMs' pools.
    top: (Option<CgroupVersion>, String),
    last_sweep: Instant,
    /// Files of the cgroup each pool hands out next, opened ahead, by name (v2: the
    /// directory for clone3; v1: the files a clone moves itself in with), so that
    /// neither the parent nor the clone opens them on the clone path.
    opened: Mutex<HashMap<String, Vec<OwnedFd>>>,
    /// Files of cgroups taken by clones forked since, closed after the parent resumed
    /// (closing a cgroup file costs microseconds the clone path need not wait for).
    spent: Vec<OwnedFd>,
    /// v1: the thread that forks a request's first clone of the default class inside
    /// its cgroup (see [`Forker`]); None on v2, or when it could not start.
    forker: Option<Forker>,
    /// The cgroup of the default class set aside for the forker's next clone, the
    /// forker sitting (or on its way) inside.
    seat: Mutex<Option<Lease>>,
    /// `pids.max` values to write back (raised by one for the forker) once the forker
    /// has left those cgroups, for seats whose clone started.
    restore: Mutex<Vec<Restore>>,
}

/// Removes the pools that VMMs killed before they could remove them (SIGKILL, OOM
/// kill) left under the same parent: a `vmm-<pid>` whose process is gone and whose
/// cgroups are empty. Failure only warns: those pools cost this VMM nothing.
fn sweep_dead_vmms(version: Option<CgroupVersion>, parent: &str) {
    let alive = |pid: i32| {
        // Signal 0 checks that the pid exists; EPERM means it does (not ours).
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None)
            .map_or_else(|e| e != nix::errno::Errno::ESRCH, |()| true)
    };
    let swept = CgroupFs::host(version, parent)
        .and_then(|top| jailer::cgroup::pool::sweep_dead_vmms(&top, alive));
    match swept {
        Ok(s) if s.is_empty() => {}
        Ok(s) => tracing::info!(
            "removed cgroup pools of VMMs that are gone: {}",
            s.join(", ")
        ),
        Err(e) => tracing::warn!("sweeping dead VMMs' cgroup pools under {parent}: {e}"),
    }
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
            top: (cfg.version, cfg.parent.clone()),
            last_sweep: Instant::now(),
            opened: Mutex::new(HashMap::new()),
            spent: Vec::new(),
            forker: None,
            seat: Mutex::new(None),
            restore: Mutex::new(Vec::new()),
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
        if made.fs.version() == CgroupVersion::V1 {
            match made.fs.open_own_move_files().map(Forker::start) {
                Ok(Ok(f)) => made.forker = Some(f),
                Ok(Err(e)) => tracing::warn!("{e}; v1 clones move themselves in"),
                Err(e) => tracing::warn!("cgroup forker: {e}; v1 clones move themselves in"),
            }
        }
        sweep_dead_vmms(cfg.version, &cfg.parent);
        made.open_ahead();
        made.reseat();
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
        let ahead = self.opened_files().remove(&lease.name);
        let opened = match (ahead, self.fs.version()) {
            (Some(files), _) => Ok(files),
            (None, CgroupVersion::V2) => self.open_files(&lease.name),
            // v1: the clone opens the paths itself.
            (None, CgroupVersion::V1) => Ok(Vec::new()),
        };
        let mut files = match opened {
            Ok(files) => files,
            Err(e) => {
                self.give_back(Taken {
                    pool,
                    lease,
                    dir: None,
                    files: Vec::new(),
                    seat: false,
                });
                return Err(PlacementError::Open(e));
            }
        };
        let dir = match self.fs.version() {
            CgroupVersion::V2 => files.pop(),
            CgroupVersion::V1 => None,
        };
        Ok(Taken {
            pool,
            lease,
            dir,
            files,
            seat: false,
        })
    }

    /// The forker's seat, for a clone of `class` (None: the default class) when the
    /// forker waits for one there.
    pub(crate) fn take_seat(&self, class: Option<&str>) -> Option<Taken> {
        if !self.is_default(class) || !self.forker.as_ref().is_some_and(Forker::is_alive) {
            return None;
        }
        let lease = lock(&self.seat).take()?;
        Some(Taken {
            pool: 0,
            lease,
            dir: None,
            files: Vec::new(),
            seat: true,
        })
    }

    /// The forker, when `taken` is its seat.
    pub(crate) fn forker_for(&self, taken: &Taken) -> Option<&Forker> {
        self.forker.as_ref().filter(|_| taken.seat)
    }

    /// Sets an idle cgroup of the default class aside as the forker's seat and sends
    /// the forker there (without waiting), when it has none: after start, after a
    /// request took it, from upkeep. Its `pids.max` is raised by one while the forker
    /// may be inside, and those of seats that clones took are written back once the
    /// forker has left them. Off the clone path: the move costs the kernel a migration
    /// per hierarchy.
    pub(crate) fn reseat(&self) {
        let Some(forker) = self.forker.as_ref().filter(|f| f.is_alive()) else {
            return;
        };
        let mut seat = lock(&self.seat);
        if seat.is_some() {
            return;
        }
        let Some(lease) = self.pools[0].try_take_idle() else {
            return;
        };
        let ahead = self.opened_files().remove(&lease.name);
        let files = match ahead.map_or_else(|| self.open_files(&lease.name), Ok) {
            Ok(f) => f,
            Err(e) => {
                tracing::warn!("cgroup forker seat {}: {e}", lease.name);
                if let Err(e) = self.pools[0].release(lease) {
                    tracing::warn!("cgroup pool: {e}");
                }
                return;
            }
        };
        if let Some(max) = self.pools[0].class().pids_max {
            let path = self.fs.pids_max_file(&lease.name);
            if let Err(e) = std::fs::write(&path, (max + 1).to_string()) {
                tracing::warn!("cgroup forker seat: {}: {e}", path.display());
            }
        }
        let restore = std::mem::take(&mut *lock(&self.restore));
        forker.seat(&lease.name, files, restore);
        *seat = Some(lease);
        drop(seat);
        self.open_ahead();
    }

    fn opened_files(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<OwnedFd>>> {
        self.opened.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The files of cgroup `name` a clone is placed with: v2, the directory for clone3;
    /// v1, the files the clone moves itself in with.
    fn open_files(&self, name: &str) -> Result<Vec<OwnedFd>, jailer::cgroup::CgroupError> {
        match self.fs.version() {
            CgroupVersion::V2 => self.fs.open_v2_dir(name).map(|d| d.into_iter().collect()),
            CgroupVersion::V1 => self.fs.open_self_move_files(name),
        }
    }

    /// Opens the files of the cgroup each pool hands out next, and closes those of
    /// cgroups no longer next (off the clone path: at start, after upkeep and after a
    /// clone's cgroup comes back). Only the next: every clone inherits all of them and
    /// closes those it does not use, each close costing the clone microseconds. A
    /// cgroup whose files cannot be opened is left to be opened when taken.
    fn open_ahead(&self) {
        let idle: Vec<String> = self
            .pools
            .iter()
            .filter_map(|p| p.idle_names().into_iter().next())
            .collect();
        let mut opened = self.opened_files();
        opened.retain(|name, _| idle.contains(name));
        for name in idle {
            if opened.contains_key(&name) {
                continue;
            }
            match self.open_files(&name) {
                Ok(files) => {
                    opened.insert(name, files);
                }
                Err(e) => tracing::debug!("cgroup {name}: opening ahead: {e}"),
            }
        }
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
            fds: taken.files.iter().map(AsRawFd::as_raw_fd).collect(),
        };
        let shown = CloneCgroup {
            class: self.pools[taken.pool].class_name().to_string(),
            path: format!("{}/{}", self.fs.parent(), taken.lease.name),
            placed_by: match (born_inside, self.fs.version()) {
                (true, _) => PlacedBy::Clone3,
                (false, CgroupVersion::V1) => PlacedBy::Tasks,
                (false, CgroupVersion::V2) => PlacedBy::Procs,
            },
            usage: None,
        };
        (placement, shown)
    }

    /// Returns a cgroup whose clone was never started (a seat stays the seat).
    pub(crate) fn give_back(&self, taken: Taken) {
        if taken.seat {
            let mut seat = lock(&self.seat);
            if seat.is_none() {
                *seat = Some(taken.lease);
                return;
            }
        }
        self.leave(&taken.lease.name);
        if let Err(e) = self.pools[taken.pool].release(taken.lease) {
            tracing::warn!("cgroup pool: {e}");
        }
        self.open_ahead();
    }

    /// Records that clone `pid` holds `taken`.
    pub(crate) fn started(&mut self, pid: i32, taken: Taken) {
        if let Some(max) = self.pools[taken.pool]
            .class()
            .pids_max
            .filter(|_| taken.seat)
        {
            lock(&self.restore).push((self.fs.pids_max_file(&taken.lease.name), max.to_string()));
        }
        self.spent.extend(taken.dir);
        self.spent.extend(taken.files);
        self.leases.insert(pid, (taken.pool, taken.lease));
    }

    /// Closes the files of cgroups taken by clones forked since the last call.
    pub(crate) fn close_spent(&mut self) {
        self.spent.clear();
    }

    /// Clone `pid` is gone (reaped): its cgroup goes back to the pool. Returns its usage.
    pub(crate) fn exited(&mut self, pid: i32) -> Option<Usage> {
        let (pool, lease) = self.leases.remove(&pid)?;
        self.leave(&lease.name);
        let usage = match self.pools[pool].release(lease) {
            Ok(u) => Some(u),
            Err(e) => {
                tracing::warn!("cgroup of clone pid {pid}: {e}");
                None
            }
        };
        self.open_ahead();
        self.reseat();
        usage
    }

    /// Before cgroup `name` is emptied and reused: the forker must not be inside (it
    /// would be killed with it, and the VMM with it), and its `pids.max` is rewritten
    /// with the rest of its limits, so no restore for it is left pending.
    fn leave(&self, name: &str) {
        if let Some(f) = &self.forker {
            if !f.leave(name) {
                tracing::warn!("cgroup forker: cannot leave {name}; releasing it will fail");
            }
        }
        let pids = self.fs.pids_max_file(name);
        lock(&self.restore).retain(|(p, _)| *p != pids);
    }

    /// What clone `pid` has used so far.
    pub(crate) fn usage(&self, pid: i32) -> Option<Usage> {
        let (pool, lease) = self.leases.get(&pid)?;
        self.pools[*pool].usage(lease).ok()
    }

    /// The life clone `pid` served ended and it rewinds (`rewind.rs`), in the same
    /// cgroup: returns what it used since it was made or last rewound, and counts
    /// afresh from now (peak memory reset), so the next life's usage is its own.
    pub(crate) fn life_ended(&mut self, pid: i32) -> Option<Usage> {
        let (pool, lease) = self.leases.get(&pid)?;
        (self.pools[*pool].turn_over(lease))
            .map_err(|e| tracing::warn!("cgroup of clone pid {pid}: {e}"))
            .ok()
    }

    /// Memory charged to clone `pid`'s cgroup now.
    pub(crate) fn memory_now(&self, pid: i32) -> Option<u64> {
        let (pool, lease) = self.leases.get(&pid)?;
        self.pools[*pool].memory_now(lease).ok()
    }

    /// A warm clone to be forked in `taken` writes `ahead` bytes of its template's
    /// working set before its request (`working.rs`), charged to that cgroup: its
    /// memory limit is raised by as much, so that its request may use what one in a
    /// clone that wrote nothing ahead may (the pages it writes of those cost it nothing
    /// more). Before the fork: the clone writes them as soon as it is in.
    pub(crate) fn allow_ahead(&self, taken: &Taken, ahead: u64) {
        if ahead > 0 {
            if let Err(e) = self.pools[taken.pool].allow_memory(&taken.lease, ahead) {
                tracing::warn!("cgroup {}: {e}", taken.lease.name);
            }
        }
    }

    /// Whether clone `pid`, come back rewound, keeps `kept` bytes more than at its first
    /// launch, past its class's whole memory limit (it is to end: a fresh clone
    /// replaces it).
    pub(crate) fn keeps_too_much(&self, pid: i32, kept: u64) -> bool {
        let Some((pool, _)) = self.leases.get(&pid) else {
            return false;
        };
        let too_much = (self.pools[*pool].class().memory_limit).is_some_and(|limit| kept > limit);
        if too_much {
            tracing::debug!("clone pid {pid} keeps {kept} bytes, past its class's limit: it ends");
        }
        too_much
    }

    /// Sets clone `pid`'s memory limit to its class's plus `extra` bytes; false when it
    /// could not be written.
    pub(crate) fn allow_extra(&self, pid: i32, extra: u64) -> bool {
        let Some((pool, lease)) = self.leases.get(&pid) else {
            return false;
        };
        (self.pools[*pool].allow_memory(lease, extra))
            .map_err(|e| tracing::warn!("cgroup of clone pid {pid}: {e}"))
            .is_ok()
    }

    /// Refills and shrinks the pools when `UPKEEP_PERIOD` has passed, and sweeps killed
    /// VMMs' pools every [`SWEEP_PERIOD`] (event loop).
    pub(crate) fn upkeep(&mut self) {
        self.close_spent();
        if self.last_sweep.elapsed() >= SWEEP_PERIOD {
            self.last_sweep = Instant::now();
            sweep_dead_vmms(self.top.0, &self.top.1);
        }
        if self.maintenance_due_in() != Some(Duration::ZERO) {
            return;
        }
        self.last_upkeep = Instant::now();
        for p in &self.pools {
            if let Err(e) = p.maintain() {
                tracing::warn!("cgroup pool {}: {e}", p.class_name());
            }
        }
        self.open_ahead();
        self.reseat();
    }

    /// Time until the next upkeep is due: the pools' maintenance while one needs it,
    /// else the next sweep.
    pub(crate) fn upkeep_due_in(&self) -> Option<Duration> {
        let sweep = SWEEP_PERIOD.saturating_sub(self.last_sweep.elapsed());
        Some(self.maintenance_due_in().map_or(sweep, |m| m.min(sweep)))
    }

    /// Time until the pools' maintenance is due; None while no pool needs it.
    fn maintenance_due_in(&self) -> Option<Duration> {
        self.pools
            .iter()
            .any(CgroupPool::needs_maintenance)
            .then(|| UPKEEP_PERIOD.saturating_sub(self.last_upkeep.elapsed()))
    }

    /// Pool counters for `GET /vm`.
    pub fn report(&self) -> CgroupsReport {
        CgroupsReport {
            version: self.fs.version(),
            parent: self.fs.parent().to_string(),
            pools: (self.pools.iter())
                .map(|p| {
                    let report = PoolReport {
                        class: p.class().clone(),
                        stats: p.stats(),
                    };
                    (p.class_name().to_string(), report)
                })
                .collect(),
            forker_seat: lock(&self.seat).as_ref().map(|l| l.name.clone()),
        }
    }
}

impl Drop for ClonePools {
    /// Kills whatever is left in this VMM's cgroups and removes them and its parent
    /// (live clones are stopped and reaped before, at shutdown).
    fn drop(&mut self) {
        // Home and ended first: its cgroup is killed below (its children, which would
        // die with it, were stopped before).
        drop(self.forker.take());
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

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Where a clone in `taken` goes and what `GET /clones` shows: both None without
/// cgroup pools.
pub(super) fn placement_of(
    pools: Option<&ClonePools>,
    taken: Option<&Taken>,
) -> (Option<Placement>, Option<CloneCgroup>) {
    match pools.zip(taken) {
        Some((p, t)) => {
            let (placement, shown) = p.placement(t);
            (Some(placement), Some(shown))
        }
        None => (None, None),
    }
}

/// Records that clone `pid` was started in `taken` (nothing without cgroup pools).
pub(super) fn started_in(pools: Option<&mut ClonePools>, pid: i32, taken: Option<Taken>) {
    if let (Some(p), Some(t)) = (pools, taken) {
        p.started(pid, t);
    }
}

/// Moves the calling process into a cgroup by writing "0" to each of its files (the
/// inherited ones first; each is closed after). Called by a clone before it runs guest
/// code, while the calling thread is its process's only one (on v1 only the calling
/// thread moves; threads started afterwards follow it).
pub(crate) fn place_self(placement: &Placement) -> std::io::Result<()> {
    let mut result = Ok(());
    for (i, path) in placement.files.iter().enumerate() {
        if let Some(&fd) = placement.fds.get(i) {
            // SAFETY: `fd` is an inherited descriptor of this placement, written once and
            // closed here; nothing else in the clone uses it.
            let wrote = unsafe {
                let n = libc::write(fd, b"0".as_ptr().cast(), 1);
                libc::close(fd);
                n == 1
            };
            if wrote {
                continue;
            }
        }
        if result.is_ok() {
            result = std::fs::write(path, "0")
                .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", path.display())));
        }
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::IntoRawFd;

    #[test]
    fn place_self_writes_the_inherited_files_and_falls_back_to_the_paths() {
        let dir = std::env::temp_dir().join(format!("forkvm-place-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b, ro) = (dir.join("a"), dir.join("b"), dir.join("ro"));
        for f in [&a, &b, &ro] {
            std::fs::write(f, "").unwrap();
        }
        let open = |p: &PathBuf, write: bool| {
            std::fs::OpenOptions::new()
                .read(!write)
                .write(write)
                .open(p)
                .unwrap()
                .into_raw_fd()
        };
        // The first file is written through its descriptor (its path does not exist);
        // the second's descriptor cannot be written, so its path is.
        let placement = Placement {
            files: vec![dir.join("missing/a"), b.clone()],
            fds: vec![open(&a, true), open(&ro, false)],
        };
        place_self(&placement).unwrap();
        assert_eq!(std::fs::read_to_string(&a).unwrap(), "0");
        assert_eq!(std::fs::read_to_string(&b).unwrap(), "0");
        assert_eq!(std::fs::read_to_string(&ro).unwrap(), "");

        // Without descriptors, a path that cannot be written is an error naming it.
        let err = place_self(&Placement {
            files: vec![dir.join("missing/a")],
            fds: Vec::new(),
        })
        .unwrap_err();
        assert!(err.to_string().contains("missing/a"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
