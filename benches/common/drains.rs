//! The drain comparison the backlog and wire benches both print (issue 24):
//! one backlog of `rows` readings, drained by
//!
//! - a bare rumqttc sync client publishing single events at QoS 1 (MQTT
//!   3.1.1 and 5; the agent's in-flight window of 32, its request channel,
//!   TCP_NODELAY, one payload of the agent's single-event size per row);
//! - the agent sending single events (MQTT 3.1.1 and 5);
//! - the agent sending batches of `batch_max_events = 50` (MQTT 5, plain
//!   JSON and lz4).
//!
//! Every case is timed at one subscriber (rumqttc, QoS 1, connected before
//! the publisher starts) from its first arrival to the last of the `rows`
//! events (a batch counts as its events, unpacked with the sink's own
//! reader); rows/s, the ratio to the bare client of the same protocol (the
//! batched cases: of MQTT 5), and the agent's CPU seconds (user + system,
//! the whole process from spawn to the last arrival) per 100,000 rows.
//! Each agent case drains its own copy of one spool filled once.

use edgespool::event::envelope::{EventIdGen, Format};
use edgespool::sink::unbatch::{decompress, split, topic_kind, TopicKind};
use edgespool::spool::{NewEvent, Spool, SpoolOptions};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::support::agent::AgentProc;
use crate::support::poll;

/// The agent's default `mqtt.inflight_window`.
const WINDOW: usize = 32;
const BATCH_EVENTS: usize = 50;

/// What one comparison drains and with what.
pub struct Setup<'a> {
    /// The agent binary.
    pub agent: &'a Path,
    /// A directory on disk for the spools and configs.
    pub dir: &'a Path,
    /// The broker's port on 127.0.0.1.
    pub port: u16,
    /// Rows in the backlog.
    pub rows: usize,
    /// The stream the rows are appended to.
    pub stream: &'a str,
    /// Reading `i` of the backlog (for `stream`).
    pub reading: &'a dyn Fn(usize) -> NewEvent,
}

