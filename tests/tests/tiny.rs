//! Boots forkvm's tiny test guest: SMP, timer interrupts through the in-kernel irqchip,
//! serial, the probe port, pause/resume over the API, power-off, and bad input.

use std::time::Duration;

use tests::{guest_file, kvm_available, run_vmm, tiny_vm, Scratch};

const BOOT: Duration = Duration::from_secs(30);

fn tiny() -> String {
    guest_file("tiny.elf").display().to_string()
}

#[test]
fn boots_with_1_2_and_4_vcpus_every_vcpu_reports_in() {
    if !kvm_available("boots_with_1_2_and_4_vcpus") {
        return;
    }
    for n in [1u8, 2, 4] {
        let scratch = Scratch::new("smp");
        let ns = n.to_string();
        let mut vm = tiny_vm(&scratch, "32", &ns, "ticks=5 beat=10 exit=2");
        let status = vm.wait_exit(BOOT);
        let console = vm.console_text();
        assert!(status.success(), "exit {status} with {n} vCPUs\n{console}");
        for cpu in 0..n {
            assert!(
                console.contains(&format!("tiny: cpu {cpu} up\n")),
                "{console}"
            );
            assert!(
                console.contains(&format!("tiny: cpu {cpu} timer ok\n")),
                "cpu {cpu} took no timer interrupts\n{console}"
            );
        }
        assert!(!console.contains(&format!("tiny: cpu {n} ")), "{console}");
        assert!(
            console.contains(&format!("tiny: all {n} cpus ok\n")),
            "{console}"
        );
        assert!(console.contains("tiny: beat 2\ntiny: reset\n"), "{console}");
        assert!(!console.contains("unexpected"), "{console}");
        assert!(
            vm.stderr_text().contains("guest reset through the i8042"),
            "{}",
            vm.stderr_text()
        );
        assert!(!scratch.path("api.sock").exists(), "socket left behind");
    }
}

