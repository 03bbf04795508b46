//! A userspace TCP fault proxy between an MQTT client and the broker.
//!
//! Both directions are parsed into whole MQTT packets (fixed header byte plus
//! the 1-4 byte "remaining length"), so packets can be counted, dropped or
//! discarded whole even when they arrive split across reads, and the stream
//! stays in sync when the mode changes back to `Forward`.

use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// How often blocked reads wake up to notice mode changes and shutdown.
const POLL: Duration = Duration::from_millis(50);
/// A write that cannot make progress for this long tears the connection down.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

const TYPE_CONNACK: u8 = 2;
const TYPE_PUBLISH: u8 = 3;
const TYPE_PUBACK: u8 = 4;
const TYPE_SUBSCRIBE: u8 = 8;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// Pass bytes both ways.
    Forward,
    /// Keep connections open but forward nothing in either direction; bytes
    /// read are discarded. Neither side sees a FIN or RST from the proxy, even
    /// if the other side goes away (a link that silently died). New
    /// connections are accepted but not connected upstream. Connections
    /// whose peer went away while blackholed are closed when the mode changes.
    Blackhole,
    /// Forward everything except PUBACK packets travelling broker -> client,
    /// which are removed from the stream (and counted).
    DropPubacks,
    /// Close every existing connection and close newly accepted ones at once.
    Refuse,
    /// Forward everything, but close a connection the moment the client sends
    /// SUBSCRIBE (a broker that answers an ACL deny by disconnecting).
    CloseOnSubscribe,
    /// Forward everything except PUBACK packets travelling client -> broker
    /// (a subscriber's acknowledgements lost), removed and counted.
    DropClientPubacks,
}

impl Mode {
    fn to_u8(self) -> u8 {
        match self {
            Mode::Forward => 0,
            Mode::Blackhole => 1,
            Mode::DropPubacks => 2,
            Mode::Refuse => 3,
            Mode::CloseOnSubscribe => 4,
            Mode::DropClientPubacks => 5,
        }
    }

    fn from_u8(v: u8) -> Mode {
        match v {
            0 => Mode::Forward,
            1 => Mode::Blackhole,
            2 => Mode::DropPubacks,
            3 => Mode::Refuse,
            4 => Mode::CloseOnSubscribe,
            5 => Mode::DropClientPubacks,
            _ => unreachable!("invalid proxy mode {v}"),
        }
    }
}

/// Result of looking at the start of a buffer for one MQTT packet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Frame {
    /// Not enough bytes yet to know, or to hold, the whole packet.
    Incomplete,
    /// The first `n` bytes are one whole packet (header included).
    Complete(usize),
    /// The remaining-length field has a continuation bit on its 4th byte.
    Malformed,
}

/// Look at the packet at the start of `buf`.
pub fn frame_len(buf: &[u8]) -> Frame {
    if buf.is_empty() {
        return Frame::Incomplete;
    }
    let mut remaining: usize = 0;
    for i in 0..4 {
        let Some(&byte) = buf.get(1 + i) else {
            return Frame::Incomplete;
        };
        remaining |= ((byte & 0x7f) as usize) << (7 * i);
        if byte & 0x80 == 0 {
            let total = 1 + (i + 1) + remaining;
            return if buf.len() >= total {
                Frame::Complete(total)
            } else {
                Frame::Incomplete
            };
        }
    }
    Frame::Malformed
}

/// Remove and return every complete packet at the front of `buf`, leaving a
/// partial tail (or malformed bytes, see [`frame_len`]) in `buf`.
pub fn split_packets(buf: &mut Vec<u8>) -> Vec<Vec<u8>> {
    let mut packets = Vec::new();
    let mut start = 0;
    while let Frame::Complete(n) = frame_len(&buf[start..]) {
        packets.push(buf[start..start + n].to_vec());
        start += n;
    }
    buf.drain(..start);
    packets
}

