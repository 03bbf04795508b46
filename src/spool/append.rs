//! Appending readings: each becomes one row with its stream's next sequence
//! number, an event id, its payload encoded once and a sha256 digest of it.
//!
//! One rule: a row's event id and bytes never change after the commit (I3);
//! a producer is told "stored" only after the transaction holding its
//! reading committed.

use super::riders::{Riders, Rode};
use super::seqs::SeqBook;
use super::seqs::{stream_row, StreamSeq, PERSIST_SEQS_EVERY, SQL_SET_SEQ};
use super::{keys, Spool, SpoolError, SQL_COUNTER_ADD, SQL_GET_STATE, SQL_SET_STATE};
use crate::event::clock::MonoStamp;
use crate::event::envelope::{self, Envelope, EventId, EventIdGen, Format};
use crate::event::reading::{FieldValue, Fields, ReplayPosition};
use rusqlite::{params, Connection, OptionalExtension, TransactionBehavior};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;

pub(super) const SQL_INSERT_EVENT: &str = "INSERT INTO events
    (stream_id, seq, event_id, created_ms, digest, payload, prio)
    VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7)";

/// One reading to append.
#[derive(Debug, Clone)]
pub struct NewEvent {
    /// Stream (source name).
    pub stream: String,
    /// The reading's time, Unix ms: the wall clock when it was taken, the
    /// producer's own time, or, for a replayed row, the trace's
    /// ([`crate::source::replay::DueRow::ts_ms`]).
    pub ts_ms: i64,
    /// Whether `ts_ms` can be trusted: the wall clock was (not before
    /// [`envelope::CLOCK_FLOOR_MS`]), a producer's time is past it; always
    /// for a replayed row's trace time.
    pub clock_trusted: bool,
    /// Where `ts_ms` was read on the board's monotonic clock, when it was
    /// read from the board's wall clock before time sync vouched for it
    /// (`crate::os::clock::reading_now`), and for a clock anchor; encoded
    /// into the payload ([`Envelope::mono`]). `None` for a producer's or a
    /// trace's own time, whose bytes must come out the same each time.
    /// Boxed: most readings have none, and every reading in flight carries
    /// the field.
    pub mono: Option<Box<MonoStamp>>,
    /// The fields.
    pub fields: Fields,
    /// For a row of a replayed trace: where the replay stands after it.
    /// The event id then derives from it ([`envelope::replay_row_id`]) and
    /// the whole payload ([`envelope::derived_event_id`]: a row read again
    /// with other bytes is a new event, never a second payload under one
    /// id), the append stores it with the row, and a row at or before the
    /// position already stored for the same trace is not appended again.
    pub replay: Option<ReplayPosition>,
    /// Idempotency key from the producer (ingest socket `key`, bridged
    /// message `id_field`), scoped to who sent it ([`ReadingKey`]). A key
    /// already spooled with the same reading is not appended again (counted
    /// under `ingest_keys_already_spooled`) and its reply carries the event
    /// id stored with the key; with another reading it is refused for good
    /// (counted under `ingest_key_conflicts`). A new key's event id derives
    /// from the key and the whole payload, `seq` and `ts_ms` included
    /// ([`envelope::derived_event_id`]): a key the spool forgot (a rollback,
    /// or past [`super::KEYS_KEPT`]) and sent again is byte-identical under
    /// its first id, or a new event under a new id, never a second payload
    /// under one id (I3). Keys are remembered while their row, or any
    /// older row, is in the spool, and the newest [`super::KEYS_KEPT`]
    /// after. Boxed: most readings have none, and every reading in flight
    /// carries the field.
    pub key: Option<Box<ReadingKey>>,
    /// Told the outcome once: after the commit, or when refused.
    pub reply: Option<Reply>,
}

impl NewEvent {
    /// A reading with no replay position, key or reply.
    pub fn new(stream: impl Into<String>, ts_ms: i64, clock_trusted: bool, fields: Fields) -> Self {
        NewEvent {
            stream: stream.into(),
            ts_ms,
            clock_trusted,
            mono: None,
            fields,
            replay: None,
            key: None,
            reply: None,
        }
    }

