//! The VMM's handle on a running vCPU: commands to its thread (pause, resume, capture,
//! results), kicks out of guest mode, and its stop.

use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

use clone::vcpu::CaptureSpec;
use clone::VcpuState;

use super::{kick_signal, Command, ImmediateExit, Reply, Vcpu, VcpuError};
use crate::kept::KeptThread;

/// The VMM's handle on a running vCPU thread.
pub struct VcpuHandle {
    pub(super) id: u8,
    /// The thread running the vCPU, and where the vCPU comes back when its run ends.
    pub(super) thread: Option<(KeptThread, Receiver<Vcpu>)>,
    pub(super) cmd_tx: Sender<Command>,
    pub(super) reply_rx: Receiver<Reply>,
    pub(super) immediate_exit: ImmediateExit,
    /// Host address of this vCPU's kvm_run mapping.
    pub(super) run_base: usize,
    /// The thread's id (0 until it runs).
    pub(super) tid: Arc<AtomicI32>,
    /// The thread's CPU time when this run began, in ns (`u64::MAX` until it begins): a
    /// kept thread ran other runs before it (a warm clone's prime, a rewound clone's
    /// earlier lives).
    pub(super) cpu_at_start: Arc<AtomicU64>,
}

const REPLY_TIMEOUT: Duration = Duration::from_secs(5);
/// How often a pause kicks a vCPU that has not parked yet.
const PAUSE_KICK_INTERVAL: Duration = Duration::from_millis(1);

impl VcpuHandle {
    /// The vCPU index.
    pub fn id(&self) -> u8 {
        self.id
    }

    fn kick(&self) {
        // Once taken back, the Vcpu (and its kvm_run mapping) is gone: nothing to kick.
        if let Some((t, _)) = &self.thread {
            self.immediate_exit.set();
            // The run may have ended already; then there is nothing to interrupt.
            t.kill(kick_signal());
        }
    }

    fn reply(&self, what: &'static str) -> Result<Reply, VcpuError> {
        self.reply_rx
            .recv_timeout(REPLY_TIMEOUT)
            .map_err(|e| match e {
                RecvTimeoutError::Disconnected => VcpuError::Gone(self.id),
                RecvTimeoutError::Timeout => VcpuError::Timeout {
                    id: self.id,
                    what,
                    ms: REPLY_TIMEOUT.as_millis() as u64,
                },
            })
    }

    fn send(&self, cmd: Command) -> Result<(), VcpuError> {
        self.cmd_tx.send(cmd).map_err(|_| VcpuError::Gone(self.id))
    }

    /// Stops the vCPU out of guest mode and waits until it is parked (kicking it again
    /// while it runs on through a deferred pause, `Vcpu::handle_kick`).
    pub fn pause(&self) -> Result<(), VcpuError> {
        self.send(Command::Pause)?;
        let start = Instant::now();
        loop {
            self.kick();
            match self.reply_rx.recv_timeout(PAUSE_KICK_INTERVAL) {
                Ok(Reply::Paused) => return Ok(()),
                Ok(_) | Err(RecvTimeoutError::Disconnected) => {
                    return Err(VcpuError::Gone(self.id))
                }
                Err(RecvTimeoutError::Timeout) if start.elapsed() >= REPLY_TIMEOUT => {
                    return Err(VcpuError::Timeout {
                        id: self.id,
                        what: "pause",
                        ms: REPLY_TIMEOUT.as_millis() as u64,
                    })
                }
                Err(RecvTimeoutError::Timeout) => {}
            }
        }
    }

    /// Lets a paused vCPU run again.
    pub fn resume(&self) -> Result<(), VcpuError> {
        self.send(Command::Resume)?;
        match self.reply("resume")? {
            Reply::Resumed => Ok(()),
            _ => Err(VcpuError::Gone(self.id)),
        }
    }

    /// Asks the (paused) vCPU thread to read its state; collect it with
    /// [`VcpuHandle::collect_capture`]. Lets every vCPU capture at once.
    pub fn request_capture(&self, spec: Arc<CaptureSpec>) -> Result<(), VcpuError> {
        self.send(Command::Capture(spec))
    }

    /// The state asked for by [`VcpuHandle::request_capture`], and the MSRs that could
    /// not be read.
    pub fn collect_capture(&self) -> Result<(VcpuState, Vec<u32>), VcpuError> {
        match self.reply("capture")? {
            Reply::Captured(Ok((state, skipped))) => Ok((*state, skipped)),
            Reply::Captured(Err(msg)) => Err(VcpuError::Capture { id: self.id, msg }),
            _ => Err(VcpuError::Gone(self.id)),
        }
    }

    /// Sets the (paused) vCPU's RAX: the result of its clone-port read.
    pub fn set_rax(&self, value: u64) -> Result<(), VcpuError> {
        self.set_result(value, 0)
    }

    /// Sets the (paused) vCPU's RAX and defers a timer interrupt due within `defer_ns`
    /// to then (`clone::timer`): a request's handler runs before the kernel catches up.
    pub fn set_result(&self, value: u64, defer_ns: u64) -> Result<(), VcpuError> {
        self.send(Command::SetRax(value, defer_ns))?;
        match self.reply("set rax")? {
            Reply::RaxSet(Ok(())) => Ok(()),
            Reply::RaxSet(Err(msg)) => Err(VcpuError::Capture { id: self.id, msg }),
            _ => Err(VcpuError::Gone(self.id)),
        }
    }

    /// Re-times a deferred timer interrupt due within `within_ns` to `ns` from now,
    /// the vCPU running or not (`clone::timer::retime_live`, on the vCPU's thread after
    /// a kick; no answer).
    pub fn retime_timer(&self, ns: u64, within_ns: u64) -> Result<(), VcpuError> {
        self.send(Command::Retime(ns, within_ns))?;
        self.kick();
        Ok(())
    }

    /// The vCPU thread's id; None before it starts.
    pub fn thread_id(&self) -> Option<i32> {
        Some(self.tid.load(Ordering::Relaxed)).filter(|&tid| tid != 0)
    }

    /// The thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`) when this run began, in ns;
    /// None before it begins.
    pub fn cpu_at_start_ns(&self) -> Option<u64> {
        Some(self.cpu_at_start.load(Ordering::Acquire)).filter(|&ns| ns != u64::MAX)
    }

    /// Host address of this vCPU's kvm_run mapping (a forked child unmaps it).
    pub fn kvm_run_base(&self) -> usize {
        self.run_base
    }

    /// Stops the vCPU's run and gives the vCPU back with its thread, idle (a rewound
    /// clone runs it again on the same thread); None if it was stopped already or its
    /// thread panicked.
    pub fn into_vcpu(mut self) -> Option<Vcpu> {
        let _ = self.cmd_tx.send(Command::Stop);
        self.kick();
        let (thread, done) = self.thread.take()?;
        let mut vcpu = done.recv().ok()?;
        vcpu.thread = Some(thread);
        Some(vcpu)
    }

    /// Stops the vCPU's run and its thread, and waits for both. Idempotent.
    pub fn stop(&mut self) {
        if self.thread.is_none() {
            return;
        }
        let _ = self.cmd_tx.send(Command::Stop);
        self.kick();
        if let Some((thread, done)) = self.thread.take() {
            // The vCPU first (its kvm_run mapping), then the thread (joined on drop).
            drop(done.recv());
            drop(thread);
        }
    }
}

impl Drop for VcpuHandle {
    fn drop(&mut self) {
        self.stop();
    }
}
