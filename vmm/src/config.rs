//! What a user asks for: the VM configuration and its validation.

use std::path::PathBuf;

pub use api_types::net::{Ipv4Cidr, MacAddr, DEFAULT_MAC};
pub use api_types::vm::ApBoot;
use api_types::{CloneAddresses, CloneRateLimits};

use crate::arch::x86_64::layout::{MAX_MEM_MIB, MIN_MEM_MIB};
use crate::arch::x86_64::mptable::{MAX_VCPUS, MAX_VIRTIO_DEVICES};

/// Most live clones one VM may have (each clone may have as many of its own), and the
/// default of `--max-clones`.
pub const MAX_LIVE_CLONES: usize = 2000;
/// Most live clones a whole tree (an original VM, its clones, theirs, ...) may have
/// (`--max-tree-clones`, default [`MAX_LIVE_CLONES`]).
pub const MAX_TREE_CLONES: usize = 65536;
/// Most warm clones a VM may keep (`--warm-clones`).
pub const MAX_WARM_CLONES: usize = 256;

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

impl std::str::FromStr for ConsoleSink {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "" => return Err("empty console sink".into()),
            "stdout" | "-" => ConsoleSink::Stdout,
            "null" | "none" => ConsoleSink::Null,
            path => ConsoleSink::File(PathBuf::from(path)),
        })
    }
}

/// The default kernel command line when the user gives none.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1";

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

/// Parses `NAME:LIMITS` (`small:cpu=0.5,memory=64M,pids=64`; `NAME` alone is unlimited).
pub fn parse_cgroup_class(s: &str) -> Result<(String, jailer::cgroup::ResourceClass), String> {
    let (name, limits) = s.split_once(':').unwrap_or((s, ""));
    if name.is_empty()
        || name.len() > 32
        || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
    {
        return Err(format!(
            "class name {name:?}: use 1 to 32 letters, digits or '_'"
        ));
    }
    Ok((name.to_string(), limits.parse()?))
}

/// The virtio-rng device.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RngConfig {
    /// Bytes and requests per refill period (None: unlimited).
    pub rate_limit: Option<devices::rate_limiter::RateLimit>,
}

/// A virtio-blk disk: `PATH[,cow=DIR[,keep]][,bytes=..][,ops=..]` (`--disk`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DiskConfig {
    /// The image: opened read-only once and never written (clones share the open file).
    pub path: PathBuf,
    /// Makes the disk writable: the guest's writes go to a private copy-on-write
    /// overlay file in this directory (each clone gets a copy of its parent's).
    pub cow_dir: Option<PathBuf>,
    /// Keep the overlay when the VM ends (not after SIGKILL), as
    /// [`DiskConfig::kept_path`].
    pub keep: bool,
    /// Limit for the disk's bytes and requests (None: unlimited).
    pub rate_limit: Option<devices::rate_limiter::RateLimit>,
}

impl DiskConfig {
    /// Where disk `index` of the VMM with process id `pid` keeps its overlay when the
    /// VM ends: `<cow dir>/fkvm<pid>-disk<index>.overlay` (None unless it keeps one).
    pub fn kept_path(&self, index: usize, pid: i32) -> Option<PathBuf> {
        let dir = self.cow_dir.as_ref().filter(|_| self.keep)?;
        Some(dir.join(format!("fkvm{pid}-disk{index}.overlay")))
    }
}

/// `disks` with every writable one keeping its overlay or not as `keep` says (None: as
/// they are).
pub fn keep_overlays(disks: &[DiskConfig], keep: Option<bool>) -> Vec<DiskConfig> {
    disks
        .iter()
        .map(|d| DiskConfig {
            keep: keep.filter(|_| d.cow_dir.is_some()).unwrap_or(d.keep),
            ..d.clone()
        })
        .collect()
}

