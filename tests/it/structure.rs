//! The house stays one-way: every `use crate::` path (and every inline
//! `crate::`/`super::` path) in `src/` runs down the floors below, never up,
//! and no files import each other in a circle. The floors are the ones in
//! the house style ("Floors: who may import whom"); a new back-import fails
//! here with the file, the line and the rule it breaks.
//!
//! Read as text: comments and string literals are blanked first, so a path
//! in a doc comment or a message is no import. Code inside `#[cfg(test)]`
//! counts too: a test module lives in its part's room.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Each part of the library (a top-level module of `src/`, a room grouped
/// by job) and its floor, bottom first. A part imports only parts on a
/// lower floor; parts on one floor import each other only where
/// [`SIDEWAYS`] says so. The floors:
///
/// - 10 `event`: what a reading is and how it travels; imports nothing
/// - 11 `os`: thin Linux wrappers (processes, filesystem guards, notify,
///   threads, backoff, identity)
/// - 20 the stores: `spool` (every SQL statement of the agent, integrity)
///   and `sink` (the fleet consumer: event and os only)
/// - 30 `flash` (checkpoint, retention, write and outage budgets, probe),
///   `intake` (what the writer thread receives)
/// - 40 `metrics`
/// - 50 the parts that move readings: `source`, `ingest`, `mqtt`
/// - 60 the parts on the link: `delivery`, `commands`
/// - 70 `config`: parses TOML, validates, assembles every part's settings
/// - 80 `push`; 90 `agent` (wiring, the writer, health); 100 `cli` (one
///   file per subcommand); 110 the binary (`main.rs`)
const FLOORS: &[(&str, u32)] = &[
    ("event", 10),
    ("os", 11),
    ("spool", 20),
    ("sink", 20),
    ("flash", 30),
    ("intake", 30),
    ("metrics", 40),
    ("source", 50),
    ("ingest", 50),
    ("mqtt", 50),
    ("delivery", 60),
    ("commands", 60),
    ("config", 70),
    ("push", 80),
    ("agent", 90),
    ("cli", 100),
    ("main", 110),
];

/// Imports allowed between parts of one floor, each with its reason.
const SIDEWAYS: &[(&str, &str, &str)] = &[];

/// Longest a source file may grow, in lines outside its `#[cfg(test)]` module.
const MAX_FILE_LINES: usize = 1000;
/// Longest a function may grow outside tests, in lines.
const MAX_FN_LINES: usize = 100;

#[test]
fn every_import_runs_down_the_floors() {
    let house = House::read();
    let mut broken = Vec::new();
    for f in &house.files {
        for imp in &f.imports {
            let Some(to) = house.file_of(&imp.module) else {
                continue;
            };
            let (a, b) = (&f.part, &house.files[to].part);
            if a == b {
                continue;
            }
            let (fa, fb) = (floor(a), floor(b));
            let sideways = SIDEWAYS.iter().any(|(x, y, _)| x == a && y == b);
            if fb < fa || (fb == fa && sideways) {
                continue;
            }
            let rule = if fb == fa {
                format!("`{a}` and `{b}` share floor {fa}; neither may import the other (no SIDEWAYS entry)")
            } else {
                format!("`{a}` is on floor {fa}, `{b}` on floor {fb}: nothing imports upward")
            };
            broken.push(format!(
                "{}:{}: imports {} — {rule}",
                f.rel,
                imp.line,
                imp.module.join("::")
            ));
        }
    }
    assert!(
        broken.is_empty(),
        "imports that run up the house:\n{}",
        broken.join("\n")
    );
}

#[test]
fn no_files_import_each_other_in_a_circle() {
    let house = House::read();
    let edges = house.edges();
    let circles = circles(house.files.len(), &edges);
    let named: Vec<String> = circles
        .iter()
        .map(|c| {
            c.iter()
                .map(|i| house.files[*i].rel.as_str())
                .collect::<Vec<_>>()
                .join(" -> ")
        })
        .collect();
    assert!(named.is_empty(), "import circles:\n{}", named.join("\n"));
}

#[test]
fn every_part_of_src_has_a_floor() {
    let house = House::read();
    let unknown: BTreeSet<&str> = house
        .files
        .iter()
        .map(|f| f.part.as_str())
        .filter(|p| !FLOORS.iter().any(|(n, _)| n == p) && *p != "lib")
        .collect();
    assert!(
        unknown.is_empty(),
        "parts with no floor in FLOORS (give each one): {unknown:?}"
    );
}

