#!/usr/bin/env python3
"""Invocation benchmarks (docs/invoke.md), with the tiny guest's echo handler.

latency: side by side in interleaved rounds, request to reply from the client's side
  (connect, POST /invocations, the whole answer read) with a 256 MiB template:
  - a fresh warm clone per request (--warm-clones 8), and the VMM's own figures for
    it (x-forkvm-clone-us: arrival to the clone's vCPUs starting with the request in
    its mailbox; x-forkvm-handler-us; x-forkvm-total-us);
  - a fresh clone forked per request (no warm clones);
  - in place, a keep-alive clone serving request after request (no clone at all);
  - POST /clones of the same paused template (the clone alone, no handler, no answer
    from the guest) followed by DELETE, as a reference;
  - the SOCK mechanism on this host: a Python zygote process that forks a child per
    request, which runs a no-op echo handler and answers over a Unix socket (no VM).
throughput: invocations per second with 1, 2, 4, ... up to 4x the cores of concurrent
  clients (processes), each request in a fresh clone of a template with --warm 8 warm
  clones, with the latency and the host CPU per invocation (/proc/stat, the clients' own
  left out); beside it, at the same client counts, the SOCK mechanism (a host Python
  zygote forking per request, with the same handler) and, with --baseline VMM, another
  build. --guest c or python: the C runtime's echo or a Python no-op in a 256 MiB Linux
  template instead of the tiny guest. --plot PNG draws invocations/s against clients.
  --rewind adds this build with `vmm run --rewind` (rewound clones), and the baseline
  so too; --class NAME:LIMITS adds each build again with cgroup pools of that class
  (every clone in a cgroup of it; needs root; the pools' parent is removed at the end);
  --sources N adds this build (and its --rewind) with `vmm run --fork-sources N`.

runtimes: the Linux runtimes, side by side in one run with 256 MiB templates booted at
  once: request to reply for the C runtime's echo (forkvm-fn echo) with the kernel RNG
  reseed on and off (forkvm.crng=off), and for a Python no-op handler
  (forkvm_examples:noop), each in a fresh warm clone, interleaved rounds; the SOCK
  mechanism with the same Python handler (a host zygote forking per request); as
  reference points, the same work through the vsock agent in a fresh clone (`vmm exec`'s
  path: `echo`, and python3 calling the same handler) and a cold boot serving one
  invocation (from spawning the VMM to the reply); then throughput with 1, 2, 4 and 8
  clients for the C and Python runtimes, and host CPU per invocation. The templates run
  with forkvm's defaults (idle refresh, timer deferral: benches/idle.py). --exec-runs 0
  and --boots 0 leave out the agent and cold-boot rows (and their VMs).

ab: two builds side by side (--baseline VMM, another build's binary, against this one),
  in interleaved rounds: request to reply of the tiny echo in a fresh warm clone
  (--warm-clones 8) and in a clone forked per request, a 256 MiB template per build
  and mode, and the VMM's x-forkvm-clone-us for the warm clone.

usage: benches/invoke.py latency [--runs N] [--rounds R] [--mem MIB] [--payload BYTES]
       benches/invoke.py ab --baseline VMM [--runs N] [--rounds R] [--mem MIB]
       benches/invoke.py throughput [--seconds S] [--clients auto|1,2,4,8] [--mem MIB]
                                    [--warm N] [--guest tiny|c|python] [--baseline VMM]
                                    [--rewind] [--class NAME:LIMITS] [--sources N]
                                    [--plot PNG]
       benches/invoke.py runtimes [--runs N] [--rounds R] [--exec-runs N] [--boots N]
                                  [--seconds S] [--clients 1,2,4,8]
"""
import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import load
from clone import pct, row as clone_row, vsock_exec

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "target/guest/tiny.elf")
GUEST = os.path.join(ROOT, "target/guest")
PYTHON_HANDLERS = os.path.join(ROOT, "guest/python")
VMM = os.path.join(ROOT, "target/release/vmm")


def read_all(s):
    """Everything `s` sends until it closes; closes `s`."""
    out = b""
    while True:
        chunk = s.recv(1 << 16)
        if not chunk:
            break
        out += chunk
    s.close()
    return out


