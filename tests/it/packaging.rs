//! The Debian packaging as far as it can be checked without installing it
//! (cross/test-package.sh installs and purges the real .deb as root): the
//! maintainer scripts' decisions, run against stub `systemctl`,
//! `deb-systemd-invoke` and friends that record their calls; the units'
//! hardening as `systemd-analyze security --offline` scores it; the drop-in
//! examples; the changelog and maintainer; what a host package build
//! installs.
//!
//! The scripts run on a copy whose `/etc/`, `/var/` and `/run/` are moved
//! under a temporary directory, with a PATH of stubs and a few real tools
//! (`cut`, `mkdir`, `rm`, `rmdir`): a command they call that is neither
//! fails the test, and nothing outside the temporary directory is touched.

use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn read(rel: &str) -> String {
    std::fs::read_to_string(root().join(rel)).unwrap_or_else(|e| panic!("read {rel}: {e}"))
}

/// Records `NAME ARGS` for every call; `systemctl list-units` prints the
/// active sink instances of `$STUB_ACTIVE_SINKS` as `systemctl --plain
/// --no-legend` does; `getent` finds the user; `dpkg-statoverride --list`
/// finds no override; `deb-systemd-helper was-enabled` says yes.
const STUB: &str = r#"#!/bin/sh
name=${0##*/}
echo "$name $*" >>"$STUB_LOG"
case "$name $*" in
    "systemctl list-units"*)
        for u in $STUB_ACTIVE_SINKS; do
            echo "$u loaded active running edgespool sink ${u#edgespool-sink@}"
        done ;;
    "dpkg-statoverride"*) exit 1 ;;
esac
exit 0
"#;

const STUBBED: &[&str] = &[
    "systemctl",
    "deb-systemd-invoke",
    "deb-systemd-helper",
    "adduser",
    "getent",
    "chown",
    "chmod",
    "dpkg-statoverride",
    "deluser",
    "delgroup",
    "userdel",
    "groupdel",
];
const REAL: &[&str] = &["cut", "mkdir", "rm", "rmdir"];

/// A place to run the maintainer scripts: `root/` stands for `/`.
struct Rig {
    dir: tempfile::TempDir,
}

/// What a script run did: its exit status, stderr and the stubs' calls.
struct Run {
    ok: bool,
    stderr: String,
    calls: Vec<String>,
}

impl Run {
    fn called(&self, line: &str) -> bool {
        self.calls.iter().any(|c| c == line)
    }

    fn any_call(&self, prefix: &str) -> bool {
        self.calls.iter().any(|c| c.starts_with(prefix))
    }
}

impl Rig {
    fn new(systemd_running: bool) -> Rig {
        let dir = tempfile::tempdir().expect("tempdir");
        let bin = dir.path().join("bin");
        std::fs::create_dir_all(&bin).expect("mkdir bin");
        let stub = bin.join("stub");
        std::fs::write(&stub, STUB).expect("write stub");
        std::fs::set_permissions(&stub, std::fs::Permissions::from_mode(0o755)).expect("chmod");
        for name in STUBBED {
            std::os::unix::fs::symlink("stub", bin.join(name)).expect("stub link");
        }
        for name in REAL {
            let real = ["/usr/bin", "/bin"]
                .iter()
                .map(|d| Path::new(d).join(name))
                .find(|p| p.exists())
                .unwrap_or_else(|| panic!("{name} not found"));
            std::os::unix::fs::symlink(real, bin.join(name)).expect("tool link");
        }
        for d in ["root/etc", "root/var/lib", "root/run"] {
            std::fs::create_dir_all(dir.path().join(d)).expect("mkdir root");
        }
        if systemd_running {
            std::fs::create_dir_all(dir.path().join("root/run/systemd/system")).expect("mkdir");
        }
        Rig { dir }
    }

    fn path(&self, abs: &str) -> PathBuf {
        self.dir
            .path()
            .join("root")
            .join(abs.trim_start_matches('/'))
    }

