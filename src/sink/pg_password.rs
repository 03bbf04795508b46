//! Where the sink's PostgreSQL password comes from, when the conninfo
//! names none. The `postgres` crate (tokio-postgres 0.7) reads no
//! environment at all: a password comes only from the conninfo or
//! `Config::password`, so libpq's `PGPASSWORD` and `PGPASSFILE` are read
//! here, with libpq's rules
//! (<https://www.postgresql.org/docs/current/libpq-pgpass.html>).
//!
//! Its one rule: **a password is read from a file only if no one but its
//! owner can read it** (mode 0600 or stricter, as libpq asks of a password
//! file, and named itself: a symlink is refused), and it never appears in
//! a message.
//!
//! Precedence, first found wins: a password in the conninfo; the
//! explicit password file (`--pg-password-file`, or `password_file` under
//! `[sink.postgres]`); `PGPASSWORD`; the first matching line of the file
//! `PGPASSFILE` names. `~/.pgpass` is not read: a service names its file.

use std::path::{Path, PathBuf};

use crate::os::fsguard::files::{read_secret, SecretRefused};

use postgres::config::Host;
use postgres::Config;

/// Where the password in force came from (for the start-up log line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PasswordFrom {
    /// The conninfo itself.
    Conninfo,
    /// The explicit password file.
    File(PathBuf),
    /// `PGPASSWORD`.
    Env,
    /// A line of the `PGPASSFILE` file.
    Passfile(PathBuf),
    /// No password (trust, peer or certificate authentication).
    None,
}

