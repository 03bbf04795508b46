#!/usr/bin/env bash
# The whole test suite, from a fresh Debian machine: installs what is missing
# (mosquitto and friends), then runs the unit and integration tests. The
# integration tests start their own mosquitto brokers on free ports.
set -euo pipefail
cd "$(dirname "$0")/.."
cross/setup-debian.sh
# Library, binary and integration tests (not the benchmark, which prints
# figures and is run on its own: cargo bench --bench throughput).
cargo test --lib --bins --tests -- --test-threads=2
