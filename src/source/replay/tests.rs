//! Tests of a whole replay: open and `check`, rows and cells as played,
//! batching, pacing and repeat, quoting, resume and identity, and the real
//! UCI trace in `data/`. Tests of one job's pure helpers sit in its file.

use super::*;
use crate::event::reading::FieldValue;
use std::fs;
use std::path::{Path, PathBuf};

const HOUR_MS: f64 = 3_600_000.0;
/// 10/03/2004 18.00.00 UTC (`date -u -d '2004-03-10 18:00' +%s`).
const T0_MS: f64 = 1_078_941_600_000.0;

const HEADER: &str = "Date;Time;CO(GT);PT08.S1(CO);T;RH;;";

fn spec(path: &Path) -> ReplaySpec {
    ReplaySpec {
        path: path.to_path_buf(),
        delimiter: ';',
        decimal_comma: true,
        missing: vec!["-200".to_owned()],
        timestamp_columns: vec!["Date".to_owned(), "Time".to_owned()],
        timestamp_format: "%d/%m/%Y %H.%M.%S".to_owned(),
        timezone: "UTC".to_owned(),
        trace_id: None,
        columns: Vec::new(),
        speed: 0.0,
        max_rows_per_call: 1000,
        repeat: false,
        follow: false,
    }
}

/// Writes `lines` joined with `eol` (and a final `eol`) to a temp file.
fn trace(lines: &[&str], eol: &str) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("trace.csv");
    let mut text = lines.join(eol);
    text.push_str(eol);
    fs::write(&path, text).unwrap();
    (dir, path)
}

/// `n` hourly rows from 10/03/2004 18.00.00 with CO = row number.
fn hourly(n: usize) -> Vec<String> {
    let mut lines = vec![HEADER.to_owned()];
    for k in 0..n {
        let hour = 18 + k;
        let (day, hour) = (10 + hour / 24, hour % 24);
        lines.push(format!(
            "{day:02}/03/2004;{hour:02}.00.00;{k};1000;10,5;50;;"
        ));
    }
    lines
}

fn refs(lines: &[String]) -> Vec<&str> {
    lines.iter().map(String::as_str).collect()
}

/// Calls `due` with speed-0 semantics until finished.
fn drain(replay: &mut Replay) -> Vec<Fields> {
    let mut all = Vec::new();
    for _ in 0..100_000 {
        if replay.stats().finished {
            return all;
        }
        let batch = replay.due(Instant::now()).unwrap();
        assert!(batch.len() <= replay.spec.max_rows_per_call);
        all.extend(batch);
    }
    panic!("replay never finished");
}

fn num(fields: &Fields, name: &str) -> Option<f64> {
    fields
        .iter()
        .find(|(n, _)| n == name)
        .map(|(_, v)| match v {
            FieldValue::Num(x) => *x,
            other => panic!("{name}: {other:?}"),
        })
}

fn names(fields: &Fields) -> Vec<&str> {
    fields.iter().map(|(n, _)| n.as_str()).collect()
}

fn ts(fields: &Fields) -> f64 {
    num(fields, TRACE_TS_FIELD).unwrap()
}

// ---- open ----

#[test]
fn open_errors() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("nope.csv");
    assert!(matches!(
        Replay::open(spec(&missing)),
        Err(SourceError::Io { ref path, .. }) if *path == missing
    ));

    let (_d, path) = trace(&refs(&hourly(2)), "\r\n");
    let mut s = spec(&path);
    s.timestamp_format = "%d/%m/%Y %H.%M.%q".to_owned();
    let e = Replay::open(s).unwrap_err().to_string();
    assert!(e.contains("timestamp_format") && e.contains("%q"), "{e}");

    for change in [
        (|s: &mut ReplaySpec| s.speed = -1.0) as fn(&mut ReplaySpec),
        |s| s.speed = f64::NAN,
        |s| s.speed = f64::INFINITY,
        |s| s.max_rows_per_call = 0,
        |s| s.delimiter = ',',
        |s| s.timestamp_columns.clear(),
        |s| s.columns = vec![("T".into(), "t".into()), ("RH".into(), "t".into())],
        |s| s.columns = vec![("T".into(), TRACE_TS_FIELD.into())],
    ] {
        let mut s = spec(&path);
        change(&mut s);
        assert!(
            matches!(Replay::open(s.clone()), Err(SourceError::Parse { .. })),
            "{s:?}"
        );
    }

    let empty = dir.path().join("empty.csv");
    fs::write(&empty, "").unwrap();
    let e = Replay::open(spec(&empty)).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
}

