#!/usr/bin/env python3
"""Snapshots (docs/snapshots.md): taking one, restoring one, and what a restored VM costs.

With the tiny guest (target/guest/tiny.elf, ticks=1 beat=1: a heartbeat line every 1 ms):

  create   for each memory size: a paused VM's snapshot, untouched (the guest wrote a
           few pages) and touched (dirty=M: the guest wrote all but 32 MiB): the time
           PUT /snapshot took, the memory file's length and what it takes on disk.
  restore  for each memory size, interleaved run by run so machine noise hits each
           alike: process start to the guest's first serial line for a cold boot
           (`vmm run`, its first line), a restore with the memory file in the page cache
           (warm) and one with it dropped from the cache first (cold, posix_fadvise
           DONTNEED on the snapshot's files), each also to the guest's first instruction
           (the CLOCK_MONOTONIC time the restored VMM logs for vCPU 0's first entry; the
           tiny guest's next heartbeat line comes within 1 ms after), and a warm clone of the same snapshot
           restored paused (POST /clones: the VMM's own latency_us, request to the
           clone's vCPU in the guest, and the request's round trip as the client saw
           it). min / median / p99 and the median against the warm restore.
  memory   N VMs restored from one snapshot, running: each VMM process's PSS, RSS and
           private dirty memory (/proc/PID/smaps_rollup).

With the Linux guest's Python runtime (python.ext4, `python3 -m forkvm` serving the no-op
handler, 256 MiB, a template booted, paused where its runtime waits and snapshotted once;
--python-snapshot DIR keeps that snapshot for later runs):

  python   interleaved run by run: process start to the reply of the first invocation
           of a template restored from the snapshot (`vmm restore`, GET /vm polled until
           the restored template waits, then POST /invocations, served in a clone forked
           for it), with the page cache warm and cold, each also split at the template
           being ready; and as references an invocation in a fresh warm clone and in a
           clone forked per request of a restored template already running, and
           (--boots N, 1 by default) a cold boot of the same guest serving one invocation
           in place, from spawning the VMM to the reply.

usage: benches/snapshot.py [create|restore|memory|all] [--sizes 128,256,1024,4096]
                           [--runs N] [--count N] [--touched-max MIB] [--dir DIR]
       benches/snapshot.py python [--runs N] [--boots N] [--python-snapshot DIR]
                                  [--dir DIR]
"""
import argparse
import json
import os
import re
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clone import api as clone_api, pct  # noqa: E402
from invoke import (PY_NOOP, cold_boot_invoke, invoke, linux_vm, stop, stop_all,  # noqa: E402
                    wait_vm)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "target/guest/tiny.elf")
VMM = os.path.join(ROOT, "target/release/vmm")


def api(sock, method, path, body=None):
    """clone.py's request, with JSON in and out: (status, parsed body or None)."""
    status, text = clone_api(sock, method, path, json.dumps(body) if body is not None else None)
    return status, (json.loads(text) if text.strip() else None)


def wait_for(what, ok, timeout=60):
    start = time.monotonic()
    while not ok():
        if time.monotonic() - start > timeout:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.01)


def first_line(cmd, needle, timeout=30.0):
    """(seconds from spawn to `needle` on stdout, seconds from spawn to vCPU 0's first
    entry into the guest as the VMM logs it, or None); the process is killed afterwards."""
    start_ns = time.monotonic_ns()
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL)
    out, err, seen, entry = b"", b"", None, None
    want_entry = "restore" in cmd
    try:
        while seen is None or (want_entry and entry is None):
            left = timeout - (time.perf_counter() - start)
            if left <= 0:
                raise RuntimeError(f"no {needle!r} within {timeout}s: {cmd} printed {out[:200]!r} {err[-300:]!r}")
            r, _, _ = select.select([p.stdout, p.stderr], [], [], left)
            for f in r:
                chunk = os.read(f.fileno(), 65536)
                if not chunk:
                    raise RuntimeError(f"{cmd} exited before {needle!r}: {out[:300]!r} {err[-300:]!r}")
                if f is p.stdout:
                    out += chunk
                    if seen is None and needle in out:
                        seen = time.perf_counter() - start
                else:
                    err += chunk
                    m = re.search(rb"entered the guest at (\d+) ns", err)
                    if m and entry is None:
                        entry = (int(m.group(1)) - start_ns) / 1e9
        return seen, entry
    finally:
        p.kill()
        p.wait()


