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
throughput: invocations per second with 1, 2, 4 and 8 concurrent clients, each request
  in a fresh warm clone, and host CPU time (all processes, /proc/stat) per invocation.

usage: benches/invoke.py latency [--runs N] [--rounds R] [--mem MIB] [--payload BYTES]
       benches/invoke.py throughput [--seconds S] [--clients 1,2,4,8] [--mem MIB]
"""
import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time

from clone import pct, row as clone_row

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "target/guest/tiny.elf")
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


def invoke(sock, payload, query=""):
    t0 = time.perf_counter()
    status, headers, data = exchange(sock, "POST", "/invocations" + query, payload)
    elapsed = time.perf_counter() - t0
    if status != 200 or not data.startswith(payload):
        sys.exit(f"invocation failed: {status} {data[:200]!r}")
    return elapsed, headers


def start_template(tmp, name, mem, warm):
    sock = os.path.join(tmp, name + ".sock")
    console = sock + ".console"
    cmd = [VMM, "run", "--kernel", TINY, "--ap-boot", "direct", "--mem-mib", str(mem),
           "--cmdline", "ticks=1 invoke=1", "--console", console, "--api-sock", sock,
           "--template", "--warm-clones", str(warm), "--prefault"]
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            status, _, body = exchange(sock, "GET", "/vm")
            if status == 200 and b'"state":"paused"' in body and \
                    (warm == 0 or f'"ready":{warm}'.encode() in body):
                return p, sock
        except OSError:
            pass
        if p.poll() is not None:
            sys.exit(f"template exited with {p.returncode}")
        time.sleep(0.02)
    p.kill()
    sys.exit("template did not come up")


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
import os, socket, sys
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


def start_zygote(tmp):
    path = os.path.join(tmp, "zygote.sock")
    p = subprocess.Popen([sys.executable, "-c", ZYGOTE, path], stdout=subprocess.PIPE,
                         stdin=subprocess.DEVNULL)
    p.stdout.readline()
    return p, path


def zygote_call(path, payload):
    t0 = time.perf_counter()
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    s.sendall(len(payload).to_bytes(4, "little") + payload)
    data = read_all(s)
    elapsed = time.perf_counter() - t0
    if data[4:] != payload:
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


def cpu_ticks():
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle


def throughput(a):
    clients = [int(c) for c in a.clients.split(",")]
    hz = os.sysconf("SC_CLK_TCK")
    print(f"\nThroughput, tiny guest echo, {a.mem} MiB template, --warm-clones 8, each "
          f"request in a fresh clone, {a.seconds} s per row\n")
    print("| clients | invocations/s | median ms | p99 ms | host CPU ms per invocation |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="forkvm-invoke-", dir="/dev/shm") as tmp:
        p, sock = start_template(tmp, "tp", a.mem, 8)
        try:
            for c in clients:
                times = []
                lock = threading.Lock()
                stop_at = time.perf_counter() + a.seconds

                def client():
                    mine = []
                    while time.perf_counter() < stop_at:
                        mine.append(invoke(sock, b"ping")[0] * 1e3)
                    with lock:
                        times.extend(mine)

                t0, cpu0 = time.perf_counter(), cpu_ticks()
                threads = [threading.Thread(target=client) for _ in range(c)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall, cpu = time.perf_counter() - t0, (cpu_ticks() - cpu0) / hz
                print(f"| {c} | {len(times) / wall:.0f} | {statistics.median(times):.2f} | "
                      f"{pct(times, 0.99):.2f} | {cpu * 1e3 / len(times):.2f} |")
                wait_warm(sock, 8)
        finally:
            stop(p, sock)


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
    tp.add_argument("--clients", default="1,2,4,8")
    tp.add_argument("--mem", type=int, default=256)
    a = ap.parse_args()
    if not os.path.exists(VMM):
        sys.exit(f"{VMM} is missing: cargo build --release")
    {"latency": latency, "throughput": throughput}[a.cmd](a)


if __name__ == "__main__":
    main()
