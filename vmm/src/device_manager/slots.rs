//! Disk slots (`--disk-slots N`): virtio-blk devices after the disks that a VM boots
//! with no medium in (`forkvm-slot<k>`, 0 sectors), into which a clone request inserts
//! an image (`POST /clones` `media`): read-only, or, in a VM with a slot overlay
//! directory (`--slot-cow-dir`, whose slots the guest sees as writable), writable
//! through an overlay of the clone's own (its empty file made by the template). The
//! clone's VMM makes the slot's device over the image as it rebuilds its devices, and
//! once its vCPUs run raises the device's configuration-change interrupt: the guest's
//! driver reads the new capacity. The template and its other clones keep theirs. A
//! clone of that clone inherits the image (its descriptor, as a disk's) and a copy of
//! its overlay, unless its own request inserts another.
//!
//! A running VM (a template or a clone) also takes a medium into an empty slot, and
//! gives one up, on request (`PUT` / `DELETE /slots/{k}`): the device's worker serves
//! the new medium from its next request on, and the guest is told by the same
//! interrupt. The guest must have stopped using a medium (unmounted it) before it is
//! ejected: its requests fail from then on.

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::path::{Path, PathBuf};

use devices::virtio::block::overlay::{Overlay, OverlayError};
use devices::virtio::block::{Block, BlockArgs, Medium, MediumError, MediumHandle};
use devices::virtio::MmioTransportState;
use devices::Persist;

use super::virtio::device_state;
use super::{lock, DeviceError, DeviceManager, VirtioRestore};

/// An image inserted into a clone's disk slot, open.
#[derive(Debug)]
pub struct Inserted {
    /// The slot.
    pub slot: u8,
    /// The image's path (for `GET /vm` and errors).
    pub path: PathBuf,
    /// The image.
    pub file: File,
    /// A writable medium's overlay file (empty, anonymous, the image's size).
    pub overlay: Option<File>,
}

/// One disk slot of this VM (its medium is in `DeviceManager::slot_media`).
pub(super) struct Slot {
    /// Its place among the virtio devices.
    virtio_index: usize,
    /// Whether the medium was inserted for this VM (its guest is told once it runs).
    inserted: bool,
    /// Changes its medium while the VM runs.
    handle: MediumHandle,
}

/// Why a running VM's slot did not take or give up a medium (the slot is as it was).
#[derive(Debug, thiserror::Error)]
pub enum SlotChangeError {
    /// No such slot.
    #[error("disk slot {slot} does not exist: the VM has {slots} (--disk-slots)")]
    NoSlot {
        /// Asked for.
        slot: u8,
        /// The VM's.
        slots: usize,
    },
    /// The image cannot be a medium (missing, unreadable, empty, not whole sectors).
    #[error("disk slot {slot}: {why}")]
    Image {
        /// The slot.
        slot: u8,
        /// Why.
        why: String,
    },
    /// A writable medium in a VM without a slot overlay directory.
    #[error(
        "disk slot {0}'s medium is writable, but the VM's slots are read-only \
         (vmm run --slot-cow-dir DIR makes them writable through overlays)"
    )]
    ReadOnlySlots(u8),
    /// The slot is full (insert) or empty (eject).
    #[error("disk slot {slot}: {source}")]
    Medium {
        /// The slot.
        slot: u8,
        /// Why.
        source: MediumError,
    },
    /// The writable medium's overlay could not be made.
    #[error("disk slot {slot}: cannot make its overlay: {source}")]
    Overlay {
        /// The slot.
        slot: u8,
        /// Why.
        source: OverlayError,
    },
}

impl SlotChangeError {
    /// Whether the request does not fit the slot's state or the VM (a conflict), as
    /// opposed to a bad image or a host failure.
    pub fn is_conflict(&self) -> bool {
        matches!(
            self,
            Self::NoSlot { .. }
                | Self::ReadOnlySlots(_)
                | Self::Medium {
                    source: MediumError::Full | MediumError::Empty | MediumError::ReadOnlySlot,
                    ..
                }
        )
    }
}

