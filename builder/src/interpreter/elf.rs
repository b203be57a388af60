//! Reading an ELF file's dynamic section (`DT_NEEDED`, `DT_RPATH`, `DT_RUNPATH`) and rewriting a search path in
//! place, for relocating an interpreter's installation into the store.
//!
//! Only what relocation needs: 64-bit little-endian files (x86_64, aarch64). The dynamic section is found through
//! the program headers (`PT_DYNAMIC`), its string table's address is mapped to a file offset through the `PT_LOAD`
//! segments. A search path is rewritten by overwriting its bytes in `.dynstr` with a string that is not longer,
//! padded with NULs: no offset, size or address in the file changes. `DT_RPATH` and `DT_RUNPATH` naming one string
//! are one search path; a search path whose bytes another dynamic string shares (the linker merges a string into
//! another's tail) is refused ([`ElfError::Shared`]). Every read is bounds-checked: a truncated or
//! hostile file is an [`ElfError`], never a panic or a read outside the buffer.

/// Why a file could not be read or edited as ELF.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ElfError {
    /// A header, table or string lies (partly) outside the file, or a field is inconsistent.
    #[error("malformed ELF: {0}")]
    Malformed(String),
    /// A valid ELF this code does not handle (32-bit or big-endian).
    #[error("unsupported ELF: {0}; only 64-bit little-endian files are relocated")]
    Unsupported(String),
    /// The replacement is longer than the string it replaces, so it cannot be edited in place.
    #[error(
        "the new search path `{new}` is longer than the old `{old}`; an in-place edit cannot grow it"
    )]
    TooLong { old: String, new: String },
    /// The replacement contains a NUL byte.
    #[error("a search path cannot contain a NUL byte")]
    Nul,
    /// Another dynamic string (a `DT_NEEDED`, `DT_SONAME`, ...) shares bytes with the search path (the linker
    /// merged one into the other's tail), so rewriting the path would change it too.
    #[error(
        "the search path `{0}` shares its bytes with another dynamic string; it cannot be edited in place"
    )]
    Shared(String),
}

const PT_LOAD: u32 = 1;
const PT_DYNAMIC: u32 = 2;
const DT_NULL: i64 = 0;
const DT_NEEDED: i64 = 1;
const DT_STRTAB: i64 = 5;
const DT_STRSZ: i64 = 10;
const DT_SONAME: i64 = 14;
const DT_CONFIG: i64 = 0x6fff_fefa;
const DT_DEPAUDIT: i64 = 0x6fff_fefb;
const DT_AUDIT: i64 = 0x6fff_fefc;
const DT_AUXILIARY: i64 = 0x7fff_fffd;
const DT_FILTER: i64 = 0x7fff_ffff;
const DT_RPATH: i64 = 15;
const DT_RUNPATH: i64 = 29;
/// A dynamic section longer than this many entries is refused (real ones have a few dozen).
const MAX_DYNAMIC_ENTRIES: usize = 1 << 16;

/// Which tag a search path came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SearchPathKind {
    Rpath,
    Runpath,
}

/// One `DT_RPATH`/`DT_RUNPATH` string: where it lies in the file and what it says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SearchPath {
    pub kind: SearchPathKind,
    /// The string's file offset.
    offset: usize,
    /// The string (without its NUL), `:`-separated directories.
    pub value: String,
    /// Whether another dynamic string lies (partly) in its bytes: it is then not rewritten.
    shared: bool,
}

/// What the dynamic section of a file says.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Dynamic {
    /// `DT_NEEDED` sonames in order.
    pub needed: Vec<String>,
    pub search_paths: Vec<SearchPath>,
}

/// Whether `bytes` starts like an ELF file.
pub fn is_elf(bytes: &[u8]) -> bool {
    bytes.starts_with(b"\x7fELF")
}

