//! Delivery order: which waiting row the delivery thread offers next.
//!
//! One job: after an outage, the rows that matter go first. Each row has
//! its stream's priority (0..=255, higher first; `priority` on a source or
//! an ingest stream; `_commands` and `_agent` 200, `durability = "full"`
//! streams 100, others 0, see [`crate::config::Config::stream_priorities`]).
//!
//! - **Levels.** Rows wait in one queue per priority, each in row-id order
//!   (so in sequence order per stream: a stream's rows are all at one
//!   priority, [`crate::spool::priority`]). A pick takes the front row of
//!   the highest priority with rows waiting.
//! - **Starvation bound.** While several priorities have rows waiting,
//!   every `100 / min_share_pct`-th pick (`mqtt.min_share_pct`, default 10:
//!   every 10th) goes to a lower one instead, the lower priorities taking
//!   turns; so lower priorities together get at least that share of the
//!   publishes offered. 0 is strict priority.
//! - **Fresh data first.** A stream with `live_first = true` has its rows
//!   appended since the current connection came up (row id above the
//!   newest at CONNACK) offered ahead of its own backlog, at its priority:
//!   while its priority also has backlog waiting, fresh rows and backlog
//!   take turns (every other pick each), so a steady flow of fresh rows
//!   holds back neither the stream's own backlog nor another stream's, and
//!   the backlog still drains completely, in order. The envelope keeps
//!   `seq` and `ts_ms`, so consumers can order.
//!
//! Bounds: at most [`PREFETCH`] rows are read ahead per lane (priority 0,
//! priorities above 0, fresh rows), whatever the backlog. After a lost
//! connection everything is read again from the oldest unacknowledged row
//! ([`Lanes::reset`], I7), and the spool's state decides what is sent:
//! nothing here retires or skips a row.

use crate::spool::priority::Lane;
use crate::spool::{OutRow, Spool, SpoolError};
use std::collections::{BTreeMap, HashSet, VecDeque};

/// Rows read ahead per lane and query. Bounds delivery memory: at most
/// three times this many payloads are held, whatever the backlog.
pub const PREFETCH: usize = 256;

// A read of PREFETCH rows is never cut short by the spool's own cap, so a
// read that returns fewer saw every row up to the newest ([`Lanes::refill`]).
const _: () = assert!(PREFETCH <= crate::spool::priority::LANE_READ_MAX);

#[derive(Debug, Default)]
struct Level {
    /// Fresh rows of `live_first` streams, in row-id order.
    live: VecDeque<OutRow>,
    /// Every other row of this priority, in row-id order.
    backlog: VecDeque<OutRow>,
}

impl Level {
    fn is_empty(&self) -> bool {
        self.live.is_empty() && self.backlog.is_empty()
    }
}

/// The rows read ahead for delivery, by priority, and the read positions of
/// the three lanes in the current epoch.
#[derive(Debug)]
pub struct Lanes {
    /// Picks between share turns (`100 / min_share_pct`); 0: none.
    share_every: u64,
    live_streams: Vec<String>,
    levels: BTreeMap<u8, Level>,
    normal_cursor: i64,
    priority_cursor: i64,
    priority_buffered: usize,
    live_cursor: i64,
    live_buffered: usize,
    /// Rows above this id are fresh (set at CONNACK; `i64::MAX` while
    /// disconnected).
    live_boundary: i64,
    /// Rows the fresh lane read that their own lane has not reached yet
    /// (it skips them once, then forgets them).
    live_taken: HashSet<i64>,
    picks: u64,
    share_turn: usize,
    /// The last pick in a level with both fresh rows and backlog was fresh.
    live_turn: bool,
}

impl Lanes {
    /// Empty lanes. `min_share_pct`: `mqtt.min_share_pct` (0..=50);
    /// `live_streams`: the streams with `live_first = true`.
    pub fn new(min_share_pct: u8, live_streams: HashSet<String>) -> Lanes {
        let mut live_streams: Vec<String> = live_streams.into_iter().collect();
        live_streams.sort();
        Lanes {
            share_every: 100u64.checked_div(u64::from(min_share_pct)).unwrap_or(0),
            live_streams,
            levels: BTreeMap::new(),
            normal_cursor: 0,
            priority_cursor: 0,
            priority_buffered: 0,
            live_cursor: 0,
            live_buffered: 0,
            live_boundary: i64::MAX,
            live_taken: HashSet::new(),
            picks: 0,
            share_turn: 0,
            live_turn: false,
        }
    }

