//! Each control-API call as data, with no I/O: what to send, how long the VMM may take to
//! answer, and how its answer decodes.
//!
//! Both clients of the workspace send these calls: the blocking one (`api`, the
//! `vmm` CLI and the tests) and the `forkvm` library's on tokio. So an endpoint's path,
//! body, time limit and answer are written once, and every client reads the VMM's
//! answers, its refusals and an invocation's outcome the same way.

use std::path::PathBuf;
use std::time::Duration;

use api_types::invoke::{
    HEADER_CLONE_ID, HEADER_CLONE_US, HEADER_HANDLER_US, HEADER_OUTCOME, HEADER_PRIMED,
    HEADER_SOCKET, HEADER_STRETCHED_US, HEADER_TOTAL_US,
};
use api_types::snapshot::SNAPSHOT_TIMEOUT;
use api_types::{
    Action, ActionType, CloneInfo, CloneList, CreateClones, CreateSnapshot, ErrorBody,
    InvokeOptions, Outcome, SlotMedium, SnapshotInfo, TargetState, VmInfo, VmUpdate,
};
use bytes::Bytes;
use serde::de::DeserializeOwned;
use serde::Serialize;

/// An answer as a client read it: its status, its headers (names in lower case) and its
/// body.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The headers, names in lower case, in order.
    pub headers: Vec<(String, String)>,
    /// The body.
    pub body: Bytes,
}

impl Answer {
    /// The value of header `name` (lower case), if present.
    pub fn header(&self, name: &str) -> Option<&str> {
        (self.headers.iter())
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    /// The JSON error body, or one whose error is the body as text.
    pub fn error_body(&self) -> ErrorBody {
        serde_json::from_slice::<ErrorBody>(&self.body)
            .unwrap_or_else(|_| ErrorBody::new(String::from_utf8_lossy(&self.body).into_owned()))
    }
}

/// How a call's answer was not what the caller asked for.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CallError {
    /// The VMM refused the request: the caller's error (a 4xx).
    #[error("the VMM refused the request ({status}): {message}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The VMM's message.
        message: String,
    },
    /// The VMM could not serve the request: the host's or the VMM's trouble (a 5xx).
    #[error("the VMM could not serve the request ({status}): {message}")]
    Unavailable {
        /// The HTTP status.
        status: u16,
        /// The VMM's message.
        message: String,
    },
    /// An invocation ran and did not end with a reply (its `x-forkvm-outcome`).
    #[error("the invocation ended {}: {}", .0.outcome.as_str(), .0.message)]
    Invocation(Box<Failed>),
    /// The answer was not what the API describes.
    #[error("unexpected answer ({status}): {reason}")]
    Decode {
        /// The HTTP status.
        status: u16,
        /// Why it did not decode.
        reason: String,
    },
}

/// An invocation that ran and ended without a reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Failed {
    /// How it ended.
    pub outcome: Outcome,
    /// The HTTP status.
    pub status: u16,
    /// The error's text (a handler's failure, the timeout, the console's tail).
    pub message: String,
    /// The clone that ran it.
    pub clone_id: String,
    /// What the handler printed, for one that ended without replying.
    pub logs: Option<String>,
    /// Bytes of its output the live log dropped.
    pub logs_dropped: u64,
}

/// What a handler replied, and what it cost (an invocation's answer headers).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Invoked {
    /// The handler's reply.
    pub body: Bytes,
    /// The clone that ran it.
    pub clone_id: String,
    /// Its control socket (a keep-alive clone takes further requests there).
    pub socket: PathBuf,
    /// Microseconds from the request's arrival to the clone running with it.
    pub clone_us: u64,
    /// Microseconds the handler took.
    pub handler_us: u64,
    /// Microseconds from the request's arrival to the reply.
    pub total_us: u64,
    /// Whether a primed warm clone served it.
    pub primed: bool,
    /// Microseconds by which the VMM moved the clone's deferred timer interrupt on,
    /// for the time its vCPU waited for a host CPU (docs/invoke.md).
    pub stretched_us: u64,
}

/// One call: a request, its time limit, and how its answer decodes into a `T`.
#[derive(Debug)]
pub struct Call<T> {
    /// The method.
    pub method: &'static str,
    /// The path, with the query string.
    pub path: String,
    /// The body's type (None: no body, or no `Content-Type`).
    pub content_type: Option<&'static str>,
    /// The body (cheap to clone: a transport sends it without copying it).
    pub body: Bytes,
    /// How much longer than a client's own call timeout the VMM may take (a snapshot's
    /// writing, an invocation's timeout).
    pub extra_time: Duration,
    decode: fn(Answer) -> Result<T, CallError>,
}

impl<T> Call<T> {
    fn new(method: &'static str, path: impl Into<String>, decode: Decoder<T>) -> Self {
        Self {
            method,
            path: path.into(),
            content_type: None,
            body: Bytes::new(),
            extra_time: Duration::ZERO,
            decode,
        }
    }

