//! Every VMM process this library starts is forked by one thread the library owns,
//! which lives as long as the process. A VMM is started with `PR_SET_PDEATHSIG`, so
//! that a scheduler that is killed leaves none behind; but the kernel sends that signal
//! when the *thread* that forked the child ends, not the process, and tokio promises
//! nothing about how long any of its threads live (a blocking-pool thread ends after
//! ten idle seconds, a `current_thread` runtime's thread is whichever thread called
//! `block_on`). Forked from here, a VMM lives until the scheduler's process ends.

use std::process::{Child, Command};
use std::sync::mpsc;
use std::sync::{Mutex, OnceLock};

use tokio::sync::oneshot;

/// A command to start, and where its child goes.
type Job = (Command, oneshot::Sender<std::io::Result<Child>>);

/// The spawner thread's queue (started on first use).
fn queue() -> std::io::Result<&'static Mutex<mpsc::Sender<Job>>> {
    static QUEUE: OnceLock<Mutex<mpsc::Sender<Job>>> = OnceLock::new();
    if let Some(q) = QUEUE.get() {
        return Ok(q);
    }
    let (tx, rx) = mpsc::channel::<Job>();
    let started = std::thread::Builder::new()
        .name("forkvm-spawner".into())
        .spawn(move || {
            // Ends only when every sender is gone: never, the queue is static.
            for (mut cmd, reply) in rx {
                let _ = reply.send(cmd.spawn());
            }
        });
    match started {
        // Another caller may have won the race: its thread serves, this one ends with
        // its queue.
        Ok(_) => Ok(QUEUE.get_or_init(|| Mutex::new(tx))),
        Err(e) => Err(e),
    }
}

/// Starts `cmd` from the spawner thread.
pub(crate) async fn spawn(cmd: Command) -> std::io::Result<Child> {
    let (reply, child) = oneshot::channel();
    queue()?
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .send((cmd, reply))
        .map_err(|_| std::io::Error::other("the VMM spawner thread is gone"))?;
    child
        .await
        .map_err(|_| std::io::Error::other("the VMM spawner thread is gone"))?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::process::CommandExt;
    use std::time::Duration;

    /// `sleep 30`, killed when the thread that forked it ends.
    fn sleeper() -> Command {
        let mut cmd = Command::new("sleep");
        cmd.arg("30");
        // SAFETY: prctl is async-signal-safe and touches nothing of the parent's.
        unsafe {
            cmd.pre_exec(|| {
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
                Ok(())
            });
        }
        cmd
    }

    #[test]
    fn a_child_outlives_the_thread_that_asked_for_it() {
        // Asked for from a thread that then ends, as a `current_thread` runtime's or a
        // blocking-pool thread may: forked by that thread, the child would get SIGKILL.
        let mut child = std::thread::spawn(|| {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .unwrap();
            rt.block_on(spawn(sleeper())).unwrap()
        })
        .join()
        .unwrap();
        // Nothing to poll for: the signal, if it came, comes as the thread ends.
        std::thread::sleep(Duration::from_millis(300));
        let status = child.try_wait().unwrap();
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(
            status, None,
            "the child died with the thread that asked for it"
        );
    }

    #[test]
    fn a_child_forked_by_a_thread_that_ends_dies_with_it() {
        // The control: the same child forked by the short-lived thread itself.
        let mut child = std::thread::spawn(|| sleeper().spawn().unwrap())
            .join()
            .unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        let mut status = None;
        while status.is_none() && std::time::Instant::now() < deadline {
            status = child.try_wait().unwrap();
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
        assert!(
            status.is_some(),
            "PR_SET_PDEATHSIG did not fire when the thread ended"
        );
    }
}
