//! Flash cloning, one stage per file, in the order a clone goes through them:
//!
//! 1. `request.rs`: the request (`POST /clones`, or a guest's read of the clone port)
//!    is checked; each clone gets its identity and, with pools, a cgroup.
//! 2. `quiesce.rs`: every vCPU of a running VM parks outside KVM_RUN.
//! 3. `capture.rs`: the device workers park; the vCPUs', the VM's and the devices'
//!    state is read.
//! 4. `fork.rs`: one child per clone, through the fork gate, into its cgroup
//!    (`cgroups.rs`, and on cgroup v1 `forker.rs`); the parent resumes and waits on each
//!    child's ready pipe.
//! 5. `child.rs`: in the child, a new VM on the inherited memory, rebuilt by
//!    `builder::rebuild`, and handed to the controller's event loop.
//! 6. `warm.rs`: for a paused template, stages 4 and 5 done ahead of requests (and,
//!    when the template's runtime takes them, a prime run by each warm clone).
//!
//! An invocation's clone answers its caller itself: its template does not wait for it
//! to start but watches its ready pipe from the event loop (`starting.rs`).
//!
//! `wire.rs` holds both ends of the two channels between a template and its clones
//! (the ready pipe, a warm clone's go channel). `working.rs` learns the guest pages a
//! template's invocation clones write, from the clones, and its warm clones write them
//! ahead.
//!
//! `table.rs` keeps every clone's record until it is reaped or stopped; `tree.rs` bounds
//! the live clones of the whole tree (`--max-tree-clones`) in slots all its VMs share.
//! [`Cloner::make_clones`] below reads the whole path top to bottom. A paused VM's state
//! cannot change, so it is captured once per pause and reused by every request.
//!
//! This module works on a [`Microvm`] (below it) and knows nothing of HTTP or of
//! invocations: the controller (above it) calls it with typed requests, and what the
//! layers above do in a clone comes as [`CloneHooks`] (plain functions: the event
//! loop, taking up a [`Handover`], a warm clone's prime), what they hand a clone as an
//! opaque [`Handover`].

mod capture;
pub mod cgroups;
mod child;
mod fork;
mod forker;
mod hooks;
mod quiesce;
mod request;
mod rewind;
mod sources;
mod starting;
mod table;
mod tree;
mod warm;
mod wire;
pub mod working;

use std::fs::File;
use std::sync::Arc;
use std::time::{Duration, Instant};

use api_types::cgroup::CgroupsReport;
use api_types::clones::CreateClonesError;
use api_types::vm::{VmState, WarmReport};
use api_types::{CloneInfo, CloneStatus, CreateClones};
use clone::MicrovmState;

use crate::config::VmConfig;
use crate::microvm::Microvm;
use cgroups::{CgroupSetupError, ClonePools};
pub use child::ChildError;
pub use hooks::{
    CloneHooks, HandedOver, KeptLife, PrimeClone, PrimeFailure, RebuiltClone, ServeClone,
    ServeError, TakeHandover,
};
pub use request::{CloneError, Handover, CLONE_FAILED};
pub use sources::{Forwarded, InboxError};
pub use table::{CloneTable, Orphan, OrphanEnd, StartFailure};
pub use tree::{init as init_tree, report as tree_report, TreeFull};
pub use warm::{WarmPool, REFILL_DELAY};
pub use wire::{LaunchError, ReadyMark};

/// The clone side of one VM: the clones it made, its warm clones, its cgroup pools.
pub struct Cloner {
    table: CloneTable,
    /// Invocation clones not reported ready yet.
    starting: starting::Starting,
    warm: WarmPool,
    spares: warm::Spares,
    /// Pooled cgroups for clones (`--cgroup-class`); None in clones.
    cgroups: Option<ClonePools>,
    /// This VM's clone id: "" for an original, "2", "2.1", ... for clones.
    clone_id: String,
    /// What the layers above do in its clones (the controller's event loop, the
    /// invocation layer's handover and prime).
    hooks: CloneHooks,
    /// The guest's refused clone requests (a guest may send them in a loop).
    guest_refusals: devices::util::LogThrottle,
    /// A template's working set (`working.rs`); off in a clone until it is derived.
    working: working::WorkingSet,
    /// A clone's duty to report its working set once it answered its invocation.
    duty: Option<working::Duty>,
    /// A template's fork sources, or a source's channel to its template.
    sources: sources::Sources,
}

