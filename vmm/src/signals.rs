//! Host signals: the shutdown signals and SIGCHLD are blocked in every thread and read
//! by the event loop through a signalfd.

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

/// Signals the VMM turns into a clean shutdown.
pub const SHUTDOWN_SIGNALS: [Signal; 3] = [Signal::SIGINT, Signal::SIGTERM, Signal::SIGHUP];

/// Blocks the shutdown signals and SIGCHLD (clones exiting) in the calling thread (and
/// so in every thread it spawns afterwards) and returns a signalfd that reads them.
/// Call before starting threads.
pub fn block_shutdown_signals() -> std::io::Result<SignalFd> {
    let mut set = SigSet::empty();
    for s in SHUTDOWN_SIGNALS.into_iter().chain([Signal::SIGCHLD]) {
        set.add(s);
    }
    set.thread_block()?;
    Ok(SignalFd::with_flags(
        &set,
        SfdFlags::SFD_CLOEXEC | SfdFlags::SFD_NONBLOCK,
    )?)
}

/// Reads one signal number from `fd`; None when none is pending.
pub fn read_signal(fd: &SignalFd) -> Option<i32> {
    fd.read_signal().ok().flatten().map(|i| i.ssi_signo as i32)
}
