//! Invocations (`POST /invocations`, docs/invoke.md): the options a request takes in its
//! query string, the headers its answer carries, and the runtime's state in `GET /vm`.
//!
//! The request body is the payload, as is; the answer's body is the handler's reply, as
//! is (200), or an [`crate::ErrorBody`] (4xx, 5xx).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use std::net::Ipv4Addr;

use crate::clones::{CloneAddresses, CloneRateLimits};
use crate::net::Ipv4Cidr;
use crate::rate_limit::{RateLimit, RateLimitText};

/// Header of every invocation answer from a VM that ran the handler: how it ended
/// ([`Outcome`]).
pub const HEADER_OUTCOME: &str = "x-forkvm-outcome";
/// Header: the id of the VM that ran the handler: the clone made for it, or, in place, the
/// VM's own ("" for an original VM).
pub const HEADER_CLONE_ID: &str = "x-forkvm-clone-id";
/// Header: the control socket of the VM that ran the handler (a keep-alive clone takes
/// further invocations there).
pub const HEADER_SOCKET: &str = "x-forkvm-socket";
/// Header: microseconds from the request's arrival to the clone's vCPUs starting with
/// the request in its mailbox.
pub const HEADER_CLONE_US: &str = "x-forkvm-clone-us";
/// Header: microseconds from then to the runtime's reply.
pub const HEADER_HANDLER_US: &str = "x-forkvm-handler-us";
/// Header: microseconds from the request's arrival to the reply taken.
pub const HEADER_TOTAL_US: &str = "x-forkvm-total-us";
/// Header: "true" when the VM that ran the handler was a primed warm clone (its runtime
/// ran its serving path once before the request, without the handler), else "false".
pub const HEADER_PRIMED: &str = "x-forkvm-primed";
/// Header: microseconds by which the VMM moved the handler's deferred timer interrupt
/// beyond `--tick-defer-ms`, for the time its vCPU waited for a host CPU (0: not moved).
pub const HEADER_STRETCHED_US: &str = "x-forkvm-stretched-us";

/// The largest timeout an invocation may ask for.
pub const MAX_TIMEOUT_MS: u64 = 3_600_000;
/// The timeout of an invocation that names none.
pub const DEFAULT_TIMEOUT_MS: u64 = 30_000;
/// The timeout of a derive request that names none: a load imports packages, which
/// takes far longer than a handler's run (seconds on a hardware KVM host, a minute or
/// more where the guest kernel is emulated).
pub const DEFAULT_DERIVE_TIMEOUT_MS: u64 = 300_000;

/// The options of `POST /invocations`, from its query string
/// (`?timeout_ms=500&keep_alive=true`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InvokeOptions {
    /// How long the handler may take, in milliseconds (default 30000, 300000 for a
    /// derive request's load; at most 3600000); past it the answer is 504 and the
    /// clone is stopped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = MAX_TIMEOUT_MS))]
    pub timeout_ms: Option<u64>,
    /// The clone's resource class (with cgroup pools), as for `POST /clones`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_class: Option<String>,
    /// After replying, the clone waits for further invocations on its own control
    /// socket (the answer's `x-forkvm-socket`) instead of ending.
    #[serde(default)]
    pub keep_alive: bool,
    /// Derive a template: the payload goes to the runtime's **loader** (a load
    /// request, mailbox kind 3: the Python runtime imports packages and loads a
    /// handler's source), not to its handler, and once the runtime replied and waits
    /// again the clone is a template of its own (paused there, with warm clones),
    /// serving invocations on its socket (the answer's `x-forkvm-socket`) until it is
    /// stopped. Refused (409) unless the runtime declared that it loads (its wait
    /// header's feature bit 1). Implies `keep_alive`.
    #[serde(default)]
    pub derive: bool,
    /// The clone's disk rate limit (`bytes=2M,ops=100`).
    #[serde(
        default,
        with = "crate::rate_limit::text",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<RateLimitText>")]
    pub disk_rate: Option<RateLimit>,
    /// The clone's network rate limit.
    #[serde(
        default,
        with = "crate::rate_limit::text",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<RateLimitText>")]
    pub net_rate: Option<RateLimit>,
    /// The clone's entropy device rate limit.
    #[serde(
        default,
        with = "crate::rate_limit::text",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<RateLimitText>")]
    pub rng_rate: Option<RateLimit>,
    /// A tap the caller made for the clone (as `taps` in `POST /clones`), instead of
    /// the `fkvm<pid>` it creates: a tap already on the caller's bridge or in its
    /// namespace carries the handler's traffic from its first frame.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,14}$"))]
    pub tap: Option<String>,
    /// The clone's own guest address (`10.0.0.5/24`; as `addresses` in
    /// `POST /clones`). The runtime takes it, with the clone's own MAC and `gateway`,
    /// before the handler runs, and aborts the TCP connections the template held from
    /// its address (docs/shared-storage.md).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<Ipv4Cidr>,
    /// The clone's default gateway (with `ipv4`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<Ipv4Addr>,
    /// Images for the clone's disk slots (as `media` in `POST /clones`): `SLOT:PATH`
    /// (read-only) or `rw:SLOT:PATH` (writable through a private overlay),
    /// comma-separated (a path may not contain a comma). A derived template's clones
    /// inherit them.
    #[serde(
        default,
        with = "crate::clones::media_text",
        skip_serializing_if = "Vec::is_empty"
    )]
    #[schemars(with = "Option<String>")]
    #[schemars(regex(pattern = r"^((rw:)?[0-7]:[^,]+)(,(rw:)?[0-7]:[^,]+)*$"))]
    pub media: Vec<crate::InsertMedium>,
}