impl Cloner {
    /// The clone side of an original VM with `config` (its cgroup pools are made
    /// here). `hooks` run in each clone.
    pub fn new(config: &VmConfig, hooks: CloneHooks) -> Result<Self, CgroupSetupError> {
        Ok(Self {
            table: CloneTable::default(),
            starting: Default::default(),
            warm: WarmPool::new(config.clones.warm_clones),
            spares: Default::default(),
            cgroups: config
                .host
                .cgroups
                .as_ref()
                .map(ClonePools::new)
                .transpose()?,
            clone_id: String::new(),
            hooks,
            guest_refusals: Default::default(),
            // Only a template's clones serve invocations, the working set's source.
            working: working::WorkingSet::new(match config.invoke.template {
                true => config.clones.working_set_mib,
                false => 0,
            }),
            duty: None,
            sources: {
                let mut s = sources::Sources::new(config.clones.fork_sources);
                if config.invoke.template {
                    s.become_template();
                }
                s
            },
        })
    }

    /// The clone side of clone `id` with `config`: no pools (its clones stay in its
    /// cgroup), no warm clones, no fork sources, no working set of its own; `duty`, its
    /// working set to report.
    fn for_clone(
        id: String,
        config: &VmConfig,
        hooks: CloneHooks,
        duty: Option<working::Duty>,
    ) -> Self {
        Self {
            table: CloneTable::default(),
            starting: Default::default(),
            warm: WarmPool::default(),
            spares: Default::default(),
            cgroups: None,
            clone_id: id,
            hooks,
            guest_refusals: Default::default(),
            working: working::WorkingSet::off(),
            duty,
            sources: sources::Sources::new(config.clones.fork_sources),
        }
    }

    /// What a child forked now takes from this VM.
    fn lineage(&self) -> child::Lineage {
        child::Lineage {
            hooks: self.hooks,
            working: self.working.for_child(),
        }
    }

    /// This VM (a clone) is a template from now on (`derive`): it keeps as many warm
    /// clones and fork sources as `config` says while paused, and pools of cgroups of
    /// its own for its clones when `config` has classes (without, or when they cannot
    /// be made, its clones stay in its own cgroup, as a clone's do).
    pub fn become_template(&mut self, config: &VmConfig) {
        self.warm.renew(config.clones.warm_clones);
        self.sources.become_template();
        self.working = working::WorkingSet::new(config.clones.working_set_mib);
        if self.cgroups.is_none() {
            match config
                .host
                .cgroups
                .as_ref()
                .map(ClonePools::new)
                .transpose()
            {
                Ok(pools) => self.cgroups = pools,
                Err(e) => tracing::warn!(
                    "the derived template's clones stay in its cgroup: cannot make pools: {e}"
                ),
            }
        }
    }

    /// This VM's clone id ("" for an original VM).
    pub fn clone_id(&self) -> &str {
        &self.clone_id
    }

    /// The paused `vm`'s state, captured once per pause (what its clones and a
    /// snapshot are made from).
    pub fn paused_state(&mut self, vm: &mut Microvm) -> Result<Arc<MicrovmState>, CloneError> {
        self.warm.epoch_state(vm)
    }

    /// The warm-clone figures for `GET /vm`.
    pub fn warm_report(&self) -> WarmReport {
        self.warm.report()
    }

    /// The cgroup pools for `GET /vm` (None without pools).
    pub fn cgroups_report(&self) -> Option<CgroupsReport> {
        self.cgroups.as_ref().map(ClonePools::report)
    }

    /// Makes `req.count` clones of `vm`. `received_ns` is when the request reached the
    /// VMM (CLOCK_MONOTONIC), for the latency figures. `requester` is the parked vCPU of
    /// a guest request: each clone's copy of it reads the clone's sequence number, the
    /// parent's reads 0, or [`CLONE_FAILED`].
    pub fn make_clones(
        &mut self,
        vm: &mut Microvm,
        req: &CreateClones,
        received_ns: u64,
        requester: Option<u8>,
    ) -> Result<Vec<CloneInfo>, CloneError> {
        self.make_clones_with(vm, req, received_ns, requester, true, |_| {})
    }

