#!/usr/bin/env bash
# The packages and static binaries, tested on this machine (root needed):
#  1. builds them (cross/package.sh; a no-op for what is already built);
#  2. lintian on the amd64 .deb (no error, no warning; overrides with their
#     reasons in packaging/lintian-overrides), then installs it with dpkg -i
#     and checks the user, files, modes
#     and the conffile, runs `check-config` and `test` as the user edgespool, runs the
#     agent as the service would (user edgespool, umask 027, /etc and /usr
#     read-only, $STATE_DIRECTORY) against a local mosquitto and checks that
#     it wrote only to /var/lib/edgespool with modes 0640/0750 at most;
#     `systemd-analyze verify` on the unit and on the drop-in examples; an
#     upgrade keeps an edited conffile; dpkg -r keeps the state and the user,
#     dpkg -P removes the state and the package's files and keeps the
#     operator's files and the user; install.sh from the tarball lays the same files;
#     a DESTDIR install (an image) carries the sysusers.d and tmpfiles.d
#     snippets, which systemd-sysusers/systemd-tmpfiles --root turn into the
#     user, group, owners and modes the .deb gives;
#  3. runs the static ARM binaries under qemu-user: --version, then the
#     delivery, crash and command integration tests with each of them as the
#     agent (the ARMv6 one under `qemu-arm -cpu arm1176`, a Pi Zero/1's CPU:
#     an ARMv7-only instruction would fault).
#   cross/test-package.sh              everything
#   EDGESPOOL_SKIP_ARM=1 cross/test-package.sh   the amd64 package only
#   EDGESPOOL_PACKAGE_REUSE=1 cross/test-package.sh   test target/dist as it is, no build
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" -ne 0 ]; then echo "test-package: needs root (dpkg -i)" >&2; exit 1; fi

targets=(x86_64 aarch64 armv7 armv6)
[ "${EDGESPOOL_SKIP_ARM:-0}" = 1 ] && targets=(x86_64)
# The test stack (mosquitto for the agent run below, lintian); package.sh
# installs only what the build needs.
cross/setup-debian.sh
# EDGESPOOL_PACKAGE_REUSE=1: test what target/dist already holds.
[ "${EDGESPOOL_PACKAGE_REUSE:-0}" = 1 ] || cross/package.sh "${targets[@]}"
if ! command -v systemd-analyze >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends systemd >/dev/null
fi

