//! Writing a snapshot of a paused VM: the state its clones are made from, its memory
//! and its overlays, into a temporary directory renamed into place once complete.

use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use api_types::SnapshotInfo;
use clone::MicrovmState;

use super::{
    overlay_file, ImageVersion, SavedConfig, SavedDisk, SavedMedium, SavedNet, SavedRng,
    SnapshotFile, MEMORY_FILE, STATE_FILE,
};
use crate::config::VmConfig;
use crate::microvm::Microvm;
use crate::vstate::memory_file::{write_memory_file, MemoryFileError};

/// Why a snapshot could not be written (nothing is left of it).
#[derive(Debug, thiserror::Error)]
pub enum SaveError {
    /// The directory is not an absolute path with a parent.
    #[error("snapshot directory {0:?}: give an absolute path whose parent exists")]
    Path(String),
    /// The directory exists already.
    #[error("snapshot directory {0} exists already")]
    Exists(String),
    /// The temporary directory could not be made, synced or renamed into place.
    #[error("cannot write the snapshot directory {path}: {source}")]
    Dir {
        /// The directory.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// Guest memory could not be written.
    #[error(transparent)]
    Memory(#[from] MemoryFileError),
    /// An overlay could not be copied.
    #[error(transparent)]
    Overlay(#[from] devices::virtio::block::overlay::OverlayError),
    /// The state file could not be written.
    #[error(transparent)]
    State(#[from] clone::state_file::StateFileError),
}

impl SaveError {
    /// Whether the host is out of room (space, quota) rather than failing.
    pub fn host_short(&self) -> bool {
        let errno = crate::errno::errno_of(self);
        errno == libc::ENOSPC || errno == libc::EDQUOT
    }
}

/// The images in `vm`'s disk slots, in slot order.
fn slot_media(vm: &Microvm) -> Result<Vec<Option<SavedMedium>>, SaveError> {
    let writable = vm.devices().slot_writable();
    (vm.devices().slot_media().iter().zip(writable))
        .map(|(m, writable)| {
            let Some((_, path)) = m else { return Ok(None) };
            let meta = std::fs::metadata(path).map_err(|source| SaveError::Dir {
                path: path.display().to_string(),
                source,
            })?;
            Ok(Some(SavedMedium {
                path: path.clone(),
                image: ImageVersion::of(&meta),
                writable,
            }))
        })
        .collect()
}

/// The configuration the guest sees, from `config`, with the images in its slots.
fn saved_config(config: &VmConfig, slot_media: Vec<Option<SavedMedium>>) -> SavedConfig {
    SavedConfig {
        kernel: config.machine.kernel.clone(),
        mem_mib: config.machine.mem_mib,
        vcpus: config.machine.vcpus,
        ap_boot: config.machine.ap_boot,
        user_cmdline: config.machine.cmdline.clone(),
        host_quirks: config.machine.host_quirks,
        mailbox_mib: config.machine.mailbox_mib,
        template: config.invoke.template,
        refresh_idle_ms: config.invoke.refresh_idle_ms,
        tick_defer_ms: config.invoke.tick_defer_ms,
        prime: config.clones.prime,
        disk_slots: config.machine.disk_slots,
        slot_cow_dir: config.machine.slot_cow_dir.clone(),
        slot_media,
        disks: (config.machine.disks.iter())
            .map(|d| SavedDisk {
                path: d.path.clone(),
                image: std::fs::metadata(&d.path)
                    .ok()
                    .map(|m| ImageVersion::of(&m)),
                cow_dir: d.cow_dir.clone(),
                keep: d.keep,
                rate_limit: d.rate_limit,
            })
            .collect(),
        rng: (config.machine.rng.as_ref()).map(|r| SavedRng {
            rate_limit: r.rate_limit,
        }),
        vsock_cid: config.machine.vsock.as_ref().map(|v| v.cid),
        net: config.machine.net.as_ref().map(|n| SavedNet {
            tap: n.tap.clone(),
            mac: n.mac,
            rate_limit: n.rate_limit,
            ipv4: n.ipv4,
            gateway: n.gateway,
        }),
    }
}

/// Where a snapshot of `dir` is written before it is renamed: beside it, hidden, named
/// for this process.
fn temporary(dir: &Path) -> Result<PathBuf, SaveError> {
    let bad = || SaveError::Path(dir.display().to_string());
    let (Some(parent), Some(name)) = (dir.parent(), dir.file_name()) else {
        return Err(bad());
    };
    if !dir.is_absolute() || !parent.is_dir() {
        return Err(bad());
    }
    let mut tmp = std::ffi::OsString::from(".");
    tmp.push(name);
    tmp.push(format!(".tmp-{}", std::process::id()));
    Ok(parent.join(tmp))
}

/// Writes a snapshot of the paused `vm`, whose state is `state` (captured in this
/// pause), to the new directory `dir`.
pub fn save(vm: &Microvm, state: &MicrovmState, dir: &Path) -> Result<SnapshotInfo, SaveError> {
    let started = Instant::now();
    let tmp = temporary(dir)?;
    if dir.exists() {
        return Err(SaveError::Exists(dir.display().to_string()));
    }
    let dir_err = |path: &Path| {
        let path = path.display().to_string();
        move |source| SaveError::Dir { path, source }
    };
    // A temporary directory left by an earlier attempt of a process with this pid.
    let _ = std::fs::remove_dir_all(&tmp);
    std::fs::DirBuilder::new()
        .mode(0o700)
        .create(&tmp)
        .map_err(dir_err(&tmp))?;
    let written = write_all(vm, state, &tmp).and_then(|info| {
        sync_dir(&tmp).map_err(dir_err(&tmp))?;
        std::fs::rename(&tmp, dir).map_err(dir_err(dir))?;
        if let Some(parent) = dir.parent() {
            sync_dir(parent).map_err(dir_err(parent))?;
        }
        Ok(info)
    });
    match written {
        Ok(mut info) => {
            info.dir = dir.display().to_string();
            info.took_ms = started.elapsed().as_millis() as u64;
            tracing::info!(
                "snapshot {}: {} MiB of memory ({} MiB written) in {} ms",
                info.dir,
                info.memory_bytes >> 20,
                info.memory_written_bytes >> 20,
                info.took_ms
            );
            Ok(info)
        }
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(e)
        }
    }
}

/// The snapshot's files in `tmp`.
fn write_all(vm: &Microvm, state: &MicrovmState, tmp: &Path) -> Result<SnapshotInfo, SaveError> {
    let memory = write_memory_file(vm.memory(), &tmp.join(MEMORY_FILE))?;
    let overlay_bytes = vm.devices().save_overlays(|i| tmp.join(overlay_file(i)))?;
    let file = SnapshotFile {
        forkvm: env!("CARGO_PKG_VERSION").to_string(),
        config: saved_config(vm.config(), slot_media(vm)?),
        cmdline: vm.cmdline().to_string(),
        host: vm.host().clone(),
        memory,
        state: state.clone(),
    };
    let state_path = tmp.join(STATE_FILE);
    clone::state_file::write(&state_path, &file)?;
    let state_bytes = std::fs::metadata(&state_path).map_or(0, |m| m.len());
    Ok(SnapshotInfo {
        dir: String::new(),
        memory_bytes: file.memory.file_len(),
        memory_written_bytes: file.memory.bytes_written,
        state_bytes,
        overlay_bytes,
        took_ms: 0,
    })
}

fn sync_dir(dir: &Path) -> std::io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}
