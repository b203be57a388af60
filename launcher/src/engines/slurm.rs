//! The `slurm` engine. Inside an allocation (`SLURM_JOB_ID` set) a distributed step is one `srun` (supervised by
//! the local engine like mpirun): `srun --kill-on-bad-exit=1 --ntasks=N ... hvd worker-env -- /bin/sh -c COMMAND`,
//! the shim reading `SLURM_*`; an elastic step's ranks are each a job step of their own (`engines/slurm_steps.rs`).
//! Outside one, [`batch_steps`] writes one batch script per step, which the sbatch
//! engine (`engines/sbatch.rs`) submits with `sbatch --parsable`, chained with `--dependency=afterok`, and follows.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use hvd_lang::model::Project;

use crate::LaunchError;
use crate::engine::{Engine, Plan, PlannedStep, RankCommand, RankStart, SupervisedEngine};
use crate::engines::shell::{self, quote};
use crate::engines::slurm_steps::{Allocation, RankSrun};
use crate::env::{Slot, WorkerLayout};
use crate::options::RunOptions;

/// What srun needs besides the step.
#[derive(Debug, Clone)]
pub struct SlurmSetup {
    pub shim: std::path::PathBuf,
    pub cpus_per_task: Option<u32>,
    pub gpus_per_task: u32,
    /// `Some` when the run has an elastic step: the allocation its ranks are spread over, one job step each. The
    /// run's distributed steps then take their layout from it and their rendezvous listens where its nodes reach
    /// it; `None` (no elastic step): one srun per step (see `plain`).
    pub allocation: Option<Allocation>,
    /// Inside an allocation without an elastic step: its nodes, so that a step's one srun has its rendezvous where
    /// every node reaches it (the address that routes to the allocation's first other node; loopback when every
    /// node is this machine), and, when it takes every task, the layout srun gives it. `None` outside an
    /// allocation, when Slurm did not say which nodes it has, or when no selected step is distributed.
    pub plain: Option<Allocation>,
    /// Whether srun places a step on every task of the allocation as [`Allocation::layout`] says (block by block):
    /// `SLURM_DISTRIBUTION` unset or `block...`, and `resources.cpus` unset or the allocation's `SLURM_CPUS_PER_TASK`
    /// (more CPUs a task fit fewer tasks on a node). Otherwise the step's layout (its lines' labels, Horovod's gloo
    /// scopes) stays this machine's, as for a step on fewer tasks.
    pub plain_layout: bool,
}

/// Whether this process runs inside a Slurm allocation.
pub fn in_allocation() -> bool {
    std::env::var_os(crate::env_vars::SLURM_JOB_ID).is_some_and(|v| !v.is_empty())
}

impl SlurmSetup {
    pub fn new(project: &Project, options: &RunOptions) -> Result<Self, LaunchError> {
        let allocation = match has_elastic_step(project, options) {
            true => Some(Allocation::from_env(options.grace)?),
            false => None,
        };
        // Host discovery: the flag's, or an elastic step's `workers = { discovery }` in the file.
        let discovery = options
            .host_discovery_script
            .as_ref()
            .map(|script| format!("`--host-discovery-script {}`", script.display()))
            .or_else(|| {
                project.steps.iter().find_map(|s| {
                    let script = s.elastic.discovery.as_ref()?;
                    Some(format!("`discovery = {script:?}` of step `{}`", s.name))
                })
            });
        if let (Some(_), Some(discovery)) = (&allocation, discovery) {
            return Err(LaunchError::Engine(format!(
                "host discovery ({discovery}) runs elastic steps on the local and ssh engines only, not on the slurm \
                 engine: its hosts are the allocation's nodes, where lost workers are replaced without it"
            )));
        }
        if let Some(allocation) = &allocation {
            for (step, workers) in elastic_workers(project, options)? {
                allocation.check_workers(&step, workers)?;
            }
        }
        // A plain step's ranks may run on other nodes of the allocation too: its rendezvous must not be loopback then.
        // Only read when a selected step is distributed (a run of steps that run once needs no rendezvous).
        let plain = match (&allocation, distributed_step(project, options)?) {
            (None, Some(step))
                if in_allocation() && slurm_var(crate::env_vars::SLURM_JOB_NODELIST).is_some() =>
            {
                Some(plain_allocation(&step, options)?)
            }
            _ => None,
        };
        Ok(SlurmSetup {
            shim: options.shim.clone().ok_or_else(|| {
                LaunchError::Engine(
                    "the slurm engine needs the hvd binary for its worker shim (RunOptions::shim)"
                        .into(),
                )
            })?,
            cpus_per_task: project.resources.cpus,
            gpus_per_task: project.resources.gpus,
            allocation,
            plain,
            plain_layout: placed_as_blocks(project.resources.cpus),
        })
    }

    /// How an elastic step's rank is started, when the run has one.
    fn rank_srun(&self) -> Option<RankSrun<'_>> {
        self.allocation.as_ref().map(|allocation| RankSrun {
            allocation,
            cpus_per_task: self.cpus_per_task,
            gpus_per_task: self.gpus_per_task,
            shim: &self.shim,
        })
    }

    /// The srun command line of a distributed step on `np` tasks; `pull`: the shim's flags that get the env from the
    /// binary caches ([`pull_flags`]), empty without them.
    pub fn srun_argv(&self, np: u32, command: &str, pull: &[String]) -> Vec<String> {
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
        argv.extend([self.shim.display().to_string(), "worker-env".into()]);
        argv.extend(pull.iter().cloned());
        argv.extend(["--".into(), "/bin/sh".into(), "-c".into(), command.into()]);
        argv
    }
}

