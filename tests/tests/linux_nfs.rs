//! Shared storage (docs/shared-storage.md): a Linux template mounts an NFS export from a
//! real user-space server (nfs-ganesha, `tests::nfs`) in a namespace behind the bridge
//! its clones use; every clone keeps using the mount after the clone point as itself.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use api_types::InvokeOptions;
use forkvm_client::api as client;
use serde_json::Value;
use tests::nfs::{NfsServer, MOUNT_PORT, NFS_PORT};
use tests::{guest_file, vmm_exec, wait_until, Netns, Scratch, Vm};

/// A Linux boot takes about 20-60 s here; generous for a loaded CI host.
const LINUX_BOOT: Duration = Duration::from_secs(400);
const CLONES: usize = 8;
const SERVER: &str = "10.79.0.1";
/// The limited clone's rate: a bucket of this many bytes, refilled each second.
const LIMIT_BUCKET: u64 = 8192;
/// What the limited clone writes: 16 buckets, so the limit shows.
const LIMITED_WRITE: u64 = 128 * 1024;

/// The mount options docs/shared-storage.md recommends for clones, without the
/// hard/soft choice.
fn mount_options() -> String {
    format!(
        "vers=3,proto=tcp,port={NFS_PORT},mountport={MOUNT_PORT},mountproto=tcp,nolock,\
         lookupcache=positive,addr={SERVER}"
    )
}

/// `vmm run` options of a 256 MiB Linux template on `tap` at 10.79.0.2 (gateway: the
/// server) booting `cmdline`, then `extra`.
fn template_args(tap: &str, cmdline: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--kernel",
        &guest_file("vmlinux").display().to_string(),
        "--initrd",
        &guest_file("initramfs.cpio").display().to_string(),
        "--mem-mib",
        "256",
        "--tap",
        tap,
        "--ipv4",
        "10.79.0.2/24",
        "--gateway",
        SERVER,
        "--cmdline",
        cmdline,
    ]
    .iter()
    .map(|a| a.to_string())
    .collect();
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// A clone's API socket, from `POST /clones`' answer.
fn sock(c: &Value) -> PathBuf {
    PathBuf::from(c["api_sock"].as_str().expect("api_sock"))
}

/// Runs `cmd` in the guest behind `sock` through its agent; its stdout, after asserting
/// it exited 0.
fn run(sock: &Path, cmd: &str) -> String {
    let (code, out, err) = vmm_exec(sock, &["--", cmd], b"");
    assert_eq!(code, Some(0), "`{cmd}` in {}: {out}{err}", sock.display());
    out
}

