//! The sampler: one thread per source, each taking readings on its
//! interval and handing them to the ingest thread.
//!
//! Its one rule: **a source waits on its own deadline and its control
//! channel, never on a polling timer**, so an idle agent sleeps (one reading
//! a minute costs about one wakeup a minute here), and an `exec` program that
//! hangs until its timeout delays only its own source.

use crate::intake::budget::Budget;
use crate::intake::IngestMsg;
use crate::os::clock::Now;
use crate::os::threads::join_within;
use crate::source::replay::{DueRow, Replay, Resumed};
use crate::source::{self, SourceState};
use crate::spool::{NewEvent, Spool};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A change to the sampler's sources, applied live.
#[derive(Debug)]
pub enum SamplerUpdate {
    /// Replace every source.
    Sources(Vec<source::SourceSpec>),
    /// Change one source's interval.
    Interval(String, Duration),
    /// Stop every source and return.
    Stop,
}

/// One source's thread and its control channel (dropping the sender stops it).
struct SourceThread {
    name: String,
    interval: Sender<Duration>,
    handle: std::thread::JoinHandle<()>,
}

/// What a source thread hands its readings to: the ingest thread, and
/// the budget the bridges take room in for each message.
type Intake = (Sender<IngestMsg>, Arc<Budget>);

fn start_source(
    spec: source::SourceSpec,
    dir: PathBuf,
    spool: PathBuf,
    intake: Intake,
    global: Arc<AtomicBool>,
) -> Option<SourceThread> {
    let (interval, ctl) = mpsc::channel();
    let name = spec.name.clone();
    let handle = std::thread::Builder::new()
        .name(format!("source-{}", spec.name))
        .spawn(move || source_loop(spec, dir, spool, intake, ctl, global));
    match handle {
        Ok(handle) => Some(SourceThread {
            name,
            interval,
            handle,
        }),
        Err(e) => {
            log::error!("source {name}: cannot start its thread: {e}");
            None
        }
    }
}

/// Run one source on its interval until its control channel closes. A
/// failed sample is logged (once a minute) and counted in the log line,
/// never fatal.
fn source_loop(
    spec: source::SourceSpec,
    dir: PathBuf,
    spool: PathBuf,
    (tx, bridges): Intake,
    ctl: Receiver<Duration>,
    global: Arc<AtomicBool>,
) {
    if let source::SourceKind::Mqtt(b) = &spec.kind {
        // Readings arrive when local programs publish: no interval.
        return source::bridge::run(&spec.name, b, (tx, bridges), ctl, global);
    }
    let mut state = SourceState::default();
    let mut replay = None;
    if let source::SourceKind::Replay(r) = &spec.kind {
        match open_replay(r, &spec.name, &spool) {
            Ok(p) => replay = Some(p),
            // A followed file may be between a rotation's rename and create.
            Err(e) if r.follow => log::warn!(
                "source {}: {e}; tried again every {} ms",
                spec.name,
                spec.interval.as_millis()
            ),
            Err(e) => {
                log::error!(
                    "source {}: {e}; this source is off until the config changes",
                    spec.name
                );
                return;
            }
        }
    }
    let mut failures = 0u64;
    let mut last_log: Option<Instant> = None;
    let mut interval = spec.interval;
    let mut next = Instant::now();
    while !global.load(Ordering::Relaxed) {
        let now = Instant::now();
        if now >= next {
            // Fixed cadence; if we fell behind, skip missed slots rather than burst.
            next += interval;
            if next < now {
                next = now + interval;
            }
            let result = match (replay.as_mut(), &spec.kind) {
                (Some(r), _) => replay_due(r, &spec.name, now),
                // Only a followed file gets here: tried again every interval.
                (None, source::SourceKind::Replay(r)) => open_replay(r, &spec.name, &spool)
                    .and_then(|p| replay_due(replay.insert(p), &spec.name, now)),
                (None, _) => source::sample(&spec, &mut state, &dir).map(|f| vec![Due::Sampled(f)]),
            };
            match result {
                Ok(list) => {
                    let clock = crate::os::clock::reading_now();
                    for due in list.into_iter().filter(|d| !d.fields().is_empty()) {
                        let ev = due.into_event(&spec.name, clock);
                        if tx.send(IngestMsg::Reading(ev)).is_err() {
                            return;
                        }
                    }
                }
                Err(e) => {
                    failures += 1;
                    if last_log.is_none_or(|t| t.elapsed() > Duration::from_secs(60)) {
                        log::warn!("source {}: {e} ({failures} failures so far)", spec.name);
                        last_log = Some(Instant::now());
                    }
                }
            }
        }
        match ctl.recv_timeout(next.saturating_duration_since(Instant::now())) {
            Ok(d) => {
                // A new interval takes effect from the next reading.
                next = next.min(Instant::now() + d);
                interval = d;
            }
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => return,
        }
    }
}