/// A `--disk` specification that does not parse.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum DiskSpecError {
    /// No image path before the first comma.
    #[error("disk {0:?}: expected PATH[,cow=DIR[,keep]][,bytes=SIZE..][,ops=N..]")]
    NoPath(String),
    /// An option other than `cow=`, `keep`, `bytes=` and `ops=`.
    #[error("disk {spec:?}: unknown option {option:?} (expected cow=DIR, keep, bytes=.., ops=..)")]
    Option {
        /// The whole specification.
        spec: String,
        /// The option.
        option: String,
    },
    /// An option given twice.
    #[error("disk {spec:?}: {source}")]
    Options {
        /// The whole specification.
        spec: String,
        /// Why.
        source: api_types::options::OptionError,
    },
    /// `keep` on a read-only disk.
    #[error("disk {0:?}: keep needs cow=DIR (a read-only disk has no overlay to keep)")]
    KeepWithoutCow(String),
    /// The rate limit does not parse.
    #[error("disk {spec:?}: {source}")]
    RateLimit {
        /// The whole specification.
        spec: String,
        /// Why.
        source: devices::rate_limiter::RateLimitError,
    },
}

impl std::str::FromStr for DiskConfig {
    type Err = DiskSpecError;

    /// `images/base.ext4`, `scratch.img,cow=/var/tmp,keep,bytes=10M,ops=1000` (a path
    /// may not contain a comma; `keep` needs `cow=`).
    fn from_str(s: &str) -> Result<Self, DiskSpecError> {
        let (path, options) = s.split_once(',').unwrap_or((s, ""));
        if path.is_empty() {
            return Err(DiskSpecError::NoPath(s.to_string()));
        }
        let items =
            api_types::options::items(options).map_err(|source| DiskSpecError::Options {
                spec: s.to_string(),
                source,
            })?;
        let mut disk = Self {
            path: PathBuf::from(path),
            cow_dir: None,
            keep: false,
            rate_limit: None,
        };
        let mut limit = Vec::new();
        for item in items {
            match (item.key, item.value) {
                ("keep", None) => disk.keep = true,
                ("cow", Some(dir)) if !dir.is_empty() => disk.cow_dir = Some(PathBuf::from(dir)),
                ("bytes" | "ops", Some(v)) => limit.push(format!("{}={v}", item.key)),
                (key, value) => {
                    return Err(DiskSpecError::Option {
                        spec: s.to_string(),
                        option: value.map_or_else(|| key.to_string(), |v| format!("{key}={v}")),
                    })
                }
            }
        }
        if disk.keep && disk.cow_dir.is_none() {
            return Err(DiskSpecError::KeepWithoutCow(s.to_string()));
        }
        if !limit.is_empty() {
            let limit = limit
                .join(",")
                .parse()
                .map_err(|source| DiskSpecError::RateLimit {
                    spec: s.to_string(),
                    source,
                })?;
            disk.rate_limit = Some(limit);
        }
        Ok(disk)
    }
}

/// The virtio-vsock device.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VsockConfig {
    /// The guest's CID (3 or more).
    pub cid: u64,
    /// The host-side Unix socket (a clone's is `<its control socket>.vsock`).
    pub uds_path: PathBuf,
}