#[test]
fn files_and_functions_stay_small() {
    let house = House::read();
    let mut big = Vec::new();
    for f in &house.files {
        if f.lines_outside_tests > MAX_FILE_LINES {
            big.push(format!(
                "{}: {} lines outside tests (at most {MAX_FILE_LINES})",
                f.rel, f.lines_outside_tests
            ));
        }
        for (name, line, len) in f.fns.iter().filter(|(_, _, len)| *len > MAX_FN_LINES) {
            big.push(format!(
                "{}:{line}: fn {name} is {len} lines (at most {MAX_FN_LINES})",
                f.rel
            ));
        }
    }
    // The figures, for the record.
    if let Some(f) = house.files.iter().max_by_key(|f| f.lines_outside_tests) {
        println!(
            "structure: largest file {} ({} lines outside tests)",
            f.rel, f.lines_outside_tests
        );
    }
    let longest = house
        .files
        .iter()
        .flat_map(|f| f.fns.iter().map(move |g| (f, g)))
        .max_by_key(|(_, (_, _, len))| *len);
    if let Some((f, (name, line, len))) = longest {
        println!(
            "structure: longest function {}:{line} fn {name} ({len} lines)",
            f.rel
        );
    }
    assert!(
        big.is_empty(),
        "rooms or functions too large:\n{}",
        big.join("\n")
    );
}

#[test]
fn the_reader_sees_imports_and_blanks_comments() {
    let code = "use crate::{spool::{Spool, NewEvent}, envelope};\n\
                // use crate::agent::X;\n\
                fn f() { let s = \"crate::config::parse\"; crate::backoff::Backoff::new(); }\n\
                use super::tail::Tail;\n";
    let clean = blank(code);
    let got: Vec<String> = paths(&clean)
        .into_iter()
        .map(|(p, line, _)| format!("{}@{line}", p.join("::")))
        .collect();
    assert_eq!(
        got,
        vec![
            "crate::spool::Spool@1",
            "crate::spool::NewEvent@1",
            "crate::envelope@1",
            "super::tail::Tail@4",
            "crate::backoff::Backoff::new@3",
        ]
    );
    // A circle of two and a chain without one.
    assert_eq!(circles(3, &[(0, 1), (1, 0), (1, 2)]), vec![vec![0, 1]]);
    assert!(circles(3, &[(0, 1), (1, 2)]).is_empty());
}

fn floor(part: &str) -> u32 {
    FLOORS
        .iter()
        .find(|(n, _)| *n == part)
        .map_or(u32::MAX, |(_, f)| *f)
}

/// One import: the module path it names (from the crate root) and its line.
struct Import {
    module: Vec<String>,
    line: usize,
}

struct SrcFile {
    rel: String,
    /// The module path of the file (`["spool", "append"]`), from the crate root.
    module: Vec<String>,
    part: String,
    imports: Vec<Import>,
    lines_outside_tests: usize,
    /// Functions outside tests: `(name, line, lines)`.
    fns: Vec<(String, usize, usize)>,
}

struct House {
    files: Vec<SrcFile>,
    by_module: BTreeMap<Vec<String>, usize>,
}

impl House {
    fn read() -> House {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        let src = root.join("src");
        let mut paths = Vec::new();
        walk(&src, &mut paths);
        let bin = bin_modules(&src);
        let mut read = Vec::new();
        // Files the crate compiles only for tests (`#[cfg(test)] mod x;`)
        // are test code as a whole.
        let mut test_only: BTreeSet<Vec<String>> = BTreeSet::new();
        for p in paths {
            let rel_src = p.strip_prefix(&src).expect("under src").to_path_buf();
            let mut module = module_of(&rel_src);
            let text = std::fs::read_to_string(&p).expect("read source");
            let clean = blank(&text);
            let is_bin = module
                .first()
                .is_some_and(|m| m == "main" || bin.contains(m));
            if is_bin && module != ["main"] {
                module.insert(0, "main".into());
            }
            for child in test_modules(&clean) {
                let mut m = module.clone();
                m.push(child);
                test_only.insert(m);
            }
            read.push((rel_src, module, clean, is_bin));
        }
        let mut files = Vec::new();
        for (rel_src, module, clean, is_bin) in read {
            let part = module.first().cloned().unwrap_or_else(|| "lib".into());
            let tests = test_ranges(&clean);
            let imports = paths_to_imports(&clean, &module, &tests, is_bin);
            let whole_test = test_only.iter().any(|t| module.starts_with(t));
            let total = clean.lines().count();
            let test_lines: usize = if whole_test {
                total
            } else {
                tests
                    .iter()
                    .map(|(a, b)| clean[*a..*b].lines().count())
                    .sum()
            };
            let fns = if whole_test {
                Vec::new()
            } else {
                functions(&clean, &tests)
            };
            files.push(SrcFile {
                rel: format!("src/{}", rel_src.display()),
                module,
                part,
                imports,
                lines_outside_tests: total - test_lines,
                fns,
            });
        }
        let by_module = files
            .iter()
            .enumerate()
            .map(|(i, f)| (f.module.clone(), i))
            .collect();
        House { files, by_module }
    }

