//! A malicious guest: the tiny guest's `hostile=N` mode has every vCPU write
//! random values to random ports of forkvm's range and read them back (the clone port,
//! the CRNG registration, the probe, identity, clock and entropy ports, the invoke
//! reply and mailbox ports, and unused ones), at any offset. The VMM stays up and
//! serves, its memory, descriptors and log stay bounded, and a VM beside it is
//! untouched.

use std::collections::BTreeMap;
use std::time::Duration;

use serde_json::Value;
use tests::{kvm_available, Scratch, Vm};

const BOOT: Duration = Duration::from_secs(60);

/// Checks the guest goes on (its timer, serial port and heartbeat: three more beats)
/// and the VM is running; then the VMM's RSS and descriptors.
fn beats_on_then_counts(vm: &mut Vm) -> (u64, usize) {
    let now = beats(vm);
    vm.wait_console(&format!("tiny: beat {}\n", now + 3), BOOT);
    let v = vm.describe();
    assert_eq!(v["state"], "running", "{v}");
    tests::rss_and_fds(vm.child.id())
}

fn beats(vm: &Vm) -> usize {
    vm.console_text().matches("tiny: beat ").count()
}

#[test]
fn a_guest_writing_garbage_to_every_port_from_every_vcpu_leaves_the_vmm_serving_and_bounded() {
    if !kvm_available("hostile_ports") {
        return;
    }
    let start = |scratch: &Scratch, cmdline: &str| {
        let limits = ["--max-clones", "4", "--max-tree-clones", "6"];
        tests::tiny_vm_with(scratch, "64", "2", cmdline, &limits)
    };
    let (s1, s2) = (Scratch::new("hostile"), Scratch::new("hostile-neighbour"));
    let mut neighbour = start(&s2, "ticks=1 beat=10");
    neighbour.wait_console("tiny: beat 1\n", BOOT);
    let mut vm = start(&s1, "ticks=1 beat=10 hostile=200");
    vm.wait_console("tiny: cpu 0 timer ok", BOOT);
    let (rss, fds) = tests::rss_and_fds(vm.child.id());
    let neighbour_beats = beats(&neighbour);
    let long = Duration::from_secs(600);
    vm.wait_console("tiny: cpu 0 hostile done", long);
    vm.wait_console("tiny: cpu 1 hostile done", long);
    let (rss_after, fds_after) = beats_on_then_counts(&mut vm);
    let log = vm.stderr_text();
    let log_lines = log.lines().count();
    // The guest's clones go on with its loop, each in its own VMM process writing to
    // this log, its lines tagged "[clone 2.1] " (the template's are not). Per VM,
    // refused clone requests are counted, logged the first ten times and at each power
    // of two ("(N so far)"), so each VM's counts rise.
    let mut vms: BTreeMap<&str, (usize, Vec<u64>)> = BTreeMap::new();
    for line in log.lines() {
        let (tag, rest) = match line.strip_prefix('[').and_then(|l| l.split_once("] ")) {
            Some((tag, rest)) => (tag, rest),
            None => ("template", line),
        };
        let (lines, refusals) = vms.entry(tag).or_default();
        *lines += 1;
        if !rest.contains("guest clone request on vCPU") {
            continue;
        }
        let n = rest
            .rsplit_once(" (")
            .and_then(|(_, n)| n.strip_suffix(" so far)"));
        refusals.push(
            n.and_then(|n| n.parse().ok())
                .unwrap_or_else(|| panic!("{line}")),
        );
    }
    let made: usize = (log.lines())
        .filter_map(|l| {
            l.split_once(" made ")?
                .1
                .split_once(" clone(s)")?
                .0
                .parse::<usize>()
                .ok()
        })
        .sum();
    // A clone's count goes on from its parent's at the fork, so the largest is a bound.
    let refused = vms.values().filter_map(|(_, r)| r.last()).max().copied();
    let refused = refused.unwrap_or(0);
    let logged: usize = vms.values().map(|(_, r)| r.len()).sum();
    let (_, list) = vm.api("GET", "/clones", None);
    let clones = serde_json::from_str::<Value>(&list).unwrap()["clones"]
        .as_array()
        .unwrap()
        .len();
    eprintln!(
        "hostile: 2 vCPUs x 200,000 port accesses: VMM RSS {rss} -> {rss_after} KiB, fds \
         {fds} -> {fds_after}, {log_lines} log lines from {} VMs (the template and the \
         {made} clones the guests made, {clones} of them the template's), clone requests \
         refused: at least {refused} ({logged} logged)",
        vms.len(),
    );
    assert!(
        rss_after < rss + 8 * 1024,
        "RSS grew {rss} -> {rss_after} KiB"
    );
    assert!(fds_after <= fds + 2, "descriptors {fds} -> {fds_after}");
    assert!(refused > 10, "the guest's clone requests were not refused");
    assert!(
        vms.len() <= 1 + made,
        "{} tags, {made} clones:\n{log}",
        vms.len()
    );
    // The guests' clones, clones of clones among them, stay within the tree's bound.
    assert!(made <= 6, "{made} clones in a tree of at most 6:\n{log}");
    let v = vm.describe();
    assert!(v["clone_tree"]["taken"].as_u64().unwrap() <= 6, "{v}");
    for (tag, (lines, refusals)) in &vms {
        assert!(
            refusals.windows(2).all(|w| w[0] < w[1]),
            "{tag}: its refusal counts do not rise (lines of another VM?): {refusals:?}"
        );
        assert!(refusals.len() <= 10 + 64, "{tag}: {refusals:?}");
        assert!(*lines < 100, "{tag}: {lines} log lines:\n{log}");
    }
    assert!(clones <= 4, "{list}");
    // The VM beside it kept its pace.
    assert!(beats(&neighbour) > neighbour_beats, "the neighbour stopped");
    vm.shutdown(BOOT);
    neighbour.shutdown(BOOT);
}

