//! Debian binary packages (`.deb`): the `ar` container, its data member's tar, and several packages merged into
//! one tree through the store's hardened extractor.
//!
//! A package is hostile input (its sha256 only says it is the one the lock names), so:
//! - the `ar` headers are parsed strictly (magic, sizes within the file, at most a few members);
//! - the data member is decompressed (xz, zstd, gzip or none) into a scratch file under a size cap (an xz block's
//!   size is read from its chunk headers before decoding: lzma-rs holds a block in memory), and the size
//!   and entry limits hold for all packages together (what reaches the scratch directory is bounded, not each one);
//! - every entry's name is normalized like the extractor does (`..`, absolute names refused);
//! - an absolute link target (Debian policy makes links across top-level directories absolute, e.g.
//!   `usr/lib/gcc/.../libgcc_s.so -> /lib/.../libgcc_s.so.1`) is re-rooted into the tree as a relative link, so it
//!   names the toolchain's own file and never the host's; a target with `..` is refused;
//! - a file that two packages both ship is refused (dpkg would refuse it too); directories merge;
//! - devices, fifos and anything else than files, directories and links are refused;
//! - the merged tar is then written by [`crate::unpack`]'s extractor, with all of its rules (no writes through links,
//!   link targets resolved against the final tree must stay inside, size and entry limits).

