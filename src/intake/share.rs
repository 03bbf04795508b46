//! The spool's capacity as local peers may take it: each peer of the
//! ingest socket (its uid, `SO_PEERCRED`), of the TCP port (its IP address)
//! and each mqtt bridge holds at most a share of what the spool can hold,
//! all of them together at most the input's share, and a socket or TCP
//! peer sends at most a byte rate (a token bucket with a burst).
//!
//! Its one rule: **the board's own readings keep the rest**: what local
//! input holds in the spool unacknowledged never passes
//! `ingest.max_spool_share_input_percent` of its capacity, so a flood from
//! one peer, or from all of them, never makes the spool refuse the board's
//! own sources (`[[sources]]` other than bridges, the agent's events,
//! command results). A reading over a bound is refused before it is handed
//! over, with a sentence naming the bound ([`Refusal`]); nothing taken
//! before is touched (I6).
//!
//! Bookkeeping, in estimated stored bytes ([`row_bytes`]): a reading's room
//! is taken when it is admitted ([`Shares::admit`], a [`Claim`]); given back
//! if it is not stored; once stored it is held until the delivery's
//! acknowledged mark (every row at or below it is acknowledged or FAILED)
//! passes the newest row id the writer saw after its commit
//! ([`Shares::bound`], [`Shares::retire`]). Rows acknowledged out of order
//! stay counted until the mark passes them: the count errs on the safe side.
//!
//! The spool stores no peer per row, so what each peer held is not known
//! after a restart: the rows of local input found unacknowledged at start
//! count against the input's share, under no peer, until the mark passes
//! the newest of them ([`Shares::carry`]).

use crate::event::reading::{FieldValue, Fields};
use std::collections::{HashMap, VecDeque};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Default `ingest.max_bytes_per_sec_per_peer`: 1 MiB/s, about 5,000
/// readings of 200 bytes a second; a spool of 1 GiB takes its peer share
/// (256 MiB) in over 4 minutes at this rate.
pub const DEFAULT_BYTES_PER_SEC: u64 = 1024 * 1024;
/// Default `ingest.max_burst_bytes_per_peer`: 4 MiB, four seconds' worth.
pub const DEFAULT_BURST_BYTES: u64 = 4 * 1024 * 1024;
/// Default `ingest.max_spool_share_per_peer_percent`: a quarter, so two
/// peers at their share fill the input's share and no fewer.
pub const DEFAULT_PEER_PERCENT: u32 = 25;
/// Default `ingest.max_spool_share_input_percent`: half the spool for
/// local input, the other half for the board's own sources.
pub const DEFAULT_INPUT_PERCENT: u32 = 50;

/// What one row costs beyond its stream name and fields, in bytes: the
/// JSON envelope's fixed members with their longest values (event id 36,
/// `seq` and `ts_ms` 20 digits each, `clock_trusted` false), the event id
/// column (36) and the digest (32), about 200, and SQLite's record and
/// cell headers; and 80 for the clock stamp a reading taken before time
/// sync carries (`"boot_id"` 32 hex digits, `"mono_ms"` 20 digits: 76).
/// The device id is added to it ([`Shares::set_device_id_bytes`]).
pub const ROW_OVERHEAD_BYTES: u64 = 336;

/// Peers tracked one by one; past this, new peers share one entry
/// ([`PeerId::Crowd`]), so a public TCP port cannot grow the map.
pub const MAX_PEERS: usize = 1024;

/// Entries (row id, bytes) kept per peer; past this the newest entry is
/// widened instead (its bytes retire later, never earlier).
const MAX_ENTRIES: usize = 4096;

/// How often a refusal is logged.
const LOG_EVERY: Duration = Duration::from_secs(30);