/// A rate limit for a device the VM does not have.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("rate limit for the {0}, which this VM does not have")]
pub struct NoSuchDevice(pub &'static str);

impl VmConfig {
    /// Applies `limits` to the devices they name; refuses one for a missing device.
    pub fn apply_rate_limits(&mut self, limits: &CloneRateLimits) -> Result<(), NoSuchDevice> {
        if let Some(l) = limits.disk {
            if self.disks.is_empty() {
                return Err(NoSuchDevice("disk"));
            }
            for d in &mut self.disks {
                d.rate_limit = Some(l);
            }
        }
        if let Some(l) = limits.rng {
            let rng = self.rng.as_mut().ok_or(NoSuchDevice("entropy device"))?;
            rng.rate_limit = Some(l);
        }
        if let Some(l) = limits.net {
            let net = self.net.as_mut().ok_or(NoSuchDevice("network card"))?;
            net.rate_limit = Some(l);
        }
        Ok(())
    }
}

/// The virtio-net device (one card over a host tap).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NetConfig {
    /// The host tap device (created if it does not exist; a clone's is
    /// [`NetConfig::clone_tap`]).
    pub tap: String,
    /// The card's MAC address (a clone's is [`NetConfig::clone_mac`]).
    pub mac: MacAddr,
    /// Limit for each direction (None: unlimited).
    pub rate_limit: Option<devices::rate_limiter::RateLimit>,
    /// The address the guest should give the card (identity block; applied by
    /// `forkvm-clone --net`).
    pub ipv4: Option<Ipv4Cidr>,
    /// The default gateway the guest should use (identity block).
    pub gateway: Option<std::net::Ipv4Addr>,
}

impl NetConfig {
    /// The tap a clone with process id `pid` creates: `fkvm<pid>`, unique among the
    /// host's live processes and short enough for an interface name.
    pub fn clone_tap(pid: i32) -> String {
        format!("fkvm{pid}")
    }

    /// The MAC address of the clone with process id `pid`: this card's first three
    /// bytes, then the pid's low 24 bits (Linux pids are below 2^22), so no two live
    /// clones share one.
    pub fn clone_mac(&self, pid: i32) -> MacAddr {
        let p = (pid as u32).to_be_bytes();
        let m = self.mac.0;
        MacAddr([m[0], m[1], m[2], p[1], p[2], p[3]])
    }

    /// This configuration as the clone with process id `pid` uses it, with the tap and
    /// addresses its request gave (its own `fkvm<pid>` and the template's otherwise).
    pub fn for_clone(&self, pid: i32, own: &CloneNetSpec) -> Self {
        let addresses = own.addresses.as_ref();
        Self {
            tap: own.tap.clone().unwrap_or_else(|| Self::clone_tap(pid)),
            mac: self.clone_mac(pid),
            rate_limit: self.rate_limit,
            ipv4: addresses.map_or(self.ipv4, |a| Some(a.ipv4)),
            gateway: addresses.map_or(self.gateway, |a| a.gateway),
        }
    }

    /// What the identity block tells the guest about this card.
    pub fn identity(&self) -> devices::identity::NetIdentity {
        devices::identity::NetIdentity {
            mac: self.mac.0,
            ipv4: self.ipv4.map(|c| (c.addr, c.prefix)),
            gateway: self.gateway,
        }
    }
}

/// What `POST /clones` gave one clone for its card.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct CloneNetSpec {
    /// A tap the caller made for it (`taps`), instead of one it creates.
    pub tap: Option<String>,
    /// Its guest addresses (`addresses`), instead of the template's.
    pub addresses: Option<CloneAddresses>,
}