#[test]
fn check_names_the_key_and_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let (key, msg) = check(&spec(&dir.path().join("nope.csv"))).unwrap_err();
    assert_eq!(key, "path");
    assert!(msg.contains("nope.csv"), "{msg}");
    let (_d, path) = trace(&refs(&hourly(1)), "\n");
    assert_eq!(check(&spec(&path)), Ok(()));
    let mut s = spec(&path);
    s.columns = vec![("NO2(GT)".into(), "no2".into())];
    let (key, msg) = check(&s).unwrap_err();
    assert_eq!(key, "columns");
    assert!(
        msg.contains("trace.csv") && msg.contains("NO2(GT)"),
        "{msg}"
    );
    let mut s = spec(&path);
    s.timestamp_columns = vec!["Datum".into()];
    assert_eq!(check(&s).unwrap_err().0, "timestamp_columns");
}

#[test]
fn unknown_column_is_named_with_the_headers() {
    let (_d, path) = trace(&refs(&hourly(2)), "\r\n");
    let mut s = spec(&path);
    s.columns = vec![
        ("T".into(), "temp_c".into()),
        ("NO2(GT)".into(), "no2".into()),
    ];
    match Replay::open(s) {
        Err(SourceError::Parse { what, detail }) => {
            assert_eq!(what, path.display().to_string());
            assert!(detail.contains("\"NO2(GT)\""), "{detail}");
            assert!(detail.contains("\"CO(GT)\", \"PT08.S1(CO)\""), "{detail}");
        }
        other => panic!("{other:?}"),
    }
    let mut s = spec(&path);
    s.timestamp_columns = vec!["Datum".into()];
    let e = Replay::open(s).unwrap_err().to_string();
    assert!(e.contains("\"Datum\""), "{e}");
}

// ---- rows and cells ----

#[test]
fn default_columns_are_sanitized_headers() {
    let (_d, path) = trace(&refs(&hourly(1)), "\r\n");
    let mut r = Replay::open(spec(&path)).unwrap();
    let rows = drain(&mut r);
    assert_eq!(rows.len(), 1);
    assert_eq!(
        rows[0],
        vec![
            (TRACE_TS_FIELD.to_owned(), FieldValue::Num(T0_MS)),
            ("co_gt".to_owned(), FieldValue::Num(0.0)),
            ("pt08_s1_co".to_owned(), FieldValue::Num(1000.0)),
            ("t".to_owned(), FieldValue::Num(10.5)),
            ("rh".to_owned(), FieldValue::Num(50.0)),
        ]
    );
}

#[test]
fn clashing_or_empty_sanitized_names_are_made_unique() {
    let (_d, path) = trace(
        &[
            "\u{feff}Date;Time;CO(GT);CO GT;(%);trace ts ms",
            "10/03/2004;18.00.00;1;2;3;4",
        ],
        "\n",
    );
    let mut r = Replay::open(spec(&path)).unwrap();
    let rows = drain(&mut r);
    assert_eq!(
        names(&rows[0]),
        ["trace_ts_ms", "co_gt", "co_gt_2", "col_5", "trace_ts_ms_2"]
    );
}

#[test]
fn selected_columns_in_configured_order() {
    let (_d, path) = trace(&refs(&hourly(2)), "\r\n");
    let mut s = spec(&path);
    s.columns = vec![
        ("RH".into(), "rh_pct".into()),
        (" CO(GT) ".into(), "co_mg_m3".into()),
    ];
    let mut r = Replay::open(s).unwrap();
    let rows = drain(&mut r);
    assert_eq!(rows.len(), 2);
    assert_eq!(
        rows[1],
        vec![
            (TRACE_TS_FIELD.to_owned(), FieldValue::Num(T0_MS + HOUR_MS)),
            ("rh_pct".to_owned(), FieldValue::Num(50.0)),
            ("co_mg_m3".to_owned(), FieldValue::Num(1.0)),
        ]
    );
}