/// The shim's flags that get the env from the binary caches and root it while the command runs (`--pull=ENV
/// --cache=URL... --trusted-key=KEY...`): empty without caches and keys, or for a cache URL with credentials
/// (refused before, in `prepare` and `batch_steps`).
fn pull_flags(plan: &Plan, shim: &Path) -> Vec<String> {
    match (crate::engines::pull_argv(plan, shim), &plan.env_dir) {
        (Ok(Some(pull)), Some(env)) => {
            let mut argv =
                crate::engines::worker_pull_argv(&pull, &env.display().to_string(), false);
            argv.split_off(2)
        }
        _ => Vec::new(),
    }
}

/// Whether a distributed step of `project` is elastic (`workers = { min, max }`, or `--min-workers`).
fn has_elastic_step(project: &Project, options: &RunOptions) -> bool {
    project
        .steps
        .iter()
        .any(|s| s.workers.is_some() && (s.min_workers.is_some() || options.min_workers.is_some()))
}

/// A non-blank `SLURM_*` variable.
fn slurm_var(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.trim().is_empty())
}

/// The first distributed step this run starts (`--step` selects it and what it needs), if any.
fn distributed_step(
    project: &Project,
    options: &RunOptions,
) -> Result<Option<String>, LaunchError> {
    let graph = crate::graph::StepGraph::new(project)?;
    let selected = graph.selection(options.step.as_deref(), options.no_deps)?;
    Ok(selected
        .into_iter()
        .find(|s| s.workers.is_some())
        .map(|s| s.name.clone()))
}

/// The allocation a plain distributed step (`step`, the first the run starts) reads for its rendezvous, with errors
/// worded for it (the reader's own speak of elastic steps).
fn plain_allocation(step: &str, options: &RunOptions) -> Result<Allocation, LaunchError> {
    let tasks = crate::env_vars::SLURM_TASKS_PER_NODE;
    if slurm_var(tasks).is_none() {
        return Err(LaunchError::Engine(format!(
            "distributed step `{step}` runs inside a Slurm allocation whose nodes (`{}`) are known but not how many \
             tasks each has (`{tasks}` is not set): its ranks may run on any of them, so the rendezvous must listen \
             where they all reach it; run `hvd run` inside the allocation as salloc or sbatch set it",
            crate::env_vars::SLURM_JOB_NODELIST
        )));
    }
    Allocation::from_env(options.grace).map_err(|e| {
        LaunchError::Engine(format!(
            "distributed step `{step}` runs inside a Slurm allocation, and its rendezvous must listen where every \
             node of it reaches: {e}"
        ))
    })
}

/// Whether srun places one step on every task of the allocation block by block, as [`Allocation::layout`] does:
/// `SLURM_DISTRIBUTION` (salloc/sbatch `--distribution`, inherited by srun) unset or `block` across nodes, and
/// `cpus` (`resources.cpus`, srun's `--cpus-per-task`) unset or the allocation's own (`SLURM_CPUS_PER_TASK`, else 1).
fn placed_as_blocks(cpus: Option<u32>) -> bool {
    let block = slurm_var(crate::env_vars::SLURM_DISTRIBUTION)
        .is_none_or(|d| d.trim().split([':', ',']).next() == Some("block"));
    let allocated = slurm_var(crate::env_vars::SLURM_CPUS_PER_TASK)
        .map_or(Some(1), |c| c.trim().parse::<u32>().ok());
    block && cpus.is_none_or(|c| Some(c) == allocated)
}

