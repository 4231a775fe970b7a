//! Invocations, the VMM's side (docs/invoke.md): a request reaches a guest runtime
//! waiting on the invoke port through the mailbox, with no guest kernel on the path,
//! and the runtime's reply goes back to the caller.
//!
//! A runtime reads the invoke port; its vCPU parks ([`Invoker::runtime_waits`]). Then:
//! - in a **template** (`--template`) the VM pauses itself there, and each invocation
//!   runs in a clone of it: the clone's VMM writes the request into its own copy of the
//!   mailbox and sets the parked read's result before its vCPUs run
//!   ([`Invoker::in_clone`], through cloning's `take` hook: `handover.rs`), and answers
//!   the caller itself; a ready template's warm clones are primed first (`prime.rs`);
//! - in any other VM (a keep-alive clone, a VM that is no template) the request is
//!   delivered in place ([`Invoker::deliver`]), one at a time.
//!
//! The runtime's write of the reply's length parks its vCPU again; the VMM reads and
//! checks the reply ([`Invoker::runtime_replied`]) and hands a [`Finished`] to the
//! controller, which answers on the caller's connection. The connection travels with
//! the request: the template hands it to the clone and never waits for the handler.
//!
//! A request that comes while the runtime is on its way back to the port (it just
//! replied to a keep-alive request, or its VM was resumed while it waited) is **held**
//! until it waits again ([`Invoker::queue`]); a template holds up to [`MAX_HELD`].
//!
//! A delivery defers the guest's overdue timer interrupt by `--tick-defer-ms`
//! (`clone::timer`: in the clone's restored state, or in place through the parked
//! vCPU), so the handler runs before the kernel catches up on the time that passed.
//!
//! A runtime can be **refreshed** ([`Invoker::refresh_due`]): once it has waited for
//! `--refresh-idle-ms` or [`IDLE_CATCH_UP_AFTER`], or (in place) once its timer has been
//! deferred for [`CATCH_UP_AFTER`], the controller lets it read "no request" and wait
//! again, so that the guest kernel's catch-up runs then, not on a request's path; a
//! template pauses again, and its warm clones are replaced by new ones.
//!
//! Nothing here knows HTTP: the controller hands a [`Finished`] to the edge
//! (`Edge::answer`, one layer up), which answers the caller.

use std::collections::VecDeque;
use std::os::unix::net::UnixStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use api_types::invoke::{InvokeOptions, InvokeReport, Outcome};
use api_types::vm::VmState;
pub use devices::mailbox::LiveLog;
use devices::mailbox::{
    read_live_log, read_reply_header, runtime_features, MailboxWindow, ReplyError, ReplyStatus,
    FEATURE_LOAD, FEATURE_PRIME, HEADER_BYTES,
};
use serde::{Deserialize, Serialize};
use vm_memory::GuestMemoryMmap;

use crate::config::VmConfig;
use crate::microvm::Microvm;
use crate::vstate::vcpu::{monotonic_ns, VcpuError};

mod body;
mod handover;
mod prime;
mod stretch;
mod write;
pub use body::Body;
pub use handover::take as take_handover;
pub use prime::{prime as prime_clone, PrimeFailed, PRIME_LIMIT};
use stretch::Stretch;
pub use stretch::{initial_ns as initial_defer_ns, ROOM as DEFER_ROOM};
use write::write;
pub use write::write_prime;

/// The caller's connection: answered by whichever VMM runs the handler.
#[derive(Debug, Clone)]
pub struct Connection(Arc<UnixStream>);

impl Connection {
    /// Wraps the caller's stream.
    pub fn new(stream: UnixStream) -> Self {
        Self(Arc::new(stream))
    }

    /// The stream.
    pub fn stream(&self) -> &UnixStream {
        &self.0
    }

    /// The stream, shared (what a template hands the clone that answers on it).
    pub fn shared(&self) -> Arc<UnixStream> {
        self.0.clone()
    }
}

