//! Keeps docs/ARCHITECTURE.md true and the layering it describes real:
//!
//! - every crate root starts with a `//!` doc;
//! - the code map has a bullet for every crate, names only files and
//!   directories that exist, and names every top-level module of a crate;
//! - the `## Crate graph` table lists every workspace crate with exactly the
//!   workspace crates it depends on (as `cargo metadata` reports them), in
//!   layer order: nothing, dev-dependencies included, depends upward;
//! - no crate has a cycle among its source files (modules): one file's
//!   `crate::`/`super::`/`self::`/child-module paths point at another's, and
//!   the graph of those references has no strongly connected component
//!   bigger than one file;
//! - an ignored test is either long (in te-cli's tests, `tests/`, run by
//!   `cargo xtask test --long`) or a device test (elsewhere, run by
//!   `--gpu`), and says which: no test is ignored that neither runs.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

const ARCHITECTURE: &str = "docs/ARCHITECTURE.md";

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every crate directory: `crates/*` and `xtask`, relative to the root.
fn crate_dirs() -> Vec<String> {
    let mut dirs: Vec<String> = std::fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| e.unwrap())
        .filter(|e| e.path().join("Cargo.toml").exists())
        .map(|e| format!("crates/{}", e.file_name().into_string().unwrap()))
        .collect();
    dirs.sort();
    dirs.push("xtask".to_string());
    dirs
}

fn fail_all(what: &str, failures: &[String]) {
    if !failures.is_empty() {
        panic!(
            "{what}: {} problem(s)\n\n{}\n",
            failures.len(),
            failures.join("\n\n")
        );
    }
}

const LONG: &str = "#[ignore = \"long: cargo xtask test --long\"]";
const GPU: &str = "#[ignore = \"needs a CUDA GPU: cargo xtask test --gpu\"]";

#[test]
fn every_ignored_test_is_long_in_te_cli_or_a_device_test_elsewhere() {
    let mut files = Vec::new();
    rust_files(&root().join("tests"), &mut files);
    let long_files = files.len();
    for dir in crate_dirs() {
        rust_files(&root().join(dir), &mut files);
    }
    let mut failures = Vec::new();
    for (i, path) in files.iter().enumerate() {
        let want = if i < long_files { LONG } else { GPU };
        let text = std::fs::read_to_string(path).unwrap();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.starts_with("#[ignore") && line != want {
                failures.push(format!(
                    "{}:{}: `{line}`: an ignored test here reads `{want}`",
                    path.display(),
                    n + 1
                ));
            }
        }
    }
    fail_all("ignored tests", &failures);
}

