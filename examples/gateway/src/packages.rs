//! Functions' package sets (`requirements`, the gateway's `--package-cache`) as the
//! gateway shows them: in `GET /functions` and `GET /package-sets`.

use std::collections::BTreeSet;

use serde::Serialize;

/// A function's package set, as `GET /functions` shows it.
#[derive(Debug, Clone, Serialize)]
pub struct PackageSetInfo {
    /// Its key: functions with the same key share its image and zygotes.
    pub key: String,
    /// The distributions in it, `name==version`.
    pub resolved: Vec<String>,
}

/// A package set as `GET /package-sets` shows it.
#[derive(Debug, Default, Serialize)]
pub struct PackageSetView {
    /// Its key.
    pub key: String,
    /// What it resolved to (known once a function of it is deployed).
    pub resolved: Vec<String>,
    /// The deployed functions that have it.
    pub functions: Vec<String>,
    /// What its cached zygotes imported (`[]`: its root).
    pub zygotes: Vec<BTreeSet<String>>,
}
