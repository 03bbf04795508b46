//! The sink's fleet store: PostgreSQL, through the synchronous `postgres` crate.
//!
//! Its one rule: a batch is one transaction, and nothing in it is written
//! over what another delivery stored. Events go in keyed by the device the
//! topic names and the event id, with
//! `INSERT .. ON CONFLICT (device_id, event_id) DO NOTHING .. RETURNING`
//! (<https://www.postgresql.org/docs/current/sql-insert.html#SQL-ON-CONFLICT>):
//! under READ COMMITTED a row another sink inserted but has not committed
//! makes this insert wait for that commit, then skip the row, so two sinks
//! holding the same event never both count it first. Keys are inserted in
//! sorted order, the same lock order in every sink (no deadlock between
//! overlapping batches). What was not inserted is compared by digest:
//! duplicate or mismatch. What is set aside (mismatches, unreadable,
//! forged) goes to side tables kept within [`SideBounds`], oldest first.
//! A batch is first tried as a binary `COPY` ([`super::pg_copy`]), which
//! succeeds only when every key is new; a stored key fails it, and the
//! batch is rolled back and stored again the way above.

use super::batch::{self, Fate, Item, Key};
use super::ledger::book;
use super::ledger::pg::PgBooks;
use super::notes::BoardNote;
use super::pg_clock;
use super::pg_copy;
use super::pg_schema::{self, MigrateError};
use super::pg_tls::{self, PgConnect, TlsFiles};
use super::{LedgerSummary, SideBounds, SinkStats, Store, StoreError, Stored};
use postgres::error::SqlState;
use postgres::{Client, Transaction};
use std::collections::{HashMap, HashSet};

const INSERT_EVENTS: &str = "
INSERT INTO events (event_id, device_id, stream, seq, ts_ms, clock_trusted,
                    received_ms, fields, payload, digest, topic,
                    boot_id, mono_ms, ts_corrected_ms)
SELECT u.id::uuid, u.device_id, u.stream, u.seq, u.ts_ms, u.clock_trusted,
       $10, u.fields::jsonb, u.payload, u.digest, u.topic,
       u.boot_id::uuid, u.mono_ms, u.corrected
FROM unnest($1::text[], $2::text[], $3::text[], $4::int8[], $5::int8[],
            $6::bool[], $7::text[], $8::bytea[], $9::bytea[], $11::text[],
            $12::text[], $13::int8[], $14::int8[])
     AS u(id, device_id, stream, seq, ts_ms, clock_trusted, fields, payload, digest, topic,
          boot_id, mono_ms, corrected)
ON CONFLICT (device_id, event_id) DO NOTHING
RETURNING device_id, event_id::text";

const SELECT_DIGESTS: &str = "
SELECT e.device_id, e.event_id::text, e.digest
FROM unnest($1::text[], $2::text[]) AS u(device_id, id)
JOIN events e ON e.device_id = u.device_id AND e.event_id = u.id::uuid";

/// Redeliveries counted per key (`pg_schema`'s version 6): `$3` more of
/// each, seen at `$4` by sink `$5`. Each key at most once in the arrays (a
/// key twice would make one statement update its row twice, which
/// PostgreSQL refuses), in sorted order.
const COUNT_REDELIVERIES: &str = "
INSERT INTO redeliveries (device_id, event_id, deliveries, first_ms, last_ms, sink)
SELECT u.device_id, u.id::uuid, u.n, $4, $4, $5
FROM unnest($1::text[], $2::text[], $3::int8[]) AS u(device_id, id, n)
ON CONFLICT (device_id, event_id) DO UPDATE
SET deliveries = redeliveries.deliveries + EXCLUDED.deliveries,
    first_ms = least(redeliveries.first_ms, EXCLUDED.first_ms),
    last_ms = greatest(redeliveries.last_ms, EXCLUDED.last_ms),
    sink = EXCLUDED.sink";

const INSERT_MISMATCHES: &str = "
INSERT INTO mismatches (device_id, event_id, digest, payload, payload_bytes, topic,
                        received_ms, sink)
SELECT u.device_id, u.id::uuid, u.digest, u.payload, u.bytes, u.topic, $7, $8
FROM unnest($1::text[], $2::text[], $3::bytea[], $4::bytea[], $5::int8[], $6::text[])
     AS u(device_id, id, digest, payload, bytes, topic)
