#!/usr/bin/env bash
# From a fresh clone: the static (musl) edgespool binaries, the .deb packages
# and the plain tarballs, with their sizes.
#   cross/package.sh                    every target
#   cross/package.sh armv6 x86_64       some (x86_64 | aarch64 | armv7 | armv6)
# Output in ${CARGO_TARGET_DIR:-target}/dist/:
#   edgespool-<target>                  the stripped static binary, to copy to a board
#   edgespool_<version>_<arch>.deb      amd64 (x86_64), arm64 (aarch64), armhf (armv6:
#                                       Raspberry Pi OS armhf is ARMv6; runs on ARMv7 too)
#   edgespool-<version>-<target>.tar.gz the same files as the .deb, with install.sh
# Installs what is missing first, and only what this build uses: the host's
# C compiler and `file` (Debian packages), Zig and cargo-zigbuild (PyPI
# wheels, in a virtualenv under the target directory: nothing global), the
# rustup targets; qemu-user only when an ARM binary is built. Not the test
# stack (cross/setup-debian.sh), no cross compiler.
#   PACKAGE_LIST=1 cross/package.sh [target...]   print the Debian packages
#                                                 it would install, and exit
set -euo pipefail
cd "$(dirname "$0")/.."

ZIGLANG_VERSION=0.17.1
ZIGBUILD_VERSION=0.24.1

all=(x86_64 aarch64 armv7 armv6)
want=("$@")
[ "${#want[@]}" -gt 0 ] || want=("${all[@]}")
triple() {
  case "$1" in
    x86_64) echo x86_64-unknown-linux-musl ;;
    aarch64) echo aarch64-unknown-linux-musl ;;
    armv7) echo armv7-unknown-linux-musleabihf ;;
    armv6) echo arm-unknown-linux-musleabihf ;;
    *) echo "usage: $0 [x86_64|aarch64|armv7|armv6]..." >&2; exit 2 ;;
  esac
}
for w in "${want[@]}"; do triple "$w" >/dev/null; done

tdir="${CARGO_TARGET_DIR:-target}"
case "$tdir" in /*) ;; *) tdir="$PWD/$tdir" ;; esac
dist="$tdir/dist"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
# The packages' changelog (Debian's format, installed as changelog.gz) opens
# with the version being packaged.
changelog_version=$(sed -n '1s/^edgespool (\([^)]*\)) .*/\1/p' packaging/changelog)
if [ "$changelog_version" != "$version" ]; then
  echo "package: packaging/changelog's latest entry is ${changelog_version:-unreadable}, Cargo.toml says $version: add an entry for $version" >&2
  exit 1
fi

# --- what the build needs -------------------------------------------------
sudo_if_needed() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }
# gcc and libc6-dev: build scripts (and proc macros) are compiled for this
# machine and linked by its cc; `file`: the static check below. Python with
# venv (Debian's, or one already on PATH such as pyenv's) for Zig.
pkgs=(gcc libc6-dev file)
python3 -c 'import venv, ensurepip' 2>/dev/null || pkgs+=(python3 python3-venv)
# The summary below runs each binary's --version: ARM ones under qemu-user.
for w in "${want[@]}"; do
  [ "$w" = x86_64 ] || { pkgs+=(qemu-user); break; }
done
if [ "${PACKAGE_LIST:-0}" = 1 ]; then
  printf '%s\n' "${pkgs[@]}"
  exit 0
fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
  echo "package: installing ${missing[*]}"
  sudo_if_needed apt-get update -qq
  sudo_if_needed env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
if ! command -v cargo >/dev/null; then
  echo "package: cargo not found; install Rust with rustup first (https://rustup.rs)" >&2
  exit 1
fi
# Zig is the C compiler and linker for every target: it carries musl for
# each architecture, so the bundled SQLite and ring compile and link
# statically with no per-target cross toolchain. Both it and cargo-zigbuild
# are prebuilt wheels on PyPI: a virtualenv of its own holds them (about
# 15 s, nothing compiled, nothing installed outside the target directory).
venv="$tdir/zig-venv"
if ! "$venv/bin/python3" -m ziglang version >/dev/null 2>&1 \
  || [ "$("$venv/bin/cargo-zigbuild" --version 2>/dev/null)" != "cargo-zigbuild $ZIGBUILD_VERSION" ]; then
  echo "package: installing Zig and cargo-zigbuild (PyPI ziglang==$ZIGLANG_VERSION, cargo-zigbuild==$ZIGBUILD_VERSION) into $venv"
  python3 -m venv "$venv"
  "$venv/bin/python3" -m pip install -q --disable-pip-version-check \
    "ziglang==$ZIGLANG_VERSION" "cargo-zigbuild==$ZIGBUILD_VERSION"
fi
# cargo finds its zigbuild subcommand, and cargo-zigbuild finds Zig
# (`python3 -m ziglang`), here first.
export PATH="$venv/bin:$PATH"

