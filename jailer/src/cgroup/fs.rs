//! Cgroup files for v1 (one hierarchy per controller) and v2 (unified).
//!
//! Every forkvm cgroup lives under one parent directory (`forkvm` by default) in each
//! hierarchy: `<root>/<controller>/forkvm/<name>` on v1, `<root>/forkvm/<name>` on v2.
//! A fake root (tests) is a plain directory laid out the same way; since no kernel
//! creates the interface files there, [`CgroupFs::create`] writes them with the
//! kernel's defaults and [`CgroupFs::remove`] deletes them.

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use super::held::HeldFiles;
use super::{CgroupError, ResourceClass, Usage};

/// cgroup v1 controllers forkvm uses, by hierarchy directory name.
const V1_CONTROLLERS: [&str; 4] = ["cpu", "cpuacct", "memory", "pids"];
/// CFS period forkvm sets with a CPU quota (the kernel default).
const CPU_PERIOD_US: u64 = 100_000;
/// What v1 `memory.limit_in_bytes` reads when unlimited (page-aligned i64::MAX).
const V1_UNLIMITED: &str = "9223372036854771712";

pub use api_types::cgroup::CgroupVersion;

/// The cgroup files of one hierarchy root.
#[derive(Debug, Clone)]
pub struct CgroupFs {
    version: CgroupVersion,
    root: PathBuf,
    parent: String,
    fake: bool,
    /// v1: the controllers mounted (looked up once: the clone path asks often).
    controllers: Vec<&'static str>,
    /// The files of cgroups held open ([`CgroupFs::hold`]).
    held: HeldFiles,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> CgroupError + '_ {
    move |source| CgroupError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Names of the directories in `dir`, sorted (none when `dir` does not exist).
/// Opens a cgroup file for writing (close-on-exec).
fn open_to_write(path: &Path) -> Result<OwnedFd, CgroupError> {
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .map(OwnedFd::from)
        .map_err(io(path))
}

fn subdirs(dir: &Path) -> Result<Vec<String>, CgroupError> {
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(io(dir)(e)),
    };
    let mut names: Vec<String> = entries
        .filter_map(Result::ok)
        .filter(|e| e.path().is_dir())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    Ok(names)
}

fn is_cgroup2(path: &Path) -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| {
            let mut f = l.split_whitespace();
            let (_, mnt, fstype) = (f.next(), f.next(), f.next());
            mnt == Some(&*path.to_string_lossy()) && fstype == Some("cgroup2")
        })
}

impl CgroupFs {
    /// The host's hierarchy: v2 when `/sys/fs/cgroup` is unified (or `want` is V2 and a
    /// cgroup2 mount exists at `/sys/fs/cgroup/unified`), else v1. `parent` is the
    /// directory every forkvm cgroup goes under.
    pub fn host(want: Option<CgroupVersion>, parent: &str) -> Result<Self, CgroupError> {
        let base = Path::new("/sys/fs/cgroup");
        let unified = base.join("unified");
        let v2_root = if is_cgroup2(base) {
            Some(base.to_path_buf())
        } else if is_cgroup2(&unified) {
            Some(unified)
        } else {
            None
        };
        let v1 = V1_CONTROLLERS.iter().any(|c| base.join(c).is_dir());
        let has_v2 = v2_root.is_some();
        let (version, root) = match (want, v2_root, v1) {
            (Some(CgroupVersion::V2) | None, Some(r), _) if want.is_some() || !v1 => {
                (CgroupVersion::V2, r)
            }
            (Some(CgroupVersion::V1) | None, _, true) => (CgroupVersion::V1, base.to_path_buf()),
            _ => {
                return Err(CgroupError::NoHierarchy(format!(
                    "asked for {want:?}; cgroup2 mount: {}, v1 controllers: {v1}",
                    has_v2
                )))
            }
        };
        let controllers = V1_CONTROLLERS
            .iter()
            .copied()
            .filter(|c| version == CgroupVersion::V1 && root.join(c).is_dir())
            .collect();
        Ok(Self {
            version,
            root,
            parent: parent.to_string(),
            fake: false,
            controllers,
            held: HeldFiles::default(),
        })
    }

