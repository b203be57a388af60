//! The signed record of one store path in a binary cache (`<cache>/<path-name>.info`, JSON): what it is, where
//! its archive is, what it needs, and who vouches for it.
//!
//! A signature covers [`Record::fingerprint`]: the path name, the store directory it was built for, the
//! derivation hash, the content hash, the archive's sha256 and size, and the references. The derivation itself is bound through its hash (a record whose
//! derivation does not hash to `derivation_hash`, or does not name the path, is refused).

use std::collections::BTreeSet;

use serde::{Deserialize, Serialize};

use hvd_resolver::Sha256;

use super::key::{PublicKey, SecretKey};
use crate::derivation::Derivation;

/// The record format this hvd writes and reads.
pub const RECORD_FORMAT: u32 = 2;
/// A record larger than this is refused unread (real ones are a few KB; an env's references dominate).
pub const MAX_RECORD_BYTES: u64 = 4 << 20;
/// Signatures one record may carry.
const MAX_SIGNATURES: usize = 16;

/// The archive of a store path in the cache (`archives/<sha256>.tar.zst`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ArchiveInfo {
    pub sha256: Sha256,
    pub size: u64,
}

/// One signature: the key's name and the base64 ed25519 signature of the fingerprint.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Signature {
    pub key: String,
    pub sig: String,
}

/// What a cache says about one store path.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Record {
    pub format: u32,
    /// The store path's name, `<hash>-<name>-<version>`.
    pub name: String,
    /// The store directory the path was built in (its files may name it: script lines, absolute links).
    pub store: String,
    pub derivation_hash: String,
    pub derivation: Derivation,
    /// The tree's content hash ([`crate::hash::content_hash`]), checked after unpacking.
    pub content_hash: Sha256,
    /// Store path names this path needs at run time; substituted before it.
    pub references: BTreeSet<String>,
    pub archive: ArchiveInfo,
    pub signatures: Vec<Signature>,
}

/// Whether a record is vouched for by a trusted key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Trust {
    /// Signed by this trusted key.
    Trusted(String),
    /// No signature names a trusted key (unsigned, or signed only by others).
    Untrusted,
    /// A signature names a trusted key but does not verify: the record was changed after signing (or forged).
    BadSignature(String),
}

/// The file name of a path's record in the cache.
pub fn record_key(path_name: &str) -> String {
    format!("{path_name}.info")
}

/// The cache key of an archive.
pub fn archive_key(sha256: &Sha256) -> String {
    format!("archives/{}.tar.zst", sha256.as_str())
}

/// Check a store path name as a record may give it: 32 lowercase hex digits, `-`, then `[A-Za-z0-9._+-]`, at
/// most 200 characters. Such a name is one path component that is never `.` or `..`.
pub fn check_path_name(name: &str) -> Result<(), String> {
    let shown = name.escape_debug();
    if name.len() > 200 {
        return Err(format!("`{shown}` is longer than 200 characters"));
    }
    let (hash, rest) = name.split_at_checked(32).unwrap_or((name, ""));
    if hash.len() != 32 || !hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f')) {
        return Err(format!(
            "`{shown}` does not start with a 32-digit derivation hash"
        ));
    }
    let Some(rest) = rest.strip_prefix('-') else {
        return Err(format!("`{shown}` has no `-` after its hash"));
    };
    if rest.is_empty()
        || !rest
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '+' | '-'))
    {
        return Err(format!(
            "`{shown}` has characters a store path name never has"
        ));
    }
    Ok(())
}

impl Record {
    /// An unsigned record.
    pub fn new(
        store: &std::path::Path,
        derivation: Derivation,
        content_hash: Sha256,
        references: BTreeSet<String>,
        archive: ArchiveInfo,
    ) -> Record {
        Record {
            format: RECORD_FORMAT,
            name: derivation.path_name(),
            store: store.display().to_string(),
            derivation_hash: derivation.hash(),
            derivation,
            content_hash,
            references,
            archive,
            signatures: Vec::new(),
        }
    }

