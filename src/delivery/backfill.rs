//! Backfill's bookkeeping in the delivery thread: the nonces this board
//! announced, the requests it accepted (and refused, by reason), the ranges
//! it still has to send again, and the pace of sending them.
//!
//! Pure: no I/O, time passed in. Its one rule: **a request is worth one
//! answer, and what it costs is bounded before it is accepted**: it must
//! name a nonce among the last [`NONCES_KEPT`] this board announced
//! (no clock involved: an older request is worthless) and an id not seen
//! before (a replay); at most [`REQUESTS_PER_MINUTE`] are accepted a
//! minute (a flood is refused, counted); a range is clipped to what the
//! board appended and still holds, and to [`MAX_QUEUED_ROWS`] rows queued
//! in all; a range already queued is not queued twice. Rows go out at
//! most `mqtt.backfill_rows_per_sec` ([`Pace`]); the caller offers them
//! only while no live row waits.

use crate::event::backfill::{GoneReason, Held, Request, Token};
use std::collections::{HashSet, VecDeque};
use std::time::{Duration, Instant};

/// Nonces (announcements) a request may name: the newest this many.
pub const NONCES_KEPT: usize = 4;
/// Request ids remembered (a replay of one of them is refused).
pub const IDS_KEPT: usize = 1024;
/// Requests accepted per minute, at most.
pub const REQUESTS_PER_MINUTE: usize = 6;
/// Rows queued to send again, all requests, at most: a range beyond is
/// left for the fleet to ask again.
pub const MAX_QUEUED_ROWS: u64 = 100_000;
/// Ranges queued, at most.
pub const MAX_JOBS: usize = 1024;
/// A range sent again is not queued again for this long, whoever asks: a
/// flood of requests sends each row once a minute at most.
pub const RECENT: Duration = Duration::from_secs(60);
/// Ranges remembered as recently sent, at most.
const RECENT_KEPT: usize = 256;
/// How far a request's time may be from this board's clock, when the
/// board's clock is trusted. The nonce is what makes a request fresh;
/// this only refuses one made by a sink whose clock is far off, which says
/// something is wrong.
pub const MAX_SKEW_MS: i64 = 24 * 3600 * 1000;

/// Why a request was refused (it sends nothing; counted by reason).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Names a nonce this board did not announce lately.
    Stale,
    /// An id seen before.
    Replayed,
    /// Over [`REQUESTS_PER_MINUTE`].
    Flood,
    /// `mqtt.backfill_rows_per_sec = 0`.
    Off,
    /// Made at a time more than [`MAX_SKEW_MS`] from this board's trusted
    /// clock.
    Skewed,
}

impl Refusal {
    /// The counter word.
    pub fn word(self) -> &'static str {
        match self {
            Refusal::Stale => "stale",
            Refusal::Replayed => "replayed",
            Refusal::Flood => "flood",
            Refusal::Off => "off",
            Refusal::Skewed => "skewed",
        }
    }
}

/// A range of one stream still to send again, for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    /// The request it answers.
    pub request: Token,
    /// The stream.
    pub stream: String,
    /// Its id in the spool.
    pub stream_id: i64,
    /// The first sequence number it was queued with.
    pub first: i64,
    /// The next sequence number to look at.
    pub next: i64,
    /// The last one asked for.
    pub last: i64,
    /// The row id to read on from (`None`: not found yet).
    pub from_id: Option<i64>,
}

impl Job {
    /// Rows left in it.
    pub fn rows(&self) -> u64 {
        (self.last - self.next + 1).max(0) as u64
    }
}

/// What accepting a request did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Accepted {
    /// Rows queued.
    pub queued: u64,
    /// Ranges the board cannot send, per stream: beyond its newest, or
    /// taken by retention.
    pub gone: crate::event::backfill::GoneRanges,
    /// Rows not queued for want of room (the fleet asks again later).
    pub clipped: u64,
}

/// The rows-per-second pace of sending again (a token bucket of one
/// second's worth).
#[derive(Debug, Clone)]
pub struct Pace {
    per_sec: u32,
    tokens: f64,
    at: Instant,
}

impl Pace {
    /// `per_sec` rows a second, the bucket full at `now`.
    pub fn new(per_sec: u32, now: Instant) -> Pace {
        Pace {
            per_sec,
            tokens: f64::from(per_sec),
            at: now,
        }
    }

    /// Rows that may go at `now`.
    pub fn available(&mut self, now: Instant) -> u64 {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        let cap = f64::from(self.per_sec);
        self.tokens = (self.tokens + dt * cap).min(cap);
        self.tokens.max(0.0) as u64
    }

    /// `n` rows went.
    pub fn spend(&mut self, n: u64) {
        self.tokens -= n as f64;
    }

