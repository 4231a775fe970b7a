//! A clone of a template made on request (`POST /clones`): a running VM of its own,
//! which serves invocations in place and commands through its guest agent.

use std::path::{Path, PathBuf};
use std::time::Duration;

use api_types::vm::VirtioKind;
use api_types::{CloneInfo, CloneStatus, CreateClones, InvokeOptions, VmInfo};
use bytes::Bytes;

use crate::agent::{agent_exchange, AgentProcess, StreamMode};
use crate::endpoint::{Endpoint, Reply};
use crate::owner::Owner;
use crate::{Error, Template};

/// A clone of a [`Template`] ([`Template::create_clones`]): its own VM, running from where the
/// template was paused (its runtime reads "no request" and waits again). It serves
/// invocations in place, one at a time; one without `keep_alive` is its last (the VM
/// ends after answering). It is stopped when its handle is dropped (SIGTERM through its
/// pidfd, then SIGKILL), or by [`VmClone::delete`]; it dies with its template's VMM,
/// whose handle it keeps alive meanwhile.
#[derive(Debug)]
pub struct VmClone {
    owner: Owner,
    ep: Endpoint,
    id: String,
}

/// What a command run in a clone through its guest agent did ([`VmClone::exec`]).
pub use forkvm_client::agent::wire::ExecOutput;

impl Template {
    /// Makes `request.count` clones of this template (`POST /clones`: its resource
    /// class, rate limits, addresses, taps), each a running [`VmClone`].
    #[tracing::instrument(level = "debug", name = "template.create_clones", skip_all, fields(pid = self.pid(), count = request.count))]
    pub async fn create_clones(&self, request: &CreateClones) -> Result<Vec<VmClone>, Error> {
        let list = self.ep().create_clones(request).await?;
        let mut made = Vec::with_capacity(list.clones.len());
        let mut failed = None;
        for info in list.clones {
            // A clone that failed is in the list with its status (and why): the lot is
            // refused, once every running one has a handle, so that all of them stop as
            // their handles drop.
            if info.status != CloneStatus::Running {
                let why = info.error.as_deref().map(|e| format!(": {e}"));
                failed.get_or_insert(Error::Exited {
                    status: format!("clone {} did not start{}", info.id, why.unwrap_or_default()),
                    console: std::fs::read_to_string(self.owner().host_path(&info.console))
                        .unwrap_or_default(),
                });
                continue;
            }
            let owner = Owner::derived(
                self.owner().clone(),
                info.id.clone(),
                info.pid as u32,
                &info.console,
            )?;
            made.push(VmClone {
                ep: Endpoint {
                    sock: owner.host_path(&info.api_sock),
                    call_timeout: self.ep().call_timeout,
                },
                owner,
                id: info.id,
            });
        }
        match failed {
            Some(e) => Err(e),
            None => Ok(made),
        }
    }
}

impl VmClone {
    /// A handle on clone `info` of a template that another process owns and keeps (a
    /// service that serves several processes' clones of its templates, as the
    /// containerd shim's does): its socket and console as `info` names them (host
    /// paths), its process through a pidfd, each call bounded by `call_timeout`. It
    /// is stopped as any clone when dropped or deleted (its template's owner reaps
    /// it), and dies with its template's VMM, which this handle does not keep alive.
    /// A clone `info` does not say is running is [`Error::Exited`].
    pub fn attach(info: &CloneInfo, call_timeout: Duration) -> Result<VmClone, Error> {
        if info.status != CloneStatus::Running {
            return Err(Error::Exited {
                status: format!("clone {} is {:?}", info.id, info.status),
                console: String::new(),
            });
        }
        let pid = u32::try_from(info.pid).map_err(|_| Error::Exited {
            status: format!("clone {} has no process ({})", info.id, info.pid),
            console: String::new(),
        })?;
        let owner = Owner::attached(info.id.clone(), pid, info.console.clone())?;
        Ok(VmClone {
            ep: Endpoint {
                sock: info.api_sock.clone(),
                call_timeout,
            },
            owner,
            id: info.id.clone(),
        })
    }

    /// Its id in its template's clone table.
    pub fn id(&self) -> &str {
        &self.id
    }

    /// Its control socket.
    pub fn socket(&self) -> &Path {
        &self.ep.sock
    }

    /// Its VMM's process id.
    pub fn pid(&self) -> u32 {
        self.owner.pid()
    }

    /// Whether its VMM still runs.
    pub fn is_alive(&self) -> bool {
        !self.owner.ended()
    }

    /// The last 2 KiB of its console.
    pub fn console_tail(&self) -> String {
        let text = std::fs::read(self.owner.console()).unwrap_or_default();
        let from = text.len().saturating_sub(2048);
        String::from_utf8_lossy(&text[from..]).into_owned()
    }

    /// `GET /vm` on its socket.
    #[tracing::instrument(level = "debug", name = "clone.status", skip_all, fields(id = self.id()))]
    pub async fn status(&self) -> Result<VmInfo, Error> {
        self.ep.status().await
    }

    /// Runs `payload` through its runtime's handler, in place (409 while another
    /// runs). Without `options.keep_alive` the clone ends after answering.
    #[tracing::instrument(level = "debug", name = "clone.invoke", skip_all, fields(id = self.id()))]
    pub async fn invoke(
        &self,
        payload: impl Into<Bytes>,
        options: &InvokeOptions,
    ) -> Result<Reply, Error> {
        self.ep.invoke(payload.into(), options).await
    }

