//! Building the jail's file system and entering it (runs in the forked child).

use std::ffi::CString;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Component, Path, PathBuf};

use nix::mount::{MntFlags, MsFlags};
use nix::sched::CloneFlags;
use nix::sys::prctl;
use nix::sys::resource::{setrlimit, Resource};
use nix::sys::signal::Signal;
use nix::sys::stat::{Mode, SFlag};
use nix::unistd::{Gid, Uid};

use super::{io_err, JailConfig, JailError, VMM_LEAF};
use crate::cgroup::CgroupVersion;

/// Device nodes made in the jail's `/dev`: (path, mode, owned by the VMM's user).
const DEVICES: [(&str, u32, bool); 4] = [
    ("/dev/kvm", 0o600, true),
    ("/dev/net/tun", 0o600, true),
    ("/dev/null", 0o666, false),
    ("/dev/urandom", 0o444, false),
];

/// cgroup v1 hierarchies the VMM's pools use.
const V1_CONTROLLERS: [&str; 4] = ["cpu", "cpuacct", "memory", "pids"];

/// An absolute path with only normal components (no `..`, no `.`).
pub(super) fn is_plain_absolute(p: &Path) -> bool {
    p.is_absolute()
        && p.components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
}

pub(super) fn chown(path: &Path, uid: u32, gid: u32) -> Result<(), JailError> {
    std::os::unix::fs::chown(path, Some(uid), Some(gid)).map_err(io_err("chown", path))
}