    /// Runs packaging/deb/`script` with `args`, with `active_sinks` as the
    /// running sink instances.
    fn run(&self, script: &str, args: &[&str], active_sinks: &[&str]) -> Run {
        let text = read(&format!("packaging/deb/{script}"));
        let root = self.dir.path().join("root");
        let root = root.to_str().expect("utf-8 temp path");
        let mut moved = text;
        for top in ["/etc/", "/var/", "/run/"] {
            moved = moved.replace(top, &format!("{root}{top}"));
        }
        let copy = self.dir.path().join(script);
        std::fs::write(&copy, moved).expect("write script");
        let log = self.dir.path().join("calls");
        let _ = std::fs::remove_file(&log);
        let out = Command::new("/bin/sh")
            .arg(&copy)
            .args(args)
            .env_clear()
            .env("PATH", self.dir.path().join("bin"))
            .env("STUB_LOG", &log)
            .env("STUB_ACTIVE_SINKS", active_sinks.join(" "))
            .output()
            .expect("run /bin/sh");
        let calls = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(|l| l.replace(root, ""))
            .collect();
        Run {
            ok: out.status.success(),
            stderr: String::from_utf8_lossy(&out.stderr).replace(root, ""),
            calls,
        }
    }
}

#[test]
fn an_upgrade_restarts_the_agent_and_every_running_sink_instance_and_nothing_else() {
    let rig = Rig::new(true);
    let sinks = ["edgespool-sink@fleet.service", "edgespool-sink@lab.service"];
    // prerm of the old package: an upgrade stops nothing.
    let pre = rig.run("prerm", &["upgrade", "0.1.1"], &sinks);
    assert!(pre.ok, "{}", pre.stderr);
    assert!(!pre.any_call("deb-systemd-invoke"), "{:?}", pre.calls);
    let post = rig.run("postinst", &["configure", "0.0.9"], &sinks);
    assert!(post.ok, "{}", post.stderr);
    assert!(
        post.called("systemctl --system daemon-reload"),
        "{:?}",
        post.calls
    );
    assert!(
        post.called("deb-systemd-invoke restart edgespool.service"),
        "{:?}",
        post.calls
    );
    assert!(
        post.called(
            "deb-systemd-invoke try-restart edgespool-sink@fleet.service edgespool-sink@lab.service"
        ),
        "{:?}",
        post.calls
    );
    // The instances are asked for by the running ones only.
    assert!(
        post.calls
            .iter()
            .any(|c| c.starts_with("systemctl list-units")
                && c.contains("--state=active")
                && c.contains("edgespool-sink@*.service")),
        "{:?}",
        post.calls
    );
    // No sink running: none is started.
    let idle = rig.run("postinst", &["configure", "0.0.9"], &[]);
    assert!(idle.ok, "{}", idle.stderr);
    assert!(
        !idle.any_call("deb-systemd-invoke try-restart"),
        "{:?}",
        idle.calls
    );
}

#[test]
fn a_first_install_enables_and_starts_the_agent_and_leaves_the_sinks_alone() {
    let rig = Rig::new(true);
    let run = rig.run("postinst", &["configure", ""], &[]);
    assert!(run.ok, "{}", run.stderr);
    assert!(
        run.called("deb-systemd-helper enable edgespool.service"),
        "{:?}",
        run.calls
    );
    assert!(
        run.called("deb-systemd-invoke start edgespool.service"),
        "{:?}",
        run.calls
    );
    assert!(
        !run.any_call("deb-systemd-invoke try-restart"),
        "{:?}",
        run.calls
    );
    assert!(
        run.called("chown edgespool:edgespool /var/lib/edgespool"),
        "{:?}",
        run.calls
    );
    assert!(rig.path("/var/lib/edgespool").is_dir());
}

#[test]
fn remove_stops_the_agent_and_the_running_sinks_and_keeps_the_state() {
    let rig = Rig::new(true);
    let spool = rig.path("/var/lib/edgespool/spool.db");
    std::fs::create_dir_all(spool.parent().expect("parent")).expect("mkdir");
    std::fs::write(&spool, "readings").expect("write spool");
    let pre = rig.run("prerm", &["remove"], &["edgespool-sink@fleet.service"]);
    assert!(pre.ok, "{}", pre.stderr);
    assert!(
        pre.called("deb-systemd-invoke stop edgespool.service"),
        "{:?}",
        pre.calls
    );
    assert!(
        pre.called("deb-systemd-invoke stop edgespool-sink@fleet.service"),
        "{:?}",
        pre.calls
    );
    let post = rig.run("postrm", &["remove"], &[]);
    assert!(post.ok, "{}", post.stderr);
    assert!(
        post.called("deb-systemd-helper mask edgespool.service"),
        "{:?}",
        post.calls
    );
    assert!(spool.exists(), "remove keeps the spool");
}

