//! The sandbox a VMM runs in (`jailer --id ID --exec-file vmm --uid U --gid G -- ARGS`).
//!
//! The jailer (root) prepares a jail directory `<chroot-base>/<exec-name>/<id>/root` and a
//! delegated cgroup `<cgroup-parent>/jail-<id>`, then forks the VMM as process 1 of a new
//! pid namespace. The child enters the cgroup and new mount and cgroup namespaces (and a
//! given network namespace), builds the jail's file system (only the executable and its
//! libraries, the files named with `--file`, `/dev/kvm`, `/dev/net/tun`, `/dev/null`,
//! `/dev/urandom`, its own `/proc`, and the delegated cgroup mounted as the cgroup root),
//! pivots into it, sets resource limits, drops to the given user and group with no
//! capabilities and `no_new_privs`, and executes the VMM. The jailer stays as its
//! supervisor: it forwards SIGINT, SIGTERM and SIGHUP, and when the VMM exits it removes
//! the cgroups and the jail directory and exits with the VMM's status. The VMM installs
//! its own seccomp filters (`crate::seccomp`). See docs/jailer.md for the threat model.

mod rootfs;

use std::io::Read;
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};

use nix::errno::Errno;
use nix::fcntl::OFlag;
use nix::sched::{unshare, CloneFlags};
use nix::sys::signal::{signal, SigHandler, Signal};
use nix::sys::wait::{waitpid, WaitStatus};
use nix::unistd::{pipe2, Pid};

use crate::cgroup::{pool::cleanup, CgroupError, CgroupFs, CgroupVersion};

/// The cgroup a jailed VMM process itself sits in, below its delegated `jail-<id>`.
const VMM_LEAF: &str = "vmm";

/// What to jail and how.
#[derive(Debug, Clone)]
pub struct JailConfig {
    /// Jail name: letters, digits and '-', at most 64.
    pub id: String,
    /// The VMM executable (host path); it runs as `/<file name>` in the jail.
    pub exec_file: PathBuf,
    /// User the VMM runs as (not 0).
    pub uid: u32,
    /// Group the VMM runs as (not 0).
    pub gid: u32,
    /// Where jails go: `<chroot_base>/<exec name>/<id>/root`.
    pub chroot_base: PathBuf,
    /// A network namespace to enter (a bind-mounted nsfs file, e.g. `/var/run/netns/X`).
    pub netns: Option<PathBuf>,
    /// cgroup hierarchy for the jail (None: v2 on a v2-only host, else v1).
    pub cgroup_version: Option<CgroupVersion>,
    /// Directory in each hierarchy the jail's cgroup goes under.
    pub cgroup_parent: String,
    /// Host files (or directories) made visible read-only in the jail: (host, jail path).
    pub files: Vec<(PathBuf, PathBuf)>,
    /// RLIMIT_NOFILE.
    pub rlimit_nofile: u64,
    /// RLIMIT_FSIZE in bytes (None: unlimited).
    pub rlimit_fsize: Option<u64>,
    /// Keep the jail directory (consoles, sockets) after the VMM exits.
    pub keep_root: bool,
    /// Arguments for the VMM.
    pub args: Vec<String>,
}

