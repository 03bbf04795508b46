//! Idempotency keys of keyed readings ([`super::NewEvent::key`]).
//!
//! One job: remember which keyed event ids are in the spool, and the digest
//! of the reading each one names, so a producer that sends a key again with
//! the same reading gets the first event id back and the spool stores
//! nothing new, and one that sends it with another reading is refused (one
//! key, one event id, one payload: I3). Only keyed rows pay for it (a row in `event_keys` and its
//! unique index); schema 5 keeps no index on `events.event_id`, because every
//! reading would pay for one.
//!
//! A key outlives its row: the newest [`KEYS_KEPT`] keys are remembered
//! after their rows have left the spool ([`forget_purged`]), so a key sent
//! again after retention deleted its row is still answered with its id
//! (the same reading) or refused (another reading), never stored a second
//! time under the same id with other bytes (which the fleet would hold as a
//! mismatch, and, in receipt mode, never receipt). Older ones are forgotten,
//! so the table stays bounded: by the spool, plus [`KEYS_KEPT`] rows of
//! about 100 bytes.

use rusqlite::{params, OptionalExtension, Transaction};

/// The digest of the reading stored under keyed event `event_id` (in the
/// spool, or appended earlier in `tx`): `None` if the key is not spooled,
/// `Some(None)` if it was stored before digests were (schema 8).
pub(super) fn spooled(
    tx: &Transaction<'_>,
    event_id: &str,
) -> rusqlite::Result<Option<Option<[u8; 32]>>> {
    let stored: Option<Option<Vec<u8>>> = tx
        .prepare_cached("SELECT digest FROM event_keys WHERE event_id = ?1")?
        .query_row(params![event_id], |r| r.get(0))
        .optional()?;
    // A digest of another length was not written by this build: like none.
    Ok(stored.map(|d| d.and_then(|d| <[u8; 32]>::try_from(d.as_slice()).ok())))
}

/// Remember that row `row_id` is keyed event `event_id`, for the reading
/// whose digest is `digest`.
pub(super) fn remember(
    tx: &Transaction<'_>,
    row_id: i64,
    event_id: &str,
    digest: &[u8; 32],
) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT OR IGNORE INTO event_keys (row_id, event_id, digest) VALUES (?1, ?2, ?3)",
    )?
    .execute(params![row_id, event_id, digest.as_slice()])?;
    Ok(())
}

/// Keys remembered after their rows left the spool (about 1 MB with the
/// unique index on `event_id`).
pub const KEYS_KEPT: i64 = 10_000;

/// Forget keys of rows below the oldest row still in the spool, but for the
/// newest [`KEYS_KEPT`] (range deletes on the primary key). Returns how many.
pub(super) fn forget_purged(tx: &Transaction<'_>) -> rusqlite::Result<usize> {
    tx.prepare_cached(
        "DELETE FROM event_keys
          WHERE row_id < coalesce((SELECT min(id) FROM events), 0)
            AND row_id < coalesce(
                (SELECT row_id FROM event_keys ORDER BY row_id DESC LIMIT 1 OFFSET ?1), 0)",
    )?
    .execute(params![KEYS_KEPT - 1])
}

#[cfg(test)]
mod tests {
    use super::KEYS_KEPT;
    use crate::envelope::{keyed_event_id, EventIdGen, Format};
    use crate::reading::FieldValue;
    use crate::spool::{CommitOutcome, NewEvent, ReadingKey, Reply, Spool, SpoolOptions};
    use std::sync::mpsc::Receiver;

    /// A reading of `x` under `key` in scope `tcp`.
    fn keyed(stream: &str, key: Option<&str>, x: f64) -> (NewEvent, Receiver<CommitOutcome>) {
        scoped(stream, "tcp", key, x)
    }

