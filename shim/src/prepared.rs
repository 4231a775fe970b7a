//! An image's template: a snapshot of the shim's template with the image in its slot,
//! mounted as a container's root file system and the container's program read into the
//! guest's page cache (`forkvm-oci --prepare`). Each later container of the image is a
//! clone of it, and finds its root file system mounted and its program warm: the mount
//! and the first reads of the disk are the guest kernel's slowest work in a container's
//! start. Made once per image (`FORKVM_SHIM_DIR/prepared-<template>-<image>`), by the
//! image's first container.

use std::path::{Path, PathBuf};

use forkvm::{CreateClones, InsertMedium, ProcessEvent, VmClone};

use crate::config::{self, dir_error, ShimConfig, TemplateError, AGENT_PORT};
use crate::spec::GuestMount;
use crate::templates::client::{self, Keeper, LeaseError};

/// Why an image's template could not be made (the container then starts from the
/// shim's template, its image inserted into its clone).
#[derive(Debug, thiserror::Error)]
pub enum PrepareError {
    /// The template or the directory failed.
    #[error(transparent)]
    Template(#[from] TemplateError),
    /// The VMM failed.
    #[error(transparent)]
    Vmm(#[from] forkvm::Error),
    /// `forkvm-oci --prepare` failed in the guest.
    #[error("forkvm-oci --prepare exited {status}: {output}")]
    Guest {
        /// Its status.
        status: i32,
        /// What it printed.
        output: String,
    },
}

/// Where image `key`'s template is, made from the shim's template at `base`.
pub fn path(cfg: &ShimConfig, base: &Path, key: &str) -> PathBuf {
    let hash = base.file_name().map(|n| n.to_string_lossy().into_owned());
    let hash = hash.unwrap_or_default().replace("template-", "");
    cfg.dir.join(format!("prepared-{hash}-{key}"))
}

/// Removes the image templates whose image is no longer in the image cache (evicted:
/// they could not be restored), each under its lock, and the lock files left of them.
fn prune(cfg: &ShimConfig) {
    for e in std::fs::read_dir(&cfg.dir).into_iter().flatten().flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("prepared-") else {
            continue;
        };
        // prepared-<template hash>-<image key>, and its lock file beside it.
        let Some((_, key)) = rest.trim_end_matches(".lock").split_once('-') else {
            continue;
        };
        let image = cfg.dir.join("images").join(format!("{key}.ext4"));
        if image.exists() {
            continue;
        }
        if e.path().is_dir() {
            let _lock = config::lock(&e.path().with_extension("lock")).ok();
            let _ = std::fs::remove_dir_all(e.path());
            log::info!("removed {name}: its image is gone");
        } else if name.ends_with(".lock") && !e.path().with_extension("").exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// The file in an image's template that lists the mount points it made and the file
/// systems it mounted there, as `forkvm-oci --prepare` printed them ("made DIR",
/// "mounted tmpfs DIR", "mounted mqueue DIR"), one a line.
const MADE: &str = "made-mount-points";

/// What an image's template made for its first container: the mount points, and the
/// file systems of the guest's mounted there.
#[derive(Debug, Default)]
pub struct Made {
    /// The directories made in its root file system.
    pub dirs: Vec<String>,
    /// The mounts (`forkvm-oci` flag, directory).
    pub mounts: Vec<GuestMount>,
}

impl Made {
    /// What `forkvm-oci --prepare` printed.
    fn parse(text: &str) -> Self {
        let mut made = Made::default();
        for line in text.lines() {
            let mut words = line.split(' ');
            match (words.next(), words.next(), words.next()) {
                (Some("made"), Some(dir), None) => made.dirs.push(dir.into()),
                (Some("mounted"), Some(kind @ ("tmpfs" | "mqueue")), Some(dir)) => {
                    made.mounts.push((format!("--{kind}"), dir.into()))
                }
                _ => {}
            }
        }
        made
    }
}

/// How long the agent may take to close the connection after `--prepare` ended.
const CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Image `key`'s template (`image` in slot 0, writable), made now if there is none
/// (one shim at a time: a lock file), warmed for `program` run with environment `env`,
/// with the file systems `mounts` mounted (their mount points made) in its root.
pub async fn prepared(
    cfg: &ShimConfig,
    base: &Path,
    key: &str,
    image: &Path,
    program: &str,
    env: &[String],
    mounts: &[GuestMount],
) -> Result<PathBuf, PrepareError> {
    let dir = path(cfg, base, key);
    if dir.join("state").exists() {
        return Ok(dir);
    }
    let lock_path = dir.with_extension("lock");
    let _lock = config::lock(&lock_path)?;
    if dir.join("state").exists() {
        return Ok(dir);
    }
    prune(cfg);
    let started = std::time::Instant::now();
    let vsock = cfg.vsock(&dir.display().to_string());
    let template = config::template(cfg, base, &vsock, "", 0).await?;
    let request = CreateClones {
        media: vec![InsertMedium {
            slot: 0,
            path: image.to_path_buf(),
            writable: true,
        }],
        ..Default::default()
    };
    let made = async {
        let clone = (template.create_clones(&request).await?.pop())
            .ok_or_else(|| forkvm::Error::Agent("no clone was made".into()))?;
        let mut argv: Vec<String> = ["forkvm-oci", "--slot", "0", "--prepare"]
            .map(String::from)
            .to_vec();
        for e in env {
            argv.extend(["--env".into(), e.clone()]);
        }
        for (flag, dir) in mounts {
            argv.extend([flag.clone(), dir.clone()]);
        }
        argv.extend(["--".into(), program.to_string()]);
        let mut process = clone.spawn(AGENT_PORT, &argv, b"").await?;
        let mut output = Vec::new();
        let status = loop {
            match process.output.next().await {
                Some(Ok(ProcessEvent::Stdout(b) | ProcessEvent::Stderr(b))) => output.extend(b),
                Some(Ok(ProcessEvent::Exit(status))) => break status,
                Some(Ok(_)) => {}
                Some(Err(e)) => return Err(PrepareError::Vmm(e)),
                None => break 255,
            }
        };
        let output = String::from_utf8_lossy(&output).into_owned();
        if status != 0 {
            return Err(PrepareError::Guest { status, output });
        }
        // The guest process that ran it gone before the pause, so that no clone
        // finishes its exit (tens of thousands of emulated instructions each here).
        if tokio::time::timeout(CLOSE_WAIT, process.output.closed())
            .await
            .is_err()
        {
            log::warn!("image {key}: the agent kept the connection past the preparation");
        }
        clone.pause().await?;
        let tmp = dir.with_extension(format!("saving-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        clone.snapshot(&tmp).await?;
        let made: String = (output.lines())
            .filter(|l| l.starts_with("made ") || l.starts_with("mounted "))
            .map(|l| format!("{l}\n"))
            .collect();
        std::fs::write(tmp.join(MADE), made).map_err(dir_error(&tmp))?;
        let _ = clone.delete().await;
        std::fs::rename(&tmp, &dir).map_err(dir_error(&dir))?;
        Ok(())
    }
    .await;
    let _ = template.shutdown().await;
    let _ = std::fs::remove_file(&vsock);
    made?;
    log::info!(
        "image {key}: its template made in {:.0} ms",
        started.elapsed().as_secs_f64() * 1e3
    );
    Ok(dir)
}

/// The template of image `image` (key `key`) for a container running `process` with
/// the guest's file systems `mounts`: its snapshot, made now if there is none
/// ([`prepared()`]), and what it made in the root file system (for its first
/// container). None if it cannot be made: the container then starts from the shim's
/// template.
pub async fn snapshot(
    cfg: &ShimConfig,
    base: &Path,
    key: &str,
    image: &Path,
    process: &oci_spec::runtime::Process,
    mounts: &[GuestMount],
) -> Option<(PathBuf, Made)> {
    let program = process.args().as_ref()?.first()?;
    let env = process.env().clone().unwrap_or_default();
    match prepared(cfg, base, key, image, program, &env, mounts).await {
        Ok(dir) => {
            let made = Made::parse(&std::fs::read_to_string(dir.join(MADE)).unwrap_or_default());
            Some((dir, made))
        }
        Err(e) => {
            log::warn!("image {key}: no template of its own: {e}");
            None
        }
    }
}

/// A clone of the image template at `dir` (image `key`) whose cgroup has the limits
/// `limits`, lent by the template service, or, when no service can be reached or
/// started, of the template restored here (its vsock socket at `vsock`), and what keeps
/// it. None if
/// the snapshot cannot be restored (its image rebuilt or gone): it is removed, and the
/// container starts from the shim's template. An error if the service refused (its
/// template's cgroup pool exhausted, say): the container's creation fails with it.
pub async fn lend(
    cfg: &ShimConfig,
    key: &str,
    dir: &Path,
    vsock: &Path,
    limits: &str,
) -> Result<Option<(Keeper, VmClone)>, String> {
    let restored = match client::lease(cfg, dir, limits, None).await {
        Ok((clone, lease)) => return Ok(Some((Keeper::Lease(lease), clone))),
        Err(e @ LeaseError::Restore(_)) => Err(e.to_string()),
        Err(e @ LeaseError::Unreachable { .. }) => {
            log::warn!("image {key}: {e}; its template is restored here");
            (config::template(cfg, dir, vsock, limits, 0).await).map_err(|e| e.to_string())
        }
        Err(e @ (LeaseError::Refused(_) | LeaseError::Clone(_))) => return Err(e.to_string()),
    };
    match restored {
        Ok(t) => client::own_clone(t, CreateClones::default(), "the container's clone")
            .await
            .map(Some),
        Err(e) => {
            log::warn!(
                "image {key}: its template {} is removed: {e}",
                dir.display()
            );
            let _lock = config::lock(&dir.with_extension("lock")).ok();
            let _ = std::fs::remove_dir_all(dir);
            Ok(None)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_prepare_printed_is_read_back_and_the_rest_is_left() {
        let made = Made::parse(
            "made /run\nmounted tmpfs /run\nmounted mqueue /dev/mqueue\nwarming sh\n\
             mounted proc /proc\nmade\nmade /a b\n",
        );
        assert_eq!(made.dirs, ["/run"]);
        let m = |f: &str, d: &str| (f.to_string(), d.to_string());
        assert_eq!(
            made.mounts,
            [m("--tmpfs", "/run"), m("--mqueue", "/dev/mqueue")]
        );
        assert!(Made::parse("").dirs.is_empty());
    }
}
