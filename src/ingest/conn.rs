//! One ingest connection: a reader (this thread) and a writer thread.
//!
//! Its one rule: **every bound holds whatever the client does**: a line is
//! read up to `ingest.max_line_bytes` and never further (a longer one is
//! answered with an error naming the limit, then the connection closes),
//! at most [`MAX_PENDING`] requests and `ingest.max_connection_bytes` wait
//! for their commit per connection, within the listener's share of
//! `ingest.max_buffered_bytes` (past any of them the reader stops reading:
//! backpressure), requests are taken at most `ingest.max_rate_per_sec`
//! (token bucket; again by not reading), and a client that does not read
//! its replies for [`WRITE_TIMEOUT`] is closed. A request past its peer's
//! byte rate or share of the spool ([`crate::intake::share`]) is answered
//! with an error naming the bound; the connection stays open.
//!
//! Pipelining: the reader hands each request to the ingest thread at once
//! with its own reply channel and queues that channel for the writer, which
//! waits for the outcomes in request order. A client that sends many lines
//! before reading gets them all committed in the same commit window.

use super::request::{error_line, ok_line, parse_request, Request};
use super::{Counters, KeyScope, PatternStreams};
use crate::event::envelope::wall_clock_ms;
use crate::ingest::IngestConfig;
use crate::intake::budget::{Budget, Hold};
use crate::intake::share::{Claim, PeerId, Refusal, Shares};
use crate::intake::IngestMsg;
use crate::spool::{CommitOutcome, NewEvent, ReadingKey, Reply};
use std::io::{self, BufRead, BufReader, BufWriter, ErrorKind, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, SyncSender, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Requests of one connection handed to the ingest thread and not yet
/// answered; past this the reader waits for the writer.
pub const MAX_PENDING: usize = 1024;

/// A client that takes no reply bytes for this long is closed.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(30);

/// The reply to a request whose reading the agent could not commit before
/// it stopped (its reply channel closed without an outcome).
pub const STOPPING: &str = "agent stopping; not stored";

/// How long a connection may go without completing a request line: a
/// client that sends nothing, or trickles a line, for this long is told so
/// and closed, so idle or slow connections cannot hold the listener's
/// `ingest.max_connections` slots. A client that sends a reading every few
/// minutes reconnects for each (or sends them over a new connection).
pub const LINE_TIMEOUT: Duration = Duration::from_secs(60);

/// A connected client, over either listener.
#[derive(Debug)]
pub enum Stream {
    /// From `ingest.socket`.
    Unix(UnixStream),
    /// From `ingest.tcp`.
    Tcp(TcpStream),
}

impl Stream {
    /// Another handle to the same connection.
    pub fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
        })
    }

    /// `shutdown(2)` on the connection (every handle sees it).
    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.shutdown(how),
            Stream::Tcp(s) => s.shutdown(how),
        }
    }

    fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Tcp(s) => s.set_write_timeout(t),
        }
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Tcp(s) => s.set_read_timeout(t),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.read(buf),
            Stream::Tcp(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Unix(s) => s.write(buf),
            Stream::Tcp(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Unix(s) => s.flush(),
            Stream::Tcp(s) => s.flush(),
        }
    }
}

/// Decrements the listener's count of active readers when dropped (also
/// on an early return).
struct ReaderDone<'a>(&'a AtomicUsize);

impl Drop for ReaderDone<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Who is on the other end, as the bounds and the keys see it.
#[derive(Debug)]
pub struct Peer<'a> {
    /// The listener's counters.
    pub counters: &'a Counters,
    /// The listener's pattern-stream budget.
    pub patterns: &'a PatternStreams,
    /// This connection's memory budget (inside its listener's).
    pub budget: Arc<Budget>,
    /// The scope of its keys.
    pub scope: KeyScope,
    /// Every peer's rate and share of the spool.
    pub shares: &'a Arc<Shares>,
    /// Who it is, as the shares see it (its uid, or its IP address).
    pub who: PeerId,
}

/// What the writer answers next.
enum Pending {
    /// A request handed to the ingest thread: its outcome comes here; its
    /// room in memory is given back once the outcome is in, its room in
    /// the spool kept if it was stored.
    Wait(Receiver<CommitOutcome>, Hold, Claim),
    /// An answer known at once (a refusal), a whole reply line.
    Now(String),
}

