//! What the seccomp filters cost: installing each thread kind's filter, and a cheap
//! system call (getpid) under no filter, the VMM filter, and the VMM filter with a
//! vCPU filter stacked on it (a clone's vCPU thread). Each figure is measured in a fresh
//! thread (medians); prints one JSON line per figure. Usage: seccomp_bench [ITERS]

use std::time::Instant;

use jailer::seccomp::{allowed, install, program, SeccompMode, ThreadKind};

fn syscall_ns(iters: u32) -> f64 {
    let t = Instant::now();
    for _ in 0..iters {
        // SAFETY: getpid has no arguments and no side effects.
        unsafe { libc::syscall(libc::SYS_getpid) };
    }
    t.elapsed().as_nanos() as f64 / f64::from(iters)
}

fn median(mut xs: Vec<f64>) -> f64 {
    xs.sort_by(f64::total_cmp);
    xs[xs.len() / 2]
}

fn main() {
    let iters: u32 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    let mode = SeccompMode::KillProcess;
    for kind in ThreadKind::ALL {
        let prog = program(kind, mode)
            .expect("filter compiles")
            .expect("mode is on");
        let t = Instant::now();
        let _ = program(kind, mode);
        let compile_us = t.elapsed().as_secs_f64() * 1e6;
        let install_us: Vec<f64> = (0..iters.min(200))
            .map(|_| {
                let prog = prog.clone();
                std::thread::spawn(move || {
                    let t = Instant::now();
                    install(kind, &prog).expect("install");
                    t.elapsed().as_secs_f64() * 1e6
                })
                .join()
                .unwrap()
            })
            .collect();
        let len = prog.len();
        println!(
            "{{\"kind\":\"{}\",\"syscalls\":{},\"instructions\":{len},\"compile_us\":{compile_us:.1},\"install_us\":{:.1}}}",
            kind.name(),
            allowed(kind).len(),
            median(install_us)
        );
    }
    let stacks: [(&str, &[ThreadKind]); 3] = [
        ("none", &[]),
        ("vmm", &[ThreadKind::Vmm]),
        ("vmm+vcpu", &[ThreadKind::Vmm, ThreadKind::Vcpu]),
    ];
    for (name, kinds) in stacks {
        let kinds = kinds.to_vec();
        let ns = std::thread::spawn(move || {
            for k in kinds {
                install(k, &program(k, mode).unwrap().unwrap()).unwrap();
            }
            median((0..21).map(|_| syscall_ns(iters * 50)).collect())
        })
        .join()
        .unwrap();
        println!("{{\"filters\":\"{name}\",\"getpid_ns\":{ns:.0}}}");
    }
}
