//! The PostgreSQL sink's schema and its migrations.
//!
//! Its one rule: the schema is changed only here, one numbered migration at a
//! time, each in the transaction that records it in `schema_version`, under a
//! transaction-scoped advisory lock so N sinks starting together migrate once.

use postgres::Client;

/// Migrations in order; `schema_version` holds the numbers applied.
const MIGRATIONS: &[(i32, &str)] = &[
    (1, V1),
    (2, V2),
    (3, V3),
    (4, V4),
    (5, super::ledger::pg::V5),
    (6, V6),
];

/// Version 1: events keyed by event id, and the deliveries kept aside.
///
/// - `events`: one row per event id, the first payload delivered (`payload`,
///   the exact bytes, JSON or postcard; `digest` = sha256 of them), with the
///   envelope's columns and its `fields` as `jsonb` whatever the wire format.
///   `events_latest` serves "latest per device and stream"
///   (`DISTINCT ON (device_id, stream) .. ORDER BY device_id, stream, seq DESC`),
///   `events_ts` time ranges by reading time, `events_received` (BRIN: rows
///   arrive in `received_ms` order) time ranges by arrival.
/// - `duplicates`: one row per delivery of an event id already stored with
///   the same digest (append-only: no update contention between sinks;
///   unbounded, so version 6 replaced it with `redeliveries`).
/// - `mismatches`: one row per (event id, digest) that differs from the
///   stored digest; never written over the stored row (I3).
/// - `unreadable`: deliveries that are not an edgespool envelope.
const V1: &str = "
CREATE TABLE events (
    event_id      uuid PRIMARY KEY,
    device_id     text NOT NULL,
    stream        text NOT NULL,
    seq           bigint NOT NULL,
    ts_ms         bigint NOT NULL,
    clock_trusted boolean NOT NULL,
    received_ms   bigint NOT NULL,
    fields        jsonb NOT NULL,
    payload       bytea NOT NULL,
    digest        bytea NOT NULL
);
CREATE INDEX events_latest ON events (device_id, stream, seq DESC);
CREATE INDEX events_ts ON events (ts_ms);
CREATE INDEX events_received ON events USING brin (received_ms);
CREATE TABLE duplicates (
    event_id    uuid NOT NULL,
    received_ms bigint NOT NULL,
    sink        text NOT NULL
);
CREATE TABLE mismatches (
    event_id    uuid NOT NULL,
    digest      bytea NOT NULL,
    payload     bytea NOT NULL,
    topic       text NOT NULL,
    received_ms bigint NOT NULL,
    sink        text NOT NULL,
    PRIMARY KEY (event_id, digest)
);
CREATE TABLE unreadable (
    id          bigserial PRIMARY KEY,
    topic       text NOT NULL,
    payload     bytea NOT NULL,
    reason      text NOT NULL,
    received_ms bigint NOT NULL,
    sink        text NOT NULL
);
";

/// Version 2: identity from the topic, dedup per device, bounded side tables.
///
/// - `events`: keyed by `(device_id, event_id)` (two devices never share a
///   row, whatever ids they choose); `topic` is the topic the event came
///   on (`NULL` for rows stored before version 2, whose `device_id` is the
///   one their payload claimed).
/// - `duplicates`: `device_id` (`NULL` before version 2).
/// - `mismatches`: `device_id` (taken from the stored event for older
///   rows), unique per `(device_id, event_id, digest)`; an `id` giving
///   their age; `payload_bytes`, the delivered length (a kept payload is
///   cut at the side-table bound, 64 KiB).
/// - `unreadable`: `payload_bytes`, as above.
/// - `forged`: envelopes whose `device_id` or `stream` is not the one their
///   topic names, kept with the topic and the reason (never in `events`).
/// - `side_drops`: rows dropped from a side table (oldest first) to keep
///   it within its bounds, per table and sink.
const V2: &str = "
ALTER TABLE events ADD COLUMN topic text;
ALTER TABLE events DROP CONSTRAINT events_pkey;
ALTER TABLE events ADD PRIMARY KEY (device_id, event_id);
ALTER TABLE duplicates ADD COLUMN device_id text;
ALTER TABLE mismatches ADD COLUMN device_id text;
UPDATE mismatches m SET device_id = e.device_id FROM events e WHERE e.event_id = m.event_id;
UPDATE mismatches SET device_id = '' WHERE device_id IS NULL;
ALTER TABLE mismatches ALTER COLUMN device_id SET NOT NULL;
ALTER TABLE mismatches DROP CONSTRAINT mismatches_pkey;
ALTER TABLE mismatches ADD COLUMN id bigserial PRIMARY KEY;
CREATE UNIQUE INDEX mismatches_key ON mismatches (device_id, event_id, digest);
ALTER TABLE mismatches ADD COLUMN payload_bytes bigint;
UPDATE mismatches SET payload_bytes = octet_length(payload),
                      payload = substring(payload FROM 1 FOR 65536);