    /// The file that defines the longest known prefix of `module`.
    fn file_of(&self, module: &[String]) -> Option<usize> {
        (1..=module.len())
            .rev()
            .find_map(|n| self.by_module.get(&module[..n]).copied())
    }

    fn edges(&self) -> Vec<(usize, usize)> {
        let mut out = BTreeSet::new();
        for (i, f) in self.files.iter().enumerate() {
            for imp in &f.imports {
                if let Some(j) = self.file_of(&imp.module) {
                    // A child naming its own parent's items through `super`
                    // is how a folder shares its types; a parent's `mod` line
                    // is no import. Both directions still count between
                    // siblings and across parts.
                    if j != i {
                        out.insert((i, j));
                    }
                }
            }
        }
        out.into_iter().collect()
    }
}

fn module_of(rel: &Path) -> Vec<String> {
    let mut parts: Vec<String> = rel
        .with_extension("")
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    if parts.last().is_some_and(|l| l == "mod") {
        parts.pop();
    }
    if parts == ["lib"] {
        return Vec::new();
    }
    parts
}

/// Modules `main.rs` declares: the binary's own, not the library's.
fn bin_modules(src: &Path) -> BTreeSet<String> {
    let text = std::fs::read_to_string(src.join("main.rs")).unwrap_or_default();
    let clean = blank(&text);
    let mut out = BTreeSet::new();
    for line in clean.lines() {
        let t = line.trim();
        if let Some(rest) = t
            .strip_prefix("mod ")
            .or_else(|| t.strip_prefix("pub mod "))
        {
            out.insert(rest.trim_end_matches(';').trim().to_owned());
        }
    }
    out
}

fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .expect("read src")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    for e in entries {
        if e.is_dir() {
            walk(&e, out);
        } else if e.extension().is_some_and(|x| x == "rs") {
            out.push(e);
        }
    }
}

/// Resolve the paths a file names to module paths from the crate root.
/// `module` is the file's own module; `super::` climbs from it, or from an
/// inline test module inside it (whose `super` is the file itself).
fn paths_to_imports(
    clean: &str,
    module: &[String],
    tests: &[(usize, usize)],
    is_bin: bool,
) -> Vec<Import> {
    let mut out = Vec::new();
    for (p, line, at) in paths(clean) {
        let mut here = module.to_vec();
        if tests.iter().any(|(a, z)| (*a..*z).contains(&at)) {
            here.push("tests".into());
        }
        let mut module: Vec<String> = match p[0].as_str() {
            "crate" if is_bin => {
                let mut m = vec!["main".to_owned()];
                m.extend(p[1..].iter().cloned());
                m
            }
            "crate" | "edgespool" => p[1..].to_vec(),
            "super" => {
                let mut base = here.clone();
                let mut rest = &p[..];
                while rest.first().is_some_and(|s| s == "super") {
                    base.pop();
                    rest = &rest[1..];
                }
                base.extend(rest.iter().cloned());
                base
            }
            _ => continue,
        };
        if module.is_empty() {
            continue;
        }
        module.retain(|s| s != "self");
        out.push(Import { module, line });
    }
    out
}

/// Every path that starts with `crate::`, `super::` or `edgespool::`, with
/// its line: the leaves of `use` trees first (in order), then inline paths.
fn paths(clean: &str) -> Vec<(Vec<String>, usize, usize)> {
    let mut uses = Vec::new();
    let mut inline = Vec::new();
    let bytes = clean.as_bytes();
    let line_at = |i: usize| clean[..i].matches('\n').count() + 1;
    let mut i = 0;
    while i < bytes.len() {
        if word_at(clean, i, "use") {
            let end = clean[i..].find(';').map_or(clean.len(), |e| i + e);
            let tree = &clean[i + 3..end];
            let line = line_at(i);
            let mut leaves = Vec::new();
            expand(tree.trim(), &[], &mut leaves);
            for l in leaves {
                if matches!(
                    l.first().map(String::as_str),
                    Some("crate" | "super" | "edgespool")
                ) {
                    uses.push((l, line, i));
                }
            }
            i = end + 1;
            continue;
        }
        for root in ["crate::", "super::", "edgespool::"] {
            if clean[i..].starts_with(root)
                && (i == 0 || !ident_char(bytes[i - 1]) && bytes[i - 1] != b':')
            {
                let end = clean[i..]
                    .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_' || c == ':'))
                    .map_or(clean.len(), |e| i + e);
                let p: Vec<String> = clean[i..end]
                    .split("::")
                    .filter(|s| !s.is_empty())
                    .map(str::to_owned)
                    .collect();
                inline.push((p, line_at(i), i));
                i = end;
                break;
            }
        }
        i += 1;
    }
    uses.extend(inline);
    uses
}

