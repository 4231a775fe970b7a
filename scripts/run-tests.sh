#!/usr/bin/env bash
# Runs the whole test suite and ends with one summary line over every test binary:
# "forkvm: P passed, F failed, S skipped" (skipped = cargo's ignored). Every test binary
# runs even after one failed (--no-fail-fast), so a failed run shows every failure.
# Each test binary's start and each test's end is followed by the seconds since the run
# began ("    (at 812 s)"; cargo's own lines are left as they are), so a slow test can be
# found in a CI log.
# Exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
log=$(mktemp)
trap 'rm -f "$log"' EXIT
stamp() {
    local line
    while IFS= read -r line; do
        printf '%s\n' "$line"
        case "$line" in
        "test "*" ... "* | "     Running "*) printf '    (at %d s)\n' "$SECONDS" ;;
        esac
    done
}
SECONDS=0
cargo test --workspace --no-fail-fast "$@" 2>&1 | tee "$log" | stamp
status=${PIPESTATUS[0]}
awk '/^test result:/ {
        for (i = 1; i <= NF; i++) {
            if ($(i+1) ~ /^passed/) p += $i
            if ($(i+1) ~ /^failed/) f += $i
            if ($(i+1) ~ /^ignored/) g += $i
        }
     }
     END { printf "forkvm: %d passed, %d failed, %d skipped\n", p, f, g }' "$log"
exit "$status"
