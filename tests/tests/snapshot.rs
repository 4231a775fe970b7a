//! Snapshots (docs/snapshots.md) with the tiny guest: a paused VM written to a
//! directory, restored (running, twice, and paused as a template that clones), and
//! every bad snapshot refused with a clear error and nothing started.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use serde_json::Value;
use tests::{kvm_available, run_vmm, wait_until, Scratch, Vm};

const BOOT: Duration = Duration::from_secs(60);

/// The last heartbeat the console shows.
fn last_beat(vm: &Vm) -> u64 {
    let text = vm.console_text();
    let beat = text
        .lines()
        .rev()
        .find_map(|l| l.strip_prefix("tiny: beat "));
    beat.and_then(|b| b.trim().parse().ok()).unwrap_or(0)
}

fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o777
}

/// Copies snapshot `from` to `to`, holes kept.
fn copy_snapshot(from: &Path, to: &Path) {
    let out = Command::new("cp")
        .args(["-r", "--sparse=always"])
        .arg(from)
        .arg(to)
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
}

/// The state file of snapshot `dir` as JSON, changed by `edit`, written back.
fn edit_state(dir: &Path, edit: impl FnOnce(&mut Value)) {
    let path = dir.join("state");
    let bytes = std::fs::read(&path).unwrap();
    let mut v: Value = clone::state_file::decode(&bytes, &path).unwrap();
    edit(&mut v);
    std::fs::write(&path, clone::state_file::encode(&v).unwrap()).unwrap();
}

/// A paused tiny guest with an entropy device, a vsock device and a writable disk,
/// its snapshot written to `<scratch>/snap`; returns the VM (paused) and the snapshot.
fn snapshotted(scratch: &Scratch) -> (Vm, PathBuf) {
    let image = scratch.path("disk.img");
    std::fs::write(&image, vec![7u8; 1 << 20]).unwrap();
    let cow = scratch.path("cow");
    std::fs::create_dir(&cow).unwrap();
    let disk = format!("{},cow={}", image.display(), cow.display());
    let vsock = scratch.path("v.sock").display().to_string();
    let args = ["--rng", "--disk", &disk, "--vsock", &vsock];
    let mut vm = tests::tiny_vm_with(scratch, "64", "1", "beat=50", &args);
    vm.wait_console("tiny: beat 3\n", BOOT);
    assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    let snap = scratch.path("snap");
    let (code, answer) = vm.snapshot(&snap);
    assert_eq!(code, 201, "{answer}");
    let info: Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(info["dir"], snap.display().to_string());
    // 64 MiB of RAM and the mailbox; the tiny guest touched little of it.
    let mailbox = vm.describe()["invoke"]["mailbox_bytes"]
        .as_u64()
        .unwrap_or(0);
    assert_eq!(info["memory_bytes"], (64 << 20) + mailbox, "{info}");
    assert!(
        info["memory_written_bytes"].as_u64().unwrap() < 4 << 20,
        "{info}"
    );
    assert_eq!(info["overlay_bytes"], 1 << 20);
    (vm, snap)
}

