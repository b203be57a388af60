//! A gcc the host lacks, pinned from Debian's archive: which archive (the machine's apt sources), which suite has
//! `gcc-N`, the suite's `Packages` index (checked against its `InRelease`), and the closure of `.deb`s that
//! compiles and links C and C++, each recorded with its sha256 (docs/eras.md, "Toolchains").
//!
//! Everything read here is hostile input: the `InRelease` and `Packages` texts are parsed within size limits, the
//! `Packages` file must have the sha256 `InRelease` lists, and a `Filename` that is not a plain relative path
//! under `pool/` ending in `.deb` is refused before it reaches a lockfile.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::digest::Sha256;
use crate::env_vars::{HVD_DEBIAN_ARCHIVE, HVD_DEBIAN_KEYRING, HVD_DEBIAN_SUITES};
use crate::index::error_chain;
use crate::lockfile::{DebPin, DebianSource, ToolchainPin};

mod sources;

use sources::read_apt_sources;

/// Debian's releases, oldest first: the suites searched after the machine's own (its suite, then older ones, then
/// newer ones: an older suite's compiler runs on a newer glibc, not the other way round).
pub const RELEASES: &[&str] = &[
    "stretch", "buster", "bullseye", "bookworm", "trixie", "forky", "sid",
];

/// Packages not followed in a closure: `libc-dev-bin` (ldd and friends) and `libnsl-dev` (NIS/RPC, and through
/// `libtirpc` all of Kerberos) are `libc6-dev` dependencies a C/C++ compile never uses.
const NOT_FOLLOWED: &[&str] = &["libc-dev-bin", "libnsl-dev"];

/// The keyring an archive's `InRelease` must be signed by when its source names none (`Signed-By`).
pub const DEFAULT_KEYRING: &str = "/usr/share/keyrings/debian-archive-keyring.gpg";

/// The most bytes of an `InRelease` file (Debian's are about 150 KB).
const MAX_RELEASE_BYTES: u64 = 16 << 20;
/// The most bytes of a compressed `Packages` file (Debian's are about 15 MB) and of its decompressed text.
const MAX_PACKAGES_BYTES: u64 = 256 << 20;
const MAX_PACKAGES_TEXT: u64 = 1 << 30;

/// A machine architecture as Debian names it (`Packages` of `binary-<name>`) and its multiarch triplet (the folder
/// of its libraries, `usr/lib/<triplet>`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DebianArch {
    pub name: &'static str,
    pub triplet: &'static str,
    /// `std::env::consts::ARCH` of a machine of this architecture.
    pub rust: &'static str,
}

/// The architectures hvd takes a gcc from Debian for.
pub const DEBIAN_ARCHES: &[DebianArch] = &[
    DebianArch {
        name: "amd64",
        triplet: "x86_64-linux-gnu",
        rust: "x86_64",
    },
    DebianArch {
        name: "arm64",
        triplet: "aarch64-linux-gnu",
        rust: "aarch64",
    },
];

impl DebianArch {
    /// The Debian architecture of a machine whose `std::env::consts::ARCH` is `rust`.
    pub fn of_rust(rust: &str) -> Result<DebianArch, DebianError> {
        DEBIAN_ARCHES
            .iter()
            .find(|a| a.rust == rust)
            .copied()
            .ok_or_else(|| DebianError::UnsupportedArch {
                arch: rust.to_string(),
            })
    }

    /// This machine's.
    pub fn host() -> Result<DebianArch, DebianError> {
        DebianArch::of_rust(std::env::consts::ARCH)
    }

    /// The architecture Debian calls `name` (`amd64`, `arm64`).
    pub fn named(name: &str) -> Option<DebianArch> {
        DEBIAN_ARCHES.iter().find(|a| a.name == name).copied()
    }
}

/// Why a toolchain could not be pinned from Debian.
#[derive(Debug, thiserror::Error)]
pub enum DebianError {
    #[error(
        "no Debian archive configured: no `deb` source with component `main` in /etc/apt/sources.list or \
         /etc/apt/sources.list.d/, and HVD_DEBIAN_ARCHIVE is not set"
    )]
    NoArchive,
    #[error("failed to fetch `{url}`: {message}")]
    Fetch { url: String, message: String },
    #[error(
        "`{url}` is not in hvd's cache and `--offline` forbids the network; run once without `--offline`"
    )]
    Offline { url: String },
    #[error("`{url}`: {message}")]
    Invalid { url: String, message: String },
    #[error(
        "no suite of the Debian archive `{archive}` has `gcc-{version}` (looked in {searched}); \
         install gcc {version} on this machine or choose a version one of them has{found}"
    )]
    NotFound {
        archive: String,
        version: String,
        searched: String,
        found: String,
    },
    #[error(
        "gcc {version} from Debian {suite} needs glibc {needs} to run, and this machine has glibc {host}; \
         install gcc {version} on this machine or use an older gcc"
    )]
    GlibcTooOld {
        version: String,
        suite: String,
        needs: String,
        host: String,
    },
    #[error("gcc {version} from Debian {suite}: {message}")]
    Closure {
        version: String,
        suite: String,
        message: String,
    },
    #[error(
        "hvd takes a gcc from Debian only for x86_64 (amd64) and aarch64 (arm64) machines, and this one is {arch}; \
         install the gcc version on this machine"
    )]
    UnsupportedArch { arch: String },
    #[error("{name}=`{value}`: {message}; fix or unset it")]
    BadVariable {
        name: String,
        value: String,
        message: String,
    },
    #[error(transparent)]
    Io(#[from] std::io::Error),
}

/// Where to look: archive base URLs (each without a trailing `/`) and suites, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Archives {
    pub urls: Vec<String>,
    pub suites: Vec<String>,
    /// The keyring each archive's `InRelease` must be signed by (its source's `Signed-By`); [`DEFAULT_KEYRING`] for
    /// one not listed.
    pub keyrings: HashMap<String, PathBuf>,
}

