#!/usr/bin/env bash
# Installs what the coverage-guided fuzz runs need, only when it is missing: Rust nightly
# (libFuzzer's sanitizer coverage needs it) and cargo-fuzz, at a fixed version.
set -euo pipefail
cargo_fuzz_version=0.13.2
if ! cargo +nightly --version >/dev/null 2>&1; then
    echo "install-fuzz: installing Rust nightly (rustup)" >&2
    rustup toolchain install nightly --profile minimal
fi
if ! cargo fuzz --version 2>/dev/null | grep -q "$cargo_fuzz_version"; then
    echo "install-fuzz: installing cargo-fuzz $cargo_fuzz_version" >&2
    cargo install cargo-fuzz --locked --version "$cargo_fuzz_version"
fi
