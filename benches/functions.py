#!/usr/bin/env python3
"""Real functions in a fresh clone, in the style of FunctionBench and SeBS:
small Python handlers that do work, each request in a fresh clone of the function's
template through forkvm-gateway, side by side in one run with the same source in a host
Python zygote that forks per request (the SOCK mechanism, /usr/bin/python3, no VM).

Each function is deployed twice: without a warm-up, and with one warm-up event (the
request's own event: the handler runs on it in the template before it pauses). Requests
to the two deployments and to the host zygote are interleaved (each round in an order
drawn for it, seeded), --runs of each. Rows: the
client's request-to-reply time (min / median / p99), its ratio to the host zygote's
median, and the template VMM's split from the answer's headers: clone (x-forkvm-clone-us),
handler (x-forkvm-handler-us), total (x-forkvm-total-us).

--compare-vmm-arg ARG starts a second gateway whose VMMs take ARG too, deploys each
function with its warm-up there as well, and interleaves its requests with the others':
an A/B of a VMM option in the same run (--compare-vmm-arg=--working-set-mib=0: without
the warm clones' working set). --compare-rootfs IMAGE does the same with the second
gateway's guests on another root image (the Python runtime before a change), and
--compare-vmm PATH with its VMMs run from PATH (another build's `vmm`). --rewind makes
the second gateway's clones rewound ones (`forkvm-gateway --rewind`: a clone that
answered is put back in its template's state and serves again), each function deployed
there with and without its warm-up: `make bench` runs it so.

usage: benches/functions.py [--runs N] [--only a,b] [--warm N] [--bin-dir DIR]
                            [--base-snapshot DIR] [--compare-vmm-arg ARG ...]
                            [--compare-rootfs IMAGE] [--compare-vmm PATH] [--compare-cold]
                            [--rewind] [--compare-label TEXT] [--age S] [--gap-ms MS]
                            [--json OUT] [--plot PNG]

--json writes every sample; --plot draws the medians and p99s (matplotlib,
python3-matplotlib), read from the run or from --from-json.
"""
import argparse
import json
import os
import random
import shutil
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import faas
from clone import pct
from faas import HOST_PYTHON, Gateway, head


def _doc():
    """A JSON document of about 100 KiB: records of mixed types."""
    rows = [{"id": i, "name": f"user-{i:05d}", "score": (i * 7919) % 1000 / 7.0,
             "tags": ["a", "bb", "ccc"][: i % 4], "active": i % 3 == 0}
            for i in range(1150)]
    return json.dumps({"rows": rows}).encode()


