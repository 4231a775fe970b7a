//! The control API's OpenAPI description, generated: the paths from [`ROUTES`] (the
//! routes [`crate::route`] answers, which its tests check against this table) and the
//! bodies' schemas from the `api_types` themselves (doc comments included), so the
//! description cannot drift from what the server sends.
//!
//! `vmm openapi` prints it; `docs/api/openapi.yaml` is that output, and a test fails
//! while the file is stale.

use api_types::{
    Action, CloneInfo, CloneList, CreateClones, CreateSnapshot, ErrorBody, InvokeOptions,
    SlotMedium, SnapshotInfo, VmInfo, VmUpdate,
};
use schemars::generate::SchemaSettings;
use schemars::{JsonSchema, Schema, SchemaGenerator};
use serde_json::{json, Map, Value};

/// A body's schema, added to the generator's components.
type SchemaFn = fn(&mut SchemaGenerator) -> Schema;

fn schema<T: JsonSchema>(g: &mut SchemaGenerator) -> Schema {
    g.subschema_for::<T>()
}

/// One answer a route gives.
pub struct Answer {
    /// HTTP status.
    pub status: u16,
    /// When it is given.
    pub description: &'static str,
    /// Its body's schema (None: no body, or the error body for statuses of 400 up).
    pub body: Option<SchemaFn>,
}

/// One route of the control API.
pub struct Route {
    /// HTTP method.
    pub method: &'static str,
    /// Path, with `{id}` for a parameter.
    pub path: &'static str,
    /// What it does.
    pub summary: &'static str,
    /// The request body's schema and whether a body is required.
    pub request: Option<(SchemaFn, bool)>,
    /// Its answers, beyond [`COMMON`].
    pub answers: &'static [Answer],
    /// The query parameters it takes: each property of this object schema is one.
    pub query: Option<SchemaFn>,
    /// Its request body and its 200 answer are raw bytes (an invocation's payload and
    /// reply), not JSON.
    pub raw: bool,
}

const fn answer(status: u16, description: &'static str) -> Answer {
    Answer {
        status,
        description,
        body: None,
    }
}

/// Answers every route may give.
pub const COMMON: &[Answer] = &[
    answer(
        400,
        "The request is not valid HTTP/1.x, or its body not what this route takes.",
    ),
    answer(
        413,
        "Headers over 8 KiB or a body over 64 KiB (an invocation's: over the mailbox).",
    ),
    answer(
        408,
        "The whole request (headers and body) did not arrive within 5 s of the connection.",
    ),
    answer(
        503,
        "The VMM is shutting down or did not answer in time (10 s, and 0.1 s more per clone \
         asked for), or the control socket is \
         at its limit (1024 connections, or request bodies held at once).",
    ),
];

