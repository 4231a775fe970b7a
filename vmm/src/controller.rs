//! The VMM core: one VM and its clone side, driven from one event loop by typed actions
//! ([`crate::rpc`]) and host events (guest power-off, vCPU exits, signals, host input,
//! timers for work done ahead of clone requests).
//!
//! Each action is answered with typed data or a typed error (a clone's deletion once
//! the clone is gone); the control socket and invocations' answers are the edge's
//! ([`Edge`], a type parameter: nothing here knows HTTP). [`serve_clone`] is what a clone
//! runs once its VM is rebuilt: the same loop, on its own control socket.

use std::io::Read;
use std::marker::PhantomData;
use std::os::fd::{AsRawFd, RawFd};
use std::path::Path;
use std::time::{Duration, Instant};

use nix::sys::signalfd::SignalFd;

use api_types::invoke::Outcome;
use api_types::vm::{TargetState, VmInfo, VmState};
use api_types::{CloneList, CloneStatus};
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::cloning::{Cloner, InboxError, KeptLife, OrphanEnd, RebuiltClone, ServeError};
use crate::config::ConsoleSink;
use crate::config::VmConfig;
use crate::edge::{Edge, EdgeError};
use crate::invoke::{Connection, Finished, Invocation, InvokeError, Invoker, Route};
use crate::kept::KeptThread;
use crate::microvm::{Input, Microvm, RunOutcome};
use crate::rpc::{
    ActionReceiver, ActionSender, Replier, VmmAction, VmmActionError, VmmData, VmmResponse,
};
use crate::signals::read_signal;
use crate::snapshot::SnapshotError;
use crate::vstate::vcpu::VcpuEvent;

/// Errors in the event loop itself.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// epoll or signalfd failed.
    #[error("event loop failure: {0}")]
    EventLoop(std::io::Error),
}

/// How much of the console an invocation's error answer quotes.
const CONSOLE_TAIL_BYTES: u64 = 2048;

/// Serves the control socket of a VM with `config` at `path` through edge `E`, queueing
/// actions on `actions`: invocations up to what its mailbox holds.
pub fn serve_socket<E: Edge>(
    path: &Path,
    actions: ActionSender,
    config: &VmConfig,
    thread: Option<KeptThread>,
) -> Result<E::Server, EdgeError> {
    let mailbox = crate::builder::mailbox(&config.machine);
    E::serve(
        path,
        actions,
        mailbox.exists().then(|| mailbox.capacity()),
        thread,
    )
}

/// A VM, its clone side and its invocation side, answering through edge `E`.
pub struct Vmm<E: Edge> {
    vm: Microvm,
    clones: Cloner,
    invoker: Invoker,
    /// Deletions waiting for their clone to be gone: its pid, and where the answer goes.
    stops: Vec<(i32, Replier)>,
    /// Snapshots and pauses asked for while the template runs on its way back to its
    /// runtime's wait (a refresh), each with where the answer goes and how long it may
    /// wait.
    held_until_paused: Vec<(VmmAction, Replier, Instant)>,
    edge: PhantomData<fn() -> E>,
}

/// How long a snapshot or a pause asked for while its template is refreshed waits for the
/// template to pause again at its runtime's wait: a runtime comes back in milliseconds
/// (microseconds on hardware KVM); after that, it is taken as asked (a snapshot is
/// refused as of a VM not paused, a pause pauses the template where it is).
const PAUSE_HOLD: Duration = Duration::from_secs(5);

const TOKEN_RESET: u64 = 1;
const TOKEN_VCPU_EXIT: u64 = 2;
const TOKEN_API: u64 = 3;
const TOKEN_SIGNAL: u64 = 4;
const TOKEN_STDIN: u64 = 5;
const TOKEN_STARTS: u64 = 6;
const TOKEN_BACK: u64 = 7;
const TOKEN_SOURCES: u64 = 8;

/// What a template tells the fork source it forwards an invocation to
/// (`cloning::sources`), beside its payload and connection.
#[derive(serde::Serialize, serde::Deserialize)]
struct ForwardNote {
    options: api_types::invoke::InvokeOptions,
    received_ns: u64,
}