# name: (source, event, packages). Each handler takes the event (bytes) and returns
# bytes or str.
FUNCTIONS = {
    "constant": ("def handler(event):\n    return b'ok'\n", b"", ()),
    "float": ("""
import math

def handler(event):
    n = int(event)
    s = 0.0
    for i in range(1, n):
        x = i * 0.001
        s += math.sin(x) * math.sqrt(x) / (1.0 + x * x)
    return repr(s)
""", b"20000", ()),
    "cipher": ("""
def xtea(block, key, rounds=32):
    v0, v1 = block
    s, delta, mask = 0, 0x9E3779B9, 0xFFFFFFFF
    for _ in range(rounds):
        v0 = (v0 + ((((v1 << 4) ^ (v1 >> 5)) + v1) ^ (s + key[s & 3]))) & mask
        s = (s + delta) & mask
        v1 = (v1 + ((((v0 << 4) ^ (v0 >> 5)) + v0) ^ (s + key[(s >> 11) & 3]))) & mask
    return v0, v1

def handler(event):
    key = (1, 2, 3, 4)
    out = bytearray()
    for i in range(0, len(event) - 7, 8):
        a, b = xtea((int.from_bytes(event[i:i + 4], "little"),
                     int.from_bytes(event[i + 4:i + 8], "little")), key)
        out += a.to_bytes(4, "little") + b.to_bytes(4, "little")
    return bytes(out)
""", bytes(i % 251 for i in range(2048)), ()),
    "json": ("""
import json

def handler(event):
    doc = json.loads(event)
    doc["rows"].sort(key=lambda r: (-r["score"], r["name"]))
    return json.dumps(doc, sort_keys=True)
""", _doc(), ("json",)),
    "sha256": ("""
import hashlib

def handler(event):
    h = event
    for _ in range(2000):
        h = hashlib.sha256(h).digest()
    return h.hex()
""", b"seed", ("hashlib",)),
    "random": ("""
import os, uuid

def handler(event):
    return os.urandom(32).hex() + " " + " ".join(str(uuid.uuid4()) for _ in range(8))
""", b"", ("uuid",)),
    "tmpfile": ("""
import os

def handler(event):
    path = "/tmp/forkvm-bench-%d" % os.getpid()
    data = event * 64
    with open(path, "wb") as f:
        f.write(data)
    with open(path, "rb") as f:
        back = f.read()
    os.unlink(path)
    return str(len(back) if back == data else -1)
""", bytes(range(256)) * 4, ()),
    "payload": ("def handler(event):\n    return event[::-1]\n",
                bytes(i % 253 for i in range(1 << 20)), ()),
    "alloc": ("""
def handler(event):
    buf = bytearray(32 << 20)
    for i in range(0, len(buf), 4096):
        buf[i] = i & 0xFF
    return str(sum(buf[::4096]))
""", b"", ()),
    "numpy": ("""
import numpy

def handler(event):
    a = numpy.arange(128 * 128, dtype=numpy.float64).reshape(128, 128) / 1000.0
    return repr(round(float((a @ a.T).trace()), 3))
""", b"", ("numpy",)),
    "template": ("""
import string

ROW = string.Template("<tr><td>$id</td><td>$name</td><td>$score</td></tr>")

def handler(event):
    rows = [ROW.substitute(id=i, name="user-%d" % i, score=i * 3 % 100) for i in range(2000)]
    return "<table>" + "".join(rows) + "</table>"
""", b"", ("string",)),
    "lazy-import": ("""
def handler(event):
    import statistics
    return repr(statistics.median([3, 1, 4, 1, 5, 9, 2, 6]))
""", b"", ()),
}


HOST_RUNNER = r'''
import importlib, os, socket, struct, sys, types
path, packages, source = sys.argv[1], sys.argv[2], sys.stdin.read()
for p in filter(None, packages.split(",")):
    importlib.import_module(p)
module = types.ModuleType("forkvm_function")
sys.modules["forkvm_function"] = module
exec(compile(source, "<forkvm_function>", "exec"), module.__dict__)
handler = module.handler

def recv_exact(conn, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)

srv = socket.socket(socket.AF_UNIX)
srv.bind(path); srv.listen(64)
print("ready", flush=True)
while True:
    conn, _ = srv.accept()
    pid = os.fork()
    if pid == 0:
        srv.close()
        (n,) = struct.unpack("<I", recv_exact(conn, 4))
        out = handler(recv_exact(conn, n))
        if isinstance(out, str):
            out = out.encode()
        conn.sendall(struct.pack("<I", len(out)) + out)
        os._exit(0)
    conn.close()
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:
                break
        except ChildProcessError:
            break
'''


