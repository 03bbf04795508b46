//! Talking to the service manager: systemd's notification protocol
//! (sd_notify(3)) over the datagram socket named by `$NOTIFY_SOCKET`, with
//! no libsystemd link.
//!
//! This module owns the messages (`READY=1`, `STATUS=...`, `STOPPING=1`,
//! `WATCHDOG=1`) and the watchdog's rule: **a ping is sent only while the
//! ingest and delivery threads are both making progress.** Each of those
//! loops stamps a [`Heartbeat`] every time it goes round (at least every
//! few seconds even when idle); a loop stuck in a write to a stalled SD
//! card, or wedged anywhere else, stops stamping, the pings stop, and
//! systemd restarts the agent after `WatchdogSec=`.
//!
//! Without `$NOTIFY_SOCKET` (not started by systemd, or `Type=simple`)
//! every call is a no-op.

use std::io;
use std::os::unix::net::UnixDatagram;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::{Duration, Instant};

/// A loop not seen for this long is stuck, whatever the watchdog interval:
/// the delivery loop's idle poll is 10 s and the ingest loop's longest sleep
/// is its maintenance period (at most 5 s).
const MIN_STALL: Duration = Duration::from_secs(15);
/// The watchdog pings at most this often, whatever `$WATCHDOG_USEC` says.
const MIN_PING_PERIOD: Duration = Duration::from_millis(100);

/// Milliseconds since the first use in this process (monotonic).
fn now_ms() -> u64 {
    static EPOCH: OnceLock<Instant> = OnceLock::new();
    let ms = EPOCH.get_or_init(Instant::now).elapsed().as_millis();
    u64::try_from(ms).unwrap_or(u64::MAX)
}

/// When a thread's loop last went round. Cheap to stamp (one relaxed store).
#[derive(Debug, Clone)]
pub struct Heartbeat(Arc<AtomicU64>);

impl Default for Heartbeat {
    fn default() -> Heartbeat {
        Heartbeat(Arc::new(AtomicU64::new(now_ms())))
    }
}

impl Heartbeat {
    /// Records that the loop is going round now.
    pub fn beat(&self) {
        self.0.store(now_ms(), Ordering::Relaxed);
    }

    /// How long since the last [`Heartbeat::beat`].
    pub fn age(&self) -> Duration {
        Duration::from_millis(now_ms().saturating_sub(self.0.load(Ordering::Relaxed)))
    }
}

/// The service manager's notification socket, if the agent has one.
#[derive(Clone)]
pub struct Notifier {
    target: Option<Arc<Target>>,
}

struct Target {
    socket: UnixDatagram,
    addr: std::os::unix::net::SocketAddr,
    /// `$WATCHDOG_USEC`, when it is meant for this process.
    watchdog: Option<Duration>,
    /// A send has failed (the first failure is a WARN).
    failed: std::sync::atomic::AtomicBool,
}

impl Notifier {
    /// Reads `$NOTIFY_SOCKET` (a path, or `@name` for the abstract
    /// namespace) and `$WATCHDOG_USEC`/`$WATCHDOG_PID` (sd_watchdog_enabled(3)).
    /// A socket that cannot be used is logged at WARN and notification is off;
    /// the agent runs either way.
    pub fn from_env() -> Notifier {
        let Some(name) = std::env::var_os("NOTIFY_SOCKET") else {
            return Notifier { target: None };
        };
        match Target::open(&name.to_string_lossy()) {
            Ok(target) => Notifier {
                target: Some(Arc::new(target)),
            },
            Err(e) => {
                log::warn!(
                    "NOTIFY_SOCKET={}: {e}; not telling the service manager when ready",
                    name.to_string_lossy()
                );
                Notifier { target: None }
            }
        }
    }

    /// `READY=1`: the spool is open and the threads are running.
    pub fn ready(&self) {
        self.send("READY=1");
    }

    /// `STOPPING=1`: a clean stop has begun.
    pub fn stopping(&self) {
        self.send("STOPPING=1");
    }

    /// `STATUS=<line>`: shown by `systemctl status` (one line; newlines
    /// would end the field, so they become spaces).
    pub fn status(&self, line: &str) {
        if self.target.is_some() {
            self.send(&format!("STATUS={}", line.replace('\n', " ")));
        }
    }

