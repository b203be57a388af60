//! Installing a wheel into a package store path.
//!
//! Layout of a package path: `site-packages/` (the wheel root plus `.data/purelib` and `.data/platlib`),
//! `scripts/` (`.data/scripts`, shebangs untouched: they are rewritten per env, because one package path is shared
//! by many envs), `include/<name>/` (`.data/headers`) and `data/` (`.data/data`). Console scripts are generated per env
//! from the dist-info's `entry_points.txt`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use hvd_resolver::Sha256;

use crate::error::{Error, Result};
use crate::unpack;

/// RECORD's own files: RECORD cannot hold its own hash, and its signatures are made after it.
const RECORD_FILES: [&str; 3] = ["RECORD", "RECORD.jws", "RECORD.p7s"];

/// The largest RECORD read: the most entries an extraction allows ([`unpack::MAX_ENTRIES`]) at 300 bytes a line (a
/// long path and its hash) is 60 MB; real RECORDs are a few MB at most.
const MAX_RECORD_BYTES: u64 = 64 << 20;

/// Unpack `wheel` into `out` (a package path being built) and check every file against the wheel's RECORD.
///
/// Everything goes through [`unpack::unpack_zip`] with the wheel's layout: the root and `.data/purelib|platlib` to
/// `site-packages/`, `.data/scripts` to `scripts/`, `.data/headers` to `include/<name>/`, `.data/data` to `data/`.
/// Each file lands at its final place in one pass (nothing is moved afterwards, so no link is ever followed or
/// re-resolved), and RECORD is strict: every file and link must be listed with a sha256 that matches, and every
/// listed path must exist; only RECORD and its signatures may be missing. On any error `out` must be discarded.
/// Returns the sha256 of the installed files by path relative to `out` (for the store's content hash).
pub fn install_wheel(wheel: &Path, out: &Path) -> Result<BTreeMap<String, Sha256>> {
    let (extracted, _) = install(wheel, out, false)?;
    Ok(extracted
        .into_values()
        .filter(|entry| !entry.is_link)
        .filter_map(|entry| Some((entry.dest, entry.sha256?)))
        .collect())
}

/// [`install_wheel`] into a store path being built: every entry gets the store's mode and mtime as it is written,
/// and the manifest of the whole tree (hashed while it was written) is returned, so that the store neither
/// canonicalizes nor walks the tree again. The checks are the same.
pub(crate) fn install_wheel_for_store(wheel: &Path, out: &Path) -> Result<unpack::Manifest> {
    let (_, manifest) = install(wheel, out, true)?;
    manifest.ok_or_else(|| Error::InvalidWheel {
        wheel: wheel.to_path_buf(),
        message: "was unpacked without hashes".into(),
    })
}

/// [`install_wheel_for_store`] of the wheel `growing` is downloading to `wheel`: its files are written as the bytes
/// arrive (the central directory was read ahead), with every check of an installation from the complete file. The
/// manifest is returned only once the download matched its locked sha256 and size and the end read ahead equals
/// the verified file's; on any error `out` must be discarded.
pub(crate) fn install_growing_for_store(
    wheel: &Path,
    growing: std::sync::Arc<unpack::Growing>,
    out: &Path,
) -> Result<unpack::Manifest> {
    let installed = unpack::OpenZip::open_growing(wheel, growing.clone())
        .and_then(|zip| install_open(wheel, zip, out, true));
    // Nothing read counts before the download's verdict, and a failed download explains a failed read.
    growing.wait_verified()?;
    let (_, manifest) = installed?;
    manifest.ok_or_else(|| Error::InvalidWheel {
        wheel: wheel.to_path_buf(),
        message: "was unpacked without hashes".into(),
    })
}

/// The installation behind [`install_wheel`] and [`install_wheel_for_store`]: the archive is opened (its central
/// directory read) once.
fn install(
    wheel: &Path,
    out: &Path,
    store_modes: bool,
) -> Result<(unpack::Extracted, Option<unpack::Manifest>)> {
    install_open(wheel, unpack::OpenZip::open(wheel)?, out, store_modes)
}