#[test]
fn missing_sentinels_and_bad_cells_are_skipped() {
    let (_d, path) = trace(
        &[
            HEADER,
            "10/03/2004;18.00.00;-200;-200;-1,9;50;;", // 2 missing, T negative kept
            "10/03/2004;19.00.00;-200,0;1292; -200 ;-200,00;;", // all missing but PT08
            "10/03/2004;20.00.00;abc;1,2,3;;49;;",     // 2 garbage, 1 empty
            "10/03/2004;21.00.00;-200;-200,0;-200;-200;;", // all missing: row skipped
            "10/03/2004;22.00.00;2,6;-2000;-20;200;;", // near-sentinels are values
            "10/03/2004;23.00.00;1;2",                 // short line: T, RH missing
        ],
        "\r\n",
    );
    let mut s = spec(&path);
    s.missing = vec!["-200".into(), " NA ".into()];
    let mut r = Replay::open(s).unwrap();
    let rows = drain(&mut r);
    let got: Vec<Vec<&str>> = rows.iter().map(names).collect();
    assert_eq!(
        got,
        [
            vec!["trace_ts_ms", "t", "rh"],
            vec!["trace_ts_ms", "pt08_s1_co"],
            vec!["trace_ts_ms", "rh"],
            vec!["trace_ts_ms", "co_gt", "pt08_s1_co", "t", "rh"],
            vec!["trace_ts_ms", "co_gt", "pt08_s1_co"],
        ]
    );
    assert_eq!(num(&rows[0], "t"), Some(-1.9));
    assert_eq!(num(&rows[3], "pt08_s1_co"), Some(-2000.0));
    assert_eq!(num(&rows[3], "t"), Some(-20.0));
    assert_eq!(ts(&rows[3]), T0_MS + 4.0 * HOUR_MS);
    assert_eq!(
        *r.stats(),
        ReplayStats {
            rows_read: 6,
            readings: 5,
            cells_skipped: 2 + 3 + 3 + 4 + 2,
            rows_skipped: 1,
            finished: true,
        }
    );
}

#[test]
fn text_sentinel_matches_after_trim() {
    let (_d, path) = trace(&["Date;Time;A;B", "10/03/2004;18.00.00; NA ;n/a"], "\n");
    let mut s = spec(&path);
    s.missing = vec![" NA".into()];
    let mut r = Replay::open(s).unwrap();
    assert!(drain(&mut r).is_empty());
    // "NA" is a sentinel, "n/a" is garbage: both skipped cells.
    assert_eq!(r.stats().cells_skipped, 2);
    assert_eq!(r.stats().rows_skipped, 1);
}

#[test]
fn separator_rows_bad_timestamps_and_line_endings() {
    // Mixed CRLF / LF, blank lines, separator-only rows, bad and empty
    // timestamps, a final line without newline.
    let text = [
        HEADER,
        "10/03/2004;18.00.00;1;2;3;4;;\r",
        ";;;;;;;\r",
        "",
        "10/03/2004;19.00.00;1;2;3;4;;",
        "31/02/2004;19.00.00;1;2;3;4;;\r",
        ";20.00.00;1;2;3;4;;",
        "10/03/2004;;1;2;3;4;;",
        "10/03/2004;21.00.00",
        "   ;  ;;;;;;",
        "10/03/2004;22.00.00;5;;;;",
    ]
    .join("\n");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.csv");
    fs::write(&path, text).unwrap();
    let mut r = Replay::open(spec(&path)).unwrap();
    let rows = drain(&mut r);
    let stamps: Vec<f64> = rows.iter().map(ts).collect();
    assert_eq!(stamps, [T0_MS, T0_MS + HOUR_MS, T0_MS + 4.0 * HOUR_MS]);
    assert_eq!(num(&rows[2], "co_gt"), Some(5.0));
    assert_eq!(
        *r.stats(),
        ReplayStats {
            rows_read: 10,
            readings: 3,
            // "21.00.00" row: 4 cells absent; last row: 3 empty cells.
            cells_skipped: 4 + 3,
            rows_skipped: 7,
            finished: true,
        }
    );
    // Finished stays finished.
    assert!(r.due(Instant::now()).unwrap().is_empty());
    assert!(r.stats().finished);
}

