//! The Linux guest as a function host: the C runtime (`forkvm-fn`, over libforkvm) and
//! the Python runtime (`forkvm.serve`, on the Python image) in a template, each
//! invocation in a fresh clone, every error with its status; and the
//! guest kernel's RNG reseeded by the VMM in every kind of clone (guest-requested, API,
//! warm, invoked), with a control boot that shows what a clone inherits without it.
//! Each test is one or two boots (slow here: see linux.rs).

use std::collections::HashSet;
use std::path::Path;
use std::time::Duration;

use api_types::InvokeOptions;
use forkvm_client::api as client;
use forkvm_client::http::Response;
use serde_json::Value;
use tests::cache::guest_image;
use tests::{invoke_figure, kvm_available, wait_until, Scratch, Vm};

/// A Linux boot and the runtime's start (generous: see linux.rs).
const LINUX_BOOT: Duration = Duration::from_secs(400);
const CLONES: usize = 20;

/// `vmm run` arguments for the Linux guest running `run` (on `root`, or the initramfs),
/// its files copied into the snapshot cache (`tests::cache::image`).
fn linux_args(root: Option<&str>, cmdline_extra: &str, run: &str, extra: &[&str]) -> Vec<String> {
    let boot = match root {
        Some(_) => "root=/dev/vda ro rootfstype=ext4",
        None => "",
    };
    let cmdline = format!(
        "console=ttyS0 reboot=k panic=-1 quiet {boot} {cmdline_extra} forkvm.run=\"{run}\""
    );
    let (disk_flag, disk) = match root {
        Some(image) => ("--rootfs", guest_image(image)),
        None => ("--initrd", guest_image("initramfs.cpio")),
    };
    let mut args: Vec<String> = vec![
        "--kernel".into(),
        guest_image("vmlinux"),
        disk_flag.into(),
        disk,
        "--mem-mib".into(),
        "256".into(),
        "--cmdline".into(),
        cmdline,
    ];
    args.extend(extra.iter().map(|a| a.to_string()));
    args
}

/// A template running the runtime `run`, once it printed `ready` and paused where the
/// runtime waits, with two warm clones; `extra` are further `vmm run` options. Booted
/// once and kept as a cached snapshot (`tests::cache`), then restored: the restored
/// template's runtime reads "no request", waits again, and the template pauses there.
fn ready_template(
    scratch: &Scratch,
    root: Option<&str>,
    run: &str,
    ready: &str,
    extra: &[&str],
) -> Vm {
    ready_template_restored(scratch, (root, run, ready, extra), &["--warm-clones", "2"])
}

/// [`ready_template`] restored with the `vmm restore` options `restore`.
fn ready_template_restored(
    scratch: &Scratch,
    (root, run, ready, extra): (Option<&str>, &str, &str, &[&str]),
    restore: &[&str],
) -> Vm {
    let mut args = vec!["--template"];
    args.extend_from_slice(extra);
    let args = linux_args(root, "", run, &args);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let wait = |vm: &mut Vm| pause_where_runtime_waits(vm, ready);
    let boot = tests::cache::CachedBoot {
        name: "linux-template",
        run_args: &args,
        ready: &wait,
    };
    let vm = tests::cache::restored(scratch, &boot, restore, LINUX_BOOT);
    wait_until("the restored template to pause", LINUX_BOOT, || {
        vm.waits_as_template()
    });
    vm
}

