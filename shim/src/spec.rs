//! What the shim reads from a container's OCI spec and root file system mounts: whether
//! it is a pod's sandbox and which pod it belongs to (CRI's annotations), its resource
//! limits, and the key of its root file system's image.

use containerd_shim_protos::api;
use sha2::{Digest, Sha256};

use crate::config;

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
/// empty without them). The pids limit is not applied: the clone's cgroup counts the
/// VMM's threads, not the guest's processes.
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
    if r.pids().is_some() {
        log::warn!(
            "the spec's pids limit is not applied (the guest's processes are not the host's)"
        );
    }
    limits.join(",")
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

/// Host files larger than this are not copied into a container (`--file`).
const MAX_FILE: u64 = 1 << 20;

/// `command` (a `forkvm-oci` argv) with what the guest can be given of the spec's
/// mounts, before its `--`: each tmpfs mount as `--tmpfs DIR`, and each host file bound
/// in (CRI's `/etc/hosts`, `/etc/hostname`, `/etc/resolv.conf`) as `--file PATH=HEX`, a
/// copy of its content (the container's changes to it stay in the guest). `/proc`,
/// `/sys`, `/dev` and `/dev/pts` are the guest's own, which `forkvm-oci` mounts; a bound
/// directory at `/dev/shm` (CRI's pod-wide one) becomes a tmpfs of the container's; the
/// rest (other bound directories, `mqueue`, larger files) is not applied, and the log
/// says so.
pub fn with_mounts(mut command: Vec<String>, spec: &oci_spec::runtime::Spec) -> Vec<String> {
    let mut extra = Vec::new();
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
        match (typ, bind, &meta) {
            ("tmpfs", _, _) => extra.extend(["--tmpfs".to_string(), dest]),
            (_, true, Some(meta)) if meta.is_dir() && dest == "/dev/shm" => {
                extra.extend(["--tmpfs".to_string(), dest])
            }
            (_, true, Some(meta)) if meta.is_file() && meta.len() <= MAX_FILE => {
                match source.map(std::fs::read) {
                    Some(Ok(bytes)) => {
                        let file = format!("{dest}={}", config::hex(&bytes));
                        extra.extend(["--file".to_string(), file]);
                    }
                    Some(Err(e)) => log::warn!("mount {dest}: not applied: {e}"),
                    None => {}
                }
            }
            _ => log::warn!(
                "mount {dest} ({typ}{}): not applied in the guest",
                if bind { ", bound from the host" } else { "" }
            ),
        }
    }
    let at = command
        .iter()
        .position(|a| a == "--")
        .unwrap_or(command.len());
    command.splice(at..at, extra);
    command
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tmpfs_and_small_bound_files_reach_the_guest_the_rest_is_left() {
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
        let got = with_mounts(command, &spec);
        assert_eq!(
            got,
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
                "--",
                "sh"
            ]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
