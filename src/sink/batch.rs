//! What a batch is and what became of each delivery in it.
//!
//! Pure: no I/O, time passed in. Its one rule: within a batch and against
//! the store, the first delivery of an event id of a device is stored and
//! every later one is compared by digest, never written over the first (I3
//! at the consumer). The device is the one the topic names
//! ([`super::identity`]): two devices never share a row, whatever ids they
//! choose.

use super::message::{Event, Unreadable};
use std::collections::{HashMap, HashSet};
use std::time::Duration;

/// What an event is stored under: (device id, event id).
pub type Key = (String, String);

/// One delivery in a batch.
#[derive(Debug, Clone, PartialEq)]
pub struct Item {
    /// Topic it arrived on.
    pub topic: String,
    /// The bytes as delivered.
    pub payload: Vec<u8>,
    /// The envelope, or why it is not one of its topic's device and stream
    /// (kept aside and counted).
    pub read: Result<Event, Unreadable>,
    /// The device that published it, whose bounds a row it leaves in a side
    /// table counts against: the device its topic names
    /// ([`super::identity::publisher`]), or for a delivery the sink set
    /// aside for its topic's shape, the level at the sink's device position
    /// ([`super::identity::Shape::publisher`]).
    pub publisher: String,
}

impl Item {
    /// Read a delivery: decode it, then check its identity against the
    /// topic ([`super::identity::check`]).
    pub fn new(topic: &str, payload: &[u8]) -> Item {
        let read = super::message::decode(payload)
            .and_then(|e| super::identity::check(topic, &e).map(|()| e));
        Item {
            topic: topic.to_owned(),
            payload: payload.to_vec(),
            read,
            publisher: super::identity::publisher(topic).to_owned(),
        }
    }

    /// A delivery set aside unread for its topic (`why`), from `publisher`
    /// ([`super::identity::Shape`]): kept in `forged` with its topic.
    pub fn forged(topic: &str, payload: &[u8], publisher: &str, why: String) -> Item {
        Item {
            topic: topic.to_owned(),
            payload: payload.to_vec(),
            read: Err(Unreadable::Forged(why)),
            publisher: publisher.to_owned(),
        }
    }
}

/// How much of an oversized delivery's payload its [`Item`] keeps (the side
/// tables keep at most this of any payload by default).
pub const OVERSIZED_KEPT: usize = 64 << 10;

impl Item {
    /// A delivery over the sink's incoming limit of `limit` bytes (its
    /// packet `packet` bytes): set aside unread, keeping its topic, its
    /// size and its first [`OVERSIZED_KEPT`] bytes.
    pub fn oversized(topic: &str, payload: &[u8], packet: usize, limit: usize) -> Item {
        Item {
            topic: topic.to_owned(),
            payload: payload[..payload.len().min(OVERSIZED_KEPT)].to_vec(),
            read: Err(Unreadable::Oversized {
                bytes: payload.len(),
                packet,
                limit,
            }),
            publisher: super::identity::publisher(topic).to_owned(),
        }
    }

    /// The payload's length as delivered (an oversized delivery keeps only
    /// its first bytes in `payload`).
    pub fn delivered_bytes(&self) -> usize {
        match &self.read {
            Err(Unreadable::Oversized { bytes, .. }) => *bytes,
            _ => self.payload.len(),
        }
    }

    /// Whether it was set aside for its size.
    pub fn is_oversized(&self) -> bool {
        matches!(self.read, Err(Unreadable::Oversized { .. }))
    }
}

/// The key of an event.
pub fn key(e: &Event) -> Key {
    (e.device_id.clone(), e.event_id.clone())
}

/// What became of one delivery.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fate {
    /// The first delivery of its key: its row was inserted by this batch.
    First,
    /// Its key is stored with the same digest.
    Duplicate,
    /// Its key is stored with another digest.
    Mismatch,
    /// Not an envelope.
    Unreadable,
    /// An envelope of another device or stream than its topic's.
    Forged,
}

