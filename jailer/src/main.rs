//! `jailer`: runs a forkvm VMM in its sandbox, and cleans up forkvm's cgroups.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};
use jailer::cgroup::{pool::cleanup, CgroupFs, CgroupVersion};
use jailer::jail::{self, JailConfig};

#[derive(Parser)]
#[command(
    name = "jailer",
    version,
    about = "forkvm jailer: run a VMM sandboxed",
    args_conflicts_with_subcommands = true,
    subcommand_negates_reqs = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    jail: JailArgs,
}

#[derive(Subcommand)]
enum Command {
    /// Kill every process in forkvm's cgroups and remove them all (every VMM's pools
    /// and every jail's cgroup under the parent), in every cgroup hierarchy of this host.
    Cleanup {
        /// The parent directory the VMMs and jails used.
        #[arg(long, default_value = "forkvm")]
        cgroup_parent: String,
    },
}

/// `jailer --id ID --exec-file vmm --uid U --gid G [options] -- <vmm args>`
#[derive(Args)]
struct JailArgs {
    /// Jail name (letters, digits, '-'; at most 64): the jail is
    /// `<chroot-base>/<exec name>/<id>/root` and its cgroup `<cgroup-parent>/jail-<id>`.
    #[arg(long, required = true)]
    id: Option<String>,
    /// The VMM executable; it runs as `/<file name>` inside the jail.
    #[arg(long, required = true)]
    exec_file: Option<PathBuf>,
    /// User id the VMM runs as (not 0).
    #[arg(long, required = true)]
    uid: Option<u32>,
    /// Group id the VMM runs as (not 0).
    #[arg(long, required = true)]
    gid: Option<u32>,
    /// Directory jails are made in.
    #[arg(long, default_value = "/srv/jailer")]
    chroot_base: PathBuf,
    /// Network namespace to run in (e.g. /var/run/netns/NAME).
    #[arg(long)]
    netns: Option<PathBuf>,
    /// cgroup version of the jail's cgroup, 1 or 2 (default: v2 on a v2-only host, else
    /// v1).
    #[arg(long)]
    cgroup_version: Option<CgroupVersion>,
    /// Directory in each cgroup hierarchy the jail's cgroup goes under.
    #[arg(long, default_value = "forkvm")]
    cgroup_parent: String,
    /// A host file or directory to make visible read-only, HOST[:JAIL_PATH] (default
    /// jail path: /<file name>). Repeat for more (kernel, initrd, disk images).
    #[arg(long = "file")]
    files: Vec<String>,
    /// Most open files (RLIMIT_NOFILE).
    #[arg(long, default_value_t = 2048)]
    rlimit_nofile: u64,
    /// Largest file the VMM may write, in bytes (RLIMIT_FSIZE; default: unlimited).
    #[arg(long)]
    rlimit_fsize: Option<u64>,
    /// Keep the jail directory (consoles, sockets) after the VMM exits.
    #[arg(long)]
    keep_root: bool,
    /// Arguments for the VMM, after `--`.
    #[arg(last = true)]
    args: Vec<String>,
}

fn parse_file(spec: &str) -> Result<(PathBuf, PathBuf), String> {
    let (host, jail) = match spec.split_once(':') {
        Some((h, j)) => (PathBuf::from(h), PathBuf::from(j)),
        None => {
            let host = PathBuf::from(spec);
            let name = host
                .file_name()
                .ok_or_else(|| format!("{spec}: no file name"))?;
            (host.clone(), PathBuf::from("/").join(name))
        }
    };
    Ok((host, jail))
}

fn jail_config(a: JailArgs) -> Result<JailConfig, String> {
    let files = a
        .files
        .iter()
        .map(|f| parse_file(f))
        .collect::<Result<_, _>>()?;
    Ok(JailConfig {
        id: a.id.unwrap_or_default(),
        exec_file: a.exec_file.unwrap_or_default(),
        uid: a.uid.unwrap_or_default(),
        gid: a.gid.unwrap_or_default(),
        chroot_base: a.chroot_base,
        netns: a.netns,
        cgroup_version: a.cgroup_version,
        cgroup_parent: a.cgroup_parent,
        files,
        rlimit_nofile: a.rlimit_nofile,
        rlimit_fsize: a.rlimit_fsize,
        keep_root: a.keep_root,
        args: a.args,
    })
}

fn cleanup_all(cgroup_parent: &str) -> ExitCode {
    let mut failed = false;
    let mut found = false;
    for version in [CgroupVersion::V1, CgroupVersion::V2] {
        let Ok(fs) = CgroupFs::host(Some(version), cgroup_parent) else {
            continue;
        };
        found = true;
        match cleanup(&fs) {
            Ok(n) => println!("{version:?}: removed {n} cgroups under {cgroup_parent}"),
            Err(e) => {
                eprintln!("jailer: {version:?}: {e}");
                failed = true;
            }
        }
    }
    if !found {
        eprintln!("jailer: no cgroup hierarchy found");
        return ExitCode::FAILURE;
    }
    if failed {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Some(Command::Cleanup { cgroup_parent }) = cli.command {
        return cleanup_all(&cgroup_parent);
    }
    let cfg = match jail_config(cli.jail) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("jailer: {e}");
            return ExitCode::from(2);
        }
    };
    match jail::run(&cfg) {
        Ok(code) => ExitCode::from(code.clamp(0, 255) as u8),
        Err(e) => {
            eprintln!("jailer: {e}");
            ExitCode::FAILURE
        }
    }
}
