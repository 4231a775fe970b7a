//! What can go wrong, and whose it is ([`ErrorKind`]).

use std::path::PathBuf;
use std::time::Duration;

use api_types::Outcome;

/// Whose failure an [`Error`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ErrorKind {
    /// The caller's: a request the VMM refused as given (bad options, a payload too
    /// large, a VM that takes no invocation now). Retrying the same request fails again.
    Caller,
    /// The guest's: the handler failed, the runtime's reply was bad, the guest stopped,
    /// or the handler did not answer in time. The template serves on.
    Guest,
    /// The host's: the VMM could not start, died, could not be reached, or had no
    /// resources (a cgroup pool exhausted); or a call timed out.
    Host,
}

/// Errors of the library's calls.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The VMM refused the request (4xx).
    #[error("the VMM refused the request ({status}): {message}")]
    Refused {
        /// The HTTP status.
        status: u16,
        /// The VMM's error text.
        message: String,
    },
    /// The invocation reached the guest and ended otherwise than with a reply.
    #[error("the invocation ended {}: {message}", outcome.as_str())]
    Invocation {
        /// How it ended.
        outcome: Outcome,
        /// The HTTP status.
        status: u16,
        /// The VMM's error text (the runtime's, and the clone's console tail).
        message: String,
        /// The clone that ran it (`x-forkvm-clone-id`; empty when the VMM did not say).
        clone_id: String,
        /// For an invocation that timed out or whose guest stopped: what the handler
        /// printed until then (its last 64 KiB), when the runtime kept a live log of
        /// it (a Python function loaded with `Load::logs`).
        logs: Option<String>,
        /// With `logs`: bytes of output dropped before them.
        logs_dropped: u64,
    },
    /// The VMM failed the request for want of host resources, or a host failure (5xx
    /// before any guest was involved).
    #[error("the VMM could not serve the request ({status}): {message}")]
    Unavailable {
        /// The HTTP status.
        status: u16,
        /// The VMM's error text.
        message: String,
    },
    /// The `vmm` program could not be started.
    #[error("cannot start {program}: {source}")]
    Spawn {
        /// The program.
        program: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The VMM exited (before it was ready, or since).
    #[error("the VMM exited ({status}); its console ends with:\n{console}")]
    Exited {
        /// How it exited.
        status: String,
        /// The last lines of its console.
        console: String,
    },
    /// A call did not finish in time.
    #[error("{what} did not finish within {after:?}")]
    Timeout {
        /// The call.
        what: &'static str,
        /// The time it had.
        after: Duration,
    },
    /// The control socket could not be used.
    #[error("control socket {path}: {source}")]
    Socket {
        /// The socket.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// HTTP on the control socket failed (the connection, the framing).
    #[error("HTTP on the control socket: {0}")]
    Http(#[source] HttpError),
    /// The VMM's answer could not be read.
    #[error("unexpected answer from the VMM: {0}")]
    Protocol(String),
    /// The guest agent (for [`crate::VmClone::exec`]) could not be reached or answered
    /// outside its protocol.
    #[error("guest agent: {0}")]
    Agent(String),
    /// A command for the guest agent that cannot be sent as it is.
    #[error("the command cannot be run: {0}")]
    Command(String),
    /// The VMM's process could not be watched or signalled (its pidfd).
    #[error("cannot watch the VMM's process: {0}")]
    Process(std::io::Error),
    /// A template the zygote cache was about to use was evicted meanwhile (try again).
    #[error("the template was evicted from the zygote cache meanwhile")]
    Evicted,
    /// What was asked is not implemented (yet): the text says what.
    #[error("not supported yet: {0}")]
    Unsupported(&'static str),
    /// Files for the template (its directory) could not be made.
    #[error("cannot make the template's directory: {0}")]
    Files(std::io::Error),
    /// A function's requirements could not be made into a package set.
    #[error(transparent)]
    Packages(#[from] crate::PackageError),
}

impl Error {
    /// Whose failure this is.
    pub fn kind(&self) -> ErrorKind {
        match self {
            Error::Refused { .. } | Error::Unsupported(_) | Error::Command(_) => ErrorKind::Caller,
            Error::Packages(e) if e.is_callers() => ErrorKind::Caller,
            Error::Invocation { .. } => ErrorKind::Guest,
            _ => ErrorKind::Host,
        }
    }
}

/// An HTTP-level failure on a VMM's control socket. Its source is the HTTP client's own
/// error (which crate that is, is not part of this library's interface).
#[derive(Debug)]
pub struct HttpError(Box<dyn std::error::Error + Send + Sync>);

impl HttpError {
    pub(crate) fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Box::new(e))
    }
}

impl std::fmt::Display for HttpError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for HttpError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}
