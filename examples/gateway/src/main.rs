//! `forkvm-gateway`: a small FaaS platform on the `forkvm` library (docs/faas.md).
//!
//! It starts a Python zygote template (a Linux guest whose runtime, `python3 -m
//! forkvm`, waits with nothing imported) and serves HTTP:
//! - `PUT /functions/{name}`: a Python handler's source, its packages and limits; its
//!   template is derived from the best zygote of a [`forkvm::ZygoteCache`];
//! - `POST /functions/{name}`: the body is the event; the answer is the handler's
//!   reply, computed in a fresh clone of the function's template (requests at once run
//!   in parallel clones);
//! - `GET /functions`, `DELETE /functions/{name}`, `GET /metrics` (Prometheus);
//! - `PUT /zygotes` (a zygote of a package set made ahead), `GET /zygotes`;
//! - `GET /package-sets` (functions' PyPI requirements, resolved and cached).
//!
//! When the base template's VMM dies, the gateway starts another and derives the
//! functions' templates again as they are invoked.

mod base;
mod gateway;
mod logs;
mod metrics;
mod packages;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::DefaultBodyLimit;
use axum::routing::{get, put};
use axum::Router;
use clap::Parser;
use forkvm::{guest_file, TemplateSpec, ZygoteCache};
use forkvm::{CachePolicy, JailSpec, PackageCache, PackageSource, ResourceClass};

use gateway::Gateway;

/// The Python runtime as a zygote: it imports nothing until a load request.
const ZYGOTE: &str = "python3 -m forkvm";

#[derive(Parser, Debug, Clone)]
#[command(
    version,
    about = "A FaaS gateway on forkvm: Python functions, each request in a fresh VM clone"
)]
struct Args {
    /// Address to serve HTTP on.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// The guest kernel (default: `vmlinux` in `../share/forkvm` beside this program
    /// when installed there, else in `target/guest`).
    #[arg(long)]
    kernel: Option<PathBuf>,
    /// The Python root image, read-only (default: `python.ext4`, found as the kernel).
    #[arg(long)]
    rootfs: Option<PathBuf>,
    /// The `vmm` program (default: `$FORKVM_VMM`, else beside this program, else PATH).
    #[arg(long)]
    vmm: Option<PathBuf>,
    /// Guest memory of the base template (and so of every clone), in MiB.
    #[arg(long, default_value_t = 256)]
    mem_mib: u32,
    /// Warm clones each template keeps ready.
    #[arg(long, default_value_t = 2)]
    warm_clones: u32,
    /// A resource class functions may name (`NAME:cpu=C,memory=M,pids=N`, as `vmm run
    /// --cgroup-class`); repeatable. Without, clones are not placed in cgroups.
    #[arg(long = "class", value_parser = parse_class)]
    classes: Vec<(String, ResourceClass)>,
    /// The memory the cached templates may hold (their own: copy-on-write sharing not
    /// counted), in MiB; least recently used templates beyond it are stopped.
    #[arg(long, default_value_t = 4096)]
    memory_budget_mib: u64,
    /// Deployments of one package set before a zygote of it is made.
    #[arg(long, default_value_t = 2)]
    create_after: u32,
    /// How long a deployment (imports and the handler's source in a guest) may take, in
    /// seconds.
    #[arg(long, default_value_t = 600)]
    load_timeout_s: u64,
    /// How long the base template may take to boot and wait, in seconds.
    #[arg(long, default_value_t = 600)]
    start_timeout_s: u64,
    /// Keep the base template as a snapshot in DIR: a start (and a restart after the
    /// base template died) restores it from there in milliseconds when the kernel, the
    /// root image, the memory and the `--vmm-arg`s are those it was saved with, and
    /// otherwise boots it and saves it there (replacing the snapshot of other inputs).
    /// Not with --jail yet.
    #[arg(long, value_name = "DIR", conflicts_with = "jail")]
    base_snapshot: Option<PathBuf>,
    /// Resolve functions' `requirements` (PyPI) into package sets kept in DIR as
    /// read-only disk images, one per resolved set, shared by every function that needs
    /// it (the base template then has a disk slot for them). Without, a function with
    /// requirements is refused. Not with --jail yet (a jailed VMM cannot open the
    /// images outside its jail).
    #[arg(long, value_name = "DIR", conflicts_with = "jail")]
    package_cache: Option<PathBuf>,
    /// The most the package cache's images may take, in MiB; the least recently used
    /// beyond it are removed (never one a cached template uses).
    #[arg(long, default_value_t = 4096, requires = "package_cache")]
    package_cache_mib: u64,
    /// Take wheels only from DIR, never from a package index (`pip --no-index
    /// --find-links DIR`), for hosts that reach none.
    #[arg(long, value_name = "DIR", requires = "package_cache")]
    find_links: Option<PathBuf>,
    /// Functions' invocation clones, once they answered, are put back in their
    /// template's state and serve another request instead of ending (`vmm run
    /// --rewind`; docs/invoke.md, "Rewound clones": what each request still gets).
    #[arg(long)]
    rewind: bool,
    /// Fork sources per template, the template included (`vmm run --fork-sources`;
    /// 1 to 64): each function's template has N-1 clones of itself that are templates
    /// too, each with `--warm-clones` of its own, serving its requests in turn, so that
    /// a popular function's clones are forked by N processes at once (docs/invoke.md,
    /// "Fork sources"). More memory and idle CPU per function for a rate that grows
    /// with the host's cores.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..=64))]
    fork_sources: u64,
    /// A further `vmm run` option for the base template (repeatable; `--vmm-arg=--no-prime`).
    #[arg(long = "vmm-arg", allow_hyphen_values = true)]
    vmm_args: Vec<String>,
    /// Run the VMMs in forkvm's jailer as user UID and group GID (not 0; the gateway
    /// must run as root): every template and clone unprivileged, chrooted, in namespaces
    /// of its own, under seccomp (docs/jailer.md).
    #[arg(long, value_name = "UID:GID", value_parser = parse_ids)]
    jail: Option<(u32, u32)>,
    /// Where jails are made, with --jail.
    #[arg(long, default_value = "/srv/jailer", requires = "jail")]
    chroot_base: PathBuf,
    /// The `jailer` program, with --jail (default: `$FORKVM_JAILER`, else beside this
    /// program, else PATH).
    #[arg(long, requires = "jail")]
    jailer: Option<PathBuf>,
}