tdir="${CARGO_TARGET_DIR:-target}"
case "$tdir" in /*) ;; *) tdir="$PWD/$tdir" ;; esac
dist="$tdir/dist"
version=$(sed -n 's/^version = "\(.*\)"/\1/p' Cargo.toml | head -1)
deb="$dist/edgespool_${version}_amd64.deb"
work=$(mktemp -d)
pids=()
installed_by_us=0
user_made_here=0
inst_installed=""
cleanup() {
  # install.sh's own install, if a check failed before its --purge.
  if [ -n "$inst_installed" ]; then "$inst_installed" --purge >/dev/null 2>&1 || true; fi
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  # A test that stopped half-way leaves no package, user or state behind.
  if [ "$installed_by_us" = 1 ] && dpkg-query -W edgespool >/dev/null 2>&1; then
    dpkg -P edgespool >/dev/null 2>&1 || true
  fi
  # Purge keeps the system user: the one this test made goes here.
  if [ "$user_made_here" = 1 ]; then
    userdel edgespool >/dev/null 2>&1 || true
    groupdel edgespool >/dev/null 2>&1 || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT

fails=0
passes=0
ok() { echo "  ok: $*"; passes=$((passes + 1)); }
bad() { echo "  FAIL: $*"; fails=$((fails + 1)); }
check() { local what=$1; shift; if "$@"; then ok "$what"; else bad "$what"; fi; }
mode_is() {
  local fmt='%a %U:%G'
  [[ "$2" =~ ^[0-7]+\ [0-9]+:[0-9]+$ ]] && fmt='%a %u:%g' # numeric: an image's own ids
  [ "$(stat -c "$fmt" "$1")" = "$2" ] || { echo "    $1: $(stat -c "$fmt" "$1"), want $2"; return 1; }
}
# No bit beyond 0640 for files, 0750 for directories.
private() {
  local f m
  while IFS= read -r f; do
    m=$(stat -c %a "$f")
    if [ -d "$f" ]; then (( (8#$m & ~8#750) == 0 )) || { echo "    $f: $m"; return 1; }
    else (( (8#$m & ~8#640) == 0 )) || { echo "    $f: $m"; return 1; }; fi
  done < <(find "$1")
}

# An image built with `DESTDIR=$1 install.sh`: the sysusers.d and tmpfiles.d
# snippets are there and, applied to the tree by systemd-sysusers --root and
# systemd-tmpfiles --root (what the first boot does; neither boots systemd),
# give the user, group, owners and modes the .deb's postinst gives.
image_checks() {
  local r=$1
  check "image: sysusers.d snippet" cmp -s "$r/usr/lib/sysusers.d/edgespool.conf" packaging/edgespool.sysusers
  check "image: tmpfiles.d snippet" cmp -s "$r/usr/lib/tmpfiles.d/edgespool.conf" packaging/edgespool.tmpfiles
  check "image: no user made at install time" test ! -e "$r/etc/passwd"
  if ! command -v systemd-sysusers >/dev/null || ! command -v systemd-tmpfiles >/dev/null; then
    echo "  (no systemd-sysusers/systemd-tmpfiles here: the first-boot checks are skipped)"
    return 0
  fi
  check "image: systemd-sysusers --root accepts the snippet" \
    systemd-sysusers --root="$r" "$r/usr/lib/sysusers.d/edgespool.conf"
  local uid gid
  IFS=: read -r _ _ uid gid _ _ _ < <(grep '^edgespool:' "$r/etc/passwd" 2>/dev/null) || true
  check "image: first boot makes the system user edgespool, home /var/lib/edgespool, no login" bash -c \
    "IFS=: read -r _ _ u _ _ home shell < <(grep '^edgespool:' '$r/etc/passwd') && [ \"\$u\" -lt 1000 ] && [ \"\$home\" = /var/lib/edgespool ] && [[ \"\$shell\" == */nologin ]]"
  check "image: and the group edgespool" grep -q "^edgespool:x:$gid:" "$r/etc/group"
  check "image: systemd-tmpfiles --root --create accepts the snippet" \
    systemd-tmpfiles --root="$r" --create "$r/usr/lib/tmpfiles.d/edgespool.conf"
  check "image: /var/lib/edgespool 750 edgespool:edgespool" mode_is "$r/var/lib/edgespool" "750 $uid:$gid"
  check "image: /etc/edgespool 750 root:edgespool" mode_is "$r/etc/edgespool" "750 0:$gid"
  check "image: /etc/edgespool/edgespool.toml 640 root:edgespool" mode_is "$r/etc/edgespool/edgespool.toml" "640 0:$gid"
}

echo "== the amd64 package: install"
# This test purges what it installs, spool included: never on a machine
# where edgespool was installed for real.
if dpkg-query -W -f='${Status}' edgespool 2>/dev/null | grep -q 'ok installed\|config-files'; then
  if [ "${EDGESPOOL_PACKAGE_TEST_PURGE:-0}" != 1 ]; then
    echo "test-package: edgespool is installed here; its spool would be purged." >&2
    echo "  EDGESPOOL_PACKAGE_TEST_PURGE=1 cross/test-package.sh to purge it and test anyway" >&2
    exit 1
  fi
  dpkg -P edgespool >/dev/null
fi
echo "== lintian"
lintian --fail-on error,warning "$deb" >"$work/lintian" 2>&1 && lrc=0 || lrc=$?
grep -v '^running with root privileges' "$work/lintian" | sed 's/^/    /' || true
check "lintian: no error, no warning" bash -c "[ $lrc = 0 ] && ! grep -q '^[EW]: ' '$work/lintian'"
check "lintian: every override has its reason" bash -c \
  "dpkg-deb --fsys-tarfile '$deb' | tar -xO ./usr/share/lintian/overrides/edgespool | awk '/^edgespool: / { if (prev !~ /^#/ && prev !~ /^edgespool: /) bad = 1 } { prev = \$0 } END { exit bad }'"

installed_by_us=1
check "no edgespool user before the install" bash -c '! getent passwd edgespool >/dev/null'
user_made_here=1
dpkg -i "$deb" </dev/null
check "the package is installed" bash -c "dpkg-query -W -f='\${Status}' edgespool | grep -q 'install ok installed'"
check "system user edgespool, home /var/lib/edgespool, no login" bash -c \
  'IFS=: read -r _ _ uid _ _ home shell < <(getent passwd edgespool) && [ "$uid" -lt 1000 ] && [ "$home" = /var/lib/edgespool ] && [[ "$shell" == */nologin || "$shell" == /bin/false ]]'
