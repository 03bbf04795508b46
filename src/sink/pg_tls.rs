//! TLS for the PostgreSQL connection: what `sslmode` asks for, and the
//! rustls client (ring provider, the one the agent's MQTT TLS links) that
//! gives it.
//!
//! Its one rule: a server certificate is trusted only through a CA the
//! operator named (`--pg-ca`); no mode falls back to trusting anything.
//!
//! `sslmode` as libpq spells it
//! (<https://www.postgresql.org/docs/current/libpq-ssl.html#LIBPQ-SSL-PROTECTION>):
//! - absent, `disable`, `prefer`, `allow`: plaintext (`NoTls`). `prefer` is
//!   libpq's default and is plaintext here, so that a conninfo without
//!   `sslmode` means what it meant before TLS existed in this sink.
//! - `verify-full`: TLS; the chain must lead to a `--pg-ca` certificate and
//!   the certificate must name the host (`host=`, a DNS name or an IP
//!   address).
//! - `verify-ca`: TLS; the chain only, any host name.
//! - `require`: as `verify-ca` (what libpq does when a root certificate is
//!   given); without `--pg-ca` it is refused rather than trusting any
//!   certificate.
//!
//! tokio-postgres knows only `disable`, `prefer` and `require`, so the mode
//! is read out of the conninfo here and the connection asks it for
//! `require` (TLS or no connection).

use super::{conninfo, pg_password};
use postgres::config::SslMode as PgSslMode;
use postgres::Config;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, RootCertStore, SignatureScheme};
use std::path::{Path, PathBuf};
use std::sync::Arc;

/// The `sslmode` of a conninfo, as libpq spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SslMode {
    /// `disable` or `allow`: plaintext.
    Disable,
    /// `prefer`, or no `sslmode`: plaintext here (see the module doc).
    Prefer,
    /// `require`: TLS, the chain checked against `--pg-ca`.
    Require,
    /// `verify-ca`: TLS, the chain checked, not the host name.
    VerifyCa,
    /// `verify-full`: TLS, the chain and the host name checked.
    VerifyFull,
}

impl SslMode {
    /// Whether this mode connects with TLS.
    pub fn wants_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }

    fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }
}

/// The files behind `--pg-ca`, `--pg-cert` and `--pg-key`.
#[derive(Debug, Clone, Default)]
pub struct TlsFiles {
    /// PEM bundle of the CA certificates a server certificate must lead to.
    pub ca: Option<PathBuf>,
    /// PEM client certificate chain (with `key`), for `cert` authentication.
    pub cert: Option<PathBuf>,
    /// PEM private key of `cert` (PKCS#8, PKCS#1 or SEC1).
    pub key: Option<PathBuf>,
}

