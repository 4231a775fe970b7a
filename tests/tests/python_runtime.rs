//! The guest's Python runtime (guest/python/forkvm.py) where it needs no VM: its loader,
//! warm-up events included, run by the host's Python 3 (the guest image's is the same
//! Debian 3.11). The runtime in a guest is tested by linux_invoke.rs and gateway.rs.

use std::path::Path;
use std::process::Command;

#[test]
fn the_runtimes_loader_warms_handlers_up_and_refuses_bad_loads_with_reasons() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/test_runtime_loader.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg("-v")
        .output()
        .expect("python3 runs (scripts/install-deps.sh installs it)");
    let text = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    // Tests ran, and none was skipped.
    let ran = text.lines().find_map(|l| {
        l.strip_prefix("Ran ")?
            .split(' ')
            .next()?
            .parse::<u32>()
            .ok()
    });
    assert!(ran.is_some_and(|n| n > 0), "{text}");
    assert!(
        text.trim_end().ends_with("OK") && !text.contains("skipped"),
        "{text}"
    );
}
