//! `std.cuda` and `std.horovod { gpu_ops = "nccl", cuda = ... }` through the CLI: `hvd check --json` gives the
//! CUDA wheels as Horovod's build requirements and the variables of its era, and `hvd check` / `hvd lock` refuse
//! what cannot work (CUDA 12 from wheels, a gcc newer than nvcc accepts, python 2, `cuda` without `gpu_ops`, a bad
//! `cuda_cc`) before
//! any index is asked (exit 2). `hvd lock` of torch + NCCL Horovod against the fixture index on 127.0.0.1 needs no
//! pin of the user's (the recipe's build requirements bind the packages the build shares with the env), and a pin
//! that contradicts one is named with who asked. The toolkit itself is built in builder/tests/cuda_toolkit.rs.

mod common;

use std::path::Path;
use std::process::{Command, Output};

use common::stdlib::{assert_refused, check_json, hvd, strings};
use common::text;
use hvd_resolver::testing::{Dist, FixtureIndex, FixtureOptions};

/// A project with `python`, an `extra` env line and `packages` (the text inside the list) in a fresh directory.
fn project(python: &str, extra: &str, packages: &str) -> tempfile::TempDir {
    common::stdlib::project("cuda", python, extra, packages)
}

/// Horovod's `build` in `hvd check --json`.
fn horovod_build(python: &str, packages: &str) -> serde_json::Value {
    check_json("cuda", python, "", packages)["env"]["packages"][0]["build"].clone()
}

#[test]
fn gpu_ops_with_cuda_adds_the_wheels_and_the_era_variables() {
    let build = horovod_build(
        "3.11",
        "std.horovod { gpu_ops = \"nccl\", cuda = std.cuda { version = \"13.0\", nccl = \"2.28.9\" } }",
    );
    let requires = strings(&build["requires"]);
    let cuda: Vec<&str> = requires
        .iter()
        .map(String::as_str)
        .filter(|r| r.starts_with("nvidia-"))
        .collect();
    assert_eq!(
        cuda,
        [
            "nvidia-cuda-nvcc==13.0.*",
            "nvidia-cuda-crt==13.0.*",
            "nvidia-nvvm==13.0.*",
            "nvidia-cuda-runtime==13.0.*",
            "nvidia-cuda-cccl==13.0.*",
            "nvidia-nccl-cu13==2.28.9",
        ]
    );
    let env = &build["env"];
    assert_eq!(env["HOROVOD_GPU_OPERATIONS"], "NCCL");
    assert_eq!(env["HOROVOD_CUDA_HOME"], "@CUDA_HOME@");
    assert_eq!(env["HOROVOD_NCCL_HOME"], "@CUDA_HOME@");
    assert_eq!(env["HOROVOD_NCCL_LINK"], "SHARED");
    assert!(env.get("HOROVOD_GPU_ALLREDUCE").is_none(), "{env}");

    // Before 0.20.0 setup.py reads HOROVOD_GPU_ALLREDUCE, not HOROVOD_GPU_OPERATIONS.
    let build = horovod_build(
        "3.6",
        "std.horovod { version = \"0.13.11\", gpu_ops = \"nccl\", cuda = std.cuda { version = \"13\" } }",
    );
    let env = &build["env"];
    assert_eq!(env["HOROVOD_GPU_ALLREDUCE"], "NCCL");
    assert!(env.get("HOROVOD_GPU_OPERATIONS").is_none(), "{env}");
    assert!(strings(&build["requires"]).contains(&"nvidia-cuda-nvcc==13.*".to_string()));

    // No `cuda_cc`: no HOROVOD_BUILD_CUDA_CC_LIST (Horovod compiles for every architecture nvcc knows).
    assert!(env.get("HOROVOD_BUILD_CUDA_CC_LIST").is_none(), "{env}");

    // Without `cuda`: the variable only, nothing of CUDA locked (the host's CUDA, as before std.cuda).
    let build = horovod_build("3.11", "std.horovod { gpu_ops = \"nccl\" }");
    assert_eq!(build["env"]["HOROVOD_GPU_OPERATIONS"], "NCCL");
    assert!(build["env"].get("HOROVOD_CUDA_HOME").is_none());
    assert!(
        !strings(&build["requires"])
            .iter()
            .any(|r| r.starts_with("nvidia-"))
    );
}