#[test]
fn header_only_file_finishes_at_once() {
    let (_d, path) = trace(&[HEADER], "\r\n");
    let mut r = Replay::open(spec(&path)).unwrap();
    assert!(r.due(Instant::now()).unwrap().is_empty());
    assert!(r.stats().finished);
    assert_eq!(r.stats().rows_read, 0);
}

#[test]
fn lines_that_are_not_utf8_do_not_fail() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.csv");
    let mut data = format!("{HEADER}\r\n").into_bytes();
    data.extend(b"10/03/2004;18.00.00;\xff\xfe;7;;;;\r\n");
    fs::write(&path, data).unwrap();
    let mut r = Replay::open(spec(&path)).unwrap();
    let rows = drain(&mut r);
    assert_eq!(names(&rows[0]), ["trace_ts_ms", "pt08_s1_co"]);
    assert_eq!(r.stats().cells_skipped, 3);
}

// ---- batching, pacing, repeat ----

#[test]
fn max_rows_per_call_bounds_each_batch() {
    let (_d, path) = trace(&refs(&hourly(5)), "\r\n");
    let mut s = spec(&path);
    s.max_rows_per_call = 2;
    let mut r = Replay::open(s).unwrap();
    let now = Instant::now();
    let sizes: Vec<usize> = (0..4).map(|_| r.due(now).unwrap().len()).collect();
    // The 3rd call reads the last row and then the end of the file.
    assert_eq!(sizes, [2, 2, 1, 0]);
    assert!(r.stats().finished);
    assert_eq!(r.stats().readings, 5);
}

#[test]
fn speed_paces_rows_against_the_clock() {
    let (_d, path) = trace(&refs(&hourly(6)), "\r\n");
    let mut s = spec(&path);
    s.speed = 3600.0; // one hourly row per second
    let mut r = Replay::open(s).unwrap();
    let t0 = Instant::now();
    let ms = Duration::from_millis;
    let mut counts = Vec::new();
    for at in [0, 0, 500, 999, 1000, 1500, 3500, 3999] {
        counts.push(r.due(t0 + ms(at)).unwrap().len());
    }
    assert_eq!(counts, [1, 0, 0, 0, 1, 0, 2, 0]);
    assert!(!r.stats().finished);
    // Far behind: rows 4 and 5 at once, and the end is seen.
    let last = r.due(t0 + ms(60_000)).unwrap();
    assert_eq!(
        last.iter().map(ts).collect::<Vec<_>>(),
        [T0_MS + 4.0 * HOUR_MS, T0_MS + 5.0 * HOUR_MS]
    );
    assert!(r.stats().finished);
    assert_eq!(r.stats().readings, 6);
}

#[test]
fn a_row_due_far_ahead_is_noticed_once_and_plays_when_due() {
    // Row 2 is ten years after row 1: at 60x it is due in ~60 days.
    let mut lines = hourly(1);
    lines.push("10/03/2014;18.00.00;9;1000;10,5;50;;".to_owned());
    let (_d, path) = trace(&refs(&lines), "\n");
    let mut s = spec(&path);
    s.speed = 60.0;
    let mut r = Replay::open(s).unwrap();
    let t0 = Instant::now();
    assert_eq!(r.due(t0).unwrap().len(), 1);
    assert!(r.due(t0 + Duration::from_secs(1)).unwrap().is_empty());
    let waited = r.warned_wait.expect("the long wait was noticed");
    assert!(r.due(t0 + Duration::from_secs(2)).unwrap().is_empty());
    assert_eq!(r.warned_wait, Some(waited), "noticed once per row");
    let later = t0 + Duration::from_secs(61 * 24 * 3600);
    assert_eq!(r.due(later).unwrap().len(), 1);
}