ON CONFLICT (device_id, event_id, digest) DO NOTHING
RETURNING device_id, event_id::text, digest";

const COUNT_DROPS: &str = "
INSERT INTO side_drops (side, sink, dropped) VALUES ($1, $2, $3)
ON CONFLICT (side, sink) DO UPDATE SET dropped = side_drops.dropped + EXCLUDED.dropped";

/// Batches stored with `INSERT .. ON CONFLICT` after a `COPY` met a key
/// already stored, before `COPY` is tried again.
const CAREFUL_BATCHES: u32 = 8;

/// A mismatch as `mismatches` keys it: (device, event id) and digest.
type KeyDigest = (Key, Vec<u8>);

/// A side table: where deliveries that are not stored as events are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Side {
    Unreadable,
    Forged,
    Mismatches,
    ClockRefused,
}

impl Side {
    const ALL: [Side; 4] = [
        Side::Unreadable,
        Side::Forged,
        Side::Mismatches,
        Side::ClockRefused,
    ];

    fn table(self) -> &'static str {
        match self {
            Side::Unreadable => "unreadable",
            Side::Forged => "forged",
            Side::Mismatches => "mismatches",
            Side::ClockRefused => "clock_refused",
        }
    }
}

/// Rows of one device beyond its bounds (`$1` rows, `$2` payload bytes):
/// its oldest.
const TRIM_DEVICE: &str = "
DELETE FROM {t} WHERE id IN (
    SELECT id FROM (
        SELECT id, row_number() OVER w AS n, sum(octet_length(payload)) OVER w AS b
        FROM {t} WINDOW w AS (PARTITION BY device_id ORDER BY id DESC)
    ) d WHERE n > $1 OR b > $2)";

/// Rows beyond the table's bounds (`$1` rows, `$2` payload bytes): rows
/// ranked by how new they are within their device (`k`), every device's
/// newest first, then its second newest, ...; what is past the bounds in
/// that order goes, so the devices holding the most lose rows first.
const TRIM_TABLE: &str = "
DELETE FROM {t} WHERE id IN (
    SELECT id FROM (
        SELECT id, row_number() OVER o AS n, sum(len) OVER o AS b
        FROM (SELECT id, octet_length(payload) AS len,
                     row_number() OVER (PARTITION BY device_id ORDER BY id DESC) AS k
              FROM {t}) r
        WINDOW o AS (ORDER BY k, id DESC)
    ) o WHERE n > $1 OR b > $2)";

/// Drop rows of `side` beyond `b` (per device, then the table's, see
/// [`SideBounds`]), count them in `side_drops`; returns how many went.
/// Two scans of a table that is at most a batch over its bounds; run only
/// after rows were added.
fn trim(
    tx: &mut Transaction<'_>,
    side: Side,
    b: &SideBounds,
    sink: &str,
) -> Result<u64, postgres::Error> {
    let t = side.table();
    let device = TRIM_DEVICE.replace("{t}", t);
    let table = TRIM_TABLE.replace("{t}", t);
    let gone = tx.execute(device.as_str(), &[&b.device_rows, &b.device_bytes])?
        + tx.execute(table.as_str(), &[&b.rows, &b.table_bytes])?;
    if gone > 0 {
        tx.execute(COUNT_DROPS, &[&t, &sink, &(gone as i64)])?;
    }
    Ok(gone)
}

