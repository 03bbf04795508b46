#!/usr/bin/env bash
# Install what edgespool needs on a fresh Debian machine, and nothing more
# than the job at hand:
#   cross/setup-debian.sh --demo   the build and the demo: gcc and libc headers (the bundled
#                                  SQLite is C), mosquitto and its clients
#   cross/setup-debian.sh          the whole test stack: the above, and sqlite3, openssl,
#                                  strace (flash bench), faketime (command tests), postgresql
#                                  (PostgreSQL sink tests and bench; tests run their own
#                                  server), socat (the ingest socket client of
#                                  docs/local-programs.md), prometheus (promtool; the
#                                  dashboard and alert tests run their own server), rustfmt,
#                                  clippy, nodejs/npm and aedes (a second broker for the tests),
#                                  lintian (cross/test-package.sh checks the .deb with it)
#   cross/setup-debian.sh --arm    the test stack, the ARM cross toolchains and qemu-user
#   SETUP_LIST=1 cross/setup-debian.sh [--demo|--arm]
#                                  print the Debian packages the mode wants and exit
# No service is started or enabled: a package's service (mosquitto,
# postgresql, prometheus) stays stopped and disabled when this script is what
# installed it (the demo and the tests start their own, on their own ports).
# Safe to run again: it installs only what is missing.
set -euo pipefail

mode=test
for a in "$@"; do
  case "$a" in
    --demo) mode=demo ;;
    --arm) mode=arm ;;
    *) echo "usage: $0 [--demo | --arm]" >&2; exit 2 ;;
  esac
done

sudo_if_needed() {
  if [ "$(id -u)" -eq 0 ]; then "$@"
  elif command -v sudo >/dev/null; then sudo "$@"
  else echo "setup: need root (or sudo) to install: $*" >&2; exit 1
  fi
}

pkgs=(gcc libc6-dev mosquitto mosquitto-clients)
if [ "$mode" != demo ]; then
  # faketime: libfaketime steps the agent's wall clock in the command tests.
  # postgresql: initdb/pg_ctl under /usr/lib/postgresql/*/bin and the `postgres` user.
  # socat: the shell client of the ingest socket (docs/local-programs.md).
  # prometheus: the server and promtool for tests/it/dashboards.rs.
  # lintian: cross/test-package.sh checks the .deb with it.
  pkgs+=(sqlite3 openssl strace faketime postgresql socat prometheus nodejs npm lintian)
fi
if [ "$mode" = arm ]; then
  pkgs+=(gcc-aarch64-linux-gnu libc6-dev-arm64-cross gcc-arm-linux-gnueabihf libc6-dev-armhf-cross qemu-user)
fi
if [ "${SETUP_LIST:-0}" = 1 ]; then
  printf '%s\n' "${pkgs[@]}"
  exit 0
fi

missing=()
for p in "${pkgs[@]}"; do
  if [ "$p" = nodejs ] || [ "$p" = npm ]; then
    # Any node and npm will do (NodeSource, nvm): only install Debian's when none is there.
    command -v "${p/nodejs/node}" >/dev/null && continue
  fi
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  # policy-rc.d answering 101 ("action forbidden") keeps the packages'
  # maintainer scripts from starting their services (invoke-rc.d(8),
  # deb-systemd-invoke); an administrator's own policy-rc.d is left alone.
  own_policy=0
  if [ ! -e /usr/sbin/policy-rc.d ]; then
    sudo_if_needed sh -c 'printf "#!/bin/sh\nexit 101\n" > /usr/sbin/policy-rc.d && chmod 0755 /usr/sbin/policy-rc.d'
    own_policy=1
  fi
  restore() { [ "$own_policy" = 1 ] && sudo_if_needed rm -f /usr/sbin/policy-rc.d; own_policy=0; }
  trap restore EXIT
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  restore
  trap - EXIT
  # Not enabled for the next boot either, when this script installed it.
  if command -v systemctl >/dev/null; then
    for p in "${missing[@]}"; do
      case "$p" in
        mosquitto|postgresql|prometheus)
          sudo_if_needed systemctl disable --quiet "$p.service" >/dev/null 2>&1 || true ;;
      esac
    done
  fi
fi

if ! command -v cargo >/dev/null; then
  echo "setup: cargo not found; install Rust with rustup first (https://rustup.rs)" >&2
  exit 1
fi
[ "$mode" = demo ] && { echo "setup: ok (demo)"; exit 0; }
if command -v rustup >/dev/null; then
  rustup component add rustfmt clippy >/dev/null 2>&1 || true
  if [ "$mode" = arm ]; then
    rustup target add aarch64-unknown-linux-gnu armv7-unknown-linux-gnueabihf >/dev/null
  fi
fi
# aedes, the second broker implementation the tests run against
# (tests/it/aedes.rs), from the npm registry at the version in its lock file.
aedes_dir="$(dirname "$0")/../tests/fixtures/aedes"
if [ ! -d "$aedes_dir/node_modules/aedes" ]; then
  echo "setup: installing aedes (npm ci in tests/fixtures/aedes)"
  (cd "$aedes_dir" && npm ci --no-audit --no-fund --loglevel=error >/dev/null)
fi

echo "setup: ok"