impl From<Arc<UnixStream>> for Connection {
    fn from(stream: Arc<UnixStream>) -> Self {
        Self(stream)
    }
}

impl PartialEq for Connection {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl Eq for Connection {}

/// A request on its way to a runtime.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invocation {
    /// Its options.
    pub options: InvokeOptions,
    /// The payload.
    pub payload: Vec<u8>,
    /// Where the answer goes.
    pub conn: Connection,
    /// When it reached the VMM (CLOCK_MONOTONIC ns).
    pub received_ns: u64,
}

/// What a clone's VMM is told about the request it delivers. Serializable: it reaches
/// a warm clone in its launch message (the payload and the connection follow it).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Delivery {
    /// The vCPU parked on the invoke port in the template.
    pub vcpu: u8,
    /// Payload length.
    pub length: u32,
    /// Whether the clone serves further requests after this one.
    pub keep_alive: bool,
    /// Whether the request is a load request, after which the clone becomes a
    /// template (`derive`).
    #[serde(default)]
    pub derive: bool,
    /// Milliseconds the handler may take.
    pub timeout_ms: u64,
    /// When the request reached the template (CLOCK_MONOTONIC ns).
    pub received_ns: u64,
    /// The clone has a guest address of its own (`ipv4`): the request header tells the
    /// runtime to take its network identity before the handler runs
    /// ([`devices::mailbox::FLAG_ADOPT_NET`]).
    #[serde(default)]
    pub adopt_net: bool,
}

impl Delivery {
    /// What delivering `inv` to the runtime waiting on `vcpu` means.
    fn of(inv: &Invocation, vcpu: u8) -> Self {
        Self {
            vcpu,
            length: inv.payload.len() as u32,
            keep_alive: inv.options.stays(),
            derive: inv.options.derive,
            timeout_ms: inv.options.timeout_ms(),
            received_ns: inv.received_ns,
            adopt_net: inv.options.ipv4.is_some(),
        }
    }
}

/// Why an invocation was refused before it reached a runtime.
#[derive(Debug, thiserror::Error)]
pub enum InvokeError {
    /// The VM has no mailbox (`--mailbox-mib 0`).
    #[error("the VM has no mailbox (started with --mailbox-mib 0)")]
    NoMailbox,
    /// No runtime waits on the invoke port.
    #[error("no runtime in the VM waits for a request (it has not started, or it is busy)")]
    NotWaiting,
    /// An invocation runs in this VM now.
    #[error("an invocation is running in this VM; a VM that is no template serves one at a time")]
    Busy,
    /// A fork source could not read the request its template forwarded.
    #[error("the request forwarded by the template is malformed: {0}")]
    Forwarded(String),
    /// A template is to be derived, and the runtime loads nothing.
    #[error("the runtime does not take load requests (its wait header does not declare it), so no template can be derived from it")]
    NoLoader,
    /// A clone's own tap, address or disk slot images asked of a VM that serves in place.
    #[error("tap, ipv4 and media are for a clone made for the invocation, and this VM is no template: it serves the request in place")]
    OwnCloneInPlace,
    /// The payload does not fit the mailbox.
    #[error("a payload of {length} bytes does not fit the mailbox ({capacity} bytes)")]
    TooLarge {
        /// The payload's length.
        length: usize,
        /// Most that fits.
        capacity: usize,
    },
    /// The clone made for the invocation did not start (its console says why).
    #[error("the clone {0} made for the invocation did not start")]
    CloneFailed(String),
    /// A template holds as many requests as it may while its runtime is on its way back.
    #[error("{MAX_HELD} invocations wait already for the template's runtime to wait again")]
    HeldFull,
    /// Writing the request failed.
    #[error("cannot write the request into the mailbox: {0}")]
    Mailbox(#[from] ReplyError),
    /// The runtime's vCPU could not be given the request.
    #[error("cannot wake the runtime's vCPU: {0}")]
    Vcpu(#[from] VcpuError),
}

/// How an invocation is served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    /// In a clone of this template: the clone's VMM delivers the request.
    Clone(u8),
    /// In this VM, on this vCPU.
    InPlace(u8),
    /// Held until the runtime, on its way back to the port, waits again
    /// ([`Invoker::queue`]).
    Queue,
}

/// An invocation whose request is in this VM's mailbox.
#[derive(Debug)]
struct InFlight {
    conn: Connection,
    vcpu: u8,
    received_ns: u64,
    delivered_ns: u64,
    deadline: Instant,
    keep_alive: bool,
    /// A load request: the VM becomes a template once the runtime replied ok.
    derive: bool,
    /// Served by a primed warm clone.
    primed: bool,
    /// Its timer deferral, stretched by its vCPU's waits for a host CPU.
    stretch: Option<Stretch>,
    /// Its sequence number in the request header.
    sequence: u64,
}

/// Microseconds spent, for the answer's headers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Timings {
    /// Arrival to the request delivered (the clone's vCPUs starting, or the runtime's
    /// vCPU resumed).
    pub clone_us: u64,
    /// Delivery to the reply.
    pub handler_us: u64,
    /// Arrival to the reply.
    pub total_us: u64,
    /// How far the timer deferral was stretched (`invoke/stretch.rs`), in µs.
    pub stretched_us: u64,
}