    /// The bytes a signature covers, one field per line.
    pub fn fingerprint(&self) -> Vec<u8> {
        let mut text = format!(
            "hvd-cache-record-v{}\nname {}\nstore {}\nderivation {}\ncontent {}\narchive {} {}\nreferences {}\n",
            self.format,
            self.name,
            self.store,
            self.derivation_hash,
            self.content_hash,
            self.archive.sha256,
            self.archive.size,
            self.references.len()
        );
        for reference in &self.references {
            text.push_str(reference);
            text.push('\n');
        }
        text.into_bytes()
    }

    /// Add `key`'s signature (replacing an earlier one by a key of the same name).
    pub fn sign(&mut self, key: &SecretKey) {
        let sig = key.sign(&self.fingerprint());
        self.signatures.retain(|s| s.key != key.name());
        self.signatures.push(Signature {
            key: key.name().to_string(),
            sig,
        });
    }

    /// Parse and check a record's bytes: the format, every name, the derivation against its hash and the path
    /// name. The reason is returned on refusal. Signatures are checked by [`Record::trust`].
    pub fn parse(bytes: &[u8]) -> Result<Record, String> {
        if bytes.len() as u64 > MAX_RECORD_BYTES {
            return Err(format!(
                "it has {} bytes, more than the {MAX_RECORD_BYTES} a record may have",
                bytes.len()
            ));
        }
        let record: Record =
            serde_json::from_slice(bytes).map_err(|err| format!("it is not a record: {err}"))?;
        record.check()?;
        Ok(record)
    }

    fn check(&self) -> Result<(), String> {
        if self.format != RECORD_FORMAT {
            return Err(format!(
                "it has format {}; this hvd reads format {RECORD_FORMAT}",
                self.format
            ));
        }
        check_path_name(&self.name).map_err(|err| format!("its name {err}"))?;
        if !self.store.starts_with('/')
            || self.store.len() > 4096
            || self.store.chars().any(|c| c.is_control())
        {
            return Err(format!(
                "its store directory `{}` is not an absolute path",
                self.store
                    .chars()
                    .take(200)
                    .flat_map(char::escape_debug)
                    .collect::<String>()
            ));
        }
        for reference in &self.references {
            check_path_name(reference).map_err(|err| format!("its reference {err}"))?;
        }
        if self.derivation.hash() != self.derivation_hash {
            return Err(format!(
                "its derivation hashes to {}, not to its derivation hash {}",
                self.derivation.hash(),
                self.derivation_hash
            ));
        }
        if self.derivation.path_name() != self.name {
            return Err(format!(
                "its derivation names the path `{}`, not `{}`",
                self.derivation.path_name(),
                self.name
            ));
        }
        if self.signatures.len() > MAX_SIGNATURES {
            return Err(format!(
                "it has {} signatures, more than {MAX_SIGNATURES}",
                self.signatures.len()
            ));
        }
        for signature in &self.signatures {
            // Key names are printed (who signed an untrusted record): no escapes, newlines or megabytes.
            super::key::check_key_name(&signature.key)
                .map_err(|err| format!("a signature has a bad key name: {err}"))?;
        }
        Ok(())
    }

    /// Whether a key of `trusted` vouches for this record.
    pub fn trust(&self, trusted: &[PublicKey]) -> Trust {
        let fingerprint = self.fingerprint();
        let mut bad = None;
        for signature in &self.signatures {
            for key in trusted.iter().filter(|k| k.name() == signature.key) {
                if key.verifies(&fingerprint, &signature.sig) {
                    return Trust::Trusted(key.name().to_string());
                }
                bad.get_or_insert_with(|| key.name().to_string());
            }
        }
        match bad {
            Some(key) => Trust::BadSignature(key),
            None => Trust::Untrusted,
        }
    }

    /// The record as the cache stores it.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut text = serde_json::to_string_pretty(self).unwrap_or_default();
        text.push('\n');
        text.into_bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::derivation::DerivationKind;

    /// One edit of a record.
    type Change = Box<dyn Fn(&mut Record)>;

