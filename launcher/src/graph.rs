//! The step graph (petgraph) and the run plan built from it: which steps run, in which order, on how many workers,
//! with which environment.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hvd_lang::model::{Project, Step};
use petgraph::Direction;
use petgraph::algo::toposort;
use petgraph::graph::{DiGraph, NodeIndex};

use crate::LaunchError;
use crate::engines::EngineKind;
use crate::env::WorkerLayout;

/// Everything `hvd run` was asked for besides the project itself.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Run only this step and the steps it needs.
    pub step: Option<String>,
    /// Override `workers` of every distributed step.
    pub workers: Option<u32>,
    /// Rerun steps even when their inputs are unchanged.
    pub force: bool,
    /// The built environment (a venv layout): `bin/` goes first on `PATH`, `VIRTUAL_ENV` points at it.
    pub env_dir: Option<PathBuf>,
    /// A hash that identifies the environment (the lock's env hash); part of every step's input hash.
    pub env_hash: Option<String>,
    /// Sets `HVD_TIMELINE` (and `HOROVOD_TIMELINE`) for the workers.
    pub timeline: Option<PathBuf>,
    /// Time between SIGTERM and SIGKILL when stopping workers.
    pub grace: Duration,
    /// Fail a distributed step when not every rank has joined the rendezvous within this time. `None`: never
    /// (plain scripts never talk to the rendezvous; see docs/running.md).
    pub start_timeout: Option<Duration>,
    /// Where state and logs go; default `<project dir>/.hvd`.
    pub state_dir: Option<PathBuf>,
    /// `--engine`: overrides `cluster { engine }` (`local`, `mpi`, `slurm`, `ssh`, `spark`; see [`EngineKind`]).
    pub engine: Option<String>,
    /// `--mpi openmpi|mpich` (else `cluster { settings { mpi } }`, else detected from `mpirun --version`).
    pub mpi: Option<String>,
    /// The mpirun program (else `cluster { settings { mpirun } }`, else found on PATH).
    pub mpirun: Option<PathBuf>,
    /// The hvd binary, whose `worker-env` subcommand is the shim engines run in front of each rank.
    pub shim: Option<PathBuf>,
    /// `--hosts` (`host:slots` entries): overrides `cluster { hosts }` for the mpi and ssh engines.
    pub hosts: Option<Vec<String>>,
    /// `--spark-master` and `--spark-python` for the spark engine.
    pub spark: crate::engines::spark::SparkOptions,
    /// ssh options and `--network-interface` for the ssh engine.
    pub ssh: crate::engines::ssh::SshOptions,
}

impl Default for RunOptions {
    fn default() -> Self {
        RunOptions {
            step: None,
            workers: None,
            force: false,
            env_dir: None,
            env_hash: None,
            timeline: None,
            grace: Duration::from_secs(10),
            start_timeout: None,
            state_dir: None,
            engine: None,
            mpi: None,
            mpirun: None,
            shim: None,
            hosts: None,
            spark: crate::engines::spark::SparkOptions::default(),
            ssh: crate::engines::ssh::SshOptions::default(),
        }
    }
}

/// The steps of a project as a dependency graph (edge: needed step -> step that needs it).
#[derive(Debug)]
pub struct StepGraph {
    graph: DiGraph<Step, ()>,
}

impl StepGraph {
    /// Builds the graph; fails on unknown `needs`, duplicate names and cycles.
    pub fn new(project: &Project) -> Result<Self, LaunchError> {
        let mut graph = DiGraph::new();
        let mut index = BTreeMap::new();
        for step in &project.steps {
            let node = graph.add_node(step.clone());
            if index.insert(step.name.clone(), node).is_some() {
                return Err(LaunchError::DuplicateStep(step.name.clone()));
            }
        }
        for step in &project.steps {
            for need in &step.needs {
                let Some(&from) = index.get(need) else {
                    return Err(LaunchError::UnknownNeed {
                        step: step.name.clone(),
                        need: need.clone(),
                    });
                };
                graph.add_edge(from, index[&step.name], ());
            }
        }
        if let Err(cycle) = toposort(&graph, None) {
            return Err(LaunchError::Cycle(graph[cycle.node_id()].name.clone()));
        }
        Ok(StepGraph { graph })
    }

