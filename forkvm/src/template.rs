//! A ready template: a `vmm` process this library started and owns, or one derived
//! from such a template.

use std::ffi::OsStr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use api_types::{InvokeOptions, SnapshotInfo, VmInfo, VmState};
use bytes::Bytes;

use crate::endpoint::{Endpoint, Reply};
use crate::jail::{Jail, JailSpec, CONSOLE, SOCKET};
use crate::options::VmmOptions;
use crate::owner::{Kind, Owner};
use crate::Error;

/// How many fresh clones [`Template::rehearse`] runs: as many as a template's VMM
/// learns its working set from (the first three invocation clones).
pub const REHEARSALS: usize = 3;

/// How to start a template: the guest and the `vmm run` options.
#[derive(Debug, Clone)]
#[non_exhaustive]
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
    /// The VMM's options, typed.
    pub options: VmmOptions,
    /// Further `vmm run` options (`vmm restore` options for [`Template::restore`]), after
    /// those of `options`: what has no field there (`--disk ...`, `--tap ...`). In a jail,
    /// files they name are jail paths (hand them in with [`JailSpec::args`]' `--file`).
    pub args: Vec<String>,
    /// Run the VMM in forkvm's jailer (unprivileged, chrooted, its own namespaces and
    /// cgroups; seccomp as `args` say, `--seccomp kill` by default). None: the VMM runs
    /// as this process's user, unjailed.
    pub jail: Option<JailSpec>,
    /// When the template is ready (default: its runtime waits for requests).
    pub ready: Ready,
    /// How long the guest may take until it is ready.
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
            options: VmmOptions::default(),
            args: Vec::new(),
            jail: None,
            ready: Ready::Runtime,
            start_timeout: Duration::from_secs(300),
            call_timeout: Duration::from_secs(10),
        }
    }
}

/// When a started template is ready ([`TemplateSpec::ready`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Ready {
    /// Its runtime waits for requests on the invoke port, the VM paused there (`vmm run
    /// --template`): it serves [`Template::invoke`] and [`Template::derive`].
    Runtime,
    /// A plain template: its console shows this text (an agent's "serving" line, say);
    /// the library then pauses the VM, so that its warm clones are made, and it serves
    /// [`Template::create_clones`]. Invocations are refused (no runtime waits).
    Console(String),
    /// Its VMM answers and the VM runs: clones are made of the running VM.
    Running,
}

/// What a template is waited for until it is ready.
#[derive(Clone, Copy)]
enum Until<'a> {
    /// As its spec says.
    Ready(&'a Ready),
    /// Its VM paused (a plain template restored `--paused`).
    Paused,
}

fn default_vmm() -> PathBuf {
    crate::program::beside_exe("vmm", "FORKVM_VMM")
}

/// The prefix of the directories templates' files live in (under the temporary
/// directory), followed by this process's pid and `-`.
const DIR_PREFIX: &str = "forkvm-template-";

