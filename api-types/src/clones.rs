//! Clones: `POST /clones`, `GET /clones`, `DELETE /clones/{id}`.

use std::net::Ipv4Addr;
use std::path::PathBuf;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::cgroup::CloneCgroup;
use crate::net::{valid_ifname, Ipv4Cidr, MacAddr};
use crate::rate_limit::{RateLimit, RateLimitText};

/// Most clones one request may ask for.
pub const MAX_CLONES_PER_REQUEST: u32 = 1000;
/// The clone counts one request may ask for: 1 to [`MAX_CLONES_PER_REQUEST`].
pub const CLONE_COUNTS: std::ops::RangeInclusive<u64> = 1..=MAX_CLONES_PER_REQUEST as u64;

/// Where a clone's serial console goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
#[serde(rename_all = "snake_case")]
pub enum CloneConsole {
    /// A file per clone, `<clone socket>.console` (discarded when the parent's own
    /// console is `null`).
    #[default]
    File,
    /// Discarded.
    Null,
}

/// Rate limits for one clone's devices, replacing its template's for the devices
/// named; each written as on the command line (`"bytes=2K,ops=100"`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CloneRateLimits {
    /// Every disk, each with a bucket of its own.
    #[serde(
        default,
        with = "crate::rate_limit::text",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<RateLimitText>")]
    pub disk: Option<RateLimit>,
    /// The entropy device.
    #[serde(
        default,
        with = "crate::rate_limit::text",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<RateLimitText>")]
    pub rng: Option<RateLimit>,
    /// The network card, each direction.
    #[serde(
        default,
        with = "crate::rate_limit::text",
        skip_serializing_if = "Option::is_none"
    )]
    #[schemars(with = "Option<RateLimitText>")]
    pub net: Option<RateLimit>,
}

/// A clone's own guest addresses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CloneAddresses {
    /// Its address and prefix length.
    pub ipv4: Ipv4Cidr,
    /// Its default gateway (None: none).
    #[serde(default)]
    pub gateway: Option<Ipv4Addr>,
}

fn one() -> u64 {
    1
}

/// `POST /clones`: how many clones, and what each gets beyond its template's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateClones {
    /// How many (1 to [`MAX_CLONES_PER_REQUEST`]).
    #[serde(default = "one")]
    #[schemars(range(min = 1, max = MAX_CLONES_PER_REQUEST))]
    pub count: u64,
    /// Where their consoles go.
    #[serde(default)]
    pub console: CloneConsole,
    /// The resource class of their cgroups (None: the VMM's first `--cgroup-class`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub resource_class: Option<String>,
    /// Rate limits replacing the template's.
    #[serde(default, deserialize_with = "crate::object")]
    pub rate_limits: CloneRateLimits,
    /// Each clone's guest addresses, in order (empty: the template's).
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "crate::objects"
    )]
    pub addresses: Vec<CloneAddresses>,
    /// Each clone's tap, made by the caller, in order (empty: each makes its own); a
    /// Linux interface name (1 to 15 bytes, no `/`, `:` or white space).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(inner(regex(pattern = r"^[A-Za-z0-9_-][A-Za-z0-9_.-]{0,14}$")))]
    #[schemars(extend("uniqueItems" = true))]
    pub taps: Vec<String>,
    /// Whether the clones keep their disks' overlays when they end (None: as the
    /// template's disks say).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub keep_overlays: Option<bool>,
    /// Images inserted into the template's disk slots (`--disk-slots`), the same in
    /// every clone of the request, read-only; at most one per slot. The template and its
    /// other clones are untouched.
    #[serde(
        default,
        skip_serializing_if = "Vec::is_empty",
        deserialize_with = "crate::objects"
    )]
    #[schemars(length(max = MAX_DISK_SLOTS))]
    pub media: Vec<InsertMedium>,
}

/// Most disk slots a VM has (`--disk-slots`).
pub const MAX_DISK_SLOTS: usize = 8;

/// An image for one disk slot of a clone.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct InsertMedium {
    /// The slot (0 for the first; the slots come after the VM's disks).
    #[schemars(range(max = 7))]
    pub slot: u8,
    /// The image: a host file of whole 512-byte sectors, opened read-only by the
    /// template's VMM.
    pub path: std::path::PathBuf,
    /// Whether the guest may write it: its writes go to a private copy-on-write overlay
    /// of this clone's (in the VM's `--slot-cow-dir`), never to the image; a clone of
    /// the clone gets a copy of the overlay. Read-only by default.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub writable: bool,
}

