//! Core metadata (METADATA / PKG-INFO), setuptools' `requires.txt`, and reading METADATA out of a wheel's zip
//! given only a way to read byte ranges (so a 230 MB wheel costs a few KB over HTTP).

use std::io::Read;

/// The parts of core metadata resolution needs.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CoreMetadata {
    pub name: String,
    pub version: String,
    pub metadata_version: String,
    /// `Requires-Dist` lines, verbatim.
    pub requires_dist: Vec<String>,
    pub requires_python: Option<String>,
    /// `Dynamic` fields (lowercase), metadata 2.2+.
    pub dynamic: Vec<String>,
}

impl CoreMetadata {
    /// Parse RFC 822-style core metadata. Headers end at the first empty line (the body is the description).
    pub fn parse(text: &str) -> CoreMetadata {
        let mut m = CoreMetadata::default();
        let mut current: Option<(String, String)> = None;
        let mut fields: Vec<(String, String)> = Vec::new();
        for line in text.lines() {
            if line.is_empty() {
                break;
            }
            if line.starts_with([' ', '\t']) {
                if let Some((_, v)) = &mut current {
                    v.push(' ');
                    v.push_str(line.trim());
                }
                continue;
            }
            if let Some(done) = current.take() {
                fields.push(done);
            }
            if let Some((k, v)) = line.split_once(':') {
                current = Some((k.trim().to_ascii_lowercase(), v.trim().to_string()));
            }
        }
        if let Some(done) = current.take() {
            fields.push(done);
        }
        for (k, v) in fields {
            match k.as_str() {
                "name" => m.name = v,
                "version" => m.version = v,
                "metadata-version" => m.metadata_version = v,
                "requires-dist" => m.requires_dist.push(v),
                "requires-python" => m.requires_python = Some(v).filter(|s| !s.is_empty()),
                "dynamic" => m.dynamic.push(v.to_ascii_lowercase()),
                _ => {}
            }
        }
        m
    }

    /// Whether `Requires-Dist` can be trusted as static (PEP 643: metadata 2.2+ and not declared dynamic).
    pub fn requires_dist_is_static(&self) -> bool {
        let newer = {
            let mut parts = self
                .metadata_version
                .split('.')
                .map(|p| p.parse::<u32>().unwrap_or(0));
            let major = parts.next().unwrap_or(0);
            let minor = parts.next().unwrap_or(0);
            (major, minor) >= (2, 2)
        };
        newer && !self.dynamic.iter().any(|d| d == "requires-dist")
    }
}

/// Convert setuptools' `*.egg-info/requires.txt` into PEP 508 strings.
/// Sections are `[extra]`, `[:marker]` or `[extra:marker]`.
pub fn parse_requires_txt(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut marker: Option<String> = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(section) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let (extra, env) = section.split_once(':').unwrap_or((section, ""));
            let mut parts = Vec::new();
            if !extra.trim().is_empty() {
                parts.push(format!("extra == \"{}\"", extra.trim()));
            }
            if !env.trim().is_empty() {
                parts.push(format!("({})", env.trim()));
            }
            marker = if parts.is_empty() {
                None
            } else {
                Some(parts.join(" and "))
            };
            continue;
        }
        match &marker {
            Some(m) => out.push(format!("{line} ; {m}")),
            None => out.push(line.to_string()),
        }
    }
    out
}

/// Errors reading a zip by ranges.
#[derive(Debug, thiserror::Error)]
pub enum ZipError {
    #[error("not a zip file: {0}")]
    Format(&'static str),
    #[error("no `*.dist-info/METADATA` in the wheel")]
    NoMetadata,
    #[error("unsupported compression method {0} for METADATA")]
    Compression(u16),
    #[error("failed to inflate METADATA")]
    Inflate(#[source] std::io::Error),
}

/// One entry of a zip central directory.
#[derive(Debug, Clone)]
pub struct ZipEntry {
    pub name: String,
    pub method: u16,
    pub compressed_size: u64,
    pub local_header_offset: u64,
}

fn u16_at(b: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_le_bytes(b.get(i..i + 2)?.try_into().ok()?))
}
fn u32_at(b: &[u8], i: usize) -> Option<u32> {
    Some(u32::from_le_bytes(b.get(i..i + 4)?.try_into().ok()?))
}
fn u64_at(b: &[u8], i: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(i..i + 8)?.try_into().ok()?))
}

