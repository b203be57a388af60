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
//!   `lib/` Horovod must say `nccl_built()`. Running NCCL needs a GPU (none here): only the build is checked.
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

fn assert_build_reproduces(dir: &Path) {
    let out = hvd(dir, &["build", "train.hvd", "--locked", "--check"]);
    assert!(
        out.status.success(),
        "hvd build --locked --check failed: {}",
        text(&out).1
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
    assert_build_reproduces(dir.path());
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
    assert_build_reproduces(dir.path());
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
    let library = std::fs::read_dir(horovod.join("tensorflow"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("mpi_lib") && n.ends_with(".so"))
        })
        .expect("horovod/tensorflow/mpi_lib*.so");
    let readelf = std::process::Command::new("readelf")
        .arg("-d")
        .arg(&library)
        .output()
        .unwrap();
    let dynamic = String::from_utf8_lossy(&readelf.stdout);
    assert!(dynamic.contains("[libnccl.so.2]"), "{dynamic}");
    // The toolkit the build used: the store's `<hash>-cuda-13.0.*` path next to the env.
    let store = std::fs::canonicalize(dir.path().join(".hvd/env"))
        .unwrap()
        .parent()
        .unwrap()
        .to_path_buf();
    let toolkit = std::fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.split_once('-'))
                .is_some_and(|(_, rest)| rest.starts_with("cuda-13.0."))
        })
        .expect("the CUDA toolkit's store path");
    let out = std::process::Command::new(dir.path().join(".hvd/env/bin/python"))
        .args([
            "-c",
            "import horovod.tensorflow as hvd; print('nccl_built', hvd.nccl_built())",
        ])
        .env("LD_LIBRARY_PATH", toolkit.join("lib"))
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains("nccl_built True") || stdout.contains("nccl_built 2"),
        "{stdout}{stderr}"
    );
}
