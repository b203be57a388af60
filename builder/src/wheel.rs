//! Installing a wheel into a package store path.
//!
//! Layout of a package path: `site-packages/` (the wheel root plus `.data/purelib` and `.data/platlib`),
//! `scripts/` (`.data/scripts`, shebangs untouched: they are rewritten per env, because one package path is shared
//! by many envs), `include/<name>/` (`.data/headers`) and `data/` (`.data/data`). Console scripts are generated per env
//! from the dist-info's `entry_points.txt`.

use std::collections::BTreeMap;
use std::path::Path;

use crate::hash::Sha256;

use base64_free::urlsafe_no_pad;

use crate::error::{Error, Result};
use crate::unpack;

/// Unpack `wheel` into `out` (a package path being built) and check the files against the wheel's RECORD.
/// Returns the sha256 of the installed files by path relative to `out` (for the store's content hash).
pub fn install_wheel(wheel: &Path, out: &Path) -> Result<BTreeMap<String, Sha256>> {
    let invalid = |message: String| Error::InvalidWheel {
        wheel: wheel.to_path_buf(),
        message,
    };
    let site = out.join("site-packages");
    fs_err::create_dir_all(&site)?;
    let hashes = unpack::unpack_zip(wheel, &site)?;
    let mut known: BTreeMap<String, Sha256> = hashes
        .iter()
        .map(|(path, hash)| (format!("site-packages/{path}"), hash.clone()))
        .collect();

    let dist_info = find_suffix_dir(&site, ".dist-info")?
        .ok_or_else(|| invalid("no `.dist-info` directory".into()))?;
    let dist_info_name = dist_info
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let record_path = dist_info.join("RECORD");
    if record_path.is_file() {
        let record = fs_err::read_to_string(&record_path)?;
        for line in record.lines().filter(|l| !l.trim().is_empty()) {
            let mut fields = line.rsplitn(3, ',');
            let _size = fields.next();
            let hash = fields.next().unwrap_or_default();
            let path = fields.next().unwrap_or_default().trim_matches('"');
            let Some(digest) = hash.strip_prefix("sha256=") else {
                continue;
            };
            let Some(actual) = hashes.get(path) else {
                return Err(invalid(format!(
                    "RECORD lists `{path}`, which the wheel does not contain"
                )));
            };
            let actual = urlsafe_no_pad(&hex::decode(actual.as_str()).unwrap_or_default());
            if actual != digest {
                return Err(invalid(format!("`{path}` does not match its RECORD hash")));
            }
        }
    } else {
        return Err(invalid(format!("`{dist_info_name}/RECORD` is missing")));
    }

    if let Some(data) = find_suffix_dir(&site, ".data")? {
        for entry in fs_err::read_dir(&data)? {
            let entry = entry?;
            let kind = entry.file_name().to_string_lossy().into_owned();
            let target = match kind.as_str() {
                "purelib" | "platlib" => site.clone(),
                "scripts" => out.join("scripts"),
                "headers" => out
                    .join("include")
                    .join(dist_info_name.split('-').next().unwrap_or("package")),
                "data" => out.join("data"),
                other => return Err(invalid(format!("unknown `.data` directory `{other}`"))),
            };
            merge_move(&entry.path(), &target, out, &mut known)?;
        }
        fs_err::remove_dir_all(&data)?;
    }
    Ok(known)
}

fn relative_key(out: &Path, path: &Path) -> String {
    path.strip_prefix(out)
        .unwrap_or(path)
        .to_string_lossy()
        .into_owned()
}

/// The single top-level directory of `dir` whose name ends with `suffix`.
pub(crate) fn find_suffix_dir(dir: &Path, suffix: &str) -> Result<Option<std::path::PathBuf>> {
    let mut found = Vec::new();
    for entry in fs_err::read_dir(dir)? {
        let entry = entry?;
        if entry.file_name().to_string_lossy().ends_with(suffix) && entry.path().is_dir() {
            found.push(entry.path());
        }
    }
    found.sort();
    Ok(found.into_iter().next())
}

/// Move the contents of `from` into `to`, merging directories.
/// Move the contents of `from` into `to`, merging directories, and keep `known` (file hashes keyed by path
/// relative to `out`) in step with every move.
fn merge_move(
    from: &Path,
    to: &Path,
    out: &Path,
    known: &mut BTreeMap<String, Sha256>,
) -> Result<()> {
    fs_err::create_dir_all(to)?;
    for entry in fs_err::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() && target.is_dir() {
            merge_move(&entry.path(), &target, out, known)?;
        } else {
            if target.is_dir() && !target.is_symlink() {
                crate::store::remove_tree(&target)?;
            }
            fs_err::rename(entry.path(), &target)?;
            let (from_key, to_key) = (relative_key(out, &entry.path()), relative_key(out, &target));
            // Anything known under the target is replaced; whatever was known under the source moves along.
            known.retain(|key, _| key != &to_key && !key.starts_with(&format!("{to_key}/")));
            let moved: Vec<(String, Sha256)> = known
                .iter()
                .filter(|(key, _)| **key == from_key || key.starts_with(&format!("{from_key}/")))
                .map(|(key, hash)| (key.clone(), hash.clone()))
                .collect();
            for (key, hash) in moved {
                known.remove(&key);
                known.insert(format!("{to_key}{}", &key[from_key.len()..]), hash);
            }
        }
    }
    Ok(())
}

/// A `console_scripts` / `gui_scripts` entry point.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryPoint {
    pub name: String,
    pub module: String,
    /// Dotted attribute path inside the module; empty when the module itself is the entry.
    pub attribute: String,
}

/// Parse the script sections of an `entry_points.txt`.
pub fn parse_entry_points(text: &str) -> Vec<EntryPoint> {
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
pub fn entry_point_script(python: &Path, point: &EntryPoint) -> String {
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

/// Minimal base64 (URL-safe alphabet, no padding) for RECORD digests; a dependency for 20 lines is not worth it.
mod base64_free {
    pub fn urlsafe_no_pad(bytes: &[u8]) -> String {
        const ALPHABET: &[u8; 64] =
            b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
        for chunk in bytes.chunks(3) {
            let b = [
                chunk[0],
                *chunk.get(1).unwrap_or(&0),
                *chunk.get(2).unwrap_or(&0),
            ];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            let chars = chunk.len() + 1;
            for i in 0..chars {
                out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn base64_matches_known_values() {
        assert_eq!(urlsafe_no_pad(b"f"), "Zg");
        assert_eq!(urlsafe_no_pad(b"fo"), "Zm8");
        assert_eq!(urlsafe_no_pad(b"foo"), "Zm9v");
        assert_eq!(urlsafe_no_pad(&[0xfb, 0xff]), "-_8");
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
