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
pub mod vm;

pub use cgroup::{CloneCgroup, ResourceClass, Usage};
pub use clones::{
    CloneAddresses, CloneConsole, CloneInfo, CloneList, CloneNet, CloneRateLimits, CloneStatus,
    CreateClones,
};
pub use invoke::{InvokeOptions, InvokeReport, Outcome};
pub use net::{Ipv4Cidr, MacAddr};
pub use rate_limit::RateLimit;
pub use vm::{Action, ActionType, TargetState, VmInfo, VmState, VmUpdate};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

/// The body of every error answer: `{"error": "message"}`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct ErrorBody {
    /// What went wrong, for a person to read.
    pub error: String,
}
