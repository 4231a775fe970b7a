//! Templates started in forkvm's jailer (docs/jailer.md): the VMM unprivileged in a
//! chroot, its own pid, mount and cgroup namespaces, seccomp filters on every thread.
//!
//! Inside the jail the VMM names its files by jail paths (`/api.sock`, a clone's
//! `/api.sock.clone-3`) and its processes by the jail's pids; [`Jail`] maps both to the
//! host's. Each jail has an id of its own, `lib-<library pid>-<n>`, and a cgroup parent
//! of its own, `forkvm-<id>`, so that one jail's cleanup never touches another's, and
//! a later library process can tell the jails of a library process that is gone
//! ([`sweep`]).

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::OnceLock;

use crate::Error;

/// How to jail a template's VMM ([`crate::TemplateSpec::jail`]). The library must run
/// as root to start the jailer.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct JailSpec {
    /// The `jailer` program (default: `$FORKVM_JAILER`, else `jailer` beside the
    /// current executable if there is one, else `jailer` from `PATH`).
    pub jailer: PathBuf,
    /// The user the VMM runs as (not 0).
    pub uid: u32,
    /// The group the VMM runs as (not 0).
    pub gid: u32,
    /// Where jails are made (`jailer --chroot-base`; default `/srv/jailer`): a
    /// template's is `<chroot_base>/<vmm file name>/<id>/root`.
    pub chroot_base: PathBuf,
    /// A network namespace to run the VMM in (`jailer --netns`, a path such as
    /// `/var/run/netns/NAME`).
    pub netns: Option<PathBuf>,
    /// The cgroup version (`jailer --cgroup-version`; default: the jailer's choice).
    pub cgroup_version: Option<u8>,
    /// Further `jailer` options, such as `--file HOST:JAIL` for a file the VMM's
    /// [`crate::TemplateSpec::args`] name (by its jail path), or `--rlimit-nofile N`.
    pub args: Vec<String>,
}

impl JailSpec {
    /// A jail for user `uid` and group `gid`, with the defaults.
    pub fn new(uid: u32, gid: u32) -> Self {
        Self {
            jailer: crate::program::beside_exe("jailer", "FORKVM_JAILER"),
            uid,
            gid,
            chroot_base: "/srv/jailer".into(),
            netns: None,
            cgroup_version: None,
            args: Vec::new(),
        }
    }
}

/// A running template's jail.
#[derive(Debug)]
pub(crate) struct Jail {
    spec: JailSpec,
    /// `<chroot_base>/<vmm file name>/<id>`: the jailer removes it when its VMM exits.
    dir: PathBuf,
    cgroup_parent: String,
    /// The jailer's host pid (its one child is the VMM, process 1 of the jail).
    jailer_pid: OnceLock<u32>,
    /// The jail's pid namespace (`/proc/<pid>/ns/pid`'s link), once looked up.
    pid_ns: OnceLock<PathBuf>,
}

/// A jail id's prefix, followed by the library process's pid, `-` and a number.
const ID_PREFIX: &str = "lib-";
/// The VMM's control socket and console, in its jail.
pub(crate) const SOCKET: &str = "/api.sock";
/// See [`SOCKET`].
pub(crate) const CONSOLE: &str = "/console";

/// Jails made by this process so far (each id unique).
static JAILS: AtomicU32 = AtomicU32::new(0);

impl Jail {
    /// A new jail's paths for the VMM `vmm` under `spec`.
    pub fn new(spec: &JailSpec, vmm: &Path) -> Self {
        let n = JAILS.fetch_add(1, Ordering::Relaxed);
        let id = format!("{ID_PREFIX}{}-{n}", std::process::id());
        let exec = vmm.file_name().unwrap_or("vmm".as_ref());
        Self {
            spec: spec.clone(),
            dir: spec.chroot_base.join(exec).join(&id),
            cgroup_parent: format!("forkvm-{id}"),
            jailer_pid: OnceLock::new(),
            pid_ns: OnceLock::new(),
        }
    }

    /// The jail's id.
    fn id(&self) -> &str {
        self.dir.file_name().and_then(|n| n.to_str()).unwrap_or("")
    }

    /// The jailer program.
    pub fn jailer(&self) -> &Path {
        &self.spec.jailer
    }

