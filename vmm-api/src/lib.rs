//! The control API's edge: REST over a Unix socket (docs/api/openapi.yaml), and the `vmm`
//! program (`main.rs`, its command line).
//!
//! The monitor's core (the `vmm` crate) knows no HTTP: it is given [`HttpEdge`] as its
//! [`vmm::edge::Edge`]. A dedicated thread (`server`) accepts connections and reads
//! requests ([`http`], the wire format `forkvm_client` shares with every client);
//! [`route`] turns each into a typed [`VmmAction`] (or answers it directly when it is
//! invalid), the event loop answers it with typed data or a typed error, and [`reply`]
//! turns that into a status and a JSON body. The bodies are `api_types`, which clients
//! (`forkvm_client`, the `vmm` CLI, the tests) read back. No async runtime: the VMM
//! process must fork cleanly.
#![deny(missing_docs)]

pub mod cli;
pub mod conn;
pub mod edge;
pub mod invoke;
pub mod server;
pub mod spec;

pub use edge::HttpEdge;
pub use forkvm_client::http;

use api_types::{Action, ActionType, CreateClones, CreateSnapshot, ErrorBody, VmUpdate};
use serde::{Deserialize, Serialize};

use vmm::cloning::cgroups::PlacementError;
use vmm::cloning::CloneError;
use vmm::invoke::{Connection, InvokeError};
use vmm::microvm::StateError;
use vmm::rpc::{VmmAction, VmmActionError, VmmData, VmmResponse};

/// An answer: status and optional JSON body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiReply {
    /// HTTP status.
    pub status: u16,
    /// JSON body.
    pub body: Option<String>,
    /// Headers beside the usual ones (`Allow` on a 405).
    pub headers: Vec<(&'static str, String)>,
}

impl ApiReply {
    /// `status` with `body` as JSON.
    pub fn json(status: u16, body: &impl Serialize) -> Self {
        match serde_json::to_string(body) {
            Ok(text) => Self {
                status,
                body: Some(text),
                headers: Vec::new(),
            },
            Err(e) => Self::error(500, format!("cannot encode the answer: {e}")),
        }
    }

    /// 204.
    pub fn no_content() -> Self {
        Self {
            status: 204,
            body: None,
            headers: Vec::new(),
        }
    }

    /// An error status with an [`ErrorBody`].
    pub fn error(status: u16, message: impl std::fmt::Display) -> Self {
        let body = ErrorBody::new(message.to_string());
        Self {
            status,
            body: serde_json::to_string(&body).ok(),
            headers: Vec::new(),
        }
    }

    /// 405 for `method` on `path`, whose methods are `allowed`.
    pub fn not_allowed(method: &str, path: &str, allowed: String) -> Self {
        let mut reply = Self::error(405, format!("{method} is not allowed on {path}"));
        reply.headers.push(("Allow", allowed));
        reply
    }
}

/// The body as a `T`, from a JSON object only (see [`api_types::object`]).
fn parse_json<'a, T: Deserialize<'a>>(body: &'a [u8]) -> Result<T, ApiReply> {
    let mut de = serde_json::Deserializer::from_slice(body);
    api_types::object(&mut de)
        .and_then(|value| de.end().map(|()| value))
        .map_err(|e| ApiReply::error(400, format!("invalid JSON body: {e}")))
}

