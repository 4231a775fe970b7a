//! `vmm`: the forkvm monitor's command line.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand};

use api_types::{CloneConsole, TargetState};
use forkvm_client::api as client;
use vmm::config::{
    ApBoot, CgroupConfig, ClonePolicy, ConsoleSink, HostPolicy, InvokePolicy, MachineConfig,
    VmConfig, DEFAULT_CMDLINE,
};
use vmm_api::cli::{parse_cgroup_class, parse_console, parse_disk};
use vmm_api::HttpEdge;

#[derive(Parser)]
#[command(
    name = "vmm",
    version,
    about = "forkvm: a KVM microVM monitor with flash cloning"
)]
struct Cli {
    /// Log level (logs go to stderr). The virtio-queue crate's own messages are off:
    /// a guest could repeat them without end; the devices log bad rings, thinned.
    #[arg(long, global = true, default_value = "warn",
          value_parser = ["off", "error", "warn", "info", "debug", "trace"])]
    log_level: String,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Boot a guest and run until it powers off.
    Run(Box<RunArgs>),
    /// Print the VM's state (GET /vm).
    Status(SockArg),
    /// Pause every vCPU (PATCH /vm).
    Pause(SockArg),
    /// Resume a paused VM (PATCH /vm).
    Resume(SockArg),
    /// Shut the VM down (PUT /actions).
    Shutdown(SockArg),
    /// Clone the running VM (POST /clones); prints one line per clone.
    Fork(ForkArgs),
    /// List this VM's clones (GET /clones).
    Clones(SockArg),
    /// Run a shell command in the guest through vsock and forkvm-agent; prints its
    /// output and exits with its status.
    Exec(ExecArgs),
    /// Run an invocation (POST /invocations): prints the handler's reply; exits 0 when
    /// the handler returned, 1 otherwise (the error on stderr).
    Invoke(InvokeArgs),
    /// Write a snapshot of the paused VM to a new directory (PUT /snapshot); prints what
    /// was written.
    Snapshot(SnapshotArgs),
    /// Start a VM from a snapshot directory and run until it stops (as `run` does).
    Restore(Box<RestoreArgs>),
    /// Print the control API's OpenAPI description (YAML; docs/api/openapi.yaml).
    Openapi,
    /// Print this build's saved-state id (16 hex digits): builds with the same id
    /// restore each other's snapshots (docs/snapshots.md).
    StateId,
}

#[derive(clap::Args)]
struct SnapshotArgs {
    /// The VM's control socket.
    #[arg(long)]
    api_sock: PathBuf,
    /// The snapshot's directory (must not exist; its parent must). Its files hold guest
    /// memory and are owner-only.
    #[arg(long)]
    dir: PathBuf,
}

#[derive(clap::Args)]
struct RestoreArgs {
    /// The snapshot's directory (`vmm snapshot`).
    #[arg(long)]
    dir: PathBuf,
    /// Control socket path (REST over a Unix socket).
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// Serial console sink: stdout, null, or a file path.
    #[arg(long, default_value = "stdout", value_parser = parse_console)]
    console: ConsoleSink,
    /// Keep the VM paused once restored (a template for clones) instead of running it.
    #[arg(long)]
    paused: bool,
    /// While the VM is paused, keep this many clones forked and prepared (0 to 256).
    #[arg(long, default_value_t = 0)]
    warm_clones: usize,
    /// Most live clones (1 to 2000).
    #[arg(long, default_value_t = vmm::config::MAX_LIVE_CLONES)]
    max_clones: usize,
    /// Most live clones of the whole tree: this VM's, their clones', and so on (1 to
    /// 65536); requests beyond are refused (409), a guest's too
    #[arg(long, default_value_t = vmm::config::MAX_LIVE_CLONES)]
    max_tree_clones: usize,
    /// The most of a template's working set (the guest pages its invocation clones
    /// write, learned from its first clones) that each warm clone copies ahead, before
    /// its request comes (an invocation's clone forked on its request too), in MiB (0:
    /// none; at most 16384; docs/invoke.md).
    #[arg(long, default_value_t = vmm::config::DEFAULT_WORKING_SET_MIB)]
    working_set_mib: u64,
    /// A template's fork sources, itself included (1 to 64): the others are clones of
    /// it, templates themselves with warm clones of their own, that serve its
    /// invocations in turn, so that several processes fork its clones at once
    /// (docs/invoke.md)
    #[arg(long, default_value_t = 1)]
    fork_sources: usize,
    /// The host tap of the network card (default: the snapshot's).
    #[arg(long)]
    tap: Option<String>,
    /// The host side of the vsock device (default: `<api-sock>.vsock`).
    #[arg(long)]
    vsock: Option<PathBuf>,
    /// Where writable disks' and slots' overlays go (default: the snapshot's directories).
    #[arg(long, value_name = "DIR")]
    cow_dir: Option<PathBuf>,
    /// A template's invocation clones, once they answered, are rewound to its state
    /// and serve another request instead of ending (as `vmm run --rewind`).
    #[arg(long)]
    rewind: bool,
    #[command(flatten)]
    cgroups: CgroupArgs,
    /// Seccomp filters per thread kind (as `run`).
    #[arg(long, default_value = "kill")]
    seccomp: jailer::seccomp::SeccompMode,
}