    /// When one more row may go, after `now`.
    pub fn next_at(&self, now: Instant) -> Instant {
        if self.tokens >= 1.0 || self.per_sec == 0 {
            return now;
        }
        now + Duration::from_secs_f64((1.0 - self.tokens) / f64::from(self.per_sec))
    }
}

/// The board's backfill state.
#[derive(Debug)]
pub struct Backfill {
    nonces: VecDeque<Token>,
    ids: VecDeque<Token>,
    id_set: HashSet<Token>,
    accepted_at: VecDeque<Instant>,
    jobs: VecDeque<Job>,
    queued_rows: u64,
    /// Ranges done lately: (stream id, first, last, when).
    recent: VecDeque<(i64, i64, i64, Instant)>,
    /// The pace of sending again.
    pub pace: Pace,
    per_sec: u32,
}

impl Backfill {
    /// Nothing announced, nothing queued; rows go at most `per_sec` a second.
    pub fn new(per_sec: u32, now: Instant) -> Backfill {
        Backfill {
            nonces: VecDeque::new(),
            ids: VecDeque::new(),
            id_set: HashSet::new(),
            accepted_at: VecDeque::new(),
            jobs: VecDeque::new(),
            queued_rows: 0,
            recent: VecDeque::new(),
            pace: Pace::new(per_sec, now),
            per_sec,
        }
    }

    /// A holdings announcement with `nonce` is going out: requests may name it.
    pub fn announced(&mut self, nonce: Token) {
        self.nonces.push_back(nonce);
        while self.nonces.len() > NONCES_KEPT {
            self.nonces.pop_front();
        }
    }

    /// Whether `req` (already checked: signed for this board by a trusted
    /// key) may be served at `now`; `clock`: this board's wall clock, when
    /// it is trusted. An accepted request's id is remembered.
    ///
    /// Errors: [`Refusal`].
    pub fn admit(
        &mut self,
        req: &Request,
        now: Instant,
        clock: Option<i64>,
    ) -> Result<(), Refusal> {
        if !self.nonces.contains(&req.nonce) {
            return Err(Refusal::Stale);
        }
        if self.id_set.contains(&req.id) {
            return Err(Refusal::Replayed);
        }
        if clock.is_some_and(|c| c.abs_diff(req.at_ms) > MAX_SKEW_MS as u64) {
            return Err(Refusal::Skewed);
        }
        if self.per_sec == 0 {
            return Err(Refusal::Off);
        }
        while self
            .accepted_at
            .front()
            .is_some_and(|t| now.saturating_duration_since(*t) >= Duration::from_secs(60))
        {
            self.accepted_at.pop_front();
        }
        if self.accepted_at.len() >= REQUESTS_PER_MINUTE {
            return Err(Refusal::Flood);
        }
        self.accepted_at.push_back(now);
        self.ids.push_back(req.id);
        self.id_set.insert(req.id);
        while self.ids.len() > IDS_KEPT {
            if let Some(old) = self.ids.pop_front() {
                self.id_set.remove(&old);
            }
        }
        Ok(())
    }

    /// Queue what `req` asks for, given what the spool holds of each stream
    /// (`holdings`: id, name, [`Held`]): each range clipped to `oldest..=
    /// newest`, the rest answered gone (beyond the newest, or retention);
    /// parts already queued are not queued again; at most
    /// [`MAX_QUEUED_ROWS`] rows and [`MAX_JOBS`] ranges in all; nor is a
    /// part sent within [`RECENT`] of `now`.
    pub fn plan(
        &mut self,
        req: &Request,
        holdings: &[(i64, String, Held)],
        now: Instant,
    ) -> Accepted {
        while self
            .recent
            .front()
            .is_some_and(|r| now.saturating_duration_since(r.3) >= RECENT)
        {
            self.recent.pop_front();
        }
        let mut out = Accepted::default();
        for (stream, ranges) in &req.ranges {
            let mut gone = Vec::new();
            let held = holdings.iter().find(|(_, n, _)| n == stream);
            for &(f, l) in ranges {
                let Some((id, _, h)) = held else {
                    gone.push((f, l, GoneReason::Beyond));
                    continue;
                };
                if l > h.newest {
                    gone.push((f.max(h.newest + 1), l, GoneReason::Beyond));
                }
                if f < h.oldest {
                    gone.push((f, l.min(h.oldest - 1), GoneReason::Retention));
                }
                let (lo, hi) = (f.max(h.oldest), l.min(h.newest));
                if lo <= hi {
                    self.queue(req.id, stream, *id, lo, hi, &mut out);
                }
            }
            if !gone.is_empty() {
                gone.sort_unstable_by_key(|g| g.0);
                out.gone.push((stream.clone(), gone));
            }
        }
        out
    }