/// Every route the server answers.
pub const ROUTES: &[Route] = &[
    Route {
        method: "get",
        path: "/vm",
        summary: "The VM's state and configuration.",
        request: None,
        answers: &[Answer {
            status: 200,
            description: "The VM.",
            body: Some(schema::<VmInfo>),
        }],
        query: None,
        raw: false,
    },
    Route {
        method: "patch",
        path: "/vm",
        summary: "Pause or resume every vCPU (a paused VM's devices are parked too).",
        request: Some((schema::<VmUpdate>, true)),
        answers: &[
            answer(204, "Done; the VM is in the requested state."),
            answer(409, "Not a valid transition (pausing a paused VM, ...)."),
            answer(500, "A vCPU did not park or resume."),
        ],
        query: None,
        raw: false,
    },
    Route {
        method: "put",
        path: "/actions",
        summary: "Act on the VM.",
        request: Some((schema::<Action>, true)),
        answers: &[answer(
            204,
            "Accepted; the VMM is stopping (exit status 0).",
        )],
        query: None,
        raw: false,
    },
    Route {
        method: "post",
        path: "/clones",
        summary: "Clone the VM (fork). Answers once every clone's guest runs and its socket is up.",
        request: Some((schema::<CreateClones>, false)),
        answers: &[
            Answer {
                status: 201,
                description: "The clones, each running or failed (its status says; a failed \
                              one's error says why). A request that fails after starting \
                              clones ends them: its caller has no clone it was not told of.",
                body: Some(schema::<CloneList>),
            },
            answer(
                409,
                "The request does not fit this VM: it is stopping, too many clones are live \
                 (2000 at most), it has no such device (a rate limit), network card (taps, \
                 addresses), writable disk (keep_overlays), cgroup pools or resource class, \
                 or its socket path leaves no room for the clones' ids.",
            ),
            answer(
                422,
                "The body's parts do not fit together: taps or addresses not one per clone.",
            ),
            answer(
                503,
                "The resource class's cgroup pool is exhausted (after --cgroup-wait-ms), or \
                 the host is out of space, descriptors, memory or processes for now (no \
                 clone started, or none could be made).",
            ),
            answer(
                500,
                "The host failed: fork, capture, an overlay copy, a cgroup operation; or no \
                 clone started (the first one's reason).",
            ),
        ],
        query: None,
        raw: false,
    },
    Route {
        method: "get",
        path: "/clones",
        summary: "The clones this VM made, oldest first (every live one and the last 1024 that \
                  ended), with live clones' cgroup usage read now.",
        request: None,
        answers: &[Answer {
            status: 200,
            description: "The clones.",
            body: Some(schema::<CloneList>),
        }],
        query: None,
        raw: false,
    },
    Route {
        method: "delete",
        path: "/clones/{id}",
        summary: "Stop a live clone (SIGTERM, SIGKILL after 3 s) and reap it.",
        request: None,
        answers: &[
            Answer {
                status: 200,
                description: "The clone, as it ended.",
                body: Some(schema::<CloneInfo>),
            },
            answer(404, "No live clone has this id."),
        ],
        query: None,
        raw: false,
    },
    Route {
        method: "put",
        path: "/slots/{slot}",
        summary: "Put an image into an empty disk slot of the running VM (docs/cloning.md, Disk slots): \
                  read-only, or writable through a new overlay of the VM's own. The guest \
                  is told by the device's configuration-change interrupt. The VM's warm \
                  clones are discarded (they were captured without it).",
        request: Some((schema::<SlotMedium>, true)),
        answers: &[
            answer(204, "Inserted."),
            answer(
                400,
                "The body is malformed, or the image cannot be a medium (missing, \
                 unreadable, empty, not whole 512-byte sectors).",
            ),
            answer(
                409,
                "No such slot, the slot holds a medium, or a writable medium in a VM \
                 without a slot overlay directory.",
            ),
            answer(500, "The host failed to make the overlay (the slot stays empty)."),
        ],
        query: None,
        raw: false,
    },
    Route {
        method: "delete",
        path: "/slots/{slot}",
        summary: "Take the image out of a disk slot of the running VM (its overlay goes \
                  with it); the guest must have unmounted it. The guest is told by the \
                  device's configuration-change interrupt.",
        request: None,
        answers: &[
            answer(204, "Ejected: the slot is empty."),
            answer(400, "The slot is no number."),
            answer(409, "No such slot, or it is empty."),
        ],
        query: None,
        raw: false,
    },
    Route {
        method: "put",
        path: "/snapshot",
        summary: "Write a snapshot of the paused VM (its state, its memory as a sparse file, \
                  its writable disks' overlays; every file owner-only) to a new directory \
                  (docs/snapshots.md). `vmm restore --dir` starts a VM from it.",
        request: Some((schema::<CreateSnapshot>, true)),
        answers: &[
            Answer {
                status: 201,
                description: "Written: the directory holds the whole snapshot.",
                body: Some(schema::<SnapshotInfo>),
            },
            answer(
                409,
                "The VM is not paused, has vCPU events to handle first, or the directory \
                 exists.",
            ),
            answer(
                503,
                "The host is out of space for it (nothing of it is left).",
            ),
            answer(
                500,
                "The host failed to capture or write it (nothing of it is left).",
            ),
        ],
        query: None,
        raw: false,
    },
    Route {
        method: "post",
        path: "/invocations",
        summary: "Run the handler on the body (raw bytes): in a fresh clone of a template, or in place in a VM whose runtime waits (docs/invoke.md). The VM that runs it answers.",
        request: None,
        answers: &[
            answer(200, "The handler's reply, as raw bytes; x-forkvm-* headers give the clone and the timings."),
            answer(409, "No runtime waits for a request (not started, busy, or a template not paused), the VM has no mailbox, or a tap or address was asked of a VM that serves in place or has no network card."),
            answer(413, "The body does not fit the mailbox (--mailbox-mib, less 64 bytes)."),
            answer(422, "The query's parts do not fit together: a gateway without an address."),
            answer(500, "The handler failed (x-forkvm-outcome: handler_error; the error has its text), or the host failed to start the clone."),
            answer(502, "The guest stopped before its runtime replied, or the reply was malformed; the error quotes the clone's console."),
            answer(503, "The resource class's cgroup pool is exhausted, the template holds as many requests as it may while its runtime is on its way back to the invoke port, or the VMM is shutting down."),
            answer(504, "The handler did not reply within timeout_ms (the clone is stopped), or the runtime did not wait again in time for a held request."),
        ],
        query: Some(schema::<InvokeOptions>),
        raw: true,
    },
];

