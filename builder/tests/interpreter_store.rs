//! The interpreter as a store path (#18 §1): pyenv's python copied in without its third-party packages, relocated
//! (`RUNPATH` `$ORIGIN/../lib`), content-hashed and referenced by the env; an env runs with the host's
//! installation hidden; the lock's pin is checked; gc keeps the interpreter while an env references it.

#[allow(dead_code)] // each test binary uses part of the shared fixtures
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use hvd_builder::interpreter::{self, HOST_LIBRARIES, InterpreterPin, elf};
use hvd_builder::python::Interpreter;
use hvd_builder::{BuildOptions, EnvPlan, Error, NoProgress, Store, build_env};

#[path = "common/planted.rs"]
mod planted;

use common::walk;
use planted::plant_interpreter_path;

/// pyenv's 3.11 (see `pyenv_311`), a fresh directory and a store in it.
fn pyenv_store(test: &str) -> Option<(Interpreter, tempfile::TempDir, Store)> {
    let python = pyenv_311(test)?;
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store")).unwrap();
    Some((python, dir, store))
}

/// The installation prefix of `python` (the parent of its `bin`).
fn prefix_of(python: &Interpreter) -> PathBuf {
    python
        .executable
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf()
}

/// The env of `plan(python.version)` without a pin, built with the default options.
fn build_unpinned(store: &Store, python: &Interpreter) -> hvd_builder::EnvBuild {
    build_env(
        store,
        &plan(&python.version, None),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap()
}

/// `sh -c script` in a private mount namespace (PYTHONPATH and PYTHONHOME unset); `Err` with what `unshare` said
/// where this machine has no mount namespaces.
fn in_mount_namespace(script: &str) -> Result<std::process::Output, String> {
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "sh", "-c", script])
        .env_remove("PYTHONPATH")
        .env_remove("PYTHONHOME")
        .output()
        .unwrap();
    let said = String::from_utf8_lossy(&out.stderr).into_owned();
    if !out.status.success() && said.contains("unshare failed") {
        return Err(said);
    }
    Ok(out)
}

/// The file name of a store path.
fn name_of(path: &Path) -> String {
    path.file_name().unwrap().to_string_lossy().into_owned()
}

/// pyenv's 3.11 (every machine hvd is tested on has it, docs: FACTS); `None` prints a loud skip.
fn pyenv_311(test: &str) -> Option<Interpreter> {
    let root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".pyenv")))?;
    let versions = std::fs::read_dir(root.join("versions")).ok()?;
    let mut found: Vec<PathBuf> = versions
        .filter_map(|e| e.ok())
        .map(|e| e.path().join("bin/python3.11"))
        .filter(|p| p.is_file())
        .collect();
    found.sort();
    let found = found.pop().and_then(|p| Interpreter::probe(&p));
    if found.is_none() {
        eprintln!(
            "\n\n!!! SKIPPED {test}: no pyenv python 3.11; the interpreter store path is NOT tested !!!\n\n"
        );
    }
    found
}

fn plan(version: &str, pin: Option<InterpreterPin>) -> EnvPlan {
    EnvPlan {
        name: "pinned".into(),
        python: version.into(),
        interpreter: pin,
        packages: Vec::new(),
        toolchain: None,
        local_packages: Vec::new(),
    }
}

/// Total bytes of regular files under `dir` (links not followed).
fn size_of(dir: &Path) -> u64 {
    walk(dir)
        .iter()
        .filter_map(|p| std::fs::symlink_metadata(p).ok())
        .filter(|m| m.is_file())
        .map(|m| m.len())
        .sum()
}

