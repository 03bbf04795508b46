//! A lost `-wal` is always said (issue 33, item 8), whatever readers held
//! the WAL: the real agent, a real `sqlite3` shell holding a read
//! transaction from before the run began (so no checkpoint copies anything
//! of the run, its start record included, into the file), SIGKILL, the
//! `-wal` removed, a restart. Before the run marker the restart logged only
//! "integrity check passed" while every committed, unacknowledged row of
//! the run was gone (57,432 in the attack): no ERROR, no counter, health ok.

use crate::support::agent::{run_cli, AgentProc};
use crate::support::board::Board;
use crate::support::spool::total;
use crate::support::wait_for;
use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// A broker URL nobody answers (the port stays bound for the test's life
/// and never answers CONNECT): every row stays committed and unacknowledged.
fn nowhere() -> String {
    let held = std::net::TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0");
    let port = held.local_addr().expect("local_addr").port();
    std::mem::forget(held);
    format!("mqtt://127.0.0.1:{port}")
}

/// `sqlite3 DB` holding `BEGIN; SELECT count(*) FROM events;` open (its
/// stdin kept open), returned once the count is printed: the read
/// transaction has its snapshot.
fn hold_a_reader(db: &Path) -> Child {
    let mut child = Command::new("sqlite3")
        .arg(db)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("run sqlite3 (Debian package sqlite3)");
    let mut stdin = child.stdin.take().expect("stdin");
    stdin
        .write_all(b"BEGIN;\nSELECT count(*) FROM events;\n")
        .expect("write to sqlite3");
    stdin.flush().expect("flush");
    // Kept open (leaked) so the shell waits for more with its transaction held.
    std::mem::forget(stdin);
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout"))
        .read_line(&mut line)
        .expect("read the count");
    assert!(
        line.trim().parse::<u64>().is_ok(),
        "sqlite3 printed {line:?}"
    );
    child
}

fn status_json(db: &Path) -> serde_json::Value {
    let (st, out, err) = run_cli(&["status", "--json", "--spool", &db.display().to_string()]);
    assert!(st.success(), "{out}{err}");
    serde_json::from_str(&out).expect("status --json")
}

#[test]
fn a_wal_lost_after_a_reader_kept_the_whole_run_out_of_the_file_is_named_counted_and_degrades_health(
) {
    let Board { dir, cfg, db } = Board::new(&nowhere(), &crate::prefix("lost-wal"), 10);
    // A first run that stops cleanly: the file holds it and its end.
    let mut first = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(30), || db.exists() && total(&db) >= 20),
        "{}",
        first.log_tail(20)
    );
    assert!(first
        .terminate(Duration::from_secs(15))
        .is_some_and(|s| s.success()));
    let kept = total(&db);
    // A reader from before the next run began.
    let mut reader = hold_a_reader(&db);
    let mut agent = AgentProc::spawn(&cfg, &[], dir.path());
    assert!(
        wait_for(Duration::from_secs(60), || total(&db) >= kept + 500),
        "{} rows\n{}",
        total(&db),
        agent.log_tail(20)
    );
    agent.kill9();
    let committed = total(&db);
    // Killed, not closed: a close would let the shell checkpoint the run in.
    let _ = reader.kill();
    let _ = reader.wait();
    let wal = dir.path().join("spool.db-wal");
    assert!(
        std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0),
        "the run's commits are in the -wal"
    );
    std::fs::remove_file(&wal).expect("remove the -wal");

    let mut again = AgentProc::spawn(&cfg, &[], dir.path());
    let named = format!(
        "spool {} has no -wal, and the run that last wrote it",
        db.display()
    );
    assert!(
        wait_for(Duration::from_secs(30), || again
            .logged("ERROR", "spool", &named)),
        "no ERROR naming the lost commits\n{}",
        again.log_tail(30)
    );
    let health_degraded = || {
        let v = status_json(&db);
        v["health"]["state"] == "degraded"
            && v["health"]["reasons"].as_array().is_some_and(|r| {
                r.iter().any(|r| {
                    r.as_str()
                        .is_some_and(|r| r.starts_with("the spool lost committed rows at start"))
                })
            })
    };
    assert!(
        wait_for(Duration::from_secs(15), health_degraded),
        "{}\n{}",
        status_json(&db)["health"],
        again.log_tail(20)
    );
    let v = status_json(&db);
    assert_eq!(
        v["counters"]["spool_opened_without_wal"], 1,
        "{}",
        v["counters"]
    );
    println!(
        "lost -wal behind a reader: {committed} rows committed, {} of this run's gone at the restart ({kept} of the earlier run kept); ERROR, counter spool_opened_without_wal = 1, health degraded",
        committed - kept
    );
    assert!(again.is_running());
    again.terminate(Duration::from_secs(15));
    // A clean stop after all that leaves no marker, and the next start
    // reports nothing new.
    assert!(!dir.path().join("spool.db.run").exists());
    let mut last = AgentProc::spawn(&cfg, &[], dir.path());
    // Logged once the spool is open, after any report of the open.
    assert!(
        wait_for(Duration::from_secs(20), || last
            .log_text()
            .contains("journal_mode=")),
        "{}",
        last.log_tail(20)
    );
    assert!(
        !last.log_text().contains("has no -wal"),
        "{}",
        last.log_tail(30)
    );
    last.terminate(Duration::from_secs(15));
    assert_eq!(status_json(&db)["counters"]["spool_opened_without_wal"], 1);
}
