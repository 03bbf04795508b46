//! What a connection needs beyond the config ([`Setup`]): the TLS material
//! and the password read from their files, the incoming packet limit, the
//! will.
//!
//! Its one rule: the files are read anew for every connection, so a rotated
//! certificate or password applies at the next connect without a restart;
//! a file that cannot be read fails that attempt, naming the key and the
//! path, and the thread goes on to its backoff. The password file is read
//! only if it is a regular file named itself that group and others cannot
//! read.

use super::settings::MqttConfig;
use super::status::{offline_payload, status_topic};
use super::wire::Setup;

/// Read a secrets file for the connection; the error names the file and the key.
fn read_file(key: &str, path: &std::path::Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read mqtt.{key} {}: {e}", path.display()))
}

/// The password file's bytes, only from a regular file named itself that
/// group and others cannot read (a planted symlink is never followed).
fn read_password(path: &std::path::Path) -> Result<Vec<u8>, String> {
    crate::os::fsguard::files::read_secret(path)
        .map_err(|e| format!("mqtt.password_file {} refused: {e}", path.display()))
}

/// What a connection needs beyond the config: TLS material and the
/// password read from their files (so rotated files apply at the next
/// connect), the incoming limit, the will. `max_incoming` is the largest
/// packet remaining length taken: rumqttc drops the connection on a larger
/// one before reading it.
///
/// Errors: a file cannot be read; the message names the config key and path.
pub(super) fn setup(cfg: &MqttConfig, max_incoming: usize, clean: bool) -> Result<Setup, String> {
    let mut transport = None;
    if let Some(tls) = &cfg.tls {
        let ca = read_file("ca_file", &tls.ca_file)?;
        let client_auth = match &tls.client {
            Some((c, k)) => Some((
                read_file("client_cert_file", c)?,
                read_file("client_key_file", k)?,
            )),
            None => None,
        };
        transport = Some(rumqttc::Transport::tls_with_config(
            rumqttc::TlsConfiguration::Simple {
                ca,
                alpn: None,
                client_auth,
            },
        ));
    }
    let mut credentials = None;
    if let Some((user, pass_file)) = &cfg.credentials {
        let pass = match pass_file {
            Some(p) => String::from_utf8(read_password(p)?)
                .map_err(|_| format!("mqtt.password_file {} is not UTF-8", p.display()))?
                .trim_end_matches(['\n', '\r'])
                .to_owned(),
            None => String::new(),
        };
        credentials = Some((user.clone(), pass));
    }
    Ok(Setup {
        max_incoming,
        clean,
        will: cfg
            .status_topic
            .then(|| (status_topic(cfg), offline_payload())),
        credentials,
        transport,
    })
}
