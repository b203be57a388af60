//! Signing keys of a binary cache: ed25519 key pairs in the text form `NAME:<base64>`, signing and verifying.
//!
//! A secret key file holds `NAME:<base64 of the 32-byte seed>`, a public key file `NAME:<base64 of the 32-byte
//! public key>` (one line each). The name travels with every signature, so a verifier knows which trusted key to
//! check it against; names are `[A-Za-z0-9._-]`, 1 to 64 characters.

use std::path::Path;

use base64::Engine;
use base64::engine::general_purpose::STANDARD;
use ed25519_dalek::Signer;

use super::CacheError;

/// The longest key name.
const MAX_NAME: usize = 64;

/// A key that signs records (`hvd cache push --key`).
pub struct SecretKey {
    name: String,
    key: ed25519_dalek::SigningKey,
}

impl std::fmt::Debug for SecretKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SecretKey")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

/// A key whose signatures are trusted (`--trusted-key`, `HVD_TRUSTED_KEYS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublicKey {
    name: String,
    key: ed25519_dalek::VerifyingKey,
}

/// Check a key name: `[A-Za-z0-9._-]`, 1 to 64 characters.
pub fn check_key_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME {
        return Err(format!(
            "a key name has 1 to {MAX_NAME} characters, `{}` has {}",
            name.chars()
                .take(MAX_NAME)
                .flat_map(char::escape_debug)
                .collect::<String>(),
            name.len()
        ));
    }
    if let Some(bad) = name
        .chars()
        .find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')))
    {
        return Err(format!(
            "a key name may hold letters, digits, `.`, `_` and `-`; `{}` has {bad:?}",
            name.escape_debug()
        ));
    }
    Ok(())
}

/// Split `NAME:<base64>` into the name and 32 bytes.
fn parse_text(text: &str, what: &str) -> Result<(String, [u8; 32]), String> {
    let text = text.trim();
    let (name, data) = text
        .split_once(':')
        .ok_or_else(|| format!("a {what} is `NAME:<base64>`; this one has no `:`"))?;
    check_key_name(name)?;
    let bytes = STANDARD
        .decode(data)
        .map_err(|err| format!("the {what} `{name}` is not valid base64: {err}"))?;
    let bytes: [u8; 32] = bytes.try_into().map_err(|bytes: Vec<u8>| {
        format!(
            "the {what} `{name}` has {} bytes, an ed25519 key has 32",
            bytes.len()
        )
    })?;
    Ok((name.to_string(), bytes))
}

impl SecretKey {
    /// A fresh key named `name`, from the operating system's random source.
    pub fn generate(name: &str) -> Result<SecretKey, CacheError> {
        check_key_name(name).map_err(|message| CacheError::Key {
            key: name.to_string(),
            message,
        })?;
        let mut seed = [0u8; 32];
        getrandom::fill(&mut seed).map_err(|err| CacheError::Key {
            key: name.to_string(),
            message: format!("no random bytes from the operating system: {err}"),
        })?;
        Ok(SecretKey {
            name: name.to_string(),
            key: ed25519_dalek::SigningKey::from_bytes(&seed),
        })
    }

    /// Parse `NAME:<base64 seed>`.
    pub fn parse(text: &str) -> Result<SecretKey, String> {
        let (name, seed) = parse_text(text, "secret key")?;
        Ok(SecretKey {
            name,
            key: ed25519_dalek::SigningKey::from_bytes(&seed),
        })
    }