    /// [`Cloner::make_clones`], with `prepare` adding to each clone's identity; with
    /// `wait` false, the clones' starts are watched ([`Cloner::check_starts`]) instead
    /// of waited for, and they are returned [`CloneStatus::Starting`].
    fn make_clones_with(
        &mut self,
        vm: &mut Microvm,
        req: &CreateClones,
        received_ns: u64,
        requester: Option<u8>,
        wait: bool,
        prepare: impl FnMut(&mut request::Identity),
    ) -> Result<Vec<CloneInfo>, CloneError> {
        // 1. The request.
        self.reap();
        let checked = request::check(vm, &self.table, req).and_then(|()| {
            let mut identities = request::identities(
                vm.config(),
                &self.clone_id,
                self.table.made(),
                req,
                requester,
            )?;
            identities.iter_mut().for_each(prepare);
            // Their slots in the tree, freed again if the request fails.
            let slots = tree::reserve(identities.len())?;
            Ok((identities, slots))
        });
        let (identities, slots) = match checked {
            Ok(i) => i,
            Err(e) => {
                quiesce::release_requester(vm, requester, CLONE_FAILED);
                return Err(e);
            }
        };
        let class = req.resource_class.as_deref();
        let was_running = vm.state() == VmState::Running;
        let t0 = Instant::now();
        let made = if vm.state() == VmState::Paused
            && requester.is_none()
            && vm.pending_events().is_empty()
        {
            // 6. Nothing can change a paused VM: its state and warm clones are reused.
            let result = self
                .warm
                .epoch_state(vm)
                .and_then(|state| self.launch_or_fork(vm, &state, identities, class));
            tracing::debug!("clone (paused VM): {} us", t0.elapsed().as_micros());
            result?
        } else {
            // 2-4. Quiesce, capture, fork, resume.
            self.clone_now(vm, identities, requester, class, t0)?
        };
        if let Some(slots) = slots {
            slots.assign(made.iter().map(|(info, _)| info.pid as u32));
        }
        // The parent waits for each clone's vCPU 0 to enter the guest. A running VM's
        // device workers were left parked until its first clone is up: woken at once,
        // they took the CPUs the clone starts on (0.5-0.9 ms more here with five of
        // them). Meanwhile the guest's requests wait in their queues; not for all of a
        // large batch, though.
        let mut devices_parked = was_running;
        let mut failed = None;
        let mut infos = Vec::with_capacity(made.len());
        for (mut info, mut ready) in made {
            if !wait {
                match self.starting.watch(info.pid, ready, received_ns) {
                    Ok(()) => {
                        info.status = CloneStatus::Starting;
                        infos.push(info);
                        continue;
                    }
                    Err(r) => ready = r,
                }
            }
            match wire::wait_ready(&mut ready, fork::READY_TIMEOUT) {
                Ok(t) => {
                    info.latency_us = Some(t.saturating_sub(received_ns) / 1000);
                    info.status = CloneStatus::Running;
                }
                Err(why) => {
                    tracing::warn!("clone {} failed: {why}", info.id);
                    info.status = CloneStatus::Failed;
                    info.error = Some(why.to_string());
                    failed.get_or_insert(why);
                }
            }
            if std::mem::take(&mut devices_parked) {
                vm.devices().resume_virtio();
            }
            infos.push(info);
        }
        if devices_parked {
            vm.devices().resume_virtio();
        }
        // The clones are up: the forker may move on to the next one's cgroup.
        if let Some(p) = &self.cgroups {
            p.reseat();
        }
        self.warm.note_request();
        self.table.record(req.count as u32, &infos);
        // None started: the request failed, with the first clone's reason (the table
        // reaps them).
        if infos.iter().all(|i| i.status == CloneStatus::Failed) {
            if let Some(why) = failed {
                return Err(CloneError::NoneStarted {
                    reason: why.to_string(),
                    errno: why.errno,
                });
            }
        }
        Ok(infos)
    }

    /// Makes one clone of this paused template per `req` (its count is 1) and hands it
    /// `handover` (a warm clone when one is ready, else one forked now). The clone
    /// takes the handover up itself; this returns once it is launched or forked, and
    /// the event loop learns of its start ([`Cloner::check_starts`]): a clone that
    /// fails to start is killed. The template keeps the handover's stream until the
    /// clone is reaped ([`Cloner::take_orphans`]), to answer it if the clone did not.
    pub fn clone_handing_over(
        &mut self,
        vm: &mut Microvm,
        req: &CreateClones,
        received_ns: u64,
        handover: Handover,
    ) -> Result<CloneInfo, CloneError> {
        let carried = Arc::new(request::Carried {
            payload: handover.payload,
            stream: handover.stream,
        });
        let record = self.working.record_next();
        let prepare = |identity: &mut request::Identity| {
            identity.record_working_set = record;
            identity.guest_result = Some(handover.guest_result);
            identity.note = Some(handover.note.clone());
            identity.defer_timer_ns = handover.defer_timer_ns;
            identity.carried = Some(carried.clone());
        };
        let stream = carried.stream.clone();
        let made = self.make_clones_with(vm, req, received_ns, None, false, prepare)?;
        let info = made
            .into_iter()
            .next()
            .ok_or(CloneError::Request(CreateClonesError::Count(0)))?;
        self.table.forget_when_reaped(info.pid, stream);
        Ok(info)
    }

