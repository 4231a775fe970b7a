#!/usr/bin/env bash
# Runs the whole test suite and ends with one summary line over every test binary:
# "forkvm: P passed, F failed, S skipped" (skipped = ignored tests).
#
# cargo-nextest schedules every test of every binary on the host's cores
# (.config/nextest.toml: what must not overlap, in test groups); it does not run doc
# tests, which `cargo test --doc` runs after it. Every test runs even after one failed,
# so a failed run shows every failure. Each test's time goes into
# target/nextest/default/junit.xml; scripts/slowest-tests.py lists the slowest.
# Arguments go to `cargo nextest run` (a filter, say). Exits non-zero if anything failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! cargo nextest --version >/dev/null 2>&1; then
    echo "run-tests: cargo-nextest is missing: ./scripts/install-deps.sh test installs it" >&2
    exit 1
fi
junit=target/nextest/default/junit.xml
rm -f "$junit"
doclog=$(mktemp)
trap 'rm -f "$doclog"' EXIT
SECONDS=0
cargo nextest run --workspace --no-fail-fast "$@"
status=$?
doc_status=0
if [ $# -eq 0 ]; then
    cargo test --workspace --doc 2>&1 | tee "$doclog"
    doc_status=${PIPESTATUS[0]}
fi
python3 scripts/slowest-tests.py --summary "$junit" "$doclog"
echo "run-tests: ${SECONDS} s"
[ "$status" -eq 0 ] && [ "$doc_status" -eq 0 ]
