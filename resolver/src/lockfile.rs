//! The lockfile (`train.hvd.lock`): types, a deterministic TOML writer, a reader that refuses newer schemas,
//! the env hash and the field-by-field staleness check.
//!
//! The format and its compatibility rules are documented in `docs/lockfile.md`. The writer is hand-written
//! (not `toml::to_string`) so the bytes depend only on the data and this file, never on a serializer's
//! formatting choices: same input, same bytes, one artifact per line.

use std::collections::BTreeMap;
use std::fmt::{self, Write as _};
use std::path::{Path, PathBuf};
use std::str::FromStr;

use hvd_lang::model::{Env, PackageRequest, SourceBuild};
use serde::{Deserialize, Serialize};
use sha2::Digest;

pub use crate::digest::Sha256;

/// The schema version this build writes and the newest it reads.
pub const SCHEMA_VERSION: u32 = 1;

/// A whole lockfile.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Lockfile {
    /// Schema version ([`SCHEMA_VERSION`] when written by this build).
    pub version: u32,
    /// `sha256:<hex>` of the normalized `env` ([`env_hash`]).
    pub env_hash: String,
    /// What was asked, normalized, so staleness can be explained field by field.
    pub request: Request,
    /// What it was resolved for.
    pub target: Target,
    /// The compiler found at lock time, when the env names a toolchain.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toolchain: Option<ToolchainPin>,
    /// Every runtime package, sorted by name.
    #[serde(default, rename = "package")]
    pub packages: Vec<LockedPackage>,
    /// Every source build, sorted by package name.
    #[serde(default, rename = "build")]
    pub builds: Vec<LockedBuild>,
}

/// The normalized echo of `env`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Request {
    /// `env.python`.
    pub python: String,
    /// `env.index` as written in the file (`None`: pip's configuration was used; see each package's `index`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub index: Option<String>,
    /// `env.toolchain`: `"<name> <version>"`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub toolchain: Option<String>,
    /// `env.packages` in file order.
    #[serde(default)]
    pub packages: Vec<RequestedPackage>,
    /// `env.variables`.
    #[serde(default)]
    pub variables: BTreeMap<String, String>,
}

/// One entry of `env.packages`, normalized.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct RequestedPackage {
    /// The PEP 508 requirement, normalized (lowercase name, canonical spacing).
    pub requirement: String,
    /// The source build recipe, when the package is built from source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub build: Option<RequestedBuild>,
}

/// The normalized `SourceBuild` of a request.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct RequestedBuild {
    #[serde(default)]
    pub requires: Vec<String>,
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    #[serde(default)]
    pub against: Vec<String>,
    #[serde(default)]
    pub no_build_isolation: bool,
}

/// The interpreter and platform the lock was resolved for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Target {
    /// `major.minor` of the interpreter, e.g. `"3.11"`.
    pub python: String,
    /// The full version markers were evaluated with (`python_full_version`), e.g. `"3.11.0"`.
    pub python_full: String,
    /// Interpreter tag, e.g. `"cp311"`.
    pub interpreter: String,
    /// ABI tag, e.g. `"cp311"`.
    pub abi: String,
    /// `sys.platform`, e.g. `"linux"`.
    pub os: String,
    /// `platform.machine()`, e.g. `"x86_64"`.
    pub arch: String,
    /// The newest `manylinux_X_Y` accepted (the host's glibc), e.g. `"2.36"`; `None` off glibc.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub glibc: Option<String>,
    /// The platform tags accepted, best first. `manylinux_X_Y` tags older than `glibc` (and the
    /// `manylinux1/2010/2014` aliases) are accepted too; they are implied, not listed.
    pub platforms: Vec<String>,
}

/// The compiler pinned at lock time.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ToolchainPin {
    /// `env.toolchain.name`, e.g. `"gcc"`.
    pub name: String,
    /// `env.toolchain.version` as requested, e.g. `"12"`.
    pub requested: String,
    /// The compilers found on PATH (e.g. `gcc` and `g++`), sorted by command.
    pub tools: Vec<ToolPin>,
}

/// One compiler binary.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct ToolPin {
    /// The command looked up on PATH, e.g. `"g++"`.
    pub command: String,
    /// The binary it resolves to, symlinks followed.
    pub path: String,
    /// `<command> -dumpfullversion` (or the first line of `--version`).
    pub version: String,
    /// sha256 of the binary.
    pub sha256: Sha256,
}

/// One locked package.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LockedPackage {
    /// Normalized name (PEP 503).
    pub name: String,
    pub version: String,
    /// The simple-API root it came from.
    pub index: String,
    /// The chosen file.
    pub artifact: Artifact,
    /// Dependency edges active for the target, sorted by name.
    #[serde(default)]
    pub dependencies: Vec<Dependency>,
}

/// A wheel or sdist file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Artifact {
    pub kind: ArtifactKind,
    pub filename: String,
    pub url: String,
    /// The sha256 the index listed (or, for an index that lists none, the one hvd computed while streaming the
    /// file at lock time). Validated when read: 64 hex digits, never empty.
    pub sha256: Sha256,
    /// Size in bytes; 0 when the index did not say (downloads then stop at a fixed maximum).
    pub size: u64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ArtifactKind {
    Wheel,
    Sdist,
}

