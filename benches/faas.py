#!/usr/bin/env python3
"""SOCK's experiments at VM level, through forkvm-gateway (docs/faas.md), side by side
with the SOCK mechanism on this host (a host Python zygote forking per request, no VM).

noop: a no-op Python handler (SOCK's figures 14-15): request to reply from the client's
  side (one keep-alive HTTP connection) through the gateway, each request in a fresh
  clone of the function's template, interleaved with the host zygote's fork per request;
  then invocations/s with 1, 2, 4, ... up to 4x the cores of clients (processes) for
  both, with host CPU per invocation (--plot PNG draws them).
imports: a handler that imports a package (SOCK's figure 17), for each of --packages,
  from the request to the first reply of a new function:
  - cold: a new VM boots, starts Python, imports the package and answers (vmm run of the
    Python zygote runtime, a derive with the import, one invocation);
  - base: the gateway deploys the function from its base zygote (nothing imported: the
    package is imported in the function's template), then invokes it;
  - zygote: the same from a zygote that imported the package already (PUT /zygotes);
  - host rows: `python3 -c 'import P'` as a new process; a host zygote that forks and
    imports P in the child; one that imported P before forking.
packages: a function with PyPI requirements (--requirements, real packages; SOCK's
  install cache at VM level), from the request to the first reply of a new function:
  - cold: a fresh clone of the Python base (no boot counted) runs pip install into its
    /tmp, imports the packages and answers: what a platform without an install cache
    does. Its wheels come from a disk (no network: a registry download would add to it);
  - install cache hit: the gateway deploys a function of a package set whose image and
    root zygote exist (nothing imported: the handler's source imports them), then
    invokes it;
  - install cache and a zygote with the imports (PUT /zygotes with the requirements):
    the gateway deploys a function from it, then invokes it;
  - host rows: pip install into a new venv and import (a new process); a host zygote
    that imported them forks per request.
  The wheels are downloaded once from the index pip is configured with (--wheels DIR to
  use a directory instead); the gateway takes them with --find-links. The image build
  (pip on the host and mkfs.ext4, the gateway's build_ms) is measured --build-runs times.
mix: --functions functions over a few package sets, deployed, then invoked at random by
  --clients-mix clients (SOCK's figure 20): latency percentiles and the cache tier of
  each request (the gateway's --memory-budget-mib evicts functions' templates, which
  are derived again on their next request).

The host baselines use /usr/bin/python3 (Debian's, the guest's version) and need
python3-numpy for numpy (apt-get install python3-numpy).

usage: benches/faas.py [--only noop,imports,packages,mix] [--runs N] [--seconds S]
                       [--clients auto|1,2,4,8] [--plot PNG] [--packages json,numpy] [--import-runs N]
                       [--cold-runs N] [--functions N] [--requests N] [--clients-mix N]
                       [--budget-mib M] [--requirements pyyaml,jinja2,requests]
                       [--modules yaml,jinja2,requests] [--wheels DIR] [--package-runs N]
                       [--build-runs N]
"""
import argparse
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import load
from clone import pct
from invoke import exchange, read_all, row, wait_vm

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUEST = os.path.join(ROOT, "target/guest")
GATEWAY = os.path.join(ROOT, "target/release/forkvm-gateway")
VMM = os.path.join(ROOT, "target/release/vmm")
HOST_PYTHON = "/usr/bin/python3"
ZYGOTE_RUN = "python3 -m forkvm"
NOOP = "def handler(event):\n    return b''\n"


def importer(packages):
    """A handler's source that imports `packages` and returns nothing."""
    imports = "".join(f"import {p}\n" for p in packages)
    return imports + NOOP


def send_all(sock, parts):
    """Sends `parts` (bytes) in as few `sendmsg` calls as the socket takes them, without
    joining them."""
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        sent = sock.sendmsg(views)
        while sent and sent >= len(views[0]):
            sent -= len(views.pop(0))
        if sent:
            views[0] = views[0][sent:]


def recv_into_exact(sock, start, n):
    """`n` bytes: `start`, then the rest read from `sock` into one buffer."""
    out = bytearray(n)
    out[:len(start)] = start
    view, got = memoryview(out), len(start)
    while got < n:
        r = sock.recv_into(view[got:])
        if not r:
            sys.exit("the connection closed mid-answer")
        got += r
    return out


