//! Choosing the engine and running: [`prepare`] maps the engine the project and options name to its module (the one
//! registry of engines) and readies the run, which a caller renders (`--dry-run`), checks and executes; [`run`] does
//! all of it.

use std::sync::Arc;

use hvd_lang::model::{EngineKind, Project};

use crate::LaunchError;
use crate::engine::{Engine, Local, Plan, WholeRunEngine};
use crate::engines::{k8s_pods, kubectl, mpi, sbatch, slurm, spark, ssh};
use crate::options::RunOptions;
use crate::process::Interrupts;
use crate::report::{EventSink, RunReport};

/// The engine of `project` under `options`: `--engine`, else `cluster { engine }`, else local.
pub fn engine_kind(project: &Project, options: &RunOptions) -> EngineKind {
    options
        .engine
        .or_else(|| project.cluster.as_ref().and_then(|c| c.engine))
        .unwrap_or(EngineKind::Local)
}

/// The registry: which module starts each engine. Adding an engine is one module under `engines/` with a `start`
/// function and one line here (and its name in [`EngineKind`]).
fn start(kind: EngineKind, project: &Project, options: &RunOptions) -> Result<Engine, LaunchError> {
    match kind {
        EngineKind::Local => Ok(Engine::Supervised(Arc::new(Local))),
        EngineKind::Ssh => ssh::start(project, options),
        EngineKind::Mpi => mpi::start(project, options),
        EngineKind::Slurm if slurm::in_allocation() => slurm::start(project, options),
        EngineKind::Slurm => sbatch::start(project, options),
        EngineKind::Spark => spark::start(project, options),
        // In an elastic step's launcher pod (the JobSet's): the step's ranks in its worker pods, through kubectl exec.
        EngineKind::Kubernetes if k8s_pods::in_launcher_pod() => k8s_pods::start(project, options),
        EngineKind::Kubernetes => kubectl::start(project, options),
    }
}

/// A run, ready to be shown or carried out.
pub enum Run {
    /// The local supervisor runs this plan, with the engine it carries.
    Supervised(Plan),
    /// An engine that owns the whole run.
    Whole(Box<dyn WholeRunEngine>),
}

/// Chooses the engine (the one named, or the one the env's Horovod needs: [`crate::controller::choose`]) and readies
/// the run: plans it, or has the engine write what it submits. Nothing runs yet.
pub fn prepare(project: &Project, options: &RunOptions) -> Result<Run, LaunchError> {
    let choice = crate::controller::choose(project, options)?;
    match start(choice.engine, project, options)? {
        Engine::Supervised(_) if options.detach => Err(LaunchError::Engine(
            "`--detach` is for `--engine slurm` outside an allocation (the batch jobs run on without hvd)".into(),
        )),
        Engine::Supervised(engine) => {
            let mut plan = crate::graph::plan(project, options, engine)?;
            // An engine that starts a step's ranks through one launcher process (mpirun, a Spark driver) cannot
            // lose one rank and keep the others.
            if let Some(step) = plan.steps.iter().find(|s| {
                s.min_workers.is_some()
                    && s.workers
                        .is_some_and(|n| plan.engine.launcher(&plan, s, n).is_some())
            }) {
                return Err(LaunchError::Engine(format!(
                    "step `{}` is elastic, but the {} engine starts its ranks through one launcher process: {}; {}",
                    step.name,
                    choice.engine,
                    no_elastic_reason(choice.engine),
                    crate::engine::ELASTIC_ENGINES
                )));
            }
            plan.notes.extend(choice.note);
            Ok(Run::Supervised(plan))
        }
        Engine::Whole(engine) => {
            // A JobSet starts every rank at once and cannot go on without one (sbatch runs an elastic step under a
            // launcher of its own in the step's job).
            let elastic = project
                .steps
                .iter()
                .filter(|_| !engine.runs_elastic_steps())
                .find(|s| s.workers.is_some() && (s.min_workers.is_some() || options.min_workers.is_some()));
            if let Some(step) = elastic {
                return Err(LaunchError::Engine(format!(
                    "step `{}` is elastic, but the {} engine submits the whole run, which cannot lose a rank and go \
                     on: {}; {}",
                    step.name,
                    choice.engine,
                    no_elastic_reason(choice.engine),
                    crate::engine::ELASTIC_ENGINES
                )));
            }
            Ok(Run::Whole(engine))
        }
    }
}

/// Why engine `kind` cannot run an elastic step (when it starts a step's ranks as one unit).
fn no_elastic_reason(kind: EngineKind) -> &'static str {
    match kind {
        EngineKind::Mpi => {
            "mpirun ends every rank when one dies (an MPI job cannot lose a process and go on)"
        }
        // These start an elastic step's ranks one by one (spark: one job each, through its relay server; slurm: one
        // srun each, outside an allocation by a launcher in the step's batch job; kubernetes: one `kubectl exec`
        // each, by a launcher pod of the step's own).
        EngineKind::Local
        | EngineKind::Ssh
        | EngineKind::Spark
        | EngineKind::Slurm
        | EngineKind::Kubernetes => "it starts every rank as one unit",
    }
}

/// The plan of a run the local supervisor carries out; an engine that owns the whole run has none.
pub fn plan(project: &Project, options: &RunOptions) -> Result<Plan, LaunchError> {
    match prepare(project, options)? {
        Run::Supervised(plan) => Ok(plan),
        Run::Whole(_) => Err(LaunchError::Engine(format!(
            "the {} engine here submits the whole run instead of a plan the launcher runs: use `hvd_launcher::run` \
             (as `hvd run` does)",
            engine_kind(project, options)
        ))),
    }
}

impl Run {
    /// What the user should know before anything runs.
    pub fn notes(&self) -> Vec<String> {
        match self {
            Run::Supervised(plan) => plan.notes.clone(),
            Run::Whole(engine) => engine.notes(),
        }
    }

    /// What `hvd run --dry-run` prints.
    pub fn render(&self) -> String {
        match self {
            Run::Supervised(plan) => plan.render(),
            Run::Whole(engine) => engine.render(),
        }
    }

    /// Checks that the engine's tools are there.
    pub fn check(&self) -> Result<(), LaunchError> {
        match self {
            Run::Supervised(_) => Ok(()),
            Run::Whole(engine) => engine.check(),
        }
    }

    /// Carries the run out. Returns when every started process has ended (or, detached, when the jobs are
    /// submitted).
    pub fn execute(
        &self,
        options: &RunOptions,
        events: &dyn EventSink,
        interrupts: Interrupts,
    ) -> Result<RunReport, LaunchError> {
        match self {
            Run::Supervised(plan) => crate::supervisor::execute(plan, options, events, interrupts),
            Run::Whole(engine) => engine.run(events, interrupts),
        }
    }
}

/// Prepares, checks and executes the run of `project`.
pub fn run(
    project: &Project,
    options: &RunOptions,
    events: &dyn EventSink,
    interrupts: Interrupts,
) -> Result<RunReport, LaunchError> {
    let run = prepare(project, options)?;
    run.check()?;
    run.execute(options, events, interrupts)
}