    /// Tell the producer this reading was refused for now (`why`, a
    /// sentence naming the cause: the same reading may be taken later);
    /// nothing when no one waits.
    pub fn refuse(&self, why: &str) {
        if let Some(r) = &self.reply {
            r.send(Err(Refused::for_now(why)));
        }
    }

    /// What this reading holds on the heap, estimated in bytes: the struct,
    /// its strings and field vector with the allocator's bookkeeping per
    /// allocation, and its reply channel. Budgets of the ingest thread's
    /// buffer and of the socket and bridge input count this
    /// ([`crate::intake::budget`]); it is an estimate (within tens of bytes
    /// per allocation), not a measurement.
    pub fn heap_bytes(&self) -> usize {
        use std::mem::size_of;
        let text = |t: &str| {
            if t.is_empty() {
                0
            } else {
                t.len() + ALLOC_BYTES
            }
        };
        let fields: usize = self
            .fields
            .iter()
            .map(|(n, v)| {
                text(n)
                    + match v {
                        FieldValue::Text(t) => text(t),
                        FieldValue::Num(_) | FieldValue::Bool(_) => 0,
                    }
            })
            .sum();
        let key = self.key.as_ref().map_or(0, |k| {
            size_of::<ReadingKey>() + ALLOC_BYTES + text(&k.scope) + text(&k.key)
        });
        let replay = self.replay.as_ref().map_or(0, |p| {
            text(&p.trace_id) + text(&p.fingerprint) + 256 * usize::from(p.segment.is_some())
        });
        let mono = self
            .mono
            .as_ref()
            .map_or(0, |_| size_of::<MonoStamp>() + ALLOC_BYTES);
        size_of::<NewEvent>()
            + mono
            + text(&self.stream)
            + self.fields.capacity() * size_of::<(String, FieldValue)>()
            + ALLOC_BYTES
            + fields
            + key
            + replay
            + if self.reply.is_some() { REPLY_BYTES } else { 0 }
    }
}

/// What one heap allocation costs beyond its bytes (glibc malloc: a header
/// and rounding to 16), for [`NewEvent::heap_bytes`].
const ALLOC_BYTES: usize = 16;
/// A reply channel ([`Reply`]: a one-slot channel and its shared state).
pub const REPLY_BYTES: usize = 256;

/// An idempotency key as the spool sees it: the producer's key, the scope
/// it was given in, and a digest of the reading it names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadingKey {
    /// Who sent it: `unix:uid=<uid>` (the ingest socket, by peer uid),
    /// `tcp` (the ingest TCP port), `topic:<topic>` (a bridge). The same
    /// key in two scopes names two readings, with two event ids.
    pub scope: String,
    /// The producer's key.
    pub key: String,
    /// sha256 of what the reading says ([`ReadingKey::new`]): the same key
    /// with another digest is another reading, refused.
    pub digest: [u8; 32],
}

impl ReadingKey {
    /// The key `key` in `scope` for a reading of `stream` with `fields` and,
    /// if the producer gave one, its own time `ts_ms` (a time the agent
    /// filled in differs at every retry, so it is left out). The digest
    /// covers the stream, the fields sorted by name (so their order does
    /// not matter) with their types and values, and that time; each part
    /// length-prefixed.
    pub fn new(
        scope: String,
        key: String,
        stream: &str,
        fields: &Fields,
        ts_ms: Option<i64>,
    ) -> Self {
        let mut h = Sha256::new();
        let mut part = |b: &[u8]| {
            h.update((b.len() as u64).to_be_bytes());
            h.update(b);
        };
        part(b"edgespool-reading-v1");
        part(stream.as_bytes());
        let mut sorted: Vec<&(String, FieldValue)> = fields.iter().collect();
        sorted.sort_by(|a, b| a.0.cmp(&b.0));
        for (name, v) in sorted {
            part(name.as_bytes());
            match v {
                FieldValue::Num(f) => {
                    part(b"n");
                    part(&f.to_bits().to_be_bytes());
                }
                FieldValue::Text(t) => {
                    part(b"s");
                    part(t.as_bytes());
                }
                FieldValue::Bool(b) => {
                    part(b"b");
                    part(&[u8::from(*b)]);
                }
            }
        }
        match ts_ms {
            Some(t) => part(&t.to_be_bytes()),
            None => part(b"-"),
        }
        ReadingKey {
            scope,
            key,
            digest: h.finalize().into(),
        }
    }
}

