#!/usr/bin/env python3
"""Where a real handler's time goes in a fresh clone: the functions of
benches/functions.py deployed through forkvm-gateway (without and with a warm-up
event), one request each traced with the host's KVM tracepoints on the clone that
serves it.

On a PVM host the guest kernel runs in KVM's instruction emulator, so
`kvm:kvm_emulate_insn` counts every guest kernel instruction the request ran;
`kvmmmu:kvm_mmu_set_spte` counts the shadow page-table entries KVM filled in for the
clone's new VM (first touches of guest pages, kernel and user; PVM fires no
`kvm_exit` or `kvm_page_fault`). The emulated
instructions are attributed to guest kernel functions by `vmlinux`'s symbols and
grouped by kind (page faults and page allocation, copies to and from user space,
system call entry and exit, files, randomness, timers and interrupts, scheduling).
On a hardware KVM host the kernel is not emulated, so only the counts carry over, not
the times.

Needs root (perf) and `perf` (Debian's linux-perf). The traced request is slower than
an untraced one; each row also gives an untraced request's handler time, measured
just before in another fresh clone of the same template.

usage: benches/trace_functions.py [--only a,b] [--bin-dir DIR] [--base-snapshot DIR]
                                  [--top N] [--json OUT]
"""
import argparse
import bisect
import collections
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import faas
import functions
from faas import GUEST, Gateway

# Kinds of guest kernel work, by function name (first match wins; the rest is "other").
KINDS = [
    ("randomness", r"chacha|crng|get_random|random|blake2s|getrandom"),
    ("ticks, timers and scheduling", r"hrtimer|tick|timekeeping|clock|timer|apic|irq|"
     r"sysvec|ktime|jiffies|second_overflow|update_wall|ntp|rcu|softirq|vsyscall|"
     r"update_process_times|read_tsc|pvclock|vm_stat|vmstat|calc_global|account_|"
     r"load_avg|schedule|sched|pick_next|enqueue|dequeue|wake|update_curr|"
     r"update_min_vruntime|update_rq_clock|cpuacct|switch_to|finish_task|ttwu|idle|"
     r"perf_event_task_tick|kvm_"),
    ("copies to and from user space", r"copy_user|copy_to_user|copy_from_user|"
     r"_copy_to_iter|_copy_from_iter|memcpy|memmove|rep_movs"),
    ("page faults and page allocation", r"fault|clear_page|alloc_page|__alloc|"
     r"get_page_from_freelist|rmqueue|free_unref|free_pcp|__free_pages|folio|lru|"
     r"pte|pmd|pud|p4d|zap|anon|vma|mmap|munmap|brk|tlb|page_|release_pages|"
     r"__mod_|mod_node|mod_zone|count_vm|percpu_counter|pfn|buddy|compound|"
     r"prep_new|post_alloc|kernel_init_pages|lock_mm|mm_"),
    ("files (VFS, tmpfs, page cache)", r"vfs_|shmem|filemap|generic_perform|"
     r"generic_file|dentry|d_alloc|d_lookup|inode|path_|link_path|namei|lookup|"
     r"do_filp|do_sys_open|file|fd_|fdget|__fput|iterate|new_sync|ksys_|dput|"
     r"getname|putname|mnt|simple_|xa_|xas_|radix|security_|iov_iter|kmem_cache|"
     r"kmalloc|kfree|slab|step_into|walk_component|may_open|do_unlinkat|"
     r"truncate|fsnotify|rw_verify|stat|close_fd|pipe|sock|unix_|skb"),
    ("system call entry and exit", r"entry_SYSCALL|syscall|exit_to_user|x64_sys|"
     r"fpregs|fpu|error_entry|error_return|asm_exc|irqentry|native_iret|swapgs"),
]
KIND_RES = [(k, re.compile(p)) for k, p in KINDS]


def kind_of(name):
    for kind, rx in KIND_RES:
        if rx.search(name):
            return kind
    return "other"


class Symbols:
    """Guest kernel text symbols of vmlinux (`nm -n`)."""

    def __init__(self, vmlinux):
        out = subprocess.run(["nm", "-n", vmlinux], capture_output=True, text=True,
                             check=True).stdout
        self.addrs, self.names = [], []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[1] in "tTwW":
                self.addrs.append(int(parts[0], 16))
                self.names.append(parts[2])

    def addr(self, name):
        return self.addrs[self.names.index(name)] if name in self.names else None

    def name(self, addr):
        i = bisect.bisect_right(self.addrs, addr) - 1
        return self.names[i] if i >= 0 else "?"


