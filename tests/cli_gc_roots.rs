//! `hvd gc` against running `hvd exec` processes: the real binary, a real interpreter, a fixture wheel served over
//! real HTTP on 127.0.0.1 (issue #16 item 11: gc deleted the env of a running job).

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use hvd_resolver::lockfile::Lockfile;

const MAKE_WHEEL: &str = r#"
import base64, hashlib, os, sys, zipfile
out = sys.argv[1]
def h(d): return base64.urlsafe_b64encode(hashlib.sha256(d).digest()).rstrip(b"=").decode()
di = "helper-1.0.dist-info"
files = {"helper.py": b"WORD = 'hello'\n",
         di + "/METADATA": b"Metadata-Version: 2.1\nName: helper\nVersion: 1.0\n",
         di + "/WHEEL": b"Wheel-Version: 1.0\nGenerator: fixture\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
files[di + "/RECORD"] = ("".join("%s,sha256=%s,%d\n" % (p, h(d), len(d)) for p, d in files.items()) + di + "/RECORD,,\n").encode()
with zipfile.ZipFile(os.path.join(out, "helper-1.0-py3-none-any.whl"), "w") as z:
    for p, d in files.items(): z.writestr(p, d)
"#;

struct Project {
    _dir: tempfile::TempDir,
    root: PathBuf,
    store: PathBuf,
}

impl Project {
    fn new() -> Project {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        let files = root.join("files");
        std::fs::create_dir(&files).unwrap();
        common::make_fixtures(MAKE_WHEEL, &files);
        let python = common::python_version();
        let base = common::serve_files(files.clone());
        let project = Project {
            store: root.join("store"),
            _dir: dir,
            root,
        };
        std::fs::create_dir_all(project.root.join("app")).unwrap();
        std::fs::write(
            project.file(),
            format!(
                "project \"app\"\nenv {{\n  python = \"{python}\"\n  packages = [\"helper\"]\n}}\n"
            ),
        )
        .unwrap();
        let wheel = files.join("helper-1.0-py3-none-any.whl");
        let packages = vec![common::locked_file("helper", &base, &wheel, &[])];
        common::lockfile(&project.file(), &python, packages, vec![])
            .write(&Lockfile::path_for(&project.file()))
            .unwrap();
        project
    }

    fn file(&self) -> PathBuf {
        self.root.join("app/train.hvd")
    }

    fn command(&self, args: &[&str]) -> Command {
        common::hvd_with_store(&self.root, &self.store, args)
    }

    fn hvd(&self, args: &[&str]) -> Output {
        self.command(args).output().unwrap()
    }
}

/// A Python command that marks `ready`, waits for `stop`, then imports from the env.
const WAIT_THEN_IMPORT: &str = "import os, time\nopen('ready', 'w').close()\nwhile not os.path.exists('stop'): time.sleep(0.02)\nimport helper; print(helper.WORD)";

#[test]
fn gc_keeps_the_env_of_a_running_exec_and_frees_it_after() {
    let p = Project::new();
    let file = p.file().display().to_string();
    let build = p.hvd(&["build", &file, "--locked"]);
    assert!(
        build.status.success(),
        "{}",
        String::from_utf8_lossy(&build.stderr)
    );
    let env = String::from_utf8_lossy(&build.stdout).trim().to_string();

    let running = p
        .command(&common::exec_locked_python(&file, WAIT_THEN_IMPORT))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_path(&p.root.join("ready"), Duration::from_secs(60));
    // The project itself lets go of its env: only the running command keeps it now.
    std::fs::remove_dir_all(p.root.join("app/.hvd")).unwrap();
    let gc = p.hvd(&["gc"]);
    assert!(
        gc.status.success(),
        "{}",
        String::from_utf8_lossy(&gc.stderr)
    );
    let removed = String::from_utf8_lossy(&gc.stdout).to_string();
    assert_eq!(removed, "", "gc removed paths of a running exec");
    assert!(Path::new(&env).join("bin/python").exists());

    std::fs::write(p.root.join("stop"), "").unwrap();
    let out = running.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "hello");

    // Its process is gone: the next gc collects the env, its package, the worker runtime and the interpreter.
    let gc = p.hvd(&["gc"]);
    let removed = String::from_utf8_lossy(&gc.stdout).to_string();
    assert_eq!(removed.lines().count(), 4, "{removed}");
    assert!(!Path::new(&env).exists());
    let roots = std::fs::read_dir(p.store.join(".temproots"))
        .unwrap()
        .count();
    assert_eq!(roots, 0, "stale temporary roots are removed");
}
