//! The one table of the binary's commands: each one's name, what it does,
//! its usage lines, its options and an example. The parser
//! ([`super::args`]) takes only the options a command lists here, the help
//! ([`super::help`]) prints them, and the man page's SYNOPSIS and OPTIONS
//! (`packaging/edgespool.1`) and the bash, zsh and fish completions
//! (`packaging/edgespool.bash`, `_edgespool`, `edgespool.fish`) are
//! generated from it by a test that fails when a committed file differs
//! (`EDGESPOOL_BLESS=1` rewrites them), so none of them can drift.

/// What an option sets; [`super::args::Args::apply`] matches every variant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flag {
    Config,
    Set,
    CheckSpool,
    Sample,
    Spool,
    Json,
    Dir,
    Url,
    Topic,
    Db,
    Postgres,
    PgPasswordFile,
    PgCa,
    PgCert,
    PgKey,
    ClientId,
    Share,
    BatchMax,
    BatchMs,
    NoReceipts,
    Username,
    PasswordFile,
    Stats,
    To,
    Out,
    ReceiptKey,
}

/// One option of one command.
#[derive(Debug)]
pub struct Opt {
    /// What it sets.
    pub flag: Flag,
    /// The long name, without `--`.
    pub long: &'static str,
    /// The one-letter name, if it has one.
    pub short: Option<char>,
    /// The name of its value (`FILE`), or `None` for a switch.
    pub value: Option<&'static str>,
    /// One line of help.
    pub help: &'static str,
    /// The man page's longer description, when it says more than `help`:
    /// sentences, with `code` set in bold and *NAME* in italics.
    pub man: Option<&'static str>,
}

impl Opt {
    /// This option with the man page's longer description `text`.
    const fn man(mut self, text: &'static str) -> Opt {
        self.man = Some(text);
        self
    }
}

/// One command.
#[derive(Debug)]
pub struct Command {
    /// Its name on the command line.
    pub name: &'static str,
    /// What it does, in one line.
    pub about: &'static str,
    /// Its usage lines, each after `edgespool `.
    pub usage: &'static [&'static str],
    /// A bare argument it takes instead of `--config` (`FILE`), if any.
    pub operand: Option<&'static str>,
    /// Its options (`-h`/`--help` is every command's and not listed).
    pub opts: &'static [Opt],
    /// One example line, after `edgespool `.
    pub example: &'static str,
}

impl Command {
    /// The option named `--long`.
    pub fn long(&self, long: &str) -> Option<&'static Opt> {
        self.opts.iter().find(|o| o.long == long)
    }

    /// The option named `-c`.
    pub fn short(&self, c: char) -> Option<&'static Opt> {
        self.opts.iter().find(|o| o.short == Some(c))
    }
}

/// The command named `name`.
pub fn command(name: &str) -> Option<&'static Command> {
    COMMANDS.iter().copied().find(|c| c.name == name)
}

const fn opt(
    flag: Flag,
    long: &'static str,
    value: Option<&'static str>,
    help: &'static str,
) -> Opt {
    Opt {
        flag,
        long,
        short: None,
        value,
        help,
        man: None,
    }
}

const CONFIG_BOARD: Opt = Opt {
    flag: Flag::Config,
    long: "config",
    short: Some('c'),
    value: Some("FILE"),
    help: "the board config (TOML)",
    man: None,
};
const CONFIG_SPOOL: Opt = Opt {
    help: "the board config; its spool.path names the spool",
    ..CONFIG_BOARD
};
const SET: Opt = opt(
    Flag::Set,
    "set",
    Some("KEY=VALUE"),
    "override one config key (repeatable), e.g. mqtt.url=mqtt://10.0.0.5:1883",
)
.man(
    "Override one config key without editing the file (repeatable), e.g. \
     `mqtt.url=mqtt://10.0.0.5:1883`, `sources.0.interval_ms=500`. The value is read as \
     TOML, or as a plain string if it is not valid TOML.",
);
const SPOOL: Opt = opt(
    Flag::Spool,
    "spool",
    Some("PATH"),
    "the spool file (wins over --config)",
);
const JSON: Opt = opt(Flag::Json, "json", None, "print JSON instead of text");

/// Every command, in the order the overview lists them.
pub static COMMANDS: [&Command; 8] = [
    &RUN,
    &CHECK_CONFIG,
    &TEST,
    &STATUS,
    &PROBE_STORAGE,
    &EXPORT,
    &SINK,
    &KEYGEN,
];