#[test]
fn every_crate_root_starts_with_a_doc_comment() {
    let mut crates: Vec<PathBuf> = std::fs::read_dir(root().join("crates"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    crates.push(root().join("xtask"));
    for krate in crates {
        let lib = krate.join("src/lib.rs");
        let main = krate.join("src/main.rs");
        let path = if lib.exists() { lib } else { main };
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(
            text.starts_with("//!"),
            "{} has no `//!` crate doc",
            path.display()
        );
    }
}

#[test]
fn code_map_names_every_crate_and_only_files_that_exist() {
    let map = std::fs::read_to_string(root().join("docs/ARCHITECTURE.md")).unwrap();
    let bullets: Vec<&str> = map.split("\n- **`").skip(1).collect();
    for entry in std::fs::read_dir(root().join("crates")).unwrap() {
        let name = entry.unwrap().file_name().into_string().unwrap();
        let tag = format!("crates/{name}`**");
        assert!(
            bullets.iter().any(|b| b.starts_with(&tag)),
            "docs/ARCHITECTURE.md has no code-map entry for crates/{name}"
        );
    }
    for bullet in bullets.iter().filter(|b| b.starts_with("crates/")) {
        let krate = &bullet[..bullet.find('`').unwrap()];
        let mut files = Vec::new();
        rust_files(&root().join(krate).join("src"), &mut files);
        let names: Vec<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        // The bullet starts inside its tag's code span: code spans are the
        // even pieces.
        for (i, piece) in bullet.split('`').enumerate() {
            if i % 2 == 0 && piece.ends_with(".rs") {
                assert!(
                    names.iter().any(|n| n == piece),
                    "docs/ARCHITECTURE.md names {piece} under {krate}, which has no such file"
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Code map: directories exist, every top-level module is named.
// ---------------------------------------------------------------------------

/// Every directory under `dir` (recursively), by file name.
fn dir_names(dir: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            out.insert(path.file_name().unwrap().to_string_lossy().into_owned());
            dir_names(&path, out);
        }
    }
}

/// The code-map bullet of each crate: crate directory (`crates/te-cli`,
/// `xtask`) -> the bullet's text (after its opening "- **`").
fn crate_bullets(map: &str) -> BTreeMap<String, String> {
    let mut bullets = BTreeMap::new();
    for bullet in map.split("\n- **`").skip(1) {
        let Some(end) = bullet.find('`') else {
            continue;
        };
        let dir = bullet[..end].trim_end_matches('/');
        // A bullet ends at the blank line or heading after it.
        let end = [bullet.find("\n\n"), bullet.find("\n#")]
            .into_iter()
            .flatten()
            .min()
            .unwrap_or(bullet.len());
        if !dir.is_empty() && root().join(dir).join("Cargo.toml").exists() {
            bullets.insert(dir.to_string(), bullet[..end].to_string());
        }
    }
    bullets
}

#[test]
fn code_map_names_every_top_level_module_and_only_directories_that_exist() {
    let map = std::fs::read_to_string(root().join(ARCHITECTURE)).unwrap();
    let bullets = crate_bullets(&map);
    let mut failures = Vec::new();
    for krate in crate_dirs() {
        let Some(bullet) = bullets.get(&krate) else {
            failures.push(format!(
                "{ARCHITECTURE}'s code map has no bullet \"- **`{krate}`**\" for crate {krate}: \
                 add one to {ARCHITECTURE}"
            ));
            continue;
        };
        let src = root().join(&krate).join("src");
        let mut files = Vec::new();
        rust_files(&src, &mut files);
        let file_names: BTreeSet<String> = files
            .iter()
            .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
            .collect();
        let mut dirs = BTreeSet::new();
        dir_names(&src, &mut dirs);
        // The bullet starts inside its tag's code span (`crates/NAME`): code
        // spans are the even pieces, the tag itself left out.
        let tokens: BTreeSet<&str> = bullet
            .split('`')
            .enumerate()
            .filter(|(i, _)| i % 2 == 0 && *i > 0)
            .map(|(_, t)| t)
            .collect();

        // Named files and directories exist. (`.rs` names under crates/ are
        // checked by the test above; here the other crates' and every `dir/`.)
        for token in &tokens {
            let is_dir = token.ends_with('/') && token.len() > 1;
            let is_rs = token.ends_with(".rs") && !krate.starts_with("crates/");
            if !is_dir && !is_rs {
                continue;
            }
            let plain = token.trim_end_matches('/');
            let exists = if plain.contains('/') {
                // A path: from the workspace root, the crate or its src/.
                [root(), root().join(&krate), src.clone()]
                    .iter()
                    .any(|base| base.join(plain).exists())
            } else if is_dir {
                dirs.contains(plain)
            } else {
                file_names.contains(plain)
            };
            if !exists {
                let kind = if is_dir { "directory" } else { "file" };
                failures.push(format!(
                    "{ARCHITECTURE} names `{token}` under {krate}, which has no such {kind} \
                     in {krate}/src: fix {ARCHITECTURE}"
                ));
            }
        }

        // Every top-level module is named.
        for entry in std::fs::read_dir(&src).unwrap() {
            let path = entry.unwrap().path();
            let name = path.file_name().unwrap().to_string_lossy().into_owned();
            let module = if path.is_dir() {
                if !path.join("mod.rs").exists() {
                    continue;
                }
                format!("{name}/")
            } else if name.ends_with(".rs") && name != "lib.rs" && name != "main.rs" {
                name.clone()
            } else {
                continue;
            };
            if !tokens.contains(module.as_str()) {
                failures.push(format!(
                    "{ARCHITECTURE}'s code-map bullet for {krate} does not name its module \
                     `{module}` ({krate}/src/{name}): add it to {ARCHITECTURE}"
                ));
            }
        }
    }
    fail_all("code map vs. top-level modules", &failures);
}

// ---------------------------------------------------------------------------
// Crate graph: docs/ARCHITECTURE.md's table against `cargo metadata`.
// ---------------------------------------------------------------------------

/// One workspace package's dependencies on other workspace packages.
struct Package {
    name: String,
    normal: BTreeSet<String>,
    dev: BTreeSet<String>,
}

/// Workspace packages in `members` order, from `cargo metadata`.
fn workspace_packages() -> Vec<Package> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    let output = Command::new(&cargo)
        .args(["metadata", "--format-version", "1", "--no-deps"])
        .current_dir(root())
        .output()
        .unwrap_or_else(|e| panic!("cannot run `{cargo} metadata`: {e}"));
    assert!(
        output.status.success(),
        "`{cargo} metadata` failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let meta: Value = serde_json::from_slice(&output.stdout).unwrap();
    let members: Vec<&str> = meta["workspace_members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m.as_str().unwrap())
        .collect();
    let packages: Vec<&Value> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| members.contains(&p["id"].as_str().unwrap()))
        .collect();
    let names: BTreeSet<String> = packages
        .iter()
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect();
    let mut out = Vec::new();
    for id in &members {
        let p = packages
            .iter()
            .find(|p| p["id"].as_str() == Some(id))
            .unwrap();
        let mut package = Package {
            name: p["name"].as_str().unwrap().to_string(),
            normal: BTreeSet::new(),
            dev: BTreeSet::new(),
        };
        for dep in p["dependencies"].as_array().unwrap() {
            let name = dep["name"].as_str().unwrap();
            if !names.contains(name) {
                continue;
            }
            match dep["kind"].as_str() {
                None => package.normal.insert(name.to_string()),
                Some("dev") => package.dev.insert(name.to_string()),
                Some(_) => false, // build
            };
        }
        out.push(package);
    }
    out
}

/// The `## Crate graph` table: (crate, listed dependencies), row by row.
fn crate_graph_table(map: &str) -> Option<Vec<(String, Vec<String>)>> {
    let start = map.lines().position(|l| l.trim_end() == "## Crate graph")?;
    let mut rows = Vec::new();
    let mut header_seen = false;
    for line in map.lines().skip(start + 1) {
        if line.starts_with("## ") {
            break;
        }
        let line = line.trim();
        if !line.starts_with('|') {
            continue;
        }
        let cells: Vec<String> = line
            .trim_matches('|')
            .split('|')
            .map(|c| c.trim().replace('`', ""))
            .collect();
        if cells
            .iter()
            .all(|c| !c.is_empty() && c.chars().all(|ch| matches!(ch, '-' | ':' | ' ')))
        {
            continue; // |---|---|
        }
        if !header_seen {
            header_seen = true; // | crate | depends on |
            continue;
        }
        let deps = cells
            .get(1)
            .map(|c| {
                c.split(',')
                    .map(|d| d.trim().to_string())
                    .filter(|d| !d.is_empty())
                    .collect()
            })
            .unwrap_or_default();
        rows.push((cells[0].clone(), deps));
    }
    Some(rows)
}

/// The table the Cargo.toml files imply: a layer order (normal and dev
/// dependencies first, ties in `members` order) with each crate's normal
/// workspace dependencies in that order. `None` if there is no such order.
fn implied_table(packages: &[Package]) -> Option<String> {
    let mut placed: Vec<&Package> = Vec::new();
    while placed.len() < packages.len() {
        let next = packages.iter().find(|p| {
            !placed.iter().any(|q| q.name == p.name)
                && p.normal
                    .iter()
                    .chain(&p.dev)
                    .all(|d| placed.iter().any(|q| &q.name == d))
        })?;
        placed.push(next);
    }
    let mut table = String::from("## Crate graph\n\n| crate | depends on |\n|---|---|\n");
    for p in &placed {
        let deps: Vec<&str> = placed
            .iter()
            .filter(|q| p.normal.contains(&q.name))
            .map(|q| q.name.as_str())
            .collect();
        table.push_str(&format!("| {} | {} |\n", p.name, deps.join(", ")));
    }
    Some(table)
}

#[test]
fn crate_graph_in_architecture_matches_cargo_metadata() {
    let packages = workspace_packages();
    let map = std::fs::read_to_string(root().join(ARCHITECTURE)).unwrap();
    let implied = implied_table(&packages).unwrap_or_else(|| {
        "(none: the workspace dependencies, dev ones included, form a cycle)\n".to_string()
    });
    let Some(rows) = crate_graph_table(&map) else {
        panic!(
            "{ARCHITECTURE} has no `## Crate graph` section; the Cargo.toml files imply:\n\n\
             {implied}"
        );
    };
    let mut failures = crate_graph_failures(&rows, &packages);
    if !failures.is_empty() {
        failures.push(format!(
            "the table the Cargo.toml files imply (one valid layer order):\n\n{implied}"
        ));
    }
    fail_all("crate graph vs. Cargo.toml", &failures);
}

/// What is wrong with the table's `rows` against the packages' dependencies.
fn crate_graph_failures(rows: &[(String, Vec<String>)], packages: &[Package]) -> Vec<String> {
    let fix = format!("fix {ARCHITECTURE} or the crate's Cargo.toml");
    let mut failures = Vec::new();
    let row_of = |name: &str| rows.iter().position(|(c, _)| c == name);

    // (a) The table's crates are the workspace's packages.
    let mut seen = BTreeSet::new();
    for (krate, _) in rows {
        if !seen.insert(krate.as_str()) {
            failures.push(format!("crate graph: {krate} has more than one row: {fix}"));
        }
        if !packages.iter().any(|p| &p.name == krate) {
            failures.push(format!(
                "crate graph: {krate} has a row but is no workspace package: {fix}"
            ));
        }
    }
    for p in packages {
        if row_of(&p.name).is_none() {
            failures.push(format!(
                "crate graph: workspace package {} has no row: {fix}",
                p.name
            ));
        }
    }

    // (d) Each row lists only crates of earlier rows.
    for (i, (krate, deps)) in rows.iter().enumerate() {
        for dep in deps {
            match row_of(dep) {
                Some(j) if j < i => {}
                Some(_) => failures.push(format!(
                    "crate graph: the row of {krate} lists {dep}, whose row is not above it \
                     (rows go in layer order, lowest first): {fix}"
                )),
                None => failures.push(format!(
                    "crate graph: the row of {krate} lists {dep}, which has no row: {fix}"
                )),
            }
        }
    }

    for p in packages {
        let Some(i) = row_of(&p.name) else { continue };
        // (b) Normal dependencies are exactly the row's list.
        let listed: BTreeSet<String> = rows[i].1.iter().cloned().collect();
        for dep in p.normal.difference(&listed) {
            failures.push(format!(
                "crate graph: {} depends on {dep} (Cargo.toml [dependencies]) but its row \
                 does not list it: {fix}",
                p.name
            ));
        }
        for dep in listed.difference(&p.normal) {
            failures.push(format!(
                "crate graph: the row of {} lists {dep}, which is not among its \
                 [dependencies]: {fix}",
                p.name
            ));
        }
        // (c) Nothing depends upward, dev-dependencies included.
        for (dep, kind) in p
            .normal
            .iter()
            .map(|d| (d, "[dependencies]"))
            .chain(p.dev.iter().map(|d| (d, "[dev-dependencies]")))
        {
            match row_of(dep) {
                Some(j) if j < i => {}
                Some(_) => failures.push(format!(
                    "crate graph: {} depends upward on {dep} ({kind}): {dep}'s row is not \
                     above {}'s: {fix}",
                    p.name, p.name
                )),
                None => failures.push(format!(
                    "crate graph: {} depends on {dep} ({kind}), which has no row: {fix}",
                    p.name
                )),
            }
        }
    }
    failures
}

// ---------------------------------------------------------------------------
// Module cycles: a token-level reading of each crate's source files.
// ---------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq)]
enum Tok {
    Ident(String),
    /// `::`
    PathSep,
    Punct(char),
    /// A string, char or number literal, or a lifetime.
    Lit,
}

#[derive(Clone, Debug)]
struct Token {
    tok: Tok,
    line: usize,
}

fn is_ident_start(c: char) -> bool {
    c.is_alphabetic() || c == '_'
}

fn is_ident_char(c: char) -> bool {
    c.is_alphanumeric() || c == '_'
}

/// Rust source to tokens, without comments; literals become `Tok::Lit`.
fn lex(text: &str) -> Vec<Token> {
    let s: Vec<char> = text.chars().collect();
    let at = |i: usize| s.get(i).copied().unwrap_or('\0');
    let mut out = Vec::new();
    let mut line = 1;
    let mut i = 0;
    // Skips a quoted literal whose opening quote is at `i`; returns the index
    // after its closing quote.
    let skip_quoted = |mut i: usize, quote: char, line: &mut usize| -> usize {
        i += 1;
        while i < s.len() {
            match s[i] {
                '\\' => {
                    if at(i + 1) == '\n' {
                        *line += 1;
                    }
                    i += 2;
                }
                '\n' => {
                    *line += 1;
                    i += 1;
                }
                c if c == quote => return i + 1,
                _ => i += 1,
            }
        }
        i
    };
    while i < s.len() {
        let c = s[i];
        let start_line = line;
        if c == '\n' {
            line += 1;
            i += 1;
        } else if c.is_whitespace() {
            i += 1;
        } else if c == '/' && at(i + 1) == '/' {
            while i < s.len() && s[i] != '\n' {
                i += 1;
            }
        } else if c == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < s.len() {
                if s[i] == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if s[i] == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    if s[i] == '\n' {
                        line += 1;
                    }
                    i += 1;
                }
            }
        } else if is_ident_start(c) {
            // Raw strings r"..", r#".."#, br#".."#, cr".."; raw identifiers r#x;
            // byte and C strings b"..", c"..", byte chars b'.'.
            let raw_at = match (c, at(i + 1)) {
                ('r', _) => Some(i + 1),
                ('b' | 'c', 'r') => Some(i + 2),
                _ => None,
            };
            if let Some(mut j) = raw_at {
                let mut hashes = 0;
                while at(j) == '#' {
                    hashes += 1;
                    j += 1;
                }
                if at(j) == '"' {
                    j += 1;
                    loop {
                        if j >= s.len() {
                            break;
                        }
                        if s[j] == '"' && (1..=hashes).all(|k| at(j + k) == '#') {
                            j += 1 + hashes;
                            break;
                        }
                        if s[j] == '\n' {
                            line += 1;
                        }
                        j += 1;
                    }
                    out.push(Token {
                        tok: Tok::Lit,
                        line: start_line,
                    });
                    i = j;
                    continue;
                }
                if c == 'r' && hashes == 1 && is_ident_start(at(i + 2)) {
                    i += 2; // raw identifier: lexed below without its r#
                }
            }
            if (c == 'b' || c == 'c') && at(i + 1) == '"' {
                i = skip_quoted(i + 1, '"', &mut line);
                out.push(Token {
                    tok: Tok::Lit,
                    line: start_line,
                });
                continue;
            }
            if c == 'b' && at(i + 1) == '\'' {
                i = skip_quoted(i + 1, '\'', &mut line);
                out.push(Token {
                    tok: Tok::Lit,
                    line: start_line,
                });
                continue;
            }
            let begin = i;
            while i < s.len() && is_ident_char(s[i]) {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Ident(s[begin..i].iter().collect()),
                line: start_line,
            });
        } else if c.is_ascii_digit() {
            while i < s.len()
                && (is_ident_char(s[i]) || (s[i] == '.' && at(i + 1).is_ascii_digit()))
            {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Lit,
                line: start_line,
            });
        } else if c == '"' {
            i = skip_quoted(i, '"', &mut line);
            out.push(Token {
                tok: Tok::Lit,
                line: start_line,
            });
        } else if c == '\'' {
            if at(i + 1) == '\\' || (at(i + 2) == '\'' && at(i + 1) != '\'') {
                i = skip_quoted(i, '\'', &mut line); // char literal
            } else {
                i += 1; // lifetime or label
                while i < s.len() && is_ident_char(s[i]) {
                    i += 1;
                }
            }
            out.push(Token {
                tok: Tok::Lit,
                line: start_line,
            });
        } else if c == ':' && at(i + 1) == ':' {
            out.push(Token {
                tok: Tok::PathSep,
                line,
            });
            i += 2;
        } else {
            out.push(Token {
                tok: Tok::Punct(c),
                line,
            });
            i += 1;
        }
    }
    out
}

fn is_punct(t: Option<&Token>, c: char) -> bool {
    matches!(t, Some(Token { tok: Tok::Punct(p), .. }) if *p == c)
}

fn is_ident(t: Option<&Token>, name: &str) -> bool {
    matches!(t, Some(Token { tok: Tok::Ident(s), .. }) if s == name)
}

/// The index just after the bracket group opening at `i` (`(`, `[` or `{`).
fn skip_group(t: &[Token], mut i: usize) -> usize {
    let mut depth = 0usize;
    while i < t.len() {
        match t[i].tok {
            Tok::Punct('(' | '[' | '{') => depth += 1,
            Tok::Punct(')' | ']' | '}') => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return i + 1;
                }
            }
            _ => {}
        }
        i += 1;
    }
    i
}

