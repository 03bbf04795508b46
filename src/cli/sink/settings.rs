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

use serde::Deserialize;

use super::super::args::{Args, PgTlsArgs};

/// The file: one `[sink]` table.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SinkFile {
    sink: SinkSection,
}

/// `[sink]`: the flags' settings, by the same names (`_` for `-`).
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub struct SinkSection {
    url: Option<String>,
    topic: Option<String>,
    client_id: Option<String>,
    share: Option<String>,
    batch_max: Option<usize>,
    batch_ms: Option<u64>,
    receipts: Option<bool>,
    username: Option<String>,
    password_file: Option<PathBuf>,
    db: Option<PathBuf>,
    postgres: Option<PgSection>,
}

/// `[sink.postgres]`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct PgSection {
    conninfo: String,
    password_file: Option<PathBuf>,
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
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
    pub store: Option<Store>,
    pub url: Option<String>,
    pub topic: Option<String>,
    pub client_id: Option<String>,
    pub share: Option<String>,
    pub batch_max: Option<usize>,
    pub batch_ms: Option<u64>,
    pub receipts: bool,
    pub username: Option<String>,
    pub password_file: Option<PathBuf>,
    pub stats: bool,
    pub json: bool,
}

/// Why the file cannot be used (told as `config invalid: FILE: ...`).
pub fn read(path: &Path) -> Result<SinkSection, String> {
    let shown = path.display();
    let text = std::fs::read_to_string(path).map_err(|e| format!("{shown}: cannot read: {e}"))?;
    let de =
        toml::Deserializer::parse(&text).map_err(|e| format!("{shown}: {}", e.message().trim()))?;
    let file: SinkFile = serde_path_to_error::deserialize(de).map_err(|e| {
        let key = e.path().to_string();
        format!("{shown}: {key}: {}", e.inner().message().trim())
    })?;
    let s = file.sink;
    if s.db.is_some() && s.postgres.is_some() {
        return Err(format!(
            "{shown}: sink: db and [sink.postgres] exclude each other"
        ));
    }
    if let Some(pg) = &s.postgres {
        if edgespool::sink::conninfo::has_password(&pg.conninfo) {
            return Err(format!(
                "{shown}: sink.postgres.conninfo holds a password: put it in a file named by \
                 sink.postgres.password_file (mode 0600)"
            ));
        }
    }
    Ok(s)
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
        store,
        url: a.url.or(f.url),
        topic: a.topic.or(f.topic),
        client_id: a.client_id.or(f.client_id),
        share: a.share.or(f.share),
        batch_max: a.batch_max.or(f.batch_max),
        batch_ms: a.batch_ms.or(f.batch_ms),
        receipts: !a.no_receipts && f.receipts.unwrap_or(true),
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
        assert!(e.contains("sink.batch_max"), "{e}");
        let e = file("[sink]\nurll = \"x\"\n").err().unwrap_or_default();
        assert!(e.contains("urll"), "{e}");
        let e = file("[other]\n").err().unwrap_or_default();
        assert!(e.contains("other"), "{e}");
        let e = file("[sink]\n[sink.postgres]\nconninfo = \"host=db password=s3cret\"\n")
            .err()
            .unwrap_or_default();
        assert!(
            e.contains("holds a password") && !e.contains("s3cret"),
            "{e}"
        );
        let e = file("[sink]\ndb = \"a\"\n[sink.postgres]\nconninfo = \"host=db\"\n")
            .err()
            .unwrap_or_default();
        assert!(e.contains("exclude each other"), "{e}");
    }
}
