//! The sink's settings file (`sink --config FILE`, a `[sink]` section) and
//! the flags over it: what the sink runs with.
//!
//! Its one rule: **a flag overrides the file, key by key** (`--db` or
//! `--postgres` replace the file's store as a whole; `--no-receipts`
//! beats `receipts = true`), and the file holds no secret itself: a
//! conninfo with a password in it is refused, the password goes in a
//! `password_file` only its owner can read.
//!
//! ```toml
//! [sink]
//! url = "mqtt://broker.example:1883"
//! topic = "edgespool/+/events/#"
//! client_id = "sink-a"            # stable per sink
//! share = "fleet"                 # $share/fleet/...
//! batch_max = 500
//! batch_ms = 100
//! receipts = true
//! receipt_key = "/etc/edgespool/receipt.key"  # signs receipts (edgespool keygen)
//! username = "sink"               # MQTT login, with password_file
//! password_file = "/etc/edgespool/sink-mqtt.password"
//! # db = "/var/lib/edgespool/sink.db"   # SQLite, or:
//! [sink.postgres]
//! conninfo = "host=db.example user=sink dbname=fleet sslmode=verify-full"
//! password_file = "/etc/edgespool/sink-pg.password"   # mode 0600
//! ca = "/etc/edgespool/pg-ca.pem"
//! # cert = "..."  key = "..."     # client certificate
//! ```

use std::path::{Path, PathBuf};

use toml::{Table, Value};

use super::super::args::{Args, PgTlsArgs};

/// `[sink]`: the flags' settings, by the same names (`_` for `-`).
#[derive(Default)]
pub struct SinkSection {
    /// The file it was read from and the line of its `[sink]` header (for
    /// a message about a key it lacks).
    file: Option<(PathBuf, Option<usize>)>,
    url: Option<String>,
    topic: Option<String>,
    client_id: Option<String>,
    share: Option<String>,
    batch_max: Option<usize>,
    batch_ms: Option<u64>,
    receipts: Option<bool>,
    receipt_key: Option<PathBuf>,
    username: Option<String>,
    password_file: Option<PathBuf>,
    db: Option<PathBuf>,
    postgres: Option<PgSection>,
}

/// `[sink.postgres]`.
struct PgSection {
    conninfo: String,
    password_file: Option<PathBuf>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
}

const SINK_KEYS: &str = "url, topic, client_id, share, batch_max, batch_ms, receipts, \
                         receipt_key, username, password_file, db, postgres";
const PG_KEYS: &str = "conninfo, password_file, ca, cert, key";

/// Why the file cannot be used: the key at fault (`sink.batch_max`), what is
/// wrong, and the line when the TOML parser gave one; [`read`] finds the
/// line of the key (or of its table) otherwise.
struct Refusal {
    key: String,
    line: Option<usize>,
    message: String,
}

fn refuse(key: impl Into<String>, message: impl Into<String>) -> Refusal {
    Refusal {
        key: key.into(),
        line: None,
        message: message.into(),
    }
}

/// A value as the file spells it (`"many"`, `5`), a table or an array by
/// its kind.
fn shown(v: &Value) -> String {
    match v {
        Value::Table(_) => "a table".to_owned(),
        Value::Array(_) => "an array".to_owned(),
        v => v.to_string(),
    }
}

/// One table's keys taken out one by one, each checked for its type; what
/// is left at the end is an unknown key. (Read from a `toml::Table`, which
/// the config's `--set` already parses, rather than by a derived
/// `Deserialize`: the armv7 binary has no room for another.)
struct Keys {
    table: Table,
    at: &'static str,
}

impl Keys {
    fn take(&mut self, key: &str) -> Option<Value> {
        self.table.remove(key)
    }

    fn bad(&self, key: &str, want: &str, got: &Value) -> Refusal {
        refuse(
            format!("{}.{key}", self.at),
            format!("expected {want}, got {}", shown(got)),
        )
    }

