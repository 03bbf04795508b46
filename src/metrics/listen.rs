//! `metrics.listen`: a minimal HTTP/1.x responder serving `GET /metrics`
//! from the [`Snapshot`] the ingest thread publishes.
//!
//! Its one rule: **the listener is attack surface, so everything it accepts
//! is bounded, and no client waits on another.** One thread serves every
//! connection as its bytes arrive (`poll(2)` over non-blocking sockets): a
//! scrape is answered as soon as its request head is in, however many
//! other clients trickle a byte at a time or say nothing. At most
//! [`MAX_CONNECTIONS`] are held; one more closes the oldest (the slowest:
//! a request that is answered leaves at once). Each connection must send
//! its request head, at most [`MAX_HEAD_BYTES`], within
//! [`REQUEST_DEADLINE`] and take its answer within [`WRITE_TIMEOUT`]; no
//! request body is read; `Connection: close` on every answer. Anything but
//! `GET`/`HEAD /metrics` gets 400, 404, 405, 408 or 431; it never panics
//! on input and never touches the spool (loopback only unless
//! `metrics.listen_public`, enforced by the config).
//!
//! Why not a thread per connection: on a small board, 64 stacks for
//! clients that trickle is what a slow-client attack wants; a poll loop
//! costs one thread and a buffer per connection.
//!
//! Why not a crate: tiny_http 0.12 (its last release, 2022) runs an accept
//! thread and a pool of at least 4 worker threads with no bound on
//! connections, and reads a header line with no length limit; for one
//! fixed text body, a small std responder is less code to trust.

use super::{Snapshot, CONTENT_TYPE};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest request head (request line and headers) read, bytes; a larger
/// one is answered 431.
pub const MAX_HEAD_BYTES: usize = 8 * 1024;

/// The request head must arrive within this, whatever the pace of its
/// bytes; then it is answered 408 and closed.
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(3);

/// Connections held at once; one more closes the oldest. Each costs a
/// descriptor and at most [`MAX_HEAD_BYTES`] plus one answer of memory.
pub const MAX_CONNECTIONS: usize = 64;

/// Writing the answer may take this long.
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// After the answer, what the client still sends (a body we did not read)
/// is read and dropped for this long, up to [`DRAIN_BYTES`]: closing with
/// unread data makes the kernel send a reset that can destroy the answer
/// before it is read.
const DRAIN_TIME: Duration = Duration::from_millis(500);
/// See [`DRAIN_TIME`].
const DRAIN_BYTES: usize = 64 * 1024;

/// New connections taken per round of the loop, so that the ones already
/// in are read between bursts.
const ACCEPT_BURST: usize = 8;

/// The loop wakes at least this often (to see the stop flag without
/// [`wake`]).
const TICK: Duration = Duration::from_millis(250);

/// After an accept error (a full descriptor table), new connections wait
/// this long before the next try; the ones in are served meanwhile.
const ACCEPT_PAUSE: Duration = Duration::from_millis(200);

/// Size of one read.
const CHUNK: usize = 1024;

/// A running listener (see [`start`]).
#[derive(Debug)]
pub struct Listener {
    /// Where it listens (the address it got, e.g. the port chosen for 0).
    pub addr: SocketAddr,
    stop: Arc<AtomicBool>,
    handle: std::thread::JoinHandle<()>,
}

/// Bind `addr` and serve `snapshot` on a thread of its own.
///
/// Errors: the address is in use or not ours to bind, or the thread cannot
/// start; the caller runs on without a listener.
pub fn start(addr: SocketAddr, snapshot: Snapshot) -> std::io::Result<Listener> {
    let listener = TcpListener::bind(addr)?;
    listener.set_nonblocking(true)?;
    let mut addr = listener.local_addr()?;
    if addr.ip().is_unspecified() {
        // The wake-up connection goes to this host itself.
        addr.set_ip(match addr {
            SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
            SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
        });
    }
    let stop = Arc::new(AtomicBool::new(false));
    let handle = {
        let stop = stop.clone();
        std::thread::Builder::new()
            .name("metrics".into())
            .spawn(move || serve(listener, snapshot, stop))?
    };
    Ok(Listener { addr, stop, handle })
}

