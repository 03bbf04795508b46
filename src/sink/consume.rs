//! The sink's MQTT session: subscribe, gather batches, acknowledge after commit.
//!
//! Its one rule: a PUBACK (MQTT 3.1.1 §3.4, sent in the order the PUBLISH
//! packets arrived, §4.6) leaves only for a delivery whose transaction has
//! committed, and only on the connection that delivered it. rumqttc's manual
//! acks (`set_manual_acks(true)`, `Client::try_ack`) queue a `PubAck(pkid)`
//! request; the event loop writes it whenever it next polls, on whatever
//! connection it then has, and a packet id of a lost connection may name
//! another message on the next one. So a lost connection drops the whole
//! client (and any acknowledgement still queued in it): the next connection
//! starts from a new client with the same id and the persistent session, and
//! the broker sends again every message it holds unacknowledged (§4.4),
//! which the store then counts as a duplicate.

use super::batch::{BatchPolicy, Item};
use super::{SinkStats, Store, StoreError};
use rumqttc::{
    Client, ConnectReturnCode, Connection, Event, Incoming, MqttOptions, Publish, QoS,
    RecvTimeoutError, SubscribeFilter, SubscribeReasonCode,
};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Sink settings.
#[derive(Debug, Clone)]
pub struct SinkOptions {
    /// Broker host.
    pub host: String,
    /// Broker port.
    pub port: u16,
    /// Topic filter, e.g. `edgespool/+/events/#`.
    pub filter: String,
    /// MQTT client id. The broker keeps the session (and what it has not had
    /// acknowledged) under it: a restarted sink must come back with the same id.
    pub client_id: String,
    /// Subscribe as `$share/<group>/<filter>` to spread load over sinks.
    pub shared_group: Option<String>,
    /// When a batch commits.
    pub batch: BatchPolicy,
    /// Interval of the summary log line.
    pub report: Duration,
}

impl SinkOptions {
    /// Options with the default batch policy (500 deliveries, 100 ms window,
    /// 2 ms pause) and a 10 s summary line.
    pub fn new(host: String, port: u16, filter: String, client_id: String) -> SinkOptions {
        SinkOptions {
            host,
            port,
            filter,
            client_id,
            shared_group: None,
            batch: BatchPolicy {
                max: 500,
                window: Duration::from_millis(100),
                idle: Duration::from_millis(2),
            },
            report: Duration::from_secs(10),
        }
    }

    /// The filters as subscribed: `filter`, and its batch twin (see
    /// [`batches_filter`]) when it has one; each as `$share/GROUP/FILTER`
    /// with a group.
    pub fn subscriptions(&self) -> Vec<String> {
        let mut out = vec![self.filter.clone()];
        out.extend(batches_filter(&self.filter));
        match &self.shared_group {
            Some(g) => out.iter().map(|f| format!("$share/{g}/{f}")).collect(),
            None => out,
        }
    }
}

/// The filter for the batched publishes of the streams an events filter
/// names: `P/events/#` → `P/batches/#`; `P/events/S` (a stream or `+`) →
/// `P/batches/S/#`, which matches `P/batches/S` and its `/lz4` and `/zstd`
/// forms (`#` also matches the parent level, MQTT 3.1.1 §4.7.1.2). `None` for
/// a filter whose second-to-last level is not `events`: it is taken as
/// given (`edgespool/#` already matches the batches).
pub fn batches_filter(filter: &str) -> Option<String> {
    let (rest, last) = filter.rsplit_once('/')?;
    let prefix = match rest.rsplit_once('/') {
        Some((p, "events")) => format!("{p}/batches"),
        None if rest == "events" => "batches".to_owned(),
        _ => return None,
    };
    Some(match last {
        "#" => format!("{prefix}/#"),
        s => format!("{prefix}/{s}/#"),
    })
}

/// How one connection ended.
enum End {
    /// `stop` was set.
    Stop,
    /// Connection or store lost; reconnect after a pause.
    Lost(String),
}

