#!/usr/bin/env python3
"""A guest image against a baseline image, side by side in one run: the Python
runtime's cost per request in a fresh clone, before and after a change to it (or to
anything else in the image).

Two forkvm-gateways run at once, one on --baseline-rootfs and one on the current image
(target/guest/python.ext4), each booting its own base template (or restoring it from
--snapshot-dir, one subdirectory each). Every function is deployed to both (the gateway
loads each with its output captured: `logs`), then invoked --runs times, the two
gateways' requests interleaved, each in a fresh warm clone. Rows: the VMM's handler time
(x-forkvm-handler-us), min / median / p99 ms, and the median's ratio to the baseline's.

usage: benches/runtime_ab.py --baseline-rootfs IMAGE [--runs N] [--snapshot-dir DIR]
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
}


def gateway(rootfs, snapshots):
    """A gateway on the root image `rootfs`, its base snapshot kept in `snapshots`."""
    return faas.Gateway(["--base-snapshot", snapshots], rootfs=rootfs)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline-rootfs", required=True)
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--snapshot-dir", help="keep the base templates' snapshots here "
                    "(default: a temporary directory, so both boot)")
    a = ap.parse_args()
    current = os.path.join(faas.GUEST, "python.ext4")
    for path in (a.baseline_rootfs, current, faas.GATEWAY):
        if not os.path.exists(path):
            sys.exit(f"{path} missing")
    with tempfile.TemporaryDirectory(prefix="forkvm-bench-") as tmp:
        snaps = a.snapshot_dir or tmp
        base = gateway(os.path.abspath(a.baseline_rootfs), os.path.join(snaps, "baseline"))
        new = gateway(current, os.path.join(snaps, "current"))
        try:
            for gw in (base, new):
                for name, source in FUNCTIONS.items():
                    gw.deploy(name, source)
            ms = {}
            for _ in range(a.runs):
                for name in FUNCTIONS:
                    for tag, gw in (("baseline", base), ("current", new)):
                        _, headers = gw.invoke(name)
                        us = int(headers["x-forkvm-handler-us"])
                        ms.setdefault((name, tag), []).append(us / 1000)
        finally:
            base.stop()
            new.stop()
    print(f"Handler time in a fresh clone, {a.runs} requests per row, interleaved (ms):\n")
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
