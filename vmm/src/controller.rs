//! The VMM core: one VM and its clone side, driven from one event loop by typed actions
//! ([`crate::rpc`]) and host events (guest power-off, vCPU exits, signals, host input,
//! timers for work done ahead of clone requests).
//!
//! [`Vmm::handle`] answers an action with typed data or a typed error; nothing here
//! knows HTTP. [`serve_clone`] is what a clone runs once its VM is rebuilt: the same
//! loop, on its own control socket.

use std::os::fd::{AsRawFd, RawFd};

use nix::sys::signalfd::SignalFd;

use api_types::vm::{TargetState, VmInfo};
use api_types::CloneList;
use vmm_sys_util::epoll::{ControlOperation, Epoll, EpollEvent, EventSet};

use crate::api::server::ApiServer;
use crate::cloning::{Cloner, RebuiltClone, ServeError};
use crate::config::ConsoleSink;
use crate::microvm::{Input, Microvm, RunOutcome};
use crate::rpc::{ActionReceiver, VmmAction, VmmActionError, VmmData, VmmResponse};
use crate::signals::read_signal;
use crate::vstate::vcpu::VcpuEvent;

/// Errors in the event loop itself.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// epoll or signalfd failed.
    #[error("event loop failure: {0}")]
    EventLoop(std::io::Error),
}

/// A VM and its clone side.
pub struct Vmm {
    vm: Microvm,
    clones: Cloner,
}

const TOKEN_RESET: u64 = 1;
const TOKEN_VCPU_EXIT: u64 = 2;
const TOKEN_API: u64 = 3;
const TOKEN_SIGNAL: u64 = 4;
const TOKEN_STDIN: u64 = 5;

/// An epoll timeout for `d`, rounded up: rounded down, the loop would wake before the
/// time and spin with timeout 0 until it.
fn wait_ms(d: std::time::Duration) -> i32 {
    i32::try_from(d.as_micros().div_ceil(1000)).unwrap_or(i32::MAX)
}

impl Vmm {
    /// The VMM of `vm`, whose clones `clones` makes.
    pub fn new(vm: Microvm, clones: Cloner) -> Self {
        Self { vm, clones }
    }

    /// What `GET /vm` shows.
    pub fn describe(&self) -> VmInfo {
        self.vm.describe(
            self.clones.clone_id(),
            self.clones.warm_report(),
            self.clones.cgroups_report(),
        )
    }

    /// Takes one action. `Shutdown` is answered here; the loop then stops.
    pub fn handle(&mut self, action: VmmAction) -> VmmResponse {
        match action {
            VmmAction::DescribeVm => Ok(VmmData::Vm(Box::new(self.describe()))),
            VmmAction::SetState(target) => {
                self.vm.set_state(target)?;
                if target == TargetState::Running {
                    // The guest runs on: what was captured and forked while paused is
                    // stale.
                    self.clones.discard_warm_clones();
                }
                Ok(VmmData::Empty)
            }
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
            VmmAction::ListClones => Ok(VmmData::Clones(CloneList {
                clones: self.clones.list_clones(),
            })),
            VmmAction::DeleteClone(id) => match self.clones.stop_clone(&id) {
                Some(info) => Ok(VmmData::Clone(Box::new(info))),
                None => Err(VmmActionError::NoSuchClone(id)),
            },
        }
    }

    /// Handles one vCPU event; returns how the VM ends when it does.
    fn vcpu_event(&mut self, id: u8, event: VcpuEvent) -> Option<RunOutcome> {
        if let VcpuEvent::CloneRequest(count) = event {
            self.clones.guest_request(&mut self.vm, id, count);
            return None;
        }
        RunOutcome::of_vcpu_event(id, &event)
    }

    /// Runs the event loop until the VM stops, then stops every vCPU thread and every
    /// clone. Actions come from `actions` (dropped, refusing whatever is still queued,
    /// when the loop ends); shutdown signals and SIGCHLD from `signals`.
    pub fn run(
        mut self,
        actions: Option<ActionReceiver>,
        signals: Option<&SignalFd>,
    ) -> Result<RunOutcome, RunError> {
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
        // Host input reaches the guest's serial port when the console is the terminal
        // (or pipe) the VMM runs on. Lines arrive as the terminal delivers them; stdin
        // is not switched to raw mode.
        let stdin_fd = std::io::stdin().as_raw_fd();
        if self.vm.config().console == ConsoleSink::Stdout {
            // epoll refuses regular files and /dev/null (EPERM): then there is no input.
            let _ = epoll.ctl(
                ControlOperation::Add,
                stdin_fd,
                EpollEvent::new(EventSet::IN, TOKEN_STDIN),
            );
        }

        let mut events = vec![EpollEvent::default(); 8];
        let outcome = 'run: loop {
            // Work done ahead of clone requests (warm clones, spare overlay files, cgroup
            // upkeep) waits a moment after the last request: fork() holds this process's
            // memory map, so the answer to that request, still being written by the API
            // thread, would wait for it.
            let timeout = self.clones.due_in(&self.vm).map_or(-1, wait_ms);
            let n = match epoll.wait(timeout, &mut events) {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(RunError::EventLoop(e)),
            };
            self.clones.do_due_work(&mut self.vm);
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
                            replier.send(self.handle(action));
                            if stop {
                                break 'run RunOutcome::ApiShutdown;
                            }
                        }
                    }
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
                                continue;
                            }
                            tracing::info!("signal {sig}: shutting down");
                            break 'run RunOutcome::Signal(sig);
                        }
                    }
                    _ => {}
                }
            }
        };
        // Actions still queued are refused ("shutting down") rather than left waiting.
        drop(actions);
        self.clones.discard_warm_clones();
        self.vm.stop();
        self.clones.shut_down();
        Ok(outcome)
    }
}

/// Serves a clone whose VM is rebuilt (`cloning::child`): opens its control socket,
/// tells its parent it is up, starts its device workers (threads that install their
/// seccomp filters first: the guest's notifications wait in the queue eventfds and host
/// vsock connections in the listening socket's backlog meanwhile), then runs its event
/// loop until it stops.
pub fn serve_clone(clone: RebuiltClone) -> Result<RunOutcome, ServeError> {
    let (sender, actions) = crate::rpc::channel()?;
    let api = ApiServer::start(&clone.api_sock, sender)?;
    clone.ready.send()?;
    clone.vm.devices().start_restored_virtio()?;
    let outcome = Vmm::new(clone.vm, clone.cloner).run(Some(actions), Some(&clone.signals))?;
    drop(api);
    Ok(outcome)
}
