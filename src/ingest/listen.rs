//! The ingest listeners: the Unix socket (`ingest.socket`) and the TCP port
//! (`ingest.tcp`), one accept thread each, one thread per connection
//! ([`super::conn`]).
//!
//! Its one rule: **the socket path is ours only if it is a socket nobody
//! listens on**: a stale socket left by a killed agent is removed at start
//! (after checking nobody answers on it); a socket another process listens
//! on is a conflict, named with that process's pid (`SO_PEERCRED`), never
//! removed nor answered for: the agent runs without it, its health
//! degraded; anything else at that path (a regular file, a directory) is
//! an error that names it and is never deleted; the socket is removed at a
//! clean stop only if it is still the one we created.
//!
//! Bounds: at most `ingest.max_connections` connections per listener; one
//! more gets one error line and is closed. Each listener has its own share
//! of the input's memory budget, its own pattern-stream budget and its own
//! key scope (the Unix socket one per peer uid), so the loopback TCP port,
//! open to every local user, can take nothing of the socket's. Each peer
//! (a socket client's uid, a TCP client's IP address) has its byte rate and
//! its share of the spool ([`crate::intake::share`]), the credentials read
//! once, on accept. The model is the metrics listener
//! ([`crate::metrics::listen`]).

use super::conn::{self, Peer, Stream};
use super::request::error_line;
use super::{Counters, KeyScope, PatternStreams};
use crate::ingest::IngestConfig;
use crate::intake::budget::{Budget, InputBudget};
use crate::intake::share::{PeerId, Shares};
use crate::intake::IngestMsg;
use std::collections::HashMap;
use std::io::{ErrorKind, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::unix::fs::{FileTypeExt, MetadataExt, PermissionsExt};
use std::os::unix::io::AsRawFd;
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The running listeners (none when `[ingest]` configures none).
#[derive(Debug, Default)]
pub struct SocketIngest {
    running: Option<Running>,
    /// The peers' shares of the spool (made from `[ingest]` even with no
    /// listener: the writer charges the mqtt bridges to it).
    shares: Option<Arc<Shares>>,
}

#[derive(Debug)]
struct Running {
    shared: Arc<Shared>,
    /// The socket path, its (device, inode) after bind, the accept thread.
    unix: Option<(PathBuf, (u64, u64), JoinHandle<()>)>,
    /// The bound address (the port chosen for 0) and the accept thread.
    tcp: Option<(SocketAddr, JoinHandle<()>)>,
    /// Another process listens on `ingest.socket`: who, and what to do.
    conflict: Option<String>,
    /// `ingest.tcp` could not be bound: the address and the cause.
    tcp_down: Option<String>,
}

/// Why [`bind_unix`] gave no listener.
enum BindError {
    /// Another process listens on the path: the agent runs without it.
    Taken(String),
    /// Anything else: the start fails with this sentence.
    Failed(String),
}

/// What the accept threads and connection threads share.
#[derive(Debug)]
struct Shared {
    cfg: IngestConfig,
    counters: Arc<Counters>,
    /// Streams patterns let in during this run (bounded), per listener.
    patterns_unix: PatternStreams,
    patterns_tcp: PatternStreams,
    /// The listeners' shares of the input's memory budget.
    budget_unix: Arc<Budget>,
    budget_tcp: Arc<Budget>,
    /// Every peer's rate and share of the spool.
    shares: Arc<Shares>,
    stop: AtomicBool,
    /// Connection readers that may still hand a request over.
    readers: AtomicUsize,
    next_id: AtomicU64,
    /// Open connections (a handle each, to shut them at the stop) and
    /// their threads.
    open: Mutex<HashMap<u64, OpenConn>>,
}

/// A handle to an open connection (to shut it at the stop), its thread,
/// and the peer it counts against (`ingest.max_connections_per_peer`).
type OpenConn = (Stream, Option<JoinHandle<()>>, PeerId);

/// Bind the configured listeners and start their threads; readings go to
/// `ingest`, each holding room in `budget` (the listener's share) until its
/// reply. Nothing configured: an empty [`SocketIngest`].
///
/// Another process listening on the socket path is no error: it is logged
/// (ERROR, naming its pid), the other listeners start, and
/// [`SocketIngest::conflict`] says so. Nor is a TCP address that cannot be
/// bound (in use, not this host's): logged at ERROR, the agent runs without
/// it (no restart loop for a port another program holds), and
/// [`SocketIngest::tcp_down`] says so.
///
/// Errors (a sentence naming the key and path): the socket path holds
/// something that is not a socket, its directory cannot be made, the group
/// is unknown, the mode or group cannot be set, a thread cannot start.
pub fn start(
    cfg: &IngestConfig,
    ingest: Sender<IngestMsg>,
    budget: &InputBudget,
) -> Result<SocketIngest, String> {
    let shares = Arc::new(Shares::new(cfg.share_settings()));
    if !cfg.enabled() {
        return Ok(SocketIngest {
            running: None,
            shares: Some(shares),
        });
    }
    let shared = Arc::new(Shared {
        cfg: cfg.clone(),
        counters: Arc::new(Counters::default()),
        patterns_unix: PatternStreams::default(),
        patterns_tcp: PatternStreams::default(),
        budget_unix: budget.unix.clone(),
        budget_tcp: budget.tcp.clone(),
        shares: shares.clone(),
        stop: AtomicBool::new(false),
        readers: AtomicUsize::new(0),
        next_id: AtomicU64::new(0),
        open: Mutex::new(HashMap::new()),
    });
    let mut running = Running {
        shared: shared.clone(),
        unix: None,
        tcp: None,
        conflict: None,
        tcp_down: None,
    };
    let bound = match &cfg.socket {
        None => None,
        Some(path) => match bind_unix(path, cfg) {
            Ok(l) => Some((path, l)),
            Err(BindError::Failed(e)) => return Err(e),
            Err(BindError::Taken(why)) => {
                log::error!("{why}");
                running.conflict = Some(why);
                None
            }
        },
    };
    if let Some((path, listener)) = bound {
        let meta = std::fs::symlink_metadata(path)
            .map_err(|e| format!("ingest.socket {}: {e}", path.display()))?;
        let (sh, tx) = (shared.clone(), ingest.clone());
        let h = std::thread::Builder::new()
            .name("ingest-unix".into())
            .spawn(move || serve(|| listener.accept().map(|(s, _)| Stream::Unix(s)), &sh, &tx))
            .map_err(|e| format!("cannot start the ingest socket thread: {e}"))?;
        log::info!(
            "ingest: listening on {} (mode {:o})",
            path.display(),
            cfg.socket_mode
        );
        running.unix = Some((path.clone(), (meta.dev(), meta.ino()), h));
    }
    let tcp = cfg.tcp.and_then(|addr| match TcpListener::bind(addr) {
        Ok(l) => Some((addr, l)),
        Err(e) => {
            let why = format!("ingest.tcp {addr}: {e}");
            log::error!("{why}; running without the TCP listener");
            running.tcp_down = Some(why);
            None
        }
    });
    if let Some((addr, listener)) = tcp {
        let mut local = listener
            .local_addr()
            .map_err(|e| format!("ingest.tcp {addr}: {e}"))?;
        if local.ip().is_unspecified() {
            local.set_ip(match local {
                SocketAddr::V4(_) => std::net::Ipv4Addr::LOCALHOST.into(),
                SocketAddr::V6(_) => std::net::Ipv6Addr::LOCALHOST.into(),
            });
        }
        let (sh, tx) = (shared.clone(), ingest);
        let h = std::thread::Builder::new()
            .name("ingest-tcp".into())
            .spawn(move || serve(|| listener.accept().map(|(s, _)| Stream::Tcp(s)), &sh, &tx))
            .map_err(|e| format!("cannot start the ingest tcp thread: {e}"))?;
        log::info!("ingest: listening on tcp {local}");
        running.tcp = Some((local, h));
    }
    Ok(SocketIngest {
        running: Some(running),
        shares: Some(shares),
    })
}

impl SocketIngest {
    /// The counters the listeners keep (drain them into the spool's).
    pub fn counters(&self) -> Option<Arc<Counters>> {
        self.running.as_ref().map(|r| r.shared.counters.clone())
    }

    /// The peers' shares of the spool: the writer tells it the spool's
    /// capacity and row marks, and charges the bridges to it.
    pub fn shares(&self) -> Option<Arc<Shares>> {
        self.shares.clone()
    }

    /// Set when another process listens on `ingest.socket` and the agent
    /// runs without it: who listens, and the fix.
    pub fn conflict(&self) -> Option<String> {
        self.running.as_ref().and_then(|r| r.conflict.clone())
    }

    /// Set when `ingest.tcp` could not be bound and the agent runs without
    /// it: the address and the cause.
    pub fn tcp_down(&self) -> Option<String> {
        self.running.as_ref().and_then(|r| r.tcp_down.clone())
    }

    /// What listens, for `status` (`unix <path> (mode 660, group g), tcp
    /// <addr>`, or `unix <path> taken by pid N (name)`); `None` when
    /// nothing is configured.
    pub fn describe(&self) -> Option<String> {
        let r = self.running.as_ref()?;
        let mut parts = Vec::new();
        if let (Some(path), Some(_)) = (&r.shared.cfg.socket, &r.conflict) {
            parts.push(format!(
                "unix {} not listening: another process holds it",
                path.display()
            ));
        }
        if let Some((path, _, _)) = &r.unix {
            let group = r
                .shared
                .cfg
                .socket_group
                .as_ref()
                .map(|g| format!(", group {g}"))
                .unwrap_or_default();
            parts.push(format!(
                "unix {} (mode {:o}{group})",
                path.display(),
                r.shared.cfg.socket_mode
            ));
        }
        if let Some((addr, _)) = &r.tcp {
            parts.push(format!("tcp {addr}"));
        }
        if let (Some(addr), Some(_)) = (r.shared.cfg.tcp, &r.tcp_down) {
            parts.push(format!("tcp {addr} not listening: it could not be bound"));
        }
        Some(parts.join(", "))
    }

    /// The stop, first half: accept nothing more and stop reading requests
    /// (every connection's read side is shut), then wait (up to 1 s) until
    /// no reader can hand a request over any more, so the ingest thread's
    /// last drain of its channel sees every request that will get an `ok`.
    /// Replies still owed are written as their outcomes arrive.
    pub fn stop_intake(&self) {
        let Some(r) = &self.running else { return };
        r.shared.stop.store(true, Ordering::Relaxed);
        // Wake the accept threads (they see the flag before serving).
        if let Some((path, _, _)) = &r.unix {
            let _ = UnixStream::connect(path);
        }
        if let Some((addr, _)) = &r.tcp {
            let _ = TcpStream::connect_timeout(addr, Duration::from_millis(500));
        }
        shut_reads(&r.shared);
        // A reader past its last check may be blocked handing its reply
        // channel to its writer, its request already sent: that one is
        // in the channel the ingest thread drains next, so a bound is safe.
        let deadline = Instant::now() + Duration::from_secs(1);
        while r.shared.readers.load(Ordering::Relaxed) > 0 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The stop, second half (after the ingest thread committed what it
    /// had): wait up to 2 s for the connections to write their last
    /// replies, then remove the socket file if it is still ours.
    pub fn finish(self) {
        let Some(r) = self.running else { return };
        shut_reads(&r.shared);
        let deadline = Instant::now() + Duration::from_secs(2);
        let threads: Vec<JoinHandle<()>> = match r.shared.open.lock() {
            Ok(mut open) => open.values_mut().filter_map(|(_, h, _)| h.take()).collect(),
            Err(_) => Vec::new(),
        };
        for h in threads {
            crate::os::threads::join_within(h, deadline, "an ingest connection");
        }
        if let Some((path, id, h)) = r.unix {
            crate::os::threads::join_within(h, deadline, "the ingest socket thread");
            let still_ours = std::fs::symlink_metadata(&path)
                .is_ok_and(|m| m.file_type().is_socket() && (m.dev(), m.ino()) == id);
            if still_ours {
                let _ = std::fs::remove_file(&path);
            }
        }
        if let Some((_, h)) = r.tcp {
            crate::os::threads::join_within(h, deadline, "the ingest tcp thread");
        }
    }
}

/// Shut the read side of every open connection: its reader sees EOF and
/// ends; replies it owes are still written. (Called again at `finish` for a
/// connection admitted while the stop began.)
fn shut_reads(shared: &Shared) {
    if let Ok(open) = shared.open.lock() {
        for (s, _, _) in open.values() {
            let _ = s.shutdown(Shutdown::Read);
        }
    }
}

/// Who listens on the Unix socket at `path`, or `None` when nobody
/// answers (a stale socket). Connected once: `SO_PEERCRED` on the client
/// end gives the pid and uid of the process that called listen(2)
/// (unix(7)); its name comes from `/proc/<pid>/comm`.
fn who_listens(path: &Path) -> Option<String> {
    let s = UnixStream::connect(path).ok()?;
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt writes at most `len` bytes into `cred`, ours.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    if rc != 0 || cred.pid <= 0 {
        return Some("a process (its pid is not visible here)".into());
    }
    let comm = std::fs::read_to_string(format!("/proc/{}/comm", cred.pid))
        .map(|c| c.trim().to_owned())
        .unwrap_or_else(|_| "?".into());
    Some(format!("pid {} ({comm}, uid {})", cred.pid, cred.uid))
}

/// Bind the Unix socket at `path`: make its directory, clear a stale
/// socket (never anything else, never one another process listens on),
/// then set its mode and group.
fn bind_unix(path: &Path, cfg: &IngestConfig) -> Result<UnixListener, BindError> {
    let shown = path.display();
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        // 0755 whatever the umask: clients must reach the socket (its own
        // mode decides who may connect), nobody else may write beside it.
        let mut mk = std::fs::DirBuilder::new();
        std::os::unix::fs::DirBuilderExt::mode(mk.recursive(true), 0o755);
        mk.create(dir).map_err(|e| {
            BindError::Failed(format!(
                "ingest.socket: cannot create {}: {e}",
                dir.display()
            ))
        })?;
    }
    let failed = |m: String| BindError::Failed(m);
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_socket() => {
            if let Some(who) = who_listens(path) {
                return Err(BindError::Taken(format!(
                    "ingest.socket {shown}: {who} is already listening on it; the agent neither removes it nor answers for it, and runs without this socket (clients connecting there reach that process, not the agent): stop that process or choose another ingest.socket, then restart the agent"
                )));
            }
            std::fs::remove_file(path).map_err(|e| {
                failed(format!(
                    "ingest.socket {shown}: cannot remove the stale socket: {e}"
                ))
            })?;
            log::info!("ingest: removed the stale socket {shown}");
        }
        Ok(m) => {
            let kind = if m.is_dir() {
                "a directory"
            } else if m.file_type().is_symlink() {
                "a symbolic link"
            } else if m.is_file() {
                "a regular file"
            } else {
                "not a socket"
            };
            return Err(failed(format!(
                "ingest.socket {shown} exists and is {kind}, not a socket; refusing to delete it (remove it or choose another path)"
            )));
        }
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(failed(format!("ingest.socket {shown}: {e}"))),
    }
    bind_fresh(path, cfg).map_err(failed)
}

/// Bind at `path` (free now), then give the socket its group and mode.
fn bind_fresh(path: &Path, cfg: &IngestConfig) -> Result<UnixListener, String> {
    let shown = path.display();
    // The group is looked up before bind, so a bad group leaves no socket.
    let gid = match &cfg.socket_group {
        None => None,
        Some(g) => Some(match g.parse::<u32>() {
            Ok(n) => n,
            Err(_) => crate::os::process::lookup_group(g)
                .map_err(|e| {
                    format!("ingest.socket_group {g:?}: cannot read the group database: {e}")
                })?
                .ok_or_else(|| format!("ingest.socket_group {g:?}: no such group"))?,
        }),
    };
    // Between bind and chmod the socket has the umask's mode; connecting
    // needs write permission, which a 022 or 077 umask gives only the
    // owner, so the window grants nobody else anything.
    let listener = UnixListener::bind(path).map_err(|e| format!("ingest.socket {shown}: {e}"))?;
    if let Err(e) = set_group_and_mode(path, cfg, gid) {
        // Never leave a socket behind with the umask's mode.
        let _ = std::fs::remove_file(path);
        return Err(e);
    }
    Ok(listener)
}

/// Give the socket file at `path` its group and mode without following a
/// symlink: the name is opened `O_PATH | O_NOFOLLOW`, must be a socket, and
/// is changed through that descriptor (`fchownat(AT_EMPTY_PATH)`, chmod
/// through `/proc/self/fd`), so a name swapped for a symlink in between
/// cannot make the agent chmod another file.
fn set_group_and_mode(path: &Path, cfg: &IngestConfig, gid: Option<u32>) -> Result<(), String> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    let shown = path.display();
    // open(2) itself, not OpenOptions::custom_flags: std masks O_ACCMODE
    // out of custom flags, and musl's O_ACCMODE includes O_PATH, so the
    // static (musl) build opened the socket plainly and got ENXIO.
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| format!("ingest.socket {shown}: a NUL byte in the path"))?;
    // SAFETY: a valid C string and constant flags; the result is checked.
    let raw = unsafe {
        libc::open(
            c_path.as_ptr(),
            libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
        )
    };
    if raw < 0 {
        let e = std::io::Error::last_os_error();
        return Err(format!("ingest.socket {shown}: {e}"));
    }
    // SAFETY: `raw` is a descriptor just opened and owned by nobody else.
    let fd = unsafe { std::fs::File::from_raw_fd(raw) };
    let is_socket = fd.metadata().is_ok_and(|m| m.file_type().is_socket());
    if !is_socket {
        return Err(format!(
            "ingest.socket {shown} was replaced by something that is not a socket right after the bind; refusing to touch it"
        ));
    }
    if let (Some(g), Some(gid)) = (&cfg.socket_group, gid) {
        // SAFETY: fchownat on a descriptor we own with an empty C string.
        let rc = unsafe {
            libc::fchownat(
                fd.as_raw_fd(),
                c"".as_ptr(),
                u32::MAX,
                gid,
                libc::AT_EMPTY_PATH,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            return Err(format!(
                "ingest.socket_group {g:?}: cannot give {shown} to gid {gid}: {e}"
            ));
        }
    }
    let proc_path = format!("/proc/self/fd/{}", fd.as_raw_fd());
    std::fs::set_permissions(&proc_path, std::fs::Permissions::from_mode(cfg.socket_mode)).map_err(
        |e| {
            format!(
                "ingest.socket_mode: cannot set {:o} on {shown}: {e}",
                cfg.socket_mode
            )
        },
    )
}

