#!/usr/bin/env python3
"""Cgroup pool benchmarks (need root).

ops: per-operation cost at concurrency 1, 2, 4, 8 on this host's v1 hierarchy and on
  its v2 mount (target/release/examples/cgroup_bench): create + configure a cgroup,
  migrate a process into it, remove it; take one from a pool and give it back; on v2,
  fork + migrate against clone3(CLONE_INTO_CGROUP). Back-to-back operations: the
  kernel's cgroup lock stays in its fast state, so a lone migration after an idle
  period can cost more (see docs/benchmarks/isolation.md).
clone: clone latency (request reaching the VMM to the clone's vCPU 0 in the guest) of a
  running 128 MiB tiny template without cgroups, with pooled cgroups, and with a fresh
  cgroup per clone (--cgroup-pool-size 0: created at the request, removed at exit), on
  v1 and v2, in interleaved rounds in one run. --templates warm measures warm clones of
  a paused template instead (launched from a pool of clones forked ahead, each already
  in its cgroup). --baseline VMM adds that binary's none and pooled cells to the same
  rounds (an A/B of two builds).

usage: benches/cgroup.py ops [--iters N] [--conc 1,2,4,8]
       benches/cgroup.py clone [--runs N] [--rounds N] [--templates running,warm]
                               [--versions 1,2] [--baseline VMM]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import clone as cb  # noqa: E402

BENCH = os.path.join(cb.ROOT, "target/release/examples/cgroup_bench")


def ops(a):
    subprocess.run(["cargo", "build", "--release", "-q", "-p", "jailer", "--examples"],
                   cwd=cb.ROOT, check=True)
    print(f"Cgroup operations, {a.iters} per thread, back to back (us):\n")
    print("| cgroup | operation | concurrency | p50 | p99 |")
    print("|---|---|---|---|---|")
    for version in ("1", "2"):
        out = subprocess.run([BENCH, version, str(a.iters), a.conc], check=True,
                             capture_output=True, text=True).stdout
        for line in out.splitlines():
            r = json.loads(line)
            print(f"| {r['version'].lower()} | {r['op']} | {r['concurrency']} | "
                  f"{r['p50_us']:.1f} | {r['p99_us']:.1f} |")
        sys.stdout.flush()


DEFAULT_VMM = cb.VMM

MODES = {
    "none": [],
    "pooled": ["--cgroup-class", "c:pids=1000", "--cgroup-pool-size", "8"],
    "fresh": ["--cgroup-class", "c:pids=1000", "--cgroup-pool-size", "0"],
}


def series(tmp, version, mode, runs, template, vmm=None):
    cb.VMM = vmm or DEFAULT_VMM
    extra = list(MODES[mode])
    if mode != "none":
        extra += ["--cgroup-version", version, "--cgroup-parent", f"forkvm-bench-{os.getpid()}"]
        if version == "2":
            # This host's v2 mount may offer no pids controller: no limit there.
            extra[1] = "c"
    return cb.clone_series(tmp, 128, True, template, runs, extra=extra,
                           body='{"count":1,"console":"null"}')[0]


def clone(a):
    print(f"Clone latency with cgroups, 128 MiB tiny template, {a.runs} clones per cell in "
          f"{a.rounds} interleaved rounds (ms; ratio of medians to no cgroup):\n")
    print("| template | cgroup | placement | min | median | p99 | vs none |")
    print("|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="forkvm-bench-") as tmp:
        for template in a.templates.split(","):
            for version in a.versions.split(","):
                cells = [(m, None) for m in MODES]
                if a.baseline:
                    cells += [("none", a.baseline), ("pooled", a.baseline)]
                got = {c: [] for c in cells}
                for _ in range(a.rounds):
                    for mode, vmm in cells:
                        got[(mode, vmm)] += series(tmp, version, mode, a.runs // a.rounds,
                                                   template, vmm)
                for (mode, vmm), xs in got.items():
                    base = statistics.median(got[("none", vmm)])
                    label = mode if vmm is None else f"{mode} (baseline binary)"
                    print(cb.row(f"{template} | v{version} | {label}", xs, base))
                sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    o = sub.add_parser("ops")
    o.add_argument("--iters", type=int, default=200)
    o.add_argument("--conc", default="1,2,4,8")
    c = sub.add_parser("clone")
    c.add_argument("--runs", type=int, default=200)
    c.add_argument("--rounds", type=int, default=4)
    c.add_argument("--templates", default="running",
                   help="running and/or warm (a paused template with warm clones)")
    c.add_argument("--versions", default="1,2", help="cgroup versions: 1 and/or 2")
    c.add_argument("--baseline", metavar="VMM",
                   help="another vmm binary (an earlier build): its none and pooled cells "
                        "run interleaved with the others, each compared to its own none")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("cgroup benchmarks need root")
    {"ops": ops, "clone": clone}[a.cmd](a)


if __name__ == "__main__":
    main()
