//! The `slurm` engine. Inside an allocation (`SLURM_JOB_ID` set) a distributed step is one `srun` (supervised by
//! the local engine like mpirun): `srun --kill-on-bad-exit=1 --ntasks=N ... hvd worker-env -- /bin/sh -c COMMAND`,
//! the shim reading `SLURM_*`. Outside one, [`sbatch_scripts`] writes one batch script per step, chained with
//! `--dependency=afterok` (`hvd run --dry-run` prints them; submitting is not built yet).

use std::fmt::Write as _;
use std::path::Path;

use hvd_lang::model::Project;

use crate::engines::mpi::shell_line;
use crate::{LaunchError, PlannedStep, RunOptions};

/// What srun needs besides the step.
#[derive(Debug, Clone)]
pub struct SlurmSetup {
    pub shim: std::path::PathBuf,
    pub cpus_per_task: Option<u32>,
    pub gpus_per_task: u32,
}

/// Whether this process runs inside a Slurm allocation.
pub fn in_allocation() -> bool {
    std::env::var_os("SLURM_JOB_ID").is_some_and(|v| !v.is_empty())
}

impl SlurmSetup {
    pub fn new(project: &Project, options: &RunOptions) -> Result<Self, LaunchError> {
        Ok(SlurmSetup {
            shim: options.shim.clone().ok_or_else(|| {
                LaunchError::Engine(
                    "the slurm engine needs the hvd binary for its worker shim (RunOptions::shim)"
                        .into(),
                )
            })?,
            cpus_per_task: project.resources.cpus,
            gpus_per_task: project.resources.gpus,
        })
    }

    /// The srun command line of a distributed step on `np` tasks.
    pub fn srun_argv(&self, np: u32, command: &str) -> Vec<String> {
        let mut argv = vec![
            "srun".to_owned(),
            "--kill-on-bad-exit=1".into(),
            format!("--ntasks={np}"),
            "--label".into(),
        ];
        if let Some(c) = self.cpus_per_task {
            argv.push(format!("--cpus-per-task={c}"));
        }
        if self.gpus_per_task > 0 {
            argv.push(format!("--gpus-per-task={}", self.gpus_per_task));
        }
        argv.extend([
            self.shim.display().to_string(),
            "worker-env".into(),
            "--".into(),
            "/bin/sh".into(),
            "-c".into(),
            command.into(),
        ]);
        argv
    }
}

/// One batch script per planned step (in plan order), each to be submitted with `sbatch --parsable` and the
/// `--dependency=afterok:` of the steps it needs. `nodes`: from `cluster { settings { nodes } }` or the number of
/// `hosts`, else 1.
pub fn sbatch_scripts(
    project: &Project,
    steps: &[PlannedStep],
    project_dir: &Path,
    shim: &Path,
) -> Result<Vec<(String, String)>, LaunchError> {
    let cluster = project.cluster.clone().unwrap_or_default();
    let nodes: u32 = match cluster.settings.get("nodes") {
        Some(n) => n.parse().ok().filter(|n| *n > 0).ok_or_else(|| {
            LaunchError::Engine(format!(
                "`nodes = \"{n}\"` in the cluster settings is not a positive number"
            ))
        })?,
        None => (cluster.hosts.len() as u32).max(1),
    };
    let setup = SlurmSetup {
        shim: shim.to_path_buf(),
        cpus_per_task: project.resources.cpus,
        gpus_per_task: project.resources.gpus,
    };
    let name = crate::engines::k8s::dns_label(&project.name);
    let mut scripts = Vec::new();
    for step in steps {
        let tasks = step.workers.unwrap_or(1);
        let step_nodes = nodes.min(tasks);
        let per_node = tasks.div_ceil(step_nodes);
        let mut s = String::from("#!/bin/sh\n");
        let mut directive = |line: String| {
            let _ = writeln!(s, "#SBATCH {line}");
        };
        directive(format!("--job-name={name}-{}", step.name));
        directive(format!("--nodes={step_nodes}"));
        directive(format!("--ntasks-per-node={per_node}"));
        if let Some(c) = project.resources.cpus {
            directive(format!("--cpus-per-task={c}"));
        }
        if project.resources.gpus > 0 {
            directive(format!("--gpus-per-task={}", project.resources.gpus));
        }
        if let Some(mem) = project.resources.mem {
            // --mem is per node: every task's share, in MiB (rounded up).
            let mib = (mem.saturating_mul(u64::from(per_node))).div_ceil(1 << 20);
            directive(format!("--mem={mib}M"));
        }
        if let Some(p) = &cluster.partition {
            directive(format!("--partition={p}"));
        }
        directive(format!("--output={name}-{}-%j.out", step.name));
        let _ = writeln!(s, "set -e");
        let _ = writeln!(s, "cd {}", shell_line(&[project_dir.display().to_string()]));
        for (k, v) in &step.env {
            let _ = writeln!(s, "export {k}={}", shell_line(std::slice::from_ref(v)));
        }
        let line = match step.workers {
            Some(n) => shell_line(&setup.srun_argv(n, &step.command)),
            None => shell_line(&["/bin/sh".into(), "-c".into(), step.command.clone()]),
        };
        let _ = writeln!(s, "{line}");
        scripts.push((step.name.clone(), s));
    }
    Ok(scripts)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn srun_line_has_kill_on_bad_exit_and_resources() {
        let setup = SlurmSetup {
            shim: "/bin/hvd".into(),
            cpus_per_task: Some(2),
            gpus_per_task: 1,
        };
        assert_eq!(
            shell_line(&setup.srun_argv(4, "python t.py")),
            "srun --kill-on-bad-exit=1 --ntasks=4 --label --cpus-per-task=2 --gpus-per-task=1 /bin/hvd worker-env -- \
             /bin/sh -c 'python t.py'"
        );
    }
}