/// The shared libraries (and the ELF interpreter) `exe` loads, as the dynamic loader
/// resolves them (`ldd`); empty for a static executable.
pub(super) fn shared_libraries(exe: &Path) -> Result<Vec<PathBuf>, JailError> {
    let fail = |why: String| JailError::Libraries {
        path: exe.display().to_string(),
        why,
    };
    let out = std::process::Command::new("ldd")
        .arg(exe)
        .output()
        .map_err(|e| fail(format!("running ldd: {e}")))?;
    let text = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if text.contains("statically linked") || stderr.contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    if !out.status.success() {
        return Err(fail(format!("ldd: {}", stderr.trim())));
    }
    let mut libs = Vec::new();
    for line in text.lines() {
        if line.contains("not found") {
            return Err(fail(format!("missing library: {}", line.trim())));
        }
        let path = match line.split_once("=>") {
            Some((_, right)) => right.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(p) = path.filter(|p| p.starts_with('/')) {
            libs.push(PathBuf::from(p));
        }
    }
    Ok(libs)
}

/// One cgroup v1 hierarchy to mount in the jail: its directory name under
/// `/sys/fs/cgroup` and its controllers (mount options).
#[derive(Debug, Clone)]
struct V1Mount {
    dir: String,
    controllers: String,
}

/// A host file bind-mounted read-only in the jail.
#[derive(Debug, Clone)]
struct Bind {
    host: PathBuf,
    jail: PathBuf,
    exec: bool,
}

/// Everything the child needs, worked out before the fork.
#[derive(Debug)]
pub(super) struct Plan {
    root: PathBuf,
    uid: u32,
    gid: u32,
    netns: Option<PathBuf>,
    binds: Vec<Bind>,
    version: CgroupVersion,
    /// `jail-<id>` in each hierarchy (host paths).
    jail_cgroups: Vec<PathBuf>,
    v1_mounts: Vec<V1Mount>,
    /// v1 controller names that are symbolic links on the host (`cpu -> cpu,cpuacct`).
    v1_links: Vec<(String, PathBuf)>,
    rlimit_nofile: u64,
    rlimit_fsize: Option<u64>,
    exec: CString,
    argv: Vec<CString>,
}

impl Plan {
    pub(super) fn new(
        cfg: &JailConfig,
        exec_name: &str,
        root: &Path,
        libs: &[PathBuf],
        version: CgroupVersion,
        jail_cgroups: Vec<PathBuf>,
    ) -> Result<Self, JailError> {
        let mut binds = vec![Bind {
            host: cfg.exec_file.clone(),
            jail: Path::new("/").join(exec_name),
            exec: true,
        }];
        binds.extend(libs.iter().map(|l| Bind {
            host: l.clone(),
            jail: l.clone(),
            exec: true,
        }));
        binds.extend(cfg.files.iter().map(|(host, jail)| Bind {
            host: host.clone(),
            jail: jail.clone(),
            exec: false,
        }));
        let (v1_mounts, v1_links) = if version == CgroupVersion::V1 {
            v1_hierarchies()
        } else {
            Default::default()
        };
        let to_c = |s: &str| CString::new(s).map_err(|_| JailError::Setup(format!("{s:?}: NUL")));
        let exec = to_c(&format!("/{exec_name}"))?;
        let mut argv = vec![to_c(exec_name)?];
        for a in &cfg.args {
            argv.push(to_c(a)?);
        }
        Ok(Self {
            root: root.to_path_buf(),
            uid: cfg.uid,
            gid: cfg.gid,
            netns: cfg.netns.clone(),
            binds,
            version,
            jail_cgroups,
            v1_mounts,
            v1_links,
            rlimit_nofile: cfg.rlimit_nofile,
            rlimit_fsize: cfg.rlimit_fsize,
            exec,
            argv,
        })
    }

    /// In the forked child: enters the jail and executes the VMM. Returns only on failure,
    /// with what went wrong.
    pub(super) fn enter_and_exec(&self) -> String {
        match self.enter() {
            Ok(()) => {}
            Err(e) => return e,
        }
        let envp: [&std::ffi::CStr; 0] = [];
        let Err(e) = nix::unistd::execve(&self.exec, &self.argv, &envp);
        format!("executing {:?} in the jail: {e}", self.exec)
    }

    fn enter(&self) -> Result<(), String> {
        if let Some(ns) = &self.netns {
            let f = std::fs::File::open(ns).map_err(|e| format!("netns {}: {e}", ns.display()))?;
            nix::sched::setns(&f, CloneFlags::CLONE_NEWNET)
                .map_err(|e| format!("setns({}): {e}", ns.display()))?;
        }
        // The cgroup namespace's root is `jail-<id>`: join it, unshare, then move down
        // into the VMM's own leaf (on v2 a cgroup with processes cannot enable
        // controllers for its children, so the VMM must not stay in the root).
        self.join_cgroups(None)?;
        // New mount and cgroup namespaces for this process.
        nix::sched::unshare(CloneFlags::CLONE_NEWNS | CloneFlags::CLONE_NEWCGROUP)
            .map_err(|e| format!("unshare(mount, cgroup): {e}"))?;
        self.join_cgroups(Some(VMM_LEAF))?;
        // Nothing mounted below propagates back to the host.
        mount(
            None,
            Path::new("/"),
            None,
            libc::MS_REC | libc::MS_PRIVATE,
            None,
        )?;
        self.build_root()?;
        pivot_into(&self.root)?;
        self.limit_and_drop()
    }

    fn join_cgroups(&self, leaf: Option<&str>) -> Result<(), String> {
        for dir in &self.jail_cgroups {
            let dir = leaf.map_or_else(|| dir.clone(), |l| dir.join(l));
            let procs = dir.join("cgroup.procs");
            std::fs::write(&procs, "0").map_err(|e| format!("joining {}: {e}", dir.display()))?;
        }
        Ok(())
    }

    fn build_root(&self) -> Result<(), String> {
        let root = &self.root;
        // pivot_root needs the new root to be a mount point.
        mount(Some(root), root, None, libc::MS_BIND, None)?;
        mount(
            None,
            root,
            None,
            libc::MS_BIND | libc::MS_REMOUNT | libc::MS_NOSUID | libc::MS_NODEV,
            None,
        )?;
        let small_tmpfs = |dir: &Path, flags| {
            mkdir_p(dir, 0o755)?;
            mount(
                Some(Path::new("tmpfs")),
                dir,
                Some("tmpfs"),
                flags,
                Some("mode=755,size=64k"),
            )
        };
        let dev = root.join("dev");
        small_tmpfs(&dev, libc::MS_NOSUID | libc::MS_NOEXEC)?;
        for (path, mode, owned) in DEVICES {
            let Ok(meta) = std::fs::metadata(path) else {
                if path == "/dev/kvm" {
                    return Err("/dev/kvm: no such device on this host".into());
                }
                continue;
            };
            if !meta.file_type().is_char_device() {
                continue;
            }
            let node = root.join(&path[1..]);
            mkdir_p(node.parent().unwrap_or(&dev), 0o755)?;
            let perm = Mode::from_bits_truncate(mode);
            nix::sys::stat::mknod(&node, SFlag::S_IFCHR, perm, meta.rdev())
                .map_err(|e| format!("mknod {}: {e}", node.display()))?;
            // The exact mode (mknod applied the umask).
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&node, std::fs::Permissions::from_mode(mode))
                .map_err(|e| format!("chmod {}: {e}", node.display()))?;
            if owned {
                chown(&node, self.uid, self.gid).map_err(|e| e.to_string())?;
            }
        }
        let proc_dir = root.join("proc");
        mkdir_p(&proc_dir, 0o555)?;
        mount(
            Some(Path::new("proc")),
            &proc_dir,
            Some("proc"),
            libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC,
            None,
        )?;
        let sys_dir = root.join("sys");
        let sys_flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        small_tmpfs(&sys_dir, sys_flags)?;
        // The VMM reads kvm_pvm's parameters to apply this host's guest fixes.
        let pvm = Path::new("/sys/module/kvm_pvm");
        if pvm.is_dir() {
            let target = sys_dir.join("module/kvm_pvm");
            mkdir_p(&target, 0o755)?;
            bind_read_only(pvm, &target, false)?;
        }
        self.mount_cgroups(&sys_dir.join("fs/cgroup"))?;
        mount(
            None,
            &sys_dir,
            None,
            libc::MS_REMOUNT | libc::MS_RDONLY | sys_flags,
            Some("mode=755,size=64k"),
        )?;
        for b in &self.binds {
            let target = root.join(b.jail.strip_prefix("/").unwrap_or(&b.jail));
            mkdir_p(target.parent().unwrap_or(root), 0o755)?;
            if b.host.is_dir() {
                mkdir_p(&target, 0o755)?;
            } else if !target.exists() {
                std::fs::File::create(&target)
                    .map_err(|e| format!("creating {}: {e}", target.display()))?;
            }
            bind_read_only(&b.host, &target, b.exec)?;
        }
        Ok(())
    }

    /// Mounts the jail's cgroup hierarchies at `dir`: seen from the new cgroup namespace,
    /// their root is the delegated `jail-<id>`.
    fn mount_cgroups(&self, dir: &Path) -> Result<(), String> {
        mkdir_p(dir, 0o755)?;
        let flags = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
        match self.version {
            CgroupVersion::V2 => mount(
                Some(Path::new("cgroup2")),
                dir,
                Some("cgroup2"),
                flags,
                None,
            )?,
            CgroupVersion::V1 => {
                for m in &self.v1_mounts {
                    let target = dir.join(&m.dir);
                    mkdir_p(&target, 0o755)?;
                    mount(
                        Some(Path::new("cgroup")),
                        &target,
                        Some("cgroup"),
                        flags,
                        Some(&m.controllers),
                    )?;
                }
                for (name, to) in &self.v1_links {
                    std::os::unix::fs::symlink(to, dir.join(name))
                        .map_err(|e| format!("linking {name}: {e}"))?;
                }
            }
        }
        Ok(())
    }

    fn limit_and_drop(&self) -> Result<(), String> {
        fn err(what: &'static str) -> impl Fn(nix::Error) -> String {
            move |e| format!("{what}: {e}")
        }
        let nofile = self.rlimit_nofile;
        setrlimit(Resource::RLIMIT_NOFILE, nofile, nofile).map_err(err("setrlimit(NOFILE)"))?;
        if let Some(fsize) = self.rlimit_fsize {
            setrlimit(Resource::RLIMIT_FSIZE, fsize, fsize).map_err(err("setrlimit(FSIZE)"))?;
        }
        let (uid, gid) = (Uid::from_raw(self.uid), Gid::from_raw(self.gid));
        nix::unistd::setgroups(&[]).map_err(err("setgroups"))?;
        nix::unistd::setresgid(gid, gid, gid).map_err(err("setresgid"))?;
        nix::unistd::setresuid(uid, uid, uid).map_err(err("setresuid"))?;
        prctl::set_no_new_privs().map_err(err("prctl(NO_NEW_PRIVS)"))?;
        // The VMM (and with it every clone in its pid namespace) dies with the jailer.
        // Set after the uid change, which clears it. (getppid() is 0 across the pid
        // namespace, so a jailer that died before this line goes unnoticed; its cgroups
        // are then left for `jailer cleanup`.)
        prctl::set_pdeathsig(Signal::SIGKILL).map_err(err("prctl(PDEATHSIG)"))?;
        // Every inherited descriptor beyond stdio closes at exec (nix has no close_range).
        // SAFETY: only sets close-on-exec on this process's descriptors from 3 up.
        unsafe { libc::close_range(3, u32::MAX, libc::CLOSE_RANGE_CLOEXEC as libc::c_int) };
        Ok(())
    }
}

