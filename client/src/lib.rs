//! A blocking client for forkvm's control socket and its guest agent, and the control
//! socket's HTTP/1.1 wire format.
//!
//! - [`call`]: each control-API call as data, with no I/O: its request, its time limit
//!   and how its answer decodes. The blocking client below and the `forkvm` library's
//!   tokio client both send these, so there is one definition of each endpoint.
//! - [`api`]: the blocking client, one function per endpoint over [`call`] (the `vmm`
//!   CLI's subcommands, the tests).
//! - [`agent`]: a command run in the guest through its vsock device and `forkvm-agent`.
//! - [`http`]: both ends of the control socket's HTTP/1.1 (requests read as bytes arrive,
//!   responses written; requests written, responses read), so that the server (the
//!   `vmm-api` package) and every client read one definition of the wire.
//!
//! No async runtime and no KVM: the `forkvm` library sends the same calls on tokio.
#![deny(missing_docs)]

pub mod agent;
pub mod api;
pub mod call;
pub mod http;
