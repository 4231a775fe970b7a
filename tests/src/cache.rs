//! Booted test guests kept as snapshots (docs/snapshots.md), cached outside the
//! repository as the guest kernel build is: `$FORKVM_CACHE_DIR/snapshots` (default
//! `/var/cache/forkvm/snapshots`), one directory per guest, named by a SHA-256 of
//! everything the saved guest depends on:
//! - the snapshot format version and the VMM's version;
//! - the `vmm run` arguments as written, with the host-side paths a boot gets fresh left
//!   as placeholders ([`VSOCK`], [`TAP`], [`COW`]): a restore gives its own;
//! - the guest's files by content: [`image`] copies a guest image into the cache under a
//!   name that holds the hash of its bytes, and the arguments name that copy, so the key
//!   does not depend on where the checkout is (a clean clone in another directory finds
//!   the same entries) and a rebuilt image with other bytes gets entries of its own;
//! - the build's saved-state id ([`vmm::SAVED_STATE_ID`]: the sources of the device
//!   models, of the saved state's types and of the snapshot code, where a change may
//!   change what a state means, and the dependencies' versions);
//! - the host CPU model.
//!
//! A test asks for a guest in a given state ([`CachedBoot`]); the first run boots it,
//! waits for that state and writes the snapshot; every run, the first included,
//! restores it, so the tests exercise the restore path each time and skip the Linux
//! boot (17-60 s here) from the second run on. A cached snapshot that no longer
//! restores (refused, or the VMM dies before its control socket is up) is removed and
//! made again, loudly. Test processes that want the same entry at once (the test
//! runner runs each test in a process of its own) take a lock on it: one boots, the
//! others wait and restore what it saved.

use std::io::Read;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use sha2::{Digest, Sha256};

use crate::{Scratch, Vm};

/// In [`CachedBoot::run_args`]: the vsock device's host socket, a path of the boot's own
/// (a restore gives its own with `--vsock`).
pub const VSOCK: &str = "{vsock}";
/// In [`CachedBoot::run_args`]: the card's tap, one the boot's VMM creates under a name
/// of its own (a restore gives its own with `--tap`).
pub const TAP: &str = "{tap}";
/// In [`CachedBoot::run_args`] (inside `--rootfs-cow` or `--disk ...,cow=`): the
/// directory of the boot's overlays (a restore gives its own with `--cow-dir`).
pub const COW: &str = "{cow}";

/// A guest booted with `run_args` (without `--console` and `--api-sock`) and brought to
/// the state to keep by `ready`, which must leave it paused.
pub struct CachedBoot<'a> {
    /// A name for the cache entry (`linux-c-template`, ...).
    pub name: &'a str,
    /// The `vmm run` arguments: guest files through [`image`], host-side paths as
    /// [`VSOCK`], [`TAP`] and [`COW`].
    pub run_args: &'a [&'a str],
    /// Waits for the booted guest's state to keep and leaves it paused.
    pub ready: &'a dyn Fn(&mut Vm),
}

/// Where cached snapshots go.
pub fn cache_dir() -> PathBuf {
    let base = std::env::var_os("FORKVM_CACHE_DIR").unwrap_or_else(|| "/var/cache/forkvm".into());
    PathBuf::from(base).join("snapshots")
}

/// Entries unused for this long are removed when another is made.
const MAX_AGE: Duration = Duration::from_secs(14 * 24 * 3600);