#[test]
fn pyenv_python_becomes_a_slim_relocated_store_path_found_again_by_fingerprint() {
    let Some((python, dir, store)) =
        pyenv_store("pyenv_python_becomes_a_slim_relocated_store_path")
    else {
        return;
    };
    let prefix = prefix_of(&python);
    let start = Instant::now();
    let stored = interpreter::import(&store, &python).unwrap();
    let first = start.elapsed();
    let start = Instant::now();
    let again = interpreter::import(&store, &python).unwrap();
    let second = start.elapsed();
    eprintln!(
        "import of python {} into an empty store: {first:?}; again (fingerprint hit): {second:?}; {} MB",
        python.version,
        size_of(&stored.path) >> 20
    );
    assert_eq!(again, stored);
    // Deterministic: another store copies the same tree (a lock's pin names it on every machine with it).
    let other = Store::open(dir.path().join("other-store")).unwrap();
    let copied = interpreter::import(&other, &python).unwrap();
    assert_eq!(copied.content_hash, stored.content_hash);
    assert_eq!(copied.path.file_name(), stored.path.file_name());
    let name = name_of(&stored.path);
    assert!(
        name.ends_with(&format!("-python-{}", python.version)),
        "{name}"
    );
    assert_eq!(stored.version, python.version);

    // The recorded content hash is a fresh walk's, and the path is named by version and content hash alone.
    let manifest = hvd_builder::hash::manifest(&stored.path).unwrap();
    assert_eq!(
        hvd_builder::hash::content_hash(&manifest),
        stored.content_hash
    );
    assert_eq!(
        store.path_of(&interpreter::derivation(
            &stored.version,
            &stored.content_hash
        )),
        stored.path
    );

    // The interpreter's own installation, not the third-party packages beside it.
    let stdlib = stored.path.join("lib/python3.11");
    assert!(stdlib.join("os.py").is_file());
    assert!(stdlib.join("lib-dynload").is_dir());
    assert!(stored.path.join("include/python3.11/Python.h").is_file());
    let site = std::fs::read_dir(stdlib.join("site-packages"))
        .unwrap()
        .count();
    assert_eq!(site, 0, "site-packages is copied empty");
    assert!(!stdlib.join("test").exists(), "the test suite is left out");
    // No bytecode is copied; a `__pycache__` file beside the sources keeps bytecode from being written there.
    assert!(stdlib.join("__pycache__").is_file());
    assert!(stdlib.join("json/__pycache__").is_file());
    assert!(
        walk(&stored.path)
            .iter()
            .all(|p| !p.to_string_lossy().ends_with(".pyc")),
        "no bytecode"
    );
    assert!(
        walk(&stored.path)
            .iter()
            .all(|p| !p.to_string_lossy().ends_with(".a")),
        "no static library"
    );
    let size = size_of(&stored.path);
    assert!(size < 150 << 20, "{} MB is not slim", size >> 20);

    // Relocated: no search path of the executable (or of any ELF file) names the host's prefix.
    let exe = std::fs::read(stored.executable()).unwrap();
    let dynamic = elf::read_dynamic(&exe).unwrap();
    let host_prefix = prefix.to_string_lossy().into_owned();
    for path in walk(&stored.path) {
        let Ok(bytes) = std::fs::read(&path) else {
            continue;
        };
        if elf::is_elf(&bytes) {
            for search in elf::read_dynamic(&bytes).unwrap().search_paths {
                assert!(
                    !search.value.contains(&host_prefix),
                    "{}: {}",
                    path.display(),
                    search.value
                );
            }
        }
    }
    if dynamic.needed.iter().any(|n| n.starts_with("libpython")) {
        assert_eq!(dynamic.search_paths[0].value, "$ORIGIN/../lib");
    }
    // What it still needs from the host beyond glibc is listed (pyenv's _ssl needs libssl).
    let host_libraries = std::fs::read_to_string(stored.path.join(HOST_LIBRARIES)).unwrap();
    assert!(
        host_libraries.lines().any(|l| l.starts_with("libssl")),
        "{host_libraries}"
    );
    assert!(!host_libraries.lines().any(|l| l == "libc.so.6"));

    // Read-only all the way down, like every store path.
    for path in walk(&stored.path) {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        if !meta.file_type().is_symlink() {
            use std::os::unix::fs::PermissionsExt;
            assert_eq!(meta.permissions().mode() & 0o222, 0, "{}", path.display());
        }
    }
}

