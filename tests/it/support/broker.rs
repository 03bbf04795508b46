//! A real mosquitto broker on a free loopback port, in its own temp dir.

use std::fs::{File, OpenOptions};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{free_port, run_ok, tail, wait_for};

/// Debian installs mosquitto in /usr/sbin, which a non-root PATH may lack.
const MOSQUITTO: &str = "/usr/sbin/mosquitto";
/// How long `start` waits for the listener to accept TCP.
const START_TIMEOUT: Duration = Duration::from_secs(5);
/// How long `restart` keeps retrying (e.g. while the port is still taken).
const RESTART_TIMEOUT: Duration = Duration::from_secs(8);

pub struct Broker {
    child: Option<Child>,
    port: u16,
    /// The listener speaks TLS: readiness is a TCP accept, not a CONNACK.
    tls: bool,
    dir: tempfile::TempDir,
    conf_path: PathBuf,
    log_path: PathBuf,
}

impl Broker {
    /// Start mosquitto on 127.0.0.1:<free port> with persistence off and
    /// anonymous access, logging everything (debug included) to a file in its
    /// own temp dir. Panics, with the log tail, if the port does not accept
    /// TCP within about 5 s.
    pub fn start() -> Broker {
        Broker::start_with_config("")
    }

    /// Like [`Broker::start`], with `extra` appended to mosquitto.conf
    /// (e.g. "max_inflight_messages 5\n"). It is kept across restarts.
    pub fn start_with_config(extra: &str) -> Broker {
        Broker::start_with_options(extra, true)
    }

    /// Like [`Broker::start_with_config`]; with `verbose` false, only
    /// errors, warnings, notices and connections are logged (a debug line per
    /// packet slows mosquitto under a load test).
    pub fn start_with_options(extra: &str, verbose: bool) -> Broker {
        Broker::start_inner(extra, verbose, false, false)
    }

    /// Like [`Broker::start_with_options`], with mosquitto's own persistence
    /// on (`persistence true`, its file in the broker's temp dir): sessions,
    /// subscriptions and queued QoS 1/2 messages survive
    /// [`Broker::restart_graceful`] (mosquitto writes the file when it exits
    /// on SIGTERM, and every `autosave_interval` = 1 s otherwise).
    pub fn start_persistent(extra: &str, verbose: bool) -> Broker {
        Broker::start_inner(extra, verbose, true, false)
    }

    /// Like [`Broker::start_with_config`], its one listener speaking TLS
    /// with `pki`'s `good-ca.pem`, `server.pem` and `server.key`; `extra`
    /// says who may connect (`require_certificate`, `allow_anonymous`).
    pub fn start_tls(pki: &Path, extra: &str) -> Broker {
        let d = pki.display();
        let tls =
            format!("cafile {d}/good-ca.pem\ncertfile {d}/server.pem\nkeyfile {d}/server.key\n");
        Broker::start_inner(&format!("{tls}{extra}"), true, false, true)
    }