def exchange(sock, method, path, body=b"", timeout=60):
    """One request; returns (status, headers dict, body bytes)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(sock)
    s.sendall(f"{method} {path} HTTP/1.1\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
    out = read_all(s)
    head, _, data = out.partition(b"\r\n\r\n")
    lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers, data


def invoke(sock, payload, query="", expect=None):
    """One invocation; its reply must start with `expect` (default: the payload)."""
    t0 = time.perf_counter()
    status, headers, data = exchange(sock, "POST", "/invocations" + query, payload)
    elapsed = time.perf_counter() - t0
    if status != 200 or not data.startswith(payload if expect is None else expect):
        sys.exit(f"invocation failed: {status} {data[:200]!r}")
    return elapsed, headers


def start_template(tmp, name, mem, warm, vmm=None, extra=()):
    sock = os.path.join(tmp, name + ".sock")
    console = sock + ".console"
    cmd = [vmm or VMM, "run", "--kernel", TINY, "--ap-boot", "direct", "--mem-mib", str(mem),
           "--cmdline", "ticks=1 invoke=1", "--console", console, "--api-sock", sock,
           "--template", "--warm-clones", str(warm), "--prefault", *extra]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    wait_vm(p, sock, lambda v: v["state"] == "paused" and
            (warm == 0 or v["warm_clones"]["ready"] == warm), timeout=60)
    return p, sock


def stop(p, sock):
    exchange(sock, "PUT", "/actions", b'{"action_type":"shutdown"}')
    p.wait(timeout=60)


def wait_warm(sock, n, timeout=10):
    deadline = time.time() + timeout
    while time.time() < deadline:
        _, _, body = exchange(sock, "GET", "/vm")
        if f'"ready":{n}'.encode() in body:
            return
        time.sleep(0.002)


ZYGOTE = r'''
import importlib, os, socket, sys
if len(sys.argv) > 2:  # MODULE:FUNCTION DIR: the handler a guest runtime serves
    sys.path.insert(0, sys.argv[3])
    module, function = sys.argv[2].split(":")
    handler = getattr(importlib.import_module(module), function)
else:
    def handler(event):
        return event
srv = socket.socket(socket.AF_UNIX)
srv.bind(sys.argv[1]); srv.listen(64)
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    pid = os.fork()
    if pid == 0:
        srv.close()
        n = int.from_bytes(conn.recv(4), "little")
        data = b""
        while len(data) < n:
            data += conn.recv(n - len(data))
        out = handler(data)
        conn.sendall(len(out).to_bytes(4, "little") + out)
        os._exit(0)
    conn.close()
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
'''


def start_zygote(tmp, handler=None):
    path = os.path.join(tmp, "zygote.sock")
    args = [handler, PYTHON_HANDLERS] if handler else []
    p = subprocess.Popen([sys.executable, "-c", ZYGOTE, path, *args], stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL)
    p.stdout.readline()
    return p, path


def zygote_call(path, payload, expect=None):
    t0 = time.perf_counter()
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(len(payload).to_bytes(4, "little") + payload)
    data = read_all(s)
    elapsed = time.perf_counter() - t0
    if data[4:] != (payload if expect is None else expect):
        sys.exit("zygote answered wrongly")
    return elapsed


def row(label, xs_ms, base=None):
    return clone_row(label, xs_ms, base, digits=3)


def latency(a):
    payload = bytes(i % 251 for i in range(a.payload))
    series = {k: [] for k in ["warm", "fork", "inplace", "clone", "sock",
                              "warm_clone_us", "warm_handler_us", "warm_total_us"]}
    with tempfile.TemporaryDirectory(prefix="forkvm-invoke-", dir="/dev/shm") as tmp:
        warm_p, warm_sock = start_template(tmp, "warm", a.mem, 8)
        fork_p, fork_sock = start_template(tmp, "fork", a.mem, 0)
        zyg_p, zyg_path = start_zygote(tmp)
        # A keep-alive clone serves in place.
        _, h = invoke(warm_sock, payload, "?keep_alive=true")
        keep_sock = h["x-forkvm-socket"]
        try:
            for _ in range(a.rounds):
                for _ in range(a.runs):
                    wait_warm(warm_sock, 8)
                    t, h = invoke(warm_sock, payload)
                    series["warm"].append(t * 1e3)
                    for k in ["clone", "handler", "total"]:
                        series[f"warm_{k}_us"].append(int(h[f"x-forkvm-{k}-us"]) / 1e3)
                for _ in range(a.runs):
                    series["fork"].append(invoke(fork_sock, payload)[0] * 1e3)
                for _ in range(a.runs):
                    t, _ = invoke(keep_sock, payload, "?keep_alive=true")
                    series["inplace"].append(t * 1e3)
                for _ in range(a.runs):
                    wait_warm(warm_sock, 8)
                    t0 = time.perf_counter()
                    status, _, body = exchange(warm_sock, "POST", "/clones", b"")
                    series["clone"].append((time.perf_counter() - t0) * 1e3)
                    cid = body.split(b'"id":"')[1].split(b'"')[0].decode()
                    exchange(warm_sock, "DELETE", f"/clones/{cid}")
                for _ in range(a.runs):
                    series["sock"].append(zygote_call(zyg_path, payload) * 1e3)
        finally:
            exchange(keep_sock, "PUT", "/actions", b'{"action_type":"shutdown"}')
            stop(warm_p, warm_sock)
            stop(fork_p, fork_sock)
            zyg_p.kill()
            zyg_p.wait()
    n = a.runs * a.rounds
    base = statistics.median(series["warm"])
    print(f"\nInvocations, tiny guest echo, {a.mem} MiB template, {a.payload}-byte payload, "
          f"{n} requests per row in {a.rounds} interleaved rounds (ms; ratio of medians "
          f"to the warm-clone row)\n")
    print("| request to reply (client) | min | median | p99 | vs warm |")
    print("|---|---|---|---|---|")
    print(row("fresh warm clone per request", series["warm"], base))
    print(row("fresh clone forked per request", series["fork"], base))
    print(row("in place, keep-alive clone (no clone)", series["inplace"], base))
    print(row("POST /clones + DELETE (clone only, reference)", series["clone"], base))
    print(row("SOCK mechanism: host Python zygote forks per request (no VM)",
              series["sock"], base))
    print("\n| warm clone, the VMM's figures | min | median | p99 |")
    print("|---|---|---|---|")
    print(row("arrival to clone running with the request", series["warm_clone_us"]))
    print(row("handler (tiny guest, CPL 0: emulated here)", series["warm_handler_us"]))
    print(row("arrival to reply taken", series["warm_total_us"]))


def fmt(r):
    """A rate() row's cells: calls/s, median and p99 ms, host CPU ms per call."""
    failed = f" ({r['failed']} failed)" if r["failed"] else ""
    return (f"{r['per_s']:.0f}{failed} | {r['median']:.2f} | {r['p99']:.2f} | "
            f"{r['cpu_ms']:.2f}")


