#!/usr/bin/env bash
# Installs what forkvm needs on Debian 12, only when something is missing.
# Needs root for apt-get (CI runs as root). Rust comes from rustup (1.85 or newer).
#   install-deps.sh         building and running forkvm: the guest kernel's and images'
#                           build tools (make deps, make demo, make install)
#   install-deps.sh test    that, and what the tests need (make test-deps, make test)
#   install-deps.sh bench   that, and the benchmarks' host baselines and plots (make bench)
set -euo pipefail
mode=${1:-run}
case "$mode" in
    run | test | bench) ;;
    *) echo "usage: install-deps.sh [test|bench]" >&2; exit 2 ;;
esac
# python3-pip and e2fsprogs also build package sets (forkvm::PackageCache) at run time.
pkgs=(linux-source-6.1 busybox-static bc bison flex libelf-dev libssl-dev cpio e2fsprogs
      gcc make binutils patch xz-utils lz4 python3 python3-pip iproute2)
if [ "$mode" = test ]; then
    # QEMU and hyperfine: the tests' side-by-side references; python3-venv: schemathesis
    # below; nfs-ganesha and rpcbind: the user-space NFS server of the shared-storage
    # tests, which start their own instances in namespaces (tests/src/nfs.rs).
    pkgs+=(qemu-system-x86 hyperfine python3-venv nfs-ganesha nfs-ganesha-vfs rpcbind)
    # The package-set tests build their own wheels, one with a C extension.
    pkgs+=(python3-setuptools python3-wheel python3-dev)
    # The containerd runtime's test starts its own containerd (tests/tests/containerd.rs),
    # whose CRI pods get their network from Debian's CNI plugins (bridge, host-local).
    pkgs+=(containerd containernetworking-plugins)
fi
if [ "$mode" = bench ]; then
    pkgs+=(python3-numpy python3-matplotlib)
fi
missing=()
for p in "${pkgs[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    echo "install-deps: installing ${missing[*]}" >&2
    if [ "$(id -u)" -ne 0 ]; then SUDO=sudo; else SUDO=; fi
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
    echo "install-deps: cargo not found: install Rust 1.85 or newer with rustup" >&2
    exit 1
fi
if [ "$mode" != test ]; then
    exit 0
fi
# cargo-nextest (crates.io), the test runner of `make test` (scripts/run-tests.sh),
# built once into cargo's bin directory; a different version is replaced.
nextest_version=0.9.133
if ! cargo nextest --version 2>/dev/null | grep -q "cargo-nextest $nextest_version"; then
    echo "install-deps: installing cargo-nextest $nextest_version (a few minutes)" >&2
    cargo install --locked --quiet cargo-nextest --version "$nextest_version"
fi
# cargo-semver-checks (crates.io), for the public crates' API check of CI
# (scripts/semver-check.sh), built once into cargo's bin directory like nextest.
semver_checks_version=0.51.0
if ! cargo semver-checks --version 2>/dev/null | grep -q "cargo-semver-checks $semver_checks_version"; then
    echo "install-deps: installing cargo-semver-checks $semver_checks_version (several minutes)" >&2
    cargo install --locked --quiet cargo-semver-checks --version "$semver_checks_version"
fi
# schemathesis (PyPI), for the API test against docs/api/openapi.yaml, in a virtual
# environment outside the repository, keyed by its version.
st_version=4.32.5
st_venv=/var/cache/forkvm/st-venv
if ! "$st_venv/bin/st" --version 2>/dev/null | grep -q "$st_version"; then
    echo "install-deps: installing schemathesis $st_version in $st_venv" >&2
    rm -rf "$st_venv"
    mkdir -p "$(dirname "$st_venv")"
    python3 -m venv "$st_venv"
    "$st_venv/bin/pip" install -q "schemathesis==$st_version"
fi
# crictl (cri-tools, from the Go module proxy), for the containerd runtime's CRI test,
# built once with the host's Go (/usr/local/go or PATH; Debian 12's golang is too old)
# into /var/cache/forkvm/bin, keyed by its version (in crictl.version: a build from the
# proxy reports none).
crictl_version=v1.37.0
crictl=/var/cache/forkvm/bin/crictl
if [ ! -x "$crictl" ] || [ "$(cat "$crictl.version" 2>/dev/null)" != "$crictl_version" ]; then
    go=$(command -v go || echo /usr/local/go/bin/go)
    if [ -x "$go" ]; then
        echo "install-deps: building crictl $crictl_version (a few minutes)" >&2
        mkdir -p "$(dirname "$crictl")"
        GOBIN=$(dirname "$crictl") "$go" install "sigs.k8s.io/cri-tools/cmd/crictl@$crictl_version"
        echo "$crictl_version" > "$crictl.version"
    else
        echo "install-deps: no Go toolchain: crictl is not built (the CRI test needs it)" >&2
    fi
fi
# containerd 2.x and its ctr (from the Go module proxy; Debian 12 ships 1.6), for the
# test that runs the shim under it, built like crictl into /var/cache/forkvm/bin/containerd2.
containerd2_version=v2.4.2
containerd2=/var/cache/forkvm/bin/containerd2
if [ ! -x "$containerd2/containerd" ] || [ ! -x "$containerd2/ctr" ] ||
    [ "$(cat "$containerd2/version" 2>/dev/null)" != "$containerd2_version" ]; then
    go=$(command -v go || echo /usr/local/go/bin/go)
    if [ -x "$go" ]; then
        echo "install-deps: building containerd $containerd2_version (a few minutes)" >&2
        rm -rf "$containerd2"
        mkdir -p "$containerd2"
        GOBIN=$containerd2 "$go" install \
            "github.com/containerd/containerd/v2/cmd/containerd@$containerd2_version" \
            "github.com/containerd/containerd/v2/cmd/ctr@$containerd2_version"
        echo "$containerd2_version" > "$containerd2/version"
    else
        echo "install-deps: no Go toolchain: containerd 2.x is not built (a containerd test needs it)" >&2
    fi
fi