#[derive(clap::Args)]
struct InvokeArgs {
    /// The template's (or a keep-alive clone's) control socket.
    #[arg(long)]
    api_sock: PathBuf,
    /// The payload: text, `@FILE`, or `-` for standard input (default: empty).
    #[arg(long)]
    data: Option<String>,
    /// How long the handler may take, in milliseconds (default 30000; with --derive, 300000).
    #[arg(long)]
    timeout_ms: Option<u64>,
    /// The clone's resource class (with cgroup pools).
    #[arg(long)]
    class: Option<String>,
    /// The clone serves further invocations on its own socket after this one.
    #[arg(long)]
    keep_alive: bool,
    /// Derive a template: the payload goes to the runtime's loader, and the clone is a
    /// template of its own afterwards (its socket printed with -v).
    #[arg(long)]
    derive: bool,
    /// An image for a disk slot of the clone, SLOT:PATH (the template's --disk-slots),
    /// read-only, or rw:SLOT:PATH, writable through the clone's own overlay (the
    /// template's --slot-cow-dir); repeat for more slots.
    #[arg(long, value_name = "[rw:]SLOT:PATH")]
    medium: Vec<api_types::InsertMedium>,
    /// Print the outcome, clone id, socket and timings on stderr.
    #[arg(long, short)]
    verbose: bool,
}

#[derive(clap::Args)]
struct ExecArgs {
    /// The VM's control socket.
    #[arg(long)]
    api_sock: PathBuf,
    /// The agent's vsock port in the guest.
    #[arg(long, default_value_t = 1024)]
    port: u32,
    /// Send this process's standard input to the command.
    #[arg(long)]
    stdin: bool,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 60)]
    timeout: u64,
    /// The command (joined with spaces and run with `sh -c`).
    #[arg(last = true, required = true)]
    command: Vec<String>,
}

#[derive(clap::Args)]
struct ForkArgs {
    /// The VM's control socket.
    #[arg(long)]
    api_sock: PathBuf,
    /// How many clones.
    #[arg(long, default_value_t = 1)]
    count: u64,
    /// Where the clones' consoles go: a file per clone, or nowhere.
    #[arg(long, value_enum, default_value_t = CloneConsole::File)]
    console: CloneConsole,
    /// Resource class of the clones' cgroups (default: the VM's first --cgroup-class).
    #[arg(long)]
    class: Option<String>,
    /// An image for a disk slot of every clone, SLOT:PATH (the VM's --disk-slots),
    /// read-only, or rw:SLOT:PATH, writable through each clone's own overlay (the VM's
    /// --slot-cow-dir); repeat for more slots.
    #[arg(long, value_name = "[rw:]SLOT:PATH")]
    medium: Vec<api_types::InsertMedium>,
}

#[derive(clap::Args)]
struct SockArg {
    /// The VM's control socket.
    #[arg(long)]
    api_sock: PathBuf,
}

