#!/bin/sh
# Install edgespool from this tarball on a system without dpkg (Yocto,
# Buildroot, Alpine, Fedora, ...). The tarball holds the same files as the
# .deb, in the same places, beside this script.
#
#   sudo ./install.sh               install; an existing /etc/edgespool/edgespool.toml is kept
#   sudo ./install.sh --uninstall   remove the files; keeps /var/lib/edgespool and the user
#   sudo ./install.sh --purge       also the state (/var/lib/edgespool, the spool!) and the user
#   DESTDIR=/tmp/root ./install.sh  only copy the files under DESTDIR (no user, no systemctl):
#                                   an image; its first boot creates the user and group
#                                   (sysusers.d) and sets the directories' owners and
#                                   modes (tmpfiles.d), as the .deb's postinst does
#
# Where systemd runs, the unit is enabled but not started: edit the config
# (mqtt.url; device_id is "@machine-id": unique per board), then
# `systemctl start edgespool`.
set -eu

here=$(cd "$(dirname "$0")" && pwd)
D=${DESTDIR:-}
mode=install
case "${1:-}" in
    "") ;;
    --uninstall) mode=uninstall ;;
    --purge) mode=purge ;;
    *) echo "usage: $0 [--uninstall | --purge]" >&2; exit 2 ;;
