//! Rebuilding a VM from a snapshot directory in this process: the state file read and
//! checked, the host checked against the guest's CPU, memory mapped from the memory
//! file, then the steps every rebuilt VM takes (`builder::rebuild`: a VM on that memory and
//! its vCPUs restored; devices restored, the guest kernel's RNG reseeded, the VM-wide state,
//! the vCPU threads started, the devices' host sides opened).
//!
//! Every check that can fail on a bad snapshot comes before anything is created: a
//! restore that fails leaves no VM, thread, socket, tap or file behind (the process
//! that tried ends with the error).

use std::fs::File;
use std::mem::ManuallyDrop;
use std::os::fd::{IntoRawFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use api_types::vm::{HostReport, MemoryInfo};
use devices::virtio::block::overlay::{OverlayError, OverlaySnapshot};
use jailer::seccomp::SeccompMode;
use kvm_bindings::CpuId;

use super::{overlay_file, ImageVersion, SavedConfig, SnapshotFile, MEMORY_FILE, STATE_FILE};
use crate::arch::x86_64::cpu_compat::{missing_features, missing_msrs};
use crate::arch::x86_64::layout::ram_ranges;
use crate::builder::capture_spec;
use crate::builder::rebuild::{prepare, start_rebuilt, RebuildError, StartFrom};
use crate::config::{CgroupConfig, ConsoleSink, DiskConfig, NetConfig, RngConfig, VmConfig};
use crate::config::{
    ClonePolicy, ConfigError, HostPolicy, InvokePolicy, MachineConfig, VsockConfig,
};
use crate::device_manager::DeviceError;
use crate::logging::StageTimer;
use crate::microvm::VmParts;
use crate::vstate::kvm::{HostKind, KvmContext, KvmError};
use crate::vstate::memory_file::{map_memory_file, MemoryFileError};

/// What the host gives a restored VM (the guest's side comes from the snapshot).
#[derive(Debug, Clone)]
pub struct RestoreOptions {
    /// The snapshot directory.
    pub dir: PathBuf,
    /// Its control socket.
    pub api_sock: Option<PathBuf>,
    /// Where its serial console goes.
    pub console: ConsoleSink,
    /// Keep it paused (a template for clones) instead of running it.
    pub paused: bool,
    /// Warm clones to keep while paused.
    pub warm_clones: usize,
    /// Most live clones.
    pub max_clones: usize,
    /// Most live clones of its whole tree.
    pub max_tree_clones: usize,
    /// The most of its working set its warm clones write ahead, in MiB (0: none).
    pub working_set_mib: u64,
    /// Pooled cgroups for its clones.
    pub cgroups: Option<CgroupConfig>,
    /// Seccomp mode.
    pub seccomp: SeccompMode,
    /// The tap of its network card (default: the snapshot's).
    pub tap: Option<String>,
    /// The host side of its vsock device (default: `<api_sock>.vsock`).
    pub vsock: Option<PathBuf>,
    /// Where writable disks' and slots' overlays go (default: where the snapshot's
    /// were).
    pub cow_dir: Option<PathBuf>,
    /// Rewind its invocation clones instead of ending them (`--rewind`).
    pub rewind: bool,
    /// Its fork sources, itself included (`--fork-sources`; a template's).
    pub fork_sources: usize,
}

/// Why a snapshot could not be restored.
#[derive(Debug, thiserror::Error)]
pub enum RestoreError {
    /// The state file is missing, truncated, corrupted, of an unknown version, or not
    /// a snapshot's.
    #[error(transparent)]
    State(#[from] clone::state_file::StateFileError),
    /// The memory file is missing or not the snapshot's.
    #[error(transparent)]
    Memory(#[from] MemoryFileError),
    /// The snapshot's parts do not fit together.
    #[error("snapshot {dir}: {why}")]
    Mismatch {
        /// The snapshot.
        dir: String,
        /// What does not fit.
        why: String,
    },
    /// The host lacks CPU features or MSRs the guest saw.
    #[error("this host cannot run the snapshot's guest: {0}")]
    Cpu(String),
    /// The restore options do not fit the snapshot.
    #[error("{0}")]
    Options(String),
    /// The configuration is refused.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// A writable disk's overlay could not be taken up.
    #[error(transparent)]
    Overlay(#[from] OverlayError),
    /// A disk image could not be opened.
    #[error("cannot open disk image {path}: {source}")]
    Disk {
        /// The image.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A disk image is not the version the snapshot was made with.
    #[error(
        "disk image {path} changed since the snapshot was made ({} bytes, modified at \
         {} ns then; {} bytes, modified at {} ns now): its guest holds the image's blocks \
         as they were, so it is not restored",
        saved.len, saved.mtime_ns, now.len, now.mtime_ns
    )]
    DiskChanged {
        /// The image.
        path: String,
        /// Its version when the snapshot was made.
        saved: ImageVersion,
        /// Its version now.
        now: ImageVersion,
    },
    /// KVM failed.
    #[error(transparent)]
    Kvm(#[from] KvmError),
    /// The VM or its vCPUs could not be rebuilt.
    #[error(transparent)]
    Rebuild(#[from] RebuildError),
    /// The devices could not be restored.
    #[error(transparent)]
    Devices(#[from] DeviceError),
    /// The pipe vCPU 0 reports its first entry on could not be made.
    #[error("cannot make a pipe: {0}")]
    Pipe(nix::Error),
    /// The restored VM could not be paused.
    #[error("cannot pause the restored VM: {0}")]
    Pause(#[from] crate::microvm::StateError),
    /// What capturing vCPU state needs could not be read.
    #[error(transparent)]
    Build(#[from] crate::builder::BuildError),
}

/// The configuration of the VM restored from `saved` with `opts`.
pub fn restored_config(
    saved: &SavedConfig,
    opts: &RestoreOptions,
) -> Result<VmConfig, RestoreError> {
    let vsock = match (saved.vsock_cid, &opts.vsock, &opts.api_sock) {
        (None, _, _) => None,
        (Some(cid), Some(path), _) => Some((cid, path.clone())),
        (Some(cid), None, Some(sock)) => {
            let mut p = sock.clone().into_os_string();
            p.push(".vsock");
            Some((cid, PathBuf::from(p)))
        }
        (Some(_), None, None) => {
            return Err(RestoreError::Options(
                "the snapshot's VM has a vsock device: give --vsock PATH or --api-sock".into(),
            ))
        }
    };
    let disks = (saved.disks.iter())
        .map(|d| DiskConfig {
            path: d.path.clone(),
            cow_dir: d
                .cow_dir
                .as_ref()
                .map(|c| opts.cow_dir.clone().unwrap_or(c.clone())),
            keep: d.keep && d.cow_dir.is_some(),
            rate_limit: d.rate_limit,
        })
        .collect();
    Ok(VmConfig {
        machine: MachineConfig {
            initrd: None,
            disks,
            disk_slots: saved.disk_slots,
            slot_cow_dir: (saved.slot_cow_dir.as_ref())
                .map(|c| opts.cow_dir.clone().unwrap_or(c.clone())),
            rng: (saved.rng.as_ref()).map(|r| RngConfig {
                rate_limit: r.rate_limit,
            }),
            vsock: vsock.map(|(cid, uds_path)| VsockConfig { cid, uds_path }),
            net: saved.net.as_ref().map(|n| NetConfig {
                tap: opts.tap.clone().unwrap_or(n.tap.clone()),
                mac: n.mac,
                rate_limit: n.rate_limit,
                ipv4: n.ipv4,
                gateway: n.gateway,
            }),
            mem_mib: saved.mem_mib,
            vcpus: saved.vcpus,
            cmdline: saved.user_cmdline.clone(),
            host_quirks: saved.host_quirks,
            ap_boot: saved.ap_boot,
            mailbox_mib: saved.mailbox_mib,
            ..MachineConfig::new(saved.kernel.clone())
        },
        host: HostPolicy {
            console: opts.console.clone(),
            api_sock: opts.api_sock.clone(),
            thp: false,
            prefault: false,
            cgroups: opts.cgroups.clone(),
            seccomp: opts.seccomp,
        },
        clones: ClonePolicy {
            warm_clones: opts.warm_clones,
            max_clones: opts.max_clones,
            max_tree_clones: opts.max_tree_clones,
            prime: saved.prime,
            working_set_mib: opts.working_set_mib,
            fork_sources: opts.fork_sources,
        },
        invoke: InvokePolicy {
            rewind: opts.rewind,
            template: saved.template,
            refresh_idle_ms: saved.refresh_idle_ms,
            tick_defer_ms: saved.tick_defer_ms,
        },
    })
}

/// Checks that this host offers every CPUID feature the saved vCPUs saw: those KVM
/// supports, and on PVM, which does not fully honour the CPUID a VMM sets, those a vCPU
/// here has in effect (`restored`: the VM's vCPUs, created with the saved CPUID and not
/// run yet), which are the host CPU's own.
fn check_cpuid(
    file: &SnapshotFile,
    kvm: &KvmContext,
    restored: &[crate::vstate::vcpu::Vcpu],
) -> Result<(), RestoreError> {
    let mut offered = (kvm.kvm)
        .get_supported_cpuid(kvm_bindings::KVM_MAX_CPUID_ENTRIES)
        .map_err(KvmError::Cpuid)?;
    if kvm.host == HostKind::Pvm {
        if let Some(v) = restored.first() {
            let effective = v.effective_cpuid().map_err(KvmError::Cpuid)?;
            offered = union(&offered, &effective);
        }
    }
    let mut missing = Vec::new();
    for v in &file.state.vcpus {
        for f in missing_features(&v.cpuid, &offered) {
            let f = f.to_string();
            if !missing.contains(&f) {
                missing.push(f);
            }
        }
    }
    match missing.is_empty() {
        true => Ok(()),
        false => Err(RestoreError::Cpu(format!(
            "the host lacks {}",
            missing.join(", ")
        ))),
    }
}

/// Every leaf of `a`, each register with `b`'s bits of the same leaf added.
fn union(a: &CpuId, b: &CpuId) -> CpuId {
    let mut u = a.clone();
    for e in u.as_mut_slice() {
        let other = (b.as_slice().iter()).find(|o| o.function == e.function && o.index == e.index);
        if let Some(o) = other {
            e.eax |= o.eax;
            e.ebx |= o.ebx;
            e.ecx |= o.ecx;
            e.edx |= o.edx;
        }
    }
    u
}

/// Reads and checks the snapshot in `dir` against `config`'s memory and this host.
fn check(
    dir: &Path,
    file: &SnapshotFile,
    config: &VmConfig,
    kvm: &KvmContext,
) -> Result<(), RestoreError> {
    let mismatch = |why: String| RestoreError::Mismatch {
        dir: dir.display().to_string(),
        why,
    };
    // The memory file's regions are those of a VM of this size and mailbox.
    let mut expected = ram_ranges(config.machine.mem_mib << 20);
    let mailbox = crate::builder::mailbox(&config.machine);
    if mailbox.size > 0 {
        expected.push((u64::from(mailbox.addr), u64::from(mailbox.size)));
        expected.sort_unstable();
    }
    let regions: Vec<(u64, u64)> = (file.memory.regions.iter())
        .map(|r| (r.guest_addr, r.size))
        .collect();
    if regions != expected {
        return Err(mismatch(format!(
            "its memory regions {regions:x?} are not those of a {} MiB VM with a {} MiB mailbox",
            config.machine.mem_mib, config.machine.mailbox_mib
        )));
    }
    if file.state.vcpus.len() != usize::from(config.machine.vcpus) {
        return Err(mismatch(format!(
            "it holds {} vCPUs, its configuration says {}",
            file.state.vcpus.len(),
            config.machine.vcpus
        )));
    }
    // Every MSR the guest saw is this host's too (CPUID features: `check_cpuid`).
    let host_msrs = kvm.kvm.get_msr_index_list().map_err(KvmError::MsrList)?;
    let mut missing = Vec::new();
    for v in &file.state.vcpus {
        let saved: Vec<u32> = v.msrs.iter().map(|m| m.index).collect();
        for m in missing_msrs(&saved, host_msrs.as_slice()) {
            let m = format!("MSR {m:#x}");
            if !missing.contains(&m) {
                missing.push(m);
            }
        }
    }
    if !missing.is_empty() {
        return Err(RestoreError::Cpu(format!(
            "the host lacks {}",
            missing.join(", ")
        )));
    }
    // Each disk image, and each image in a slot, is the version the guest saw.
    let disks = (file.config.disks.iter()).filter_map(|d| Some((&d.path, d.image?)));
    let media = (file.config.slot_media.iter().flatten()).map(|m| (&m.path, m.image));
    for (path, saved) in disks.chain(media) {
        let meta = std::fs::metadata(path).map_err(|source| RestoreError::Disk {
            path: path.display().to_string(),
            source,
        })?;
        let now = ImageVersion::of(&meta);
        if now != saved {
            return Err(RestoreError::DiskChanged {
                path: path.display().to_string(),
                saved,
                now,
            });
        }
    }
    // A writable medium has its overlay in the snapshot (after the disks'), and the VM
    // its slot.
    if file.config.slot_media.len() > usize::from(config.machine.disk_slots) {
        return Err(mismatch(format!(
            "it has media for {} slots, its configuration {}",
            file.config.slot_media.len(),
            config.machine.disk_slots
        )));
    }
    for (k, m) in file.config.slot_media.iter().enumerate() {
        let Some(m) = m.as_ref().filter(|m| m.writable) else {
            continue;
        };
        let path = dir.join(overlay_file(config.machine.disks.len() + k));
        if config.machine.slot_cow_dir.is_none() || !path.is_file() {
            return Err(mismatch(format!(
                "slot {k} ({}) is writable and its overlay {} or the slots' overlay \
                 directory is missing",
                m.path.display(),
                path.display()
            )));
        }
    }
    // A writable disk has its overlay in the snapshot.
    for (i, d) in config.machine.disks.iter().enumerate() {
        let path = dir.join(overlay_file(i));
        if d.cow_dir.is_some() && !path.is_file() {
            return Err(mismatch(format!(
                "disk {i} ({}) is writable and its overlay {} is missing",
                d.path.display(),
                path.display()
            )));
        }
    }
    Ok(())
}

/// Disk image `path` opened again (read-only), and, for a writable one (its overlay
/// directory `cow`), its overlay `saved` in the snapshot copied into `cow`.
fn reopen(
    path: &Path,
    saved: &Path,
    cow: Option<&Path>,
) -> Result<(RawFd, Option<OverlaySnapshot>), RestoreError> {
    let disk_error = |source| RestoreError::Disk {
        path: path.display().to_string(),
        source,
    };
    let image = File::open(path).map_err(disk_error)?;
    let size = image.metadata().map_err(disk_error)?.len();
    let overlay = match cow {
        Some(cow) => Some(OverlaySnapshot::from_kept(saved, cow, size)?),
        None => None,
    };
    Ok((image.into_raw_fd(), overlay))
}

/// A snapshot read and checked against this host, not started yet.
pub struct Restoring {
    dir: PathBuf,
    file: SnapshotFile,
    config: VmConfig,
    kvm: KvmContext,
    started: Instant,
    marks: StageTimer,
}

/// Reads the snapshot `opts.dir` and checks it against `opts` and this host: nothing is
/// created yet.
pub fn open(opts: &RestoreOptions) -> Result<Restoring, RestoreError> {
    let started = Instant::now();
    let mut marks = StageTimer::new();
    let dir = &opts.dir;
    let file: SnapshotFile = clone::state_file::read(&dir.join(STATE_FILE))?;
    marks.done("state file");
    if opts.paused && file.config.template {
        return Err(RestoreError::Options(
            "the snapshot is of a template, which pauses itself once its runtime waits \
             for a request: restore it without --paused"
                .into(),
        ));
    }
    let config = restored_config(&file.config, opts)?;
    let kvm = KvmContext::open()?;
    config.validate_restored(kvm.max_vcpus)?;
    check(dir, &file, &config, &kvm)?;
    marks.done("checks");
    Ok(Restoring {
        dir: dir.clone(),
        file,
        config,
        kvm,
        started,
        marks,
    })
}

impl Restoring {
    /// The restored VM's configuration.
    pub fn config(&self) -> &VmConfig {
        &self.config
    }

    /// Rebuilds the VM; its vCPUs run and its devices' host sides are open, their
    /// workers not started yet (`DeviceManager::start_restored_virtio`).
    pub fn start(self) -> Result<VmParts, RestoreError> {
        let Self {
            dir,
            file,
            config,
            kvm,
            started,
            mut marks,
        } = self;
        let dir = &dir;
        let window = crate::builder::mailbox(&config.machine);
        let mem = map_memory_file(&dir.join(MEMORY_FILE), &file.memory)?;
        marks.done("memory mapped");

        // The disks: their images opened again, writable ones' overlays copied from the
        // snapshot into their directories (the snapshot's stay as they are). The device
        // restore takes each descriptor over (`VirtioRestore`): the overlays' are not
        // dropped here.
        let mut disk_fds = Vec::with_capacity(config.machine.disks.len());
        let mut overlays = ManuallyDrop::new(Vec::with_capacity(config.machine.disks.len()));
        for (i, d) in config.machine.disks.iter().enumerate() {
            let saved = dir.join(overlay_file(i));
            let (fd, overlay) = reopen(&d.path, &saved, d.cow_dir.as_deref())?;
            overlays.push(overlay);
            disk_fds.push(fd);
        }
        // The slots' media: opened again, a writable one's overlay copied as a disk's
        // (after the disks', as the devices count them).
        let mut slots = Vec::with_capacity(file.config.slot_media.len());
        for (k, m) in file.config.slot_media.iter().enumerate() {
            let Some(m) = m else {
                slots.push(None);
                overlays.push(None);
                continue;
            };
            let saved = dir.join(overlay_file(config.machine.disks.len() + k));
            let cow = config
                .machine
                .slot_cow_dir
                .as_deref()
                .filter(|_| m.writable);
            let (fd, overlay) = reopen(&m.path, &saved, cow)?;
            overlays.push(overlay);
            slots.push(Some((fd, m.path.clone())));
        }
        marks.done("disks");
        let state = &file.state;
        let mut prepared = prepare(&kvm, state, &mem, window)?;
        marks.done("vm and vcpus");
        check_cpuid(&file, &kvm, &prepared.vcpus)?;
        marks.done("cpuid check");
        // The rest is a clone's: every VM restored from one snapshot gets its own kernel
        // RNG key (and its identity block a new generation, with the devices). vCPU 0
        // writes when it first enters the guest (CLOCK_MONOTONIC ns), logged below: what
        // a caller measures a restore by.
        let (entry_read, entry_write) = nix::unistd::pipe().map_err(RestoreError::Pipe)?;
        let from = StartFrom {
            mem: &mem,
            config: &config,
            seq: 0,
            state,
            disk_fds: &disk_fds,
            overlays: &overlays,
            slots: &slots,
            media: &[],
        };
        let ready = File::from(entry_write);
        let (devices, vcpus) = start_rebuilt(&mut prepared, &from, ready, &mut marks)?;
        let capture_spec = capture_spec(&kvm, &prepared.vm)?;
        let kvm_run_size = kvm.kvm.get_vcpu_mmap_size().map_err(KvmError::MmapSize)?;
        let host = HostReport {
            kvm: kvm.host,
            skipped_msrs: prepared.skipped_msrs,
            // Mapped from the file: no huge pages asked for.
            memory: MemoryInfo {
                thp_advised: false,
                huge_aligned: false,
            },
            ..file.host
        };
        let mut ns = [0u8; 8];
        let entered_ns = std::io::Read::read_exact(&mut File::from(entry_read), &mut ns)
            .map_or(0, |()| u64::from_le_bytes(ns));
        let crng = match devices.crng.registration.layout() {
            Some(_) => "guest kernel's CRNG registered",
            None => "no guest CRNG registered",
        };
        tracing::info!(
            "restored {} ({} MiB, {} vCPUs, {crng}) in {} us; vCPU 0 entered the guest at {} \
             ns (CLOCK_MONOTONIC)",
            dir.display(),
            config.machine.mem_mib,
            config.machine.vcpus,
            started.elapsed().as_micros(),
            entered_ns
        );
        tracing::debug!("restore stages: {}", marks.report());
        Ok(VmParts {
            config,
            mailbox: window,
            vm: prepared.vm,
            mem,
            kvm,
            devices,
            vcpus,
            host,
            cmdline: file.cmdline,
            capture_spec: Arc::new(capture_spec),
            kvm_run_size,
        })
    }
}
