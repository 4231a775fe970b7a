//! Where the programs the library starts are found.

use std::path::PathBuf;

/// Program `name`: `$var` if set, else `name` beside the current executable if there is
/// one, else `name` (from `PATH`).
pub(crate) fn beside_exe(name: &str, var: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(var) {
        return p.into();
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.join(name)));
    beside
        .filter(|p| p.is_file())
        .unwrap_or_else(|| name.into())
}
