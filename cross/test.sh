#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what is missing
# (mosquitto, the ARM cross compilers, qemu-user, rustup targets), then runs
# the unit and integration tests on this host, then the ARM builds under
# qemu-user (cross/test-arm.sh), then the static binaries and the packages
# (cross/test-package.sh: installs and purges the amd64 .deb on this
# machine). Run as root. The integration tests start their own mosquitto
# brokers on free loopback ports.
#   EDGESPOOL_SKIP_ARM=1 cross/test.sh        host only (and the amd64 package)
#   EDGESPOOL_SKIP_PACKAGE=1 cross/test.sh    without the packages
#   EDGESPOOL_SKIP_FUZZ=1 cross/test.sh       without the fuzz smoke
set -euo pipefail
cd "$(dirname "$0")/.."
# Root: the storage tests mount tmpfs filesystems and a loop-mounted ext4
# image, and cross/test-package.sh installs the .deb.
if [ "$(id -u)" -ne 0 ]; then
  echo "test: run as root (sudo cross/test.sh): the storage tests mount tmpfs and loop images, the package test runs dpkg -i" >&2
  exit 1
fi
if [ "${EDGESPOOL_SKIP_ARM:-0}" = 1 ]; then cross/setup-debian.sh; else cross/setup-debian.sh --arm; fi
# Library, binary and integration tests (not the benchmarks, which print
# figures and are run on their own: cargo bench --bench flash). cargo-nextest
# runs every test in its own process, kills a hung one after 10 minutes and
# retries a failure once, reporting it as FLAKY (.config/nextest.toml).
cross/ensure-nextest.sh
cargo nextest run --profile ci --lib --bins --test it
# The network-loss rig is a program, not a libtest harness: bounded here
# as nextest bounds the others.
timeout 1800 cargo test --test rig
# Fuzz smoke: every parser's fuzz target built (nightly, cargo-fuzz; its own
# workspace and target directory) and run reproducibly: 20,000 mutations
# from a fixed seed each, spool_open over its seeds and past crashes only;
# about 8 min on a 2-core machine, most of it the first sanitizer build.
# Exploring for new crashes is fuzz/run.sh 600. EDGESPOOL_SKIP_FUZZ=1 skips it.
if [ "${EDGESPOOL_SKIP_FUZZ:-0}" != 1 ]; then
  FUZZ_RUNS=20000 fuzz/run.sh
fi
if [ "${EDGESPOOL_SKIP_ARM:-0}" != 1 ]; then
  cross/test-arm.sh
fi
if [ "${EDGESPOOL_SKIP_PACKAGE:-0}" != 1 ]; then
  cross/test-package.sh
fi