/// Runs `cmd` in every clone at once; their outputs in clone order.
fn run_in_all(clones: &[Value], cmd: impl Fn(usize) -> String + Sync) -> Vec<String> {
    std::thread::scope(|s| {
        let handles: Vec<_> = clones
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let cmd = &cmd;
                s.spawn(move || run(&sock(c), &cmd(i + 1)))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// The files of the export and their contents.
fn export_files(export: &Path) -> Vec<(String, String)> {
    let mut files: Vec<(String, String)> = std::fs::read_dir(export)
        .unwrap()
        .map(|e| {
            let e = e.unwrap();
            let name = e.file_name().to_string_lossy().into_owned();
            let text = String::from_utf8_lossy(&std::fs::read(e.path()).unwrap()).into_owned();
            (name, text)
        })
        .collect();
    files.sort();
    files
}

#[test]
fn linux_clones_share_an_nfs_export_each_as_itself_and_survive_a_server_restart() {
    if !tests::kvm_and_root_available("linux_nfs_shared_storage") {
        return;
    }
    let scratch = Scratch::new("linux-nfs");
    let pid = std::process::id();
    let tap = format!("fkn{}", pid % 100_000_000);
    let ns = Netns::new(&format!("fkvm-test-{pid}-nfs"));
    ns.add_bridge(&format!("{SERVER}/24"), "02:00:0a:4f:00:01");
    let attach = |dev: &str| ns.attach_to_bridge(dev);
    let export = scratch.path("export");
    let mut server = NfsServer::start(&ns, &export, &scratch.path("server"));

    // The template takes its address, mounts the export twice (hard, and soft with a
    // short timeout), writes a file, flushes it and serves its agent.
    let opts = mount_options();
    let src = format!("{SERVER}:{}", server.export().display());
    let script = format!(
        "forkvm-clone --net; until ping -c1 -W1 {SERVER} >/dev/null 2>&1; do sleep 1; done; \
         mkdir -p /mnt/nfs /mnt/soft && \
         mount -t nfs -o {opts},hard {src} /mnt/nfs && \
         mount -t nfs -o {opts},soft,timeo=20,retrans=1 {src} /mnt/soft && \
         echo template > /mnt/nfs/template && sync && echo nfs-up; echo script-done"
    );
    // Restored from the cached agent guest on the bridge's network, the script run
    // through the agent as a boot would run it from the command line.
    let vsock = scratch.path("vm.vsock");
    let devices = [
        "--tap",
        tests::cache::TAP,
        "--ipv4",
        "10.79.0.2/24",
        "--gateway",
        SERVER,
    ];
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-nfs-net",
        &devices,
        &vsock,
        &["--tap", &tap],
        LINUX_BOOT,
    );
    tests::wait_link(&tap);
    attach(&tap);
    tests::run_on_console(&vm.sock, &script);
    let console = vm.wait_console_line("script-done", LINUX_BOOT);
    assert!(
        console.contains("nfs-up\n"),
        "the template did not mount: {console}"
    );
    assert_eq!(
        std::fs::read_to_string(export.join("template")).unwrap(),
        "template\n"
    );

    // 8 clones of the paused template, each with its own address on the bridge.
    assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    let addresses: Vec<Value> = (1..=CLONES)
        .map(|i| serde_json::json!({ "ipv4": format!("10.79.0.{}/24", 10 + i) }))
        .collect();
    let body = serde_json::json!({"count": CLONES, "console": "null", "addresses": addresses});
    let (code, answer) = vm.api("POST", "/clones", Some(&body.to_string()));
    assert_eq!(code, 201, "{answer}");
    let answer: Value = serde_json::from_str(&answer).unwrap();
    let clones = answer["clones"].as_array().unwrap().clone();
    for c in &clones {
        let own = c["net"]["tap"].as_str().unwrap();
        tests::wait_link(own);
        attach(own);
    }

    // Each clone (the agent adopts first: its address, then its NFS connections made
    // again) reads the template's file and writes its own.
    let start = Instant::now();
    let outs = run_in_all(&clones, |i| {
        format!("cat /mnt/nfs/template && echo clone-{i} > /mnt/nfs/clone-{i} && sync")
    });
    eprintln!(
        "linux_nfs: {CLONES} clones adopted, read and wrote in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    for out in &outs {
        assert!(out.ends_with("template\n"), "{out}");
    }
    // The server saw every clone connect from its own address.
    let peers: BTreeSet<String> = server.clients().into_iter().collect();
    for i in 1..=CLONES {
        let addr = format!("10.79.0.{}", 10 + i);
        assert!(
            peers.contains(&addr),
            "no NFS connection from {addr}: {peers:?}"
        );
    }
    // Then each reads every other's file (close-to-open: each open asks the server).
    let all: String = (1..=CLONES).map(|i| format!("clone-{i}\n")).collect();
    let names: String = (1..=CLONES)
        .map(|i| format!(" /mnt/nfs/clone-{i}"))
        .collect();
    for out in run_in_all(&clones, |_| format!("cat{names}")) {
        assert_eq!(out, all);
    }
    let mut expected: Vec<(String, String)> = (1..=CLONES)
        .map(|i| (format!("clone-{i}"), format!("clone-{i}\n")))
        .collect();
    expected.push(("template".into(), "template\n".into()));
    expected.sort();
    assert_eq!(export_files(&export), expected);

    // A clone killed in the middle of a long write: the others and the server go on.
    let victim = &clones[CLONES - 1];
    run(
        &sock(victim),
        "dd if=/dev/zero of=/mnt/nfs/big bs=64k count=100000 >/dev/null 2>&1 & echo started",
    );
    let start = Instant::now();
    while std::fs::metadata(export.join("big"))
        .map(|m| m.len())
        .unwrap_or(0)
        == 0
    {
        assert!(
            start.elapsed() < Duration::from_secs(120),
            "the write never reached the server"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // SAFETY: kill(2) on a clone's VMM process this test's template made.
    unsafe { libc::kill(victim["pid"].as_i64().unwrap() as i32, libc::SIGKILL) };
    let out = run(
        &sock(&clones[0]),
        "echo after > /mnt/nfs/after-kill && sync && cat /mnt/nfs/clone-2",
    );
    assert_eq!(out, "clone-2\n");
    assert_eq!(
        std::fs::read_to_string(export.join("after-kill")).unwrap(),
        "after\n"
    );
    for i in 1..CLONES {
        assert_eq!(
            std::fs::read_to_string(export.join(format!("clone-{i}"))).unwrap(),
            format!("clone-{i}\n")
        );
    }

    // The server restarts under running clones: an operation on the hard mount waits
    // and completes once it is back; one on the soft mount fails with EIO meanwhile.
    server.stop();
    let (hard, soft) = std::thread::scope(|s| {
        let hard = s.spawn(|| run(&sock(&clones[1]), "cat /mnt/nfs/clone-3"));
        let soft = run(
            &sock(&clones[2]),
            "cat /mnt/soft/clone-4 2>&1; echo status=$?",
        );
        // The hard one is still waiting (the soft one took its timeouts meanwhile).
        std::thread::sleep(Duration::from_secs(2));
        assert!(
            !hard.is_finished(),
            "a hard mount answered without its server"
        );
        server.start_again();
        (hard.join().unwrap(), soft)
    });
    assert_eq!(hard, "clone-3\n");
    assert!(
        soft.contains("Input/output error") && soft.ends_with("status=1\n"),
        "the soft mount did not fail clearly: {soft}"
    );
    // After the restart the soft mount works again too.
    assert_eq!(run(&sock(&clones[2]), "cat /mnt/soft/clone-4"), "clone-4\n");

    // A clone's NFS traffic passes its own card's limiter: one made with a limit writes
    // through the mount no faster than it allows, and the clones made without one have
    // no limiter at all.
    assert!(tests::net_limiter(&sock(&clones[0]), "tx").is_none());
    let body = serde_json::json!({
        "count": 1, "console": "null",
        "addresses": [{"ipv4": "10.79.0.30/24"}],
        "rate_limits": {"net": format!("bytes={LIMIT_BUCKET}/1000")},
    });
    let (code, answer) = vm.api("POST", "/clones", Some(&body.to_string()));
    assert_eq!(code, 201, "{answer}");
    let limited = serde_json::from_str::<Value>(&answer).unwrap()["clones"][0].clone();
    let own = limited["net"]["tap"].as_str().unwrap();
    tests::wait_link(own);
    attach(own);
    assert_eq!(run(&sock(&limited), "cat /mnt/nfs/clone-1"), "clone-1\n");
    let counter = |l: &Value, k: &str| l[k].as_u64().unwrap();
    // The span runs from before the first reading of the counters to after the second.
    let t0 = Instant::now();
    let before = tests::net_limiter(&sock(&limited), "tx").expect("a tx limiter");
    run(
        &sock(&limited),
        &format!(
            "dd if=/dev/zero of=/mnt/nfs/limited bs=16k count={} conv=fsync 2>/dev/null",
            LIMITED_WRITE / 16384
        ),
    );
    let after = tests::net_limiter(&sock(&limited), "tx").expect("a tx limiter");
    let secs = t0.elapsed().as_secs_f64();
    let passed = counter(&after, "passed_bytes") - counter(&before, "passed_bytes");
    let held = counter(&after, "throttled") - counter(&before, "throttled");
    eprintln!(
        "linux_nfs: the limited clone wrote {LIMITED_WRITE} B in {secs:.1} s; its tx limiter \
         passed {passed} B ({:.0} B/s) and held {held} frames back",
        passed as f64 / secs
    );
    assert_eq!(
        std::fs::metadata(export.join("limited")).unwrap().len(),
        LIMITED_WRITE
    );
    assert!(
        passed >= LIMITED_WRITE,
        "the write bypassed the limiter: {passed} B"
    );
    // A token bucket passes at most its rate over the span plus what it held at the start.
    let ceiling = LIMIT_BUCKET as f64 * (secs + 1.0);
    assert!(
        passed as f64 <= ceiling,
        "{passed} B passed in {secs:.1} s, above {LIMIT_BUCKET} B/s and a full bucket"
    );
    assert!(held > 0, "the limiter never held a frame back");
    assert!(tests::net_limiter(&sock(&clones[0]), "tx").is_none());

    for c in clones[..CLONES - 1].iter().chain([&limited]) {
        vm.api(
            "DELETE",
            &format!("/clones/{}", c["id"].as_str().unwrap()),
            None,
        );
    }
    vm.shutdown(Duration::from_secs(60));
    drop(server);
}

/// Invocations: a template whose C runtime waits mounted the export; each invocation's
/// clone, given a tap on the bridge and an address (`tap`, `ipv4`, `gateway`), takes
/// its address in the runtime before the handler runs and uses the mount as itself.
#[test]
fn linux_invocation_clones_given_an_address_use_the_nfs_export_as_themselves() {
    if !tests::kvm_and_root_available("linux_nfs_invocations") {
        return;
    }
    const INVOCATIONS: usize = 3;
    let scratch = Scratch::new("linux-nfs-inv");
    let pid = std::process::id();
    let ns = Netns::new(&format!("fkvm-test-{pid}-nfsinv"));
    ns.add_bridge(&format!("{SERVER}/24"), "02:00:0a:4f:00:01");
    let export = scratch.path("export");
    let server = NfsServer::start(&ns, &export, &scratch.path("server"));

    // The VMM runs in the namespace (as a platform's would), so the taps it creates and
    // the taps handed to its clones are the namespace's, on its bridge.
    let opts = mount_options();
    let src = format!("{SERVER}:{}", server.export().display());
    let script = format!(
        "forkvm-clone --net; until ping -c1 -W1 {SERVER} >/dev/null 2>&1; do sleep 1; done; \
         mkdir -p /mnt/nfs && mount -t nfs -o {opts},hard {src} /mnt/nfs && \
         echo template > /mnt/nfs/template && sync && exec forkvm-fn info"
    );
    let cmdline = format!("console=ttyS0 reboot=k panic=-1 quiet forkvm.run=\"{script}\"");
    let tap = "fknt";
    let args = template_args(tap, &cmdline, &["--template"]);
    let mut vm = Vm::start_at(
        &scratch,
        &scratch.path("api.sock"),
        &scratch.path("console"),
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
        |cmd| ns.enter_on_exec(cmd),
    );
    wait_until("the template's tap", Duration::from_secs(30), || {
        ns.has_link(tap)
    });
    ns.bridge_port(tap);
    vm.wait_api(LINUX_BOOT);
    let start = Instant::now();
    while !vm.waits_as_template() {
        assert!(
            start.elapsed() < LINUX_BOOT && matches!(vm.child.try_wait(), Ok(None)),
            "the template's runtime did not wait\n--- console:\n{}\n--- log:\n{}",
            vm.console_text(),
            vm.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        std::fs::read_to_string(export.join("template")).unwrap(),
        "template\n"
    );

    // Each invocation gets a tap made on the bridge beforehand and its own address; the
    // handler reads the template's file, writes its own and shows its address. Kept
    // alive, so the server's connections from them can be seen.
    let taps: Vec<String> = (1..=INVOCATIONS).map(|i| format!("fkni{i}")).collect();
    taps.iter().for_each(|t| ns.add_tap_on_bridge(t));
    let replies: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (1..=INVOCATIONS)
            .map(|i| {
                let (sock, tap) = (&vm.sock, &taps[i - 1]);
                s.spawn(move || {
                    let options = InvokeOptions {
                        tap: Some(tap.clone()),
                        ipv4: Some(format!("10.79.0.{}/24", 30 + i).parse().unwrap()),
                        gateway: Some(SERVER.parse().unwrap()),
                        keep_alive: true,
                        timeout_ms: Some(300_000),
                        ..InvokeOptions::default()
                    };
                    let payload = format!(
                        "sh cat /mnt/nfs/template && echo inv-{i} > /mnt/nfs/inv-{i} && sync && \
                         ip -4 -o addr show eth0"
                    );
                    client::invoke(sock, &options, payload.as_bytes()).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (i, r) in (1..=INVOCATIONS).zip(&replies) {
        assert_eq!(r.status, 200, "invocation {i}: {}", r.body);
        assert!(r.body.starts_with("template\n"), "{}", r.body);
        let own = format!("inet 10.79.0.{}/24", 30 + i);
        assert!(
            r.body.contains(&own) && !r.body.contains("10.79.0.2/"),
            "invocation {i} did not take its address: {}",
            r.body
        );
        assert_eq!(
            std::fs::read_to_string(export.join(format!("inv-{i}"))).unwrap(),
            format!("inv-{i}\n")
        );
    }
    let peers: BTreeSet<String> = server.clients().into_iter().collect();
    for i in 1..=INVOCATIONS {
        let addr = format!("10.79.0.{}", 30 + i);
        assert!(
            peers.contains(&addr),
            "no NFS connection from {addr}: {peers:?}"
        );
    }

    // A kept clone serves in place: it has its identity, and refuses another (409).
    let kept = PathBuf::from(replies[0].header("x-forkvm-socket").unwrap());
    let again = InvokeOptions {
        ipv4: Some("10.79.0.40/24".parse().unwrap()),
        ..InvokeOptions::default()
    };
    let r = client::invoke(&kept, &again, b"x").unwrap();
    assert_eq!(r.status, 409, "{}", r.body);
    assert!(r.body.contains("no template"), "{}", r.body);

    for r in &replies {
        let id = r.header("x-forkvm-clone-id").unwrap();
        assert_eq!(vm.api("DELETE", &format!("/clones/{id}"), None).0, 200);
    }
    vm.shutdown(Duration::from_secs(60));
    drop(server);
}
