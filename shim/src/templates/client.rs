//! A shim's side: a clone of an image's template lent by the template service, which
//! is started first if none serves.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use api_types::CloneAddresses;
use forkvm::{CloneInfo, CreateClones, Template, VmClone};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;
use tokio::sync::Mutex;

use super::{read_line, Answer, Call, Request, TemplateKey, SUBCOMMAND};
use crate::config::{self, ShimConfig, CALL_TIMEOUT};

/// How long a service just started has to take connections.
const START_WAIT: Duration = Duration::from_secs(10);

/// Why no clone was lent.
#[derive(Debug, thiserror::Error)]
pub enum LeaseError {
    /// No service could be reached or started.
    #[error("the template service ({socket}): {reason}")]
    Unreachable {
        /// Its socket.
        socket: PathBuf,
        /// Why.
        reason: String,
    },
    /// The service could not restore the template from its snapshot.
    #[error("the image's template could not be restored: {0}")]
    Restore(String),
    /// The service refused or failed otherwise.
    #[error("the template service: {0}")]
    Refused(String),
    /// The clone it lent could not be taken up.
    #[error("the lent clone: {0}")]
    Clone(#[from] forkvm::Error),
}

/// A clone lent by the service: it is stopped when this is dropped (the connection
/// closes), if it has not ended before.
#[derive(Debug)]
pub struct Lease {
    conn: Mutex<(BufReader<OwnedReadHalf>, OwnedWriteHalf)>,
}

impl Lease {
    /// The clone as its template's clone table shows it now: its cgroup and usage.
    pub async fn usage(&self) -> Result<CloneInfo, LeaseError> {
        let mut conn = self.conn.lock().await;
        let (read, write) = &mut *conn;
        let mut line = serde_json::to_vec(&Call::Usage).map_err(refused)?;
        line.push(b'\n');
        write.write_all(&line).await.map_err(refused)?;
        match answer(read).await? {
            Answer::Usage(info) => Ok(info),
            other => Err(LeaseError::Refused(format!("answered {other:?}"))),
        }
    }
}

/// What keeps a container's (or a pod's) clone: a template of the shim's own, or the
/// template service's lease of it.
pub enum Keeper {
    /// The shim's own template (no service could be had).
    Template(Template),
    /// The service's lease.
    Lease(Lease),
}

impl Keeper {
    /// Lets the clone go: the shim's own template is stopped (its clones with it); a
    /// lease is given back (the service stops the clone if it still runs, and keeps
    /// the template).
    pub async fn stop(self) {
        match self {
            Keeper::Template(t) => {
                let _ = t.shutdown().await;
            }
            Keeper::Lease(lease) => drop(lease),
        }
    }
}

/// One clone of `template`, the shim's own (restored here), made by `request` with a
/// container's resource class, and what keeps it; `what` names it in an error (the
/// template is stopped then).
pub async fn own_clone(
    template: Template,
    request: CreateClones,
    what: &str,
) -> Result<(Keeper, VmClone), String> {
    let request = CreateClones {
        resource_class: Some(config::CLASS.into()),
        ..request
    };
    match template.create_clones(&request).await.map(|mut c| c.pop()) {
        Ok(Some(c)) => Ok((Keeper::Template(template), c)),
        made => {
            let _ = template.shutdown().await;
            Err(match made {
                Err(e) => format!("{what}: {e}"),
                _ => "no clone was made".into(),
            })
        }
    }
}

fn refused(e: impl std::fmt::Display) -> LeaseError {
    LeaseError::Refused(e.to_string())
}

/// Reads one answer, within the call timeout.
async fn answer(read: &mut BufReader<OwnedReadHalf>) -> Result<Answer, LeaseError> {
    match tokio::time::timeout(CALL_TIMEOUT, read_line(read)).await {
        Err(_) => Err(refused(format!("no answer within {CALL_TIMEOUT:?}"))),
        Ok(Err(e)) => Err(refused(e)),
        Ok(Ok(None)) => Err(refused("the connection closed")),
        Ok(Ok(Some(line))) => serde_json::from_str(&line).map_err(refused),
    }
}

/// A clone of the template restored from `snapshot` (the shim's template's or an
/// image's), its cgroup's limits `limits`, on its own tap `net.0` with the guest's
/// addresses `net.1` when given, lent by the service (started if none serves), and its
/// lease.
pub async fn lease(
    cfg: &ShimConfig,
    snapshot: &Path,
    limits: &str,
    net: Option<(String, CloneAddresses)>,
) -> Result<(VmClone, Lease), LeaseError> {
    let socket = cfg.service_socket();
    let (tap, addresses) = net.unzip();
    let request = Request {
        template: TemplateKey {
            snapshot: snapshot.to_path_buf(),
            limits: limits.to_string(),
        },
        tap,
        addresses,
    };
    let mut line = serde_json::to_vec(&request).map_err(refused)?;
    line.push(b'\n');
    // A service on its way out closes a connection it did not take: once more, with
    // a service started again.
    let mut last = None;
    for _ in 0..2 {
        let stream = match UnixStream::connect(&socket).await {
            Ok(s) => s,
            Err(_) => start(cfg, &socket).await?,
        };
        let (read, mut write) = stream.into_split();
        let mut read = BufReader::new(read);
        if let Err(e) = write.write_all(&line).await {
            last = Some(refused(e));
            continue;
        }
        match answer(&mut read).await {
            Ok(Answer::Clone(info)) => {
                let lease = Lease {
                    conn: Mutex::new((read, write)),
                };
                // The lease is dropped on failure: the service stops the clone.
                return Ok((VmClone::attach(&info, CALL_TIMEOUT)?, lease));
            }
            Ok(Answer::Restore(why)) => return Err(LeaseError::Restore(why)),
            Ok(Answer::Error(why)) => return Err(LeaseError::Refused(why)),
            Ok(other) => return Err(refused(format!("answered {other:?}"))),
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| refused("no answer")))
}

/// Starts the service, one shim at a time (a lock file), unless one serves by the time
/// the lock is held, and connects to it.
async fn start(cfg: &ShimConfig, socket: &Path) -> Result<UnixStream, LeaseError> {
    let unreachable = |reason: String| LeaseError::Unreachable {
        socket: socket.to_path_buf(),
        reason,
    };
    std::fs::create_dir_all(&cfg.run_dir).map_err(|e| unreachable(e.to_string()))?;
    let lock_path = socket.with_extension("lock");
    let _lock = tokio::task::spawn_blocking(move || config::lock(&lock_path))
        .await
        .map_err(|e| unreachable(e.to_string()))?
        .map_err(|e| unreachable(e.to_string()))?;
    if let Ok(s) = UnixStream::connect(socket).await {
        return Ok(s);
    }
    let log = socket.with_extension("log");
    spawn_detached(&log).map_err(|e| unreachable(format!("cannot start it: {e}")))?;
    log::info!("started the template service ({})", socket.display());
    let started = Instant::now();
    loop {
        if let Ok(s) = UnixStream::connect(socket).await {
            return Ok(s);
        }
        if started.elapsed() > START_WAIT {
            let text = std::fs::read_to_string(&log).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(3).collect();
            let tail: Vec<&str> = tail.into_iter().rev().collect();
            return Err(unreachable(format!(
                "not serving {START_WAIT:?} after its start; its log ({}) ends: {}",
                log.display(),
                tail.join(" / ")
            )));
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Runs this program as the service, in a session of its own and not this process's
/// child (it outlives this shim), its standard error to `log`.
fn spawn_detached(log: &Path) -> std::io::Result<()> {
    let exe = std::env::current_exe()?;
    let log = std::fs::File::create(log)?;
    let mut cmd = Command::new(exe);
    cmd.arg(SUBCOMMAND)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log);
    // SAFETY: setsid, fork and _exit are async-signal-safe; the child between its fork
    // and its exec touches nothing of the parent's.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            match libc::fork() {
                -1 => Err(std::io::Error::last_os_error()),
                // The service: execs.
                0 => Ok(()),
                // The middle process ends at once: the service is reparented (the shim
                // is no subreaper: to init).
                _ => libc::_exit(0),
            }
        });
    }
    let mut middle = cmd.spawn()?;
    middle.wait()?;
    Ok(())
}
