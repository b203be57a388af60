//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! A source build runs with an empty environment plus exactly the variables marked "set for source builds" below,
//! and `env.variables` (which may not name these).

hvd_env_vars::env_vars! {
    /// The store's directory (e.g. `~/.local/share/hvd/store`).
    HVD_STORE default "<data dir>/hvd/store";
    /// The interpreter to build envs with, tried before the search.
    HVD_PYTHON;
    /// pyenv's root, whose `versions/` are searched for `pythonX.Y`.
    PYENV_ROOT default "~/.pyenv";
    /// Searched for `pythonX.Y`, `python3` and toolchains; set for source builds to the build env's `bin` first, the
    /// toolchain's directory, then `/usr/local/bin:/usr/bin:/bin`; the activation script puts the env's `bin` first.
    PATH;
    /// Set for source builds and by the activation script: the env (the build env for a source build).
    VIRTUAL_ENV;
    /// Unset by the activation script, so no other interpreter's library shadows the env's.
    PYTHONHOME;
    /// Set for source builds: a fresh home directory inside the build's work directory.
    HOME;
    /// Set for source builds: a fresh temporary directory inside the build's work directory.
    TMPDIR;
    /// Set for source builds to 1980-01-01, the earliest time a zip (wheel) can record.
    SOURCE_DATE_EPOCH default "315532800";
    /// Set for source builds to `C`.
    LANG default "C";
    /// Set for source builds to `C`.
    LC_ALL default "C";
    /// Set for source builds to `0`: the same hash order every time.
    PYTHONHASHSEED default "0";
    /// Set for source builds to `1`: no bytecode written into the source tree.
    PYTHONDONTWRITEBYTECODE default "1";
    /// Set for source builds with `env.toolchain = "gcc"`: that gcc.
    CC;
    /// Set for source builds with `env.toolchain = "gcc"`: the g++ next to that gcc.
    CXX;
    /// Set for source builds with a CUDA toolkit (`std.cuda`, docs/store.md): the toolkit's store path.
    CUDA_HOME;
    /// Set for source builds with a CUDA toolkit: the toolkit's store path (CMake's FindCUDAToolkit reads it).
    CUDA_PATH;
    /// Set for source builds with a CUDA toolkit: its `bin/nvcc` (CMake's CUDA compiler).
    CUDACXX;
    /// The most seconds one source build's backend run (`build_wheel`) may take before it is killed with every
    /// process it started.
    HVD_BUILD_TIMEOUT default "3600";
    /// The most seconds one sdist's metadata build (`prepare_metadata_for_build_wheel`, during `hvd lock`) may take
    /// before it is killed with every process it started.
    HVD_METADATA_TIMEOUT default "600";
    /// Binary caches `hvd build` substitutes from (space-separated URLs: `file:///dir`, `http(s)://...`,
    /// `s3://bucket/prefix`), asked after `--cache` and before the file's `cluster { caches }`.
    HVD_CACHES;
    /// Public keys whose signatures on cache records are trusted (space-separated key files or `NAME:BASE64`), with
    /// `--trusted-key`.
    HVD_TRUSTED_KEYS;
    /// The endpoint of an S3-compatible server for `s3://` caches (e.g. `http://127.0.0.1:8333`), before
    /// `AWS_ENDPOINT_URL`.
    HVD_S3_ENDPOINT;
    /// The endpoint of an S3-compatible server for `s3://` caches, when `HVD_S3_ENDPOINT` is unset.
    AWS_ENDPOINT_URL;
    /// The access key of `s3://` caches; without it (and `AWS_SECRET_ACCESS_KEY`) requests are unsigned.
    AWS_ACCESS_KEY_ID;
    /// The secret of `AWS_ACCESS_KEY_ID`.
    AWS_SECRET_ACCESS_KEY;
    /// A session token for temporary `s3://` credentials.
    AWS_SESSION_TOKEN;
    /// The region of `s3://` caches.
    AWS_REGION default "us-east-1";
    /// The region of `s3://` caches when `AWS_REGION` is unset.
    AWS_DEFAULT_REGION;
}
