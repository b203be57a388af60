//! Safe unpacking of wheels (zip) and sdists (tar.gz, zip).
//!
//! Every entry is checked before anything is written: absolute paths, `..` components and links whose target
//! leaves the destination are refused, so a hostile archive cannot write outside the directory it is unpacked into.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Component, Path, PathBuf};

use sha2::Digest;

use crate::error::{Error, Result};
use crate::hash::Sha256;

/// The relative path an archive entry may be written to, or an error when it would escape.
fn safe_relative(archive: &Path, entry: &str) -> Result<PathBuf> {
    let unsafe_entry = || Error::UnsafeArchiveEntry {
        archive: archive.to_path_buf(),
        entry: entry.to_string(),
    };
    let mut out = PathBuf::new();
    for component in Path::new(entry).components() {
        match component {
            Component::Normal(part) => out.push(part),
            Component::CurDir => {}
            Component::ParentDir | Component::RootDir | Component::Prefix(_) => {
                return Err(unsafe_entry());
            }
        }
    }
    if out.as_os_str().is_empty() {
        return Err(unsafe_entry());
    }
    Ok(out)
}

/// Refuse a link at `relative` whose `target` (absolute, or relative to the link's directory) leaves the root.
fn check_link_target(archive: &Path, relative: &Path, target: &Path, entry: &str) -> Result<()> {
    let unsafe_entry = || Error::UnsafeArchiveEntry {
        archive: archive.to_path_buf(),
        entry: format!("{entry} -> {}", target.display()),
    };
    if target.is_absolute() {
        return Err(unsafe_entry());
    }
    let mut depth: i64 = relative.components().count() as i64 - 1;
    for component in target.components() {
        match component {
            Component::ParentDir => depth -= 1,
            Component::Normal(_) => depth += 1,
            Component::CurDir => {}
            Component::RootDir | Component::Prefix(_) => return Err(unsafe_entry()),
        }
        if depth < 0 {
            return Err(unsafe_entry());
        }
    }
    Ok(())
}

/// Refuse to write through a symlink already unpacked (a link entry followed by a file "inside" it).
fn check_no_link_on_the_way(
    archive: &Path,
    dest: &Path,
    relative: &Path,
    entry: &str,
) -> Result<()> {
    let mut current = dest.to_path_buf();
    let parts: Vec<_> = relative.components().collect();
    for part in &parts[..parts.len().saturating_sub(1)] {
        current.push(part);
        if current.is_symlink() {
            return Err(Error::UnsafeArchiveEntry {
                archive: archive.to_path_buf(),
                entry: entry.to_string(),
            });
        }
    }
    Ok(())
}

fn archive_error(archive: &Path, err: impl std::fmt::Display) -> Error {
    Error::Archive {
        archive: archive.to_path_buf(),
        message: err.to_string(),
    }
}

/// Unpack a zip archive into `dest`; returns the sha256 of every regular file by its relative path.
pub fn unpack_zip(archive: &Path, dest: &Path) -> Result<BTreeMap<String, Sha256>> {
    let file = fs_err::File::open(archive)?;
    let mut zip = zip::ZipArchive::new(std::io::BufReader::new(file))
        .map_err(|err| archive_error(archive, err))?;
    let mut hashes = BTreeMap::new();
    for index in 0..zip.len() {
        let mut entry = zip
            .by_index(index)
            .map_err(|err| archive_error(archive, err))?;
        let name = entry.name().to_string();
        let relative = safe_relative(archive, &name)?;
        check_no_link_on_the_way(archive, dest, &relative, &name)?;
        let path = dest.join(&relative);
        let mode = entry.unix_mode();
        let is_link = mode.is_some_and(|mode| mode & 0o170000 == 0o120000);
        if entry.is_dir() {
            fs_err::create_dir_all(&path)?;
            continue;
        }
        if let Some(parent) = path.parent() {
            fs_err::create_dir_all(parent)?;
        }
        if is_link {
            let mut target = String::new();
            entry
                .read_to_string(&mut target)
                .map_err(|err| archive_error(archive, err))?;
            check_link_target(archive, &relative, Path::new(&target), &name)?;
            std::os::unix::fs::symlink(&target, &path).map_err(|err| {
                std::io::Error::other(format!("failed to create link `{}`: {err}", path.display()))
            })?;
            continue;
        }
        let mut out = fs_err::File::create(&path)?;
        let mut hasher = sha2::Sha256::new();
        let mut buffer = vec![0u8; 1 << 16];
        loop {
            let n = entry
                .read(&mut buffer)
                .map_err(|err| archive_error(archive, err))?;
            if n == 0 {
                break;
            }
            hasher.update(&buffer[..n]);
            out.write_all(&buffer[..n])?;
        }
        if mode.is_some_and(|mode| mode & 0o111 != 0) {
            fs_err::set_permissions(&path, std::fs::Permissions::from_mode(0o755))?;
        }
        hashes.insert(
            relative.to_string_lossy().into_owned(),
            Sha256::from_hasher(hasher),
        );
    }
    Ok(hashes)
}

