//! A blocking client for forkvm's control socket and its guest agent, and the control
//! socket's HTTP/1.1 wire format.
//!
//! - [`api`]: one function per control-API endpoint, taking and returning
//!   `api_types` (the `vmm` CLI's subcommands, the tests).
//! - [`agent`]: a command run in the guest through its vsock device and `forkvm-agent`.
//! - [`http`]: both ends of the control socket's HTTP/1.1 (requests read as bytes arrive,
//!   responses written; requests written, responses read), so that the server (the
//!   `vmm-api` package) and every client read one definition of the wire.
//!
//! No async runtime and no KVM: the `forkvm` library speaks the same API on tokio.
#![deny(missing_docs)]

pub mod agent;
pub mod api;
pub mod http;
