//! Writes the seed corpus of the `spool_open` target: small, checkpointed
//! spool files made by the agent's own `Spool` (rows appended, some
//! acknowledged in and out of order, one FAILED, a replay position and the
//! agent state the agent keeps), one at SQLite's default page size and one
//! at 512-byte pages (a smaller file the fuzzer mutates faster).
//!
//! Usage: make_spool_seed <output directory>

use edgespool::event::envelope::{EventIdGen, Format};
use edgespool::event::reading::FieldValue;
use edgespool::spool::{CheckpointMode, NewEvent, Spool, SpoolOptions};
use std::path::Path;

fn main() {
    let out = std::env::args()
        .nth(1)
        .expect("usage: make_spool_seed <dir>");
    let out = Path::new(&out);
    std::fs::create_dir_all(out).expect("create the output directory");
    for (name, page_size) in [
        ("spool-default-pages.db", None),
        ("spool-512-pages.db", Some(512)),
    ] {
        let dir = tempfile::tempdir().expect("temporary directory");
        let path = dir.path().join("spool.db");
        if let Some(size) = page_size {
            // page_size takes effect only before the first table exists.
            let conn = rusqlite::Connection::open(&path).expect("create the file");
            conn.execute_batch(&format!("PRAGMA page_size = {size}; VACUUM;"))
                .expect("set the page size");
        }
        make(&path);
        std::fs::copy(&path, out.join(name)).expect("copy the seed");
    }
}

fn make(path: &Path) {
    let mut spool = Spool::open(path, &SpoolOptions::default()).expect("open the spool");
    let mut ids = EventIdGen::new().expect("event ids");
    // `temp` above priority 0: its rows are in the partial index too.
    spool
        .set_priorities(&[("temp".to_owned(), 100)].into())
        .expect("priorities");
    let events: Vec<NewEvent> = (0..6)
        .map(|i| NewEvent {
            stream: if i % 2 == 0 { "system" } else { "temp" }.to_owned(),
            ts_ms: 1_790_000_000_000 + i,
            clock_trusted: true,
            mono: None,
            fields: vec![
                ("load1".to_owned(), FieldValue::Num(0.25 * i as f64)),
                ("ok".to_owned(), FieldValue::Bool(true)),
            ],
            replay: None,
            key: None,
            reply: None,
        })
        .collect();
    spool
        .append(
            &events,
            &mut ids,
            "seed-board",
            Format::Json,
            1_790_000_000_000,
        )
        .expect("append");
    spool
        .append(
            &events[..2],
            &mut ids,
            "seed-board",
            Format::Postcard,
            1_790_000_000_100,
        )
        .expect("append");
    spool
        .record_delivery(&[1, 2, 3, 4, 5], &[1, 2, 4])
        .expect("record");
    spool
        .mark_failed(6, "seed: oversized", "oversized")
        .expect("fail");
    spool
        .set_state("seed", "1", 1_790_000_000_200)
        .expect("state");
    spool.persist_seqs().expect("persist");
    spool
        .checkpoint(CheckpointMode::Truncate)
        .expect("checkpoint");
}
