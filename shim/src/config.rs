//! Where the shim finds its guest and keeps its files (from the environment containerd
//! starts it with), and its template: a Linux guest with forkvm's agent and one
//! writable disk slot, restored from the snapshot the first shim saved.

use std::os::fd::AsRawFd;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use forkvm::{guest_file, Ready, Template, TemplateSpec};
use sha2::{Digest, Sha256};

/// The agent's vsock port in the guest.
pub const AGENT_PORT: u32 = 1024;
/// What the guest's init prints once its agent serves.
const SERVING: &str = "forkvm-init: serving on vsock port 1024";
/// How long a call to a template's or a clone's VMM may take (a restore on a busy host
/// takes a while).
pub const CALL_TIMEOUT: Duration = Duration::from_secs(120);
/// The template's kernel command line.
const CMDLINE: &str = "console=ttyS0 reboot=k panic=-1 quiet forkvm.agent=1024";

/// The shim's configuration.
#[derive(Debug, Clone)]
pub struct ShimConfig {
    /// The guest kernel (`FORKVM_SHIM_KERNEL`; default `vmlinux` in `../share/forkvm`
    /// beside the shim when installed there, else in `target/guest`).
    pub kernel: PathBuf,
    /// The guest's initramfs with the agent (`FORKVM_SHIM_INITRD`; `initramfs.cpio`,
    /// found as the kernel).
    pub initrd: PathBuf,
    /// Where the template's snapshot, the root file system images and the clones'
    /// overlays go (`FORKVM_SHIM_DIR`; default `/var/lib/forkvm/shim`).
    pub dir: PathBuf,
    /// The most the images may take, in bytes (`FORKVM_SHIM_IMAGES_MIB`; 16 GiB).
    pub images_budget: u64,
    /// Where the template VMs' vsock sockets go (`FORKVM_SHIM_RUN_DIR`; default
    /// `/run/forkvm/shim`): not in the bundle, whose path (containerd's state, the
    /// namespace, a 64-character id) can be longer than a socket's path may be.
    pub run_dir: PathBuf,
    /// Boot a template for each container instead of restoring the saved one
    /// (`FORKVM_SHIM_BOOT_EACH=1`): what a runtime that boots a VM per container pays,
    /// for comparison (`benches/containerd.py`).
    pub boot_each: bool,
    /// Warm clones each image's template keeps in the template service
    /// (`FORKVM_SHIM_WARM_CLONES`; 1).
    pub warm_clones: u32,
    /// How long the template service keeps an image's template that no container
    /// uses, and itself runs with none (`FORKVM_SHIM_TEMPLATE_IDLE_S`; 300 s).
    pub template_idle: Duration,
    /// The most clones a template lends at once (`FORKVM_SHIM_CLONES_MAX`, 1 to 2000;
    /// 256): its cgroup pool's maximum (`vmm restore --cgroup-pool-max`). A container
    /// past it fails with the reason.
    pub clones_max: u32,
    /// The most templates the template service keeps (`FORKVM_SHIM_TEMPLATES_MAX`; 16):
    /// past it the least recently used that lends no clone is stopped.
    pub templates_max: usize,
}

impl ShimConfig {
    /// The configuration from the environment.
    pub fn from_env() -> Self {
        let var = |name: &str| std::env::var_os(name).map(PathBuf::from);
        let mib = std::env::var("FORKVM_SHIM_IMAGES_MIB").ok();
        Self {
            kernel: var("FORKVM_SHIM_KERNEL").unwrap_or_else(|| guest_file("vmlinux")),
            initrd: (var("FORKVM_SHIM_INITRD")).unwrap_or_else(|| guest_file("initramfs.cpio")),
            dir: var("FORKVM_SHIM_DIR").unwrap_or_else(|| "/var/lib/forkvm/shim".into()),
            images_budget: mib.and_then(|m| m.parse::<u64>().ok()).unwrap_or(16 << 10) << 20,
            run_dir: var("FORKVM_SHIM_RUN_DIR").unwrap_or_else(|| "/run/forkvm/shim".into()),
            boot_each: std::env::var("FORKVM_SHIM_BOOT_EACH").is_ok_and(|v| v == "1"),
            warm_clones: number("FORKVM_SHIM_WARM_CLONES").unwrap_or(1.0) as u32,
            template_idle: Duration::from_secs_f64(
                number("FORKVM_SHIM_TEMPLATE_IDLE_S").unwrap_or(300.0),
            ),
            clones_max: number("FORKVM_SHIM_CLONES_MAX")
                .map_or(256, |n| n.clamp(1.0, 2000.0) as u32),
            templates_max: number("FORKVM_SHIM_TEMPLATES_MAX").map_or(16, |n| n.max(1.0) as usize),
        }
    }

