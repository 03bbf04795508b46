//! A test board: its own temp dir, a topic prefix no other test uses, the
//! board config the agent runs with there, and where its spool lives. The
//! one rule: each test's board is its own (dir and prefix), so tests that
//! run side by side never read each other's files or messages.

use std::path::{Path, PathBuf};

use super::unique_suffix;

/// A broker URL nothing answers at (port 9, discard): for tests where
/// delivery does not matter and every row stays PENDING. The port is not
/// held: a test that must never see an answer binds a port of its own.
pub const NO_BROKER: &str = "mqtt://127.0.0.1:9";

/// A unique topic prefix per test, so tests sharing nothing still never
/// read each other's messages.
pub fn prefix(test: &str) -> String {
    format!("it/{test}/{}", unique_suffix())
}

/// Write a test board config into `dir`: a fast `system` source (every
/// `interval_ms`), short commit window, fast reconnects, a short watchdog.
pub fn write_config(dir: &Path, url: &str, prefix: &str, interval_ms: u64) -> PathBuf {
    write_board(
        dir,
        url,
        prefix,
        &format!(
            "[[sources]]\nname = \"system\"\nkind = \"system\"\ninterval_ms = {interval_ms}\n"
        ),
    )
}

/// [`write_config`] with `sources` (its `[[sources]]` tables) instead of
/// the `system` source.
pub fn write_board(dir: &Path, url: &str, prefix: &str, sources: &str) -> PathBuf {
    let path = dir.join("board.toml");
    let text = format!(
        r#"device_id = "it-board"
[spool]
path = "{spool}"
commit_window_ms = 50
checkpoint_interval_secs = 1
[mqtt]
url = "{url}"
topic_prefix = "{prefix}"
reconnect_min_ms = 100
reconnect_max_ms = 800
connect_timeout_secs = 2
ack_timeout_secs = 3
inflight_window = 16
[agent]
summary_interval_secs = 2
{sources}"#,
        spool = dir.join("spool.db").display()
    );
    std::fs::write(&path, text).expect("write test config");
    path
}

/// Pin `mqtt.protocol` to 3.1.1 in a config [`write_config`] wrote (the
/// default is MQTT 5): for brokers that do not speak 5 (aedes 1.2) and for
/// tests of what 3.1.1 does.
pub fn v311(cfg: PathBuf) -> PathBuf {
    edit_config(&cfg, |text| {
        text.replacen("[mqtt]\n", "[mqtt]\nprotocol = \"3.1.1\"\n", 1)
    });
    cfg
}

/// Rewrite the config file `cfg` through `f` (the text in, the new text out).
pub fn edit_config(cfg: &Path, f: impl FnOnce(String) -> String) {
    let text = std::fs::read_to_string(cfg)
        .unwrap_or_else(|e| panic!("read test config {}: {e}", cfg.display()));
    std::fs::write(cfg, f(text))
        .unwrap_or_else(|e| panic!("write test config {}: {e}", cfg.display()));
}

/// Append `more` (whole TOML lines: a key of the last table, or tables of
/// their own) to the config file `cfg`.
pub fn append_config(cfg: &Path, more: &str) {
    edit_config(cfg, |text| text + more);
}

/// Append an `[ingest]` table to the config file `cfg`: its socket at
/// `run/ingest.sock` beside `cfg`, then `more` (more keys of the table,
/// then its `[[ingest.streams]]`). Returns the socket's path.
pub fn add_ingest(cfg: &Path, more: &str) -> PathBuf {
    let sock = cfg
        .parent()
        .expect("a config file in a directory")
        .join("run/ingest.sock");
    append_config(
        cfg,
        &format!("[ingest]\nsocket = \"{}\"\n{more}", sock.display()),
    );
    sock
}

/// One test's board, as [`write_config`] writes it. Its fields are meant
/// to be taken apart (`let Board { dir, cfg, db } = ...`): the temp dir
/// lives as long as the binding `dir`.
pub struct Board {
    /// The board's directory (its config, spool, agent logs).
    pub dir: tempfile::TempDir,
    /// `<dir>/board.toml`.
    pub cfg: PathBuf,
    /// `<dir>/spool.db`, which the agent creates.
    pub db: PathBuf,
}

impl Board {
    /// A new temp dir with the board config of [`write_config`]: the
    /// broker at `url`, topics under `prefix` (see [`prefix`]), a `system`
    /// reading every `interval_ms`.
    pub fn new(url: &str, prefix: &str, interval_ms: u64) -> Board {
        let dir = tempfile::tempdir().expect("tempdir");
        let cfg = write_config(dir.path(), url, prefix, interval_ms);
        let db = dir.path().join("spool.db");
        Board { dir, cfg, db }
    }

    /// The same board speaking MQTT 3.1.1 ([`v311`]).
    pub fn v311(self) -> Board {
        let cfg = v311(self.cfg);
        Board { cfg, ..self }
    }
}