/// Drops every item marked `#[cfg(test)]` (`mod tests { .. }`, test-only
/// `use`s and functions): the item ends at its first `;` or at the end of its
/// first `{ .. }` block, whichever comes first (or before the `}` that closes
/// the block around it).
fn strip_cfg_test(t: Vec<Token>) -> Vec<Token> {
    let cfg_test = |i: usize| {
        is_punct(t.get(i), '#')
            && is_punct(t.get(i + 1), '[')
            && is_ident(t.get(i + 2), "cfg")
            && is_punct(t.get(i + 3), '(')
            && is_ident(t.get(i + 4), "test")
            && is_punct(t.get(i + 5), ')')
            && is_punct(t.get(i + 6), ']')
    };
    let mut out = Vec::new();
    let mut i = 0;
    while i < t.len() {
        if !cfg_test(i) {
            out.push(t[i].clone());
            i += 1;
            continue;
        }
        i += 7;
        while i < t.len() {
            match t[i].tok {
                Tok::Punct(';') => {
                    i += 1;
                    break;
                }
                Tok::Punct('{') => {
                    i = skip_group(&t, i);
                    break;
                }
                Tok::Punct('(' | '[') => i = skip_group(&t, i),
                Tok::Punct('}') => break, // the enclosing block's end: kept
                _ => i += 1,
            }
        }
    }
    out
}

