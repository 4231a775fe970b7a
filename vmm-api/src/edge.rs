//! The REST edge as the core sees it ([`vmm::edge::Edge`]): the API thread serves the
//! control socket (`server`), and an invocation's caller is answered over HTTP
//! (`invoke`).

use std::path::Path;

use vmm::edge::{Edge, EdgeError};
use vmm::invoke::{Connection, Finished, LiveLog};
use vmm::kept::KeptThread;
use vmm::rpc::{ActionSender, VmmActionError};

use crate::http::BodyLimits;
use crate::server::ApiServer;

/// The control API over HTTP/1.1 on a Unix socket (docs/api/openapi.yaml): what the
/// `vmm` binary runs its VMs with.
#[derive(Debug, Clone, Copy, Default)]
pub struct HttpEdge;

impl Edge for HttpEdge {
    type Server = ApiServer;

    fn serve(
        path: &Path,
        actions: ActionSender,
        max_payload: Option<usize>,
        thread: Option<KeptThread>,
    ) -> Result<ApiServer, EdgeError> {
        // Without a mailbox, invocations are bounded as other requests are: the VM
        // refuses them (409).
        let limits =
            max_payload.map_or_else(BodyLimits::default, |invocation| BodyLimits { invocation });
        Ok(ApiServer::start(path, actions, limits, thread)?)
    }

    fn keep_thread(server: ApiServer) -> Option<KeptThread> {
        server.into_thread()
    }

    fn answer(
        f: &Finished,
        clone_id: &str,
        socket: &Path,
        console: Option<String>,
        logs: Option<LiveLog>,
    ) -> std::io::Result<()> {
        crate::invoke::answer(f, clone_id, socket, console, logs)
    }

    fn refuse(conn: &Connection, e: VmmActionError) {
        crate::invoke::refuse(conn, e)
    }
}