#[test]
fn a_paused_vm_saved_to_a_directory_restores_where_it_stopped_twice_and_as_a_template() {
    if !kvm_available("snapshot_restore") {
        return;
    }
    let scratch = Scratch::new("snapshot");
    let (mut vm, snap) = snapshotted(&scratch);
    let at = last_beat(&vm);

    // Owner-only files in an owner-only directory; the memory file holds only what
    // the guest wrote (the rest are holes), and nothing else is left beside it.
    assert_eq!(mode(&snap), 0o700);
    let mut names: Vec<String> = std::fs::read_dir(&snap)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(
        names,
        ["disk0.blocks", "disk0.overlay", "memory", "state"],
        "{names:?}"
    );
    for n in &names {
        assert_eq!(mode(&snap.join(n)), 0o600, "{n}");
    }
    let memory = std::fs::metadata(snap.join("memory")).unwrap();
    assert!(memory.len() > 64 << 20);
    assert!(
        memory.blocks() * 512 < 4 << 20,
        "{} blocks",
        memory.blocks()
    );
    let leftovers: Vec<_> = std::fs::read_dir(scratch.path(""))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.contains(".tmp-"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");

    // Refused: an existing directory, a relative path, a running VM; the VM goes on.
    let (code, body) = vm.snapshot(&snap);
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("exists already"), "{body}");
    let (code, body) = vm.snapshot(Path::new("relative/snap"));
    assert_eq!(code, 400, "{body}");
    assert_eq!(
        vm.api("PATCH", "/vm", Some(r#"{"state":"running"}"#)).0,
        204
    );
    let (code, body) = vm.snapshot(&scratch.path("snap2"));
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("paused"), "{body}");
    vm.wait_console(&format!("tiny: beat {}\n", at + 2), BOOT);
    vm.shutdown(Duration::from_secs(10));

    // Restored twice, running: each goes on from the beat after the snapshot's, with
    // its own vsock socket beside its control socket.
    let restored: Vec<(Scratch, Vm)> = (0..2)
        .map(|i| {
            let s = Scratch::new(&format!("snapshot-restore{i}"));
            let vm = Vm::restore(&s, &snap, &[]);
            (s, vm)
        })
        .collect();
    for (s, r) in restored {
        let mut r = r;
        let first = r.wait_console_line("tiny: beat ", BOOT);
        assert!(
            first.starts_with(&format!("tiny: beat {}\n", at + 1)),
            "snapshot at beat {at}, restored console:\n{first}"
        );
        r.wait_console(&format!("tiny: beat {}\n", at + 3), BOOT);
        let v = r.describe();
        assert_eq!(v["state"], "running", "{v}");
        assert!(r.stderr_text().contains("restored"), "{}", r.stderr_text());
        let vsock = s.path("api.sock.vsock");
        assert!(vsock.exists(), "{}", vsock.display());
        r.shutdown(Duration::from_secs(10));
        assert!(!vsock.exists() && !r.sock.exists());
    }

    // Restored paused, as a template: warm clones ready, clones run on from the
    // snapshot's state; the template itself does not run.
    let s = Scratch::new("snapshot-template");
    let mut t = Vm::restore(&s, &snap, &["--paused", "--warm-clones", "2"]);
    t.wait_api(BOOT);
    wait_until("2 warm clones", BOOT, || {
        t.describe()["warm_clones"]["ready"] == 2
    });
    assert_eq!(t.describe()["state"], "paused");
    let (code, body) = t.api("POST", "/clones", Some(r#"{"count":3}"#));
    assert_eq!(code, 201, "{body}");
    let clones: Value = serde_json::from_str(&body).unwrap();
    for c in clones["clones"].as_array().unwrap() {
        assert_eq!(c["status"]["state"], "running", "{c}");
        let console = PathBuf::from(c["console"].as_str().unwrap());
        wait_until("the clone's heartbeat", BOOT, || {
            let text = std::fs::read_to_string(&console).unwrap_or_default();
            text.contains(&format!("tiny: beat {}\n", at + 2))
        });
    }
    assert!(
        !t.console_text().contains("tiny: beat"),
        "{}",
        t.console_text()
    );
    t.shutdown(Duration::from_secs(10));
}

/// `vmm restore` of `snap` on control socket `sock`, its console discarded, until it
/// ends (at most a minute): whether it succeeded, and its log.
fn restore_once(snap: &Path, sock: &Path) -> (bool, String) {
    let (status, _, err) = run_vmm(
        &[
            "restore",
            "--dir",
            snap.to_str().unwrap(),
            "--api-sock",
            sock.to_str().unwrap(),
            "--console",
            "null",
        ],
        Duration::from_secs(60),
    );
    (status.success(), err)
}

#[test]
fn a_bad_snapshot_is_refused_with_a_clear_error_and_nothing_started() {
    if !kvm_available("snapshot_bad_files") {
        return;
    }
    let scratch = Scratch::new("snapshot-bad");
    let (mut vm, snap) = snapshotted(&scratch);
    vm.shutdown(Duration::from_secs(10));

    type Damage = fn(&Path);
    let cases: &[(&str, Damage, &str)] = &[
        (
            "truncated state",
            |d| {
                let p = d.join("state");
                let len = std::fs::metadata(&p).unwrap().len();
                let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
                f.set_len(len / 2).unwrap();
            },
            "truncated or appended to",
        ),
        (
            "corrupted state",
            |d| {
                let p = d.join("state");
                let mut b = std::fs::read(&p).unwrap();
                let at = b.len() - 100;
                b[at] ^= 0x20;
                std::fs::write(&p, b).unwrap();
            },
            "is corrupted",
        ),
        (
            "unknown version",
            |d| {
                let p = d.join("state");
                let mut b = std::fs::read(&p).unwrap();
                b[8..12].copy_from_slice(&99u32.to_le_bytes());
                std::fs::write(&p, b).unwrap();
            },
            "format version 99",
        ),
        (
            "not a state file",
            |d| std::fs::write(d.join("state"), b"{\"hello\":1}").unwrap(),
            "not a forkvm snapshot state file",
        ),
        (
            "no state file",
            |d| std::fs::remove_file(d.join("state")).unwrap(),
            "No such file",
        ),
        (
            "truncated memory",
            |d| {
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(d.join("memory"))
                    .unwrap();
                f.set_len(1 << 20).unwrap();
            },
            "1048576 bytes long",
        ),
        (
            "no memory file",
            |d| std::fs::remove_file(d.join("memory")).unwrap(),
            "cannot map guest memory",
        ),
        (
            "no overlay",
            |d| std::fs::remove_file(d.join("disk0.overlay")).unwrap(),
            "disk0.overlay is missing",
        ),
        (
            "no block map",
            |d| std::fs::remove_file(d.join("disk0.blocks")).unwrap(),
            "disk0.blocks",
        ),
        (
            "a disk image changed since",
            |d| {
                edit_state(d, |v| {
                    v["config"]["disks"][0]["image"]["mtime_ns"] = 7.into()
                })
            },
            "changed since the snapshot was made",
        ),
        (
            "memory of another size",
            |d| edit_state(d, |v| v["config"]["mem_mib"] = 128.into()),
            "are not those of a 128 MiB VM",
        ),
        (
            "a CPU feature the host lacks",
            // Leaf 7.0 EBX with every bit set: no CPU has them all (some are reserved).
            |d| {
                edit_state(d, |v| {
                    // kvm_cpuid_entry2 as 40 bytes: function, index, flags, eax, ebx, ...
                    let cpuid = &mut v["state"]["vcpus"][0]["cpuid"][1];
                    for e in cpuid.as_array_mut().unwrap() {
                        let bytes: Vec<u64> = e
                            .as_array()
                            .unwrap()
                            .iter()
                            .map(|b| b.as_u64().unwrap())
                            .collect();
                        if bytes[0..4] == [7, 0, 0, 0] && bytes[4..8] == [0, 0, 0, 0] {
                            for b in 16..20 {
                                e[b] = 255.into();
                            }
                        }
                    }
                })
            },
            "the host lacks",
        ),
        (
            "an MSR the host lacks",
            |d| {
                edit_state(d, |v| {
                    let msrs = v["state"]["vcpus"][0]["msrs"].as_array_mut().unwrap();
                    // kvm_msr_entry as 16 bytes: index, reserved, data.
                    let mut extra = msrs[0].clone();
                    for (i, b) in 0x4b56_4dff_u32.to_le_bytes().iter().enumerate() {
                        extra[i] = (*b).into();
                    }
                    msrs.push(extra);
                })
            },
            "MSR 0x4b564dff",
        ),
    ];
    for (i, (what, damage, expected)) in cases.iter().enumerate() {
        let copy = scratch.path(&format!("bad{i}"));
        copy_snapshot(&snap, &copy);
        damage(&copy);
        let sock = scratch.path(&format!("bad{i}.sock"));
        let (restored, err) = restore_once(&copy, &sock);
        assert!(!restored, "{what}: restored ({err})");
        assert!(err.contains(expected), "{what}: {err}");
        assert!(!err.contains("panicked"), "{what}: {err}");
        // Nothing left: no socket, no vsock socket, no overlay in the cow directory
        // (anonymous files there would be gone with the process anyway).
        assert!(!sock.exists(), "{what}: {}", sock.display());
        assert!(
            !scratch.path(&format!("bad{i}.sock.vsock")).exists(),
            "{what}"
        );
    }
    // The undamaged snapshot still restores.
    let s = Scratch::new("snapshot-bad-good");
    let mut r = Vm::restore(&s, &snap, &[]);
    r.wait_console("tiny: beat ", BOOT);
    r.shutdown(Duration::from_secs(10));
    // Not once its disk image is written anew, even with its size unchanged.
    let image = scratch.path("disk.img");
    std::thread::sleep(Duration::from_millis(20));
    std::fs::write(&image, vec![8u8; 1 << 20]).unwrap();
    let (restored, err) = restore_once(&snap, &scratch.path("rewritten.sock"));
    assert!(!restored, "restored on a rewritten image ({err})");
    assert!(err.contains("disk.img changed since the snapshot"), "{err}");
}

#[test]
fn a_template_snapshot_restores_as_a_template_that_serves_invocations() {
    if !kvm_available("snapshot_template") {
        return;
    }
    let scratch = Scratch::new("snapshot-invoke");
    let args = ["--template", "--warm-clones", "1"];
    let mut vm = tests::tiny_vm_with(&scratch, "64", "1", "ticks=1 invoke=1", &args);
    vm.wait_console("tiny: invoke ready\n", BOOT);
    vm.wait_api(BOOT);
    wait_until("the template to pause", BOOT, || vm.waits_as_template());
    let snap = scratch.path("snap");
    let (code, answer) = vm.snapshot(&snap);
    assert_eq!(code, 201, "{answer}");
    vm.shutdown(Duration::from_secs(10));

    // A template pauses itself where its runtime waits: --paused is refused, clearly.
    let (status, _, err) = run_vmm(
        &["restore", "--dir", snap.to_str().unwrap(), "--paused"],
        Duration::from_secs(60),
    );
    assert!(!status.success());
    assert!(err.contains("restore it without --paused"), "{err}");

    // Restored, its runtime reads "no request", waits again, and the template pauses
    // there; each invocation then runs in a fresh clone of it (the echo's reply carries
    // the clone's number).
    let s = Scratch::new("snapshot-invoke-restored");
    let mut t = Vm::restore(&s, &snap, &["--warm-clones", "1"]);
    t.wait_api(BOOT);
    wait_until("the restored template to pause", BOOT, || {
        t.waits_as_template()
    });
    for n in 1..=3u64 {
        let payload = format!("hello {n}");
        let r = forkvm_client::api::invoke(&t.sock, &Default::default(), payload.as_bytes())
            .unwrap_or_else(|e| panic!("invoke: {e}"));
        assert_eq!(r.status, 200, "{}", r.body);
        assert!(r.bytes.starts_with(payload.as_bytes()), "{:?}", r.bytes);
        let trailer = &r.bytes[payload.len()..];
        let clone = u64::from_le_bytes(trailer[..8].try_into().unwrap());
        assert_eq!(clone, n, "invocation {n} ran in clone {clone}");
    }
    t.shutdown(Duration::from_secs(10));
}

/// `vmm state-id` prints this build's saved-state id, which the library reads as the
/// caches of saved VMs (the containerd shim's template, the gateway's base snapshot) do.
#[test]
fn the_vmm_tells_its_saved_state_id() {
    let vmm = tests::workspace_bin("vmm");
    let out = Command::new(&vmm).arg("state-id").output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let text = String::from_utf8(out.stdout).unwrap();
    assert_eq!(text, format!("{}\n", vmm::SAVED_STATE_ID));
    assert_eq!(forkvm::vmm_state_id(&vmm).unwrap(), vmm::SAVED_STATE_ID);
    let id = vmm::SAVED_STATE_ID;
    assert!(
        id.len() == 16 && id.bytes().all(|b| b.is_ascii_hexdigit()),
        "{id}"
    );
}