    /// Read a secret key file.
    pub fn read(path: &Path) -> Result<SecretKey, CacheError> {
        use std::os::unix::fs::MetadataExt;
        let metadata = fs_err::metadata(path)?;
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let refuse = |message: String| CacheError::Key {
            key: path.display().to_string(),
            message,
        };
        if metadata.uid() != me {
            return Err(refuse(format!(
                "the secret key file is owned by user {}, not by you (user {me}): someone else could have \
                 replaced it; use your own key file (`chmod 600` it)",
                metadata.uid()
            )));
        }
        if metadata.mode() & 0o077 != 0 {
            return Err(refuse(format!(
                "the secret key file is readable or writable by others (mode {:o}): run `chmod 600 {}`, and make \
                 a new key pair if others may have read it",
                metadata.mode() & 0o777,
                path.display()
            )));
        }
        let text = fs_err::read_to_string(path)?;
        SecretKey::parse(&text).map_err(|message| CacheError::Key {
            key: path.display().to_string(),
            message,
        })
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `NAME:<base64 seed>`.
    pub fn to_text(&self) -> String {
        format!("{}:{}", self.name, STANDARD.encode(self.key.to_bytes()))
    }

    pub fn public(&self) -> PublicKey {
        PublicKey {
            name: self.name.clone(),
            key: self.key.verifying_key(),
        }
    }

    /// The base64 signature of `message`.
    pub fn sign(&self, message: &[u8]) -> String {
        STANDARD.encode(self.key.sign(message).to_bytes())
    }
}

impl PublicKey {
    /// Parse `NAME:<base64 public key>`.
    pub fn parse(text: &str) -> Result<PublicKey, String> {
        let (name, bytes) = parse_text(text, "public key")?;
        let key = ed25519_dalek::VerifyingKey::from_bytes(&bytes)
            .map_err(|err| format!("the public key `{name}` is not an ed25519 point: {err}"))?;
        Ok(PublicKey { name, key })
    }

    /// A trusted key as given on the command line or in `HVD_TRUSTED_KEYS`: `NAME:<base64>` itself, or the path
    /// of a public key file. A key's text is always the key, never a path: the nodes read `--trusted-key=TEXT` in
    /// the project's directory, where a file of that name (a project's content comes from others) would otherwise
    /// be read as the key to trust.
    pub fn from_arg(arg: &str) -> Result<PublicKey, CacheError> {
        if let Ok(key) = PublicKey::parse(arg) {
            return Ok(key);
        }
        let error = |message| CacheError::Key {
            key: arg.to_string(),
            message,
        };
        let path = Path::new(arg);
        if path.is_file() {
            let text = fs_err::read_to_string(path)?;
            return PublicKey::parse(&text).map_err(error);
        }
        PublicKey::parse(arg)
            .map_err(|message| error(format!("{message} (and it is not a key file either)")))
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// `NAME:<base64 public key>`.
    pub fn to_text(&self) -> String {
        format!("{}:{}", self.name, STANDARD.encode(self.key.to_bytes()))
    }

    /// Whether `signature` (base64) is this key's signature of `message`.
    pub fn verifies(&self, message: &[u8], signature: &str) -> bool {
        let Ok(bytes) = STANDARD.decode(signature) else {
            return false;
        };
        let Ok(bytes) = <[u8; 64]>::try_from(bytes) else {
            return false;
        };
        let signature = ed25519_dalek::Signature::from_bytes(&bytes);
        self.key.verify_strict(message, &signature).is_ok()
    }
}

/// Write a fresh key pair: `<dir>/<name>.secret` (mode 0600, created new: an existing file is never overwritten)
/// and `<dir>/<name>.public`. Returns both paths.
pub fn write_key_pair(
    name: &str,
    dir: &Path,
) -> Result<(std::path::PathBuf, std::path::PathBuf), CacheError> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let key = SecretKey::generate(name)?;
    fs_err::create_dir_all(dir)?;
    let secret = dir.join(format!("{name}.secret"));
    let public = dir.join(format!("{name}.public"));
    for path in [&secret, &public] {
        if fs_err::symlink_metadata(path).is_ok() {
            return Err(CacheError::Key {
                key: path.display().to_string(),
                message: "already exists; remove it or choose another name or directory".into(),
            });
        }
    }
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&secret)
        .map_err(|err| {
            std::io::Error::new(
                err.kind(),
                format!("failed to create `{}`: {err}", secret.display()),
            )
        })?;
    file.write_all(format!("{}\n", key.to_text()).as_bytes())?;
    crate::store::write_new_file(
        &public,
        format!("{}\n", key.public().to_text()).as_bytes(),
        0o644,
    )?;
    Ok((secret, public))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_round_trip_and_sign() {
        let key = SecretKey::generate("test-1").unwrap();
        let again = SecretKey::parse(&key.to_text()).unwrap();
        assert_eq!(again.public(), key.public());
        let public = PublicKey::parse(&key.public().to_text()).unwrap();
        let signature = key.sign(b"message");
        assert!(public.verifies(b"message", &signature));
        assert!(!public.verifies(b"messagE", &signature));
        let other = SecretKey::generate("test-1").unwrap().public();
        assert!(!other.verifies(b"message", &signature));
        assert!(!public.verifies(b"message", "not base64!"));
    }

