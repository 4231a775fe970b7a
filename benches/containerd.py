#!/usr/bin/env python3
"""forkvm as a containerd runtime (docs/containerd.md), side by side in one run with
Debian's runc (no VM: the floor) and a VM booted per container with the same kernel and
agent (the shim with FORKVM_SHIM_BOOT_EACH=1: what a runtime that boots a VM per
container pays on this host).

Each row is `ctr run --rm` of a busybox image (an OCI archive this script builds from
Debian's static busybox) running `echo ready`, timed from the start of `ctr` to the
first line of the container's output and to ctr's exit. The forkvm and runc rows
alternate run by run against one containerd the script starts (its own root, state and
socket, the CRI plugin off); the boot row has a containerd of its own and fewer runs.

Then:
- --concurrent containers started at once (forkvm and runc): each one's first line,
  and the time until all have exited;
- memory per running container: --memory-containers containers that print a line and
  sleep, the PSS of everything the runtime runs for them (the shims and their
  descendants, and for forkvm the template service's process tree: its templates'
  VMMs, their warm clones and the containers' clones; for runc the container's
  processes), divided by their number;
- where forkvm's time goes: the shim's log (image, the image's template, the clone
  the template service lent at create;
  the first output after the agent is asked to start the process, which is the guest's
  work: forkvm-oci's mounts, chroot and exec in the guest kernel).

With --volume a third row alternates with the two: forkvm with a host directory bound
in (`--mount`, in a Kubernetes ConfigMap volume's shape: a small file and a 100 KiB one,
--volume-kib, behind `..data` links), which the shim copies into the container at its start
(docs/containerd.md, "Volumes are copies"); the shim's account then covers both forkvm
rows. `--containerd2 DIR` adds forkvm's row again under the containerd 2.x and ctr in DIR
(a containerd of its own, the same shim and template), alternating with the others.
`--compare-build DIR` adds it again from another build: DIR holds that build's
`containerd-shim-forkvm-v2` and `vmm`, and `guest/vmlinux` and `guest/initramfs.cpio`
(an A/B of a change to the shim or the guest), under a containerd of its own whose shim
keeps its templates in --dir with `-compare` appended.

Needs root, containerd, ctr and runc (scripts/install-deps.sh test), the release
binaries (cargo build --release --workspace --bins) and the guest (make guest).

usage: benches/containerd.py [--runs N] [--boot-runs N] [--concurrent N]
                             [--memory-containers N] [--volume] [--containerd2 DIR]
                             [--compare-build DIR] [--dir DIR]
"""
import argparse
import hashlib
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time

from clone import pct

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IMAGE = "docker.io/forkvm/bench-busybox:1"
NAMESPACE = "forkvm-bench"
FORKVM = "io.containerd.forkvm.v2"
RUNC = "io.containerd.runc.v2"


def digest(b):
    return "sha256:" + hashlib.sha256(b).hexdigest()


def busybox_archive(path):
    """An OCI archive of one layer: /bin/busybox (Debian's static one) and its applets."""
    def add(t, name, data=b"", mode=0o644, kind=tarfile.REGTYPE, link=""):
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime, info.linkname = kind, mode, 1_700_000_000, link
        info.size = len(data)
        t.addfile(info, io.BytesIO(data) if data else None)

    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w", format=tarfile.USTAR_FORMAT) as t:
        for d, mode in [("bin", 0o755), ("dev", 0o755), ("etc", 0o755), ("proc", 0o755),
                        ("sys", 0o755), ("tmp", 0o1777)]:
            add(t, d, mode=mode, kind=tarfile.DIRTYPE)
        add(t, "bin/busybox", open("/bin/busybox", "rb").read(), 0o755)
        for a in ["sh", "echo", "sleep", "cat"]:
            add(t, "bin/" + a, mode=0o777, kind=tarfile.SYMTYPE, link="busybox")
    layer = layer.getvalue()
    config = json.dumps({
        "architecture": "amd64", "os": "linux",
        "config": {"Cmd": ["sh"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [digest(layer)]},
    }).encode()
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json",
                   "digest": digest(config), "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar",
                    "digest": digest(layer), "size": len(layer)}],
    }).encode()
    index = json.dumps({
        "schemaVersion": 2,
        "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
                       "digest": digest(manifest), "size": len(manifest),
                       "annotations": {"io.containerd.image.name": IMAGE,
                                       "org.opencontainers.image.ref.name": "1"}}],
    }).encode()
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as t:
        add(t, "oci-layout", b'{"imageLayoutVersion":"1.0.0"}')
        add(t, "index.json", index)
        for blob in [layer, config, manifest]:
            add(t, "blobs/sha256/" + digest(blob)[7:], blob)


