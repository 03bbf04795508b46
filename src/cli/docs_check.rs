//! The man page (`packaging/edgespool.1`) and the bash completion
//! (`packaging/edgespool.bash`) held against the table of commands
//! ([`super::spec`]), both ways: every option of every command is in them,
//! and nothing is in them that the table does not have.

use std::collections::BTreeSet;

use super::spec::COMMANDS;

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

fn read(file: &str) -> String {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file);
    std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn own(name: &str) -> BTreeSet<String> {
    let cmd = super::spec::command(name).unwrap_or_else(|| panic!("no command {name}"));
    cmd.opts.iter().map(|o| o.long.to_owned()).collect()
}

/// The man page's parts between `.SH`/`.SS` headings whose heading line
/// is `heading`, up to the next heading of the same kind.
fn section<'a>(man: &'a str, heading: &str) -> &'a str {
    let start = man
        .find(&format!("\n{heading}\n"))
        .unwrap_or_else(|| panic!("edgespool.1 has no {heading:?}"));
    let body = &man[start + heading.len() + 2..];
    let kind = &heading[..3];
    let end = body.find(&format!("\n{kind} ")).unwrap_or(body.len());
    let end = end.min(body.find("\n.SH ").unwrap_or(body.len()));
    &body[..end]
}

#[test]
fn the_man_page_synopsis_gives_each_command_exactly_its_options() {
    let man = read("packaging/edgespool.1");
    let synopsis = section(&man, ".SH SYNOPSIS");
    // One entry per `.B edgespool NAME` line, up to the next such line; a
    // command may have several (sink and sink --stats).
    let mut seen: std::collections::BTreeMap<String, BTreeSet<String>> = Default::default();
    let starts: Vec<usize> = synopsis
        .match_indices(".B edgespool ")
        .map(|(i, _)| i)
        .collect();
    for (k, &s) in starts.iter().enumerate() {
        let e = starts.get(k + 1).copied().unwrap_or(synopsis.len());
        let entry = &synopsis[s..e];
        let name = entry[".B edgespool ".len()..]
            .split_whitespace()
            .next()
            .unwrap_or("")
            .replace("\\-", "-");
        if name == "--version" || name == "help" {
            continue;
        }
        seen.entry(name).or_default().extend(long_options_in(entry));
    }
    let all: BTreeSet<String> = COMMANDS.iter().map(|c| c.name.to_owned()).collect();
    assert_eq!(
        seen.keys().cloned().collect::<BTreeSet<_>>(),
        all,
        "edgespool.1 SYNOPSIS: the commands"
    );
    for (name, mut named) in seen {
        named.remove("help");
        assert_eq!(named, own(&name), "edgespool.1 SYNOPSIS, {name}");
    }
}

#[test]
fn the_man_page_describes_every_option_of_every_command_under_its_own_heading() {
    let man = read("packaging/edgespool.1");
    let options = section(&man, ".SH OPTIONS");
    for cmd in COMMANDS {
        let sub = section(options, &format!(".SS {}", cmd.name.replace('-', "\\-")));
        // Only the `.TP` tag lines: the descriptions may mention others.
        let tags: String = sub
            .split(".TP\n")
            .skip(1)
            .filter_map(|t| t.lines().next())
            .collect::<Vec<_>>()
            .join("\n");
        let mut named = long_options_in(&tags);
        named.remove("help");
        assert_eq!(named, own(cmd.name), "edgespool.1 OPTIONS, {}", cmd.name);
    }
}

#[test]
fn the_bash_completion_offers_each_command_exactly_its_options() {
    let bash = read("packaging/edgespool.bash");
    let cmds_line = bash
        .lines()
        .find(|l| l.trim_start().starts_with("local cmds="))
        .expect("a cmds= line");
    let words: BTreeSet<&str> = cmds_line
        .split('"')
        .nth(1)
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let mut want: BTreeSet<&str> = COMMANDS.iter().map(|c| c.name).collect();
    want.extend(["help", "--help", "--version"]);
    assert_eq!(words, want, "edgespool.bash: the commands");
    let mut valued = BTreeSet::new();
    for cmd in COMMANDS {
        let line = bash
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{}) opts=", cmd.name)))
            .unwrap_or_else(|| panic!("edgespool.bash: no `{}) opts=` line", cmd.name));
        let mut named = long_options_in(line);
        assert!(
            named.remove("help"),
            "edgespool.bash: {} offers --help",
            cmd.name
        );
        assert_eq!(named, own(cmd.name), "edgespool.bash, {}", cmd.name);
        valued.extend(
            cmd.opts
                .iter()
                .filter(|o| o.value.is_some())
                .map(|o| o.long.to_owned()),
        );
    }
    // The options that take a value are the ones after which no option
    // is offered (the `case "$prev"` lists).
    let prev = &bash[bash.find("case \"$prev\"").expect("a case on $prev")..];
    let prev = &prev[..prev.find("esac").unwrap_or(prev.len())];
    assert_eq!(
        long_options_in(prev),
        valued,
        "edgespool.bash: case \"$prev\""
    );
}

#[test]
fn the_option_scanner_reads_roff_and_shell_spellings() {
    let found =
        long_options_in(".BR \\-c \", \" \\-\\-config \" \\fIFILE\\fR\" --pg-ca|--json) x -- y");
    let want: BTreeSet<String> = ["config", "pg-ca", "json"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(found, want);
}