    /// Runs `command` (a shell command line) in the guest through its agent
    /// (`forkvm-agent` on vsock port `port`: the template needs `--vsock` and the agent,
    /// docs/guest-abi.md), with `stdin` as its input, within the call timeout.
    #[tracing::instrument(level = "debug", name = "clone.exec", skip_all, fields(id = self.id(), port = port))]
    pub async fn exec(&self, port: u32, command: &str, stdin: &[u8]) -> Result<ExecOutput, Error> {
        let vsock = self.vsock().await?;
        let limit = self.ep.call_timeout;
        let run = agent_exchange(&vsock, port, command, stdin);
        match tokio::time::timeout(limit, run).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: "a command through the guest agent",
                after: limit,
            }),
        }
    }

    /// Starts program `argv` in the guest through its agent (no shell: its first word
    /// is looked up on the guest's `PATH`; `["sh", "-c", line]` for a shell), streaming:
    /// its stdout and stderr come apart and as they are written, it can be sent
    /// signals, and it runs as long as it likes ([`AgentProcess`]). Only reaching the
    /// agent is bounded by the call timeout. An empty `argv`, or a word with a NUL
    /// byte, is [`Error::Command`].
    #[tracing::instrument(level = "debug", name = "clone.spawn", skip_all, fields(id = self.id(), port = port))]
    pub async fn spawn(
        &self,
        port: u32,
        argv: &[String],
        stdin: &[u8],
    ) -> Result<AgentProcess, Error> {
        self.spawn_stream(port, argv, stdin, StreamMode::default())
            .await
    }

    /// [`VmClone::spawn`] of a program whose input is fed while it runs
    /// ([`AgentControl::write_input`](crate::AgentControl::write_input),
    /// [`close_input`](crate::AgentControl::close_input)) or that runs on a terminal in
    /// the guest ([`StreamMode::tty`]: its output all comes as stdout, and
    /// [`resize`](crate::AgentControl::resize) sets its size), as `mode` says.
    #[tracing::instrument(level = "debug", name = "clone.spawn_with", skip_all, fields(id = self.id(), port = port))]
    pub async fn spawn_with(
        &self,
        port: u32,
        argv: &[String],
        mode: StreamMode,
    ) -> Result<AgentProcess, Error> {
        self.spawn_stream(port, argv, b"", mode).await
    }

    async fn spawn_stream(
        &self,
        port: u32,
        argv: &[String],
        stdin: &[u8],
        mode: StreamMode,
    ) -> Result<AgentProcess, Error> {
        let vsock = self.vsock().await?;
        let limit = self.ep.call_timeout;
        let start = AgentProcess::start(&vsock, port, argv, stdin, mode);
        match tokio::time::timeout(limit, start).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout {
                what: "reaching the guest agent",
                after: limit,
            }),
        }
    }

    /// Writes a snapshot of the clone to `dir` (`PUT /snapshot`, as
    /// [`Template::snapshot`]): it must be paused ([`VmClone::pause`]).
    #[tracing::instrument(level = "debug", name = "clone.snapshot", skip_all, fields(id = self.id()))]
    pub async fn snapshot(&self, dir: impl AsRef<Path>) -> Result<api_types::SnapshotInfo, Error> {
        self.ep.snapshot(dir.as_ref()).await
    }

    /// Puts the image at `path` (as the clone's VMM sees it) into empty disk slot
    /// `slot` of the running clone (`PUT /slots/{slot}`): read-only, or writable
    /// through a new overlay of the clone's own. The guest learns of it from an
    /// interrupt, on its own time.
    #[tracing::instrument(level = "debug", name = "clone.insert_medium", skip_all, fields(id = self.id(), slot = slot))]
    pub async fn insert_medium(
        &self,
        slot: u8,
        path: impl Into<PathBuf>,
        writable: bool,
    ) -> Result<(), Error> {
        let medium = api_types::SlotMedium {
            path: path.into(),
            writable,
        };
        self.ep.set_medium(slot, Some(&medium)).await
    }

    /// Takes the image out of disk slot `slot` (`DELETE /slots/{slot}`); the guest
    /// must have stopped using it (unmounted it) first.
    #[tracing::instrument(level = "debug", name = "clone.eject_medium", skip_all, fields(id = self.id(), slot = slot))]
    pub async fn eject_medium(&self, slot: u8) -> Result<(), Error> {
        self.ep.set_medium(slot, None).await
    }

    /// Pauses its vCPUs (`PATCH /vm` paused); its devices' host sides stay up.
    #[tracing::instrument(level = "debug", name = "clone.pause", skip_all, fields(id = self.id()))]
    pub async fn pause(&self) -> Result<(), Error> {
        self.ep.set_state(true).await
    }

    /// Runs it again after [`VmClone::pause`].
    #[tracing::instrument(level = "debug", name = "clone.resume", skip_all, fields(id = self.id()))]
    pub async fn resume(&self) -> Result<(), Error> {
        self.ep.set_state(false).await
    }

    /// The host side of the clone's vsock device.
    async fn vsock(&self) -> Result<PathBuf, Error> {
        let vsock = (self.status().await?.devices.into_iter())
            .find_map(|d| match d.kind {
                VirtioKind::Vsock { uds_path, .. } => Some(uds_path),
                _ => None,
            })
            .ok_or_else(|| Error::Agent("the clone has no vsock device (--vsock)".into()))?;
        Ok(self.owner.host_path(&vsock))
    }

    /// Stops the clone (`PUT /actions` shutdown on its socket) and waits for it to end.
    #[tracing::instrument(level = "debug", name = "clone.delete", skip_all, fields(id = self.id()))]
    pub async fn delete(self) -> Result<(), Error> {
        self.ep.shut_down(&self.owner).await
    }
}
