#!/usr/bin/env python3
"""Soak (docs/reliability.md): one tiny-guest template serving clone/exit cycles and
invocations, with what the template's VMM holds counted every --every operations:
descriptors, threads, RSS, live children, zombies, clone records, files in its socket
directory, and, with --cgroup-class, the cgroups of its pools. The counts must end where
they began (after a first round that makes what is made lazily).

--cgroup-class CLASS (as `vmm run` takes it, e.g. small:cpu=0.5,memory=64M,pids=64) puts
every clone in a pooled cgroup of that class, under a parent of the soak's own
(forkvm-soak-PID in each hierarchy, removed at the end); the cgroups counted are every
directory below it, in every hierarchy. After the template exits, none may be left.

cycles: POST /clones {"count":1} then DELETE /clones/{id} (the clone stops; its console,
  which a clone leaves for its user, is removed as a user would), --cycles times.
invocations: POST /invocations of the tiny guest's echo handler, each in a fresh warm
  clone, --invocations times.
The start and end counts are taken at rest (the template paused with its warm clones
ready, no other child, and with --cgroup-class the pools' cgroup count unchanged for
35 s, as idle extras are removed after 30 s); those in between are snapshots with
clones on their way.
Records of clones that ended are kept up to 1024 (`cloning::table::ENDED_KEPT`).

--guest c or python runs a Linux template instead of the tiny guest (256 MiB, release
build, as benches/invoke.py's runtimes): the C runtime's echo (`forkvm-fn echo`,
initramfs) or the Python runtime's no-op (`forkvm_examples:noop`, python.ext4 as a
read-only root). Its boot takes minutes here; each cycle's clone runs a Linux kernel
until it is deleted, and each invocation is served by a fresh primed warm clone.

--rewind runs the template with `vmm run --rewind`: its invocation clones are rewound and
serve again, so the warm clones' own descriptors and anonymous memory (clone_fds,
clone_anon_kib: its children's, summed) must end where they began too.

--sources N runs the template with `vmm run --fork-sources N`: its invocations are served
in turn by it and by N-1 fork sources (clones of it that are templates too). At rest its
children are then its warm clones and the sources, and the sources' children
(grandchildren) their warm clones: their descriptors are in clone_fds, and the
grandchildren's count and descriptors (grandchild_fds) must end where they began too.

usage: benches/soak.py [--cycles 10000] [--invocations 10000] [--every 1000] [--warm 4]
                       [--cgroup-class CLASS] [--guest tiny|c|python] [--rewind]
                       [--sources N]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from invoke import LINUX, PY_NOOP, VMM, exchange, invoke, ready_template, wait_vm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "target/guest/tiny.elf")
GUEST = os.path.join(ROOT, "target/guest")


def guest_args(guest):
    """`vmm run` arguments of the template's guest, and what its handler answers to a
    payload (None: the payload itself)."""
    if guest == "tiny":
        return ["--kernel", TINY, "--ap-boot", "direct", "--mem-mib", "64",
                "--cmdline", "ticks=1 invoke=1"], None
    kernel = ["--kernel", os.path.join(GUEST, "vmlinux"), "--mem-mib", "256"]
    if guest == "c":
        return kernel + ["--initrd", os.path.join(GUEST, "initramfs.cpio"), "--cmdline",
                         f'{LINUX} forkvm.run="forkvm-fn echo"'], None
    return kernel + ["--rootfs", os.path.join(GUEST, "python.ext4"), "--cmdline",
                     f"{LINUX} root=/dev/vda ro rootfstype=ext4 "
                     f'forkvm.run="python3 -m forkvm {PY_NOOP}"'], b""


def kib(pid, key):
    """A /proc/PID/status figure in KiB (0 for a process gone meanwhile)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def fd_count(pid):
    """Its descriptors (0 for a process gone meanwhile)."""
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return 0


def children(pid):
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def children_of_gone_ok(pid):
    """A child's children ([] for a process gone meanwhile)."""
    try:
        return children(pid)
    except OSError:
        return []


# The template's fork sources, itself included (--sources).
SOURCES = 1


