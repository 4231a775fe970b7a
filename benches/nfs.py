#!/usr/bin/env python3
"""Shared NFS storage per clone against the number of clones at once (root;
docs/shared-storage.md).

A user-space NFS server (nfs-ganesha, VFS backend, with an rpcbind of its own) serves a
host directory over NFSv3/TCP in a network namespace, behind a bridge that every VM's tap
joins. A 256 MiB Linux template takes 10.79.0.2, mounts the export (the options of
docs/shared-storage.md), remounts its private disk (an ext4 image attached with
`--disk IMG,cow=DIR`: each clone writes its own copy-on-write overlay) read-write, and is
paused. Then, for 1, 2, 4 and 8 clones at once (`POST /clones` with their own addresses,
and in the limited configuration a per-clone `rate_limits.net`), every clone, started
together by the clock:

  nfs write   dd of --kib KiB of zeros to a file of its own on the export, conv=fsync
  nfs read    the caches dropped, dd of that file to /dev/null
  disk write  the same on its private overlay disk (the reference; not limited)
  disk read

Each clone's data rate is the file's bytes over the time the guest measured around dd
(/proc/uptime, 10 ms steps). Its link rate is the bytes of the frames its network card
counted over the same time (eth0's tx_bytes for writes, rx_bytes for reads): what the
VMM let through its limiter, Ethernet, IP, TCP and RPC headers included. Its steady
rate is the same seen from the host, with no process in the guest: the bench reads every
tap's byte counters every 0.25 s and takes the rate between the moments the clone's
transfer had moved 10% and 90% of its bytes, so what its limiter passed while it
transferred, without dd's process start before it or the last COMMIT after it. A
per-clone limit R is judged by the steady rate; the link rate over dd's whole window is
shown beside it. With each tap sample the bench also reads the clone's limiter counters
(`GET /vm`), and over the same span reports the rate of tokens its limiter had no frame
for (`unused`: the transfer did not keep up, the guest or the server slow to queue the
next frame) and lost while a frame waited (`late`: the VMM's worker came late to its
timer); a clone more than 10% off R is listed with both. A clone whose link rate over
dd's whole window is more than 10% below R is listed with where that window's time
went, from its tap's samples: before its transfer moved 1% of its bytes, to 10%, to
90%, to 99%, and after; its longest stall between 1% and 99%; and its limiter's counters
over the window (the guest's window is placed on the host's clock by one clock reading
between two uptime readings before the phase). Beside them, for the NFS phases: the frames the taps
dropped for want of room, the server's TCP retransmissions (both counted in the
namespace before and after), and the share of the host's CPU time that was busy. 15 s
in which every clone only sleeps (from 5 s after the processes that sleep started)
give the CPU floor under those figures and name the host threads that used the most CPU
meanwhile. Each phase starts its clones' commands `4 + 3n` s ahead of the start second,
and nothing but dd starts a process within a clone's timed window: starting a process
costs this host's emulated guest kernel about a second of CPU. The configurations run
one after the other in one run: unlimited, then --limit (--limited-only: the limit alone; a limit is
`bytes=SIZE[/MS]`, SIZE bytes every MS milliseconds, 1000 by default, and SIZE is also
the bucket: `bytes=8K/4000` is 2 KiB/s with 4 s of tokens).

With --capture, tcpdump records the NFS traffic on the server's bridge during the NFS
phases, and every clone whose transfer moved nothing for 2 s or more between 1% and 99%
of its bytes is listed with what crossed the bridge around that stall: how many frames
each side sent during it, who sent the last one before it, each side's bytes in flight
when it began, and the frames themselves (the bridge sees a clone's frames past its
tx limiter and the server's before its rx limiter: a stall with the server's bytes in
flight waits on the clone's side, its limiter, VMM or guest; one with the clone's bytes
in flight on the server; one with neither on whoever owes the next request).

usage: benches/nfs.py [--counts 1,2,4,8] [--kib 4096] [--limit bytes=128K] [--limited-only]
                      [--rwsize N] [--capture]
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GUEST = os.path.join(ROOT, "target/guest")
VMM = os.path.join(ROOT, "target/release/vmm")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from clone import api  # noqa: E402

SERVER = "10.79.0.1"
OPTS = (f"vers=3,proto=tcp,port=2049,mountport=20048,mountproto=tcp,nolock,"
        f"lookupcache=positive,hard,addr={SERVER}")
GANESHA = """NFS_CORE_PARAM {{ Protocols = 3; NFS_Port = 2049; MNT_Port = 20048;
  Enable_NLM = false; Enable_RQUOTA = false; Enable_UDP = false; }}
NFSV4 {{ Graceless = true; }}
EXPORT {{ Export_Id = 1; Path = {export}; Pseudo = /export; Access_Type = RW;
  Squash = No_Root_Squash; Protocols = 3; Transports = TCP; SecType = sys;
  FSAL {{ Name = VFS; }} }}