use std::collections::HashMap;
use std::io::{BufReader, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::unpack::{self, Limits, Options};

/// `ar`'s global header.
const AR_MAGIC: &[u8; 8] = b"!<arch>\n";
/// A `.deb` has three members (`debian-binary`, `control.tar.*`, `data.tar.*`); a few more are tolerated.
const MAX_MEMBERS: usize = 8;

/// One package to merge: its name (for messages) and its verified file.
#[derive(Debug, Clone)]
pub struct Deb {
    pub name: String,
    pub path: PathBuf,
}

/// Unpack `debs` into `dest` (a fresh directory) as one tree, using `scratch` (a fresh directory) for the
/// decompressed members and the merged tar. Returns the package that wrote each file and link, by path.
pub fn unpack_debs(debs: &[Deb], scratch: &Path, dest: &Path) -> Result<HashMap<String, String>> {
    unpack_debs_with(debs, scratch, dest, Limits::default())
}

/// What all packages of one toolchain may still write to the scratch directory together: the `limits` hold for
/// the sum over every package (decompressed data members, merged entries and file bytes), not for each one.
struct Budget {
    limits: Limits,
    decompressed: u64,
    entries: u64,
    bytes: u64,
}

/// [`unpack_debs`] under `limits`, which bound all packages together.
pub fn unpack_debs_with(
    debs: &[Deb],
    scratch: &Path,
    dest: &Path,
    limits: Limits,
) -> Result<HashMap<String, String>> {
    let mut budget = Budget {
        limits,
        decompressed: 0,
        entries: 0,
        bytes: 0,
    };
    let merged_path = scratch.join("merged.tar");
    let mut merged =
        tar::Builder::new(std::io::BufWriter::new(fs_err::File::create(&merged_path)?));
    merged.mode(tar::HeaderMode::Deterministic);
    // Which package wrote each name, and whether it is a directory.
    let mut owners: HashMap<String, (String, bool)> = HashMap::new();
    for (index, deb) in debs.iter().enumerate() {
        let data = scratch.join(format!("{index}.tar"));
        budget.decompressed += decompress_data(&deb.path, &data, &budget)?;
        merge(deb, &data, &mut merged, &mut owners, &mut budget)?;
        fs_err::remove_file(&data)?;
    }
    merged
        .into_inner()
        .and_then(|mut w| w.flush())
        .map_err(|err| archive_error(&merged_path, err))?;
    unpack::unpack_tar_plain(
        &merged_path,
        dest,
        Options {
            hash: false,
            limits,
            ..Options::default()
        },
    )?;
    fs_err::remove_file(&merged_path)?;
    Ok(owners
        .into_iter()
        .filter(|(_, (_, is_dir))| !is_dir)
        .map(|(path, (owner, _))| (path, owner))
        .collect())
}

fn archive_error(archive: &Path, err: impl std::fmt::Display) -> Error {
    Error::Archive {
        archive: archive.to_path_buf(),
        message: err.to_string(),
    }
}

/// The data member of a `.deb`: its name, offset and size.
fn data_member(deb: &Path) -> Result<(String, u64, u64)> {
    let bad = |message: String| archive_error(deb, format!("not a Debian package: {message}"));
    let mut file = fs_err::File::open(deb)?;
    let len = file.metadata()?.len();
    let mut magic = [0u8; 8];
    file.read_exact(&mut magic)
        .map_err(|_| bad("shorter than an ar header".into()))?;
    if &magic != AR_MAGIC {
        return Err(bad("no `!<arch>` magic".into()));
    }
    let mut offset = 8u64;
    for _ in 0..MAX_MEMBERS {
        if offset + 60 > len {
            break;
        }
        let mut header = [0u8; 60];
        file.seek(SeekFrom::Start(offset))?;
        file.read_exact(&mut header)?;
        if &header[58..60] != b"`\n" {
            return Err(bad(format!(
                "a member header at byte {offset} is malformed"
            )));
        }
        let field = |range: std::ops::Range<usize>| -> String {
            String::from_utf8_lossy(&header[range])
                .trim_end()
                .to_string()
        };
        let name = field(0..16);
        let name = name.strip_suffix('/').unwrap_or(&name).to_string();
        let size: u64 = field(48..58)
            .parse()
            .map_err(|_| bad(format!("member `{name}` has no decimal size")))?;
        let start = offset + 60;
        if size > len - start {
            return Err(bad(format!(
                "member `{name}` claims {size} bytes, more than the file holds"
            )));
        }
        if name.starts_with("data.tar") {
            return Ok((name, start, size));
        }
        offset = start + size + (size & 1);
    }
    Err(bad("no data.tar member".into()))
}

/// A writer that refuses to grow past `cap` bytes.
struct Capped<W> {
    inner: W,
    written: u64,
    cap: u64,
    /// Why the cap is what it is (for the error).
    why: String,
}

impl<W: Write> Write for Capped<W> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.written += buf.len() as u64;
        if self.written > self.cap {
            return Err(std::io::Error::other(format!(
                "the data member decompresses to more than {} bytes ({})",
                self.cap, self.why
            )));
        }
        self.inner.write_all(buf)?;
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

/// Decompress the data member of `deb` into `out`, within the ratio limit and what the budget has left of the size
/// limit; returns the bytes written.
fn decompress_data(deb: &Path, out: &Path, budget: &Budget) -> Result<u64> {
    let (name, start, size) = data_member(deb)?;
    let limits = budget.limits;
    let cap = limits
        .max_unpacked_bytes
        .saturating_sub(budget.decompressed)
        .min(
            limits
                .ratio_floor
                .max(size.saturating_mul(limits.max_ratio)),
        );
    let mut file = fs_err::File::open(deb)?;
    file.seek(SeekFrom::Start(start))?;
    let mut input = BufReader::new(file.take(size));
    let mut output = Capped {
        inner: std::io::BufWriter::new(fs_err::File::create(out)?),
        written: 0,
        cap,
        why: format!(
            "what is left of the limit of {} bytes for all packages of the toolchain together, or {} times its \
             compressed size",
            limits.max_unpacked_bytes, limits.max_ratio
        ),
    };
    let member =
        |err: &dyn std::fmt::Display| archive_error(deb, format!("member `{name}`: {err}"));
    match name.as_str() {
        "data.tar.xz" => {
            // lzma-rs keeps each xz block's whole output in memory (it has no memory limit for xz): the block sizes
            // are read from the LZMA2 chunk headers first, and a block larger than the bound is refused undecoded.
            let mut scan = fs_err::File::open(deb)?;
            scan.seek(SeekFrom::Start(start))?;
            let bound = cap.min(XZ_MAX_BLOCK);
            let largest = xz_largest_block(&mut BufReader::new(scan.take(size)), bound)
                .map_err(|e| member(&e))?;
            if largest > bound {
                return Err(member(&format!(
                    "an xz block decompresses to {largest} bytes, more than {bound} (the decoder holds a block \
                     in memory)"
                )));
            }
            lzma_rs::xz_decompress(&mut input, &mut output).map_err(|e| member(&e))?
        }
        "data.tar.zst" => {
            let mut decoder =
                zstd::stream::read::Decoder::with_buffer(input).map_err(|e| member(&e))?;
            std::io::copy(&mut decoder, &mut output).map_err(|e| member(&e))?;
        }
        "data.tar.gz" => {
            let mut decoder = flate2::read::GzDecoder::new(input);
            std::io::copy(&mut decoder, &mut output).map_err(|e| member(&e))?;
        }
        "data.tar" => {
            std::io::copy(&mut input, &mut output).map_err(|e| member(&e))?;
        }
        other => {
            return Err(archive_error(
                deb,
                format!(
                    "member `{other}` has a compression hvd does not read (xz, zst, gz or none)"
                ),
            ));
        }
    }
    output.flush().map_err(|e| member(&e))?;
    Ok(output.written)
}

/// The most bytes one xz block may decompress to: lzma-rs holds a block's output in memory, and Debian's packages
/// (one block each, `dpkg-deb` runs xz single-threaded) stay far below it (the largest of a gcc's are about 100 MB).
const XZ_MAX_BLOCK: u64 = 1 << 30;

/// The decompressed size of the largest block of an xz stream, from its LZMA2 chunk headers (no decoding); stops
/// counting past `bound`. Reads the stream header, then each block: its header, its chunks (control byte, sizes,
/// skipped data), its padding and check; stops at the index.
fn xz_largest_block(input: &mut impl Read, bound: u64) -> std::io::Result<u64> {
    let bad = |what: &str| std::io::Error::other(format!("not an xz stream hvd reads: {what}"));
    let byte = |input: &mut dyn Read| -> std::io::Result<u8> {
        let mut b = [0u8; 1];
        input.read_exact(&mut b)?;
        Ok(b[0])
    };
    let u16_be = |input: &mut dyn Read| -> std::io::Result<u64> {
        let mut b = [0u8; 2];
        input.read_exact(&mut b)?;
        Ok(u16::from_be_bytes(b) as u64)
    };
    let skip = |input: &mut dyn Read, n: u64| -> std::io::Result<()> {
        let skipped = std::io::copy(&mut input.take(n), &mut std::io::sink())?;
        if skipped != n {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                "the xz stream ends inside a block",
            ));
        }
        Ok(())
    };
    let mut header = [0u8; 12];
    input.read_exact(&mut header)?;
    if &header[..6] != b"\xFD7zXZ\x00" {
        return Err(bad("no xz magic"));
    }
    let check = match header[7] & 0x0F {
        0 => 0,
        1 => 4,
        4 => 8,
        10 => 32,
        _ => return Err(bad("an unknown check type")),
    };
    let mut largest = 0u64;
    loop {
        let header_size = byte(input)?;
        if header_size == 0 {
            return Ok(largest);
        }
        let header_len = (header_size as u64 + 1) * 4;
        skip(input, header_len - 1)?;
        let mut compressed = header_len;
        let mut unpacked = 0u64;
        loop {
            let control = byte(input)?;
            compressed += 1;
            match control {
                0 => break,
                1 | 2 => {
                    let size = u16_be(input)? + 1;
                    skip(input, size)?;
                    unpacked += size;
                    compressed += 2 + size;
                }
                0x80..=0xFF => {
                    let size = (((control & 0x1F) as u64) << 16 | u16_be(input)?) + 1;
                    let packed = u16_be(input)? + 1;
                    let props = u64::from((control >> 5) & 3 >= 2);
                    skip(input, props + packed)?;
                    unpacked += size;
                    compressed += 4 + props + packed;
                }
                _ => return Err(bad("an LZMA2 chunk with an invalid control byte")),
            }
            if unpacked > bound {
                return Ok(unpacked);
            }
        }
        largest = largest.max(unpacked);
        skip(input, (4 - compressed % 4) % 4 + check)?;
    }
}

