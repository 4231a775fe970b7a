//! Booted test guests kept as snapshots (docs/snapshots.md), cached outside the
//! repository as the guest kernel build is: `$FORKVM_CACHE_DIR/snapshots` (default
//! `/var/cache/forkvm/snapshots`), one directory per guest, named by a hash of
//! everything the saved guest depends on: the snapshot format version, the `vmm run`
//! arguments, the contents of the files the guest boots from (kernel, initramfs, root
//! image), the sources of the device models and of the saved state's types (a change
//! there may change what a state means), and the host CPU model. Paths are part of it
//! (a snapshot names its disk images by path): each checkout has entries of its own.
//!
//! A test asks for a guest in a given state ([`CachedBoot`]); the first run boots it,
//! waits for that state and writes the snapshot; every run, the first included,
//! restores it, so the tests exercise the restore path each time and skip the Linux
//! boot (17-60 s here) from the second run on. A cached snapshot that no longer
//! restores (refused, or the VMM dies before its control socket is up) is removed and
//! made again, loudly.

use std::hash::{Hash, Hasher};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use crate::{repo_root, Scratch, Vm};

/// A guest booted with `run_args` (without `--console` and `--api-sock`) and brought to
/// the state to keep by `ready`, which must leave it paused.
pub struct CachedBoot<'a> {
    /// A name for the cache entry (`linux-c-template`, ...).
    pub name: &'a str,
    /// The `vmm run` arguments.
    pub run_args: &'a [&'a str],
    /// Files whose contents the guest depends on beyond the arguments' text.
    pub inputs: &'a [PathBuf],
    /// The guest has a vsock device (its host socket, a path of each run's own, is not
    /// part of the key: the boot gets one in its scratch directory, a restore its own).
    pub vsock: bool,
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

fn hash_file(h: &mut impl Hasher, path: &Path) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    path.hash(h);
    bytes.hash(h);
}

fn hash_sources(h: &mut impl Hasher, dir: &Path) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for p in entries {
        if p.is_dir() {
            hash_sources(h, &p);
        } else if p.extension().is_some_and(|e| e == "rs") {
            hash_file(h, &p);
        }
    }
}

fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = info.lines().find(|l| l.starts_with("model name"));
    model.unwrap_or("unknown").to_string()
}

/// The cache entry of `boot`.
fn entry(boot: &CachedBoot<'_>) -> PathBuf {
    // SipHash with fixed keys: the same inputs give the same name from run to run.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    clone::state_file::FORMAT_VERSION.hash(&mut h);
    boot.run_args.hash(&mut h);
    boot.vsock.hash(&mut h);
    for f in boot.inputs {
        hash_file(&mut h, f);
    }
    let root = repo_root();
    for dir in [
        "devices/src",
        "clone/src",
        "vmm/src/device_manager",
        "vmm/src/snapshot",
    ] {
        hash_sources(&mut h, &root.join(dir));
    }
    cpu_model().hash(&mut h);
    cache_dir().join(format!("{}-{:016x}", boot.name, h.finish()))
}

/// Removes cache entries unused for [`MAX_AGE`] (each restore touches its entry).
fn prune(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let old = (e.metadata().and_then(|m| m.modified()).ok())
            .and_then(|t| SystemTime::now().duration_since(t).ok())
            .is_some_and(|age| age > MAX_AGE);
        if old {
            let _ = std::fs::remove_dir_all(e.path());
        }
    }
}

/// Boots `boot`'s guest, brings it to its state and writes the snapshot to `dir`.
fn make(boot: &CachedBoot<'_>, dir: &Path, timeout: Duration) {
    let parent = dir.parent().expect("an entry has a parent");
    std::fs::create_dir_all(parent).unwrap();
    prune(parent);
    let scratch = Scratch::new(&format!("cache-{}", boot.name));
    let vsock = scratch.path("boot.vsock").display().to_string();
    let mut args = boot.run_args.to_vec();
    if boot.vsock {
        args.extend(["--vsock", &vsock]);
    }
    let mut vm = Vm::start(&scratch, &args);
    (boot.ready)(&mut vm);
    assert_eq!(
        vm.describe()["state"],
        "paused",
        "{} is not paused",
        boot.name
    );
    let (code, answer) = vm.snapshot(dir);
    // 409: another test made it meanwhile.
    assert!(code == 201 || code == 409, "{}: {code} {answer}", boot.name);
    eprintln!(
        "cache: {} booted and saved as {} ({answer})",
        boot.name,
        dir.display()
    );
    vm.shutdown(timeout);
}

/// A VM in `boot`'s state: restored from the cached snapshot, made first if there is
/// none (or the one there does not restore). `restore_args` are `vmm restore`'s host
/// options beyond `--dir`, `--console` and `--api-sock`. Returns the VM, its control
/// socket up.
pub fn restored(
    scratch: &Scratch,
    boot: &CachedBoot<'_>,
    restore_args: &[&str],
    timeout: Duration,
) -> Vm {
    let dir = entry(boot);
    for attempt in 0..2 {
        if !dir.join("state").exists() {
            make(boot, &dir, timeout);
        }
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
        let _ = std::fs::remove_dir_all(&dir);
    }
    panic!("{} does not restore even when just made", dir.display());
}

/// The Linux guest (the initramfs, 256 MiB) once init serves forkvm's agent on vsock
/// port 1024 (nothing else in it is starting up then), restored with its host socket at
/// `vsock`: booted and saved the first time.
pub fn linux_agent(scratch: &Scratch, vsock: &Path, timeout: Duration) -> Vm {
    let (kernel, initrd) = (
        crate::guest_file("vmlinux"),
        crate::guest_file("initramfs.cpio"),
    );
    let (k, i) = (kernel.display().to_string(), initrd.display().to_string());
    let args = [
        "--kernel",
        &k,
        "--initrd",
        &i,
        "--mem-mib",
        "256",
        "--cmdline",
        "console=ttyS0 reboot=k panic=-1 quiet forkvm.agent=1024",
    ];
    let serving = |vm: &mut Vm| {
        vm.wait_console_line("forkvm-init: serving on vsock port 1024", timeout);
        assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    };
    let boot = CachedBoot {
        name: "linux-agent",
        run_args: &args,
        inputs: &[kernel.clone(), initrd.clone()],
        vsock: true,
        ready: &serving,
    };
    let restore = ["--vsock", vsock.to_str().expect("UTF-8 path")];
    restored(scratch, &boot, &restore, timeout)
}