/// Estimated stored bytes of a reading of `stream` with `fields`, for a
/// board whose device id is `device_id_bytes` long: the JSON envelope with
/// the longest form of each value (a number in its 24-character worst
/// case, a text escaped byte for byte), the event id and digest columns,
/// and [`ROW_OVERHEAD_BYTES`]. At least what either payload format stores
/// (postcard is smaller); `tests` hold it against the encoder.
pub fn row_bytes(stream: &str, fields: &Fields, device_id_bytes: u64) -> u64 {
    let fields: u64 = fields
        .iter()
        .map(|(name, v)| {
            // "name":value, with its comma.
            let value = match v {
                FieldValue::Num(_) => 24,
                FieldValue::Bool(_) => 5,
                FieldValue::Text(t) => json_text_bytes(t) + 2,
            };
            name.len() as u64 + 4 + value
        })
        .sum();
    ROW_OVERHEAD_BYTES + device_id_bytes + stream.len() as u64 + 2 + fields
}

/// Bytes of `t` as a JSON string's contents: control characters take six
/// (`\u0000`), `"` and `\` two.
fn json_text_bytes(t: &str) -> u64 {
    t.bytes()
        .map(|b| match b {
            b'"' | b'\\' => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum()
}

/// `pct` percent of `capacity` bytes, rounded down, without overflow.
fn share_of(capacity: u64, pct: u32) -> u64 {
    let pct = u64::from(pct);
    capacity / 100 * pct + capacity % 100 * pct / 100
}

/// `[ingest]`'s bounds of peers, as the ingest settings give them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShareSettings {
    /// `max_bytes_per_sec_per_peer`: the byte rate of a socket or TCP peer.
    pub bytes_per_sec: u64,
    /// `max_burst_bytes_per_peer`: the token bucket's size.
    pub burst_bytes: u64,
    /// `max_spool_share_per_peer_percent`: a peer's share of the capacity.
    pub peer_percent: u32,
    /// `max_spool_share_input_percent`: every peer and bridge together.
    pub input_percent: u32,
}

impl Default for ShareSettings {
    fn default() -> Self {
        ShareSettings {
            bytes_per_sec: DEFAULT_BYTES_PER_SEC,
            burst_bytes: DEFAULT_BURST_BYTES,
            peer_percent: DEFAULT_PEER_PERCENT,
            input_percent: DEFAULT_INPUT_PERCENT,
        }
    }
}

/// Who takes a share.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum PeerId {
    /// A client of the ingest socket running as this uid (`None`: the
    /// kernel did not say; such clients are one peer).
    Uid(Option<u32>),
    /// A client of the TCP port from this address ([`PeerId::ip`]): on
    /// loopback, every local user is the one peer `127.0.0.1` (tell them
    /// apart on the socket); an IPv6 address stands for its /64.
    Ip(IpAddr),
    /// An mqtt bridge (`[[sources]]` of `kind = "mqtt"`), by source name:
    /// every publisher of its local broker.
    Bridge(String),
    /// Every peer that came after [`MAX_PEERS`] others were tracked.
    Crowd,
}

impl PeerId {
    /// The peer of a TCP client at `ip`. A local user may connect from
    /// any address of 127.0.0.0/8 (or `::1`), and one host is routinely
    /// given a whole IPv6 /64: each is one peer, or one user would be as
    /// many peers as it likes. An IPv4 address mapped into IPv6 is the
    /// IPv4 one.
    pub fn ip(ip: IpAddr) -> PeerId {
        PeerId::Ip(match ip.to_canonical() {
            a if a.is_loopback() => Ipv4Addr::LOCALHOST.into(),
            IpAddr::V6(a) => {
                let s = a.segments();
                Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0).into()
            }
            a => a,
        })
    }
}

impl fmt::Display for PeerId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PeerId::Uid(Some(u)) => write!(f, "uid {u}"),
            PeerId::Uid(None) => f.write_str("uid unknown"),
            PeerId::Ip(IpAddr::V6(ip)) => write!(f, "ip {ip}/64"),
            PeerId::Ip(ip) => write!(f, "ip {ip}"),
            PeerId::Bridge(name) => write!(f, "bridge {name}"),
            PeerId::Crowd => write!(f, "the peers past the first {MAX_PEERS}"),
        }
    }
}

