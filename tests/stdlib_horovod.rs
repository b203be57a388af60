//! `std.horovod` across its history through the CLI: `hvd check --json` gives each era's build requirements and
//! variables (docs/eras.md), and `hvd check` / `hvd lock` refuse combinations Horovod never supported with the
//! version, what it needs and what works instead, before any index is asked (exit 2).

mod common;

use common::stdlib::{assert_refused, check_json, strings};

/// A project with `python` and `packages` (the text inside the list) in a fresh directory.
fn project(python: &str, packages: &str) -> tempfile::TempDir {
    common::stdlib::project("eras", python, "", packages)
}

/// The `build` of the package named `horovod` in `hvd check --json`.
fn horovod_build(python: &str, packages: &str) -> serde_json::Value {
    let model = check_json("eras", python, "", packages);
    let packages = model["env"]["packages"].as_array().unwrap();
    let horovod = packages
        .iter()
        .find(|p| p["requirement"].as_str().unwrap().starts_with("horovod=="))
        .expect("a horovod package");
    horovod["build"].clone()
}

/// What std.horovod 0.26-0.28 builds with.
const LATEST_REQUIRES: &[&str] = &[
    "cmake>=3.13,<4",
    "cloudpickle",
    "psutil",
    "pyyaml",
    "dataclasses; python_version < \"3.7\"",
    "packaging",
    "setuptools",
    "wheel",
];

/// What std.horovod 0.26-0.28 builds with against torch: setuptools with pkg_resources, which torch's
/// cpp_extension imports.
const LATEST_TORCH_REQUIRES: &[&str] = &[
    "cmake>=3.13,<4",
    "cloudpickle",
    "psutil",
    "pyyaml",
    "dataclasses; python_version < \"3.7\"",
    "packaging",
    "setuptools<82",
    "wheel",
];

/// One row of the era table: python, framework, Horovod version, build requires, variables set to "1",
/// variables that must be absent.
struct Case(
    &'static str,
    String,
    &'static str,
    &'static [&'static str],
    &'static [&'static str],
    &'static [&'static str],
);

#[test]
fn each_era_gets_its_requirements_and_variables() {
    let tf = |v: &str| format!("std.tensorflow {{ version = \"{v}\", variant = \"gpu\" }}");
    let table = [
        // The seeds' era: MPI only, distutils build with cffi, no cmake, no gloo/MPI/MXNet variables.
        Case(
            "3.6",
            tf("1.5.0"),
            "0.13.11",
            &["cffi>=1.4.0", "setuptools", "wheel"],
            &["HOROVOD_WITH_TENSORFLOW", "HOROVOD_WITHOUT_PYTORCH"],
            &[
                "HOROVOD_WITH_GLOO",
                "HOROVOD_WITHOUT_MPI",
                "HOROVOD_WITH_MPI",
                "HOROVOD_WITHOUT_MXNET",
            ],
        ),
        Case(
            "3.6",
            tf("1.5.0"),
            "0.16.4",
            &["cloudpickle", "psutil", "six", "setuptools", "wheel"],
            &["HOROVOD_WITHOUT_MXNET"],
            &["HOROVOD_WITH_GLOO", "HOROVOD_WITHOUT_MPI"],
        ),
        // Gloo from 0.17.0: cmake builds it.
        Case(
            "3.6",
            tf("1.5.0"),
            "0.17.0",
            &[
                "cmake<4",
                "cloudpickle",
                "psutil",
                "six",
                "setuptools",
                "wheel",
            ],
            &["HOROVOD_WITH_GLOO", "HOROVOD_WITHOUT_MPI"],
            &[],
        ),
        Case(
            "3.6",
            tf("1.15.5"),
            "0.21.3",
            &[
                "cmake<4",
                "cloudpickle",
                "psutil",
                "pyyaml",
                "dataclasses; python_version < \"3.7\"",
                "setuptools",
                "wheel",
            ],
            &["HOROVOD_WITH_GLOO"],
            &[],
        ),
        // The failing case: 0.28.1 on python 3.7 needs `packaging` to run its setup.py.
        Case(
            "3.7",
            tf("1.15.5"),
            "0.28.1",
            LATEST_REQUIRES,
            &["HOROVOD_WITH_GLOO", "HOROVOD_WITH_TENSORFLOW"],
            &["HOROVOD_WITH_MPI"],
        ),
        Case(
            "3.8",
            "std.torch { version = \"1.13.1\" }".to_string(),
            "0.28.1",
            LATEST_TORCH_REQUIRES,
            &["HOROVOD_WITH_PYTORCH", "HOROVOD_WITHOUT_TENSORFLOW"],
            &[],
        ),
        // The newest torch any Horovod release builds against (2.1 on needs C++17: refused below).
        Case(
            "3.11",
            "std.torch { version = \"2.0.1\" }".to_string(),
            "0.28.1",
            LATEST_TORCH_REQUIRES,
            &["HOROVOD_WITH_PYTORCH", "HOROVOD_WITHOUT_TENSORFLOW"],
            &[],
        ),
    ];
    for Case(python, framework, version, requires, set, absent) in table {
        let packages = format!(
            "{framework}, std.horovod {{ version = \"{version}\", frameworks = [{framework}] }}"
        );
        let build = horovod_build(python, &packages);
        assert_eq!(
            strings(&build["requires"]),
            requires,
            "{version} on {python}"
        );
        let env = build["env"].as_object().unwrap();
        for name in set {
            assert_eq!(
                env.get(*name).and_then(|v| v.as_str()),
                Some("1"),
                "{version}: {name}"
            );
        }
        for name in absent {
            assert!(!env.contains_key(*name), "{version} must not set {name}");
        }
    }
}