/// Why a reading was not stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refused {
    /// A sentence naming the cause.
    pub why: String,
    /// The same reading would be refused again (a key reused for another
    /// reading, a reading that cannot be encoded): a producer that can
    /// resend (the bridge) must not. Otherwise (spool or disk full, the
    /// buffer full) it may be taken later.
    pub lasting: bool,
}

impl Refused {
    /// A refusal that may not hold later (the spool, disk or buffer full).
    pub fn for_now(why: &str) -> Refused {
        Refused {
            why: why.to_owned(),
            lasting: false,
        }
    }

    /// A refusal the same reading would get again.
    pub fn lasting(why: String) -> Refused {
        Refused { why, lasting: true }
    }
}

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.why)
    }
}

/// What a producer waiting on a reading learns: `Ok` ([`Committed`]) once
/// the transaction holding it has committed, or `Err` when it was refused
/// (spool or disk full, the in-memory buffer full, not encodable, a key
/// reused for another reading). When the agent stops before committing, the
/// sender is dropped and the receiver's `recv` fails: not stored.
pub type CommitOutcome = Result<Committed, Refused>;

/// A reading's commit, as its producer is told it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Committed {
    /// Its event id (for a keyed reading already spooled, the stored
    /// one's).
    pub event_id: EventId,
    /// Whether the commit was synced to the disk (the connection's
    /// `PRAGMA synchronous` read back as FULL): then a power cut cannot roll
    /// it back. Under NORMAL it is durable only from the next checkpoint;
    /// a power cut before it may roll the reading back (the `batched`
    /// contract).
    pub synced: bool,
}

/// What [`Spool::append`] tells a reading's producer before it knows the
/// commit: its event id, or why it was refused.
type Told = Result<EventId, Refused>;

/// Where a reading's [`CommitOutcome`] goes (one per reading): a one-slot
/// channel ([`Reply::channel`]), so a reading in flight costs little memory.
#[derive(Debug, Clone)]
pub struct Reply(std::sync::mpsc::SyncSender<CommitOutcome>);

impl Reply {
    /// A reply and the receiver its producer waits on.
    pub fn channel() -> (Reply, std::sync::mpsc::Receiver<CommitOutcome>) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        (Reply(tx), rx)
    }

    /// Send `outcome`; a producer that has gone away is ignored (and a
    /// second outcome for one reading never blocks the ingest thread).
    pub fn send(&self, outcome: CommitOutcome) {
        let _ = self.0.try_send(outcome);
    }
}

/// How a row's event id is made ([`Issued::event_id`]).
#[derive(Clone, Copy)]
enum IdFor {
    /// Known before the payload: a fresh random id.
    Ready(EventId),
    /// Derived from a handle and the payload ([`envelope::derived_event_id`]):
    /// a keyed reading's key ([`envelope::key_id`]) or a replayed row's
    /// position ([`envelope::replay_row_id`]).
    Derived(EventId),
}

/// Where one append transaction writes its rows.
struct Target<'a, 't> {
    tx: &'a rusqlite::Transaction<'t>,
    insert: &'a mut rusqlite::CachedStatement<'t>,
    device_id: &'a str,
    format: Format,
    now_ms: i64,
    path: &'a Path,
    /// The spool's secret for keyed event ids.
    key_secret: &'a [u8; 32],
}

