#!/usr/bin/env bash
# Builds the tiny test guest with binutils: build.sh OUTPUT.elf
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/../../target/guest/tiny.elf}
mkdir -p "$(dirname "$out")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
gcc -c -nostdlib -ffreestanding -o "$tmp/tiny.o" "$here/tiny.S"
ld -nostdlib -static -z noexecstack --no-warn-rwx-segments -T "$here/tiny.ld" -o "$tmp/tiny.elf" "$tmp/tiny.o"
mv "$tmp/tiny.elf" "$out"
