//! systemd supervision: `Type=notify` readiness and a watchdog that pings
//! only while the ingest and delivery threads make progress.
//!
//! The test binds its own datagram socket as `$NOTIFY_SOCKET` and stalls the
//! spool's disk for real: the spool lives on a loop-mounted ext4 image that
//! `fsfreeze` freezes, so every write to it blocks, as on an SD card that
//! stops answering. (Root is needed for the mount, as for the tmpfs tests.)

use crate::support::agent::AgentProc;
use crate::support::broker::Broker;
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// An ext4 image mounted on a loop device, which the test can freeze. Drop
/// thaws it first (a frozen mount cannot be unmounted), then unmounts.
struct FreezableFs {
    dir: PathBuf,
}

impl FreezableFs {
    fn mount(parent: &Path) -> FreezableFs {
        let image = parent.join("spool.img");
        let dir = parent.join("mnt");
        std::fs::create_dir_all(&dir).expect("mkdir mnt");
        run("truncate", &["-s", "64M", path_str(&image)]);
        run("mkfs.ext4", &["-q", "-F", path_str(&image)]);
        run("mount", &["-o", "loop", path_str(&image), path_str(&dir)]);
        FreezableFs { dir }
    }

    fn freeze(&self) {
        run("fsfreeze", &["-f", path_str(&self.dir)]);
    }

    /// Thaws the filesystem; harmless (an error) when it is not frozen.
    fn thaw(&self) {
        let _ = Command::new("fsfreeze")
            .arg("-u")
            .arg(&self.dir)
            .stderr(std::process::Stdio::null())
            .status();
    }
}

impl Drop for FreezableFs {
    fn drop(&mut self) {
        self.thaw();
        let _ = Command::new("umount").arg("-l").arg(&self.dir).status();
    }
}

fn path_str(p: &Path) -> &str {
    p.to_str().expect("utf-8 temp path")
}

fn run(program: &str, args: &[&str]) {
    let st = Command::new(program)
        .args(args)
        .status()
        .unwrap_or_else(|e| panic!("run {program}: {e}"));
    assert!(
        st.success(),
        "{program} {args:?}: {st} (the test needs root)"
    );
}

/// The next message on the socket within `timeout`, or `None`.
fn next_message(socket: &UnixDatagram, timeout: Duration) -> Option<String> {
    socket.set_read_timeout(Some(timeout)).expect("timeout");
    let mut buf = [0u8; 4096];
    let n = socket.recv(&mut buf).ok()?;
    Some(String::from_utf8_lossy(&buf[..n]).into_owned())
}

/// Waits up to `deadline` for a message that satisfies `want`.
fn wait_message(socket: &UnixDatagram, deadline: Duration, want: impl Fn(&str) -> bool) -> bool {
    let end = Instant::now() + deadline;
    while let Some(left) = end.checked_duration_since(Instant::now()) {
        match next_message(socket, left.max(Duration::from_millis(1))) {
            Some(m) if want(&m) => return true,
            Some(_) => {}
            None => return false,
        }
    }
    false
}

