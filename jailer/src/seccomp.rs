//! Seccomp filters for the VMM's threads, one allowlist per thread kind (seccompiler).
//!
//! A thread installs the filter of its kind when it starts ([`apply`]). Filters stack: a
//! thread keeps the filter of the thread that spawned it and a process forked by a thread
//! keeps that thread's. So a clone's main thread runs under the template's VMM filter,
//! its vCPU threads under the VMM filter and their own, and a device worker spawned by
//! a vCPU thread (when the guest activates the device) under the vCPU filter and its own.
//! Each list therefore covers what the threads it spawns need; the narrower filter of
//! the spawned thread still applies on top.
//!
//! Threads other than the VMM's main thread may not call `clone3`: it answers ENOSYS,
//! which makes glibc fall back to `clone`, whose flags a filter can see; those threads
//! may only create threads (`CLONE_THREAD`), never processes. The main thread forks
//! clones (`clone`, and `clone3` with `CLONE_INTO_CGROUP`).
//!
//! Not filtered yet: `ioctl` request numbers (the VMM and vCPU threads issue many KVM
//! ioctls; an allowlist by request is future work) and the paths of file calls (the
//! jail limits what exists).

pub use seccompiler::BpfProgram;
use seccompiler::{apply_filter, sock_filter};

/// Which thread a filter is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ThreadKind {
    /// The VMM's main thread: event loop, control requests, forking clones and, in a
    /// clone, moving itself into its cgroup and rebuilding the VM.
    Vmm,
    /// The control socket's thread.
    Api,
    /// A vCPU thread (port and MMIO exits, device activation).
    Vcpu,
    /// A device's I/O worker (virtio-blk).
    Device,
}

impl ThreadKind {
    /// Every kind.
    pub const ALL: [ThreadKind; 4] = [Self::Vmm, Self::Api, Self::Vcpu, Self::Device];

    /// Lower-case name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Vmm => "vmm",
            Self::Api => "api",
            Self::Vcpu => "vcpu",
            Self::Device => "device",
        }
    }
}

/// What a system call outside the filter does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeccompMode {
    /// Kill the whole process (default; a VMM missing one thread could hang holding a
    /// lock, a dead process is noticed and reaped).
    KillProcess,
    /// Kill only the calling thread.
    KillThread,
    /// Allow it but log it to the kernel log (finding what a filter misses).
    Log,
    /// No filters.
    Off,
}

impl std::str::FromStr for SeccompMode {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "kill" | "kill-process" => Self::KillProcess,
            "kill-thread" => Self::KillThread,
            "log" => Self::Log,
            "off" => Self::Off,
            _ => return Err(format!("{s:?}: use kill, kill-thread, log or off")),
        })
    }
}

/// Errors building or installing a filter.
#[derive(Debug, thiserror::Error)]
pub enum SeccompError {
    /// The rules did not compile (a bug in the lists).
    #[error("seccomp filter for {kind} threads: {why}")]
    Build {
        /// The thread kind.
        kind: &'static str,
        /// Why.
        why: String,
    },
    /// The kernel refused the filter.
    #[error("installing the seccomp filter for {kind} threads: {why}")]
    Install {
        /// The thread kind.
        kind: &'static str,
        /// Why.
        why: String,
    },
}

/// What every thread needs: memory, locks, signals (the vCPU kick, abort on panic),
/// time, logging to stderr, thread exit.
const COMMON: &[i64] = &[
    libc::SYS_brk,
    libc::SYS_mmap,
    libc::SYS_munmap,
    libc::SYS_mprotect,
    libc::SYS_madvise,
    libc::SYS_mremap,
    libc::SYS_futex,
    libc::SYS_exit,
    libc::SYS_exit_group,
    libc::SYS_rt_sigprocmask,
    libc::SYS_rt_sigreturn,
    libc::SYS_rt_sigaction,
    libc::SYS_sigaltstack,
    libc::SYS_gettid,
    libc::SYS_getpid,
    libc::SYS_tgkill,
    libc::SYS_sched_getaffinity,
    libc::SYS_sched_yield,
    libc::SYS_clock_gettime,
    libc::SYS_clock_nanosleep,
    libc::SYS_nanosleep,
    libc::SYS_restart_syscall,
    libc::SYS_getrandom,
    libc::SYS_write,
    // glibc's report of a fatal error it detects (heap corruption, a failed check) goes
    // to stderr with writev (main sets LIBC_FATAL_STDERR_), then abort.
    libc::SYS_writev,
    libc::SYS_close,
    libc::SYS_fcntl,
];

