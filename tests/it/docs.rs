//! The documentation holds together: README.md and docs/*.md link only to
//! files and anchors that exist, and docs/config.md names exactly the keys the
//! config parser accepts.
//!
//! Links: every inline link `[text](target)` outside fenced code and inline
//! code. A target with a scheme (`https:`, `mailto:`) is not checked; any
//! other is a path relative to the file holding it (empty: that file), which
//! must exist, and its `#anchor`, for a Markdown file, must be a heading of it
//! under GitHub's slug rules (lowercase; spaces to `-`; punctuation other than
//! `-` and `_` dropped; a repeated slug gets `-1`, `-2`; headings inside
//! fenced code are none).
//!
//! Keys: **a key in the reference** is an inline code span in docs/config.md,
//! outside fenced code, that is written as a full key path: dotted segments
//! of lowercase letters, digits and `_`, an array entry written `[N]` (or an
//! index: `[0]`, `.0`), a key of the operator's choosing written `<name>`,
//! starting with a top-level key of the config (`spool.max_bytes`,
//! `sources[N].follow`, `commands.handlers[N].params.<name>.type`; a
//! top-level key alone, `device_id`, counts too, a table name alone such as
//! `mqtt` does not). Every key `edgespool::config::accepted_keys()` lists
//! (read from the parser's own serde definitions) must be one; every one must
//! be an accepted key or a table holding some (`commands.config_push`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Component, Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// README.md and every docs/*.md, sorted.
fn pages() -> Vec<PathBuf> {
    let mut out = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .expect("docs/ exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    docs.sort();
    out.extend(docs);
    out
}

/// Lines outside fenced code blocks, with their 1-based numbers.
fn prose(text: &str) -> Vec<(usize, &str)> {
    let mut out = Vec::new();
    let mut fence: Option<(char, usize)> = None;
    for (n, line) in text.lines().enumerate() {
        let t = line.trim_start_matches(' ');
        let indent = line.len() - t.len();
        let c = t.chars().next().unwrap_or(' ');
        let run = t.chars().take_while(|x| *x == c).count();
        let is_fence = indent <= 3 && (c == '`' || c == '~') && run >= 3;
        match fence {
            None if is_fence => fence = Some((c, run)),
            None => out.push((n + 1, line)),
            Some((fc, flen)) => {
                if is_fence && c == fc && run >= flen && t.trim_end().len() == run {
                    fence = None;
                }
            }
        }
    }
    out
}

/// The text of `line` outside inline code spans, and the spans' contents.
fn split_code(line: &str) -> (String, Vec<String>) {
    let (mut text, mut code) = (String::new(), Vec::new());
    let mut rest = line;
    while let Some(at) = rest.find('`') {
        text.push_str(&rest[..at]);
        let ticks = rest[at..].chars().take_while(|c| *c == '`').count();
        let open = &rest[at..at + ticks];
        let after = &rest[at + ticks..];
        match after.find(open) {
            Some(end) => {
                code.push(after[..end].trim().to_owned());
                rest = &after[end + ticks..];
            }
            None => {
                // An unclosed span (it continues on the next line): the rest is code.
                rest = "";
            }
        }
    }
    text.push_str(rest);
    (text, code)
}

/// GitHub's anchor for a heading's text (before duplicate numbering).
fn slug(heading: &str) -> String {
    // A link in a heading contributes its text.
    let mut text = String::new();
    let mut rest = heading;
    while let Some(open) = rest.find('[') {
        match rest[open..]
            .find("](")
            .and_then(|m| rest[open + m..].find(')').map(|c| (open + m, open + m + c)))
        {
            Some((mid, close)) => {
                text.push_str(&rest[..open]);
                text.push_str(&rest[open + 1..mid]);
                rest = &rest[close + 1..];
            }
            None => break,
        }
    }
    text.push_str(rest);
    text.to_lowercase()
        .chars()
        .filter(|c| c.is_alphanumeric() || matches!(c, ' ' | '-' | '_'))
        .map(|c| if c == ' ' { '-' } else { c })
        .collect()
}

/// Every anchor of a Markdown text: its headings' slugs, numbered as GitHub does.
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: BTreeMap<String, usize> = BTreeMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose(text) {
        let hashes = line.chars().take_while(|c| *c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with([' ', '\t']) {
            continue;
        }
        let title = line[hashes..].trim().trim_end_matches('#').trim_end();
        let base = slug(title);
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// Every inline link target in `text`, with its line.
fn links(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(text) {
        let (plain, _) = split_code(line);
        let mut rest = plain.as_str();
        while let Some(at) = rest.find("](") {
            let after = &rest[at + 2..];
            let end = after.find(')').unwrap_or(after.len());
            let target = after[..end].trim();
            // `[text](target "title")`: the title is no part of the target.
            let target = target.split_whitespace().next().unwrap_or("");
            out.push((n, target.to_owned()));
            rest = &after[end..];
        }
    }
    out
}

/// What is wrong with each link of the page at `file` (`text`): a missing
/// file or anchor, as `file:line: target: problem`.
fn broken_links(file: &Path, text: &str, read: &dyn Fn(&Path) -> Option<String>) -> Vec<String> {
    let rel = file
        .strip_prefix(root())
        .unwrap_or(file)
        .display()
        .to_string();
    let mut out = Vec::new();
    for (n, target) in links(text) {
        let scheme = target.split_once(':').is_some_and(|(s, _)| {
            !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "+.-".contains(c))
        });
        if scheme || target.starts_with("//") {
            continue;
        }
        let (path, anchor) = match target.split_once('#') {
            Some((p, a)) => (p, Some(a)),
            None => (target.as_str(), None),
        };
        let dest = if path.is_empty() {
            file.to_path_buf()
        } else {
            normalize(&file.parent().unwrap_or(root()).join(path))
        };
        if !dest.starts_with(root()) {
            out.push(format!("{rel}:{n}: {target}: leaves the repository"));
            continue;
        }
        let own = path.is_empty().then(|| text.to_owned());
        let Some(body) = own.or_else(|| read(&dest)) else {
            out.push(format!("{rel}:{n}: {target}: no such file"));
            continue;
        };
        if let Some(a) = anchor {
            let is_md = dest.extension().is_some_and(|x| x == "md");
            if is_md && !anchors(&body).contains(a) {
                out.push(format!(
                    "{rel}:{n}: {target}: no heading gives the anchor #{a}"
                ));
            }
        }
    }
    out
}

fn normalize(p: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in p.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

fn read_repo(p: &Path) -> Option<String> {
    if p.is_dir() {
        return Some(String::new());
    }
    std::fs::read(p)
        .ok()
        .map(|b| String::from_utf8_lossy(&b).into_owned())
}

#[test]
fn every_link_in_the_readme_and_docs_resolves() {
    let pages = pages();
    assert!(pages.len() > 5, "docs/ holds only {pages:?}");
    let mut broken = Vec::new();
    let mut count = 0;
    for page in &pages {
        let text = std::fs::read_to_string(page).expect("read page");
        count += links(&text).len();
        broken.extend(broken_links(page, &text, &read_repo));
    }
    println!("docs: {} pages, {count} links", pages.len());
    assert!(
        broken.is_empty(),
        "links that lead nowhere:\n{}",
        broken.join("\n")
    );
}

/// `token` as a key path (`sources[N].follow`), if it is written as one.
fn key_path(token: &str, top: &BTreeSet<String>) -> Option<String> {
    let mut segs: Vec<String> = Vec::new();
    for seg in token.split('.') {
        if !seg.is_empty() && seg.chars().all(|c| c.is_ascii_digit()) {
            segs.last_mut()?.push_str("[N]");
            continue;
        }
        if seg == "<name>" {
            segs.push(seg.to_owned());
            continue;
        }
        let (name, index) = match seg.split_once('[') {
            Some((n, i)) => (n, Some(i.strip_suffix(']')?)),
            None => (seg, None),
        };
        let word = !name.is_empty()
            && name.starts_with(|c: char| c.is_ascii_lowercase())
            && name
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if !word {
            return None;
        }
        match index {
            None => segs.push(name.to_owned()),
            Some(i) if i == "N" || (!i.is_empty() && i.chars().all(|c| c.is_ascii_digit())) => {
                segs.push(format!("{name}[N]"));
            }
            Some(_) => return None,
        }
    }
    let first = segs.first()?.trim_end_matches("[N]");
    if !top.contains(first) {
        return None;
    }
    let path = segs.join(".");
    // A top-level name alone counts only as a plain key (`device_id`).
    if segs.len() == 1 && !segs[0].ends_with("[N]") && top.contains(&path) {
        return Some(path).filter(|p| TOP_PLAIN.contains(&p.as_str()));
    }
    Some(path)
}

/// Top-level keys that hold a value, not a table.
const TOP_PLAIN: &[&str] = &["device_id"];

/// Every key in the reference text (see the module doc), with its line.
fn reference_keys(text: &str, top: &BTreeSet<String>) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    for (n, line) in prose(text) {
        for code in split_code(line).1 {
            if let Some(k) = key_path(&code, top) {
                out.push((n, k));
            }
        }
    }
    out
}

/// The first segment of each accepted key: the config's top-level names.
fn top_level(accepted: &[String]) -> BTreeSet<String> {
    accepted
        .iter()
        .map(|k| k.split(['.', '[']).next().unwrap_or_default().to_owned())
        .collect()
}

/// (accepted keys missing from the reference, reference keys not accepted).
fn key_mismatches(text: &str, accepted: &[String]) -> (Vec<String>, Vec<String>) {
    let top = top_level(accepted);
    let written = reference_keys(text, &top);
    let in_ref: BTreeSet<&str> = written.iter().map(|(_, k)| k.as_str()).collect();
    let missing = accepted
        .iter()
        .filter(|k| !in_ref.contains(k.as_str()))
        .cloned()
        .collect();
    let unknown = written
        .iter()
        .filter(|(_, k)| {
            !accepted.iter().any(|a| {
                a == k || a.starts_with(&format!("{k}.")) || a.starts_with(&format!("{k}["))
            })
        })
        .map(|(n, k)| format!("docs/config.md:{n}: `{k}`"))
        .collect();
    (missing, unknown)
}

#[test]
fn the_config_reference_names_every_accepted_key_and_no_other() {
    let accepted = edgespool::config::accepted_keys();
    assert!(
        accepted.len() > 100,
        "only {} keys accepted",
        accepted.len()
    );
    let text = std::fs::read_to_string(root().join("docs/config.md")).expect("docs/config.md");
    let (missing, unknown) = key_mismatches(&text, &accepted);
    println!(
        "docs: {} accepted keys, {} written in docs/config.md",
        accepted.len(),
        reference_keys(&text, &top_level(&accepted)).len()
    );
    assert!(
        missing.is_empty() && unknown.is_empty(),
        "keys the parser accepts that docs/config.md does not name (add them, as full paths):\n{}\n\
         keys docs/config.md names that the parser does not accept:\n{}",
        missing.join("\n"),
        unknown.join("\n")
    );
}

#[test]
fn the_checks_catch_a_broken_link_and_a_missing_key() {
    let page = root().join("docs/x.md");
    let other = "# Other\n\n## Two words\n\n```\n# not a heading\n```\n";
    let read = |p: &Path| -> Option<String> {
        (p == root().join("docs/other.md")).then(|| other.to_owned())
    };
    let text = "# X\n\n## Here, (too)\n\n[a](#here-too) [b](other.md#two-words) \
                [c](https://example.com) `[d](nope.md)`\n\
                [e](other.md#not-a-heading) [f](gone.md) [g](#nowhere)\n";
    let broken = broken_links(&page, text, &read);
    assert_eq!(broken.len(), 3, "{broken:?}");
    assert!(broken[0].contains("#not-a-heading"), "{broken:?}");
    assert!(broken[1].contains("gone.md: no such file"), "{broken:?}");
    assert!(broken[2].contains("#nowhere"), "{broken:?}");
    // Repeated headings get -1, -2; punctuation goes, `-` and `_` stay.
    let a = anchors("# A b\n## A b\n## A b\n### Follow (`x = y`)\n### snake_case-x\n");
    for s in ["a-b", "a-b-1", "a-b-2", "follow-x--y", "snake_case-x"] {
        assert!(a.contains(s), "{s} not in {a:?}");
    }

    let accepted: Vec<String> = [
        "device_id",
        "spool.path",
        "sources[N].follow",
        "commands.config_push.mode",
    ]
    .map(String::from)
    .to_vec();
    let reference =
        "| `device_id` | `spool.path` | `sources[0].follow` | `commands.config_push` | `mqtt` |\n\
                     ```\n`spool.nope`\n```\n";
    let (missing, unknown) = key_mismatches(reference, &accepted);
    assert_eq!(missing, vec!["commands.config_push.mode".to_owned()]);
    assert!(unknown.is_empty(), "{unknown:?}");
    let (_, unknown) = key_mismatches("`spool.pth` and `sources.1.follow`", &accepted);
    assert_eq!(unknown, vec!["docs/config.md:1: `spool.pth`".to_owned()]);
}

/// Issue 36: the demo sets up what the demo needs and nothing of the test
/// stack; the test command installs the rest. Read from the set-up script
/// itself (`SETUP_LIST=1` prints a mode's packages and installs nothing).
#[test]
fn the_demo_installs_only_what_the_demo_needs() {
    let list = |mode: &[&str]| -> BTreeSet<String> {
        let out = std::process::Command::new(root().join("cross/setup-debian.sh"))
            .args(mode)
            .env("SETUP_LIST", "1")
            .output()
            .expect("run cross/setup-debian.sh");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8_lossy(&out.stdout)
            .split_whitespace()
            .map(str::to_owned)
            .collect()
    };
    let demo = list(&["--demo"]);
    let want: BTreeSet<String> = ["gcc", "libc6-dev", "mosquitto", "mosquitto-clients"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    assert_eq!(demo, want, "the demo's packages");
    let tests = list(&[]);
    for p in ["postgresql", "prometheus", "faketime", "strace", "nodejs"] {
        assert!(tests.contains(p), "the test stack installs {p}");
        assert!(!demo.contains(p), "the demo does not install {p}");
    }
    let demo_sh = std::fs::read_to_string(root().join("cross/demo.sh")).expect("demo.sh");
    assert!(
        demo_sh
            .lines()
            .any(|l| l.trim() == "cross/setup-debian.sh --demo"),
        "cross/demo.sh sets up with --demo"
    );
    // No command of the README starts (or enables) a system service.
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README");
    for bad in [
        "systemctl start",
        "systemctl enable",
        "service mosquitto start",
    ] {
        assert!(!readme.contains(bad), "README.md runs `{bad}`");
    }
}

/// The README's quick start works as written: its shell block, from a
/// clone's directory (here a fresh one), writes a config that
/// `check-config` and `test` accept, with the spool beside it and nothing
/// in a fixed path a second user could hold. `cargo build` and the
/// background `run` are left out (the suite has built the binary; `run`
/// is tested elsewhere).
#[test]
fn readme_quick_start_runs_as_written() {
    let readme = std::fs::read_to_string(root().join("README.md")).expect("README");
    let at = readme
        .find("## Quick start")
        .expect("README has a Quick start");
    let rest = &readme[at..];
    let open = rest.find("```sh\n").expect("a sh block") + "```sh\n".len();
    let close = open + rest[open..].find("\n```").expect("the block ends");
    let block = &rest[open..close];
    assert!(!block.contains("/tmp/"), "fixed /tmp path:\n{block}");
    let script: String = block
        .lines()
        .filter(|l| !l.starts_with("cargo build") && !l.trim_end().ends_with('&'))
        .map(|l| l.replace("target/release/edgespool", "\"$EDGESPOOL\""))
        .collect::<Vec<_>>()
        .join("\n");
    let clone = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new("bash")
        .args(["-euc", &script])
        .current_dir(clone.path())
        .env("EDGESPOOL", crate::support::agent::bin())
        .output()
        .expect("bash runs");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{script}\n---\n{text}");
    assert!(
        text.contains(": ok (device qs-01 from the config, 1 source,"),
        "{text}"
    );
    assert!(text.contains("test: ok (1 source gave a reading"), "{text}");
    let cfg = std::fs::read_to_string(clone.path().join("qs-data/board.toml")).expect("config");
    let spool = clone.path().join("qs-data/spool.db");
    assert!(
        cfg.contains(&format!("path = \"{}\"", spool.display())),
        "{cfg}"
    );
}