fn parse_ids(s: &str) -> Result<(u32, u32), String> {
    let (u, g) = s.split_once(':').ok_or("expected UID:GID")?;
    let id = |v: &str| v.parse::<u32>().map_err(|e| format!("{v:?}: {e}"));
    match (id(u)?, id(g)?) {
        (0, _) | (_, 0) => Err("the jail's user and group must not be 0 (root)".into()),
        ids => Ok(ids),
    }
}

#[derive(Debug, thiserror::Error)]
enum GatewayError {
    #[error("the base template did not start: {0}")]
    Base(#[from] forkvm::Error),
    #[error(transparent)]
    SnapshotDir(#[from] base::SnapshotDirError),
    #[error(transparent)]
    Packages(#[from] forkvm::PackageError),
    #[error("a task of the gateway failed: {0}")]
    Task(String),
    #[error("cannot serve on {addr}: {source}")]
    Listen {
        addr: String,
        source: std::io::Error,
    },
    #[error("HTTP server: {0}")]
    Serve(std::io::Error),
}

/// Starts the base template (restored from `--base-snapshot` when it can be) and its
/// cache.
/// `--class NAME:LIMITS`: the class's name and limits (the VMM checks the name).
fn parse_class(s: &str) -> Result<(String, ResourceClass), String> {
    let (name, limits) = s.split_once(':').unwrap_or((s, ""));
    if name.is_empty() {
        return Err("a class is NAME:cpu=C,memory=M,pids=N".into());
    }
    Ok((name.to_string(), limits.parse()?))
}

async fn start_cache(args: &Args) -> Result<ZygoteCache, GatewayError> {
    let kernel = (args.kernel.clone()).unwrap_or_else(|| guest_file("vmlinux"));
    let rootfs = (args.rootfs.clone()).unwrap_or_else(|| guest_file("python.ext4"));
    let mut spec = TemplateSpec::new(&kernel);
    if let Some(v) = &args.vmm {
        spec.vmm.clone_from(v);
    }
    spec.rootfs = Some(rootfs.clone());
    let cmdline = format!(
        "console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda ro rootfstype=ext4 forkvm.run=\"{ZYGOTE}\""
    );
    spec.cmdline = Some(cmdline.clone());
    spec.mem_mib = args.mem_mib;
    spec.warm_clones = args.warm_clones;
    spec.start_timeout = Duration::from_secs(args.start_timeout_s);
    spec.options.cgroup_classes.clone_from(&args.classes);
    spec.options.rewind = args.rewind;
    spec.options.fork_sources = (args.fork_sources > 1).then_some(args.fork_sources as usize);
    let mut vmm_args = args.vmm_args.clone();
    let slots_given = (vmm_args.iter()).any(|a| a.split('=').next() == Some("--disk-slots"));
    if args.package_cache.is_some() && !slots_given {
        // Package sets' images go in a disk slot of the base template.
        vmm_args.extend(["--disk-slots".to_string(), "1".to_string()]);
    }
    spec.args.extend(vmm_args.iter().cloned());
    let restore_args = base::restore_args(&spec.args);
    if let Some((uid, gid)) = args.jail {
        let mut jail = JailSpec::new(uid, gid);
        jail.chroot_base.clone_from(&args.chroot_base);
        if let Some(j) = &args.jailer {
            jail.jailer.clone_from(j);
        }
        spec.jail = Some(jail);
    }
    let inputs = base::Inputs {
        kernel,
        rootfs,
        vmm: spec.vmm.clone(),
        cmdline,
        mem_mib: args.mem_mib,
        vmm_args,
    };
    let snapshots = args.base_snapshot.as_deref().map(|d| (d, &inputs));
    let base = base::start(spec, snapshots, restore_args).await?;
    let mut policy = CachePolicy::default();
    policy.create_after = args.create_after;
    policy.memory_budget_kib = args.memory_budget_mib * 1024;
    policy.load_timeout_ms = args.load_timeout_s * 1000;
    let cache = ZygoteCache::new(base, policy).await?;
    let Some(dir) = &args.package_cache else {
        return Ok(cache);
    };
    let packages = PackageCache::new(dir, args.package_cache_mib << 20)?;
    let source = match &args.find_links {
        Some(links) => PackageSource::FindLinks(links.clone()),
        None => PackageSource::Index,
    };
    Ok(cache.with_packages(packages, source))
}

/// Starts another base template whenever the current one's VMM dies.
async fn supervise(g: Arc<Gateway>, args: Args) {
    loop {
        let base = g.cache().base();
        let e = base.died().await;
        drop(base);
        tracing::error!("the base template died: {e}; starting another");
        loop {
            match start_cache(&args).await {
                Ok(cache) => {
                    g.replace_cache(cache);
                    break;
                }
                Err(e) => {
                    tracing::error!("cannot start a base template: {e}; trying again in 5 s");
                    tokio::time::sleep(Duration::from_secs(5)).await;
                }
            }
        }
    }
}

async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {},
        _ = int.recv() => {},
    }
    tracing::info!("shutting down");
}

async fn run(args: Args) -> Result<(), GatewayError> {
    let listener = tokio::net::TcpListener::bind(&args.listen)
        .await
        .map_err(|source| GatewayError::Listen {
            addr: args.listen.clone(),
            source,
        })?;
    let cache = start_cache(&args).await?;
    let classes = args.classes.iter().map(|(name, _)| name.clone()).collect();
    let packages = args.package_cache.is_some();
    let g = Arc::new(Gateway::new(cache, classes, packages));
    let supervisor = tokio::spawn(supervise(g.clone(), args.clone()));
    let app = Router::new()
        .route("/functions", get(gateway::list))
        .route(
            "/functions/{name}",
            put(gateway::deploy)
                .post(gateway::invoke)
                .delete(gateway::delete),
        )
        .route("/functions/{name}/logs", get(gateway::logs))
        .route("/zygotes", get(gateway::zygotes).put(gateway::prepare))
        .route("/package-sets", get(gateway::package_sets))
        .route("/metrics", get(gateway::metrics))
        // Events up to the default mailbox (4 MiB less its header).
        .layer(DefaultBodyLimit::max((4 << 20) - 64))
        .with_state(g.clone());
    tracing::info!("serving on http://{}", args.listen);
    println!("forkvm-gateway: serving on http://{}", args.listen);
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(shutdown_signal())
        .await;
    supervisor.abort();
    let _ = supervisor.await;
    // The last handles of every template: each VMM is stopped (clones with it), on the
    // library's threads; waited for before the process ends.
    drop(g);
    let stopped = tokio::task::spawn_blocking(|| forkvm::wait_stopped(Duration::from_secs(10)));
    if !matches!(stopped.await, Ok(true)) {
        tracing::warn!("some templates had not stopped after 10 s");
    }
    served.map_err(GatewayError::Serve)
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "forkvm_gateway=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("forkvm-gateway: cannot start tokio: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("forkvm-gateway: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
