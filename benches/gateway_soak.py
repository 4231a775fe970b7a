#!/usr/bin/env python3
"""A soak of forkvm-gateway: real functions (benches/functions.py's) deployed with their
warm-up, invoked one request at a time, round after round, while the processes below the
gateway are counted at rest: per depth below it (1: the base template; 2: its warm
clones and the functions' templates; 3: their warm clones), how many, their RSS and
their descriptors. A leak shows as a count that grows with the rounds.

usage: benches/gateway_soak.py [--functions constant,json,alloc] [--rounds 2500]
                               [--samples 5] [--rewind] [--bin-dir DIR]
                               [--base-snapshot DIR] [--class NAME:LIMITS ...]

--rewind gives the gateway --rewind (its functions' clones are rewound and serve again).
--class (repeatable) gives the gateway resource classes (needs root) and each function
one of them in turn (the first function the first class, and so on); the cgroup
directories below the VMMs' parent (`forkvm`, in the memory hierarchy on cgroup v1, else
the unified one) are counted too.
"""
import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import faas  # noqa: E402
import functions  # noqa: E402


def tree(root):
    """(depth, pid, rss KiB, descriptors) of every process below `root`."""
    out = subprocess.run(["ps", "-e", "-o", "pid=,ppid=,rss="], capture_output=True,
                         text=True, check=True).stdout
    kids = {}
    for line in out.splitlines():
        pid, ppid, rss = map(int, line.split())
        kids.setdefault(ppid, []).append((pid, rss))
    found, stack = [], [(root, 1)]
    while stack:
        parent, depth = stack.pop()
        for pid, rss in kids.get(parent, []):
            try:
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                fds = -1
            found.append((depth, pid, rss, fds))
            stack.append((pid, depth + 1))
    return found


def cgroups():
    """Cgroup directories below the VMMs' default parent."""
    for top in ("/sys/fs/cgroup/memory/forkvm", "/sys/fs/cgroup/forkvm"):
        if os.path.isdir(top):
            return sum(len(dirs) for _, dirs, _ in os.walk(top))
    return 0


def sample(gw, rounds, started, classes):
    by = {}
    for depth, _, rss, fds in tree(gw.p.pid):
        s = by.setdefault(depth, [0, 0, 0])
        s[0] += 1
        s[1] += rss
        s[2] += fds
    cells = " | ".join(f"{n} / {rss:,} / {fds}" for _, (n, rss, fds) in sorted(by.items()))
    if classes:
        cells += f" | {cgroups()}"
    print(f"| {rounds} | {time.time() - started:.0f} | {cells} |", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--functions", default="constant,json,alloc")
    ap.add_argument("--rounds", type=int, default=2500)
    ap.add_argument("--samples", type=int, default=5, help="counts taken along the run")
    ap.add_argument("--rewind", action="store_true")
    ap.add_argument("--bin-dir", default="target/release")
    ap.add_argument("--base-snapshot")
    ap.add_argument("--class", dest="classes", action="append", default=[],
                    metavar="NAME:LIMITS", help="a resource class of the gateway (repeatable)")
    a = ap.parse_args()
    names = a.functions.split(",")
    unknown = [n for n in names if n not in functions.FUNCTIONS]
    if unknown:
        sys.exit(f"no such function: {unknown}; there are {list(functions.FUNCTIONS)}")
    faas.GATEWAY = os.path.join(a.bin_dir, "forkvm-gateway")
    extra = ["--rewind"] if a.rewind else []
    if a.base_snapshot:
        extra += ["--base-snapshot", a.base_snapshot]
    extra += [x for c in a.classes for x in ("--class", c)]
    gw = faas.Gateway(extra, warm=2)
    try:
        for i, name in enumerate(names):
            source, event, packages = functions.FUNCTIONS[name]
            cls = a.classes[i % len(a.classes)].split(":")[0] if a.classes else None
            functions.deploy(gw, name, source, packages, event, cls)
            if cls:
                print(f"{name}: class {cls}")
        print(f"{len(names)} functions, one request each per round; at rest (3 s), per "
              "depth below the gateway: processes / RSS KiB / descriptors\n")
        cg = " cgroups |" if a.classes else ""
        print("| rounds | s | " + " | ".join(f"depth {d}" for d in (1, 2, 3)) + " |" + cg)
        print("|---|---|---|---|---|" + ("---|" if a.classes else ""))
        started = time.time()
        every = max(1, a.rounds // a.samples)
        for k in range(a.rounds + 1):
            if k % every == 0 or k == a.rounds:
                time.sleep(3)
                sample(gw, k, started, a.classes)
            if k == a.rounds:
                break
            for name in names:
                functions.invoke(gw, name, functions.FUNCTIONS[name][1])
    finally:
        gw.stop()


if __name__ == "__main__":
    main()