/// Read the dynamic section of an ELF file. A file without one (statically linked) gives an empty [`Dynamic`].
pub fn read_dynamic(bytes: &[u8]) -> Result<Dynamic, ElfError> {
    if !is_elf(bytes) {
        return Err(ElfError::Malformed("no ELF magic".into()));
    }
    let class = *bytes
        .get(4)
        .ok_or_else(|| malformed("the identification is cut short"))?;
    let data = *bytes
        .get(5)
        .ok_or_else(|| malformed("the identification is cut short"))?;
    if class != 2 {
        return Err(ElfError::Unsupported(format!("class {class} (not 64-bit)")));
    }
    if data != 1 {
        return Err(ElfError::Unsupported(format!(
            "data encoding {data} (not little-endian)"
        )));
    }
    let phoff = to_usize(u64_at(bytes, 0x20)?)?;
    let phentsize = usize::from(u16_at(bytes, 0x36)?);
    let phnum = usize::from(u16_at(bytes, 0x38)?);
    if phnum > 0 && phentsize < 56 {
        return Err(malformed(
            "program header entries are smaller than 56 bytes",
        ));
    }
    let mut loads = Vec::new();
    let mut dynamic = None;
    for index in 0..phnum {
        let at = index
            .checked_mul(phentsize)
            .and_then(|n| n.checked_add(phoff))
            .ok_or_else(|| malformed("program header table offset overflows"))?;
        let kind = u32_at(bytes, at)?;
        let offset = u64_at(bytes, at.saturating_add(8))?;
        let vaddr = u64_at(bytes, at.saturating_add(16))?;
        let filesz = u64_at(bytes, at.saturating_add(32))?;
        match kind {
            PT_LOAD => loads.push((offset, vaddr, filesz)),
            PT_DYNAMIC => dynamic = Some((offset, filesz)),
            _ => {}
        }
    }
    let Some((dyn_offset, dyn_size)) = dynamic else {
        return Ok(Dynamic::default());
    };
    let dyn_offset = to_usize(dyn_offset)?;
    let entries = to_usize(dyn_size)? / 16;
    if entries > MAX_DYNAMIC_ENTRIES {
        return Err(malformed("the dynamic section is implausibly large"));
    }
    let mut strtab = None;
    let mut strsz = None;
    let mut needed = Vec::new();
    let mut paths = Vec::new();
    // Every other string offset of the dynamic section (`DT_NEEDED` included).
    let mut others = Vec::new();
    for index in 0..entries {
        let at = dyn_offset
            .checked_add(index * 16)
            .ok_or_else(|| malformed("dynamic section offset overflows"))?;
        let tag = u64_at(bytes, at)? as i64;
        let value = u64_at(bytes, at.saturating_add(8))?;
        match tag {
            DT_NULL => break,
            DT_STRTAB => strtab = Some(value),
            DT_STRSZ => strsz = Some(value),
            DT_NEEDED => {
                needed.push(value);
                others.push(value);
            }
            DT_SONAME | DT_CONFIG | DT_DEPAUDIT | DT_AUDIT | DT_AUXILIARY | DT_FILTER => {
                others.push(value)
            }
            DT_RPATH => paths.push((SearchPathKind::Rpath, value)),
            DT_RUNPATH => paths.push((SearchPathKind::Runpath, value)),
            _ => {}
        }
    }
    if needed.is_empty() && paths.is_empty() {
        return Ok(Dynamic::default());
    }
    let strtab = strtab.ok_or_else(|| malformed("DT_STRTAB is missing"))?;
    let strsz = to_usize(strsz.ok_or_else(|| malformed("DT_STRSZ is missing"))?)?;
    let table = loads
        .iter()
        .find(|(_, vaddr, filesz)| strtab >= *vaddr && strtab - vaddr < *filesz)
        .map(|(offset, vaddr, _)| offset.checked_add(strtab - vaddr))
        .ok_or_else(|| malformed("DT_STRTAB lies in no loaded segment"))?
        .ok_or_else(|| malformed("DT_STRTAB's file offset overflows"))?;
    let table = to_usize(table)?;
    let end = table
        .checked_add(strsz)
        .filter(|end| *end <= bytes.len())
        .ok_or_else(|| malformed("the string table lies outside the file"))?;
    let strings = &bytes[table..end];
    let string_at = |offset: u64| -> Result<(usize, String), ElfError> {
        let start = to_usize(offset)?;
        let rest = strings
            .get(start..)
            .ok_or_else(|| malformed("a string offset lies outside the string table"))?;
        let len = rest
            .iter()
            .position(|b| *b == 0)
            .ok_or_else(|| malformed("a string is not NUL-terminated in the string table"))?;
        let text =
            std::str::from_utf8(&rest[..len]).map_err(|_| malformed("a string is not UTF-8"))?;
        Ok((table + start, text.to_string()))
    };
    let needed = needed
        .into_iter()
        .map(|offset| string_at(offset).map(|(_, name)| name))
        .collect::<Result<_, _>>()?;
    // The file ranges (NUL included) of every other string; a search path is shared when one overlaps it.
    let mut ranges = Vec::new();
    for offset in others {
        let (at, text) = string_at(offset)?;
        ranges.push((at, at + text.len()));
    }
    let paths = paths
        .into_iter()
        .map(|(kind, offset)| string_at(offset).map(|(offset, value)| (kind, offset, value)))
        .collect::<Result<Vec<_>, _>>()?;
    let mut search_paths: Vec<SearchPath> = Vec::new();
    for (index, (kind, offset, value)) in paths.iter().enumerate() {
        // `DT_RPATH` and `DT_RUNPATH` naming the same string: it is one string, rewritten once.
        if search_paths.iter().any(|p| p.offset == *offset) {
            continue;
        }
        let end = offset + value.len();
        let overlaps = |(start, stop): (usize, usize)| start <= end && *offset <= stop;
        let shared = ranges.iter().any(|range| overlaps(*range))
            || paths.iter().enumerate().any(|(other, (_, at, text))| {
                other != index && at != offset && overlaps((*at, at + text.len()))
            });
        search_paths.push(SearchPath {
            kind: *kind,
            offset: *offset,
            value: value.clone(),
            shared,
        });
    }
    Ok(Dynamic {
        needed,
        search_paths,
    })
}

