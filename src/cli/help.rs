//! What the binary says about itself: `edgespool help [COMMAND]`,
//! `edgespool COMMAND --help`, and the usage told after a usage error. All
//! of it is rendered from the table in [`super::spec`].

use std::fmt::Write;

use super::spec::{self, Command, COMMANDS};
use super::{Failure, Outcome};

/// `edgespool help [COMMAND]`: the overview, or that command's help.
///
/// Errors: [`Failure::Usage`] for an unknown command or a second argument.
pub fn main(p: &mut lexopt::Parser) -> Outcome {
    use lexopt::prelude::*;
    let mut named: Option<&'static Command> = None;
    let bad = |msg: String| Failure::Usage { command: None, msg };
    while let Some(arg) = p.next().map_err(|e| bad(format!("help: {e}")))? {
        match arg {
            Long("help") | Short('h') => break,
            Value(v) if named.is_none() => {
                let name = v.to_string_lossy();
                named = Some(spec::command(&name).ok_or_else(|| {
                    bad(format!(
                        "help: unknown command {name:?} (commands: {})",
                        names()
                    ))
                })?);
            }
            Value(v) => {
                return Err(bad(format!(
                    "help: unexpected argument {:?}",
                    v.to_string_lossy()
                )))
            }
            Long(o) => return Err(bad(format!("help: unknown option --{o}"))),
            Short(c) => return Err(bad(format!("help: unknown option -{c}"))),
        }
    }
    match named {
        Some(cmd) => print(cmd),
        None => {
            print!("{}", overview());
            Ok(())
        }
    }
}

/// Prints `cmd`'s help on stdout.
pub fn print(cmd: &Command) -> Outcome {
    print!("{}", command_help(cmd));
    Ok(())
}

/// The commands' names, comma-separated, `help` last.
fn names() -> String {
    let mut out: Vec<&str> = COMMANDS.iter().map(|c| c.name).collect();
    out.push("help");
    out.join(", ")
}

/// `usage:` and the command's usage lines, indented.
pub fn usage_lines(cmd: &Command) -> String {
    let mut out = String::from("usage:\n");
    push_usage(&mut out, cmd);
    out
}

/// Each usage line after `  edgespool `; a line that starts with a blank
/// continues the one before, under it.
fn push_usage(out: &mut String, cmd: &Command) {
    for l in cmd.usage {
        let lead = if l.starts_with(' ') { "" } else { "edgespool " };
        let _ = writeln!(out, "  {lead:10}{l}");
    }
}

/// A command's help: what it does, its usage, its options, an example.
pub fn command_help(cmd: &Command) -> String {
    let mut out = format!("edgespool {}: {}\n\n", cmd.name, cmd.about);
    out.push_str(&usage_lines(cmd));
    out.push_str("\noptions:\n");
    let tags: Vec<String> = cmd.opts.iter().map(tag).collect();
    let width = tags.iter().map(String::len).max().unwrap_or(0).max(10);
    for (o, t) in cmd.opts.iter().zip(&tags) {
        let _ = writeln!(out, "  {t:width$}  {}", o.help);
    }
    let _ = writeln!(out, "  {:width$}  print this help", "-h, --help");
    let _ = write!(out, "\nexample:\n  edgespool {}\n", cmd.example);
    out
}

/// `-c, --config FILE` or `    --json`.
fn tag(o: &spec::Opt) -> String {
    let short = match o.short {
        Some(c) => format!("-{c}, "),
        None => "    ".to_owned(),
    };
    match o.value {
        Some(v) => format!("{short}--{} {v}", o.long),
        None => format!("{short}--{}", o.long),
    }
}

/// `edgespool help` and `edgespool --help`: every command's usage lines,
/// then each command in a line, the exit codes.
pub fn overview() -> String {
    let mut out = format!(
        "edgespool {}: store-and-forward agent (SQLite spool to MQTT)\n\nusage:\n",
        env!("CARGO_PKG_VERSION")
    );
    for cmd in COMMANDS {
        push_usage(&mut out, cmd);
    }
    out.push_str("  edgespool help [COMMAND]\n  edgespool -V | --version\n\ncommands:\n");
    for cmd in COMMANDS {
        let _ = writeln!(out, "  {:14} {}", cmd.name, cmd.about);
    }
    let _ = writeln!(out, "  {:14} {}", "help", spec::HELP_ABOUT);
    out.push_str(
        "\n`edgespool help COMMAND` (or `edgespool COMMAND --help`): its options and an example.\n\
         exit status: 0 ok; 1 runtime failure; 2 bad usage or bad config.\n",
    );
    out
}

/// Tells a usage error on stderr: `edgespool CMD: WHY`, the command's
/// usage lines, and where its help is.
pub fn tell_usage_error(command: Option<&Command>, msg: &str) {
    match command {
        Some(cmd) => eprint!(
            "edgespool {}: {msg}\n{}Run `edgespool help {}` for its options and an example.\n",
            cmd.name,
            usage_lines(cmd),
            cmd.name
        ),
        None => eprintln!("edgespool: {msg}\nRun `edgespool help` for the commands."),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_usage_line_names_only_the_commands_own_options_and_all_of_them() {
        for cmd in COMMANDS {
            let text = cmd.usage.join(" ");
            let named = super::super::docs_gen::long_options_in(&text);
            let own: std::collections::BTreeSet<String> =
                cmd.opts.iter().map(|o| o.long.to_owned()).collect();
            assert_eq!(named, own, "usage lines of {}", cmd.name);
        }
    }

    #[test]
    fn a_commands_help_lists_each_option_once_with_its_value_and_an_example() {
        let h = command_help(&spec::SINK);
        for o in spec::SINK.opts {
            let t = tag(o);
            assert_eq!(h.matches(&format!("{t} ")).count(), 1, "{t} in\n{h}");
        }
        assert!(h.contains("-c, --config FILE"), "{h}");
        assert!(h.contains("--pg-password-file FILE"), "{h}");
        assert!(h.contains("\nexample:\n  edgespool sink --config "), "{h}");
        assert!(h.contains("-h, --help"), "{h}");
    }

    #[test]
    fn a_continued_usage_line_sits_under_the_one_before() {
        let u = usage_lines(&spec::SINK);
        assert!(u.contains("\n                 [--client-id ID]"), "{u}");
        assert_eq!(u.matches("edgespool sink ").count(), 3, "{u}");
    }

    #[test]
    fn the_overview_names_every_command() {
        let o = overview();
        for cmd in COMMANDS {
            assert!(o.contains(&format!("\n  {} ", cmd.name)), "{}", cmd.name);
            assert!(o.contains(&format!("  edgespool {}", cmd.usage[0])));
        }
    }
}