/// Starting a thread (beyond COMMON): the thread's own setup calls and installing its
/// (narrower) filter. `clone` itself is added with the CLONE_THREAD condition.
const SPAWN: &[i64] = &[
    libc::SYS_rseq,
    libc::SYS_set_robust_list,
    libc::SYS_prctl,
    libc::SYS_seccomp,
];

/// A device worker: wait on its queues' eventfds and its rate limiter's timer, read and
/// write the backing file, fill buffers from getrandom, accept and connect Unix sockets
/// (vsock), signal the guest.
const DEVICE: &[i64] = &[
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_preadv,
    libc::SYS_pwrite64,
    libc::SYS_pwritev,
    libc::SYS_lseek,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_fstat,
    libc::SYS_newfstatat,
    libc::SYS_statx,
    // vsock: host connections to the VM's socket, guest connections to host sockets
    // (`socket` itself only for AF_UNIX: see `unix_sockets_only`).
    libc::SYS_accept4,
    libc::SYS_socket,
    libc::SYS_connect,
    libc::SYS_shutdown,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    // Rate limiters' timers (created where the device is activated).
    libc::SYS_timerfd_create,
    libc::SYS_timerfd_settime,
    libc::SYS_timerfd_gettime,
];

/// A vCPU: KVM_RUN and the state ioctls, eventfds (irqfd, stop), activating devices.
const VCPU: &[i64] = &[libc::SYS_ioctl, libc::SYS_read, libc::SYS_eventfd2];

/// The control socket: accept, read the request, write the answer, wake the event loop.
const API: &[i64] = &[
    libc::SYS_accept4,
    libc::SYS_read,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_epoll_ctl,
    libc::SYS_shutdown,
];

/// The VMM thread: everything above plus building VMs (also in a clone child), files
/// (kernel, consoles, cgroups), sockets, forking and reaping clones.
const VMM: &[i64] = &[
    libc::SYS_ioctl,
    libc::SYS_read,
    libc::SYS_readv,
    libc::SYS_writev,
    libc::SYS_pread64,
    libc::SYS_pwrite64,
    libc::SYS_lseek,
    libc::SYS_openat,
    libc::SYS_open,
    libc::SYS_newfstatat,
    libc::SYS_fstat,
    libc::SYS_statx,
    libc::SYS_access,
    libc::SYS_readlink,
    libc::SYS_getdents64,
    libc::SYS_mkdir,
    libc::SYS_rmdir,
    libc::SYS_unlink,
    libc::SYS_unlinkat,
    libc::SYS_linkat,
    // A snapshot's directory renamed into place (`vmm::snapshot`).
    libc::SYS_rename,
    libc::SYS_ftruncate,
    libc::SYS_fsync,
    libc::SYS_fdatasync,
    libc::SYS_dup,
    libc::SYS_dup3,
    libc::SYS_pipe2,
    libc::SYS_eventfd2,
    libc::SYS_signalfd4,
    libc::SYS_epoll_create1,
    libc::SYS_epoll_ctl,
    libc::SYS_epoll_wait,
    libc::SYS_epoll_pwait,
    libc::SYS_poll,
    libc::SYS_ppoll,
    libc::SYS_socket,
    libc::SYS_bind,
    libc::SYS_listen,
    libc::SYS_accept4,
    libc::SYS_connect,
    libc::SYS_shutdown,
    libc::SYS_recvfrom,
    libc::SYS_sendto,
    libc::SYS_setsockopt,
    libc::SYS_getsockopt,
    // A warm clone's launch channel, which carries an invocation's connection.
    libc::SYS_socketpair,
    libc::SYS_sendmsg,
    libc::SYS_recvmsg,
    libc::SYS_clone,
    libc::SYS_clone3,
    libc::SYS_wait4,
    libc::SYS_waitid,
    libc::SYS_kill,
    libc::SYS_getppid,
    libc::SYS_prlimit64,
    libc::SYS_close_range,
    libc::SYS_set_tid_address,
    libc::SYS_uname,
    // A rewound clone tracks the guest memory it writes (`vmm::vstate::written`).
    libc::SYS_userfaultfd,
];