    fn start_inner(extra: &str, verbose: bool, persistent: bool, tls: bool) -> Broker {
        let dir = tempfile::Builder::new()
            .prefix("edgespool-broker-")
            .tempdir()
            .expect("create temp dir for mosquitto");
        let conf_path = dir.path().join("mosquitto.conf");
        let log_path = dir.path().join("mosquitto.log");
        let mut broker = Broker {
            child: None,
            port: 0,
            tls,
            dir,
            conf_path,
            log_path,
        };
        // The probed port may be taken by someone else before mosquitto binds
        // it; if mosquitto exits early, try another port.
        let mut last_err = String::new();
        for _ in 0..3 {
            broker.port = free_port();
            let persistence = persistent.then(|| broker.dir.path().to_path_buf());
            write_config(
                &broker.conf_path,
                broker.port,
                extra,
                verbose,
                persistence.as_deref(),
            );
            match broker.spawn_and_wait(START_TIMEOUT) {
                Ok(()) => return broker,
                Err(why) => last_err = why,
            }
            let exited_early = broker.child.is_none();
            broker.kill();
            if !exited_early {
                break;
            }
        }
        panic!(
            "mosquitto did not come up on 127.0.0.1:{}: {last_err}\n--- mosquitto log tail ---\n{}",
            broker.port,
            tail(&broker.log_text(), 40)
        );
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    pub fn conf_path(&self) -> &Path {
        &self.conf_path
    }

    pub fn log_path(&self) -> &Path {
        &self.log_path
    }

    /// True while the broker process is alive.
    pub fn is_running(&mut self) -> bool {
        match self.child.as_mut() {
            None => false,
            Some(child) => matches!(child.try_wait(), Ok(None)),
        }
    }

    /// SIGTERM (mosquitto saves its persistence file on the way out) and
    /// reap; SIGKILL after 10 s. A no-op if it is not running.
    pub fn stop_graceful(&mut self) {
        if let Some(mut child) = self.child.take() {
            super::terminate(&mut child, Duration::from_secs(10));
        }
    }

    /// SIGKILL the broker (no clean shutdown, no goodbye to clients) and
    /// reap it. A no-op if it is not running.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Child::kill sends SIGKILL on Unix; an error only means it has
            // already exited, and wait() reaps it either way.
            let _ = child.kill();
            child
                .wait()
                .unwrap_or_else(|e| panic!("reap mosquitto (pid {}): {e}", child.id()));
        }
    }

    /// Start the broker again on the same port, with a blank state
    /// (persistence is off, so every session and subscription is gone).
    /// Kills the current process first if it is still running. Retries for a
    /// few seconds if the port cannot be bound yet.
    pub fn restart(&mut self) {
        self.kill();
        let deadline = Instant::now() + RESTART_TIMEOUT;
        let mut last_err;
        loop {
            match self.spawn_and_wait(deadline.saturating_duration_since(Instant::now())) {
                Ok(()) => return,
                Err(why) => last_err = why,
            }
            self.kill();
            if Instant::now() >= deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        panic!(
            "mosquitto did not come back on 127.0.0.1:{}: {last_err}\n--- mosquitto log tail ---\n{}",
            self.port,
            tail(&self.log_text(), 40)
        );
    }

    /// SIGTERM (mosquitto saves its persistence file on the way out), then
    /// start it again on the same port: with [`Broker::start_persistent`],
    /// sessions and queued messages are back. Panics if it does not come back.
    pub fn restart_graceful(&mut self) {
        self.stop_graceful();
        self.restart();
    }

    /// Everything mosquitto has logged so far, across restarts.
    pub fn log_text(&self) -> String {
        match std::fs::read(&self.log_path) {
            Ok(bytes) => String::from_utf8_lossy(&bytes).into_owned(),
            Err(e) => format!("<cannot read {}: {e}>", self.log_path.display()),
        }
    }

    /// Wait up to `timeout` until mosquitto's log holds `text`.
    pub fn wait_log(&self, timeout: Duration, text: &str) -> bool {
        wait_for(timeout, || self.log_text().contains(text))
    }

    /// Spawn mosquitto and wait until it answers an MQTT CONNECT on its port,
    /// the process dies, or `timeout` passes.
    fn spawn_and_wait(&mut self, timeout: Duration) -> Result<(), String> {
        assert!(self.child.is_none(), "spawn_and_wait with a live broker");
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log_path)
            .unwrap_or_else(|e| panic!("open mosquitto log {}: {e}", self.log_path.display()));
        let log_err = log.try_clone().expect("clone mosquitto log file handle");
        let exe = if Path::new(MOSQUITTO).exists() {
            MOSQUITTO
        } else {
            "mosquitto"
        };
        let child = Command::new(exe)
            .arg("-c")
            .arg(&self.conf_path)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .unwrap_or_else(|e| panic!("spawn {exe} (cross/setup-debian.sh installs it): {e}"));
        self.child = Some(child);

        let addr = SocketAddr::from(([127, 0, 0, 1], self.port));
        let deadline = Instant::now() + timeout;
        loop {
            let child = self.child.as_mut().expect("child just spawned");
            if let Ok(Some(status)) = child.try_wait() {
                self.child = None;
                return Err(format!("mosquitto exited early with {status}"));
            }
            let ready = if self.tls {
                TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok()
            } else {
                mqtt_probe(&addr)
            };
            if ready {
                return Ok(());
            }
            if Instant::now() >= deadline {
                return Err(format!("port not accepting after {timeout:?}"));
            }
            std::thread::sleep(Duration::from_millis(25));
        }
    }
}

