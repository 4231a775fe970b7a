#!/usr/bin/env bash
# Gives every inode of a freshly made ext4 image (mke2fs -d) one fixed change and access
# time, so that the same tree gives the same image bytes: mke2fs copies those two times
# from the source files, and a file's change time cannot be set there.
#
#   ext4-settle.sh IMAGE EPOCH
#
# mke2fs -d allocates inodes in order on a new file system: the root (2), then 11 (lost+
# found) onwards, so the used ones are 2 and 11 to the used count.
set -euo pipefail
img=$1
epoch=$2
export E2FSPROGS_FAKE_TIME=$epoch
count=$(dumpe2fs -h "$img" 2>/dev/null | sed -n 's/^Inode count: *//p')
free=$(dumpe2fs -h "$img" 2>/dev/null | sed -n 's/^Free inodes: *//p')
[ -n "$count" ] && [ -n "$free" ] || { echo "ext4-settle: cannot read $img" >&2; exit 1; }
cmds=$(mktemp)
trap 'rm -f "$cmds"' EXIT
for ino in 2 $(seq 11 $((count - free))); do
    printf 'sif <%d> ctime @%d\nsif <%d> atime @%d\n' "$ino" "$epoch" "$ino" "$epoch"
done > "$cmds"
debugfs -w -f "$cmds" "$img" >/dev/null 2>&1
# The image must still be whole.
e2fsck -fn "$img" >/dev/null 2>&1 || { echo "ext4-settle: $img fails e2fsck after settling" >&2; exit 1; }