#[test]
fn an_env_runs_from_the_store_with_the_hosts_installation_hidden() {
    let Some((python, _dir, store)) =
        pyenv_store("an_env_runs_from_the_store_with_the_hosts_installation_hidden")
    else {
        return;
    };
    let prefix = prefix_of(&python);
    let built = build_unpinned(&store, &python);
    let stored = interpreter::import(&store, &python).unwrap();
    let cfg = std::fs::read_to_string(built.env.join("pyvenv.cfg")).unwrap();
    assert!(
        cfg.contains(&format!("home = {}", stored.path.join("bin").display())),
        "{cfg}"
    );
    assert_eq!(
        std::fs::read_link(built.env.join("bin/python")).unwrap(),
        stored.executable()
    );
    // The env references its interpreter: closures (push, pull, substitution) and gc follow references.
    let info = store.path_info(&built.env).unwrap();
    let python_name = name_of(&stored.path);
    assert!(
        info.references.contains(&python_name),
        "{:?}",
        info.references
    );

    // Hide the host's installation under an empty tmpfs in a private mount namespace and run the env there.
    // The configure-time variables (what builds of extensions read: `-L$LIBDIR`, `INCLUDEPY`) name the copy, and
    // no value names the host's installation any more (3.11's `WASM_*` hold `./<prefix>`, a path relative to a
    // WebAssembly build's directory, not the installation: left as they are).
    let code = format!(
        "import sys, ssl, ctypes, sqlite3, json, decimal, hashlib, zlib, os, sysconfig; \
         print(sys.base_prefix); print(ssl.OPENSSL_VERSION.split()[0]); v = sysconfig.get_config_vars(); \
         print(v[\"LIBDIR\"]); print(os.path.isfile(os.path.join(v[\"INCLUDEPY\"], \"Python.h\"))); \
         print(sorted(k for k, x in v.items() if isinstance(x, str) and \"{}\" in x and not k.startswith(\"WASM_\")))",
        prefix.display()
    );
    let script = format!(
        "mount -t tmpfs none {prefix} && test ! -e {exe} && exec {python} -c '{code}'",
        prefix = prefix.display(),
        exe = python.executable.display(),
        python = built.env.join("bin/python").display(),
    );
    let out = match in_mount_namespace(&script) {
        Ok(out) => out,
        Err(said) => {
            eprintln!(
                "\n\n!!! SKIPPED the hidden-host part of an_env_runs_from_the_store_with_the_hosts_installation_hidden: \
                 no mount namespaces here ({}) !!!\n\n",
                said.trim()
            );
            return;
        }
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "stdout: {stdout}\nstderr: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut lines = stdout.lines();
    assert_eq!(lines.next(), Some(stored.path.to_str().unwrap()));
    assert_eq!(lines.next(), Some("OpenSSL"));
    assert_eq!(
        lines.next(),
        Some(stored.path.join("lib").to_str().unwrap()),
        "LIBDIR: {stdout}"
    );
    assert_eq!(lines.next(), Some("True"), "INCLUDEPY: {stdout}");
    assert_eq!(
        lines.next(),
        Some("[]"),
        "variables naming the host's installation: {stdout}"
    );
}

#[test]
fn the_locks_pin_names_the_path_and_a_tampered_hash_is_refused() {
    let Some((python, _dir, store)) =
        pyenv_store("the_locks_pin_names_the_path_and_a_tampered_hash_is_refused")
    else {
        return;
    };
    let stored = interpreter::import(&store, &python).unwrap();

    // The pin as `hvd lock` writes it builds an env over exactly that path.
    let built = build_env(
        &store,
        &plan(&python.short_version, Some(stored.pin())),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(
        std::fs::read_link(built.env.join("bin/python")).unwrap(),
        stored.executable()
    );

    // A lock from a pull request pins other content for the same version: refused, naming both hashes.
    let tampered = hvd_builder::Sha256::of_bytes(b"someone else's python");
    let err = build_env(
        &store,
        &plan(
            &python.short_version,
            Some(InterpreterPin {
                version: python.version.clone(),
                content_hash: tampered.clone(),
            }),
        ),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap_err();
    match &err {
        Error::InterpreterMismatch {
            version,
            expected,
            found,
            ..
        } => {
            assert_eq!(version, &python.version);
            assert_eq!(expected, tampered.as_str());
            assert_eq!(found, stored.content_hash.as_str());
        }
        other => panic!("expected an interpreter mismatch, got {other}"),
    }
    let message = err.to_string();
    assert!(message.contains(tampered.as_str()) && message.contains(stored.content_hash.as_str()));
    // Nothing was built under the tampered pin's name.
    let forged = store.path_of(&interpreter::derivation(&python.version, &tampered));
    assert!(!forged.exists());
}

/// #22 §4: the pinned interpreter is copied in while the wheels download and install. A cold build makes both;
/// a pin this machine cannot satisfy is still the error reported (not a wheel's, not a success), and no env is
/// built, though the wheel was in flight meanwhile.
#[test]
fn a_pinned_interpreter_is_copied_in_beside_the_wheels_and_its_mismatch_is_the_error() {
    let test = "a_pinned_interpreter_is_copied_in_beside_the_wheels_and_its_mismatch_is_the_error";
    let Some(python) = pyenv_311(test) else {
        return;
    };
    let (dir, server, store) = common::served_store();
    let wheel = common::make_wheel(
        &server.root,
        "alpha",
        "1.0",
        &[("alpha/__init__.py", b"VALUE = 1\n")],
        None,
    );
    let with_wheel = |pin: InterpreterPin| EnvPlan {
        packages: vec![server.wheel_plan("alpha", "1.0", &wheel)],
        ..plan(&python.short_version, Some(pin))
    };
    // The pin as `hvd lock` writes it: computed without copying anything into the store.
    let pin = interpreter::pin(&store, &python).unwrap();
    let pinned_path = store.path_of(&interpreter::derivation(&pin.version, &pin.content_hash));
    assert!(!pinned_path.exists());
    let built = build_env(
        &store,
        &with_wheel(pin.clone()),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap();
    assert!(store.is_valid(&pinned_path));
    let stored = interpreter::StoredPython::from_path(&store, &pinned_path).unwrap();
    assert_eq!(
        std::fs::read_link(built.env.join("bin/python")).unwrap(),
        stored.executable()
    );
    assert!(
        built
            .packages
            .iter()
            .all(|p| p.built && store.is_valid(&p.path))
    );

    // Another store, a pin of other content: the mismatch is the error, and there is no env.
    let fresh = Store::open(dir.path().join("fresh-store")).unwrap();
    let tampered = hvd_builder::Sha256::of_bytes(b"someone else's python");
    let err = build_env(
        &fresh,
        &with_wheel(InterpreterPin {
            version: python.version.clone(),
            content_hash: tampered.clone(),
        }),
        &BuildOptions::default(),
        &NoProgress,
    )
    .unwrap_err();
    assert!(
        matches!(&err, Error::InterpreterMismatch { expected, .. } if expected == tampered.as_str()),
        "{err}"
    );
    let kinds: Vec<_> = fresh
        .list_paths()
        .unwrap()
        .iter()
        .map(|name| {
            fresh
                .path_info(&fresh.root().join(name))
                .unwrap()
                .derivation
                .kind
        })
        .collect();
    assert!(
        !kinds.contains(&hvd_builder::derivation::DerivationKind::Env),
        "{kinds:?}"
    );
    assert!(
        !fresh
            .path_of(&interpreter::derivation(&python.version, &tampered))
            .exists()
    );
}

#[test]
fn gc_keeps_the_interpreter_while_an_env_references_it() {
    let Some((python, dir, store)) =
        pyenv_store("gc_keeps_the_interpreter_while_an_env_references_it")
    else {
        return;
    };
    let built = build_unpinned(&store, &python);
    let stored = interpreter::import(&store, &python).unwrap();
    let link = dir.path().join("project/.hvd/env");
    std::fs::create_dir_all(link.parent().unwrap()).unwrap();
    hvd_builder::gc::add_root(&store, &link, &built.env).unwrap();
    hvd_builder::gc::collect_garbage(&store, false).unwrap();
    assert!(
        store.is_valid(&stored.path),
        "kept through the env's reference"
    );
    std::fs::remove_file(&link).unwrap();
    hvd_builder::gc::collect_garbage(&store, false).unwrap();
    assert!(!built.env.exists());
    assert!(
        !stored.path.exists(),
        "collected with the last env that referenced it"
    );
    // The fingerprint cache names a path that is gone: the next import copies it in again.
    let again = interpreter::import(&store, &python).unwrap();
    assert_eq!(again.path, stored.path);
    assert!(store.is_valid(&again.path));
}

#[test]
fn debians_usr_python_is_assembled_from_usr_bin_and_usr_lib_without_dist_packages() {
    let executable = Path::new("/usr/bin/python3.11");
    let Some(python) =
        Interpreter::probe(executable).filter(|_| Path::new("/usr/lib/python3.11/os.py").is_file())
    else {
        eprintln!(
            "\n\n!!! SKIPPED debians_usr_python_is_assembled_from_usr_bin_and_usr_lib_without_dist_packages: no \
             Debian python3.11 in /usr !!!\n\n"
        );
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(dir.path().join("store")).unwrap();
    let stored = interpreter::import(&store, &python).unwrap();
    assert!(stored.executable().is_file());
    assert!(stored.path.join("lib/python3.11/os.py").is_file());
    assert!(stored.path.join("lib/python3.11/lib-dynload").is_dir());
    // Debian's third-party packages live in /usr/lib/python3/dist-packages: not part of the interpreter.
    assert!(!stored.path.join("lib/python3").exists());
    assert!(
        walk(&stored.path)
            .iter()
            .all(|p| !p.to_string_lossy().contains("dist-packages")),
        "nothing of dist-packages"
    );
    // Debian's executable links libexpat and libz itself: the interpreter needs them to start.
    let host_libraries = std::fs::read_to_string(stored.path.join(HOST_LIBRARIES)).unwrap();
    assert!(
        host_libraries
            .lines()
            .any(|l| l.starts_with("libz.so.1 ") && l.contains("bin/python3.11")),
        "{host_libraries}"
    );

    // An env over it (pinned, so no interpreter is looked up) runs with /usr/lib/python3.11 hidden.
    let mut plan = plan(&python.short_version, Some(stored.pin()));
    plan.name = "debian".into();
    let built = build_env(&store, &plan, &BuildOptions::default(), &NoProgress).unwrap();
    let script = format!(
        "mount -t tmpfs none /usr/lib/python3.11 && exec {} -c 'import sys, ssl, ctypes, sqlite3, json; \
         print(sys.base_prefix)'",
        built.env.join("bin/python").display()
    );
    let out = match in_mount_namespace(&script) {
        Ok(out) => out,
        Err(_) => {
            eprintln!("\n\n!!! SKIPPED the hidden-host part: no mount namespaces here !!!\n\n");
            return;
        }
    };
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        stored.path.to_str().unwrap()
    );
}

#[test]
fn a_pinned_interpreter_comes_from_a_cache_without_reading_the_hosts() {
    use hvd_builder::cache::{Cache, SecretKey, Substituter, push};
    let Some((python, dir, store)) =
        pyenv_store("a_pinned_interpreter_comes_from_a_cache_without_reading_the_hosts")
    else {
        return;
    };
    let stored = interpreter::import(&store, &python).unwrap();
    let pinned = plan(&python.short_version, Some(stored.pin()));
    let built = build_env(&store, &pinned, &BuildOptions::default(), &NoProgress).unwrap();
    let key = SecretKey::generate("interpreter-test").unwrap();
    let url = format!("file://{}", dir.path().join("cache").display());
    let env_name = built
        .env
        .file_name()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    push(
        &store,
        &[env_name],
        &Cache::parse(&url).unwrap(),
        &key,
        &NoProgress,
    )
    .unwrap();

    // The store loses everything (no root), and the record of which host installation was copied where.
    hvd_builder::gc::collect_garbage(&store, false).unwrap();
    assert!(!stored.path.exists() && !built.env.exists());
    hvd_builder::store::remove_tree(&store.root().join(".interpreters")).unwrap();

    let substituter = Substituter::new(&[url], vec![key.public()]).unwrap();
    let again = hvd_builder::build_env_with(
        &store,
        &pinned,
        &BuildOptions::default(),
        Some(&substituter),
        &NoProgress,
    )
    .unwrap();
    assert_eq!(again.env, built.env);
    assert!(
        store.is_valid(&stored.path),
        "the pinned interpreter is back"
    );
    assert!(
        substituter.substituted() >= 2,
        "the interpreter and the env came from the cache"
    );
    assert!(
        !store.root().join(".interpreters").exists(),
        "the host's installation was not looked at (nothing was copied from it)"
    );
}

#[test]
fn a_planted_or_stale_fingerprint_entry_is_ignored_and_overwritten() {
    let Some((python, _dir, store)) =
        pyenv_store("a_planted_or_stale_fingerprint_entry_is_ignored_and_overwritten")
    else {
        return;
    };
    let stored = interpreter::import(&store, &python).unwrap();
    let entries = store.root().join(".interpreters");
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(&entries).unwrap().permissions(),
    );
    assert_eq!(
        mode & 0o022,
        0,
        "`.interpreters` is writable by others: {mode:o}"
    );
    let entry: Vec<PathBuf> = std::fs::read_dir(&entries)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| !p.file_name().unwrap().to_string_lossy().starts_with('.'))
        .collect();
    let [entry] = &entry[..] else {
        panic!("one fingerprint entry expected: {entry:?}")
    };
    let name = name_of(&stored.path);
    assert_eq!(std::fs::read_to_string(entry).unwrap().trim(), name);

    // Another version's interpreter path (a stale entry after the host's python changed version, or a planted
    // one); a path of this version whose name is not its content's; a path that is not an interpreter.
    let hash = hvd_builder::Sha256::of_bytes(b"planted");
    let older = plant_interpreter_path(&store, "3.10.13", &hash);
    let misnamed = plant_interpreter_path(&store, &python.version, &hash);
    for planted in [older.as_str(), misnamed.as_str(), "../store"] {
        std::fs::write(entry, format!("{planted}\n")).unwrap();
        let again = interpreter::import(&store, &python).unwrap();
        assert_eq!(again, stored, "the entry naming `{planted}` was trusted");
        assert_eq!(
            std::fs::read_to_string(entry).unwrap().trim(),
            name,
            "the entry naming `{planted}` was not overwritten"
        );
    }
}

#[test]
fn bytecode_written_and_removed_during_the_walk_neither_fails_nor_changes_the_copy() {
    // A small installation whose `__pycache__` a running interpreter keeps writing `<module>.pyc.<id>` files
    // into and renaming away (other processes on the host importing the standard library).
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("prefix");
    let stdlib = prefix.join("lib/python3.11");
    let cache = stdlib.join("json/__pycache__");
    std::fs::create_dir_all(prefix.join("bin")).unwrap();
    std::fs::create_dir_all(&cache).unwrap();
    std::fs::copy("/bin/true", prefix.join("bin/python3.11")).unwrap();
    std::fs::write(stdlib.join("os.py"), b"# os\n").unwrap();
    std::fs::write(stdlib.join("json/__init__.py"), b"# json\n").unwrap();
    let python = Interpreter {
        executable: prefix.join("bin/python3.11"),
        version: "3.11.7".into(),
        short_version: "3.11".into(),
    };
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let churn = {
        let stop = stop.clone();
        let cache = cache.clone();
        std::thread::spawn(move || {
            let mut round = 0u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let names: Vec<PathBuf> = (0..64)
                    .map(|i| cache.join(format!("m{i}.cpython-311.pyc.{round}")))
                    .collect();
                for name in &names {
                    std::fs::write(name, b"bytecode").unwrap();
                }
                for name in &names {
                    std::fs::remove_file(name).unwrap();
                }
                round += 1;
            }
        })
    };
    let mut hashes = std::collections::BTreeSet::new();
    for i in 0..40 {
        let store = Store::open(dir.path().join(format!("store-{i}"))).unwrap();
        let stored = interpreter::import(&store, &python);
        let stored = match stored {
            Ok(stored) => stored,
            Err(err) => {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                panic!("import {i} failed: {err}");
            }
        };
        assert!(!stored.path.join("lib/python3.11/json/__pycache__").is_dir());
        hashes.insert(stored.content_hash.as_str().to_string());
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    churn.join().unwrap();
    assert_eq!(hashes.len(), 1, "the copies differ: {hashes:?}");
}

#[test]
fn a_search_path_into_an_uncopied_part_of_the_installation_is_left_out_and_its_libraries_are_host_libraries()
 {
    // pyenv builds against its own OpenSSL in `<prefix>/openssl/lib`, which is not copied: a RUNPATH entry there
    // would be rewritten to an `$ORIGIN` path that points nowhere.
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("prefix");
    let openssl = prefix.join("openssl/lib");
    std::fs::create_dir_all(prefix.join("bin")).unwrap();
    std::fs::create_dir_all(&openssl).unwrap();
    std::fs::create_dir_all(prefix.join("lib/python3.11")).unwrap();
    std::fs::write(prefix.join("lib/python3.11/os.py"), b"# os\n").unwrap();
    let source = dir.path().join("x.c");
    std::fs::write(&source, "int hvd_fake(void) { return 0; }\n").unwrap();
    let cc = |args: &[&std::ffi::OsStr]| {
        let out = Command::new("cc").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    cc(&[
        "-shared".as_ref(),
        "-fPIC".as_ref(),
        "-Wl,-soname,libhvdfake.so.1".as_ref(),
        "-o".as_ref(),
        openssl.join("libhvdfake.so.1").as_os_str(),
        source.as_os_str(),
    ]);
    let main = dir.path().join("main.c");
    std::fs::write(
        &main,
        "int hvd_fake(void);\nint main(void) { return hvd_fake(); }\n",
    )
    .unwrap();
    let runpath = format!(
        "-Wl,--enable-new-dtags,-rpath,{}:{}:/opt/hvd-elsewhere/lib",
        openssl.display(),
        prefix.join("lib").display()
    );
    cc(&[
        "-o".as_ref(),
        prefix.join("bin/python3.11").as_os_str(),
        main.as_os_str(),
        runpath.as_ref(),
        openssl.join("libhvdfake.so.1").as_os_str(),
    ]);
    let python = Interpreter {
        executable: prefix.join("bin/python3.11"),
        version: "3.11.7".into(),
        short_version: "3.11".into(),
    };
    let store = Store::open(dir.path().join("store")).unwrap();
    let stored = interpreter::import(&store, &python).unwrap();
    let copied = std::fs::read(stored.executable()).unwrap();
    let dynamic = elf::read_dynamic(&copied).unwrap();
    let paths: Vec<&str> = dynamic
        .search_paths
        .iter()
        .map(|p| p.value.as_str())
        .collect();
    assert_eq!(paths, ["$ORIGIN/../lib:/opt/hvd-elsewhere/lib"]);
    let listed = std::fs::read_to_string(stored.path.join(HOST_LIBRARIES)).unwrap();
    assert!(
        listed
            .lines()
            .any(|l| l == "libhvdfake.so.1 bin/python3.11"),
        "{listed}"
    );
}
