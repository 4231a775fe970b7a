//! A pool of ready cgroups for one resource class.
//!
//! Creating a cgroup and configuring its limits costs several file operations (and on
//! v1 one directory per controller); a pooled cgroup is taken from a list. The pool
//! pre-creates `size` cgroups, refills back to `size` when fewer than `low_water` are
//! idle (from [`CgroupPool::maintain`], run by a background thread), never holds more
//! than `max`, and removes idle cgroups beyond `size` after `idle_timeout`.
//!
//! A pool of size 0 keeps no cgroup: each lease creates one and release removes it
//! (what placing clones costs without pooling).
//!
//! On release a cgroup must be empty (leftover processes are killed first: a clone that
//! died leaves none, one that is still running is stopped), its usage is read and
//! reported, its accounting reset where the kernel allows it, its limits written again
//! from the class, and it goes back to the idle list. A cgroup removed behind the
//! pool's back is dropped and replaced.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{CgroupError, CgroupFs, CgroupVersion, ResourceClass, Usage};

/// What `acquire` does when every cgroup is in use and the pool is at `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WhenExhausted {
    /// Fail at once.
    Fail,
    /// Wait up to this long for a release.
    Wait(Duration),
}

/// Pool sizes and policies.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolConfig {
    /// Idle cgroups kept ready (pre-created, refilled to).
    pub size: usize,
    /// Refill when fewer than this many are idle.
    pub low_water: usize,
    /// Most cgroups (idle and in use) the pool may hold.
    pub max: usize,
    /// Idle cgroups beyond `size` are removed after this long.
    pub idle_timeout: Duration,
    /// When every cgroup is in use at `max`.
    pub when_exhausted: WhenExhausted,
}

