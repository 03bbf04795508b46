//! Whether the command SUBSCRIBE goes out ([`SubJudge`]): a broker that
//! closes every connection on it (aedes does on an ACL deny) must not stop
//! telemetry, and a flaky link, or someone who can reset TCP a few times,
//! must not switch an operator's commands off.
//!
//! Its one rule: **commands go off only when the SUBSCRIBE is shown to be
//! the cause, and never for longer than [`OFF_MAX`] at a time.** Shown:
//! [`KILLS_TO_JUDGE`] connections in a row closed by the peer within
//! [`KILL_WINDOW`] of their SUBSCRIBE, with no SUBACK. Then connections go
//! without it for [`OFF_MIN`], twice as long after each further such
//! close, at most [`OFF_MAX`]; when the time comes the subscription is sent
//! on the connection that is up (no reconnect needed). A connection
//! without it that the peer also closes within [`KILL_WINDOW`] of its
//! CONNACK shows the link, not the subscription, is at fault: the verdict
//! is withdrawn and every connection subscribes again. A granted SUBACK
//! clears everything. Pure: time is passed in.

use std::time::{Duration, Instant};

/// Connections in a row closed right after their command SUBSCRIBE before
/// commands go off.
pub(super) const KILLS_TO_JUDGE: u32 = 3;
/// How soon after the SUBSCRIBE a close counts against it (a broker that
/// answers a SUBSCRIBE by closing does so at once).
pub(super) const KILL_WINDOW: Duration = Duration::from_secs(10);
/// The first time commands stay off; doubles with each further close.
pub(super) const OFF_MIN: Duration = Duration::from_secs(5);
/// The longest commands stay off before the subscription is tried again.
pub(super) const OFF_MAX: Duration = Duration::from_secs(300);

/// What a connection's end changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum Verdict {
    /// Nothing new.
    Same,
    /// Commands off for this long (`kills` closes so far).
    Off {
        /// Connections closed right after their SUBSCRIBE, in a row.
        kills: u32,
        /// Until the subscription is tried again.
        off_for: Duration,
    },
    /// A connection without the subscription was closed as soon: the link
    /// is at fault, not the subscription; it goes out again.
    Withdrawn,
}

/// The command subscription's record across connections (see the module
/// doc).
#[derive(Debug, Clone)]
pub(super) struct SubJudge {
    /// Connections in a row closed right after their SUBSCRIBE.
    kills: u32,
    /// Without the subscription until then.
    off_until: Option<Instant>,
    /// The next time off.
    off_for: Duration,
    /// When this connection's SUBSCRIBE went out, while no SUBACK came.
    sent_at: Option<Instant>,
    /// When this connection came up without the subscription.
    without_since: Option<Instant>,
}

impl SubJudge {
    /// Nothing seen: subscribe on every connection.
    pub(super) fn new() -> SubJudge {
        SubJudge {
            kills: 0,
            off_until: None,
            off_for: OFF_MIN,
            sent_at: None,
            without_since: None,
        }
    }

    /// CONNACK at `now`: whether to send the SUBSCRIBE on this connection.
    pub(super) fn at_connack(&mut self, now: Instant) -> bool {
        self.sent_at = None;
        if self.off_until.is_some_and(|t| now < t) {
            self.without_since = Some(now);
            return false;
        }
        self.without_since = None;
        true
    }

    /// Connected without the subscription: when to send it after all.
    pub(super) fn retry_at(&self) -> Option<Instant> {
        self.without_since.and(self.off_until)
    }

    /// The SUBSCRIBE went out at `now`.
    pub(super) fn sent(&mut self, now: Instant) {
        self.sent_at = Some(now);
        self.without_since = None;
    }

    /// Its SUBACK came: granted (everything is forgotten), or refused (an
    /// ACL that answers; not a close).
    pub(super) fn answered(&mut self, granted: bool) {
        if granted {
            *self = SubJudge::new();
        } else {
            self.sent_at = None;
        }
    }

    /// Why commands cannot arrive, while the verdict stands.
    pub(super) fn why_off(&self, now: Instant) -> Option<String> {
        if self.kills < KILLS_TO_JUDGE {
            return None;
        }
        let next = match self.off_until {
            Some(t) if t > now => format!("tried again in {} s", (t - now).as_secs().max(1)),
            _ => "being tried again".to_owned(),
        };
        Some(format!(
            "the broker closed the connection right after the command SUBSCRIBE {} times in a row (an ACL that answers by disconnecting?): connecting without it, {next} (off {} s at most each time)",
            self.kills,
            OFF_MAX.as_secs()
        ))
    }