/// An image for a disk slot of a running VM (`PUT /slots/{slot}`): the slot must be
/// empty. The guest's driver is told by a configuration-change interrupt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct SlotMedium {
    /// The image: a host file of whole 512-byte sectors, opened read-only by the VM's
    /// VMM.
    pub path: std::path::PathBuf,
    /// Whether the guest may write it: its writes go to a new copy-on-write overlay of
    /// this VM's (in its `--slot-cow-dir`), never to the image. Read-only by default.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub writable: bool,
}

impl std::fmt::Display for InsertMedium {
    /// `SLOT:PATH`, or `rw:SLOT:PATH` for a writable medium.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let rw = if self.writable { "rw:" } else { "" };
        write!(f, "{rw}{}:{}", self.slot, self.path.display())
    }
}

impl std::str::FromStr for InsertMedium {
    type Err = String;

    /// `SLOT:PATH`, or `rw:SLOT:PATH` for a writable medium (the slot's range is
    /// checked with the request).
    fn from_str(text: &str) -> Result<Self, String> {
        let (writable, rest) = match text.strip_prefix("rw:") {
            Some(rest) => (true, rest),
            None => (false, text),
        };
        let (slot, path) = (rest.split_once(':'))
            .filter(|(_, p)| !p.is_empty())
            .ok_or_else(|| format!("{text:?} is not SLOT:PATH or rw:SLOT:PATH"))?;
        let slot = (slot.parse()).map_err(|_| format!("{slot:?} is no disk slot number"))?;
        Ok(Self {
            slot,
            path: path.into(),
            writable,
        })
    }
}

/// Media as one text, `[rw:]SLOT:PATH[,[rw:]SLOT:PATH...]` (a query string's form: a
/// path may not contain a comma); empty: none.
pub mod media_text {
    use super::InsertMedium;
    use serde::{Deserialize, Deserializer, Serializer};

    /// Writes the media's text.
    pub fn serialize<S: Serializer>(media: &[InsertMedium], s: S) -> Result<S::Ok, S::Error> {
        let text: Vec<String> = media.iter().map(ToString::to_string).collect();
        s.collect_str(&text.join(","))
    }

    /// Reads the media's text.
    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<InsertMedium>, D::Error> {
        let text = String::deserialize(d)?;
        (text.split(',').filter(|p| !p.is_empty()))
            .map(|p| p.parse().map_err(serde::de::Error::custom))
            .collect()
    }
}

impl Default for CreateClones {
    fn default() -> Self {
        Self {
            count: 1,
            console: CloneConsole::File,
            resource_class: None,
            rate_limits: CloneRateLimits::default(),
            addresses: Vec::new(),
            taps: Vec::new(),
            keep_overlays: None,
            media: Vec::new(),
        }
    }
}

/// A `POST /clones` body wrong on its own: a count out of range, or parts that do not fit
/// together.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CreateClonesError {
    /// `count` out of its range.
    #[error("clone count must be 1 to {MAX_CLONES_PER_REQUEST}, not {0}")]
    Count(u64),
    /// `addresses` or `taps` not one per clone.
    #[error("{given} {what} for {count} clones: give one per clone or none")]
    PerClone {
        /// `addresses` or `taps`.
        what: &'static str,
        /// How many were given.
        given: usize,
        /// Clones asked for.
        count: u64,
    },
    /// A tap name Linux would refuse.
    #[error("invalid tap name {0:?}")]
    TapName(String),
    /// The same tap for two clones.
    #[error("tap {0:?} given twice")]
    TapTwice(String),
    /// A slot past the most a VM has.
    #[error("disk slot {0} does not exist: a VM has at most {MAX_DISK_SLOTS}")]
    Slot(u8),
    /// Two media for one slot.
    #[error("disk slot {0} given twice")]
    SlotTwice(u8),
}