/// Run the sink until `stop`; returns what it stored.
///
/// Errors: a fatal store error or a refused subscription (retrying cannot
/// help; exit non-zero).
pub fn run<S: Store>(
    opts: &SinkOptions,
    store: &mut S,
    stop: &AtomicBool,
) -> Result<SinkStats, String> {
    let mut totals = SinkStats::default();
    let mut backoff = Duration::from_millis(100);
    let mut last_report = Instant::now();
    while !stop.load(Ordering::Relaxed) {
        let (client, conn) = connect(opts);
        let began = Instant::now();
        match session(
            opts,
            store,
            &client,
            conn,
            stop,
            &mut totals,
            &mut last_report,
        )? {
            End::Stop => break,
            End::Lost(why) => {
                log::warn!("sink: connection lost: {why}; reconnecting in {backoff:?}");
                // A session that lasted is not a failure streak.
                if began.elapsed() > Duration::from_secs(30) {
                    backoff = Duration::from_millis(100);
                }
                sleep_unless(stop, backoff);
                backoff = (backoff * 2).min(Duration::from_secs(5));
            }
        }
    }
    Ok(totals)
}

/// A batch is committed once its payloads reach this many bytes, whatever
/// `--batch-max` says: with incoming packets of up to 16 MiB, 500 of them
/// would make one transaction too large for PostgreSQL (1 GiB per message),
/// fail every time and be redelivered for ever.
const MAX_BATCH_BYTES: usize = 16 << 20;

fn connect(opts: &SinkOptions) -> (Client, Connection) {
    let mut o = MqttOptions::new(opts.client_id.clone(), opts.host.clone(), opts.port);
    o.set_clean_session(false);
    o.set_manual_acks(true);
    o.set_keep_alive(Duration::from_secs(10));
    o.set_max_packet_size(16 << 20, 1 << 20);
    // Room for every acknowledgement of a full batch, so `try_ack` does not
    // find the request channel full in the common case.
    Client::new(o, opts.batch.max.saturating_mul(2).max(64))
}

/// One connection, from CONNECT to its loss or `stop`.
fn session<S: Store>(
    opts: &SinkOptions,
    store: &mut S,
    client: &Client,
    mut conn: Connection,
    stop: &AtomicBool,
    totals: &mut SinkStats,
    last_report: &mut Instant,
) -> Result<End, String> {
    let mut pending: Vec<Publish> = Vec::new();
    let mut items: Vec<Item> = Vec::new();
    // Payload bytes in `items`: a batch is also committed at MAX_BATCH_BYTES,
    // so a few large messages never make one transaction too big to send.
    let mut batch_bytes = 0usize;
    // Committed, not yet handed to the client (its channel was full).
    let mut acks: std::collections::VecDeque<Publish> = Default::default();
    let (mut first_at, mut last_at) = (Instant::now(), Instant::now());
    loop {
        while let Some(p) = acks.front() {
            if client.try_ack(p).is_err() {
                break;
            }
            acks.pop_front();
        }
        if stop.load(Ordering::Relaxed) {
            // The open batch is not acknowledged: the broker sends it again.
            flush_acks(client, &mut conn, &mut acks);
            let _ = client.try_disconnect();
            return Ok(End::Stop);
        }
        let wait = opts.batch.wait(
            items.len(),
            first_at.elapsed(),
            last_at.elapsed(),
            Duration::from_secs(1),
        );
        match conn.recv_timeout(wait) {
            Ok(Ok(Event::Incoming(Incoming::ConnAck(c)))) => {
                if c.code != ConnectReturnCode::Success {
                    return Ok(End::Lost(format!("broker refused: {:?}", c.code)));
                }
                let subs = opts.subscriptions();
                log::info!(
                    "sink: connected as {} (session_present {}), subscribing {}",
                    opts.client_id,
                    c.session_present,
                    subs.join(" ")
                );
                // rumqttc does not re-subscribe by itself; with a session
                // present it is a harmless repeat.
                let filters = subs
                    .into_iter()
                    .map(|f| SubscribeFilter::new(f, QoS::AtLeastOnce));
                if let Err(e) = client.try_subscribe_many(filters) {
                    return Ok(End::Lost(format!("subscribe request: {e}")));
                }
            }
            Ok(Ok(Event::Incoming(Incoming::SubAck(s)))) => {
                let subs = opts.subscriptions();
                // One return code per filter, in the order subscribed
                // (MQTT 3.1.1 §3.9.3).
                if let Some((f, _)) = subs
                    .iter()
                    .zip(&s.return_codes)
                    .find(|(_, c)| **c == SubscribeReasonCode::Failure)
                {
                    return Err(format!("broker refused the subscription {f}"));
                }
                log::info!("sink: subscribed {}", subs.join(" "));
            }
            Ok(Ok(Event::Incoming(Incoming::Publish(p)))) => {
                if items.is_empty() {
                    first_at = Instant::now();
                }
                last_at = Instant::now();
                // A batched publish becomes one item per event, all in
                // this transaction: its PUBACK waits for every one of them.
                let new = super::unbatch::items(&p.topic, &p.payload);
                let bytes: usize = new.iter().map(|it| it.payload.len()).sum();
                batch_bytes = batch_bytes.saturating_add(bytes);
                items.extend(new);
                pending.push(p);
            }
            Ok(Ok(_)) | Err(RecvTimeoutError::Timeout) => {}
            Ok(Err(e)) => return Ok(End::Lost(e.to_string())),
            Err(RecvTimeoutError::Disconnected) => {
                return Ok(End::Lost("event loop closed".into()))
            }
        }
        let full = !items.is_empty() && batch_bytes >= MAX_BATCH_BYTES;
        if full
            || opts
                .batch
                .due(items.len(), first_at.elapsed(), last_at.elapsed())
        {
            let now = crate::envelope::wall_clock_ms().0;
            match store.store_batch(&items, now) {
                Ok(s) => *totals += s,
                Err(StoreError::Transient(e)) => return Ok(End::Lost(format!("store: {e}"))),
                Err(e @ StoreError::Fatal(_)) => return Err(e.to_string()),
            }
            items.clear();
            batch_bytes = 0;
            acks.extend(pending.drain(..));
        }
        if last_report.elapsed() >= opts.report {
            *last_report = Instant::now();
            log::info!(
                "sink: first {} duplicates {} mismatches {} unreadable {}",
                totals.first,
                totals.duplicates,
                totals.mismatches,
                totals.unreadable
            );
        }
    }
}