    fn json(mut self, body: &impl Serialize) -> Self {
        self.body = serde_json::to_vec(body)
            .expect("API bodies serialize")
            .into();
        self.content_type = Some("application/json");
        self
    }

    /// How long a client whose own call timeout is `call_timeout` waits for the answer.
    pub fn limit(&self, call_timeout: Duration) -> Duration {
        call_timeout.saturating_add(self.extra_time)
    }

    /// The answer, decoded.
    pub fn decode(&self, answer: Answer) -> Result<T, CallError> {
        (self.decode)(answer)
    }
}

type Decoder<T> = fn(Answer) -> Result<T, CallError>;

/// The error of an answer that is not a success: the caller's (4xx) or the host's.
pub fn refusal(a: &Answer) -> CallError {
    let message = a.error_body().error;
    match a.status {
        400..=499 => CallError::Refused {
            status: a.status,
            message,
        },
        status => CallError::Unavailable { status, message },
    }
}

fn json<T: DeserializeOwned>(a: Answer) -> Result<T, CallError> {
    match a.status {
        200 | 201 => serde_json::from_slice(&a.body).map_err(|e| CallError::Decode {
            status: a.status,
            reason: e.to_string(),
        }),
        _ => Err(refusal(&a)),
    }
}

fn no_content(a: Answer) -> Result<(), CallError> {
    match a.status {
        200..=299 => Ok(()),
        _ => Err(refusal(&a)),
    }
}

/// The reply, or how the invocation failed, of an invocation's answer.
fn invoked(a: Answer) -> Result<Invoked, CallError> {
    let outcome = a.header(HEADER_OUTCOME).map(str::parse::<Outcome>);
    let us = |h| a.header(h).and_then(|v| v.parse().ok()).unwrap_or(0);
    let clone_id = a.header(HEADER_CLONE_ID).unwrap_or("").to_string();
    match outcome {
        Some(Ok(Outcome::Ok)) if a.status == 200 => Ok(Invoked {
            socket: a.header(HEADER_SOCKET).unwrap_or("").into(),
            clone_us: us(HEADER_CLONE_US),
            handler_us: us(HEADER_HANDLER_US),
            total_us: us(HEADER_TOTAL_US),
            primed: a.header(HEADER_PRIMED) == Some("true"),
            stretched_us: us(HEADER_STRETCHED_US),
            clone_id,
            body: a.body,
        }),
        Some(Ok(outcome)) => {
            let body = a.error_body();
            Err(CallError::Invocation(Box::new(Failed {
                outcome,
                status: a.status,
                message: body.error,
                clone_id,
                logs: body.logs,
                logs_dropped: body.logs_dropped.unwrap_or(0),
            })))
        }
        Some(Err(reason)) => Err(CallError::Decode {
            status: a.status,
            reason,
        }),
        None => Err(refusal(&a)),
    }
}

/// `GET /vm`: the VM's state and figures.
pub fn describe_vm() -> Call<VmInfo> {
    Call::new("GET", "/vm", json)
}

/// `PATCH /vm`: pause or resume.
pub fn set_state(state: TargetState) -> Call<()> {
    Call::new("PATCH", "/vm", no_content).json(&VmUpdate { state })
}

/// `PUT /actions` shutdown: the VM stops, its clones first.
pub fn shutdown() -> Call<()> {
    let action = Action {
        action_type: ActionType::Shutdown,
    };
    Call::new("PUT", "/actions", no_content).json(&action)
}

/// `POST /clones` with `request`.
pub fn create_clones(request: &CreateClones) -> Call<CloneList> {
    Call::new("POST", "/clones", json).json(request)
}

/// `GET /clones`: every clone the VM made and what became of it.
pub fn list_clones() -> Call<CloneList> {
    Call::new("GET", "/clones", json)
}

/// `DELETE /clones/{id}`: the clone's final record once it is gone.
pub fn delete_clone(id: &str) -> Call<CloneInfo> {
    Call::new("DELETE", format!("/clones/{id}"), json)
}

/// `PUT /snapshot` to the new directory `dir`; the VMM may take
/// [`SNAPSHOT_TIMEOUT`] to write it.
pub fn snapshot(dir: &str) -> Call<SnapshotInfo> {
    let request = CreateSnapshot {
        dir: dir.to_string(),
    };
    let mut call = Call::new("PUT", "/snapshot", json).json(&request);
    call.extra_time = SNAPSHOT_TIMEOUT;
    call
}

/// `PUT /slots/{slot}` with `medium`.
pub fn insert_medium(slot: u8, medium: &SlotMedium) -> Call<()> {
    Call::new("PUT", format!("/slots/{slot}"), no_content).json(medium)
}

/// `DELETE /slots/{slot}`.
pub fn eject_medium(slot: u8) -> Call<()> {
    Call::new("DELETE", format!("/slots/{slot}"), no_content)
}

