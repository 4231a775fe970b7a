//! Stage 4, fork: one child per clone, each forked through the fork gate
//! (`crate::gate`: no other thread holds a lock or is inside malloc) into its cgroup
//! where it has one: born inside with `clone3(CLONE_INTO_CGROUP)` on v2, forked by the
//! forker thread waiting inside on v1 (`forker.rs`), or moving itself in first
//! (`cgroups.rs`). Guest RAM is anonymous `MAP_PRIVATE` memory, so every child shares
//! it copy-on-write; each writable disk's overlay is copied for it first.
//!
//! The parent then waits on each child's ready pipe (`wire.rs`) for the time its vCPU 0
//! first entered the guest and the mark that its sockets are up.
//!
//! Next, in the child: the rebuild (`child.rs`).

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd};

use std::time::{Duration, Instant};

use api_types::cgroup::PlacedBy;
use api_types::CloneInfo;
use clone::MicrovmState;

use super::cgroups::{self, ClonePools, Taken};
use super::child::{child_main, ChildPlan, Lineage, Start};
use super::request::{give_back, starting_info, NewClone};
use super::working::PAGE;
use super::CloneError;
use crate::microvm::Microvm;

/// How long the parent waits for a clone's vCPU 0 to enter the guest.
pub(super) const READY_TIMEOUT: Duration = Duration::from_secs(10);

/// Forks one child of `lineage` that rebuilds `vm` from `state` and starts per `start`; `ready` is
/// the write end of its ready pipe; `taken` its cgroup: the child is born in it when
/// it is a v2 one (`clone3`) or the forker's seat with the forker inside (v1). Returns
/// the child's pid and whether it was born inside its cgroup that way. Every vCPU
/// must be parked.
pub(super) fn fork_child(
    vm: &Microvm,
    pools: Option<&ClonePools>,
    lineage: &Lineage,
    state: &MicrovmState,
    ready: &OwnedFd,
    start: Start,
    taken: Option<&Taken>,
) -> Result<(i32, bool), CloneError> {
    let run_bases: Vec<usize> = vm.vcpus().iter().map(|v| v.kvm_run_base()).collect();
    // The child's copies of the disk overlays: the disks' workers are parked, so each
    // overlay holds exactly what the guest wrote up to the clone point. The parent
    // closes its descriptors of the copies when this returns.
    let t0 = Instant::now();
    let overlays = vm.devices().snapshot_overlays()?;
    let t_overlays = t0.elapsed();
    let plan = ChildPlan {
        parent_pid: nix::unistd::getpid().as_raw(),
        ready: ready.as_raw_fd(),
        start,
        state,
        template: vm,
        hooks: lineage.hooks,
        working: lineage.working.clone(),
        run_bases: &run_bases,
        overlays: &overlays,
    };
    let into = taken.and_then(|t| t.dir.as_ref());
    let fork = |mut plan: ChildPlan<'_>, born_inside: bool| {
        if let (true, Start::Now(id)) = (born_inside, &mut plan.start) {
            id.cgroup = None;
        }
        // SAFETY: every vCPU and virtio worker is parked holding no lock, the API
        // thread holds none while the gate is closed (see `gate`), and on the forker
        // the main thread waits for this without holding one: so neither fork() nor
        // clone3 (which skips glibc's fork handling, see `fork_into`) leaves the child a
        // lock or a malloc arena that nobody will release.
        match crate::gate::closed(|| unsafe { cgroups::fork_into(into) }) {
            // Read on the thread that forked.
            -1 => Err(CloneError::Os(std::io::Error::last_os_error())),
            0 => child_main(plan),
            pid => Ok(pid),
        }
    };
    let forker = pools
        .zip(taken)
        .and_then(|(p, t)| Some((p.forker_for(t)?, t.name())));
    let mut plan = Some(plan);
    let on_forker = forker.and_then(|(f, name)| {
        f.run(|seated| {
            let born = seated == Some(name);
            plan.take().map(|p| (fork(p, born), born))
        })
        .flatten()
    });
    let (forked, born_inside) = match (on_forker, plan) {
        (Some(done), _) => done,
        // No forker, or it is gone: from this thread (the clone moves itself in).
        (None, Some(plan)) => (fork(plan, false), false),
        (None, None) => unreachable!("the plan is taken only by a fork"),
    };
    let pid = forked?;
    tracing::debug!(
        "clone {pid}: overlay copies {} us, fork {} us{}",
        t_overlays.as_micros(),
        (t0.elapsed() - t_overlays).as_micros(),
        if born_inside { " (forker)" } else { "" }
    );
    Ok((pid, born_inside))
}

/// Forks a child for each of `clones` (identity and cgroup), launching each at once.
/// Returns each clone's record and the read end of its ready pipe. On failure the
/// cgroups of the clones not started go back to their pools, and the clones started
/// come back with the error ([`Partial`]).
pub(super) fn fork_all(
    vm: &Microvm,
    mut pools: Option<&mut ClonePools>,
    lineage: &Lineage,
    state: &MicrovmState,
    clones: Vec<NewClone>,
) -> Result<Vec<Made>, Partial> {
    let mut made = Vec::with_capacity(clones.len());
    let mut clones = clones.into_iter();
    while let Some((mut identity, taken)) = clones.next() {
        let (placement, mut cgroup) = cgroups::placement_of(pools.as_deref(), taken.as_ref());
        identity.cgroup = placement;
        // An invocation's clone writes the working set ahead (`child::prepare_now`).
        if let (Some(p), Some(t), true) =
            (pools.as_deref(), taken.as_ref(), identity.carried.is_some())
        {
            p.allow_ahead(
                t,
                lineage.working.as_ref().map_or(0, |w| w.set.pages() * PAGE),
            );
        }
        let forked = pipe()
            .map_err(CloneError::Os)
            .and_then(|(read_end, write_end)| {
                let start = Start::Now(Box::new(identity.clone()));
                let forked = fork_child(
                    vm,
                    pools.as_deref(),
                    lineage,
                    state,
                    &write_end,
                    start,
                    taken.as_ref(),
                )?;
                Ok((forked, read_end))
            });
        match forked {
            Ok(((pid, born_inside), read_end)) => {
                if born_inside {
                    identity.cgroup = None;
                    if let Some(c) = cgroup.as_mut() {
                        c.placed_by = PlacedBy::Forker;
                    }
                }
                cgroups::started_in(pools.as_deref_mut(), pid, taken);
                made.push((
                    starting_info(identity, pid, cgroup, vm.config()),
                    File::from(read_end),
                ));
            }
            Err(error) => {
                give_back(
                    pools.as_deref(),
                    std::iter::once(taken).chain(clones.map(|(_, t)| t)),
                );
                let made = made.into_iter().map(|(info, _)| info).collect();
                return Err(Partial { made, error });
            }
        }
    }
    Ok(made)
}

/// A clone started, with the read end of its ready pipe.
pub(super) type Made = (CloneInfo, File);

/// A request that failed after it had started some clones: those (to be ended: the
/// caller learns of none) and the error.
pub(super) struct Partial {
    /// The clones started before the failure.
    pub made: Vec<CloneInfo>,
    /// The failure.
    pub error: CloneError,
}

/// A new pipe, both ends close-on-exec: (read end, write end).
pub(super) fn pipe() -> std::io::Result<(OwnedFd, OwnedFd)> {
    Ok(nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?)
}
