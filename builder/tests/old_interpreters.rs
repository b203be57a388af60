//! Every interpreter under pyenv's versions (2.7 to 3.13 on the machines hvd is tested on) gets a tiny env built
//! from a fixture wheel; importing from it and running its console script must succeed with an empty stderr, so a
//! `.pth` line, wrapper or `pyvenv.cfg` hvd writes that an old interpreter cannot process fails here.

#[allow(dead_code)] // each test binary uses part of the shared fixtures
mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;
use hvd_builder::{BuildOptions, EnvPlan, LocalPackage, NoProgress, Store, build_env};

/// `(version, executable)` of each interpreter under `$PYENV_ROOT/versions` (default `~/.pyenv/versions`).
fn pyenv_interpreters() -> Vec<(String, PathBuf)> {
    let root = std::env::var_os("PYENV_ROOT")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|home| Path::new(&home).join(".pyenv")));
    let Some(versions) = root.map(|root| root.join("versions")) else {
        return Vec::new();
    };
    let Ok(entries) = std::fs::read_dir(&versions) else {
        return Vec::new();
    };
    let mut found: Vec<(String, PathBuf)> = entries
        .filter_map(|entry| entry.ok())
        .filter_map(|entry| {
            let python = entry.path().join("bin/python");
            let out = Command::new(&python)
                // `-E -s -S`, not `-I` (3.4+): 2.7 must answer too.
                .args([
                    "-E",
                    "-s",
                    "-S",
                    "-c",
                    "import sys; print('%d.%d.%d' % sys.version_info[:3])",
                ])
                .output()
                .ok()?;
            let version = String::from_utf8(out.stdout).ok()?.trim().to_string();
            (out.status.success() && !version.is_empty()).then_some((version, python))
        })
        .collect();
    found.sort();
    found.dedup_by(|a, b| a.0 == b.0);
    found
}

/// Run `program` with no Python variables from the test's environment (they would hide what the env does);
/// returns (success, stdout, stderr).
fn run_clean(program: &Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(program)
        .args(args)
        .env_remove("PYTHONPATH")
        .env_remove("PYTHONHOME")
        .env_remove("PYTHONDONTWRITEBYTECODE")
        .env_remove("PYTHONPYCACHEPREFIX")
        .env_remove("PYTHONWARNINGS")
        .env_remove("PYTHONSTARTUP")
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", program.display()));
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).trim().to_string(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Entries under `root` (itself included, links not followed) whose mtime is not the store's.
fn touched_entries(root: &Path) -> Vec<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let mut touched = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(path) = stack.pop() {
        let meta = std::fs::symlink_metadata(&path).unwrap();
        if meta.mtime() != hvd_builder::store::STORE_MTIME {
            touched.push(path.clone());
        }
        if meta.is_dir() {
            stack.extend(std::fs::read_dir(&path).unwrap().map(|e| e.unwrap().path()));
        }
    }
    touched
}

/// Regular files (not links) under `dir` whose name ends with `suffix`.
fn files_under(dir: &Path, suffix: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return found;
    };
    for entry in entries.filter_map(|e| e.ok()) {
        let path = entry.path();
        let file_type = entry.file_type().unwrap();
        if file_type.is_dir() {
            found.extend(files_under(&path, suffix));
        } else if file_type.is_file() && path.to_string_lossy().ends_with(suffix) {
            found.push(path);
        }
    }
    found
}

