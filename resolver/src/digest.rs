//! [`Sha256`]: a validated sha256 digest. Every hash that comes from outside (an index page, a lockfile) is parsed
//! into this type where it is read, so a string like `../../x` never travels further than the parser: it cannot
//! become part of a file name, and it cannot be written into a lockfile.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::Digest;

/// A sha256 digest: exactly 64 hex digits, stored lowercase. Parsing accepts upper case (and normalizes it) and
/// nothing else: no `sha256:` prefix, no whitespace, no other length.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct Sha256(String);

/// A string that is not a sha256 digest.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{shown}` is not a sha256 digest (64 hex digits)")]
pub struct BadSha256 {
    /// The offending text, cut to 80 characters and with control characters escaped (it may be hostile).
    pub shown: String,
}

impl BadSha256 {
    fn new(text: &str) -> BadSha256 {
        let mut shown: String = text.chars().take(80).flat_map(char::escape_debug).collect();
        if text.chars().count() > 80 {
            shown.push_str("...");
        }
        BadSha256 { shown }
    }
}

impl Sha256 {
    /// The 64 lowercase hex digits.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The digest of `bytes`.
    pub fn of_bytes(bytes: &[u8]) -> Sha256 {
        Sha256(hex::encode(sha2::Sha256::digest(bytes)))
    }

    /// The digest a running hasher has computed.
    pub fn from_hasher(hasher: sha2::Sha256) -> Sha256 {
        Sha256(hex::encode(hasher.finalize()))
    }
}

impl FromStr for Sha256 {
    type Err = BadSha256;

    fn from_str(text: &str) -> Result<Sha256, BadSha256> {
        if text.len() == 64 && text.bytes().all(|b| b.is_ascii_hexdigit()) {
            Ok(Sha256(text.to_ascii_lowercase()))
        } else {
            Err(BadSha256::new(text))
        }
    }
}

impl TryFrom<String> for Sha256 {
    type Error = BadSha256;

    fn try_from(text: String) -> Result<Sha256, BadSha256> {
        text.parse()
    }
}

impl From<Sha256> for String {
    fn from(hash: Sha256) -> String {
        hash.0
    }
}

impl fmt::Display for Sha256 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl AsRef<str> for Sha256 {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_exactly_64_hex_digits_and_normalizes_case() {
        let upper = "AB".repeat(32);
        assert_eq!(upper.parse::<Sha256>().unwrap().as_str(), "ab".repeat(32));
        assert_eq!(Sha256::of_bytes(b"").as_str().len(), 64);
        for bad in [
            String::new(),
            "ab".repeat(31),
            "ab".repeat(33),
            format!("../../{}", "a".repeat(58)),
            format!("{}g", "a".repeat(63)),
            format!("sha256:{}", "a".repeat(64)),
            format!(" {}", "a".repeat(63)),
            format!("{}\n", "a".repeat(63)),
            // Multi-byte characters: 64 bytes but not 64 digits.
            "é".repeat(32),
        ] {
            let err = bad.parse::<Sha256>().unwrap_err();
            assert!(err.to_string().contains("not a sha256"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn deserializing_validates() {
        #[derive(Deserialize)]
        struct T {
            h: Sha256,
        }
        assert!(toml::from_str::<T>("h = \"../../etc/passwd\"").is_err());
        assert!(toml::from_str::<T>("h = \"\"").is_err());
        let ok: T = toml::from_str(&format!("h = \"{}\"", "F".repeat(64))).unwrap();
        assert_eq!(ok.h.as_str(), "f".repeat(64));
    }

    #[test]
    fn long_hostile_text_is_cut_and_escaped_in_errors() {
        let err = format!("\u{1b}[2J{}", "x".repeat(500))
            .parse::<Sha256>()
            .unwrap_err();
        assert!(!err.shown.contains('\u{1b}'));
        assert!(err.shown.len() < 100, "{}", err.shown);
    }
}
