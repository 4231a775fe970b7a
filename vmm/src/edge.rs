//! What the core asks of the control API's edge, the layer above it: serving a VM's
//! control socket, and answering an invocation's caller on the connection it came on.
//!
//! The core names no protocol. [`crate::run`], [`crate::restore`] and every clone's
//! event loop take an [`Edge`] as a type parameter, so the compiler, not a comment, keeps
//! HTTP out of this crate: the `vmm-api` package is the REST edge (docs/api/openapi.yaml)
//! and the `vmm` binary. An edge is a type, not a value, because a clone's event loop is
//! started by the cloning layer as a plain function (`cloning::CloneHooks`); a type's
//! functions reach it with no state shared across the fork.

use std::path::Path;

use crate::invoke::{Connection, Finished, LiveLog};
use crate::kept::KeptThread;
use crate::rpc::{ActionSender, VmmActionError};

/// Why the control socket could not be served (the edge's own error, boxed).
pub type EdgeError = Box<dyn std::error::Error + Send + Sync>;

/// The control API's edge: turns requests on a control socket into typed actions and
/// typed answers into the protocol's.
pub trait Edge: 'static {
    /// A control socket being served. Dropping it stops serving and removes the socket
    /// file; the event loop drops its action queue first (refusing what is queued), so
    /// no request waits for an answer meanwhile.
    type Server;

    /// Binds `path` and serves it, queueing each request's action on `actions`.
    /// `max_payload` is the largest invocation payload the VM takes (what its mailbox
    /// holds); None for a VM with no mailbox, which refuses invocations itself. Serves
    /// on `thread` when given (a rewound clone's, kept from its life before), else on a
    /// thread of its own.
    fn serve(
        path: &Path,
        actions: ActionSender,
        max_payload: Option<usize>,
        thread: Option<KeptThread>,
    ) -> Result<Self::Server, EdgeError>;

    /// Stops serving, as dropping `server` does, and gives its thread back, idle, for
    /// the next [`Edge::serve`] (None when it ended).
    fn keep_thread(server: Self::Server) -> Option<KeptThread>;

    /// Answers the caller of the finished invocation `f` on its connection, and shuts
    /// the connection down. It ran in the VM with clone id `clone_id` serving on
    /// `socket`. An error answer quotes `console` (the VM's console tail) when given and
    /// carries `logs` (what the handler printed, for one that ended without a reply).
    fn answer(
        f: &Finished,
        clone_id: &str,
        socket: &Path,
        console: Option<String>,
        logs: Option<LiveLog>,
    ) -> std::io::Result<()>;

    /// Answers the caller of an invocation refused with `e` after the edge handed it
    /// on (a held request refused when the runtime came back, or one whose clone never
    /// started), as the edge answers one refused at once.
    fn refuse(conn: &Connection, e: VmmActionError);
}