#[test]
fn every_pyenv_interpreter_imports_from_its_env_with_an_empty_stderr() {
    let interpreters = pyenv_interpreters();
    if interpreters.is_empty() {
        eprintln!(
            "\n\n!!! SKIPPED every_pyenv_interpreter_imports_from_its_env_with_an_empty_stderr: no interpreter \
             under $PYENV_ROOT/versions or ~/.pyenv/versions; old-interpreter envs are NOT tested here !!!\n\n"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let files = dir.path().join("files");
    std::fs::create_dir(&files).unwrap();
    let server = FileServer::start(&files);
    let store = Store::open(dir.path().join("store")).unwrap();
    // Python 2.7 and 3.x alike: no f-strings, print as a function of one argument.
    let wheel = make_wheel(
        &server.root,
        "oldgreet",
        "1.0",
        &[(
            "oldgreet/__init__.py",
            b"import sys\nGREETING = 'hello %d.%d' % sys.version_info[:2]\n\ndef main():\n    print(GREETING)\n    return 0\n",
        )],
        Some("[console_scripts]\noldgreet = oldgreet:main\n"),
    );
    // The worker runtime `hvd` as `hvd build` adds it to every env: its Python sources, staged as a local package.
    let runtime = dir.path().join("runtime");
    std::fs::create_dir_all(runtime.join("hvd")).unwrap();
    let sources = Path::new(env!("CARGO_MANIFEST_DIR")).join("../collective/python/hvd");
    for entry in std::fs::read_dir(&sources).unwrap().filter_map(|e| e.ok()) {
        if entry.file_name().to_string_lossy().ends_with(".py") {
            std::fs::copy(entry.path(), runtime.join("hvd").join(entry.file_name())).unwrap();
        }
    }
    let pycache = store.root().join(".pycache");
    let mut failures = Vec::new();
    let mut checked = Vec::new();
    for (version, _) in &interpreters {
        let short: String = version.split('.').take(2).collect::<Vec<_>>().join(".");
        let plan = EnvPlan {
            name: "old".into(),
            python: version.clone(),
            interpreter: None,
            packages: vec![server.wheel_plan("oldgreet", "1.0", &wheel)],
            toolchain: None,
            local_packages: vec![LocalPackage {
                name: "hvd".into(),
                version: "0.1.0".into(),
                source: runtime.clone(),
            }],
        };
        let built = match build_env(&store, &plan, &BuildOptions::default(), &NoProgress) {
            Ok(built) => built,
            Err(err) => {
                failures.push(format!("{version}: building the env failed: {err}"));
                continue;
            }
        };
        let python = built.env.join("bin/python");
        let (ok, stdout, stderr) = run_clean(
            &python,
            &[
                "-c",
                "import sys, oldgreet; print(oldgreet.GREETING); print(getattr(sys, 'pycache_prefix', None)); \
                 print(sys.dont_write_bytecode)",
            ],
        );
        let old = short == "2.7" || short == "3.6" || short == "3.7";
        let expected = if old {
            format!("hello {short}\nNone\nTrue")
        } else {
            format!("hello {short}\n{}\nFalse", pycache.display())
        };
        if !ok || !stderr.is_empty() || stdout != expected {
            failures.push(format!(
                "{version}: import from the env: success={ok}, stdout={stdout:?} (expected {expected:?}), \
                 stderr={stderr:?}"
            ));
        }
        let (ok, stdout, stderr) = run_clean(&built.env.join("bin/oldgreet"), &[]);
        if !ok || !stderr.is_empty() || stdout != format!("hello {short}") {
            failures.push(format!(
                "{version}: console script: success={ok}, stdout={stdout:?}, stderr={stderr:?}"
            ));
        }
        // The configure-time variables a build of an extension reads name the interpreter's store path, not the
        // installation it was copied from (python 2 included: its compiled `_sysconfigdata.pyc` holds the
        // relocation, and importing it writes nothing: checked below).
        let (ok, stdout, stderr) = run_clean(
            &python,
            &[
                "-c",
                "import sysconfig; v = sysconfig.get_config_vars(); print(v['LIBDIR']); \
                 print(v['prefix'] in v['LDSHARED'] or v['Py_ENABLE_SHARED'] != 1)",
            ],
        );
        let interpreter = store
            .list_paths()
            .unwrap()
            .into_iter()
            .find(|name| name.ends_with(&format!("-python-{version}")))
            .map(|name| store.root().join(name));
        let expected = interpreter.map(|path| format!("{}\nTrue", path.join("lib").display()));
        if !ok || !stderr.is_empty() || Some(&stdout) != expected.as_ref() {
            failures.push(format!(
                "{version}: sysconfig: success={ok}, stdout={stdout:?} (expected LIBDIR {expected:?}), \
                 stderr={stderr:?}"
            ));
        }
        // The runtime imports on 3.6+ (its library loads lazily); 2.7 gets a clear refusal, not a SyntaxError.
        let (ok, _, stderr) = run_clean(&python, &["-c", "import hvd"]);
        if short == "2.7" {
            let message = "needs python 3.6 or newer; this env's python is 2.7";
            if ok || !stderr.contains(message) || !stderr.contains("ImportError") {
                failures.push(format!(
                    "{version}: import hvd should fail with an ImportError saying {message:?}: success={ok}, \
                     stderr={stderr:?}"
                ));
            }
        } else if !ok || !stderr.is_empty() {
            failures.push(format!(
                "{version}: import hvd: success={ok}, stderr={stderr:?}"
            ));
        }
        checked.push(version.clone());
    }
    // Nothing was written into any store path (the packages', the env's, the interpreter's), whatever the version:
    // every entry of a store path has the store's mtime (1), and creating, replacing or changing anything in it
    // changes the mtime of the entry or of its directory. (The interpreter's path of python 2 ships the bytecode of
    // its standard library, so `.pyc` files alone do not tell a write.)
    for name in store.list_paths().unwrap() {
        let touched = touched_entries(&store.root().join(&name));
        if !touched.is_empty() {
            failures.push(format!(
                "store path {name} changed after it was made (bytecode written into it?): {:?}",
                &touched[..touched.len().min(3)]
            ));
        }
    }
    let new_enough =
        |v: &String| !v.starts_with("2.") && !v.starts_with("3.6.") && !v.starts_with("3.7.");
    if checked.iter().any(new_enough) && files_under(&pycache, ".pyc").is_empty() {
        failures.push(format!(
            "no bytecode in {} after imports on 3.8+",
            pycache.display()
        ));
    }
    assert!(
        failures.is_empty(),
        "interpreters checked: {checked:?}\n{}",
        failures.join("\n")
    );
    eprintln!("old-interpreter envs checked: {checked:?}");
}
