//! A private copy-on-write layer over a read-only base image: the guest's writes go to
//! an overlay file (sparse, the base's size), in whole 4 KiB blocks, and a bitmap says
//! which blocks the overlay holds. Reads take each block from the overlay if it holds
//! it, else from the base. The base is never written.
//!
//! The overlay is an anonymous file (`O_TMPFILE` in a directory the user names), so it
//! is gone when the last descriptor to it closes, however its VM ends. A clone gets a
//! copy of its parent's overlay made at the clone point ([`Overlay::snapshot`], while
//! the parent's device is parked), so neither sees the other's later writes.
//!
//! [`Overlay::keep`] gives the file a name when its VM ends, if asked: the overlay
//! (sparse, the base's size) and a `.blocks` file saying which blocks it holds.
//!
//! Blocks are written whole (a partial write to a block the overlay does not hold yet
//! reads the rest from the base first), so one bit per block says where it is.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// Overlay block size.
pub const BLOCK: u64 = 4096;
/// Bytes copied at a time by [`Overlay::snapshot`].
const COPY_CHUNK: usize = 1 << 20;

/// Errors making or keeping an overlay.
#[derive(Debug, thiserror::Error)]
pub enum OverlayError {
    /// The overlay could not be kept under a name.
    #[error("cannot keep the overlay as {path}: {source}")]
    Keep {
        /// The name asked for.
        path: String,
        /// Why.
        source: std::io::Error,
    },
    /// A kept overlay could not be taken up again.
    #[error("cannot use the kept overlay {path}: {reason}")]
    Kept {
        /// The kept overlay.
        path: String,
        /// Why.
        reason: String,
    },
    /// The overlay file could not be created or sized.
    #[error("cannot create an overlay file in {dir}: {source}")]
    Create {
        /// The directory.
        dir: String,
        /// Why.
        source: std::io::Error,
    },
}

/// A copy of an overlay for a clone: the file and which blocks it holds.
#[derive(Debug)]
pub struct OverlaySnapshot {
    /// The copy (anonymous).
    pub file: File,
    present: Vec<u64>,
}

impl OverlaySnapshot {
    /// This snapshot as a forked child owns it: `file` is its inherited descriptor of
    /// [`OverlaySnapshot::file`].
    pub fn inherited(&self, file: File) -> Self {
        Self {
            file,
            present: self.present.clone(),
        }
    }
}

/// A copy-on-write layer (see the module documentation).
#[derive(Debug)]
pub struct Overlay {
    file: File,
    dir: PathBuf,
    size: u64,
    present: Vec<u64>,
    /// An empty file made ahead (see [`Overlay::wants_spare`]) for the next snapshot.
    spare: Option<File>,
}

fn tmpfile(dir: &Path, size: u64) -> Result<File, OverlayError> {
    let err = |source| OverlayError::Create {
        dir: dir.display().to_string(),
        source,
    };
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .mode(0o600)
        .custom_flags(libc::O_TMPFILE | libc::O_CLOEXEC)
        .open(dir)
        .map_err(err)?;
    file.set_len(size).map_err(err)?;
    Ok(file)
}

fn blocks(size: u64) -> u64 {
    size.div_ceil(BLOCK)
}

/// Copies the blocks `present` marks from `from` to `to` (files of `size` bytes), in
/// runs of up to [`COPY_CHUNK`].
fn copy_blocks(from: &File, to: &File, present: &[u64], size: u64) -> std::io::Result<()> {
    let has = |b: u64| present[(b / 64) as usize] & (1 << (b % 64)) != 0;
    // Allocated at the first block to copy: an overlay that holds nothing copies nothing
    // and should not pay for a buffer.
    let mut buf = Vec::new();
    let total = blocks(size);
    let mut b = 0;
    while b < total {
        if !has(b) {
            b += 1;
            continue;
        }
        // A run of present blocks, at most one buffer long.
        let start = b;
        while b < total && has(b) && (b - start + 1) * BLOCK <= COPY_CHUNK as u64 {
            b += 1;
        }
        let at = start * BLOCK;
        let len = ((b * BLOCK).min(size) - at) as usize;
        buf.resize(COPY_CHUNK, 0);
        from.read_exact_at(&mut buf[..len], at)?;
        to.write_all_at(&buf[..len], at)?;
    }
    Ok(())
}