impl Fate {
    /// Whether the store now holds the delivery's row with its bytes: what
    /// a receipt may say.
    pub fn held(self) -> bool {
        matches!(self, Fate::First | Fate::Duplicate)
    }
}

/// Indices of the first delivery of each key in `items`, ordered by key.
/// The order is the lock order of the insert: two sinks inserting
/// overlapping keys in different orders could deadlock each other.
pub fn candidates(items: &[Item]) -> Vec<usize> {
    let mut seen = HashSet::new();
    let mut out: Vec<usize> = items
        .iter()
        .enumerate()
        .filter_map(|(i, it)| match &it.read {
            Ok(e) if seen.insert((e.device_id.as_str(), e.event_id.as_str())) => Some(i),
            _ => None,
        })
        .collect();
    out.sort_by(|&a, &b| sort_key(&items[a]).cmp(&sort_key(&items[b])));
    out
}

fn sort_key(it: &Item) -> (&str, &str) {
    it.read
        .as_ref()
        .map(|e| (e.device_id.as_str(), e.event_id.as_str()))
        .unwrap_or(("", ""))
}

/// The fate of every item, in order. `inserted`: the keys whose row this
/// batch's insert created; `stored`: the digest stored for every key of
/// the batch after the insert (inserted or found).
///
/// A key missing from `stored` (which a correct caller never produces) is a
/// mismatch: it is kept aside rather than assumed equal.
pub fn classify(
    items: &[Item],
    inserted: &HashSet<Key>,
    stored: &HashMap<Key, [u8; 32]>,
) -> Vec<Fate> {
    let mut claimed: HashSet<Key> = HashSet::new();
    items
        .iter()
        .map(|it| match &it.read {
            Err(Unreadable::Forged(_)) => Fate::Forged,
            Err(_) => Fate::Unreadable,
            Ok(e) => {
                let k = key(e);
                if inserted.contains(&k) && !claimed.contains(&k) {
                    claimed.insert(k);
                    Fate::First
                } else if stored.get(&k) == Some(&e.digest) {
                    Fate::Duplicate
                } else {
                    Fate::Mismatch
                }
            }
        })
        .collect()
}

/// When a batch is committed: at `max` deliveries, when its first delivery
/// is `window` old, or when nothing arrived for `idle` (the broker stops
/// sending once its in-flight limit for this client is reached, so waiting
/// longer would only wait for our own acknowledgements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchPolicy {
    /// Most deliveries in one transaction.
    pub max: usize,
    /// Longest a delivery waits for its transaction.
    pub window: Duration,
    /// A pause in arrivals this long commits what is there.
    pub idle: Duration,
}

impl BatchPolicy {
    /// Whether a batch of `len`, the oldest `age` old, with the last arrival
    /// `quiet` ago, is to be committed now.
    pub fn due(&self, len: usize, age: Duration, quiet: Duration) -> bool {
        len > 0 && (len >= self.max || age >= self.window || quiet >= self.idle)
    }