/// Whether `kind` may make Unix sockets only (`socket(AF_UNIX, ...)`: the vsock device
/// worker connects to host sockets, and vCPU threads, which spawn workers, keep that);
/// the VMM thread may make any socket, the API thread none.
pub fn unix_sockets_only(kind: ThreadKind) -> bool {
    matches!(kind, ThreadKind::Device | ThreadKind::Vcpu)
}

/// The system calls `kind` may make (without conditions), sorted. `clone` is allowed
/// for every kind: only with `CLONE_THREAD` except for [`ThreadKind::Vmm`]; `socket`
/// only with `AF_UNIX` where [`unix_sockets_only`] says so (then it is not listed).
pub fn allowed(kind: ThreadKind) -> Vec<i64> {
    let lists: &[&[i64]] = match kind {
        ThreadKind::Vmm => &[COMMON, SPAWN, DEVICE, VCPU, API, VMM],
        ThreadKind::Api => &[COMMON, API],
        ThreadKind::Vcpu => &[COMMON, SPAWN, DEVICE, VCPU],
        ThreadKind::Device => &[COMMON, DEVICE],
    };
    let mut all: Vec<i64> = lists.iter().flat_map(|l| l.iter().copied()).collect();
    if kind != ThreadKind::Vmm {
        all.retain(|&n| n != libc::SYS_clone && n != libc::SYS_clone3);
        all.push(libc::SYS_clone);
    }
    if unix_sockets_only(kind) {
        all.retain(|&n| n != libc::SYS_socket);
    }
    all.sort_unstable();
    all.dedup();
    all
}

