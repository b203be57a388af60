//! The `mpi` engine: a distributed step runs as one `mpirun` of OpenMPI or MPICH (Hydra), which starts the ranks;
//! each rank runs `hvd worker-env -- /bin/sh -c COMMAND`, the shim that turns MPI's rank variables into the worker
//! contract. The local engine supervises mpirun like any worker (output lines, logs, failure, signals).

use std::path::{Path, PathBuf};
use std::process::Command;

use std::sync::Arc;

use hvd_lang::model::Project;

use crate::LaunchError;
use crate::engine::{Engine, Plan, PlannedStep, SupervisedEngine};
use crate::env::WorkerLayout;
use crate::options::RunOptions;

/// Which MPI implementation `mpirun` belongs to (they differ in every flag that matters here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MpiFlavour {
    OpenMpi,
    Mpich,
}

impl MpiFlavour {
    /// `openmpi` or `mpich` (`--mpi`, `cluster { settings }`).
    pub fn parse(name: &str) -> Option<Self> {
        match name.to_ascii_lowercase().as_str() {
            "openmpi" | "open-mpi" | "ompi" => Some(MpiFlavour::OpenMpi),
            "mpich" | "hydra" => Some(MpiFlavour::Mpich),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            MpiFlavour::OpenMpi => "openmpi",
            MpiFlavour::Mpich => "mpich",
        }
    }

    /// Reads the flavour from `mpirun --version` output.
    pub fn from_version_text(text: &str) -> Option<Self> {
        if text.contains("Open MPI") || text.contains("OpenRTE") {
            Some(MpiFlavour::OpenMpi)
        } else if text.contains("HYDRA") || text.contains("MPICH") || text.contains("Intel(R) MPI")
        {
            Some(MpiFlavour::Mpich)
        } else {
            None
        }
    }
}

/// The `mpirun` to use and what it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mpirun {
    pub program: PathBuf,
    pub flavour: MpiFlavour,
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Finds mpirun. `program` (a path or name) and `flavour` when given; else a flavour-specific name
/// (`mpirun.openmpi`, `mpirun.mpich`, `mpiexec.hydra`) when the flavour is given, else `mpirun`; the flavour is
/// detected with `PROGRAM --version` when not given.
pub fn find_mpirun(
    program: Option<&Path>,
    flavour: Option<MpiFlavour>,
) -> Result<Mpirun, LaunchError> {
    let program = match program {
        Some(p) if p.components().count() > 1 => p.to_path_buf(),
        Some(p) => {
            on_path(&p.to_string_lossy()).ok_or_else(|| missing(&p.display().to_string()))?
        }
        None => {
            let names: &[&str] = match flavour {
                Some(MpiFlavour::OpenMpi) => &["mpirun.openmpi", "mpirun"],
                Some(MpiFlavour::Mpich) => {
                    &["mpirun.mpich", "mpiexec.hydra", "mpiexec.mpich", "mpirun"]
                }
                None => &["mpirun"],
            };
            names
                .iter()
                .find_map(|n| on_path(n))
                .ok_or_else(|| missing("mpirun"))?
        }
    };
    let flavour = match flavour {
        Some(f) => f,
        None => {
            let out = Command::new(&program)
                .arg("--version")
                .output()
                .map_err(|source| LaunchError::Io {
                    path: program.clone(),
                    source,
                })?;
            let text = format!(
                "{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
            MpiFlavour::from_version_text(&text).ok_or_else(|| LaunchError::Engine(format!(
                "`{} --version` names neither Open MPI nor MPICH/Hydra; pass `--mpi openmpi` or `--mpi mpich`",
                program.display()
            )))?
        }
    };
    Ok(Mpirun { program, flavour })
}

fn missing(name: &str) -> LaunchError {
    LaunchError::Engine(format!(
        "`{name}` was not found on PATH: install OpenMPI or MPICH, or use `--engine local`"
    ))
}

/// What one distributed step asks of mpirun.
#[derive(Debug, Clone)]
pub struct MpiStep<'a> {
    /// Ranks.
    pub np: u32,
    /// `host:slots` entries (`cluster { hosts }`); empty: this machine.
    pub hosts: &'a [(String, u32)],
    /// Variables the ranks must get from mpirun's environment.
    pub export: &'a [String],
    /// The hvd binary (the shim is `hvd worker-env`).
    pub shim: &'a Path,
    /// More arguments of the shim, before its own (an MPIJob's `--pull=ENV --cache=URL --trusted-key=KEY`).
    pub shim_args: &'a [String],
    /// The step's shell command.
    pub command: &'a str,
    /// Cores on this machine (more ranks per host than this oversubscribes).
    pub cores: u32,
    /// Whether the launcher runs as root.
    pub root: bool,
}