#[test]
fn purge_deletes_the_state_and_the_agents_files_and_keeps_the_operators_files_and_the_user() {
    let rig = Rig::new(true);
    let files = [
        "/var/lib/edgespool/spool.db",
        "/var/lib/edgespool/storage-profile.json",
        "/etc/edgespool/edgespool.toml.last-good",
        "/etc/edgespool/sink-fleet.toml",
        "/etc/edgespool/broker.key",
    ];
    for f in files {
        let p = rig.path(f);
        std::fs::create_dir_all(p.parent().expect("parent")).expect("mkdir");
        std::fs::write(&p, f).expect("write");
    }
    let run = rig.run("postrm", &["purge"], &[]);
    assert!(run.ok, "{}", run.stderr);
    assert!(
        !rig.path("/var/lib/edgespool").exists(),
        "the state is deleted"
    );
    assert!(!rig.path("/etc/edgespool/edgespool.toml.last-good").exists());
    for kept in [
        "/etc/edgespool/sink-fleet.toml",
        "/etc/edgespool/broker.key",
    ] {
        assert!(
            rig.path(kept).exists(),
            "{kept}: the operator's file is kept"
        );
    }
    assert!(run.stderr.contains("kept /etc/edgespool"), "{}", run.stderr);
    assert!(
        run.called("deb-systemd-helper purge edgespool.service"),
        "{:?}",
        run.calls
    );
    for tool in ["deluser", "delgroup", "userdel", "groupdel"] {
        assert!(
            !run.any_call(tool),
            "purge keeps the system user: {:?}",
            run.calls
        );
    }
    // Nothing of the operator's left: the directory goes too.
    std::fs::remove_file(rig.path("/etc/edgespool/sink-fleet.toml")).expect("rm");
    std::fs::remove_file(rig.path("/etc/edgespool/broker.key")).expect("rm");
    let again = rig.run("postrm", &["purge"], &[]);
    assert!(again.ok, "{}", again.stderr);
    assert!(!rig.path("/etc/edgespool").exists());
}

#[test]
fn without_systemd_running_the_scripts_start_stop_and_reload_nothing() {
    let rig = Rig::new(false);
    let sinks = ["edgespool-sink@fleet.service"];
    for (script, args) in [
        ("postinst", &["configure", ""][..]),
        ("postinst", &["configure", "0.0.9"][..]),
        ("prerm", &["remove"][..]),
        ("postrm", &["remove"][..]),
    ] {
        let run = rig.run(script, args, &sinks);
        assert!(run.ok, "{script} {args:?}: {}", run.stderr);
        assert!(
            !run.any_call("systemctl") && !run.any_call("deb-systemd-invoke"),
            "{script} {args:?}: {:?}",
            run.calls
        );
    }
}

/// `systemd-analyze security --offline=yes` of `unit` (a unit file's text)
/// installed as `name`: the overall exposure, 0.0 (best) to 10.0.
fn exposure(name: &str, unit: &str) -> f64 {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join(name), unit).expect("write unit");
    let out = Command::new("systemd-analyze")
        .args(["security", "--offline=yes", "--no-pager", name])
        .current_dir(dir.path())
        .output()
        .expect("systemd-analyze (package systemd) must be installed");
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.contains("Overall exposure level"))
        .unwrap_or_else(|| {
            panic!(
                "no exposure line: {text}{}",
                String::from_utf8_lossy(&out.stderr)
            )
        });
    line.rsplit(": ")
        .next()
        .and_then(|t| t.split_whitespace().next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("exposure in {line}"))
}

/// The unit with a drop-in's `[Service]` lines added at the end of its
/// `[Service]` section, as systemd applies them.
fn with_drop_in(unit: &str, drop_in: &str) -> String {
    let extra: String = drop_in
        .lines()
        .filter(|l| l.trim() != "[Service]")
        .map(|l| format!("{l}\n"))
        .collect();
    unit.replace("\n[Install]", &format!("\n{extra}\n[Install]"))
}

/// systemd's major version (`systemd-analyze --version`): the scores'
/// weights are its own, so the docs' figures are those of one version.
fn systemd_version() -> Option<u32> {
    let out = Command::new("systemd-analyze")
        .arg("--version")
        .output()
        .ok()?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    text.split_whitespace().nth(1)?.parse().ok()
}

