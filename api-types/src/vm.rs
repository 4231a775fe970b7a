//! The VM as a whole: its lifecycle state, `GET /vm`, `PATCH /vm` and `PUT /actions`.

use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::cgroup::CgroupsReport;
use crate::net::MacAddr;
use crate::rate_limit::RateLimit;

/// Lifecycle states.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum VmState {
    /// vCPUs run guest code.
    Running,
    /// vCPUs are parked outside KVM_RUN; memory and devices keep their state.
    Paused,
    /// Stopping for good.
    Stopped,
}

impl VmState {
    /// Whether the lifecycle allows going from `self` to `to`.
    pub fn valid_transition(self, to: VmState) -> bool {
        matches!(
            (self, to),
            (VmState::Running, VmState::Paused)
                | (VmState::Paused, VmState::Running)
                | (VmState::Running, VmState::Stopped)
                | (VmState::Paused, VmState::Stopped)
        )
    }
}

/// States a user may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum TargetState {
    /// Stop running guest code (memory and devices stay).
    Paused,
    /// Run again.
    Running,
}

impl From<TargetState> for VmState {
    fn from(t: TargetState) -> Self {
        match t {
            TargetState::Paused => VmState::Paused,
            TargetState::Running => VmState::Running,
        }
    }
}

/// `PATCH /vm`: pause or resume.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct VmUpdate {
    /// The state to go to.
    pub state: TargetState,
}

/// What `PUT /actions` can do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ActionType {
    /// Stop the VM; the VMM exits with status 0.
    Shutdown,
}

/// `PUT /actions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct Action {
    /// What to do.
    pub action_type: ActionType,
}

/// How application processors (vCPUs other than 0) start.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum ApBoot {
    /// They wait for INIT/SIPI from the boot vCPU, as on real hardware (Linux).
    Sipi,
    /// The VMM starts every vCPU at the kernel entry itself (guests that expect it, such
    /// as forkvm's tiny test guest).
    Direct,
}

/// What provides /dev/kvm.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum HostKind {
    /// Hardware virtualization (VT-x or AMD-V).
    Hardware,
    /// PVM, a software hypervisor on top of KVM (module `kvm_pvm`).
    Pvm,
}

/// Whether transparent huge pages were advised, and how the mappings are aligned.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct MemoryInfo {
    /// MADV_HUGEPAGE succeeded on every region.
    pub thp_advised: bool,
    /// Every region starts on a 2 MiB host boundary (needed for huge pages to be used).
    pub huge_aligned: bool,
}

/// How the host was handled.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct HostReport {
    /// What provides KVM.
    pub kvm: HostKind,
    /// Whether host quirks were applied.
    pub quirks_applied: bool,
    /// CPUID features hidden from the guest.
    pub hidden_cpuid: Vec<String>,
    /// Kernel switches the VMM added.
    pub kernel_switches: String,
    /// MSRs the host refused at boot.
    pub skipped_msrs: Vec<u32>,
    /// Guest memory backing.
    pub memory: MemoryInfo,
}

/// The warm-clone pool, in `GET /vm`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct WarmReport {
    /// Kept ready while the VM is paused.
    pub target: usize,
    /// Forked and waiting now, ready to launch (a primed one once its prime is done).
    pub ready: usize,
    /// Launched on requests so far.
    pub launched: u64,
    /// Discarded unused so far (the template resumed or changed).
    pub discarded: u64,
    /// Whether warm clones made now are primed: the template's runtime waits and
    /// declared it handles prime requests, `--no-prime` was not given, and no primed
    /// warm clone has died before its launch (docs/invoke.md).
    #[serde(default)]
    pub priming: bool,
    /// Warm clones forked to be primed so far.
    #[serde(default)]
    pub primed: u64,
}

/// The live clones of a VM's whole tree (its original, every clone, their clones), in
/// `GET /vm`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct TreeReport {
    /// Slots taken: the tree's live clones, those being made, and those that ended
    /// without their parent reaping them (their parent was killed first) until a
    /// request that finds the tree full frees theirs.
    pub taken: usize,
    /// At most this many (`--max-tree-clones` of the original VM).
    pub max: usize,
}

/// The probe port's counters (forkvm's test guests write it), in `GET /vm`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ProbeReport {
    /// Writes so far.
    pub writes: u64,
    /// The last value written.
    pub last: u32,
    /// Host CLOCK_MONOTONIC (ns) of the first write, 0 before any.
    pub first_write_ns: u64,
}

/// One virtio device, in `GET /vm`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct VirtioDeviceInfo {
    /// Base of its virtio-mmio registers, `0x...`.
    pub mmio_base: String,
    /// Its interrupt line.
    pub gsi: u32,
    /// Whether the guest's driver started it.
    pub active: bool,
    /// Its type and settings.
    #[serde(flatten)]
    pub kind: VirtioKind,
    /// Its rate limiters' counters since the device was made (a clone's: since its
    /// launch), when it has a limit: `rx` and `tx` for virtio-net, `requests` for
    /// virtio-blk and virtio-rng.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rate_limiters: Vec<LimiterReport>,
}