/// `kind`'s filter under `mode` as one BPF program (none when off), compiled here rather
/// than by seccompiler.
///
/// Installing a filter costs the time the kernel takes to run it once for every system
/// call number (it caches which calls are always allowed): 2.2 us per instruction a
/// call passes through here. seccompiler emits 4-5 instructions per allowed call, tried
/// one after another (266 for the vCPU list); one comparison per call (76) still cost
/// 0.13-0.15 ms per install, on the clone path for its vCPU threads. So the calls are
/// found by binary search: a number passes through about 4 + log2(n/4) + 4 instructions.
///
/// ```text
///   ld arch; jeq X86_64 ? next : BAD_ARCH
///   ld nr;   jge X32_BIT ? MISMATCH : next
///   jge n_mid ? (right half) : (left half)          recursively, down to 4 calls:
///   jeq n1 ? T1 : next; ... jeq n4 ? T4 : MISMATCH     T: ALLOW, or ENOSYS (clone3),
///                                                     CLONE, SOCKET (narrow kinds)
///   MISMATCH: ret <mode>;  ALLOW: ret allow;  BAD_ARCH: ret kill-process
///   [ENOSYS: ret errno(ENOSYS);  CLONE: ld args[0] low; jset CLONE_THREAD ? ALLOW : MISMATCH]
///   [SOCKET: ld args[0] low; jeq AF_UNIX ? ALLOW : MISMATCH]   (device and vCPU threads)
/// ```
///
/// A unit test checks it against seccompiler's program for every call number, both
/// architectures' values and clone flags.
pub fn program(kind: ThreadKind, mode: SeccompMode) -> Result<Option<BpfProgram>, SeccompError> {
    let mismatch = match mode {
        SeccompMode::Off => return Ok(None),
        SeccompMode::KillProcess => RET_KILL_PROCESS,
        SeccompMode::KillThread => RET_KILL_THREAD,
        SeccompMode::Log => RET_LOG,
    };
    let threads_only = kind != ThreadKind::Vmm;
    let unix_only = unix_sockets_only(kind);
    // Where each call with a decision of its own goes: the allowed ones; clone3 answers
    // ENOSYS where only threads may be made (glibc then uses clone); socket checks the
    // domain where only Unix sockets may be made.
    let mut calls: Vec<(u32, To)> = allowed(kind)
        .into_iter()
        .map(|n| {
            let to = match n {
                libc::SYS_clone if threads_only => To::Clone,
                _ => To::Allow,
            };
            (n as u32, to)
        })
        .collect();
    if threads_only {
        calls.push((libc::SYS_clone3 as u32, To::Enosys));
    }
    if unix_only {
        calls.push((libc::SYS_socket as u32, To::Socket));
    }
    calls.sort_unstable_by_key(|&(nr, _)| nr);
    let mut body: Vec<(u16, To, To, u32)> = vec![
        (LD_W_ABS, To::Next, To::Next, DATA_ARCH),
        (JEQ_K, To::Next, To::BadArch, AUDIT_ARCH_X86_64),
        (LD_W_ABS, To::Next, To::Next, DATA_NR),
        (JGE_K, To::Mismatch, To::Next, X32_SYSCALL_BIT),
    ];
    search(&calls, &mut body);
    // The targets, in the order they follow the comparisons.
    let at_mismatch = body.len();
    let (at_allow, at_bad_arch, at_enosys, at_clone) = (
        at_mismatch + 1,
        at_mismatch + 2,
        at_mismatch + 3,
        at_mismatch + 4,
    );
    // After the ENOSYS return and the clone block (4 instructions) where they are.
    let at_socket = at_mismatch + if threads_only { 8 } else { 3 };
    let mut prog = Vec::with_capacity(body.len() + 11);
    for (i, &(code, jt, jf, k)) in body.iter().enumerate() {
        let off = |to: To| -> Result<u8, SeccompError> {
            let target = match to {
                To::Next => return Ok(0),
                To::At(at) => at,
                To::Mismatch => at_mismatch,
                To::Allow => at_allow,
                To::BadArch => at_bad_arch,
                To::Enosys => at_enosys,
                To::Clone => at_clone,
                To::Socket => at_socket,
            };
            u8::try_from(target - i - 1).map_err(|_| SeccompError::Build {
                kind: kind.name(),
                why: "too many system calls for one jump".into(),
            })
        };
        prog.push(sock_filter {
            code,
            jt: off(jt)?,
            jf: off(jf)?,
            k,
        });
    }
    let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
    prog.push(ins(RET_K, 0, 0, mismatch));
    prog.push(ins(RET_K, 0, 0, RET_ALLOW));
    prog.push(ins(RET_K, 0, 0, RET_KILL_PROCESS));
    if threads_only {
        prog.push(ins(RET_K, 0, 0, RET_ERRNO | libc::ENOSYS as u32));
        // clone(flags, ...): allowed only to make a thread (BPF jumps only forward,
        // so this block has its own pair of returns).
        prog.push(ins(LD_W_ABS, 0, 0, DATA_ARG0_LOW));
        prog.push(ins(JSET_K, 0, 1, libc::CLONE_THREAD as u32));
        prog.push(ins(RET_K, 0, 0, RET_ALLOW));
        prog.push(ins(RET_K, 0, 0, mismatch));
    }
    if unix_only {
        debug_assert_eq!(prog.len(), at_socket);
        // socket(domain, ...): Unix sockets only.
        prog.push(ins(LD_W_ABS, 0, 0, DATA_ARG0_LOW));
        prog.push(ins(JEQ_K, 0, 1, libc::AF_UNIX as u32));
        prog.push(ins(RET_K, 0, 0, RET_ALLOW));
        prog.push(ins(RET_K, 0, 0, mismatch));
    }
    Ok(Some(prog))
}

/// Where a comparison in [`program`] jumps: the next instruction, an instruction of the
/// search by index, or one of the blocks after it.
#[derive(Clone, Copy)]
enum To {
    Next,
    At(usize),
    Mismatch,
    Allow,
    BadArch,
    Enosys,
    Clone,
    Socket,
}

