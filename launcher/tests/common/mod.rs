//! The launcher's integration tests' one fixture: a project of plain steps, run locally without an env.

use std::collections::BTreeMap;
use std::path::Path;

use hvd_lang::model::{Env, Project, Resources, Step};

/// A step named `name` that runs `run` on one worker, needing nothing.
pub fn step(name: &str, run: &str) -> Step {
    Step::new(name, run)
}

/// Project `name` with `steps`, its file in `dir`, no packages, no GPUs and no cluster.
pub fn project(dir: &Path, name: &str, steps: Vec<Step>) -> Project {
    Project {
        name: name.into(),
        file: dir.join("train.hvd"),
        env: Env {
            python: "3.11".into(),
            index: None,
            toolchain: None,
            packages: vec![],
            variables: BTreeMap::new(),
        },
        resources: Resources {
            gpus: 0,
            cpus: None,
            mem: None,
        },
        steps,
        cluster: None,
    }
}