/// A complete VM configuration.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// Kernel: ELF vmlinux (PVH entry used when present) or bzImage.
    pub kernel: PathBuf,
    /// Optional initramfs.
    pub initrd: Option<PathBuf>,
    /// Disks (virtio-blk), `/dev/vda` first.
    pub disks: Vec<DiskConfig>,
    /// Disk slots after the disks: virtio-blk devices with no medium, into which a
    /// clone request inserts images (0 to [`api_types::MAX_DISK_SLOTS`]).
    pub disk_slots: u8,
    /// Where writable slot media's overlays go: with it, the guest sees the slots as
    /// writable and a clone request may insert a writable medium (`rw:SLOT:PATH`).
    pub slot_cow_dir: Option<PathBuf>,
    /// A virtio-rng entropy device, with its optional rate limit.
    pub rng: Option<RngConfig>,
    /// A virtio-vsock device.
    pub vsock: Option<VsockConfig>,
    /// A virtio-net device.
    pub net: Option<NetConfig>,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// Number of vCPUs.
    pub vcpus: u8,
    /// Kernel command line (the VMM appends device and host-quirk switches).
    pub cmdline: String,
    /// Serial console sink.
    pub console: ConsoleSink,
    /// Control socket path.
    pub api_sock: Option<PathBuf>,
    /// Apply host-specific guest fixes (PVM: hide CPUID features, add kernel switches).
    pub host_quirks: bool,
    /// Advise transparent huge pages for guest RAM.
    pub thp: bool,
    /// Populate all guest RAM before boot.
    pub prefault: bool,
    /// How vCPUs other than 0 start.
    pub ap_boot: ApBoot,
    /// Warm clones to keep ready while the VM is paused (`cloning::warm`).
    pub warm_clones: usize,
    /// Most live clones (1 to [`MAX_LIVE_CLONES`]); requests beyond are refused (409).
    pub max_clones: usize,
    /// Most live clones of the whole tree this VM starts (1 to [`MAX_TREE_CLONES`];
    /// an original VM's, which its clones inherit: `cloning::tree`).
    pub max_tree_clones: usize,
    /// The invocation mailbox's size in MiB (0: none; docs/invoke.md).
    pub mailbox_mib: u32,
    /// A template: the VM pauses itself the first time its runtime waits for a
    /// request, and each invocation runs in a clone of it.
    pub template: bool,
    /// How long a runtime waits idle for a request before it is refreshed, in ms (0:
    /// never; `invoke`).
    pub refresh_idle_ms: u64,
    /// How far a guest timer interrupt already due when a request is delivered is
    /// moved on, in ms (0: not; `clone::timer`).
    pub tick_defer_ms: u64,
    /// Whether a template's warm clones are primed (`cloning::prime`).
    pub prime: bool,
    /// Pooled cgroups for clones (None: clones stay in the VMM's cgroup).
    pub cgroups: Option<CgroupConfig>,
    /// What a system call outside a thread's seccomp filter does (`crate::sandbox`).
    pub seccomp: jailer::seccomp::SeccompMode,
}

impl VmConfig {
    /// A configuration with defaults for everything but the kernel.
    pub fn new(kernel: PathBuf) -> Self {
        Self {
            kernel,
            initrd: None,
            disks: Vec::new(),
            disk_slots: 0,
            slot_cow_dir: None,
            rng: None,
            vsock: None,
            net: None,
            mem_mib: 128,
            vcpus: 1,
            cmdline: DEFAULT_CMDLINE.to_string(),
            console: ConsoleSink::Stdout,
            api_sock: None,
            host_quirks: true,
            thp: true,
            prefault: false,
            ap_boot: ApBoot::Sipi,
            warm_clones: 0,
            max_clones: MAX_LIVE_CLONES,
            max_tree_clones: MAX_LIVE_CLONES,
            mailbox_mib: DEFAULT_MAILBOX_MIB,
            template: false,
            refresh_idle_ms: DEFAULT_REFRESH_IDLE_MS,
            tick_defer_ms: DEFAULT_TICK_DEFER_MS,
            prime: true,
            cgroups: None,
            seccomp: jailer::seccomp::SeccompMode::KillProcess,
        }
    }
}

/// The mailbox size a VM gets unless told otherwise, in MiB.
pub const DEFAULT_MAILBOX_MIB: u32 = 4;

/// How long an idle runtime waits before it is refreshed unless told otherwise, in ms.
pub const DEFAULT_REFRESH_IDLE_MS: u64 = 0;

/// How far a due timer interrupt is deferred at a request's delivery unless told
/// otherwise, in ms.
pub const DEFAULT_TICK_DEFER_MS: u64 = 10;

/// Most `--tick-defer-ms`: a guest timer may be held back this long, not more.
pub const MAX_TICK_DEFER_MS: u64 = 1000;

