//! What the Python runtime's loader takes (a load request, docs/invoke.md): packages to
//! import, a handler's source, events to warm the handler up with, environment
//! variables, and whether invocations answer with their logs.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

use base64::Engine as _;
use bytes::Bytes;
use serde::de::{self, Deserializer, MapAccess, Visitor};
use serde::ser::{SerializeMap, Serializer};
use serde::{Deserialize, Serialize};

/// One warm-up event: what a handler is called with in the template, before it pauses,
/// so that what a request touches (the interpreter's heap and caches, the guest's page
/// tables) is already in the memory every clone starts from. In JSON a UTF-8 string, or
/// `{"base64": "..."}` for any bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Event {
    /// Text, sent UTF-8.
    Text(String),
    /// Bytes, sent as base64.
    Bytes(Vec<u8>),
}

impl Event {
    /// The bytes the handler gets.
    pub fn as_bytes(&self) -> &[u8] {
        match self {
            Event::Text(t) => t.as_bytes(),
            Event::Bytes(b) => b,
        }
    }
}

impl From<&str> for Event {
    fn from(text: &str) -> Self {
        Event::Text(text.into())
    }
}

impl From<Vec<u8>> for Event {
    fn from(bytes: Vec<u8>) -> Self {
        Event::Bytes(bytes)
    }
}

impl Serialize for Event {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            Event::Text(t) => s.serialize_str(t),
            Event::Bytes(b) => {
                let mut map = s.serialize_map(Some(1))?;
                map.serialize_entry(
                    "base64",
                    &base64::engine::general_purpose::STANDARD.encode(b),
                )?;
                map.end()
            }
        }
    }
}

impl<'de> Deserialize<'de> for Event {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct EventVisitor;
        impl<'de> Visitor<'de> for EventVisitor {
            type Value = Event;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str(r#"a string or {"base64": "..."}"#)
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Event, E> {
                Ok(Event::Text(v.into()))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Event, A::Error> {
                let mut bytes = None;
                while let Some(key) = map.next_key::<String>()? {
                    if key != "base64" || bytes.is_some() {
                        return Err(de::Error::custom(format!(
                            r#"an event is a string or {{"base64": "..."}}, not a map with {key:?}"#
                        )));
                    }
                    let text: String = map.next_value()?;
                    let b = (base64::engine::general_purpose::STANDARD.decode(&text))
                        .map_err(|e| de::Error::custom(format!("bad base64: {e}")))?;
                    bytes = Some(b);
                }
                bytes
                    .map(Event::Bytes)
                    .ok_or_else(|| de::Error::missing_field("base64"))
            }
        }
        d.deserialize_any(EventVisitor)
    }
}

/// A load request for forkvm's Python runtime (`forkvm.serve`): imports `imports`,
/// then runs `source` (if any) as the module `forkvm_function` and serves its
/// `handler` from then on. Its JSON is [`Load::payload`].
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
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
    /// Events the handler is called with once each, in order, before the template
    /// pauses (what they leave behind is in every clone; a failing one fails the load).
    /// [`crate::ZygoteCache::function`] then runs them again in
    /// [`crate::REHEARSALS`] fresh clones of the new template, answers dropped
    /// ([`crate::Template::rehearse`]), so that its warm clones copy its working set
    /// ahead before the first request.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub warmup: Vec<Event>,
    /// Variables set in the guest's `os.environ` before anything else of the load runs
    /// (the function's configuration and secrets). They are in the derived template's
    /// memory, so in every clone of it.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Whether each invocation's output (`print`, `logging`) is kept and answered with
    /// it, in an envelope ([`crate::Envelope`]) the caller unpacks.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub logs: bool,
    /// Whether the imports inside the handler module's functions are left to their
    /// calls. By default (false) the loader runs them in the template, so that every
    /// clone finds those modules loaded and an import at call time costs it a lookup;
    /// their import side effects then happen once, in the template.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub lazy_imports: bool,
    /// Disk slots whose images come with the derivation (`InvokeOptions::media`; a
    /// [`crate::PackageSet`]'s image): the loader mounts each read-only first on
    /// `sys.path` before the imports, and the derived template's clones keep them.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub disks: Vec<u8>,
    /// PyPI requirements (`pyyaml==6.0.1`, `jinja2`): the function's package set, which
    /// [`crate::ZygoteCache::function`] resolves on the host ([`crate::PackageCache`]),
    /// mounts in a disk slot of the function's template and puts first on `sys.path`
    /// before the imports. The runtime's own loader refuses them: a template derived
    /// by hand ([`crate::Template::derive`]) takes the set's image as a medium and
    /// `disks` instead.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub requirements: Vec<String>,
    /// The resource class (one of the VMM's `--cgroup-class`es) the template is
    /// derived in by [`crate::ZygoteCache::function`]: its clone runs in a cgroup of
    /// that class, and its own warm clones, and so the requests that name that class,
    /// wait in cgroups of it (the VMM makes it the derived template's default class).
    /// None: the VMM's default class. Not part of the payload.
    #[serde(skip)]
    pub class: Option<String>,
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
        assert!(v.get("warmup").is_none());
        assert!(v.get("env").is_none() && v.get("logs").is_none());
        assert!(v.get("lazy_imports").is_none());
        let l = Load {
            env: BTreeMap::from([("A".into(), "b".into())]),
            logs: true,
            lazy_imports: true,
            ..l
        };
        let v: serde_json::Value = serde_json::from_slice(&l.payload()).unwrap();
        assert_eq!(v["env"], serde_json::json!({"A": "b"}));
        assert_eq!(v["logs"], true);
        assert_eq!(v["lazy_imports"], true);
        let l = Load {
            warmup: vec!["{}".into(), vec![0, 0xff].into()],
            ..l
        };
        let v: serde_json::Value = serde_json::from_slice(&l.payload()).unwrap();
        assert_eq!(v["warmup"], serde_json::json!(["{}", {"base64": "AP8="}]));
        assert!(v.get("disks").is_none());
        let l = Load {
            disks: vec![0],
            ..l
        };
        let v: serde_json::Value = serde_json::from_slice(&l.payload()).unwrap();
        assert_eq!(v["disks"], serde_json::json!([0]));
    }

    #[test]
    fn events_read_back_as_written_and_bad_ones_say_why() {
        let events: Vec<Event> =
            serde_json::from_str(r#"["héllo", {"base64": "AP8="}, ""]"#).unwrap();
        assert_eq!(
            events,
            [
                Event::from("héllo"),
                Event::from(vec![0, 0xff]),
                Event::from("")
            ]
        );
        assert_eq!(events[1].as_bytes(), [0, 0xff]);
        let back: Vec<Event> =
            serde_json::from_slice(&serde_json::to_vec(&events).unwrap()).unwrap();
        assert_eq!(back, events);
        for (bad, says) in [
            (r#"[{"base64": "!!"}]"#, "bad base64"),
            (r#"[{"b64": "AA=="}]"#, "not a map with \"b64\""),
            (r#"[{"base64": "AA==", "x": 1}]"#, "not a map with \"x\""),
            (r#"[{}]"#, "missing field `base64`"),
            (r#"[3]"#, r#"a string or {"base64": "..."}"#),
        ] {
            let e = serde_json::from_str::<Vec<Event>>(bad)
                .unwrap_err()
                .to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
