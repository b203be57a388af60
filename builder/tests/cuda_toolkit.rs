//! The CUDA toolkit of source builds (`builder/src/cuda.rs`, `std.cuda`): fixture wheels with the file layout of
//! NVIDIA's CUDA 13 wheels (`nvidia/cu13/bin/nvcc` a shell script here) are the build requirements of a fixture
//! sdist, and the build must see one toolkit tree (bin, include, lib with the development links, lib64, nvvm) as
//! `CUDA_HOME`, on `PATH` and through `@CUDA_HOME@` in its recipe variables; what nvcc refuses as a host compiler
//! and hostile trees are refused. The ignored `real_cuda_wheels_compile_and_link_a_cu_file` (opt-in,
//! `--run-ignored only`; downloads about 410 MB from the configured index) does the same with the real wheels and
//! compiles and links a `.cu` file with the store's nvcc.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hvd_builder::{EnvPlan, PackagePlan, SourceBuildPlan, Store};

#[allow(dead_code)] // each test binary uses part of the shared fixtures
mod common;

use common::{FileServer, build_default, host_python, make_sdist, served_store, write_wheel};

/// Write a wheel `name`-`version` (py3-none-any) into `dir`; `files` are (path, bytes, executable).
fn cuda_wheel(dir: &Path, name: &str, version: &str, files: &[(&str, &[u8], bool)]) -> String {
    write_wheel(dir, &name.replace('-', "_"), name, version, files, None)
}

/// The fixture nvcc: checks the toolkit around the path it was started as (as the real nvcc finds its tree
/// through `bin/..`) and prints what it saw.
const NVCC: &str = r#"#!/bin/sh
top="$(dirname "$0")/.."
for f in include/cuda_runtime.h include/crt/host_config.h include/cccl/cuda/std/version include/nccl.h \
         lib64/libcudart.so lib64/libnccl.so nvvm/bin/cicc nvvm/libdevice/libdevice.10.bc; do
  test -e "$top/$f" || { echo "fixture nvcc: no $f in $top" >&2; exit 1; }
done
echo "fixture nvcc ok: $(cat "$top/include/cuda_runtime.h")"
"#;

/// The fixture CUDA 13 wheels, with `host_config` as include/crt/host_config.h.
fn cuda_wheels(server: &FileServer, host_config: &str) -> Vec<PackagePlan> {
    let dir = &server.root;
    let v = "13.0.88";
    let wheels = [
        (
            "nvidia-cuda-nvcc",
            v,
            cuda_wheel(
                dir,
                "nvidia-cuda-nvcc",
                v,
                &[
                    ("nvidia/cu13/bin/nvcc", NVCC.as_bytes(), true),
                    (
                        "nvidia/cu13/bin/nvcc.profile",
                        b"TOP = $(_HERE_)/..\n",
                        false,
                    ),
                    ("nvidia/cu13/bin/ptxas", b"#!/bin/sh\n", true),
                ],
            ),
        ),
        (
            "nvidia-cuda-crt",
            v,
            cuda_wheel(
                dir,
                "nvidia-cuda-crt",
                v,
                &[(
                    "nvidia/cu13/include/crt/host_config.h",
                    host_config.as_bytes(),
                    false,
                )],
            ),
        ),
        (
            "nvidia-nvvm",
            v,
            cuda_wheel(
                dir,
                "nvidia-nvvm",
                v,
                &[
                    ("nvidia/cu13/nvvm/bin/cicc", b"#!/bin/sh\n", true),
                    ("nvidia/cu13/nvvm/libdevice/libdevice.10.bc", b"bc", false),
                    ("nvidia/cu13/lib/libnvvm.so.4", b"ELF nvvm", false),
                ],
            ),
        ),
        (
            "nvidia-cuda-runtime",
            "13.0.96",
            cuda_wheel(
                dir,
                "nvidia-cuda-runtime",
                "13.0.96",
                &[
                    (
                        "nvidia/cu13/include/cuda_runtime.h",
                        b"cuda_runtime 13.0",
                        false,
                    ),
                    ("nvidia/cu13/lib/libcudart.so.13", b"ELF cudart", false),
                    ("nvidia/cu13/lib/libcudart_static.a", b"!<arch>", false),
                ],
            ),
        ),
        (
            "nvidia-cuda-cccl",
            "13.0.85",
            cuda_wheel(
                dir,
                "nvidia-cuda-cccl",
                "13.0.85",
                &[
                    ("nvidia/cu13/include/cccl/cuda/std/version", b"cccl", false),
                    (
                        "nvidia/cu13/lib/cmake/cccl/cccl-config.cmake",
                        b"# cccl",
                        false,
                    ),
                ],
            ),
        ),
        (
            "nvidia-nccl-cu13",
            "2.28.9",
            cuda_wheel(
                dir,
                "nvidia-nccl-cu13",
                "2.28.9",
                &[
                    ("nvidia/__init__.py", b"", false),
                    ("nvidia/nccl/include/nccl.h", b"#define NCCL_MAJOR 2", false),
                    ("nvidia/nccl/lib/libnccl.so.2", b"ELF nccl", false),
                ],
            ),
        ),
    ];
    wheels
        .iter()
        .map(|(name, version, file)| server.wheel_plan(name, version, file))
        .collect()
}

