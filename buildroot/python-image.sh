#!/usr/bin/env bash
# The Python guest's root file system: Debian's Python 3 and numpy, unpacked offline from
# Debian packages (apt-get download, no maintainer scripts), byte-compiled, cached in
# $FORKVM_CACHE_DIR/python keyed by the exact package versions and this script.
#
#   python-image.sh STAGE OUT
#
# STAGE is build-guest.sh's staged userland (busybox, init, forkvm tools, libforkvm);
# it is laid over the Python tree with the forkvm Python module (guest/python), and the
# result written as OUT, a read-only ext4 root (`--rootfs OUT`, `root=/dev/vda`).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
stage=$1
out=$2
cache="${FORKVM_CACHE_DIR:-/var/cache/forkvm}/python"
log() { printf 'python-image: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

# The roots, and what their dependency closure drags in that a function host never
# runs (package tools, perl) or that is one of several alternatives (numpy uses the
# reference BLAS and LAPACK).
roots=(python3-minimal python3 python3-numpy)
skip='^(dpkg|install-info|tar|perl|perl-base|perl-modules-.*|libperl.*|libatlas3-base|libblis.*|libopenblas.*|libgomp1|python3-pkg-resources|mailcap|mime-support|readline-common)$'

packages() {
    apt-cache depends --recurse --no-recommends --no-suggests --no-conflicts --no-breaks \
        --no-replaces --no-enhances "${roots[@]}" 2>/dev/null |
        grep '^[a-z0-9]' | sort -u | grep -Ev "$skip"
}

resolve() {
    list=$(packages) || return 1
    [ -n "$list" ] || return 1
    versions=$(for p in $list; do printf '%s=%s\n' "$p" "$(apt-cache policy "$p" | sed -n 's/ *Candidate: //p')"; done)
    ! printf '%s\n' "$versions" | grep -qE '=$|=\(none\)$'
}
if ! resolve; then
    log "package lists incomplete: apt-get update"
    apt-get update -qq || die "apt-get update failed"
    resolve || die "cannot resolve ${roots[*]} from the package lists"
fi
key=$( { printf '%s\n' "$versions"; cat "$0"; } | sha256sum | cut -c1-16)
tree="$cache/$key"

if [ -d "$tree" ]; then
    log "package tree cache hit ($tree)"
else
    log "package tree cache miss ($key): $(echo $list | wc -w) packages"
    mkdir -p "$cache"
    work=$(mktemp -d "$cache/build.XXXXXX")
    chmod 0755 "$work"   # apt downloads as _apt where it can
    trap 'rm -rf "$work"' EXIT
    (cd "$work" && apt-get download -qq $(printf '%s\n' "$versions")) ||
        die "apt-get download failed"
    mkdir "$work/root"
    for deb in "$work"/*.deb; do dpkg-deb -x "$deb" "$work/root"; done
    multi="$work/root/usr/lib/x86_64-linux-gnu"
    # What update-alternatives would link: the reference BLAS and LAPACK.
    for l in libblas.so.3 liblapack.so.3; do
        d=${l%%.so.3}; d=${d#lib}
        [ -e "$multi/$d/$l" ] || die "$multi/$d/$l missing"
        ln -sf "$d/$l" "$multi/$l"
    done
    # Byte-compile with the image's own interpreter: the root is read-only in the guest.
    chroot "$work/root" /usr/bin/python3 -m compileall -q \
        /usr/lib/python3.11 /usr/lib/python3/dist-packages >/dev/null ||
        die "byte-compiling failed"
    chroot "$work/root" /usr/bin/python3 -c 'import numpy' || die "numpy does not import"
    rm -rf "$tree"   # not a directory: a leftover
    mv "$work/root" "$tree"
    rm -rf "$work"
    # Keep the cache bounded: the two most recent trees (this one counted as new: the
    # directory moved in kept the time its package gave it).
    touch "$tree"
    ls -1dt "$cache"/*/ 2>/dev/null | grep -v '/build\.' | tail -n +3 | xargs -r rm -rf
fi
touch "$tree"

root=$(mktemp -d "$(dirname "$out")/python-root.XXXXXX")
trap 'rm -rf "$root" "$marker"' EXIT
marker=$(mktemp)
touch -d '1 second ago' "$marker"
cp -a "$tree/." "$root/"
# The forkvm userland over it: busybox and its applets where Debian has no file,
# init, the forkvm tools, libforkvm.
(cd "$stage" && find . \( -type f -o -type l -o -type p \) -print0) | while IFS= read -r -d '' f; do
    [ -e "$root/$f" ] || [ -L "$root/$f" ] && continue
    mkdir -p "$root/$(dirname "$f")"
    cp -a "$stage/$f" "$root/$f"
done
for d in proc sys dev tmp run mnt/disk root; do mkdir -p "$root/$d"; done
dist="$root/usr/lib/python3/dist-packages"
install -m 0644 "$repo"/guest/python/*.py "$dist/"
echo "forkvm python disk" > "$root/etc/forkvm-disk"
# Reproducible: the same inputs give the same bytes (build-guest.sh). The package tree's
# files keep the times its packages gave them, which its byte code records; what this
# script added or changed (directories, forkvm's files) gets one fixed time, the new
# byte code too.
epoch=1700000000
fs_uuid=6f726b76-6d00-4000-8000-000000000002
export E2FSPROGS_FAKE_TIME=$epoch
find "$root" -newer "$marker" -exec touch -h -d "@$epoch" {} +
chroot "$root" /usr/bin/python3 -m compileall -q /usr/lib/python3/dist-packages >/dev/null
find "$root" -newer "$marker" -exec touch -h -d "@$epoch" {} +
size=$(( $(du -sm "$root" | cut -f1) * 5 / 4 + 16 ))
rm -f "$out.tmp"
mke2fs -q -t ext4 -O ^has_journal -L forkvm-python -U "$fs_uuid" -E "hash_seed=$fs_uuid" \
    -d "$root" "$out.tmp" "${size}M"
"$repo/buildroot/ext4-settle.sh" "$out.tmp" "$epoch"
mv "$out.tmp" "$out"
log "done: $out (${size} MiB)"