impl Listener {
    /// Tell the thread to stop and wake it; join the returned handle.
    pub fn stop(self) -> std::thread::JoinHandle<()> {
        self.stop.store(true, Ordering::Relaxed);
        wake(self.addr);
        self.handle
    }
}

/// The listener thread: serve every connection as its bytes come until
/// `stop` is set (it is seen within [`TICK`], at once after [`wake`]).
/// Accept errors (a full descriptor table) are logged at most once a
/// minute and new connections wait [`ACCEPT_PAUSE`].
pub fn serve(listener: TcpListener, snapshot: Snapshot, stop: Arc<AtomicBool>) {
    if let Err(e) = listener.set_nonblocking(true) {
        log::warn!("metrics.listen: cannot make the socket non-blocking: {e}; not serving");
        return;
    }
    let mut conns: Vec<Conn> = Vec::with_capacity(MAX_CONNECTIONS);
    let mut fds: Vec<libc::pollfd> = Vec::with_capacity(MAX_CONNECTIONS + 1);
    let mut last_error: Option<Instant> = None;
    let mut paused_until: Option<Instant> = None;
    while !stop.load(Ordering::Relaxed) {
        let now = Instant::now();
        for c in &mut conns {
            c.check_deadline(now, &snapshot);
        }
        conns.retain(|c| !c.done());
        let accepting = paused_until.is_none_or(|t| now >= t);
        fds.clear();
        fds.push(pollfd(&listener, if accepting { libc::POLLIN } else { 0 }));
        fds.extend(conns.iter().map(|c| pollfd(&c.stream, c.interest())));
        let next = conns
            .iter()
            .map(Conn::deadline)
            .chain(paused_until)
            .min()
            .map_or(TICK, |t| t.saturating_duration_since(now).min(TICK));
        wait_ready(&mut fds, next);
        if stop.load(Ordering::Relaxed) {
            return;
        }
        for (c, fd) in conns.iter_mut().zip(fds.iter().skip(1)) {
            if fd.revents != 0 {
                c.advance(&snapshot);
            }
        }
        conns.retain(|c| !c.done());
        if fds.first().is_some_and(|fd| fd.revents != 0) {
            if let Err(e) = accept_some(&listener, &mut conns, &snapshot) {
                if last_error.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    log::warn!("metrics.listen: accept failed: {e} (repeats logged every 60 s)");
                    last_error = Some(Instant::now());
                }
                paused_until = Some(Instant::now() + ACCEPT_PAUSE);
            } else {
                paused_until = None;
            }
        }
    }
}

/// Make a blocked [`serve`] return after its stop flag was set: connect to
/// it once (it sees the flag before reading anything).
pub fn wake(addr: SocketAddr) {
    let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(500));
}

fn pollfd(socket: &impl AsRawFd, events: libc::c_short) -> libc::pollfd {
    libc::pollfd {
        fd: socket.as_raw_fd(),
        events,
        revents: 0,
    }
}

/// `poll(2)` on `fds` for at most `timeout`; an error (EINTR) counts as a
/// timeout with nothing ready.
fn wait_ready(fds: &mut [libc::pollfd], timeout: Duration) {
    let ms =
        libc::c_int::try_from(timeout.as_millis().saturating_add(1)).unwrap_or(libc::c_int::MAX);
    let Ok(n) = libc::nfds_t::try_from(fds.len()) else {
        return;
    };
    // SAFETY: poll reads and writes `n` pollfds, the length of `fds`.
    if unsafe { libc::poll(fds.as_mut_ptr(), n, ms) } < 0 {
        for fd in fds {
            fd.revents = 0;
        }
    }
}

/// Takes up to [`ACCEPT_BURST`] new connections, closing the oldest held
/// one for each beyond [`MAX_CONNECTIONS`], and reads each at once (a
/// scrape's request is usually there with it). Errors: accept failed for a
/// reason other than "none pending".
fn accept_some(
    listener: &TcpListener,
    conns: &mut Vec<Conn>,
    snapshot: &Snapshot,
) -> std::io::Result<()> {
    for _ in 0..ACCEPT_BURST {
        let stream = match listener.accept() {
            Ok((stream, _)) => stream,
            Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
            Err(e)
                if matches!(
                    e.kind(),
                    ErrorKind::Interrupted | ErrorKind::ConnectionAborted
                ) =>
            {
                continue
            }
            Err(e) => return Err(e),
        };
        if stream.set_nonblocking(true).is_err() {
            continue;
        }
        if conns.len() >= MAX_CONNECTIONS {
            if let Some(oldest) = (0..conns.len()).min_by_key(|&i| conns[i].opened) {
                conns.swap_remove(oldest);
            }
        }
        let mut conn = Conn::new(stream, Instant::now());
        conn.advance(snapshot);
        if !conn.done() {
            conns.push(conn);
        }
    }
    Ok(())
}