/// `POST /invocations`: runs the handler on `payload`; the VMM may take the options'
/// timeout.
pub fn invoke(options: &InvokeOptions, payload: impl Into<Bytes>) -> Call<Invoked> {
    // Every field is a scalar or text (rate limits and media as their text): any value
    // encodes (`every_invocation_option_encodes` holds it to that).
    let query = serde_urlencoded::to_string(options).expect("invocation options encode");
    let path = match query.as_str() {
        "" => "/invocations".to_string(),
        q => format!("/invocations?{q}"),
    };
    let mut call = Call::new("POST", path, invoked);
    call.content_type = Some("application/octet-stream");
    call.body = payload.into();
    call.extra_time = Duration::from_millis(options.timeout_ms());
    call
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(status: u16, body: &str) -> Answer {
        Answer {
            status,
            headers: Vec::new(),
            body: Bytes::copy_from_slice(body.as_bytes()),
        }
    }

    #[test]
    fn answers_decode_and_refusals_say_whose_error_it_is() {
        let list = list_clones()
            .decode(answer(200, r#"{"clones":[]}"#))
            .unwrap();
        assert!(list.clones.is_empty());
        set_state(TargetState::Paused)
            .decode(answer(204, ""))
            .unwrap();
        let refused = list_clones().decode(answer(409, r#"{"error":"busy"}"#));
        assert_eq!(
            refused,
            Err(CallError::Refused {
                status: 409,
                message: "busy".into()
            })
        );
        let unavailable = list_clones().decode(answer(503, "not JSON"));
        assert_eq!(
            unavailable,
            Err(CallError::Unavailable {
                status: 503,
                message: "not JSON".into()
            })
        );
        assert!(matches!(
            list_clones().decode(answer(200, r#"{"clones":7}"#)),
            Err(CallError::Decode { status: 200, .. })
        ));
    }

    #[test]
    fn an_invocations_answer_is_its_reply_or_how_it_failed() {
        let mut ok = answer(200, "\u{0}echo");
        ok.headers = vec![
            (HEADER_OUTCOME.into(), "ok".into()),
            (HEADER_CLONE_ID.into(), "4".into()),
            (HEADER_HANDLER_US.into(), "12".into()),
            (HEADER_PRIMED.into(), "true".into()),
        ];
        let call = invoke(&InvokeOptions::default(), b"x".to_vec());
        let r = call.decode(ok).unwrap();
        assert_eq!((&r.body[..], r.clone_id.as_str()), (&b"\0echo"[..], "4"));
        assert_eq!((r.handler_us, r.primed, r.clone_us), (12, true, 0));
        let mut timeout = answer(504, r#"{"error":"late","logs":"step 1\n"}"#);
        timeout.headers = vec![(HEADER_OUTCOME.into(), "timeout".into())];
        match call.decode(timeout) {
            Err(CallError::Invocation(f)) => {
                assert_eq!((f.outcome, f.status), (Outcome::Timeout, 504));
                assert_eq!(
                    (f.message.as_str(), f.logs.as_deref()),
                    ("late", Some("step 1\n"))
                );
            }
            other => panic!("{other:?}"),
        }
        // Refused before any clone ran it: no outcome header.
        let refused = call.decode(answer(409, r#"{"error":"no runtime waits"}"#));
        assert!(matches!(
            refused,
            Err(CallError::Refused { status: 409, .. })
        ));
    }

    #[test]
    fn every_invocation_option_encodes() {
        let text = "timeout_ms=250&resource_class=small&keep_alive=true&derive=true\
                    &disk_rate=bytes%3D1M&net_rate=ops%3D10&rng_rate=bytes%3D1K&tap=fkc1\
                    &ipv4=10.0.0.5%2F24&gateway=10.0.0.1&media=rw%3A1%3A%2Fi%C3%A9.img%2C0%3A%2Fb";
        let options: InvokeOptions = serde_urlencoded::from_str(text).unwrap();
        assert_eq!(options.media.len(), 2);
        let call = invoke(&options, Vec::new());
        let query = call.path.strip_prefix("/invocations?").unwrap();
        let back: InvokeOptions = serde_urlencoded::from_str(query).unwrap();
        assert_eq!(back, options);
    }

    #[test]
    fn long_calls_may_take_longer_than_the_call_timeout() {
        let ten = Duration::from_secs(10);
        assert_eq!(describe_vm().limit(ten), ten);
        assert_eq!(snapshot("/s").limit(ten), SNAPSHOT_TIMEOUT + ten);
        let options: InvokeOptions = serde_urlencoded::from_str("timeout_ms=250").unwrap();
        let call = invoke(&options, Vec::new());
        assert_eq!(call.limit(ten), ten + Duration::from_millis(250));
        assert!(
            call.path.starts_with("/invocations?timeout_ms=250"),
            "{}",
            call.path
        );
    }
}