/// What one append transaction has issued so far. Its sequence numbers
/// reach the book only after the commit, so a rolled-back batch does not
/// advance any sequence.
#[derive(Default)]
struct Issued {
    /// The last sequence number issued per stream in this transaction.
    next: HashMap<String, StreamSeq>,
    appended: usize,
    unencodable: i64,
    keys_already: i64,
    key_conflicts: i64,
    marks: ReplayMarks,
}

impl Issued {
    /// Append `ev` as the next row of its stream; what its producer is told
    /// (`None`: a replayed row already spooled, told nothing).
    fn row(
        &mut self,
        to: &mut Target<'_, '_>,
        book: &SeqBook,
        ev: &NewEvent,
        ids: &mut EventIdGen,
    ) -> Result<Option<Told>, SpoolError> {
        let err = |e| SpoolError::classify(to.path, e);
        let stream = self.stream(to.tx, book, &ev.stream).map_err(err)?;
        let id = match self.event_id(to, ev, ids).map_err(err)? {
            Ok(id) => id,
            Err(told) => return Ok(told),
        };
        let seq = stream.last_seq + 1;
        let mut env = Envelope {
            event_id: match id {
                IdFor::Ready(id) => id,
                IdFor::Derived(_) => envelope::ZERO_EVENT_ID,
            },
            device_id: to.device_id,
            stream: &ev.stream,
            seq: seq as u64,
            ts_ms: ev.ts_ms,
            clock_trusted: ev.clock_trusted,
            mono: ev.mono.as_deref().copied(),
            fields: &ev.fields,
        };
        let mut encoded = envelope::encode(to.format, &env);
        if let (IdFor::Derived(handle), Ok(body)) = (id, &encoded) {
            // The id is derived from the payload it names (I3 after a rollback).
            env.event_id = envelope::derived_event_id(&handle, body);
            encoded = envelope::encode(to.format, &env);
        }
        let payload = match encoded {
            Ok(p) => p,
            Err(e) => {
                log::warn!("stream {}: reading not encodable, skipped: {e}", ev.stream);
                self.unencodable += 1;
                return Ok(Some(Err(Refused::lasting(format!(
                    "not stored: the reading is not encodable ({e})"
                )))));
            }
        };
        let digest = Sha256::digest(&payload);
        let hyphenated = env.event_id.hyphenated();
        // The id is in the payload: not stored twice (schema 12).
        to.insert
            .execute(params![
                stream.id,
                seq,
                "",
                to.now_ms,
                digest.as_slice(),
                payload,
                stream.prio
            ])
            .map_err(err)?;
        if let (Some(k), IdFor::Derived(key_id)) = (&ev.key, id) {
            let row_id = to.tx.last_insert_rowid();
            keys::remember(to.tx, row_id, &key_id.hyphenated(), &hyphenated, &k.digest)
                .map_err(err)?;
        }
        self.next.insert(
            ev.stream.clone(),
            StreamSeq {
                last_seq: seq,
                ..stream
            },
        );
        if let Some(pos) = &ev.replay {
            self.marks.appended(&ev.stream, pos);
        }
        self.appended += 1;
        Ok(Some(Ok(env.event_id)))
    }

    /// The stream `name` as this transaction sees it (created with the
    /// config's priority, or the fallback one, the first time).
    fn stream(
        &self,
        tx: &rusqlite::Transaction<'_>,
        book: &SeqBook,
        name: &str,
    ) -> rusqlite::Result<StreamSeq> {
        if let Some(s) = self.next.get(name).or_else(|| book.streams.get(name)) {
            return Ok(*s);
        }
        let prio = book.priorities.get(name).copied();
        let prio = prio.unwrap_or_else(|| crate::event::stream::fallback_priority(name));
        stream_row(tx, name, prio)
    }

