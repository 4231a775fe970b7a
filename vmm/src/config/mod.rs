//! What a user asks for, and its validation: the machine the guest sees (`machine`,
//! what a snapshot saves), and the policies around it (`policy`: the host's, the
//! clones', the invocations'). Parsing them from text is the command line's (the
//! `vmm-api` package); a clone's configuration is its template's, patched.

mod machine;
mod policy;

use std::path::PathBuf;

pub use machine::*;
pub use policy::*;

use crate::arch::x86_64::layout::{MAX_MEM_MIB, MIN_MEM_MIB};
use crate::arch::x86_64::mptable::{MAX_VCPUS, MAX_VIRTIO_DEVICES};

/// A complete VM configuration.
#[derive(Debug, Clone)]
pub struct VmConfig {
    /// The guest's machine.
    pub machine: MachineConfig,
    /// How this host runs it.
    pub host: HostPolicy,
    /// What its clones may be.
    pub clones: ClonePolicy,
    /// How it serves invocations.
    pub invoke: InvokePolicy,
}

impl VmConfig {
    /// A configuration with defaults for everything but the kernel.
    pub fn new(kernel: PathBuf) -> Self {
        Self {
            machine: MachineConfig::new(kernel),
            host: HostPolicy::default(),
            clones: ClonePolicy::default(),
            invoke: InvokePolicy::default(),
        }
    }

    /// Checks sizes and files. `host_max_vcpus` is what KVM allows on this host.
    pub fn validate(&self, host_max_vcpus: usize) -> Result<(), ConfigError> {
        self.validate_restored(host_max_vcpus)?;
        check_file("kernel", &self.machine.kernel)?;
        if let Some(p) = &self.machine.initrd {
            check_file("initrd", p)?;
        }
        Ok(())
    }

    /// [`VmConfig::validate`] without the boot files, which a VM restored from a
    /// snapshot does not read.
    pub fn validate_restored(&self, host_max_vcpus: usize) -> Result<(), ConfigError> {
        if !(MIN_MEM_MIB..=MAX_MEM_MIB).contains(&self.machine.mem_mib) {
            return Err(ConfigError::MemSize(self.machine.mem_mib));
        }
        let max_mailbox = (devices::mailbox::MAX_MAILBOX_BYTES >> 20) as u32;
        if self.machine.mailbox_mib > max_mailbox
            || (self.invoke.template && self.machine.mailbox_mib == 0)
        {
            return Err(ConfigError::Mailbox(self.machine.mailbox_mib));
        }
        if self.clones.warm_clones > MAX_WARM_CLONES {
            return Err(ConfigError::WarmClones(self.clones.warm_clones));
        }
        if !(1..=MAX_FORK_SOURCES).contains(&self.clones.fork_sources) {
            return Err(ConfigError::ForkSources(self.clones.fork_sources));
        }
        if self.clones.fork_sources > 1 && !self.invoke.template {
            return Err(ConfigError::ForkSourcesNoTemplate);
        }
        if self.clones.working_set_mib > MAX_WORKING_SET_MIB {
            return Err(ConfigError::WorkingSet(self.clones.working_set_mib));
        }
        if usize::from(self.machine.disk_slots) > api_types::MAX_DISK_SLOTS {
            return Err(ConfigError::DiskSlots(self.machine.disk_slots));
        }
        if self.machine.slot_cow_dir.is_some() && self.machine.disk_slots == 0 {
            return Err(ConfigError::SlotCowDir);
        }
        if !(1..=MAX_LIVE_CLONES).contains(&self.clones.max_clones) {
            return Err(ConfigError::MaxClones(self.clones.max_clones));
        }
        if !(1..=MAX_TREE_CLONES).contains(&self.clones.max_tree_clones) {
            return Err(ConfigError::MaxTreeClones(self.clones.max_tree_clones));
        }
        if self.invoke.tick_defer_ms > MAX_TICK_DEFER_MS {
            return Err(ConfigError::TickDefer(self.invoke.tick_defer_ms));
        }
        if let Some(c) = &self.host.cgroups {
            c.check().map_err(ConfigError::Cgroups)?;
        }
        let max = (host_max_vcpus as u64).min(u64::from(MAX_VCPUS));
        if self.machine.vcpus == 0 || u64::from(self.machine.vcpus) > max {
            return Err(ConfigError::VcpuCount {
                requested: u64::from(self.machine.vcpus),
                max,
            });
        }
        let virtio = self.machine.disks.len()
            + usize::from(self.machine.rng.is_some())
            + usize::from(self.machine.vsock.is_some())
            + usize::from(self.machine.net.is_some());
        if virtio > MAX_VIRTIO_DEVICES {
            return Err(ConfigError::TooManyDevices(virtio));
        }
        for d in &self.machine.disks {
            check_file("disk", &d.path)?;
            if let Some(dir) = &d.cow_dir {
                if !dir.is_dir() {
                    return Err(ConfigError::File {
                        what: "copy-on-write directory",
                        path: dir.display().to_string(),
                        why: "not a directory".into(),
                    });
                }
            }
        }
        Ok(())
    }
}