/// The methods the resource at `path` takes, as an `Allow` header lists them; None when
/// there is no such resource.
pub fn allowed(path: &str) -> Option<String> {
    let takes = |template: &str| match template.split_once('{') {
        None => template == path,
        Some((prefix, _)) => path.strip_prefix(prefix).is_some_and(|id| !id.is_empty()),
    };
    let methods: Vec<String> = (ROUTES.iter())
        .filter(|r| takes(r.path))
        .map(|r| r.method.to_ascii_uppercase())
        .collect();
    (!methods.is_empty()).then(|| methods.join(", "))
}

const DESCRIPTION: &str = "REST over the Unix socket given with `vmm run --api-sock PATH`. \
One request per connection (the server answers with `Connection: close`); bodies are JSON \
and sized by Content-Length (at most 64 KiB; headers at most 8 KiB). Connections are served \
at once, none waiting for another: a request must arrive whole within 5 s of its \
connection (else 408), and up to 1024 connections are open at once (beyond, 503). Every \
error carries `{\"error\": \"message\"}`. Unknown paths answer 404; methods a path does \
not take (not listed here), 405 with an `Allow` header. \
Generated from forkvm's route table and `api_types` (`vmm openapi`).";

/// The OpenAPI 3.0 description of the control API.
pub fn openapi() -> Value {
    let mut g = SchemaSettings::openapi3().into_generator();
    let error = serde_json::to_value(schema::<ErrorBody>(&mut g)).unwrap_or_default();
    let mut paths = Map::new();
    for route in ROUTES {
        let operation = operation(route, &mut g, &error);
        let path = paths
            .entry(route.path)
            .or_insert_with(|| json!({}))
            .as_object_mut()
            .expect("paths are objects");
        path.insert(route.method.into(), operation);
    }
    let schemas = Value::Object(g.take_definitions(true));
    json!({
        "openapi": "3.0.3",
        "info": {
            "title": "forkvm control API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": DESCRIPTION,
        },
        "paths": paths,
        "components": { "schemas": schemas },
    })
}

fn error_answer(description: &str, error: &Value) -> Value {
    json!({
        "description": description,
        "content": { "application/json": { "schema": error } },
    })
}

fn id_parameter() -> Value {
    json!([{
        "name": "id",
        "in": "path",
        "required": true,
        "description": "The clone's id, as `POST /clones` gave it (`2`, `2.1`, ...).",
        "schema": { "type": "string" },
    }])
}

fn operation(route: &Route, g: &mut SchemaGenerator, error: &Value) -> Value {
    let mut responses = Map::new();
    for a in route.answers.iter().chain(COMMON) {
        let key = a.status.to_string();
        if responses.contains_key(&key) {
            continue;
        }
        let value = match (a.body, a.status) {
            (None, 200) if route.raw => json!({
                "description": a.description,
                "content": { "application/octet-stream": { "schema": { "type": "string", "format": "binary" } } },
            }),
            (Some(body), _) => json!({
                "description": a.description,
                "content": { "application/json": { "schema": body(g) } },
            }),
            (None, 400..) => error_answer(a.description, error),
            (None, _) => json!({ "description": a.description }),
        };
        responses.insert(key, value);
    }
    let mut op = json!({ "summary": route.summary, "responses": responses });
    if let Some((body, required)) = route.request {
        op["requestBody"] = json!({
            "required": required,
            "content": { "application/json": { "schema": body(g) } },
        });
    }
    if route.raw {
        op["requestBody"] = json!({
            "required": false,
            "content": { "application/octet-stream": { "schema": { "type": "string", "format": "binary" } } },
        });
    }
    if route.path.contains("{id}") {
        op["parameters"] = id_parameter();
    }
    if route.path.contains("{slot}") {
        op["parameters"] = json!([{
            "name": "slot",
            "in": "path",
            "required": true,
            "description": "The disk slot (0 for the first).",
            "schema": { "type": "integer", "minimum": 0, "maximum": 7 },
        }]);
    }
    if let Some(query) = route.query {
        op["parameters"] = query_parameters(query(g), g);
    }
    op
}

