//! `edgespool test`: one reading from every source, shown as it would be
//! sent, and a bind check of every listener the agent would open.
//!
//! Its one rule: **nothing is written.** No spool is opened or created, no
//! state file is touched, no broker is contacted (an mqtt source's local
//! broker only gets a TCP connect, closed at once: no MQTT session, nothing
//! acknowledged); a listener bound to be
//! checked is closed (and a Unix socket file made for the check removed)
//! before the function returns. What a source itself does when read (an
//! `exec` program) is up to it.

use crate::config::Config;
use crate::event::envelope::{self, Envelope, EventIdGen, Format};
use crate::source::{self, SourceSpec};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};

/// One source's reading as it would be sent.
#[derive(Debug, Clone, PartialEq)]
pub struct Shown {
    /// The topic it would be published on: `<topic_prefix>/events/<stream>`.
    pub topic: String,
    /// The envelope as JSON (see [`crate::event::envelope`]), whatever
    /// `mqtt.payload_format` is. Its `event_id` is a fresh one and its
    /// `seq` is 0: the real ones are issued when a reading is appended.
    pub json: String,
    /// Bytes of the payload in the configured format (JSON or postcard).
    pub payload_bytes: usize,
}

/// What a source gave when tried.
#[derive(Debug, Clone, PartialEq)]
pub enum Taken {
    /// A reading, as it would be sent.
    Reading(Shown),
    /// A source that takes no sample (an mqtt bridge: its readings arrive
    /// as local programs publish), with what was checked instead.
    NoSample(String),
    /// A followed replay (`follow = true`) whose file has no row yet (only
    /// its header): the agent waits for rows, so this is no failure.
    NoRowsYet(String),
}

/// What trying one source gave.
#[derive(Debug)]
pub struct SourceResult {
    /// The source's name.
    pub name: String,
    /// Its place in the config: `sources[N]`.
    pub key: String,
    /// What it gave, or why it gave nothing.
    pub outcome: Result<Taken, String>,
}

/// A listener the agent would open.
#[derive(Debug, Clone, PartialEq)]
pub enum Listener {
    /// A TCP listener on `addr`, from config key `key`.
    Tcp {
        /// Config key, e.g. `metrics.listen`.
        key: String,
        /// The address it binds.
        addr: SocketAddr,
    },
    /// A Unix stream socket at `path`, from config key `key`.
    Unix {
        /// Config key.
        key: String,
        /// The socket file.
        path: PathBuf,
        /// `ingest.socket_group`: the group the agent gives the socket;
        /// it must exist, or the agent does not start.
        group: Option<String>,
    },
}

impl Listener {
    /// The config key it comes from.
    pub fn key(&self) -> &str {
        match self {
            Listener::Tcp { key, .. } | Listener::Unix { key, .. } => key,
        }
    }
}

/// Takes one reading from each source of `cfg`, in config order
/// ([`source::sample_once`]: a replay gives its first usable row, read from
/// the start; a system source lacks `cpu_util_pct`, which needs two
/// samples), and encodes it as [`Shown`]. An mqtt source takes no sample:
/// its local broker must accept TCP within 2 s ([`source::bridge::probe`]).
/// A followed replay whose file has no row yet gives [`Taken::NoRowsYet`].
pub fn sample_sources(cfg: &Config) -> Vec<SourceResult> {
    let dir = spool_dir(&cfg.spool.path);
    let mut ids = EventIdGen::new().ok();
    cfg.sources
        .iter()
        .enumerate()
        .map(|(i, spec)| SourceResult {
            name: spec.name.clone(),
            key: format!("sources[{i}]"),
            outcome: match &spec.kind {
                source::SourceKind::Mqtt(b) => {
                    source::bridge::probe(b, std::time::Duration::from_secs(2)).map(Taken::NoSample)
                }
                _ => match source::sample_once(spec, &dir) {
                    Ok(Some(fields)) => show(cfg, spec, &fields, ids.as_mut()).map(Taken::Reading),
                    Ok(None) => Ok(Taken::NoRowsYet("no rows yet; following".to_owned())),
                    Err(e) => Err(e.to_string()),
                },
            },
        })
        .collect()
}

