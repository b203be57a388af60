//! End-to-end tests of the language commands (`check`, `fmt`, `graph`, `init`) against the built binary.

use std::path::Path;
use std::process::{Command, Output};

/// The example that opens docs/language.md (its first `hvd` block), as a user would write it.
fn design_example() -> String {
    let doc =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/language.md"))
            .expect("docs/language.md");
    let start = doc
        .find("```hvd\n")
        .expect("an hvd block in docs/language.md")
        + "```hvd\n".len();
    let end = start + doc[start..].find("```").expect("the block ends");
    doc[start..end].to_owned()
}

fn hvd(dir: &Path, args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_hvd"))
        .args(args)
        .current_dir(dir)
        .env("NO_COLOR", "1")
        .output()
        .expect("run hvd")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

fn project_dir() -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("train.hvd"), design_example()).expect("write");
    dir
}

#[test]
fn check_accepts_the_design_example() {
    let dir = project_dir();
    let out = hvd(dir.path(), &["check", "train.hvd"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    assert!(
        stdout(&out).starts_with("ok: train.hvd (project `imagenet`)"),
        "{}",
        stdout(&out)
    );

    let out = hvd(dir.path(), &["check", "train.hvd", "--json"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let model: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
    assert_eq!(model["name"], "imagenet");
    assert_eq!(model["resources"]["mem"], 10u64 << 30);
    assert_eq!(model["steps"][1]["needs"][0], "prepare");
    assert_eq!(
        model["env"]["packages"][1]["build"]["against"][0],
        "tensorflow-cpu"
    );
}

#[test]
fn check_reports_every_error_with_locations_and_exits_2() {
    let dir = project_dir();
    let broken = design_example()
        .replace("needs   = [prepare]", "needs   = [prepar]")
        .replace("workers = 32", "worker = 32")
        .replace("mem = 10GiB", "mem = 10Gib");
    std::fs::write(dir.path().join("train.hvd"), broken).expect("write");
    let out = hvd(dir.path(), &["check", "train.hvd"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    // The bad unit is a syntax error, reported alone with the syntax errors; fix it and see the rest.
    assert!(
        err.contains("unknown unit `Gib`") && err.contains("did you mean `GiB`?"),
        "{err}"
    );
    assert!(err.contains("train.hvd:18:"), "{err}");

    let broken = design_example()
        .replace("needs   = [prepare]", "needs   = [prepar]")
        .replace("workers = 32", "worker = 32");
    std::fs::write(dir.path().join("train.hvd"), broken).expect("write");
    let out = hvd(dir.path(), &["check", "train.hvd"]);
    assert_eq!(out.status.code(), Some(2));
    let err = stderr(&out);
    assert!(err.contains("has 2 errors"), "{err}");
    assert!(
        err.contains("unknown step `prepar` in `needs`") && err.contains("did you mean `prepare`?"),
        "{err}"
    );
    assert!(
        err.contains("unknown attribute `worker` in step `train`")
            && err.contains("did you mean `workers`?"),
        "{err}"
    );
    assert!(err.contains("train.hvd:26:14"), "{err}");
}

#[test]
fn check_of_a_missing_file_exits_2() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = hvd(dir.path(), &["check", "nope.hvd"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("nope.hvd"), "{}", stderr(&out));
}

#[test]
fn fmt_leaves_the_design_example_alone_and_formats_others() {
    let dir = project_dir();
    let out = hvd(dir.path(), &["fmt", "--check", "train.hvd"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));

    let messy = "project \"x\"  # name\nimport std\nenv{python=\"3.11\",packages=[\"numpy\"]}\nstep a {run=\"echo\"\n}\n";
    let path = dir.path().join("messy.hvd");
    std::fs::write(&path, messy).expect("write");
    let out = hvd(dir.path(), &["fmt", "--check", "messy.hvd"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        stderr(&out).contains("messy.hvd is not formatted"),
        "{}",
        stderr(&out)
    );
    assert_eq!(
        std::fs::read_to_string(&path).expect("read"),
        messy,
        "--check must not write"
    );

    let out = hvd(dir.path(), &["fmt", "messy.hvd"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let formatted = std::fs::read_to_string(&path).expect("read");
    assert_eq!(
        formatted,
        "project \"x\"  # name\nimport std\nenv { python = \"3.11\", packages = [\"numpy\"] }\nstep a {\n  run = \"echo\"\n}\n"
    );
    let out = hvd(dir.path(), &["fmt", "--check", "messy.hvd"]);
    assert_eq!(out.status.code(), Some(0));
}

#[test]
fn fmt_refuses_a_file_with_syntax_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    std::fs::write(dir.path().join("bad.hvd"), "let a = [1 2]\n").expect("write");
    let out = hvd(dir.path(), &["fmt", "bad.hvd"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("expected `,` or `]`"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn graph_prints_dot_and_mermaid() {
    let dir = project_dir();
    let out = hvd(dir.path(), &["graph", "train.hvd"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let dot = stdout(&out);
    assert!(dot.starts_with("digraph \"imagenet\" {"), "{dot}");
    assert!(dot.contains("\"prepare\" -> \"train\";"), "{dot}");
    assert!(dot.contains("train (32 workers)"), "{dot}");

    let out = hvd(dir.path(), &["graph", "train.hvd", "--format", "mermaid"]);
    assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
    let mermaid = stdout(&out);
    assert!(mermaid.starts_with("flowchart LR\n"), "{mermaid}");
    assert!(mermaid.contains("  prepare --> train\n"), "{mermaid}");
}

#[test]
fn init_writes_projects_that_check_and_never_overwrites() {
    let root = tempfile::tempdir().expect("tempdir");
    for template in ["numpy", "pytorch", "tensorflow"] {
        let out = hvd(root.path(), &["init", template, "--template", template]);
        assert_eq!(out.status.code(), Some(0), "{}", stderr(&out));
        let project = root.path().join(template);
        assert!(project.join("train.py").is_file());
        let out = hvd(&project, &["check", "train.hvd"]);
        assert_eq!(out.status.code(), Some(0), "{template}: {}", stderr(&out));
        let out = hvd(&project, &["fmt", "--check", "train.hvd"]);
        assert_eq!(
            out.status.code(),
            Some(0),
            "{template} starter is not formatted: {}",
            stderr(&out)
        );
    }
    let numpy = root.path().join("numpy");
    let before = std::fs::read_to_string(numpy.join("train.hvd")).expect("read");
    let out = hvd(root.path(), &["init", "numpy", "--template", "pytorch"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(stderr(&out).contains("already exists"), "{}", stderr(&out));
    assert_eq!(
        std::fs::read_to_string(numpy.join("train.hvd")).expect("read"),
        before
    );
}