impl InvokeOptions {
    /// Whether the VM that serves the request stays after it (keep-alive, or derive).
    pub fn stays(&self) -> bool {
        self.keep_alive || self.derive
    }

    /// The timeout asked for, or the default (a derive request's is longer).
    pub fn timeout_ms(&self) -> u64 {
        self.timeout_ms.unwrap_or(if self.derive {
            DEFAULT_DERIVE_TIMEOUT_MS
        } else {
            DEFAULT_TIMEOUT_MS
        })
    }

    /// The per-clone rate limits asked for.
    pub fn rate_limits(&self) -> CloneRateLimits {
        CloneRateLimits {
            disk: self.disk_rate,
            rng: self.rng_rate,
            net: self.net_rate,
        }
    }

    /// The guest addresses asked for (`ipv4`, `gateway`).
    pub fn addresses(&self) -> Option<CloneAddresses> {
        self.ipv4.map(|ipv4| CloneAddresses {
            ipv4,
            gateway: self.gateway,
        })
    }

    /// Whether the request asks for a clone's own network identity (`tap`, `ipv4`),
    /// which only a clone made for it can have.
    pub fn wants_own_net(&self) -> bool {
        self.tap.is_some() || self.ipv4.is_some()
    }

    /// Whether the request asks for what only a clone made for it can have: a network
    /// identity of its own, or images in its disk slots.
    pub fn wants_own_clone(&self) -> bool {
        self.wants_own_net() || !self.media.is_empty()
    }

    /// Checks the values.
    pub fn check(&self) -> Result<(), InvokeOptionsError> {
        if let Some(t) = self
            .timeout_ms
            .filter(|t| !(1..=MAX_TIMEOUT_MS).contains(t))
        {
            return Err(InvokeOptionsError::Timeout(t));
        }
        if let Some(t) = self.tap.as_ref().filter(|t| !crate::net::valid_ifname(t)) {
            return Err(InvokeOptionsError::TapName(t.clone()));
        }
        if self.gateway.is_some() && self.ipv4.is_none() {
            return Err(InvokeOptionsError::GatewayWithoutAddress);
        }
        Ok(())
    }
}

/// Why [`InvokeOptions::check`] refused the options.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvokeOptionsError {
    /// A timeout out of range.
    #[error("timeout_ms must be 1 to {MAX_TIMEOUT_MS}, not {0}")]
    Timeout(u64),
    /// A tap name Linux would refuse.
    #[error("invalid tap name {0:?}")]
    TapName(String),
    /// A gateway without an address: each part valid, but they do not fit together.
    #[error("gateway is given with ipv4 only")]
    GatewayWithoutAddress,
}