/// Waits until a booting template `vm` is paused where its runtime waits (it prints
/// `ready` then). Not by the console: the runtime's `ready` line may still be in the
/// guest kernel's serial buffer when the template pauses (the CI once saw
/// "forkvm.serve: re" and nothing more).
fn pause_where_runtime_waits(vm: &mut Vm, ready: &str) {
    vm.wait_api(LINUX_BOOT);
    let start = std::time::Instant::now();
    while !vm.waits_as_template() {
        let gone = matches!(vm.child.try_wait(), Ok(Some(_)));
        assert!(
            !gone && start.elapsed() < LINUX_BOOT,
            "the template did not pause where its runtime waits (it prints {ready:?} \
             then)\n--- console:\n{}\n--- log:\n{}",
            vm.console_text(),
            vm.stderr_text()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Waits until `vm`'s two warm clones are ready and checks they are primed (both
/// runtimes declare prime requests).
fn wait_primed(vm: &Vm) {
    wait_until("two primed warm clones", Duration::from_secs(30), || {
        vm.describe()["warm_clones"]["ready"] == 2
    });
    let warm = &vm.describe()["warm_clones"];
    assert_eq!(warm["priming"], true, "{warm}");
    assert!(warm["primed"].as_u64().unwrap() >= 2, "{warm}");
}

/// Checks an `info` reply's count of handler calls (1: a prime is no call) and returns
/// whether the answer came from a primed warm clone.
fn first_call_primed(r: &Response, calls: &str) -> bool {
    assert_eq!(calls, "1", "the handler's calls in its clone");
    match r.header("x-forkvm-primed") {
        Some("true") => true,
        Some("false") => false,
        other => panic!("x-forkvm-primed: {other:?}"),
    }
}

/// What both runtimes' `info` handlers do with `sleep S` and `exit N`: past the
/// timeout, 504 (the clone is stopped); the runtime exiting (`exit`, `os._exit`), init
/// reports the status and powers the clone off: 502 with the console tail.
fn assert_timeout_and_runtime_exit(vm: &Vm) {
    let options = InvokeOptions {
        timeout_ms: Some(3000),
        ..Default::default()
    };
    let r = invoke_with(&vm.sock, &options, "sleep 60");
    assert_eq!(
        (r.status, r.header("x-forkvm-outcome")),
        (504, Some("timeout")),
        "{}",
        r.body
    );
    // The runtime's exit, init's report and the kernel's power-off are emulated guest
    // kernel work here: beside the other Linux tests in CI they once took over the
    // default 30 s (504 with "exit status 3" on the console). What is checked is the
    // outcome, so the timeout is generous.
    let slow = InvokeOptions {
        timeout_ms: Some(180_000),
        ..Default::default()
    };
    let r = invoke_with(&vm.sock, &slow, "exit 3");
    assert_eq!(
        (r.status, r.header("x-forkvm-outcome")),
        (502, Some("guest_stopped")),
        "{}",
        r.body
    );
    assert!(error_of(&r).contains("exit status 3"), "{}", r.body);
}

fn invoke_with(sock: &Path, options: &InvokeOptions, payload: &str) -> Response {
    client::invoke(sock, options, payload.as_bytes()).unwrap_or_else(|e| panic!("invoke: {e}"))
}

fn invoke(sock: &Path, payload: &str) -> Response {
    invoke_with(sock, &InvokeOptions::default(), payload)
}

fn error_of(r: &Response) -> String {
    serde_json::from_str::<api_types::ErrorBody>(&r.body)
        .map(|e| e.error)
        .unwrap_or_else(|_| r.body.clone())
}

/// `key=value` from `forkvm-fn info`'s reply.
fn field<'a>(reply: &'a str, key: &str) -> &'a str {
    let at = reply
        .find(&format!("{key}="))
        .unwrap_or_else(|| panic!("no {key}= in {reply:?}"));
    let rest = &reply[at + key.len() + 1..];
    if key == "input" {
        return rest;
    }
    rest.split(' ').next().unwrap()
}

fn assert_distinct(values: &[String], what: &str) {
    let unique: HashSet<&String> = values.iter().collect();
    assert_eq!(unique.len(), values.len(), "{what} repeat: {values:?}");
}

#[test]
fn linux_c_runtime_serves_each_invocation_in_a_fresh_clone_and_reports_every_failure() {
    if !kvm_available("linux_c_runtime") {
        return;
    }
    let scratch = Scratch::new("linux-c-runtime");
    // Not refreshed: the template's age is the test's to set (below).
    let no_refresh = ["--refresh-idle-ms", "0"];
    let mut vm = ready_template(
        &scratch,
        None,
        "forkvm-fn info",
        "forkvm-fn: ready",
        &no_refresh,
    );

    // 20 invocations: each in its own clone (its own number and generation), each
    // reads its own kernel random bytes (reseeded by the VMM, not by the runtime) and
    // gets its own userspace PRNG seed from the request's entropy; input byte for byte.
    // The first goes to a primed warm clone, whose runtime ran its loop once without
    // calling the handler.
    wait_primed(&vm);
    let mut seen: [Vec<String>; 4] = Default::default();
    for i in 0..CLONES {
        let payload = format!("hello {i} \u{e9}\u{1f600}");
        let r = invoke(&vm.sock, &payload);
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.header("x-forkvm-outcome"), Some("ok"));
        let reply = String::from_utf8(r.bytes.clone()).unwrap();
        let primed = first_call_primed(&r, field(&reply, "calls"));
        assert!(primed || i > 0, "the first invocation was not primed");
        assert_eq!(field(&reply, "input"), payload);
        assert_eq!(Some(field(&reply, "seq")), r.header("x-forkvm-clone-id"));
        assert_eq!(field(&reply, "urandom").len(), 64, "{reply}");
        for (k, key) in ["seq", "gen", "urandom", "random"].iter().enumerate() {
            seen[k].push(field(&reply, key).to_string());
        }
    }
    for (k, key) in ["clone numbers", "generations", "urandom", "random()"]
        .iter()
        .enumerate()
    {
        assert_distinct(&seen[k], key);
    }

    // The handler fails: 500 with its text.
    let r = invoke(&vm.sock, "fail the handler gave up");
    assert_eq!(
        (r.status, r.header("x-forkvm-outcome")),
        (500, Some("handler_error"))
    );
    assert!(error_of(&r).contains("the handler gave up"), "{}", r.body);
    // A reply larger than the mailbox is refused by the library, never cut: 500 says so.
    let r = invoke(&vm.sock, "big");
    assert_eq!(r.status, 500, "{}", r.body);
    assert!(
        error_of(&r).contains("does not fit the mailbox"),
        "{}",
        r.body
    );
    // A handler command (fork and exec in the guest): its output, or its error.
    let r = invoke(&vm.sock, "sh echo via-sh-$((6*7))");
    assert_eq!(
        (r.status, r.body.as_str()),
        (200, "via-sh-42\n"),
        "{}",
        r.body
    );
    let r = invoke(&vm.sock, "sh echo no-such-thing >&2; exit 4");
    assert_eq!(r.status, 500, "{}", r.body);
    assert!(error_of(&r).contains("no-such-thing"), "{}", r.body);
    assert_timeout_and_runtime_exit(&vm);

    // The handler runs before the kernel's timer interrupt that fell due while the
    // guest did not run (--tick-defer-ms, default 10 ms): after 1.5 s paused, a fresh
    // clone's handler reads the kernel's coarse clock (its last tick) that far behind
    // the fine one; delivered at once, the interrupt would have moved it on first.
    // Likewise in place, in a keep-alive clone left waiting for 0.2 s.
    let lag = |r: Response| -> u64 {
        assert_eq!(r.status, 200, "{}", r.body);
        field(&r.body, "coarse_lag_ms").parse().unwrap()
    };
    assert_eq!(vm.describe()["invoke"]["tick_defer_ms"], 10);
    std::thread::sleep(Duration::from_millis(1500));
    let keep = InvokeOptions {
        keep_alive: true,
        ..Default::default()
    };
    // A clone whose kernel went a second (CATCH_UP_AFTER) without its timer interrupt
    // is refreshed at its wait, and catches up then: on a loaded host that second can
    // pass before the request in place, counted from the clone's start. Such a clone
    // says so (`refreshes`) and a new one is tried; so is one whose vCPU the host kept
    // from running for longer than the deferral can reach (`x-forkvm-stretched-us` at
    // its most). Three in a row fail the test.
    let ran_out = |r: &Response| {
        let us: u64 = r.header("x-forkvm-stretched-us").unwrap().parse().unwrap();
        us >= vmm::invoke::DEFER_ROOM.as_micros() as u64
    };
    let mut lags = None;
    for attempt in 1..=3 {
        let r = invoke_with(&vm.sock, &keep, "clocks");
        let sock = std::path::PathBuf::from(r.header("x-forkvm-socket").unwrap());
        let id = r.header("x-forkvm-clone-id").unwrap().to_string();
        let fresh_ran_out = ran_out(&r);
        let fresh = lag(r);
        std::thread::sleep(Duration::from_millis(200));
        let r = invoke_with(&sock, &keep, "clocks");
        let in_place_ran_out = ran_out(&r);
        let in_place = lag(r);
        let refreshes = invoke_figure(&sock, "refreshes");
        assert_eq!(vm.api("DELETE", &format!("/clones/{id}"), None).0, 200);
        if refreshes == 0 && !fresh_ran_out && !in_place_ran_out {
            lags = Some((fresh, in_place));
            break;
        }
        eprintln!(
            "attempt {attempt}: the clone was refreshed {refreshes} times; deferral ran \
             out: fresh {fresh_ran_out}, in place {in_place_ran_out}"
        );
    }
    let (fresh, in_place) =
        lags.expect("three keep-alive clones were refreshed or kept from running");
    assert!(
        fresh >= 1000,
        "a fresh clone's coarse clock lags {fresh} ms"
    );
    assert!(
        in_place >= 1000,
        "in place, the coarse clock lags {in_place} ms"
    );

    // The template is untouched by all of it.
    let r = invoke(&vm.sock, "after");
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        field(&String::from_utf8(r.bytes).unwrap(), "input"),
        "after"
    );
    vm.shutdown(Duration::from_secs(60));
}

