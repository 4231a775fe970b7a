//! The thread that serves a virtio device's queues, and the pause handshake cloning needs.
//!
//! Every device runs one worker: an epoll loop over its queues' eventfds (the guest's
//! notifications, registered with KVM as ioeventfds), any descriptors of its own (a tap,
//! a socket, a rate limiter's timer) and a control eventfd. The VMM can **pause** a
//! worker: it finishes the event it is handling, answers with its queues' state, and
//! blocks on its command channel holding no lock, so the process can `fork()` and the
//! child can rebuild the device from that state. `resume` lets it go on; `stop` ends it.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::thread::JoinHandle;

use virtio_queue::QueueState;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};
use vmm_sys_util::eventfd::EventFd;

/// Token of the control eventfd; queue `i` has token `i`; handlers use tokens from
/// [`FIRST_HANDLER_TOKEN`] up for their own descriptors.
const TOKEN_CONTROL: u64 = u64::MAX;
/// The first epoll token a handler may use for descriptors of its own.
pub const FIRST_HANDLER_TOKEN: u64 = 1 << 32;

/// What a device does when its worker wakes up. Runs on the worker thread only.
pub trait QueueHandler: Send + 'static {
    /// Called once when the worker starts, before any event: register the handler's own
    /// descriptors (tokens from [`FIRST_HANDLER_TOKEN`] up).
    fn start(&mut self, _ctx: &WorkerContext<'_>) {}
    /// The guest notified queue `index` (also called once per queue at start, so a
    /// restored device serves what the driver queued before the clone point).
    fn queue_event(&mut self, index: usize, ctx: &WorkerContext<'_>);
    /// One of the handler's own descriptors is ready.
    fn handler_event(&mut self, _token: u64, _events: EventSet, _ctx: &WorkerContext<'_>) {}
    /// The state of every queue, in order (read while the worker is paused).
    fn queue_states(&self) -> Vec<QueueState>;
}

impl QueueHandler for Box<dyn QueueHandler> {
    fn start(&mut self, ctx: &WorkerContext<'_>) {
        (**self).start(ctx)
    }
    fn queue_event(&mut self, index: usize, ctx: &WorkerContext<'_>) {
        (**self).queue_event(index, ctx)
    }
    fn handler_event(&mut self, token: u64, events: EventSet, ctx: &WorkerContext<'_>) {
        (**self).handler_event(token, events, ctx)
    }
    fn queue_states(&self) -> Vec<QueueState> {
        (**self).queue_states()
    }
}

/// What a handler may do to its worker's event loop.
pub struct WorkerContext<'a> {
    epoll: &'a Epoll,
}

impl<'a> WorkerContext<'a> {
    /// A context over `epoll` (the worker's; tests drive handlers with their own).
    pub(crate) fn new(epoll: &'a Epoll) -> Self {
        Self { epoll }
    }

    /// Watches `fd` for `events`, reported to the handler with `token`.
    pub fn add(&self, fd: RawFd, token: u64, events: EventSet) -> std::io::Result<()> {
        self.epoll
            .ctl(ControlOperation::Add, fd, EpollEvent::new(events, token))
    }

    /// Changes what `fd` is watched for.
    pub fn modify(&self, fd: RawFd, token: u64, events: EventSet) -> std::io::Result<()> {
        self.epoll
            .ctl(ControlOperation::Modify, fd, EpollEvent::new(events, token))
    }

    /// Stops watching `fd`.
    pub fn remove(&self, fd: RawFd) -> std::io::Result<()> {
        self.epoll
            .ctl(ControlOperation::Delete, fd, EpollEvent::default())
    }
}

enum Command {
    Pause,
    Resume,
    Stop,
}

/// Errors controlling a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The thread could not be started.
    #[error("cannot start the {0} worker: {1}")]
    Spawn(&'static str, std::io::Error),
    /// The worker is gone (it failed to start, or ended after an error it logged).
    #[error("the {0} worker is not running")]
    Gone(&'static str),
}

/// A running worker thread.
pub struct Worker {
    name: &'static str,
    commands: Sender<Command>,
    wake: EventFd,
    paused: Receiver<Vec<QueueState>>,
    thread: Option<JoinHandle<()>>,
}

impl Worker {
    /// Starts a thread named `name` that serves `handler`, woken by `queue_evts`.
    pub fn spawn<H: QueueHandler>(
        name: &'static str,
        handler: H,
        queue_evts: Vec<EventFd>,
    ) -> Result<Self, WorkerError> {
        let spawn_err = |e| WorkerError::Spawn(name, e);
        let wake = EventFd::new(0).map_err(spawn_err)?;
        let thread_wake = wake.try_clone().map_err(spawn_err)?;
        let (commands, thread_commands) = channel();
        let (thread_paused, paused) = channel();
        let thread = std::thread::Builder::new()
            .name(name.into())
            .spawn(move || {
                if super::worker_started(name) {
                    let mut run = Run {
                        name,
                        handler,
                        queue_evts,
                        wake: thread_wake,
                        commands: thread_commands,
                        paused: thread_paused,
                    };
                    if let Err(e) = run.serve() {
                        tracing::error!("{name} worker: {e}; the device no longer serves");
                    }
                }
            })
            .map_err(spawn_err)?;
        Ok(Self {
            name,
            commands,
            wake,
            paused,
            thread: Some(thread),
        })
    }

    fn send(&self, c: Command) -> Result<(), WorkerError> {
        self.commands
            .send(c)
            .map_err(|_| WorkerError::Gone(self.name))?;
        self.wake.write(1).map_err(|_| WorkerError::Gone(self.name))
    }

    /// Parks the worker between two events and returns its queues' state. It holds no
    /// lock while parked, until [`Worker::resume`] or [`Worker::stop`].
    pub fn pause(&self) -> Result<Vec<QueueState>, WorkerError> {
        self.request_pause()?;
        self.paused_state()
    }

    /// The first half of [`Worker::pause`]: asks the worker to park, without waiting
    /// (so several workers park at once). Every request must be followed by
    /// [`Worker::paused_state`].
    pub fn request_pause(&self) -> Result<(), WorkerError> {
        self.send(Command::Pause)
    }

    /// The second half of [`Worker::pause`]: waits until the worker is parked and
    /// returns its queues' state.
    pub fn paused_state(&self) -> Result<Vec<QueueState>, WorkerError> {
        self.paused.recv().map_err(|_| WorkerError::Gone(self.name))
    }

    /// Lets a paused worker go on.
    pub fn resume(&self) -> Result<(), WorkerError> {
        self.send(Command::Resume)
    }

    /// Ends the worker (paused or not) and joins it.
    pub fn stop(&mut self) {
        let _ = self.send(Command::Stop);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        self.stop();
    }
}

struct Run<H> {
    name: &'static str,
    handler: H,
    queue_evts: Vec<EventFd>,
    wake: EventFd,
    commands: Receiver<Command>,
    paused: Sender<Vec<QueueState>>,
}

impl<H: QueueHandler> Run<H> {
    fn serve(&mut self) -> std::io::Result<()> {
        let epoll = Epoll::new()?;
        let ctx = WorkerContext::new(&epoll);
        ctx.add(self.wake.as_raw_fd(), TOKEN_CONTROL, EventSet::IN)?;
        for (i, evt) in self.queue_evts.iter().enumerate() {
            ctx.add(evt.as_raw_fd(), i as u64, EventSet::IN)?;
        }
        self.handler.start(&ctx);
        for i in 0..self.queue_evts.len() {
            self.handler.queue_event(i, &ctx);
        }
        let mut events = vec![EpollEvent::default(); 32];
        loop {
            let n = match epoll.wait(-1, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            };
            for ev in &events[..n] {
                match ev.data() {
                    TOKEN_CONTROL => {
                        let _ = self.wake.read();
                        if !self.control() {
                            return Ok(());
                        }
                    }
                    t if t < FIRST_HANDLER_TOKEN => {
                        let i = t as usize;
                        let _ = self.queue_evts[i].read();
                        self.handler.queue_event(i, &ctx);
                    }
                    t => self.handler.handler_event(t, ev.event_set(), &ctx),
                }
            }
        }
    }

    /// Serves the commands waiting; false when the worker must end.
    fn control(&mut self) -> bool {
        while let Ok(c) = self.commands.try_recv() {
            match c {
                Command::Pause => {
                    if self.paused.send(self.handler.queue_states()).is_err() {
                        return false;
                    }
                    // Parked: only the next command wakes it.
                    loop {
                        match self.commands.recv() {
                            Ok(Command::Resume) => break,
                            Ok(Command::Pause) => {
                                if self.paused.send(self.handler.queue_states()).is_err() {
                                    return false;
                                }
                            }
                            Ok(Command::Stop) | Err(_) => return false,
                        }
                    }
                    tracing::trace!("{} worker resumed", self.name);
                }
                Command::Resume => {}
                Command::Stop => return false,
            }
        }
        true
    }
}