/// Errors from preparing, running or cleaning up a jail.
#[derive(Debug, thiserror::Error)]
pub enum JailError {
    /// The id has characters other than letters, digits and '-', or is too long.
    #[error("jail id {0:?}: use 1 to 64 letters, digits or '-'")]
    BadId(String),
    /// uid or gid 0: a VMM running as root could undo the jail.
    #[error("--uid and --gid must not be 0: the VMM must not run as root in its jail")]
    RootUser,
    /// The executable is missing or not a regular file.
    #[error("exec file {path}: {why}")]
    ExecFile {
        /// The path given.
        path: String,
        /// What is wrong.
        why: String,
    },
    /// A `--file` is missing or its jail path is not absolute and normal.
    #[error("--file {0}")]
    BadFile(String),
    /// The jail directory exists: another jail with this id runs, or one was killed
    /// before it could clean up.
    #[error("jail directory {0} exists: another jail uses this id (or a killed jailer left it; remove it)")]
    InUse(String),
    /// A file operation while preparing or removing the jail failed.
    #[error("{what} {path}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The file.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// The executable's shared libraries could not be listed.
    #[error("cannot list the shared libraries of {path}: {why}")]
    Libraries {
        /// The executable.
        path: String,
        /// Why.
        why: String,
    },
    /// The jail's cgroup could not be created, delegated or removed.
    #[error("jail cgroup: {0}")]
    Cgroup(#[from] CgroupError),
    /// A system call in the jailer failed.
    #[error("{0}: {1}")]
    Sys(&'static str, std::io::Error),
    /// The child failed to enter the jail or to execute the VMM.
    #[error("setting up the jail: {0}")]
    Setup(String),
}

fn io_err<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> JailError + 'a {
    move |source| JailError::Io {
        what,
        path: path.display().to_string(),
        source,
    }
}

/// Validates `cfg`, returning the executable's name in the jail.
fn validate(cfg: &JailConfig) -> Result<String, JailError> {
    let id_ok = !cfg.id.is_empty()
        && cfg.id.len() <= 64
        && cfg
            .id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-');
    if !id_ok {
        return Err(JailError::BadId(cfg.id.clone()));
    }
    if cfg.uid == 0 || cfg.gid == 0 {
        return Err(JailError::RootUser);
    }
    let bad_exec = |why: &str| JailError::ExecFile {
        path: cfg.exec_file.display().to_string(),
        why: why.into(),
    };
    let meta = std::fs::metadata(&cfg.exec_file).map_err(|e| bad_exec(&e.to_string()))?;
    if !meta.is_file() {
        return Err(bad_exec("not a regular file"));
    }
    let name = cfg
        .exec_file
        .file_name()
        .and_then(|n| n.to_str())
        .filter(|n| !n.is_empty())
        .ok_or_else(|| bad_exec("no file name"))?
        .to_string();
    for (host, jail) in &cfg.files {
        if !host.exists() {
            return Err(JailError::BadFile(format!(
                "{}: no such file",
                host.display()
            )));
        }
        if !rootfs::is_plain_absolute(jail) || jail == Path::new("/") {
            return Err(JailError::BadFile(format!(
                "{}: the jail path must be absolute, without '..', and not /",
                jail.display()
            )));
        }
    }
    Ok(name)
}

/// Set in the jailer once the VMM is forked; the signal forwarder sends to it.
static CHILD: AtomicI32 = AtomicI32::new(0);

extern "C" fn forward(sig: libc::c_int) {
    let pid = CHILD.load(Ordering::Relaxed);
    if pid > 0 {
        // SAFETY: kill is async-signal-safe; it only sends a signal.
        unsafe { libc::kill(pid, sig) };
    }
}

/// Removes what the jailer made when it is dropped: the jail's cgroups (killing what is
/// left in them) and, unless kept, the jail directory.
struct Cleanup {
    jail_dir: PathBuf,
    keep_root: bool,
    cgroups: Option<CgroupFs>,
}

impl Cleanup {
    fn run(&mut self) -> Result<(), JailError> {
        let mut first = None;
        if let Some(fs) = self.cgroups.take() {
            if let Err(e) = cleanup(&fs) {
                first.get_or_insert(JailError::Cgroup(e));
            }
        }
        if !self.keep_root {
            match std::fs::remove_dir_all(&self.jail_dir) {
                Ok(()) => {
                    // `<base>/<exec name>` when no other jail is left in it.
                    if let Some(up) = self.jail_dir.parent() {
                        let _ = std::fs::remove_dir(up);
                    }
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => {
                    first.get_or_insert(JailError::Io {
                        what: "removing the jail directory",
                        path: self.jail_dir.display().to_string(),
                        source: e,
                    });
                }
            }
            self.keep_root = true;
        }
        first.map_or(Ok(()), Err)
    }
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        if let Err(e) = self.run() {
            eprintln!("jailer: cleanup: {e}");
        }
    }
}

/// The jail directory of `cfg` (`<chroot_base>/<exec name>/<id>`); its `root` is the
/// VMM's `/`.
pub fn jail_dir(cfg: &JailConfig, exec_name: &str) -> PathBuf {
    cfg.chroot_base.join(exec_name).join(&cfg.id)
}

/// Jails and runs the VMM, waits for it, cleans up, and returns the exit code the jailer
/// should exit with (the VMM's, or 128 + the signal that ended it).
///
/// Must be called while the process has a single thread (it forks).
pub fn run(cfg: &JailConfig) -> Result<i32, JailError> {
    let exec_name = validate(cfg)?;
    let libs = rootfs::shared_libraries(&cfg.exec_file)?;
    let jail_dir = jail_dir(cfg, &exec_name);
    let root = jail_dir.join("root");
    std::fs::create_dir_all(jail_dir.parent().unwrap_or(&jail_dir))
        .map_err(io_err("creating", &jail_dir))?;
    std::fs::create_dir(&jail_dir).map_err(|e| match e.kind() {
        std::io::ErrorKind::AlreadyExists => JailError::InUse(jail_dir.display().to_string()),
        _ => io_err("creating", &jail_dir)(e),
    })?;
    let mut guard = Cleanup {
        jail_dir: jail_dir.clone(),
        keep_root: cfg.keep_root,
        cgroups: None,
    };
    std::fs::create_dir(&root).map_err(io_err("creating", &root))?;
    rootfs::chown(&root, cfg.uid, cfg.gid)?;

    let cg_parent = format!("{}/jail-{}", cfg.cgroup_parent.trim_matches('/'), cfg.id);
    let fs = CgroupFs::host(cfg.cgroup_version, &cg_parent)?;
    guard.cgroups = Some(fs.clone());
    let jail_cgroups = fs.delegate(VMM_LEAF, cfg.uid, cfg.gid)?;
    let plan = rootfs::Plan::new(cfg, &exec_name, &root, &libs, fs.version(), jail_cgroups)?;

    let (rd, wr) = pipe()?;
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP] {
        // SAFETY: installs an async-signal-safe handler that only calls kill().
        let _ = unsafe { signal(sig, SigHandler::Handler(forward)) };
    }
    // Only changes which pid namespace this process's next child gets.
    unshare(CloneFlags::CLONE_NEWPID)
        .map_err(|e| JailError::Sys("unshare(CLONE_NEWPID)", e.into()))?;
    // SAFETY: the jailer is single-threaded (see the contract above), so the child may
    // allocate; it only sets up the jail and executes the VMM or exits.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(JailError::Sys("fork", std::io::Error::last_os_error()));
    }
    if pid == 0 {
        drop(rd);
        let why = plan.enter_and_exec();
        let mut msg = why.into_bytes();
        msg.truncate(4000);
        // SAFETY: writes our message to the pipe the parent reads; then exits without
        // running the parent's destructors (the guard belongs to the parent).
        unsafe {
            libc::write(wr.as_raw_fd(), msg.as_ptr().cast(), msg.len());
            libc::_exit(127)
        }
    }
    CHILD.store(pid, Ordering::Relaxed);
    drop(wr);
    let mut why = String::new();
    let _ = std::fs::File::from(rd).read_to_string(&mut why);
    let status = wait(pid)?;
    CHILD.store(0, Ordering::Relaxed);
    guard.run()?;
    if !why.is_empty() {
        return Err(JailError::Setup(why));
    }
    Ok(match status {
        WaitStatus::Exited(_, code) => code,
        WaitStatus::Signaled(_, sig, _) => 128 + sig as i32,
        other => return Err(JailError::Setup(format!("unexpected VMM status {other:?}"))),
    })
}

