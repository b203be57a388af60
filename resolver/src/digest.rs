//! [`Sha256`]: a validated sha256 digest. Every hash that comes from outside (an index page, a lockfile) is parsed
//! into this type where it is read, so a string like `../../x` never travels further than the parser: it cannot
//! become part of a file name, and it cannot be written into a lockfile. The builder uses the same type.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sha2::Digest;

/// A sha256 digest: exactly 64 hex digits, stored lowercase. Parsing accepts upper case (and normalizes it) and
/// nothing else: no whitespace, no other length, and no `sha256:` prefix (only [`Sha256::parse_prefixed`] takes one).
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

    /// The digest of a file's contents, read in 64 KiB pieces.
    pub fn of_file(path: &std::path::Path) -> std::io::Result<Sha256> {
        use std::io::Read as _;
        let mut file = fs_err::File::open(path)?;
        let mut hasher = sha2::Sha256::new();
        let mut buffer = vec![0u8; 1 << 16];
        loop {
            let n = file.read(&mut buffer)?;
            if n == 0 {
                break;
            }
            hasher.update(&buffer[..n]);
        }
        Ok(Sha256::from_hasher(hasher))
    }

    /// The digest as a wheel's RECORD writes it (PEP 376/427): URL-safe base64 of the 32 bytes, no padding.
    pub fn record_form(&self) -> String {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let bytes = hex::decode(&self.0).expect("a Sha256 holds 64 hex digits");
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let b = [
                chunk[0],
                *chunk.get(1).unwrap_or(&0),
                *chunk.get(2).unwrap_or(&0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..=chunk.len() {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }

    /// Parse a digest written by a person, which may carry a `sha256:` prefix (as `hvd`'s own messages print
    /// it); otherwise exactly what [`FromStr`] accepts.
    pub fn parse_prefixed(text: &str) -> Result<Sha256, BadSha256> {
        text.strip_prefix("sha256:").unwrap_or(text).parse()
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
    fn only_parse_prefixed_takes_the_prefix() {
        let text = "sha256:ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef0123456789";
        let hash = Sha256::parse_prefixed(text).unwrap();
        assert_eq!(
            hash.as_str(),
            "abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789"
        );
        assert_eq!(Sha256::parse_prefixed(hash.as_str()).unwrap(), hash);
        assert!(text.parse::<Sha256>().is_err());
        for bad in ["xyz", "sha256:", "sha256:sha256:ab", "md5:ab"] {
            assert!(Sha256::parse_prefixed(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn record_form_is_unpadded_urlsafe_base64() {
        // The sha256 of the empty string, in RECORD form as pip writes it.
        assert_eq!(
            Sha256::of_bytes(b"").record_form(),
            "47DEQpj8HBSa-_TImW-5JCeuQeRkm5NMpJWZG3hSuFU"
        );
        // 0xfb 0xff ... exercises both URL-safe characters.
        let hash: Sha256 = format!("fbff{}", "0".repeat(60)).parse().unwrap();
        assert!(
            hash.record_form().starts_with("-_8A"),
            "{}",
            hash.record_form()
        );
        assert_eq!(hash.record_form().len(), 43);
    }

    #[test]
    fn of_file_is_of_bytes_of_its_contents() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        let bytes: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        std::fs::write(&path, &bytes).unwrap();
        assert_eq!(Sha256::of_file(&path).unwrap(), Sha256::of_bytes(&bytes));
        assert!(Sha256::of_file(&dir.path().join("missing")).is_err());
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