/// The version docs/install.md's scores were measured with.
const SCORED_WITH_SYSTEMD: u32 = 252;

#[test]
fn both_units_are_hardened_as_far_as_docs_install_md_says() {
    let agent = exposure("edgespool.service", &read("packaging/edgespool.service"));
    let sink = exposure(
        "edgespool-sink@fleet.service",
        &read("packaging/edgespool-sink@.service"),
    );
    // Issue 36 asked for the agent at the sink's exposure or better (the
    // sink was 6.7, the agent 8.5); both are far below it now.
    assert!(agent <= 2.0 && sink <= 2.0, "agent {agent}, sink {sink}");
    if systemd_version() == Some(SCORED_WITH_SYSTEMD) {
        let install = read("docs/install.md");
        assert!(install.contains(&format!("systemd {SCORED_WITH_SYSTEMD}")));
        for (what, score) in [("agent", agent), ("sink", sink)] {
            let said = format!("{what} {score:.1}");
            assert!(
                install.contains(&said),
                "docs/install.md should give the {what}'s score as `{said}`"
            );
        }
    }
    // The drop-ins that open a door for a job keep the rest closed.
    for (d, at_most) in [("devices.conf", 2.5), ("metrics-textfile.conf", 2.0)] {
        let dropin = read(&format!("packaging/edgespool.service.d/{d}"));
        let unit = with_drop_in(&read("packaging/edgespool.service"), &dropin);
        let score = exposure("edgespool.service", &unit);
        assert!(score <= at_most, "{d}: {score}");
    }
}

/// The settings for which systemd turns NoNewPrivileges= on by itself when
/// the service does not run as root (`context_has_seccomp` in systemd's
/// src/core/execute.c): the exec-handlers drop-in, whose sudo needs it
/// off, must turn off every one the unit sets.
const IMPLY_NO_NEW_PRIVILEGES: &[&str] = &[
    "LockPersonality",
    "MemoryDenyWriteExecute",
    "PrivateDevices",
    "ProtectClock",
    "ProtectHostname",
    "ProtectKernelTunables",
    "ProtectKernelModules",
    "ProtectKernelLogs",
    "RestrictAddressFamilies",
    "RestrictNamespaces",
    "RestrictRealtime",
    "RestrictSUIDSGID",
    "SystemCallArchitectures",
    "SystemCallFilter",
    "SystemCallLog",
];

/// The last value of each `[Service]` key (an empty one resets a list).
fn service_keys(unit: &str) -> BTreeMap<String, String> {
    let mut keys = BTreeMap::new();
    let mut in_service = false;
    for line in unit.lines().map(str::trim) {
        if line.starts_with('[') {
            in_service = line == "[Service]";
        } else if in_service && !line.starts_with('#') {
            if let Some((k, v)) = line.split_once('=') {
                keys.insert(k.to_owned(), v.to_owned());
            }
        }
    }
    keys
}

#[test]
fn the_exec_handlers_drop_in_turns_off_whatever_would_keep_sudo_from_working() {
    let unit = read("packaging/edgespool.service");
    let dropin = read("packaging/edgespool.service.d/exec-handlers.conf");
    let merged = service_keys(&with_drop_in(&unit, &dropin));
    assert_eq!(
        merged.get("NoNewPrivileges").map(String::as_str),
        Some("no")
    );
    for k in IMPLY_NO_NEW_PRIVILEGES {
        if let Some(v) = merged.get(*k) {
            assert!(
                v.is_empty() || v == "no",
                "exec-handlers.conf leaves {k}={v}: systemd would keep NoNewPrivileges on and sudo would fail"
            );
        }
    }
    // And the capabilities back: sudo, and the agent as root switching users.
    assert_eq!(
        merged.get("CapabilityBoundingSet").map(String::as_str),
        Some("~")
    );
}

