//! The ledger in PostgreSQL: its tables (schema version 5, in
//! `pg_schema`'s migrations) and [`Books`] over one transaction.
//!
//! Its one rule: a line is locked (`FOR UPDATE`) before its gaps are read,
//! and lines are locked in one order in every sink (`COLLATE "C"`, the
//! byte order the ledger sorts keys in): N sinks storing one board's events
//! take turns on its lines and never deadlock on them. Statements are
//! parsed in the transaction, never prepared once per connection (a
//! transaction-mode pooler may run the next transaction elsewhere).

use super::book::{Board, Books, Key, Stored};
use super::{Gap, Line};
use crate::event::backfill::Held;
use postgres::Transaction;
use std::collections::HashMap;

/// Version 5: the replay ledger (see the SQLite file's version 5 for the
/// columns), filled from the events already stored: each (device, stream)
/// accounted up to its highest `seq`, and the numbers missing below it
/// (from 1) as gaps seen now.
pub(crate) const V5: &str = "
CREATE TABLE ledger (
    device_id      text   NOT NULL,
    stream         text   NOT NULL,
    known_seq      bigint NOT NULL,
    newest_seq     bigint NOT NULL,
    contiguous_seq bigint NOT NULL,
    repeats        bigint NOT NULL DEFAULT 0,
    board_oldest   bigint,
    board_newest   bigint,
    board_pending  bigint,
    board_at_ms    bigint,
    updated_ms     bigint NOT NULL,
    PRIMARY KEY (device_id, stream)
);
CREATE TABLE ledger_gaps (
    device_id   text    NOT NULL,
    stream      text    NOT NULL,
    first_seq   bigint  NOT NULL,
    last_seq    bigint  NOT NULL,
    since_ms    bigint  NOT NULL,
    asks        integer NOT NULL DEFAULT 0,
    asked_ms    bigint,
    gone_reason text,
    gone_ms     bigint,
    PRIMARY KEY (device_id, stream, first_seq)
);
CREATE TABLE ledger_boards (
    device_id   text PRIMARY KEY,
    prefix      text   NOT NULL,
    nonce       bytea,
    holdings_ms bigint,
    asked_ms    bigint,
    asks        bigint NOT NULL DEFAULT 0,
    asked_rows  bigint NOT NULL DEFAULT 0,
    gone_rows   bigint NOT NULL DEFAULT 0
);
INSERT INTO ledger_gaps (device_id, stream, first_seq, last_seq, since_ms)
SELECT device_id, stream, prev + 1, seq - 1, (extract(epoch FROM clock_timestamp()) * 1000)::bigint
FROM (SELECT device_id, stream, seq,
             lag(seq, 1, 0::bigint) OVER (PARTITION BY device_id, stream ORDER BY seq) AS prev
      FROM events WHERE seq >= 1) s
WHERE seq > prev + 1;
INSERT INTO ledger (device_id, stream, known_seq, newest_seq, contiguous_seq, updated_ms)
SELECT device_id, stream, max(seq), max(seq), max(seq),
       (extract(epoch FROM clock_timestamp()) * 1000)::bigint
FROM events WHERE seq >= 1 GROUP BY device_id, stream;
UPDATE ledger l SET contiguous_seq = g.f - 1
FROM (SELECT device_id, stream, min(first_seq) AS f FROM ledger_gaps GROUP BY 1, 2) g
WHERE g.device_id = l.device_id AND g.stream = l.stream;
";

const NEW_LINES: &str = "
INSERT INTO ledger (device_id, stream, known_seq, newest_seq, contiguous_seq, updated_ms)
SELECT d, s, 0, 0, 0, 0 FROM unnest($1::text[], $2::text[]) AS u(d, s)
ON CONFLICT (device_id, stream) DO NOTHING";

const LOCK_LINES: &str = "
SELECT device_id, stream, known_seq, newest_seq, contiguous_seq, repeats, board_oldest,
       board_newest, board_pending, board_at_ms
FROM ledger WHERE (device_id, stream) IN (SELECT * FROM unnest($1::text[], $2::text[]))
ORDER BY device_id COLLATE \"C\", stream COLLATE \"C\" FOR UPDATE";

const PUT_LINES: &str = "
UPDATE ledger l SET known_seq = u.k, newest_seq = u.n, contiguous_seq = u.c, repeats = u.r,
    board_oldest = u.bo, board_newest = u.bn, board_pending = u.bp, board_at_ms = u.ba,
    updated_ms = $11
