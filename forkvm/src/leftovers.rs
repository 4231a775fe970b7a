//! What library processes that were killed left behind: files and jails named after
//! their pid (`<prefix><pid>-...`), removed by a later start once that pid is gone.

use std::ffi::OsStr;
use std::path::Path;

/// Whether process `pid` runs (a pid reused since counts as running: its files are then
/// left for a later sweep).
fn runs(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `name` is `<prefix><pid>-...` and that pid no longer runs.
pub(crate) fn left_by_dead_process(name: &OsStr, prefix: &str) -> bool {
    let pid = (name.to_str())
        .and_then(|n| n.strip_prefix(prefix))
        .and_then(|n| n.split_once('-'))
        .and_then(|(p, _)| p.parse().ok());
    pid.is_some_and(|p| !runs(p))
}
