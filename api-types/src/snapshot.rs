//! `PUT /snapshot`: a paused VM saved to a directory (docs/snapshots.md).

use std::time::Duration;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// How long a VMM may take to answer `PUT /snapshot` (it answers 504 after): writing
/// many GiB of guest memory to a slow disk takes minutes. A client waits a little longer.
pub const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(600);

/// `PUT /snapshot`: where to write the snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateSnapshot {
    /// The snapshot's directory, an absolute path: it must not exist, its parent must
    /// (it is written beside it and renamed into place once complete).
    #[schemars(regex(pattern = r"^/.*[^/]/*$"))]
    pub dir: String,
}

/// A snapshot just written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct SnapshotInfo {
    /// Its directory.
    pub dir: String,
    /// Guest memory in bytes (the memory file's length, holes included).
    pub memory_bytes: u64,
    /// Bytes of guest memory written (pages that were not all zeros; the rest are holes).
    pub memory_written_bytes: u64,
    /// Bytes of the state file.
    pub state_bytes: u64,
    /// Bytes of the writable disks' overlays (their length, holes included).
    pub overlay_bytes: u64,
    /// How long writing it took, in milliseconds.
    pub took_ms: u64,
}
