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

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};

use crate::images::{ImageCache, ImageError, ImageHold};

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

/// Package sets on this host, in one directory: their images (an [`ImageCache`]) and
/// what each list of requirements resolved to.
#[derive(Debug, Clone)]
pub struct PackageCache {
    images: ImageCache,
    /// The host Python whose pip resolves ([`DEFAULT_PYTHON`]).
    python: Arc<PathBuf>,
}

/// Keeps a package set's image from eviction while it lives ([`PackageCache::hold`]).
pub type PackageHold = ImageHold;

impl From<ImageError> for PackageError {
    fn from(e: ImageError) -> Self {
        match e {
            ImageError::Budget { need, budget } => PackageError::Budget { need, budget },
            ImageError::Io { path, source } => PackageError::Io { path, source },
            e => PackageError::Image(e.to_string()),
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
        Ok(Self {
            images: ImageCache::new(dir, budget)?,
            python: Arc::new(python.into()),
        })
    }

    /// Keeps set `key`'s image from eviction until the hold is dropped.
    pub fn hold(&self, key: &str) -> PackageHold {
        self.images.hold(key)
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
        let dir = self.images.dir();
        let index = dir.join(format!("requirements-{asked}.json"));
        if let Some(set) = self.known(&index) {
            return Ok(set);
        }
        let started = std::time::Instant::now();
        let scratch = tempfile::Builder::new()
            .prefix("resolving-")
            .tempdir_in(dir)
            .map_err(io(dir))?;
        let site = scratch.path().join("site");
        self.pip_install(&sorted, source, &site).await?;
        let resolved = installed(&site).map_err(io(&site))?;
        let key = hex(&format!(
            "cp311 x86_64 {}\n{}",
            PLATFORMS.join(" "),
            resolved.join("\n")
        ))[..16]
            .to_string();
        let (image, built) = self.images.build(&key, &site).await?;
        let set = PackageSet {
            key,
            image,
            resolved,
            built,
            took: started.elapsed(),
        };
        let record = serde_json::json!({"key": set.key, "resolved": set.resolved});
        std::fs::write(&index, record.to_string()).map_err(io(&index))?;
        Ok(set)
    }

    /// The set these requirements resolved to before, if its image is still there.
    fn known(&self, index: &Path) -> Option<PackageSet> {
        let text = std::fs::read_to_string(index).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        let key = v["key"].as_str()?.to_string();
        let image = self.images.get(&key)?;
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
        let mut pip = tokio::process::Command::new(&*self.python);
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
            python: self.python.to_path_buf(),
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

fn hex(text: &str) -> String {
    Sha256::digest(text.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}
