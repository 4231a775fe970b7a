//! The VMM core's typed interface: the actions it takes ([`VmmAction`]), what it answers
//! ([`VmmData`]) and why it refuses ([`VmmActionError`]), and the queue that carries
//! them from the API thread to the event loop.
//!
//! The API edge (`api/`) turns an HTTP request into an action and an answer into
//! a status and a body; the controller (`controller.rs`) handles the actions on the
//! event loop. Neither side sees the other's types: no HTTP here, no KVM in the answers
//! (they are `api_types`).
//!
//! The API thread learns of its answer through an eventfd it polls ([`ActionSender::
//! send_waking`]) and takes it from the [`Reply`]; a caller may also block on the reply
//! (without allocating: a channel's receiver allocates as it starts to wait, and no
//! thread may be inside malloc while a clone may be forked, see `crate::gate`).

use std::sync::mpsc::{Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use api_types::{CloneInfo, CloneList, CreateClones, TargetState, VmInfo};
use vmm_sys_util::eventfd::{EventFd, EFD_NONBLOCK};

use crate::cloning::CloneError;
use crate::invoke::{Invocation, InvokeError};
use crate::microvm::StateError;

/// What the VMM core can be asked to do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VmmAction {
    /// Describe the VM (`GET /vm`).
    DescribeVm,
    /// Pause or resume (`PATCH /vm`).
    SetState(TargetState),
    /// Stop the VM; the VMM exits (`PUT /actions` shutdown).
    Shutdown,
    /// Make clones (`POST /clones`); `received_ns` is when the request arrived
    /// (CLOCK_MONOTONIC), for the latency figures.
    CreateClones {
        /// What to make.
        request: Box<CreateClones>,
        /// Arrival time.
        received_ns: u64,
    },
    /// List the clones (`GET /clones`).
    ListClones,
    /// Stop one clone (`DELETE /clones/{id}`).
    DeleteClone(String),
    /// Run an invocation (`POST /invocations`): in a clone of a template, or in place.
    /// The VM that runs it answers on its connection.
    Invoke(Box<Invocation>),
    /// Write a snapshot of the paused VM to this new directory (`PUT /snapshot`).
    Snapshot(std::path::PathBuf),
    /// Put an image into an empty disk slot of the VM (`PUT /slots/{k}`).
    InsertMedium(api_types::InsertMedium),
    /// Take the image out of a disk slot (`DELETE /slots/{k}`).
    EjectMedium(u8),
}

/// What the VMM core answers.
#[derive(Debug, Clone, PartialEq)]
pub enum VmmData {
    /// Done; nothing to report.
    Empty,
    /// The VM's description.
    Vm(Box<VmInfo>),
    /// The clones just made.
    CreatedClones(CloneList),
    /// Every clone.
    Clones(CloneList),
    /// One clone, as it ended.
    Clone(Box<CloneInfo>),
    /// The invocation is on its way; the VM that runs it answers the caller.
    Invoked,
    /// The snapshot just written.
    Snapshot(Box<api_types::SnapshotInfo>),
}