/// Give queued acknowledgements a moment to leave before a clean stop
/// (one that does not go out is only a duplicate later).
fn flush_acks(
    client: &Client,
    conn: &mut Connection,
    acks: &mut std::collections::VecDeque<Publish>,
) {
    let deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < deadline {
        while let Some(p) = acks.front() {
            if client.try_ack(p).is_err() {
                break;
            }
            acks.pop_front();
        }
        match conn.recv_timeout(Duration::from_millis(50)) {
            Err(RecvTimeoutError::Timeout) if acks.is_empty() => return,
            Ok(Err(_)) | Err(RecvTimeoutError::Disconnected) => return,
            _ => {}
        }
    }
}

fn sleep_unless(stop: &AtomicBool, d: Duration) {
    let until = Instant::now() + d;
    while !stop.load(Ordering::Relaxed) && Instant::now() < until {
        std::thread::sleep(Duration::from_millis(20).min(until - Instant::now()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn batch_filters_follow_the_events_filter() {
        let f = |s: &str| batches_filter(s);
        assert_eq!(
            f("edgespool/+/events/#").as_deref(),
            Some("edgespool/+/batches/#")
        );
        assert_eq!(f("events/#").as_deref(), Some("batches/#"));
        assert_eq!(
            f("es/d1/events/system").as_deref(),
            Some("es/d1/batches/system/#")
        );
        assert_eq!(f("es/+/events/+").as_deref(), Some("es/+/batches/+/#"));
        assert_eq!(f("edgespool/#"), None);
        assert_eq!(f("#"), None);
        let mut o =
            crate::sink::SinkOptions::new("h".into(), 1, "es/+/events/#".into(), "c".into());
        o.shared_group = Some("g".into());
        assert_eq!(
            o.subscriptions(),
            vec!["$share/g/es/+/events/#", "$share/g/es/+/batches/#"]
        );
    }
}