const GCC_15: &str = "#if defined(__GNUC__)\n#if __GNUC__ > 15\n#error -- unsupported GNU version!\n#endif\n#endif\n";

/// The start of both probe backends: imports and `_facts_wheel`, which writes the wheel `<project>-1.0` whose
/// `<project>/facts.py` holds `FACTS`.
const FACTS_WHEEL: &str = r#"
import base64, hashlib, os, subprocess, zipfile
def _hash(data):
    return base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
def _facts_wheel(wheel_directory, project, facts):
    files = {project + "/__init__.py": b"", project + "/facts.py": ("FACTS = %r\n" % facts).encode()}
    dist = project + "-1.0.dist-info"
    files[dist + "/METADATA"] = ("Metadata-Version: 2.1\nName: %s\nVersion: 1.0\n" % project).encode()
    files[dist + "/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: fixture\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join("%s,sha256=%s,%d\n" % (p, _hash(d), len(d)) for p, d in sorted(files.items()))
    files[dist + "/RECORD"] = (record + dist + "/RECORD,,\n").encode()
    name = project + "-1.0-py3-none-any.whl"
    with zipfile.ZipFile(os.path.join(wheel_directory, name), "w") as z:
        for path, data in sorted(files.items()):
            z.writestr(zipfile.ZipInfo(path, (1980, 1, 1, 0, 0, 0)), data)
    return name
"#;

/// A backend whose build runs `nvcc` from PATH and records what it printed and the variables it saw in
/// `cudaprobe/facts.py` of the wheel.
const BACKEND: &str = r#"
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    names = ["CUDA_HOME", "CUDA_PATH", "CUDACXX", "HOROVOD_CUDA_HOME", "PATH"]
    facts = {n: os.environ.get(n) for n in names}
    try:
        nvcc = subprocess.run(["nvcc"], capture_output=True, text=True)
    except FileNotFoundError:
        facts["nvcc"] = None
    else:
        if nvcc.returncode != 0:
            raise SystemExit("nvcc failed: " + nvcc.stderr)
        facts["nvcc"] = nvcc.stdout.strip()
    return _facts_wheel(wheel_directory, "cudaprobe", facts)
"#;

const PYPROJECT: &str =
    "[build-system]\nrequires = []\nbuild-backend = \"probe_backend\"\nbackend-path = [\".\"]\n";

/// The `cudaprobe` sdist built with `requires` and the recipe variable HOROVOD_CUDA_HOME = "@CUDA_HOME@".
fn probe(server: &FileServer, requires: Vec<PackagePlan>) -> PackagePlan {
    let filename = make_sdist(
        &server.root,
        "cudaprobe",
        "1.0",
        &[
            ("pyproject.toml", PYPROJECT.as_bytes()),
            (
                "probe_backend.py",
                format!("{FACTS_WHEEL}{BACKEND}").as_bytes(),
            ),
        ],
    );
    PackagePlan {
        name: "cudaprobe".into(),
        version: "1.0".into(),
        artifact: server.artifact(&filename),
        dependencies: Vec::new(),
        build: Some(SourceBuildPlan {
            requires,
            env: BTreeMap::from([("HOROVOD_CUDA_HOME".to_string(), "@CUDA_HOME@".to_string())]),
            against: Vec::new(),
        }),
    }
}

fn plan(packages: Vec<PackagePlan>) -> EnvPlan {
    EnvPlan {
        name: "probe".into(),
        python: host_python(),
        interpreter: None,
        packages,
        toolchain: None,
        local_packages: Vec::new(),
    }
}

/// The names of the store's toolkit paths (`<hash>-cuda-<version>`, not the wheels' `<hash>-nvidia-cuda-...`).
fn toolkits(store: &Store) -> Vec<String> {
    std::fs::read_dir(store.root())
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().into_string().ok())
        .filter(|n| {
            n.split_once('-')
                .is_some_and(|(_, rest)| rest.starts_with("cuda-"))
        })
        .collect()
}