    /// The jailer's command line up to `--`: the jail of the VMM `vmm`, `files` handed
    /// in as `(host path, jail path)`, the spec's options.
    pub fn command(&self, vmm: &Path, files: &[(&Path, &str)]) -> std::process::Command {
        let spec = &self.spec;
        let mut cmd = std::process::Command::new(&spec.jailer);
        cmd.arg("--id").arg(self.id()).arg("--exec-file").arg(vmm);
        cmd.arg("--uid").arg(spec.uid.to_string());
        cmd.arg("--gid").arg(spec.gid.to_string());
        cmd.arg("--chroot-base").arg(&spec.chroot_base);
        cmd.arg("--cgroup-parent").arg(&self.cgroup_parent);
        if let Some(n) = &spec.netns {
            cmd.arg("--netns").arg(n);
        }
        if let Some(v) = spec.cgroup_version {
            cmd.arg("--cgroup-version").arg(v.to_string());
        }
        for (host, jail) in files {
            let mut arg = host.as_os_str().to_owned();
            arg.push(":");
            arg.push(jail);
            cmd.arg("--file").arg(arg);
        }
        cmd.args(&spec.args).arg("--");
        cmd
    }

    /// Records the jailer's pid once it runs.
    pub fn started(&self, jailer_pid: u32) {
        let _ = self.jailer_pid.set(jailer_pid);
    }

    /// The jail's root as the host sees it.
    pub fn root(&self) -> PathBuf {
        self.dir.join("root")
    }

    /// The host's path of the jail path `p`.
    pub fn host_path(&self, p: &Path) -> PathBuf {
        self.root().join(p.strip_prefix("/").unwrap_or(p))
    }

    /// The host pid of the jail's process `pid`: the process in the jail's pid namespace
    /// whose innermost pid (`NSpid`, last field) it is.
    pub fn host_pid(&self, pid: u32) -> Result<u32, Error> {
        let not_found = || {
            Error::Process(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("no process {pid} in jail {}", self.id()),
            ))
        };
        let ns = self.pid_ns()?;
        let procs = std::fs::read_dir("/proc").map_err(Error::Process)?;
        for entry in procs.flatten() {
            let Some(host) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            let status = std::fs::read_to_string(entry.path().join("status")).unwrap_or_default();
            let inner = (status.lines())
                .find_map(|l| l.strip_prefix("NSpid:"))
                .and_then(|l| l.split_whitespace().last())
                .and_then(|p| p.parse::<u32>().ok());
            if inner == Some(pid)
                && std::fs::read_link(entry.path().join("ns/pid")).ok() == Some(ns.clone())
            {
                return Ok(host);
            }
        }
        Err(not_found())
    }

    /// The jail's pid namespace: that of the jailer's child.
    fn pid_ns(&self) -> Result<PathBuf, Error> {
        if let Some(ns) = self.pid_ns.get() {
            return Ok(ns.clone());
        }
        let missing = |what: &str| {
            Error::Process(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("jail {}: {what}", self.id()),
            ))
        };
        let jailer = *self
            .jailer_pid
            .get()
            .ok_or_else(|| missing("no jailer yet"))?;
        let children = std::fs::read_to_string(format!("/proc/{jailer}/task/{jailer}/children"))
            .map_err(Error::Process)?;
        let vmm = children
            .split_whitespace()
            .next()
            .ok_or_else(|| missing("the jailer has no VMM"))?;
        let ns = std::fs::read_link(format!("/proc/{vmm}/ns/pid")).map_err(Error::Process)?;
        Ok(self.pid_ns.get_or_init(|| ns).clone())
    }

    /// After the jailer ended: what it leaves when it was killed (its jail directory,
    /// its cgroups), removed. Nothing to do after a jailer that exited on its own.
    pub fn clean_up(&self) {
        clean_up(&self.spec.jailer, &self.dir);
    }
}

/// Removes jail directory `dir` (`<base>/<exec>/<id>`) and its cgroup parent
/// `forkvm-<id>` (`jailer cleanup`).
fn clean_up(jailer: &Path, dir: &Path) {
    if !dir.exists() {
        return;
    }
    let Some(id) = dir.file_name().and_then(|n| n.to_str()) else {
        return;
    };
    let _ = std::process::Command::new(jailer)
        .args(["cleanup", "--cgroup-parent", &format!("forkvm-{id}")])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status();
    let _ = std::fs::remove_dir_all(dir);
}

/// Removes the jails this library made in processes that are gone (killed before they
/// could stop their templates: the jailer then dies with them and its VMM too, but its
/// jail directory and cgroups stay): every `lib-<pid>-<n>` under
/// `<chroot_base>/<vmm file name>` whose pid no longer runs.
pub(crate) fn sweep(spec: &JailSpec, vmm: &Path) {
    let exec = vmm.file_name().unwrap_or("vmm".as_ref());
    let Ok(entries) = std::fs::read_dir(spec.chroot_base.join(exec)) else {
        return;
    };
    for entry in entries.flatten() {
        if crate::leftovers::left_by_dead_process(&entry.file_name(), ID_PREFIX) {
            clean_up(&spec.jailer, &entry.path());
        }
    }
}
