"""Closed-loop load for the throughput benchmarks (invoke.py, faas.py): N client
processes, each calling in a loop for a fixed time, and the host CPU the calls cost.

Clients are processes (forked), not threads: Python threads share one interpreter
lock, and at thousands of calls a second the client, not the system under test, would
set the rate. The CPU figure is the whole host's busy time (/proc/stat) less the
clients' own (their rusage), per call: what serving a call costs.
"""
import multiprocessing
import os
import statistics
import time

from clone import pct


def cores():
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0))


def default_clients(n=None):
    """1, 2, 4, ... up to 4x the cores (and 4x itself when that is no power of two)."""
    top = 4 * (n or cores())
    out, c = [], 1
    while c < top:
        out.append(c)
        c *= 2
    return out + [top]


def parse_clients(text):
    """A comma-separated list of client counts, or "auto" (default_clients)."""
    if text == "auto":
        return default_clients()
    return [int(c) for c in text.split(",")]


def busy_seconds():
    """The host's CPU time spent not idle so far (all CPUs, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields) - idle) / os.sysconf("SC_CLK_TCK")


def process_cpu(pid):
    """(own, reaped children's) CPU seconds of process `pid` (/proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return (utime + stime) / hz, (cutime + cstime) / hz


def _client(call, seconds, conn):
    mine, failed = [], 0
    stop_at = time.perf_counter() + seconds
    while time.perf_counter() < stop_at:
        try:
            mine.append(call() * 1e3)
        except (Exception, SystemExit) as e:  # counted, and the first one said
            if failed == 0:
                print(f"load: a call failed: {e}", flush=True)
            failed += 1
    t = os.times()
    conn.send((mine, failed, t.user + t.system))
    conn.close()


def rate(clients, seconds, call, pid=None):
    """`clients` processes call `call` (returns seconds taken) for `seconds`. Returns a
    dict: per_s (calls a second), median and p99 (ms), cpu_ms (host CPU per call,
    the clients' own left out), failed (calls that raised); with `pid` (a template's
    VMM), its share of cpu_ms: own_ms (its own threads) and children_ms (its children
    reaped meanwhile: its clones)."""
    ctx = multiprocessing.get_context("fork")
    pipes, procs = [], []
    split0 = process_cpu(pid) if pid else None
    t0, busy0 = time.perf_counter(), busy_seconds()
    for _ in range(clients):
        ours, theirs = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_client, args=(call, seconds, theirs))
        p.start()
        theirs.close()
        pipes.append(ours)
        procs.append(p)
    times, failed, client_cpu = [], 0, 0.0
    for ours, p in zip(pipes, procs):
        mine, f, cpu = ours.recv()
        times.extend(mine)
        failed += f
        client_cpu += cpu
        p.join()
    wall, busy = time.perf_counter() - t0, busy_seconds() - busy0
    n = max(len(times), 1)
    split = {}
    if pid:
        (own0, kids0), (own1, kids1) = split0, process_cpu(pid)
        split = {"own_ms": (own1 - own0) * 1e3 / n, "children_ms": (kids1 - kids0) * 1e3 / n}
    return {
        **split,
        "clients": clients,
        "per_s": len(times) / wall,
        "median": statistics.median(times) if times else float("nan"),
        "p99": pct(times, 0.99) if times else float("nan"),
        "cpu_ms": max(busy - client_cpu, 0.0) * 1e3 / n,
        "failed": failed,
    }


def plot(path, title, series):
    """Draws calls/s against clients, one line per entry of `series` ({label: [rate()
    dicts]}), to the PNG `path` (matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rows in series.items():
        xs = [r["clients"] for r in rows]
        ax.plot(xs, [r["per_s"] for r in rows], marker="o", label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("invocations per second")
    ax.set_title(title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")