/// Why the TLS settings cannot give a connection. Each is fatal: the same
/// settings give the same answer; the operator fixes the flag or file named.
#[derive(Debug, thiserror::Error)]
pub enum TlsSetupError {
    /// Fix the conninfo: tokio-postgres would not parse it either.
    #[error("--postgres: sslmode={0:?} is not one of disable, allow, prefer, require, verify-ca, verify-full")]
    UnknownMode(String),
    /// Give `--pg-ca FILE`: no mode trusts a server certificate by itself.
    #[error("sslmode={mode} needs --pg-ca FILE (or ca in [sink.postgres]: the CA that signed the server's certificate); without it no server certificate can be trusted")]
    NoCa {
        /// The mode asked for.
        mode: &'static str,
    },
    /// Ask for TLS in the conninfo, or drop the TLS flags.
    #[error("{flag} is given but the conninfo asks for no TLS (sslmode={mode}); add sslmode=verify-full to --postgres")]
    TlsFlagWithoutTls {
        /// The flag given.
        flag: &'static str,
        /// The mode in force.
        mode: &'static str,
    },
    /// Give both `--pg-cert` and `--pg-key`, or neither.
    #[error("--pg-cert and --pg-key go together (got only {0})")]
    HalfClientCert(&'static str),
    /// Fix the path or its permissions.
    #[error("{flag} {}: cannot read: {source}", path.display())]
    Unreadable {
        /// The flag that named the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What reading said.
        source: std::io::Error,
    },
    /// The file is not the PEM it should be.
    #[error("{flag} {}: {problem}", path.display())]
    BadPem {
        /// The flag that named the file.
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// rustls refused the client configuration (a key that does not match
    /// the certificate, an unsupported key type).
    #[error("TLS client configuration: {0}")]
    Config(#[from] rustls::Error),
}

/// How to connect: plaintext or rustls.
#[derive(Clone)]
pub enum Connector {
    /// No TLS (sslmode absent, `disable`, `allow` or `prefer`).
    Plain,
    /// TLS with the CA and client certificate given.
    Tls(tokio_postgres_rustls::MakeRustlsConnect),
}

/// The conninfo parsed, with what its `sslmode` asks for.
#[derive(Clone)]
pub struct PgConnect {
    /// The connection settings (sslmode `require` when TLS is asked for).
    pub config: Config,
    /// The mode the conninfo asked for.
    pub mode: SslMode,
    /// Plaintext or TLS.
    pub connector: Connector,
    /// Where its password came from.
    pub password_from: pg_password::PasswordFrom,
}

/// Why `conninfo` does not parse, told without its passwords: the error
/// of parsing the redacted text (which holds no secret), or, when only the
/// original fails, that the password's value is malformed.
fn parse_error(conninfo: &str) -> String {
    let shown = conninfo::redact(conninfo);
    let (_, redacted) = match split_sslmode(&shown) {
        Ok(r) => r,
        Err(e) => return e.to_string(),
    };
    match redacted.parse::<Config>() {
        Err(e) => format!("--postgres {shown:?}: {e}"),
        Ok(_) => format!(
            "--postgres {shown:?}: invalid connection string: the password value is malformed \
             (quote it: password='...', with \\' and \\\\ inside)"
        ),
    }
}

impl PgConnect {
    /// Parse `conninfo` (libpq keyword/value or URL form) and build the
    /// connector its `sslmode` and `files` ask for; a password it lacks is
    /// looked for as [`pg_password::fill`] says (no explicit file).
    ///
    /// Errors: as [`PgConnect::new_with`].
    pub fn new(conninfo: &str, files: &TlsFiles) -> Result<PgConnect, String> {
        PgConnect::new_with(conninfo, files, None)
    }

    /// As [`PgConnect::new`], with the password from `password_file` when
    /// the conninfo has none.
    ///
    /// Errors: a conninfo tokio-postgres refuses (told with its passwords
    /// hidden, see [`super::conninfo`]), a [`TlsSetupError`] or a
    /// [`pg_password::PasswordError`], as text for
    /// [`crate::sink::StoreError::Fatal`].
    pub fn new_with(
        conninfo: &str,
        files: &TlsFiles,
        password_file: Option<&Path>,
    ) -> Result<PgConnect, String> {
        let (mode, rest) = split_sslmode(conninfo).map_err(|e| e.to_string())?;
        let mut config: Config = rest.parse().map_err(|_| parse_error(conninfo))?;
        let password_from =
            pg_password::fill(&mut config, password_file, |k| std::env::var(k).ok())
                .map_err(|e| e.to_string())?;
        let connector = connector(mode, files).map_err(|e| e.to_string())?;
        config.ssl_mode(if mode.wants_tls() {
            PgSslMode::Require
        } else {
            PgSslMode::Disable
        });
        Ok(PgConnect {
            config,
            mode,
            connector,
            password_from,
        })
    }

    /// Connect (plaintext or TLS as asked).
    ///
    /// Errors: as [`postgres::Config::connect`]; see [`tls_failure`] for
    /// telling a refused handshake from a lost network.
    pub fn connect(&self) -> Result<postgres::Client, postgres::Error> {
        match &self.connector {
            Connector::Plain => self.config.connect(postgres::NoTls),
            Connector::Tls(t) => self.config.connect(t.clone()),
        }
    }
}

/// The rustls error under a failed connection, if the TLS handshake was
/// refused (by us: certificate not trusted, wrong name, expired; or by the
/// server: an alert). The same settings get the same answer, so the caller
/// treats it as fatal. A network failure during the handshake is not one.
pub fn tls_failure(e: &postgres::Error) -> Option<&rustls::Error> {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(e);
    while let Some(err) = cur {
        if let Some(r) = err.downcast_ref::<rustls::Error>() {
            return Some(r);
        }
        // io::Error's source() skips the error it wraps: look inside.
        if let Some(r) = err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(r);
        }
        cur = err.source();
    }
    None
}

fn connector(mode: SslMode, files: &TlsFiles) -> Result<Connector, TlsSetupError> {
    if !mode.wants_tls() {
        let given = [
            ("--pg-ca", files.ca.is_some()),
            ("--pg-cert", files.cert.is_some()),
            ("--pg-key", files.key.is_some()),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
            return Err(TlsSetupError::TlsFlagWithoutTls {
                flag,
                mode: mode.name(),
            });
        }
        return Ok(Connector::Plain);
    }
    let ca = files
        .ca
        .as_deref()
        .ok_or(TlsSetupError::NoCa { mode: mode.name() })?;
    let mut roots = RootCertStore::empty();
    for cert in read_certs("--pg-ca", ca)? {
        roots.add(cert).map_err(|e| TlsSetupError::BadPem {
            flag: "--pg-ca",
            path: ca.to_owned(),
            problem: format!("not a usable CA certificate: {e}"),
        })?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(
        Arc::new(roots),
        provider.clone(),
    )
    .build()
    .map_err(|e| TlsSetupError::BadPem {
        flag: "--pg-ca",
        path: ca.to_owned(),
        problem: e.to_string(),
    })?;
    let verifier: Arc<dyn ServerCertVerifier> = if mode == SslMode::VerifyFull {
        webpki
    } else {
        Arc::new(ChainOnly(webpki))
    };
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match (&files.cert, &files.key) {
        (None, None) => builder.with_no_client_auth(),
        (Some(_), None) => return Err(TlsSetupError::HalfClientCert("--pg-cert")),
        (None, Some(_)) => return Err(TlsSetupError::HalfClientCert("--pg-key")),
        (Some(c), Some(k)) => {
            let chain = read_certs("--pg-cert", c)?;
            let key = read_key(k)?;
            builder.with_client_auth_cert(chain, key)?
        }
    };
    Ok(Connector::Tls(
        tokio_postgres_rustls::MakeRustlsConnect::new(config),
    ))
}

fn read_file(flag: &'static str, path: &Path) -> Result<Vec<u8>, TlsSetupError> {
    std::fs::read(path).map_err(|source| TlsSetupError::Unreadable {
        flag,
        path: path.to_owned(),
        source,
    })
}

fn read_certs(
    flag: &'static str,
    path: &Path,
) -> Result<Vec<CertificateDer<'static>>, TlsSetupError> {
    let bad = |problem: String| TlsSetupError::BadPem {
        flag,
        path: path.to_owned(),
        problem,
    };
    let pem = read_file(flag, path)?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(format!("bad PEM: {e}")))?;
    if certs.is_empty() {
        return Err(bad("no CERTIFICATE block in the file".into()));
    }
    Ok(certs)
}

fn read_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsSetupError> {
    let pem = read_file("--pg-key", path)?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| TlsSetupError::BadPem {
        flag: "--pg-key",
        path: path.to_owned(),
        problem: format!("no usable private key: {e}"),
    })
}

