#!/usr/bin/env bash
# The ARM builds under qemu-user: the unit tests cross-compiled for each
# target, then integration tests with the ARM agent binary (run by qemu)
# against mosquitto on this host: on armv7 the delivery, crash-safety,
# command and MQTT 5 tests, the ingest socket's, the bridge's and the lz4
# batches' first test, and a short network-loss rig schedule; on aarch64 a
# smoke set (delivery, crash-safety, MQTT 5, one command and the lz4 test).
#   cross/test-arm.sh              both targets
#   cross/test-arm.sh armv7        one (aarch64 | armv7)
set -euo pipefail
cd "$(dirname "$0")/.."
cross/setup-debian.sh --arm
cross/ensure-nextest.sh
targets=(aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf)
case "${1:-}" in
  aarch64) targets=(aarch64-unknown-linux-gnu) ;;
  armv7) targets=(armv7-unknown-linux-gnueabihf) ;;
  "") ;;
  *) echo "usage: $0 [aarch64|armv7]" >&2; exit 2 ;;
esac
# Honour CARGO_TARGET_DIR like cargo does (absolute, or relative to here).
tdir="${CARGO_TARGET_DIR:-target}"
case "$tdir" in /*) ;; *) tdir="$PWD/$tdir" ;; esac
for t in "${targets[@]}"; do
  case "$t" in
    aarch64*) runner="qemu-aarch64 -L /usr/aarch64-linux-gnu" ;;
    armv7*) runner="qemu-arm -L /usr/arm-linux-gnueabihf" ;;
  esac
  echo "== $t: unit tests under qemu"
  # The sink stays in the ARM test builds (the rig runs it under qemu);
  # only the armv7 and armv6 packages leave it out (cross/package.sh).
  EDGESPOOL_UNDER_QEMU=1 cargo nextest run --profile ci --target "$t" --lib --no-default-features --features sink
  # Heavy set on armv7 (the board most fielded, and the 3 MB budget); a smoke
  # set on aarch64, whose code paths differ only in word size. The command
  # tests run on armv7 here and on the static armv6 agent in
  # cross/test-package.sh.
  filter='test(/^(delivery|faults|mqtt5)::/) | test(/^commands::a_thousand_redeliveries/) | test(/^batches::an_lz4/)'
  if [[ "$t" == armv7* ]]; then
    filter='test(/^(delivery|faults|commands|mqtt5)::/) | test(/^ingest::socket_and_tcp/) | test(/^bridge::json_messages/) | test(/^batches::an_lz4/)'
  fi
  echo "== $t: integration tests, agent under qemu"
  cargo build --target "$t" --bin edgespool --no-default-features --features sink
  EDGESPOOL_AGENT_BIN="$tdir/$t/debug/edgespool" EDGESPOOL_AGENT_RUNNER="$runner" \
    cargo nextest run --profile ci --test it -E "$filter"
  if [[ "$t" == armv7* ]]; then
    echo "== $t: a short network-loss rig schedule, agent and sink under qemu"
    EDGESPOOL_AGENT_BIN="$tdir/$t/debug/edgespool" EDGESPOOL_AGENT_RUNNER="$runner" RIG_FAULTS=8 \
      timeout 1800 cargo test --test rig
  fi
done
