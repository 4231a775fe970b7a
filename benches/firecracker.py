#!/usr/bin/env python3
"""forkvm beside Firecracker: from nothing running to a guest that answers, for a snapshot
restore in each VMM and for a forkvm clone, side by side in one run (docs/benchmarks/snapshots.md).

Firecracker is not part of forkvm, and this script neither fetches nor builds it: pass a
`firecracker` binary built from its source (--firecracker BIN). The same guest images,
memory size and vCPU count go to both VMMs; each boots the guest once and snapshots it,
then the runs alternate between the ways of starting one, so machine noise hits each
alike.

  tiny   forkvm's tiny guest (target/guest/tiny.elf, ticks=1 beat=1: a heartbeat line on
         the serial port every 1 ms), 128 MiB, 1 vCPU: process spawn to the restored
         guest's first heartbeat line, with the snapshot's files in the page cache (warm)
         and dropped from it first (cold, posix_fadvise DONTNEED).
           firecracker   spawn `firecracker --api-sock S`, then PUT /snapshot/load
                         (`File` memory backend, resume_vm) once its socket is there;
           forkvm        `vmm restore --dir D --console stdout`.
  linux  the Linux guest (vmlinux, rootfs.ext4 as a read-only root, 256 MiB, 1 vCPU,
         forkvm-agent listening on vsock port 1024), snapshotted while idle, started
         three ways, in a shuffled order each run, each after 0.5 s of quiet:
           Firecracker restore   spawn, PUT /snapshot/load (resume_vm, vsock_override);
           forkvm restore        spawn `vmm restore --dir D --vsock V`;
           forkvm warm clone     POST /clones on the paused template forkvm booted
                                 (--warm-clones 1).
         Each is timed from the spawn (the request) to
           VM running       Firecracker: PUT /snapshot/load answered (the VM resumed);
                            forkvm restore: vCPU 0's first entry into the guest, which
                            it logs; warm clone: POST /clones answered (its vCPU runs),
                            and the VMM's own latency_us for it;
           guest accepts    the guest kernel accepting a connection on vsock port 1024
                            (the VMM's `OK` line, which both VMMs send when the guest's
                            connection response arrives);
           echo answered    a command run through the agent (`echo`, a process the
                            guest forks);
         and `echo again (alone)` times a second command by itself. In a forkvm clone or
         restore the agent adopts the new identity (`forkvm-clone --adopt`: reseed,
         clock) before its first command, and a Firecracker restore keeps its
         parent's, so the first `echo` costs forkvm more; the second shows the guest
         alone. The guest's kernel command line in Firecracker is the one forkvm gave it
         (read from /proc/cmdline, less forkvm's virtio-mmio device list), so both get
         the PVM host switches.

Firecracker runs with --no-seccomp (built for glibc, it has no default filter; its
filters are for its musl build); forkvm with its default seccomp filters. min / median /
p99 and the median against Firecracker's restore.

usage: benches/firecracker.py --firecracker BIN [tiny|linux|all] [--runs N] [--dir DIR]
"""
import argparse
import json
import os
import random
import re
import select
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clone import vsock_exec  # noqa: E402
from invoke import LINUX  # noqa: E402
from snapshot import drop_cache, first_line, stats, take_snapshot, wait_for  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUEST = os.path.join(ROOT, "target/guest")
VMM = os.path.join(ROOT, "target/release/vmm")