def stats(xs):
    return min(xs), statistics.median(xs), pct(xs, 0.99)


def boot_args(mib, cmdline):
    return [VMM, "run", "--kernel", TINY, "--mem-mib", str(mib), "--ap-boot", "direct",
            "--cmdline", cmdline]


def take_snapshot(work, mib, touched):
    """Boots the tiny guest, pauses it, writes its snapshot; returns (dir, answer)."""
    tag = f"{mib}-{'touched' if touched else 'untouched'}"
    sock = os.path.join(work, f"{tag}.sock")
    cmdline = "ticks=1 beat=1"
    if touched:
        cmdline = f"ticks=1 beat=1000 dirty={mib - 32}"
    p = subprocess.Popen(boot_args(mib, cmdline) + ["--api-sock", sock, "--console",
                         os.path.join(work, f"{tag}.console")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        console = os.path.join(work, f"{tag}.console")
        needle = "tiny: dirty pass 1" if touched else "tiny: beat 5"
        wait_for(needle, lambda: os.path.exists(console) and needle in open(console).read(),
                 timeout=300)
        assert api(sock, "PATCH", "/vm", {"state": "paused"})[0] == 204
        snap = os.path.join(work, f"snap-{tag}")
        status, answer = api(sock, "PUT", "/snapshot", {"dir": snap})
        if status != 201:
            raise RuntimeError(f"PUT /snapshot: {status} {answer}")
        api(sock, "PUT", "/actions", {"action_type": "shutdown"})
        p.wait(timeout=30)
        return snap, answer
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def drop_cache(snap):
    for name in os.listdir(snap):
        fd = os.open(os.path.join(snap, name), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def create(work, sizes, touched_max):
    print("Snapshot creation (PUT /snapshot on the paused tiny guest):\n")
    print("| guest memory | guest wrote | took (ms) | memory file | on disk |")
    print("|---|---|---|---|---|")
    for mib in sizes:
        for touched in (False, True):
            if touched and mib > touched_max:
                print(f"| {mib} MiB | all but 32 MiB | not measured (--touched-max "
                      f"{touched_max}) | | |")
                continue
            snap, a = take_snapshot(work, mib, touched)
            st = os.stat(os.path.join(snap, "memory"))
            print(f"| {mib} MiB | {'all but 32 MiB' if touched else 'a few pages'} "
                  f"| {a['took_ms']} | {st.st_size >> 20} MiB "
                  f"| {st.st_blocks * 512 / 2**20:.1f} MiB |")
            shutil.rmtree(snap)
    print()


def restore(work, sizes, runs):
    print(f"Process start (or clone request) to the new VM's guest running, tiny guest, "
          f"{runs} interleaved runs each (ms):\n")
    print("| memory | how | min | median | p99 | median vs warm restore |")
    print("|---|---|---|---|---|---|")
    for mib in sizes:
        snap, _ = take_snapshot(work, mib, False)
        tsock = os.path.join(work, f"t{mib}.sock")
        template = subprocess.Popen(
            [VMM, "restore", "--dir", snap, "--paused", "--warm-clones", "1",
             "--api-sock", tsock, "--console", "null"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for("the restored template", lambda: os.path.exists(tsock))
            wait_for("a warm clone", lambda: api(tsock, "GET", "/vm")[1]["warm_clones"]["ready"] == 1)
            restore_cmd = [VMM, "--log-level", "info", "restore", "--dir", snap, "--console",
                           "stdout"]
            needle = b"tiny: beat "
            res = {"cold boot (first serial line)": [],
                   "restore, warm cache (first serial line)": [],
                   "restore, warm cache (guest's first instruction)": [],
                   "restore, cold cache (first serial line)": [],
                   "restore, cold cache (guest's first instruction)": [],
                   "warm clone (VMM latency_us)": [], "warm clone (request round trip)": []}
            first_line(restore_cmd, needle)  # the page cache, warmed once unmeasured
            for _ in range(runs):
                boot, _ = first_line(boot_args(mib, "ticks=1 beat=1"), b"tiny: cpu 0 up")
                res["cold boot (first serial line)"].append(boot)
                line, entry = first_line(restore_cmd, needle)
                res["restore, warm cache (first serial line)"].append(line)
                res["restore, warm cache (guest's first instruction)"].append(entry)
                drop_cache(snap)
                line, entry = first_line(restore_cmd, needle)
                res["restore, cold cache (first serial line)"].append(line)
                res["restore, cold cache (guest's first instruction)"].append(entry)
                wait_for("a warm clone",
                         lambda: api(tsock, "GET", "/vm")[1]["warm_clones"]["ready"] == 1)
                t0 = time.perf_counter()
                status, made = api(tsock, "POST", "/clones", {"count": 1, "console": "null"})
                rtt = time.perf_counter() - t0
                assert status == 201, made
                c = made["clones"][0]
                res["warm clone (VMM latency_us)"].append(c["latency_us"] / 1e6)
                res["warm clone (request round trip)"].append(rtt)
                api(tsock, "DELETE", f"/clones/{c['id']}")
            base = statistics.median(res["restore, warm cache (first serial line)"])
            for how, xs in res.items():
                lo, med, p99 = stats(xs)
                print(f"| {mib} MiB | {how} | {lo*1e3:.2f} | {med*1e3:.2f} | {p99*1e3:.2f} "
                      f"| {med/base:.2f}x |")
        finally:
            template.kill()
            template.wait()
            shutil.rmtree(snap, ignore_errors=True)
    print()


def smaps_rollup(pid):
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                out[parts[0][:-1]] = int(parts[1])
    return out


def memory(work, count, mib=128):
    snap, answer = take_snapshot(work, mib, False)
    procs = []
    try:
        for i in range(count):
            sock = os.path.join(work, f"m{i}.sock")
            procs.append((subprocess.Popen(
                [VMM, "restore", "--dir", snap, "--api-sock", sock, "--console", "null"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL), sock))
        for p, sock in procs:
            wait_for("a restored VM", lambda: os.path.exists(sock))
        time.sleep(2)  # every guest ran a while
        rows = [smaps_rollup(p.pid) for p, _ in procs]
        pss = [r.get("Pss", 0) for r in rows]
        rss = [r.get("Rss", 0) for r in rows]
        dirty = [r.get("Private_Dirty", 0) for r in rows]
        print(f"{count} VMs restored from one {mib} MiB snapshot (the guest wrote "
              f"{answer['memory_written_bytes'] >> 10} KiB before it), per VMM process (KiB):\n")
        print("| | min | median | max |")
        print("|---|---|---|---|")
        for name, xs in (("PSS", pss), ("RSS", rss), ("private dirty", dirty)):
            print(f"| {name} | {min(xs)} | {statistics.median(xs):.0f} | {max(xs)} |")
        print(f"\nTotal PSS {sum(pss) >> 10} MiB, {sum(pss) / count / 1024:.2f} MiB per VM.\n")
    finally:
        for p, _ in procs:
            p.kill()
        for p, _ in procs:
            p.wait()
        shutil.rmtree(snap, ignore_errors=True)


def python_snapshot(work, keep):
    """The Python runtime's template, booted once, paused where its runtime waits, and
    snapshotted (into `keep` when given and kept there; reused when it exists)."""
    snap = keep or os.path.join(work, "python-template")
    if keep and os.path.exists(os.path.join(keep, "state")):
        print(f"Python template: the snapshot in {keep}", file=sys.stderr)
        return snap
    p, sock, t0 = linux_vm(work, "py-boot", root="python.ext4",
                           run=f"python3 -m forkvm {PY_NOOP}", extra=["--template"])
    try:
        wait_vm(p, sock, lambda v: v["state"] == "paused" and v["invoke"]["waiting"])
        print(f"Python template: booted and waiting in {time.perf_counter() - t0:.0f} s",
              file=sys.stderr)
        status, answer = api(sock, "PUT", "/snapshot", {"dir": snap})
        if status != 201:
            raise RuntimeError(f"PUT /snapshot: {status} {answer}")
        print(f"Python template: snapshot in {answer['took_ms']} ms, "
              f"{answer['memory_written_bytes'] >> 20} MiB of memory written",
              file=sys.stderr)
        stop(p, sock)
        return snap
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def restored_template(work, snap, name, warm):
    """`vmm restore` of the template snapshot `snap`: (process, socket, spawn time,
    seconds until it waits as a template)."""
    sock = os.path.join(work, name + ".sock")
    t0 = time.perf_counter()
    p = subprocess.Popen([VMM, "restore", "--dir", snap, "--api-sock", sock, "--console",
                          "null", "--warm-clones", str(warm)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(sock + ".log", "wb"))
    wait_vm(p, sock, lambda v: v["state"] == "paused" and v["invoke"]["waiting"]
            and v["warm_clones"]["ready"] == warm, timeout=60, poll=0.0005)
    return p, sock, t0, time.perf_counter() - t0


def python(work, runs, boots, keep):
    snap = python_snapshot(work, keep)
    res = {"restore + first invocation, warm cache": [],
           "restore until the template waits, warm cache": [],
           "restore + first invocation, cold cache": [],
           "restore until the template waits, cold cache": [],
           "invocation in a fresh warm clone of a running restored template": [],
           "invocation in a clone forked for it, same template": []}
    warm_p, warm_sock, _, _ = restored_template(work, snap, "warm", 1)
    fork_p, fork_sock, _, _ = restored_template(work, snap, "fork", 0)
    try:
        for _ in range(2):  # the page cache and the host's paths warmed, unmeasured
            p, sock, _, _ = restored_template(work, snap, "first", 0)
            invoke(sock, b"", expect=b"")
            stop(p, sock)
        for _ in range(runs):
            for cold in (False, True):
                if cold:
                    drop_cache(snap)
                p, sock, t0, ready = restored_template(work, snap, "first", 0)
                invoke(sock, b"", expect=b"")
                total = time.perf_counter() - t0
                stop(p, sock)
                key = "cold" if cold else "warm"
                res[f"restore + first invocation, {key} cache"].append(total)
                res[f"restore until the template waits, {key} cache"].append(ready)
            wait_vm(warm_p, warm_sock, lambda v: v["warm_clones"]["ready"] == 1)
            res["invocation in a fresh warm clone of a running restored template"].append(
                invoke(warm_sock, b"", expect=b"")[0])
            res["invocation in a clone forked for it, same template"].append(
                invoke(fork_sock, b"", expect=b"")[0])
    finally:
        stop_all([(warm_p, warm_sock, None), (fork_p, fork_sock, None)])
    booted = [cold_boot_invoke(work, f"boot{i}", "python.ext4", f"python3 -m forkvm {PY_NOOP}",
                               b"", b"") / 1e3 for i in range(boots)]
    print(f"Python runtime (no-op handler, 256 MiB), start to the first invocation's reply, "
          f"{runs} interleaved runs (ms):\n")
    print("| how | min | median | p99 | median vs restore + first invocation (warm) |")
    print("|---|---|---|---|---|")
    base = statistics.median(res["restore + first invocation, warm cache"])
    rows = list(res.items())
    if booted:
        rows.append((f"cold boot serving one invocation in place ({boots} run"
                     f"{'s' if boots > 1 else ''})", booted))
    for how, xs in rows:
        lo, med, p99 = stats(xs)
        print(f"| {how} | {lo*1e3:.2f} | {med*1e3:.2f} | {p99*1e3:.2f} | {med/base:.2f}x |")
    print()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="all", choices=["create", "restore", "memory", "all", "python"])
    ap.add_argument("--sizes", default="128,256,1024,4096")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--touched-max", type=int, default=1024,
                    help="largest guest whose memory is touched for `create` (MiB): here a "
                         "tiny guest took over 5 minutes to write 4 GiB the first time")
    ap.add_argument("--boots", type=int, default=1,
                    help="cold boots of the Python guest for `python` (minutes each here)")
    ap.add_argument("--python-snapshot", default=None,
                    help="where `python` keeps its template's snapshot (reused if there)")
    ap.add_argument("--dir", default=None, help="where snapshots go (default: a temporary directory in /var/tmp)")
    a = ap.parse_args()
    for f in (TINY, VMM):
        if not os.path.exists(f):
            sys.exit(f"{f} missing: run `make release guest` first")
    sizes = [int(s) for s in a.sizes.split(",")]
    work = tempfile.mkdtemp(prefix="forkvm-snapbench-", dir=a.dir or "/var/tmp")
    try:
        if a.what in ("create", "all"):
            create(work, sizes, a.touched_max)
        if a.what in ("restore", "all"):
            restore(work, sizes, a.runs)
        if a.what in ("memory", "all"):
            memory(work, a.count)
        if a.what == "python":
            python(work, a.runs, a.boots, a.python_snapshot)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