impl Overlay {
    /// An empty overlay for a base of `size` bytes, in directory `dir`.
    pub fn create(dir: &Path, size: u64) -> Result<Self, OverlayError> {
        Ok(Self {
            file: tmpfile(dir, size)?,
            dir: dir.to_path_buf(),
            size,
            present: vec![0; blocks(size).div_ceil(64) as usize],
            spare: None,
        })
    }

    /// An empty overlay in `file`, an empty anonymous file of `size` bytes made in
    /// `dir` ([`Overlay::new_spare`]; a clone's, made for it by its template).
    pub fn from_empty(file: File, dir: &Path, size: u64) -> Self {
        Self {
            file,
            dir: dir.to_path_buf(),
            size,
            present: vec![0; blocks(size).div_ceil(64) as usize],
            spare: None,
        }
    }

    /// The overlay a clone continues with: its parent's [`Overlay::snapshot`]; later
    /// snapshots go to `dir`.
    pub fn from_snapshot(s: OverlaySnapshot, dir: &Path, size: u64) -> Self {
        Self {
            file: s.file,
            dir: dir.to_path_buf(),
            size,
            present: s.present,
            spare: None,
        }
    }

    fn has(&self, b: u64) -> bool {
        self.present[(b / 64) as usize] & (1 << (b % 64)) != 0
    }

    fn mark(&mut self, b: u64) {
        self.present[(b / 64) as usize] |= 1 << (b % 64);
    }

    /// The disk's size in bytes (the overlay file's length).
    pub fn size(&self) -> u64 {
        self.size
    }

    /// Blocks the overlay holds.
    pub fn blocks_present(&self) -> u64 {
        self.present.iter().map(|w| u64::from(w.count_ones())).sum()
    }

    /// The overlay file.
    pub fn file(&self) -> &File {
        &self.file
    }

    /// The block-sized pieces of `len` bytes at `off`: (block, offset in it, length).
    fn pieces(off: u64, len: usize) -> impl Iterator<Item = (u64, u64, usize)> {
        let mut at = off;
        let end = off + len as u64;
        std::iter::from_fn(move || {
            if at >= end {
                return None;
            }
            let b = at / BLOCK;
            let within = at % BLOCK;
            let n = (BLOCK - within).min(end - at);
            at += n;
            Some((b, within, n as usize))
        })
    }

    /// Reads `buf.len()` bytes at `off` (inside the disk), each block from wherever it is.
    pub fn read_at(&self, base: &File, buf: &mut [u8], off: u64) -> std::io::Result<()> {
        let mut done = 0;
        for (b, within, n) in Self::pieces(off, buf.len()) {
            let from = if self.has(b) { &self.file } else { base };
            from.read_exact_at(&mut buf[done..done + n], b * BLOCK + within)?;
            done += n;
        }
        Ok(())
    }

    /// Writes `data` at `off` (inside the disk) into the overlay.
    pub fn write_at(&mut self, base: &File, data: &[u8], off: u64) -> std::io::Result<()> {
        let mut done = 0;
        for (b, within, n) in Self::pieces(off, data.len()) {
            let piece = &data[done..done + n];
            let start = b * BLOCK;
            let block_len = BLOCK.min(self.size - start) as usize;
            if self.has(b) || (within == 0 && n == block_len) {
                self.file.write_all_at(piece, start + within)?;
            } else {
                // First write to this block, and not all of it: the rest comes from
                // the base, so the overlay holds the whole block from now on.
                let mut block = vec![0u8; block_len];
                base.read_exact_at(&mut block, start)?;
                block[within as usize..within as usize + n].copy_from_slice(piece);
                self.file.write_all_at(&block, start)?;
            }
            self.mark(b);
            done += n;
        }
        Ok(())
    }