/// One connection and how far it is.
struct Conn {
    stream: TcpStream,
    opened: Instant,
    phase: Phase,
}

enum Phase {
    /// Reading the request head until `deadline`.
    Head { buf: Vec<u8>, deadline: Instant },
    /// Writing the answer from `sent` until `deadline`.
    Answer {
        out: Vec<u8>,
        sent: usize,
        deadline: Instant,
    },
    /// Answered and half-closed: reading and dropping up to `left` more
    /// bytes until `deadline` (see [`DRAIN_TIME`]).
    Drain { left: usize, deadline: Instant },
    /// To be closed.
    Done,
}

impl Conn {
    fn new(stream: TcpStream, now: Instant) -> Conn {
        Conn {
            stream,
            opened: now,
            phase: Phase::Head {
                buf: Vec::with_capacity(CHUNK),
                deadline: now + REQUEST_DEADLINE,
            },
        }
    }

    fn done(&self) -> bool {
        matches!(self.phase, Phase::Done)
    }

    fn deadline(&self) -> Instant {
        match &self.phase {
            Phase::Head { deadline, .. }
            | Phase::Answer { deadline, .. }
            | Phase::Drain { deadline, .. } => *deadline,
            Phase::Done => self.opened,
        }
    }

    /// What to wait for on its socket.
    fn interest(&self) -> libc::c_short {
        match self.phase {
            Phase::Answer { .. } => libc::POLLOUT,
            _ => libc::POLLIN,
        }
    }

    /// Past its deadline: a head not in yet is answered 408, anything else
    /// is closed.
    fn check_deadline(&mut self, now: Instant, snapshot: &Snapshot) {
        if now < self.deadline() {
            return;
        }
        match self.phase {
            Phase::Head { .. } => self.answer(Verdict::Error(408, "Request Timeout"), snapshot),
            _ => self.phase = Phase::Done,
        }
    }

    /// Does what its socket allows now, without blocking.
    fn advance(&mut self, snapshot: &Snapshot) {
        let mut chunk = [0u8; CHUNK];
        loop {
            match &mut self.phase {
                Phase::Head { buf, .. } => match self.stream.read(&mut chunk) {
                    Ok(0) => self.answer(Verdict::Error(400, "Bad Request"), snapshot),
                    Ok(n) => {
                        buf.extend_from_slice(chunk.get(..n).unwrap_or_default());
                        match head_end(buf) {
                            Some(end) if end <= MAX_HEAD_BYTES => {
                                let verdict = judge(buf.get(..end).unwrap_or_default());
                                self.answer(verdict, snapshot);
                            }
                            _ if buf.len() > MAX_HEAD_BYTES => self.answer(
                                Verdict::Error(431, "Request Header Fields Too Large"),
                                snapshot,
                            ),
                            _ => {}
                        }
                    }
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                    Err(_) => self.phase = Phase::Done,
                },
                Phase::Answer { out, sent, .. } => {
                    match self.stream.write(out.get(*sent..).unwrap_or_default()) {
                        Ok(n) if n > 0 => {
                            *sent += n;
                            if *sent >= out.len() {
                                let _ = self.stream.shutdown(Shutdown::Write);
                                self.phase = Phase::Drain {
                                    left: DRAIN_BYTES,
                                    deadline: Instant::now() + DRAIN_TIME,
                                };
                            }
                        }
                        Err(e) if e.kind() == ErrorKind::Interrupted => {}
                        Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                        Ok(_) | Err(_) => self.phase = Phase::Done,
                    }
                }
                Phase::Drain { left, .. } => match self.stream.read(&mut chunk) {
                    Ok(n) if n > 0 && n < *left => *left -= n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) if e.kind() == ErrorKind::WouldBlock => return,
                    Ok(_) | Err(_) => self.phase = Phase::Done,
                },
                Phase::Done => return,
            }
        }
    }

    /// Turns to answering `verdict` (the metrics come from `snapshot`).
    fn answer(&mut self, verdict: Verdict, snapshot: &Snapshot) {
        let out = match verdict {
            Verdict::Metrics { head } => response(200, "OK", CONTENT_TYPE, &snapshot.text(), head),
            Verdict::Error(code, reason) => response(
                code,
                reason,
                "text/plain; charset=utf-8",
                &format!("{code} {reason}\n"),
                false,
            ),
        };
        self.phase = Phase::Answer {
            out,
            sent: 0,
            deadline: Instant::now() + WRITE_TIMEOUT,
        };
    }
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// `GET /metrics` (`head` = a HEAD request: headers only).
    Metrics { head: bool },
    /// An error status and its reason phrase.
    Error(u16, &'static str),
}