/// The host's cgroup v1 hierarchies holding forkvm's controllers, and the controller
/// names that are links to a co-mounted hierarchy.
fn v1_hierarchies() -> (Vec<V1Mount>, Vec<(String, PathBuf)>) {
    let known: Vec<String> = std::fs::read_to_string("/proc/cgroups")
        .unwrap_or_default()
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| l.split_whitespace().next().map(String::from))
        .collect();
    let mut mounts: Vec<V1Mount> = Vec::new();
    let text = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    for line in text.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 || f[2] != "cgroup" {
            continue;
        }
        let Some(dir) = f[1].strip_prefix("/sys/fs/cgroup/") else {
            continue;
        };
        let controllers: Vec<&str> = f[3]
            .split(',')
            .filter(|o| known.iter().any(|k| k == o))
            .collect();
        if controllers.iter().any(|c| V1_CONTROLLERS.contains(c))
            && !mounts.iter().any(|m| m.dir == dir)
        {
            mounts.push(V1Mount {
                dir: dir.to_string(),
                controllers: controllers.join(","),
            });
        }
    }
    let links = V1_CONTROLLERS
        .iter()
        .filter_map(|c| {
            let to = std::fs::read_link(Path::new("/sys/fs/cgroup").join(c)).ok()?;
            Some((c.to_string(), to))
        })
        .collect();
    (mounts, links)
}

