//! What identifies a built env here: its store path, content hash and closure (every store path it references,
//! read from each one's `.hvd-path.json`), checked by the engines before any rank starts.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use crate::LaunchError;
use crate::glibc::{GlibcNeed, HostLibrary};

/// What identifies a built env: its store path name, its content hash and its closure (the store paths it
/// references, and theirs, from each one's `.hvd-path.json` here).
#[derive(Debug, Clone)]
pub(crate) struct EnvIdentity {
    /// The env's own store path name.
    pub name: String,
    pub content_hash: String,
    pub store: PathBuf,
    /// Every store path the env needs, the env excluded; each name checked with [`is_store_path_name`].
    pub closure: BTreeSet<String>,
    /// The newest glibc a wheel of the closure needs (`None`: no wheel has a manylinux tag).
    pub glibc: Option<GlibcNeed>,
    /// The shared libraries beyond glibc that the closure's interpreter loads from the host.
    pub host_libraries: Vec<HostLibrary>,
}

/// Whether `name` is a store path name: `<32 lowercase hex digits>-<name>-<version>` (see builder's
/// `Derivation::path_name`), the rest made of ASCII letters, digits and `-._+`, without `..`, at most 200
/// characters. So it has no `/`, does
/// not start with `-` and is never `.` or `..`: safe as an argument and as a path below the store.
pub fn is_store_path_name(name: &str) -> bool {
    let Some((hash, rest)) = name.split_once('-') else {
        return false;
    };
    // At most 200 characters, as the cache's records allow (`record::check_path_name`), so a name the launcher
    // writes is one a node's `hvd cache pull` takes.
    name.len() <= 200
        && hash.len() == 32
        && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        && !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._+".contains(&b))
        && !rest.contains("..")
}

/// `text` as a message may show it: at most 100 characters, control characters escaped.
pub(crate) fn printable(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(100)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().nth(100).is_some() {
        out.push_str("...");
    }
    format!("`{out}`")
}

impl EnvIdentity {
    /// `None` inside: the env is not a store path (`--env-dir` of a plain venv), so only its presence is checked.
    pub(crate) fn local(env: &Path) -> Result<Option<EnvIdentity>, LaunchError> {
        let file = env.join(".hvd-path.json");
        let text = match fs_err::read_to_string(&file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(LaunchError::Io { path: file, source }),
        };
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            LaunchError::Engine(format!(
                "{} is not valid JSON ({e}); rebuild the env with `hvd build`",
                file.display()
            ))
        })?;
        let Some(content_hash) = value["content_hash"].as_str() else {
            return Err(LaunchError::Engine(format!(
                "{} has no `content_hash`; rebuild the env with `hvd build`",
                file.display()
            )));
        };
        let name = env
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !is_store_path_name(&name) {
            return Err(LaunchError::Engine(format!(
                "{} has a `.hvd-path.json` but its name is not a store path name (`<hash>-<name>-<version>`); \
                 use the env hvd built (`hvd build`)",
                env.display()
            )));
        }
        let store = env.parent().unwrap_or(Path::new("/")).to_path_buf();
        let (closure, glibc, interpreters) = closure(&store, &name, &value)?;
        let host_libraries = host_libraries(&store, &interpreters)?;
        Ok(Some(EnvIdentity {
            name,
            content_hash: content_hash.to_owned(),
            store,
            closure,
            glibc,
            host_libraries,
        }))
    }
}

/// The names in the `references` of a `.hvd-path.json` (`info`, of store path `of`), each checked.
fn references_of(of: &str, info: &serde_json::Value) -> Result<Vec<String>, LaunchError> {
    let mut out = Vec::new();
    for reference in info["references"].as_array().into_iter().flatten() {
        match reference.as_str() {
            Some(r) if is_store_path_name(r) => out.push(r.to_owned()),
            _ => {
                return Err(LaunchError::Engine(format!(
                    "store path {of} lists {} as a reference, which is not a store path name; its \
                     `.hvd-path.json` is damaged: rebuild the env with `hvd build --rebuild`",
                    printable(&reference.to_string())
                )));
            }
        }
    }
    Ok(out)
}

/// A closure's store paths, the newest glibc its wheels need, and its interpreter paths.
type Closure = (BTreeSet<String>, Option<GlibcNeed>, BTreeSet<String>);

