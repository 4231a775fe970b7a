//! The machine a guest sees, and what a snapshot saves of it: memory, vCPUs, how it
//! boots, its devices and the invocation mailbox. A clone's is its template's, with its
//! own card and rate limits ([`MachineConfig::apply_rate_limits`],
//! [`NetConfig::for_clone`]).

use std::path::PathBuf;

pub use api_types::net::{Ipv4Cidr, MacAddr, DEFAULT_MAC};
pub use api_types::vm::ApBoot;
use api_types::{CloneAddresses, CloneRateLimits};

/// The default kernel command line when the user gives none.
pub const DEFAULT_CMDLINE: &str = "console=ttyS0 reboot=k panic=-1";

/// The mailbox size a VM gets unless told otherwise, in MiB.
pub const DEFAULT_MAILBOX_MIB: u32 = 4;

/// The guest's machine.
#[derive(Debug, Clone)]
pub struct MachineConfig {
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
    /// Apply host-specific guest fixes (PVM: hide CPUID features, add kernel switches).
    pub host_quirks: bool,
    /// How vCPUs other than 0 start.
    pub ap_boot: ApBoot,
    /// The invocation mailbox's size in MiB (0: none; docs/invoke.md). Where it lies in
    /// guest memory is the builder's to say (`builder::mailbox`).
    pub mailbox_mib: u32,
}

impl MachineConfig {
    /// A machine with defaults for everything but the kernel: 128 MiB, one vCPU, no
    /// devices, the default command line, a mailbox of [`DEFAULT_MAILBOX_MIB`].
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
            host_quirks: true,
            ap_boot: ApBoot::Sipi,
            mailbox_mib: DEFAULT_MAILBOX_MIB,
        }
    }

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
