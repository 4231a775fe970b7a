//! The shim's task service: a container's process in a clone of the template (create),
//! run through the guest agent with `forkvm-oci` (start), its exit status (wait),
//! stopped with its clone (kill), and nothing left (delete).
//!
//! A CRI pod is one clone: one shim serves the pod (containerd starts the shim of each
//! of its containers with the sandbox's id as their group, and finds this one's
//! socket), its sandbox makes the clone, and each container's root file system goes
//! into a disk slot of that clone while it runs (`PUT /slots/{slot}`), its processes
//! run in the pod's VM.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use async_trait::async_trait;
use containerd_shim::asynchronous::{spawn, ExitSignal, Shim};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Config, Error, Flags, StartOpts, TtrpcResult};
use containerd_shim_protos::api;
use containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim_protos::protobuf::MessageField;
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::ttrpc::r#async::TtrpcContext;
use containerd_shim_protos::ttrpc::{Code, Status as RpcStatus};
use forkvm::VmClone;
use tokio::sync::Mutex;

use crate::config::{ShimConfig, AGENT_PORT};
use crate::events::Events;
use crate::metrics;
use crate::pod::Pods;
use crate::process::{self, oci_command, Proc};
use crate::spec::sandbox_id;
use crate::templates::client::Keeper;

pub(crate) struct Container {
    pub(crate) bundle: String,
    pub(crate) pid: u32,
    pub(crate) clone_id: String,
    /// What keeps its VM (None: a pod's container, kept by its sandbox's).
    pub(crate) keeper: Option<Keeper>,
    pub(crate) clone: Option<Arc<VmClone>>,
    /// The spec's process.
    pub(crate) init: Proc,
    /// The processes `exec` added, by exec id.
    pub(crate) execs: HashMap<String, Proc>,
    /// Whether its VM is paused.
    pub(crate) paused: bool,
    /// A pod's sandbox (CRI's `io.kubernetes.cri.container-type: sandbox`): the pod's
    /// VM, its process only a placeholder that runs until it is killed.
    pub(crate) sandbox: bool,
    /// The sandbox whose VM a pod's container runs in (its root file system in disk
    /// slot `slot` of that VM); None for a container with a VM of its own (slot 0).
    pub(crate) in_pod: Option<String>,
    /// The disk slot of its root file system.
    pub(crate) slot: u8,
}

impl Container {
    /// Process `exec_id` ("" is the init).
    fn process(&self, exec_id: &str) -> TtrpcResult<&Proc> {
        match exec_id {
            "" => Ok(&self.init),
            id => self
                .execs
                .get(id)
                .ok_or_else(|| rpc_error(Code::NOT_FOUND, format!("no process {id:?}"))),
        }
    }

    fn process_mut(&mut self, exec_id: &str) -> TtrpcResult<&mut Proc> {
        match exec_id {
            "" => Ok(&mut self.init),
            id => self
                .execs
                .get_mut(id)
                .ok_or_else(|| rpc_error(Code::NOT_FOUND, format!("no process {id:?}"))),
        }
    }

    fn clone_vm(&self) -> TtrpcResult<Arc<VmClone>> {
        (self.clone.clone())
            .ok_or_else(|| rpc_error(Code::FAILED_PRECONDITION, "the container's VM is gone"))
    }
}

/// The serving shim's pid, in the bundle of the container it was started for.
const SHIM_PID: &str = "forkvm-shim.pid";

/// The shim: its configuration and its containers.
#[derive(Clone)]
pub struct Service {
    pub(crate) cfg: Arc<ShimConfig>,
    pub(crate) exit: Arc<ExitSignal>,
    pub(crate) containers: Arc<Mutex<HashMap<String, Container>>>,
    /// The pods this shim serves.
    pub(crate) pods: Arc<Pods>,
    pub(crate) events: Arc<Events>,
}

fn rpc_error(code: Code, message: impl std::fmt::Display) -> containerd_shim_protos::ttrpc::Error {
    containerd_shim_protos::ttrpc::Error::RpcStatus(RpcStatus {
        code: code.into(),
        message: message.to_string(),
        ..Default::default()
    })
}

fn not_found(id: &str) -> containerd_shim_protos::ttrpc::Error {
    rpc_error(Code::NOT_FOUND, format!("no container {id:?}"))
}