class Gateway:
    def __init__(self, extra=(), warm=2, rootfs=None, kernel=None):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        rootfs = rootfs or os.path.join(GUEST, "python.ext4")
        kernel = kernel or os.path.join(GUEST, "vmlinux")
        cmd = [GATEWAY, "--listen", f"127.0.0.1:{self.port}", "--warm-clones", str(warm),
               "--kernel", kernel, "--rootfs", rootfs, *extra]
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                  env={**os.environ, "RUST_LOG": "warn"})
        line = self.p.stdout.readline().decode()
        if "serving on" not in line:
            sys.exit(f"the gateway did not start: {line!r}")
        self.local = threading.local()

    def conn(self):
        """This thread's keep-alive connection (TCP_NODELAY: each request is sent in one
        write, so no client-side delay is measured)."""
        c = getattr(self.local, "conn", None)
        # A client process forked from the one that opened it makes its own.
        if c is None or self.local.pid != os.getpid():
            c = socket.create_connection(("127.0.0.1", self.port), timeout=1800)
            c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.local.conn = c
            self.local.pid = os.getpid()
            self.local.buf = b""
        return c

    def request(self, method, path, body=b""):
        """(status, headers, body, seconds): one HTTP/1.1 exchange on this thread's
        connection. The request goes out in one `sendmsg` of its head and body, and the
        answer's body is read into one buffer of its length: the client copies and
        faults no more than it must, so a large payload measures the gateway, not this
        client (joining 64 KiB reads as `bytes` cost 3 ms and 720 page faults of client
        CPU per 1 MiB echoed)."""
        c = self.conn()
        t0 = time.perf_counter()
        head = (f"{method} {path} HTTP/1.1\r\nHost: gw\r\nContent-Length: {len(body)}"
                "\r\n\r\n").encode()
        send_all(c, [head, body])
        buf = self.local.buf
        while b"\r\n\r\n" not in buf:
            chunk = c.recv(1 << 16)
            if not chunk:
                sys.exit("the gateway closed the connection")
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
        n = int(headers.get("content-length", 0))
        if len(buf) >= n:
            data, self.local.buf = buf[:n], buf[n:]
        else:
            data = recv_into_exact(c, buf, n)
            self.local.buf = b""
        return int(lines[0].split()[1]), headers, data, time.perf_counter() - t0

    def deploy(self, name, source, packages=(), requirements=(), answer=False):
        spec = {"source": source, "packages": list(packages)}
        if requirements:
            spec["requirements"] = list(requirements)
        status, _, data, t = self.request("PUT", f"/functions/{name}",
                                          json.dumps(spec).encode())
        if status not in (200, 201):
            sys.exit(f"deploy {name}: {status} {data[:300]!r}")
        if answer:
            return json.loads(data), t
        return json.loads(data)["tier"], t

    def invoke(self, name, event=b""):
        status, headers, data, t = self.request("POST", f"/functions/{name}", event)
        if status != 200:
            sys.exit(f"invoke {name}: {status} {data[:300]!r}")
        return t, headers

    def metric(self, sample):
        _, _, text, _ = self.request("GET", "/metrics")
        for line in text.decode().splitlines():
            if line.startswith(sample + " "):
                return float(line.split()[-1])
        return 0.0

    def stop(self):
        self.p.terminate()
        self.p.wait(timeout=120)


HOST_ZYGOTE = r'''
import importlib, os, socket, sys
path, pre, needs = sys.argv[1], sys.argv[2], sys.argv[3]
for p in filter(None, pre.split(",")):
    importlib.import_module(p)
srv = socket.socket(socket.AF_UNIX)
srv.bind(path); srv.listen(64)
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    pid = os.fork()
    if pid == 0:
        srv.close()
        conn.recv(1)
        for p in filter(None, needs.split(",")):
            importlib.import_module(p)
        conn.sendall(b"k")
        os._exit(0)
    conn.close()
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
'''


class HostZygote:
    """The SOCK mechanism on the host: a Python process that imported `pre` forks a
    child per request, which imports `needs` and answers."""

    def __init__(self, tmp, name, pre=(), needs=(), env=None):
        self.path = os.path.join(tmp, name + ".sock")
        self.p = subprocess.Popen([HOST_PYTHON, "-c", HOST_ZYGOTE, self.path, ",".join(pre),
                                   ",".join(needs)], stdout=subprocess.PIPE,
                                  stdin=subprocess.DEVNULL, env=env)
        if self.p.stdout.readline() != b"ready\n":
            sys.exit("the host zygote did not start (python3-numpy installed?)")

    def call(self):
        t0 = time.perf_counter()
        s = socket.socket(socket.AF_UNIX)
        s.connect(self.path)
        s.sendall(b"x")
        if read_all(s) != b"k":
            sys.exit("the host zygote answered wrongly")
        return time.perf_counter() - t0

    def stop(self):
        self.p.kill()
        self.p.wait()


