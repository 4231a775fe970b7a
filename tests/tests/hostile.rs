//! A malicious guest (issue 23): the tiny guest's `hostile=N` mode has every vCPU write
//! random values to random ports of forkvm's range and read them back (the clone port,
//! the CRNG registration, the probe, identity, clock and entropy ports, the invoke
//! reply and mailbox ports, and unused ones), at any offset. The VMM stays up and
//! serves, its memory, descriptors and log stay bounded, and a VM beside it is
//! untouched.

use std::time::Duration;

use serde_json::Value;
use tests::{count_dir, kvm_available, Scratch, Vm};

const BOOT: Duration = Duration::from_secs(60);

fn status_kib(pid: u32, key: &str) -> u64 {
    let text = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = text.lines().find(|l| l.starts_with(key)).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
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
        tests::tiny_vm_with(scratch, "64", "2", cmdline, &["--max-clones", "4"])
    };
    let (s1, s2) = (Scratch::new("hostile"), Scratch::new("hostile-neighbour"));
    let mut neighbour = start(&s2, "ticks=1 beat=10");
    neighbour.wait_console("tiny: beat 1\n", BOOT);
    let mut vm = start(&s1, "ticks=1 beat=10 hostile=200");
    vm.wait_console("tiny: cpu 0 timer ok", BOOT);
    let pid = vm.child.id();
    let (rss, fds) = (
        status_kib(pid, "VmRSS:"),
        count_dir(format!("/proc/{pid}/fd")),
    );
    let neighbour_beats = beats(&neighbour);
    let long = Duration::from_secs(600);
    vm.wait_console("tiny: cpu 0 hostile done", long);
    vm.wait_console("tiny: cpu 1 hostile done", long);
    // The guest goes on: its timer, serial port and heartbeat still work.
    let now = beats(&vm);
    vm.wait_console(&format!("tiny: beat {}\n", now + 3), BOOT);
    let v = vm.describe();
    assert_eq!(v["state"], "running", "{v}");
    let (rss_after, fds_after) = (
        status_kib(pid, "VmRSS:"),
        count_dir(format!("/proc/{pid}/fd")),
    );
    let log = vm.stderr_text();
    let log_lines = log.lines().count();
    // Refused clone requests: counted, logged the first ten times and at each power of
    // two ("(N so far)").
    let refusals: Vec<u64> = (log.lines())
        .filter(|l| l.contains("guest clone request on vCPU"))
        .filter_map(|l| {
            l.rsplit_once(" (")?
                .1
                .strip_suffix(" so far)")?
                .parse()
                .ok()
        })
        .collect();
    let refused = refusals.iter().copied().max().unwrap_or(0);
    let (_, list) = vm.api("GET", "/clones", None);
    let clones = serde_json::from_str::<Value>(&list).unwrap()["clones"]
        .as_array()
        .unwrap()
        .len();
    eprintln!(
        "hostile: 2 vCPUs x 200,000 port accesses: VMM RSS {rss} -> {rss_after} KiB, fds \
         {fds} -> {fds_after}, {log_lines} log lines, clone requests refused: at least \
         {refused} ({} logged), {clones} clones the guest made",
        refusals.len()
    );
    assert!(
        rss_after < rss + 8 * 1024,
        "RSS grew {rss} -> {rss_after} KiB"
    );
    assert!(fds_after <= fds + 2, "descriptors {fds} -> {fds_after}");
    assert!(
        refused > 10,
        "the guest's clone requests were not refused: {refusals:?}"
    );
    assert!(refusals.len() <= 10 + 64, "{refusals:?}");
    assert!(log_lines < 200, "{log_lines} log lines:\n{log}");
    assert!(clones <= 4, "{list}");
    // The VM beside it kept its pace.
    assert!(beats(&neighbour) > neighbour_beats, "the neighbour stopped");
    vm.shutdown(BOOT);
    neighbour.shutdown(BOOT);
}
