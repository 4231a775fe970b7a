//! A template's `vmm` options, typed ([`VmmOptions`]).

use std::time::Duration;

use api_types::ResourceClass;

/// The `vmm` options of a template ([`TemplateSpec::options`](crate::TemplateSpec)).
///
/// What shapes the machine (vCPUs, the entropy device, the mailbox, how invocations
/// treat the guest's timer, priming) is saved with a snapshot, so it applies when a
/// template boots; the host side (cgroup classes, the clone limit) applies to a restored
/// template as well. `Default` is `vmm`'s own defaults. Options without a field here go
/// in [`TemplateSpec::args`](crate::TemplateSpec).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct VmmOptions {
    /// vCPUs (`--vcpus`; default 1).
    pub vcpus: u8,
    /// A virtio entropy device (`--rng`).
    pub rng: bool,
    /// The invocation mailbox's size in MiB (`--mailbox-mib`; None: the VMM's default).
    pub mailbox_mib: Option<u32>,
    /// How far a due timer interrupt is deferred when a request is delivered, counted
    /// in the handler's run time (`--tick-defer-ms`; None: the VMM's default, 10 ms;
    /// zero: none). Whole milliseconds.
    pub tick_defer: Option<Duration>,
    /// How long a waiting runtime is left before it is refreshed (`--refresh-idle-ms`;
    /// None: the VMM's default, 30 s, which also bounds a longer one). Whole
    /// milliseconds.
    pub refresh_idle: Option<Duration>,
    /// Warm clones are primed (false: `--no-prime`).
    pub prime: bool,
    /// Resource classes clones may be given, each a pool of cgroups
    /// (`--cgroup-class NAME:LIMITS`).
    pub cgroup_classes: Vec<(String, ResourceClass)>,
    /// Most live clones (`--max-clones`; None: the VMM's default).
    pub max_clones: Option<usize>,
    /// The most of a template's working set (the guest pages its invocation clones
    /// write) that each warm clone copies ahead of its request (and an invocation's
    /// clone forked on its request, before its vCPUs run), in MiB
    /// (`--working-set-mib`; None: the VMM's default, 64; zero: none). Each warm clone
    /// holds that much more memory of its own while it waits (docs/invoke.md).
    pub working_set_mib: Option<u64>,
    /// Invocation clones that answered are rewound to the template's state and serve
    /// again instead of ending (`--rewind`; docs/invoke.md, "Rewound clones": what a
    /// rewound clone shares with the requests before it, and the templates it is not
    /// built for yet, whose clones end as before).
    pub rewind: bool,
    /// The template's fork sources, itself included (`--fork-sources`; None: the VMM's
    /// default, 1): clones of it that are templates themselves, each with its own warm
    /// clones, serving its invocations in turn, so that several processes fork its
    /// clones at once on a host with the cores for it (docs/invoke.md, "Fork sources").
    /// A function template derived from it has as many.
    pub fork_sources: Option<usize>,
}

impl Default for VmmOptions {
    fn default() -> Self {
        Self {
            vcpus: 1,
            rng: false,
            mailbox_mib: None,
            tick_defer: None,
            refresh_idle: None,
            prime: true,
            cgroup_classes: Vec::new(),
            max_clones: None,
            working_set_mib: None,
            rewind: false,
            fork_sources: None,
        }
    }
}

impl VmmOptions {
    /// `vmm run`'s options.
    pub(crate) fn run_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        let mut opt = |flag: &str, value: String| out.extend([flag.to_string(), value]);
        if self.vcpus != 1 {
            opt("--vcpus", self.vcpus.to_string());
        }
        if let Some(m) = self.mailbox_mib {
            opt("--mailbox-mib", m.to_string());
        }
        if let Some(d) = self.tick_defer {
            opt("--tick-defer-ms", d.as_millis().to_string());
        }
        if let Some(d) = self.refresh_idle {
            opt("--refresh-idle-ms", d.as_millis().to_string());
        }
        if self.rng {
            out.push("--rng".into());
        }
        if !self.prime {
            out.push("--no-prime".into());
        }
        out.extend(self.restore_args());
        out
    }

    /// `vmm restore`'s: the host side (the machine is the snapshot's).
    pub(crate) fn restore_args(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (name, class) in &self.cgroup_classes {
            out.extend(["--cgroup-class".to_string(), format!("{name}:{class}")]);
        }
        if let Some(n) = self.max_clones {
            out.extend(["--max-clones".to_string(), n.to_string()]);
        }
        if let Some(n) = self.working_set_mib {
            out.extend(["--working-set-mib".to_string(), n.to_string()]);
        }
        if self.rewind {
            out.push("--rewind".into());
        }
        if let Some(n) = self.fork_sources {
            out.extend(["--fork-sources".to_string(), n.to_string()]);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_add_nothing() {
        assert!(VmmOptions::default().run_args().is_empty());
        assert!(VmmOptions::default().restore_args().is_empty());
    }

    #[test]
    fn each_option_is_its_flag_and_a_restore_takes_only_the_host_side() {
        let small = "cpu=0.5,memory=64M".parse().unwrap();
        let o = VmmOptions {
            vcpus: 2,
            rng: true,
            mailbox_mib: Some(1),
            tick_defer: Some(Duration::from_millis(25)),
            refresh_idle: Some(Duration::from_secs(2)),
            prime: false,
            cgroup_classes: vec![("small".into(), small)],
            max_clones: Some(40),
            working_set_mib: Some(8),
            rewind: true,
            fork_sources: Some(3),
        };
        let run = o.run_args().join(" ");
        assert_eq!(
            run,
            "--vcpus 2 --mailbox-mib 1 --tick-defer-ms 25 --refresh-idle-ms 2000 --rng \
             --no-prime --cgroup-class small:cpu=0.5,memory=64M --max-clones 40 \
             --working-set-mib 8 --rewind --fork-sources 3"
        );
        assert_eq!(
            o.restore_args().join(" "),
            "--cgroup-class small:cpu=0.5,memory=64M --max-clones 40 --working-set-mib 8 \
             --rewind --fork-sources 3"
        );
    }
}