impl Archives {
    /// From `HVD_DEBIAN_ARCHIVE` / `HVD_DEBIAN_SUITES` (checked like the lock reader checks `[toolchain] debian`),
    /// else the machine's apt sources for this machine's architecture.
    pub fn discover() -> Result<Archives, DebianError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let mut archives = Archives::discover_in(
            Path::new("/etc/apt"),
            var(HVD_DEBIAN_ARCHIVE),
            var(HVD_DEBIAN_SUITES),
            DebianArch::host()?.name,
        )?;
        if let (Some(url), Some(keyring)) = (archives.urls.first(), var(HVD_DEBIAN_KEYRING))
            && var(HVD_DEBIAN_ARCHIVE).is_some()
        {
            archives
                .keyrings
                .insert(url.clone(), PathBuf::from(keyring));
        }
        Ok(archives)
    }

    /// The keyring `url`'s `InRelease` must be signed by.
    pub fn keyring(&self, url: &str) -> PathBuf {
        self.keyrings
            .get(url)
            .cloned()
            .unwrap_or_else(|| PathBuf::from(DEFAULT_KEYRING))
    }

    fn discover_in(
        apt: &Path,
        archive_var: Option<String>,
        suites_var: Option<String>,
        arch: &str,
    ) -> Result<Archives, DebianError> {
        let bad = |name: &str, value: &str, message: String| DebianError::BadVariable {
            name: name.to_string(),
            value: value.to_string(),
            message,
        };
        let sources = read_apt_sources(apt, arch);
        let urls = match archive_var {
            Some(url) => {
                let url = url.trim().trim_end_matches('/').to_string();
                check_archive(&url).map_err(|m| bad(HVD_DEBIAN_ARCHIVE, &url, m))?;
                vec![url]
            }
            None => {
                let mut urls = Vec::new();
                for (url, _, _) in &sources {
                    if !urls.contains(url) {
                        urls.push(url.clone());
                    }
                }
                urls
            }
        };
        let suites = match suites_var {
            Some(list) => {
                let suites: Vec<String> = list
                    .split(',')
                    .map(|s| s.trim().to_string())
                    .filter(|s| !s.is_empty())
                    .collect();
                for suite in &suites {
                    check_suite(suite).map_err(|m| bad(HVD_DEBIAN_SUITES, &list, m))?;
                }
                suites
            }
            None => search_order(sources.iter().map(|(_, suite, _)| suite.as_str())),
        };
        let mut keyrings = HashMap::new();
        for (url, _, signed_by) in sources {
            if let Some(keyring) = signed_by {
                keyrings.entry(url).or_insert(keyring);
            }
        }
        Ok(Archives {
            urls,
            suites,
            keyrings,
        })
    }
}

/// An archive URL as a lock may name it: `http(s)://`, a URL.
pub(crate) fn check_archive(url: &str) -> Result<(), String> {
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        return Err(format!(
            "debian archive `{}` is not an http(s) URL",
            url.escape_debug()
        ));
    }
    reqwest::Url::parse(url)
        .map(|_| ())
        .map_err(|e| format!("debian archive `{}` is not a URL: {e}", url.escape_debug()))
}

/// A suite name as a lock may hold it: `[A-Za-z0-9._-]`, not empty.
pub(crate) fn check_suite(suite: &str) -> Result<(), String> {
    if suite.is_empty()
        || !suite
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-._".contains(c))
    {
        return Err(format!(
            "debian suite `{}` has characters outside `[A-Za-z0-9._-]`",
            suite.escape_debug()
        ));
    }
    Ok(())
}

/// The machine's suites that are Debian releases, then the older releases (newest first), then the newer ones.
fn search_order<'a>(host_suites: impl Iterator<Item = &'a str>) -> Vec<String> {
    let host: Vec<usize> = host_suites
        .filter_map(|s| RELEASES.iter().position(|r| *r == s))
        .collect();
    let start = host.iter().copied().max().unwrap_or(RELEASES.len() - 1);
    let mut order: Vec<usize> = vec![start];
    order.extend((0..start).rev());
    order.extend(start + 1..RELEASES.len());
    order.into_iter().map(|i| RELEASES[i].to_string()).collect()
}