/// Unpack a `.tar.gz` archive into `dest`. Only directories, regular files and in-tree links are accepted.
pub fn unpack_tar_gz(archive: &Path, dest: &Path) -> Result<()> {
    let file = fs_err::File::open(archive)?;
    let mut tar = tar::Archive::new(flate2::read::GzDecoder::new(std::io::BufReader::new(file)));
    for entry in tar.entries().map_err(|err| archive_error(archive, err))? {
        let mut entry = entry.map_err(|err| archive_error(archive, err))?;
        let name = entry
            .path()
            .map_err(|err| archive_error(archive, err))?
            .to_string_lossy()
            .into_owned();
        let relative = safe_relative(archive, &name)?;
        check_no_link_on_the_way(archive, dest, &relative, &name)?;
        let path = dest.join(&relative);
        let kind = entry.header().entry_type();
        if kind.is_dir() {
            fs_err::create_dir_all(&path)?;
            continue;
        }
        if let Some(parent) = path.parent() {
            fs_err::create_dir_all(parent)?;
        }
        if kind.is_symlink() || kind.is_hard_link() {
            let target = entry
                .link_name()
                .map_err(|err| archive_error(archive, err))?
                .ok_or_else(|| archive_error(archive, format!("link `{name}` has no target")))?
                .into_owned();
            if kind.is_hard_link() {
                // Hard link targets are archive paths relative to the root.
                let target_relative = safe_relative(archive, &target.to_string_lossy())?;
                fs_err::copy(dest.join(target_relative), &path)?;
            } else {
                check_link_target(archive, &relative, &target, &name)?;
                std::os::unix::fs::symlink(&target, &path).map_err(|err| {
                    std::io::Error::other(format!(
                        "failed to create link `{}`: {err}",
                        path.display()
                    ))
                })?;
            }
            continue;
        }
        if kind.is_file() || kind == tar::EntryType::Continuous {
            let mut out = fs_err::File::create(&path)?;
            std::io::copy(&mut entry, &mut out).map_err(|err| archive_error(archive, err))?;
            let mode = entry.header().mode().unwrap_or(0o644);
            fs_err::set_permissions(
                &path,
                std::fs::Permissions::from_mode(if mode & 0o111 != 0 { 0o755 } else { 0o644 }),
            )?;
            continue;
        }
        // pax headers are consumed by the tar crate; anything else (devices, fifos) has no place in an sdist.
        if !matches!(
            kind,
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader
        ) {
            return Err(archive_error(
                archive,
                format!("entry `{name}` has unsupported type {kind:?}"),
            ));
        }
    }
    Ok(())
}