/// Errors in a configuration, found before anything is created.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ConfigError {
    /// Timer deferral too long.
    #[error("--tick-defer-ms {0}: at most {max} ms", max = MAX_TICK_DEFER_MS)]
    TickDefer(u64),
    /// A limit of live clones out of range.
    #[error("--max-clones {0} is not 1 to {max}", max = MAX_LIVE_CLONES)]
    MaxClones(usize),
    /// A limit of a tree's live clones out of range.
    #[error("--max-tree-clones {0} is not 1 to {max}", max = MAX_TREE_CLONES)]
    MaxTreeClones(usize),
    /// Too many warm clones.
    #[error("{0} warm clones requested; at most {max} may be kept", max = MAX_WARM_CLONES)]
    WarmClones(usize),
    /// `--fork-sources` out of range.
    #[error("fork sources must be 1 to {max}, not {0}", max = MAX_FORK_SOURCES)]
    ForkSources(usize),
    /// `--fork-sources` above 1 for a VM that is no template.
    #[error("fork sources are a template's (--template, or a snapshot of one)")]
    ForkSourcesNoTemplate,
    /// `--working-set-mib` out of range.
    #[error("--working-set-mib {0} is more than {max}", max = MAX_WORKING_SET_MIB)]
    WorkingSet(u64),
    /// `--disk-slots` out of range.
    #[error("disk slots must be 0 to {max}, not {0}", max = api_types::MAX_DISK_SLOTS)]
    DiskSlots(u8),
    /// `--slot-cow-dir` without slots.
    #[error("--slot-cow-dir is for disk slots: give --disk-slots N too")]
    SlotCowDir,
    /// Mailbox too large, or missing for a template.
    #[error("mailbox of {0} MiB: a VM's mailbox is 1 to {max} MiB (0: none, not for a template)", max = devices::mailbox::MAX_MAILBOX_BYTES >> 20)]
    Mailbox(u32),
    /// Bad cgroup pool settings.
    #[error("cgroup classes: {0}")]
    Cgroups(String),
    /// Memory size out of range.
    #[error("memory size {0} MiB is out of range ({MIN_MEM_MIB} to {MAX_MEM_MIB} MiB)")]
    MemSize(u64),
    /// vCPU count out of range for the host or forkvm.
    #[error("{requested} vCPUs requested; this host allows 1 to {max}")]
    VcpuCount {
        /// Asked for.
        requested: u64,
        /// Most allowed here.
        max: u64,
    },
    /// More virtio devices than interrupt lines for them.
    #[error("{0} virtio devices requested; at most {max} fit", max = MAX_VIRTIO_DEVICES)]
    TooManyDevices(usize),
    /// A file given does not exist or is not a regular file.
    #[error("{what} {path}: {why}")]
    File {
        /// kernel, initrd, disk.
        what: &'static str,
        /// The path.
        path: String,
        /// What is wrong.
        why: String,
    },
}

