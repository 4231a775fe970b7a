//! A container's processes: the command `forkvm-oci` runs for an OCI process, and one
//! running through the guest agent, its output streamed to containerd's FIFOs as it is
//! written and its end recorded.

use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp;
use forkvm::{AgentControl, AgentOutput, ProcessEvent, StreamMode};
use oci_spec::runtime::Process;
use tokio::fs::File;
use tokio::io::AsyncReadExt;
use tokio::io::AsyncWriteExt;
use tokio::sync::{watch, Mutex, Notify};

/// How a process ended: its status and when.
pub type Exit = Option<(u32, Timestamp)>;

/// One process of a container: its init (the spec's process) or one `exec` started.
pub struct Proc {
    /// What the guest runs for it (an argv).
    pub command: Vec<String>,
    /// containerd's FIFOs for its output (empty: none).
    pub stdout: String,
    pub stderr: String,
    /// containerd's FIFO for its input (empty: none: it reads an empty input).
    pub stdin: String,
    /// Whether it runs on a terminal in the guest (`-t`): its output, both streams,
    /// goes to `stdout`.
    pub terminal: bool,
    /// What its input starts with, before its own: the archive of volumes
    /// `forkvm-oci --unpack` reads (empty: none; never on a terminal).
    pub preamble: Vec<u8>,
    /// Ends its input before its FIFO's writer has (`CloseIO`).
    pub close_stdin: Arc<Notify>,
    /// Its signals, once started (None: not yet, or it could not start).
    pub control: Option<Arc<Mutex<AgentControl>>>,
    /// Whether it was started.
    pub started: bool,
    /// Its end, once known.
    pub exit: watch::Sender<Exit>,
}

impl Proc {
    pub fn new(command: Vec<String>, stdout: &str, stderr: &str) -> Self {
        Self {
            command,
            stdout: stdout.into(),
            stderr: stderr.into(),
            stdin: String::new(),
            terminal: false,
            preamble: Vec::new(),
            close_stdin: Arc::default(),
            control: None,
            started: false,
            exit: watch::channel(None).0,
        }
    }

    /// The same, its input from containerd's FIFO `stdin` (empty: none), on a terminal
    /// when `terminal`.
    pub fn with_input(mut self, stdin: &str, terminal: bool) -> Self {
        self.stdin = stdin.into();
        self.terminal = terminal;
        self
    }

    /// The same, its input starting with `preamble` (the volumes' archive).
    pub fn with_preamble(mut self, preamble: Vec<u8>) -> Self {
        self.preamble = preamble;
        self
    }

    /// How the guest runs it.
    pub fn mode(&self) -> StreamMode {
        StreamMode {
            stdin: !self.stdin.is_empty(),
            tty: self.terminal,
        }
    }

    /// Records that it ended with `status` now, unless its end is known already (the
    /// first of its exit and a kill before it started stands).
    pub fn record_exit(&self, status: u32) {
        record_exit(&self.exit, status);
    }

    /// Its end, if known.
    pub fn exited(&self) -> Exit {
        self.exit.borrow().clone()
    }
}

fn record_exit(exit: &watch::Sender<Exit>, status: u32) {
    exit.send_if_modified(|e| {
        let first = e.is_none();
        if first {
            *e = Some((status, Timestamp::now()));
        }
        first
    });
}

/// The guest argv that runs OCI process `process` on the root file system in disk slot
/// `slot` (`forkvm-oci`, which the agent runs in its own process), setting `hostname`
/// first if given.
pub fn oci_command(
    process: &Process,
    hostname: Option<&str>,
    slot: u8,
) -> Result<Vec<String>, String> {
    let args = process.args().as_ref().filter(|a| !a.is_empty());
    let args = args.ok_or("the spec's process has no args")?;
    let user = process.user();
    let mut argv: Vec<String> = vec![
        "forkvm-oci".into(),
        "--slot".into(),
        slot.to_string(),
        "--cwd".into(),
        process.cwd().display().to_string(),
        "--user".into(),
        format!("{}:{}", user.uid(), user.gid()),
    ];
    if let Some(h) = hostname {
        argv.extend(["--hostname".into(), h.to_string()]);
    }
    for e in process.env().iter().flatten() {
        argv.extend(["--env".into(), e.clone()]);
    }
    argv.push("--".into());
    argv.extend(args.iter().cloned());
    Ok(argv)
}

/// How long the reader of a process's output has to take what was written, before its
/// exit is reported anyway.
const DRAIN: Duration = Duration::from_secs(10);