/// The listeners `cfg` makes the agent open, each with its config key:
/// `metrics.listen`, `ingest.socket`, `ingest.tcp`.
pub fn listeners(cfg: &Config) -> Vec<Listener> {
    let tcp = |key: &str, addr: Option<SocketAddr>| {
        addr.map(|addr| Listener::Tcp {
            key: key.into(),
            addr,
        })
    };
    let unix = cfg.ingest.socket.clone().map(|path| Listener::Unix {
        key: "ingest.socket".into(),
        path,
        group: cfg.ingest.socket_group.clone(),
    });
    [
        tcp("metrics.listen", cfg.metrics.listen),
        unix,
        tcp("ingest.tcp", cfg.ingest.tcp),
    ]
    .into_iter()
    .flatten()
    .collect()
}

/// Whether `l` can be bound now. The listener is closed again at once.
///
/// # Errors
///
/// The OS error of the bind, with a hint when the address is in use (a
/// running agent holds it); for a Unix socket whose file exists, a
/// connection attempt tells a live socket (in use) from a stale file,
/// which the agent replaces. A Unix socket's `group` that names no group
/// (the agent's start would fail on it: see `process::lookup_group`).
pub fn try_bind(l: &Listener) -> Result<(), String> {
    match l {
        Listener::Tcp { addr, .. } => match TcpListener::bind(addr) {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => Err(format!(
                "cannot bind {addr}: {e} (a running agent holds it?)"
            )),
            Err(e) => Err(format!("cannot bind {addr}: {e}")),
        },
        Listener::Unix { path, group, .. } => {
            if let Some(g) = group {
                group_exists(g)?;
            }
            try_bind_unix(path)
        }
    }
}

/// `Ok` if the group `name` exists in the group database.
fn group_exists(name: &str) -> Result<(), String> {
    match crate::os::process::lookup_group(name) {
        Ok(Some(_)) => Ok(()),
        Ok(None) => Err(format!(
            "ingest.socket_group {name:?}: no such group (the agent would not start)"
        )),
        Err(e) => Err(format!(
            "ingest.socket_group {name:?}: cannot read the group database: {e}"
        )),
    }
}

fn try_bind_unix(path: &Path) -> Result<(), String> {
    use std::os::unix::fs::FileTypeExt;
    use std::os::unix::net::{UnixListener, UnixStream};
    let shown = path.display();
    if let Ok(m) = std::fs::symlink_metadata(path) {
        if !m.file_type().is_socket() {
            return Err(format!(
                "{shown} exists and is not a socket; the agent refuses to delete it"
            ));
        }
        return match UnixStream::connect(path) {
            Ok(_) => Err(format!(
                "{shown}: a process is listening on it (a running agent?)"
            )),
            // A stale socket file: the agent removes it and binds.
            Err(_) => Ok(()),
        };
    }
    if path
        .parent()
        .is_some_and(|d| !d.as_os_str().is_empty() && !d.exists())
    {
        // The agent creates it (under systemd, RuntimeDirectory= does).
        return Ok(());
    }
    match UnixListener::bind(path) {
        Ok(listener) => {
            drop(listener);
            std::fs::remove_file(path)
                .map_err(|e| format!("{shown}: bound, but the test socket cannot be removed: {e}"))
        }
        Err(e) => Err(format!("cannot bind {shown}: {e}")),
    }
}

