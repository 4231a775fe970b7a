//! A ready template: a `vmm` process this library started and owns.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use api_types::{InvokeOptions, Outcome, VmInfo, VmState};
use bytes::Bytes;
use tokio::process::{Child, Command};

use crate::http::{exchange, Answer};
use crate::Error;

/// How to start a template: the guest and the `vmm run` options.
#[derive(Debug, Clone)]
pub struct TemplateSpec {
    /// The `vmm` program (default: `$FORKVM_VMM`, else `vmm` beside the current
    /// executable if there is one, else `vmm` from `PATH`).
    pub vmm: PathBuf,
    /// The guest kernel (or the tiny guest's ELF).
    pub kernel: PathBuf,
    /// An initramfs.
    pub initrd: Option<PathBuf>,
    /// A root disk image (read-only for the template's clones' sake: they share it).
    pub rootfs: Option<PathBuf>,
    /// The guest's command line (`vmm run --cmdline`).
    pub cmdline: Option<String>,
    /// Guest memory in MiB.
    pub mem_mib: u32,
    /// Warm clones kept ready.
    pub warm_clones: u32,
    /// Further `vmm run` options (`--vcpus 2`, `--cgroup-class ...`).
    pub args: Vec<String>,
    /// How long the guest may take until its runtime waits for requests.
    pub start_timeout: Duration,
    /// How long each call to the VMM may take (an invocation: its own timeout plus
    /// this).
    pub call_timeout: Duration,
}

impl TemplateSpec {
    /// A template of `kernel` with the defaults: 256 MiB, 4 warm clones, 5 minutes to
    /// start (a Linux guest that imports packages takes a while on a slow host), 10 s
    /// per call.
    pub fn new(kernel: impl Into<PathBuf>) -> Self {
        Self {
            vmm: default_vmm(),
            kernel: kernel.into(),
            initrd: None,
            rootfs: None,
            cmdline: None,
            mem_mib: 256,
            warm_clones: 4,
            args: Vec::new(),
            start_timeout: Duration::from_secs(300),
            call_timeout: Duration::from_secs(10),
        }
    }
}

fn default_vmm() -> PathBuf {
    if let Some(p) = std::env::var_os("FORKVM_VMM") {
        return p.into();
    }
    let beside = std::env::current_exe()
        .ok()
        .and_then(|e| Some(e.parent()?.join("vmm")));
    beside
        .filter(|p| p.is_file())
        .unwrap_or_else(|| "vmm".into())
}

/// What a handler replied, and what it cost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// The handler's reply.
    pub body: Bytes,
    /// The clone that ran it.
    pub clone_id: String,
    /// Its control socket (a keep-alive clone takes further requests there).
    pub socket: PathBuf,
    /// Microseconds from the request's arrival to the clone running with it.
    pub clone_us: u64,
    /// Microseconds the handler took.
    pub handler_us: u64,
    /// Microseconds from the request's arrival to the reply.
    pub total_us: u64,
    /// Whether a primed warm clone served it.
    pub primed: bool,
}

/// A ready template: a `vmm run --template` process whose runtime waits for requests.
/// Dropping it kills the VMM (its clones die with it) and removes its files; the VMM
/// also dies if the thread that started it ends (`PR_SET_PDEATHSIG`), so a scheduler
/// that is killed leaves no VMM behind.
#[derive(Debug)]
pub struct Template {
    child: Child,
    dir: tempfile::TempDir,
    sock: PathBuf,
    call_timeout: Duration,
}

