//! The policies around a machine: how this host runs it (its console, control socket,
//! memory, sandbox, cgroups), what its clones may be, and how it serves invocations.
//! A snapshot saves the clone and invocation policies beside the machine; the host's
//! are given again at restore.

use std::path::PathBuf;

/// Most live clones one VM may have (each clone may have as many of its own), and the
/// default of `--max-clones`.
pub const MAX_LIVE_CLONES: usize = 2000;
/// Most live clones a whole tree (an original VM, its clones, theirs, ...) may have
/// (`--max-tree-clones`, default [`MAX_LIVE_CLONES`]).
pub const MAX_TREE_CLONES: usize = 65536;
/// Most warm clones a VM may keep (`--warm-clones`).
pub const MAX_WARM_CLONES: usize = 256;
/// Most fork sources a template may have, itself included (`--fork-sources`).
pub const MAX_FORK_SOURCES: usize = 64;

/// The most of a template's working set its warm clones write ahead unless told
/// otherwise, in MiB (`cloning::working`).
pub const DEFAULT_WORKING_SET_MIB: u64 = 64;
/// Most `--working-set-mib`.
pub const MAX_WORKING_SET_MIB: u64 = 16 * 1024;

/// How long an idle runtime waits before it is refreshed unless told otherwise, in ms.
pub const DEFAULT_REFRESH_IDLE_MS: u64 = 0;

/// How far a due timer interrupt is deferred at a request's delivery unless told
/// otherwise, in ms.
pub const DEFAULT_TICK_DEFER_MS: u64 = 10;

/// Most `--tick-defer-ms`: a guest timer may be held back this long, not more.
pub const MAX_TICK_DEFER_MS: u64 = 1000;

/// Where the guest's serial console goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ConsoleSink {
    /// The VMM's standard output.
    Stdout,
    /// A file, created or truncated.
    File(PathBuf),
    /// Discarded.
    Null,
}

/// Resource classes for clones, each with a pool of ready cgroups (`cloning::cgroups`).
#[derive(Debug, Clone, PartialEq)]
pub struct CgroupConfig {
    /// Class names and limits; the first is used when a request names none (and for
    /// clones the guest asks for).
    pub classes: Vec<(String, jailer::cgroup::ResourceClass)>,
    /// Which hierarchy (None: v2 when the host is v2-only, else v1).
    pub version: Option<jailer::cgroup::CgroupVersion>,
    /// Directory under each hierarchy's root for every forkvm VMM (each adds
    /// `vmm-<pid>` under it).
    pub parent: String,
    /// Ready cgroups kept per class.
    pub pool_size: usize,
    /// Most cgroups per class (idle and in use).
    pub pool_max: usize,
    /// How long a clone request waits for a cgroup when its pool is at `pool_max` (0:
    /// fail at once).
    pub wait_ms: u64,
}

impl Default for CgroupConfig {
    fn default() -> Self {
        Self {
            classes: Vec::new(),
            version: None,
            parent: "forkvm".into(),
            pool_size: 4,
            pool_max: 256,
            wait_ms: 0,
        }
    }
}

impl CgroupConfig {
    /// Makes class `name` the default (first) one, the others following in their
    /// order; nothing when there is no such class.
    pub fn make_default(&mut self, name: &str) {
        if let Some(i) = self.classes.iter().position(|(n, _)| n == name) {
            let class = self.classes.remove(i);
            self.classes.insert(0, class);
        }
    }

    /// Checks the classes and pool sizes.
    pub fn check(&self) -> Result<(), String> {
        if self.classes.is_empty() {
            return Err("no class given".into());
        }
        for (i, (name, _)) in self.classes.iter().enumerate() {
            if self.classes[..i].iter().any(|(n, _)| n == name) {
                return Err(format!("class {name:?} given twice"));
            }
        }
        let max_live = MAX_LIVE_CLONES;
        if self.pool_max == 0 || self.pool_max > max_live || self.pool_size > self.pool_max {
            return Err(format!(
                "need pool size <= pool max <= {max_live} and pool max > 0 (size {}, max {})",
                self.pool_size, self.pool_max
            ));
        }
        if self.wait_ms > 10_000 {
            return Err(format!("wait of {} ms is over 10 s", self.wait_ms));
        }
        let parent = std::path::Path::new(&self.parent);
        if self.parent.is_empty()
            || parent.is_absolute()
            || parent
                .components()
                .any(|c| !matches!(c, std::path::Component::Normal(_)))
        {
            return Err(format!(
                "cgroup parent {:?} must be a relative path without '..'",
                self.parent
            ));
        }
        Ok(())
    }
}

