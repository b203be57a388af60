//! The environment-variable registries (`<crate>/src/env_vars.rs`) checked against themselves, against
//! docs/environment.md, and against the variable names each crate's own source spells out.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The binary crate's registry (a module of `main.rs`, so not importable as a library).
#[path = "../src/env_vars.rs"]
#[allow(dead_code)]
mod hvd_env_vars;

type Table = &'static [(&'static str, &'static str, &'static str)];

/// One crate: its name as docs/environment.md heads its table, its registry, where its non-test code lives, and the
/// crates it builds on (a name it spells out may be theirs: the command line names the builder's `HVD_PYTHON`).
struct Crate {
    name: &'static str,
    registry: &'static str,
    all: Table,
    sources: &'static [&'static str],
    deps: &'static [&'static str],
}

const CRATES: &[Crate] = &[
    Crate {
        name: "hvd",
        registry: "src/env_vars.rs",
        all: hvd_env_vars::ALL,
        sources: &["src"],
        deps: &[
            "hvd-lang",
            "hvd-resolver",
            "hvd-builder",
            "hvd-launcher",
            "hvd-collective",
            "hvd-runtime",
        ],
    },
    Crate {
        name: "hvd-lang",
        registry: "lang/src/env_vars.rs",
        all: hvd_lang::env_vars::ALL,
        sources: &["lang/src"],
        deps: &[],
    },
    Crate {
        name: "hvd-resolver",
        registry: "resolver/src/env_vars.rs",
        all: hvd_resolver::env_vars::ALL,
        sources: &["resolver/src"],
        deps: &["hvd-lang"],
    },
    Crate {
        name: "hvd-builder",
        registry: "builder/src/env_vars.rs",
        all: hvd_builder::env_vars::ALL,
        sources: &["builder/src"],
        deps: &["hvd-resolver", "hvd-lang"],
    },
    Crate {
        name: "hvd-launcher",
        registry: "launcher/src/env_vars.rs",
        all: hvd_launcher::env_vars::ALL,
        sources: &["launcher/src"],
        deps: &["hvd-collective", "hvd-lang"],
    },
    Crate {
        name: "hvd-collective",
        registry: "collective/src/env_vars.rs",
        all: hvd_collective::env_vars::ALL,
        sources: &["collective/src"],
        deps: &[],
    },
    Crate {
        name: "hvd-runtime",
        registry: "collective/runtime/src/env_vars.rs",
        all: hvd_runtime::env_vars::ALL,
        sources: &["collective/runtime/src", "collective/python"],
        deps: &["hvd-collective"],
    },
];

/// Names that look like variables but are not ones: the source or the docs may spell them without a registry.
const NOT_VARIABLES: &[(&str, &str)] = &[
    (
        "HVD_BATCH_SCRIPT_END",
        "the heredoc delimiter of sbatch's submit script",
    ),
    (
        "HVD_WHEEL",
        "the build driver's `HVD_WHEEL=<name>` line in the build log",
    ),
    (
        "HVD_HOOK",
        "the build driver's `HVD_HOOK=<hook> of <backend>` line in the build log (which hook failed)",
    ),
    (
        "HVD_METADATA",
        "the build driver's `HVD_METADATA=<name>.dist-info` line in the build log",
    ),
    (
        "MPI_THREAD_MULTIPLE",
        "an MPI thread level the python package names",
    ),
    ("HVD_BIN", "read by the benchmark scripts under bench/ only"),
    (
        "HVD_RUN_ARGS",
        "read by the benchmark scripts under bench/ only",
    ),
    (
        "HVD_HOSTS_ENV",
        "read by bench/allreduce_hosts.sh only (extra environment of its ranks across namespaces)",
    ),
    (
        "HVD_HOROVOD_TESTS",
        "read by the opt-in harness scripts/horovod_suites.py only (a local copy of Horovod's test suites)",
    ),
    ("HVD_TEST_PYTHON", "read by tests only"),
    ("HVD_TEST_TORCH", "read by tests only"),
    (
        "HVD_TEST_REAL_STORE",
        "read by tests only: the opt-in era tests reuse this store (docs/eras.md)",
    ),
    ("HVD_TEST_JAX", "read by tests only"),
    ("HVD_TEST_TENSORFLOW", "read by tests only"),
    (
        "HVD_TEST_WHEELS",
        "read by tests only: the opt-in real-wheels unpack test (builder/tests/real_wheels.rs)",
    ),
    (
        "HOROVOD_WITH_GLOO",
        "a Horovod build variable the launcher reads from the recipe's `build.env` (the model), not its environment",
    ),
    (
        "HOROVOD_WITHOUT_GLOO",
        "a Horovod build variable the launcher reads from the recipe's `build.env` (the model), not its environment",
    ),
    (
        "HOROVOD_WITH_MPI",
        "a Horovod build variable the launcher reads from the recipe's `build.env` (the model), not its environment",
    ),
    (
        "HOROVOD_WITHOUT_MPI",
        "a Horovod build variable the launcher reads from the recipe's `build.env` (the model), not its environment",
    ),
];

