//! The template service's side: the images' templates it keeps, and a task per shim's
//! connection that lends one clone until the connection closes.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use forkvm::{CloneInfo, CreateClones, Template, VmClone};
use tokio::io::{AsyncWriteExt, BufReader};
use tokio::net::unix::OwnedWriteHalf;
use tokio::net::{UnixListener, UnixStream};
use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::Mutex;

use super::{read_line, Answer, Call, Request, TemplateKey};
use crate::config::{self, ShimConfig, TemplateError, CLASS};

/// How long a shim has to send its request once connected.
const REQUEST_WAIT: Duration = Duration::from_secs(10);

/// An image's template the service keeps.
struct Kept {
    template: Option<Template>,
    /// Its snapshot's `state` file (device, inode) when it was restored: a snapshot
    /// made again at the same path is restored again.
    state: (u64, u64),
    /// Its clones lent now.
    leases: usize,
    /// Its clones lent since it was restored.
    lent: u64,
    /// When it was last asked for, or a lease of it ended.
    used: Instant,
}

/// What the service holds.
struct State {
    cfg: ShimConfig,
    kept: std::sync::Mutex<HashMap<TemplateKey, Arc<Mutex<Kept>>>>,
    /// Connections open now.
    open: AtomicUsize,
    /// When a connection last closed (or the service started).
    quiet_since: std::sync::Mutex<Instant>,
}

/// Runs the template service (`containerd-shim-forkvm-v2 templates`) until it has
/// been idle for `FORKVM_SHIM_TEMPLATE_IDLE_S`, or SIGTERM or SIGINT, which stop its
/// templates and the clones they lent.
pub async fn run() -> i32 {
    // What it restores and stops; each lease too with FORKVM_SHIM_LOG=debug.
    let filter = std::env::var("FORKVM_SHIM_LOG").unwrap_or_else(|_| "info".into());
    let _ = tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .try_init();
    // Not the bundle directory of the shim that started it.
    let _ = std::env::set_current_dir("/");
    // Its socket, and what its VMMs make (their sockets, consoles), are root's alone
    // from the start (no window between a bind and a chmod).
    // SAFETY: umask only sets this process's file mode mask.
    unsafe { libc::umask(0o077) };
    match serve(ShimConfig::from_env()).await {
        Ok(()) => 0,
        Err(e) => {
            log::error!("the template service stops: {e}");
            1
        }
    }
}

async fn serve(cfg: ShimConfig) -> Result<(), TemplateError> {
    let sock = cfg.service_socket();
    std::fs::create_dir_all(&cfg.run_dir).map_err(config::dir_error(&cfg.run_dir))?;
    // One service per socket: the pid file's lock, held for the service's life. One
    // still on its way out holds it a little longer: waited for.
    let pid_file = sock.with_extension("pid");
    let lock = {
        let pid_file = pid_file.clone();
        tokio::task::spawn_blocking(move || config::lock(&pid_file))
            .await
            .map_err(|e| config::dir_error(&sock)(std::io::Error::other(e)))??
    };
    let _ = std::fs::write(&pid_file, format!("{}\n", std::process::id()));
    let _ = std::fs::remove_file(&sock);
    let listener = UnixListener::bind(&sock).map_err(config::dir_error(&sock))?;
    log::info!(
        "serving on {} (pid {}): {} warm clone(s) a template, idle after {:?}",
        sock.display(),
        std::process::id(),
        cfg.warm_clones,
        cfg.template_idle
    );
    let tick = (cfg.template_idle / 4).clamp(Duration::from_millis(100), Duration::from_secs(5));
    let state = Arc::new(State {
        cfg,
        kept: Default::default(),
        open: AtomicUsize::new(0),
        quiet_since: std::sync::Mutex::new(Instant::now()),
    });
    let signal_error = |e| config::dir_error(Path::new("signal handler"))(e);
    let mut term = signal(SignalKind::terminate()).map_err(signal_error)?;
    let mut int = signal(SignalKind::interrupt()).map_err(signal_error)?;
    let mut ticks = tokio::time::interval(tick);
    // The idle templates being stopped.
    let mut stopping = tokio::task::JoinSet::new();
    loop {
        tokio::select! {
            conn = listener.accept() => match conn {
                Ok((stream, _)) => {
                    state.open.fetch_add(1, Ordering::SeqCst);
                    tokio::spawn(lend(state.clone(), stream));
                }
                Err(e) => log::warn!("accept: {e}"),
            },
            _ = ticks.tick() => {
                for (key, t) in state.evict() {
                    let state = state.clone();
                    stopping.spawn(async move { state.shut_down(&key, t).await });
                }
                while stopping.try_join_next().is_some() {}
                if stopping.is_empty() && state.idle() {
                    log::info!("idle for {:?}: exiting", state.cfg.template_idle);
                    break;
                }
            }
            _ = term.recv() => { log::info!("SIGTERM: stopping"); break }
            _ = int.recv() => { log::info!("SIGINT: stopping"); break }
        }
    }
    // No new connection from here on (one not yet accepted is refused: its shim
    // starts a service again, which waits for this one's lock).
    let _ = std::fs::remove_file(&sock);
    drop(listener);
    let kept: Vec<_> = (state.kept.lock().unwrap_or_else(|p| p.into_inner()).drain()).collect();
    for (key, kept) in kept {
        let (template, lent, leases) = {
            let mut k = kept.lock().await;
            (k.template.take(), k.lent, k.leases)
        };
        if let Some(t) = template {
            log::info!("{key}: stopped after lending {lent} clone(s), {leases} of them still lent");
            state.shut_down(&key, t).await;
        }
    }
    stopping.join_all().await;
    tokio::task::spawn_blocking(|| forkvm::wait_stopped(Duration::from_secs(5)))
        .await
        .ok();
    drop(lock);
    Ok(())
}