/// An invocation that ended: what to answer, and on which connection.
#[derive(Debug)]
pub struct Finished {
    /// The caller's connection.
    pub conn: Connection,
    /// How it ended.
    pub outcome: Outcome,
    /// The handler's reply or its error text (in the mailbox, the runtime parked until
    /// its caller is answered), or the text of an error the VMM found.
    pub body: Body,
    /// Time spent.
    pub timings: Timings,
    /// Whether the VM serves on: the runtime's vCPU is to be resumed (the VM ends
    /// otherwise).
    pub keep_alive: bool,
    /// The runtime's vCPU, parked.
    pub vcpu: u8,
    /// Whether the VM that served it was a primed warm clone.
    pub primed: bool,
    /// Whether the VM is now a template (a load request, answered ok): it pauses when
    /// its runtime waits again.
    pub derived: bool,
    /// The request's sequence number (0: it was never delivered).
    pub sequence: u64,
}

/// One VM's invocation side.
#[derive(Debug)]
pub struct Invoker {
    window: MailboxWindow,
    template: bool,
    /// The vCPU parked on the invoke port, waiting for a request.
    waiting: Option<u8>,
    in_flight: Option<InFlight>,
    /// The runtime is on its way back to the port: it replied to a keep-alive request,
    /// or the VM was resumed (from outside, or to refresh it) while it waited.
    returning: bool,
    /// Requests held for it, oldest first, each with its deadline.
    held: VecDeque<(Invocation, Instant)>,
    /// Requests handed to a clone or delivered here so far.
    started: u64,
    /// How long a runtime waits before it is refreshed (None: never).
    refresh_after: Option<Duration>,
    /// Since when the runtime waits (set with `waiting`).
    waiting_since: Option<Instant>,
    /// Refreshes so far.
    refreshes: u64,
    /// How far a due timer interrupt is moved on at delivery, in ns (`clone::timer`).
    tick_defer_ns: u64,
    /// When a delivery first deferred the guest's due timer interrupts since its kernel
    /// last had them (a refresh, or a delivery that deferred none); None: none did. With
    /// deferral, a busy runtime's kernel would get none otherwise: every delivery moves
    /// them on again.
    deferred_since: Option<Instant>,
    /// Whether a template's warm clones may be primed (`--no-prime` not given).
    prime: bool,
    /// This process's own memory when it last paused as a template, in KiB.
    own_memory_kib: Option<u64>,
}

/// How long a runtime served in place may go with its timer deferred at every delivery
/// before it is refreshed at its next wait, its kernel then catching up.
pub const CATCH_UP_AFTER: Duration = Duration::from_secs(1);