    /// The event id of `ev`: derived from its replay position, fresh, or,
    /// for a keyed reading, to be derived from its payload. `Err(told)`: not
    /// appended (a replayed row or a keyed reading already spooled), with
    /// what its producer is told.
    fn event_id(
        &mut self,
        to: &Target<'_, '_>,
        ev: &NewEvent,
        ids: &mut EventIdGen,
    ) -> rusqlite::Result<Result<IdFor, Option<Told>>> {
        if let Some(pos) = &ev.replay {
            if !self.marks.admit(to.tx, &ev.stream, pos)? {
                return Ok(Err(None));
            }
            let trace = pos.id_trace();
            let row = envelope::replay_row_id(to.device_id, &ev.stream, &trace, pos.lap, pos.line);
            return Ok(Ok(IdFor::Derived(row)));
        }
        let Some(key) = &ev.key else {
            return Ok(Ok(IdFor::Ready(ids.next_id())));
        };
        let key_id = envelope::key_id(
            to.key_secret,
            to.device_id,
            &ev.stream,
            &key.scope,
            &key.key,
        );
        let Some(stored) = keys::spooled(to.tx, &key_id.hyphenated())? else {
            return Ok(Ok(IdFor::Derived(key_id)));
        };
        // A key stored before digests were (schema 8) counts as the same reading.
        if stored.digest.is_none_or(|d| d == key.digest) {
            let Some(first) = EventId::parse(&stored.event_id) else {
                // The spool holds the key with a damaged id: the first
                // reading stays as it is, and this one is not stored as a
                // second copy under another id.
                self.key_conflicts += 1;
                return Ok(Err(Some(Err(Refused::lasting(format!(
                    "not stored: key {:?} is remembered with an event id that is not one ({:?}); send this reading under a new key",
                    key.key, stored.event_id
                ))))));
            };
            self.keys_already += 1;
            return Ok(Err(Some(Ok(first))));
        }
        self.key_conflicts += 1;
        Ok(Err(Some(Err(Refused::lasting(format!(
            "not stored: key {:?} was already used for another reading (event id {}); a key names one reading: send this one under a new key",
            key.key, stored.event_id
        ))))))
    }

    /// The replay positions moved and the counts of readings not appended,
    /// into `tx`.
    fn store(&self, tx: &rusqlite::Transaction<'_>, now_ms: i64) -> rusqlite::Result<()> {
        self.marks.store(tx, now_ms)?;
        for (name, n) in [
            ("readings_unencodable", self.unencodable),
            ("ingest_keys_already_spooled", self.keys_already),
            ("ingest_key_conflicts", self.key_conflicts),
        ] {
            if n > 0 {
                tx.execute(SQL_COUNTER_ADD, params![name, n])?;
            }
        }
        Ok(())
    }
}

/// Replay positions met in one append transaction.
#[derive(Default)]
pub(super) struct ReplayMarks {
    /// Per stream: the position stored (or appended in this transaction),
    /// and whether this transaction moved it.
    by_stream: HashMap<String, (Option<ReplayPosition>, bool)>,
    /// Rows not appended because their position was already stored.
    already: i64,
}

impl ReplayMarks {
    /// Whether the row at `pos` is new: not at or before the position
    /// stored for `stream` with the same trace identity. Two readers of one
    /// trace (a config reload racing the old source thread) thus never
    /// append one row twice.
    fn admit(
        &mut self,
        tx: &rusqlite::Transaction<'_>,
        stream: &str,
        pos: &ReplayPosition,
    ) -> rusqlite::Result<bool> {
        if !self.by_stream.contains_key(stream) {
            let stored = load_replay_position(tx, stream)?;
            self.by_stream.insert(stream.to_owned(), (stored, false));
        }
        let seen = self.by_stream.get(stream).is_some_and(|(s, _)| {
            s.as_ref().is_some_and(|s| {
                s.trace_id == pos.trace_id && (pos.lap, pos.line) <= (s.lap, s.line)
            })
        });
        if seen {
            self.already += 1;
        }
        Ok(!seen)
    }

    /// The row at `pos` was appended.
    fn appended(&mut self, stream: &str, pos: &ReplayPosition) {
        self.by_stream
            .insert(stream.to_owned(), (Some(pos.clone()), true));
    }