fn mkdir_p(dir: &Path, mode: u32) -> Result<(), String> {
    use std::os::unix::fs::DirBuilderExt;
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(mode)
        .create(dir)
        .map_err(|e| format!("creating {}: {e}", dir.display()))
}

fn mount(
    source: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
) -> Result<(), String> {
    let flags = MsFlags::from_bits_truncate(flags);
    nix::mount::mount(source, target, fstype, flags, data).map_err(|e| {
        format!(
            "mount {} on {} ({}): {e}",
            source.map_or("none".into(), |s| s.display().to_string()),
            target.display(),
            fstype.unwrap_or("bind/remount")
        )
    })
}

/// Binds `host` at `target` read-only, without setuid or devices, executable only when
/// `exec`.
fn bind_read_only(host: &Path, target: &Path, exec: bool) -> Result<(), String> {
    mount(Some(host), target, None, libc::MS_BIND | libc::MS_REC, None)?;
    let mut flags =
        libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV;
    if !exec {
        flags |= libc::MS_NOEXEC;
    }
    mount(None, target, None, flags, None)
}

/// Makes `root` the process's `/` and drops the old root from its view.
fn pivot_into(root: &Path) -> Result<(), String> {
    std::env::set_current_dir(root).map_err(|e| format!("chdir {}: {e}", root.display()))?;
    // "." for both: the old root is stacked on the new one and detached below.
    nix::unistd::pivot_root(".", ".").map_err(|e| format!("pivot_root: {e}"))?;
    nix::mount::umount2(".", MntFlags::MNT_DETACH)
        .map_err(|e| format!("detaching the old root: {e}"))?;
    std::env::set_current_dir("/").map_err(|e| format!("chdir /: {e}"))
}
