//! The ledger in the sink's SQLite file: its tables (schema version 5),
//! their first filling from the events already stored, and [`Books`] over
//! one transaction.
//!
//! Its one rule: every statement here runs inside the caller's `IMMEDIATE`
//! transaction (the one that stores the batch, or the migration's), so the
//! ledger and the events it describes commit together or not at all.

use super::book::{Arrival, Board, Books, Key, Stored};
use super::{Gap, Line};
use crate::event::backfill::Held;
use rusqlite::{params, OptionalExtension, Transaction};

/// Version 4 to 5: the replay ledger.
///
/// - `ledger`: per (device, stream), the highest sequence number accounted
///   for (`known_seq`), the highest stored (`newest_seq`), the contiguous
///   mark (`contiguous_seq`), events stored at a number already covered
///   (`repeats`), and the board's last holdings of it (`board_*`);
/// - `ledger_gaps`: the numbers missing, as ranges, open or given up
///   (`gone_reason`), with when each was seen and asked for;
/// - `ledger_boards`: per board, its topic prefix, the nonce of its last
///   holdings, and the requests made of it.
pub(crate) const V4_TO_V5: &str = "
CREATE TABLE ledger (
    device_id      TEXT    NOT NULL,
    stream         TEXT    NOT NULL,
    known_seq      INTEGER NOT NULL,
    newest_seq     INTEGER NOT NULL,
    contiguous_seq INTEGER NOT NULL,
    repeats        INTEGER NOT NULL DEFAULT 0,
    board_oldest   INTEGER,
    board_newest   INTEGER,
    board_pending  INTEGER,
    board_at_ms    INTEGER,
    updated_ms     INTEGER NOT NULL,
    PRIMARY KEY (device_id, stream)
);
CREATE TABLE ledger_gaps (
    device_id   TEXT    NOT NULL,
    stream      TEXT    NOT NULL,
    first_seq   INTEGER NOT NULL,
    last_seq    INTEGER NOT NULL,
    since_ms    INTEGER NOT NULL,
    asks        INTEGER NOT NULL DEFAULT 0,
    asked_ms    INTEGER,
    gone_reason TEXT,
    gone_ms     INTEGER,
    PRIMARY KEY (device_id, stream, first_seq)
);
CREATE TABLE ledger_boards (
    device_id   TEXT PRIMARY KEY,
    prefix      TEXT    NOT NULL,
    nonce       BLOB,
    holdings_ms INTEGER,
    asked_ms    INTEGER,
    asks        INTEGER NOT NULL DEFAULT 0,
    asked_rows  INTEGER NOT NULL DEFAULT 0,
    gone_rows   INTEGER NOT NULL DEFAULT 0
);
PRAGMA user_version = 5;
";

/// The ledger of the events already in `received` (a file older than
/// version 5): each row's device and stream are its own columns, its
/// sequence number read from its payload (a row whose payload is no
/// envelope has none and counts nowhere).
///
/// Errors: SQLite's.
pub(crate) fn fill(tx: &Transaction<'_>, now_ms: i64) -> rusqlite::Result<u64> {
    let mut arrivals = Vec::new();
    {
        let mut st = tx.prepare("SELECT device_id, stream, payload FROM received")?;
        let mut rows = st.query([])?;
        while let Some(r) = rows.next()? {
            let payload: Vec<u8> = r.get(2)?;
            if let Ok(e) = crate::sink::message::decode(&payload) {
                arrivals.push(Arrival {
                    key: (r.get(0)?, r.get(1)?),
                    seq: e.seq,
                    first: true,
                });
            }
        }
    }
    let n = arrivals.len() as u64;
    super::book::record(&mut SqliteBooks { tx }, &arrivals, now_ms)?;
    Ok(n)
}

/// [`Books`] over one SQLite transaction.
pub struct SqliteBooks<'a, 'c> {
    /// The transaction.
    pub tx: &'a Transaction<'c>,
}