def descendants(root):
    """Pids of root's descendant processes (the gateway's templates and clones)."""
    children = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children[ppid].append(int(entry))
    out, todo = [], [root]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def ended(pids):
    """Those of pids that exited (gone, or a zombie not yet reaped)."""
    out = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    out.add(pid)
        except OSError:
            out.add(pid)
    return out


def traced_invoke(gw, name, event, tmp):
    """Invokes once with perf recording the gateway's VMM processes (and, inherited,
    the clones they fork); returns the answer's headers, the events of the clone that
    served the request (the process that ended with it), the emulated instruction
    count of every other process (a warm clone made meanwhile) and perf's complaints
    about lost events."""
    time.sleep(1.0)  # the warm pool refilled after the previous request
    pids = descendants(gw.p.pid)
    data = os.path.join(tmp, "perf.data")
    perf = perf_record(["-p", ",".join(map(str, pids))], data)
    status, headers, body, _ = gw.request("POST", f"/functions/{name}", event)
    deadline = time.monotonic() + 5
    while not ended(pids) and time.monotonic() < deadline:
        time.sleep(0.02)
    served = ended(pids)
    def answered():
        if status != 200:
            sys.exit(f"invoke {name}: {status} {body[:300]!r}")

    per_pid, lost = perf_events(perf, data, answered)
    if len(served) != 1:
        sys.exit(f"{name}: {len(served)} of the gateway's processes ended with the "
                 "request, not one")
    mine = per_pid.pop(served.pop(), [])
    others = sum(len(evs) for evs in per_pid.values())
    return headers, mine, others, lost