/// The most calls a leaf of the search compares one after another.
const LEAF_CALLS: usize = 4;

/// Appends the comparisons that send each call number in `calls` (sorted) to its
/// target and every other number to the mismatch action: `jge` on the middle number
/// down to [`LEAF_CALLS`] numbers, then one `jeq` each. The accumulator holds the
/// number.
fn search(calls: &[(u32, To)], body: &mut Vec<(u16, To, To, u32)>) {
    if calls.len() <= LEAF_CALLS {
        for (i, &(nr, to)) in calls.iter().enumerate() {
            let otherwise = if i + 1 == calls.len() {
                To::Mismatch
            } else {
                To::Next
            };
            body.push((JEQ_K, to, otherwise, nr));
        }
        if calls.is_empty() {
            // Nothing allowed: either way to the mismatch action.
            body.push((JEQ_K, To::Mismatch, To::Mismatch, 0));
        }
        return;
    }
    let (low, high) = calls.split_at(calls.len() / 2);
    let split = body.len();
    body.push((JGE_K, To::Next, To::Next, high[0].0));
    search(low, body);
    body[split].1 = To::At(body.len());
    search(high, body);
}

const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const JGE_K: u16 = 0x35; // BPF_JMP | BPF_JGE | BPF_K
const JSET_K: u16 = 0x45; // BPF_JMP | BPF_JSET | BPF_K
const RET_K: u16 = 0x06; // BPF_RET | BPF_K
const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const X32_SYSCALL_BIT: u32 = 0x4000_0000;
/// Offsets in `struct seccomp_data`.
const DATA_NR: u32 = 0;
const DATA_ARCH: u32 = 4;
const DATA_ARG0_LOW: u32 = 16;
const RET_KILL_PROCESS: u32 = 0x8000_0000;
const RET_KILL_THREAD: u32 = 0;
const RET_ERRNO: u32 = 0x0005_0000;
const RET_LOG: u32 = 0x7ffc_0000;
const RET_ALLOW: u32 = 0x7fff_0000;

/// Keeps glibc's allocator from opening a file under a filter; call it before the first
/// filter. The first time `free` shrinks a thread's heap (not the main one: any thread
/// that frees 128 KiB at the top of its heap, such as a device worker at the end of a VM),
/// glibc reads `/proc/sys/vm/overcommit_memory` once per process to choose how: an
/// `openat` no thread but the VMM's may make, and the process died of SIGSYS. With a trim
/// threshold above the largest thread heap (64 MiB) no thread heap is ever shrunk (its
/// free memory is kept for reuse; wholly free heaps are still unmapped, and allocations
/// from 128 KiB up are still mapped and unmapped on their own).
///
/// Likewise the arena limit: once a process's threads have made 8 malloc arenas, glibc
/// reads `/sys/devices/system/cpu/online` to size the limit (8 per CPU), and a VMM with
/// eight disk slots has that many device threads. The limit is set here to what glibc
/// would choose, so nothing is read.
pub fn prepare_libc() {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let arenas = i32::try_from(8 * cpus).unwrap_or(i32::MAX);
    // SAFETY: mallopt only sets parameters of the allocator.
    unsafe {
        libc::mallopt(libc::M_TRIM_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_ARENA_MAX, arenas);
    }
}

/// Installs `kind`'s filter on the calling thread (nothing when `mode` is off).
pub fn apply(kind: ThreadKind, mode: SeccompMode) -> Result<(), SeccompError> {
    match program(kind, mode)? {
        Some(prog) => install(kind, &prog),
        None => Ok(()),
    }
}

