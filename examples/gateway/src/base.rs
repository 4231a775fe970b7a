//! The base template, booted or restored from a snapshot of it (`--base-snapshot DIR`).
//!
//! A booted base template takes a Linux boot and Python's start (a minute or two on a
//! slow host); one restored from a snapshot serves in tens of milliseconds. With a
//! snapshot directory, the gateway restores the base template from the snapshot made
//! of the same inputs, or boots it and saves one there for the next start (and for the
//! supervisor's restarts). A snapshot is named by a SHA-256 over its inputs: the bytes
//! of the kernel and the root image, the `vmm` program's saved-state id (`vmm
//! state-id`: what a guest was shown, CPUID among it, decided how its kernel set itself
//! up at boot, so a `vmm` whose saved state differs boots and saves anew, and one
//! rebuilt without such a change restores), the guest's command line, its memory, and
//! the further `vmm run` options. Hashing a file is remembered in `DIR/inputs.json` by
//! its path, size, inode and modification time, so a restart with the same files does
//! not read them again.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::fs::{DirBuilderExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use forkvm::{Template, TemplateSpec};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// What a saved base template depends on.
#[derive(Debug, Clone)]
pub struct Inputs {
    /// The guest kernel.
    pub kernel: PathBuf,
    /// The root image.
    pub rootfs: PathBuf,
    /// The `vmm` program that boots it (a bare name is looked up in `PATH`).
    pub vmm: PathBuf,
    /// The guest's command line.
    pub cmdline: String,
    /// Guest memory in MiB.
    pub mem_mib: u32,
    /// Further `vmm run` options (they shape the saved VM).
    pub vmm_args: Vec<String>,
}

