#!/usr/bin/env python3
"""Copy-on-write write penalty, measured inside a Linux guest.

Boots the Linux template (plain initramfs) running `forkvm-cowbench MIB ROUNDS`: each
round times a full write pass over MIB MiB with no clone in between (baseline), makes
one clone through the clone port, and times the first write pass after it in the
parent and in the clone. Prints min / median / max per kind and the median ratio.

usage: benches/cow.py [--mib 64] [--rounds 10] [--mem-mib 512] [--no-thp]
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
G = os.path.join(ROOT, "target/guest")
VMM = os.path.join(ROOT, "target/release/vmm")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--mem-mib", type=int, default=512)
    ap.add_argument("--no-thp", action="store_true",
                    help="guest RAM without transparent huge pages (vmm run --no-thp)")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="forkvm-cow-") as tmp:
        sock = os.path.join(tmp, "vm.sock")
        console = os.path.join(tmp, "vm.console")
        cmdline = (f'console=ttyS0 reboot=k panic=-1 quiet '
                   f'forkvm.run="forkvm-cowbench {a.mib} {a.rounds}"')
        p = subprocess.Popen([VMM, "run", "--kernel", f"{G}/vmlinux", "--initrd",
                              f"{G}/initramfs.cpio", "--mem-mib", str(a.mem_mib),
                              "--api-sock", sock, "--console", console, "--cmdline", cmdline]
                             + (["--no-thp"] if a.no_thp else []),
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
        deadline = time.time() + 600
        while p.poll() is None and time.time() < deadline:
            time.sleep(1)
        if p.poll() is None:
            p.kill()
            sys.exit("the guest did not finish")
        lines = []
        for name in sorted(os.listdir(tmp)):
            if name.endswith("console"):
                lines += open(os.path.join(tmp, name), errors="replace").read().splitlines()
    res = {"base": [], "parent": [], "clone": []}
    for line in lines:
        m = re.match(r"cow (base|parent|clone) (\d+) ([0-9.]+)", line.strip())
        if m:
            res[m.group(1)].append(float(m.group(3)))
    if not all(res.values()):
        sys.exit(f"missing results: { {k: len(v) for k, v in res.items()} }")
    base = statistics.median(res["base"])
    thp = "without" if a.no_thp else "with"
    print(f"First write pass over {a.mib} MiB in a Linux guest ({a.mem_mib} MiB, {thp} THP), "
          f"{a.rounds} rounds (ms):\n")
    print("| pass | n | min | median | max | median vs baseline |")
    print("|---|---|---|---|---|---|")
    for k, label in (("base", "no clone (baseline)"), ("parent", "parent, after a clone"),
                     ("clone", "clone, after the clone point")):
        xs = res[k]
        print(f"| {label} | {len(xs)} | {min(xs):.1f} | {statistics.median(xs):.1f} | "
              f"{max(xs):.1f} | {statistics.median(xs)/base:.1f}x |")


if __name__ == "__main__":
    main()
