//! The PostgreSQL store's share of true time ([`super::clock`]): the lock
//! that keeps an anchor and its boot's readings from missing each other,
//! a reading's corrected time at its insert, and what a clock anchor does
//! when it is first stored.
//!
//! Its one rule: **a reading's `ts_corrected_ms` is set by the first anchor
//! believed for its boot, whichever commits first.** Under READ COMMITTED
//! an anchor's update cannot see a reading another sink has inserted and
//! not yet committed, and that sink did not see the anchor either; so a
//! batch holding stamped readings takes a shared transaction-level
//! advisory lock (<https://www.postgresql.org/docs/current/explicit-locking.html#ADVISORY-LOCKS>)
//! on each of their devices' buckets ([`BUCKETS`] of them, so a batch
//! takes at most that many locks), and a batch holding an anchor an
//! exclusive one, first thing in the transaction and in bucket order
//! (no lock cycle between sinks). The reading's batch then either sees the
//! anchor committed, or commits before the anchor's update runs. Batches
//! with neither (every batch of a synchronized board) take none.

use super::batch::{Fate, Item, Key};
use super::clock::{self, Refused};
use super::message::Event;
use crate::event::clock::{Anchor, BootId, MonoStamp, CLOCK_STREAM};
use postgres::Transaction;
use std::collections::{BTreeMap, HashMap};

/// Advisory lock buckets devices are spread over (FNV-1a of the device id).
pub const BUCKETS: u32 = 64;

/// The first key of the advisory locks of true time ("eclk"): the two-key
/// form, a space apart from the one-key migration lock.
const LOCK_CLASS: i32 = 0x6563_6c6b;

/// Anchors believed for (device, boot) pairs.
const SELECT_ANCHORS: &str = "
SELECT a.device_id, a.boot_id::text, a.mono_ms, a.wall_ms
FROM unnest($1::text[], $2::text[]) AS u(device_id, boot_id)
JOIN clock_anchors a ON a.device_id = u.device_id AND a.boot_id = u.boot_id::uuid";

/// The boot's readings taken before the anchor (`$3` mono, `$4` wall)
/// whose time was off, moved; [`clock::MOVE_MS`] is `$5`.
const MOVE_READINGS: &str = "
UPDATE events SET ts_corrected_ms = $4 - ($3 - mono_ms)
WHERE device_id = $1 AND boot_id = $2::text::uuid AND boot_id IS NOT NULL AND mono_ms <= $3
  AND ts_corrected_ms IS NULL AND stream <> $6
  AND (NOT clock_trusted OR abs($4 - ($3 - mono_ms) - ts_ms) > $5)";

const INSERT_ANCHOR: &str = "
INSERT INTO clock_anchors (device_id, boot_id, mono_ms, wall_ms, event_id, received_ms, sink)
VALUES ($1, $2::text::uuid, $3, $4, $5::text::uuid, $6, $7)
ON CONFLICT (device_id, boot_id) DO NOTHING";

/// The bucket of `device`.
fn bucket(device: &str) -> i32 {
    let h = device.bytes().fold(0x811c_9dc5u32, |h, b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    });
    (h % BUCKETS) as i32
}

/// Take the advisory locks `items` need (see the module): exclusive for
/// the buckets of devices with an anchor, shared for those with a stamped
/// reading, in bucket order. Nothing for a batch with neither.
///
/// Errors: the server's.
pub fn lock(tx: &mut Transaction<'_>, items: &[Item]) -> Result<(), postgres::Error> {
    let mut wanted: BTreeMap<i32, bool> = BTreeMap::new();
    for e in items.iter().filter_map(|it| it.read.as_ref().ok()) {
        let exclusive = clock::is_anchor(e);
        if exclusive || e.mono.is_some() {
            *wanted.entry(bucket(&e.device_id)).or_default() |= exclusive;
        }
    }
    for (b, exclusive) in wanted {
        let sql = match exclusive {
            true => "SELECT pg_advisory_xact_lock($1, $2)",
            false => "SELECT pg_advisory_xact_lock_shared($1, $2)",
        };
        tx.execute(sql, &[&LOCK_CLASS, &b])?;
    }
    Ok(())
}