ALTER TABLE mismatches ALTER COLUMN payload_bytes SET NOT NULL;
ALTER TABLE unreadable ADD COLUMN payload_bytes bigint;
UPDATE unreadable SET payload_bytes = octet_length(payload),
                      payload = substring(payload FROM 1 FOR 65536);
ALTER TABLE unreadable ALTER COLUMN payload_bytes SET NOT NULL;
CREATE TABLE forged (
    id            bigserial PRIMARY KEY,
    topic         text NOT NULL,
    payload       bytea NOT NULL,
    payload_bytes bigint NOT NULL,
    reason        text NOT NULL,
    received_ms   bigint NOT NULL,
    sink          text NOT NULL
);
CREATE TABLE side_drops (
    side    text NOT NULL,
    sink    text NOT NULL,
    dropped bigint NOT NULL,
    PRIMARY KEY (side, sink)
);
";

/// Version 3: side tables bounded per device.
///
/// - `forged`, `unreadable`: `device_id`, the device that published the
///   row (the topic's, see [`super::identity::publisher`]; filled from the
///   topic of the rows already there by [`fill_devices`]), so one device's
///   junk evicts only its own oldest rows.
const V3: &str = "
ALTER TABLE forged ADD COLUMN device_id text NOT NULL DEFAULT '';
ALTER TABLE unreadable ADD COLUMN device_id text NOT NULL DEFAULT '';
";

/// Version 4: true time (`super::clock`).
///
/// - `events`: `boot_id` and `mono_ms`, where the envelope carries them (a
///   reading taken before its board's clock was synchronized, a clock
///   anchor), and `ts_corrected_ms`, the reading's true time once an
///   anchor of its boot moved it (`NULL` otherwise; `ts_ms` stays what was
///   sent). Adding the columns rewrites nothing (no default); the partial
///   index `events_boot` holds stamped rows only, so building it reads
///   `events` once and finds none.
/// - `clock_anchors`: the anchor believed per `(device_id, boot_id)`.
/// - `clock_refused`: anchors kept aside with their reason, bounded like
///   the other side tables.
const V4: &str = "
ALTER TABLE events ADD COLUMN boot_id uuid;
ALTER TABLE events ADD COLUMN mono_ms bigint;
ALTER TABLE events ADD COLUMN ts_corrected_ms bigint;
CREATE INDEX events_boot ON events (device_id, boot_id, mono_ms) WHERE boot_id IS NOT NULL;
CREATE TABLE clock_anchors (
    device_id   text NOT NULL,
    boot_id     uuid NOT NULL,
    mono_ms     bigint NOT NULL,
    wall_ms     bigint NOT NULL,
    event_id    uuid NOT NULL,
    received_ms bigint NOT NULL,
    sink        text NOT NULL,
    PRIMARY KEY (device_id, boot_id)
);
CREATE TABLE clock_refused (
    id            bigserial PRIMARY KEY,
    device_id     text NOT NULL,
    topic         text NOT NULL,
    payload       bytea NOT NULL,
    payload_bytes bigint NOT NULL,
    reason        text NOT NULL,
    received_ms   bigint NOT NULL,
    sink          text NOT NULL
);
";

/// Version 6: redeliveries counted per event, not kept one row each.
///
/// - `redeliveries`: one row per `(device_id, event_id)` delivered again
///   after it was stored with the same digest (or again with a digest
///   already in `mismatches`): `deliveries` such deliveries, the wall
///   clock (ms) of the first and the last, and the sink that counted the
///   last. Each batch adds to it with `INSERT .. ON CONFLICT DO UPDATE`, its
///   keys in sorted order (the lock order of every sink), so the table holds
///   at most one row per stored event, however often a device sends one
///   again (field case F6: 200 batches of 1,000 copies of one event made
///   199,999 rows, 13.7 MB, in `duplicates`).
/// - `duplicates` (one row per redelivery) is folded into it, a row per key
///   (rows of version 1, without a device, take the device of their stored
///   event, else `''`), and dropped: a sink of version 5 or older still
///   running fails its next duplicate with 42P01 (undefined table, fatal:
///   it exits) instead of writing rows no one counts, and refuses this
///   schema when started again (`MigrateError::Newer`).
const V6: &str = "
CREATE TABLE redeliveries (
    device_id  text NOT NULL,
    event_id   uuid NOT NULL,
    deliveries bigint NOT NULL,
    first_ms   bigint NOT NULL,
    last_ms    bigint NOT NULL,
    sink       text NOT NULL,
    PRIMARY KEY (device_id, event_id)
);
UPDATE duplicates d SET device_id = e.device_id FROM events e
 WHERE d.device_id IS NULL AND e.event_id = d.event_id;