/// Serve one connection until the client closes it, a bound closes it, or
/// [`Stream::shutdown`] from the listener's stop. Returns when every reply
/// it owes is written (or the client is gone).
///
/// `intake` is the listener's stop flag and count of readers still
/// handing requests over: once the flag is set no request is handed over
/// any more (a line already read but not handed over gets no reply: not
/// stored), and the count is decremented when this reader is done, so the
/// stop can wait for every hand-over before the last commit.
pub fn serve(
    stream: Stream,
    cfg: &IngestConfig,
    ingest: Sender<IngestMsg>,
    peer: &Peer<'_>,
    intake: (&AtomicBool, &AtomicUsize),
) {
    let reader_done = ReaderDone(intake.1);
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = stream.set_read_timeout(Some(LINE_TIMEOUT));
    let write_half = match stream.try_clone() {
        Ok(w) => w,
        Err(e) => {
            log::warn!("ingest: cannot serve a connection: {e}");
            return;
        }
    };
    let (out, replies) = mpsc::sync_channel::<Pending>(MAX_PENDING);
    let writer = std::thread::Builder::new()
        .name("ingest-reply".into())
        .spawn(move || write_replies(write_half, replies));
    let Ok(writer) = writer else {
        log::warn!("ingest: cannot start a reply thread; closing the connection");
        return;
    };
    let mut reader = BufReader::with_capacity(64 * 1024, stream);
    let overlong = read_requests(&mut reader, cfg, &ingest, peer, &out, intake.0);
    drop(reader_done);
    drop(out);
    let _ = writer.join();
    let stream = reader.into_inner();
    if overlong {
        // Half-close, then drain briefly what the client still sends:
        // closing a TCP socket with unread data sends a reset that can
        // destroy the error reply before the client reads it.
        let _ = stream.shutdown(Shutdown::Write);
        drain(stream);
    } else {
        let _ = stream.shutdown(Shutdown::Both);
    }
}

/// Read and hand over requests until EOF, an I/O error, an over-long line
/// (returns true: close after the replies) or a writer that is gone.
fn read_requests(
    reader: &mut BufReader<Stream>,
    cfg: &IngestConfig,
    ingest: &Sender<IngestMsg>,
    peer: &Peer<'_>,
    out: &SyncSender<Pending>,
    stop: &AtomicBool,
) -> bool {
    let counters = peer.counters;
    let mut bucket = TokenBucket::new(cfg.max_rate_per_sec, Instant::now());
    let mut line = Vec::with_capacity(1024);
    loop {
        let give_up = Instant::now() + LINE_TIMEOUT;
        match read_line(reader, &mut line, cfg.max_line_bytes, give_up) {
            Ok(Line::Eof) => return false,
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                counters.refused("idle");
                let why = format!(
                    "no complete request line for {} s; closing the connection",
                    LINE_TIMEOUT.as_secs()
                );
                let _ = out.send(Pending::Now(error_line(&why)));
                return true;
            }
            Err(_) => return false,
            Ok(Line::TooLong) => {
                counters.refused("line_too_long");
                let why = format!(
                    "line longer than {} bytes (ingest.max_line_bytes); closing the connection",
                    cfg.max_line_bytes
                );
                let _ = out.send(Pending::Now(error_line(&why)));
                return true;
            }
            Ok(Line::Line) => {}
        }
        if line.iter().all(u8::is_ascii_whitespace) {
            continue; // a blank line is no request and gets no reply
        }
        if let Some(wait) = bucket.take(Instant::now()) {
            std::thread::sleep(wait);
        }
        if stop.load(Ordering::Relaxed) {
            return false;
        }
        let parsed = parse_request(&line, cfg, wall_clock_ms())
            .and_then(|req| peer.patterns.admit(cfg, &req.stream.name).map(|()| req));
        let admitted = parsed.map(|req| {
            let cost = peer.shares.cost(&req.stream.name, &req.fields);
            (peer.shares.admit(&peer.who, cost, Instant::now()), req)
        });
        let pending = match admitted {
            Ok((Ok(claim), req)) => match hand_over(req, claim, peer, ingest, stop) {
                Some(p) => p,
                // Stopping while waiting for room: not handed over, no reply.
                None => return false,
            },
            Ok((Err(over), _)) => refuse_over(&over, peer),
            Err(e) => {
                counters.refused(e.reason());
                Pending::Now(error_line(&e.to_string()))
            }
        };
        if out.send(pending).is_err() {
            return false;
        }
    }
}

/// A request over its peer's rate or share: counted by reason
/// (`ingest_refused.<reason>` and `readings_refused_<reason>`), logged
/// every 30 s at most, answered with the bound's sentence.
fn refuse_over(over: &Refusal, peer: &Peer<'_>) -> Pending {
    peer.counters.refused(over.reason());
    peer.counters.add(&over.counter(), 1);
    if let Some(n) = peer.shares.log_due(over, Instant::now()) {
        log::warn!("ingest: {n} requests refused for {} since the last such line; the last: {over} (repeats logged every 30 s)", over.reason());
    }
    Pending::Now(error_line(&over.to_string()))
}