FROM unnest($1::text[], $2::text[], $3::int8[], $4::int8[], $5::int8[], $6::int8[],
            $7::int8[], $8::int8[], $9::int8[], $10::int8[])
     AS u(d, s, k, n, c, r, bo, bn, bp, ba)
WHERE l.device_id = u.d AND l.stream = u.s";

const GAP_COLUMNS: &str = "first_seq, last_seq, since_ms, asks, asked_ms, gone_reason, gone_ms";

/// [`Books`] over one PostgreSQL transaction.
pub struct PgBooks<'a, 'b> {
    /// The transaction.
    pub tx: &'a mut Transaction<'b>,
}

fn gap_of(r: &postgres::Row) -> Gap {
    let reason: Option<String> = r.get(5);
    let at: Option<i64> = r.get(6);
    Gap {
        first: r.get(0),
        last: r.get(1),
        since_ms: r.get(2),
        asks: r.get(3),
        asked_ms: r.get(4),
        gone: reason.map(|w| (w, at.unwrap_or(0))),
    }
}

impl Books for PgBooks<'_, '_> {
    type Error = postgres::Error;

    fn lines(&mut self, keys: &[Key]) -> Result<Vec<Stored>, postgres::Error> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        let devs: Vec<&str> = keys.iter().map(|k| k.0.as_str()).collect();
        let streams: Vec<&str> = keys.iter().map(|k| k.1.as_str()).collect();
        self.tx.execute(NEW_LINES, &[&devs, &streams])?;
        let mut found: HashMap<(String, String), Stored> = HashMap::new();
        for r in self.tx.query(LOCK_LINES, &[&devs, &streams])? {
            let held = match (r.get(6), r.get(7), r.get(8), r.get(9)) {
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
            found.insert(
                (r.get(0), r.get(1)),
                Stored {
                    line: Line {
                        known: r.get(2),
                        newest: r.get(3),
                        repeats: r.get(5),
                    },
                    contiguous: r.get(4),
                    held,
                },
            );
        }
        Ok(keys
            .iter()
            .map(|k| found.remove(k).unwrap_or_default())
            .collect())
    }

    fn gaps(&mut self, (d, s): &Key, lo: i64, hi: i64) -> Result<Vec<Gap>, postgres::Error> {
        let sql = format!(
            "SELECT {GAP_COLUMNS} FROM ledger_gaps
             WHERE device_id = $1 AND stream = $2 AND first_seq <= $4 AND last_seq >= $3
             ORDER BY first_seq"
        );
        Ok(self
            .tx
            .query(sql.as_str(), &[d, s, &lo, &hi])?
            .iter()
            .map(gap_of)
            .collect())
    }

    fn open_gaps(&mut self, (d, s): &Key, limit: usize) -> Result<Vec<Gap>, postgres::Error> {
        let sql = format!(
            "SELECT {GAP_COLUMNS} FROM ledger_gaps
             WHERE device_id = $1 AND stream = $2 AND gone_reason IS NULL
             ORDER BY first_seq LIMIT $3"
        );
        Ok(self
            .tx
            .query(sql.as_str(), &[d, s, &(limit as i64)])?
            .iter()
            .map(gap_of)
            .collect())
    }

    fn replace_gaps(
        &mut self,
        (d, s): &Key,
        old: &[i64],
        new: &[Gap],
    ) -> Result<(), postgres::Error> {
        if !old.is_empty() {
            self.tx.execute(
                "DELETE FROM ledger_gaps WHERE device_id = $1 AND stream = $2
                 AND first_seq = ANY($3::int8[])",
                &[d, s, &old],
            )?;
        }
        if new.is_empty() {
            return Ok(());
        }
        let col = |f: fn(&Gap) -> i64| new.iter().map(f).collect::<Vec<i64>>();
        let (firsts, lasts, since) = (col(|g| g.first), col(|g| g.last), col(|g| g.since_ms));
        let asks: Vec<i32> = new.iter().map(|g| g.asks).collect();
        let asked: Vec<Option<i64>> = new.iter().map(|g| g.asked_ms).collect();
        let why: Vec<Option<&str>> = new
            .iter()
            .map(|g| g.gone.as_ref().map(|x| x.0.as_str()))
            .collect();
        let at: Vec<Option<i64>> = new.iter().map(|g| g.gone.as_ref().map(|x| x.1)).collect();
        let sql = format!(
            "INSERT INTO ledger_gaps (device_id, stream, {GAP_COLUMNS})
             SELECT $1, $2, u.* FROM unnest($3::int8[], $4::int8[], $5::int8[], $6::int4[],
                                            $7::int8[], $8::text[], $9::int8[]) AS u"
        );
        self.tx.execute(
            sql.as_str(),
            &[d, s, &firsts, &lasts, &since, &asks, &asked, &why, &at],
        )?;
        Ok(())
    }

