#!/bin/sh
# Buildroot post-build hook: install forkvm's init (the same file the offline build uses).
set -e
here=$(dirname "$0")
install -m 0755 "$here/../../../../guest/init/init" "$1/init"
mkdir -p "$1/mnt/disk"