    /// Queue `lo..=hi` of `stream`, less what is queued already and within
    /// the bounds.
    fn queue(
        &mut self,
        request: Token,
        stream: &str,
        stream_id: i64,
        lo: i64,
        hi: i64,
        out: &mut Accepted,
    ) {
        let mut parts = vec![(lo, hi)];
        let busy = self
            .jobs
            .iter()
            .filter(|j| j.stream_id == stream_id)
            .map(|j| (j.next, j.last))
            .chain(
                self.recent
                    .iter()
                    .filter(|r| r.0 == stream_id)
                    .map(|r| (r.1, r.2)),
            );
        for taken in busy {
            parts = parts
                .into_iter()
                .flat_map(|(a, b)| minus((a, b), taken))
                .collect();
        }
        for (a, b) in parts {
            let room = MAX_QUEUED_ROWS.saturating_sub(self.queued_rows);
            let want = (b - a + 1) as u64;
            if room == 0 || self.jobs.len() >= MAX_JOBS {
                out.clipped += want;
                continue;
            }
            let take = want.min(room);
            out.clipped += want - take;
            out.queued += take;
            self.queued_rows += take;
            self.jobs.push_back(Job {
                request,
                stream: stream.to_owned(),
                stream_id,
                first: a,
                next: a,
                last: a + take as i64 - 1,
                from_id: None,
            });
        }
    }

    /// The range to send from now, if any.
    pub fn front(&mut self) -> Option<&mut Job> {
        self.jobs.front_mut()
    }

    /// The front range is done (sent, or answered) at `now`: forget it,
    /// and remember it as sent lately.
    pub fn pop(&mut self, now: Instant) -> Option<Job> {
        let j = self.jobs.pop_front()?;
        self.queued_rows = self.queued_rows.saturating_sub(j.rows());
        if self.recent.len() >= RECENT_KEPT {
            self.recent.pop_front();
        }
        self.recent
            .push_back((j.stream_id, j.first, j.next.min(j.last + 1) - 1, now));
        Some(j)
    }

    /// `n` rows of the front range were looked at (sent or answered).
    pub fn advanced(&mut self, n: u64) {
        self.queued_rows = self.queued_rows.saturating_sub(n);
    }

    /// Rows sent and not yet acknowledged when a connection was lost:
    /// queued again, ahead of the rest (`(stream, stream id, seq)`).
    pub fn lost(&mut self, rows: &[(String, i64, i64)], request: Token) {
        let mut sorted: Vec<&(String, i64, i64)> = rows.iter().collect();
        sorted.sort_by(|a, b| (a.1, a.2).cmp(&(b.1, b.2)).reverse());
        for (stream, id, seq) in sorted {
            self.queued_rows += 1;
            self.jobs.push_front(Job {
                request,
                stream: stream.clone(),
                stream_id: *id,
                first: *seq,
                next: *seq,
                last: *seq,
                from_id: None,
            });
        }
    }

    /// Rows queued.
    pub fn queued_rows(&self) -> u64 {
        self.queued_rows
    }

    /// Whether nothing is queued.
    pub fn idle(&self) -> bool {
        self.jobs.is_empty()
    }
}