/// One query parameter per property of the object schema `schema` (a reference into
/// the generator's definitions).
fn query_parameters(schema: Schema, g: &mut SchemaGenerator) -> Value {
    let value = serde_json::to_value(schema).unwrap_or_default();
    let resolved = match value.get("$ref").and_then(Value::as_str) {
        Some(r) => {
            let name = r.rsplit('/').next().unwrap_or_default();
            Value::Object(
                g.definitions()
                    .get(name)
                    .cloned()
                    .map_or_else(Map::new, |d| d.as_object().cloned().unwrap_or_default()),
            )
        }
        None => value,
    };
    let props = resolved["properties"]
        .as_object()
        .cloned()
        .unwrap_or_default();
    let params: Vec<Value> = props
        .into_iter()
        .map(|(name, mut prop)| {
            let description = prop
                .as_object_mut()
                .and_then(|p| p.remove("description"))
                .unwrap_or(Value::Null);
            json!({ "name": name, "in": "query", "required": false, "description": description, "schema": prop })
        })
        .collect();
    Value::Array(params)
}

/// [`openapi`] as YAML.
pub fn openapi_yaml() -> String {
    serde_norway::to_string(&openapi()).expect("a JSON value serializes to YAML")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{status_of, ApiReply};
    use vmm::cloning::cgroups::PlacementError;
    use vmm::cloning::CloneError;
    use vmm::microvm::StateError;
    use vmm::rpc::{VmmAction, VmmActionError};

    fn request(method: &str, path: &str) -> crate::http::Request {
        crate::http::Request {
            method: method.to_uppercase(),
            path: path.into(),
            ..Default::default()
        }
    }

    /// What the server answers `req` with at once, or the action it queues; an
    /// invocation carries a connection, as the server's do.
    fn route(req: crate::http::Request) -> Result<VmmAction, ApiReply> {
        let (conn, _) = std::os::unix::net::UnixStream::pair().unwrap();
        crate::route(req, Some(vmm::invoke::Connection::new(conn)))
    }

    /// `path` as the spec writes it.
    fn template(path: &str) -> &str {
        match path {
            p if p.starts_with("/clones/") => "/clones/{id}",
            p if p.starts_with("/slots/") => "/slots/{slot}",
            p => p,
        }
    }

    fn statuses(method: &str, path: &str) -> Vec<u16> {
        let spec = openapi();
        let op = &spec["paths"][template(path)][method];
        let responses = op["responses"].as_object().cloned().unwrap_or_default();
        responses.keys().map(|k| k.parse().unwrap()).collect()
    }

    #[test]
    fn the_router_answers_exactly_the_routes_in_the_spec() {
        const METHODS: &[&str] = &["get", "put", "post", "patch", "delete", "options"];
        for path in [
            "/vm",
            "/actions",
            "/clones",
            "/clones/2.1",
            "/slots/1",
            "/invocations",
            "/nope",
            "/vm/x",
        ] {
            for method in METHODS {
                let known = ROUTES
                    .iter()
                    .any(|r| r.path == template(path) && r.method == *method);
                match route(request(method, path)) {
                    // A body the route needs is missing: 400, the route exists.
                    Ok(_) | Err(ApiReply { status: 400, .. }) => {
                        assert!(known, "{method} {path} is routed but not in the spec")
                    }
                    Err(r) if r.status == 405 => {
                        assert!(!known, "{method} {path} is in the spec but refused");
                        assert!(statuses(method, path).is_empty(), "{method} {path}");
                        let allow = &r.headers[0];
                        assert_eq!(allow, &("Allow", allowed(path).unwrap()));
                    }
                    Err(r) => {
                        assert_eq!(r.status, 404, "{method} {path}");
                        assert!(openapi()["paths"].get(template(path)).is_none(), "{path}");
                    }
                }
            }
        }
    }

    #[test]
    fn every_status_an_action_can_end_with_is_in_the_spec() {
        use jailer::cgroup::PoolError;
        let clone_errors = [
            CloneError::Request(api_types::clones::CreateClonesError::Count(0)),
            CloneError::Request(api_types::clones::CreateClonesError::PerClone {
                what: "addresses",
                given: 1,
                count: 2,
            }),
            CloneError::Request(api_types::clones::CreateClonesError::TapTwice("t".into())),
            CloneError::TooMany { live: 1, max: 1 },
            CloneError::Tree(vmm::cloning::TreeFull { live: 1, max: 1 }),
            CloneError::State(api_types::VmState::Stopped),
            CloneError::PathTooLong("p".into()),
            CloneError::Os(std::io::Error::other("x")),
            CloneError::RateLimit(vmm::config::NoSuchDevice("disk")),
            CloneError::NoOverlay,
            CloneError::NoCard,
            CloneError::Cgroup(PlacementError::NoPools("c".into())),
            CloneError::Cgroup(PlacementError::UnknownClass {
                class: "c".into(),
                known: vec![],
            }),
            CloneError::Cgroup(PlacementError::Pool(PoolError::Exhausted {
                class: "c".into(),
                max: 1,
            })),
            CloneError::Cgroup(PlacementError::Pool(PoolError::Config("x".into()))),
        ];
        let mut cases: Vec<(&str, &str, VmmActionError)> = clone_errors
            .into_iter()
            .map(|e| ("post", "/clones", e.into()))
            .collect();
        cases.push((
            "patch",
            "/vm",
            StateError::Transition {
                from: "paused",
                to: "paused",
            }
            .into(),
        ));
        cases.push((
            "patch",
            "/vm",
            StateError::Vcpu(vmm::vstate::vcpu::VcpuError::Gone(0)).into(),
        ));
        cases.push((
            "delete",
            "/clones/7",
            VmmActionError::NoSuchClone("7".into()),
        ));
        use devices::virtio::block::MediumError;
        use vmm::device_manager::SlotChangeError;
        for (method, e) in [
            ("put", SlotChangeError::NoSlot { slot: 9, slots: 1 }),
            ("put", SlotChangeError::ReadOnlySlots(0)),
            (
                "put",
                SlotChangeError::Image {
                    slot: 0,
                    why: "x".into(),
                },
            ),
            (
                "put",
                SlotChangeError::Medium {
                    slot: 0,
                    source: MediumError::Full,
                },
            ),
            (
                "put",
                SlotChangeError::Overlay {
                    slot: 0,
                    source: devices::virtio::block::overlay::OverlayError::Create {
                        dir: "d".into(),
                        source: std::io::Error::other("x"),
                    },
                },
            ),
            ("delete", SlotChangeError::NoSlot { slot: 9, slots: 1 }),
            (
                "delete",
                SlotChangeError::Medium {
                    slot: 0,
                    source: MediumError::Empty,
                },
            ),
        ] {
            cases.push((method, "/slots/0", e.into()));
        }
        let bad = route(request("delete", "/slots/x")).unwrap_err();
        assert!(statuses("delete", "/slots/x").contains(&bad.status));
        use vmm::invoke::InvokeError;
        for e in [
            InvokeError::NoMailbox,
            InvokeError::NotWaiting,
            InvokeError::NoLoader,
            InvokeError::OwnCloneInPlace,
            InvokeError::Busy,
            InvokeError::HeldFull,
            InvokeError::TooLarge {
                length: 2,
                capacity: 1,
            },
            InvokeError::CloneFailed("1".into()),
            InvokeError::Vcpu(vmm::vstate::vcpu::VcpuError::Gone(0)),
        ] {
            cases.push(("post", "/invocations", e.into()));
        }
        for c in [
            CloneError::Cgroup(PlacementError::Pool(PoolError::Exhausted {
                class: "c".into(),
                max: 1,
            })),
            CloneError::Cgroup(PlacementError::NoPools("c".into())),
            CloneError::TooMany { live: 1, max: 1 },
            CloneError::Tree(vmm::cloning::TreeFull { live: 1, max: 1 }),
            CloneError::Os(std::io::Error::other("x")),
        ] {
            cases.push(("post", "/invocations", c.into()));
        }
        for r in ROUTES {
            cases.push((r.method, r.path, VmmActionError::ShuttingDown));
        }
        for (method, path, e) in &cases {
            let status = status_of(e);
            assert!(
                statuses(method, path).contains(&status),
                "{method} {path} can answer {status} ({e}), which the spec does not list"
            );
        }
        // What the router itself answers.
        let parsed = route(request("patch", "/vm")).unwrap_err();
        assert!(statuses("patch", "/vm").contains(&parsed.status));
        assert!(matches!(
            route(request("post", "/clones")),
            Ok(VmmAction::CreateClones { .. })
        ));
    }

    #[test]
    fn the_spec_file_is_generated_from_the_types() {
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/api/openapi.yaml");
        let committed = std::fs::read_to_string(path).unwrap_or_default();
        assert!(
            committed == openapi_yaml(),
            "docs/api/openapi.yaml is stale: regenerate it with \
             `cargo run -p vmm-api --bin vmm -- openapi > docs/api/openapi.yaml`"
        );
    }
}
