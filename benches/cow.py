#!/usr/bin/env python3
"""Copy-on-write write penalty, measured inside a Linux guest.

Boots the Linux template (plain initramfs) running `forkvm-cowbench MIB ROUNDS`: each
round times a full write pass over MIB MiB with no clone in between (baseline), makes
one clone through the clone port, and times the first write pass after it in the
parent and in the clone. Prints min / median / max per kind and the median ratio.
With --read-first, each of those write passes is preceded by a timed read pass over the
same memory, so the table also shows what mapping the pages again costs without copying
them.

usage: benches/cow.py [--mib 64] [--rounds 10] [--mem-mib 512] [--no-thp] [--read-first]
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
    ap.add_argument("--read-first", action="store_true",
                    help="time a read pass before each write pass")
    a = ap.parse_args()
    read = " read" if a.read_first else ""
    with tempfile.TemporaryDirectory(prefix="forkvm-cow-") as tmp:
        sock = os.path.join(tmp, "vm.sock")
        console = os.path.join(tmp, "vm.console")
        cmdline = (f'console=ttyS0 reboot=k panic=-1 quiet '
                   f'forkvm.run="forkvm-cowbench {a.mib} {a.rounds}{read}"')
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
    kinds = ("base", "parent", "clone")
    res = {k + sfx: [] for k in kinds for sfx in (("-read", "") if a.read_first else ("",))}
    for line in lines:
        m = re.match(r"cow ((?:base|parent|clone)(?:-read)?) (\d+) ([0-9.]+)", line.strip())
        if m and m.group(1) in res:
            res[m.group(1)].append(float(m.group(3)))
    if not all(res.values()):
        sys.exit(f"missing results: { {k: len(v) for k, v in res.items()} }")
    thp = "without" if a.no_thp else "with"
    what = "Read pass, then write pass" if a.read_first else "First write pass"
    print(f"{what} over {a.mib} MiB in a Linux guest ({a.mem_mib} MiB, {thp} THP), "
          f"{a.rounds} rounds (ms):\n")
    print("| pass | n | min | median | max | median vs baseline |")
    print("|---|---|---|---|---|---|")
    labels = {"base": "no clone (baseline)", "parent": "parent, after a clone",
              "clone": "clone, after the clone point"}
    for sfx, op in ((("-read", "read"),) if a.read_first else ()) + (("", "write"),):
        base = statistics.median(res["base" + sfx])
        for k in kinds:
            xs = res[k + sfx]
            label = f"{op}: {labels[k]}" if a.read_first else labels[k]
            print(f"| {label} | {len(xs)} | {min(xs):.1f} | {statistics.median(xs):.1f} | "
                  f"{max(xs):.1f} | {statistics.median(xs)/base:.1f}x |")


if __name__ == "__main__":
    main()
