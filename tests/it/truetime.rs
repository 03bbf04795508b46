//! True time on boards without an RTC (issue 34 item 5), against the real
//! agent, a real mosquitto and the real sinks (SQLite and PostgreSQL): the
//! agent's wall clock stepped by hours both ways (and to 1972) by
//! libfaketime, the kernel's "synchronized" answer (adjtimex's maximum
//! error, which the agent reads) played by `EDGESPOOL_CLOCK_SYNC_FILE`, the
//! monotonic clock left alone (NTP steps `CLOCK_REALTIME` only).
//!
//! True time of a reading is known here without trusting the agent: the
//! test reads the real wall clock and `CLOCK_BOOTTIME` itself (it runs
//! without libfaketime), and a reading's true time is that offset plus the
//! `mono_ms` it carries. Every reading an anchor moves is moved by the same
//! amount (the anchor's wall less its monotonic time), so the error is the
//! gap between the agent's two clock reads for its anchor and this test's
//! two reads: [`TOLERANCE_MS`] allows a preemption of a loaded 2-core
//! machine between them, and the tests print what they measured.

use crate::support::agent::AgentProc;
use crate::support::board::{edit_config, write_config};
use crate::support::broker::Broker;
use crate::support::faketime::{self, FakeClock};
use crate::support::postgres::Postgres;
use crate::support::proxy::{Mode, Proxy};
use crate::support::sink::{SinkProc, BROKER_EXTRA};
use crate::support::subscriber::Subscriber;
use crate::support::{tail, unique_suffix, wait_for};
use edgespool::event::clock::{Anchor, BootId, MonoStamp, CLOCK_STREAM};
use edgespool::event::envelope::{encode, read_compact, Envelope, EventId, Format};
use edgespool::event::reading::FieldValue;
use rumqttc::{Client, Event, Incoming, MqttOptions, QoS};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

const HOUR: i64 = 3_600_000;

/// How far a corrected time may be from true time, ms (see the module doc).
const TOLERANCE_MS: i64 = 250;

/// The agent's wall clock in 1972: 1.7 billion seconds back, before the
/// clock floor, so its readings are flagged `clock_trusted: false` (a board
/// that booted in 1970 and has run a while).
const BEFORE_FLOOR_S: i64 = 1_700_000_000;

/// The real wall clock less `CLOCK_BOOTTIME`, ms: a boot's start in true
/// time, read by this (unfaked) process. Of a few tries, the one whose
/// wall read lies in the narrowest `CLOCK_BOOTTIME` window, so a preemption
/// between the reads does not move true time.
fn true_offset_ms() -> i64 {
    let boottime = || edgespool::os::clock::boottime_ms().expect("CLOCK_BOOTTIME") as i64;
    (0..20)
        .map(|_| {
            let before = boottime();
            let wall = edgespool::event::envelope::wall_clock_ms().0;
            let after = boottime();
            (after - before, wall - (before + after) / 2)
        })
        .min()
        .map(|(_, offset)| offset)
        .expect("tries")
}

/// One stored event as a store's columns give it.
#[derive(Debug, Clone, PartialEq)]
struct Stored {
    stream: String,
    ts_ms: i64,
    boot_id: Option<String>,
    mono_ms: Option<i64>,
    corrected: Option<i64>,
    payload: Vec<u8>,
}

/// Events of `device` in the sink's SQLite file, by event id.
fn from_sqlite(db: &Path, device: &str) -> BTreeMap<String, Stored> {
    let Ok(c) =
        rusqlite::Connection::open_with_flags(db, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)
    else {
        return BTreeMap::new();
    };
    let _ = c.busy_timeout(Duration::from_secs(5));
    let Ok(mut st) = c.prepare(
        "SELECT event_id, stream, ts_ms, boot_id, mono_ms, ts_corrected_ms, payload
         FROM received WHERE device_id = ?1",
    ) else {
        return BTreeMap::new();
    };
    st.query_map([device], |r| {
        Ok((
            r.get::<_, String>(0)?,
            Stored {
                stream: r.get(1)?,
                ts_ms: r.get(2)?,
                boot_id: r.get(3)?,
                mono_ms: r.get(4)?,
                corrected: r.get(5)?,
                payload: r.get(6)?,
            },
        ))
    })
    .and_then(|rows| rows.collect())
    .unwrap_or_default()
}

