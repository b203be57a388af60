//! The step graph (petgraph) and the run plan built from it ([`plan`], [`Plan::render`]): which steps run, in which order, on how many workers,
//! with which environment.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use hvd_lang::model::{Project, Step};
use petgraph::Direction;
use petgraph::algo::toposort;
use petgraph::graph::{DiGraph, NodeIndex};

use std::sync::Arc;

use crate::LaunchError;
use crate::engine::{Plan, PlannedStep, SupervisedEngine};
use crate::env_vars::{HOROVOD_TIMELINE, HVD_TIMELINE};
use crate::options::{ELASTIC_TIMEOUT, ElasticSettings, RunOptions};

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
    /// everything it needs (transitively), or `only` alone when `alone` (`--no-deps`).
    pub fn selection(&self, only: Option<&str>, alone: bool) -> Result<Vec<&Step>, LaunchError> {
        let keep: Option<BTreeSet<NodeIndex>> = match only {
            None => None,
            Some(name) => {
                let start = self.node(name).ok_or_else(|| LaunchError::UnknownStep {
                    name: name.to_owned(),
                    known: self.graph.node_weights().map(|s| s.name.clone()).collect(),
                })?;
                let mut seen = BTreeSet::from([start]);
                let mut todo = if alone { Vec::new() } else { vec![start] };
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
                // Only the needs that run (`--no-deps` leaves them out).
                indegree.insert(
                    n,
                    self.graph
                        .neighbors_directed(n, Direction::Incoming)
                        .filter(|m| keep.as_ref().is_none_or(|k| k.contains(m)))
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

/// An elastic step's settings: each `hvd run` flag over the step's `workers = { .. }` in the file, over the default.
/// The file's discovery program is a path relative to the file's directory, and must exist.
fn elastic_settings(
    step: &Step,
    options: &RunOptions,
    project_dir: &Path,
) -> Result<ElasticSettings, LaunchError> {
    let file = &step.elastic;
    let discovery = match (&options.host_discovery_script, &file.discovery) {
        (Some(flag), _) => Some(flag.clone()),
        (None, Some(path)) => {
            let path = project_dir.join(path);
            if !path.is_file() {
                return Err(LaunchError::Engine(format!(
                    "step `{}`: its host discovery program (`workers = {{ discovery }}`) `{}` is not a file (a path \
                     relative to the .hvd file's directory, of an executable that prints `host:slots` lines)",
                    step.name,
                    path.display()
                )));
            }
            Some(path)
        }
        (None, None) => None,
    };
    let cooldown = match (options.blacklist_cooldown, file.cooldown_seconds) {
        (Some(flag), _) => flag,
        (None, Some((min, max))) => crate::discovery::Cooldown::from_seconds(min, max)
            .map_err(|e| LaunchError::Engine(format!("step `{}`: {e}", step.name)))?,
        (None, None) => crate::discovery::Cooldown::default(),
    };
    Ok(ElasticSettings {
        timeout: options
            .elastic_timeout
            .or(file.elastic_timeout_ms.map(Duration::from_millis))
            .unwrap_or(ELASTIC_TIMEOUT),
        discovery,
        slots_per_host: options.slots_per_host.or(file.slots_per_host),
        cooldown,
    })
}

/// Builds the plan for `project` with `engine` running its distributed steps.
pub fn plan(
    project: &Project,
    options: &RunOptions,
    engine: Arc<dyn SupervisedEngine>,
) -> Result<Plan, LaunchError> {
    let graph = StepGraph::new(project)?;
    let selected = graph.selection(options.step.as_deref(), options.no_deps)?;
    let names: BTreeSet<&str> = selected.iter().map(|s| s.name.as_str()).collect();
    let project_dir = project_dir(&project.file);
    // `--checkpoints DIR` for a file of several steps: one subdirectory each (writers of one directory prune each
    // other's), the same whichever steps `--step` selects, so a later run of one step resumes its own.
    let per_step = project.steps.len() > 1;
    let mut checkpoint_owners: BTreeMap<PathBuf, String> = BTreeMap::new();
    let mut steps = Vec::new();
    for step in selected {
        let workers = match (step.workers, options.max_workers.or(options.workers)) {
            (Some(_), Some(n)) | (Some(n), None) => Some(n),
            (None, _) => None,
        };
        if workers == Some(0) {
            return Err(LaunchError::ZeroWorkers(step.name.clone()));
        }
        let min_workers = workers.and(options.min_workers.or(step.min_workers));
        if let (Some(min), Some(max)) = (min_workers, workers)
            && min > max
        {
            return Err(LaunchError::ElasticRange {
                step: step.name.clone(),
                min,
                max,
            });
        }
        let mut env = project.env.variables.clone();
        env.extend(step.env.clone());
        if let Some(timeline) = &options.timeline {
            let timeline = if timeline.is_absolute() {
                timeline.clone()
            } else {
                cwd().join(timeline)
            };
            env.insert(HVD_TIMELINE.into(), timeline.display().to_string());
            env.insert(HOROVOD_TIMELINE.into(), timeline.display().to_string());
        }
        if let Some(dir) = checkpoint_dir(step, options, &project_dir, per_step) {
            if let Some(first) = checkpoint_owners.insert(dir.clone(), step.name.clone()) {
                return Err(LaunchError::SharedCheckpoints {
                    dir,
                    first,
                    second: step.name.clone(),
                });
            }
            env.insert(
                crate::env_vars::HVD_CHECKPOINT_DIR.into(),
                dir.display().to_string(),
            );
        }
        steps.push(PlannedStep {
            name: step.name.clone(),
            command: step.run.clone(),
            needs: step
                .needs
                .iter()
                .filter(|n| names.contains(n.as_str()))
                .cloned()
                .collect(),
            workers,
            layout: engine.layout(workers),
            env,
            inputs: step.inputs.clone(),
            outputs: step.outputs.clone(),
            timeout: step.timeout_ms.map(Duration::from_millis),
            restarts: restarts_of(step, options),
            elastic: match min_workers {
                Some(_) => elastic_settings(step, options, &project_dir)?,
                None => ElasticSettings::default(),
            },
            min_workers,
        });
    }
    Ok(Plan {
        project: project.name.clone(),
        state_dir: state_dir(project, options),
        project_dir,
        steps,
        gpus_per_worker: project.resources.gpus,
        env_dir: options.env_dir.clone(),
        caches: options.caches.clone(),
        trusted_keys: options.trusted_keys.clone(),
        engine,
        notes: Vec::new(),
    })
}

/// Where state and logs go: `RunOptions::state_dir`, else `.hvd/` next to the file.
pub fn state_dir(project: &Project, options: &RunOptions) -> PathBuf {
    options
        .state_dir
        .clone()
        .unwrap_or_else(|| project_dir(&project.file).join(".hvd"))
}

pub(crate) fn cwd() -> PathBuf {
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
            let launcher = step
                .workers
                .and_then(|n| self.engine.launcher(self, step, n));
            if let Some(argv) = &launcher {
                let label = self.engine.launcher_label();
                let env: String = self
                    .engine
                    .launcher_env(true)
                    .iter()
                    .map(|(k, v)| format!("{k}={} ", crate::engines::shell::quote(v)))
                    .collect();
                let _ = writeln!(
                    out,
                    "   {label:<8} {env}{}",
                    crate::engines::shell::line(argv)
                );
            }
            match step.workers {
                Some(n) => {
                    let (ip, _) = self.engine.rendezvous();
                    let how = self.engine.name();
                    let _ = writeln!(out, "   workers: {n} ({how}, rendezvous on {ip})");
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
                        for line in self.engine.dry_run_rank(self, step, slot) {
                            let _ = writeln!(out, "       {line}");
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
            if let Some(min) = step.min_workers {
                let _ = writeln!(
                    out,
                    "   elastic: goes on while at least {min} of its workers are alive (HVD_ELASTIC=1)"
                );
            }
            if step.restarts > 0 {
                let _ = writeln!(
                    out,
                    "   restarts: up to {} (HVD_RESTART_COUNT), after a rank fails",
                    step.restarts
                );
            }
            if let Some(t) = step.timeout {
                let _ = writeln!(out, "   timeout: {} s", t.as_secs_f64());
            }
        }
        out
    }
}

/// Where `step`'s workers keep their checkpoints (`HVD_CHECKPOINT_DIR`), absolute: `--checkpoints DIR` (relative to
/// the current directory; with `per_step`, when it applies to several steps, `DIR/<step name>`) over the step's
/// `checkpoints` (relative to the project directory; a `file://` URL is its path); an `s3://bucket/prefix` URL as it
/// is.
pub fn checkpoint_dir(
    step: &Step,
    options: &RunOptions,
    project_dir: &Path,
    per_step: bool,
) -> Option<PathBuf> {
    if let Some(dir) = &options.checkpoints {
        return Some(match dir.to_str().filter(|d| d.starts_with("s3://")) {
            Some(url) if per_step => {
                PathBuf::from(format!("{}/{}", url.trim_end_matches('/'), step.name))
            }
            Some(url) => PathBuf::from(url),
            None if per_step => cwd().join(dir).join(&step.name).components().collect(),
            None => cwd().join(dir).components().collect(),
        });
    }
    let dir = step.checkpoints.as_deref()?;
    if dir.starts_with("s3://") {
        // The workers write to the bucket themselves (hvd.elastic); nothing to resolve here.
        return Some(PathBuf::from(dir));
    }
    let dir = Path::new(dir.strip_prefix("file://").unwrap_or(dir));
    // `ckpt/` and `./ckpt` name the same directory: one spelling for the workers and the messages.
    Some(project_dir.join(dir).components().collect())
}

/// How many times `step` starts again after a rank fails: `--max-restarts` over the step's `restarts`, else 0.
pub fn restarts_of(step: &Step, options: &RunOptions) -> u32 {
    options.max_restarts.or(step.restarts).unwrap_or(0)
}