/// How long a runtime waits, its guest not running, before it is refreshed whatever
/// `--refresh-idle-ms` says. A guest catches up, at its first timer interrupt, on the time
/// it did not run (timekeeping's accumulation loops about once per second of it), and so
/// does every clone of a template at its own first one, from the template's pause: a
/// template serving requests never runs itself, so without this a handler that meets the
/// interrupt pays more the older its template is (on the PVM development host about 160
/// emulated instructions per second: 0.1-0.2 s for a template 20 minutes old). Refreshed,
/// the kernel catches up once, and a template's warm clones are replaced
/// (docs/invoke.md, "A guest that did not run").
pub const IDLE_CATCH_UP_AFTER: Duration = Duration::from_secs(30);

/// Most requests a template holds while its runtime is on its way back to the port
/// (a VM that is no template holds one).
pub const MAX_HELD: usize = 256;

impl Invoker {
    /// The invocation side of a VM with `config`, whose mailbox is `window`.
    pub fn new(config: &VmConfig, window: MailboxWindow) -> Self {
        Self {
            window,
            template: config.invoke.template,
            waiting: None,
            in_flight: None,
            returning: false,
            held: VecDeque::new(),
            started: 0,
            refresh_after: (config.invoke.refresh_idle_ms > 0)
                .then(|| Duration::from_millis(config.invoke.refresh_idle_ms)),
            waiting_since: None,
            refreshes: 0,
            tick_defer_ns: config.invoke.tick_defer_ns(),
            deferred_since: None,
            prime: config.clones.prime,
            own_memory_kib: None,
        }
    }

    /// Measures this process's own memory (a template that just paused, before its
    /// warm clones share its pages), for `GET /vm`.
    pub fn measure_own_memory(&mut self) {
        let rollup = std::fs::read_to_string("/proc/self/smaps_rollup");
        self.own_memory_kib = rollup.ok().and_then(|r| private_kib(&r));
        if self.own_memory_kib.is_none() {
            tracing::debug!("cannot read /proc/self/smaps_rollup: own memory unknown");
        }
    }

    /// The vCPU a template's warm clones made now are primed on: the one its runtime
    /// waits on, when the runtime declared (in its wait header) that it handles prime
    /// requests and the template is paused there. None: not primed.
    pub fn prime_vcpu(&self, vm: &Microvm) -> Option<u8> {
        let declared = || runtime_features(vm.memory(), self.window) & FEATURE_PRIME != 0;
        let ready = self.template && self.prime && vm.state() == VmState::Paused;
        self.waiting.filter(|_| ready && declared())
    }

    /// Whether the runtime is on its way back to its wait (it replied to a keep-alive
    /// request, or the VM was resumed while it waited: a refresh, or from outside).
    pub fn is_returning(&self) -> bool {
        self.returning
    }

    /// Whether this VM is a template.
    pub fn is_template(&self) -> bool {
        self.template
    }

    /// The figures for `GET /vm`.
    pub fn report(&self) -> InvokeReport {
        InvokeReport {
            mailbox_bytes: u64::from(self.window.size),
            template: self.template,
            waiting: self.waiting.is_some(),
            in_flight: self.in_flight.is_some(),
            started: self.started,
            held: self.held.len() as u64,
            refresh_idle_ms: self.refresh_after.map_or(0, |d| d.as_millis() as u64),
            refreshes: self.refreshes,
            tick_defer_ms: self.tick_defer_ns / 1_000_000,
            own_memory_kib: self.own_memory_kib,
        }
    }