def head(*cols):
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)


def zygote_vm(tmp, name, warm, extra=()):
    """A Python zygote template booted by `vmm run` (no gateway): (process, socket)."""
    sock = os.path.join(tmp, name + ".sock")
    cmdline = ("console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda ro rootfstype=ext4 "
               f'forkvm.run="{ZYGOTE_RUN}"')
    p = subprocess.Popen([VMM, "run", "--kernel", os.path.join(GUEST, "vmlinux"),
                          "--rootfs", os.path.join(GUEST, "python.ext4"), "--mem-mib", "256",
                          "--cmdline", cmdline, "--api-sock", sock, "--console",
                          sock + ".console", "--template", "--warm-clones", str(warm),
                          *extra],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    wait_vm(p, sock, lambda v: v["state"] == "paused" and v["invoke"]["waiting"], poll=0.05)
    return p, sock


def derive(sock, load, warm, query=""):
    """The socket of a template derived from the one on `sock` with `load`, ready."""
    status, headers, data = exchange(sock, "POST",
                                     "/invocations?derive=true&timeout_ms=1800000" + query,
                                     json.dumps(load).encode(), timeout=1800)
    if status != 200:
        sys.exit(f"derive: {status} {data[:300]!r}")
    derived = headers["x-forkvm-socket"]
    wait_vm(None, derived, lambda v: v["state"] == "paused" and v["invoke"]["waiting"] and
            v["warm_clones"]["ready"] >= warm, poll=0.005)
    return derived


def direct_call(sock):
    t0 = time.perf_counter()
    status, _, data = exchange(sock, "POST", "/invocations", b"")
    if status != 200:
        sys.exit(f"direct invocation: {status} {data[:300]!r}")
    return time.perf_counter() - t0


def noop(a, tmp):
    gw = Gateway(warm=a.warm)
    vm, sock = zygote_vm(tmp, "noop-vm", a.warm)
    try:
        gw.deploy("noop", NOOP)
        direct = derive(sock, {"source": NOOP}, a.warm)
        host = HostZygote(tmp, "noop")
        for _ in range(20):
            gw.invoke("noop")
            direct_call(direct)
            host.call()
        client, vmm, hz, dc = [], [], [], []
        for _ in range(a.runs):
            t, h = gw.invoke("noop")
            client.append(t * 1e3)
            vmm.append(int(h["x-forkvm-total-us"]) / 1e3)
            time.sleep(0.005)
            dc.append(direct_call(direct) * 1e3)
            time.sleep(0.005)
            hz.append(host.call() * 1e3)
            time.sleep(0.005)
        print(f"\nno-op handler, request to reply, {a.runs} requests, interleaved (ms)\n")
        head("path", "min", "median", "p99", "vs host zygote")
        base = statistics.median(hz)
        print(row("gateway: fresh clone of the function's template (client side, HTTP)",
                  client, base))
        print(row("  of which the template's VMM (x-forkvm-total-us)", vmm, base))
        print(row("the same handler's derived template, POST /invocations on its socket "
                  "(no gateway)", dc, base))
        print(row("host Python zygote, fork per request (SOCK mechanism, no VM)", hz, base))
        print(f"\nthroughput on {load.cores()} cores, {a.seconds} s per row and path, "
              f"clients are processes (host CPU per call leaves theirs out)\n")
        head("clients", "gateway /s", "median ms", "p99 ms", "CPU ms", "no gateway /s",
             "median ms", "p99 ms", "CPU ms", "host zygote /s", "median ms", "p99 ms",
             "CPU ms")
        series = {"gateway: fresh clone per request": [],
                  "POST /invocations, no gateway": [],
                  "host Python zygote, fork per request (SOCK)": []}
        for c in load.parse_clients(a.clients):
            g = load.rate(c, a.seconds, lambda: gw.invoke("noop")[0])
            time.sleep(1)
            d = load.rate(c, a.seconds, lambda: direct_call(direct))
            time.sleep(1)
            h = load.rate(c, a.seconds, host.call)
            cells = []
            for r, rows in zip((g, d, h), series.values()):
                rows.append(r)
                failed = f" ({r['failed']} failed)" if r["failed"] else ""
                cells.append(f"{r['per_s']:.0f}{failed} | {r['median']:.2f} | "
                             f"{r['p99']:.2f} | {r['cpu_ms']:.2f}")
            print(f"| {c} | {' | '.join(cells)} |", flush=True)
            time.sleep(1)
        if a.plot:
            load.plot(a.plot, f"Python no-op, {load.cores()} cores", series)
        host.stop()
    finally:
        gw.stop()
        exchange(sock, "PUT", "/actions", b'{"action_type":"shutdown"}')
        vm.wait(timeout=60)


def cold_import(tmp, package, i):
    """Spawn to the first reply of a new VM that starts Python and imports `package`."""
    t0 = time.perf_counter()
    p, sock = zygote_vm(tmp, f"cold-{package}-{i}", 0)
    try:
        derived = derive(sock, {"imports": [package], "source": NOOP}, 0)
        direct_call(derived)
        return time.perf_counter() - t0
    finally:
        exchange(sock, "PUT", "/actions", b'{"action_type":"shutdown"}')
        p.wait(timeout=60)


def host_cold(package):
    t0 = time.perf_counter()
    subprocess.run([HOST_PYTHON, "-c", f"import {package}"], check=True)
    return time.perf_counter() - t0


def deploy_runs(gw, runs, pkg, src, tier, r):
    """`runs` new functions importing `pkg`, each deployed (from `tier`) and invoked once:
    the deployment's time and the first reply's, into r[tier + " deploy"] and r[tier]."""
    for i in range(runs):
        got, deploy = gw.deploy(f"{tier}-{pkg}-{i}", src, [pkg])
        assert got == tier, got
        first, _ = gw.invoke(f"{tier}-{pkg}-{i}")
        r[tier + " deploy"].append(deploy * 1e3)
        r[tier].append((deploy + first) * 1e3)
        print(f"{pkg}: {tier} {i}: {deploy:.2f} s + {first * 1e3:.1f} ms", file=sys.stderr)


def imports(a, tmp):
    packages = a.packages.split(",")
    gw = Gateway(["--create-after", "1000000", "--load-timeout-s", "1800"])
    results = {}
    try:
        for pkg in packages:
            r = results[pkg] = {"cold": [], "base": [], "base deploy": [], "zygote": [],
                                "zygote deploy": [], "host cold": [], "host fork+import": [],
                                "host zygote": []}
            src = importer([pkg])
            deploy_runs(gw, a.import_runs, pkg, src, "base", r)
            status, _, data, made = gw.request(
                "PUT", "/zygotes", json.dumps({"packages": [pkg]}).encode())
            if status != 200:
                sys.exit(f"zygote {pkg}: {status} {data!r}")
            r["zygote made"] = made * 1e3
            deploy_runs(gw, a.import_runs, pkg, src, "zygote", r)
            for i in range(a.cold_runs):
                r["cold"].append(cold_import(tmp, pkg, i) * 1e3)
                print(f"{pkg}: cold {i}: {r['cold'][-1] / 1e3:.1f} s", file=sys.stderr)
            fresh = HostZygote(tmp, f"fresh-{pkg}", needs=[pkg])
            warm = HostZygote(tmp, f"warm-{pkg}", pre=[pkg], needs=[pkg])
            for _ in range(a.import_runs * 3):
                r["host cold"].append(host_cold(pkg) * 1e3)
                r["host fork+import"].append(fresh.call() * 1e3)
                r["host zygote"].append(warm.call() * 1e3)
            fresh.stop()
            warm.stop()
    finally:
        gw.stop()
    for pkg, r in results.items():
        print(f"\nimport {pkg}: request to the first reply of a new function (ms)\n")
        head("path", "min", "median", "p99", "vs zygote")
        base = statistics.median(r["zygote"])
        for label, key in [
            ("cold: VM boot, Python start, import, reply", "cold"),
            ("base: a clone of the base zygote imports, then reply", "base"),
            ("  of which the deployment (PUT)", "base deploy"),
            ("zygote: a clone of a zygote that imported it, then reply", "zygote"),
            ("  of which the deployment (PUT)", "zygote deploy"),
            ("host: new python3 process importing it", "host cold"),
            ("host: zygote forks, child imports", "host fork+import"),
            ("host: zygote that imported it forks (SOCK)", "host zygote"),
        ]:
            if r[key]:
                print(row(label, r[key], base))
        print(f"\n(the zygote of {pkg} was made in {r['zygote made'] / 1e3:.1f} s)")


# What the cold row's function runs when it loads: pip, from its wheel on the disk in
# slot 0, installs the requirements into /tmp, then the source imports them.
COLD_PIP = r'''
import glob, subprocess, sys
_slot = "/run/forkvm/slot0"
_pip = glob.glob(_slot + "/pip-*.whl")[0] + "/pip"
subprocess.run([sys.executable, _pip, "install", "--quiet", "--no-index", "--find-links", _slot,
                "--target", "/tmp/site", "--disable-pip-version-check", "--no-cache-dir",
                "--root-user-action=ignore", *REQUIREMENTS], check=True)
sys.path.insert(0, "/tmp/site")
'''


def wheels_of(a, tmp, reqs):
    """A directory with the wheels of `reqs` and their dependencies for the guest's
    Python, and pip's own wheel: --wheels, or downloaded once."""
    if a.wheels:
        return a.wheels
    out = os.path.join(tmp, "wheels")
    tags = [f"--platform={p}" for p in ("manylinux2014_x86_64", "manylinux_2_17_x86_64",
                                          "manylinux_2_28_x86_64", "linux_x86_64")]
    done = subprocess.run([HOST_PYTHON, "-m", "pip", "download", "--quiet",
                           "--disable-pip-version-check", "--only-binary=:all:",
                           "--python-version=3.11", "--implementation=cp", "--abi=cp311",
                           *tags, "-d", out, *reqs, "pip"], capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"cannot download the wheels (no index? pass --wheels DIR):\n{done.stderr}")
    return out


def ext4_of(tmp, tree):
    """An ext4 image of directory `tree` (the cold row's disk of wheels)."""
    image = os.path.join(tmp, "wheels.ext4")
    size = sum(os.path.getsize(os.path.join(tree, f)) for f in os.listdir(tree))
    subprocess.run(["mkfs.ext4", "-q", "-F", "-O", "^has_journal", "-d", tree, image,
                    f"{size // 1024 * 2 + 16384}k"], check=True, stdout=subprocess.DEVNULL)
    return image


def host_venv(tmp, wheels, reqs, mods, i):
    """A new venv, pip install of `reqs` into it (from `wheels`), a new process of it
    importing `mods`."""
    venv = os.path.join(tmp, f"venv-{i}")
    t0 = time.perf_counter()
    subprocess.run([HOST_PYTHON, "-m", "venv", "--without-pip", venv], check=True)
    subprocess.run([HOST_PYTHON, "-m", "pip", "--python", os.path.join(venv, "bin/python"),
                    "install", "--quiet", "--disable-pip-version-check", "--no-index",
                    "--find-links", wheels, "--root-user-action=ignore", *reqs], check=True)
    subprocess.run([os.path.join(venv, "bin/python"), "-c", "import " + ", ".join(mods)],
                   check=True)
    return time.perf_counter() - t0


def packages(a, tmp):
    reqs, mods = a.requirements.split(","), a.modules.split(",")
    wheels = wheels_of(a, tmp, reqs)
    cache_dir = os.path.join(tmp, "package-cache")
    gw = Gateway(["--package-cache", cache_dir, "--find-links", wheels,
                  "--create-after", "1000000", "--load-timeout-s", "1800"])
    vm = None
    r = {k: [] for k in ("build", "cold", "hit", "hit deploy", "zygote", "zygote deploy",
                         "host venv", "host zygote")}
    imports = "".join(f"import {m}\n" for m in mods)
    try:
        # The image build: the cache emptied before each (the set's root zygote is made
        # by the first deployment only).
        for i in range(a.build_runs):
            for f in os.listdir(cache_dir) if os.path.isdir(cache_dir) else []:
                if f.endswith(".ext4") or f.startswith("requirements-"):
                    os.remove(os.path.join(cache_dir, f))
            v, t = gw.deploy(f"build-{i}", NOOP, requirements=reqs, answer=True)
            if not v["package_set"]["built"]:
                sys.exit(f"build {i}: the set was not built: {v}")
            r["build"].append(v["package_set"]["build_ms"])
            print(f"build {i}: {r['build'][-1]} ms ({len(v['package_set']['resolved'])} "
                  f"distributions), deploy {t:.1f} s", file=sys.stderr)
        resolved = v["package_set"]["resolved"]

        def runs(tier, key):
            for i in range(a.package_runs):
                name = f"{key}-{i}"
                got, deploy = gw.deploy(name, imports + NOOP, mods, reqs)
                if got != tier:
                    sys.exit(f"{name}: deployed from {got}, not {tier}")
                first, _ = gw.invoke(name)
                r[key + " deploy"].append(deploy * 1e3)
                r[key].append((deploy + first) * 1e3)
                print(f"{key} {i}: {deploy:.2f} s + {first * 1e3:.1f} ms", file=sys.stderr)

        runs("base", "hit")
        status, _, data, made = gw.request("PUT", "/zygotes", json.dumps(
            {"packages": mods, "requirements": reqs}).encode())
        if status != 200:
            sys.exit(f"zygote: {status} {data!r}")
        runs("zygote", "zygote")
        # Cold: a fresh clone of a Python base with the wheels in a disk slot installs
        # them with pip when it loads.
        image = ext4_of(tmp, wheels)
        vm, sock = zygote_vm(tmp, "pkg-cold", 0, ["--disk-slots", "1"])
        source = COLD_PIP.replace("REQUIREMENTS", repr(reqs)) + imports + NOOP
        for i in range(a.cold_runs):
            t0 = time.perf_counter()
            derived = derive(sock, {"disks": [0], "source": source}, 0, f"&media=0:{image}")
            direct_call(derived)
            r["cold"].append((time.perf_counter() - t0) * 1e3)
            exchange(derived, "PUT", "/actions", b'{"action_type":"shutdown"}')
            print(f"cold {i}: {r['cold'][-1] / 1e3:.1f} s", file=sys.stderr)
        site = os.path.join(tmp, "host-site")
        subprocess.run([HOST_PYTHON, "-m", "pip", "install", "--quiet", "--no-index",
                        "--disable-pip-version-check", "--find-links", wheels, "--target",
                        site, "--root-user-action=ignore", *reqs], check=True)
        warm = HostZygote(tmp, "pkg-warm", pre=mods, needs=mods,
                          env={**os.environ, "PYTHONPATH": site})
        for i in range(a.package_runs):
            r["host venv"].append(host_venv(tmp, wheels, reqs, mods, i) * 1e3)
        for _ in range(a.package_runs * 10):
            r["host zygote"].append(warm.call() * 1e3)
        warm.stop()
    finally:
        gw.stop()
        if vm is not None:
            exchange(sock, "PUT", "/actions", b'{"action_type":"shutdown"}')
            vm.wait(timeout=60)
    cold = statistics.median(r["cold"])
    print(f"\nrequirements {', '.join(reqs)} ({len(resolved)} distributions: "
          f"{', '.join(resolved)}), importing {', '.join(mods)}: request to the first "
          f"reply of a new function (ms)\n")
    head("path", "min", "median", "p99", "cold / this (medians)")
    for label, key in [
        ("cold: a fresh clone of the Python base pip-installs (wheels on a disk), "
         "imports, replies", "cold"),
        ("install cache hit: deploy from the set's root (image mounted, nothing "
         "imported), imports, reply", "hit"),
        ("  of which the deployment (PUT)", "hit deploy"),
        ("install cache and zygote: deploy from the zygote of the set and imports, "
         "reply", "zygote"),
        ("  of which the deployment (PUT)", "zygote deploy"),
        ("host: new venv, pip install, new process imports", "host venv"),
        ("host: zygote that imported them forks (SOCK)", "host zygote"),
    ]:
        if r[key]:
            print(row(label, r[key]) + f" {cold / statistics.median(r[key]):.1f}x |")
    print(f"\npackage set's image (pip on the host from the wheel directory, then "
          f"mkfs.ext4), {len(r['build'])} builds: min {min(r['build'])} ms, median "
          f"{statistics.median(r['build']):.0f} ms, max {max(r['build'])} ms; the zygote "
          f"of the set and its imports was made in {made:.1f} s")


MIX_SETS = [[], ["json"], ["json", "base64"], ["decimal"], ["numpy"]]


def mix(a):
    gw = Gateway(["--memory-budget-mib", str(a.budget_mib), "--load-timeout-s", "1800"])
    rng = random.Random(1)
    try:
        deploy_tiers = {}
        names = []
        for i in range(a.functions):
            pkgs = MIX_SETS[i % len(MIX_SETS)]
            name = f"f{i}"
            tier, _ = gw.deploy(name, importer(pkgs), pkgs)
            deploy_tiers[tier] = deploy_tiers.get(tier, 0) + 1
            names.append(name)
        print(f"deployed {a.functions} functions: {deploy_tiers}", file=sys.stderr)
        hits0 = {t: gw.metric(f'forkvm_cache_hits_total{{tier="{t}"}}')
                 for t in ("function", "zygote", "subset", "base")}
        evicted0 = gw.metric("forkvm_templates_evicted")
        times, tiers, lock = [], {}, threading.Lock()
        plan = [rng.choice(names) for _ in range(a.requests)]
        per = [plan[i::a.clients_mix] for i in range(a.clients_mix)]

        def client(mine):
            out = []
            for name in mine:
                t, h = gw.invoke(name)
                out.append((t * 1e3, h.get("x-forkvm-tier", "?")))
            with lock:
                for t, tier in out:
                    times.append(t)
                    tiers.setdefault(tier, []).append(t)

        t0 = time.perf_counter()
        threads = [threading.Thread(target=client, args=(m,)) for m in per]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t0
        hits = {t: gw.metric(f'forkvm_cache_hits_total{{tier="{t}"}}') - hits0[t]
                for t in hits0}
        evicted = gw.metric("forkvm_templates_evicted") - evicted0
        memory = gw.metric("forkvm_template_memory_bytes") / (1 << 20)
        templates = gw.metric("forkvm_templates")
    finally:
        gw.stop()
    print(f"\n{a.functions} functions over {len(MIX_SETS)} package sets, {a.requests} "
          f"requests by {a.clients_mix} clients at random, {wall:.1f} s "
          f"({a.requests / wall:.0f}/s); memory budget {a.budget_mib} MiB\n")
    head("percentile", "latency ms")
    for q in (0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0):
        print(f"| p{q * 100:g} | {pct(times, q):.2f} |")
    print()
    head("tier of the function's template", "requests", "median ms", "p99 ms")
    for t in ("function", "zygote", "subset", "base"):
        xs = tiers.get(t, [])
        med = f"{statistics.median(xs):.2f}" if xs else "-"
        p99 = f"{pct(xs, 0.99):.2f}" if xs else "-"
        print(f"| {t} | {int(hits[t])} | {med} | {p99} |")
    print(f"\ntemplates evicted during the run: {evicted:.0f}; cached at the end: "
          f"{templates:.0f} ({memory:.0f} MiB own memory); deployments by tier: "
          f"{deploy_tiers}")


def main():
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="noop,imports,packages,mix")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=5)
    ap.add_argument("--clients", default="auto",
                    help="noop's client counts (auto: 1, 2, 4, ... 4x the cores)")
    ap.add_argument("--plot", help="draw noop's invocations/s against clients to this PNG")
    ap.add_argument("--warm", type=int, default=2,
                    help="warm clones of each template in the noop experiment")
    ap.add_argument("--packages", default="json,numpy")
    ap.add_argument("--import-runs", type=int, default=3)
    ap.add_argument("--cold-runs", type=int, default=2)
    ap.add_argument("--functions", type=int, default=100)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--clients-mix", type=int, default=8)
    ap.add_argument("--budget-mib", type=int, default=400)
    ap.add_argument("--requirements", default="pyyaml,jinja2,requests")
    ap.add_argument("--modules", default="yaml,jinja2,requests",
                    help="what the packages experiment's handler imports")
    ap.add_argument("--wheels", help="a directory of the requirements' wheels (and pip's) "
                    "instead of downloading them")
    ap.add_argument("--package-runs", type=int, default=5)
    ap.add_argument("--build-runs", type=int, default=3)
    a = ap.parse_args()
    for path in (GATEWAY, VMM):
        if not os.path.exists(path):
            sys.exit(f"{path} missing: cargo build --release --workspace --bins")
    with tempfile.TemporaryDirectory(prefix="forkvm-faas-") as tmp:
        only = a.only.split(",")
        if "noop" in only:
            noop(a, tmp)
        if "imports" in only:
            imports(a, tmp)
        if "packages" in only:
            packages(a, tmp)
        if "mix" in only:
            mix(a)


if __name__ == "__main__":
    main()
