//! Opt-in: the era matrix of issue #21 (real package index; each row downloads hundreds of MB to GBs and builds
//! Horovod from source, minutes on 2 cores):
//!
//!     cargo nextest run -p hvd --test e2e_eras --run-ignored only [-E 'test(tf1_15)']
//!
//! Each row is locked, built, run by the default `hvd run --workers 2` (a Horovod allreduce of rank + 1 must give 3
//! on both ranks of one world of size 2) and `hvd build --locked --check` must find it reproducible:
//! - `tf1_15_...`: python 3.7, TensorFlow 1.15.5, Horovod 0.28.1 through gloo;
//! - `torch1_13_...`: python 3.8, torch 1.13.1, Horovod 0.28.1 through gloo;
//! - `nccl_...`: python 3.11, TensorFlow 2.12.1 (the GPU wheel), Horovod 0.28.1 with `gpu_ops = "nccl"` compiled
//!   against the store's CUDA 13 toolkit (`std.cuda`); its library must need `libnccl.so.2`, and with the toolkit's
//!   `lib/` Horovod must say `nccl_built()`, and `hvd build --locked --check` must find it reproducible. Running
//!   NCCL needs a GPU (none here): only the build is checked;
//! - `nccl_..._torch_...`: python 3.11, torch 2.0.1 (CUDA 11.7 wheels), Horovod 0.28.1 with `gpu_ops = "nccl"`
//!   against the same toolkit (`cuda_cc = ["80"]`): `horovod/torch/mpi_lib_v2*.so` must need `libnccl.so.2` through
//!   a RUNPATH into the toolkit's store path (readelf, ldd), `horovod.torch.nccl_built()` must be true after `import
//!   torch`, and `hvd build --locked --check` must find it reproducible (it did not before the toolkit's `bin/nvcc`
//!   took nvcc's temporary file names and the build directory out of the objects: docs/eras.md).
//!
//! The other rows of the matrix are tests of their own: python 3.6 + TF 1.5.0 + Horovod 0.13.11 (MPI only) in
//! tests/controller.rs (`the_default_run_of_an_mpi_only_horovod_is_one_world_of_size_2`), python 3.11 + TF 2.12.1 +
//! Horovod 0.28.1 in tests/e2e_frameworks.rs. `HVD_TEST_REAL_STORE=DIR` reuses a store between runs. Times
//! measured with them are in docs/eras.md.

use std::path::Path;
use std::process::Output;
use std::time::Instant;

mod common;

use common::text;

fn hvd(dir: &Path, args: &[&str]) -> Output {
    common::hvd_logged(dir, args, |command| {
        if let Some(store) = std::env::var_os("HVD_TEST_REAL_STORE") {
            command.env("HVD_STORE", store);
        }
    })
}

/// A project directory with `train.hvd` (python, packages, one distributed step) and `train.py`.
fn project(python: &str, lets: &str, packages: &str, script: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let hvd = format!(
        "project \"era\"\nimport std\n{lets}\nenv {{\n  python = \"{python}\"\n  packages = [{packages}]\n}}\n\
         step train {{\n  workers = 2\n  run = \"python train.py\"\n}}\n"
    );
    std::fs::write(dir.path().join("train.hvd"), hvd).unwrap();
    std::fs::write(dir.path().join("train.py"), script).unwrap();
    dir
}

/// `hvd lock` then `hvd build`, both must succeed; prints how long each took.
fn lock_and_build(dir: &Path) {
    for command in ["lock", "build"] {
        let started = Instant::now();
        let out = hvd(dir, &[command, "train.hvd"]);
        assert!(
            out.status.success(),
            "hvd {command} failed: {}",
            text(&out).1
        );
        eprintln!("hvd {command}: {:.0} s", started.elapsed().as_secs_f64());
    }
}

/// The default `hvd run --workers 2`: both ranks must report size 2 and the sum 3.
fn run_allreduce(dir: &Path) {
    let out = hvd(dir, &["run", "train.hvd", "--workers", "2"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "hvd run failed: {stderr}");
    for rank in 0..2 {
        let line = format!("rank {rank}/2: allreduce sum 3.0");
        assert!(
            stdout.contains(&line),
            "rank {rank}: no `{line}` in\n{stdout}"
        );
    }
}

/// `hvd build --locked --check` rebuilds the source builds and must say `package version: reproducible` for each
/// of `packages` (e.g. "horovod 0.28.1").
fn assert_build_reproduces(dir: &Path, packages: &[&str]) {
    let started = Instant::now();
    let out = hvd(dir, &["build", "train.hvd", "--locked", "--check"]);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success(),
        "hvd build --locked --check failed: {stdout}{stderr}"
    );
    for package in packages {
        assert!(
            stderr.contains(&format!("{package}: reproducible")),
            "no `{package}: reproducible` in\n{stderr}"
        );
    }
    eprintln!(
        "hvd build --locked --check: {:.0} s",
        started.elapsed().as_secs_f64()
    );
}

