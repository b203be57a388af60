//! The engine interface. An engine is one of two kinds: a [`SupervisedEngine`] (local, ssh, mpi, srun, spark) says
//! where a distributed step's ranks run and which processes start them, and the local supervisor
//! (`supervisor.rs`) does the rest (rendezvous, logs, failures, stopping) for the [`Plan`] that carries it; a
//! [`WholeRunEngine`] (sbatch, kubectl) owns the whole run: it submits the steps and follows them to the end.
//! `run.rs` chooses one per run (the layers: `run` above `supervisor` and `engines`, which sit on this module).

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::PathBuf;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

use crate::LaunchError;
use crate::env::{RendezvousInfo, Slot, WorkerLayout, worker_env};
use crate::process::Interrupts;
use crate::report::{EventSink, RunReport};

/// Where elastic steps run (docs/running.md, Elastic steps).
pub(crate) const ELASTIC_ENGINES: &str =
    "run elastic steps on the local, ssh, spark, slurm or kubernetes engine";

/// An engine whose ranks the local supervisor starts and stops. Every method but [`SupervisedEngine::name`] has the
/// local engine's answer as its default; the supervisor asks only about distributed steps (a step that runs once
/// always runs here, with [`Local`]).
pub trait SupervisedEngine: std::fmt::Debug + Send + Sync {
    /// How `--dry-run` names it (`local engine`, `mpi engine`, ...).
    fn name(&self) -> &'static str;

    /// Where the ranks of a step on `workers` run (`None`: a step that runs once, one slot).
    fn layout(&self, workers: Option<u32>) -> WorkerLayout {
        WorkerLayout::local(&crate::env::local_hostname(), workers.unwrap_or(1))
    }

    /// Checks and files needed before the first step starts (ssh: every host has the project and the env; spark:
    /// the driver program).
    fn prepare(&self, _plan: &Plan) -> Result<(), LaunchError> {
        Ok(())
    }

    /// Called before `step` first starts (its restarts included), with its log directory: the engine may start what
    /// the step's ranks need (spark: an elastic step's relay server). [`SupervisedEngine::end_step`] follows once the
    /// step is over, however it ended. A wait in it asks `stopping` now and then (true once the run is interrupted
    /// or failed: give up waiting and return; no rank of the step starts then).
    fn begin_step(
        &self,
        _plan: &Plan,
        _step: &PlannedStep,
        _log_dir: &std::path::Path,
        _stopping: &dyn Fn() -> bool,
    ) -> Result<(), LaunchError> {
        Ok(())
    }

    /// Ends what [`SupervisedEngine::begin_step`] started for `step`; `interrupted`: the step ended because `hvd
    /// run` got SIGINT or SIGTERM (a launcher pod being evicted, whose replacement will run the step again).
    fn end_step(&self, _step: &PlannedStep, _interrupted: bool) {}

    /// Where a distributed step's rendezvous listens, and the peers its token-less endpoints answer.
    fn rendezvous(&self) -> (IpAddr, Vec<IpAddr>) {
        let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
        (loopback, vec![loopback])
    }

    /// Whether a rank 0 on any host the engine runs ranks on reaches the rendezvous at `HVD_RENDEZVOUS` (its address
    /// is the launcher's, not a loopback address on rank 0's own host): then it reports a resume there
    /// (`HVD_CHECKPOINT_REPORT_RENDEZVOUS`), else only in the file. Not under mpirun (127.0.0.1, ranks on any host).
    fn rank_zero_reaches_rendezvous(&self) -> bool {
        true
    }

    /// `Some(argv)`: a distributed step on `workers` is this one process (mpirun, srun, a Spark driver), which starts
    /// every rank itself and tags each output line with its rank; the supervisor runs it in place of the ranks (as
    /// rank 0). `None`: the supervisor starts each rank with [`SupervisedEngine::rank_command`].
    fn launcher(&self, _plan: &Plan, _step: &PlannedStep, _workers: u32) -> Option<Vec<String>> {
        None
    }