/// The SHA-256 of a file's bytes, in hex.
fn file_digest(path: &Path) -> String {
    let mut f = std::fs::File::open(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f
            .read(&mut buf)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    hex(&h.finalize())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// `path`, a guest file, as a copy in the cache named by the hash of its bytes
/// (`images/<hash>-<name>`), made the first time: the path to give a [`CachedBoot`]'s
/// arguments. A copy, not a link: `make guest` rewrites some images in place.
pub fn image(path: &Path) -> String {
    let name = path.file_name().expect("a file").to_string_lossy();
    let dir = cache_dir().join("images");
    let copy = dir.join(format!("{}-{name}", &file_digest(path)[..16]));
    if !copy.exists() {
        std::fs::create_dir_all(&dir).unwrap();
        // Per process and per call: tests of one binary may run as threads of one
        // process, and two of them copy the same image at once.
        static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let tmp = dir.join(format!(".{name}.tmp-{}-{call}", std::process::id()));
        std::fs::copy(path, &tmp).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        std::fs::rename(&tmp, &copy).unwrap();
    }
    // Recently used: kept by the pruning. Its access time says so, not its
    // modification time, which programs that key what they saved by the file's path,
    // size and modification time (the containerd shim's template; the gateway's memo
    // of its hash) keep seeing unchanged.
    let _ = std::fs::File::open(&copy)
        .and_then(|f| f.set_times(std::fs::FileTimes::new().set_accessed(SystemTime::now())));
    copy.display().to_string()
}

/// [`image`] of a file in `target/guest/`.
pub fn guest_image(name: &str) -> String {
    image(&crate::guest_file(name))
}

fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info.lines().find(|l| l.starts_with("model name"));
    model.unwrap_or("unknown").to_string()
}

/// The cache entry of `boot`: the directory its snapshot is (or would be) in.
pub fn entry(boot: &CachedBoot<'_>) -> PathBuf {
    let mut h = Sha256::new();
    h.update(format!(
        "format {}\0vmm {}\0",
        clone::state_file::FORMAT_VERSION,
        env!("CARGO_PKG_VERSION")
    ));
    for a in boot.run_args {
        h.update(format!("{}\0{a}\0", a.len()));
    }
    // The build's saved-state id (vmm/build.rs: the sources that decide what a saved VM
    // holds and how it restores, and Cargo.lock): a change there needs new snapshots.
    h.update(format!("state {}\0", vmm::SAVED_STATE_ID));
    h.update(cpu_model());
    let digest = hex(&h.finalize());
    cache_dir().join(format!("{}-{}", boot.name, &digest[..16]))
}

/// Removes cache entries and image copies unused for [`MAX_AGE`] (each use touches
/// them).
fn prune(dir: &Path) {
    for dir in [dir.to_path_buf(), dir.join("images")] {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            if e.file_name() == "images" {
                continue;
            }
            // Last used: the later of its modification and access times.
            let used = e.metadata().ok().and_then(|m| {
                let modified = m.modified().ok()?;
                Some(m.accessed().map_or(modified, |a| a.max(modified)))
            });
            let old = used
                .and_then(|t| SystemTime::now().duration_since(t).ok())
                .is_some_and(|age| age > MAX_AGE);
            if old {
                let p = e.path();
                let _ = std::fs::remove_dir_all(&p).or_else(|_| std::fs::remove_file(&p));
            }
        }
    }
}

/// An exclusive lock on `<entry>.lock`, held until dropped (closing the file releases
/// it): one process makes an entry while the others wait for it.
struct EntryLock(#[allow(dead_code)] std::fs::File);

impl EntryLock {
    fn take(dir: &Path) -> Self {
        let parent = dir.parent().expect("an entry has a parent");
        std::fs::create_dir_all(parent).unwrap();
        let path = dir.with_extension("lock");
        let f = std::fs::File::create(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        // SAFETY: flock on a descriptor this function owns; no memory is involved.
        let rc = unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) };
        assert_eq!(rc, 0, "flock {}", path.display());
        Self(f)
    }
}

/// A tap name of this process's own for a boot (`fkc<pid>`, at most 15 bytes).
fn boot_tap() -> String {
    format!("fkc{}", std::process::id())
}

/// Boots `boot`'s guest, brings it to its state and writes the snapshot to `dir`.
fn make(boot: &CachedBoot<'_>, dir: &Path, timeout: Duration) {
    prune(dir.parent().expect("an entry has a parent"));
    let scratch = Scratch::new(&format!("cache-{}", boot.name));
    let vsock = scratch.path("boot.vsock").display().to_string();
    let cow = scratch.path("cow");
    std::fs::create_dir_all(&cow).unwrap();
    let cow = cow.display().to_string();
    let tap = boot_tap();
    let args: Vec<String> = boot
        .run_args
        .iter()
        .map(|a| {
            a.replace(VSOCK, &vsock)
                .replace(TAP, &tap)
                .replace(COW, &cow)
        })
        .collect();
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let mut vm = Vm::start(&scratch, &args);
    (boot.ready)(&mut vm);
    assert_eq!(
        vm.describe()["state"],
        "paused",
        "{} is not paused",
        boot.name
    );
    let (code, answer) = vm.snapshot(dir);
    assert_eq!(code, 201, "{}: {answer}", boot.name);
    eprintln!(
        "cache: {} booted and saved as {} ({answer})",
        boot.name,
        dir.display()
    );
    vm.shutdown(timeout);
}

