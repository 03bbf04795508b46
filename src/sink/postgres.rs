//! The sink's fleet store: PostgreSQL, through the synchronous `postgres` crate.
//!
//! Its one rule: a batch is one transaction, and nothing in it is written
//! over what another delivery stored. Events go in with
//! `INSERT .. ON CONFLICT (event_id) DO NOTHING .. RETURNING`
//! (<https://www.postgresql.org/docs/current/sql-insert.html#SQL-ON-CONFLICT>):
//! under READ COMMITTED a row another sink inserted but has not committed
//! makes this insert wait for that commit, then skip the row, so two sinks
//! holding the same event id never both count it first. Ids are inserted in
//! sorted order, the same lock order in every sink (no deadlock between
//! overlapping batches). What was not inserted is compared by digest:
//! duplicate or mismatch.

use super::batch::{self, Fate, Item};
use super::pg_schema::{self, MigrateError};
use super::pg_tls::{self, PgConnect, TlsFiles};
use super::{SinkStats, Store, StoreError};
use postgres::{Client, Transaction};
use std::collections::{HashMap, HashSet};

const INSERT_EVENTS: &str = "
INSERT INTO events (event_id, device_id, stream, seq, ts_ms, clock_trusted,
                    received_ms, fields, payload, digest)
SELECT u.id::uuid, u.device_id, u.stream, u.seq, u.ts_ms, u.clock_trusted,
       $10, u.fields::jsonb, u.payload, u.digest
FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[],
            $6::bool[], $7::text[], $8::bytea[], $9::bytea[])
     AS u(id, device_id, stream, seq, ts_ms, clock_trusted, fields, payload, digest)
ON CONFLICT (event_id) DO NOTHING
RETURNING event_id::text";

const SELECT_DIGESTS: &str =
    "SELECT event_id::text, digest FROM events WHERE event_id = ANY($1::text[]::uuid[])";

const INSERT_DUPLICATES: &str = "
INSERT INTO duplicates (event_id, received_ms, sink)
SELECT unnest($1::text[])::uuid, $2, $3";

const INSERT_MISMATCHES: &str = "
INSERT INTO mismatches (event_id, digest, payload, topic, received_ms, sink)
SELECT u.id::uuid, u.digest, u.payload, u.topic, $5, $6
FROM unnest($1::text[], $2::bytea[], $3::bytea[], $4::text[]) AS u(id, digest, payload, topic)
ON CONFLICT (event_id, digest) DO NOTHING
RETURNING event_id::text, digest";

const INSERT_UNREADABLE: &str = "
INSERT INTO unreadable (topic, payload, reason, received_ms, sink)
SELECT u.topic, u.payload, u.reason, $4, $5
FROM unnest($1::text[], $2::bytea[], $3::text[]) AS u(topic, payload, reason)";

/// A PostgreSQL connection that reconnects when lost, and the sink's name.
pub struct PgStore {
    connect: PgConnect,
    client: Option<Client>,
    sink: String,
}

impl PgStore {
    /// Parse `conninfo` (libpq keyword/value or URL form), connect (with
    /// TLS if its `sslmode` asks for it, see [`pg_tls`]), and migrate the
    /// schema. `sink` names this sink in the rows it keeps aside and as
    /// `application_name`.
    ///
    /// Errors: [`StoreError::Fatal`] for a bad connection string or TLS
    /// setting, a refused TLS handshake, a refused login or a newer schema;
    /// [`StoreError::Transient`] when the server cannot be reached (the
    /// caller may retry).
    pub fn connect(conninfo: &str, sink: &str, tls: &TlsFiles) -> Result<PgStore, StoreError> {
        let mut connect = PgConnect::new(conninfo, tls).map_err(StoreError::Fatal)?;
        let config = &mut connect.config;
        if config.get_application_name().is_none() {
            config.application_name(sink);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(std::time::Duration::from_secs(10));
        }
        let mut s = PgStore {
            connect,
            client: None,
            sink: sink.to_owned(),
        };
        s.client()?;
        Ok(s)
    }

    /// The live client, connecting (and migrating) if there is none.
    ///
    /// Errors: as [`PgStore::connect`].
    pub fn client(&mut self) -> Result<&mut Client, StoreError> {
        if self.client.as_ref().is_some_and(|c| c.is_closed()) {
            self.client = None;
        }
        if self.client.is_none() {
            let mut c = self.connect.connect().map_err(connect_error)?;
            pg_schema::migrate(&mut c).map_err(|e| match e {
                MigrateError::Db(e) => classify(&e).into_error(e),
                e @ MigrateError::Newer { .. } => StoreError::Fatal(e.to_string()),
            })?;
            self.client = Some(c);
        }
        self.client
            .as_mut()
            .ok_or_else(|| StoreError::Transient("no connection".into()))
    }

