//! Host signals: the shutdown signals and SIGCHLD are blocked in every thread and read
//! by the event loop through a signalfd. A clone also handles the signal it gets when
//! its parent ends ([`die_with_parent`]).

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicPtr, Ordering};

use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};
use vmm_sys_util::signal::{register_signal_handler, unblock_signal, SIGRTMIN};

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

/// The signal a clone gets when the thread that forked it ends (`PR_SET_PDEATHSIG`): the
/// first real-time signal after the vCPU kick.
fn parent_death_signal() -> i32 {
    SIGRTMIN() + 1
}

/// The files the handler of [`parent_death_signal`] removes: a leaked
/// `Box<Vec<CString>>`, or null. Set, never freed: the handler may be reading it.
static FILES_AT_PARENT_DEATH: AtomicPtr<Vec<CString>> = AtomicPtr::new(std::ptr::null_mut());
/// Set once the parent-death handler started (it may be reading the list).
static IN_PARENT_DEATH: AtomicBool = AtomicBool::new(false);

/// Runs on the main thread only: any other thread passes the signal on to it. Only the
/// main thread may unlink under seccomp, and it is the thread that creates the files, so
/// the signal lands before a file is created (which then never is) or after (and it is
/// removed here).
extern "C" fn on_parent_death(num: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: getpid(2) and gettid(2) are async-signal-safe and cannot fail.
    let (pid, tid) = unsafe {
        (
            libc::getpid(),
            libc::syscall(libc::SYS_gettid) as libc::pid_t,
        )
    };
    if tid != pid {
        // SAFETY: tgkill(2) is async-signal-safe; it signals this process's main thread.
        unsafe { libc::syscall(libc::SYS_tgkill, pid, pid, num) };
        return;
    }
    // Before the list is read: a list replaced from now on is not freed.
    IN_PARENT_DEATH.store(true, Ordering::SeqCst);
    let files = FILES_AT_PARENT_DEATH.load(Ordering::SeqCst);
    if !files.is_null() {
        // SAFETY: a pointer from Box::into_raw in `remove_at_parent_death`, freed there
        // only while this handler has not started (IN_PARENT_DEATH).
        for f in unsafe { &*files } {
            // SAFETY: unlink(2) is async-signal-safe; `f` is a valid C string.
            unsafe { libc::unlink(f.as_ptr()) };
        }
    }
    // SAFETY: _exit(2) is async-signal-safe and has no preconditions. It ends every
    // thread, and so this clone's own clones get their parent-death signal in turn.
    unsafe { libc::_exit(128 + num) }
}

/// In a new clone, first thing: forgets the files a parent clone registered (inherited
/// by fork), handles the parent-death signal by removing this clone's files
/// ([`remove_at_parent_death`]) and exiting, and asks the kernel for that signal when the
/// thread that forked this process ends. A parent killed with SIGKILL cannot remove its
/// clones' sockets and consoles; each clone removes its own on the way out.
///
/// A clone that is stopped (SIGSTOP) when its parent dies handles the signal once it
/// continues.
pub fn die_with_parent() -> std::io::Result<()> {
    FILES_AT_PARENT_DEATH.store(std::ptr::null_mut(), Ordering::Release);
    let num = parent_death_signal();
    register_signal_handler(num, on_parent_death).map_err(std::io::Error::from)?;
    unblock_signal(num).map_err(|e| std::io::Error::other(e.to_string()))?;
    // nix's Signal has no real-time signals: the raw prctl.
    // SAFETY: PR_SET_PDEATHSIG takes a signal number; no pointers.
    if unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, num as libc::c_ulong) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The files this clone removes if its parent dies before it (its control socket,
/// console, vsock socket). Replaces the list given before. Unlinking a path that does
/// not exist yet does nothing, so call this before creating them.
pub fn remove_at_parent_death<'a>(paths: impl IntoIterator<Item = &'a Path>) {
    let files: Vec<CString> = paths
        .into_iter()
        .filter_map(|p| CString::new(p.as_os_str().as_bytes()).ok())
        .collect();
    let before = FILES_AT_PARENT_DEATH.swap(Box::into_raw(Box::new(files)), Ordering::SeqCst);
    // The list before is freed unless the handler started (it may be reading it; the
    // process ends then): a handler that starts after this load reads the new list. A
    // rewound clone replaces it at every request.
    if !before.is_null() && !IN_PARENT_DEATH.load(Ordering::SeqCst) {
        // SAFETY: from Box::into_raw above (an earlier call), swapped out of the static:
        // no one else frees it, and the handler, not started, will read the new list.
        drop(unsafe { Box::from_raw(before) });
    }
}