/// Why a reading was refused; its `Display` is the reply's sentence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The peer sent more than its byte rate allows.
    Rate {
        /// Who.
        peer: PeerId,
        /// `ingest.max_bytes_per_sec_per_peer`.
        bytes_per_sec: u64,
        /// `ingest.max_burst_bytes_per_peer`.
        burst_bytes: u64,
    },
    /// The peer holds its share of the spool.
    PeerShare {
        /// Who.
        peer: PeerId,
        /// Bytes it holds (estimated, unacknowledged or waiting for commit).
        held: u64,
        /// Its share, bytes.
        share: u64,
        /// `ingest.max_spool_share_per_peer_percent`.
        percent: u32,
        /// The spool's capacity now, bytes.
        capacity: u64,
    },
    /// Every peer and bridge together hold the input's share.
    InputShare {
        /// Bytes local input holds.
        held: u64,
        /// Its share, bytes.
        share: u64,
        /// `ingest.max_spool_share_input_percent`.
        percent: u32,
        /// The spool's capacity now, bytes.
        capacity: u64,
    },
}

impl Refusal {
    /// The counter suffix (`ingest_refused.<reason>`,
    /// `readings_refused_<reason>`): `peer_rate`, `peer_share`,
    /// `input_share`.
    pub fn reason(&self) -> &'static str {
        match self {
            Refusal::Rate { .. } => "peer_rate",
            Refusal::PeerShare { .. } => "peer_share",
            Refusal::InputShare { .. } => "input_share",
        }
    }

    /// The spool counter of this refusal (`readings_refused_<reason>`).
    pub fn counter(&self) -> String {
        format!("readings_refused_{}", self.reason())
    }
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Rate { peer, bytes_per_sec, burst_bytes } => write!(
                f,
                "not stored: {peer} sends faster than ingest.max_bytes_per_sec_per_peer ({bytes_per_sec} bytes/s, bursts of ingest.max_burst_bytes_per_peer {burst_bytes} bytes); send it again more slowly"
            ),
            Refusal::PeerShare { peer, held, share, percent, capacity } => write!(
                f,
                "not stored: {peer} holds {held} bytes of readings not yet delivered, its share is {share} bytes (ingest.max_spool_share_per_peer_percent {percent} of the spool's {capacity}); send it again once they are delivered"
            ),
            Refusal::InputShare { held, share, percent, capacity } => write!(
                f,
                "not stored: local input (ingest socket, TCP port, mqtt bridges) holds {held} bytes of readings not yet delivered, its share is {share} bytes (ingest.max_spool_share_input_percent {percent} of the spool's {capacity}; the rest is the board's own); send it again once they are delivered"
            ),
        }
    }
}

/// One peer's bookkeeping.
#[derive(Debug)]
struct Peer {
    /// Rate tokens (bytes) at `at`.
    tokens: f64,
    at: Instant,
    /// Admitted, outcome not known yet.
    inflight: u64,
    /// Stored, row id not bound yet.
    unbounded: u64,
    /// Stored with at most this row id: (row id, bytes), oldest first.
    bounded: VecDeque<(i64, u64)>,
    /// All of the above.
    held: u64,
}

/// What the ledger keeps.
#[derive(Debug)]
struct State {
    /// Bytes the spool can hold now (`None`: not judged yet).
    capacity: Option<u64>,
    /// The board's device id length (every payload carries it).
    device_id_bytes: u64,
    peers: HashMap<PeerId, Peer>,
    /// Local input's unacknowledged bytes found at start, and the newest
    /// row id then: held until the mark passes it.
    carried: (u64, i64),
    /// Every peer's `held` and `carried`.
    input: u64,
    /// Per reason ([`Refusal::reason`]): the last refusal logged and the
    /// refusals since.
    logged: [(Option<Instant>, u64); 3],
}

