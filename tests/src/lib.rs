//! Shared helpers for forkvm's integration tests (in `tests/tests/`), which boot real
//! guests with the `vmm` binary.
//!
//! KVM tests skip with a loud message where /dev/kvm is absent, and fail instead when the
//! `CI` environment variable is set.

use std::io::{Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub mod cache;
pub mod nfs;
pub mod oci;
pub mod wheels;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ has a parent")
        .to_path_buf()
}

/// A guest artifact from `target/guest/` (built by `make guest`).
pub fn guest_file(name: &str) -> PathBuf {
    let p = repo_root().join("target/guest").join(name);
    assert!(
        p.exists(),
        "{} is missing: build the guest images first (make guest)",
        p.display()
    );
    p
}

/// The `vmm` binary of the same build profile as this test.
pub fn vmm_bin() -> PathBuf {
    workspace_bin("vmm")
}

/// The `jailer` binary of the same build profile as this test.
pub fn jailer_bin() -> PathBuf {
    workspace_bin("jailer")
}

/// A binary of this workspace, of the same build profile as this test.
pub fn workspace_bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // target/<profile>/deps/<test> -> target/<profile>/<name>
    let bin = exe
        .parent()
        .and_then(Path::parent)
        .expect("target dir")
        .join(name);
    assert!(
        bin.exists(),
        "{} is missing: build it first (cargo build --workspace --bins)",
        bin.display()
    );
    bin
}

/// Whether `test` can run, given that what it needs is `present`: without it, a loud
/// skip naming `missing`, or a failure under CI (where every test must run).
pub fn require(test: &str, present: bool, missing: &str) -> bool {
    if !present {
        assert!(
            std::env::var_os("CI").is_none(),
            "{test}: {missing}, and CI is set: every test must run in CI"
        );
        eprintln!("\n*** SKIPPED {test}: {missing} ***\n");
    }
    present
}

/// Whether KVM tests can run. Without /dev/kvm: a loud skip, or a failure under CI.
pub fn kvm_available(test: &str) -> bool {
    let ok = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_ok();
    require(test, ok, "/dev/kvm is not usable on this machine")
}

/// Whether tests that need KVM and root (cgroups, jails) can run: a loud skip without
/// either, a failure under CI.
pub fn kvm_and_root_available(test: &str) -> bool {
    // SAFETY: geteuid has no preconditions.
    kvm_available(test) && require(test, unsafe { libc::geteuid() } == 0, "it needs root")
}

/// A unique scratch directory for one test, removed on drop.
pub struct Scratch(PathBuf);