impl CreateClones {
    /// Checks what the body can tell alone: the count's range, and the parts that must fit
    /// it (the VMM checks the rest: the devices the VM has, its classes, its live clones).
    pub fn check(&self) -> Result<(), CreateClonesError> {
        if !CLONE_COUNTS.contains(&self.count) {
            return Err(CreateClonesError::Count(self.count));
        }
        for (what, given) in [
            ("addresses", self.addresses.len()),
            ("taps", self.taps.len()),
        ] {
            if given != 0 && given as u64 != self.count {
                return Err(CreateClonesError::PerClone {
                    what,
                    given,
                    count: self.count,
                });
            }
        }
        for (i, tap) in self.taps.iter().enumerate() {
            if !valid_ifname(tap) {
                return Err(CreateClonesError::TapName(tap.clone()));
            }
            if self.taps[..i].contains(tap) {
                return Err(CreateClonesError::TapTwice(tap.clone()));
            }
        }
        for (i, m) in self.media.iter().enumerate() {
            if usize::from(m.slot) >= MAX_DISK_SLOTS {
                return Err(CreateClonesError::Slot(m.slot));
            }
            if self.media[..i].iter().any(|o| o.slot == m.slot) {
                return Err(CreateClonesError::SlotTwice(m.slot));
            }
        }
        Ok(())
    }
}

/// What became of a clone.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case", tag = "state", content = "code")]
pub enum CloneStatus {
    /// Made, its vCPU 0 not in the guest yet: a clone made for an invocation, whose
    /// start its template does not wait for (it answers its caller itself).
    Starting,
    /// Running (its vCPU 0 entered the guest).
    Running,
    /// Started but its vCPU 0 never reported entering the guest.
    Failed,
    /// Exited with this status.
    Exited(i32),
    /// Killed by this signal.
    Killed(i32),
    /// Killed by the OOM killer at its cgroup's memory limit.
    OomKilled,
}

impl CloneStatus {
    /// Not reaped yet (a clone that failed to report may still run).
    pub fn is_live(&self) -> bool {
        matches!(
            self,
            CloneStatus::Starting | CloneStatus::Running | CloneStatus::Failed
        )
    }
}

/// A clone's network card: the host configures the tap (address, bridge, namespace)
/// and may give the guest the MAC (docs/clone-network.md).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct CloneNet {
    /// Its tap (`fkvm<pid>` unless the request gave one); a tap the clone created
    /// disappears when it exits.
    pub tap: String,
    /// The MAC address in the clone's device configuration and identity block.
    pub mac: MacAddr,
    /// The address its identity block gives the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ipv4: Option<Ipv4Cidr>,
    /// The gateway its identity block gives the guest.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<Ipv4Addr>,
}

/// One clone, as `POST /clones`, `GET /clones` and `DELETE /clones/{id}` report it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CloneInfo {
    /// Clone id: the parent's id (if it is itself a clone), a dot, and a counter.
    pub id: String,
    /// Process id.
    pub pid: i32,
    /// The clone's own control socket.
    pub api_sock: PathBuf,
    /// The clone's console sink.
    pub console: PathBuf,
    /// The clone's vsock socket (with a vsock device).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub vsock: Option<PathBuf>,
    /// The clone's tap and MAC address (with a network card).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub net: Option<CloneNet>,
    /// Where the clone keeps its disks' overlays when it ends (not after SIGKILL).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kept_overlays: Vec<PathBuf>,
    /// From the request reaching the VMM to the clone's vCPU 0 entering the guest.
    pub latency_us: Option<u64>,
    /// What became of it.
    pub status: CloneStatus,
    /// Why it failed before it was ready (status `failed`), as it said.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Its pooled cgroup and usage (None when the VMM has no cgroup pools).
    pub cgroup: Option<CloneCgroup>,
}