#[test]
fn pacing_catch_up_respects_max_rows_per_call() {
    let (_d, path) = trace(&refs(&hourly(10)), "\n");
    let mut s = spec(&path);
    s.speed = 7200.0; // two rows per second
    s.max_rows_per_call = 3;
    let mut r = Replay::open(s).unwrap();
    let t0 = Instant::now();
    assert_eq!(r.due(t0).unwrap().len(), 1);
    // At 3 s rows 1..=6 are due: 3 now, 3 next, none after.
    let at = t0 + Duration::from_secs(3);
    let sizes: Vec<usize> = (0..3).map(|_| r.due(at).unwrap().len()).collect();
    assert_eq!(sizes, [3, 3, 0]);
    assert_eq!(r.stats().readings, 7);
    // The earliest instant may come before the first call's instant:
    // nothing is due before the start, nothing panics.
    assert!(r.due(t0).unwrap().is_empty());
}

#[test]
fn repeat_without_pacing_continues_the_timeline() {
    let (_d, path) = trace(&refs(&hourly(3)), "\r\n");
    let mut s = spec(&path);
    s.repeat = true;
    let mut r = Replay::open(s).unwrap();
    let now = Instant::now();
    let mut stamps = Vec::new();
    for _ in 0..3 {
        stamps.extend(r.due(now).unwrap().iter().map(ts));
    }
    let want: Vec<f64> = (0..stamps.len())
        .map(|k| T0_MS + HOUR_MS * k as f64)
        .collect();
    assert_eq!(stamps, want);
    // At most one reopen per call: 3 + 3 rows, then 3 per call.
    assert_eq!(stamps.len(), 6 + 3 + 3);
    assert!(!r.stats().finished);
    assert_eq!(r.stats().rows_read, 12);
}

#[test]
fn repeat_with_pacing_is_smooth_across_the_wrap() {
    let (_d, path) = trace(&refs(&hourly(3)), "\r\n");
    let mut s = spec(&path);
    s.speed = 3600.0;
    s.repeat = true;
    let mut r = Replay::open(s).unwrap();
    let t0 = Instant::now();
    let mut seen = Vec::new();
    for sec in 0..8 {
        let batch = r.due(t0 + Duration::from_secs(sec)).unwrap();
        assert_eq!(batch.len(), 1, "at {sec} s");
        seen.push(ts(&batch[0]));
    }
    let want: Vec<f64> = (0..8).map(|k| T0_MS + HOUR_MS * f64::from(k)).collect();
    assert_eq!(seen, want);
    // The field values repeat with the file.
    let again = r.due(t0 + Duration::from_secs(8)).unwrap();
    assert_eq!(num(&again[0], "co_gt"), Some(2.0));
}

#[test]
fn repeat_of_a_file_without_usable_rows_stops() {
    let (_d, path) = trace(
        &[HEADER, ";;;;;;;", "10/03/2004;18.00.00;-200;;;;;"],
        "\r\n",
    );
    let mut s = spec(&path);
    s.repeat = true;
    let mut r = Replay::open(s).unwrap();
    assert!(r.due(Instant::now()).unwrap().is_empty());
    assert!(r.stats().finished);
    assert_eq!(r.stats().rows_skipped, 2);
}

#[test]
fn repeat_refuses_a_changed_header() {
    let (_d, path) = trace(&refs(&hourly(2)), "\r\n");
    let mut s = spec(&path);
    s.repeat = true;
    s.max_rows_per_call = 2;
    let mut r = Replay::open(s).unwrap();
    assert_eq!(r.due(Instant::now()).unwrap().len(), 2);
    fs::write(&path, "Date;Time;T\r\n10/03/2004;18.00.00;1\r\n").unwrap();
    let e = r.due(Instant::now()).unwrap_err().to_string();
    assert!(e.contains("header changed"), "{e}");
    // Still an error on the next call, never a panic.
    assert!(r.due(Instant::now()).is_err());
}

