//! Test helper: installs one of the VMM's seccomp filters and makes one system call.
//!
//! `seccomp_probe KIND MODE SYSCALL WHERE`: KIND vmm|api|vcpu|device, MODE kill|
//! kill-thread|log, SYSCALL getpid|socket|inet-socket|clone3|glibc-fatal|heap-trim|
//! heap-trim-unprepared, WHERE main|thread
//! (glibc-fatal: a double free, which glibc detects, reports and aborts on; heap-trim: 2 MiB
//! allocated in 64 KiB blocks and freed, which shrinks a thread's heap; -unprepared without
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

fn main() {
    // As the VMM does (vmm/src/main.rs): glibc's fatal-error report goes to stderr.
    std::env::set_var("LIBC_FATAL_STDERR_", "1");
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [kind, mode, syscall, place] = args.as_slice() else {
        eprintln!("usage: seccomp_probe KIND MODE SYSCALL main|thread");
        std::process::exit(2);
    };
    if syscall != "heap-trim-unprepared" {
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
    if place == "thread" {
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