/// Maps an HTTP request to an action, or answers it directly when it is invalid. `conn`
/// is the connection it came on, for an invocation (answered by the VM that runs it).
pub fn route(req: http::Request, conn: Option<Connection>) -> Result<VmmAction, ApiReply> {
    match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/vm") => Ok(VmmAction::DescribeVm),
        ("PATCH", "/vm") => Ok(VmmAction::SetState(
            parse_json::<VmUpdate>(&req.body)?.state,
        )),
        ("PUT", "/actions") => match parse_json::<Action>(&req.body)?.action_type {
            ActionType::Shutdown => Ok(VmmAction::Shutdown),
        },
        ("POST", "/clones") => {
            let received_ns = vmm::vstate::vcpu::monotonic_ns();
            let request = if req.body.iter().all(u8::is_ascii_whitespace) {
                CreateClones::default()
            } else {
                parse_json::<CreateClones>(&req.body)?
            };
            request
                .check()
                .map_err(|e| ApiReply::error(request_status(&e), e))?;
            Ok(VmmAction::CreateClones {
                request: Box::new(request),
                received_ns,
            })
        }
        ("GET", "/clones") => Ok(VmmAction::ListClones),
        ("PUT", "/snapshot") => Ok(VmmAction::Snapshot(
            parse_json::<CreateSnapshot>(&req.body)?.dir.into(),
        )),
        ("POST", "/invocations") => {
            invoke::route(req, conn).map(|i| VmmAction::Invoke(Box::new(i)))
        }
        ("PUT", path) if slot_of(path).is_some() => {
            let slot = slot_number(path)?;
            let m = parse_json::<api_types::SlotMedium>(&req.body)?;
            Ok(VmmAction::InsertMedium(api_types::InsertMedium {
                slot,
                path: m.path,
                writable: m.writable,
            }))
        }
        ("DELETE", path) if slot_of(path).is_some() => {
            Ok(VmmAction::EjectMedium(slot_number(path)?))
        }
        ("DELETE", path) if clone_id(path).is_some() => {
            Ok(VmmAction::DeleteClone(path["/clones/".len()..].to_string()))
        }
        (method, path) => match spec::allowed(path) {
            Some(allowed) => Err(ApiReply::not_allowed(method, path, allowed)),
            None => Err(ApiReply::error(404, format!("no such resource {path}"))),
        },
    }
}

/// The slot in a `/slots/{slot}` path, as written.
fn slot_of(path: &str) -> Option<&str> {
    path.strip_prefix("/slots/").filter(|s| !s.is_empty())
}

/// The slot number in a `/slots/{slot}` path: 400 unless it is one (its range is the
/// VM's to check).
fn slot_number(path: &str) -> Result<u8, ApiReply> {
    let s = slot_of(path).unwrap_or_default();
    s.parse()
        .map_err(|_| ApiReply::error(400, format!("{s:?} is no disk slot number")))
}

/// The clone id in a `/clones/{id}` path.
fn clone_id(path: &str) -> Option<&str> {
    path.strip_prefix("/clones/").filter(|id| !id.is_empty())
}

/// The answer to an action, as a status and a body.
pub fn reply(response: VmmResponse) -> ApiReply {
    match response {
        Ok(VmmData::Empty) => ApiReply::no_content(),
        Ok(VmmData::Vm(vm)) => ApiReply::json(200, &vm),
        Ok(VmmData::CreatedClones(list)) => ApiReply::json(201, &list),
        Ok(VmmData::Clones(list)) => ApiReply::json(200, &list),
        Ok(VmmData::Clone(info)) => ApiReply::json(200, &info),
        // The server writes nothing for an invocation on its way (see `server`).
        Ok(VmmData::Invoked) => ApiReply::no_content(),
        Ok(VmmData::Snapshot(info)) => ApiReply::json(201, &info),
        Err(e) => ApiReply::error(status_of(&e), e),
    }
}

/// The status of a clone request wrong on its own: 422 when each part is valid but they
/// do not fit together (no schema says so), else 400.
fn request_status(e: &api_types::clones::CreateClonesError) -> u16 {
    use api_types::clones::CreateClonesError;
    match e {
        CreateClonesError::PerClone { .. } | CreateClonesError::SlotTwice(_) => 422,
        CreateClonesError::Count(_)
        | CreateClonesError::TapName(_)
        | CreateClonesError::TapTwice(_)
        | CreateClonesError::Slot(_) => 400,
    }
}