#[test]
fn linux_python_rewound_clones_serve_each_request_as_a_fresh_clone() {
    if !kvm_available("linux_python_rewind") {
        return;
    }
    // `--rewind`: each clone that answered is put back in the template's state and
    // serves again, in the same process. The handler's own count of its calls is 1
    // every time (the guest's memory is the template's again), and the clone number,
    // os.urandom and random.random() differ every time, as in fresh clones.
    let scratch = Scratch::new("linux-python-rewind");
    let run = "python3 -m forkvm forkvm_examples:info";
    let template = (Some("python.ext4"), run, "forkvm.serve: ready", &[][..]);
    let vm = ready_template_restored(&scratch, template, &["--warm-clones", "2", "--rewind"]);
    wait_primed(&vm);
    // The first requests' clones report the template's working set, and the warm
    // clones made before are replaced by ones that write it ahead (docs/invoke.md): the
    // processes are counted after three requests.
    let pid = vm.child.id();
    let settled = || vm.describe()["warm_clones"]["ready"] == 2;
    let mut seen: [Vec<String>; 3] = Default::default();
    let mut processes = Vec::new();
    for i in 0..13 {
        if i == 3 {
            // Until the replacements are made and no stale one is left.
            let mut last = Vec::new();
            wait_until("the pool to settle", Duration::from_secs(60), || {
                let now = tests::children_of(pid);
                let same = now == last && now.len() == 2 && settled();
                last = now;
                std::thread::sleep(Duration::from_millis(1000));
                same
            });
            processes = last;
        }
        let payload = format!("rewound {i}");
        let r = invoke(&vm.sock, &payload);
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_slice(&r.bytes).unwrap();
        first_call_primed(&r, &v["calls"].to_string());
        assert_eq!(v["input"], payload.as_str());
        for (k, key) in ["clone", "urandom", "random"].iter().enumerate() {
            seen[k].push(v[key].to_string());
        }
        wait_until("the clone to come back", Duration::from_secs(30), settled);
    }
    for (k, key) in ["clone numbers", "os.urandom", "random.random()"]
        .iter()
        .enumerate()
    {
        assert_distinct(&seen[k], key);
    }
    assert_eq!(
        tests::children_of(pid),
        processes,
        "the requests were not all served by the same two processes"
    );
}