    /// How `--dry-run` labels the [`SupervisedEngine::launcher`] line (`mpirun:`, `srun:`, `spark:`).
    /// Variables an engine's launcher process (above) gets besides the worker contract: what must not be on its
    /// command line, which every local user can read (spark: its settings, `HVD_SPARK_CONF`). `shown`: for
    /// `--dry-run`, with what looks secret masked and nothing that says nothing.
    fn launcher_env(&self, _shown: bool) -> Vec<(String, String)> {
        Vec::new()
    }

    fn launcher_label(&self) -> &'static str {
        "launch:"
    }

    /// The command of one rank: by default `/bin/sh -c COMMAND` on this machine with the worker contract.
    fn rank_command(&self, rank: &RankStart<'_>) -> Result<RankCommand, LaunchError> {
        Ok(RankCommand::local(rank))
    }

    /// The lines `--dry-run` shows under a rank of a distributed step (ssh: its ssh command line, then what its stdin
    /// carries); none by default.
    fn dry_run_rank(&self, _plan: &Plan, _step: &PlannedStep, _slot: &Slot) -> Vec<String> {
        Vec::new()
    }

    /// Whether the engine starts an elastic step's new workers (replacements, and slots host discovery finds) on
    /// hosts of their own, by name, each made ready first with [`SupervisedEngine::reach_host`] (ssh; slurm inside an
    /// allocation, on its nodes); `false`: every worker runs on this machine, other hosts are ignored.
    fn remote_hosts(&self) -> bool {
        false
    }

    /// Whether an elastic step's lost workers count against their hosts (the blacklist, and a host held back a
    /// heartbeat timeout after a silent worker): not where the launcher's hosts are not where the ranks ran (spark:
    /// Spark places each rank).
    fn charges_hosts(&self) -> bool {
        true
    }

    /// Whether the engine starts replacements for an elastic step's lost workers (it starts each rank by itself):
    /// on hosts of their own ([`SupervisedEngine::remote_hosts`]), on this machine (local), or where the engine's
    /// cluster places them (spark: a new one-task job).
    fn replaces_workers(&self) -> bool {
        self.remote_hosts()
    }

    /// Makes `host` (named by host discovery, or where a replacement goes) ready for the ranks of `step` of `plan`
    /// (the checks and delivery the engine does for its own hosts before a run); blocking, called on a thread of its
    /// own unless [`SupervisedEngine::reaches_at_once`]. An error names the host and why.
    fn reach_host(
        &self,
        _plan: &Plan,
        _step: &PlannedStep,
        _host: &str,
    ) -> Result<(), LaunchError> {
        Ok(())
    }

    /// Whether [`SupervisedEngine::reach_host`] answers at once (a look-up, no connection): it is then called
    /// inline, not on a thread of its own.
    fn reaches_at_once(&self) -> bool {
        false
    }

    /// Whether the launcher reaches `host` now, asked when every worker of an elastic step went quiet at once: to
    /// tell the launcher cut off (its own network: nobody is judged) from workers all frozen on hosts it still reaches
    /// (each is judged on its own silence). `None`: the engine cannot look (the workers then wait until one is heard
    /// again); else whether a no-op ran there within `within`. Blocking, called on a thread of its own.
    fn probe_host(&self, _host: &str, _within: Duration) -> Option<bool> {
        None
    }

    /// How long the first host discovery of an elastic step waits for the step's minimum of slots, given the step's
    /// `--elastic-timeout`, and the flag that sets it (for the message when it runs out). An engine whose hosts take
    /// a while to come up waits longer (kubernetes: worker pods being scheduled, pulling their image).
    fn first_hosts_within(&self, elastic_timeout: Duration) -> (Duration, &'static str) {
        (elastic_timeout, "--elastic-timeout")
    }

    /// The host discovery of an elastic step that names no program of its own: the engine's (kubernetes in a
    /// launcher pod: `kubectl get pods` of the step's worker pods that run). `None`: without a program the step's
    /// hosts are its layout's.
    fn discovery(&self) -> Option<crate::discovery::Program> {
        None
    }

    /// Where an elastic step's lost workers are replaced without host discovery: hosts and how many live workers
    /// each may hold. `None`: the step's own layout (its ranks per host); slurm: the allocation's nodes and tasks.
    fn replacement_hosts(&self) -> Option<Vec<(String, u32)>> {
        None
    }
}