# --- static binaries ------------------------------------------------------
mkdir -p "$dist"
installed_targets=$(rustup target list --installed 2>/dev/null || true)
build() {
  local t; t=$(triple "$1")
  local cmd=(cargo zigbuild --release --target "$t" --bin edgespool)
  # Boards carry the agent, not the PostgreSQL sink (feature pg-sink, about
  # 0.7 MB): only the x86_64 build, where fleet sinks run, keeps it.
  [ "$1" = x86_64 ] || cmd+=(--no-default-features)
  # zstd batches (about 110 KB of code) and the SQLite sink fit aarch64;
  # armv7 and armv6 keep to their size budget without them (lz4 batches
  # work everywhere; `edgespool sink` there says it is not in the build).
  [ "$1" = aarch64 ] && cmd+=(--features zstd,sink)
  local env=() rustflags=""
  if ! grep -qx "$t" <<<"$installed_targets" && ! rustup target add "$t" >/dev/null 2>&1; then
    # No prebuilt standard library for this target from rustup: build it
    # from rust-src (nightly's -Zbuild-std, enabled on stable by
    # RUSTC_BOOTSTRAP for this one command). Without the self-contained
    # crt objects rustc would name, Zig's musl supplies them.
    echo "package: no prebuilt std for $t; building it from rust-src"
    rustup component add rust-src >/dev/null 2>&1
    env+=(RUSTC_BOOTSTRAP=1)
    rustflags="-C link-self-contained=no"
    cmd+=(-Zbuild-std=std,panic_abort)
    # std's own size-over-speed choices (its default panic-unwind is not
    # needed: every build here aborts on panic).
    cmd+=(-Zbuild-std-features=optimize_for_size)
  fi
  if [ "$1" = armv7 ]; then
    # Thumb-2 code, as Debian's armhf compilers emit by default: about a
    # fifth smaller than ARM code (3.5 MB -> 2.8 MB), within the 3 MB budget.
    rustflags="${rustflags:+$rustflags }-C target-feature=+thumb-mode"
    env+=("CFLAGS_${t//-/_}=-mthumb")
    # And optimised for size over speed (opt-level z, -Oz for SQLite's C):
    # a Pi Zero 2's bottleneck is the SD card, not the CPU.
    env+=(CARGO_PROFILE_RELEASE_OPT_LEVEL=z)
  fi
  [ -z "$rustflags" ] || env+=("CARGO_TARGET_$(tr 'a-z-' 'A-Z_' <<<"$t")_RUSTFLAGS=$rustflags")
  echo "== $t"
  env "${env[@]}" "${cmd[@]}"
  cp "$tdir/$t/release/edgespool" "$dist/edgespool-$1"
  if ! file "$dist/edgespool-$1" | grep -Eq 'statically linked|static-pie linked'; then
    echo "package: $dist/edgespool-$1 is not statically linked: $(file -b "$dist/edgespool-$1")" >&2
    exit 1
  fi
}
for w in "${want[@]}"; do build "$w"; done

# --- packages -------------------------------------------------------------
# SOURCE_DATE_EPOCH (the commit's time) keeps the archives' dates stable.
export SOURCE_DATE_EPOCH="${SOURCE_DATE_EPOCH:-$(git log -1 --format=%ct 2>/dev/null || date +%s)}"