/// Why the snapshot directory could not be used.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotDirError {
    /// The directory could not be made.
    #[error("cannot make the snapshot directory {dir}: {source}")]
    Dir {
        /// The directory.
        dir: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The `vmm` did not tell its saved-state id.
    #[error(transparent)]
    StateId(#[from] forkvm::StateIdError),
    /// An input file could not be read to hash it.
    #[error("cannot read {path} to name its snapshot: {source}")]
    Input {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// A file's hash as `inputs.json` remembers it, with what identifies that version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Hashed {
    len: u64,
    inode: u64,
    mtime_ns: i128,
    sha256: String,
}

/// The memo of input hashes, `DIR/inputs.json`.
const MEMO: &str = "inputs.json";

/// The SHA-256 of `path`'s bytes, from `memo` when the file is the version it hashed.
fn file_hash(path: &Path, memo: &mut BTreeMap<PathBuf, Hashed>) -> std::io::Result<String> {
    let path = path.canonicalize()?;
    let meta = std::fs::metadata(&path)?;
    let version = |sha256: String| Hashed {
        len: meta.len(),
        inode: meta.ino(),
        mtime_ns: i128::from(meta.mtime()) * 1_000_000_000 + i128::from(meta.mtime_nsec()),
        sha256,
    };
    if let Some(h) = memo.get(&path) {
        if *h == version(h.sha256.clone()) {
            return Ok(h.sha256.clone());
        }
    }
    let mut file = std::fs::File::open(&path)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match file.read(&mut buf)? {
            0 => break,
            n => hasher.update(&buf[..n]),
        }
    }
    let sha256 = hex(&hasher.finalize());
    memo.insert(path, version(sha256.clone()));
    Ok(sha256)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// The name of the snapshot of `inputs` in `dir`: 16 hex digits of a SHA-256 over
/// them. Makes `dir` (owner-only: snapshots hold guest memory) when it is missing.
fn snapshot_name(dir: &Path, inputs: &Inputs) -> Result<String, SnapshotDirError> {
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(|source| SnapshotDirError::Dir {
            dir: dir.to_path_buf(),
            source,
        })?;
    let memo_path = dir.join(MEMO);
    let mut memo: BTreeMap<PathBuf, Hashed> = std::fs::read(&memo_path)
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default();
    let remembered = memo.clone();
    let mut h = Sha256::new();
    for path in [&inputs.kernel, &inputs.rootfs] {
        let sha = file_hash(path, &mut memo).map_err(|source| SnapshotDirError::Input {
            path: path.clone(),
            source,
        })?;
        h.update(sha.as_bytes());
        h.update(b"\0");
    }
    h.update(forkvm::vmm_state_id(&program_path(&inputs.vmm))?.as_bytes());
    h.update(b"\0");
    h.update(inputs.cmdline.as_bytes());
    h.update(b"\0");
    h.update(inputs.mem_mib.to_le_bytes());
    for a in (inputs.vmm_args.iter()).filter(|a| !RESTORE_FLAGS.contains(&a.as_str())) {
        h.update(a.as_bytes());
        h.update(b"\0");
    }
    if memo != remembered {
        remember(dir, &memo);
    }
    Ok(hex(&h.finalize())[..16].to_string())
}

/// `program` as a path: itself when it names a directory, else the first match in
/// `PATH` (itself again when there is none: hashing it then fails, naming it).
fn program_path(program: &Path) -> PathBuf {
    if program.components().count() > 1 {
        return program.to_path_buf();
    }
    std::env::var_os("PATH")
        .iter()
        .flat_map(std::env::split_paths)
        .map(|dir| dir.join(program))
        .find(|p| p.is_file())
        .unwrap_or_else(|| program.to_path_buf())
}

/// Writes `memo` to `dir`'s [`MEMO`] (through a temporary file and a rename). The memo
/// is a cache: one that cannot be written is hashed again next time.
fn remember(dir: &Path, memo: &BTreeMap<PathBuf, Hashed>) {
    let memo_path = dir.join(MEMO);
    let tmp = dir.join(format!(".{MEMO}.{}", std::process::id()));
    let written = serde_json::to_vec_pretty(memo)
        .map_err(std::io::Error::other)
        .and_then(|b| std::fs::write(&tmp, b))
        .and_then(|()| std::fs::rename(&tmp, &memo_path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        tracing::warn!(
            "cannot remember the inputs' hashes in {}: {e}",
            memo_path.display()
        );
    }
}

/// The host-side options `vmm restore` takes as `vmm run` does (each with a value).
const RESTORE_OPTIONS: &[&str] = &[
    "--cgroup-class",
    "--cgroup-version",
    "--cgroup-parent",
    "--cgroup-pool-size",
    "--cgroup-pool-max",
    "--cgroup-wait-ms",
    "--max-clones",
    "--max-tree-clones",
    "--fork-sources",
    "--seccomp",
    "--tap",
    "--vsock",
];

/// The `vmm run` flags (no value) `vmm restore` takes too. They change what the
/// template does with its clones, not the VM it saves, so they are no part of its
/// snapshot's name either.
const RESTORE_FLAGS: &[&str] = &["--rewind"];

/// The options of `run_args` (`vmm run` options) that a restore takes too, in order:
/// each of [`RESTORE_OPTIONS`], as `--flag VALUE` or `--flag=VALUE`, and of
/// [`RESTORE_FLAGS`]. The others shape the saved VM (and are part of its snapshot's
/// name).
pub fn restore_args(run_args: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut args = run_args.iter();
    while let Some(a) = args.next() {
        if RESTORE_FLAGS.contains(&a.as_str()) {
            out.push(a.clone());
            continue;
        }
        let flag = a.split_once('=').map_or(a.as_str(), |(f, _)| f);
        if !RESTORE_OPTIONS.contains(&flag) {
            continue;
        }
        out.push(a.clone());
        if flag == a.as_str() {
            out.extend(args.next().cloned());
        }
    }
    out
}

/// Whether `name` is one of this module's snapshot names (16 hex digits).
fn is_snapshot_name(name: &str) -> bool {
    name.len() == 16 && name.bytes().all(|b| b.is_ascii_hexdigit())
}

/// Starts the base template: restored from `dir`'s snapshot of `inputs` when there is
/// one and it restores (with `spec`'s warm clones and `restore_args`, `vmm restore`
/// options), else booted with `spec` and saved there, the snapshots of other inputs
/// removed. Without `dir`, booted. A snapshot that does not restore is removed and the
/// template booted; one that cannot be saved leaves the booted template serving.
pub async fn start(
    spec: TemplateSpec,
    snapshots: Option<(&Path, &Inputs)>,
    restore_args: Vec<String>,
) -> Result<Template, crate::GatewayError> {
    let Some((dir, inputs)) = snapshots else {
        return Ok(boot(spec).await?);
    };
    let (dir_owned, inputs_owned) = (dir.to_path_buf(), inputs.clone());
    let name = tokio::task::spawn_blocking(move || snapshot_name(&dir_owned, &inputs_owned))
        .await
        .map_err(|e| crate::GatewayError::Task(e.to_string()))??;
    let snapshot = dir.join(&name);
    if snapshot.exists() {
        let started = Instant::now();
        let mut restore_spec = spec.clone();
        restore_spec.args = restore_args;
        match Template::restore(&snapshot, restore_spec).await {
            Ok(t) => {
                tracing::info!(
                    "base template restored from {} in {} ms (pid {})",
                    snapshot.display(),
                    started.elapsed().as_millis(),
                    t.pid()
                );
                return Ok(t);
            }
            Err(e) => {
                tracing::warn!(
                    "cannot restore the base template from {}: {e}; booting it and saving it again",
                    snapshot.display()
                );
                if let Err(e) = std::fs::remove_dir_all(&snapshot) {
                    tracing::warn!("cannot remove {}: {e}", snapshot.display());
                }
            }
        }
    }
    let t = boot(spec).await?;
    match t.snapshot(&snapshot).await {
        Ok(info) => {
            tracing::info!(
                "base template saved in {} ({} MiB of memory written, {} ms)",
                info.dir,
                info.memory_written_bytes >> 20,
                info.took_ms
            );
            remove_others(dir, &name);
        }
        Err(e) => tracing::warn!(
            "cannot save the base template in {}: {e}; the next start boots again",
            snapshot.display()
        ),
    }
    Ok(t)
}

async fn boot(spec: TemplateSpec) -> Result<Template, forkvm::Error> {
    tracing::info!("booting the base template ({})", spec.kernel.display());
    let t = Template::start(spec).await?;
    tracing::info!("base template ready (pid {})", t.pid());
    Ok(t)
}

/// Removes the snapshots in `dir` other than `keep` (of other inputs: stale).
fn remove_others(dir: &Path, keep: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if is_snapshot_name(&name) && name != keep {
            match std::fs::remove_dir_all(e.path()) {
                Ok(()) => tracing::info!("removed the stale snapshot {}", e.path().display()),
                Err(err) => tracing::warn!("cannot remove {}: {err}", e.path().display()),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(dir: &Path) -> Inputs {
        let kernel = dir.join("kernel");
        let rootfs = dir.join("rootfs");
        std::fs::write(&kernel, b"kernel bytes").unwrap();
        std::fs::write(&rootfs, b"rootfs bytes").unwrap();
        let vmm = dir.join("vmm");
        fake_vmm(&vmm, "0123456789abcdef");
        Inputs {
            kernel,
            rootfs,
            vmm,
            cmdline: "console=ttyS0".into(),
            mem_mib: 256,
            vmm_args: vec![],
        }
    }

    /// A program at `path` that answers `state-id` with `id`.
    fn fake_vmm(path: &Path, id: &str) {
        use std::os::unix::fs::PermissionsExt;
        // Written aside and renamed: a program being written cannot be executed.
        let tmp = path.with_extension("tmp");
        std::fs::write(
            &tmp,
            format!("#!/bin/sh\n[ \"$1\" = state-id ] && echo {id}\n"),
        )
        .unwrap();
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::rename(&tmp, path).unwrap();
    }

    #[test]
    fn a_snapshot_is_named_by_its_inputs_bytes_the_vmms_state_id_and_options() {
        let files = tempfile::tempdir().unwrap();
        let dir = files.path().join("snapshots");
        let i = inputs(files.path());
        let name = snapshot_name(&dir, &i).unwrap();
        assert!(is_snapshot_name(&name), "{name}");
        // The directory is owner-only, and the hashes are remembered.
        let mode = std::fs::metadata(&dir).unwrap().mode() & 0o777;
        assert_eq!(mode, 0o700);
        let memo: BTreeMap<PathBuf, Hashed> =
            serde_json::from_slice(&std::fs::read(dir.join(MEMO)).unwrap()).unwrap();
        assert_eq!(memo.len(), 2);
        // Named again from the memo, which is not written again.
        let written = std::fs::metadata(dir.join(MEMO)).unwrap().ino();
        assert_eq!(snapshot_name(&dir, &i).unwrap(), name);
        assert_eq!(std::fs::metadata(dir.join(MEMO)).unwrap().ino(), written);
        // Each input names another snapshot: the options, and the bytes of a file
        // rewritten in place (its size and inode unchanged).
        let other = Inputs {
            mem_mib: 512,
            ..i.clone()
        };
        assert_ne!(snapshot_name(&dir, &other).unwrap(), name);
        let other = Inputs {
            vmm_args: vec!["--no-prime".into()],
            ..i.clone()
        };
        assert_ne!(snapshot_name(&dir, &other).unwrap(), name);
        // but not a flag that only the restore takes.
        let rewound = Inputs {
            vmm_args: vec!["--rewind".into()],
            ..i.clone()
        };
        assert_eq!(snapshot_name(&dir, &rewound).unwrap(), name);
        // A vmm whose saved state differs: another snapshot (what it shows a guest may
        // differ); one rebuilt with the same saved state (other bytes, the same id): the
        // same snapshot.
        let vmm = files.path().join("vmm2");
        fake_vmm(&vmm, "fedcba9876543210");
        let other = Inputs { vmm, ..i.clone() };
        assert_ne!(snapshot_name(&dir, &other).unwrap(), name);
        let vmm = files.path().join("vmm3");
        fake_vmm(&vmm, "0123456789abcdef\n# rebuilt");
        let rebuilt = Inputs { vmm, ..i.clone() };
        assert_eq!(snapshot_name(&dir, &rebuilt).unwrap(), name);
        // A vmm that does not tell its id: an error naming it.
        let mute = Inputs {
            vmm: files.path().join("kernel"),
            ..i.clone()
        };
        let e = snapshot_name(&dir, &mute).unwrap_err();
        assert!(e.to_string().contains("kernel"), "{e}");
        std::fs::write(&i.rootfs, b"rootfs BYTES").unwrap();
        let later = std::time::SystemTime::now() + std::time::Duration::from_secs(1);
        let f = std::fs::File::options()
            .write(true)
            .open(&i.rootfs)
            .unwrap();
        f.set_modified(later).unwrap();
        assert_ne!(snapshot_name(&dir, &i).unwrap(), name);
        // A memo that is not JSON is hashed again, not trusted.
        std::fs::write(dir.join(MEMO), b"garbage").unwrap();
        std::fs::write(&i.rootfs, b"rootfs bytes").unwrap();
        assert_eq!(snapshot_name(&dir, &i).unwrap(), name);
        // A missing input is an error naming it.
        let gone = Inputs {
            kernel: files.path().join("nope"),
            ..i
        };
        let e = snapshot_name(&dir, &gone).unwrap_err();
        assert!(e.to_string().contains("nope"), "{e}");
    }

    #[test]
    fn a_bare_program_name_is_found_in_path() {
        let sh = program_path(Path::new("sh"));
        assert!(sh.is_absolute() && sh.is_file(), "{}", sh.display());
        assert_eq!(program_path(Path::new("./vmm")), Path::new("./vmm"));
        let none = Path::new("forkvm-no-such-program");
        assert_eq!(program_path(none), none);
    }

    #[test]
    fn a_restore_gets_the_host_side_options_of_the_boot() {
        let run: Vec<String> = [
            "--cgroup-class",
            "small:cpu=1",
            "--no-prime",
            "--seccomp=log",
            "--vcpus",
            "2",
            "--rewind",
            "--max-clones",
            "9",
        ]
        .map(String::from)
        .to_vec();
        assert_eq!(
            restore_args(&run),
            [
                "--cgroup-class",
                "small:cpu=1",
                "--seccomp=log",
                "--rewind",
                "--max-clones",
                "9"
            ]
        );
    }

    #[test]
    fn only_snapshots_of_other_inputs_are_removed() {
        let dir = tempfile::tempdir().unwrap();
        for name in ["0123456789abcdef", "fedcba9876543210", "keep-me", MEMO] {
            std::fs::create_dir(dir.path().join(name)).unwrap();
        }
        remove_others(dir.path(), "0123456789abcdef");
        let mut left: Vec<String> = (std::fs::read_dir(dir.path()).unwrap())
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        left.sort();
        assert_eq!(left, ["0123456789abcdef", MEMO, "keep-me"]);
    }
}