#[test]
fn many_junk_rows_are_spread_over_calls() {
    let mut lines = vec![HEADER.to_owned()];
    lines.extend((0..MAX_SKIPPED_ROWS_PER_CALL + 5).map(|_| ";;;;;;;".to_owned()));
    lines.extend(hourly(1).into_iter().skip(1));
    let (_d, path) = trace(&refs(&lines), "\n");
    let mut r = Replay::open(spec(&path)).unwrap();
    assert!(r.due(Instant::now()).unwrap().is_empty());
    assert!(!r.stats().finished);
    assert_eq!(r.due(Instant::now()).unwrap().len(), 1);
}

// ---- quoting, resume, identity ----

#[test]
fn a_quoted_header_and_quoted_cells_play() {
    let (_d, path) = trace(
        &[
            "\"Date\";\"Time\";\"CO;GT\";\"T\"",
            "\"10/03/2004\";\"18.00.00\";\"2,6\";\"-1,9\"",
        ],
        "\r\n",
    );
    let mut s = spec(&path);
    s.columns = vec![("CO;GT".into(), "co".into()), ("T".into(), "t".into())];
    let mut r = Replay::open(s).unwrap();
    let rows = drain(&mut r);
    assert_eq!(rows.len(), 1);
    assert_eq!(num(&rows[0], "co"), Some(2.6));
    assert_eq!(num(&rows[0], "t"), Some(-1.9));
    assert_eq!(ts(&rows[0]), T0_MS);
}

/// Every (position, trace_ts_ms) of a replay, `per_call` rows a call.
fn positions(r: &mut Replay, calls: usize) -> Vec<(ReplayPosition, f64)> {
    let mut out = Vec::new();
    for _ in 0..calls {
        for (f, p) in r.due_at(Instant::now()).unwrap() {
            out.push((p, ts(&f)));
        }
    }
    out
}

#[test]
fn resume_continues_after_the_stored_row_with_the_same_identities() {
    let (_d, path) = trace(&refs(&hourly(5)), "\r\n");
    let mut s = spec(&path);
    s.repeat = true;
    s.max_rows_per_call = 2;
    // Uninterrupted: 32 rows over laps 0..=6.
    let whole = positions(&mut Replay::open(s.clone()).unwrap(), 16);
    assert_eq!(whole.len(), 32);
    assert_eq!(whole[31].0.lap, 6);
    assert_eq!(whole[4].0.line, 6);
    assert_eq!(whole[5].0.lap, 1);
    // Stopped after each k rows, resumed from the k-th position.
    for k in 1..10 {
        let mut r = Replay::open(s.clone()).unwrap();
        let done = positions(&mut r, 8);
        let stored = done[k - 1].0.clone();
        let mut again = Replay::open(s.clone()).unwrap();
        let how = again.resume(Some(stored.clone())).unwrap();
        assert_eq!(
            how,
            Resumed::After {
                lap: stored.lap,
                line: stored.line
            }
        );
        let rest = positions(&mut again, 8);
        assert_eq!(rest[..], whole[k..k + rest.len()], "after row {k}");
        assert!(rest.len() >= 2);
    }
}

#[test]
fn resume_at_the_end_finishes_and_a_changed_file_is_a_new_trace() {
    let (_d, path) = trace(&refs(&hourly(3)), "\r\n");
    let s = spec(&path);
    let mut r = Replay::open(s.clone()).unwrap();
    let all = positions(&mut r, 2);
    let last = all[2].0.clone();
    let mut again = Replay::open(s.clone()).unwrap();
    again.resume(Some(last.clone())).unwrap();
    assert!(again.due(Instant::now()).unwrap().is_empty());
    assert!(again.stats().finished);

    // One more row: another fingerprint, so another trace from row 1.
    let mut lines = hourly(4);
    lines[1] = lines[1].replace(";0;", ";9;");
    fs::write(&path, refs(&lines).join("\r\n")).unwrap();
    let mut changed = Replay::open(s).unwrap();
    assert_ne!(changed.trace_id(), last.trace_id);
    let how = changed.resume(Some(last.clone())).unwrap();
    assert_eq!(how, Resumed::NewTrace { was: last.trace_id });
    let rows = positions(&mut changed, 2);
    assert_eq!((rows[0].0.lap, rows[0].0.line), (0, 2));
    assert_eq!(rows.len(), 4);
}

