//! The agent's health: `starting`, `ok`, or `degraded` with named reasons.
//!
//! Its one rule: **health says `ok` only while data can flow**: connected
//! (a CONNACK this run), acknowledged when rows wait, storage taking
//! readings, every configured listener listening, nothing the spool held
//! lost at start. Before the first CONNACK it says `starting`, never `ok`.
//! Each reason names what to check. Pure: the agent gathers [`Facts`] and
//! stores the [`Health`] this returns (only when it changes).

use std::time::Duration;

/// What the agent knows at a maintenance pass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Facts {
    /// Connected now (CONNACK accepted, not yet lost).
    pub connected: bool,
    /// A CONNACK was accepted at least once this run: until then health
    /// is [`State::Starting`] at best.
    pub ever_connected: bool,
    /// How long the connection has been in its current state (up or down).
    pub state_for: Duration,
    /// Why the last connection ended (or the last connect failed).
    pub last_error: Option<String>,
    /// `host:port` of the broker, for the messages.
    pub broker: String,
    /// Rows submitted and not acknowledged.
    pub in_flight: usize,
    /// Time since the oldest of them was submitted or the last PUBACK.
    pub no_puback_for: Option<Duration>,
    /// Connections in a row that ended soon after their CONNACK (within a
    /// keep-alive, without a PUBACK).
    pub quick_drops: u32,
    /// The broker refused the command subscription (SUBACK 0x80, MQTT 3.1.1
    /// §3.9.3), or closed 3 connections in a row right after it, so the
    /// agent connects without it for a while (at most 5 minutes at a time).
    pub commands_unavailable: Option<String>,
    /// FAILED rows in the spool now (kept and shown by `status` until an
    /// operator requeues them).
    pub failed_rows: u64,
    /// Rows held back on the broker's word (refused, over its CONNACK
    /// maximum, set aside after dropped connections), tried again with
    /// backoff and never FAILED for it ([`crate::delivery`]).
    pub deferred: u64,
    /// What the broker said or did about them.
    pub deferred_why: String,
    /// A reader pins the WAL (checkpoints cannot finish).
    pub checkpoint_blocked: bool,
    /// Readings refused since the last pass, and why.
    pub dropping: Option<String>,
    /// The config in force is the last-known-good copy.
    pub config_fallback: bool,
    /// Receipt mode: why receipts cannot arrive (the broker refused the
    /// subscription); rows wait meanwhile.
    pub receipts_unavailable: Option<String>,
    /// Receipt mode: rows PUBACKed and waiting for their receipt, and how
    /// long the oldest has waited.
    pub awaiting_receipt: (u64, Option<Duration>),
    /// `mqtt.receipt_timeout_secs` in receipt mode; `None` otherwise.
    pub receipt_timeout: Option<Duration>,
    /// Receipt mode: receipts refused (unsigned, forged, another board's,
    /// malformed) within the last [`REFUSED_WINDOW`], and the reasons
    /// named, e.g. `unsigned 3, bad_signature 1`.
    pub receipts_refused: (u64, String),
    /// Another process listens on `ingest.socket`: who, and the fix.
    pub ingest_socket_taken: Option<String>,
    /// The write budget cannot be met within the widest commit window
    /// allowed: the projection and what would meet it
    /// ([`crate::flash::write_budget::Verdict::reason`], worded by the caller).
    pub write_budget: Option<String>,
    /// Configured listeners that could not bind (`metrics.listen`), each
    /// with its key, address and cause; the agent runs without them.
    pub listeners_down: Vec<String>,
    /// What the spool lost at start (committed rows gone with a lost
    /// `-wal`, a damaged file moved aside:
    /// [`crate::spool::integrity::Opened::lost`]); kept for the run.
    pub spool_lost: Option<String>,
}

/// The three states of [`Health`], as `status`, the record in the spool
/// and the `edgespool_health{state}` gauge name them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// No CONNACK yet this run, and nothing wrong yet.
    Starting,
    /// Data can flow.
    Ok,
    /// At least one reason.
    Degraded,
}

