//! What the shim reads from a container's OCI spec and root file system mounts: whether
//! it is a pod's sandbox and which pod it belongs to (CRI's annotations), its resource
//! limits, and the key of its root file system's image.

use containerd_shim_protos::api;
use sha2::{Digest, Sha256};

use crate::config;
use crate::volumes::{Archive, VolumeError};

/// Whether `spec` is a pod's sandbox container (CRI's annotation).
pub fn is_sandbox(spec: &oci_spec::runtime::Spec) -> bool {
    (spec.annotations().as_ref())
        .and_then(|a| a.get("io.kubernetes.cri.container-type"))
        .is_some_and(|t| t == "sandbox")
}

/// The sandbox a pod's container belongs to (CRI's annotation); a sandbox names itself.
pub fn sandbox_id(spec: &oci_spec::runtime::Spec) -> Option<String> {
    (spec.annotations().as_ref())
        .and_then(|a| a.get("io.kubernetes.cri.sandbox-id"))
        .filter(|id| !id.is_empty())
        .cloned()
}

/// The OCI spec's CPU and memory limits as a resource class's (`cpu=CPUS,memory=BYTES`;
/// empty without them), for the clone's cgroup on the host. The pids limit is the
/// guest's ([`with_guest_limits`]): the clone's cgroup counts the VMM's threads, not the
/// guest's processes.
pub fn limits(spec: &oci_spec::runtime::Spec) -> String {
    let resources = spec.linux().as_ref().and_then(|l| l.resources().as_ref());
    let Some(r) = resources else {
        return String::new();
    };
    let mut limits = Vec::new();
    if let Some(cpu) = r.cpu() {
        if let (Some(quota), period) = (cpu.quota(), cpu.period().unwrap_or(100_000)) {
            if quota > 0 && period > 0 {
                let cpus = (quota as f64 / period as f64).clamp(0.01, 1024.0);
                limits.push(format!("cpu={cpus:.2}"));
            }
        }
    }
    if let Some(bytes) = r.memory().as_ref().and_then(|m| m.limit()) {
        if bytes > 0 {
            limits.push(format!("memory={}K", (bytes as u64 / 1024).max(4096)));
        }
    }
    limits.join(",")
}

/// `command` (a `forkvm-oci` argv) with the flags that apply the spec's limits inside
/// the guest, to the container's processes in a cgroup of their own there: its pids
/// limit (`--cgroup pids.max=N`), as the spec's `pids` or its `unified` `pids.max`.
pub fn with_guest_limits(command: Vec<String>, spec: &oci_spec::runtime::Spec) -> Vec<String> {
    flags_before_program(command, guest_limits(spec))
}

fn guest_limits(spec: &oci_spec::runtime::Spec) -> Vec<String> {
    let resources = spec.linux().as_ref().and_then(|l| l.resources().as_ref());
    let mut flags = Vec::new();
    if let Some(pids) = resources.and_then(|r| r.pids().as_ref()) {
        // Zero or less is no limit (runc's reading).
        if pids.limit() > 0 {
            flags.extend(["--cgroup".to_string(), format!("pids.max={}", pids.limit())]);
        }
    }
    // cgroup v2 settings by file (CRI's `unified`), after the above as runc does: the
    // guest's kernel has the pids controller only (docs/guest-kernel.md).
    let unified = resources.and_then(|r| r.unified().as_ref());
    for (file, value) in unified.into_iter().flatten() {
        match file.as_str() {
            "pids.max" => flags.extend(["--cgroup".to_string(), format!("{file}={value}")]),
            _ => log::warn!("the spec's cgroup setting {file} is not applied in the guest"),
        }
    }
    flags
}

/// The image key of a root file system's mounts: its layers (the overlay's lower
/// directories, or the mount's source), not the container's own upper directory.
pub fn rootfs_key(mounts: &[api::Mount]) -> String {
    let mut h = Sha256::new();
    for m in mounts {
        h.update(m.type_.as_bytes());
        h.update(b"\0");
        h.update(m.source.as_bytes());
        for o in m.options.iter().filter(|o| {
            !(o.starts_with("upperdir=") || o.starts_with("workdir=") || o.starts_with("index="))
        }) {
            h.update(b"\0");
            h.update(o.as_bytes());
        }
        h.update(b"\n");
    }
    format!("rootfs-{}", &config::hex(&h.finalize())[..32])
}