    /// Gives the overlay a name, `path` (which must not exist, in the overlay's file
    /// system), and writes which blocks it holds to `path` with the extension
    /// `blocks`: one bit per 4 KiB block, block n in bit n % 64 of little-endian u64
    /// word n / 64. Blocks not held read from the base image. Call it once nothing
    /// writes to the overlay any more.
    pub fn keep(&self, path: &Path) -> Result<(), OverlayError> {
        let err = |source| OverlayError::Keep {
            path: path.display().to_string(),
            source,
        };
        self.file.sync_data().map_err(err)?;
        // An O_TMPFILE file gets a name through its /proc link (linkat with
        // AT_EMPTY_PATH would need CAP_DAC_READ_SEARCH).
        let from = std::ffi::CString::new(format!("/proc/self/fd/{}", self.file.as_raw_fd()))
            .map_err(|e| err(e.into()))?;
        let to = std::ffi::CString::new(path.as_os_str().as_bytes()).map_err(|e| err(e.into()))?;
        // SAFETY: both are valid NUL-terminated paths that outlive the call.
        let r = unsafe {
            libc::linkat(
                libc::AT_FDCWD,
                from.as_ptr(),
                libc::AT_FDCWD,
                to.as_ptr(),
                libc::AT_SYMLINK_FOLLOW,
            )
        };
        if r != 0 {
            return Err(err(std::io::Error::last_os_error()));
        }
        let map: Vec<u8> = self.present.iter().flat_map(|w| w.to_le_bytes()).collect();
        std::fs::write(path.with_extension("blocks"), map).map_err(err)
    }

    /// Makes the overlay's writes durable.
    pub fn flush(&self) -> std::io::Result<()> {
        self.file.sync_data()
    }

    /// Where and how big the empty file the next [`Overlay::snapshot`] fills is to be
    /// made, when none is ready: creating and sizing one costs about 0.1 ms a clone need
    /// not wait for. Make it with [`Overlay::new_spare`] without holding the overlay
    /// (its disk's worker would wait), then hand it over with [`Overlay::set_spare`].
    pub fn wants_spare(&self) -> Option<(PathBuf, u64)> {
        self.spare.is_none().then(|| (self.dir.clone(), self.size))
    }

    /// An empty anonymous file of `size` bytes in `dir`, for [`Overlay::set_spare`].
    pub fn new_spare(dir: &Path, size: u64) -> Result<File, OverlayError> {
        tmpfile(dir, size)
    }

    /// Keeps `file` (from [`Overlay::new_spare`] with this overlay's directory and
    /// size) for the next snapshot.
    pub fn set_spare(&mut self, file: File) {
        self.spare = Some(file);
    }

    /// A new overlay file holding the same blocks (for a clone: call it while nothing
    /// writes to this overlay): the spare file if one was made, else a new one. Costs
    /// a copy of the blocks written so far.
    pub fn snapshot(&mut self) -> Result<OverlaySnapshot, OverlayError> {
        let copy = match self.spare.take() {
            Some(f) => f,
            None => tmpfile(&self.dir, self.size)?,
        };
        let err = |source| OverlayError::Create {
            dir: self.dir.display().to_string(),
            source,
        };
        copy_blocks(&self.file, &copy, &self.present, self.size).map_err(err)?;
        Ok(OverlaySnapshot {
            file: copy,
            present: self.present.clone(),
        })
    }

    /// Writes a copy of the overlay to a new file at `path` (owner-only; it must not
    /// exist) and its block map beside it, as [`Overlay::keep`] names them: for a
    /// snapshot, while nothing writes to the overlay. The overlay goes on as it was.
    pub fn save_copy(&self, path: &Path) -> Result<(), OverlayError> {
        let err = |source| OverlayError::Keep {
            path: path.display().to_string(),
            source,
        };
        let copy = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)
            .map_err(err)?;
        copy.set_len(self.size).map_err(err)?;
        copy_blocks(&self.file, &copy, &self.present, self.size).map_err(err)?;
        copy.sync_data().map_err(err)?;
        let map: Vec<u8> = self.present.iter().flat_map(|w| w.to_le_bytes()).collect();
        let map_path = path.with_extension("blocks");
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(map_path)
            .map_err(err)?;
        std::io::Write::write_all(&mut f, &map).map_err(err)?;
        f.sync_data().map_err(err)
    }

    /// An overlay that goes on from a kept one ([`Overlay::keep`]: `path` and its
    /// `.blocks` map) over a base of `size` bytes: its blocks copied into a new file in
    /// `dir`, so that the kept overlay stays as it was and can be taken up again.
    pub fn from_kept(path: &Path, dir: &Path, size: u64) -> Result<Self, OverlayError> {
        Ok(Self::from_snapshot(
            OverlaySnapshot::from_kept(path, dir, size)?,
            dir,
            size,
        ))
    }
}