/// The most bytes METADATA may inflate to (a zip bomb in METADATA is refused, not inflated).
pub const MAX_METADATA_INFLATED: u64 = 64 << 20;

/// The most bytes of one tar extension header (a GNU long name or a pax record set) that are read. Real ones hold a
/// path or a few attributes: well under 64 KiB.
pub const MAX_TAR_EXTENSION_HEADER: u64 = 1 << 20;

/// Where the central directory is, found from the tail of the file (`tail` ends at `file_size`).
/// Returns (offset, size) of the central directory; `offset + size <= file_size` is guaranteed. Every number
/// comes from the (possibly hostile) file and is checked: a lying record is an error, never a panic.
pub fn find_central_directory(tail: &[u8], file_size: u64) -> Result<(u64, u64), ZipError> {
    let tail_start = file_size
        .checked_sub(tail.len() as u64)
        .ok_or(ZipError::Format("tail longer than the file"))?;
    let eocd = (0..tail.len().saturating_sub(21))
        .rev()
        .find(|&i| u32_at(tail, i) == Some(0x0605_4b50))
        .ok_or(ZipError::Format("no end of central directory record"))?;
    let mut size = u64::from(u32_at(tail, eocd + 12).ok_or(ZipError::Format("short record"))?);
    let mut offset = u64::from(u32_at(tail, eocd + 16).ok_or(ZipError::Format("short record"))?);
    if offset == 0xFFFF_FFFF || size == 0xFFFF_FFFF {
        // ZIP64: the locator sits right before the EOCD and points at the ZIP64 EOCD record.
        let loc = eocd
            .checked_sub(20)
            .ok_or(ZipError::Format("missing zip64 locator"))?;
        if u32_at(tail, loc) != Some(0x0706_4b50) {
            return Err(ZipError::Format("missing zip64 locator"));
        }
        let rec_abs = u64_at(tail, loc + 8).ok_or(ZipError::Format("short zip64 locator"))?;
        let rec = rec_abs
            .checked_sub(tail_start)
            .and_then(|r| usize::try_from(r).ok())
            .filter(|&r| r < tail.len())
            .ok_or(ZipError::Format("zip64 record outside the tail"))?;
        size = u64_at(tail, rec + 40).ok_or(ZipError::Format("short zip64 record"))?;
        offset = u64_at(tail, rec + 48).ok_or(ZipError::Format("short zip64 record"))?;
    }
    if offset.checked_add(size).is_none_or(|end| end > file_size) {
        return Err(ZipError::Format("central directory outside the file"));
    }
    Ok((offset, size))
}

/// Parse central directory entries.
pub fn parse_central_directory(cd: &[u8]) -> Result<Vec<ZipEntry>, ZipError> {
    let mut out = Vec::new();
    let mut i = 0;
    while i + 46 <= cd.len() {
        if u32_at(cd, i) != Some(0x0201_4b50) {
            break;
        }
        let short = ZipError::Format("short central directory entry");
        let method = u16_at(cd, i + 10).ok_or(ZipError::Format("short entry"))?;
        let mut compressed = u64::from(u32_at(cd, i + 20).ok_or(ZipError::Format("short entry"))?);
        let uncompressed = u32_at(cd, i + 24).ok_or(ZipError::Format("short entry"))?;
        let name_len = usize::from(u16_at(cd, i + 28).ok_or(ZipError::Format("short entry"))?);
        let extra_len = usize::from(u16_at(cd, i + 30).ok_or(ZipError::Format("short entry"))?);
        let comment_len = usize::from(u16_at(cd, i + 32).ok_or(ZipError::Format("short entry"))?);
        let mut offset = u64::from(u32_at(cd, i + 42).ok_or(ZipError::Format("short entry"))?);
        let name = cd.get(i + 46..i + 46 + name_len).ok_or(short)?;
        let extra = cd
            .get(i + 46 + name_len..i + 46 + name_len + extra_len)
            .unwrap_or(&[]);
        // ZIP64 extended information: values present only for fields saturated at 0xFFFFFFFF, in order.
        let mut e = 0;
        while e + 4 <= extra.len() {
            let id = u16_at(extra, e).unwrap_or(0);
            let len = usize::from(u16_at(extra, e + 2).unwrap_or(0));
            if id == 1 {
                let mut p = e + 4;
                if uncompressed == 0xFFFF_FFFF {
                    p += 8;
                }
                if compressed == 0xFFFF_FFFF {
                    compressed = u64_at(extra, p).unwrap_or(compressed);
                    p += 8;
                }
                if offset == 0xFFFF_FFFF {
                    offset = u64_at(extra, p).unwrap_or(offset);
                }
            }
            e += 4 + len;
        }
        out.push(ZipEntry {
            name: String::from_utf8_lossy(name).into_owned(),
            method,
            compressed_size: compressed,
            local_header_offset: offset,
        });
        i += 46 + name_len + extra_len + comment_len;
    }
    Ok(out)
}