    /// A fake hierarchy in the directory `root` (created if needed), for tests.
    pub fn fake(root: &Path, version: CgroupVersion, parent: &str) -> Result<Self, CgroupError> {
        let fs = Self {
            version,
            root: root.to_path_buf(),
            parent: parent.to_string(),
            fake: true,
            controllers: V1_CONTROLLERS.to_vec(),
            held: HeldFiles::default(),
        };
        for dir in fs.parent_dirs() {
            std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        }
        Ok(fs)
    }

    /// The same hierarchy with `name` (a cgroup under this parent) as the parent.
    pub fn below(&self, name: &str) -> Self {
        Self {
            parent: format!("{}/{name}", self.parent),
            held: HeldFiles::default(),
            ..self.clone()
        }
    }

    /// v1 or v2.
    pub fn version(&self) -> CgroupVersion {
        self.version
    }

    /// The forkvm parent directory in every hierarchy.
    fn parent_dirs(&self) -> Vec<PathBuf> {
        match self.version {
            CgroupVersion::V2 => vec![self.root.join(&self.parent)],
            CgroupVersion::V1 => self
                .controllers
                .iter()
                .map(|c| self.root.join(c).join(&self.parent))
                .collect(),
        }
    }

    /// Directory of cgroup `name` for `controller` (v1) or the unified one (v2).
    fn dir(&self, controller: &str, name: &str) -> PathBuf {
        match self.version {
            CgroupVersion::V2 => self.root.join(&self.parent).join(name),
            CgroupVersion::V1 => self.root.join(controller).join(&self.parent).join(name),
        }
    }

    /// Every directory of cgroup `name`.
    fn dirs(&self, name: &str) -> Vec<PathBuf> {
        self.parent_dirs()
            .into_iter()
            .map(|p| p.join(name))
            .collect()
    }

    /// The v2 directory of `name` (for `clone3(CLONE_INTO_CGROUP)`); None on v1.
    pub fn v2_dir(&self, name: &str) -> Option<PathBuf> {
        (self.version == CgroupVersion::V2).then(|| self.dir("", name))
    }

