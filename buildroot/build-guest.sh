#!/usr/bin/env bash
# Offline guest image build from Debian packages only.
#
# Outputs (in target/guest/):
#   vmlinux            Linux 6.1 ELF with a PVH entry note
#   bzImage            the same kernel as a bzImage
#   initramfs.cpio     busybox-static + forkvm init + guest programs (what the
#                      README, the shim and the tests boot)
#   initramfs.cpio.gz  the same, compressed: a smaller file, but the guest kernel
#                      inflates it, which doubles a boot on PVM hosts
#                      (docs/benchmarks/startup.md)
#   rootfs.ext4        a read-only ext4 image with the same userland, bootable as root
#   python.ext4        a read-only root with Debian's Python 3 and numpy, the same
#                      userland and the forkvm Python module (buildroot/python-image.sh)
#   tiny.elf           forkvm's tiny test guest (built by guest/tiny/build.sh)
#   libforkvm.a, libforkvm.so.1
#                      the guest runtime library (guest/lib), also in the images
#
# The kernel build (about 3 minutes here) is cached outside the repo in
# $FORKVM_CACHE_DIR (default /var/cache/forkvm), keyed by a hash of every input:
# the linux-source-6.1 package version, the config fragment, the patches and the
# kernel part of this script. Needs: linux-source-6.1 busybox-static bc bison
# flex libelf-dev libssl-dev cpio e2fsprogs lz4 (installed by .ci/run and `make deps`).
set -euo pipefail

repo=$(cd "$(dirname "$0")/.." && pwd)
out="$repo/target/guest"
cache="${FORKVM_CACHE_DIR:-/var/cache/forkvm}"
kdir="$repo/buildroot/kernel"
tarball=/usr/src/linux-source-6.1.tar.xz
jobs=$(nproc)

log() { printf 'build-guest: %s\n' "$*" >&2; }
die() { log "error: $*"; exit 1; }

[ -f "$tarball" ] || die "$tarball missing: apt-get install linux-source-6.1"
command -v busybox >/dev/null || [ -x /bin/busybox ] || die "busybox missing: apt-get install busybox-static"

mkdir -p "$out" "$cache/kernel"