def state_of(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


CGROUP_ROOT = "/sys/fs/cgroup"


def cgroup_dirs(parent):
    """The parent's directory in every cgroup hierarchy that has it (v1 controllers,
    and the v2 mount)."""
    out = []
    for h in sorted(os.listdir(CGROUP_ROOT)):
        d = os.path.join(CGROUP_ROOT, h, parent)
        if os.path.isdir(d):
            out.append(d)
    if os.path.isdir(os.path.join(CGROUP_ROOT, parent)):
        out.append(os.path.join(CGROUP_ROOT, parent))
    return out


def cgroups_below(parent):
    return sum(len(d) for top in cgroup_dirs(parent) for _, d, _ in os.walk(top))


def counts(pid, sock, tmp, cgroup_parent):
    kids = children(pid)
    _, _, body = exchange(sock, "GET", "/clones")
    c = {
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
        "threads": len(os.listdir(f"/proc/{pid}/task")),
        "rss_kib": kib(pid, "VmRSS:"),
        "children": len(kids),
        "zombies": sum(state_of(k) == "Z" for k in kids),
        "records": len(json.loads(body)["clones"]),
        "files": len(os.listdir(tmp)),
        # Its live children's own (warm clones; with --rewind the same processes serve
        # request after request).
        "clone_fds": sum(fd_count(k) for k in kids),
        "clone_anon_kib": sum(kib(k, "RssAnon:") for k in kids),
    }
    grand = [g for k in kids for g in children_of_gone_ok(k)]
    if grand or SOURCES > 1:
        c["grandchildren"] = len(grand)
        c["grandchild_fds"] = sum(fd_count(g) for g in grand)
    if cgroup_parent:
        c["cgroups"] = cgroups_below(cgroup_parent)
    return c


def settled(p, sock, tmp, a):
    """The counts once the template is back at rest: paused and waiting with its warm
    clones ready, and no child but them (invocation clones are reaped as they end)."""
    wait_vm(p, sock, ready_template(a.warm), timeout=60)
    if a.cgroup_parent:
        # Pools grow with the clones in use at once and remove idle extras after 30 s
        # (docs/jailer.md): at rest means no change for longer than that.
        deadline, last, since = time.time() + 120, None, time.time()
        while time.time() < deadline:
            n = cgroups_below(a.cgroup_parent)
            if n != last:
                last, since = n, time.time()
            elif time.time() - since > 35:
                break
            time.sleep(0.5)
    deadline = time.time() + 10
    sources = a.sources - 1
    while True:
        c = counts(p.pid, sock, tmp, a.cgroup_parent)
        rest = c["children"] == a.warm + sources and \
            c.get("grandchildren", 0) == a.warm * sources
        if rest or time.time() > deadline:
            return c
        time.sleep(0.05)


def show(what, done, c, t0):
    cols = " ".join(f"{k}={v}" for k, v in c.items())
    print(f"{what:12} {done:6}  {time.time() - t0:7.1f} s  {cols}", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cycles", type=int, default=10000)
    ap.add_argument("--invocations", type=int, default=10000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--warm", type=int, default=4)
    ap.add_argument("--cgroup-class", default="", help="a resource class for every clone")
    ap.add_argument("--guest", choices=["tiny", "c", "python"], default="tiny",
                    help="the template's guest and runtime")
    ap.add_argument("--rewind", action="store_true",
                    help="vmm run --rewind: invocation clones rewound, not ended")
    ap.add_argument("--sources", type=int, default=1, metavar="N",
                    help="vmm run --fork-sources N: invocations served by N processes")
    a = ap.parse_args()
    global SOURCES
    SOURCES = a.sources
    a.cgroup_parent = f"forkvm-soak-{os.getpid()}" if a.cgroup_class else ""
    tmp = tempfile.mkdtemp(prefix="forkvm-soak-")
    sock = os.path.join(tmp, "api.sock")
    guest, expect = guest_args(a.guest)
    cmd = [VMM, "run", *guest, "--console", os.path.join(tmp, "console"),
           "--api-sock", sock, "--template", "--warm-clones", str(a.warm)]
    if a.rewind:
        cmd.append("--rewind")
    if a.sources > 1:
        cmd += ["--fork-sources", str(a.sources)]
    if a.cgroup_class:
        cmd += ["--cgroup-class", a.cgroup_class, "--cgroup-parent", a.cgroup_parent]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    try:
        wait_vm(p, sock, ready_template(a.warm), timeout=120 if a.guest == "tiny" else 900)
        t0 = time.time()
        first = None
        print(f"{a.guest} template pid {p.pid}; counts of its VMM every {a.every} operations")

        def cycle():
            status, _, body = exchange(sock, "POST", "/clones", b'{"count":1}')
            if status != 201:
                sys.exit(f"POST /clones: {status} {body[:200]!r}")
            c = json.loads(body)["clones"][0]
            status, _, body = exchange(sock, "DELETE", "/clones/" + c["id"])
            if status != 200:
                sys.exit(f"DELETE /clones/{c['id']}: {status} {body[:200]!r}")
            os.remove(c["console"])

        # A first round of each, so what is made lazily exists before counting.
        # Each phase's own way (invocations back to back keep more cgroups busy at once
        # than cycles do: a clone's cgroup is free again only once it was reaped).
        for _ in range(min(a.every, 100)):
            cycle()
        for _ in range(min(a.every, 100)):
            invoke(sock, b"soak", expect=expect)
        first = settled(p, sock, tmp, a)
        show("start", 0, first, t0)
        for i in range(1, a.cycles + 1):
            cycle()
            if i % a.every == 0:
                show("cycles", i, counts(p.pid, sock, tmp, a.cgroup_parent), t0)
        for i in range(1, a.invocations + 1):
            invoke(sock, b"soak %d" % i, expect=expect)
            if i % a.every == 0:
                show("invocations", i, counts(p.pid, sock, tmp, a.cgroup_parent), t0)
        last = settled(p, sock, tmp, a)
        show("end", a.cycles + a.invocations, last, t0)
        # Records of clones that ended are kept up to 1024 (the oldest go first).
        # Memory is reported, not required to end equal: the clones' own depends on
        # which processes the pool holds at the end (a rewound one holds the pages its
        # requests wrote; a leak shows as growth from row to row with the same ones).
        grew = {k: (first[k], last[k]) for k in first
                if k not in ("rss_kib", "records", "clone_anon_kib") and last.get(k) != first[k]}
        # Besides the sources, which run.
        if last["records"] > 1024 + a.sources - 1:
            grew["records"] = (first["records"], last["records"])
        rss = last["rss_kib"] - first["rss_kib"]
        print(f"RSS {first['rss_kib']} -> {last['rss_kib']} KiB ({rss:+d}); "
              f"changed: {grew or 'nothing else'}")
        exchange(sock, "PUT", "/actions", b'{"action_type":"shutdown"}')
        p.wait(timeout=60)
        left = cgroups_below(a.cgroup_parent) if a.cgroup_parent else 0
        if a.cgroup_parent:
            print(f"cgroups left after the template exited: {left}")
        if grew or left:
            sys.exit(1)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
        if a.cgroup_parent:
            for d in cgroup_dirs(a.cgroup_parent):
                try:
                    os.rmdir(d)
                except OSError as e:
                    print(f"cannot remove {d}: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
