//! The archive of a store path in a binary cache: a tar of the tree in manifest order with fixed owners, modes
//! and mtimes (equal trees give equal bytes), zstd-compressed; unpacked only through the hardened extractor.

use std::collections::BTreeMap;
use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use sha2::Digest;

use hvd_resolver::Sha256;

use super::record::ArchiveInfo;
use crate::error::{Error, Result};
use crate::hash::PATH_INFO_FILE;

/// zstd level: fast to write, about as small as gzip -9.
const LEVEL: i32 = 3;

/// Counts and hashes what passes through to the file.
struct HashingWriter<W> {
    inner: W,
    hasher: sha2::Sha256,
    size: u64,
}

impl<W: Write> Write for HashingWriter<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.hasher.update(&buf[..n]);
        self.size += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Write the archive of the store path `path` to `out` (created new) and return its sha256 and size.
/// The path's `.hvd-path.json` is left out: the substituting store writes its own.
pub fn pack(path: &Path, out: &Path) -> Result<ArchiveInfo> {
    let file = fs_err::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(out)?;
    let writer = HashingWriter {
        inner: std::io::BufWriter::new(file),
        hasher: sha2::Sha256::new(),
        size: 0,
    };
    let encoder = zstd::stream::write::Encoder::new(writer, LEVEL)?;
    let mut tar = tar::Builder::new(encoder);
    for entry in walkdir::WalkDir::new(path)
        .follow_links(false)
        .sort_by_file_name()
        .min_depth(1)
    {
        let entry = entry.map_err(|err| {
            std::io::Error::other(format!("failed to walk `{}`: {err}", path.display()))
        })?;
        let relative = entry.path().strip_prefix(path).unwrap_or(entry.path());
        let Some(name) = relative.to_str() else {
            return Err(Error::Invalid(format!(
                "`{}` has a name that is not UTF-8; it cannot be archived",
                entry.path().display()
            )));
        };
        if name == PATH_INFO_FILE {
            continue;
        }
        let mut header = tar::Header::new_gnu();
        header.set_uid(0);
        header.set_gid(0);
        header.set_mtime(crate::store::STORE_MTIME as u64);
        let kind = entry.file_type();
        if kind.is_symlink() {
            let target = fs_err::read_link(entry.path())?;
            header.set_entry_type(tar::EntryType::Symlink);
            header.set_mode(0o777);
            header.set_size(0);
            tar.append_link(&mut header, name, &target)?;
        } else if kind.is_dir() {
            header.set_entry_type(tar::EntryType::Directory);
            header.set_mode(0o555);
            header.set_size(0);
            tar.append_data(&mut header, format!("{name}/"), std::io::empty())?;
        } else if kind.is_file() {
            let file = fs_err::File::open(entry.path())?;
            let metadata = file.metadata()?;
            let executable = metadata.permissions().mode() & 0o111 != 0;
            header.set_entry_type(tar::EntryType::Regular);
            header.set_mode(if executable { 0o555 } else { 0o444 });
            header.set_size(metadata.len());
            tar.append_data(&mut header, name, file)?;
        } else {
            return Err(Error::Invalid(format!(
                "`{}` is not a file, directory or link; a store path cannot hold it",
                entry.path().display()
            )));
        }
    }
    let encoder = tar.into_inner()?;
    let mut writer = encoder.finish()?;
    writer.flush()?;
    Ok(ArchiveInfo {
        sha256: Sha256::from_hasher(writer.hasher),
        size: writer.size,
    })
}

