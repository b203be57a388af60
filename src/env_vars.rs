//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! The command line's own variables; each library crate keeps its own registry (`hvd_builder::env_vars`, ...).

hvd_env_vars::env_vars! {
    /// The log filter, `tracing`'s syntax (e.g. `debug` or `hvd_launcher=trace`); `-v`, `-vv`, `-vvv` raise the
    /// default `warn`.
    HVD_LOG default "warn";
    /// The `libhvd_runtime.so` that `hvd build` puts into the env's `hvd` package, instead of the one built into (or
    /// next to) `hvd`; a path that is not a file is a usage error.
    HVD_RUNTIME_LIBRARY;
    /// Development override: a directory holding a ready `hvd/` package (its library in `hvd/lib/`) that `hvd build`
    /// adds to every env as is, instead of staging the embedded one.
    HVD_RUNTIME_DIR;
    /// Read from the env's `variables` (not from the process): `"0"` keeps the `horovod` compatibility package and
    /// `horovodrun` out of that env (docs/horovod.md); the variable is also set in the env like every other one.
    HVD_HOROVOD_COMPAT default "1";
    /// Set by `hvd shell` in the shell it starts: the env's store path.
    HVD_ENV;
    /// The shell `hvd shell` starts.
    SHELL default "/bin/sh";
    /// Set by `hvd shell` and `hvd exec` with the env's `bin` first.
    PATH;
    /// Set by `hvd shell` and `hvd exec`: the env.
    VIRTUAL_ENV;
    /// Removed by `hvd shell` and `hvd exec`, so no other interpreter's library shadows the env's.
    PYTHONHOME;
    /// Set: `hvd run` shows workers' lines without colour.
    #[allow(dead_code, reason = "`hvd run` (src/commands/run.rs) still spells the name out")]
    NO_COLOR;
    /// `hvd worker-env` hands the shim the rendezvous it resolved in place of this one.
    #[allow(dead_code, reason = "`hvd run` (src/commands/run.rs) still spells the name out")]
    HVD_RENDEZVOUS;
    /// `hvd worker-env` names the rank it starts by this variable of the worker's contract.
    #[allow(dead_code, reason = "`hvd run` (src/commands/run.rs) still spells the name out")]
    HVD_RANK;
}
