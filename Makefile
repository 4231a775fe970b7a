# forkvm: `make demo` builds everything and boots guests; `make test` runs every test;
# `make install` installs the programs and guest images under PREFIX.
.PHONY: all deps test-deps guest build release demo test lint semver bench fuzz fuzz-ci \
	clean-guest-cache install install-files install-shim install-shim-files uninstall

CARGO ?= cargo

all: build guest

# What building and running need (Debian packages; Rust from rustup).
deps:
	./scripts/install-deps.sh

# That, and what the tests need (QEMU, nfs-ganesha, cargo-nextest, schemathesis, ...).
test-deps:
	./scripts/install-deps.sh test

guest: deps
	./buildroot/build-guest.sh

build:
	$(CARGO) build --workspace --bins

# The programs `make install` installs (the benches build every program:
# `cargo build --release --workspace --bins`).
release:
	$(CARGO) build --release -p vmm-api -p jailer -p forkvm-gateway

demo: deps guest release
	./scripts/demo.sh

test: test-deps guest build
	./scripts/run-tests.sh

# PREFIX/bin: vmm, jailer, forkvm-gateway; PREFIX/share/forkvm: the guest images (the
# gateway finds its kernel and root image there by default); PREFIX/lib/systemd/system:
# forkvm-gateway.service. DESTDIR stages the whole tree elsewhere (packaging); BIN_DIR is
# where the programs are taken from (the tests install their debug build).
PREFIX ?= /usr/local
DESTDIR ?=
BIN_DIR ?= target/release
GUEST_FILES = vmlinux bzImage initramfs.cpio rootfs.ext4 python.ext4
install: release guest
	$(MAKE) install-files

install-files:
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/forkvm \
		$(DESTDIR)$(PREFIX)/lib/systemd/system
	install -m 0755 $(BIN_DIR)/vmm $(BIN_DIR)/jailer $(BIN_DIR)/forkvm-gateway \
		$(DESTDIR)$(PREFIX)/bin/
	cd target/guest && install -m 0644 $(GUEST_FILES) $(DESTDIR)$(PREFIX)/share/forkvm/
	sed 's|@PREFIX@|$(PREFIX)|g' scripts/forkvm-gateway.service.in \
		> $(DESTDIR)$(PREFIX)/lib/systemd/system/forkvm-gateway.service
	@echo "installed under $(DESTDIR)$(PREFIX): bin/{vmm,jailer,forkvm-gateway}, share/forkvm, lib/systemd/system/forkvm-gateway.service"

# containerd's runtime (docs/containerd.md), a target of its own: its containerd crates
# double the release build. PREFIX/bin: containerd-shim-forkvm-v2 and the vmm it runs
# (beside it); PREFIX/share/forkvm: the guest kernel and initramfs it boots.
install-shim: guest
	$(CARGO) build --release -p vmm-api -p containerd-shim-forkvm
	$(MAKE) install-shim-files

install-shim-files:
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/forkvm
	install -m 0755 $(BIN_DIR)/vmm $(BIN_DIR)/containerd-shim-forkvm-v2 $(DESTDIR)$(PREFIX)/bin/
	cd target/guest && install -m 0644 vmlinux initramfs.cpio $(DESTDIR)$(PREFIX)/share/forkvm/
	@echo "installed under $(DESTDIR)$(PREFIX): bin/{vmm,containerd-shim-forkvm-v2}, share/forkvm/{vmlinux,initramfs.cpio}"

uninstall:
	rm -f $(addprefix $(DESTDIR)$(PREFIX)/bin/,vmm jailer forkvm-gateway containerd-shim-forkvm-v2)
	rm -f $(addprefix $(DESTDIR)$(PREFIX)/share/forkvm/,$(GUEST_FILES))
	-rmdir $(DESTDIR)$(PREFIX)/share/forkvm
	rm -f $(DESTDIR)$(PREFIX)/lib/systemd/system/forkvm-gateway.service

lint:
	$(CARGO) fmt --check
	$(CARGO) clippy --all-targets -- -D warnings
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --workspace --quiet
	@# The monitor's core knows no HTTP and no command line (docs/design.md, "Crates").
	@if $(CARGO) tree -p vmm -e normal --prefix none | grep -qE '^(httparse|hyper|clap) '; then \
		echo "lint: vmm, the monitor's core, depends on an HTTP crate or a command-line parser" >&2; exit 1; fi

# The public crates (forkvm, api-types, forkvm-client) against the release of the
# workspace's version: a breaking change needs a version that says so (docs/library.md).
semver:
	./scripts/semver-check.sh

# Each fuzz target for FUZZ_SECONDS (60) on nightly Rust with cargo-fuzz
# (`rustup toolchain install nightly`, `cargo install cargo-fuzz`); new inputs that add
# coverage go to fuzz/corpus/<target>, crashes to fuzz/artifacts (docs/reliability.md).
FUZZ_SECONDS ?= 60
fuzz:
	cd fuzz && for t in $$(cargo +nightly fuzz list); do \
		cargo +nightly fuzz run -O $$t -- -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 || exit 1; \
	done

# What CI runs (.ci/run): each target for FUZZ_CI_SECONDS (10) from the committed corpus,
# which it leaves as it is (new inputs go to a scratch directory); a crash fails the run
# and leaves its input in fuzz/artifacts/<target>. The sanitizer build is kept outside the
# repository (FUZZ_TARGET_DIR), so a run after a small change rebuilds only what changed.
FUZZ_CI_SECONDS ?= 10
FUZZ_TARGET_DIR ?= /var/cache/forkvm/fuzz-target
fuzz-ci:
	./scripts/install-fuzz.sh
	./scripts/fuzz-ci.sh $(FUZZ_CI_SECONDS) $(FUZZ_TARGET_DIR)

# A short standard set (a few minutes); each bench has more (benches/*.py --help).
bench: deps guest release
	./scripts/install-deps.sh bench
	python3 benches/boot.py
	python3 benches/clone.py latency --runs 50 --mem 128
	python3 benches/clone.py fanout --counts 100 --dirs /dev/shm
	python3 benches/invoke.py latency --runs 50 --rounds 2
	/usr/bin/python3 benches/functions.py --runs 100 --rewind --plot docs/functions.png
