//! Stage 5, the child's rebuild: a new VM around the inherited guest RAM.
//!
//! A child starts with only the forking thread. It dies with its parent
//! (`PR_SET_PDEATHSIG`, removing its sockets first: `signals::die_with_parent`), unmaps
//! the parent's `kvm_run` pages, closes every inherited file descriptor but its pipes,
//! and never drops the parent's objects (their threads do not exist in the child).
//! Then, in order:
//!
//! 1. it moves itself into its cgroup, if it was not born inside (`cgroups.rs`); a
//!    warm clone then writes its template's working set ahead (`working.rs`);
//! 2. `builder::rebuild::prepare`: a new VM on the inherited memory (memory slots
//!    first, then TSS, irqchip, PIT), its vCPUs restored from the captured state;
//! 3. [`launch`]: its configuration (sockets, console, tap, limits from its
//!    [`Identity`]), its devices restored from their state, the VM-wide state, its vCPU
//!    threads started; once vCPU 0 is in the guest, the devices' host sides (tap, vsock
//!    socket) are opened;
//! 4. the rebuilt VM goes to the `serve` hook the controller gave the [`Cloner`]
//!    ([`CloneHooks`]; a handover, if the clone has one, was taken up by the `take`
//!    hook before its vCPUs ran): the controller opens its control socket, marks it
//!    ready ([`ReadyMark`]), starts its device workers and runs its event loop. (The
//!    event loop is the controller's, a layer above this one: the hook keeps this
//!    module from depending on it.)
//!
//! A clone made on request does all of it at once. A warm clone (`warm.rs`) is forked
//! ahead of time from a paused template: it prepares, then blocks on its `go` pipe until
//! a request gives it an identity, re-times its clocks and launches. Its vCPU 0 writes
//! the time it first enters the guest into the `ready` pipe, which gives the latency;
//! the controller marks it ready once the control socket is up (both on the ready pipe,
//! `wire.rs`).

use std::borrow::Cow;
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clone::MicrovmState;

use super::cgroups::{place_self, Placement};
use super::hooks::{CloneHooks, HandedOver, KeptLife, PrimeFailure, RebuiltClone, ServeError};
use super::request::Identity;
use super::rewind::{RewindError, Rewinder};
use super::wire::{
    report_back, report_life_ended, report_primed, wait_for_go, Go, LaunchError, ReadyMark,
};
use super::working::{populate, Duty, ForChild, PageSet};
use super::Cloner;
use crate::builder::rebuild::{
    prepare, prepare_or_reuse, start_rebuilt, Prepared, RebuildError, StartFrom,
};
use crate::config::{keep_overlays, ConsoleSink, NoSuchDevice, VmConfig};
use crate::device_manager::Inserted;
use crate::errno::errno_of;
use crate::kept::KeptThread;
use crate::logging::{raw_eprintln, StageTimer};
use crate::microvm::{Microvm, RunOutcome, VmParts};
use crate::signals::block_shutdown_signals;
use crate::vstate::kvm::KvmContext;
use crate::vstate::vcpu::{monotonic_ns, VcpuError};

/// How a child starts.
pub(crate) enum Start {
    /// Launch at once with this identity.
    Now(Box<Identity>),
    /// Prepare, then wait for an identity on this channel (a warm clone).
    Warm {
        /// The child's end of the go channel (`wire::go_channel`).
        go: RawFd,
        /// The cgroup it moves itself into at once (the first class's).
        cgroup: Option<Placement>,
        /// The vCPU to prime it on (the hooks' `prime`), if it is primed.
        prime: Option<u8>,
        /// The prime request's pages to map (`working::prime_pages`, found once by the
        /// template for its paused state and working set; empty: none).
        touch: Arc<[u8]>,
        /// The template's memory (`rewind::open_own_memory`), when its invocation
        /// clones are rewound.
        rewind: Option<RawFd>,
    },
}

/// What every child of a VM takes from it, whatever its start.
pub(crate) struct Lineage {
    /// What the layers above do in the child.
    pub hooks: CloneHooks,
    /// The VM's working set (`working.rs`), if it keeps one.
    pub working: Option<ForChild>,
}