/// An epoll timeout for `d`, rounded up: rounded down, the loop would wake before the
/// time and spin with timeout 0 until it.
fn wait_ms(d: std::time::Duration) -> i32 {
    i32::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
}

impl<E: Edge> Vmm<E> {
    /// The VMM of `vm`, whose clones `clones` makes.
    pub fn new(vm: Microvm, clones: Cloner) -> Self {
        let invoker = Invoker::new(vm.config(), vm.mailbox());
        Self {
            vm,
            clones,
            invoker,
            stops: Vec::new(),
            held_until_paused: Vec::new(),
            edge: PhantomData,
        }
    }

    /// Takes one action from the API: answered at once, but for a clone's deletion,
    /// answered with the clone's final record once it is gone (the event loop does not
    /// wait for a clone's exit, which can take seconds on a busy host).
    fn take_action(&mut self, action: VmmAction, replier: Replier) {
        match action {
            VmmAction::DeleteClone(id) => match self.clones.begin_stop_clone(&id) {
                Some(pid) => self.stops.push((pid, replier)),
                None => replier.send(Err(VmmActionError::NoSuchClone(id))),
            },
            // A template runs only to come back to its runtime's wait and pause again:
            // the snapshot is of that pause, and a pause is that one.
            VmmAction::Snapshot(_) | VmmAction::SetState(TargetState::Paused)
                if self.template_returning() =>
            {
                let until = Instant::now() + PAUSE_HOLD;
                self.held_until_paused.push((action, replier, until));
            }
            action => replier.send(self.handle(action)),
        }
    }

    /// Whether this is a template that runs on its way back to its runtime's wait (a
    /// refresh, or a resume), to pause again there.
    fn template_returning(&self) -> bool {
        self.invoker.is_template()
            && self.invoker.is_returning()
            && self.vm.state() == VmState::Running
    }

    /// Takes the actions held until the template pauses: all of them once it paused
    /// again (or is no longer on its way back), else those whose time is up.
    fn take_held_until_paused(&mut self) {
        if self.held_until_paused.is_empty() {
            return;
        }
        let now = Instant::now();
        let returning = self.template_returning();
        let (due, held) = std::mem::take(&mut self.held_until_paused)
            .into_iter()
            .partition(|h| !returning || h.2 <= now);
        self.held_until_paused = held;
        for (action, replier, _) in due {
            let answer = match action {
                // Paused, as asked.
                VmmAction::SetState(TargetState::Paused) if self.vm.state() == VmState::Paused => {
                    Ok(VmmData::Empty)
                }
                action => self.handle(action),
            };
            replier.send(answer);
        }
    }

    /// Answers the deletions whose clones were reaped.
    fn answer_stopped(&mut self) {
        for (pid, info) in self.clones.take_stopped() {
            let (done, waiting) = std::mem::take(&mut self.stops)
                .into_iter()
                .partition(|(p, _)| *p == pid);
            self.stops = waiting;
            for (_, replier) in done {
                replier.send(Ok(VmmData::Clone(Box::new(info.clone()))));
            }
        }
    }

    /// What `GET /vm` shows.
    pub fn describe(&self) -> VmInfo {
        let mut info = self.vm.describe(
            self.clones.clone_id(),
            self.clones.warm_report(),
            self.clones.cgroups_report(),
            self.invoker.report(),
        );
        info.clone_tree = crate::cloning::tree_report();
        info
    }

    /// Runs invocation `inv`: in a clone of a template (which answers the caller), or
    /// in place.
    fn invoke(&mut self, inv: Invocation) -> VmmResponse {
        match (self.invoker).route(&self.vm, &inv)? {
            Route::Clone(_) if self.forwarded(&inv) => {}
            Route::Clone(vcpu) => {
                let received_ns = inv.received_ns;
                let (req, handover) = self.invoker.hand_to_clone(inv, vcpu);
                let info =
                    (self.clones).clone_handing_over(&mut self.vm, &req, received_ns, handover)?;
                self.invoker.handed_to_clone();
                if info.status == CloneStatus::Failed {
                    return Err(InvokeError::CloneFailed(info.id).into());
                }
            }
            Route::InPlace(vcpu) => self.invoker.deliver(&self.vm, inv, vcpu)?,
            Route::Queue => self.invoker.queue(inv),
        }
        Ok(VmmData::Invoked)
    }