"""
SERVER_SCRIPT = """mount -t tmpfs tmpfs /run && mount -t tmpfs tmpfs /var/lib/nfs || exit 1
rpcbind -f &
i=0; while [ ! -S /run/rpcbind.sock ] && [ $i -lt 100 ]; do sleep 0.05; i=$((i+1)); done
exec ganesha.nfsd -F -L {log} -f {conf} -p /run/ganesha.pid -N NIV_EVENT
"""


# Before a read: its data comes from the server or the disk, not the guest's page cache.
DROP = "echo 3 > /proc/sys/vm/drop_caches; "


def ip(*args):
    subprocess.run(["ip", *args], check=True, capture_output=True)


def wait_for(what, ok, timeout):
    deadline = time.time() + timeout
    while not ok():
        if time.time() > deadline:
            sys.exit(f"timed out waiting for {what}")
        time.sleep(0.1)


def start_server(ns, work, export):
    conf, log = os.path.join(work, "ganesha.conf"), os.path.join(work, "ganesha.log")
    with open(conf, "w") as f:
        f.write(GANESHA.format(export=export))
    p = subprocess.Popen(["ip", "netns", "exec", ns, "unshare", "--mount", "--pid", "--fork",
                          "--propagation", "private", "sh", "-c",
                          SERVER_SCRIPT.format(log=log, conf=conf)],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL)
    wait_for("the NFS server", lambda: os.path.exists(log) and
             "NFS SERVER INITIALIZED" in open(log).read(), 60)
    return p


def stop_server(p):
    """SIGKILL to ganesha, the first process of its PID namespace (ends its rpcbind)."""
    try:
        with open(f"/proc/{p.pid}/task/{p.pid}/children") as f:
            for pid in f.read().split():
                os.kill(int(pid), 9)
    except OSError:
        pass
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def exec_start(sock, cmd):
    """`cmd` started in the VM behind `sock` (`vmm exec`): its Popen, output piped."""
    return subprocess.Popen([VMM, "exec", "--api-sock", sock, "--timeout", "900", "--", cmd],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)


def exec_end(p, sock, cmd):
    """The output of `exec_start(sock, cmd)`'s `p` once it ended; raises if it failed."""
    out, err = p.communicate()
    if p.returncode != 0:
        raise RuntimeError(f"`{cmd}` in {sock}: {p.returncode} {out} {err}")
    return out


def vmm_exec(sock, cmd):
    return exec_end(exec_start(sock, cmd), sock, cmd)


def in_every(clones, start, cmd_of, prep=""):
    """Runs `cmd_of(i)` (shell) in every clone, each from the wall-clock second `start`
    (the clones' clocks are the host's), after `prep` (run before the wait). Returns a
    function that waits for them all and gives their outputs."""
    # One sleep to the start (to the second): a loop polling the clock would fork a
    # process every step, which costs an emulated guest kernel a CPU. The one process
    # that reads the clock (busybox's adjtimex: its date has no sub-second) sits between
    # two readings of /proc/uptime, which ties the guest's uptime to the host's clock
    # (`clock U0 U1 SEC FRACTION STATUS`; see guest_to_host).
    wait = ("read u0 x < /proc/uptime; c=$(adjtimex); read u1 x < /proc/uptime; set -- $c; "
            "while [ $# -gt 1 ]; do case $1 in status:) st=$2;; time.tv_sec:) s=$2;; "
            "time.tv_usec:) us=$2;; esac; shift; done; [ -n \"$s\" ] || s=$(date +%s); "
            "echo clock $u0 $u1 $s $us $st; "
            f"d=$(({start} - s)); [ $d -le 0 ] || sleep $d; ")
    started = [(c["api_sock"], prep + wait + cmd_of(i)) for i, c in enumerate(clones, 1)]
    procs = [exec_start(sock, cmd) for sock, cmd in started]
    return lambda: [exec_end(p, sock, cmd) for p, (sock, cmd) in zip(procs, started)]


# Not anchored to a line's start: once (2026-11-27) an output came back with the 16 bytes
# before a `took` line zeroed (docs/guest-kernel.md, "Known host problems"), and the bench
# reads what it can.
UPTIME = re.compile(r"took ([0-9.]+) ([0-9.]+) ([0-9.]+) ([0-9.]+)\n")
CLOCK = re.compile(r"clock ([0-9.]+) ([0-9.]+) ([0-9]+) ([0-9]+) ([0-9]+)\n")
STA_NANO = 0x2000


def guest_to_host(out):
    """What to add to the guest's uptime in `out` (an in_every output) for the host's
    clock (time.time()), from its `clock` line, or None. Its error is half the time
    the adjtimex process took to start, run and end (the two uptime readings around it):
    on this host's emulated guest kernel up to about half a second."""
    m = CLOCK.search(out)
    if not m:
        return None
    u0, u1, sec, frac = float(m.group(1)), float(m.group(2)), int(m.group(3)), int(m.group(4))
    # The field is tv_usec, but nanoseconds once the clock runs with STA_NANO (set by the
    # ADJ_NANO offset `forkvm-clone --sync-clock` applies).
    frac /= 1e9 if int(m.group(5)) & STA_NANO else 1e6
    return sec + frac - (u0 + u1) / 2


