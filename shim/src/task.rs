//! The shim's task service: one container per shim, its process in a clone of the
//! template (create), run through the guest agent with `forkvm-oci` (start), its exit
//! status (wait), stopped with its clone (kill), and nothing left (delete).

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use containerd_shim::asynchronous::{spawn, ExitSignal, Shim};
use containerd_shim::mount::{mount_rootfs, umount_recursive};
use containerd_shim::publisher::RemotePublisher;
use containerd_shim::{Config, Error, Flags, StartOpts, TtrpcResult};
use containerd_shim_protos::api;
use containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim_protos::protobuf::MessageField;
use containerd_shim_protos::shim_async::Task;
use containerd_shim_protos::ttrpc::r#async::TtrpcContext;
use containerd_shim_protos::ttrpc::{Code, Status as RpcStatus};
use forkvm::{CreateClones, ImageCache, InsertMedium, Template, VmClone};
use sha2::{Digest, Sha256};
use tokio::io::AsyncWriteExt;
use tokio::sync::{watch, Mutex};

use crate::config::{self, ShimConfig, AGENT_PORT};

/// How a container's process ended: its status and when.
type Exit = Option<(u32, Timestamp)>;

/// Records that the process ended with `status` now, unless its end is known already
/// (the first of its exit and a kill stands).
fn record_exit(exit: &watch::Sender<Exit>, status: u32) {
    exit.send_if_modified(|e| {
        let first = e.is_none();
        if first {
            *e = Some((status, Timestamp::now()));
        }
        first
    });
}

struct Container {
    bundle: String,
    stdout: String,
    command: String,
    pid: u32,
    template: Option<Template>,
    clone: Option<Arc<VmClone>>,
    started: bool,
    exit: watch::Sender<Exit>,
}