/// The full mpirun command line for a step.
pub fn argv(mpirun: &Mpirun, step: &MpiStep<'_>) -> Vec<String> {
    let mut argv = vec![mpirun.program.display().to_string()];
    let per_host = step.hosts.iter().map(|(_, n)| *n).max().unwrap_or(step.np);
    let oversubscribed = per_host > step.cores;
    let bind = if oversubscribed { "none" } else { "core" };
    let hosts = step
        .hosts
        .iter()
        .map(|(h, n)| format!("{h}:{n}"))
        .collect::<Vec<_>>()
        .join(",");
    match mpirun.flavour {
        MpiFlavour::OpenMpi => {
            if step.root {
                argv.push("--allow-run-as-root".into());
            }
            argv.extend(["--tag-output".into(), "-np".into(), step.np.to_string()]);
            if !hosts.is_empty() {
                argv.extend(["-H".into(), hosts]);
            }
            if oversubscribed {
                argv.push("--oversubscribe".into());
            }
            argv.extend(["--bind-to".into(), bind.into()]);
            for name in step.export {
                argv.extend(["-x".into(), name.clone()]);
            }
        }
        MpiFlavour::Mpich => {
            argv.extend(["-prepend-rank".into(), "-np".into(), step.np.to_string()]);
            if !hosts.is_empty() {
                argv.extend(["-hosts".into(), hosts]);
            }
            argv.extend(["-bind-to".into(), bind.into()]);
            if !step.export.is_empty() {
                argv.extend(["-genvlist".into(), step.export.join(",")]);
            }
        }
    }
    // mpirun tags each piece it reads from a rank: the shim passes output on in whole lines.
    argv.extend([step.shim.display().to_string(), "worker-env".into()]);
    argv.extend(step.shim_args.iter().cloned());
    argv.push("--whole-lines".into());
    if mpirun.flavour == MpiFlavour::Mpich {
        // Hydra ends the job when a rank dies of a signal, but waits for every rank after a plain non-zero exit.
        argv.push("--kill-on-failure".into());
    }
    argv.extend([
        "--".into(),
        "/bin/sh".into(),
        "-c".into(),
        step.command.into(),
    ]);
    argv
}

/// What the mpi engine needs for every step of a plan.
#[derive(Debug, Clone)]
pub struct MpiSetup {
    pub mpirun: Mpirun,
    pub hosts: Vec<(String, u32)>,
    pub shim: std::path::PathBuf,
    pub cores: u32,
    pub root: bool,
}

/// Finds mpirun and reads the hosts for the mpi engine.
pub fn setup(
    project: &hvd_lang::model::Project,
    options: &RunOptions,
) -> Result<MpiSetup, LaunchError> {
    let settings = project.cluster.as_ref().map(|c| &c.settings);
    let flavour = match options
        .mpi
        .clone()
        .or_else(|| settings.and_then(|s| s.mpi.clone()))
    {
        Some(name) => Some(MpiFlavour::parse(&name).ok_or_else(|| {
            LaunchError::Engine(format!("unknown MPI `{name}`: use `openmpi` or `mpich`"))
        })?),
        None => None,
    };
    let program = options
        .mpirun
        .clone()
        .or_else(|| settings.and_then(|s| s.mpirun.clone()));
    let mpirun = find_mpirun(program.as_deref(), flavour)?;
    let hosts = super::hosts(project, options)?;
    let shim = options.shim.clone().ok_or_else(|| {
        LaunchError::Engine(
            "the mpi engine needs the hvd binary for its worker shim (RunOptions::shim)".into(),
        )
    })?;
    Ok(MpiSetup {
        mpirun,
        hosts,
        shim,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get() as u32),
        // SAFETY: geteuid has no preconditions and cannot fail.
        root: unsafe { libc::geteuid() } == 0,
    })
}