/// A rate limiter's counters, in `GET /vm`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct LimiterReport {
    /// Which one: `rx` (host to guest) or `tx` (guest to host) for a network card;
    /// `requests` for a disk or an entropy device (its one queue).
    pub name: String,
    /// Bytes it let through.
    pub passed_bytes: u64,
    /// Requests (frames) it held back for want of tokens.
    pub throttled: u64,
    /// Time those requests waited, in ms (a request still waiting is counted once it
    /// goes).
    pub throttled_ms: u64,
    /// Tokens (bytes) its bandwidth bucket could not hold because it was full and no
    /// request waited: rate the device had nothing to use for (an idle card loses them
    /// all the time; a sender too slow to keep up loses them while it catches up).
    /// 0 for a limit of requests only (`ops=`), as `late_bytes`.
    pub unused_bytes: u64,
    /// Tokens lost while a request waited: the worker came late to its timer (a host
    /// short of CPU), and the bucket filled meanwhile. Over any span, what passed plus
    /// what was unused and late, less what the bucket gained, is the rate times the span.
    pub late_bytes: u64,
}

/// A virtio device's type (`type`) and settings.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(tag = "type")]
pub enum VirtioKind {
    /// A disk.
    #[serde(rename = "virtio-blk")]
    Block {
        /// The image.
        path: PathBuf,
        /// Whether the guest's writes are refused (no overlay).
        read_only: bool,
        /// Where its copy-on-write overlay files go.
        cow_dir: Option<PathBuf>,
        /// Whether a VM that ends keeps its overlay.
        keep: bool,
        /// Its rate limit.
        rate_limit: Option<RateLimit>,
    },
    /// A disk slot (`--disk-slots`): a disk with no medium, or, in a clone, the image
    /// its request inserted.
    #[serde(rename = "virtio-blk-slot")]
    Slot {
        /// The slot (0 for the first).
        slot: u8,
        /// The image in it (None: empty).
        medium: Option<PathBuf>,
        /// Whether the guest writes to it (into an overlay of this VM's own).
        #[serde(default)]
        writable: bool,
    },
    /// The entropy device.
    #[serde(rename = "virtio-rng")]
    Rng {
        /// Its rate limit.
        rate_limit: Option<RateLimit>,
    },
    /// The socket device.
    #[serde(rename = "virtio-vsock")]
    Vsock {
        /// The guest's CID.
        cid: u64,
        /// The host side's Unix socket.
        uds_path: PathBuf,
    },
    /// The network card.
    #[serde(rename = "virtio-net")]
    Net {
        /// The host tap.
        tap: String,
        /// The card's MAC address.
        mac: MacAddr,
        /// Its rate limit, each direction.
        rate_limit: Option<RateLimit>,
    },
}

/// `GET /vm`: the VM's state and configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct VmInfo {
    /// Lifecycle state.
    pub state: VmState,
    /// vCPUs.
    pub vcpus: u8,
    /// Guest memory, MiB.
    pub memory_mib: u64,
    /// The kernel image.
    pub kernel: String,
    /// The whole command line the guest got.
    pub cmdline: String,
    /// How vCPUs other than 0 started.
    pub ap_boot: ApBoot,
    /// Milliseconds since this VM (or clone) started running.
    pub uptime_ms: u64,
    /// This VM's clone id: "" for an original, "2", "2.1", ... for clones.
    pub clone_id: String,
    /// Warm clones.
    pub warm_clones: WarmReport,
    /// Invocations: the mailbox, whether a runtime waits.
    pub invoke: crate::invoke::InvokeReport,
    /// Cgroup pools for clones (None: none).
    pub cgroups: Option<CgroupsReport>,
    /// The live clones of this VM's whole tree (`--max-tree-clones`).
    #[serde(default)]
    pub clone_tree: TreeReport,
    /// The host.
    pub host: HostReport,
    /// Virtio devices, in bus order.
    pub devices: Vec<VirtioDeviceInfo>,
    /// The probe port.
    pub probe: ProbeReport,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifecycle_transitions() {
        use VmState::*;
        assert!(Running.valid_transition(Paused));
        assert!(Paused.valid_transition(Running));
        assert!(!Running.valid_transition(Running));
        assert!(!Paused.valid_transition(Paused));
        assert!(!Stopped.valid_transition(Running));
        assert!(Paused.valid_transition(Stopped));
    }

    #[test]
    fn devices_show_their_type_beside_the_common_fields() {
        let d = VirtioDeviceInfo {
            mmio_base: "0xd0000000".into(),
            gsi: 5,
            active: false,
            kind: VirtioKind::Vsock {
                cid: 3,
                uds_path: "/tmp/v.sock".into(),
            },
            rate_limiters: Vec::new(),
        };
        let v = serde_json::to_value(&d).unwrap();
        assert_eq!(v["type"], "virtio-vsock");
        assert_eq!(v["cid"], 3);
        assert_eq!(serde_json::from_value::<VirtioDeviceInfo>(v).unwrap(), d);
    }
}