#[test]
fn probe_port_counts_every_vcpu_and_get_vm_reports_state() {
    if !kvm_available("probe_port_counts_every_vcpu") {
        return;
    }
    let scratch = Scratch::new("probe");
    let mut vm = tiny_vm(&scratch, "32", "3", "ticks=3");
    vm.wait_console("tiny: all 3 cpus ok", BOOT);
    let (code, body) = vm.api("GET", "/vm", None);
    assert_eq!(code, 200, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["state"], "running");
    assert_eq!(v["vcpus"], 3);
    assert_eq!(v["memory_mib"], 32);
    assert_eq!(v["ap_boot"], "direct");
    assert_eq!(v["probe"]["writes"], 3, "{v}");
    let last = v["probe"]["last"].as_u64().unwrap();
    assert!((0x100..0x103).contains(&last), "{v}");
    let host = v["host"]["kvm"].as_str().unwrap();
    let pvm = std::path::Path::new("/sys/module/kvm_pvm").exists();
    assert_eq!(host, if pvm { "pvm" } else { "hardware" });
    assert_eq!(v["host"]["quirks_applied"], pvm);
    let (code, _) = vm.api("PUT", "/actions", Some(r#"{"action_type":"shutdown"}"#));
    assert_eq!(code, 204);
    assert!(vm.wait_exit(BOOT).success());
}

fn beats(console: &str) -> usize {
    console
        .lines()
        .filter(|l| l.starts_with("tiny: beat "))
        .count()
}

#[test]
fn pause_stops_the_guest_and_resume_continues_it() {
    if !kvm_available("pause_resume") {
        return;
    }
    let scratch = Scratch::new("pause");
    let mut vm = tiny_vm(&scratch, "32", "2", "ticks=2 beat=10");
    vm.wait_console("tiny: beat 3\n", BOOT);
    assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    let (_, body) = vm.api("GET", "/vm", None);
    assert!(body.contains(r#""state":"paused""#), "{body}");
    // Pausing twice is a conflict, and says why.
    let (code, body) = vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#));
    assert_eq!(code, 409, "{body}");
    assert!(body.contains("paused"), "{body}");

    let before = beats(&vm.console_text());
    std::thread::sleep(Duration::from_millis(400));
    let during = beats(&vm.console_text());
    assert_eq!(before, during, "guest ran while paused");

    assert_eq!(
        vm.api("PATCH", "/vm", Some(r#"{"state":"running"}"#)).0,
        204
    );
    vm.wait_console(&format!("tiny: beat {}\n", during + 3), BOOT);
    vm.shutdown(BOOT);
}

#[test]
fn memory_pattern_written_and_verified_by_the_guest() {
    if !kvm_available("memory_pattern") {
        return;
    }
    let (status, out, err) = run_vmm(
        &[
            "run",
            "--kernel",
            &tiny(),
            "--mem-mib",
            "64",
            "--cmdline",
            "ticks=1 beat=1 exit=1 memtest=8",
        ],
        BOOT,
    );
    assert!(status.success(), "{out}\n{err}");
    assert!(out.contains("tiny: memtest MiB=8 ok\n"), "{out}");
}

#[test]
fn an_exception_in_the_guest_is_reported_with_its_vector() {
    if !kvm_available("exception_report") {
        return;
    }
    let scratch = Scratch::new("ud");
    let mut vm = tiny_vm(&scratch, "32", "1", "ticks=1 beat=1 ud=1");
    vm.wait_console("tiny: unexpected exception 6\n", BOOT);
    // The CPU halted there: no heartbeat follows, and the probe saw 0xdead.
    let v = vm.describe();
    assert_eq!(v["probe"]["last"], 0xdead, "{v}");
    assert_eq!(beats(&vm.console_text()), 0);
    vm.shutdown(BOOT);
}

#[test]
fn api_rejects_bad_requests_and_keeps_running() {
    if !kvm_available("api_bad_requests") {
        return;
    }
    let scratch = Scratch::new("apibad");
    let mut vm = tiny_vm(&scratch, "32", "1", "ticks=1 beat=20");
    vm.wait_api(BOOT);
    let cases: &[(&str, &str, Option<&str>, u16)] = &[
        ("PATCH", "/vm", Some("{not json"), 400),
        ("PATCH", "/vm", Some(r#"{"state":"sleeping"}"#), 400),
        ("PUT", "/actions", Some(r#"{"action_type":"explode"}"#), 400),
        ("DELETE", "/vm", None, 405),
        ("GET", "/nothing", None, 404),
        ("PATCH", "/vm", Some(r#"{"state":"running"}"#), 409),
    ];
    for (method, path, body, want) in cases {
        let (code, text) = vm.api(method, path, *body);
        assert_eq!(code, *want, "{method} {path} {body:?}: {text}");
        assert!(text.contains("\"error\""), "{text}");
    }
    let (code, _) = tests::raw_request(&vm.sock, b"garbage\r\n\r\n");
    assert_eq!(code, 400);
    vm.wait_console("tiny: beat 2\n", BOOT);
    let (code, _) = vm.api("GET", "/vm", None);
    assert_eq!(code, 200);
    vm.shutdown(BOOT);
}

/// Raises this process's open-file soft limit to at least `n` (within the hard limit).
fn allow_open_files(n: u64) {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit and setrlimit read and write the struct given.
    unsafe {
        assert_eq!(libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim), 0);
        if lim.rlim_cur < n {
            lim.rlim_cur = n.min(lim.rlim_max);
            assert_eq!(libc::setrlimit(libc::RLIMIT_NOFILE, &lim), 0);
        }
    }
}

/// Whether the VMM still holds `s` open: it has neither answered nor closed it.
fn still_open(s: &std::os::unix::net::UnixStream) -> bool {
    use std::io::Read;
    s.set_nonblocking(true).unwrap();
    let mut b = [0u8; 1];
    let open = matches!((&*s).read(&mut b), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock);
    s.set_nonblocking(false).unwrap();
    open
}

#[test]
fn the_control_socket_serves_everyone_while_clients_stall_or_idle() {
    use std::io::Write;
    use std::os::unix::net::UnixStream;
    if !kvm_available("control_socket_stalls") {
        return;
    }
    allow_open_files(4096);
    let scratch = Scratch::new("apistall");
    let mut vm = tiny_vm(&scratch, "32", "1", "ticks=1 beat=20");
    vm.wait_api(BOOT);
    // A client that sends half a request and waits.
    let mut stalled = UnixStream::connect(&vm.sock).unwrap();
    stalled
        .write_all(b"PATCH /vm HTTP/1.1\r\nContent-Length: 20\r\n\r\n{\"st")
        .unwrap();
    let (code, _) = vm.api("GET", "/vm", None);
    assert_eq!(code, 200);
    assert!(still_open(&stalled), "the stalled client was dropped early");

    // 1,000 clients at once (each thread opens its connections, sends every request,
    // then reads every answer), while the stalled one waits.
    let threads: Vec<_> = (0..20)
        .map(|_| {
            let sock = vm.sock.clone();
            std::thread::spawn(move || {
                let conns: Vec<UnixStream> = (0..50)
                    .map(|_| UnixStream::connect(&sock).unwrap())
                    .collect();
                for mut c in &conns {
                    c.write_all(b"GET /vm HTTP/1.1\r\n\r\n").unwrap();
                }
                conns
                    .iter()
                    .map(|c| {
                        let r = forkvm_client::http::read_response(c).unwrap();
                        let vm: api_types::VmInfo = serde_json::from_str(&r.body)
                            .unwrap_or_else(|e| panic!("{} {}: {e}", r.status, r.body));
                        (r.status, vm.state)
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let answers: Vec<_> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    assert_eq!(answers.len(), 1000);
    assert!(answers.iter().all(|(code, _)| *code == 200));
    assert!(still_open(&stalled), "the stalled client was dropped early");

    // 200 connections opened and left idle do not hold up a request either.
    let idle: Vec<UnixStream> = (0..200)
        .map(|_| UnixStream::connect(&vm.sock).unwrap())
        .collect();
    let (code, _) = vm.api("GET", "/vm", None);
    assert_eq!(code, 200);
    assert!(idle.iter().all(still_open));

    // At its deadline the stalled client is told why.
    let r = forkvm_client::http::read_response(&stalled).unwrap();
    assert_eq!(r.status, 408, "{}", r.body);
    vm.wait_console("tiny: beat 2\n", BOOT);
    vm.shutdown(BOOT);
}

#[test]
fn sigterm_stops_cleanly_and_removes_the_socket() {
    if !kvm_available("sigterm") {
        return;
    }
    let scratch = Scratch::new("sigterm");
    let mut vm = tiny_vm(&scratch, "32", "1", "ticks=1 beat=10");
    vm.wait_console("tiny: beat 1\n", BOOT);
    // Our own child, by PID.
    let rc = std::process::Command::new("kill")
        .arg("-TERM")
        .arg(vm.child.id().to_string())
        .status()
        .unwrap();
    assert!(rc.success());
    let status = vm.wait_exit(BOOT);
    assert_eq!(status.code(), Some(128 + 15), "{}", vm.stderr_text());
    assert!(!vm.sock.exists(), "socket left behind after SIGTERM");
}

#[test]
fn bad_inputs_give_clear_errors_not_panics() {
    if !kvm_available("bad_inputs") {
        return;
    }
    let scratch = Scratch::new("badin");
    let not_kernel = scratch.path("not-a-kernel");
    std::fs::write(&not_kernel, b"hello, I am not a kernel\n").unwrap();
    let not_kernel = not_kernel.display().to_string();
    let regular = scratch.path("regular-file");
    std::fs::write(&regular, b"x").unwrap();
    let regular = regular.display().to_string();
    let t = tiny();
    let long_cmdline = "x".repeat(3000);
    let cow_not_dir = format!("{t},cow={t}");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["run", "--kernel", "/nonexistent/vmlinux"],
            "kernel /nonexistent/vmlinux",
        ),
        (
            vec!["run", "--kernel", &t, "--mem-mib", "1"],
            "memory size 1 MiB is out of range",
        ),
        (
            vec!["run", "--kernel", &t, "--vcpus", "0"],
            "0 vCPUs requested",
        ),
        (
            vec!["run", "--kernel", &t, "--vcpus", "255"],
            "255 vCPUs requested",
        ),
        (
            vec!["run", "--kernel", &not_kernel],
            "is not a loadable kernel",
        ),
        (
            vec!["run", "--kernel", &t, "--initrd", "/nonexistent/initrd"],
            "initrd /nonexistent/initrd",
        ),
        (
            vec!["run", "--kernel", &t, "--api-sock", &regular],
            "exists and is not a socket",
        ),
        (
            vec![
                "run",
                "--kernel",
                &t,
                "--mem-mib",
                "16",
                "--cmdline",
                &long_cmdline,
            ],
            "kernel command line is",
        ),
        (
            vec!["status", "--api-sock", "/nonexistent/sock"],
            "cannot connect to /nonexistent/sock",
        ),
        (
            vec!["run", "--kernel", &t, "--tap", "no/slash"],
            "invalid tap name \"no/slash\"",
        ),
        (
            vec!["run", "--kernel", &t, "--disk", "/nonexistent.img"],
            "disk /nonexistent.img: No such file",
        ),
        (
            vec!["run", "--kernel", &t, "--disk", &cow_not_dir],
            "copy-on-write directory",
        ),
    ];
    for (args, want) in cases {
        let (status, out, err) = run_vmm(&args, BOOT);
        assert_eq!(status.code(), Some(1), "{args:?}: {out}\n{err}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in:\n{err}");
        assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    }
    // Bad values the command line parser refuses (exit status 2).
    for (args, want) in [
        (
            vec![
                "run",
                "--kernel",
                &t,
                "--tap",
                "t0",
                "--mac",
                "01:00:5e:00:00:01",
            ],
            "multicast",
        ),
        (
            vec!["run", "--kernel", &t, "--tap", "t0", "--mac", "06:00"],
            "six hex bytes",
        ),
        (
            vec!["run", "--kernel", &t, "--mac", "06:00:ac:10:00:02"],
            "--tap",
        ),
        (
            vec!["run", "--kernel", &t, "--disk", "a.img,ro"],
            "unknown option \"ro\"",
        ),
        (
            vec![
                "run",
                "--kernel",
                &t,
                "--disk",
                "a.img,cow=/tmp,cow=/var/tmp",
            ],
            "\"cow\" is given twice",
        ),
        (
            vec!["run", "--kernel", &t, "--disk", "a.img,bytes=fast"],
            "bad rate limit",
        ),
    ] {
        let (status, out, err) = run_vmm(&args, BOOT);
        assert_eq!(status.code(), Some(2), "{args:?}: {out}\n{err}");
        assert!(err.contains(want), "{args:?}: expected {want:?} in:\n{err}");
    }
    // The regular file given as a socket path is left alone.
    assert_eq!(std::fs::read(&regular).unwrap(), b"x");
    let (status, _, err) = run_vmm(&["--log-level", "loud", "status", "--api-sock", "/x"], BOOT);
    assert_eq!(status.code(), Some(2));
    assert!(
        err.contains("invalid value 'loud' for '--log-level"),
        "{err}"
    );
}