/// Overwrite `path` (read from these `bytes` by [`read_dynamic`]) with `new`, padded with NULs to the old length.
pub fn set_search_path(bytes: &mut [u8], path: &SearchPath, new: &str) -> Result<(), ElfError> {
    if new.as_bytes().contains(&0) {
        return Err(ElfError::Nul);
    }
    if path.shared {
        return Err(ElfError::Shared(path.value.clone()));
    }
    if new.len() > path.value.len() {
        return Err(ElfError::TooLong {
            old: path.value.clone(),
            new: new.to_string(),
        });
    }
    let end = path
        .offset
        .checked_add(path.value.len())
        .filter(|end| *end <= bytes.len())
        .ok_or_else(|| malformed("the search path lies outside the file"))?;
    let slot = &mut bytes[path.offset..end];
    if slot != path.value.as_bytes() {
        return Err(malformed("the search path is not where it was read"));
    }
    slot.fill(0);
    slot[..new.len()].copy_from_slice(new.as_bytes());
    Ok(())
}

fn malformed(what: &str) -> ElfError {
    ElfError::Malformed(what.to_string())
}

fn to_usize(value: u64) -> Result<usize, ElfError> {
    usize::try_from(value).map_err(|_| malformed("an offset does not fit in memory"))
}

fn field<const N: usize>(bytes: &[u8], at: usize) -> Result<[u8; N], ElfError> {
    at.checked_add(N)
        .and_then(|end| bytes.get(at..end))
        .and_then(|slice| slice.try_into().ok())
        .ok_or_else(|| malformed("the file is truncated"))
}

fn u16_at(bytes: &[u8], at: usize) -> Result<u16, ElfError> {
    field::<2>(bytes, at).map(u16::from_le_bytes)
}

fn u32_at(bytes: &[u8], at: usize) -> Result<u32, ElfError> {
    field::<4>(bytes, at).map(u32::from_le_bytes)
}

