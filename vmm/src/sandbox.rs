//! The VMM's seccomp filters (`jailer::seccomp`): the mode is chosen once at start, the
//! programs are compiled then, and each thread installs its kind's filter when it starts.
//! A clone inherits the compiled programs with the rest of its memory, so its new
//! threads only install them.

use std::cell::Cell;
use std::sync::OnceLock;

use jailer::seccomp::BpfProgram;
pub use jailer::seccomp::{SeccompError, SeccompMode, ThreadKind};

/// The compiled programs, per thread kind in [`ThreadKind::ALL`] order (None: off).
static PROGRAMS: OnceLock<Vec<Option<BpfProgram>>> = OnceLock::new();

/// Compiles every kind's filter for `mode` (the first call wins; a library user that
/// never calls it gets no filters) and prepares glibc for them
/// ([`jailer::seccomp::prepare_libc`]). Also makes device worker threads install theirs.
pub fn init(mode: SeccompMode) -> Result<(), SeccompError> {
    if mode != SeccompMode::Off {
        jailer::seccomp::prepare_libc();
    }
    let progs = ThreadKind::ALL
        .iter()
        .map(|&k| jailer::seccomp::program(k, mode))
        .collect::<Result<Vec<_>, _>>()?;
    let _ = PROGRAMS.set(progs);
    devices::virtio::set_worker_start(|| enter(ThreadKind::Device).map_err(|e| e.to_string()));
    Ok(())
}

/// Installs `kind`'s filter on the calling thread (nothing before [`init`] or when the
/// mode is off, nor when this thread has it already: a vCPU thread kept for the
/// vCPU's next run or an API thread for a rewound clone's next life: `kept.rs`).
pub fn enter(kind: ThreadKind) -> Result<(), SeccompError> {
    if FILTERED.with(Cell::get) == Some(kind) {
        return Ok(());
    }
    let i = ThreadKind::ALL.iter().position(|&k| k == kind).unwrap_or(0);
    match PROGRAMS.get().and_then(|all| all[i].as_ref()) {
        Some(prog) => {
            jailer::seccomp::install(kind, prog)?;
            FILTERED.with(|f| f.set(Some(kind)));
            Ok(())
        }
        None => Ok(()),
    }
}

thread_local! {
    /// The filter this thread installed last, if any.
    static FILTERED: Cell<Option<ThreadKind>> = const { Cell::new(None) };
}

/// Makes a panic on a filtered thread report itself in one lock-free `write(2)` and
/// without a backtrace: symbolizing one opens files, outside every filter, so the
/// process would die of SIGSYS in the middle of the report (and a forked clone could
/// block on the stderr lock another thread of its parent held). Threads without a
/// filter keep the previous hook. For the `vmm` binary; a library user decides.
pub fn install_panic_hook() {
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        if FILTERED.with(Cell::get).is_some() {
            let thread = std::thread::current();
            crate::logging::raw_eprintln(&format!(
                "vmm: thread '{}' {info} (no backtrace under seccomp; --seccomp off for one)",
                thread.name().unwrap_or("<unnamed>")
            ));
        } else {
            previous(info);
        }
    }));
}