/// Take room in memory for `req` (waiting while the connection, its
/// listener or the whole input is full: backpressure, counted once per
/// wait), then hand it to the ingest thread with its room in the spool
/// (`claim`). `None`: the stop came while waiting (nothing handed over).
fn hand_over(
    req: Request,
    claim: Claim,
    peer: &Peer<'_>,
    ingest: &Sender<IngestMsg>,
    stop: &AtomicBool,
) -> Option<Pending> {
    let (reply, rx) = Reply::channel();
    // The key's digest holds the time only if the client gave it; the event
    // id holds the time the payload carries either way
    // ([`crate::event::envelope::derived_event_id`]), so only a client's own `ts_ms`
    // makes a resend after a rollback byte-identical under its first id.
    let given_ts = req.ts_given.then_some(req.ts_ms);
    let key = req.key.map(|k| {
        ReadingKey::new(
            peer.scope.as_text(),
            k,
            &req.stream.name,
            &req.fields,
            given_ts,
        )
    });
    let mut ev = NewEvent::new(req.stream.name, req.ts_ms, req.clock_trusted, req.fields);
    if !req.ts_given {
        // The agent's time, read microseconds ago: its monotonic stamp too.
        ev.mono = crate::os::clock::reading_now().mono.map(Box::new);
    }
    ev.key = key.map(Box::new);
    ev.reply = Some(reply);
    let stopping = || stop.load(Ordering::Relaxed);
    let (hold, waited) = peer.budget.take(ev.heap_bytes(), None, &stopping).ok()?;
    if let Some(full) = waited {
        peer.counters.add("ingest_backpressure", 1);
        peer.counters
            .add(&format!("ingest_backpressure.{}", full.level), 1);
    }
    if ingest.send(IngestMsg::Reading(ev)).is_ok() {
        peer.counters.add("ingest_requests", 1);
        Some(Pending::Wait(rx, hold, claim))
    } else {
        peer.counters.refused("agent_stopping");
        Some(Pending::Now(error_line(STOPPING)))
    }
}

/// The writer thread: replies in request order, flushed whenever it would
/// otherwise wait (so a pipelining client gets replies in batches, a
/// one-at-a-time client each at once).
fn write_replies(stream: Stream, pending: Receiver<Pending>) {
    let mut w = BufWriter::with_capacity(16 * 1024, stream);
    let mut failed = false;
    while let Some(p) = next_or_flush(&pending, &mut w, &mut failed) {
        let line = match p {
            Pending::Now(l) => l,
            Pending::Wait(rx, hold, claim) => {
                let line = match next_or_flush(&rx, &mut w, &mut failed) {
                    Some(Ok(c)) => {
                        claim.stored();
                        ok_line(&c.event_id.hyphenated(), c.synced)
                    }
                    Some(Err(why)) => error_line(&why.why),
                    None => error_line(STOPPING),
                };
                // The reading is committed or refused: its room is free.
                drop(hold);
                line
            }
        };
        if failed || w.write_all(line.as_bytes()).is_err() {
            failed = true;
            break;
        }
    }
    if !failed && w.flush().is_ok() {
        return;
    }
    // The client is gone or not reading: wake the reader so the connection
    // ends (its next send to us would fail anyway).
    let _ = w.get_ref().shutdown(Shutdown::Both);
    // The requests handed over still sit in the ingest thread's channel or
    // buffer: their room is given back only as their outcomes come, or a
    // client that hangs up at once could hand over without bound.
    for p in pending {
        if let Pending::Wait(rx, hold, claim) = p {
            if let Ok(Ok(_)) = rx.recv() {
                claim.stored();
            }
            drop(hold);
        }
    }
}

/// The next message of `rx`; if none is there yet, flush `w` first, then
/// wait. `None`: the channel closed.
fn next_or_flush<T>(rx: &Receiver<T>, w: &mut BufWriter<Stream>, failed: &mut bool) -> Option<T> {
    match rx.try_recv() {
        Ok(v) => Some(v),
        Err(TryRecvError::Disconnected) => None,
        Err(TryRecvError::Empty) => {
            if w.flush().is_err() {
                *failed = true;
            }
            rx.recv().ok()
        }
    }
}