class Containerd:
    """A containerd of the bench's own in `tmp`, with the shim on its PATH."""

    def __init__(self, tmp, name, shim_dir, env_extra, bin_dir=None):
        self.bin = (lambda tool: os.path.join(bin_dir, tool)) if bin_dir else (lambda t: t)
        self.dir = os.path.join(tmp, name)
        os.makedirs(self.dir)
        self.sock = os.path.join(self.dir, "containerd.sock")
        self.log_path = os.path.join(self.dir, "containerd.log")
        cfg = os.path.join(self.dir, "config.toml")
        with open(cfg, "w") as f:
            f.write(f'version = 2\nroot = "{self.dir}/root"\nstate = "{self.dir}/state"\n'
                    'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
                    f'[grpc]\n  address = "{self.sock}"\n'
                    f'[ttrpc]\n  address = "{self.sock}.ttrpc"\n')
        guest = os.path.join(REPO, "target", "guest")
        env = dict(os.environ)
        env.update({
            "PATH": os.path.join(REPO, "target", "release") + ":" + env.get("PATH", ""),
            "FORKVM_SHIM_KERNEL": os.path.join(guest, "vmlinux"),
            "FORKVM_SHIM_INITRD": os.path.join(guest, "initramfs.cpio"),
            "FORKVM_SHIM_DIR": shim_dir,
            # The template service of this containerd's shims, its own.
            "FORKVM_SHIM_RUN_DIR": os.path.join(self.dir, "run"),
        })
        env.update(env_extra)
        self.p = subprocess.Popen([self.bin("containerd"), "--config", cfg], env=env,
                                  stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                  stderr=open(self.log_path, "w"))
        deadline = time.time() + 30
        while self.ctr("version").returncode != 0:
            if time.time() > deadline:
                sys.exit("containerd did not serve:\n" + self.log())
            time.sleep(0.1)

    def log(self):
        return open(self.log_path).read()

    def argv(self, *args):
        return [self.bin("ctr"), "--address", self.sock, "--namespace", NAMESPACE, *args]

    def ctr(self, *args):
        return subprocess.run(self.argv(*args), capture_output=True, text=True)

    def services(self):
        """The pids of the template services of this containerd's shims (from their
        pid files) that still run."""
        run = os.path.join(self.dir, "run")
        pids = []
        for name in os.listdir(run) if os.path.isdir(run) else []:
            if not name.endswith(".pid"):
                continue
            try:
                pid = int(open(os.path.join(run, name)).read())
                if b"templates" in open(f"/proc/{pid}/cmdline", "rb").read():
                    pids.append(pid)
            except (OSError, ValueError):
                pass
        return pids

    def stop(self):
        self.p.terminate()
        try:
            self.p.wait(20)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
        # The template service its shims started (it would exit once idle): stopped.
        for pid in self.services():
            os.kill(pid, 15)
        deadline = time.time() + 20
        while self.services() and time.time() < deadline:
            time.sleep(0.1)


def with_image(started, archive, *args, **kwargs):
    """A Containerd(*args, **kwargs), added to `started`, with the image of `archive`
    imported (the run ends with ctr's complaint if it cannot be)."""
    c = Containerd(*args, **kwargs)
    started.append(c)
    imp = c.ctr("image", "import", archive)
    if imp.returncode != 0:
        sys.exit(imp.stderr)
    return c