def timed(cmd, counter=None):
    """`cmd` in the guest between two readings of /proc/uptime (10 ms steps; busybox's
    dd prints no time) and of eth0's `counter` (rx_bytes, tx_bytes) if given: the bytes
    of the frames the VMM passed through its limiter, as the guest's card counted them.
    The readings are the shell's own `read`: a process started in the window (`cut`,
    `cat`) costs this host's emulated guest kernel about a second of CPU, which with 8
    clones on 2 CPUs kept each window open seconds longer than its transfer."""
    count = f"/sys/class/net/eth0/statistics/{counter}" if counter else "/proc/uptime"
    return (f"read t0 x < /proc/uptime; read b0 x < {count}; {cmd} >/dev/null 2>&1 || exit 1; "
            f"read t1 x < /proc/uptime; read b1 x < {count}; echo took $t0 $t1 $b0 $b1")


def net_counts(ns):
    """Every tap's tx drops (frames for the guest its queue had no room for) in namespace
    `ns`, and the namespace's TCP retransmissions (the server's: the clients are in the
    guests) as `tcp-retrans`: {name: count}."""
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/dev", "/proc/net/snmp"],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    counts = {}
    for line in out:
        if ":" in line and "|" not in line and not line.startswith(("Ip", "Icmp", "Tcp", "Udp")):
            row = line.replace(":", " ", 1).split()
            counts[row[0]] = int(row[12])
    tcp = [line.split() for line in out if line.startswith("Tcp:")]
    counts["tcp-retrans"] = int(tcp[1][tcp[0].index("RetransSegs")])
    return counts


class TapSampler:
    """Every tap's byte counters in namespace `ns`, read every `every` s on a thread of
    the host while a phase runs: what each clone's limiter passed, seen from the host,
    with no process started in the guest. A tap's rx is what its VMM wrote (the guest's
    transmit side, past its limiter); its tx what the host queued for the VMM to read."""

    def __init__(self, ns, socks=(), limiter="tx", every=0.25):
        self.ns, self.every, self.rows = ns, every, []
        # Each clone's limiter counters (GET /vm) at each sample: {sock: report}.
        self.socks, self.limiter, self.limits = list(socks), limiter, []
        self.stop_at = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        while not self.stop_at.is_set():
            out = subprocess.run(["ip", "netns", "exec", self.ns, "cat", "/proc/net/dev"],
                                 capture_output=True, text=True).stdout
            t = time.time()
            row = {}
            for line in out.splitlines()[2:]:
                v = line.replace(":", " ", 1).split()
                row[v[0]] = (int(v[1]), int(v[9]))
            self.rows.append((t, row))
            self.limits.append({sk: limiter_of(sk, self.limiter) for sk in self.socks})
            self.stop_at.wait(self.every)

    def stop(self):
        self.stop_at.set()
        self.thread.join()

    def points(self, tap, rx):
        """Tap `tap`'s samples as (sample index, time, rx or tx bytes so far), and a
        function giving the first of them at which it had moved a share of what it moved
        over the phase; or None with fewer than 3 samples."""
        pts = [(i, t, row[tap][0 if rx else 1]) for i, (t, row) in enumerate(self.rows)
               if tap in row]
        if len(pts) < 3:
            return None
        base, total = pts[0][2], pts[-1][2] - pts[0][2]
        return pts, lambda share: next(p for p in pts if p[2] - base >= share * total)

    def steady(self, tap, rx, sock=None):
        """Tap `tap`'s rate in B/s (rx or tx bytes) between the samples at which it had
        moved 10% and 90% of what it moved over the phase: the limiter's rate while the
        transfer flows, without the process start before it, the end after it, or the
        bucket's first burst. With `sock`, also the rates over that span of the tokens
        the clone's limiter had no frame for (`unused`) and lost while a frame waited
        (`late`): (rate, unused, late), or None."""
        found = self.points(tap, rx)
        if not found:
            return None
        (ia, ta, ba), (ib, tb, bb) = found[1](0.1), found[1](0.9)
        if tb <= ta:
            return None
        lost = [None, None]
        a, b = (self.limits[ia].get(sock), self.limits[ib].get(sock)) if sock else (None, None)
        if a and b:
            lost = [(b[k] - a[k]) / (tb - ta) for k in ("unused_bytes", "late_bytes")]
        return ((bb - ba) / (tb - ta), *lost)

    def window(self, tap, rx, sock, w0, w1):
        """Where the time of a clone's window [w0, w1] (the host's clock) went, from its
        tap's samples: `before`, from w0 until its transfer had moved 1% of what it moved
        over the phase; `ramp`, to 10%; `steady`, to 90%; `tail`, to 99%; `after`, from
        there to w1 (each to the sample, 0.25 s or more apart); `gap`, the longest time
        between 1% and 99% in which nothing moved, and `gap_at` when it began (the last
        sample that saw bytes move before it). With the limiter counters at the
        samples nearest w0 and w1: `throttled` (s frames waited), `unused` and `late`
        (bytes) over the window. A dict, or None."""
        found = self.points(tap, rx)
        if not found:
            return None
        pts, at = found
        marks = [at(x)[1] for x in (0.01, 0.1, 0.9, 0.99)]
        edges = [w0] + marks + [w1]
        res = {k: b - a for k, a, b in zip(("before", "ramp", "steady", "tail", "after"),
                                           edges, edges[1:])}
        moving = [p for p in pts if marks[0] <= p[1] <= marks[3]]
        res["moved"], res["gap"], res["gap_at"], since = pts[-1][2] - pts[0][2], 0.0, 0.0, \
            marks[0]
        for (_, ta, ba), (_, tb, bb) in zip(moving, moving[1:]):
            since = since if bb == ba else tb
            if tb - since > res["gap"]:
                res["gap"], res["gap_at"] = tb - since, since
        near = lambda w: min(pts, key=lambda p: abs(p[1] - w))[0]  # noqa: E731
        a, b = self.limits[near(w0)].get(sock), self.limits[near(w1)].get(sock)
        if a and b:
            res["throttled"] = (b["throttled_ms"] - a["throttled_ms"]) / 1000
            res["unused"] = b["unused_bytes"] - a["unused_bytes"]
            res["late"] = b["late_bytes"] - a["late_bytes"]
        return res


