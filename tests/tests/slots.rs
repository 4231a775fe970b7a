//! Disk slots (`--disk-slots`, docs/cloning.md "Disk slots"): a VM boots with empty
//! virtio-blk slots, and a clone request inserts a read-only image into a slot of its
//! clones, whether they are forked on request or launched from the warm pool; the
//! template and its other clones keep theirs, a clone's clone inherits its image, and
//! every bad request is refused with its reason before any clone exists. The tiny guest
//! has no block driver: what the VMM made of each slot is read from `GET /vm`; the
//! guest's view is linux.rs's.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;
use tests::{api_request, kvm_available, Scratch};

const BOOT: Duration = Duration::from_secs(60);

/// Each slot's medium as `GET /vm` on `sock` lists it (None: empty), in slot order.
fn media(sock: &Path) -> Vec<Option<String>> {
    let (code, body) = api_request(sock, "GET", "/vm", None);
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    (v["devices"].as_array().unwrap().iter())
        .filter(|d| d["type"] == "virtio-blk-slot")
        .enumerate()
        .map(|(i, d)| {
            assert_eq!(d["slot"], i, "{d}");
            d["medium"].as_str().map(String::from)
        })
        .collect()
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

    // A VM with an image in a slot is not snapshotted (not supported yet).
    let sock = socket_of(&made[1]);
    assert_eq!(
        api_request(sock, "PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0,
        204
    );
    let dir = scratch.path("snap");
    let body = format!(r#"{{"dir":"{}"}}"#, dir.display());
    let (code, text) = api_request(sock, "PUT", "/snapshot", Some(&body));
    assert_eq!(code, 409, "{text}");
    assert!(text.contains("disk slot"), "{text}");
    assert!(!dir.exists());

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
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-slots",
        &["--disk-slots", "1"],
        &vsock,
        &[],
        LINUX_BOOT,
    );
    // The driver learns of the new capacity from the configuration-change interrupt,
    // on its own time: the script waits for it (up to 30 s on this emulated host).
    let look = "i=0; while [ $(cat /sys/block/vda/size) = 0 ] && [ $i -lt 300 ]; do \
                sleep 0.1; i=$((i+1)); done; echo size=$(cat /sys/block/vda/size); \
                head -c 14 /dev/vda; echo";
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
    let (code, out, err) = tests::vmm_exec(socket_of(clone), &["--", look], b"");
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(out, "size=16\nforkvm-medium-\n", "{err}");
    // The template's stays empty.
    let (code, out, err) = tests::vmm_exec(&vm.sock, &["--", "cat /sys/block/vda/size"], b"");
    assert_eq!((code, out.as_str()), (Some(0), "0\n"), "{err}");
    vm.shutdown(LINUX_BOOT);
}

#[test]
fn an_invocations_clone_gets_the_images_it_asks_for() {
    if !kvm_available("invocation_media") {
        return;
    }
    use api_types::{InsertMedium, InvokeOptions};
    use vmm::api::client;
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

/// A Python template (the runtime's zygote, `python3 -m forkvm`) with one disk slot,
/// paused where its runtime waits: booted once and kept in the snapshot cache.
fn python_template_with_a_slot(scratch: &Scratch) -> tests::Vm {
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
    let vm = tests::cache::restored(scratch, &boot, &[], LINUX_BOOT);
    tests::wait_until("the restored template to pause", LINUX_BOOT, || {
        vm.waits_as_template()
    });
    vm
}

#[test]
fn linux_a_function_imports_its_package_set_from_the_image_in_its_slot() {
    if !kvm_available("linux_slot_packages") {
        return;
    }
    let scratch = Scratch::new("linux-slot-packages");
    // A package set built by the library's cache from wheels made here: a pure-Python
    // distribution and one with a C extension, for the guest's Python.
    let wheels = scratch.path("wheels");
    std::fs::create_dir_all(&wheels).unwrap();
    tests::wheels::pure(&scratch.path(""), "1.0", &wheels);
    tests::wheels::c_extension(&scratch.path(""), &wheels);
    let cache = forkvm::PackageCache::new(scratch.path("cache"), 256 << 20).unwrap();
    let requirements = ["fkvm-pure==1.0".to_string(), "fkvm-c".to_string()];
    let source = forkvm::PackageSource::FindLinks(wheels);
    let set = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(cache.resolve(&requirements, &source))
        .unwrap();
    let image = set.image.clone();
    let mut vm = python_template_with_a_slot(&scratch);
    let load = r#"{"disks": [0], "imports": ["fkvm_pure", "fkvm_c"], "source": "import fkvm_c, fkvm_pure\ndef handler(e):\n    return 'hello %s from %s and %d' % (e.decode(), fkvm_pure.VERSION, fkvm_c.answer())\n"}"#;
    let options = api_types::InvokeOptions {
        derive: true,
        media: vec![api_types::InsertMedium {
            slot: 0,
            path: image.clone(),
        }],
        ..Default::default()
    };
    let r = vmm::api::client::invoke(&vm.sock, &options, load.as_bytes()).unwrap();
    assert_eq!(r.status, 200, "{}", r.body);
    assert!(r.body.contains("\"fkvm_c\""), "imported: {}", r.body);
    // The derived template's clones have the image and the mount: each request in a
    // fresh clone imports nothing more.
    let derived = Path::new(r.header("x-forkvm-socket").unwrap()).to_path_buf();
    tests::wait_until("the derived template to pause", LINUX_BOOT, || {
        api_request(&derived, "GET", "/vm", None)
            .1
            .contains("\"waiting\":true")
    });
    for name in ["Ada", "Grace"] {
        let (code, text) = api_request(&derived, "POST", "/invocations", Some(name));
        assert_eq!((code, text), (200, format!("hello {name} from 1.0 and 42")));
    }
    assert_eq!(media(&derived), [Some(image.display().to_string())]);
    assert_eq!(media(&vm.sock), [None], "the zygote's slot stays empty");
    vm.shutdown(LINUX_BOOT);
}