/// The METADATA entry of a wheel: `<name>-<version>.dist-info/METADATA` at the top level.
pub fn metadata_entry(entries: &[ZipEntry]) -> Result<&ZipEntry, ZipError> {
    entries
        .iter()
        .find(|e| {
            let mut parts = e.name.split('/');
            matches!((parts.next(), parts.next(), parts.next()), (Some(d), Some("METADATA"), None) if d.ends_with(".dist-info"))
        })
        .ok_or(ZipError::NoMetadata)
}

/// Given bytes starting at an entry's local header (at least header + name + extra + data), return its
/// uncompressed data.
pub fn read_local_entry(bytes: &[u8], entry: &ZipEntry) -> Result<Vec<u8>, ZipError> {
    if u32_at(bytes, 0) != Some(0x0403_4b50) {
        return Err(ZipError::Format("bad local header"));
    }
    let name_len = usize::from(u16_at(bytes, 26).ok_or(ZipError::Format("short local header"))?);
    let extra_len = usize::from(u16_at(bytes, 28).ok_or(ZipError::Format("short local header"))?);
    let start = 30 + name_len + extra_len;
    let end = usize::try_from(entry.compressed_size)
        .ok()
        .and_then(|size| start.checked_add(size))
        .ok_or(ZipError::Format("entry too large"))?;
    let data = bytes
        .get(start..end)
        .ok_or(ZipError::Format("entry data cut short"))?;
    match entry.method {
        0 if data.len() as u64 > MAX_METADATA_INFLATED => {
            Err(ZipError::Format("METADATA too large"))
        }
        0 => Ok(data.to_vec()),
        8 => {
            let mut out = Vec::new();
            flate2::read::DeflateDecoder::new(data)
                .take(MAX_METADATA_INFLATED + 1)
                .read_to_end(&mut out)
                .map_err(ZipError::Inflate)?;
            if out.len() as u64 > MAX_METADATA_INFLATED {
                return Err(ZipError::Format("METADATA inflates beyond the limit"));
            }
            Ok(out)
        }
        m => Err(ZipError::Compression(m)),
    }
}

/// Read METADATA from a whole wheel held in memory (used when the server has no range support).
pub fn metadata_from_wheel_bytes(wheel: &[u8]) -> Result<Vec<u8>, ZipError> {
    let (offset, size) = find_central_directory(
        &wheel[wheel.len().saturating_sub(70_000)..],
        wheel.len() as u64,
    )?;
    let range = usize::try_from(offset)
        .ok()
        .zip(usize::try_from(offset + size).ok())
        .ok_or(ZipError::Format("bad central directory"))?;
    let cd = wheel
        .get(range.0..range.1)
        .ok_or(ZipError::Format("bad central directory"))?;
    let entries = parse_central_directory(cd)?;
    let entry = metadata_entry(&entries)?;
    let local = usize::try_from(entry.local_header_offset)
        .ok()
        .and_then(|at| wheel.get(at..))
        .ok_or(ZipError::Format("bad local offset"))?;
    read_local_entry(local, entry)
}

/// The PEP 517 default build requirements, used when an sdist has no pyproject.toml or no `[build-system]`
/// table in it (the backend is then `setuptools.build_meta:__legacy__`).
pub const DEFAULT_BUILD_REQUIRES: [&str; 2] = ["setuptools>=40.8.0", "wheel"];