check "group edgespool" bash -c 'getent group edgespool >/dev/null'
check "/usr/bin/edgespool 755 root:root" mode_is /usr/bin/edgespool "755 root:root"
check "/usr/bin/edgespool is static" bash -c 'file -b /usr/bin/edgespool | grep -Eq "statically linked|static-pie linked"'
check "the unit 644 root:root" mode_is /lib/systemd/system/edgespool.service "644 root:root"
check "sysusers.d and tmpfiles.d snippets 644 root:root" bash -c \
  "$(declare -f mode_is); mode_is /usr/lib/sysusers.d/edgespool.conf '644 root:root' && mode_is /usr/lib/tmpfiles.d/edgespool.conf '644 root:root'"
check "/etc/edgespool 750 root:edgespool" mode_is /etc/edgespool "750 root:edgespool"
check "/etc/edgespool/edgespool.toml 640 root:edgespool" mode_is /etc/edgespool/edgespool.toml "640 root:edgespool"
check "/var/lib/edgespool 750 edgespool:edgespool" mode_is /var/lib/edgespool "750 edgespool:edgespool"
check "the config is a conffile" bash -c "dpkg-query -W -f='\${Conffiles}' edgespool | grep -q '^ /etc/edgespool/edgespool.toml '"
check "the config is the shipped one" cmp -s /etc/edgespool/edgespool.toml board-configs/edgespool.toml
check "man page edgespool(1), gzipped" gzip -t /usr/share/man/man1/edgespool.1.gz
check "changelog.gz opens with this version" bash -c \
  "zcat /usr/share/doc/edgespool/changelog.gz | head -1 | grep -q '^edgespool ($version) '"
check "the maintainer is no localhost" bash -c "! dpkg-query -W -f='\${Maintainer}' edgespool | grep -q localhost"
check "bash completion" bash -c 'source /usr/share/bash-completion/completions/edgespool 2>/dev/null; complete -p edgespool | grep -q _edgespool'
check "zsh and fish completions, as generated" bash -c \
  'cmp -s /usr/share/zsh/vendor-completions/_edgespool packaging/_edgespool && cmp -s /usr/share/fish/vendor_completions.d/edgespool.fish packaging/edgespool.fish'
check "drop-in examples" test -f /usr/share/doc/edgespool/examples/edgespool.service.d/exec-handlers.conf
check "the Grafana dashboard and the alert rules" bash -c 'cmp -s /usr/share/doc/edgespool/examples/grafana/edgespool.json packaging/grafana/edgespool.json && cmp -s /usr/share/doc/edgespool/examples/prometheus/edgespool-alerts.yml packaging/prometheus/edgespool-alerts.yml && cmp -s /usr/share/doc/edgespool/examples/prometheus/edgespool-alerts.test.yml packaging/prometheus/edgespool-alerts.test.yml'
check "enabled for multi-user.target" test -L /etc/systemd/system/multi-user.target.wants/edgespool.service
check "check-config as the user edgespool" \
  runuser -u edgespool -- /usr/bin/edgespool check-config /etc/edgespool/edgespool.toml
check "test as the user edgespool: a reading from each source, nothing written" bash -c \
  'before=$(ls -A /var/lib/edgespool); runuser -u edgespool -- /usr/bin/edgespool test --config /etc/edgespool/edgespool.toml >/dev/null && [ "$(ls -A /var/lib/edgespool)" = "$before" ]'
check "the user edgespool cannot write /etc/edgespool" \
  runuser -u edgespool -- sh -c '! touch /etc/edgespool/x 2>/dev/null'

echo "== the unit"
check "systemd-analyze verify accepts the unit" bash -c \
  'out=$(systemd-analyze verify /lib/systemd/system/edgespool.service 2>&1) && rc=0 || rc=$?; [ -z "$out" ] || echo "$out" | sed "s/^/    /"; [ $rc = 0 ] && ! echo "$out" | grep -q edgespool.service'
