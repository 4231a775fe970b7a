//! The real Linux 6.1 guest. Two tests boot it, because booting is what they test (PVH
//! with an initramfs, 2 vCPUs and a data disk; the bzImage with its root on virtio-blk):
//! slow on a PVM host (20-100 s, nearly all of it kernel code in the host's instruction
//! emulator). Every other test starts from a cached snapshot of the booted guest with
//! the devices it needs and its agent serving (`tests::cache`), and runs its guest
//! script through the agent as the boot used to run it from the command line
//! (`tests::run_on_console`). What must not run beside what is in
//! `.config/nextest.toml`.

use std::path::Path;
use std::time::Duration;

use serde_json::Value;

use tests::{guest_file, kvm_available, vmm_exec, Scratch, Vm};

/// Generous for a guest beside one other: a Linux boot takes about 20-60 s here (the bzImage,
/// which decompresses itself (LZ4) in the host's instruction emulator, about 100 s).
const LINUX_BOOT: Duration = Duration::from_secs(400);

/// What the guest kernel prints when a process crashes the way the PVM host's start-up
/// problem makes it (docs/host.md: its FS base lost, a load through address 0).
const HOST_CRASH: &str = "segfault at 0 ip ";

fn path(name: &str) -> String {
    guest_file(name).display().to_string()
}

/// What the guest kernel prints when RCU finds a CPU that has not passed a quiescent
/// state for its stall timeout ("detected stalls on CPUs/tasks", "self-detected stall").
const RCU_STALL: &str = "rcu: INFO: rcu_sched ";

/// How long a guest that reported an RCU stall may print nothing more before it is taken
/// for hung: more than the longest silence of a boot beside other guests here (its
/// initramfs unpacked, about 80 s).
const STALL_HUNG: Duration = Duration::from_secs(150);

