//! The control API: REST over a Unix socket (docs/api/openapi.yaml).
//!
//! A dedicated thread accepts connections and parses requests; it hands each one to the
//! VMM's event loop through a channel (waking it with an eventfd) and writes the answer.
//! No async runtime: the VMM process must fork cleanly.

pub mod client;
pub mod exec;
pub mod http;
pub mod server;

use serde::Deserialize;

/// A request the VMM's event loop answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApiRequest {
    /// `GET /vm`
    GetVm,
    /// `PATCH /vm {"state": ...}`
    SetState(TargetState),
    /// `PUT /actions {"action_type": "shutdown"}`
    Shutdown,
    /// `POST /clones {"count": N}`; `received_ns` is when the request arrived
    /// (CLOCK_MONOTONIC), for latency figures.
    CreateClones {
        /// How many.
        count: u64,
        /// Arrival time.
        received_ns: u64,
        /// Where the clones' consoles go.
        console: CloneConsole,
        /// Resource class for the clones' cgroups (None: the VMM's first class).
        resource_class: Option<String>,
        /// Rate limits replacing the template's for these clones' devices.
        rate_limits: Box<crate::config::DeviceRateLimits>,
        /// Each clone's guest addresses, in order (empty: the template's).
        addresses: Vec<crate::config::CloneAddresses>,
        /// Each clone's tap, made by the caller, in order (empty: each makes its own).
        taps: Vec<String>,
        /// Whether the clones keep their disks' overlays (None: as the template's).
        keep_overlays: Option<bool>,
    },
    /// `GET /clones`
    ListClones,
    /// `DELETE /clones/{id}`
    DeleteClone(String),
}

/// States a user may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TargetState {
    /// Stop running guest code (memory and devices stay).
    Paused,
    /// Run again.
    Running,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PatchVm {
    state: TargetState,
}

/// Where a clone's serial console goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CloneConsole {
    /// A file per clone, `<clone socket>.console` (discarded when the parent's own
    /// console is `null`).
    #[default]
    File,
    /// Discarded.
    Null,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateClones {
    #[serde(default = "one")]
    count: u64,
    #[serde(default)]
    console: CloneConsole,
    #[serde(default)]
    resource_class: Option<String>,
    #[serde(default)]
    rate_limits: RateLimitSpecs,
    #[serde(default)]
    addresses: Vec<crate::config::CloneAddresses>,
    #[serde(default)]
    taps: Vec<String>,
    #[serde(default)]
    keep_overlays: Option<bool>,
}

/// `rate_limits` in `POST /clones`: limit texts as on the command line.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct RateLimitSpecs {
    disk: Option<String>,
    rng: Option<String>,
    net: Option<String>,
}

impl RateLimitSpecs {
    fn parse(&self) -> Result<crate::config::DeviceRateLimits, ApiReply> {
        let one = |what: &str, spec: &Option<String>| {
            spec.as_deref()
                .map(|s| {
                    s.parse().map_err(|e| {
                        ApiReply::error(400, format!("invalid rate_limits.{what} {s:?}: {e}"))
                    })
                })
                .transpose()
        };
        Ok(crate::config::DeviceRateLimits {
            disk: one("disk", &self.disk)?,
            rng: one("rng", &self.rng)?,
            net: one("net", &self.net)?,
        })
    }
}

fn one() -> u64 {
    1
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Action {
    action_type: String,
}

/// An answer: status and optional JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiReply {
    /// HTTP status.
    pub status: u16,
    /// JSON body.
    pub body: Option<String>,
}

impl ApiReply {
    /// 200 with a JSON body.
    pub fn ok(body: serde_json::Value) -> Self {
        Self {
            status: 200,
            body: Some(body.to_string()),
        }
    }
    /// 204.
    pub fn no_content() -> Self {
        Self {
            status: 204,
            body: None,
        }
    }
    /// An error status with `{"error": message}`.
    pub fn error(status: u16, message: impl std::fmt::Display) -> Self {
        Self {
            status,
            body: Some(serde_json::json!({ "error": message.to_string() }).to_string()),
        }
    }
}

fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiReply> {
    serde_json::from_slice(body)
        .map_err(|e| ApiReply::error(400, format!("invalid JSON body: {e}")))
}