# The installed tree, the same for the .deb and the tarball.
stage() {
  local root=$1 bin=$2
  rm -rf "$root"
  install -D -m 0755 "$bin" "$root/usr/bin/edgespool"
  install -D -m 0644 packaging/edgespool.service "$root/lib/systemd/system/edgespool.service"
  # The user and the directories' modes for image builds, applied at boot
  # by systemd-sysusers and systemd-tmpfiles (the .deb's postinst does the
  # same at install time).
  install -D -m 0644 packaging/edgespool.sysusers "$root/usr/lib/sysusers.d/edgespool.conf"
  install -D -m 0644 packaging/edgespool.tmpfiles "$root/usr/lib/tmpfiles.d/edgespool.conf"
  # The sink as a service, one instance per /etc/edgespool/sink-NAME.toml
  # (not enabled: a board runs the agent; a fleet host enables instances).
  install -D -m 0644 packaging/edgespool-sink@.service "$root/lib/systemd/system/edgespool-sink@.service"
  install -d -m 0750 "$root/etc/edgespool"
  install -m 0640 board-configs/edgespool.toml "$root/etc/edgespool/edgespool.toml"
  install -d -m 0755 "$root/usr/share/man/man1"
  sed "s/@VERSION@/$version/" packaging/edgespool.1 | gzip -9n >"$root/usr/share/man/man1/edgespool.1.gz"
  chmod 0644 "$root/usr/share/man/man1/edgespool.1.gz"
  install -D -m 0644 packaging/edgespool.bash "$root/usr/share/bash-completion/completions/edgespool"
  install -D -m 0644 packaging/_edgespool "$root/usr/share/zsh/vendor-completions/_edgespool"
  install -D -m 0644 packaging/edgespool.fish "$root/usr/share/fish/vendor_completions.d/edgespool.fish"
  local doc="$root/usr/share/doc/edgespool"
  install -D -m 0644 packaging/copyright "$doc/copyright"
  # A native package's changelog is changelog.gz (Debian Policy 12.7).
  gzip -9n <packaging/changelog >"$doc/changelog.gz"
  chmod 0644 "$doc/changelog.gz"
  install -D -m 0644 README.md "$doc/README.md"
  install -D -m 0644 -t "$doc/docs" docs/*.md   # the README links to them
  install -D -m 0644 board-configs/example.toml "$doc/examples/example.toml"
  install -D -m 0644 packaging/sink.toml "$doc/examples/sink.toml"
  install -D -m 0644 -t "$doc/examples/edgespool.service.d" packaging/edgespool.service.d/*.conf
  # The Grafana dashboard and the Prometheus alert rules (README, "Dashboard and alerts").
  install -D -m 0644 packaging/grafana/edgespool.json "$doc/examples/grafana/edgespool.json"
  install -D -m 0644 packaging/prometheus/edgespool-alerts.yml "$doc/examples/prometheus/edgespool-alerts.yml"
  install -D -m 0644 packaging/prometheus/edgespool-alerts.test.yml "$doc/examples/prometheus/edgespool-alerts.test.yml"
  find "$root" -type d -exec chmod go-w {} +
}

deb() {
  local w=$1 arch=$2
  local root="$tdir/pkg/deb-$arch"
  stage "$root" "$dist/edgespool-$w"
  install -d -m 0755 "$root/DEBIAN"
  install -m 0755 packaging/deb/postinst packaging/deb/prerm packaging/deb/postrm "$root/DEBIAN/"
  # What lintian reports and is meant, each with its reason.
  install -D -m 0644 packaging/lintian-overrides "$root/usr/share/lintian/overrides/edgespool"
  echo /etc/edgespool/edgespool.toml >"$root/DEBIAN/conffiles"
  (cd "$root" && find . -type f ! -path './DEBIAN/*' ! -path './etc/*' -printf '%P\0' | sort -z | xargs -0 md5sum) >"$root/DEBIAN/md5sums"
  cat >"$root/DEBIAN/control" <<CONTROL
Package: edgespool
Version: $version
Architecture: $arch
Maintainer: edgespool maintainers <edgespool@users.noreply.github.com>
Installed-Size: $(du -sk --exclude=DEBIAN "$root" | cut -f1)
Depends: adduser
Suggests: mosquitto, mosquitto-clients
Section: net
Priority: optional
Description: store-and-forward agent for Linux gateways (SQLite spool to MQTT)
 edgespool takes readings on a board (system sensors, files, programs),
 stores each one in a SQLite spool on local flash, publishes them over MQTT
 QoS 1 and deletes a reading only after the broker acknowledged it.
 .
 One static binary; a hardened systemd unit (Type=notify, watchdog) running
 as the system user edgespool, with its state in /var/lib/edgespool.
CONTROL
  dpkg-deb --root-owner-group -Zxz --build "$root" "$dist/edgespool_${version}_${arch}.deb" >/dev/null
}

tarball() {
  local w=$1 t; t=$(triple "$1")
  local name="edgespool-$version-${t/-unknown/}"
  local root="$tdir/pkg/tar/$name"
  stage "$root" "$dist/edgespool-$w"
  install -m 0755 packaging/install.sh "$root/install.sh"
  tar --sort=name --mtime="@$SOURCE_DATE_EPOCH" --owner=0 --group=0 --numeric-owner \
    -C "$tdir/pkg/tar" -czf "$dist/$name.tar.gz" "$name"
}

for w in "${want[@]}"; do
  case "$w" in
    x86_64) deb x86_64 amd64 ;;
    aarch64) deb aarch64 arm64 ;;
    armv6) deb armv6 armhf ;;
  esac
  tarball "$w"
done

# --- what was built -------------------------------------------------------
echo
echo "== artifacts in $dist"
for w in "${want[@]}"; do
  b="$dist/edgespool-$w"
  case "$w" in
    x86_64) run=() ;;
    aarch64) run=(qemu-aarch64) ;;
    armv7) run=(qemu-arm -cpu cortex-a7) ;;
    armv6) run=(qemu-arm -cpu arm1176) ;;
  esac
  ver=$("${run[@]}" "$b" --version)
  printf '%-46s %9d bytes  %s; %s\n' "$(basename "$b")" "$(stat -c %s "$b")" \
    "$(file -b "$b" | sed 's/, BuildID[^,]*//; s/, version 1 (SYSV)//')" "$ver"
done
for f in "$dist"/*.deb "$dist"/*.tar.gz; do
  [ -e "$f" ] && printf '%-46s %9d bytes\n' "$(basename "$f")" "$(stat -c %s "$f")"
done
if printf '%s\n' "${want[@]}" | grep -qx armv7; then
  size=$(stat -c %s "$dist/edgespool-armv7")
  if [ "$size" -gt 3000000 ]; then
    echo "package: the armv7 binary is $size bytes, over the 3 MB budget" >&2
    exit 1
  fi
fi
