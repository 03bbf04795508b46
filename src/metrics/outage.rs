//! The outage budget's families ([`crate::flash::outage`]): ingest rates per
//! stream, hold time, the last measured delivery rate, drain time and the
//! projected flash writes, as the last summary computed them.
//!
//! Its one rule: **a figure not measured yet has its HELP and TYPE but no
//! sample** (never a made-up 0); a spool that does not grow holds for
//! `+Inf` seconds.

use super::Out;
use crate::flash::outage::{Bound, Budget};

/// Label value of a bound.
fn bound_label(b: Bound) -> &'static str {
    match b {
        Bound::MaxBytes => "max_bytes",
        Bound::FreeSpaceReserve => "free_space_reserve",
    }
}

/// A gauge family with one unlabelled sample when `v` is `Some`.
fn maybe(o: &mut Out, name: &str, help: &str, v: Option<f64>) {
    o.family(name, "gauge", help);
    if let Some(v) = v {
        o.sample(name, &[], v);
    }
}

/// The families of `b`.
pub(super) fn render(o: &mut Out, b: &Budget) {
    o.single(
        "edgespool_rate_window_seconds",
        "gauge",
        "Window of the moving averages below (agent.rate_window_secs).",
        b.window_secs,
    );
    for (name, help, bytes) in [
        ("edgespool_ingest_readings_per_second", "Readings committed to the spool per second, by stream, averaged over the rate window.", false),
        ("edgespool_ingest_bytes_per_second", "Stored bytes (payload, event id, digest) committed per second, by stream, averaged over the rate window.", true),
    ] {
        o.family(name, "gauge", help);
        for (stream, r) in b.ingest.iter().flat_map(|i| &i.streams) {
            let v = if bytes {
                r.bytes_per_sec
            } else {
                r.readings_per_sec
            };
            o.sample(name, &[("stream", stream)], v);
        }
    }
    maybe(
        o,
        "edgespool_spool_bytes_per_row",
        "What a row costs in the spool (live pages / rows, the spool's fixed pages included), bytes.",
        b.spool_bytes_per_row,
    );
    let name = "edgespool_outage_hold_seconds";
    o.family(
        name,
        "gauge",
        "How long the spool holds an outage at the ingest rate before the bound named refuses readings (+Inf: it does not grow).",
    );
    if let Some(h) = &b.hold {
        let v = h.secs.unwrap_or(f64::INFINITY);
        o.sample(name, &[("bound", bound_label(h.bound))], v);
    }
    maybe(
        o,
        "edgespool_delivery_rows_per_second",
        "Rows acknowledged per second while connected with rows waiting, the last measurement (kept while offline).",
        b.delivery.map(|d| d.rows_per_sec),
    );
    maybe(
        o,
        "edgespool_delivery_rate_measured_timestamp_seconds",
        "Wall clock of the last delivery rate measurement, Unix seconds.",
        b.delivery.map(|d| d.measured_at_ms as f64 / 1000.0),
    );
    maybe(
        o,
        "edgespool_backlog_drain_seconds",
        "Backlog rows / the last measured delivery rate, seconds (readings still arriving lengthen it).",
        b.drain_secs,
    );
    maybe(
        o,
        "edgespool_flash_projected_bytes_per_day",
        "Bytes this process sends to the block layer per day at the write rate of the rate window.",
        b.flash_mb_per_day.map(|mb| mb * 1e6),
    );
}

#[cfg(test)]
mod tests {
    use crate::flash::outage::{budget, Meter, Room, Sample};
    use crate::metrics::{render, Figures};
    use std::collections::BTreeMap;

    #[test]
    fn the_outage_families_show_measured_figures_and_leave_out_the_rest() {
        let empty = render(&Figures {
            outage: Some(budget(&Meter::new(60.0), Room::default())),
            ..Figures::default()
        });
        assert!(empty.contains("# TYPE edgespool_outage_hold_seconds gauge"));
        assert!(
            !empty.contains("\nedgespool_outage_hold_seconds"),
            "{empty}"
        );
        assert!(!empty.contains("\nedgespool_delivery_rows_per_second "));
        assert!(empty.contains("\nedgespool_backlog_drain_seconds 0\n"));
        let mut m = Meter::new(60.0);
        for (at, n) in [(0.0, 0), (10.0, 100)] {
            m.record(Sample {
                at_secs: at,
                streams: BTreeMap::from([("pump".to_owned(), (n, n * 50))]),
                retired: n,
                connected: true,
                backlog: 1,
                ..Sample::default()
            });
        }
        let room = Room {
            used_bytes: 100_000,
            max_bytes: 200_000,
            free_bytes: u64::MAX / 2,
            rows: 100,
            backlog_rows: 100,
            ..Room::default()
        };
        let text = render(&Figures {
            outage: Some(budget(&m, room)),
            ..Figures::default()
        });
        assert!(text.contains("\nedgespool_ingest_readings_per_second{stream=\"pump\"} 10\n"));
        assert!(text.contains("\nedgespool_ingest_bytes_per_second{stream=\"pump\"} 500\n"));
        // 100 kB of room at 10 rows/s of 1000 B.
        assert!(
            text.contains("\nedgespool_outage_hold_seconds{bound=\"max_bytes\"} 10\n"),
            "{text}"
        );
        assert!(text.contains("\nedgespool_delivery_rows_per_second 10\n"));
        assert!(text.contains("\nedgespool_backlog_drain_seconds 10\n"));
        // Readings came, none in the window: the spool does not grow.
        let mut quiet = Meter::new(60.0);
        for at in [0.0, 10.0] {
            quiet.record(Sample {
                at_secs: at,
                streams: BTreeMap::from([("pump".to_owned(), (5, 250))]),
                ..Sample::default()
            });
        }
        let text = render(&Figures {
            outage: Some(budget(&quiet, room)),
            ..Figures::default()
        });
        assert!(
            text.contains("\nedgespool_outage_hold_seconds{bound=\"max_bytes\"} +Inf\n"),
            "{text}"
        );
    }
}