/// The directory of `boot`'s cached snapshot, made first if there is none (for a test
/// that restores it otherwise than [`restored`] does: through the library, say).
pub fn saved(boot: &CachedBoot<'_>, timeout: Duration) -> PathBuf {
    let dir = entry(boot);
    if !dir.join("state").exists() {
        let _lock = EntryLock::take(&dir);
        // Another process may have made it while this one waited.
        if !dir.join("state").exists() {
            make(boot, &dir, timeout);
        }
    }
    dir
}

/// A VM in `boot`'s state: restored from the cached snapshot, made first if there is
/// none (or the one there does not restore). `restore_args` are `vmm restore`'s host
/// options beyond `--dir`, `--console` and `--api-sock` (`--vsock`, `--tap`,
/// `--cow-dir` for what the boot had as [`VSOCK`], [`TAP`], [`COW`]). Returns the VM,
/// its control socket up.
pub fn restored(
    scratch: &Scratch,
    boot: &CachedBoot<'_>,
    restore_args: &[&str],
    timeout: Duration,
) -> Vm {
    let dir = entry(boot);
    for attempt in 0..2 {
        saved(boot, timeout);
        let mut vm = Vm::restore(scratch, &dir, restore_args);
        if vm.try_wait_api(timeout) {
            // Recently used: kept by the pruning.
            let _ = std::fs::File::open(&dir).and_then(|f| f.set_modified(SystemTime::now()));
            return vm;
        }
        eprintln!(
            "WARNING: the cached snapshot {} does not restore (attempt {attempt}); making it \
             again. The VMM said:\n{}",
            dir.display(),
            vm.stderr_text()
        );
        let _lock = EntryLock::take(&dir);
        let _ = std::fs::remove_dir_all(&dir);
    }
    panic!("{} does not restore even when just made", dir.display());
}

/// A Linux guest kept in the cache: the initramfs, 256 MiB, once init serves forkvm's
/// agent on vsock port 1024 (nothing else in it is starting up then), paused.
#[derive(Default)]
pub struct LinuxAgent<'a> {
    /// The cache entry's name.
    pub name: &'a str,
    /// More of the kernel command line (`forkvm.crng=off`, ...).
    pub cmdline: &'a str,
    /// Further `vmm run` options (devices; host-side paths as [`TAP`], [`COW`]).
    pub devices: &'a [&'a str],
    /// Further `vmm restore` options (`--tap`, `--cow-dir`, `--warm-clones`, ...).
    pub restore: &'a [&'a str],
}

impl LinuxAgent<'_> {
    /// The guest restored with its vsock device's host socket at `vsock`: booted and
    /// saved the first time.
    pub fn restore(&self, scratch: &Scratch, vsock: &Path, timeout: Duration) -> Vm {
        let (kernel, initrd) = (guest_image("vmlinux"), guest_image("initramfs.cpio"));
        let cmdline = format!(
            "console=ttyS0 reboot=k panic=-1 quiet forkvm.agent=1024 {}",
            self.cmdline
        );
        let mut args = vec![
            "--kernel",
            &kernel,
            "--initrd",
            &initrd,
            "--mem-mib",
            "256",
            "--cmdline",
            cmdline.trim_end(),
            "--vsock",
            VSOCK,
        ];
        args.extend_from_slice(self.devices);
        let serving = |vm: &mut Vm| {
            vm.wait_console_line("forkvm-init: serving on vsock port 1024", timeout);
            assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
        };
        let boot = CachedBoot {
            name: self.name,
            run_args: &args,
            ready: &serving,
        };
        let mut all = vec!["--vsock", vsock.to_str().expect("UTF-8 path")];
        all.extend_from_slice(self.restore);
        restored(scratch, &boot, &all, timeout)
    }
}

/// [`LinuxAgent`] `name` with `devices`, restored with `restore`.
pub fn linux_agent_with(
    scratch: &Scratch,
    name: &str,
    devices: &[&str],
    vsock: &Path,
    restore: &[&str],
    timeout: Duration,
) -> Vm {
    let guest = LinuxAgent {
        name,
        devices,
        restore,
        ..Default::default()
    };
    guest.restore(scratch, vsock, timeout)
}

/// [`LinuxAgent`] with no more devices than vsock.
pub fn linux_agent(scratch: &Scratch, vsock: &Path, timeout: Duration) -> Vm {
    linux_agent_with(scratch, "linux-agent", &[], vsock, &[], timeout)
}