    fn string(&mut self, key: &str) -> Result<Option<String>, Refusal> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(self.bad(key, "text in quotes", &v)),
        }
    }

    fn path(&mut self, key: &str) -> Result<Option<PathBuf>, Refusal> {
        Ok(self.string(key)?.map(PathBuf::from))
    }

    /// A whole number, 0 or more; `unit` completes "a whole number" (` of
    /// milliseconds`).
    fn number(&mut self, key: &str, unit: &str) -> Result<Option<u64>, Refusal> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Integer(n)) if n >= 0 => Ok(Some(n as u64)),
            Some(v) => Err(self.bad(key, &format!("a whole number{unit}, 0 or more"), &v)),
        }
    }

    fn boolean(&mut self, key: &str) -> Result<Option<bool>, Refusal> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Boolean(b)) => Ok(Some(b)),
            Some(v) => Err(self.bad(key, "true or false", &v)),
        }
    }

    /// Errors: the first key left, as unknown.
    fn done(self, known: &str) -> Result<(), Refusal> {
        match self.table.keys().next() {
            None => Ok(()),
            Some(k) => Err(refuse(
                format!("{}.{k}", self.at),
                format!("unknown key (known keys: {known})"),
            )),
        }
    }
}

/// Where the sink keeps what it takes.
pub enum Store {
    /// `--db` / `db`.
    Sqlite(PathBuf),
    /// `--postgres` / `[sink.postgres]`.
    Postgres {
        /// The conninfo.
        conninfo: String,
        /// The password file, if one is named.
        password_file: Option<PathBuf>,
        /// TLS files.
        tls: PgTlsArgs,
    },
}

/// The flags and the file together, before the checks of what a run needs.
pub struct Merged {
    /// The settings file (`--config`) and the line of its `[sink]` header,
    /// when one was read: a setting a run needs and lacks is then named by
    /// its key there.
    pub file: Option<(PathBuf, Option<usize>)>,
    pub store: Option<Store>,
    pub url: Option<String>,
    pub topic: Option<String>,
    pub client_id: Option<String>,
    pub share: Option<String>,
    pub batch_max: Option<usize>,
    pub batch_ms: Option<u64>,
    pub receipts: bool,
    pub receipt_key: Option<PathBuf>,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
    pub stats: bool,
    pub json: bool,
}

/// The `[sink]` section of the file at `path`.
///
/// Errors: the sentence to tell: `sink settings file FILE does not exist`,
/// or `config invalid: FILE:LINE: KEY: what is wrong` (the line where the
/// key, or the table that lacks it, is written).
pub fn read(path: &Path) -> Result<SinkSection, String> {
    let shown = path.display();
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("sink settings file {shown} does not exist"))
        }
        Err(e) => return Err(format!("config invalid: {shown}: cannot read: {e}")),
    };
    match parse(&text) {
        Ok(mut s) => {
            s.file = Some((path.to_owned(), crate::config::line_of_key(&text, "sink")));
            Ok(s)
        }
        Err(r) => {
            let table = r.key.rsplit_once('.').map_or("", |(t, _)| t);
            let line = r
                .line
                .or_else(|| crate::config::line_of_key(&text, &r.key))
                .or_else(|| crate::config::line_of_key(&text, table));
            Err(match line {
                Some(l) => format!("config invalid: {shown}:{l}: {}: {}", r.key, r.message),
                None => format!("config invalid: {shown}: {}: {}", r.key, r.message),
            })
        }
    }
}

fn parse(text: &str) -> Result<SinkSection, Refusal> {
    let mut root: Table = text.parse().map_err(|e: toml::de::Error| Refusal {
        key: "(syntax)".into(),
        line: e
            .span()
            .map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1),
        message: e.message().trim().to_owned(),
    })?;
    let sink = match root.remove("sink") {
        Some(Value::Table(t)) => t,
        Some(v) => {
            return Err(refuse(
                "sink",
                format!("expected a table, got {}", shown(&v)),
            ))
        }
        None => {
            return Err(refuse(
                "sink",
                "no [sink] section: the sink's settings go under [sink]",
            ))
        }
    };
    if let Some(k) = root.keys().next() {
        return Err(refuse(
            k.as_str(),
            "unknown key (the file has one [sink] section)",
        ));
    }
    let mut k = Keys {
        table: sink,
        at: "sink",
    };
    let batch_max = match k.number("batch_max", "")? {
        Some(n) => Some(usize::try_from(n).map_err(|e| refuse("sink.batch_max", e.to_string()))?),
        None => None,
    };
    let postgres = match k.take("postgres") {
        None => None,
        Some(Value::Table(t)) => Some(postgres(t)?),
        Some(v) => return Err(k.bad("postgres", "a table", &v)),
    };
    let s = SinkSection {
        file: None,
        url: k.string("url")?,
        topic: k.string("topic")?,
        client_id: k.string("client_id")?,
        share: k.string("share")?,
        batch_max,
        batch_ms: k.number("batch_ms", " of milliseconds")?,
        receipts: k.boolean("receipts")?,
        receipt_key: k.path("receipt_key")?,
        username: k.string("username")?,
        password_file: k.path("password_file")?,
        db: k.path("db")?,
        postgres,
    };
    k.done(SINK_KEYS)?;
    if s.db.is_some() && s.postgres.is_some() {
        return Err(refuse(
            "sink.db",
            "db and [sink.postgres] exclude each other",
        ));
    }
    Ok(s)
}