impl State {
    /// `ok`, `starting` or `degraded` (one of
    /// [`crate::metrics::HEALTH_STATES`]).
    pub fn name(self) -> &'static str {
        match self {
            State::Starting => "starting",
            State::Ok => "ok",
            State::Degraded => "degraded",
        }
    }
}

/// The verdict.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Health {
    /// [`State::Degraded`] exactly when `reasons` is not empty.
    pub state: State,
    /// Every reason it is not ok; empty when ok or starting.
    pub reasons: Vec<String>,
}

impl Health {
    /// `ok`, `starting`, or `degraded: <reason>; <reason>`.
    pub fn line(&self) -> String {
        match self.state {
            State::Degraded => format!("degraded: {}", self.reasons.join("; ")),
            s => s.name().to_owned(),
        }
    }
}

/// How long a connection problem may last before it counts:
/// `mqtt.keep_alive_secs` x 2, or 30 s, whichever is larger.
pub fn grace(keep_alive: Duration) -> Duration {
    (keep_alive * 2).max(Duration::from_secs(30))
}

/// Judge `f` with the connection `grace` (see [`grace`]).
pub fn assess(f: &Facts, grace: Duration) -> Health {
    let mut reasons = Vec::new();
    let secs = |d: Duration| d.as_secs();
    if !f.connected && f.state_for >= grace {
        reasons.push(format!(
            "not connected to {} for {} s ({}): check the broker, the network and the credentials",
            f.broker,
            secs(f.state_for),
            f.last_error.as_deref().unwrap_or("no connection yet")
        ));
    }
    if f.connected && f.in_flight > 0 && f.no_puback_for.is_some_and(|d| d >= grace) {
        reasons.push(format!(
            "connected but no PUBACK for {} s with {} rows in flight: the broker accepts the connection and not the publishes (limits, ACL?)",
            f.no_puback_for.map_or(0, secs),
            f.in_flight
        ));
    }
    if f.quick_drops >= 3 {
        reasons.push(format!(
            "{} connections in a row ended soon after CONNACK ({}): check the broker's log, ACL and limits",
            f.quick_drops,
            f.last_error.as_deref().unwrap_or("closed")
        ));
    }
    if let Some(why) = &f.commands_unavailable {
        reasons.push(format!("commands unavailable: {why}"));
    }
    if f.failed_rows > 0 {
        reasons.push(format!(
            "{} rows FAILED in the spool (status shows why; the requeue-failed command sends them again)",
            f.failed_rows
        ));
    }
    if f.deferred > 0 {
        reasons.push(format!(
            "{} rows held back by the broker, tried again with backoff, never FAILED for it: {}",
            f.deferred, f.deferred_why
        ));
    }
    if let Some(why) = &f.write_budget {
        reasons.push(why.clone());
    }
    if f.checkpoint_blocked {
        reasons.push("checkpoint blocked: a reader is pinning the WAL".to_owned());
    }
    if let Some(d) = &f.dropping {
        reasons.push(format!("refusing readings: {d}"));
    }
    if f.config_fallback {
        reasons.push("running the last-known-good config".to_owned());
    }
    if let Some(why) = &f.receipts_unavailable {
        reasons.push(format!("receipts unavailable: {why}"));
    }
    let (waiting, oldest) = f.awaiting_receipt;
    if let (Some(timeout), Some(age)) = (f.receipt_timeout, oldest) {
        // Twice the timeout: a row sent again once for a lost receipt is
        // not yet a stop; one still unstored after that is.
        if waiting > 0 && age >= timeout.saturating_mul(2) {
            reasons.push(format!(
                "receipts stopped: {waiting} rows the broker acknowledged wait for their receipt, the oldest {} s since its first PUBACK (over twice mqtt.receipt_timeout_secs {}): is the sink running and publishing to <topic_prefix>/receipts?",
                secs(age),
                secs(timeout)
            ));
        }
    }
    let (refused, by) = &f.receipts_refused;
    if *refused >= REFUSED_DEGRADE {
        reasons.push(format!(
            "receipts refused: {refused} in the last {} min ({by}): something publishes receipts this board does not trust on <topic_prefix>/receipts (a forgery, or a sink whose --receipt-key is not in mqtt.receipt_public_keys); they retire nothing",
            REFUSED_WINDOW.as_secs() / 60
        ));
    }
    if let Some(why) = &f.ingest_socket_taken {
        reasons.push(format!("ingest socket not ours: {why}"));
    }
    for why in &f.listeners_down {
        reasons.push(format!("not listening: {why}"));
    }
    if let Some(why) = &f.spool_lost {
        reasons.push(format!("the spool lost committed rows at start: {why}"));
    }
    let state = if !reasons.is_empty() {
        State::Degraded
    } else if f.ever_connected {
        State::Ok
    } else {
        State::Starting
    };
    Health { state, reasons }
}