/// Why the VMM core refused or failed an action, per operation.
#[derive(Debug, thiserror::Error)]
pub enum VmmActionError {
    /// Pausing or resuming failed.
    #[error(transparent)]
    SetState(#[from] StateError),
    /// Making clones failed (the VM goes on as before).
    #[error(transparent)]
    CreateClones(#[from] CloneError),
    /// The invocation was refused before it reached a runtime.
    #[error(transparent)]
    Invoke(#[from] InvokeError),
    /// The snapshot was refused or failed (the VM goes on as before).
    #[error(transparent)]
    Snapshot(#[from] crate::snapshot::SnapshotError),
    /// A disk slot did not take or give up its medium (it is as it was).
    #[error(transparent)]
    Slot(#[from] crate::device_manager::SlotChangeError),
    /// No live clone has this id.
    #[error("no running clone with id {0:?}")]
    NoSuchClone(String),
    /// The VMM stopped before it took the action.
    #[error("the VMM is shutting down")]
    ShuttingDown,
}

/// The answer to one action.
pub type VmmResponse = Result<VmmData, VmmActionError>;

/// Where one answer is left, how a thread blocked on it is woken, and the eventfd, if
/// any, written once it is there.
struct SlotInner {
    answer: Mutex<Option<VmmResponse>>,
    ready: Condvar,
    waker: Option<Arc<EventFd>>,
}

type Slot = Arc<SlotInner>;

/// The queue's sending side, for the API thread.
pub struct ActionSender {
    tx: Sender<(VmmAction, Replier)>,
    evt: EventFd,
}

/// The queue's receiving side, for the event loop: its eventfd is written once per
/// action queued.
pub struct ActionReceiver {
    rx: Receiver<(VmmAction, Replier)>,
    evt: EventFd,
}

/// A new action queue.
pub fn channel() -> std::io::Result<(ActionSender, ActionReceiver)> {
    let evt = EventFd::new(EFD_NONBLOCK)?;
    let (tx, rx) = std::sync::mpsc::channel();
    Ok((
        ActionSender {
            tx,
            evt: evt.try_clone()?,
        },
        ActionReceiver { rx, evt },
    ))
}

impl ActionSender {
    /// Queues `action` and wakes the event loop; wait for the answer on the [`Reply`].
    /// An action the VMM no longer takes (it stopped) is answered at once.
    pub fn send(&self, action: VmmAction) -> Reply {
        self.queue(action, None)
    }

    /// As [`Self::send`], and `waker` is written once the answer is there.
    pub fn send_waking(&self, action: VmmAction, waker: &Arc<EventFd>) -> Reply {
        self.queue(action, Some(waker.clone()))
    }

    fn queue(&self, action: VmmAction, waker: Option<Arc<EventFd>>) -> Reply {
        let slot: Slot = Arc::new(SlotInner {
            answer: Mutex::new(None),
            ready: Condvar::new(),
            waker,
        });
        // Not queued (the VMM is stopping): the Replier, dropped with the error,
        // answered.
        if self.tx.send((action, Replier(slot.clone()))).is_ok() {
            let _ = self.evt.write(1);
        }
        Reply(slot)
    }
}

impl ActionReceiver {
    /// Written once per action queued.
    pub fn evt(&self) -> &EventFd {
        &self.evt
    }

    /// The next queued action, if any.
    pub fn try_recv(&self) -> Option<(VmmAction, Replier)> {
        self.rx.try_recv().ok()
    }
}

/// Where the VMM leaves its answer to one action.
pub struct Replier(Slot);

impl Replier {
    /// Hands the answer to the waiting API thread (dropped if it gave up waiting); the
    /// thread is woken as `self` drops.
    pub fn send(self, response: VmmResponse) {
        *self.0.answer.lock().unwrap_or_else(|p| p.into_inner()) = Some(response);
    }
}

impl Drop for Replier {
    /// Wakes the waiting API thread. An action dropped unanswered (the VMM stopped with
    /// it queued, or it could not be queued) is answered at once, so its client and the
    /// API thread do not wait out their timeout.
    fn drop(&mut self) {
        let slot = &*self.0;
        let mut answer = slot.answer.lock().unwrap_or_else(|p| p.into_inner());
        if answer.is_none() {
            *answer = Some(Err(VmmActionError::ShuttingDown));
        }
        drop(answer);
        slot.ready.notify_one();
        if let Some(waker) = &slot.waker {
            let _ = waker.write(1);
        }
    }
}

/// The API thread's end of one action: the answer, once the VMM gives it.
pub struct Reply(Slot);

impl Reply {
    /// Waits up to `timeout` for the answer (without allocating); None on timeout.
    pub fn wait(&self, timeout: Duration) -> Option<VmmResponse> {
        let slot = &*self.0;
        let guard = slot.answer.lock().unwrap_or_else(|p| p.into_inner());
        (slot.ready)
            .wait_timeout_while(guard, timeout, |a| a.is_none())
            .unwrap_or_else(|p| p.into_inner())
            .0
            .take()
    }

    /// The answer, if it is there (without waiting).
    pub fn try_take(&self) -> Option<VmmResponse> {
        self.0
            .answer
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answered_by(answer: impl FnOnce(Replier) + Send + 'static) -> Option<VmmResponse> {
        let (tx, rx) = channel().unwrap();
        let vmm = std::thread::spawn(move || {
            while rx.evt().read().is_err() {
                std::thread::sleep(Duration::from_millis(1));
            }
            let (_action, replier) = rx.try_recv().unwrap();
            answer(replier);
        });
        let reply = tx.send(VmmAction::DescribeVm).wait(Duration::from_secs(10));
        vmm.join().unwrap();
        reply
    }

    #[test]
    fn an_answer_reaches_the_waiting_thread() {
        let reply = answered_by(|r| {
            std::thread::sleep(Duration::from_millis(20));
            r.send(Ok(VmmData::Empty));
        });
        assert!(matches!(reply, Some(Ok(VmmData::Empty))));
    }

    #[test]
    fn an_action_dropped_unanswered_is_refused_not_timed_out() {
        let reply = answered_by(drop);
        assert!(matches!(reply, Some(Err(VmmActionError::ShuttingDown))));
    }

    #[test]
    fn an_action_the_vmm_no_longer_takes_is_refused_at_once() {
        let (tx, rx) = channel().unwrap();
        let evt = rx.evt().try_clone().unwrap();
        drop(rx);
        let reply = tx.send(VmmAction::ListClones).wait(Duration::from_secs(10));
        assert!(matches!(reply, Some(Err(VmmActionError::ShuttingDown))));
        // Nothing was queued, so nothing was signalled.
        assert!(evt.read().is_err());
    }

    #[test]
    fn a_queued_action_is_refused_when_the_queue_goes() {
        let (tx, rx) = channel().unwrap();
        let reply = tx.send(VmmAction::ListClones);
        drop(rx);
        assert!(matches!(
            reply.wait(Duration::from_secs(10)),
            Some(Err(VmmActionError::ShuttingDown))
        ));
    }
}
