//! Every stdlib file parses, evaluates and is in canonical layout; the recipes compute what they promise.

use std::path::Path;

use hvd_lang::model::Project;

fn load(packages: &str) -> Project {
    let src = format!("import std\nenv {{\n  python = \"3.11\"\n  packages = [{packages}]\n}}\n");
    match hvd_lang::load_source(Path::new("stdlib-test.hvd"), &src) {
        Ok(p) => p,
        Err(d) => panic!("{}", d.render_plain()),
    }
}

#[test]
fn every_stdlib_file_parses_and_is_formatted() {
    for (name, text) in hvd_lang::stdlib::FILES {
        let formatted = hvd_lang::format_source(name, text)
            .unwrap_or_else(|d| panic!("{name}: {}", d.render_plain()));
        assert_eq!(&formatted, text, "{name} is not in canonical layout");
    }
}

#[test]
fn every_recipe_evaluates() {
    let p = load(
        "std.tensorflow { version = \"2.12.1\" }, std.tensorflow { version = \"2.12.1\", variant = \"gpu\" }, \
         std.torch { version = \"2.0.1\" }, std.jax { version = \"0.4.30\" }, std.cmake {}, std.nccl {}, \
         std.nccl { version = \"2.18.1\" }, std.horovod {}",
    );
    let reqs: Vec<&str> = p
        .env
        .packages
        .iter()
        .map(|p| p.requirement.as_str())
        .collect();
    assert_eq!(
        reqs,
        [
            "tensorflow-cpu==2.12.1",
            "tensorflow==2.12.1",
            "torch==2.0.1",
            "jax==0.4.30",
            "cmake<4",
            "nvidia-nccl-cu12",
            "nvidia-nccl-cu12==2.18.1",
            "horovod==0.28.1"
        ]
    );
    let src = "import std\nenv {\n  python = std.python { version = \"3.12\" }\n  toolchain = std.gcc { version = \"12\" }\n}\n";
    let p = hvd_lang::load_source(Path::new("t.hvd"), src).expect("loads");
    assert_eq!(p.env.python, "3.12");
    assert_eq!(
        p.env.toolchain.map(|t| (t.name, t.version)),
        Some(("gcc".into(), "12".into()))
    );
}

#[test]
fn horovod_build_follows_its_parameters() {
    let p = load(
        "std.horovod { version = \"0.28.0\", frameworks = [std.torch { version = \"2.0.1\" }, \
         std.tensorflow { version = \"2.12.1\", variant = \"gpu\" }], gpu_ops = \"nccl\", with_mpi = true }",
    );
    let pkg = &p.env.packages[0];
    assert_eq!(pkg.requirement, "horovod==0.28.0");
    let build = pkg.build.as_ref().expect("horovod is built from source");
    // tests/stdlib_horovod.rs checks the whole list of each era; here, that this is the 0.26+ era's.
    for needed in ["cmake>=3.13,<4", "packaging", "setuptools<82", "wheel"] {
        assert!(
            build.requires.iter().any(|r| r == needed),
            "{needed}: {:?}",
            build.requires
        );
    }
    assert_eq!(build.against, ["torch", "tensorflow"]);
    assert!(build.no_build_isolation);
    let env: Vec<(&str, &str)> = build
        .env
        .iter()
        .map(|(k, v)| (k.as_str(), v.as_str()))
        .collect();
    assert_eq!(
        env,
        [
            ("HOROVOD_GPU_OPERATIONS", "NCCL"),
            ("HOROVOD_WITHOUT_MXNET", "1"),
            ("HOROVOD_WITH_GLOO", "1"),
            ("HOROVOD_WITH_MPI", "1"),
            ("HOROVOD_WITH_PYTORCH", "1"),
            ("HOROVOD_WITH_TENSORFLOW", "1"),
        ]
    );
    // No frameworks: everything off, nothing to build against.
    let p = load("std.horovod {}");
    let build = p.env.packages[0].build.as_ref().expect("build");
    assert!(build.against.is_empty());
    assert_eq!(
        build
            .env
            .get("HOROVOD_WITHOUT_TENSORFLOW")
            .map(String::as_str),
        Some("1")
    );
    assert_eq!(
        build.env.get("HOROVOD_WITHOUT_PYTORCH").map(String::as_str),
        Some("1")
    );
    assert_eq!(
        build.env.get("HOROVOD_WITHOUT_MPI").map(String::as_str),
        Some("1")
    );
    assert!(!build.env.contains_key("HOROVOD_GPU_OPERATIONS"));
}

#[test]
fn bad_recipe_arguments_point_at_the_call() {
    let src = "import std\nlet tf = std.tensorflow { version = \"2.12.1\", variant = \"tpu\" }\nenv { python = \"3.11\", packages = [tf] }\n";
    let d = hvd_lang::load_source(Path::new("t.hvd"), src).expect_err("tpu is not a variant");
    let e = &d.errors()[0];
    assert!(
        e.message().contains("\"cpu\" or \"gpu\", found \"tpu\""),
        "{}",
        e.message()
    );
    assert_eq!(e.location(), Some(("t.hvd".into(), 2, 10)));
}

#[test]
fn horovod_rejects_unknown_gpu_ops() {
    let src = "import std\nenv {\n  python = \"3.11\"\n  packages = [std.horovod { gpu_ops = \"rccl\" }]\n}\n";
    let d = hvd_lang::load_source(Path::new("t.hvd"), src).expect_err("rccl is not supported");
    assert_eq!(
        d.errors()[0].message(),
        "`gpu_ops` of std.horovod is none or \"nccl\", found \"rccl\""
    );
    assert_eq!(d.errors()[0].location(), Some(("t.hvd".into(), 4, 15)));
}