impl ArtifactKind {
    pub fn as_str(self) -> &'static str {
        match self {
            ArtifactKind::Wheel => "wheel",
            ArtifactKind::Sdist => "sdist",
        }
    }
}

/// A dependency edge.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct Dependency {
    /// Normalized name of the dependency (a package of the same section).
    pub name: String,
    /// Extras requested on the edge, sorted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub extras: Vec<String>,
    /// The edge's marker as published (it evaluated to true for the target).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub marker: Option<String>,
}

/// A source build: the recipe inputs and the separately locked build requirements.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case", deny_unknown_fields)]
pub struct LockedBuild {
    /// Normalized name of the runtime package this builds (its sdist is in `[[package]]`).
    #[serde(rename = "name")]
    pub package: String,
    /// Build requirements as requested (normalized).
    #[serde(default)]
    pub requires: Vec<String>,
    /// Environment variables for the build.
    #[serde(default)]
    pub env: BTreeMap<String, String>,
    /// Runtime packages the build compiles against (normalized names; locked in `[[package]]`).
    #[serde(default)]
    pub against: Vec<String>,
    #[serde(default)]
    pub no_build_isolation: bool,
    /// The locked build requirements, sorted by name: the closure of `requires` minus the runtime closure of
    /// `against` (those come from `[[package]]`, and the build resolution is pinned to their versions).
    #[serde(default, rename = "package")]
    pub packages: Vec<LockedPackage>,
}

/// Reading a lockfile failed.
#[derive(Debug, thiserror::Error)]
pub enum LockfileError {
    #[error("failed to read lockfile")]
    Io(#[from] std::io::Error),
    #[error(
        "lockfile `{path}` has schema version {found}, newer than this hvd reads ({supported}); upgrade hvd, or delete the lockfile and run `hvd lock`"
    )]
    NewerSchema {
        path: PathBuf,
        found: u32,
        supported: u32,
    },
    #[error("lockfile `{path}` is not valid: {message}; delete it and run `hvd lock`")]
    Invalid { path: PathBuf, message: String },
}

impl Lockfile {
    /// Parse lockfile text. `path` only names the file in errors.
    pub fn parse(text: &str, path: &Path) -> Result<Lockfile, LockfileError> {
        let invalid = |message: String| LockfileError::Invalid {
            path: path.to_path_buf(),
            message,
        };
        let table: toml::Table =
            toml::from_str(text).map_err(|e| invalid(e.message().to_string()))?;
        let version = match table.get("version") {
            Some(toml::Value::Integer(v)) => {
                u32::try_from(*v).map_err(|_| invalid(format!("bad `version` {v}")))?
            }
            _ => return Err(invalid("missing integer `version`".into())),
        };
        if version > SCHEMA_VERSION {
            return Err(LockfileError::NewerSchema {
                path: path.to_path_buf(),
                found: version,
                supported: SCHEMA_VERSION,
            });
        }
        let lock: Lockfile = toml::from_str(text).map_err(|e| invalid(e.message().to_string()))?;
        lock.validate().map_err(invalid)?;
        Ok(lock)
    }

    /// Check every artifact field strictly (a lockfile may come from a pull request): names are normalized,
    /// versions are PEP 440, file names are plain file names of the package and version with the suffix of
    /// their kind, URLs are `http(s)` (or local files, only for a package whose index is itself local), and
    /// digests are 64 hex digits (the type checks that). Called by [`Lockfile::parse`], so every reader gets it.
    pub fn validate(&self) -> Result<(), String> {
        for p in &self.packages {
            validate_package(p)
                .map_err(|e| format!("[[package]] `{}`: {e}", p.name.escape_debug()))?;
        }
        for b in &self.builds {
            if !is_normalized_name(&b.package) {
                return Err(format!(
                    "[[build]] name `{}` is not a normalized package name",
                    b.package.escape_debug()
                ));
            }
            for p in &b.packages {
                validate_package(p).map_err(|e| {
                    format!(
                        "[[build.package]] `{}` of `{}`: {e}",
                        p.name.escape_debug(),
                        b.package
                    )
                })?;
            }
        }
        Ok(())
    }

    /// Read a lockfile from disk. Refuses files over 64 MiB (a lockfile is a few KB per package).
    pub fn read(path: &Path) -> Result<Lockfile, LockfileError> {
        use std::io::Read as _;
        const MAX_LOCKFILE_BYTES: u64 = 64 << 20;
        let file = fs_err::File::open(path)?;
        let mut text = String::new();
        file.take(MAX_LOCKFILE_BYTES + 1)
            .read_to_string(&mut text)?;
        if text.len() as u64 > MAX_LOCKFILE_BYTES {
            return Err(LockfileError::Invalid {
                path: path.to_path_buf(),
                message: format!("it is larger than {MAX_LOCKFILE_BYTES} bytes"),
            });
        }
        Lockfile::parse(&text, path)
    }