class HostFunction:
    """The function's source loaded in a host Python process (its packages imported,
    its module run) that forks a child per request to call the handler."""

    def __init__(self, tmp, name, source, packages):
        self.path = os.path.join(tmp, name + ".sock")
        self.p = subprocess.Popen([HOST_PYTHON, "-c", HOST_RUNNER, self.path,
                                   ",".join(packages)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE)
        self.p.stdin.write(source.encode())
        self.p.stdin.close()
        if self.p.stdout.readline() != b"ready\n":
            sys.exit(f"the host zygote of {name} did not start (python3-numpy installed?)")

    def call(self, event):
        """(seconds, reply)."""
        t0 = time.perf_counter()
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(self.path)
            # As the gateway's client does (faas.Gateway.request): one sendmsg, the
            # answer read into one buffer of its length.
            faas.send_all(s, [struct.pack("<I", len(event)), event])
            head = b""
            while len(head) < 4:
                chunk = s.recv(4 - len(head))
                if not chunk:
                    sys.exit("the host zygote's child died")
                head += chunk
            (n,) = struct.unpack("<I", head)
            out = faas.recv_into_exact(s, b"", n)
        return time.perf_counter() - t0, out

    def stop(self):
        self.p.kill()
        self.p.wait()


def deploy(gw, name, source, packages, warmup, cls=None):
    spec = {"source": source, "packages": list(packages), "limits": {"timeout_ms": 300_000}}
    if cls:
        spec["limits"]["class"] = cls
    if warmup is not None:
        spec["warmup"] = [{"base64": __import__("base64").b64encode(warmup).decode()}]
    status, _, data, _ = gw.request("PUT", f"/functions/{name}", json.dumps(spec).encode())
    if status not in (200, 201):
        sys.exit(f"deploy {name}: {status} {data[:400]!r}")


def invoke(gw, name, event):
    """(client ms, clone ms, handler ms, total ms, 1 if its clone was primed else 0,
    reply)."""
    status, h, data, t = gw.request("POST", f"/functions/{name}", event)
    if status != 200:
        sys.exit(f"invoke {name}: {status} {data[:400]!r}")
    us = [int(h.get(f"x-forkvm-{k}-us", 0)) / 1e3 for k in ("clone", "handler", "total")]
    return (t * 1e3, *us, int(h.get("x-forkvm-primed") == "true"), data)


def run(a):
    names = a.only.split(",") if a.only else list(FUNCTIONS)
    unknown = [n for n in names if n not in FUNCTIONS]
    if unknown:
        sys.exit(f"no such function: {unknown}; there are {list(FUNCTIONS)}")
    if a.bin_dir:
        faas.GATEWAY = os.path.join(a.bin_dir, "forkvm-gateway")
    # The host zygotes import the functions' packages: checked before anything runs,
    # so that a missing one (numpy) does not end a long run half way.
    packages = sorted({p for n in names for p in FUNCTIONS[n][2]})
    check = subprocess.run([HOST_PYTHON, "-c", "import " + ", ".join(packages or ["os"])],
                           capture_output=True, text=True)
    if check.returncode != 0:
        sys.exit(f"{HOST_PYTHON} cannot import {packages} for the host zygotes "
                 f"(`make bench` installs python3-numpy):\n{check.stderr.strip()[-400:]}")
    extra = ["--load-timeout-s", "1800"]
    if a.base_snapshot:
        extra += ["--base-snapshot", a.base_snapshot]
    gw = Gateway(extra, warm=a.warm)
    # The same functions on a second gateway whose VMMs take more arguments or boot
    # another image, deployed with the warm-up too, its requests interleaved with the
    # others'.
    other = None
    if a.compare_vmm_arg or a.compare_rootfs or a.compare_vmm or a.rewind:
        more = [x for v in a.compare_vmm_arg for x in ("--vmm-arg", v)]
        if a.rewind:
            more.append("--rewind")
        if a.compare_vmm:
            more += ["--vmm", a.compare_vmm]
        other = Gateway(extra + more, warm=a.warm, rootfs=a.compare_rootfs)
    results = {}
    tmp = tempfile.mkdtemp(prefix="forkvm-functions-")
    try:
        for name in names:
            source, event, packages = FUNCTIONS[name]
            deploy(gw, name, source, packages, None)
            deploy(gw, name + "-warm", source, packages, event)
            if other:
                deploy(other, name + "-warm", source, packages, event)
                if a.compare_cold:
                    deploy(other, name, source, packages, None)
            host = HostFunction(tmp, name, source, packages)
            time.sleep(a.age)
            try:
                # The host's reply is the reference for both deployments' (a function
                # with randomness in its reply is only checked for its length).
                _, want = host.call(event)
                series = {"cold": [], "warm": [], "host": []}
                paths = [("cold", gw, name), ("warm", gw, name + "-warm")]
                if other:
                    series["other"] = []
                    paths.append(("other", other, name + "-warm"))
                    if a.compare_cold:
                        series["other-cold"] = []
                        paths.append(("other-cold", other, name))
                # Each round in its own order (seeded): a request that comes right after
                # a fresh clone's shares the 2 cores with that template making its next
                # warm clone, so a fixed order had one kind always pay for the one
                # before it (the warm-up's deployment, after the one without, measured
                # 1.5-2.5 ms slower for the pure-Python functions on 2026-12-05).
                order = random.Random(1)
                paths.append(("host", None, None))
                for _ in range(a.runs):
                    order.shuffle(paths)
                    for mode, g, fname in paths:
                        time.sleep(a.gap_ms / 1e3)
                        if mode == "host":
                            series["host"].append([host.call(event)[0] * 1e3, 0, 0, 0, 0])
                            continue
                        *times, reply = invoke(g, fname, event)
                        same = reply == want if name != "random" else len(reply) == len(want)
                        if not same:
                            sys.exit(f"{fname} answered {reply[:200]!r}, the host {want[:200]!r}")
                        series[mode].append(times)
            finally:
                host.stop()
            results[name] = series
            report(name, series, a.compare_label)
    finally:
        gw.stop()
        if other:
            other.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def report(name, series, label="compared gateway"):
    client = {m: [s[0] for s in xs] for m, xs in series.items()}
    base = statistics.median(client["host"])
    print(f"\n{name}: {len(client['host'])} requests of each, interleaved (ms)\n")
    head("path", "min", "median", "p99", "vs host", "clone p50", "handler p50", "total p50",
         "primed")
    for mode, label in (("cold", "fresh clone, no warm-up"),
                        ("warm", "fresh clone, one warm-up event"),
                        ("other", f"one warm-up event, {label}"),
                        ("other-cold", f"no warm-up, {label}"),
                        ("host", "host Python zygote, fork per request")):
        if mode not in client:
            continue
        xs = client[mode]
        line = (f"| {label} | {min(xs):.2f} | {statistics.median(xs):.2f} | "
                f"{pct(xs, 0.99):.2f} | {statistics.median(xs) / base:.1f}x |")
        if mode == "host":
            line += " - | - | - | - |"
        else:
            split = [statistics.median(s[k] for s in series[mode]) for k in (1, 2, 3)]
            line += "".join(f" {v:.2f} |" for v in split)
            # Requests whose clone was a primed warm clone (x-forkvm-primed); a run saved
            # before the column was added has none.
            primed = [s[4] for s in series[mode] if len(s) > 4]
            line += f" {100 * sum(primed) / len(primed):.0f}% |" if primed else " - |"
        print(line, flush=True)


def summary(results, label="compared"):
    print("\nall functions, client side (ms)\n")
    other = any("other" in s for s in results.values())
    cold = any("other-cold" in s for s in results.values())
    head("function", "no warm-up p50", "p99", "warm-up p50", "p99", "host p50", "p99",
         "warm-up / host",
         *((f"{label} p50", "p99", f"{label} / warm-up") if other else ()),
         *((f"{label} no warm-up p50", "p99", f"{label} / no warm-up") if cold else ()))
    for name, series in results.items():
        c = {m: [s[0] for s in xs] for m, xs in series.items()}
        med = {m: statistics.median(xs) for m, xs in c.items()}
        line = (f"| {name} | {med['cold']:.2f} | {pct(c['cold'], 0.99):.2f} | "
                f"{med['warm']:.2f} | {pct(c['warm'], 0.99):.2f} | {med['host']:.2f} | "
                f"{pct(c['host'], 0.99):.2f} | {med['warm'] / med['host']:.1f}x |")
        if "other" in c:
            line += (f" {med['other']:.2f} | {pct(c['other'], 0.99):.2f} | "
                     f"{med['other'] / med['warm']:.2f} |")
        if "other-cold" in c:
            line += (f" {med['other-cold']:.2f} | {pct(c['other-cold'], 0.99):.2f} | "
                     f"{med['other-cold'] / med['cold']:.2f} |")
        print(line)


def plot(results, png, label="compared gateway"):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    modes = [("cold", "fresh clone, no warm-up"), ("warm", "fresh clone, warm-up")]
    if all("other-cold" in results[n] for n in names):
        modes.append(("other-cold", f"{label}, no warm-up"))
    if all("other" in results[n] for n in names):
        modes.append(("other", f"{label}, warm-up"))
    modes.append(("host", "host zygote, fork"))
    fig, ax = plt.subplots(figsize=(11 + 1.5 * (len(modes) - 3), 4.5))
    width = 0.8 / len(modes)
    for i, (mode, label) in enumerate(modes):
        xs = [j + (i - (len(modes) - 1) / 2) * width for j in range(len(names))]
        med = [statistics.median(s[0] for s in results[n][mode]) for n in names]
        p99 = [pct([s[0] for s in results[n][mode]], 0.99) for n in names]
        ax.bar(xs, med, width, label=label)
        ax.scatter(xs, p99, marker="_", color="black", zorder=3)
    ax.set_yscale("log")
    ax.set_ylabel("request to reply, ms (bar: median, dash: p99)")
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right")
    ax.legend()
    ax.set_title("Real Python functions: a clone per request vs a host zygote's fork")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"\nplot: {png}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=100, help="requests of each kind per function")
    ap.add_argument("--only", default="", help="comma-separated function names")
    ap.add_argument("--warm", type=int, default=2, help="the gateway's --warm-clones")
    ap.add_argument("--bin-dir", help="where forkvm-gateway and vmm are (default "
                    "target/release)")
    ap.add_argument("--base-snapshot", help="the gateway's --base-snapshot: its base "
                    "template restored from there instead of booted (saved there the first "
                    "time)")
    ap.add_argument("--compare-vmm-arg", action="append", default=[], metavar="ARG",
                    help="also run each function, with its warm-up, on a second gateway "
                    "whose VMMs take ARG (repeat for more), side by side "
                    "(e.g. --compare-vmm-arg=--working-set-mib=0)")
    ap.add_argument("--compare-rootfs", metavar="IMAGE",
                    help="the same, with the second gateway's guests on root image IMAGE "
                    "(a baseline of the Python runtime)")
    ap.add_argument("--compare-vmm", metavar="PATH",
                    help="the same, with the second gateway's VMMs run from PATH (the "
                    "`vmm` of another build: an A/B of a change)")
    ap.add_argument("--compare-cold", action="store_true",
                    help="deploy each function without a warm-up on the second gateway "
                    "too, its requests interleaved as well")
    ap.add_argument("--rewind", action="store_true",
                    help="the second gateway takes --rewind (its functions' clones are "
                    "rewound and serve again: docs/invoke.md), each function deployed there "
                    "with and without its warm-up")
    ap.add_argument("--compare-label", help="what the second gateway's rows are called "
                    "(default: 'rewound clone' with --rewind, else 'compared gateway')")
    ap.add_argument("--age", type=float, default=0,
                    help="seconds to wait after deploying a function, before its first "
                    "request (its templates paused that long)")
    ap.add_argument("--gap-ms", type=float, default=0,
                    help="wait this long before each request (the warm clones made after "
                    "the one before, and their primes, done by then: each request alone "
                    "on the host)")
    ap.add_argument("--json", help="write every sample to this file")
    ap.add_argument("--from-json", help="report and plot a run saved with --json")
    ap.add_argument("--plot", help="draw the figures to this PNG (matplotlib)")
    a = ap.parse_args()
    a.compare_label = a.compare_label or ("rewound clone" if a.rewind else "compared gateway")
    a.compare_cold = a.compare_cold or a.rewind
    if a.from_json:
        with open(a.from_json) as f:
            results = json.load(f)
        for name, series in results.items():
            report(name, series, a.compare_label)
    else:
        results = run(a)
    summary(results, a.compare_label)
    if a.json and not a.from_json:
        with open(a.json, "w") as f:
            json.dump(results, f)
    if a.plot:
        plot(results, a.plot, a.compare_label)


if __name__ == "__main__":
    main()