    /// Starts the watchdog thread if systemd asked for one: `WATCHDOG=1`
    /// every half interval while every heartbeat in `threads` is younger
    /// than the stall limit (half the interval, at least 15 s). The first
    /// thread found stuck is logged at ERROR, once per stall.
    pub fn start_watchdog(&self, threads: Vec<(&'static str, Heartbeat)>) {
        let Some(target) = self.target.clone() else {
            return;
        };
        let Some(interval) = target.watchdog else {
            return;
        };
        let notifier = self.clone();
        let stall = (interval / 2).max(MIN_STALL);
        // A WatchdogSec= below 200 ms cannot be served anyway; never spin.
        let every = (interval / 2).max(MIN_PING_PERIOD);
        let spawned = thread::Builder::new()
            .name("watchdog".into())
            .spawn(move || watchdog_loop(&notifier, every, stall, &threads));
        if let Err(e) = spawned {
            log::error!("cannot start the watchdog thread: {e}; systemd will restart the agent");
        }
    }

    fn send(&self, msg: &str) {
        if let Some(t) = &self.target {
            if let Err(e) = t.socket.send_to_addr(msg.as_bytes(), &t.addr) {
                // The first failure matters (under Type=notify a lost READY=1
                // gets the agent killed at its start timeout); repeats do not.
                if t.failed.swap(true, Ordering::Relaxed) {
                    log::debug!("sd_notify {msg:?}: {e}");
                } else {
                    log::warn!("cannot notify the service manager ({msg:?}): {e}; under Type=notify systemd will not see the agent as ready");
                }
            }
        }
    }
}

fn watchdog_loop(
    notifier: &Notifier,
    every: Duration,
    stall: Duration,
    threads: &[(&'static str, Heartbeat)],
) {
    let mut stuck: Option<&'static str> = None;
    loop {
        match threads.iter().find(|(_, h)| h.age() > stall) {
            None => {
                if let Some(name) = stuck.take() {
                    log::warn!("the {name} thread is going again; watchdog pings resume");
                }
                notifier.send("WATCHDOG=1");
            }
            Some((name, h)) => {
                if stuck.is_none() {
                    log::error!(
                        "the {name} thread has not gone round for {} s (a stalled disk?); \
                         no watchdog ping, so systemd restarts the agent if it stays stuck",
                        h.age().as_secs()
                    );
                }
                stuck = Some(name);
            }
        }
        thread::sleep(every);
    }
}

impl Target {
    fn open(name: &str) -> io::Result<Target> {
        let addr = if let Some(abstract_name) = name.strip_prefix('@') {
            use std::os::linux::net::SocketAddrExt;
            std::os::unix::net::SocketAddr::from_abstract_name(abstract_name.as_bytes())?
        } else if name.starts_with('/') {
            std::os::unix::net::SocketAddr::from_pathname(name)?
        } else {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "not an absolute path or an @abstract name",
            ));
        };
        Ok(Target {
            socket: UnixDatagram::unbound()?,
            addr,
            watchdog: watchdog_from_env(),
            failed: std::sync::atomic::AtomicBool::new(false),
        })
    }
}

/// `$WATCHDOG_USEC` if set, positive, and (when `$WATCHDOG_PID` is set)
/// meant for this process, as sd_watchdog_enabled(3) says.
fn watchdog_from_env() -> Option<Duration> {
    if let Some(pid) = std::env::var_os("WATCHDOG_PID") {
        if pid.to_string_lossy().parse::<u32>().ok() != Some(std::process::id()) {
            return None;
        }
    }
    let usec: u64 = std::env::var("WATCHDOG_USEC").ok()?.parse().ok()?;
    (usec > 0).then(|| Duration::from_micros(usec))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_reach_a_bound_socket_and_the_watchdog_stops_for_a_stuck_thread() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("notify");
        let listener = UnixDatagram::bind(&path).unwrap();
        listener
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let notifier = Notifier {
            target: Some(Arc::new(Target {
                socket: UnixDatagram::unbound().unwrap(),
                addr: std::os::unix::net::SocketAddr::from_pathname(&path).unwrap(),
                watchdog: None,
                failed: std::sync::atomic::AtomicBool::new(false),
            })),
        };
        let recv = || {
            let mut buf = [0u8; 256];
            let n = listener.recv(&mut buf).unwrap();
            String::from_utf8_lossy(&buf[..n]).into_owned()
        };
        notifier.ready();
        assert_eq!(recv(), "READY=1");
        notifier.status("a\nb");
        assert_eq!(recv(), "STATUS=a b");

        // A heartbeat that goes stale stops the pings; a fresh one resumes them.
        let alive = Heartbeat::default();
        let stuck = Heartbeat::default();
        let (n, a, s) = (notifier.clone(), alive.clone(), stuck.clone());
        let stall = Duration::from_millis(300);
        thread::spawn(move || {
            watchdog_loop(&n, Duration::from_millis(50), stall, &[("a", a), ("s", s)])
        });
        let beater = thread::spawn(move || {
            for _ in 0..40 {
                alive.beat();
                thread::sleep(Duration::from_millis(50));
            }
        });
        assert_eq!(recv(), "WATCHDOG=1");
        // `stuck` never beats: after the stall limit the pings stop.
        thread::sleep(stall + Duration::from_millis(200));
        // Drain the pings sent before the limit; then none may come.
        listener.set_nonblocking(true).unwrap();
        let mut buf = [0u8; 64];
        while listener.recv(&mut buf).is_ok() {}
        listener.set_nonblocking(false).unwrap();
        listener
            .set_read_timeout(Some(Duration::from_millis(500)))
            .unwrap();
        assert!(
            listener.recv(&mut buf).is_err(),
            "a ping arrived though a thread is stuck"
        );
        stuck.beat();
        listener
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        assert_eq!(recv(), "WATCHDOG=1");
        beater.join().unwrap();
    }

    #[test]
    fn a_relative_socket_name_is_refused_and_notification_is_off() {
        assert!(Target::open("notify.sock").is_err());
        let off = Notifier { target: None };
        off.ready();
        off.status("nothing happens");
    }
}