/// Unpack an sdist by its file name (`.tar.gz`, `.tgz` or `.zip`).
pub fn unpack_sdist(archive: &Path, filename: &str, dest: &Path) -> Result<()> {
    if filename.ends_with(".zip") {
        unpack_zip(archive, dest).map(|_| ())
    } else if filename.ends_with(".tar.gz") || filename.ends_with(".tgz") {
        unpack_tar_gz(archive, dest)
    } else {
        Err(Error::Invalid(format!(
            "unsupported sdist format `{filename}` (expected .tar.gz or .zip)"
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn zip_with(entries: &[(&str, &[u8], Option<u32>)]) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.zip");
        let mut writer = zip::ZipWriter::new(fs_err::File::create(&path).unwrap());
        for (name, data, mode) in entries {
            let options = zip::write::SimpleFileOptions::default();
            if mode.is_some_and(|mode| mode & 0o170000 == 0o120000) {
                writer
                    .add_symlink(*name, std::str::from_utf8(data).unwrap(), options)
                    .unwrap();
                continue;
            }
            writer.start_file(*name, options).unwrap();
            writer.write_all(data).unwrap();
        }
        writer.finish().unwrap();
        (dir, path)
    }

    #[test]
    fn zip_escapes_are_refused() {
        for bad in ["../evil", "/abs/evil", "a/../../evil"] {
            let (dir, archive) = zip_with(&[("ok.txt", b"x", None), (bad, b"x", None)]);
            let dest = dir.path().join("dest");
            let err = unpack_zip(&archive, &dest).unwrap_err();
            assert!(
                matches!(err, Error::UnsafeArchiveEntry { .. }),
                "{bad}: {err}"
            );
            assert!(!dir.path().join("evil").exists());
        }
        let (dir, archive) = zip_with(&[("link", b"../../etc", Some(0o120777))]);
        let err = unpack_zip(&archive, &dir.path().join("dest")).unwrap_err();
        assert!(err.to_string().contains("link -> ../../etc"), "{err}");
    }

    #[test]
    fn zip_unpacks_with_hashes() {
        let (dir, archive) = zip_with(&[
            ("pkg/a.py", b"print(1)\n", None),
            ("pkg/l", b"a.py", Some(0o120777)),
        ]);
        let dest = dir.path().join("dest");
        let hashes = unpack_zip(&archive, &dest).unwrap();
        assert_eq!(hashes["pkg/a.py"], Sha256::of_bytes(b"print(1)\n"));
        assert_eq!(
            fs_err::read_to_string(dest.join("pkg/l")).unwrap(),
            "print(1)\n"
        );
    }

    fn tar_gz_with(
        build: impl FnOnce(&mut tar::Builder<flate2::write::GzEncoder<fs_err::File>>),
    ) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.tar.gz");
        let encoder = flate2::write::GzEncoder::new(
            fs_err::File::create(&path).unwrap(),
            flate2::Compression::fast(),
        );
        let mut builder = tar::Builder::new(encoder);
        build(&mut builder);
        builder.into_inner().unwrap().finish().unwrap();
        (dir, path)
    }

    #[test]
    fn tar_escapes_are_refused() {
        // A symlink out of the tree, then a file written "through" it.
        let (dir, archive) = tar_gz_with(|builder| {
            let mut header = tar::Header::new_gnu();
            header.set_entry_type(tar::EntryType::Symlink);
            header.set_size(0);
            builder
                .append_link(&mut header, "pkg/out", "../..")
                .unwrap();
        });
        let err = unpack_tar_gz(&archive, &dir.path().join("dest")).unwrap_err();
        assert!(matches!(err, Error::UnsafeArchiveEntry { .. }), "{err}");

        // `..` in a name: the tar crate refuses to build one, so write the raw header bytes.
        let (dir, archive) = tar_gz_with(|builder| {
            let mut header = tar::Header::new_old();
            header.as_old_mut().name[..9].copy_from_slice(b"../escape");
            header.set_size(1);
            header.set_mode(0o644);
            header.set_entry_type(tar::EntryType::Regular);
            header.set_cksum();
            builder.append(&header, &b"x"[..]).unwrap();
        });
        let err = unpack_tar_gz(&archive, &dir.path().join("dest")).unwrap_err();
        assert!(matches!(err, Error::UnsafeArchiveEntry { .. }), "{err}");
        assert!(!dir.path().join("escape").exists());
    }
}