    /// Whether invocation `inv` went to a fork source, whose clone answers it. A derive
    /// request is served here: the template it makes is this one's clone.
    fn forwarded(&mut self, inv: &Invocation) -> bool {
        if inv.options.derive {
            return false;
        }
        // Made only for a source that takes it (a template without one pays nothing).
        let note = || {
            let note = ForwardNote {
                options: inv.options.clone(),
                received_ns: inv.received_ns,
            };
            // Options and a number: they always serialize.
            serde_json::to_vec(&note).unwrap_or_default()
        };
        self.clones.forward(note, &inv.payload, inv.conn.stream())
    }

    /// Takes what the fork sources' channels have: in a fork source, an invocation its
    /// template forwarded, served as one that came on its own socket.
    fn take_forwarded(&mut self) {
        let f = match self.clones.take_forwarded() {
            None => return,
            // Its template let it go (its state changed, or it stops).
            Some(Err(InboxError::Io(e))) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                return tracing::info!(
                    "let go by its template: this fork source ends once its clones have"
                )
            }
            Some(Err(e)) => return tracing::warn!("{e}"),
            Some(Ok(f)) => f,
        };
        let conn = Connection::new(f.stream);
        let note: ForwardNote = match serde_json::from_value(f.note) {
            Ok(n) => n,
            Err(e) => {
                let e = InvokeError::Forwarded(e.to_string());
                return E::refuse(&conn, e.into());
            }
        };
        let inv = Invocation {
            options: note.options,
            payload: f.payload,
            conn: conn.clone(),
            received_ns: note.received_ns,
        };
        if let Err(e) = self.invoke(inv) {
            E::refuse(&conn, e);
        }
    }

    /// Answers the caller of finished invocation `f`; returns how the VM ends when it
    /// does (it served its one invocation), or resumes the runtime (keep-alive).
    fn answer(&mut self, f: Finished) -> Option<RunOutcome> {
        let console = match (&self.vm.config().host.console, f.outcome) {
            (_, Outcome::Ok) => None,
            (ConsoleSink::File(path), _) => console_tail(path),
            _ => None,
        };
        let logs = self.invoker.live_log(self.vm.memory(), &f);
        let socket = self.vm.config().host.api_sock.clone().unwrap_or_default();
        let id = self.clones.clone_id();
        if let Err(e) = E::answer(&f, id, &socket, console, logs) {
            tracing::warn!("cannot answer the invocation's caller: {e}");
        }
        tracing::info!(
            "invocation answered: {} in {} us (handler {} us)",
            f.outcome.as_str(),
            f.timings.total_us,
            f.timings.handler_us
        );
        if f.derived {
            // A template of its own from now on: it pauses when its runtime waits again,
            // and keeps as many warm clones as the VM it was cloned from.
            tracing::info!("derived: a template once the runtime waits again");
            self.vm.become_template();
            self.clones.become_template(self.vm.config());
        }
        if !f.keep_alive {
            // A template answers only the requests it held and could not serve; it
            // ends for none of them. A clone told to reports what it wrote first.
            if self.invoker.is_template() {
                return None;
            }
            self.clones.report_working_set(&self.vm);
            return Some(RunOutcome::Invoked);
        }
        let resumed = (self.vm.vcpus().get(usize::from(f.vcpu))).map(|v| v.resume());
        match resumed {
            Some(Ok(())) => None,
            _ => Some(RunOutcome::Error(format!(
                "cannot resume the runtime's vCPU {}",
                f.vcpu
            ))),
        }
    }

    /// Writes a snapshot of the paused VM to the new directory `dir`: the state its
    /// clones are made from in this pause (captured now if none was yet).
    fn snapshot(
        &mut self,
        dir: &std::path::Path,
    ) -> Result<api_types::SnapshotInfo, SnapshotError> {
        if self.vm.state() != VmState::Paused {
            return Err(SnapshotError::NotPaused);
        }
        if !self.vm.pending_events().is_empty() {
            return Err(SnapshotError::EventsPending);
        }
        let state = self.clones.paused_state(&mut self.vm)?;
        Ok(crate::snapshot::save(&self.vm, &state, dir)?)
    }

    /// Takes one action. `Shutdown` is answered here; the loop then stops.
    fn handle(&mut self, action: VmmAction) -> VmmResponse {
        match action {
            VmmAction::DescribeVm => Ok(VmmData::Vm(Box::new(self.describe()))),
            VmmAction::SetState(target) => {
                self.vm.set_state(target)?;
                if target == TargetState::Running {
                    // The guest runs on: what was captured and forked while paused is
                    // stale, and a waiting runtime reads "no request".
                    self.clones.discard_warm_clones();
                    self.invoker.resumed();
                }
                Ok(VmmData::Empty)
            }
            VmmAction::Invoke(inv) => self.invoke(*inv),
            VmmAction::Shutdown => Ok(VmmData::Empty),
            VmmAction::CreateClones {
                request,
                received_ns,
            } => {
                let clones = self
                    .clones
                    .make_clones(&mut self.vm, &request, received_ns, None)?;
                Ok(VmmData::CreatedClones(CloneList { clones }))
            }
            VmmAction::Snapshot(dir) => Ok(VmmData::Snapshot(Box::new(self.snapshot(&dir)?))),
            VmmAction::InsertMedium(m) => {
                self.vm.insert_medium(&m)?;
                // Warm clones were captured with the slot as it was.
                self.clones.discard_warm_clones();
                Ok(VmmData::Empty)
            }
            VmmAction::EjectMedium(slot) => {
                self.vm.eject_medium(slot)?;
                self.clones.discard_warm_clones();
                Ok(VmmData::Empty)
            }
            VmmAction::ListClones => Ok(VmmData::Clones(CloneList {
                clones: self.clones.list_clones(),
            })),
            // Answered once the clone is gone (`Vmm::take_action`).
            VmmAction::DeleteClone(id) => Err(VmmActionError::NoSuchClone(id)),
        }
    }

    /// Serves the requests that came while the runtime was on its way back to the port,
    /// oldest first: each in a clone of a template; in place, one (a VM that is no
    /// template holds no more).
    fn serve_held(&mut self) {
        while let Some(inv) = self.invoker.take_held() {
            let conn = inv.conn.clone();
            if let Err(e) = self.invoke(inv) {
                tracing::warn!("a held invocation is refused: {e}");
                E::refuse(&conn, e);
            }
        }
    }

    /// Refreshes the idle runtime (`invoke`): it reads "no request" and waits again,
    /// the guest kernel catching up meanwhile on the time it did not run. A template
    /// runs again until then, and its warm clones, made from the older state, are
    /// replaced once it pauses again.
    fn refresh(&mut self) {
        let Some(vcpu) = self.invoker.refreshing() else {
            return;
        };
        let resumed = match self.invoker.is_template() {
            true => (self.vm.set_state(TargetState::Running)).map_err(|e| e.to_string()),
            false => match self.vm.vcpus().get(usize::from(vcpu)) {
                Some(v) => v.resume().map_err(|e| e.to_string()),
                None => Err(format!("no vCPU {vcpu}")),
            },
        };
        match resumed {
            // A refreshed runtime reads "no request" and waits again: the template
            // pauses as it was, only its clock caught up.
            Ok(()) => self.clones.age_warm_clones(),
            Err(e) => {
                tracing::error!("cannot refresh the runtime on vCPU {vcpu}: {e}");
                // It still waits; it is tried again after another idle period.
                self.invoker.runtime_waits(&self.vm, vcpu);
            }
        }
    }

    /// Answers (502) the callers of invocation clones that ended without answering.
    fn answer_orphans(&mut self) {
        for o in self.clones.take_orphans() {
            match o.end {
                OrphanEnd::Ended(how) => answer_orphan::<E>(o.conn.into(), &o.id, &how),
                // As a request whose clone failed to start is answered (503 when the
                // host ran short of something).
                OrphanEnd::NotStarted(why) => {
                    let e = crate::cloning::CloneError::NoneStarted {
                        reason: why.reason,
                        errno: why.errno,
                    };
                    E::refuse(&o.conn.into(), e.into())
                }
            }
        }
    }

    /// Handles one vCPU event; returns how the VM ends when it does.
    fn vcpu_event(&mut self, id: u8, event: VcpuEvent) -> Option<RunOutcome> {
        match event {
            VcpuEvent::CloneRequest(count) => {
                self.clones.guest_request(&mut self.vm, id, count);
                None
            }
            VcpuEvent::InvokeWait => {
                if self.invoker.runtime_waits(&self.vm, id) {
                    // A template: paused where its runtime waits, its warm clones made.
                    match self.vm.set_state(TargetState::Paused) {
                        Ok(()) => {
                            // Before its warm clones share its pages.
                            self.invoker.measure_own_memory();
                            // A fork source may be sent requests from now on.
                            self.clones.announce_ready();
                            tracing::info!("template ready: its runtime waits on vCPU {id}")
                        }
                        Err(e) => tracing::error!("cannot pause the template: {e}"),
                    }
                }
                self.serve_held();
                self.take_held_until_paused();
                None
            }
            VcpuEvent::InvokeReply(len) => match self.invoker.runtime_replied(&self.vm, id, len) {
                Some(f) => self.answer(f),
                None => {
                    tracing::warn!("vCPU {id} replied with no invocation in flight; resuming it");
                    let _ = self.vm.vcpus().get(usize::from(id)).map(|v| v.resume());
                    None
                }
            },
            event => RunOutcome::of_vcpu_event(id, &event),
        }
    }

    /// Runs the event loop until the VM stops, then stops every vCPU thread and every
    /// clone. Actions come from `actions` (dropped, refusing whatever is still queued,
    /// when the loop ends); shutdown signals and SIGCHLD from `signals`.
    pub fn run(
        self,
        actions: Option<ActionReceiver>,
        signals: Option<&SignalFd>,
    ) -> Result<RunOutcome, RunError> {
        self.run_keeping(actions, signals, false).map(|(o, _)| o)
    }

    /// [`Vmm::run`]; with `keep`, a VM that served its invocation and ended
    /// ([`RunOutcome::Invoked`]) is given back as it stopped, its vCPU threads parked
    /// (a clone to be rewound takes it apart: `Microvm::into_kept`).
    pub fn run_keeping(
        mut self,
        actions: Option<ActionReceiver>,
        signals: Option<&SignalFd>,
        keep: bool,
    ) -> Result<(RunOutcome, Option<Microvm>), RunError> {
        let epoll = Epoll::new().map_err(RunError::EventLoop)?;
        let add = |fd: RawFd, token: u64| {
            epoll
                .ctl(
                    ControlOperation::Add,
                    fd,
                    EpollEvent::new(EventSet::IN, token),
                )
                .map_err(RunError::EventLoop)
        };
        add(self.vm.devices().reset_evt.as_raw_fd(), TOKEN_RESET)?;
        add(self.vm.vcpu_exit_evt().as_raw_fd(), TOKEN_VCPU_EXIT)?;
        if let Some(a) = &actions {
            add(a.evt().as_raw_fd(), TOKEN_API)?;
        }
        if let Some(s) = signals {
            add(s.as_raw_fd(), TOKEN_SIGNAL)?;
        }
        // Without it, a template waits for each invocation clone's start.
        match self.clones.starts_fd() {
            Ok(fd) => add(fd, TOKEN_STARTS)?,
            Err(e) => tracing::warn!("invocation clones' starts are waited for: {e}"),
        }
        // Fork sources' channels (`--fork-sources`), or a source's to its template.
        match self.clones.sources_fd() {
            Ok(Some(fd)) => add(fd, TOKEN_SOURCES)?,
            Ok(None) => {}
            Err(e) => tracing::warn!("fork sources cannot be watched: none is made: {e}"),
        }
        // Rewound clones coming back (`--rewind`).
        if self.vm.config().invoke.rewind {
            match self.clones.back_fd() {
                Ok(fd) => add(fd, TOKEN_BACK)?,
                Err(e) => tracing::warn!("rewound clones cannot come back: {e}"),
            }
        }
        // Host input reaches the guest's serial port when the console is the terminal
        // (or pipe) the VMM runs on. Lines arrive as the terminal delivers them; stdin
        // is not switched to raw mode.
        let stdin_fd = std::io::stdin().as_raw_fd();
        if self.vm.config().host.console == ConsoleSink::Stdout {
            // epoll refuses regular files and /dev/null (EPERM): then there is no input.
            let _ = epoll.ctl(
                ControlOperation::Add,
                stdin_fd,
                EpollEvent::new(EventSet::IN, TOKEN_STDIN),
            );
        }

        let mut events = vec![EpollEvent::default(); 8];
        // A clone made for an invocation: its vCPUs run now.
        self.invoker.watch_deferral(&self.vm, true);
        let outcome = 'run: loop {
            // Work done ahead of clone requests (warm clones, spare overlay files, cgroup
            // upkeep) waits a moment after the last request: fork() holds this process's
            // memory map, so the answer to that request, still being written by the API
            // thread, would wait for it.
            let held = (self.held_until_paused.iter().map(|h| h.2).min())
                .map(|t| t.saturating_duration_since(Instant::now()));
            let due = [
                self.clones.due_in(&self.vm),
                self.invoker.due_in(&self.vm),
                held,
            ];
            let timeout = due.into_iter().flatten().min().map_or(-1, wait_ms);
            let n = match epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(RunError::EventLoop(e)),
            };
            let invoker = &self.invoker;
            (self.clones).do_due_work(&mut self.vm, |vm| invoker.prime_vcpu(vm));
            self.invoker.stretch_deferral(&self.vm);
            for f in self.invoker.expire() {
                if let Some(outcome) = self.answer(f) {
                    break 'run outcome;
                }
            }
            if self.invoker.refresh_due(&self.vm) {
                self.refresh();
            }
            self.take_held_until_paused();
            if self.clones.retired() {
                break 'run RunOutcome::Retired;
            }
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_RESET => {
                        let _ = self.vm.devices().reset_evt.eventfd().read();
                        tracing::info!("guest reset through the i8042: powering off");
                        break 'run RunOutcome::GuestPowerOff;
                    }
                    TOKEN_VCPU_EXIT => {
                        let _ = self.vm.vcpu_exit_evt().read();
                        self.vm.drain_vcpu_events();
                        while let Some((id, event)) = self.vm.next_event() {
                            if let Some(outcome) = self.vcpu_event(id, event) {
                                break 'run outcome;
                            }
                        }
                    }
                    TOKEN_API => {
                        let Some(actions) = &actions else { continue };
                        let _ = actions.evt().read();
                        while let Some((action, replier)) = actions.try_recv() {
                            let stop = action == VmmAction::Shutdown;
                            self.take_action(action, replier);
                            if stop {
                                break 'run RunOutcome::ApiShutdown;
                            }
                        }
                    }
                    TOKEN_STARTS => self.clones.check_starts(),
                    TOKEN_BACK => self.clones.take_back(&self.vm),
                    TOKEN_SOURCES => self.take_forwarded(),
                    TOKEN_STDIN => {
                        if self.vm.forward_input(stdin_fd) == Input::Closed {
                            // End of input or an error: stop watching stdin.
                            let _ = epoll.ctl(
                                ControlOperation::Delete,
                                stdin_fd,
                                EpollEvent::default(),
                            );
                        } else {
                            // The serial port's state changed: a paused VM's captured
                            // state is stale.
                            self.clones.discard_warm_clones();
                        }
                    }
                    TOKEN_SIGNAL => {
                        while let Some(sig) = signals.and_then(read_signal) {
                            if sig == libc::SIGCHLD {
                                self.clones.reap();
                                self.answer_stopped();
                                continue;
                            }
                            tracing::info!("signal {sig}: shutting down");
                            break 'run RunOutcome::Signal(sig);
                        }
                    }
                    _ => {}
                }
            }
            // Invocation clones reaped above that died without answering.
            self.answer_orphans();
        };
        // Invocations the guest did not answer are answered now.
        for f in self.invoker.guest_stopped(&describe_outcome(&outcome)) {
            self.answer(f);
        }
        // Actions still queued are refused ("shutting down") rather than left waiting.
        drop(actions);
        self.clones.discard_warm_clones();
        let keep = keep && outcome == RunOutcome::Invoked;
        if !keep {
            self.vm.stop();
        }
        self.clones.shut_down();
        self.answer_orphans();
        // Deletions of clones that were reaped get their records; any other is answered
        // "shutting down" as its replier drops.
        self.answer_stopped();
        self.stops.clear();
        Ok((outcome, keep.then_some(self.vm)))
    }
}