/// Control-file stanzas (`Key: value` with continuation lines; `#` comments), each as its fields in order.
fn stanzas(text: &str) -> Vec<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut current: Vec<(String, String)> = Vec::new();
    for line in text.lines() {
        if line.trim().is_empty() {
            if !current.is_empty() {
                out.push(std::mem::take(&mut current));
            }
            continue;
        }
        if line.starts_with('#') {
            continue;
        }
        if line.starts_with([' ', '\t']) {
            if let Some((_, value)) = current.last_mut() {
                value.push('\n');
                value.push_str(line.trim());
            }
            continue;
        }
        if let Some((key, value)) = line.split_once(':') {
            current.push((key.trim().to_string(), value.trim().to_string()));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// The signed text of a clearsigned `InRelease` (or a plain `Release`).
fn release_body(text: &str) -> &str {
    let Some(rest) = text.strip_prefix("-----BEGIN PGP SIGNED MESSAGE-----") else {
        return text;
    };
    // Armor headers end at the first empty line.
    let body = rest.split_once("\n\n").map(|(_, b)| b).unwrap_or("");
    body.split("\n-----BEGIN PGP SIGNATURE-----")
        .next()
        .unwrap_or("")
}

/// The `SHA256` entries of a Release file: path -> (sha256, size).
fn release_sha256(body: &str) -> HashMap<String, (String, u64)> {
    let mut out = HashMap::new();
    for stanza in stanzas(body) {
        for (key, value) in stanza {
            if key != "SHA256" {
                continue;
            }
            for line in value.lines() {
                let words: Vec<&str> = line.split_whitespace().collect();
                if let [hash, size, path] = words.as_slice()
                    && let Ok(size) = size.parse()
                {
                    out.insert(path.to_string(), (hash.to_ascii_lowercase(), size));
                }
            }
        }
    }
    out
}

/// One binary package of a `Packages` index.
#[derive(Debug, Clone)]
struct Package {
    name: String,
    version: String,
    depends: String,
    provides: Vec<String>,
    filename: String,
    size: u64,
    sha256: String,
}

/// Parse a `Packages` index: each package's newest version; provides map.
fn parse_packages(text: &str) -> HashMap<String, Package> {
    let mut out: HashMap<String, Package> = HashMap::new();
    for stanza in stanzas(text) {
        let get = |key: &str| {
            stanza
                .iter()
                .find(|(k, _)| k == key)
                .map(|(_, v)| v.clone())
                .unwrap_or_default()
        };
        let mut depends = get("Pre-Depends");
        let more = get("Depends");
        if !more.is_empty() {
            if !depends.is_empty() {
                depends.push_str(", ");
            }
            depends.push_str(&more);
        }
        let package = Package {
            name: get("Package"),
            version: get("Version"),
            depends,
            provides: get("Provides")
                .split(',')
                .map(|p| p.split_whitespace().next().unwrap_or("").to_string())
                .filter(|p| !p.is_empty())
                .collect(),
            filename: get("Filename"),
            size: get("Size").parse().unwrap_or(0),
            sha256: get("SHA256").to_ascii_lowercase(),
        };
        if package.name.is_empty() {
            continue;
        }
        match out.get(&package.name) {
            Some(old) if compare_versions(&old.version, &package.version).is_ge() => {}
            _ => {
                out.insert(package.name.clone(), package);
            }
        }
    }
    out
}

/// dpkg's version order (`epoch:upstream-revision`, `~` before everything, letters before other characters).
pub fn compare_versions(a: &str, b: &str) -> std::cmp::Ordering {
    fn split(v: &str) -> (u64, &str, &str) {
        let (epoch, rest) = match v.split_once(':') {
            Some((e, r)) if e.chars().all(|c| c.is_ascii_digit()) => (e.parse().unwrap_or(0), r),
            _ => (0, v),
        };
        match rest.rsplit_once('-') {
            Some((up, rev)) => (epoch, up, rev),
            None => (epoch, rest, ""),
        }
    }
    fn order(c: Option<u8>) -> i32 {
        match c {
            None => 0,
            Some(b'~') => -1,
            Some(c) if c.is_ascii_alphabetic() => c as i32,
            Some(c) => c as i32 + 256,
        }
    }
    fn part(a: &str, b: &str) -> std::cmp::Ordering {
        let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
        while !a.is_empty() || !b.is_empty() {
            // Non-digit prefixes, character by character.
            loop {
                let ca = a.first().copied().filter(|c| !c.is_ascii_digit());
                let cb = b.first().copied().filter(|c| !c.is_ascii_digit());
                if ca.is_none() && cb.is_none() {
                    break;
                }
                let (oa, ob) = (order(ca), order(cb));
                if oa != ob {
                    return oa.cmp(&ob);
                }
                a = &a[1..];
                b = &b[1..];
            }
            let digits = |s: &[u8]| s.iter().take_while(|c| c.is_ascii_digit()).count();
            let (na, nb) = (digits(a), digits(b));
            let trim =
                |s: &[u8]| -> Vec<u8> { s.iter().copied().skip_while(|c| *c == b'0').collect() };
            let (da, db) = (trim(&a[..na]), trim(&b[..nb]));
            let ord = da.len().cmp(&db.len()).then(da.cmp(&db));
            if ord.is_ne() {
                return ord;
            }
            a = &a[na..];
            b = &b[nb..];
        }
        std::cmp::Ordering::Equal
    }
    let (ea, ua, ra) = split(a);
    let (eb, ub, rb) = split(b);
    ea.cmp(&eb).then(part(ua, ub)).then(part(ra, rb))
}

/// Does `version` satisfy `op wanted` (`<<`, `<=`, `=`, `>=`, `>>`)?
fn satisfies(version: &str, op: &str, wanted: &str) -> bool {
    let ord = compare_versions(version, wanted);
    match op {
        "<<" | "<" => ord.is_lt(),
        "<=" => ord.is_le(),
        "=" => ord.is_eq(),
        ">=" => ord.is_ge(),
        ">>" | ">" => ord.is_gt(),
        _ => false,
    }
}

/// One alternative of a dependency: name, and an optional `(op, version)`.
fn parse_alternative(text: &str) -> Option<(String, Option<(String, String)>)> {
    let text = text.trim();
    let (name, constraint) = match text.split_once('(') {
        Some((n, c)) => (n.trim(), Some(c.trim_end_matches(')').trim())),
        None => (text.split_whitespace().next().unwrap_or(""), None),
    };
    // Architecture qualifiers (`:any`) and restriction lists (`[amd64]`, `<!nocheck>`) do not matter here.
    let name = name.split([':', ' ', '[', '<']).next()?.to_string();
    if name.is_empty() {
        return None;
    }
    let constraint = constraint.and_then(|c| {
        let op: String = c.chars().take_while(|c| "<=>".contains(*c)).collect();
        let version = c[op.len()..].trim().to_string();
        (!op.is_empty() && !version.is_empty()).then_some((op, version))
    });
    Some((name, constraint))
}

/// A `Filename` hvd will fetch: relative, under `pool/`, plain components, ending in `.deb`.
fn check_filename(filename: &str) -> Result<(), &'static str> {
    if !filename.starts_with("pool/") || !filename.ends_with(".deb") {
        return Err("is not a `.deb` under `pool/`");
    }
    if filename
        .split('/')
        .any(|part| part.is_empty() || part == "." || part == "..")
    {
        return Err("has an empty, `.` or `..` component");
    }
    if !filename
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._+-~".contains(c))
    {
        return Err("has characters outside `[A-Za-z0-9/._+~-]`");
    }
    Ok(())
}

/// The closure of `roots` in `index`: every package (by name) a C/C++ compile with gcc needs.
fn closure(
    index: &HashMap<String, Package>,
    roots: &[String],
) -> Result<BTreeMap<String, Package>, String> {
    let mut providers: HashMap<&str, Vec<&Package>> = HashMap::new();
    for package in index.values() {
        for name in &package.provides {
            providers.entry(name.as_str()).or_default().push(package);
        }
    }
    for list in providers.values_mut() {
        list.sort_by(|a, b| a.name.cmp(&b.name));
    }
    let mut chosen: BTreeMap<String, Package> = BTreeMap::new();
    let mut stack: Vec<(String, String)> = roots
        .iter()
        .map(|r| (r.clone(), "(requested)".to_string()))
        .collect();
    let mut pending_roots: BTreeSet<String> = roots.iter().cloned().collect();
    while let Some((name, _)) = stack.pop() {
        if chosen.contains_key(&name) {
            continue;
        }
        let package = index
            .get(&name)
            .ok_or_else(|| format!("the suite has no package `{name}`"))?;
        pending_roots.remove(&name);
        chosen.insert(name.clone(), package.clone());
        for dependency in package.depends.split(',').filter(|d| !d.trim().is_empty()) {
            let alternatives: Vec<_> = dependency
                .split('|')
                .filter_map(parse_alternative)
                .collect();
            if alternatives
                .iter()
                .any(|(n, _)| NOT_FOLLOWED.contains(&n.as_str()))
            {
                continue;
            }
            let ok = |p: &Package, constraint: &Option<(String, String)>| match constraint {
                Some((op, v)) => satisfies(&p.version, op, v),
                None => true,
            };
            let mut pick = None;
            for (alt, constraint) in &alternatives {
                if let Some(p) = chosen.get(alt).or_else(|| index.get(alt))
                    && ok(p, constraint)
                {
                    pick = Some(p.name.clone());
                    break;
                }
                // A virtual package: any provider (an unversioned Provides satisfies no versioned dependency).
                if constraint.is_none()
                    && let Some(p) = providers.get(alt.as_str()).and_then(|l| l.first())
                {
                    pick = Some(p.name.clone());
                    break;
                }
            }
            let pick = pick.ok_or_else(|| {
                format!(
                    "`{}` depends on `{}`, which no package of the suite satisfies",
                    package.name,
                    dependency.trim()
                )
            })?;
            stack.push((pick, package.name.clone()));
        }
    }
    Ok(chosen)
}

/// Upstream part of a Debian version: `2:2.31-13+deb11u1` -> `2.31`.
fn upstream(version: &str) -> &str {
    let v = version.split_once(':').map(|(_, r)| r).unwrap_or(version);
    v.rsplit_once('-').map(|(u, _)| u).unwrap_or(v)
}

/// Reads the archive over HTTP with a cache of `Packages` files by sha256.
struct Reader {
    http: reqwest::Client,
    cache: PathBuf,
    offline: bool,
    /// `gpgv` on PATH: when present, every Release must carry a valid signature from its source's keyring.
    gpgv: Option<PathBuf>,
}

impl Reader {
    fn new(cache_dir: &Path, offline: bool) -> Result<Reader, DebianError> {
        let mut roots = Vec::new();
        if let Some(bundle) = crate::pip_config::discover_ca_bundle() {
            let pem = fs_err::read(&bundle)?;
            roots = reqwest::Certificate::from_pem_bundle(&pem).unwrap_or_default();
        }
        let http = crate::index::client_builder(roots)
            .timeout(Duration::from_secs(600))
            .build()
            .map_err(|err| DebianError::Fetch {
                url: String::new(),
                message: error_chain(&err),
            })?;
        let gpgv = std::env::var_os("PATH").and_then(|path| {
            std::env::split_paths(&path)
                .map(|dir| dir.join("gpgv"))
                .find(|p| p.is_file())
        });
        if gpgv.is_none() {
            tracing::warn!(
                "gpgv is not on PATH: the Debian archive's Release files are used without checking their signatures"
            );
        }
        Ok(Reader {
            http,
            cache: cache_dir.join("debian"),
            offline,
            gpgv,
        })
    }

    /// GET `url` within `limit` bytes; `Ok(None)` on 404/410.
    async fn get(&self, url: &str, limit: u64) -> Result<Option<Vec<u8>>, DebianError> {
        let fail = |message: String| DebianError::Fetch {
            url: url.to_string(),
            message,
        };
        if self.offline {
            return Err(DebianError::Offline {
                url: url.to_string(),
            });
        }
        let mut response = self
            .http
            .get(url)
            .send()
            .await
            .map_err(|e| fail(error_chain(&e)))?;
        if matches!(response.status().as_u16(), 404 | 410) {
            return Ok(None);
        }
        if !response.status().is_success() {
            return Err(fail(format!("HTTP {}", response.status())));
        }
        let mut body = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| fail(error_chain(&e)))? {
            body.extend_from_slice(&chunk);
            if body.len() as u64 > limit {
                return Err(fail(format!("the answer is larger than {limit} bytes")));
            }
        }
        Ok(Some(body))
    }

    /// The `Release` body of a suite (InRelease, else Release with Release.gpg), its signature checked with `gpgv`
    /// against `keyring` when gpgv is on PATH, and its `Valid-Until` (if any) not past; `None` when the archive does
    /// not have the suite.
    async fn release(
        &self,
        archive: &str,
        suite: &str,
        keyring: &Path,
    ) -> Result<Option<String>, DebianError> {
        let utf8 = |url: &str, bytes: Vec<u8>| {
            String::from_utf8(bytes).map_err(|_| DebianError::Invalid {
                url: url.to_string(),
                message: "is not UTF-8".into(),
            })
        };
        let in_release = format!("{archive}/dists/{suite}/InRelease");
        let (url, body) = if let Some(bytes) = self.get(&in_release, MAX_RELEASE_BYTES).await? {
            let body = match &self.gpgv {
                Some(gpgv) => self.verify(gpgv, keyring, &in_release, &bytes, None)?,
                None => release_body(&utf8(&in_release, bytes)?).to_string(),
            };
            (in_release, body)
        } else {
            let url = format!("{archive}/dists/{suite}/Release");
            let Some(bytes) = self.get(&url, MAX_RELEASE_BYTES).await? else {
                return Ok(None);
            };
            if let Some(gpgv) = &self.gpgv {
                let signature_url = format!("{url}.gpg");
                let signature = self
                    .get(&signature_url, MAX_RELEASE_BYTES)
                    .await?
                    .ok_or_else(|| DebianError::Invalid {
                        url: url.clone(),
                        message: "has no InRelease and no Release.gpg beside it: it is not signed"
                            .into(),
                    })?;
                self.verify(gpgv, keyring, &url, &signature, Some(&bytes))?;
            }
            let body = utf8(&url, bytes)?;
            (url, body)
        };
        if let Some(until) = valid_until(&body) {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_secs() as i64)
                .unwrap_or(0);
            match until {
                Some(until) if until >= now => {}
                Some(_) => {
                    return Err(DebianError::Invalid {
                        url,
                        message: "is past its Valid-Until: the archive (or whoever answers for it) serves an \
                                  expired Release"
                            .into(),
                    });
                }
                None => {
                    return Err(DebianError::Invalid {
                        url,
                        message: "has a Valid-Until that is not a date".into(),
                    });
                }
            }
        }
        Ok(Some(body))
    }

    /// Check `signed` (a clearsigned file, or the detached signature of `data`) with gpgv against `keyring`:
    /// accepted when gpgv reports a `VALIDSIG` and no `BADSIG` (its exit status is not used: it is 2 when some
    /// signatures are from keys not in the keyring, even with a valid one). Returns the signed text gpgv printed.
    fn verify(
        &self,
        gpgv: &Path,
        keyring: &Path,
        url: &str,
        signed: &[u8],
        data: Option<&[u8]>,
    ) -> Result<String, DebianError> {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = self
            .cache
            .join(format!(".gpgv.{}.{n}.tmp", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        fs_err::create_dir_all(&dir)?;
        let result = (|| {
            let signed_path = dir.join("signed");
            fs_err::write(&signed_path, signed)?;
            let mut command = std::process::Command::new(gpgv);
            command
                .arg("--status-fd")
                .arg("1")
                .arg("--keyring")
                .arg(keyring);
            let output_path = dir.join("text");
            match data {
                Some(data) => {
                    let data_path = dir.join("data");
                    fs_err::write(&data_path, data)?;
                    command.arg(&signed_path).arg(&data_path);
                }
                None => {
                    command.arg("--output").arg(&output_path).arg(&signed_path);
                }
            }
            let out = command.stdin(std::process::Stdio::null()).output()?;
            let status = String::from_utf8_lossy(&out.stdout);
            let has = |what: &str| {
                status
                    .lines()
                    .any(|l| l.starts_with(&format!("[GNUPG:] {what} ")))
            };
            if !has("VALIDSIG") || has("BADSIG") {
                let said = String::from_utf8_lossy(&out.stderr);
                return Err(DebianError::Invalid {
                    url: url.to_string(),
                    message: format!(
                        "has no valid signature from the keyring {} (gpgv: {}); if the source is trusted, name its \
                         keyring with `Signed-By` in its apt source (or HVD_DEBIAN_KEYRING with HVD_DEBIAN_ARCHIVE)",
                        keyring.display(),
                        said.trim().lines().last().unwrap_or("no output")
                    ),
                });
            }
            match data {
                Some(data) => Ok(String::from_utf8_lossy(data).into_owned()),
                None => {
                    let text = fs_err::read(&output_path)?;
                    String::from_utf8(text).map_err(|_| DebianError::Invalid {
                        url: url.to_string(),
                        message: "is not UTF-8".into(),
                    })
                }
            }
        })();
        let _ = std::fs::remove_dir_all(&dir);
        result
    }

    /// The suite's `main` `Packages` text for `arch`, checked against the release's sha256 and size.
    async fn packages(
        &self,
        archive: &str,
        suite: &str,
        release: &str,
        arch: &str,
    ) -> Result<String, DebianError> {
        let hashes = release_sha256(release);
        let path = format!("main/binary-{arch}/Packages.gz");
        let url = format!("{archive}/dists/{suite}/{path}");
        let (sha256, size) = hashes.get(&path).ok_or_else(|| DebianError::Invalid {
            url: format!("{archive}/dists/{suite}/InRelease"),
            message: format!("lists no SHA256 for `{path}`"),
        })?;
        let sha256 = sha256.parse::<Sha256>().map_err(|e| DebianError::Invalid {
            url: url.clone(),
            message: format!("its listed SHA256 is not one: {e}"),
        })?;
        let cached = self.cache.join(sha256.as_str());
        let compressed = match std::fs::read(&cached) {
            Ok(bytes) if Sha256::of_bytes(&bytes) == sha256 => bytes,
            _ => {
                let bytes = self
                    .get(&url, MAX_PACKAGES_BYTES.min(*size))
                    .await?
                    .ok_or_else(|| DebianError::Fetch {
                        url: url.clone(),
                        message: "not found (HTTP 404), though InRelease lists it".into(),
                    })?;
                let actual = Sha256::of_bytes(&bytes);
                if actual != sha256 || bytes.len() as u64 != *size {
                    return Err(DebianError::Invalid {
                        url,
                        message: format!(
                            "has sha256 {actual} and {} bytes, but InRelease lists {sha256} and {size} bytes",
                            bytes.len()
                        ),
                    });
                }
                fs_err::create_dir_all(&self.cache)?;
                let temp =
                    self.cache
                        .join(format!(".{}.{}.tmp", sha256.as_str(), std::process::id()));
                fs_err::write(&temp, &bytes)?;
                fs_err::rename(&temp, &cached)?;
                bytes
            }
        };
        let mut text = String::new();
        flate2::read::GzDecoder::new(compressed.as_slice())
            .take(MAX_PACKAGES_TEXT)
            .read_to_string(&mut text)
            .map_err(|e| DebianError::Invalid {
                url: url.clone(),
                message: format!("does not decompress to text: {e}"),
            })?;
        Ok(text)
    }
}

/// Pin `gcc-<version>` from the first suite of `archives` that has it: the closure of `gcc-N`, `g++-N` and
/// `libc6-dev` (glibc's headers and startup files, the sysroot the wrapper links against), with every `.deb`'s
/// sha256. `host_glibc` is the machine's glibc: the compiler runs on it, so the suite's glibc may not be newer.
pub async fn pin_gcc(
    version: &str,
    archives: &Archives,
    host_glibc: Option<(u64, u64)>,
    cache_dir: &Path,
    offline: bool,
) -> Result<ToolchainPin, DebianError> {
    let arch = DebianArch::host()?.name;
    let reader = Reader::new(cache_dir, offline)?;
    let Some(archive) = archives.urls.first() else {
        return Err(DebianError::NoArchive);
    };
    let mut search = Search {
        reader: &reader,
        version,
        root: format!("gcc-{version}"),
        arch,
        host_glibc,
        searched: Vec::new(),
        found: Vec::new(),
        failed: Vec::new(),
        answered: 0,
    };
    // Sources whose Release says `Origin: Debian` first, in order; the others after, in order.
    let mut others: Vec<(&String, &String, String)> = Vec::new();
    for archive in &archives.urls {
        for suite in &archives.suites {
            let release = match reader
                .release(archive, suite, &archives.keyring(archive))
                .await
            {
                Ok(Some(release)) => release,
                Ok(None) => continue,
                Err(err @ (DebianError::Offline { .. } | DebianError::Io(_))) => return Err(err),
                Err(err) => {
                    search.skip(archive, suite, err);
                    continue;
                }
            };
            if release_origin(&release) != Some("Debian") {
                others.push((archive, suite, release));
                continue;
            }
            if let Some(pin) = search.suite(archive, suite, &release).await? {
                return Ok(pin);
            }
        }
    }
    for (archive, suite, release) in others {
        if let Some(pin) = search.suite(archive, suite, &release).await? {
            return Ok(pin);
        }
    }
    let Search {
        searched,
        mut found,
        mut failed,
        answered,
        ..
    } = search;
    // No source gave a Packages index: the first failure says why.
    if answered == 0 && !failed.is_empty() {
        return Err(failed.remove(0));
    }
    if !failed.is_empty() {
        found.push(format!(
            "{} source(s) skipped, the first: {}",
            failed.len(),
            failed[0]
        ));
    }
    Err(DebianError::NotFound {
        archive: archive.clone(),
        version: version.to_string(),
        searched: if searched.is_empty() {
            format!("none of {} answered", archives.suites.join(", "))
        } else {
            searched.join(", ")
        },
        found: if found.is_empty() {
            String::new()
        } else {
            format!(" ({})", found.join("; "))
        },
    })
}

/// One search of [`pin_gcc`]: what it looks for, and the suites asked, the gcc versions they have and the sources
/// skipped so far.
struct Search<'a> {
    reader: &'a Reader,
    version: &'a str,
    root: String,
    arch: &'a str,
    host_glibc: Option<(u64, u64)>,
    searched: Vec<String>,
    found: Vec<String>,
    failed: Vec<DebianError>,
    answered: usize,
}