    fn scoped(
        stream: &str,
        scope: &str,
        key: Option<&str>,
        x: f64,
    ) -> (NewEvent, Receiver<CommitOutcome>) {
        let (reply, rx) = Reply::channel();
        let mut ev = NewEvent::new(stream, 1, true, vec![("x".into(), FieldValue::Num(x))]);
        ev.key = key.map(|k| {
            Box::new(ReadingKey::new(
                scope.into(),
                k.into(),
                stream,
                &ev.fields,
                None,
            ))
        });
        ev.reply = Some(reply);
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
        // The same reading twice in one batch, then once more in a later one.
        let (b, rb) = keyed("pump", Some("pump-1"), 1.0);
        let (c, rc) = keyed("pump", None, 3.0);
        assert_eq!(
            s.append(&[a, b, c], &mut ids, "dev", Format::Json, 5)
                .unwrap(),
            2
        );
        let first = ra.recv().unwrap().unwrap();
        assert_eq!(
            first,
            keyed_event_id(&s.key_secret, "dev", "pump", "tcp", "pump-1").hyphenated()
        );
        assert_eq!(rb.recv().unwrap().unwrap(), first);
        let unkeyed = rc.recv().unwrap().unwrap();
        assert_ne!(unkeyed, first);
        let (again, r2) = keyed("pump", Some("pump-1"), 1.0);
        assert_eq!(
            s.append(&[again], &mut ids, "dev", Format::Json, 6)
                .unwrap(),
            0
        );
        assert_eq!(r2.recv().unwrap().unwrap(), first);
        assert_eq!(rows(&s), 2);
        assert_eq!(counter(&s, "ingest_keys_already_spooled"), 2);
        // The same key on another stream, or from another scope, is another event.
        let (other, ro) = keyed("valve", Some("pump-1"), 1.0);
        let (theirs, rt) = scoped("pump", "unix:uid=1000", Some("pump-1"), 1.0);
        assert_eq!(
            s.append(&[other, theirs], &mut ids, "dev", Format::Json, 7)
                .unwrap(),
            2
        );
        let (o, t) = (ro.recv().unwrap().unwrap(), rt.recv().unwrap().unwrap());
        assert!(o != first && t != first && o != t);
    }