/// `path` opened read-only as a disk slot's image: a regular file of whole 512-byte
/// sectors, not empty. The error says why not, naming the path.
pub fn open_image(path: &Path) -> Result<File, String> {
    let shown = path.display().to_string();
    let file = File::open(path).map_err(|e| format!("{shown}: {e}"))?;
    let meta = file.metadata().map_err(|e| format!("{shown}: {e}"))?;
    if !meta.is_file() {
        return Err(format!("{shown} is no regular file"));
    }
    match devices::virtio::block::image_sectors(&file, &shown) {
        Ok(0) => Err(format!("{shown} is empty (0 sectors)")),
        Ok(_) => Ok(file),
        Err(e) => Err(e.to_string()),
    }
}

impl DeviceManager {
    /// Slot `k`'s device (serial `forkvm-slot<k>`): empty at boot, shown as writable
    /// with a slot overlay directory `cow_dir`; restoring (`state`), with the image
    /// `restore` inserts into it (and its overlay file, writable), or else the
    /// parent's medium (its descriptor inherited by fork, and the copy of its overlay
    /// the parent made for this clone), or empty. Returns the device and its medium's
    /// path.
    pub(super) fn open_slot(
        &mut self,
        k: u8,
        cow_dir: Option<&Path>,
        restore: Option<&VirtioRestore<'_>>,
        state: Option<&MmioTransportState>,
    ) -> Result<(Block, Option<PathBuf>), DeviceError> {
        let id = format!("forkvm-slot{k}");
        let saved = device_state::<Block>(state)?;
        // Its place among the overlays (the disks' first), as in the parent.
        let index = self.overlays.len();
        let (block, path, inserted) = match (restore, saved) {
            (Some(r), Some(saved)) => {
                let new = r.media.iter().find(|m| m.slot == k);
                let parent = r.slots.get(usize::from(k)).and_then(Option::as_ref);
                let dir = || cow_dir.ok_or(DeviceError::SlotCowDir(k));
                let (medium, path, inserted, overlay) = match (new, parent) {
                    (Some(m), _) => {
                        let file = m.file.try_clone().map_err(DeviceError::Slot)?;
                        let overlay = match &m.overlay {
                            Some(o) => {
                                let o = o.try_clone().map_err(DeviceError::Slot)?;
                                let size = file.metadata().map_err(DeviceError::Slot)?.len();
                                Some(Overlay::from_empty(o, dir()?, size))
                            }
                            None => None,
                        };
                        (Medium::Inserted(file), Some(m.path.clone()), true, overlay)
                    }
                    (None, Some((fd, path))) => {
                        // A copy of the descriptor: the inherited one stays open for the
                        // devices a rewound clone makes at its next launch
                        // (`cloning/rewind.rs`).
                        // SAFETY: a descriptor of the parent's slot image, inherited by
                        // fork and kept open by the clone for as long as it lives;
                        // borrowed for the copy.
                        let file = unsafe { std::os::fd::BorrowedFd::borrow_raw(*fd) }
                            .try_clone_to_owned()
                            .map(File::from)
                            .map_err(DeviceError::Slot)?;
                        let overlay = match r.overlays.get(index).and_then(Option::as_ref) {
                            Some(s) => {
                                // SAFETY: the snapshot's descriptor, made by the parent
                                // for this clone and kept open across fork; the parent's
                                // object owning it is never used or dropped here, so
                                // this is its only owner.
                                let copy = unsafe { File::from_raw_fd(s.file.as_raw_fd()) };
                                Some(Overlay::from_snapshot(
                                    s.inherited(copy),
                                    dir()?,
                                    saved.size(),
                                ))
                            }
                            None => None,
                        };
                        (Medium::Saved(file), Some(path.clone()), false, overlay)
                    }
                    (None, None) => (Medium::Empty, None, false, None),
                };
                let shown = (path.as_ref()).map_or(id.clone(), |p| p.display().to_string());
                let args = BlockArgs {
                    medium,
                    shown,
                    overlay,
                    limit: None,
                };
                (Block::restore(args, saved)?, path, inserted)
            }
            _ => {
                let block = Block::empty(&id).with_writable_slot(cow_dir.is_some());
                (block, None, false)
            }
        };
        self.overlays.push(block.overlay());
        self.slots.push(Slot {
            virtio_index: self.virtio.len(),
            inserted,
            handle: block.medium_handle(),
        });
        (self.slot_media).push((block.file()).map(|f| f.as_raw_fd()).zip(path.clone()));
        Ok((block, path))
    }