    /// How long to wait for the next delivery: until the batch is due by
    /// time, or `empty_wait` when there is none.
    pub fn wait(
        &self,
        len: usize,
        age: Duration,
        quiet: Duration,
        empty_wait: Duration,
    ) -> Duration {
        if len == 0 {
            return empty_wait;
        }
        let left = self
            .window
            .saturating_sub(age)
            .min(self.idle.saturating_sub(quiet));
        left.max(Duration::from_millis(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sink::message::digest;

    fn ev(id: &str, payload: &[u8]) -> Item {
        ev_of("d", id, payload)
    }

    fn ev_of(device: &str, id: &str, payload: &[u8]) -> Item {
        Item {
            topic: format!("p/{device}/events/s"),
            payload: payload.to_vec(),
            read: Ok(Event {
                event_id: id.into(),
                device_id: device.into(),
                stream: "s".into(),
                seq: 1,
                ts_ms: 0,
                clock_trusted: true,
                mono: None,
                fields_json: "{}".into(),
                digest: digest(payload),
            }),
            publisher: device.into(),
        }
    }

    fn k(id: &str) -> Key {
        ("d".to_owned(), id.to_owned())
    }

    #[test]
    fn candidates_are_first_deliveries_in_id_order() {
        let items = vec![ev("b", b"1"), ev("a", b"2"), ev("b", b"1"), ev("c", b"3")];
        assert_eq!(candidates(&items), vec![1, 0, 3]);
    }

    #[test]
    fn a_repeat_in_the_same_batch_is_a_duplicate_or_a_mismatch() {
        let items = vec![ev("a", b"1"), ev("a", b"1"), ev("a", b"x")];
        let inserted = HashSet::from([k("a")]);
        let stored = HashMap::from([(k("a"), digest(b"1"))]);
        assert_eq!(
            classify(&items, &inserted, &stored),
            vec![Fate::First, Fate::Duplicate, Fate::Mismatch]
        );
    }

    #[test]
    fn an_id_stored_by_another_sink_is_never_first() {
        let items = vec![ev("a", b"1"), ev("b", b"2")];
        let stored = HashMap::from([(k("a"), digest(b"1")), (k("b"), digest(b"other"))]);
        assert_eq!(
            classify(&items, &HashSet::new(), &stored),
            vec![Fate::Duplicate, Fate::Mismatch]
        );
    }

    #[test]
    fn two_devices_with_one_event_id_are_two_events() {
        let items = vec![ev_of("gw2", "a", b"2"), ev_of("gw1", "a", b"1")];
        assert_eq!(candidates(&items), vec![1, 0], "ordered by (device, id)");
        let inserted = HashSet::from([
            ("gw1".to_owned(), "a".to_owned()),
            ("gw2".to_owned(), "a".to_owned()),
        ]);
        assert_eq!(
            classify(&items, &inserted, &HashMap::new()),
            vec![Fate::First, Fate::First]
        );
    }

    #[test]
    fn a_forged_envelope_is_neither_a_candidate_nor_unreadable() {
        let item = Item::new("p/evil/events/s", br#"{"event_id":"abababab-abab-abab-abab-abababababab","device_id":"gw1","stream":"s","seq":1,"ts_ms":5,"clock_trusted":true}"#);
        assert!(
            matches!(item.read, Err(Unreadable::Forged(_))),
            "{:?}",
            item.read
        );
        let items = vec![item];
        assert!(candidates(&items).is_empty());
        assert_eq!(
            classify(&items, &HashSet::new(), &HashMap::new()),
            vec![Fate::Forged]
        );
        assert!(!Fate::Forged.held() && Fate::Duplicate.held() && !Fate::Mismatch.held());
    }

    #[test]
    fn an_id_missing_from_the_store_is_kept_aside_not_assumed_equal() {
        let items = vec![ev("a", b"1")];
        assert_eq!(
            classify(&items, &HashSet::new(), &HashMap::new()),
            vec![Fate::Mismatch]
        );
    }

    #[test]
    fn batches_are_due_by_size_age_or_a_pause() {
        let p = BatchPolicy {
            max: 3,
            window: Duration::from_millis(100),
            idle: Duration::from_millis(5),
        };
        let ms = Duration::from_millis;
        assert!(!p.due(0, ms(500), ms(500)));
        assert!(!p.due(2, ms(10), ms(1)));
        assert!(p.due(3, ms(0), ms(0)));
        assert!(p.due(1, ms(100), ms(0)));
        assert!(p.due(1, ms(1), ms(5)));
        assert_eq!(p.wait(0, ms(0), ms(0), ms(1000)), ms(1000));
        assert_eq!(p.wait(1, ms(98), ms(0), ms(1000)), ms(2));
        assert_eq!(p.wait(1, ms(10), ms(3), ms(1000)), ms(2));
        assert_eq!(p.wait(1, ms(200), ms(9), ms(1000)), ms(1));
    }
}