#[test]
fn the_units_and_every_drop_in_pass_systemd_analyze_verify() {
    let bin = crate::support::agent::bin();
    let local = |unit: &str| -> String {
        unit.lines()
            .filter(|l| !l.starts_with("Documentation="))
            .map(|l| l.replace("/usr/bin/edgespool", &bin.display().to_string()) + "\n")
            .collect()
    };
    let unit = read("packaging/edgespool.service");
    let mut cases = vec![("packaged".to_owned(), unit.clone())];
    let dir = root().join("packaging/edgespool.service.d");
    let mut dropins: Vec<_> = std::fs::read_dir(&dir)
        .expect("read the drop-ins")
        .map(|e| e.expect("entry").path())
        .collect();
    dropins.sort();
    for d in dropins {
        let text = std::fs::read_to_string(&d).expect("read drop-in");
        cases.push((d.display().to_string(), with_drop_in(&unit, &text)));
    }
    for (what, text) in cases {
        let tmp = tempfile::tempdir().expect("tempdir");
        let path = tmp.path().join("edgespool.service");
        std::fs::write(&path, local(&text)).expect("write unit");
        let out = Command::new("systemd-analyze")
            .arg("verify")
            .arg(&path)
            .output()
            .expect("systemd-analyze (package systemd) must be installed");
        let said = String::from_utf8_lossy(&out.stderr).into_owned()
            + &String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && said.trim().is_empty(),
            "{what}: {said}"
        );
    }
}

#[test]
fn the_changelog_opens_with_this_version_and_names_a_real_maintainer() {
    let changelog = read("packaging/changelog");
    let cargo = read("Cargo.toml");
    let version = cargo
        .lines()
        .find_map(|l| l.strip_prefix("version = \""))
        .and_then(|v| v.strip_suffix('"'))
        .expect("Cargo.toml version");
    let first = changelog.lines().next().unwrap_or_default();
    assert!(
        first.starts_with(&format!("edgespool ({version}) ")),
        "packaging/changelog opens with `{first}`, the package is {version}: add an entry"
    );
    let package = read("cross/package.sh");
    let maintainer = package
        .lines()
        .find_map(|l| l.strip_prefix("Maintainer: "))
        .expect("package.sh's control file has a Maintainer");
    assert!(!maintainer.contains("localhost"), "{maintainer}");
    assert!(
        changelog.contains(&format!(" -- {maintainer}  ")),
        "the changelog's entries are signed by the Maintainer ({maintainer})"
    );
    // dpkg's own parser reads it, where installed (package dpkg-dev).
    if let Ok(out) = Command::new("dpkg-parsechangelog")
        .args(["-l", "packaging/changelog", "-S", "Version"])
        .current_dir(root())
        .output()
    {
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), version);
    }
}

#[test]
fn a_host_package_build_installs_no_cross_tools_and_no_test_stack() {
    let list = |targets: &[&str]| -> Vec<String> {
        let out = Command::new(root().join("cross/package.sh"))
            .args(targets)
            .env("PACKAGE_LIST", "1")
            .output()
            .expect("run cross/package.sh");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    let host = list(&["x86_64"]);
    for p in &host {
        assert!(
            ["gcc", "libc6-dev", "file", "python3", "python3-venv"].contains(&p.as_str()),
            "a host package build installs {p}"
        );
    }
    assert!(list(&["armv6"]).contains(&"qemu-user".to_owned()));
    let script = read("cross/package.sh");
    for line in script.lines().filter(|l| !l.trim_start().starts_with('#')) {
        assert!(
            !line.contains("setup-debian.sh"),
            "package.sh runs the test set-up: {line}"
        );
        assert!(
            !line.contains("cargo install"),
            "package.sh installs globally: {line}"
        );
    }
}

/// The tarball's install.sh lists the files it lays by hand; the .deb takes
/// every `docs/*.md` (cross/package.sh). A page added to docs/ and not to
/// the list made the package test fail at the end of CI; here it fails in
/// a second.
#[test]
fn install_sh_lists_every_page_of_docs_the_deb_ships() {
    let manifest = read("packaging/install.sh");
    let mut missing = Vec::new();
    let mut pages = 0;
    for entry in std::fs::read_dir(root().join("docs")).expect("read docs/") {
        let name = entry.expect("docs/ entry").file_name();
        let name = name.to_string_lossy();
        if !name.ends_with(".md") {
            continue;
        }
        pages += 1;
        let line = format!("usr/share/doc/edgespool/docs/{name}:0644");
        if !manifest.lines().any(|l| l.trim() == line) {
            missing.push(line);
        }
    }
    assert!(
        pages >= 10,
        "docs/ holds {pages} pages: the wrong directory?"
    );
    assert!(
        missing.is_empty(),
        "packaging/install.sh lacks: {missing:?}"
    );
}