    /// Forget everything read ahead: the next read starts again from the
    /// oldest unacknowledged row of each lane (after a lost connection, I7).
    /// No row is fresh until [`Lanes::connected`].
    pub fn reset(&mut self) {
        self.levels.clear();
        self.normal_cursor = 0;
        self.priority_cursor = 0;
        self.priority_buffered = 0;
        self.live_cursor = 0;
        self.live_buffered = 0;
        self.live_boundary = i64::MAX;
        self.live_taken.clear();
    }

    /// A connection came up: rows above `newest_id` (the newest row now)
    /// are fresh.
    pub fn connected(&mut self, newest_id: i64) {
        self.live_boundary = newest_id;
        self.live_cursor = self.live_cursor.max(newest_id);
    }

    /// Rows read ahead and not yet picked.
    pub fn buffered(&self) -> usize {
        self.levels
            .values()
            .map(|l| l.live.len() + l.backlog.len())
            .sum()
    }

    /// The row ids read ahead and not yet picked.
    pub fn buffered_ids(&self) -> impl Iterator<Item = i64> + '_ {
        self.levels
            .values()
            .flat_map(|l| l.live.iter().chain(l.backlog.iter()))
            .map(|r| r.id)
    }

    /// Drop `rows` from what is read ahead (they were retired since they
    /// were read: a receipt for a row that waited for it). The read
    /// positions stay: those rows are resolved in the spool now.
    pub fn discard(&mut self, rows: &HashSet<i64>) {
        if rows.is_empty() {
            return;
        }
        for (prio, level) in self.levels.iter_mut() {
            let before = (level.live.len(), level.backlog.len());
            level.live.retain(|r| !rows.contains(&r.id));
            level.backlog.retain(|r| !rows.contains(&r.id));
            self.live_buffered -= before.0 - level.live.len();
            if *prio > 0 {
                self.priority_buffered -= before.1 - level.backlog.len();
            }
        }
    }

    /// Read ahead from `spool` what each lane lacks: priority 0 when its
    /// queue is empty, priorities above 0 and fresh rows up to
    /// [`PREFETCH`] each. One indexed query per lane at most, none for a
    /// lane that has read up to the newest row.
    ///
    /// The newest row id is read first. Row ids are handed out in commit
    /// order and never reused ([`crate::spool`]), so every row at or below
    /// it is visible to the reads that follow: a read that returns fewer
    /// rows than it asked for has seen all of them, and its lane's cursor
    /// moves up to it. Without that, the priority-0 lane of a spool whose
    /// rows are all of higher priority (a `full` stream's) walked every row
    /// above the acknowledged mark at each read, up to [`crate::delivery::RECORD_BATCH`]
    /// rows per read.
    pub fn refill(&mut self, spool: &Spool) -> Result<(), SpoolError> {
        let newest = spool.newest_id()?;
        if self.priority_buffered < PREFETCH && newest > self.priority_cursor {
            let limit = PREFETCH - self.priority_buffered;
            let rows = spool.sendable_lane(Lane::Priority, self.priority_cursor, limit)?;
            self.priority_cursor = read_through(self.priority_cursor, &rows, limit, newest);
            for row in rows {
                if !self.live_taken.remove(&row.id) {
                    self.priority_buffered += 1;
                    self.level(row.prio).backlog.push_back(row);
                }
            }
        }
        let normal_empty = self.levels.get(&0).is_none_or(|l| l.backlog.is_empty());
        if normal_empty && newest > self.normal_cursor {
            let rows = spool.sendable_lane(Lane::Normal, self.normal_cursor, PREFETCH)?;
            self.normal_cursor = read_through(self.normal_cursor, &rows, PREFETCH, newest);
            for row in rows {
                if !self.live_taken.remove(&row.id) {
                    self.level(0).backlog.push_back(row);
                }
            }
        }
        self.refill_live(spool, newest)
    }

    fn refill_live(&mut self, spool: &Spool, through: i64) -> Result<(), SpoolError> {
        if self.live_streams.is_empty()
            || self.live_boundary == i64::MAX
            || self.live_buffered >= PREFETCH
        {
            return Ok(());
        }
        let after = self.live_cursor.max(self.live_boundary);
        if through <= after {
            return Ok(());
        }
        let limit = PREFETCH - self.live_buffered;
        let rows = spool.sendable_of_streams(&self.live_streams, after, through, limit)?;
        // Rows in (after, through] not returned are of other streams or
        // resolved: never look at them again in this lane.
        self.live_cursor = match rows.last() {
            Some(last) if rows.len() >= limit => last.id,
            _ => through,
        };
        for row in rows {
            let own = if row.prio == 0 {
                self.normal_cursor
            } else {
                self.priority_cursor
            };
            if row.id <= own {
                continue; // its own lane has read it already
            }
            self.live_taken.insert(row.id);
            self.live_buffered += 1;
            self.level(row.prio).live.push_back(row);
        }
        Ok(())
    }

    fn level(&mut self, prio: u8) -> &mut Level {
        self.levels.entry(prio).or_default()
    }

    /// The next row to offer: the front row of the highest priority with
    /// rows waiting (its fresh rows first), except on share turns, which go
    /// to the lower priorities in turn. `None` when nothing is read ahead.
    pub fn pick(&mut self) -> Option<OutRow> {
        // The priorities with rows waiting, highest first, without a list
        // of them (this runs once per row offered).
        let waiting = || {
            self.levels
                .iter()
                .rev()
                .filter(|(_, l)| !l.is_empty())
                .map(|(p, _)| *p)
        };
        let top = waiting().next()?;
        self.picks += 1;
        let share_turn = self.share_every > 0 && self.picks.is_multiple_of(self.share_every);
        let lower = if share_turn { waiting().count() - 1 } else { 0 };
        let prio = if lower > 0 {
            let turn = self.share_turn.wrapping_add(1);
            self.share_turn = turn;
            waiting().nth(1 + turn % lower).unwrap_or(top)
        } else {
            top
        };
        let level = self.levels.get_mut(&prio)?;
        // Fresh rows and the backlog take turns while both wait, so neither
        // another stream's backlog nor the stream's own is held back by a
        // steady flow of fresh rows.
        let live = !level.live.is_empty() && {
            self.live_turn = !self.live_turn;
            self.live_turn || level.backlog.is_empty()
        };
        let row = if live {
            self.live_buffered -= 1;
            level.live.pop_front()?
        } else {
            let r = level.backlog.pop_front()?;
            if prio > 0 {
                self.priority_buffered -= 1;
            }
            r
        };
        Some(row)
    }
}