/// The (device, inode) of a snapshot's `state` file.
fn state_id(snapshot: &Path) -> std::io::Result<(u64, u64)> {
    let m = std::fs::metadata(snapshot.join("state"))?;
    Ok((m.dev(), m.ino()))
}

impl State {
    /// The host socket of the vsock device of template `key`.
    fn vsock(&self, key: &TemplateKey) -> PathBuf {
        let key = format!("service {} {}", key.snapshot.display(), key.limits);
        self.cfg.vsock(&key)
    }

    /// Whether `snapshot` is the shim's template or an image's in the shim's directory
    /// (the only snapshots the service restores).
    fn is_template(&self, snapshot: &Path) -> bool {
        let name = snapshot
            .file_name()
            .map(|n| n.to_string_lossy().into_owned());
        snapshot.parent() == Some(self.cfg.dir.as_path())
            && name.is_some_and(|n| {
                (n.starts_with("prepared-") || n.starts_with("template-")) && !n.contains('.')
            })
    }

    /// A running clone of the template `request` asks for (restored first if the
    /// service keeps none, or one of an older snapshot at that path), counted as lent,
    /// with the template.
    async fn clone_of(&self, request: &Request) -> Result<(Template, VmClone, CloneInfo), Answer> {
        let key = &request.template;
        if !self.is_template(&key.snapshot) {
            return Err(Answer::Error(format!(
                "{} is not a template in {}",
                key.snapshot.display(),
                self.cfg.dir.display()
            )));
        }
        let state = state_id(&key.snapshot)
            .map_err(|e| Answer::Restore(format!("{}: {e}", key.snapshot.display())))?;
        let kept = (self.kept.lock().unwrap_or_else(|p| p.into_inner()))
            .entry(key.clone())
            .or_insert_with(|| {
                Arc::new(Mutex::new(Kept {
                    template: None,
                    state,
                    leases: 0,
                    lent: 0,
                    used: Instant::now(),
                }))
            })
            .clone();
        let template = {
            let mut k = kept.lock().await;
            k.used = Instant::now();
            let usable = (k.template.as_ref()).filter(|t| t.is_alive() && k.state == state);
            let template = match usable {
                Some(t) => t.clone(),
                None => {
                    if let Some(old) = k.template.take() {
                        self.shut_down(key, old).await;
                    }
                    let started = Instant::now();
                    let vsock = self.vsock(key);
                    let warm = self.cfg.warm_clones;
                    let restored =
                        config::template(&self.cfg, &key.snapshot, &vsock, &key.limits, warm)
                            .await
                            .map_err(|e| Answer::Restore(e.to_string()))?;
                    log::info!(
                        "{key}: restored in {:.1} ms",
                        started.elapsed().as_secs_f64() * 1e3
                    );
                    k.state = state;
                    k.lent = 0;
                    k.template = Some(restored.clone());
                    restored
                }
            };
            k.leases += 1;
            k.lent += 1;
            template
        };
        let made = async {
            let req = CreateClones {
                resource_class: Some(CLASS.into()),
                taps: request.tap.iter().cloned().collect(),
                addresses: request.addresses.iter().copied().collect(),
                ..Default::default()
            };
            let clone = (template.create_clones(&req).await?.pop())
                .ok_or_else(|| forkvm::Error::Agent("no clone was made".into()))?;
            let info = (template.clone_table().await?.clones.into_iter())
                .find(|c| c.id == clone.id())
                .ok_or_else(|| forkvm::Error::Agent("the clone is not in its table".into()))?;
            Ok::<_, forkvm::Error>((clone, info))
        };
        match made.await {
            Ok((clone, info)) => Ok((template, clone, info)),
            Err(e) => {
                self.release(&kept).await;
                Err(Answer::Error(format!("the clone: {e}")))
            }
        }
    }

