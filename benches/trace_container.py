#!/usr/bin/env python3
"""Where a container's start goes in the guest: `ctr run --rm` of the busybox image of
benches/containerd.py through forkvm's shim, one run traced with the host's KVM
tracepoints (system-wide: run it on an otherwise idle host, no other VM running).

On a PVM host the guest kernel runs in KVM's instruction emulator, so
`kvm:kvm_emulate_insn` counts every guest kernel instruction the container's clone ran
(the agent taking the request, forkvm-oci's mounts, chroot and exec, the program, its
output leaving over vsock, the exit) and `kvmmmu:kvm_mmu_set_spte` the shadow
page-table entries the clone's new VM filled in. The instructions are attributed to
guest kernel functions by vmlinux's symbols and grouped by kind as
benches/trace_functions.py does. The clone is the process with the most emulated
instructions in the run; the rest (the template, other warm clones) is given as one
sum. Each traced run is preceded by an untraced one for its time.

Needs root, perf (Debian's linux-perf), containerd and ctr, the release binaries and
the guest (as benches/containerd.py).

usage: benches/trace_container.py [--script 'echo ready'] [--runs N] [--vmlinux PATH]
                                  [--initrd PATH] [--env NAME=VALUE]... [--top N]
                                  [--other N] [--sequence FILE] [--dir DIR]

--vmlinux is also the kernel the shim's template boots (default: target/guest/vmlinux)
and --initrd its initramfs (default: target/guest/initramfs.cpio), so another build
of either can be traced as it is; --env is given to `ctr run` (the image's own
environment is PATH=/bin).
"""
import argparse
import collections
import os
import re
import shutil
import sys
import tempfile
import time

import containerd
from containerd import FORKVM, Containerd, busybox_archive, run_once
from trace_functions import (KERNEL, Symbols, analyse, emulated_rips, kind_of, perf_events,
                             perf_record, report)


def traced_run(c, cid, script, extra, tmp):
    """One `ctr run` with perf recording every VM on the host; (first line ms, exit ms,
    the events of the process that ran the most guest kernel code, the instruction count
    of the others, perf's complaints about lost events)."""
    data = os.path.join(tmp, "perf.data")
    perf = perf_record(["-a"], data)
    first, done = run_once(c, FORKVM, cid, script, extra)
    per_pid, lost = perf_events(perf, data)
    if not per_pid:
        sys.exit("perf recorded no KVM event")
    clone = max(per_pid, key=lambda p: sum(ev == "kvm_emulate_insn" for ev, _ in per_pid[p]))
    mine = per_pid.pop(clone)
    others = sum(ev == "kvm_emulate_insn" for evs in per_pid.values() for ev, _ in evs)
    return first, done, mine, others, lost


def write_sequence(path, events, syms):
    """The guest kernel functions of `events` in the order they ran, consecutive
    instructions of one function as one line: "COUNT FUNCTION" (user-mode stretches as
    "COUNT [user]"); and in PATH.steps the same split at each system call's entry: a line
    per system call, "INSTRUCTIONS NAME", with everything that ran until the next one (its
    page faults, interrupts, and other processes after a switch)."""
    runs = []
    last, n = None, 0
    for rip in emulated_rips(events):
        fn = syms.name(rip) if rip >= KERNEL else "[user]"
        if fn != last and last is not None:
            runs.append((n, last))
            n = 0
        last, n = fn, n + 1
    if last is not None:
        runs.append((n, last))
    with open(path, "w") as f:
        f.writelines(f"{n} {fn}\n" for n, fn in runs)
    # A step starts where do_syscall_64 is followed by a system call's own function.
    steps, name, count, entered = [], "(before the first system call)", 0, False
    for n, fn in runs:
        if fn == "do_syscall_64":
            entered = True
        elif entered and re.match(r"__(x64|do)_sys_", fn):
            steps.append((count, name))
            name, count, entered = re.sub(r"^__(x64|do)_sys_", "", fn), 0, False
        count += n
    steps.append((count, name))
    with open(path + ".steps", "w") as f:
        f.writelines(f"{n} {name}\n" for n, name in steps)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--script", default="echo ready",
                    help="what the container's sh -c runs (its first line must be 'ready')")
    ap.add_argument("--runs", type=int, default=2, help="traced runs")
    ap.add_argument("--vmlinux", default=os.path.join(containerd.REPO, "target", "guest",
                                                      "vmlinux"))
    ap.add_argument("--initrd", default=os.path.join(containerd.REPO, "target", "guest",
                                                     "initramfs.cpio"))
    ap.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable of the container (repeated)")
    ap.add_argument("--top", type=int, default=12, help="kernel functions listed per run")
    ap.add_argument("--sequence", metavar="FILE",
                    help="write the clone's guest kernel functions in the order they ran "
                         "(a line per run of one function, with its instruction count) "
                         "to FILE.N for traced run N, and to FILE.N.steps the same split "
                         "at each system call (what ran from its entry to the next one's)")
    ap.add_argument("--other", type=int, default=0,
                    help="also list this many functions of the kind 'other' per run")
    ap.add_argument("--dir", default="/var/tmp/forkvm-bench-shim",
                    help="the shim's directory (its saved template is kept between runs)")
    a = ap.parse_args()
    if not shutil.which("perf"):
        sys.exit("perf is not installed (apt-get install linux-perf)")
    syms = Symbols(a.vmlinux)
    tmp = tempfile.mkdtemp(prefix="forkvm-trace-container-")
    c = None
    try:
        archive = os.path.join(tmp, "busybox.tar")
        busybox_archive(archive)
        c = Containerd(tmp, "main", a.dir, {"FORKVM_SHIM_KERNEL": os.path.abspath(a.vmlinux),
                                            "FORKVM_SHIM_INITRD": os.path.abspath(a.initrd)})
        imp = c.ctr("image", "import", archive)
        if imp.returncode != 0:
            sys.exit(imp.stderr)
        # Not counted: the shim's template (and the image's) made if they are not.
        extra = [arg for e in a.env for arg in ("--env", e)]
        run_once(c, FORKVM, "warmup", a.script, extra)
        for i in range(a.runs):
            untraced = run_once(c, FORKVM, f"plain{i}", a.script, extra)
            time.sleep(1.0)
            first, done, events, others, lost = traced_run(c, f"traced{i}", a.script, extra,
                                                           tmp)
            counts = analyse(events, syms)
            counts.update(other_process_insns=others, lost=lost,
                          handler_ms_untraced=untraced[0], handler_ms_traced=first)
            print(f"\nrun {i}: untraced first line {untraced[0]:.0f} ms, exit "
                  f"{untraced[1]:.0f} ms; traced {first:.0f} / {done:.0f} ms")
            report(f"run {i} (the 'handler' times are ctr's first line)", counts, a.top)
            if a.sequence:
                write_sequence(f"{a.sequence}.{i}", events, syms)
            if a.other:
                rest = collections.Counter(
                    syms.name(rip) for rip in emulated_rips(events) if rip >= KERNEL)
                rest = [(fn, n) for fn, n in rest.most_common() if kind_of(fn) == "other"]
                print("  other: " + ", ".join(f"{fn} {n}" for fn, n in rest[:a.other]))
    finally:
        if c:
            c.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
