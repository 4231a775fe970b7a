#!/usr/bin/env python3
"""Clone benchmarks with the tiny guest.

latency: for each guest memory size (all of it touched: --prefault), with and without
  transparent huge pages, and for a running template, a paused one, and a paused one
  with warm clones (--warm-clones), clone the template N times, one clone per request, and
  record (a) the VMM's own figure, from the request reaching the VMM to the clone's
  vCPU 0 entering the guest, and (b) end to end, from the client sending POST /clones
  to the answer (the clone's guest is running and its socket is up). Each clone is
  deleted before the next. A cold boot of the same guest (process start to first serial
  line) is measured in the same run for comparison.
fanout: time to create 100 / 1000 clones of a 256 MiB template in one request, and the
  proportional set size (PSS) of each clone process.

e2e: from the client sending POST /clones to the clone's guest code running (the
  template's guest writes the probe port in a loop; the clone's first write is timed).
sandbox: clone latency of a running template without seccomp filters, with them (the
  default), and jailed (jailer: filters, namespaces, unprivileged user), interleaved;
  the VMM's figure and end to end to the clone's first guest port write (as e2e).
devices: clone latency of a running Linux template (its drivers have set the devices
  up, so every clone restores running devices and starts their workers) without virtio
  devices, with a root disk and an entropy device, and with those plus vsock and a
  network card, one boot per row and round, rounds interleaved; --gap MS waits after
  each clone's deletion (the host kernel's teardown of the exited clone slows the next
  clone's VM creation when requests follow back to back).

ab: two builds side by side (--baseline VMM, another build's binary, against this one),
  in interleaved rounds: clone latency of a running, a paused and a warm template
  (--mem MiB), and the wall time of one N-clone fan-out (--fanout N, 256 MiB) per round.

usage: benches/clone.py latency [--runs N] [--mem 128,512,2048,4096] [--modes running,paused,warm]
       benches/clone.py ab --baseline VMM [--runs N] [--rounds R] [--mem MIB] [--fanout N]
       benches/clone.py fanout [--counts 100,1000] [--dirs /tmp,/dev/shm] [--rounds N]
       benches/clone.py e2e [--runs N] [--modes running,paused,warm]
       benches/clone.py sandbox [--runs N] [--rounds R] [--mem MIB]   (root)
       benches/clone.py devices [--runs N] [--rounds R] [--gap MS]
       benches/clone.py vsock [--runs N]
vsock: a running Linux template with a vsock device and forkvm-agent; each run makes one
  clone and runs `true` in it through its own vsock socket (vmm exec's protocol): clone
  latency, first answer from the clone (the agent adopts the clone's identity first),
  the two together from the client's side, and a second `true` in the same clone.
"""
import argparse
import json
import os
import select
import socket
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "target/guest/tiny.elf")
GUEST = os.path.join(ROOT, "target/guest")
VMM = os.path.join(ROOT, "target/release/vmm")
JAILER = os.path.join(ROOT, "target/release/jailer")
JAIL_ID = 60123


def api(sock, method, path, body=None, timeout=600):
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(timeout)
    s.connect(sock)
    data = body or ""
    s.sendall(f"{method} {path} HTTP/1.1\r\nContent-Length: {len(data)}\r\n\r\n{data}".encode())
    out = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        out += chunk
    s.close()
    head, _, body = out.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


TEMPLATES = 0