    /// Write to disk atomically: a temp file unique to this process and call (concurrent `hvd lock` runs never
    /// share it), then a rename, so a reader never sees half a lockfile and the last writer wins whole. Temp files
    /// of this lockfile that a killed writer left next to it are removed once stale (an hour old, or a minute when
    /// their writer's pid is gone).
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        crate::index::write_atomic(path, self.to_toml().as_bytes())?;
        if let (Some(parent), Some(name)) =
            (path.parent(), path.file_name().and_then(|n| n.to_str()))
        {
            let parent = if parent.as_os_str().is_empty() {
                Path::new(".")
            } else {
                parent
            };
            crate::index::remove_stale_temps(parent, Some(name));
        }
        Ok(())
    }

    /// The lockfile path of a `.hvd` file: `train.hvd` -> `train.hvd.lock`.
    pub fn path_for(hvd_file: &Path) -> PathBuf {
        let mut os = hvd_file.as_os_str().to_owned();
        os.push(".lock");
        PathBuf::from(os)
    }

    /// Look up a runtime package by (normalized) name.
    pub fn package(&self, name: &str) -> Option<&LockedPackage> {
        let name = normalize_name(name);
        self.packages.iter().find(|p| p.name == name)
    }

    /// Sort everything that has no meaningful order, so equal locks serialize to equal bytes.
    pub fn canonicalize(&mut self) {
        fn sort_packages(packages: &mut [LockedPackage]) {
            packages.sort_by(|a, b| a.name.cmp(&b.name).then_with(|| a.version.cmp(&b.version)));
            for p in packages.iter_mut() {
                p.dependencies.sort();
                p.dependencies.dedup();
            }
        }
        sort_packages(&mut self.packages);
        self.builds.sort_by(|a, b| a.package.cmp(&b.package));
        for b in &mut self.builds {
            sort_packages(&mut b.packages);
        }
        if let Some(t) = &mut self.toolchain {
            t.tools.sort_by(|a, b| a.command.cmp(&b.command));
        }
    }

    /// The deterministic TOML text.
    pub fn to_toml(&self) -> String {
        let mut lock = self.clone();
        lock.canonicalize();
        let mut out = String::new();
        let w = &mut out;
        w.push_str("# This file is generated by `hvd lock`. Do not edit it by hand.\n");
        line(w, "version", &lock.version.to_string());
        line(w, "env-hash", &quote(&lock.env_hash));

        let r = &lock.request;
        w.push_str("\n[request]\n");
        line(w, "python", &quote(&r.python));
        if let Some(index) = &r.index {
            line(w, "index", &quote(index));
        }
        if let Some(t) = &r.toolchain {
            line(w, "toolchain", &quote(t));
        }
        line(w, "variables", &inline_map(&r.variables));
        w.push_str("packages = [\n");
        for p in &r.packages {
            let mut fields = vec![("requirement", quote(&p.requirement))];
            if let Some(b) = &p.build {
                fields.push(("build", requested_build_inline(b)));
            }
            let _ = writeln!(w, "  {},", inline_table(&fields));
        }
        w.push_str("]\n");

        let t = &lock.target;
        w.push_str("\n[target]\n");
        line(w, "python", &quote(&t.python));
        line(w, "python-full", &quote(&t.python_full));
        line(w, "interpreter", &quote(&t.interpreter));
        line(w, "abi", &quote(&t.abi));
        line(w, "os", &quote(&t.os));
        line(w, "arch", &quote(&t.arch));
        if let Some(g) = &t.glibc {
            line(w, "glibc", &quote(g));
        }
        line(w, "platforms", &inline_list(&t.platforms));

        if let Some(tc) = &lock.toolchain {
            w.push_str("\n[toolchain]\n");
            line(w, "name", &quote(&tc.name));
            line(w, "requested", &quote(&tc.requested));
            w.push_str("tools = [\n");
            for tool in &tc.tools {
                let fields = [
                    ("command", quote(&tool.command)),
                    ("path", quote(&tool.path)),
                    ("version", quote(&tool.version)),
                    ("sha256", quote(tool.sha256.as_str())),
                ];
                let _ = writeln!(w, "  {},", inline_table(&fields));
            }
            w.push_str("]\n");
        }

        for p in &lock.packages {
            w.push_str("\n[[package]]\n");
            write_package_body(w, p);
        }
        for b in &lock.builds {
            w.push_str("\n[[build]]\n");
            line(w, "name", &quote(&b.package));
            line(w, "requires", &inline_list(&b.requires));
            line(w, "env", &inline_map(&b.env));
            line(w, "against", &inline_list(&b.against));
            line(w, "no-build-isolation", &b.no_build_isolation.to_string());
            for p in &b.packages {
                w.push_str("\n[[build.package]]\n");
                write_package_body(w, p);
            }
        }
        out
    }

    /// Whether this lock still satisfies `env`. The error lists every requested field that changed.
    pub fn check_against(&self, env: &Env) -> Result<(), Staleness> {
        let now = Request::from_env(env);
        let mut changes = Vec::new();
        if self.version != SCHEMA_VERSION {
            changes.push(FieldChange {
                field: "version".into(),
                now: SCHEMA_VERSION.to_string(),
                was: self.version.to_string(),
            });
        }
        diff_requests(&now, &self.request, &mut changes);
        if changes.is_empty() {
            // The echo matches the file: what the builder runs must match it too.
            diff_builds(&now, &self.builds, &mut changes);
        }
        if changes.is_empty() && self.env_hash != env_hash(env) {
            // Same echo, different hash: the normalization changed between hvd versions.
            changes.push(FieldChange {
                field: "env-hash".into(),
                now: env_hash(env),
                was: self.env_hash.clone(),
            });
        }
        if changes.is_empty() {
            Ok(())
        } else {
            Err(Staleness { changes })
        }
    }
}