    /// Opens the v2 directory of `name` for `clone3(CLONE_INTO_CGROUP)` (see
    /// [`super::fork_into`]); None on v1.
    pub fn open_v2_dir(&self, name: &str) -> Result<Option<OwnedFd>, CgroupError> {
        use std::os::unix::fs::OpenOptionsExt;
        let Some(path) = self.v2_dir(name) else {
            return Ok(None);
        };
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_DIRECTORY | libc::O_CLOEXEC)
            .open(&path)
            .map_err(io(&path))?;
        Ok(Some(f.into()))
    }

    /// Names of the cgroups under the forkvm parent (from the first hierarchy).
    pub fn list(&self) -> Result<Vec<String>, CgroupError> {
        let Some(parent) = self.parent_dirs().into_iter().next() else {
            return Ok(Vec::new());
        };
        subdirs(&parent)
    }

    /// Every cgroup below the forkvm parent at any depth (from the first hierarchy),
    /// as names relative to the parent, children before their parents.
    pub fn tree(&self) -> Result<Vec<String>, CgroupError> {
        fn walk(dir: &Path, rel: &str, out: &mut Vec<String>) -> Result<(), CgroupError> {
            for name in subdirs(dir)? {
                let child = if rel.is_empty() {
                    name.clone()
                } else {
                    format!("{rel}/{name}")
                };
                walk(&dir.join(&name), &child, out)?;
                out.push(child);
            }
            Ok(())
        }
        let mut out = Vec::new();
        if let Some(parent) = self.parent_dirs().into_iter().next() {
            walk(&parent, "", &mut out)?;
        }
        Ok(out)
    }

    fn write(
        &self,
        controller: &str,
        name: &str,
        file: &str,
        value: &str,
    ) -> Result<(), CgroupError> {
        let path = self.dir(controller, name).join(file);
        (self.held.write(name, &path, value, self.fake))
            .unwrap_or_else(|| std::fs::write(&path, value))
            .map_err(io(&path))
    }

    fn read(&self, controller: &str, name: &str, file: &str) -> Result<String, CgroupError> {
        let path = self.dir(controller, name).join(file);
        (self.held.read(name, &path))
            .unwrap_or_else(|| std::fs::read_to_string(&path))
            .map_err(io(&path))
    }

    /// Keeps cgroup `name`'s files open once read or written (its accounting is read
    /// and reset often), until it is let go or removed.
    pub fn hold(&self, name: &str) {
        self.held.hold(name);
    }

    /// Closes the files [`CgroupFs::hold`] kept open for cgroup `name`.
    pub fn let_go(&self, name: &str) {
        self.held.let_go(name);
    }

    fn read_u64(&self, controller: &str, name: &str, file: &str) -> Result<u64, CgroupError> {
        let text = self.read(controller, name, file)?;
        text.trim().parse().map_err(|_| CgroupError::Parse {
            path: self.dir(controller, name).join(file).display().to_string(),
            text,
        })
    }

    /// `key value` lines (cpu.stat, memory.events, memory.oom_control): the value of `key`.
    fn read_key(&self, controller: &str, name: &str, file: &str, key: &str) -> u64 {
        self.read(controller, name, file)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix(key)?.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Whether cgroup `name` exists in every hierarchy.
    pub fn exists(&self, name: &str) -> bool {
        self.dirs(name).iter().all(|d| d.is_dir())
    }

    /// Whether cgroup `name`'s directory exists in the first hierarchy: one `stat`, for
    /// the clone path (each costs ~10 us here). A cgroup removed from another
    /// hierarchy only is found when its clone cannot enter it.
    pub fn exists_in_first(&self, name: &str) -> bool {
        self.parent_dirs()
            .first()
            .is_some_and(|p| p.join(name).is_dir())
    }

    /// Creates cgroup `name` (and the forkvm parent if needed) with `class`'s limits.
    pub fn create(&self, name: &str, class: &ResourceClass) -> Result<(), CgroupError> {
        for parent in self.parent_dirs() {
            if !parent.is_dir() {
                std::fs::create_dir_all(&parent).map_err(io(&parent))?;
                if self.version == CgroupVersion::V2 && !self.fake {
                    self.enable_v2_controllers(&parent);
                }
            }
            let dir = parent.join(name);
            match std::fs::create_dir(&dir) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                Err(e) => return Err(io(&dir)(e)),
            }
            if self.fake {
                self.fake_interface_files(&dir)?;
            }
        }
        // A cgroup whose limits cannot be written is not left behind.
        self.set_limits(name, class).inspect_err(|_| {
            let _ = self.remove(name);
        })
    }

    /// Delegates the parent directory to `uid`:`gid` for a jailed VMM (`jailer`): creates
    /// it with an empty child `leaf` for the VMM itself, and hands the VMM the parent's
    /// directory and the files a delegatee writes (`cgroup.procs`, on v1 `tasks`, and on
    /// v2 `cgroup.subtree_control` and `cgroup.threads`). On v2 the offered controllers are
    /// enabled down to the parent's own parent only: the VMM enables them in the parent
    /// once it sits in `leaf` (a cgroup with processes cannot). Returns the parent
    /// directories, one per hierarchy.
    pub fn delegate(&self, leaf: &str, uid: u32, gid: u32) -> Result<Vec<PathBuf>, CgroupError> {
        let parents = self.parent_dirs();
        for parent in &parents {
            if self.version == CgroupVersion::V2 && !self.fake {
                if let Some(up) = parent.parent() {
                    std::fs::create_dir_all(up).map_err(io(up))?;
                    self.enable_v2_controllers(up);
                }
            }
            let dir = parent.join(leaf);
            std::fs::create_dir_all(&dir).map_err(io(&dir))?;
            if self.fake {
                self.fake_interface_files(&dir)?;
                self.fake_interface_files(parent)?;
            }
            for path in [
                parent.clone(),
                parent.join("cgroup.procs"),
                parent.join("tasks"),
                parent.join("cgroup.subtree_control"),
                parent.join("cgroup.threads"),
            ] {
                match std::os::unix::fs::chown(&path, Some(uid), Some(gid)) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(io(&path)(e)),
                    _ => {}
                }
            }
        }
        Ok(parents)
    }

    /// Lets the forkvm parent's children use every controller the root offers (enabled
    /// at each level from the root down to `parent`).
    fn enable_v2_controllers(&self, parent: &Path) {
        let offered =
            std::fs::read_to_string(self.root.join("cgroup.controllers")).unwrap_or_default();
        let mut levels = vec![self.root.clone()];
        let mut dir = self.root.clone();
        for part in Path::new(&self.parent).components() {
            if levels.last().map(PathBuf::as_path) == Some(parent) {
                break;
            }
            dir = dir.join(part);
            levels.push(dir.clone());
        }
        for c in offered
            .split_whitespace()
            .filter(|c| ["cpu", "memory", "pids"].contains(c))
        {
            for dir in &levels {
                let _ = std::fs::write(dir.join("cgroup.subtree_control"), format!("+{c}"));
            }
        }
    }

    /// The interface files the kernel would create in `dir`, with its defaults.
    fn fake_interface_files(&self, dir: &Path) -> Result<(), CgroupError> {
        let controller = dir
            .strip_prefix(&self.root)
            .ok()
            .and_then(|rel| rel.components().next())
            .map(|c| c.as_os_str().to_string_lossy().into_owned())
            .unwrap_or_default();
        let files: &[(&str, &str)] = match (self.version, controller.as_str()) {
            (CgroupVersion::V2, _) => &[
                ("cgroup.procs", ""),
                ("cgroup.kill", ""),
                ("cpu.max", "max 100000\n"),
                (
                    "cpu.stat",
                    "usage_usec 0\nnr_throttled 0\nthrottled_usec 0\n",
                ),
                ("memory.max", "max\n"),
                ("memory.current", "0\n"),
                ("memory.peak", "0\n"),
                ("memory.events", "oom 0\noom_kill 0\n"),
                ("pids.max", "max\n"),
            ],
            (CgroupVersion::V1, "cpu") => &[
                ("cgroup.procs", ""),
                ("tasks", ""),
                ("cpu.cfs_period_us", "100000\n"),
                ("cpu.cfs_quota_us", "-1\n"),
                (
                    "cpu.stat",
                    "nr_periods 0\nnr_throttled 0\nthrottled_time 0\n",
                ),
            ],
            (CgroupVersion::V1, "cpuacct") => &[
                ("cgroup.procs", ""),
                ("tasks", ""),
                ("cpuacct.usage", "0\n"),
            ],
            (CgroupVersion::V1, "memory") => &[
                ("cgroup.procs", ""),
                ("tasks", ""),
                ("memory.limit_in_bytes", "9223372036854771712\n"),
                ("memory.usage_in_bytes", "0\n"),
                ("memory.max_usage_in_bytes", "0\n"),
                (
                    "memory.oom_control",
                    "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n",
                ),
            ],
            (CgroupVersion::V1, _) => &[("cgroup.procs", ""), ("tasks", ""), ("pids.max", "max\n")],
        };
        for (file, value) in files {
            let path = dir.join(file);
            std::fs::write(&path, value).map_err(io(&path))?;
        }
        Ok(())
    }

    /// Writes `class`'s limits (unlimited where it sets none). On v2 a controller the
    /// hierarchy does not offer is skipped while its limit is unlimited, and an error
    /// when the class sets one.
    pub fn set_limits(&self, name: &str, class: &ResourceClass) -> Result<(), CgroupError> {
        let quota = class
            .cpu_quota
            .map(|q| (q * CPU_PERIOD_US as f64).round() as u64);
        match self.version {
            CgroupVersion::V2 => {
                let cpu = quota.map(|q| format!("{q} {CPU_PERIOD_US}"));
                let mem = class.memory_limit.map(|m| m.to_string());
                let pids = class.pids_max.map(|p| p.to_string());
                for (file, value, unlimited) in [
                    ("cpu.max", cpu, "max 100000"),
                    ("memory.max", mem, "max"),
                    ("pids.max", pids, "max"),
                ] {
                    let path = self.dir("", name).join(file);
                    match value {
                        Some(v) if !path.exists() => {
                            return Err(CgroupError::NoController {
                                file: path.display().to_string(),
                                value: v,
                            })
                        }
                        Some(v) => self.write("", name, file, &v)?,
                        None if path.exists() => self.write("", name, file, unlimited)?,
                        None => {}
                    }
                }
            }
            CgroupVersion::V1 => {
                self.write("cpu", name, "cpu.cfs_period_us", &CPU_PERIOD_US.to_string())?;
                let q = quota.map_or("-1".to_string(), |q| q.to_string());
                self.write("cpu", name, "cpu.cfs_quota_us", &q)?;
                let mem = class.memory_limit.map_or("-1".into(), |m| m.to_string());
                self.write("memory", name, "memory.limit_in_bytes", &mem)?;
                let pids = class.pids_max.map_or("max".into(), |p| p.to_string());
                self.write("pids", name, "pids.max", &pids)?;
            }
        }
        Ok(())
    }

    /// The limits in force, read back.
    pub fn limits(&self, name: &str) -> Result<ResourceClass, CgroupError> {
        let opt = |s: String| {
            let s = s.trim().to_string();
            (s != "max" && s != "-1" && s != V1_UNLIMITED).then(|| s.parse::<u64>().ok())
        };
        Ok(match self.version {
            CgroupVersion::V2 => {
                // A controller the hierarchy does not offer limits nothing.
                let read = |file| self.read("", name, file).unwrap_or_else(|_| "max".into());
                let quota = read("cpu.max")
                    .split_whitespace()
                    .next()
                    .unwrap_or("max")
                    .to_string();
                ResourceClass {
                    cpu_quota: opt(quota)
                        .flatten()
                        .map(|q| q as f64 / CPU_PERIOD_US as f64),
                    memory_limit: opt(read("memory.max")).flatten(),
                    pids_max: opt(read("pids.max")).flatten(),
                }
            }
            CgroupVersion::V1 => {
                let period = self.read_u64("cpu", name, "cpu.cfs_period_us")?.max(1);
                ResourceClass {
                    cpu_quota: opt(self.read("cpu", name, "cpu.cfs_quota_us")?)
                        .flatten()
                        .map(|q| q as f64 / period as f64),
                    memory_limit: opt(self.read("memory", name, "memory.limit_in_bytes")?)
                        .flatten(),
                    pids_max: opt(self.read("pids", name, "pids.max")?).flatten(),
                }
            }
        })
    }

    /// Processes in cgroup `name` (every hierarchy).
    pub fn procs(&self, name: &str) -> Result<Vec<i32>, CgroupError> {
        let mut pids = Vec::new();
        for dir in self.dirs(name) {
            let path = dir.join("cgroup.procs");
            let text = std::fs::read_to_string(&path).map_err(io(&path))?;
            pids.extend(
                text.split_whitespace()
                    .filter_map(|p| p.parse::<i32>().ok()),
            );
        }
        pids.sort_unstable();
        pids.dedup();
        Ok(pids)
    }

    /// The files of cgroup `name`, one per hierarchy, a process's *only* thread writes
    /// "0" to in order to move itself in (how a clone places itself before running
    /// guest code). On v1 that is `tasks`: moving the calling thread alone does not take
    /// the cgroup core's thread-group lock for writing, whose first taking after a quiet
    /// spell waits for an RCU grace period (milliseconds); a process of one thread has
    /// moved whole. On v2, `cgroup.procs`.
    pub fn self_move_files(&self, name: &str) -> Vec<PathBuf> {
        let file = match self.version {
            CgroupVersion::V1 => "tasks",
            CgroupVersion::V2 => "cgroup.procs",
        };
        self.dirs(name).into_iter().map(|d| d.join(file)).collect()
    }

    /// [`CgroupFs::self_move_files`] opened for writing (close-on-exec), so a clone can
    /// move itself in without opening them on its way.
    pub fn open_self_move_files(&self, name: &str) -> Result<Vec<OwnedFd>, CgroupError> {
        self.self_move_files(name)
            .into_iter()
            .map(|path| open_to_write(&path))
            .collect()
    }

    /// The `tasks` files (v1) of the cgroups the calling thread is in now, one per
    /// hierarchy of this driver, opened for writing (close-on-exec): a thread that
    /// leaves for a pooled cgroup writes "0" to them to come back. Read from
    /// `/proc/thread-self/cgroup`, whose paths are relative to each hierarchy's mount
    /// (also in a cgroup namespace, as the jail mounts it). Empty on v2 (no v1
    /// controllers); a fake root has no such files.
    pub fn open_own_move_files(&self) -> Result<Vec<OwnedFd>, CgroupError> {
        let own = Path::new("/proc/thread-self/cgroup");
        let text = std::fs::read_to_string(own).map_err(io(own))?;
        self.controllers
            .iter()
            .map(|c| {
                let rel = text
                    .lines()
                    .filter_map(|l| l.split_once(':')?.1.split_once(':'))
                    .find(|(ctrls, _)| ctrls.split(',').any(|x| x == *c))
                    .map(|(_, path)| path.trim_start_matches('/'))
                    .ok_or_else(|| CgroupError::NoHierarchy(format!("{c} not in {own:?}")))?;
                open_to_write(&self.root.join(c).join(rel).join("tasks"))
            })
            .collect()
    }

    /// The `pids.max` file of cgroup `name`.
    pub fn pids_max_file(&self, name: &str) -> PathBuf {
        self.dir("pids", name).join("pids.max")
    }

    /// Moves process `pid` into cgroup `name` in every hierarchy.
    pub fn place(&self, name: &str, pid: i32) -> Result<(), CgroupError> {
        for dir in self.dirs(name) {
            let path = dir.join("cgroup.procs");
            if self.fake {
                // No kernel: record the member (a move appends in the fake).
                let mut text = std::fs::read_to_string(&path).map_err(io(&path))?;
                text.push_str(&format!("{pid}\n"));
                std::fs::write(&path, text).map_err(io(&path))?;
            } else {
                std::fs::write(&path, pid.to_string()).map_err(io(&path))?;
            }
        }
        Ok(())
    }

    /// Accounting so far (cumulative since creation or the last reset).
    pub fn usage(&self, name: &str) -> Result<Usage, CgroupError> {
        Ok(match self.version {
            CgroupVersion::V2 => {
                // Without the memory controller there is no memory figure: 0.
                let peak = self
                    .read_u64("", name, "memory.peak")
                    .or_else(|_| self.read_u64("", name, "memory.current"))
                    .unwrap_or(0);
                Usage {
                    cpu_us: self.read_key("", name, "cpu.stat", "usage_usec"),
                    memory_peak: peak,
                    oom_kills: self.read_key("", name, "memory.events", "oom_kill"),
                    cpu_throttled_us: self.read_key("", name, "cpu.stat", "throttled_usec"),
                }
            }
            CgroupVersion::V1 => Usage {
                cpu_us: self.read_u64("cpuacct", name, "cpuacct.usage")? / 1000,
                memory_peak: self.read_u64("memory", name, "memory.max_usage_in_bytes")?,
                oom_kills: self.read_key("memory", name, "memory.oom_control", "oom_kill "),
                cpu_throttled_us: self.read_key("cpu", name, "cpu.stat", "throttled_time ") / 1000,
            },
        })
    }

    /// Memory charged to cgroup `name` now (v1 `memory.usage_in_bytes`, v2
    /// `memory.current`).
    pub fn memory_now(&self, name: &str) -> Result<u64, CgroupError> {
        match self.version {
            CgroupVersion::V2 => self.read_u64("", name, "memory.current"),
            CgroupVersion::V1 => self.read_u64("memory", name, "memory.usage_in_bytes"),
        }
    }

    /// Sets cgroup `name`'s memory limit to `bytes` (v1 `memory.limit_in_bytes`, v2
    /// `memory.max`); [`CgroupFs::set_limits`] writes the class's again.
    pub fn set_memory_limit(&self, name: &str, bytes: u64) -> Result<(), CgroupError> {
        match self.version {
            CgroupVersion::V2 => self.write("", name, "memory.max", &bytes.to_string()),
            CgroupVersion::V1 => {
                self.write("memory", name, "memory.limit_in_bytes", &bytes.to_string())
            }
        }
    }

    /// Resets what can be reset: v1 CPU time and peak memory; v2 peak memory where the
    /// kernel allows it (6.12+). Counters that cannot be reset are reported as deltas
    /// by the pool.
    pub fn reset_accounting(&self, name: &str) -> Result<(), CgroupError> {
        match self.version {
            CgroupVersion::V2 => {
                let _ = self.write("", name, "memory.peak", "0");
            }
            CgroupVersion::V1 => {
                self.write("cpuacct", name, "cpuacct.usage", "0")?;
                self.write("memory", name, "memory.max_usage_in_bytes", "0")?;
            }
        }
        Ok(())
    }

    /// Kills every process in cgroup `name` (v2: `cgroup.kill`; v1: SIGKILL each).
    pub fn kill_all(&self, name: &str) -> Result<(), CgroupError> {
        if self.fake {
            for dir in self.dirs(name) {
                let path = dir.join("cgroup.procs");
                std::fs::write(&path, "").map_err(io(&path))?;
            }
            return Ok(());
        }
        if self.version == CgroupVersion::V2 && self.write("", name, "cgroup.kill", "1").is_ok() {
            return Ok(());
        }
        // A thread of this process in the cgroup (a VMM's forker, see the VMM) makes
        // its pid show here: never kill ourselves; the caller finds the cgroup busy.
        let own = std::process::id() as i32;
        for pid in self.procs(name)?.into_iter().filter(|&p| p != own) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        Ok(())
    }

    /// Removes cgroup `name` (it must be empty).
    pub fn remove(&self, name: &str) -> Result<(), CgroupError> {
        self.held.let_go(name);
        self.remove_dirs(self.dirs(name))
    }

    /// The parent directory every cgroup of this driver goes under, relative to each
    /// hierarchy's root.
    pub fn parent(&self) -> &str {
        &self.parent
    }

    /// Removes the parent directories (they must be empty), then each ancestor within
    /// the parent path that is left empty (`forkvm` once its last VMM's `vmm-<pid>` is
    /// gone).
    pub fn remove_parent(&self) -> Result<(), CgroupError> {
        self.remove_dirs(self.parent_dirs())?;
        let mut up = Path::new(&self.parent).parent();
        while let Some(rel) = up.filter(|r| !r.as_os_str().is_empty()) {
            for dir in self.parent_dirs() {
                let Some(root) = dir
                    .ancestors()
                    .nth(Path::new(&self.parent).components().count())
                else {
                    continue;
                };
                // Another VMM's cgroups keep it busy (ENOTEMPTY/EBUSY): leave it.
                let _ = std::fs::remove_dir(root.join(rel));
            }
            up = rel.parent();
        }
        Ok(())
    }

    /// Removes cgroup directories (a fake root's with the files in them); ones already
    /// gone are fine.
    fn remove_dirs(&self, dirs: Vec<PathBuf>) -> Result<(), CgroupError> {
        for dir in dirs {
            let r = if self.fake {
                std::fs::remove_dir_all(&dir)
            } else {
                std::fs::remove_dir(&dir)
            };
            match r {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(io(&dir)(e)),
            }
        }
        Ok(())
    }
}