/// The corrected time of each stamped reading among the candidates
/// (`cands`, indices into `items`) whose boot has a believed anchor, by key.
///
/// Errors: the server's.
pub fn corrections(
    tx: &mut Transaction<'_>,
    items: &[Item],
    cands: &[usize],
) -> Result<HashMap<Key, i64>, postgres::Error> {
    let stamped: Vec<(&Event, MonoStamp)> = cands
        .iter()
        .filter_map(|&i| items[i].read.as_ref().ok())
        .filter(|e| e.stream != CLOCK_STREAM)
        .filter_map(|e| Some((e, e.mono?)))
        .collect();
    if stamped.is_empty() {
        return Ok(HashMap::new());
    }
    let mut pairs: Vec<(&str, String)> = stamped
        .iter()
        .map(|(e, m)| (e.device_id.as_str(), m.boot_id.simple()))
        .collect();
    pairs.sort();
    pairs.dedup();
    let (devs, boots): (Vec<&str>, Vec<String>) = pairs.into_iter().unzip();
    let boots: Vec<&str> = boots.iter().map(String::as_str).collect();
    let mut anchors: HashMap<(String, BootId), Anchor> = HashMap::new();
    for row in tx.query(SELECT_ANCHORS, &[&devs, &boots])? {
        let (device, boot): (String, String) = (row.get(0), row.get(1));
        let Some(boot_id) = BootId::parse(&boot) else {
            continue;
        };
        let a = Anchor {
            at: MonoStamp {
                boot_id,
                mono_ms: row.get::<_, i64>(2).max(0) as u64,
            },
            wall_ms: row.get(3),
        };
        anchors.insert((device, boot_id), a);
    }
    let mut out = HashMap::new();
    for (e, m) in stamped {
        let Some(a) = anchors.get(&(e.device_id.clone(), m.boot_id)) else {
            continue;
        };
        if let Some(t) = clock::corrected(a, e.ts_ms, e.clock_trusted, &m) {
            out.insert(super::batch::key(e), t);
        }
    }
    Ok(out)
}

/// What the anchors a batch stored for the first time did.
#[derive(Debug, Default)]
pub struct AnchorsDone<'a> {
    /// Anchors believed.
    pub believed: u64,
    /// Readings moved by them.
    pub moved: u64,
    /// Anchors to keep aside, with their reasons.
    pub refused: Vec<(&'a Item, String)>,
}

/// Judge each anchor of `items` whose fate is [`Fate::First`], in order;
/// a believed boot's first anchor is stored and moves its readings, at
/// the sink's clock `now_ms`, by sink `sink`.
///
/// Errors: the server's.
pub fn anchors<'a>(
    tx: &mut Transaction<'_>,
    items: &'a [Item],
    fates: &[Fate],
    now_ms: i64,
    sink: &str,
) -> Result<AnchorsDone<'a>, postgres::Error> {
    let mut done = AnchorsDone::default();
    for (it, fate) in items.iter().zip(fates) {
        let Ok(e) = &it.read else { continue };
        if *fate != Fate::First || !clock::is_anchor(e) {
            continue;
        }
        match believe(tx, e, now_ms, sink)? {
            Ok(moved) => {
                done.believed += 1;
                done.moved += moved;
            }
            Err(why) => {
                log::warn!("sink: clock anchor on {} kept aside: {why}", it.topic);
                done.refused.push((it, why.to_string()));
            }
        }
    }
    Ok(done)
}

/// One anchor: `Ok(n)` believed, `n` readings moved (0 when it agrees
/// with the one already believed); `Err` why it is kept aside.
fn believe(
    tx: &mut Transaction<'_>,
    e: &Event,
    now_ms: i64,
    sink: &str,
) -> Result<Result<u64, Refused>, postgres::Error> {
    let a = match clock::anchor_of(e) {
        Ok(a) => a,
        Err(r) => return Ok(Err(r)),
    };
    let boot = a.at.boot_id.simple();
    let stored = tx
        .query_opt(
            "SELECT mono_ms, wall_ms FROM clock_anchors WHERE device_id = $1 AND boot_id = $2::text::uuid",
            &[&e.device_id, &boot],
        )?
        .map(|r| Anchor {
            at: MonoStamp {
                boot_id: a.at.boot_id,
                mono_ms: r.get::<_, i64>(0).max(0) as u64,
            },
            wall_ms: r.get(1),
        });
    match clock::judge(&a, stored.as_ref(), now_ms) {
        Err(r) => return Ok(Err(r)),
        Ok(false) => return Ok(Ok(0)),
        Ok(true) => {}
    }
    let mono = a.at.mono_ms as i64;
    tx.execute(
        INSERT_ANCHOR,
        &[
            &e.device_id,
            &boot,
            &mono,
            &a.wall_ms,
            &e.event_id,
            &now_ms,
            &sink,
        ],
    )?;
    let moved = tx.execute(
        MOVE_READINGS,
        &[
            &e.device_id,
            &boot,
            &mono,
            &a.wall_ms,
            &clock::MOVE_MS,
            &CLOCK_STREAM,
        ],
    )?;
    log::info!(
        "sink: clock anchor of {} boot {boot} believed; {moved} readings taken before it moved to true time",
        e.device_id
    );
    Ok(Ok(moved))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_are_the_same_in_every_sink_and_spread_devices() {
        // FNV-1a is fixed: another sink process, another build, the same bucket.
        assert_eq!(bucket("gw17"), bucket("gw17"));
        assert_eq!(bucket(""), (0x811c_9dc5u32 % BUCKETS) as i32);
        let used: std::collections::HashSet<i32> =
            (0..1000).map(|i| bucket(&format!("gw{i}"))).collect();
        assert_eq!(used.len(), BUCKETS as usize);
    }
}