impl Service {
    /// Kills what `exec` started in container `id` (its init has ended).
    async fn kill_execs(&self, id: &str) {
        let controls: Vec<_> = match self.containers.lock().await.get(id) {
            Some(c) => c.execs.values().filter_map(|p| p.control.clone()).collect(),
            None => return,
        };
        for control in controls {
            let _ = control.lock().await.signal(libc::SIGKILL as u32).await;
        }
    }

    /// Pauses or resumes container `id`'s VM.
    async fn set_paused(&self, id: &str, paused: bool) -> TtrpcResult<api::Empty> {
        let clone = {
            let all = self.containers.lock().await;
            let c = all.get(id).ok_or_else(|| not_found(id))?;
            if c.in_pod.is_some() {
                return Err(rpc_error(
                    Code::UNIMPLEMENTED,
                    "a pod's container runs in the pod's VM: pause the pod's sandbox",
                ));
            }
            c.clone_vm()?
        };
        let r = match paused {
            true => clone.pause().await,
            false => clone.resume().await,
        };
        r.map_err(|e| rpc_error(Code::FAILED_PRECONDITION, e))?;
        if let Some(c) = self.containers.lock().await.get_mut(id) {
            c.paused = paused;
        }
        self.events.paused(id, paused).await;
        Ok(api::Empty::default())
    }
}