/// What the supervisor knows when it starts one rank (or an engine's launcher, as rank 0).
#[derive(Debug)]
pub struct RankStart<'a> {
    pub plan: &'a Plan,
    pub step: &'a PlannedStep,
    pub slot: &'a Slot,
    /// The step's rendezvous (`None` for a step that runs once).
    pub rendezvous: Option<&'a RendezvousInfo>,
    /// `MASTER_PORT` of the step (torch's rendezvous on rank 0's host).
    pub master_port: u16,
    /// The step marker ([`crate::env::STEP_MARKER_VAR`]) of this start.
    pub marker: &'a str,
}

/// A rank's process as an engine wants it started; the supervisor adds the working directory, the pipes, the step
/// marker and the process group.
#[derive(Debug)]
pub struct RankCommand {
    pub command: Command,
    /// A remote rank (ssh): its stdin carries the job token as the first line, and stopping it is writing the
    /// signal's name there ([`send_stop`]) rather than signalling the local process.
    pub remote: bool,
    /// What a remote rank's stdin carries after the job token: its variables, as its wrapper reads them
    /// ([`stdin_vars`](crate::engines::ssh::stdin_vars)), never on a command line. Empty for a local rank.
    pub after_token: String,
    /// The rank's process may exit 0 without the rank having finished (the slurm engine's srun after a node
    /// failure): its stdin's first line is a nonce, before the token, and its wrapper ends its stderr with
    /// `hvd-rank-status NONCE CODE`; an exit 0 without that report of 0 is a lost rank (`supervisor/reported.rs`).
    pub reports_status: bool,
}

impl RankCommand {
    /// `program args...` on this machine with the worker contract of `rank` (and `MASTER_PORT` for a distributed
    /// step).
    pub fn local_argv(rank: &RankStart<'_>, argv: &[String]) -> RankCommand {
        let mut command = Command::new(&argv[0]);
        command.args(&argv[1..]);
        command.envs(worker_env(
            &rank.step.env,
            rank.slot,
            rank.rendezvous,
            rank.plan.gpus_per_worker,
            rank.plan.env_dir.as_deref(),
        ));
        if rank.rendezvous.is_some() {
            command.env(crate::env_vars::MASTER_PORT, rank.master_port.to_string());
        }
        RankCommand {
            command,
            remote: false,
            after_token: String::new(),
            reports_status: false,
        }
    }

    /// `/bin/sh -c COMMAND` on this machine with the worker contract.
    /// `argv` (program first) as a remote rank ([`RankCommand::remote`]: stopped through its stdin) whose stdin
    /// carries `after_token` after the job token ([`RankCommand::after_token`]), reporting its status as
    /// [`RankCommand::reports_status`] says.
    pub fn remote_argv(argv: &[String], after_token: String, reports_status: bool) -> RankCommand {
        let mut command = Command::new(&argv[0]);
        command.args(&argv[1..]);
        RankCommand {
            command,
            remote: true,
            after_token,
            reports_status,
        }
    }

    pub fn local(rank: &RankStart<'_>) -> RankCommand {
        let argv = [
            "/bin/sh".to_owned(),
            "-c".to_owned(),
            rank.step.command.clone(),
        ];
        RankCommand::local_argv(rank, &argv)
    }
}

/// Tells a remote rank ([`RankCommand::remote`]) to stop: writes the signal's name (`TERM`, `INT`, `KILL`) as one line to its ssh's
/// stdin; the caller then closes it (end of file alone means TERM). Each line is one write, shorter than a pipe's
/// atomic size: the pipe does not block (`supervisor/keepalive.rs`), and a full one takes all of it or none of it.
pub fn send_stop(stdin: &mut impl std::io::Write, signal: i32) {
    let name = crate::process::signal_name(signal);
    let name = name.strip_prefix("SIG").unwrap_or(&name);
    let _ = stdin.write_all(format!("{name}\n").as_bytes());
    let _ = stdin.flush();
}

