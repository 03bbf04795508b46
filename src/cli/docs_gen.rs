//! The man page's SYNOPSIS and OPTIONS (`packaging/edgespool.1`, between
//! its `GENERATED` comment markers) and the bash, zsh and fish completions
//! (`packaging/edgespool.bash`, `packaging/_edgespool`,
//! `packaging/edgespool.fish`), rendered from the table of commands
//! ([`super::spec`]).
//!
//! Its one rule: **nothing here is written by hand twice**: a test renders
//! every file again and fails, naming the file, when the committed one
//! differs; `EDGESPOOL_BLESS=1 cargo test --lib docs_gen` rewrites them.
//! The man page's prose (DESCRIPTION, COMMANDS, EXIT STATUS, ENVIRONMENT,
//! FILES, EXAMPLES) stays hand-written outside the markers.

use std::collections::BTreeSet;
use std::fmt::Write;

use super::spec::{Command, Flag, Opt, COMMANDS, HELP_ABOUT, HELP_OPTION, VERSION_ABOUT};

/// How to regenerate, said in every generated file.
const BLESS: &str = "EDGESPOOL_BLESS=1 cargo test --lib docs_gen";

/// What the value of an option is, for the shells: a file, a directory, or
/// anything (no completion).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ValueKind {
    File,
    Dir,
    Other,
}

/// The kind of the value named `name` (`FILE`, `PATH`: a file; `DIR`).
fn value_kind(name: &str) -> ValueKind {
    match name {
        "FILE" | "PATH" => ValueKind::File,
        "DIR" => ValueKind::Dir,
        _ => ValueKind::Other,
    }
}