fn u64_at(bytes: &[u8], at: usize) -> Result<u64, ElfError> {
    field::<8>(bytes, at).map(u64::from_le_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal 64-bit little-endian ELF: one PT_LOAD covering the file at vaddr 0x1000, one PT_DYNAMIC with
    /// DT_NEEDED "libfoo.so.1", DT_RUNPATH "/opt/old/prefix/lib", DT_STRTAB and DT_STRSZ.
    fn sample() -> Vec<u8> {
        elf_with(
            b"\0libfoo.so.1\0/opt/old/prefix/lib\0",
            &[(DT_NEEDED, 1), (DT_RUNPATH, 13)],
        )
    }

    /// The same layout with these `strings` and dynamic entries (before DT_STRTAB, DT_STRSZ and DT_NULL).
    fn elf_with(strings: &[u8], tags: &[(i64, u64)]) -> Vec<u8> {
        let ph_off = 64usize;
        let dyn_off = ph_off + 2 * 56;
        let mut dyn_entries: Vec<(i64, u64)> = tags.to_vec();
        dyn_entries.extend([
            (DT_STRTAB, 0),
            (DT_STRSZ, strings.len() as u64),
            (DT_NULL, 0),
        ]);
        let str_off = dyn_off + dyn_entries.len() * 16;
        let total = str_off + strings.len();
        let mut b = vec![0u8; total];
        b[..4].copy_from_slice(b"\x7fELF");
        b[4] = 2;
        b[5] = 1;
        b[0x20..0x28].copy_from_slice(&(ph_off as u64).to_le_bytes());
        b[0x36..0x38].copy_from_slice(&56u16.to_le_bytes());
        b[0x38..0x3a].copy_from_slice(&2u16.to_le_bytes());
        let mut ph = |index: usize, kind: u32, offset: u64, vaddr: u64, size: u64| {
            let at = ph_off + index * 56;
            b[at..at + 4].copy_from_slice(&kind.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&offset.to_le_bytes());
            b[at + 16..at + 24].copy_from_slice(&vaddr.to_le_bytes());
            b[at + 32..at + 40].copy_from_slice(&size.to_le_bytes());
        };
        ph(0, PT_LOAD, 0, 0x1000, total as u64);
        ph(
            1,
            PT_DYNAMIC,
            dyn_off as u64,
            0x1000 + dyn_off as u64,
            dyn_entries.len() as u64 * 16,
        );
        for (index, (tag, value)) in dyn_entries.iter().enumerate() {
            let at = dyn_off + index * 16;
            let value = if *tag == DT_STRTAB {
                0x1000 + str_off as u64
            } else {
                *value
            };
            b[at..at + 8].copy_from_slice(&tag.to_le_bytes());
            b[at + 8..at + 16].copy_from_slice(&value.to_le_bytes());
        }
        b[str_off..].copy_from_slice(strings);
        b
    }

    #[test]
    fn reads_needed_and_runpath_and_rewrites_in_place() {
        let mut bytes = sample();
        let dynamic = read_dynamic(&bytes).unwrap();
        assert_eq!(dynamic.needed, ["libfoo.so.1"]);
        assert_eq!(dynamic.search_paths.len(), 1);
        let path = &dynamic.search_paths[0];
        assert_eq!(path.kind, SearchPathKind::Runpath);
        assert_eq!(path.value, "/opt/old/prefix/lib");
        let len = bytes.len();
        set_search_path(&mut bytes, path, "$ORIGIN/../lib").unwrap();
        assert_eq!(bytes.len(), len);
        let again = read_dynamic(&bytes).unwrap();
        assert_eq!(again.search_paths[0].value, "$ORIGIN/../lib");
        assert_eq!(again.needed, ["libfoo.so.1"], "other strings are untouched");
        let too_long = "$ORIGIN/../../../../../../lib";
        assert!(matches!(
            set_search_path(&mut bytes, &again.search_paths[0], too_long),
            Err(ElfError::TooLong { .. })
        ));
        assert_eq!(
            set_search_path(&mut bytes, &again.search_paths[0], "a\0b"),
            Err(ElfError::Nul)
        );
    }

    #[test]
    fn every_truncation_of_a_valid_file_is_refused_or_read_without_panic() {
        let bytes = sample();
        for len in 0..bytes.len() {
            // Every prefix either fails cleanly or (never) reads a different string.
            if let Ok(dynamic) = read_dynamic(&bytes[..len]) {
                assert!(
                    dynamic
                        .search_paths
                        .iter()
                        .all(|p| p.value == "/opt/old/prefix/lib")
                );
            }
        }
        assert!(
            read_dynamic(&bytes[..bytes.len() - 1]).is_err(),
            "the last NUL is cut"
        );
    }

    #[test]
    fn hostile_headers_are_refused_cleanly() {
        let base = sample();
        // A program header table far beyond the file.
        let mut far = base.clone();
        far[0x20..0x28].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(read_dynamic(&far), Err(ElfError::Malformed(_))));
        // A string offset outside the string table.
        let mut offset = base.clone();
        let dyn_off = 64 + 2 * 56;
        offset[dyn_off + 16 + 8..dyn_off + 32].copy_from_slice(&0xffff_ffffu64.to_le_bytes());
        assert!(matches!(read_dynamic(&offset), Err(ElfError::Malformed(_))));
        // A string table size past the end of the file.
        let mut size = base.clone();
        size[dyn_off + 48 + 8..dyn_off + 64].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(read_dynamic(&size), Err(ElfError::Malformed(_))));
        // A huge dynamic segment size.
        let mut huge = base.clone();
        let ph1 = 64 + 56;
        huge[ph1 + 32..ph1 + 40].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(read_dynamic(&huge).is_err());
        // 32-bit and big-endian files are not handled, and say so.
        let mut class = base.clone();
        class[4] = 1;
        assert!(matches!(
            read_dynamic(&class),
            Err(ElfError::Unsupported(_))
        ));
        let mut endian = base.clone();
        endian[5] = 2;
        assert!(matches!(
            read_dynamic(&endian),
            Err(ElfError::Unsupported(_))
        ));
        assert!(read_dynamic(b"not an elf").is_err());
        // A stale SearchPath (the file changed under it) is refused, not written blindly.
        let dynamic = read_dynamic(&base).unwrap();
        let mut other = base.clone();
        let at = other.len() - 5;
        other[at] = b'X';
        assert!(matches!(
            set_search_path(&mut other, &dynamic.search_paths[0], "$ORIGIN"),
            Err(ElfError::Malformed(_))
        ));
    }

    #[test]
    fn rpath_and_runpath_naming_one_string_are_rewritten_once() {
        let mut bytes = elf_with(
            b"\0libfoo.so.1\0/opt/old/prefix/lib\0",
            &[(DT_NEEDED, 1), (DT_RPATH, 13), (DT_RUNPATH, 13)],
        );
        let dynamic = read_dynamic(&bytes).unwrap();
        assert_eq!(dynamic.search_paths.len(), 1, "{dynamic:?}");
        for path in &dynamic.search_paths {
            set_search_path(&mut bytes, path, "$ORIGIN/../lib").unwrap();
        }
        let again = read_dynamic(&bytes).unwrap();
        assert_eq!(again.search_paths[0].value, "$ORIGIN/../lib");
        assert_eq!(again.needed, ["libfoo.so.1"]);
    }

    #[test]
    fn a_search_path_sharing_bytes_with_another_string_is_refused() {
        // The linker merged the soname `lib.so` into the tail of the run path `/opt/x/lib.so` (offset 1 + 7).
        let strings = b"\0/opt/x/lib.so\0";
        for tag in [DT_NEEDED, DT_SONAME, DT_FILTER] {
            let mut bytes = elf_with(strings, &[(tag, 8), (DT_RUNPATH, 1)]);
            let before = bytes.clone();
            let dynamic = read_dynamic(&bytes).unwrap();
            assert_eq!(
                set_search_path(&mut bytes, &dynamic.search_paths[0], "$ORIGIN"),
                Err(ElfError::Shared("/opt/x/lib.so".into()))
            );
            assert_eq!(bytes, before, "nothing was written");
        }
        // A DT_RPATH that is the tail of the DT_RUNPATH: neither is rewritten.
        let mut bytes = elf_with(strings, &[(DT_RPATH, 8), (DT_RUNPATH, 1)]);
        let dynamic = read_dynamic(&bytes).unwrap();
        assert_eq!(dynamic.search_paths.len(), 2);
        for path in &dynamic.search_paths {
            assert!(matches!(
                set_search_path(&mut bytes, path, "$ORIGIN"),
                Err(ElfError::Shared(_))
            ));
        }
        // A string next to it (not overlapping) does not stop the rewrite.
        let mut bytes = elf_with(
            b"\0/opt/x/lib\0libfoo.so.1\0",
            &[(DT_NEEDED, 12), (DT_RUNPATH, 1)],
        );
        let dynamic = read_dynamic(&bytes).unwrap();
        set_search_path(&mut bytes, &dynamic.search_paths[0], "$ORIGIN").unwrap();
        assert_eq!(read_dynamic(&bytes).unwrap().needed, ["libfoo.so.1"]);
    }

    #[test]
    fn the_hosts_own_interpreter_reads() {
        // A real binary of this machine: whatever it is, reading it must not fail.
        let exe = std::fs::read("/proc/self/exe").unwrap();
        read_dynamic(&exe).unwrap();
    }
}