def limiter_of(sock, name):
    """The counters of limiter `name` (rx or tx) of the network card of the VM at `sock`
    (`GET /vm`), or None."""
    try:
        code, body = api(sock, "GET", "/vm")
        devices = json.loads(body)["devices"] if code == 200 else []
    except (OSError, ValueError, KeyError):
        return None
    for d in devices:
        for lim in d.get("rate_limiters", []) if d.get("type") == "virtio-net" else []:
            if lim["name"] == name:
                return lim
    return None


def host_cpu():
    """(idle, total) jiffies of all host CPUs (/proc/stat; idle includes iowait)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return v[3] + v[4], sum(v)


def proc_cpu():
    """{(pid/tid, process name/thread name): CPU ticks so far} of every host thread."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            tids = os.listdir(f"/proc/{pid}/task")
            with open(f"/proc/{pid}/comm") as f:
                pname = f.read().strip()
        except OSError:
            continue
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    text = f.read()
            except OSError:
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            v = text[text.rindex(")") + 2:].split()
            out[(f"{pid}/{tid}", f"{pname}/{name}")] = int(v[11]) + int(v[12])
    return out


def top_cpu(before, after, secs, n=6):
    """The `n` threads that used the most CPU between two proc_cpu() readings, as
    text: process/thread (pid/tid) share of one CPU."""
    tick = os.sysconf("SC_CLK_TCK")
    used = sorted(((after[k] - before.get(k, 0), k) for k in after), reverse=True)[:n]
    return ", ".join(f"{k[1]} ({k[0]}) {u / tick / secs:.0%}" for u, k in used)


def lead(n):
    """Seconds from now to the start of a phase of `n` clones: each clone's `vmm exec`,
    its `date` and its `sleep` start processes, about 4 s of CPU in all on this host's
    emulated guest kernel, and n clones share 2 CPUs."""
    return 4 + 3 * n


def asleep(clones, secs=15):
    """The host's CPU busy share, and the threads that used the most, over `secs` while
    every clone sleeps (a `sleep` started before, its process start not counted): what
    the clones, the server and the VMMs cost doing nothing."""
    start = int(time.time()) + lead(len(clones))
    done = in_every(clones, start, lambda i: f"sleep {secs + 10}")
    time.sleep(max(0.0, start + 5 - time.time()))
    cpu0, p0, t0 = host_cpu(), proc_cpu(), time.time()
    time.sleep(secs)
    cpu1, p1, t1 = host_cpu(), proc_cpu(), time.time()
    done()
    return 1 - (cpu1[0] - cpu0[0]) / max(cpu1[1] - cpu0[1], 1), top_cpu(p0, p1, t1 - t0)


# A transfer that moved nothing for this long (s) is a stall worth explaining.
STALL = 2.0