    fn record() -> Record {
        let derivation =
            Derivation::new(DerivationKind::Wheel, "demo", "1.0").input("artifact.sha256", "ab");
        let reference =
            Derivation::new(DerivationKind::Wheel, "dep", "2.0").input("artifact.sha256", "cd");
        Record::new(
            std::path::Path::new("/store"),
            derivation,
            Sha256::of_bytes(b"tree"),
            [reference.path_name()].into(),
            ArchiveInfo {
                sha256: Sha256::of_bytes(b"archive"),
                size: 7,
            },
        )
    }

    #[test]
    fn a_signed_record_round_trips_and_verifies() {
        let key = SecretKey::generate("cache-1").unwrap();
        let mut record = record();
        record.sign(&key);
        let parsed = Record::parse(&record.to_bytes()).unwrap();
        assert_eq!(parsed, record);
        assert_eq!(
            parsed.trust(&[key.public()]),
            Trust::Trusted("cache-1".into())
        );
        // Another key of another name: untrusted; another key under the same name: a bad signature.
        let stranger = SecretKey::generate("stranger").unwrap().public();
        assert_eq!(parsed.trust(&[stranger]), Trust::Untrusted);
        let impostor = SecretKey::generate("cache-1").unwrap().public();
        assert_eq!(
            parsed.trust(&[impostor]),
            Trust::BadSignature("cache-1".into())
        );
    }

    #[test]
    fn every_signed_field_breaks_the_signature() {
        let key = SecretKey::generate("k").unwrap();
        let mut signed = record();
        signed.sign(&key);
        let changes: Vec<Change> = vec![
            Box::new(|r| r.content_hash = Sha256::of_bytes(b"other")),
            Box::new(|r| r.archive.sha256 = Sha256::of_bytes(b"other")),
            Box::new(|r| r.archive.size += 1),
            Box::new(|r| r.store = "/other-store".into()),
            Box::new(|r| {
                r.references.clear();
            }),
            Box::new(|r| {
                let other = Derivation::new(DerivationKind::Wheel, "demo", "1.1");
                r.name = other.path_name();
                r.derivation_hash = other.hash();
                r.derivation = other;
            }),
        ];
        for change in changes {
            let mut changed = signed.clone();
            change(&mut changed);
            let parsed = Record::parse(&changed.to_bytes()).unwrap();
            assert_eq!(
                parsed.trust(&[key.public()]),
                Trust::BadSignature("k".into())
            );
        }
    }

    #[test]
    fn unsafe_names_and_foreign_derivations_are_refused_even_when_signed() {
        let key = SecretKey::generate("k").unwrap();
        let cases: Vec<(Change, &str)> = vec![
            (Box::new(|r| r.name = "../x".into()), "derivation hash"),
            (
                Box::new(|r| r.name = format!("{}-../../x", r.derivation_hash)),
                "characters",
            ),
            (
                Box::new(|r| {
                    r.references.insert("../../etc".into());
                }),
                "reference",
            ),
            (
                Box::new(|r| r.derivation_hash = "0".repeat(32)),
                "hashes to",
            ),
            (Box::new(|r| r.format = 1), "format 1"),
            (
                Box::new(|r| r.store = "relative\nx".into()),
                "not an absolute path",
            ),
            (
                Box::new(|r| r.signatures[0].key = "\x1b]0;owned\x07\nk".into()),
                "bad key name",
            ),
            (
                Box::new(|r| r.signatures[0].key = "k".repeat(1 << 20)),
                "bad key name: a key name has 1 to 64",
            ),
        ];
        for (change, reason) in cases {
            let mut record = record();
            record.sign(&key);
            change(&mut record);
            let err = Record::parse(&record.to_bytes()).unwrap_err();
            assert!(err.contains(reason), "{err}");
            assert!(
                err.len() < 1024 && !err.contains('\x1b') && !err.contains('\n'),
                "{err}"
            );
        }
        assert!(Record::parse(b"{}").is_err());
        assert!(Record::parse(&vec![b' '; MAX_RECORD_BYTES as usize + 1]).is_err());
    }
}
