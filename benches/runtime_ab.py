#!/usr/bin/env python3
"""A guest image or kernel against a baseline, side by side in one run: the Python
runtime's cost per request in a fresh clone, before and after a change to it (or to
anything else in the image, or to the guest kernel).

Two forkvm-gateways run at once, one on --baseline-rootfs and --baseline-kernel and one
on --rootfs and --kernel (default: the current target/guest/python.ext4 and vmlinux;
give at least one baseline), each booting its own base template (or restoring it from
--snapshot-dir, one subdirectory each). Every function is deployed to both (the gateway
loads each with its output captured: `logs`), then invoked --runs times, the two
gateways' requests interleaved (which goes first alternating), each in a fresh warm
clone. Rows: the VMM's handler time
(x-forkvm-handler-us), min / median / p99 ms, and the median's ratio to the baseline's.

usage: benches/runtime_ab.py [--baseline-rootfs IMAGE] [--baseline-kernel VMLINUX]
                             [--rootfs IMAGE] [--kernel VMLINUX] [--runs N]
                             [--snapshot-dir DIR]
"""
import argparse
import os
import statistics
import sys
import tempfile

import faas
from clone import pct

FUNCTIONS = {
    "constant": "def handler(event):\n    return b'ok'\n",
    "print": "def handler(event):\n    print('hello', event)\n    return b'ok'\n",
    "float": ("import math\n\ndef handler(event):\n    s = 0.0\n"
              "    for i in range(1, 20000):\n        x = i * 0.001\n"
              "        s += math.sin(x) * math.sqrt(x) / (1.0 + x * x)\n"
              "    return repr(s)\n"),
    # Guest kernel work: page cache pages allocated and freed, a process made and reaped.
    "tmpfile": ("import os\n\ndef handler(event):\n"
                "    path = '/tmp/ab-%d' % os.getpid()\n"
                "    with open(path, 'wb') as f:\n        f.write(b'x' * (256 << 10))\n"
                "    with open(path, 'rb') as f:\n        n = len(f.read())\n"
                "    os.unlink(path)\n    return str(n)\n"),
    "spawn": ("import os\n\ndef handler(event):\n    pid = os.fork()\n"
              "    if pid == 0:\n        os._exit(7)\n"
              "    return str(os.waitpid(pid, 0)[1] >> 8)\n"),
}


def gateway(rootfs, kernel, snapshots):
    """A gateway on the root image `rootfs` and guest kernel `kernel`, its base snapshot
    kept in `snapshots`."""
    return faas.Gateway(["--base-snapshot", snapshots], rootfs=rootfs, kernel=kernel)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rootfs")
    ap.add_argument("--baseline-kernel")
    ap.add_argument("--rootfs", default=os.path.join(faas.GUEST, "python.ext4"))
    ap.add_argument("--kernel", default=os.path.join(faas.GUEST, "vmlinux"))
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--snapshot-dir", help="keep the base templates' snapshots here "
                    "(default: a temporary directory, so both boot)")
    a = ap.parse_args()
    if not (a.baseline_rootfs or a.baseline_kernel):
        sys.exit("give --baseline-rootfs, --baseline-kernel or both")
    baseline = (os.path.abspath(a.baseline_rootfs or a.rootfs),
                os.path.abspath(a.baseline_kernel or a.kernel))
    current = (os.path.abspath(a.rootfs), os.path.abspath(a.kernel))
    for path in (*baseline, *current, faas.GATEWAY):
        if not os.path.exists(path):
            sys.exit(f"{path} missing")
    with tempfile.TemporaryDirectory(prefix="forkvm-bench-") as tmp:
        snaps = a.snapshot_dir or tmp
        base = gateway(*baseline, os.path.join(snaps, "baseline"))
        new = gateway(*current, os.path.join(snaps, "current"))
        try:
            for gw in (base, new):
                for name, source in FUNCTIONS.items():
                    gw.deploy(name, source)
            ms = {}
            pair = (("baseline", base), ("current", new))
            for i in range(a.runs):
                for name in FUNCTIONS:
                    # Which goes first alternates: with a fixed order the first of each
                    # pair ran slower for user code alone (a float loop 1.6-1.9x the
                    # second's), meeting the clones the other's request left behind.
                    for tag, gw in (pair if i % 2 == 0 else pair[::-1]):
                        _, headers = gw.invoke(name)
                        us = int(headers["x-forkvm-handler-us"])
                        ms.setdefault((name, tag), []).append(us / 1000)
        finally:
            base.stop()
            new.stop()
    print(f"Handler time in a fresh clone, {a.runs} requests per row, interleaved (ms):\n")
    print(f"baseline: {baseline[0]}, {baseline[1]}\ncurrent: {current[0]}, {current[1]}\n")
    print("| function | image | min | median | p99 | median / baseline |")
    print("|---|---|---|---|---|---|")
    for name in FUNCTIONS:
        ref = statistics.median(ms[(name, "baseline")])
        for tag in ("baseline", "current"):
            v = ms[(name, tag)]
            m = statistics.median(v)
            print(f"| {name} | {tag} | {min(v):.2f} | {m:.2f} | {pct(v, 0.99):.2f} | "
                  f"{m / ref:.2f} |")


if __name__ == "__main__":
    main()
