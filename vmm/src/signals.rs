//! Host signals: the shutdown signals and SIGCHLD are blocked in every thread and read
//! by the event loop through a signalfd.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};

/// Signals the VMM turns into a clean shutdown.
pub const SHUTDOWN_SIGNALS: [i32; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];
/// Signals the event loop reads: the shutdown ones and SIGCHLD (clones exiting).
const LOOP_SIGNALS: [i32; 4] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP, libc::SIGCHLD];

/// Blocks the shutdown signals and SIGCHLD in the calling thread (and so in every thread
/// it spawns afterwards) and returns a signalfd that reads them. Call before starting
/// threads.
pub fn block_shutdown_signals() -> std::io::Result<OwnedFd> {
    // SAFETY: sigset_t is plain data; sigemptyset/sigaddset initialise it.
    let mut set: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid sigset_t.
    unsafe { libc::sigemptyset(&mut set) };
    for s in LOOP_SIGNALS {
        // SAFETY: `set` is valid and `s` a valid signal number.
        unsafe { libc::sigaddset(&mut set, s) };
    }
    // SAFETY: `set` is initialised; the old mask is not needed.
    let rc = unsafe { libc::pthread_sigmask(libc::SIG_BLOCK, &set, std::ptr::null_mut()) };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    // SAFETY: `set` is initialised; -1 asks for a new fd.
    let fd = unsafe { libc::signalfd(-1, &set, libc::SFD_CLOEXEC | libc::SFD_NONBLOCK) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: signalfd returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Reads one signal number from the signalfd `fd`; None when none is pending.
pub fn read_signal(fd: RawFd) -> Option<i32> {
    // SAFETY: signalfd_siginfo is plain data.
    let mut info: libc::signalfd_siginfo = unsafe { std::mem::zeroed() };
    let size = std::mem::size_of::<libc::signalfd_siginfo>();
    // SAFETY: reading at most `size` bytes into `info`, which is that large.
    let n = unsafe { libc::read(fd, std::ptr::addr_of_mut!(info).cast(), size) };
    (n == size as isize).then_some(info.ssi_signo as i32)
}