/// The last bytes of the console file `path` (a clone's), for an error answer; None
/// when there is none or it cannot be read.
fn console_tail(path: &Path) -> Option<String> {
    use std::io::{Seek, SeekFrom};
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(SeekFrom::Start(len.saturating_sub(CONSOLE_TAIL_BYTES)))
        .ok()?;
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).ok()?;
    Some(String::from_utf8_lossy(&tail).into_owned())
}

/// Answers, if nobody did, the caller of an invocation whose clone `clone_id` ended
/// (`how`) without answering (the edge's answer to a guest that stopped: 502 over
/// HTTP). Never blocks: a connection the clone answered is shut down, and this write
/// fails.
fn answer_orphan<E: Edge>(conn: Connection, clone_id: &str, how: &str) {
    if conn.stream().set_nonblocking(true).is_err() {
        return;
    }
    let f = Finished {
        conn,
        outcome: Outcome::GuestStopped,
        body: format!("the clone's VMM {how} before it answered")
            .into_bytes()
            .into(),
        timings: Default::default(),
        keep_alive: false,
        vcpu: 0,
        primed: false,
        derived: false,
        sequence: 0,
    };
    if E::answer(&f, clone_id, Path::new(""), None, None).is_ok() {
        tracing::warn!("clone {clone_id} {how} without answering its invocation: answered");
    }
}