fn pipe() -> Result<(OwnedFd, OwnedFd), JailError> {
    pipe2(OFlag::O_CLOEXEC).map_err(|e| JailError::Sys("pipe2", e.into()))
}

/// Waits for the VMM to end (a signal forwarded meanwhile interrupts the wait: go on).
fn wait(pid: i32) -> Result<WaitStatus, JailError> {
    loop {
        match waitpid(Pid::from_raw(pid), None) {
            Err(Errno::EINTR) => continue,
            Err(e) => return Err(JailError::Sys("waitpid", e.into())),
            Ok(status) => return Ok(status),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> JailConfig {
        JailConfig {
            id: "ok-1".into(),
            exec_file: PathBuf::from("/bin/sh"),
            uid: 1000,
            gid: 1000,
            chroot_base: std::env::temp_dir(),
            netns: None,
            cgroup_version: None,
            cgroup_parent: "forkvm".into(),
            files: Vec::new(),
            rlimit_nofile: 2048,
            rlimit_fsize: None,
            keep_root: false,
            args: Vec::new(),
        }
    }

    #[test]
    fn bad_configurations_are_refused_before_anything_is_made() {
        assert!(validate(&cfg()).is_ok());
        for id in ["", "a/b", "..", "a b", &"x".repeat(65)] {
            let c = JailConfig {
                id: id.into(),
                ..cfg()
            };
            assert!(matches!(validate(&c), Err(JailError::BadId(_))), "{id:?}");
        }
        let c = JailConfig { uid: 0, ..cfg() };
        assert!(matches!(validate(&c), Err(JailError::RootUser)));
        let c = JailConfig { gid: 0, ..cfg() };
        assert!(matches!(validate(&c), Err(JailError::RootUser)));
        let c = JailConfig {
            exec_file: "/nonexistent-forkvm".into(),
            ..cfg()
        };
        assert!(matches!(validate(&c), Err(JailError::ExecFile { .. })));
        let c = JailConfig {
            exec_file: "/".into(),
            ..cfg()
        };
        assert!(matches!(validate(&c), Err(JailError::ExecFile { .. })));
        for (host, jail) in [
            ("/nonexistent-forkvm", "/x"),
            ("/bin/sh", "relative"),
            ("/bin/sh", "/a/../b"),
            ("/bin/sh", "/"),
        ] {
            let c = JailConfig {
                files: vec![(host.into(), jail.into())],
                ..cfg()
            };
            assert!(
                matches!(validate(&c), Err(JailError::BadFile(_))),
                "{host}:{jail}"
            );
        }
    }

    #[test]
    fn shared_libraries_of_a_dynamic_executable_include_libc_and_the_loader() {
        let libs = rootfs::shared_libraries(Path::new("/bin/sh")).unwrap();
        assert!(
            libs.iter().any(|l| l.to_string_lossy().contains("libc.so")),
            "{libs:?}"
        );
        assert!(
            libs.iter()
                .any(|l| l.to_string_lossy().contains("ld-linux")),
            "{libs:?}"
        );
        assert!(
            libs.iter().all(|l| l.is_absolute() && l.exists()),
            "{libs:?}"
        );
        // A static executable needs none.
        if Path::new("/bin/busybox").exists() {
            assert_eq!(
                rootfs::shared_libraries(Path::new("/bin/busybox")).unwrap(),
                Vec::<PathBuf>::new()
            );
        }
    }
}
