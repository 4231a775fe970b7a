#!/usr/bin/env bash
# The public crates' API against the release of the workspace's current version
# (docs/library.md, "Versions"): cargo-semver-checks compares each crate with the commit
# that set `version = "X"` in Cargo.toml, so a change that breaks a user of forkvm,
# api-types or forkvm-client fails until the workspace version says so (0.x: the minor).
# A crate that did not exist at that commit is new: nothing to compare.
#
# Its builds (each crate's rustdoc at the release and now, with their dependencies) go
# to SEMVER_TARGET_DIR (default /var/cache/forkvm/semver-target, outside the checkout,
# as the fuzz targets' build does): a clean clone rebuilds only its own crates' rustdoc
# (about 6 s here, against 45 s with the checkout's own target directory). Where that
# directory cannot be made, the checkout's target directory is used.
set -euo pipefail
cd "$(dirname "$0")/.."
crates=(forkvm api-types forkvm-client)
target_dir=${SEMVER_TARGET_DIR:-/var/cache/forkvm/semver-target}
if mkdir -p "$target_dir" 2>/dev/null && [ -w "$target_dir" ]; then
    export CARGO_TARGET_DIR=$target_dir
fi
if ! cargo semver-checks --version >/dev/null 2>&1; then
    echo "semver-check: cargo-semver-checks is missing: ./scripts/install-deps.sh test installs it" >&2
    exit 1
fi
if [ "$(git rev-parse --is-shallow-repository)" = true ]; then
    echo "semver-check: a shallow clone has no release to compare with; skipped" >&2
    exit 0
fi
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
# The oldest commit whose Cargo.toml changed the count of this line: where it was set.
release=$(git log --format=%H -S"version = \"$version\"" -- Cargo.toml | tail -1)
if [ -z "$release" ]; then
    echo "semver-check: no commit sets version $version in Cargo.toml" >&2
    exit 1
fi
echo "semver-check: the public crates at $version against ${release:0:12}, which set it"
for crate in "${crates[@]}"; do
    manifest=$(cargo metadata --no-deps --format-version 1 |
        python3 -c "import json,sys; print(next(p['manifest_path'] for p in json.load(sys.stdin)['packages'] if p['name']=='$crate'))")
    dir=$(dirname "${manifest#"$PWD"/}")
    if ! git cat-file -e "$release:$dir/Cargo.toml" 2>/dev/null; then
        echo "semver-check: $crate is new since ${release:0:12}"
        continue
    fi
    cargo semver-checks -p "$crate" --baseline-rev "$release"
done