#[test]
fn linux_python_runtime_serves_each_invocation_in_a_fresh_clone_and_reports_every_failure() {
    if !kvm_available("linux_python_runtime") {
        return;
    }
    let scratch = Scratch::new("linux-python-runtime");
    let run = "python3 -m forkvm forkvm_examples:info";
    let mut vm = ready_template(
        &scratch,
        Some("python.ext4"),
        run,
        "forkvm.serve: ready",
        &[],
    );

    // 20 invocations, each in its own clone: the input back, the clone's number, 32
    // bytes of os.urandom (the VMM rekeyed the kernel RNG) and random.random() (the
    // runtime reseeded it from the request's entropy), all distinct.
    // The first in a primed warm clone (the handler not called by the prime).
    wait_primed(&vm);
    let mut seen: [Vec<String>; 3] = Default::default();
    let mut named = Vec::new();
    for i in 0..CLONES {
        let payload = format!("py {i} \u{e9}");
        let r = invoke(&vm.sock, &payload);
        assert_eq!(r.status, 200, "{}", r.body);
        let v: Value = serde_json::from_slice(&r.bytes).unwrap();
        let primed = first_call_primed(&r, &v["calls"].to_string());
        assert!(primed || i > 0, "the first invocation was not primed");
        assert_eq!(v["input"], payload.as_str());
        assert_eq!(
            v["clone"].to_string(),
            r.header("x-forkvm-clone-id").unwrap()
        );
        assert_eq!(v["urandom"].as_str().unwrap().len(), 64, "{v}");
        for (k, key) in ["clone", "urandom", "random"].iter().enumerate() {
            seen[k].push(v[key].to_string());
        }
        let pages = v["prime_pages"].as_u64().unwrap_or_else(|| panic!("{v}"));
        named.push((pages, r.header("x-forkvm-primed") == Some("true")));
    }
    // The first warm clones were made before the template learned its working set (from
    // its first clones' requests): no page named in their primes; primed warm clones
    // made after had the runtime's pages of the set named, and read them in their primes
    // (docs/invoke.md, "The warm-up's pages, mapped in the prime"). A clone forked for a
    // request when no warm clone was ready has no prime, and no pages.
    assert_eq!(
        named[0].0, 0,
        "pages named before anything was learned: {named:?}"
    );
    assert!(
        named.iter().any(|&(n, _)| n > 0),
        "no pages named: {named:?}"
    );
    assert!(
        named.iter().all(|&(n, primed)| n == 0 || primed),
        "pages named to an unprimed clone: {named:?}"
    );
    for (k, key) in ["clone numbers", "os.urandom", "random.random()"]
        .iter()
        .enumerate()
    {
        assert_distinct(&seen[k], key);
    }

    // The handler raises: 500 with the traceback.
    let r = invoke(&vm.sock, "raise no luck");
    assert_eq!(
        (r.status, r.header("x-forkvm-outcome")),
        (500, Some("handler_error"))
    );
    let e = error_of(&r);
    assert!(
        e.contains("RuntimeError: no luck") && e.contains("Traceback"),
        "{e}"
    );
    // A reply one byte over the mailbox: 500, nothing cut. Its 4 MiB are memory the
    // clone touches first (guest page faults, emulated on the PVM host: tens of seconds
    // while other guests boot beside it), so these two get more than the default 30 s.
    let long = InvokeOptions {
        timeout_ms: Some(180_000),
        ..Default::default()
    };
    let r = invoke_with(&vm.sock, &long, &format!("big {}", (4 << 20) - 64 + 1));
    assert_eq!(r.status, 500, "{}", r.body);
    assert!(
        error_of(&r).contains("does not fit the mailbox"),
        "{}",
        r.body
    );
    // One byte under: the whole reply.
    let r = invoke_with(&vm.sock, &long, &format!("big {}", (4 << 20) - 64));
    assert_eq!((r.status, r.bytes.len()), (200, (4 << 20) - 64));
    assert_timeout_and_runtime_exit(&vm);
    let r = invoke(&vm.sock, "after");
    assert_eq!(r.status, 200, "{}", r.body);
    vm.shutdown(Duration::from_secs(60));
}

