//! Idempotency keys of keyed readings ([`super::NewEvent::key`]).
//!
//! One job: remember which keys are in the spool (by their
//! [`crate::event::envelope::key_id`], column `event_id`), the event id each one's
//! reading was published under (`published_id`, schema 11: derived from the
//! key and the payload, see [`crate::event::envelope::derived_event_id`]; NULL for a
//! key stored before, published under its key id) and the digest of that
//! reading, so a producer that sends a key again with the same reading gets
//! the first event id back and the spool stores nothing new, and one that
//! sends it with another reading is refused (one key, one event id, one
//! payload: I3). The lookup is by key, never by the published id: that one
//! depends on the `seq` and time the first copy got. Only keyed rows pay
//! for it (a row in `event_keys` and its unique index); schema 5 keeps no
//! index on `events.event_id`, because every reading would pay for one.
//!
//! A key outlives its row: the newest [`KEYS_KEPT`] keys are remembered
//! after their rows have left the spool ([`forget_purged`]), so a key sent
//! again after retention deleted its row is still answered with its id
//! (the same reading) or refused (another reading), never stored a second
//! time under the same id with other bytes (which the fleet would hold as a
//! mismatch, and, in receipt mode, never receipt). Older ones are forgotten,
//! so the table stays bounded: by the spool, plus [`KEYS_KEPT`] rows of
//! about 140 bytes. A forgotten key (past the bound, or rolled back with
//! the newest commits) sent again cannot give a second payload under its
//! first id either: its id is derived from its whole payload.

use rusqlite::{params, OptionalExtension, Transaction};

/// What the spool remembers of a key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct StoredKey {
    /// The event id the key's reading was published under (hyphenated).
    pub(super) event_id: String,
    /// The digest of that reading ([`super::ReadingKey::digest`]); `None`
    /// if it was stored before digests were (schema 8).
    pub(super) digest: Option<[u8; 32]>,
}

/// The key whose [`crate::event::envelope::key_id`] is `key_id` (in the spool, or
/// appended earlier in `tx`), if remembered. A key stored before schema 11
/// was published under its key id itself.
pub(super) fn spooled(tx: &Transaction<'_>, key_id: &str) -> rusqlite::Result<Option<StoredKey>> {
    let stored: Option<(Option<String>, Option<Vec<u8>>)> = tx
        .prepare_cached("SELECT published_id, digest FROM event_keys WHERE event_id = ?1")?
        .query_row(params![key_id], |r| Ok((r.get(0)?, r.get(1)?)))
        .optional()?;
    Ok(stored.map(|(published, digest)| StoredKey {
        event_id: published.unwrap_or_else(|| key_id.to_owned()),
        // A digest of another length was not written by this build: like none.
        digest: digest.and_then(|d| <[u8; 32]>::try_from(d.as_slice()).ok()),
    }))
}

/// Remember that row `row_id` holds the reading of the key whose key id is
/// `key_id`, published as `event_id`, with the reading's `digest`.
pub(super) fn remember(
    tx: &Transaction<'_>,
    row_id: i64,
    key_id: &str,
    event_id: &str,
    digest: &[u8; 32],
) -> rusqlite::Result<()> {
    tx.prepare_cached(
        "INSERT OR IGNORE INTO event_keys (row_id, event_id, published_id, digest)
         VALUES (?1, ?2, ?3, ?4)",
    )?
    .execute(params![row_id, key_id, event_id, digest.as_slice()])?;
    Ok(())
}