def start_template(tmp, mem, thp, prefault=True, guest="ticks=1 tickless=1",
                   ready=b"tiny: tickless", warm=0, extra=(), jail=False, kernel=TINY,
                   boot_timeout=120):
    """Starts a template; with jail, under the jailer (uid/gid JAIL_ID, the kernel bound
    at /tiny.elf, its socket and console in the jail's root)."""
    global TEMPLATES
    TEMPLATES += 1
    name = f"t{TEMPLATES}-{mem}{'h' if thp else 'n'}"
    if jail:
        root = os.path.join(tmp, "jails", "vmm", name, "root")
        sock, console = os.path.join(root, "api.sock"), os.path.join(root, "console")
        cmd = [JAILER, "--id", name, "--exec-file", VMM, "--uid", str(JAIL_ID),
               "--gid", str(JAIL_ID), "--chroot-base", os.path.join(tmp, "jails"),
               "--file", TINY, "--cgroup-parent", f"forkvm-bench-{os.getpid()}", "--",
               "run", "--kernel", "/tiny.elf", "--console", "/console",
               "--api-sock", "/api.sock"]
    else:
        sock = os.path.join(tmp, name + ".sock")
        console = sock + ".console"
        cmd = [VMM, "run", "--kernel", kernel, "--console", console, "--api-sock", sock]
    cmd += ["--mem-mib", str(mem), "--cmdline", guest]
    if prefault:
        cmd.append("--prefault")
    if not thp:
        cmd.append("--no-thp")
    if warm:
        cmd += ["--warm-clones", str(warm)]
    cmd += list(extra)
    p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
    deadline = time.time() + boot_timeout
    while time.time() < deadline:
        try:
            if ready in open(console, "rb").read():
                return p, sock
        except FileNotFoundError:
            pass
        if p.poll() is not None:
            sys.exit(f"template exited with {p.returncode}")
        time.sleep(0.01)
    p.kill()
    sys.exit("template did not come up")


def stop_template(p, sock):
    api(sock, "PUT", "/actions", '{"action_type":"shutdown"}')
    p.wait(timeout=60)


