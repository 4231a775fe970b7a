//! `ctr task metrics`: a container's clone's cgroup usage, as containerd's cgroups v1
//! metrics.

use api_types::cgroup::CloneCgroup;
use containerd_shim_protos::cgroups::metrics::{
    CPUStat, CPUUsage, MemoryEntry, MemoryOomControl, MemoryStat, Metrics, Throttle,
};
use containerd_shim_protos::protobuf::MessageField;

/// The first readable number of `files` (the v1 and the v2 name of one value).
fn read_number(files: &[String]) -> Option<u64> {
    files
        .iter()
        .find_map(|f| std::fs::read_to_string(f).ok()?.trim().parse().ok())
}

/// The metrics of clone cgroup `cgroup`: CPU time and throttling, peak memory and OOM
/// kills from the VMM's account, memory now and its limit read from the cgroup (v1's
/// memory hierarchy or v2's).
pub fn of(cgroup: &CloneCgroup) -> Metrics {
    let usage = cgroup.usage.unwrap_or_default();
    let path = cgroup.path.trim_start_matches('/');
    let file = |v1: &str, v2: &str| {
        vec![
            format!("/sys/fs/cgroup/memory/{path}/{v1}"),
            format!("/sys/fs/cgroup/{path}/{v2}"),
            format!("/sys/fs/cgroup/unified/{path}/{v2}"),
        ]
    };
    let memory = MemoryEntry {
        usage: read_number(&file("memory.usage_in_bytes", "memory.current")).unwrap_or(0),
        limit: read_number(&file("memory.limit_in_bytes", "memory.max")).unwrap_or(u64::MAX),
        max: usage.memory_peak,
        ..Default::default()
    };
    Metrics {
        cpu: MessageField::some(CPUStat {
            usage: MessageField::some(CPUUsage {
                total: usage.cpu_us * 1000,
                ..Default::default()
            }),
            throttling: MessageField::some(Throttle {
                throttled_time: usage.cpu_throttled_us * 1000,
                ..Default::default()
            }),
            ..Default::default()
        }),
        memory: MessageField::some(MemoryStat {
            usage: MessageField::some(memory),
            ..Default::default()
        }),
        memory_oom_control: MessageField::some(MemoryOomControl {
            oom_kill: usage.oom_kills,
            ..Default::default()
        }),
        ..Default::default()
    }
}