/// Asks a remote rank ([`RankCommand::remote`]) to hand over (an elastic worker removed at its next commit): writes
/// `PREEMPT TICKS` to its ssh's stdin; the host's wrapper sends SIGTERM to the rank's processes past its `/bin/sh -c`
/// leader and SIGKILL after `within` (TICKS tenths of a second), not after `--grace`.
pub fn send_preempt(stdin: &mut impl std::io::Write, within: std::time::Duration) {
    let ticks = (within.as_millis() / 100).clamp(1, u128::from(u32::MAX));
    let _ = stdin.write_all(format!("PREEMPT {ticks}\n").as_bytes());
    let _ = stdin.flush();
}

/// Tells a remote rank ([`RankCommand::remote`]) that the launcher is still there: writes `ALIVE` to its stdin, which
/// the host's wrapper skips; the stream to the rank then never looks idle to what closes idle streams on the way (the
/// kubelet's exec streams, load balancers, sshd's `ChannelTimeout`: `supervisor/keepalive.rs`).
pub fn send_alive(stdin: &mut impl std::io::Write) {
    let _ = stdin.write_all(b"ALIVE\n");
    let _ = stdin.flush();
}

/// The local engine: every rank is a process on this machine.
#[derive(Debug, Clone, Copy, Default)]
pub struct Local;

impl SupervisedEngine for Local {
    fn name(&self) -> &'static str {
        "local engine"
    }

    fn replaces_workers(&self) -> bool {
        true
    }

    /// The env's wheels run on this machine's glibc (a lock made on a machine with a newer one may pick wheels that
    /// do not).
    fn prepare(&self, plan: &Plan) -> Result<(), LaunchError> {
        let Some(env) = plan.env_dir.as_deref() else {
            return Ok(());
        };
        crate::closure::check_env_here(env, "this machine")
    }
}

/// An engine that owns the whole run (a batch system, a cluster's scheduler): it submits the steps and follows
/// them to their end, reporting the same [`crate::Event`]s and [`RunReport`] as the supervisor.
pub trait WholeRunEngine: Send + Sync {
    /// What the user should know before anything runs (e.g. what an export leaves out).
    fn notes(&self) -> Vec<String> {
        Vec::new()
    }

    /// What `--dry-run` prints: the submission, and the commands that would run.
    fn render(&self) -> String;

    /// Checks that the engine's tools are there, before anything is submitted.
    fn check(&self) -> Result<(), LaunchError>;

    /// Whether it runs elastic steps (sbatch: each under a launcher of its own in the step's job); one that does not
    /// is refused an elastic step before anything runs.
    fn runs_elastic_steps(&self) -> bool {
        false
    }

    /// Runs it to its end.
    fn run(&self, events: &dyn EventSink, interrupts: Interrupts)
    -> Result<RunReport, LaunchError>;
}

/// The engine of a run, as an engine module's `start` makes it.
pub enum Engine {
    Supervised(Arc<dyn SupervisedEngine>),
    Whole(Box<dyn WholeRunEngine>),
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
    /// How many times the step starts again after a rank fails (`--max-restarts`, else `restarts`, else 0).
    pub restarts: u32,
    /// `Some(min)`: an elastic step (`workers = { min, max }`, `--min-workers`): it starts `workers` and goes on
    /// while at least `min` are alive (docs/running.md, Elastic steps).
    pub min_workers: Option<u32>,
    /// An elastic step's settings (its flags over the file's `workers = { .. }`); the defaults for any other step.
    pub elastic: crate::options::ElasticSettings,
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
    /// Binary caches and trusted keys (`NAME:BASE64`) the nodes get the env from ([`crate::RunOptions::caches`]).
    pub caches: Vec<String>,
    pub trusted_keys: Vec<String>,
    /// The engine that runs the distributed steps (a step that runs once runs here, as with [`Local`]).
    pub engine: Arc<dyn SupervisedEngine>,
    /// What the user should know before anything runs (why the engine is not the one asked for).
    pub notes: Vec<String>,
}
