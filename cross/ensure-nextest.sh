#!/usr/bin/env bash
# cargo-nextest, the test runner of cross/test.sh and cross/test-arm.sh
# (one process per test, hung tests killed: .config/nextest.toml).
# Installed only when missing; the demo does not need it.
set -euo pipefail
if ! cargo nextest --version >/dev/null 2>&1; then
  echo "test: installing cargo-nextest (a few minutes: it is compiled)"
  cargo install --locked cargo-nextest
fi