    /// A runtime on `vcpu` waits for a request (its vCPU parked). Returns whether the
    /// VM is to pause itself: a template does, the first time.
    pub fn runtime_waits(&mut self, vm: &Microvm, vcpu: u8) -> bool {
        self.returning = false;
        if let Some(other) = self.waiting.replace(vcpu) {
            if other != vcpu {
                // One runtime per VM: the earlier one stays parked until the VM is
                // resumed (it then reads "no request").
                tracing::warn!("runtimes wait on vCPUs {other} and {vcpu}; serving vCPU {vcpu}");
            }
        }
        self.waiting_since = Some(Instant::now());
        self.template && vm.state() == VmState::Running
    }

    /// The VM was resumed (`PATCH /vm`, or a refresh): a waiting runtime's read returns
    /// "no request" and the runtime waits again; requests are held until it does.
    pub fn resumed(&mut self) {
        if self.waiting.take().is_some() {
            self.returning = true;
        }
        self.waiting_since = None;
    }

    /// When the runtime is to be refreshed: it waits, in a paused template or a running
    /// VM that is no template, nothing held for it; once it waited the refresh period or
    /// [`IDLE_CATCH_UP_AFTER`], or (in place) once its kernel's timer interrupts were
    /// deferred for [`CATCH_UP_AFTER`].
    fn refresh_at(&self, vm: &Microvm) -> Option<Instant> {
        let since = self.waiting_since?;
        let idle_due = self.refresh_after.map(|after| since + after);
        let deferred_due = (self.deferred_since)
            .filter(|_| !self.template)
            .map(|d| d + CATCH_UP_AFTER);
        let at = [idle_due, deferred_due, Some(since + IDLE_CATCH_UP_AFTER)]
            .into_iter()
            .flatten()
            .min()?;
        let idle = self.waiting.is_some() && self.in_flight.is_none() && self.held.is_empty();
        let state = match self.template {
            true => VmState::Paused,
            false => VmState::Running,
        };
        (idle && vm.state() == state).then_some(at)
    }

    /// Whether the waiting runtime is due for a refresh.
    pub fn refresh_due(&self, vm: &Microvm) -> bool {
        self.refresh_at(vm).is_some_and(|t| t <= Instant::now())
    }

    /// Refreshes the waiting runtime: returns its vCPU, to be resumed (with the VM, in a
    /// template) with "no request" as its read's result.
    pub fn refreshing(&mut self) -> Option<u8> {
        let vcpu = self.waiting?;
        self.resumed();
        self.refreshes += 1;
        self.deferred_since = None;
        Some(vcpu)
    }

    /// How invocation `inv` would be served now (a load request, `derive`, only by a
    /// runtime that declared it takes them; a tap or address of its own only in a clone).
    pub fn route(&self, vm: &Microvm, inv: &Invocation) -> Result<Route, InvokeError> {
        let (length, derive) = (inv.payload.len(), inv.options.derive);
        if !self.window.exists() {
            return Err(InvokeError::NoMailbox);
        }
        if inv.options.wants_own_clone() && !self.template {
            return Err(InvokeError::OwnCloneInPlace);
        }
        let loads = || runtime_features(vm.memory(), self.window) & FEATURE_LOAD != 0;
        if derive && self.waiting.is_some() && !loads() {
            return Err(InvokeError::NoLoader);
        }
        if length > self.window.capacity() {
            return Err(InvokeError::TooLarge {
                length,
                capacity: self.window.capacity(),
            });
        }
        if self.in_flight.is_some() || (!self.template && !self.held.is_empty()) {
            return Err(InvokeError::Busy);
        }
        if self.held.len() >= MAX_HELD {
            return Err(InvokeError::HeldFull);
        }
        let Some(vcpu) = self.waiting else {
            return match self.returning {
                true => Ok(Route::Queue),
                false => Err(InvokeError::NotWaiting),
            };
        };
        match (self.template, vm.state()) {
            (true, VmState::Paused) => Ok(Route::Clone(vcpu)),
            (false, VmState::Running) => Ok(Route::InPlace(vcpu)),
            _ => Err(InvokeError::NotWaiting),
        }
    }