    /// One item alone; an item the server refuses as data is kept aside in
    /// `unreadable` with the server's reason.
    fn store_alone(&mut self, it: &Item, now_ms: i64) -> Result<SinkStats, StoreError> {
        let sink = self.sink.clone();
        let client = self.client()?;
        match write_batch(client, std::slice::from_ref(it), now_ms, &sink) {
            Ok(s) => Ok(s),
            Err(e) if classify(&e) == Class::Data => {
                log::warn!(
                    "sink: {} refused as data: {e}; kept in unreadable",
                    it.topic
                );
                let mut tx = client
                    .transaction()
                    .map_err(|e| classify(&e).into_error(e))?;
                let why = vec![format!("refused by PostgreSQL: {e}")];
                insert_unreadable(&mut tx, &[it], why, now_ms, &sink)
                    .and_then(|_| tx.commit())
                    .map_err(|e| classify(&e).into_error(e))?;
                Ok(SinkStats {
                    unreadable: 1,
                    ..SinkStats::default()
                })
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    fn fail(&mut self, e: postgres::Error) -> StoreError {
        let c = classify(&e);
        if c == Class::Transient {
            self.client = None;
        }
        c.into_error(e)
    }
}

impl Store for PgStore {
    /// One transaction; if the server refuses the batch as data (a value it
    /// cannot hold), each item in its own transaction, so one bad delivery
    /// cannot hold back the rest nor come back forever.
    fn store_batch(&mut self, items: &[Item], now_ms: i64) -> Result<SinkStats, StoreError> {
        let sink = self.sink.clone();
        let client = self.client()?;
        match write_batch(client, items, now_ms, &sink) {
            Ok(s) => Ok(s),
            Err(e) if classify(&e) == Class::Data => {
                log::warn!("sink: batch refused as data ({e}); storing its items one by one");
                let mut total = SinkStats::default();
                for it in items {
                    total += self.store_alone(it, now_ms)?;
                }
                Ok(total)
            }
            Err(e) => Err(self.fail(e)),
        }
    }
}

/// What a PostgreSQL error means for the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Retry later on a new connection (class 08 connection, 40 rollback:
    /// deadlock or serialization, 53 resources, 57 operator intervention,
    /// 58 system; any error without a SQLSTATE: I/O, closed connection).
    Transient,
    /// A value the server cannot hold (class 22 data, 23 constraint).
    Data,
    /// Anything else (28 login, 3D database, 42 schema or permission).
    Fatal,
}

impl Class {
    fn into_error(self, e: postgres::Error) -> StoreError {
        let text = match e.as_db_error() {
            Some(db) => format!("{} ({})", db.message(), db.code().code()),
            None => e.to_string(),
        };
        match self {
            Class::Fatal => StoreError::Fatal(text),
            Class::Transient | Class::Data => StoreError::Transient(text),
        }
    }
}

/// A failed connection: a refused TLS handshake is fatal (the same
/// certificates get the same answer), the rest as [`classify`].
fn connect_error(e: postgres::Error) -> StoreError {
    match pg_tls::tls_failure(&e) {
        Some(r) => StoreError::Fatal(format!("TLS handshake with PostgreSQL failed: {r}")),
        None => classify(&e).into_error(e),
    }
}

/// Connect once, as [`PgStore::connect`] does but without migrating (for
/// `sink --stats`).
///
/// Errors: as [`PgStore::connect`].
pub fn connect_client(conninfo: &str, tls: &TlsFiles) -> Result<Client, StoreError> {
    PgConnect::new(conninfo, tls)
        .map_err(StoreError::Fatal)?
        .connect()
        .map_err(connect_error)
}

fn classify(e: &postgres::Error) -> Class {
    let Some(db) = e.as_db_error() else {
        return Class::Transient;
    };
    match &db.code().code()[..2] {
        "08" | "40" | "53" | "57" | "58" => Class::Transient,
        // 54: a program limit one row exceeded (an index row too large):
        // about that row, so it is set aside like bad data, not a reason
        // to stop (the broker would send it again after every restart).
        "22" | "23" | "54" => Class::Data,
        _ => Class::Fatal,
    }
}

/// The batch in one transaction: insert, compare, keep aside, commit.
fn write_batch(
    client: &mut Client,
    items: &[Item],
    now_ms: i64,
    sink: &str,
) -> Result<SinkStats, postgres::Error> {
    let mut tx = client.transaction()?;
    let cands = batch::candidates(items);
    let inserted = insert_events(&mut tx, items, &cands, now_ms)?;
    let mut stored: HashMap<String, [u8; 32]> = HashMap::new();
    let mut others = Vec::new();
    for &i in &cands {
        if let Ok(e) = &items[i].read {
            if inserted.contains(&e.event_id) {
                stored.insert(e.event_id.clone(), e.digest);
            } else {
                others.push(e.event_id.clone());
            }
        }
    }
    if !others.is_empty() {
        for row in tx.query(SELECT_DIGESTS, &[&others])? {
            let d: Vec<u8> = row.get(1);
            // A digest of another length matches nothing: a mismatch.
            if let Ok(d) = <[u8; 32]>::try_from(d.as_slice()) {
                stored.insert(row.get(0), d);
            }
        }
    }
    let fates = batch::classify(items, &inserted, &stored);
    let stats = keep_aside(&mut tx, items, &fates, now_ms, sink)?;
    tx.commit()?;
    Ok(stats)
}

/// Insert the candidates (first delivery of each id, in id order); returns
/// the ids whose row this transaction created.
fn insert_events(
    tx: &mut Transaction<'_>,
    items: &[Item],
    cands: &[usize],
    now_ms: i64,
) -> Result<HashSet<String>, postgres::Error> {
    let n = cands.len();
    let (mut ids, mut devs, mut streams) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut seqs, mut tss, mut trusted) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    let (mut fields, mut payloads, mut digests) = (
        Vec::with_capacity(n),
        Vec::with_capacity(n),
        Vec::with_capacity(n),
    );
    for it in cands.iter().map(|&i| &items[i]) {
        if let Ok(e) = &it.read {
            ids.push(e.event_id.as_str());
            devs.push(e.device_id.as_str());
            streams.push(e.stream.as_str());
            seqs.push(e.seq);
            tss.push(e.ts_ms);
            trusted.push(e.clock_trusted);
            fields.push(e.fields_json.as_str());
            payloads.push(it.payload.as_slice());
            digests.push(&e.digest[..]);
        }
    }
    if ids.is_empty() {
        return Ok(HashSet::new());
    }
    let rows = tx.query(
        INSERT_EVENTS,
        &[
            &ids, &devs, &streams, &seqs, &tss, &trusted, &fields, &payloads, &digests, &now_ms,
        ],
    )?;
    Ok(rows.iter().map(|r| r.get(0)).collect())
}

/// Record duplicates, mismatches and unreadable deliveries; count the batch.
///
/// A mismatch already recorded (the same id and digest, delivered again
/// after a sink died before acknowledging it) counts as a duplicate.
fn keep_aside(
    tx: &mut Transaction<'_>,
    items: &[Item],
    fates: &[Fate],
    now_ms: i64,
    sink: &str,
) -> Result<SinkStats, postgres::Error> {
    let mut s = SinkStats::default();
    let mut dups: Vec<&str> = Vec::new();
    let mut mism: Vec<&Item> = Vec::new();
    let mut unread: Vec<&Item> = Vec::new();
    for (it, fate) in items.iter().zip(fates) {
        match (fate, &it.read) {
            (Fate::First, _) => s.first += 1,
            (Fate::Duplicate, Ok(e)) => dups.push(&e.event_id),
            (Fate::Mismatch, Ok(_)) => mism.push(it),
            _ => unread.push(it),
        }
    }
    if !mism.is_empty() {
        let (mut ids, mut ds, mut ps, mut ts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for it in &mism {
            if let Ok(e) = &it.read {
                ids.push(e.event_id.as_str());
                ds.push(&e.digest[..]);
                ps.push(it.payload.as_slice());
                ts.push(it.topic.as_str());
            }
        }
        let mut new: HashSet<(String, Vec<u8>)> = tx
            .query(INSERT_MISMATCHES, &[&ids, &ds, &ps, &ts, &now_ms, &sink])?
            .iter()
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        for it in &mism {
            if let Ok(e) = &it.read {
                if new.remove(&(e.event_id.clone(), e.digest.to_vec())) {
                    s.mismatches += 1;
                } else {
                    dups.push(&e.event_id);
                }
            }
        }
    }
    if !dups.is_empty() {
        s.duplicates += dups.len() as u64;
        tx.execute(INSERT_DUPLICATES, &[&dups, &now_ms, &sink])?;
    }
    if !unread.is_empty() {
        s.unreadable += unread.len() as u64;
        let why = unread
            .iter()
            .map(|it| match &it.read {
                Err(w) => w.to_string(),
                Ok(_) => "unreadable".to_owned(),
            })
            .collect();
        insert_unreadable(tx, &unread, why, now_ms, sink)?;
    }
    Ok(s)
}

fn insert_unreadable(
    tx: &mut Transaction<'_>,
    items: &[&Item],
    why: Vec<String>,
    now_ms: i64,
    sink: &str,
) -> Result<(), postgres::Error> {
    let topics: Vec<&str> = items.iter().map(|it| it.topic.as_str()).collect();
    let payloads: Vec<&[u8]> = items.iter().map(|it| it.payload.as_slice()).collect();
    tx.execute(
        INSERT_UNREADABLE,
        &[&topics, &payloads, &why, &now_ms, &sink],
    )?;
    Ok(())
}