/// Encode an MQTT "remaining length" (for building packets in tests).
pub fn encode_remaining_length(mut len: usize) -> Vec<u8> {
    assert!(
        len < 268_435_456,
        "remaining length {len} too large for MQTT"
    );
    let mut out = Vec::with_capacity(4);
    loop {
        let mut byte = (len % 128) as u8;
        len /= 128;
        if len > 0 {
            byte |= 0x80;
        }
        out.push(byte);
        if len == 0 {
            return out;
        }
    }
}

struct Conn {
    client: TcpStream,
    /// None for connections accepted while blackholed (never sent upstream).
    upstream: Option<TcpStream>,
    closed: AtomicBool,
}

impl Conn {
    fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _ = self.client.shutdown(Shutdown::Both);
        if let Some(up) = &self.upstream {
            let _ = up.shutdown(Shutdown::Both);
        }
    }

    fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}

struct Shared {
    upstream: SocketAddr,
    mode: AtomicU8,
    stop: AtomicBool,
    pubacks_dropped: AtomicU64,
    /// A PUBLISH packet larger than this closes its connection (0: off).
    max_publish: AtomicU64,
    /// Connections closed because of a packet (SUBSCRIBE, oversized PUBLISH).
    closed_on_packet: AtomicU64,
    latency_ms: AtomicU64,
    rate_bytes_per_sec: AtomicU64,
    loss_pct: AtomicU64,
    rng: AtomicU64,
    publishes_seen: AtomicU64,
    publishes_forwarded: AtomicU64,
    accepted: AtomicU64,
    /// A client PUBLISH whose topic contains this closes its connection.
    close_on_topic: Mutex<Option<String>>,
    /// The next this many client SUBSCRIBEs close their connection.
    close_subscribes: AtomicU64,
    /// Maximum Packet Size written into MQTT 5 CONNACKs (0: unchanged).
    connack_max_packet: AtomicU64,
    conns: Mutex<Vec<Arc<Conn>>>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Shared {
    fn mode(&self) -> Mode {
        Mode::from_u8(self.mode.load(Ordering::SeqCst))
    }

    fn stopping(&self) -> bool {
        self.stop.load(Ordering::SeqCst)
    }

    fn close_all(&self) {
        let conns: Vec<Arc<Conn>> = self
            .conns
            .lock()
            .expect("proxy conns lock")
            .drain(..)
            .collect();
        for conn in conns {
            conn.close();
        }
    }

    fn spawn(&self, name: String, f: impl FnOnce() + Send + 'static) {
        let handle = std::thread::Builder::new()
            .name(name)
            .spawn(f)
            .expect("spawn proxy thread");
        let mut threads = self.threads.lock().expect("proxy threads lock");
        threads.retain(|h| !h.is_finished());
        threads.push(handle);
    }
}

pub struct Proxy {
    port: u16,
    shared: Arc<Shared>,
    acceptor: Option<JoinHandle<()>>,
}

impl Proxy {
    /// Listen on 127.0.0.1:<free port> and forward to 127.0.0.1:`upstream_port`.
    /// The mode starts as `Forward`.
    pub fn start(upstream_port: u16) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").expect("proxy: bind 127.0.0.1:0");
        let port = listener.local_addr().expect("proxy: local_addr").port();
        listener
            .set_nonblocking(true)
            .expect("proxy: set listener non-blocking");
        let shared = Arc::new(Shared {
            upstream: SocketAddr::from(([127, 0, 0, 1], upstream_port)),
            mode: AtomicU8::new(Mode::Forward.to_u8()),
            stop: AtomicBool::new(false),
            pubacks_dropped: AtomicU64::new(0),
            max_publish: AtomicU64::new(0),
            closed_on_packet: AtomicU64::new(0),
            latency_ms: AtomicU64::new(0),
            rate_bytes_per_sec: AtomicU64::new(0),
            loss_pct: AtomicU64::new(0),
            rng: AtomicU64::new(0x9e37_79b9_7f4a_7c15 ^ u64::from(port)),
            publishes_seen: AtomicU64::new(0),
            publishes_forwarded: AtomicU64::new(0),
            accepted: AtomicU64::new(0),
            close_on_topic: Mutex::new(None),
            close_subscribes: AtomicU64::new(0),
            connack_max_packet: AtomicU64::new(0),
            conns: Mutex::new(Vec::new()),
            threads: Mutex::new(Vec::new()),
        });
        let acceptor = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name(format!("proxy-accept-{port}"))
                .spawn(move || accept_loop(listener, shared))
                .expect("spawn proxy acceptor thread")
        };
        Proxy {
            port,
            shared,
            acceptor: Some(acceptor),
        }
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    pub fn url(&self) -> String {
        format!("mqtt://127.0.0.1:{}", self.port)
    }

