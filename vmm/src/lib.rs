//! forkvm's virtual machine monitor: boots microVM guests on KVM and serves the control
//! API. The `vmm` binary is a thin CLI over [`run`]; schedulers can embed the library.
#![deny(missing_docs)]

pub mod api;
pub mod arch;
pub mod builder;
pub mod cloning;
pub mod config;
pub mod device_manager;
pub mod logging;
pub mod microvm;
pub mod sandbox;
pub mod vstate;

use api::server::{ApiServer, ApiServerError};
use builder::{build_microvm, BuildError};
use config::VmConfig;
use microvm::{block_shutdown_signals, RunError, RunOutcome};

/// Errors running a VM from start to finish.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The control socket could not be served.
    #[error(transparent)]
    Api(#[from] ApiServerError),
    /// The VM could not be built.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The event loop failed.
    #[error(transparent)]
    Run(#[from] RunError),
    /// Shutdown signals could not be routed to the event loop.
    #[error("cannot set up signal handling: {0}")]
    Signals(std::io::Error),
    /// A seccomp filter could not be built or installed.
    #[error(transparent)]
    Seccomp(#[from] sandbox::SeccompError),
}

/// Boots the VM described by `config`, serves its control socket, and returns when it
/// stops. Every thread, fd and the socket file are gone when this returns.
pub fn run(config: VmConfig) -> Result<RunOutcome, VmmError> {
    // Before any thread starts, so that every thread inherits the blocked mask and the
    // signals reach only the event loop's signalfd.
    let signals = block_shutdown_signals().map_err(VmmError::Signals)?;
    // Compiled before any thread starts: each installs its kind's filter first.
    sandbox::init(config.seccomp)?;
    let api = config
        .api_sock
        .as_deref()
        .map(ApiServer::start)
        .transpose()?;
    let vm = build_microvm(config)?;
    // The event loop's filter covers forking clones and rebuilding VMs in them.
    sandbox::enter(sandbox::ThreadKind::Vmm)?;
    Ok(vm.run(api.as_ref(), Some(&signals))?)
}
