#!/usr/bin/env bash
# Flakiness as a measured property: runs the whole test suite (`make test`) N times in a
# row (default 5) while a busy loop holds one core (pinned to the last CPU), and lists
# every test that failed even once. Each run's output and JUnit file go to OUT (default
# target/hog-runs/<date>). docs/reliability.md, "Flaky tests", lists what such runs
# found. Run it from a checkout whose `make test` passes; it takes N times a run.
#   scripts/hog-runs.sh [N] [OUT]
set -uo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
out=${2:-target/hog-runs/$(date +%Y%m%d-%H%M%S)}
mkdir -p "$out"
cpu=$(($(nproc) - 1))
taskset -c "$cpu" sh -c 'while :; do :; done' &
hog=$!
trap 'kill "$hog" 2>/dev/null; wait "$hog" 2>/dev/null' EXIT
echo "hog-runs: a busy loop (pid $hog) on CPU $cpu; $runs runs into $out"
for i in $(seq 1 "$runs"); do
    start=$SECONDS
    make test >"$out/run$i.log" 2>&1
    status=$?
    cp target/nextest/default/junit.xml "$out/run$i.junit.xml" 2>/dev/null
    echo "hog-runs: run $i: exit $status in $((SECONDS - start)) s: $(grep '^forkvm: ' "$out/run$i.log" | tail -1)"
done
python3 - "$out" "$runs" <<'EOF'
import sys, glob, xml.etree.ElementTree as ET
out, runs = sys.argv[1], int(sys.argv[2])
failed = {}
for path in sorted(glob.glob(f"{out}/run*.junit.xml")):
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.find("failure") is not None or case.find("error") is not None:
            name = f"{case.get('classname')} {case.get('name')}"
            failed.setdefault(name, []).append(path.rsplit("/", 1)[-1].split(".")[0])
print(f"hog-runs: {len(failed)} tests failed at least once in {runs} runs")
for name, where in sorted(failed.items()):
    print(f"  {name}: {', '.join(where)}")
EOF
