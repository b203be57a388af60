//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! The command line's own variables; each library crate keeps its own registry (`hvd_builder::env_vars`, ...).

/// The log filter, `tracing`'s syntax (e.g. `debug` or `hvd_launcher=trace`); `-v`, `-vv`, `-vvv` raise the
/// default `warn`.
pub const HVD_LOG: &str = "HVD_LOG";
/// The `libhvd_runtime.so` that `hvd build` puts into the env's `hvd` package, instead of the one built into (or
/// next to) `hvd`; a path that is not a file is a usage error.
pub const HVD_RUNTIME_LIBRARY: &str = "HVD_RUNTIME_LIBRARY";
/// Development override: a directory holding a ready `hvd/` package (its library in `hvd/lib/`) that `hvd build`
/// adds to every env as is, instead of staging the embedded one.
pub const HVD_RUNTIME_DIR: &str = "HVD_RUNTIME_DIR";
/// Read from the env's `variables` (not from the process): `"0"` keeps the `horovod` compatibility package and
/// `horovodrun` out of that env (docs/horovod.md); the variable is also set in the env like every other one.
pub const HVD_HOROVOD_COMPAT: &str = "HVD_HOROVOD_COMPAT";
/// Set by `hvd shell` in the shell it starts: the env's store path.
pub const HVD_ENV: &str = "HVD_ENV";
/// The shell `hvd shell` starts (default `/bin/sh`).
pub const SHELL: &str = "SHELL";
/// Set by `hvd shell` and `hvd exec` with the env's `bin` first.
pub const PATH: &str = "PATH";
/// Set by `hvd shell` and `hvd exec`: the env.
pub const VIRTUAL_ENV: &str = "VIRTUAL_ENV";
/// Removed by `hvd shell` and `hvd exec`, so no other interpreter's library shadows the env's.
pub const PYTHONHOME: &str = "PYTHONHOME";
/// Set: `hvd run` shows workers' lines without colour.
#[allow(
    dead_code,
    reason = "`hvd run` (src/commands/run.rs) still spells the name out"
)]
pub const NO_COLOR: &str = "NO_COLOR";
/// `hvd worker-env` hands the shim the rendezvous it resolved in place of this one.
#[allow(
    dead_code,
    reason = "`hvd run` (src/commands/run.rs) still spells the name out"
)]
pub const HVD_RENDEZVOUS: &str = "HVD_RENDEZVOUS";
/// `hvd worker-env` names the rank it starts by this variable of the worker's contract.
#[allow(
    dead_code,
    reason = "`hvd run` (src/commands/run.rs) still spells the name out"
)]
pub const HVD_RANK: &str = "HVD_RANK";

/// `(name, default or "" when unset means none/off, one-line meaning)` for every constant above.
#[allow(dead_code, reason = "read by tests/env_vars.rs")]
pub const ALL: &[(&str, &str, &str)] = &[
    (
        HVD_LOG,
        "warn",
        "the log filter (`tracing`'s syntax, e.g. `debug` or `hvd_launcher=trace`); `-v` raises the default",
    ),
    (
        HVD_RUNTIME_LIBRARY,
        "",
        "the `libhvd_runtime.so` that `hvd build` puts into envs instead of the embedded one",
    ),
    (
        HVD_RUNTIME_DIR,
        "",
        "development override: a ready `hvd/` package directory that `hvd build` adds to every env as is",
    ),
    (
        HVD_HOROVOD_COMPAT,
        "1",
        "in `env { variables }`: `\"0\"` keeps the `horovod` compatibility package and `horovodrun` out of the env",
    ),
    (
        HVD_ENV,
        "",
        "set by `hvd shell` in the shell it starts: the env's store path",
    ),
    (SHELL, "/bin/sh", "the shell `hvd shell` starts"),
    (
        PATH,
        "",
        "set by `hvd shell` and `hvd exec` with the env's `bin` first",
    ),
    (
        VIRTUAL_ENV,
        "",
        "set by `hvd shell` and `hvd exec`: the env",
    ),
    (PYTHONHOME, "", "removed by `hvd shell` and `hvd exec`"),
    (
        NO_COLOR,
        "",
        "set: `hvd run` shows workers' lines without colour",
    ),
    (
        HVD_RENDEZVOUS,
        "",
        "`hvd worker-env` hands the shim the rendezvous it resolved in place of this one",
    ),
    (
        HVD_RANK,
        "",
        "`hvd worker-env` names the rank it starts by it",
    ),
];