#[derive(clap::Args)]
struct RunArgs {
    /// Kernel: ELF vmlinux (entered through PVH when it has the note) or bzImage.
    #[arg(long)]
    kernel: PathBuf,
    /// Initramfs image.
    #[arg(long)]
    initrd: Option<PathBuf>,
    /// Read-only disk image, attached as virtio-blk /dev/vda (before any --disk).
    #[arg(long)]
    rootfs: Option<PathBuf>,
    /// Rate limit for the disk: bytes read and requests (same syntax as
    /// --rng-rate-limit).
    #[arg(long, requires = "rootfs")]
    rootfs_rate_limit: Option<api_types::RateLimit>,
    /// Make the disk writable through a private copy-on-write overlay, an anonymous
    /// file in this directory (gone when the VM exits); the image is never written.
    /// Each clone gets a copy of its parent's overlay.
    #[arg(long, requires = "rootfs", value_name = "DIR")]
    rootfs_cow: Option<PathBuf>,
    /// Another disk, PATH[,cow=DIR[,keep]][,bytes=..][,ops=..]: read-only unless cow=
    /// names a directory for its overlay (kept there as fkvm<pid>-disk<N>.overlay when
    /// the VM ends, with keep), limited by bytes=/ops= (as --rng-rate-limit). Repeat for
    /// more; they follow --rootfs as /dev/vdb, /dev/vdc, ...
    #[arg(long, value_name = "SPEC", value_parser = parse_disk)]
    disk: Vec<vmm::config::DiskConfig>,
    /// Disk slots after the disks (0 to 8): disks with no medium, into which a clone
    /// request inserts an image (`POST /clones` `media`, `vmm fork --medium`); the
    /// guest sees the new capacity through a configuration-change interrupt
    #[arg(long, default_value_t = 0, value_name = "N")]
    disk_slots: u8,
    /// Make the disk slots writable: the guest sees them as writable disks, and a
    /// medium inserted writable (`rw:SLOT:PATH`) takes the guest's writes into an
    /// overlay of the clone's own in DIR (anonymous: gone with the clone), never into
    /// the image; a read-only medium refuses writes
    #[arg(long, value_name = "DIR", requires = "disk_slots")]
    slot_cow_dir: Option<PathBuf>,
    /// Attach a virtio-rng entropy device (/dev/hwrng in the guest), fed from the
    /// host's getrandom.
    #[arg(long)]
    rng: bool,
    /// Rate limit for the entropy device: bytes=SIZE[/MS][+BURST],ops=N[/MS][+BURST]
    /// (SIZE may end in K, M or G; MS is the refill period, default 1000). Implies --rng.
    #[arg(long)]
    rng_rate_limit: Option<api_types::RateLimit>,
    /// Attach a virtio-vsock device whose host side listens on this Unix socket (hosts
    /// connect and write `CONNECT <port>`; guest connections to host port P reach
    /// `PATH_P`). Each clone listens on `<its control socket>.vsock`.
    #[arg(long)]
    vsock: Option<PathBuf>,
    /// The guest's vsock CID.
    #[arg(long, default_value_t = 3)]
    vsock_cid: u64,
    /// Attach a virtio-net card over this host tap device (created if missing, which
    /// needs CAP_NET_ADMIN). Each clone creates its own tap, `fkvm<its pid>`.
    #[arg(long)]
    tap: Option<String>,
    /// The card's MAC address (a clone's keeps the first three bytes, then its pid).
    #[arg(long, default_value_t = vmm::config::DEFAULT_MAC, requires = "tap")]
    mac: vmm::config::MacAddr,
    /// Rate limit for each direction of the card (same syntax as --rng-rate-limit).
    #[arg(long, requires = "tap")]
    net_rate_limit: Option<api_types::RateLimit>,
    /// The guest's address for the card, ADDR/PREFIX, told to the guest through the
    /// identity block (forkvm-clone --net applies it; clones get theirs from POST
    /// /clones or keep this one).
    #[arg(long, requires = "tap")]
    ipv4: Option<vmm::config::Ipv4Cidr>,
    /// The guest's default gateway, told to the guest as --ipv4 is.
    #[arg(long, requires = "ipv4")]
    gateway: Option<std::net::Ipv4Addr>,
    /// Guest memory in MiB.
    #[arg(long, default_value_t = 128)]
    mem_mib: u64,
    /// Number of vCPUs.
    #[arg(long, default_value_t = 1)]
    vcpus: u8,
    /// Kernel command line.
    #[arg(long, default_value = DEFAULT_CMDLINE)]
    cmdline: String,
    /// Serial console sink: stdout, null, or a file path.
    #[arg(long, default_value = "stdout", value_parser = parse_console)]
    console: ConsoleSink,
    /// Control socket path (REST over a Unix socket).
    #[arg(long)]
    api_sock: Option<PathBuf>,
    /// Do not apply host-specific guest fixes (on PVM: CPUID filtering and kernel switches).
    #[arg(long)]
    no_host_quirks: bool,
    /// Do not advise transparent huge pages for guest RAM.
    #[arg(long)]
    no_thp: bool,
    /// Populate all guest RAM before boot, as if the guest had touched every page.
    #[arg(long)]
    prefault: bool,
    /// How vCPUs other than 0 start.
    #[arg(long, value_enum, default_value_t = ApBoot::Sipi)]
    ap_boot: ApBoot,
    /// While the VM is paused, keep this many clones forked and prepared so that
    /// `vmm fork` only launches them (0 to 256)
    #[arg(long, default_value_t = 0)]
    warm_clones: usize,
    /// Most live clones (1 to 2000); clone requests beyond are refused (409), and so is
    /// an invocation that needs a clone
    #[arg(long, default_value_t = vmm::config::MAX_LIVE_CLONES)]
    max_clones: usize,
    /// Most live clones of the whole tree: this VM's, their clones', and so on (1 to
    /// 65536); requests beyond are refused (409), a guest's too
    #[arg(long, default_value_t = vmm::config::MAX_LIVE_CLONES)]
    max_tree_clones: usize,
    /// The most of a template's working set (the guest pages its invocation clones
    /// write, learned from its first clones) that each warm clone copies ahead, before
    /// its request comes (an invocation's clone forked on its request too), in MiB (0:
    /// none; at most 16384; docs/invoke.md).
    #[arg(long, default_value_t = vmm::config::DEFAULT_WORKING_SET_MIB)]
    working_set_mib: u64,
    /// A template's fork sources, itself included (1 to 64): the others are clones of
    /// it, templates themselves with warm clones of their own, that serve its
    /// invocations in turn, so that several processes fork its clones at once
    /// (docs/invoke.md)
    #[arg(long, default_value_t = 1)]
    fork_sources: usize,
    #[command(flatten)]
    cgroups: CgroupArgs,
    /// The invocation mailbox's size in MiB (0: none; 1 to 256): the largest request
    /// or reply is this less 64 bytes.
    #[arg(long, default_value_t = vmm::config::DEFAULT_MAILBOX_MIB)]
    mailbox_mib: u32,
    /// A template: pause the first time the guest's runtime waits for a request; each
    /// invocation then runs in a clone of it (keep --warm-clones ready).
    #[arg(long)]
    template: bool,
    /// Refresh a runtime that has waited this long for a request (ms; 0, the default:
    /// only after 30 s): it reads "no request" and waits again, so the guest kernel
    /// catches up on the time that passed before the next request rather than on its
    /// path; a template pauses again and replaces its warm clones (docs/invoke.md).
    #[arg(long, default_value_t = vmm::config::DEFAULT_REFRESH_IDLE_MS)]
    refresh_idle_ms: u64,
    /// When a request is delivered, move a guest timer interrupt already due (or due
    /// sooner) this many ms on, so the handler runs before the kernel catches up on the
    /// time the guest did not run (0: deliver it at once; at most 1000).
    #[arg(long, default_value_t = vmm::config::DEFAULT_TICK_DEFER_MS)]
    tick_defer_ms: u64,
    /// A template's invocation clones, once they answered, are rewound to the
    /// template's state (the guest memory they wrote copied back, vCPUs restored) and
    /// serve another request in the same host process and KVM VM, instead of ending
    /// (docs/invoke.md, "Rewound clones": what it keeps and what it costs). Not yet for
    /// a VM with a writable disk (or a writable medium of its own in a slot), a network
    /// device, or cgroup pools: their clones end as before.
    #[arg(long)]
    rewind: bool,
    /// Do not prime a template's warm clones (by default each runs its runtime's serving
    /// path once, without the handler, before its request comes, when the runtime
    /// declares it can: docs/invoke.md).
    #[arg(long)]
    no_prime: bool,
    /// Seccomp filters per thread kind: a system call outside them kills the process
    /// (kill), only the thread (kill-thread), is logged to the kernel log (log), or
    /// no filters (off).
    #[arg(long, default_value = "kill")]
    seccomp: jailer::seccomp::SeccompMode,
}

