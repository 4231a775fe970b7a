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