def cold_boot(mem):
    start = time.perf_counter()
    p = subprocess.Popen([VMM, "run", "--kernel", TINY, "--mem-mib", str(mem), "--cmdline",
                          "ticks=1"], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    buf = b""
    try:
        while b"tiny: cpu 0 up" not in buf:
            r, _, _ = select.select([p.stdout], [], [], 10)
            if not r:
                raise RuntimeError("cold boot timed out")
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError("cold boot exited")
            buf += chunk
        return time.perf_counter() - start
    finally:
        p.kill()
        p.wait()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def row(label, xs_ms, base=None, digits=2):
    """A table row: min, median, p99 (with `digits` decimals); with base, the ratio of
    the median to it."""
    f = f".{digits}f"
    out = (f"| {label} | {min(xs_ms):{f}} | {statistics.median(xs_ms):{f}} | "
           f"{pct(xs_ms, 0.99):{f}} |")
    if base is not None:
        out += f" {statistics.median(xs_ms) / base:.2f}x |"
    return out


def latency(a):
    mems = [int(m) for m in a.mem.split(",")]
    print(f"Clone latency, tiny guest, 1 vCPU, all guest memory touched; {a.runs} clones "
          f"per row, one per request, each deleted before the next (ms):\n")
    print("| memory | THP | template | measure | min | median | p99 |")
    print("|---|---|---|---|---|---|---|")
    cold = {}
    with tempfile.TemporaryDirectory(prefix="forkvm-bench-") as tmp:
        for mem in mems:
            for thp in (True, False):
                for mode in a.modes.split(","):
                    vmm_ms, e2e_ms, note = clone_series(tmp, mem, thp, mode, a.runs)
                    th = "on" if thp else "off"
                    print(row(f"{mem} MiB | {th} | {mode} | request to clone vCPU 0 in guest{note}",
                              vmm_ms))
                    print(row(f"{mem} MiB | {th} | {mode} | client end to end", e2e_ms))
                    sys.stdout.flush()
            cold[mem] = [cold_boot(mem) * 1e3 for _ in range(max(10, a.runs // 10))]
            print(row(f"{mem} MiB | on | - | cold boot, process start to first line", cold[mem]))


# running: the template runs, each request pauses, captures, forks and resumes it.
# paused: the template is paused; its state is captured once and each request forks.
# warm: paused with --warm-clones 4: requests launch clones forked and prepared ahead.
MODES = ("running", "paused", "warm")
WARM = 4


def wait_warm(sock, n, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        _, body = api(sock, "GET", "/vm")
        if json.loads(body)["warm_clones"]["ready"] >= n:
            return
        time.sleep(0.002)
    sys.exit("warm clones were not refilled")


def clone_series(tmp, mem, thp, mode, runs, guest=None, ready=None, extra=(),
                 body='{"count":1}', jail=False, probe=None, gap=0.0, **template):
    """Clones a template `runs` times; with a `guest` that writes the probe port (probe
    unset or True), the second figure is to the clone's first port write. `gap`: seconds
    to wait after deleting a clone before the next request."""
    kw = {} if guest is None else {"guest": guest, "ready": ready}
    probe = guest is not None if probe is None else probe
    p, sock = start_template(tmp, mem, thp, warm=WARM if mode == "warm" else 0,
                             extra=extra, jail=jail, **kw, **template)
    # Paths the VMM reports are its own: inside a jail, under the jail's root.
    root = os.path.dirname(sock) if jail else "/"

    def host(path):
        return os.path.join(root, path.lstrip("/")) if jail else path
    vmm_ms, e2e_ms, guest_ms = [], [], []
    try:
        if mode != "running":
            api(sock, "PATCH", "/vm", '{"state":"paused"}')
        for _ in range(runs):
            if mode == "warm":
                # Requests spaced out: the pool is full and its refill is not competing
                # for the CPUs with the clone being launched.
                wait_warm(sock, WARM)
            t_ns = time.monotonic_ns()
            t = time.perf_counter()
            code, answer = api(sock, "POST", "/clones", body)
            e2e_ms.append((time.perf_counter() - t) * 1e3)
            if code != 201:
                sys.exit(f"clone failed: {code} {answer}")
            c = json.loads(answer)["clones"][0]
            vmm_ms.append(c["latency_us"] / 1e3)
            if probe:
                # The clone's guest may not have run yet when its socket is up (a busy
                # host): ask again until it has written the port.
                deadline = time.time() + 5
                while True:
                    _, vm = api(host(c["api_sock"]), "GET", "/vm")
                    first = json.loads(vm)["probe"]["first_write_ns"]
                    if first or time.time() > deadline:
                        break
                    time.sleep(0.001)
                if first == 0:
                    sys.exit(f"clone {c['id']} never wrote the probe port")
                guest_ms.append((first - t_ns) / 1e6)
            api(sock, "DELETE", f"/clones/{c['id']}")
            if os.path.isfile(host(c["console"])):
                os.unlink(host(c["console"]))
            time.sleep(gap)
        note = ""
        if mode == "warm":
            _, body = api(sock, "GET", "/vm")
            launched = json.loads(body)["warm_clones"]["launched"]
            note = f" ({launched}/{runs} from the pool)"
    finally:
        stop_template(p, sock)
    if probe:
        return vmm_ms, guest_ms, note
    return vmm_ms, e2e_ms, note


# sandbox: none = no seccomp filters, seccomp = the default filters, jailed = under the
# jailer (filters, namespaces, unprivileged user, pivot_root).
SANDBOX = {"none": {"extra": ["--seccomp", "off"]}, "seccomp": {},
           "jailed": {"jail": True}}


def sandbox(a):
    if os.geteuid() != 0:
        sys.exit("the jailed case needs root")
    print(f"Clone latency with and without the sandbox, running {a.mem} MiB tiny template, "
          f"{a.runs} clones per row in {a.rounds} interleaved rounds (ms; ratio of "
          f"medians to none):\n")
    print("| sandbox | measure | min | median | p99 | vs none |")
    print("|---|---|---|---|---|---|")
    got = {m: ([], []) for m in SANDBOX}
    with tempfile.TemporaryDirectory(prefix="forkvm-bench-") as tmp:
        os.chmod(tmp, 0o755)
        for _ in range(a.rounds):
            for mode, kw in SANDBOX.items():
                vmm_ms, e2e_ms, _ = clone_series(tmp, a.mem, True, "running",
                                                 a.runs // a.rounds,
                                                 guest="ticks=1 probespin=1",
                                                 ready=b"tiny: all 1 cpus ok", **kw)
                got[mode][0].extend(vmm_ms)
                got[mode][1].extend(e2e_ms)
    # The second includes the clone's first exit to the VMM (the probe port write),
    # where its vCPU thread installs its filter.
    for i, measure in enumerate(("request to clone vCPU 0 in guest",
                                 "client sends POST /clones to the clone's first port write")):
        base = statistics.median(got["none"][i])
        for mode in SANDBOX:
            xs = got[mode][i]
            print(row(f"{mode} | {measure}", xs, base))


def device_sets(tmp):
    """The device sets compared: none, disk+rng, and 2 disks (the read-only image and
    a writable scratch disk, each clone getting a copy of its overlay) + rng + vsock +
    a network card (a tap the template creates; every clone creates its own, needs
    root)."""
    disk_rng = ["--rootfs", os.path.join(GUEST, "rootfs.ext4"), "--rng"]
    scratch = os.path.join(tmp, "scratch.img")
    with open(scratch, "wb") as f:
        f.truncate(64 << 20)
    return {"none": [],
            "disk+rng": disk_rng,
            "2 disks+rng+vsock+net": disk_rng + [
                "--disk", f"{scratch},cow={tmp}",
                "--vsock", os.path.join(tmp, "t.vsock"),
                "--tap", f"fkb{os.getpid() % 100000000}"]}


def devices(a):
    print(f"Clone latency of a running 256 MiB Linux template without and with virtio "
          f"devices set up by its drivers, {a.runs} clones per row in {a.rounds} rounds, "
          f"{a.gap:g} ms between a clone's deletion and the next request "
          f"(ms; ratio of medians to none):\n")
    print("| devices | measure | min | median | p99 | vs none |")
    print("|---|---|---|---|---|---|")
    guest = ('console=ttyS0 reboot=k panic=-1 quiet '
             'forkvm.run="echo template-$((1+1)); sleep 1000000"')
    with tempfile.TemporaryDirectory(prefix="forkvm-bench-") as tmp:
        sets = device_sets(tmp)
        got = {m: ([], []) for m in sets}
        for _ in range(a.rounds):
            for name, extra in sets.items():
                vmm_ms, e2e_ms, _ = clone_series(
                    tmp, 256, True, "running", a.runs // a.rounds, guest=guest,
                    ready=b"template-2", probe=False, body='{"count":1,"console":"null"}',
                    extra=["--initrd", os.path.join(GUEST, "initramfs.cpio")] + extra,
                    kernel=os.path.join(GUEST, "vmlinux"), boot_timeout=600,
                    gap=a.gap / 1000)
                got[name][0].extend(vmm_ms)
                got[name][1].extend(e2e_ms)
    for i, measure in enumerate(("request to clone vCPU 0 in guest", "client end to end")):
        base = statistics.median(got["none"][i])
        for name in got:
            print(row(f"{name} | {measure}", got[name][i], base))


def vsock_exec(path, cmd, timeout=120):
    """One request to forkvm-agent through a VM's vsock socket; returns (status, output)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    f = s.makefile("rwb")
    f.write(b"CONNECT 1024\n")
    f.flush()
    ok = f.readline()
    if not ok.startswith(b"OK "):
        sys.exit(f"vsock: no agent answered: {ok!r}")
    f.write(f"{len(cmd)} 0\n{cmd}".encode())
    f.flush()
    status, n = f.readline().split()
    out = f.read(int(n))
    s.close()
    return int(status), out


def vsock(a):
    guest = 'console=ttyS0 reboot=k panic=-1 quiet forkvm.agent=1024'
    clone_ms, answer_ms, total_ms, second_ms = [], [], [], []
    with tempfile.TemporaryDirectory(prefix="forkvm-bench-") as tmp:
        p, sock = start_template(
            tmp, 256, True, guest=guest, ready=b"forkvm-init: serving on vsock port 1024\n",
            extra=["--initrd", os.path.join(GUEST, "initramfs.cpio"),
                   "--vsock", os.path.join(tmp, "t.vsock")],
            kernel=os.path.join(GUEST, "vmlinux"), boot_timeout=600)
        try:
            for _ in range(a.runs):
                t = time.perf_counter()
                code, answer = api(sock, "POST", "/clones", '{"count":1,"console":"null"}')
                t_clone = time.perf_counter()
                if code != 201:
                    sys.exit(f"clone failed: {code} {answer}")
                c = json.loads(answer)["clones"][0]
                status, _ = vsock_exec(c["vsock"], "true")
                t_answer = time.perf_counter()
                if status != 0:
                    sys.exit(f"clone {c['id']}: `true` exited {status}")
                status, _ = vsock_exec(c["vsock"], "true")
                second_ms.append((time.perf_counter() - t_answer) * 1e3)
                if status != 0:
                    sys.exit(f"clone {c['id']}: second `true` exited {status}")
                clone_ms.append((t_clone - t) * 1e3)
                answer_ms.append((t_answer - t_clone) * 1e3)
                total_ms.append((t_answer - t) * 1e3)
                api(sock, "DELETE", f"/clones/{c['id']}")
        finally:
            stop_template(p, sock)
    print(f"vsock request to a fresh clone of a running 256 MiB Linux template, "
          f"{a.runs} runs (ms):\n")
    print("| measure | min | median | p99 |")
    print("|---|---|---|---|")
    for label, xs in (("POST /clones answered (clone running)", clone_ms),
                      ("then `true` through the clone's vsock and agent", answer_ms),
                      ("clone + first answer, client side", total_ms),
                      ("a second `true` in the same clone", second_ms)):
        print(row(label, xs))


def e2e(a):
    print(f"End to end to the clone's guest code: the template's guest writes the probe "
          f"port in a tight loop (probespin=1), so a clone's first probe write marks when "
          f"its guest code ran again. From the client sending POST /clones to that write "
          f"(CLOCK_MONOTONIC on both sides), 128 MiB, {a.runs} clones one at a time (ms):\n")
    print("| template | measure | min | median | p99 |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="forkvm-bench-") as tmp:
        for mode in a.modes.split(","):
            vmm_ms, guest_ms, note = clone_series(
                tmp, 128, True, mode, a.runs, guest="ticks=1 probespin=1",
                ready=b"tiny: all 1 cpus ok")
            print(row(f"{mode} | request reaching the VMM to clone vCPU 0 in guest "
                      f"(VMM's figure){note}", vmm_ms))
            print(row(f"{mode} | client sends POST /clones to the clone's first guest port "
                      f"write", guest_ms))
            sys.stdout.flush()


def pss_kb(pid):
    try:
        for line in open(f"/proc/{pid}/smaps_rollup"):
            if line.startswith("Pss:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def fanout_once(tmp, n, while_up=None):
    """One POST /clones {count: n} on a running 256 MiB template: its wall time (ms), and
    what while_up(clones, template pid) returns, called while the clones run."""
    p, sock = start_template(tmp, 256, True)
    try:
        t = time.perf_counter()
        code, body = api(sock, "POST", "/clones", json.dumps({"count": n}))
        total = time.perf_counter() - t
        if code != 201:
            sys.exit(f"fan-out failed: {code} {body}")
        clones = json.loads(body)["clones"]
        bad = [c for c in clones if c["status"]["state"] != "running"]
        if bad:
            sys.exit(f"{len(bad)} clones did not start: {bad[:3]}")
        return total * 1e3, while_up(clones, p.pid) if while_up else None
    finally:
        stop_template(p, sock)


def ab(a):
    global VMM
    versions = {"baseline": os.path.abspath(a.baseline), "this build": VMM}
    modes = a.modes.split(",")
    print(f"A/B of two builds, interleaved rounds ({a.rounds}); clone latency of a {a.mem} MiB "
          f"tiny template, {a.runs} clones per row; one {a.fanout}-clone fan-out of a 256 MiB "
          f"template per round; sockets on /dev/shm (ms; ratio of medians to the baseline):\n")
    print(f"baseline: {versions['baseline']}\n")
    got = {(v, m): ([], []) for v in versions for m in modes}
    fan = {v: [] for v in versions}
    with tempfile.TemporaryDirectory(prefix="forkvm-bench-", dir="/dev/shm") as tmp:
        for _ in range(a.rounds):
            for v, path in versions.items():
                VMM = path
                for mode in modes:
                    vmm_ms, e2e_ms, _ = clone_series(tmp, a.mem, True, mode,
                                                     a.runs // a.rounds)
                    got[(v, mode)][0].extend(vmm_ms)
                    got[(v, mode)][1].extend(e2e_ms)
                if a.fanout:
                    fan[v].append(fanout_once(tmp, a.fanout)[0])
    print("| template | measure | build | min | median | p99 | vs baseline |")
    print("|---|---|---|---|---|---|---|")
    for mode in modes:
        for i, measure in enumerate(("request to clone vCPU 0 in guest", "client end to end")):
            base = statistics.median(got[("baseline", mode)][i])
            for v in versions:
                print(row(f"{mode} | {measure} | {v}", got[(v, mode)][i], base))
    if a.fanout:
        base = statistics.median(fan["baseline"])
        for v in versions:
            print(row(f"running, 256 MiB | {a.fanout}-clone fan-out, whole request | {v}",
                      fan[v], base))


def fanout(a):
    dirs = a.dirs.split(",") if a.dirs else [tempfile.gettempdir()]
    print("Fan-out: one POST /clones {count: N} on a running 256 MiB template (all memory "
          "touched), wall time until the answer (every clone's guest running, sockets up), "
          "and PSS per clone process; the template's socket (so every clone's socket and "
          f"console file) in each directory, {a.rounds} interleaved round(s):\n")
    print("| directory | clones | total | per clone | PSS per clone, median | template PSS |")
    print("|---|---|---|---|---|---|")
    totals = {}
    for _ in range(a.rounds):
        for d in dirs:
            with tempfile.TemporaryDirectory(prefix="forkvm-bench-", dir=d) as tmp:
                for n in [int(x) for x in a.counts.split(",")]:
                    def sizes(clones, template_pid):
                        time.sleep(0.5)
                        pss = [pss_kb(c["pid"]) for c in clones]
                        return [x for x in pss if x is not None], pss_kb(template_pid)
                    total, (pss, tpl) = fanout_once(tmp, n, sizes)
                    total /= 1e3
                    totals.setdefault((d, n), []).append(total * 1e3)
                    print(f"| {d} | {n} | {total*1e3:.0f} ms | {total*1e3/n:.2f} ms | "
                          f"{statistics.median(pss)/1024:.1f} MiB | {tpl/1024:.1f} MiB |")
                    sys.stdout.flush()
    if a.rounds > 1:
        print("\n| directory | clones | min | median | max (ms) |")
        print("|---|---|---|---|---|")
        for (d, n), xs in totals.items():
            print(f"| {d} | {n} | {min(xs):.0f} | {statistics.median(xs):.0f} | {max(xs):.0f} |")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="what", required=True)
    lat = sub.add_parser("latency")
    lat.add_argument("--runs", type=int, default=100)
    lat.add_argument("--mem", default="128,512,2048,4096")
    lat.add_argument("--modes", default=",".join(MODES))
    fo = sub.add_parser("fanout")
    fo.add_argument("--counts", default="100,1000")
    fo.add_argument("--dirs", default="",
                    help="comma-separated directories for the sockets and consoles "
                         "(default: the temporary directory)")
    fo.add_argument("--rounds", type=int, default=1)
    sb = sub.add_parser("sandbox")
    sb.add_argument("--runs", type=int, default=200)
    sb.add_argument("--rounds", type=int, default=4)
    sb.add_argument("--mem", type=int, default=128)
    dv = sub.add_parser("devices")
    dv.add_argument("--runs", type=int, default=100)
    dv.add_argument("--rounds", type=int, default=2)
    dv.add_argument("--gap", type=float, default=0.0,
                    help="ms to wait after deleting a clone (its exit's teardown in "
                         "the host kernel can slow the next clone's VM creation)")
    vs = sub.add_parser("vsock")
    vs.add_argument("--runs", type=int, default=20)
    abp = sub.add_parser("ab")
    abp.add_argument("--baseline", required=True, help="the other build's vmm binary")
    abp.add_argument("--runs", type=int, default=200)
    abp.add_argument("--rounds", type=int, default=4)
    abp.add_argument("--mem", type=int, default=128)
    abp.add_argument("--modes", default=",".join(MODES))
    abp.add_argument("--fanout", type=int, default=1000, help="clones per fan-out (0: none)")
    ee = sub.add_parser("e2e")
    ee.add_argument("--runs", type=int, default=100)
    ee.add_argument("--modes", default=",".join(MODES))
    a = ap.parse_args()
    for f in (TINY, VMM):
        if not os.path.exists(f):
            sys.exit(f"{f} missing: run `make release guest` first")
    {"latency": latency, "fanout": fanout, "e2e": e2e, "sandbox": sandbox,
     "devices": devices, "vsock": vsock, "ab": ab}[a.what](a)


if __name__ == "__main__":
    main()