/// Cgroup pools for clones (`run` and `restore`).
#[derive(clap::Args)]
struct CgroupArgs {
    /// A resource class for clones, NAME[:cpu=CPUS,memory=BYTES[K|M|G],pids=N]; each gets
    /// a pool of ready cgroups and every clone is placed in one. Repeat for more classes;
    /// the first is the default.
    #[arg(long = "cgroup-class", value_parser = parse_cgroup_class)]
    cgroup_classes: Vec<(String, api_types::ResourceClass)>,
    /// cgroup version for the pools, 1 or 2 (default: v2 on a v2-only host, else v1).
    #[arg(long)]
    cgroup_version: Option<api_types::cgroup::CgroupVersion>,
    /// Directory in each cgroup hierarchy that the pools go under (as `<dir>/vmm-<pid>`).
    #[arg(long, default_value = "forkvm")]
    cgroup_parent: String,
    /// Ready cgroups kept per class.
    #[arg(long, default_value_t = 4)]
    cgroup_pool_size: usize,
    /// Most cgroups per class; further clone requests wait or fail.
    #[arg(long, default_value_t = 256)]
    cgroup_pool_max: usize,
    /// How long a clone request waits for a free cgroup at the maximum (0: fail at once).
    #[arg(long, default_value_t = 0)]
    cgroup_wait_ms: u64,
}

