//! Cgroups for clones as the API shows them: resource classes, usage, pool counters.

use std::collections::BTreeMap;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::options::{key_values, parse_size};

/// Limits shared by every cgroup of one pool, written `cpu=0.5,memory=64M,pids=100`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct ResourceClass {
    /// CPU time per period, in CPUs (0.5: half a CPU). None: unlimited.
    pub cpu_quota: Option<f64>,
    /// Memory limit in bytes. None: unlimited.
    pub memory_limit: Option<u64>,
    /// Most tasks. None: unlimited.
    pub pids_max: Option<u64>,
}

impl std::str::FromStr for ResourceClass {
    type Err = String;

    /// Parses `cpu=0.5,memory=64M,pids=100` (any subset, in any order; memory takes
    /// K, M or G suffixes, powers of 1024). An empty string is the unlimited class.
    fn from_str(s: &str) -> Result<Self, String> {
        let mut class = ResourceClass::default();
        for (key, value) in key_values(s).map_err(|e| e.to_string())? {
            let bad = |what: &str| format!("\"{key}={value}\": {what}");
            match key {
                "cpu" => {
                    let q: f64 = value.parse().map_err(|_| bad("not a number of CPUs"))?;
                    if !(0.01..=1024.0).contains(&q) {
                        return Err(bad("CPUs must be 0.01 to 1024"));
                    }
                    class.cpu_quota = Some(q);
                }
                "memory" => {
                    let bytes = parse_size(value).ok_or_else(|| bad("not a size"))?;
                    if bytes < 4 << 20 {
                        return Err(bad("memory must be at least 4M"));
                    }
                    class.memory_limit = Some(bytes);
                }
                "pids" => {
                    let n: u64 = value.parse().map_err(|_| bad("not a count"))?;
                    if n == 0 {
                        return Err(bad("pids must be at least 1"));
                    }
                    class.pids_max = Some(n);
                }
                _ => return Err(bad("unknown limit; use cpu, memory or pids")),
            }
        }
        Ok(class)
    }
}

impl std::fmt::Display for ResourceClass {
    /// The limits as [`FromStr`](std::str::FromStr) reads them back
    /// (`cpu=0.5,memory=64M,pids=100`; empty for the unlimited class).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let limits = [
            self.cpu_quota.map(|q| format!("cpu={q}")),
            (self.memory_limit).map(|b| format!("memory={}", crate::options::format_size(b))),
            self.pids_max.map(|n| format!("pids={n}")),
        ];
        let limits: Vec<String> = limits.into_iter().flatten().collect();
        f.write_str(&limits.join(","))
    }
}

/// What one clone used while it held a cgroup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct Usage {
    /// CPU time, microseconds.
    pub cpu_us: u64,
    /// Peak memory, bytes (v2 without `memory.peak`: memory at release).
    pub memory_peak: u64,
    /// OOM kills in the cgroup.
    pub oom_kills: u64,
    /// Time the CPU quota held the clone's threads back (`cpu.stat`: `throttled_usec` on
    /// v2, `throttled_time` on v1), microseconds; 0 without a quota. A clone that ran
    /// slowly with this near 0 was not slowed by its quota.
    #[serde(default)]
    pub cpu_throttled_us: u64,
}

/// Which cgroup interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum CgroupVersion {
    /// One hierarchy per controller.
    V1,
    /// The unified hierarchy.
    V2,
}

impl std::str::FromStr for CgroupVersion {
    type Err = String;

    /// `1` or `2` (as the command lines take it).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "1" => Ok(Self::V1),
            "2" => Ok(Self::V2),
            _ => Err(format!("{s:?}: cgroup version is 1 or 2")),
        }
    }
}

/// Pool counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
pub struct PoolStats {
    /// Ready now.
    pub idle: usize,
    /// Leased now.
    pub in_use: usize,
    /// Created since start.
    pub created: u64,
    /// Removed since start (shrinking, replaced, destroyed).
    pub removed: u64,
    /// Found removed behind the pool's back and replaced.
    pub vanished: u64,
}

/// One class's pool, in `GET /vm`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct PoolReport {
    /// The class's limits.
    pub class: ResourceClass,
    /// Its counters.
    pub stats: PoolStats,
}

/// A VMM's cgroup pools, in `GET /vm` (`cgroups`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CgroupsReport {
    /// The hierarchy used.
    pub version: CgroupVersion,
    /// The pools' parent below each hierarchy's root (`forkvm/vmm-<pid>`).
    pub parent: String,
    /// Every class's pool, by class name.
    pub pools: BTreeMap<String, PoolReport>,
    /// cgroup v1: the cgroup the forker waits in for the next clone of the default
    /// class (None: none now, or cgroup v2).
    pub forker_seat: Option<String>,
}

/// How a clone got into its cgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "lowercase")]
pub enum PlacedBy {
    /// Born inside (cgroup v2, `clone3(CLONE_INTO_CGROUP)`).
    Clone3,
    /// Born inside (cgroup v1): forked by the forker thread waiting there.
    Forker,
    /// Moved its only thread in through each hierarchy's `tasks` file (cgroup v1).
    Tasks,
    /// Moved itself in through `cgroup.procs` (cgroup v2).
    Procs,
}

/// A clone's cgroup, in `GET /clones`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
pub struct CloneCgroup {
    /// Resource class.
    pub class: String,
    /// Cgroup path below each hierarchy's root.
    pub path: String,
    /// How it was placed.
    pub placed_by: PlacedBy,
    /// What it used: so far while it runs, in total once it exited.
    pub usage: Option<Usage>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_resource_class_is_written_as_it_is_read() {
        for text in [
            "cpu=0.5,memory=64M,pids=64",
            "memory=4100K",
            "pids=3",
            "cpu=2",
            "",
        ] {
            let c: ResourceClass = text.parse().unwrap();
            assert_eq!(c.to_string(), text);
            assert_eq!(c.to_string().parse::<ResourceClass>().unwrap(), c);
        }
    }

    #[test]
    fn resource_classes_parse_and_say_what_is_wrong() {
        let c: ResourceClass = "cpu=0.5, memory=64M,pids=64".parse().unwrap();
        assert_eq!(c.cpu_quota, Some(0.5));
        assert_eq!(c.memory_limit, Some(64 << 20));
        assert_eq!(c.pids_max, Some(64));
        assert_eq!(
            "".parse::<ResourceClass>().unwrap(),
            ResourceClass::default()
        );
        for (bad, why) in [
            ("cpu=0", "0.01 to 1024"),
            ("gpu=1", "unknown limit"),
            ("memory=1M", "at least 4M"),
            ("memory=lots", "not a size"),
            ("pids=0", "at least 1"),
            ("pids", "expected key=value"),
            ("pids=1,pids=2", "twice"),
            ("cpu=x", "not a number"),
            ("cpu=NaN", "0.01 to 1024"),
            ("memory=99999999999G", "not a size"),
            ("memory=-1", "not a size"),
        ] {
            let e = bad.parse::<ResourceClass>().unwrap_err();
            assert!(e.contains(why), "{bad}: {e}");
        }
    }

    #[test]
    fn placement_names() {
        let names: Vec<String> = [
            PlacedBy::Clone3,
            PlacedBy::Forker,
            PlacedBy::Tasks,
            PlacedBy::Procs,
        ]
        .iter()
        .map(|p| serde_json::to_string(p).unwrap())
        .collect();
        assert_eq!(
            names,
            [r#""clone3""#, r#""forker""#, r#""tasks""#, r#""procs""#]
        );
    }
}
