//! The `edgespool` command: reads the subcommand's name, hands the rest of
//! the line to that subcommand (one module each, under `cli/`), and turns
//! what it returns into an exit code (the codes: [`cli`]).

use edgespool::cli;

use std::process::ExitCode;

use cli::{Failure, First};

fn main() -> ExitCode {
    init_logging();
    let mut line = lexopt::Parser::from_env();
    let result = match cli::first_word(&mut line) {
        Ok(First::Command(name)) => match name.as_str() {
            "run" => cli::run::main(&mut line),
            "check-config" => cli::check_config::main(&mut line),
            "test" => cli::test::main(&mut line),
            "status" => cli::status::main(&mut line),
            "probe-storage" => cli::probe_storage::main(&mut line),
            "export" => cli::export::main(&mut line),
            #[cfg(feature = "sink")]
            "sink" => cli::sink::main(&mut line),
            #[cfg(not(feature = "sink"))]
            "sink" => {
                eprintln!("edgespool sink: not in this build (the armv7 and armv6 packages carry the agent only; the amd64 and arm64 ones carry the sink)");
                Err(Failure::Invalid)
            }
            "keygen" => cli::keygen::main(&mut line),
            "help" => cli::help::main(&mut line),
            other => cli::unknown(other),
        },
        Ok(First::Help) => {
            print!("{}", cli::help::overview());
            Ok(())
        }
        Ok(First::Version) => cli::print_version(),
        Err(f) => Err(f),
    };
    ExitCode::from(match result {
        Ok(()) => cli::EXIT_OK,
        Err(f) => {
            if let Failure::Usage { command, msg } = &f {
                cli::help::tell_usage_error(*command, msg);
            }
            f.exit_code()
        }
    })
}

/// Log to stderr through env_logger (`RUST_LOG`, default `info`). Under
/// systemd (`JOURNAL_STREAM` set: stderr is the journal) each line starts
/// with its syslog priority, `<3>` error to `<7>` debug (sd-daemon(3)), and
/// carries no timestamp of its own: the journal stamps every line.
fn init_logging() {
    use std::io::Write;
    let mut b = env_logger::Builder::from_env(env_logger::Env::default().default_filter_or("info"));
    if std::env::var_os("JOURNAL_STREAM").is_some() {
        b.format(|buf, record| {
            let prio = match record.level() {
                log::Level::Error => 3,
                log::Level::Warn => 4,
                log::Level::Info => 6,
                log::Level::Debug | log::Level::Trace => 7,
            };
            writeln!(buf, "<{prio}>{}: {}", record.target(), record.args())
        });
    }
    b.init();
}