    /// Holds `inv` until the runtime, on its way back to the port, waits again
    /// ([`Invoker::take_held`]); its timeout runs from now.
    pub fn queue(&mut self, inv: Invocation) {
        let deadline = Instant::now() + Duration::from_millis(inv.options.timeout_ms());
        self.held.push_back((inv, deadline));
    }

    /// The oldest request held for the runtime, which waits again now.
    pub fn take_held(&mut self) -> Option<Invocation> {
        self.held.pop_front().map(|(inv, _)| inv)
    }

    /// The clone request and handover that run `inv` in a clone of this template,
    /// whose runtime waits on `vcpu` (`handover.rs`).
    pub fn hand_to_clone(
        &self,
        inv: Invocation,
        vcpu: u8,
    ) -> (api_types::CreateClones, crate::cloning::Handover) {
        handover::handover(inv, vcpu, self.tick_defer_ns)
    }

    /// Counts an invocation a clone was made for (not one refused before that, say for
    /// want of a cgroup).
    pub fn handed_to_clone(&mut self) {
        self.started += 1;
    }

    /// Delivers `inv` to the runtime waiting on `vcpu` in this VM: writes the request,
    /// sets the port read's result, and resumes the vCPU.
    pub fn deliver(&mut self, vm: &Microvm, inv: Invocation, vcpu: u8) -> Result<(), InvokeError> {
        let d = Delivery::of(&inv, vcpu);
        write(
            vm.memory(),
            self.window,
            &d,
            self.started + 1,
            (&inv.payload, 0),
        )?;
        let handle = vm
            .vcpus()
            .get(usize::from(vcpu))
            .ok_or(VcpuError::Gone(vcpu))?;
        handle.set_result(u64::from(d.length), initial_defer_ns(self.tick_defer_ns))?;
        self.started += 1;
        self.waiting = None;
        self.waiting_since = None;
        self.delivered();
        self.in_flight = Some(InFlight {
            conn: inv.conn,
            vcpu,
            received_ns: d.received_ns,
            delivered_ns: monotonic_ns(),
            deadline: Instant::now() + Duration::from_millis(d.timeout_ms),
            keep_alive: d.keep_alive,
            derive: d.derive,
            primed: false,
            stretch: None,
            sequence: self.started,
        });
        handle.resume()?;
        self.watch_deferral(vm, false);
        Ok(())
    }

    /// Starts watching the timer deferral of the request in flight: a clone's when it
    /// serves (`fresh`: its vCPU threads started after the delivery), one in place on
    /// delivery.
    pub fn watch_deferral(&mut self, vm: &Microvm, fresh: bool) {
        let defer = Duration::from_nanos(self.tick_defer_ns);
        let Some(f) = self.in_flight.as_mut() else {
            return;
        };
        if defer.is_zero() || f.stretch.is_some() {
            return;
        }
        let ago = Duration::from_nanos(monotonic_ns().saturating_sub(f.delivered_ns));
        let delivered = Instant::now().checked_sub(ago).unwrap_or_else(Instant::now);
        f.stretch = Stretch::watch(vm, f.vcpu, delivered, defer, fresh);
    }

    /// Re-times the deferral of the request in flight if a check is due
    /// (`invoke/stretch.rs`).
    pub fn stretch_deferral(&mut self, vm: &Microvm) {
        let stretch = self.in_flight.as_mut().and_then(|f| f.stretch.as_mut());
        if let Some(s) = stretch {
            s.check(vm, Instant::now());
        }
    }