/// Parses the path (or `use` tree) whose first segment is at `i`; pushes
/// every full path it names (`a::{b, c::D}` gives `a::b` and `a::c::D`).
/// Returns the index after it.
fn parse_paths(
    t: &[Token],
    mut i: usize,
    prefix: Vec<String>,
    out: &mut Vec<Vec<String>>,
) -> usize {
    let mut segs = prefix;
    loop {
        match t.get(i).map(|x| &x.tok) {
            Some(Tok::Ident(s)) => {
                segs.push(s.clone());
                i += 1;
            }
            Some(Tok::Punct('*')) => {
                out.push(segs);
                return i + 1;
            }
            Some(Tok::Punct('{')) => {
                i += 1;
                while i < t.len() && !is_punct(t.get(i), '}') {
                    i = parse_paths(t, i, segs.clone(), out);
                    // Past `as name` and such, to the next `,` or `}`.
                    while i < t.len() && !is_punct(t.get(i), ',') && !is_punct(t.get(i), '}') {
                        i += 1;
                    }
                    if is_punct(t.get(i), ',') {
                        i += 1;
                    }
                }
                return i + 1;
            }
            _ => {
                out.push(segs);
                return i;
            }
        }
        if t.get(i).map(|x| &x.tok) == Some(&Tok::PathSep) {
            i += 1;
        } else {
            out.push(segs);
            return i;
        }
    }
}

