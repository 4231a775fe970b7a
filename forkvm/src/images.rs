//! Images of directory trees for disk slots: ext4 file systems built once on the host
//! (`mkfs.ext4 -d`, no journal, every file owned by root), each named by a key in one
//! cache directory (`KEY.ext4`), kept to a byte budget by evicting the least recently
//! used, never one a [`ImageCache::hold`] keeps. A package set's image is one
//! ([`crate::PackageCache`]); a container's root file system is meant to be another.
//!
//! Building an image is cheap beside what it saves: `mkfs.ext4 -d` of a 122 MB tree of
//! 3,679 files took 0.47 s on the development host (docs/design.md).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

/// Why an image could not be built or kept; nothing of it is left behind.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ImageError {
    /// A key that cannot name a file in the cache directory.
    #[error("{0:?} is no image key (letters, digits, '.', '_' or '-', not first a '.')")]
    Key(String),
    /// The image would be larger than the whole cache may be.
    #[error("the image needs {need} bytes, more than the cache's budget of {budget}")]
    Budget {
        /// Its size.
        need: u64,
        /// The cache's budget.
        budget: u64,
    },
    /// `mkfs.ext4` could not build it.
    #[error("cannot build the image: {0}")]
    Build(String),
    /// The cache directory or the tree failed.
    #[error("image cache {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Images in one directory (`Clone` is cheap: clones share the holds).
#[derive(Debug, Clone)]
pub struct ImageCache {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    budget: u64,
    /// Images kept from eviction, and by how many holders.
    held: Mutex<HashMap<String, usize>>,
}

/// Keeps an image from eviction while it lives ([`ImageCache::hold`]).
#[derive(Debug)]
pub struct ImageHold {
    cache: Arc<Inner>,
    key: String,
}

impl Drop for ImageHold {
    fn drop(&mut self) {
        let mut held = lock(&self.cache.held);
        if let Some(n) = held.get_mut(&self.key) {
            *n -= 1;
            if *n == 0 {
                held.remove(&self.key);
            }
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn io(path: &Path) -> impl FnOnce(std::io::Error) -> ImageError + '_ {
    move |source| ImageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl ImageCache {
    /// A cache in `dir` (made if missing) of at most `budget` bytes of images.
    pub fn new(dir: impl Into<PathBuf>, budget: u64) -> Result<Self, ImageError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        Ok(Self {
            inner: Arc::new(Inner {
                dir,
                budget,
                held: Mutex::default(),
            }),
        })
    }

    /// The cache directory.
    pub fn dir(&self) -> &Path {
        &self.inner.dir
    }

    /// Where image `key` is (whether or not it is there now).
    pub fn image_of(&self, key: &str) -> PathBuf {
        self.inner.dir.join(format!("{key}.ext4"))
    }

    /// Image `key`, marked used now, if it is in the cache.
    pub fn get(&self, key: &str) -> Option<PathBuf> {
        let image = self.image_of(key);
        image.exists().then(|| {
            touch(&image);
            image
        })
    }

    /// Keeps image `key` from eviction until the hold is dropped (it need not exist
    /// yet: an image built while held is kept too).
    pub fn hold(&self, key: &str) -> ImageHold {
        *lock(&self.inner.held).entry(key.to_string()).or_default() += 1;
        ImageHold {
            cache: self.inner.clone(),
            key: key.to_string(),
        }
    }

    /// Image `key` of the directory `tree`: from the cache when it is there, else built
    /// (beside the cache's images, then moved in place), after which the least recently
    /// used images go until the cache fits its budget (never this one or a held one).
    /// Returns the image and whether this call built it.
    pub async fn build(&self, key: &str, tree: &Path) -> Result<(PathBuf, bool), ImageError> {
        let ok = !key.is_empty()
            && !key.starts_with('.')
            && (key.bytes()).all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
        if !ok {
            return Err(ImageError::Key(key.to_string()));
        }
        if let Some(image) = self.get(key) {
            return Ok((image, false));
        }
        let scratch = tempfile::Builder::new()
            .prefix("building-")
            .tempdir_in(&self.inner.dir)
            .map_err(io(&self.inner.dir))?;
        let image = self.image_of(key);
        build_image(tree, &image, scratch.path(), self.inner.budget).await?;
        touch(&image);
        self.evict(key);
        Ok((image, true))
    }

    /// Removes the least recently used images until the cache fits its budget, never
    /// `keep` or a held one.
    fn evict(&self, keep: &str) {
        let Ok(entries) = std::fs::read_dir(&self.inner.dir) else {
            return;
        };
        let mut images: Vec<(std::time::SystemTime, u64, String, PathBuf)> = entries
            .flatten()
            .filter_map(|e| {
                let path = e.path();
                let key = path
                    .file_name()?
                    .to_str()?
                    .strip_suffix(".ext4")?
                    .to_string();
                let meta = e.metadata().ok()?;
                Some((meta.accessed().ok()?, meta.len(), key, path))
            })
            .collect();
        let mut total: u64 = images.iter().map(|i| i.1).sum();
        images.sort();
        let held = lock(&self.inner.held);
        for (_, len, key, path) in images {
            if total <= self.inner.budget {
                break;
            }
            if key == keep || held.contains_key(&key) {
                continue;
            }
            if std::fs::remove_file(&path).is_ok() {
                tracing::info!("image cache: evicted {key} ({len} bytes)");
                total -= len;
            }
        }
    }
}

/// An ext4 image of `tree` at `image` (built beside it in `scratch`, then moved there):
/// its files, owned by root, with room for the file system's own structures.
async fn build_image(
    tree: &Path,
    image: &Path,
    scratch: &Path,
    budget: u64,
) -> Result<(), ImageError> {
    let (bytes, files) = tree_size(tree).map_err(io(tree))?;
    // Data rounded to blocks, inodes, journal-less metadata: generous, then whole MiB.
    let need = (bytes + files * 4096) * 5 / 4 + (8 << 20);
    let need = need.div_ceil(1 << 20) << 20;
    if need > budget {
        return Err(ImageError::Budget { need, budget });
    }
    let tmp = scratch.join("image.ext4");
    let out = tokio::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-O",
            "^has_journal",
            "-E",
            // Inode tables zeroed here: a guest that mounts the image writable would
            // otherwise start a kernel thread that zeroes them, writing to its overlay.
            "root_owner=0:0,lazy_itable_init=0",
            "-L",
            "forkvm-image",
        ])
        .arg("-d")
        .arg(tree)
        .arg(&tmp)
        .arg(format!("{}k", need >> 10))
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| ImageError::Build(format!("cannot run mkfs.ext4: {e}")))?;
    if !out.status.success() {
        return Err(ImageError::Build(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    std::fs::rename(&tmp, image).map_err(io(image))
}

/// Bytes and files under `dir`.
fn tree_size(dir: &Path) -> std::io::Result<(u64, u64)> {
    let (mut bytes, mut files) = (0, 0);
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let meta = e.metadata()?;
        files += 1;
        if meta.is_dir() {
            let (b, f) = tree_size(&e.path())?;
            bytes += b;
            files += f;
        } else {
            bytes += meta.len();
        }
    }
    Ok((bytes, files))
}

/// Marks `path` used now: its access time orders eviction. Not its modification time,
/// which a snapshot of a VM with the image in a slot records as the image's version
/// (a restore refuses an image modified since).
fn touch(path: &Path) {
    if let Ok(f) = std::fs::File::open(path) {
        let times = std::fs::FileTimes::new().set_accessed(std::time::SystemTime::now());
        let _ = f.set_times(times);
    }
}