/// Opens a replay and resumes it after the position the spool stored with
/// its last committed row (read on a read-only connection of its own).
/// An unreadable spool is logged and the replay starts from its first row:
/// rows it already holds are not appended twice ([`crate::spool::Spool::append`]).
fn open_replay(
    spec: &source::replay::ReplaySpec,
    name: &str,
    spool: &Path,
) -> Result<Replay, source::SourceError> {
    let mut replay = Replay::open(spec.clone())?;
    let saved = match Spool::open_read_only(spool).and_then(|s| s.replay_position(name)) {
        Ok(saved) => saved,
        Err(e) => {
            log::warn!("source {name}: cannot read its stored replay position ({e}); starting from the first row");
            None
        }
    };
    let what = spec.path.display();
    match replay.resume(saved)? {
        Resumed::Fresh => log::info!(
            "source {name}: replaying {what} (trace {}) from the first row",
            replay.trace_id()
        ),
        Resumed::After { lap, line } => log::info!(
            "source {name}: resuming {what} (trace {}) after line {line} of lap {lap}",
            replay.trace_id()
        ),
        Resumed::SkippedTo { lap, line, reached } => log::warn!(
            "source {name}: {what} changed under trace_id {:?}: {} line {line} of lap {lap}",
            replay.trace_id(),
            if reached { "skipped to just after" } else { "the file is shorter than the stored position, so that lap ended at" }
        ),
        Resumed::InRotated { lap, line, file } => log::info!(
            "source {name}: {what} was rotated while stopped: finishing segment {lap} in {} after line {line}, then the new file",
            file.display()
        ),
        Resumed::NextSegment { lap } => log::warn!(
            "source {name}: the file followed before is gone or was truncated: following {what} from its first row as segment {lap}"
        ),
        Resumed::NewTrace { was } => log::warn!(
            "source {name}: {what} is not the trace played before (stored identity {was}, now {}): playing it from the first row under new event ids; give the source a trace_id so that an edited or appended trace resumes by line instead",
            replay.trace_id()
        ),
    }
    Ok(replay)
}

/// One reading a source took.
#[derive(Debug)]
enum Due {
    /// Sampled now: its time is the wall clock's.
    Sampled(crate::event::reading::Fields),
    /// A replayed row: its time is the trace's.
    Replayed(DueRow),
}

impl Due {
    fn fields(&self) -> &crate::event::reading::Fields {
        match self {
            Due::Sampled(f) => f,
            Due::Replayed(r) => &r.fields,
        }
    }

    /// The reading for `stream`. A sampled one carries `clock`, the wall
    /// clock when it was taken (and where on the monotonic clock, while
    /// time sync has not vouched for it). A replayed row carries its
    /// own time ([`DueRow::ts_ms`]), marked trusted: it is the trace's
    /// time, not a reading of the board's clock (which may still be in
    /// 1970), and it comes out the same each time the row is read. The
    /// row's event id derives from its position and its payload, so a row
    /// read again after a rollback is the same bytes under the same id, or,
    /// if its `seq` or cells moved (a dropped row, a truncated file, a
    /// config change), a new event: never a second payload under one id.
    fn into_event(self, stream: &str, clock: Now) -> NewEvent {
        match self {
            Due::Sampled(fields) => {
                let mut ev = NewEvent::new(stream, clock.wall_ms, clock.trusted, fields);
                ev.mono = clock.mono.map(Box::new);
                ev
            }
            Due::Replayed(row) => {
                let mut ev = NewEvent::new(stream, row.ts_ms, true, row.fields);
                ev.replay = Some(row.position);
                ev
            }
        }
    }
}