impl Template {
    /// Starts the VMM and waits until its runtime waits for requests (the template
    /// paused there), within `spec.start_timeout`.
    pub async fn start(spec: TemplateSpec) -> Result<Self, Error> {
        let dir = tempfile::Builder::new()
            .prefix("forkvm-template-")
            .tempdir()
            .map_err(Error::Files)?;
        let sock = dir.path().join("api.sock");
        let mut cmd = Command::new(&spec.vmm);
        cmd.arg("run").arg("--kernel").arg(&spec.kernel);
        if let Some(i) = &spec.initrd {
            cmd.arg("--initrd").arg(i);
        }
        if let Some(r) = &spec.rootfs {
            cmd.arg("--rootfs").arg(r);
        }
        if let Some(c) = &spec.cmdline {
            cmd.arg("--cmdline").arg(c);
        }
        cmd.arg("--mem-mib").arg(spec.mem_mib.to_string());
        cmd.arg("--warm-clones").arg(spec.warm_clones.to_string());
        cmd.arg("--template").arg("--api-sock").arg(&sock);
        cmd.arg("--console").arg(dir.path().join("console"));
        cmd.args(&spec.args);
        cmd.stdin(Stdio::null()).stdout(Stdio::null());
        cmd.stderr(std::fs::File::create(dir.path().join("stderr")).map_err(Error::Files)?);
        cmd.kill_on_drop(true);
        // SAFETY: prctl is async-signal-safe and touches nothing of the parent's.
        unsafe {
            cmd.pre_exec(|| {
                match libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                }
            });
        }
        let child = cmd.spawn().map_err(|source| Error::Spawn {
            program: spec.vmm.clone(),
            source,
        })?;
        let mut t = Self {
            child,
            dir,
            sock,
            call_timeout: spec.call_timeout,
        };
        let ready = tokio::time::timeout(spec.start_timeout, t.wait_ready()).await;
        match ready {
            Ok(r) => r.map(|()| t),
            Err(_) => Err(Error::Timeout {
                what: "the template's start",
                after: spec.start_timeout,
            }),
        }
    }

    async fn wait_ready(&mut self) -> Result<(), Error> {
        loop {
            if let Some(status) = self.child.try_wait().map_err(Error::Files)? {
                return Err(self.exited(status));
            }
            // Until the socket is up, connecting fails: poll.
            if let Ok(info) = self.status().await {
                if info.invoke.waiting && info.state == VmState::Paused {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn exited(&self, status: std::process::ExitStatus) -> Error {
        Error::Exited {
            status: status.to_string(),
            console: self.console_tail(),
        }
    }

    /// The template's control socket.
    pub fn socket(&self) -> &Path {
        &self.sock
    }

    /// The VMM's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// The last 2 KiB of the template's console.
    pub fn console_tail(&self) -> String {
        let text = std::fs::read(self.dir.path().join("console")).unwrap_or_default();
        let from = text.len().saturating_sub(2048);
        String::from_utf8_lossy(&text[from..]).into_owned()
    }

    /// What the VMM's standard error says (its log).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("stderr")).unwrap_or_default()
    }

    /// `GET /vm`: the template's state and figures.
    pub async fn status(&self) -> Result<VmInfo, Error> {
        let a = self
            .call("GET", "/vm", Bytes::new(), self.call_timeout)
            .await?;
        match a.status {
            200 => serde_json::from_slice(&a.body).map_err(|e| Error::Protocol(e.to_string())),
            _ => Err(refusal(&a)),
        }
    }

    /// Runs `payload` through the handler in a fresh clone (`POST /invocations`).
    /// Dropping the future closes the connection: the clone still ends on its own
    /// once its handler replies or its timeout passes.
    pub async fn invoke(
        &self,
        payload: impl Into<Bytes>,
        options: &InvokeOptions,
    ) -> Result<Reply, Error> {
        let query =
            serde_urlencoded::to_string(options).map_err(|e| Error::Protocol(e.to_string()))?;
        let path = match query.is_empty() {
            true => "/invocations".to_string(),
            false => format!("/invocations?{query}"),
        };
        let limit = Duration::from_millis(options.timeout_ms()) + self.call_timeout;
        let a = self.call("POST", &path, payload.into(), limit).await?;
        answer(a)
    }

    /// Stops the VMM (`PUT /actions` shutdown: its clones are stopped first) and waits
    /// for it to exit; kills it past the call timeout.
    pub async fn shutdown(mut self) -> Result<(), Error> {
        let body = Bytes::from_static(br#"{"action_type":"shutdown"}"#);
        let asked = self.call("PUT", "/actions", body, self.call_timeout).await;
        let waited = tokio::time::timeout(self.call_timeout, self.child.wait()).await;
        if !matches!(waited, Ok(Ok(_))) {
            let _ = self.child.kill().await;
        }
        asked.map(|_| ())
    }

    async fn call(
        &self,
        method: &str,
        path: &str,
        body: Bytes,
        limit: Duration,
    ) -> Result<Answer, Error> {
        match tokio::time::timeout(limit, exchange(&self.sock, method, path, body)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: "a call to the VMM",
                after: limit,
            }),
        }
    }
}

impl Drop for Template {
    /// Stops the VMM if it still runs: SIGTERM (it shuts down as on `PUT /actions`:
    /// its clones stopped, its cgroups given back), waiting up to 2 s, then SIGKILL.
    /// This blocks the calling thread for that long at most.
    fn drop(&mut self) {
        let Some(pid) = self.child.id() else { return };
        // SAFETY: signals a process this handle owns and has not reaped (id() is Some).
        unsafe { libc::kill(pid as libc::pid_t, libc::SIGTERM) };
        for _ in 0..200 {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = self.child.start_kill();
    }
}

/// An error answer without an outcome: the caller's (4xx) or the host's (5xx).
fn refusal(a: &Answer) -> Error {
    let message = a.error_text();
    match a.status {
        400..=499 => Error::Refused {
            status: a.status,
            message,
        },
        status => Error::Unavailable { status, message },
    }
}

/// The reply, or the error, of an invocation's answer.
fn answer(a: Answer) -> Result<Reply, Error> {
    let outcome = a
        .header(api_types::invoke::HEADER_OUTCOME)
        .map(str::parse::<Outcome>);
    let us = |h| a.header(h).and_then(|v| v.parse().ok()).unwrap_or(0);
    match outcome {
        Some(Ok(Outcome::Ok)) if a.status == 200 => Ok(Reply {
            clone_id: a
                .header(api_types::invoke::HEADER_CLONE_ID)
                .unwrap_or("")
                .into(),
            socket: a
                .header(api_types::invoke::HEADER_SOCKET)
                .unwrap_or("")
                .into(),
            clone_us: us(api_types::invoke::HEADER_CLONE_US),
            handler_us: us(api_types::invoke::HEADER_HANDLER_US),
            total_us: us(api_types::invoke::HEADER_TOTAL_US),
            primed: a.header(api_types::invoke::HEADER_PRIMED) == Some("true"),
            body: a.body,
        }),
        Some(Ok(outcome)) => Err(Error::Invocation {
            outcome,
            status: a.status,
            message: a.error_text(),
        }),
        Some(Err(e)) => Err(Error::Protocol(e)),
        None => Err(refusal(&a)),
    }
}