/// Every option of every command, once per long name, with its value
/// kind. Panics when two commands give one long name different value
/// kinds (the bash completion completes a value by the option alone).
fn valued_options() -> Vec<(&'static Opt, ValueKind)> {
    let mut out: Vec<(&'static Opt, ValueKind)> = Vec::new();
    for o in COMMANDS.iter().flat_map(|c| c.opts.iter()) {
        let Some(v) = o.value else { continue };
        let kind = value_kind(v);
        match out.iter().find(|(seen, _)| seen.long == o.long) {
            Some((_, k)) => assert_eq!(*k, kind, "--{} takes two kinds of value", o.long),
            None => out.push((o, kind)),
        }
    }
    out
}

// ---------------------------------------------------------------- roff

/// `text` escaped for roff: backslashes, and hyphens as `\-` (options and
/// paths copy as typed); a line's leading `.` or `'` is [`push_roff_line`]'s.
fn roff_escape(text: &str) -> String {
    text.replace('\\', "\\e").replace('-', "\\-")
}

/// The man page's markup of `text`: `code` in bold, *NAME* in italics,
/// everything escaped ([`roff_escape`]).
fn roff_inline(text: &str) -> String {
    let mut out = String::new();
    let mut font: Option<char> = None;
    let mut plain = String::new();
    for c in text.chars() {
        let mark = match c {
            '`' => Some('B'),
            '*' => Some('I'),
            _ => None,
        };
        match (mark, font) {
            (Some(m), None) => {
                out.push_str(&roff_escape(&plain));
                plain.clear();
                out.push_str(&format!("\\f{m}"));
                font = Some(m);
            }
            (Some(m), Some(f)) if m == f => {
                out.push_str(&roff_escape(&plain));
                plain.clear();
                out.push_str("\\fR");
                font = None;
            }
            _ => plain.push(c),
        }
    }
    assert!(font.is_none(), "unclosed markup in {text:?}");
    out.push_str(&roff_escape(&plain));
    out
}

/// `text` as roff lines of at most about 78 columns, split between words;
/// a line that would start with `.` or `'` starts with `\&`.
fn roff_wrap(text: &str) -> String {
    let mut out = String::new();
    let mut line = String::new();
    for word in text.split(' ').filter(|w| !w.is_empty()) {
        if !line.is_empty() && line.len() + 1 + word.len() > 78 {
            push_roff_line(&mut out, &line);
            line.clear();
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() {
        push_roff_line(&mut out, &line);
    }
    out
}

fn push_roff_line(out: &mut String, line: &str) {
    if line.starts_with(['.', '\'']) {
        out.push_str("\\&");
    }
    out.push_str(line);
    out.push('\n');
}

/// One usage line in roff fonts: `--options` and literal words in bold,
/// placeholders (`FILE`, `HOST`) in italics, brackets and bars as they are.
fn roff_usage(line: &str) -> String {
    let mut out = String::new();
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        if !word.is_empty() {
            out.push_str(&roff_word(word));
            word.clear();
        }
    };
    for c in line.chars() {
        match c {
            '(' | ')' | '[' | ']' | '|' | ' ' => {
                flush(&mut word, &mut out);
                out.push(c);
            }
            '.' if word.is_empty() || word.ends_with('.') => {
                // `...` after a group: repeatable, in the roman font.
                if word.is_empty() {
                    out.push('.');
                } else {
                    word.push('.');
                }
            }
            c => word.push(c),
        }
    }
    flush(&mut word, &mut out);
    out
}

/// A word of a usage line: an option (`-V`, `--config`) in bold; else runs
/// of capitals (with `=` and `_` inside them) are placeholders in italics,
/// the rest is literal in bold.
fn roff_word(word: &str) -> String {
    if word.starts_with('-') {
        return format!("\\fB{}\\fR", roff_escape(word));
    }
    let mut out = String::new();
    let chars: Vec<char> = word.chars().collect();
    let mut i = 0;
    while i < chars.len() {
        let placeholder = chars[i].is_ascii_uppercase();
        let start = i;
        while i < chars.len() {
            let c = chars[i];
            let in_placeholder = c.is_ascii_uppercase()
                || c.is_ascii_digit()
                || (matches!(c, '=' | '_')
                    && chars.get(i + 1).is_some_and(|n| n.is_ascii_uppercase()));
            if in_placeholder != placeholder {
                break;
            }
            i += 1;
        }
        let part: String = chars[start..i].iter().collect();
        let font = if placeholder { 'I' } else { 'B' };
        out.push_str(&format!("\\f{font}{}\\fR", roff_escape(&part)));
    }
    out
}

/// The man page's SYNOPSIS: each command's usage lines (a continued line
/// joins the one before), then `help`, `COMMAND --help` and `--version`.
fn man_synopsis() -> String {
    let mut out = String::from(".SH SYNOPSIS\n");
    let mut entries: Vec<String> = Vec::new();
    for cmd in COMMANDS {
        for l in cmd.usage {
            match (l.starts_with(' '), entries.last_mut()) {
                (true, Some(last)) => {
                    last.push(' ');
                    last.push_str(l.trim());
                }
                _ => entries.push(format!("edgespool {l}")),
            }
        }
    }
    entries.push("edgespool help [COMMAND]".to_owned());
    entries.push("edgespool COMMAND (-h | --help)".to_owned());
    entries.push("edgespool (-V | --version)".to_owned());
    for (i, e) in entries.iter().enumerate() {
        if i > 0 {
            out.push_str(".br\n");
        }
        push_roff_line(&mut out, &roff_usage(e));
    }
    out
}

/// An option's tag for `.TP`: `-c, --config FILE` in its fonts.
fn roff_tag(o: &Opt) -> String {
    let short = o
        .short
        .map_or(String::new(), |c| format!("\\fB\\-{c}\\fR, "));
    let value = o
        .value
        .map_or(String::new(), |v| format!(" {}", roff_word(v)));
    format!(
        "{short}\\fB{}\\fR{value}",
        roff_escape(&format!("--{}", o.long))
    )
}

/// An option's description for the man page: its longer text, else its
/// help as a sentence; the bare operand a command takes instead of
/// `--config` is said under `--config`.
fn man_text(cmd: &Command, o: &Opt) -> String {
    let mut text = match o.man {
        Some(m) => m.to_owned(),
        None => {
            let mut s = o.help.to_owned();
            if let Some(first) = s.get(0..1) {
                s.replace_range(0..1, &first.to_uppercase());
            }
            s.push('.');
            s
        }
    };
    if let (Some(operand), Flag::Config) = (cmd.operand, o.flag) {
        text.push_str(&format!(
            " It may be given as the bare *{operand}* instead."
        ));
    }
    text
}

/// The man page's OPTIONS: each command's options under its own heading,
/// then the options of every command.
fn man_options() -> String {
    let mut out = String::from(".SH OPTIONS\n");
    out.push_str(&roff_wrap(&roff_inline(
        "Each command takes only its own options; any other is a usage error (exit 2) \
         naming the option and the command. Every command takes `-h`, `--help` (its usage, \
         options and an example, as `edgespool help` *COMMAND*).",
    )));
    for cmd in COMMANDS {
        let _ = writeln!(out, ".SS {}", roff_escape(cmd.name));
        for o in cmd.opts {
            let _ = writeln!(out, ".TP\n{}", roff_tag(o));
            out.push_str(&roff_wrap(&roff_inline(&man_text(cmd, o))));
        }
    }
    out.push_str(".SS Every command\n.TP\n\\fB\\-h\\fR, \\fB\\-\\-help\\fR\n");
    out.push_str(&roff_wrap(&roff_inline(&sentence(HELP_OPTION))));
    out.push_str(".TP\n\\fB\\-V\\fR, \\fB\\-\\-version\\fR\n");
    out.push_str(&roff_wrap(&roff_inline(&format!(
        "{} Only as the first word: `edgespool -V`, `edgespool --version`.",
        sentence(VERSION_ABOUT)
    ))));
    out
}

/// `help` text as a sentence: a capital first, a full stop last.
fn sentence(help: &str) -> String {
    let mut s = help.to_owned();
    if let Some(first) = s.get(0..1) {
        s.replace_range(0..1, &first.to_uppercase());
    }
    s.push('.');
    s
}

/// `man` with its GENERATED regions (SYNOPSIS, OPTIONS) rendered again.
/// Panics when a marker is missing.
fn man_page(man: &str) -> String {
    let man = splice(man, "SYNOPSIS", &man_synopsis());
    splice(&man, "OPTIONS", &man_options())
}

/// `text` with what lies between its `BEGIN GENERATED NAME` and `END
/// GENERATED NAME` comment lines replaced by `generated`.
fn splice(text: &str, name: &str, generated: &str) -> String {
    let begin = format!(".\\\" BEGIN GENERATED {name}");
    let end = format!(".\\\" END GENERATED {name}\n");
    let b = text
        .find(&begin)
        .unwrap_or_else(|| panic!("edgespool.1 has no {begin:?} line"));
    let body = b + text[b..].find('\n').map_or(text.len() - b, |n| n + 1);
    let e = text[body..]
        .find(&end)
        .map(|n| body + n)
        .unwrap_or_else(|| panic!("edgespool.1 has no {end:?} line"));
    let head = format!(".\\\" BEGIN GENERATED {name} from src/cli/spec.rs: {BLESS} rewrites it\n");
    format!("{}{head}{generated}{}", &text[..b], &text[e..])
}

// ---------------------------------------------------------------- shells

/// The commands' names, space-separated.
fn names() -> String {
    COMMANDS
        .iter()
        .map(|c| c.name)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The bash completion.
fn bash() -> String {
    let valued = valued_options();
    let of_kind = |kind: ValueKind| {
        let mut words = Vec::new();
        for (o, k) in &valued {
            if *k == kind {
                words.push(format!("--{}", o.long));
                if let Some(c) = o.short {
                    words.push(format!("-{c}"));
                }
            }
        }
        words.join("|")
    };
    let mut out = format!(
        "# bash completion for edgespool(1), generated from the table of commands\n\
         # (src/cli/spec.rs, what `edgespool help COMMAND` prints): do not edit;\n\
         # `{BLESS}` rewrites it.\n\
         _edgespool() {{\n    local cur prev words cword\n    _init_completion || return\n    \
         local cmds=\"{} help --version --help\"\n",
        names()
    );
    out.push_str(
        "    if [ \"$cword\" -eq 1 ]; then\n        COMPREPLY=($(compgen -W \"$cmds\" -- \"$cur\"))\n        return\n    fi\n\
         \x20   # Options that take a value: complete the value, not an option.\n    case \"$prev\" in\n",
    );
    let _ = write!(
        out,
        "        {})\n            _filedir\n            return ;;\n",
        of_kind(ValueKind::File)
    );
    let _ = write!(
        out,
        "        {})\n            _filedir -d\n            return ;;\n",
        of_kind(ValueKind::Dir)
    );
    let _ = write!(
        out,
        "        {})\n            return ;;\n    esac\n    local opts=\"\"\n    case \"${{words[1]}}\" in\n",
        of_kind(ValueKind::Other)
    );
    for cmd in COMMANDS {
        let opts: Vec<String> = cmd.opts.iter().map(|o| format!("--{}", o.long)).collect();
        let _ = writeln!(
            out,
            "        {}) opts=\"{} --help\" ;;",
            cmd.name,
            opts.join(" ")
        );
    }
    let _ = write!(
        out,
        "        help)\n            [ \"$cword\" -eq 2 ] && COMPREPLY=($(compgen -W \"{}\" -- \"$cur\"))\n            return ;;\n    esac\n",
        names()
    );
    let operands: Vec<String> = COMMANDS
        .iter()
        .filter(|c| c.operand.is_some())
        .map(|c| format!("\"${{words[1]}}\" == {}", c.name))
        .collect();
    if !operands.is_empty() {
        let _ = write!(
            out,
            "    # The bare config file some commands take instead of --config.\n    \
             if [[ \"$cur\" != -* ]] && [[ {} ]]; then\n        _filedir toml\n        return\n    fi\n",
            operands.join(" || ")
        );
    }
    out.push_str(
        "    COMPREPLY=($(compgen -W \"$opts\" -- \"$cur\"))\n} &&\ncomplete -F _edgespool edgespool\n",
    );
    out
}

/// `text` inside zsh's single quotes.
fn zsh_quote(text: &str) -> String {
    text.replace('\'', "'\\''")
}

/// One `_arguments` spec of option `o`.
fn zsh_spec(o: &Opt) -> String {
    let help = zsh_quote(&o.help.replace('[', "\\[").replace(']', "\\]"));
    let value = match o.value {
        None => String::new(),
        Some(v) => {
            let action = match value_kind(v) {
                ValueKind::File => "_files",
                ValueKind::Dir => "_files -/",
                ValueKind::Other => " ",
            };
            format!(":{}:{action}", zsh_quote(&v.replace(':', "\\:")))
        }
    };
    let repeat = if o.flag == Flag::Set { "*" } else { "" };
    match o.short {
        Some(c) => format!(
            "'(-{c} --{long})'{{-{c},--{long}}}'[{help}]{value}'",
            long = o.long
        ),
        None => format!("'{repeat}--{}[{help}]{value}'", o.long),
    }
}

/// The zsh completion (`_edgespool`, for a directory in `$fpath`).
fn zsh() -> String {
    let help = zsh_quote(HELP_OPTION);
    let mut out = format!(
        "#compdef edgespool\n\
         # zsh completion for edgespool(1), generated from the table of commands\n\
         # (src/cli/spec.rs, what `edgespool help COMMAND` prints): do not edit;\n\
         # `{BLESS}` rewrites it.\n\n\
         _edgespool() {{\n  local curcontext=\"$curcontext\" state line ret=1\n  _arguments -C \\\n    \
         '(- *)'{{-h,--help}}'[{help}]' \\\n    \
         '(- *)'{{-V,--version}}'[{}]' \\\n    \
         '1: :->command' \\\n    '*:: :->args' && ret=0\n  case $state in\n    command)\n      \
         local -a commands\n      commands=(\n",
        zsh_quote(VERSION_ABOUT)
    );
    for cmd in COMMANDS {
        let _ = writeln!(out, "        '{}:{}'", cmd.name, zsh_quote(cmd.about));
    }
    let _ = write!(
        out,
        "        'help:{}'\n      )\n      _describe -t commands 'edgespool command' commands && ret=0\n      ;;\n    \
         args)\n      case $words[1] in\n",
        zsh_quote(HELP_ABOUT)
    );
    for cmd in COMMANDS {
        let _ = writeln!(out, "        {})\n          _arguments \\", cmd.name);
        for o in cmd.opts {
            let _ = writeln!(out, "            {} \\", zsh_spec(o));
        }
        if let Some(operand) = cmd.operand {
            let _ = writeln!(out, "            '1::{operand}:_files -g \"*.toml\"' \\");
        }
        let _ = writeln!(
            out,
            "            '(- *)'{{-h,--help}}'[{help}]' && ret=0\n          ;;"
        );
    }
    let _ = write!(
        out,
        "        help)\n          _arguments '1:command:({})' && ret=0\n          ;;\n      esac\n      ;;\n  \
         esac\n  return ret\n}}\n\n\
         # Autoloaded from $fpath it runs; sourced, it registers itself.\n\
         if [ \"$funcstack[1]\" = \"_edgespool\" ]; then\n  _edgespool \"$@\"\nelse\n  \
         compdef _edgespool edgespool\nfi\n",
        names()
    );
    out
}

/// `text` inside fish's single quotes.
fn fish_quote(text: &str) -> String {
    text.replace('\\', "\\\\").replace('\'', "\\'")
}

/// The fish completion (`edgespool.fish`).
fn fish() -> String {
    let mut out = format!(
        "# fish completion for edgespool(1), generated from the table of commands\n\
         # (src/cli/spec.rs, what `edgespool help COMMAND` prints): do not edit;\n\
         # `{BLESS}` rewrites it.\n\
         complete -c edgespool -f\n\
         complete -c edgespool -n __fish_use_subcommand -s h -l help -d '{}'\n\
         complete -c edgespool -n __fish_use_subcommand -s V -l version -d '{}'\n",
        fish_quote(HELP_OPTION),
        fish_quote(VERSION_ABOUT)
    );
    for cmd in COMMANDS {
        let _ = writeln!(
            out,
            "complete -c edgespool -n __fish_use_subcommand -a {} -d '{}'",
            cmd.name,
            fish_quote(cmd.about)
        );
    }
    let _ = writeln!(
        out,
        "complete -c edgespool -n __fish_use_subcommand -a help -d '{}'",
        fish_quote(HELP_ABOUT)
    );
    for cmd in COMMANDS {
        let when = format!("-n '__fish_seen_subcommand_from {}'", cmd.name);
        for o in cmd.opts {
            let short = o.short.map_or(String::new(), |c| format!(" -s {c}"));
            let value = match o.value.map(value_kind) {
                None => String::new(),
                Some(ValueKind::File) => " -r -F".to_owned(),
                Some(ValueKind::Dir) => " -x -a '(__fish_complete_directories)'".to_owned(),
                Some(ValueKind::Other) => " -x".to_owned(),
            };
            let _ = writeln!(
                out,
                "complete -c edgespool {when}{short} -l {}{value} -d '{}'",
                o.long,
                fish_quote(o.help)
            );
        }
        let _ = writeln!(
            out,
            "complete -c edgespool {when} -s h -l help -d '{}'",
            fish_quote(HELP_OPTION)
        );
        if cmd.operand.is_some() {
            let _ = writeln!(out, "complete -c edgespool {when} -F");
        }
    }
    let _ = writeln!(
        out,
        "complete -c edgespool -n '__fish_seen_subcommand_from help' -x -a '{}'",
        names()
    );
    out
}

// ---------------------------------------------------------------- tests

/// The long options (`--name`, roff's `\-\-name` too) named in `text`,
/// without their dashes.
pub fn long_options_in(text: &str) -> BTreeSet<String> {
    let text = text.replace("\\-", "-");
    let b = text.as_bytes();
    let mut out = BTreeSet::new();
    let mut i = 0;
    while let Some(at) = text[i..].find("--") {
        let start = i + at + 2;
        let mut end = start;
        while end < b.len()
            && (b[end].is_ascii_lowercase() || b[end] == b'-' || b[end].is_ascii_digit())
        {
            end += 1;
        }
        let name = text[start..end].trim_end_matches('-');
        if !name.is_empty() && b[start].is_ascii_lowercase() {
            out.insert(name.to_owned());
        }
        i = end.max(start);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::{Path, PathBuf};

    fn path(file: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(file)
    }

    fn read(file: &str) -> String {
        let p = path(file);
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    /// Every generated file as it must be committed.
    fn generated() -> Vec<(&'static str, String)> {
        vec![
            (
                "packaging/edgespool.1",
                man_page(&read("packaging/edgespool.1")),
            ),
            ("packaging/edgespool.bash", bash()),
            ("packaging/_edgespool", zsh()),
            ("packaging/edgespool.fish", fish()),
        ]
    }

    #[test]
    fn the_committed_man_page_and_completions_are_the_generated_ones() {
        let bless = std::env::var("EDGESPOOL_BLESS").is_ok_and(|v| v == "1");
        let mut stale = Vec::new();
        for (file, want) in generated() {
            let have = std::fs::read_to_string(path(file)).unwrap_or_default();
            if have == want {
                continue;
            }
            if bless {
                std::fs::write(path(file), &want).unwrap_or_else(|e| panic!("{file}: {e}"));
                continue;
            }
            let line = have
                .lines()
                .zip(want.lines())
                .position(|(a, b)| a != b)
                .map_or(have.lines().count().min(want.lines().count()), |n| n)
                + 1;
            stale.push(format!(
                "{file} differs from what src/cli/spec.rs gives (first at line {line}: {:?}, want {:?})",
                have.lines().nth(line - 1).unwrap_or(""),
                want.lines().nth(line - 1).unwrap_or("")
            ));
        }
        assert!(
            stale.is_empty(),
            "{}\nrun `{BLESS}` and commit the files",
            stale.join("\n")
        );
    }

    /// Each shell reads its file without a syntax error (where the shell
    /// is installed), and groff reads the man page without a warning.
    #[test]
    fn every_shell_and_groff_read_their_generated_file() {
        let check = |tool: &str, args: &[&str], text: &str, ext: &str| {
            let dir = tempfile::tempdir().unwrap();
            let f = dir.path().join(format!("edgespool{ext}"));
            std::fs::write(&f, text).unwrap();
            let out = match std::process::Command::new(tool).args(args).arg(&f).output() {
                Ok(o) => o,
                Err(_) => return, // not installed here
            };
            assert!(
                out.status.success() && out.stderr.is_empty(),
                "{tool} {args:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        };
        check("bash", &["-n"], &bash(), ".bash");
        check("zsh", &["-n"], &zsh(), ".zsh");
        check("fish", &["--no-execute"], &fish(), ".fish");
        let man = man_page(&read("packaging/edgespool.1"));
        check("groff", &["-man", "-ww", "-z", "-Tutf8"], &man, ".1");
    }

    #[test]
    fn each_command_has_exactly_its_options_in_every_generated_file() {
        let man = man_page(&read("packaging/edgespool.1"));
        let options = &man[man.find(".SH OPTIONS").unwrap_or(0)..];
        let (bash, zsh, fish) = (bash(), zsh(), fish());
        for cmd in COMMANDS {
            let own: BTreeSet<String> = cmd.opts.iter().map(|o| o.long.to_owned()).collect();
            let heading = format!(".SS {}\n", roff_escape(cmd.name));
            let sub = &options[options.find(&heading).expect("a heading") + heading.len()..];
            let sub = &sub[..sub.find(".SS ").unwrap_or(sub.len())];
            let tags: String = sub
                .split(".TP\n")
                .skip(1)
                .filter_map(|t| t.lines().next())
                .collect::<Vec<_>>()
                .join("\n");
            assert_eq!(
                long_options_in(&tags),
                own,
                "edgespool.1 OPTIONS, {}",
                cmd.name
            );
            let line = bash
                .lines()
                .find(|l| l.trim_start().starts_with(&format!("{}) opts=", cmd.name)))
                .expect("an opts= line");
            let mut named = long_options_in(line);
            assert!(named.remove("help"));
            assert_eq!(named, own, "edgespool.bash, {}", cmd.name);
            let block = &zsh[zsh
                .find(&format!("        {})\n", cmd.name))
                .expect("a case")..];
            let block = &block[..block.find(";;").unwrap_or(block.len())];
            let mut named = long_options_in(block);
            assert!(named.remove("help"));
            assert_eq!(named, own, "_edgespool, {}", cmd.name);
            let mut named: BTreeSet<String> = fish
                .lines()
                .filter(|l| l.contains(&format!("'__fish_seen_subcommand_from {}'", cmd.name)))
                .filter_map(|l| l.split(" -l ").nth(1))
                .filter_map(|l| l.split_whitespace().next())
                .map(str::to_owned)
                .collect();
            assert!(named.remove("help"));
            assert_eq!(named, own, "edgespool.fish, {}", cmd.name);
        }
        // The synopsis names every command and only its options.
        let synopsis = &man[man.find(".SH SYNOPSIS").expect("SYNOPSIS")..];
        let synopsis = &synopsis[..synopsis.find(".SH DESCRIPTION").unwrap_or(synopsis.len())];
        for cmd in COMMANDS {
            let entry = format!("\\fBedgespool\\fR \\fB{}\\fR", roff_escape(cmd.name));
            assert!(synopsis.contains(&entry), "{entry} in\n{synopsis}");
        }
    }

    #[test]
    fn usage_words_take_their_fonts_and_markup_escapes() {
        assert_eq!(
            roff_usage("run --config FILE [--set KEY=VALUE]..."),
            "\\fBrun\\fR \\fB\\-\\-config\\fR \\fIFILE\\fR [\\fB\\-\\-set\\fR \\fIKEY=VALUE\\fR]..."
        );
        assert_eq!(
            roff_word("mqtt://HOST:PORT"),
            "\\fBmqtt://\\fR\\fIHOST\\fR\\fB:\\fR\\fIPORT\\fR"
        );
        assert_eq!(
            roff_inline("Subscribe as `$share/`*GROUP* to spread"),
            "Subscribe as \\fB$share/\\fR\\fIGROUP\\fR to spread"
        );
        assert_eq!(roff_wrap(". starts"), "\\&. starts\n");
        assert_eq!(roff_word("-V"), "\\fB\\-V\\fR");
    }

    #[test]
    fn the_option_scanner_reads_roff_and_shell_spellings() {
        let found = long_options_in(
            ".BR \\-c \", \" \\-\\-config \" \\fIFILE\\fR\" --pg-ca|--json) x -- y",
        );
        let want: BTreeSet<String> = ["config", "pg-ca", "json"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        assert_eq!(found, want);
    }
}