/// A PostgreSQL connection that reconnects when lost, and the sink's name.
pub struct PgStore {
    connect: PgConnect,
    client: Option<Client>,
    sink: String,
    bounds: SideBounds,
    /// Batches still to store with `INSERT .. ON CONFLICT` (a `COPY` met
    /// a stored key: redeliveries come in runs).
    careful: u32,
    /// Set when the server refused `COPY` itself, not a key or a value
    /// (row-level security on `events`, `events` a view, a privilege):
    /// every later batch of this process goes the `ON CONFLICT` way, which
    /// that database still takes.
    copy_refused: bool,
    /// Side-table rows dropped at connect (bounds applied to what an older
    /// sink left), reported with the next batch.
    dropped_at_connect: u64,
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
        PgStore::connect_with(
            PgConnect::new(conninfo, tls).map_err(StoreError::Fatal)?,
            sink,
        )
    }

    /// As [`PgStore::connect`], from a conninfo already parsed (with its
    /// password, see [`PgConnect::new_with`]).
    ///
    /// Errors: as [`PgStore::connect`].
    pub fn connect_with(mut connect: PgConnect, sink: &str) -> Result<PgStore, StoreError> {
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
            careful: 0,
            copy_refused: false,
            sink: sink.to_owned(),
            bounds: SideBounds::default(),
            dropped_at_connect: 0,
        };
        s.client()?;
        Ok(s)
    }

    /// Keep the side tables within `b` from now on (default:
    /// [`SideBounds::default`]).
    pub fn set_side_bounds(&mut self, b: SideBounds) {
        self.bounds = b;
    }

    /// The live client, connecting (migrating, and trimming the side
    /// tables to their bounds) if there is none.
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
            let dropped = trim_all(&mut c, &self.bounds, &self.sink)
                .map_err(|e| classify(&e).into_error(e))?;
            if dropped > 0 {
                log::info!("sink: {dropped} side-table rows over their bounds dropped");
            }
            self.dropped_at_connect += dropped;
            self.client = Some(c);
        }
        self.client
            .as_mut()
            .ok_or_else(|| StoreError::Transient("no connection".into()))
    }

    /// One item alone; an item the server refuses as data is kept aside in
    /// `unreadable` with the server's reason.
    fn store_alone(&mut self, it: &Item, now_ms: i64) -> Result<Stored, StoreError> {
        let (sink, bounds) = (self.sink.clone(), self.bounds);
        let client = self.client()?;
        let at = At {
            now_ms,
            sink: &sink,
            bounds: &bounds,
        };
        match write_batch(client, std::slice::from_ref(it), &at, false) {
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
                let dropped = at
                    .insert(&mut tx, Side::Unreadable, &[it], why)
                    .and_then(|d| tx.commit().map(|()| d))
                    .map_err(|e| classify(&e).into_error(e))?;
                Ok(Stored {
                    stats: SinkStats {
                        unreadable: 1,
                        oversized: u64::from(it.is_oversized()),
                        side_dropped: dropped,
                        ..SinkStats::default()
                    },
                    fates: vec![Fate::Unreadable],
                })
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    /// [`write_batch`] on the live connection (connecting first); the
    /// outer error is the connection's, the inner the batch's, for the
    /// caller to classify.
    fn write(
        &mut self,
        items: &[Item],
        now_ms: i64,
        copy: bool,
    ) -> Result<Result<Stored, postgres::Error>, StoreError> {
        let (sink, bounds) = (self.sink.clone(), self.bounds);
        let at = At {
            now_ms,
            sink: &sink,
            bounds: &bounds,
        };
        Ok(write_batch(self.client()?, items, &at, copy))
    }

    /// The batch by `COPY` ([`super::pg_copy`]); `None` when some key
    /// was already stored or the server refused a value (rolled back, and
    /// the next [`CAREFUL_BATCHES`] batches go the careful way), or when
    /// the server refused `COPY` itself (rolled back, and `COPY` is not
    /// tried again by this process: [`PgStore::copy_refused`]). A lost
    /// connection is transient, as on the careful path.
    ///
    /// Any failure but a key already stored (23505) also drops the
    /// connection: a `COPY` the server refuses before it enters copy mode
    /// leaves the client one `ReadyForQuery` ahead (rust-postgres sends a
    /// `Sync` after the `Execute` and another after the `CopyFail`; its
    /// issue 789), and the next statement on that connection fails with
    /// "unexpected message from server".
    fn try_copy(&mut self, items: &[Item], now_ms: i64) -> Result<Option<Stored>, StoreError> {
        let e = match self.write(items, now_ms, true)? {
            Ok(s) => return Ok(Some(s)),
            Err(e) => e,
        };
        if !e
            .as_db_error()
            .is_some_and(|d| *d.code() == SqlState::UNIQUE_VIOLATION)
        {
            self.client = None;
        }
        match classify(&e) {
            Class::Data => {
                log::debug!("sink: COPY refused ({e}); storing the batch with ON CONFLICT");
                self.careful = CAREFUL_BATCHES;
                Ok(None)
            }
            Class::Fatal => {
                log::warn!(
                    "sink: PostgreSQL refused COPY into events ({e}); storing every batch with INSERT .. ON CONFLICT from now on (slower)"
                );
                self.copy_refused = true;
                Ok(None)
            }
            Class::Transient | Class::Settings => Err(self.fail(e)),
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
    fn commit(&mut self, items: &[Item], now_ms: i64) -> Result<Stored, StoreError> {
        if self.careful == 0 && !self.copy_refused {
            if let Some(mut out) = self.try_copy(items, now_ms)? {
                out.stats.side_dropped += std::mem::take(&mut self.dropped_at_connect);
                return Ok(out);
            }
        } else {
            self.careful = self.careful.saturating_sub(1);
        }
        let mut out = match self.write(items, now_ms, false)? {
            Ok(s) => s,
            Err(e) if classify(&e) == Class::Data => {
                log::warn!("sink: batch refused as data ({e}); storing its items one by one");
                let mut total = Stored::default();
                for it in items {
                    let one = self.store_alone(it, now_ms)?;
                    total.stats += one.stats;
                    total.fates.extend(one.fates);
                }
                total
            }
            Err(e) => return Err(self.fail(e)),
        };
        out.stats.side_dropped += std::mem::take(&mut self.dropped_at_connect);
        Ok(out)
    }

    /// One transaction for the notes; a refusal as data (which a correct
    /// note never causes) drops them: a note is worth nothing twice.
    fn notes(
        &mut self,
        notes: &[BoardNote],
        asking: bool,
        now_ms: i64,
    ) -> Result<book::NotesDone, StoreError> {
        let client = self.client()?;
        let done = client.transaction().and_then(|mut tx| {
            let done = book::apply_notes(&mut PgBooks { tx: &mut tx }, notes, asking, now_ms)?;
            tx.commit().map(|()| done)
        });
        match done {
            Ok(d) => Ok(d),
            Err(e) if classify(&e) == Class::Data => {
                log::warn!("sink: boards' notes refused as data ({e}); dropped");
                Ok(book::NotesDone::default())
            }
            Err(e) => Err(self.fail(e)),
        }
    }

    fn ledger_summary(&mut self) -> Result<LedgerSummary, StoreError> {
        let row = match self.client()?.query_one(super::LEDGER_SUMMARY, &[]) {
            Ok(r) => r,
            Err(e) => return Err(self.fail(e)),
        };
        let n = |i: usize| row.get::<_, i64>(i).max(0) as u64;
        Ok(LedgerSummary {
            boards_with_gaps: n(0),
            rows_missing: n(1),
            oldest_gap_since_ms: row.get(2),
            rows_gone: n(3),
        })
    }
}

/// Every side table within `b`, in one transaction; returns the rows dropped.
fn trim_all(c: &mut Client, b: &SideBounds, sink: &str) -> Result<u64, postgres::Error> {
    let mut tx = c.transaction()?;
    let mut gone = 0;
    for side in Side::ALL {
        gone += trim(&mut tx, side, b, sink)?;
    }
    tx.commit()?;
    Ok(gone)
}

/// What a PostgreSQL error means for the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    /// Retry later on a new connection (class 08 connection, 40 rollback:
    /// deadlock or serialization, 53 resources, 57 operator intervention,
    /// 58 system; any other error without a SQLSTATE: I/O, closed
    /// connection, a server not reachable).
    Transient,
    /// A value the server cannot hold (class 22 data, 23 constraint).
    Data,
    /// Anything else (28 login, 3D database, 42 schema or permission).
    Fatal,
    /// The client's own settings cannot work: no password where the server
    /// asks for one, a conninfo it refuses ([`client_settings_error`]).
    Settings,
}

impl Class {
    fn into_error(self, e: postgres::Error) -> StoreError {
        let text = error_text(&e);
        match self {
            Class::Fatal => StoreError::Fatal(text),
            Class::Settings => StoreError::Settings(text),
            Class::Transient | Class::Data => StoreError::Transient(text),
        }
    }
}

/// `e` with its cause: the server's message, SQLSTATE, detail and hint
/// (`password authentication failed for user "sink" (28P01)`), or the
/// client's words and every error under them (`error connecting to
/// server: Connection refused (os error 111)`); tokio-postgres' own
/// `Display` says only the first part (`db error`, `error connecting to
/// server`). A missing password says where one is read from.
pub fn error_text(e: &postgres::Error) -> String {
    if let Some(db) = e.as_db_error() {
        let mut text = format!("{} ({})", db.message(), db.code().code());
        if let Some(d) = db.detail() {
            text.push_str(&format!("; detail: {d}"));
        }
        if let Some(h) = db.hint() {
            text.push_str(&format!("; hint: {h}"));
        }
        return text;
    }
    let mut text = e.to_string();
    let mut cur = std::error::Error::source(e);
    while let Some(err) = cur {
        let part = err.to_string();
        if !text.ends_with(&part) {
            text.push_str(&format!(": {part}"));
        }
        cur = err.source();
    }
    if text.ends_with("password missing") {
        text.push_str(
            " (the server asks for a password and none was given: name a file only its owner can \
             read in password_file under [sink.postgres] or --pg-password-file, or set PGPASSWORD \
             or PGPASSFILE)",
        );
    }
    text
}

/// Whether `e` is the client refusing its own settings, which no retry
/// changes. tokio-postgres 0.7 has no accessor for an error's kind; its
/// `Display` of `Kind::Config`, `Kind::ConfigParse` and
/// `Kind::Authentication` is exactly these words (src/error/mod.rs), and
/// such errors carry no SQLSTATE.
fn client_settings_error(e: &postgres::Error) -> bool {
    e.as_db_error().is_none()
        && matches!(
            e.to_string().as_str(),
            "invalid configuration" | "invalid connection string" | "authentication error"
        )
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

/// As [`connect_client`], from a conninfo already parsed.
///
/// Errors: as [`PgStore::connect`].
pub fn connect_client_with(connect: &PgConnect) -> Result<Client, StoreError> {
    connect.connect().map_err(connect_error)
}

fn classify(e: &postgres::Error) -> Class {
    if client_settings_error(e) {
        return Class::Settings;
    }
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

/// The batch in one transaction: insert (by `COPY` if `copy`, see
/// [`super::pg_copy`]), compare, keep aside, commit.
fn write_batch(
    client: &mut Client,
    items: &[Item],
    at: &At<'_>,
    copy: bool,
) -> Result<Stored, postgres::Error> {
    let mut tx = client.transaction()?;
    pg_clock::lock(&mut tx, items)?;
    let cands = batch::candidates(items);
    let fixes = pg_clock::corrections(&mut tx, items, &cands)?;
    let copied = match copy {
        true => pg_copy::copy_events(&mut tx, items, &cands, &fixes, at.now_ms)?,
        false => None,
    };
    let inserted = match copied {
        Some(keys) => keys,
        None => insert_events(&mut tx, items, &cands, &fixes, at.now_ms)?,
    };
    let mut stored: HashMap<Key, [u8; 32]> = HashMap::new();
    let (mut other_devs, mut other_ids) = (Vec::new(), Vec::new());
    for &i in &cands {
        if let Ok(e) = &items[i].read {
            let k = batch::key(e);
            if inserted.contains(&k) {
                stored.insert(k, e.digest);
            } else {
                other_devs.push(e.device_id.as_str());
                other_ids.push(e.event_id.as_str());
            }
        }
    }
    if !other_ids.is_empty() {
        for row in tx.query(SELECT_DIGESTS, &[&other_devs, &other_ids])? {
            let d: Vec<u8> = row.get(2);
            // A digest of another length matches nothing: a mismatch.
            if let Ok(d) = <[u8; 32]>::try_from(d.as_slice()) {
                stored.insert((row.get(0), row.get(1)), d);
            }
        }
    }
    let fates = batch::classify(items, &inserted, &stored);
    let mut stats = at.keep(&mut tx, items, &fates)?;
    stats.corrected = fixes.keys().filter(|k| inserted.contains(*k)).count() as u64;
    let clock = pg_clock::anchors(&mut tx, items, &fates, at.now_ms, at.sink)?;
    stats.anchors = clock.believed;
    stats.corrected += clock.moved;
    if !clock.refused.is_empty() {
        stats.anchors_refused = clock.refused.len() as u64;
        let (list, why): (Vec<&Item>, Vec<String>) = clock.refused.into_iter().unzip();
        stats.side_dropped += at.insert(&mut tx, Side::ClockRefused, &list, why)?;
    }
    // Last before the commit: the ledger's lines stay locked the shortest.
    let arrivals = book::arrivals(items, &fates);
    book::record(&mut PgBooks { tx: &mut tx }, &arrivals, at.now_ms)?;
    tx.commit()?;
    Ok(Stored { stats, fates })
}

/// Insert the candidates (first delivery of each key, in key order), with
/// the topic each came on; returns the keys whose row this transaction
/// created.
fn insert_events(
    tx: &mut Transaction<'_>,
    items: &[Item],
    cands: &[usize],
    fixes: &HashMap<Key, i64>,
    now_ms: i64,
) -> Result<HashSet<Key>, postgres::Error> {
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
    let mut topics = Vec::with_capacity(n);
    let (mut boots, mut monos, mut corrected) = (
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
            topics.push(it.topic.as_str());
            boots.push(e.mono.map(|m| m.boot_id.simple()));
            monos.push(e.mono.map(|m| m.mono_ms as i64));
            corrected.push(fixes.get(&batch::key(e)).copied());
        }
    }
    if ids.is_empty() {
        return Ok(HashSet::new());
    }
    // Parsed in this transaction, not prepared once per connection: a
    // transaction-mode pooler (PgBouncer) may run the next transaction on
    // another server connection, where a statement prepared before would
    // not exist (26000). Only batches `COPY` cannot take come here.
    let rows = tx.query(
        INSERT_EVENTS,
        &[
            &ids, &devs, &streams, &seqs, &tss, &trusted, &fields, &payloads, &digests, &now_ms,
            &topics, &boots, &monos, &corrected,
        ],
    )?;
    Ok(rows.iter().map(|r| (r.get(0), r.get(1))).collect())
}

/// When a batch is stored, by which sink, and the bounds its side tables
/// are kept in.
struct At<'a> {
    now_ms: i64,
    sink: &'a str,
    bounds: &'a SideBounds,
}

impl At<'_> {
    /// Record duplicates, mismatches, unreadable and forged deliveries;
    /// count the batch.
    ///
    /// A mismatch already recorded (the same key and digest, delivered
    /// again after a sink died before acknowledging it) counts as a
    /// duplicate.
    fn keep(
        &self,
        tx: &mut Transaction<'_>,
        items: &[Item],
        fates: &[Fate],
    ) -> Result<SinkStats, postgres::Error> {
        let mut s = SinkStats::default();
        let mut dups: Vec<&super::message::Event> = Vec::new();
        let mut mism: Vec<&Item> = Vec::new();
        let (mut unread, mut forged): (Vec<&Item>, Vec<&Item>) = (Vec::new(), Vec::new());
        for (it, fate) in items.iter().zip(fates) {
            match (fate, &it.read) {
                (Fate::First, _) => s.first += 1,
                (Fate::Duplicate, Ok(e)) => dups.push(e),
                (Fate::Mismatch, Ok(_)) => mism.push(it),
                (Fate::Forged, _) => forged.push(it),
                _ => unread.push(it),
            }
        }
        if !mism.is_empty() {
            let (mut new, dropped) = self.mismatches(tx, &mism)?;
            s.side_dropped += dropped;
            for it in &mism {
                if let Ok(e) = &it.read {
                    if new.remove(&(batch::key(e), e.digest.to_vec())) {
                        s.mismatches += 1;
                    } else {
                        dups.push(e);
                    }
                }
            }
        }
        if !dups.is_empty() {
            s.duplicates += dups.len() as u64;
            self.redeliveries(tx, &dups)?;
        }
        for (side, list) in [(Side::Unreadable, &unread), (Side::Forged, &forged)] {
            if list.is_empty() {
                continue;
            }
            let why = list
                .iter()
                .map(|it| match &it.read {
                    Err(super::message::Unreadable::Forged(w)) => w.clone(),
                    Err(w) => w.to_string(),
                    Ok(_) => "unreadable".to_owned(),
                })
                .collect();
            s.side_dropped += self.insert(tx, side, list, why)?;
        }
        s.unreadable += unread.len() as u64;
        s.oversized += unread.iter().filter(|it| it.is_oversized()).count() as u64;
        s.forged += forged.len() as u64;
        Ok(s)
    }

    /// Count `dups` in `redeliveries`: one row per key, however many
    /// deliveries of it the batch holds, keys in sorted order (every sink
    /// locks the rows it adds to in the same order: no deadlock between
    /// two sinks counting the same events).
    fn redeliveries(
        &self,
        tx: &mut Transaction<'_>,
        dups: &[&super::message::Event],
    ) -> Result<(), postgres::Error> {
        let mut per_key: std::collections::BTreeMap<(&str, &str), i64> = Default::default();
        for e in dups {
            *per_key
                .entry((e.device_id.as_str(), e.event_id.as_str()))
                .or_default() += 1;
        }
        let devs: Vec<&str> = per_key.keys().map(|k| k.0).collect();
        let ids: Vec<&str> = per_key.keys().map(|k| k.1).collect();
        let counts: Vec<i64> = per_key.values().copied().collect();
        tx.execute(
            COUNT_REDELIVERIES,
            &[&devs, &ids, &counts, &self.now_ms, &self.sink],
        )?;
        Ok(())
    }

    /// Insert mismatches (cut to the bounds); returns the (key, digest)
    /// pairs new to the table and the rows the trim dropped.
    fn mismatches(
        &self,
        tx: &mut Transaction<'_>,
        mism: &[&Item],
    ) -> Result<(HashSet<KeyDigest>, u64), postgres::Error> {
        let (mut devs, mut ids, mut ds) = (Vec::new(), Vec::new(), Vec::new());
        let (mut ps, mut lens, mut ts) = (Vec::new(), Vec::new(), Vec::new());
        for it in mism {
            if let Ok(e) = &it.read {
                devs.push(e.device_id.as_str());
                ids.push(e.event_id.as_str());
                ds.push(&e.digest[..]);
                ps.push(self.bounds.cut(&it.payload));
                lens.push(it.payload.len() as i64);
                ts.push(it.topic.as_str());
            }
        }
        let new: HashSet<KeyDigest> = tx
            .query(
                INSERT_MISMATCHES,
                &[&devs, &ids, &ds, &ps, &lens, &ts, &self.now_ms, &self.sink],
            )?
            .iter()
            .map(|r| ((r.get(0), r.get(1)), r.get(2)))
            .collect();
        let dropped = if new.is_empty() {
            0
        } else {
            trim(tx, Side::Mismatches, self.bounds, self.sink)?
        };
        Ok((new, dropped))
    }

    /// Keep `items` in `side` (unreadable or forged) with their reasons,
    /// payloads cut to the bounds; returns the rows the trim dropped.
    fn insert(
        &self,
        tx: &mut Transaction<'_>,
        side: Side,
        items: &[&Item],
        why: Vec<String>,
    ) -> Result<u64, postgres::Error> {
        let topics: Vec<&str> = items.iter().map(|it| it.topic.as_str()).collect();
        let devices: Vec<&str> = items.iter().map(|it| it.publisher.as_str()).collect();
        let payloads: Vec<&[u8]> = items
            .iter()
            .map(|it| self.bounds.cut(&it.payload))
            .collect();
        let lens: Vec<i64> = items.iter().map(|it| it.delivered_bytes() as i64).collect();
        let sql = format!(
            "INSERT INTO {} (device_id, topic, payload, payload_bytes, reason, received_ms, sink)
             SELECT u.device_id, u.topic, u.payload, u.bytes, u.reason, $6, $7
             FROM unnest($1::text[], $2::text[], $3::bytea[], $4::int8[], $5::text[])
                  AS u(device_id, topic, payload, bytes, reason)",
            side.table()
        );
        tx.execute(
            sql.as_str(),
            &[
                &devices,
                &topics,
                &payloads,
                &lens,
                &why,
                &self.now_ms,
                &self.sink,
            ],
        )?;
        trim(tx, side, self.bounds, self.sink)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_client_settings_error_is_settings_and_keeps_its_cause() {
        // No host at all: tokio-postgres' `Kind::Config`, with the words
        // of what is missing under it.
        let e = postgres::Config::new()
            .user("sink")
            .connect(postgres::NoTls)
            .err()
            .expect("no host");
        assert_eq!(classify(&e), Class::Settings);
        let text = error_text(&e);
        assert!(text.starts_with("invalid configuration: "), "{text}");
        assert!(text.contains("missing"), "{text}");
        assert!(matches!(
            classify(&e).into_error(e),
            StoreError::Settings(_)
        ));
    }

    #[test]
    fn a_server_not_reachable_is_transient_and_says_why() {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("a free port");
        let e = postgres::Client::connect(
            &format!("host=127.0.0.1 port={port} user=sink connect_timeout=5"),
            postgres::NoTls,
        )
        .err()
        .expect("nothing listens there");
        assert_eq!(classify(&e), Class::Transient);
        let text = error_text(&e);
        assert!(
            text.starts_with("error connecting to server: ") && text.contains("refused"),
            "{text}"
        );
    }
}