/// The one toolkit store path.
fn toolkit_path(store: &Store) -> PathBuf {
    let found = toolkits(store);
    assert_eq!(found.len(), 1, "{found:?}");
    store.root().join(&found[0])
}

fn link(path: &Path) -> String {
    std::fs::read_link(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .display()
        .to_string()
}

/// The probe's store path.
fn probe_path(store: &Store) -> PathBuf {
    std::fs::read_dir(store.root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with("-cudaprobe-1.0"))
        })
        .expect("the probe's store path")
}

/// The probe's `.hvd-path.json`.
fn probe_metadata(store: &Store) -> serde_json::Value {
    let text = std::fs::read_to_string(probe_path(store).join(".hvd-path.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// What the probe's build recorded, as Python's repr of a dict.
fn facts(store: &Store) -> String {
    std::fs::read_to_string(probe_path(store).join("site-packages/cudaprobe/facts.py")).unwrap()
}

#[test]
fn a_build_with_the_cuda_wheels_sees_one_toolkit_tree() {
    let (_dir, server, store) = served_store();
    let wheels = cuda_wheels(&server, GCC_15);
    let built = build_default(&store, &plan(vec![probe(&server, wheels)])).unwrap();
    let toolkit = toolkit_path(&store);
    let home = toolkit.display().to_string();

    // The layout: real top-level directories, links into the wheels' store paths, the development links.
    for dir in ["bin", "include", "lib", "nvvm"] {
        let meta = std::fs::symlink_metadata(toolkit.join(dir)).unwrap();
        assert!(meta.is_dir(), "{dir} is a real directory");
    }
    // bin/nvcc is the toolkit's script (builder/src/cuda.rs), which starts the wheel's nvcc as bin/.nvcc-real;
    // "fixture nvcc ok" below is the build running it through the script in the sandbox.
    assert!(link(&toolkit.join("bin/.nvcc-real")).ends_with("site-packages/nvidia/cu13/bin/nvcc"));
    let script = std::fs::read_to_string(toolkit.join("bin/nvcc")).unwrap();
    assert!(
        script.starts_with("#!/bin/sh\n")
            && script.contains(&format!("real='{home}/bin/.nvcc-real'")),
        "{script}"
    );
    assert!(
        link(&toolkit.join("include/nccl.h")).ends_with("site-packages/nvidia/nccl/include/nccl.h")
    );
    assert_eq!(link(&toolkit.join("lib/libcudart.so")), "libcudart.so.13");
    assert_eq!(link(&toolkit.join("lib/libnccl.so")), "libnccl.so.2");
    assert_eq!(link(&toolkit.join("lib/libnvvm.so")), "libnvvm.so.4");
    assert_eq!(link(&toolkit.join("lib64")), "lib");
    assert!(!toolkit.join("lib/libcudart_static.so").exists());
    assert_eq!(
        std::fs::read_to_string(toolkit.join("lib64/libcudart.so")).unwrap(),
        "ELF cudart"
    );
    // The wheels' Python package markers are not part of a toolkit.
    assert!(std::fs::symlink_metadata(toolkit.join("__init__.py")).is_err());
    // Store paths are read-only: the toolkit's directories too.
    let mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(toolkit.join("lib"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(mode & 0o222, 0, "lib/ is read-only");
    // Its metadata references every wheel it links into, so gc keeps them.
    let meta = std::fs::read_to_string(toolkit.join(".hvd-path.json")).unwrap();
    let meta: serde_json::Value = serde_json::from_str(&meta).unwrap();
    let references = meta["references"].as_array().unwrap();
    assert_eq!(references.len(), 6, "{references:?}");

    // The probe's output holds the toolkit's path (its facts do), so it references the toolkit: gc keeps it and a
    // cache closure carries it.
    let probe_meta = probe_metadata(&store);
    assert!(
        probe_meta["references"]
            .as_array()
            .unwrap()
            .iter()
            .any(|r| toolkit.ends_with(r.as_str().unwrap())),
        "{probe_meta}"
    );

    // What the build saw.
    let facts = facts(&store);
    assert!(facts.contains(&format!("'CUDA_HOME': '{home}'")), "{facts}");
    assert!(facts.contains(&format!("'CUDA_PATH': '{home}'")), "{facts}");
    assert!(
        facts.contains(&format!("'CUDACXX': '{home}/bin/nvcc'")),
        "{facts}"
    );
    assert!(
        facts.contains(&format!("'HOROVOD_CUDA_HOME': '{home}'")),
        "{facts}"
    );
    assert!(facts.contains(&format!("{home}/bin:")), "on PATH: {facts}");
    assert!(
        facts.contains("fixture nvcc ok: cuda_runtime 13.0"),
        "{facts}"
    );
    assert!(built.env.join("bin/python").exists());
}

#[test]
fn without_nvcc_there_is_no_toolkit_and_the_placeholder_is_refused() {
    // The other CUDA wheels without nvidia-cuda-nvcc: no toolkit; a recipe variable naming one is refused, naming
    // the variable and the missing package.
    let (_dir, server, store) = served_store();
    let without_nvcc: Vec<PackagePlan> = cuda_wheels(&server, GCC_15)
        .into_iter()
        .filter(|w| w.name != "nvidia-cuda-nvcc")
        .collect();
    let mut without = plan(vec![probe(&server, without_nvcc)]);
    let err = build_default(&store, &without).unwrap_err().to_string();
    assert!(
        err.contains("HOROVOD_CUDA_HOME") && err.contains("nvidia-cuda-nvcc"),
        "{err}"
    );
    if let Some(build) = without.packages[0].build.as_mut() {
        build.env.clear();
    }
    build_default(&store, &without).unwrap();
    let facts = facts(&store);
    assert!(
        facts.contains("'CUDA_HOME': None") && facts.contains("'nvcc': None"),
        "{facts}"
    );
    assert_eq!(toolkits(&store), Vec::<String>::new());
    let meta = probe_metadata(&store);
    assert_eq!(meta["references"], serde_json::json!([]), "{meta}");
}

#[test]
fn a_host_compiler_newer_than_nvcc_accepts_is_refused() {
    // This toolkit's host_config.h accepts gcc 5 at most; the build's gcc (the host's, 12 here) is newer.
    let (_dir, server, store) = served_store();
    let old = "#if __GNUC__ > 5\n#error -- unsupported GNU version!\n#endif\n";
    let wheels = cuda_wheels(&server, old);
    let err = build_default(&store, &plan(vec![probe(&server, wheels)]))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("accepts gcc 5 or older") && err.contains("std.gcc"),
        "{err}"
    );
}

#[test]
fn hostile_cuda_wheels_are_refused() {
    // Attacker: a wheel named like NVIDIA's without nvcc under nvidia/cu13/bin (e.g. the CUDA 12 layout, or a
    // squatted name): refused with the reason, no toolkit path made.
    let (_dir, server, store) = served_store();
    let empty = cuda_wheel(
        &server.root,
        "nvidia-cuda-nvcc",
        "12.9.86",
        &[("nvidia/cuda_nvcc/bin/ptxas", b"#!/bin/sh\n", true)],
    );
    let wheels = vec![server.wheel_plan("nvidia-cuda-nvcc", "12.9.86", &empty)];
    let err = build_default(&store, &plan(vec![probe(&server, wheels)]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("no `bin/nvcc`"), "{err}");

    // Attacker: a tree nested deeper than any toolkit, in two wheels so that the merge must descend: refused.
    let deep: String = (0..20).map(|i| format!("d{i}/")).collect();
    let deep_file = format!("nvidia/cu13/include/{deep}x.h");
    let a = cuda_wheel(
        &server.root,
        "nvidia-deep-a",
        "1.0",
        &[(deep_file.as_str(), b"a", false)],
    );
    let deep_file_b = format!("nvidia/cu13/include/{deep}y.h");
    let b = cuda_wheel(
        &server.root,
        "nvidia-deep-b",
        "1.0",
        &[(deep_file_b.as_str(), b"b", false)],
    );
    let mut wheels = cuda_wheels(&server, GCC_15);
    wheels.push(server.wheel_plan("nvidia-deep-a", "1.0", &a));
    wheels.push(server.wheel_plan("nvidia-deep-b", "1.0", &b));
    let err = build_default(&store, &plan(vec![probe(&server, wheels)]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("nest deeper than"), "{err}");
    assert_eq!(toolkits(&store), Vec::<String>::new());
}

/// A `.cu` file that needs the CUDA runtime and NCCL to compile and link (no GPU to run: it prints the error).
const CU: &str = r#"#include <cstdio>
#include <cuda_runtime.h>
#include <nccl.h>
__global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }
int main() {
  int devices = -1;
  cudaError_t status = cudaGetDeviceCount(&devices);
  int nccl = 0;
  ncclGetVersion(&nccl);
  printf("devices %d (%s) nccl %d\n", devices, cudaGetErrorName(status), nccl);
  return 0;
}
"#;

/// A backend whose build compiles and links `probe.cu` with the nvcc on PATH (`-lcudart -lnccl`, nothing else:
/// the toolkit's nvcc.profile gives its include/ and lib64/), runs it with the toolkit's lib/ and records the
/// output, nvcc's version and the program's NEEDED libraries.
const CU_BACKEND: &str = r#"
def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    version = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, check=True).stdout
    built = subprocess.run(["nvcc", "probe.cu", "-o", "probe", "-lcudart", "-lnccl"], capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit("nvcc failed:\n" + built.stdout + built.stderr)
    env = dict(os.environ, LD_LIBRARY_PATH=os.path.join(os.environ["CUDA_HOME"], "lib"))
    ran = subprocess.run(["./probe"], capture_output=True, text=True, env=env).stdout
    needed = subprocess.run(["readelf", "-d", "probe"], capture_output=True, text=True).stdout
    needed = sorted(l.split("[")[1].split("]")[0] for l in needed.splitlines() if "(NEEDED)" in l)
    facts = {"version": version, "ran": ran.strip(), "needed": needed}
    return _facts_wheel(wheel_directory, "cuprobe", facts)
"#;

/// Opt-in (`--run-ignored only`; downloads about 410 MB from the configured package index): `std.cuda { version
/// = "13.0" }`'s requirements locked against the real index (hashes checked), fetched, assembled into the toolkit,
/// and a `.cu` file using cuda_runtime.h and nccl.h compiled and linked with the store's nvcc inside the build
/// sandbox (no GPU: the program runs and reports none).
#[test]
#[ignore = "downloads about 410 MB of NVIDIA's CUDA 13 wheels from the configured package index"]
fn real_cuda_wheels_compile_and_link_a_cu_file() {
    let (dir, server, store) = served_store();
    let requirements = [
        "nvidia-cuda-nvcc==13.0.*",
        "nvidia-cuda-crt==13.0.*",
        "nvidia-nvvm==13.0.*",
        "nvidia-cuda-runtime==13.0.*",
        "nvidia-cuda-cccl==13.0.*",
        "nvidia-nccl-cu13",
    ];
    let mut env = hvd_resolver::testing::env_of(&requirements);
    env.python = host_python();
    let options = hvd_resolver::LockOptions {
        cache_dir: Some(dir.path().join("cache")),
        ..hvd_resolver::LockOptions::default()
    };
    let started = std::time::Instant::now();
    let lock = hvd_resolver::lock(&env, &options).unwrap();
    let locked = hvd_builder::lockfile::plan_from_lockfile(&lock, "cuda").unwrap();
    eprintln!(
        "locked in {:.1} s: {}",
        started.elapsed().as_secs_f64(),
        locked
            .packages
            .iter()
            .map(|p| format!(
                "{} {} ({} bytes)",
                p.name,
                p.version,
                p.artifact.size.unwrap_or(0)
            ))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let filename = make_sdist(
        &server.root,
        "cuprobe",
        "1.0",
        &[
            ("pyproject.toml", PYPROJECT.as_bytes()),
            (
                "probe_backend.py",
                format!("{FACTS_WHEEL}{CU_BACKEND}").as_bytes(),
            ),
            ("probe.cu", CU.as_bytes()),
        ],
    );
    let probe = PackagePlan {
        name: "cuprobe".into(),
        version: "1.0".into(),
        artifact: server.artifact(&filename),
        dependencies: Vec::new(),
        build: Some(SourceBuildPlan {
            requires: locked.packages.clone(),
            env: BTreeMap::new(),
            against: Vec::new(),
        }),
    };
    let started = std::time::Instant::now();
    build_default(&store, &plan(vec![probe])).unwrap();
    eprintln!(
        "fetched, assembled and built in {:.1} s",
        started.elapsed().as_secs_f64()
    );
    let path = std::fs::read_dir(store.root())
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.ends_with("-cuprobe-1.0"))
        })
        .expect("the probe's store path");
    let facts = std::fs::read_to_string(path.join("site-packages/cuprobe/facts.py")).unwrap();
    eprintln!("{facts}");
    assert!(facts.contains("release 13.0"), "{facts}");
    assert!(
        facts.contains("'libcudart.so.13'") && facts.contains("'libnccl.so.2'"),
        "{facts}"
    );
    // No GPU (or driver) here: the runtime says so, and NCCL reports its version (2.x.y as 2xxyy).
    assert!(facts.contains("'ran': 'devices "), "{facts}");
    assert!(facts.contains(" nccl 2"), "{facts}");
    let toolkit = toolkit_path(&store);
    eprintln!("toolkit {}", toolkit.display());
}