/// One source file of a crate, as a module.
struct ModFile {
    /// Relative to the crate directory: `src/cuda/ops.rs`.
    rel: String,
    tokens: Vec<Token>,
}

/// A reference from one file to another module's file.
struct Reference {
    target: Vec<String>,
    text: String,
    line: usize,
}

fn module_path(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap();
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    let last = parts.pop().unwrap();
    let stem = last.trim_end_matches(".rs");
    let is_root = parts.is_empty() && (stem == "lib" || stem == "main");
    if stem != "mod" && !is_root {
        parts.push(stem.to_string());
    }
    parts
}

/// The references one file makes to other modules of its crate, resolved
/// to the longest module prefix that is a file.
fn references(
    module: &[String],
    tokens: &[Token],
    modules: &BTreeMap<Vec<String>, ModFile>,
    reexports: &BTreeMap<String, Vec<String>>,
) -> Vec<Reference> {
    let t = tokens;
    // `mod child;` declarations at the top level of the file.
    let mut children = BTreeSet::new();
    let mut depth = 0usize;
    for i in 0..t.len() {
        match t[i].tok {
            Tok::Punct('{') => depth += 1,
            Tok::Punct('}') => depth = depth.saturating_sub(1),
            Tok::Ident(ref m) if m == "mod" && depth == 0 => {
                if let (
                    Some(Token {
                        tok: Tok::Ident(name),
                        ..
                    }),
                    true,
                ) = (t.get(i + 1), is_punct(t.get(i + 2), ';'))
                {
                    children.insert(name.clone());
                }
            }
            _ => {}
        }
    }

    let mut out = Vec::new();
    // Inline modules (`mod name { .. }`): (name, brace depth inside it).
    let mut inline: Vec<(String, usize)> = Vec::new();
    let mut depth = 0usize;
    let mut i = 0;
    while i < t.len() {
        match &t[i].tok {
            Tok::Punct('{') => {
                depth += 1;
                if let (
                    true,
                    Some(Token {
                        tok: Tok::Ident(name),
                        ..
                    }),
                ) = (
                    is_ident(t.get(i.wrapping_sub(2)), "mod"),
                    t.get(i.wrapping_sub(1)),
                ) {
                    inline.push((name.clone(), depth));
                }
                i += 1;
                continue;
            }
            Tok::Punct('}') => {
                if inline.last().is_some_and(|(_, d)| *d == depth) {
                    inline.pop();
                }
                depth = depth.saturating_sub(1);
                i += 1;
                continue;
            }
            Tok::Ident(first) => {
                let prev = i.checked_sub(1).and_then(|p| t.get(p));
                let mid_path = matches!(
                    prev,
                    Some(Token {
                        tok: Tok::PathSep,
                        ..
                    })
                ) || is_punct(prev, '.');
                let starts = matches!(first.as_str(), "crate" | "super" | "self")
                    || (inline.is_empty() && children.contains(first));
                let sep_next = matches!(
                    t.get(i + 1),
                    Some(Token {
                        tok: Tok::PathSep,
                        ..
                    })
                );
                if mid_path || !starts || !sep_next {
                    i += 1;
                    continue;
                }
                let line = t[i].line;
                let mut paths = Vec::new();
                let next = parse_paths(t, i, Vec::new(), &mut paths);
                let here: Vec<String> = module
                    .iter()
                    .cloned()
                    .chain(inline.iter().map(|(n, _)| n.clone()))
                    .collect();
                for segs in paths {
                    let mut full: Vec<String> = match segs[0].as_str() {
                        "crate" => Vec::new(),
                        "super" | "self" => here.clone(),
                        _ => module.to_vec(), // a declared child
                    };
                    for (k, seg) in segs.iter().enumerate() {
                        match seg.as_str() {
                            "crate" if k == 0 => {}
                            "super" => {
                                full.pop();
                            }
                            "self" => {}
                            _ => full.push(seg.clone()),
                        }
                    }
                    let mut target = (0..=full.len())
                        .rev()
                        .map(|n| full[..n].to_vec())
                        .find(|p| modules.contains_key(p))
                        .unwrap_or_default();
                    // `crate::Name` where the root re-exports `Name` from a
                    // module: a reference to that module.
                    if target.is_empty() {
                        if let Some(m) = full.first().and_then(|n| reexports.get(n)) {
                            target = m.clone();
                        }
                    }
                    if target.is_empty() || target == module {
                        continue;
                    }
                    out.push(Reference {
                        target,
                        text: segs
                            .strip_suffix(&["self".to_string()])
                            .unwrap_or(&segs)
                            .join("::"),
                        line,
                    });
                }
                i = next.max(i + 1);
                continue;
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// The names the crate root re-exports from its modules (`pub use
/// engine::{Engine, EngineConfig};`), each with the module it comes from.
fn root_reexports(modules: &BTreeMap<Vec<String>, ModFile>) -> BTreeMap<String, Vec<String>> {
    let mut out = BTreeMap::new();
    let Some(root) = modules.get(&Vec::new()) else {
        return out;
    };
    let t = &root.tokens;
    for i in 0..t.len() {
        if !(is_ident(t.get(i), "pub") && is_ident(t.get(i + 1), "use")) {
            continue;
        }
        let mut paths = Vec::new();
        parse_paths(t, i + 2, Vec::new(), &mut paths);
        for segs in paths {
            let segs: Vec<String> = segs
                .into_iter()
                .filter(|s| s != "crate" && s != "self")
                .collect();
            let Some((name, path)) = segs.split_last() else {
                continue;
            };
            let module = (1..=path.len())
                .rev()
                .map(|n| path[..n].to_vec())
                .find(|p| modules.contains_key(p));
            if let Some(module) = module {
                out.insert(name.clone(), module);
            }
        }
    }
    out
}

/// Strongly connected components (Tarjan) of a graph over `0..n`.
fn tarjan(n: usize, edges: &[Vec<usize>]) -> Vec<Vec<usize>> {
    struct State<'a> {
        edges: &'a [Vec<usize>],
        index: Vec<Option<usize>>,
        low: Vec<usize>,
        on_stack: Vec<bool>,
        stack: Vec<usize>,
        next: usize,
        out: Vec<Vec<usize>>,
    }
    fn visit(s: &mut State, v: usize) {
        s.index[v] = Some(s.next);
        s.low[v] = s.next;
        s.next += 1;
        s.stack.push(v);
        s.on_stack[v] = true;
        for k in 0..s.edges[v].len() {
            let w = s.edges[v][k];
            match s.index[w] {
                None => {
                    visit(s, w);
                    s.low[v] = s.low[v].min(s.low[w]);
                }
                Some(iw) if s.on_stack[w] => s.low[v] = s.low[v].min(iw),
                _ => {}
            }
        }
        if Some(s.low[v]) == s.index[v] {
            let mut component = Vec::new();
            loop {
                let w = s.stack.pop().unwrap();
                s.on_stack[w] = false;
                component.push(w);
                if w == v {
                    break;
                }
            }
            component.sort();
            s.out.push(component);
        }
    }
    let mut s = State {
        edges,
        index: vec![None; n],
        low: vec![0; n],
        on_stack: vec![false; n],
        stack: Vec::new(),
        next: 0,
        out: Vec::new(),
    };
    for v in 0..n {
        if s.index[v].is_none() {
            visit(&mut s, v);
        }
    }
    s.out
}

/// Every module cycle of one crate, as a failure message.
fn module_cycles(krate: &str) -> Vec<String> {
    let src = root().join(krate).join("src");
    let mut files = Vec::new();
    rust_files(&src, &mut files);
    files.sort();
    let mut modules: BTreeMap<Vec<String>, ModFile> = BTreeMap::new();
    for file in &files {
        let module = module_path(&src, file);
        let rel = format!("src/{}", file.strip_prefix(&src).unwrap().to_string_lossy());
        // lib.rs wins over main.rs as the root of a crate with both.
        if module.is_empty() && modules.contains_key(&module) && !rel.ends_with("lib.rs") {
            continue;
        }
        let text = std::fs::read_to_string(file).unwrap();
        let tokens = strip_cfg_test(lex(&text));
        modules.insert(module, ModFile { rel, tokens });
    }
    let reexports = root_reexports(&modules);
    let keys: Vec<Vec<String>> = modules.keys().cloned().collect();
    let node = |m: &[String]| keys.iter().position(|k| k == m).unwrap();
    // (from, to) -> the first reference seen.
    let mut edges: BTreeMap<(usize, usize), Reference> = BTreeMap::new();
    for (module, file) in &modules {
        if module.is_empty() {
            continue; // the crate root declares and re-exports everything
        }
        for r in references(module, &file.tokens, &modules, &reexports) {
            edges.entry((node(module), node(&r.target))).or_insert(r);
        }
    }
    let mut adjacency = vec![Vec::new(); keys.len()];
    for &(from, to) in edges.keys() {
        adjacency[from].push(to);
    }
    let mut failures = Vec::new();
    for component in tarjan(keys.len(), &adjacency) {
        if component.len() < 2 {
            continue;
        }
        let rel = |v: usize| modules[&keys[v]].rel.as_str();
        let names: Vec<&str> = component.iter().map(|&v| rel(v)).collect();
        let mut message = format!(
            "module cycle in {krate}: {} (break it: move what both sides need into one \
             module the others use, so references point one way)",
            names.join(", ")
        );
        for ((from, to), r) in &edges {
            if component.contains(from) && component.contains(to) {
                message.push_str(&format!(
                    "\n    {krate}/{} -> {krate}/{}: \"{}\" (line {})",
                    rel(*from),
                    rel(*to),
                    r.text,
                    r.line
                ));
            }
        }
        failures.push(message);
    }
    failures
}

#[test]
fn no_module_cycle_inside_any_crate() {
    let mut failures = Vec::new();
    for krate in crate_dirs() {
        if root().join(&krate).join("src").is_dir() {
            failures.extend(module_cycles(&krate));
        }
    }
    fail_all("module cycles", &failures);
}

#[test]
fn module_reference_parser_reads_use_trees_and_skips_comments_strings_and_tests() {
    let text = r##"
//! crate::doc::Comment
use crate::{a::{self, B}, b::C as D};
use super::*;
/* crate::block::Comment /* nested */ crate::still::Comment */
fn f() -> &'static str {
    let _ = crate::c::d::E::new();
    let _ = child::X;
    let _ = 'x';
    let _ = "crate::string::Literal";
    r#"crate::raw::"String"#
}
mod child;
#[cfg(test)]
mod tests {
    use crate::test_only::X;
}
"##;
    let module = vec!["m".to_string(), "n".to_string()];
    let mut modules = BTreeMap::new();
    for m in [
        vec![],
        vec!["a"],
        vec!["b"],
        vec!["c"],
        vec!["c", "d"],
        vec!["m"],
        vec!["m", "n"],
        vec!["m", "n", "child"],
        vec!["doc"],
        vec!["block"],
        vec!["still"],
        vec!["string"],
        vec!["raw"],
        vec!["test_only"],
    ] {
        let key: Vec<String> = m.iter().map(|s| s.to_string()).collect();
        modules.insert(
            key,
            ModFile {
                rel: String::new(),
                tokens: Vec::new(),
            },
        );
    }
    let tokens = strip_cfg_test(lex(text));
    let found: Vec<(String, String)> = references(&module, &tokens, &modules, &BTreeMap::new())
        .into_iter()
        .map(|r| (r.target.join("::"), r.text))
        .collect();
    let expected: Vec<(String, String)> = [
        ("a", "crate::a"),
        ("a", "crate::a::B"),
        ("b", "crate::b::C"),
        ("m", "super"),
        ("c::d", "crate::c::d::E::new"),
        ("m::n::child", "child::X"),
    ]
    .iter()
    .map(|(a, b)| (a.to_string(), b.to_string()))
    .collect();
    assert_eq!(found, expected);
}

#[test]
fn crate_graph_check_reads_the_table_and_reports_each_kind_of_mismatch() {
    let map = "# A\n\n## Crate graph\n\nIntro.\n\n| crate | depends on |\n|---|---|\n\
               | `a` | |\n| b | a |\n| c | a, d |\n| d | b |\n\n## Next\n\n| x | y |\n";
    let rows = crate_graph_table(map).unwrap();
    let expected: Vec<(String, Vec<String>)> = vec![
        ("a".into(), vec![]),
        ("b".into(), vec!["a".into()]),
        ("c".into(), vec!["a".into(), "d".into()]),
        ("d".into(), vec!["b".into()]),
    ];
    assert_eq!(rows, expected);
    let package = |name: &str, normal: &[&str], dev: &[&str]| Package {
        name: name.to_string(),
        normal: normal.iter().map(|s| s.to_string()).collect(),
        dev: dev.iter().map(|s| s.to_string()).collect(),
    };
    let packages = [
        package("a", &[], &["b"]),
        package("b", &["a"], &[]),
        package("c", &["a", "e"], &[]),
        package("d", &[], &[]),
        package("e", &[], &[]),
    ];
    let failures = crate_graph_failures(&rows, &packages);
    let has = |needle: &str| failures.iter().any(|f| f.contains(needle));
    assert!(has("workspace package e has no row"), "{failures:#?}");
    assert!(
        has("the row of c lists d, whose row is not above it"),
        "{failures:#?}"
    );
    assert!(has(
        "c depends on e (Cargo.toml [dependencies]) but its row does not list it"
    ));
    assert!(has(
        "the row of c lists d, which is not among its [dependencies]"
    ));
    assert!(has(
        "the row of d lists b, which is not among its [dependencies]"
    ));
    assert!(has("a depends upward on b ([dev-dependencies])"));
    assert!(has("c depends on e ([dependencies]), which has no row"));
    assert!(failures
        .iter()
        .all(|f| f.contains("fix docs/ARCHITECTURE.md or")));
    assert_eq!(failures.len(), 7, "{failures:#?}");
    let good = [package("a", &[], &[]), package("b", &["a"], &["a"])];
    let rows: Vec<(String, Vec<String>)> =
        vec![("a".into(), vec![]), ("b".into(), vec!["a".into()])];
    assert!(crate_graph_failures(&rows, &good).is_empty());
    assert_eq!(
        implied_table(&[package("b", &["a"], &[]), package("a", &[], &[])]).unwrap(),
        "## Crate graph\n\n| crate | depends on |\n|---|---|\n| a |  |\n| b | a |\n"
    );
}

#[test]
fn tarjan_finds_each_cycle_once() {
    // 0 -> 1 -> 2 -> 0, 2 -> 3, 3 -> 4 -> 3, 5 alone.
    let edges = vec![vec![1], vec![2], vec![0, 3], vec![4], vec![3], vec![]];
    let mut cycles: Vec<Vec<usize>> = tarjan(6, &edges)
        .into_iter()
        .filter(|c| c.len() > 1)
        .collect();
    cycles.sort();
    assert_eq!(cycles, vec![vec![0, 1, 2], vec![3, 4]]);
}