/// The names the C ABI declares (`collective/runtime/include/hvd.h`: `NAME = value` enum constants and `#define`s):
/// not variables.
fn c_abi_names() -> BTreeSet<String> {
    let header = read(&root().join("collective/runtime/include/hvd.h"));
    let mut names = BTreeSet::new();
    for (at, _) in header.match_indices("HVD_") {
        let word: String = header[at..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        let after = header[at + word.len()..].trim_start_matches(' ');
        let assigned = after.starts_with('=') && !after.starts_with("==");
        if assigned || header[..at].ends_with("#define ") {
            names.insert(word);
        }
    }
    names
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn crate_named(name: &str) -> &'static Crate {
    CRATES
        .iter()
        .find(|c| c.name == name)
        .unwrap_or_else(|| panic!("no crate {name}"))
}

/// `(identifier, value)` of every variable a registry's text declares in its `hvd_env_vars::env_vars!` block
/// (`NAME;`, `NAME default "..";` or `NAME = "VALUE" ..;`: the value is the name unless written).
fn declared_constants(text: &str) -> Vec<(String, String)> {
    let Some((_, block)) = text.split_once("hvd_env_vars::env_vars! {") else {
        return Vec::new();
    };
    block
        .lines()
        .take_while(|line| !line.starts_with('}'))
        .filter_map(|line| {
            let line = line.trim().strip_suffix(';')?;
            let ident = line.split([' ', '=']).next()?;
            if ident.is_empty()
                || !ident
                    .bytes()
                    .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_')
            {
                return None;
            }
            let value = match line[ident.len()..].trim_start().strip_prefix("= \"") {
                Some(rest) => rest.split_once('"')?.0.to_owned(),
                None => ident.to_owned(),
            };
            Some((ident.to_owned(), value))
        })
        .collect()
}

/// How docs/environment.md writes a registered name: a prefix (`HOROVOD_`) as a family (`HOROVOD_*`).
fn doc_name(name: &str) -> String {
    if name.ends_with('_') {
        format!("{name}*")
    } else {
        name.to_owned()
    }
}

#[test]
fn every_registry_lists_each_constant_once() {
    let mut problems = Vec::new();
    for c in CRATES {
        let consts = declared_constants(&read(&root().join(c.registry)));
        let mut values = BTreeSet::new();
        for (ident, value) in &consts {
            if !values.insert(value.as_str()) {
                problems.push(format!("{}: `{value}` is declared twice", c.registry));
            }
            let expected = if value.ends_with('_') {
                format!("{}PREFIX", value)
            } else {
                value.clone()
            };
            if *ident != expected {
                problems.push(format!(
                    "{}: the constant for `{value}` is `{ident}`; name it `{expected}`",
                    c.registry
                ));
            }
        }
        let mut listed: BTreeMap<&str, usize> = BTreeMap::new();
        for (name, _, meaning) in c.all {
            *listed.entry(name).or_default() += 1;
            if meaning.trim().is_empty() {
                problems.push(format!("{}: `{name}` has no meaning in `ALL`", c.registry));
            }
        }
        for (name, n) in &listed {
            if *n != 1 {
                problems.push(format!("{}: `{name}` is in `ALL` {n} times", c.registry));
            }
            if !values.contains(name) {
                problems.push(format!(
                    "{}: `{name}` is in `ALL` but has no constant",
                    c.registry
                ));
            }
        }
        for value in &values {
            if !listed.contains_key(value) {
                problems.push(format!("{}: `{value}` is missing from `ALL`", c.registry));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// docs/environment.md's tables: crate name (the `## NAME: ...` heading) -> `(variable, default)` rows.
fn documented(text: &str) -> BTreeMap<String, Vec<(String, String)>> {
    let mut tables: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    let mut current: Option<String> = None;
    for line in text.lines() {
        if let Some(heading) = line.strip_prefix("## ") {
            let name = heading
                .split(':')
                .next()
                .unwrap_or(heading)
                .trim()
                .to_owned();
            tables.entry(name.clone()).or_default();
            current = Some(name);
            continue;
        }
        let Some(row) = line.strip_prefix("| `") else {
            continue;
        };
        let (name, rest) = row.split_once('`').expect("a row's name is in backticks");
        let default = rest
            .trim_start_matches([' ', '|'])
            .split(" | ")
            .next()
            .unwrap_or_default()
            .trim();
        let default = match default {
            "—" => String::new(),
            d => d
                .strip_prefix('`')
                .and_then(|d| d.strip_suffix('`'))
                .unwrap_or_else(|| panic!("docs/environment.md: the default of `{name}` is neither `—` nor in backticks"))
                .to_owned(),
        };
        let crate_name = current.clone().unwrap_or_else(|| {
            panic!("docs/environment.md: `{name}` is listed before any crate's heading")
        });
        tables
            .entry(crate_name)
            .or_default()
            .push((name.to_owned(), default));
    }
    tables
}

#[test]
fn docs_list_exactly_the_registered_variables() {
    let docs = "docs/environment.md";
    let tables = documented(&read(&root().join(docs)));
    let mut problems = Vec::new();
    for c in CRATES {
        let Some(rows) = tables.get(c.name) else {
            problems.push(format!(
                "{docs}: no `## {}: ...` section (for {})",
                c.name, c.registry
            ));
            continue;
        };
        let registered: BTreeMap<String, &str> =
            c.all.iter().map(|(n, d, _)| (doc_name(n), *d)).collect();
        let mut seen = BTreeSet::new();
        for (name, default) in rows {
            if !seen.insert(name) {
                problems.push(format!("{docs}: `{name}` is listed twice under {}", c.name));
            }
            match registered.get(name) {
                None => problems.push(format!(
                    "{docs}: `{name}` is documented under {} but not registered in {}",
                    c.name, c.registry
                )),
                Some(d) if d != default => problems.push(format!(
                    "{docs}: `{name}` under {} has default `{default}`, but {} says `{d}`",
                    c.name, c.registry
                )),
                Some(_) => {}
            }
        }
        for name in registered.keys() {
            if !seen.contains(name) {
                problems.push(format!(
                    "{docs}: `{name}` (registered in {}) is missing from the {} table",
                    c.registry, c.name
                ));
            }
        }
    }
    for name in tables.keys() {
        if !CRATES.iter().any(|c| c.name == name) {
            problems.push(format!(
                "{docs}: a section for `{name}`, which is no crate here"
            ));
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every `HVD_*` name (or `HVD_X_*` family) in the prose of the docs is a registered variable, a name of the C ABI
/// or a known non-variable: a renamed or removed variable cannot stay documented anywhere.
#[test]
fn docs_name_no_unregistered_hvd_variable() {
    let c_abi = c_abi_names();
    let registered: BTreeSet<&str> = CRATES
        .iter()
        .flat_map(|c| c.all.iter().map(|(n, _, _)| *n))
        .chain(NOT_VARIABLES.iter().map(|(n, _)| *n))
        .chain(c_abi.iter().map(String::as_str))
        .collect();
    let mut files = vec![root().join("README.md"), root().join("ARCHITECTURE.md")];
    for entry in std::fs::read_dir(root().join("docs")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "md") {
            files.push(path);
        }
    }
    let mut problems = Vec::new();
    for file in files {
        let text = read(&file);
        for (token, family) in uppercase_tokens(&text) {
            if !token.starts_with("HVD_") {
                continue;
            }
            let known = if family {
                let prefix = format!("{token}_");
                registered.iter().any(|n| n.starts_with(&prefix))
            } else {
                registered.contains(token.as_str())
            };
            if !known {
                problems.push(format!(
                    "{}: `{token}{}` is no registered variable",
                    file.strip_prefix(root()).unwrap().display(),
                    if family { "_*" } else { "" }
                ));
            }
        }
    }
    problems.dedup();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every maximal word of `text` made of `A-Z`, `0-9` and `_` that starts with a letter and contains `_` (trailing
/// `_` trimmed), with whether it is written as a family (`NAME_*`).
fn uppercase_tokens(text: &str) -> Vec<(String, bool)> {
    let bytes = text.as_bytes();
    let word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut out = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        if !word(bytes[i]) {
            i += 1;
            continue;
        }
        let start = i;
        while i < bytes.len() && word(bytes[i]) {
            i += 1;
        }
        let w = &text[start..i];
        let upper = w
            .bytes()
            .all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
        if upper && w.as_bytes()[0].is_ascii_uppercase() && w.contains('_') {
            let trimmed = w.trim_end_matches('_');
            let family = w.ends_with('_') && bytes.get(i) == Some(&b'*');
            if trimmed.contains('_') || w.ends_with('_') {
                out.push((trimmed.to_owned(), family || w.ends_with('_')));
            }
        }
    }
    out
}

/// The string literals of Rust source `text` (contents, escapes kept), without comments and without the
/// compile-time `env!`/`option_env!` names. Source after the first `#[cfg(test)]` module is left out: clippy's
/// `items_after_test_module` keeps a crate's test module last in its file.
fn rust_literals(text: &str) -> Vec<String> {
    let code = shipped_rust(text);
    let b = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'/' if b.get(i + 1) == Some(&b'/') => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
            }
            b'/' if b.get(i + 1) == Some(&b'*') => {
                i += 2;
                while i + 1 < b.len() && !(b[i] == b'*' && b[i + 1] == b'/') {
                    i += 1;
                }
                i += 2;
            }
            b'\'' => {
                // A char literal ('"', '\'', 'x') is skipped; a lifetime is not a literal.
                if b.get(i + 1) == Some(&b'\\') {
                    i += 2;
                    while i < b.len() && b[i] != b'\'' {
                        i += 1;
                    }
                    i += 1;
                } else if b.get(i + 2) == Some(&b'\'') {
                    i += 3;
                } else {
                    i += 1;
                }
            }
            b'r' if (b.get(i + 1) == Some(&b'"') || b.get(i + 1) == Some(&b'#'))
                && (i == 0 || !(b[i - 1].is_ascii_alphanumeric() || b[i - 1] == b'_')) =>
            {
                let mut j = i + 1;
                while b.get(j) == Some(&b'#') {
                    j += 1;
                }
                if b.get(j) != Some(&b'"') {
                    i += 1;
                    continue;
                }
                let hashes = j - i - 1;
                let close: String = format!("\"{}", "#".repeat(hashes));
                let start = j + 1;
                let end = code[start..].find(&close).map_or(b.len(), |n| start + n);
                out.push(code[start..end].to_owned());
                i = end + close.len();
            }
            b'"' => {
                let start = i + 1;
                let mut j = start;
                while j < b.len() && b[j] != b'"' {
                    j += if b[j] == b'\\' { 2 } else { 1 };
                }
                let before = code[..i].trim_end();
                if !(before.ends_with("env!(") || before.ends_with("option_env!(")) {
                    out.push(code[start..j.min(b.len())].to_owned());
                }
                i = j + 1;
            }
            _ => i += 1,
        }
    }
    out
}

/// Rust source `text` up to its `#[cfg(test)]` module (clippy's `items_after_test_module` keeps that last).
fn shipped_rust(text: &str) -> String {
    let mut lines = text.lines().peekable();
    let mut code = String::new();
    while let Some(line) = lines.next() {
        if line.trim() == "#[cfg(test)]"
            && lines.peek().is_some_and(|next| {
                let next = next.trim_start();
                next.starts_with("mod ")
                    || next.starts_with("pub mod ")
                    || next.starts_with("#[path")
            })
        {
            break;
        }
        code.push_str(line);
        code.push('\n');
    }
    code
}

/// The string literals of Python source `text` (single or double quoted, one line each; comments left out).
fn python_literals(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in text.lines() {
        let b = line.as_bytes();
        let mut i = 0;
        while i < b.len() {
            match b[i] {
                b'#' => break,
                q @ (b'"' | b'\'') => {
                    let start = i + 1;
                    let mut j = start;
                    while j < b.len() && b[j] != q {
                        j += if b[j] == b'\\' { 2 } else { 1 };
                    }
                    out.push(line[start..j.min(b.len())].to_owned());
                    i = j + 1;
                }
                _ => i += 1,
            }
        }
    }
    out
}

/// Every source file of a crate that ships (not `tests.rs` files or `tests/` folders), `.rs` and `.py`.
fn source_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    for path in entries {
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if name != "tests" && name != "__pycache__" {
                source_files(&path, out);
            }
        } else if (name.ends_with(".rs") && name != "tests.rs") || name.ends_with(".py") {
            out.push(path);
        }
    }
}

/// The names a crate may spell out: its own registry's and those of the crates it builds on (transitively).
fn visible_names(c: &Crate) -> BTreeSet<&'static str> {
    let mut names = BTreeSet::new();
    let mut todo = vec![c];
    let mut done = BTreeSet::new();
    while let Some(c) = todo.pop() {
        if !done.insert(c.name) {
            continue;
        }
        names.extend(c.all.iter().map(|(n, _, _)| *n));
        todo.extend(c.deps.iter().map(|d| crate_named(d)));
    }
    names
}

/// A word in a crate's string literals that names a variable: any `HVD_*` or `HOROVOD_*` word, and any other word
/// whose first part (`SLURM` of `SLURM_PROCID`) starts a variable some registry lists (the families hvd reads or
/// sets), unless it is a known non-variable. The word must be registered by the crate or one it builds on.
#[test]
fn sources_name_only_registered_variables() {
    let families: BTreeSet<&str> = CRATES
        .iter()
        .flat_map(|c| c.all.iter())
        .filter_map(|(n, _, _)| n.split_once('_').map(|(first, _)| first))
        .collect();
    let c_abi = c_abi_names();
    let not_variables: BTreeSet<&str> = NOT_VARIABLES
        .iter()
        .map(|(n, _)| *n)
        .chain(c_abi.iter().map(String::as_str))
        .collect();
    let mut problems = Vec::new();
    let mut scanned = 0;
    for c in CRATES {
        let visible = visible_names(c);
        let mut files = Vec::new();
        for dir in c.sources {
            source_files(&root().join(dir), &mut files);
        }
        for file in files {
            let text = read(&file);
            let literals = if file.extension().is_some_and(|e| e == "py") {
                python_literals(&text)
            } else {
                rust_literals(&text)
            };
            scanned += 1;
            for literal in literals {
                for (token, prefix) in uppercase_tokens(&literal) {
                    let first = token.split('_').next().unwrap_or_default();
                    let ours = first == "HVD" || first == "HOROVOD";
                    if !(ours || families.contains(first)) || not_variables.contains(token.as_str())
                    {
                        continue;
                    }
                    let known = if prefix {
                        let p = format!("{token}_");
                        visible.iter().any(|n| n.starts_with(&p))
                    } else {
                        visible.contains(token.as_str())
                    };
                    if !known {
                        problems.push(format!(
                            "{}: `{token}{}` is not in {} (nor in the registry of a crate it builds on)",
                            file.strip_prefix(root()).unwrap().display(),
                            if prefix { "_" } else { "" },
                            c.registry
                        ));
                    }
                }
            }
        }
    }
    assert!(scanned > 100, "only {scanned} source files found");
    problems.sort();
    problems.dedup();
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// Every registered variable is named somewhere in its crate's shipped code besides the registry (as the constant,
/// or in a string: a generated script, a message): a variable the code stopped using leaves the registry too.
#[test]
fn every_registered_variable_is_used_by_its_crate() {
    let mut problems = Vec::new();
    for c in CRATES {
        let mut files = Vec::new();
        for dir in c.sources {
            source_files(&root().join(dir), &mut files);
        }
        let mut code = String::new();
        for file in files.iter().filter(|f| !f.ends_with(c.registry)) {
            let text = read(file);
            let (text, comment) = if file.extension().is_some_and(|e| e == "py") {
                (text, "#")
            } else {
                (shipped_rust(&text), "//")
            };
            for line in text
                .lines()
                .filter(|l| !l.trim_start().starts_with(comment))
            {
                code.push_str(line);
                code.push('\n');
            }
        }
        let words: BTreeSet<&str> = code
            .split(|ch: char| !(ch.is_ascii_alphanumeric() || ch == '_'))
            .collect();
        for (name, _, _) in c.all {
            let used = if name.ends_with('_') {
                code.contains(name)
            } else {
                words.contains(name)
            };
            if !used {
                problems.push(format!(
                    "{}: `{name}` is registered but no shipped code of {} names it",
                    c.registry, c.name
                ));
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// The scanners find what they must and skip comments, test modules and compile-time names.
#[test]
fn the_c_abi_names_are_read_from_its_header() {
    let names = c_abi_names();
    for name in ["HVD_FLOAT32", "HVD_SUM", "HVD_ALLREDUCE", "HVD_H"] {
        assert!(names.contains(name), "{name} not in {names:?}");
    }
    assert!(
        !names.contains("HVD_RANK"),
        "a variable named in a comment is no declaration"
    );
}

#[test]
fn the_scanners_see_literals_not_comments() {
    let rust = concat!(
        "// \"HVD_IN_COMMENT\"\n",
        "let c = '\"'; let x = \"HVD_A is `HVD_B`\";\n",
        "let r = r#\"export HVD_C=\"$x\"\"#; let v = env!(\"CARGO_PKG_VERSION\");\n",
        "#[cfg(test)]\nmod tests { const T: &str = \"HVD_IN_TEST\"; }\n",
    );
    let literals = rust_literals(rust);
    let tokens: Vec<String> = literals
        .iter()
        .flat_map(|l| uppercase_tokens(l))
        .map(|(t, _)| t)
        .collect();
    assert_eq!(tokens, ["HVD_A", "HVD_B", "HVD_C"], "{literals:?}");
    let python = "x = os.environ.get('HVD_P')  # \"HVD_NOT\"\ny = \"a HOROVOD_Q b\"\n";
    let tokens: Vec<String> = python_literals(python)
        .iter()
        .flat_map(|l| uppercase_tokens(l))
        .map(|(t, _)| t)
        .collect();
    assert_eq!(tokens, ["HVD_P", "HOROVOD_Q"]);
    assert_eq!(
        uppercase_tokens("`HVD_SPARK_*` and HOROVOD_ and Bad_Name"),
        [("HVD_SPARK".to_owned(), true), ("HOROVOD".to_owned(), true)]
    );
}