#[test]
fn cuda_cc_chooses_the_architectures_horovods_kernels_are_compiled_for() {
    let build = horovod_build(
        "3.11",
        "std.horovod { gpu_ops = \"nccl\", cuda = std.cuda { version = \"13.0\" }, cuda_cc = [\"80\", \"90\"] }",
    );
    assert_eq!(build["env"]["HOROVOD_BUILD_CUDA_CC_LIST"], "80,90");
    // With the host's CUDA older architectures are the host nvcc's business.
    let build = horovod_build(
        "3.11",
        "std.horovod { version = \"0.20.0\", gpu_ops = \"nccl\", cuda_cc = [\"60\", \"121\"] }",
    );
    assert_eq!(build["env"]["HOROVOD_BUILD_CUDA_CC_LIST"], "60,121");
    assert_eq!(build["env"]["HOROVOD_GPU_OPERATIONS"], "NCCL");

    let cases = [
        (
            "std.horovod { gpu_ops = \"nccl\", cuda = std.cuda {}, cuda_cc = [\"8.0\"] }",
            "compute capabilities as strings without the dot",
            "[\"80\", \"90\"]",
        ),
        (
            "std.horovod { gpu_ops = \"nccl\", cuda = std.cuda {}, cuda_cc = [80] }",
            "compute capabilities as strings without the dot",
            "known: 30, 32",
        ),
        (
            "std.horovod { gpu_ops = \"nccl\", cuda = std.cuda {}, cuda_cc = [] }",
            "a non-empty list",
            "e.g. [\"80\", \"90\"]",
        ),
        (
            "std.horovod { gpu_ops = \"nccl\", cuda = std.cuda { version = \"13.0\" }, cuda_cc = [\"70\", \"80\"] }",
            "nvcc of CUDA 13.0 (std.cuda) compiles for compute capability 7.5 and newer",
            "keep \"75\" and newer",
        ),
        (
            "std.horovod { gpu_ops = \"nccl\", cuda = std.cuda { version = \"13.0\" }, cuda_cc = [\"90\", \"101\"] }",
            "CUDA 13 (std.cuda 13.0) calls compute capability 10.1 11.0",
            "write \"110\" in `cuda_cc` instead of \"101\"",
        ),
        (
            "std.horovod { version = \"0.19.5\", gpu_ops = \"nccl\", cuda_cc = [\"80\"] }",
            "Horovod 0.19.5 compiles no CUDA kernels of its own",
            "drop it",
        ),
        (
            "std.horovod { cuda_cc = [\"80\"] }",
            "`cuda_cc` of std.horovod is for `gpu_ops = \"nccl\"`",
            "drop `cuda_cc`",
        ),
    ];
    for (packages, message, instead) in cases {
        let dir = project("3.11", "", packages);
        assert_refused(dir.path(), packages, message, instead);
    }
}

#[test]
fn combinations_that_cannot_work_are_refused_at_check_and_lock() {
    let gpu = |cuda: &str| format!("std.horovod {{ gpu_ops = \"nccl\", cuda = {cuda} }}");
    let cases = [
        (
            "3.11",
            String::new(),
            gpu("std.cuda { version = \"12.9\" }"),
            "the CUDA 12 ones have no nvcc",
            "use version = \"13\"",
        ),
        (
            "3.11",
            String::new(),
            gpu("std.cuda { version = \"11.8\" }"),
            "std.cuda knows CUDA 13",
            "found \"11.8\"",
        ),
        (
            "3.11",
            "toolchain = std.gcc { version = \"16\" }".to_string(),
            "std.horovod { gpu_ops = \"nccl\", cuda = std.cuda { version = \"13.0\" }, toolchain = std.gcc { version = \"16\" } }".to_string(),
            "nvcc of CUDA 13.0 (std.cuda) accepts gcc 6 to 15 as its host compiler, and the toolchain is gcc 16",
            "std.gcc { version = \"15\" }",
        ),
        (
            "2.7",
            String::new(),
            "std.horovod { version = \"0.19.5\", gpu_ops = \"nccl\", cuda = std.cuda {} }".to_string(),
            "needs python >= 3.0; this env has python 2.7",
            "NVIDIA's CUDA wheels (std.cuda) are for Python 3 only",
        ),
        (
            "3.11",
            String::new(),
            "std.horovod { cuda = std.cuda {} }".to_string(),
            "`cuda` of std.horovod is for `gpu_ops = \"nccl\"`",
            "drop `cuda`",
        ),
        (
            "3.11",
            String::new(),
            "std.horovod { frameworks = [std.tensorflow { version = \"2.12.1\" }], gpu_ops = \"nccl\", cuda = std.cuda {} }".to_string(),
            "tensorflow-cpu has none (the built library would not load)",
            "variant = \"gpu\"",
        ),
        (
            "3.11",
            String::new(),
            gpu("\"13.0\""),
            "`cuda` of std.horovod is a `std.cuda { ... }` value",
            "std.cuda",
        ),
    ];
    for (python, extra, packages, message, instead) in cases {
        let dir = project(python, &extra, &packages);
        assert_refused(dir.path(), &packages, message, instead);
    }
    // The newest series accept gcc 16 (host_config.h of nvidia-cuda-crt 13.4 and 13.5).
    let dir = project(
        "3.11",
        "",
        "std.horovod { gpu_ops = \"nccl\", cuda = std.cuda { version = \"13.5\" }, toolchain = std.gcc { version = \"16\" } }",
    );
    let out = hvd(dir.path(), &["check"]);
    assert!(out.status.success(), "{}", text(&out).1);
}