def throughput_rows(sock, clients, seconds, payload=b"ping", expect=None, warm=8):
    """Prints one row per client count: invocations/s, latency, host CPU per invocation."""
    for c in clients:
        r = load.rate(c, seconds, lambda: invoke(sock, payload, expect=expect)[0])
        print(f"| {c} | {fmt(r)} |", flush=True)
        wait_warm(sock, warm, timeout=60)


THROUGHPUT_HEAD = ("| clients | invocations/s | median ms | p99 ms | "
                   "host CPU ms per invocation |\n|---|---|---|---|---|")


def throughput(a):
    clients = load.parse_clients(a.clients)
    builds = [("forkvm", VMM)] + ([("baseline", a.baseline)] if a.baseline else [])
    if a.rewind:
        builds.append(("rewind", VMM))
        if a.baseline:
            builds.append(("baseline-rewind", a.baseline))
    parent = f"forkvm-bench-{os.getpid()}"
    if a.cgroup_class:
        # The same builds again with cgroup pools: each clone in a cgroup of the class.
        builds += [(f"{n}+class", vmm) for n, vmm in builds if not n.startswith("baseline")]

    if a.sources > 1:
        # This build again (fresh, and rewound with --rewind) with fork sources.
        builds += [(f"{n}+sources", vmm) for n, vmm in builds if n in ("forkvm", "rewind")]

    def extra(n):
        pools = ["--cgroup-class", a.cgroup_class, "--cgroup-parent", parent]
        sources = ["--fork-sources", str(a.sources)]
        return (["--rewind"] if "rewind" in n else []) + \
            (pools if n.endswith("+class") else []) + \
            (sources if n.endswith("+sources") else [])

    label, guest, expect, handler = GUESTS[a.guest]
    print(f"\nThroughput on {load.cores()} cores, {label}, "
          f"{a.mem if a.guest == 'tiny' else 256} MiB template, "
          f"--warm-clones {a.warm}, each request in a fresh clone (a new connection per "
          f"request), {a.seconds} s per row and system, systems interleaved per client "
          f"count; beside it the SOCK mechanism (a host Python zygote forking per "
          f"request, no VM). Clients are processes; host CPU per invocation leaves "
          f"theirs out.\n")
    cells = " | ".join(f"{n} /s | median ms | p99 ms | CPU ms" for n, _ in builds)
    print(f"| clients | {cells} | SOCK /s | median ms | p99 ms | CPU ms |")
    print("|---" * (1 + 4 * (len(builds) + 1)) + "|")
    series = {n: [] for n, _ in builds}
    series["SOCK"] = []
    with tempfile.TemporaryDirectory(prefix="forkvm-invoke-", dir="/dev/shm") as tmp:
        if a.guest == "tiny":
            vms = [(n, *start_template(tmp, n, a.mem, a.warm, vmm, extra(n)))
                   for n, vmm in builds]
        else:
            run, root = guest
            warm = ["--template", "--warm-clones", str(a.warm)]
            vms = [(n, *linux_vm(tmp, n, root, run, vmm=vmm, extra=warm + extra(n))[:2])
                   for n, vmm in builds]
            for _, p, sock in vms:
                wait_vm(p, sock, ready_template(a.warm))
        zyg_p, zyg_path = start_zygote(tmp, handler)
        try:
            for c in clients:
                out = []
                for n, p, sock in vms:
                    wait_warm(sock, a.warm, timeout=60)
                    r = load.rate(c, a.seconds, lambda: invoke(sock, b"ping", expect=expect)[0],
                                  pid=p.pid)
                    series[n].append(r)
                    out.append(fmt(r))
                r = load.rate(c, a.seconds, lambda: zygote_call(zyg_path, b"ping", expect))
                series["SOCK"].append(r)
                out.append(fmt(r))
                print(f"| {c} | {' | '.join(out)} |", flush=True)
        finally:
            for _, p, sock in vms:
                stop(p, sock)
            zyg_p.kill()
            zyg_p.wait()
            if a.cgroup_class:
                jailer = os.path.join(os.path.dirname(VMM), "jailer")
                subprocess.run([jailer, "cleanup", "--cgroup-parent", parent],
                               stdout=subprocess.DEVNULL, check=False)
    print("\nWhere the host CPU per invocation goes (ms): the template VMM's own threads, "
          "its clones (reaped children), and the rest (host kernel threads: deferred "
          "teardown, RCU; other processes). With fork sources, the template's own "
          "threads are the part no other process can take (its API thread, forwarding, "
          "and the requests it serves itself), and the sources and their clones, not "
          "reaped during a row, are in the rest\n")
    print("| clients | " + " | ".join(f"{n}: template | clones | rest" for n, _ in builds) + " |")
    print("|---" * (1 + 3 * len(builds)) + "|")
    for i, c in enumerate(clients):
        cells = []
        for n, _ in builds:
            r = series[n][i]
            rest = r["cpu_ms"] - r["own_ms"] - r["children_ms"]
            cells.append(f"{r['own_ms']:.2f} | {r['children_ms']:.2f} | {rest:.2f}")
        print(f"| {c} | {' | '.join(cells)} |")
    if a.plot:
        labels = {"forkvm": "forkvm, fresh clone per request",
                  "baseline": f"baseline build ({os.path.basename(a.baseline or '')})",
                  "rewind": "forkvm --rewind, rewound clone per request",
                  "baseline-rewind": f"baseline build --rewind ({os.path.basename(a.baseline or '')})",
                  "SOCK": "host Python zygote, fork per request (SOCK)"}
        labels.update({f"{n}+class": f"{labels[n]}, in a cgroup of {a.cgroup_class}"
                       for n in ("forkvm", "rewind")})
        labels.update({f"{n}+sources": f"{labels[n]}, --fork-sources {a.sources}"
                       for n in ("forkvm", "rewind")})
        kind = "a fresh or rewound clone" if a.rewind else "a fresh clone"
        load.plot(a.plot, f"{label}: {kind} per request, {load.cores()} cores",
                  {labels[k]: v for k, v in series.items()})