# ---------------------------------------------------------------- kernel
kernel_key() {
    {
        dpkg-query -W -f='${Version}\n' linux-source-6.1
        cat "$kdir/microvm.config"
        for p in "$kdir"/patches/*.patch; do printf '%s\n' "$(basename "$p")"; cat "$p"; done
        sed -n '/^# ---- kernel build begin/,/^# ---- kernel build end/p' "$0"
    } | sha256sum | cut -c1-16
}

# ---- kernel build begin
build_kernel() (
    # A subshell, so the cleanup trap also runs when a step fails.
    dest=$1
    work=$(mktemp -d "$cache/kernel/build.XXXXXX")
    trap 'rm -rf "$work"' EXIT
    log "extracting linux-source-6.1 into $work"
    tar -C "$work" -xf "$tarball"
    src="$work/linux-source-6.1"
    for p in "$kdir"/patches/*.patch; do
        log "applying $(basename "$p")"
        patch -d "$src" -p1 --quiet --forward < "$p"
    done
    log "configuring (allnoconfig + microvm.config)"
    make -C "$src" -s KCONFIG_ALLCONFIG="$kdir/microvm.config" allnoconfig
    # Every line of the fragment must survive: a typo or an unmet dependency fails here.
    missing=0
    while IFS= read -r line; do
        case "$line" in ''|'#'*) continue ;; esac
        name=${line%%=*}
        if [ "${line#*=}" = n ]; then
            if grep -q "^$name=" "$src/.config"; then log "config: $name should be off"; missing=1; fi
        elif ! grep -qxF "$line" "$src/.config"; then
            log "config: $line did not survive (dependency or typo)"; missing=1
        fi
    done < "$kdir/microvm.config"
    [ "$missing" = 0 ] || die "kernel config fragment does not apply cleanly"
    log "building vmlinux and bzImage with -j$jobs (cold build, about 3 minutes)"
    make -C "$src" -s -j"$jobs" vmlinux bzImage
    mkdir -p "$dest.tmp"
    cp "$src/vmlinux" "$src/arch/x86/boot/bzImage" "$src/.config" "$dest.tmp/"
    mv "$dest.tmp" "$dest"
)
# ---- kernel build end

key=$(kernel_key)
kcache="$cache/kernel/$key"
if [ -f "$kcache/vmlinux" ]; then
    log "kernel cache hit ($kcache)"
else
    log "kernel cache miss ($key)"
    rm -rf "$kcache.tmp"
    build_kernel "$kcache"
    # Keep the cache bounded: the four most recently built kernels.
    ls -1dt "$cache"/kernel/*/ 2>/dev/null | grep -v '/build\.' | tail -n +5 | xargs -r rm -rf
fi
touch "$kcache"
cp "$kcache/vmlinux" "$kcache/bzImage" "$out/"
cp "$kcache/.config" "$out/kernel.config"
[ "${1:-}" = --kernel-only ] && exit 0

# ---------------------------------------------------------------- userland
"$repo/guest/tiny/build.sh" "$out/tiny.elf"

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
root="$stage/root"
mkdir -p "$root"/{bin,sbin,etc,proc,sys,dev,tmp,run,mnt/disk,root,usr/bin,usr/sbin}
cp /bin/busybox "$root/bin/busybox"
# Applet links: every applet busybox-static offers.
for applet in $(/bin/busybox --list); do
    [ "$applet" = busybox ] && continue
    ln -sf busybox "$root/bin/$applet"
done
# libforkvm (guest/lib), static and shared: runtimes link it (forkvm-fn statically; the
# Python runtime loads the shared one through ctypes).
lib="$stage/lib"
mkdir -p "$lib" "$root/usr/lib" "$root/usr/include"
for src in forkvm forkvm-net; do
    gcc -O2 -Wall -Wextra -Werror -fPIC -c -o "$lib/$src.o" "$repo/guest/lib/$src.c"
done
ar rcs "$lib/libforkvm.a" "$lib/forkvm.o" "$lib/forkvm-net.o"
gcc -shared -Wl,-soname,libforkvm.so.1 -o "$lib/libforkvm.so.1" "$lib/forkvm.o" "$lib/forkvm-net.o"
install -m 0644 "$lib/libforkvm.a" "$lib/libforkvm.so.1" "$root/usr/lib/"
ln -sf libforkvm.so.1 "$root/usr/lib/libforkvm.so"
install -m 0644 "$repo/guest/lib/forkvm.h" "$root/usr/include/"
cp "$lib/libforkvm.a" "$lib/libforkvm.so.1" "$out/"
# The guest programs (guest/tools/*.c) as one static multi-call binary,
# /usr/bin/forkvm-tools, that runs the tool its name says (argv[0]); each tool's name is
# a link to it. Seven statically linked copies of the C library were 5.7 of the
# initramfs's 7.8 MB, and a PVM host's guest kernel unpacks the archive in its
# instruction emulator at every boot (docs/guest-kernel.md). Each tool's main becomes
# main_<tool>, the one symbol its object keeps global: tools may define the same names.
tools=()
objects=()
dispatch="$stage/forkvm-tools.c"
for tool in "$repo"/guest/tools/*.c; do
    name=$(basename "$tool" .c)
    fn=main_${name//-/_}
    gcc -O2 -Wall -Wextra -Werror -I"$repo/guest/lib" -Dmain="$fn" -c -o "$lib/$name.o" "$tool"
    objcopy --keep-global-symbol="$fn" "$lib/$name.o"
    tools+=("$name")
    objects+=("$lib/$name.o")
done
{
    echo '#include <stdio.h>'
    echo '#include <string.h>'
    for name in "${tools[@]}"; do echo "int main_${name//-/_}(int, char **);"; done
    echo 'int main(int argc, char **argv)'
    echo '{'
    echo '    const char *name = argc > 0 ? argv[0] : "";'
    echo '    const char *slash = strrchr(name, '"'/'"');'
    echo '    if (slash)'
    echo '        name = slash + 1;'
    for name in "${tools[@]}"; do
        echo "    if (strcmp(name, \"$name\") == 0)"
        echo "        return main_${name//-/_}(argc, argv);"
    done
    echo "    fprintf(stderr, \"forkvm-tools: run me as one of: ${tools[*]}\\n\");"
    echo '    return 127;'
    echo '}'
} > "$dispatch"
gcc -static -O2 -Wall -Wextra -Werror -o "$root/usr/bin/forkvm-tools" "$dispatch" \
    "${objects[@]}" "$lib/libforkvm.a"
for name in "${tools[@]}"; do
    ln -s forkvm-tools "$root/usr/bin/$name"
done
install -m 0755 "$repo/guest/init/init" "$root/init"
install -m 0755 "$repo/guest/init/init" "$root/sbin/init"
echo "forkvm guest $(cat "$repo/guest/init/VERSION")" > "$root/etc/forkvm-release"
mkfifo -m 0600 "$root/etc/forkvm-idle"   # init waits on it while it serves the agent

# Reproducible images: the same inputs give the same bytes (the tests' snapshot cache
# names a booted guest by the hash of its images, tests/src/cache.rs), so every file
# gets one fixed time, and the file systems a fixed UUID, hash seed and creation time.
epoch=1700000000
fs_uuid=6f726b76-6d00-4000-8000-000000000001
export E2FSPROGS_FAKE_TIME=$epoch
settle() { find "$1" -exec touch -h -d "@$epoch" {} +; }
settle "$root"

# Both compressed and plain: on a PVM host the guest kernel's gunzip runs in the
# instruction emulator and the plain archive unpacks about 2x faster (docs/benchmarks.md).
(cd "$root" && find . -print0 | LC_ALL=C sort -z | cpio --null -o -H newc --quiet --reproducible) \
    > "$out/initramfs.cpio.tmp"
gzip -9n < "$out/initramfs.cpio.tmp" > "$out/initramfs.cpio.gz.tmp"
mv "$out/initramfs.cpio.tmp" "$out/initramfs.cpio"
mv "$out/initramfs.cpio.gz.tmp" "$out/initramfs.cpio.gz"

# A read-only data disk with the same userland and a marker file tests can read.
echo "forkvm rootfs disk" > "$root/etc/forkvm-disk"
settle "$root"
rm -f "$out/rootfs.ext4.tmp"
mke2fs -q -t ext4 -O ^has_journal -L forkvm-root -U "$fs_uuid" -E "hash_seed=$fs_uuid" \
    -d "$root" "$out/rootfs.ext4.tmp" 16M
"$repo/buildroot/ext4-settle.sh" "$out/rootfs.ext4.tmp" "$epoch"
mv "$out/rootfs.ext4.tmp" "$out/rootfs.ext4"

# The Python guest's root: Debian's Python 3 and numpy with this userland
# (buildroot/python-image.sh; the package tree is cached like the kernel).
"$repo/buildroot/python-image.sh" "$root" "$out/python.ext4"

log "done: $(cd "$out" && ls | tr '\n' ' ')"