    /// A project plants a file whose path is the trusted key's text, holding its own key: the text is the key
    /// trusted, not the file's (a file given by its path still works).
    #[test]
    fn a_keys_text_is_never_read_as_a_path() {
        let dir = tempfile::tempdir().unwrap();
        let trusted = SecretKey::generate("trusted").unwrap().public();
        let planted = SecretKey::generate("trusted").unwrap().public();
        let text = trusted.to_text();
        let path = dir.path().join(&text);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, planted.to_text()).unwrap();
        let here = std::env::current_dir().unwrap();
        // Relative, as a node reads it in the project's directory.
        let relative = path
            .strip_prefix(dir.path())
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned();
        assert_eq!(relative, text);
        let cwd_key = std::panic::catch_unwind(|| {
            std::env::set_current_dir(dir.path()).unwrap();
            PublicKey::from_arg(&relative).unwrap()
        });
        std::env::set_current_dir(here).unwrap();
        assert_eq!(cwd_key.unwrap(), trusted);
        // A key file by its path.
        let file = dir.path().join("k.public");
        std::fs::write(&file, planted.to_text()).unwrap();
        assert_eq!(
            PublicKey::from_arg(file.to_str().unwrap()).unwrap(),
            planted
        );
    }

    #[test]
    fn bad_keys_are_refused_with_a_reason() {
        assert!(PublicKey::parse("no-colon").unwrap_err().contains("`:`"));
        assert!(
            PublicKey::parse("a/b:AAAA")
                .unwrap_err()
                .contains("key name")
        );
        assert!(PublicKey::parse("k:AAAA").unwrap_err().contains("32"));
        assert!(check_key_name("").is_err());
        assert!(check_key_name(&"x".repeat(65)).is_err());
    }

    #[test]
    fn key_pair_files_are_private_and_never_overwritten() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let (secret, public) = write_key_pair("k", dir.path()).unwrap();
        let mode = fs_err::metadata(&secret).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        let key = SecretKey::read(&secret).unwrap();
        assert_eq!(
            PublicKey::from_arg(&public.display().to_string()).unwrap(),
            key.public()
        );
        assert!(write_key_pair("k", dir.path()).is_err());

        // A secret key others can read is refused, naming the file and the fix.
        fs_err::set_permissions(&secret, std::fs::Permissions::from_mode(0o644)).unwrap();
        let err = SecretKey::read(&secret).unwrap_err().to_string();
        assert!(
            err.contains(&secret.display().to_string()) && err.contains("chmod 600"),
            "{err}"
        );
        fs_err::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert!(SecretKey::read(&secret).is_ok());

        // A link planted at the public key's name is not written through.
        let other = tempfile::tempdir().unwrap();
        let victim = other.path().join("victim");
        fs_err::write(&victim, "mine").unwrap();
        std::os::unix::fs::symlink(&victim, other.path().join("j.public")).unwrap();
        assert!(write_key_pair("j", other.path()).is_err());
        assert_eq!(fs_err::read_to_string(&victim).unwrap(), "mine");
    }
}
