#!/usr/bin/env python3
"""Per-clone network bandwidth against the number of clones sending at once (root).

A running Linux template with a network card (and, in the limited configuration, a rate
limit on it) is paused; then 1, 2, 4 and 8 clones are made at once, each clone's tap goes
into a network namespace of its own with a TCP sink at 10.77.0.1:5000, and every clone
streams zeros to its sink (the template's script: `dd | nc`, retried every second). Once
every clone has sent a bucket's worth twice over, the bytes each clone's frames carried
into its tap (the tap's rx_bytes, what the limiter counts) are read over a window.
Configurations run one after the other in the same run: without a limit and with
--limit.

usage: benches/net.py [--counts 1,2,4,8] [--window S] [--limit bytes=8K/4000]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clone import GUEST, api, start_template, stop_template  # noqa: E402

SINK = ("import socket,threading\n"
        "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
        "s.bind(('0.0.0.0',5000));s.listen(16)\n"
        "def d(c):\n  while c.recv(65536):pass\n"
        "while True:\n  c,_=s.accept();threading.Thread(target=d,args=(c,),daemon=True).start()\n")
SCRIPT = ("ip link set eth0 up; ip addr add 10.77.0.2/24 dev eth0; echo net-configured; "
          "while :; do if ping -c1 -W1 10.77.0.1 >/dev/null 2>&1; then "
          "dd if=/dev/zero bs=1k count=1000000 2>/dev/null | nc 10.77.0.1 5000; fi; "
          "sleep 1; done")


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


def rx_bytes(ns, dev):
    out = subprocess.run(["ip", "netns", "exec", ns, "cat",
                          f"/sys/class/net/{dev}/statistics/rx_bytes"],
                         check=True, capture_output=True, text=True)
    return int(out.stdout)


def has_link(ns, dev):
    return subprocess.run(["ip", "-n", ns, "link", "show", dev],
                          capture_output=True).returncode == 0


def wait_link(dev, timeout=30):
    deadline = time.time() + timeout
    while subprocess.run(["ip", "link", "show", dev], capture_output=True).returncode:
        if time.time() > deadline:
            sys.exit(f"no tap {dev}")
        time.sleep(0.05)


def measure(tmp, label, limit, counts, window, namespaces):
    """Rows (label, clones, per-clone rates) for one template configuration."""
    tap = f"fkn{os.getpid() % 10000000}"
    extra = ["--initrd", os.path.join(GUEST, "initramfs.cpio"), "--tap", tap]
    if limit:
        extra += ["--net-rate-limit", limit]
    guest = f'console=ttyS0 reboot=k panic=-1 quiet forkvm.run="{SCRIPT}"'
    p, sock = start_template(tmp, 256, True, prefault=False, guest=guest,
                             ready=b"net-configured", extra=extra,
                             kernel=os.path.join(GUEST, "vmlinux"), boot_timeout=600)
    rows = []
    try:
        code, body = api(sock, "PATCH", "/vm", '{"state":"paused"}')
        assert code == 204, body
        # Enough bytes that every clone is past its bucket's first fill (limited) or
        # past TCP's start (unlimited).
        warm_bytes = 64 * 1024
        for n in counts:
            code, body = api(sock, "POST", "/clones", f'{{"count":{n},"console":"null"}}')
            assert code == 201, body
            clones = json.loads(body)["clones"]
            taps = [c["net"]["tap"] for c in clones]
            for t, ns in zip(taps, namespaces):
                wait_link(t)
                ip("link", "set", t, "netns", ns)
                ip("-n", ns, "addr", "add", "10.77.0.1/24", "dev", t)
                ip("-n", ns, "link", "set", t, "up")
            deadline = time.time() + 900
            while not all(rx_bytes(ns, t) > warm_bytes for t, ns in zip(taps, namespaces)):
                if time.time() > deadline:
                    sys.exit(f"{label}, {n} clones: not all sending")
                time.sleep(0.5)
            before = [rx_bytes(ns, t) for t, ns in zip(taps, namespaces)]
            t0 = time.monotonic()
            time.sleep(window)
            after = [rx_bytes(ns, t) for t, ns in zip(taps, namespaces)]
            secs = time.monotonic() - t0
            rates = [(a - b) / secs for a, b in zip(after, before)]
            rows.append((label, n, rates))
            print(f"  {label}, {n} clones: {[round(r) for r in rates]} B/s", file=sys.stderr)
            for c in clones:
                api(sock, "DELETE", f"/clones/{c['id']}")
            for t, ns in zip(taps, namespaces):
                deadline = time.time() + 60
                while has_link(ns, t):
                    if time.time() > deadline:
                        sys.exit(f"tap {t} stays")
                    time.sleep(0.1)
    finally:
        stop_template(p, sock)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--window", type=float, default=20)
    ap.add_argument("--limit", default="bytes=8K/4000")
    a = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("benches/net.py needs root (taps, network namespaces)")
    counts = [int(c) for c in a.counts.split(",")]
    namespaces = [f"fkvm-bench-{os.getpid()}-{i}" for i in range(max(counts))]
    sinks = []
    try:
        for ns in namespaces:
            ip("netns", "add", ns)
            ip("-n", ns, "link", "set", "lo", "up")
            sinks.append(subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-c", SINK],
                                          stdin=subprocess.DEVNULL))
        rows = []
        with tempfile.TemporaryDirectory(prefix="forkvm-bench-") as tmp:
            rows += measure(tmp, "unlimited", None, counts, a.window, namespaces)
            rows += measure(tmp, a.limit, a.limit, counts, a.window, namespaces)
    finally:
        for s in sinks:
            s.kill()
            s.wait()
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
    print(f"Per-clone TCP throughput into the clone's tap (bytes/s over {a.window:g} s), "
          f"256 MiB Linux clones of one paused template, all sending at once:\n")
    print("| limit | clones | min | median | max | sum |")
    print("|---|---|---|---|---|---|")
    for label, n, rates in rows:
        print(f"| {label} | {n} | {min(rates):.0f} | {statistics.median(rates):.0f} | "
              f"{max(rates):.0f} | {sum(rates):.0f} |")


if __name__ == "__main__":
    main()
