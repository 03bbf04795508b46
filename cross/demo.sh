#!/usr/bin/env bash
# Run edgespool's main job on this machine's real readings (board-configs/
# local-demo.toml: /proc and /sys system sensors every 2 s) against a local
# mosquitto on 127.0.0.1:1883, print what the broker receives, then show the
# spool's status. Installs what is missing first.
#   cross/demo.sh            run for 30 s
#   DEMO_SECS=0 cross/demo.sh  run until Ctrl-C
set -euo pipefail
cd "$(dirname "$0")/.."
cross/setup-debian.sh --demo
cargo build --release
bin="${CARGO_TARGET_DIR:-target}/release/edgespool"
cfg=board-configs/local-demo.toml
"$bin" check-config "$cfg"

pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap cleanup EXIT

if ! (exec 3<>/dev/tcp/127.0.0.1/1883) 2>/dev/null; then
  echo "demo: starting mosquitto on 127.0.0.1:1883"
  conf=$(mktemp)
  printf 'listener 1883 127.0.0.1\nallow_anonymous true\n' > "$conf"
  [ "$(id -u)" -eq 0 ] && echo "user root" >> "$conf"
  "$(command -v mosquitto || echo /usr/sbin/mosquitto)" -c "$conf" >/dev/null 2>&1 &
  pids+=($!)
  for _ in $(seq 50); do (exec 3<>/dev/tcp/127.0.0.1/1883) 2>/dev/null && break; sleep 0.1; done
fi

mosquitto_sub -h 127.0.0.1 -p 1883 -q 1 -v -t 'edgespool/local-demo/#' &
pids+=($!)

secs=${DEMO_SECS:-30}
echo "demo: running edgespool (spool ./demo-data/spool.db) $( [ "$secs" = 0 ] && echo 'until Ctrl-C' || echo "for ${secs} s")"
"$bin" run --config "$cfg" &
agent=$!
if [ "$secs" = 0 ]; then
  wait "$agent" || true
else
  sleep "$secs"
  kill -TERM "$agent"
  wait "$agent"
fi
echo
"$bin" status --config "$cfg"