#[async_trait]
impl Shim for Service {
    type T = Service;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut Config) -> Self {
        Service {
            cfg: Arc::new(ShimConfig::from_env()),
            exit: Arc::new(ExitSignal::default()),
            containers: Arc::default(),
            pods: Arc::default(),
            events: Arc::new(Events::new(&args.namespace)),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        // A pod's containers go to the shim of its sandbox (grouped by its id), whose
        // socket is there once the sandbox was started.
        let spec = oci_spec::runtime::Spec::load("config.json").ok();
        let grouping = spec
            .as_ref()
            .and_then(sandbox_id)
            .unwrap_or(opts.id.clone());
        if grouping != opts.id {
            let address =
                containerd_shim::socket_address(&opts.address, &opts.namespace, &grouping);
            let path = address.strip_prefix("unix://").unwrap_or(&address);
            if std::os::unix::net::UnixStream::connect(path).is_ok() {
                containerd_shim::asynchronous::util::write_str_to_file("address", &address).await?;
                return Ok(address);
            }
        }
        keep_legacy_start_input().map_err(|err| Error::IoError {
            context: "the start's input".into(),
            err,
        })?;
        let address = spawn(opts, &grouping, Vec::new()).await?;
        // In the bundle (the working directory): a restarted containerd reconnects to
        // the shim at this address.
        containerd_shim::asynchronous::util::write_str_to_file("address", &address).await?;
        Ok(address)
    }

    async fn delete_shim(&mut self) -> Result<api::DeleteResponse, Error> {
        // containerd cleans up after a shim it lost (restarted, it cannot load the
        // task): the serving shim of this bundle (the working directory) goes, and its
        // VMMs with it (they die with their parent), and so does its socket.
        if let Some(pid) = (std::fs::read_to_string(SHIM_PID).ok())
            .and_then(|p| p.trim().parse::<i32>().ok())
            .filter(|&p| p > 0 && p != std::process::id() as i32)
        {
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).ok();
            if exe.is_some() && exe == std::env::current_exe().ok() {
                // SAFETY: signals the shim process this bundle recorded, by its pid,
                // checked to run this program.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
        }
        let _ = std::fs::remove_file(SHIM_PID);
        if let Ok(bundle) = std::env::current_dir() {
            let _ = std::fs::remove_file(self.cfg.vsock(&bundle.display().to_string()));
        }
        let mut r = api::DeleteResponse::new();
        r.exited_at = MessageField::some(Timestamp::now());
        r.exit_status = 137;
        Ok(r)
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> Self::T {
        self.events.connect(publisher);
        // For `delete_shim`, run in this bundle after containerd lost this process.
        if let Err(e) = std::fs::write(SHIM_PID, std::process::id().to_string()) {
            log::warn!("{SHIM_PID}: {e}");
        }
        self.clone()
    }
}

#[async_trait]
impl Task for Service {
    async fn create(
        &self,
        _ctx: &TtrpcContext,
        req: api::CreateTaskRequest,
    ) -> TtrpcResult<api::CreateTaskResponse> {
        let c = self
            .make(&req)
            .await
            .map_err(|e| rpc_error(Code::FAILED_PRECONDITION, e))?;
        let pid = c.pid;
        self.containers.lock().await.insert(req.id.clone(), c);
        self.events.create(&req.id, &req.bundle, pid).await;
        Ok(api::CreateTaskResponse {
            pid,
            ..Default::default()
        })
    }

    async fn start(
        &self,
        _ctx: &TtrpcContext,
        req: api::StartRequest,
    ) -> TtrpcResult<api::StartResponse> {
        let (clone, (command, preamble), (stdout, stderr, stdin), mode, close_stdin, exit, pid) = {
            let mut all = self.containers.lock().await;
            let c = all.get_mut(&req.id).ok_or_else(|| not_found(&req.id))?;
            if c.sandbox && req.exec_id.is_empty() && !c.init.started {
                // The placeholder runs until it is killed.
                c.init.started = true;
                let pid = c.pid;
                drop(all);
                self.events.start(&req.id, "", pid).await;
                return Ok(api::StartResponse {
                    pid,
                    ..Default::default()
                });
            }
            let clone = c.clone_vm()?;
            let pid = c.pid;
            let p = c.process_mut(&req.exec_id)?;
            if p.started {
                return Err(rpc_error(Code::FAILED_PRECONDITION, "already started"));
            }
            p.started = true;
            let fifos = (p.stdout.clone(), p.stderr.clone(), p.stdin.clone());
            let close = p.close_stdin.clone();
            (
                clone,
                (p.command.clone(), std::mem::take(&mut p.preamble)),
                fifos,
                p.mode(),
                close,
                p.exit.clone(),
                pid,
            )
        };
        let since = Instant::now();
        // The volumes' archive first (`forkvm-oci --unpack`): the whole input of a process
        // whose input is not fed, or its first bytes.
        let started = match (mode.stdin, preamble.is_empty()) {
            (false, false) => clone.spawn(AGENT_PORT, &command, &preamble).await,
            (true, false) => match clone.spawn_with(AGENT_PORT, &command, mode).await {
                Ok(mut p) => (p.control.write_input(&preamble).await).map(|()| p),
                Err(e) => Err(e),
            },
            (_, true) => clone.spawn_with(AGENT_PORT, &command, mode).await,
        };
        let process = match started {
            Ok(p) => p,
            Err(e) => {
                let mut all = self.containers.lock().await;
                if let Some(p) = all
                    .get_mut(&req.id)
                    .and_then(|c| c.process_mut(&req.exec_id).ok())
                {
                    p.started = false;
                    p.preamble = preamble;
                }
                return Err(rpc_error(
                    Code::UNAVAILABLE,
                    format!("the guest agent: {e}"),
                ));
            }
        };
        let control = Arc::new(Mutex::new(process.control));
        if let Some(p) = (self.containers.lock().await.get_mut(&req.id))
            .and_then(|c| c.process_mut(&req.exec_id).ok())
        {
            p.control = Some(control.clone());
        }
        if !stdin.is_empty() {
            let feed = process::feed_stdin(stdin, Arc::downgrade(&control), close_stdin);
            tokio::spawn(feed);
        }
        self.events.start(&req.id, &req.exec_id, pid).await;
        let service = self.clone();
        let (id, exec_id) = (req.id.clone(), req.exec_id.clone());
        tokio::spawn(async move {
            let label = format!("{id} {exec_id:?}");
            let mut ended = exit.subscribe();
            process::forward(process.output, [stdout, stderr], exit, &label, since).await;
            if exec_id.is_empty() {
                // The container ends with its init: its other processes go too.
                service.kill_execs(&id).await;
            }
            let end = ended.borrow_and_update().clone();
            if let Some((status, at)) = end {
                service.events.exit(&id, &exec_id, pid, status, at).await;
            }
        });
        Ok(api::StartResponse {
            pid,
            ..Default::default()
        })
    }

    async fn exec(
        &self,
        _ctx: &TtrpcContext,
        req: api::ExecProcessRequest,
    ) -> TtrpcResult<api::Empty> {
        let process: oci_spec::runtime::Process = serde_json::from_slice(&req.spec.value)
            .map_err(|e| rpc_error(Code::INVALID_ARGUMENT, format!("the exec's process: {e}")))?;
        let mut all = self.containers.lock().await;
        let c = all.get_mut(&req.id).ok_or_else(|| not_found(&req.id))?;
        let command = (oci_command(&process, None, c.slot))
            .map_err(|e| rpc_error(Code::INVALID_ARGUMENT, e))?;
        if c.init.exited().is_some() || !c.init.started {
            return Err(rpc_error(
                Code::FAILED_PRECONDITION,
                "the container is not running",
            ));
        }
        if c.execs.contains_key(&req.exec_id) || req.exec_id.is_empty() {
            return Err(rpc_error(
                Code::ALREADY_EXISTS,
                format!("process {:?} exists", req.exec_id),
            ));
        }
        let p = Proc::new(command, &req.stdout, &req.stderr).with_input(&req.stdin, req.terminal);
        c.execs.insert(req.exec_id.clone(), p);
        drop(all);
        self.events.exec_added(&req.id, &req.exec_id).await;
        Ok(api::Empty::default())
    }

    async fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        let all = self.containers.lock().await;
        let c = all.get(&req.id).ok_or_else(|| not_found(&req.id))?;
        let p = c.process(&req.exec_id)?;
        let exit = p.exited();
        let status = match (&exit, p.started, c.paused) {
            (Some(_), _, _) => api::Status::STOPPED,
            (None, true, true) => api::Status::PAUSED,
            (None, true, false) => api::Status::RUNNING,
            (None, false, _) => api::Status::CREATED,
        };
        let mut r = api::StateResponse {
            id: req.id.clone(),
            exec_id: req.exec_id.clone(),
            bundle: c.bundle.clone(),
            pid: c.pid,
            status: status.into(),
            stdout: p.stdout.clone(),
            stderr: p.stderr.clone(),
            ..Default::default()
        };
        if let Some((code, at)) = exit {
            r.exit_status = code;
            r.exited_at = MessageField::some(at);
        }
        Ok(r)
    }

    async fn wait(
        &self,
        _ctx: &TtrpcContext,
        req: api::WaitRequest,
    ) -> TtrpcResult<api::WaitResponse> {
        let mut rx = {
            let all = self.containers.lock().await;
            let c = all.get(&req.id).ok_or_else(|| not_found(&req.id))?;
            c.process(&req.exec_id)?.exit.subscribe()
        };
        let exit = rx
            .wait_for(Option::is_some)
            .await
            .map_err(|_| rpc_error(Code::INTERNAL, "the container went"))?
            .clone();
        let (code, at) = exit.unwrap_or((255, Timestamp::now()));
        Ok(api::WaitResponse {
            exit_status: code,
            exited_at: MessageField::some(at),
            ..Default::default()
        })
    }

    async fn kill(&self, _ctx: &TtrpcContext, req: api::KillRequest) -> TtrpcResult<api::Empty> {
        let control = {
            let mut all = self.containers.lock().await;
            let c = all.get_mut(&req.id).ok_or_else(|| not_found(&req.id))?;
            let p = c.process(&req.exec_id)?;
            if p.exited().is_some() {
                return Err(rpc_error(Code::NOT_FOUND, "the process has ended"));
            }
            match p.control.clone() {
                Some(control) => control,
                None => {
                    // Not started, or a sandbox's placeholder: it ends now (and an
                    // init's VM with it).
                    p.record_exit(128 + req.signal);
                    if let Some((status, at)) = p.exited() {
                        let events = self.events.clone();
                        let (id, exec_id, pid) = (req.id.clone(), req.exec_id.clone(), c.pid);
                        tokio::spawn(async move {
                            events.exit(&id, &exec_id, pid, status, at).await;
                        });
                    }
                    // A container's own VM goes now; a pod's when its sandbox is deleted.
                    if req.exec_id.is_empty() && !c.sandbox && c.in_pod.is_none() {
                        if let Some(clone) = c.clone.take().and_then(|c| Arc::try_unwrap(c).ok()) {
                            let _ = clone.delete().await;
                        }
                    }
                    return Ok(api::Empty::default());
                }
            }
        };
        let sent = control.lock().await.signal(req.signal).await;
        sent.map_err(|e| rpc_error(Code::NOT_FOUND, format!("the process has ended: {e}")))?;
        Ok(api::Empty::default())
    }

    async fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        if !req.exec_id.is_empty() {
            let mut all = self.containers.lock().await;
            let c = all.get_mut(&req.id).ok_or_else(|| not_found(&req.id))?;
            let p = c.process(&req.exec_id)?;
            let Some((code, at)) = p.exited() else {
                return Err(rpc_error(Code::FAILED_PRECONDITION, "the process runs"));
            };
            c.execs.remove(&req.exec_id);
            return Ok(api::DeleteResponse {
                pid: c.pid,
                exit_status: code,
                exited_at: MessageField::some(at),
                ..Default::default()
            });
        }
        let mut c = self
            .containers
            .lock()
            .await
            .remove(&req.id)
            .ok_or_else(|| not_found(&req.id))?;
        // Dropping the processes' controls kills what still runs; the VM goes next (a
        // pod's container gives its slot back; the pod's VM stays).
        c.execs.clear();
        c.init.control = None;
        if let (Some(sandbox), Some(clone)) = (&c.in_pod, &c.clone) {
            self.pods.leave(sandbox, clone, c.slot).await;
        }
        if c.sandbox {
            self.pods.remove(&req.id).await;
            // Containers of the pod still here let go of its VM.
            for m in self.containers.lock().await.values_mut() {
                if m.in_pod.as_deref() == Some(req.id.as_str()) {
                    m.clone = None;
                }
            }
        }
        let own = c.in_pod.is_none();
        if let Some(clone) = (c.clone.take().filter(|_| own)).and_then(|c| Arc::try_unwrap(c).ok())
        {
            let _ = clone.delete().await;
        }
        if let Some(keeper) = c.keeper.take() {
            keeper.stop().await;
        }
        let _ = std::fs::remove_file(self.cfg.vsock(&c.bundle));
        let (code, at) = c.init.exited().unwrap_or((137, Timestamp::now()));
        (self.events.delete(&req.id, c.pid, code, at.clone())).await;
        Ok(api::DeleteResponse {
            pid: c.pid,
            exit_status: code,
            exited_at: MessageField::some(at),
            ..Default::default()
        })
    }

    async fn pause(&self, _ctx: &TtrpcContext, req: api::PauseRequest) -> TtrpcResult<api::Empty> {
        self.set_paused(&req.id, true).await
    }

    async fn resume(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResumeRequest,
    ) -> TtrpcResult<api::Empty> {
        self.set_paused(&req.id, false).await
    }

    async fn stats(
        &self,
        _ctx: &TtrpcContext,
        req: api::StatsRequest,
    ) -> TtrpcResult<api::StatsResponse> {
        let info = {
            let all = self.containers.lock().await;
            let c = all.get(&req.id).ok_or_else(|| not_found(&req.id))?;
            // A pod's container reports the pod's VM, its sandbox's clone.
            let owner = match &c.in_pod {
                Some(sandbox) => all.get(sandbox).ok_or_else(|| not_found(sandbox))?,
                None => c,
            };
            let unavailable = |e: String| rpc_error(Code::UNAVAILABLE, e);
            match owner.keeper.as_ref().ok_or_else(|| not_found(&req.id))? {
                Keeper::Template(t) => (t.clone_table().await)
                    .map_err(|e| unavailable(e.to_string()))?
                    .clones
                    .into_iter()
                    .find(|i| i.id == c.clone_id),
                Keeper::Lease(lease) => Some(
                    lease
                        .usage()
                        .await
                        .map_err(|e| unavailable(e.to_string()))?,
                ),
            }
        };
        let cgroup = (info.and_then(|i| i.cgroup))
            .ok_or_else(|| rpc_error(Code::NOT_FOUND, "the clone has no cgroup"))?;
        let any = containerd_shim::util::convert_to_any(Box::new(metrics::of(&cgroup)))
            .map_err(|e| rpc_error(Code::INTERNAL, e))?;
        Ok(api::StatsResponse {
            stats: MessageField::some(any),
            ..Default::default()
        })
    }

    async fn close_io(
        &self,
        _ctx: &TtrpcContext,
        req: api::CloseIORequest,
    ) -> TtrpcResult<api::Empty> {
        // The process's input ends once what its FIFO holds has gone to the guest.
        let all = self.containers.lock().await;
        let c = all.get(&req.id).ok_or_else(|| not_found(&req.id))?;
        c.process(&req.exec_id)?.close_stdin.notify_one();
        Ok(api::Empty::default())
    }

    async fn resize_pty(
        &self,
        _ctx: &TtrpcContext,
        req: api::ResizePtyRequest,
    ) -> TtrpcResult<api::Empty> {
        let control = {
            let all = self.containers.lock().await;
            let c = all.get(&req.id).ok_or_else(|| not_found(&req.id))?;
            let p = c.process(&req.exec_id)?;
            if !p.terminal {
                return Err(rpc_error(
                    Code::FAILED_PRECONDITION,
                    "the process has no terminal",
                ));
            }
            p.control.clone()
        };
        // Before it started there is nothing to resize yet; the guest's default stands.
        if let Some(control) = control {
            let (rows, cols) = (
                req.height.min(u16::MAX.into()),
                req.width.min(u16::MAX.into()),
            );
            let r = control.lock().await.resize(rows as u16, cols as u16).await;
            r.map_err(|e| rpc_error(Code::NOT_FOUND, format!("the process has ended: {e}")))?;
        }
        Ok(api::Empty::default())
    }

    async fn pids(
        &self,
        _ctx: &TtrpcContext,
        req: api::PidsRequest,
    ) -> TtrpcResult<api::PidsResponse> {
        let (clone, slot, vmm_pid, sandbox) = {
            let all = self.containers.lock().await;
            let c = all.get(&req.id).ok_or_else(|| not_found(&req.id))?;
            (c.clone.clone(), c.slot, c.pid, c.sandbox)
        };
        // The guest's processes on the container's root file system; a sandbox (no
        // root file system of its own) or a VM that cannot say: its VMM.
        let pids = match (clone, sandbox) {
            (Some(clone), false) => match process::guest_pids(&clone, slot).await {
                Ok(p) => p,
                Err(e) => {
                    log::warn!("{}: the guest's processes: {e}", req.id);
                    vec![vmm_pid]
                }
            },
            _ => vec![vmm_pid],
        };
        let processes = (pids.into_iter())
            .map(|pid| api::ProcessInfo {
                pid,
                ..Default::default()
            })
            .collect();
        Ok(api::PidsResponse {
            processes,
            ..Default::default()
        })
    }

    async fn connect(
        &self,
        _ctx: &TtrpcContext,
        req: api::ConnectRequest,
    ) -> TtrpcResult<api::ConnectResponse> {
        let all = self.containers.lock().await;
        let pid = all.get(&req.id).map_or(0, |c| c.pid);
        Ok(api::ConnectResponse {
            shim_pid: std::process::id(),
            task_pid: pid,
            version: env!("CARGO_PKG_VERSION").into(),
            ..Default::default()
        })
    }

    async fn shutdown(
        &self,
        _ctx: &TtrpcContext,
        _req: api::ShutdownRequest,
    ) -> TtrpcResult<api::Empty> {
        if self.containers.lock().await.is_empty() {
            self.exit.signal();
        }
        Ok(api::Empty::default())
    }
}