/// Which publisher drains the backlog.
#[derive(Clone, Copy)]
enum Who {
    Bare,
    Single,
    Batch(&'static str),
}

/// One line of the table.
pub struct Figure {
    name: String,
    v5: bool,
    bare: bool,
    rows_per_sec: f64,
    cpu_per_100k: Option<f64>,
}

/// Fill a spool once, then drain it with every case in turn; prints a
/// line per case as it ends, and returns the figures for [`print`].
pub fn compare(s: &Setup) -> Vec<Figure> {
    let template = s.dir.join("compare-template.db");
    let t = Instant::now();
    let payload_len = fill(&template, s);
    println!(
        "  drain comparison: {} rows filled in {:.1} s ({} bytes per single-event payload)",
        s.rows,
        t.elapsed().as_secs_f64(),
        payload_len
    );
    let cases = [
        ("bare rumqttc", false, Who::Bare),
        ("bare rumqttc", true, Who::Bare),
        ("agent single", false, Who::Single),
        ("agent single", true, Who::Single),
        ("agent batch 50", true, Who::Batch("none")),
        ("agent batch 50 lz4", true, Who::Batch("lz4")),
    ];
    let mut out = Vec::new();
    for (n, (name, v5, who)) in cases.into_iter().enumerate() {
        let (rows_per_sec, cpu) = match who {
            Who::Bare => (bare(s, v5, payload_len, n), None),
            _ => {
                let (r, c) = agent(s, &template, v5, who, n);
                (r, Some(c))
            }
        };
        let proto = if v5 { "MQTT 5" } else { "MQTT 3.1.1" };
        println!(
            "  .. {name} ({proto}): {rows_per_sec:.0} rows/s{}",
            cpu.map_or(String::new(), |c| format!(", {c:.2} CPU s per 100k rows"))
        );
        out.push(Figure {
            name: format!("{name} ({proto})"),
            v5,
            bare: matches!(who, Who::Bare),
            rows_per_sec,
            cpu_per_100k: cpu,
        });
    }
    let _ = std::fs::remove_file(&template);
    out
}

/// The table: rows/s, the ratio to the bare client of the same protocol,
/// and agent CPU per 100,000 rows.
pub fn print(rows: usize, figs: &[Figure]) {
    println!("drain comparison, a {rows}-row backlog (one run, this machine):");
    println!(
        "  {:<30} {:>12} {:>10} {:>16}",
        "publisher", "rows/s", "vs bare", "CPU s/100k rows"
    );
    for f in figs {
        let bare = figs
            .iter()
            .find(|b| b.bare && b.v5 == f.v5)
            .map_or(f64::NAN, |b| b.rows_per_sec);
        println!(
            "  {:<30} {:>12.0} {:>9.2}x {:>16}",
            f.name,
            f.rows_per_sec,
            f.rows_per_sec / bare,
            f.cpu_per_100k.map_or("-".into(), |c| format!("{c:.2}"))
        );
    }
    let single = figs
        .iter()
        .find(|f| !f.bare && f.v5 && f.name.starts_with("agent single"));
    if let Some(single) = single {
        for f in figs.iter().filter(|f| f.name.starts_with("agent batch")) {
            println!(
                "  {}: {:.2}x the agent's single-event drain (MQTT 5)",
                f.name,
                f.rows_per_sec / single.rows_per_sec
            );
        }
    }
    println!("  (rows/s: first to last arrival at a QoS 1 subscriber; vs bare: the bare client of the same protocol, MQTT 5 for batches; CPU: the agent process, user + system, spawn to last arrival)");
}

/// Append the backlog; returns the single-event payload size of its first row.
fn fill(path: &Path, s: &Setup) -> usize {
    let mut spool = Spool::open(path, &SpoolOptions::default()).expect("open the template spool");
    let mut ids = EventIdGen::new().expect("event ids");
    let now = edgespool::event::envelope::wall_clock_ms().0;
    let mut done = 0;
    while done < s.rows {
        let n = 1000.min(s.rows - done);
        let evs: Vec<NewEvent> = (done..done + n).map(|i| (s.reading)(i)).collect();
        spool
            .append(&evs, &mut ids, "bench-device", Format::Json, now)
            .expect("append the backlog");
        done += n;
    }
    let first = spool.sendable(0, 1).expect("read the first row");
    first.first().map_or(175, |r| r.payload.len())
}

/// The bare client: `rows` single publishes at QoS 1; rows/s at the subscriber.
fn bare(s: &Setup, v5: bool, len: usize, n: usize) -> f64 {
    let prefix = format!("compare/{n}/bare");
    let topic = format!("{prefix}/events/bare");
    let sub = Subscriber::start(s.port, &prefix, s.rows);
    let payload = vec![b'x'; len];
    let deadline = Duration::from_secs(60 + s.rows as u64 / 500);
    let client = if v5 {
        std::thread::spawn({
            let (port, rows, topic) = (s.port, s.rows, topic.clone());
            move || bare_v5(port, &topic, rows, &payload, deadline)
        })
    } else {
        std::thread::spawn({
            let (port, rows, topic) = (s.port, s.rows, topic.clone());
            move || bare_v4(port, &topic, rows, &payload, deadline)
        })
    };
    let rate = sub.wait(deadline);
    let _ = client.join();
    rate
}

/// A bare rumqttc 3.1.1 client set up as the agent sets up its own: its
/// in-flight window, a request channel just above it, 1 MiB packets,
/// TCP_NODELAY.
pub fn bare_client(
    id: String,
    port: u16,
    keep_alive: Duration,
) -> (rumqttc::Client, rumqttc::Connection) {
    let mut o = rumqttc::MqttOptions::new(id, "127.0.0.1", port);
    o.set_keep_alive(keep_alive);
    o.set_inflight(WINDOW as u16);
    o.set_max_packet_size(1 << 20, 1 << 20);
    o.set_request_channel_capacity(WINDOW + 8);
    let (client, mut conn) = rumqttc::Client::new(o, WINDOW + 8);
    let mut net = conn.eventloop.network_options();
    net.set_tcp_nodelay(true);
    conn.eventloop.set_network_options(net);
    (client, conn)
}

fn bare_v4(port: u16, topic: &str, rows: usize, payload: &[u8], deadline: Duration) {
    use rumqttc::{Event, Incoming, QoS};
    let id = format!("compare-bare-{port}-v4");
    let (client, mut conn) = bare_client(id, port, Duration::from_secs(600));
    let publisher = {
        let (client, topic, payload) = (client.clone(), topic.to_owned(), payload.to_vec());
        std::thread::spawn(move || {
            for _ in 0..rows {
                let p = payload.clone();
                if client.publish(&topic, QoS::AtLeastOnce, false, p).is_err() {
                    return;
                }
            }
        })
    };
    let end = Instant::now() + deadline;
    let mut acks = 0;
    while acks < rows && Instant::now() < end {
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Incoming::PubAck(_)))) => acks += 1,
            Ok(Err(e)) => panic!("bare 3.1.1 publisher: {e}"),
            _ => {}
        }
    }
    let _ = client.try_disconnect();
    let _ = conn.recv_timeout(Duration::from_millis(200));
    drop(conn);
    let _ = publisher.join();
}