/// Waits for the VMM to exit (at most [`LINUX_BOOT`]); `None`, the VM killed, when its
/// console showed [`RCU_STALL`] and then stayed the same for [`STALL_HUNG`].
fn wait_exit_unless_stalled(vm: &mut Vm) -> Option<std::process::ExitStatus> {
    let start = std::time::Instant::now();
    let (mut seen, mut since) = (0, std::time::Instant::now());
    loop {
        if let Some(status) = vm.child.try_wait().expect("wait vmm") {
            return Some(status);
        }
        let console = vm.console_text();
        if console.len() != seen {
            (seen, since) = (console.len(), std::time::Instant::now());
        }
        if console.contains(RCU_STALL) && since.elapsed() > STALL_HUNG {
            vm.kill();
            return None;
        }
        if start.elapsed() > LINUX_BOOT {
            // Ends it with what it was doing (threads, console, log).
            return Some(vm.wait_exit(Duration::ZERO));
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[test]
fn linux_smp_pvh_boot_runs_userspace_command_and_reads_the_disk() {
    if !kvm_available("linux_smp_pvh_boot") {
        return;
    }
    let cmd = r#"console=ttyS0 reboot=k panic=-1 forkvm.run="echo hello-from-$(echo userspace); echo nproc=$(nproc); cat /mnt/disk/etc/forkvm-disk""#;
    let (kernel, initrd, rootfs) = (path("vmlinux"), path("initramfs.cpio"), path("rootfs.ext4"));
    let args = [
        "--kernel",
        &kernel,
        // The uncompressed archive: unpacking runs in the host's instruction
        // emulator here, and gunzip would double that (docs/benchmarks.md).
        "--initrd",
        &initrd,
        "--rootfs",
        &rootfs,
        // 128 MiB, not 256: the kernel sets up and frees half as many pages (emulated
        // here): a boot 0.92x as long, measured side by side.
        "--mem-mib",
        "128",
        "--vcpus",
        "2",
        "--cmdline",
        cmd,
    ];
    // The test's command starts several processes on a 2-vCPU guest: on the AMD PVM
    // host one of them can crash at start-up for the host's reasons (docs/host.md;
    // 2 of the 4 hog runs of 2026-11-28 saw it). A boot whose command failed that way is
    // done once more, saying so; one that fails otherwise fails the test.
    // And on the AMD PVM host a 2-vCPU boot beside other guests can report an RCU stall
    // (a vCPU in kernel code for the stall timeout, 21 s, its work emulated and its
    // thread waiting for a core) and then stop making progress for good (docs/host.md);
    // a boot whose console stayed the same for STALL_HUNG after such a report is ended
    // and done once more, saying so.
    let mut tries = 0;
    let (status, console, log) = loop {
        tries += 1;
        let scratch = Scratch::new("linux-pvh");
        let mut vm = Vm::start(&scratch, &args);
        let Some(status) = wait_exit_unless_stalled(&mut vm) else {
            let console = vm.console_text();
            assert!(tries < 2, "hung again after an RCU stall:\n{console}");
            eprintln!(
                "warning: the guest hung after an RCU stall report (host problem); booting \
                 again\n{}",
                &console[console.find(RCU_STALL).unwrap_or(0)..]
            );
            continue;
        };
        let console = vm.console_text();
        let log = vm.stderr_text();
        let ok = console.contains("forkvm-init: exit status 0");
        if !ok && tries < 2 && console.contains(HOST_CRASH) {
            eprintln!("warning: a guest process crashed at start-up (host problem); booting again");
            continue;
        }
        break (status, console, log);
    };
    assert!(status.success(), "exit {status}\n{console}\n{log}");
    assert!(log.contains("via Pvh"), "{log}");
    // The shell expanded $(...): the line came from userspace, not the kernel echoing
    // its command line.
    assert!(console.contains("\nhello-from-userspace\n"), "{console}");
    assert!(console.contains("\nnproc=2\n"), "SMP: {console}");
    assert!(
        console.contains("\nforkvm rootfs disk\n"),
        "disk: {console}"
    );
    assert!(console.contains("forkvm-init: exit status 0"), "{console}");
}

#[test]
fn linux_bzimage_boot_protocol_with_root_on_virtio_blk() {
    if !kvm_available("linux_bzimage_boot") {
        return;
    }
    let scratch = Scratch::new("linux-bz");
    let mut vm = Vm::start(
        &scratch,
        &[
            "--kernel",
            &path("bzImage"),
            "--rootfs",
            &path("rootfs.ext4"),
            "--mem-mib",
            "128",
            "--cmdline",
            r#"console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda ro rootfstype=ext4 forkvm.run="echo bz-$(uname -r); grep ' / ' /proc/mounts""#,
        ],
    );
    let status = vm.wait_exit(LINUX_BOOT);
    let console = vm.console_text();
    let log = vm.stderr_text();
    assert!(status.success(), "exit {status}\n{console}\n{log}");
    assert!(log.contains("via Linux64"), "{log}");
    assert!(console.contains("\nbz-6.1."), "{console}");
    assert!(console.contains("-forkvm\n"), "{console}");
    assert!(
        console.contains("/dev/root / ext4 ro"),
        "root not on the disk: {console}"
    );
}

fn host_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// `forkvm-clone --clock` output ("+0.000002 0.000028": host minus guest wall clock and
/// the reading's uncertainty, in seconds) within 0.5 s.
fn assert_clock_right(clock: Option<&str>, who: &str) {
    let offset: Option<f64> = clock
        .and_then(|c| c.split_whitespace().next())
        .and_then(|o| o.parse().ok());
    let Some(offset) = offset else {
        panic!("{who}: no clock reading: {clock:?}");
    };
    assert!(
        offset.abs() < 0.5,
        "{who}: wall clock {offset} s off the host's ({clock:?})"
    );
}

/// Every sample is `bytes` bytes in hex and no two are the same.
fn assert_distinct_hex(samples: &[String], bytes: usize, what: &str) {
    for h in samples {
        assert_eq!(h.len(), 2 * bytes, "{bytes} bytes from {what} in hex: {h}");
    }
    let mut unique = samples.to_vec();
    unique.sort();
    unique.dedup();
    assert_eq!(
        unique.len(),
        samples.len(),
        "clones share {what} output: {samples:?}"
    );
}

fn value_after<'a>(console: &'a str, prefix: &str) -> Option<&'a str> {
    console
        .lines()
        .find_map(|l| l.trim_end_matches('\r').strip_prefix(prefix))
}

#[test]
fn linux_clones_run_userspace_with_their_own_rng_and_the_right_clock() {
    // Also: warm clones of the paused template (prepared ahead, launched later) keep
    // the right clock and working timers.
    if !kvm_available("linux_clones") {
        return;
    }
    let scratch = Scratch::new("linux-clones");
    let test_start = host_now();
    // The template (with a root disk and virtio-rng) clones itself from userspace; every
    // side prints its fork-like result, 16 bytes of /dev/urandom, 64 bytes of
    // /dev/hwrng, a checksum of a file it reads from the disk for the first time after
    // the clone point (through the restored virtio-blk queue) and of the same file in
    // its initramfs, and the time. The clones then power off; the parent ticks until
    // it is shut down.
    let script = r#"r=$(forkvm-clone 3); echo tool-status=$?; echo clone-result=$r; echo rand=$(od -An -tx1 -N16 /dev/urandom); echo hwrng=$(od -An -tx1 -N64 /dev/hwrng); echo disk=$(md5sum < /mnt/disk/usr/bin/forkvm-cowbench); echo ram=$(md5sum < /usr/bin/forkvm-cowbench); echo time=$(date +%s); echo finished; if [ $r = 0 ]; then while :; do echo tick=$(date +%s) clock=$(forkvm-clone --clock); sleep 1; done; else reboot -f; fi"#;
    // Restored from the cached agent guest with those devices, the script run as a boot
    // would run it from the command line.
    let rootfs = tests::cache::guest_image("rootfs.ext4");
    let devices = [
        "--rootfs",
        &rootfs,
        // Limits far above what the guest asks for, so their counters can be read.
        "--rootfs-rate-limit",
        "bytes=256M",
        "--rng-rate-limit",
        "bytes=1M",
    ];
    let vsock = scratch.path("vm.vsock");
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-disk-rng",
        &devices,
        &vsock,
        &["--warm-clones", "2"],
        LINUX_BOOT,
    );
    tests::run_on_console(&vm.sock, script);
    let parent = vm.wait_console("finished\n", LINUX_BOOT);
    // One `od` per sample, no pipeline: on this host two processes starting at once
    // can crash one (docs/guest-kernel.md, "Known host problems"). Its bytes come
    // space-separated.
    let hex = |console: &str, prefix: &str| {
        value_after(console, prefix)
            .unwrap_or_default()
            .replace(' ', "")
    };
    let mut rands = vec![hex(&parent, "rand=")];
    let mut hwrngs = vec![hex(&parent, "hwrng=")];
    let disk_sum = |console: &str| {
        let disk = value_after(console, "disk=")
            .unwrap_or_default()
            .to_string();
        assert!(disk.len() >= 32, "no checksum of the disk file: {console}");
        assert_eq!(
            Some(disk.as_str()),
            value_after(console, "ram="),
            "{console}"
        );
    };
    disk_sum(&parent);
    // The disk's and the entropy device's limiters counted what the template read
    // (a disk read before the clone point, then the file and 64 bytes of /dev/hwrng).
    let passed = |kind: &str| {
        let limiter = tests::device_limiter(&vm.sock, kind, "requests");
        let limiter = limiter.unwrap_or_else(|| panic!("{kind} has no limiter"));
        limiter["passed_bytes"].as_u64().unwrap()
    };
    assert!(passed("virtio-rng") >= 64, "{}", vm.describe());
    assert!(passed("virtio-blk") > 0, "{}", vm.describe());
    assert_eq!(value_after(&parent, "clone-result="), Some("0"), "{parent}");
    assert_eq!(value_after(&parent, "tool-status="), Some("0"), "{parent}");
    let parent_time = value_after(&parent, "time=")
        .unwrap()
        .parse::<u64>()
        .unwrap();
    // Read after the parent printed it (the slow guest kernel takes a while to get the
    // line out): between the start of the test and now.
    let now = host_now();
    assert!(
        parent_time + 2 >= test_start && parent_time <= now + 1,
        "parent clock {parent_time}: test started {test_start}, host now {now}"
    );

    let start = std::time::Instant::now();
    let clones = loop {
        let (_, body) = vm.api("GET", "/clones", None);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let list = v["clones"].as_array().unwrap().clone();
        // Clones power off after the script (`reboot -f`), exit status 0.
        if list.len() == 3 && list.iter().all(|c| c["status"]["state"] == "exited") {
            break list;
        }
        assert!(
            start.elapsed() < LINUX_BOOT,
            "clones did not finish: {body}"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    for c in &clones {
        let k = c["id"].as_str().unwrap();
        assert_eq!(c["status"]["code"], 0, "{c}");
        let console = std::fs::read_to_string(c["console"].as_str().unwrap())
            .unwrap()
            .replace("\r\n", "\n");
        assert_eq!(value_after(&console, "clone-result="), Some(k), "{console}");
        // The tool exits 3 (and says why) when reseeding the kernel RNG fails.
        assert_eq!(
            value_after(&console, "tool-status="),
            Some("0"),
            "{console}"
        );
        assert!(console.contains("finished\n"), "{console}");
        assert!(!console.contains("forkvm-clone:"), "tool error: {console}");
        let t = value_after(&console, "time=")
            .unwrap()
            .parse::<u64>()
            .unwrap();
        // Read after every clone exited: the clone printed its time after the test
        // started and before now. (The clones and the parent run the same slow commands
        // after the clone point on 2 CPUs, so a clone may print seconds before the
        // parent. A clock that stays behind is caught by the warm clones below, launched
        // long after they were forked.)
        let now = host_now();
        assert!(
            t + 1 >= test_start && t <= now + 1,
            "clone {k} clock {t}: test started {test_start}, host now {now}"
        );
        rands.push(hex(&console, "rand="));
        hwrngs.push(hex(&console, "hwrng="));
        disk_sum(&console);
    }
    // Each clone's virtio-rng serves its own host entropy, and forkvm-clone discarded
    // what the guest had buffered from the parent's device (docs/clone-uniqueness.md).
    assert_distinct_hex(&hwrngs, 64, "/dev/hwrng");
    // Distinct output is the property users need. Note that Linux also reseeds on its
    // own timer from per-clone interrupt timings, so this alone could pass without
    // forkvm-clone's reseed; its exit status above is what shows the reseed ran.
    assert_distinct_hex(&rands, 16, "/dev/urandom");

    // Warm clones: pause the template (it prints the time every second), let it
    // prepare two clones, wait, then launch them. Their clocks must have moved on by
    // the pause, and their timers must run (`sleep 1` keeps printing).
    vm.wait_console("tick=", LINUX_BOOT);
    assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    let start = std::time::Instant::now();
    loop {
        let (_, body) = vm.api("GET", "/vm", None);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if v["warm_clones"]["ready"] == 2 {
            break;
        }
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "no warm clones: {body}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_secs(5));
    let launched_at = host_now();
    let (code, body) = vm.api("POST", "/clones", Some(r#"{"count":2}"#));
    assert_eq!(code, 201, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let (_, status) = vm.api("GET", "/vm", None);
    let s: serde_json::Value = serde_json::from_str(&status).unwrap();
    assert_eq!(s["warm_clones"]["launched"], 2, "{status}");
    for c in v["clones"].as_array().unwrap() {
        let console = c["console"].as_str().unwrap().to_string();
        let start = std::time::Instant::now();
        let ticks = loop {
            let text = std::fs::read_to_string(&console).unwrap_or_default();
            let ticks: Vec<(u64, String)> = text
                .lines()
                .filter_map(|l| l.trim_end_matches('\r').strip_prefix("tick="))
                .filter_map(|t| {
                    let (secs, clock) = t.split_once(" clock=")?;
                    Some((secs.parse().ok()?, clock.to_string()))
                })
                .collect();
            if ticks.len() >= 3 {
                break ticks;
            }
            assert!(
                start.elapsed() < LINUX_BOOT,
                "warm clone {} stopped ticking: {text}",
                c["id"]
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        // The first line may carry a time read before the pause: the second is the
        // first read wholly after the launch.
        assert!(
            ticks[1].0 + 2 >= launched_at && ticks[1].0 <= host_now() + 1,
            "warm clone {} clock {ticks:?}, launched at host time {launched_at}",
            c["id"]
        );
        assert_clock_right(Some(&ticks[1].1), &format!("warm clone {}", c["id"]));
    }
    vm.shutdown(Duration::from_secs(30));
}

/// A host that connects to the agent on `vsock` (`CONNECT 1024`) and is accepted.
fn agent_stream(vsock: &std::path::Path) -> std::os::unix::net::UnixStream {
    use std::io::{BufRead, Write};
    let mut s = std::os::unix::net::UnixStream::connect(vsock).unwrap();
    s.write_all(forkvm_client::agent::wire::connect_line(1024).as_bytes())
        .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(120))).unwrap();
    let mut line = String::new();
    let mut reader = std::io::BufReader::new(s.try_clone().unwrap());
    reader.read_line(&mut line).unwrap();
    forkvm_client::agent::wire::accepted(&line).unwrap();
    s
}

/// User processes in the guest, through the agent: not init, not kernel threads (their
/// parent is kthreadd, pid 2), which come and go on their own (a worker of a freshly
/// restored kernel ends a while after). grep runs alone and the host counts the files
/// it lists: the agent sends stderr with stdout, so a complaint about a process that
/// ended between the glob and grep's read, or the shell's report of a crashed program in
/// a pipeline, would otherwise be read as the count; a grep crashed by the known host
/// problem exits 139, which `vmm_exec` runs again.
fn guest_processes(vm: &Vm) -> usize {
    let list = "grep -L '^PPid:[[:space:]]*[02]$' /proc/[0-9]*/status 2>/dev/null";
    let (code, out, err) = vmm_exec(&vm.sock, &["--", list], b"");
    // 0 or 1 by what it listed, 2 when a process ended before grep read it.
    assert!(matches!(code, Some(0..=2)), "{code:?} {out} {err}");
    out.lines()
        .filter(|l| l.starts_with("/proc/") && l.ends_with("/status"))
        .count()
}

/// The host side of vsock closes mid-stream, both ways: while it sends a command's input
/// (the guest is reading), and while it reads the answer (the guest is writing). The
/// VMM drops the connections (its descriptors come back to where they were), the agent's
/// handlers end, and the agent serves the next command.
fn hosts_that_close_mid_stream_leave_nothing_behind(vm: &Vm, vsock: &std::path::Path) {
    use std::io::{Read, Write};
    let fds = || tests::count_dir(format!("/proc/{}/fd", vm.child.id()));
    let (fds_before, processes_before) = (fds(), guest_processes(vm));
    // Half of a 1 MiB input, then the host is gone.
    let mut s = agent_stream(vsock);
    s.write_all(format!("4 {}\ntrue", 1 << 20).as_bytes())
        .unwrap();
    s.write_all(&vec![b'x'; 512 << 10]).unwrap();
    drop(s);
    // A 4 MiB answer: the first 64 KiB read, then the host is gone.
    let mut s = agent_stream(vsock);
    let cmd = "head -c 4194304 /dev/zero";
    s.write_all(format!("{} 0\n{cmd}", cmd.len()).as_bytes())
        .unwrap();
    let mut first = vec![0u8; 64 << 10];
    s.read_exact(&mut first).unwrap();
    assert!(first.starts_with(b"0 4194304\n"), "{:?}", &first[..16]);
    drop(s);
    let start = std::time::Instant::now();
    while fds() != fds_before || guest_processes(vm) != processes_before {
        assert!(
            start.elapsed() < Duration::from_secs(60),
            "descriptors {} (were {fds_before}), guest processes {} (were {processes_before})",
            fds(),
            guest_processes(vm)
        );
        std::thread::sleep(Duration::from_millis(500));
    }
    let (code, out, _) = vmm_exec(&vm.sock, &["--", "echo still-serving"], b"");
    assert_eq!((code, out.as_str()), (Some(0), "still-serving\n"));
}

#[test]
fn linux_vsock_exec_reaches_the_template_and_every_clone_on_its_own_socket() {
    if !kvm_available("linux_vsock") {
        return;
    }
    let scratch = Scratch::new("linux-vsock");
    let vsock = scratch.path("vm.vsock");
    // The guest once init serves the agent, booted once and kept as a cached snapshot
    // (`tests::cache`), restored here.
    let mut vm = tests::cache::linux_agent(&scratch, &vsock, LINUX_BOOT);
    // The template: input, output and exit status go through; it is not a clone.
    let (code, out, err) = vmm_exec(
        &vm.sock,
        &[
            "--stdin",
            "--",
            "read x; echo got-$x; forkvm-clone --id; exit 7",
        ],
        b"hello\n",
    );
    assert_eq!(code, Some(7), "{out}{err}");
    assert_eq!(out, "got-hello\n0\n");
    // Nobody listens on port 999: a clear error, and the VM keeps serving.
    let (code, _, err) = vmm_exec(&vm.sock, &["--port", "999", "--", "true"], b"");
    assert_eq!(code, Some(255));
    assert!(
        err.contains("nothing in the guest accepted on vsock port 999"),
        "{err}"
    );
    hosts_that_close_mid_stream_leave_nothing_behind(&vm, &vsock);
    // Connections at once: the agent has one spare process forked ahead, and the others
    // wait for the next ones it forks; each is served, with its own command.
    let replies: Vec<_> = std::thread::scope(|s| {
        let calls: Vec<_> = (0..4)
            .map(|i| {
                let sock = &vm.sock;
                s.spawn(move || vmm_exec(sock, &["--", &format!("echo at-once-{i}")], b""))
            })
            .collect();
        calls.into_iter().map(|c| c.join().unwrap()).collect()
    });
    for (i, (code, out, err)) in replies.iter().enumerate() {
        assert_eq!(
            (*code, out.as_str()),
            (Some(0), format!("at-once-{i}\n").as_str()),
            "{err}"
        );
    }
    // Output of many pipe reads comes through intact. On the PVM host the agent's copy of
    // each read (a user-space memcpy) once lost about 1% of lines to 16-byte runs of
    // zeros (docs/guest-kernel.md); it now reads into the reply directly.
    const LINES: usize = 3000;
    let (code, out, err) = vmm_exec(
        &vm.sock,
        &[
            "--",
            &format!(
                "i=0; while [ $i -lt {LINES} ]; do echo line $i of a long output; i=$((i+1)); done"
            ),
        ],
        b"",
    );
    assert_eq!(code, Some(0), "{err}");
    let lines: Vec<&str> = out.lines().collect();
    let bad: Vec<(usize, &&str)> = lines
        .iter()
        .enumerate()
        .filter(|&(i, l)| *l != format!("line {i} of a long output"))
        .collect();
    assert!(
        bad.is_empty() && lines.len() == LINES,
        "{} of {} lines differ, first: {:?}",
        bad.len(),
        lines.len(),
        &bad[..bad.len().min(3)]
    );

    // A request in flight in the template while it is cloned completes in the template;
    // each clone's copy of that connection is reset (it belongs to the parent).
    let sock = vm.sock.clone();
    let long = std::thread::spawn(move || vmm_exec(&sock, &["--", "sleep 4; echo long-done"], b""));
    std::thread::sleep(Duration::from_secs(2));
    const CLONES: usize = 10;
    let (code, body) = vm.api(
        "POST",
        "/clones",
        Some(&format!(r#"{{"count":{CLONES},"console":"null"}}"#)),
    );
    assert_eq!(code, 201, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let clones = v["clones"].as_array().unwrap().clone();
    assert_eq!(clones.len(), CLONES);
    for c in &clones {
        let sock = std::path::PathBuf::from(c["api_sock"].as_str().unwrap());
        let own = format!("{}.vsock", sock.display());
        assert_eq!(c["vsock"], own.as_str(), "{c}");
        // Its own number, its wall clock (set by the agent's `forkvm-clone --adopt` before
        // this first command), and the host can have it reseed its kernel RNG again (no
        // hwrng device here: the drain finds none and succeeds).
        let cmd = "echo id=$(forkvm-clone --id); echo clock=$(forkvm-clone --clock); \
                   forkvm-clone --reseed && echo reseeded";
        let (code, out, err) = vmm_exec(&sock, &["--", cmd], b"");
        assert_eq!(code, Some(0), "clone {}: {err}", c["id"]);
        let id = c["id"].as_str().unwrap();
        assert_eq!(value_after(&out, "id="), Some(id), "{out}");
        assert!(out.ends_with("reseeded\n"), "{out}");
        assert_clock_right(value_after(&out, "clock="), &format!("clone {id}"));
    }
    let (code, out, err) = long.join().unwrap();
    assert_eq!((code, out.as_str()), (Some(0), "long-done\n"), "{err}");

    for c in &clones {
        let (code, _) = vm.api(
            "DELETE",
            &format!("/clones/{}", c["id"].as_str().unwrap()),
            None,
        );
        assert_eq!(code, 200);
    }
    let start = std::time::Instant::now();
    while clones
        .iter()
        .any(|c| std::path::Path::new(c["vsock"].as_str().unwrap()).exists())
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "clone vsock sockets left"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    vm.shutdown(Duration::from_secs(30));
    assert!(!vsock.exists(), "the template's vsock socket was left");
}

#[test]
fn linux_clones_get_their_own_tap_and_reach_their_own_host_peer_only() {
    // Each side lives in its own network namespace the test makes: the template's tap
    // and each clone's (created by the clone's VMM, named in POST /clones) get the same
    // peer address, 10.77.0.1, which only a frame on that very tap can reach.
    if !tests::kvm_and_root_available("linux_clones_net") {
        return;
    }
    let scratch = Scratch::new("linux-net");
    let pid = std::process::id();
    let tap = format!("fkt{}", pid % 100_000_000);
    let ns: Vec<tests::Netns> = (0..3)
        .map(|i| tests::Netns::new(&format!("fkvm-test-{pid}-{i}")))
        .collect();
    // The parent takes its network down once it has shown it works, so nothing it
    // sends can be mistaken for a clone's frame on its tap.
    let ping = "until ping -c1 -W1 10.77.0.1 >/dev/null 2>&1; do sleep 1; done";
    let script = format!(
        "ip link set eth0 up; ip addr add 10.77.0.2/24 dev eth0; {ping}; echo net-up; \
         r=$(forkvm-clone 2); {ping}; echo net-ok-$r; \
         if [ $r = 0 ]; then ip link set eth0 down; echo parent-quiet; sleep 1000000; \
         else reboot -f; fi"
    );
    let vsock = scratch.path("vm.vsock");
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-tap",
        &["--tap", tests::cache::TAP],
        &vsock,
        &["--tap", &tap],
        LINUX_BOOT,
    );
    tests::wait_link(&tap);
    ns[0].take(&tap, "10.77.0.1/24");
    tests::run_on_console(&vm.sock, &script);
    vm.wait_console("net-up", LINUX_BOOT);
    let (_, body) = vm.api("GET", "/vm", None);
    assert!(body.contains(&format!("\"tap\":\"{tap}\"")), "{body}");

    let start = std::time::Instant::now();
    let clones = loop {
        let (_, body) = vm.api("GET", "/clones", None);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let list = v["clones"].as_array().unwrap().clone();
        if list.len() == 2 {
            break list;
        }
        assert!(start.elapsed() < LINUX_BOOT, "no clones: {body}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let mut macs = vec!["06:00:ac:10:00:02".to_string()];
    for (c, ns) in clones.iter().zip(&ns[1..]) {
        let own = c["net"]["tap"].as_str().unwrap();
        assert_eq!(own, format!("fkvm{}", c["pid"]), "{c}");
        tests::wait_link(own);
        ns.take(own, "10.77.0.1/24");
        macs.push(c["net"]["mac"].as_str().unwrap().to_string());
    }
    macs.sort();
    macs.dedup();
    assert_eq!(macs.len(), 3, "every card has its own MAC: {macs:?}");
    vm.wait_console("parent-quiet", LINUX_BOOT);
    let quiet = ns[0].counter(&tap, "rx_packets");
    for c in &clones {
        let k = c["id"].as_str().unwrap();
        let console = c["console"].as_str().unwrap();
        let start = std::time::Instant::now();
        loop {
            let text = std::fs::read_to_string(console).unwrap_or_default();
            if text.contains(&format!("net-ok-{k}")) {
                break;
            }
            assert!(
                start.elapsed() < LINUX_BOOT,
                "clone {k} did not reach its peer: {text}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    assert_eq!(
        ns[0].counter(&tap, "rx_packets"),
        quiet,
        "a clone's frame reached the template's tap"
    );
    // A clone's tap goes with it.
    for (c, ns) in clones.iter().zip(&ns[1..]) {
        let own = c["net"]["tap"].as_str().unwrap();
        let start = std::time::Instant::now();
        loop {
            let (_, body) = vm.api("GET", "/clones", None);
            if !ns.has_link(own) && body.contains("\"exited\"") {
                break;
            }
            assert!(
                start.elapsed() < Duration::from_secs(120),
                "tap {own} of clone {} still there: {body}",
                c["id"]
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    vm.shutdown(Duration::from_secs(30));
}

#[test]
fn linux_clones_take_their_own_mac_and_address_on_a_shared_bridge() {
    // All taps on one bridge (10.78.0.1 on the host side): the template takes the
    // address --ipv4 gives it with `forkvm-clone --net`; two clones made with POST
    // /clones and their own addresses take theirs (and their MACs) through the agent
    // before the first command each runs; then one clone reaches the other and the
    // host, the host knows it at its new MAC, and the bridge learned that MAC on its
    // own tap. Then clone 1's tap is deleted under it.
    if !tests::kvm_and_root_available("linux_clones_net_identity") {
        return;
    }
    let scratch = Scratch::new("linux-netid");
    let pid = std::process::id();
    let tap = format!("fki{}", pid % 100_000_000);
    let ns = tests::Netns::new(&format!("fkvm-test-{pid}-br"));
    ns.add_bridge("10.78.0.1/24", "02:00:0a:4e:00:01");
    let attach = |dev: &str| ns.attach_to_bridge(dev);
    let vsock = scratch.path("vm.vsock");
    let script = "forkvm-clone --net; \
                  until ping -c1 -W1 10.78.0.1 >/dev/null 2>&1; do sleep 1; done; \
                  echo net-up";
    let devices = [
        "--tap",
        tests::cache::TAP,
        "--ipv4",
        "10.78.0.2/24",
        "--gateway",
        "10.78.0.1",
    ];
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-tap-ipv4",
        &devices,
        &vsock,
        &["--tap", &tap],
        LINUX_BOOT,
    );
    tests::wait_link(&tap);
    attach(&tap);
    tests::run_on_console(&vm.sock, script);
    let console = vm.wait_console_line("net-up", LINUX_BOOT);
    assert!(
        console.contains("eth0 06:00:ac:10:00:02 10.78.0.2/24 via 10.78.0.1\n"),
        "the template did not take its address: {console}"
    );
    let (code, _) = vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#));
    assert_eq!(code, 204);
    let (code, body) = vm.api(
        "POST",
        "/clones",
        Some(
            r#"{"count":2,"console":"null","addresses":[
                {"ipv4":"10.78.0.11/24","gateway":"10.78.0.1"},{"ipv4":"10.78.0.12/24"}]}"#,
        ),
    );
    assert_eq!(code, 201, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let clones = v["clones"].as_array().unwrap().clone();
    for (c, addr) in clones.iter().zip(["10.78.0.11/24", "10.78.0.12/24"]) {
        assert_eq!(c["net"]["ipv4"], addr, "{c}");
        let own = c["net"]["tap"].as_str().unwrap();
        tests::wait_link(own);
        attach(own);
    }
    let shows_identity = |c: &serde_json::Value, out: &str| {
        let mac = c["net"]["mac"].as_str().unwrap();
        let addr = c["net"]["ipv4"].as_str().unwrap();
        assert!(
            out.starts_with(&format!("{mac}\n")),
            "clone {} kept another MAC: {out}",
            c["id"]
        );
        assert!(
            out.contains(&format!("inet {addr} ")),
            "clone {} has no {addr}: {out}",
            c["id"]
        );
    };
    let sock = |c: &serde_json::Value| std::path::PathBuf::from(c["api_sock"].as_str().unwrap());
    let show = "cat /sys/class/net/eth0/address; ip addr show dev eth0";
    let (code, out, err) = vmm_exec(&sock(&clones[1]), &["--", show], b"");
    assert_eq!(code, Some(0), "{out}{err}");
    shows_identity(&clones[1], &out);
    let cmd = format!(
        "{show}; ip route; ping -c1 -W5 10.78.0.12 >/dev/null && echo peer-ok; \
         ping -c1 -W5 10.78.0.1 >/dev/null && echo host-ok"
    );
    let (code, out, err) = vmm_exec(&sock(&clones[0]), &["--", &cmd], b"");
    assert_eq!(code, Some(0), "{out}{err}");
    shows_identity(&clones[0], &out);
    assert!(out.contains("default via 10.78.0.1 "), "{out}");
    assert!(
        out.contains("peer-ok\nhost-ok\n"),
        "clone 1 did not reach clone 2 and the host: {out}"
    );
    // The host answered clone 1's ping: its neighbour table has clone 1's address at
    // clone 1's own MAC.
    let (mac, own) = (
        clones[0]["net"]["mac"].as_str().unwrap(),
        clones[0]["net"]["tap"].as_str().unwrap(),
    );
    let neigh = std::process::Command::new("ip")
        .args(["-n", &ns.0, "neigh", "show", "10.78.0.11"])
        .output()
        .unwrap();
    let neigh = String::from_utf8_lossy(&neigh.stdout);
    assert!(
        neigh.contains(&format!("lladdr {mac} ")),
        "the host knows 10.78.0.11 at another MAC: {neigh}"
    );
    let fdb = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.0, "bridge", "fdb", "show", "br", "br0"])
        .output()
        .unwrap();
    let fdb = String::from_utf8_lossy(&fdb.stdout);
    assert!(
        fdb.lines()
            .any(|l| l.starts_with(&format!("{mac} dev {own} "))),
        "the bridge did not learn clone 1's MAC on its tap: {fdb}"
    );
    // Clone 1's tap vanishes behind its back: its frames go nowhere, its VMM says so
    // once and keeps running, and the clone still answers through vsock.
    let own = clones[0]["net"]["tap"].as_str().unwrap();
    ns.ip(&["link", "del", own]);
    let (code, out, err) = vmm_exec(
        &sock(&clones[0]),
        &["--", "ping -c1 -W2 10.78.0.1 >/dev/null; echo ping=$?"],
        b"",
    );
    assert_eq!(code, Some(0), "{out}{err}");
    assert_eq!(value_after(&out, "ping="), Some("1"), "{out}");
    let (code, body) = tests::api_request(&sock(&clones[0]), "GET", "/vm", None);
    assert!(
        code == 200 && body.contains("\"state\":\"running\""),
        "{body}"
    );
    let log = vm.stderr_text();
    assert!(
        log.contains("virtio-net: the tap failed"),
        "no word of the vanished tap: {log}"
    );
    for c in &clones {
        vm.api(
            "DELETE",
            &format!("/clones/{}", c["id"].as_str().unwrap()),
            None,
        );
    }
    // The paused template saved to a snapshot, shut down, and restored on a tap of its
    // own (`vmm restore --tap`): the restored guest keeps its MAC and address and
    // reaches the host through the new tap; the old tap is gone with its VMM.
    let snap = scratch.path("snapshot");
    let (code, body) = vm.snapshot(&snap);
    assert_eq!(code, 201, "{body}");
    vm.shutdown(Duration::from_secs(30));
    assert!(!ns.has_link(&tap), "the template's tap outlived it");
    let restored_scratch = Scratch::new("linux-netid-restored");
    let restored_tap = format!("fkr{}", pid % 100_000_000);
    let restored_vsock = restored_scratch.path("vm.vsock");
    let mut restored = Vm::restore(
        &restored_scratch,
        &snap,
        &[
            "--tap",
            &restored_tap,
            "--vsock",
            restored_vsock.to_str().unwrap(),
        ],
    );
    restored.wait_api(Duration::from_secs(30));
    tests::wait_link(&restored_tap);
    attach(&restored_tap);
    let (code, out, err) = vmm_exec(
        &restored_scratch.path("api.sock"),
        &[
            "--",
            "cat /sys/class/net/eth0/address; ip addr show dev eth0; \
               ping -c1 -W5 10.78.0.1 >/dev/null && echo host-ok; \
               ip -s link show dev eth0; ip route; cat /proc/net/arp; true",
        ],
        b"",
    );
    let diag = || {
        let show = |args: &[&str]| {
            let out = std::process::Command::new("ip")
                .args(args)
                .output()
                .unwrap();
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        format!(
            "{out}{err}\nhost: {}{}{}",
            show(&["-n", &ns.0, "-s", "link", "show", &restored_tap]),
            show(&["-n", &ns.0, "neigh"]),
            show(&["netns", "exec", &ns.0, "bridge", "fdb", "show", "br", "br0"]),
        )
    };
    assert_eq!(code, Some(0), "{}", diag());
    assert!(
        out.starts_with("06:00:ac:10:00:02\n") && out.contains("inet 10.78.0.2/24 "),
        "the restored guest changed its identity: {out}"
    );
    assert!(
        out.contains("\nhost-ok\n"),
        "the restored guest did not reach the host: {}",
        diag()
    );
    assert!(
        ns.counter(&restored_tap, "rx_packets") > 0,
        "no frame of the restored guest on its tap"
    );
    restored.shutdown(Duration::from_secs(30));
    assert!(
        !ns.has_link(&restored_tap),
        "the restored VM's tap outlived it"
    );
}

/// The tx rate limiter's counters of the network card of the VM at `sock` (`GET /vm`).
fn tx_limiter(sock: &str) -> Value {
    tests::net_limiter(Path::new(sock), "tx").expect("a tx limiter")
}

#[test]
fn linux_clone_throughput_holds_the_rate_limit_with_1_and_8_clones_sending() {
    // Every clone of the template sends as fast as its card takes frames, through a card
    // limited to RATE bytes/s each way: ICMP echo requests of 1400 bytes every 10 ms, to
    // a neighbour entered by hand, so that the template is already sending when it
    // pauses and each clone goes on at once, with frames always waiting in its ring (a
    // TCP stream had to connect anew in every clone: 8 clones took 3.5 minutes to all
    // send here, on guest kernels emulated on 2 CPUs). One unlimited guest reaches about
    // 32 KB/s here (its kernel is slow on this host; docs/benchmarks.md), so RATE is well
    // below it even with 8 clones on 2 CPUs. Measured: bytes the clone's frames carried
    // into its tap (the tap's rx_bytes, what the limiter counts) over a window.
    // The bucket holds 4 s of tokens (`bytes=8K/4000`, still 2048 B/s): when the clones
    // streamed TCP, 8 slow guest kernels on 2 CPUs sometimes took over a second to queue
    // the next frame, and a 1-s bucket overflowed and lost those tokens (CI measured
    // 1659-1986 B/s that way); it also absorbs a VMM kept off a CPU for a while.
    const RATE: f64 = 2048.0;
    const BUCKET: u64 = 4 * RATE as u64;
    const WINDOW: Duration = Duration::from_secs(30);
    if !tests::kvm_and_root_available("linux_net_rate") {
        return;
    }
    let scratch = Scratch::new("linux-net-rate");
    let pid = std::process::id();
    let tap = format!("fkr{}", pid % 100_000_000);
    // The template sends too, into its own tap, which has no peer (so the neighbour's
    // address is set by hand, not asked for); each clone takes a tap of its own and goes
    // on sending through it. Its ping ends when the guest's queue is full (ENOBUFS, a
    // thousand frames: minutes at RATE) and starts again 10 s later, while the frames it
    // queued wait.
    let script = "ip link set eth0 up; ip addr add 10.77.0.2/24 dev eth0; \
                  arp -s 10.77.0.1 ff:ff:ff:ff:ff:ff; echo net-configured; \
                  while :; do ping -q -i 0.01 -s 1400 10.77.0.1 >/dev/null 2>&1; sleep 10; done";
    let vsock = scratch.path("vm.vsock");
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-tap-limited",
        &[
            "--tap",
            tests::cache::TAP,
            "--net-rate-limit",
            "bytes=8K/4000",
        ],
        &vsock,
        &["--tap", &tap],
        LINUX_BOOT,
    );
    tests::run_on_console(&vm.sock, script);
    vm.wait_console("net-configured", LINUX_BOOT);
    // Paused while sending: once its tap (up, so that it counts) has had more than its
    // bucket.
    tests::ip(&["link", "set", &tap, "up"]);
    let rx = format!("/sys/class/net/{tap}/statistics/rx_bytes");
    let start = std::time::Instant::now();
    while std::fs::read_to_string(&rx).map_or(0, |s| s.trim().parse::<u64>().unwrap()) <= BUCKET {
        assert!(start.elapsed() < LINUX_BOOT, "the template does not send");
        std::thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
    let ns: Vec<tests::Netns> = (0..8)
        .map(|i| tests::Netns::new(&format!("fkvm-rate-{pid}-{i}")))
        .collect();
    let mut report = Vec::new();
    // One clone alone and eight on 2 CPUs (2 and 4 clones, measured in earlier runs, are
    // in docs/clone-network.md; each round here costs a minute of CI).
    for n in [1usize, 8] {
        let (code, body) = vm.api("POST", "/clones", Some(&format!(r#"{{"count":{n}}}"#)));
        assert_eq!(code, 201, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let clones = v["clones"].as_array().unwrap().clone();
        let taps: Vec<String> = clones
            .iter()
            .map(|c| c["net"]["tap"].as_str().unwrap().to_string())
            .collect();
        for (t, ns) in taps.iter().zip(&ns) {
            tests::wait_link(t);
            ns.take(t, "10.77.0.1/24");
        }
        // Every clone streaming (well past its bucket's first fill), then the window.
        let start = std::time::Instant::now();
        loop {
            let sending = taps
                .iter()
                .zip(&ns)
                .all(|(t, ns)| ns.counter(t, "rx_bytes") > 2 * BUCKET);
            if sending {
                break;
            }
            assert!(
                start.elapsed() < LINUX_BOOT,
                "{n} clones: not all sending: {:?}",
                taps.iter()
                    .zip(&ns)
                    .map(|(t, ns)| ns.counter(t, "rx_bytes"))
                    .collect::<Vec<_>>()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        let socks: Vec<&str> = clones
            .iter()
            .map(|c| c["api_sock"].as_str().unwrap())
            .collect();
        let limiters_before: Vec<Value> = socks.iter().map(|s| tx_limiter(s)).collect();
        // Each clone's tap's rx bytes: what its VMM wrote, past its tx limiter.
        let tap_rx = || -> Vec<u64> {
            taps.iter()
                .zip(&ns)
                .map(|(t, ns)| ns.counter(t, "rx_bytes"))
                .collect()
        };
        let before = tap_rx();
        let t0 = std::time::Instant::now();
        std::thread::sleep(WINDOW);
        let after = tap_rx();
        let secs = t0.elapsed().as_secs_f64();
        let limiters_after: Vec<Value> = socks.iter().map(|s| tx_limiter(s)).collect();
        let tap_end = tap_rx();
        // The tx limiter's own counters (GET /vm): every byte it passed reached the tap
        // (read around the answer), and while a frame waited it lost no token to a
        // worker that came late to its timer. Tokens nobody asked for (the guest slow to
        // queue its next frame) are `unused`.
        for i in 0..taps.len() {
            let (a, b) = (&limiters_after[i], &limiters_before[i]);
            let field = |v: &Value, k: &str| v[k].as_u64().unwrap();
            // Over the window: the tap is read after each limiter, so it may have had a
            // frame or two more at the start (frames a clone sent before its tap was up
            // are counted by its limiter and dropped by the tap, as a wire would).
            let passed = field(a, "passed_bytes") - field(b, "passed_bytes");
            let (low, high) = (after[i] - before[i], tap_end[i] - before[i] + 2 * 1514);
            assert!(
                (low..=high).contains(&passed),
                "{n} clones: clone {i}'s tx limiter passed {passed} bytes over the window, \
                 its tap received {low}..{high}"
            );
            let late = field(a, "late_bytes") - field(b, "late_bytes");
            let unused = field(a, "unused_bytes") - field(b, "unused_bytes");
            eprintln!(
                "{n} clones: clone {i}: limiter passed {passed} B, unused {unused} B, late \
                 {late} B over the window"
            );
            assert!(
                late as f64 <= 0.1 * RATE * secs,
                "{n} clones: clone {i}'s limiter lost {late} bytes of tokens while frames waited"
            );
        }
        let rates: Vec<f64> = before
            .iter()
            .zip(&after)
            .map(|(b, a)| (a - b) as f64 / secs)
            .collect();
        eprintln!("{n} clones: tap rx bytes/s {rates:?}");
        report.push((n, rates.clone()));
        for c in &clones {
            let id = c["id"].as_str().unwrap();
            assert_eq!(vm.api("DELETE", &format!("/clones/{id}"), None).0, 200);
        }
        for (t, ns) in taps.iter().zip(&ns) {
            let start = std::time::Instant::now();
            while ns.has_link(t) {
                assert!(start.elapsed() < Duration::from_secs(60), "tap {t} stays");
                std::thread::sleep(Duration::from_millis(100));
            }
        }
    }
    eprintln!("per-clone tap rx bytes/s with a {RATE} B/s limit: {report:?}");
    // Above the limit and what a full bucket adds is a limiter bug at any count: a clone
    // starved of a CPU for 4 s before the window has a full bucket at its start, which
    // it may spend on top of the rate (CI saw 2275 B/s at 8 clones, 111%, with a 2321 B/s
    // ceiling so), and the counters are read by processes that start late under load
    // (3%). Below it, every clone must reach 90% of it: frames always wait in its queue
    // (when the clones streamed TCP, 8 slow guest kernels on 2 CPUs could not always
    // queue a frame within the bucket's 4 s, and CI measured 1804-2056 B/s).
    let ceiling = 1.03 * RATE + BUCKET as f64 / WINDOW.as_secs_f64();
    for (n, rates) in &report {
        let floor = 0.9;
        for r in rates {
            assert!(
                *r <= ceiling && *r >= floor * RATE,
                "{n} clones: a clone sent {r:.0} B/s with a {RATE} B/s limit \
                 (allowed {:.0}..={ceiling:.0}): {report:?}",
                floor * RATE,
            );
        }
    }
    vm.shutdown(Duration::from_secs(30));
}

#[test]
fn linux_clones_write_their_own_copy_of_each_disk_and_the_images_stay_untouched() {
    // Three disks: /dev/vda and /dev/vdb writable through overlays, /dev/vdc a shared
    // read-only base holding a pattern. The template writes 1 MiB to vda before the
    // clone point; then clone 1 writes 16 MiB of its own pattern (many 1 MiB copy
    // runs of overlay blocks), and the template and clone 2 4 MiB of theirs, over the
    // same sectors, and each reads its range back (forkvm-diskcheck, O_DIRECT, so
    // through the device; about 90 s per 64 MiB each way in this host's slow guest
    // kernel, which is why it is not more); each also writes 1 MiB of its own to vdb
    // after the clone point, reads the base and fails to write it. Each must read its
    // own data and the template's earlier write; the images must stay as they were
    // (all zeros, the base's pattern); vda's overlays must never be visible files, and
    // vdb's (`keep`) must be kept by each VM that ends, not by one killed with SIGKILL.
    if !kvm_available("linux_clones_cow_disk") {
        return;
    }
    let scratch = Scratch::new("linux-cow");
    let image = scratch.path("base.img");
    let size = 72u64 << 20;
    std::fs::File::create(&image)
        .unwrap()
        .set_len(size)
        .unwrap();
    let second = scratch.path("second.img");
    std::fs::File::create(&second)
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    // The base: "base\n" repeated over its first MiB, as forkvm-diskcheck writes it.
    let base = scratch.path("base-ro.img");
    let mut pattern: Vec<u8> = b"base\n".iter().copied().cycle().take(1 << 20).collect();
    pattern.resize(4 << 20, 0);
    std::fs::write(&base, &pattern).unwrap();
    // The images as the snapshot cache's copies (named by their bytes, so every run
    // finds the same cached guest), which must stay as they are too.
    let (image, second, base) = (
        tests::cache::image(&image),
        tests::cache::image(&second),
        tests::cache::image(&base),
    );
    let cow = scratch.path("overlays");
    std::fs::create_dir(&cow).unwrap();
    let script = "forkvm-diskcheck write /dev/vda 64 1 template; \
                  r=$(forkvm-clone 2); if [ $r = 1 ]; then n=16; else n=4; fi; \
                  forkvm-diskcheck write /dev/vda 0 $n clone-$r; \
                  forkvm-diskcheck write /dev/vdb 0 1 second-$r; \
                  echo own-$r=$(forkvm-diskcheck check /dev/vda 0 $n clone-$r); \
                  echo early-$r=$(forkvm-diskcheck check /dev/vda 64 1 template); \
                  echo second-$r=$(forkvm-diskcheck check /dev/vdb 0 1 second-$r); \
                  echo base-$r=$(forkvm-diskcheck check /dev/vdc 0 1 base); \
                  forkvm-diskcheck write /dev/vdc 0 1 x 2>/dev/null; echo rw-$r=$?; \
                  echo done-$r; if [ $r = 1 ]; then reboot -f; else sleep 1000000; fi";
    let cow_arg = format!("{},cow={},keep", second, tests::cache::COW);
    let devices = [
        "--rootfs",
        &image,
        "--rootfs-cow",
        tests::cache::COW,
        "--disk",
        &cow_arg,
        "--disk",
        &base,
    ];
    let vsock = scratch.path("vm.vsock");
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-disks",
        &devices,
        &vsock,
        &["--cow-dir", cow.to_str().unwrap()],
        LINUX_BOOT,
    );
    let (_, body) = vm.api("GET", "/vm", None);
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    let disks: Vec<_> = v["devices"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|d| d["type"] == "virtio-blk")
        .map(|d| {
            (
                d["path"].as_str().unwrap().to_string(),
                d["read_only"] == true,
            )
        })
        .collect();
    assert_eq!(
        disks,
        [
            (image.clone(), false),
            (second.clone(), false),
            (base.clone(), true)
        ],
        "{body}"
    );
    tests::run_on_console(&vm.sock, script);
    let parent = vm.wait_console("done-0", LINUX_BOOT);
    let check = |console: &str, k: &str| {
        for (what, why) in [
            ("second", "read back other data from its second disk"),
            ("base", "did not read the base disk's pattern"),
        ] {
            assert_eq!(
                value_after(console, &format!("{what}-{k}=")),
                Some("ok"),
                "side {k} {why}: {console}"
            );
        }
        let rw = value_after(console, &format!("rw-{k}="));
        assert!(
            rw.is_some_and(|s| s != "0"),
            "side {k} wrote the read-only disk ({rw:?}): {console}"
        );
        assert_eq!(
            value_after(console, &format!("own-{k}=")),
            Some("ok"),
            "side {k} read back other data: {console}"
        );
        assert_eq!(
            value_after(console, &format!("early-{k}=")),
            Some("ok"),
            "side {k} lost the template's write: {console}"
        );
    };
    check(&parent, "0");
    let start = std::time::Instant::now();
    let clones = loop {
        let (_, body) = vm.api("GET", "/clones", None);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let list = v["clones"].as_array().unwrap().clone();
        let done = list.iter().all(|c| {
            std::fs::read_to_string(c["console"].as_str().unwrap())
                .is_ok_and(|t| t.contains(&format!("done-{}", c["id"].as_str().unwrap())))
        });
        if list.len() == 2 && done {
            break list;
        }
        assert!(
            start.elapsed() < LINUX_BOOT,
            "clones did not finish: {body}"
        );
        std::thread::sleep(Duration::from_millis(500));
    };
    for c in &clones {
        let console = std::fs::read_to_string(c["console"].as_str().unwrap()).unwrap();
        check(&console, c["id"].as_str().unwrap());
    }
    // Clone 2 stays up: kill it hard. Clone 1 powered off by itself.
    let two = clones.iter().find(|c| c["id"] == "2").unwrap();
    let pid = two["pid"].as_i64().unwrap() as i32;
    // SAFETY: kill has no memory preconditions; the pid is a clone this test made.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let start = std::time::Instant::now();
    loop {
        let (_, body) = vm.api("GET", "/clones", None);
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        let states: Vec<_> = v["clones"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["status"]["state"].as_str().unwrap_or("").to_string())
            .collect();
        if states.iter().all(|s| s == "exited" || s == "killed") {
            break;
        }
        assert!(start.elapsed() < Duration::from_secs(60), "{body}");
        std::thread::sleep(Duration::from_millis(200));
    }
    // Only vdb keeps its overlay, and not after SIGKILL: clone 1 (which powered off)
    // has kept its own; the template keeps its own once it ends.
    let kept = |pid: i64| {
        let path = cow.join(format!("fkvm{pid}-disk1.overlay"));
        let data = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let blocks = std::fs::read(path.with_extension("blocks")).unwrap();
        (data, blocks)
    };
    let names = |dir: &std::path::Path| {
        let mut n: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        n.sort();
        n
    };
    let one = clones.iter().find(|c| c["id"] == "1").unwrap();
    let one_pid = one["pid"].as_i64().unwrap();
    assert_eq!(
        names(&cow),
        [
            format!("fkvm{one_pid}-disk1.blocks"),
            format!("fkvm{one_pid}-disk1.overlay")
        ]
    );
    let pattern_of =
        |text: &str| -> Vec<u8> { format!("{text}\n").bytes().cycle().take(1 << 20).collect() };
    let (data, blocks) = kept(one_pid);
    assert_eq!(data.len(), 8 << 20);
    assert!(
        data[..1 << 20] == pattern_of("second-1"),
        "clone 1's kept overlay"
    );
    assert_eq!(blocks.len(), 2048 / 8, "one bit per block of 8 MiB");
    assert!(
        blocks[..32].iter().all(|b| *b == 0xff) && blocks[32..].iter().all(|b| *b == 0),
        "clone 1 wrote its first MiB and nothing else: {blocks:?}"
    );
    vm.shutdown(Duration::from_secs(30));
    let template_pid = vm.child.id() as i64;
    assert_eq!(names(&cow).len(), 4, "{:?}", names(&cow));
    let (data, _) = kept(template_pid);
    assert!(
        data[..1 << 20] == pattern_of("second-0"),
        "the template's kept overlay"
    );
    let data = std::fs::read(&image).unwrap();
    assert_eq!(data.len() as u64, size);
    assert!(data.iter().all(|b| *b == 0), "the image was written");
    let data = std::fs::read(&second).unwrap();
    assert!(data.iter().all(|b| *b == 0), "the second image was written");
    assert!(
        std::fs::read(&base).unwrap() == pattern,
        "the base was written"
    );
}

/// A tmpfs mounted for one test, unmounted on drop.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: std::path::PathBuf, size: &str) -> Self {
        std::fs::create_dir_all(&dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "mount tmpfs: {out:?}");
        Self(dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg(&self.0).output();
    }
}

#[test]
fn linux_a_full_overlay_file_system_fails_writes_and_clones_cleanly() {
    // The writable disk's overlays live on a 2 MiB tmpfs. The guest writes 8 MiB: the
    // write fails with an I/O error once the tmpfs is full; overwriting what it did
    // write still works and reads back; asking for a clone fails (the clone's copy of
    // the overlay has no room) with a clear error; the VMM keeps running throughout.
    if !tests::kvm_and_root_available("linux_full_overlay") {
        return;
    }
    let scratch = Scratch::new("linux-full");
    let image = scratch.path("disk.img");
    std::fs::File::create(&image)
        .unwrap()
        .set_len(16 << 20)
        .unwrap();
    let image = tests::cache::image(&image);
    let cow = Tmpfs::mount(scratch.path("cow"), "2m");
    let script = "forkvm-diskcheck write /dev/vda 0 8 big; echo big=$?; \
                  forkvm-diskcheck write /dev/vda 0 1 small; echo small=$?; \
                  echo check=$(forkvm-diskcheck check /dev/vda 0 1 small); \
                  echo clone=$(forkvm-clone 1); echo done; sleep 1000000";
    let vsock = scratch.path("vm.vsock");
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-cow-disk",
        &["--rootfs", &image, "--rootfs-cow", tests::cache::COW],
        &vsock,
        &["--cow-dir", cow.0.to_str().unwrap()],
        LINUX_BOOT,
    );
    tests::run_on_console(&vm.sock, script);
    let console = vm.wait_console("\ndone", LINUX_BOOT);
    assert!(
        value_after(&console, "big=").is_some_and(|v| v != "0"),
        "8 MiB fit in a 2 MiB overlay file system? {console}"
    );
    assert_eq!(value_after(&console, "small="), Some("0"), "{console}");
    assert_eq!(value_after(&console, "check="), Some("ok"), "{console}");
    assert_eq!(value_after(&console, "clone="), Some("failed"), "{console}");
    let (code, body) = vm.api("GET", "/vm", None);
    assert_eq!(code, 200, "{body}");
    assert!(body.contains("\"state\":\"running\""), "{body}");
    let (_, body) = vm.api("GET", "/clones", None);
    assert!(!body.contains("\"running\""), "a clone runs: {body}");
    let log = vm.stderr_text();
    assert!(
        log.contains("a write to the overlay failed") && log.contains("No space left on device"),
        "no warning about the failed write: {log}"
    );
    assert!(
        log.contains("cannot copy the disk overlay for a clone"),
        "no clear error for the clone: {log}"
    );
    vm.shutdown(Duration::from_secs(30));
    drop(cow);
    let data = std::fs::read(&image).unwrap();
    assert!(data.iter().all(|b| *b == 0), "the image was written");
}

/// The figures of one `forkvm-rogue` line: (chains returned, rounds that ended with the
/// device needing a reset).
fn rogue_figures(out: &str) -> (u64, u64) {
    let line = (out.lines())
        .find(|l| l.starts_with("forkvm-rogue: ") && l.contains(" rounds (seed "))
        .unwrap_or_else(|| panic!("no forkvm-rogue figures: {out}"));
    assert!(line.ends_with("reset ok"), "{line}");
    let before = |what: &str| -> u64 {
        let head = line.split_once(what).unwrap_or_else(|| panic!("{line}")).0;
        head.rsplit(' ').next().unwrap().parse().unwrap()
    };
    (
        before(" chains returned"),
        line.split_once("needs-reset after ")
            .and_then(|(_, r)| r.split(' ').next()?.parse().ok())
            .unwrap_or_else(|| panic!("{line}")),
    )
}

/// `out` without the "Segmentation fault" lines of tries that crashed at start-up: a
/// `ping` the PVM host problem (docs/guest-kernel.md, "Known host problems") crashed makes
/// the shell say so and the loop try again; what counts is that a later try reached.
fn without_crashed_tries(out: &str) -> String {
    let crashed = out.lines().filter(|l| *l == "Segmentation fault").count();
    if crashed > 0 {
        eprintln!("warning: {crashed} guest command(s) crashed at start-up (host problem)");
    }
    (out.lines())
        .filter(|l| *l != "Segmentation fault")
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn linux_a_root_process_driving_each_virtio_device_badly_leaves_the_vmm_serving_and_the_devices_working_again(
) {
    // `forkvm-rogue` (guest/tools) takes each device from Linux in turn (disk, entropy,
    // network card, vsock), drives it through /dev/mem with loops, addresses outside memory, absurd
    // lengths and sizes, random registers and never-acknowledged interrupts, resets it
    // and gives it back to Linux's driver, which must then work as before. Its rings and
    // buffers sit in the invocation mailbox, so the guest kernel stays intact.
    if !tests::kvm_and_root_available("linux_rogue_driver") {
        return;
    }
    let scratch = Scratch::new("linux-rogue");
    let neighbour_scratch = Scratch::new("linux-rogue-neighbour");
    let mut neighbour = tests::tiny_vm(&neighbour_scratch, "64", "1", "ticks=1 beat=10");
    // Restored from a cached snapshot of the booted guest with its devices (one vCPU:
    // a cached 2-vCPU guest restored tens of minutes after it was saved stalls (RCU)
    // on the AMD PVM host, docs/snapshots.md, "Not yet"). The disk's overlay and the
    // tap are the restore's own.
    let image = tests::cache::guest_image("rootfs.ext4");
    let vsock = scratch.path("vm.vsock");
    let disk = format!("{image},cow={}", tests::cache::COW);
    let tap = format!("fkg{}", std::process::id() % 100_000_000);
    let mut vm = tests::cache::linux_agent_with(
        &scratch,
        "linux-agent-rogue",
        &[
            "--disk",
            &disk,
            "--rng",
            "--tap",
            tests::cache::TAP,
            "--mailbox-mib",
            "1",
        ],
        &vsock,
        &[
            "--tap",
            &tap,
            "--cow-dir",
            scratch.path("").to_str().unwrap(),
        ],
        LINUX_BOOT,
    );
    let base = |kind: &str| -> String {
        let info = vm.describe();
        let devices = info["devices"].as_array().unwrap();
        let d = devices.iter().find(|d| d["type"] == kind);
        let d = d.unwrap_or_else(|| panic!("no {kind}: {info}"));
        d["mmio_base"].as_str().unwrap().to_string()
    };
    let (blk, rng, vsk) = (base("virtio-blk"), base("virtio-rng"), base("virtio-vsock"));
    let net = base("virtio-net");
    // The card's host peer, in a namespace of the test's own.
    let ns = tests::Netns::new(&format!("fkvm-rogue-{}", std::process::id()));
    tests::wait_link(&tap);
    ns.take(&tap, "10.78.0.1/24");
    let reach = "ip link set eth0 up && ip addr add 10.78.0.2/24 dev eth0 && \
                 for i in 1 2 3; do ping -c1 -W5 10.78.0.1 >/dev/null && echo reached && break; done";
    let (code, out, err) = vmm_exec(&vm.sock, &["--", reach], b"");
    assert_eq!(
        (code, without_crashed_tries(&out)),
        (Some(0), "reached\n".into()),
        "{out}{err}"
    );
    // The seed changes with each run (and is printed): each run tries other sequences.
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let rogue = |base: &str| format!("forkvm-rogue --rounds 25 --seed {seed} --rebind {base}");
    let pid = vm.child.id();
    let counts = || tests::rss_and_fds(pid);
    let (code, _, err) = vmm_exec(&vm.sock, &["--", "umount /mnt/disk"], b"");
    assert_eq!(code, Some(0), "{err}");
    let (rss, fds) = counts();
    let beats = |n: &Vm| n.console_text().matches("tiny: beat ").count();
    let neighbour_beats = beats(&neighbour);

    // `forkvm-rogue` on the device at `base`, then `then` (through Linux's driver again,
    // once `node` is back): its output and figures. Any failure fails the command.
    let rogue_then = |base: &str, node: &str, then: &str| {
        let script = format!(
            "{} && for i in $(seq 50); do [ -e {node} ] && break; sleep 0.1; done && {then}",
            rogue(base)
        );
        let (code, out, err) = vmm_exec(&vm.sock, &["--", &script], b"");
        assert_eq!(code, Some(0), "{out}{err}");
        let figures = rogue_figures(&out);
        (out, figures)
    };
    // The disk: then a write and a read.
    let check =
        "forkvm-diskcheck write /dev/vda 8 1 after && forkvm-diskcheck check /dev/vda 8 1 after";
    let (out, disk) = rogue_then(&blk, "/dev/vda", check);
    assert!(
        out.ends_with("bound to its driver again\nok\nok\n"),
        "{out}"
    );
    // The entropy device: then 64 bytes of /dev/hwrng.
    let read =
        "cat /sys/class/misc/hw_random/rng_current && head -c 64 /dev/hwrng | od -An -v -tx1";
    let (out, entropy) = rogue_then(&rng, "/dev/hwrng", read);
    assert!(out.contains("\nvirtio_rng."), "{out}");
    let random: String = (out.lines().skip_while(|l| !l.starts_with("virtio_rng.")))
        .skip(1)
        .collect();
    assert_eq!(random.split_whitespace().count(), 64, "{out}");
    assert!(random.split_whitespace().any(|b| b != "00"), "{out}");
    // The network card: then the host peer reached (its eth0 is made anew, without an
    // address).
    let (out, card) = rogue_then(&net, "/sys/class/net/eth0", reach);
    assert!(
        without_crashed_tries(&out).ends_with("bound to its driver again\nreached\n"),
        "{out}"
    );
    // vsock carries the agent itself: the rogue runs in the background and writes to the
    // console; then a command goes through Linux's driver again.
    let script = format!(
        "({}; echo forkvm-rogue exit $?) > /dev/console 2>&1 &",
        rogue(&vsk)
    );
    let (code, _, err) = vmm_exec(&vm.sock, &["--", &script], b"");
    assert_eq!(code, Some(0), "{err}");
    let console = vm.wait_console_line("forkvm-rogue exit ", Duration::from_secs(300));
    assert!(console.contains("\nforkvm-rogue exit 0\n"), "{console}");
    let vsock_figures = rogue_figures(&console);
    let (code, out, _) = vmm_exec(&vm.sock, &["--", "echo served-again"], b"");
    assert_eq!((code, out.as_str()), (Some(0), "served-again\n"));

    // Each device did work for the rogue (chains came back), not only refused it.
    let devices = [
        ("disk", disk),
        ("entropy", entropy),
        ("network card", card),
        ("vsock", vsock_figures),
    ];
    for (what, (chains, _)) in devices {
        assert!(chains > 0, "{what}: no chain returned: {console}");
    }
    assert_eq!(vm.describe()["state"], "running");
    let (rss_after, fds_after) = counts();
    let log = vm.stderr_text();
    eprintln!(
        "rogue Linux driver (seed {seed}, 25 rounds per device): chains returned and rounds \
         needing a reset: disk {disk:?}, entropy {entropy:?}, network card {card:?}, vsock \
         {vsock_figures:?}; VMM \
         RSS {rss} -> {rss_after} KiB, fds {fds} -> {fds_after}, {} log lines",
        log.lines().count()
    );
    assert!(
        rss_after < rss + 8 * 1024,
        "RSS grew {rss} -> {rss_after} KiB"
    );
    assert!(fds_after <= fds + 2, "descriptors {fds} -> {fds_after}");
    // The VMM logs each kind of driver error sparingly (the first ten, then powers of two).
    assert!(log.lines().count() < 1000, "{log}");
    assert!(!log.contains("panicked"), "{log}");
    // The neighbour VM went on beating throughout.
    neighbour.wait_console(
        &format!("tiny: beat {}\n", neighbour_beats + 3),
        Duration::from_secs(30),
    );
    // The disk's writes went to its overlay; the image is as it was.
    assert!(
        std::fs::read(&image).unwrap() == std::fs::read(path("rootfs.ext4")).unwrap(),
        "the image was written"
    );
}