LINUX = "console=ttyS0 reboot=k panic=-1 quiet"
PY_NOOP = "forkvm_examples:noop"
# throughput's --guest: (label, the Linux runtime and root image, reply expected, the
# SOCK zygote's handler)
GUESTS = {
    "tiny": ("tiny guest echo", None, None, None),
    "c": ("C runtime echo (Linux)", ("forkvm-fn echo", None), None, None),
    "python": ("Python no-op (Linux)", (f"python3 -m forkvm {PY_NOOP}", "python.ext4"), b"",
               PY_NOOP),
}


def linux_vm(tmp, name, root=None, run=None, cmdline="", extra=(), vmm=None):
    """Spawns a 256 MiB Linux VM (initramfs, or `root` image as a read-only root) whose
    init runs `run` (with `vmm`, default this build's); returns (process, socket, spawn
    time)."""
    sock = os.path.join(tmp, name + ".sock")
    if root:
        disk, cmdline = ["--rootfs", os.path.join(GUEST, root)], \
            f"root=/dev/vda ro rootfstype=ext4 {cmdline}"
    else:
        disk = ["--initrd", os.path.join(GUEST, "initramfs.cpio")]
    cmdline = f"{LINUX} {cmdline}" + (f' forkvm.run="{run}"' if run else "")
    cmd = [vmm or VMM, "run", "--kernel", os.path.join(GUEST, "vmlinux"), *disk, "--mem-mib", "256",
           "--cmdline", cmdline, "--console", sock + ".console", "--api-sock", sock, *extra]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(sock + ".log", "wb"))
    return p, sock, t0