impl Search<'_> {
    /// `suite`'s `Packages` index searched for `gcc-<version>`: its pin where it has it, `None` where it has not or
    /// the source was skipped (noted), an error that ends the search (offline, local I/O).
    async fn suite(
        &mut self,
        archive: &str,
        suite: &str,
        release: &str,
    ) -> Result<Option<ToolchainPin>, DebianError> {
        self.searched.push(suite.to_string());
        match self
            .reader
            .packages(archive, suite, release, self.arch)
            .await
        {
            Ok(text) => {
                self.answered += 1;
                let index = parse_packages(&text);
                if index.contains_key(&self.root) {
                    return pin_from_index(
                        self.version,
                        archive,
                        suite,
                        self.arch,
                        &index,
                        self.host_glibc,
                    )
                    .map(Some);
                }
                self.found.extend(gcc_versions(suite, &index));
            }
            Err(err @ (DebianError::Offline { .. } | DebianError::Io(_))) => return Err(err),
            Err(err) => self.skip(archive, suite, err),
        }
        Ok(None)
    }

    fn skip(&mut self, archive: &str, suite: &str, err: DebianError) {
        tracing::warn!("Debian source {archive} {suite} skipped: {err}");
        self.failed.push(err);
    }
}

/// `"<suite> has gcc A, B"` for the `gcc-<digits>` packages of an index, if any.
fn gcc_versions(suite: &str, index: &HashMap<String, Package>) -> Option<String> {
    let mut here: Vec<&str> = index
        .keys()
        .filter_map(|k| k.strip_prefix("gcc-"))
        .filter(|v| !v.is_empty() && v.chars().all(|c| c.is_ascii_digit()))
        .collect();
    here.sort_by_key(|v| v.parse::<u64>().unwrap_or(0));
    (!here.is_empty()).then(|| format!("{suite} has gcc {}", here.join(", ")))
}