    #[test]
    fn a_key_reused_for_another_reading_is_refused_for_good() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Spool::open(&d.path().join("spool.db"), &SpoolOptions::default()).unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let (a, ra) = keyed("pump", Some("k"), 1.0);
        // In the same batch, and in a later one.
        let (b, rb) = keyed("pump", Some("k"), 2.0);
        assert_eq!(
            s.append(&[a, b], &mut ids, "dev", Format::Json, 5).unwrap(),
            1
        );
        let first = ra.recv().unwrap().unwrap();
        let refused = rb.recv().unwrap().unwrap_err();
        assert!(refused.lasting, "{refused:?}");
        assert!(
            refused.why.contains("another reading") && refused.why.contains(&first),
            "{refused}"
        );
        let (c, rc) = keyed("pump", Some("k"), 3.0);
        assert_eq!(s.append(&[c], &mut ids, "dev", Format::Json, 6).unwrap(), 0);
        assert!(rc.recv().unwrap().is_err());
        assert_eq!(counter(&s, "ingest_key_conflicts"), 2);
        assert_eq!(rows(&s), 1);
    }

    #[test]
    fn a_small_keyed_reading_costs_well_under_a_kilobyte_of_budget() {
        // What `ingest.max_connection_bytes` (1 MiB) is sized against: over
        // 1,000 pipelined small requests per connection.
        let (ev, _rx) = scoped("pump", "unix:uid=1000", Some("pump-000123"), 2.5);
        let n = ev.heap_bytes();
        assert!((300..1000).contains(&n), "{n}");
    }

    #[test]
    fn the_reading_digest_ignores_field_order_and_sees_types_values_and_a_given_time() {
        let f = |v: Vec<(&str, FieldValue)>| -> crate::reading::Fields {
            v.into_iter().map(|(n, v)| (n.to_owned(), v)).collect()
        };
        let k = |fields: &crate::reading::Fields, ts| {
            ReadingKey::new("tcp".into(), "k".into(), "pump", fields, ts).digest
        };
        let ab = f(vec![
            ("a", FieldValue::Num(1.0)),
            ("b", FieldValue::Bool(true)),
        ]);
        let ba = f(vec![
            ("b", FieldValue::Bool(true)),
            ("a", FieldValue::Num(1.0)),
        ]);
        assert_eq!(k(&ab, None), k(&ba, None));
        let text = f(vec![
            ("a", FieldValue::Text("1".into())),
            ("b", FieldValue::Bool(true)),
        ]);
        assert_ne!(k(&ab, None), k(&text, None));
        assert_ne!(k(&ab, None), k(&ab, Some(5)));
        assert_ne!(k(&ab, Some(5)), k(&ab, Some(6)));
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
        assert!(why.lasting && why.why.contains("not encodable"), "{why}");
    }

    #[test]
    fn keys_outlive_their_rows_up_to_keys_kept() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Spool::open(&d.path().join("spool.db"), &SpoolOptions::default()).unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let mut first = String::new();
        for i in 0..3 {
            let (e, r) = keyed("pump", Some(&format!("k{i}")), i as f64);
            s.append(&[e], &mut ids, "dev", Format::Json, 5).unwrap();
            if i == 0 {
                first = r.recv().unwrap().unwrap();
            }
        }
        let keys = |s: &Spool| -> i64 {
            s.conn
                .query_row("SELECT count(*) FROM event_keys", [], |r| r.get(0))
                .unwrap()
        };
        let retire_all = |s: &mut Spool| {
            let r: Vec<i64> = s
                .sendable(0, 100_000)
                .unwrap()
                .iter()
                .map(|r| r.id)
                .collect();
            s.retire(&r).unwrap();
        };
        retire_all(&mut s);
        // The newest row always stays (its id keeps new ids above it).
        assert_eq!(s.purge_acked(i64::MAX, 100).unwrap(), 2);
        assert_eq!(keys(&s), 3, "keys are kept after their rows");
        // k0's row is gone: the same reading gets its id back, another
        // reading under it is refused, and nothing is stored.
        let (same, rs) = keyed("pump", Some("k0"), 0.0);
        let (other, ro) = keyed("pump", Some("k0"), 9.0);
        assert_eq!(
            s.append(&[same, other], &mut ids, "dev", Format::Json, 6)
                .unwrap(),
            0
        );
        assert_eq!(rs.recv().unwrap().unwrap(), first);
        assert!(ro.recv().unwrap().is_err());
        // Bounded: past KEYS_KEPT keys of purged rows the oldest go.
        let n = KEYS_KEPT as usize + 50;
        for chunk in (0..n).collect::<Vec<_>>().chunks(1000) {
            let evs: Vec<NewEvent> = chunk
                .iter()
                .map(|i| keyed("pump", Some(&format!("m{i}")), 1.0).0)
                .collect();
            s.append(&evs, &mut ids, "dev", Format::Json, 7).unwrap();
        }
        retire_all(&mut s);
        while s.purge_acked(i64::MAX, 5000).unwrap() > 0 {}
        assert_eq!(keys(&s), KEYS_KEPT);
        let (gone, rg) = keyed("pump", Some("k0"), 9.0);
        assert_eq!(
            s.append(&[gone], &mut ids, "dev", Format::Json, 8).unwrap(),
            1
        );
        assert!(
            rg.recv().unwrap().is_ok(),
            "a key past the bound is forgotten"
        );
    }

    #[test]
    fn a_keyed_id_is_the_spools_own_and_outlives_a_reopen() {
        let d = tempfile::tempdir().unwrap();
        let id_in = |path: &std::path::Path| {
            let mut s = Spool::open(path, &SpoolOptions::default()).unwrap();
            let mut ids = EventIdGen::new().unwrap();
            let (ev, rx) = keyed("pump", Some("pump-1"), 1.0);
            s.append(&[ev], &mut ids, "dev", Format::Json, 5).unwrap();
            rx.recv().unwrap().unwrap()
        };
        let a = d.path().join("a.db");
        let first = id_in(&a);
        // Another board (spool) with the same key: another id, which the
        // first cannot compute from the key.
        assert_ne!(id_in(&d.path().join("b.db")), first);
        // The same spool reopened: the key's id again (stored, not re-made).
        assert_eq!(id_in(&a), first);
        let s = Spool::open(&a, &SpoolOptions::default()).unwrap();
        let secret: Vec<u8> = s
            .raw()
            .query_row(
                "SELECT value FROM secrets WHERE name = 'key_ids'",
                [],
                |r| r.get(0),
            )
            .unwrap();
        assert_eq!(secret.len(), 32);
        assert_ne!(secret, vec![0u8; 32]);
    }
}