/// `verify-ca`: the chain, the validity dates and the signatures as
/// `verify-full`, any host name. rustls checks the name only after the
/// chain verified (rustls 0.23 `WebPkiServerVerifier::verify_server_cert`),
/// so a name error means the chain was good.
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Take `sslmode` out of a conninfo: the mode, and the conninfo without it
/// (tokio-postgres refuses `verify-ca` and `verify-full`). Both libpq forms:
/// `key=value` pairs (values may be single-quoted, with `\` escapes) and
/// `postgres://` / `postgresql://` URLs (`?sslmode=...`). The last
/// `sslmode` wins, as in libpq.
fn split_sslmode(conninfo: &str) -> Result<(SslMode, String), TlsSetupError> {
    let (raw, rest) =
        if conninfo.starts_with("postgres://") || conninfo.starts_with("postgresql://") {
            split_url(conninfo)
        } else {
            split_pairs(conninfo)
        };
    let mode = match raw.as_deref() {
        None | Some("prefer") => SslMode::Prefer,
        Some("disable" | "allow") => SslMode::Disable,
        Some("require") => SslMode::Require,
        Some("verify-ca") => SslMode::VerifyCa,
        Some("verify-full") => SslMode::VerifyFull,
        Some(other) => return Err(TlsSetupError::UnknownMode(other.to_owned())),
    };
    Ok((mode, rest))
}

fn split_url(url: &str) -> (Option<String>, String) {
    let Some((base, query)) = url.split_once('?') else {
        return (None, url.to_owned());
    };
    let mut mode = None;
    let mut kept = Vec::new();
    for pair in query.split('&') {
        match pair.split_once('=') {
            Some(("sslmode", v)) => mode = Some(v.to_owned()),
            _ => kept.push(pair),
        }
    }
    if kept.is_empty() {
        (mode, base.to_owned())
    } else {
        (mode, format!("{base}?{}", kept.join("&")))
    }
}