def stop_all(vms):
    """Stops every (process, socket, _) of `vms`, killing those whose socket is gone."""
    for p, sock, _ in vms:
        try:
            stop(p, sock)
        except OSError:
            p.kill()
            p.wait()


def wait_vm(p, sock, ready, timeout=900, poll=0.02):
    """Waits until GET /vm's answer satisfies `ready` (p: the VMM's process, or None for
    a clone's socket)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            status, _, body = exchange(sock, "GET", "/vm")
            if status == 200 and ready(json.loads(body)):
                return
        except (OSError, ValueError):
            pass
        if p is not None and p.poll() is not None:
            sys.exit(f"{sock}: the VMM exited with {p.returncode}")
        time.sleep(poll)
    if p is not None:
        p.kill()
    sys.exit(f"{sock}: not ready in {timeout} s")


def ready_template(warm):
    return lambda v: (v["state"] == "paused" and v["invoke"]["waiting"]
                      and v["warm_clones"]["ready"] == warm)


def cold_boot_invoke(tmp, name, root, run, payload, expect):
    """Spawn to reply: a VM that is no template boots, its runtime waits, and it serves
    one invocation in place; ms."""
    p, sock, t0 = linux_vm(tmp, name, root, run)
    wait_vm(p, sock, lambda v: v["invoke"]["waiting"], poll=0.005)
    invoke(sock, payload, expect=expect)
    elapsed = (time.perf_counter() - t0) * 1e3
    p.wait(timeout=120)
    return elapsed


def agent_exec(tmp, sock, cmd, expect, runs):
    """`vmm exec`'s path: a fresh clone of running template `sock`, `cmd` run in it
    through its vsock and agent; client-side ms from the clone request to the answer."""
    out = []
    for _ in range(runs):
        t0 = time.perf_counter()
        status, _, body = exchange(sock, "POST", "/clones", b'{"count":1,"console":"null"}')
        if status != 201:
            sys.exit(f"clone failed: {status} {body[:200]!r}")
        c = json.loads(body)["clones"][0]
        code, got = vsock_exec(c["vsock"], cmd)
        out.append((time.perf_counter() - t0) * 1e3)
        if code != 0 or not got.startswith(expect):
            sys.exit(f"agent: {cmd!r} exited {code}: {got[:200]!r}")
        exchange(sock, "DELETE", f"/clones/{c['id']}")
    return out


def runtimes(a):
    payload = b"hello from the benchmark"
    clients = [int(c) for c in a.clients.split(",")]
    warm = ["--template", "--warm-clones", "8"]
    py_cmd = f"python3 -c 'import forkvm_examples as m; print(m.noop(b\"\"))'"
    latency_vms = ["c", "c_unprimed", "c_norng", "py", "py_unprimed"]
    s = {k: [] for k in latency_vms + [k + "_handler" for k in latency_vms]
         + ["sock", "c_clone"]}
    primed = {k: 0 for k in latency_vms}
    with tempfile.TemporaryDirectory(prefix="forkvm-invoke-", dir="/dev/shm") as tmp:
        vms = {
            "c": linux_vm(tmp, "c", run="forkvm-fn echo", extra=warm),
            "c_unprimed": linux_vm(tmp, "c-unprimed", run="forkvm-fn echo",
                                   extra=warm + ["--no-prime"]),
            "c_norng": linux_vm(tmp, "c-norng", run="forkvm-fn echo",
                                cmdline="forkvm.crng=off", extra=warm),
            "py": linux_vm(tmp, "py", root="python.ext4",
                           run=f"python3 -m forkvm {PY_NOOP}", extra=warm),
            "py_unprimed": linux_vm(tmp, "py-unprimed", root="python.ext4",
                                    run=f"python3 -m forkvm {PY_NOOP}",
                                    extra=warm + ["--no-prime"]),
        }
        if a.exec_runs:
            vms["agent"] = linux_vm(tmp, "agent", cmdline="forkvm.agent=1024",
                                    extra=["--vsock", os.path.join(tmp, "agent.vsock")])
            vms["py_agent"] = linux_vm(tmp, "py-agent", root="python.ext4",
                                       cmdline="forkvm.agent=1024",
                                       extra=["--vsock", os.path.join(tmp, "py-agent.vsock")])
        zyg_p, zyg_path = start_zygote(tmp, PY_NOOP)
        try:
            for k in latency_vms:
                wait_vm(vms[k][0], vms[k][1], ready_template(8))
            for k in [k for k in ["agent", "py_agent"] if k in vms]:
                wait_vm(vms[k][0], vms[k][1], lambda v: v["state"] == "running")
                console = vms[k][1] + ".console"
                deadline = time.time() + 900
                while b"serving on vsock port 1024" not in open(console, "rb").read():
                    if time.time() > deadline:
                        sys.exit(f"{k}: the agent did not come up")
                    time.sleep(0.1)
            print("templates ready", file=sys.stderr, flush=True)
            for _ in range(a.rounds):
                # The templates run with the defaults: idle refresh and timer deferral
                # (docs/invoke.md; benches/idle.py measures them).
                for k in latency_vms:
                    sock = vms[k][1]
                    expect = b"" if k.startswith("py") else payload
                    for _ in range(a.runs):
                        wait_warm(sock, 8, timeout=60)
                        t, h = invoke(sock, payload, expect=expect)
                        s[k].append(t * 1e3)
                        s[k + "_handler"].append(int(h["x-forkvm-handler-us"]) / 1e3)
                        primed[k] += h.get("x-forkvm-primed") == "true"
                        if k == "c":
                            s["c_clone"].append(int(h["x-forkvm-clone-us"]) / 1e3)
                for _ in range(a.runs):
                    s["sock"].append(zygote_call(zyg_path, payload, expect=b"") * 1e3)
            print("latency rounds done", file=sys.stderr, flush=True)
            if a.exec_runs:
                agent_c = agent_exec(tmp, vms["agent"][1], "echo hello", b"hello",
                                     a.exec_runs)
                agent_py = agent_exec(tmp, vms["py_agent"][1], py_cmd, b"b''",
                                      max(2, a.exec_runs // 4))
                print("agent rows done", file=sys.stderr, flush=True)
            print(f"\nThroughput, C runtime echo, {a.seconds} s per row\n\n{THROUGHPUT_HEAD}")
            throughput_rows(vms["c"][1], clients, a.seconds, payload)
            print(f"\nThroughput, Python no-op, {a.seconds} s per row\n\n{THROUGHPUT_HEAD}")
            throughput_rows(vms["py"][1], clients, a.seconds, payload, expect=b"")
            print(f"\nThroughput, Python no-op, --no-prime, {a.seconds} s per row\n\n"
                  f"{THROUGHPUT_HEAD}")
            throughput_rows(vms["py_unprimed"][1], clients, a.seconds, payload, expect=b"")
        finally:
            stop_all(vms.values())
            zyg_p.kill()
            zyg_p.wait()
        boots_c = [cold_boot_invoke(tmp, f"boot-c{i}", None, "forkvm-fn echo", payload,
                                    payload) for i in range(a.boots)]
        boots_py = [cold_boot_invoke(tmp, f"boot-py{i}", "python.ext4",
                                     f"python3 -m forkvm {PY_NOOP}", payload, b"")
                    for i in range(a.boots)]
    n = a.runs * a.rounds
    base = statistics.median(s["py"])
    print(f"\nLinux runtimes, 256 MiB templates (--warm-clones 8), {len(payload)}-byte "
          f"payload, {n} requests per invocation row in {a.rounds} interleaved rounds "
          f"(ms; ratio of medians to the Python row)\n")
    print("| request to reply (client) | min | median | p99 | vs Python |")
    print("|---|---|---|---|---|")
    print(row("C runtime echo, fresh primed warm clone", s["c"], base))
    print(row("C runtime echo, fresh warm clone, --no-prime", s["c_unprimed"], base))
    print(row("C runtime echo, fresh primed warm clone, kernel RNG reseed off",
              s["c_norng"], base))
    print(row("Python no-op, fresh primed warm clone", s["py"], base))
    print(row("Python no-op, fresh warm clone, --no-prime", s["py_unprimed"], base))
    print(row("SOCK mechanism: host Python zygote forks per request, same handler",
              s["sock"], base))
    if a.exec_runs:
        print(row(f"vsock + agent in a fresh clone: `echo` ({a.exec_runs} runs)", agent_c,
                  base))
        print(row(f"vsock + agent in a fresh clone: python3 calling the handler "
                  f"({len(agent_py)} runs)", agent_py, base))
    if a.boots:
        print(row(f"cold boot to the C runtime's reply ({a.boots} runs)", boots_c, base))
        print(row(f"cold boot to the Python runtime's reply ({a.boots} runs)", boots_py,
                  base))
    print("\n| the VMM's figures (`x-forkvm-*-us`) | min | median | p99 |")
    print("|---|---|---|---|")
    print(row("C: arrival to clone running with the request", s["c_clone"]))
    print(row("C: handler (clone running to reply written)", s["c_handler"]))
    print(row("C, --no-prime: handler", s["c_unprimed_handler"]))
    print(row("C, RNG reseed off: handler", s["c_norng_handler"]))
    print(row("Python: handler", s["py_handler"]))
    print(row("Python, --no-prime: handler", s["py_unprimed_handler"]))
    print("\nServed by a primed warm clone: " + ", ".join(
        f"{k} {primed[k]} of {len(s[k])}" for k in latency_vms))


def ab(a):
    payload = bytes(i % 251 for i in range(64))
    builds = {"baseline": os.path.abspath(a.baseline), "this build": VMM}
    got = {(b, k): [] for b in builds for k in ("warm", "warm_clone_us", "fork")}
    print(f"A/B of two builds, interleaved rounds ({a.rounds}); tiny echo, 64-byte payload, "
          f"{a.mem} MiB templates, {a.runs} requests per row and round (ms; ratio of "
          "medians to the baseline):\n")
    print(f"baseline: {builds['baseline']}\n")
    with tempfile.TemporaryDirectory(prefix="forkvm-invoke-", dir="/dev/shm") as tmp:
        vms = {}
        try:
            for b, path in builds.items():
                tag = b.replace(" ", "-")
                vms[(b, "warm")] = start_template(tmp, tag + "-warm", a.mem, 8, path)
                vms[(b, "fork")] = start_template(tmp, tag + "-fork", a.mem, 0, path)
            for _ in range(a.rounds):
                for b in builds:
                    warm_sock = vms[(b, "warm")][1]
                    for _ in range(a.runs):
                        wait_warm(warm_sock, 8)
                        t, h = invoke(warm_sock, payload)
                        got[(b, "warm")].append(t * 1e3)
                        got[(b, "warm_clone_us")].append(int(h["x-forkvm-clone-us"]) / 1e3)
                    for _ in range(a.runs):
                        got[(b, "fork")].append(invoke(vms[(b, "fork")][1], payload)[0] * 1e3)
        finally:
            for p, sock in vms.values():
                stop(p, sock)
    print("| measure | build | min | median | p99 | vs baseline |")
    print("|---|---|---|---|---|---|")
    for k, label in [("warm", "fresh warm clone, request to reply"),
                     ("warm_clone_us", "fresh warm clone, x-forkvm-clone-us"),
                     ("fork", "clone forked per request, request to reply")]:
        base = statistics.median(got[("baseline", k)])
        for b in builds:
            print(row(f"{label} | {b}", got[(b, k)], base))


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--runs", type=int, default=50)
    lat.add_argument("--rounds", type=int, default=4)
    lat.add_argument("--mem", type=int, default=256)
    lat.add_argument("--payload", type=int, default=64)
    tp = sub.add_parser("throughput")
    tp.add_argument("--seconds", type=float, default=5)
    tp.add_argument("--clients", default="auto",
                    help="comma-separated client counts (auto: 1, 2, 4, ... 4x the cores)")
    tp.add_argument("--mem", type=int, default=256)
    tp.add_argument("--warm", type=int, default=8, help="warm clones of the template")
    tp.add_argument("--guest", choices=["tiny", "c", "python"], default="tiny",
                    help="tiny guest echo, C runtime echo, or Python no-op (Linux, 256 MiB)")
    tp.add_argument("--baseline", help="another build's vmm binary, run beside this one")
    tp.add_argument("--rewind", action="store_true",
                    help="also this build with --rewind: rewound clones")
    tp.add_argument("--sources", type=int, default=1, metavar="N",
                    help="also this build (and --rewind's) with --fork-sources N: the "
                         "template and N-1 clones of it forking its clones")
    tp.add_argument("--plot", help="draw invocations/s against clients to this PNG")
    tp.add_argument("--class", dest="cgroup_class", metavar="NAME:LIMITS",
                    help="also each build with cgroup pools of this class (vmm run "
                         "--cgroup-class; needs root): each clone in a cgroup of it")
    rt = sub.add_parser("runtimes")
    rt.add_argument("--runs", type=int, default=50)
    rt.add_argument("--rounds", type=int, default=4)
    rt.add_argument("--exec-runs", type=int, default=20)
    rt.add_argument("--boots", type=int, default=3)
    rt.add_argument("--seconds", type=float, default=5)
    rt.add_argument("--clients", default="1,2,4,8")
    abp = sub.add_parser("ab")
    abp.add_argument("--baseline", required=True, help="the other build's vmm binary")
    abp.add_argument("--runs", type=int, default=50)
    abp.add_argument("--rounds", type=int, default=4)
    abp.add_argument("--mem", type=int, default=256)
    a = ap.parse_args()
    if not os.path.exists(VMM):
        sys.exit(f"{VMM} is missing: cargo build --release")
    {"latency": latency, "throughput": throughput, "runtimes": runtimes, "ab": ab}[a.cmd](a)


if __name__ == "__main__":
    main()