    pub fn mode(&self) -> Mode {
        self.shared.mode()
    }

    /// Change the mode; it applies to existing connections too (within about
    /// 50 ms). Switching to `Refuse` closes every current connection at once.
    pub fn set_mode(&self, mode: Mode) {
        self.shared.mode.store(mode.to_u8(), Ordering::SeqCst);
        if mode == Mode::Refuse {
            self.shared.close_all();
        }
    }

    /// Close every current connection, both the client and the upstream side.
    pub fn reset_all(&self) {
        self.shared.close_all();
    }

    /// Close a connection on any PUBLISH packet larger than `bytes` (whole
    /// packet, as brokers count it); 0 turns this off.
    pub fn set_max_publish(&self, bytes: u64) {
        self.shared.max_publish.store(bytes, Ordering::SeqCst);
    }

    /// Close a connection on any client PUBLISH whose topic contains
    /// `part` (`None`: off): a broker, or a man in the middle, that drops
    /// the connection after every event it is sent.
    pub fn set_close_on_publish_to(&self, part: Option<&str>) {
        *self.shared.close_on_topic.lock().expect("proxy lock") = part.map(str::to_owned);
    }

    /// Close the connection on each of the next `n` client SUBSCRIBEs,
    /// whatever the mode (a link reset right after the subscribe).
    pub fn close_next_subscribes(&self, n: u64) {
        self.shared.close_subscribes.store(n, Ordering::SeqCst);
    }

    /// Announce `max` as the Maximum Packet Size (MQTT 5 §3.2.2.3.6) in
    /// every MQTT 5 CONNACK the broker sends (`None`: pass it unchanged): a
    /// hostile or misconfigured relay. The broker must not announce one of
    /// its own (mosquitto without `max_packet_size` does not).
    pub fn set_connack_max_packet(&self, max: Option<u32>) {
        self.shared
            .connack_max_packet
            .store(max.map_or(0, u64::from), Ordering::SeqCst);
    }

    /// Connections closed because of a SUBSCRIBE or an oversized PUBLISH.
    pub fn closed_on_packet(&self) -> u64 {
        self.shared.closed_on_packet.load(Ordering::SeqCst)
    }

    /// PUBACK packets removed (broker -> client) so far.
    /// Delay every forwarded chunk by `d` (both directions).
    pub fn set_latency(&self, d: Duration) {
        self.shared
            .latency_ms
            .store(d.as_millis() as u64, Ordering::SeqCst);
    }

    /// Cap forwarding at `bytes_per_sec` per direction per connection (0 = off).
    pub fn set_rate(&self, bytes_per_sec: u64) {
        self.shared
            .rate_bytes_per_sec
            .store(bytes_per_sec, Ordering::SeqCst);
    }

    /// Stall `percent` of forwarded chunks by 200 ms, as retransmissions after
    /// random loss would (0 = off).
    pub fn set_loss(&self, percent: u64) {
        self.shared
            .loss_pct
            .store(percent.min(100), Ordering::SeqCst);
    }