/// An accept thread: until the stop flag, admit each connection or refuse
/// it over the bound. Accept errors (a full descriptor table) are logged
/// at most once a minute and retried after a pause.
fn serve(
    mut accept: impl FnMut() -> std::io::Result<Stream>,
    shared: &Arc<Shared>,
    ingest: &Sender<IngestMsg>,
) {
    let mut last_error: Option<Instant> = None;
    loop {
        let accepted = accept();
        if shared.stop.load(Ordering::Relaxed) {
            return;
        }
        match accepted {
            Ok(s) => admit(s, shared, ingest),
            Err(e) => {
                if last_error.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                    log::warn!("ingest: accept failed: {e} (repeats logged every 60 s)");
                    last_error = Some(Instant::now());
                }
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    }
}

/// Whether one more connection of `who` on the Unix socket (`unix`) or
/// the TCP port is over a bound: the refusal's counter reason and its line.
/// Counted per listener: clients of the loopback TCP port (any local user)
/// can never take the Unix socket's slots (its mode and group decide who
/// connects there), nor the other way round; and per peer within one, so
/// one user holding connections open cannot lock the others out (its
/// idle ones end after [`conn::LINE_TIMEOUT`] anyway).
fn over_bounds(
    open: &HashMap<u64, OpenConn>,
    unix: bool,
    who: &PeerId,
    cfg: &IngestConfig,
) -> Option<(&'static str, String)> {
    let here = || {
        open.values()
            .filter(move |(s, _, _)| matches!(s, Stream::Unix(_)) == unix)
    };
    if here().count() >= cfg.max_connections {
        return Some((
            "too_many_connections",
            format!(
                "too many connections on this listener ({} open, ingest.max_connections); try again later",
                cfg.max_connections
            ),
        ));
    }
    let mine = here().filter(|(_, _, p)| p == who).count();
    let per_peer = cfg.max_connections_per_peer.min(cfg.max_connections);
    (mine >= per_peer).then(|| {
        (
            "peer_connections",
            format!(
                "too many connections from this peer ({mine} open, ingest.max_connections_per_peer {per_peer}); close one or try again later"
            ),
        )
    })
}

/// Start a connection thread for `stream`, or refuse it in one line if
/// `ingest.max_connections` are open on its listener, or its peer holds
/// `ingest.max_connections_per_peer` of them.
fn admit(stream: Stream, shared: &Arc<Shared>, ingest: &Sender<IngestMsg>) {
    let Ok(mut open) = shared.open.lock() else {
        return;
    };
    open.retain(|_, (_, h, _)| h.as_ref().is_some_and(|h| !h.is_finished()));
    let unix = matches!(stream, Stream::Unix(_));
    let (scope, who) = match &stream {
        Stream::Unix(u) => {
            let uid = peer_uid(u);
            (KeyScope::Unix(uid), PeerId::Uid(uid))
        }
        Stream::Tcp(t) => {
            let ip = t
                .peer_addr()
                .map_or(std::net::Ipv4Addr::UNSPECIFIED.into(), |a| a.ip());
            (KeyScope::Tcp, PeerId::ip(ip))
        }
    };
    if let Some((reason, why)) = over_bounds(&open, unix, &who, &shared.cfg) {
        drop(open);
        shared.counters.refused(reason);
        refuse(stream, &why);
        return;
    }
    let Ok(handle) = stream.try_clone() else {
        return;
    };
    let id = shared.next_id.fetch_add(1, Ordering::Relaxed);
    let (sh, tx) = (shared.clone(), ingest.clone());
    let peer_id = who.clone();
    // Counted before the thread starts, so a stop beginning now waits for it.
    shared.readers.fetch_add(1, Ordering::Relaxed);
    let spawned = std::thread::Builder::new()
        .name("ingest-conn".into())
        .spawn(move || {
            let (patterns, listener) = if unix {
                (&sh.patterns_unix, &sh.budget_unix)
            } else {
                (&sh.patterns_tcp, &sh.budget_tcp)
            };
            let peer = Peer {
                counters: &sh.counters,
                patterns,
                budget: listener.child(
                    "connection",
                    "ingest.max_connection_bytes",
                    conn::MAX_PENDING,
                    sh.cfg.max_connection_bytes,
                ),
                scope,
                shares: &sh.shares,
                who,
            };
            conn::serve(stream, &sh.cfg, tx, &peer, (&sh.stop, &sh.readers));
        });
    match spawned {
        Ok(h) => {
            shared.counters.add("ingest_connections", 1);
            open.insert(id, (handle, Some(h), peer_id));
        }
        Err(e) => {
            shared.readers.fetch_sub(1, Ordering::Relaxed);
            log::warn!("ingest: cannot start a connection thread: {e}");
        }
    }
}

/// The uid of the process at the other end of `s` (`SO_PEERCRED`, unix(7):
/// the credentials it had when it connected), or `None` if the kernel does
/// not say.
fn peer_uid(s: &UnixStream) -> Option<u32> {
    let mut cred = libc::ucred {
        pid: 0,
        uid: 0,
        gid: 0,
    };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(2) writes at most `len` bytes into `cred`, a
    // ucred that lives for the call; the descriptor is open (we hold `s`).
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            std::ptr::addr_of_mut!(cred).cast::<libc::c_void>(),
            &mut len,
        )
    };
    let whole = usize::try_from(len).is_ok_and(|l| l == std::mem::size_of::<libc::ucred>());
    (rc == 0 && whole).then_some(cred.uid)
}