for d in /usr/share/doc/edgespool/examples/edgespool.service.d/*.conf; do
  # The unit with a drop-in's settings appended: its keys must be known.
  grep -v '^\[Service\]' "$d" >"$work/dropin"
  sed "/^\[Install\]/e cat $work/dropin" /lib/systemd/system/edgespool.service >"$work/edgespool.service"
  check "systemd-analyze verify accepts the drop-in $(basename "$d")" bash -c \
    "out=\$(systemd-analyze verify '$work/edgespool.service' 2>&1) && rc=0 || rc=\$?; [ -z \"\$out\" ] || echo \"\$out\" | sed 's/^/    /'; [ \$rc = 0 ] && ! echo \"\$out\" | grep -q edgespool.service"
done
for k in Type=notify NotifyAccess=main WatchdogSec=120 \
  'ExecStart=/usr/bin/edgespool run --config /etc/edgespool/edgespool.toml' \
  'ExecReload=/bin/kill -HUP $MAINPID' Restart=on-failure RestartPreventExitStatus=2 \
  User=edgespool Group=edgespool StateDirectory=edgespool UMask=0027 ProtectSystem=strict \
  ProtectHome=yes PrivateTmp=yes NoNewPrivileges=yes ReadWritePaths=/var/lib/edgespool \
  CapabilityBoundingSet= PrivateDevices=yes SystemCallFilter=@system-service; do
  check "unit: $k" grep -qxF "$k" /lib/systemd/system/edgespool.service
done
# The installed units as systemd scores them (docs/install.md gives the
# figures): at most 2.0 each, on a scale where 10 is wide open.
for u in edgespool.service edgespool-sink@fleet.service; do
  score=$(systemd-analyze security --offline=yes --no-pager "$u" 2>/dev/null \
    | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
  check "systemd-analyze security: $u ${score:-?} (at most 2.0)" \
    awk "BEGIN { exit !(\"${score:-99}\" + 0 <= 2.0) }"
done

echo "== the agent as the service runs it"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
printf 'listener %s 127.0.0.1\nallow_anonymous true\nuser root\n' "$port" >"$work/mosquitto.conf"
"$(command -v mosquitto || echo /usr/sbin/mosquitto)" -c "$work/mosquitto.conf" >/dev/null 2>&1 &
pids+=($!)
for _ in $(seq 50); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
# A machine without /etc/machine-id (a container image, a chroot) gets one
# the way a board's first boot does, so the packaged config has an id to use.
if [ ! -s /etc/machine-id ] || grep -qx uninitialized /etc/machine-id; then
  systemd-machine-id-setup >/dev/null 2>&1 || tr -d '-' </proc/sys/kernel/random/uuid >/etc/machine-id
fi
# device_id = "@machine-id": this machine's own id, never the machine id.
dev=$(/usr/bin/edgespool check-config /etc/edgespool/edgespool.toml 2>/dev/null | sed -n 's/.*: ok (device \([^ ]*\) from @machine-id: \/etc\/machine-id,.*/\1/p')
check "the packaged config's device_id comes from /etc/machine-id" bash -c "[[ '$dev' =~ ^es-[0-9a-f]{12}\$ ]]"
if command -v systemd-id128 >/dev/null; then
  check "device_id is systemd's app-specific id of this machine" bash -c \
    "[ '$dev' = \"es-\$(systemd-id128 machine-id --app-specific=59059745eaf64aef817b21555c34a3fb | cut -c1-12)\" ]"
fi
timeout 20 mosquitto_sub -h 127.0.0.1 -p "$port" -q 1 -C 1 -t "edgespool/$dev/events/#" >"$work/received" &
sub=$!
pids+=($sub)
sleep 0.5
find /etc /usr -newer "$work/mosquitto.conf" -print 2>/dev/null >"$work/etc-before" || true
# ProtectSystem=strict, by hand: /etc and /usr read-only in a mount namespace.
unshare --mount --propagation private sh -c "
  mount --bind /etc /etc && mount -o remount,bind,ro /etc &&
  mount --bind /usr /usr && mount -o remount,bind,ro /usr &&
  exec runuser -u edgespool -- env STATE_DIRECTORY=/var/lib/edgespool RUST_LOG=info \
    sh -c 'umask 0027; exec timeout --preserve-status -s TERM 8 /usr/bin/edgespool run --config /etc/edgespool/edgespool.toml --set mqtt.url=mqtt://127.0.0.1:$port --set sources.0.interval_ms=500'
" >"$work/agent.log" 2>&1 && rc=0 || rc=$?
check "the agent stopped cleanly on SIGTERM (exit 0)" bash -c "[ $rc = 0 ] && grep -q 'stopped cleanly' '$work/agent.log'"
wait "$sub" || true
check "the broker received an event from the packaged agent" grep -q event_id "$work/received"
check "the agent's first log line names its device_id and where it came from" bash -c \
  "head -1 '$work/agent.log' | grep -qF 'starting: device_id $dev (from @machine-id: /etc/machine-id)'"
