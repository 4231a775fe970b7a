//! Snapshots: a paused VM saved to a directory ([`save`]), and a VM rebuilt from one
//! in a new process ([`open`], then [`Restoring::start`]) on this host or another
//! (docs/snapshots.md).
//!
//! A snapshot directory holds:
//!
//! | file | what |
//! |------|------|
//! | `state` | [`SnapshotFile`] in a versioned, checksummed state file (`clone::state_file`): vCPUs, VM, every device through `Persist`, the VM's configuration, the memory file's layout |
//! | `memory` | guest memory, a sparse file holding only the pages that are not zeros (`vstate::memory_file`) |
//! | `disk<N>.overlay`, `disk<N>.blocks` | each writable disk's copy-on-write overlay and its block map |
//!
//! Every file is created owner-only (0600) in a directory made owner-only (0700): they
//! hold guest memory, secrets included. A snapshot is written into a temporary
//! directory beside the one asked for and renamed into place once complete, so a
//! directory of that name is always a whole snapshot.
//!
//! A restore maps `memory` `MAP_PRIVATE` (pages come from the page cache on first touch,
//! shared by every VM restored from the file; a guest's writes are its own), checks
//! that the host offers every CPUID feature and MSR the guest saw, rebuilds the VM with
//! the clone path's steps, reseeds the guest kernel's RNG and gives the VM a new
//! identity generation, as a clone gets.

mod restore;
mod save;

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use api_types::vm::{ApBoot, HostReport};
use api_types::{Ipv4Cidr, MacAddr, RateLimit};
use clone::MicrovmState;

use crate::vstate::memory_file::MemoryFileLayout;

pub use restore::{open, restored_config, RestoreError, RestoreOptions, Restoring};
pub use save::{save, SaveError};

/// Why `PUT /snapshot` was refused or failed.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// Only a paused VM's state holds still.
    #[error("only a paused VM can be snapshotted (pause it first: PATCH /vm)")]
    NotPaused,
    /// A vCPU event came in before the pause and is not handled yet.
    #[error("the VM has vCPU events to handle first; try again")]
    EventsPending,
    /// The VM's state could not be captured.
    #[error(transparent)]
    Capture(#[from] crate::cloning::CloneError),
    /// The snapshot could not be written.
    #[error(transparent)]
    Save(#[from] SaveError),
}

/// The state file's name in a snapshot directory.
pub const STATE_FILE: &str = "state";
/// The memory file's name in a snapshot directory.
pub const MEMORY_FILE: &str = "memory";

/// The name of disk `index`'s overlay in a snapshot directory (its block map has the
/// extension `blocks`).
pub fn overlay_file(index: usize) -> String {
    format!("disk{index}.overlay")
}

/// What a snapshot's state file holds.
#[derive(Clone, Serialize, Deserialize)]
pub struct SnapshotFile {
    /// The forkvm version that wrote it (for people; the state file's format version is
    /// what a restore checks).
    pub forkvm: String,
    /// The VM's configuration, as far as the guest sees it.
    pub config: SavedConfig,
    /// The whole command line the guest booted with.
    pub cmdline: String,
    /// How the host was handled when the VM was built (the CPUID features hidden stay
    /// hidden: the guest's CPUID is saved with each vCPU).
    pub host: HostReport,
    /// Where each memory region is in the memory file.
    pub memory: MemoryFileLayout,
    /// vCPUs, VM and devices.
    pub state: MicrovmState,
}

/// The parts of a VM's configuration the guest sees, which a restore keeps. What is
/// the host's (sockets, console, tap name, cgroups, warm clones) comes from the restore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedConfig {
    /// The kernel it booted (for people: a restore does not read it).
    pub kernel: PathBuf,
    /// Guest memory in MiB.
    pub mem_mib: u64,
    /// vCPUs.
    pub vcpus: u8,
    /// How vCPUs other than 0 started.
    pub ap_boot: ApBoot,
    /// The command line the user gave (`cmdline` above is the whole one).
    pub user_cmdline: String,
    /// Host quirks were applied.
    pub host_quirks: bool,
    /// The invocation mailbox in MiB.
    pub mailbox_mib: u32,
    /// A template (docs/invoke.md).
    pub template: bool,
    /// `--refresh-idle-ms`.
    pub refresh_idle_ms: u64,
    /// `--tick-defer-ms`.
    pub tick_defer_ms: u64,
    /// Warm clones are primed.
    pub prime: bool,
    /// The disks, in device order.
    pub disks: Vec<SavedDisk>,
    /// Disk slots after them.
    #[serde(default)]
    pub disk_slots: u8,
    /// Their overlay directory (writable slots).
    #[serde(default)]
    pub slot_cow_dir: Option<std::path::PathBuf>,
    /// The images in the slots when the snapshot was taken, in slot order (None:
    /// empty). Absent in snapshots made before they were saved (no media then).
    #[serde(default)]
    pub slot_media: Vec<Option<SavedMedium>>,
    /// The entropy device.
    pub rng: Option<SavedRng>,
    /// The vsock device's guest CID.
    pub vsock_cid: Option<u64>,
    /// The network card.
    pub net: Option<SavedNet>,
}

/// An image in a disk slot, in a snapshot: opened again at restore, unchanged; a
/// writable one's overlay is saved as the slot's (`disk<N>.overlay`, N counting the
/// disks first).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedMedium {
    /// The image.
    pub path: PathBuf,
    /// Its size and modification time then: a restore refuses an image that differs.
    pub image: ImageVersion,
    /// It was inserted writable (its overlay is in the snapshot).
    pub writable: bool,
}

/// A disk in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedDisk {
    /// The image (opened again, read-only, at restore; it must be unchanged).
    pub path: PathBuf,
    /// The image's size and modification time when the snapshot was made: a restore
    /// refuses an image that differs (the guest's page cache holds its blocks as they
    /// were). Absent in snapshots made before it was saved (not checked then).
    #[serde(default)]
    pub image: Option<ImageVersion>,
    /// Where its overlay was made (writable disks): a restore's default.
    pub cow_dir: Option<PathBuf>,
    /// Every VM with the disk keeps its overlay when it ends (`--disk ...,keep`): so
    /// does a restored one and its clones. Absent in snapshots made before it was saved
    /// (none kept then).
    #[serde(default)]
    pub keep: bool,
    /// Its limit.
    pub rate_limit: Option<RateLimit>,
}

/// What identifies a version of a disk image: its size and modification time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImageVersion {
    /// Its size in bytes.
    pub len: u64,
    /// Its modification time, in ns since the epoch.
    pub mtime_ns: i128,
}

impl ImageVersion {
    /// The version of the file `meta` describes.
    pub fn of(meta: &std::fs::Metadata) -> Self {
        use std::os::unix::fs::MetadataExt;
        Self {
            len: meta.len(),
            mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        }
    }
}

/// The entropy device in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedRng {
    /// Its limit.
    pub rate_limit: Option<RateLimit>,
}

/// The network card in a snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SavedNet {
    /// The tap it used (a restore's default).
    pub tap: String,
    /// Its MAC address (the guest's driver holds it).
    pub mac: MacAddr,
    /// Its limit.
    pub rate_limit: Option<RateLimit>,
    /// The address the identity block gives the guest.
    pub ipv4: Option<Ipv4Cidr>,
    /// The gateway the identity block gives the guest.
    pub gateway: Option<std::net::Ipv4Addr>,
}