    /// The connection ended at `now`. `by_peer`: closed by the broker or
    /// the network, not by this agent (a stop, a reconfigure, the
    /// watchdog).
    pub(super) fn ended(&mut self, now: Instant, by_peer: bool) -> Verdict {
        let sent = self.sent_at.take();
        let without = self.without_since.take();
        let soon = |t: Instant| now.saturating_duration_since(t) < KILL_WINDOW;
        match (sent, without) {
            (Some(at), _) if by_peer && soon(at) => {
                self.kills += 1;
                if self.kills < KILLS_TO_JUDGE {
                    return Verdict::Same;
                }
                let off_for = self.off_for;
                self.off_until = Some(now + off_for);
                self.off_for = (off_for * 2).min(OFF_MAX);
                Verdict::Off {
                    kills: self.kills,
                    off_for,
                }
            }
            (None, Some(since)) if by_peer && soon(since) && self.kills > 0 => {
                *self = SubJudge::new();
                Verdict::Withdrawn
            }
            _ => Verdict::Same,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A connection at `t` that subscribes and is closed by the peer 50 ms later.
    fn killed(j: &mut SubJudge, t: Instant) -> Verdict {
        assert!(j.at_connack(t), "did not subscribe at {t:?}");
        j.sent(t);
        j.ended(t + Duration::from_millis(50), true)
    }

    #[test]
    fn two_closes_after_the_subscribe_are_not_a_verdict() {
        // Issue 33: two drops during subscribe turned commands off for 10
        // minutes; a flaky link or two TCP resets did it.
        let t0 = Instant::now();
        let mut j = SubJudge::new();
        assert_eq!(killed(&mut j, t0), Verdict::Same);
        assert_eq!(killed(&mut j, t0 + Duration::from_secs(1)), Verdict::Same);
        assert!(j.why_off(t0).is_none());
        assert!(
            j.at_connack(t0 + Duration::from_secs(2)),
            "commands went off"
        );
    }

    #[test]
    fn three_closes_turn_commands_off_for_seconds_doubling_to_the_bound() {
        let ms = Duration::from_millis;
        let mut t = Instant::now();
        let mut j = SubJudge::new();
        killed(&mut j, t);
        killed(&mut j, t);
        let mut verdict = killed(&mut j, t);
        let mut offs = Vec::new();
        for _ in 0..8 {
            let Verdict::Off { off_for, .. } = verdict else {
                panic!("{verdict:?}");
            };
            offs.push(off_for.as_secs());
            let end = t + ms(50);
            // The next connection comes up without it, says why ...
            assert!(!j.at_connack(end + ms(100)));
            assert!(j
                .why_off(end + ms(100))
                .is_some_and(|w| w.contains("tried again in")));
            // ... and sends it on that connection when the time comes.
            let due = j.retry_at().expect("a retry time");
            assert_eq!(due, end + off_for);
            j.sent(due);
            t = due;
            verdict = j.ended(t + ms(50), true);
        }
        assert_eq!(offs, [5, 10, 20, 40, 80, 160, 300, 300]);
    }

    #[test]
    fn a_connection_without_it_closed_as_soon_withdraws_the_verdict() {
        let t0 = Instant::now();
        let mut j = SubJudge::new();
        for i in 0..3 {
            killed(&mut j, t0 + Duration::from_secs(i));
        }
        let t = t0 + Duration::from_secs(3);
        assert!(!j.at_connack(t));
        // The peer closes this one too, without any SUBSCRIBE: the link.
        assert_eq!(
            j.ended(t + Duration::from_secs(1), true),
            Verdict::Withdrawn
        );
        assert!(j.why_off(t).is_none());
        assert!(j.at_connack(t + Duration::from_secs(2)));
    }

    #[test]
    fn closes_by_this_agent_or_late_ones_do_not_count_and_a_suback_clears() {
        let t0 = Instant::now();
        let mut j = SubJudge::new();
        for i in 0..5 {
            let t = t0 + Duration::from_secs(20 * i);
            assert!(j.at_connack(t));
            j.sent(t);
            // Ours (stop, watchdog), or the peer's long after the SUBSCRIBE.
            let by_peer = i % 2 == 0;
            assert_eq!(
                j.ended(
                    t + Duration::from_secs(if by_peer { 11 } else { 1 }),
                    by_peer
                ),
                Verdict::Same
            );
        }
        killed(&mut j, t0);
        killed(&mut j, t0);
        assert!(j.at_connack(t0));
        j.sent(t0);
        j.answered(true);
        killed(&mut j, t0);
        assert!(
            j.why_off(t0).is_none(),
            "a granted SUBACK did not clear the count"
        );
    }
}
