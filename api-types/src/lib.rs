//! The types of forkvm's control API: every request, response and error body, with both
//! `Serialize` and `Deserialize`, and the text syntax of option values (rate limits,
//! resource classes, sizes) that command lines and request bodies share.
//!
//! The VMM's API edge, the `vmm` command line, the tests and client libraries all use
//! these types, so what the server sends and what clients read cannot drift apart.
//! The crate has no KVM dependency. `docs/api/openapi.yaml` describes the same bodies.
//!
//! | endpoint | request | answer |
//! |---|---|---|
//! | `GET /vm` | | 200 [`VmInfo`] |
//! | `PATCH /vm` | [`VmUpdate`] | 204 |
//! | `PUT /actions` | [`Action`] | 204 |
//! | `POST /clones` | [`CreateClones`] (optional) | 201 [`CloneList`] |
//! | `GET /clones` | | 200 [`CloneList`] |
//! | `DELETE /clones/{id}` | | 200 [`CloneInfo`] |
//! | `PUT /snapshot` | [`CreateSnapshot`] | 201 [`SnapshotInfo`] |
//! | `POST /invocations` | the payload; [`InvokeOptions`] in the query | 200 the reply |
//!
//! Every error answer carries an [`ErrorBody`].
#![deny(missing_docs)]

pub mod cgroup;
pub mod clones;
pub mod invoke;
pub mod net;
pub mod options;
pub mod rate_limit;
pub mod snapshot;
pub mod vm;

pub use cgroup::{CloneCgroup, ResourceClass, Usage};
pub use clones::{
    CloneAddresses, CloneConsole, CloneInfo, CloneList, CloneNet, CloneRateLimits, CloneStatus,
    CreateClones, InsertMedium, SlotMedium, MAX_DISK_SLOTS,
};
pub use invoke::{InvokeOptions, InvokeReport, Outcome};
pub use net::{Ipv4Cidr, MacAddr};
pub use rate_limit::RateLimit;
pub use snapshot::{CreateSnapshot, SnapshotInfo};
pub use vm::{Action, ActionType, TargetState, VmInfo, VmState, VmUpdate};

use schemars::JsonSchema;
use serde::de::{Deserializer, MapAccess, Visitor};

/// Deserializes a `T` from an object only: serde's derived structs also take an array
/// of their fields in order, which no client means and the schema does not allow.
/// `#[serde(deserialize_with = "crate::object")]`, or for a request body.
pub fn object<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<T, D::Error> {
    struct Object<T>(std::marker::PhantomData<T>);
    impl<'de, T: Deserialize<'de>> Visitor<'de> for Object<T> {
        type Value = T;
        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("an object")
        }
        fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
            T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
        }
    }
    d.deserialize_map(Object(std::marker::PhantomData))
}

/// As [`object`], for an array of objects.
pub fn objects<'de, D: Deserializer<'de>, T: Deserialize<'de>>(d: D) -> Result<Vec<T>, D::Error> {
    struct Item<T>(T);
    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Item<T> {
        fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
            object(d).map(Item)
        }
    }
    let items: Vec<Item<T>> = Vec::deserialize(d)?;
    Ok(items.into_iter().map(|i| i.0).collect())
}
use serde::{Deserialize, Serialize};

/// The body of every error answer: `{"error": "message"}`, and for an invocation that
/// ended without a reply, what its handler printed until then when the runtime kept it
/// (`logs`, `logs_dropped`).
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    /// What went wrong, for a person to read.
    pub error: String,
    /// An invocation that timed out or whose guest stopped: what the handler wrote to
    /// its output until then (its last 64 KiB, UTF-8), from the runtime's live log in
    /// the mailbox (docs/invoke.md, "The live log"). Absent when the runtime kept none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logs: Option<String>,
    /// With `logs`: bytes of output dropped before them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logs_dropped: Option<u64>,
}

impl ErrorBody {
    /// An error answer's body with `error` alone.
    pub fn new(error: impl Into<String>) -> Self {
        Self {
            error: error.into(),
            ..Self::default()
        }
    }
}
