//! forkvm's virtual machine monitor: boots microVM guests on KVM, clones them, and
//! serves typed actions ([`rpc`]) on one event loop. The control socket's protocol is an
//! [`edge::Edge`] given as a type: the `vmm-api` package holds the REST edge and the
//! `vmm` binary, a thin CLI over [`run`] and [`restore`].
#![deny(missing_docs)]

pub mod arch;
pub mod builder;
pub mod cloning;
pub mod config;
pub mod controller;
pub mod device_manager;
pub mod edge;
mod errno;
pub mod gate;
pub mod invoke;
pub mod kept;
pub mod logging;
pub mod microvm;
pub mod rpc;
pub mod sandbox;
pub mod signals;
pub mod snapshot;
pub mod vstate;

/// This build's saved-state id: 16 hexadecimal digits of a SHA-256 over the sources
/// that decide what a saved or cloned VM holds and how it is restored (the build
/// script lists them). Builds with the same id restore each other's snapshots; `vmm
/// state-id` prints it, and caches of saved VMs are keyed by it.
pub const SAVED_STATE_ID: &str = env!("FORKVM_SAVED_STATE_ID");

use builder::{build_microvm, BuildError};
use cloning::cgroups::CgroupSetupError;
use cloning::Cloner;
use config::VmConfig;
use controller::{serve_socket, RunError, Vmm};
use edge::{Edge, EdgeError};
use microvm::{Microvm, RunOutcome};
use signals::block_shutdown_signals;

/// Errors running a VM from start to finish.
#[derive(Debug, thiserror::Error)]
pub enum VmmError {
    /// The control socket could not be served.
    #[error("{0}")]
    Api(EdgeError),
    /// The VM could not be built.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The clones' cgroup pools could not be made.
    #[error(transparent)]
    Cgroups(#[from] CgroupSetupError),
    /// The shared slots of the VM's clone tree could not be mapped.
    #[error("cannot map the clone tree's slots: {0}")]
    Tree(std::io::Error),
    /// The event loop failed.
    #[error(transparent)]
    Run(#[from] RunError),
    /// Shutdown signals could not be routed to the event loop.
    #[error("cannot set up signal handling: {0}")]
    Signals(std::io::Error),
    /// The queue between the control socket and the event loop could not be made.
    #[error("cannot set up the control queue: {0}")]
    Queue(std::io::Error),
    /// A seccomp filter could not be built or installed.
    #[error(transparent)]
    Seccomp(#[from] sandbox::SeccompError),
    /// The snapshot could not be restored.
    #[error(transparent)]
    Restore(#[from] snapshot::RestoreError),
}

/// Boots the VM described by `config`, serves its control socket through edge `E`, and
/// returns when it stops. Every thread, fd and the socket file are gone when this
/// returns.
pub fn run<E: Edge>(config: VmConfig) -> Result<RunOutcome, VmmError> {
    // Before any thread starts, so that every thread inherits the blocked mask and the
    // signals reach only the event loop's signalfd.
    let signals = block_shutdown_signals().map_err(VmmError::Signals)?;
    // Compiled before any thread starts: each installs its kind's filter first.
    sandbox::init(config.host.seccomp)?;
    let (sender, actions) = rpc::channel().map_err(VmmError::Queue)?;
    let api = (config.host.api_sock.as_deref())
        .map(|path| serve_socket::<E>(path, sender, &config, None))
        .transpose()
        .map_err(VmmError::Api)?;
    let actions = api.is_some().then_some(actions);
    // The queue's end goes (refusing what is queued) before the server, whose thread
    // may wait for an answer.
    let outcome = serve::<E>(config, actions, &signals);
    drop(api);
    outcome
}

/// Makes the clones' cgroup pools and the VM, and runs the event loop on `actions`.
fn serve<E: Edge>(
    config: VmConfig,
    actions: Option<rpc::ActionReceiver>,
    signals: &nix::sys::signalfd::SignalFd,
) -> Result<RunOutcome, VmmError> {
    let clones = pools::<E>(&config)?;
    let vm = Microvm::new(build_microvm(config)?);
    // The event loop's filter covers forking clones and rebuilding VMs in them.
    sandbox::enter(sandbox::ThreadKind::Vmm)?;
    Ok(Vmm::<E>::new(vm, clones).run(actions, Some(signals))?)
}

/// What runs in every clone: the controller's event loop on edge `E`, and the
/// invocation layer's handover and prime (cloning knows neither).
fn clone_hooks<E: Edge>() -> cloning::CloneHooks {
    cloning::CloneHooks {
        serve: controller::serve_clone::<E>,
        take: invoke::take_handover,
        prime: invoke::prime_clone,
    }
}

/// The clone side of a VM with `config`, its cgroup pools made: before the VM, so that
/// no guest code runs if they cannot be.
fn pools<E: Edge>(config: &VmConfig) -> Result<Cloner, VmmError> {
    if let Some(c) = &config.host.cgroups {
        c.check()
            .map_err(|e| BuildError::Config(config::ConfigError::Cgroups(e)))?;
    }
    cloning::init_tree(config.clones.max_tree_clones).map_err(VmmError::Tree)?;
    Ok(Cloner::new(config, clone_hooks::<E>())?)
}

/// Restores the VM of a snapshot (`snapshot`), serves its control socket, and returns
/// when it stops, as [`run`] does for a booted VM. The snapshot is read and checked
/// against this host before anything is created.
pub fn restore<E: Edge>(opts: snapshot::RestoreOptions) -> Result<RunOutcome, VmmError> {
    let signals = block_shutdown_signals().map_err(VmmError::Signals)?;
    let restoring = snapshot::open(&opts)?;
    let config = restoring.config();
    sandbox::init(config.host.seccomp)?;
    let (sender, actions) = rpc::channel().map_err(VmmError::Queue)?;
    let api = (config.host.api_sock.as_deref())
        .map(|path| serve_socket::<E>(path, sender, config, None))
        .transpose()
        .map_err(VmmError::Api)?;
    let actions = api.is_some().then_some(actions);
    let outcome = serve_restored::<E>(restoring, opts.paused, actions, &signals);
    drop(api);
    outcome
}

/// [`serve`] for a restored VM, paused first with `paused`.
fn serve_restored<E: Edge>(
    restoring: snapshot::Restoring,
    paused: bool,
    actions: Option<rpc::ActionReceiver>,
    signals: &nix::sys::signalfd::SignalFd,
) -> Result<RunOutcome, VmmError> {
    let clones = pools::<E>(restoring.config())?;
    let mut vm = Microvm::new(restoring.start()?);
    let started = vm.devices().start_restored_virtio();
    started.map_err(snapshot::RestoreError::Devices)?;
    if paused {
        vm.set_state(api_types::TargetState::Paused)
            .map_err(snapshot::RestoreError::Pause)?;
    }
    sandbox::enter(sandbox::ThreadKind::Vmm)?;
    Ok(Vmm::<E>::new(vm, clones).run(actions, Some(signals))?)
}