#[test]
fn a_configured_trace_id_skips_by_line_and_a_shorter_file_ends_the_lap() {
    let (_d, path) = trace(&refs(&hourly(6)), "\n");
    let mut s = spec(&path);
    s.trace_id = Some("air-2004".into());
    let mut r = Replay::open(s.clone()).unwrap();
    assert_eq!(r.trace_id(), "air-2004");
    let all = positions(&mut r, 2);
    let at4 = all[3].0.clone();
    assert_eq!(at4.line, 5);

    // Same id, other content (CRLF now, so other offsets): by line.
    fs::write(&path, refs(&hourly(6)).join("\r\n")).unwrap();
    let mut again = Replay::open(s.clone()).unwrap();
    let how = again.resume(Some(at4.clone())).unwrap();
    assert_eq!(
        how,
        Resumed::SkippedTo {
            lap: 0,
            line: 5,
            reached: true
        }
    );
    let rest = positions(&mut again, 2);
    assert_eq!(rest.iter().map(|(p, _)| p.line).collect::<Vec<_>>(), [6, 7]);
    assert_eq!(rest[0].1, all[4].1);

    // Shorter than the stored line: that lap has ended.
    fs::write(&path, refs(&hourly(2)).join("\n")).unwrap();
    let mut short = Replay::open(s.clone()).unwrap();
    let how = short.resume(Some(at4.clone())).unwrap();
    assert_eq!(
        how,
        Resumed::SkippedTo {
            lap: 0,
            line: 5,
            reached: false
        }
    );
    assert!(short.due(Instant::now()).unwrap().is_empty());
    assert!(short.stats().finished);
    // With repeat, the next lap starts, from its first row.
    s.repeat = true;
    let mut looped = Replay::open(s).unwrap();
    looped.resume(Some(at4)).unwrap();
    let next = positions(&mut looped, 1);
    assert_eq!((next[0].0.lap, next[0].0.line), (1, 2));
}

#[test]
fn a_followed_trace_waits_at_its_end_and_numbers_segments_across_rotation() {
    let (dir, path) = trace(&refs(&hourly(2)), "\n");
    let mut s = spec(&path);
    s.follow = true;
    let mut r = Replay::open(s.clone()).unwrap();
    assert_eq!(r.trace_id(), format!("path:{}", path.display()));
    let first = positions(&mut r, 2);
    assert_eq!(first.len(), 2);
    assert!(!r.stats().finished, "a followed file has no end");
    let more = hourly(4);
    let mut f = fs::OpenOptions::new().append(true).open(&path).unwrap();
    std::io::Write::write_all(&mut f, format!("{}\n{}", more[3], &more[4][..5]).as_bytes())
        .unwrap();
    let grown = positions(&mut r, 1);
    assert_eq!(grown.len(), 1, "the incomplete line waits");
    assert_eq!((grown[0].0.lap, grown[0].0.line), (0, 4));
    // Rotated: the rest of the old file, then the new one as segment 1.
    std::io::Write::write_all(&mut f, format!("{}\n", &more[4][5..]).as_bytes()).unwrap();
    fs::rename(&path, dir.path().join("trace.csv.1")).unwrap();
    fs::write(&path, refs(&hourly(1)).join("\n") + "\n").unwrap();
    let after = positions(&mut r, 1);
    let at: Vec<(u64, u64)> = after.iter().map(|(p, _)| (p.lap, p.line)).collect();
    assert_eq!(at, [(0, 5), (1, 2)]);
    // Row 2 of segment 1 and of segment 0 hold the same data, yet their
    // identities differ (segment number, inode and head are all in it).
    assert_eq!(after[1].1, first[0].1);
    assert_ne!(after[1].0.id_trace(), first[0].0.id_trace());
    assert_ne!(after[1].0.segment, first[0].0.segment);

    // Resumed from each stored position, the rest is the same rows.
    let stored = after[0].0.clone();
    let mut again = Replay::open(s.clone()).unwrap();
    let how = again.resume(Some(stored)).unwrap();
    assert_eq!(
        how,
        Resumed::InRotated {
            lap: 0,
            line: 5,
            file: dir.path().join("trace.csv.1")
        }
    );
    let rest = positions(&mut again, 1);
    assert_eq!(rest, after[1..]);
    let mut again = Replay::open(s).unwrap();
    let how = again.resume(Some(after[1].0.clone())).unwrap();
    assert_eq!(how, Resumed::After { lap: 1, line: 2 });
    assert!(positions(&mut again, 1).is_empty());
}

