//! One VMM's control socket, typed: the calls a template and a clone share.

use std::path::PathBuf;
use std::time::Duration;

use api_types::{CloneList, InvokeOptions, Outcome, SnapshotInfo, VmInfo};
use bytes::Bytes;

use crate::http::{exchange, Answer};
use crate::owner::Owner;
use crate::Error;

/// How long the VMM may take to write a snapshot (its control socket's own limit).
const SNAPSHOT_LIMIT: Duration = Duration::from_secs(600);

/// What a handler replied, and what it cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
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

impl Reply {
    /// The body unpacked, for a function loaded with logs ([`crate::Load::logs`]): how the
    /// handler ended, its reply or traceback, and what it printed.
    pub fn envelope(&self) -> Result<crate::Envelope, crate::EnvelopeError> {
        crate::Envelope::parse(&self.body)
    }
}

/// A VMM's control socket, with the time each call may take.
#[derive(Debug, Clone)]
pub(crate) struct Endpoint {
    pub sock: PathBuf,
    pub call_timeout: Duration,
}

impl Endpoint {
    /// One exchange, within `limit`.
    pub async fn call(
        &self,
        method: &str,
        path: &str,
        body: Bytes,
        limit: Duration,
    ) -> Result<Answer, Error> {
        match tokio::time::timeout(limit, exchange(&self.sock, method, path, body)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: "a call to the VMM",
                after: limit,
            }),
        }
    }

    /// A JSON answer of a call with the call timeout.
    async fn json<T: serde::de::DeserializeOwned>(
        &self,
        method: &str,
        path: &str,
        body: Bytes,
    ) -> Result<T, Error> {
        let a = self.call(method, path, body, self.call_timeout).await?;
        match a.status {
            200 | 201 => {
                serde_json::from_slice(&a.body).map_err(|e| Error::Protocol(e.to_string()))
            }
            _ => Err(refusal(&a)),
        }
    }

    /// `PATCH /vm` to `paused`.
    pub async fn pause(&self) -> Result<(), Error> {
        self.set_state(true).await
    }

    /// `PATCH /vm` to `paused` or `running`.
    pub async fn set_state(&self, paused: bool) -> Result<(), Error> {
        let body = match paused {
            true => Bytes::from_static(br#"{"state":"paused"}"#),
            false => Bytes::from_static(br#"{"state":"running"}"#),
        };
        let a = self.call("PATCH", "/vm", body, self.call_timeout).await?;
        match a.status {
            200 | 204 => Ok(()),
            _ => Err(refusal(&a)),
        }
    }

    /// `PUT /slots/{slot}` with `medium`, or `DELETE /slots/{slot}` for None.
    pub async fn set_medium(
        &self,
        slot: u8,
        medium: Option<&api_types::SlotMedium>,
    ) -> Result<(), Error> {
        let path = format!("/slots/{slot}");
        let a = match medium {
            Some(m) => {
                let body = serde_json::to_vec(m).map_err(|e| Error::Protocol(e.to_string()))?;
                self.call("PUT", &path, body.into(), self.call_timeout)
                    .await?
            }
            None => {
                self.call("DELETE", &path, Bytes::new(), self.call_timeout)
                    .await?
            }
        };
        match a.status {
            204 => Ok(()),
            _ => Err(refusal(&a)),
        }
    }

    /// `GET /vm`.
    pub async fn status(&self) -> Result<VmInfo, Error> {
        self.json("GET", "/vm", Bytes::new()).await
    }

    /// `GET /clones`.
    pub async fn clones(&self) -> Result<CloneList, Error> {
        self.json("GET", "/clones", Bytes::new()).await
    }

    /// `POST /clones` with `request`.
    pub async fn create_clones(
        &self,
        request: &api_types::CreateClones,
    ) -> Result<CloneList, Error> {
        let body = serde_json::to_vec(request).map_err(|e| Error::Protocol(e.to_string()))?;
        self.json("POST", "/clones", body.into()).await
    }

    /// `PUT /snapshot` to `dir`, within 600 s (the VMM's own limit for it).
    pub async fn snapshot(&self, dir: &std::path::Path) -> Result<SnapshotInfo, Error> {
        let request = api_types::CreateSnapshot {
            dir: dir.display().to_string(),
        };
        let body = serde_json::to_vec(&request).map_err(|e| Error::Protocol(e.to_string()))?;
        let a = (self.call("PUT", "/snapshot", body.into(), SNAPSHOT_LIMIT)).await?;
        match a.status {
            201 => serde_json::from_slice(&a.body).map_err(|e| Error::Protocol(e.to_string())),
            _ => Err(refusal(&a)),
        }
    }

    /// `POST /invocations`: its time limit is the invocation's timeout and the call
    /// timeout.
    pub async fn invoke(&self, payload: Bytes, options: &InvokeOptions) -> Result<Reply, Error> {
        let query =
            serde_urlencoded::to_string(options).map_err(|e| Error::Protocol(e.to_string()))?;
        let path = match query.is_empty() {
            true => "/invocations".to_string(),
            false => format!("/invocations?{query}"),
        };
        let limit = Duration::from_millis(options.timeout_ms()) + self.call_timeout;
        let a = self.call("POST", &path, payload, limit).await?;
        answer(a)
    }

    /// Stops the VMM `owner` runs (`PUT /actions` shutdown: its clones first) and waits
    /// for it to end; kills it past the call timeout.
    pub async fn shut_down(&self, owner: &Owner) -> Result<(), Error> {
        let body = Bytes::from_static(br#"{"action_type":"shutdown"}"#);
        let asked = self.call("PUT", "/actions", body, self.call_timeout).await;
        let waited = tokio::time::timeout(self.call_timeout, owner.wait()).await;
        if !matches!(waited, Ok(Ok(()))) {
            owner.signal(libc::SIGKILL);
        }
        asked.map(|_| ())
    }
}

/// An error answer without an outcome: the caller's (4xx) or the host's (5xx).
pub(crate) fn refusal(a: &Answer) -> Error {
    let message = a.error_text();
    match a.status {
        400..=499 => Error::Refused {
            status: a.status,
            message,
        },
        status => Error::Unavailable { status, message },
    }
}

/// The reply, or the error, of an invocation's answer.
fn answer(a: Answer) -> Result<Reply, Error> {
    let outcome = a
        .header(api_types::invoke::HEADER_OUTCOME)
        .map(str::parse::<Outcome>);
    let us = |h| a.header(h).and_then(|v| v.parse().ok()).unwrap_or(0);
    match outcome {
        Some(Ok(Outcome::Ok)) if a.status == 200 => Ok(Reply {
            clone_id: a
                .header(api_types::invoke::HEADER_CLONE_ID)
                .unwrap_or("")
                .into(),
            socket: a
                .header(api_types::invoke::HEADER_SOCKET)
                .unwrap_or("")
                .into(),
            clone_us: us(api_types::invoke::HEADER_CLONE_US),
            handler_us: us(api_types::invoke::HEADER_HANDLER_US),
            total_us: us(api_types::invoke::HEADER_TOTAL_US),
            primed: a.header(api_types::invoke::HEADER_PRIMED) == Some("true"),
            stretched_us: us(api_types::invoke::HEADER_STRETCHED_US),
            body: a.body,
        }),
        Some(Ok(outcome)) => {
            let body = a.error_body();
            Err(Error::Invocation {
                outcome,
                status: a.status,
                message: body.error,
                clone_id: (a.header(api_types::invoke::HEADER_CLONE_ID))
                    .unwrap_or("")
                    .into(),
                logs: body.logs,
                logs_dropped: body.logs_dropped.unwrap_or(0),
            })
        }
        Some(Err(e)) => Err(Error::Protocol(e)),
        None => Err(refusal(&a)),
    }
}