impl Drop for Broker {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Write mosquitto's password file `path` holding `users` (name,
/// password), with `mosquitto_passwd -b`.
pub fn password_file(path: &Path, users: &[(&str, &str)]) {
    for (i, (user, password)) in users.iter().enumerate() {
        let mut c = Command::new("mosquitto_passwd");
        c.arg("-b");
        if i == 0 {
            c.arg("-c");
        }
        run_ok(
            c.arg(path).args([user, password]),
            "mosquitto_passwd (package mosquitto)",
        );
    }
}

/// True if an MQTT 3.1.1 CONNECT to `addr` is answered with a CONNACK (so
/// it is mosquitto listening there, and it is ready). A refusing CONNACK
/// counts too: a broker with `allow_anonymous false` answers this anonymous
/// probe with return code 5.
fn mqtt_probe(addr: &SocketAddr) -> bool {
    use std::io::{Read, Write};
    const CLIENT_ID: &[u8] = b"edgespool-broker-probe";
    let Ok(mut stream) = TcpStream::connect_timeout(addr, Duration::from_millis(200)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_millis(500)));
    let _ = stream.set_write_timeout(Some(Duration::from_millis(500)));
    // Variable header: protocol name "MQTT", level 4, flags clean-session,
    // keep-alive 5 s; payload: the client id.
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0x02, 0, 5];
    body.extend_from_slice(&(CLIENT_ID.len() as u16).to_be_bytes());
    body.extend_from_slice(CLIENT_ID);
    let mut connect = vec![0x10, body.len() as u8];
    connect.extend_from_slice(&body);
    if stream.write_all(&connect).is_err() {
        return false;
    }
    let mut connack = [0u8; 4];
    if stream.read_exact(&mut connack).is_err() {
        return false;
    }
    let ok = connack[0] == 0x20 && connack[1] == 2 && connack[3] <= 5;
    let _ = stream.write_all(&[0xe0, 0x00]); // DISCONNECT
    ok
}

fn write_config(path: &Path, port: u16, extra: &str, verbose: bool, persistence: Option<&Path>) {
    use std::io::Write;
    let mut conf = String::new();
    conf.push_str(&format!("listener {port} 127.0.0.1\n"));
    conf.push_str("allow_anonymous true\n");
    match persistence {
        None => conf.push_str("persistence false\n"),
        Some(dir) => {
            conf.push_str("persistence true\n");
            conf.push_str(&format!("persistence_location {}/\n", dir.display()));
            conf.push_str("autosave_interval 1\n");
        }
    }
    // Logs go to stderr, which is redirected (append) to mosquitto.log so a
    // bind failure and every restart land in the same file.
    conf.push_str("log_dest stderr\n");
    if verbose {
        conf.push_str("log_type all\n");
    } else {
        conf.push_str("log_type error\nlog_type warning\nlog_type notice\n");
    }
    conf.push_str("log_timestamp true\n");
    conf.push_str("log_timestamp_format %H:%M:%S\n");
    conf.push_str("connection_messages true\n");
    // Running as root, mosquitto would otherwise switch to the `mosquitto`
    // user, which cannot write into our temp dir.
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 {
        conf.push_str("user root\n");
    }
    conf.push_str(extra);
    if !extra.is_empty() && !extra.ends_with('\n') {
        conf.push('\n');
    }
    let mut file = File::create(path).unwrap_or_else(|e| panic!("create {}: {e}", path.display()));
    file.write_all(conf.as_bytes())
        .unwrap_or_else(|e| panic!("write {}: {e}", path.display()));
}