fn write_package_body(w: &mut String, p: &LockedPackage) {
    line(w, "name", &quote(&p.name));
    line(w, "version", &quote(&p.version));
    line(w, "index", &quote(&p.index));
    let a = &p.artifact;
    let fields = [
        ("kind", quote(a.kind.as_str())),
        ("filename", quote(&a.filename)),
        ("url", quote(&a.url)),
        ("sha256", quote(a.sha256.as_str())),
        ("size", a.size.to_string()),
    ];
    line(w, "artifact", &inline_table(&fields));
    if p.dependencies.is_empty() {
        line(w, "dependencies", "[]");
    } else {
        w.push_str("dependencies = [\n");
        for d in &p.dependencies {
            let mut fields = vec![("name", quote(&d.name))];
            if !d.extras.is_empty() {
                fields.push(("extras", inline_list(&d.extras)));
            }
            if let Some(m) = &d.marker {
                fields.push(("marker", quote(m)));
            }
            let _ = writeln!(w, "  {},", inline_table(&fields));
        }
        w.push_str("]\n");
    }
}

fn requested_build_inline(b: &RequestedBuild) -> String {
    inline_table(&[
        ("requires", inline_list(&b.requires)),
        ("env", inline_map(&b.env)),
        ("against", inline_list(&b.against)),
        ("no-build-isolation", b.no_build_isolation.to_string()),
    ])
}

fn line(w: &mut String, key: &str, value: &str) {
    let _ = writeln!(w, "{} = {value}", key_text(key));
}

fn key_text(key: &str) -> String {
    if !key.is_empty()
        && key
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '_')
    {
        key.to_string()
    } else {
        quote(key)
    }
}

/// A TOML basic string.
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if (c as u32) < 0x20 || c as u32 == 0x7f => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

fn inline_list(items: &[String]) -> String {
    let parts: Vec<String> = items.iter().map(|s| quote(s)).collect();
    format!("[{}]", parts.join(", "))
}

fn inline_map(map: &BTreeMap<String, String>) -> String {
    if map.is_empty() {
        return "{}".into();
    }
    let parts: Vec<String> = map
        .iter()
        .map(|(k, v)| format!("{} = {}", key_text(k), quote(v)))
        .collect();
    format!("{{ {} }}", parts.join(", "))
}

fn inline_table(fields: &[(&str, String)]) -> String {
    let parts: Vec<String> = fields
        .iter()
        .map(|(k, v)| format!("{} = {v}", key_text(k)))
        .collect();
    format!("{{ {} }}", parts.join(", "))
}

fn is_normalized_name(name: &str) -> bool {
    !name.is_empty()
        && normalize_name(name) == name
        && name
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// A local artifact location: `file://...` or an absolute path.
pub fn is_local_url(url: &str) -> bool {
    url.starts_with("file://") || url.starts_with('/')
}

fn validate_url(what: &str, url: &str) -> Result<(), String> {
    if url.starts_with('/') {
        return Ok(());
    }
    match reqwest::Url::parse(url) {
        Ok(u) if matches!(u.scheme(), "http" | "https" | "file") => Ok(()),
        Ok(u) => Err(format!(
            "{what} `{}` has scheme `{}`; only http, https and local files are fetched",
            url.escape_debug(),
            u.scheme()
        )),
        Err(e) => Err(format!("{what} `{}` is not a URL: {e}", url.escape_debug())),
    }
}

fn validate_package(p: &LockedPackage) -> Result<(), String> {
    if !is_normalized_name(&p.name) {
        return Err("the name is not a normalized package name".into());
    }
    let version = pep440_rs::Version::from_str(&p.version).map_err(|e| {
        format!(
            "version `{}` is not a PEP 440 version: {e}",
            p.version.escape_debug()
        )
    })?;
    let a = &p.artifact;
    let f = &a.filename;
    if f.is_empty()
        || f.starts_with('.')
        || f.contains(['/', '\\', '\0'])
        || f.chars().any(char::is_control)
    {
        return Err(format!(
            "artifact filename `{}` is not a plain file name",
            f.escape_debug()
        ));
    }
    let suffix_ok = match a.kind {
        ArtifactKind::Wheel => f.ends_with(".whl"),
        ArtifactKind::Sdist => f.ends_with(".tar.gz") || f.ends_with(".zip"),
    };
    if !suffix_ok {
        return Err(format!(
            "artifact filename `{}` does not end like a {}",
            f.escape_debug(),
            a.kind.as_str()
        ));
    }
    if crate::source::version_of(f, &p.name).as_ref() != Some(&version) {
        return Err(format!(
            "artifact filename `{}` is not a file of {} {}",
            f.escape_debug(),
            p.name,
            p.version
        ));
    }
    validate_url("index", &p.index)?;
    validate_url("artifact url", &a.url)?;
    if is_local_url(&a.url) && !is_local_url(&p.index) {
        return Err(format!(
            "artifact url `{}` is a local file but the package's index `{}` is not local; only a local index serves local files",
            a.url.escape_debug(),
            p.index.escape_debug()
        ));
    }
    Ok(())
}

/// PEP 503 name normalization: lowercase, runs of `-`, `_`, `.` become `-`.
pub fn normalize_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut last_sep = false;
    for c in name.trim().chars() {
        if matches!(c, '-' | '_' | '.') {
            if !last_sep {
                out.push('-');
            }
            last_sep = true;
        } else {
            out.push(c.to_ascii_lowercase());
            last_sep = false;
        }
    }
    out
}