/// The index's torch 2.0.1 reduced to what Horovod's build shares with the env (its CUDA 11.7 wheels depend on
/// setuptools, its triton on cmake, without versions), Horovod's sdist, and every build requirement of
/// `std.horovod { frameworks = [torch], gpu_ops = "nccl", cuda = std.cuda { version = "13.0" } }` as wheels.
fn torch_nccl_index() -> FixtureIndex {
    let manylinux = "py3-none-manylinux_2_17_x86_64";
    let mut dists =
        hvd_resolver::testing::torch_2_0_1_sharing_build_tools("nvidia-nccl-cu11", "2.14.3");
    dists.extend([
        Dist::sdist("horovod", "0.28.1").requires(&[
            "cloudpickle",
            "psutil",
            "pyyaml",
            "packaging",
        ]),
        Dist::wheel("nvidia-nccl-cu13", "2.28.9").tag(manylinux),
    ]);
    for name in ["cloudpickle", "psutil", "pyyaml", "packaging", "wheel"] {
        dists.push(Dist::wheel(name, "1.0"));
    }
    for name in [
        "nvidia-cuda-nvcc",
        "nvidia-cuda-crt",
        "nvidia-nvvm",
        "nvidia-cuda-runtime",
        "nvidia-cuda-cccl",
    ] {
        dists.push(Dist::wheel(name, "13.0.88").tag(manylinux));
    }
    FixtureIndex::start(dists, FixtureOptions::default()).unwrap()
}

/// `hvd lock` of the project in `dir` with its own cache and no pip configuration of the machine's.
fn lock(dir: &Path, cache: &Path) -> Output {
    Command::new(common::HVD)
        .arg("lock")
        .arg(dir.join("train.hvd"))
        .env("HVD_CACHE_DIR", cache)
        .env("NO_COLOR", "1")
        .env_remove("PIP_INDEX_URL")
        .env_remove("PIP_CONFIG_FILE")
        .output()
        .unwrap()
}

/// `name==version` of each locked package.
fn pins(lock: &hvd_resolver::Lockfile) -> Vec<String> {
    lock.packages
        .iter()
        .map(|p| format!("{}=={}", p.name, p.version))
        .collect()
}

#[test]
fn torch_nccl_horovod_locks_without_pins_of_the_users() {
    let index = torch_nccl_index();
    let cache = tempfile::tempdir().unwrap();
    let torch = "std.torch { version = \"2.0.1\" }";
    let horovod = format!(
        "std.horovod {{ frameworks = [{torch}], gpu_ops = \"nccl\", cuda = std.cuda {{ version = \"13.0\" }}, cuda_cc = [\"80\"] }}"
    );
    let index_line = format!("index = \"{}\"", index.url());
    let dir = project("3.11", &index_line, &format!("{torch}, {horovod}"));
    let out = lock(dir.path(), cache.path());
    assert!(out.status.success(), "{}", text(&out).1);
    let path = dir.path().join("train.hvd.lock");
    let locked =
        hvd_resolver::Lockfile::parse(&std::fs::read_to_string(&path).unwrap(), &path).unwrap();
    // Horovod's build installs torch's closure at the env's versions, so the recipe's `setuptools<82` (torch
    // 2.0.1's cpp_extension imports pkg_resources) and `cmake>=3.13,<4` choose the env's.
    let env = pins(&locked);
    for pin in [
        "setuptools==81.0.0",
        "cmake==3.31.6",
        "torch==2.0.1",
        "horovod==0.28.1",
    ] {
        assert!(env.contains(&pin.to_string()), "{pin} not in {env:?}");
    }
    let build = locked
        .builds
        .iter()
        .find(|b| b.package == "horovod")
        .unwrap();
    assert!(
        build.requires.contains(&"setuptools<82".to_string()),
        "{:?}",
        build.requires
    );
    let build_pins: Vec<String> = build
        .packages
        .iter()
        .map(|p| format!("{}=={}", p.name, p.version))
        .collect();
    assert!(
        build_pins.contains(&"nvidia-cuda-nvcc==13.0.88".to_string())
            && !build_pins
                .iter()
                .any(|p| p.starts_with("setuptools") || p.starts_with("cmake")),
        "the CUDA wheels are the build's own, setuptools and cmake the env's: {build_pins:?}"
    );

    // A pin of the user's that Horovod's build cannot share: both requirements named, with who asked.
    let dir = project(
        "3.11",
        &index_line,
        &format!("{torch}, \"setuptools==84.2.1\", {horovod}"),
    );
    let out = lock(dir.path(), cache.path());
    let stderr = common::flat_stderr(&out);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for part in [
        "no version of setuptools satisfies `setuptools==84.2.1` (asked by the env's packages) and `setuptools<82` (asked by `horovod`'s build, which installs torch and what it needs at the env's versions)",
        "change or drop one of those requirements",
    ] {
        assert!(stderr.contains(part), "`{part}` not in {stderr}");
    }
    assert!(!stderr.contains('∅'), "{stderr}");
}