/// [`install`] of the archive `zip`, opened from `wheel`.
fn install_open(
    wheel: &Path,
    zip: unpack::OpenZip<'_>,
    out: &Path,
    store_modes: bool,
) -> Result<(unpack::Extracted, Option<unpack::Manifest>)> {
    let invalid = |message: String| Error::InvalidWheel {
        wheel: wheel.to_path_buf(),
        message,
    };
    let (dist_info, data_dir) = wheel_dirs(wheel, &zip)?;
    let project = dist_info.split('-').next().unwrap_or_default().to_string();
    // The name part of `<name>-<version>.dist-info` becomes `include/<name>/`: it must be a distribution name (PEP 427
    // escapes it to letters, digits, `_` and `.`), not `..` or anything else that means a place.
    if project.is_empty()
        || project.starts_with('.')
        || !project
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.'))
    {
        return Err(invalid(format!(
            "its `.dist-info` directory `{dist_info}` does not start with a distribution name"
        )));
    }
    let layout = |name: &str| -> std::result::Result<Option<String>, String> {
        let top = name.split('/').next().unwrap_or_default();
        if data_dir.as_deref() == Some(top) {
            let rest = &name[top.len()..];
            let rest = rest.strip_prefix('/').unwrap_or(rest);
            if rest.is_empty() {
                return Ok(None);
            }
            let (kind, below) = rest.split_once('/').unwrap_or((rest, ""));
            let base = match kind {
                "purelib" | "platlib" => "site-packages".to_string(),
                "scripts" => "scripts".to_string(),
                "headers" => format!("include/{project}"),
                "data" => "data".to_string(),
                other => return Err(format!("is in the unknown `.data` directory `{other}`")),
            };
            if below.is_empty() {
                return Ok(None);
            }
            if base == "site-packages" {
                let first = below.split('/').next().unwrap_or_default();
                if first.ends_with(".dist-info") || first.ends_with(".data") {
                    return Err(format!("would install a second `{first}` directory"));
                }
            }
            return Ok(Some(format!("{base}/{below}")));
        }
        Ok(Some(format!("site-packages/{name}")))
    };
    let options = unpack::Options {
        layout: Some(&layout),
        ..unpack::Options::default()
    };
    let (extracted, manifest) = unpack::unpack_open_zip(zip, out, options, store_modes)?;

    let record_name = format!("{dist_info}/RECORD");
    let record_path = match extracted.get(&record_name) {
        Some(entry) if !entry.is_link => out.join(&entry.dest),
        _ => return Err(invalid(format!("`{record_name}` is missing"))),
    };
    // RECORD is one line per file: the extraction's file-count limit bounds a real one far below this. A bigger
    // one is an attack on memory (the ratio limit alone would let it inflate to gigabytes).
    let record_size = fs_err::metadata(&record_path)?.len();
    if record_size > MAX_RECORD_BYTES {
        return Err(invalid(format!(
            "`{record_name}` is {record_size} bytes (at most {MAX_RECORD_BYTES} are read)"
        )));
    }
    let record = fs_err::read_to_string(&record_path)?;
    let mut listed: BTreeMap<String, Option<String>> = BTreeMap::new();
    for (number, line) in record.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let fields = csv_fields(line);
        let (path, hash) = match fields.as_slice() {
            [path, hash, ..] => (path, hash),
            _ => {
                return Err(invalid(format!(
                    "RECORD line {} is not `path,hash,size`",
                    number + 1
                )));
            }
        };
        let path = unpack::normalize(path).map_err(|reason| {
            invalid(format!("RECORD line {} path `{path}` {reason}", number + 1))
        })?;
        let digest = hash.strip_prefix("sha256=").map(str::to_string);
        if listed.insert(path.clone(), digest).is_some() {
            return Err(invalid(format!("RECORD lists `{path}` twice")));
        }
    }
    let is_record_file = |path: &str| {
        path.strip_prefix(&dist_info)
            .and_then(|rest| rest.strip_prefix('/'))
            .is_some_and(|file| RECORD_FILES.contains(&file))
    };
    for (path, entry) in &extracted {
        if is_record_file(path) {
            continue;
        }
        let digest = match listed.get(path) {
            None => {
                return Err(invalid(format!(
                    "`{path}` is not listed in RECORD: every installed file must be"
                )));
            }
            Some(None) => {
                return Err(invalid(format!(
                    "RECORD lists `{path}` without a sha256 hash: every installed file needs one"
                )));
            }
            Some(Some(digest)) => digest,
        };
        let actual = entry
            .sha256
            .as_ref()
            .map(Sha256::record_form)
            .unwrap_or_default();
        if &actual != digest {
            return Err(invalid(format!("`{path}` does not match its RECORD hash")));
        }
    }
    if let Some(path) = listed
        .keys()
        .find(|path| !is_record_file(path) && !extracted.contains_key(*path))
    {
        return Err(invalid(format!(
            "RECORD lists `{path}`, which the wheel does not contain"
        )));
    }
    Ok((extracted, manifest))
}

