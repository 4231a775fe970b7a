#!/usr/bin/env python3
"""Linux boot on forkvm: process start to the first userspace line ("forkvm-init:
userspace up", the first thing /init prints), for several boot setups, interleaved run by
run so machine noise hits all alike. Each boot takes tens of seconds on a PVM host.

With --kernels NAME=VMLINUX,... each setup boots each kernel, interleaved too (to
measure what a kernel configuration change costs, beside the kernel before it: the
build cache keeps the last four in $FORKVM_CACHE_DIR/kernel).

usage: benches/linux_boot.py [--runs N] [--mem-mib M] [--variants 'a;b;...']
                             [--kernels NAME=VMLINUX,...]
"""
import argparse
import os
import select
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
G = os.path.join(ROOT, "target/guest")
VMM = os.path.join(ROOT, "target/release/vmm")
MARK = b"forkvm-init: userspace up"
BASE = "console=ttyS0 reboot=k panic=-1"

VARIANTS = {
    # The setup comparable to the reference figure: compressed initramfs, full log.
    "initramfs.cpio.gz": ["--initrd", f"{G}/initramfs.cpio.gz", "--cmdline", BASE],
    "initramfs.cpio": ["--initrd", f"{G}/initramfs.cpio", "--cmdline", BASE],
    "initramfs.cpio, quiet": ["--initrd", f"{G}/initramfs.cpio", "--cmdline", BASE + " quiet"],
    "rootfs.ext4 as root": ["--rootfs", f"{G}/rootfs.ext4", "--cmdline",
                            BASE + " root=/dev/vda ro rootfstype=ext4"],
    "rootfs.ext4 as root, quiet": ["--rootfs", f"{G}/rootfs.ext4", "--cmdline",
                                   BASE + " root=/dev/vda ro rootfstype=ext4 quiet"],
}


def boot(args, mem, kernel, timeout=400.0):
    cmd = [VMM, "run", "--kernel", kernel, "--mem-mib", str(mem)] + args
    start = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                         stdin=subprocess.DEVNULL)
    buf = b""
    try:
        while time.perf_counter() - start < timeout:
            r, _, _ = select.select([p.stdout], [], [], 1.0)
            if not r:
                continue
            chunk = os.read(p.stdout.fileno(), 65536)
            if not chunk:
                break
            buf += chunk
            if MARK in buf:
                return time.perf_counter() - start
        raise RuntimeError(f"no userspace line: {buf[-400:]!r}")
    finally:
        p.kill()
        p.wait()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mem-mib", type=int, default=256)
    ap.add_argument("--variants", default="initramfs.cpio.gz;rootfs.ext4 as root, quiet",
                    help="';'-separated names from: " + "; ".join(VARIANTS))
    ap.add_argument("--kernels", default=f"vmlinux={G}/vmlinux",
                    help="','-separated NAME=PATH of the kernels to boot")
    a = ap.parse_args()
    kernels = dict(k.split("=", 1) for k in a.kernels.split(","))
    chosen = [v.strip() for v in a.variants.split(";") if v.strip()]
    for n in chosen:
        if n not in VARIANTS:
            sys.exit(f"unknown variant {n!r}; known: {list(VARIANTS)}")
    names = [n if len(kernels) == 1 else f"{n}, {k}" for n in chosen for k in kernels]
    res = {n: [] for n in names}
    for _ in range(a.runs):
        for n in chosen:
            for k, path in kernels.items():
                name = n if len(kernels) == 1 else f"{n}, {k}"
                res[name].append(boot(VARIANTS[n], a.mem_mib, path))
                print(f"{name}: {res[name][-1]:.1f} s", file=sys.stderr)
    print(f"Linux 6.1 (vmlinux, PVH), {a.mem_mib} MiB, 1 vCPU: process start to the first "
          f"userspace line, {a.runs} interleaved runs each (s):\n")
    print("| setup | min | median | max |")
    print("|---|---|---|---|")
    for n, xs in res.items():
        print(f"| {n} | {min(xs):.1f} | {statistics.median(xs):.1f} | {max(xs):.1f} |")


if __name__ == "__main__":
    main()