/// `f` with writes that wait for room again.
fn blocking(f: File) -> std::io::Result<File> {
    // SAFETY: F_SETFL on a descriptor `f` owns, with flags read from it just before.
    let ok = unsafe {
        let flags = libc::fcntl(f.as_raw_fd(), libc::F_GETFL);
        flags >= 0 && libc::fcntl(f.as_raw_fd(), libc::F_SETFL, flags & !libc::O_NONBLOCK) == 0
    };
    match ok {
        true => Ok(f),
        false => Err(std::io::Error::last_os_error()),
    }
}

/// One of containerd's FIFOs, opened for writing when the process starts and closed
/// when it ends: a reader (CRI's exec) waits for both its FIFOs to be opened and
/// closed, whether or not anything was written to them.
struct Fifo {
    path: String,
    file: Option<File>,
    broken: bool,
}

impl Fifo {
    fn new(path: &str) -> Self {
        Self {
            path: path.into(),
            file: None,
            broken: path.is_empty(),
        }
    }

    /// Opens the FIFO for writing, unless it is open, there is none, or it failed.
    async fn open(&mut self) {
        if self.broken || self.file.is_some() {
            return;
        }
        // Without a reader (ctr run -d has gone) the open fails rather than waits, and
        // what the process writes is dropped.
        let open = tokio::fs::OpenOptions::new()
            .write(true)
            .custom_flags(libc::O_NONBLOCK)
            .open(&self.path)
            .await;
        match open.and_then(blocking) {
            Ok(f) => self.file = Some(f),
            Err(e) => {
                log::warn!("{}: {e}", self.path);
                self.broken = true;
            }
        }
    }

    async fn write(&mut self, bytes: &[u8]) {
        self.open().await;
        if let Some(f) = &mut self.file {
            if let Err(e) = f.write_all(bytes).await {
                // The reader went (ctr detached): what follows is dropped.
                log::warn!("{}: {e}", self.path);
                self.broken = true;
                self.file = None;
            }
        }
    }