/// Lines of the VMM's log that name `what`.
fn log_count(vm: &Vm, what: &str) -> usize {
    vm.stderr_text()
        .lines()
        .filter(|l| l.contains(what))
        .count()
}

#[test]
fn a_guest_driving_every_virtio_device_badly_leaves_the_vmm_serving_and_bounded() {
    // The tiny guest's `hostile_virtio=N` (docs/tiny-guest.md): N rounds in which every
    // virtio device (disk, rng, vsock, net on a tap that is down) is reset, given random
    // features, queues of random sizes with rings in or outside memory, then descriptor
    // tables and rings rewritten at random while its worker reads them (loops, addresses
    // past the end of memory, absurd lengths, heads beyond the queue), notified, and
    // poked at a random register; interrupts are never acknowledged. At the end it
    // resets every device.
    if !kvm_available("hostile_virtio") {
        return;
    }
    const ROUNDS: u32 = 15;
    let (s1, s2) = (
        Scratch::new("hostile-virtio"),
        Scratch::new("hostile-virtio-n"),
    );
    let mut neighbour = tests::tiny_vm_with(&s2, "64", "1", "ticks=1 beat=10", &[]);
    neighbour.wait_console("tiny: beat 1\n", BOOT);
    let disk = s1.path("disk.img");
    std::fs::write(&disk, vec![0x5a; 1 << 20]).unwrap();
    let vsock = s1.path("vm.vsock");
    let tap = format!("fkh{}", std::process::id() % 100_000_000);
    let cmdline = format!("ticks=1 beat=10 hostile_virtio={ROUNDS}");
    let mut vm = tests::tiny_vm_with(
        &s1,
        "64",
        "1",
        &cmdline,
        &[
            "--disk",
            disk.to_str().unwrap(),
            "--rng",
            "--vsock",
            vsock.to_str().unwrap(),
            "--tap",
            &tap,
        ],
    );
    vm.wait_console("tiny: hostile virtio start", BOOT);
    let started = std::time::Instant::now();
    let (rss, fds) = tests::rss_and_fds(vm.child.id());
    let neighbour_beats = beats(&neighbour);
    loop {
        let text = vm.console_text();
        if text.contains("tiny: hostile virtio done") {
            break;
        }
        assert!(
            !text.contains("unexpected exception"),
            "the guest faulted (a device wrote over its code?):\n{text}\n{}",
            vm.stderr_text()
        );
        assert!(started.elapsed() < Duration::from_secs(600), "{text}");
        std::thread::sleep(Duration::from_millis(100));
    }
    let took = started.elapsed();
    let (rss_after, fds_after) = beats_on_then_counts(&mut vm);
    let log = vm.stderr_text();
    let log_lines = log.lines().count();
    eprintln!(
        "hostile virtio: {ROUNDS} rounds over 4 devices in {took:?}: VMM RSS {rss} -> \
         {rss_after} KiB, fds {fds} -> {fds_after}, {log_lines} log lines ({} bad layouts, \
         {} chains not returnable)",
        log_count(&vm, "invalid layout"),
        log_count(&vm, "cannot return descriptor"),
    );
    assert!(
        rss_after < rss + 8 * 1024,
        "RSS grew {rss} -> {rss_after} KiB"
    );
    // The guest reset every device at the end, so no worker runs: every descriptor a
    // device's activations opened is closed again.
    assert!(fds_after <= fds, "descriptors {fds} -> {fds_after}");
    assert!(log_lines < 300, "{log_lines} log lines:\n{log}");
    // The devices' state, however the guest left it, is captured for a clone, which
    // runs.
    let (code, body) = vm.api("POST", "/clones", Some(r#"{"count":1,"console":"file"}"#));
    assert_eq!(code, 201, "{body}");
    let clone: Value = serde_json::from_str(&body).unwrap();
    let clone = &clone["clones"][0];
    let console = std::path::PathBuf::from(clone["console"].as_str().unwrap());
    let start = std::time::Instant::now();
    let clone_beats = || std::fs::read_to_string(&console).unwrap_or_default();
    while !clone_beats().contains("tiny: beat ") {
        assert!(
            start.elapsed() < BOOT,
            "the clone does not beat: {}",
            clone_beats()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, body) = vm.api(
        "DELETE",
        &format!("/clones/{}", clone["id"].as_str().unwrap()),
        None,
    );
    assert_eq!(code, 200, "{body}");
    // The VM beside it kept its pace.
    assert!(beats(&neighbour) > neighbour_beats, "the neighbour stopped");
    vm.shutdown(BOOT);
    neighbour.shutdown(BOOT);
    assert!(!vsock.exists(), "the vsock socket was left");
    let links = std::process::Command::new("ip")
        .args(["link", "show", &tap])
        .output()
        .unwrap();
    assert!(!links.status.success(), "tap {tap} was left");
}
