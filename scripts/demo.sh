#!/usr/bin/env bash
# The README demo: boot the tiny test guest on 2 vCPUs, then Linux with a command from
# the kernel command line. Linux is slow to boot on a PVM host (see docs/guest-kernel.md).
set -euo pipefail
cd "$(dirname "$0")/.."
vmm=target/release/vmm
g=target/guest
echo "== tiny test guest, 2 vCPUs =="
$vmm run --kernel $g/tiny.elf --mem-mib 32 --vcpus 2 --ap-boot direct --cmdline "ticks=5 beat=100 exit=3"
echo "== exit status $? =="
echo "== flash cloning: a tiny-guest template asks for 3 clones through the clone port =="
tmp=$(mktemp -d)
vmpid=
cleanup() {
    if [ -n "$vmpid" ] && kill -0 "$vmpid" 2>/dev/null; then
        $vmm shutdown --api-sock "$tmp/vm.sock" >/dev/null 2>&1 || kill -TERM "$vmpid"
        wait "$vmpid" || true
    fi
    rm -rf "$tmp"
}
trap cleanup EXIT
$vmm run --kernel $g/tiny.elf --mem-mib 128 --cmdline "ticks=2 beat=200 clonetest=3" \
    --warm-clones 2 --api-sock "$tmp/vm.sock" --console "$tmp/vm.console" </dev/null >/dev/null 2>&1 &
vmpid=$!
for _ in $(seq 300); do
    [ "$(cat "$tmp"/vm.console "$tmp"/vm.sock.*.console 2>/dev/null | grep -c 'own pattern')" = 4 ] && break
    sleep 0.1
done
for c in "$tmp"/vm.console "$tmp"/vm.sock.*.console; do
    echo "-- $(basename "$c"):"
    grep -E "clone|pattern" "$c" || true
done
echo "-- two more clones from the API (vmm fork --count 2):"
$vmm fork --api-sock "$tmp/vm.sock" --count 2
echo "-- pause it as a template; it keeps 2 warm clones ready (--warm-clones 2), then 2 more:"
$vmm pause --api-sock "$tmp/vm.sock"
for _ in $(seq 100); do
    $vmm status --api-sock "$tmp/vm.sock" | grep -q '"ready":2' && break
    sleep 0.05
done
$vmm fork --api-sock "$tmp/vm.sock" --count 2
$vmm clones --api-sock "$tmp/vm.sock" | python3 -m json.tool | grep -E '"id"|latency|"state"'
cleanup
trap - EXIT
echo "== Linux 6.1 guest, 2 vCPUs, root on the read-only virtio-blk disk, running a command =="
start=$(date +%s)
$vmm --log-level info run --kernel $g/vmlinux --rootfs $g/rootfs.ext4 --mem-mib 256 --vcpus 2 \
    --cmdline 'console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda ro rootfstype=ext4 forkvm.run="echo hello from forkvm; uname -r; nproc; cat /etc/forkvm-disk"'
echo "== exit status $?, $(( $(date +%s) - start )) s =="
echo "== functions: a Python template (Debian's Python 3 on a read-only root) waits in its runtime; =="
echo "== each invocation runs the handler in a fresh clone (docs/invoke.md)                         =="
tmp=$(mktemp -d)
vmpid=
trap cleanup EXIT
$vmm run --kernel $g/vmlinux --rootfs $g/python.ext4 --mem-mib 256 --template --warm-clones 2 \
    --cmdline 'console=ttyS0 reboot=k panic=-1 quiet root=/dev/vda ro rootfstype=ext4 forkvm.run="python3 -m forkvm forkvm_examples:info"' \
    --api-sock "$tmp/vm.sock" --console "$tmp/vm.console" </dev/null >/dev/null 2>&1 &
vmpid=$!
start=$(date +%s)
for _ in $(seq 1200); do
    $vmm status --api-sock "$tmp/vm.sock" 2>/dev/null | grep -q '"waiting":true' && break
    sleep 0.5
done
echo "-- the template is ready after $(( $(date +%s) - start )) s (boot, Python start, then it paused)"
for who in Ada Grace Linus; do
    $vmm invoke --api-sock "$tmp/vm.sock" --data "hello from $who" -v
    echo
done
echo "-- each of those ran the handler for the first time in its clone. A derived template with a"
echo "-- warm-up event runs it once before it pauses; the clones of its first requests tell it which"
echo "-- guest pages a request writes, and its warm clones copy them ahead (docs/invoke.md):"
derived=$($vmm invoke --api-sock "$tmp/vm.sock" --derive -v \
    --data '{"handler": "forkvm_examples:info", "warmup": ["hello from the warm-up"]}' \
    2>&1 >/dev/null | sed -n 's/^x-forkvm-socket: //p')
for _ in $(seq 200); do
    $vmm status --api-sock "$derived" 2>/dev/null | grep -q '"waiting":true' && break
    sleep 0.1
done
for who in Barbara Dennis Ken Margaret; do
    sleep 0.3
    $vmm invoke --api-sock "$derived" --data "hello from $who" -v
    echo
done
echo "-- a handler that raises:"
$vmm invoke --api-sock "$tmp/vm.sock" --data "raise no luck" || true
cleanup
trap - EXIT