/// Leaves on the shim's stdin only what `spawn` can read there. containerd 1.x writes the
/// runtime's options (a protobuf `Any` of runc's `Options`, often nothing), whose
/// `shim_cgroup` `spawn` applies to the serving shim; containerd 2.x writes its
/// bootstrap parameters instead (the same ids and addresses as the arguments and
/// environment), which `spawn` would fail to read as options: the shim then reads
/// nothing there.
fn keep_legacy_start_input() -> std::io::Result<()> {
    use containerd_shim_protos::protobuf::{well_known_types::any::Any, Message};
    use containerd_shim_protos::shim::oci::Options;
    use std::io::{Read, Write};
    use std::os::fd::AsRawFd;
    let mut data = Vec::new();
    std::io::stdin().read_to_end(&mut data)?;
    let legacy = data.is_empty()
        || Any::parse_from_bytes(&data)
            .and_then(|any| Options::parse_from_bytes(&any.value))
            .is_ok();
    let (reader, mut writer) = std::os::unix::net::UnixStream::pair()?;
    if legacy {
        // At most a few hundred bytes: the socket holds them without a reader.
        writer.write_all(&data)?;
    } else {
        let len = data.len();
        log::info!("start: containerd's bootstrap parameters on stdin ({len} bytes)");
    }
    drop(writer);
    // SAFETY: dup2 onto fd 0 of a socket's end this function owns; it closes and
    // replaces the shim's stdin, which nothing else holds a handle to at this point.
    if unsafe { libc::dup2(reader.as_raw_fd(), 0) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