const TF1_SCRIPT: &str = "import tensorflow as tf\nimport horovod.tensorflow as hvd\nhvd.init()\n\
    with tf.Session() as session:\n    \
    total = session.run(hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), average=False))\n\
    print('rank %d/%d: allreduce sum %.1f' % (hvd.rank(), hvd.size(), total[0]))\n";

#[test]
#[ignore = "opt-in: needs the real package index and builds Horovod 0.28.1 against TF 1.15.5 (minutes); run with --run-ignored only"]
fn tf1_15_on_python_3_7_with_horovod_0_28_1_through_gloo() {
    let dir = project(
        "3.7",
        "let tf = std.tensorflow { version = \"1.15.5\", variant = \"gpu\" }",
        "tf, \"protobuf<3.21\", std.horovod { version = \"0.28.1\", frameworks = [tf] }",
        TF1_SCRIPT,
    );
    lock_and_build(dir.path());
    run_allreduce(dir.path());
    assert_build_reproduces(dir.path(), &["horovod 0.28.1", "gast 0.2.2"]);
}

#[test]
#[ignore = "opt-in: needs the real package index, downloads torch 1.13.1 with its CUDA libraries (GBs) and builds Horovod (minutes); run with --run-ignored only"]
fn torch1_13_on_python_3_8_with_horovod_0_28_1_through_gloo() {
    let dir = project(
        "3.8",
        "let torch = std.torch { version = \"1.13.1\" }",
        "torch, std.horovod { version = \"0.28.1\", frameworks = [torch] }",
        "import torch\nimport horovod.torch as hvd\nhvd.init()\n\
         total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)\n\
         print('rank %d/%d: allreduce sum %.1f' % (hvd.rank(), hvd.size(), total[0].item()))\n",
    );
    lock_and_build(dir.path());
    run_allreduce(dir.path());
    assert_build_reproduces(dir.path(), &["horovod 0.28.1"]);
}

/// Horovod's package folder in the project's built env, resolved into its store path.
fn built_horovod(dir: &Path) -> std::path::PathBuf {
    let env = std::fs::canonicalize(dir.join(".hvd/env")).unwrap();
    let site = std::fs::read_dir(env.join("lib"))
        .unwrap()
        .map(|e| e.unwrap().path().join("site-packages"))
        .find(|p| p.is_dir())
        .expect("the env's site-packages");
    std::fs::canonicalize(site.join("horovod")).unwrap()
}

/// The one file in `folder` whose name starts with `prefix` and ends with `.so`.
fn library(folder: &Path, prefix: &str) -> std::path::PathBuf {
    std::fs::read_dir(folder)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with(prefix) && n.ends_with(".so"))
        })
        .unwrap_or_else(|| panic!("{}/{prefix}*.so", folder.display()))
}

/// `readelf -d` of `library`.
fn dynamic_section(library: &Path) -> String {
    let readelf = std::process::Command::new("readelf")
        .arg("-d")
        .arg(library)
        .output()
        .unwrap();
    assert!(readelf.status.success(), "readelf -d {}", library.display());
    String::from_utf8_lossy(&readelf.stdout).into_owned()
}

/// The CUDA toolkit the build used: the store's `<hash>-cuda-13.0.*` path next to the project's env.
fn store_toolkit(dir: &Path) -> std::path::PathBuf {
    let store = std::fs::canonicalize(dir.join(".hvd/env"))
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    std::fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.split_once('-'))
                .is_some_and(|(_, rest)| rest.starts_with("cuda-13.0."))
        })
        .expect("the CUDA toolkit's store path")
}

/// Runs `code` with the project's env python; must succeed; gives stdout.
fn env_python(dir: &Path, code: &str, library_path: Option<&Path>) -> String {
    let mut command = std::process::Command::new(dir.join(".hvd/env/bin/python"));
    command.args(["-c", code]);
    if let Some(path) = library_path {
        command.env("LD_LIBRARY_PATH", path);
    }
    let out = command.output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}{stderr}");
    stdout
}