check "the raw machine id is in nothing published" bash -c "! grep -q \"\$(cat /etc/machine-id)\" '$work/received'"
# One caution is this rig's own set-up and expected: a broker on
# 127.0.0.1 in puback mode. The packaged config's command channel is safe
# as shipped (unsigned commands with a side effect are refused): no WARN.
check "no WARN or ERROR from the packaged agent (but its start-up caution about a local broker)" bash -c "! grep -E ' (WARN|ERROR) ' '$work/agent.log' | grep -v -e 'mqtt.url points at a broker on this board' | grep -q ."
check "the spool is in /var/lib/edgespool" test -f /var/lib/edgespool/spool.db
check "the last-known-good config is in /var/lib/edgespool" \
  cmp -s /var/lib/edgespool/edgespool.toml.last-good /etc/edgespool/edgespool.toml
check "nothing written to /etc/edgespool" bash -c '[ "$(ls -A /etc/edgespool)" = edgespool.toml ]'
check "every file the agent made is 0640/0750 at most, owned by edgespool" bash -c \
  "$(declare -f private); private /var/lib/edgespool && [ -z \"\$(find /var/lib/edgespool ! -user edgespool)\" ]"
ls -la /var/lib/edgespool | sed 's/^/    /'
check "status reads the spool as the user edgespool" \
  runuser -u edgespool -- /usr/bin/edgespool status --config /etc/edgespool/edgespool.toml
if [ "${fails}" -gt 0 ]; then sed 's/^/    agent: /' "$work/agent.log"; fi

echo "== upgrade keeps an edited conffile"
sed -i 's/^device_id = .*/device_id = "edited-board"/' /etc/edgespool/edgespool.toml
up="$work/up"
dpkg-deb -R "$deb" "$up"
sed -i "s/^Version: .*/Version: ${version}+test1/" "$up/DEBIAN/control"
dpkg-deb --root-owner-group -Zxz --build "$up" "$work/edgespool_up.deb" >/dev/null
dpkg -i "$work/edgespool_up.deb" </dev/null
check "the upgrade is installed" bash -c "[ \"\$(dpkg-query -W -f='\${Version}' edgespool)\" = '${version}+test1' ]"
check "the edited conffile was kept" grep -qx 'device_id = "edited-board"' /etc/edgespool/edgespool.toml
check "modes survive the upgrade" mode_is /etc/edgespool/edgespool.toml "640 root:edgespool"

echo "== remove keeps the state, purge removes it"
dpkg -r edgespool </dev/null >/dev/null
check "remove: binary gone" test ! -e /usr/bin/edgespool
check "remove: the spool kept" test -f /var/lib/edgespool/spool.db
check "remove: the user kept" bash -c 'getent passwd edgespool >/dev/null'
# Something of the operator's in /etc/edgespool: purge leaves it (and the
# directory) where dpkg deletes the conffile.
echo '# an operator file' >/etc/edgespool/sink-fleet.toml
dpkg -P edgespool </dev/null >/dev/null 2>"$work/purge.err"
check "purge: says it kept /etc/edgespool" grep -q 'kept /etc/edgespool' "$work/purge.err"
check "purge: the conffile is gone" test ! -e /etc/edgespool/edgespool.toml
check "purge: only the operator's file is left in /etc/edgespool" bash -c '[ "$(ls -A /etc/edgespool)" = sink-fleet.toml ]'
rm -f /etc/edgespool/sink-fleet.toml
rmdir /etc/edgespool 2>/dev/null || true
check "purge: the package is gone" bash -c '! dpkg-query -W -f="\${Status}" edgespool 2>/dev/null | grep -q installed'
check "purge: the system user edgespool is kept" bash -c 'getent passwd edgespool >/dev/null'
check "purge: the group edgespool is kept" bash -c 'getent group edgespool >/dev/null'
check "purge: /var/lib/edgespool is gone" test ! -e /var/lib/edgespool
check "purge: the unit's enable link is gone" test ! -e /etc/systemd/system/multi-user.target.wants/edgespool.service
# The kept user is this test's to remove: install.sh below creates its own.
userdel edgespool >/dev/null 2>&1 || true
groupdel edgespool >/dev/null 2>&1 || true
user_made_here=0