fn bare_v5(port: u16, topic: &str, rows: usize, payload: &[u8], deadline: Duration) {
    use rumqttc::v5::mqttbytes::v5::Packet;
    use rumqttc::v5::mqttbytes::QoS;
    use rumqttc::v5::{Client, Event, MqttOptions};
    let mut o = MqttOptions::new(format!("compare-bare-{port}-v5"), "127.0.0.1", port);
    o.set_keep_alive(Duration::from_secs(600));
    o.set_outgoing_inflight_upper_limit(WINDOW as u16);
    o.set_request_channel_capacity(WINDOW + 8);
    let mut net = rumqttc::NetworkOptions::new();
    net.set_tcp_nodelay(true);
    o.set_network_options(net);
    let (client, mut conn) = Client::new(o, WINDOW + 8);
    let publisher = {
        let (client, topic, payload) = (client.clone(), topic.to_owned(), payload.to_vec());
        std::thread::spawn(move || {
            for _ in 0..rows {
                let p = payload.clone();
                if client.publish(&topic, QoS::AtLeastOnce, false, p).is_err() {
                    return;
                }
            }
        })
    };
    let end = Instant::now() + deadline;
    let mut acks = 0;
    while acks < rows && Instant::now() < end {
        match conn.recv_timeout(Duration::from_secs(1)) {
            Ok(Ok(Event::Incoming(Packet::PubAck(_)))) => acks += 1,
            Ok(Err(e)) => panic!("bare MQTT 5 publisher: {e}"),
            _ => {}
        }
    }
    let _ = client.try_disconnect();
    let _ = conn.recv_timeout(Duration::from_millis(200));
    drop(conn);
    let _ = publisher.join();
}

/// The agent on a copy of `template`: rows/s at the subscriber and CPU
/// seconds per 100,000 rows.
fn agent(s: &Setup, template: &Path, v5: bool, who: Who, n: usize) -> (f64, f64) {
    let dir = s.dir.join(format!("compare-{n}"));
    std::fs::create_dir_all(&dir).expect("case dir");
    let db = dir.join("spool.db");
    std::fs::copy(template, &db).expect("copy the template spool");
    let prefix = format!("compare/{n}/agent");
    let batch = match who {
        Who::Batch(c) => format!(
            "batch_max_events = {BATCH_EVENTS}\nbatch_max_ms = 1000\ncompression = \"{c}\"\n"
        ),
        _ => String::new(),
    };
    let d = dir.display();
    let cfg = format!(
        "device_id = \"bench-device\"\n[spool]\npath = \"{d}/spool.db\"\ntune_from_probe = false\n\
         [mqtt]\nurl = \"mqtt://127.0.0.1:{}\"\ntopic_prefix = \"{prefix}\"\nclient_id = \"compare-{n}\"\n\
         protocol = \"{}\"\nkeep_alive_secs = 600\n[agent]\nsummary_interval_secs = 3600\n\
         [ingest]\nsocket = \"{d}/ingest.sock\"\n[[ingest.streams]]\nname = \"{}\"\n{batch}",
        s.port,
        if v5 { "5" } else { "3.1.1" },
        s.stream
    );
    let cfg_path = dir.join("agent.toml");
    std::fs::write(&cfg_path, cfg).expect("write the agent config");
    let sub = Subscriber::start(s.port, &prefix, s.rows);
    let mut proc = AgentProc::spawn_bin(s.agent, &cfg_path, &dir, "warn");
    let rate = sub.wait(Duration::from_secs(60 + s.rows as u64 / 500));
    let cpu = cpu_secs(proc.pid()).unwrap_or(f64::NAN);
    proc.terminate(Duration::from_secs(15));
    let _ = std::fs::remove_dir_all(&dir);
    (rate, cpu / s.rows as f64 * 100_000.0)
}