/// The relative form of an absolute link target, as seen from the link `name` (both inside one tree).
fn reroot(name: &str, target: &str) -> std::result::Result<String, &'static str> {
    let inside = unpack::normalize(target.trim_start_matches('/'))?;
    let depth = name.matches('/').count();
    let mut relative = "../".repeat(depth);
    relative.push_str(&inside);
    if relative.is_empty() {
        relative.push('.');
    }
    Ok(relative)
}

/// Append the entries of one package's data tar to the merged tar.
fn merge(
    deb: &Deb,
    data: &Path,
    merged: &mut tar::Builder<impl Write>,
    owners: &mut HashMap<String, (String, bool)>,
    budget: &mut Budget,
) -> Result<()> {
    let refuse = |entry: &str, reason: String| Error::UnsafeArchiveEntry {
        archive: deb.path.clone(),
        entry: entry.to_string(),
        reason,
    };
    let mut archive = tar::Archive::new(BufReader::new(fs_err::File::open(data)?));
    let entries = archive
        .entries()
        .map_err(|err| archive_error(&deb.path, err))?;
    for entry in entries {
        let mut entry = entry.map_err(|err| archive_error(&deb.path, err))?;
        let raw = entry.path_bytes().into_owned();
        let name = String::from_utf8(raw).map_err(|raw| {
            refuse(
                &String::from_utf8_lossy(raw.as_bytes()),
                "has a name that is not UTF-8".into(),
            )
        })?;
        let kind = entry.header().entry_type();
        if matches!(
            kind,
            tar::EntryType::XGlobalHeader | tar::EntryType::XHeader
        ) {
            continue;
        }
        let normalized = unpack::normalize(&name).map_err(|why| refuse(&name, why.into()))?;
        let is_dir = kind == tar::EntryType::Directory;
        if normalized.is_empty() && is_dir {
            continue;
        }
        budget.entries += 1;
        budget.bytes = budget.bytes.saturating_add(entry.size());
        let past = |limit: u64, what: &str| {
            refuse(
                &name,
                format!(
                    "is past the limit of {limit} {what} for all packages of the toolchain together"
                ),
            )
        };
        if budget.entries > budget.limits.max_entries {
            return Err(past(budget.limits.max_entries, "entries"));
        }
        if budget.bytes > budget.limits.max_unpacked_bytes {
            return Err(past(budget.limits.max_unpacked_bytes, "bytes"));
        }
        match owners.get(&normalized) {
            Some((_, true)) if is_dir => continue,
            Some((owner, _)) => {
                return Err(refuse(
                    &name,
                    format!(
                        "is also shipped by `{owner}`: two packages of a toolchain may not write one path"
                    ),
                ));
            }
            None => {
                owners.insert(normalized.clone(), (deb.name.clone(), is_dir));
            }
        }
        let link_target = |entry: &tar::Entry<'_, _>| -> Result<String> {
            let target = entry
                .link_name_bytes()
                .ok_or_else(|| refuse(&name, "is a link without a target".into()))?;
            String::from_utf8(target.into_owned())
                .map_err(|_| refuse(&name, "is a link whose target is not UTF-8".into()))
        };
        let mut header = tar::Header::new_gnu();
        header.set_mtime(0);
        header.set_uid(0);
        header.set_gid(0);
        let append =
            |merged: &mut tar::Builder<_>, header: &mut tar::Header, data: &mut dyn Read| {
                merged
                    .append_data(header, &normalized, data)
                    .map_err(|err| archive_error(&deb.path, err))
            };
        match kind {
            tar::EntryType::Directory => {
                header.set_entry_type(tar::EntryType::Directory);
                header.set_mode(0o755);
                header.set_size(0);
                append(merged, &mut header, &mut std::io::empty())?;
            }
            tar::EntryType::Regular | tar::EntryType::Continuous => {
                let executable = entry.header().mode().unwrap_or(0o644) & 0o111 != 0;
                header.set_entry_type(tar::EntryType::Regular);
                header.set_mode(if executable { 0o755 } else { 0o644 });
                header.set_size(entry.size());
                append(merged, &mut header, &mut entry)?;
            }
            tar::EntryType::Symlink => {
                let target = link_target(&entry)?;
                let target = if target.starts_with('/') {
                    reroot(&normalized, &target).map_err(|why| {
                        refuse(&name, format!("is a link to `{target}`, whose path {why}"))
                    })?
                } else {
                    target
                };
                header.set_entry_type(tar::EntryType::Symlink);
                header.set_mode(0o777);
                header.set_size(0);
                merged
                    .append_link(&mut header, &normalized, &target)
                    .map_err(|err| archive_error(&deb.path, err))?;
            }
            tar::EntryType::Link => {
                let target = link_target(&entry)?;
                let target = unpack::normalize(&target).map_err(|why| {
                    refuse(&name, format!("is a hard link to `{target}`, which {why}"))
                })?;
                header.set_entry_type(tar::EntryType::Link);
                header.set_mode(0o644);
                header.set_size(0);
                merged
                    .append_link(&mut header, &normalized, &target)
                    .map_err(|err| archive_error(&deb.path, err))?;
            }
            other => {
                return Err(refuse(
                    &name,
                    format!("has type {other:?}: only files, directories and links are allowed"),
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `head -c 3000000 /dev/zero | xz -6`: two LZMA2 chunks of compressed data (xz 5 made it).
    const ZEROS_XZ: &str = concat!(
        "fd377a585a000004e6d6b4460200210116000000742fe5a3ffff11016c5d00006ffdffffa3b7ff473e481572396151b89228",
        "e6a38607f9eee41e82d32fc53a3c014bb17ec98a8a4d2fa30dd97fa6e38c231153e05918c5758ae277f8b6947f0c6ac0de74",
        "4964e2e95c53b204d8f7440cab5f0d6d46e9e5c37688b79657acb64de1691d6ffb4b88106c42cb883f5c008fd04eaf262894",
        "711f3d8f24e1709ea7235fec28cb85d195988a7e2a91f22775f719c006984d98fdd8afd5900fc42553f8f591363105a5b0ee",
        "6fc1704d470cd19111aaad601dbaceb127185c5986e9665258bee976ac59e4e55b0508f9c7daadfcfb522b74cd1e5b2042f9",
        "dd533df82964093b80cb2a6cdfb53bf0c4bd2e5faa0f3e4b664290130eff1093f8717859f80bcdff9528460fa9fc7cdefb9a",
        "302e56c08f85f38381c065c42553f8f591363105a5b0ee6fc1704d470cd19111aaad601dbaceb127185c5986e9665258bee9",
        "76ac59e4e55b0508f9c7daadfcfb522b74cd1e5b2042f9dd533df82964093b80cb2a6cdfb53bf0c4bc4827e6588dc7ad0084",
        "00ec7353a7fdbeae7c311a9fb78d316e709ea7235fec28cb85d195988a7e2a91f22775f719c006984d98fdd8afd5900fc425",
        "53f8f591363105a5b0ee6fc1704d470cd19111aaad601dbaceb127185c5986e9665258bee976ac59e4e55b0508f9c7daadfc",
        "fb522b74cd1e5b2042f9dd533df82964093b80cb2a6cdfb53bf0c4bd14792d5d000000009f0399b9c886fd2200019204c08d",
        "b70169ab5825b1c467fb020000000004595a",
    );

    #[test]
    fn xz_block_sizes_come_from_the_chunk_headers() {
        let bytes: Vec<u8> = (0..ZEROS_XZ.len() / 2)
            .map(|i| u8::from_str_radix(&ZEROS_XZ[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        assert_eq!(
            xz_largest_block(&mut bytes.as_slice(), u64::MAX).unwrap(),
            3_000_000
        );
        // Counting stops past the bound.
        assert!(xz_largest_block(&mut bytes.as_slice(), 1 << 20).unwrap() > 1 << 20);
        // lzma-rs's own encoder (uncompressed chunks).
        let data: Vec<u8> = (0..100_000u32).map(|i| (i % 251) as u8).collect();
        let mut xz = Vec::new();
        lzma_rs::xz_compress(&mut data.as_slice(), &mut xz).unwrap();
        assert_eq!(
            xz_largest_block(&mut xz.as_slice(), u64::MAX).unwrap(),
            100_000
        );
        // Cut short, or not xz: an error, not a panic.
        assert!(xz_largest_block(&mut &bytes[..100], u64::MAX).is_err());
        assert!(xz_largest_block(&mut &b"PK\x03\x04 not xz at all"[..], u64::MAX).is_err());
    }

    #[test]
    fn absolute_targets_become_relative_inside() {
        assert_eq!(
            reroot(
                "usr/lib/gcc/x86_64-linux-gnu/10/libgcc_s.so",
                "/lib/x86_64-linux-gnu/libgcc_s.so.1"
            )
            .unwrap(),
            "../../../../../lib/x86_64-linux-gnu/libgcc_s.so.1"
        );
        assert_eq!(reroot("cc", "/usr/bin/gcc").unwrap(), "usr/bin/gcc");
        assert!(reroot("usr/bin/x", "/../../etc/passwd").is_err());
    }
}
