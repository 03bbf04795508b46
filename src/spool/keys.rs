//! Idempotency keys of keyed readings ([`super::NewEvent::key`]).
//!
//! One job: remember which keyed event ids are in the spool, so a producer
//! that sends a key again gets the first event id back and the spool stores
//! nothing new. Only keyed rows pay for it (a row in `event_keys` and its
//! unique index); schema 5 keeps no index on `events.event_id`, because every
//! reading would pay for one.
//!
//! Keys are forgotten once every row up to theirs has left the spool
//! ([`forget_purged`]), so the table stays bounded by the spool; a key
//! re-sent after that is appended again under the same event id, which a
//! consumer deduplicating on event ids drops.

use rusqlite::{params, OptionalExtension, Transaction};

/// Whether `event_id` is a keyed event already in the spool (or appended
/// earlier in `tx`).
pub(super) fn spooled(tx: &Transaction<'_>, event_id: &str) -> rusqlite::Result<bool> {
    Ok(tx
        .prepare_cached("SELECT 1 FROM event_keys WHERE event_id = ?1")?
        .query_row(params![event_id], |_| Ok(()))
        .optional()?
        .is_some())
}

/// Remember that row `row_id` is keyed event `event_id`.
pub(super) fn remember(tx: &Transaction<'_>, row_id: i64, event_id: &str) -> rusqlite::Result<()> {
    tx.prepare_cached("INSERT OR IGNORE INTO event_keys (row_id, event_id) VALUES (?1, ?2)")?
        .execute(params![row_id, event_id])?;
    Ok(())
}

/// Forget keys of rows below the oldest row still in the spool (a range
/// delete on the primary key). Returns how many.
pub(super) fn forget_purged(tx: &Transaction<'_>) -> rusqlite::Result<usize> {
    tx.prepare_cached(
        "DELETE FROM event_keys WHERE row_id < coalesce((SELECT min(id) FROM events), 0)",
    )?
    .execute([])
}

#[cfg(test)]
mod tests {
    use crate::envelope::{keyed_event_id, EventIdGen, Format};
    use crate::reading::FieldValue;
    use crate::spool::{CommitOutcome, NewEvent, Reply, Spool, SpoolOptions};
    use std::sync::mpsc::{channel, Receiver};

    fn keyed(stream: &str, key: Option<&str>, x: f64) -> (NewEvent, Receiver<CommitOutcome>) {
        let (tx, rx) = channel();
        let mut ev = NewEvent::new(stream, 1, true, vec![("x".into(), FieldValue::Num(x))]);
        ev.key = key.map(str::to_owned);
        ev.reply = Some(Reply::new(tx));
        (ev, rx)
    }

    fn rows(s: &Spool) -> i64 {
        s.conn
            .query_row("SELECT count(*) FROM events", [], |r| r.get(0))
            .unwrap()
    }

    fn counter(s: &Spool, name: &str) -> i64 {
        s.counters()
            .unwrap()
            .into_iter()
            .find(|(n, _)| n == name)
            .map_or(0, |(_, v)| v)
    }

    #[test]
    fn a_key_sent_again_gets_the_first_event_id_and_stores_nothing_new() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Spool::open(&d.path().join("spool.db"), &SpoolOptions::default()).unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let (a, ra) = keyed("pump", Some("pump-1"), 1.0);
        // The same key twice in one batch, then once more in a later one.
        let (b, rb) = keyed("pump", Some("pump-1"), 2.0);
        let (c, rc) = keyed("pump", None, 3.0);
        assert_eq!(
            s.append(&[a, b, c], &mut ids, "dev", Format::Json, 5)
                .unwrap(),
            2
        );
        let first = ra.recv().unwrap().unwrap();
        assert_eq!(first, keyed_event_id("dev", "pump", "pump-1").hyphenated());
        assert_eq!(rb.recv().unwrap().unwrap(), first);
        let unkeyed = rc.recv().unwrap().unwrap();
        assert_ne!(unkeyed, first);
        let (again, r2) = keyed("pump", Some("pump-1"), 9.0);
        assert_eq!(
            s.append(&[again], &mut ids, "dev", Format::Json, 6)
                .unwrap(),
            0
        );
        assert_eq!(r2.recv().unwrap().unwrap(), first);
        assert_eq!(rows(&s), 2);
        assert_eq!(counter(&s, "ingest_keys_already_spooled"), 2);
        // The same key on another stream is another event.
        let (other, ro) = keyed("valve", Some("pump-1"), 1.0);
        assert_eq!(
            s.append(&[other], &mut ids, "dev", Format::Json, 7)
                .unwrap(),
            1
        );
        assert_ne!(ro.recv().unwrap().unwrap(), first);
    }

    #[test]
    fn no_reply_comes_before_the_commit_and_a_failed_transaction_sends_none() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("spool.db");
        let mut s = Spool::open(&path, &SpoolOptions::default()).unwrap();
        let mut ids = EventIdGen::new().unwrap();
        // Another connection holds the write lock: the append fails busy.
        let blocker = rusqlite::Connection::open(&path).unwrap();
        blocker.execute_batch("BEGIN IMMEDIATE").unwrap();
        let (a, ra) = keyed("pump", Some("k"), 1.0);
        assert!(s.append(&[a], &mut ids, "dev", Format::Json, 5).is_err());
        assert!(ra.try_recv().is_err(), "a reply before any commit");
        blocker.execute_batch("ROLLBACK").unwrap();
        let (a, ra) = keyed("pump", Some("k"), 1.0);
        assert_eq!(s.append(&[a], &mut ids, "dev", Format::Json, 5).unwrap(), 1);
        assert!(ra.recv().unwrap().is_ok());
    }

    #[test]
    fn an_unencodable_reading_is_refused_by_name() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Spool::open(&d.path().join("spool.db"), &SpoolOptions::default()).unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let (mut a, ra) = keyed("pump", Some("k"), 1.0);
        a.fields = vec![("x".into(), FieldValue::Num(f64::NAN))];
        s.append(&[a], &mut ids, "dev", Format::Json, 5).unwrap();
        let why = ra.recv().unwrap().unwrap_err();
        assert!(why.contains("not encodable"), "{why}");
    }

    #[test]
    fn keys_are_forgotten_with_their_rows() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Spool::open(&d.path().join("spool.db"), &SpoolOptions::default()).unwrap();
        let mut ids = EventIdGen::new().unwrap();
        for i in 0..3 {
            let (e, _r) = keyed("pump", Some(&format!("k{i}")), i as f64);
            s.append(&[e], &mut ids, "dev", Format::Json, 5).unwrap();
        }
        let keys = |s: &Spool| -> i64 {
            s.conn
                .query_row("SELECT count(*) FROM event_keys", [], |r| r.get(0))
                .unwrap()
        };
        assert_eq!(keys(&s), 3);
        let r: Vec<i64> = s.sendable(0, 10).unwrap().iter().map(|r| r.id).collect();
        s.retire(&r).unwrap();
        // The newest row always stays (its id keeps new ids above it).
        assert_eq!(s.purge_acked(i64::MAX, 100).unwrap(), 2);
        assert_eq!(keys(&s), 1);
        let (e, rx) = keyed("pump", Some("k2"), 0.0);
        assert_eq!(s.append(&[e], &mut ids, "dev", Format::Json, 6).unwrap(), 0);
        assert!(rx.recv().unwrap().is_ok());
    }
}