/// Everything a child needs from its parent, gathered before fork.
pub(crate) struct ChildPlan<'a> {
    pub parent_pid: i32,
    /// Write end of the ready pipe.
    pub ready: RawFd,
    pub start: Start,
    pub state: &'a MicrovmState,
    /// The parent's VM: the child takes its configuration, memory, /dev/kvm, open disk
    /// images and host report (and never drops it).
    pub template: &'a Microvm,
    /// What the layers above do in the child.
    pub hooks: CloneHooks,
    /// The parent's working set, written ahead by a warm clone, and where a clone
    /// reports its own.
    pub working: Option<ForChild>,
    /// The parent's vCPUs' kvm_run mappings, unmapped in the child.
    pub run_bases: &'a [usize],
    /// The copies of the parent's disk overlays made for this child, in disk order.
    pub overlays: &'a [Option<devices::virtio::block::overlay::OverlaySnapshot>],
}

/// Errors rebuilding a VM in a clone.
#[derive(Debug, thiserror::Error)]
pub enum ChildError {
    /// Rebuilding the VM failed.
    #[error(transparent)]
    Rebuild(#[from] RebuildError),
    /// Re-timing a warm clone's vCPU failed.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
    /// Serving the clone failed.
    #[error("{0}")]
    Serve(ServeError),
    /// Signal routing failed.
    #[error("cannot set up signal handling: {0}")]
    Signals(std::io::Error),
    /// The pipe that tells the parent the clone is ready failed.
    #[error("ready pipe: {0}")]
    ReadyPipe(std::io::Error),
    /// The parent's launch message could not be read.
    #[error("bad launch message from the parent: {0}")]
    Launch(#[from] LaunchError),
    /// The go channel failed.
    #[error("cannot report the prime to the parent: {0}")]
    ReportPrime(nix::Error),
    /// The identity's rate limits do not fit the template's devices.
    #[error("cannot apply the clone's rate limits: {0}")]
    RateLimits(#[from] NoSuchDevice),
    /// The clone could not move itself into its cgroup (it does not run unconfined).
    #[error("cannot enter its cgroup: {0}")]
    Cgroup(std::io::Error),
    /// The images for its disk slots could not be taken up.
    #[error("cannot take up its disk slots' images: {0}")]
    Media(std::io::Error),
    /// A warm clone's prime failed (the warm clone ends).
    #[error("prime failed: {0}")]
    Prime(#[from] PrimeFailure),
    /// The clone's handover could not be taken up.
    #[error("cannot take up the clone's handover: {0}")]
    Take(ServeError),
    /// The clone could not be rewound after its request (it ends).
    #[error("cannot rewind: {0}")]
    Rewind(#[from] RewindError),
    /// A rewound clone could not tell its parent it is back (it ends).
    #[error("cannot tell the parent this rewound clone is back: {0}")]
    ReportBack(nix::Error),
    /// A fork source could not take its channel to its template (it ends).
    #[error("cannot take the fork source's channel: {0}")]
    Source(std::io::Error),
    /// A clone to be rewound could not tell its parent its life ended (it ends).
    #[error("cannot tell the parent this clone's life ended: {0}")]
    ReportEnded(nix::Error),
}

/// Closes every descriptor from 3 up except those in `keep`.
fn close_all_but(keep: &[RawFd]) {
    let mut keep: Vec<u32> = keep.iter().map(|&fd| fd as u32).collect();
    keep.sort_unstable();
    let mut from = 3u32;
    for fd in keep {
        if fd > from {
            // SAFETY: closes inherited descriptors; the objects that own them in this
            // process belong to the parent's threads and are never used or dropped here.
            unsafe { libc::close_range(from, fd - 1, 0) };
        }
        from = from.max(fd + 1);
    }
    // SAFETY: as above.
    unsafe { libc::close_range(from, u32::MAX, 0) };
}

/// The child side of fork(). Never returns.
pub(crate) fn child_main(plan: ChildPlan<'_>) -> ! {
    // Ends this clone (after it removes its files) when the thread that forked it ends;
    // SIGKILL if the handler cannot be set up.
    if crate::signals::die_with_parent().is_err() {
        let _ = nix::sys::prctl::set_pdeathsig(nix::sys::signal::Signal::SIGKILL);
    }
    if nix::unistd::getppid().as_raw() != plan.parent_pid {
        // SAFETY: _exit has no preconditions; the parent is gone already.
        unsafe { libc::_exit(1) }
    }
    for base in plan.run_bases {
        // SAFETY: these are the parent's vCPU kvm_run mappings, inherited by fork; no
        // thread of this process uses them (their owners exist only in the parent).
        unsafe { libc::munmap(*base as *mut libc::c_void, plan.template.kvm_run_size()) };
    }
    let mut keep = plan.template.devices().disk_fds().to_vec();
    let slots = plan.template.devices().slot_media();
    keep.extend(slots.iter().flatten().map(|(fd, _)| *fd));
    keep.extend(
        plan.overlays
            .iter()
            .flatten()
            .map(|o| std::os::fd::AsRawFd::as_raw_fd(&o.file)),
    );
    keep.push(plan.ready);
    keep.push(std::os::fd::AsRawFd::as_raw_fd(&plan.template.kvm().kvm));
    keep.extend(plan.working.iter().map(|w| w.report));
    match &plan.start {
        Start::Warm { go, rewind, .. } => {
            keep.push(*go);
            keep.extend(rewind);
        }
        Start::Now(id) => {
            keep.extend(id.cgroup.iter().flat_map(|p| p.fds.iter().copied()));
            keep.extend(id.carried.iter().map(|c| c.stream.as_raw_fd()));
            keep.extend(id.media_files.iter().map(|f| f.as_raw_fd()));
            keep.extend(id.overlay_files.iter().map(|f| f.as_raw_fd()));
            keep.extend(id.source.iter().map(|f| f.as_raw_fd()));
        }
    }
    close_all_but(&keep);
    crate::logging::set_tag(&format!("clone pid {}", std::process::id()));
    // SAFETY: the ready pipe's write end, kept open above, owned from here on.
    let ready = unsafe { File::from_raw_fd(plan.ready) };
    // The parent answers once every write end of the ready pipe is closed: vCPU 0's
    // (after it wrote its timestamp) and the mark's (after the control socket is up, or
    // the clone failed and said why); a pipe that ends without the mark is a clone that
    // failed.
    let mark = ready.try_clone().ok().map(ReadyMark::new);
    let mut name = String::from("(warm)");
    // A panic must end the clone here: unwinding further would run the destructors of
    // the parent's objects this process inherited (its control socket's, which removes
    // the parent's socket file, among them).
    let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &mark {
        Some(m) => run_clone(&plan, ready, m.share(), &mut name),
        None => Err(ChildError::ReadyPipe(std::io::Error::last_os_error())),
    }));
    let fail = |errno: i32, why: &str| {
        if let Some(m) = &mark {
            m.fail(errno, why);
        }
    };
    let code = match run {
        Ok(Ok(outcome)) => {
            if let RunOutcome::Error(msg) = &outcome {
                raw_eprintln(&format!("vmm: clone {name}: guest stopped: {msg}"));
            }
            outcome.exit_code()
        }
        Ok(Err(e)) => {
            raw_eprintln(&format!("vmm: clone {name}: {e}"));
            let errno = match &e {
                ChildError::Serve(inner) => errno_of(inner.as_ref()),
                e => errno_of(e),
            };
            fail(errno, &e.to_string());
            match e {
                ChildError::Prime(PrimeFailure {
                    timed_out: true, ..
                }) => PRIME_TIMEOUT_EXIT,
                _ => 1,
            }
        }
        Err(_) => {
            raw_eprintln(&format!("vmm: clone {name}: panicked (reported above)"));
            fail(0, "the clone panicked");
            PANIC_EXIT
        }
    };
    // Exit without running the parent's atexit handlers or flushing its stdio buffers.
    // SAFETY: _exit has no preconditions.
    unsafe { libc::_exit(code) }
}

/// A clone's exit status after a panic on its main thread (as a Rust program's).
const PANIC_EXIT: i32 = 101;

/// A warm clone's exit status when its prime ran out of time (`EX_TEMPFAIL`): the
/// template pauses priming for a while rather than turning it off (`warm.rs`).
pub(super) const PRIME_TIMEOUT_EXIT: i32 = 75;

/// `state` with the guest's clocks moved on to now, as if it had kept running since the
/// capture, and a timer interrupt already due moved on as `id` says (`clone::timer`: an
/// invocation's handler runs before the kernel catches up).
fn advanced(state: &MicrovmState, id: &Identity) -> MicrovmState {
    let mut state = state.clone();
    state.advance_clocks(monotonic_ns().saturating_sub(state.captured_at_ns));
    if id.defer_timer_ns > 0 {
        for v in &mut state.vcpus {
            v.defer_timer(id.defer_timer_ns);
        }
    }
    state
}

/// A clone made on request: into its cgroup, then its VM prepared from the state as
/// of now (clocks advanced, its guest result set).
fn prepare_now(
    kvm: &KvmContext,
    plan: &ChildPlan<'_>,
    id: &Identity,
    marks: &mut StageTimer,
) -> Result<(MicrovmState, Prepared, Arc<PageSet>), ChildError> {
    // First, while this is the process's only thread (see place_self).
    if let Some(p) = &id.cgroup {
        place_self(p).map_err(ChildError::Cgroup)?;
        marks.done("placed");
    }
    // An invocation's clone, on its request's path: cheaper than the guest's own first
    // writes (`working.rs`).
    let ahead = if id.carried.is_some() {
        write_ahead(plan, marks)
    } else {
        Arc::default()
    };
    let mut state = advanced(plan.state, id);
    if let Some((vcpu, value)) = id.guest_result {
        if let Some(v) = state.vcpus.iter_mut().find(|v| v.id == vcpu) {
            v.regs.rax = value;
        }
    }
    let prepared = prepare(kvm, &state, plan.template.memory(), plan.template.mailbox())?;
    Ok((state, prepared, ahead))
}

/// Writes the template's working set ahead in this clone (a hint: a failure is
/// logged); returns the set, empty when there is none.
fn write_ahead(plan: &ChildPlan<'_>, marks: &mut StageTimer) -> Arc<PageSet> {
    let Some(w) = plan.working.as_ref().filter(|w| !w.set.is_empty()) else {
        return Arc::default();
    };
    if let Err(e) = populate(plan.template.memory(), &w.set) {
        tracing::warn!("cannot write the working set ahead: {e}");
    }
    marks.done("written ahead");
    w.set.clone()
}

/// A warm clone as launched: its state, its VM, its launch message and the pages it
/// wrote ahead.
type Warmed = (MicrovmState, Prepared, Go, Arc<PageSet>);

/// A warm clone: into the default class's cgroup, its template's working set written
/// ahead, its VM prepared (and primed on vCPU `prime`, when given), then it waits for
/// its identity and re-times its vCPUs to the launch. A rewound clone (`reuse`: its VM)
/// has its cgroup and its pages already: it is prepared (and primed) again in its VM,
/// then tells its template it is back. None: discarded unlaunched.
fn prepare_warm(
    kvm: &KvmContext,
    plan: &ChildPlan<'_>,
    (go, cgroup, prime, touch): (RawFd, Option<&Placement>, Option<u8>, &[u8]),
    marks: &mut StageTimer,
    reuse: Option<Prepared>,
) -> Result<Option<Warmed>, ChildError> {
    let rewound = reuse.is_some();
    if let (Some(p), false) = (cgroup, rewound) {
        place_self(p).map_err(ChildError::Cgroup)?;
    }
    // Before the prime, which then finds those pages its own too.
    let ahead = if rewound {
        Arc::default()
    } else {
        write_ahead(plan, marks)
    };
    let (base, prepared) = match prime {
        Some(vcpu) => {
            let (state, prepared) =
                (plan.hooks.prime)(kvm, plan.template, plan.state, vcpu, reuse, touch)?;
            // Tells the parent it may launch this clone (`warm::WarmClone::launchable`).
            if !rewound {
                report_primed(go).map_err(ChildError::ReportPrime)?;
            }
            (Cow::Owned(state), prepared)
        }
        None => {
            let mem = plan.template.memory();
            let window = plan.template.mailbox();
            (
                Cow::Borrowed(plan.state),
                prepare_or_reuse(kvm, plan.state, mem, window, reuse)?,
            )
        }
    };
    marks.done(if prime.is_some() {
        "primed"
    } else {
        "prepared"
    });
    if rewound {
        tracing::debug!("rewound: {}", marks.report());
        report_back(go).map_err(ChildError::ReportBack)?;
    }
    let Some((id, carried)) = wait_for_go(go)? else {
        return Ok(None);
    };
    marks.done("go");
    if let Some(p) = &id.cgroup {
        place_self(p).map_err(ChildError::Cgroup)?;
        marks.done("placed");
    }
    let state = advanced(&base, &id);
    for (v, s) in prepared.vcpus.iter().zip(&state.vcpus) {
        let rax = id
            .guest_result
            .and_then(|(vcpu, value)| (vcpu == s.id).then_some(value));
        v.retime(s, rax)?;
    }
    Ok(Some((state, prepared, (id, carried), ahead)))
}

/// The template's configuration as clone `id` uses it: its own sockets, console, tap,
/// MAC, limits and overlay policy.
fn clone_config(template: &VmConfig, id: &Identity) -> Result<VmConfig, ChildError> {
    let mut config = template.clone();
    config.host.api_sock = Some(id.api_sock.clone());
    // A clone is no template of its own (`--template` is not inherited), but for a
    // fork source (`sources.rs`).
    config.invoke.template = id.source.is_some();
    config.host.console = ConsoleSink::File(id.console.clone());
    if let (Some(v), Some(path)) = (config.machine.vsock.as_mut(), &id.vsock) {
        v.uds_path = path.clone();
    }
    config.machine.apply_rate_limits(&id.rate_limits)?;
    // Should it become a template, its own pools' default class is its request's.
    if let (Some(cgroups), Some(class)) = (config.host.cgroups.as_mut(), &id.class) {
        cgroups.make_default(class);
    }
    // Its own tap and MAC (the tap is created here; it goes when the clone exits).
    let pid = std::process::id() as i32;
    config.machine.disks = keep_overlays(&config.machine.disks, id.keep_overlays);
    config.machine.net = config.machine.net.map(|n| n.for_clone(pid, &id.net));
    Ok(config)
}

/// The images `id` inserts into the clone's disk slots, each its own descriptor.
fn inserted_media(id: &Identity) -> std::io::Result<Vec<Inserted>> {
    let mut overlays = id.overlay_files.iter();
    (id.media.iter().zip(&id.media_files))
        .map(|((slot, path, writable), f)| {
            let overlay = match writable {
                true => Some(overlays.next().ok_or_else(|| {
                    std::io::Error::other(format!("no overlay file for disk slot {slot}"))
                })?),
                false => None,
            };
            Ok(Inserted {
                slot: *slot,
                path: path.clone(),
                file: f.try_clone()?,
                overlay: overlay.map(|o| o.try_clone()).transpose()?,
            })
        })
        .collect()
}

/// [`start_rebuilt`] for the clone with `config`, on its template's memory and disks.
fn launch(
    plan: &ChildPlan<'_>,
    (kvm, mut prepared): (KvmContext, Prepared),
    (state, config, seq): (&MicrovmState, VmConfig, u32),
    (ready, media): (File, &[Inserted]),
    marks: &mut StageTimer,
) -> Result<VmParts, ChildError> {
    let template = plan.template;
    let mem = template.memory();
    let from = StartFrom {
        mem,
        config: &config,
        seq,
        state,
        disk_fds: template.devices().disk_fds(),
        overlays: plan.overlays,
        slots: template.devices().slot_media(),
        media,
    };
    let (devices, vcpus) = start_rebuilt(&mut prepared, &from, ready, marks)?;
    Ok(VmParts {
        config,
        mailbox: template.mailbox(),
        vm: prepared.vm,
        mem: mem.clone(),
        kvm,
        devices,
        vcpus,
        host: template.host().clone(),
        cmdline: template.cmdline().to_string(),
        capture_spec: template.capture_spec().clone(),
        kvm_run_size: template.kvm_run_size(),
    })
}

fn run_clone(
    plan: &ChildPlan<'_>,
    ready: File,
    mark: ReadyMark,
    name: &mut String,
) -> Result<RunOutcome, ChildError> {
    // SAFETY: the parent's KvmContext in this process is never dropped (see child_main).
    let kvm = unsafe { plan.template.kvm().inherited() };
    let mut marks = StageTimer::new();
    // First, off the request's path (a warm clone's launch waits for none of it).
    let signals = block_shutdown_signals().map_err(ChildError::Signals)?;
    let (go, cgroup, prime, touch, rewind) = match &plan.start {
        Start::Now(id) => {
            let (state, prepared, ahead) = prepare_now(&kvm, plan, id, &mut marks)?;
            let carried = (id.carried.as_ref()).map(|c| {
                // SAFETY: the stream's descriptor, inherited and kept open by
                // close_all_but; its owner in this process (the parent's) is never
                // dropped, so this is its only owner here.
                let fd = unsafe { OwnedFd::from_raw_fd(c.stream.as_raw_fd()) };
                (Cow::Borrowed(c.payload.as_slice()), 0, fd)
            });
            let life = Life {
                state,
                identity: Identity::clone(id),
                carried,
                go: None,
                ahead,
                primed: false,
                signals,
                api_thread: None,
            };
            let run = life.run(
                plan,
                (kvm, prepared),
                (ready, mark),
                name,
                &mut marks,
                false,
            );
            return run.map(|(outcome, _)| outcome);
        }
        Start::Warm {
            go,
            cgroup,
            prime,
            touch,
            rewind,
        } => (*go, cgroup.as_ref(), *prime, touch, *rewind),
    };
    // Before anything writes guest memory: the prime, the working set written ahead.
    // A copy of the template's writable disk overlays would keep a request's writes
    // into the next: such a clone ends as before (`rewind.rs`).
    let overlays = plan.overlays.iter().any(Option::is_some);
    let rewind = rewind.filter(|_| !overlays);
    let mut rewinder = rewind.and_then(|fd| {
        Rewinder::new(fd, plan.template.memory(), kvm.host, plan.state)
            .map_err(|e| tracing::warn!("this clone will not be rewound: {e}"))
            .ok()
    });
    let mut kvm = kvm;
    let mut signals = Some(signals);
    let mut reuse = None;
    let mut api_thread = None;
    let mut first = Some((ready, mark));
    loop {
        // The first life's was made above; a rewound clone's before it waits again.
        let signals = match signals.take() {
            Some(s) => s,
            None => block_shutdown_signals().map_err(ChildError::Signals)?,
        };
        let start = (go, cgroup, prime, &**touch);
        let Some((state, prepared, (mut identity, carried), ahead)) =
            prepare_warm(&kvm, plan, start, &mut marks, reuse.take())?
        else {
            return Ok(RunOutcome::ApiShutdown);
        };
        // The first launch reports on the pipe inherited from the fork; a rewound
        // clone's on the one its launch message brought (the template answers once
        // every write end is closed: none may stay in the identity).
        let sent = identity.ready.take().and_then(|f| Arc::try_unwrap(f).ok());
        let pipe = match (first.take(), sent) {
            (Some(pipe), _) => pipe,
            (None, Some(f)) => {
                let mark = ReadyMark::new(f.try_clone().map_err(ChildError::ReadyPipe)?);
                (f, mark)
            }
            (None, None) => {
                return Err(ChildError::Launch(LaunchError::new(
                    "a rewound clone's launch without a ready pipe",
                )))
            }
        };
        let carried = carried.map(|(p, unread, fd)| (Cow::Owned(p), unread, fd));
        let life = Life {
            state,
            identity,
            carried,
            go: Some(go),
            ahead,
            primed: prime.is_some(),
            signals,
            api_thread: api_thread.take(),
        };
        let keep = rewinder.is_some();
        let (outcome, kept) = life.run(plan, (kvm, prepared), pipe, name, &mut marks, keep)?;
        let (Some(kept), Some(r)) = (kept, rewinder.as_mut()) else {
            return Ok(outcome);
        };
        // The life's sockets are gone: its record ends now, not once it is back.
        report_life_ended(go).map_err(ChildError::ReportEnded)?;
        marks = StageTimer::new();
        api_thread = kept.api_thread;
        let (k, prepared, pages) = r.rewind(kept.vm, &mut marks)?;
        tracing::debug!(
            "rewind {} ({} with the memory slots registered again): {} bytes in {} ranges \
             copied back",
            r.count,
            r.zaps,
            pages.bytes,
            pages.ranges
        );
        crate::logging::set_tag(&format!("clone pid {} (rewound)", std::process::id()));
        "(rewound)".clone_into(name);
        kvm = k;
        reuse = Some(prepared);
    }
}

/// One request's life in a clone: from its identity to the end of its event loop.
struct Life<'a> {
    /// The state it is launched from.
    state: MicrovmState,
    identity: Identity,
    /// A handover's payload (what is at hand, and how many bytes more are on the go
    /// channel) and stream.
    carried: Option<(Cow<'a, [u8]>, usize, OwnedFd)>,
    /// A warm clone's go channel.
    go: Option<RawFd>,
    /// The pages it wrote ahead.
    ahead: Arc<PageSet>,
    /// Whether it is a primed warm clone.
    primed: bool,
    /// Its signalfd, made before the launch (off the request's path).
    signals: nix::sys::signalfd::SignalFd,
    /// The API thread of the life before (a rewound clone's).
    api_thread: Option<KeptThread>,
}

impl Life<'_> {
    /// Launches the prepared VM with this identity and serves it until it stops;
    /// with `keep`, gives the VM back when it served its invocation, with its API
    /// thread.
    fn run(
        self,
        plan: &ChildPlan<'_>,
        (kvm, prepared): (KvmContext, Prepared),
        (ready, mark): (File, ReadyMark),
        name: &mut String,
        marks: &mut StageTimer,
        keep: bool,
    ) -> Result<(RunOutcome, Option<KeptLife>), ChildError> {
        let Life {
            state,
            identity,
            carried,
            go,
            ahead,
            primed,
            signals,
            api_thread,
        } = self;
        name.clone_from(&identity.id);
        crate::logging::set_tag(&format!("clone {}", identity.id));
        // Before any of them exists: a parent killed with SIGKILL cannot remove them.
        // Its sockets, and the console of a clone handed something (an invocation's):
        // what the parent removes when it reaps such a clone (other clones' consoles are
        // kept for reading).
        let transient = carried.is_some() && identity.console != Path::new("/dev/null");
        let console = transient.then_some(&identity.console);
        let files = [Some(&identity.api_sock), console, identity.vsock.as_ref()];
        crate::signals::remove_at_parent_death(files.into_iter().flatten().map(PathBuf::as_path));
        let launched = Instant::now();
        marks.done("vcpus");
        let config = clone_config(plan.template.config(), &identity)?;
        // The guest reads the last part of its id ("2.1" -> 1) from the identity port.
        let seq = (identity.id.rsplit('.').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0);
        // The handover is taken up before the vCPUs run (an invocation's request goes
        // into the clone's copy of the mailbox; its port read already has the length,
        // `guest_result`).
        let taken = match (&identity.note, carried) {
            (Some(note), Some((payload, unread, stream))) => {
                let rest = match go {
                    Some(fd) if unread > 0 => {
                        // SAFETY: the go channel's descriptor, open for this process's
                        // life (close_all_but keeps it; nothing closes it); borrowed
                        // for the take.
                        Some((unsafe { BorrowedFd::borrow_raw(fd) }, unread))
                    }
                    _ => None,
                };
                let handed = HandedOver {
                    note,
                    payload: &payload,
                    rest,
                    stream: stream.into(),
                    primed,
                };
                let t = (plan.hooks.take)(handed, &config, plan.template);
                Some(t.map_err(ChildError::Take)?)
            }
            _ => None,
        };
        let media = inserted_media(&identity).map_err(ChildError::Media)?;
        let parts = launch(
            plan,
            (kvm, prepared),
            (&state, config, seq),
            (ready, &media),
            marks,
        )?;
        tracing::info!(
            "clone {} (pid {}) running {} us after launch",
            identity.id,
            std::process::id(),
            launched.elapsed().as_micros()
        );
        tracing::debug!("clone {} stages: {}", identity.id, marks.report());
        let duty = (plan.working.as_ref())
            .filter(|_| identity.record_working_set)
            .map(|w| Duty::new(w, ahead));
        let vm = Microvm::new(parts);
        let mut cloner = Cloner::for_clone(identity.id, vm.config(), plan.hooks, duty);
        if let Some(channel) = &identity.source {
            let channel = channel.try_clone().map_err(ChildError::Source)?;
            cloner.become_source(vm.config(), channel);
        }
        let rebuilt = RebuiltClone {
            vm,
            cloner,
            api_sock: identity.api_sock,
            signals,
            ready: mark,
            taken,
            keep,
            api_thread,
        };
        (plan.hooks.serve)(rebuilt).map_err(ChildError::Serve)
    }
}