/// Read what the client still sends for up to 500 ms or 64 KiB, then drop it.
fn drain(mut stream: Stream) {
    let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
    let give_up = Instant::now() + Duration::from_millis(500);
    let mut sink = [0u8; 4096];
    let mut drained = 0;
    while drained < 64 * 1024 && Instant::now() < give_up {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

/// What [`read_line`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Line {
    /// A line is in the buffer (without its `\n`; the last line of a
    /// stream may lack one).
    Line,
    /// The line is longer than the limit (what was read of it is dropped).
    TooLong,
    /// The stream ended with no further bytes.
    Eof,
}

/// Read one line into `buf` (cleared first), never holding more than `max`
/// bytes of it (unlike `read_line`, which grows without bound).
///
/// Errors: the reader's; `TimedOut` once `give_up` has passed with the line
/// still incomplete (checked between reads, so a client trickling bytes
/// cannot hold a connection past it).
pub fn read_line<R: BufRead>(
    r: &mut R,
    buf: &mut Vec<u8>,
    max: usize,
    give_up: Instant,
) -> io::Result<Line> {
    buf.clear();
    loop {
        if !buf.is_empty() && Instant::now() > give_up {
            return Err(io::Error::new(
                ErrorKind::TimedOut,
                "request line not completed in time",
            ));
        }
        let avail = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(if buf.is_empty() {
                Line::Eof
            } else {
                Line::Line
            });
        }
        let (take, done) = match avail.iter().position(|b| *b == b'\n') {
            Some(i) => (i, true),
            None => (avail.len(), false),
        };
        if buf.len() + take > max {
            return Ok(Line::TooLong);
        }
        buf.extend_from_slice(avail.get(..take).unwrap_or_default());
        r.consume(if done { take + 1 } else { take });
        if done {
            return Ok(Line::Line);
        }
    }
}

/// Requests per second with a burst of one second's worth.
#[derive(Debug)]
pub struct TokenBucket {
    rate: f64,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    /// Full bucket of `rate_per_sec` tokens at `now`.
    pub fn new(rate_per_sec: u32, now: Instant) -> TokenBucket {
        let rate = f64::from(rate_per_sec.max(1));
        TokenBucket {
            rate,
            tokens: rate,
            at: now,
        }
    }

    /// Take one token at `now`: `None` if there was one, else how long to
    /// wait before the request may go (the token is taken in advance).
    pub fn take(&mut self, now: Instant) -> Option<Duration> {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.at = now;
        self.tokens = (self.tokens + elapsed * self.rate).min(self.rate) - 1.0;
        (self.tokens < 0.0).then(|| Duration::from_secs_f64(-self.tokens / self.rate))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    #[test]
    fn a_line_not_completed_by_its_deadline_times_out() {
        // A reader that gives one byte per call, like a trickling client.
        struct Trickle(Vec<u8>);
        impl std::io::Read for Trickle {
            fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
                if self.0.is_empty() || buf.is_empty() {
                    return Ok(0);
                }
                buf[0] = self.0.remove(0);
                Ok(1)
            }
        }
        let mut r = std::io::BufReader::with_capacity(1, Trickle(b"{\"stream\"".to_vec()));
        let mut buf = Vec::new();
        let past = Instant::now() - Duration::from_millis(1);
        let e = read_line(&mut r, &mut buf, 1024, past).expect_err("timed out");
        assert_eq!(e.kind(), ErrorKind::TimedOut);
    }

    #[test]
    fn lines_are_read_up_to_the_limit_and_no_further() {
        let mut r = BufReader::with_capacity(4, &b"abc\n\nabcdef\nxy"[..]);
        let mut buf = Vec::new();
        assert_eq!(read_line(&mut r, &mut buf, 5, far()).ok(), Some(Line::Line));
        assert_eq!(buf, b"abc");
        assert_eq!(read_line(&mut r, &mut buf, 5, far()).ok(), Some(Line::Line));
        assert_eq!(buf, b"");
        assert_eq!(
            read_line(&mut r, &mut buf, 5, far()).ok(),
            Some(Line::TooLong)
        );
        assert!(buf.len() <= 5);
        let mut r = BufReader::new(&b"xy"[..]);
        assert_eq!(read_line(&mut r, &mut buf, 5, far()).ok(), Some(Line::Line));
        assert_eq!(buf, b"xy");
        assert_eq!(read_line(&mut r, &mut buf, 5, far()).ok(), Some(Line::Eof));
        // Exactly the limit is allowed.
        let mut r = BufReader::new(&b"12345\n"[..]);
        assert_eq!(read_line(&mut r, &mut buf, 5, far()).ok(), Some(Line::Line));
    }

    #[test]
    fn the_bucket_allows_a_second_of_burst_then_paces() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(10, t0);
        for _ in 0..10 {
            assert_eq!(b.take(t0), None);
        }
        let wait = b.take(t0).expect("must wait");
        assert!((wait.as_secs_f64() - 0.1).abs() < 1e-9, "{wait:?}");
        // After that wait, and another 100 ms, one more is free.
        assert_eq!(b.take(t0 + Duration::from_millis(200)), None);
    }
}
