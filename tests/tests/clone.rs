//! Flash cloning with the tiny guest: clones keep running with every vCPU, timers and
//! serial intact; clones of clones; stopping; cleanup; bad requests; no leaks.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use serde_json::Value;
use tests::{
    api_request, children_of, count_dir, fd_targets, fds_of, guest_file, kvm_available, tiny_vm,
    Scratch, Vm,
};

const BOOT: Duration = Duration::from_secs(30);

fn post_clones(sock: &Path, count: u64) -> Vec<Value> {
    let (code, body) = api_request(
        sock,
        "POST",
        "/clones",
        Some(&format!(r#"{{"count":{count}}}"#)),
    );
    assert_eq!(code, 201, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let clones = v["clones"].as_array().unwrap().clone();
    assert_eq!(clones.len() as u64, count, "{body}");
    for c in &clones {
        assert_eq!(c["status"]["state"], "running", "{c}");
        assert!(c["latency_us"].as_u64().unwrap() > 0, "{c}");
        assert!(c["pid"].as_i64().unwrap() > 0);
    }
    clones
}

fn read(path: &str) -> String {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .replace("\r\n", "\n")
}

/// Waits until `path` contains every needle.
fn wait_file(path: &str, needles: &[String], timeout: Duration) -> String {
    let start = Instant::now();
    loop {
        let text = read(path);
        if needles.iter().all(|n| text.contains(n.as_str())) {
            return text;
        }
        assert!(
            start.elapsed() < timeout,
            "{path} never showed {needles:?}:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn last_beat(console: &str, cpu: u32) -> u64 {
    let prefix = format!("tiny: cpu {cpu} beat ");
    console
        .lines()
        .filter_map(|l| l.strip_prefix(&prefix))
        .filter_map(|n| n.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

fn alive(pid: i64) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
        && !std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .unwrap_or_default()
            .rsplit(')')
            .next()
            .unwrap_or("")
            .trim_start()
            .starts_with('Z')
}

#[test]
fn busy_4_vcpu_guest_clones_keep_every_vcpu_timer_and_serial_running() {
    if !kvm_available("busy_4_vcpu_clones") {
        return;
    }
    let scratch = Scratch::new("clone-busy");
    let mut vm = tiny_vm(&scratch, "64", "4", "ticks=2 beat=20 busy=1");
    let needles: Vec<String> = (0..4).map(|c| format!("tiny: cpu {c} beat 2\n")).collect();
    vm.wait_console(&needles[3], BOOT);
    let parent_console = vm.console.display().to_string();
    wait_file(&parent_console, &needles, BOOT);

    let clones = post_clones(&vm.sock, 2);
    for c in &clones {
        let console = c["console"].as_str().unwrap().to_string();
        // A clone's console holds only what the clone printed after the clone point.
        let first = wait_file(&console, &["tiny: cpu".to_string()], BOOT);
        assert!(
            !first.contains("tiny: all 4 cpus ok"),
            "clone console has parent output: {first}"
        );
        // Every vCPU of the clone keeps taking timer interrupts and printing: each
        // reaches a beat well past where the parent was at the clone point.
        let parent_now = read(&parent_console);
        let want: Vec<String> = (0..4)
            .map(|cpu| format!("tiny: cpu {cpu} beat {}\n", last_beat(&parent_now, cpu) + 3))
            .collect();
        wait_file(&console, &want, BOOT);
        assert!(!read(&console).contains("unexpected"), "{}", read(&console));
        // The clone answers on its own socket, as a clone.
        let (code, body) = api_request(
            Path::new(c["api_sock"].as_str().unwrap()),
            "GET",
            "/vm",
            None,
        );
        assert_eq!(code, 200);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["clone_id"], c["id"]);
        assert_eq!(v["state"], "running");
        assert_eq!(v["vcpus"], 4);
    }
    // The parent keeps running too.
    let parent_now = read(&parent_console);
    let want: Vec<String> = (0..4)
        .map(|cpu| format!("tiny: cpu {cpu} beat {}\n", last_beat(&parent_now, cpu) + 2))
        .collect();
    wait_file(&parent_console, &want, BOOT);
    vm.shutdown(BOOT);
    for c in &clones {
        let pid = c["pid"].as_i64().unwrap();
        assert!(!alive(pid), "clone {pid} outlived its parent's shutdown");
        assert!(!Path::new(c["api_sock"].as_str().unwrap()).exists());
    }
}

#[test]
fn clone_of_a_clone_list_and_delete() {
    if !kvm_available("clone_of_clone") {
        return;
    }
    let scratch = Scratch::new("clone-tree");
    let mut vm = tiny_vm(&scratch, "64", "2", "ticks=2 beat=10");
    vm.wait_console("tiny: beat 2\n", BOOT);
    let first = post_clones(&vm.sock, 1).remove(0);
    assert_eq!(first["id"], "1");
    let first_sock = PathBuf::from(first["api_sock"].as_str().unwrap());
    let grandchild = post_clones(&first_sock, 1).remove(0);
    assert_eq!(grandchild["id"], "1.1");
    let gc_console = grandchild["console"].as_str().unwrap().to_string();
    // Clone 1's console starts wherever the clone point fell, possibly mid-line: wait
    // for a whole beat line in it (the grandchild was made before that line's beat
    // or during it, so it prints the third beat after it).
    let first_console = first["console"].as_str().unwrap().to_string();
    let start = Instant::now();
    let beat = loop {
        match last_beat_plain(&read(&first_console)) {
            0 => {
                assert!(start.elapsed() < BOOT, "clone 1 never printed a whole beat");
                std::thread::sleep(Duration::from_millis(10));
            }
            b => break b,
        }
    };
    wait_file(&gc_console, &[format!("tiny: beat {}\n", beat + 3)], BOOT);

    let (code, body) = vm.api("GET", "/clones", None);
    assert_eq!(code, 200);
    let list: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        list["clones"].as_array().unwrap().len(),
        1,
        "only direct clones: {body}"
    );
    // Every VM of the tree logs to the template's stderr; a clone's lines carry its id.
    let log = vm.stderr_text();
    for (id, clone) in [("1", &first), ("1.1", &grandchild)] {
        let started = format!("clone {id} (pid {}) running", clone["pid"]);
        let line = log.lines().find(|l| l.contains(&started));
        let line = line.unwrap_or_else(|| panic!("no {started:?} in\n{log}"));
        assert!(line.starts_with(&format!("[clone {id}] ")), "{line}");
    }
    let template = log.lines().find(|l| l.contains("VM started in")).unwrap();
    assert!(
        template.starts_with(|c: char| c.is_ascii_digit()),
        "{template}"
    );

    // Deleting clone 1 stops it; its own clone dies with it (PR_SET_PDEATHSIG).
    let (code, body) = vm.api("DELETE", "/clones/1", None);
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["status"]["state"], "exited", "{body}");
    assert_eq!(v["status"]["code"], 143, "{body}");
    assert!(!first_sock.exists());
    let gc_pid = grandchild["pid"].as_i64().unwrap();
    let start = Instant::now();
    while alive(gc_pid) {
        assert!(start.elapsed() < BOOT, "grandchild outlived its parent");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(vm.api("DELETE", "/clones/1", None).0, 404);
    assert_eq!(vm.api("DELETE", "/clones/7", None).0, 404);

    // A clone that does not stop (stopped itself: SIGTERM waits) does not hold up its
    // parent: its deletion is answered once SIGKILL ended it, seconds later, and the
    // parent serves meanwhile.
    let stuck = post_clones(&vm.sock, 1).remove(0);
    let pid = stuck["pid"].as_i64().unwrap();
    // SAFETY: signals the clone this test made, which still runs.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGSTOP) }, 0);
    let sock = vm.sock.clone();
    let path = format!("/clones/{}", stuck["id"].as_str().unwrap());
    let deletion = std::thread::spawn(move || api_request(&sock, "DELETE", &path, None));
    std::thread::sleep(Duration::from_millis(200));
    for _ in 0..5 {
        assert_eq!(vm.api("GET", "/vm", None).0, 200);
        assert_eq!(vm.api("GET", "/clones", None).0, 200);
    }
    assert!(
        !deletion.is_finished(),
        "the stopped clone was deleted at once"
    );
    let (code, body) = deletion.join().unwrap();
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(
        v["status"],
        serde_json::json!({"state": "killed", "code": 9}),
        "{body}"
    );
    assert!(!alive(pid));
    vm.shutdown(BOOT);
}

#[test]
fn a_tree_of_clones_stays_within_max_tree_clones() {
    // --max-clones bounds each VM's own clones; --max-tree-clones the whole tree's, so
    // clones that each make clones cannot grow it without end.
    if !kvm_available("clone_tree_limit") {
        return;
    }
    let scratch = Scratch::new("clone-tree-max");
    let extra = ["--max-tree-clones", "3"];
    let mut vm = tests::tiny_vm_with(&scratch, "64", "1", "ticks=1 beat=10", &extra);
    vm.wait_console("tiny: beat 1\n", BOOT);
    let sock_of = |c: &Value| PathBuf::from(c["api_sock"].as_str().unwrap());
    let two = post_clones(&vm.sock, 2);
    let (one, two) = (sock_of(&two[0]), &two[1]);
    let one_one = post_clones(&one, 1).remove(0);
    // Three live clones: no VM of the tree may make a fourth.
    let refused = |sock: &Path| {
        let (code, body) = api_request(sock, "POST", "/clones", Some(r#"{"count":1}"#));
        assert_eq!(code, 409, "{body}");
        assert!(
            body.contains("at most 3 may be (--max-tree-clones)"),
            "{body}"
        );
    };
    for sock in [&vm.sock, &one, &sock_of(two), &sock_of(&one_one)] {
        refused(sock);
    }
    let taken = |sock: &Path| {
        let (code, body) = api_request(sock, "GET", "/vm", None);
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["clone_tree"]["max"], 3, "{body}");
        v["clone_tree"]["taken"].as_u64().unwrap()
    };
    assert_eq!(taken(&vm.sock), 3);
    // A clone its parent stopped gives its slot back, and every VM sees it.
    let (code, body) = api_request(&one, "DELETE", "/clones/1.1", None);
    assert_eq!(code, 200, "{body}");
    assert_eq!((taken(&vm.sock), taken(&sock_of(two))), (2, 2));
    let two_one = post_clones(&sock_of(two), 1).remove(0);
    refused(&vm.sock);
    // A clone whose parent was killed dies with it, and nobody of the tree reaps it:
    // its slot is freed once a VM finds the tree full and its process gone.
    let pid = |c: &Value| c["pid"].as_i64().unwrap();
    // SAFETY: signals a clone process this test made.
    unsafe { libc::kill(pid(two) as i32, libc::SIGKILL) };
    let start = Instant::now();
    // Clone 2 is the template's to reap; 2.1 is gone once init reaped it.
    let gone = |c: &Value| !Path::new(&format!("/proc/{}", pid(c))).exists();
    while !gone(&two_one) || alive(pid(two)) {
        assert!(start.elapsed() < BOOT, "clone 2.1 outlived its parent");
        std::thread::sleep(Duration::from_millis(10));
    }
    // The template reaps clone 2 and frees its slot; 2.1's stays taken until needed.
    while taken(&vm.sock) != 2 {
        assert!(start.elapsed() < BOOT, "clone 2's slot was never freed");
        std::thread::sleep(Duration::from_millis(10));
    }
    let two_more = post_clones(&vm.sock, 2);
    assert_eq!(two_more[0]["id"], "3", "{two_more:?}");
    refused(&one);
    vm.shutdown(BOOT);
}

fn last_beat_plain(console: &str) -> u64 {
    console
        .lines()
        .filter_map(|l| l.strip_prefix("tiny: beat "))
        .filter_map(|n| n.trim().parse().ok())
        .max()
        .unwrap_or(0)
}

#[test]
fn paused_template_clones_and_stays_paused() {
    if !kvm_available("paused_template") {
        return;
    }
    let scratch = Scratch::new("clone-template");
    let mut vm = tiny_vm(&scratch, "64", "1", "ticks=2 beat=10");
    vm.wait_console("tiny: beat 2\n", BOOT);
    assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    let before = last_beat_plain(&vm.console_text());
    let c = post_clones(&vm.sock, 3);
    for clone in &c {
        wait_file(
            clone["console"].as_str().unwrap(),
            &[format!("tiny: beat {}\n", before + 2)],
            BOOT,
        );
    }
    std::thread::sleep(Duration::from_millis(200));
    assert_eq!(
        last_beat_plain(&vm.console_text()),
        before,
        "template ran while paused"
    );
    let (_, body) = vm.api("GET", "/vm", None);
    assert!(body.contains(r#""state":"paused""#), "{body}");
    vm.shutdown(BOOT);
}

fn warm_report(vm: &mut Vm) -> Value {
    let (_, body) = vm.api("GET", "/vm", None);
    serde_json::from_str::<Value>(&body).unwrap()["warm_clones"].clone()
}

fn wait_warm_ready(vm: &mut Vm, ready: u64) {
    let start = Instant::now();
    while warm_report(vm)["ready"] != ready {
        assert!(
            start.elapsed() < BOOT,
            "warm clones never ready: {}",
            warm_report(vm)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn warm_clones_of_a_paused_template_launch_refill_and_are_discarded_on_resume() {
    if !kvm_available("warm_clones") {
        return;
    }
    let scratch = Scratch::new("clone-warm");
    let warm = ["--warm-clones", "3"];
    let mut vm = tests::tiny_vm_with(&scratch, "64", "2", "ticks=2 beat=10", &warm);
    vm.wait_console("tiny: beat 2\n", BOOT);
    let parent_pid = vm.child.id();
    // Running: no warm clones.
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(warm_report(&mut vm)["ready"], 0);
    assert!(children_of(parent_pid).is_empty());

    assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    let before = last_beat_plain(&vm.console_text());
    wait_warm_ready(&mut vm, 3);
    assert_eq!(children_of(parent_pid).len(), 3);
    // Two launched from the pool, then five: three warm and two forked on request.
    let mut clones = post_clones(&vm.sock, 2);
    assert_eq!(warm_report(&mut vm)["launched"], 2);
    wait_warm_ready(&mut vm, 3);
    clones.extend(post_clones(&vm.sock, 5));
    assert_eq!(warm_report(&mut vm)["launched"], 5);
    for c in &clones {
        // Each runs on from the pause point with working timers, as itself.
        wait_file(
            c["console"].as_str().unwrap(),
            &[format!("tiny: beat {}\n", before + 3)],
            BOOT,
        );
        let (code, body) = api_request(
            Path::new(c["api_sock"].as_str().unwrap()),
            "GET",
            "/vm",
            None,
        );
        assert_eq!(code, 200);
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["clone_id"], c["id"], "{body}");
        assert_eq!(v["vcpus"], 2);
    }
    let ids: Vec<&str> = clones.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["1", "2", "3", "4", "5", "6", "7"]);
    assert_eq!(
        last_beat_plain(&vm.console_text()),
        before,
        "template ran while paused"
    );

    // Resuming discards the pool: only the seven clones remain as children.
    wait_warm_ready(&mut vm, 3);
    assert_eq!(
        vm.api("PATCH", "/vm", Some(r#"{"state":"running"}"#)).0,
        204
    );
    let report = warm_report(&mut vm);
    assert_eq!(report["ready"], 0, "{report}");
    assert_eq!(report["discarded"], 3, "{report}");
    // Killed, not waited for: gone once reaped.
    tests::wait_until("the discarded warm clones reaped", BOOT, || {
        children_of(parent_pid).len() == 7
    });
    vm.wait_console(&format!("tiny: beat {}\n", before + 2), BOOT);
    vm.shutdown(BOOT);
    for c in &clones {
        assert!(!alive(c["pid"].as_i64().unwrap()));
    }
}

#[test]
fn bad_clone_requests_are_refused_and_the_parent_keeps_running() {
    if !kvm_available("bad_clone_requests") {
        return;
    }
    let scratch = Scratch::new("clone-bad");
    let mut vm = tiny_vm(&scratch, "64", "1", "ticks=1 beat=10");
    vm.wait_console("tiny: beat 1\n", BOOT);
    let cases: &[(&str, u16, &str)] = &[
        (r#"{"count":0}"#, 400, "1 to 1000"),
        (r#"{"count":1001}"#, 400, "1 to 1000"),
        (r#"{"count":18446744073709551615}"#, 400, "1 to 1000"),
        (r#"{"count":-1}"#, 400, "invalid JSON"),
        (r#"{"count":"2"}"#, 400, "invalid JSON"),
        (r#"{"count":2"#, 400, "invalid JSON"),
        (r#"{"cuont":2}"#, 400, "invalid JSON"),
    ];
    for (body, want, text) in cases {
        let (code, answer) = vm.api("POST", "/clones", Some(body));
        assert_eq!(code, *want, "{body}: {answer}");
        assert!(answer.contains(text), "{body}: {answer}");
    }
    let (_, list) = vm.api("GET", "/clones", None);
    assert_eq!(list, r#"{"clones":[]}"#);
    let now = last_beat_plain(&vm.console_text());
    vm.wait_console(&format!("tiny: beat {}\n", now + 2), BOOT);
    vm.shutdown(BOOT);
}

#[test]
fn a_vm_with_virtio_devices_clones_and_both_keep_running() {
    // The tiny guest does not drive virtio (the Linux tests do): its devices are cloned
    // before the driver set them up, and clones of it run. The device round trip itself
    // is covered by the devices crate's transport tests.
    if !kvm_available("clone_with_virtio") {
        return;
    }
    let scratch = Scratch::new("clone-virtio");
    let tiny = guest_file("tiny.elf").display().to_string();
    let disk = guest_file("rootfs.ext4").display().to_string();
    let mut vm = Vm::start(
        &scratch,
        &[
            "--kernel",
            &tiny,
            "--mem-mib",
            "64",
            "--rootfs",
            &disk,
            "--rng-rate-limit",
            "bytes=64K",
            "--cmdline",
            "ticks=1 beat=10",
        ],
    );
    vm.wait_console("tiny: beat 1\n", BOOT);
    let (_, status) = vm.api("GET", "/vm", None);
    let parent: Value = serde_json::from_str(&status).unwrap();
    let devices = parent["devices"].clone();
    assert_eq!(devices[0]["type"], "virtio-blk", "{status}");
    assert_eq!(devices[1]["type"], "virtio-rng", "{status}");
    assert_eq!(
        devices[1]["rate_limit"]["bandwidth"]["size"], 65536,
        "{status}"
    );
    let (code, answer) = vm.api("POST", "/clones", Some(r#"{"count":2}"#));
    assert_eq!(code, 201, "{answer}");
    let v: Value = serde_json::from_str(&answer).unwrap();
    for c in v["clones"].as_array().unwrap() {
        assert_eq!(c["status"]["state"], "running", "{c}");
        // The clone has the same devices, in the same places.
        let (code, status) = api_request(
            Path::new(c["api_sock"].as_str().unwrap()),
            "GET",
            "/vm",
            None,
        );
        assert_eq!(code, 200);
        let clone: Value = serde_json::from_str(&status).unwrap();
        assert_eq!(clone["devices"], devices, "{status}");
        let console = c["console"].as_str().unwrap().to_string();
        let start = std::time::Instant::now();
        while last_beat_plain(&std::fs::read_to_string(&console).unwrap_or_default()) < 2 {
            assert!(start.elapsed() < BOOT, "clone {} stopped: {c}", c["id"]);
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
    // Per-clone rate limits replace the template's for that clone only; one for a
    // device the VM lacks is refused.
    let (code, answer) = vm.api(
        "POST",
        "/clones",
        Some(r#"{"rate_limits":{"rng":"bytes=8K","disk":"ops=100"}}"#),
    );
    assert_eq!(code, 201, "{answer}");
    let v: Value = serde_json::from_str(&answer).unwrap();
    let sock = v["clones"][0]["api_sock"].as_str().unwrap().to_string();
    let (_, status) = api_request(Path::new(&sock), "GET", "/vm", None);
    let clone: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(
        clone["devices"][1]["rate_limit"]["bandwidth"]["size"], 8192,
        "{status}"
    );
    assert_eq!(
        clone["devices"][0]["rate_limit"]["ops"]["size"], 100,
        "{status}"
    );
    // Each limited device reports its limiter's counters: nothing passed yet (the tiny
    // guest drives no virtio).
    for d in 0..2 {
        let limiters = &clone["devices"][d]["rate_limiters"];
        assert_eq!(limiters[0]["name"], "requests", "{status}");
        assert_eq!(limiters[0]["passed_bytes"], 0, "{status}");
    }
    let (_, status) = vm.api("GET", "/vm", None);
    let parent: Value = serde_json::from_str(&status).unwrap();
    assert_eq!(parent["devices"], devices, "the template's limits stay");
    let (code, answer) = vm.api(
        "POST",
        "/clones",
        Some(r#"{"rate_limits":{"net":"bytes=1K"}}"#),
    );
    assert_eq!(code, 409, "{answer}");
    assert!(answer.contains("network card"), "{answer}");
    let now = last_beat_plain(&vm.console_text());
    vm.wait_console(&format!("tiny: beat {}\n", now + 2), BOOT);
    vm.shutdown(BOOT);
}

#[test]
fn two_hundred_clone_and_stop_cycles_leak_nothing() {
    if !kvm_available("clone_cycles_leak") {
        return;
    }
    let scratch = Scratch::new("clone-leak");
    let mut vm = tiny_vm(&scratch, "64", "1", "ticks=1 beat=50");
    vm.wait_console("tiny: beat 1\n", BOOT);
    let pid = vm.child.id();
    // One cycle first, so lazily created state (capture spec, ...) exists before counting.
    let c = post_clones(&vm.sock, 1).remove(0);
    assert_eq!(
        vm.api(
            "DELETE",
            &format!("/clones/{}", c["id"].as_str().unwrap()),
            None
        )
        .0,
        200
    );
    let fds = tests::fds_at_rest(pid);
    let threads = count_dir(format!("/proc/{pid}/task"));
    for _ in 0..200 {
        let c = post_clones(&vm.sock, 1).remove(0);
        let (code, body) = vm.api(
            "DELETE",
            &format!("/clones/{}", c["id"].as_str().unwrap()),
            None,
        );
        assert_eq!(code, 200, "{body}");
        assert!(!Path::new(c["api_sock"].as_str().unwrap()).exists());
        let _ = std::fs::remove_file(c["console"].as_str().unwrap());
    }
    assert_eq!(fds_of(pid, fds), fds, "fds leaked:\n{}", fd_targets(pid));
    assert_eq!(
        count_dir(format!("/proc/{pid}/task")),
        threads,
        "threads leaked"
    );
    assert!(
        children_of(pid).is_empty(),
        "children left: {:?}",
        children_of(pid)
    );
    let (_, body) = vm.api("GET", "/clones", None);
    let v: Value = serde_json::from_str(&body).unwrap();
    let list = v["clones"].as_array().unwrap();
    assert_eq!(list.len(), 201);
    assert!(
        list.iter().all(|c| c["status"]["state"] == "exited"),
        "{body}"
    );
    vm.shutdown(BOOT);
}

#[test]
fn guest_requested_clones_get_fork_like_results_and_isolated_memory() {
    if !kvm_available("guest_clone_isolation") {
        return;
    }
    let scratch = Scratch::new("clone-guest");
    // The guest fills 2 MiB with a pattern, asks for 3 clones through the clone port,
    // and every side checks the inherited pattern, writes its own, waits two beats (so
    // the others have written theirs) and verifies it. Clones then report done with
    // their number as exit status.
    let mut vm = tiny_vm(&scratch, "64", "1", "ticks=2 beat=20 clonetest=3 done=1");
    let slow = Duration::from_secs(120); // 2 MiB loops at CPL 0 run in the emulator here
    let parent = vm.wait_console_line("tiny: own pattern, clone 0", slow);
    assert!(parent.contains("tiny: clone 0\n"), "{parent}");
    assert!(
        parent.contains("tiny: inherited pattern, clone 0 ok\n"),
        "{parent}"
    );
    assert!(
        parent.contains("tiny: own pattern, clone 0 ok\n"),
        "{parent}"
    );
    let start = Instant::now();
    let clones = loop {
        let (_, body) = vm.api("GET", "/clones", None);
        let v: Value = serde_json::from_str(&body).unwrap();
        let list = v["clones"].as_array().unwrap().clone();
        if list.len() == 3 && list.iter().all(|c| c["status"]["state"] == "exited") {
            break list;
        }
        assert!(start.elapsed() < slow, "clones did not finish: {body}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut seen = Vec::new();
    for c in &clones {
        let k: u64 = c["id"].as_str().unwrap().parse().unwrap();
        let console = read(c["console"].as_str().unwrap());
        assert!(console.contains(&format!("tiny: clone {k}\n")), "{console}");
        assert!(
            console.contains(&format!("tiny: inherited pattern, clone {k} ok\n")),
            "{console}"
        );
        assert!(
            console.contains(&format!("tiny: own pattern, clone {k} ok\n")),
            "{console}"
        );
        assert_eq!(
            c["status"]["code"].as_u64(),
            Some(k),
            "done status of clone {k}: {c}"
        );
        seen.push(k);
    }
    seen.sort();
    assert_eq!(seen, vec![1, 2, 3]);
    // The parent goes on after its clones are gone.
    let beat = last_beat_plain(&vm.console_text());
    vm.wait_console(&format!("tiny: beat {}\n", beat + 2), BOOT);
    vm.shutdown(BOOT);
}

#[test]
fn guest_request_for_too_many_clones_fails_cleanly() {
    if !kvm_available("guest_clone_too_many") {
        return;
    }
    let scratch = Scratch::new("clone-guest-bad");
    let mut vm = tiny_vm(&scratch, "64", "1", "ticks=1 beat=10 clonetest=5000");
    let text = vm.wait_console("tiny: clone failed\n", Duration::from_secs(120));
    assert!(!text.contains("tiny: clone 0"), "{text}");
    vm.wait_console("tiny: beat 2\n", BOOT);
    let (_, list) = vm.api("GET", "/clones", None);
    assert_eq!(list, r#"{"clones":[]}"#);
    assert!(
        vm.stderr_text()
            .contains("clone count must be 1 to 1000, not 5000"),
        "{}",
        vm.stderr_text()
    );
    vm.shutdown(BOOT);
}

#[test]
fn a_guest_request_beyond_the_tree_limit_fails_cleanly() {
    if !kvm_available("guest_clone_tree_limit") {
        return;
    }
    let scratch = Scratch::new("clone-guest-tree");
    let extra = ["--max-tree-clones", "3"];
    let mut vm = tests::tiny_vm_with(&scratch, "64", "1", "ticks=1 beat=10 clonetest=4", &extra);
    let text = vm.wait_console("tiny: clone failed\n", Duration::from_secs(120));
    assert!(!text.contains("tiny: clone 0"), "{text}");
    vm.wait_console("tiny: beat 2\n", BOOT);
    let (_, list) = vm.api("GET", "/clones", None);
    assert_eq!(list, r#"{"clones":[]}"#);
    let log = vm.stderr_text();
    assert!(
        log.contains("at most 3 may be (--max-tree-clones)"),
        "{log}"
    );
    assert_eq!(vm.describe()["clone_tree"]["taken"], 0);
    vm.shutdown(BOOT);
}

#[test]
fn a_thousand_clones_from_one_template() {
    if !kvm_available("thousand_clones") {
        return;
    }
    let scratch = Scratch::new("clone-1000");
    let mut vm = tiny_vm(&scratch, "64", "1", "ticks=1 tickless=1");
    vm.wait_console("tiny: tickless\n", BOOT);
    let clones = post_clones(&vm.sock, 1000);
    let mut pids: Vec<i64> = clones.iter().map(|c| c["pid"].as_i64().unwrap()).collect();
    pids.sort();
    pids.dedup();
    assert_eq!(pids.len(), 1000, "every clone is its own process");
    for i in [0usize, 499, 999] {
        let c = &clones[i];
        let (code, body) = api_request(
            Path::new(c["api_sock"].as_str().unwrap()),
            "GET",
            "/vm",
            None,
        );
        assert_eq!(code, 200, "{body}");
        let v: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["clone_id"], c["id"]);
        assert_eq!(v["state"], "running");
    }
    // The template shuts down its clones first; nothing is left running.
    vm.shutdown(Duration::from_secs(120));
    let alive_now: Vec<i64> = pids.iter().copied().filter(|p| alive(*p)).collect();
    assert!(
        alive_now.is_empty(),
        "clones left running: {:?}",
        &alive_now[..alive_now.len().min(5)]
    );
    for c in &clones {
        assert!(!Path::new(c["api_sock"].as_str().unwrap()).exists());
    }
}

#[test]
fn clones_die_with_a_sigkilled_parent() {
    if !kvm_available("clones_die_with_parent") {
        return;
    }
    let scratch = Scratch::new("clone-sigkill");
    let mut vm = tiny_vm(&scratch, "64", "1", "ticks=1 tickless=1");
    vm.wait_console("tiny: tickless\n", BOOT);
    let clones = post_clones(&vm.sock, 3);
    let grandchild = post_clones(Path::new(clones[0]["api_sock"].as_str().unwrap()), 1).remove(0);
    // A clone whose console is discarded: no file, and it runs like the others.
    let (code, body) = vm.api("POST", "/clones", Some(r#"{"count":1,"console":"null"}"#));
    assert_eq!(code, 201, "{body}");
    let quiet: Value = serde_json::from_str::<Value>(&body).unwrap()["clones"][0].clone();
    assert_eq!(quiet["console"], "/dev/null");
    assert!(!Path::new(&format!("{}.console", quiet["api_sock"].as_str().unwrap())).exists());
    let (code, _) = api_request(
        Path::new(quiet["api_sock"].as_str().unwrap()),
        "GET",
        "/vm",
        None,
    );
    assert_eq!(code, 200);
    // No chance to clean up: PR_SET_PDEATHSIG must take every clone (and theirs) down,
    // and each removes its own socket on the way out.
    vm.child.kill().unwrap();
    vm.child.wait().unwrap();
    let start = Instant::now();
    for c in clones.iter().chain([&grandchild, &quiet]) {
        let pid = c["pid"].as_i64().unwrap();
        while alive(pid) {
            assert!(
                start.elapsed() < BOOT,
                "clone {pid} outlived its SIGKILLed parent"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let sock = c["api_sock"].as_str().unwrap();
        assert!(!Path::new(sock).exists(), "{sock} outlived its clone");
        // Consoles are kept for reading, as when any clone exits.
        let console = c["console"].as_str().unwrap();
        assert!(console == "/dev/null" || Path::new(console).exists());
    }
}