impl CgroupArgs {
    fn config(&self) -> Option<CgroupConfig> {
        (!self.cgroup_classes.is_empty()).then(|| CgroupConfig {
            classes: self.cgroup_classes.clone(),
            version: self.cgroup_version,
            parent: self.cgroup_parent.clone(),
            pool_size: self.cgroup_pool_size,
            pool_max: self.cgroup_pool_max,
            wait_ms: self.cgroup_wait_ms,
        })
    }
}

fn init_logging(level: &str) -> Result<(), String> {
    // virtio-queue logs an error for each bad ring a guest offers, which a guest can do
    // without end; the devices log what matters, thinned.
    let filter = tracing_subscriber::EnvFilter::try_new(format!("{level},virtio_queue=off"))
        .map_err(|e| format!("invalid --log-level {level:?}: {e}"))?;
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(vmm::logging::RawStderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_target(false)
        .init();
    Ok(())
}

/// Prints what a control-socket call returned (as JSON, if anything) or its error.
fn print_answer<T: serde::Serialize>(answer: Result<T, client::ClientError>) -> ExitCode {
    match answer {
        Ok(value) => {
            match serde_json::to_value(&value) {
                Ok(serde_json::Value::Null) => {}
                Ok(v) => println!("{v}"),
                Err(e) => eprintln!("vmm: {e}"),
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("vmm: {e}");
            ExitCode::FAILURE
        }
    }
}

fn exec(e: &ExecArgs) -> ExitCode {
    use std::io::{Read, Write};
    let mut input = Vec::new();
    if e.stdin {
        if let Err(err) = std::io::stdin().read_to_end(&mut input) {
            eprintln!("vmm: reading standard input: {err}");
            return ExitCode::FAILURE;
        }
    }
    let command = e.command.join(" ");
    let timeout = std::time::Duration::from_secs(e.timeout);
    match forkvm_client::agent::exec(&e.api_sock, e.port, &command, &input, timeout) {
        Ok(out) => {
            let _ = std::io::stdout().write_all(&out.output);
            ExitCode::from(out.status.clamp(0, 255) as u8)
        }
        Err(err) => {
            eprintln!("vmm: {err}");
            ExitCode::from(255)
        }
    }
}

fn fork(f: &ForkArgs) -> ExitCode {
    let request = api_types::CreateClones {
        count: f.count,
        console: f.console,
        resource_class: f.class.clone(),
        media: f.medium.clone(),
        ..Default::default()
    };
    let made = match client::create_clones(&f.api_sock, &request) {
        Ok(list) => list.clones,
        Err(e) => {
            eprintln!("vmm: {e}");
            return ExitCode::FAILURE;
        }
    };
    println!(
        "{:<8} {:>8} {:>12}  {:<10} api_sock / console",
        "id", "pid", "latency_us", "status"
    );
    for c in made {
        let latency = c.latency_us.map_or_else(|| "-".into(), |l| l.to_string());
        let status = serde_json::to_value(c.status).map_or_else(
            |_| "?".into(),
            |v| v["state"].as_str().unwrap_or("?").to_string(),
        );
        println!(
            "{:<8} {:>8} {:>12}  {:<10} {} {}",
            c.id,
            c.pid,
            latency,
            status,
            c.api_sock.display(),
            c.console.display(),
        );
        if let Some(cg) = c.cgroup {
            let placed = serde_json::to_value(cg.placed_by).unwrap_or_default();
            println!("{:<8} cgroup {} ({placed})", "", cg.path);
        }
    }
    ExitCode::SUCCESS
}

/// Raises the open-file soft limit to the hard limit: a VMM holds a few descriptors per
/// clone while making them (1000 clones need more than the common default of 1024).
fn raise_nofile_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    if let Ok((soft, hard)) = getrlimit(Resource::RLIMIT_NOFILE) {
        if soft < hard {
            let _ = setrlimit(Resource::RLIMIT_NOFILE, hard, hard);
        }
    }
}

fn invoke(i: &InvokeArgs) -> ExitCode {
    use std::io::{Read, Write};
    let payload = match i.data.as_deref() {
        None => Ok(Vec::new()),
        Some("-") => {
            let mut v = Vec::new();
            std::io::stdin().read_to_end(&mut v).map(|_| v)
        }
        Some(d) => match d.strip_prefix('@') {
            Some(file) => std::fs::read(file),
            None => Ok(d.as_bytes().to_vec()),
        },
    };
    let payload = match payload {
        Ok(p) => p,
        Err(e) => {
            eprintln!("vmm: reading the payload: {e}");
            return ExitCode::FAILURE;
        }
    };
    let options = api_types::InvokeOptions {
        timeout_ms: i.timeout_ms,
        resource_class: i.class.clone(),
        keep_alive: i.keep_alive,
        derive: i.derive,
        media: i.medium.clone(),
        ..Default::default()
    };
    let r = match client::invoke(&i.api_sock, &options, &payload) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("vmm: {e}");
            return ExitCode::FAILURE;
        }
    };
    if i.verbose {
        for (name, value) in r.headers.iter().filter(|(n, _)| n.starts_with("x-forkvm-")) {
            eprintln!("{name}: {value}");
        }
    }
    if r.status == 200 {
        let mut out = std::io::stdout();
        let _ = out.write_all(&r.bytes).and_then(|()| out.flush());
        return ExitCode::SUCCESS;
    }
    let message =
        serde_json::from_str::<api_types::ErrorBody>(&r.body).map_or(r.body.clone(), |e| e.error);
    eprintln!("vmm: error {}: {message}", r.status);
    ExitCode::FAILURE
}