    fn node(&self, name: &str) -> Option<NodeIndex> {
        self.graph
            .node_indices()
            .find(|&n| self.graph[n].name == name)
    }

    /// Names of the steps `name` needs directly.
    pub fn needs(&self, name: &str) -> Vec<String> {
        self.node(name)
            .map(|n| {
                self.graph
                    .neighbors_directed(n, Direction::Incoming)
                    .map(|m| self.graph[m].name.clone())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The steps to run, in a topological order (file order among independent steps): all of them, or `only` and
    /// everything it needs (transitively).
    pub fn selection(&self, only: Option<&str>) -> Result<Vec<&Step>, LaunchError> {
        let keep: Option<BTreeSet<NodeIndex>> = match only {
            None => None,
            Some(name) => {
                let start = self.node(name).ok_or_else(|| LaunchError::UnknownStep {
                    name: name.to_owned(),
                    known: self.graph.node_weights().map(|s| s.name.clone()).collect(),
                })?;
                let mut seen = BTreeSet::from([start]);
                let mut todo = vec![start];
                while let Some(n) = todo.pop() {
                    for m in self.graph.neighbors_directed(n, Direction::Incoming) {
                        if seen.insert(m) {
                            todo.push(m);
                        }
                    }
                }
                Some(seen)
            }
        };
        // Kahn's algorithm, always taking the ready step that comes first in the file: a stable, readable order.
        let mut indegree: BTreeMap<NodeIndex, usize> = BTreeMap::new();
        for n in self.graph.node_indices() {
            if keep.as_ref().is_none_or(|k| k.contains(&n)) {
                indegree.insert(
                    n,
                    self.graph
                        .neighbors_directed(n, Direction::Incoming)
                        .count(),
                );
            }
        }
        let mut order = Vec::new();
        while let Some((&n, _)) = indegree.iter().find(|(_, d)| **d == 0) {
            indegree.remove(&n);
            order.push(&self.graph[n]);
            for m in self.graph.neighbors_directed(n, Direction::Outgoing) {
                if let Some(d) = indegree.get_mut(&m) {
                    *d -= 1;
                }
            }
        }
        Ok(order)
    }
}

/// One step as it will run.
#[derive(Debug, Clone)]
pub struct PlannedStep {
    pub name: String,
    /// The shell command (`sh -c`).
    pub command: String,
    /// Steps (within the plan) that must finish first.
    pub needs: Vec<String>,
    /// `Some(n)`: a distributed step on n workers (with a rendezvous); `None`: runs once.
    pub workers: Option<u32>,
    /// Where each rank runs.
    pub layout: WorkerLayout,
    /// Variables set for this step on top of the inherited environment (rank-specific ones excluded).
    pub env: BTreeMap<String, String>,
    pub inputs: Vec<String>,
    pub outputs: Vec<String>,
    pub timeout: Option<Duration>,
    /// `Some(argv)`: the step is started as this one process (e.g. mpirun), which starts the ranks itself; the
    /// engine supervises it in place of the ranks.
    pub launch: Option<Vec<String>>,
}

/// What `hvd run` will do.
#[derive(Debug, Clone)]
pub struct Plan {
    pub project: String,
    /// The directory the .hvd file is in: the steps' working directory.
    pub project_dir: PathBuf,
    /// `.hvd/` next to the file (or `RunOptions::state_dir`).
    pub state_dir: PathBuf,
    pub steps: Vec<PlannedStep>,
    pub gpus_per_worker: u32,
    pub env_dir: Option<PathBuf>,
    /// The ssh engine's hosts and options: distributed steps run their ranks over ssh.
    pub ssh: Option<std::sync::Arc<crate::engines::ssh::SshSetup>>,
    /// Where the rendezvous of a distributed step binds when its ranks run elsewhere but not over ssh (a Spark
    /// cluster's executors); `None`: 127.0.0.1.
    pub rendezvous_bind: Option<std::net::IpAddr>,
}

/// Builds the plan for `project`.
pub fn plan(project: &Project, options: &RunOptions) -> Result<Plan, LaunchError> {
    let engine = options
        .engine
        .as_deref()
        .or_else(|| project.cluster.as_ref().and_then(|c| c.engine.as_deref()))
        .map(EngineKind::parse)
        .transpose()?
        .unwrap_or_default();
    let mpi = match engine {
        EngineKind::Mpi => Some(crate::engines::mpi_setup(project, options)?),
        _ => None,
    };
    let ssh = match engine {
        EngineKind::Ssh => Some(std::sync::Arc::new(crate::engines::ssh::SshSetup::new(
            project, options,
        )?)),
        _ => None,
    };
    let slurm = match engine {
        EngineKind::Slurm if crate::engines::slurm::in_allocation() => {
            Some(crate::engines::slurm::SlurmSetup::new(project, options)?)
        }
        EngineKind::Slurm => {
            return Err(LaunchError::Engine(
                "the slurm engine outside an allocation (SLURM_JOB_ID unset) submits batch jobs instead of running \
                 a plan: use `engines::slurm::batch_steps` and `engines::sbatch` (as `hvd run` does), or run inside \
                 `salloc`"
                    .into(),
            ));
        }
        _ => None,
    };
    let graph = StepGraph::new(project)?;
    let selected = graph.selection(options.step.as_deref())?;
    let names: BTreeSet<&str> = selected.iter().map(|s| s.name.as_str()).collect();
    let project_dir = project_dir(&project.file);
    let spark = match engine {
        EngineKind::Spark => Some(crate::engines::spark::SparkSetup::new(
            project,
            options,
            &options
                .state_dir
                .clone()
                .unwrap_or_else(|| project_dir.join(".hvd")),
        )?),
        _ => None,
    };
    let host = crate::env::local_hostname();
    let mut steps = Vec::new();
    for step in selected {
        let workers = match (step.workers, options.workers) {
            (Some(_), Some(n)) | (Some(n), None) => Some(n),
            (None, _) => None,
        };
        if workers == Some(0) {
            return Err(LaunchError::ZeroWorkers(step.name.clone()));
        }
        let mut env = project.env.variables.clone();
        env.extend(step.env.clone());
        if let Some(timeline) = &options.timeline {
            let timeline = if timeline.is_absolute() {
                timeline.clone()
            } else {
                cwd().join(timeline)
            };
            env.insert("HVD_TIMELINE".into(), timeline.display().to_string());
            env.insert("HOROVOD_TIMELINE".into(), timeline.display().to_string());
        }
        let layout = match &mpi {
            Some(setup) if !setup.hosts.is_empty() => {
                WorkerLayout::spread(&setup.hosts, workers.unwrap_or(1))
            }
            _ => match (&ssh, workers) {
                (Some(setup), Some(n)) => WorkerLayout::spread(&setup.hosts, n),
                _ => WorkerLayout::local(
                    // A spark step's ranks have the executors' host (127.0.0.1 under a local master).
                    spark
                        .as_ref()
                        .filter(|_| workers.is_some())
                        .and_then(|s| s.local_host())
                        .unwrap_or(&host),
                    workers.unwrap_or(1),
                ),
            },
        };
        let launch = match (&mpi, &slurm, workers) {
            (Some(setup), _, Some(n)) => {
                Some(setup.argv(n, &env, &step.run, options.env_dir.is_some()))
            }
            (_, Some(setup), Some(n)) => Some(setup.srun_argv(n, &step.run)),
            _ => spark
                .as_ref()
                .zip(workers)
                .map(|(setup, n)| setup.argv(n, &env, &step.run, options.env_dir.is_some())),
        };
        steps.push(PlannedStep {
            launch,
            name: step.name.clone(),
            command: step.run.clone(),
            needs: step
                .needs
                .iter()
                .filter(|n| names.contains(n.as_str()))
                .cloned()
                .collect(),
            workers,
            layout,
            env,
            inputs: step.inputs.clone(),
            outputs: step.outputs.clone(),
            timeout: step.timeout_ms.map(Duration::from_millis),
        });
    }
    let network_interface = options.ssh.network_interface.clone().or_else(|| {
        project
            .cluster
            .as_ref()
            .and_then(|c| c.settings.get("network_interface").cloned())
    });
    let rendezvous_bind = match &spark {
        Some(setup) => setup.rendezvous_bind(network_interface.as_deref())?,
        None => None,
    };
    Ok(Plan {
        project: project.name.clone(),
        state_dir: options
            .state_dir
            .clone()
            .unwrap_or_else(|| project_dir.join(".hvd")),
        project_dir,
        steps,
        gpus_per_worker: project.resources.gpus,
        env_dir: options.env_dir.clone(),
        ssh,
        rendezvous_bind,
    })
}

fn cwd() -> PathBuf {
    std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."))
}

fn project_dir(file: &Path) -> PathBuf {
    match file
        .parent()
        .filter(|p| !p.as_os_str().is_empty() && *p != Path::new("."))
    {
        Some(dir) if dir.is_absolute() => dir.to_path_buf(),
        Some(dir) => cwd().join(dir),
        None => cwd(),
    }
}

impl Plan {
    /// A human-readable description of the plan (`hvd run --dry-run`).
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "project {} ({} step{})",
            self.project,
            self.steps.len(),
            if self.steps.len() == 1 { "" } else { "s" }
        );
        let _ = writeln!(out, "  directory: {}", self.project_dir.display());
        match &self.env_dir {
            Some(env) => {
                let _ = writeln!(out, "  env:       {}", env.display());
            }
            None => {
                let _ = writeln!(out, "  env:       (none: the current PATH)");
            }
        }
        for (i, step) in self.steps.iter().enumerate() {
            let _ = writeln!(out, "\n{}. step {}", i + 1, step.name);
            if !step.needs.is_empty() {
                let _ = writeln!(out, "   needs:   {}", step.needs.join(", "));
            }
            let _ = writeln!(out, "   run:     sh -c {:?}", step.command);
            if let Some(argv) = &step.launch {
                let program = argv
                    .first()
                    .map_or("", |p| p.rsplit('/').next().unwrap_or(p));
                let label = if program == "srun" {
                    "srun:"
                } else if crate::engines::spark::is_driver(argv) {
                    "spark:"
                } else {
                    "mpirun:"
                };
                let _ = writeln!(out, "   {label:<8} {}", crate::engines::shell::line(argv));
            }
            match step.workers {
                Some(n) => {
                    let how = match step.launch.as_ref().and_then(|a| a.first()) {
                        Some(p) if p == "srun" => "slurm engine",
                        Some(_)
                            if step
                                .launch
                                .as_deref()
                                .is_some_and(crate::engines::spark::is_driver) =>
                        {
                            "spark engine, one barrier task per rank, placed by Spark"
                        }
                        Some(_) => "mpi engine",
                        None => "local engine",
                    };
                    let (how, rendezvous) = match &self.ssh {
                        Some(ssh) => ("ssh engine", ssh.bind_ip.to_string()),
                        None => (how, "127.0.0.1".to_owned()),
                    };
                    let _ = writeln!(out, "   workers: {n} ({how}, rendezvous on {rendezvous})");
                    for slot in &step.layout.slots {
                        let gpus =
                            crate::env::visible_devices(self.gpus_per_worker, slot.local_rank);
                        let _ = writeln!(
                            out,
                            "     rank {} on {} (local rank {}/{}, cross rank {}/{}){}",
                            slot.rank,
                            slot.host,
                            slot.local_rank,
                            slot.local_size,
                            slot.cross_rank,
                            slot.cross_size,
                            gpus.map(|g| format!(", CUDA_VISIBLE_DEVICES={g}"))
                                .unwrap_or_default()
                        );
                        if let Some(ssh) = &self.ssh {
                            let _ =
                                writeln!(out, "       ssh: {}", ssh.dry_run_line(self, step, slot));
                        }
                    }
                }
                None => {
                    let _ = writeln!(out, "   workers: runs once");
                }
            }
            for (k, v) in &step.env {
                let _ = writeln!(out, "   env:     {k}={v}");
            }
            if !step.inputs.is_empty() {
                let _ = writeln!(out, "   inputs:  {}", step.inputs.join(", "));
            }
            if !step.outputs.is_empty() {
                let _ = writeln!(out, "   outputs: {}", step.outputs.join(", "));
            }
            if let Some(t) = step.timeout {
                let _ = writeln!(out, "   timeout: {} s", t.as_secs_f64());
            }
        }
        out
    }
}
