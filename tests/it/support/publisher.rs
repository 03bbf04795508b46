//! An agent-like publisher: JSON envelopes for several device ids at QoS 1,
//! with deliberate duplicates (same event id, same bytes) and conflicts
//! (same event id, other bytes). It returns once the broker has
//! acknowledged every publish.

use rumqttc::{Client, Event, Incoming, MqttOptions, QoS};
use std::time::{Duration, Instant};

/// What to send.
#[derive(Debug, Clone, Copy)]
pub struct Plan {
    /// Distinct events.
    pub events: usize,
    /// Device ids (`dev-00`..), events dealt round robin.
    pub devices: usize,
    /// Every `dup_every`-th event is published twice with the same bytes.
    pub dup_every: usize,
    /// This many events are published again with different bytes.
    pub conflicts: usize,
}

/// What was sent.
#[derive(Debug, Clone, Default)]
pub struct Sent {
    pub distinct: usize,
    pub duplicates: usize,
    pub conflicts: usize,
    pub publishes: usize,
    pub elapsed: Duration,
}

/// The JSON envelope of event `i` (variant 0 is the real one; another
/// variant changes one field, so the same id gets other bytes).
pub fn envelope(plan: &Plan, i: usize, variant: u32) -> (String, Vec<u8>) {
    let dev = i % plan.devices;
    let seq = i / plan.devices + 1;
    let id = format!("{:08x}-0000-4000-8000-{:012x}", dev, i);
    let body = format!(
        r#"{{"event_id":"{id}","device_id":"dev-{dev:02}","stream":"load","seq":{seq},"ts_ms":{ts},"clock_trusted":true,"fields":{{"load1":{v},"variant":{variant}}}}}"#,
        ts = 1_800_000_000_000u64 + i as u64,
        v = (i % 97) as f64 / 10.0 + 0.05
    );
    (format!("dev-{dev:02}"), body.into_bytes())
}

/// Whether event `i` is one of the conflicting ones.
pub fn is_conflict(plan: &Plan, i: usize) -> bool {
    let stride = (plan.events / plan.conflicts.max(1)).max(1);
    plan.conflicts > 0 && i % stride == 3 && i / stride < plan.conflicts
}

/// Publish the plan to `<prefix>/<device>/events/load` on 127.0.0.1:`port`;
/// panics if the broker has not acknowledged everything within `timeout`.
pub fn publish(port: u16, prefix: &str, plan: Plan, timeout: Duration) -> Sent {
    let mut o = MqttOptions::new(format!("pub-{}", super::unique_suffix()), "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(10));
    o.set_inflight(100);
    let (client, mut conn) = Client::new(o, 1000);
    let prefix = prefix.to_owned();
    let started = Instant::now();
    let sender = std::thread::spawn(move || {
        let mut sent = Sent::default();
        let send = |dev: &str, body: Vec<u8>| {
            client
                .publish(
                    format!("{prefix}/{dev}/events/load"),
                    QoS::AtLeastOnce,
                    false,
                    body,
                )
                .expect("queue publish");
        };
        for i in 0..plan.events {
            let (dev, body) = envelope(&plan, i, 0);
            send(&dev, body.clone());
            sent.distinct += 1;
            if plan.dup_every > 0 && i % plan.dup_every == 0 {
                send(&dev, body);
                sent.duplicates += 1;
            }
            if is_conflict(&plan, i) {
                let (dev, other) = envelope(&plan, i, 1);
                send(&dev, other);
                sent.conflicts += 1;
            }
        }
        sent.publishes = sent.distinct + sent.duplicates + sent.conflicts;
        (sent, client)
    });
    let mut sender = Some(sender);
    let mut done: Option<(Sent, Client)> = None;
    let mut acked = 0usize;
    let deadline = Instant::now() + timeout;
    while done.as_ref().is_none_or(|(s, _)| acked < s.publishes) {
        assert!(
            Instant::now() < deadline,
            "publisher: {acked} acknowledged after {timeout:?}"
        );
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => acked += 1,
            Ok(Ok(_)) | Err(_) => {}
            Ok(Err(e)) => panic!("publisher connection failed: {e}"),
        }
        if sender.as_ref().is_some_and(|h| h.is_finished()) {
            let h = sender.take().expect("checked");
            done = Some(h.join().expect("publisher thread"));
        }
    }
    let (mut sent, client) = done.expect("sender finished");
    let _ = client.disconnect();
    sent.elapsed = started.elapsed();
    sent
}
