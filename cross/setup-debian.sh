#!/usr/bin/env bash
# Install what edgespool's build, demo and tests need on a fresh Debian machine.
#   cross/setup-debian.sh          host build + tests: mosquitto, sqlite3, strace (flash bench),
#                                  faketime (command tests), postgresql (PostgreSQL sink
#                                  tests and bench; the service is not started: tests run
#                                  their own server), rustfmt, clippy,
#                                  nodejs/npm and aedes (a second broker for the tests),
#                                  socat (the ingest socket client of docs/local-programs.md),
#                                  prometheus (promtool; the dashboard and alert tests
#                                  run their own server: the service is not started)
#   cross/setup-debian.sh --arm    also the ARM cross toolchains and qemu-user
# Safe to run again: it installs only what is missing.
set -euo pipefail

want_arm=0
for a in "$@"; do
  case "$a" in
    --arm) want_arm=1 ;;
    *) echo "usage: $0 [--arm]" >&2; exit 2 ;;
  esac
done

sudo_if_needed() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else echo "setup: need root (or sudo) to install: $*" >&2; exit 1
  fi
}

# faketime: libfaketime steps the agent's wall clock in the command tests.
# postgresql: initdb/pg_ctl under /usr/lib/postgresql/*/bin and the `postgres` user.
# socat: the shell client of the ingest socket (docs/local-programs.md).
# prometheus: the server and promtool for tests/it/dashboards.rs.
pkgs=(mosquitto mosquitto-clients sqlite3 gcc libc6-dev openssl strace faketime postgresql socat prometheus)
if [ "$want_arm" = 1 ]; then
  pkgs+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross gcc-arm-linux-gnueabihf libc6-dev-armhf-cross qemu-user)
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found; install Rust with rustup first" >&2
  exit 1
fi
if command -v rustup >/dev/null; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
  if [ "$want_arm" = 1 ]; then
    rustup target add aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf >/dev/null
  fi
fi
# aedes, the second broker implementation the tests run against
# (tests/it/aedes.rs), from the npm registry at the version in its lock file.
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  echo "setup: installing nodejs and npm"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
fi
aedes_dir="$(dirname "$0")/../tests/fixtures/aedes"
if [ ! -d "$aedes_dir/node_modules/aedes" ]; then
  echo "setup: installing aedes (npm ci in tests/fixtures/aedes)"
  (cd "$aedes_dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi

echo "setup: ok"
