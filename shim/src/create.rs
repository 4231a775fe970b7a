//! Making a container: a pod's VM for a sandbox ([`crate::pod`]); for a container, its
//! root file system's image, then a slot of its pod's VM, or a clone of its image's
//! template (or of the shim's, with the image in slot 0) of its own.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use containerd_shim::mount::{mount_rootfs, umount_recursive};
use containerd_shim_protos::api;
use forkvm::{CreateClones, ImageCache, InsertMedium};

use crate::config;
use crate::net;
use crate::pod::Place;
use crate::prepared;
use crate::process::{oci_command, Proc};
use crate::spec::{
    self, is_sandbox, limits, rootfs_key, sandbox_id, with_guest_limits, with_mounts, Mounted,
};
use crate::task::{Container, Service};
use crate::templates::client::{self, Keeper};

impl Service {
    /// Makes container `req.id`'s clone: its root file system as an image in slot 0,
    /// writable into the clone's overlay.
    pub(crate) async fn make(&self, req: &api::CreateTaskRequest) -> Result<Container, String> {
        let bundle = Path::new(&req.bundle);
        let spec = oci_spec::runtime::Spec::load(bundle.join("config.json"))
            .map_err(|e| format!("the bundle's config.json: {e}"))?;
        if is_sandbox(&spec) {
            return self.make_pod(req, &spec).await;
        }
        let process = spec.process().as_ref().ok_or("the spec has no process")?;
        // A pod's container (its sandbox served here): a slot of the pod's VM.
        let place = match sandbox_id(&spec) {
            Some(sandbox) => self.pods.reserve(&sandbox).await?,
            None => None,
        };
        let slot = place.as_ref().map_or(0, |p| p.slot);
        let sandbox = place.as_ref().map(|p| p.sandbox.clone());
        let mounted = oci_command(process, spec.hostname().as_deref(), slot)
            .map(|c| with_guest_limits(c, &spec))
            .and_then(|c| with_mounts(c, &spec, req.terminal).map_err(|e| e.to_string()));
        let made = match mounted {
            Ok(mounted) => self.make_rootfs(req, &spec, process, mounted, place).await,
            Err(e) => Err(e),
        };
        if let (Err(_), Some(sandbox)) = (&made, sandbox) {
            self.pods.free(&sandbox, slot).await;
        }
        made
    }

    /// Makes pod `req.id`'s VM.
    async fn make_pod(
        &self,
        req: &api::CreateTaskRequest,
        spec: &oci_spec::runtime::Spec,
    ) -> Result<Container, String> {
        let vsock = self.cfg.vsock(&req.bundle);
        let pod_net = match net::netns_of(spec) {
            Some(ns) => Some(
                net::read(&ns)
                    .await
                    .map_err(|e| format!("the pod's network: {e}"))?,
            ),
            None => None,
        };
        let limits = limits(spec);
        let made = self
            .pods
            .make(&self.cfg, &req.id, &vsock, &limits, pod_net.as_ref());
        let (keeper, clone) = made.await?;
        Ok(Container {
            bundle: req.bundle.clone(),
            pid: clone.pid(),
            clone_id: clone.id().to_string(),
            keeper: Some(keeper),
            clone: Some(clone),
            init: Proc::new(Vec::new(), &req.stdout, &req.stderr),
            execs: HashMap::new(),
            paused: false,
            sandbox: true,
            in_pod: None,
            slot: 0,
        })
    }