/// Tell a client it was refused, in one line, and close.
/// Tell `stream` why it is refused and close it. On the Unix socket this
/// never waits on the client (non-blocking): a refusal that waited (20 ms
/// for a read, up to 500 ms for a write) let one user flooding the socket
/// with silent connections keep the listen backlog full and every other
/// user out (a review: a second user got no answer in 30 s, the accept
/// thread draining about 50 refusals a second; after: 20,000 a second, the
/// second user answered in 55 ms). The one line fits an empty socket
/// buffer; if it does not, it is dropped, and a client's late request meets
/// EPIPE, its error line still readable. On TCP the refusal still reads
/// what arrives within 20 ms: unread data at close makes TCP send a reset
/// that can destroy the line just written; the TCP port has its own accept
/// thread, and on loopback every local user is one peer there anyway.
fn refuse(mut stream: Stream, why: &str) {
    let _ = match &stream {
        Stream::Unix(u) => u.set_nonblocking(true),
        Stream::Tcp(t) => t
            .set_write_timeout(Some(Duration::from_millis(500)))
            .and_then(|()| t.set_read_timeout(Some(Duration::from_millis(20)))),
    };
    let _ = stream.write_all(error_line(why).as_bytes());
    let _ = stream.shutdown(Shutdown::Write);
    let mut sink = [0u8; 4096];
    let _ = stream.read(&mut sink);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_process_listening_on_a_socket_is_named_by_pid_and_a_stale_one_by_none() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("s.sock");
        let l = UnixListener::bind(&p).unwrap();
        let who = who_listens(&p).unwrap();
        assert!(
            who.starts_with(&format!("pid {} (", std::process::id())),
            "{who}"
        );
        drop(l);
        assert_eq!(who_listens(&p), None, "nobody answers a stale socket");
    }
}