/// The shim: its configuration and its containers.
#[derive(Clone)]
pub struct Service {
    cfg: Arc<ShimConfig>,
    exit: Arc<ExitSignal>,
    containers: Arc<Mutex<HashMap<String, Container>>>,
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

/// `text` as one word of a shell command line.
fn quote(text: &str) -> String {
    format!("'{}'", text.replace('\'', r"'\''"))
}

/// The guest command that runs `spec`'s process on the root file system in slot 0.
fn oci_command(spec: &oci_spec::runtime::Spec) -> Result<String, String> {
    let process = spec.process().as_ref().ok_or("the spec has no process")?;
    let args = process.args().as_ref().filter(|a| !a.is_empty());
    let args = args.ok_or("the spec's process has no args")?;
    let user = process.user();
    let mut cmd = format!(
        "forkvm-oci --slot 0 --cwd {} --user {}:{}",
        quote(&process.cwd().display().to_string()),
        user.uid(),
        user.gid()
    );
    if let Some(h) = spec.hostname() {
        cmd += &format!(" --hostname {}", quote(h));
    }
    for e in process.env().iter().flatten() {
        cmd += &format!(" --env {}", quote(e));
    }
    cmd += " --";
    for a in args {
        cmd += " ";
        cmd += &quote(a);
    }
    Ok(cmd)
}

/// The image key of a root file system's mounts: its layers (the overlay's lower
/// directories, or the mount's source), not the container's own upper directory.
fn rootfs_key(mounts: &[api::Mount]) -> String {
    let mut h = Sha256::new();
    for m in mounts {
        h.update(m.type_.as_bytes());
        h.update(b"\0");
        h.update(m.source.as_bytes());
        for o in m.options.iter().filter(|o| {
            !(o.starts_with("upperdir=") || o.starts_with("workdir=") || o.starts_with("index="))
        }) {
            h.update(b"\0");
            h.update(o.as_bytes());
        }
        h.update(b"\n");
    }
    let hex: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
    format!("rootfs-{}", &hex[..32])
}

impl Service {
    /// Makes container `req.id`'s clone: its root file system as an image in slot 0,
    /// writable into the clone's overlay.
    async fn make(&self, req: &api::CreateTaskRequest) -> Result<Container, String> {
        let bundle = Path::new(&req.bundle);
        let spec = oci_spec::runtime::Spec::load(bundle.join("config.json"))
            .map_err(|e| format!("the bundle's config.json: {e}"))?;
        let command = oci_command(&spec)?;
        let rootfs = bundle.join("rootfs");
        for m in &req.rootfs {
            mount_rootfs(Some(&m.type_), Some(&m.source), &m.options, &rootfs)
                .map_err(|e| format!("cannot mount the root file system: {e}"))?;
        }
        let images = ImageCache::new(self.cfg.dir.join("images"), self.cfg.images_budget)
            .map_err(|e| e.to_string())?;
        let built = images.build(&rootfs_key(&req.rootfs), &rootfs).await;
        if !req.rootfs.is_empty() {
            let _ = umount_recursive(rootfs.to_str(), 0);
        }
        let (image, _) = built.map_err(|e| format!("the root file system's image: {e}"))?;
        let template = config::template(&self.cfg, &bundle.join("vm.vsock"))
            .await
            .map_err(|e| format!("the template: {e}"))?;
        let request = CreateClones {
            media: vec![InsertMedium {
                slot: 0,
                path: image,
                writable: true,
            }],
            ..Default::default()
        };
        let clone = (template.create_clones(&request).await)
            .map_err(|e| format!("the container's clone: {e}"))?
            .pop()
            .ok_or("no clone was made")?;
        let (exit, _) = watch::channel(None);
        Ok(Container {
            bundle: req.bundle.clone(),
            stdout: req.stdout.clone(),
            command,
            pid: clone.pid(),
            template: Some(template),
            clone: Some(Arc::new(clone)),
            started: false,
            exit,
        })
    }
}

/// How long the reader of a container's stdout has to take what was written, before
/// its exit is reported anyway.
const DRAIN: Duration = Duration::from_secs(10);

/// Writes `output` to the container's stdout FIFO `path` (none: dropped) and waits until
/// its reader has taken it all: a client (`ctr`) stops reading as soon as it learns of
/// the exit, and what is still in the FIFO then is lost.
async fn deliver(path: &str, output: &[u8]) {
    if path.is_empty() || output.is_empty() {
        return;
    }
    let mut f = match tokio::fs::OpenOptions::new().write(true).open(path).await {
        Ok(f) => f,
        Err(e) => return log::warn!("stdout {path}: {e}"),
    };
    if let Err(e) = f.write_all(output).await {
        return log::warn!("stdout {path}: {e}");
    }
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

#[async_trait]
impl Shim for Service {
    type T = Service;

    async fn new(_runtime_id: &str, _args: &Flags, _config: &mut Config) -> Self {
        Service {
            cfg: Arc::new(ShimConfig::from_env()),
            exit: Arc::new(ExitSignal::default()),
            containers: Arc::default(),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> Result<String, Error> {
        let grouping = opts.id.clone();
        spawn(opts, &grouping, Vec::new()).await
    }

    async fn delete_shim(&mut self) -> Result<api::DeleteResponse, Error> {
        let mut r = api::DeleteResponse::new();
        r.exited_at = MessageField::some(Timestamp::now());
        r.exit_status = 137;
        Ok(r)
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, _publisher: RemotePublisher) -> Self::T {
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
        if req.terminal {
            return Err(rpc_error(
                Code::UNIMPLEMENTED,
                "a terminal (-t) is not supported yet",
            ));
        }
        let c = self
            .make(&req)
            .await
            .map_err(|e| rpc_error(Code::FAILED_PRECONDITION, e))?;
        let pid = c.pid;
        self.containers.lock().await.insert(req.id.clone(), c);
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
        let mut all = self.containers.lock().await;
        let c = all.get_mut(&req.id).ok_or_else(|| not_found(&req.id))?;
        if !req.exec_id.is_empty() {
            return Err(rpc_error(Code::UNIMPLEMENTED, "exec is not supported yet"));
        }
        let clone = c
            .clone
            .clone()
            .ok_or_else(|| rpc_error(Code::FAILED_PRECONDITION, "the container was killed"))?;
        c.started = true;
        let (command, stdout, exit) = (c.command.clone(), c.stdout.clone(), c.exit.clone());
        tokio::spawn(async move {
            let (status, output) = match clone.exec(AGENT_PORT, &command, b"").await {
                Ok(out) => (out.status as u32, out.output),
                Err(e) => (255, format!("containerd-shim-forkvm: {e}\n").into_bytes()),
            };
            log::info!(
                "clone {}: exit status {status}, {} bytes of output to {stdout:?}",
                clone.id(),
                output.len()
            );
            deliver(&stdout, &output).await;
            record_exit(&exit, status);
        });
        Ok(api::StartResponse {
            pid: c.pid,
            ..Default::default()
        })
    }

    async fn state(
        &self,
        _ctx: &TtrpcContext,
        req: api::StateRequest,
    ) -> TtrpcResult<api::StateResponse> {
        let all = self.containers.lock().await;
        let c = all.get(&req.id).ok_or_else(|| not_found(&req.id))?;
        let exit = c.exit.borrow().clone();
        let status = match (&exit, c.started) {
            (Some(_), _) => api::Status::STOPPED,
            (None, true) => api::Status::RUNNING,
            (None, false) => api::Status::CREATED,
        };
        let mut r = api::StateResponse {
            id: req.id.clone(),
            bundle: c.bundle.clone(),
            pid: c.pid,
            status: status.into(),
            stdout: c.stdout.clone(),
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
            c.exit.subscribe()
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
        let clone = {
            let mut all = self.containers.lock().await;
            let c = all.get_mut(&req.id).ok_or_else(|| not_found(&req.id))?;
            record_exit(&c.exit, 128 + req.signal);
            c.clone.take()
        };
        // The whole VM goes: its process with it.
        if let Some(clone) = clone.and_then(|c| Arc::try_unwrap(c).ok()) {
            let _ = clone.delete().await;
        }
        Ok(api::Empty::default())
    }

    async fn delete(
        &self,
        _ctx: &TtrpcContext,
        req: api::DeleteRequest,
    ) -> TtrpcResult<api::DeleteResponse> {
        let mut c = self
            .containers
            .lock()
            .await
            .remove(&req.id)
            .ok_or_else(|| not_found(&req.id))?;
        if let Some(clone) = c.clone.take().and_then(|c| Arc::try_unwrap(c).ok()) {
            let _ = clone.delete().await;
        }
        if let Some(t) = c.template.take() {
            let _ = t.shutdown().await;
        }
        let _ = std::fs::remove_file(PathBuf::from(&c.bundle).join("vm.vsock"));
        let exit = c.exit.borrow().clone();
        let (code, at) = exit.unwrap_or((137, Timestamp::now()));
        Ok(api::DeleteResponse {
            pid: c.pid,
            exit_status: code,
            exited_at: MessageField::some(at),
            ..Default::default()
        })
    }

    async fn pids(
        &self,
        _ctx: &TtrpcContext,
        req: api::PidsRequest,
    ) -> TtrpcResult<api::PidsResponse> {
        let all = self.containers.lock().await;
        let c = all.get(&req.id).ok_or_else(|| not_found(&req.id))?;
        let mut info = api::ProcessInfo::new();
        info.pid = c.pid;
        Ok(api::PidsResponse {
            processes: vec![info],
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
