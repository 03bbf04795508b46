//! The receipts a committed batch owes its devices, and the bounded queue
//! they wait in until the MQTT client takes them.
//!
//! Pure: no I/O. Its one rule: **a receipt names only events whose row the
//! store holds with the bytes delivered (fate [`Fate::held`]: First or
//! Duplicate, under the device and stream the topic names), with the
//! digest of those bytes, signed for that device, and goes to that topic's
//! own `<topic_prefix>/receipts`**. What it says comes from the
//! store's answer inside the committed transaction, so it holds with N
//! sinks and across restarts. What does not fit the queue is dropped and
//! counted: the agent sends such a row again after its receipt timeout, and
//! the sink then receipts the duplicate.

use super::batch::{Fate, Item};
use super::message::Event;
use crate::event::envelope::EventId;
use crate::event::signature::SigningKey;
use std::collections::{HashMap, HashSet, VecDeque};

/// Most receipts waiting for the client.
pub const MAX_QUEUED: usize = 1024;
/// Most bytes of receipts waiting for the client.
pub const MAX_QUEUED_BYTES: usize = 8 << 20;
/// Most receipts handed to the client and not yet acknowledged by the
/// broker: below rumqttc's in-flight limit (100 by default), whose
/// exhaustion stops its event loop reading requests, the PUBACKs of
/// deliveries among them.
pub const MAX_IN_FLIGHT: usize = 64;