    /// Makes a container with its root file system as an image: in the slot `pod`
    /// gives of a pod's VM, or in slot 0 of a clone of its own.
    async fn make_rootfs(
        &self,
        req: &api::CreateTaskRequest,
        spec: &oci_spec::runtime::Spec,
        process: &oci_spec::runtime::Process,
        mounted: Mounted,
        place: Option<Place>,
    ) -> Result<Container, String> {
        let Mounted {
            mut command,
            archive,
        } = mounted;
        let bundle = Path::new(&req.bundle);
        let rootfs = bundle.join("rootfs");
        let t0 = Instant::now();
        for m in &req.rootfs {
            mount_rootfs(Some(&m.type_), Some(&m.source), &m.options, &rootfs)
                .map_err(|e| format!("cannot mount the root file system: {e}"))?;
        }
        let images = ImageCache::new(self.cfg.dir.join("images"), self.cfg.images_budget)
            .map_err(|e| e.to_string())?;
        let key = rootfs_key(&req.rootfs);
        let built = images.build(&key, &rootfs).await;
        if !req.rootfs.is_empty() {
            let _ = umount_recursive(rootfs.to_str(), 0);
        }
        let (image, made) = built.map_err(|e| format!("the root file system's image: {e}"))?;
        let t1 = Instant::now();
        if let Some(Place {
            sandbox,
            clone,
            slot,
        }) = place
        {
            (clone.insert_medium(slot, &image, true).await)
                .map_err(|e| format!("the pod's VM took no root file system: {e}"))?;
            log::info!(
                "{}: created in pod {sandbox}, slot {slot}: image {:.1} ms (built: {made}), \
                 inserted {:.1} ms",
                req.id,
                (t1 - t0).as_secs_f64() * 1e3,
                t1.elapsed().as_secs_f64() * 1e3
            );
            return Ok(Container {
                bundle: req.bundle.clone(),
                pid: clone.pid(),
                clone_id: clone.id().to_string(),
                keeper: None,
                clone: Some(clone),
                init: Proc::new(command, &req.stdout, &req.stderr)
                    .with_input(&req.stdin, req.terminal)
                    .with_preamble(archive),
                execs: HashMap::new(),
                paused: false,
                sandbox: false,
                in_pod: Some(sandbox),
                slot,
            });
        }
        let limits = limits(spec);
        let vsock = self.cfg.vsock(&req.bundle);
        let base = (config::base(&self.cfg).await).map_err(|e| format!("the template: {e}"))?;
        // Booting a VM per container (for comparison) has no snapshots to restore.
        let snapshot = match self.cfg.boot_each {
            true => None,
            false => {
                let mounts = spec::guest_mounts(&command);
                prepared::snapshot(&self.cfg, &base, &key, &image, process, &mounts).await
            }
        };
        let t2 = Instant::now();
        let ms = |from: Instant, to: Instant| (to - from).as_secs_f64() * 1e3;
        let from_image = match snapshot {
            Some((dir, made)) => (prepared::lend(&self.cfg, &key, &dir, &vsock, &limits).await)
                .map_err(|e| format!("the container's clone: {e}"))?
                .map(|lent| (lent, made)),
            None => None,
        };
        let ((keeper, clone), how) = match from_image {
            Some((lent, made)) => {
                command = spec::with_template_mounts(command, &made.dirs, &made.mounts);
                let how = match lent.0 {
                    Keeper::Lease(_) => "lent by the template service",
                    Keeper::Template(_) => "of the image's template, restored here",
                };
                (lent, how)
            }
            None => {
                let t = config::template(&self.cfg, &base, &vsock, &limits, 0)
                    .await
                    .map_err(|e| format!("the template: {e}"))?;
                let request = CreateClones {
                    media: vec![InsertMedium {
                        slot: 0,
                        path: image,
                        writable: true,
                    }],
                    ..Default::default()
                };
                let lent = client::own_clone(t, request, "the container's clone").await?;
                (lent, "of the shim's template, restored here")
            }
        };
        log::info!(
            "{}: created: image {:.1} ms (built: {made}), image's template {:.1} ms, clone \
             {:.1} ms ({how})",
            req.id,
            ms(t0, t1),
            ms(t1, t2),
            ms(t2, Instant::now())
        );
        Ok(Container {
            bundle: req.bundle.clone(),
            pid: clone.pid(),
            clone_id: clone.id().to_string(),
            keeper: Some(keeper),
            clone: Some(Arc::new(clone)),
            init: Proc::new(command, &req.stdout, &req.stderr)
                .with_input(&req.stdin, req.terminal)
                .with_preamble(archive),
            execs: HashMap::new(),
            paused: false,
            sandbox: false,
            in_pod: None,
            slot: 0,
        })
    }
}