/// The `Valid-Until` field of a Release body: `None` when absent, `Some(None)` when it is not a date, else its
/// seconds since the epoch.
fn valid_until(body: &str) -> Option<Option<i64>> {
    let value = body
        .lines()
        .take_while(|line| !line.trim().is_empty())
        .find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case("Valid-Until")
                .then(|| value.trim())
        })?;
    Some(parse_release_date(value))
}

/// A Release date (`Sat, 09 Jan 2027 14:22:06 UTC`, RFC 2822 in UTC) as seconds since the epoch.
fn parse_release_date(value: &str) -> Option<i64> {
    let words: Vec<&str> = value.split_whitespace().collect();
    let [_, day, month, year, time, zone] = words.as_slice() else {
        return None;
    };
    if !matches!(*zone, "UTC" | "GMT" | "+0000" | "Z") {
        return None;
    }
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    let month = MONTHS.iter().position(|m| m == month)? as i64 + 1;
    let day: i64 = day.parse().ok()?;
    let year: i64 = year.parse().ok()?;
    let hms: Vec<i64> = time
        .split(':')
        .map(|p| p.parse().ok())
        .collect::<Option<_>>()?;
    let [h, m, sec] = hms.as_slice() else {
        return None;
    };
    if !(1..=31).contains(&day) || *h > 23 || *m > 59 || *sec > 60 {
        return None;
    }
    // Days from the civil date (Howard Hinnant's algorithm).
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    let days = era * 146_097 + doe - 719_468;
    Some(days * 86_400 + h * 3600 + m * 60 + sec)
}

