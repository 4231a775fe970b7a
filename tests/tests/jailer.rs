//! The sandbox: a jailed VMM boots the tiny guest and forks clones into pooled cgroups,
//! runs unprivileged with seccomp filters on every thread, cannot open host files
//! outside its jail, and leaves nothing behind; and the filters kill what they do not
//! allow (`seccomp_probe`).
//!
//! The jail tests need root. Without it they skip loudly, and fail under CI.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;
use tests::{api_request, guest_file, jailer_bin, kvm_and_root_available, vmm_bin, Scratch};

const BOOT: Duration = Duration::from_secs(30);
const UID: u32 = 60123;
const GID: u32 = 60124;

/// A jailer running a VMM, with its jail under a scratch directory and its cgroups under
/// a parent unique to the jail (removed by `jailer cleanup` when dropped; tests run in
/// parallel, so a shared parent would kill another test's VMM).
struct Jailed {
    child: Child,
    root: PathBuf,
    parent: String,
    stderr: PathBuf,
}

impl Jailed {
    fn start(scratch: &Scratch, id: &str, files: &[&Path], vmm_args: &[&str]) -> Self {
        Self::start_with(scratch, id, files, &[], vmm_args)
    }

    fn start_with(
        scratch: &Scratch,
        id: &str,
        files: &[&Path],
        jailer_args: &[&str],
        vmm_args: &[&str],
    ) -> Self {
        // Tests run in parallel: two jails with one id would share a jail directory and
        // a cgroup parent, and one's cleanup would kill the other's VMM.
        static IDS: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());
        let mut ids = IDS.lock().unwrap_or_else(|p| p.into_inner());
        assert!(!ids.iter().any(|i| i == id), "jail id {id} used twice");
        ids.push(id.to_string());
        drop(ids);
        let parent = format!("forkvm-test-{id}");
        let base = scratch.path("jails");
        let stderr = scratch.path(&format!("{id}.stderr"));
        let mut cmd = Command::new(jailer_bin());
        cmd.args([
            "--id",
            id,
            "--uid",
            &UID.to_string(),
            "--gid",
            &GID.to_string(),
        ])
        .arg("--exec-file")
        .arg(vmm_bin())
        .arg("--chroot-base")
        .arg(&base)
        .args(["--cgroup-parent", &parent]);
        for f in files {
            cmd.arg("--file").arg(f);
        }
        cmd.args(jailer_args);
        let child = cmd
            .arg("--")
            .args(["--log-level", "info"])
            .args(vmm_args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).unwrap())
            .spawn()
            .expect("spawn jailer");
        Self {
            child,
            root: base.join("vmm").join(id).join("root"),
            parent,
            stderr,
        }
    }

    /// The tiny guest (64 MiB, beat every 20 ms) jailed with `jailer_args`, its clones
    /// in cgroup class `class`; returns once it has printed a heartbeat.
    fn tiny(scratch: &Scratch, id: &str, jailer_args: &[&str], class: &str) -> Self {
        Self::tiny_with(scratch, id, jailer_args, &["--cgroup-class", class])
    }

    /// As [`Jailed::tiny`], with `vmm_args` added to `vmm run`'s instead of a class.
    fn tiny_with(scratch: &Scratch, id: &str, jailer_args: &[&str], vmm_args: &[&str]) -> Self {
        let tiny = guest_file("tiny.elf");
        let mut args = vec![
            "run",
            "--kernel",
            "/tiny.elf",
            "--mem-mib",
            "64",
            "--ap-boot",
            "direct",
            "--cmdline",
            "beat=20",
            "--console",
            "/console",
            "--api-sock",
            "/api.sock",
        ];
        args.extend_from_slice(vmm_args);
        let mut jail = Self::start_with(scratch, id, &[&tiny], jailer_args, &args);
        jail.wait_file("console", "tiny: beat 1\n");
        jail
    }

    fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    fn wait_file(&mut self, rel: &str, needle: &str) -> String {
        let path = self.root.join(rel);
        let start = Instant::now();
        loop {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            if text.contains(needle) {
                return text;
            }
            if let Some(s) = self.child.try_wait().unwrap() {
                panic!(
                    "jailer exited ({s}) before {rel} showed {needle:?}:\n{}",
                    self.stderr_text()
                );
            }
            assert!(
                start.elapsed() < BOOT,
                "{rel} never showed {needle:?}:\n{text}\n{}",
                self.stderr_text()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn api(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        api_request(&self.root.join("api.sock"), method, path, body)
    }

    fn wait_exit(&mut self, timeout: Duration) -> std::process::ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            if start.elapsed() > timeout {
                let _ = self.child.kill();
                panic!(
                    "jailer did not exit in {timeout:?}:\n{}",
                    self.stderr_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The VMM's host pid: the jailer's only child.
    fn vmm_pid(&self) -> i32 {
        let pid = self.child.id();
        let children =
            std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
        children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .expect("the jailer has a child")
    }
}

impl Drop for Jailed {
    fn drop(&mut self) {
        // A failed test leaves the jail running: stop it the way a user would (the
        // jailer then cleans up), and kill it only if that does not work.
        if self.child.try_wait().ok().flatten().is_none() {
            // SAFETY: signals our own child process.
            unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
            let start = Instant::now();
            while self.child.try_wait().ok().flatten().is_none() {
                if start.elapsed() > Duration::from_secs(10) {
                    let _ = self.child.kill();
                    let _ = self.child.wait();
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let _ = Command::new(jailer_bin())
            .args(["cleanup", "--cgroup-parent", &self.parent])
            .stdout(Stdio::null())
            .status();
    }
}

/// `Key:\tvalue` from /proc/<pid>/status (or a task's).
fn status_field(status_path: &str, key: &str) -> String {
    let text = std::fs::read_to_string(status_path).unwrap_or_default();
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{key}:")))
        .map(|v| v.trim().to_string())
        .unwrap_or_else(|| panic!("{status_path} has no {key}"))
}

/// Checks a jailed process: unprivileged, no capabilities, no_new_privs, pid 1.. in its
/// own namespace, and every thread under a seccomp filter. Returns (thread name, number
/// of stacked filters) per thread.
fn assert_confined(pid: i32) -> Vec<(String, u32)> {
    let status = format!("/proc/{pid}/status");
    assert_eq!(
        status_field(&status, "Uid"),
        format!("{UID}\t{UID}\t{UID}\t{UID}")
    );
    assert_eq!(
        status_field(&status, "Gid"),
        format!("{GID}\t{GID}\t{GID}\t{GID}")
    );
    assert_eq!(status_field(&status, "CapEff"), "0000000000000000");
    assert_eq!(status_field(&status, "CapPrm"), "0000000000000000");
    assert_eq!(status_field(&status, "NoNewPrivs"), "1");
    let nspid = status_field(&status, "NSpid");
    assert_eq!(
        nspid.split_whitespace().count(),
        2,
        "not in a pid namespace: {nspid}"
    );
    // What the process sees as / is its jail: no host /etc, no host checkout.
    let root = PathBuf::from(format!("/proc/{pid}/root"));
    assert!(root.join("dev/kvm").exists());
    assert!(!root.join("etc").exists(), "host /etc visible in the jail");
    assert!(!root.join("work").exists() && !root.join("tmp").exists());
    let limits = std::fs::read_to_string(format!("/proc/{pid}/limits")).unwrap();
    assert!(
        limits
            .lines()
            .any(|l| l.starts_with("Max open files") && l.contains(" 2048 ")),
        "{limits}"
    );
    let mut threads = Vec::new();
    for t in std::fs::read_dir(format!("/proc/{pid}/task")).unwrap() {
        let t = t.unwrap().path();
        let st = format!("{}/status", t.display());
        let name = status_field(&st, "Name");
        // KVM's own worker (kvm-nx-lpage-recovery) lives in the process but never runs
        // user code; every thread of forkvm's must be filtered.
        if name.starts_with("kvm-") {
            continue;
        }
        assert_eq!(
            status_field(&st, "Seccomp"),
            "2",
            "thread {name} has no filter"
        );
        threads.push((name, status_field(&st, "Seccomp_filters").parse().unwrap()));
    }
    threads.sort();
    threads
}

fn v1_cgroup_dir(parent: &str, id: &str, rel: &str, controller: &str) -> PathBuf {
    Path::new("/sys/fs/cgroup")
        .join(controller)
        .join(parent)
        .join(format!("jail-{id}"))
        .join(rel)
}

#[test]
fn a_jailed_vmm_boots_forks_clones_into_pooled_cgroups_and_leaves_nothing() {
    if !kvm_and_root_available(
        "a_jailed_vmm_boots_forks_clones_into_pooled_cgroups_and_leaves_nothing",
    ) {
        return;
    }
    let scratch = Scratch::new("jail");
    let id = format!("jt-{}", std::process::id());
    let mut jail = Jailed::tiny(&scratch, &id, &[], "small:memory=64M,pids=64");
    let vmm = jail.vmm_pid();
    let threads = assert_confined(vmm);
    // One filter per thread: the api and vCPU threads started before the main thread
    // installed its own.
    let names: Vec<&str> = threads.iter().map(|(n, _)| n.as_str()).collect();
    assert!(
        names.contains(&"api") && names.contains(&"vcpu0"),
        "{threads:?}"
    );
    for (name, n) in &threads {
        let want = match name.as_str() {
            "vmm" | "api" => 1,
            v if v.starts_with("vcpu") => 1,
            _ => continue,
        };
        assert_eq!(*n, want, "{name}: {n} filters");
    }
    // The VMM sits in the jail's leaf cgroup, in cgroup, mount and pid namespaces of
    // its own (it sees the jail's cgroup as its root).
    let self_cg = std::fs::read_to_string(format!("/proc/{vmm}/cgroup")).unwrap();
    let leaf = format!("/{}/jail-{id}/vmm", jail.parent);
    for c in ["memory", "pids", "cpuacct"] {
        assert!(self_cg.contains(&format!(":{c}:{leaf}\n")), "{self_cg}");
    }
    for ns in ["cgroup", "mnt", "pid"] {
        let theirs = std::fs::read_link(format!("/proc/{vmm}/ns/{ns}")).unwrap();
        let ours = std::fs::read_link(format!("/proc/self/ns/{ns}")).unwrap();
        assert_ne!(theirs, ours, "{ns} namespace shared with the host");
    }

    let (code, body) = jail.api("POST", "/clones", Some(r#"{"count": 2}"#));
    assert_eq!(code, 201, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let clones = v["clones"].as_array().unwrap().clone();
    assert_eq!(clones.len(), 2);
    for c in &clones {
        // Paths the VMM reports are the jail's; the host finds them under the root.
        let console = c["console"]
            .as_str()
            .unwrap()
            .trim_start_matches('/')
            .to_string();
        jail.wait_file(&console, "tiny: beat");
        let cg = c["cgroup"]["path"].as_str().unwrap();
        assert!(cg.starts_with("forkvm/vmm-1/small-"), "{cg}");
        let mem = v1_cgroup_dir(&jail.parent, &id, cg, "memory");
        let limit = std::fs::read_to_string(mem.join("memory.limit_in_bytes")).unwrap();
        assert_eq!(limit.trim(), (64u64 << 20).to_string());
        let procs = std::fs::read_to_string(mem.join("cgroup.procs")).unwrap();
        let host_pid: i32 = procs.split_whitespace().next().unwrap().parse().unwrap();
        // The clone is confined like its template, and its vCPU threads stack their
        // filter on the VMM filter it was forked with.
        for (name, n) in assert_confined(host_pid) {
            let want = match name.as_str() {
                "vmm" => 1,
                "api" => 2,
                v if v.starts_with("vcpu") => 2,
                _ => continue,
            };
            assert_eq!(n, want, "clone thread {name}: {n} filters");
        }
        let nspid = status_field(&format!("/proc/{host_pid}/status"), "NSpid");
        assert_eq!(
            nspid.split_whitespace().nth(1),
            Some(c["pid"].to_string().as_str()),
            "the API reports the pid inside the jail"
        );
    }
    // A clone of a clone works inside the jail too.
    let sock1 = clones[0]["api_sock"]
        .as_str()
        .unwrap()
        .trim_start_matches('/');
    let (code, body) = api_request(&jail.root.join(sock1), "POST", "/clones", None);
    assert_eq!(code, 201, "{body}");

    let (code, _) = jail.api("PUT", "/actions", Some(r#"{"action_type":"shutdown"}"#));
    assert_eq!(code, 204);
    let status = jail.wait_exit(BOOT);
    assert!(status.success(), "{status}:\n{}", jail.stderr_text());
    assert!(!jail.root.exists(), "jail directory left behind");
    for c in ["cpu", "cpuacct", "memory", "pids"] {
        let dir = Path::new("/sys/fs/cgroup").join(c).join(&jail.parent);
        assert!(!dir.exists(), "{} left behind", dir.display());
    }
    assert!(
        !Path::new(&format!("/proc/{vmm}")).exists(),
        "the VMM outlived its jailer"
    );
}

/// A network namespace made with `ip netns add`, deleted on drop.
struct Netns(String);

impl Netns {
    fn new(name: &str) -> Self {
        let ok = Command::new("ip").args(["netns", "add", name]).status();
        assert!(ok.is_ok_and(|s| s.success()), "ip netns add {name} failed");
        Self(name.to_string())
    }

    fn path(&self) -> String {
        format!("/var/run/netns/{}", self.0)
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "delete", &self.0])
            .status();
    }
}

/// The host's cgroup v2 mount (unified-only hosts: /sys/fs/cgroup; hybrid: .../unified).
fn v2_mount() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").unwrap_or_default();
    mounts.lines().find_map(|l| {
        let f: Vec<&str> = l.split_whitespace().collect();
        (f.len() > 2 && f[2] == "cgroup2").then(|| PathBuf::from(f[1]))
    })
}

#[test]
fn a_jailed_vmm_on_cgroup_v2_forks_clones_with_clone3_and_stops_on_sigterm() {
    let test = "a_jailed_vmm_on_cgroup_v2_forks_clones_with_clone3_and_stops_on_sigterm";
    if !kvm_and_root_available(test) {
        return;
    }
    let Some(v2) = v2_mount() else {
        tests::require(test, false, "no cgroup2 mount");
        return;
    };
    let scratch = Scratch::new("jail-v2");
    let id = format!("j2-{}", std::process::id());
    // In a network namespace of its own, made for this test.
    let netns = Netns::new(&format!("forkvm-{id}"));
    let mut jail = Jailed::tiny(
        &scratch,
        &id,
        &["--cgroup-version", "2", "--netns", &netns.path()],
        "plain",
    );
    let vmm = jail.vmm_pid();
    assert_confined(vmm);
    let ns_of = |p: &str| std::fs::metadata(p).map(|m| std::os::unix::fs::MetadataExt::ino(&m));
    assert_eq!(
        ns_of(&format!("/proc/{vmm}/ns/net")).unwrap(),
        ns_of(&netns.path()).unwrap(),
        "the VMM is not in the given network namespace"
    );
    let (code, body) = jail.api("POST", "/clones", None);
    assert_eq!(code, 201, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let c = &v["clones"][0];
    assert_eq!(c["cgroup"]["placed_by"], "clone3", "{c}");
    let cg = v2
        .join(&jail.parent)
        .join(format!("jail-{id}"))
        .join(c["cgroup"]["path"].as_str().unwrap());
    let procs = std::fs::read_to_string(cg.join("cgroup.procs")).unwrap();
    let host_pid: i32 = procs
        .split_whitespace()
        .next()
        .expect("clone in its cgroup")
        .parse()
        .unwrap();
    assert_confined(host_pid);
    // SIGTERM to the jailer reaches the VMM, which shuts down (exit 128 + 15) and takes
    // its clone with it; the jailer then removes everything.
    // SAFETY: signals our own child process.
    unsafe { libc::kill(jail.child.id() as i32, libc::SIGTERM) };
    let status = jail.wait_exit(BOOT);
    assert_eq!(status.code(), Some(143), "{}", jail.stderr_text());
    assert!(!jail.root.exists(), "jail directory left behind");
    assert!(!v2.join(&jail.parent).exists(), "v2 cgroups left behind");
    for pid in [vmm, host_pid] {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "{pid} outlived the jail"
        );
    }
}

#[test]
fn a_jailed_vmms_clones_use_taps_handed_in_and_cannot_create_their_own() {
    // The jailed VMM has no CAP_NET_ADMIN: it can attach to taps its user owns, which
    // the host made in its network namespace, and cannot create one. Its card is on such
    // a tap; a clone handed another (POST /clones taps) runs on it; a clone that has to
    // create its own fails with a clear error, and the VMM goes on.
    let test = "a_jailed_vmms_clones_use_taps_handed_in_and_cannot_create_their_own";
    if !kvm_and_root_available(test) {
        return;
    }
    let scratch = Scratch::new("jail-tap");
    let id = format!("jn-{}", std::process::id());
    let netns = Netns::new(&format!("forkvm-{id}"));
    for tap in ["fkj0", "fkj1"] {
        let ok = Command::new("ip")
            .args(["-n", &netns.0, "tuntap", "add", tap, "mode", "tap", "user"])
            .arg(UID.to_string())
            .arg("group")
            .arg(GID.to_string())
            .status();
        assert!(ok.is_ok_and(|s| s.success()), "ip tuntap add {tap}");
    }
    let mut jail = Jailed::tiny_with(
        &scratch,
        &id,
        &["--netns", &netns.path()],
        &["--tap", "fkj0"],
    );
    let (code, body) = jail.api("POST", "/clones", Some(r#"{"taps":["fkj1"]}"#));
    assert_eq!(code, 201, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let c = &v["clones"][0];
    assert_eq!(c["net"]["tap"], "fkj1", "{c}");
    assert_eq!(c["status"]["state"], "running", "{c}");
    // The tap is busy while that clone holds it: a second clone on it fails, and the
    // request (none of whose clones started) says why.
    let (code, body) = jail.api("POST", "/clones", Some(r#"{"taps":["fkj1"]}"#));
    assert_eq!(code, 500, "{body}");
    assert!(body.contains(r#"cannot attach to tap \"fkj1\""#), "{body}");
    let (code, body) = jail.api("POST", "/clones", None);
    assert_eq!(code, 500, "{body}");
    assert!(body.contains(r#"cannot attach to tap \"fkvm"#), "{body}");
    // A failed clone prints why as it exits, after the parent has seen it fail.
    let start = Instant::now();
    loop {
        let log = jail.stderr_text();
        if log.contains(r#"cannot attach to tap "fkj1""#)
            && log.contains(r#"cannot attach to tap "fkvm"#)
        {
            break;
        }
        assert!(start.elapsed() < BOOT, "{log}");
        std::thread::sleep(Duration::from_millis(50));
    }
    let (code, body) = jail.api("GET", "/vm", None);
    assert!(
        code == 200 && body.contains(r#""state":"running""#),
        "{body}"
    );
    // SAFETY: signals our own child process.
    unsafe { libc::kill(jail.child.id() as i32, libc::SIGTERM) };
    let status = jail.wait_exit(BOOT);
    assert_eq!(status.code(), Some(143), "{}", jail.stderr_text());
    // Taps the host made stay (persistent); the host removes them with the namespace.
    let links = Command::new("ip")
        .args(["-n", &netns.0, "link", "show", "fkj1"])
        .status()
        .unwrap();
    assert!(links.success(), "a handed-in tap was removed");
}

#[test]
fn a_jailed_vmm_cannot_open_host_files_and_bad_jails_are_refused() {
    if !kvm_and_root_available("a_jailed_vmm_cannot_open_host_files_and_bad_jails_are_refused") {
        return;
    }
    let scratch = Scratch::new("jail-host");
    let tiny = guest_file("tiny.elf");
    let host_path = tiny.display().to_string();
    // The same kernel by its host path: outside the jail it does not exist.
    let id = format!("jh-{}", std::process::id());
    let mut jail = Jailed::start(
        &scratch,
        &id,
        &[],
        &["run", "--kernel", &host_path, "--console", "null"],
    );
    let status = jail.wait_exit(BOOT);
    assert!(!status.success());
    let err = jail.stderr_text();
    assert!(
        err.contains(&host_path) && err.contains("No such file"),
        "expected the VMM to fail to open {host_path}:\n{err}"
    );
    assert!(!jail.root.exists());

    // Refused before anything is made, with a message naming the problem.
    let base = scratch.path("jails");
    let refused = |args: &str| -> String {
        let out = Command::new(jailer_bin())
            .args(args.split_whitespace())
            .arg("--exec-file")
            .arg(vmm_bin())
            .arg("--chroot-base")
            .arg(&base)
            .args(["--", "run", "--kernel", "/x"])
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args} accepted");
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    for (args, want) in [
        ("--id bad/id --uid 1 --gid 1", "jail id"),
        ("--id ok --uid 0 --gid 1", "must not be 0"),
        (
            "--id ok --uid 1 --gid 1 --file /nonexistent-forkvm",
            "no such file",
        ),
        (
            "--id ok --uid 1 --gid 1 --file /etc/hostname:../x",
            "must be absolute",
        ),
    ] {
        let err = refused(args);
        assert!(err.contains(want), "{args}: {err}");
        assert!(!base.join("vmm").exists(), "{args} left a jail directory");
    }
    // A jail id in use is refused, and the existing directory is left alone.
    let busy = base.join("vmm").join("busy");
    std::fs::create_dir_all(&busy).unwrap();
    assert!(refused("--id busy --uid 1 --gid 1").contains("exists"));
    assert!(busy.exists());
}

fn probe(args: &str) -> (Option<i32>, Option<i32>, String) {
    use std::os::unix::process::ExitStatusExt;
    let out = Command::new(env!("CARGO_BIN_EXE_seccomp_probe"))
        .args(args.split_whitespace())
        .output()
        .unwrap();
    (
        out.status.code(),
        out.status.signal(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn a_syscall_outside_the_filter_kills_the_process_or_thread() {
    // Allowed calls run.
    let (code, _, out) = probe("api kill getpid main");
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("getpid returned") && out.contains("main survived"));
    // socket() is not the API thread's at all; vCPUs and device workers may make Unix
    // sockets only (vsock's host connections), nothing else.
    for (kind, call) in [
        ("api", "socket"),
        ("vcpu", "inet-socket"),
        ("device", "inet-socket"),
    ] {
        let (code, sig, out) = probe(&format!("{kind} kill {call} main"));
        assert_eq!((code, sig), (None, Some(libc::SIGSYS)), "{kind}: {out}");
        assert!(!out.contains("main survived"));
    }
    let (code, _, out) = probe("device kill socket main");
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("socket returned 3"), "{out}");
    // The VMM thread may make any socket (control sockets of clones).
    let (code, _, out) = probe("vmm kill inet-socket main");
    assert_eq!(code, Some(0), "{out}");
    // kill-thread: the thread dies, the process goes on.
    let (code, _, out) = probe("device kill-thread inet-socket thread");
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains("thread gone") && out.contains("main survived"),
        "{out}"
    );
    assert!(!out.contains("socket returned"), "{out}");
    // log: allowed, only logged.
    let (code, _, out) = probe("api log socket main");
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("socket returned 3"), "{out}");
    // Threads other than the VMM's see ENOSYS for clone3 (so glibc falls back to
    // clone, whose flags the filter checks) and are not killed for it.
    let (code, _, out) = probe("vcpu kill clone3 thread");
    assert_eq!(code, Some(0), "{out}");
    assert!(
        out.contains(&format!("clone3 returned -1 errno {}", libc::ENOSYS)),
        "{out}"
    );
    assert!(out.contains("thread finished"), "{out}");
    // A fatal error glibc detects (here a double free) is reported on stderr under
    // every filter and ends the process with SIGABRT: not a silent SIGSYS for opening
    // /dev/tty or calling writev.
    for kind in ["vmm", "api", "vcpu", "device"] {
        let (code, sig, out) = probe(&format!("{kind} kill glibc-fatal thread"));
        assert_eq!((code, sig), (None, Some(libc::SIGABRT)), "{kind}: {out}");
        assert!(out.contains("double free"), "{kind}: {out}");
    }
    // A thread that frees the top of its heap: glibc would open a /proc file to decide
    // how to shrink it (a virtio-blk worker died of that at the end of a VM); prepared
    // as the VMM prepares it, it never shrinks a thread's heap.
    let (code, sig, out) = probe("device kill heap-trim-unprepared thread");
    assert_eq!((code, sig), (None, Some(libc::SIGSYS)), "{out}");
    for kind in ["api", "vcpu", "device"] {
        let (code, _, out) = probe(&format!("{kind} kill heap-trim thread"));
        assert_eq!(code, Some(0), "{kind}: {out}");
        assert!(out.contains("thread finished"), "{kind}: {out}");
    }
    // Many threads allocating at once (a VM with eight disk slots has eight device
    // threads): past 8 arenas glibc would read /sys to size its limit; prepared, the
    // limit is set.
    let (code, sig, out) = probe("device kill arenas-unprepared thread");
    assert_eq!((code, sig), (None, Some(libc::SIGSYS)), "{out}");
    let (code, _, out) = probe("device kill arenas thread");
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("thread finished"), "{out}");
}