/// `a` less `b`, as up to two ranges.
fn minus(a: (i64, i64), b: (i64, i64)) -> Vec<(i64, i64)> {
    if b.1 < a.0 || b.0 > a.1 {
        return vec![a];
    }
    let mut out = Vec::new();
    if a.0 < b.0 {
        out.push((a.0, b.0 - 1));
    }
    if b.1 < a.1 {
        out.push((b.1 + 1, a.1));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::signature::PublicKey;

    fn req(nonce: u8, id: u8, ranges: &[(&str, i64, i64)]) -> Request {
        let mut by: Vec<(String, Vec<(i64, i64)>)> = Vec::new();
        for (s, f, l) in ranges {
            match by.iter_mut().find(|(n, _)| n == s) {
                Some((_, r)) => r.push((*f, *l)),
                None => by.push(((*s).to_owned(), vec![(*f, *l)])),
            }
        }
        Request {
            board: "gw1".into(),
            nonce: [nonce; 16],
            id: [id; 16],
            at_ms: 0,
            ranges: by,
            key: PublicKey([0; 32]),
            sig: [0; 64],
        }
    }

    fn held(oldest: i64, newest: i64) -> Held {
        Held {
            oldest,
            newest,
            pending: newest + 1,
        }
    }

    #[test]
    fn only_a_fresh_nonce_and_a_new_id_are_served_and_a_flood_is_bounded() {
        let t0 = Instant::now();
        let mut b = Backfill::new(100, t0);
        assert_eq!(b.admit(&req(1, 1, &[]), t0, None), Err(Refusal::Stale));
        b.announced([1; 16]);
        assert_eq!(b.admit(&req(1, 1, &[]), t0, None), Ok(()));
        assert_eq!(b.admit(&req(1, 1, &[]), t0, None), Err(Refusal::Replayed));
        // Four newer announcements make nonce 1 worthless.
        for n in 2..=5 {
            b.announced([n; 16]);
        }
        assert_eq!(b.admit(&req(1, 9, &[]), t0, None), Err(Refusal::Stale));
        // A far clock is refused when this board's clock is trusted.
        let mut r = req(5, 8, &[]);
        r.at_ms = 10 * MAX_SKEW_MS;
        assert_eq!(b.admit(&r, t0, Some(0)), Err(Refusal::Skewed));
        assert_eq!(b.admit(&r, t0, None), Ok(()));
        // A flood: REQUESTS_PER_MINUTE a minute (two taken above), then
        // refused.
        let mut ok = 2;
        for id in 10..40 {
            if b.admit(&req(5, id, &[]), t0, None).is_ok() {
                ok += 1;
            }
        }
        assert_eq!(ok, REQUESTS_PER_MINUTE);
        assert_eq!(b.admit(&req(5, 50, &[]), t0, None), Err(Refusal::Flood));
        assert_eq!(
            b.admit(&req(5, 51, &[]), t0 + Duration::from_secs(61), None),
            Ok(())
        );
        let mut off = Backfill::new(0, t0);
        off.announced([1; 16]);
        assert_eq!(off.admit(&req(1, 1, &[]), t0, None), Err(Refusal::Off));
    }

    #[test]
    fn ranges_are_clipped_to_what_is_held_and_bounded_in_rows() {
        let t0 = Instant::now();
        let mut b = Backfill::new(100, t0);
        let h = vec![(7, "s".to_owned(), held(351, 1000))];
        // Beyond the newest, below the oldest, and another board's stream.
        let a = b.plan(&req(1, 1, &[("s", 301, 2000), ("t", 1, 5)]), &h, t0);
        assert_eq!(a.queued, 650);
        assert_eq!(
            a.gone,
            vec![
                (
                    "s".to_owned(),
                    vec![
                        (301, 350, GoneReason::Retention),
                        (1001, 2000, GoneReason::Beyond)
                    ]
                ),
                ("t".to_owned(), vec![(1, 5, GoneReason::Beyond)])
            ]
        );
        // The same range again: nothing queued twice.
        let a = b.plan(&req(1, 2, &[("s", 351, 1000)]), &h, t0);
        assert_eq!(a.queued, 0);
        // An absurd range is held to what the board holds, and to the bound.
        let big = vec![(7, "s".to_owned(), held(1, 5_000_000_000))];
        let a = b.plan(&req(1, 3, &[("s", 1, 9_000_000_000)]), &big, t0);
        assert_eq!(a.queued + 650, MAX_QUEUED_ROWS);
        assert_eq!(a.clipped, 5_000_000_000 - 650 - a.queued);
        assert_eq!(b.queued_rows(), MAX_QUEUED_ROWS);
        let j = b.pop(t0).expect("a job");
        assert_eq!((j.next, j.last), (351, 1000));
        assert_eq!(b.queued_rows(), MAX_QUEUED_ROWS - 650);
    }

    #[test]
    fn a_range_sent_lately_is_not_sent_again_whoever_asks() {
        let t0 = Instant::now();
        let mut b = Backfill::new(100, t0);
        let h = vec![(7, "s".to_owned(), held(1, 100))];
        assert_eq!(b.plan(&req(1, 1, &[("s", 1, 100)]), &h, t0).queued, 100);
        let mut j = b.pop(t0).expect("a job");
        j.next = 101;
        // Sent: asked again within a minute, nothing; after, again.
        b.recent.back_mut().expect("noted").2 = 100;
        assert_eq!(b.plan(&req(1, 2, &[("s", 1, 100)]), &h, t0).queued, 0);
        let later = t0 + RECENT;
        assert_eq!(b.plan(&req(1, 3, &[("s", 50, 60)]), &h, later).queued, 11);
    }

    #[test]
    fn the_pace_is_a_second_of_rows_at_most() {
        let t0 = Instant::now();
        let mut p = Pace::new(200, t0);
        assert_eq!(p.available(t0), 200);
        p.spend(200);
        assert_eq!(p.available(t0), 0);
        assert!(p.next_at(t0) > t0);
        assert_eq!(p.available(t0 + Duration::from_millis(500)), 100);
        assert_eq!(p.available(t0 + Duration::from_secs(60)), 200);
    }
}