def run_once(c, runtime, cid, script="echo ready", extra=()):
    """`ctr run --rm` (with `extra` options) to the first line and to the exit, in ms."""
    t0 = time.perf_counter()
    p = subprocess.Popen(c.argv("run", "--rm", "--runtime", runtime, *extra, IMAGE, cid,
                                "sh", "-c", script),
                         stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE)
    line = p.stdout.readline()
    t1 = time.perf_counter()
    rest, err = p.communicate()
    t2 = time.perf_counter()
    if p.returncode != 0 or line != b"ready\n":
        sys.exit(f"{runtime} {cid}: status {p.returncode}, output {line + rest!r}, "
                 f"{err.decode()}\n{c.log()[-3000:]}")
    return (t1 - t0) * 1e3, (t2 - t0) * 1e3


def configmap_volume(path, kib=100):
    """A host directory in a Kubernetes ConfigMap volume's shape at `path` (its larger
    file `kib` KiB); returns the `ctr run --mount` options that bind it at /etc/config."""
    dated = os.path.join(path, "..2026_12_03")
    os.makedirs(os.path.join(dated, "sub"))
    with open(os.path.join(dated, "app.conf"), "w") as f:
        f.write("port=8080\n")
    with open(os.path.join(dated, "sub", "big"), "wb") as f:
        f.write(b"v" * (kib << 10))
    os.symlink("..2026_12_03", os.path.join(path, "..data"))
    os.symlink("..data/app.conf", os.path.join(path, "app.conf"))
    os.symlink("..data/sub", os.path.join(path, "sub"))
    return ["--mount", f"type=bind,src={path},dst=/etc/config,options=rbind:ro"]


def stats(xs):
    return f"{min(xs):.0f} / {statistics.median(xs):.0f} / {pct(xs, 0.99):.0f}"


def head(*cols):
    print("| " + " | ".join(cols) + " |\n|" + "---|" * len(cols), flush=True)


def concurrent(c, runtime, n, tag):
    """n containers started at once: each one's first line (ms) and the wall until all
    exited (ms)."""
    firsts, errors = [], []

    def one(i):
        try:
            firsts.append(run_once(c, runtime, f"{tag}-{i}")[0])
        except SystemExit as e:
            errors.append(str(e))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = (time.perf_counter() - t0) * 1e3
    if errors:
        sys.exit(errors[0])
    return firsts, wall