    /// A lease of `kept`'s template has ended.
    async fn release(&self, kept: &Mutex<Kept>) {
        let mut k = kept.lock().await;
        k.leases = k.leases.saturating_sub(1);
        k.used = Instant::now();
    }

    /// Stops template `t` (`key`) and removes its vsock socket.
    async fn shut_down(&self, key: &TemplateKey, t: Template) {
        if let Err(e) = t.shutdown().await {
            log::warn!("{key}: its shutdown: {e}");
        }
        let _ = std::fs::remove_file(self.vsock(key));
    }

    /// Takes the templates that lend nothing and were not asked for within the idle
    /// time, and while more than `FORKVM_SHIM_TEMPLATES_MAX` are kept the least
    /// recently used that lend nothing, to be stopped; forgets those that died with
    /// nothing lent.
    fn evict(&self) -> Vec<(TemplateKey, Template)> {
        let mut kept = self.kept.lock().unwrap_or_else(|p| p.into_inner());
        // Those being lent from now are not looked at (they are in use).
        let seen: Vec<Seen> = (kept.iter())
            .filter_map(|(key, k)| {
                let k = k.try_lock().ok()?;
                Some(Seen {
                    key: key.clone(),
                    leases: k.leases,
                    used: k.used,
                    alive: k.template.as_ref().is_some_and(Template::is_alive),
                })
            })
            .collect();
        let now = Instant::now();
        let mut gone = Vec::new();
        for (key, why) in to_stop(seen, now, self.cfg.template_idle, self.cfg.templates_max) {
            let Some(k) = kept.remove(&key) else {
                continue;
            };
            let Ok(mut k) = k.try_lock() else {
                continue;
            };
            log::info!("{key}: {why}: stopped after lending {} clone(s)", k.lent);
            gone.extend(k.template.take().map(|t| (key, t)));
        }
        gone
    }

    /// Whether the service keeps no template, serves no connection, and has not for
    /// the idle time.
    fn idle(&self) -> bool {
        let quiet = *self.quiet_since.lock().unwrap_or_else(|p| p.into_inner());
        (self.kept.lock().unwrap_or_else(|p| p.into_inner())).is_empty()
            && self.open.load(Ordering::SeqCst) == 0
            && quiet.elapsed() >= self.cfg.template_idle
    }
}

/// Serves one shim's connection: its request, then its calls, until it closes; then
/// stops the clone lent to it.
async fn lend(state: Arc<State>, stream: UnixStream) {
    let (read, mut write) = stream.into_split();
    let mut read = BufReader::new(read);
    let request = match tokio::time::timeout(REQUEST_WAIT, read_line(&mut read)).await {
        Ok(Ok(Some(line))) => serde_json::from_str::<Request>(&line)
            .map_err(|e| Answer::Error(format!("a request the service cannot read: {e}"))),
        Ok(Ok(None)) => Err(Answer::Error(String::new())),
        Ok(Err(e)) => Err(Answer::Error(format!("the request: {e}"))),
        Err(_) => Err(Answer::Error(format!("no request within {REQUEST_WAIT:?}"))),
    };
    let lent = match request {
        Ok(request) => match state.clone_of(&request).await {
            Ok(lent) => Ok((request, lent)),
            Err(answer) => Err(answer),
        },
        Err(answer) => Err(answer),
    };
    match lent {
        Err(answer) => {
            let _ = write.write_all(&answer.line()).await;
        }
        Ok((request, (template, clone, info))) => {
            log::debug!(
                "{}: clone {} (pid {}) lent",
                request.template,
                info.id,
                info.pid
            );
            if write.write_all(&Answer::Clone(info).line()).await.is_ok() {
                serve_calls(&template, clone.id(), &mut read, &mut write).await;
            }
            let id = clone.id().to_string();
            // The shim stops it first, as a rule: then it has ended already.
            if clone.is_alive() {
                if let Err(e) = clone.delete().await {
                    log::warn!("clone {id}: its stop: {e}");
                }
            }
            let kept = (state.kept.lock().unwrap_or_else(|p| p.into_inner()))
                .get(&request.template)
                .cloned();
            if let Some(kept) = kept {
                state.release(&kept).await;
            }
            log::debug!("{}: clone {id} given back", request.template);
        }
    }
    *state.quiet_since.lock().unwrap_or_else(|p| p.into_inner()) = Instant::now();
    state.open.fetch_sub(1, Ordering::SeqCst);
}