/// The first node of a Slurm host list (`SLURM_STEP_NODELIST`: `n[01-03,7],gpu1` begins with `n01`), the node of
/// rank 0 of a step srun placed by block or cyclic distribution; `None` for a value that is not a host list (a
/// stray or unclosed bracket, an empty range, a range that is not `N`, `N-M`, ... separated by commas, an empty
/// entry), wherever in the list. The whole list is checked in one pass, with no cap on its length (a job's huge list
/// of scattered nodes is as Slurm wrote it).
pub fn first_node(list: &str) -> Option<String> {
    let list = list.trim();
    if !crate::engines::slurm_steps::host_list_text(list) {
        return None;
    }
    let mut first = String::new();
    let mut in_first = true;
    let mut entry_empty = true;
    let mut rest = list;
    while let Some(c) = rest.chars().next() {
        rest = &rest[c.len_utf8()..];
        match c {
            ',' if entry_empty => return None,
            ',' => {
                in_first = false;
                entry_empty = true;
            }
            '[' if entry_empty => return None,
            '[' => {
                // The range's first number, zero padding kept; the rest of the brackets checked, then skipped.
                let (ranges, after) = rest.split_once(']')?;
                let well_formed = ranges.split(',').all(|range| {
                    let mut ends = range.splitn(2, '-');
                    ends.all(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
                });
                if !well_formed {
                    return None;
                }
                if in_first {
                    first.extend(ranges.chars().take_while(char::is_ascii_digit));
                }
                entry_empty = false;
                rest = after;
            }
            ']' => return None,
            c => {
                if in_first {
                    first.push(c);
                }
                entry_empty = false;
            }
        }
    }
    (!entry_empty).then_some(first)
}

/// The elastic steps this run starts (`--step` selects them and what they need) and how many workers each has (the
/// most: `--max-workers`, else `--workers`, else the step's), as the plan ([`crate::graph::plan`]) sizes them.
fn elastic_workers(
    project: &Project,
    options: &RunOptions,
) -> Result<Vec<(String, u32)>, LaunchError> {
    let graph = crate::graph::StepGraph::new(project)?;
    let selected = graph.selection(options.step.as_deref(), options.no_deps)?;
    Ok(selected
        .into_iter()
        .filter(|s| s.min_workers.is_some() || options.min_workers.is_some())
        .filter_map(|s| {
            let workers = s
                .workers
                .map(|n| options.max_workers.or(options.workers).unwrap_or(n))?;
            Some((s.name.clone(), workers))
        })
        .collect())
}

/// The `slurm` engine inside an allocation: a distributed step is one srun, which starts the ranks; an elastic
/// step's ranks are one srun each.
pub fn start(project: &Project, options: &RunOptions) -> Result<Engine, LaunchError> {
    Ok(Engine::Supervised(std::sync::Arc::new(SlurmSetup::new(
        project, options,
    )?)))
}

impl SupervisedEngine for SlurmSetup {
    fn name(&self) -> &'static str {
        "slurm engine"
    }

    fn layout(&self, workers: Option<u32>) -> WorkerLayout {
        // One srun of every task of the allocation places them node by node, as the allocation's layout does.
        if let (Some(plain), Some(n), true) = (&self.plain, workers, self.plain_layout)
            && plain.tasks() == u64::from(n)
        {
            return plain.layout(n);
        }
        match (&self.allocation, workers) {
            (Some(allocation), Some(n)) => allocation.layout(n),
            _ => WorkerLayout::local(&crate::env::local_hostname(), workers.unwrap_or(1)),
        }
    }

    fn rendezvous(&self) -> (IpAddr, Vec<IpAddr>) {
        match self.allocation.as_ref().or(self.plain.as_ref()) {
            Some(allocation) => (allocation.bind_ip, allocation.peers.clone()),
            None => {
                let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
                (loopback, vec![loopback])
            }
        }
    }

    /// Only inside an allocation (the rendezvous on an address the nodes reach); else it is on 127.0.0.1 and srun
    /// may put rank 0 on another node.
    fn rank_zero_reaches_rendezvous(&self) -> bool {
        self.allocation.is_some() || self.plain.is_some()
    }

    /// Inside an allocation with an elastic step: its ranks, and their replacements, run on the allocation's nodes.
    fn remote_hosts(&self) -> bool {
        self.allocation.is_some()
    }

    /// A host where a replacement goes: one of the allocation's nodes (an `srun --nodelist` elsewhere would wait for
    /// a node the job does not have).
    fn reach_host(&self, _plan: &Plan, _step: &PlannedStep, host: &str) -> Result<(), LaunchError> {
        match &self.allocation {
            Some(a) if a.nodes.iter().any(|(n, _)| n == host) => Ok(()),
            _ => Err(LaunchError::Engine(format!(
                "`{host}` is not a node of this Slurm allocation (`{}`)",
                crate::env_vars::SLURM_JOB_NODELIST
            ))),
        }
    }

    /// Its [`SupervisedEngine::reach_host`] only looks the node up in the allocation.
    fn reaches_at_once(&self) -> bool {
        true
    }

    /// Inside an allocation: `srun --nodelist=HOST --overlap --gres=none true` (a job step beside the ranks', asking
    /// for nothing they hold), killed past
    /// `within`; outside one the engine cannot look.
    fn probe_host(&self, host: &str, within: std::time::Duration) -> Option<bool> {
        self.allocation.as_ref()?;
        let mut srun = std::process::Command::new("srun");
        srun.args([
            "--ntasks=1",
            "--nodes=1",
            &format!("--nodelist={host}"),
            "--overlap",
            "--mem=0",
            // Nothing the ranks hold (a GPU request inherited from the allocation's environment would wait for them).
            "--gres=none",
            "--cpus-per-task=1",
            "--quiet",
            "true",
        ]);
        // No answer within the time: not reached. An srun that fails at once (refused by Slurm: options, limits)
        // says nothing of the node, so the engine could not look.
        match crate::engines::ssh::exits_within(&mut srun, within) {
            None => Some(false),
            Some(true) => Some(true),
            Some(false) => None,
        }
    }

    /// A lost rank is replaced by a new `srun --exact` on a node of the allocation with a free task: its nodes and
    /// their tasks (`SLURM_JOB_NODELIST`, `SLURM_TASKS_PER_NODE`).
    fn replacement_hosts(&self) -> Option<Vec<(String, u32)>> {
        self.allocation.as_ref().map(|a| a.nodes.clone())
    }

    /// An elastic step has no launcher: the supervisor starts each rank ([`SupervisedEngine::rank_command`]), so it
    /// can lose one and go on.
    fn launcher(&self, plan: &Plan, step: &PlannedStep, workers: u32) -> Option<Vec<String>> {
        match step.min_workers {
            Some(_) => None,
            None => Some(self.srun_argv(workers, &step.command, &pull_flags(plan, &self.shim))),
        }
    }

    /// A cache URL that carries credentials is refused before anything runs (the ranks' srun lines would show it),
    /// and so is a variable name an elastic step's remote ranks cannot take.
    fn prepare(&self, plan: &Plan) -> Result<(), LaunchError> {
        if self.rank_srun().is_some() {
            crate::engines::ssh::check_elastic_env_names(plan, "the slurm engine")?;
        }
        crate::engines::pull_argv(plan, &self.shim).map(|_| ())
    }

    fn launcher_label(&self) -> &'static str {
        "srun:"
    }

    fn rank_command(&self, rank: &RankStart<'_>) -> Result<RankCommand, LaunchError> {
        match self.rank_srun() {
            Some(srun) => srun.command(rank),
            None => Ok(RankCommand::local(rank)),
        }
    }

    /// An elastic step's rank: its srun line (the ports and the run id, chosen when the step starts, shown as
    /// `<port>`, `<master-port>` and `<run id>`).
    fn dry_run_rank(&self, plan: &Plan, step: &PlannedStep, slot: &Slot) -> Vec<String> {
        let Some(srun) = self.rank_srun().filter(|_| step.min_workers.is_some()) else {
            return Vec::new();
        };
        let ip = srun.allocation.bind_ip;
        let vars = srun.vars(crate::engines::ssh::dry_run_rank_env(plan, step, slot, ip));
        let argv = srun.argv(plan, step, slot, ip, &srun.pull(plan).unwrap_or_default());
        crate::engines::ssh::dry_run_lines("srun", Ok(argv), &vars, "the slurm engine")
    }
}