def tree_pss_kib(roots):
    """PSS (KiB) of processes `roots` and all their descendants."""
    children = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            stat = open(f"/proc/{pid}/stat").read()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        children.setdefault(ppid, []).append(int(pid))
    total, todo = 0, list(roots)
    while todo:
        pid = todo.pop()
        todo.extend(children.get(pid, []))
        try:
            for line in open(f"/proc/{pid}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total


def shims_of(c, binary):
    pids = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if binary in cmd and c.sock in cmd:
            pids.append(int(pid))
    return pids


def memory(c, runtime, binary, n, tag):
    """PSS per running container (MiB): n containers that print a line and sleep."""
    procs = []
    for i in range(n):
        p = subprocess.Popen(c.argv("run", "--rm", "--runtime", runtime, IMAGE, f"{tag}-{i}",
                                    "sh", "-c", "echo ready; sleep 600"),
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL)
        if p.stdout.readline() != b"ready\n":
            sys.exit(f"{runtime}: a sleeping container did not start\n{c.log()[-3000:]}")
        procs.append(p)
    time.sleep(1)
    shims = shims_of(c, binary)
    # forkvm's clones are lent by the template service: its process, its templates and
    # their clones count too.
    pss = tree_pss_kib(shims + c.services()) / 1024 / n
    for i in range(n):
        c.ctr("task", "kill", "-s", "SIGKILL", f"{tag}-{i}")
    for p in procs:
        p.wait(60)
    return pss, len(shims)


def shim_phases(log):
    """The forkvm shim's own account, from containerd's log: ms of image, the image's
    template, clone (create) and first output, exit (start)."""
    created = re.findall(r"created: image ([\d.]+) ms \(built: \w+\), image's template "
                         r"([\d.]+) ms, clone ([\d.]+) ms", log)
    started = re.findall(r"started: first output ([\d.]+) ms, exit ([\d.]+) ms", log)
    return ([tuple(map(float, x)) for x in created], [tuple(map(float, x)) for x in started])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--boot-runs", type=int, default=3)
    ap.add_argument("--concurrent", type=int, default=20)
    ap.add_argument("--memory-containers", type=int, default=5)
    ap.add_argument("--log", help="append containerd's logs (the shim's lines among them) here")
    ap.add_argument("--volume", action="store_true",
                    help="also forkvm with a ConfigMap-shaped host directory bound in")
    ap.add_argument("--volume-kib", type=int, default=100,
                    help="the size of the volume's larger file, KiB")
    ap.add_argument("--containerd2", metavar="DIR",
                    help="also forkvm under the containerd (2.x) and ctr in DIR, alternating "
                         "with the other rows (scripts/install-deps.sh test builds one in "
                         "/var/cache/forkvm/bin/containerd2)")
    ap.add_argument("--compare-build", metavar="DIR",
                    help="also forkvm from another build: DIR has its "
                         "containerd-shim-forkvm-v2, vmm, guest/vmlinux and "
                         "guest/initramfs.cpio; its row alternates with the others")
    ap.add_argument("--dir", default="/var/tmp/forkvm-bench-shim",
                    help="the shim's directory (its saved template is kept between runs)")
    a = ap.parse_args()
    for tool in ["containerd", "ctr", "runc"]:
        if not shutil.which(tool):
            sys.exit(f"{tool} is not installed (scripts/install-deps.sh test)")
    shim = os.path.join(REPO, "target", "release", "containerd-shim-forkvm-v2")
    if not os.path.exists(shim):
        sys.exit("no release shim: cargo build --release --workspace --bins")
    tmp = tempfile.mkdtemp(prefix="forkvm-bench-containerd-")
    started = []
    try:
        archive = os.path.join(tmp, "busybox.tar")
        busybox_archive(archive)
        c = with_image(started, archive, tmp, "main", a.dir, {})
        # Warm-up, not counted: the shim's template is booted and saved if it is not.
        for runtime in [FORKVM, RUNC]:
            run_once(c, runtime, "warmup-" + runtime.split(".")[2])
        skip = len(shim_phases(c.log())[0])
        # (label, runtime, ctr options, containerd) per row, alternating run by run.
        kinds = [(FORKVM, FORKVM, [], c), (RUNC, RUNC, [], c)]
        if a.volume:
            mount = configmap_volume(os.path.join(tmp, "volume"), a.volume_kib)
            kinds.insert(1, ("volume", FORKVM, mount, c))
        if a.containerd2:
            c2 = with_image(started, archive, tmp, "containerd2", a.dir, {},
                            bin_dir=a.containerd2)
            run_once(c2, FORKVM, "warmup-2")
            kinds.insert(1, ("containerd2", FORKVM, [], c2))
        if a.compare_build:
            d = os.path.abspath(a.compare_build)
            missing = [f for f in ["containerd-shim-forkvm-v2", "vmm", "guest/vmlinux",
                                   "guest/initramfs.cpio"]
                       if not os.path.exists(os.path.join(d, f))]
            if missing:
                sys.exit(f"--compare-build {d} lacks {missing}")
            cb = with_image(started, archive, tmp, "compare", a.dir.rstrip("/") + "-compare",
                            {"PATH": d + ":" + os.environ.get("PATH", ""),
                             "FORKVM_VMM": os.path.join(d, "vmm"),
                             "FORKVM_SHIM_KERNEL": os.path.join(d, "guest", "vmlinux"),
                             "FORKVM_SHIM_INITRD": os.path.join(d, "guest", "initramfs.cpio")})
            run_once(cb, FORKVM, "warmup-compare")
            kinds.insert(1, ("compare", FORKVM, [], cb))
        rows = {label: [] for label, _, _, _ in kinds}
        for i in range(a.runs):
            for label, runtime, extra, on in (kinds if i % 2 == 0 else kinds[::-1]):
                cid = f"r{i}-{label.split('.')[-2] if '.' in label else label}"
                rows[label].append(run_once(on, runtime, cid, extra=extra))
        created, began = shim_phases(c.log())
        created, began = created[skip:], began[skip:]

        b = with_image(started, archive, tmp, "boot", a.dir, {"FORKVM_SHIM_BOOT_EACH": "1"})
        boot = [run_once(b, FORKVM, f"boot{i}") for i in range(a.boot_runs)]
        b.stop()

        print(f"\n`ctr run --rm IMAGE ID sh -c 'echo ready'`, ms, min / median / p99 "
              f"({a.runs} runs each, the rows alternating run by run; {a.boot_runs} boot runs):\n")
        head("runtime", "to the first line", "to ctr's exit", "median first line / forkvm's")
        med = statistics.median([x[0] for x in rows[FORKVM]])
        for label, xs in [("forkvm (a clone of the saved template)", rows[FORKVM]),
                          ("forkvm with a ConfigMap-shaped volume bound in (copied in)",
                           rows.get("volume", [])),
                          ("forkvm under containerd 2.x (`--containerd2`)",
                           rows.get("containerd2", [])),
                          ("forkvm, the build compared (`--compare-build`)",
                           rows.get("compare", [])),
                          ("runc (no VM)", rows[RUNC]),
                          ("a VM booted per container (forkvm's shim, FORKVM_SHIM_BOOT_EACH=1)",
                           boot)]:
            if not xs:
                continue
            first = [x[0] for x in xs]
            print(f"| {label} | {stats(first)} | {stats([x[1] for x in xs])} | "
                  f"{statistics.median(first) / med:.2f}x |")

        print("\nforkvm's shim's own account of those runs, ms (min / median / p99):\n")
        head("phase", "ms")
        for i, name in enumerate(["image (cached: the snapshotter's mounts, the key)",
                                  "the image's template (made once, then found)",
                                  "clone (lent by the template service)"]):
            print(f"| create: {name} | {stats([x[i] for x in created])} |")
        print(f"| start: agent asked to its first output (the guest: forkvm-oci's mounts, "
              f"exec) | {stats([x[0] for x in began])} |")
        print(f"| start: to the exit | {stats([x[1] for x in began])} |")

        print(f"\n{a.concurrent} containers started at once, ms:\n")
        head("runtime", "first line min / median / p99", "all exited")
        for runtime in [FORKVM, RUNC]:
            firsts, wall = concurrent(c, runtime, a.concurrent, "c-" + runtime.split(".")[2])
            print(f"| {runtime} | {stats(firsts)} | {wall:.0f} |")

        print(f"\nmemory per running container ({a.memory_containers} running), PSS of the "
              "runtime's processes for them:\n")
        head("runtime", "MiB per container", "shim processes")
        for runtime, binary in [(FORKVM, "containerd-shim-forkvm-v2"),
                                (RUNC, "containerd-shim-runc-v2")]:
            pss, n = memory(c, runtime, binary, a.memory_containers, "m-" + runtime.split(".")[2])
            print(f"| {runtime} | {pss:.1f} | {n} |")
    finally:
        for c in started:
            c.stop()
        if a.log:
            with open(a.log, "a") as f:
                for name in ["main", "boot"]:
                    path = os.path.join(tmp, name, "containerd.log")
                    if os.path.exists(path):
                        f.write(open(path).read())
        shutil.rmtree(tmp, ignore_errors=True)
        remove_namespace_cgroups()


def remove_namespace_cgroups():
    """runc puts a container's cgroup under /<namespace>/<id> in every hierarchy and
    removes only the container's: the namespace's own (empty) directories go here."""
    for root in ["/sys/fs/cgroup", "/sys/fs/cgroup/unified"]:
        if not os.path.isdir(root):
            continue
        for hierarchy in [root] + [os.path.join(root, d) for d in os.listdir(root)]:
            path = os.path.join(hierarchy, NAMESPACE)
            if os.path.isdir(path):
                try:
                    os.rmdir(path)
                except OSError as e:
                    print(f"containerd.py: {path}: {e}", file=sys.stderr)


if __name__ == "__main__":
    main()