/// `fields` of `spec` as they would be sent.
fn show(
    cfg: &Config,
    spec: &SourceSpec,
    fields: &crate::event::reading::Fields,
    ids: Option<&mut EventIdGen>,
) -> Result<Shown, String> {
    let ids = ids.ok_or("the OS random source failed, no event id can be issued")?;
    let now = crate::os::clock::reading_now();
    let env = Envelope {
        event_id: ids.next_id(),
        device_id: &cfg.device_id,
        stream: &spec.name,
        seq: 0,
        ts_ms: now.wall_ms,
        clock_trusted: now.trusted,
        mono: now.mono,
        fields,
    };
    let json = envelope::encode(Format::Json, &env)?;
    let payload_bytes = match cfg.mqtt.payload_format {
        Format::Json => json.len(),
        Format::Postcard => envelope::encode(Format::Postcard, &env)?.len(),
    };
    Ok(Shown {
        topic: format!("{}/events/{}", cfg.mqtt.topic_prefix, spec.name),
        json: String::from_utf8_lossy(&json).into_owned(),
        payload_bytes,
    })
}

/// The spool's directory (a system source reports its free space); only
/// read, never created.
fn spool_dir(spool: &Path) -> PathBuf {
    spool
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(extra: &str) -> Config {
        let text = format!(
            "device_id = \"t\"\n[spool]\npath = \"/nonexistent/dir/spool.db\"\n[mqtt]\nurl = \"mqtt://127.0.0.1:1\"\ntopic_prefix = \"p\"\n{extra}"
        );
        crate::config::parse(&text, "t.toml", &[]).expect("config")
    }

    #[test]
    fn each_source_gives_a_reading_or_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let good = dir.path().join("n");
        std::fs::write(&good, "21500\n").unwrap();
        let c = cfg(&format!(
            "[[sources]]\nname = \"ok\"\nkind = \"file\"\npath = \"{}\"\nscale = 0.001\nfield = \"temp_c\"\n[[sources]]\nname = \"gone\"\nkind = \"file\"\npath = \"{}\"\n",
            good.display(),
            dir.path().join("missing").display()
        ));
        let r = sample_sources(&c);
        assert_eq!(r.len(), 2);
        let Ok(Taken::Reading(shown)) = &r[0].outcome else {
            panic!("not a reading: {:?}", r[0].outcome)
        };
        assert_eq!(shown.topic, "p/events/ok");
        let v: serde_json::Value = serde_json::from_str(&shown.json).unwrap();
        assert_eq!(v["fields"]["temp_c"], 21.5);
        assert_eq!(
            (v["stream"].as_str(), v["seq"].as_u64()),
            (Some("ok"), Some(0))
        );
        assert_eq!(shown.payload_bytes, shown.json.len());
        assert_eq!(
            (r[1].name.as_str(), r[1].key.as_str()),
            ("gone", "sources[1]")
        );
        let e = r[1].outcome.as_ref().unwrap_err();
        assert!(e.contains("missing"), "{e}");
        assert!(!Path::new("/nonexistent/dir").exists());
    }

    #[test]
    fn an_mqtt_source_takes_no_sample_but_its_broker_must_accept_connections() {
        let open = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = open.local_addr().unwrap().port();
        let closed = TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let c = cfg(&format!(
            "[[sources]]\nname = \"up\"\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{port}\"\ntopics = [\"a/#\"]\n[[sources]]\nname = \"down\"\nkind = \"mqtt\"\nurl = \"mqtt://127.0.0.1:{closed}\"\ntopics = [\"a/#\"]\n"
        ));
        let r = sample_sources(&c);
        let Ok(Taken::NoSample(what)) = &r[0].outcome else {
            panic!("{:?}", r[0].outcome)
        };
        assert!(what.contains("no sample taken"), "{what}");
        let e = r[1].outcome.as_ref().unwrap_err();
        assert!(e.contains("cannot connect"), "{e}");
    }

    #[test]
    fn a_listener_in_use_is_reported_and_a_free_one_is_released() {
        let busy = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = busy.local_addr().unwrap();
        let c = cfg(&format!("[metrics]\nlisten = \"{addr}\"\n"));
        let ls = listeners(&c);
        assert_eq!(ls.len(), 1);
        assert_eq!(ls[0].key(), "metrics.listen");
        let e = try_bind(&ls[0]).unwrap_err();
        assert!(e.contains("in use") || e.contains("running agent"), "{e}");
        drop(busy);
        assert_eq!(try_bind(&ls[0]), Ok(()));
        // Released: it can be bound again.
        TcpListener::bind(addr).expect("released");

        let dir = tempfile::tempdir().unwrap();
        let sock = Listener::Unix {
            key: "k".into(),
            path: dir.path().join("s.sock"),
            group: None,
        };
        assert_eq!(try_bind(&sock), Ok(()));
        assert!(!dir.path().join("s.sock").exists(), "nothing left behind");
        let live = std::os::unix::net::UnixListener::bind(dir.path().join("s.sock")).unwrap();
        assert!(try_bind(&sock).unwrap_err().contains("listening"));
        drop(live);
        // The file stays, nobody listens: stale, the agent replaces it.
        assert_eq!(try_bind(&sock), Ok(()));
        // A regular file there is never the agent's to replace.
        let file = Listener::Unix {
            key: "ingest.socket".into(),
            path: dir.path().join("f.sock"),
            group: None,
        };
        std::fs::write(dir.path().join("f.sock"), "x").unwrap();
        assert!(try_bind(&file).unwrap_err().contains("not a socket"));
    }

    #[test]
    fn a_socket_group_that_does_not_exist_fails_the_listener() {
        let dir = tempfile::tempdir().unwrap();
        let sock = dir.path().join("i.sock");
        let with = |group: &str| {
            cfg(&format!(
                "[ingest]\nsocket = \"{}\"\nsocket_group = \"{group}\"\n[[ingest.streams]]\nname = \"pump\"\n",
                sock.display()
            ))
        };
        let ls = listeners(&with("no-such-group-edgespool"));
        let e = try_bind(&ls[0]).unwrap_err();
        assert!(e.contains("no such group"), "{e}");
        assert!(e.contains("no-such-group-edgespool"), "{e}");
        // The group "root" (gid 0) exists on every Linux system.
        let ls = listeners(&with("root"));
        assert_eq!(try_bind(&ls[0]), Ok(()));
        assert!(!sock.exists(), "nothing left behind");
    }

    #[test]
    fn a_followed_replay_with_only_its_header_has_no_rows_yet_not_a_failure() {
        let dir = tempfile::tempdir().unwrap();
        let csv = dir.path().join("t.csv");
        std::fs::write(&csv, "ts,temp_c\n").unwrap();
        let src = |name: &str, follow: bool| {
            format!(
                "[[sources]]\nname = \"{name}\"\nkind = \"replay\"\npath = \"{}\"\ntimestamp_columns = [\"ts\"]\ntimestamp_format = \"%s\"\nfollow = {follow}\n",
                csv.display()
            )
        };
        let c = cfg(&format!("{}{}", src("tail", true), src("once", false)));
        let r = sample_sources(&c);
        let Ok(Taken::NoRowsYet(note)) = &r[0].outcome else {
            panic!("{:?}", r[0].outcome)
        };
        assert!(note.contains("following"), "{note}");
        // Not followed: a file with no row is a failure, as before.
        let e = r[1].outcome.as_ref().unwrap_err();
        assert!(e.contains("no usable row"), "{e}");
        // Once a row is there, the followed replay gives it.
        std::fs::write(&csv, "ts,temp_c\n1796000000,21.5\n").unwrap();
        let r = sample_sources(&c);
        assert!(
            matches!(r[0].outcome, Ok(Taken::Reading(_))),
            "{:?}",
            r[0].outcome
        );
    }

    #[test]
    fn the_ingest_listeners_are_listed_with_their_keys() {
        let c = cfg("[ingest]\nsocket = \"/run/edgespool/ingest.sock\"\ntcp = \"127.0.0.1:7788\"\n[[ingest.streams]]\nname = \"pump\"\n");
        let ls = listeners(&c);
        let keys: Vec<&str> = ls.iter().map(Listener::key).collect();
        assert_eq!(keys, ["ingest.socket", "ingest.tcp"]);
    }
}