/// The longest argument a program started in the guest may have, its NUL left out
/// (Linux's `MAX_ARG_STRLEN`, 32 pages): a `--file PATH=HEX` must fit, so a bound file
/// is copied only up to about 64 KiB.
const MAX_ARG: usize = 32 * 4096 - 1;

/// The most content of bound files copied into one container, all together: in hex
/// twice that, in an argv that Linux limits to a quarter of the stack limit (2 MiB of
/// the guest's 8).
const MAX_FILES_TOTAL: usize = 512 << 10;

/// The most `--tmpfs` mounts, and the most `--file` copies, `forkvm-oci` takes
/// (`OCI_MAX_MOUNTS`).
const MAX_MOUNTS: usize = 32;

/// The most `--ro` and `--rw` mounts `forkvm-oci` takes (twice `OCI_MAX_MOUNTS`).
const MAX_BINDS: usize = 2 * MAX_MOUNTS;

/// Why the spec's mounts cannot be given to the guest.
#[derive(Debug, thiserror::Error)]
pub enum MountError {
    /// A bound host file that does not fit a `--file` argument.
    #[error(
        "mount {dest}: a host file of {len} bytes; forkvm copies a file bound in into the \
         guest only up to {max} bytes at that path (docs/containerd.md)"
    )]
    FileTooLarge { dest: String, len: u64, max: usize },
    /// More content of bound files than one container's start can carry.
    #[error("the files bound in hold more than {MAX_FILES_TOTAL} bytes in all (at {dest})")]
    FilesTooLarge { dest: String },
    /// More tmpfs mounts or copied files than `forkvm-oci` takes.
    #[error("more than {MAX_MOUNTS} {what} (at {dest})")]
    TooMany { what: &'static str, dest: String },
    /// A bound host file that cannot be read.
    #[error("mount {dest}: {error}")]
    Read { dest: String, error: std::io::Error },
    /// A volume that cannot be copied.
    #[error(transparent)]
    Volume(#[from] VolumeError),
}

/// What the guest is given of the spec's mounts: the `forkvm-oci` argv, and the archive
/// of volumes its first process's input starts with (empty: none).
#[derive(Debug)]
pub struct Mounted {
    /// The argv.
    pub command: Vec<String>,
    /// The archive (`forkvm-oci --unpack`, [`crate::volumes`]).
    pub archive: Vec<u8>,
}

/// `command` (a `forkvm-oci` argv) with what the guest can be given of the spec's
/// mounts, before its `--`: each tmpfs mount as `--tmpfs DIR`, each small host file
/// bound in (CRI's `/etc/hosts`, `/etc/hostname`, `/etc/resolv.conf`) as `--file
/// PATH=HEX`, a copy of its content, and host directories and larger files bound in
/// (volumes) copied through an archive on the process's input (`--unpack`,
/// [`crate::volumes`]). The container's changes to its copies stay in the guest.
/// `/proc`, `/sys`, `/dev` and `/dev/pts` are the guest's own, which `forkvm-oci`
/// mounts; a bound directory at `/dev/shm` (CRI's pod-wide one) becomes a tmpfs of the
/// container's; an `mqueue` mount, the guest's message queues (`--mqueue DIR`: one IPC
/// namespace per VM, so a pod's containers share them, as a pod shares its IPC
/// namespace). A process on a terminal
/// (`terminal`: the create request's, with which containerd sets up its input) reads
/// its input there, so it gets no archive: its bound
/// directories are not applied (the log says so), and a bound file too large for a
/// `--file` argument is an error, as is anything past the limits. A mount whose options
/// say `ro` is made read-only (`--ro DIR`); the spec's `root.readonly` makes the root
/// file system read-only (`--readonly`), the other mounts writable (`--rw DIR`) unless
/// they say `ro`.
pub fn with_mounts(
    command: Vec<String>,
    spec: &oci_spec::runtime::Spec,
    terminal: bool,
) -> Result<Mounted, MountError> {
    let readonly = (spec.root().as_ref()).is_some_and(|r| r.readonly().unwrap_or(false));
    let (mut extra, mut binds) = (Vec::new(), Vec::new());
    let mut archive = Archive::default();
    let (mut tmpfs, mut files, mut total) = (0, 0, 0);
    for m in spec.mounts().iter().flatten() {
        let dest = m.destination().display().to_string();
        let typ = m.typ().as_deref().unwrap_or_default();
        let options = m.options().clone().unwrap_or_default();
        let bind = typ == "bind" || options.iter().any(|o| o == "bind" || o == "rbind");
        let guests = ["/proc", "/sys", "/dev", "/dev/pts"];
        if guests.contains(&dest.as_str()) || dest.starts_with("/sys/") {
            continue;
        }
        let source = m.source().as_ref();
        let meta = source.and_then(|s| std::fs::metadata(s).ok());
        let ro = options.iter().any(|o| o == "ro");
        let is_tmpfs = typ == "tmpfs"
            || (bind && meta.as_ref().is_some_and(|m| m.is_dir()) && dest == "/dev/shm");
        if is_tmpfs {
            tmpfs += 1;
            if tmpfs > MAX_MOUNTS {
                return Err(MountError::TooMany {
                    what: "tmpfs mounts",
                    dest,
                });
            }
            // A tmpfs is a mount of its own: writable, it needs no `--rw`.
            binds.extend(bind_flag(ro, false, &dest));
            extra.extend(["--tmpfs".to_string(), dest]);
            continue;
        }
        if typ == "mqueue" {
            extra.extend(["--mqueue".to_string(), dest]);
            continue;
        }
        let flag = bind_flag(ro, readonly, &dest);
        match (bind, &meta, source) {
            (true, Some(meta), Some(source)) if meta.is_file() => {
                let max = MAX_ARG.saturating_sub(dest.len() + 1) / 2;
                let fits = meta.len() <= max as u64
                    && files < MAX_MOUNTS
                    && total + meta.len() as usize <= MAX_FILES_TOTAL;
                if !fits && !terminal {
                    archive.add_file(source, &dest)?;
                    binds.extend(flag);
                    continue;
                }
                if meta.len() > max as u64 {
                    let len = meta.len();
                    return Err(MountError::FileTooLarge { dest, len, max });
                }
                let bytes = std::fs::read(source).map_err(|error| MountError::Read {
                    dest: dest.clone(),
                    error,
                })?;
                (files, total) = (files + 1, total + bytes.len());
                if files > MAX_MOUNTS {
                    let what = "files bound in";
                    return Err(MountError::TooMany { what, dest });
                }
                if total > MAX_FILES_TOTAL {
                    return Err(MountError::FilesTooLarge { dest });
                }
                let file = format!("{dest}={}", config::hex(&bytes));
                extra.extend(["--file".to_string(), file]);
                binds.extend(flag);
            }
            (true, Some(meta), Some(source)) if meta.is_dir() && !terminal => {
                archive.add_dir(source, &dest)?;
                binds.extend(flag);
            }
            _ => log::warn!(
                "mount {dest} ({typ}{}): not applied in the guest",
                match (bind, terminal) {
                    (true, true) => ", bound from the host, for a process on a terminal",
                    (true, false) => ", bound from the host",
                    _ => "",
                }
            ),
        }
    }
    if !archive.is_empty() {
        extra.push("--unpack".into());
    }
    if binds.len() > MAX_BINDS {
        let dest = binds.swap_remove(MAX_BINDS)[1].clone();
        let what = "mounts read-only or writable apart from the root";
        return Err(MountError::TooMany { what, dest });
    }
    extra.extend(binds.into_iter().flatten());
    if readonly {
        extra.push("--readonly".into());
    }
    Ok(Mounted {
        command: flags_before_program(command, extra),
        archive: archive.finish(),
    })
}

/// `command` (a `forkvm-oci` argv) with `flags` put before its `--`.
fn flags_before_program(mut command: Vec<String>, flags: Vec<String>) -> Vec<String> {
    let at = command
        .iter()
        .position(|a| a == "--")
        .unwrap_or(command.len());
    command.splice(at..at, flags);
    command
}

/// A file system of the guest's that a `forkvm-oci` argv mounts: its flag (`--tmpfs` or
/// `--mqueue`) and its directory.
pub type GuestMount = (String, String);

/// The `forkvm-oci` flags that take no value.
const ALONE: [&str; 4] = ["--readonly", "--prepare", "--release", "--unpack"];

/// The flags of a `forkvm-oci` argv (after the program name, up to `--`), each with its
/// value (none for those that take none).
fn flags(command: &[String]) -> Vec<(&String, Option<&String>)> {
    let mut out = Vec::new();
    let mut args = command.iter().skip(1).take_while(|a| *a != "--");
    while let Some(flag) = args.next() {
        let value = match ALONE.contains(&flag.as_str()) {
            true => None,
            false => args.next(),
        };
        out.push((flag, value));
    }
    out
}

/// The file systems of the guest's a `forkvm-oci` argv mounts (its `--tmpfs` and
/// `--mqueue` values): what an image's template mounts ahead.
pub fn guest_mounts(command: &[String]) -> Vec<GuestMount> {
    (flags(command).into_iter())
        .filter(|(flag, _)| *flag == "--tmpfs" || *flag == "--mqueue")
        .filter_map(|(flag, dir)| Some((flag.clone(), dir?.clone())))
        .collect()
}

/// `command` for a clone of an image's template that made the mount points `made`
/// and mounted `mounted`: a mount it has already is left out, one it does not want is
/// unmounted (`--umount DIR`), and a directory made that it mounts nothing at is
/// removed (`--rmdir DIR`), so that a container sees no mount and no directory its
/// image lacks that its own spec did not ask for.
pub fn with_template_mounts(
    command: Vec<String>,
    made: &[String],
    mounted: &[GuestMount],
) -> Vec<String> {
    let wanted = guest_mounts(&command);
    let mut extra = Vec::new();
    for (_, dir) in mounted.iter().filter(|m| !wanted.contains(m)) {
        extra.extend(["--umount".to_string(), dir.clone()]);
    }
    for dir in made.iter().filter(|d| !wanted.iter().any(|(_, w)| w == *d)) {
        extra.extend(["--rmdir".to_string(), dir.clone()]);
    }
    let mut kept = command[..1.min(command.len())].to_vec();
    for (flag, value) in flags(&command) {
        let pair = value.map(|v| (flag.clone(), v.clone()));
        if pair.as_ref().is_some_and(|p| mounted.contains(p)) {
            continue;
        }
        kept.push(flag.clone());
        kept.extend(value.cloned());
    }
    let rest = command
        .iter()
        .position(|a| a == "--")
        .unwrap_or(command.len());
    kept.extend_from_slice(&command[rest..]);
    flags_before_program(kept, extra)
}

/// The `forkvm-oci` flag that makes a copy at `dest` a mount of its own: read-only if
/// its options say `ro`, writable if it must stay so under a read-only root; none
/// otherwise.
fn bind_flag(ro: bool, readonly_root: bool, dest: &str) -> Option<[String; 2]> {
    match (ro, readonly_root) {
        (true, _) => Some(["--ro".into(), dest.into()]),
        (false, true) => Some(["--rw".into(), dest.into()]),
        (false, false) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tmpfs_small_files_and_volumes_reach_the_guest_the_rest_is_left() {
        let dir = std::env::temp_dir().join(format!("forkvm-shim-mounts-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("resolv.conf"), "nameserver 10.0.0.53\n").unwrap();
        let spec: oci_spec::runtime::Spec = serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "mounts": [
                {"destination": "/proc", "type": "proc", "source": "proc"},
                {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
                {"destination": "/sys/fs/cgroup", "type": "cgroup", "source": "cgroup"},
                {"destination": "/run", "type": "tmpfs", "source": "tmpfs"},
                {"destination": "/etc/resolv.conf", "type": "bind",
                 "source": dir.join("resolv.conf"), "options": ["rbind", "ro"]},
                {"destination": "/dev/shm", "type": "bind", "source": dir,
                 "options": ["rbind"]},
                {"destination": "/data", "type": "bind", "source": dir, "options": ["rbind"]},
                {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue"},
            ],
        }))
        .unwrap();
        let command = vec!["forkvm-oci".to_string(), "--".into(), "sh".into()];
        let got = with_mounts(command, &spec, false).unwrap();
        assert_eq!(
            got.command,
            [
                "forkvm-oci",
                "--tmpfs",
                "/run",
                "--file",
                &format!(
                    "/etc/resolv.conf={}",
                    config::hex(b"nameserver 10.0.0.53\n")
                ),
                "--tmpfs",
                "/dev/shm",
                "--mqueue",
                "/dev/mqueue",
                "--unpack",
                "--ro",
                "/etc/resolv.conf",
                "--",
                "sh"
            ]
        );
        let m = |f: &str, d: &str| (f.to_string(), d.to_string());
        assert_eq!(
            guest_mounts(&got.command),
            [
                m("--tmpfs", "/run"),
                m("--tmpfs", "/dev/shm"),
                m("--mqueue", "/dev/mqueue")
            ]
        );
        // A template that made /run and /x and mounted a tmpfs at /run, /x and
        // /dev/mqueue: /run is left out, /x unmounted and removed, /dev/mqueue (a tmpfs
        // there, where this one wants the message queues) unmounted and mounted again.
        let made = ["/run".to_string(), "/x".into()];
        let mounted = [
            m("--tmpfs", "/run"),
            m("--tmpfs", "/x"),
            m("--tmpfs", "/dev/mqueue"),
        ];
        let cmd = with_template_mounts(got.command.clone(), &made, &mounted);
        assert_eq!(
            guest_mounts(&cmd),
            [m("--tmpfs", "/dev/shm"), m("--mqueue", "/dev/mqueue")]
        );
        let tail = [
            "--umount",
            "/x",
            "--umount",
            "/dev/mqueue",
            "--rmdir",
            "/x",
            "--",
            "sh",
        ];
        assert_eq!(cmd[cmd.len() - tail.len()..], tail);
        assert_eq!(cmd.len(), got.command.len() - 2 + 6);
        // The other flags are kept as they were.
        assert!(cmd.iter().any(|a| a == "--unpack"));
        assert!(cmd
            .windows(2)
            .any(|w| w[0] == "--ro" && w[1] == "/etc/resolv.conf"));
        // A template with nothing: the command as it was.
        assert_eq!(
            with_template_mounts(got.command.clone(), &[], &[]),
            got.command
        );
        // A read-only root: the other mounts it copies into stay writable, unless `ro`.
        let mut readonly = spec.clone();
        let root = oci_spec::runtime::RootBuilder::default()
            .path("rootfs")
            .readonly(true)
            .build()
            .unwrap();
        readonly.set_root(Some(root));
        let command = vec!["forkvm-oci".to_string(), "--".into(), "sh".into()];
        let got_ro = with_mounts(command, &readonly, false).unwrap();
        let tail = [
            "--ro",
            "/etc/resolv.conf",
            "--rw",
            "/data",
            "--readonly",
            "--",
        ];
        let at = got_ro.command.iter().position(|a| a == "--unpack").unwrap() + 1;
        assert_eq!(got_ro.command[at..at + tail.len()], tail);
        assert_eq!(got_ro.archive, got.archive);
        // The directory at /data, in the archive: itself, then its file.
        let mut want = Archive::default();
        want.add_dir(&dir, "/data").unwrap();
        assert_eq!(got.archive, want.finish());
        assert!(got.archive.len() > 2 * 16 + "/data/resolv.conf".len());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_pids_limit_becomes_the_guest_cgroups_and_none_is_no_flag() {
        let spec = |pids: serde_json::Value| -> oci_spec::runtime::Spec {
            serde_json::from_value(serde_json::json!({
                "ociVersion": "1.0.2",
                "linux": {"resources": {"pids": pids}},
            }))
            .unwrap()
        };
        let command = || vec!["forkvm-oci".to_string(), "--".into(), "sh".into()];
        let got = with_guest_limits(command(), &spec(serde_json::json!({"limit": 64})));
        assert_eq!(got, ["forkvm-oci", "--cgroup", "pids.max=64", "--", "sh"]);
        for none in [0, -1] {
            let got = with_guest_limits(command(), &spec(serde_json::json!({"limit": none})));
            assert_eq!(got, command(), "a limit of {none}");
        }
        let plain: oci_spec::runtime::Spec =
            serde_json::from_value(serde_json::json!({"ociVersion": "1.0.2"})).unwrap();
        assert_eq!(with_guest_limits(command(), &plain), command());
        // CRI's unified settings: pids.max passed on, the rest (no such controller in
        // the guest) left.
        let unified: oci_spec::runtime::Spec = serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "linux": {"resources": {"unified": {"pids.max": "max", "memory.high": "1G"}}},
        }))
        .unwrap();
        let got = with_guest_limits(command(), &unified);
        assert_eq!(got, ["forkvm-oci", "--cgroup", "pids.max=max", "--", "sh"]);
    }

    fn spec_binding(dir: &std::path::Path, files: &[(&str, usize)]) -> oci_spec::runtime::Spec {
        let mounts: Vec<_> = (files.iter())
            .map(|(dest, len)| {
                let src = dir.join(dest.trim_start_matches('/').replace('/', "_"));
                std::fs::write(&src, vec![b'x'; *len]).unwrap();
                serde_json::json!({"destination": dest, "type": "bind",
                                   "source": src, "options": ["rbind", "ro"]})
            })
            .collect();
        serde_json::from_value(serde_json::json!({
            "ociVersion": "1.0.2",
            "process": {"cwd": "/", "args": ["sh"],
                        "user": {"uid": 0, "gid": 0}},
            "mounts": mounts,
        }))
        .unwrap()
    }

    #[test]
    fn bound_files_past_an_argument_go_in_the_archive_and_on_a_terminal_are_errors() {
        let dir = std::env::temp_dir().join(format!("forkvm-shim-big-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let command = || vec!["forkvm-oci".to_string(), "--".into(), "sh".into()];
        // The largest that fits one argument with its path; one byte more is archived.
        let dest = "/etc/app.conf";
        let max = (MAX_ARG - dest.len() - 1) / 2;
        let got = with_mounts(command(), &spec_binding(&dir, &[(dest, max)]), false).unwrap();
        let arg = got.command[2].len();
        assert!(
            arg <= MAX_ARG && arg + 2 > MAX_ARG,
            "--file {dest}=HEX fills one argument"
        );
        assert!(got.archive.is_empty());
        let got = with_mounts(command(), &spec_binding(&dir, &[(dest, max + 1)]), false).unwrap();
        let want = ["forkvm-oci", "--unpack", "--ro", dest, "--", "sh"];
        assert_eq!(got.command, want);
        assert_eq!(got.archive.len(), 16 + dest.len() + max + 1 + 16);
        // On a terminal (no archive): an error that names it.
        let spec = spec_binding(&dir, &[(dest, max + 1)]);
        let e = with_mounts(command(), &spec, true).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains(dest) && text.contains(&format!("{}", max + 1)),
            "{text}"
        );
        // Files that fit one by one but not all together: the rest archived, or an
        // error on a terminal.
        let many: Vec<(String, usize)> = (0..10).map(|i| (format!("/etc/f{i}"), 60_000)).collect();
        let many: Vec<(&str, usize)> = many.iter().map(|(d, l)| (d.as_str(), *l)).collect();
        let got = with_mounts(command(), &spec_binding(&dir, &many), false).unwrap();
        let files = got.command.iter().filter(|a| *a == "--file").count();
        assert_eq!(files, MAX_FILES_TOTAL / 60_000);
        assert!(got.command.contains(&"--unpack".to_string()));
        let e = with_mounts(command(), &spec_binding(&dir, &many), true).unwrap_err();
        assert!(matches!(e, MountError::FilesTooLarge { .. }), "{e}");
        // More files than forkvm-oci takes as arguments.
        let many: Vec<(String, usize)> = (0..33).map(|i| (format!("/etc/g{i}"), 1)).collect();
        let many: Vec<(&str, usize)> = many.iter().map(|(d, l)| (d.as_str(), *l)).collect();
        let got = with_mounts(command(), &spec_binding(&dir, &many), false).unwrap();
        assert_eq!(
            got.command.iter().filter(|a| *a == "--file").count(),
            MAX_MOUNTS
        );
        let e = with_mounts(command(), &spec_binding(&dir, &many), true).unwrap_err();
        assert!(matches!(e, MountError::TooMany { .. }), "{e}");
        // More read-only mounts than forkvm-oci makes.
        let many: Vec<(String, usize)> = (0..65).map(|i| (format!("/etc/h{i}"), 1)).collect();
        let many: Vec<(&str, usize)> = many.iter().map(|(d, l)| (d.as_str(), *l)).collect();
        let e = with_mounts(command(), &spec_binding(&dir, &many), false).unwrap_err();
        assert!(e.to_string().contains("/etc/h64"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
