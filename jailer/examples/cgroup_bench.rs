//! Cgroup operation costs on this host, driven by `benches/cgroup.py ops` (needs root).
//!
//! For each concurrency C, C threads each repeat, with their own sleeping process:
//! - fresh: create + configure a cgroup, migrate the process into it, migrate it back
//!   out, remove the cgroup;
//! - pooled: take a cgroup from a shared pool, migrate in, migrate out, release it;
//! - on v2 also: fork + migrate the child, against clone3(CLONE_INTO_CGROUP).
//!
//! Prints one JSON object per (operation, concurrency) with p50/p99 in microseconds.

use std::sync::Arc;
use std::time::{Duration, Instant};

use jailer::cgroup::{
    fork_into, CgroupFs, CgroupPool, CgroupVersion, PoolConfig, ResourceClass, WhenExhausted,
};

fn percentile(xs: &mut [f64], q: f64) -> f64 {
    xs.sort_by(|a, b| a.total_cmp(b));
    xs[((xs.len() - 1) as f64 * q).round() as usize]
}

fn us(t: Instant) -> f64 {
    t.elapsed().as_secs_f64() * 1e6
}

fn report(version: CgroupVersion, op: &str, conc: usize, mut xs: Vec<f64>) {
    let n = xs.len();
    let p50 = percentile(&mut xs, 0.5);
    let p99 = percentile(&mut xs, 0.99);
    println!(
        r#"{{"version":"{version:?}","op":"{op}","concurrency":{conc},"n":{n},"p50_us":{p50:.1},"p99_us":{p99:.1}}}"#
    );
}

/// Runs `per_thread` on `conc` threads at once and gathers each op's samples.
fn run<F>(conc: usize, per_thread: F) -> Vec<Vec<(String, f64)>>
where
    F: Fn(usize) -> Vec<(String, f64)> + Sync,
{
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..conc)
            .map(|t| {
                let f = &per_thread;
                s.spawn(move || f(t))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

fn gather(version: CgroupVersion, conc: usize, samples: Vec<Vec<(String, f64)>>) {
    let mut ops: Vec<String> = Vec::new();
    for (op, _) in samples.iter().flatten() {
        if !ops.contains(op) {
            ops.push(op.clone());
        }
    }
    for op in ops {
        let xs: Vec<f64> = samples
            .iter()
            .flatten()
            .filter(|(o, _)| *o == op)
            .map(|(_, x)| *x)
            .collect();
        report(version, &op, conc, xs);
    }
}

fn sleeper() -> std::process::Child {
    std::process::Command::new("sleep")
        .arg("3600")
        .spawn()
        .expect("spawn sleep")
}

fn main() {
    let mut args = std::env::args().skip(1);
    let version = match args.next().as_deref() {
        Some("2") => CgroupVersion::V2,
        _ => CgroupVersion::V1,
    };
    let iters: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(200);
    let concs: Vec<usize> = args
        .next()
        .unwrap_or_else(|| "1,2,4,8".into())
        .split(',')
        .filter_map(|c| c.parse().ok())
        .collect();
    let parent = format!("forkvm-bench-{}", std::process::id());
    let fs = CgroupFs::host(Some(version), &parent).expect("cgroup hierarchy");
    // Classes with limits where the hierarchy can enforce them.
    let class = if version == CgroupVersion::V1 {
        "cpu=0.5,memory=256M,pids=64".parse().unwrap()
    } else {
        ResourceClass::default()
    };
    let max = concs.iter().max().copied().unwrap_or(1);
    for t in 0..max {
        fs.create(&format!("home-{t}"), &ResourceClass::default())
            .expect("home cgroup");
    }
    for &conc in &concs {
        let mut sleepers: Vec<_> = (0..conc).map(|_| sleeper()).collect();
        let pids: Vec<i32> = sleepers.iter().map(|c| c.id() as i32).collect();
        for (t, pid) in pids.iter().enumerate() {
            fs.place(&format!("home-{t}"), *pid).unwrap();
        }
        // Fresh cgroup per use.
        let fresh = run(conc, |t| {
            let mut out = Vec::new();
            for i in 0..iters {
                let name = format!("fresh-{t}-{i}");
                let t0 = Instant::now();
                fs.create(&name, &class).unwrap();
                out.push(("create+configure".into(), us(t0)));
                let t0 = Instant::now();
                fs.place(&name, pids[t]).unwrap();
                out.push(("migrate in".into(), us(t0)));
                fs.place(&format!("home-{t}"), pids[t]).unwrap();
                let t0 = Instant::now();
                fs.remove(&name).unwrap();
                out.push(("remove".into(), us(t0)));
            }
            out
        });
        gather(version, conc, fresh);
        // Pooled.
        let cfg = PoolConfig {
            size: conc * 2,
            low_water: 0,
            max: conc * 4,
            idle_timeout: Duration::from_secs(60),
            when_exhausted: WhenExhausted::Wait(Duration::from_secs(5)),
        };
        let pool = Arc::new(CgroupPool::new(fs.clone(), "pooled", class.clone(), cfg).unwrap());
        let pooled = run(conc, |t| {
            let mut out = Vec::new();
            for _ in 0..iters {
                let t0 = Instant::now();
                let lease = pool.acquire().unwrap();
                out.push(("pool acquire".into(), us(t0)));
                fs.place(&lease.name, pids[t]).unwrap();
                fs.place(&format!("home-{t}"), pids[t]).unwrap();
                let t0 = Instant::now();
                pool.release(lease).unwrap();
                out.push(("pool release".into(), us(t0)));
            }
            out
        });
        gather(version, conc, pooled);
        if version == CgroupVersion::V2 {
            let births = run(conc, |_| {
                let mut out = Vec::new();
                for _ in 0..iters {
                    let lease = pool.acquire().unwrap();
                    let dir = fs.open_v2_dir(&lease.name).unwrap().unwrap();
                    for (op, into) in [("fork + migrate", None), ("clone3 into cgroup", Some(&dir))]
                    {
                        let t0 = Instant::now();
                        // SAFETY: the child only calls _exit.
                        let pid = unsafe { fork_into(into) };
                        if pid == 0 {
                            // SAFETY: _exit has no preconditions.
                            unsafe { libc::_exit(0) };
                        }
                        if into.is_none() {
                            fs.place(&lease.name, pid).unwrap();
                        }
                        out.push((op.to_string(), us(t0)));
                        // SAFETY: reaping our own child.
                        unsafe { libc::waitpid(pid, std::ptr::null_mut(), 0) };
                    }
                    drop(dir);
                    pool.release(lease).unwrap();
                }
                out
            });
            gather(version, conc, births);
        }
        pool.destroy().unwrap();
        for s in &mut sleepers {
            let _ = s.kill();
            let _ = s.wait();
        }
    }
    jailer::cgroup::pool::cleanup(&fs).unwrap();
}
