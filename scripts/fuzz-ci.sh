#!/usr/bin/env bash
# Runs every fuzz target for a bounded time (CI; `make fuzz-ci`): scripts/fuzz-ci.sh
# SECONDS TARGET_DIR. Each run starts from the committed corpus (fuzz/corpus/<target>,
# read only here) and writes new inputs to a scratch directory that is removed at the end,
# so CI leaves the repository as it found it. A crash or a failed property stops the run
# with libFuzzer's report; its input is kept in fuzz/artifacts/<target>.
set -euo pipefail
seconds=${1:?seconds per target}
target_dir=${2:?cargo target directory}
cd "$(dirname "$0")/../fuzz"
scratch=$(mktemp -d /tmp/forkvm-fuzz-ci.XXXXXX)
trap 'rm -rf "$scratch"' EXIT
export CARGO_TARGET_DIR=$target_dir
start=$(date +%s)
cargo +nightly fuzz build -O
echo "fuzz-ci: build took $(( $(date +%s) - start )) s" >&2
# One target per core at a time (each libFuzzer run is one process on one core).
jobs=${FUZZ_JOBS:-$(nproc)}
run() {
    local t=$1
    mkdir -p "$scratch/$t"
    if cargo +nightly fuzz run -O "$t" "$scratch/$t" "corpus/$t" -- \
            -max_total_time="$seconds" -print_final_stats=1 >"$scratch/$t.log" 2>&1; then
        echo ok >"$scratch/$t.status"
    else
        echo failed >"$scratch/$t.status"
    fi
}
targets=$(cargo +nightly fuzz list)
for t in $targets; do
    while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do
        wait -n || true
    done
    run "$t" &
done
wait
failed=0
for t in $targets; do
    if [ "$(cat "$scratch/$t.status" 2>/dev/null)" != ok ]; then
        tail -n 60 "$scratch/$t.log" >&2
        echo "fuzz-ci: $t failed; its input is in fuzz/artifacts/$t" >&2
        failed=1
        continue
    fi
    runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$scratch/$t.log")
    echo "fuzz-ci: $t: $runs executions in $seconds s, $(ls "$scratch/$t" | wc -l) new inputs" >&2
done
[ "$failed" = 0 ] || exit 1
echo "fuzz-ci: all targets passed in $(( $(date +%s) - start )) s ($jobs at a time)" >&2