/// Every store path that env `name` (whose `.hvd-path.json` is `info`) needs, read here: its references, theirs, and
/// so on (the env itself is not in it); the newest glibc a wheel among them needs; and those of them whose
/// `.hvd-path.json` records the kind `interpreter`.
fn closure(store: &Path, name: &str, info: &serde_json::Value) -> Result<Closure, LaunchError> {
    let mut closure = BTreeSet::new();
    let mut interpreters = BTreeSet::new();
    let mut glibc: Option<GlibcNeed> = None;
    let mut queue: Vec<String> = references_of(name, info)?;
    while let Some(next) = queue.pop() {
        if next == name || !closure.insert(next.clone()) {
            continue;
        }
        let file = store.join(&next).join(".hvd-path.json");
        let text = fs_err::read_to_string(&file).map_err(|e| {
            LaunchError::Engine(format!(
                "store path {next}, which the env needs, is not valid here ({e}); rebuild the env with \
                 `hvd build`"
            ))
        })?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            LaunchError::Engine(format!(
                "{} is not valid JSON ({e}); rebuild the env with `hvd build --rebuild`",
                file.display()
            ))
        })?;
        queue.extend(references_of(&next, &value)?);
        if value["derivation"]["kind"].as_str() == Some("interpreter") {
            interpreters.insert(next.clone());
        }
        if let Some(need) = GlibcNeed::of_path(&value)
            && glibc.as_ref().is_none_or(|g| need.version > g.version)
        {
            glibc = Some(need);
        }
    }
    Ok((closure, glibc, interpreters))
}

/// The host libraries the interpreter paths of a closure list (`lib/hvd-host-libraries`, written by the builder
/// when it copied the interpreter in; a path without the file needs none). Only paths of the kind `interpreter`
/// are read: a wheel's files are its authors', and a list in one means nothing.
fn host_libraries(
    store: &Path,
    interpreters: &BTreeSet<String>,
) -> Result<Vec<HostLibrary>, LaunchError> {
    use std::io::Read as _;
    let mut out = Vec::new();
    for name in interpreters {
        let list = store.join(name).join("lib/hvd-host-libraries");
        let file = match std::fs::File::open(&list) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(LaunchError::Io { path: list, source }),
        };
        let mut text = String::new();
        file.take(crate::glibc::MAX_HOST_LIBRARIES_BYTES)
            .read_to_string(&mut text)
            .map_err(|source| LaunchError::Io {
                path: list.clone(),
                source,
            })?;
        out.extend(HostLibrary::parse(name, &text));
    }
    Ok(out)
}

/// Checks that this machine's glibc is as new as the wheels of the env at `env` need, and that it has the shared
/// libraries the env's interpreter needs to start (`where_` names this machine in the message; a library only an
/// extension module needs is a warning). An env that is not a store path (a plain venv given with `--env-dir`) is
/// not checked.
pub fn check_env_here(env: &std::path::Path, where_: &str) -> Result<(), crate::LaunchError> {
    let Some(identity) = EnvIdentity::local(env)? else {
        return Ok(());
    };
    if let Some(problem) = identity
        .glibc
        .and_then(|need| need.problem(crate::glibc::host(), where_))
    {
        return Err(crate::LaunchError::Engine(problem));
    }
    let missing = crate::glibc::missing_here(&identity.host_libraries);
    match crate::glibc::host_library_problem(&missing, where_) {
        Some(problem) => Err(crate::LaunchError::Engine(problem)),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store with an env referencing an interpreter path whose list names `libraries`.
    fn store_with(libraries: &str) -> (tempfile::TempDir, PathBuf) {
        store_of_kind("interpreter", libraries)
    }

    /// A store with an env referencing a path of `kind` (named like an interpreter) whose list names `libraries`.
    fn store_of_kind(kind: &str, libraries: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let python = "0123456789abcdef0123456789abcdef-python-3.11.7";
        let env = "fedcba9876543210fedcba9876543210-app-env";
        let write_info = |name: &str, kind: &str, references: &[&str]| {
            let path = dir.path().join(name);
            std::fs::create_dir_all(path.join("lib")).unwrap();
            let info = serde_json::json!({
                "content_hash": "00",
                "references": references,
                "derivation": { "kind": kind, "inputs": {} },
            });
            std::fs::write(path.join(".hvd-path.json"), info.to_string()).unwrap();
        };
        write_info(python, kind, &[]);
        write_info(env, "env", &[python]);
        std::fs::write(
            dir.path().join(python).join("lib/hvd-host-libraries"),
            libraries,
        )
        .unwrap();
        let env = dir.path().join(env);
        (dir, env)
    }

    #[test]
    fn an_interpreter_that_needs_a_library_this_machine_lacks_is_refused_before_a_run() {
        let (_dir, env) = store_with("libhvd-missing-for-test.so.3 bin/python3.11\n");
        let err = check_env_here(&env, "this machine")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("this machine lacks the shared library `libhvd-missing-for-test.so.3`"),
            "{err}"
        );
        assert!(err.contains("-python-3.11.7"), "{err}");
        // Only a module needs it: a warning, the run goes on; libraries this machine has pass.
        let (_dir, env) = store_with(
            "libhvd-missing-for-test.so.3 lib/python3.11/lib-dynload/_x.so\nlibm.so.6 bin/python3.11\n",
        );
        check_env_here(&env, "this machine").unwrap();
    }

    #[test]
    fn a_host_library_list_in_a_path_that_is_not_an_interpreter_is_not_read() {
        // A wheel shipping `lib/hvd-host-libraries` (its authors' file) cannot make every run refused.
        let (_dir, env) = store_of_kind("wheel", "libhvd-missing-for-test.so.3 bin/python3.11\n");
        check_env_here(&env, "this machine").unwrap();
    }
}
