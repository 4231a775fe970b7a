//! Threads kept between runs: a vCPU's, kept with its `Vcpu` (`vstate::vcpu`)
//! (a warm clone's prime and its run after the launch, and a rewound clone's every
//! life, `cloning/rewind.rs`, take the same thread instead of a new one each), and a
//! rewound clone's API thread, from one life's control socket to the next.
//!
//! Starting a thread costs its stack's mapping and, under seccomp, its filter's
//! installation, which the host kernel compiles anew for each thread (its BPF JIT):
//! the vCPU's and the API thread's were about 7% of the host CPU a rewound tiny-guest
//! invocation took (perf, this project's PVM host). A kept thread has its filter from
//! its first job on (`sandbox::enter` does nothing for a thread that has its
//! kind's filter already).

use std::sync::mpsc::{channel, Sender};
use std::thread::JoinHandle;

use vmm_sys_util::signal::Killable;

/// Work for a kept thread: it runs one after another.
type Job = Box<dyn FnOnce() + Send>;

/// A thread that runs a vCPU's jobs one after another, idle between them; joined when
/// dropped (after the job it runs, if any, returned).
pub struct KeptThread {
    jobs: Option<Sender<Job>>,
    handle: Option<JoinHandle<()>>,
}

impl KeptThread {
    /// Starts a thread named `name`, idle until it is given a job.
    pub fn spawn(name: String) -> std::io::Result<Self> {
        let (jobs, rx) = channel::<Job>();
        let handle = std::thread::Builder::new().name(name).spawn(move || {
            while let Ok(job) = rx.recv() {
                job();
            }
        })?;
        Ok(Self {
            jobs: Some(jobs),
            handle: Some(handle),
        })
    }

    /// Gives the thread `job`; false if the thread is gone (a job of it panicked).
    pub fn run(&self, job: impl FnOnce() + Send + 'static) -> bool {
        (self.jobs.as_ref()).is_some_and(|j| j.send(Box::new(job)).is_ok())
    }

    /// Sends signal `sig` to the thread (a kick: it interrupts a KVM_RUN; an idle
    /// thread's handler does nothing). Nothing if the thread ended.
    pub fn kill(&self, sig: i32) {
        if let Some(h) = &self.handle {
            if !h.is_finished() {
                let _ = h.kill(sig);
            }
        }
    }
}

impl Drop for KeptThread {
    fn drop(&mut self) {
        // No more jobs: the thread ends once its current one (if any) returned.
        drop(self.jobs.take());
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn jobs_run_one_after_another_on_the_same_thread_until_it_is_dropped() {
        let t = KeptThread::spawn("kept-test".into()).unwrap();
        let (tx, rx) = channel();
        for i in 0..3 {
            let tx = tx.clone();
            assert!(t.run(move || {
                // SAFETY: gettid has no arguments and cannot fail.
                let tid = unsafe { libc::gettid() };
                tx.send((i, tid)).unwrap();
            }));
        }
        let got: Vec<(i32, i32)> = (0..3).map(|_| rx.recv().unwrap()).collect();
        assert_eq!(got.iter().map(|g| g.0).collect::<Vec<_>>(), [0, 1, 2]);
        assert!(got.iter().all(|g| g.1 == got[0].1), "{got:?}");
        drop(t);
        // Dropped: joined, so the jobs' senders are gone with them.
        drop(tx);
        assert!(rx.recv().is_err());
    }

    #[test]
    fn a_thread_whose_job_panicked_takes_no_more() {
        let t = KeptThread::spawn("kept-panic".into()).unwrap();
        assert!(t.run(|| panic!("a job that panics (expected in this test)")));
        let start = std::time::Instant::now();
        while t.run(|| {}) {
            assert!(start.elapsed() < std::time::Duration::from_secs(5));
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
    }
}