impl VmConfig {
    /// Where the invocation mailbox is and how large.
    pub fn mailbox(&self) -> devices::mailbox::MailboxWindow {
        devices::mailbox::MailboxWindow::of_size(self.mailbox_mib << 20)
    }
}

/// Errors in a configuration, found before anything is created.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Timer deferral too long.
    #[error("--tick-defer-ms {0}: at most {max} ms", max = MAX_TICK_DEFER_MS)]
    TickDefer(u64),
    /// A limit of live clones out of range.
    #[error("--max-clones {0} is not 1 to {max}", max = MAX_LIVE_CLONES)]
    MaxClones(usize),
    /// A limit of a tree's live clones out of range.
    #[error("--max-tree-clones {0} is not 1 to {max}", max = MAX_TREE_CLONES)]
    MaxTreeClones(usize),
    /// Too many warm clones.
    #[error("{0} warm clones requested; at most {max} may be kept", max = MAX_WARM_CLONES)]
    WarmClones(usize),
    /// `--disk-slots` out of range.
    #[error("disk slots must be 0 to {max}, not {0}", max = api_types::MAX_DISK_SLOTS)]
    DiskSlots(u8),
    /// `--slot-cow-dir` without slots.
    #[error("--slot-cow-dir is for disk slots: give --disk-slots N too")]
    SlotCowDir,
    /// Mailbox too large, or missing for a template.
    #[error("mailbox of {0} MiB: a VM's mailbox is 1 to {max} MiB (0: none, not for a template)", max = devices::mailbox::MAX_MAILBOX_BYTES >> 20)]
    Mailbox(u32),
    /// Bad cgroup pool settings.
    #[error("cgroup classes: {0}")]
    Cgroups(String),
    /// Memory size out of range.
    #[error("memory size {0} MiB is out of range ({MIN_MEM_MIB} to {MAX_MEM_MIB} MiB)")]
    MemSize(u64),
    /// vCPU count out of range for the host or forkvm.
    #[error("{requested} vCPUs requested; this host allows 1 to {max}")]
    VcpuCount {
        /// Asked for.
        requested: u64,
        /// Most allowed here.
        max: u64,
    },
    /// More virtio devices than interrupt lines for them.
    #[error("{0} virtio devices requested; at most {max} fit", max = MAX_VIRTIO_DEVICES)]
    TooManyDevices(usize),
    /// A file given does not exist or is not a regular file.
    #[error("{what} {path}: {why}")]
    File {
        /// kernel, initrd, disk.
        what: &'static str,
        /// The path.
        path: String,
        /// What is wrong.
        why: String,
    },
}

fn check_file(what: &'static str, path: &std::path::Path) -> Result<(), ConfigError> {
    let err = |why: String| ConfigError::File {
        what,
        path: path.display().to_string(),
        why,
    };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err("not a regular file".into()));
    }
    std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    Ok(())
}

impl CgroupConfig {
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

impl VmConfig {
    /// How far a due timer interrupt is moved on at a request's delivery, in ns (0: not).
    pub fn tick_defer_ns(&self) -> u64 {
        self.tick_defer_ms.saturating_mul(1_000_000)
    }

    /// Checks sizes and files. `host_max_vcpus` is what KVM allows on this host.
    pub fn validate(&self, host_max_vcpus: usize) -> Result<(), ConfigError> {
        self.validate_restored(host_max_vcpus)?;
        check_file("kernel", &self.kernel)?;
        if let Some(p) = &self.initrd {
            check_file("initrd", p)?;
        }
        Ok(())
    }