/// The peers' shares of the spool ([`self`]); shared by the listeners'
/// connections and the writer.
#[derive(Debug)]
pub struct Shares {
    settings: ShareSettings,
    state: Mutex<State>,
}

/// Room one admitted reading holds. [`Claim::stored`] once it is
/// committed; dropped otherwise (refused, or the agent stopped), the room
/// is given back.
#[derive(Debug)]
pub struct Claim {
    shares: Arc<Shares>,
    peer: PeerId,
    bytes: u64,
    stored: bool,
}

impl Shares {
    /// An empty ledger (capacity not judged yet: shares are judged from
    /// the first [`Shares::set_capacity`]).
    pub fn new(settings: ShareSettings) -> Shares {
        Shares {
            settings,
            state: Mutex::new(State {
                capacity: None,
                device_id_bytes: 0,
                peers: HashMap::new(),
                carried: (0, 0),
                input: 0,
                logged: [(None, 0); 3],
            }),
        }
    }

    /// The settings in force.
    pub fn settings(&self) -> ShareSettings {
        self.settings
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Every update is whole before anything can panic.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The board's device id is `n` bytes long (every row carries it).
    pub fn set_device_id_bytes(&self, n: usize) {
        self.lock().device_id_bytes = n as u64;
    }

    /// [`row_bytes`] of a reading on this board.
    pub fn cost(&self, stream: &str, fields: &Fields) -> u64 {
        row_bytes(stream, fields, self.lock().device_id_bytes)
    }

    /// The spool can hold `bytes` now (`spool.max_bytes`, or less when the
    /// filesystem has less room above its reserve).
    pub fn set_capacity(&self, bytes: u64) {
        self.lock().capacity = Some(bytes);
    }

    /// Local input's rows found unacknowledged at start: `bytes`, the
    /// newest of them `through` (a row id). Counted against the input's
    /// share, under no peer, until the acknowledged mark passes `through`.
    pub fn carry(&self, bytes: u64, through: i64) {
        let mut st = self.lock();
        st.input = st.input.saturating_sub(st.carried.0).saturating_add(bytes);
        st.carried = (bytes, through);
    }

    /// Admit a reading of `bytes` from `peer` at `now`: within the input's
    /// share, the peer's share and (for a socket or TCP peer) its byte
    /// rate, all or nothing. A peer holding nothing may take one reading
    /// larger than its share; a reading larger than the burst passes when
    /// the bucket is full.
    ///
    /// Errors: the first bound it is over (input share, peer share, rate).
    pub fn admit(
        self: &Arc<Self>,
        peer: &PeerId,
        bytes: u64,
        now: Instant,
    ) -> Result<Claim, Refusal> {
        let peer = self.take(peer, bytes, now, true, false)?;
        Ok(Claim {
            shares: self.clone(),
            peer,
            bytes,
            stored: false,
        })
    }

    /// A bridge's reading of `bytes`, taken as stored at once (the writer
    /// charges it as it buffers it; its row id is bound at the next
    /// [`Shares::bound`]). No rate: a bridge is paced by its broker.
    ///
    /// Errors: the input's or the bridge's share is full.
    pub fn charge(&self, peer: &PeerId, bytes: u64, now: Instant) -> Result<(), Refusal> {
        self.take(peer, bytes, now, false, true).map(|_| ())
    }

    /// Judge and take `bytes` for `peer`: as in flight, or as stored when
    /// `stored`. Returns the entry the bytes went to.
    fn take(
        &self,
        peer: &PeerId,
        bytes: u64,
        now: Instant,
        rated: bool,
        stored: bool,
    ) -> Result<PeerId, Refusal> {
        let s = self.settings;
        let mut guard = self.lock();
        let st = &mut *guard;
        let peer = if st.peers.len() >= MAX_PEERS && !st.peers.contains_key(peer) {
            PeerId::Crowd
        } else {
            peer.clone()
        };
        let burst = s.burst_bytes as f64;
        let p = st.peers.entry(peer.clone()).or_insert_with(|| Peer {
            tokens: burst,
            at: now,
            inflight: 0,
            unbounded: 0,
            bounded: VecDeque::new(),
            held: 0,
        });
        if let Some(capacity) = st.capacity {
            let input_share = share_of(capacity, s.input_percent);
            if st.input.saturating_add(bytes) > input_share {
                return Err(Refusal::InputShare {
                    held: st.input,
                    share: input_share,
                    percent: s.input_percent,
                    capacity,
                });
            }
            let peer_share = share_of(capacity, s.peer_percent);
            if p.held > 0 && p.held.saturating_add(bytes) > peer_share {
                return Err(Refusal::PeerShare {
                    peer,
                    held: p.held,
                    share: peer_share,
                    percent: s.peer_percent,
                    capacity,
                });
            }
        }
        if rated {
            let dt = now.saturating_duration_since(p.at).as_secs_f64();
            p.at = now.max(p.at);
            p.tokens = (p.tokens + dt * s.bytes_per_sec as f64).min(burst);
            let full = p.tokens >= burst;
            if p.tokens < bytes as f64 && !full {
                return Err(Refusal::Rate {
                    peer,
                    bytes_per_sec: s.bytes_per_sec,
                    burst_bytes: s.burst_bytes,
                });
            }
            p.tokens -= bytes as f64;
        }
        if stored {
            p.unbounded += bytes;
        } else {
            p.inflight += bytes;
        }
        p.held += bytes;
        st.input = st.input.saturating_add(bytes);
        Ok(peer)
    }

    /// Every reading stored so far has a row id at most `newest_row` (the
    /// writer's newest row id, read between its commits).
    pub fn bound(&self, newest_row: i64) {
        let mut st = self.lock();
        for p in st.peers.values_mut() {
            if p.unbounded == 0 {
                continue;
            }
            let bytes = std::mem::take(&mut p.unbounded);
            let full = p.bounded.len() >= MAX_ENTRIES;
            match p.bounded.back_mut() {
                Some(last) if last.0 == newest_row || full => {
                    *last = (newest_row.max(last.0), last.1 + bytes);
                }
                _ => p.bounded.push_back((newest_row, bytes)),
            }
        }
    }

    /// Every row at or below `acked_through` is acknowledged (or FAILED):
    /// what was held for them is given back. Peers that hold nothing and
    /// whose bucket is full again at `now` are forgotten.
    pub fn retire(&self, acked_through: i64, now: Instant) {
        let s = self.settings;
        let mut guard = self.lock();
        let st = &mut *guard;
        let mut freed = 0;
        for p in st.peers.values_mut() {
            while let Some(&(row, bytes)) = p.bounded.front() {
                if row > acked_through {
                    break;
                }
                p.bounded.pop_front();
                p.held = p.held.saturating_sub(bytes);
                freed += bytes;
            }
        }
        if st.carried.0 > 0 && st.carried.1 <= acked_through {
            freed += st.carried.0;
            st.carried = (0, 0);
        }
        st.input = st.input.saturating_sub(freed);
        let refill = Duration::from_secs_f64(s.burst_bytes as f64 / s.bytes_per_sec.max(1) as f64);
        st.peers
            .retain(|_, p| p.held > 0 || now.saturating_duration_since(p.at) < refill);
    }

    /// Whether to log refusal `r` at `now` (every 30 s at most per
    /// reason): `Some(n)`, the refusals for its reason since the last such
    /// line, this one included.
    pub fn log_due(&self, r: &Refusal, now: Instant) -> Option<u64> {
        let i = match r {
            Refusal::Rate { .. } => 0,
            Refusal::PeerShare { .. } => 1,
            Refusal::InputShare { .. } => 2,
        };
        let mut st = self.lock();
        let (last, since) = &mut st.logged[i];
        *since += 1;
        if last.is_some_and(|t| now.saturating_duration_since(t) < LOG_EVERY) {
            return None;
        }
        *last = Some(now);
        Some(std::mem::take(since))
    }

    /// Bytes local input holds (every peer, bridges and what was carried
    /// over from before the start).
    pub fn input_bytes(&self) -> u64 {
        self.lock().input
    }

    /// Bytes `peer` holds.
    pub fn held_by(&self, peer: &PeerId) -> u64 {
        self.lock().peers.get(peer).map_or(0, |p| p.held)
    }

    /// For `status`: what local input holds of its share and the peers
    /// holding most, e.g. `local input 9437184 of 16777216 bytes
    /// (max_spool_share_input_percent 50); ip 127.0.0.1 8388608, uid 0
    /// 2048`; `None` before the capacity is judged.
    pub fn describe(&self) -> Option<String> {
        let st = self.lock();
        let capacity = st.capacity?;
        let pct = self.settings.input_percent;
        let mut out = format!(
            "local input {} of {} bytes (max_spool_share_input_percent {pct} of {capacity})",
            st.input,
            share_of(capacity, pct)
        );
        if st.carried.0 > 0 {
            out.push_str(&format!("; {} from before the start", st.carried.0));
        }
        let mut top: Vec<(&PeerId, u64)> = st
            .peers
            .iter()
            .filter(|(_, p)| p.held > 0)
            .map(|(k, p)| (k, p.held))
            .collect();
        top.sort_by_key(|p| std::cmp::Reverse(p.1));
        for (peer, held) in top.iter().take(8) {
            out.push_str(&format!("; {peer} {held}"));
        }
        Some(out)
    }
}

impl Claim {
    /// The reading is committed: its room is held until its row is
    /// acknowledged.
    pub fn stored(mut self) {
        let mut st = self.shares.lock();
        if let Some(p) = st.peers.get_mut(&self.peer) {
            p.inflight = p.inflight.saturating_sub(self.bytes);
            p.unbounded += self.bytes;
        }
        self.stored = true;
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if self.stored {
            return;
        }
        let mut st = self.shares.lock();
        if let Some(p) = st.peers.get_mut(&self.peer) {
            p.inflight = p.inflight.saturating_sub(self.bytes);
            p.held = p.held.saturating_sub(self.bytes);
        }
        st.input = st.input.saturating_sub(self.bytes);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::envelope::{encode, Envelope, EventId, Format};

    fn settings() -> ShareSettings {
        ShareSettings {
            bytes_per_sec: 1000,
            burst_bytes: 2000,
            peer_percent: 25,
            input_percent: 50,
        }
    }

    fn uid(n: u32) -> PeerId {
        PeerId::Uid(Some(n))
    }

    #[test]
    fn a_peer_gets_its_burst_then_its_rate_and_a_refused_reading_costs_nothing() {
        let s = Arc::new(Shares::new(settings()));
        let t0 = Instant::now();
        let a = s.admit(&uid(1), 1500, t0).expect("within the burst");
        let over = s.admit(&uid(1), 1000, t0).expect_err("past the burst");
        assert_eq!(over.reason(), "peer_rate");
        assert!(
            over.to_string()
                .contains("ingest.max_bytes_per_sec_per_peer (1000 bytes/s"),
            "{over}"
        );
        // Half a second later 500 more tokens: 1000 fit.
        let b = s
            .admit(&uid(1), 1000, t0 + Duration::from_millis(500))
            .expect("refilled");
        // Another peer has its own bucket.
        let c = s.admit(&uid(2), 1500, t0).expect("its own bucket");
        assert_eq!(s.input_bytes(), 4000, "no capacity judged yet: no share");
        drop((a, b, c));
        assert_eq!(s.input_bytes(), 0, "refused or not stored: given back");
    }

    #[test]
    fn every_loopback_address_is_one_peer_and_an_ipv6_address_its_64() {
        let ip = |s: &str| PeerId::ip(s.parse().unwrap());
        assert_eq!(ip("127.0.0.2"), ip("127.0.0.1"));
        assert_eq!(ip("::1"), ip("127.9.9.9"));
        assert_eq!(ip("::ffff:10.0.0.7"), ip("10.0.0.7"));
        assert_ne!(ip("10.0.0.7"), ip("10.0.0.8"));
        assert_eq!(ip("2001:db8:1:2:aaaa::1"), ip("2001:db8:1:2:bbbb::9"));
        assert_ne!(ip("2001:db8:1:2::1"), ip("2001:db8:1:3::1"));
        assert_eq!(ip("2001:db8:1:2::1").to_string(), "ip 2001:db8:1:2::/64");
        assert_eq!(ip("127.0.0.5").to_string(), "ip 127.0.0.1");
    }

    #[test]
    fn a_reading_larger_than_the_burst_passes_when_the_bucket_is_full() {
        let s = Arc::new(Shares::new(settings()));
        let t0 = Instant::now();
        let big = s.admit(&uid(1), 5000, t0).expect("full bucket");
        assert!(s.admit(&uid(1), 1, t0 + Duration::from_secs(1)).is_err());
        drop(big);
    }

    #[test]
    fn a_peer_is_held_to_its_share_and_all_of_them_to_the_inputs() {
        let s = Arc::new(Shares::new(ShareSettings {
            bytes_per_sec: u64::MAX / 4,
            burst_bytes: u64::MAX / 4,
            ..settings()
        }));
        s.set_capacity(40_000); // peer share 10,000, input share 20,000
        let t0 = Instant::now();
        let mut held = Vec::new();
        for _ in 0..10 {
            held.push(s.admit(&uid(1), 1000, t0).expect("within its share"));
        }
        let e = s.admit(&uid(1), 1, t0).expect_err("its share is full");
        assert_eq!(e.reason(), "peer_share");
        assert!(e.to_string().contains("uid 1 holds 10000 bytes"), "{e}");
        assert!(
            e.to_string()
                .contains("max_spool_share_per_peer_percent 25"),
            "{e}"
        );
        for _ in 0..10 {
            held.push(s.admit(&uid(2), 1000, t0).expect("its own share"));
        }
        let e = s
            .admit(&uid(3), 1, t0)
            .expect_err("the input's share is full");
        assert_eq!(e.reason(), "input_share");
        assert_eq!(s.held_by(&uid(3)), 0);
        drop(held);
        assert_eq!(s.input_bytes(), 0);
    }

    #[test]
    fn stored_bytes_are_held_until_the_acknowledged_mark_passes_their_bound() {
        let s = Arc::new(Shares::new(settings()));
        s.set_capacity(1_000_000);
        let t0 = Instant::now();
        let first = s.admit(&uid(1), 100, t0).unwrap();
        let in_flight = s.admit(&uid(1), 100, t0).unwrap();
        first.stored();
        s.bound(10); // the first is at row 10 or below
        in_flight.stored(); // committed after that bound: a later one
        s.retire(9, t0);
        assert_eq!(s.held_by(&uid(1)), 200, "row 10 not acknowledged yet");
        s.retire(10, t0);
        assert_eq!(s.held_by(&uid(1)), 100, "the second is not bound yet");
        s.bound(12);
        s.retire(11, t0);
        assert_eq!(s.held_by(&uid(1)), 100);
        s.retire(12, t0);
        assert_eq!((s.held_by(&uid(1)), s.input_bytes()), (0, 0));
    }

    #[test]
    fn what_was_carried_over_counts_for_the_input_until_the_mark_passes_it() {
        let s = Arc::new(Shares::new(settings()));
        s.set_capacity(10_000); // input share 5,000
        s.carry(4_500, 50);
        let t0 = Instant::now();
        let e = s
            .admit(&uid(1), 600, t0)
            .expect_err("the carried bytes count");
        assert_eq!(e.reason(), "input_share");
        s.retire(49, t0);
        assert!(s.admit(&uid(1), 600, t0).is_err());
        s.retire(50, t0);
        assert_eq!(s.input_bytes(), 0);
        assert!(s.admit(&uid(1), 600, t0).is_ok());
    }

    #[test]
    fn a_bridge_is_charged_as_stored_and_has_no_rate() {
        let s = Arc::new(Shares::new(settings()));
        s.set_capacity(100_000); // peer share 25,000
        let b = PeerId::Bridge("plant".into());
        let t0 = Instant::now();
        for _ in 0..25 {
            s.charge(&b, 1000, t0).expect("no rate for a bridge");
        }
        assert_eq!(s.charge(&b, 1000, t0).unwrap_err().reason(), "peer_share");
        s.bound(7);
        s.retire(7, t0);
        assert_eq!(s.held_by(&b), 0);
    }

    #[test]
    fn peers_past_the_bound_share_one_entry_and_idle_ones_are_forgotten() {
        let s = Arc::new(Shares::new(settings()));
        let t0 = Instant::now();
        let mut claims = Vec::new();
        for n in 0..MAX_PEERS as u32 {
            claims.push(s.admit(&uid(n), 1, t0).unwrap());
        }
        let crowd = s.admit(&uid(99_999), 1, t0).unwrap();
        assert_eq!(crowd.peer, PeerId::Crowd);
        drop((claims, crowd));
        s.retire(0, t0 + Duration::from_secs(3));
        assert!(s.lock().peers.is_empty(), "idle peers with full buckets go");
    }

    #[test]
    fn entries_past_the_bound_widen_the_newest_and_never_retire_early() {
        let s = Arc::new(Shares::new(settings()));
        let t0 = Instant::now();
        let b = PeerId::Bridge("b".into());
        for row in 1..=(MAX_ENTRIES as i64 + 10) {
            s.charge(&b, 1, t0).unwrap();
            s.bound(row);
        }
        assert_eq!(s.lock().peers[&b].bounded.len(), MAX_ENTRIES);
        s.retire(MAX_ENTRIES as i64 + 9, t0);
        assert_eq!(
            s.held_by(&b),
            11,
            "the widened entry waits for its newest row"
        );
        s.retire(MAX_ENTRIES as i64 + 10, t0);
        assert_eq!(s.held_by(&b), 0);
    }

    #[test]
    fn the_estimate_is_at_least_what_the_spool_stores_for_a_row() {
        let id = EventId([0x5a; 16]);
        let cases: Vec<(&str, Fields)> = vec![
            ("s", vec![("v".into(), FieldValue::Num(1.0))]),
            (
                "pump",
                vec![(
                    "pressure_bar".into(),
                    FieldValue::Num(-1.2345678901234567e-300),
                )],
            ),
            (
                "a.b",
                vec![("t".into(), FieldValue::Text("\u{1}\"\\x".repeat(50)))],
            ),
            (
                "flood",
                (0..64)
                    .map(|i| (format!("f{i}"), FieldValue::Bool(i % 2 == 0)))
                    .collect(),
            ),
            ("x", vec![("t".into(), FieldValue::Text("é".repeat(300)))]),
        ];
        let device = "it-board-with-a-long-device-id";
        for (stream, fields) in cases {
            for format in [Format::Json, Format::Postcard] {
                let env = Envelope {
                    event_id: id,
                    device_id: device,
                    stream,
                    seq: u64::MAX >> 1,
                    ts_ms: i64::MAX,
                    clock_trusted: false,
                    mono: Some(crate::event::clock::MonoStamp {
                        boot_id: crate::event::clock::BootId([0xff; 16]),
                        mono_ms: u64::MAX,
                    }),
                    fields: &fields,
                };
                let payload = encode(format, &env).expect("encodes");
                // As the outage budget counts a row: payload, event id, digest.
                let stored = payload.len() as u64 + 36 + 32;
                let est = row_bytes(stream, &fields, device.len() as u64);
                assert!(
                    est >= stored,
                    "{stream} {format:?}: estimate {est} < stored {stored}"
                );
            }
        }
    }
}