fn postgres(t: Table) -> Result<PgSection, Refusal> {
    let mut k = Keys {
        table: t,
        at: "sink.postgres",
    };
    let conninfo = k.string("conninfo")?.ok_or_else(|| {
        refuse(
            "sink.postgres.conninfo",
            "required key is missing (libpq keywords or a URL)",
        )
    })?;
    if crate::sink::conninfo::has_password(&conninfo) {
        return Err(refuse(
            "sink.postgres.conninfo",
            "holds a password: put it in a file named by sink.postgres.password_file (mode 0600)",
        ));
    }
    let pg = PgSection {
        conninfo,
        password_file: k.path("password_file")?,
        ca: k.path("ca")?,
        cert: k.path("cert")?,
        key: k.path("key")?,
    };
    k.done(PG_KEYS)?;
    Ok(pg)
}

/// `a` over `file`, key by key.
///
/// Errors: a usage error's words (both `--db` and `--postgres`, or TLS
/// flags without PostgreSQL).
pub fn merge(a: Args, file: SinkSection) -> Result<Merged, String> {
    let f = file;
    let pg_flags = a.pg_tls.any() || a.pg_password_file.is_some();
    let store = match (a.db, a.postgres) {
        (Some(_), Some(_)) => return Err("--db and --postgres exclude each other".into()),
        (Some(db), None) => Some(Store::Sqlite(db)),
        (None, Some(conninfo)) => Some(Store::Postgres {
            conninfo,
            password_file: a.pg_password_file,
            tls: a.pg_tls,
        }),
        (None, None) => match (f.db, f.postgres) {
            (Some(db), _) => Some(Store::Sqlite(db)),
            (None, Some(pg)) => Some(Store::Postgres {
                conninfo: pg.conninfo,
                password_file: a.pg_password_file.or(pg.password_file),
                tls: PgTlsArgs {
                    ca: a.pg_tls.ca.or(pg.ca),
                    cert: a.pg_tls.cert.or(pg.cert),
                    key: a.pg_tls.key.or(pg.key),
                },
            }),
            (None, None) => None,
        },
    };
    if let Some(Store::Sqlite(_)) = &store {
        if pg_flags {
            return Err(
                "--pg-ca, --pg-cert, --pg-key and --pg-password-file go with PostgreSQL".into(),
            );
        }
    }
    Ok(Merged {
        file: f.file,
        store,
        url: a.url.or(f.url),
        topic: a.topic.or(f.topic),
        client_id: a.client_id.or(f.client_id),
        share: a.share.or(f.share),
        batch_max: a.batch_max.or(f.batch_max),
        batch_ms: a.batch_ms.or(f.batch_ms),
        receipts: !a.no_receipts && f.receipts.unwrap_or(true),
        receipt_key: a.receipt_key.or(f.receipt_key),
        username: a.username.or(f.username),
        password_file: a.password_file.or(f.password_file),
        stats: a.stats,
        json: a.json,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> Result<SinkSection, String> {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("sink.toml");
        std::fs::write(&p, text).expect("write");
        read(&p)
    }

    #[test]
    fn the_shipped_example_reads_and_names_a_postgres_store() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("packaging/sink.toml");
        let s = read(&p).unwrap_or_else(|e| panic!("{e}"));
        let m = merge(Args::default(), s).expect("merged");
        assert!(matches!(
            m.store,
            Some(Store::Postgres {
                password_file: Some(_),
                ..
            })
        ));
        assert!(m.url.is_some() && m.topic.is_some() && m.client_id.is_some());
    }

    #[test]
    fn flags_override_the_file_key_by_key() {
        let f = file(
            "[sink]\nurl = \"mqtt://a:1\"\ntopic = \"t/#\"\nclient_id = \"f\"\nbatch_max = 9\n\
             receipts = true\n[sink.postgres]\nconninfo = \"host=db\"\npassword_file = \"/f\"\nca = \"/ca\"\n",
        )
        .expect("valid");
        let a = Args {
            url: Some("mqtt://b:2".into()),
            no_receipts: true,
            pg_password_file: Some("/flag".into()),
            ..Args::default()
        };
        let m = merge(a, f).expect("merged");
        assert_eq!(m.url.as_deref(), Some("mqtt://b:2"));
        assert_eq!(m.topic.as_deref(), Some("t/#"));
        assert_eq!((m.client_id.as_deref(), m.batch_max), (Some("f"), Some(9)));
        assert!(!m.receipts);
        match m.store {
            Some(Store::Postgres {
                conninfo,
                password_file,
                tls,
            }) => {
                assert_eq!(conninfo, "host=db");
                assert_eq!(password_file, Some(PathBuf::from("/flag")));
                assert_eq!(tls.ca, Some(PathBuf::from("/ca")));
            }
            _ => panic!("the file's PostgreSQL store"),
        }
    }

    #[test]
    fn a_store_flag_replaces_the_files_store() {
        let f = file("[sink]\n[sink.postgres]\nconninfo = \"host=db\"\n").expect("valid");
        let a = Args {
            db: Some("x.db".into()),
            ..Args::default()
        };
        assert!(matches!(
            merge(a, f).map(|m| m.store),
            Ok(Some(Store::Sqlite(_)))
        ));
    }

    #[test]
    fn the_file_names_the_key_it_cannot_take_and_keeps_no_password() {
        let e = file("[sink]\nbatch_max = \"many\"\n")
            .err()
            .unwrap_or_default();
        assert!(
            e.ends_with(":2: sink.batch_max: expected a whole number, 0 or more, got \"many\""),
            "{e}"
        );
        let e = file("[sink]\nurll = \"x\"\n").err().unwrap_or_default();
        assert!(e.contains(":2: sink.urll: unknown key"), "{e}");
        let e = file("[sink]\n[sink.postgres]\nconninfo = \"h\"\nca = 1\n")
            .err()
            .unwrap_or_default();
        assert!(
            e.ends_with(":4: sink.postgres.ca: expected text in quotes, got 1"),
            "{e}"
        );
        let e = file("[sink]\n[other]\nx = 1\n").err().unwrap_or_default();
        assert!(e.contains(":2: other: unknown key"), "{e}");
        let e = file("[sink]\n[sink.postgres]\nconninfo = \"host=db password=s3cret\"\n")
            .err()
            .unwrap_or_default();
        assert!(
            e.contains(":3: sink.postgres.conninfo: holds a password") && !e.contains("s3cret"),
            "{e}"
        );
        let e = file("[sink]\ndb = \"a\"\n[sink.postgres]\nconninfo = \"host=db\"\n")
            .err()
            .unwrap_or_default();
        assert!(
            e.contains(":2: sink.db: db and [sink.postgres] exclude each other"),
            "{e}"
        );
    }

    #[test]
    fn every_refusal_names_the_file_the_line_and_the_key() {
        // A missing key: the line of the table that lacks it.
        let e = file("# the fleet's sink\n[sink]\n[sink.postgres]\nca = \"/ca\"\n")
            .err()
            .unwrap_or_default();
        assert!(e.starts_with("config invalid: "), "{e}");
        assert!(
            e.contains("sink.toml:3: sink.postgres.conninfo: required key is missing"),
            "{e}"
        );
        // A syntax error: the parser's line.
        let e = file("[sink]\nurl = \n").err().unwrap_or_default();
        assert!(e.contains("sink.toml:2: (syntax): "), "{e}");
        let e = file("url = \"x\"\n").err().unwrap_or_default();
        assert!(e.contains(": sink: no [sink] section"), "{e}");
        // A file that is not there is said as such.
        let e = read(Path::new("/nonexistent/sink-fleet.toml"))
            .err()
            .unwrap_or_default();
        assert_eq!(
            e,
            "sink settings file /nonexistent/sink-fleet.toml does not exist"
        );
        // The [sink] header's line, for a setting a run lacks.
        let s = file("# x\n\n[sink]\nurl = \"mqtt://a:1\"\n").expect("valid");
        let m = merge(Args::default(), s).expect("merged");
        assert_eq!(m.file.map(|(_, line)| line), Some(Some(3)));
    }
}