/// The wheel's `.dist-info` directory (exactly one) and `.data` directory (at most one), from its zip listing.
fn wheel_dirs(wheel: &Path, zip: &unpack::OpenZip<'_>) -> Result<(String, Option<String>)> {
    let invalid = |message: String| Error::InvalidWheel {
        wheel: wheel.to_path_buf(),
        message,
    };
    let (mut dist_infos, mut datas) = (BTreeSet::new(), BTreeSet::new());
    for name in zip.names() {
        // Bad names are refused (with their reason) by the extraction itself.
        let Ok(name) = unpack::normalize(name) else {
            continue;
        };
        let Some((top, _)) = name.split_once('/') else {
            continue;
        };
        if top.ends_with(".dist-info") {
            dist_infos.insert(top.to_string());
        } else if top.ends_with(".data") {
            datas.insert(top.to_string());
        }
    }
    let dist_info = match dist_infos.len() {
        1 => dist_infos.pop_first().unwrap_or_default(),
        0 => return Err(invalid("no `.dist-info` directory".into())),
        _ => {
            return Err(invalid(format!(
                "more than one `.dist-info` directory: {dist_infos:?}"
            )));
        }
    };
    if datas.len() > 1 {
        return Err(invalid(format!(
            "more than one `.data` directory: {datas:?}"
        )));
    }
    Ok((dist_info, datas.pop_first()))
}

/// The fields of one CSV line (RECORD's format): commas separate, double quotes quote, `""` is a quote.
fn csv_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut quoted = false;
    let mut chars = line.trim_end_matches('\r').chars().peekable();
    while let Some(c) = chars.next() {
        let field = fields.last_mut().expect("never empty");
        match c {
            '"' if quoted && chars.peek() == Some(&'"') => {
                chars.next();
                field.push('"');
            }
            '"' => quoted = !quoted,
            ',' if !quoted => fields.push(String::new()),
            c => field.push(c),
        }
    }
    fields
}

/// The single top-level directory of `dir` whose name ends with `suffix`.
pub(crate) fn find_suffix_dir(dir: &Path, suffix: &str) -> Result<Option<std::path::PathBuf>> {
    let mut found = Vec::new();
    for entry in fs_err::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().ends_with(suffix) && entry.file_type()?.is_dir() {
            found.push(entry.path());
        }
    }
    found.sort();
    Ok(found.into_iter().next())
}

/// A `console_scripts` / `gui_scripts` entry point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct EntryPoint {
    pub name: String,
    pub module: String,
    /// Dotted attribute path inside the module; empty when the module itself is the entry.
    pub attribute: String,
}

/// Parse the script sections of an `entry_points.txt`.
pub(crate) fn parse_entry_points(text: &str) -> Vec<EntryPoint> {
    let mut section = String::new();
    let mut points = Vec::new();
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') || line.starts_with(';') {
            continue;
        }
        if line.starts_with('[') && line.ends_with(']') {
            section = line[1..line.len() - 1].trim().to_string();
            continue;
        }
        if section != "console_scripts" && section != "gui_scripts" {
            continue;
        }
        let Some((name, value)) = line.split_once('=') else {
            continue;
        };
        // Drop extras (`module:attr [extra]`).
        let value = value.split('[').next().unwrap_or_default().trim();
        let (module, attribute) = value.split_once(':').unwrap_or((value, ""));
        let valid = |s: &str| {
            s.chars()
                .all(|c| c.is_alphanumeric() || c == '_' || c == '.')
        };
        let name = name.trim();
        if name.is_empty()
            || name.contains('/')
            || !valid(module.trim())
            || !valid(attribute.trim())
        {
            continue;
        }
        points.push(EntryPoint {
            name: name.to_string(),
            module: module.trim().to_string(),
            attribute: attribute.trim().to_string(),
        });
    }
    points
}

