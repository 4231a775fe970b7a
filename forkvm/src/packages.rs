//! Package sets, SOCK's install cache at VM level: a function's PyPI requirements
//! resolved on the host with pip into the installed distributions for the guest's Python
//! (Debian's CPython 3.11 on x86_64: wheels only, `manylinux` or `linux` platform tags),
//! made once into a read-only ext4 image and kept in a cache directory under the exact
//! versions pip chose. A function's template is derived with the image in a disk slot
//! (`InvokeOptions::media`) and its loader mounts it first on `sys.path` (the load's
//! `disks`): two functions with the same requirements share one image.
//!
//! The cache has a size budget: once over it, the least recently used images go, never
//! one [`PackageCache::hold`] keeps (a live template's). Requirements already resolved
//! once are not given to pip again: what they resolved to is kept beside the images.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};

/// The guest's Python, as pip is told to resolve for it.
pub const GUEST_PYTHON: &str = "3.11";
/// The host Python whose pip resolves by default: Debian's, with `python3-pip`.
pub const DEFAULT_PYTHON: &str = "/usr/bin/python3";
/// The platform tags of wheels the guest's Python can load.
const PLATFORMS: &[&str] = &[
    "manylinux2014_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux_2_28_x86_64",
    "linux_x86_64",
];

/// Where pip takes distributions from.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum PackageSource {
    /// The package index pip is configured with (PyPI by default).
    Index,
    /// Only wheels in this directory (`--no-index --find-links DIR`), for hosts that
    /// reach no index.
    FindLinks(PathBuf),
}

/// A package set: the image of what a list of requirements resolved to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackageSet {
    /// Its name in the cache: a hash of the resolved distributions and the guest's
    /// Python and platform.
    pub key: String,
    /// The read-only ext4 image.
    pub image: PathBuf,
    /// The distributions in it, `name==version`, sorted.
    pub resolved: Vec<String>,
    /// Whether this call built the image (false: it was in the cache).
    pub built: bool,
    /// How long this call's pip and image took (zero when the requirements' set came
    /// from the cache).
    pub took: std::time::Duration,
}

