//! `jailer`: forkvm's cgroup housekeeping (the sandbox is not implemented yet).

use std::process::ExitCode;

use clap::{Parser, Subcommand};
use jailer::cgroup::{pool::cleanup, CgroupFs, CgroupVersion};

#[derive(Parser)]
#[command(name = "jailer", version, about = "forkvm jailer")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Kill every process in forkvm's cgroups and remove them all (every VMM's pools
    /// under the parent), in every cgroup hierarchy of this host.
    Cleanup {
        /// The parent directory the VMMs used (`vmm run --cgroup-parent`).
        #[arg(long, default_value = "forkvm")]
        cgroup_parent: String,
    },
}

fn main() -> ExitCode {
    let Command::Cleanup { cgroup_parent } = Cli::parse().command;
    let mut failed = false;
    let mut found = false;
    for version in [CgroupVersion::V1, CgroupVersion::V2] {
        let Ok(fs) = CgroupFs::host(Some(version), &cgroup_parent) else {
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