#[test]
#[ignore = "opt-in: needs the real package index, downloads the CUDA 13 wheels (410 MB) and TF, and builds Horovod with nvcc (minutes); run with --run-ignored only"]
fn nccl_horovod_compiles_against_the_store_cuda_toolkit() {
    let dir = project(
        "3.11",
        "let tf = std.tensorflow { version = \"2.12.1\", variant = \"gpu\" }",
        "tf, std.horovod { frameworks = [tf], gpu_ops = \"nccl\", cuda = std.cuda { version = \"13.0\" }, \
         toolchain = std.gcc { version = \"12\" } }",
        "",
    );
    lock_and_build(dir.path());
    let horovod = built_horovod(dir.path());
    let dynamic = dynamic_section(&library(&horovod.join("tensorflow"), "mpi_lib"));
    assert!(dynamic.contains("[libnccl.so.2]"), "{dynamic}");
    let toolkit = store_toolkit(dir.path());
    let stdout = env_python(
        dir.path(),
        "import horovod.tensorflow as hvd; print('nccl_built', hvd.nccl_built())",
        Some(&toolkit.join("lib")),
    );
    assert!(
        stdout.contains("nccl_built True") || stdout.contains("nccl_built 2"),
        "{stdout}"
    );
    assert_build_reproduces(dir.path(), &["horovod 0.28.1"]);
}

/// Prints `nccl_built` and `cuda_built` of `horovod.torch`, then `libnccl` and each library whose name holds
/// "cudart" as the process mapped them (which files the dynamic loader chose).
const TORCH_NCCL_SCRIPT: &str = "import torch\nimport horovod.torch as hvd\n\
    print('nccl_built', hvd.nccl_built(), 'cuda_built', hvd.cuda_built())\n\
    maps = {l.split()[-1] for l in open('/proc/self/maps') if 'libnccl' in l or 'cudart' in l}\n\
    print('\\n'.join('mapped ' + m for m in sorted(maps)))\n";

#[test]
#[ignore = "opt-in: needs the real package index, downloads torch 2.0.1 with its CUDA 11.7 libraries and the CUDA 13 wheels (GBs), and builds Horovod with nvcc (minutes); run with --run-ignored only"]
fn nccl_horovod_compiles_against_torch_and_the_store_cuda_toolkit() {
    // torch 2.0.1 is the newest any Horovod builds against (docs/eras.md); its triton needs cmake and its CUDA
    // wheels setuptools, which Horovod's build shares with the env: the recipe's `cmake>=3.13,<4` and
    // `setuptools<82` choose the env's versions, with no pin here.
    let dir = project(
        "3.11",
        "let torch = std.torch { version = \"2.0.1\" }",
        "torch, std.horovod { frameworks = [torch], gpu_ops = \"nccl\", \
         cuda = std.cuda { version = \"13.0\" }, cuda_cc = [\"80\"], toolchain = std.gcc { version = \"12\" } }",
        "",
    );
    lock_and_build(dir.path());
    let horovod = built_horovod(dir.path());
    let library = library(&horovod.join("torch"), "mpi_lib_v2");
    let toolkit = store_toolkit(dir.path());
    let dynamic = dynamic_section(&library);
    assert!(dynamic.contains("[libnccl.so.2]"), "{dynamic}");
    // The RUNPATH leads into the toolkit's store path, and the loader finds NCCL there for the library alone.
    let toolkit_lib = toolkit.join("lib");
    assert!(
        dynamic.contains(&format!("{}", toolkit_lib.display())),
        "no RUNPATH into {}:\n{dynamic}",
        toolkit_lib.display()
    );
    // The library alone (ldd): NCCL and the CUDA 13 runtime from the toolkit's store path. (torch's own CUDA 11
    // libraries are not found this way: torch preloads them when imported.)
    let ldd = std::process::Command::new("ldd")
        .arg(&library)
        .output()
        .unwrap();
    let ldd = String::from_utf8_lossy(&ldd.stdout).into_owned();
    eprintln!("ldd {}:\n{ldd}", library.display());
    for name in ["libnccl.so.2", "libcudart.so.13"] {
        let line = ldd
            .lines()
            .find(|l| l.trim_start().starts_with(&format!("{name} ")))
            .unwrap_or_else(|| panic!("no {name} in ldd:\n{ldd}"));
        assert!(
            line.contains(&format!("=> {}/{name}", toolkit_lib.display())),
            "{line}"
        );
    }
    // In a process that imported torch first, NCCL is the one torch loaded (same soname): still a store path.
    let stdout = env_python(dir.path(), TORCH_NCCL_SCRIPT, None);
    eprintln!("{stdout}");
    assert!(stdout.contains("nccl_built 2"), "{stdout}");
    let store = toolkit.parent().unwrap().display().to_string();
    let nccl: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.strip_prefix("mapped "))
        .filter(|m| m.contains("libnccl"))
        .collect();
    assert!(
        nccl.len() == 1 && nccl[0].starts_with(&store),
        "one libnccl from the store: {nccl:?}"
    );
    assert_build_reproduces(dir.path(), &["horovod 0.28.1"]);
}