/// Unpack `archive` into the fresh directory `dest` with every check of the hardened extractor but the one on link
/// targets (see [`crate::unpack::Options::links_anywhere`]); returns the sha256 of each file by relative path (for
/// the content hash).
pub fn unpack(archive: &Path, dest: &Path) -> Result<BTreeMap<String, Sha256>> {
    // Envs link into the store and to their interpreter by absolute path; the content hash covers every target.
    let options = crate::unpack::Options {
        links_anywhere: true,
        ..crate::unpack::Options::default()
    };
    let extracted = crate::unpack::unpack_tar_zst(archive, dest, options)?;
    Ok(extracted
        .into_values()
        .filter(|unpacked| !unpacked.is_link)
        .filter_map(|unpacked| unpacked.sha256.map(|sha| (unpacked.dest, sha)))
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tree(root: &Path) {
        fs_err::create_dir_all(root.join("lib/pkg")).unwrap();
        fs_err::create_dir_all(root.join("empty")).unwrap();
        fs_err::write(root.join("lib/pkg/mod.py"), "x = 1\n").unwrap();
        fs_err::write(root.join("run"), "#!/bin/sh\n").unwrap();
        fs_err::set_permissions(root.join("run"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::os::unix::fs::symlink("lib/pkg", root.join("link")).unwrap();
        // An env's interpreter link: absolute, out of the tree.
        std::os::unix::fs::symlink("/usr/bin/python3", root.join("python")).unwrap();
        fs_err::write(root.join(PATH_INFO_FILE), "{}").unwrap();
        crate::store::canonicalize(root).unwrap();
    }

    #[test]
    fn packing_is_deterministic_and_unpacks_to_the_same_tree() {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("source");
        tree(&source);
        let first = pack(&source, &dir.path().join("a.tar.zst")).unwrap();
        let second = pack(&source, &dir.path().join("b.tar.zst")).unwrap();
        assert_eq!(first, second);
        let dest = dir.path().join("dest");
        let hashes = unpack(&dir.path().join("a.tar.zst"), &dest).unwrap();
        assert!(!dest.join(PATH_INFO_FILE).exists());
        crate::store::canonicalize(&dest).unwrap();
        let want = crate::hash::manifest(&source).unwrap();
        assert_eq!(crate::hash::manifest(&dest).unwrap(), want);
        assert_eq!(
            crate::hash::manifest_with_known(&dest, &hashes).unwrap(),
            want
        );
    }

    /// An archive whose entry name climbs out, or that writes through its own link, is refused by the extractor.
    #[test]
    fn hostile_entries_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let write = |path: &Path, entries: &[(&[u8], tar::EntryType, &[u8])]| {
            let file = fs_err::File::create(path).unwrap();
            let encoder = zstd::stream::write::Encoder::new(file, 3).unwrap();
            let mut tar = tar::Builder::new(encoder);
            for (name, kind, data) in entries {
                let mut header = tar::Header::new_gnu();
                let gnu = header.as_gnu_mut().unwrap();
                gnu.name[..name.len()].copy_from_slice(name);
                header.set_entry_type(*kind);
                header.set_mode(0o644);
                if *kind == tar::EntryType::Symlink {
                    header
                        .set_link_name(std::str::from_utf8(data).unwrap())
                        .unwrap();
                    header.set_size(0);
                    header.set_cksum();
                    tar.append(&header, std::io::empty()).unwrap();
                } else {
                    header.set_size(data.len() as u64);
                    header.set_cksum();
                    tar.append(&header, *data).unwrap();
                }
            }
            tar.into_inner().unwrap().finish().unwrap();
        };
        let climbing = dir.path().join("climbing.tar.zst");
        write(&climbing, &[(b"../evil", tar::EntryType::Regular, b"x")]);
        let err = unpack(&climbing, &dir.path().join("a/dest")).unwrap_err();
        assert!(err.to_string().contains("../evil"), "{err}");
        assert!(!dir.path().join("a/evil").exists());

        let through = dir.path().join("through.tar.zst");
        let outside = dir.path().join("outside");
        fs_err::create_dir(&outside).unwrap();
        write(
            &through,
            &[
                (
                    b"out",
                    tar::EntryType::Symlink,
                    outside.to_str().unwrap().as_bytes(),
                ),
                (b"out/planted", tar::EntryType::Regular, b"x"),
            ],
        );
        assert!(unpack(&through, &dir.path().join("b")).is_err());
        assert!(!outside.join("planted").exists());
    }
}
