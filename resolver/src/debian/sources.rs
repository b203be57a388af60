//! The machine's apt sources: the `deb` sources of `main` for an architecture, in apt's one-line and deb822 formats.

use std::path::{Path, PathBuf};

use super::stanzas;

/// `(URI, suite)` of every `deb` source with component `main` for `arch`: `sources.list` and the `*.list`
/// (one-line) and `*.sources` (deb822) files of `sources.list.d/`; other files there are ignored, as apt does.
/// Each with its `Signed-By` keyring when that names a file.
pub(super) fn read_apt_sources(apt: &Path, arch: &str) -> Vec<(String, String, Option<PathBuf>)> {
    let mut files = vec![apt.join("sources.list")];
    if let Ok(dir) = std::fs::read_dir(apt.join("sources.list.d")) {
        let mut more: Vec<PathBuf> = dir.filter_map(|e| e.ok().map(|e| e.path())).collect();
        more.sort();
        files.extend(more);
    }
    let mut out = Vec::new();
    for file in files {
        let format = file.extension().and_then(|e| e.to_str());
        if !matches!(format, Some("list" | "sources")) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&file) else {
            continue;
        };
        if format == Some("sources") {
            out.extend(deb822_sources(&text, arch));
        } else {
            out.extend(one_line_sources(&text, arch));
        }
    }
    out.retain(|(url, _, _)| url.starts_with("http://") || url.starts_with("https://"));
    out
}

/// Whether a source with `arch=` (`only`) and `arch-=` (`removed`) option values serves `arch`.
fn serves_arch(only: Option<&str>, removed: Option<&str>, arch: &str) -> bool {
    let has = |list: &str| list.split([',', ' ', '\t']).any(|a| a == arch);
    only.is_none_or(has) && !removed.is_some_and(has)
}

/// A `Signed-By` value that names a keyring file (an inline key block is not read: the default keyring applies).
fn keyring_path(value: Option<&str>) -> Option<PathBuf> {
    let value = value?.trim();
    (value.starts_with('/') && !value.contains(char::is_whitespace)).then(|| PathBuf::from(value))
}

fn one_line_sources(text: &str, arch: &str) -> Vec<(String, String, Option<PathBuf>)> {
    let mut out = Vec::new();
    for line in text.lines() {
        let line = line.split('#').next().unwrap_or("").trim();
        let Some(rest) = line
            .strip_prefix("deb")
            .filter(|r| r.starts_with([' ', '\t']))
        else {
            continue;
        };
        let rest = rest.trim_start();
        let (options, rest) = match rest.strip_prefix('[') {
            Some(inner) => match inner.split_once(']') {
                Some((options, rest)) => (options, rest),
                None => continue,
            },
            None => ("", rest),
        };
        let option = |key: &str| {
            options
                .split_whitespace()
                .find_map(|o| o.strip_prefix(key)?.strip_prefix('='))
        };
        if !serves_arch(option("arch"), option("arch-"), arch) {
            continue;
        }
        let words: Vec<&str> = rest.split_whitespace().collect();
        if let [uri, suite, components @ ..] = words.as_slice()
            && components.contains(&"main")
        {
            out.push((
                uri.trim_end_matches('/').to_string(),
                suite.to_string(),
                keyring_path(option("signed-by")),
            ));
        }
    }
    out
}

fn deb822_sources(text: &str, arch: &str) -> Vec<(String, String, Option<PathBuf>)> {
    let mut out = Vec::new();
    for stanza in stanzas(text) {
        let field = |key: &str| {
            stanza
                .iter()
                .find(|(k, _)| k.eq_ignore_ascii_case(key))
                .map(|(_, v)| v.as_str())
        };
        let get = |key: &str| field(key).unwrap_or("");
        if !get("Types").split_whitespace().any(|t| t == "deb")
            || !get("Components").split_whitespace().any(|c| c == "main")
            || get("Enabled").trim().eq_ignore_ascii_case("no")
            || !serves_arch(field("Architectures"), field("Architectures-Remove"), arch)
        {
            continue;
        }
        for uri in get("URIs").split_whitespace() {
            for suite in get("Suites").split_whitespace() {
                out.push((
                    uri.trim_end_matches('/').to_string(),
                    suite.to_string(),
                    keyring_path(field("Signed-By")),
                ));
            }
        }
    }
    out
}
