//! `PUT /snapshot`: a paused VM saved to a directory (docs/snapshots.md).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

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