/// The `Origin` field of a Release body.
fn release_origin(body: &str) -> Option<&str> {
    body.lines()
        .take_while(|line| !line.trim().is_empty())
        .find_map(|line| {
            let (key, value) = line.split_once(':')?;
            key.trim()
                .eq_ignore_ascii_case("Origin")
                .then(|| value.trim())
        })
}

fn pin_from_index(
    version: &str,
    archive: &str,
    suite: &str,
    arch: &str,
    index: &HashMap<String, Package>,
    host_glibc: Option<(u64, u64)>,
) -> Result<ToolchainPin, DebianError> {
    let closure_error = |message: String| DebianError::Closure {
        version: version.to_string(),
        suite: suite.to_string(),
        message,
    };
    let roots = vec![
        format!("gcc-{version}"),
        format!("g++-{version}"),
        "libc6-dev".to_string(),
    ];
    let chosen = closure(index, &roots).map_err(closure_error)?;
    if let Some(libc) = chosen.get("libc6") {
        let needs = upstream(&libc.version).to_string();
        let host = host_glibc.map(|(a, b)| format!("{a}.{b}"));
        let runs = host
            .as_deref()
            .is_some_and(|h| compare_versions(h, &needs).is_ge());
        if !runs {
            return Err(DebianError::GlibcTooOld {
                version: version.to_string(),
                suite: suite.to_string(),
                needs,
                host: host.unwrap_or_else(|| "none".into()),
            });
        }
    }
    let mut debs = Vec::new();
    for package in chosen.values() {
        check_filename(&package.filename).map_err(|why| {
            closure_error(format!(
                "the Packages index names the file `{}` for `{}`, which {why}; hvd will not fetch it",
                package.filename.escape_debug(),
                package.name
            ))
        })?;
        let sha256 = package.sha256.parse::<Sha256>().map_err(|e| {
            closure_error(format!(
                "the Packages index lists no valid SHA256 for `{}`: {e}",
                package.name
            ))
        })?;
        debs.push(DebPin {
            name: package.name.clone(),
            version: package.version.clone(),
            filename: package.filename.clone(),
            sha256,
            size: package.size,
        });
    }
    let gcc = &chosen[&format!("gcc-{version}")];
    Ok(ToolchainPin {
        name: "gcc".into(),
        requested: version.to_string(),
        tools: Vec::new(),
        debian: Some(DebianSource {
            archive: archive.to_string(),
            suite: suite.to_string(),
            version: upstream(&gcc.version).to_string(),
            arch: Some(arch.to_string()),
        }),
        debs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn machine_arches_map_to_debian_names_and_triplets() {
        let amd64 = DebianArch::of_rust("x86_64").unwrap();
        assert_eq!((amd64.name, amd64.triplet), ("amd64", "x86_64-linux-gnu"));
        let arm64 = DebianArch::of_rust("aarch64").unwrap();
        assert_eq!((arm64.name, arm64.triplet), ("arm64", "aarch64-linux-gnu"));
        assert_eq!(DebianArch::named("arm64"), Some(arm64));
        let err = DebianArch::of_rust("riscv64").unwrap_err().to_string();
        assert!(err.contains("this one is riscv64"), "{err}");
        assert_eq!(DebianArch::named("i386"), None);
    }

    #[test]
    fn release_dates() {
        assert_eq!(
            parse_release_date("Sat, 14 Aug 2021 07:50:33 UTC"),
            Some(1_628_927_433)
        );
        assert_eq!(parse_release_date("Thu, 01 Jan 1970 00:00:00 GMT"), Some(0));
        for bad in [
            "Sat, 14 Aug 2021 07:50:33 CEST",
            "14 Aug 2021",
            "Sat, 32 Aug 2021 07:50:33 UTC",
            "Sat, 14 Foo 2021 07:50:33 UTC",
        ] {
            assert_eq!(parse_release_date(bad), None, "{bad}");
        }
        assert_eq!(
            valid_until("Origin: Debian\nValid-Until: Thu, 01 Jan 1970 00:00:10 UTC\n"),
            Some(Some(10))
        );
        assert_eq!(valid_until("Origin: Debian\n"), None);
        assert_eq!(valid_until("Valid-Until: soon\n"), Some(None));
    }

    #[test]
    fn dpkg_version_order() {
        use std::cmp::Ordering::*;
        for (a, b, want) in [
            ("1.0", "1.0", Equal),
            ("1.0~rc1", "1.0", Less),
            ("2:1.0", "10.0", Greater),
            ("10.2.1-6", "10.2.1-10", Less),
            ("2.31-13+deb11u11", "2.31", Greater),
            ("1.0a", "1.0+", Less),
            ("2.36", "2.31", Greater),
        ] {
            assert_eq!(compare_versions(a, b), want, "{a} vs {b}");
        }
        assert_eq!(upstream("2:6.2.1+dfsg-1+deb11u1"), "6.2.1+dfsg");
    }

    #[test]
    fn apt_sources_both_formats() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::create_dir(dir.path().join("sources.list.d")).unwrap();
        std::fs::write(
            dir.path().join("sources.list"),
            "# c\ndeb [arch=amd64] http://a.invalid/debian/ bullseye main contrib\ndeb-src http://b.invalid/x bullseye main\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("sources.list.d/d.sources"),
            "Types: deb\nURIs: http://c.invalid/debian\nSuites: bookworm bookworm-updates\nComponents: main\n\nTypes: deb\nURIs: http://d.invalid/\nSuites: x\nComponents: contrib\n",
        )
        .unwrap();
        // Not read: a file without `.list`/`.sources` (apt ignores it too), sources for another arch.
        std::fs::write(
            dir.path().join("sources.list.d/old-mirror"),
            "deb http://e.invalid/debian bullseye main\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("sources.list.d/ports.list"),
            "deb [ arch=arm64,armhf signed-by=/k.gpg ] http://f.invalid/ports bullseye main\n\
             deb [arch-=amd64] http://g.invalid/x bullseye main\n",
        )
        .unwrap();
        std::fs::write(
            dir.path().join("sources.list.d/p.sources"),
            "Types: deb\nURIs: http://h.invalid/debian\nSuites: sid\nComponents: main\nArchitectures: arm64\n",
        )
        .unwrap();
        let pairs = |arch: &str| -> Vec<(String, String)> {
            read_apt_sources(dir.path(), arch)
                .into_iter()
                .map(|(url, suite, _)| (url, suite))
                .collect()
        };
        assert_eq!(
            pairs("amd64"),
            vec![
                ("http://a.invalid/debian".into(), "bullseye".into()),
                ("http://c.invalid/debian".into(), "bookworm".into()),
                ("http://c.invalid/debian".into(), "bookworm-updates".into()),
            ]
        );
        assert_eq!(
            pairs("arm64"),
            vec![
                ("http://c.invalid/debian".into(), "bookworm".into()),
                ("http://c.invalid/debian".into(), "bookworm-updates".into()),
                ("http://h.invalid/debian".into(), "sid".into()),
                ("http://f.invalid/ports".into(), "bullseye".into()),
                ("http://g.invalid/x".into(), "bullseye".into()),
            ]
        );
        // The variables are checked when read, naming themselves.
        let discover = |archive: Option<&str>, suites: Option<&str>| {
            Archives::discover_in(
                dir.path(),
                archive.map(str::to_string),
                suites.map(str::to_string),
                "amd64",
            )
        };
        // The ports source names its keyring (`signed-by=`); the others get the default.
        let arm = Archives::discover_in(dir.path(), None, None, "arm64").unwrap();
        assert_eq!(arm.keyring("http://f.invalid/ports"), Path::new("/k.gpg"));
        assert_eq!(
            arm.keyring("http://c.invalid/debian"),
            Path::new(DEFAULT_KEYRING)
        );
        let ok = discover(Some("http://x.invalid/debian/"), Some("a, b-c")).unwrap();
        assert_eq!(
            (ok.urls, ok.suites),
            (
                vec!["http://x.invalid/debian".to_string()],
                vec!["a".to_string(), "b-c".to_string()]
            )
        );
        for (archive, suites, expect) in [
            (
                Some("ftp://x/debian"),
                None,
                "HVD_DEBIAN_ARCHIVE=`ftp://x/debian`",
            ),
            (Some("file:///etc"), None, "not an http(s) URL"),
            (
                None,
                Some("bullseye,../x"),
                "HVD_DEBIAN_SUITES=`bullseye,../x`",
            ),
            (None, Some("a/b"), "outside"),
        ] {
            let err = discover(archive, suites).unwrap_err().to_string();
            assert!(err.contains(expect), "{err}");
        }
        assert_eq!(
            search_order(["bookworm", "bookworm-updates"].into_iter()),
            [
                "bookworm", "bullseye", "buster", "stretch", "trixie", "forky", "sid"
            ]
        );
    }

    #[test]
    fn filenames_outside_the_pool_are_refused() {
        assert!(check_filename("pool/main/g/gcc-10/gcc-10_10.2.1-6_amd64.deb").is_ok());
        for bad in [
            "pool/../../etc/passwd.deb",
            "/pool/x.deb",
            "pool/main/x.tar",
            "pool//x.deb",
            "pool/x y.deb",
            "dists/x.deb",
        ] {
            assert!(check_filename(bad).is_err(), "{bad}");
        }
    }

    fn stanza(name: &str, version: &str, depends: &str, provides: &str) -> String {
        format!(
            "Package: {name}\nVersion: {version}\nArchitecture: amd64\nDepends: {depends}\nProvides: {provides}\n\
             Description: x\n continued line\nFilename: pool/main/{name}_{version}_amd64.deb\nSize: 10\n\
             SHA256: {}\n\n",
            Sha256::of_bytes(name.as_bytes())
        )
    }

    #[test]
    fn closure_follows_alternatives_versions_and_provides() {
        let text = [
            stanza(
                "gcc-9",
                "9.3-1",
                "cpp-9 (= 9.3-1), binutils (>= 2.30) | foo, libc6 (>= 2.14)",
                "",
            ),
            stanza("g++-9", "9.3-1", "gcc-9 (= 9.3-1), libstdc++-dev", ""),
            stanza("libstdc++-9-dev", "9.3-1", "libc6-dev", "libstdc++-dev"),
            stanza("cpp-9", "9.3-1", "", ""),
            stanza("cpp-9", "9.2-1", "never-there", ""),
            stanza("binutils", "2.35", "libc6", ""),
            stanza("libc6", "2.31-1", "", ""),
            stanza(
                "libc6-dev",
                "2.31-1",
                "libc6 (= 2.31-1), libc-dev-bin, libnsl-dev",
                "",
            ),
        ]
        .concat();
        let index = parse_packages(&text);
        let pin = pin_from_index(
            "9",
            "http://x.invalid",
            "bullseye",
            "amd64",
            &index,
            Some((2, 36)),
        )
        .unwrap();
        let names: Vec<&str> = pin.debs.iter().map(|d| d.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "binutils",
                "cpp-9",
                "g++-9",
                "gcc-9",
                "libc6",
                "libc6-dev",
                "libstdc++-9-dev"
            ]
        );
        assert_eq!(pin.debian.as_ref().unwrap().version, "9.3");
        // The compiler needs a newer glibc than the host has.
        let err = pin_from_index(
            "9",
            "http://x.invalid",
            "bullseye",
            "amd64",
            &index,
            Some((2, 28)),
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("needs glibc 2.31") && err.contains("has glibc 2.28"),
            "{err}"
        );
        // An unsatisfiable versioned dependency names the package and the dependency.
        let broken = parse_packages(
            &[
                stanza("gcc-9", "9.3-1", "cpp-9 (>= 10)", ""),
                stanza("cpp-9", "9.3-1", "", ""),
            ]
            .concat(),
        );
        let err = closure(&broken, &["gcc-9".to_string()]).unwrap_err();
        assert!(err.contains("cpp-9 (>= 10)"), "{err}");
    }

    #[test]
    fn hostile_filename_in_index_is_refused() {
        let text = stanza("gcc-9", "9.3-1", "", "").replace(
            "Filename: pool/main/gcc-9_9.3-1_amd64.deb",
            "Filename: pool/../../../etc/shadow.deb",
        );
        let index = parse_packages(
            &[
                text,
                stanza("libc6-dev", "2.31", "", ""),
                stanza("g++-9", "9.3-1", "", ""),
            ]
            .concat(),
        );
        let err = pin_from_index("9", "http://x.invalid", "s", "amd64", &index, Some((2, 36)))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("etc/shadow") && err.contains("will not fetch"),
            "{err}"
        );
    }

    #[test]
    fn release_bodies_and_hashes() {
        let signed = "-----BEGIN PGP SIGNED MESSAGE-----\nHash: SHA512\n\nOrigin: Debian\nSHA256:\n 0123 10 main/binary-amd64/Packages.gz\n-----BEGIN PGP SIGNATURE-----\nxyz\n-----END PGP SIGNATURE-----\n";
        let body = release_body(signed);
        assert!(body.starts_with("Origin: Debian") && !body.contains("SIGNATURE"));
        assert_eq!(
            release_sha256(body).get("main/binary-amd64/Packages.gz"),
            Some(&("0123".to_string(), 10))
        );
    }
}