    fn first_gap(&mut self, (d, s): &Key) -> Result<Option<i64>, postgres::Error> {
        Ok(self
            .tx
            .query_one(
                "SELECT min(first_seq) FROM ledger_gaps WHERE device_id = $1 AND stream = $2",
                &[d, s],
            )?
            .get(0))
    }

    fn put_lines(&mut self, lines: &[(Key, Stored)], now_ms: i64) -> Result<(), postgres::Error> {
        if lines.is_empty() {
            return Ok(());
        }
        let devs: Vec<&str> = lines.iter().map(|(k, _)| k.0.as_str()).collect();
        let streams: Vec<&str> = lines.iter().map(|(k, _)| k.1.as_str()).collect();
        let col = |f: &dyn Fn(&Stored) -> i64| lines.iter().map(|(_, s)| f(s)).collect::<Vec<_>>();
        let opt = |f: &dyn Fn(&Held) -> i64| {
            lines
                .iter()
                .map(|(_, s)| s.held.map(|(h, _)| f(&h)))
                .collect::<Vec<Option<i64>>>()
        };
        let at: Vec<Option<i64>> = lines.iter().map(|(_, s)| s.held.map(|h| h.1)).collect();
        self.tx.execute(
            PUT_LINES,
            &[
                &devs,
                &streams,
                &col(&|s| s.line.known),
                &col(&|s| s.line.newest),
                &col(&|s| s.contiguous),
                &col(&|s| s.line.repeats),
                &opt(&|h| h.oldest),
                &opt(&|h| h.newest),
                &opt(&|h| h.pending),
                &at,
                &now_ms,
            ],
        )?;
        Ok(())
    }

    fn board(&mut self, device: &str) -> Result<Option<Board>, postgres::Error> {
        // Made first (empty), so that two sinks hearing from one board
        // take turns on its row rather than both finding none.
        self.tx.execute(
            "INSERT INTO ledger_boards (device_id, prefix) VALUES ($1, '')
             ON CONFLICT (device_id) DO NOTHING",
            &[&device],
        )?;
        let row = self.tx.query_opt(
            "SELECT prefix, nonce, holdings_ms, asked_ms, asks, asked_rows, gone_rows
             FROM ledger_boards WHERE device_id = $1 FOR UPDATE",
            &[&device],
        )?;
        Ok(row.map(|r| {
            let nonce: Option<Vec<u8>> = r.get(1);
            Board {
                prefix: r.get(0),
                nonce: nonce.and_then(|n| <[u8; 16]>::try_from(n.as_slice()).ok()),
                holdings_ms: r.get(2),
                asked_ms: r.get(3),
                asks: r.get(4),
                asked_rows: r.get(5),
                gone_rows: r.get(6),
            }
        }))
    }

    fn put_board(&mut self, device: &str, b: &Board) -> Result<(), postgres::Error> {
        self.tx.execute(
            "INSERT INTO ledger_boards (device_id, prefix, nonce, holdings_ms, asked_ms, asks,
                                        asked_rows, gone_rows)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
             ON CONFLICT (device_id) DO UPDATE SET
                prefix = excluded.prefix, nonce = excluded.nonce,
                holdings_ms = excluded.holdings_ms, asked_ms = excluded.asked_ms,
                asks = excluded.asks, asked_rows = excluded.asked_rows,
                gone_rows = excluded.gone_rows",
            &[
                &device,
                &b.prefix,
                &b.nonce.map(|n| n.to_vec()),
                &b.holdings_ms,
                &b.asked_ms,
                &b.asks,
                &b.asked_rows,
                &b.gone_rows,
            ],
        )?;
        Ok(())
    }
}
