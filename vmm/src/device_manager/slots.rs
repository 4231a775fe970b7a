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

use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::path::{Path, PathBuf};

use devices::virtio::block::overlay::Overlay;
use devices::virtio::block::{Block, BlockArgs, Medium};
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
#[derive(Debug)]
pub(super) struct Slot {
    /// Its place among the virtio devices.
    virtio_index: usize,
    /// Whether the medium was inserted for this VM (its guest is told once it runs).
    inserted: bool,
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
                        // SAFETY: a descriptor of the parent's slot image, inherited by
                        // fork and kept open by the clone; the parent's object owning it
                        // is never used or dropped in the child, so this is its only
                        // owner here.
                        let file = unsafe { File::from_raw_fd(*fd) };
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
        });
        (self.slot_media).push((block.file()).map(|f| f.as_raw_fd()).zip(path.clone()));
        Ok((block, path))
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