/// A probe's read: its first 16 random bytes in hex, and whether a clone point fell
/// inside it (the clone number changed between just before and just after it).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct Tick {
    rand: String,
    straddled: bool,
}

/// The first whole `tick id=N from=F rand=HEX` line of clone `id` in `console` (which
/// the guest may be writing still).
fn first_tick(console: &str, id: &str) -> Option<Tick> {
    let prefix = format!("tick id={id} from=");
    console
        .split_inclusive('\n')
        .filter(|l| l.ends_with('\n'))
        .find_map(|l| {
            let (from, rand) = l.trim().strip_prefix(&prefix)?.split_once(" rand=")?;
            assert_eq!(rand.len(), 32, "16 bytes in hex: {l}");
            Some(Tick {
                rand: rand.to_string(),
                straddled: from != id,
            })
        })
}

/// A clone's console (`GET /clones` entry `c`) as it is now.
fn clone_console(c: &Value) -> String {
    std::fs::read_to_string(c["console"].as_str().unwrap()).unwrap_or_default()
}

/// Each clone's first tick, once all printed.
fn first_ticks(clones: &[Value]) -> Vec<Tick> {
    let mut ticks = vec![None; clones.len()];
    wait_until("every clone's first tick", LINUX_BOOT, || {
        for (t, c) in ticks.iter_mut().zip(clones) {
            if t.is_none() {
                *t = first_tick(&clone_console(c), c["id"].as_str().unwrap());
            }
        }
        ticks.iter().all(Option::is_some)
    });
    ticks.into_iter().map(Option::unwrap).collect()
}

