//! OCI image archives the containerd tests build themselves (no registry is reached):
//! one layer of Debian's static busybox, or of the Python guest's root file system, for
//! `ctr image import`.

use std::path::Path;

use sha2::{Digest, Sha256};

fn digest(bytes: &[u8]) -> String {
    let hex: String = Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    format!("sha256:{hex}")
}

fn file(t: &mut tar::Builder<Vec<u8>>, path: &str, data: &[u8], mode: u32) {
    let mut h = tar::Header::new_ustar();
    h.set_size(data.len() as u64);
    h.set_mode(mode);
    h.set_mtime(1_700_000_000);
    t.append_data(&mut h, path, data).unwrap();
}

/// The busybox layer: `bin/busybox` (the host's static one) with `applets` linked to it,
/// and the directories a container needs (`tmp` world-writable).
fn busybox_layer(applets: &[&str]) -> Vec<u8> {
    let mut t = tar::Builder::new(Vec::new());
    for (dir, mode) in [
        ("bin", 0o755),
        ("dev", 0o755),
        ("etc", 0o755),
        ("proc", 0o755),
        ("sys", 0o755),
        ("tmp", 0o1777),
    ] {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::Directory);
        h.set_mode(mode);
        h.set_mtime(1_700_000_000);
        h.set_size(0);
        t.append_data(&mut h, dir, std::io::empty()).unwrap();
    }
    let busybox = std::fs::read("/bin/busybox").expect("/bin/busybox (busybox-static)");
    file(&mut t, "bin/busybox", &busybox, 0o755);
    file(&mut t, "etc/motd", b"from the image\n", 0o644);
    for a in applets {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(tar::EntryType::Symlink);
        h.set_mode(0o777);
        h.set_mtime(1_700_000_000);
        h.set_size(0);
        t.append_link(&mut h, format!("bin/{a}"), "busybox")
            .unwrap();
    }
    t.into_inner().unwrap()
}

/// An OCI image archive at `out` named `name` (`docker.io/forkvm/busybox:1`): busybox
/// with `applets`, `PATH=/bin`, default command `sh`.
pub fn busybox_image(out: &Path, name: &str, applets: &[&str]) {
    archive(out, name, &busybox_layer(applets), "PATH=/bin", "sh");
}

/// An OCI image archive at `out` named `name`: the Python guest's root file system
/// (`target/guest/python.ext4`: Debian's Python 3 and numpy, busybox), read from a
/// read-only loop mount of it (needs root) into one layer; `PATH=/usr/bin:/bin`,
/// default command `python3`.
pub fn python_image(out: &Path, name: &str) {
    let ext4 = crate::guest_file("python.ext4");
    let mnt = out.with_extension("mnt");
    std::fs::create_dir_all(&mnt).unwrap();
    let run = |cmd: &mut std::process::Command| {
        let o = cmd.output().unwrap();
        assert!(o.status.success(), "{cmd:?}: {o:?}");
        o.stdout
    };
    run(std::process::Command::new("mount")
        .args(["-o", "loop,ro"])
        .arg(&ext4)
        .arg(&mnt));
    let layer = std::process::Command::new("tar")
        .arg("-C")
        .arg(&mnt)
        .args(["--numeric-owner", "--exclude=./lost+found", "-cf", "-", "."])
        .output();
    run(std::process::Command::new("umount").arg(&mnt));
    let _ = std::fs::remove_dir(&mnt);
    let layer = layer.unwrap();
    assert!(
        layer.status.success(),
        "tar of {}: {layer:?}",
        ext4.display()
    );
    archive(out, name, &layer.stdout, "PATH=/usr/bin:/bin", "python3");
}

/// An OCI image archive at `out` named `name`, of one layer (an uncompressed tar),
/// with environment `env` and default command `cmd`.
fn archive(out: &Path, name: &str, layer: &[u8], env: &str, cmd: &str) {
    let config = serde_json::json!({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": [cmd], "Env": [env]},
        "rootfs": {"type": "layers", "diff_ids": [digest(layer)]},
    })
    .to_string()
    .into_bytes();
    let manifest = serde_json::json!({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": digest(&config),
            "size": config.len(),
        },
        "layers": [{
            "mediaType": "application/vnd.oci.image.layer.v1.tar",
            "digest": digest(layer),
            "size": layer.len(),
        }],
    })
    .to_string()
    .into_bytes();
    let tag = name.rsplit_once(':').map_or("latest", |(_, t)| t);
    let index = serde_json::json!({
        "schemaVersion": 2,
        "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "digest": digest(&manifest),
            "size": manifest.len(),
            "annotations": {
                "io.containerd.image.name": name,
                "org.opencontainers.image.ref.name": tag,
            },
        }],
    })
    .to_string()
    .into_bytes();
    let mut t = tar::Builder::new(Vec::new());
    file(
        &mut t,
        "oci-layout",
        br#"{"imageLayoutVersion":"1.0.0"}"#,
        0o644,
    );
    file(&mut t, "index.json", &index, 0o644);
    for blob in [layer, &config, &manifest] {
        let d = digest(blob);
        let path = format!("blobs/sha256/{}", d.trim_start_matches("sha256:"));
        file(&mut t, &path, blob, 0o644);
    }
    std::fs::write(out, t.into_inner().unwrap()).unwrap();
}