    /// The invocation side of a clone made for `d` (a primed warm clone when `primed`),
    /// before its vCPUs run: the request is written into the clone's copy of the
    /// mailbox (the caller sets the port read's result, the payload length, in the
    /// vCPU's state).
    pub fn in_clone(
        config: &VmConfig,
        (mem, window): (&GuestMemoryMmap, MailboxWindow),
        d: &Delivery,
        (payload, in_place, conn): (&[u8], usize, Connection),
        primed: bool,
    ) -> Result<Self, InvokeError> {
        let mut me = Self::new(config, window);
        // A clone's first request, its timer deferred as any delivery's.
        me.delivered();
        let sequence = 1;
        write(mem, me.window, d, sequence, (payload, in_place))?;
        me.started = 1;
        me.in_flight = Some(InFlight {
            conn,
            vcpu: d.vcpu,
            received_ns: d.received_ns,
            delivered_ns: monotonic_ns(),
            deadline: Instant::now() + Duration::from_millis(d.timeout_ms),
            keep_alive: d.keep_alive,
            derive: d.derive,
            primed,
            stretch: None,
            sequence,
        });
        Ok(me)
    }

    /// A request was delivered: with deferral, it moved the guest's due timer
    /// interrupts on (counted from the first such delivery since they were had);
    /// without, the kernel had them.
    fn delivered(&mut self) {
        match self.tick_defer_ns {
            0 => self.deferred_since = None,
            _ => _ = self.deferred_since.get_or_insert_with(Instant::now),
        }
    }

    fn finish(&mut self, outcome: Outcome, body: Body, vcpu: Option<u8>) -> Option<Finished> {
        let f = self.in_flight.take()?;
        let now = monotonic_ns();
        let us = |from: u64, to: u64| to.saturating_sub(from) / 1000;
        Some(Finished {
            conn: f.conn,
            outcome,
            body,
            timings: Timings {
                clone_us: us(f.received_ns, f.delivered_ns),
                handler_us: us(f.delivered_ns, now),
                total_us: us(f.received_ns, now),
                stretched_us: f.stretch.as_ref().map_or(0, Stretch::stretched_us),
            },
            keep_alive: f.keep_alive && outcome != Outcome::Timeout,
            vcpu: vcpu.unwrap_or(f.vcpu),
            primed: f.primed,
            derived: f.derive && outcome == Outcome::Ok,
            sequence: f.sequence,
        })
    }

    /// The runtime on `vcpu` replied with `length` bytes (its vCPU parked): the reply
    /// read and checked. None when no invocation was in flight (the caller resumes the
    /// vCPU).
    pub fn runtime_replied(&mut self, vm: &Microvm, vcpu: u8, length: u32) -> Option<Finished> {
        let derive = self.in_flight.as_ref()?.derive;
        let mem = vm.memory();
        // The reply, or the handler's error text, stays in the mailbox until the caller
        // is answered (`Body`): its header is read once.
        let (outcome, body) = match read_reply_header(mem, self.window, length) {
            Ok(h) => {
                let outcome = match h.status {
                    ReplyStatus::Ok => Outcome::Ok,
                    _ => Outcome::HandlerError,
                };
                let (mem, at, len) = (mem.clone(), self.window.at(HEADER_BYTES), h.length);
                let len = len as usize;
                (outcome, Body::Mailbox { mem, at, len })
            }
            Err(e) => (Outcome::BadReply, e.to_string().into_bytes().into()),
        };
        let mut f = self.finish(outcome, body, Some(vcpu))?;
        // A runtime that cannot write a reply is not trusted with another request, and
        // one that failed to load is no template.
        f.keep_alive &= outcome != Outcome::BadReply;
        f.keep_alive &= f.derived || !derive;
        self.returning = f.keep_alive;
        if f.derived {
            self.template = true;
        }
        Some(f)
    }

    /// What the runtime printed during `f`, when it ended without a reply (its time
    /// limit passed, the guest stopped) and the runtime kept a live log of it in the
    /// mailbox (docs/invoke.md, "The live log").
    pub fn live_log(&self, mem: &GuestMemoryMmap, f: &Finished) -> Option<LiveLog> {
        let replied = matches!(f.outcome, Outcome::Ok | Outcome::HandlerError);
        if replied || f.sequence == 0 {
            return None;
        }
        read_live_log(mem, self.window, f.sequence)
    }