fn check_file(what: &'static str, path: &std::path::Path) -> Result<(), ConfigError> {
    let err = |why: String| ConfigError::File {
        what,
        path: path.display().to_string(),
        why,
    };
    let meta = std::fs::metadata(path).map_err(|e| err(e.to_string()))?;
    if !meta.is_file() {
        return Err(err("not a regular file".into()));
    }
    std::fs::File::open(path).map_err(|e| err(e.to_string()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use api_types::{CloneAddresses, CloneRateLimits};

    fn cfg() -> VmConfig {
        // The test binary itself is a regular file that exists.
        VmConfig::new(std::env::current_exe().unwrap())
    }

    #[test]
    fn clones_get_their_own_mac_tap_and_addresses() {
        let mac = DEFAULT_MAC;
        let net = NetConfig {
            tap: "tap0".into(),
            mac,
            rate_limit: None,
            ipv4: Some("10.0.0.2/24".parse().unwrap()),
            gateway: None,
        };
        let a = net.for_clone(4_194_303, &CloneNetSpec::default());
        assert_eq!((a.ipv4, a.gateway), (net.ipv4, None));
        let own = CloneAddresses {
            ipv4: "10.0.0.9/24".parse().unwrap(),
            gateway: Some("10.0.0.1".parse().unwrap()),
        };
        let b = net.for_clone(
            7,
            &CloneNetSpec {
                tap: Some("given0".into()),
                addresses: Some(own),
            },
        );
        assert_eq!((b.ipv4, b.gateway), (Some(own.ipv4), own.gateway));
        assert_eq!(b.tap, "given0");
        assert_eq!(b.identity().ipv4, Some(("10.0.0.9".parse().unwrap(), 24)));
        assert_eq!(a.tap, "fkvm4194303");
        assert!(api_types::net::valid_ifname(&a.tap));
        assert_eq!(a.mac.to_string(), "06:00:ac:3f:ff:ff");
        assert_ne!(net.clone_mac(1234), net.clone_mac(1235));
    }

    #[test]
    fn per_clone_rate_limits_replace_the_templates_and_need_the_device() {
        let limit = |s: &str| Some(s.parse().unwrap());
        let mut c = cfg();
        c.machine.rng = Some(RngConfig {
            rate_limit: limit("bytes=1K"),
        });
        let both = CloneRateLimits {
            rng: limit("bytes=2K"),
            net: limit("bytes=3K"),
            ..Default::default()
        };
        assert_eq!(
            c.clone().machine.apply_rate_limits(&both),
            Err(NoSuchDevice("network card"))
        );
        let rng_only = CloneRateLimits {
            rng: limit("bytes=2K"),
            ..Default::default()
        };
        c.machine.apply_rate_limits(&rng_only).unwrap();
        assert_eq!(c.machine.rng.unwrap().rate_limit, limit("bytes=2K"));
        let disk = CloneRateLimits {
            disk: limit("ops=10"),
            ..Default::default()
        };
        assert_eq!(
            cfg().machine.apply_rate_limits(&disk),
            Err(NoSuchDevice("disk"))
        );
    }

    #[test]
    fn disks_are_checked_and_limited_together() {
        let exe = std::env::current_exe().unwrap();
        let disk = |cow: Option<&str>| DiskConfig {
            path: exe.clone(),
            cow_dir: cow.map(PathBuf::from),
            keep: false,
            rate_limit: None,
        };
        let mut c = cfg();
        c.machine.disks = vec![disk(None), disk(Some("/tmp"))];
        assert_eq!(c.validate(8), Ok(()));
        c.machine.disks[1].cow_dir = Some(exe.clone());
        assert!(matches!(
            c.validate(8),
            Err(ConfigError::File {
                what: "copy-on-write directory",
                ..
            })
        ));
        c.machine.disks[1].path = "/nonexistent.img".into();
        assert!(matches!(
            c.validate(8),
            Err(ConfigError::File { what: "disk", .. })
        ));
        let max = MAX_VIRTIO_DEVICES;
        c.machine.disks = vec![disk(None); max];
        assert_eq!(c.validate(8), Ok(()));
        c.machine.rng = Some(RngConfig::default());
        assert_eq!(c.validate(8), Err(ConfigError::TooManyDevices(max + 1)));
        c.machine.rng = None;
        c.machine.disks.truncate(2);
        let limit: devices::rate_limiter::RateLimit = "ops=10".parse().unwrap();
        c.machine
            .apply_rate_limits(&CloneRateLimits {
                disk: Some(limit),
                ..Default::default()
            })
            .unwrap();
        assert!(c.machine.disks.iter().all(|d| d.rate_limit == Some(limit)));
    }

    #[test]
    fn accepts_defaults() {
        assert_eq!(cfg().validate(64), Ok(()));
    }

    #[test]
    fn rejects_bad_sizes() {
        let mut c = cfg();
        c.machine.mem_mib = 1;
        assert_eq!(c.validate(64), Err(ConfigError::MemSize(1)));
        c.machine.mem_mib = 128;
        c.machine.vcpus = 0;
        assert!(matches!(c.validate(64), Err(ConfigError::VcpuCount { .. })));
        c.machine.vcpus = 65;
        assert_eq!(
            c.validate(64),
            Err(ConfigError::VcpuCount {
                requested: 65,
                max: 64
            })
        );
    }

    #[test]
    fn rejects_missing_and_non_regular_files() {
        let mut c = cfg();
        c.machine.kernel = "/nonexistent/vmlinux".into();
        let e = c.validate(8).unwrap_err().to_string();
        assert!(e.starts_with("kernel /nonexistent/vmlinux: "), "{e}");
        let mut c = cfg();
        c.machine.initrd = Some("/".into());
        assert_eq!(
            c.validate(8),
            Err(ConfigError::File {
                what: "initrd",
                path: "/".into(),
                why: "not a regular file".into()
            })
        );
    }

    #[test]
    fn a_class_made_default_goes_first_and_the_others_keep_their_order() {
        let names = |c: &CgroupConfig| c.classes.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
        let mut c = CgroupConfig {
            classes: ["a", "b", "c"]
                .map(|n| (n.to_string(), Default::default()))
                .into(),
            ..Default::default()
        };
        c.make_default("c");
        assert_eq!(names(&c), ["c", "a", "b"]);
        c.make_default("x");
        assert_eq!(names(&c), ["c", "a", "b"], "no such class: nothing moves");
        c.make_default("c");
        assert_eq!(names(&c), ["c", "a", "b"]);
    }

    #[test]
    fn cgroup_pools_are_checked() {
        let mut c = cfg();
        let mut cg = CgroupConfig {
            classes: vec![("a".to_string(), Default::default())],
            ..Default::default()
        };
        c.host.cgroups = Some(cg.clone());
        assert_eq!(c.validate(8), Ok(()));
        for bad in [
            CgroupConfig {
                classes: vec![],
                ..cg.clone()
            },
            CgroupConfig {
                classes: vec![cg.classes[0].clone(), cg.classes[0].clone()],
                ..cg.clone()
            },
            CgroupConfig {
                pool_size: 10,
                pool_max: 5,
                ..cg.clone()
            },
            CgroupConfig {
                parent: "../x".into(),
                ..cg.clone()
            },
            CgroupConfig {
                parent: "/abs".into(),
                ..cg.clone()
            },
        ] {
            c.host.cgroups = Some(bad.clone());
            assert!(
                matches!(c.validate(8), Err(ConfigError::Cgroups(_))),
                "{bad:?} accepted"
            );
        }
        cg.parent = "forkvm/test".into();
        c.host.cgroups = Some(cg);
        assert_eq!(c.validate(8), Ok(()));
    }

    #[test]
    fn fork_sources_are_one_to_the_most_and_only_a_template_s() {
        let mut c = cfg();
        c.invoke.template = true;
        for (n, ok) in [(0, false), (1, true), (2, true), (MAX_FORK_SOURCES, true)] {
            c.clones.fork_sources = n;
            assert_eq!(c.validate(8).is_ok(), ok, "{n}");
        }
        c.clones.fork_sources = MAX_FORK_SOURCES + 1;
        assert!(matches!(c.validate(8), Err(ConfigError::ForkSources(_))));
        c.clones.fork_sources = 2;
        c.invoke.template = false;
        assert_eq!(c.validate(8), Err(ConfigError::ForkSourcesNoTemplate));
        c.clones.fork_sources = 1;
        assert_eq!(c.validate(8), Ok(()));
    }
}