    /// The descriptor the event loop watches for clones' starts
    /// ([`Cloner::check_starts`]); until it is asked for, starts are waited for.
    pub fn starts_fd(&mut self) -> std::io::Result<std::os::fd::RawFd> {
        self.starting.fd()
    }

    /// Records the starts of invocation clones that ended (their vCPU 0 entered the
    /// guest, or they failed or ran out of time to: those are killed, and their
    /// callers answered once they are reaped).
    pub fn check_starts(&mut self) {
        for s in self.starting.take_ended() {
            let entered = s.entered.map_err(|why| table::StartFailure {
                reason: why.to_string(),
                errno: why.errno,
            });
            let failed = entered.as_ref().err().map(|why| why.reason.clone());
            if self.table.started(s.pid, entered, s.since_ns) {
                if let Some(why) = failed {
                    tracing::warn!("invocation clone (pid {}) failed: {why}", s.pid);
                    // Not reaped yet (the table still had it starting): its pid is its own.
                    let _ = nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(s.pid),
                        nix::sys::signal::Signal::SIGKILL,
                    );
                }
            }
        }
    }

    /// In an invocation clone told to: reports the guest pages it wrote to its template
    /// (once; call after it answered).
    pub fn report_working_set(&mut self, vm: &Microvm) {
        if let Some(d) = self.duty.take() {
            d.report(vm.memory());
        }
    }

    /// A guest read the clone port on vCPU `vcpu` (which parked itself) asking for
    /// `count` clones. Failures are logged and reported to the guest.
    pub fn guest_request(&mut self, vm: &mut Microvm, vcpu: u8, count: u32) {
        let requested = crate::vstate::vcpu::monotonic_ns();
        let req = CreateClones {
            count: u64::from(count),
            ..CreateClones::default()
        };
        match self.make_clones(vm, &req, requested, Some(vcpu)) {
            Ok(made) => tracing::info!(
                "guest on vCPU {vcpu} made {} clone(s): {}",
                made.len(),
                made.iter()
                    .map(|c| c.id.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Err(e) => {
                if let Some(n) = self.guest_refusals.hit() {
                    tracing::warn!("guest clone request on vCPU {vcpu} failed: {e} ({n} so far)");
                }
            }
        }
    }

    /// Stages 2 to 4 for `identities`: pauses a running VM, captures, forks one child
    /// per identity, and resumes (the device workers once the first clone is up).
    fn clone_now(
        &mut self,
        vm: &mut Microvm,
        identities: Vec<request::Identity>,
        requester: Option<u8>,
        class: Option<&str>,
        t0: Instant,
    ) -> Result<Vec<(CloneInfo, File)>, CloneError> {
        let clones = match request::take_cgroups(self.cgroups.as_ref(), identities, class) {
            Ok(c) => c,
            Err(e) => {
                quiesce::release_requester(vm, requester, CLONE_FAILED);
                return Err(e);
            }
        };
        // 2. Quiesce.
        let was_running = vm.state() == VmState::Running;
        if was_running {
            if let Err(e) = quiesce::pause_all(vm) {
                request::give_back(self.cgroups.as_ref(), clones.into_iter().map(|(_, t)| t));
                quiesce::release_requester(vm, requester, CLONE_FAILED);
                return Err(e.into());
            }
        }
        let t_pause = t0.elapsed();
        // Every vCPU is parked now, so any other vCPU that read the clone port has
        // queued its request: it stays parked here (served next, in turn).
        let waiting = quiesce::waiting_requesters(vm, requester);
        // 3. Capture.
        let captured = capture::capture(vm).map(|mut state| {
            for v in state.vcpus.iter_mut().filter(|v| waiting.contains(&v.id)) {
                v.regs.rax = CLONE_FAILED;
            }
            state
        });
        let t_capture = t0.elapsed();
        // 4. Fork.
        let lineage = self.lineage();
        let result = match captured {
            Ok(state) => fork::fork_all(vm, self.cgroups.as_mut(), &lineage, &state, clones)
                .map_err(|p| self.abandon(p.made, p.error)),
            Err(e) => {
                request::give_back(self.cgroups.as_ref(), clones.into_iter().map(|(_, t)| t));
                Err(e)
            }
        };
        let t_fork = t0.elapsed();
        let value = if result.is_ok() { 0 } else { CLONE_FAILED };
        quiesce::answer_requester(vm, requester, value);
        // The device workers of a running VM resume once its first clone is up
        // (make_clones), unless cloning failed.
        if was_running {
            let resumed = match result {
                Ok(_) => quiesce::resume_vcpus(vm, &waiting),
                Err(_) => quiesce::resume_all(vm, &waiting),
            };
            if let Err(e) = resumed {
                tracing::error!("resuming after cloning failed: {e}");
            }
        }
        if let Some(pools) = self.cgroups.as_mut() {
            pools.close_spent();
        }
        tracing::debug!(
            "clone: paused {} us, captured {} us, forked {} us, resumed {} us (cumulative)",
            t_pause.as_micros(),
            t_capture.as_micros(),
            t_fork.as_micros(),
            t0.elapsed().as_micros()
        );
        result
    }

    /// For a paused VM: launches warm clones while there are any, forks the rest.
    /// Warm clones sit in a cgroup of the first class already: they serve requests
    /// for that class (or any request without pools); others are forked.
    fn launch_or_fork(
        &mut self,
        vm: &Microvm,
        state: &Arc<MicrovmState>,
        identities: Vec<request::Identity>,
        class: Option<&str>,
    ) -> Result<Vec<(CloneInfo, File)>, CloneError> {
        let warm_fits = (self.cgroups.as_ref()).map_or(class.is_none(), |p| p.is_default(class))
            && identities.iter().all(|i| i.source.is_none());
        let mut made = Vec::with_capacity(identities.len());
        let mut rest = Vec::new();
        for identity in identities {
            let launched = match warm_fits {
                true => self.warm.launch(&identity, self.cgroups.as_mut()),
                false => None,
            };
            match launched {
                Some((pid, ready, cgroup)) => made.push((
                    request::starting_info(identity, pid, cgroup, vm.config()),
                    ready,
                )),
                None => rest.push(identity),
            }
        }
        if !rest.is_empty() {
            let launched = |made: Vec<fork::Made>| made.into_iter().map(|(i, _)| i);
            let clones = match request::take_cgroups(self.cgroups.as_ref(), rest, class) {
                Ok(c) => c,
                Err(error) => return Err(self.abandon(launched(made), error)),
            };
            let lineage = self.lineage();
            match fork::fork_all(vm, self.cgroups.as_mut(), &lineage, state, clones) {
                Ok(more) => made.extend(more),
                Err(p) => return Err(self.abandon(launched(made).chain(p.made), p.error)),
            }
        }
        Ok(made)
    }

    /// A request failed with `error` after it had started the clones `made` (warm ones
    /// launched, forked ones): they are ended, so that its caller, told it failed, has
    /// no clone it does not know of. Returns the error.
    fn abandon(
        &mut self,
        made: impl IntoIterator<Item = CloneInfo>,
        error: CloneError,
    ) -> CloneError {
        self.table.abandon(made);
        error
    }

    /// The VM changed while paused (it resumed, or its serial port got input): the
    /// warm clones hold what it was, so they are discarded.
    pub fn discard_warm_clones(&mut self) {
        self.warm.discard();
        // Fork sources too: they are templates of the state it had.
        self.sources.let_go();
    }

    /// The template runs to be refreshed and pauses again as it was, its clock caught
    /// up: its warm clones are clones of it still (only older), so they serve on until
    /// new ones replace them, one at a time (a request never finds the pool empty for
    /// a refresh).
    pub fn age_warm_clones(&mut self) {
        self.warm.forget_epoch();
        self.warm.mark_stale();
    }

    /// Time until the event loop has work here (zero: now): a warm clone to fork,
    /// spare overlay files to make, cgroup pools to refill. None: nothing due.
    pub fn due_in(&self, vm: &Microvm) -> Option<Duration> {
        let spares =
            (self.spares).due_in(vm, self.table.made(), !self.clone_id.is_empty(), &self.warm);
        [
            self.starting.due_in(),
            self.warm.due_in(vm).filter(|_| !self.sources.retiring()),
            self.cgroups.as_ref().and_then(ClonePools::upkeep_due_in),
            spares,
            self.table.kill_due_in(),
            match self.sources_wanted(vm) {
                true => Some(Duration::ZERO),
                false => self.sources.due_in(),
            },
        ]
        .into_iter()
        .flatten()
        .min()
    }

    /// Does the work [`Cloner::due_in`] says is due. A warm clone made now is primed
    /// on the vCPU `prime` gives, if any (the hooks' `prime`); asked only when one is made.
    pub fn do_due_work(&mut self, vm: &mut Microvm, prime: impl FnOnce(&Microvm) -> Option<u8>) {
        self.table.kill_overdue();
        self.check_starts();
        self.warm.retire_stale();
        self.warm.trim_surplus();
        if self.sources_wanted(vm) {
            self.make_sources(vm);
        }
        if self.warm.refill_due_in(vm) == Some(Duration::ZERO) && !self.sources.retiring() {
            let prime = prime(vm);
            if vm.config().invoke.rewind && vm.config().invoke.template {
                let why_not = rewind::unsupported(vm);
                self.warm.rewind_clones(why_not);
            }
            let lineage = self.lineage();
            self.warm.add(vm, self.cgroups.as_mut(), &lineage, prime);
        }
        let made = self.table.made();
        if self
            .spares
            .due_in(vm, made, !self.clone_id.is_empty(), &self.warm)
            == Some(Duration::ZERO)
        {
            self.spares.make(vm, made);
        }
        if let Some(c) = self.cgroups.as_mut() {
            c.upkeep();
        }
    }

    /// The descriptor the event loop watches for rewound clones coming back
    /// ([`Cloner::take_back`]).
    pub fn back_fd(&mut self) -> std::io::Result<std::os::fd::RawFd> {
        self.warm.back_fd()
    }

    /// Takes back the invocation clones that came back rewound: their requests'
    /// records end (as at an exit with status 0) and they join the warm pool.
    pub fn take_back(&mut self, vm: &Microvm) {
        // Their starts first: a record ends only once started.
        self.check_starts();
        for pid in self.warm.take_back(vm, self.cgroups.as_ref()) {
            let usage = self.cgroups.as_mut().and_then(|p| p.life_ended(pid));
            self.table.rewound(pid, usage);
        }
    }

    /// Reaps every exited child (clone or warm clone) without blocking.
    pub fn reap(&mut self) {
        // A clone that failed to start said why on its ready pipe: read before its
        // record ends, so that its caller is told.
        self.check_starts();
        let warm = &mut self.warm;
        self.table.reap(self.cgroups.as_mut(), |pid, status| {
            warm.reaped(pid, status)
        });
        // A clone reports its working set before it exits. The warm clones there were
        // when the first report came copied nothing ahead: they are replaced.
        if self.working.take_reports() {
            self.warm.mark_stale();
        }
    }

    /// The streams of clones made with a handover that ended since last asked, each
    /// with the clone's id and how it ended: the controller answers those the clone did not
    /// (a clone shuts its connection down once it answered).
    pub fn take_orphans(&mut self) -> Vec<Orphan> {
        self.table.take_orphans()
    }

    /// Every clone, with live clones' cgroup usage read now.
    pub fn list_clones(&mut self) -> Vec<CloneInfo> {
        self.reap();
        self.table.with_usage(self.cgroups.as_ref())
    }

    /// Tells clone `id` to stop (SIGTERM, SIGKILL a while later) without waiting for
    /// it; its final record comes from [`Cloner::take_stopped`] once it is reaped.
    /// Returns its pid; None if no live clone has that id.
    pub fn begin_stop_clone(&mut self, id: &str) -> Option<i32> {
        self.table.begin_stop(id)
    }

    /// The final records of clones told to stop that were reaped since last asked,
    /// with their pids.
    pub fn take_stopped(&mut self) -> Vec<(i32, CloneInfo)> {
        self.table.take_stopped()
    }

    /// The VM stopped: discards the warm clones, stops every clone (each removes its
    /// socket; they would die with this process anyway, `PR_SET_PDEATHSIG`) and
    /// removes this VMM's cgroups.
    pub fn shut_down(&mut self) {
        self.discard_warm_clones();
        let killed: Vec<i32> = self.warm.dying().collect();
        self.table.stop_all(self.cgroups.as_mut(), &killed);
        drop(self.cgroups.take());
    }
}
