//! Every environment variable this crate reads or sets, declared once: the code uses these constants, and a test
//! (tests/env_vars.rs at the workspace root) checks the tables in docs/ against `ALL`.
//!
//! The language reads no environment variable: a project's meaning never depends on the shell it is checked in
//! (`env.variables` and a step's `env` are values of the model, set for other processes by the launcher).

hvd_env_vars::env_vars! {}
