//! Test helper: installs one of the VMM's seccomp filters and makes one system call.
//!
//! `seccomp_probe KIND MODE SYSCALL WHERE`: KIND vmm|api|vcpu|device, MODE kill|
//! kill-thread|log, SYSCALL getpid|socket|inet-socket|clone3|glibc-fatal|heap-trim|
//! heap-trim-unprepared|arenas|arenas-unprepared, WHERE main|thread
//! (glibc-fatal: a double free, which glibc detects, reports and aborts on; heap-trim: 2 MiB
//! allocated in 64 KiB blocks and freed, which shrinks a thread's heap; arenas: 24
//! threads alive at once, each with the filter, each allocating, which makes glibc size
//! its arena limit (WHERE is ignored); -unprepared without
//! `prepare_libc`, which the VMM calls and the probe otherwise calls too; the filter and the
//! call on the main thread, or on a second thread: then the main thread prints `thread
//! finished` or, when it never reports back, `thread gone`). Prints what the call
//! returned, then `main survived`, and exits 0; a filter that kills the process ends
//! it before that.

use jailer::seccomp::{apply, SeccompMode, ThreadKind};

fn call(kind: ThreadKind, mode: SeccompMode, syscall: &str) {
    if let Err(e) = apply(kind, mode) {
        eprintln!("probe: {e}");
        std::process::exit(3);
    }
    // SAFETY: raw system calls with harmless arguments; results are only printed (the
    // socket, if made, is closed at exit).
    let r = unsafe {
        match syscall {
            "getpid" => libc::syscall(libc::SYS_getpid),
            "socket" => libc::syscall(libc::SYS_socket, libc::AF_UNIX, libc::SOCK_STREAM, 0),
            "inet-socket" => libc::syscall(libc::SYS_socket, libc::AF_INET, libc::SOCK_STREAM, 0),
            "clone3" => libc::syscall(libc::SYS_clone3, std::ptr::null::<u8>(), 0usize),
            // Deliberately freed twice: glibc's check catches it before anything is
            // reused, reports it and aborts (how the VMM would meet heap corruption).
            "glibc-fatal" => {
                let p = libc::malloc(32);
                libc::free(p);
                libc::free(p);
                0
            }
            "heap-trim" | "heap-trim-unprepared" => {
                let blocks: Vec<Vec<u8>> = (0..32).map(|_| vec![1u8; 64 << 10]).collect();
                drop(std::hint::black_box(blocks));
                0
            }
            _ => {
                eprintln!("probe: unknown syscall {syscall}");
                std::process::exit(2);
            }
        }
    };
    let errno = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
    println!("{syscall} returned {r} errno {errno}");
}

/// The filter the `arenas` probe's threads install, set once before they start.
static ARENA_PROG: std::sync::OnceLock<(ThreadKind, jailer::seccomp::BpfProgram)> =
    std::sync::OnceLock::new();
/// The `arenas` probe's threads that have allocated.
static ARENA_DONE: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// An `arenas` probe thread: a bare pthread (std's thread start allocates before the
/// closure runs), which installs the filter, allocates for the first time (glibc gives
/// it an arena of its own) and stays.
extern "C" fn arena_thread(_: *mut libc::c_void) -> *mut libc::c_void {
    if let Some((kind, prog)) = ARENA_PROG.get() {
        if jailer::seccomp::install(*kind, prog).is_ok() {
            std::hint::black_box(vec![1u8; 1024]);
        }
    }
    ARENA_DONE.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    static NEVER: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    loop {
        // SAFETY: waits on a word no one changes (futex is in every thread's filter:
        // locks use it).
        unsafe {
            libc::syscall(
                libc::SYS_futex,
                NEVER.as_ptr(),
                libc::FUTEX_WAIT | libc::FUTEX_PRIVATE_FLAG,
                0u32,
                std::ptr::null::<libc::timespec>(),
            )
        };
    }
}

/// 24 threads, each under `kind`'s filter, alive at once, each allocating for the
/// first time (so each wants an arena of its own).
fn arenas(kind: ThreadKind, mode: SeccompMode) {
    let prog = jailer::seccomp::program(kind, mode).ok().flatten();
    let _ = ARENA_PROG.set((kind, prog.expect("a filter")));
    for _ in 0..24 {
        let mut t: libc::pthread_t = 0;
        // SAFETY: starts a thread running `arena_thread`, which takes no argument.
        let r = unsafe {
            libc::pthread_create(&mut t, std::ptr::null(), arena_thread, std::ptr::null_mut())
        };
        assert_eq!(r, 0, "pthread_create");
    }
    let start = std::time::Instant::now();
    while ARENA_DONE.load(std::sync::atomic::Ordering::SeqCst) < 24 {
        if start.elapsed() > std::time::Duration::from_secs(5) {
            println!("thread gone");
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    println!("thread finished");
}

fn main() {
    // As the VMM does (vmm-api/src/main.rs): glibc's fatal-error report goes to stderr.
    std::env::set_var("LIBC_FATAL_STDERR_", "1");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [kind, mode, syscall, place] = args.as_slice() else {
        eprintln!("usage: seccomp_probe KIND MODE SYSCALL main|thread");
        std::process::exit(2);
    };
    if !syscall.ends_with("-unprepared") {
        jailer::seccomp::prepare_libc();
    }
    let kind = match ThreadKind::ALL.iter().find(|k| k.name() == kind) {
        Some(k) => *k,
        None => {
            eprintln!("probe: unknown kind {kind}");
            std::process::exit(2);
        }
    };
    let mode: SeccompMode = mode.parse().unwrap_or_else(|e| {
        eprintln!("probe: {e}");
        std::process::exit(2);
    });
    if syscall.starts_with("arenas") {
        arenas(kind, mode);
    } else if place == "thread" {
        // Not joined: a thread the kernel killed never hands std its result.
        let syscall = syscall.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            call(kind, mode, &syscall);
            let _ = tx.send(());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(5)) {
            Ok(()) => println!("thread finished"),
            Err(_) => println!("thread gone"),
        }
    } else {
        call(kind, mode, syscall);
    }
    println!("main survived");
}