/// `POST /clones` (201) and `GET /clones`: `{"clones": [...]}`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CloneList {
    /// The clones, oldest first.
    pub clones: Vec<CloneInfo>,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(json: &str) -> Result<CreateClones, String> {
        let b: CreateClones = serde_json::from_str(json).map_err(|e| e.to_string())?;
        b.check().map_err(|e| e.to_string())?;
        Ok(b)
    }

    #[test]
    fn create_clones_bodies() {
        assert_eq!(body("{}").unwrap(), CreateClones::default());
        let b = body(r#"{"count":2,"console":"null","taps":["t1","t2"],"keep_overlays":true}"#)
            .unwrap();
        assert_eq!(
            (b.count, b.console, b.keep_overlays),
            (2, CloneConsole::Null, Some(true))
        );
        let b = body(r#"{"rate_limits":{"net":"bytes=2K","rng":"ops=5"}}"#).unwrap();
        assert_eq!(b.rate_limits.net, Some("bytes=2K".parse().unwrap()));
        assert_eq!(b.rate_limits.disk, None);
        let b = body(r#"{"count":2,"addresses":[{"ipv4":"10.0.0.5/24"},{"ipv4":"10.0.0.6/24","gateway":"10.0.0.1"}]}"#).unwrap();
        assert_eq!(b.addresses[1].gateway, Some(Ipv4Addr::new(10, 0, 0, 1)));
        // What a client sends reads back the same.
        let text = serde_json::to_string(&b).unwrap();
        assert_eq!(body(&text).unwrap(), b);
        for bad in [
            r#"{"count":2,"taps":["t1"]}"#,
            r#"{"count":2,"taps":["t1","t1"]}"#,
            r#"{"taps":["no/slash"]}"#,
            r#"{"keep_overlays":"yes"}"#,
            r#"{"count":2,"addresses":[{"ipv4":"10.0.0.5/24"}]}"#,
            r#"{"addresses":[{"ipv4":"10.0.0.5"}]}"#,
            r#"{"addresses":[{"ipv4":"10.0.0.5/24","mac":"x"}]}"#,
            r#"{"rate_limits":{"net":"bytes=0"}}"#,
            r#"{"rate_limits":{"net":"fast"}}"#,
            r#"{"rate_limits":{"gpu":"bytes=1K"}}"#,
            r#"{"rate_limits":"bytes=1K"}"#,
            r#"{"console":"tty"}"#,
            r#"{"count":"many"}"#,
            r#"{"count":2,"x":1}"#,
            r#"{"count":0}"#,
            r#"{"count":1001}"#,
            r#"{"count":0,"taps":["t1"]}"#,
            r#"{"media":[{"slot":8,"path":"/a.img"}]}"#,
            r#"{"media":[{"slot":0,"path":"/a.img"},{"slot":0,"path":"/b.img"}]}"#,
            r#"{"media":[{"slot":0}]}"#,
            r#"{"media":[{"slot":0,"path":"/a.img","rw":true}]}"#,
            r#"{"media":{"slot":0,"path":"/a.img"}}"#,
        ] {
            assert!(body(bad).is_err(), "{bad} accepted");
        }
        let b =
            body(r#"{"media":[{"slot":1,"path":"/a.img"},{"slot":0,"path":"/b.img"}]}"#).unwrap();
        assert_eq!(
            (b.media[0].slot, b.media[1].path.to_str()),
            (1, Some("/b.img"))
        );
        assert_eq!(body(&serde_json::to_string(&b).unwrap()).unwrap(), b);
        assert!(!b.media[0].writable, "read-only unless asked");
        let b = body(r#"{"media":[{"slot":0,"path":"/a.img","writable":true}]}"#).unwrap();
        assert!(b.media[0].writable);
        assert_eq!(body(&serde_json::to_string(&b).unwrap()).unwrap(), b);
    }

    #[test]
    fn media_text_reads_back_as_written_writable_ones_with_rw() {
        for (text, slot, path, writable) in [
            ("0:/a.img", 0, "/a.img", false),
            ("rw:3:/b:c.img", 3, "/b:c.img", true),
            ("2:rw.img", 2, "rw.img", false),
        ] {
            let m: InsertMedium = text.parse().unwrap();
            assert_eq!(
                (m.slot, m.path.to_str(), m.writable),
                (slot, Some(path), writable)
            );
            assert_eq!(m.to_string(), text);
        }
        for bad in ["rw:", "rw:x:/a", "ro:0:/a", "0:", "/a.img", "rw:0:"] {
            assert!(bad.parse::<InsertMedium>().is_err(), "{bad} accepted");
        }
    }

    #[test]
    fn clone_status_names() {
        let s = serde_json::to_string(&CloneStatus::Exited(3)).unwrap();
        assert_eq!(s, r#"{"state":"exited","code":3}"#);
        let s = serde_json::to_string(&CloneStatus::OomKilled).unwrap();
        assert_eq!(s, r#"{"state":"oom_killed"}"#);
        assert!(CloneStatus::Failed.is_live() && !CloneStatus::Killed(9).is_live());
        assert!(CloneStatus::Starting.is_live());
        let s = serde_json::to_string(&CloneStatus::Starting).unwrap();
        assert_eq!(s, r#"{"state":"starting"}"#);
    }
}