/// User + system CPU seconds of process `pid` so far (/proc/pid/stat).
fn cpu_secs(pid: u32) -> Option<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the command name (which may hold spaces) in parentheses.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split(' ').collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Some(ticks / hz)
}

/// A QoS 1 subscriber counting events (a batch as its members).
struct Subscriber {
    count: Arc<AtomicU64>,
    times: Arc<Mutex<(Option<Instant>, Option<Instant>)>>,
    stop: Arc<AtomicBool>,
    handle: Option<JoinHandle<()>>,
    target: u64,
}

impl Subscriber {
    /// Connect, subscribe to `<prefix>/events/#` and `<prefix>/batches/#`
    /// (not the agent's status topic) and wait for the SUBACKs.
    fn start(port: u16, prefix: &str, target: usize) -> Subscriber {
        use rumqttc::{Client, Event, Incoming, MqttOptions, QoS};
        let id = format!("compare-sub-{}", prefix.replace('/', "-"));
        let mut o = MqttOptions::new(id, "127.0.0.1", port);
        o.set_keep_alive(Duration::from_secs(600));
        o.set_max_packet_size(16 << 20, 16 << 20);
        let (client, mut conn) = Client::new(o, 64);
        for kind in ["events", "batches"] {
            client
                .subscribe(format!("{prefix}/{kind}/#"), QoS::AtLeastOnce)
                .expect("queue the subscription");
        }
        let count = Arc::new(AtomicU64::new(0));
        let times = Arc::new(Mutex::new((None, None)));
        let stop = Arc::new(AtomicBool::new(false));
        let subscribed = Arc::new(AtomicU64::new(0));
        let handle = {
            let (count, times, stop, subscribed) = (
                count.clone(),
                times.clone(),
                stop.clone(),
                subscribed.clone(),
            );
            let target = target as u64;
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    match conn.recv_timeout(Duration::from_millis(200)) {
                        Ok(Ok(Event::Incoming(Incoming::Publish(p)))) => {
                            let now = Instant::now();
                            let n = events(&p.topic, &p.payload);
                            let total = count.fetch_add(n, Ordering::Relaxed) + n;
                            let mut t = times.lock().unwrap_or_else(|e| e.into_inner());
                            t.0.get_or_insert(now);
                            if total >= target && t.1.is_none() {
                                t.1 = Some(now);
                            }
                        }
                        Ok(Ok(Event::Incoming(Incoming::SubAck(_)))) => {
                            subscribed.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
                let _ = client.try_disconnect();
            })
        };
        let subacked = poll(Duration::from_secs(10), Duration::from_millis(10), || {
            subscribed.load(Ordering::Relaxed) >= 2
        });
        assert!(subacked, "subscriber: no SUBACK within 10 s");
        Subscriber {
            count,
            times,
            stop,
            handle: Some(handle),
            target: target as u64,
        }
    }

    /// Wait for every event (at most `limit`); rows/s from the first
    /// arrival to the last (NaN if they did not all come).
    fn wait(&self, limit: Duration) -> f64 {
        let mut span = None;
        let all = poll(limit, Duration::from_millis(5), || {
            let t = *self.times.lock().unwrap_or_else(|e| e.into_inner());
            span = t.0.zip(t.1);
            span.is_some()
        });
        match span {
            Some((first, last)) if all => {
                self.target as f64 / (last - first).as_secs_f64().max(1e-6)
            }
            _ => {
                println!(
                    "  (only {} of {} events arrived)",
                    self.count.load(Ordering::Relaxed),
                    self.target
                );
                f64::NAN
            }
        }
    }
}

impl Drop for Subscriber {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}

/// Events in one delivery: a batch's members, else one.
fn events(topic: &str, payload: &[u8]) -> u64 {
    match topic_kind(topic) {
        TopicKind::Batch(c) => decompress(c, payload)
            .ok()
            .and_then(|p| split(&p).ok().map(|e| e.len() as u64))
            .unwrap_or(0),
        _ => 1,
    }
}