/// `edgespool run`.
pub static RUN: Command = Command {
    name: "run",
    about: "take readings, spool them and publish them until SIGTERM or SIGINT",
    usage: &["run --config FILE [--set KEY=VALUE]... [--check-spool]"],
    operand: None,
    opts: &[
        CONFIG_BOARD,
        SET,
        opt(
            Flag::CheckSpool,
            "check-spool",
            None,
            "run the whole-file integrity check beside delivery",
        ),
    ],
    example: "run --config /etc/edgespool/edgespool.toml",
};

/// `edgespool check-config`.
pub static CHECK_CONFIG: Command = Command {
    name: "check-config",
    about: "validate a board config and the replay files it names; nothing is written",
    usage: &["check-config (FILE | --config FILE) [--set KEY=VALUE]... [--sample]"],
    operand: Some("FILE"),
    opts: &[
        CONFIG_BOARD,
        SET,
        opt(
            Flag::Sample,
            "sample",
            None,
            "then take one reading per source, as `test` does",
        ),
    ],
    example: "check-config /etc/edgespool/edgespool.toml",
};

/// `edgespool test`.
pub static TEST: Command = Command {
    name: "test",
    about:
        "one reading from every source as it would be sent, listener binds checked; nothing written",
    usage: &["test (--config FILE | FILE) [--set KEY=VALUE]..."],
    operand: Some("FILE"),
    opts: &[CONFIG_BOARD, SET],
    example: "test --config /etc/edgespool/edgespool.toml",
};

/// `edgespool status`.
pub static STATUS: Command = Command {
    name: "status",
    about: "the spool's health, rows by state and stream, sizes and counters (read-only)",
    usage: &["status (--config FILE | --spool PATH) [--json]"],
    operand: None,
    opts: &[CONFIG_SPOOL, SPOOL, JSON],
    example: "status --spool /var/lib/edgespool/spool.db",
};

/// `edgespool export`.
pub static EXPORT: Command = Command {
    name: "export",
    about: "write a consistent copy of the live spool to a new file (a backup, a move)",
    usage: &["export (--config FILE | --spool PATH) --to PATH"],
    operand: None,
    opts: &[
        CONFIG_SPOOL,
        SPOOL,
        opt(
            Flag::To,
            "to",
            Some("PATH"),
            "the copy: a new file (an existing one is refused)",
        ),
    ],
    example: "export --config /etc/edgespool/edgespool.toml --to /media/usb/spool-backup.db",
};

/// `edgespool probe-storage`.
pub static PROBE_STORAGE: Command = Command {
    name: "probe-storage",
    about: "measure the spool directory's fsync latency and write rate, store the derived knobs",
    usage: &["probe-storage (--config FILE | --dir DIR) [--json]"],
    operand: None,
    opts: &[
        CONFIG_SPOOL.man("The board config; the directory of its `spool.path` is measured."),
        opt(
            Flag::Dir,
            "dir",
            Some("DIR"),
            "the directory to measure (wins over --config)",
        ),
        JSON,
    ],
    example: "probe-storage --dir /var/lib/edgespool",
};

