//! The NAR-like content hash of a directory tree (digests themselves are [`hvd_resolver::Sha256`]).

use std::collections::BTreeMap;
use std::fmt;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use hvd_resolver::Sha256;
use sha2::Digest;

use crate::error::Result;

/// One entry of a tree manifest: what the content hash covers for a path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManifestEntry {
    Directory,
    File { executable: bool, sha256: Sha256 },
    Symlink { target: String },
}

impl fmt::Display for ManifestEntry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ManifestEntry::Directory => f.write_str("dir"),
            ManifestEntry::File { executable, sha256 } => {
                write!(f, "file {} {sha256}", if *executable { "x" } else { "-" })
            }
            ManifestEntry::Symlink { target } => write!(f, "link {target}"),
        }
    }
}

/// The file name of the per-path metadata; excluded from the content hash.
pub const PATH_INFO_FILE: &str = ".hvd-path.json";

/// Every entry under `root` by relative path (sorted), the root's own metadata file excluded.
/// Symlinks are recorded by target and never followed.
pub fn manifest(root: &Path) -> Result<BTreeMap<String, ManifestEntry>> {
    manifest_with_known(root, &BTreeMap::new())
}

/// [`manifest`], taking the sha256 of files from `known` (relative path -> digest, computed while the files were
/// written) instead of reading them again.
pub(crate) fn manifest_with_known(
    root: &Path,
    known: &BTreeMap<String, Sha256>,
) -> Result<BTreeMap<String, ManifestEntry>> {
    let mut entries = BTreeMap::new();
    for entry in walkdir::WalkDir::new(root)
        .follow_links(false)
        .sort_by_file_name()
        .min_depth(1)
    {
        let entry = entry.map_err(|err| {
            std::io::Error::other(format!("failed to walk `{}`: {err}", root.display()))
        })?;
        let relative = entry.path().strip_prefix(root).unwrap_or(entry.path());
        let relative = relative.to_string_lossy().into_owned();
        if relative == PATH_INFO_FILE {
            continue;
        }
        let kind = entry.file_type();
        let value = if kind.is_symlink() {
            let target = fs_err::read_link(entry.path())?;
            ManifestEntry::Symlink {
                target: target.to_string_lossy().into_owned(),
            }
        } else if kind.is_dir() {
            ManifestEntry::Directory
        } else {
            let metadata = fs_err::symlink_metadata(entry.path())?;
            ManifestEntry::File {
                executable: metadata.permissions().mode() & 0o111 != 0,
                sha256: match known.get(&relative) {
                    Some(hash) => hash.clone(),
                    None => Sha256::of_file(entry.path())?,
                },
            }
        };
        entries.insert(relative, value);
    }
    Ok(entries)
}

/// The content hash of a tree: sha256 over its manifest serialized one entry per line, `path\0entry\n`.
pub fn content_hash(manifest: &BTreeMap<String, ManifestEntry>) -> Sha256 {
    let mut hasher = sha2::Sha256::new();
    hasher.update(b"hvd-content-v1\n");
    for (path, entry) in manifest {
        hasher.update(path.as_bytes());
        hasher.update(b"\0");
        hasher.update(entry.to_string().as_bytes());
        hasher.update(b"\n");
    }
    Sha256::from_hasher(hasher)
}

/// Paths whose entries differ between two manifests (added, removed or changed), sorted.
pub(crate) fn manifest_differences(
    left: &BTreeMap<String, ManifestEntry>,
    right: &BTreeMap<String, ManifestEntry>,
) -> Vec<String> {
    let mut differing: Vec<String> = left
        .iter()
        .filter(|(path, entry)| right.get(*path) != Some(entry))
        .map(|(path, _)| path.clone())
        .collect();
    differing.extend(
        right
            .keys()
            .filter(|path| !left.contains_key(*path))
            .cloned(),
    );
    differing.sort();
    differing
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The builder's digests are the resolver's type; a `sha256:` prefix is taken where asked for.
    #[test]
    fn sha256_parses_and_rejects() {
        let hash = Sha256::parse_prefixed(
            "sha256:ABCDEF0123456789abcdef0123456789abcdef0123456789abcdef0123456789",
        )
        .unwrap();
        assert_eq!(
            hash.as_str(),
            "abcdef0123456789abcdef0123456789abcdef0123456789abcdef0123456789"
        );
        assert!("xyz".parse::<Sha256>().is_err());
    }

    #[test]
    fn content_hash_sees_names_contents_modes_and_links() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path();
        fs_err::create_dir(root.join("a")).unwrap();
        fs_err::write(root.join("a/f"), "one").unwrap();
        std::os::unix::fs::symlink("a/f", root.join("l")).unwrap();
        fs_err::write(root.join(PATH_INFO_FILE), "ignored").unwrap();
        let first = manifest(root).unwrap();
        assert_eq!(first.len(), 3);
        let hash = content_hash(&first);

        fs_err::write(root.join(PATH_INFO_FILE), "still ignored").unwrap();
        assert_eq!(content_hash(&manifest(root).unwrap()), hash);

        fs_err::set_permissions(root.join("a/f"), std::fs::Permissions::from_mode(0o755)).unwrap();
        let second = manifest(root).unwrap();
        assert_ne!(content_hash(&second), hash);
        assert_eq!(
            manifest_differences(&first, &second),
            vec!["a/f".to_string()]
        );
    }
}