/// Installs a program made by [`program`] for `kind` on the calling thread.
pub fn install(kind: ThreadKind, prog: &BpfProgram) -> Result<(), SeccompError> {
    apply_filter(prog).map_err(|e| SeccompError::Install {
        kind: kind.name(),
        why: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use seccompiler::{
        SeccompAction, SeccompCmpArgLen, SeccompCmpOp, SeccompCondition, SeccompFilter,
        SeccompRule, TargetArch,
    };
    use std::collections::BTreeMap;

    /// Runs a classic BPF seccomp program on (nr, arch, args[0]) as the kernel would,
    /// for the instructions seccompiler and `programs` emit.
    fn run(prog: &[sock_filter], nr: u32, arch: u32, arg0: u64) -> u32 {
        let data = |off: u32| -> u32 {
            match off {
                0 => nr,
                4 => arch,
                16 => arg0 as u32,
                20 => (arg0 >> 32) as u32,
                _ => 0,
            }
        };
        let (mut a, mut pc) = (0u32, 0usize);
        loop {
            let i = &prog[pc];
            pc += 1;
            let jump = |taken: bool| if taken { i.jt as usize } else { i.jf as usize };
            match i.code {
                0x20 => a = data(i.k),            // ld [k]
                0x54 => a &= i.k,                 // and #k
                0x05 => pc += i.k as usize,       // ja
                0x15 => pc += jump(a == i.k),     // jeq
                0x25 => pc += jump(a > i.k),      // jgt
                0x35 => pc += jump(a >= i.k),     // jge
                0x45 => pc += jump(a & i.k != 0), // jset
                0x06 => return i.k,               // ret
                c => panic!("instruction {c:#x} not interpreted"),
            }
        }
    }

    #[test]
    fn compact_programs_decide_like_seccompilers_and_are_shorter() {
        let flags = [
            0,
            libc::SIGCHLD as u64,
            (libc::CLONE_VM | libc::CLONE_THREAD | libc::CLONE_SIGHAND) as u64,
            libc::CLONE_THREAD as u64 | 1 << 40,
            1 << 40,
            libc::AF_UNIX as u64,
            libc::AF_INET as u64,
            libc::AF_UNIX as u64 | 1 << 40,
        ];
        for kind in ThreadKind::ALL {
            for mode in [
                SeccompMode::KillProcess,
                SeccompMode::KillThread,
                SeccompMode::Log,
            ] {
                let ours = &program(kind, mode).unwrap().unwrap();
                let theirs = &seccompiler_program(kind, mode).unwrap();
                assert!(
                    ours.len() * 3 < theirs.len(),
                    "{}: {} vs {}",
                    kind.name(),
                    ours.len(),
                    theirs.len()
                );
                for nr in (0..600u32).chain([0x4000_0000, 0x4000_0002, u32::MAX]) {
                    for arch in [AUDIT_ARCH_X86_64, 0x4000_0003] {
                        for &arg0 in &flags {
                            let (o, t) = (run(ours, nr, arch, arg0), run(theirs, nr, arch, arg0));
                            assert_eq!(
                                o,
                                t,
                                "{} {mode:?}: nr {nr} arch {arch:#x} arg0 {arg0:#x}",
                                kind.name()
                            );
                        }
                    }
                }
                // And what they decide is what the lists say.
                for n in allowed(kind) {
                    let arg0 = if n == libc::SYS_clone {
                        libc::CLONE_THREAD as u64
                    } else {
                        0
                    };
                    assert_eq!(run(ours, n as u32, AUDIT_ARCH_X86_64, arg0), RET_ALLOW);
                }
                let socket = |domain| {
                    run(ours, libc::SYS_socket as u32, AUDIT_ARCH_X86_64, domain) == RET_ALLOW
                };
                assert_eq!(socket(libc::AF_INET as u64), kind == ThreadKind::Vmm);
                assert_eq!(
                    socket(libc::AF_UNIX as u64),
                    kind == ThreadKind::Vmm || unix_sockets_only(kind)
                );
            }
        }
    }

    /// `kind`'s filter as seccompiler builds it (with the clone3 prologue by hand): the
    /// reference the compact program must agree with on every call.
    fn seccompiler_program(
        kind: ThreadKind,
        mode: SeccompMode,
    ) -> Result<BpfProgram, SeccompError> {
        let mismatch = match mode {
            SeccompMode::Off => panic!("no program when off"),
            SeccompMode::KillProcess => SeccompAction::KillProcess,
            SeccompMode::KillThread => SeccompAction::KillThread,
            SeccompMode::Log => SeccompAction::Log,
        };
        let build = |rules: BTreeMap<i64, Vec<SeccompRule>>, mismatch, matched| {
            SeccompFilter::new(rules, mismatch, matched, TargetArch::x86_64)
                .and_then(BpfProgram::try_from)
                .map_err(|e| SeccompError::Build {
                    kind: kind.name(),
                    why: e.to_string(),
                })
        };
        let mut rules: BTreeMap<i64, Vec<SeccompRule>> =
            allowed(kind).into_iter().map(|n| (n, vec![])).collect();
        let mut prologue = Vec::new();
        if kind != ThreadKind::Vmm {
            let only_threads = SeccompCondition::new(
                0,
                SeccompCmpArgLen::Qword,
                SeccompCmpOp::MaskedEq(libc::CLONE_THREAD as u64),
                libc::CLONE_THREAD as u64,
            )
            .and_then(|c| SeccompRule::new(vec![c]))
            .map_err(|e| SeccompError::Build {
                kind: kind.name(),
                why: e.to_string(),
            })?;
            rules.insert(libc::SYS_clone, vec![only_threads]);
            prologue = clone3_enosys();
        }
        if unix_sockets_only(kind) {
            let unix = SeccompCondition::new(
                0,
                SeccompCmpArgLen::Dword,
                SeccompCmpOp::Eq,
                libc::AF_UNIX as u64,
            )
            .and_then(|c| SeccompRule::new(vec![c]))
            .map_err(|e| SeccompError::Build {
                kind: kind.name(),
                why: e.to_string(),
            })?;
            rules.insert(libc::SYS_socket, vec![unix]);
        }
        let mut prog = prologue;
        prog.extend(build(rules, mismatch, SeccompAction::Allow)?);
        Ok(prog)
    }

    /// BPF that makes `clone3` answer ENOSYS on x86_64 and falls through to what follows
    /// for every other call (seccompiler gives one action per filter).
    fn clone3_enosys() -> Vec<sock_filter> {
        let ins = |code, jt, jf, k| sock_filter { code, jt, jf, k };
        vec![
            ins(LD_W_ABS, 0, 0, 4), // seccomp_data.arch
            ins(JEQ_K, 0, 3, AUDIT_ARCH_X86_64),
            ins(LD_W_ABS, 0, 0, 0), // seccomp_data.nr
            ins(JEQ_K, 0, 1, libc::SYS_clone3 as u32),
            ins(RET_K, 0, 0, RET_ERRNO | libc::ENOSYS as u32),
        ]
    }

    #[test]
    fn every_kind_compiles_in_every_mode() {
        for kind in ThreadKind::ALL {
            for mode in [
                SeccompMode::KillProcess,
                SeccompMode::KillThread,
                SeccompMode::Log,
            ] {
                assert!(program(kind, mode).unwrap().is_some());
            }
            assert!(program(kind, SeccompMode::Off).unwrap().is_none());
        }
    }

    #[test]
    fn narrower_kinds_are_subsets_of_the_threads_that_spawn_them() {
        let vmm = allowed(ThreadKind::Vmm);
        let vcpu = allowed(ThreadKind::Vcpu);
        for kind in ThreadKind::ALL {
            for n in allowed(kind) {
                assert!(vmm.contains(&n), "{} allows {n}, vmm does not", kind.name());
            }
        }
        for n in allowed(ThreadKind::Device) {
            assert!(vcpu.contains(&n), "device allows {n}, vcpu does not");
        }
        assert!(!vcpu.contains(&libc::SYS_clone3));
        assert!(!allowed(ThreadKind::Api).contains(&libc::SYS_socket));
        assert!(!allowed(ThreadKind::Device).contains(&libc::SYS_ioctl));
        assert!(vmm.contains(&libc::SYS_clone3));
    }

    #[test]
    fn modes_parse() {
        assert_eq!("kill".parse(), Ok(SeccompMode::KillProcess));
        assert_eq!("kill-thread".parse(), Ok(SeccompMode::KillThread));
        assert_eq!("log".parse(), Ok(SeccompMode::Log));
        assert_eq!("off".parse(), Ok(SeccompMode::Off));
        assert!("trap".parse::<SeccompMode>().is_err());
    }
}
