//! A pod's network. containerd's CRI plugin gives a pod a network namespace and has
//! CNI set up an interface in it (`eth0`, with the pod's address and a default route)
//! before it creates the sandbox. The pod's VM takes that address (its identity block,
//! applied by the guest's agent), and its tap, made by the VM's VMM in the host's
//! namespace, moves into the pod's namespace, where a traffic-control redirect joins it
//! to `eth0` both ways: every frame that arrives on one leaves on the other (what Kata
//! Containers does between the veth and its tap). The tap goes with the VM; the
//! redirect on `eth0` with the interface when CNI removes it.
//!
//! The work is done with iproute2 (`ip`, `tc`) run in the namespace with util-linux's
//! `nsenter`: no netlink code of the shim's own.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use api_types::Ipv4Cidr;

/// The interface CRI has CNI make in a pod's namespace.
const POD_IF: &str = "eth0";

/// The pod's network as CNI set it up.
#[derive(Debug, Clone)]
pub struct PodNet {
    /// The pod's network namespace (a bind-mounted file).
    pub netns: PathBuf,
    /// `eth0`'s address.
    pub ipv4: Ipv4Cidr,
    /// The default route's gateway, if any.
    pub gateway: Option<Ipv4Addr>,
    /// `eth0`'s MTU (the tap gets the same).
    pub mtu: u32,
}

/// The network namespace the OCI spec puts the container in; None: the host's.
pub fn netns_of(spec: &oci_spec::runtime::Spec) -> Option<PathBuf> {
    use oci_spec::runtime::LinuxNamespaceType;
    let namespaces = spec.linux().as_ref()?.namespaces().as_ref()?;
    (namespaces.iter())
        .find(|n| n.typ() == LinuxNamespaceType::Network)
        .and_then(|n| n.path().clone())
}

/// Runs `program args` in network namespace `netns` (the host's: None); its stdout,
/// or why it failed.
async fn run(netns: Option<&Path>, program: &str, args: &[&str]) -> Result<String, String> {
    let mut cmd = match netns {
        Some(ns) => {
            let mut c = tokio::process::Command::new("nsenter");
            c.arg(format!("--net={}", ns.display())).arg(program);
            c
        }
        None => tokio::process::Command::new(program),
    };
    let shown = format!("{program} {}", args.join(" "));
    let out =
        (cmd.args(args).kill_on_drop(true).output().await).map_err(|e| format!("{shown}: {e}"))?;
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).into_owned()),
        false => Err(format!(
            "{shown}: {}: {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )),
    }
}

/// The pod network in namespace `netns`: `eth0`'s IPv4 address and MTU, the default
/// route's gateway.
pub async fn read(netns: &Path) -> Result<PodNet, String> {
    let text = run(
        Some(netns),
        "ip",
        &["-j", "-4", "addr", "show", "dev", POD_IF],
    )
    .await?;
    let links: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("ip -j addr: {e}"))?;
    let link = &links[0];
    let addr = (link["addr_info"].as_array().into_iter().flatten())
        .find(|a| a["family"] == "inet")
        .ok_or_else(|| format!("{POD_IF} in {} has no IPv4 address", netns.display()))?;
    let ipv4: Ipv4Cidr = format!(
        "{}/{}",
        addr["local"].as_str().unwrap_or_default(),
        addr["prefixlen"].as_u64().unwrap_or(0)
    )
    .parse()
    .map_err(|e| format!("{POD_IF}'s address: {e}"))?;
    let mtu = link["mtu"].as_u64().unwrap_or(1500) as u32;
    let text = run(Some(netns), "ip", &["-j", "-4", "route", "show", "default"]).await?;
    let routes: serde_json::Value =
        serde_json::from_str(&text).map_err(|e| format!("ip -j route: {e}"))?;
    let gateway = (routes.as_array().into_iter().flatten())
        .find_map(|r| r["gateway"].as_str().and_then(|g| g.parse().ok()));
    Ok(PodNet {
        netns: netns.to_path_buf(),
        ipv4,
        gateway,
        mtu,
    })
}

/// Moves tap `tap` (made in the host's namespace by the pod VM's VMM; waited for up to
/// 10 s) into the pod's namespace and joins it to `eth0` both ways.
pub async fn join(net: &PodNet, tap: &str) -> Result<(), String> {
    let since = Instant::now();
    while !Path::new("/sys/class/net").join(tap).exists() {
        if since.elapsed() > Duration::from_secs(10) {
            return Err(format!("the pod VM's tap {tap} did not appear"));
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let ns = net.netns.display().to_string();
    run(None, "ip", &["link", "set", "dev", tap, "netns", &ns]).await?;
    let inside = Some(net.netns.as_path());
    let mtu = net.mtu.to_string();
    run(
        inside,
        "ip",
        &["link", "set", "dev", tap, "mtu", &mtu, "up"],
    )
    .await?;
    for (from, to) in [(POD_IF, tap), (tap, POD_IF)] {
        run(inside, "tc", &["qdisc", "add", "dev", from, "ingress"]).await?;
        let filter = [
            "filter", "add", "dev", from, "parent", "ffff:", "protocol", "all", "u32", "match",
            "u8", "0", "0", "action", "mirred", "egress", "redirect", "dev", to,
        ];
        run(inside, "tc", &filter).await?;
    }
    Ok(())
}
