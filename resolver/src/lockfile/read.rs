//! Reading a lockfile: the TOML parsed, the schema version checked, and every field that comes from outside (a
//! lockfile may come from a pull request) validated before anything uses it.

use std::path::Path;
use std::str::FromStr;

use super::{ArtifactKind, LockedPackage, Lockfile, LockfileError, SCHEMA_VERSION};
use crate::names::{normalize_name, version_of};

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
        if let Some(t) = &self.toolchain {
            validate_debian(t).map_err(|e| format!("[toolchain]: {e}"))?;
        }
        if let Some(pin) = &self.target.installation {
            validate_installation(&self.target.python, &pin.version)
                .map_err(|e| format!("[target] installation: {e}"))?;
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

/// A toolchain from Debian: an http(s) archive, Debian package names and versions, files under `pool/`.
fn validate_debian(t: &super::ToolchainPin) -> Result<(), String> {
    let plain = |text: &str, extra: &str| {
        !text.is_empty()
            && text
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || extra.contains(c))
    };
    if let Some(d) = &t.debian {
        crate::debian::check_archive(&d.archive)?;
        // The builder names the compiler `<root>/usr/bin/<name>-<version>`: any other name could make CC a host
        // binary (`/usr/bin/x` joined onto the root replaces it).
        if t.name != "gcc" {
            return Err(format!(
                "name `{}` with a `debian` source: only gcc comes from Debian",
                t.name.escape_debug()
            ));
        }
        if !plain(&t.requested, ".") {
            return Err(format!(
                "requested version `{}` of a Debian toolchain is not digits and dots",
                t.requested.escape_debug()
            ));
        }
        if crate::debian::DebianArch::named(d.arch()).is_none() {
            return Err(format!(
                "debian arch `{}` is not one hvd takes a gcc from Debian for (amd64, arm64)",
                d.arch().escape_debug()
            ));
        }
        crate::debian::check_suite(&d.suite)?;
        if !plain(&d.version, ".+~-") {
            return Err("debian version has characters outside `[A-Za-z0-9.+~-]`".into());
        }
    } else if !t.debs.is_empty() {
        return Err("`debs` without a `debian` source".into());
    }
    for deb in &t.debs {
        if !plain(&deb.name, "+.-") || !plain(&deb.version, ".+~:-") {
            return Err(format!(
                "deb `{}` {}: not a Debian package name and version",
                deb.name.escape_debug(),
                deb.version.escape_debug()
            ));
        }
        if deb.size == 0 {
            return Err(format!(
                "deb `{}` has size 0: the size bounds its download, so it must be the archive's size",
                deb.name.escape_debug()
            ));
        }
        let f = &deb.filename;
        let parts_ok = f
            .split('/')
            .all(|part| !part.is_empty() && part != "." && part != "..");
        if !f.starts_with("pool/") || !f.ends_with(".deb") || !parts_ok || !plain(f, "/._+~-") {
            return Err(format!(
                "deb `{}`: filename `{}` is not a `.deb` path under `pool/`",
                deb.name,
                f.escape_debug()
            ));
        }
    }
    Ok(())
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
    if version_of(f, &p.name).as_ref() != Some(&version) {
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

/// The pinned interpreter's version names a store path: three decimal numbers (`3.11.7`), of `target.python`.
fn validate_installation(python: &str, version: &str) -> Result<(), String> {
    let parts: Vec<&str> = version.split('.').collect();
    let numeric = |p: &&str| !p.is_empty() && p.len() <= 4 && p.bytes().all(|b| b.is_ascii_digit());
    if parts.len() != 3 || !parts.iter().all(numeric) {
        return Err(format!(
            "version `{}` is not a full interpreter version like `3.11.7`",
            version.escape_debug()
        ));
    }
    if !version.starts_with(&format!("{python}.")) {
        return Err(format!(
            "version `{}` is not a python `{}`",
            version.escape_debug(),
            python.escape_debug()
        ));
    }
    Ok(())
}