impl MpiSetup {
    /// The mpirun command line of a distributed step on `np` ranks passing on the variables named in `export`.
    pub fn argv(&self, np: u32, export: &[String], command: &str) -> Vec<String> {
        argv(
            &self.mpirun,
            &MpiStep {
                np,
                hosts: &self.hosts,
                export,
                shim: &self.shim,
                shim_args: &[],
                command,
                cores: self.cores,
                root: self.root,
            },
        )
    }
}

/// The `mpi` engine: a distributed step is one mpirun, which starts the ranks on the hosts.
pub fn start(project: &Project, options: &RunOptions) -> Result<Engine, LaunchError> {
    Ok(Engine::Supervised(Arc::new(setup(project, options)?)))
}

impl SupervisedEngine for MpiSetup {
    fn name(&self) -> &'static str {
        "mpi engine"
    }

    /// The rendezvous is on 127.0.0.1 here, and mpirun may put rank 0 on another host.
    fn rank_zero_reaches_rendezvous(&self) -> bool {
        false
    }

    fn layout(&self, workers: Option<u32>) -> WorkerLayout {
        match self.hosts.is_empty() {
            false => WorkerLayout::spread(&self.hosts, workers.unwrap_or(1)),
            true => WorkerLayout::local(&crate::env::local_hostname(), workers.unwrap_or(1)),
        }
    }

    fn launcher(&self, plan: &Plan, step: &PlannedStep, workers: u32) -> Option<Vec<String>> {
        let export = super::exported_vars(&step.env, plan.env_dir.is_some());
        Some(self.argv(workers, &export, &step.command))
    }

    fn launcher_label(&self) -> &'static str {
        "mpirun:"
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::shell;

    fn step<'a>(hosts: &'a [(String, u32)], export: &'a [String], cores: u32) -> MpiStep<'a> {
        MpiStep {
            np: 4,
            hosts,
            export,
            shim: Path::new("/bin/hvd"),
            shim_args: &[],
            command: "python train.py",
            cores,
            root: true,
        }
    }

    #[test]
    fn openmpi_flags() {
        let mpirun = Mpirun {
            program: "mpirun".into(),
            flavour: MpiFlavour::OpenMpi,
        };
        let hosts = [("a".to_string(), 2), ("b".to_string(), 2)];
        let export = ["HVD_RENDEZVOUS".to_string(), "PATH".to_string()];
        let line = shell::line(&argv(&mpirun, &step(&hosts, &export, 8)));
        assert_eq!(
            line,
            "mpirun --allow-run-as-root --tag-output -np 4 -H a:2,b:2 --bind-to core -x HVD_RENDEZVOUS -x PATH \
             /bin/hvd worker-env --whole-lines -- /bin/sh -c 'python train.py'"
        );
        let line = shell::line(&argv(&mpirun, &step(&[], &[], 2)));
        assert!(line.contains("--oversubscribe --bind-to none"), "{line}");
    }

    #[test]
    fn mpich_flags() {
        let mpirun = Mpirun {
            program: "mpirun.mpich".into(),
            flavour: MpiFlavour::Mpich,
        };
        let hosts = [("a".to_string(), 4)];
        let export = ["A".to_string(), "B".to_string()];
        let line = shell::line(&argv(&mpirun, &step(&hosts, &export, 8)));
        assert_eq!(
            line,
            "mpirun.mpich -prepend-rank -np 4 -hosts a:4 -bind-to core -genvlist A,B \
             /bin/hvd worker-env --whole-lines --kill-on-failure -- /bin/sh -c 'python train.py'"
        );
    }

    #[test]
    fn flavour_from_version() {
        assert_eq!(
            MpiFlavour::from_version_text("mpirun (Open MPI) 4.1.4"),
            Some(MpiFlavour::OpenMpi)
        );
        assert_eq!(
            MpiFlavour::from_version_text("HYDRA build details:\n Version: 4.0.2"),
            Some(MpiFlavour::Mpich)
        );
        assert_eq!(MpiFlavour::from_version_text("something"), None);
    }
}