/// What the resolver reads out of an sdist in one pass.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SdistContents {
    /// PKG-INFO (with `requires.txt` folded in); `None` without PKG-INFO.
    pub metadata: Option<CoreMetadata>,
    /// `[build-system] requires` of its top-level pyproject.toml, else [`DEFAULT_BUILD_REQUIRES`].
    pub build_requires: Vec<String>,
}

/// `[build-system] requires` of a pyproject.toml; the PEP 517 default when the table or `requires` is absent.
pub fn build_requires_from_pyproject(text: Option<&str>) -> std::io::Result<Vec<String>> {
    let default = || {
        DEFAULT_BUILD_REQUIRES
            .iter()
            .map(|s| s.to_string())
            .collect()
    };
    let Some(text) = text else {
        return Ok(default());
    };
    let value: toml::Table = toml::from_str(text).map_err(|e| {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("its pyproject.toml is not valid TOML: {e}"),
        )
    })?;
    let Some(requires) = value
        .get("build-system")
        .and_then(|b| b.as_table())
        .and_then(|b| b.get("requires"))
    else {
        return Ok(default());
    };
    let bad = || {
        std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            "its pyproject.toml `[build-system] requires` is not a list of strings",
        )
    };
    requires
        .as_array()
        .ok_or_else(bad)?
        .iter()
        .map(|r| r.as_str().map(|s| s.trim().to_string()).ok_or_else(bad))
        .collect()
}