INSERT INTO redeliveries (device_id, event_id, deliveries, first_ms, last_ms, sink)
SELECT coalesce(device_id, ''), event_id, count(*), min(received_ms), max(received_ms),
       (array_agg(sink ORDER BY received_ms DESC))[1]
FROM duplicates GROUP BY 1, 2;
DROP TABLE duplicates;
";

/// Version 3's `device_id` of the rows `forged` and `unreadable` already
/// held (at most the side tables' bounds), from their topics.
fn fill_devices(tx: &mut postgres::Transaction<'_>) -> Result<(), postgres::Error> {
    for table in ["forged", "unreadable"] {
        let rows = tx.query(format!("SELECT id, topic FROM {table}").as_str(), &[])?;
        let ids: Vec<i64> = rows.iter().map(|r| r.get(0)).collect();
        let devices: Vec<&str> = rows
            .iter()
            .map(|r| super::identity::publisher(r.get(1)))
            .collect();
        tx.execute(
            format!(
                "UPDATE {table} t SET device_id = u.d
                 FROM unnest($1::int8[], $2::text[]) AS u(id, d) WHERE t.id = u.id"
            )
            .as_str(),
            &[&ids, &devices],
        )?;
    }
    Ok(())
}

/// Any constant, the same in every sink: the key of the advisory lock.
const MIGRATION_LOCK: i64 = 0x6564_6765_7370_6f6f; // "edgespoo"

/// The newest schema version this build knows.
pub fn latest() -> i32 {
    MIGRATIONS.last().map(|m| m.0).unwrap_or(0)
}

/// Bring the schema to [`latest`]; returns the version found before.
///
/// TimescaleDB: `events` stays a plain table even when the extension is
/// present. A hypertable requires every unique index to include its time
/// column, so `(device_id, event_id)` could no longer be the key that
/// deduplicates; this is logged once.
///
/// Errors: a database error, or a schema newer than this build (`Err` text
/// names both versions: run a newer sink).
pub fn migrate(client: &mut Client) -> Result<i32, MigrateError> {
    let mut tx = client.transaction()?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&MIGRATION_LOCK])?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS schema_version (
             version    integer PRIMARY KEY,
             applied_at timestamptz NOT NULL DEFAULT now()
         )",
    )?;
    let found: i32 = tx
        .query_one("SELECT coalesce(max(version), 0) FROM schema_version", &[])?
        .get(0);
    if found > latest() {
        return Err(MigrateError::Newer {
            found,
            known: latest(),
        });
    }
    for (v, sql) in MIGRATIONS.iter().filter(|(v, _)| *v > found) {
        tx.batch_execute(sql)?;
        if *v == 3 {
            fill_devices(&mut tx)?;
        }
        tx.execute("INSERT INTO schema_version (version) VALUES ($1)", &[v])?;
        log::info!("sink: PostgreSQL schema migrated to version {v}");
    }
    let timescale: bool = tx
        .query_one(
            "SELECT EXISTS (SELECT 1 FROM pg_extension WHERE extname = 'timescaledb')",
            &[],
        )?
        .get(0);
    tx.commit()?;
    if timescale {
        log::info!(
            "sink: TimescaleDB is installed; events stays a plain table \
             (a hypertable cannot keep (device_id, event_id) unique)"
        );
    }
    Ok(found)
}

/// Why the schema could not be brought up to date.
#[derive(Debug, thiserror::Error)]
pub enum MigrateError {
    /// A database error (classified by the caller: transient or fatal).
    #[error(transparent)]
    Db(#[from] postgres::Error),
    /// The database was migrated by a newer sink: fatal, run that version.
    #[error(
        "schema version {found} is newer than this sink knows ({known}); run a newer edgespool"
    )]
    Newer {
        /// Version in `schema_version`.
        found: i32,
        /// Newest version this build has.
        known: i32,
    },
}
