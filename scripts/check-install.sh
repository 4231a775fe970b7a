#!/usr/bin/env bash
# `make install` as a packager runs it (a staging DESTDIR, a PREFIX of its own), then
# what a newcomer relies on: every program and guest image in its place, the installed
# programs the release build's and runnable, the systemd unit valid and pointing at the
# installed gateway (systemd-analyze verify), and `make uninstall` taking it all away.
# CI runs it after the tests (.ci/run); the test suite's gateway test serves functions
# from a `make install-files` tree with the unit's own command line.
set -euo pipefail
cd "$(dirname "$0")/.."
prefix=${PREFIX:-/opt/forkvm}
dest=$(mktemp -d /tmp/forkvm-install-XXXXXX)
trap 'rm -rf "$dest"' EXIT
fail() {
    echo "check-install: $*" >&2
    exit 1
}

make install DESTDIR="$dest" PREFIX="$prefix"
root=$dest$prefix
unit=$root/lib/systemd/system/forkvm-gateway.service
for f in bin/vmm bin/jailer bin/forkvm-gateway share/forkvm/vmlinux share/forkvm/bzImage \
    share/forkvm/initramfs.cpio share/forkvm/rootfs.ext4 share/forkvm/python.ext4; do
    [ -f "$root/$f" ] || fail "$prefix/$f was not installed"
done
[ -f "$unit" ] || fail "the systemd unit was not installed"
for p in vmm jailer forkvm-gateway; do
    cmp -s "$root/bin/$p" "target/release/$p" || fail "bin/$p is not the release build's"
    [ -x "$root/bin/$p" ] || fail "bin/$p is not executable"
done
"$root/bin/vmm" --version >/dev/null || fail "vmm --version failed"
"$root/bin/jailer" --help >/dev/null || fail "jailer --help failed"
"$root/bin/forkvm-gateway" --help >/dev/null || fail "forkvm-gateway --help failed"

# The unit names the installed gateway under PREFIX, with options the gateway takes.
exec_start=$(sed -n 's/^ExecStart=//p' "$unit")
[ "${exec_start%% *}" = "$prefix/bin/forkvm-gateway" ] ||
    fail "ExecStart is not $prefix/bin/forkvm-gateway: $exec_start"
help=$("$root/bin/forkvm-gateway" --help)
for opt in ${exec_start#* }; do
    case $opt in
    --*) grep -q -- "$opt" <<<"$help" || fail "the gateway has no option $opt (ExecStart)" ;;
    esac
done
if command -v systemd-analyze >/dev/null; then
    # Verified where it will run from once DESTDIR is the root: the staged tree.
    staged=$dest/forkvm-gateway.service
    sed "s|$prefix/|$root/|g" "$unit" >"$staged"
    out=$(systemd-analyze verify "$staged" 2>&1) || fail "systemd-analyze verify: $out"
    [ -z "$out" ] || fail "systemd-analyze verify: $out"
else
    echo "check-install: systemd-analyze is missing; the unit's syntax is not verified" >&2
fi

# The containerd runtime's files (make install-shim: a release build of its own; its
# debug build here, which the tests made), then make uninstall takes them too.
make install-shim-files DESTDIR="$dest" PREFIX="$prefix" BIN_DIR=target/debug
for f in bin/containerd-shim-forkvm-v2 share/forkvm/initramfs.cpio share/forkvm/vmlinux; do
    [ -f "$root/$f" ] || fail "make install-shim-files did not install $prefix/$f"
done
"$root/bin/containerd-shim-forkvm-v2" -v >/dev/null || fail "containerd-shim-forkvm-v2 -v failed"

make uninstall DESTDIR="$dest" PREFIX="$prefix"
left=$(find "$dest" -type f ! -name forkvm-gateway.service -path "$root/*")
[ -z "$left" ] || fail "make uninstall left: $left"
[ ! -e "$root/share/forkvm" ] || fail "make uninstall left $prefix/share/forkvm"
echo "check-install: make install and make uninstall under $prefix: ok"