/// Read PKG-INFO (plus `*.egg-info/requires.txt`) and the pyproject.toml build requirements of a `.tar.gz` sdist.
///
/// The archive is walked raw, with its extension headers (GNU long names, pax records) read here and bounded by
/// [`MAX_TAR_EXTENSION_HEADER`]: the tar crate's own walk reads them whole, whatever size they announce (a 400 KB
/// sdist with a long-name header of zeros took 900 MB at lock time). A pax `size` record (files over 8 GiB, never
/// in an sdist) is refused, so the raw walk and a full tar reader always agree on where entries begin.
pub fn read_sdist_targz(bytes: &[u8]) -> std::io::Result<SdistContents> {
    let mut archive = tar::Archive::new(flate2::read::GzDecoder::new(bytes));
    let mut pkg_info: Option<String> = None;
    let mut requires_txt: Option<String> = None;
    let mut pyproject: Option<String> = None;
    let mut long_name: Option<Vec<u8>> = None;
    for entry in archive.entries()?.raw(true) {
        let mut entry = entry?;
        let kind = entry.header().entry_type();
        if kind.is_gnu_longname()
            || kind.is_gnu_longlink()
            || kind.is_pax_local_extensions()
            || kind.is_pax_global_extensions()
        {
            let size = entry.header().entry_size()?;
            if size > MAX_TAR_EXTENSION_HEADER {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!(
                        "its tar archive has an extension header of {size} bytes (at most \
                         {MAX_TAR_EXTENSION_HEADER} are read)"
                    ),
                ));
            }
            let mut data = Vec::new();
            (&mut entry).take(size).read_to_end(&mut data)?;
            if kind.is_gnu_longname() {
                let end = data.iter().position(|&b| b == 0).unwrap_or(data.len());
                data.truncate(end);
                long_name = Some(data);
            } else if kind.is_pax_local_extensions() || kind.is_pax_global_extensions() {
                for record in tar::PaxExtensions::new(&data) {
                    let record = record?;
                    match record.key_bytes() {
                        b"size" => {
                            return Err(std::io::Error::new(
                                std::io::ErrorKind::InvalidData,
                                "its tar archive has a pax `size` record (a file over 8 GiB)",
                            ));
                        }
                        b"path" if kind.is_pax_local_extensions() => {
                            long_name = Some(record.value_bytes().to_vec());
                        }
                        _ => {}
                    }
                }
            }
            continue;
        }
        let path = match long_name.take() {
            Some(name) => String::from_utf8_lossy(&name).into_owned(),
            None => entry.path()?.to_string_lossy().into_owned(),
        };
        let parts: Vec<&str> = path.trim_start_matches("./").split('/').collect();
        match parts.as_slice() {
            [_, "PKG-INFO"] => {
                let mut s = String::new();
                (&mut entry)
                    .take(MAX_METADATA_INFLATED)
                    .read_to_string(&mut s)?;
                pkg_info = Some(s);
            }
            [_, "pyproject.toml"] => {
                let mut s = String::new();
                (&mut entry)
                    .take(MAX_METADATA_INFLATED)
                    .read_to_string(&mut s)?;
                pyproject = Some(s);
            }
            [_, egg, "requires.txt"] | [_, _, egg, "requires.txt"]
                if egg.ends_with(".egg-info") && requires_txt.is_none() =>
            {
                let mut s = String::new();
                (&mut entry)
                    .take(MAX_METADATA_INFLATED)
                    .read_to_string(&mut s)?;
                requires_txt = Some(s);
            }
            _ => {}
        }
    }
    let build_requires = build_requires_from_pyproject(pyproject.as_deref())?;
    let metadata = pkg_info.map(|pkg_info| {
        let mut m = CoreMetadata::parse(&pkg_info);
        if m.requires_dist.is_empty()
            && let Some(req) = requires_txt
        {
            m.requires_dist = parse_requires_txt(&req);
        }
        m
    });
    Ok(SdistContents {
        metadata,
        build_requires,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A gzip-compressed tar whose first entry is a GNU long-name header announcing `size` bytes of zeros.
    fn targz_with_long_name_header(size: u64) -> Vec<u8> {
        use std::io::Write;
        let mut gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
        let mut header = tar::Header::new_gnu();
        header.set_path("././@LongLink").unwrap();
        header.set_entry_type(tar::EntryType::GNULongName);
        header.set_size(size);
        header.set_cksum();
        gz.write_all(header.as_bytes()).unwrap();
        let zeros = vec![0u8; 1 << 20];
        let mut left = size.div_ceil(512) * 512;
        while left > 0 {
            let n = left.min(zeros.len() as u64) as usize;
            gz.write_all(&zeros[..n]).unwrap();
            left -= n as u64;
        }
        gz.finish().unwrap()
    }

    /// A 400 KB sdist whose long-name header announced hundreds of MB made `hvd lock` hold it all in memory.
    #[test]
    fn sdist_extension_header_beyond_the_limit_is_refused_unread() {
        let sdist = targz_with_long_name_header(256 << 20);
        assert!(
            sdist.len() < 1 << 20,
            "the attack is small: {} bytes",
            sdist.len()
        );
        let err = read_sdist_targz(&sdist).expect_err("refused");
        assert!(err.to_string().contains("extension header"), "{err}");
    }

    #[test]
    fn sdist_with_a_long_top_directory_name_still_reads_its_metadata() {
        let top = "p".repeat(150);
        let mut builder = tar::Builder::new(flate2::write::GzEncoder::new(
            Vec::new(),
            flate2::Compression::fast(),
        ));
        let pkg_info = b"Metadata-Version: 2.1\nName: p\nVersion: 1.0\nRequires-Dist: q>=2\n";
        let mut header = tar::Header::new_gnu();
        header.set_size(pkg_info.len() as u64);
        header.set_mode(0o644);
        builder
            .append_data(&mut header, format!("{top}/PKG-INFO"), &pkg_info[..])
            .unwrap();
        let sdist = builder.into_inner().unwrap().finish().unwrap();
        let metadata = read_sdist_targz(&sdist).unwrap().metadata.unwrap();
        assert_eq!(metadata.requires_dist, ["q>=2"]);
    }

    #[test]
    fn parses_metadata() {
        let m = CoreMetadata::parse(
            "Metadata-Version: 2.1\nName: Foo\nVersion: 1.0\nRequires-Dist: bar>=1\nRequires-Dist: baz ; extra == \"x\"\nRequires-Python: >=3.8\nDescription: a\n  b\n\nBody: no\n",
        );
        assert_eq!(m.name, "Foo");
        assert_eq!(m.requires_dist, ["bar>=1", "baz ; extra == \"x\""]);
        assert_eq!(m.requires_python.as_deref(), Some(">=3.8"));
        assert!(!m.requires_dist_is_static());
    }

    #[test]
    fn reads_build_requires_or_the_pep517_default() {
        let default = ["setuptools>=40.8.0", "wheel"];
        assert_eq!(build_requires_from_pyproject(None).unwrap(), default);
        assert_eq!(
            build_requires_from_pyproject(Some("[project]\nname = \"x\"\n")).unwrap(),
            default
        );
        assert_eq!(
            build_requires_from_pyproject(Some(
                "[build-system]\nrequires = [\"flit_core >=3.2\", \"cython\"]\nbuild-backend = \"flit_core.buildapi\"\n"
            ))
            .unwrap(),
            ["flit_core >=3.2", "cython"]
        );
        assert!(build_requires_from_pyproject(Some("[build-system]\nrequires = 3\n")).is_err());
        assert!(build_requires_from_pyproject(Some("not = = toml")).is_err());
    }

    #[test]
    fn converts_requires_txt() {
        let r = parse_requires_txt(
            "cloudpickle\npsutil\n\n[:python_version < \"3.8\"]\nimportlib\n\n[tf]\ntensorflow\n",
        );
        assert_eq!(
            r,
            [
                "cloudpickle",
                "psutil",
                "importlib ; (python_version < \"3.8\")",
                "tensorflow ; extra == \"tf\""
            ]
        );
    }

    #[test]
    fn garbage_zip_is_an_error() {
        assert!(metadata_from_wheel_bytes(b"not a zip").is_err());
        assert!(metadata_from_wheel_bytes(b"").is_err());
    }

    /// An end-of-central-directory record (22 bytes) claiming `size` bytes at `offset`.
    fn eocd(offset: u32, size: u32) -> Vec<u8> {
        let mut r = 0x0605_4b50u32.to_le_bytes().to_vec();
        r.extend_from_slice(&[0; 8]);
        r.extend_from_slice(&size.to_le_bytes());
        r.extend_from_slice(&offset.to_le_bytes());
        r.extend_from_slice(&[0; 2]);
        r
    }

    /// Issue 16 item 16: a central directory pointing past the end panicked the range reader.
    #[test]
    fn central_directory_past_the_end_is_an_error_not_a_panic() {
        let tail = eocd(0xFFFF_FFF0, 0x100);
        assert!(find_central_directory(&tail, tail.len() as u64).is_err());
        // A file size smaller than the tail received (a lying Content-Range).
        assert!(find_central_directory(&tail, 3).is_err());
        // ZIP64 markers with a locator pointing anywhere.
        let mut z = 0x0706_4b50u32.to_le_bytes().to_vec();
        z.extend_from_slice(&[0; 4]);
        z.extend_from_slice(&u64::MAX.to_le_bytes());
        z.extend_from_slice(&[0; 4]);
        z.extend(eocd(0xFFFF_FFFF, 0xFFFF_FFFF));
        assert!(find_central_directory(&z, z.len() as u64).is_err());
        assert!(find_central_directory(&z, u64::MAX).is_err());
        let mut wheel = vec![0u8; 10];
        wheel.extend(eocd(5, 0xFFFF_FFFF));
        assert!(metadata_from_wheel_bytes(&wheel).is_err());
        let entry = ZipEntry {
            name: "a.dist-info/METADATA".into(),
            method: 0,
            compressed_size: u64::MAX,
            local_header_offset: u64::MAX,
        };
        let mut local = 0x0403_4b50u32.to_le_bytes().to_vec();
        local.extend_from_slice(&[0xFF; 40]);
        assert!(read_local_entry(&local, &entry).is_err());
    }

    proptest::proptest! {
        /// No bytes and no claimed file size make the zip readers panic.
        #[test]
        fn zip_readers_never_panic(
            body in proptest::collection::vec(proptest::num::u8::ANY, 0..300),
            offset in proptest::num::u32::ANY,
            size in proptest::num::u32::ANY,
            file_size in proptest::num::u64::ANY,
            compressed in proptest::num::u64::ANY,
        ) {
            let mut tail = body.clone();
            tail.extend(eocd(offset, size));
            let _ = find_central_directory(&tail, file_size);
            let _ = find_central_directory(&tail, tail.len() as u64);
            let _ = metadata_from_wheel_bytes(&tail);
            let _ = parse_central_directory(&body);
            let entry = ZipEntry {
                name: String::new(),
                method: 8,
                compressed_size: compressed,
                local_header_offset: u64::from(offset),
            };
            let _ = read_local_entry(&body, &entry);
        }
    }
}