impl OverlaySnapshot {
    /// A copy of a kept overlay ([`Overlay::keep`], [`Overlay::save_copy`]: `path` and
    /// its `.blocks` map) over a base of `size` bytes, in a new anonymous file in `dir`
    /// (the kept one stays as it was).
    pub fn from_kept(path: &Path, dir: &Path, size: u64) -> Result<Self, OverlayError> {
        let kept_err = |reason: String| OverlayError::Kept {
            path: path.display().to_string(),
            reason,
        };
        let kept = File::open(path).map_err(|e| kept_err(e.to_string()))?;
        let len = kept.metadata().map_err(|e| kept_err(e.to_string()))?.len();
        if len != size {
            return Err(kept_err(format!("it is {len} bytes long, the disk {size}")));
        }
        let map_path = path.with_extension("blocks");
        let map = std::fs::read(&map_path)
            .map_err(|e| kept_err(format!("its block map {}: {e}", map_path.display())))?;
        let words = blocks(size).div_ceil(64) as usize;
        if map.len() != words * 8 {
            return Err(kept_err(format!(
                "its block map is {} bytes, a {size}-byte disk's is {}",
                map.len(),
                words * 8
            )));
        }
        let present: Vec<u64> = map
            .chunks_exact(8)
            .map(|w| u64::from_le_bytes(w.try_into().unwrap_or_default()))
            .collect();
        let beyond = blocks(size) % 64;
        if beyond != 0 && present[words - 1] >> beyond != 0 {
            return Err(kept_err(
                "its block map marks blocks beyond the disk".into(),
            ));
        }
        let file = tmpfile(dir, size)?;
        copy_blocks(&kept, &file, &present, size).map_err(|e| kept_err(e.to_string()))?;
        Ok(Self { file, present })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    struct Base(PathBuf, File);

    impl Drop for Base {
        fn drop(&mut self) {
            let _ = std::fs::remove_file(&self.0);
        }
    }

    /// A base image of `size` bytes, byte i = i / 512 (its sector number, truncated).
    fn base(size: u64) -> Base {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let path = std::env::temp_dir().join(format!(
            "forkvm-overlay-base-{}-{}",
            std::process::id(),
            N.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        let data: Vec<u8> = (0..size).map(|i| (i / 512) as u8).collect();
        std::fs::write(&path, &data).unwrap();
        let f = File::open(&path).unwrap();
        Base(path, f)
    }

    fn dir() -> PathBuf {
        std::env::temp_dir()
    }

    #[test]
    fn reads_fall_through_to_the_base_and_writes_stay_in_the_overlay() {
        let b = base(64 * 1024);
        let before = std::fs::read(&b.0).unwrap();
        let mut o = Overlay::create(&dir(), 64 * 1024).unwrap();
        let mut buf = vec![0u8; 1024];
        o.read_at(&b.1, &mut buf, 8192).unwrap();
        assert_eq!(buf[..512], [16u8; 512]);
        // A 100-byte write in the middle of block 2: the block is copied in whole.
        o.write_at(&b.1, &[0xaa; 100], 8192 + 1000).unwrap();
        assert_eq!(o.blocks_present(), 1);
        let mut block = vec![0u8; 4096];
        o.read_at(&b.1, &mut block, 8192).unwrap();
        assert_eq!(block[..512], [16u8; 512], "rest of the block from the base");
        assert_eq!(block[1000..1100], [0xaa; 100]);
        assert_eq!(block[1100..1536], [18u8; 436]);
        // A write across a block boundary, and a whole block.
        o.write_at(&b.1, &[0xbb; 200], 3 * 4096 - 100).unwrap();
        o.write_at(&b.1, &[0xcc; 4096], 5 * 4096).unwrap();
        assert_eq!(o.blocks_present(), 3, "blocks 2, 3 and 5");
        let mut span = vec![0u8; 300];
        o.read_at(&b.1, &mut span, 3 * 4096 - 150).unwrap();
        assert_eq!(span[..50], [23u8; 50]);
        assert_eq!(span[50..250], [0xbb; 200]);
        assert_eq!(span[250..], [24u8; 50]);
        o.flush().unwrap();
        assert_eq!(
            std::fs::read(&b.0).unwrap(),
            before,
            "the base is never written"
        );
    }

    #[test]
    fn a_snapshot_holds_the_same_blocks_and_then_goes_its_own_way() {
        let b = base(40 * 1024 + 512); // Not a whole number of blocks.
        let mut o = Overlay::create(&dir(), 40 * 1024 + 512).unwrap();
        o.write_at(&b.1, &[1; 4096], 0).unwrap();
        o.write_at(&b.1, &[2; 10], 40 * 1024 + 100).unwrap();
        let copy = o.snapshot().unwrap();
        let mut c = Overlay::from_snapshot(copy, &dir(), 40 * 1024 + 512);
        assert_eq!(c.blocks_present(), 2);
        let mut tail = vec![0u8; 512];
        c.read_at(&b.1, &mut tail, 40 * 1024).unwrap();
        assert_eq!(tail[100..110], [2; 10]);
        assert_eq!(tail[..100], [80u8; 100]);
        // Writes after the snapshot are private to each side.
        o.write_at(&b.1, &[3; 4096], 4096).unwrap();
        c.write_at(&b.1, &[4; 4096], 0).unwrap();
        let mut x = vec![0u8; 8192];
        o.read_at(&b.1, &mut x, 0).unwrap();
        assert_eq!((x[0], x[4096]), (1, 3));
        c.read_at(&b.1, &mut x, 0).unwrap();
        assert_eq!((x[0], x[4096]), (4, 8), "block 1 from the base in the copy");
    }

    #[test]
    fn a_spare_made_before_writes_serves_the_next_snapshot_with_them() {
        let b = base(16 * 1024);
        let mut o = Overlay::create(&dir(), 16 * 1024).unwrap();
        let (d, size) = o.wants_spare().unwrap();
        o.set_spare(Overlay::new_spare(&d, size).unwrap());
        assert!(o.wants_spare().is_none());
        // Written after the spare was made: the snapshot must still hold it.
        o.write_at(&b.1, &[5; 4096], 8192).unwrap();
        let copy = o.snapshot().unwrap();
        assert!(o.wants_spare().is_some(), "the spare went to the snapshot");
        let c = Overlay::from_snapshot(copy, &dir(), 16 * 1024);
        assert_eq!(c.blocks_present(), 1);
        let mut x = vec![0u8; 4096];
        c.read_at(&b.1, &mut x, 8192).unwrap();
        assert_eq!(x, [5; 4096]);
        assert_eq!(c.file.metadata().unwrap().len(), 16 * 1024);
        // Without a spare, a snapshot makes its own file.
        let again = o.snapshot().unwrap();
        assert_eq!(
            Overlay::from_snapshot(again, &dir(), 16 * 1024).blocks_present(),
            1
        );
    }

    #[test]
    fn a_write_the_host_refuses_fails_and_leaves_the_blocks_to_the_base() {
        let b = base(16 * 1024);
        let mut o = Overlay::create(&dir(), 16 * 1024).unwrap();
        o.write_at(&b.1, &[7; 4096], 0).unwrap();
        // A full file system: /dev/full refuses every write with ENOSPC.
        o.file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/full")
            .unwrap();
        for (at, len) in [(4096, 4096), (8192 + 100, 10)] {
            let e = o.write_at(&b.1, &vec![9; len], at).unwrap_err();
            assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
        }
        assert_eq!(o.blocks_present(), 1, "failed writes mark no block");
        let mut x = vec![0u8; 4096];
        o.read_at(&b.1, &mut x, 8192).unwrap();
        assert_eq!(x[..512], [16u8; 512], "block 2 still from the base");
    }

    #[test]
    fn a_kept_overlay_has_a_name_and_a_block_map() {
        let b = base(3 * 4096 + 512);
        let d = std::env::temp_dir().join(format!("forkvm-keep-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let mut o = Overlay::create(&d, 3 * 4096 + 512).unwrap();
        o.write_at(&b.1, &[5; 10], 4096 + 7).unwrap();
        let path = d.join("vm-disk0.overlay");
        o.keep(&path).unwrap();
        let data = std::fs::read(&path).unwrap();
        assert_eq!(data.len(), 3 * 4096 + 512);
        assert_eq!(data[4096 + 7..4096 + 17], [5; 10]);
        assert_eq!(
            data[4096..4096 + 7],
            [8u8; 7],
            "the rest of the block, from the base"
        );
        let map = std::fs::read(path.with_extension("blocks")).unwrap();
        assert_eq!(map, 2u64.to_le_bytes(), "block 1 only");
        let e = o.keep(&path).unwrap_err().to_string();
        assert!(
            e.contains("vm-disk0.overlay") && e.contains("exists"),
            "{e}"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_kept_overlay_is_taken_up_again_as_a_copy_that_goes_its_own_way() {
        let size = 5 * 4096 + 100;
        let b = base(size);
        let d = std::env::temp_dir().join(format!("forkvm-kept-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        let mut o = Overlay::create(&d, size).unwrap();
        o.write_at(&b.1, &[7; 5000], 3000).unwrap();
        o.write_at(&b.1, &[9; 50], 5 * 4096 + 10).unwrap();
        let path = d.join("disk0.overlay");
        o.keep(&path).unwrap();
        let read_all = |o: &Overlay| {
            let mut all = vec![0u8; size as usize];
            o.read_at(&b.1, &mut all, 0).unwrap();
            all
        };
        let kept = read_all(&o);
        let mut again = Overlay::from_kept(&path, &d, size).unwrap();
        assert_eq!(again.blocks_present(), o.blocks_present());
        assert_eq!(read_all(&again), kept);
        // Its writes are its own: the kept file, and a second take, are as kept.
        again.write_at(&b.1, &[1; 4096], 0).unwrap();
        let twice = Overlay::from_kept(&path, &d, size).unwrap();
        assert_eq!(read_all(&twice), kept);
        // A saved copy (a snapshot's) is taken up the same way; the overlay goes on,
        // and the copy is a new file, never one that exists.
        let saved = d.join("disk1.overlay");
        again.save_copy(&saved).unwrap();
        let mode = std::fs::metadata(&saved).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600);
        let of_copy = Overlay::from_kept(&saved, &d, size).unwrap();
        assert_eq!(read_all(&of_copy), read_all(&again));
        again.write_at(&b.1, &[2; 10], 0).unwrap();
        assert_ne!(read_all(&of_copy), read_all(&again));
        let e = again.save_copy(&saved).unwrap_err().to_string();
        assert!(e.contains("disk1.overlay") && e.contains("exists"), "{e}");
        // A disk of another size, a damaged map, no map: refused, each saying why.
        let e = Overlay::from_kept(&path, &d, size + 4096)
            .unwrap_err()
            .to_string();
        assert!(e.contains("bytes long"), "{e}");
        let map = path.with_extension("blocks");
        std::fs::write(&map, [0xff; 8]).unwrap();
        let e = Overlay::from_kept(&path, &d, size).unwrap_err().to_string();
        assert!(e.contains("beyond the disk"), "{e}");
        std::fs::write(&map, [0xff; 9]).unwrap();
        let e = Overlay::from_kept(&path, &d, size).unwrap_err().to_string();
        assert!(e.contains("block map is 9 bytes"), "{e}");
        std::fs::remove_file(&map).unwrap();
        let e = Overlay::from_kept(&path, &d, size).unwrap_err().to_string();
        assert!(e.contains("disk0.blocks"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_overlay_directory_that_cannot_hold_one_is_a_clear_error() {
        let e = Overlay::create(Path::new("/nonexistent/overlays"), 4096).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/overlays"), "{e}");
    }
}