#[test]
fn ready_then_watchdog_pings_that_stop_while_the_spool_disk_is_frozen_and_resume_after() {
    let broker = Broker::start();
    let spool_parent = tempfile::tempdir().expect("tempdir");
    let fs = FreezableFs::mount(spool_parent.path());
    let agent_dir = tempfile::tempdir().expect("tempdir");
    let socket_path = agent_dir.path().join("notify.sock");
    let socket = UnixDatagram::bind(&socket_path).expect("bind notify socket");
    let prefix = crate::prefix("notify");
    let cfg = crate::write_config(&fs.dir, &broker.url(), &prefix, 100);
    // WatchdogSec=2: a ping every second while both threads go round.
    let mut agent = AgentProc::spawn_with_env(
        &cfg,
        &[],
        agent_dir.path(),
        &[
            ("NOTIFY_SOCKET", path_str(&socket_path)),
            ("WATCHDOG_USEC", "2000000"),
        ],
    );
    assert!(
        wait_message(&socket, Duration::from_secs(60), |m| m == "READY=1"),
        "no READY=1\n{}",
        agent.log_tail(30)
    );
    for _ in 0..2 {
        assert!(
            wait_message(&socket, Duration::from_secs(30), |m| m == "WATCHDOG=1"),
            "no watchdog ping while healthy\n{}",
            agent.log_tail(30)
        );
    }
    assert!(
        wait_message(&socket, Duration::from_secs(30), |m| m
            .starts_with("STATUS=summary: appended=")),
        "no STATUS= line\n{}",
        agent.log_tail(30)
    );

    // The disk stops answering: writes block, the loops stop going round.
    fs.freeze();
    // Within the stall limit (15 s) plus a ping period the pings stop: a
    // quiet stretch of 5 s must come within 60 s.
    let frozen_at = Instant::now();
    let mut quiet = false;
    while frozen_at.elapsed() < Duration::from_secs(60) {
        if next_message(&socket, Duration::from_secs(5)).is_none() {
            quiet = true;
            break;
        }
    }
    let stall_logged = agent.log_text().contains("has not gone round");
    // Thaw before any assertion: a test that panics with the disk frozen
    // would leave the agent in uninterruptible sleep on it.
    fs.thaw();
    assert!(
        quiet,
        "watchdog pings went on while the spool's disk was frozen\n{}",
        agent.log_tail(30)
    );
    assert!(
        stall_logged,
        "the stall was not logged\n{}",
        agent.log_tail(30)
    );

    assert!(
        wait_message(&socket, Duration::from_secs(60), |m| m == "WATCHDOG=1"),
        "pings did not resume after the disk came back\n{}",
        agent.log_tail(30)
    );
    agent.terminate(Duration::from_secs(15));
    assert!(
        wait_message(&socket, Duration::from_secs(5), |m| m == "STOPPING=1"),
        "no STOPPING=1 at the clean stop"
    );
    drop(fs);
}

/// The sink's template unit as `systemd-analyze verify` sees an instance of
/// it (with the binary under test in `ExecStart`: the packaged path is not
/// installed here, and no man page is), and shipped by both package kinds.
#[test]
fn sink_unit_template_passes_systemd_analyze_verify_and_is_packaged() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let unit = std::fs::read_to_string(root.join("packaging/edgespool-sink@.service"))
        .expect("read the sink unit");
    assert!(
        unit.lines()
            .any(|l| l == "ExecStart=/usr/bin/edgespool sink --config /etc/edgespool/sink-%i.toml"),
        "{unit}"
    );
    for k in [
        "RestartPreventExitStatus=2",
        "User=edgespool",
        "NoNewPrivileges=yes",
    ] {
        assert!(unit.lines().any(|l| l == k), "unit lacks {k}");
    }
    let bin = crate::support::agent::bin();
    let local: String = unit
        .lines()
        .filter(|l| !l.starts_with("Documentation="))
        .map(|l| l.replace("/usr/bin/edgespool", &bin.display().to_string()) + "\n")
        .collect();
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("edgespool-sink@.service"), local).expect("write unit");
    std::os::unix::fs::symlink(
        "edgespool-sink@.service",
        dir.path().join("edgespool-sink@fleet.service"),
    )
    .expect("instance link");
    let out = Command::new("systemd-analyze")
        .arg("verify")
        .arg(dir.path().join("edgespool-sink@fleet.service"))
        .output()
        .expect("systemd-analyze (package systemd) must be installed");
    let said =
        String::from_utf8_lossy(&out.stderr).into_owned() + &String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && said.trim().is_empty(),
        "systemd-analyze verify: {said}"
    );
    let package = std::fs::read_to_string(root.join("cross/package.sh")).expect("package.sh");
    assert!(package.contains(
        "packaging/edgespool-sink@.service \"$root/lib/systemd/system/edgespool-sink@.service\""
    ));
    assert!(package.contains("packaging/sink.toml \"$doc/examples/sink.toml\""));
    let install = std::fs::read_to_string(root.join("packaging/install.sh")).expect("install.sh");
    assert!(install.contains("\nlib/systemd/system/edgespool-sink@.service:0644\n"));
    assert!(install.contains("\nusr/share/doc/edgespool/examples/sink.toml:0644\n"));
}
