//! The `horovod` compatibility package and `horovodrun` (docs/horovod.md): the package's documented behaviour
//! checked by tests/horovod/checks.py with python3, horovodrun's refusals from the command line, and a real env
//! built by `hvd build` that has both, runs a 2-worker job through `horovodrun`, and has neither when its variables
//! opt out.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use common::{HVD, text};

fn python_with_package(args: &[&str]) -> Output {
    common::hvd_python().args(args).output().expect("python3")
}

#[test]
fn the_package_behaves_as_documented() {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/horovod/checks.py");
    let out = python_with_package(&[script.to_str().unwrap()]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.trim(), "ok", "{stderr}");
}

#[test]
fn horovodrun_refuses_what_it_cannot_map_naming_the_flag() {
    for (args, part) in [
        (
            &["--slots-per-host", "none", "-np", "2", "python", "t.py"][..],
            "--slots-per-host takes a positive number of slots, not `none`",
        ),
        (
            &["-np", "2", "--autotune", "python", "t.py"][..],
            "unknown or unsupported flag `--autotune`",
        ),
    ] {
        let mut argv = vec!["-m", "horovod.runner.launch"];
        argv.extend_from_slice(args);
        let out = python_with_package(&argv);
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{stdout}\n{stderr}");
        assert!(stderr.contains(part), "`{part}` missing: {stderr}");
    }
}

/// A project with an env of no packages (`variables` inside its block), built into a store of its own.
struct Built {
    dir: tempfile::TempDir,
}

impl Built {
    fn new(variables: &str) -> Built {
        let dir = tempfile::tempdir().unwrap();
        let text = format!(
            "project \"app\"\nenv {{\n  python = \"{}\"\n  packages = []\n  {variables}\n}}\n",
            common::python_version()
        );
        std::fs::write(dir.path().join("train.hvd"), text).unwrap();
        let built = Built { dir };
        let out = built.hvd(&["build", "train.hvd"]).output().unwrap();
        assert!(out.status.success(), "{}", text_of(&out));
        built
    }

    /// `hvd ARGS` in the project, with its own store and this `hvd` first on PATH (horovodrun runs `hvd run`).
    fn hvd(&self, args: &[&str]) -> Command {
        let bin = Path::new(HVD).parent().unwrap();
        let path = std::env::join_paths(std::iter::once(bin.to_path_buf()).chain(
            std::env::split_paths(&std::env::var_os("PATH").unwrap_or_default()),
        ))
        .unwrap();
        let mut command =
            common::hvd_with_store(self.dir.path(), &self.dir.path().join("store"), args);
        command.env("PATH", path).env("NO_COLOR", "1");
        command
    }

    fn env(&self) -> PathBuf {
        self.dir.path().join(".hvd/env")
    }

    fn site_packages(&self) -> PathBuf {
        let lib = self.env().join("lib");
        let python = std::fs::read_dir(&lib)
            .unwrap()
            .map(|e| e.unwrap().path())
            .find(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("python")
            })
            .expect("lib/pythonX.Y");
        python.join("site-packages")
    }
}

fn text_of(out: &Output) -> String {
    let (stdout, stderr) = text(out);
    format!("{stdout}\n{stderr}")
}

const WORKER: &str = r#"
import sys
import horovod
from horovod.common.exceptions import HorovodInternalError
import hvd
hvd.init()
hvd.barrier()
print("worker %d of %d in %s; no torch: %s; hvd's error: %s" % (
    hvd.rank(), hvd.size(), sys.prefix, "torch" not in sys.modules, HorovodInternalError is hvd.HorovodInternalError))
"#;

#[test]
fn a_built_env_has_horovod_and_horovodrun_runs_two_workers() {
    let built = Built::new("");
    assert!(
        built
            .site_packages()
            .join("horovod/torch/__init__.py")
            .is_file()
    );
    assert!(built.env().join("bin/horovodrun").is_file());
    std::fs::write(built.dir.path().join("worker.py"), WORKER).unwrap();
    let out = built
        .hvd(&[
            "exec",
            "train.hvd",
            "--",
            "horovodrun",
            "-np",
            "2",
            "-H",
            "localhost:2",
            "--gloo",
            "python",
            "worker.py",
        ])
        .output()
        .unwrap();
    let all = text_of(&out);
    assert!(out.status.success(), "{all}");
    let prefix = built.env().canonicalize().unwrap();
    let check = built
        .hvd(&["exec", "train.hvd", "--", "horovodrun", "--check-build"])
        .output()
        .unwrap();
    let report = text_of(&check);
    assert!(check.status.success(), "{report}");
    // The env has no framework; hvd has no Gloo.
    for line in [
        "    [ ] PyTorch\n",
        "    [ ] TensorFlow\n",
        "    [ ] Gloo\n",
        "    [X] hvd (tcp, shm)\n",
    ] {
        assert!(report.contains(line), "`{line}` missing: {report}");
    }
    for rank in 0..2 {
        let line = format!(
            "worker {rank} of 2 in {}; no torch: True; hvd's error: True",
            prefix.display()
        );
        assert!(all.contains(&line), "`{line}` missing: {all}");
    }
}

#[test]
fn an_env_that_opts_out_has_neither() {
    let built = Built::new("variables = { HVD_HOROVOD_COMPAT = \"0\" }");
    assert!(built.site_packages().join("hvd/__init__.py").is_file());
    assert!(!built.site_packages().join("horovod").exists());
    assert!(!built.env().join("bin/horovodrun").exists());
}
