//! A CRI pod as one clone: the sandbox makes the pod's VM (a clone of the template with
//! its disk slots empty), and each container of the pod takes a slot of it for its root
//! file system while it runs (`PUT /slots/{slot}`), given back when it is deleted (the
//! file system released in the guest, then the medium ejected).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use api_types::CloneAddresses;
use forkvm::{CreateClones, VmClone};
use tokio::sync::Mutex;

use crate::config::{self, ShimConfig, AGENT_PORT};
use crate::net::{self, PodNet};
use crate::templates::client::{self, Keeper, LeaseError};

/// A pod's VM and which of its disk slots hold a container's root file system.
struct Pod {
    clone: Arc<VmClone>,
    used: [bool; config::SLOTS as usize],
}

/// A slot of a pod's VM, taken for one container.
pub struct Place {
    /// The pod's sandbox id.
    pub sandbox: String,
    /// The pod's VM.
    pub clone: Arc<VmClone>,
    /// The slot.
    pub slot: u8,
}

/// The pods one shim serves, by sandbox id.
#[derive(Default)]
pub struct Pods(Mutex<HashMap<String, Pod>>);

impl Pods {
    /// Makes pod `id`'s VM (limits `limits`), on the pod's network `pod_net` if it has
    /// one of its own, and keeps it; returns what keeps it (the template service's
    /// lease, or the shim's own template restored here, its vsock socket at `vsock`,
    /// when no service can be had) and the clone.
    pub async fn make(
        &self,
        cfg: &ShimConfig,
        id: &str,
        vsock: &Path,
        limits: &str,
        pod_net: Option<&PodNet>,
    ) -> Result<(Keeper, Arc<VmClone>), String> {
        let base = (config::base(cfg).await).map_err(|e| format!("the template: {e}"))?;
        // On a network of its own: the pod's address, and a tap named for the pod.
        let tap = config::digest_name("fvp", id, 12);
        let addresses = pod_net.map(|n| CloneAddresses {
            ipv4: n.ipv4,
            gateway: n.gateway,
        });
        let net = addresses.map(|a| (tap.clone(), a));
        // Booting a VM per pod (for comparison) has no snapshot to lend clones of.
        let lent = match cfg.boot_each {
            true => None,
            false => Some(client::lease(cfg, &base, limits, net).await),
        };
        let (keeper, clone) = match lent {
            Some(Ok((clone, lease))) => {
                log::info!("{id}: the pod's VM lent by the template service");
                (Keeper::Lease(lease), clone)
            }
            Some(Err(e @ LeaseError::Restore(_))) => return Err(format!("the template: {e}")),
            Some(Err(e @ (LeaseError::Refused(_) | LeaseError::Clone(_)))) => {
                return Err(format!("the pod's clone: {e}"))
            }
            Some(Err(e @ LeaseError::Unreachable { .. })) => {
                log::warn!("pod {id}: {e}; its template is restored here");
                own_clone(cfg, &base, vsock, limits, &tap, addresses).await?
            }
            None => own_clone(cfg, &base, vsock, limits, &tap, addresses).await?,
        };
        let clone = Arc::new(clone);
        if let Some(n) = pod_net {
            // The guest takes its address before the agent's first command.
            let joined = match net::join(n, &tap).await {
                Ok(()) => clone.exec(AGENT_PORT, "true", b"").await.map(|_| ()),
                Err(e) => Err(forkvm::Error::Command(e)),
            };
            if let Err(e) = joined {
                drop(clone);
                keeper.stop().await;
                return Err(format!("the pod's network: {e}"));
            }
            log::info!("{id}: the pod's VM is at {} on {tap}", n.ipv4);
        }
        let pod = Pod {
            clone: clone.clone(),
            used: [false; config::SLOTS as usize],
        };
        self.0.lock().await.insert(id.to_string(), pod);
        log::info!("{id}: the pod's VM is clone {}", clone.id());
        Ok((keeper, clone))
    }

    /// Forgets pod `id` (its sandbox is deleted).
    pub async fn remove(&self, id: &str) {
        self.0.lock().await.remove(id);
    }

    /// A free disk slot of pod `sandbox`'s VM, taken; None if this shim does not serve
    /// that pod (the container gets a VM of its own).
    pub async fn reserve(&self, sandbox: &str) -> Result<Option<Place>, String> {
        let mut pods = self.0.lock().await;
        let Some(pod) = pods.get_mut(sandbox) else {
            return Ok(None);
        };
        let free = pod.used.iter().position(|u| !u).ok_or_else(|| {
            format!(
                "pod {sandbox} runs {} containers, the most its VM holds at once",
                config::SLOTS
            )
        })?;
        pod.used[free] = true;
        Ok(Some(Place {
            sandbox: sandbox.to_string(),
            clone: pod.clone.clone(),
            slot: free as u8,
        }))
    }

    /// Gives slot `slot` of pod `sandbox`'s VM back.
    pub async fn free(&self, sandbox: &str, slot: u8) {
        if let Some(pod) = self.0.lock().await.get_mut(sandbox) {
            pod.used[usize::from(slot)] = false;
        }
    }

    /// Empties slot `slot` of pod `sandbox`'s VM `clone` (its container's processes
    /// were killed): the root file system unmounted in the guest, then ejected, and the
    /// slot free. Failures are logged: the slot is given back all the same.
    pub async fn leave(&self, sandbox: &str, clone: &VmClone, slot: u8) {
        let release = format!("forkvm-oci --slot {slot} --release");
        match clone.exec(AGENT_PORT, &release, b"").await {
            Ok(o) if o.status == 0 => {}
            Ok(o) => log::warn!(
                "{release}: exit {}: {}",
                o.status,
                String::from_utf8_lossy(&o.output)
            ),
            Err(e) => log::warn!("{release}: {e}"),
        }
        if let Err(e) = clone.eject_medium(slot).await {
            log::warn!("pod {sandbox}: slot {slot}: {e}");
        }
        self.free(sandbox, slot).await;
    }
}

/// A pod's VM as a clone of the shim's template restored here (snapshot `base`, its
/// vsock socket at `vsock`; booted with `FORKVM_SHIM_BOOT_EACH`), on tap `tap` with the
/// guest's `addresses` when given.
async fn own_clone(
    cfg: &ShimConfig,
    base: &Path,
    vsock: &Path,
    limits: &str,
    tap: &str,
    addresses: Option<CloneAddresses>,
) -> Result<(Keeper, VmClone), String> {
    let template = config::template(cfg, base, vsock, limits, 0)
        .await
        .map_err(|e| format!("the template: {e}"))?;
    let request = CreateClones {
        addresses: addresses.into_iter().collect(),
        taps: addresses.map(|_| tap.to_string()).into_iter().collect(),
        ..Default::default()
    };
    client::own_clone(template, request, "the pod's clone").await
}