#[test]
fn unsupported_combinations_fail_at_check_and_lock_naming_what_works() {
    let cases = [
        (
            "2.7",
            "std.horovod { version = \"0.20.0\" }",
            "`horovod==0.20.0` needs python >= 3.6; this env has python 2.7",
            "Horovod 0.19.5 for older pythons",
        ),
        (
            "3.6",
            "std.horovod { version = \"0.28.1\", frameworks = [std.tensorflow { version = \"1.5.0\", variant = \"gpu\" }] }",
            "Horovod 0.28.1 builds against tensorflow 1.15.0 or later, found 1.5.0",
            "Horovod 0.19.5 is the last that builds against older ones",
        ),
        (
            "3.8",
            "std.horovod { version = \"0.25.0\", frameworks = [std.torch { version = \"1.4.0\" }] }",
            "Horovod 0.25.0 builds against torch 1.5.0 or later, found 1.4.0",
            "Horovod 0.24.3 builds against torch 1.2.0",
        ),
        (
            "3.11",
            "std.horovod { version = \"0.28.1\", frameworks = [std.torch { version = \"2.1.0\" }] }",
            "Horovod 0.28.1 compiles its torch extension as C++14 and torch 2.1 on needs C++17",
            "use torch 2.0.1",
        ),
        (
            "3.11",
            "std.horovod { version = \"0.28.1\", frameworks = [std.torch { version = \"2.10.0\" }] }",
            "no Horovod release builds against torch 2.10.0",
            "use torch 2.0.1",
        ),
        (
            "3.6",
            "std.horovod { version = \"0.13.11\", with_mpi = false }",
            "Horovod 0.13.11 has no gloo controller (it came with 0.17.0)",
            "use Horovod 0.17.0 or later",
        ),
        (
            "3.11",
            "std.horovod { version = \"0.29.0\" }",
            "std.horovod knows Horovod 0.13.0 to 0.28.1, found \"0.29.0\"",
            "\"0.28.1\" (the last)",
        ),
    ];
    for (python, packages, message, instead) in cases {
        let dir = project(python, packages);
        assert_refused(dir.path(), packages, message, instead);
    }
}
