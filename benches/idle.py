#!/usr/bin/env python3
"""What a guest's idle time costs a request, and what idle refresh and timer deferral
do about it (docs/invoke.md, "A guest that did not run"), side by side in one run.

Linux templates (256 MiB, --warm-clones 4) of the C runtime's echo and of a Python
no-op, each in four configurations, all booted at once:
  - --refresh-idle-ms 0 --tick-defer-ms 0: neither (the template ages from its boot);
  - --refresh-idle-ms 1000 --tick-defer-ms 0: idle refresh only;
  - --refresh-idle-ms 0 --tick-defer-ms 10: timer deferral only;
  - --refresh-idle-ms 1000 --tick-defer-ms 10: both (the defaults).
Each template also has one keep-alive clone, served in place.

Requests come one at a time with random gaps (uniform, 0 to twice --gap seconds between
a template's requests); each round sends every template a request in a fresh clone and
its keep-alive clone one in place, in a random order, so that every configuration sees
the same arrival pattern and the same host noise. Rows: request to reply from the client
(a held request's wait included, and a fork on request when the warm clones were being
made again), and the VMM's handler figure (x-forkvm-handler-us: from the guest running
with the request to its reply, where the guest kernel's work shows).

First, with every template idle, each VMM's host CPU over --idle seconds (its own and
that of the warm clones it discarded and reaped: /proc/PID/stat utime + stime + cutime +
cstime) and its refreshes: what refreshing costs while nothing is asked.

usage: benches/idle.py [--runs N] [--gap S] [--idle S]
"""
import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time

from invoke import PY_NOOP, exchange, invoke, linux_vm, row, stop_all, wait_vm, VMM

WARM = 4
CONFIGS = [(0, 0), (1000, 0), (0, 10), (1000, 10)]


def ready(v):
    return (v["state"] == "paused" and v["invoke"]["waiting"]
            and v["warm_clones"]["ready"] == WARM)


def cpu_s(pid):
    """utime + stime + cutime + cstime of `pid`, in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")


def refreshes(sock):
    return json.loads(exchange(sock, "GET", "/vm")[2])["invoke"]["refreshes"]


def label(name, refresh, defer):
    parts = [f"refresh {refresh} ms" if refresh else "no refresh",
             f"defer {defer} ms" if defer else "no deferral"]
    return f"{name}, " + ", ".join(parts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=100)
    ap.add_argument("--gap", type=float, default=1.0)
    ap.add_argument("--idle", type=float, default=30)
    a = ap.parse_args()
    if not os.path.exists(VMM):
        sys.exit(f"{VMM} is missing: cargo build --release")
    payload = b"hello from the benchmark"
    kinds = {"c": ("C echo", None, "forkvm-fn echo", payload),
             "py": ("Python no-op", "python.ext4", f"python3 -m forkvm {PY_NOOP}", b"")}
    keys = [(k, r, d) for k in kinds for r, d in CONFIGS]
    total = {(key, where): [] for key in keys for where in ("fresh", "in place")}
    handler = {(key, where): [] for key in keys for where in ("fresh", "in place")}
    with tempfile.TemporaryDirectory(prefix="forkvm-idle-", dir="/dev/shm") as tmp:
        vms = {}
        for key in keys:
            k, r, d = key
            _, root, run, _ = kinds[k]
            extra = ["--template", "--warm-clones", str(WARM), "--refresh-idle-ms", str(r),
                     "--tick-defer-ms", str(d)]
            vms[key] = linux_vm(tmp, f"{k}-{r}-{d}", root=root, run=run, extra=extra)
        try:
            for p, sock, _ in vms.values():
                wait_vm(p, sock, ready)
            print("templates ready", file=sys.stderr, flush=True)
            before = {key: (cpu_s(p.pid), refreshes(sock)) for key, (p, sock, _) in vms.items()}
            time.sleep(a.idle)
            idle = {key: (cpu_s(p.pid) - before[key][0], refreshes(sock) - before[key][1])
                    for key, (p, sock, _) in vms.items()}
            print("idle done", file=sys.stderr, flush=True)
            keep = {}
            for key, (_, sock, _) in vms.items():
                expect = kinds[key[0]][3]
                _, h = invoke(sock, payload, query="?keep_alive=true", expect=expect)
                keep[key] = h["x-forkvm-socket"]
            asks = [(key, where) for key in keys for where in ("fresh", "in place")]
            for i in range(a.runs):
                random.shuffle(asks)
                for key, where in asks:
                    time.sleep(random.uniform(0, 2 * a.gap) / len(asks))
                    sock = vms[key][1] if where == "fresh" else keep[key]
                    query = "" if where == "fresh" else "?keep_alive=true"
                    t, h = invoke(sock, payload, query=query, expect=kinds[key[0]][3])
                    total[(key, where)].append(t * 1e3)
                    handler[(key, where)].append(int(h["x-forkvm-handler-us"]) / 1e3)
                if i % 10 == 9:
                    print(f"{i + 1} rounds", file=sys.stderr, flush=True)
            for key, sock in keep.items():
                invoke(sock, payload, expect=kinds[key[0]][3])
        finally:
            stop_all(vms.values())

    print(f"\nA guest that did not run: 256 MiB Linux templates (--warm-clones {WARM}), "
          f"one request at a time in random order, random gaps (mean {a.gap} s between "
          f"two requests to the same VM), {a.runs} requests per row (ms; ratio of "
          f"medians to the same runtime and path with neither refresh nor deferral)\n")
    for where in ("fresh", "in place"):
        title = "a fresh clone per request" if where == "fresh" else \
            "in place, a keep-alive clone"
        print(f"| {title}: request to reply (client) | min | median | p99 | vs neither |")
        print("|---|---|---|---|---|")
        for key in keys:
            base = statistics.median(total[((key[0], 0, 0), where)])
            print(row(label(kinds[key[0]][0], key[1], key[2]), total[(key, where)], base))
        print(f"\n| {title}: handler (x-forkvm-handler-us) | min | median | p99 |")
        print("|---|---|---|---|")
        for key in keys:
            print(row(label(kinds[key[0]][0], key[1], key[2]), handler[(key, where)]))
        print()
    print(f"| idle for {a.idle:.0f} s, no requests | host CPU, ms per s | refreshes |")
    print("|---|---|---|")
    for key in keys:
        cpu, n = idle[key]
        print(f"| {label(kinds[key[0]][0], key[1], key[2])} | {cpu * 1e3 / a.idle:.1f} | {n} |")


if __name__ == "__main__":
    main()
