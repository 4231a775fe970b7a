//! One VMM's control socket, typed: the calls a template and a clone share, each one of
//! `forkvm_client::call` (the same the blocking client sends).

use std::path::PathBuf;
use std::time::Duration;

use api_types::{CloneList, InvokeOptions, SnapshotInfo, TargetState, VmInfo};
use bytes::Bytes;
use forkvm_client::call::{self, Answer, Call, CallError, Invoked};

use crate::http::exchange;
use crate::owner::Owner;
use crate::Error;

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
    /// Sends `call` and reads its answer, whatever its status, within the call's limit.
    async fn exchange<T>(&self, call: &Call<T>) -> Result<Answer, Error> {
        let limit = call.limit(self.call_timeout);
        match tokio::time::timeout(limit, exchange(&self.sock, call)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: "a call to the VMM",
                after: limit,
            }),
        }
    }

    /// Sends `call` and decodes its answer.
    async fn send<T>(&self, call: Call<T>) -> Result<T, Error> {
        let answer = self.exchange(&call).await?;
        call.decode(answer).map_err(error)
    }

    /// `PATCH /vm` to `paused`.
    pub async fn pause(&self) -> Result<(), Error> {
        self.set_state(true).await
    }

    /// `PATCH /vm` to `paused` or `running`.
    pub async fn set_state(&self, paused: bool) -> Result<(), Error> {
        let state = match paused {
            true => TargetState::Paused,
            false => TargetState::Running,
        };
        self.send(call::set_state(state)).await
    }

    /// `PUT /slots/{slot}` with `medium`, or `DELETE /slots/{slot}` for None.
    pub async fn set_medium(
        &self,
        slot: u8,
        medium: Option<&api_types::SlotMedium>,
    ) -> Result<(), Error> {
        match medium {
            Some(m) => self.send(call::insert_medium(slot, m)).await,
            None => self.send(call::eject_medium(slot)).await,
        }
    }

    /// `GET /vm`.
    pub async fn status(&self) -> Result<VmInfo, Error> {
        self.send(call::describe_vm()).await
    }

    /// `GET /clones`.
    pub async fn clones(&self) -> Result<CloneList, Error> {
        self.send(call::list_clones()).await
    }

    /// `POST /clones` with `request`.
    pub async fn create_clones(
        &self,
        request: &api_types::CreateClones,
    ) -> Result<CloneList, Error> {
        self.send(call::create_clones(request)).await
    }

    /// `PUT /snapshot` to `dir`: the VMM may take 600 s to write it, beyond the call
    /// timeout.
    pub async fn snapshot(&self, dir: &std::path::Path) -> Result<SnapshotInfo, Error> {
        self.send(call::snapshot(&dir.display().to_string())).await
    }

    /// `POST /invocations`: its time limit is the invocation's timeout and the call
    /// timeout.
    pub async fn invoke(&self, payload: Bytes, options: &InvokeOptions) -> Result<Reply, Error> {
        let invoked = self.send(call::invoke(options, payload)).await?;
        Ok(Reply::from(invoked))
    }

    /// Stops the VMM `owner` runs (`PUT /actions` shutdown: its clones first) and waits
    /// for it to end; kills it past the call timeout.
    pub async fn shut_down(&self, owner: &Owner) -> Result<(), Error> {
        let asked = self.exchange(&call::shutdown()).await;
        let waited = tokio::time::timeout(self.call_timeout, owner.wait()).await;
        if !matches!(waited, Ok(Ok(()))) {
            owner.signal(libc::SIGKILL);
        }
        asked.map(|_| ())
    }
}

impl From<Invoked> for Reply {
    fn from(i: Invoked) -> Self {
        Self {
            body: i.body,
            clone_id: i.clone_id,
            socket: i.socket,
            clone_us: i.clone_us,
            handler_us: i.handler_us,
            total_us: i.total_us,
            primed: i.primed,
            stretched_us: i.stretched_us,
        }
    }
}

/// The library's error for an answer that was not what the call asked for.
fn error(e: CallError) -> Error {
    match e {
        CallError::Refused { status, message } => Error::Refused { status, message },
        CallError::Unavailable { status, message } => Error::Unavailable { status, message },
        CallError::Invocation(f) => Error::Invocation {
            outcome: f.outcome,
            status: f.status,
            message: f.message,
            clone_id: f.clone_id,
            logs: f.logs,
            logs_dropped: f.logs_dropped,
        },
        CallError::Decode { status, reason } => {
            Error::Protocol(format!("answer {status}: {reason}"))
        }
    }
}