// ---- the real trace ----

#[test]
fn plays_the_uci_air_quality_trace() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/AirQualityUCI.csv");
    let mut s = spec(&path);
    s.missing = vec!["-200".into()];
    let mut r = Replay::open(s).unwrap();
    let rows = drain(&mut r);
    let stats = r.stats().clone();
    println!("AirQualityUCI.csv: {stats:?}");

    // 9357 data rows + 114 separator-only rows, all counted as read.
    assert_eq!(stats.rows_read, 9357 + 114);
    // 31 data rows have all 13 value columns at -200 (25-26/05/2004
    // 19:00-08:00 and 07-08/09/2004 23:00-16:00 except 09:00), so they
    // give no reading.
    assert_eq!(stats.readings, 9357 - 31);
    assert_eq!(rows.len(), 9326);
    assert_eq!(stats.rows_skipped, 114 + 31);
    // Per column (SOURCE.txt): NMHC 8443 + CO 1683 + NO2 1642 + NOx 1639
    // + 9 device columns x 366, the 31 all-missing rows included.
    assert_eq!(stats.cells_skipped, 8443 + 1683 + 1642 + 1639 + 9 * 366);
    assert!(stats.finished);

    let first = &rows[0];
    assert_eq!(
        *first,
        [
            ("trace_ts_ms", T0_MS),
            ("co_gt", 2.6),
            ("pt08_s1_co", 1360.0),
            ("nmhc_gt", 150.0),
            ("c6h6_gt", 11.9),
            ("pt08_s2_nmhc", 1046.0),
            ("nox_gt", 166.0),
            ("pt08_s3_nox", 1056.0),
            ("no2_gt", 113.0),
            ("pt08_s4_no2", 1692.0),
            ("pt08_s5_o3", 1268.0),
            ("t", 13.6),
            ("rh", 48.9),
            ("ah", 0.7578),
        ]
        .map(|(n, v)| (n.to_owned(), FieldValue::Num(v)))
    );
    assert_eq!(ts(&rows[rows.len() - 1]), 1_112_623_200_000.0);
    // Strictly increasing, on the hour, no -200 left anywhere.
    for pair in rows.windows(2) {
        let gap = ts(&pair[1]) - ts(&pair[0]);
        assert!(gap >= HOUR_MS && gap % HOUR_MS == 0.0, "{gap}");
    }
    let values = rows.iter().flat_map(|f| f.iter().skip(1));
    assert!(values.clone().all(|(_, v)| *v != FieldValue::Num(-200.0)));
    let present: usize = rows.iter().map(|f| f.len() - 1).sum();
    assert_eq!(present, 9357 * 13 - 16701);
    let cold = values
        .filter(|(n, v)| n == "t" && matches!(v, FieldValue::Num(x) if *x < 0.0))
        .count();
    assert_eq!(cold, 13);
}

#[test]
fn paces_the_uci_air_quality_trace() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/AirQualityUCI.csv");
    let mut s = spec(&path);
    s.speed = 3600.0;
    s.max_rows_per_call = 1000;
    let mut r = Replay::open(s).unwrap();
    let t0 = Instant::now();
    assert_eq!(r.due(t0).unwrap().len(), 1);
    assert_eq!(r.due(t0 + Duration::from_millis(999)).unwrap().len(), 0);
    assert_eq!(r.due(t0 + Duration::from_secs(1)).unwrap().len(), 1);
    // One simulated day later: 24 more hourly rows (none missing there).
    assert_eq!(r.due(t0 + Duration::from_secs(25)).unwrap().len(), 24);
}