    /// Stores the moved positions (and the count of rows not appended
    /// again) in `tx`.
    fn store(&self, tx: &rusqlite::Transaction<'_>, now_ms: i64) -> rusqlite::Result<()> {
        for (stream, (pos, moved)) in &self.by_stream {
            let Some(pos) = pos.as_ref().filter(|_| *moved) else {
                continue;
            };
            let json = serde_json::to_string(pos)
                .map_err(|e| rusqlite::Error::ToSqlConversionFailure(Box::new(e)))?;
            tx.prepare_cached(SQL_SET_STATE)?
                .execute(params![replay_key(stream), json, now_ms])?;
        }
        if self.already > 0 {
            tx.execute(
                SQL_COUNTER_ADD,
                params!["replay_rows_already_spooled", self.already],
            )?;
        }
        Ok(())
    }
}

/// `agent_state` key of a replayed stream's position.
pub(super) fn replay_key(stream: &str) -> String {
    format!("replay_position.{stream}")
}

/// The position stored for `stream`; a value that does not parse (written
/// by hand, or by a later version) counts as none, with a warning.
pub(super) fn load_replay_position(
    conn: &Connection,
    stream: &str,
) -> rusqlite::Result<Option<ReplayPosition>> {
    let text: Option<String> = conn
        .prepare_cached(SQL_GET_STATE)?
        .query_row(params![replay_key(stream)], |r| r.get(0))
        .optional()?;
    Ok(text.and_then(|t| match serde_json::from_str(&t) {
        Ok(p) => Some(p),
        Err(e) => {
            log::warn!("stream {stream}: stored replay position unreadable ({e}); ignored");
            None
        }
    }))
}

/// Append one event inside the caller's transaction `tx`, reading and
/// advancing its stream's sequence in the `streams` table at once (not the ingest
/// connection's cache: used for streams only one other connection writes,
/// such as command results). Returns the event id (stored as its text).
pub(crate) fn insert_one(
    tx: &rusqlite::Transaction<'_>,
    path: &Path,
    ev: &NewEvent,
    ids: &mut EventIdGen,
    device_id: &str,
    format: Format,
    now_ms: i64,
) -> Result<EventId, SpoolError> {
    let err = |e| SpoolError::classify(path, e);
    let prio = crate::event::stream::fallback_priority(&ev.stream);
    let stream = stream_row(tx, &ev.stream, prio).map_err(err)?;
    let seq = stream.last_seq + 1;
    let event_id = ids.next_id();
    let env = Envelope {
        event_id,
        device_id,
        stream: &ev.stream,
        seq: seq as u64,
        ts_ms: ev.ts_ms,
        clock_trusted: ev.clock_trusted,
        mono: ev.mono.as_deref().copied(),
        fields: &ev.fields,
    };
    let payload = envelope::encode(format, &env).map_err(|e| SpoolError::Encode {
        path: path.to_path_buf(),
        detail: e,
    })?;
    let digest = Sha256::digest(&payload);
    tx.prepare_cached(SQL_INSERT_EVENT)
        .map_err(err)?
        .execute(params![
            stream.id,
            seq,
            // The id is in the payload: not stored twice (schema 12).
            "",
            now_ms,
            digest.as_slice(),
            payload,
            stream.prio
        ])
        .map_err(err)?;
    tx.prepare_cached(SQL_SET_SEQ)
        .map_err(err)?
        .execute(params![stream.id, seq])
        .map_err(err)?;
    Ok(event_id)
}

impl Spool {
    /// Append `events` in one IMMEDIATE transaction: each gets the next
    /// sequence number of its stream, an event id (fresh, derived from its
    /// replay position, or for a keyed reading from its key and payload,
    /// see [`NewEvent::key`]), its payload encoded once, and a sha256
    /// digest of that payload. All or nothing. The transaction writes the new rows
    /// only (plus a `streams` row the first time a stream appears, and the
    /// replay position of each replayed stream, see [`NewEvent::replay`]):
    /// sequence numbers reach `streams` through [`Spool::persist_seqs`].
    ///
    /// Returns the number of rows appended. Errors: classified SQLite errors
    /// (nothing is appended); an event whose encoding fails is skipped and
    /// counted under `readings_unencodable`; a replayed row already in the
    /// spool is skipped and counted under `replay_rows_already_spooled`.
    pub fn append(
        &mut self,
        events: &[NewEvent],
        ids: &mut EventIdGen,
        device_id: &str,
        format: Format,
        now_ms: i64,
    ) -> Result<usize, SpoolError> {
        let riders = Riders::default();
        self.append_riding(events, ids, (device_id, format), now_ms, &riders)
            .map(|(rows, _)| rows)
    }

