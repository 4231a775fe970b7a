//! Priming: a warm clone's runtime vCPU runs the runtime's serving path once, with a
//! prime request, before the clone has devices or an identity (`cloning::prime`).
//!
//! The vCPU runs on its thread (the one it runs on after its launch: `crate::kept`;
//! under the vCPU seccomp filter, as any vCPU thread) until the runtime has replied and reads the invoke port again; anything
//! else it does (another port, MMIO, a halt, a shutdown) ends the prime, and so does
//! the time limit (the waiting thread kicks it). A failed prime leaves the vCPU
//! somewhere in the guest: the caller discards the clone.

use std::sync::mpsc::{channel, RecvTimeoutError};
use std::time::Duration;

use devices::control::{ControlPorts, ControlRequest};
use kvm_ioctls::VcpuExit;

use super::{install_kick_handler, kick_signal, ImmediateExit, Vcpu, VcpuError};

/// Why a prime failed.
#[derive(Debug, thiserror::Error)]
pub enum PrimeError {
    /// The runtime did something else than answer and wait again.
    #[error("the runtime left its serving path: {0}")]
    Left(String),
    /// It did not wait again in time.
    #[error("the runtime did not wait again within {0} ms")]
    Timeout(u64),
    /// KVM_RUN failed.
    #[error("KVM_RUN failed: {0}")]
    Run(kvm_ioctls::Error),
    /// The seccomp filter could not be installed on the thread.
    #[error("cannot sandbox the prime thread: {0}")]
    Sandbox(String),
    /// The thread could not be started, or ended in a panic.
    #[error(transparent)]
    Vcpu(#[from] VcpuError),
}

impl Vcpu {
    /// Runs this vCPU, whose runtime's invoke-port read has a prime request's length as
    /// its result, until the runtime has replied and waits again (its read completed,
    /// nothing in flight: its state can be saved), for at most `limit`. `check` judges
    /// the reply when the runtime writes its length (an error ends the prime). Returns
    /// the vCPU then; on failure it is gone (the clone is to be discarded).
    pub fn prime<F>(mut self, limit: Duration, check: F) -> Result<Self, PrimeError>
    where
        F: FnOnce(u32) -> Result<(), String> + Send + 'static,
    {
        install_kick_handler()?;
        let id = self.id;
        let kicker = ImmediateExit::new(&mut self.fd);
        // On the thread the vCPU runs on after its launch (`crate::kept`).
        let thread = self.take_thread()?;
        let (done_tx, done_rx) = channel();
        let job = move || {
            let r = self.run_prime(check);
            let _ = done_tx.send((self, r));
        };
        if !thread.run(job) {
            return Err(VcpuError::Gone(id).into());
        }
        let mut done = done_rx.recv_timeout(limit);
        let timed_out = matches!(done, Err(RecvTimeoutError::Timeout));
        if timed_out {
            kicker.set();
            thread.kill(kick_signal());
            done = done_rx.recv().map_err(|_| RecvTimeoutError::Disconnected);
        }
        let (mut vcpu, r) = done.map_err(|_| VcpuError::Gone(id))?;
        vcpu.fd.set_kvm_immediate_exit(0);
        vcpu.thread = Some(thread);
        match timed_out {
            true => Err(PrimeError::Timeout(limit.as_millis() as u64)),
            false => r.map(|()| vcpu),
        }
    }

    fn run_prime(
        &mut self,
        check: impl FnOnce(u32) -> Result<(), String>,
    ) -> Result<(), PrimeError> {
        let mut filtered = false;
        let mut check = Some(check);
        loop {
            let result = self.fd.run();
            if !filtered {
                crate::sandbox::enter(crate::sandbox::ThreadKind::Vcpu)
                    .map_err(|e| PrimeError::Sandbox(e.to_string()))?;
                filtered = true;
            }
            let left = match result {
                Ok(VcpuExit::IoIn(port, data)) if ControlPorts::decodes(port) => {
                    match self.control.read(port, data) {
                        Some(ControlRequest::Wait) if check.is_none() => break,
                        Some(ControlRequest::Wait) => "waited again without a reply".to_string(),
                        Some(other) => format!("{other:?} through port {port:#x}"),
                        None => continue,
                    }
                }
                Ok(VcpuExit::IoOut(port, data)) if ControlPorts::decodes(port) => {
                    match self.control.write(port, data) {
                        Some(ControlRequest::Reply(len)) => match check.take() {
                            Some(check) => match check(len) {
                                Ok(()) => continue,
                                Err(why) => why,
                            },
                            None => "replied twice".to_string(),
                        },
                        Some(other) => format!("{other:?} through port {port:#x}"),
                        None => continue,
                    }
                }
                // A kick: the waiting thread's, at the time limit.
                Ok(VcpuExit::Intr) => "interrupted".to_string(),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    "interrupted".to_string()
                }
                Ok(other) => format!("{other:?}"),
                Err(e) => return Err(PrimeError::Run(e)),
            };
            return Err(PrimeError::Left(left));
        }
        // Complete the IN (KVM returns at once, the read done) and stop before the
        // runtime's next instruction.
        self.fd.set_kvm_immediate_exit(1);
        match self.fd.run() {
            Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => Ok(()),
            Err(e) => Err(PrimeError::Run(e)),
            Ok(other) => Err(PrimeError::Left(format!("{other:?}"))),
        }
    }
}