class Capture:
    """tcpdump of the NFS traffic on the server's bridge in namespace `ns`, into a file
    of directory `where`, from creation to stop(). The bridge sees a clone's frames past
    its tx limiter and the server's before its rx limiter."""

    def __init__(self, ns, where):
        fd, self.path = tempfile.mkstemp(dir=where, suffix=".pcap")
        os.close(fd)
        self.p = subprocess.Popen(["ip", "netns", "exec", ns, "tcpdump", "-i", "br0", "-n",
                                   "-s", "256", "-U", "-w", self.path, "tcp", "port", "2049"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        # tcpdump says it listens once its filter is in place.
        line = self.p.stderr.readline()
        if "listening" not in line:
            self.p.kill()
            self.p.wait()
            sys.exit(f"tcpdump did not start: {line}{self.p.stderr.read()}")

    def stop(self):
        self.p.terminate()
        self.p.wait(timeout=30)


def stall_frames(pcap, addr, t0, t1):
    """What crossed the bridge between clone `addr` and the server around its stall
    [t0, t1] (the host's clock, to a tap sample, 0.25 s): a line counting each side's
    frames during the stall, naming the last sender before it and each side's bytes in
    flight when it began, then the frames from 1 s before to 1 s after (times from t0).
    The server's bytes in flight wait in the clone's tap or guest, so a read stall with
    some is the clone's side (its limiter, VMM or guest); a stall with neither side's is
    whoever owes the next request or reply."""
    out = subprocess.run(["tcpdump", "-r", pcap, "-n", "-tt", "host", addr],
                         capture_output=True, text=True).stdout
    frames = []
    for line in out.splitlines():
        t, _, rest = line.partition(" ")
        try:
            frames.append((float(t), rest))
        except ValueError:
            continue
    # The tap sample that last saw bytes move can be up to a sample after them.
    t0 -= 0.25
    before = [f for f in frames if f[0] < t0]
    during = [f for f in frames if t0 <= f[0] < t1]
    after = [f for f in frames if t1 <= f[0] < t1 + 1]
    sent = lambda fs, src: sum(r.startswith(f"IP {src}.") for _, r in fs)  # noqa: E731
    last = ("the clone" if before[-1][1].startswith(f"IP {addr}.") else "the server") \
        if before else "nobody"

    def in_flight(src, dst):
        """Bytes `src` had sent on the bridge before the stall and `dst` had not yet
        acknowledged (tcpdump's sequence numbers, relative per connection)."""
        end = max((int(m.group(1)) for _, r in before if r.startswith(f"IP {src}.")
                   for m in [re.search(r"seq \d+:(\d+)", r)] if m), default=0)
        acked = max((int(m.group(1)) for _, r in before if r.startswith(f"IP {dst}.")
                     for m in [re.search(r"ack (\d+)", r)] if m), default=0)
        return max(end - acked, 0)

    lines = [f"during the stall the clone sent {sent(during, addr)} frames and the server "
             f"{sent(during, SERVER)}; the last frame before it was from {last}; in flight "
             f"when it began (sent on the bridge, not acknowledged): the clone's "
             f"{in_flight(addr, SERVER)} B, the server's {in_flight(SERVER, addr)} B"]
    shown = [f for f in before if f[0] >= t0 - 1][-6:] + during[:6] + during[6:][-3:] + after[:4]
    lines += [f"{t - t0:+7.2f} s  {r[:150]}" for t, r in shown]
    return lines


def phase(clones, nbytes, cmd_of, ns=None, taps=None, counter=None, prep="", capture=None):
    """Runs cmd_of(i), which moves `nbytes`, in every clone at once, each starting at the
    same wall-clock second (the clones' clocks are the host's), after `prep` (shell,
    outside the timed window). Returns a dict: `rates`,
    each clone's file data in B/s; with `counter` (eth0's rx_bytes or tx_bytes) `link`,
    the bytes of the frames its card counted over the same time in B/s (what the
    limiter let through); with `taps` (the clones' taps in namespace `ns`) `drops`, the
    frames the taps dropped for want of room, and `retrans`, the server's TCP
    retransmissions; `cpu`, the share of the host's CPU time that was busy meanwhile
    (from the second the clones start at to the last one's end). With `capture` (a
    directory) and `taps`, the NFS traffic on the bridge is recorded and `stalls` lists,
    for each clone whose transfer stalled for STALL s or more, what crossed the bridge
    around its stall (stall_frames)."""
    start = int(time.time()) + lead(len(clones))
    net0 = net_counts(ns) if taps else None
    done = in_every(clones, start, lambda i: timed(cmd_of(i), counter), prep)
    time.sleep(max(0.0, start - time.time()))
    cpu0 = host_cpu()
    rx = counter == "tx_bytes"
    socks = [c["api_sock"] for c in clones]
    sampler = TapSampler(ns, socks, "tx" if rx else "rx") if taps else None
    pcap = None
    try:
        # Started as the clones start (their dd's first bytes come a second or more
        # later), inside the try so that it is stopped whatever happens.
        pcap = Capture(ns, capture) if capture and taps else None
        outs = done()
    finally:
        if sampler:
            sampler.stop()
        if pcap:
            pcap.stop()
        net1 = net_counts(ns) if taps else None
    cpu1 = host_cpu()
    res = {"rates": [], "link": [] if counter else None,
           "cpu": 1 - (cpu1[0] - cpu0[0]) / max(cpu1[1] - cpu0[1], 1)}
    windows = []
    for out in outs:
        m = UPTIME.search(out)
        if not m:
            raise RuntimeError(f"no timing in {out!r}")
        took = max(float(m.group(2)) - float(m.group(1)), 0.01)
        res["rates"].append(nbytes / took)
        if counter:
            res["link"].append((int(m.group(4)) - int(m.group(3))) / took)
        off = guest_to_host(out)
        if off is None:
            print(f"  no clock line in {out!r}", file=sys.stderr)
        windows.append((off + float(m.group(1)), off + float(m.group(2)))
                       if off is not None else None)
    if taps:
        # The guest's tx_bytes went out through its tap (the tap's rx), rx_bytes in.
        st = [sampler.steady(t, rx, sk) for t, sk in zip(taps, socks)]
        for i, key in enumerate(("steady", "unused", "late")):
            res[key] = [x[i] if x else None for x in st]
        res["window"] = [sampler.window(t, rx, sk, *w) if w else None
                         for t, sk, w in zip(taps, socks, windows)]
        if pcap:
            res["stalls"] = [
                (i, w["gap"], stall_frames(pcap.path, c["net"]["ipv4"].split("/")[0],
                                           w["gap_at"], w["gap_at"] + w["gap"]))
                for i, (c, w) in enumerate(zip(clones, res["window"]))
                if w and w["gap"] >= STALL]
        res["drops"] = sum(net1[t] - net0[t] for t in taps)
        res["retrans"] = net1["tcp-retrans"] - net0["tcp-retrans"]
    return res


def measure(work, ns, label, limit, counts, kib, with_disk, idles, opts=OPTS, capture=None):
    """The rows of one configuration; appends (label, count, host CPU busy) with the
    clones asleep to `idles`."""
    tap = f"fkb{os.getpid() % 10000000}"
    export = os.path.join(work, "export")
    src = f"{SERVER}:{export}"
    script = (f"forkvm-clone --net; until ping -c1 -W1 {SERVER} >/dev/null 2>&1; "
              f"do sleep 1; done; mkdir -p /mnt/nfs && mount -t nfs -o {opts} {src} /mnt/nfs "
              f"&& mount -o remount,rw /mnt/disk && sync && echo nfs-up")
    # The label as a file name (a limit such as bytes=8K/4000 holds a slash).
    name = re.sub(r"[^A-Za-z0-9]", "-", label)
    sock = os.path.join(work, name + ".sock")
    console = sock + ".console"
    cowdir = os.path.join(work, "cow")
    os.makedirs(cowdir, exist_ok=True)
    cmdline = (f'console=ttyS0 reboot=k panic=-1 quiet forkvm.agent=1024 '
               f'forkvm.run="{script}"')
    p = subprocess.Popen([VMM, "run", "--kernel", os.path.join(GUEST, "vmlinux"), "--initrd",
                          os.path.join(GUEST, "initramfs.cpio"), "--mem-mib", "256",
                          "--disk", f"{os.path.join(work, 'disk.ext4')},cow={cowdir}",
                          "--tap", tap, "--ipv4", "10.79.0.2/24", "--gateway", SERVER,
                          "--vsock", sock + ".vsock", "--cmdline", cmdline,
                          "--console", console, "--api-sock", sock],
                         stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                         stderr=open(sock + ".log", "w"))
    rows = []
    try:
        wait_for(f"{tap}", lambda: os.path.exists(f"/sys/class/net/{tap}"), 30)
        for args in (["link", "set", tap, "netns", ns], ["-n", ns, "link", "set", tap, "master",
                                                         "br0"], ["-n", ns, "link", "set", tap, "up"]):
            ip(*args)
        wait_for("the template's mount", lambda: os.path.exists(console) and
                 "forkvm-init: serving on vsock port" in open(console).read(), 900)
        if "nfs-up" not in open(console).read():
            sys.exit(f"the template did not mount: {open(console).read()[-2000:]}")
        code, body = api(sock, "PATCH", "/vm", '{"state":"paused"}')
        assert code == 204, body
        for n in counts:
            req = {"count": n, "console": "null",
                   "addresses": [{"ipv4": f"10.79.0.{10 + i}/24"} for i in range(1, n + 1)]}
            if limit:
                req["rate_limits"] = {"net": limit}
            code, body = api(sock, "POST", "/clones", json.dumps(req))
            assert code == 201, body
            clones = json.loads(body)["clones"]
            taps = [c["net"]["tap"] for c in clones]
            for t in taps:
                wait_for(t, lambda t=t: os.path.exists(f"/sys/class/net/{t}"), 30)
                ip("link", "set", t, "netns", ns)
                ip("-n", ns, "link", "set", t, "master", "br0")
                ip("-n", ns, "link", "set", t, "up")
            # Adoption (address, connections) and a first NFS request, unmeasured.
            for c in clones:
                vmm_exec(c["api_sock"], "ls /mnt/nfs >/dev/null")
            count, nbytes = kib // 64, kib << 10
            tag = f"{name}-{n}"
            w = phase(clones, nbytes, lambda i: f"dd if=/dev/zero of=/mnt/nfs/{tag}-{i} "
                      f"bs=64k count={count} conv=fsync", ns, taps, "tx_bytes", capture=capture)
            r = phase(clones, nbytes, lambda i: f"dd if=/mnt/nfs/{tag}-{i} of=/dev/null bs=64k",
                      ns, taps, "rx_bytes", DROP, capture)
            # What the clones cost the host while they do nothing (their kernels' timers,
            # the server, the VMMs): the floor under the phases' CPU figures.
            idle, top = asleep(clones)
            print(f"  asleep, the most CPU: {top}", file=sys.stderr)
            rows.append((label, n, "NFS write", w))
            rows.append((label, n, "NFS read", r))
            if with_disk:
                dw = phase(clones, nbytes, lambda i: f"dd if=/dev/zero "
                           f"of=/mnt/disk/{tag}-{i} bs=64k count={count} conv=fsync")
                dr = phase(clones, nbytes, lambda i: f"dd if=/mnt/disk/{tag}-{i} of=/dev/null "
                           "bs=64k", prep=DROP)
                rows.append((label, n, "private disk write", dw))
                rows.append((label, n, "private disk read", dr))
            print(f"  {label}, {n} clones asleep: host CPU {idle:.0%} busy", file=sys.stderr)
            idles.append((label, n, idle))
            for row in rows[-(4 if with_disk else 2):]:
                kibs = lambda k: [round((x or 0) / 1024, 2) for x in row[3][k]]  # noqa: E731
                link = (f", link {kibs('link')}, steady {kibs('steady')}, limiter unused "
                        f"{kibs('unused')}, late {kibs('late')}" if row[3]["link"] else "")
                parts = ("before", "ramp", "steady", "tail", "after", "gap")
                windows = (", windows (s: " + "/".join(parts) + ") " + " ".join(
                    "/".join(f"{w[k]:.1f}" for k in parts) if w else "?"
                    for w in row[3]["window"]) if row[3].get("window") else "")
                print(f"  {row[0]}, {row[1]} clones, {row[2]}: "
                      f"{[round(x / 1024, 2) for x in row[3]['rates']]} KiB/s{link}, "
                      f"host CPU {row[3]['cpu']:.0%} busy{windows}",
                      file=sys.stderr)
            for c in clones:
                api(sock, "DELETE", f"/clones/{c['id']}")
    finally:
        try:
            api(sock, "PUT", "/actions", '{"action_type":"shutdown"}')
            p.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            p.kill()
            p.wait()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--counts", default="1,2,4,8")
    ap.add_argument("--kib", type=int, default=4096,
                    help="KiB each clone writes and reads (a multiple of 64)")
    ap.add_argument("--limit", default="bytes=128K",
                    help="the per-clone network rate limit of the limited configuration")
    ap.add_argument("--rwsize", type=int,
                    help="rsize and wsize of the mount (default: as client and server agree)")
    ap.add_argument("--limited-only", action="store_true",
                    help="run the limited configuration only (a second limit after a "
                         "whole run showed the fair shares)")
    ap.add_argument("--capture", action="store_true",
                    help="record the NFS traffic on the server's bridge (tcpdump) and, for "
                         f"every clone whose transfer stalled {STALL:.0f} s or more, show "
                         "which side sent last and what each sent during the stall")
    a = ap.parse_args()
    if a.capture and not shutil.which("tcpdump"):
        sys.exit("--capture needs tcpdump (apt-get install tcpdump)")
    if os.geteuid() != 0:
        sys.exit("benches/nfs.py needs root (taps, namespaces, the NFS server)")
    for f in (VMM, os.path.join(GUEST, "vmlinux"), "/usr/bin/ganesha.nfsd"):
        if not os.path.exists(f):
            sys.exit(f"{f} missing: make release guest deps")
    counts = [int(c) for c in a.counts.split(",")]
    if a.kib < 64 or a.kib % 64:
        sys.exit("--kib takes a multiple of 64")
    ns = f"fkvm-bench-{os.getpid()}-nfs"
    work = tempfile.mkdtemp(prefix="forkvm-nfsbench-", dir="/var/tmp")
    server = None
    rows, idles = [], []
    try:
        ip("netns", "add", ns)
        ip("-n", ns, "link", "set", "lo", "up")
        # A fixed MAC, not its lowest port's (docs/clone-network.md).
        ip("-n", ns, "link", "add", "br0", "address", "02:00:0a:4f:00:01", "type", "bridge")
        ip("-n", ns, "addr", "add", f"{SERVER}/24", "dev", "br0")
        ip("-n", ns, "link", "set", "br0", "up")
        os.makedirs(os.path.join(work, "export"))
        disk = os.path.join(work, "disk.ext4")
        subprocess.run(["truncate", "-s", f"{max(counts) * a.kib * 2 // 1024 + 64}M", disk], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", disk], check=True)
        server = start_server(ns, work, os.path.join(work, "export"))
        opts = OPTS + (f",rsize={a.rwsize},wsize={a.rwsize}" if a.rwsize else "")
        capture = work if a.capture else None
        if not a.limited_only:
            rows += measure(work, ns, "unlimited", None, counts, a.kib, True, idles, opts,
                            capture)
        rows += measure(work, ns, a.limit, a.limit, counts, a.kib, False, idles, opts,
                        capture)
    finally:
        if server:
            stop_server(server)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nPer-clone throughput, {a.kib} KiB each, 256 MiB Linux clones of one paused "
          f"template, all at once (KiB/s; data: the file's bytes over the clone's own timing "
          f"of dd; link: the frame bytes its card counted over the same time, which is what "
          f"the limiter let through; the host's CPU over the phase):\n")
    print("| limit | clones | what | data min | data median | data max | data total "
          "| link min | link max | steady min | steady max | unused max | late max "
          "| tap drops | server retransmits | host CPU busy |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    kib = lambda x: f"{x / 1024:.2f}"  # noqa: E731
    for label, n, what, res in rows:
        rates = res["rates"]
        link = (f"{kib(min(res['link']))} | {kib(max(res['link']))}" if res["link"] else " | ")
        tap = f"{res['drops']} | {res['retrans']}" if "drops" in res else " | "
        steady = [x for x in res.get("steady") or [] if x]
        steady = f"{kib(min(steady))} | {kib(max(steady))}" if steady else " | "
        lost = [max((x for x in res.get(k) or [] if x is not None), default=None)
                for k in ("unused", "late")]
        steady += " | " + " | ".join(kib(x) if x is not None else "" for x in lost)
        print(f"| {label} | {n} | {what} | {kib(min(rates))} | {kib(statistics.median(rates))} "
              f"| {kib(max(rates))} | {kib(sum(rates))} | {link} | {steady} | {tap} "
              f"| {res['cpu']:.0%} |")
    print("\nHost CPU busy while the clones sleep 15 s (the floor under the column above): " +
          ", ".join(f"{label} {n} clones {cpu:.0%}" for label, n, cpu in idles))
    rate = limit_rate(a.limit)
    limited = [res for label, _, _, res in rows if label == a.limit and res["link"]]
    if rate and limited:
        off = lambda key: max(abs((x or 0) - rate) / rate  # noqa: E731
                              for res in limited for x in res[key])
        steady, link = off("steady"), off("link")
        print(f"\nGoal (every clone within 10% of R = {rate / 1024:.2f} KiB/s at every count, "
              f"by its steady rate: what its limiter passed while it transferred): "
              f"{'met' if steady <= 0.10 else 'NOT met'}, worst {steady:.1%} off. Over dd's "
              f"whole window (its process start and the last COMMIT included), the link rate's "
              f"worst is {link:.1%} off.")
        for label, n, what, res in rows:
            for i, x in enumerate(res.get("steady") or []):
                if label == a.limit and x is not None and abs(x - rate) / rate > 0.10:
                    unused, late = res["unused"][i], res["late"][i]
                    print(f"  {n} clones, {what}, clone {i}: steady {kib(x)} KiB/s; over the "
                          f"same span its limiter had no frame for "
                          f"{kib(unused) if unused is not None else '?'} KiB/s of tokens "
                          f"(the transfer did not keep up) and lost "
                          f"{kib(late) if late is not None else '?'} KiB/s while a frame "
                          f"waited (the VMM's worker came late)")
        for label, n, what, res in rows:
            for i, x in enumerate(res["link"] if label == a.limit and res["link"] else []):
                if x < 0.9 * rate:
                    explain_window(f"{n} clones, {what}, clone {i}", x, parse_limit(a.limit),
                                   (res.get("window") or [None] * n)[i])
    for label, n, what, res in rows:
        for i, gap, lines in res.get("stalls") or []:
            print(f"  {label}, {n} clones, {what}, clone {i}: stalled {gap:.1f} s; "
                  + "\n      ".join(lines))
    for n in counts:
        fair = [sum(res["rates"]) / n for label, c, what, res in rows
                if label == "unlimited" and c == n and what.startswith("NFS")]
        if fair and rate:
            print(f"  {n} clones: fair share of the unlimited NFS total "
                  f"{min(fair) / 1024:.1f} KiB/s per clone; R is "
                  f"{'below' if rate < min(fair) else 'NOT below'} it")


def explain_window(who, link, limit, w):
    """Prints where the time of a clone's dd window went (TapSampler.window), for a link
    rate `link` more than 10% below the rate of `limit` (rate, bucket)."""
    rate, bucket = limit
    if not w:
        print(f"  {who}: link {link / 1024:.2f} KiB/s over dd's window; its window could "
              f"not be placed on the host's clock")
        return
    span = sum(w[k] for k in ("before", "ramp", "steady", "tail", "after"))
    lim = (f"; its limiter over the window: frames waited {w['throttled']:.1f} s, unused "
           f"{w['unused'] / 1024:.1f} KiB, late {w['late'] / 1024:.1f} KiB"
           if "unused" in w else "")
    print(f"  {who}: link {link / 1024:.2f} KiB/s over dd's window of {span:.1f} s: "
          f"{w['before']:.1f} s before 1% of its {w['moved'] / 1024:.0f} KiB moved, "
          f"{w['ramp']:.1f} s to 10%, {w['steady']:.1f} s to 90%, {w['tail']:.1f} s to 99%, "
          f"{w['after']:.1f} s after (1% to 99% at R after a full bucket: "
          f"{max(0.98 * w['moved'] - bucket, 0) / rate:.1f} s); "
          f"longest stall between 1% and 99% {w['gap']:.1f} s{lim}")


def parse_limit(text):
    """(B/s, bucket bytes) of a `bytes=SIZE[/MS]` limit (K and M in 1024s), or None."""
    m = re.search(r"bytes=([0-9]+)([KM]?)(?:/([0-9]+))?", text)
    if not m:
        return None
    size = int(m.group(1)) * {"": 1, "K": 1024, "M": 1 << 20}[m.group(2)]
    return size * 1000 / int(m.group(3) or 1000), size


def limit_rate(text):
    """B/s of a `bytes=SIZE[/MS]` limit, or None."""
    limit = parse_limit(text)
    return limit[0] if limit else None


if __name__ == "__main__":
    main()