fn replay_due(r: &mut Replay, name: &str, now: Instant) -> Result<Vec<Due>, source::SourceError> {
    let was_done = r.stats().finished;
    let res = r
        .due_rows(now)
        .map(|list| list.into_iter().map(Due::Replayed).collect());
    if !was_done && r.stats().finished {
        let st = r.stats();
        log::info!(
            "source {name}: replay finished: {} rows read, {} readings, {} cells skipped, {} rows skipped",
            st.rows_read, st.readings, st.cells_skipped, st.rows_skipped
        );
    }
    res
}

/// The sampler: starts one thread per source and applies live changes until
/// [`SamplerUpdate::Stop`]. `spool` is the spool file: its directory is the
/// one the system source reports free space of, and a replay source reads
/// its stored position from it at start (see [`Replay::resume`]). On stop it waits at most 2 s for the source
/// threads; one stuck in a program (until its own timeout) is left behind
/// rather than delaying the final commit. Readings go to `intake`'s sender;
/// a bridge takes room in its budget for each message it hands over.
pub fn run(
    sources: Vec<source::SourceSpec>,
    spool: PathBuf,
    intake: (Sender<IngestMsg>, Arc<Budget>),
    updates: Receiver<SamplerUpdate>,
    stop: Arc<AtomicBool>,
) {
    let dir = spool
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| ".".into());
    let start_all = |sources: Vec<source::SourceSpec>| -> Vec<SourceThread> {
        sources
            .into_iter()
            .filter_map(|s| {
                start_source(s, dir.clone(), spool.clone(), intake.clone(), stop.clone())
            })
            .collect()
    };
    let mut threads = start_all(sources);
    loop {
        match updates.recv() {
            Ok(SamplerUpdate::Sources(s)) => {
                // Dropping the old threads' senders stops them.
                threads = start_all(s);
            }
            Ok(SamplerUpdate::Interval(name, interval)) => {
                if let Some(t) = threads.iter().find(|t| t.name == name) {
                    let _ = t.interval.send(interval);
                }
            }
            Ok(SamplerUpdate::Stop) | Err(_) => break,
        }
    }
    let deadline = Instant::now() + Duration::from_secs(2);
    for t in threads {
        drop(t.interval);
        join_within(t.handle, deadline, &format!("source {}", t.name));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::envelope::{EventIdGen, Format};
    use crate::source::replay::ReplaySpec;
    use crate::spool::SpoolOptions;
    use std::collections::BTreeMap;

    /// A repeated 4-row trace (`ts,v`, epoch seconds 10 s apart).
    fn spec(path: &Path) -> ReplaySpec {
        ReplaySpec {
            path: path.to_path_buf(),
            delimiter: ',',
            decimal_comma: false,
            missing: Vec::new(),
            timestamp_columns: vec!["ts".to_owned()],
            timestamp_format: "%s".to_owned(),
            timezone: "UTC".to_owned(),
            trace_id: None,
            columns: Vec::new(),
            speed: 0.0,
            max_rows_per_call: 3,
            repeat: true,
            follow: false,
        }
    }

    /// The clock reading `(ms, trusted)`, stamped: a replayed row keeps
    /// its trace's time and no stamp whatever the board's clock says, so
    /// its bytes come out the same on every read.
    fn at((wall_ms, trusted): (i64, bool)) -> Now {
        Now {
            wall_ms,
            trusted,
            mono: Some(crate::event::clock::MonoStamp {
                boot_id: crate::event::clock::BootId([7; 16]),
                mono_ms: wall_ms.unsigned_abs() % 1_000_000,
            }),
        }
    }

    /// `calls` calls' worth of readings, as the source loop makes them
    /// with the wall clock reading `clock`, appended to `spool`.
    fn play(r: &mut Replay, spool: &Path, calls: usize, clock: (i64, bool)) {
        let mut s = Spool::open(spool, &SpoolOptions::default()).unwrap();
        let mut ids = EventIdGen::new().unwrap();
        for _ in 0..calls {
            let evs: Vec<NewEvent> = replay_due(r, "trace", Instant::now())
                .unwrap()
                .into_iter()
                .map(|d| d.into_event("trace", at(clock)))
                .collect();
            s.append(&evs, &mut ids, "dev", Format::Json, clock.0)
                .unwrap();
        }
    }

    /// Event id → payload of every row.
    fn payloads(spool: &Path) -> BTreeMap<String, Vec<u8>> {
        let s = Spool::open_read_only(spool).unwrap();
        let mut q = s
            .raw()
            .prepare("SELECT event_id, payload FROM event_states")
            .unwrap();
        let rows = q.query_map([], |r| Ok((r.get(0)?, r.get(1)?))).unwrap();
        rows.map(Result::unwrap).collect()
    }

    #[test]
    fn a_replay_resumed_after_a_rollback_sends_each_row_again_with_the_same_bytes() {
        let d = tempfile::tempdir().unwrap();
        let trace = d.path().join("trace.csv");
        let lines: String = (0..4)
            .map(|k| format!("{},{k}\n", 1_714_550_400 + 10 * k))
            .collect();
        std::fs::write(&trace, format!("ts,v\n{lines}")).unwrap();
        let (live, rolled) = (d.path().join("live.db"), d.path().join("rolled.db"));
        let mut r = open_replay(&spec(&trace), "trace", &live).unwrap();
        // Lap 0 and the start of lap 1 (its shift from the stored position).
        play(&mut r, &live, 2, (1, false));
        // The rollback: what the spool held then, without the commits after.
        std::fs::copy(&live, &rolled).unwrap();
        play(&mut r, &live, 3, (1_800_000_000_000, true));
        let mut again = open_replay(&spec(&trace), "trace", &rolled).unwrap();
        play(&mut again, &rolled, 3, (1_900_000_000_000, true));
        let (a, b) = (payloads(&live), payloads(&rolled));
        assert_eq!((a.len(), b.len()), (15, 15));
        assert_eq!(a, b, "the same rows, ids and bytes after the resume");
        for p in a.values() {
            let v: serde_json::Value = serde_json::from_slice(p).unwrap();
            assert_eq!(v["ts_ms"], v["fields"]["trace_ts_ms"], "{v}");
            assert_eq!(v["clock_trusted"], true);
        }
        // The third row of lap 3, shifted by three laps of 40 s.
        let last = a
            .values()
            .map(|p| serde_json::from_slice::<serde_json::Value>(p).unwrap())
            .max_by_key(|v| v["seq"].as_i64())
            .unwrap();
        assert_eq!(last["ts_ms"], (1_714_550_400i64 + 20 + 3 * 40) * 1000);
    }

    /// The event ids both spools hold with different payloads.
    fn two_payloads(live: &Path, rolled: &Path) -> Vec<String> {
        let (a, b) = (payloads(live), payloads(rolled));
        a.iter()
            .filter(|(id, p)| b.get(*id).is_some_and(|q| q != *p))
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// A replayed row the ingest thread dropped (buffer full, capacity,
    /// disk full: the replay is not told) shifts the seq of the rows after
    /// it; a rollback then reads it again, and the later rows come again
    /// with other seqs: under new ids, never a second payload under an old one.
    #[test]
    fn a_dropped_replay_row_then_a_rollback_gives_no_id_two_payloads() {
        let d = tempfile::tempdir().unwrap();
        let trace = d.path().join("trace.csv");
        let lines: String = (0..6)
            .map(|k| format!("{},{k}\n", 1_714_550_400 + 10 * k))
            .collect();
        std::fs::write(&trace, format!("ts,v\n{lines}")).unwrap();
        let (live, rolled) = (d.path().join("live.db"), d.path().join("rolled.db"));
        let mut sp = spec(&trace);
        sp.repeat = false;
        let mut r = open_replay(&sp, "trace", &live).unwrap();
        play(&mut r, &live, 1, (1, false)); // rows 1..3 committed
        std::fs::copy(&live, &rolled).unwrap(); // what a power cut rolls back to
        {
            // rows 4..6 read; row 4 refused by the ingest thread (dropped)
            let mut s = Spool::open(&live, &SpoolOptions::default()).unwrap();
            let mut ids = EventIdGen::new().unwrap();
            let evs: Vec<NewEvent> = replay_due(&mut r, "trace", Instant::now())
                .unwrap()
                .into_iter()
                .skip(1)
                .map(|d| d.into_event("trace", at((1, false))))
                .collect();
            s.append(&evs, &mut ids, "dev", Format::Json, 1).unwrap();
        }
        // After the rollback the replay resumes after row 3: rows 4..6 again.
        let mut again = open_replay(&sp, "trace", &rolled).unwrap();
        play(&mut again, &rolled, 1, (1, false));
        let two = two_payloads(&live, &rolled);
        assert!(two.is_empty(), "ids with two payloads: {two:?}");
    }

    /// A row rolled back and read again after `mqtt.payload_format`
    /// changed has other bytes, so another id (the id holds the payload).
    #[test]
    fn a_payload_format_change_then_a_rollback_gives_no_id_two_payloads() {
        let d = tempfile::tempdir().unwrap();
        let trace = d.path().join("trace.csv");
        std::fs::write(&trace, "ts,v\n1714550400,1\n1714550410,2\n").unwrap();
        let (live, rolled) = (d.path().join("live.db"), d.path().join("rolled.db"));
        let mut sp = spec(&trace);
        sp.repeat = false;
        let run = |db: &Path, format: Format| {
            let mut r = open_replay(&sp, "trace", db).unwrap();
            let mut s = Spool::open(db, &SpoolOptions::default()).unwrap();
            let mut ids = EventIdGen::new().unwrap();
            let evs: Vec<NewEvent> = replay_due(&mut r, "trace", Instant::now())
                .unwrap()
                .into_iter()
                .map(|d| d.into_event("trace", at((1, false))))
                .collect();
            s.append(&evs, &mut ids, "dev", format, 1).unwrap();
        };
        Spool::open(&live, &SpoolOptions::default()).unwrap();
        std::fs::copy(&live, &rolled).unwrap();
        run(&live, Format::Json);
        run(&rolled, Format::Postcard);
        let two = two_payloads(&live, &rolled);
        assert!(two.is_empty(), "ids with two payloads: {two:?}");
    }

    /// A followed file truncated in place (copytruncate) after rows that a
    /// rollback then undoes: the new segment's rows come again with other
    /// seqs, so under other ids (same inode, same head: same position ids).
    #[test]
    fn a_followed_file_truncated_then_rolled_back_gives_no_id_two_payloads() {
        let d = tempfile::tempdir().unwrap();
        let f = d.path().join("log.csv");
        let row = |k: i64| format!("{},{k}\n", 1_714_550_400 + 10 * k);
        std::fs::write(&f, format!("ts,v\n{}{}{}", row(1), row(2), row(3))).unwrap();
        let (live, rolled) = (d.path().join("live.db"), d.path().join("rolled.db"));
        let mut sp = spec(&f);
        sp.repeat = false;
        sp.follow = true;
        let mut r = open_replay(&sp, "trace", &live).unwrap();
        play(&mut r, &live, 1, (1, false));
        std::fs::copy(&live, &rolled).unwrap();
        {
            use std::io::Write;
            let mut w = std::fs::OpenOptions::new().append(true).open(&f).unwrap();
            w.write_all(format!("{}{}", row(4), row(5)).as_bytes())
                .unwrap();
        }
        play(&mut r, &live, 1, (1, false));
        // copytruncate: same inode, rewritten from its start.
        {
            use std::io::Write;
            let mut w = std::fs::OpenOptions::new()
                .write(true)
                .truncate(true)
                .open(&f)
                .unwrap();
            w.write_all(format!("ts,v\n{}{}", row(6), row(7)).as_bytes())
                .unwrap();
        }
        play(&mut r, &live, 2, (1, false));
        let mut again = open_replay(&sp, "trace", &rolled).unwrap();
        play(&mut again, &rolled, 2, (1, false));
        let two = two_payloads(&live, &rolled);
        assert!(two.is_empty(), "ids with two payloads: {two:?}");
    }
}
