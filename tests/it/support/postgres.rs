//! A real PostgreSQL server from Debian's packages, on a free loopback port,
//! in a temporary data directory, run as the unprivileged `postgres` user
//! when the tests run as root (initdb refuses root).

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use super::free_port;

pub struct Postgres {
    bin: PathBuf,
    dir: tempfile::TempDir,
    port: u16,
    as_postgres: bool,
}

/// The newest `/usr/lib/postgresql/<version>/bin` that has `initdb`.
fn bin_dir() -> PathBuf {
    let mut found: Vec<(u32, PathBuf)> = std::fs::read_dir("/usr/lib/postgresql")
        .expect("PostgreSQL is not installed (/usr/lib/postgresql): run cross/setup-debian.sh")
        .filter_map(|e| e.ok())
        .filter_map(|e| {
            let v = e.file_name().to_string_lossy().parse::<u32>().ok()?;
            let bin = e.path().join("bin");
            bin.join("initdb").is_file().then_some((v, bin))
        })
        .collect();
    found.sort();
    found
        .pop()
        .map(|(_, b)| b)
        .expect("no /usr/lib/postgresql/*/bin/initdb: run cross/setup-debian.sh")
}

impl Postgres {
    /// initdb (trust auth, superuser `postgres`) and start the server with
    /// `settings` (`-c` pairs); wait until it accepts connections.
    pub fn start(settings: &[(&str, &str)]) -> Postgres {
        let mut pg = Postgres::init();
        pg.launch(settings);
        pg
    }

    /// initdb only: files may be put in the data directory ([`Postgres::put`])
    /// before [`Postgres::launch`].
    pub fn init() -> Postgres {
        let bin = bin_dir();
        let dir = tempfile::Builder::new()
            .prefix("edgespool-pg-")
            .tempdir()
            .expect("temp dir for PostgreSQL");
        // SAFETY: geteuid has no preconditions.
        let as_postgres = unsafe { libc::geteuid() } == 0;
        if as_postgres {
            chown_to_postgres(dir.path());
        }
        let pg = Postgres {
            bin,
            dir,
            port: 0,
            as_postgres,
        };
        let data = pg.data();
        pg.run_tool(
            "initdb",
            &[
                "-D",
                &data,
                "-A",
                "trust",
                "-U",
                "postgres",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        );
        pg
    }

    /// Write `name` in the data directory, readable by the server's user
    /// only (PostgreSQL refuses a key file others can read).
    pub fn put(&self, name: &str, contents: &[u8]) {
        use std::os::unix::fs::PermissionsExt;
        let path = self.dir.path().join("data").join(name);
        std::fs::write(&path, contents).unwrap_or_else(|e| panic!("write {name}: {e}"));
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))
            .unwrap_or_else(|e| panic!("chmod {name}: {e}"));
        if self.as_postgres {
            chown_to_postgres(&path);
        }
    }

    /// Start the initialized server with `settings` (`-c` pairs); wait
    /// until it accepts connections.
    pub fn launch(&mut self, settings: &[(&str, &str)]) {
        let pg = self;
        let data = pg.data();
        let mut last = String::new();
        for _ in 0..3 {
            pg.port = free_port();
            let mut opts = format!(
                "-p {} -k {} -c listen_addresses=127.0.0.1",
                pg.port,
                pg.dir.path().display()
            );
            for (k, v) in settings {
                opts.push_str(&format!(" -c {k}={v}"));
            }
            let log = pg.dir.path().join("postgres.log");
            let ok = pg
                .tool("pg_ctl")
                .args(["-D", &data, "-w", "-t", "60", "-l"])
                .arg(&log)
                .args(["-o", &opts, "start"])
                .status();
            if matches!(ok, Ok(s) if s.success()) {
                return;
            }
            last = std::fs::read_to_string(&log).unwrap_or_default();
        }
        panic!("PostgreSQL did not start:\n{}", super::tail(&last, 30));
    }

    fn data(&self) -> String {
        self.dir.path().join("data").display().to_string()
    }

    /// A command running `tool` from the server's bin dir, as `postgres`
    /// when we are root.
    fn tool(&self, tool: &str) -> Command {
        let path = self.bin.join(tool);
        let mut c = if self.as_postgres {
            let mut c = Command::new("runuser");
            c.args(["-u", "postgres", "--"]).arg(path);
            c
        } else {
            Command::new(path)
        };
        c.stdin(Stdio::null()).stdout(Stdio::null());
        c
    }

    fn run_tool(&self, tool: &str, args: &[&str]) {
        let out = self
            .tool(tool)
            .args(args)
            .stderr(Stdio::piped())
            .output()
            .unwrap_or_else(|e| panic!("run {tool}: {e}"));
        assert!(
            out.status.success(),
            "{tool} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// libpq keyword/value connection string for the `postgres` database.
    pub fn conninfo(&self) -> String {
        format!(
            "host=127.0.0.1 port={} user=postgres dbname=postgres",
            self.port
        )
    }

    /// A new, empty database `name` (dropped first if it exists); its
    /// libpq connection string.
    pub fn database(&self, name: &str) -> String {
        let mut c = self.client();
        // One statement each: DROP/CREATE DATABASE cannot run in the
        // implicit transaction block of a multi-statement string.
        for sql in [
            format!("DROP DATABASE IF EXISTS {name}"),
            format!("CREATE DATABASE {name}"),
        ] {
            c.batch_execute(&sql)
                .unwrap_or_else(|e| panic!("{sql}: {e}"));
        }
        format!(
            "host=127.0.0.1 port={} user=postgres dbname={name}",
            self.port
        )
    }

    /// A new client connection over the Unix socket (which pg_hba.conf
    /// may allow when TCP needs TLS).
    pub fn socket_client(&self) -> postgres::Client {
        let conninfo = format!(
            "host={} port={} user=postgres dbname=postgres",
            self.dir.path().display(),
            self.port
        );
        postgres::Client::connect(&conninfo, postgres::NoTls)
            .unwrap_or_else(|e| panic!("connect to test PostgreSQL by socket: {e}"))
    }

    /// A new client connection.
    pub fn client(&self) -> postgres::Client {
        postgres::Client::connect(&self.conninfo(), postgres::NoTls)
            .unwrap_or_else(|e| panic!("connect to test PostgreSQL: {e}"))
    }

    /// The server log so far.
    pub fn log_text(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("postgres.log")).unwrap_or_default()
    }

    pub fn dir(&self) -> &Path {
        self.dir.path()
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        let data = self.data();
        let _ = self
            .tool("pg_ctl")
            .args(["-D", &data, "-m", "immediate", "-w", "stop"])
            .stderr(Stdio::null())
            .status();
    }
}

fn chown_to_postgres(dir: &Path) {
    let name = CString::new("postgres").expect("static name");
    // SAFETY: getpwnam with a valid C string; the result is read at once.
    let pw = unsafe { libc::getpwnam(name.as_ptr()) };
    assert!(
        !pw.is_null(),
        "no `postgres` user: install Debian's postgresql (cross/setup-debian.sh)"
    );
    // SAFETY: pw is non-null and points to a static passwd entry.
    let (uid, gid) = unsafe { ((*pw).pw_uid, (*pw).pw_gid) };
    let c = CString::new(dir.as_os_str().as_encoded_bytes()).expect("path without NUL");
    // SAFETY: chown(2) on a path we created.
    let rc = unsafe { libc::chown(c.as_ptr(), uid, gid) };
    assert_eq!(rc, 0, "chown {} to postgres", dir.display());
}