/// How far back refused receipts count for health.
pub const REFUSED_WINDOW: Duration = Duration::from_secs(600);
/// Refused receipts within [`REFUSED_WINDOW`] that degrade health: one may
/// be a stale receipt of a key just rotated; several keep happening.
pub const REFUSED_DEGRADE: u64 = 3;

/// The growth of a running total over the last `window`, from samples taken
/// at each pass (a sample kept when the total moved or a twentieth of the
/// window passed, at most [`RecentGrowth::MAX_SAMPLES`]), so memory stays
/// small whatever the pass rate. Pure: time is passed in.
#[derive(Debug, Clone)]
pub struct RecentGrowth {
    window: Duration,
    samples: std::collections::VecDeque<(std::time::Instant, u64)>,
}

impl RecentGrowth {
    /// Samples kept at most (a burst of refusals beyond it ages out early,
    /// counting growth over a shorter span, never a larger one).
    pub const MAX_SAMPLES: usize = 64;

    /// Nothing seen yet; growth over `window`.
    pub fn new(window: Duration) -> RecentGrowth {
        RecentGrowth {
            window,
            samples: std::collections::VecDeque::new(),
        }
    }

    /// The total is `total` at `now`: returns how much it grew since the
    /// newest sample at least one window old (or since the first sample).
    pub fn observe(&mut self, now: std::time::Instant, total: u64) -> u64 {
        let old = |t: &std::time::Instant| now.saturating_duration_since(*t) >= self.window;
        // Keep one sample at or before the window's start: the base.
        while self.samples.get(1).is_some_and(|(t, _)| old(t)) {
            self.samples.pop_front();
        }
        let moved = self.samples.back().is_none_or(|(t, v)| {
            *v != total || now.saturating_duration_since(*t) >= self.window / 20
        });
        if moved {
            self.samples.push_back((now, total));
            if self.samples.len() > Self::MAX_SAMPLES {
                self.samples.pop_front();
            }
        }
        let base = self.samples.front().map_or(total, |(_, v)| *v);
        total.saturating_sub(base)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refused_receipts_degrade_health_only_when_they_keep_coming_within_the_window() {
        let t = std::time::Instant::now();
        let mut g = RecentGrowth::new(REFUSED_WINDOW);
        assert_eq!(g.observe(t, 0), 0);
        assert_eq!(g.observe(t + Duration::from_secs(10), 1), 1);
        assert_eq!(g.observe(t + Duration::from_secs(20), 3), 3);
        // Ten minutes later the first refusals have aged out.
        assert_eq!(g.observe(t + Duration::from_secs(640), 3), 0);
        assert_eq!(g.observe(t + Duration::from_secs(650), 5), 2);
        let mut f = healthy();
        f.receipts_refused = (2, "unsigned 2".into());
        assert!(assess(&f, G).reasons.is_empty(), "one or two: no verdict");
        f.receipts_refused = (3, "unsigned 2, bad_signature 1".into());
        let h = assess(&f, G);
        assert!(
            h.reasons[0].starts_with(
                "receipts refused: 3 in the last 10 min (unsigned 2, bad_signature 1)"
            ),
            "{h:?}"
        );
    }

    fn healthy() -> Facts {
        Facts {
            connected: true,
            ever_connected: true,
            state_for: Duration::from_secs(600),
            broker: "b:1883".into(),
            ..Facts::default()
        }
    }

    const G: Duration = Duration::from_secs(60);

    #[test]
    fn connected_and_acknowledged_is_ok() {
        assert_eq!(assess(&healthy(), G).line(), "ok");
    }

    #[test]
    fn a_short_outage_is_ok_and_a_long_one_is_named_with_its_cause() {
        let mut f = healthy();
        f.connected = false;
        f.state_for = Duration::from_secs(10);
        f.last_error = Some("connection refused".into());
        assert_eq!(assess(&f, G).line(), "ok");
        f.state_for = Duration::from_secs(61);
        let l = assess(&f, G).line();
        assert!(
            l.starts_with("degraded: not connected to b:1883 for 61 s (connection refused)"),
            "{l}"
        );
    }

    #[test]
    fn rows_in_flight_without_puback_past_the_grace_degrade() {
        let mut f = healthy();
        f.in_flight = 5;
        f.no_puback_for = Some(Duration::from_secs(59));
        assert_eq!(assess(&f, G).line(), "ok");
        f.no_puback_for = Some(Duration::from_secs(60));
        assert!(assess(&f, G)
            .line()
            .contains("no PUBACK for 60 s with 5 rows"));
    }

    #[test]
    fn every_reason_is_listed() {
        let f = Facts {
            quick_drops: 3,
            commands_unavailable: Some("SUBACK refused".into()),
            failed_rows: 2,
            deferred: 1,
            checkpoint_blocked: true,
            dropping: Some("disk full".into()),
            config_fallback: true,
            ingest_socket_taken: Some("pid 7 listens on it".into()),
            write_budget: Some("write budget exceeded: projected 300 MB/day".into()),
            listeners_down: vec!["metrics.listen 127.0.0.1:9469: address in use".into()],
            spool_lost: Some("run 7's -wal is gone".into()),
            ..healthy()
        };
        let h = assess(&f, G);
        assert_eq!(h.reasons.len(), 11, "{h:?}");
        assert_eq!(h.state, State::Degraded);
    }

    /// Issue 36: `ok` for 55 s while never connected.
    #[test]
    fn before_the_first_connack_health_is_starting_never_ok() {
        let mut f = Facts {
            broker: "b:1883".into(),
            state_for: Duration::from_secs(10),
            ..Facts::default()
        };
        let h = assess(&f, G);
        assert_eq!((h.state, h.line().as_str()), (State::Starting, "starting"));
        f.state_for = Duration::from_secs(60);
        let h = assess(&f, G);
        assert_eq!(h.state, State::Degraded);
        assert!(h.line().contains("(no connection yet)"), "{}", h.line());
        // A listener down is degraded from the first pass, connected or not.
        f.state_for = Duration::from_secs(1);
        f.listeners_down = vec!["metrics.listen 127.0.0.1:1: in use".into()];
        assert!(assess(&f, G)
            .line()
            .starts_with("degraded: not listening: metrics.listen"));
        f.listeners_down.clear();
        f.ever_connected = true;
        f.connected = true;
        assert_eq!(assess(&f, G).state, State::Ok);
    }

    #[test]
    fn the_grace_is_twice_the_keep_alive_and_at_least_30_s() {
        assert_eq!(grace(Duration::from_secs(5)), Duration::from_secs(30));
        assert_eq!(grace(Duration::from_secs(60)), Duration::from_secs(120));
    }

    #[test]
    fn receipts_that_stop_or_cannot_arrive_degrade_health_naming_the_cause() {
        let t = Duration::from_secs(300);
        let mut f = Facts {
            connected: true,
            ever_connected: true,
            receipt_timeout: Some(t),
            awaiting_receipt: (12, Some(Duration::from_secs(599))),
            ..Facts::default()
        };
        // Sent again once and not yet receipted: not yet a stop.
        assert!(assess(&f, Duration::from_secs(30)).reasons.is_empty());
        f.awaiting_receipt = (12, Some(Duration::from_secs(600)));
        let h = assess(&f, Duration::from_secs(30));
        assert!(
            h.line().contains("receipts stopped: 12 rows"),
            "{}",
            h.line()
        );
        f.awaiting_receipt = (0, None);
        f.receipts_unavailable = Some("the broker refused the subscription".into());
        let h = assess(&f, Duration::from_secs(30));
        assert!(
            h.line()
                .contains("receipts unavailable: the broker refused"),
            "{}",
            h.line()
        );
    }
}