def perf_record(target, data):
    """perf recording the KVM tracepoints into file `data` for `target` (perf's `-a`, or
    `-p PIDS`), once it has had a moment to attach (perf has no ready signal)."""
    perf = subprocess.Popen(
        ["perf", "record", *target, "-m", "16M", "-o", data, "-e", "kvm:kvm_emulate_insn",
         "-e", "kvmmmu:kvm_mmu_set_spte"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(1.5)
    return perf


def perf_events(perf, data, check=lambda: None):
    """Stops `perf` (perf_record's) and reads what it recorded in `data`: each process's
    events, {pid: [(event, its text)]}, and perf's complaints about lost events.
    `check` runs once perf has stopped, before perf's own failure is looked at."""
    perf.send_signal(signal.SIGINT)
    _, err = perf.communicate()
    check()
    if perf.returncode not in (0, -signal.SIGINT):
        sys.exit(f"perf record failed ({perf.returncode}): {err.decode()[-400:]}")
    script = subprocess.run(["perf", "script", "-i", data, "-F", "pid,event,trace"],
                            capture_output=True, text=True)
    per_pid = collections.defaultdict(list)
    for line in script.stdout.splitlines():
        m = re.match(r"\s*(\d+)\s+kvm(?:mmu)?:(\w+):\s*(.*)", line)
        if m:
            per_pid[int(m.group(1))].append((m.group(2), m.group(3)))
    lost = [ln for ln in (err.decode() + script.stderr).splitlines() if "lost" in ln.lower()]
    return per_pid, lost


# Kernel functions whose first instruction counts an event: a system call (the PVM
# guest patch dispatches through do_syscall_64 too), a guest page fault, a timer
# interrupt, a tick, a task switch.
ENTRIES = {"syscalls": "do_syscall_64", "page faults": "handle_mm_fault",
           "timer interrupts": "sysvec_apic_timer_interrupt", "ticks": "tick_sched_timer",
           "schedules": "__schedule"}


# Where the guest kernel's addresses begin (x86-64's upper half).
KERNEL = 0xFFFF800000000000


def emulated_rips(events):
    """The guest addresses of the emulated instructions among `events`, in order."""
    for ev, text in events:
        if ev == "kvm_emulate_insn":
            yield int(text.split(":")[1].split()[0], 16)


def analyse(events, syms):
    """Counts of one request's events: emulated instructions (kernel, user), by kind
    and by function; entries to ENTRIES' functions; shadow page-table entries set."""
    by_fn, kinds = collections.Counter(), collections.Counter()
    user = 0
    starts = {syms.addr(fn): what for what, fn in ENTRIES.items()}
    entries = collections.Counter({what: 0 for what in ENTRIES})
    for rip in emulated_rips(events):
        if rip < KERNEL:
            user += 1
            continue
        if rip in starts:
            entries[starts[rip]] += 1
        fn = syms.name(rip)
        by_fn[fn] += 1
        kinds[kind_of(fn)] += 1
    sptes = sum(ev == "kvm_mmu_set_spte" for ev, _ in events)
    return {"kernel_insns": sum(by_fn.values()), "user_insns": user, "sptes": sptes,
            "entries": dict(entries),
            "kinds": dict(kinds.most_common()), "functions": dict(by_fn.most_common(40))}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated function names")
    ap.add_argument("--bin-dir", help="where forkvm-gateway and vmm are")
    ap.add_argument("--base-snapshot", help="the gateway's --base-snapshot")
    ap.add_argument("--vmlinux", default=os.path.join(GUEST, "vmlinux"))
    ap.add_argument("--top", type=int, default=6, help="kernel functions listed per row")
    ap.add_argument("--json", help="write every count to this file")
    ap.add_argument("--age", type=float, default=0,
                    help="seconds to wait after the first request, before the traced "
                    "one (the template paused that long: what a clone of an idle "
                    "template catches up on)")
    a = ap.parse_args()
    names = a.only.split(",") if a.only else list(functions.FUNCTIONS)
    if a.bin_dir:
        faas.GATEWAY = os.path.join(a.bin_dir, "forkvm-gateway")
    syms = Symbols(a.vmlinux)
    extra = ["--load-timeout-s", "1800"]
    if a.base_snapshot:
        extra += ["--base-snapshot", a.base_snapshot]
    gw = Gateway(extra, warm=1)
    results = {}
    tmp = tempfile.mkdtemp(prefix="forkvm-trace-")
    try:
        for name in names:
            source, event, packages = functions.FUNCTIONS[name]
            for mode, fname, warmup in (("no warm-up", name, None),
                                        ("warm-up", name + "-warm", event)):
                functions.deploy(gw, fname, source, packages, warmup)
                untraced = functions.invoke(gw, fname, event)[2]
                if a.age:
                    time.sleep(a.age)
                    untraced = functions.invoke(gw, fname, event)[2]
                    time.sleep(a.age)
                headers, events, others, lost = traced_invoke(gw, fname, event, tmp)
                counts = analyse(events, syms)
                counts["other_process_insns"] = others
                counts["handler_ms_untraced"] = untraced
                counts["handler_ms_traced"] = int(headers.get("x-forkvm-handler-us", 0)) / 1e3
                counts["lost"] = lost
                results[f"{name} ({mode})"] = counts
                report(f"{name} ({mode})", counts, a.top)
    finally:
        gw.stop()
        for f in os.listdir(tmp):
            os.unlink(os.path.join(tmp, f))
        os.rmdir(tmp)
    summary(results)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1)


def report(label, c, top):
    print(f"\n{label}: handler {c['handler_ms_untraced']:.1f} ms untraced "
          f"({c['handler_ms_traced']:.1f} traced); {c['kernel_insns']} emulated kernel "
          f"instructions, {c['user_insns']} user; {c['sptes']} shadow PTEs set; "
          f"{c['other_process_insns']} instructions in other processes")
    if c["lost"]:
        print(f"  perf lost events: {c['lost']}")
    print("  " + ", ".join(f"{what} {n}" for what, n in c["entries"].items()))
    for kind, n in c["kinds"].items():
        print(f"  {kind}: {n}")
    fns = list(c["functions"].items())[:top]
    print("  top: " + ", ".join(f"{fn} {n}" for fn, n in fns))


def summary(results):
    kinds = [k for k, _ in KINDS] + ["other"]
    short = ["random", "ticks+sched", "copies", "faults+alloc", "files", "syscalls",
             "other"]
    print("\n| function | handler ms | kernel insns | " + " | ".join(short) +
          " | shadow PTEs |")
    print("|---" * (len(short) + 4) + "|")
    for label, c in results.items():
        cells = " | ".join(str(c["kinds"].get(k, 0)) for k in kinds)
        print(f"| {label} | {c['handler_ms_untraced']:.1f} | {c['kernel_insns']} | {cells} "
              f"| {c['sptes']} |")


if __name__ == "__main__":
    main()