/// A lane's cursor after a read from `cursor` that asked for `limit` rows
/// and got `rows`, with `newest` the newest row id read before it: the last
/// row returned, or `newest` when the read came back short (it saw every
/// row up to `newest`; see [`Lanes::refill`]).
fn read_through(cursor: i64, rows: &[OutRow], limit: usize, newest: i64) -> i64 {
    let last = rows.last().map_or(cursor, |r| r.id);
    if rows.len() < limit {
        last.max(newest)
    } else {
        last
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::envelope::{EventIdGen, Format};
    use crate::event::reading::FieldValue;
    use crate::spool::{NewEvent, SpoolOptions};
    use std::collections::HashMap;

    fn spool(dir: &std::path::Path, prios: &[(&str, u8)]) -> Spool {
        let mut s = Spool::open(&dir.join("s.db"), &SpoolOptions::default()).unwrap();
        let want: HashMap<String, u8> = prios.iter().map(|(n, p)| ((*n).to_owned(), *p)).collect();
        s.set_priorities(&want).unwrap();
        s
    }

    fn append(s: &mut Spool, stream: &str, n: usize) {
        let evs: Vec<NewEvent> = (0..n)
            .map(|i| {
                NewEvent::new(
                    stream,
                    1,
                    true,
                    vec![("x".into(), FieldValue::Num(i as f64))],
                )
            })
            .collect();
        s.append(
            &evs,
            &mut EventIdGen::new().unwrap(),
            "dev",
            Format::Json,
            1,
        )
        .unwrap();
    }

    fn drain(l: &mut Lanes, s: &Spool) -> Vec<(String, i64)> {
        let mut out = Vec::new();
        loop {
            l.refill(s).unwrap();
            let Some(r) = l.pick() else { break };
            out.push((r.stream, r.id));
        }
        out
    }

    fn streams(order: &[(String, i64)]) -> String {
        order.iter().map(|(s, _)| &s[..1]).collect()
    }

    #[test]
    fn higher_priority_rows_go_first_and_each_stream_stays_in_row_order() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[("alarm", 100), ("tele", 0)]);
        append(&mut s, "tele", 5);
        append(&mut s, "alarm", 2);
        append(&mut s, "_commands", 1);
        append(&mut s, "tele", 2);
        let mut l = Lanes::new(0, HashSet::new());
        let order = drain(&mut l, &s);
        assert_eq!(streams(&order), "_aattttttt");
        for name in ["tele", "alarm"] {
            let ids: Vec<i64> = order
                .iter()
                .filter(|(n, _)| n == name)
                .map(|r| r.1)
                .collect();
            assert!(ids.windows(2).all(|w| w[0] < w[1]), "{name}: {ids:?}");
        }
    }

    #[test]
    fn a_lane_with_none_of_its_rows_reads_past_the_others_and_still_gets_later_ones() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[("alarm", 100), ("tele", 0)]);
        append(&mut s, "alarm", 3);
        let mut l = Lanes::new(0, HashSet::new());
        assert_eq!(streams(&drain(&mut l, &s)), "aaa");
        // The priority-0 lane found none of its rows up to the newest, so
        // its next read starts past them, not at the acknowledged mark.
        let newest = s.newest_id().unwrap();
        assert_eq!((l.normal_cursor, l.priority_cursor), (newest, newest));
        // More than one read's worth of priority-0 rows, then one alarm:
        // the full read keeps its cursor at its last row, and none is lost.
        append(&mut s, "tele", PREFETCH + 4);
        append(&mut s, "alarm", 1);
        let order = drain(&mut l, &s);
        assert_eq!(order.len(), PREFETCH + 5, "{order:?}");
        assert_eq!(order.iter().filter(|(n, _)| n == "alarm").count(), 1);
        let tele: Vec<i64> = order
            .iter()
            .filter(|(n, _)| n == "tele")
            .map(|r| r.1)
            .collect();
        assert!(tele.windows(2).all(|w| w[1] == w[0] + 1), "{tele:?}");
        // After a reset everything unacknowledged is read again.
        l.reset();
        assert_eq!(drain(&mut l, &s).len(), PREFETCH + 8);
    }

    #[test]
    fn a_lower_priority_gets_every_tenth_pick_while_a_higher_one_has_backlog() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[("alarm", 100)]);
        append(&mut s, "tele", 100);
        append(&mut s, "alarm", 100);
        let mut l = Lanes::new(10, HashSet::new());
        let order = drain(&mut l, &s);
        assert_eq!(order.len(), 200);
        let first_100 = &order[..100];
        let tele = first_100.iter().filter(|(n, _)| n == "tele").count();
        assert_eq!(tele, 10, "{}", streams(first_100));
        // Strict priority: none.
        let mut l = Lanes::new(0, HashSet::new());
        let order = drain(&mut l, &s);
        assert_eq!(order[..100].iter().filter(|(n, _)| n == "tele").count(), 0);
    }

    #[test]
    fn share_turns_rotate_between_the_lower_priorities() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[("hi", 200), ("mid", 100)]);
        append(&mut s, "lo", 50);
        append(&mut s, "mid", 50);
        append(&mut s, "hi", 100);
        let mut l = Lanes::new(50, HashSet::new());
        let order = drain(&mut l, &s);
        let first = &order[..40];
        let count = |n: &str| first.iter().filter(|(s, _)| s == n).count();
        assert_eq!((count("hi"), count("mid"), count("lo")), (20, 10, 10));
    }

    #[test]
    fn fresh_rows_of_a_live_first_stream_go_ahead_of_its_backlog_which_still_drains() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[]);
        append(&mut s, "dash", 300);
        append(&mut s, "tele", 10);
        let mut l = Lanes::new(0, ["dash".to_owned()].into());
        l.connected(s.newest_id().unwrap());
        append(&mut s, "dash", 3);
        append(&mut s, "tele", 1);
        let order = drain(&mut l, &s);
        let ids: Vec<i64> = order.iter().map(|r| r.1).collect();
        assert_eq!(
            &ids[..6],
            &[311, 1, 312, 2, 313, 3],
            "fresh rows first, taking turns with the backlog"
        );
        assert_eq!(order.len(), 314, "every row once");
        let mut sorted = ids.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 314, "no row twice");
        let backlog: Vec<i64> = ids
            .iter()
            .copied()
            .filter(|id| !(311..=313).contains(id))
            .collect();
        assert_eq!(backlog, (1..=310).chain(314..=314).collect::<Vec<_>>());
    }

    #[test]
    fn without_a_connection_nothing_is_fresh_and_reset_reads_again_from_the_start() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[]);
        append(&mut s, "dash", 3);
        let mut l = Lanes::new(0, ["dash".to_owned()].into());
        let first = drain(&mut l, &s);
        assert_eq!(first.iter().map(|r| r.1).collect::<Vec<_>>(), [1, 2, 3]);
        assert!(
            drain(&mut l, &s).is_empty(),
            "nothing read twice in an epoch"
        );
        l.reset();
        assert_eq!(
            drain(&mut l, &s).len(),
            3,
            "a reset offers the unacknowledged rows again"
        );
    }

    #[test]
    fn a_priority_change_moves_the_unacknowledged_rows_of_the_stream() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[]);
        append(&mut s, "tele", 4);
        append(&mut s, "pump", 4);
        s.retire(&[5]).unwrap();
        let changed = s
            .set_priorities(&[("pump".to_owned(), 150)].into())
            .unwrap();
        assert_eq!(changed.len(), 1);
        assert_eq!(
            (changed[0].from, changed[0].to, changed[0].rows),
            (0, 150, 4)
        );
        let mut l = Lanes::new(0, HashSet::new());
        let order = drain(&mut l, &s);
        assert_eq!(
            streams(&order),
            "ppptttt",
            "pump's three unacknowledged rows first"
        );
        // Appended from now on with the new priority too.
        append(&mut s, "pump", 1);
        l.reset();
        let again = drain(&mut l, &s);
        let ids: Vec<i64> = again.iter().map(|r| r.1).collect();
        assert_eq!(&ids[..4], &[6, 7, 8, 9], "{ids:?}");
    }

    #[test]
    fn backlog_per_stream_counts_unacknowledged_rows_highest_priority_first() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[("alarm", 100)]);
        append(&mut s, "tele", 3);
        append(&mut s, "alarm", 2);
        s.retire(&[1, 4]).unwrap();
        s.mark_failed(2, "test", "test").unwrap();
        let b = s.backlog_by_stream(1001).unwrap();
        let got: Vec<(&str, u8, u64, Option<i64>)> = b
            .iter()
            .map(|b| {
                (
                    b.stream.as_str(),
                    b.priority,
                    b.rows,
                    b.oldest_unacked_age_ms,
                )
            })
            .collect();
        assert_eq!(
            got,
            [("alarm", 100, 1, Some(1000)), ("tele", 0, 1, Some(1000))]
        );
    }

    /// Regression (found by the delivery model check): a requeued FAILED
    /// row was appended again at priority 0, so a priority stream's rows
    /// were split between two lanes and went out of sequence order.
    #[test]
    fn a_requeued_failed_row_keeps_its_streams_priority() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[("alarm", 100)]);
        append(&mut s, "alarm", 1);
        append(&mut s, "tele", 2);
        s.mark_failed(1, "test", "test").unwrap();
        assert_eq!(s.requeue_failed(None).unwrap(), 1);
        append(&mut s, "alarm", 1);
        let mut l = Lanes::new(0, HashSet::new());
        let order = drain(&mut l, &s);
        assert_eq!(streams(&order), "aatt", "{order:?}");
        assert_eq!(order[0].1, 4, "the requeued row, appended again as row 4");
        assert_eq!(order[1].1, 5);
    }

    /// Regression (found by a reviewer): fresh rows went ahead of every
    /// backlog of their priority, so a steady flow of them (at link rate)
    /// starved the other streams and the stream's own backlog.
    #[test]
    fn a_steady_flow_of_fresh_rows_starves_no_backlog() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = spool(dir.path(), &[]);
        append(&mut s, "tele", 50);
        append(&mut s, "live", 5);
        let mut l = Lanes::new(0, ["live".to_owned()].into());
        l.connected(s.newest_id().unwrap());
        let mut picked = Vec::new();
        for _ in 0..40 {
            append(&mut s, "live", 1); // one fresh row per pick: the link's rate
            l.refill(&s).unwrap();
            picked.push(l.pick().unwrap());
        }
        let tele = picked.iter().filter(|r| r.stream == "tele").count();
        let fresh = picked.iter().filter(|r| r.id > 55).count();
        assert_eq!((tele, fresh), (20, 20), "half each");
        let order: Vec<i64> = picked.iter().filter(|r| r.id <= 55).map(|r| r.id).collect();
        assert!(
            order.windows(2).all(|w| w[0] < w[1]),
            "backlog in order: {order:?}"
        );
    }
}