/// Where the head ends (the index of its blank line), `\r\n\r\n` or a bare
/// `\n\n` (RFC 9112 §2.2 lets a recipient accept a bare LF).
fn head_end(buf: &[u8]) -> Option<usize> {
    let crlf = buf.windows(4).position(|w| w == b"\r\n\r\n");
    let lf = buf.windows(2).position(|w| w == b"\n\n");
    match (crlf, lf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// Judge a request head (RFC 9112 §3: `method SP target SP HTTP-version`).
fn judge(head: &[u8]) -> Verdict {
    let Ok(text) = std::str::from_utf8(head) else {
        return Verdict::Error(400, "Bad Request");
    };
    let line = text.lines().next().unwrap_or_default();
    let mut parts = line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Verdict::Error(400, "Bad Request");
    };
    let token = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_alphabetic());
    if !token(method) || !version.starts_with("HTTP/1.") || !target.starts_with('/') {
        return Verdict::Error(400, "Bad Request");
    }
    let path = target.split('?').next().unwrap_or_default();
    if path != "/metrics" {
        return Verdict::Error(404, "Not Found");
    }
    match method {
        "GET" => Verdict::Metrics { head: false },
        "HEAD" => Verdict::Metrics { head: true },
        _ => Verdict::Error(405, "Method Not Allowed"),
    }
}