/// How this host runs the VM: nothing of it reaches the guest.
#[derive(Debug, Clone)]
pub struct HostPolicy {
    /// Serial console sink.
    pub console: ConsoleSink,
    /// Control socket path.
    pub api_sock: Option<PathBuf>,
    /// Advise transparent huge pages for guest RAM.
    pub thp: bool,
    /// Populate all guest RAM before boot.
    pub prefault: bool,
    /// Pooled cgroups for clones (None: clones stay in the VMM's cgroup).
    pub cgroups: Option<CgroupConfig>,
    /// What a system call outside a thread's seccomp filter does (`crate::sandbox`).
    pub seccomp: jailer::seccomp::SeccompMode,
}

impl Default for HostPolicy {
    fn default() -> Self {
        Self {
            console: ConsoleSink::Stdout,
            api_sock: None,
            thp: true,
            prefault: false,
            cgroups: None,
            seccomp: jailer::seccomp::SeccompMode::KillProcess,
        }
    }
}

/// What the VM's clones may be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClonePolicy {
    /// Warm clones to keep ready while the VM is paused (`cloning::warm`).
    pub warm_clones: usize,
    /// Most live clones (1 to [`MAX_LIVE_CLONES`]); requests beyond are refused (409).
    pub max_clones: usize,
    /// Most live clones of the whole tree this VM starts (1 to [`MAX_TREE_CLONES`];
    /// an original VM's, which its clones inherit: `cloning::tree`).
    pub max_tree_clones: usize,
    /// Whether a template's warm clones are primed (`invoke::prime`).
    pub prime: bool,
    /// The most of a template's working set, learned from its invocation clones, that
    /// each warm clone (and an invocation's clone forked on its request) writes ahead,
    /// in MiB (0: none; `cloning::working`).
    pub working_set_mib: u64,
    /// A template's fork sources, itself included (1 to [`MAX_FORK_SOURCES`]): the
    /// others are clones of it that serve its invocations in turn, each with its own
    /// warm clones (`cloning::sources`).
    pub fork_sources: usize,
}

impl Default for ClonePolicy {
    fn default() -> Self {
        Self {
            warm_clones: 0,
            max_clones: MAX_LIVE_CLONES,
            max_tree_clones: MAX_LIVE_CLONES,
            prime: true,
            working_set_mib: DEFAULT_WORKING_SET_MIB,
            fork_sources: 1,
        }
    }
}

/// How the VM serves invocations (docs/invoke.md).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvokePolicy {
    /// A template: the VM pauses itself the first time its runtime waits for a
    /// request, and each invocation runs in a clone of it.
    pub template: bool,
    /// How long a runtime waits idle for a request before it is refreshed, in ms (0:
    /// never; `invoke`).
    pub refresh_idle_ms: u64,
    /// How far a guest timer interrupt already due when a request is delivered is
    /// moved on, in ms (0: not; `clone::timer`).
    pub tick_defer_ms: u64,
    /// A template's invocation clones are rewound to its state once they answered and
    /// serve another request, instead of ending (`cloning/rewind.rs`; `--rewind`).
    pub rewind: bool,
}

impl Default for InvokePolicy {
    fn default() -> Self {
        Self {
            template: false,
            refresh_idle_ms: DEFAULT_REFRESH_IDLE_MS,
            tick_defer_ms: DEFAULT_TICK_DEFER_MS,
            rewind: false,
        }
    }
}

impl InvokePolicy {
    /// How far a due timer interrupt is moved on at a request's delivery, in ns (0: not).
    pub fn tick_defer_ns(&self) -> u64 {
        self.tick_defer_ms.saturating_mul(1_000_000)
    }
}