/// Keys remembered after their rows left the spool (about 1.4 MB with the
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
    use crate::event::envelope::{key_id, EventIdGen, Format};
    use crate::event::reading::FieldValue;
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

    /// `event_keys` as (key id, published id), by row.
    fn stored_ids(s: &Spool) -> Vec<(String, Option<String>)> {
        let mut q = s
            .conn
            .prepare("SELECT event_id, published_id FROM event_keys ORDER BY row_id")
            .unwrap();
        let rows = q.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.map(Result::unwrap).collect()
    }

    /// Every row as (event id, payload), in order.
    fn payloads(s: &Spool) -> Vec<(String, Vec<u8>)> {
        let mut q = s
            .conn
            .prepare("SELECT event_id, payload FROM event_states ORDER BY id")
            .unwrap();
        let rows = q.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.map(Result::unwrap).collect()
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
        let first = ra.recv().unwrap().unwrap().event_id.hyphenated();
        // Looked up by the key's id, published under the id of its payload.
        let kid = key_id(&s.key_secret, "dev", "pump", "tcp", "pump-1").hyphenated();
        assert_ne!(first, kid);
        assert_eq!(stored_ids(&s), vec![(kid, Some(first.clone()))]);
        assert_eq!(payloads(&s)[0].0, first);
        assert_eq!(rb.recv().unwrap().unwrap().event_id.hyphenated(), first);
        let unkeyed = rc.recv().unwrap().unwrap().event_id.hyphenated();
        assert_ne!(unkeyed, first);
        let (again, r2) = keyed("pump", Some("pump-1"), 1.0);
        assert_eq!(
            s.append(&[again], &mut ids, "dev", Format::Json, 6)
                .unwrap(),
            0
        );
        assert_eq!(r2.recv().unwrap().unwrap().event_id.hyphenated(), first);
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
        let (o, t) = (
            ro.recv().unwrap().unwrap().event_id.hyphenated(),
            rt.recv().unwrap().unwrap().event_id.hyphenated(),
        );
        assert!(o != first && t != first && o != t);
    }

    #[test]
    fn a_key_remembered_with_a_damaged_event_id_refuses_the_reading_and_keeps_the_first() {
        let d = tempfile::tempdir().unwrap();
        let mut s = Spool::open(&d.path().join("spool.db"), &SpoolOptions::default()).unwrap();
        let mut ids = EventIdGen::new().unwrap();
        let (a, ra) = keyed("pump", Some("k"), 1.0);
        s.append(&[a], &mut ids, "dev", Format::Json, 5).unwrap();
        assert!(ra.recv().unwrap().is_ok());
        s.conn
            .execute("UPDATE event_keys SET published_id = 'not-an-id'", [])
            .unwrap();
        // The same reading again: its first id cannot be told, and it is
        // not stored a second time under another.
        let (again, r2) = keyed("pump", Some("k"), 1.0);
        assert_eq!(
            s.append(&[again], &mut ids, "dev", Format::Json, 6)
                .unwrap(),
            0
        );
        let refused = r2.recv().unwrap().unwrap_err();
        assert!(refused.lasting, "{refused:?}");
        assert!(
            refused.why.contains("not one") && refused.why.contains("not-an-id"),
            "{refused}"
        );
        assert_eq!(rows(&s), 1);
        assert_eq!(counter(&s, "ingest_key_conflicts"), 1);
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
        let first = ra.recv().unwrap().unwrap().event_id.hyphenated();
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
        let f = |v: Vec<(&str, FieldValue)>| -> crate::event::reading::Fields {
            v.into_iter().map(|(n, v)| (n.to_owned(), v)).collect()
        };
        let k = |fields: &crate::event::reading::Fields, ts| {
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
                first = r.recv().unwrap().unwrap().event_id.hyphenated();
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
        assert_eq!(rs.recv().unwrap().unwrap().event_id.hyphenated(), first);
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
            rx.recv().unwrap().unwrap().event_id.hyphenated()
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

    /// `key` with its own time `ts` (`Some`: the producer's) or the agent's
    /// (`None`: stamped `stamp`), fields `x`.
    fn timed(
        key: &str,
        ts: Option<i64>,
        stamp: i64,
        x: f64,
    ) -> (NewEvent, Receiver<CommitOutcome>) {
        let (reply, rx) = Reply::channel();
        let fields = vec![("x".into(), FieldValue::Num(x))];
        let mut ev = NewEvent::new("pump", ts.unwrap_or(stamp), true, fields);
        ev.key = Some(Box::new(ReadingKey::new(
            "tcp".into(),
            key.into(),
            "pump",
            &ev.fields,
            ts,
        )));
        ev.reply = Some(reply);
        (ev, rx)
    }

    /// Appends `evs` to `s` one batch each; the ids told.
    fn ids_told(s: &mut Spool, evs: Vec<(NewEvent, Receiver<CommitOutcome>)>) -> Vec<String> {
        let mut ids = EventIdGen::new().unwrap();
        evs.into_iter()
            .map(|(ev, rx)| {
                s.append(&[ev], &mut ids, "dev", Format::Json, 9).unwrap();
                rx.recv().unwrap().unwrap().event_id.hyphenated()
            })
            .collect()
    }

    #[test]
    fn a_key_forgotten_by_a_rollback_and_sent_again_is_the_same_bytes_or_a_new_event() {
        // A rollback, modelled exactly: the spool file copied while closed
        // (its WAL checkpointed into it), the newest commits made on the
        // original only, then the same readings sent to the copy.
        let d = tempfile::tempdir().unwrap();
        let live = d.path().join("live.db");
        let base = ids_told(
            &mut Spool::open(&live, &SpoolOptions::default()).unwrap(),
            vec![keyed("pump", Some("k0"), 0.0)],
        );
        for copy in ["same.db", "shifted.db"] {
            std::fs::copy(&live, d.path().join(copy)).unwrap();
        }
        let mut s = Spool::open(&live, &SpoolOptions::default()).unwrap();
        let sent = ids_told(
            &mut s,
            vec![
                timed("given", Some(1_800_000_000_000), 0, 1.0),
                timed("stamped", None, 1_800_000_000_500, 2.0),
            ],
        );
        let before = payloads(&s);
        // The same order: the producer's time gives the same id over the
        // same bytes; the agent's time (another stamp) a new event.
        let mut same = Spool::open(&d.path().join("same.db"), &SpoolOptions::default()).unwrap();
        let again = ids_told(
            &mut same,
            vec![
                timed("given", Some(1_800_000_000_000), 0, 1.0),
                timed("stamped", None, 1_800_000_000_900, 2.0),
            ],
        );
        assert_eq!(again[0], sent[0]);
        assert_eq!(payloads(&same)[1], before[1], "byte-identical");
        assert_ne!(again[1], sent[1]);
        // Another reading first: the keyed one gets another seq, so another
        // id (under the key's id alone it would be a second payload).
        let mut shifted =
            Spool::open(&d.path().join("shifted.db"), &SpoolOptions::default()).unwrap();
        let moved = ids_told(
            &mut shifted,
            vec![
                keyed("pump", None, 7.0),
                timed("given", Some(1_800_000_000_000), 0, 1.0),
            ],
        );
        assert_ne!(moved[1], sent[0]);
        // No id names two payloads across the three spools.
        let mut by_id: std::collections::HashMap<String, Vec<u8>> = Default::default();
        for (id, p) in [before, payloads(&same), payloads(&shifted)].concat() {
            let seen = by_id.entry(id.clone()).or_insert_with(|| p.clone());
            assert_eq!(*seen, p, "two payloads under {id}");
        }
        assert!(by_id.contains_key(&base[0]));
        // While remembered, a retry of the stamped reading (yet another
        // stamp) gets its first id back and stores nothing.
        let retry = ids_told(&mut s, vec![timed("stamped", None, 1_800_000_009_999, 2.0)]);
        assert_eq!(retry[0], sent[1]);
        assert_eq!(rows(&s), 3);
    }

    #[test]
    fn a_schema_10_spool_keeps_answering_its_keys_with_their_first_ids() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("spool.db");
        let old_id = {
            let mut s = Spool::open(&path, &SpoolOptions::default()).unwrap();
            ids_told(&mut s, vec![keyed("pump", Some("k"), 1.0)]);
            // As schema 10 wrote it: the row published under the key's id,
            // no published_id column.
            let kid = key_id(&s.key_secret, "dev", "pump", "tcp", "k").hyphenated();
            s.conn
                .execute_batch(&format!(
                    "UPDATE events SET event_id = '{kid}';
                     ALTER TABLE event_keys DROP COLUMN published_id;
                     PRAGMA user_version = 10;"
                ))
                .unwrap();
            kid
        };
        let mut s = Spool::open(&path, &SpoolOptions::default()).unwrap();
        assert_eq!(s.schema_version().unwrap(), crate::spool::SCHEMA_VERSION);
        assert_eq!(stored_ids(&s), vec![(old_id.clone(), None)]);
        let told = ids_told(&mut s, vec![keyed("pump", Some("k"), 1.0)]);
        assert_eq!(told[0], old_id);
        assert_eq!(rows(&s), 1);
        let (other, ro) = keyed("pump", Some("k"), 2.0);
        let mut ids = EventIdGen::new().unwrap();
        s.append(&[other], &mut ids, "dev", Format::Json, 9)
            .unwrap();
        let refused = ro.recv().unwrap().unwrap_err();
        assert!(refused.why.contains(&old_id), "{refused}");
    }
}