/// Each clone's first tick, once all printed; then the clones deleted.
fn clone_ticks(vm: &Vm, clones: &[Value]) -> Vec<Tick> {
    let ticks = first_ticks(clones);
    for c in clones {
        let (code, body) = vm.api(
            "DELETE",
            &format!("/clones/{}", c["id"].as_str().unwrap()),
            None,
        );
        assert_eq!(code, 200, "{body}");
    }
    ticks
}

fn clones_of(vm: &Vm, body: Option<&str>) -> Vec<Value> {
    let (code, body) = match body {
        Some(b) => vm.api("POST", "/clones", Some(b)),
        None => vm.api("GET", "/clones", None),
    };
    assert!(code == 200 || code == 201, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    v["clones"].as_array().unwrap().clone()
}

/// The probe's reads: back to back, each long enough in the guest kernel (about 0.1 s
/// here) that a clone point of a running VM mostly falls inside one.
const PROBE: &str = "--ticks 0 --tick-bytes 4096";

/// Checks that no two clones read the same bytes; returns how many of the reads were
/// in flight at the clone point.
fn assert_own_bytes(ticks: &[Tick], what: &str) -> usize {
    let rands: Vec<String> = ticks.iter().map(|t| t.rand.clone()).collect();
    assert_distinct(&rands, what);
    ticks.iter().filter(|t| t.straddled).count()
}

/// Whether a batch of clones, all of one clone point, met it in the one place where
/// sharing their first bytes is what forkvm documents (docs/clone-uniqueness.md): the
/// read had passed the kernel's last generation check, on its way back to the program
/// (the probe cannot tell that from a read drawn again, so the batch is made once more:
/// a kernel that did not draw again would repeat on most clone points, which fall
/// inside the 0.1 s copy loop, not in those last instructions).
fn returning_at_clone_point(ticks: &[Tick]) -> bool {
    ticks.iter().all(|t| t.straddled && *t == ticks[0])
}

#[test]
fn linux_every_kind_of_clone_reads_its_own_kernel_random_bytes_from_the_first_read() {
    if !kvm_available("linux_crng_reseed") {
        return;
    }
    // The probe: `forkvm-clone --no-reseed --ticks 0 --tick-bytes B N` waits for the
    // kernel RNG to be ready, makes N clones without the tool's own reseed, then every
    // side reads B bytes with getrandom() again and again, the first read right after
    // the clone point, and prints the first 16 of each read.
    let scratch = Scratch::new("linux-crng");
    let control = Scratch::new("linux-crng-off");
    let probe = format!("forkvm-clone --no-reseed {PROBE} {CLONES}");
    // Both restored from cached snapshots of the booted agent guest, the probes run
    // through the agent (tests::run_on_console).
    let guest = tests::cache::LinuxAgent {
        name: "linux-agent",
        restore: &["--warm-clones", "4"],
        ..Default::default()
    };
    let mut vm = guest.restore(&scratch, &scratch.path("vm.vsock"), LINUX_BOOT);
    // The control: the same guest with the kernel's registration switched off (its
    // clones read right after the clone point; it reads once a second, so as not to
    // take the CPU the other VM's clones need). Restored (booted, the first time)
    // before either probe runs: 20 clones reading random bytes starve a boot.
    let control_guest = tests::cache::LinuxAgent {
        name: "linux-agent-crng-off",
        cmdline: "forkvm.crng=off",
        ..Default::default()
    };
    let mut off = control_guest.restore(&control, &control.path("vm.vsock"), LINUX_BOOT);
    tests::run_on_console(&vm.sock, &probe);
    tests::run_on_console(&off.sock, "forkvm-clone --no-reseed --ticks 1000 4");

    // Guest-requested clones: each one's first read starts and ends in the clone.
    vm.wait_console("tick id=0 ", LINUX_BOOT);
    let mut guest = Vec::new();
    wait_until("the guest's clones", LINUX_BOOT, || {
        guest = clones_of(&vm, None);
        guest.len() == CLONES
    });
    let ticks = clone_ticks(&vm, &guest);
    assert!(ticks.iter().all(|t| !t.straddled), "{ticks:?}");
    assert_own_bytes(&ticks, "guest-requested clones' first random bytes");

    // Clones made through the API of the running VM: mostly inside a read, which the
    // kernel draws again when the VMM's reseed moved its generation.
    // A batch whose clone point fell on a read's way back is made again, once for each
    // kind of batch.
    let mut excused = 0;
    let mut batch = |vm: &Vm, pause: bool, what: &str| {
        let mut again = false;
        loop {
            if pause {
                // The VM paused: warm clones (prepared ahead), then clones forked from it.
                assert_eq!(vm.api("PATCH", "/vm", Some(r#"{"state":"paused"}"#)).0, 204);
                wait_until("4 warm clones", LINUX_BOOT, || {
                    vm.describe()["warm_clones"]["ready"] == 4
                });
            }
            let clones = clones_of(vm, Some(&format!(r#"{{"count":{CLONES}}}"#)));
            assert_eq!(clones.len(), CLONES);
            if pause {
                assert!(vm.describe()["warm_clones"]["launched"].as_u64().unwrap() >= 4);
            }
            let ticks = clone_ticks(vm, &clones);
            if pause {
                assert_eq!(
                    vm.api("PATCH", "/vm", Some(r#"{"state":"running"}"#)).0,
                    204
                );
            }
            if returning_at_clone_point(&ticks) {
                if !again {
                    eprintln!(
                        "linux_crng_reseed: {what}: the clone point fell on a read's way back; again"
                    );
                    again = true;
                    excused += 1;
                    continue;
                }
                // Seen in a clean-clone CI run (0dab24c) for the paused VM's batch, and in
                // a local run beside a CI run (2026-12-05) for the running VM's: the
                // clone point fell there twice in a row, as if a pause on this PVM host
                // stopped the vCPU where the system call returns (docs/reliability.md):
                // not explained yet. The other batch must still be checked (below).
                eprintln!(
                    "WARNING linux_crng_reseed: {what}: the clone point fell on a read's way \
                     back twice; such a read returns the same bytes in every clone \
                     (docs/clone-uniqueness.md); not checked in this run"
                );
                break None;
            }
            break Some(assert_own_bytes(&ticks, what));
        }
    };
    let api_inside = batch(&vm, false, "API clones' first random bytes");
    let paused_inside = batch(&vm, true, "warm and paused-VM clones' first random bytes");
    eprintln!(
        "linux_crng_reseed: clone points inside a read: API clones {api_inside:?}/{CLONES}, \
         paused {paused_inside:?}/{CLONES}, batches made again {excused}"
    );
    assert!(
        api_inside.is_some() || paused_inside.is_some(),
        "neither batch of clones made through the API could be checked"
    );
    vm.shutdown(Duration::from_secs(60));

    // Without the registration every clone starts from its parent's CRNG state and reads
    // the same bytes: what the reseed prevents.
    off.wait_console("tick id=0 ", LINUX_BOOT);
    let mut inherited = Vec::new();
    wait_until("the control's clones", LINUX_BOOT, || {
        inherited = clones_of(&off, None);
        inherited.len() == 4
    });
    // Read once every clone has ticked, before they are deleted.
    first_ticks(&inherited);
    let consoles: Vec<String> = inherited.iter().map(clone_console).collect();
    let ticks = clone_ticks(&off, &inherited);
    // Some of them, not all: the guest kernel itself reseeds from its input pool when
    // a read finds the seed older than an interval (uptime/2 in early boot, then 60 s),
    // and a clone whose first read crossed that deadline reads fresh bytes by chance
    // (the CI saw 1 of 3 do so). Two clones with the same 16 bytes cannot be chance;
    // the registration is what makes every clone's its own.
    let shared = ticks
        .iter()
        .map(|t| ticks.iter().filter(|u| u.rand == t.rand).count())
        .max()
        .unwrap_or(0);
    assert!(
        shared >= 2 && ticks.iter().all(|t| !t.straddled),
        "clones of a kernel that did not register read different bytes: {ticks:?}\n\
         parent:\n{}\nclones:\n{consoles:#?}",
        off.console_text()
    );
    if shared < ticks.len() {
        eprintln!(
            "linux_crng_reseed: {} of {} unregistered clones read the same first bytes \
             (the others' first read met the kernel's own timed reseed)",
            shared,
            ticks.len()
        );
    }
    // The saved guests as their boots left them: one kernel registered, one did not.
    assert!(off.stderr_text().contains("no guest CRNG registered"));
    assert!(vm.stderr_text().contains("guest kernel's CRNG registered"));
    off.shutdown(Duration::from_secs(60));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linux_library_clones_run_commands_through_their_guest_agent() {
    if !kvm_available("linux_library_exec") {
        return;
    }
    // A template of the C runtime waiting and the guest agent on vsock port 1024,
    // restored by the library from a cached snapshot (booted and saved the first
    // time); a clone made on request runs commands through its own agent.
    let scratch = Scratch::new("linux-library-exec");
    let args = linux_args(
        None,
        "forkvm.agent=1024",
        "forkvm-fn info",
        &["--template", "--vsock", tests::cache::VSOCK],
    );
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let boot = tests::cache::CachedBoot {
        name: "linux-library-exec",
        run_args: &args,
        ready: &|vm| pause_where_runtime_waits(vm, "forkvm-fn"),
    };
    let dir = tokio::task::block_in_place(|| tests::cache::saved(&boot, LINUX_BOOT));
    let mut spec = forkvm::TemplateSpec::new("unused: the snapshot's guest runs");
    spec.vmm = tests::vmm_bin();
    spec.warm_clones = 1;
    let vsock = scratch.path("vm.vsock");
    spec.args = vec!["--vsock".into(), vsock.display().to_string()];
    spec.start_timeout = LINUX_BOOT;
    // A fresh clone's first command forks and execs in the guest (emulated kernel work
    // on a PVM host): a few seconds, but more than 60 once with two test suites and a
    // busy loop on the 2 cores.
    spec.call_timeout = Duration::from_secs(180);
    let t = forkvm::Template::restore(&dir, spec).await.unwrap();
    let mut clones = t.create_clones(&Default::default()).await.unwrap();
    let c = clones.pop().unwrap();
    let out = c
        .exec(
            1024,
            "read x; echo got-$x; forkvm-clone --id; exit 7",
            b"hello\n",
        )
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.output);
    assert_eq!(out.status, 7, "{text}");
    assert_eq!(text, format!("got-hello\n{}\n", c.id()));
    // Nobody on port 999: the agent's error, typed.
    let e = c.exec(999, "true", b"").await.unwrap_err();
    assert!(matches!(e, forkvm::Error::Agent(_)), "{e}");
    // The clone still serves invocations in place.
    let keep = InvokeOptions {
        keep_alive: true,
        ..Default::default()
    };
    let r = c.invoke(&b"after exec"[..], &keep).await.unwrap();
    assert_eq!(r.clone_id, c.id());
    c.delete().await.unwrap();
    t.shutdown().await.unwrap();
}
