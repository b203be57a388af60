//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! A source build runs with an empty environment plus exactly the variables marked "set for source builds" below,
//! and `env.variables` (which may not name these).

/// The store's directory (default `<data dir>/hvd/store`, e.g. `~/.local/share/hvd/store`).
pub const HVD_STORE: &str = "HVD_STORE";
/// The interpreter to build envs with, tried before the search.
pub const HVD_PYTHON: &str = "HVD_PYTHON";
/// pyenv's root, whose `versions/` are searched for `pythonX.Y` (default `~/.pyenv`).
pub const PYENV_ROOT: &str = "PYENV_ROOT";
/// Searched for `pythonX.Y`, `python3` and toolchains; set for source builds to the build env's `bin` first, the
/// toolchain's directory, then `/usr/local/bin:/usr/bin:/bin`; the activation script puts the env's `bin` first.
pub const PATH: &str = "PATH";
/// Set for source builds and by the activation script: the env (the build env for a source build).
pub const VIRTUAL_ENV: &str = "VIRTUAL_ENV";
/// Unset by the activation script, so no other interpreter's library shadows the env's.
pub const PYTHONHOME: &str = "PYTHONHOME";
/// Set for source builds: a fresh home directory inside the build's work directory.
pub const HOME: &str = "HOME";
/// Set for source builds: a fresh temporary directory inside the build's work directory.
pub const TMPDIR: &str = "TMPDIR";
/// Set for source builds to 1980-01-01, the earliest time a zip (wheel) can record.
pub const SOURCE_DATE_EPOCH: &str = "SOURCE_DATE_EPOCH";
/// Set for source builds to `C`.
pub const LANG: &str = "LANG";
/// Set for source builds to `C`.
pub const LC_ALL: &str = "LC_ALL";
/// Set for source builds to `0`: the same hash order every time.
pub const PYTHONHASHSEED: &str = "PYTHONHASHSEED";
/// Set for source builds to `1`: no bytecode written into the source tree.
pub const PYTHONDONTWRITEBYTECODE: &str = "PYTHONDONTWRITEBYTECODE";
/// Set for source builds with `env.toolchain = "gcc"`: that gcc.
pub const CC: &str = "CC";
/// Set for source builds with `env.toolchain = "gcc"`: the g++ next to that gcc.
pub const CXX: &str = "CXX";

/// `(name, default or "" when unset means none/off, one-line meaning)` for every constant above.
pub const ALL: &[(&str, &str, &str)] = &[
    (HVD_STORE, "<data dir>/hvd/store", "the store's directory"),
    (
        HVD_PYTHON,
        "",
        "the interpreter to build envs with, tried before the search",
    ),
    (
        PYENV_ROOT,
        "~/.pyenv",
        "pyenv's root, whose `versions/` are searched for `pythonX.Y`",
    ),
    (
        PATH,
        "",
        "searched for pythons and toolchains; set for source builds and by the activation script",
    ),
    (
        VIRTUAL_ENV,
        "",
        "set for source builds (the build env) and by the activation script (the env)",
    ),
    (PYTHONHOME, "", "unset by the activation script"),
    (HOME, "", "set for source builds: a fresh directory"),
    (TMPDIR, "", "set for source builds: a fresh directory"),
    (
        SOURCE_DATE_EPOCH,
        "315532800",
        "set for source builds: 1980-01-01, the earliest time a wheel can record",
    ),
    (LANG, "C", "set for source builds"),
    (LC_ALL, "C", "set for source builds"),
    (PYTHONHASHSEED, "0", "set for source builds"),
    (PYTHONDONTWRITEBYTECODE, "1", "set for source builds"),
    (
        CC,
        "",
        "set for source builds with `env.toolchain = \"gcc\"`: that gcc",
    ),
    (
        CXX,
        "",
        "set for source builds with `env.toolchain = \"gcc\"`: the g++ next to it",
    ),
];
