//! What the layers above cloning do in a clone ([`CloneHooks`]), given to the
//! [`Cloner`](super::Cloner) as plain functions so that cloning names none of them, and
//! what passes through them.

use std::any::Any;
use std::os::fd::BorrowedFd;

use clone::MicrovmState;

use std::path::PathBuf;

use super::wire::ReadyMark;
use super::Cloner;
use crate::builder::rebuild::Prepared;
use crate::config::VmConfig;
use crate::kept::KeptThread;
use crate::microvm::{Microvm, RunOutcome};
use crate::vstate::kvm::KvmContext;

/// A clone's rebuilt VM, running, as the `serve` hook gets it.
pub struct RebuiltClone {
    /// The VM: vCPUs running, host endpoints open, device workers not started yet
    /// (`DeviceManager::start_restored_virtio`).
    pub vm: Microvm,
    /// Its own clone state (it may be cloned in turn).
    pub cloner: Cloner,
    /// Where its control socket goes.
    pub api_sock: PathBuf,
    /// Its signalfd (shutdown signals and SIGCHLD).
    pub signals: nix::sys::signalfd::SignalFd,
    /// Tells the parent the clone is up, once its control socket is.
    pub ready: ReadyMark,
    /// What the hooks' `take` made of the clone's handover, if it had one.
    pub taken: Option<Box<dyn Any>>,
    /// Whether `serve` gives the VM back once it served its invocation (the clone is
    /// rewound: `rewind.rs`).
    pub keep: bool,
    /// The API thread of its life before, idle (a rewound clone's), for its socket.
    pub api_thread: Option<KeptThread>,
}

/// What a rewound clone keeps of a life it served: its VM, stopped, and its API thread,
/// idle.
pub struct KeptLife {
    /// The VM.
    pub vm: Microvm,
    /// The thread that served its control socket (None: it ended).
    pub api_thread: Option<KeptThread>,
}

/// What the layers above cloning do in a clone, given to the [`Cloner`](super::Cloner) as plain
/// functions so that cloning names none of them: the controller's event loop, and the
/// invocation layer's handover and prime.
#[derive(Clone, Copy)]
pub struct CloneHooks {
    /// Serves the rebuilt clone until it stops.
    pub serve: ServeClone,
    /// Takes up a clone's handover before its vCPUs run (`super::Handover`: the
    /// invocation layer writes the request into the clone's mailbox); what it returns
    /// reaches `serve` as [`RebuiltClone::taken`].
    pub take: TakeHandover,
    /// Runs a warm clone's vCPU once before the clone waits for its launch (a prime:
    /// the runtime's serving path, docs/invoke.md); returns the state the clone is to
    /// be launched from and its VM, prepared.
    pub prime: PrimeClone,
}

/// Serves a rebuilt clone until it stops (the controller's event loop); gives the VM
/// back, stopped, with its API thread, when the clone is to be rewound
/// ([`RebuiltClone::keep`]) and it served its invocation.
pub type ServeClone = fn(RebuiltClone) -> Result<(RunOutcome, Option<KeptLife>), ServeError>;

/// Takes up a handover in the clone, before its vCPUs run.
/// `template` is the VM the clone's is rebuilt from, on its memory (the clone's own, copy
/// on write, from the fork).
pub type TakeHandover = fn(HandedOver, &VmConfig, &Microvm) -> Result<Box<dyn Any>, ServeError>;

/// Primes a warm clone of `template`, captured as the state given, on the vCPU given;
/// in the VM given when it has one (a rewound clone's), else in a new one. The bytes
/// given are the prime request's payload: the runtime's pages to map
/// ([`super::working::prime_pages`]).
pub type PrimeClone = fn(
    &KvmContext,
    &Microvm,
    &MicrovmState,
    u8,
    Option<Prepared>,
    &[u8],
) -> Result<(MicrovmState, Prepared), PrimeFailure>;

/// Why serving a clone, or a hook, failed.
pub type ServeError = Box<dyn std::error::Error + Send + Sync>;

/// A handover as the clone receives it.
pub struct HandedOver<'a> {
    /// What the clone is told (`Handover::note`).
    pub note: &'a serde_json::Value,
    /// The payload, or its first bytes when `rest` has more.
    pub payload: &'a [u8],
    /// The rest of the payload, this many bytes still to read from this descriptor (a
    /// warm clone's go channel: the taker reads them where it wants them, before its
    /// VM runs), or None.
    pub rest: Option<(BorrowedFd<'a>, usize)>,
    /// The stream, the clone's own from now on.
    pub stream: std::os::unix::net::UnixStream,
    /// Whether the clone is a primed warm clone.
    pub primed: bool,
}

/// Why a warm clone's prime failed (the warm clone ends).
#[derive(Debug, thiserror::Error)]
#[error("{error}")]
pub struct PrimeFailure {
    /// It ran out of time (the template pauses priming instead of turning it off).
    pub timed_out: bool,
    /// Why.
    pub error: ServeError,
}