    /// The template service's socket for this configuration (its files beside it:
    /// `.lock`, `.pid`, `.log`): named by what the service is started with (this
    /// program, the guest, the directories, the `vmm`, the warm clones, the idle time
    /// and the maximums), so shims configured otherwise (another containerd's, another build's)
    /// have a service of their own.
    pub fn service_socket(&self) -> PathBuf {
        let exe = std::env::current_exe().unwrap_or_default();
        let vmm = TemplateSpec::new("").vmm;
        let text = format!(
            "{}\0{}\0{}\0{}\0{}\0{}\0{}\0{:?}\0{}\0{}",
            exe.display(),
            vmm.display(),
            self.kernel.display(),
            self.initrd.display(),
            self.dir.display(),
            self.run_dir.display(),
            self.warm_clones,
            self.template_idle,
            self.clones_max,
            self.templates_max
        );
        self.run_dir
            .join(format!("{}.sock", digest_name("templates-", &text, 12)))
    }

    /// The host socket of the vsock device of the template for the container whose
    /// bundle is `bundle`: named by a hash of the bundle's path.
    pub fn vsock(&self, bundle: &str) -> PathBuf {
        self.run_dir
            .join(format!("{}.vsock", digest_name("", bundle, 24)))
    }

    /// Where the clones' overlays go.
    pub fn overlays(&self) -> PathBuf {
        self.dir.join("overlays")
    }

    /// Where the template's snapshot of these guest files and this `vmm` is: named by
    /// the guest files' paths, sizes and modification times and the `vmm`'s saved-state
    /// id (a new kernel or image, or a `vmm` whose saved state differs, boots and saves
    /// anew; a `vmm` rebuilt with the same id restores the saved one).
    fn snapshot(&self, vmm: &Path) -> Result<PathBuf, TemplateError> {
        let mut h = Sha256::new();
        for f in [&self.kernel, &self.initrd] {
            h.update(f.display().to_string().as_bytes());
            if let Ok(m) = std::fs::metadata(f) {
                h.update(m.len().to_le_bytes());
                h.update(m.mtime().to_le_bytes());
                h.update(m.mtime_nsec().to_le_bytes());
            }
            h.update(b"\0");
        }
        h.update(forkvm::vmm_state_id(vmm)?.as_bytes());
        h.update(CMDLINE.as_bytes());
        h.update(format!("\0slots={SLOTS},net").as_bytes());
        let hex = hex(&h.finalize());
        Ok(self.dir.join(format!("template-{}", &hex[..16])))
    }
}

/// Environment variable `name` as a number that is not negative (None when unset or
/// not one).
fn number(name: &str) -> Option<f64> {
    let v: f64 = std::env::var(name).ok()?.trim().parse().ok()?;
    (v.is_finite() && v >= 0.0).then_some(v)
}

/// `prefix` and the first `len` hexadecimal digits of the SHA-256 of `text`: a short
/// name of its own for something named by `text` (a socket, a tap: 15 characters at
/// most).
pub fn digest_name(prefix: &str, text: &str, len: usize) -> String {
    format!("{prefix}{}", &hex(&Sha256::digest(text.as_bytes()))[..len])
}