/// Why a package set could not be made; nothing of it is left behind.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PackageError {
    /// A requirement pip would read as something else (an option, several lines).
    #[error("{0:?} is no requirement (a name with an optional version: pyyaml==6.0.1)")]
    Requirement(String),
    /// pip could not resolve or install them for the guest's Python.
    #[error("pip could not install the requirements for Python {GUEST_PYTHON} on x86_64: {0}")]
    Resolve(String),
    /// The host's pip could not be run.
    #[error("cannot run {} -m pip (Debian's python3-pip): {source}", python.display())]
    Pip {
        /// The Python it was run with.
        python: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The image could not be built.
    #[error("cannot build the package image: {0}")]
    Image(String),
    /// One set is larger than the whole cache may be.
    #[error("the package set needs {need} bytes, more than the cache's budget of {budget}")]
    Budget {
        /// Its image's size.
        need: u64,
        /// The cache's budget.
        budget: u64,
    },
    /// The cache directory failed.
    #[error("package cache {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Package sets on this host, in one directory.
#[derive(Debug, Clone)]
pub struct PackageCache {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    dir: PathBuf,
    budget: u64,
    /// The host Python whose pip resolves ([`DEFAULT_PYTHON`]).
    python: PathBuf,
    /// Images kept from eviction, and by how many holders.
    held: Mutex<HashMap<String, usize>>,
}

/// Keeps a package set's image from eviction while it lives ([`PackageCache::hold`]).
#[derive(Debug)]
pub struct PackageHold {
    cache: Arc<Inner>,
    key: String,
}

impl Drop for PackageHold {
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

impl PackageError {
    /// Whether the requirements are to blame (retrying them fails again), not the host.
    pub fn is_callers(&self) -> bool {
        matches!(
            self,
            PackageError::Requirement(_) | PackageError::Resolve(_) | PackageError::Budget { .. }
        )
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> PackageError + '_ {
    move |source| PackageError::Io {
        path: path.to_path_buf(),
        source,
    }
}

impl PackageCache {
    /// A cache in `dir` (made if missing) of at most `budget` bytes of images, resolving
    /// with [`DEFAULT_PYTHON`]` -m pip`.
    pub fn new(dir: impl Into<PathBuf>, budget: u64) -> Result<Self, PackageError> {
        Self::with_python(dir, budget, DEFAULT_PYTHON)
    }

    /// [`PackageCache::new`] resolving with `python`'s pip.
    pub fn with_python(
        dir: impl Into<PathBuf>,
        budget: u64,
        python: impl Into<PathBuf>,
    ) -> Result<Self, PackageError> {
        let dir = dir.into();
        std::fs::create_dir_all(&dir).map_err(io(&dir))?;
        Ok(Self {
            inner: Arc::new(Inner {
                dir,
                budget,
                python: python.into(),
                held: Mutex::default(),
            }),
        })
    }

    /// The image's path of set `key`.
    fn image_of(&self, key: &str) -> PathBuf {
        self.inner.dir.join(format!("{key}.ext4"))
    }

    /// Keeps set `key`'s image from eviction until the hold is dropped.
    pub fn hold(&self, key: &str) -> PackageHold {
        *lock(&self.inner.held).entry(key.to_string()).or_default() += 1;
        PackageHold {
            cache: self.inner.clone(),
            key: key.to_string(),
        }
    }

    /// The package set of `requirements` from `source`: from the cache when these
    /// requirements were resolved before and their image is still there, else pip
    /// installs them into a scratch directory, which becomes the image.
    pub async fn resolve(
        &self,
        requirements: &[String],
        source: &PackageSource,
    ) -> Result<PackageSet, PackageError> {
        for r in requirements {
            let bad = r.is_empty() || r.starts_with('-') || r.contains(['\n', '\r', '\0', ' ']);
            if bad {
                return Err(PackageError::Requirement(r.clone()));
            }
        }
        let mut sorted = requirements.to_vec();
        sorted.sort();
        sorted.dedup();
        let asked = hex(&format!("{source:?}\n{}", sorted.join("\n")))[..16].to_string();
        let index = self.inner.dir.join(format!("requirements-{asked}.json"));
        if let Some(set) = self.known(&index) {
            return Ok(set);
        }
        let started = std::time::Instant::now();
        let scratch = tempfile::Builder::new()
            .prefix("resolving-")
            .tempdir_in(&self.inner.dir)
            .map_err(io(&self.inner.dir))?;
        let site = scratch.path().join("site");
        self.pip_install(&sorted, source, &site).await?;
        let resolved = installed(&site).map_err(io(&site))?;
        let key = hex(&format!(
            "cp311 x86_64 {}\n{}",
            PLATFORMS.join(" "),
            resolved.join("\n")
        ))[..16]
            .to_string();
        let image = self.image_of(&key);
        let built = !image.exists();
        if built {
            build_image(&site, &image, scratch.path(), self.inner.budget).await?;
        }
        touch(&image);
        let set = PackageSet {
            key,
            image,
            resolved,
            built,
            took: started.elapsed(),
        };
        let record = serde_json::json!({"key": set.key, "resolved": set.resolved});
        std::fs::write(&index, record.to_string()).map_err(io(&index))?;
        self.evict(&set.key);
        Ok(set)
    }

    /// The set these requirements resolved to before, if its image is still there.
    fn known(&self, index: &Path) -> Option<PackageSet> {
        let text = std::fs::read_to_string(index).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        let key = v["key"].as_str()?.to_string();
        let image = self.image_of(&key);
        if !image.exists() {
            return None;
        }
        touch(&image);
        let resolved = (v["resolved"].as_array()?.iter())
            .filter_map(|r| r.as_str().map(String::from))
            .collect();
        Some(PackageSet {
            key,
            image,
            resolved,
            built: false,
            took: std::time::Duration::ZERO,
        })
    }

    async fn pip_install(
        &self,
        requirements: &[String],
        source: &PackageSource,
        site: &Path,
    ) -> Result<(), PackageError> {
        let mut pip = tokio::process::Command::new(&self.inner.python);
        pip.args([
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "--quiet",
        ])
        .args([
            "--no-compile",
            "--only-binary=:all:",
            "--implementation",
            "cp",
        ])
        .args(["--python-version", GUEST_PYTHON, "--abi", "cp311"])
        .arg("--target")
        .arg(site);
        for p in PLATFORMS {
            pip.args(["--platform", p]);
        }
        if let PackageSource::FindLinks(dir) = source {
            pip.arg("--no-index").arg("--find-links").arg(dir);
        }
        pip.arg("--").args(requirements);
        pip.stdin(std::process::Stdio::null()).kill_on_drop(true);
        let out = pip.output().await.map_err(|source| PackageError::Pip {
            python: self.inner.python.clone(),
            source,
        })?;
        if !out.status.success() {
            let text = String::from_utf8_lossy(&out.stderr);
            let tail: Vec<&str> = text.lines().rev().take(12).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(PackageError::Resolve(tail.join("\n")));
        }
        Ok(())
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
                Some((meta.modified().ok()?, meta.len(), key, path))
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
                tracing::info!("package cache: evicted {key} ({len} bytes)");
                total -= len;
            }
        }
    }
}

/// The distributions installed in `site`, `name==version` (from the `.dist-info`
/// directories' names), sorted.
fn installed(site: &Path) -> std::io::Result<Vec<String>> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(site)? {
        let name = e?.file_name();
        let Some(stem) = name.to_str().and_then(|n| n.strip_suffix(".dist-info")) else {
            continue;
        };
        if let Some((dist, version)) = stem.rsplit_once('-') {
            found.push(format!(
                "{}=={version}",
                dist.to_lowercase().replace('_', "-")
            ));
        }
    }
    found.sort();
    Ok(found)
}

/// An ext4 image of `site` at `image` (built beside it in `scratch`, then moved there):
/// its files, owned by root, with room for the file system's own structures.
async fn build_image(
    site: &Path,
    image: &Path,
    scratch: &Path,
    budget: u64,
) -> Result<(), PackageError> {
    let (bytes, files) = tree_size(site).map_err(io(site))?;
    // Data rounded to blocks, inodes, journal-less metadata: generous, then whole MiB.
    let need = (bytes + files * 4096) * 5 / 4 + (8 << 20);
    let need = need.div_ceil(1 << 20) << 20;
    if need > budget {
        return Err(PackageError::Budget { need, budget });
    }
    let tmp = scratch.join("image.ext4");
    let out = tokio::process::Command::new("mkfs.ext4")
        .args([
            "-q",
            "-F",
            "-O",
            "^has_journal",
            "-E",
            "root_owner=0:0",
            "-L",
            "forkvm-pkgs",
        ])
        .arg("-d")
        .arg(site)
        .arg(&tmp)
        .arg(format!("{}k", need >> 10))
        .stdin(std::process::Stdio::null())
        .output()
        .await
        .map_err(|e| PackageError::Image(format!("cannot run mkfs.ext4: {e}")))?;
    if !out.status.success() {
        return Err(PackageError::Image(
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

/// Marks `path` used now (its modification time orders eviction).
fn touch(path: &Path) {
    if let Ok(f) = std::fs::File::options().write(true).open(path) {
        let _ = f.set_modified(std::time::SystemTime::now());
    }
}

fn hex(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