/// A whole answer: `Connection: close`, `Allow` on 405.
fn response(code: u16, reason: &str, content_type: &str, body: &str, head_only: bool) -> Vec<u8> {
    let allow = if code == 405 {
        "Allow: GET, HEAD\r\n"
    } else {
        ""
    };
    let mut out = format!(
        "HTTP/1.1 {code} {reason}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\n{allow}Connection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    if !head_only {
        out.extend_from_slice(body.as_bytes());
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_get_and_head_of_metrics_are_served() {
        assert_eq!(
            judge(b"GET /metrics HTTP/1.1\r\nHost: x"),
            Verdict::Metrics { head: false }
        );
        assert_eq!(
            judge(b"GET /metrics?x=1 HTTP/1.0"),
            Verdict::Metrics { head: false }
        );
        assert_eq!(
            judge(b"HEAD /metrics HTTP/1.1"),
            Verdict::Metrics { head: true }
        );
        assert_eq!(
            judge(b"POST /metrics HTTP/1.1"),
            Verdict::Error(405, "Method Not Allowed")
        );
        assert_eq!(judge(b"GET / HTTP/1.1"), Verdict::Error(404, "Not Found"));
        assert_eq!(
            judge(b"GET /metrics/x HTTP/1.1"),
            Verdict::Error(404, "Not Found")
        );
    }

    #[test]
    fn garbage_is_a_bad_request_and_never_a_panic() {
        for head in [
            &b""[..],
            b"\xff\xfe\x00",
            b"GET",
            b"GET /metrics",
            b"GET  /metrics HTTP/1.1",
            b"GET /metrics HTTP/1.1 extra",
            b"GET metrics HTTP/1.1",
            b"G=T /metrics HTTP/1.1",
            b"GET /metrics SPDY/3",
        ] {
            assert!(matches!(judge(head), Verdict::Error(400, _)), "{head:?}");
        }
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n\r\nbody"), Some(14));
        assert_eq!(head_end(b"GET / HTTP/1.1\n\n"), Some(14));
        assert_eq!(head_end(b"GET / HTTP/1.1\r\n"), None);
    }

    /// A real socket: the answer, an oversized head, then still serving.
    #[test]
    fn a_listener_answers_oversized_heads_with_431_and_keeps_serving() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let snap = Snapshot::new();
        snap.publish("a_total 1\n".into());
        let stop = Arc::new(AtomicBool::new(false));
        let t = {
            let (snap, stop) = (snap.clone(), stop.clone());
            std::thread::spawn(move || serve(listener, snap, stop))
        };
        let ask = |req: &[u8]| {
            let mut s = TcpStream::connect(addr).expect("connect");
            let _ = s.write_all(req);
            let mut out = String::new();
            let _ = s.read_to_string(&mut out);
            out
        };
        let big = format!("GET /metrics HTTP/1.1\r\nX: {}\r\n\r\n", "a".repeat(9000));
        assert!(ask(big.as_bytes()).starts_with("HTTP/1.1 431 "));
        let ok = ask(b"GET /metrics HTTP/1.1\r\n\r\n");
        assert!(ok.starts_with("HTTP/1.1 200 OK\r\n"), "{ok}");
        assert!(
            ok.contains("version=0.0.4") && ok.ends_with("\r\n\r\na_total 1\n"),
            "{ok}"
        );
        stop.store(true, Ordering::Relaxed);
        wake(addr);
        t.join().expect("listener thread");
    }

    /// A listener on a thread of its own, serving `a_total 1`.
    fn listening() -> (SocketAddr, Arc<AtomicBool>, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let snap = Snapshot::new();
        snap.publish("a_total 1\n".into());
        let stop = Arc::new(AtomicBool::new(false));
        let t = {
            let stop = stop.clone();
            std::thread::spawn(move || serve(listener, snap, stop))
        };
        (addr, stop, t)
    }

    fn scrape(addr: SocketAddr) -> (String, Duration) {
        let started = Instant::now();
        let mut s = TcpStream::connect(addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(10)))
            .expect("timeout");
        let _ = s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n");
        let mut out = String::new();
        let _ = s.read_to_string(&mut out);
        (out, started.elapsed())
    }

    #[test]
    fn clients_that_trickle_or_say_nothing_keep_no_scrape_waiting() {
        let (addr, stop, t) = listening();
        let mut slow: Vec<TcpStream> = (0..20)
            .map(|_| TcpStream::connect(addr).expect("connect"))
            .collect();
        for s in &mut slow[..10] {
            s.write_all(b"GET /metr").expect("trickle");
        }
        let (out, took) = scrape(addr);
        assert!(out.ends_with("\r\n\r\na_total 1\n"), "{out}");
        assert!(took < Duration::from_secs(1), "{took:?}");
        // The slow ones are still served once their heads are whole.
        slow[0].write_all(b"ics HTTP/1.1\r\n\r\n").expect("rest");
        let mut out = String::new();
        let _ = slow[0].read_to_string(&mut out);
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        stop.store(true, Ordering::Relaxed);
        wake(addr);
        t.join().expect("listener thread");
    }

    #[test]
    fn a_connection_beyond_the_bound_closes_the_oldest() {
        let (addr, stop, t) = listening();
        let mut held: Vec<TcpStream> = (0..MAX_CONNECTIONS)
            .map(|_| TcpStream::connect(addr).expect("connect"))
            .collect();
        // Let the loop take them all before the one more.
        std::thread::sleep(Duration::from_millis(300));
        let (out, took) = scrape(addr);
        assert!(out.starts_with("HTTP/1.1 200 OK\r\n"), "{out}");
        assert!(took < Duration::from_secs(1), "{took:?}");
        // The first one was closed without an answer to make room.
        let first = &mut held[0];
        first
            .set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let mut buf = [0u8; 64];
        let closed = matches!(first.read(&mut buf), Ok(0) | Err(_));
        assert!(closed, "the oldest connection is still held");
        // An idle one is answered 408 at its deadline, not held for good.
        let last = held.last_mut().expect("a connection");
        last.set_read_timeout(Some(REQUEST_DEADLINE * 2))
            .expect("timeout");
        let mut out = String::new();
        let _ = last.read_to_string(&mut out);
        assert!(out.starts_with("HTTP/1.1 408 "), "{out}");
        stop.store(true, Ordering::Relaxed);
        wake(addr);
        t.join().expect("listener thread");
    }
}