/// Normalize a PEP 508 requirement string (lowercase normalized name, canonical spacing). Unparsable strings are
/// kept trimmed, so the echo still shows what was written; resolution reports the parse error.
pub fn normalize_requirement(requirement: &str) -> String {
    match pep508_rs::Requirement::<pep508_rs::VerbatimUrl>::from_str(requirement) {
        Ok(r) => r.to_string(),
        Err(_) => requirement.trim().to_string(),
    }
}

impl Request {
    /// The normalized echo of an env.
    pub fn from_env(env: &Env) -> Request {
        Request {
            python: env.python.trim().to_string(),
            index: env
                .index
                .as_ref()
                .map(|i| i.trim().trim_end_matches('/').to_string()),
            toolchain: env
                .toolchain
                .as_ref()
                .map(|t| format!("{} {}", t.name.trim(), t.version.trim())),
            packages: env
                .packages
                .iter()
                .map(RequestedPackage::from_request)
                .collect(),
            variables: env.variables.clone(),
        }
    }
}

impl RequestedPackage {
    fn from_request(p: &PackageRequest) -> RequestedPackage {
        RequestedPackage {
            requirement: normalize_requirement(&p.requirement),
            build: p.build.as_ref().map(RequestedBuild::from_source_build),
        }
    }
}

impl RequestedBuild {
    pub fn from_source_build(b: &SourceBuild) -> RequestedBuild {
        RequestedBuild {
            requires: b
                .requires
                .iter()
                .map(|r| normalize_requirement(r))
                .collect(),
            env: b.env.clone(),
            against: b.against.iter().map(|a| normalize_name(a)).collect(),
            no_build_isolation: b.no_build_isolation,
        }
    }
}

/// `sha256:<hex>` of the normalized env: its [`Request`] echo as canonical JSON. Only `env` counts (steps,
/// resources, comments and formatting do not).
pub fn env_hash(env: &Env) -> String {
    let request = Request::from_env(env);
    // serde_json writes struct fields in declaration order and BTreeMaps sorted: a stable encoding.
    let json = serde_json::to_vec(&request).unwrap_or_default();
    format!("sha256:{}", hex::encode(sha2::Sha256::digest(&json)))
}

/// One requested field that no longer matches the lock.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldChange {
    /// e.g. `env.packages[2]`, `env.python`, `env.packages[1].build.requires`.
    pub field: String,
    /// The value in the file now (`(none)` when removed).
    pub now: String,
    /// The value recorded in the lock (`(none)` when added).
    pub was: String,
}

impl fmt::Display for FieldChange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {} was {}", self.field, self.now, self.was)
    }
}

/// The lock no longer matches the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Staleness {
    pub changes: Vec<FieldChange>,
}

impl fmt::Display for Staleness {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "the lockfile is out of date: ")?;
        for (i, c) in self.changes.iter().enumerate() {
            if i > 0 {
                write!(f, "; ")?;
            }
            write!(f, "{c}")?;
        }
        Ok(())
    }
}

impl std::error::Error for Staleness {}

fn shown(s: Option<&str>) -> String {
    match s {
        Some(s) => quote(s),
        None => "(none)".into(),
    }
}

/// The recipe fields of every `[[build]]` (what the builder runs) against what the file asks now: a package's
/// recipe, or for an sdist built without one no variables, nothing to compile against and build isolation (what
/// is installed for the build is `[[build.package]]`, not `requires`, so that is not compared here). The
/// request echo alone is not enough: the builder reads `[[build]]`, so a lockfile in a pull request could
/// otherwise carry build variables the file never asked for.
fn diff_builds(now: &Request, builds: &[LockedBuild], out: &mut Vec<FieldChange>) {
    for b in builds {
        let recipe = now
            .packages
            .iter()
            .filter(|p| {
                pep508_rs::Requirement::<pep508_rs::VerbatimUrl>::from_str(&p.requirement)
                    .is_ok_and(|r| normalize_name(r.name.as_ref()) == b.package)
            })
            .find_map(|p| p.build.clone());
        let base = format!("build.{}", b.package);
        let mut push = |field: &str, n: String, w: String| {
            if n != w {
                out.push(FieldChange {
                    field: format!("{base}.{field}"),
                    now: n,
                    was: w,
                });
            }
        };
        let expected = recipe.unwrap_or_default();
        push("env", inline_map(&expected.env), inline_map(&b.env));
        push(
            "against",
            inline_list(&expected.against),
            inline_list(&b.against),
        );
        push(
            "no-build-isolation",
            expected.no_build_isolation.to_string(),
            b.no_build_isolation.to_string(),
        );
    }
}

