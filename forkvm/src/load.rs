//! What the Python runtime's loader takes (a load request, docs/invoke.md): packages to
//! import, and a handler's source.

use std::collections::BTreeSet;

use bytes::Bytes;
use serde::Serialize;

/// A load request for forkvm's Python runtime (`forkvm.serve`): imports `imports`,
/// then runs `source` (if any) as the module `forkvm_function` and serves its
/// `handler` from then on. Its JSON is [`Load::payload`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Load {
    /// Modules to import (the zygote's package set).
    pub imports: BTreeSet<String>,
    /// A handler's Python source.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// The function that serves: a name in `source` (default `handler` when there is
    /// source), or `MODULE:FUNCTION`. None with no source: the handler stays as it was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub handler: Option<String>,
}

impl Load {
    /// A load that imports `packages` and nothing else.
    pub fn imports<I, S>(packages: I) -> Self
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        Self {
            imports: packages.into_iter().map(Into::into).collect(),
            ..Default::default()
        }
    }

    /// The request's payload: the JSON object the runtime's loader reads.
    pub fn payload(&self) -> Bytes {
        // A struct of strings always serializes.
        Bytes::from(serde_json::to_vec(self).unwrap_or_default())
    }
}

impl From<&Load> for Bytes {
    fn from(load: &Load) -> Bytes {
        load.payload()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_payload_is_the_loaders_json() {
        let l = Load::imports(["numpy", "json"]);
        assert_eq!(&l.payload()[..], br#"{"imports":["json","numpy"]}"#);
        let l = Load {
            source: Some("def handler(e):\n    return e\n".into()),
            ..Load::imports(["json"])
        };
        let v: serde_json::Value = serde_json::from_slice(&l.payload()).unwrap();
        assert_eq!(v["source"], "def handler(e):\n    return e\n");
        assert!(v.get("handler").is_none());
    }
}
