//! Stage 1, the request: `POST /clones` or a guest's read of the clone port is checked
//! against the VM, and each clone to make gets its [`Identity`] (id, sockets, console,
//! card, limits) and, with cgroup pools, a cgroup of its class.
//!
//! Next: a running VM is quiesced (`quiesce.rs`); a paused one reuses its captured
//! state and warm clones (`warm.rs`).

use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::sync::Arc;

use api_types::clones::CreateClonesError;
use api_types::{CloneCgroup, CloneConsole, CloneInfo, CloneNet, CloneStatus, CreateClones};
use serde::{Deserialize, Serialize};

use super::cgroups::{ClonePools, Placement, PlacementError, Taken};
use super::table::CloneTable;
use crate::config::{keep_overlays, CloneNetSpec, ConsoleSink, VmConfig};
use crate::microvm::Microvm;
use api_types::vm::VmState;
use devices::virtio::block::overlay::Overlay;

/// What a guest reads from the clone port when its request failed.
pub const CLONE_FAILED: u64 = 0xffff_ffff;
/// Longest Unix socket path (sun_path holds 108 bytes with the terminating NUL).
const MAX_SOCK_PATH: usize = 107;

/// Errors making clones. The parent keeps running (or stays paused) after any of them.
#[derive(Debug, thiserror::Error)]
pub enum CloneError {
    /// The request is wrong on its own (`CreateClones::check`): its count, or taps and
    /// addresses that do not fit it. The router refuses such bodies first; this catches
    /// in-process callers and the VMM's own requests.
    #[error(transparent)]
    Request(#[from] CreateClonesError),
    /// Too many live clones.
    #[error("{live} clones are running; at most {max} may be (--max-clones)")]
    TooMany {
        /// Live clones now.
        live: usize,
        /// The VM's limit.
        max: usize,
    },
    /// Too many live clones in the VM's whole tree.
    #[error(transparent)]
    Tree(#[from] super::tree::TreeFull),
    /// The VM is not in a state that can be cloned.
    #[error("cannot clone a VM that is {0:?}")]
    State(VmState),
    /// A virtio device's worker could not be paused.
    #[error("pausing devices failed: {0}")]
    Devices(#[from] devices::virtio::WorkerError),
    /// Pausing or capturing a vCPU failed.
    #[error("capturing vCPU state failed: {0}")]
    Vcpu(#[from] crate::vstate::vcpu::VcpuError),
    /// Reading VM state failed.
    #[error("capturing VM state failed: {0}")]
    VmState(#[from] clone::vm::VmStateError),
    /// A clone's socket path would be too long.
    #[error(
        "clone socket path {0} is longer than {MAX_SOCK_PATH} bytes; use a shorter --api-sock"
    )]
    PathTooLong(String),
    /// pipe() or fork() failed.
    #[error("cannot start a clone process: {0}")]
    Os(std::io::Error),
    /// The copy of the disk overlay for a clone could not be made.
    #[error("cannot copy the disk overlay for a clone: {0}")]
    Overlay(#[from] devices::virtio::block::overlay::OverlayError),
    /// A per-clone rate limit names a device the VM does not have.
    #[error(transparent)]
    RateLimit(crate::config::NoSuchDevice),
    /// Keeping overlays asked for a VM without a writable disk.
    #[error("keep_overlays given for clones of a VM without a writable disk")]
    NoOverlay,
    /// Taps or addresses for clones of a VM without a network card.
    #[error("taps or addresses given for clones of a VM without a network card")]
    NoCard,
    /// A medium for a disk slot the VM does not have.
    #[error("disk slot {slot} given, but the VM has {slots} (--disk-slots)")]
    NoSlot {
        /// The slot asked for.
        slot: u8,
        /// The VM's.
        slots: u8,
    },
    /// A writable medium for a VM whose slots are read-only.
    #[error(
        "disk slot {slot}'s medium is writable, but the VM's slots are read-only \
         (vmm run --slot-cow-dir DIR makes them writable through overlays)"
    )]
    ReadOnlySlots {
        /// The slot asked for.
        slot: u8,
    },
    /// A writable medium's overlay file could not be made.
    #[error("disk slot {slot}: cannot make its overlay: {source}")]
    SlotOverlay {
        /// The slot.
        slot: u8,
        /// Why.
        source: devices::virtio::block::overlay::OverlayError,
    },
    /// A slot's image cannot be opened, or is no whole number of 512-byte sectors.
    #[error("disk slot {slot}: {why}")]
    Medium {
        /// The slot.
        slot: u8,
        /// Why (the image's path in it).
        why: String,
    },
    /// No cgroup for the clone.
    #[error(transparent)]
    Cgroup(#[from] PlacementError),
    /// Every clone of the request failed before it was ready (each one's reason is
    /// in the log; this is the first's).
    #[error("no clone started: {reason}")]
    NoneStarted {
        /// Why the first failed.
        reason: String,
        /// The host error number behind it (0: none).
        errno: i32,
    },
}

impl CloneError {
    /// Whether the host ran out of something for now (space, descriptors, memory,
    /// processes): a request that may succeed later.
    pub fn host_short(&self) -> bool {
        let errno = match self {
            CloneError::Os(e) => e.raw_os_error().unwrap_or(0),
            CloneError::Overlay(e) | CloneError::SlotOverlay { source: e, .. } => {
                crate::errno::errno_of(e)
            }
            CloneError::NoneStarted { errno, .. } => *errno,
            _ => 0,
        };
        matches!(
            errno,
            libc::ENOSPC | libc::EDQUOT | libc::EMFILE | libc::ENFILE | libc::ENOMEM | libc::EAGAIN
        )
    }
}

/// What a clone is told about itself when it is launched.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Identity {
    /// Clone id.
    pub id: String,
    /// Its control socket.
    pub api_sock: PathBuf,
    /// Its console sink.
    pub console: PathBuf,
    /// Its vsock socket (with a vsock device).
    pub vsock: Option<PathBuf>,
    /// Rate limits replacing the template's (checked against its devices).
    #[serde(default)]
    pub rate_limits: api_types::CloneRateLimits,
    /// Its own tap and guest addresses (None: its own new tap, the template's addresses).
    #[serde(default)]
    pub net: CloneNetSpec,
    /// Whether it keeps its writable disks' overlays (None: as its template's disks).
    #[serde(default)]
    pub keep_overlays: Option<bool>,
    /// The vCPU that read the clone port, and the value it reads in this clone.
    pub guest_result: Option<(u8, u64)>,
    /// The cgroup it moves itself into before running guest code.
    pub cgroup: Option<Placement>,
    /// The resource class its request named, with cgroup pools: the default class of
    /// its own pools should it become a template (`derive`), so that its requests,
    /// which name that class, are served by its warm clones.
    #[serde(default)]
    pub class: Option<String>,
    /// What a layer above tells the clone it hands something over to ([`Handover`]).
    #[serde(default)]
    pub note: Option<serde_json::Value>,
    /// A timer interrupt already due in its vCPUs' state is moved this far on (0: none).
    #[serde(default)]
    pub defer_timer_ns: u64,
    /// Whether it reports the guest pages it wrote to its template once it answered
    /// (`working.rs`).
    #[serde(default)]
    pub record_working_set: bool,
    /// The handover's payload and stream: inherited by a clone forked now, sent after
    /// the identity to a warm clone.
    #[serde(skip)]
    pub carried: Option<Arc<Carried>>,
    /// The images it inserts into its disk slots: slot, path and whether it is
    /// writable.
    #[serde(default)]
    pub media: Vec<(u8, PathBuf, bool)>,
    /// Those images, open in the same order: inherited by a clone forked now, sent with
    /// the launch message to a warm clone.
    #[serde(skip)]
    pub media_files: Vec<Arc<std::fs::File>>,
    /// The writable ones' overlay files (empty, anonymous, made by the template in
    /// its slot overlay directory), this clone's own, in the same order; sent after
    /// the images.
    #[serde(skip)]
    pub overlay_files: Vec<Arc<std::fs::File>>,
    /// The write end of a new ready pipe, sent first with the launch message to a
    /// rewound clone (its first launch used the pipe it inherited): `ready_attached`
    /// says it was sent.
    #[serde(skip)]
    pub ready: Option<Arc<std::fs::File>>,
    /// Whether `ready` travels with the launch message.
    #[serde(default)]
    pub ready_attached: bool,
    /// A fork source's end of its channel to its template (`sources.rs`): the clone is
    /// a template of its own from its start. Inherited: a source is always forked.
    #[serde(skip)]
    pub source: Option<Arc<std::os::fd::OwnedFd>>,
}

/// A handover's payload and stream, on their way to a clone.
#[derive(Debug)]
pub(crate) struct Carried {
    /// The payload.
    pub payload: Vec<u8>,
    /// The stream.
    pub stream: Arc<UnixStream>,
}

/// What a layer above hands one clone (the invocation layer: a request, its payload and
/// the caller's connection), opaque to cloning: the clone is told `note` (in its
/// identity, as JSON), its parked vCPU's port read returns `guest_result`, a timer
/// interrupt already due is deferred by `defer_timer_ns`, and `payload` and `stream`
/// travel after its identity. In the child, the hooks' `take`
/// (`child::CloneHooks`) takes them up before its vCPUs run. The template keeps the
/// stream until the clone is reaped: one that ended without a word leaves it to the
/// template ([`super::Cloner::take_orphans`]).
#[derive(Debug)]
pub struct Handover {
    /// What the clone is told.
    pub note: serde_json::Value,
    /// The parked vCPU, and what its port read returns in the clone.
    pub guest_result: (u8, u64),
    /// How far a timer interrupt already due is moved on, in ns (0: not at all).
    pub defer_timer_ns: u64,
    /// Bytes for the clone.
    pub payload: Vec<u8>,
    /// A stream for the clone (whose other end the caller holds).
    pub stream: Arc<UnixStream>,
}

/// A clone about to be made: its identity and its cgroup (with cgroup pools).
pub(super) type NewClone = (Identity, Option<Taken>);

/// Checks `req` against the VM and its live clones.
pub(super) fn check(
    vm: &Microvm,
    table: &CloneTable,
    req: &CreateClones,
) -> Result<(), CloneError> {
    req.check()?;
    let count = req.count;
    if !matches!(vm.state(), VmState::Running | VmState::Paused) {
        return Err(CloneError::State(vm.state()));
    }
    let live = table.live().count();
    let max = vm.config().clones.max_clones;
    if live + count as usize > max {
        return Err(CloneError::TooMany { live, max });
    }
    let config = vm.config();
    if !(req.addresses.is_empty() && req.taps.is_empty()) && config.machine.net.is_none() {
        return Err(CloneError::NoCard);
    }
    if req.keep_overlays == Some(true) && config.machine.disks.iter().all(|d| d.cow_dir.is_none()) {
        return Err(CloneError::NoOverlay);
    }
    if let Some(m) = req
        .media
        .iter()
        .find(|m| m.slot >= config.machine.disk_slots)
    {
        return Err(CloneError::NoSlot {
            slot: m.slot,
            slots: config.machine.disk_slots,
        });
    }
    if config.machine.slot_cow_dir.is_none() {
        if let Some(m) = req.media.iter().find(|m| m.writable) {
            return Err(CloneError::ReadOnlySlots { slot: m.slot });
        }
    }
    config
        .clone()
        .machine
        .apply_rate_limits(&req.rate_limits)
        .map_err(CloneError::RateLimit)
}

/// A slot's image, opened read-only by the template (so a missing or unreadable one is
/// the request's error, before any clone exists), of whole 512-byte sectors.
fn open_medium(m: &api_types::InsertMedium) -> Result<std::fs::File, CloneError> {
    crate::device_manager::open_image(&m.path)
        .map_err(|why| CloneError::Medium { slot: m.slot, why })
}

/// The slot and size of each writable one of `media` (open as `files`), in order.
fn writable_sizes(
    media: &[api_types::InsertMedium],
    files: &[Arc<std::fs::File>],
) -> Result<Vec<(u8, u64)>, CloneError> {
    (media.iter().zip(files))
        .filter(|(m, _)| m.writable)
        .map(|(m, f)| {
            let meta = f.metadata().map_err(|e| CloneError::Medium {
                slot: m.slot,
                why: e.to_string(),
            })?;
            Ok((m.slot, meta.len()))
        })
        .collect()
}

/// One clone's overlay files for the `writable` media (slot and size): empty anonymous
/// files of each image's size in the VM's slot overlay directory.
fn overlay_files(
    config: &VmConfig,
    writable: &[(u8, u64)],
) -> Result<Vec<Arc<std::fs::File>>, CloneError> {
    let (Some(dir), false) = (&config.machine.slot_cow_dir, writable.is_empty()) else {
        return Ok(Vec::new());
    };
    (writable.iter())
        .map(|&(slot, size)| {
            let file = Overlay::new_spare(dir, size)
                .map_err(|source| CloneError::SlotOverlay { slot, source })?;
            Ok(Arc::new(file))
        })
        .collect()
}

/// Where clone files go: the control socket path, or a per-process one.
fn clone_base(config: &VmConfig) -> PathBuf {
    config
        .host
        .api_sock
        .clone()
        .unwrap_or_else(|| std::env::temp_dir().join(format!("forkvm-{}.sock", std::process::id())))
}

/// The identities of the `req.count` clones to make: clone `n` of a VM whose id is
/// `clone_id` ("" for an original) that has made `made` clones so far is
/// `<clone_id>.<made + n>`, with its socket at `<api sock>.<made + n>`. `requester` is
/// the parked vCPU of a guest request: each clone's copy reads its sequence number.
pub(super) fn identities(
    config: &VmConfig,
    clone_id: &str,
    made: u32,
    req: &CreateClones,
    requester: Option<u8>,
) -> Result<Vec<Identity>, CloneError> {
    let base = clone_base(config);
    let media_files = (req.media.iter())
        .map(|m| open_medium(m).map(Arc::new))
        .collect::<Result<Vec<_>, _>>()?;
    let media: Vec<(u8, PathBuf, bool)> = (req.media.iter())
        .map(|m| (m.slot, m.path.clone(), m.writable))
        .collect();
    let writable = writable_sizes(&req.media, &media_files)?;
    let mut identities = Vec::with_capacity(req.count as usize);
    for n in 0..req.count as u32 {
        let seq = made + n + 1;
        let id = match clone_id {
            "" => seq.to_string(),
            parent => format!("{parent}.{seq}"),
        };
        let sock = PathBuf::from(format!("{}.{seq}", base.display()));
        let vsock = (config.machine.vsock.as_ref())
            .map(|_| PathBuf::from(format!("{}.vsock", sock.display())));
        for p in std::iter::once(&sock).chain(vsock.as_ref()) {
            if p.as_os_str().len() > MAX_SOCK_PATH {
                return Err(CloneError::PathTooLong(p.display().to_string()));
            }
        }
        let console = match (&config.host.console, req.console) {
            (ConsoleSink::Null, _) | (_, CloneConsole::Null) => PathBuf::from("/dev/null"),
            _ => PathBuf::from(format!("{}.console", sock.display())),
        };
        identities.push(Identity {
            id,
            api_sock: sock,
            console,
            vsock,
            rate_limits: req.rate_limits,
            net: CloneNetSpec {
                tap: req.taps.get(n as usize).cloned(),
                addresses: req.addresses.get(n as usize).copied(),
            },
            keep_overlays: req.keep_overlays,
            guest_result: requester.map(|v| (v, u64::from(seq))),
            cgroup: None,
            class: None,
            note: None,
            defer_timer_ns: 0,
            record_working_set: false,
            carried: None,
            media: media.clone(),
            media_files: media_files.clone(),
            overlay_files: overlay_files(config, &writable)?,
            ready: None,
            ready_attached: false,
            source: None,
        });
    }
    Ok(identities)
}

/// Pairs each identity with a cgroup from the pool of `class` (none without pools).
/// The first may be the forker's seat (v1): born inside its cgroup.
pub(super) fn take_cgroups(
    pools: Option<&ClonePools>,
    identities: Vec<Identity>,
    class: Option<&str>,
) -> Result<Vec<NewClone>, CloneError> {
    let Some(pools) = pools else {
        if let Some(c) = class {
            return Err(PlacementError::NoPools(c.to_string()).into());
        }
        return Ok(identities.into_iter().map(|i| (i, None)).collect());
    };
    let mut clones: Vec<NewClone> = Vec::with_capacity(identities.len());
    for mut identity in identities {
        identity.class = class.map(str::to_string);
        let seat = clones.is_empty().then(|| pools.take_seat(class)).flatten();
        match seat.map_or_else(|| pools.take(class), Ok) {
            Ok(t) => clones.push((identity, Some(t))),
            Err(e) => {
                give_back(Some(pools), clones.into_iter().map(|(_, t)| t));
                return Err(e.into());
            }
        }
    }
    Ok(clones)
}

/// Returns the cgroups of clones that were not started.
pub(super) fn give_back(
    pools: Option<&ClonePools>,
    taken: impl IntoIterator<Item = Option<Taken>>,
) {
    if let Some(pools) = pools {
        taken.into_iter().flatten().for_each(|t| pools.give_back(t));
    }
}

/// The record of a clone just forked or launched, not yet known to run.
pub(super) fn starting_info(
    identity: Identity,
    pid: i32,
    cgroup: Option<CloneCgroup>,
    template: &VmConfig,
) -> CloneInfo {
    let net = (template.machine.net.as_ref()).map(|n| n.for_clone(pid, &identity.net));
    let kept_overlays = keep_overlays(&template.machine.disks, identity.keep_overlays)
        .iter()
        .enumerate()
        .filter_map(|(i, d)| d.kept_path(i, pid))
        .collect();
    CloneInfo {
        id: identity.id,
        pid,
        api_sock: identity.api_sock,
        console: identity.console,
        vsock: identity.vsock,
        net: net.map(|n| CloneNet {
            tap: n.tap,
            mac: n.mac,
            ipv4: n.ipv4,
            gateway: n.gateway,
        }),
        kept_overlays,
        latency_us: None,
        status: CloneStatus::Failed,
        error: None,
        cgroup,
    }
}