/// The exit status of a VM that ran (`run`, `restore`), its error printed.
fn finish(result: Result<vmm::microvm::RunOutcome, vmm::VmmError>) -> ExitCode {
    match result {
        Ok(outcome) => {
            if let vmm::microvm::RunOutcome::Error(msg) = &outcome {
                eprintln!("vmm: guest stopped: {msg}");
            }
            ExitCode::from(outcome.exit_code() as u8)
        }
        Err(e) => {
            eprintln!("vmm: {e}");
            ExitCode::FAILURE
        }
    }
}

fn main() -> ExitCode {
    // glibc reports a fatal error it detects (heap corruption, a failed check) on
    // /dev/tty unless this is set: opening it is outside every thread's seccomp filter,
    // so the process died of SIGSYS without a word. With it, the message goes to stderr.
    // Set before any thread exists.
    std::env::set_var("LIBC_FATAL_STDERR_", "1");
    vmm::sandbox::install_panic_hook();
    let cli = Cli::parse();
    raise_nofile_limit();
    if let Err(e) = init_logging(&cli.log_level) {
        eprintln!("vmm: {e}");
        return ExitCode::from(2);
    }
    match cli.command {
        Command::Run(a) => {
            let a = *a;
            let disks = (a.rootfs)
                .map(|path| vmm::config::DiskConfig {
                    path,
                    cow_dir: a.rootfs_cow,
                    keep: false,
                    rate_limit: a.rootfs_rate_limit,
                })
                .into_iter()
                .chain(a.disk)
                .collect();
            let config = VmConfig {
                machine: MachineConfig {
                    initrd: a.initrd,
                    disks,
                    disk_slots: a.disk_slots,
                    slot_cow_dir: a.slot_cow_dir,
                    rng: (a.rng || a.rng_rate_limit.is_some()).then_some(vmm::config::RngConfig {
                        rate_limit: a.rng_rate_limit,
                    }),
                    vsock: a.vsock.map(|uds_path| vmm::config::VsockConfig {
                        cid: a.vsock_cid,
                        uds_path,
                    }),
                    net: a.tap.map(|tap| vmm::config::NetConfig {
                        tap,
                        mac: a.mac,
                        rate_limit: a.net_rate_limit,
                        ipv4: a.ipv4,
                        gateway: a.gateway,
                    }),
                    mem_mib: a.mem_mib,
                    vcpus: a.vcpus,
                    cmdline: a.cmdline,
                    host_quirks: !a.no_host_quirks,
                    ap_boot: a.ap_boot,
                    mailbox_mib: a.mailbox_mib,
                    ..MachineConfig::new(a.kernel)
                },
                host: HostPolicy {
                    console: a.console,
                    api_sock: a.api_sock,
                    thp: !a.no_thp,
                    prefault: a.prefault,
                    cgroups: a.cgroups.config(),
                    seccomp: a.seccomp,
                },
                clones: ClonePolicy {
                    warm_clones: a.warm_clones,
                    max_clones: a.max_clones,
                    max_tree_clones: a.max_tree_clones,
                    prime: !a.no_prime,
                    working_set_mib: a.working_set_mib,
                    fork_sources: a.fork_sources,
                },
                invoke: InvokePolicy {
                    template: a.template,
                    refresh_idle_ms: a.refresh_idle_ms,
                    tick_defer_ms: a.tick_defer_ms,
                    rewind: a.rewind,
                },
            };
            finish(vmm::run::<HttpEdge>(config))
        }
        Command::Status(s) => print_answer(client::describe_vm(&s.api_sock)),
        Command::Pause(s) => print_answer(client::set_state(&s.api_sock, TargetState::Paused)),
        Command::Resume(s) => print_answer(client::set_state(&s.api_sock, TargetState::Running)),
        Command::Fork(f) => fork(&f),
        Command::Clones(s) => print_answer(client::list_clones(&s.api_sock)),
        Command::Exec(e) => exec(&e),
        Command::Invoke(i) => invoke(&i),
        Command::Snapshot(a) => {
            print_answer(client::snapshot(&a.api_sock, &a.dir.display().to_string()))
        }
        Command::Restore(a) => {
            let opts = vmm::snapshot::RestoreOptions {
                dir: a.dir,
                api_sock: a.api_sock,
                console: a.console,
                paused: a.paused,
                warm_clones: a.warm_clones,
                max_clones: a.max_clones,
                max_tree_clones: a.max_tree_clones,
                working_set_mib: a.working_set_mib,
                cgroups: a.cgroups.config(),
                seccomp: a.seccomp,
                tap: a.tap,
                vsock: a.vsock,
                cow_dir: a.cow_dir,
                rewind: a.rewind,
                fork_sources: a.fork_sources,
            };
            finish(vmm::restore::<HttpEdge>(opts))
        }
        Command::Openapi => {
            print!("{}", vmm_api::spec::openapi_yaml());
            ExitCode::SUCCESS
        }
        Command::StateId => {
            println!("{}", vmm::SAVED_STATE_ID);
            ExitCode::SUCCESS
        }
        Command::Shutdown(s) => print_answer(client::shutdown(&s.api_sock)),
    }
}