/// Removes the directories of templates whose library process is gone (killed before
/// it could remove them): `forkvm-template-<pid>-*` whose pid no longer runs.
fn sweep_dirs() {
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        if crate::leftovers::left_by_dead_process(&entry.file_name(), DIR_PREFIX) {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// A ready template: a `vmm` process whose runtime waits for requests, paused there
/// (or, started with another [`Ready`], a plain template: paused where its console
/// showed a text, or running).
///
/// A `Template` is a cheap handle (an `Arc` inside): clone it to share the template
/// between tasks; the VMM stops when the last handle goes.
///
/// A template this library started ([`Template::start`]) is its child process; one
/// derived from another ([`Template::derive`]) is a clone of that template's VMM, and
/// keeps its parent alive as long as it lives (a clone dies with its parent VMM). A
/// template's VMM stops when its last handle is dropped (its clones die with it) and its
/// files are removed; the VMM also dies if the scheduler's process ends
/// (`PR_SET_PDEATHSIG`, from a thread the library owns: not whichever tokio thread
/// started the template), so a scheduler that is killed leaves no VMM behind.
///
/// A template serves one tenant: its clones share its memory pages, and so can observe
/// its memory timing (page-sharing side channels). Derive per tenant, never across.
#[derive(Debug, Clone)]
pub struct Template {
    owner: Arc<Owner>,
    ep: Endpoint,
}

impl Template {
    /// Starts the VMM (in a jail if `spec.jail` says so) and waits until its runtime
    /// waits for requests (the template paused there), within `spec.start_timeout`.
    ///
    /// Its files (control socket, console, log) are in a directory of its own,
    /// `forkvm-template-<pid>-*` in the temporary directory (jailed: the socket and
    /// console in the jail), removed with the template. Those of library processes that
    /// were killed are removed here first, as are their jails.
    #[tracing::instrument(level = "debug", name = "template.start", skip_all, fields(kernel = %spec.kernel.display()))]
    pub async fn start(spec: TemplateSpec) -> Result<Self, Error> {
        Self::launch(spec, None).await
    }

    /// Starts the VMM from a snapshot of a template ([`Template::snapshot`], `vmm
    /// snapshot`) instead of booting its guest (`vmm restore --dir`): a Python template
    /// serves in tens of milliseconds instead of a boot's minute. `spec` says how to run
    /// it, as for [`Template::start`]: `vmm`, `warm_clones`, `ready`, the timeouts, and
    /// `args`, which are `vmm restore` options here (`--cgroup-class`, `--seccomp`,
    /// `--max-clones`, `--tap`, `--cow-dir`; docs/snapshots.md). The guest is the
    /// snapshot's: `kernel`, `initrd`, `rootfs`, `cmdline` and `mem_mib` are not used.
    ///
    /// A snapshot of a template whose runtime waited ([`Ready::Runtime`]) is ready once
    /// its runtime waits again, at once; with [`Ready::Console`], once the restored VM
    /// is paused (`vmm restore --paused`: its console does not show the text again);
    /// with [`Ready::Running`], once it runs. A snapshot the VMM refuses (another
    /// format, a truncated file, a disk image whose size changed, a host without the
    /// guest's CPU features) is [`Error::Exited`] with the VMM's reason in
    /// [`Template::log`]'s words. Not yet in a jail ([`Error::Unsupported`]).
    #[tracing::instrument(level = "debug", name = "template.restore", skip_all)]
    pub async fn restore(dir: impl Into<PathBuf>, spec: TemplateSpec) -> Result<Self, Error> {
        if spec.jail.is_some() {
            return Err(Error::Unsupported(
                "restoring a template in a jail (the snapshot and its disks would have to be handed into the jail)",
            ));
        }
        Self::launch(spec, Some(dir.into())).await
    }

    /// Starts the VMM: `vmm run` with `spec`'s guest, or `vmm restore` of `snapshot`.
    async fn launch(spec: TemplateSpec, snapshot: Option<PathBuf>) -> Result<Self, Error> {
        sweep_dirs();
        let dir = tempfile::Builder::new()
            .prefix(&format!("{DIR_PREFIX}{}-", std::process::id()))
            .tempdir()
            .map_err(Error::Files)?;
        let jail = spec.jail.as_ref().map(|j| {
            crate::jail::sweep(j, &spec.vmm);
            Jail::new(j, &spec.vmm)
        });
        // Files the VMM opens, each with its option and its path in a jail, where the
        // jailer hands it in read-only (none for a restore: the snapshot names them).
        let guest = [
            ("--kernel", Some(&spec.kernel), "/kernel"),
            ("--initrd", spec.initrd.as_ref(), "/initrd"),
            ("--rootfs", spec.rootfs.as_ref(), "/rootfs"),
        ];
        let opened: Vec<(&str, &Path, &str)> = (guest.into_iter())
            .filter(|_| snapshot.is_none())
            .filter_map(|(flag, host, in_jail)| Some((flag, host?.as_path(), in_jail)))
            .collect();
        let (mut cmd, sock, console) = match &jail {
            Some(jail) => {
                let files: Vec<_> = opened.iter().map(|&(_, h, j)| (h, j)).collect();
                (
                    jail.command(&spec.vmm, &files),
                    SOCKET.into(),
                    CONSOLE.into(),
                )
            }
            None => (
                Command::new(&spec.vmm),
                dir.path().join("api.sock"),
                dir.path().join("console"),
            ),
        };
        match &snapshot {
            None => {
                cmd.arg("run");
                for (flag, host, in_jail) in opened {
                    let path: &OsStr = match jail {
                        Some(_) => in_jail.as_ref(),
                        None => host.as_ref(),
                    };
                    cmd.arg(flag).arg(path);
                }
                if let Some(c) = &spec.cmdline {
                    cmd.arg("--cmdline").arg(c);
                }
                cmd.arg("--mem-mib").arg(spec.mem_mib.to_string());
                if spec.ready == Ready::Runtime {
                    cmd.arg("--template");
                }
                cmd.args(spec.options.run_args());
            }
            Some(snapshot) => {
                cmd.arg("restore").arg("--dir").arg(snapshot);
                if let Ready::Console(_) = spec.ready {
                    cmd.arg("--paused");
                }
                cmd.args(spec.options.restore_args());
            }
        }
        cmd.arg("--warm-clones").arg(spec.warm_clones.to_string());
        cmd.arg("--api-sock").arg(&sock);
        cmd.arg("--console").arg(&console);
        cmd.args(&spec.args);
        let sock: PathBuf = match &jail {
            Some(j) => j.host_path(&sock),
            None => sock,
        };
        cmd.stdin(Stdio::null()).stdout(Stdio::null());
        cmd.stderr(std::fs::File::create(dir.path().join("stderr")).map_err(Error::Files)?);
        // SAFETY: prctl is async-signal-safe and touches nothing of the parent's.
        unsafe {
            cmd.pre_exec(|| {
                match libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong) {
                    0 => Ok(()),
                    _ => Err(std::io::Error::last_os_error()),
                }
            });
        }
        let program = match &jail {
            Some(j) => j.jailer().to_path_buf(),
            None => spec.vmm.clone(),
        };
        // From the library's own thread: PR_SET_PDEATHSIG fires when the thread that
        // forked the VMM ends (`spawner.rs`).
        let child = crate::spawner::spawn(cmd)
            .await
            .map_err(|source| Error::Spawn { program, source })?;
        let t = Self {
            owner: Arc::new(Owner::spawned(child, dir, jail)?),
            ep: Endpoint {
                sock,
                call_timeout: spec.call_timeout,
            },
        };
        let (until, what) = match (&snapshot, &spec.ready) {
            (None, r) => (Until::Ready(r), "the template's start"),
            (Some(_), Ready::Console(_)) => (Until::Paused, "the template's restore"),
            (Some(_), r) => (Until::Ready(r), "the template's restore"),
        };
        t.until_ready(until, spec.start_timeout, what).await?;
        if snapshot.is_none() {
            if let Ready::Console(_) = spec.ready {
                t.ep.pause().await?;
            }
        }
        Ok(t)
    }

    /// Writes a snapshot of the template to `dir` (`PUT /snapshot`; the directory must
    /// not exist, its parent must): [`Template::restore`] starts a template from it
    /// later, in this process or another, without booting its guest. The template must
    /// be paused (a template whose runtime waits is; a running plain template is
    /// refused, 409) and stays as it was. Its files hold the guest's memory: keep them
    /// as secret as the guest (docs/snapshots.md). Waits up to 600 s (a large guest's
    /// memory is written to disk). The path is the VMM's (in a jail, a jail path).
    #[tracing::instrument(level = "debug", name = "template.snapshot", skip_all, fields(pid = self.pid()))]
    pub async fn snapshot(&self, dir: impl AsRef<Path>) -> Result<SnapshotInfo, Error> {
        self.ep.snapshot(dir.as_ref()).await
    }

    /// Derives a template from this one: a fresh clone runs `load` through the
    /// runtime's loader (a load request; for the Python runtime, [`crate::Load::payload`])
    /// instead of its handler and, once its runtime waits again, is a template of its
    /// own, with its own warm clones, serving on its own socket. Returns it with the
    /// loader's reply. `options.timeout_ms` bounds the load (importing packages in a
    /// guest takes a while; the default is 300 s, not an invocation's 30 s);
    /// `options.derive` is implied.
    ///
    /// A runtime that loads nothing is refused ([`Error::Refused`], 409); a load that
    /// fails is [`Error::Invocation`] and leaves no clone. The derived template keeps
    /// this one's VMM alive while it lives; stopping this one stops it too.
    #[tracing::instrument(level = "debug", name = "template.derive", skip_all, fields(pid = self.pid()))]
    pub async fn derive(
        &self,
        load: impl Into<Bytes>,
        options: &InvokeOptions,
    ) -> Result<(Template, Reply), Error> {
        let options = InvokeOptions {
            derive: true,
            ..options.clone()
        };
        let reply = self.invoke(load, &options).await?;
        let list = self.ep.clones().await?;
        let info = (list.clones.into_iter())
            .find(|c| c.id == reply.clone_id && c.status.is_live())
            .ok_or_else(|| Error::Exited {
                status: format!("derived template {} ended at once", reply.clone_id),
                console: String::new(),
            })?;
        let owner = Owner::derived(self.owner.clone(), info.id, info.pid as u32, &info.console)?;
        let t = Template {
            ep: Endpoint {
                sock: owner.host_path(&info.api_sock),
                call_timeout: self.ep.call_timeout,
            },
            owner: Arc::new(owner),
        };
        t.until_ready(
            Until::Ready(&Ready::Runtime),
            self.ep.call_timeout,
            "the derived template's pause",
        )
        .await?;
        Ok((t, reply))
    }

    /// Waits up to `limit` until the template is `ready`.
    async fn until_ready(
        &self,
        until: Until<'_>,
        limit: Duration,
        what: &'static str,
    ) -> Result<(), Error> {
        match tokio::time::timeout(limit, self.wait_ready(until)).await {
            Ok(r) => r,
            Err(_) => Err(Error::Timeout { what, after: limit }),
        }
    }

    async fn wait_ready(&self, until: Until<'_>) -> Result<(), Error> {
        loop {
            if self.owner.ended() {
                return Err(self.exited());
            }
            // Until the socket is up, connecting fails: poll.
            if let Ok(info) = self.status().await {
                let done = match until {
                    Until::Paused => info.state == VmState::Paused,
                    Until::Ready(Ready::Runtime) => {
                        info.invoke.waiting && info.state == VmState::Paused
                    }
                    Until::Ready(Ready::Running) => info.state == VmState::Running,
                    Until::Ready(Ready::Console(text)) => {
                        let console = std::fs::read(self.owner.console()).unwrap_or_default();
                        let text = text.as_bytes();
                        console.windows(text.len().max(1)).any(|w| w == text)
                    }
                };
                if done {
                    return Ok(());
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// How the VMM ended: its exit status and, for a VMM this library started, its
    /// log's last three lines (why a restore or a boot failed), and its console's tail.
    fn exited(&self) -> Error {
        let mut status = self.owner.exit_status();
        if let Kind::Spawned { .. } = self.owner.kind {
            let log = self.log();
            let lines: Vec<&str> = (log.lines().map(str::trim))
                .filter(|l| !l.is_empty())
                .collect();
            if !lines.is_empty() {
                let tail = &lines[lines.len().saturating_sub(3)..];
                status = format!("{status}; its log ends with: {}", tail.join(" / "));
            }
        }
        Error::Exited {
            status,
            console: self.console_tail(),
        }
    }

    /// Resolves when the template's VMM ends, with how it ended ([`Error::Exited`]):
    /// a scheduler watches it (`tokio::select!`, or a task of its own) to restart a
    /// template that died. Never resolves while the VMM runs.
    pub async fn died(&self) -> Error {
        match self.owner.wait().await {
            Ok(()) => self.exited(),
            Err(e) => e,
        }
    }

    /// The template's control socket.
    pub fn socket(&self) -> &Path {
        &self.ep.sock
    }

    /// Whether the template's VMM still runs (a poll of its pidfd: no call to it).
    pub fn is_alive(&self) -> bool {
        !self.owner.ended()
    }

    /// Its control socket, typed (for the crate's other modules).
    pub(crate) fn ep(&self) -> &Endpoint {
        &self.ep
    }

    /// Its process's owner (a clone of it keeps it alive).
    pub(crate) fn owner(&self) -> &Arc<Owner> {
        &self.owner
    }

    /// The VMM's process id.
    pub fn pid(&self) -> u32 {
        self.owner.pid()
    }

    /// The id of a derived template in its parent's clone table (None: a template this
    /// library started).
    pub fn clone_id(&self) -> Option<&str> {
        match &self.owner.kind {
            Kind::Derived { id, .. } => Some(id),
            Kind::Spawned { .. } | Kind::Attached { .. } | Kind::Gone => None,
        }
    }

    /// The last 2 KiB of the template's console.
    pub fn console_tail(&self) -> String {
        let text = std::fs::read(self.owner.console()).unwrap_or_default();
        let from = text.len().saturating_sub(2048);
        String::from_utf8_lossy(&text[from..]).into_owned()
    }

    /// What the VMM's standard error says (its log; a derived template's VMM writes
    /// to its root template's).
    pub fn log(&self) -> String {
        std::fs::read_to_string(self.owner.log_file()).unwrap_or_default()
    }

    /// `GET /vm`: the template's state and figures.
    #[tracing::instrument(level = "debug", name = "template.status", skip_all, fields(pid = self.pid()))]
    pub async fn status(&self) -> Result<VmInfo, Error> {
        self.ep.status().await
    }

    /// `GET /clones`: every clone this template's VMM made (invocations' clones, warm
    /// clones launched, derived templates, clones on request), oldest first, with what
    /// became of each and, with cgroup classes, its cgroup's usage read now. Paths are
    /// the host's; in a jail, pids are the jail's.
    #[tracing::instrument(level = "debug", name = "template.clone_table", skip_all, fields(pid = self.pid()))]
    pub async fn clone_table(&self) -> Result<api_types::CloneList, Error> {
        let mut list = self.ep.clones().await?;
        for c in &mut list.clones {
            c.api_sock = self.owner.host_path(&c.api_sock);
            c.console = self.owner.host_path(&c.console);
            c.vsock = c.vsock.as_deref().map(|v| self.owner.host_path(v));
        }
        Ok(list)
    }

    /// Runs `payload` through the handler in a fresh clone (`POST /invocations`).
    /// Dropping the future closes the connection: the clone still ends on its own
    /// once its handler replies or its timeout passes.
    #[tracing::instrument(level = "debug", name = "template.invoke", skip_all, fields(pid = self.pid()))]
    pub async fn invoke(
        &self,
        payload: impl Into<Bytes>,
        options: &InvokeOptions,
    ) -> Result<Reply, Error> {
        self.ep.invoke(payload.into(), options).await
    }

    /// Runs `events` (in turn, again from the first if they are fewer) through the
    /// handler in [`REHEARSALS`] fresh clones (or one per event, if more), their answers dropped: a template's VMM
    /// learns its working set from its first invocation clones (`vmm run
    /// --working-set-mib`, docs/invoke.md), and its warm clones made after copy it
    /// ahead, so these pay for learning it instead of a caller's first requests. Each
    /// clone ends with its answer, so a caller's request never runs where one of these
    /// did; but what the handler does outside its VM (a network call) it does each time.
    /// Returns the first failure; nothing with no events.
    #[tracing::instrument(level = "debug", name = "template.rehearse", skip_all, fields(pid = self.pid()))]
    pub async fn rehearse(
        &self,
        events: &[crate::Event],
        options: &InvokeOptions,
    ) -> Result<(), Error> {
        let runs = match events.len() {
            0 => 0,
            n => n.max(REHEARSALS),
        };
        for e in events.iter().cycle().take(runs) {
            self.invoke(Bytes::copy_from_slice(e.as_bytes()), options)
                .await?;
        }
        Ok(())
    }

    /// Stops the VMM (`PUT /actions` shutdown: its clones, and the templates derived
    /// from it, are stopped first) and waits for it to exit; kills it past the call
    /// timeout. Handles of templates derived from it then answer [`Error::Exited`] or
    /// [`Error::Socket`].
    #[tracing::instrument(level = "debug", name = "template.shutdown", skip_all, fields(pid = self.pid()))]
    pub async fn shutdown(self) -> Result<(), Error> {
        self.ep.shut_down(&self.owner).await
    }
}
