//! Derivations: the canonical description of everything that goes into one store path.
//!
//! The store path's hash is the sha256 of the derivation's canonical JSON (struct fields in declaration order,
//! maps sorted by key, no whitespace), so equal inputs give equal paths and any changed input gives a new one
//! (Nix's input addressing). `SCHEMA` is part of the hash: bump it when the meaning of an input changes.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use hvd_resolver::Sha256;

/// Version of the derivation format; part of every hash.
pub(crate) const SCHEMA: u32 = 1;

/// What kind of store path a derivation produces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum DerivationKind {
    /// A wheel unpacked into a site-packages layout.
    Wheel,
    /// An sdist built with its PEP 517 backend, then installed like a wheel.
    SourceBuild,
    /// A directory of Python packages from the local machine (e.g. the hvd worker runtime).
    Local,
    /// A venv-layout environment linking package paths.
    Env,
    /// A compiler toolchain assembled from pinned packages (a gcc from Debian's archive, `debian/`).
    Toolchain,
    /// A base interpreter's own installation copied from the host and relocated (`interpreter.rs`).
    Interpreter,
}

/// Every input of one store path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Derivation {
    pub schema: u32,
    pub kind: DerivationKind,
    /// Normalized package (or env) name.
    pub name: String,
    pub version: String,
    /// Plain inputs: artifact sha256s, recipe environment (`env.NAME`), toolchain, platform, interpreter, ...
    pub inputs: BTreeMap<String, String>,
    /// Hashes of input derivations by role, e.g. `against.tensorflow-cpu`, `requires.setuptools`, `package.numpy`.
    pub input_derivations: BTreeMap<String, String>,
}

impl Derivation {
    /// A derivation with no inputs yet.
    pub fn new(kind: DerivationKind, name: &str, version: &str) -> Derivation {
        Derivation {
            schema: SCHEMA,
            kind,
            name: normalize_name(name),
            version: version.to_string(),
            inputs: BTreeMap::new(),
            input_derivations: BTreeMap::new(),
        }
    }

    /// Add a plain input.
    pub fn input(mut self, key: &str, value: impl Into<String>) -> Derivation {
        self.inputs.insert(key.to_string(), value.into());
        self
    }

    /// The canonical serialization the hash covers.
    pub(crate) fn canonical_json(&self) -> String {
        // Serializing plain structs and BTreeMaps of strings cannot fail.
        serde_json::to_string(self).unwrap_or_default()
    }

    /// The first 32 hex digits of the sha256 of the canonical serialization.
    pub fn hash(&self) -> String {
        let mut text = String::from("hvd-derivation\n");
        text.push_str(&self.canonical_json());
        Sha256::of_bytes(text.as_bytes()).as_str()[..32].to_string()
    }

    /// The store path's directory name: `<hash>-<name>-<version>`.
    pub fn path_name(&self) -> String {
        format!("{}-{}-{}", self.hash(), self.name, sanitize(&self.version))
    }
}

/// A package name as a store path name: PEP 503 normalized ([`hvd_resolver::names::normalize_name`]), then
/// kept to a safe alphabet.
pub fn normalize_name(name: &str) -> String {
    sanitize(&hvd_resolver::names::normalize_name(name))
}

/// Keep store path names to a safe alphabet.
fn sanitize(text: &str) -> String {
    text.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '-' | '.' | '+' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_stable_and_sensitive() {
        let a =
            Derivation::new(DerivationKind::Wheel, "Foo_Bar", "1.0").input("artifact.sha256", "00");
        let b =
            Derivation::new(DerivationKind::Wheel, "foo-bar", "1.0").input("artifact.sha256", "00");
        assert_eq!(a.hash(), b.hash());
        assert_eq!(a.hash().len(), 32);
        assert!(a.path_name().ends_with("-foo-bar-1.0"));
        let c = b.clone().input("artifact.sha256", "01");
        assert_ne!(a.hash(), c.hash());
        let mut d = b.clone();
        d.input_derivations
            .insert("against.fwk".into(), "abc".into());
        assert_ne!(b.hash(), d.hash());
    }

    #[test]
    fn names_normalize() {
        assert_eq!(normalize_name("Tensorflow_CPU"), "tensorflow-cpu");
        assert_eq!(normalize_name("a.-_b"), "a-b");
    }
}