fn ident_char(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

fn word_at(s: &str, i: usize, w: &str) -> bool {
    let b = s.as_bytes();
    s[i..].starts_with(w)
        && (i == 0 || !ident_char(b[i - 1]))
        && b.get(i + w.len()).is_some_and(|c| c.is_ascii_whitespace())
}

/// The leaves of a `use` tree (`a::{b, c::{d, e}}` → a::b, a::c::d, a::c::e).
fn expand(tree: &str, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let tree = tree.trim();
    if tree.is_empty() {
        return;
    }
    if let Some(open) = tree.find('{') {
        let head = &tree[..open];
        let mut base = prefix.to_vec();
        base.extend(split_path(head));
        let inner = &tree[open + 1..tree.rfind('}').unwrap_or(tree.len())];
        for item in split_top(inner) {
            expand(item, &base, out);
        }
        return;
    }
    let tree = tree.split(" as ").next().unwrap_or(tree);
    let mut p = prefix.to_vec();
    p.extend(split_path(tree));
    if !p.is_empty() {
        out.push(p);
    }
}

fn split_path(s: &str) -> Vec<String> {
    s.split("::")
        .map(str::trim)
        .filter(|x| !x.is_empty() && *x != "*")
        .map(str::to_owned)
        .collect()
}

/// Split on commas that are not inside braces.
fn split_top(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut depth, mut start) = (0i32, 0);
    for (i, c) in s.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// `src` with comments, string and char literals replaced by spaces (line
/// breaks kept, so byte offsets and line numbers stay).
fn blank(src: &str) -> String {
    let b = src.as_bytes();
    let mut out = b.to_vec();
    let mut i = 0;
    let wipe = |out: &mut Vec<u8>, a: usize, z: usize| {
        for c in &mut out[a..z] {
            if *c != b'\n' {
                *c = b' ';
            }
        }
    };
    while i < b.len() {
        if b[i..].starts_with(b"//") {
            let e = src[i..].find('\n').map_or(b.len(), |e| i + e);
            wipe(&mut out, i, e);
            i = e;
        } else if b[i..].starts_with(b"/*") {
            let e = src[i + 2..].find("*/").map_or(b.len(), |e| i + 2 + e + 2);
            wipe(&mut out, i, e);
            i = e;
        } else if b[i] == b'r' && (i == 0 || !ident_char(b[i - 1])) && raw_string_at(b, i).is_some()
        {
            let hashes = raw_string_at(b, i).unwrap_or(0);
            let close = format!("\"{}", "#".repeat(hashes));
            let body = i + 2 + hashes;
            let e = src[body..]
                .find(&close)
                .map_or(b.len(), |e| body + e + close.len());
            wipe(&mut out, i, e);
            i = e;
        } else if b[i] == b'"' {
            let mut j = i + 1;
            while j < b.len() && b[j] != b'"' {
                j += if b[j] == b'\\' { 2 } else { 1 };
            }
            let e = (j + 1).min(b.len());
            wipe(&mut out, i, e);
            i = e;
        } else if b[i] == b'\'' {
            // A char literal ('a', '\n', '\u{..}'), not a lifetime ('a).
            let e = if b.get(i + 1) == Some(&b'\\') {
                src[i + 2..].find('\'').map(|e| i + 2 + e + 1)
            } else if b.get(i + 2) == Some(&b'\'') {
                Some(i + 3)
            } else {
                src[i + 1..]
                    .char_indices()
                    .nth(1)
                    .filter(|(_, c)| *c == '\'')
                    .map(|(k, _)| i + 1 + k + 1)
            };
            match e {
                Some(e) => {
                    wipe(&mut out, i, e);
                    i = e;
                }
                None => i += 1,
            }
        } else {
            i += 1;
        }
    }
    String::from_utf8(out).unwrap_or_default()
}

/// `r"` or `r#"` at `i`: the number of `#`.
fn raw_string_at(b: &[u8], i: usize) -> Option<usize> {
    let mut j = i + 1;
    while b.get(j) == Some(&b'#') {
        j += 1;
    }
    (b.get(j) == Some(&b'"')).then_some(j - i - 1)
}

/// Modules declared `#[cfg(test)] mod name;`: compiled for tests only.
fn test_modules(clean: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = clean[from..].find("#[cfg(test)]") {
        let start = from + at + 12;
        let item = clean[start..].trim_start();
        let item = item.strip_prefix("pub ").unwrap_or(item);
        if let Some(rest) = item.strip_prefix("mod ") {
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if rest[name.len()..].trim_start().starts_with(';') {
                out.push(name);
            }
        }
        from = start;
    }
    out
}

/// Byte ranges of `#[cfg(test)]` modules (the attribute to the closing brace).
fn test_ranges(clean: &str) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut from = 0;
    while let Some(at) = clean[from..].find("#[cfg(test)]") {
        let start = from + at;
        let after = &clean[start..];
        let item = after[12..].trim_start();
        let is_mod = item.starts_with("mod ") || item.starts_with("pub mod ");
        match after.find(['{', ';']) {
            Some(k) if is_mod && after.as_bytes()[k] == b'{' => {
                let end = matching(clean, start + k);
                out.push((start, end));
                from = end;
            }
            _ => from = start + 12,
        }
    }
    out
}