    /// [`Spool::append`] with `riders` written in the same transaction
    /// ([`Riders`]): counters, agent state, delivery records and the
    /// sequence book, none of which then needs a commit of its own. The
    /// sequence book also rides when [`PERSIST_SEQS_EVERY`] rows were
    /// appended since it was last written. `events` may be empty (the
    /// riders alone). Returns the rows appended and what the riders did;
    /// on an error nothing of either is stored.
    pub fn append_riding(
        &mut self,
        events: &[NewEvent],
        ids: &mut EventIdGen,
        (device_id, format): (&str, Format),
        now_ms: i64,
        riders: &Riders<'_>,
    ) -> Result<(usize, Rode), SpoolError> {
        let path = self.path.clone();
        let err = |e| SpoolError::classify(&path, e);
        let seqs = self.seqs.clone();
        let key_secret = self.key_secret;
        let mut book = seqs.lock().unwrap_or_else(|p| p.into_inner());
        let mut issued = Issued::default();
        // What each reading's producer is told after the commit.
        let mut outcomes: Vec<Option<Told>> = vec![None; events.len()];
        // Bounds what the next open reads to catch up, whoever appends.
        let riders = Riders {
            seqs: riders.seqs
                || book.appended_since_persist + events.len() as u64 >= PERSIST_SEQS_EVERY,
            ..*riders
        };
        let tx = self
            .conn
            .transaction_with_behavior(TransactionBehavior::Immediate)
            .map_err(err)?;
        let first_new = match riders.clock {
            Some(_) => super::clock_spans::next_id(&tx).map_err(err)?,
            None => 0,
        };
        let rode = {
            let mut insert = tx.prepare_cached(SQL_INSERT_EVENT).map_err(err)?;
            let mut to = Target {
                tx: &tx,
                insert: &mut insert,
                device_id,
                format,
                now_ms,
                path: &path,
                key_secret: &key_secret,
            };
            for (ev, outcome) in events.iter().zip(outcomes.iter_mut()) {
                *outcome = issued.row(&mut to, &book, ev, ids)?;
            }
            issued.store(&tx, now_ms).map_err(err)?;
            if let Some(clock) = riders.clock {
                let rows = (self.seen_through + 1, first_new, issued.appended);
                super::clock_spans::note(&tx, &err, clock, now_ms, rows)?;
            }
            super::riders::ride(&tx, &err, &riders, (&book, &issued.next), now_ms)?
        };
        tx.commit().map_err(err)?;
        if riders.clock.is_some() {
            self.seen_through = first_new - 1 + issued.appended as i64;
        }
        let synced = self.pragmas.synchronous >= 2;
        for (ev, outcome) in events.iter().zip(outcomes) {
            if let (Some(reply), Some(outcome)) = (&ev.reply, outcome) {
                reply.send(outcome.map(|event_id| Committed { event_id, synced }));
            }
        }
        let appended = issued.appended;
        book.dirty |= !issued.next.is_empty();
        book.appended_since_persist += appended as u64;
        book.streams.extend(issued.next);
        if rode.seqs {
            book.dirty = false;
            book.appended_since_persist = 0;
        }
        Ok((appended, rode))
    }

    /// The replay position stored with the last row appended to `stream`
    /// (see [`NewEvent::replay`]), if any.
    ///
    /// # Errors
    ///
    /// Classified SQLite errors.
    pub fn replay_position(&self, stream: &str) -> Result<Option<ReplayPosition>, SpoolError> {
        load_replay_position(&self.conn, stream).map_err(|e| self.err(e))
    }
}
