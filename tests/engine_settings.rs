//! The engine settings of `cluster { settings = { ... } }` are declared once with their types
//! (`hvd_lang::model::SETTINGS`): a typo gets "did you mean", a wrong type is refused, through lang's API and through
//! `hvd`; the launcher reads the typed values.

use std::path::Path;
use std::process::{Command, Output};

use hvd_lang::model::{EngineKind, SETTINGS};

fn file(settings: &str) -> String {
    format!(
        "project \"t\"\nenv {{\n  python = \"3.11\"\n  packages = []\n}}\ncluster {{\n  engine = \"ssh\"\n  \
         hosts = [\"127.0.0.1:2\"]\n  settings = {{ {settings} }}\n}}\nstep train {{\n  run = \"true\"\n  \
         workers = 2\n}}\n"
    )
}

fn load(settings: &str) -> Result<hvd_lang::model::Project, String> {
    hvd_lang::load_source(Path::new("train.hvd"), &file(settings)).map_err(|d| d.render_plain())
}

/// `hvd ARGS` in `dir`: its exit code and stderr.
fn hvd(dir: &Path, args: &[&str]) -> (Option<i32>, String) {
    let out: Output = Command::new(env!("CARGO_BIN_EXE_hvd"))
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.code(), stderr)
}

#[test]
fn a_typo_in_a_setting_gets_did_you_mean_through_the_api() {
    let err = load("ssh_prot = \"2222\"").unwrap_err();
    assert!(err.contains("unknown setting `ssh_prot`"), "{err}");
    assert!(err.contains("did you mean `ssh_port`?"), "{err}");
    // A key nothing resembles lists the settings instead.
    let err = load("zzzzzz = 1").unwrap_err();
    assert!(err.contains("the settings are"), "{err}");
    assert!(err.contains("`spark.*`"), "{err}");
}

#[test]
fn a_wrong_type_is_refused() {
    let err = load("ssh_port = \"twenty-two\"").unwrap_err();
    assert!(
        err.contains("the setting `ssh_port` is a port number"),
        "{err}"
    );
    let err = load("ssh_port = 70000").unwrap_err();
    assert!(err.contains("`ssh_port`"), "{err}");
    let err = load("copy_env = \"maybe\"").unwrap_err();
    assert!(err.contains("`true` or `false`"), "{err}");
    let err = load("nodes = 0").unwrap_err();
    assert!(err.contains("a positive whole number"), "{err}");
    let err = load("ssh_config = 3").unwrap_err();
    assert!(err.contains("a path"), "{err}");
    let err = load("master = [\"a\"]").unwrap_err();
    assert!(
        err.contains("expected a string, number or boolean"),
        "{err}"
    );
}

#[test]
fn settings_are_typed_values() {
    let project = load(
        "ssh_port = \"2222\", copy_env = true, nodes = 2, slots_timeout = \"30\", \
         \"spark.executor.memory\" = \"2g\", \"spark.executor.cores\" = 2",
    )
    .unwrap();
    let cluster = project.cluster.unwrap();
    assert_eq!(cluster.engine, Some(EngineKind::Ssh));
    let s = cluster.settings;
    assert_eq!(s.ssh_port, Some(2222));
    assert_eq!(s.copy_env, Some(true));
    assert_eq!(s.nodes, Some(2));
    assert_eq!(s.slots_timeout, Some(30));
    assert_eq!(s.spark_conf["spark.executor.memory"], "2g");
    assert_eq!(s.spark_conf["spark.executor.cores"], "2");
    assert_eq!(s.master, None);
    // Every declared key names the engines that read it.
    assert!(SETTINGS.iter().all(|s| !s.engines.is_empty()));
}

#[test]
fn hvd_check_and_run_refuse_a_typo_with_did_you_mean() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("train.hvd"), file("ssh_prot = \"2222\"")).unwrap();
    for args in [
        &["check", "train.hvd"][..],
        &["run", "train.hvd", "--no-build", "--dry-run"][..],
    ] {
        let (code, stderr) = hvd(dir.path(), args);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains("unknown setting `ssh_prot`"), "{stderr}");
        assert!(stderr.contains("did you mean `ssh_port`?"), "{stderr}");
    }
    // The right key passes the check.
    std::fs::write(dir.path().join("train.hvd"), file("ssh_port = \"2222\"")).unwrap();
    let (code, stderr) = hvd(dir.path(), &["check", "train.hvd"]);
    assert_eq!(code, Some(0), "{stderr}");
}

#[test]
fn docs_list_every_setting() {
    let docs =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/engines.md")).unwrap();
    let table: Vec<&str> = docs
        .lines()
        .skip_while(|l| !l.starts_with("## Settings"))
        .skip(1)
        .take_while(|l| !l.starts_with("## "))
        .filter(|l| l.starts_with("| `"))
        .collect();
    for setting in SETTINGS {
        let row = table
            .iter()
            .find(|l| l.starts_with(&format!("| `{}` ", setting.key)))
            .unwrap_or_else(|| panic!("docs/engines.md has no row for `{}`", setting.key));
        for engine in setting.engines {
            assert!(row.contains(engine.name()), "{row} lacks {engine}");
        }
    }
    // And nothing more than the schema (besides `spark.*`).
    assert_eq!(table.len(), SETTINGS.len() + 1, "{table:#?}");
}