/// Errors from the pool.
#[derive(Debug, thiserror::Error)]
pub enum PoolError {
    /// Sizes that do not fit together.
    #[error("bad pool configuration: {0}")]
    Config(String),
    /// Every cgroup is in use and the pool is at its maximum.
    #[error("cgroup pool {class} exhausted: all {max} cgroups are in use")]
    Exhausted {
        /// The class.
        class: String,
        /// Its maximum.
        max: usize,
    },
    /// The cgroup is not leased from this pool.
    #[error("cgroup {0} is not in use in this pool")]
    NotLeased(String),
    /// A cgroup file operation failed.
    #[error(transparent)]
    Cgroup(#[from] CgroupError),
}

/// A cgroup taken from the pool; give it back with [`CgroupPool::release`].
#[derive(Debug, PartialEq, Eq)]
pub struct Lease {
    /// Cgroup name under the forkvm parent.
    pub name: String,
}

pub use api_types::cgroup::PoolStats;

struct Idle {
    name: String,
    since: Instant,
    /// Its accounting when it became idle: the base for the next holder's usage.
    base: Usage,
}

#[derive(Default)]
struct State {
    idle: VecDeque<Idle>,
    /// Leased cgroups and their usage when leased (for counters that cannot be reset).
    in_use: HashMap<String, Usage>,
    next: u64,
    stats: PoolStats,
}

/// A pool of cgroups of one class.
pub struct CgroupPool {
    fs: CgroupFs,
    class_name: String,
    class: ResourceClass,
    cfg: PoolConfig,
    state: Mutex<State>,
    released: Condvar,
}

impl CgroupPool {
    /// Makes the pool: removes cgroups of this class left by an earlier run, then
    /// pre-creates `cfg.size`.
    pub fn new(
        fs: CgroupFs,
        class_name: &str,
        class: ResourceClass,
        cfg: PoolConfig,
    ) -> Result<Self, PoolError> {
        if cfg.max == 0 || cfg.size > cfg.max || cfg.low_water > cfg.size {
            return Err(PoolError::Config(format!(
                "need low_water <= size <= max and max > 0 (low_water {}, size {}, max {})",
                cfg.low_water, cfg.size, cfg.max
            )));
        }
        if class_name.is_empty() || class_name.contains(['/', '.']) {
            return Err(PoolError::Config(format!("bad class name {class_name:?}")));
        }
        let pool = Self {
            fs,
            class_name: class_name.to_string(),
            class,
            cfg,
            state: Mutex::new(State::default()),
            released: Condvar::new(),
        };
        let prefix = format!("{class_name}-");
        for name in pool.fs.list()? {
            if name.starts_with(&prefix) {
                pool.fs.kill_all(&name)?;
                pool.fs.remove(&name)?;
            }
        }
        let mut st = pool.lock();
        pool.fill(&mut st, cfg.size)?;
        drop(st);
        Ok(pool)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The class's name.
    pub fn class_name(&self) -> &str {
        &self.class_name
    }

    /// The class's limits.
    pub fn class(&self) -> &ResourceClass {
        &self.class
    }

    /// The driver (for placing processes).
    pub fn fs(&self) -> &CgroupFs {
        &self.fs
    }

    /// Counters.
    pub fn stats(&self) -> PoolStats {
        let st = self.lock();
        PoolStats {
            idle: st.idle.len(),
            in_use: st.in_use.len(),
            ..st.stats
        }
    }

    /// Names of the idle cgroups, the next to be taken first.
    pub fn idle_names(&self) -> Vec<String> {
        self.lock().idle.iter().map(|i| i.name.clone()).collect()
    }

    fn total(st: &State) -> usize {
        st.idle.len() + st.in_use.len()
    }

    fn create_one(&self, st: &mut State) -> Result<String, PoolError> {
        st.next += 1;
        let name = format!("{}-{}", self.class_name, st.next);
        self.fs.create(&name, &self.class)?;
        st.stats.created += 1;
        Ok(name)
    }

    /// Creates idle cgroups until `target` are idle (within `max`).
    fn fill(&self, st: &mut State, target: usize) -> Result<usize, PoolError> {
        let mut made = 0;
        while st.idle.len() < target && Self::total(st) < self.cfg.max {
            let name = self.create_one(st)?;
            let base = self.fs.usage(&name)?;
            st.idle.push_back(Idle {
                name,
                since: Instant::now(),
                base,
            });
            made += 1;
        }
        Ok(made)
    }

    /// Takes a ready cgroup (creating one when none is idle and the pool is below
    /// `max`; waiting or failing at `max`, per the configuration).
    pub fn acquire(&self) -> Result<Lease, PoolError> {
        let deadline = match self.cfg.when_exhausted {
            WhenExhausted::Fail => None,
            WhenExhausted::Wait(d) => Some(Instant::now() + d),
        };
        let mut st = self.lock();
        loop {
            // The clone path: only a stat of the first hierarchy's directory here.
            // Emptiness and accounting were settled when the cgroup became idle.
            while let Some(idle) = st.idle.pop_front() {
                if !self.fs.exists_in_first(&idle.name) {
                    // Removed behind our back: the refill replaces it.
                    st.stats.vanished += 1;
                    continue;
                }
                st.in_use.insert(idle.name.clone(), idle.base);
                return Ok(Lease { name: idle.name });
            }
            if Self::total(&st) < self.cfg.max {
                let name = self.create_one(&mut st)?;
                let base = self.fs.usage(&name)?;
                st.in_use.insert(name.clone(), base);
                return Ok(Lease { name });
            }
            let Some(deadline) = deadline else {
                return Err(self.exhausted());
            };
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.exhausted());
            }
            st = self
                .released
                .wait_timeout(st, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    /// Takes an idle cgroup if there is one, without creating or waiting (for a
    /// cgroup set aside ahead of a request).
    pub fn try_take_idle(&self) -> Option<Lease> {
        let mut st = self.lock();
        while let Some(idle) = st.idle.pop_front() {
            if self.fs.exists_in_first(&idle.name) {
                st.in_use.insert(idle.name.clone(), idle.base);
                return Some(Lease { name: idle.name });
            }
            st.stats.vanished += 1;
        }
        None
    }

    fn exhausted(&self) -> PoolError {
        PoolError::Exhausted {
            class: self.class_name.clone(),
            max: self.cfg.max,
        }
    }

    fn discard(&self, st: &mut State, name: &str) {
        if self.fs.remove(name).is_ok() {
            st.stats.removed += 1;
        }
    }

    /// What the holder of `lease` has used so far.
    pub fn usage(&self, lease: &Lease) -> Result<Usage, PoolError> {
        let base = self
            .lock()
            .in_use
            .get(&lease.name)
            .copied()
            .ok_or_else(|| PoolError::NotLeased(lease.name.clone()))?;
        Ok(since(&base, &self.fs.usage(&lease.name)?))
    }

    /// Starts another accounting period for the holder of `lease`, a clone that serves
    /// one request after another in the same cgroup (a rewound clone): returns its usage
    /// since the last period began (or since its lease), resets what can be reset (peak
    /// memory; v1 CPU time) and counts from now.
    pub fn turn_over(&self, lease: &Lease) -> Result<Usage, PoolError> {
        let mut st = self.lock();
        let Some(base) = st.in_use.get(&lease.name).copied() else {
            return Err(PoolError::NotLeased(lease.name.clone()));
        };
        // Read and reset at every request's end, and its memory each time it comes
        // back: its files are kept open until its release.
        self.fs.hold(&lease.name);
        let now = self.fs.usage(&lease.name)?;
        self.fs.reset_accounting(&lease.name)?;
        // Counted from here: v1's CPU time restarts from zero; the other counters go on.
        let cpu_us = match self.fs.version() {
            CgroupVersion::V1 => 0,
            CgroupVersion::V2 => now.cpu_us,
        };
        st.in_use
            .insert(lease.name.clone(), Usage { cpu_us, ..now });
        Ok(since(&base, &now))
    }

    /// Memory charged to `lease`'s cgroup now.
    pub fn memory_now(&self, lease: &Lease) -> Result<u64, PoolError> {
        Ok(self.fs.memory_now(&lease.name)?)
    }

    /// Raises `lease`'s memory limit to the class's plus `extra` bytes (nothing when
    /// the class sets none); the class's own comes back when the cgroup is released.
    pub fn allow_memory(&self, lease: &Lease, extra: u64) -> Result<(), PoolError> {
        if let Some(limit) = self.class.memory_limit {
            self.fs
                .set_memory_limit(&lease.name, limit.saturating_add(extra))?;
        }
        Ok(())
    }

    /// Gives a cgroup back: kills what is left in it, reads its usage since it was
    /// leased, resets accounting and limits, and makes it ready again. A cgroup that
    /// vanished or cannot be emptied is dropped (a new one replaces it on refill).
    pub fn release(&self, lease: Lease) -> Result<Usage, PoolError> {
        let mut st = self.lock();
        let Some(base) = st.in_use.remove(&lease.name) else {
            return Err(PoolError::NotLeased(lease.name));
        };
        self.released.notify_one();
        let name = lease.name;
        self.fs.let_go(&name);
        if !self.fs.exists(&name) {
            // Gone from at least one hierarchy: what is left elsewhere goes too.
            st.stats.vanished += 1;
            if let Err(e) = self.fs.remove(&name) {
                tracing::warn!("cgroup {name} (vanished in part): {e}");
            }
            return Ok(Usage::default());
        }
        if !self.fs.procs(&name)?.is_empty() {
            self.fs.kill_all(&name)?;
            let left = wait_empty(&self.fs, &name)?;
            if !left.is_empty() {
                return Err(CgroupError::Busy { pids: left, name }.into());
            }
        }
        let usage = since(&base, &self.fs.usage(&name)?);
        if self.cfg.size == 0 {
            // A pool of size 0 keeps nothing: one cgroup per lease, removed on release.
            self.discard(&mut st, &name);
            return Ok(usage);
        }
        let reset = self
            .fs
            .reset_accounting(&name)
            .and_then(|()| self.fs.set_limits(&name, &self.class))
            .and_then(|()| self.fs.usage(&name));
        match reset {
            Ok(base) => st.idle.push_back(Idle {
                name,
                since: Instant::now(),
                base,
            }),
            Err(e) => {
                tracing::warn!("cgroup {name} not reused: {e}");
                self.discard(&mut st, &name);
            }
        }
        Ok(usage)
    }

    /// Whether [`CgroupPool::maintain`] has anything to do: fewer than `low_water`
    /// idle, or more than `size` (to remove once idle long enough).
    pub fn needs_maintenance(&self) -> bool {
        let idle = self.lock().idle.len();
        idle < self.cfg.low_water || idle > self.cfg.size
    }

    /// Background work: refill to `size` when below `low_water`, and remove idle
    /// cgroups beyond `size` that have been idle longer than `idle_timeout`. Returns
    /// (created, removed).
    pub fn maintain(&self) -> Result<(usize, usize), PoolError> {
        let mut st = self.lock();
        let made = if st.idle.len() < self.cfg.low_water {
            self.fill(&mut st, self.cfg.size)?
        } else {
            0
        };
        let mut removed = 0;
        while st.idle.len() > self.cfg.size
            && st
                .idle
                .front()
                .is_some_and(|i| i.since.elapsed() >= self.cfg.idle_timeout)
        {
            let idle = st.idle.pop_front().expect("checked non-empty");
            self.discard(&mut st, &idle.name);
            removed += 1;
        }
        Ok((made, removed))
    }

    /// Kills and removes every cgroup of the pool, idle and leased.
    pub fn destroy(&self) -> Result<(), PoolError> {
        let mut st = self.lock();
        let mut names: Vec<String> = st.idle.drain(..).map(|i| i.name).collect();
        names.extend(st.in_use.drain().map(|(n, _)| n));
        for name in names {
            self.fs.kill_all(&name)?;
            self.fs.remove(&name)?;
            st.stats.removed += 1;
        }
        Ok(())
    }
}

/// Usage between `base` (at lease) and `now`; peak memory is not a counter.
fn since(base: &Usage, now: &Usage) -> Usage {
    Usage {
        cpu_us: now.cpu_us.saturating_sub(base.cpu_us),
        memory_peak: now.memory_peak,
        oom_kills: now.oom_kills.saturating_sub(base.oom_kills),
        cpu_throttled_us: now.cpu_throttled_us.saturating_sub(base.cpu_throttled_us),
    }
}

/// Runs [`CgroupPool::maintain`] on a thread every `period` until dropped.
pub struct Maintainer {
    stop: Arc<(Mutex<bool>, Condvar)>,
    thread: Option<JoinHandle<()>>,
}

impl Maintainer {
    /// Starts the thread.
    pub fn start(pool: Arc<CgroupPool>, period: Duration) -> std::io::Result<Self> {
        let stop = Arc::new((Mutex::new(false), Condvar::new()));
        let flag = stop.clone();
        let thread = std::thread::Builder::new()
            .name("cgroup-pool".into())
            .spawn(move || loop {
                if let Err(e) = pool.maintain() {
                    tracing::warn!("cgroup pool upkeep: {e}");
                }
                let (lock, cv) = &*flag;
                let guard = lock.lock().unwrap_or_else(|p| p.into_inner());
                let (guard, _) = cv
                    .wait_timeout_while(guard, period, |stopped| !*stopped)
                    .unwrap_or_else(|p| p.into_inner());
                if *guard {
                    break;
                }
            })?;
        Ok(Self {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Maintainer {
    fn drop(&mut self) {
        let (lock, cv) = &*self.stop;
        *lock.lock().unwrap_or_else(|p| p.into_inner()) = true;
        cv.notify_all();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Waits up to 2 s for killed processes to leave cgroup `name`; returns those still in it.
fn wait_empty(fs: &CgroupFs, name: &str) -> Result<Vec<i32>, CgroupError> {
    let start = Instant::now();
    loop {
        let left = fs.procs(name)?;
        if left.is_empty() || start.elapsed() > Duration::from_secs(2) {
            return Ok(left);
        }
        std::thread::sleep(Duration::from_millis(2));
    }
}

/// Kills and removes every cgroup under the forkvm parent at any depth (those of every
/// VMM that used this parent), then the parent (`jailer cleanup`). Returns how many cgroups were removed.
pub fn cleanup(fs: &CgroupFs) -> Result<usize, CgroupError> {
    let names = fs.tree()?;
    for name in &names {
        fs.kill_all(name)?;
        wait_empty(fs, name)?;
        // A killed process whose parent has not reaped it yet no longer shows in
        // cgroup.procs but still keeps its cgroup busy: retry for a while.
        let start = Instant::now();
        while let Err(e) = fs.remove(name) {
            let busy = matches!(&e, CgroupError::Io { source, .. } if source.raw_os_error() == Some(libc::EBUSY));
            if !busy || start.elapsed() > Duration::from_secs(2) {
                return Err(e);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }
    fs.remove_parent()?;
    Ok(names.len())
}

/// Removes the pools left by VMMs that died without removing them (killed with
/// SIGKILL, say): each `vmm-<pid>` directly under `top`'s parent whose process `alive`
/// says is gone and whose cgroups hold no process. A directory with a process in it is
/// left alone, whatever its name says. Returns the `vmm-<pid>` names removed.
///
/// `alive` is asked per pid; a VMM passes "a process with this pid exists", so a pid
/// reused by another process only delays the sweep to a later start.
pub fn sweep_dead_vmms(
    top: &CgroupFs,
    alive: impl Fn(i32) -> bool,
) -> Result<Vec<String>, CgroupError> {
    let mut swept = Vec::new();
    for name in top.list()? {
        let Some(pid) = name
            .strip_prefix("vmm-")
            .and_then(|p| p.parse::<i32>().ok())
        else {
            continue;
        };
        if alive(pid) {
            continue;
        }
        let pools = top.below(&name);
        let names = pools.tree()?;
        let mut busy = false;
        for n in &names {
            busy |= !pools.procs(n)?.is_empty();
        }
        if busy {
            continue;
        }
        for n in &names {
            pools.remove(n)?;
        }
        top.remove(&name)?;
        swept.push(name);
    }
    Ok(swept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cgroup::CgroupVersion;
    use std::path::PathBuf;

    struct TempRoot(PathBuf);
    impl TempRoot {
        fn new(tag: &str) -> Self {
            let p = std::env::temp_dir().join(format!(
                "forkvm-cgfake-{tag}-{}-{:?}",
                std::process::id(),
                std::thread::current().id()
            ));
            let _ = std::fs::remove_dir_all(&p);
            Self(p)
        }
    }
    impl Drop for TempRoot {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn class() -> ResourceClass {
        ResourceClass {
            cpu_quota: Some(0.5),
            memory_limit: Some(64 << 20),
            pids_max: Some(32),
        }
    }

    fn cfg(size: usize, low: usize, max: usize, exhausted: WhenExhausted) -> PoolConfig {
        PoolConfig {
            size,
            low_water: low,
            max,
            idle_timeout: Duration::ZERO,
            when_exhausted: exhausted,
        }
    }

    fn fake_pool(root: &TempRoot, v: CgroupVersion, c: PoolConfig) -> CgroupPool {
        let fs = CgroupFs::fake(&root.0, v, "forkvm").unwrap();
        CgroupPool::new(fs, "small", class(), c).unwrap()
    }

    #[test]
    fn precreates_with_limits_on_v1_and_v2() {
        for v in [CgroupVersion::V1, CgroupVersion::V2] {
            let root = TempRoot::new("pre");
            let pool = fake_pool(&root, v, cfg(3, 1, 5, WhenExhausted::Fail));
            assert_eq!(pool.stats().idle, 3);
            assert_eq!(pool.fs().list().unwrap(), ["small-1", "small-2", "small-3"]);
            assert_eq!(pool.fs().limits("small-2").unwrap(), class());
            if v == CgroupVersion::V1 {
                for c in ["cpu", "cpuacct", "memory", "pids"] {
                    assert!(root.0.join(c).join("forkvm/small-3").is_dir());
                }
                let q = std::fs::read_to_string(root.0.join("cpu/forkvm/small-1/cpu.cfs_quota_us"));
                assert_eq!(q.unwrap(), "50000");
            } else {
                let m = std::fs::read_to_string(root.0.join("forkvm/small-1/cpu.max"));
                assert_eq!(m.unwrap(), "50000 100000");
            }
        }
    }

    #[test]
    fn acquire_release_reports_usage_and_resets() {
        let root = TempRoot::new("rel");
        let pool = fake_pool(&root, CgroupVersion::V1, cfg(1, 0, 2, WhenExhausted::Fail));
        let lease = pool.acquire().unwrap();
        let dir = root.0.join("memory/forkvm").join(&lease.name);
        // The clone runs: it is placed, uses CPU and memory, and a limit is changed.
        pool.fs().place(&lease.name, 4242).unwrap();
        assert_eq!(pool.fs().procs(&lease.name).unwrap(), [4242]);
        std::fs::write(
            root.0
                .join("cpuacct/forkvm")
                .join(&lease.name)
                .join("cpuacct.usage"),
            "7000000",
        )
        .unwrap();
        std::fs::write(dir.join("memory.max_usage_in_bytes"), "1048576").unwrap();
        std::fs::write(dir.join("memory.limit_in_bytes"), "1").unwrap();
        let cpu_stat = root.0.join("cpu/forkvm").join(&lease.name).join("cpu.stat");
        let throttled = |ns: u64| {
            let text = format!("nr_periods 9\nnr_throttled 3\nthrottled_time {ns}\n");
            std::fs::write(&cpu_stat, text).unwrap();
        };
        throttled(3_000_000);
        let name = lease.name.clone();
        // Released with a process left: it is killed, usage read, limits reset.
        let usage = pool.release(lease).unwrap();
        assert_eq!(
            usage,
            Usage {
                cpu_us: 7000,
                memory_peak: 1 << 20,
                oom_kills: 0,
                cpu_throttled_us: 3000,
            }
        );
        assert!(pool.fs().procs(&name).unwrap().is_empty());
        assert_eq!(pool.fs().limits(&name).unwrap(), class());
        // v1 cannot reset the throttled time: the next lease gets the difference.
        let left = Usage {
            cpu_throttled_us: 3000,
            ..Usage::default()
        };
        assert_eq!(pool.fs().usage(&name).unwrap(), left);
        assert_eq!(pool.stats().idle, 1);
        // The same cgroup is reused, and reports only what it used since.
        let lease = pool.acquire().unwrap();
        assert_eq!(lease.name, name);
        throttled(3_500_000);
        assert_eq!(pool.release(lease).unwrap().cpu_throttled_us, 500);
        assert_eq!(pool.acquire().unwrap().name, name);
        assert!(matches!(
            pool.release(Lease {
                name: "small-9".into()
            }),
            Err(PoolError::NotLeased(_))
        ));
    }

    #[test]
    fn a_lease_turned_over_reports_each_period_and_its_memory_limit_is_raised_then_reset() {
        for v in [CgroupVersion::V1, CgroupVersion::V2] {
            let root = TempRoot::new("turn");
            let pool = fake_pool(&root, v, cfg(1, 0, 2, WhenExhausted::Fail));
            let lease = pool.acquire().unwrap();
            let (cpu_dir, mem_dir, cpu_file, peak_file, now_file, limit_file) = match v {
                CgroupVersion::V1 => (
                    root.0.join("cpuacct/forkvm").join(&lease.name),
                    root.0.join("memory/forkvm").join(&lease.name),
                    "cpuacct.usage",
                    "memory.max_usage_in_bytes",
                    "memory.usage_in_bytes",
                    "memory.limit_in_bytes",
                ),
                CgroupVersion::V2 => {
                    let dir = root.0.join("forkvm").join(&lease.name);
                    (
                        dir.clone(),
                        dir,
                        "cpu.stat",
                        "memory.peak",
                        "memory.current",
                        "memory.max",
                    )
                }
            };
            let ran = |us: u64| {
                let text = match v {
                    CgroupVersion::V1 => (us * 1000).to_string(),
                    CgroupVersion::V2 => format!("usage_usec {us}\nthrottled_usec 0\n"),
                };
                std::fs::write(cpu_dir.join(cpu_file), text).unwrap();
            };
            let write =
                |file: &str, value: &str| std::fs::write(mem_dir.join(file), value).unwrap();
            ran(5000);
            write(peak_file, "3000000");
            let first = pool.turn_over(&lease).unwrap();
            assert_eq!(
                (first.cpu_us, first.memory_peak),
                (5000, 3_000_000),
                "{v:?}"
            );
            // Peak memory was reset (the fake files keep what was written: "0").
            ran(match v {
                CgroupVersion::V1 => 2000,
                CgroupVersion::V2 => 7000,
            });
            write(peak_file, "1000000");
            let second = pool.turn_over(&lease).unwrap();
            assert_eq!(
                (second.cpu_us, second.memory_peak),
                (2000, 1_000_000),
                "{v:?}"
            );
            write(now_file, "4096");
            assert_eq!(pool.memory_now(&lease).unwrap(), 4096);
            pool.allow_memory(&lease, 1 << 20).unwrap();
            let limit = std::fs::read_to_string(mem_dir.join(limit_file)).unwrap();
            assert_eq!(limit, ((64u64 << 20) + (1 << 20)).to_string(), "{v:?}");
            let name = lease.name.clone();
            pool.release(lease).unwrap();
            assert_eq!(pool.fs().limits(&name).unwrap(), class(), "{v:?}");
            assert!(matches!(
                pool.turn_over(&Lease { name }),
                Err(PoolError::NotLeased(_))
            ));
        }
    }

    #[test]
    fn exhaustion_fails_or_waits_per_config() {
        let root = TempRoot::new("exh");
        let pool = fake_pool(&root, CgroupVersion::V2, cfg(1, 0, 2, WhenExhausted::Fail));
        let a = pool.acquire().unwrap();
        let _b = pool.acquire().unwrap();
        let e = pool.acquire().unwrap_err();
        assert!(matches!(e, PoolError::Exhausted { max: 2, .. }), "{e}");
        assert!(e.to_string().contains("all 2 cgroups are in use"));
        pool.release(a).unwrap();
        pool.acquire().unwrap();

        let root = TempRoot::new("wait");
        let pool = Arc::new(fake_pool(
            &root,
            CgroupVersion::V2,
            cfg(1, 0, 1, WhenExhausted::Wait(Duration::from_secs(5))),
        ));
        let held = pool.acquire().unwrap();
        let p = pool.clone();
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            p.release(held).unwrap();
        });
        let start = Instant::now();
        let got = pool.acquire().unwrap();
        assert!(start.elapsed() >= Duration::from_millis(90));
        assert_eq!(got.name, "small-1");
        releaser.join().unwrap();
    }

    #[test]
    fn refills_below_low_water_shrinks_idle_and_replaces_vanished() {
        let root = TempRoot::new("refill");
        let pool = fake_pool(&root, CgroupVersion::V1, cfg(3, 2, 6, WhenExhausted::Fail));
        let leases: Vec<Lease> = (0..5).map(|_| pool.acquire().unwrap()).collect();
        assert_eq!(pool.stats().idle, 0);
        // Below low water: refill to size, within max (5 in use + 1).
        assert_eq!(pool.maintain().unwrap(), (1, 0));
        for l in leases {
            pool.release(l).unwrap();
        }
        // 6 idle > size 3: the oldest idle beyond size go (idle_timeout 0).
        assert_eq!(pool.maintain().unwrap(), (0, 3));
        assert_eq!(pool.stats().idle, 3);
        // A cgroup removed behind the pool's back is skipped and replaced.
        let first = pool.fs().list().unwrap()[0].clone();
        pool.fs().remove(&first).unwrap();
        let l = pool.acquire().unwrap();
        assert_ne!(l.name, first);
        assert_eq!(pool.stats().vanished, 1);
        // One removed from a hierarchy other than the first is taken (a take looks at
        // the first only); at release the rest of it is removed too.
        let next = pool.acquire().unwrap();
        std::fs::remove_dir_all(root.0.join("memory/forkvm").join(&next.name)).unwrap();
        let gone = next.name.clone();
        assert_eq!(pool.release(next).unwrap(), Usage::default());
        assert_eq!(pool.stats().vanished, 2);
        assert!(!pool.fs().list().unwrap().contains(&gone));
        assert!(!root.0.join("pids/forkvm").join(&gone).exists());
        // Everything goes: destroy, then cleanup removes the parent.
        pool.destroy().unwrap();
        assert!(pool.fs().list().unwrap().is_empty());
        assert_eq!(cleanup(pool.fs()).unwrap(), 0);
        assert!(!root.0.join("cpu/forkvm").exists());
    }

    #[test]
    fn size_zero_creates_per_lease_and_removes_on_release() {
        let root = TempRoot::new("zero");
        let pool = fake_pool(&root, CgroupVersion::V2, cfg(0, 0, 4, WhenExhausted::Fail));
        assert!(pool.fs().list().unwrap().is_empty());
        let a = pool.acquire().unwrap();
        let b = pool.acquire().unwrap();
        assert_eq!(pool.fs().list().unwrap().len(), 2);
        pool.release(a).unwrap();
        pool.release(b).unwrap();
        assert!(pool.fs().list().unwrap().is_empty());
        let s = pool.stats();
        assert_eq!((s.idle, s.in_use, s.created, s.removed), (0, 0, 2, 2));
        pool.destroy().unwrap();
    }

    #[test]
    fn nested_parents_are_cleaned_up_to_the_top() {
        let root = TempRoot::new("nested");
        let fs = CgroupFs::fake(&root.0, CgroupVersion::V1, "forkvm/vmm-1").unwrap();
        let pool =
            CgroupPool::new(fs.clone(), "a", class(), cfg(2, 1, 4, WhenExhausted::Fail)).unwrap();
        let other = CgroupFs::fake(&root.0, CgroupVersion::V1, "forkvm/vmm-2").unwrap();
        other.create("b-1", &class()).unwrap();
        // One VMM's parent goes; the shared top stays while another VMM uses it.
        pool.destroy().unwrap();
        fs.remove_parent().unwrap();
        assert!(!root.0.join("memory/forkvm/vmm-1").exists());
        assert!(root.0.join("memory/forkvm/vmm-2/b-1").exists());
        // `jailer cleanup` on the top removes every VMM's cgroups at any depth.
        let top = CgroupFs::fake(&root.0, CgroupVersion::V1, "forkvm").unwrap();
        assert_eq!(cleanup(&top).unwrap(), 2);
        assert!(!root.0.join("memory/forkvm").exists());
    }

    #[test]
    fn dead_vmms_pools_are_swept_and_live_ones_kept() {
        let root = TempRoot::new("sweep");
        for (vmm, leaves) in [
            ("vmm-10", &["a-1"][..]),
            ("vmm-11", &["a-1"]),
            ("vmm-12", &["b", "b/c"]),
        ] {
            let fs = CgroupFs::fake(&root.0, CgroupVersion::V1, &format!("forkvm/{vmm}")).unwrap();
            for leaf in leaves {
                fs.create(leaf, &class()).unwrap();
            }
        }
        std::fs::create_dir_all(root.0.join("memory/forkvm/not-a-vmm")).unwrap();
        // vmm-12 is dead but one of its cgroups still holds a process.
        std::fs::write(root.0.join("pids/forkvm/vmm-12/b/c/cgroup.procs"), "4242\n").unwrap();
        let top = CgroupFs::fake(&root.0, CgroupVersion::V1, "forkvm").unwrap();
        let swept = sweep_dead_vmms(&top, |pid| pid == 11).unwrap();
        assert_eq!(swept, vec!["vmm-10".to_string()]);
        for c in ["cpu", "cpuacct", "memory", "pids"] {
            assert!(!root.0.join(c).join("forkvm/vmm-10").exists(), "{c}");
            assert!(root.0.join(c).join("forkvm/vmm-11/a-1").exists(), "{c}");
            assert!(root.0.join(c).join("forkvm/vmm-12/b/c").exists(), "{c}");
        }
        assert!(root.0.join("memory/forkvm/not-a-vmm").exists());
    }

    #[test]
    fn bad_configs_are_refused() {
        let root = TempRoot::new("bad");
        let fs = CgroupFs::fake(&root.0, CgroupVersion::V2, "forkvm").unwrap();
        for c in [
            cfg(3, 1, 2, WhenExhausted::Fail),
            cfg(1, 2, 3, WhenExhausted::Fail),
            cfg(0, 0, 0, WhenExhausted::Fail),
        ] {
            assert!(matches!(
                CgroupPool::new(fs.clone(), "x", class(), c),
                Err(PoolError::Config(_))
            ));
        }
        assert!(CgroupPool::new(fs, "a/b", class(), cfg(1, 0, 1, WhenExhausted::Fail)).is_err());
    }

    /// On this host's real hierarchy (v1 here; v2 where it is the only one): a process
    /// placed in a pooled cgroup is seen there, killed on release, and every cgroup is
    /// gone after cleanup. Needs root; fails instead of skipping under CI.
    #[test]
    fn real_hierarchy_place_release_cleanup() {
        if !nix::unistd::geteuid().is_root() {
            assert!(
                std::env::var_os("CI").is_none(),
                "cgroup tests need root in CI"
            );
            eprintln!("SKIPPED real_hierarchy_place_release_cleanup: not root");
            return;
        }
        let parent = format!("forkvm-unit-{}", std::process::id());
        let fs = CgroupFs::host(None, &parent).unwrap();
        let pool =
            CgroupPool::new(fs.clone(), "t", class(), cfg(2, 1, 4, WhenExhausted::Fail)).unwrap();
        let lease = pool.acquire().unwrap();
        assert_eq!(fs.limits(&lease.name).unwrap(), class());
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .spawn()
            .unwrap();
        fs.place(&lease.name, child.id() as i32).unwrap();
        assert_eq!(fs.procs(&lease.name).unwrap(), [child.id() as i32]);
        pool.release(lease).unwrap();
        let status = child.wait().unwrap();
        assert!(!status.success(), "the leftover process was killed");
        pool.destroy().unwrap();
        cleanup(&fs).unwrap();
        assert!(fs.list().unwrap().is_empty());
    }
}