    /// Time until the invocation in flight or a held one times out, or the runtime is
    /// to be refreshed (zero: now).
    pub fn due_in(&self, vm: &Microvm) -> Option<Duration> {
        let f = self.in_flight.as_ref().map(|f| f.deadline);
        let stretch = (self.in_flight.as_ref())
            .and_then(|f| f.stretch.as_ref())
            .and_then(Stretch::due);
        let held = self.held.iter().map(|h| h.1);
        let at = (f.into_iter().chain(stretch).chain(held))
            .chain(self.refresh_at(vm))
            .min()?;
        Some(at.saturating_duration_since(Instant::now()))
    }

    /// The invocation in flight, if its time is up, and the held ones whose time is up
    /// (their runtime did not come back in time).
    pub fn expire(&mut self) -> Vec<Finished> {
        let now = Instant::now();
        let (late, kept) = std::mem::take(&mut self.held)
            .into_iter()
            .partition::<VecDeque<_>, _>(|h| h.1 <= now);
        self.held = kept;
        let text = "the runtime did not wait for the request in time";
        let mut done: Vec<Finished> = late
            .into_iter()
            .map(|(inv, _)| unserved(inv, Outcome::Timeout, text))
            .collect();
        if self.in_flight.as_ref().is_some_and(|f| f.deadline <= now) {
            let text = "the handler did not reply in time".as_bytes().to_vec();
            done.extend(self.finish(Outcome::Timeout, text.into(), None));
        }
        done
    }

    /// The guest stopped (`why`): the invocation in flight and the held ones.
    pub fn guest_stopped(&mut self, why: &str) -> Vec<Finished> {
        let text = format!("the guest stopped before its runtime replied: {why}");
        let mut done: Vec<Finished> = (self.held.drain(..))
            .map(|(inv, _)| unserved(inv, Outcome::GuestStopped, &text))
            .collect();
        done.extend(self.finish(Outcome::GuestStopped, text.into_bytes().into(), None));
        done
    }
}

/// The pages a process alone maps, in KiB, from its `smaps_rollup` (the sum of
/// `Private_Clean` and `Private_Dirty`); None without either.
fn private_kib(rollup: &str) -> Option<u64> {
    let field = |name: &str| {
        rollup.lines().find_map(|l| {
            let rest = l.strip_prefix(name)?.strip_prefix(':')?;
            rest.trim().strip_suffix("kB")?.trim().parse::<u64>().ok()
        })
    };
    Some(field("Private_Clean")? + field("Private_Dirty")?)
}

/// The answer to `inv`, never delivered: `outcome`, with `text`.
fn unserved(inv: Invocation, outcome: Outcome, text: &str) -> Finished {
    let total_us = monotonic_ns().saturating_sub(inv.received_ns) / 1000;
    Finished {
        conn: inv.conn,
        outcome,
        body: text.as_bytes().to_vec().into(),
        timings: Timings {
            total_us,
            ..Default::default()
        },
        keep_alive: false,
        vcpu: 0,
        primed: false,
        derived: false,
        sequence: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_memory_is_the_private_pages_of_smaps_rollup() {
        let rollup = "55d0c1a00000-7ffd1e1f2000 ---p 00000000 00:00 0    [rollup]\n\
                      Rss:              269656 kB\nPss:              140000 kB\n\
                      Shared_Clean:       4000 kB\nShared_Dirty:     250000 kB\n\
                      Private_Clean:       656 kB\nPrivate_Dirty:     15000 kB\n";
        assert_eq!(private_kib(rollup), Some(15656));
        assert_eq!(private_kib("Rss: 1 kB\nPrivate_Dirty: 2 kB\n"), None);
        assert_eq!(
            private_kib("Private_Clean: x kB\nPrivate_Dirty: 2 kB\n"),
            None
        );
        let here = std::fs::read_to_string("/proc/self/smaps_rollup").unwrap();
        assert!(private_kib(&here).is_some_and(|k| k > 0), "{here}");
    }
}
