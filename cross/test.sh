#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what is missing
# (mosquitto, the ARM cross compilers, qemu-user, rustup targets), then runs
# the unit and integration tests on this host, then the ARM builds under
# qemu-user (cross/test-arm.sh). The integration tests start their own
# mosquitto brokers on free loopback ports.
#   EDGESPOOL_SKIP_ARM=1 cross/test.sh    host only
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${EDGESPOOL_SKIP_ARM:-0}" = 1 ]; then cross/setup-debian.sh; else cross/setup-debian.sh --arm; fi
# Library, binary and integration tests (not the benchmark, which prints
# figures and is run on its own: cargo bench --bench throughput).
cargo test --lib --bins --tests -- --test-threads=2
if [ "${EDGESPOOL_SKIP_ARM:-0}" != 1 ]; then
  cross/test-arm.sh
fi