def request(sock, method, path, body=None, ok=(200, 201, 204)):
    """One API request with a JSON body to either VMM, its answer read by its
    Content-Length (Firecracker keeps the connection open); exits on an unexpected
    status."""
    data = json.dumps(body).encode() if body is not None else b""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(600)
    s.connect(sock)
    s.sendall(f"{method} {path} HTTP/1.1\r\nHost: localhost\r\nContent-Type: "
              f"application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode() + data)
    out = b""
    while b"\r\n\r\n" not in out:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    head, _, answer = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    length = next((int(v) for k, _, v in (line.partition(": ") for line in lines[1:])
                   if k.lower() == "content-length"), None)
    while length is not None and len(answer) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        answer += chunk
    s.close()
    status = int(lines[0].split()[1]) if lines[0] else 0
    if status not in ok:
        sys.exit(f"{method} {path} on {sock}: {status} {answer[:300]!r}")
    return json.loads(answer) if answer.strip() else None


def connect_when_there(path, deadline, poll=0.0002):
    """A connected Unix socket to `path`, tried until it accepts or `deadline`."""
    while True:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except OSError:
            s.close()
            if time.perf_counter() > deadline:
                raise RuntimeError(f"nothing listening on {path}")
            time.sleep(poll)


def agent_ok(path, timeout=600.0):
    """Seconds until the guest accepts a connection on vsock port 1024 through the VMM's
    socket `path` (retried while the VMM or the guest's agent is not there yet)."""
    start = time.perf_counter()
    deadline = start + timeout
    while True:
        s = connect_when_there(path, deadline)
        s.settimeout(max(deadline - time.perf_counter(), 1))
        s.sendall(b"CONNECT 1024\n")
        line = b""
        try:
            while not line.endswith(b"\n"):
                chunk = s.recv(64)
                if not chunk:
                    break
                line += chunk
        except OSError:
            pass
        s.close()
        if line.startswith(b"OK "):
            return time.perf_counter() - start
        if time.perf_counter() > deadline:
            raise RuntimeError(f"no agent on {path}: {line!r}")
        time.sleep(0.05)


# What the Linux phase measures, in the order of its table.
MEASURES = ["VM running", "VM running (the VMM's latency_us)", "guest accepts",
            "echo answered", "echo again (alone)"]
# Seconds of quiet before each start, so the last VM's end does not overlap the next.
SETTLE = 0.5


def echo(path):
    code, out = vsock_exec(path, "echo forkvm-bench")
    if code != 0 or not out.startswith(b"forkvm-bench"):
        sys.exit(f"{path}: echo through the agent exited {code}: {out[:200]!r}")


def answers(path, t0):
    """Seconds from t0 to the guest's `OK` on vsock port 1024 and to `echo`'s answer
    through the agent, and a second `echo`'s own time."""
    deadline = t0 + 120
    s = connect_when_there(path, deadline)
    s.settimeout(120)
    f = s.makefile("rb")
    s.sendall(b"CONNECT 1024\n")
    line = f.readline()
    ok = time.perf_counter() - t0
    s.close()
    if not line.startswith(b"OK "):
        sys.exit(f"{path}: the guest did not accept: {line!r}")
    echo(path)
    answered = time.perf_counter() - t0
    echo(path)
    return {"guest accepts": ok, "echo answered": answered,
            "echo again (alone)": time.perf_counter() - t0 - answered}


def stop(p):
    if p.poll() is None:
        p.kill()
    p.wait()


def remove(*paths):
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Firecracker:
    """Boots, snapshots and restores guests with a Firecracker binary."""

    def __init__(self, binary, work):
        self.binary, self.work, self.n = binary, work, 0

    def spawn(self, stdout):
        self.n += 1
        sock = os.path.join(self.work, f"fc{self.n}.sock")
        p = subprocess.Popen([self.binary, "--api-sock", sock, "--no-seccomp",
                              "--level", "Error"],
                             stdin=subprocess.DEVNULL, stdout=stdout,
                             stderr=open(sock + ".log", "wb"))
        return p, sock

    def snapshot(self, config, ready, tag):
        """Boots `config`, waits for `ready(process)`, pauses and writes a full snapshot;
        returns (state file, memory file)."""
        cfg = os.path.join(self.work, f"{tag}.json")
        with open(cfg, "w") as f:
            json.dump(config, f)
        sock = os.path.join(self.work, f"fc-{tag}.sock")
        p = subprocess.Popen([self.binary, "--api-sock", sock, "--no-seccomp", "--level",
                              "Error", "--config-file", cfg],
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=open(sock + ".log", "wb"))
        try:
            ready(p)
            request(sock, "PATCH", "/vm", {"state": "Paused"})
            snap = os.path.join(self.work, f"fc-snap-{tag}")
            os.makedirs(snap, exist_ok=True)
            state, mem = (os.path.join(snap, x) for x in ("state", "mem"))
            request(sock, "PUT", "/snapshot/create",
                    {"snapshot_type": "Full", "snapshot_path": state, "mem_file_path": mem})
            return state, mem
        finally:
            stop(p)
            remove(sock)

    def restore(self, state, mem, stdout, vsock=None):
        """Spawns Firecracker and loads the snapshot, resumed; returns (process, spawn
        time)."""
        t0 = time.perf_counter()
        p, sock = self.spawn(stdout)
        connect_when_there(sock, t0 + 30).close()
        load = {"snapshot_path": state,
                "mem_backend": {"backend_path": mem, "backend_type": "File"},
                "resume_vm": True}
        if vsock:
            load["vsock_override"] = {"uds_path": vsock}
        request(sock, "PUT", "/snapshot/load", load)
        return p, sock, t0, time.perf_counter() - t0


def wait_output(p, needle, timeout=900):
    """Reads `p`'s stdout until `needle`; returns what was read."""
    out, start = b"", time.perf_counter()
    while needle not in out:
        left = timeout - (time.perf_counter() - start)
        r, _, _ = select.select([p.stdout], [], [], max(left, 0))
        if not r:
            raise RuntimeError(f"no {needle!r} in {timeout} s: {out[-300:]!r}")
        chunk = os.read(p.stdout.fileno(), 65536)
        if not chunk:
            raise RuntimeError(f"exited before {needle!r}: {out[-300:]!r}")
        out += chunk
    return out


def print_rows(title, res, base_key):
    print(title + "\n")
    print("| how | min | median | p99 | median vs Firecracker |")
    print("|---|---|---|---|---|")
    base = statistics.median(res[base_key])
    for how, xs in res.items():
        lo, med, p99 = stats(xs)
        print(f"| {how} | {lo*1e3:.2f} | {med*1e3:.2f} | {p99*1e3:.2f} | {med/base:.2f}x |")
    print()


def tiny(fc, work, runs):
    mib = 128
    snap, _ = take_snapshot(work, mib, False)
    state, mem = fc.snapshot(
        {"boot-source": {"kernel_image_path": os.path.join(GUEST, "tiny.elf"),
                         "boot_args": "ticks=1 beat=1"},
         "drives": [],
         "machine-config": {"vcpu_count": 1, "mem_size_mib": mib}},
        lambda p: wait_output(p, b"tiny: beat 5", timeout=60), "tiny")
    needle = b"tiny: beat "

    def fc_restore():
        p, sock, t0, _ = fc.restore(state, mem, subprocess.PIPE)
        try:
            wait_output(p, needle, timeout=30)
            return time.perf_counter() - t0
        finally:
            stop(p)
            remove(sock)

    forkvm_cmd = [VMM, "--log-level", "info", "restore", "--dir", snap, "--console", "stdout"]
    res = {k: [] for k in ("Firecracker restore, warm cache", "forkvm restore, warm cache",
                           "Firecracker restore, cold cache", "forkvm restore, cold cache")}
    fc_restore()
    first_line(forkvm_cmd, needle)  # the page cache, warmed once unmeasured
    for _ in range(runs):
        res["Firecracker restore, warm cache"].append(fc_restore())
        res["forkvm restore, warm cache"].append(first_line(forkvm_cmd, needle)[0])
        drop_cache(os.path.dirname(state))
        res["Firecracker restore, cold cache"].append(fc_restore())
        drop_cache(snap)
        res["forkvm restore, cold cache"].append(first_line(forkvm_cmd, needle)[0])
    print_rows(f"Process spawn to the restored tiny guest's first heartbeat line, {mib} MiB, "
               f"1 vCPU, {runs} interleaved runs each (ms):", res,
               "Firecracker restore, warm cache")
    shutil.rmtree(snap, ignore_errors=True)
    shutil.rmtree(os.path.dirname(state), ignore_errors=True)


def linux(fc, work, runs):
    mib = 256
    sock, vsock = os.path.join(work, "t.sock"), os.path.join(work, "t.vsock")
    cmdline = f"{LINUX} root=/dev/vda ro rootfstype=ext4 forkvm.agent=1024"
    template = subprocess.Popen(
        [VMM, "run", "--kernel", os.path.join(GUEST, "vmlinux"), "--rootfs",
         os.path.join(GUEST, "rootfs.ext4"), "--mem-mib", str(mib), "--vcpus", "1",
         "--vsock", vsock, "--warm-clones", "1", "--cmdline", cmdline,
         "--console", os.path.join(work, "t.console"), "--api-sock", sock],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=open(sock + ".log", "wb"))
    try:
        booted = agent_ok(vsock)
        print(f"forkvm booted the Linux guest to its agent in {booted:.1f} s", file=sys.stderr)
        code, seen = vsock_exec(vsock, "cat /proc/cmdline")
        if code != 0:
            sys.exit(f"cat /proc/cmdline: {code} {seen!r}")
        words = [w for w in seen.decode().split()
                 if not w.startswith(("virtio_mmio.device=", "root=")) and w != "ro"]
        request(sock, "PATCH", "/vm", {"state": "paused"})
        snap = os.path.join(work, "linux-snap")
        request(sock, "PUT", "/snapshot", {"dir": snap})
        wait_for("a warm clone", lambda: request(sock, "GET", "/vm")["warm_clones"]["ready"] == 1,
                 timeout=120)

        fc_vsock = os.path.join(work, "fc-boot.vsock")
        start = time.perf_counter()
        state, mem = fc.snapshot(
            {"boot-source": {"kernel_image_path": os.path.join(GUEST, "vmlinux"),
                             "boot_args": " ".join(words)},
             "drives": [{"drive_id": "rootfs", "is_root_device": True, "is_read_only": True,
                         "path_on_host": os.path.join(GUEST, "rootfs.ext4")}],
             "machine-config": {"vcpu_count": 1, "mem_size_mib": mib},
             "vsock": {"guest_cid": 3, "uds_path": fc_vsock}},
            lambda p: (agent_ok(fc_vsock), answers(fc_vsock, time.perf_counter())), "linux")
        print(f"Firecracker booted the Linux guest to its agent in "
              f"{time.perf_counter() - start:.1f} s", file=sys.stderr)
        remove(fc_vsock)

        def fc_restore(run):
            v = os.path.join(work, f"r{run}.vsock")
            p, fsock, t0, loaded = fc.restore(state, mem, subprocess.DEVNULL, vsock=v)
            try:
                return {"VM running": loaded, **answers(v, t0)}
            finally:
                stop(p)
                remove(fsock, v)

        def forkvm_restore(run):
            rsock, v = os.path.join(work, f"r{run}.sock"), os.path.join(work, f"r{run}.vsock")
            t0_ns, t0 = time.monotonic_ns(), time.perf_counter()
            p = subprocess.Popen([VMM, "--log-level", "info", "restore", "--dir", snap,
                                  "--api-sock", rsock, "--vsock", v, "--console", "null"],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=open(rsock + ".log", "wb"))
            try:
                got = answers(v, t0)
            finally:
                stop(p)
                remove(rsock, v)
            with open(rsock + ".log", "rb") as f:
                m = re.search(rb"entered the guest at (\d+) ns", f.read())
            if not m:
                sys.exit(f"forkvm restore logged no vCPU entry: see {rsock}.log")
            return {"VM running": (int(m.group(1)) - t0_ns) / 1e9, **got}

        def warm_clone(run):
            wait_for("a warm clone",
                     lambda: request(sock, "GET", "/vm")["warm_clones"]["ready"] == 1,
                     timeout=120)
            time.sleep(SETTLE)
            t0 = time.perf_counter()
            c = request(sock, "POST", "/clones", {"count": 1, "console": "null"})["clones"][0]
            running = time.perf_counter() - t0
            try:
                got = answers(c["vsock"], t0)
            finally:
                request(sock, "DELETE", f"/clones/{c['id']}")
            return {"VM running": running,
                    "VM running (the VMM's latency_us)": c["latency_us"] / 1e6, **got}

        ways = {"Firecracker restore": fc_restore, "forkvm restore": forkvm_restore,
                "forkvm warm clone": warm_clone}
        got = {}
        order = random.Random(1)
        for run in range(runs):
            names = list(ways)
            order.shuffle(names)
            for name in names:
                time.sleep(SETTLE)
                for what, x in ways[name](run).items():
                    got.setdefault((what, name), []).append(x)
        res = {f"{name}: {what}": xs for (what, name), xs in
               sorted(got.items(), key=lambda kv: (MEASURES.index(kv[0][0]),
                                                   list(ways).index(kv[0][1])))}
        print_rows(f"To the Linux guest answering on vsock, {mib} MiB, 1 vCPU, snapshot and "
                   f"page cache warm, {runs} runs each in a shuffled order (ms):", res,
                   "Firecracker restore: VM running")
        shutil.rmtree(snap, ignore_errors=True)
        shutil.rmtree(os.path.dirname(state), ignore_errors=True)
    finally:
        stop(template)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("what", nargs="?", default="all", choices=["tiny", "linux", "all"])
    ap.add_argument("--firecracker", required=True, help="a firecracker binary")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--dir", help="scratch directory (default: a new one in /var/tmp, on "
                    "disk, so the cold-cache runs read the snapshots from the disk)")
    a = ap.parse_args()
    if not os.access(a.firecracker, os.X_OK):
        sys.exit(f"{a.firecracker}: not an executable")
    version = subprocess.run([a.firecracker, "--version"], capture_output=True, text=True)
    print(f"Firecracker: {version.stdout.strip().splitlines()[0] if version.stdout else '?'}")
    work = a.dir or tempfile.mkdtemp(prefix="forkvm-fc-", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    fc = Firecracker(a.firecracker, work)
    try:
        if a.what in ("tiny", "all"):
            tiny(fc, work, a.runs)
        if a.what in ("linux", "all"):
            linux(fc, work, a.runs)
    finally:
        if not a.dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
