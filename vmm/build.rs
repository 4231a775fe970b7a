//! Names the saved-state compatibility of this build: `FORKVM_SAVED_STATE_ID`, 16
//! hexadecimal digits of a SHA-256 over the sources that decide what a saved or cloned
//! VM holds and how it is restored (the state types and their capture and restore, the
//! device models, the devices' wiring, what the guest is shown at boot: CPUID, MSRs,
//! host quirks, the memory layout) and the dependencies' versions (`Cargo.lock`). Two
//! `vmm` builds with the same id restore each other's snapshots; a snapshot cache keyed
//! by it (the containerd shim's template, the gateway's base snapshot) survives a
//! rebuild that changed nothing of those.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

/// The directories, relative to the workspace root, whose `.rs` files are hashed.
const STATE_SOURCES: &[&str] = &[
    "clone/src",
    "devices/src",
    "vmm/src/arch",
    "vmm/src/builder",
    "vmm/src/device_manager",
    "vmm/src/snapshot",
    "vmm/src/vstate",
];

fn rs_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
    for e in entries {
        let p = e.expect("a directory entry").path();
        if p.is_dir() {
            rs_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let root = manifest.parent().expect("vmm is in the workspace");
    let mut files = Vec::new();
    for dir in STATE_SOURCES {
        let dir = root.join(dir);
        println!("cargo:rerun-if-changed={}", dir.display());
        rs_files(&dir, &mut files);
    }
    files.sort();
    // The dependencies' versions too (kvm-bindings' state structures, the virtio queue
    // crate's): the lock file, whole.
    let lock = root.join("Cargo.lock");
    println!("cargo:rerun-if-changed={}", lock.display());
    files.push(lock);
    let mut h = Sha256::new();
    for f in &files {
        let rel = f.strip_prefix(root).expect("under the workspace");
        let bytes = std::fs::read(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        h.update(format!("{}\0{}\0", rel.display(), bytes.len()));
        h.update(&bytes);
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    println!("cargo:rustc-env=FORKVM_SAVED_STATE_ID={}", &hex[..16]);
}