fn diff_requests(now: &Request, was: &Request, out: &mut Vec<FieldChange>) {
    let mut push = |field: String, n: Option<&str>, w: Option<&str>| {
        if n != w {
            out.push(FieldChange {
                field,
                now: shown(n),
                was: shown(w),
            });
        }
    };
    push("env.python".into(), Some(&now.python), Some(&was.python));
    push(
        "env.index".into(),
        now.index.as_deref(),
        was.index.as_deref(),
    );
    push(
        "env.toolchain".into(),
        now.toolchain.as_deref(),
        was.toolchain.as_deref(),
    );
    let len = now.packages.len().max(was.packages.len());
    for i in 0..len {
        let n = now.packages.get(i);
        let w = was.packages.get(i);
        push(
            format!("env.packages[{i}]"),
            n.map(|p| p.requirement.as_str()),
            w.map(|p| p.requirement.as_str()),
        );
        let nb = n.and_then(|p| p.build.as_ref());
        let wb = w.and_then(|p| p.build.as_ref());
        match (nb, wb) {
            (None, None) => {}
            (Some(nb), Some(wb)) => {
                let base = format!("env.packages[{i}].build");
                if nb.requires != wb.requires {
                    push(
                        format!("{base}.requires"),
                        Some(&inline_list(&nb.requires)),
                        Some(&inline_list(&wb.requires)),
                    );
                }
                if nb.env != wb.env {
                    push(
                        format!("{base}.env"),
                        Some(&inline_map(&nb.env)),
                        Some(&inline_map(&wb.env)),
                    );
                }
                if nb.against != wb.against {
                    push(
                        format!("{base}.against"),
                        Some(&inline_list(&nb.against)),
                        Some(&inline_list(&wb.against)),
                    );
                }
                if nb.no_build_isolation != wb.no_build_isolation {
                    push(
                        format!("{base}.no_build_isolation"),
                        Some(&nb.no_build_isolation.to_string()),
                        Some(&wb.no_build_isolation.to_string()),
                    );
                }
            }
            (nb, wb) => push(
                format!("env.packages[{i}].build"),
                nb.map(requested_build_inline).as_deref(),
                wb.map(requested_build_inline).as_deref(),
            ),
        }
    }
    let keys: std::collections::BTreeSet<&String> =
        now.variables.keys().chain(was.variables.keys()).collect();
    for k in keys {
        push(
            format!("env.variables.{k}"),
            now.variables.get(k).map(String::as_str),
            was.variables.get(k).map(String::as_str),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use hvd_lang::model::Toolchain;

    fn env() -> Env {
        Env {
            python: "3.11".into(),
            index: None,
            toolchain: Some(Toolchain {
                name: "gcc".into(),
                version: "12".into(),
            }),
            packages: vec![
                PackageRequest {
                    requirement: "tensorflow-cpu==2.12.1".into(),
                    build: None,
                },
                PackageRequest {
                    requirement: "Horovod == 0.28.1".into(),
                    build: Some(SourceBuild {
                        requires: vec!["cmake<4".into(), "setuptools".into()],
                        env: BTreeMap::from([("HOROVOD_WITH_TENSORFLOW".into(), "1".into())]),
                        against: vec!["tensorflow_cpu".into()],
                        no_build_isolation: true,
                    }),
                },
                PackageRequest {
                    requirement: "numpy<1.26".into(),
                    build: None,
                },
            ],
            variables: BTreeMap::new(),
        }
    }

    fn package(name: &str, version: &str) -> LockedPackage {
        LockedPackage {
            name: name.into(),
            version: version.into(),
            index: "http://127.0.0.1:1/simple".into(),
            artifact: Artifact {
                kind: ArtifactKind::Wheel,
                filename: format!("{name}-{version}-py3-none-any.whl"),
                url: format!("http://127.0.0.1:1/files/{name}-{version}-py3-none-any.whl"),
                sha256: "ab".repeat(32).parse().unwrap(),
                size: 1234,
            },
            dependencies: vec![Dependency {
                name: "zz".into(),
                extras: vec![],
                marker: Some("python_version < \"3.12\"".into()),
            }],
        }
    }

    fn lock() -> Lockfile {
        let e = env();
        Lockfile {
            version: SCHEMA_VERSION,
            env_hash: env_hash(&e),
            request: Request::from_env(&e),
            target: Target {
                python: "3.11".into(),
                python_full: "3.11.0".into(),
                interpreter: "cp311".into(),
                abi: "cp311".into(),
                os: "linux".into(),
                arch: "x86_64".into(),
                glibc: Some("2.36".into()),
                platforms: vec!["manylinux_2_36_x86_64".into(), "linux_x86_64".into()],
            },
            toolchain: Some(ToolchainPin {
                name: "gcc".into(),
                requested: "12".into(),
                tools: vec![ToolPin {
                    command: "gcc".into(),
                    path: "/usr/bin/x86_64-linux-gnu-gcc-12".into(),
                    version: "12.2.0".into(),
                    sha256: "cd".repeat(32).parse().unwrap(),
                }],
            }),
            packages: vec![package("zz", "1.0"), package("aa", "2.0")],
            builds: vec![LockedBuild {
                package: "horovod".into(),
                requires: vec!["cmake<4".into()],
                env: BTreeMap::from([("HOROVOD_WITH_TENSORFLOW".into(), "1".into())]),
                against: vec!["tensorflow-cpu".into()],
                no_build_isolation: true,
                packages: vec![package("cmake", "3.31.6")],
            }],
        }
    }

    #[test]
    fn build_variables_the_file_does_not_ask_for_make_the_lock_stale() {
        let mut l = lock();
        l.env_hash = env_hash(&env());
        assert_eq!(l.check_against(&env()), Ok(()));
        // A lockfile in a pull request adds a loader variable to the recipe's build.
        l.builds[0]
            .env
            .insert("LD_PRELOAD".into(), "./evil.so".into());
        let s = l.check_against(&env()).unwrap_err();
        assert_eq!(s.changes.len(), 1, "{s}");
        assert_eq!(s.changes[0].field, "build.horovod.env");
        assert!(s.changes[0].was.contains("LD_PRELOAD"), "{s}");
        // A `[[build]]` of a package the file builds without a recipe may carry no variables either.
        let mut l = lock();
        l.env_hash = env_hash(&env());
        l.builds.push(LockedBuild {
            package: "numpy".into(),
            requires: vec![],
            env: BTreeMap::from([("PATH".into(), "/tmp/evil".into())]),
            against: vec![],
            no_build_isolation: false,
            packages: vec![],
        });
        let s = l.check_against(&env()).unwrap_err();
        assert_eq!(s.changes[0].field, "build.numpy.env", "{s}");
        l.builds[1].env.clear();
        assert_eq!(l.check_against(&env()), Ok(()));
    }

    #[test]
    fn round_trips_and_is_deterministic() {
        let l = lock();
        let text = l.to_toml();
        let back = Lockfile::parse(&text, Path::new("x.lock")).unwrap();
        let mut sorted = l.clone();
        sorted.canonicalize();
        assert_eq!(back, sorted);
        assert_eq!(back.to_toml(), text);
        // Packages come out sorted whatever the input order.
        let aa = text.find("name = \"aa\"").unwrap();
        let zz = text.find("name = \"zz\"").unwrap();
        assert!(aa < zz, "{text}");
        // One artifact per line.
        assert_eq!(
            text.lines()
                .filter(|l| l.starts_with("artifact = {"))
                .count(),
            3
        );
    }

    #[test]
    fn refuses_newer_schema() {
        let text = lock().to_toml().replacen("version = 1", "version = 99", 1);
        let err = Lockfile::parse(&text, Path::new("t.hvd.lock")).unwrap_err();
        let msg = err.to_string();
        assert!(
            matches!(err, LockfileError::NewerSchema { found: 99, .. }),
            "{msg}"
        );
        assert!(msg.contains("upgrade hvd"), "{msg}");
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        for text in [
            "",
            "version = \"x\"",
            "version = 1\n",
            "[[[",
            "version = -1",
        ] {
            assert!(
                Lockfile::parse(text, Path::new("t.lock")).is_err(),
                "{text}"
            );
        }
    }

    #[test]
    fn normalizes_requests() {
        let r = Request::from_env(&env());
        assert_eq!(r.packages[1].requirement, "horovod==0.28.1");
        assert_eq!(
            r.packages[1].build.as_ref().unwrap().against,
            vec!["tensorflow-cpu"]
        );
        assert_eq!(normalize_name("Foo__Bar.baz"), "foo-bar-baz");
    }

    #[test]
    fn env_hash_ignores_spacing_but_not_content() {
        let a = env();
        let mut b = env();
        b.packages[2].requirement = "numpy <1.26".into();
        assert_eq!(env_hash(&a), env_hash(&b));
        b.packages[2].requirement = "numpy<2".into();
        assert_ne!(env_hash(&a), env_hash(&b));
    }

    #[test]
    fn staleness_names_each_field() {
        let l = lock();
        assert_eq!(l.check_against(&env()), Ok(()));

        let mut e = env();
        e.packages[2].requirement = "numpy<2".into();
        let s = l.check_against(&e).unwrap_err();
        assert_eq!(s.changes.len(), 1);
        assert_eq!(
            s.changes[0].to_string(),
            r#"env.packages[2]: "numpy<2" was "numpy<1.26""#
        );

        let mut e = env();
        e.python = "3.12".into();
        e.packages[1]
            .build
            .as_mut()
            .unwrap()
            .requires
            .push("wheel".into());
        e.variables.insert("A".into(), "1".into());
        let fields: Vec<String> = l
            .check_against(&e)
            .unwrap_err()
            .changes
            .into_iter()
            .map(|c| c.field)
            .collect();
        assert_eq!(
            fields,
            [
                "env.python",
                "env.packages[1].build.requires",
                "env.variables.A"
            ]
        );

        let mut e = env();
        e.packages.pop();
        let s = l.check_against(&e).unwrap_err();
        assert_eq!(
            s.changes[0].to_string(),
            r#"env.packages[2]: (none) was "numpy<1.26""#
        );

        let mut e = env();
        e.index = Some("http://127.0.0.1:1/simple/".into());
        e.packages[1]
            .build
            .as_mut()
            .unwrap()
            .env
            .insert("X".into(), "1".into());
        e.packages[1].build.as_mut().unwrap().against = vec![];
        let fields: Vec<String> = l
            .check_against(&e)
            .unwrap_err()
            .changes
            .into_iter()
            .map(|c| c.field)
            .collect();
        assert_eq!(
            fields,
            [
                "env.index",
                "env.packages[1].build.env",
                "env.packages[1].build.against"
            ]
        );

        let mut e = env();
        e.toolchain = None;
        let s = l.check_against(&e).unwrap_err();
        assert_eq!(s.changes[0].field, "env.toolchain");
    }

    /// Issue 16 items 1 and 15: a lockfile (e.g. from a pull request) with hostile artifact fields is refused
    /// when read, naming the package and the field.
    #[test]
    fn hostile_artifact_fields_are_refused_when_read() {
        let good = lock().to_toml();
        let aa_sha = format!("sha256 = \"{}\"", "ab".repeat(32));
        let aa_url = "url = \"http://127.0.0.1:1/files/aa-2.0-py3-none-any.whl\"";
        let aa_file = "filename = \"aa-2.0-py3-none-any.whl\"";
        let cases: Vec<(String, &str)> = vec![
            (
                good.replacen(&aa_sha, "sha256 = \"../../../../tmp/x\"", 1),
                "not a sha256",
            ),
            (good.replacen(&aa_sha, "sha256 = \"\"", 1), "not a sha256"),
            (
                good.replacen(aa_file, "filename = \"../../aa-2.0-py3-none-any.whl\"", 1),
                "not a plain file name",
            ),
            (
                good.replacen(aa_file, "filename = \"evil-2.0-py3-none-any.whl\"", 1),
                "is not a file of aa 2.0",
            ),
            (
                good.replacen(aa_file, "filename = \"aa-2.0.tar.gz\"", 1),
                "does not end like a wheel",
            ),
            (
                good.replacen(aa_url, "url = \"file:///dev/zero\"", 1),
                "index `http://127.0.0.1:1/simple` is not local",
            ),
            (
                good.replacen(aa_url, "url = \"/dev/zero\"", 1),
                "is not local",
            ),
            (
                good.replacen(
                    aa_url,
                    "url = \"ftp://127.0.0.1/aa-2.0-py3-none-any.whl\"",
                    1,
                ),
                "scheme `ftp`",
            ),
            (
                good.replacen("name = \"aa\"", "name = \"../aa\"", 1),
                "not a normalized package name",
            ),
            (
                good.replacen("version = \"2.0\"", "version = \"2.0; rm -rf /\"", 1),
                "not a PEP 440 version",
            ),
        ];
        for (text, reason) in cases {
            assert_ne!(
                text, good,
                "the case for {reason} did not change the lockfile"
            );
            let err = Lockfile::parse(&text, Path::new("t.hvd.lock"))
                .unwrap_err()
                .to_string();
            assert!(err.contains(reason), "{reason}: {err}");
            assert!(err.contains("t.hvd.lock"), "{err}");
        }
        // A local artifact of a local index is fine.
        let local = good
            .replace(
                "index = \"http://127.0.0.1:1/simple\"",
                "index = \"file:///srv/simple\"",
            )
            .replacen(
                aa_url,
                "url = \"file:///srv/files/aa-2.0-py3-none-any.whl\"",
                1,
            );
        Lockfile::parse(&local, Path::new("t.hvd.lock")).unwrap();
    }

    /// Low item: concurrent `hvd lock` runs shared one temp file name, so one run's rename failed or moved the
    /// other's half-written file into place.
    #[test]
    fn concurrent_writes_never_share_a_temp_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("train.hvd.lock");
        let l = lock();
        std::thread::scope(|scope| {
            for _ in 0..8 {
                scope.spawn(|| {
                    for _ in 0..40 {
                        l.write(&path).unwrap();
                    }
                });
            }
        });
        assert_eq!(Lockfile::read(&path).unwrap().to_toml(), l.to_toml());
        let left: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        assert_eq!(left, [std::ffi::OsString::from("train.hvd.lock")]);
    }

    #[test]
    fn lock_path_appends_suffix() {
        assert_eq!(
            Lockfile::path_for(Path::new("a/train.hvd")),
            PathBuf::from("a/train.hvd.lock")
        );
    }
}