fn gap_of(r: &rusqlite::Row<'_>) -> rusqlite::Result<Gap> {
    let reason: Option<String> = r.get(5)?;
    let at: Option<i64> = r.get(6)?;
    Ok(Gap {
        first: r.get(0)?,
        last: r.get(1)?,
        since_ms: r.get(2)?,
        asks: r.get(3)?,
        asked_ms: r.get(4)?,
        gone: reason.map(|why| (why, at.unwrap_or(0))),
    })
}

const GAP_COLUMNS: &str = "first_seq, last_seq, since_ms, asks, asked_ms, gone_reason, gone_ms";

impl Books for SqliteBooks<'_, '_> {
    type Error = rusqlite::Error;

    fn lines(&mut self, keys: &[Key]) -> rusqlite::Result<Vec<Stored>> {
        let mut read = self.tx.prepare_cached(
            "SELECT known_seq, newest_seq, contiguous_seq, repeats, board_oldest, board_newest,
                    board_pending, board_at_ms
             FROM ledger WHERE device_id = ?1 AND stream = ?2",
        )?;
        let mut out = Vec::with_capacity(keys.len());
        for (d, s) in keys {
            let row = read
                .query_row(params![d, s], |r| {
                    let held = match (r.get(4)?, r.get(5)?, r.get(6)?, r.get(7)?) {
                        (Some(oldest), Some(newest), Some(pending), Some(at)) => Some((
                            Held {
                                oldest,
                                newest,
                                pending,
                            },
                            at,
                        )),
                        _ => None,
                    };
                    Ok(Stored {
                        line: Line {
                            known: r.get(0)?,
                            newest: r.get(1)?,
                            repeats: r.get(3)?,
                        },
                        contiguous: r.get(2)?,
                        held,
                    })
                })
                .optional()?;
            out.push(row.unwrap_or_default());
        }
        Ok(out)
    }