impl Scratch {
    /// Creates `/tmp/forkvm-test-<name>-<pid>-<n>`.
    pub fn new(name: &str) -> Self {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let p = std::env::temp_dir().join(format!("forkvm-test-{name}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).expect("scratch dir");
        Self(p)
    }

    /// A path inside the scratch directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A network namespace made for one test (`ip netns add`), deleted on drop.
pub struct Netns(pub String);

impl Netns {
    /// Creates namespace `name` with its loopback up.
    pub fn new(name: &str) -> Self {
        let _ = Command::new("ip").args(["netns", "del", name]).output();
        ip(&["netns", "add", name]);
        let ns = Self(name.to_string());
        ns.ip(&["link", "set", "lo", "up"]);
        ns
    }

    /// Runs `ip -n NS ARGS` and asserts it succeeded.
    pub fn ip(&self, args: &[&str]) {
        let mut all = vec!["-n", &self.0];
        all.extend_from_slice(args);
        ip(&all);
    }

    /// Moves host interface `dev` (a tap) into this namespace, gives it `addr` (CIDR)
    /// and brings it up.
    pub fn take(&self, dev: &str, addr: &str) {
        ip(&["link", "set", dev, "netns", &self.0]);
        self.ip(&["addr", "add", addr, "dev", dev]);
        self.ip(&["link", "set", dev, "up"]);
    }

    /// Adds bridge `br0` with address `addr` (CIDR) for the host side and brings it up.
    /// It gets the fixed MAC `mac`: a bridge's own otherwise follows its lowest port's,
    /// which changes as clone taps come and go while guests keep the old one in their
    /// ARP caches (docs/clone-network.md).
    pub fn add_bridge(&self, addr: &str, mac: &str) {
        self.ip(&["link", "add", "br0", "address", mac, "type", "bridge"]);
        self.ip(&["addr", "add", addr, "dev", "br0"]);
        self.ip(&["link", "set", "br0", "up"]);
    }

    /// Moves host interface `dev` (a tap) into this namespace, onto `br0`, and up.
    pub fn attach_to_bridge(&self, dev: &str) {
        ip(&["link", "set", dev, "netns", &self.0]);
        self.bridge_port(dev);
    }

    /// Puts interface `dev` of this namespace onto `br0`, and up.
    pub fn bridge_port(&self, dev: &str) {
        self.ip(&["link", "set", dev, "master", "br0"]);
        self.ip(&["link", "set", dev, "up"]);
    }

    /// Makes `cmd` run in this namespace (`setns` between fork and exec): a VMM started
    /// so creates its taps here, and opens taps made here by name.
    pub fn enter_on_exec(&self, cmd: &mut Command) {
        use std::os::unix::io::AsRawFd;
        use std::os::unix::process::CommandExt;
        let ns = std::fs::File::open(format!("/run/netns/{}", self.0)).expect("netns file");
        // SAFETY: the closure runs in the forked child before exec and only calls
        // setns(2), which is async-signal-safe, on a descriptor it owns (moved in).
        unsafe {
            cmd.pre_exec(move || {
                if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
    }

    /// Creates tap `dev` in this namespace, on `br0`, and up (a tap handed to a clone).
    pub fn add_tap_on_bridge(&self, dev: &str) {
        self.ip(&["tuntap", "add", dev, "mode", "tap"]);
        self.bridge_port(dev);
    }

    /// Whether interface `dev` is in this namespace.
    pub fn has_link(&self, dev: &str) -> bool {
        Command::new("ip")
            .args(["-n", &self.0, "link", "show", dev])
            .output()
            .expect("ip")
            .status
            .success()
    }

    /// A counter of `dev` in this namespace (`rx_packets`, `tx_bytes`, ...).
    pub fn counter(&self, dev: &str, name: &str) -> u64 {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.0, "cat"])
            .arg(format!("/sys/class/net/{dev}/statistics/{name}"))
            .output()
            .expect("ip netns exec");
        String::from_utf8_lossy(&out.stdout)
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("{dev} {name} in {}: {out:?}", self.0))
    }
}

impl Drop for Netns {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).output();
    }
}

/// Runs `ip ARGS` and asserts it succeeded.
pub fn ip(args: &[&str]) {
    let out = Command::new("ip").args(args).output().expect("ip");
    assert!(out.status.success(), "ip {args:?}: {out:?}");
}

/// Whether host interface `dev` exists (in this namespace).
pub fn link_exists(dev: &str) -> bool {
    Path::new("/sys/class/net").join(dev).exists()
}

/// Waits up to 30 s for host interface `dev` (a VMM's new tap) to appear.
pub fn wait_link(dev: &str) {
    let start = Instant::now();
    while !link_exists(dev) {
        assert!(start.elapsed() < Duration::from_secs(30), "no tap {dev}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// A `vmm run` process whose console goes to a file.
pub struct Vm {
    /// The child process.
    pub child: Child,
    /// Console file.
    pub console: PathBuf,
    /// Control socket.
    pub sock: PathBuf,
    /// Captured stderr file.
    pub stderr: PathBuf,
}

impl Vm {
    /// Starts `vmm run ARGS --console <scratch>/console --api-sock <scratch>/api.sock`.
    pub fn start(scratch: &Scratch, args: &[&str]) -> Vm {
        let sock = scratch.path("api.sock");
        Self::start_at(scratch, &sock, &scratch.path("console"), args, |_| {})
    }

    /// Starts `vmm run ARGS --console CONSOLE --api-sock SOCK` (its log in
    /// `<scratch>/stderr`), after `prepare` had its say on the command (limits, say).
    pub fn start_at(
        scratch: &Scratch,
        sock: &Path,
        console: &Path,
        args: &[&str],
        prepare: impl FnOnce(&mut Command),
    ) -> Vm {
        Self::spawn(scratch, "run", sock, console, args, prepare)
    }

    /// Starts `vmm restore --dir DIR ARGS --console <scratch>/console --api-sock
    /// <scratch>/api.sock` (a VM from a snapshot).
    pub fn restore(scratch: &Scratch, dir: &Path, args: &[&str]) -> Vm {
        let sock = scratch.path("api.sock");
        let mut all = vec!["--dir", dir.to_str().expect("UTF-8 path")];
        all.extend_from_slice(args);
        Self::spawn(
            scratch,
            "restore",
            &sock,
            &scratch.path("console"),
            &all,
            |_| {},
        )
    }

    /// Starts `vmm SUBCOMMAND ARGS --console CONSOLE --api-sock SOCK`.
    fn spawn(
        scratch: &Scratch,
        subcommand: &str,
        sock: &Path,
        console: &Path,
        args: &[&str],
        prepare: impl FnOnce(&mut Command),
    ) -> Vm {
        let stderr = scratch.path("stderr");
        let mut cmd = Command::new(vmm_bin());
        // FORKVM_TEST_LOG_LEVEL=debug for a closer look at a failing test.
        let level = std::env::var("FORKVM_TEST_LOG_LEVEL").unwrap_or_else(|_| "info".into());
        cmd.arg("--log-level")
            .arg(level)
            .arg(subcommand)
            .args(args)
            .arg("--console")
            .arg(console)
            .arg("--api-sock")
            .arg(sock)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&stderr).expect("stderr file"));
        prepare(&mut cmd);
        Vm {
            child: cmd.spawn().expect("spawn vmm"),
            console: console.to_path_buf(),
            sock: sock.to_path_buf(),
            stderr,
        }
    }

    /// The console output so far, with the guest tty's CR LF line ends made LF.
    pub fn console_text(&self) -> String {
        std::fs::read_to_string(&self.console)
            .unwrap_or_default()
            .replace("\r\n", "\n")
    }

    /// The VMM's log so far.
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Waits until the console contains `needle`, panicking with the console and log
    /// after `timeout` or if the VMM exits first.
    pub fn wait_console(&mut self, needle: &str, timeout: Duration) -> String {
        let start = Instant::now();
        loop {
            let text = self.console_text();
            if text.contains(needle) {
                return text;
            }
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "VMM exited ({status}) before the console showed {needle:?}\n--- console:\n{text}\n--- log:\n{}",
                    self.stderr_text()
                );
            }
            if start.elapsed() > timeout {
                self.kill();
                panic!(
                    "console did not show {needle:?} within {timeout:?}\n--- console:\n{text}\n--- log:\n{}",
                    self.stderr_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until the console holds a whole line that starts with `prefix` (a guest
    /// prints a line a character at a time: a test that saw only the prefix could read
    /// the rest before it is written) and returns the console.
    pub fn wait_console_line(&mut self, prefix: &str, timeout: Duration) -> String {
        let start = Instant::now();
        loop {
            let text = self.wait_console(prefix, timeout.saturating_sub(start.elapsed()));
            if text
                .split_once(prefix)
                .is_some_and(|(_, rest)| rest.contains('\n'))
            {
                return text;
            }
            if start.elapsed() > timeout {
                self.kill();
                panic!(
                    "console line {prefix:?} not finished within {timeout:?}\n--- console:\n{text}"
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the VMM to exit, killing it after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().expect("wait vmm") {
                return s;
            }
            if start.elapsed() > timeout {
                let threads = Self::threads_of(self.child.id());
                self.kill();
                panic!(
                    "VMM did not exit within {timeout:?}\n--- its threads and its children's:\n{threads}\n--- console:\n{}\n--- log:\n{}",
                    self.console_text(),
                    self.stderr_text()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits for the control socket to accept connections.
    pub fn wait_api(&mut self, timeout: Duration) {
        let start = Instant::now();
        while UnixStream::connect(&self.sock).is_err() {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "VMM exited ({status}) before serving its API\n{}",
                    self.stderr_text()
                );
            }
            assert!(start.elapsed() < timeout, "API socket never came up");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Waits until the VMM answers `GET /vm` (a restored VM: once it is restored);
    /// false if it exits first or `timeout` passes.
    pub fn try_wait_api(&mut self, timeout: Duration) -> bool {
        let start = Instant::now();
        while start.elapsed() < timeout {
            if let Ok(Some(_)) = self.child.try_wait() {
                return false;
            }
            if forkvm_client::api::describe_vm(&self.sock).is_ok() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// `PUT /snapshot` into `dir`: (status, body).
    pub fn snapshot(&self, dir: &Path) -> (u16, String) {
        let body = serde_json::json!({ "dir": dir }).to_string();
        self.api("PUT", "/snapshot", Some(&body))
    }

    /// Shuts the VM down over the API and checks that the VMM exits with status 0.
    pub fn shutdown(&mut self, timeout: Duration) {
        let (code, body) = self.api("PUT", "/actions", Some(r#"{"action_type":"shutdown"}"#));
        assert_eq!(code, 204, "shutdown refused: {body}");
        let status = self.wait_exit(timeout);
        assert!(status.success(), "exit {status}\n{}", self.stderr_text());
    }

    /// Every thread of process `pid` and of its children: name, state, what it waits in,
    /// and its kernel stack (what a VMM that does not exit is stuck on).
    fn threads_of(pid: u32) -> String {
        let children = (std::fs::read_dir("/proc").into_iter().flatten().flatten())
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|p| {
                let stat = std::fs::read_to_string(format!("/proc/{p}/stat")).unwrap_or_default();
                let after = stat.rsplit_once(')').map_or("", |(_, a)| a);
                after.split_whitespace().nth(1) == Some(&pid.to_string())
            });
        let mut out = String::new();
        for p in std::iter::once(pid).chain(children) {
            let tasks = std::fs::read_dir(format!("/proc/{p}/task"))
                .into_iter()
                .flatten();
            for task in tasks.flatten() {
                let dir = task.path();
                let read = |f: &str| std::fs::read_to_string(dir.join(f)).unwrap_or_default();
                let stat = read("stat");
                let state = stat
                    .rsplit_once(')')
                    .map_or("?", |(_, a)| a.trim())
                    .get(..1);
                out += &format!(
                    "{} {} {} in {}\n{}",
                    dir.display(),
                    read("comm").trim(),
                    state.unwrap_or("?"),
                    read("wchan"),
                    read("stack")
                );
            }
        }
        out
    }

    /// One API request: returns (status, body). If the control socket does not take
    /// the connection, panics with whether the VMM still runs and its log.
    pub fn api(&self, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
        let stream = UnixStream::connect(&self.sock).unwrap_or_else(|e| {
            let pid = self.child.id();
            let alive = Path::new(&format!("/proc/{pid}")).exists();
            panic!(
                "{method} {path}: cannot connect to {}: {e} (VMM {pid} {})\n--- log:\n{}\n--- console (end):\n{}",
                self.sock.display(),
                if alive { "still runs" } else { "has exited" },
                self.stderr_text(),
                tail(&self.console_text(), 3000)
            )
        });
        request_on(stream, &http_request(method, path, body))
    }

    /// `GET /vm`, parsed (the VMM must answer 200).
    pub fn describe(&self) -> serde_json::Value {
        let (code, body) = self.api("GET", "/vm", None);
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("GET /vm: {e}: {body}"))
    }

    /// Whether the VM is a ready template: paused where its runtime waits for a request.
    pub fn waits_as_template(&self) -> bool {
        let v = self.describe();
        v["state"] == "paused" && v["invoke"]["waiting"] == true
    }

    /// Kills the VMM and reaps it.
    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            self.kill();
        }
    }
}

/// Starts forkvm's tiny test guest with `mem_mib` MiB, `vcpus` vCPUs (all started by
/// the VMM, `--ap-boot direct`) and its command line (docs/tiny-guest.md).
pub fn tiny_vm(scratch: &Scratch, mem_mib: &str, vcpus: &str, cmdline: &str) -> Vm {
    tiny_vm_with(scratch, mem_mib, vcpus, cmdline, &[])
}

/// [`tiny_vm`] with further `vmm run` options.
pub fn tiny_vm_with(
    scratch: &Scratch,
    mem_mib: &str,
    vcpus: &str,
    cmdline: &str,
    extra: &[&str],
) -> Vm {
    let tiny = guest_file("tiny.elf").display().to_string();
    let mut args = vec![
        "--kernel",
        &tiny,
        "--mem-mib",
        mem_mib,
        "--vcpus",
        vcpus,
        "--ap-boot",
        "direct",
        "--cmdline",
        cmdline,
    ];
    args.extend_from_slice(extra);
    Vm::start(scratch, &args)
}

/// Waits until `done` holds, checking every 50 ms; panics naming `what` after `timeout`.
pub fn wait_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let start = Instant::now();
    while !done() {
        assert!(start.elapsed() < timeout, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The CPU time process `pid` (all its threads) has used, in clock ticks (`utime` plus
/// `stime` of `/proc/PID/stat`); None once it is gone.
pub fn cpu_ticks(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name, which may hold spaces: state is the first.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let field = |n: usize| fields.get(n)?.parse::<u64>().ok();
    Some(field(11)? + field(12)?)
}

/// Waits (at most `timeout`) until the VM of VMM process `pid` is idle: its process used
/// at most 2 clock ticks (20 ms) in each of two half seconds in a row, as a guest whose
/// processes all sleep does. Its guest's processes are past their start-up then: on the
/// AMD PVM host a process running beside another's start-up can die by SIGSEGV
/// (docs/guest-kernel.md, "Known host problems"), so a test that starts a second one
/// waits for this first.
pub fn wait_until_vm_idle(pid: u32, timeout: Duration) {
    let start = Instant::now();
    let (mut last, mut quiet) = (cpu_ticks(pid), 0);
    while quiet < 2 {
        assert!(
            start.elapsed() < timeout,
            "timed out waiting for VM process {pid} to be idle"
        );
        std::thread::sleep(Duration::from_millis(500));
        let now = cpu_ticks(pid);
        quiet = match (last, now) {
            (Some(a), Some(b)) if b.saturating_sub(a) <= 2 => quiet + 1,
            _ => 0,
        };
        last = now;
    }
}

/// Entries in directory `path` (0 if it cannot be read): a process's `/proc/PID/fd` or
/// `/proc/PID/task`, say.
pub fn count_dir(path: impl AsRef<Path>) -> usize {
    std::fs::read_dir(path).map(|d| d.count()).unwrap_or(0)
}

/// `pid`'s open descriptors once they number `expected`, or after 2 s: an answer's
/// connection, or a clone's hand-over socket, closes a moment after the client has what
/// it waited for. `expected` of 0 (or `usize::MAX`) takes the count after 2 s.
pub fn fds_of(pid: u32, expected: usize) -> usize {
    let start = Instant::now();
    loop {
        let n = count_dir(format!("/proc/{pid}/fd"));
        if n == expected || start.elapsed() > Duration::from_secs(2) {
            return n;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// `pid`'s descriptor count at rest: once two reads 300 ms apart agree (at most 5 s).
/// The baseline of a leak check: a count read at once can hold a descriptor the VMM is
/// about to close (a connection, a clone's teardown), more so beside other tests' load,
/// and make every later count look one short.
pub fn fds_at_rest(pid: u32) -> usize {
    let start = Instant::now();
    let mut last = count_dir(format!("/proc/{pid}/fd"));
    loop {
        std::thread::sleep(Duration::from_millis(300));
        let now = count_dir(format!("/proc/{pid}/fd"));
        if now == last || start.elapsed() > Duration::from_secs(5) {
            return now;
        }
        last = now;
    }
}

/// What `pid`'s descriptors point at (`3 -> socket:[123]`, ...), for a failure message.
pub fn fd_targets(pid: u32) -> String {
    let mut fds: Vec<(u32, String)> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .into_iter()
        .flatten()
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_str()?.parse().ok()?;
            let to = std::fs::read_link(e.path()).ok()?;
            Some((n, to.display().to_string()))
        })
        .collect();
    fds.sort();
    let lines: Vec<String> = fds.iter().map(|(n, to)| format!("{n} -> {to}")).collect();
    lines.join("\n")
}

/// The processes whose parent is `pid`, whichever of its threads forked them (none once
/// `pid` is gone). Panics if the host kernel does not list children in /proc.
pub fn children_of(pid: u32) -> Vec<u32> {
    let me = std::process::id();
    assert!(
        Path::new(&format!("/proc/{me}/task/{me}/children")).exists(),
        "the host kernel lists children in /proc (CONFIG_PROC_CHILDREN)"
    );
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task"))
        .into_iter()
        .flatten();
    // A thread may end while it is read: its list is then empty.
    (tasks.flatten())
        .flat_map(|t| {
            let list = std::fs::read_to_string(t.path().join("children")).unwrap_or_default();
            list.split_whitespace()
                .filter_map(|p| p.parse().ok())
                .collect::<Vec<u32>>()
        })
        .collect()
}

/// The last `max` bytes of `text` (from a character boundary).
fn tail(text: &str, max: usize) -> &str {
    let mut at = text.len().saturating_sub(max);
    while !text.is_char_boundary(at) {
        at += 1;
    }
    &text[at..]
}

/// One HTTP request's bytes.
fn http_request(method: &str, path: &str, body: Option<&str>) -> Vec<u8> {
    let body = body.unwrap_or("");
    let head = forkvm_client::http::request_head(method, path, None, body.len());
    format!("{head}{body}").into_bytes()
}

/// Sends a raw HTTP request over a Unix socket and returns (status, body).
pub fn api_request(sock: &Path, method: &str, path: &str, body: Option<&str>) -> (u16, String) {
    raw_request(sock, &http_request(method, path, body))
}

/// A figure of the invocation report in `GET /vm` (`invoke.<what>`) of the VM at `sock`.
pub fn invoke_figure(sock: &Path, what: &str) -> u64 {
    let (code, body) = api_request(sock, "GET", "/vm", None);
    assert_eq!(code, 200, "GET /vm: {body}");
    let v: serde_json::Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    v["invoke"][what]
        .as_u64()
        .unwrap_or_else(|| panic!("{what}: {body}"))
}

/// Process `pid`'s resident memory (KiB, `VmRSS` of /proc/PID/status) and open
/// descriptors: what a leak test compares before and after.
pub fn rss_and_fds(pid: u32) -> (u64, usize) {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
    let rss = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    (rss, count_dir(format!("/proc/{pid}/fd")))
}

/// The counters of the rate limiter `name` of the VM at `sock`'s first device of type
/// `kind` (`GET /vm`: `rx` or `tx` of `virtio-net`, `requests` of `virtio-blk` or
/// `virtio-rng`); None when that device has no limit.
pub fn device_limiter(sock: &Path, kind: &str, name: &str) -> Option<serde_json::Value> {
    let (code, body) = api_request(sock, "GET", "/vm", None);
    assert_eq!(code, 200, "GET /vm: {body}");
    let vm: serde_json::Value =
        serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let devices = vm["devices"].as_array().expect("devices");
    let device = devices.iter().find(|d| d["type"] == kind);
    let limiters = device.unwrap_or_else(|| panic!("no {kind}: {body}"))["rate_limiters"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    limiters.into_iter().find(|l| l["name"] == name)
}

/// The counters of the network card's `direction` (`rx` or `tx`) rate limiter of the VM
/// at `sock`; None when its card has no limit.
pub fn net_limiter(sock: &Path, direction: &str) -> Option<serde_json::Value> {
    device_limiter(sock, "virtio-net", direction)
}

/// Sends raw bytes and returns (status, body).
pub fn raw_request(sock: &Path, bytes: &[u8]) -> (u16, String) {
    let s = UnixStream::connect(sock)
        .unwrap_or_else(|e| panic!("connect API socket {}: {e}", sock.display()));
    request_on(s, bytes)
}

/// Sends `bytes` on a connected control socket and returns (status, body), read with
/// the VMM's own response reader.
fn request_on(mut s: UnixStream, bytes: &[u8]) -> (u16, String) {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    s.write_all(bytes).expect("send request");
    let _ = s.shutdown(std::net::Shutdown::Write);
    let r = forkvm_client::http::read_response(&s).unwrap_or_else(|e| panic!("bad response: {e}"));
    (r.status, r.body)
}

/// `vmm exec` with `args` and `input`; a command that dies by SIGSEGV (status 139) is
/// run again, at most twice, and said so: on this host a guest process starting up can
/// crash for reasons outside the VMM (docs/guest-kernel.md, "Known host problems").
pub fn vmm_exec(
    sock: &std::path::Path,
    args: &[&str],
    input: &[u8],
) -> (Option<i32>, String, String) {
    let mut result = vmm_exec_once(sock, args, input);
    for _ in 0..2 {
        if result.0 != Some(139) {
            break;
        }
        eprintln!(
            "WARNING: `vmm exec {args:?}` died by SIGSEGV in the guest (known host problem, \
             docs/guest-kernel.md); running it again: {result:?}"
        );
        result = vmm_exec_once(sock, args, input);
    }
    result
}

/// Runs `script` in the guest behind `sock` as init runs `forkvm.run="..."` at boot, for a
/// guest restored from a cached snapshot (`cache`) instead of booted with it: through the
/// guest agent (`vmm exec`), detached from the agent (its own session), its output on the
/// guest's console. Returns once the guest shell has started it. A clone the script makes
/// inherits it, and writes to its own console.
pub fn run_on_console(sock: &Path, script: &str) {
    let start = "cat > /run/console.sh || exit 1; setsid sh /run/console.sh </dev/null >/dev/console 2>&1 &";
    let (code, out, err) = vmm_exec(sock, &["--stdin", "--", start], script.as_bytes());
    assert_eq!(
        code,
        Some(0),
        "starting a script on the console: {out}{err}"
    );
}

/// `vmm exec ARGS` with `input` on its stdin: (exit code, stdout, stderr).
fn vmm_exec_once(
    sock: &std::path::Path,
    args: &[&str],
    input: &[u8],
) -> (Option<i32>, String, String) {
    use std::io::Write;
    let mut child = std::process::Command::new(vmm_bin())
        .arg("exec")
        .arg("--api-sock")
        .arg(sock)
        .args(["--timeout", "300"])
        .args(args)
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawn vmm exec");
    child.stdin.take().unwrap().write_all(input).unwrap();
    let out = child.wait_with_output().unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `vmm ARGS` to completion with a timeout; returns (status, stdout, stderr).
pub fn run_vmm(args: &[&str], timeout: Duration) -> (ExitStatus, String, String) {
    let mut child = Command::new(vmm_bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn vmm");
    let start = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().expect("wait") {
            break s;
        }
        if start.elapsed() > timeout {
            let _ = child.kill();
            let _ = child.wait();
            panic!("vmm {args:?} did not finish within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let mut out = String::new();
    let mut err = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    (status, out, err)
}
