//! Disk slots (`--disk-slots`, docs/cloning.md "Disk slots"): a VM boots with empty
//! virtio-blk slots, and a clone request inserts a read-only image into a slot of its
//! clones, whether they are forked on request or launched from the warm pool; the
//! template and its other clones keep theirs, a clone's clone inherits its image, and
//! every bad request is refused with its reason before any clone exists; a snapshot of a
//! clone keeps its media (a restore refuses an image changed since). The tiny guest
//! has no block driver: what the VMM made of each slot is read from `GET /vm`; the
//! guest's view is linux.rs's.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tests::{api_request, kvm_available, Scratch};

const BOOT: Duration = Duration::from_secs(60);

/// Each slot's medium as `GET /vm` on `sock` lists it (None: empty) and whether the VM
/// writes to it, in slot order.
fn writable(sock: &Path) -> Vec<(Option<String>, bool)> {
    let (code, body) = api_request(sock, "GET", "/vm", None);
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    (v["devices"].as_array().unwrap().iter())
        .filter(|d| d["type"] == "virtio-blk-slot")
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["slot"], i, "{d}");
            (
                d["medium"].as_str().map(String::from),
                d["writable"] == true,
            )
        })
        .collect()
}

/// Each slot's medium ([`writable`] without the flag).
fn media(sock: &Path) -> Vec<Option<String>> {
    writable(sock).into_iter().map(|(m, _)| m).collect()
}

/// `POST /clones` on `sock` with `body`; the status and the clones made.
fn clones(sock: &Path, body: &str) -> (u16, Value) {
    let (code, text) = api_request(sock, "POST", "/clones", Some(body));
    (
        code,
        serde_json::from_str(&text).unwrap_or(Value::String(text)),
    )
}

fn socket_of(clone: &Value) -> &Path {
    Path::new(clone["api_sock"].as_str().unwrap())
}