fn matching(s: &str, open: usize) -> usize {
    let mut depth = 0i32;
    for (k, c) in s[open..].char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return open + k + 1;
                }
            }
            _ => {}
        }
    }
    s.len()
}

/// Every function outside the test ranges: `(name, line, lines)`.
fn functions(clean: &str, tests: &[(usize, usize)]) -> Vec<(String, usize, usize)> {
    let mut out = Vec::new();
    let b = clean.as_bytes();
    let mut i = 0;
    while let Some(at) = clean[i..].find("fn ") {
        let start = i + at;
        i = start + 3;
        if start > 0 && ident_char(b[start - 1])
            || tests.iter().any(|(a, z)| (*a..*z).contains(&start))
        {
            continue;
        }
        let name: String = clean[start + 3..]
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if name.is_empty() {
            continue;
        }
        // The body: the first `{` before any `;` (a declaration has none).
        let Some(k) = clean[start..].find(['{', ';']) else {
            continue;
        };
        if b[start + k] == b';' {
            continue;
        }
        let end = matching(clean, start + k);
        let len = clean[start..end].matches('\n').count() + 1;
        out.push((name, clean[..start].matches('\n').count() + 1, len));
    }
    out
}

/// Every set of files that import each other in a loop (strongly connected
/// components of more than one file), each sorted, in order.
fn circles(n: usize, edges: &[(usize, usize)]) -> Vec<Vec<usize>> {
    let mut adj = vec![Vec::new(); n];
    for (a, b) in edges {
        adj[*a].push(*b);
    }
    // Tarjan's algorithm, iterative.
    let mut index = vec![usize::MAX; n];
    let mut low = vec![0; n];
    let mut on = vec![false; n];
    let mut stack = Vec::new();
    let mut next = 0;
    let mut out = Vec::new();
    for s in 0..n {
        if index[s] != usize::MAX {
            continue;
        }
        let mut work = vec![(s, 0usize)];
        index[s] = next;
        low[s] = next;
        next += 1;
        stack.push(s);
        on[s] = true;
        while let Some(&mut (v, ref mut k)) = work.last_mut() {
            if *k < adj[v].len() {
                let w = adj[v][*k];
                *k += 1;
                if index[w] == usize::MAX {
                    index[w] = next;
                    low[w] = next;
                    next += 1;
                    stack.push(w);
                    on[w] = true;
                    work.push((w, 0));
                } else if on[w] {
                    low[v] = low[v].min(index[w]);
                }
            } else {
                work.pop();
                if let Some(&(u, _)) = work.last() {
                    low[u] = low[u].min(low[v]);
                }
                if low[v] == index[v] {
                    let mut comp = Vec::new();
                    while let Some(w) = stack.pop() {
                        on[w] = false;
                        comp.push(w);
                        if w == v {
                            break;
                        }
                    }
                    if comp.len() > 1 {
                        comp.sort();
                        out.push(comp);
                    }
                }
            }
        }
    }
    out.sort();
    out
}
