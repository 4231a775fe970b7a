#!/usr/bin/env python3
"""VMM overhead: process start to the tiny guest's first serial line.

forkvm and QEMU microvm boot the same tiny guest (target/guest/tiny.elf), interleaved
run by run in one process so machine noise hits both alike. Prints a Markdown table with
min / median / p99 per VMM and the median ratio.

usage: benches/boot.py [--runs N] [--mem-mib M] [--no-qemu]
"""
import argparse
import os
import select
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "target/guest/tiny.elf")
VMM = os.path.join(ROOT, "target/release/vmm")
FIRST_LINE = b"tiny: cpu 0 up"


def time_to_first_line(cmd, timeout=10.0):
    """Seconds from spawn to FIRST_LINE on stdout; the process is killed afterwards."""
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL)
    buf = b""
    try:
        while True:
            left = timeout - (time.perf_counter() - start)
            if left <= 0:
                raise RuntimeError(f"no first line within {timeout}s: {cmd[0]} printed {buf[:200]!r}")
            r, _, _ = select.select([p.stdout], [], [], left)
            if not r:
                continue
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"{cmd[0]} exited before its first line: {buf[:200]!r}")
            buf += chunk
            if FIRST_LINE in buf:
                return time.perf_counter() - start
    finally:
        p.kill()
        p.wait()


def stats(xs):
    xs = sorted(xs)
    p99 = xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))]
    return xs[0], statistics.median(xs), p99


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--mem-mib", type=int, default=128)
    ap.add_argument("--no-qemu", action="store_true")
    a = ap.parse_args()

    for f in (TINY, VMM):
        if not os.path.exists(f):
            sys.exit(f"{f} missing: run `make release guest` first")
    mem = str(a.mem_mib)
    vmms = {
        "forkvm": [VMM, "run", "--kernel", TINY, "--mem-mib", mem, "--cmdline", "ticks=1"],
    }
    qemu = shutil.which("qemu-system-x86_64")
    if qemu and not a.no_qemu:
        vmms["qemu microvm"] = [
            qemu, "-M", "microvm", "-enable-kvm", "-cpu", "host,-arch-capabilities",
            "-m", mem, "-smp", "1", "-nodefaults", "-no-user-config", "-display", "none",
            "-serial", "stdio", "-kernel", TINY, "-append", "ticks=1",
        ]
    elif not a.no_qemu:
        print("qemu-system-x86_64 not found: forkvm only", file=sys.stderr)

    results = {name: [] for name in vmms}
    for name, cmd in vmms.items():  # warm the page cache once, unmeasured
        time_to_first_line(cmd)
    for _ in range(a.runs):
        for name, cmd in vmms.items():
            results[name].append(time_to_first_line(cmd))

    print(f"Process start to the tiny guest's first serial line, {a.mem_mib} MiB, "
          f"{a.runs} interleaved runs each (ms):\n")
    print("| VMM | min | median | p99 | median vs forkvm |")
    print("|---|---|---|---|---|")
    base = statistics.median(results["forkvm"])
    for name, xs in results.items():
        lo, med, p99 = stats(xs)
        print(f"| {name} | {lo*1e3:.2f} | {med*1e3:.2f} | {p99*1e3:.2f} | {med/base:.2f}x |")


if __name__ == "__main__":
    main()