#[test]
fn clones_get_their_own_image_in_a_disk_slot_forked_or_warm() {
    if !kvm_available("disk_slots") {
        return;
    }
    let scratch = Scratch::new("slots");
    let one = scratch.path("one.img");
    let two = scratch.path("two.img");
    std::fs::write(&one, vec![1u8; 8192]).unwrap();
    std::fs::write(&two, vec![2u8; 4096]).unwrap();
    let odd = scratch.path("odd.img");
    std::fs::write(&odd, [0u8; 513]).unwrap();
    let extra = ["--disk-slots", "2", "--warm-clones", "1"];
    let mut vm = tests::tiny_vm_with(&scratch, "64", "1", "ticks=1 beat=10", &extra);
    vm.wait_console("tiny: beat 2\n", BOOT);
    assert_eq!(
        media(&vm.sock),
        [None, None],
        "the template's slots are empty"
    );

    // Forked on request (the VM runs): slot 0 of both clones holds the image.
    let body = format!(
        r#"{{"count":2,"media":[{{"slot":0,"path":"{}"}}]}}"#,
        one.display()
    );
    let (code, made) = clones(&vm.sock, &body);
    assert_eq!(code, 201, "{made}");
    let made = made["clones"].as_array().unwrap().clone();
    let shown = Some(one.display().to_string());
    for c in &made {
        assert_eq!(media(socket_of(c)), [shown.clone(), None], "{c}");
    }
    assert_eq!(
        media(&vm.sock),
        [None, None],
        "the template's are untouched"
    );

    // A clone of such a clone inherits its image; its own request may put another in
    // the other slot.
    let body = format!(r#"{{"media":[{{"slot":1,"path":"{}"}}]}}"#, two.display());
    let (code, grand) = clones(socket_of(&made[0]), &body);
    assert_eq!(code, 201, "{grand}");
    let grand = &grand["clones"][0];
    let both = [shown.clone(), Some(two.display().to_string())];
    assert_eq!(media(socket_of(grand)), both);
    assert_eq!(media(socket_of(&made[0])), [shown.clone(), None]);

    // Launched from the warm pool of the paused template: its image travels with the
    // launch message.
    assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    tests::wait_until("a warm clone", BOOT, || {
        vm.describe()["warm_clones"]["ready"] == 1
    });
    let body = format!(r#"{{"media":[{{"slot":1,"path":"{}"}}]}}"#, two.display());
    let (code, warm) = clones(&vm.sock, &body);
    assert_eq!(code, 201, "{warm}");
    assert_eq!(vm.describe()["warm_clones"]["launched"], 1);
    let warm = &warm["clones"][0];
    assert_eq!(
        media(socket_of(warm)),
        [None, Some(two.display().to_string())]
    );

    // Refused before any clone exists, each with its reason.
    let before = vm.describe()["warm_clones"]["launched"].clone();
    for (media, status, says) in [
        (
            format!(r#"[{{"slot":2,"path":"{}"}}]"#, one.display()),
            409,
            "has 2",
        ),
        (
            format!(r#"[{{"slot":8,"path":"{}"}}]"#, one.display()),
            400,
            "at most 8",
        ),
        (
            format!(
                r#"[{{"slot":0,"path":"{0}"}},{{"slot":0,"path":"{0}"}}]"#,
                one.display()
            ),
            422,
            "given twice",
        ),
        (
            r#"[{"slot":0,"path":"/nonexistent/disk.img"}]"#.into(),
            400,
            "No such file",
        ),
        (
            format!(r#"[{{"slot":0,"path":"{}"}}]"#, odd.display()),
            400,
            "513 bytes",
        ),
        (
            format!(r#"[{{"slot":0,"path":"{}"}}]"#, scratch.path("").display()),
            400,
            "no regular file",
        ),
    ] {
        let (code, text) = api_request(
            &vm.sock,
            "POST",
            "/clones",
            Some(&format!(r#"{{"media":{media}}}"#)),
        );
        assert_eq!(code, status, "{media}: {text}");
        assert!(text.contains(says), "{media}: {text}");
    }
    assert_eq!(
        vm.describe()["warm_clones"]["launched"],
        before,
        "no clone was made"
    );
    // The template keeps no image open once its clones have theirs.
    let targets = tests::fd_targets(vm.child.id());
    assert!(
        !targets.contains("one.img") && !targets.contains("two.img"),
        "{targets}"
    );
    vm.shutdown(BOOT);
}

#[test]
fn writable_media_go_into_writable_slots_each_clone_with_its_own_overlay() {
    if !kvm_available("writable_slots") {
        return;
    }
    let scratch = Scratch::new("slots-rw");
    let image = scratch.path("rw.img");
    std::fs::write(&image, vec![7u8; 8192]).unwrap();
    let rw = format!(
        r#"{{"media":[{{"slot":0,"path":"{}","writable":true}}]}}"#,
        image.display()
    );
    // Read-only slots refuse a writable medium, before any clone exists.
    let mut ro = tests::tiny_vm_with(
        &scratch,
        "64",
        "1",
        "ticks=1 beat=10",
        &["--disk-slots", "1"],
    );
    ro.wait_console("tiny: beat 2\n", BOOT);
    let (code, text) = clones(&ro.sock, &rw);
    assert_eq!(code, 409, "{text}");
    assert!(text.to_string().contains("--slot-cow-dir"), "{text}");
    let (_, list) = api_request(&ro.sock, "GET", "/clones", None);
    assert_eq!(list, r#"{"clones":[]}"#, "no clone was made");
    ro.shutdown(BOOT);

    // Writable slots: each clone's medium has an overlay of its own, anonymous in the
    // directory; a clone of it inherits a copy, a warm clone gets one at launch.
    let cow = scratch.path("slot-cow");
    std::fs::create_dir_all(&cow).unwrap();
    let cow_arg = cow.display().to_string();
    let extra = [
        "--disk-slots",
        "2",
        "--slot-cow-dir",
        &cow_arg,
        "--warm-clones",
        "1",
    ];
    let second = Scratch::new("slots-rw-cow");
    let mut vm = tests::tiny_vm_with(&second, "64", "1", "ticks=1 beat=10", &extra);
    vm.wait_console("tiny: beat 2\n", BOOT);
    let shown = Some(image.display().to_string());
    let (code, made) = clones(
        &vm.sock,
        &rw.replace(r#"{"media""#, r#"{"count":2,"media""#),
    );
    assert_eq!(code, 201, "{made}");
    let made = made["clones"].as_array().unwrap().clone();
    for c in &made {
        assert_eq!(
            writable(socket_of(c)),
            [(shown.clone(), true), (None, false)]
        );
    }
    let (code, grand) = clones(socket_of(&made[0]), "{}");
    assert_eq!(code, 201, "{grand}");
    assert_eq!(
        writable(socket_of(&grand["clones"][0])),
        [(shown.clone(), true), (None, false)]
    );
    // A read-only medium in a writable slot stays read-only.
    let ro_body = format!(r#"{{"media":[{{"slot":1,"path":"{}"}}]}}"#, image.display());
    let (code, c) = clones(&vm.sock, &ro_body);
    assert_eq!(code, 201, "{c}");
    assert_eq!(
        writable(socket_of(&c["clones"][0])),
        [(None, false), (shown.clone(), false)]
    );
    assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    tests::wait_until("a warm clone", BOOT, || {
        vm.describe()["warm_clones"]["ready"] == 1
    });
    let (code, warm) = clones(&vm.sock, &rw);
    assert_eq!(code, 201, "{warm}");
    assert_eq!(vm.describe()["warm_clones"]["launched"], 1);
    assert_eq!(
        writable(socket_of(&warm["clones"][0])),
        [(shown.clone(), true), (None, false)]
    );
    assert_eq!(writable(&vm.sock), [(None, false), (None, false)]);
    // The overlays are anonymous: nothing named in the directory, the image as written;
    // the template holds none of its clones' overlays open.
    assert_eq!(std::fs::read_dir(&cow).unwrap().count(), 0);
    let targets = tests::fd_targets(vm.child.id());
    assert!(!targets.contains(&cow_arg), "{targets}");
    assert_eq!(std::fs::read(&image).unwrap(), vec![7u8; 8192]);
    vm.shutdown(BOOT);
}

#[test]
fn a_snapshot_keeps_the_media_in_its_slots_and_refuses_an_image_changed_since() {
    if !kvm_available("slot_snapshots") {
        return;
    }
    let scratch = Scratch::new("slots-snap");
    let (rw_image, ro_image) = (scratch.path("rw.img"), scratch.path("ro.img"));
    std::fs::write(&rw_image, vec![7u8; 8192]).unwrap();
    std::fs::write(&ro_image, vec![9u8; 4096]).unwrap();
    let cow = scratch.path("cow");
    std::fs::create_dir_all(&cow).unwrap();
    let cow_arg = cow.display().to_string();
    let extra = ["--disk-slots", "2", "--slot-cow-dir", &cow_arg];
    let mut vm = tests::tiny_vm_with(&scratch, "64", "1", "ticks=1 beat=10", &extra);
    vm.wait_console("tiny: beat 2\n", BOOT);
    let body = format!(
        r#"{{"media":[{{"slot":0,"path":"{}","writable":true}},{{"slot":1,"path":"{}"}}]}}"#,
        rw_image.display(),
        ro_image.display()
    );
    let (code, made) = clones(&vm.sock, &body);
    assert_eq!(code, 201, "{made}");
    let clone = socket_of(&made["clones"][0]).to_path_buf();
    let shown = [
        (Some(rw_image.display().to_string()), true),
        (Some(ro_image.display().to_string()), false),
    ];
    assert_eq!(writable(&clone), shown);
    // The clone, paused, saved: its media by path, the writable one's overlay copied.
    let (code, text) = api_request(&clone, "PATCH", "/vm", Some(r#"{"state":"paused"}"#));
    assert_eq!(code, 204, "{text}");
    let snap = scratch.path("snap");
    let body = format!(r#"{{"dir":"{}"}}"#, snap.display());
    let (code, text) = api_request(&clone, "PUT", "/snapshot", Some(&body));
    assert_eq!(code, 201, "{text}");
    assert!(snap.join("disk0.overlay").is_file(), "{text}");
    vm.shutdown(BOOT);

    // Restored: the same media, the same writability, and so are its clones'.
    let again = Scratch::new("slots-snap-restored");
    let cow2 = again.path("cow");
    std::fs::create_dir_all(&cow2).unwrap();
    let cow2_arg = cow2.display().to_string();
    let mut restored = tests::Vm::restore(&again, &snap, &["--paused", "--cow-dir", &cow2_arg]);
    restored.wait_api(BOOT);
    assert_eq!(writable(&restored.sock), shown);
    let (code, made) = clones(&restored.sock, "{}");
    assert_eq!(code, 201, "{made}");
    assert_eq!(writable(socket_of(&made["clones"][0])), shown);
    restored.shutdown(BOOT);
    assert_eq!(std::fs::read(&rw_image).unwrap(), vec![7u8; 8192]);

    // An image modified since: the guest's page cache would not match it.
    let f = std::fs::File::options()
        .write(true)
        .open(&ro_image)
        .unwrap();
    f.set_modified(std::time::SystemTime::now() + Duration::from_secs(5))
        .unwrap();
    drop(f);
    let third = Scratch::new("slots-snap-changed");
    let mut refused = tests::Vm::restore(&third, &snap, &["--paused"]);
    let status = refused.wait_exit(BOOT);
    assert!(!status.success());
    let err = refused.stderr_text();
    assert!(err.contains("ro.img changed since the snapshot"), "{err}");
}

/// A Linux guest restored from the snapshot cache, its boot being what linux.rs tests.
const LINUX_BOOT: Duration = Duration::from_secs(900);

#[test]
fn linux_sees_the_image_inserted_into_its_clones_slot() {
    if !kvm_available("linux_disk_slots") {
        return;
    }
    let scratch = Scratch::new("linux-slots");
    let image = scratch.path("medium.img");
    let mut bytes = b"forkvm-medium-".to_vec();
    bytes.resize(8192, b'.');
    std::fs::write(&image, &bytes).unwrap();
    let vsock = scratch.path("vm.vsock");
    let cow = scratch.path("slot-cow");
    std::fs::create_dir_all(&cow).unwrap();
    let cow_arg = cow.display().to_string();
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-slots",
        &["--disk-slots", "1", "--slot-cow-dir", tests::cache::COW],
        &vsock,
        &["--cow-dir", &cow_arg],
        LINUX_BOOT,
    );
    // The driver learns of the new capacity from the configuration-change interrupt,
    // on its own time: the script waits for it (up to 30 s on this emulated host).
    let wait = "i=0; while [ $(cat /sys/block/vda/size) = 0 ] && [ $i -lt 300 ]; do \
                sleep 0.1; i=$((i+1)); done; echo size=$(cat /sys/block/vda/size)";
    let look = format!("{wait}; head -c 14 /dev/vda; echo");
    let (code, out, err) = tests::vmm_exec(&vm.sock, &["--", "cat /sys/block/vda/size"], b"");
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "0\n"),
        "the template's slot: {err}"
    );
    let body = format!(r#"{{"media":[{{"slot":0,"path":"{}"}}]}}"#, image.display());
    let (code, text) = api_request(&vm.sock, "POST", "/clones", Some(&body));
    assert_eq!(code, 201, "{text}");
    let made: Value = serde_json::from_str(&text).unwrap();
    let clone = &made["clones"][0];
    let (code, out, err) = tests::vmm_exec(socket_of(clone), &["--", &look], b"");
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(out, "size=16\nforkvm-medium-\n", "{err}");
    // The template's stays empty.
    let (code, out, err) = tests::vmm_exec(&vm.sock, &["--", "cat /sys/block/vda/size"], b"");
    assert_eq!((code, out.as_str()), (Some(0), "0\n"), "{err}");

    // Writable (the slots are: --slot-cow-dir): two clones of the same image each
    // write their own, read back from the device (the page cache dropped), and see
    // nothing of the other's; a clone of the writer reads what it wrote from its copy
    // of the overlay; the image is never written.
    let body = format!(
        r#"{{"count":2,"media":[{{"slot":0,"path":"{}","writable":true}}]}}"#,
        image.display()
    );
    let (code, text) = api_request(&vm.sock, "POST", "/clones", Some(&body));
    assert_eq!(code, 201, "{text}");
    let made: Value = serde_json::from_str(&text).unwrap();
    let read = "sync; echo 3 > /proc/sys/vm/drop_caches; dd if=/dev/vda bs=512 skip=1 count=1 \
                2>/dev/null | head -c 9; echo";
    for (i, c) in made["clones"].as_array().unwrap().iter().enumerate() {
        let write = format!(
            "{wait}; {read}; printf 'clone-{i}-w' | dd of=/dev/vda bs=512 seek=1 \
             conv=notrunc 2>/dev/null && {read}"
        );
        let (code, out, err) = tests::vmm_exec(socket_of(c), &["--", &write], b"");
        assert_eq!(code, Some(0), "{out}{err}");
        // Before its write the image's bytes: nothing of the other clone's.
        assert_eq!(out, format!("size=16\n.........\nclone-{i}-w\n"), "{err}");
    }
    let writer = socket_of(&made["clones"][0]);
    let (code, text) = api_request(writer, "POST", "/clones", Some("{}"));
    assert_eq!(code, 201, "{text}");
    let grand: Value = serde_json::from_str(&text).unwrap();
    let (code, out, err) = tests::vmm_exec(socket_of(&grand["clones"][0]), &["--", read], b"");
    assert_eq!((code, out.as_str()), (Some(0), "clone-0-w\n"), "{err}");
    assert_eq!(std::fs::read(&image).unwrap(), bytes, "the image as it was");
    assert_eq!(
        std::fs::read_dir(&cow).unwrap().count(),
        0,
        "anonymous overlays"
    );
    let rootfs = containers_in_clones(&scratch, &vm);
    media_changed_while_running(&vm, &rootfs, &image, &look);
    vm.shutdown(LINUX_BOOT);
}

/// A running clone of `vm` (slot 0 empty) takes a medium (`PUT /slots/0`): the
/// container root file system `rootfs`, writable, which a container runs on; gives it
/// up once released (`DELETE /slots/0`), and takes another (`image`, read-only) that
/// the guest reads fresh (`look` prints its first bytes); a clone of the clone inherits
/// it. Requests that do not fit are refused with the slot as it was.
fn media_changed_while_running(vm: &tests::Vm, rootfs: &Path, image: &Path, look: &str) {
    let (code, text) = api_request(&vm.sock, "POST", "/clones", Some("{}"));
    assert_eq!(code, 201, "{text}");
    let made: Value = serde_json::from_str(&text).unwrap();
    let c = socket_of(&made["clones"][0]);
    let put = |path: &Path, writable: bool| {
        let body = format!(r#"{{"path":"{}","writable":{writable}}}"#, path.display());
        api_request(c, "PUT", "/slots/0", Some(&body))
    };
    let (code, text) = put(rootfs, true);
    assert_eq!(code, 204, "{text}");
    let shown = rootfs.display().to_string();
    assert_eq!(writable(c), vec![(Some(shown), true)]);
    let run = "forkvm-oci -- sh -c 'cat /etc/motd; echo hot > /tmp/f; cat /tmp/f'";
    let (code, out, err) = tests::vmm_exec(c, &["--", run], b"");
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "from the image\nhot\n"),
        "{err}"
    );
    let (code, text) = put(image, false);
    assert_eq!(code, 409, "a full slot: {text}");
    // Released in the guest, then ejected: the driver sees the slot empty.
    let (code, out, err) = tests::vmm_exec(c, &["--", "forkvm-oci --release"], b"");
    assert_eq!(code, Some(0), "{out}{err}");
    let (code, text) = api_request(c, "DELETE", "/slots/0", None);
    assert_eq!(code, 204, "{text}");
    assert_eq!(media(c), vec![None]);
    let gone = "i=0; while [ $(cat /sys/block/vda/size) != 0 ] && [ $i -lt 300 ]; do \
                sleep 0.1; i=$((i+1)); done; cat /sys/block/vda/size";
    let (code, out, err) = tests::vmm_exec(c, &["--", gone], b"");
    assert_eq!((code, out.as_str()), (Some(0), "0\n"), "{err}");
    let (code, text) = api_request(c, "DELETE", "/slots/0", None);
    assert_eq!(code, 409, "an empty slot: {text}");
    let (code, text) = api_request(c, "PUT", "/slots/3", Some(r#"{"path":"/x"}"#));
    assert_eq!(code, 409, "no such slot: {text}");
    let (code, text) = put(Path::new("/nonexistent.img"), false);
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("/nonexistent.img"), "{text}");
    assert_eq!(media(c), vec![None], "refusals change nothing");
    // Another medium: the guest reads its bytes, not the last one's.
    let (code, text) = put(image, false);
    assert_eq!(code, 204, "{text}");
    let (code, out, err) = tests::vmm_exec(c, &["--", look], b"");
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "size=16\nforkvm-medium-\n"),
        "{err}"
    );
    let (code, text) = api_request(c, "POST", "/clones", Some("{}"));
    assert_eq!(code, 201, "{text}");
    let grand: Value = serde_json::from_str(&text).unwrap();
    let g = socket_of(&grand["clones"][0]);
    let (code, out, err) = tests::vmm_exec(g, &["--", look], b"");
    assert_eq!(
        (code, out.as_str()),
        (Some(0), "size=16\nforkvm-medium-\n"),
        "{err}"
    );
    for s in [g, c] {
        api_request(s, "PUT", "/actions", Some(r#"{"action_type":"shutdown"}"#));
    }
}

/// A busybox root file system tree in `dir` (Debian's static busybox, the host's).
fn busybox_tree(dir: &Path) {
    use std::os::unix::fs::PermissionsExt;
    for d in ["bin", "proc", "sys", "dev", "etc", "tmp"] {
        std::fs::create_dir_all(dir.join(d)).unwrap();
    }
    let tmp = dir.join("tmp");
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::fs::copy("/bin/busybox", dir.join("bin/busybox")).unwrap();
    for applet in ["sh", "echo", "cat", "id", "hostname", "pwd", "env", "ls"] {
        std::os::unix::fs::symlink("busybox", dir.join("bin").join(applet)).unwrap();
    }
    std::fs::write(dir.join("etc/motd"), "from the image\n").unwrap();
}

/// Containers in clones of `vm` (writable slots; the Linux agent): a root file system
/// image (`forkvm::ImageCache`) inserted writable into slot 0 of two clones, a process
/// run in each with `forkvm-oci` through the agent: its hostname, user, directory,
/// environment and exit status as asked; each container's writes its own; a program
/// that is not there 127; a VM with no medium says so (125).
/// Returns the image.
fn containers_in_clones(scratch: &Scratch, vm: &tests::Vm) -> std::path::PathBuf {
    let tree = scratch.path("rootfs");
    busybox_tree(&tree);
    let images = forkvm::ImageCache::new(scratch.path("images"), 64 << 20).unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (image, built) = rt.block_on(images.build("busybox", &tree)).unwrap();
    assert!(built);
    let body = format!(
        r#"{{"count":2,"media":[{{"slot":0,"path":"{}","writable":true}}]}}"#,
        image.display()
    );
    let (code, text) = api_request(&vm.sock, "POST", "/clones", Some(&body));
    assert_eq!(code, 201, "{text}");
    let made: Value = serde_json::from_str(&text).unwrap();
    let (one, two) = (socket_of(&made["clones"][0]), socket_of(&made["clones"][1]));
    let run = "forkvm-oci --hostname box1 --cwd /tmp --user 1000:1000 --env GREETING=hi -- \
               sh -c 'echo $GREETING from $(hostname) in $(pwd) as $(id -u):$(id -g); \
               cat /etc/motd; echo mine > /tmp/f; cat /tmp/f; exit 3'";
    let (code, out, err) = tests::vmm_exec(one, &["--", run], b"");
    assert_eq!(code, Some(3), "{out}{err}");
    assert_eq!(
        out, "hi from box1 in /tmp as 1000:1000\nfrom the image\nmine\n",
        "{err}"
    );
    // A second process in the same container sees its file; the other container
    // does not.
    let (code, out, err) = tests::vmm_exec(one, &["--", "forkvm-oci -- cat /tmp/f"], b"");
    assert_eq!((code, out.as_str()), (Some(0), "mine\n"), "{err}");
    let (code, out, err) = tests::vmm_exec(two, &["--", "forkvm-oci -- cat /tmp/f 2>&1"], b"");
    assert_eq!(code, Some(1), "{out}{err}");
    assert!(out.contains("can't open '/tmp/f'"), "{out}");
    let (code, out, _) = tests::vmm_exec(two, &["--", "forkvm-oci -- nosuch 2>&1"], b"");
    assert_eq!(code, Some(127), "{out}");
    assert!(out.contains("forkvm-oci: nosuch: No such file"), "{out}");
    // The template's slot is empty: nothing to run on.
    let (code, out, _) = tests::vmm_exec(
        &vm.sock,
        &["--", "forkvm-oci --timeout-s 1 -- true 2>&1"],
        b"",
    );
    assert_eq!(code, Some(125), "{out}");
    assert!(out.contains("slot 0 is empty"), "{out}");
    for c in [one, two] {
        api_request(c, "PUT", "/actions", Some(r#"{"action_type":"shutdown"}"#));
    }
    image
}

#[test]
fn an_invocations_clone_gets_the_images_it_asks_for() {
    if !kvm_available("invocation_media") {
        return;
    }
    use api_types::{InsertMedium, InvokeOptions};
    use forkvm_client::api as client;
    let scratch = Scratch::new("slots-invoke");
    let image = scratch.path("fn.img");
    std::fs::write(&image, vec![7u8; 4096]).unwrap();
    let extra = ["--template", "--disk-slots", "1", "--warm-clones", "1"];
    let mut vm = tests::tiny_vm_with(&scratch, "64", "1", "ticks=1 invoke=1", &extra);
    vm.wait_console("tiny: invoke ready\n", BOOT);
    tests::wait_until("the template to pause", BOOT, || vm.waits_as_template());
    let options = InvokeOptions {
        keep_alive: true,
        media: vec![InsertMedium {
            slot: 0,
            path: image.clone(),
            writable: false,
        }],
        ..Default::default()
    };
    let r = client::invoke(&vm.sock, &options, b"ping").unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let socket = Path::new(r.header("x-forkvm-socket").unwrap()).to_path_buf();
    assert_eq!(media(&socket), [Some(image.display().to_string())]);
    assert_eq!(media(&vm.sock), [None]);
    // A keep-alive clone serves the next request in place: no clone, so no images.
    let r = client::invoke(&socket, &options, b"again").unwrap();
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.body.contains("media"), "{}", r.body);
    assert_eq!(
        client::invoke(&socket, &Default::default(), b"x")
            .unwrap()
            .status,
        200
    );
    // The query's text form, and a missing image refused before any clone exists.
    let query = format!("/invocations?media=0:{}", image.display());
    assert_eq!(api_request(&vm.sock, "POST", &query, Some("p")).0, 200);
    let made = vm.describe()["warm_clones"]["launched"].clone();
    let (code, text) = api_request(
        &vm.sock,
        "POST",
        "/invocations?media=0:/no/such.img",
        Some("p"),
    );
    assert_eq!(code, 400, "{text}");
    assert!(text.contains("/no/such.img"), "{text}");
    let (code, text) = api_request(&vm.sock, "POST", "/invocations?media=zero", Some("p"));
    assert_eq!(code, 400, "{text}");
    assert_eq!(vm.describe()["warm_clones"]["launched"], made);
    vm.shutdown(BOOT);
}

/// With `--rewind`, the clones of a template with a disk slot come back rewound: a
/// request's own image, and the image of a derived template (the gateway's package
/// sets), each opened again at every launch, none left open after.
#[test]
fn rewound_clones_open_their_images_again_at_each_launch() {
    if !kvm_available("slots_rewind") {
        return;
    }
    use api_types::{InsertMedium, InvokeOptions};
    use forkvm_client::api as client;
    let scratch = Scratch::new("slots-rewind");
    let image = scratch.path("fn.img");
    std::fs::write(&image, vec![7u8; 4096]).unwrap();
    let extra = [
        "--template",
        "--disk-slots",
        "1",
        "--warm-clones",
        "2",
        "--rewind",
    ];
    let cmdline = "ticks=1 invoke=1 load=1";
    let mut vm = tests::tiny_vm_with(&scratch, "64", "1", cmdline, &extra);
    vm.wait_console("tiny: invoke ready\n", BOOT);
    tests::wait_until("the template to pause", BOOT, || vm.waits_as_template());
    let medium = InsertMedium {
        slot: 0,
        path: image.clone(),
        writable: false,
    };
    let derive = InvokeOptions {
        derive: true,
        media: vec![medium.clone()],
        ..Default::default()
    };
    let r = client::invoke(&vm.sock, &derive, b"pkgs\0\0\0\0").unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    let id = r.header("x-forkvm-clone-id").unwrap().to_string();
    let derived = Path::new(r.header("x-forkvm-socket").unwrap()).to_path_buf();
    let (_, body) = api_request(&vm.sock, "GET", "/clones", None);
    let list: Value = serde_json::from_str(&body).unwrap();
    let dpid = (list["clones"].as_array().unwrap().iter())
        .find(|c| c["id"] == id.as_str())
        .and_then(|c| c["pid"].as_u64())
        .unwrap_or_else(|| panic!("{id} not listed: {body}")) as u32;
    tests::wait_until("the derived template to pause", BOOT, || {
        let (_, v) = api_request(&derived, "GET", "/vm", None);
        let v: Value = serde_json::from_str(&v).unwrap();
        v["state"] == "paused" && v["invoke"]["template"] == true
    });
    assert_eq!(media(&derived), [Some(image.display().to_string())]);
    let own = InvokeOptions {
        media: vec![medium],
        ..Default::default()
    };
    // On the derived template its image inherited; on the root the request's own. A
    // template's warm clones: its children but the derived template.
    let warm_of = |pid: u32| -> Vec<u32> {
        (tests::children_of(pid).into_iter())
            .filter(|&c| c != dpid)
            .collect()
    };
    let root = vm.child.id();
    for (sock, pid, options) in [
        (&derived, dpid, InvokeOptions::default()),
        (&vm.sock, root, own),
    ] {
        let ready = || {
            let (_, v) = api_request(sock, "GET", "/vm", None);
            let v: Value = serde_json::from_str(&v).unwrap();
            v["warm_clones"]["ready"] == 2 && warm_of(pid).len() == 2
        };
        let mut at_rest = None;
        for i in 0..10 {
            let r = client::invoke(sock, &options, b"x").unwrap();
            assert_eq!(r.status, 200, "{}: {}", sock.display(), r.body);
            tests::wait_until("the clone to come back", BOOT, ready);
            // The first requests' clones report the working set, and the warm clones
            // made before are replaced: the processes are taken after three.
            // (Their descriptors once each served a life since: they take turns.)
            if i == 5 {
                std::thread::sleep(Duration::from_millis(500));
                tests::wait_until("the pool to settle", BOOT, ready);
                let warm = warm_of(pid);
                let fds: Vec<usize> = warm.iter().map(|&w| tests::fds_at_rest(w)).collect();
                at_rest = Some((warm, fds));
            }
        }
        let (warm, fds) = at_rest.unwrap();
        assert_eq!(warm_of(pid), warm, "{}: not rewound", sock.display());
        for (w, n) in warm.into_iter().zip(fds) {
            assert_eq!(tests::fds_of(w, n), n, "{}", tests::fd_targets(w));
        }
    }
}

/// The snapshot of a Python template (the runtime's zygote, `python3 -m forkvm`) with
/// one disk slot, paused where its runtime waits: booted once and kept in the snapshot
/// cache.
fn python_template_with_a_slot() -> std::path::PathBuf {
    let cmdline = "console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda ro rootfstype=ext4 \
                   forkvm.run=\"python3 -m forkvm\"";
    let (kernel, root) = (
        tests::cache::guest_image("vmlinux"),
        tests::cache::guest_image("python.ext4"),
    );
    let args = [
        "--kernel",
        &kernel,
        "--rootfs",
        &root,
        "--mem-mib",
        "256",
        "--cmdline",
        cmdline,
        "--template",
        "--disk-slots",
        "1",
    ];
    let paused = |vm: &mut tests::Vm| {
        vm.wait_api(LINUX_BOOT);
        tests::wait_until("the template to pause", LINUX_BOOT, || {
            vm.waits_as_template()
        });
    };
    let boot = tests::cache::CachedBoot {
        name: "linux-python-slot",
        run_args: &args,
        ready: &paused,
    };
    tests::cache::saved(&boot, LINUX_BOOT)
}

/// The handler of the package-set functions: both packages' answers.
const PACKAGED: &str = "import fkvm_c, fkvm_pure\ndef handler(e):\n    return 'hello %s from %s and %d' % (e.decode(), fkvm_pure.VERSION, fkvm_c.answer())\n";

fn load(requirements: &[&str], imports: &[&str], source: &str) -> forkvm::Load {
    let mut l = forkvm::Load::imports(imports.iter().copied());
    l.requirements = requirements.iter().map(|r| r.to_string()).collect();
    l.source = Some(source.into());
    l
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linux_functions_with_one_package_set_share_its_image_and_zygotes() {
    if !kvm_available("linux_slot_packages") {
        return;
    }
    use forkvm::{Error, PackageCache, PackageSource, Tier, ZygoteCache};
    let scratch = Scratch::new("linux-slot-packages");
    // Wheels made here (no index): a pure-Python distribution in two versions and one
    // with a C extension, for the guest's Python.
    let wheels = scratch.path("wheels");
    std::fs::create_dir_all(&wheels).unwrap();
    for v in ["1.0", "2.0"] {
        tests::wheels::pure(&scratch.path(""), v, &wheels);
    }
    tests::wheels::c_extension(&scratch.path(""), &wheels);
    let images = scratch.path("cache");
    // Room for one set's image (9 MiB each here), not two: a set a cached root zygote
    // holds is kept over the budget, one no root holds goes.
    let packages = PackageCache::new(&images, 12 << 20).unwrap();
    // The zygote tree's base: the Python template with a slot, restored by the library.
    let dir = tokio::task::block_in_place(python_template_with_a_slot);
    let mut spec = forkvm::TemplateSpec::new("unused: the snapshot's guest runs");
    spec.vmm = tests::vmm_bin();
    spec.warm_clones = 1;
    spec.start_timeout = LINUX_BOOT;
    spec.call_timeout = LINUX_BOOT;
    let base = forkvm::Template::restore(&dir, spec).await.unwrap();
    let cache = ZygoteCache::new(base, Default::default()).await.unwrap();
    // Without a package cache, requirements are refused before any guest work.
    let v1 = load(
        &["fkvm-pure==1.0", "fkvm-c"],
        &["fkvm_pure", "fkvm_c"],
        PACKAGED,
    );
    let e = cache.function("early", &v1).await.unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    let cache = cache.with_packages(packages, PackageSource::FindLinks(wheels));

    // The first function of a set: its root (the base with the image mounted), then
    // the function's template derived from it, which imports both packages, the C
    // extension included, in every clone.
    let (a, tier) = cache.function("a", &v1).await.unwrap();
    assert_eq!(tier, Tier::Base);
    for name in ["Ada", "Grace"] {
        let r = a
            .invoke(name.to_string(), &Default::default())
            .await
            .unwrap();
        assert_eq!(r.body, format!("hello {name} from 1.0 and 42"));
    }
    let set = cache.package_set(&v1.requirements).await.unwrap();
    assert_eq!(set.resolved, ["fkvm-c==1.0", "fkvm-pure==1.0"]);
    assert!(!set.built, "resolved once, by the first function");
    let image = Some(set.image.display().to_string());
    let (a_sock, base_sock) = (
        a.socket().to_path_buf(),
        cache.base().socket().to_path_buf(),
    );
    tokio::task::block_in_place(|| {
        assert_eq!(media(&a_sock), [image]);
        assert_eq!(media(&base_sock), [None], "the base's slot stays empty");
    });
    let stats = cache.stats();
    assert_eq!((stats.package_sets_mounted, stats.zygotes_made), (1, 1));

    // A second function with the same requirements (another order) and imports: the
    // same set and root; asked twice, the (set, imports) zygote is made for it.
    let v1b = load(
        &["fkvm-c", "fkvm-pure==1.0"],
        &["fkvm_c", "fkvm_pure"],
        "import fkvm_pure\ndef handler(e):\n    return fkvm_pure.VERSION\n",
    );
    let (b, _) = cache.function("b", &v1b).await.unwrap();
    let r = b.invoke("x", &Default::default()).await.unwrap();
    assert_eq!(&r.body[..], b"1.0");
    let stats = cache.stats();
    assert_eq!((stats.package_sets_mounted, stats.zygotes_made), (1, 2));
    let imports: forkvm::Packages = ["fkvm_c", "fkvm_pure"].map(String::from).into();
    assert_eq!(
        cache.package_zygotes(),
        [
            (set.key.clone(), Default::default()),
            (set.key.clone(), imports)
        ]
    );
    assert_eq!(
        cache.zygotes(),
        [forkvm::Packages::new()],
        "no image-only zygote"
    );

    // Another version is another set, with its own image and root.
    let v2 = load(
        &["fkvm-pure==2.0", "fkvm-c"],
        &["fkvm_pure", "fkvm_c"],
        PACKAGED,
    );
    let (c, tier) = cache.function("c", &v2).await.unwrap();
    assert_eq!(tier, Tier::Base, "no zygote of this set yet");
    let r = c.invoke("Lin", &Default::default()).await.unwrap();
    assert_eq!(r.body, "hello Lin from 2.0 and 42");
    assert_eq!(cache.stats().package_sets_mounted, 2);
    let ext4 = |dir: &Path| {
        (std::fs::read_dir(dir).unwrap().flatten())
            .filter(|e| e.path().extension().is_some_and(|x| x == "ext4"))
            .count()
    };
    assert_eq!(ext4(&images), 2);

    // A requirement that does not resolve: the caller's error with pip's message,
    // nothing cached or built.
    let bad = load(&["fkvm-missing"], &[], PACKAGED);
    let e = cache.function("bad", &bad).await.unwrap_err();
    assert_eq!(e.kind(), forkvm::ErrorKind::Caller, "{e}");
    assert!(e.to_string().contains("fkvm-missing"), "{e}");
    assert_eq!(ext4(&images), 2);
    assert_eq!(cache.stats().package_sets_mounted, 2);

    // Every template evicted: the sets are held no more, and the next set built keeps
    // the cache to its budget.
    drop((a, b, c));
    cache.set_memory_budget(0);
    assert!(cache.package_zygotes().is_empty());
    let v3 = load(
        &["fkvm-pure==2.0"],
        &["fkvm_pure"],
        "import fkvm_pure\ndef handler(e):\n    return fkvm_pure.VERSION\n",
    );
    let (d, _) = cache.function("d", &v3).await.unwrap();
    assert_eq!(
        &d.invoke("x", &Default::default()).await.unwrap().body[..],
        b"2.0"
    );
    assert_eq!(ext4(&images), 1, "the unheld images evicted");
    drop(d);
    drop(cache);
    tokio::task::spawn_blocking(|| forkvm::wait_stopped(Duration::from_secs(10)))
        .await
        .unwrap();
}
