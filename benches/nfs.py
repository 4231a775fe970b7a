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

Each clone's rate is the bytes moved over the time the guest measured around dd
(/proc/uptime, 10 ms steps): file data only. For the NFS phases the clone's tap
counters are sampled every 0.2 s inside the namespace: its frame rate is the bytes of
the frames the limiter counts (tap rx for writes, tx for reads; Ethernet, IP, TCP and
RPC headers included) over the time they moved: the middle 90% of the bytes over the
time between the samples that passed 5% and 95%. For writes (tap rx: what the VMM let out through the
limiter) that is the rate a per-clone limit R is judged by. For reads the tap's tx
counter counts frames as the server's stack queues them into the tap, before the
limiter takes them out, retransmissions included; the server's TCP retransmissions and
the taps' drops are counted beside. The configurations run one after the other in one
run: unlimited, then --limit (--limited-only: the limit alone).

usage: benches/nfs.py [--counts 1,2,4,8] [--kib 4096] [--limit bytes=128K] [--limited-only] [--rwsize N]
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


def vmm_exec(sock, cmd):
    out = subprocess.run([VMM, "exec", "--api-sock", sock, "--timeout", "900", "--", cmd],
                         capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if out.returncode != 0:
        raise RuntimeError(f"`{cmd}` in {sock}: {out.returncode} {out.stdout} {out.stderr}")
    return out.stdout


UPTIME = re.compile(r"^took ([0-9.]+) ([0-9.]+)$", re.M)


def timed(cmd):
    """`cmd` in the guest between two readings of /proc/uptime (10 ms steps; busybox's
    dd prints no time)."""
    up = "cut -d' ' -f1 /proc/uptime"
    return f"t0=$({up}); {cmd} >/dev/null 2>&1 || exit 1; echo took $t0 $({up})"


SAMPLER = """import time
while True:
    t = time.monotonic()
    rows = [l.replace(':', ' ', 1).split() for l in open('/proc/net/dev').read().splitlines()[2:]]
    snmp = [l.split() for l in open('/proc/net/snmp') if l.startswith('Tcp:')]
    retrans = snmp[1][snmp[0].index('RetransSegs')]
    print(t, ' '.join(r[0] + '=' + r[1] + ',' + r[9] + ',' + r[12] for r in rows),
          'tcp-retrans=' + retrans + ',0,0', flush=True)
    time.sleep(0.2)
"""


class Sampler:
    """Every tap's rx and tx byte counters and tx drops (frames for the guest the tap's
    queue had no room for) in namespace `ns`, sampled every 0.2 s by one Python process
    inside it (CLOCK_MONOTONIC, as this process reads it), and the namespace's TCP
    retransmissions (the server's: the clients are in the guests) as `tcp-retrans`."""

    def __init__(self, ns):
        self.p = subprocess.Popen(["ip", "netns", "exec", ns, "python3", "-u", "-c", SAMPLER],
                                  stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, text=True)

    def stop(self):
        """The samples: [(t, {dev: (rx, tx, tx_dropped)})]."""
        self.p.terminate()
        out, _ = self.p.communicate()
        samples = []
        for line in out.splitlines():
            t, *devs = line.split(" ")
            try:
                counts = {}
                for d in devs:
                    name, _, v = d.partition("=")
                    rx, tx, drops = v.split(",")
                    counts[name] = (int(rx), int(tx), int(drops))
                samples.append((float(t), counts))
            except ValueError:
                pass  # the last line, cut short by the terminate
        return samples


def active_rate(samples, dev, which):
    """`dev`'s counter `which` (0: rx, 1: tx) over the time its bytes moved: the middle
    90% of what it moved over the phase, from the first sample past 5% to the first past
    95% (a stray frame before or after, an ARP, does not stretch the time); B/s, or
    None."""
    series = [(t, c[dev][which]) for t, c in samples if dev in c]
    if len(series) < 2 or series[-1][1] == series[0][1]:
        return None
    v0, total = series[0][1], series[-1][1] - series[0][1]
    lo = next((t, v) for t, v in series if v - v0 >= 0.05 * total)
    hi = next((t, v) for t, v in series if v - v0 >= 0.95 * total)
    if hi[0] <= lo[0]:
        return None
    return (hi[1] - lo[1]) / (hi[0] - lo[0])


def phase(clones, nbytes, cmd_of, ns=None, taps=None):
    """Runs cmd_of(i), which moves `nbytes`, in every clone at once, each starting at the
    same wall-clock second (the clones' clocks are the host's); returns (each clone's
    rate in B/s, its tap's frame rate in B/s while it moved or None, and (the frames
    the taps dropped for want of room, the server's TCP retransmissions) or None). `taps`: each clone's (tap, 0 for rx or 1 for tx)
    in namespace `ns`."""
    start = int(time.time()) + 4 + len(clones)
    sampler = Sampler(ns) if taps else None
    procs = []
    for i, c in enumerate(clones, 1):
        wait = f"while [ $(date +%s) -lt {start} ]; do sleep 0.05; done; "
        procs.append(subprocess.Popen(
            [VMM, "exec", "--api-sock", c["api_sock"], "--timeout", "900", "--",
             wait + timed(cmd_of(i))],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            stdin=subprocess.DEVNULL))
    outs = []
    try:
        for p in procs:
            out, err = p.communicate()
            if p.returncode != 0:
                raise RuntimeError(f"clone exec failed: {out} {err}")
            outs.append(out)
    finally:
        samples = sampler.stop() if sampler else None
    rates = []
    for out in outs:
        m = UPTIME.search(out)
        if not m:
            raise RuntimeError(f"no timing in {out!r}")
        rates.append(nbytes / max(float(m.group(2)) - float(m.group(1)), 0.01))
    frames = drops = None
    if taps:
        # Each tap over the time its own frames moved: the rate the limiter let through.
        frames = [active_rate(samples, t, which) or 0.0 for t, which in taps]
        whole = [c for _, c in samples if all(t in c for t, _ in taps)]
        drops = sum(whole[-1][t][2] - whole[0][t][2] for t, _ in taps)
        retrans = [c["tcp-retrans"][0] for _, c in samples if "tcp-retrans" in c]
        drops = (drops, retrans[-1] - retrans[0])
    return rates, frames, drops


def measure(work, ns, label, limit, counts, kib, with_disk, opts=OPTS):
    tap = f"fkb{os.getpid() % 10000000}"
    export = os.path.join(work, "export")
    src = f"{SERVER}:{export}"
    script = (f"forkvm-clone --net; until ping -c1 -W1 {SERVER} >/dev/null 2>&1; "
              f"do sleep 1; done; mkdir -p /mnt/nfs && mount -t nfs -o {opts} {src} /mnt/nfs "
              f"&& mount -o remount,rw /mnt/disk && sync && echo nfs-up")
    sock = os.path.join(work, f"{label}.sock")
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
            tag = f"{label}-{n}"
            w, wf, wd = phase(clones, nbytes, lambda i: f"dd if=/dev/zero of=/mnt/nfs/{tag}-{i} "
                          f"bs=64k count={count} conv=fsync",
                          ns, [(t, 0) for t in taps])
            r, rf, rd = phase(clones, nbytes, lambda i: f"echo 3 > /proc/sys/vm/drop_caches; "
                          f"dd if=/mnt/nfs/{tag}-{i} of=/dev/null bs=64k",
                          ns, [(t, 1) for t in taps])
            rows.append((label, n, "NFS write", w, wf, wd))
            rows.append((label, n, "NFS read", r, rf, rd))
            if with_disk:
                dw, _, _ = phase(clones, nbytes, lambda i: f"dd if=/dev/zero "
                              f"of=/mnt/disk/{tag}-{i} bs=64k count={count} conv=fsync")
                dr, _, _ = phase(clones, nbytes, lambda i: f"echo 3 > /proc/sys/vm/drop_caches; "
                              f"dd if=/mnt/disk/{tag}-{i} of=/dev/null bs=64k")
                rows.append((label, n, "private disk write", dw, None, None))
                rows.append((label, n, "private disk read", dr, None, None))
            for row in rows[-(4 if with_disk else 2):]:
                print(f"  {row[0]}, {row[1]} clones, {row[2]}: "
                      f"{[round(x / 1024) for x in row[3]]} KiB/s", file=sys.stderr)
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
    a = ap.parse_args()
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
    rows = []
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
        if not a.limited_only:
            rows += measure(work, ns, "unlimited", None, counts, a.kib, True, opts)
        rows += measure(work, ns, a.limit, a.limit, counts, a.kib, False, opts)
    finally:
        if server:
            stop_server(server)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)
    print(f"\nPer-clone throughput, {a.kib} KiB each, 256 MiB Linux clones of one paused "
          f"template, all at once (KiB/s, each clone's own timing; frames: the clone's tap bytes "
          f"over the time they moved):\n")
    print("| limit | clones | what | min | median | max | total | frames min | frames max "
          "| tap drops | server retransmits |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, n, what, rates, frames, drops in rows:
        fr = (f"{min(frames) / 1024:.1f} | {max(frames) / 1024:.1f} | {drops[0]} | {drops[1]}"
              if frames else " | | | ")
        print(f"| {label} | {n} | {what} | {min(rates) / 1024:.1f} | "
              f"{statistics.median(rates) / 1024:.1f} | {max(rates) / 1024:.1f} | "
              f"{sum(rates) / 1024:.1f} | {fr} |")
    rate = limit_rate(a.limit)
    limited = [(n, what, f) for label, n, what, _, f, _ in rows if label == a.limit and f]
    if rate and limited:
        worst = max(abs(x - rate) / rate for _, _, f in limited for x in f)
        print(f"\nGoal (every clone's frame rate within 10% of R = {rate / 1024:.1f} KiB/s at "
              f"every count): {'met' if worst <= 0.10 else 'NOT met'}, worst {worst:.1%} off")
    for n in counts:
        fair = [sum(r) / n for label, c, what, r, _, _ in rows
                if label == "unlimited" and c == n and what.startswith("NFS")]
        if fair and rate:
            print(f"  {n} clones: fair share of the unlimited NFS total "
                  f"{min(fair) / 1024:.1f} KiB/s per clone; R is "
                  f"{'below' if rate < min(fair) else 'NOT below'} it")


def limit_rate(text):
    """B/s of a `bytes=SIZE[/MS]` limit (K and M in 1024s), or None."""
    m = re.search(r"bytes=([0-9]+)([KM]?)(?:/([0-9]+))?", text)
    if not m:
        return None
    size = int(m.group(1)) * {"": 1, "K": 1024, "M": 1 << 20}[m.group(2)]
    return size * 1000 / int(m.group(3) or 1000)


if __name__ == "__main__":
    main()