/// `bytes` in lower-case hexadecimal (a digest in a file name).
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Why the template could not be had.
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The shim's directory failed.
    #[error("{path}: {source}")]
    Dir {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The VMM failed.
    #[error(transparent)]
    Vmm(#[from] forkvm::Error),
    /// The `vmm` did not tell its saved-state id.
    #[error(transparent)]
    StateId(#[from] forkvm::StateIdError),
}

pub fn dir_error(path: &Path) -> impl FnOnce(std::io::Error) -> TemplateError + '_ {
    move |source| TemplateError::Dir {
        path: path.to_path_buf(),
        source,
    }
}

/// The template's disk slots: a pod's VM holds this many containers at once, each
/// container's root file system in a slot of its own (a container outside a pod uses
/// slot 0).
pub const SLOTS: u8 = api_types::MAX_DISK_SLOTS as u8;

/// The resource class of a container's clone: its cgroup (the VMM's pool).
pub const CLASS: &str = "container";

/// Takes an exclusive lock on file `path` (made if missing), held while the returned
/// file is open.
pub fn lock(path: &Path) -> Result<std::fs::File, TemplateError> {
    let lock = std::fs::File::create(path).map_err(dir_error(path))?;
    // SAFETY: flock on a descriptor this function owns; released when it closes.
    let locked = unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
    if locked != 0 {
        return Err(dir_error(path)(std::io::Error::last_os_error()));
    }
    Ok(lock)
}

/// The shim's template's snapshot: booted and saved first if there is none (one shim at
/// a time: a lock file). With `FORKVM_SHIM_BOOT_EACH` none (an empty path): each
/// template boots ([`template`]).
pub async fn base(cfg: &ShimConfig) -> Result<PathBuf, TemplateError> {
    let overlays = cfg.overlays();
    std::fs::create_dir_all(&overlays).map_err(dir_error(&overlays))?;
    std::fs::create_dir_all(&cfg.run_dir).map_err(dir_error(&cfg.run_dir))?;
    if cfg.boot_each {
        return Ok(PathBuf::new());
    }
    let snapshot = cfg.snapshot(&TemplateSpec::new("").vmm)?;
    if !snapshot.join("state").exists() {
        let _lock = lock(&cfg.dir.join("template.lock"))?;
        if !snapshot.join("state").exists() {
            boot_and_save(cfg, &snapshot).await?;
        }
    }
    Ok(snapshot)
}

/// The template for a container, its vsock device's host socket at `vsock`, with one
/// resource class (`CLASS`, limits `limits`: `cpu=..,memory=..`, or none) and
/// `warm_clones` warm clones: restored from `snapshot` (the shim's template's,
/// [`base`], or one of an image's), or booted with `FORKVM_SHIM_BOOT_EACH`.
pub async fn template(
    cfg: &ShimConfig,
    snapshot: &Path,
    vsock: &Path,
    limits: &str,
    warm_clones: u32,
) -> Result<Template, TemplateError> {
    let class = match limits {
        "" => CLASS.to_string(),
        l => format!("{CLASS}:{l}"),
    };
    if cfg.boot_each {
        let mut spec = boot_spec(cfg, vsock);
        spec.args.extend(["--cgroup-class".into(), class]);
        return Ok(Template::start(spec).await?);
    }
    let mut spec = TemplateSpec::new("unused: the snapshot's guest runs");
    spec.warm_clones = warm_clones;
    spec.ready = Ready::Console(SERVING.into());
    spec.call_timeout = CALL_TIMEOUT;
    spec.args = vec![
        "--vsock".into(),
        vsock.display().to_string(),
        "--tap".into(),
        tap_name(vsock),
        "--cow-dir".into(),
        cfg.overlays().display().to_string(),
        "--cgroup-class".into(),
        class,
        "--cgroup-pool-max".into(),
        cfg.clones_max.to_string(),
        "--cgroup-pool-size".into(),
        cfg.clones_max.min(4).to_string(),
    ];
    Ok(Template::restore(snapshot, spec).await?)
}

/// The tap of the template whose vsock socket is `vsock` (a name of its own: 15
/// characters at most). The VMM makes it; it goes with the VMM.
fn tap_name(vsock: &Path) -> String {
    digest_name("fvt", &vsock.display().to_string(), 12)
}

/// The spec of a template booted with its vsock device's host socket at `vsock`.
fn boot_spec(cfg: &ShimConfig, vsock: &Path) -> TemplateSpec {
    let mut spec = TemplateSpec::new(&cfg.kernel);
    spec.initrd = Some(cfg.initrd.clone());
    spec.cmdline = Some(CMDLINE.into());
    spec.mem_mib = 256;
    spec.warm_clones = 0;
    spec.ready = Ready::Console(SERVING.into());
    spec.start_timeout = Duration::from_secs(600);
    spec.args = vec![
        "--vsock".into(),
        vsock.display().to_string(),
        "--tap".into(),
        tap_name(vsock),
        "--disk-slots".into(),
        SLOTS.to_string(),
        "--slot-cow-dir".into(),
        cfg.overlays().display().to_string(),
    ];
    spec
}

/// Boots the template and saves it at `snapshot`.
async fn boot_and_save(cfg: &ShimConfig, snapshot: &Path) -> Result<(), TemplateError> {
    log::info!("booting the template from {}", cfg.kernel.display());
    let boot_vsock = cfg.dir.join("boot.vsock");
    let t = Template::start(boot_spec(cfg, &boot_vsock)).await?;
    let tmp = cfg
        .dir
        .join(format!("template.saving-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&tmp);
    t.snapshot(&tmp).await?;
    t.shutdown().await?;
    std::fs::rename(&tmp, snapshot).map_err(dir_error(snapshot))?;
    // Snapshots of other guest files or another vmm go, and the images' made from them
    // (a VMM restored from one keeps its memory file open).
    let hash = snapshot
        .file_name()
        .map(|n| n.to_string_lossy().into_owned());
    let hash = hash.unwrap_or_default().replace("template-", "");
    for e in std::fs::read_dir(&cfg.dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let stale_template = name.starts_with("template-") && e.path() != snapshot;
        let stale_image = name.starts_with("prepared-") && !name.contains(&hash);
        if stale_template || stale_image {
            // An image template's lock file goes with it.
            let _ = std::fs::remove_dir_all(e.path()).or_else(|_| std::fs::remove_file(e.path()));
        }
    }
    let _ = std::fs::remove_file(&boot_vsock);
    Ok(())
}