/// What an invocation's caller is told when the VM ended with `outcome` before the
/// runtime replied.
fn describe_outcome(outcome: &RunOutcome) -> String {
    match outcome {
        RunOutcome::GuestPowerOff => "the guest powered off".into(),
        RunOutcome::ApiShutdown => "the VM was shut down through its API".into(),
        RunOutcome::Signal(s) => format!("the VMM got signal {s}"),
        RunOutcome::GuestDone(code) => format!("the guest ended with status {code}"),
        RunOutcome::Error(e) => e.clone(),
        RunOutcome::Invoked => "the VM ended".into(),
        RunOutcome::Retired => "the fork source was let go by its template".into(),
    }
}

/// Serves a clone whose VM is rebuilt (`cloning::child`): opens its control socket,
/// tells its parent it is up, starts its device workers (threads that install their
/// seccomp filters first: the guest's notifications wait in the queue eventfds and host
/// vsock connections in the listening socket's backlog meanwhile), then runs its event
/// loop until it stops. A clone to be rewound ([`RebuiltClone::keep`]) that served its
/// invocation gets its VM back, stopped, and its API thread, idle.
pub fn serve_clone<E: Edge>(
    clone: RebuiltClone,
) -> Result<(RunOutcome, Option<KeptLife>), ServeError> {
    let (sender, actions) = crate::rpc::channel()?;
    let config = clone.vm.config();
    let api = serve_socket::<E>(&clone.api_sock, sender, config, clone.api_thread)?;
    clone.ready.send()?;
    clone.vm.devices().start_restored_virtio()?;
    let mut vmm = Vmm::<E>::new(clone.vm, clone.cloner);
    // What `invoke::take_handover` made of an invocation clone's handover.
    if let Some(invoker) = clone.taken.and_then(|t| t.downcast::<Invoker>().ok()) {
        vmm.invoker = *invoker;
    }
    let (outcome, vm) = vmm.run_keeping(Some(actions), Some(&clone.signals), clone.keep)?;
    let Some(vm) = vm else {
        drop(api);
        return Ok((outcome, None));
    };
    let api_thread = E::keep_thread(api);
    Ok((outcome, Some(KeptLife { vm, api_thread })))
}