echo "== the tarball's install.sh lays the .deb's files"
tarball="$dist/edgespool-$version-x86_64-linux-musl.tar.gz"
tar -C "$work" -xzf "$tarball"
DESTDIR="$work/root" "$work/edgespool-$version-x86_64-linux-musl/install.sh" >/dev/null
(cd "$work/root" && find . -type f | sed 's|^\./|/|' | sort) >"$work/tar-files"
# The lintian overrides are the .deb's own.
dpkg-deb -c "$deb" | awk '$1 !~ /^d/ {print substr($6, 2)}' | grep -v '^/usr/share/lintian/' | sort >"$work/deb-files"
check "install.sh installs the files of the .deb" diff "$work/deb-files" "$work/tar-files"
check "install.sh: config 0640" bash -c "[ \"\$(stat -c %a '$work/root/etc/edgespool/edgespool.toml')\" = 640 ]"
check "the .deb ships the sysusers.d and tmpfiles.d snippets" bash -c \
  "grep -qx /usr/lib/sysusers.d/edgespool.conf '$work/deb-files' && grep -qx /usr/lib/tmpfiles.d/edgespool.conf '$work/deb-files'"
DESTDIR="$work/image" "$work/edgespool-$version-x86_64-linux-musl/install.sh" >/dev/null
image_checks "$work/image"
DESTDIR="$work/root" "$work/edgespool-$version-x86_64-linux-musl/install.sh" --uninstall >/dev/null
check "install.sh --uninstall keeps only the config and state" bash -c \
  "[ -z \"\$(cd '$work/root' && find . -type f ! -path './etc/edgespool/*')\" ]"
inst="$work/edgespool-$version-x86_64-linux-musl/install.sh"
inst_installed="$inst"
"$inst" >/dev/null
check "install.sh: user edgespool created" bash -c 'getent passwd edgespool >/dev/null'
check "install.sh: /etc/edgespool/edgespool.toml 640 root:edgespool" mode_is /etc/edgespool/edgespool.toml "640 root:edgespool"
check "install.sh: /var/lib/edgespool 750 edgespool:edgespool" mode_is /var/lib/edgespool "750 edgespool:edgespool"
check "install.sh: check-config as the user edgespool" \
  runuser -u edgespool -- /usr/bin/edgespool check-config /etc/edgespool/edgespool.toml
"$inst" --purge >/dev/null
inst_installed=""
check "install.sh --purge: user, state and files gone" bash -c \
  '! getent passwd edgespool && [ ! -e /var/lib/edgespool ] && [ ! -e /etc/edgespool ] && [ ! -e /usr/bin/edgespool ]'

if [ "${EDGESPOOL_SKIP_ARM:-0}" != 1 ]; then
  echo "== static ARM binaries under qemu-user"
  for w in aarch64 armv7 armv6; do
    b="$dist/edgespool-$w"
    case "$w" in
      aarch64) run="qemu-aarch64" ;;
      armv7) run="qemu-arm -cpu cortex-a7" ;;
      armv6) run="qemu-arm -cpu arm1176" ;;
    esac
    check "$w: statically linked" bash -c "file -b '$b' | grep -Eq 'statically linked|static-pie linked'"
    check "$w: --version under $run" bash -c "$run '$b' --version | grep -qx 'edgespool $version'"
  done
  check "armv7 binary at most 3 MB" bash -c "[ \$(stat -c %s '$dist/edgespool-armv7') -le 3000000 ]"
  check "armv6 binary is ARMv6 (Tag_CPU_arch: v6)" bash -c "readelf -A '$dist/edgespool-armv6' | grep -q 'Tag_CPU_arch: v6\$'"
fi

echo "test-package: $passes passed, $fails failed"
[ "$fails" -eq 0 ] || exit 1

if [ "${EDGESPOOL_SKIP_ARM:-0}" != 1 ]; then
  # The shipped binaries themselves, not debug builds. The armv6 agent runs
  # the delivery, crash and command tests (no other stage runs ARMv6 code);
  # the aarch64 and armv7 ones, whose debug builds ran the heavier sets in
  # cross/test-arm.sh, a smoke set of delivery and crash tests.
  for w in aarch64 armv7 armv6; do
    filter='test(/^(delivery|faults)::/)'
    [ "$w" = armv6 ] && filter='test(/^(delivery|faults|commands)::/)'
    case "$w" in
      aarch64) run="qemu-aarch64" ;;
      armv7) run="qemu-arm -cpu cortex-a7" ;;
      armv6) run="qemu-arm -cpu arm1176" ;;
    esac
    echo "== integration tests ($filter): static $w agent under $run"
    EDGESPOOL_AGENT_BIN="$dist/edgespool-$w" EDGESPOOL_AGENT_RUNNER="$run" \
      cargo nextest run --profile ci --test it -E "$filter"
  done
fi