    /// Puts `medium` into its empty slot of this running VM, writable through a new
    /// overlay in `cow_dir` if it asks, and tells the guest.
    pub fn insert_medium(
        &mut self,
        medium: &api_types::InsertMedium,
        cow_dir: Option<&Path>,
    ) -> Result<(), SlotChangeError> {
        let k = medium.slot;
        let slot = self.slot(k)?;
        if medium.writable && cow_dir.is_none() {
            return Err(SlotChangeError::ReadOnlySlots(k));
        }
        let file =
            open_image(&medium.path).map_err(|why| SlotChangeError::Image { slot: k, why })?;
        let overlay = match (medium.writable, cow_dir) {
            (true, Some(dir)) => {
                let size = file.metadata().map_or(0, |m| m.len());
                let o = Overlay::create(dir, size)
                    .map_err(|source| SlotChangeError::Overlay { slot: k, source })?;
                Some(o)
            }
            _ => None,
        };
        let shown = medium.path.display().to_string();
        (slot.handle.insert(file, &shown, overlay))
            .map_err(|source| SlotChangeError::Medium { slot: k, source })?;
        self.medium_changed(k, Some(medium.path.clone()));
        Ok(())
    }

    /// Takes the medium out of slot `k` of this running VM (its overlay goes with it)
    /// and tells the guest.
    pub fn eject_medium(&mut self, k: u8) -> Result<(), SlotChangeError> {
        let slot = self.slot(k)?;
        (slot.handle.eject()).map_err(|source| SlotChangeError::Medium { slot: k, source })?;
        self.medium_changed(k, None);
        Ok(())
    }

    fn slot(&self, k: u8) -> Result<&Slot, SlotChangeError> {
        (self.slots.get(usize::from(k))).ok_or(SlotChangeError::NoSlot {
            slot: k,
            slots: self.slots.len(),
        })
    }

    /// Records slot `k`'s new medium (at `path`, None: empty) where clones, snapshots
    /// and `GET /vm` look, and raises the device's configuration-change interrupt.
    fn medium_changed(&mut self, k: u8, path: Option<PathBuf>) {
        let i = usize::from(k);
        let (file, overlay) = self.slots[i].handle.current();
        let writable = overlay.is_some();
        let first = self.overlays.len() - self.slots.len();
        self.overlays[first + i] = overlay;
        // The descriptor stays open while the slot holds the medium.
        self.slot_media[i] = file.map(|f| f.as_raw_fd()).zip(path.clone());
        let index = self.slots[i].virtio_index;
        if let Some(info) = self.virtio_info.get_mut(index) {
            info.kind = api_types::vm::VirtioKind::Slot {
                slot: k,
                medium: path,
                writable,
            };
        }
        if let Err(e) = lock(&self.virtio[index]).notify_config_change() {
            // The medium changed all the same; a guest that missed the interrupt
            // sees the new capacity when it next reads the device's configuration.
            tracing::warn!("disk slot {k}: cannot interrupt the guest: {e}");
        }
    }

    /// Whether each slot's medium is writable (has an overlay of this VM's), in slot
    /// order. The slots' overlays are the last of `overlays`, after the disks'.
    pub fn slot_writable(&self) -> Vec<bool> {
        let first = self.overlays.len() - self.slots.len();
        self.overlays[first..].iter().map(Option::is_some).collect()
    }

    /// Each slot's medium (its open image's descriptor and path), in slot order: what a
    /// clone inherits.
    pub fn slot_media(&self) -> &[Option<(RawFd, PathBuf)>] {
        &self.slot_media
    }

    /// Tells the guest of the images inserted for this VM (a configuration-change
    /// interrupt per slot): called once its vCPUs run.
    pub fn announce_inserted_media(&self) -> Result<(), DeviceError> {
        for s in self.slots.iter().filter(|s| s.inserted) {
            let t = &self.virtio[s.virtio_index];
            lock(t).notify_config_change().map_err(DeviceError::Slot)?;
        }
        Ok(())
    }
}
