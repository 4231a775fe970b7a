//! `containerd-shim-forkvm-v2`: a containerd runtime (shim v2, `io.containerd.forkvm.v2`)
//! that runs each container's process in a fresh clone of a warm template VM
//! (docs/containerd.md).
//!
//! A container's root file system (the snapshotter's mounts) becomes an ext4 image kept
//! by its content ([`forkvm::ImageCache`]), inserted writable into disk slot 0 of the
//! clone: the container's writes go to the clone's own overlay. The template is a Linux
//! guest with forkvm's agent, restored from a snapshot the first shim saves (and each
//! image's, with its root file system mounted), kept by the template service
//! (`containerd-shim-forkvm-v2 templates`, [`templates`]), which lends the shims their
//! clones; in the clone, the agent runs `forkvm-oci` with the process the OCI spec asks
//! for.

mod config;
mod create;
mod events;
mod metrics;
mod net;
mod pod;
mod prepared;
mod process;
mod spec;
mod task;
mod templates;
mod volumes;

use containerd_shim::asynchronous::run;
use containerd_shim::Config;

#[tokio::main]
async fn main() {
    // `-v`/`--version` answer without containerd (the crate's own flag needs
    // containerd's environment).
    if let Some("-v" | "--version" | "-version") = std::env::args().nth(1).as_deref() {
        println!("containerd-shim-forkvm-v2 {}", env!("CARGO_PKG_VERSION"));
        return;
    }
    if std::env::args().nth(1).as_deref() == Some(templates::SUBCOMMAND) {
        std::process::exit(templates::server::run().await);
    }
    // The shim reaps nothing it did not start: the forkvm library waits for its VMMs
    // (through pidfds) and tokio for the commands it runs (mkfs.ext4), and a reaper of
    // every child would take their exit statuses first. Orphans go to init.
    let config = Config {
        no_reaper: true,
        no_sub_reaper: true,
        ..Default::default()
    };
    run::<task::Service>("io.containerd.forkvm.v2", Some(config)).await;
}