/// `edgespool sink`.
pub static SINK: Command = Command {
        name: "sink",
        about: "the reference consumer: store each event once (SQLite or PostgreSQL), acknowledge after commit",
        usage: &[
            "sink --config FILE [OPTIONS]",
            "sink --url mqtt://HOST:PORT --topic FILTER (--db FILE | --postgres CONNINFO)",
            "     [--client-id ID] [--share GROUP] [--batch-max N] [--batch-ms MS]",
            "     [--receipt-key FILE | --no-receipts]",
            "     [--username USER --password-file FILE] [--pg-password-file FILE]",
            "     [--pg-ca FILE] [--pg-cert FILE --pg-key FILE]",
            "sink --stats (--config FILE | --db FILE | --postgres CONNINFO) [--json]",
        ],
        operand: None,
        opts: &[
            Opt {
                help: "the sink's settings, a [sink] section; options given here override it",
                ..CONFIG_BOARD
            }
            .man(
                "The sink's settings: a `[sink]` section with the options below by the same \
                 names (`url`, `topic`, `client_id`, `share`, `batch_max`, `batch_ms`, \
                 `receipts`, `receipt_key`, `username`, `password_file`, `db`) and a \
                 `[sink.postgres]` table \
                 (`conninfo`, `password_file`, `ca`, `cert`, `key`). An option given on the \
                 command line overrides the file's key.",
            ),
            opt(Flag::Url, "url", Some("mqtt://HOST:PORT"), "the broker"),
            opt(Flag::Topic, "topic", Some("FILTER"), "the events filter, e.g. edgespool/+/events/#"),
            opt(Flag::Db, "db", Some("FILE"), "store in this SQLite file"),
            opt(Flag::Postgres, "postgres", Some("CONNINFO"), "store in PostgreSQL (libpq keywords or URL; no password here)")
                .man("Store in PostgreSQL (libpq keyword/value or URL form). Put no password here: \
                      the command line is readable by every local user."),
            opt(
                Flag::PgPasswordFile,
                "pg-password-file",
                Some("FILE"),
                "the PostgreSQL password (mode 0600 or stricter)",
            )
            .man(
                "The PostgreSQL password (one trailing newline dropped). Refused unless only its \
                 owner can read it (mode 0600 or stricter). Without it (and without a password \
                 in the conninfo) `PGPASSWORD` and then the file `PGPASSFILE` names are read, \
                 as libpq does.",
            ),
            opt(Flag::PgCa, "pg-ca", Some("FILE"), "PEM CA bundle a PostgreSQL server certificate must lead to")
                .man("PEM CA bundle the PostgreSQL server's certificate must lead to (for \
                      `sslmode=require`, `verify-ca`, `verify-full`)."),
            opt(Flag::PgCert, "pg-cert", Some("FILE"), "PEM client certificate for PostgreSQL (with --pg-key)"),
            opt(Flag::PgKey, "pg-key", Some("FILE"), "PEM private key of --pg-cert"),
            opt(Flag::ClientId, "client-id", Some("ID"), "MQTT client id (stable per sink; needed with PostgreSQL)")
                .man("MQTT client id: the broker keeps the sink's session under it. Stable per \
                      sink; required with PostgreSQL."),
            opt(Flag::Share, "share", Some("GROUP"), "subscribe as $share/GROUP/FILTER")
                .man("Subscribe as `$share/`*GROUP*`/`*FILTER* to spread the load over several sinks."),
            opt(Flag::BatchMax, "batch-max", Some("N"), "deliveries per transaction (default 500)"),
            opt(Flag::BatchMs, "batch-ms", Some("MS"), "longest wait before a batch commits (default 100)"),
            opt(Flag::ReceiptKey, "receipt-key", Some("FILE"), "sign receipts with this Ed25519 key (edgespool keygen; mode 0600)")
                .man("Sign every receipt with this Ed25519 private key (PEM, PKCS#8, as \
                      `edgespool keygen` writes it; refused unless only its owner can read it). A \
                      board retires a row on a receipt only when a key its \
                      `mqtt.receipt_public_keys` lists signed it, for that board, naming the \
                      event's id and the digest of its bytes. Without a key the sink publishes no \
                      receipts."),
            opt(Flag::NoReceipts, "no-receipts", None, "publish no receipts"),
            opt(Flag::Username, "username", Some("USER"), "MQTT user name (with --password-file)"),
            opt(Flag::PasswordFile, "password-file", Some("FILE"), "the MQTT password (mode 0600 or stricter)")
                .man("The MQTT password (one trailing newline dropped; read at every connect). \
                      Refused unless only its owner can read it (mode 0600 or stricter)."),
            opt(Flag::Stats, "stats", None, "print the store's report and exit"),
            JSON.man("With `--stats`: JSON instead of text."),
        ],
        example: "sink --config /etc/edgespool/sink-fleet.toml",
};

/// `edgespool keygen`.
pub static KEYGEN: Command = Command {
    name: "keygen",
    about: "write a new Ed25519 private key (mode 0600) and print its public key",
    usage: &["keygen --out FILE"],
    operand: None,
    opts: &[opt(
        Flag::Out,
        "out",
        Some("FILE"),
        "the new private key (PEM, PKCS#8); FILE.pub gets the public key",
    )],
    example: "keygen --out /etc/edgespool/receipt.key",
};

/// `help` itself: not in [`COMMANDS`] (it has no options), but listed.
pub const HELP_ABOUT: &str = "print a command's usage, options and an example";

/// `-h`, `--help`: every command's, and the first word's.
pub const HELP_OPTION: &str = "print the command's usage, options and an example";

/// `-V`, `--version`: the first word only.
pub const VERSION_ABOUT: &str = "print the version";
