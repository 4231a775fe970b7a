//! Faults injected into a running template: a full socket or overlay
//! directory, too few file descriptors, and a SIGKILL at any moment of a clone request.
//! For each: what the caller sees, that the template keeps serving, and that nothing is
//! left behind. Tiny guest, so each boot takes a second or two.

use std::io::{Read, Write};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::Value;
use tests::{children_of, fds_of, guest_file, kvm_and_root_available, kvm_available, Scratch, Vm};

const BOOT: Duration = Duration::from_secs(60);

/// A tmpfs with room for `inodes` inodes mounted on `dir` (made if missing), unmounted
/// on drop.
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, inodes: u32) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let out = Command::new("mount")
            .args(["-t", "tmpfs", "-o"])
            .arg(format!("size=16m,nr_inodes={inodes},mode=0755"))
            .arg("tmpfs")
            .arg(dir)
            .output()
            .expect("mount");
        assert!(out.status.success(), "mount tmpfs: {out:?}");
        Self(dir.to_path_buf())
    }

    /// Makes empty files until the file system has no inode left; returns them.
    fn fill(&self) -> Vec<PathBuf> {
        let mut made = Vec::new();
        for i in 0.. {
            let p = self.0.join(format!("filler-{i}"));
            match std::fs::File::create(&p) {
                Ok(_) => made.push(p),
                Err(e) => {
                    assert_eq!(e.raw_os_error(), Some(libc::ENOSPC), "{e}");
                    return made;
                }
            }
        }
        unreachable!()
    }

    /// What is in it besides the fillers.
    fn entries(&self) -> Vec<String> {
        std::fs::read_dir(&self.0)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| !n.starts_with("filler-"))
            .collect()
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Waits (at most 5 s) until `pid` has no child left: its failed or deleted clones
/// ended and were reaped.
fn children_reaped(pid: u32) {
    let start = Instant::now();
    while !children_of(pid).is_empty() && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn post_clones(vm: &Vm, count: u32) -> (u16, Value) {
    let (code, body) = vm.api("POST", "/clones", Some(&format!(r#"{{"count":{count}}}"#)));
    let v = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    (code, v)
}

/// Deletes the clones of a `POST /clones` answer and their consoles (which a clone
/// leaves for its user to read).
fn delete_all(vm: &Vm, clones: &Value) {
    for c in clones["clones"].as_array().unwrap() {
        let (code, body) = vm.api(
            "DELETE",
            &format!("/clones/{}", c["id"].as_str().unwrap()),
            None,
        );
        assert_eq!(code, 200, "{body}");
        std::fs::remove_file(c["console"].as_str().unwrap()).unwrap();
    }
}

/// The template still runs its guest and answers.
fn assert_serving(vm: &mut Vm) {
    let text = vm.console_text();
    let beats = text.matches("tiny: beat ").count();
    vm.wait_console(&format!("tiny: beat {}\n", beats + 1), BOOT);
    assert_eq!(vm.describe()["state"], "running");
}

#[test]
fn clones_refused_for_a_full_socket_or_overlay_directory_leave_nothing_and_the_template_serves() {
    if !kvm_and_root_available("faults_full_directories") {
        return;
    }
    let scratch = Scratch::new("faults-full");
    // The control socket's directory and the overlay directory, each its own small
    // file system (the template's socket, console and log take 3 inodes, the root 1).
    let socks = Tmpfs::mount(&scratch.path("socks"), 64);
    let cow = Tmpfs::mount(&scratch.path("cow"), 64);
    let tiny = guest_file("tiny.elf").display().to_string();
    let disk = guest_file("rootfs.ext4").display().to_string();
    let cow_dir = cow.0.display().to_string();
    let args = [
        "--kernel",
        &tiny,
        "--mem-mib",
        "64",
        "--rootfs",
        &disk,
        "--rootfs-cow",
        &cow_dir,
        "--cmdline",
        "ticks=1 beat=10",
    ];
    let (sock, console) = (socks.0.join("api.sock"), socks.0.join("console"));
    let mut vm = Vm::start_at(&scratch, &sock, &console, &args, |_| {});
    vm.wait_console("tiny: beat 1\n", BOOT);
    let pid = vm.child.id();
    // A clone first, so lazily made state exists before counting.
    let (code, made) = post_clones(&vm, 1);
    assert_eq!(code, 201, "{made}");
    delete_all(&vm, &made);
    // The count at rest: once the deleted clone is reaped and the count holds still
    // (read at once, a descriptor of the clone's teardown could still be open beside
    // the other tests' load, making every later count look one short).
    children_reaped(pid);
    let fds = tests::fds_at_rest(pid);
    let fds_before = tests::fd_targets(pid);
    let before = socks.entries();

    for (full, what) in [(&socks, "socket directory"), (&cow, "overlay directory")] {
        let fillers = full.fill();
        let (code, body) = post_clones(&vm, 3);
        assert_eq!(code, 503, "a full {what}: {body}");
        let msg = body["error"].as_str().unwrap_or_default().to_string();
        assert!(msg.contains("No space left on device"), "{what}: {msg}");
        eprintln!("faults: a full {what}: {code} {msg}");
        // Nothing half-made: no clone process (each failed one ends on its own and is
        // reaped on SIGCHLD), socket, console or descriptor.
        children_reaped(pid);
        assert!(children_of(pid).is_empty(), "{:?}", children_of(pid));
        assert_eq!(socks.entries(), before, "{what}");
        assert_eq!(
            fds_of(pid, fds),
            fds,
            "{what}: fds (at rest before: {fds_before})\n{}",
            tests::fd_targets(pid)
        );
        let (_, list) = vm.api("GET", "/clones", None);
        let list: Value = serde_json::from_str(&list).unwrap();
        assert!(
            (list["clones"].as_array().unwrap().iter()).all(|c| c["status"]["state"] != "running"),
            "{list}"
        );
        assert_serving(&mut vm);
        // With room again, clones are made as before.
        for f in fillers {
            std::fs::remove_file(f).unwrap();
        }
        let (code, made) = post_clones(&vm, 3);
        assert_eq!(code, 201, "{what} with room again: {made}");
        delete_all(&vm, &made);
        assert_eq!(socks.entries(), before, "{what}");
    }
    vm.shutdown(BOOT);
    assert!(
        socks.entries().iter().all(|e| e == "console"),
        "{:?}",
        socks.entries()
    );
    assert_eq!(cow.entries(), Vec::<String>::new());
}

/// An invocation's clone is not waited for by its template (it answers its caller
/// itself): one that cannot start must still get its caller an answer, with the reason.
#[test]
fn an_invocation_whose_clone_cannot_start_is_answered_with_the_reason_and_the_template_serves() {
    if !kvm_and_root_available("faults_invocation_full_directory") {
        return;
    }
    let scratch = Scratch::new("faults-invoke-full");
    let socks = Tmpfs::mount(&scratch.path("socks"), 64);
    let tiny = guest_file("tiny.elf").display().to_string();
    for warm in ["0", "2"] {
        let args = [
            "--kernel",
            &tiny,
            "--mem-mib",
            "64",
            "--ap-boot",
            "direct",
            "--cmdline",
            "ticks=1 invoke=1",
            "--template",
            "--warm-clones",
            warm,
        ];
        let (sock, console) = (socks.0.join("api.sock"), socks.0.join("console"));
        let mut vm = Vm::start_at(&scratch, &sock, &console, &args, |_| {});
        vm.wait_console("tiny: invoke ready\n", BOOT);
        vm.wait_api(BOOT);
        tests::wait_until("the template to pause", BOOT, || vm.waits_as_template());
        let pid = vm.child.id();
        let invoke = || {
            let options = api_types::InvokeOptions::default();
            forkvm_client::api::invoke(&sock, &options, b"ping").expect("invoke")
        };
        // Its warm clones are its only children, and its own socket and console the
        // only files, once the invocation clones are reaped (each one's files go then:
        // one that went after the directory was filled would make room for the next).
        let kept: usize = warm.parse().unwrap();
        let settled = || {
            let done = || {
                children_of(pid).len() <= kept
                    && socks
                        .entries()
                        .iter()
                        .all(|e| e == "api.sock" || e == "console")
            };
            // Settled once seen so: a warm clone made a moment later (the pool replaces
            // those made before it learned its working set) is no leftover.
            let start = Instant::now();
            loop {
                if done() {
                    return true;
                }
                if start.elapsed() >= Duration::from_secs(5) {
                    return false;
                }
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let r = invoke();
        assert_eq!(r.status, 200, "warm {warm}: {}", r.body);
        assert!(settled(), "{:?} {:?}", children_of(pid), socks.entries());
        let before = socks.entries();
        let fillers = socks.fill();
        for _ in 0..3 {
            let r = invoke();
            eprintln!(
                "faults: warm {warm}, a full socket directory: {} {}",
                r.status, r.body
            );
            assert_eq!(r.status, 503, "warm {warm}: {}", r.body);
            assert!(r.body.contains("No space left on device"), "{}", r.body);
        }
        // Nothing left: no clone process, socket, console.
        assert!(settled(), "{:?} {:?}", children_of(pid), socks.entries());
        assert_eq!(socks.entries(), before, "warm {warm}");
        for f in fillers {
            std::fs::remove_file(f).unwrap();
        }
        let r = invoke();
        assert_eq!(r.status, 200, "warm {warm}, with room again: {}", r.body);
        vm.shutdown(BOOT);
        let _ = std::fs::remove_file(&console);
    }
}

#[test]
fn a_template_out_of_file_descriptors_refuses_clearly_and_recovers() {
    if !kvm_available("faults_emfile") {
        return;
    }
    let scratch = Scratch::new("faults-emfile");
    let tiny = guest_file("tiny.elf").display().to_string();
    let args = [
        "--kernel",
        &tiny,
        "--mem-mib",
        "64",
        "--cmdline",
        "ticks=1 beat=10",
    ];
    let (sock, console) = (scratch.path("api.sock"), scratch.path("console"));
    let mut vm = Vm::start_at(&scratch, &sock, &console, &args, |cmd| {
        // SAFETY: setrlimit is async-signal-safe and touches only the child's limits.
        unsafe {
            cmd.pre_exec(|| {
                let lim = libc::rlimit {
                    rlim_cur: NOFILE,
                    rlim_max: NOFILE,
                };
                if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    });
    vm.wait_console("tiny: beat 1\n", BOOT);
    let pid = vm.child.id();
    let at_rest = tests::fds_at_rest(pid);
    let free = NOFILE as usize - at_rest;
    let connect = || UnixStream::connect(&vm.sock).unwrap();
    let accepted = |n: usize, what: &str| {
        let got = fds_of(pid, n);
        assert_eq!(got, n, "{what}: the template holds {got} descriptors");
    };

    // Idle connections take all descriptors but the one a clone request's connection
    // takes: the clone cannot be made, and the caller is told why.
    let idle: Vec<UnixStream> = (0..free - 1).map(|_| connect()).collect();
    accepted(NOFILE as usize - 1, "idle connections");
    let (code, body) = post_clones(&vm, 1);
    let msg = body["error"].as_str().unwrap_or_default().to_string();
    eprintln!("faults: {NOFILE} descriptors ({at_rest} at rest), all taken: {code} {msg}");
    assert_eq!(code, 503, "{body}");
    assert!(msg.contains("Too many open files"), "{msg}");
    assert!(
        children_of(pid).is_empty(),
        "a half-made clone: {:?}",
        children_of(pid)
    );
    drop(idle);
    accepted(at_rest, "idle connections closed");
    let (code, made) = post_clones(&vm, 1);
    assert_eq!(code, 201, "{made}");
    delete_all(&vm, &made);
    accepted(at_rest, "after a clone");

    // More connections than descriptors: accepting pauses while none is left, the idle
    // ones get 408 at their request deadline (5 s), and a request among the waiting ones
    // is then served.
    let idle: Vec<UnixStream> = (0..free + 16).map(|_| connect()).collect();
    let full = fds_of(pid, usize::MAX);
    assert!(
        full >= NOFILE as usize,
        "{full} descriptors with every one taken"
    );
    let (code, body) = vm.api("GET", "/vm", None);
    assert_eq!(code, 200, "{body}");
    let mut timed_out = 0;
    for mut c in idle {
        c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut answer = String::new();
        let _ = c.read_to_string(&mut answer);
        timed_out += usize::from(answer.starts_with("HTTP/1.1 408"));
    }
    assert!(
        timed_out >= free - 1,
        "{timed_out} of the idle connections got 408"
    );
    assert_serving(&mut vm);
    let (code, made) = post_clones(&vm, 1);
    assert_eq!(code, 201, "{made}");
    delete_all(&vm, &made);
    accepted(at_rest, "at the end");
    vm.shutdown(BOOT);
}

/// The template's descriptor limit in the test above.
const NOFILE: u64 = 64;

/// Processes whose command line names `needle` (a scratch directory: the template's and
/// its clones', which are forked, not executed).
fn processes_naming(needle: &str) -> Vec<u32> {
    let me = std::process::id();
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|&p| p != me)
        .filter(|p| {
            std::fs::read(format!("/proc/{p}/cmdline"))
                .map(|c| String::from_utf8_lossy(&c).contains(needle))
                .unwrap_or(false)
        })
        .collect()
}

#[test]
fn a_template_sigkilled_at_any_moment_of_a_clone_request_takes_every_clone_with_it() {
    if !kvm_available("faults_sigkill_template") {
        return;
    }
    // Delays after sending a request for 8 clones of a paused template that keeps 2 warm
    // clones: they land before the pause, while the state is captured, between the
    // forks and the clones' ready, and while warm clones are launched and refilled.
    let mut slowest = Duration::ZERO;
    let delays = [0u64, 1, 2, 4, 8, 15, 30, 60, 120, 250];
    for (delay_ms, paused) in delays.iter().flat_map(|&d| [(d, false), (d, true)]) {
        let scratch = Scratch::new("faults-kill");
        let warm = ["--warm-clones", "2"];
        let mut vm = tests::tiny_vm_with(&scratch, "64", "1", "ticks=1 beat=10", &warm);
        let needle = scratch.path("").display().to_string();
        vm.wait_console("tiny: beat 1\n", BOOT);
        vm.wait_api(BOOT);
        if paused {
            assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
        }
        // Connected before the thread starts, so even at delay 0 the SIGKILL comes after
        // the template accepted the connection (a connect racing the kill could be
        // refused, which says nothing about the template).
        let mut c = UnixStream::connect(&vm.sock).unwrap();
        // The answer's status, or 0 when the connection broke first.
        let request = std::thread::spawn(move || {
            let body = r#"{"count":8}"#;
            let head = format!(
                "POST /clones HTTP/1.1\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            let _ = c.write_all(format!("{head}{body}").as_bytes());
            let mut answer = String::new();
            let _ = c.read_to_string(&mut answer);
            (answer.get(9..12))
                .and_then(|s| s.parse::<u16>().ok())
                .unwrap_or(0)
        });
        std::thread::sleep(Duration::from_millis(delay_ms));
        vm.child.kill().unwrap();
        let killed = Instant::now();
        vm.child.wait().unwrap();
        let code = request.join().unwrap();
        let left = loop {
            let left = processes_naming(&needle);
            if left.is_empty() || killed.elapsed() > Duration::from_secs(10) {
                break left;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(
            left.is_empty(),
            "after {delay_ms} ms: processes outlived their SIGKILLed template: {left:?}\n{}",
            vm.stderr_text()
        );
        // Each clone removed its socket as it died; the template's own stays (nothing
        // could remove it).
        let sockets: Vec<_> = std::fs::read_dir(scratch.path(""))
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_type().is_ok_and(|t| t.is_socket()) && e.path() != vm.sock)
            .map(|e| e.path())
            .collect();
        assert!(
            sockets.is_empty(),
            "after {delay_ms} ms: clone sockets left: {sockets:?}\n{}",
            vm.stderr_text()
        );
        slowest = slowest.max(killed.elapsed());
        eprintln!(
            "faults: SIGKILL {delay_ms} ms into the request (paused: {paused}, answer \
             {code}): all gone after {:?}",
            killed.elapsed()
        );
    }
    eprintln!("faults: slowest: {slowest:?}");
}

#[test]
fn a_clone_killed_while_it_starts_is_reported_and_leaves_nothing() {
    if !kvm_available("faults_clone_killed_starting") {
        return;
    }
    let scratch = Scratch::new("faults-starting");
    let mut vm = tests::tiny_vm(&scratch, "64", "1", "ticks=1 beat=10");
    vm.wait_console("tiny: beat 1\n", BOOT);
    let pid = vm.child.id();
    let fds = tests::fds_at_rest(pid);
    for round in 0..5 {
        // A thread that SIGKILLs the template's first new child as soon as it appears
        // (while it rebuilds its VM, or just after it reported ready).
        let watcher = std::thread::spawn(move || {
            let start = Instant::now();
            while start.elapsed() < Duration::from_secs(10) {
                if let Some(&child) = children_of(pid).first() {
                    // SAFETY: kill has no memory preconditions; the pid is a clone this
                    // test's template just forked.
                    unsafe { libc::kill(child as i32, libc::SIGKILL) };
                    return Some(child);
                }
            }
            None
        });
        let (code, body) = post_clones(&vm, 4);
        let killed = watcher.join().unwrap().expect("a clone to kill") as i64;
        let clones = body["clones"].as_array().cloned().unwrap_or_default();
        let victim = clones.iter().find(|c| c["pid"] == killed);
        eprintln!(
            "faults: round {round}: clone {killed} killed while starting: {code}, it is {}",
            victim.map_or("unlisted".into(), |c| format!(
                "{} {}",
                c["status"], c["error"]
            ))
        );
        assert_eq!(code, 201, "{body}");
        let victim = victim.unwrap_or_else(|| panic!("clone {killed} not listed: {body}"));
        match victim["status"]["state"].as_str() {
            // Killed before it was ready: said so.
            Some("failed") => assert!(victim["error"].is_string(), "{victim}"),
            // Killed just after.
            Some("running") => {}
            other => panic!("{other:?}: {victim}"),
        }
        // The other three run; the killed one is reaped and its socket removed.
        for c in clones.iter().filter(|c| c["pid"] != killed) {
            assert_eq!(c["status"]["state"], "running", "{c}");
        }
        // Reaped (on SIGCHLD): its record says killed, and its socket is not left.
        let record = || {
            let (_, list) = vm.api("GET", "/clones", None);
            let list: Value = serde_json::from_str(&list).unwrap();
            (list["clones"].as_array().unwrap().iter())
                .find(|c| c["pid"] == killed)
                .cloned()
                .unwrap()
        };
        let start = Instant::now();
        while record()["status"]["state"] != "killed" && start.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert_eq!(record()["status"]["state"], "killed", "{}", record());
        assert!(!Path::new(victim["api_sock"].as_str().unwrap()).exists());
        let others = serde_json::json!({
            "clones": clones.iter().filter(|c| c["pid"] != killed).cloned().collect::<Vec<_>>()
        });
        delete_all(&vm, &others);
        let _ = std::fs::remove_file(victim["console"].as_str().unwrap());
        assert_serving(&mut vm);
    }
    assert!(children_of(pid).is_empty(), "{:?}", children_of(pid));
    assert_eq!(fds_of(pid, fds), fds, "fds");
    vm.shutdown(BOOT);
}