/// How an invocation ended, in the answer's `x-forkvm-outcome` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The handler returned: 200, the body is its reply.
    Ok,
    /// The handler failed: 500, the error names the runtime's text.
    HandlerError,
    /// The runtime's reply could not be read (garbage header, bad length): 502.
    BadReply,
    /// The guest stopped (crashed, powered off, ended) before it replied: 502.
    GuestStopped,
    /// No reply within the timeout: 504.
    Timeout,
}

impl Outcome {
    /// The header's text.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ok => "ok",
            Self::HandlerError => "handler_error",
            Self::BadReply => "bad_reply",
            Self::GuestStopped => "guest_stopped",
            Self::Timeout => "timeout",
        }
    }

    /// The answer's status.
    pub fn status(self) -> u16 {
        match self {
            Self::Ok => 200,
            Self::HandlerError => 500,
            Self::BadReply | Self::GuestStopped => 502,
            Self::Timeout => 504,
        }
    }
}

impl std::str::FromStr for Outcome {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        [
            Self::Ok,
            Self::HandlerError,
            Self::BadReply,
            Self::GuestStopped,
            Self::Timeout,
        ]
        .into_iter()
        .find(|o| o.as_str() == s)
        .ok_or_else(|| format!("unknown outcome {s:?}"))
    }
}

/// The VM's invocation side, in `GET /vm`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct InvokeReport {
    /// The mailbox's size in bytes (0: none).
    pub mailbox_bytes: u64,
    /// Whether the VM is a template (each invocation runs in a clone of it).
    pub template: bool,
    /// Whether a runtime waits on the invoke port: the VM takes invocations.
    pub waiting: bool,
    /// Whether an invocation runs in this VM now.
    pub in_flight: bool,
    /// Invocations handed to a clone or delivered in place so far.
    pub started: u64,
    /// Invocations held now until the runtime, on its way back to the invoke port,
    /// waits again.
    pub held: u64,
    /// How long the runtime waits idle before it is refreshed, in ms (0: never).
    pub refresh_idle_ms: u64,
    /// Refreshes of the idle runtime so far.
    pub refreshes: u64,
    /// How far a guest timer interrupt already due at a request's delivery is moved
    /// on, in ms (0: not).
    pub tick_defer_ms: u64,
    /// The memory this VMM process alone holds, in KiB (its private pages: the guest
    /// memory it wrote since it was cloned or booted, its own heap), measured when it
    /// last paused as a template, before its warm clones were made. What stopping the
    /// template would free at least; pages shared with its parent or its clones are
    /// not counted. None: never paused as a template, or `/proc` not readable.
    pub own_memory_kib: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn outcomes_read_back_and_map_to_statuses() {
        for o in [
            Outcome::Ok,
            Outcome::HandlerError,
            Outcome::BadReply,
            Outcome::GuestStopped,
            Outcome::Timeout,
        ] {
            assert_eq!(o.as_str().parse::<Outcome>(), Ok(o));
        }
        assert_eq!(Outcome::Timeout.status(), 504);
        assert!("nope".parse::<Outcome>().is_err());
    }

    #[test]
    fn options_are_checked() {
        let mut o = InvokeOptions::default();
        assert_eq!(o.timeout_ms(), DEFAULT_TIMEOUT_MS);
        assert!(o.check().is_ok());
        // A load's default is longer; a timeout asked for holds for both.
        o.derive = true;
        assert_eq!(o.timeout_ms(), DEFAULT_DERIVE_TIMEOUT_MS);
        o.timeout_ms = Some(500);
        assert_eq!(o.timeout_ms(), 500);
        o.derive = false;
        assert_eq!(o.timeout_ms(), 500);
        o.timeout_ms = Some(0);
        assert!(o.check().is_err());
        o.timeout_ms = Some(MAX_TIMEOUT_MS + 1);
        assert!(o.check().is_err());
        let mut o = InvokeOptions {
            gateway: Some("10.0.0.1".parse().unwrap()),
            ..InvokeOptions::default()
        };
        assert_eq!(o.check(), Err(InvokeOptionsError::GatewayWithoutAddress));
        o.ipv4 = Some("10.0.0.5/24".parse().unwrap());
        assert!(o.check().is_ok() && o.wants_own_net());
        assert_eq!(o.addresses().unwrap().gateway, o.gateway);
        o.tap = Some("no/slash".into());
        assert!(matches!(o.check(), Err(InvokeOptionsError::TapName(_))));
    }
}