/// Why no password could be read. Each is fatal: the operator fixes the
/// file named (its path, owner or mode).
#[derive(Debug, thiserror::Error)]
pub enum PasswordError {
    /// Fix the path or its permissions.
    #[error("{what} {}: cannot read: {source}", path.display())]
    Unreadable {
        /// Which setting named it.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// What reading said.
        source: std::io::Error,
    },
    /// `chmod 600` the file.
    #[error("{what} {}: mode {mode:04o} lets group or others read it; chmod 600 it", path.display())]
    TooOpen {
        /// Which setting named it.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Name the file itself, not a link to it.
    #[error("{what} {}: a symbolic link, never followed for a password; name the file itself", path.display())]
    Symlink {
        /// Which setting named it.
        what: &'static str,
        /// The link.
        path: PathBuf,
    },
    /// Name a regular file.
    #[error("{what} {}: not a regular file", path.display())]
    NotAFile {
        /// Which setting named it.
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
    /// Save the file as UTF-8.
    #[error("{what} {}: not UTF-8", path.display())]
    NotUtf8 {
        /// Which setting named it.
        what: &'static str,
        /// The file.
        path: PathBuf,
    },
}

/// Reads `path` whole, once its handle shows a regular file that only its
/// owner may read (checked on the opened file, not on the path, which is
/// opened `O_NOFOLLOW`: a symlink is refused, never followed; see
/// [`read_secret`]).
///
/// Errors: [`PasswordError`].
pub fn read_private(what: &'static str, path: &Path) -> Result<String, PasswordError> {
    let path_ = || path.to_owned();
    let bytes = read_secret(path).map_err(|e| match e {
        SecretRefused::Symlink => PasswordError::Symlink {
            what,
            path: path_(),
        },
        SecretRefused::NotRegular => PasswordError::NotAFile {
            what,
            path: path_(),
        },
        SecretRefused::Readable { mode } => PasswordError::TooOpen {
            what,
            path: path_(),
            mode,
        },
        e @ SecretRefused::TooLarge { .. } => PasswordError::Unreadable {
            what,
            path: path_(),
            source: std::io::Error::new(std::io::ErrorKind::InvalidData, e.to_string()),
        },
        SecretRefused::Unreadable(source) => PasswordError::Unreadable {
            what,
            path: path_(),
            source,
        },
    })?;
    String::from_utf8(bytes).map_err(|_| PasswordError::NotUtf8 {
        what,
        path: path_(),
    })
}

/// The password of a password file: its text without one trailing
/// newline (`\n` or `\r\n`).
pub fn read_password_file(path: &Path) -> Result<String, PasswordError> {
    let text = read_private("password_file", path)?;
    let t = text.strip_suffix('\n').unwrap_or(&text);
    Ok(t.strip_suffix('\r').unwrap_or(t).to_owned())
}

/// Gives `config` a password when it has none, by the module's precedence;
/// `env` reads an environment variable (the process's, or a test's).
///
/// Errors: [`PasswordError`] for a password file or `PGPASSFILE` that
/// cannot be used.
pub fn fill(
    config: &mut Config,
    password_file: Option<&Path>,
    env: impl Fn(&str) -> Option<String>,
) -> Result<PasswordFrom, PasswordError> {
    if config.get_password().is_some() {
        return Ok(PasswordFrom::Conninfo);
    }
    if let Some(path) = password_file {
        config.password(read_password_file(path)?);
        return Ok(PasswordFrom::File(path.to_owned()));
    }
    if let Some(pw) = env("PGPASSWORD").filter(|p| !p.is_empty()) {
        config.password(pw);
        return Ok(PasswordFrom::Env);
    }
    if let Some(file) = env("PGPASSFILE").filter(|p| !p.is_empty()) {
        let path = PathBuf::from(file);
        let text = read_private("PGPASSFILE", &path)?;
        if let Some(pw) = lookup_for(config, &text) {
            config.password(pw);
            return Ok(PasswordFrom::Passfile(path));
        }
    }
    Ok(PasswordFrom::None)
}

/// The passfile's password for the first of `config`'s hosts that has a
/// matching line.
fn lookup_for(config: &Config, text: &str) -> Option<String> {
    let user = config.get_user().unwrap_or("");
    let db = config.get_dbname().unwrap_or(user);
    let ports = config.get_ports();
    let hosts: Vec<String> = config
        .get_hosts()
        .iter()
        .map(|h| match h {
            Host::Tcp(name) => name.clone(),
            // libpq matches a socket directory as `localhost`.
            Host::Unix(_) => "localhost".to_owned(),
        })
        .collect();
    let hosts = if hosts.is_empty() {
        vec!["localhost".to_owned()]
    } else {
        hosts
    };
    hosts.iter().enumerate().find_map(|(i, host)| {
        let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
        lookup(text, host, &port.to_string(), db, user)
    })
}

/// The password of the first line of a libpq password file that matches
/// (`hostname:port:database:username:password`; `*` matches anything;
/// `\:` and `\\` are a literal colon and backslash; `#` starts a comment
/// line).
pub fn lookup(text: &str, host: &str, port: &str, db: &str, user: &str) -> Option<String> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .find_map(|line| {
            let fields = split_fields(line);
            let [h, p, d, u, pw] = <[String; 5]>::try_from(fields).ok()?;
            let m = |pat: &str, v: &str| pat == "*" || pat == v;
            (m(&h, host) && m(&p, port) && m(&d, db) && m(&u, user)).then_some(pw)
        })
}

/// A passfile line's fields: split on `:` not escaped by `\`; the fifth
/// field takes the rest of the line.
fn split_fields(line: &str) -> Vec<String> {
    let mut out = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let (Some(n), Some(f)) = (chars.next(), out.last_mut()) {
                    f.push(n);
                }
            }
            ':' if out.len() < 5 => out.push(String::new()),
            c => {
                if let Some(f) = out.last_mut() {
                    f.push(c);
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn a_passfile_line_matches_field_by_field_with_wildcards_and_escapes() {
        let text = "# comment\n\
                    db.example:5432:fleet:sink:first\n\
                    *:*:*:sink:any\\:thing\\\\\n\
                    10.0.0.1:*:*:*:wild\n";
        assert_eq!(
            lookup(text, "db.example", "5432", "fleet", "sink").as_deref(),
            Some("first")
        );
        assert_eq!(
            lookup(text, "db.example", "6432", "fleet", "sink").as_deref(),
            Some("any:thing\\")
        );
        assert_eq!(
            lookup(text, "10.0.0.1", "1", "x", "other").as_deref(),
            Some("wild")
        );
        assert_eq!(lookup(text, "elsewhere", "5432", "fleet", "other"), None);
        assert_eq!(
            lookup("a:b:c\n", "a", "b", "c", "d"),
            None,
            "too few fields"
        );
    }

    fn private(dir: &Path, name: &str, text: &str, mode: u32) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        p
    }

    #[test]
    fn a_password_file_others_can_read_is_refused_without_its_text() {
        let dir = tempfile::tempdir().expect("tempdir");
        for mode in [0o640, 0o604, 0o660, 0o644] {
            let p = private(dir.path(), "pw", "s3cret\n", mode);
            let e = read_password_file(&p)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default();
            assert!(
                e.contains(&format!("mode {mode:04o}")) && e.contains("chmod 600"),
                "{e}"
            );
            assert!(!e.contains("s3cret"), "{e}");
        }
        let p = private(dir.path(), "pw", "s3cret\r\n", 0o600);
        assert_eq!(read_password_file(&p).ok().as_deref(), Some("s3cret"));
        let p = private(dir.path(), "pw", "two\n\n", 0o400);
        assert_eq!(read_password_file(&p).ok().as_deref(), Some("two\n"));
        assert!(matches!(
            read_password_file(dir.path()),
            Err(PasswordError::NotAFile { .. } | PasswordError::TooOpen { .. })
        ));
    }

    #[test]
    fn the_conninfo_then_the_file_then_pgpassword_then_pgpassfile() {
        let dir = tempfile::tempdir().expect("tempdir");
        let file = private(dir.path(), "pw", "from-file\n", 0o600);
        let passfile = private(
            dir.path(),
            "pgpass",
            "db:5433:fleet:sink:from-passfile\n",
            0o600,
        );
        let passfile_s = passfile.display().to_string();
        let parse = |s: &str| s.parse::<Config>().expect("conninfo");
        let base = "host=db port=5433 user=sink dbname=fleet";
        let env_all = |k: &str| match k {
            "PGPASSWORD" => Some("from-env".to_owned()),
            "PGPASSFILE" => Some(passfile_s.clone()),
            _ => None,
        };
        let mut c = parse(&format!("{base} password=inline"));
        assert_eq!(
            fill(&mut c, Some(&file), env_all).ok(),
            Some(PasswordFrom::Conninfo)
        );
        assert_eq!(c.get_password(), Some(&b"inline"[..]));
        let mut c = parse(base);
        assert_eq!(
            fill(&mut c, Some(&file), env_all).ok(),
            Some(PasswordFrom::File(file.clone()))
        );
        assert_eq!(c.get_password(), Some(&b"from-file"[..]));
        let mut c = parse(base);
        assert_eq!(fill(&mut c, None, env_all).ok(), Some(PasswordFrom::Env));
        assert_eq!(c.get_password(), Some(&b"from-env"[..]));
        let only_passfile = |k: &str| (k == "PGPASSFILE").then(|| passfile_s.clone());
        let mut c = parse(base);
        assert_eq!(
            fill(&mut c, None, only_passfile).ok(),
            Some(PasswordFrom::Passfile(passfile.clone()))
        );
        assert_eq!(c.get_password(), Some(&b"from-passfile"[..]));
        let mut c = parse("host=other user=sink");
        assert_eq!(
            fill(&mut c, None, only_passfile).ok(),
            Some(PasswordFrom::None)
        );
        assert_eq!(c.get_password(), None);
        std::fs::set_permissions(&passfile, std::fs::Permissions::from_mode(0o644)).expect("chmod");
        let mut c = parse(base);
        assert!(matches!(
            fill(&mut c, None, only_passfile),
            Err(PasswordError::TooOpen { .. })
        ));
    }

    #[test]
    fn a_fifo_at_the_password_path_is_refused_at_once_not_waited_on() {
        let d = tempfile::tempdir().expect("tempdir");
        let fifo = d.path().join("pw");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).expect("path");
        // SAFETY: mkfifo(3) on a NUL-terminated path we own.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let e = read_private("password_file", &fifo).expect_err("a FIFO is no password file");
        assert!(matches!(e, PasswordError::NotAFile { .. }), "{e}");
    }

    #[test]
    fn a_symlink_at_the_password_path_is_refused_not_followed() {
        let d = tempfile::tempdir().expect("tempdir");
        let real = d.path().join("real");
        std::fs::write(&real, "pw\n").expect("write");
        std::fs::set_permissions(&real, std::fs::Permissions::from_mode(0o600)).expect("chmod");
        let link = d.path().join("pw");
        std::os::unix::fs::symlink(&real, &link).expect("symlink");
        let e = read_password_file(&link).expect_err("a symlink is no password file");
        assert!(matches!(e, PasswordError::Symlink { .. }), "{e}");
        assert!(e.to_string().contains("symbolic link"), "{e}");
        assert_eq!(read_password_file(&real).expect("the file itself"), "pw");
    }
}