/// `key = value` pairs: the byte spans of each `sslmode` pair are cut out
/// and everything else is kept byte for byte.
fn split_pairs(s: &str) -> (Option<String>, String) {
    let b = s.as_bytes();
    let mut i = 0;
    let mut mode = None;
    let mut out = String::with_capacity(s.len());
    let mut kept_from = 0;
    while i < b.len() {
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        let start = i;
        while i < b.len() && b[i] != b'=' && !b[i].is_ascii_whitespace() {
            i += 1;
        }
        let key = &s[start..i];
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        if i >= b.len() || b[i] != b'=' {
            // Not a pair: leave it for tokio-postgres to refuse.
            break;
        }
        i += 1;
        while i < b.len() && b[i].is_ascii_whitespace() {
            i += 1;
        }
        let mut value = Vec::new();
        if i < b.len() && b[i] == b'\'' {
            i += 1;
            while i < b.len() && b[i] != b'\'' {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                value.push(b[i]);
                i += 1;
            }
            i = (i + 1).min(b.len());
        } else {
            while i < b.len() && !b[i].is_ascii_whitespace() {
                if b[i] == b'\\' && i + 1 < b.len() {
                    i += 1;
                }
                value.push(b[i]);
                i += 1;
            }
        }
        if key == "sslmode" {
            mode = Some(String::from_utf8_lossy(&value).into_owned());
            out.push_str(&s[kept_from..start]);
            kept_from = i;
        }
    }
    out.push_str(&s[kept_from..]);
    (mode, out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_conninfo_that_fails_to_parse_is_told_without_its_password() {
        for bad in [
            "host=db password=s3cret port=notaport",
            "host=db password=s3cret bogus_key=1",
            "host=db password='s3cret",
            "host=db password=s3cret trailing",
            "postgresql://sink:s3cret@db:notaport/fleet",
        ] {
            let e = PgConnect::new(bad, &TlsFiles::default())
                .err()
                .unwrap_or_default();
            assert!(!e.is_empty(), "{bad} parsed");
            assert!(!e.contains("s3cret"), "{bad}: {e}");
            assert!(e.contains("***") && e.contains("--postgres"), "{bad}: {e}");
        }
        let e = PgConnect::new("host=db port=x", &TlsFiles::default())
            .err()
            .unwrap_or_default();
        assert!(e.contains("host=db port=x") && e.contains("port"), "{e}");
    }

    fn split(s: &str) -> (SslMode, String) {
        match split_sslmode(s) {
            Ok(r) => r,
            Err(e) => panic!("{s}: {e}"),
        }
    }

    #[test]
    fn sslmode_is_taken_out_of_key_value_pairs() {
        let (m, rest) = split("host=db port=5432 sslmode=verify-full user=sink");
        assert_eq!(m, SslMode::VerifyFull);
        assert_eq!(rest, "host=db port=5432  user=sink");
        let (m, rest) = split("host=db sslmode = 'verify-ca'");
        assert_eq!(m, SslMode::VerifyCa);
        assert_eq!(rest.trim(), "host=db");
    }

    #[test]
    fn a_quoted_value_containing_sslmode_is_not_a_key() {
        let (m, rest) = split("password='a sslmode=require b' host=db");
        assert_eq!(m, SslMode::Prefer);
        assert_eq!(rest, "password='a sslmode=require b' host=db");
    }

    #[test]
    fn no_sslmode_is_prefer_and_prefer_is_plaintext() {
        assert_eq!(split("host=db").0, SslMode::Prefer);
        assert!(!SslMode::Prefer.wants_tls());
        assert_eq!(split("host=db sslmode=disable").0, SslMode::Disable);
    }

    #[test]
    fn sslmode_is_taken_out_of_a_url() {
        let (m, rest) = split("postgresql://u@db:5432/fleet?sslmode=verify-full&connect_timeout=3");
        assert_eq!(m, SslMode::VerifyFull);
        assert_eq!(rest, "postgresql://u@db:5432/fleet?connect_timeout=3");
        let (m, rest) = split("postgres://db/fleet?sslmode=require");
        assert_eq!(m, SslMode::Require);
        assert_eq!(rest, "postgres://db/fleet");
    }

    #[test]
    fn an_unknown_sslmode_is_named() {
        let e = split_sslmode("host=db sslmode=verify")
            .err()
            .map(|e| e.to_string());
        assert!(e.is_some_and(|e| e.contains("\"verify\"")));
    }

    #[test]
    fn verify_full_without_a_ca_is_refused_not_trusted() {
        let e = PgConnect::new("host=db sslmode=verify-full", &TlsFiles::default())
            .err()
            .unwrap_or_default();
        assert!(e.contains("needs --pg-ca"), "{e}");
        let e = PgConnect::new("host=db sslmode=require", &TlsFiles::default())
            .err()
            .unwrap_or_default();
        assert!(e.contains("sslmode=require needs --pg-ca"), "{e}");
    }

    #[test]
    fn a_ca_flag_without_tls_in_the_conninfo_is_refused() {
        let files = TlsFiles {
            ca: Some("/ca.pem".into()),
            ..TlsFiles::default()
        };
        let e = PgConnect::new("host=db", &files).err().unwrap_or_default();
        assert!(
            e.contains("--pg-ca is given but") && e.contains("sslmode=prefer"),
            "{e}"
        );
    }

    #[test]
    fn an_unreadable_ca_file_is_named() {
        let files = TlsFiles {
            ca: Some("/nonexistent/ca.pem".into()),
            ..TlsFiles::default()
        };
        let e = PgConnect::new("host=db sslmode=verify-full", &files)
            .err()
            .unwrap_or_default();
        assert!(
            e.contains("--pg-ca /nonexistent/ca.pem: cannot read"),
            "{e}"
        );
    }
}
