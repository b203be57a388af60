//! Package names and file names: PEP 503 name normalization, a requirement in canonical form, and the project
//! name and version a wheel (PEP 427) or sdist file name carries.

use std::str::FromStr;

use pep440_rs::Version;

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
pub(crate) fn normalize_requirement(requirement: &str) -> String {
    match pep508_rs::Requirement::<pep508_rs::VerbatimUrl>::from_str(requirement) {
        Ok(r) => r.to_string(),
        Err(_) => requirement.trim().to_string(),
    }
}

/// A parsed wheel filename (PEP 427).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct WheelName {
    pub name: String,
    pub version: String,
    pub python: Vec<String>,
    pub abi: Vec<String>,
    pub platform: Vec<String>,
}

impl FromStr for WheelName {
    type Err = ();
    fn from_str(filename: &str) -> Result<Self, ()> {
        let stem = filename.strip_suffix(".whl").ok_or(())?;
        // PEP 427 names are ASCII letters, digits, `_` and `.` (plus a version's `+` and `!`): anything else is not a
        // wheel name, and refusing it here keeps index-made strings from reaching code that slices them by byte.
        if !stem
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'+' | b'!'))
        {
            return Err(());
        }
        let parts: Vec<&str> = stem.split('-').collect();
        let (name, version, py, abi, plat) = match parts.as_slice() {
            [n, v, p, a, pl] | [n, v, _, p, a, pl] => (*n, *v, *p, *a, *pl),
            _ => return Err(()),
        };
        let split = |s: &str| s.split('.').map(str::to_string).collect::<Vec<_>>();
        Ok(WheelName {
            name: name.to_string(),
            version: version.to_string(),
            python: split(py),
            abi: split(abi),
            platform: split(plat),
        })
    }
}

/// The version in a file name of package `name` (normalized); `None` when it is not such a file name.
pub(crate) fn version_of(filename: &str, name: &str) -> Option<Version> {
    if let Ok(w) = WheelName::from_str(filename) {
        // A wheel of another project listed on this page is not a file of `name`.
        if normalize_name(&w.name) != name {
            return None;
        }
        return Version::from_str(&w.version).ok();
    }
    let stem = filename
        .strip_suffix(".tar.gz")
        .or_else(|| filename.strip_suffix(".zip"))?;
    // `name-version`: the name may itself contain `-`, so strip the normalized name prefix.
    let (_, version) = stem.rsplit_once('-')?;
    let prefix = &stem[..stem.len() - version.len() - 1];
    if normalize_name(prefix) != name {
        return None;
    }
    Version::from_str(version).ok()
}