/// One step as a batch job: its script and what the submission needs to know.
#[derive(Debug, Clone)]
pub struct BatchStep {
    pub name: String,
    /// Steps (within the plan) whose jobs must end successfully first (`--dependency=afterok:`).
    pub needs: Vec<String>,
    /// `Some(n)`: the script runs n tasks with srun; `None`: the step runs once in the batch script itself.
    pub workers: Option<u32>,
    /// Tasks per node (block distribution: rank r runs on node r / tasks_per_node of the job's node list).
    pub tasks_per_node: u32,
    pub timeout: Option<std::time::Duration>,
    /// The batch script (`#SBATCH` directives, then the commands).
    pub script: String,
    /// The step runs under a launcher of its own in the job (an elastic step, or one that may start again):
    /// `hvd run` of this step alone inside the allocation ([`launcher_argv`]), whose console lines the job's output
    /// files hold.
    pub supervised: bool,
}

/// Where the batch jobs' output files (`<project>-<step>-<job id>.out` / `.err`) and file rendezvous
/// directories go: `<state dir>/slurm`, on the file system the nodes share with the submitting host.
pub fn output_dir(plan: &Plan) -> std::path::PathBuf {
    plan.state_dir.join("slurm")
}

/// The batch script of every planned step (in plan order), each to be submitted with `sbatch --parsable` and the
/// `--dependency=afterok:` of the steps it needs. `nodes`: from `cluster { settings { nodes } }` or the number of
/// `hosts`, else 1; `settings { overcommit = "true" }` adds `--overcommit`. Distributed steps meet at a file
/// rendezvous (`HVD_RENDEZVOUS=file:<output dir>/rdv-<job id>`, removed when srun ends), so a script needs nothing
/// from the submitting process and the jobs run the same whether `hvd run` follows them or not.
pub fn batch_steps(
    project: &Project,
    plan: &Plan,
    options: &RunOptions,
    shim: &Path,
) -> Result<Vec<BatchStep>, LaunchError> {
    let cluster = project.cluster.clone().unwrap_or_default();
    let nodes = cluster
        .settings
        .nodes
        .unwrap_or((cluster.hosts.len() as u32).max(1));
    let overcommit = cluster.settings.overcommit.unwrap_or(false);
    let setup = SlurmSetup {
        shim: shim.to_path_buf(),
        cpus_per_task: project.resources.cpus,
        gpus_per_task: project.resources.gpus,
        allocation: None,
        plain: None,
        plain_layout: false,
    };
    let name = crate::engines::k8s::dns_label(&project.name);
    let out_dir = output_dir(plan).display().to_string();
    let mut steps = Vec::new();
    for step in &plan.steps {
        let tasks = step.workers.unwrap_or(1);
        let step_nodes = nodes.min(tasks);
        let per_node = tasks.div_ceil(step_nodes);
        let mut s = String::from("#!/bin/sh\n");
        let mut directive = |line: String| {
            let _ = writeln!(s, "#SBATCH {line}");
        };
        directive(format!("--job-name={name}-{}", step.name));
        directive(format!("--nodes={step_nodes}"));
        if overcommit {
            // Slurm refuses `--ntasks-per-node` beyond a node's CPUs even with `--overcommit` (BadConstraints); the
            // tasks in all, over `--nodes`, are placed in blocks of `per_node` all the same.
            directive(format!("--ntasks={tasks}"));
        } else {
            directive(format!("--ntasks-per-node={per_node}"));
        }
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
        // An elastic step, or one that may start again, runs under its own launcher in the job; an elastic one goes on
        // without a lost node, so the allocation must survive the node (else Slurm revokes it).
        let supervised = step.min_workers.is_some() || step.restarts > 0;
        if let Some(t) = step.timeout {
            // The launcher in the job gives each attempt the step's timeout (and stops its ranks within the grace):
            // the job's limit holds every attempt, and a minute more.
            let job = match supervised {
                true => (t + options.grace)
                    .saturating_mul(step.restarts.saturating_add(1))
                    .saturating_add(std::time::Duration::from_secs(60)),
                false => t,
            };
            directive(format!("--time={}", job.as_secs().div_ceil(60).max(1)));
        }
        if overcommit {
            directive("--overcommit".into());
        }
        if step.min_workers.is_some() {
            directive("--no-kill".into());
        }
        directive(format!(
            "--output={}",
            quote(&format!("{out_dir}/{name}-{}-%j.out", step.name))
        ));
        directive(format!(
            "--error={}",
            quote(&format!("{out_dir}/{name}-{}-%j.err", step.name))
        ));
        let _ = writeln!(s, "set -e");
        let _ = writeln!(s, "cd {}", quote(&plan.project_dir.display().to_string()));
        let _ = writeln!(s, "export PYTHONUNBUFFERED=1");
        if let Some(env) = &plan.env_dir {
            let env = env.display().to_string();
            let _ = writeln!(s, "export PATH={}:\"$PATH\"", quote(&format!("{env}/bin")));
            let _ = writeln!(s, "export VIRTUAL_ENV={}", quote(&env));
        }
        if plan.gpus_per_worker > 0 {
            let _ = writeln!(
                s,
                "export {}={}",
                crate::engines::shim::GPUS_VAR,
                plan.gpus_per_worker
            );
        }
        for (k, v) in &step.env {
            let _ = writeln!(s, "export {k}={}", quote(v));
        }
        let pull = crate::engines::pull_argv(plan, shim)?;
        if let Some(pull) = &pull {
            // Every node of the job gets the env into its own store before any rank starts; one that cannot ends
            // the job naming itself.
            let _ = writeln!(
                s,
                "srun --ntasks-per-node=1 --ntasks={step_nodes} /bin/sh -c {}",
                quote(&format!(
                    "{} >/dev/null || {{ echo \"hvd: node $(hostname) could not get the env from the binary \
                     caches (above)\" >&2; exit 1; }}",
                    shell::line(pull)
                ))
            );
        }
        // Each command then starts through `hvd worker-env --pull`, which finds the pulled env (or pulls it again
        // if an `hvd gc` on the node removed it meanwhile) and roots it until the command has ended.
        let worker_pull = |once: bool| match (&pull, &plan.env_dir) {
            (Some(pull), Some(env)) => {
                crate::engines::worker_pull_argv(pull, &env.display().to_string(), once)
            }
            _ => Vec::new(),
        };
        match step.workers {
            _ if supervised => {
                let argv = launcher_argv(project, plan, step, options, shim, pull.is_some())?;
                let _ = writeln!(s, "exec {}", shell::line(&argv));
            }
            Some(n) => {
                // torch's env:// meets at the first node; the port is spread by job id, below the kernel's ephemeral
                // range (32768 up by default), where outgoing connections on the node cannot hold it.
                let _ = writeln!(
                    s,
                    "export MASTER_ADDR=\"$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1)\""
                );
                let _ = writeln!(s, "export MASTER_PORT=$((20000 + SLURM_JOB_ID % 12000))");
                let _ = writeln!(s, "rdv={}/rdv-\"$SLURM_JOB_ID\"", quote(&out_dir));
                // srun ... hvd worker-env [--pull=ENV --cache=URL... --trusted-key=KEY...] -- /bin/sh -c COMMAND
                let argv = setup.srun_argv(n, &step.command, &pull_flags(plan, shim));
                // srun ... hvd worker-env -- [env HVD_RENDEZVOUS=file:DIR] /bin/sh -c COMMAND
                let split = argv.len() - 3;
                let _ = writeln!(s, "status=0");
                let _ = writeln!(
                    s,
                    "{} env \"HVD_RENDEZVOUS=file:$rdv\" {} || status=$?",
                    shell::line(&argv[..split]),
                    shell::line(&argv[split..])
                );
                let _ = writeln!(s, "rm -rf \"$rdv\"");
                let _ = writeln!(s, "exit \"$status\"");
            }
            None => {
                let mut argv = worker_pull(true);
                if !argv.is_empty() {
                    argv.push("--".into());
                }
                argv.extend(["/bin/sh".into(), "-c".into(), step.command.clone()]);
                let _ = writeln!(s, "{}", shell::line(&argv));
            }
        }
        steps.push(BatchStep {
            name: step.name.clone(),
            needs: step.needs.clone(),
            workers: step.workers,
            tasks_per_node: per_node,
            timeout: step.timeout,
            script: s,
            supervised,
        });
    }
    Ok(steps)
}

