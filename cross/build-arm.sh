#!/usr/bin/env bash
# Build stripped, size-tuned release binaries for the boards and print their sizes.
#   cross/build-arm.sh              both targets
#   cross/build-arm.sh armv7        one (aarch64 | armv7)
# Installs the cross compilers, qemu-user and rustup targets first.
set -euo pipefail
cd "$(dirname "$0")/.."
cross/setup-debian.sh --arm
targets=(aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf)
case "${1:-}" in
  aarch64) targets=(aarch64-unknown-linux-gnu) ;;
  armv7) targets=(armv7-unknown-linux-gnueabihf) ;;
  "") ;;
  *) echo "usage: $0 [aarch64|armv7]" >&2; exit 2 ;;
esac
for t in "${targets[@]}"; do
  # --no-default-features: a board carries the agent, not the sink.
  cargo build --release --target "$t" --bin edgespool --no-default-features
  bin="${CARGO_TARGET_DIR:-target}/$t/release/edgespool"
  case "$t" in
    aarch64*) run=(qemu-aarch64 -L /usr/aarch64-linux-gnu) ;;
    armv7*) run=(qemu-arm -L /usr/arm-linux-gnueabihf) ;;
  esac
  ver=$("${run[@]}" "$bin" --version)
  printf '%-34s %9d bytes  %s  (%s under qemu)\n' "$t" "$(stat -c %s "$bin")" "$bin" "$ver"
done