    /// Waits until the FIFO's reader has taken all that was written (a client, `ctr`,
    /// stops reading as soon as it learns of the exit, and what is still in the FIFO
    /// then is lost), at most [`DRAIN`].
    async fn drain(&self) {
        let Some(f) = &self.file else { return };
        let deadline = tokio::time::Instant::now() + DRAIN;
        loop {
            let mut unread: libc::c_int = 0;
            // SAFETY: FIONREAD writes one int through the pointer, to a local that lives
            // across the call; the descriptor is the open FIFO's.
            let r = unsafe { libc::ioctl(f.as_raw_fd(), libc::FIONREAD, &mut unread) };
            if r != 0 || unread == 0 || tokio::time::Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }
}

/// Forwards a started process's output to its FIFOs `[stdout, stderr]` as it comes,
/// and records its end in `exit` once its readers have taken the output. A process
/// whose agent connection fails ends with 255, the reason on its stderr. The log says
/// when (after `since`) `label`'s first output came and when it ended.
pub async fn forward(
    mut output: AgentOutput,
    [stdout, stderr]: [String; 2],
    exit: watch::Sender<Exit>,
    label: &str,
    since: Instant,
) {
    let (mut out, mut err) = (Fifo::new(&stdout), Fifo::new(&stderr));
    out.open().await;
    err.open().await;
    let mut first = None;
    let status = loop {
        let event = output.next().await;
        first.get_or_insert_with(|| since.elapsed());
        match event {
            Some(Ok(ProcessEvent::Stdout(b))) => out.write(&b).await,
            Some(Ok(ProcessEvent::Stderr(b))) => err.write(&b).await,
            Some(Ok(ProcessEvent::Exit(status))) => break status as u32,
            // An event this shim does not know yet: nothing to pass on.
            Some(Ok(_)) => {}
            Some(Err(e)) => {
                err.write(format!("containerd-shim-forkvm: {e}\n").as_bytes())
                    .await;
                break 255;
            }
            None => break 255,
        }
    };
    out.drain().await;
    err.drain().await;
    log::info!(
        "{label}: started: first output {:.1} ms, exit {:.1} ms, status {status}",
        first.unwrap_or_default().as_secs_f64() * 1e3,
        since.elapsed().as_secs_f64() * 1e3
    );
    record_exit(&exit, status);
}

/// Feeds a started process's input from containerd's FIFO `path` (opening it waits
/// for its writer) until the writer closes it or `close` is notified (`CloseIO`: then
/// after what the FIFO holds), then ends the input. It holds the process's control
/// only while it writes: dropping the control elsewhere still kills the process.
pub async fn feed_stdin(
    path: String,
    control: std::sync::Weak<Mutex<AgentControl>>,
    close: Arc<Notify>,
) {
    let mut opening = tokio::task::spawn_blocking({
        let path = path.clone();
        move || std::fs::File::open(path)
    });
    // `CloseIO` may come while the open still waits, or in the same moment it returns:
    // what the writer left in the FIFO is still read then, up to what is there.
    let mut closing = false;
    let opened = tokio::select! {
        biased;
        opened = &mut opening => opened,
        _ = close.notified() => {
            closing = true;
            // Its open waits for a writer: one that comes and goes lets it return.
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(&path);
            opening.await
        }
    };
    let file = match opened {
        Ok(Ok(f)) => Some(f),
        Ok(Err(e)) => {
            log::warn!("{path}: {e}");
            None
        }
        Err(_) => None,
    };
    if let Some(file) = file {
        // The same open FIFO, read directly once closing (non-blocking, as the
        // receiver makes it): the receiver's readiness may not be known yet then.
        let direct = file.try_clone().ok();
        match tokio::net::unix::pipe::Receiver::from_file(file) {
            Ok(mut fifo) => {
                let mut buf = vec![0u8; 65536];
                loop {
                    let n = match (closing, direct.as_ref()) {
                        // After `CloseIO`: only what is readable now.
                        (true, Some(mut d)) => std::io::Read::read(&mut d, &mut buf).unwrap_or(0),
                        (true, None) => 0,
                        (false, _) => tokio::select! {
                            biased;
                            r = fifo.read(&mut buf) => r.unwrap_or(0),
                            _ = close.notified() => {
                                closing = true;
                                continue;
                            }
                        },
                    };
                    let Some(control) = control.upgrade() else {
                        return;
                    };
                    if n == 0 {
                        break;
                    }
                    if control.lock().await.write_input(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            }
            Err(e) => log::warn!("{path}: {e}"),
        }
    }
    if let Some(control) = control.upgrade() {
        let _ = control.lock().await.close_input().await;
    }
}

/// The guest's processes running on the root file system in slot `slot` of `clone`
/// (their root is its mount point), by their pids in the guest: one `ls` through the
/// agent. An `ls` that died by SIGSEGV runs again, twice at most: on some PVM hosts a
/// guest process starting up can crash for reasons outside forkvm (docs/guest-kernel.md,
/// "Known host problems"); its empty listing would read as no processes.
pub async fn guest_pids(clone: &forkvm::VmClone, slot: u8) -> Result<Vec<u32>, String> {
    const SIGSEGV_STATUS: i32 = 128 + 11;
    let mut tries = 0;
    let out = loop {
        let out = (clone
            .exec(crate::config::AGENT_PORT, "ls -l /proc/*/root", b"")
            .await)
            .map_err(|e| e.to_string())?;
        tries += 1;
        match out.status {
            SIGSEGV_STATUS if tries < 3 => {
                log::warn!("the guest's `ls -l /proc/*/root` died by SIGSEGV; running it again")
            }
            SIGSEGV_STATUS => {
                return Err("the guest's `ls -l /proc/*/root` died by SIGSEGV 3 times".into())
            }
            _ => break out,
        }
    };
    Ok(pids_rooted_at(
        &String::from_utf8_lossy(&out.output),
        &format!("/run/forkvm/rootfs{slot}"),
    ))
}

/// The pids in `ls -l /proc/*/root` output whose link points at `root`.
fn pids_rooted_at(listing: &str, root: &str) -> Vec<u32> {
    let mut pids: Vec<u32> = (listing.lines())
        .filter_map(|l| l.split_once("/proc/")?.1.split_once("/root -> "))
        .filter(|(_, target)| target.trim() == root)
        .filter_map(|(pid, _)| pid.parse().ok())
        .collect();
    pids.sort_unstable();
    pids
}

#[cfg(test)]
mod tests {
    #[test]
    fn pids_are_those_rooted_at_the_containers_file_system() {
        let listing = "lrwxrwxrwx 1 0 0 0 Nov 29 15:00 /proc/1/root -> /\n\
                       lrwxrwxrwx 1 0 0 0 Nov 29 15:00 /proc/77/root -> /run/forkvm/rootfs0\n\
                       lrwxrwxrwx 1 0 0 0 Nov 29 15:00 /proc/78/root -> /run/forkvm/rootfs1\n\
                       lrwxrwxrwx 1 0 0 0 Nov 29 15:00 /proc/9/root -> /run/forkvm/rootfs0\n\
                       ls: /proc/80/root: No such file or directory\n";
        assert_eq!(
            super::pids_rooted_at(listing, "/run/forkvm/rootfs0"),
            vec![9, 77]
        );
        assert_eq!(
            super::pids_rooted_at(listing, "/run/forkvm/rootfs1"),
            vec![78]
        );
        assert!(super::pids_rooted_at("", "/run/forkvm/rootfs0").is_empty());
    }
}