/// What a batch job of step `step` runs when the step needs hvd's supervision (an elastic step, or one that may
/// start again): `hvd run FILE --step STEP --no-deps --force --engine slurm` inside the allocation (one srun per rank
/// for an elastic step; restarts through hvd), with the env this run built (`--env-dir`, else `--no-build`), the
/// caches the job pulled from when `pulls`, and the run's flags that shape the step; the file itself says the rest,
/// read when the job starts, as the job reads the step's scripts then. Host discovery is refused before (the
/// allocation's nodes are the step's hosts).
fn launcher_argv(
    project: &Project,
    plan: &Plan,
    step: &PlannedStep,
    options: &RunOptions,
    shim: &Path,
    pulls: bool,
) -> Result<Vec<String>, LaunchError> {
    let utf8 = |path: &Path, what: &str| {
        path.to_str().map(str::to_owned).ok_or_else(|| {
            LaunchError::Engine(format!(
                "{what} {} is not UTF-8; a batch script cannot name it",
                path.display()
            ))
        })
    };
    let file = match project.file.file_name() {
        Some(name) => plan.project_dir.join(name),
        None => project.file.clone(),
    };
    let mut argv = vec![
        utf8(shim, "the hvd binary")?,
        "run".into(),
        utf8(&file, "the .hvd file")?,
        format!("--step={}", step.name),
        "--no-deps".into(),
        "--force".into(),
        "--engine=slurm".into(),
    ];
    match &plan.env_dir {
        Some(env) => argv.push(format!("--env-dir={}", utf8(env, "the env")?)),
        None => argv.push("--no-build".into()),
    }
    if pulls {
        argv.extend(plan.caches.iter().map(|c| format!("--cache={c}")));
        argv.extend(
            plan.trusted_keys
                .iter()
                .map(|k| format!("--trusted-key={k}")),
        );
    }
    argv.extend(super::step_flags(options));
    // Paths given on the command line are against the submitting shell's directory; the job starts elsewhere.
    let here = |path: &Path| crate::graph::cwd().join(path);
    if let Some(t) = &options.timeline {
        argv.push(format!("--timeline={}", utf8(&here(t), "the timeline")?));
    }
    if let Some(dir) = &options.checkpoints {
        let dir = match dir.to_str().filter(|d| d.starts_with("s3://")) {
            Some(url) => url.to_owned(),
            None => utf8(&here(dir), "the checkpoint directory")?,
        };
        argv.push(format!("--checkpoints={dir}"));
    }
    Ok(argv)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// Runs `command`, which must succeed (its stderr in the message otherwise).
    fn succeeds(command: &mut std::process::Command) -> std::process::Output {
        let out = command.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn project(overcommit: bool) -> Project {
        let step = |name: &str, workers: Option<u32>, needs: &[&str], timeout_ms: Option<u64>| {
            hvd_lang::model::Step {
                needs: needs.iter().map(|n| (*n).to_owned()).collect(),
                workers,
                timeout_ms,
                ..hvd_lang::model::Step::new(name, &format!("echo {name}"))
            }
        };
        Project {
            name: "p".into(),
            file: "/work/p/train.hvd".into(),
            env: hvd_lang::model::Env {
                python: "3.11".into(),
                index: None,
                toolchain: None,
                packages: vec![],
                variables: BTreeMap::new(),
            },
            resources: hvd_lang::model::Resources::default(),
            steps: vec![
                step("a", None, &[], Some(90_000)),
                step("b", None, &[], None),
                step("train", Some(3), &["a", "b"], None),
            ],
            cluster: Some(hvd_lang::model::Cluster {
                engine: Some(hvd_lang::model::EngineKind::Slurm),
                settings: hvd_lang::model::EngineSettings {
                    overcommit: Some(overcommit),
                    ..Default::default()
                },
                ..Default::default()
            }),
        }
    }

    /// Inside an allocation an elastic step's replacements go to the allocation's nodes, up to each node's tasks, and
    /// nowhere else; without one (no elastic step) the engine starts no new workers.
    #[test]
    fn replacements_go_to_the_allocations_nodes_only() {
        let allocation = Allocation {
            nodes: vec![("n1".into(), 2), ("n2".into(), 1)],
            bind_ip: "10.0.0.1".parse().unwrap(),
            peers: vec![],
            grace_ticks: 20,
        };
        let setup = |allocation: Option<Allocation>| SlurmSetup {
            shim: "/bin/hvd".into(),
            cpus_per_task: None,
            gpus_per_task: 0,
            allocation,
            plain: None,
            plain_layout: false,
        };
        let plan = crate::engines::sbatch::plan(&project(false), &RunOptions::default()).unwrap();
        let inside = setup(Some(allocation));
        assert!(inside.remote_hosts());
        assert_eq!(
            inside.replacement_hosts(),
            Some(vec![("n1".to_owned(), 2), ("n2".to_owned(), 1)])
        );
        let step = &plan.steps[0];
        inside.reach_host(&plan, step, "n2").unwrap();
        let err = inside
            .reach_host(&plan, step, "n3")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`n3` is not a node of this Slurm allocation"),
            "{err}"
        );
        let outside = setup(None);
        assert!(!outside.remote_hosts() && outside.replacement_hosts().is_none());
    }

    /// A plain step inside an allocation of several nodes: the rendezvous on the allocation's address (not loopback),
    /// rank 0 reaching it; on every task the layout is the allocation's, node by node; on fewer, this machine's; and
    /// no replacements (the step is not elastic).
    #[test]
    fn a_plain_step_meets_where_the_allocations_nodes_reach() {
        let plain = Allocation {
            nodes: vec![("n1".into(), 2), ("n2".into(), 2)],
            bind_ip: "10.0.0.1".parse().unwrap(),
            peers: vec!["10.0.0.2".parse().unwrap(), "10.0.0.1".parse().unwrap()],
            grace_ticks: 20,
        };
        let setup = SlurmSetup {
            shim: "/bin/hvd".into(),
            cpus_per_task: None,
            gpus_per_task: 0,
            allocation: None,
            plain: Some(plain.clone()),
            plain_layout: true,
        };
        assert_eq!(setup.rendezvous(), (plain.bind_ip, plain.peers.clone()));
        assert!(setup.rank_zero_reaches_rendezvous());
        assert!(!setup.remote_hosts() && setup.replacement_hosts().is_none());
        let hosts = |n| -> Vec<String> {
            setup
                .layout(Some(n))
                .slots
                .into_iter()
                .map(|s| s.host)
                .collect()
        };
        assert_eq!(hosts(4), ["n1", "n1", "n2", "n2"]);
        let here = crate::env::local_hostname();
        assert_eq!(hosts(3), [here.clone(), here.clone(), here.clone()]);
        // Placed otherwise than block by block (`SLURM_DISTRIBUTION=cyclic`, other CPUs a task): this machine's too.
        let cyclic = SlurmSetup {
            plain_layout: false,
            ..setup.clone()
        };
        assert!(cyclic.layout(Some(4)).slots.iter().all(|s| s.host == here));
    }

    /// Rank 0's node under srun: the first name of the step's host list, ranges' zero padding kept; what is not a
    /// host list (an option, a stray or unclosed bracket, an empty or invalid range) gives none.
    #[test]
    fn the_first_node_of_a_host_list() {
        let first = |list: &str| first_node(list);
        assert_eq!(first("n1").as_deref(), Some("n1"));
        assert_eq!(
            first("gpu-07.cluster,n1").as_deref(),
            Some("gpu-07.cluster")
        );
        assert_eq!(first("n[01-03,7],m2").as_deref(), Some("n01"));
        assert_eq!(first("n[5,2-3]").as_deref(), Some("n5"));
        assert_eq!(first("rack[2-3]-n[10-11]").as_deref(), Some("rack2-n10"));
        for bad in [
            "", "-n1", "[1-2]", "n1]", "n1 n2", "n$(id)", "n[1-3", "n[", "n[]", "n[abc]", "n[1-]",
            "n[-2]", "n[1,]", "n[1-2-3]", "n[1[2]]", "n[1]]", "n1,m[", "n1,m[1-", "n1,m]",
            "n1,,m2", "n1,", "n1,m$", "n[1],[2]",
        ] {
            assert_eq!(first(bad), None, "{bad}");
        }
        // A huge list of scattered nodes (over 64 KiB) is read as any other.
        let huge = (0..20_000)
            .map(|i| format!("node{i:05}"))
            .collect::<Vec<_>>()
            .join(",");
        assert!(huge.len() > 1 << 17);
        assert_eq!(first(&huge).as_deref(), Some("node00000"));
    }

    /// An elastic step's job, and a restarted step's, end in `exec hvd run ... --step=S --no-deps` with the run's
    /// flags that shape the step (paths absolute: the job starts in the project directory); only the elastic one's
    /// allocation survives a lost node (`--no-kill`); a plain step's job runs srun itself.
    #[test]
    fn a_step_that_needs_supervision_runs_its_own_launcher_in_the_job() {
        let mut project = project(false);
        project.file = "/p/train.hvd".into();
        project.steps = vec![
            hvd_lang::model::Step {
                workers: Some(4),
                min_workers: Some(2),
                ..hvd_lang::model::Step::new("elastic", "python e.py")
            },
            hvd_lang::model::Step {
                workers: Some(2),
                restarts: Some(1),
                timeout_ms: Some(600_000),
                ..hvd_lang::model::Step::new("restarted", "python r.py")
            },
            hvd_lang::model::Step {
                workers: Some(2),
                ..hvd_lang::model::Step::new("plain", "python p.py")
            },
        ];
        let options = RunOptions {
            env_dir: Some("/envs/e1".into()),
            grace: std::time::Duration::from_millis(2500),
            elastic_timeout: Some(std::time::Duration::from_secs(7)),
            blacklist_cooldown: Some(crate::discovery::Cooldown {
                min: std::time::Duration::from_secs(5),
                max: std::time::Duration::from_secs(9),
            }),
            checkpoints: Some("s3://b/ck".into()),
            timeline: Some("t.json".into()),
            verbose: 2,
            ..RunOptions::default()
        };
        let plan = crate::engines::sbatch::plan(&project, &options).unwrap();
        let steps = batch_steps(&project, &plan, &options, Path::new("/bin/hvd")).unwrap();
        let here = std::env::current_dir().unwrap();
        let exec = |s: &BatchStep| {
            s.script
                .lines()
                .find(|l| l.starts_with("exec "))
                .map(str::to_owned)
        };
        let elastic = exec(&steps[0]).expect("the elastic step's launcher");
        assert_eq!(
            elastic,
            format!(
                "exec /bin/hvd run /p/train.hvd --step=elastic --no-deps --force --engine=slurm \
                 --env-dir=/envs/e1 --grace=2.5 --elastic-timeout=7 --blacklist-cooldown-range 5 9 -v -v \
                 --timeline={}/t.json --checkpoints=s3://b/ck",
                here.display()
            )
        );
        assert!(steps[0].supervised && steps[0].script.contains("#SBATCH --no-kill\n"));
        let restarted = exec(&steps[1]).expect("the restarted step's launcher");
        assert!(
            restarted.contains(" --step=restarted --no-deps "),
            "{restarted}"
        );
        assert!(steps[1].supervised && !steps[1].script.contains("--no-kill"));
        // Each attempt has the step's 10 minutes and the grace: the job's limit holds both, and a minute more.
        assert!(
            steps[1].script.contains("#SBATCH --time=22\n"),
            "{}",
            steps[1].script
        );
        assert!(!steps[2].supervised && exec(&steps[2]).is_none());
        assert!(
            steps[2].script.contains("srun --kill-on-bad-exit=1"),
            "{}",
            steps[2].script
        );
    }

    #[test]
    fn batch_scripts_carry_time_overcommit_env_and_a_multi_step_dependency() {
        let project = project(true);
        let options = RunOptions {
            env_dir: Some("/envs/e1".into()),
            ..RunOptions::default()
        };
        let plan = crate::engines::sbatch::plan(&project, &options).unwrap();
        let steps = batch_steps(&project, &plan, &options, Path::new("/bin/hvd")).unwrap();
        assert_eq!(steps.len(), 3);
        // 90 s rounds up to 2 minutes.
        assert!(
            steps[0].script.contains("#SBATCH --time=2\n"),
            "{}",
            steps[0].script
        );
        assert!(!steps[1].script.contains("--time"), "{}", steps[1].script);
        let train = &steps[2].script;
        assert!(train.contains("#SBATCH --overcommit\n"), "{train}");
        // Slurm refuses `--ntasks-per-node` beyond a node's CPUs even with `--overcommit`: the tasks in all.
        assert!(train.contains("#SBATCH --ntasks=3\n"), "{train}");
        assert!(!train.contains("--ntasks-per-node"), "{train}");
        assert!(
            train.contains("export PATH=/envs/e1/bin:\"$PATH\"\n"),
            "{train}"
        );
        assert!(train.contains("export VIRTUAL_ENV=/envs/e1\n"), "{train}");
        assert!(
            train.contains("/bin/hvd worker-env -- env \"HVD_RENDEZVOUS=file:$rdv\" /bin/sh -c 'echo train' || status=$?"),
            "{train}"
        );
        let submit = crate::engines::sbatch::submit_script(&plan, &steps);
        assert!(
            submit.contains("JOB_TRAIN=$(sbatch --parsable --kill-on-invalid-dep=yes --dependency=afterok:${JOB_A}:${JOB_B} <<'HVD_BATCH_SCRIPT_END'\n"),
            "{submit}"
        );
        // A value that is not a flag never reaches the engine: the settings' schema refuses it.
        let err = hvd_lang::model::EngineSettings::default()
            .set(
                "overcommit",
                hvd_lang::model::SettingValue::Str("sometimes"),
            )
            .unwrap_err();
        assert!(err.to_string().contains("`true` or `false`"), "{err}");
    }

    /// With caches, each job first gets the env onto every node of it (`hvd cache pull` into the env's store
    /// directory), then starts the ranks; without caches, or an env that is not a store path, it does not.
    #[test]
    fn batch_scripts_pull_the_env_onto_every_node_first_when_caches_are_given() {
        let dir = tempfile::tempdir().unwrap();
        let env = dir
            .path()
            .join("store/0123456789abcdef0123456789abcdef-t-env");
        let project = project(false);
        let scripts = |env: &Path, caches: &[&str]| {
            let options = RunOptions {
                env_dir: Some(env.to_path_buf()),
                caches: caches.iter().map(|c| (*c).to_owned()).collect(),
                trusted_keys: vec!["k1:AAAA".into()],
                ..RunOptions::default()
            };
            let plan = crate::engines::sbatch::plan(&project, &options).unwrap();
            batch_steps(&project, &plan, &options, Path::new("/bin/hvd"))
                .unwrap()
                .into_iter()
                .map(|s| s.script)
                .collect::<Vec<_>>()
        };
        let with = scripts(&env, &["s3://b/p", "file:///c d"]);
        let store = dir.path().join("store").display().to_string();
        for script in &with {
            let pull = script
                .lines()
                .find(|l| l.starts_with("srun --ntasks-per-node=1"))
                .unwrap_or_else(|| panic!("no pull in {script}"));
            assert!(
                pull.contains(&format!(
                    "/bin/hvd cache pull --store={store} 0123456789abcdef0123456789abcdef-t-env \
                     --cache=s3://b/p '\\''--cache=file:///c d'\\'' --trusted-key=k1:AAAA"
                )),
                "{pull}"
            );
            // Before the ranks, after the step's variables.
            let at = |part: &str| script.find(part).unwrap_or(usize::MAX);
            assert!(
                at("cache pull") < at("worker-env").min(at("/bin/sh -c 'echo")),
                "{script}"
            );
            // Each command starts through the shim's pull, which roots the env (against `hvd gc` on the node) until
            // the command has ended: a rank as a rank, a step without workers once.
            let shim_pull = format!(
                "--pull={} --cache=s3://b/p '--cache=file:///c d' --trusted-key=k1:AAAA -- ",
                env.display()
            );
            let command = script.lines().rev().find(|l| l.contains("echo ")).unwrap();
            let expected = match command.starts_with("srun --kill-on-bad-exit=1") {
                true => format!("/bin/hvd worker-env {shim_pull}env \"HVD_RENDEZVOUS=file:$rdv\""),
                false => format!("/bin/hvd worker-env --once {shim_pull}/bin/sh -c 'echo "),
            };
            assert!(command.contains(&expected), "{command}");
        }
        assert!(
            with[2].contains("srun --ntasks-per-node=1 --ntasks=1 "),
            "{}",
            with[2]
        );
        // A URL with credentials is refused, naming it without them: they would be in the script, the scheduler's
        // records and every node's process list.
        let options = RunOptions {
            env_dir: Some(env.clone()),
            caches: vec!["https://user:s3cr3t@cache.example/p".into()],
            ..RunOptions::default()
        };
        let plan = crate::engines::sbatch::plan(&project, &options).unwrap();
        let err = batch_steps(&project, &plan, &options, Path::new("/bin/hvd"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("`https://***@cache.example/p` carries credentials"),
            "{err}"
        );
        assert!(!err.contains("s3cr3t"), "{err}");
        for script in scripts(&env, &[])
            .iter()
            .chain(&scripts(Path::new("/envs/e1"), &["s3://b/p"]))
        {
            assert!(!script.contains("cache pull"), "{script}");
            assert!(!script.contains("--pull"), "{script}");
        }
    }

    /// A `run` with a line `EOF`, quotes and command substitutions: the printed submission hands every batch script
    /// to sbatch byte for byte (a fake `sbatch` on PATH keeps what it gets), and the script runs the exact command.
    #[test]
    fn a_run_line_eof_cannot_end_the_submission_heredoc() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let run = "cat <<'EOF'\nit's $(touch never-run) `touch never-either`\nEOF\necho \"after $(echo sub)\" 'q'\"'\"'q'";
        let mut project = project(false);
        project.file = d.join("train.hvd");
        project.steps = vec![hvd_lang::model::Step {
            env: BTreeMap::from([("X".to_string(), "a'b $(c)\nEOF".to_string())]),
            ..hvd_lang::model::Step::new("once", run)
        }];
        project.steps.push(hvd_lang::model::Step {
            name: "train".into(),
            needs: vec!["once".into()],
            workers: Some(2),
            min_workers: None,
            ..project.steps[0].clone()
        });
        let options = RunOptions::default();
        let plan = crate::engines::sbatch::plan(&project, &options).unwrap();
        let steps = batch_steps(&project, &plan, &options, Path::new("/bin/hvd")).unwrap();
        let submit = crate::engines::sbatch::submit_script(&plan, &steps);
        assert!(!submit.contains("<<'EOF'"), "{submit}");
        let bin = d.join("bin");
        std::fs::create_dir(&bin).unwrap();
        let sbatch = bin.join("sbatch");
        std::fs::write(
            &sbatch,
            "#!/bin/sh\nn=$(ls \"$JOBS\" | wc -l); n=$((n + 1)); cat > \"$JOBS/$n.sh\"; echo \"$n\"\n",
        )
        .unwrap();
        std::fs::set_permissions(&sbatch, std::fs::Permissions::from_mode(0o755)).unwrap();
        let jobs = d.join("jobs");
        std::fs::create_dir(&jobs).unwrap();
        succeeds(
            std::process::Command::new("bash")
                .arg("-c")
                .arg(&submit)
                .current_dir(d)
                .env("JOBS", &jobs)
                .env("PATH", format!("{}:/usr/bin:/bin", bin.display())),
        );
        for (i, step) in steps.iter().enumerate() {
            let got = std::fs::read_to_string(jobs.join(format!("{}.sh", i + 1))).unwrap();
            assert_eq!(got, step.script, "step `{}`", step.name);
        }
        assert_eq!(std::fs::read_dir(&jobs).unwrap().count(), 2);
        // The batch script of the step that runs once runs the command itself: exactly what `run` says.
        let out = succeeds(std::process::Command::new("bash").arg(jobs.join("1.sh")));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout),
            "it's $(touch never-run) `touch never-either`\nafter sub q'q\n"
        );
        for never in ["never-run", "never-either"] {
            assert!(!d.join(never).exists(), "{never} ran");
        }
        // A delimiter that is a line of the script is lengthened until it is not.
        let delimiter = crate::engines::sbatch::heredoc_delimiter("x\n");
        let text = format!("x\n{delimiter}\n");
        let other = crate::engines::sbatch::heredoc_delimiter(&text);
        assert!(!text.lines().any(|l| l == other), "{other}");
    }

    #[test]
    fn srun_line_has_kill_on_bad_exit_and_resources() {
        let setup = SlurmSetup {
            shim: "/bin/hvd".into(),
            cpus_per_task: Some(2),
            gpus_per_task: 1,
            allocation: None,
            plain: None,
            plain_layout: false,
        };
        assert_eq!(
            shell::line(&setup.srun_argv(4, "python t.py", &[])),
            "srun --kill-on-bad-exit=1 --ntasks=4 --label --cpus-per-task=2 --gpus-per-task=1 /bin/hvd worker-env -- \
             /bin/sh -c 'python t.py'"
        );
    }
}