/// The launcher script for an entry point, run by `python`. The call is guarded by `__name__ == "__main__"`, as in
/// pip's scripts: multiprocessing's spawn start method re-imports the main module in every child (as `__mp_main__`),
/// which must not run the command again (`horovodrun` starts its workers that way).
pub(crate) fn entry_point_script(python: &Path, point: &EntryPoint) -> String {
    let (import, call) = if point.attribute.is_empty() {
        (
            "import runpy".to_string(),
            format!(
                "runpy.run_module({:?}, run_name=\"__main__\")\n    sys.exit(0)",
                point.module
            ),
        )
    } else {
        let first = point.attribute.split('.').next().unwrap_or_default();
        (
            format!("from {} import {first}", point.module),
            format!("sys.exit({}())", point.attribute),
        )
    };
    format!(
        "#!{}\n# -*- coding: utf-8 -*-\nimport re\nimport sys\n{import}\nif __name__ == \"__main__\":\n    \
         sys.argv[0] = re.sub(r\"(-script\\.pyw|\\.exe)?$\", \"\", sys.argv[0])\n    {call}\n",
        python.display()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn record_lines_are_csv() {
        assert_eq!(csv_fields("a/b.py,sha256=x,3"), ["a/b.py", "sha256=x", "3"]);
        assert_eq!(
            csv_fields("\"a,\"\"b\"\".py\",sha256=x,3\r"),
            ["a,\"b\".py", "sha256=x", "3"]
        );
        assert_eq!(
            csv_fields("x.dist-info/RECORD,,"),
            ["x.dist-info/RECORD", "", ""]
        );
    }

    #[test]
    fn entry_points_parse() {
        let points = parse_entry_points(
            "[console_scripts]\nfoo = foo.cli:main [extra]\nbar=bar\n\n[other]\nx = y:z\n[gui_scripts]\ng = g.app:App.run\n",
        );
        assert_eq!(points.len(), 3);
        assert_eq!(
            points[0],
            EntryPoint {
                name: "foo".into(),
                module: "foo.cli".into(),
                attribute: "main".into()
            }
        );
        assert_eq!(points[2].attribute, "App.run");
        let script = entry_point_script(Path::new("/env/bin/python"), &points[0]);
        assert!(script.starts_with("#!/env/bin/python\n"));
        assert!(script.contains("from foo.cli import main\nif __name__ == \"__main__\":\n"));
        assert!(script.contains("\n    sys.exit(main())\n"));
    }

    /// A console script whose command starts processes with multiprocessing's spawn method (as `horovodrun` does):
    /// each child re-imports the script, which must not run the command again.
    #[test]
    fn entry_point_scripts_survive_multiprocessing_spawn() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(
            dir.path().join("spawner.py"),
            "import multiprocessing as mp\n\ndef work(x):\n    return x * 2\n\n\
             def main():\n    with mp.get_context('spawn').Pool(1) as pool:\n        print(pool.map(work, [21]))\n    \
             return 0\n",
        )
        .unwrap();
        let python = std::env::var("HVD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
        let point = EntryPoint {
            name: "spawner".into(),
            module: "spawner".into(),
            attribute: "main".into(),
        };
        let script = dir.path().join("spawner-script");
        std::fs::write(&script, entry_point_script(Path::new(&python), &point)).unwrap();
        // Without the guard the children fail and the pool replaces them forever: a deadline, not a hang.
        let mut child = std::process::Command::new(&python)
            .arg(&script)
            .env("PYTHONPATH", dir.path())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("run python");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
        while child.try_wait().unwrap().is_none() {
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.trim() == "[42]",
            "{}: {stdout}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