esac
if [ -z "$D" ] && [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: run as root (or set DESTDIR)" >&2
    exit 1
fi
have_systemd() { [ -z "$D" ] && [ -d /run/systemd/system ] && command -v systemctl >/dev/null 2>&1; }

# path in the tarball : installed mode
files="usr/bin/edgespool:0755
lib/systemd/system/edgespool.service:0644
usr/lib/sysusers.d/edgespool.conf:0644
usr/lib/tmpfiles.d/edgespool.conf:0644
lib/systemd/system/edgespool-sink@.service:0644
usr/share/man/man1/edgespool.1.gz:0644
usr/share/bash-completion/completions/edgespool:0644
usr/share/zsh/vendor-completions/_edgespool:0644
usr/share/fish/vendor_completions.d/edgespool.fish:0644
usr/share/doc/edgespool/copyright:0644
usr/share/doc/edgespool/changelog.gz:0644
usr/share/doc/edgespool/README.md:0644
usr/share/doc/edgespool/docs/benchmarks.md:0644
usr/share/doc/edgespool/docs/commands.md:0644
usr/share/doc/edgespool/docs/config.md:0644
usr/share/doc/edgespool/docs/delivery.md:0644
usr/share/doc/edgespool/docs/development.md:0644
usr/share/doc/edgespool/docs/flash.md:0644
usr/share/doc/edgespool/docs/fleet.md:0644
usr/share/doc/edgespool/docs/install.md:0644
usr/share/doc/edgespool/docs/invariants.md:0644
usr/share/doc/edgespool/docs/local-programs.md:0644
usr/share/doc/edgespool/docs/operations.md:0644
usr/share/doc/edgespool/examples/example.toml:0644
usr/share/doc/edgespool/examples/sink.toml:0644
usr/share/doc/edgespool/examples/edgespool.service.d/devices.conf:0644
usr/share/doc/edgespool/examples/edgespool.service.d/exec-handlers.conf:0644
usr/share/doc/edgespool/examples/edgespool.service.d/metrics-textfile.conf:0644
usr/share/doc/edgespool/examples/grafana/edgespool.json:0644
usr/share/doc/edgespool/examples/prometheus/edgespool-alerts.yml:0644
usr/share/doc/edgespool/examples/prometheus/edgespool-alerts.test.yml:0644"

if [ "$mode" != install ]; then
    if have_systemd; then
        systemctl disable --now edgespool.service >/dev/null 2>&1 || true
        # Running sink instances (enabled ones are the operator's to disable).
        systemctl stop 'edgespool-sink@*.service' >/dev/null 2>&1 || true
    fi
    for f in $files; do rm -f "$D/${f%:*}"; done
    rmdir "$D/usr/share/doc/edgespool/examples/edgespool.service.d" \
        "$D/usr/share/doc/edgespool/examples/grafana" \
        "$D/usr/share/doc/edgespool/examples/prometheus" \
        "$D/usr/share/doc/edgespool/examples" "$D/usr/share/doc/edgespool/docs" \
        "$D/usr/share/doc/edgespool" 2>/dev/null || true
    have_systemd && systemctl daemon-reload || true
    if [ "$mode" = purge ]; then
        rm -rf "$D/var/lib/edgespool" "$D/etc/edgespool"
        if [ -z "$D" ] && id edgespool >/dev/null 2>&1; then
            userdel edgespool 2>/dev/null || deluser edgespool 2>/dev/null || true
            groupdel edgespool 2>/dev/null || delgroup edgespool 2>/dev/null || true
        fi
        echo "edgespool: removed, with its state and user"
    else
        echo "edgespool: removed; kept /etc/edgespool, /var/lib/edgespool and the user (--purge deletes them)"
    fi
    exit 0
fi

for f in $files; do
    p=${f%:*}
    mkdir -p "$D/$(dirname "$p")"
    cp "$here/$p" "$D/$p.new-$$"
    chmod "${f##*:}" "$D/$p.new-$$"
    mv -f "$D/$p.new-$$" "$D/$p"
done

# The system user (no login, home = the state directory).
if [ -z "$D" ] && ! id edgespool >/dev/null 2>&1; then
    nologin=/usr/sbin/nologin
    [ -x "$nologin" ] || nologin=/sbin/nologin
    if command -v useradd >/dev/null 2>&1; then
        useradd --system --user-group --home-dir /var/lib/edgespool --no-create-home \
            --shell "$nologin" --comment "edgespool agent" edgespool
    elif command -v adduser >/dev/null 2>&1 && command -v addgroup >/dev/null 2>&1; then
        # BusyBox
        addgroup -S edgespool
        adduser -S -D -H -h /var/lib/edgespool -s "$nologin" -G edgespool edgespool
    else
        echo "install.sh: no useradd or adduser: create the user edgespool yourself" >&2
    fi
fi
grp=root
[ -z "$D" ] && id edgespool >/dev/null 2>&1 && grp=edgespool

# State: 0750, owned by the agent.
mkdir -p "$D/var/lib/edgespool"
chmod 0750 "$D/var/lib/edgespool"
[ "$grp" = edgespool ] && chown edgespool:edgespool "$D/var/lib/edgespool"

# The config: root writes it, the agent's group reads it. Never overwritten.
mkdir -p "$D/etc/edgespool"
chmod 0750 "$D/etc/edgespool"
chgrp "$grp" "$D/etc/edgespool"
if [ -e "$D/etc/edgespool/edgespool.toml" ]; then
    cp "$here/etc/edgespool/edgespool.toml" "$D/etc/edgespool/edgespool.toml.dist"
    chmod 0640 "$D/etc/edgespool/edgespool.toml.dist"
    echo "edgespool: kept /etc/edgespool/edgespool.toml; the shipped one is edgespool.toml.dist"
else
    cp "$here/etc/edgespool/edgespool.toml" "$D/etc/edgespool/edgespool.toml"
    chmod 0640 "$D/etc/edgespool/edgespool.toml"
    chgrp "$grp" "$D/etc/edgespool/edgespool.toml"
fi

if have_systemd; then
    systemctl daemon-reload
    systemctl enable edgespool.service >/dev/null 2>&1 || true
    echo "edgespool: installed and enabled; edit /etc/edgespool/edgespool.toml, then: systemctl start edgespool"
else
    echo "edgespool: installed. Without systemd, run as the user edgespool with umask 027:"
    echo "  edgespool run --config /etc/edgespool/edgespool.toml"
fi
