//! Skipping unchanged steps: a step's input hash covers the env hash, its command, its variables and worker count,
//! the content of its declared inputs and the outputs of the steps it needs. State lives in `.hvd/steps/<step>.json`.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use crate::LaunchError;
use crate::engine::PlannedStep;

/// What was recorded after a step last succeeded.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StepRecord {
    pub input_hash: String,
    pub outputs_hash: String,
}

/// Hashes the content of `paths` (files or directories, relative to `dir`), walking directories in sorted order.
/// Missing paths hash as missing, so creating one changes the hash.
pub fn hash_paths(dir: &Path, paths: &[String]) -> Result<String, LaunchError> {
    let mut hasher = Sha256::new();
    for path in paths {
        hasher.update(b"path\0");
        hasher.update(path.as_bytes());
        hasher.update(b"\0");
        hash_tree(&mut hasher, &dir.join(path), Path::new(""))?;
    }
    Ok(hex(&hasher.finalize()))
}

fn hash_tree(hasher: &mut Sha256, path: &Path, rel: &Path) -> Result<(), LaunchError> {
    let io = |source| LaunchError::Io {
        path: path.to_path_buf(),
        source,
    };
    let meta = match std::fs::symlink_metadata(path) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            hasher.update(b"missing\0");
            return Ok(());
        }
        Err(e) => return Err(io(e)),
    };
    if meta.is_dir() {
        hasher.update(b"dir\0");
        let mut entries: Vec<PathBuf> = fs_err::read_dir(path)
            .map_err(&io)?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .collect();
        entries.sort();
        for entry in entries {
            let name = entry.file_name().map(PathBuf::from).unwrap_or_default();
            hasher.update(name.as_os_str().as_encoded_bytes());
            hasher.update(b"\0");
            hash_tree(hasher, &entry, &rel.join(&name))?;
        }
    } else if meta.is_symlink() {
        hasher.update(b"link\0");
        let target = fs_err::read_link(path).map_err(&io)?;
        hasher.update(target.as_os_str().as_encoded_bytes());
    } else {
        hasher.update(b"file\0");
        hasher.update(meta.len().to_le_bytes());
        let mut file = fs_err::File::open(path).map_err(&io)?;
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = file.read(&mut buf).map_err(&io)?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
        }
    }
    Ok(())
}

/// The input hash of `step`, given the output hashes of the steps it needs.
pub fn input_hash(
    step: &PlannedStep,
    project_dir: &Path,
    env_hash: Option<&str>,
    upstream_outputs: &BTreeMap<String, String>,
) -> Result<String, LaunchError> {
    let mut hasher = Sha256::new();
    let mut field = |name: &str, value: &[u8]| {
        hasher.update(name.as_bytes());
        hasher.update((value.len() as u64).to_le_bytes());
        hasher.update(value);
    };
    field("env", env_hash.unwrap_or("").as_bytes());
    field("command", step.command.as_bytes());
    field(
        "workers",
        step.workers
            .map(|w| w.to_string())
            .unwrap_or_default()
            .as_bytes(),
    );
    for (k, v) in &step.env {
        field("var", format!("{k}={v}").as_bytes());
    }
    field("inputs", hash_paths(project_dir, &step.inputs)?.as_bytes());
    for need in &step.needs {
        field(
            "upstream",
            format!(
                "{need}={}",
                upstream_outputs.get(need).map_or("", String::as_str)
            )
            .as_bytes(),
        );
    }
    Ok(hex(&hasher.finalize()))
}

fn record_path(state_dir: &Path, step: &str) -> PathBuf {
    state_dir.join("steps").join(format!("{step}.json"))
}

/// The record of the step's last success, if any and readable (a damaged record just means "run it").
pub fn load(state_dir: &Path, step: &str) -> Option<StepRecord> {
    let text = std::fs::read_to_string(record_path(state_dir, step)).ok()?;
    serde_json::from_str(&text).ok()
}

/// Records a success (atomically: temp file + rename).
pub fn store(state_dir: &Path, step: &str, record: &StepRecord) -> Result<(), LaunchError> {
    let path = record_path(state_dir, step);
    let dir = path.parent().unwrap_or(state_dir);
    fs_err::create_dir_all(dir).map_err(|source| LaunchError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    let tmp = path.with_extension(format!("json.tmp.{}", std::process::id()));
    let text = serde_json::to_string_pretty(record).unwrap_or_default();
    fs_err::write(&tmp, text).map_err(|source| LaunchError::Io {
        path: tmp.clone(),
        source,
    })?;
    fs_err::rename(&tmp, &path).map_err(|source| LaunchError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(())
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