/// Answers a lease's calls about clone `id` of `template` until the shim closes the
/// connection (or sends what the service cannot read).
async fn serve_calls(
    template: &Template,
    id: &str,
    read: &mut BufReader<tokio::net::unix::OwnedReadHalf>,
    write: &mut OwnedWriteHalf,
) {
    while let Ok(Some(line)) = read_line(read).await {
        let answer = match serde_json::from_str::<Call>(&line) {
            Ok(Call::Usage) => match template.clone_table().await {
                Ok(list) => (list.clones.into_iter().find(|c| c.id == id))
                    .map_or_else(|| Answer::Error(format!("no clone {id}")), Answer::Usage),
                Err(e) => Answer::Error(format!("the clone table: {e}")),
            },
            Err(e) => Answer::Error(format!("a call the service cannot read: {e}")),
        };
        if write.write_all(&answer.line()).await.is_err() {
            return;
        }
    }
}

/// A kept template as [`to_stop`] weighs it.
struct Seen {
    key: TemplateKey,
    leases: usize,
    used: Instant,
    alive: bool,
}

/// Which of the templates `seen` to stop at `now`, and why: those that lend nothing and
/// died or were not used within `idle`, then, while more than `max` remain, the least
/// recently used of those that lend nothing.
fn to_stop(
    mut seen: Vec<Seen>,
    now: Instant,
    idle: Duration,
    max: usize,
) -> Vec<(TemplateKey, String)> {
    let mut stop = Vec::new();
    seen.retain(|s| {
        let unused = s.leases == 0 && (!s.alive || now.duration_since(s.used) >= idle);
        if unused {
            let why = match s.alive {
                true => format!("not used for {idle:?}"),
                false => "its VMM ended".to_string(),
            };
            stop.push((s.key.clone(), why));
        }
        !unused
    });
    seen.sort_by_key(|s| s.used);
    let mut over = seen.len().saturating_sub(max);
    for s in seen.into_iter().filter(|s| s.leases == 0) {
        if over == 0 {
            break;
        }
        stop.push((
            s.key,
            format!("more than {max} templates kept, the least recently used"),
        ));
        over -= 1;
    }
    stop
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seen(name: &str, leases: usize, used: Instant, alive: bool) -> Seen {
        Seen {
            key: TemplateKey {
                snapshot: name.into(),
                limits: String::new(),
            },
            leases,
            used,
            alive,
        }
    }

    fn names(stop: &[(TemplateKey, String)]) -> Vec<String> {
        (stop.iter())
            .map(|(k, _)| k.snapshot.display().to_string())
            .collect()
    }

    #[test]
    fn idle_dead_and_least_recently_used_templates_go_and_lent_ones_stay() {
        let t0 = Instant::now();
        let s = Duration::from_secs(1);
        let idle = 10 * s;
        let now = t0 + 20 * s;
        let all = || {
            vec![
                seen("idle", 0, t0, true),
                seen("idle-but-lent", 2, t0, true),
                seen("dead", 0, t0 + 19 * s, false),
                seen("old", 0, t0 + 12 * s, true),
                seen("older-but-lent", 1, t0 + 11 * s, true),
                seen("new", 0, t0 + 18 * s, true),
            ]
        };
        // Under the cap: only the idle one and the dead one.
        assert_eq!(names(&to_stop(all(), now, idle, 8)), ["idle", "dead"]);
        // Three kept at most of the four left: the least recently used that lends
        // nothing goes ("older-but-lent" is older, but lends a clone).
        assert_eq!(
            names(&to_stop(all(), now, idle, 3)),
            ["idle", "dead", "old"]
        );
        // One at most: every one that lends nothing goes; lent ones stay over the cap.
        assert_eq!(
            names(&to_stop(all(), now, idle, 1)),
            ["idle", "dead", "old", "new"]
        );
    }
}