    fn gaps(&mut self, (d, s): &Key, lo: i64, hi: i64) -> rusqlite::Result<Vec<Gap>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {GAP_COLUMNS} FROM ledger_gaps
             WHERE device_id = ?1 AND stream = ?2 AND first_seq <= ?4 AND last_seq >= ?3
             ORDER BY first_seq"
        ))?;
        let rows = st.query_map(params![d, s, lo, hi], gap_of)?;
        rows.collect()
    }

    fn open_gaps(&mut self, (d, s): &Key, limit: usize) -> rusqlite::Result<Vec<Gap>> {
        let mut st = self.tx.prepare_cached(&format!(
            "SELECT {GAP_COLUMNS} FROM ledger_gaps
             WHERE device_id = ?1 AND stream = ?2 AND gone_reason IS NULL
             ORDER BY first_seq LIMIT ?3"
        ))?;
        let rows = st.query_map(params![d, s, limit as i64], gap_of)?;
        rows.collect()
    }

    fn replace_gaps(&mut self, (d, s): &Key, old: &[i64], new: &[Gap]) -> rusqlite::Result<()> {
        let mut del = self.tx.prepare_cached(
            "DELETE FROM ledger_gaps WHERE device_id = ?1 AND stream = ?2 AND first_seq = ?3",
        )?;
        for f in old {
            del.execute(params![d, s, f])?;
        }
        let mut ins = self.tx.prepare_cached(&format!(
            "INSERT INTO ledger_gaps (device_id, stream, {GAP_COLUMNS})
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9)"
        ))?;
        for g in new {
            let (why, at) = match &g.gone {
                Some((w, t)) => (Some(w.as_str()), Some(*t)),
                None => (None, None),
            };
            ins.execute(params![
                d, s, g.first, g.last, g.since_ms, g.asks, g.asked_ms, why, at
            ])?;
        }
        Ok(())
    }

    fn first_gap(&mut self, (d, s): &Key) -> rusqlite::Result<Option<i64>> {
        self.tx
            .prepare_cached(
                "SELECT min(first_seq) FROM ledger_gaps WHERE device_id = ?1 AND stream = ?2",
            )?
            .query_row(params![d, s], |r| r.get(0))
    }

    fn put_lines(&mut self, lines: &[(Key, Stored)], now_ms: i64) -> rusqlite::Result<()> {
        let mut put = self.tx.prepare_cached(
            "INSERT INTO ledger (device_id, stream, known_seq, newest_seq, contiguous_seq,
                                 repeats, board_oldest, board_newest, board_pending,
                                 board_at_ms, updated_ms)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)
             ON CONFLICT (device_id, stream) DO UPDATE SET
                known_seq = excluded.known_seq, newest_seq = excluded.newest_seq,
                contiguous_seq = excluded.contiguous_seq, repeats = excluded.repeats,
                board_oldest = excluded.board_oldest, board_newest = excluded.board_newest,
                board_pending = excluded.board_pending, board_at_ms = excluded.board_at_ms,
                updated_ms = excluded.updated_ms",
        )?;
        for ((d, s), st) in lines {
            let (h, at) = match st.held {
                Some((h, at)) => (Some(h), Some(at)),
                None => (None, None),
            };
            put.execute(params![
                d,
                s,
                st.line.known,
                st.line.newest,
                st.contiguous,
                st.line.repeats,
                h.map(|h| h.oldest),
                h.map(|h| h.newest),
                h.map(|h| h.pending),
                at,
                now_ms
            ])?;
        }
        Ok(())
    }

    fn board(&mut self, device: &str) -> rusqlite::Result<Option<Board>> {
        self.tx
            .prepare_cached(
                "SELECT prefix, nonce, holdings_ms, asked_ms, asks, asked_rows, gone_rows
                 FROM ledger_boards WHERE device_id = ?1",
            )?
            .query_row(params![device], |r| {
                let nonce: Option<Vec<u8>> = r.get(1)?;
                Ok(Board {
                    prefix: r.get(0)?,
                    nonce: nonce.and_then(|n| <[u8; 16]>::try_from(n.as_slice()).ok()),
                    holdings_ms: r.get(2)?,
                    asked_ms: r.get(3)?,
                    asks: r.get(4)?,
                    asked_rows: r.get(5)?,
                    gone_rows: r.get(6)?,
                })
            })
            .optional()
    }

    fn put_board(&mut self, device: &str, b: &Board) -> rusqlite::Result<()> {
        self.tx
            .prepare_cached(
                "INSERT INTO ledger_boards (device_id, prefix, nonce, holdings_ms, asked_ms,
                                            asks, asked_rows, gone_rows)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)
                 ON CONFLICT (device_id) DO UPDATE SET
                    prefix = excluded.prefix, nonce = excluded.nonce,
                    holdings_ms = excluded.holdings_ms, asked_ms = excluded.asked_ms,
                    asks = excluded.asks, asked_rows = excluded.asked_rows,
                    gone_rows = excluded.gone_rows",
            )?
            .execute(params![
                device,
                b.prefix,
                b.nonce.map(|n| n.to_vec()),
                b.holdings_ms,
                b.asked_ms,
                b.asks,
                b.asked_rows,
                b.gone_rows
            ])?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use crate::event::backfill::{Answer, GoneReason, Held, Holdings, Note};
    use crate::sink::batch::Item;
    use crate::sink::notes::BoardNote;
    use crate::sink::{SinkDb, Store};

    fn event(seq: i64) -> Item {
        let p = format!(
            r#"{{"event_id":"00000000-0000-4000-8000-{seq:012}","device_id":"gw1","stream":"s","seq":{seq},"ts_ms":5,"clock_trusted":true,"fields":{{}}}}"#
        );
        Item::new("edgespool/gw1/events/s", p.as_bytes())
    }

    fn holdings(oldest: i64, newest: i64, pending: i64) -> BoardNote {
        BoardNote {
            device: "gw1".into(),
            prefix: "edgespool/gw1".into(),
            note: Note::Holdings(Holdings {
                board: "gw1".into(),
                nonce: [3; 16],
                streams: vec![(
                    "s".into(),
                    Held {
                        oldest,
                        newest,
                        pending,
                    },
                )],
                more: false,
            }),
        }
    }

    fn report(path: &std::path::Path) -> crate::sink::stats::Report {
        crate::sink::stats::from_sqlite(path, 1_000_000).expect("report")
    }

    #[test]
    fn a_restored_file_sees_its_gap_asks_for_it_and_fills_it() {
        let d = tempfile::tempdir().expect("tempdir");
        let path = d.path().join("sink.db");
        let mut db = SinkDb::open(&path).expect("open");
        let first: Vec<Item> = (1..=300).map(event).collect();
        db.commit(&first, 10).expect("commit");
        let r = report(&path);
        assert_eq!(
            (
                r.ledger[0].newest_seq,
                r.ledger[0].contiguous_seq,
                r.ledger[0].open_gaps
            ),
            (300, 300, 0)
        );
        // Duplicates are no progress, and open nothing.
        db.commit(&first[..10], 11).expect("commit");
        assert_eq!(report(&path).ledger[0].rows_missing, 0);
        // The board holds 51..=1000, all delivered: 301..=1000 are missing.
        let done = db
            .notes(&[holdings(51, 1000, 1001)], true, 20)
            .expect("notes");
        assert_eq!(done.asks.len(), 1);
        assert_eq!(
            done.asks[0].ranges,
            vec![("s".to_owned(), vec![(301, 1000)])]
        );
        let r = report(&path);
        assert_eq!(
            (r.ledger[0].known_seq, r.ledger[0].rows_missing),
            (1000, 700)
        );
        assert_eq!(r.ledger_summary.boards_with_gaps, 1);
        // Within the rate limit the same holdings ask nothing more.
        let again = db
            .notes(&[holdings(51, 1000, 1001)], true, 30)
            .expect("notes");
        assert!(again.asks.is_empty());
        // The board answers that 990..=1000 are gone; the rest arrives.
        let answer = BoardNote {
            device: "gw1".into(),
            prefix: "edgespool/gw1".into(),
            note: Note::Answer(Answer {
                board: "gw1".into(),
                request: [1; 16],
                queued: 689,
                gone: vec![("s".into(), vec![(990, 1000, GoneReason::Retention)])],
                pending: Vec::new(),
            }),
        };
        assert_eq!(db.notes(&[answer], true, 40).expect("notes").gone_rows, 11);
        let rest: Vec<Item> = (301..990).rev().map(event).collect();
        db.commit(&rest, 50).expect("commit");
        let r = report(&path);
        let l = &r.ledger[0];
        assert_eq!((l.newest_seq, l.contiguous_seq, l.open_gaps), (989, 989, 0));
        assert_eq!((l.rows_missing, l.rows_gone), (0, 11));
        assert_eq!(r.gaps.len(), 1);
        assert!(r.gaps[0]
            .gone_reason
            .as_deref()
            .is_some_and(|w| w.starts_with("retention")));
        assert!(crate::sink::stats::render(&r).contains("rows given up"));
    }

    #[test]
    fn a_version_4_file_gets_a_ledger_of_the_events_it_holds() {
        let d = tempfile::tempdir().expect("tempdir");
        let path = d.path().join("sink.db");
        {
            let mut db = SinkDb::open(&path).expect("open");
            let items: Vec<Item> = [1, 2, 3, 7, 8].into_iter().map(event).collect();
            db.commit(&items, 1).expect("commit");
        }
        // Back to version 4: no ledger.
        {
            let c = rusqlite::Connection::open(&path).expect("open");
            c.execute_batch(
                "DROP TABLE ledger; DROP TABLE ledger_gaps; DROP TABLE ledger_boards;
                 PRAGMA user_version = 4;",
            )
            .expect("downgrade");
        }
        drop(SinkDb::open(&path).expect("migrate"));
        let r = report(&path);
        let l = &r.ledger[0];
        assert_eq!((l.newest_seq, l.contiguous_seq, l.rows_missing), (8, 3, 3));
        assert_eq!((r.gaps[0].first_seq, r.gaps[0].last_seq), (4, 6));
    }
}