/// Maps an HTTP request to an API request, or answers it directly when it is invalid.
pub fn route(req: &http::Request) -> Result<ApiRequest, ApiReply> {
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/vm") => Ok(ApiRequest::GetVm),
        ("PATCH", "/vm") => Ok(ApiRequest::SetState(
            parse_json::<PatchVm>(&req.body)?.state,
        )),
        ("PUT", "/actions") => {
            let a: Action = parse_json(&req.body)?;
            match a.action_type.as_str() {
                "shutdown" => Ok(ApiRequest::Shutdown),
                other => Err(ApiReply::error(
                    400,
                    format!("unknown action_type {other:?}; supported: \"shutdown\""),
                )),
            }
        }
        ("POST", "/clones") => {
            let received_ns = crate::vstate::vcpu::monotonic_ns();
            let body = if req.body.iter().all(u8::is_ascii_whitespace) {
                CreateClones {
                    count: 1,
                    console: CloneConsole::File,
                    resource_class: None,
                    rate_limits: RateLimitSpecs::default(),
                    addresses: Vec::new(),
                    taps: Vec::new(),
                    keep_overlays: None,
                }
            } else {
                parse_json::<CreateClones>(&req.body)?
            };
            for (what, n) in [
                ("addresses", body.addresses.len()),
                ("taps", body.taps.len()),
            ] {
                if n != 0 && n as u64 != body.count {
                    return Err(ApiReply::error(
                        400,
                        format!(
                            "{n} {what} for {} clones: give one per clone or none",
                            body.count
                        ),
                    ));
                }
            }
            for (i, tap) in body.taps.iter().enumerate() {
                if !devices::virtio::net::valid_ifname(tap) {
                    return Err(ApiReply::error(400, format!("invalid tap name {tap:?}")));
                }
                if body.taps[..i].contains(tap) {
                    return Err(ApiReply::error(400, format!("tap {tap:?} given twice")));
                }
            }
            Ok(ApiRequest::CreateClones {
                count: body.count,
                received_ns,
                console: body.console,
                resource_class: body.resource_class,
                rate_limits: Box::new(body.rate_limits.parse()?),
                addresses: body.addresses,
                taps: body.taps,
                keep_overlays: body.keep_overlays,
            })
        }
        ("GET", "/clones") => Ok(ApiRequest::ListClones),
        ("DELETE", path) if path.starts_with("/clones/") && path.len() > "/clones/".len() => Ok(
            ApiRequest::DeleteClone(path["/clones/".len()..].to_string()),
        ),
        (_, "/vm") | (_, "/actions") | (_, "/clones") => Err(ApiReply::error(
            405,
            format!("{} is not allowed on {}", req.method, req.path),
        )),
        (_, path) => Err(ApiReply::error(404, format!("no such resource {path}"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn req(method: &str, path: &str, body: &str) -> http::Request {
        http::Request {
            method: method.into(),
            path: path.into(),
            body: body.as_bytes().to_vec(),
        }
    }

    #[test]
    fn routes() {
        assert_eq!(route(&req("GET", "/vm", "")), Ok(ApiRequest::GetVm));
        assert_eq!(
            route(&req("PATCH", "/vm", r#"{"state":"paused"}"#)),
            Ok(ApiRequest::SetState(TargetState::Paused))
        );
        assert_eq!(
            route(&req("PUT", "/actions", r#"{"action_type":"shutdown"}"#)),
            Ok(ApiRequest::Shutdown)
        );
        assert!(matches!(
            route(&req("POST", "/clones", r#"{"count":3}"#)),
            Ok(ApiRequest::CreateClones { count: 3, .. })
        ));
        assert!(matches!(
            route(&req("POST", "/clones", "")),
            Ok(ApiRequest::CreateClones {
                count: 1,
                console: CloneConsole::File,
                ..
            })
        ));
        assert!(matches!(
            route(&req("POST", "/clones", r#"{"resource_class":"small"}"#)),
            Ok(ApiRequest::CreateClones {
                count: 1,
                resource_class: Some(c),
                ..
            }) if c == "small"
        ));
        assert!(matches!(
            route(&req("POST", "/clones", r#"{"count":2,"console":"null"}"#)),
            Ok(ApiRequest::CreateClones {
                count: 2,
                console: CloneConsole::Null,
                ..
            })
        ));
        assert!(matches!(
            route(&req("POST", "/clones", r#"{"rate_limits":{"net":"bytes=2K","rng":"ops=5"}}"#)),
            Ok(ApiRequest::CreateClones { rate_limits: l, .. })
                if l.net == Some("bytes=2K".parse().unwrap())
                    && l.rng == Some("ops=5".parse().unwrap())
                    && l.disk.is_none()
        ));
        assert!(matches!(
            route(&req(
                "POST",
                "/clones",
                r#"{"count":2,"addresses":[{"ipv4":"10.0.0.5/24"},{"ipv4":"10.0.0.6/24","gateway":"10.0.0.1"}]}"#
            )),
            Ok(ApiRequest::CreateClones { addresses: a, .. })
                if a.len() == 2 && a[1].gateway == Some("10.0.0.1".parse().unwrap())
        ));
        assert!(matches!(
            route(&req("POST", "/clones", r#"{"keep_overlays":true}"#)),
            Ok(ApiRequest::CreateClones {
                keep_overlays: Some(true),
                ..
            })
        ));
        assert!(matches!(
            route(&req("POST", "/clones", r#"{"count":2,"taps":["t1","t2"]}"#)),
            Ok(ApiRequest::CreateClones { taps: t, .. }) if t == ["t1", "t2"]
        ));
        for bad in [
            r#"{"count":2,"taps":["t1"]}"#,
            r#"{"count":2,"taps":["t1","t1"]}"#,
            r#"{"taps":["no/slash"]}"#,
            r#"{"taps":["a-name-far-too-long-for-linux"]}"#,
            r#"{"keep_overlays":"yes"}"#,
            r#"{"count":2,"addresses":[{"ipv4":"10.0.0.5/24"}]}"#,
            r#"{"addresses":[{"ipv4":"10.0.0.5"}]}"#,
            r#"{"addresses":[{"ipv4":"10.0.0.5/24","mac":"x"}]}"#,
            r#"{"rate_limits":{"net":"bytes=0"}}"#,
            r#"{"rate_limits":{"net":"fast"}}"#,
            r#"{"rate_limits":{"gpu":"bytes=1K"}}"#,
            r#"{"rate_limits":"bytes=1K"}"#,
        ] {
            let e = route(&req("POST", "/clones", bad)).unwrap_err();
            assert_eq!(e.status, 400, "{bad}: {e:?}");
        }
        assert_eq!(
            route(&req("POST", "/clones", r#"{"console":"tty"}"#))
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            route(&req("GET", "/clones", "")),
            Ok(ApiRequest::ListClones)
        );
        assert_eq!(
            route(&req("DELETE", "/clones/2.1", "")),
            Ok(ApiRequest::DeleteClone("2.1".into()))
        );
    }

    #[test]
    fn rejects_bad_requests_with_reasons() {
        assert_eq!(route(&req("PATCH", "/vm", "{")).unwrap_err().status, 400);
        assert_eq!(
            route(&req("PATCH", "/vm", r#"{"state":"frozen"}"#))
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            route(&req("PATCH", "/vm", r#"{"state":"paused","x":1}"#))
                .unwrap_err()
                .status,
            400
        );
        let e = route(&req("PUT", "/actions", r#"{"action_type":"reboot"}"#)).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.body.unwrap().contains("reboot"));
        assert_eq!(route(&req("DELETE", "/vm", "")).unwrap_err().status, 405);
        assert_eq!(route(&req("PUT", "/clones", "")).unwrap_err().status, 405);
        assert_eq!(
            route(&req("POST", "/clones", r#"{"count":"many"}"#))
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            route(&req("POST", "/clones", r#"{"count":2,"x":1}"#))
                .unwrap_err()
                .status,
            400
        );
        assert_eq!(
            route(&req("DELETE", "/clones/", "")).unwrap_err().status,
            404
        );
        assert_eq!(route(&req("GET", "/nope", "")).unwrap_err().status, 404);
    }
}