/// The receipts `items` (committed, with `fates`) owe: `(topic, payload)`,
/// one or more per receipts topic, each event named once with the digest
/// of the bytes stored, for the device its topic names, signed by `key`
/// ([`crate::event::receipts::encode`]).
pub fn owed(items: &[Item], fates: &[Fate], key: &SigningKey) -> Vec<(String, Vec<u8>)> {
    type Owed<'a> = (String, &'a str, Vec<(&'a str, EventId, [u8; 32])>);
    let mut topics: Vec<Owed<'_>> = Vec::new();
    let mut index: HashMap<String, usize> = HashMap::new();
    let mut seen: HashSet<(usize, &str, EventId)> = HashSet::new();
    for (it, fate) in items.iter().zip(fates) {
        let Ok(e) = &it.read else { continue };
        if !fate.held() || !receiptable(e) {
            continue;
        }
        let (Some(topic), Some(who), Some(id)) = (
            super::identity::receipts_topic(&it.topic),
            super::identity::of_topic(&it.topic),
            EventId::parse(&e.event_id),
        ) else {
            continue;
        };
        let at = *index.entry(topic.clone()).or_insert_with(|| {
            topics.push((topic, who.device, Vec::new()));
            topics.len() - 1
        });
        if seen.insert((at, e.stream.as_str(), id)) {
            topics[at].2.push((e.stream.as_str(), id, e.digest));
        }
    }
    topics
        .into_iter()
        .flat_map(|(topic, device, events)| {
            crate::event::receipts::encode(device, &events, key)
                .into_iter()
                .map(move |p| (topic.clone(), p))
        })
        .collect()
}

/// Whether a receipt can name `e`: a stream and id of the forms
/// [`crate::event::receipts::parse`] accepts (one it refuses would cost the
/// whole receipt).
fn receiptable(e: &Event) -> bool {
    let s = &e.stream;
    !s.is_empty()
        && s.len() <= 64
        && s.chars().all(crate::event::stream::topic_safe)
        && crate::event::receipts::event_id_ok(&e.event_id)
}

/// Receipts waiting for the client, and those it has not had acknowledged.
#[derive(Debug, Default)]
pub struct Outbox {
    queue: VecDeque<(String, Vec<u8>)>,
    bytes: usize,
    in_flight: usize,
    dropped: u64,
}

impl Outbox {
    /// An empty outbox.
    pub fn new() -> Outbox {
        Outbox::default()
    }

    /// Queue a receipt; the oldest go when the queue is over
    /// [`MAX_QUEUED`] or [`MAX_QUEUED_BYTES`] (counted).
    pub fn push(&mut self, topic: String, payload: Vec<u8>) {
        self.bytes += topic.len() + payload.len();
        self.queue.push_back((topic, payload));
        while self.queue.len() > MAX_QUEUED || self.bytes > MAX_QUEUED_BYTES {
            let Some((t, p)) = self.queue.pop_front() else {
                break;
            };
            self.bytes -= t.len() + p.len();
            self.dropped += 1;
        }
    }

    /// The next receipt to hand to the client, unless [`MAX_IN_FLIGHT`]
    /// are out.
    pub fn next(&self) -> Option<(&str, &[u8])> {
        if self.in_flight >= MAX_IN_FLIGHT {
            return None;
        }
        self.queue.front().map(|(t, p)| (t.as_str(), p.as_slice()))
    }

    /// The receipt [`Outbox::next`] gave was taken by the client.
    pub fn sent(&mut self) {
        if let Some((t, p)) = self.queue.pop_front() {
            self.bytes -= t.len() + p.len();
            self.in_flight += 1;
        }
    }

    /// The broker acknowledged one of ours.
    pub fn acked(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
    }

    /// A new client: nothing of ours is in flight on it.
    pub fn new_connection(&mut self) {
        self.in_flight = 0;
    }

    /// Receipts waiting.
    pub fn len(&self) -> usize {
        self.queue.len()
    }

    /// Whether none waits.
    pub fn is_empty(&self) -> bool {
        self.queue.is_empty()
    }

    /// Receipts handed out and not yet acknowledged.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Receipts dropped since the last call.
    pub fn take_dropped(&mut self) -> u64 {
        std::mem::take(&mut self.dropped)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::receipts::parse;

    fn env(device: &str, stream: &str, n: u8) -> Vec<u8> {
        format!(
            r#"{{"event_id":"0000000{n}-0000-4000-8000-000000000000","device_id":"{device}","stream":"{stream}","seq":{n},"ts_ms":5,"clock_trusted":true,"fields":{{}}}}"#
        )
        .into_bytes()
    }

    #[test]
    fn only_held_events_are_receipted_once_each_on_their_own_topic() {
        let items = vec![
            Item::new("edgespool/gw1/events/load", &env("gw1", "load", 1)),
            Item::new("edgespool/gw1/batches/temp/lz4", &env("gw1", "temp", 2)),
            Item::new("edgespool/gw1/events/load", &env("gw1", "load", 1)),
            Item::new("edgespool/gw2/events/load", &env("gw2", "load", 3)),
            Item::new("edgespool/gw2/events/load", &env("gw2", "load", 4)),
            Item::new("edgespool/evil/events/load", &env("gw1", "load", 5)),
            Item::new("edgespool/gw2/events/load", b"junk"),
        ];
        let fates = [
            Fate::First,
            Fate::First,
            Fate::Duplicate,
            Fate::Duplicate,
            Fate::Mismatch,
            Fate::Forged,
            Fate::Unreadable,
        ];
        let key = SigningKey::generate().expect("keygen").0;
        let out = owed(&items, &fates, &key);
        type Named = Vec<(String, Vec<String>)>;
        let got: Vec<(&str, Named)> = out
            .iter()
            .map(|(t, p)| {
                let r = parse(p).expect("receipt parses");
                let device = t.split('/').nth(1).expect("a device level");
                assert_eq!(r.check(device, &[key.public()]), Ok(()), "{t}");
                for (stream, events) in &r.stored {
                    for (_, digest) in events {
                        let it = items.iter().find(|i| {
                            i.read
                                .as_ref()
                                .is_ok_and(|e| &e.stream == stream && e.digest == *digest)
                        });
                        assert!(it.is_some(), "the digest of bytes delivered");
                    }
                }
                let named = r
                    .stored
                    .into_iter()
                    .map(|(s, ids)| (s, ids.iter().map(|(i, _)| i.hyphenated()).collect()))
                    .collect();
                (t.as_str(), named)
            })
            .collect();
        let id = |n: u8| format!("0000000{n}-0000-4000-8000-000000000000");
        assert_eq!(
            got,
            vec![
                (
                    "edgespool/gw1/receipts",
                    vec![
                        ("load".to_owned(), vec![id(1)]),
                        ("temp".to_owned(), vec![id(2)])
                    ]
                ),
                (
                    "edgespool/gw2/receipts",
                    vec![("load".to_owned(), vec![id(3)])]
                ),
            ]
        );
    }

    #[test]
    fn the_queue_is_bounded_oldest_first_and_in_flight_is_capped() {
        let mut o = Outbox::new();
        for i in 0..MAX_QUEUED + 3 {
            o.push(format!("t/{i}"), vec![0; 10]);
        }
        assert_eq!(o.len(), MAX_QUEUED);
        assert_eq!(o.take_dropped(), 3);
        assert_eq!(o.take_dropped(), 0);
        assert_eq!(o.next().map(|(t, _)| t.to_owned()), Some("t/3".into()));
        for _ in 0..MAX_IN_FLIGHT {
            assert!(o.next().is_some());
            o.sent();
        }
        assert!(o.next().is_none(), "in flight at its cap");
        o.acked();
        assert!(o.next().is_some());
        o.new_connection();
        assert_eq!(o.in_flight(), 0);
        let mut big = Outbox::new();
        for _ in 0..200 {
            big.push("t".into(), vec![0; 64 << 10]);
        }
        assert!(big.len() * (64 << 10) <= MAX_QUEUED_BYTES);
        assert_eq!(big.take_dropped() as usize, 200 - big.len());
    }
}