    /// [`VmConfig::validate`] without the boot files, which a VM restored from a
    /// snapshot does not read.
    pub fn validate_restored(&self, host_max_vcpus: usize) -> Result<(), ConfigError> {
        if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&self.mem_mib) {
            return Err(ConfigError::MemSize(self.mem_mib));
        }
        let max_mailbox = (devices::mailbox::MAX_MAILBOX_BYTES >> 20) as u32;
        if self.mailbox_mib > max_mailbox || (self.template && self.mailbox_mib == 0) {
            return Err(ConfigError::Mailbox(self.mailbox_mib));
        }
        if self.warm_clones > MAX_WARM_CLONES {
            return Err(ConfigError::WarmClones(self.warm_clones));
        }
        if usize::from(self.disk_slots) > api_types::MAX_DISK_SLOTS {
            return Err(ConfigError::DiskSlots(self.disk_slots));
        }
        if self.slot_cow_dir.is_some() && self.disk_slots == 0 {
            return Err(ConfigError::SlotCowDir);
        }
        if !(1..=MAX_LIVE_CLONES).contains(&self.max_clones) {
            return Err(ConfigError::MaxClones(self.max_clones));
        }
        if !(1..=MAX_TREE_CLONES).contains(&self.max_tree_clones) {
            return Err(ConfigError::MaxTreeClones(self.max_tree_clones));
        }
        if self.tick_defer_ms > MAX_TICK_DEFER_MS {
            return Err(ConfigError::TickDefer(self.tick_defer_ms));
        }
        if let Some(c) = &self.cgroups {
            c.check().map_err(ConfigError::Cgroups)?;
        }
        let max = (host_max_vcpus as u64).min(u64::from(MAX_VCPUS));
        if self.vcpus == 0 || u64::from(self.vcpus) > max {
            return Err(ConfigError::VcpuCount {
                requested: u64::from(self.vcpus),
                max,
            });
        }
        let virtio = self.disks.len()
            + usize::from(self.rng.is_some())
            + usize::from(self.vsock.is_some())
            + usize::from(self.net.is_some());
        if virtio > MAX_VIRTIO_DEVICES {
            return Err(ConfigError::TooManyDevices(virtio));
        }
        for d in &self.disks {
            check_file("disk", &d.path)?;
            if let Some(dir) = &d.cow_dir {
                if !dir.is_dir() {
                    return Err(ConfigError::File {
                        what: "copy-on-write directory",
                        path: dir.display().to_string(),
                        why: "not a directory".into(),
                    });
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> VmConfig {
        // The test binary itself is a regular file that exists.
        VmConfig::new(std::env::current_exe().unwrap())
    }

    #[test]
    fn clones_get_their_own_mac_tap_and_addresses() {
        let mac = DEFAULT_MAC;
        let net = NetConfig {
            tap: "tap0".into(),
            mac,
            rate_limit: None,
            ipv4: Some("10.0.0.2/24".parse().unwrap()),
            gateway: None,
        };
        let a = net.for_clone(4_194_303, &CloneNetSpec::default());
        assert_eq!((a.ipv4, a.gateway), (net.ipv4, None));
        let own = CloneAddresses {
            ipv4: "10.0.0.9/24".parse().unwrap(),
            gateway: Some("10.0.0.1".parse().unwrap()),
        };
        let b = net.for_clone(
            7,
            &CloneNetSpec {
                tap: Some("given0".into()),
                addresses: Some(own),
            },
        );
        assert_eq!((b.ipv4, b.gateway), (Some(own.ipv4), own.gateway));
        assert_eq!(b.tap, "given0");
        assert_eq!(b.identity().ipv4, Some(("10.0.0.9".parse().unwrap(), 24)));
        assert_eq!(a.tap, "fkvm4194303");
        assert!(api_types::net::valid_ifname(&a.tap));
        assert_eq!(a.mac.to_string(), "06:00:ac:3f:ff:ff");
        assert_ne!(net.clone_mac(1234), net.clone_mac(1235));
    }

    #[test]
    fn per_clone_rate_limits_replace_the_templates_and_need_the_device() {
        let limit = |s: &str| Some(s.parse().unwrap());
        let mut c = cfg();
        c.rng = Some(RngConfig {
            rate_limit: limit("bytes=1K"),
        });
        let both = CloneRateLimits {
            rng: limit("bytes=2K"),
            net: limit("bytes=3K"),
            ..Default::default()
        };
        assert_eq!(
            c.clone().apply_rate_limits(&both),
            Err(NoSuchDevice("network card"))
        );
        let rng_only = CloneRateLimits {
            rng: limit("bytes=2K"),
            ..Default::default()
        };
        c.apply_rate_limits(&rng_only).unwrap();
        assert_eq!(c.rng.unwrap().rate_limit, limit("bytes=2K"));
        let disk = CloneRateLimits {
            disk: limit("ops=10"),
            ..Default::default()
        };
        assert_eq!(cfg().apply_rate_limits(&disk), Err(NoSuchDevice("disk")));
    }

    #[test]
    fn disk_specs_parse_and_bad_ones_say_why() {
        let d: DiskConfig = "a.img".parse().unwrap();
        assert_eq!(
            (d.path, d.cow_dir, d.rate_limit),
            ("a.img".into(), None, None)
        );
        let d: DiskConfig = "/x/b.img,bytes=1M,cow=/tmp,ops=10/100".parse().unwrap();
        assert!(!d.keep);
        assert_eq!(d.kept_path(1, 42), None);
        let k: DiskConfig = "/x/b.img,cow=/tmp,keep".parse().unwrap();
        assert_eq!(k.kept_path(1, 42), Some("/tmp/fkvm42-disk1.overlay".into()));
        assert_eq!(
            "a,keep".parse::<DiskConfig>(),
            Err(DiskSpecError::KeepWithoutCow("a,keep".into()))
        );
        assert_eq!(d.path, PathBuf::from("/x/b.img"));
        assert_eq!(d.cow_dir, Some("/tmp".into()));
        assert_eq!(d.rate_limit, Some("bytes=1M,ops=10/100".parse().unwrap()));
        assert_eq!(
            "".parse::<DiskConfig>(),
            Err(DiskSpecError::NoPath("".into()))
        );
        assert!(matches!(
            ",cow=/tmp".parse::<DiskConfig>(),
            Err(DiskSpecError::NoPath(_))
        ));
        for bad in ["a,cow=/t,cow=/u", "a,cow=/t,keep,keep", "a,bytes=1,bytes=2"] {
            assert!(
                matches!(
                    bad.parse::<DiskConfig>(),
                    Err(DiskSpecError::Options { .. })
                ),
                "{bad}"
            );
        }
        for (bad, option) in [
            ("a,ro", "ro"),
            ("a,cow=", "cow="),
            ("a,size=1", "size=1"),
            ("a,keep=1", "keep=1"),
        ] {
            assert_eq!(
                bad.parse::<DiskConfig>(),
                Err(DiskSpecError::Option {
                    spec: bad.into(),
                    option: option.into()
                })
            );
        }
        for bad in ["a,bytes=x", "a,ops=0"] {
            assert!(
                matches!(
                    bad.parse::<DiskConfig>(),
                    Err(DiskSpecError::RateLimit { .. })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn disks_are_checked_and_limited_together() {
        let exe = std::env::current_exe().unwrap();
        let disk = |cow: Option<&str>| DiskConfig {
            path: exe.clone(),
            cow_dir: cow.map(PathBuf::from),
            keep: false,
            rate_limit: None,
        };
        let mut c = cfg();
        c.disks = vec![disk(None), disk(Some("/tmp"))];
        assert_eq!(c.validate(8), Ok(()));
        c.disks[1].cow_dir = Some(exe.clone());
        assert!(matches!(
            c.validate(8),
            Err(ConfigError::File {
                what: "copy-on-write directory",
                ..
            })
        ));
        c.disks[1].path = "/nonexistent.img".into();
        assert!(matches!(
            c.validate(8),
            Err(ConfigError::File { what: "disk", .. })
        ));
        let max = MAX_VIRTIO_DEVICES;
        c.disks = vec![disk(None); max];
        assert_eq!(c.validate(8), Ok(()));
        c.rng = Some(RngConfig::default());
        assert_eq!(c.validate(8), Err(ConfigError::TooManyDevices(max + 1)));
        c.rng = None;
        c.disks.truncate(2);
        let limit: devices::rate_limiter::RateLimit = "ops=10".parse().unwrap();
        c.apply_rate_limits(&CloneRateLimits {
            disk: Some(limit),
            ..Default::default()
        })
        .unwrap();
        assert!(c.disks.iter().all(|d| d.rate_limit == Some(limit)));
    }

    #[test]
    fn accepts_defaults() {
        assert_eq!(cfg().validate(64), Ok(()));
    }

    #[test]
    fn rejects_bad_sizes() {
        let mut c = cfg();
        c.mem_mib = 1;
        assert_eq!(c.validate(64), Err(ConfigError::MemSize(1)));
        c.mem_mib = 128;
        c.vcpus = 0;
        assert!(matches!(c.validate(64), Err(ConfigError::VcpuCount { .. })));
        c.vcpus = 65;
        assert_eq!(
            c.validate(64),
            Err(ConfigError::VcpuCount {
                requested: 65,
                max: 64
            })
        );
    }

    #[test]
    fn rejects_missing_and_non_regular_files() {
        let mut c = cfg();
        c.kernel = "/nonexistent/vmlinux".into();
        let e = c.validate(8).unwrap_err().to_string();
        assert!(e.starts_with("kernel /nonexistent/vmlinux: "), "{e}");
        let mut c = cfg();
        c.initrd = Some("/".into());
        assert_eq!(
            c.validate(8),
            Err(ConfigError::File {
                what: "initrd",
                path: "/".into(),
                why: "not a regular file".into()
            })
        );
    }

    #[test]
    fn cgroup_classes() {
        let (name, class) = parse_cgroup_class("small:cpu=0.5,memory=64M").unwrap();
        assert_eq!(name, "small");
        assert_eq!(class.cpu_quota, Some(0.5));
        assert_eq!(parse_cgroup_class("any").unwrap().1, Default::default());
        for bad in ["", ":cpu=1", "a/b:cpu=1", "x:cpu=0", "x:gpu=1"] {
            assert!(parse_cgroup_class(bad).is_err(), "{bad} accepted");
        }
        let mut c = cfg();
        let mut cg = CgroupConfig {
            classes: vec![parse_cgroup_class("a").unwrap()],
            ..Default::default()
        };
        c.cgroups = Some(cg.clone());
        assert_eq!(c.validate(8), Ok(()));
        for bad in [
            CgroupConfig {
                classes: vec![],
                ..cg.clone()
            },
            CgroupConfig {
                classes: vec![cg.classes[0].clone(), cg.classes[0].clone()],
                ..cg.clone()
            },
            CgroupConfig {
                pool_size: 10,
                pool_max: 5,
                ..cg.clone()
            },
            CgroupConfig {
                parent: "../x".into(),
                ..cg.clone()
            },
            CgroupConfig {
                parent: "/abs".into(),
                ..cg.clone()
            },
        ] {
            c.cgroups = Some(bad.clone());
            assert!(
                matches!(c.validate(8), Err(ConfigError::Cgroups(_))),
                "{bad:?} accepted"
            );
        }
        cg.parent = "forkvm/test".into();
        c.cgroups = Some(cg);
        assert_eq!(c.validate(8), Ok(()));
    }

    #[test]
    fn console_sink_parsing() {
        assert_eq!("stdout".parse(), Ok(ConsoleSink::Stdout));
        assert_eq!("null".parse(), Ok(ConsoleSink::Null));
        assert_eq!(
            "/tmp/c.log".parse(),
            Ok(ConsoleSink::File("/tmp/c.log".into()))
        );
        assert!("".parse::<ConsoleSink>().is_err());
    }
}
