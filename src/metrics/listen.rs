//! `metrics.listen`: a minimal HTTP/1.x responder serving `GET /metrics`
//! from the [`Snapshot`] the ingest thread publishes.
//!
//! Its one rule: **the listener is attack surface, so everything it accepts
//! is bounded**: one connection at a time, request head at most
//! [`MAX_HEAD_BYTES`], the whole request within [`REQUEST_DEADLINE`], no
//! request body read, `Connection: close` on every answer. Anything but
//! `GET`/`HEAD /metrics` gets 400, 404, 405, 408 or 431; it never panics on
//! input and never touches the spool (loopback only unless
//! `metrics.listen_public`, enforced by the config).
//!
//! Why not a crate: tiny_http 0.12 (its last release, 2022) runs an accept
//! thread and a pool of at least 4 worker threads with no bound on
//! connections, and reads a header line with no length limit; for one
//! fixed text body, a small std responder is less code to trust.

use super::{Snapshot, CONTENT_TYPE};
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Largest request head (request line and headers) read, bytes; a larger
/// one is answered 431.
pub const MAX_HEAD_BYTES: usize = 8 * 1024;

/// The request head must arrive within this, whatever the pace of its
/// bytes (a client that trickles keeps nobody else waiting longer).
pub const REQUEST_DEADLINE: Duration = Duration::from_secs(3);

/// Writing the answer may take this long.
const WRITE_TIMEOUT: Duration = Duration::from_secs(5);

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

/// The listener thread: accept one connection at a time until `stop` is
/// set (then wake it with [`wake`]). Accept errors (a full descriptor table)
/// are logged at most once a minute and retried after a pause.
pub fn serve(listener: TcpListener, snapshot: Snapshot, stop: Arc<AtomicBool>) {
    let mut last_error: Option<Instant> = None;
    loop {
        let accepted = listener.accept();
        if stop.load(Ordering::Relaxed) {
            return;
        }
        match accepted {
            Ok((stream, _)) => answer(stream, &snapshot),
            Err(e) => {
                if last_error.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    log::warn!("metrics.listen: accept failed: {e} (repeats logged every 60 s)");
                    last_error = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// Make a blocked [`serve`] return after its stop flag was set: connect to
/// it once (it sees the flag before reading anything).
pub fn wake(addr: SocketAddr) {
    let _ = TcpStream::connect_timeout(&addr, Duration::from_millis(500));
}

/// What a request head asks for.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// `GET /metrics` (`head` = a HEAD request: headers only).
    Metrics { head: bool },
    /// An error status and its reason phrase.
    Error(u16, &'static str),
}

/// Read one request head from `stream` and answer it.
fn answer(mut stream: TcpStream, snapshot: &Snapshot) {
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let verdict = match read_head(&mut stream) {
        Ok(head) => judge(&head),
        Err(v) => v,
    };
    let res = match verdict {
        Verdict::Metrics { head } => {
            let body = snapshot.text();
            respond(&mut stream, 200, "OK", CONTENT_TYPE, &body, head)
        }
        Verdict::Error(code, reason) => {
            let body = format!("{code} {reason}\n");
            respond(
                &mut stream,
                code,
                reason,
                "text/plain; charset=utf-8",
                &body,
                false,
            )
        }
    };
    if res.is_ok() {
        // Half-close, then drain briefly what the client still sends (a
        // body we did not read): closing with unread data makes the kernel
        // send a reset that can destroy the answer before it is read.
        let _ = stream.shutdown(Shutdown::Write);
        let _ = stream.set_read_timeout(Some(Duration::from_millis(200)));
        let mut sink = [0u8; 4096];
        let mut drained = 0;
        // One overall bound too: a client trickling a byte per read must
        // not hold the only listener thread.
        let give_up = Instant::now() + Duration::from_millis(500);
        while drained < 64 * 1024 && Instant::now() < give_up {
            match stream.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    }
}

/// Read until the blank line that ends the head. Errors: the status to
/// answer (431 over [`MAX_HEAD_BYTES`], 408 past [`REQUEST_DEADLINE`], 400
/// on a connection closed early).
fn read_head(stream: &mut TcpStream) -> Result<Vec<u8>, Verdict> {
    let deadline = Instant::now() + REQUEST_DEADLINE;
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 1024];
    loop {
        match head_end(&buf) {
            Some(end) if end <= MAX_HEAD_BYTES => {
                buf.truncate(end);
                return Ok(buf);
            }
            _ => {}
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(Verdict::Error(431, "Request Header Fields Too Large"));
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || stream.set_read_timeout(Some(left)).is_err() {
            return Err(Verdict::Error(408, "Request Timeout"));
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Err(Verdict::Error(400, "Bad Request")),
            Ok(n) => buf.extend_from_slice(chunk.get(..n).unwrap_or_default()),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                return Err(Verdict::Error(408, "Request Timeout"))
            }
            Err(_) => return Err(Verdict::Error(400, "Bad Request")),
        }
    }
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

/// Write a whole answer; `Connection: close`, `Allow` on 405.
fn respond(
    stream: &mut TcpStream,
    code: u16,
    reason: &str,
    content_type: &str,
    body: &str,
    head_only: bool,
) -> std::io::Result<()> {
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
    stream.write_all(&out)?;
    stream.flush()
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
}