    pub fn pubacks_dropped(&self) -> u64 {
        self.shared.pubacks_dropped.load(Ordering::SeqCst)
    }

    /// PUBLISH packets parsed client -> broker and actually written to the
    /// broker so far (those discarded while blackholed are not included; see
    /// [`Proxy::publishes_seen`]).
    pub fn publishes_forwarded(&self) -> u64 {
        self.shared.publishes_forwarded.load(Ordering::SeqCst)
    }

    /// PUBLISH packets parsed client -> broker so far, forwarded or not.
    pub fn publishes_seen(&self) -> u64 {
        self.shared.publishes_seen.load(Ordering::SeqCst)
    }

    /// Client connections accepted so far (including ones refused).
    pub fn connections_accepted(&self) -> u64 {
        self.shared.accepted.load(Ordering::SeqCst)
    }

    /// Connections currently open through the proxy.
    pub fn active_connections(&self) -> usize {
        let mut conns = self.shared.conns.lock().expect("proxy conns lock");
        conns.retain(|c| !c.is_closed());
        conns.len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        self.shared.close_all();
        if let Some(acceptor) = self.acceptor.take() {
            let _ = acceptor.join();
        }
        // The acceptor has stopped, so no thread is added after this.
        let threads: Vec<JoinHandle<()>> = self
            .shared
            .threads
            .lock()
            .map(|mut t| t.drain(..).collect())
            .unwrap_or_default();
        for t in threads {
            let _ = t.join();
        }
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut n = 0u64;
    while !shared.stopping() {
        let client = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock || e.kind() == ErrorKind::Interrupted => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            Err(_) => {
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        shared.accepted.fetch_add(1, Ordering::SeqCst);
        n += 1;
        let mode = shared.mode();
        if mode == Mode::Refuse {
            let _ = client.shutdown(Shutdown::Both);
            continue;
        }
        if configure(&client).is_err() {
            continue;
        }
        let upstream = if mode == Mode::Blackhole {
            None
        } else {
            match TcpStream::connect_timeout(&shared.upstream, CONNECT_TIMEOUT) {
                Ok(up) if configure(&up).is_ok() => Some(up),
                // Upstream unreachable: the client sees its connection closed.
                _ => {
                    let _ = client.shutdown(Shutdown::Both);
                    continue;
                }
            }
        };
        let has_upstream = upstream.is_some();
        let conn = Arc::new(Conn {
            client,
            upstream,
            closed: AtomicBool::new(false),
        });
        {
            let mut conns = shared.conns.lock().expect("proxy conns lock");
            conns.retain(|c| !c.is_closed());
            conns.push(Arc::clone(&conn));
        }
        // A mode change to Refuse may have raced with the registration above.
        if shared.mode() == Mode::Refuse || shared.stopping() {
            conn.close();
            continue;
        }
        if has_upstream {
            for dir in [Direction::ToBroker, Direction::ToClient] {
                let (shared2, conn2) = (Arc::clone(&shared), Arc::clone(&conn));
                shared.spawn(format!("proxy-{n}-{dir:?}"), move || {
                    pump(&shared2, &conn2, dir)
                });
            }
        } else {
            let (shared2, conn2) = (Arc::clone(&shared), Arc::clone(&conn));
            shared.spawn(format!("proxy-{n}-held"), move || hold(&shared2, &conn2));
        }
    }
    shared.close_all();
}

fn configure(stream: &TcpStream) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(POLL))?;
    stream.set_write_timeout(Some(WRITE_TIMEOUT))?;
    Ok(())
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Direction {
    ToBroker,
    ToClient,
}

/// Copy one direction of a connection, packet by packet, applying the mode.
/// Added latency, a bandwidth cap and "random loss" (as TCP sees it: a lost
/// segment is a retransmission stall, here 200 ms) before `len` bytes go out.
fn shape(shared: &Shared, len: usize) {
    let lat = shared.latency_ms.load(Ordering::SeqCst);
    if lat > 0 {
        std::thread::sleep(Duration::from_millis(lat));
    }
    let rate = shared.rate_bytes_per_sec.load(Ordering::SeqCst);
    if let Some(us) = (len as u64 * 1_000_000).checked_div(rate) {
        std::thread::sleep(Duration::from_micros(us));
    }
    let loss = shared.loss_pct.load(Ordering::SeqCst);
    if loss > 0 {
        let mut x = shared.rng.load(Ordering::SeqCst);
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        shared.rng.store(x, Ordering::SeqCst);
        if x % 100 < loss {
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

fn pump(shared: &Shared, conn: &Conn, dir: Direction) {
    let upstream = conn.upstream.as_ref().expect("pump needs an upstream");
    let (mut src, mut dst) = match dir {
        Direction::ToBroker => (&conn.client, upstream),
        Direction::ToClient => (upstream, &conn.client),
    };
    let mut chunk = vec![0u8; 64 * 1024];
    let mut pending: Vec<u8> = Vec::new();
    // Set once the stream cannot be framed; bytes are then copied as they come.
    let mut raw = false;
    loop {
        if shared.stopping() || conn.is_closed() || shared.mode() == Mode::Refuse {
            break;
        }
        let n = match src.read(&mut chunk) {
            Ok(0) => {
                stall_if_blackholed(shared, conn);
                break;
            }
            Ok(n) => n,
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) =>
            {
                continue
            }
            Err(_) => {
                stall_if_blackholed(shared, conn);
                break;
            }
        };
        let mode = shared.mode();
        match mode {
            Mode::Refuse => break,
            Mode::Blackhole if raw => continue,
            _ => {}
        }
        let mut out: Vec<u8> = Vec::new();
        let mut publishes = 0u64;
        if raw {
            out.extend_from_slice(&chunk[..n]);
        } else {
            pending.extend_from_slice(&chunk[..n]);
            for packet in split_packets(&mut pending) {
                let ptype = packet[0] >> 4;
                if dir == Direction::ToBroker && ptype == TYPE_PUBLISH {
                    shared.publishes_seen.fetch_add(1, Ordering::SeqCst);
                }
                let too_big = shared.max_publish.load(Ordering::SeqCst);
                if dir == Direction::ToBroker
                    && ((ptype == TYPE_SUBSCRIBE
                        && (mode == Mode::CloseOnSubscribe || take_one(&shared.close_subscribes)))
                        || (ptype == TYPE_PUBLISH && too_big > 0 && packet.len() as u64 > too_big)
                        || (ptype == TYPE_PUBLISH && closes_on_topic(shared, &packet)))
                {
                    // Like a broker that refuses by disconnecting.
                    shared.closed_on_packet.fetch_add(1, Ordering::SeqCst);
                    conn.close();
                    return;
                }
                match mode {
                    Mode::Blackhole | Mode::Refuse => continue,
                    Mode::DropPubacks if dir == Direction::ToClient && ptype == TYPE_PUBACK => {
                        shared.pubacks_dropped.fetch_add(1, Ordering::SeqCst);
                        continue;
                    }
                    Mode::DropClientPubacks
                        if dir == Direction::ToBroker && ptype == TYPE_PUBACK =>
                    {
                        shared.pubacks_dropped.fetch_add(1, Ordering::SeqCst);
                        continue;
                    }
                    _ => {}
                }
                if dir == Direction::ToBroker && ptype == TYPE_PUBLISH {
                    publishes += 1;
                }
                let max = shared.connack_max_packet.load(Ordering::SeqCst);
                if dir == Direction::ToClient && ptype == TYPE_CONNACK && max > 0 {
                    out.extend_from_slice(&with_max_packet(&packet, max as u32));
                    continue;
                }
                out.extend_from_slice(&packet);
            }
            if frame_len(&pending) == Frame::Malformed {
                raw = true;
                if mode != Mode::Blackhole {
                    out.append(&mut pending);
                }
                pending.clear();
            }
        }
        if !out.is_empty() {
            shape(shared, out.len());
            if dst.write_all(&out).is_err() {
                break;
            }
            shared
                .publishes_forwarded
                .fetch_add(publishes, Ordering::SeqCst);
        }
    }
    conn.close();
}

/// Take one from `n` if it is above 0.
fn take_one(n: &AtomicU64) -> bool {
    n.fetch_update(Ordering::SeqCst, Ordering::SeqCst, |v| v.checked_sub(1))
        .is_ok()
}

/// Whether `packet` (a whole PUBLISH) goes to a topic the proxy closes on.
fn closes_on_topic(shared: &Shared, packet: &[u8]) -> bool {
    let part = shared.close_on_topic.lock().expect("proxy lock").clone();
    let Some(part) = part else {
        return false;
    };
    // Fixed header, Remaining Length (1 to 4 bytes), then the topic's length.
    let start = 1
        + packet[1..]
            .iter()
            .take(4)
            .take_while(|b| *b & 0x80 != 0)
            .count()
        + 1;
    let topic = packet.get(start..start + 2).and_then(|l| {
        let len = usize::from(u16::from_be_bytes([l[0], l[1]]));
        packet.get(start + 2..start + 2 + len)
    });
    topic.is_some_and(|t| String::from_utf8_lossy(t).contains(&part))
}

/// An MQTT 5 CONNACK (`packet`, whole) with the Maximum Packet Size
/// property `max` appended to its properties; a 3.1.1 CONNACK (two bytes,
/// no properties) as it is.
fn with_max_packet(packet: &[u8], max: u32) -> Vec<u8> {
    let start = 1
        + packet[1..]
            .iter()
            .take(4)
            .take_while(|b| *b & 0x80 != 0)
            .count()
        + 1;
    let body = &packet[start..];
    if body.len() <= 2 {
        return packet.to_vec();
    }
    // Flags, reason code, then the properties' length (a variable integer).
    let mut len = 0usize;
    let mut n = 0;
    while let Some(b) = body.get(2 + n) {
        len |= usize::from(b & 0x7f) << (7 * n);
        n += 1;
        if b & 0x80 == 0 || n == 4 {
            break;
        }
    }
    let mut props = body[2 + n..].to_vec();
    props.truncate(len);
    props.push(0x27);
    props.extend_from_slice(&max.to_be_bytes());
    let mut new_body = body[..2].to_vec();
    new_body.extend(encode_remaining_length(props.len()));
    new_body.extend(props);
    let mut out = vec![packet[0]];
    out.extend(encode_remaining_length(new_body.len()));
    out.extend(new_body);
    out
}

/// While blackholed, a peer that goes away must not be reported to the other
/// side: wait (silently) until the mode changes or the proxy stops.
fn stall_if_blackholed(shared: &Shared, conn: &Conn) {
    while shared.mode() == Mode::Blackhole && !shared.stopping() && !conn.is_closed() {
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A connection accepted while blackholed: read and discard until the mode
/// changes, then close it (it never reached the broker).
fn hold(shared: &Shared, conn: &Conn) {
    let mut chunk = vec![0u8; 16 * 1024];
    let mut src = &conn.client;
    let mut peer_gone = false;
    while shared.mode() == Mode::Blackhole && !shared.stopping() && !conn.is_closed() {
        if peer_gone {
            std::thread::sleep(Duration::from_millis(20));
            continue;
        }
        match src.read(&mut chunk) {
            Ok(0) => peer_gone = true,
            Ok(_) => {}
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::WouldBlock | ErrorKind::TimedOut | ErrorKind::Interrupted
                ) => {}
            Err(_) => peer_gone = true,
        }
    }
    conn.close();
}