/// The status of a refused or failed action: a request the schema refuses (400), one
/// whose parts do not fit together (422, from [`route`]), no such thing (404), one that
/// does not fit the VM's configuration or state (409), a resource the host is out of for
/// now (503), or the host failing (500).
pub fn status_of(e: &VmmActionError) -> u16 {
    use jailer::cgroup::PoolError;
    match e {
        VmmActionError::SetState(StateError::Transition { .. }) => 409,
        VmmActionError::SetState(StateError::Vcpu(_)) => 500,
        VmmActionError::CreateClones(c) => match c {
            CloneError::Request(e) => request_status(e),
            // A slot's image the host cannot take (missing, unreadable, not whole sectors).
            CloneError::Medium { .. } => 400,
            // Valid requests that do not fit this VM: its devices, classes, socket path,
            // state, or its limit of live clones.
            CloneError::PathTooLong(_)
            | CloneError::RateLimit(_)
            | CloneError::NoCard
            | CloneError::NoOverlay
            | CloneError::NoSlot { .. }
            | CloneError::ReadOnlySlots { .. }
            | CloneError::Cgroup(
                PlacementError::UnknownClass { .. } | PlacementError::NoPools(_),
            )
            | CloneError::State(_)
            | CloneError::TooMany { .. }
            | CloneError::Tree(_) => 409,
            CloneError::Cgroup(PlacementError::Pool(PoolError::Exhausted { .. })) => 503,
            c if c.host_short() => 503,
            _ => 500,
        },
        VmmActionError::Invoke(e) => match e {
            InvokeError::NoMailbox
            | InvokeError::NotWaiting
            | InvokeError::Busy
            | InvokeError::NoLoader
            | InvokeError::OwnCloneInPlace => 409,
            InvokeError::TooLarge { .. } => 413,
            InvokeError::HeldFull => 503,
            InvokeError::Mailbox(_)
            | InvokeError::Vcpu(_)
            | InvokeError::CloneFailed(_)
            | InvokeError::Forwarded(_) => 500,
        },
        VmmActionError::Snapshot(e) => {
            use vmm::snapshot::{SaveError, SnapshotError};
            match e {
                SnapshotError::Save(SaveError::Path(_)) => 400,
                SnapshotError::NotPaused
                | SnapshotError::EventsPending
                | SnapshotError::Save(SaveError::Exists(_)) => 409,
                SnapshotError::Save(s) if s.host_short() => 503,
                SnapshotError::Capture(c) if c.host_short() => 503,
                _ => 500,
            }
        }
        VmmActionError::Slot(e) if e.is_conflict() => 409,
        VmmActionError::Slot(vmm::device_manager::SlotChangeError::Image { .. }) => 400,
        VmmActionError::Slot(_) => 500,
        VmmActionError::NoSuchClone(_) => 404,
        VmmActionError::ShuttingDown => 503,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use api_types::{CloneConsole, TargetState};

    fn req(method: &str, path: &str, body: &str) -> http::Request {
        http::Request {
            method: method.into(),
            path: path.into(),
            body: body.as_bytes().to_vec(),
            ..Default::default()
        }
    }

    fn route_(req: http::Request) -> Result<VmmAction, ApiReply> {
        route(req, None)
    }

    fn created(body: &str) -> CreateClones {
        match route_(req("POST", "/clones", body)) {
            Ok(VmmAction::CreateClones { request, .. }) => *request,
            other => panic!("{body}: {other:?}"),
        }
    }

    #[test]
    fn routes() {
        assert_eq!(route_(req("GET", "/vm", "")), Ok(VmmAction::DescribeVm));
        assert_eq!(
            route_(req("PATCH", "/vm", r#"{"state":"paused"}"#)),
            Ok(VmmAction::SetState(TargetState::Paused))
        );
        assert_eq!(
            route_(req("PUT", "/actions", r#"{"action_type":"shutdown"}"#)),
            Ok(VmmAction::Shutdown)
        );
        assert_eq!(created(r#"{"count":3}"#).count, 3);
        assert_eq!(created(""), CreateClones::default());
        assert_eq!(
            created(r#"{"resource_class":"small"}"#)
                .resource_class
                .as_deref(),
            Some("small")
        );
        assert_eq!(
            created(r#"{"count":2,"console":"null"}"#).console,
            CloneConsole::Null
        );
        assert_eq!(
            created(r#"{"count":2,"taps":["t1","t2"]}"#).taps,
            ["t1", "t2"]
        );
        assert_eq!(route_(req("GET", "/clones", "")), Ok(VmmAction::ListClones));
        assert_eq!(
            route_(req("PUT", "/snapshot", r#"{"dir":"/var/snap/a"}"#)),
            Ok(VmmAction::Snapshot("/var/snap/a".into()))
        );
        assert_eq!(
            route_(req("DELETE", "/clones/2.1", "")),
            Ok(VmmAction::DeleteClone("2.1".into()))
        );
    }

    #[test]
    fn rejects_bad_requests_with_reasons() {
        let status = |m: &str, p: &str, b: &str| route_(req(m, p, b)).unwrap_err().status;
        assert_eq!(status("PATCH", "/vm", "{"), 400);
        assert_eq!(status("PATCH", "/vm", r#"{"state":"frozen"}"#), 400);
        assert_eq!(status("PATCH", "/vm", r#"{"state":"paused","x":1}"#), 400);
        let e = route_(req("PUT", "/actions", r#"{"action_type":"reboot"}"#)).unwrap_err();
        assert_eq!(e.status, 400);
        assert!(e.body.unwrap().contains("reboot"));
        assert_eq!(status("DELETE", "/vm", ""), 405);
        assert_eq!(status("PUT", "/clones", ""), 405);
        assert_eq!(status("PUT", "/snapshot", ""), 400);
        assert_eq!(status("PUT", "/snapshot", r#"{"dir":"/a","x":1}"#), 400);
        assert_eq!(status("GET", "/snapshot", ""), 405);
        for bad in [
            r#"{"count":"many"}"#,
            r#"{"count":2,"x":1}"#,
            r#"{"rate_limits":[null,null]}"#,
            r#"[2]"#,
            r#"{"taps":["a-name-far-too-long-for-linux"]}"#,
            r#"{"rate_limits":{"net":"fast"}}"#,
            r#"{"console":"tty"}"#,
            r#"{"count":0}"#,
            "{\"count\":\r\r0 }",
            r#"{"count":1001,"taps":["t1"]}"#,
        ] {
            assert_eq!(status("POST", "/clones", bad), 400, "{bad}");
        }
        assert_eq!(
            status("POST", "/clones", r#"{"count":2,"taps":["t1"]}"#),
            422
        );
        assert_eq!(status("DELETE", "/clones/", ""), 404);
        assert_eq!(status("GET", "/nope", ""), 404);
    }

    #[test]
    fn answers_and_errors_map_to_statuses_and_bodies() {
        assert_eq!(reply(Ok(VmmData::Empty)), ApiReply::no_content());
        let list = api_types::CloneList::default();
        let r = reply(Ok(VmmData::CreatedClones(list.clone())));
        assert_eq!(
            (r.status, r.body.as_deref()),
            (201, Some(r#"{"clones":[]}"#))
        );
        assert_eq!(reply(Ok(VmmData::Clones(list))).status, 200);
        let e = |e: VmmActionError| reply(Err(e));
        let r = e(VmmActionError::NoSuchClone("7".into()));
        assert_eq!(r.status, 404);
        let body: ErrorBody = serde_json::from_str(r.body.as_deref().unwrap()).unwrap();
        assert_eq!(body.error, "no running clone with id \"7\"");
        assert_eq!(e(VmmActionError::ShuttingDown).status, 503);
        let transition = StateError::Transition {
            from: "paused",
            to: "paused",
        };
        let r = e(transition.into());
        assert_eq!(r.status, 409);
        assert!(r.body.unwrap().contains("cannot go from paused to paused"));
        use api_types::clones::CreateClonesError;
        assert_eq!(
            e(CloneError::from(CreateClonesError::Count(0)).into()).status,
            400
        );
        let per_clone = CreateClonesError::PerClone {
            what: "taps",
            given: 1,
            count: 2,
        };
        assert_eq!(e(CloneError::from(per_clone).into()).status, 422);
        assert_eq!(e(CloneError::NoCard.into()).status, 409);
        assert_eq!(
            e(CloneError::TooMany { live: 1, max: 1 }.into()).status,
            409
        );
        assert_eq!(
            e(CloneError::Os(std::io::Error::other("x")).into()).status,
            500
        );
        let exhausted = PlacementError::Pool(jailer::cgroup::PoolError::Exhausted {
            class: "a".into(),
            max: 1,
        });
        assert_eq!(e(CloneError::Cgroup(exhausted).into()).status, 503);
    }
}
