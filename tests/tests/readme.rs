//! The README's "Using the monitor" command block, run as a newcomer would paste it:
//! every command in order, in one shell that stops at the first failure, with this
//! build's programs on `PATH` (the README puts `target/release` there after `make demo`;
//! the test puts the directory of the build it belongs to) and the block's `/tmp/`
//! paths moved into a scratch directory. Booting is part of what the block shows, so
//! its guests boot (two Linux VMs and a Python template) instead of restoring cached
//! snapshots.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use tests::{kvm_available, repo_root, workspace_bin, Scratch};

/// Three Linux boots, a Python start and a numpy import on this PVM host, beside other
/// tests: minutes.
const LIMIT: Duration = Duration::from_secs(900);

/// The first `sh` block after `heading` in `text`.
fn sh_block<'a>(text: &'a str, heading: &str) -> &'a str {
    let section = &text[text.find(heading).expect("the heading")..];
    let start = section.find("```sh\n").expect("a sh block") + "```sh\n".len();
    let len = section[start..].find("\n```").expect("the block's end");
    &section[start..start + len + 1]
}

/// Whether any process is still in process group `pgid`.
fn group_alive(pgid: i32) -> bool {
    // SAFETY: signal 0 only checks that the group exists; no signal is sent.
    unsafe { libc::kill(-pgid, 0) == 0 }
}

#[test]
fn the_readme_command_block_runs_as_written() {
    if !kvm_available("the_readme_command_block_runs_as_written") {
        return;
    }
    let readme = std::fs::read_to_string(repo_root().join("README.md")).expect("README.md");
    let block = sh_block(&readme, "## Using the monitor");
    assert!(
        block.contains("vmm run") && block.contains("vmm invoke"),
        "{block}"
    );
    let scratch = Scratch::new("readme");
    let dir = scratch.path("");
    let script = block.replace("/tmp/", &dir.display().to_string());
    // Every VM the block starts in the background has ended when the shell does.
    let script = format!("set -e -o pipefail\n{script}wait\n");
    let bin_dir = workspace_bin("vmm").parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}",
        bin_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let log_path = scratch.path("out.log");
    let log = std::fs::File::create(&log_path).unwrap();
    let mut shell = Command::new("bash")
        .arg("-c")
        .arg(&script)
        .current_dir(repo_root())
        .env("PATH", path)
        .stdin(Stdio::null())
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        // A group of its own, so that whatever it leaves running can be found and ended.
        .process_group(0)
        .spawn()
        .expect("bash");
    let pgid = shell.id() as i32;
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = shell.try_wait().unwrap() {
            break Some(s);
        }
        if t0.elapsed() > LIMIT {
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    // Whatever it left (a VM that did not stop, on failure) is ended with the group.
    let leftover = group_alive(pgid);
    if leftover {
        // SAFETY: the group is this test's shell's own (process_group(0) above).
        unsafe { libc::kill(-pgid, libc::SIGKILL) };
        if status.is_none() {
            let _ = shell.wait();
        }
    }
    let mut out = String::new();
    std::fs::File::open(&log_path)
        .unwrap()
        .read_to_string(&mut out)
        .unwrap();
    let status = status.unwrap_or_else(|| panic!("not done in {LIMIT:?}; its output:\n{out}"));
    assert!(status.success(), "{status}; its output:\n{out}");
    assert!(
        !leftover,
        "processes left after the block ended; its output:\n{out}"
    );
    // What each step shows: the guest's kernel through the agent, the two clones, the
    // snapshot, the function's answer from a fresh clone, the derived template's
    // socket, the spec.
    for needle in [
        "Linux forkvm ",
        "vm.sock.1",
        "vm.sock.2",
        "\"memory_bytes\":",
        "\"input\": \"hello\", \"clone\": ",
        "x-forkvm-socket: ",
        "openapi: 3",
    ] {
        assert!(out.contains(needle), "no {needle:?} in its output:\n{out}");
    }
    eprintln!(
        "the README's block ran in {:.0} s",
        t0.elapsed().as_secs_f64()
    );
}