/// Events of `device` in the PostgreSQL store, by event id (boot ids in
/// the 32-digit form, as SQLite keeps them).
fn from_postgres(pg: &mut postgres::Client, device: &str) -> BTreeMap<String, Stored> {
    let Ok(rows) = pg.query(
        "SELECT event_id::text, stream, ts_ms, replace(boot_id::text, '-', ''), mono_ms,
                ts_corrected_ms, payload
         FROM events WHERE device_id = $1",
        &[&device],
    ) else {
        return BTreeMap::new();
    };
    rows.iter()
        .map(|r| {
            (
                r.get(0),
                Stored {
                    stream: r.get(1),
                    ts_ms: r.get(2),
                    boot_id: r.get(3),
                    mono_ms: r.get(4),
                    corrected: r.get(5),
                    payload: r.get(6),
                },
            )
        })
        .collect()
}

/// Publish `msgs` (topic, payload) at QoS 1 and wait for every PUBACK.
fn publish(port: u16, msgs: &[(String, Vec<u8>)]) {
    let mut o = MqttOptions::new(format!("tt-pub-{}", unique_suffix()), "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(10));
    let (client, mut conn) = Client::new(o, 100);
    for (t, p) in msgs {
        client
            .publish(t.as_str(), QoS::AtLeastOnce, false, p.clone())
            .expect("queue a publish");
    }
    let mut acked = 0;
    for ev in conn.iter() {
        match ev {
            Ok(Event::Incoming(Incoming::PubAck(_))) => {
                acked += 1;
                if acked == msgs.len() {
                    break;
                }
            }
            Ok(_) => {}
            Err(e) => panic!("publisher: {e}"),
        }
    }
    let _ = client.disconnect();
}

/// An envelope of `device` on `stream` with id `n`, in `format`.
#[allow(clippy::too_many_arguments)]
fn envelope(
    format: Format,
    device: &str,
    stream: &str,
    n: u8,
    ts_ms: i64,
    trusted: bool,
    mono: Option<MonoStamp>,
    fields: &[(String, FieldValue)],
) -> Vec<u8> {
    let fields = fields.to_vec();
    encode(
        format,
        &Envelope {
            event_id: EventId([0xe0, n, 0, 0, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, n]),
            device_id: device,
            stream,
            seq: u64::from(n),
            ts_ms,
            clock_trusted: trusted,
            mono,
            fields: &fields,
        },
    )
    .expect("encode")
}

/// A clock anchor whose fields say `fields_at`, in an envelope carrying `at`.
fn anchor(device: &str, n: u8, at: MonoStamp, fields_at: MonoStamp, wall_ms: i64) -> Vec<u8> {
    let f = Anchor {
        at: fields_at,
        wall_ms,
    }
    .fields(1000);
    envelope(
        Format::Json,
        device,
        CLOCK_STREAM,
        n,
        wall_ms,
        true,
        Some(at),
        &f,
    )
}

/// A `system` reading as the agent sent it.
#[derive(Debug, Clone)]
struct Sent {
    payload: Vec<u8>,
    /// As the envelope says.
    ts_ms: i64,
    /// The stamp's, if any.
    mono_ms: Option<u64>,
}

/// The bytes a postcard payload's clock stamp adds to it, and those the
/// same stamp adds to the event's JSON form: each form encoded again with
/// and without the stamp (the first must give the payload's own bytes).
fn stamp_bytes(payload: &[u8]) -> (usize, usize) {
    let (c, mono) = read_compact(payload).expect("postcard");
    let form = |format, mono| {
        encode(
            format,
            &Envelope {
                event_id: EventId(c.event_id),
                device_id: &c.device_id,
                stream: &c.stream,
                seq: c.seq,
                ts_ms: c.ts_ms,
                clock_trusted: c.clock_trusted,
                mono,
                fields: &c.fields,
            },
        )
        .expect("encode")
    };
    assert_eq!(form(Format::Postcard, mono), payload, "encoded again");
    let len = |format| form(format, mono).len() - form(format, None).len();
    (len(Format::Postcard), len(Format::Json))
}

/// A board whose clock libfaketime steps, the kernel's answer in a file,
/// its link to the broker through a proxy (an outage that leaves the
/// sinks' subscriptions in place), and two sinks (SQLite, PostgreSQL)
/// subscribed to its events.
struct Rig {
    /// Kept for the server's life.
    _pg: Postgres,
    db: postgres::Client,
    broker: Broker,
    /// The board's way to the broker.
    link: Proxy,
    /// What the broker forwards of the board's events.
    wire: Subscriber,
    /// [`Rig::readings`] so far.
    seen: RefCell<BTreeMap<String, Sent>>,
    dir: tempfile::TempDir,
    sqlite: std::path::PathBuf,
    lite: SinkProc,
    fleet: SinkProc,
    cfg: std::path::PathBuf,
    /// The board's wall clock; `sync` holds what the kernel says of it.
    clock: FakeClock,
    sync: std::path::PathBuf,
    prefix: String,
    /// True time less `CLOCK_BOOTTIME`, read by this process.
    offset: i64,
}

const DEVICE: &str = "it-board";

impl Rig {
    /// The sinks subscribed, the board's config (a `system` reading every
    /// 200 ms, postcard), its clock 3 h behind and not synchronized.
    fn new(name: &str) -> Rig {
        let pg = Postgres::start(&[("fsync", "off")]);
        let broker = Broker::start_with_options(BROKER_EXTRA, false);
        let dir = tempfile::tempdir().expect("tempdir");
        let base = crate::prefix(name);
        let prefix = format!("{base}/{DEVICE}");
        let filter = format!("{base}/+/events/#");
        let sqlite = dir.path().join("sink.db");
        let lite = SinkProc::spawn_sqlite(broker.port(), &filter, &sqlite, "tt-lite", dir.path());
        let fleet = SinkProc::spawn(
            broker.port(),
            &filter,
            &pg.conninfo(),
            "tt-pg",
            "tt",
            dir.path(),
        );
        lite.wait_subscribed();
        fleet.wait_subscribed();
        let db = pg.client();
        let link = Proxy::start(broker.port());
        let wire = Subscriber::events(broker.port(), &prefix);
        let cfg = write_config(dir.path(), &link.url(), &prefix, 200);
        edit_config(&cfg, |t| {
            t.replacen("[mqtt]\n", "[mqtt]\npayload_format = \"postcard\"\n", 1)
        });
        let sync = dir.path().join("sync");
        let clock = FakeClock::new(dir.path().join("faketime"), "-10800").with_sync_file(&sync);
        std::fs::write(&sync, "unsynchronized\n").expect("sync file");
        Rig {
            _pg: pg,
            db,
            broker,
            link,
            wire,
            seen: RefCell::new(BTreeMap::new()),
            dir,
            sqlite,
            lite,
            fleet,
            cfg,
            clock,
            sync,
            prefix,
            offset: true_offset_ms(),
        }
    }

    fn spawn_agent(&self) -> AgentProc {
        AgentProc::spawn_with_env(&self.cfg, &[], self.dir.path(), &self.clock.env())
    }

    /// Every `system` reading the agent has made so far, by event id:
    /// payload, `ts_ms` and the stamp's `mono_ms` (postcard, read as the
    /// sink reads it). Gathered from the spool and from the wire, and kept:
    /// retention deletes an acknowledged row appended by a clock in 1972 at
    /// its next pass (its age is judged by that clock), and the wire sees
    /// nothing during an outage. One id with two payloads fails the test.
    fn readings(&self) -> BTreeMap<String, Sent> {
        let mut seen = self.seen.borrow_mut();
        let wire = self
            .wire
            .deliveries()
            .into_iter()
            .filter(|d| d.topic.ends_with("/events/system"))
            .map(|d| {
                let (c, _) = read_compact(&d.payload).expect("a postcard envelope");
                (EventId(c.event_id).hyphenated(), d.payload)
            });
        for (id, payload) in self.spooled().into_iter().chain(wire) {
            let (c, mono) = read_compact(&payload).expect("a postcard envelope");
            let got = Sent {
                payload,
                ts_ms: c.ts_ms,
                mono_ms: mono.map(|m| m.mono_ms),
            };
            let known = seen.entry(id.clone()).or_insert_with(|| got.clone());
            assert_eq!(known.payload, got.payload, "{id}: one id, two payloads");
        }
        seen.clone()
    }

    /// The spool's rows of `system` now: event id and payload.
    fn spooled(&self) -> Vec<(String, Vec<u8>)> {
        let flags = rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY;
        let Ok(c) = rusqlite::Connection::open_with_flags(self.dir.path().join("spool.db"), flags)
        else {
            return Vec::new();
        };
        let _ = c.busy_timeout(Duration::from_secs(5));
        // Before the agent made its schema: nothing yet.
        let Ok(mut st) =
            c.prepare("SELECT event_id, payload FROM event_states WHERE stream = 'system'")
        else {
            return Vec::new();
        };
        st.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(|rows| rows.collect())
            .unwrap_or_default()
    }

    /// Stamped readings taken with the clock `off_ms` from true time
    /// (within a minute; true time from their stamp).
    fn taken_off_by(&self, off_ms: i64) -> usize {
        self.readings()
            .values()
            .filter(|r| {
                r.mono_ms
                    .is_some_and(|m| (r.ts_ms - self.offset - m as i64 - off_ms).abs() < 60_000)
            })
            .count()
    }

    /// Readings 3 h behind, 3 h ahead, in 1972, then right but not yet
    /// vouched for; then the kernel says synchronized and the agent appends
    /// its anchor. Each step waits for the readings of the one before.
    fn play_the_clock(&self, agent: &mut AgentProc) {
        let before_floor = format!("-{BEFORE_FLOOR_S}");
        // How far off the readings of each phase are, and the next step.
        let phases = [
            (-3 * HOUR, Some("+10800")),
            (3 * HOUR, Some(before_floor.as_str())),
            (-BEFORE_FLOOR_S * 1000, Some("+0")),
            (0, None),
        ];
        for (off_ms, next) in phases {
            assert!(
                wait_for(Duration::from_secs(60), || self.taken_off_by(off_ms) >= 8),
                "readings {off_ms} ms off: {}\n{}",
                self.taken_off_by(off_ms),
                agent.log_tail(30)
            );
            if let Some(next) = next {
                self.clock.step(next);
            }
        }
        std::fs::write(&self.sync, "synchronized\n").expect("sync file");
        assert!(
            wait_for(Duration::from_secs(60), || agent
                .log_text()
                .contains("anchor for boot")),
            "no anchor:\n{}",
            agent.log_tail(30)
        );
    }

    /// Wait until both stores hold the anchor, every reading taken off by
    /// hours has its corrected time, and readings taken after the sync
    /// (no stamp) have arrived; stop the agent and check both stores
    /// against the spool and true time. Returns the worst error and the
    /// readings moved.
    fn settle_and_check(&mut self, mut agent: AgentProc) -> (i64, usize) {
        let offset = self.offset;
        let settled = |s: &BTreeMap<String, Stored>| {
            let system = || s.values().filter(|e| e.stream == "system");
            s.values().any(|e| e.stream == CLOCK_STREAM)
                && system().filter(|e| e.mono_ms.is_none()).count() >= 3
                && system().filter(|e| e.mono_ms.is_some()).all(|e| {
                    (e.ts_ms - offset - e.mono_ms.unwrap_or(0)).abs() < HOUR
                        || e.corrected.is_some()
                })
        };
        let sqlite = self.sqlite.clone();
        assert!(
            wait_for(Duration::from_secs(90), || settled(&from_sqlite(
                &sqlite, DEVICE
            )) && settled(&from_postgres(
                &mut self.db,
                DEVICE
            ))),
            "corrections not in both stores\n{}\n{}\n{}",
            agent.log_tail(30),
            tail(&self.lite.log_text(), 20),
            tail(&self.fleet.log_text(), 20)
        );
        agent.terminate(Duration::from_secs(15));
        // What the agent sent before it stopped reaches both stores.
        assert!(
            wait_for(Duration::from_secs(30), || {
                let (a, b) = (
                    from_sqlite(&sqlite, DEVICE),
                    from_postgres(&mut self.db, DEVICE),
                );
                a.keys().eq(b.keys())
            }),
            "the stores hold different events"
        );
        let sent = self.readings();
        let boot = edgespool::os::clock::boot_id().expect("boot id");
        let lite = from_sqlite(&sqlite, DEVICE);
        let mut worst_ms = 0;
        let mut errors = std::collections::BTreeSet::new();
        let mut added = std::collections::BTreeSet::new();
        let (mut moved, mut stamped_right, mut unstamped) = (0, 0, 0);
        for (id, s) in lite.iter().filter(|(_, s)| s.stream == "system") {
            assert_eq!(
                sent.get(id).map(|r| &r.payload),
                Some(&s.payload),
                "{id}: the payload is the bytes sent"
            );
            let Some(mono) = s.mono_ms else {
                // Taken after the sync: right as sent.
                unstamped += 1;
                assert!(s.corrected.is_none());
                continue;
            };
            assert_eq!(s.boot_id.as_deref(), Some(boot.simple().as_str()));
            added.insert(stamp_bytes(&s.payload));
            let truth = offset + mono;
            match s.corrected {
                Some(t) => {
                    moved += 1;
                    assert!(
                        (s.ts_ms - truth).abs() > 2 * HOUR,
                        "{id}: moved, yet it was right"
                    );
                    worst_ms = worst_ms.max((t - truth).abs());
                    errors.insert(t - truth);
                }
                None => {
                    stamped_right += 1;
                    assert!(
                        (s.ts_ms - truth).abs() <= 1000,
                        "{id}: off, yet not moved: {s:?}"
                    );
                }
            }
        }
        println!(
            "true time: {moved} readings moved (corrected - true: {errors:?} ms), \
             {stamped_right} stamped readings already right, {unstamped} unstamped after \
             the sync; bytes a stamp adds (postcard, JSON): {added:?}"
        );
        assert!(moved >= 24, "{moved}");
        assert!(
            worst_ms <= TOLERANCE_MS,
            "corrected time {worst_ms} ms from true time"
        );
        assert!(stamped_right >= 1, "no reading right before the sync");
        assert!(unstamped >= 3, "no reading after the sync");
        let fleet = from_postgres(&mut self.db, DEVICE);
        for (id, s) in &lite {
            assert_eq!(fleet.get(id), Some(s), "{id} differs between the stores");
        }
        (worst_ms, moved)
    }
}

/// Readings taken while the clock was 3 h behind, then 3 h ahead, then in
/// 1972, then right but not yet vouched for, delivered as they are taken:
/// once the kernel says synchronized, the anchor moves them in both stores
/// (each within [`TOLERANCE_MS`] of true time, the payloads byte for byte
/// as sent, nothing else moved). Then old envelopes (no stamp) still store, and
/// anchors of another boot, of years ago or ahead, or contradicting the
/// believed one are kept aside with their reasons and move nothing.
#[test]
fn readings_taken_with_the_clock_hours_off_are_stored_with_true_time_once_the_board_syncs() {
    if !faketime::reaches_the_agent() {
        return;
    }
    let mut rig = Rig::new("truetime");
    let mut agent = rig.spawn_agent();
    rig.play_the_clock(&mut agent);
    rig.settle_and_check(agent);
    bad_anchors_and_old_envelopes(&mut rig);
}

/// The board cannot reach the broker while its clock is off and while it
/// syncs (the sinks stay subscribed): once the link is back, its anchor
/// goes out before the backlog (the `_clock` stream has the agent's own
/// priority), so each sink corrects every reading at its insert, each
/// within [`TOLERANCE_MS`] of true time, payloads byte for byte as sent.
#[test]
fn after_an_outage_the_backlog_gets_true_time_from_the_anchor_sent_before_it() {
    if !faketime::reaches_the_agent() {
        return;
    }
    let mut rig = Rig::new("truetime-outage");
    rig.link.set_mode(Mode::Refuse);
    let mut agent = rig.spawn_agent();
    rig.play_the_clock(&mut agent);
    assert!(
        from_sqlite(&rig.sqlite, DEVICE).is_empty(),
        "the sink stored something during the outage"
    );
    rig.link.set_mode(Mode::Forward);
    rig.settle_and_check(agent);
    // In the SQLite sink's insert order (rowid), the anchor came first.
    let c = rusqlite::Connection::open(&rig.sqlite).expect("sink db");
    let first: String = c
        .query_row(
            "SELECT stream FROM received WHERE device_id = ?1 ORDER BY rowid LIMIT 1",
            [DEVICE],
            |r| r.get(0),
        )
        .expect("a first row");
    assert_eq!(
        first, CLOCK_STREAM,
        "the anchor is stored before the backlog"
    );
}

/// Bad anchors and old envelopes published as the board (see the first test).
fn bad_anchors_and_old_envelopes(rig: &mut Rig) {
    let device = DEVICE;
    let lite = from_sqlite(&rig.sqlite, device);
    let boot = edgespool::os::clock::boot_id().expect("boot id");
    let now = true_offset_ms() + edgespool::os::clock::boottime_ms().expect("boottime") as i64;
    let stamp = |b: BootId, mono_ms| MonoStamp {
        boot_id: b,
        mono_ms,
    };
    let (b2, b3) = (BootId([0xb2; 16]), BootId([0xb3; 16]));
    let this = edgespool::os::clock::boottime_ms().expect("boottime");
    let prefix = rig.prefix.clone();
    let clock_topic = format!("{prefix}/events/{CLOCK_STREAM}");
    let legacy_topic = format!("{prefix}/events/legacy");
    let x = vec![("x".to_owned(), FieldValue::Num(1.0))];
    let legacy = |n, ts, mono, format| envelope(format, device, "legacy", n, ts, false, mono, &x);
    let msgs = vec![
        // Fields of boot b2 in an envelope of this boot.
        (
            clock_topic.clone(),
            anchor(device, 1, stamp(boot, this), stamp(b2, this), now),
        ),
        // A boot that began in 1999; a wall time two days ahead.
        (
            clock_topic.clone(),
            anchor(device, 2, stamp(b2, 1000), stamp(b2, 1000), 946_684_801_000),
        ),
        (
            clock_topic.clone(),
            anchor(device, 3, stamp(b3, 1000), stamp(b3, 1000), now + 48 * HOUR),
        ),
        // This boot, 3 h from the anchor believed.
        (
            clock_topic.clone(),
            anchor(
                device,
                4,
                stamp(boot, this),
                stamp(boot, this),
                now + 3 * HOUR,
            ),
        ),
        // A reading of boot b2 taken in 1970: no believed anchor, not moved.
        (
            legacy_topic.clone(),
            legacy(5, 5, Some(stamp(b2, 500)), Format::Json),
        ),
        // Envelopes of before stamps, both formats.
        (legacy_topic.clone(), legacy(6, 7, None, Format::Json)),
        (legacy_topic.clone(), legacy(7, 8, None, Format::Postcard)),
    ];
    publish(rig.broker.port(), &msgs);
    let sqlite = rig.sqlite.clone();
    let refused_sqlite = || -> Vec<String> {
        let Ok(c) = rusqlite::Connection::open(&sqlite) else {
            return Vec::new();
        };
        c.prepare("SELECT reason FROM clock_refused ORDER BY rowid")
            .and_then(|mut st| st.query_map([], |r| r.get(0))?.collect())
            .unwrap_or_default()
    };
    let refused_pg = |db: &mut postgres::Client| -> Vec<String> {
        db.query("SELECT reason FROM clock_refused ORDER BY id", &[])
            .map(|rows| rows.iter().map(|r| r.get(0)).collect())
            .unwrap_or_default()
    };
    let db = &mut rig.db;
    assert!(
        wait_for(Duration::from_secs(30), || refused_sqlite().len() == 4
            && refused_pg(db).len() == 4
            && from_sqlite(&sqlite, device).len() == lite.len() + 7
            && from_postgres(db, device).len() == lite.len() + 7),
        "sqlite {:?}\npostgres {:?}\n{}",
        refused_sqlite(),
        refused_pg(db),
        tail(&rig.lite.log_text(), 20)
    );
    // The same four reasons in both stores (each names its own sink's clock).
    for reasons in [refused_pg(db), refused_sqlite()] {
        for want in [
            "another boot",
            "before 2020",
            "more than a day ahead",
            "contradicts",
        ] {
            let n = reasons.iter().filter(|r| r.contains(want)).count();
            assert_eq!(n, 1, "{want}: {reasons:?}");
        }
    }
    let after = from_sqlite(&sqlite, device);
    for (id, s) in &lite {
        assert_eq!(after.get(id), Some(s), "{id} moved by a refused anchor");
    }
    let legacy: Vec<&Stored> = after.values().filter(|s| s.stream == "legacy").collect();
    assert_eq!(legacy.len(), 3);
    assert!(legacy.iter().all(|s| s.corrected.is_none()), "{legacy:?}");
    let pg_anchors: i64 = db
        .query_one("SELECT count(*) FROM clock_anchors", &[])
        .expect("anchors")
        .get(0);
    assert_eq!(pg_anchors, 1, "one anchor believed");
}

/// The other order (a backlog after an outage, the anchor first): in
/// PostgreSQL a reading whose boot's anchor is already believed gets its
/// true time at its insert, by `COPY` and by `INSERT .. ON CONFLICT`
/// alike; one of another boot, or taken after the anchor, does not.
#[test]
fn a_reading_stored_after_its_boots_anchor_is_corrected_at_its_insert_in_postgres() {
    use edgespool::sink::batch::Item;
    use edgespool::sink::postgres::PgStore;
    use edgespool::sink::Store;
    let pg = Postgres::start(&[("fsync", "off")]);
    let mut store = PgStore::connect(&pg.conninfo(), "tt", &Default::default()).expect("connect");
    let now = edgespool::event::envelope::wall_clock_ms().0;
    let boot = BootId([0x5a; 16]);
    let at = |mono_ms| MonoStamp {
        boot_id: boot,
        mono_ms,
    };
    let topic = |s: &str| format!("tt/gw/events/{s}");
    let a = anchor("gw", 1, at(600_000), at(600_000), now);
    let s = store
        .commit(&[Item::new(&topic(CLOCK_STREAM), &a)], now)
        .expect("anchor");
    assert_eq!((s.stats.anchors, s.stats.corrected), (1, 0));
    let x = vec![("x".to_owned(), FieldValue::Num(1.0))];
    let reading = |n: u8, ts: i64, mono: Option<MonoStamp>| {
        let format = match n % 2 {
            0 => Format::Json,
            _ => Format::Postcard,
        };
        Item::new(
            &topic("s"),
            &envelope(format, "gw", "s", n, ts, true, mono, &x),
        )
    };
    let truth = |mono: i64| now - 600_000 + mono;
    // A first batch goes by COPY; after a key already stored, the next
    // ones by INSERT .. ON CONFLICT (the duplicate of 2 sends it there).
    let copy = [
        reading(2, truth(10_000) - 3 * HOUR, Some(at(10_000))),
        reading(3, truth(20_000) + 3 * HOUR, Some(at(20_000))),
    ];
    let careful = [
        reading(2, truth(10_000) - 3 * HOUR, Some(at(10_000))),
        reading(4, truth(30_000) + 5 * HOUR, Some(at(30_000))),
        reading(5, 9, Some(at(700_000))),
        reading(
            6,
            9,
            Some(MonoStamp {
                boot_id: BootId([0x5b; 16]),
                mono_ms: 30_000,
            }),
        ),
        reading(7, 9, None),
    ];
    let s = store.commit(&copy, now).expect("copy");
    assert_eq!((s.stats.first, s.stats.corrected), (2, 2));
    let s = store.commit(&careful, now).expect("careful");
    assert_eq!(
        (s.stats.first, s.stats.duplicates, s.stats.corrected),
        (4, 1, 1)
    );
    let mut db = pg.client();
    let got: Vec<(i64, Option<i64>)> = db
        .query(
            "SELECT seq, ts_corrected_ms FROM events WHERE stream = 's' ORDER BY seq",
            &[],
        )
        .expect("events")
        .iter()
        .map(|r| (r.get(0), r.get(1)))
        .collect();
    assert_eq!(
        got,
        vec![
            (2, Some(truth(10_000))),
            (3, Some(truth(20_000))),
            (4, Some(truth(30_000))),
            (5, None),
            (6, None),
            (7, None),
        ]
    );
}
