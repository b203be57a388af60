//! `hvd run`: plan the step graph and run it with an engine (docs/engines.md: local, mpi, ssh, slurm, spark,
//! kubernetes); `hvd worker-env`, the shim of engines that start the ranks themselves.

use std::collections::BTreeSet;
use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use hvd_lang::model::EngineKind;
use hvd_launcher::{Cause, Event, FailureSummary, Interrupts, RunOptions, Stream};

use crate::exit::{CommandResult, Failure, Status};

/// Writes one line to stderr, ignoring errors: a closed stderr (the reader went away) must not stop the run and
/// leave workers behind (`eprintln!` would panic).
macro_rules! note {
    ($($arg:tt)*) => {{
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

#[derive(Debug, Args)]
pub struct RunArgs {
    /// The .hvd file.
    #[arg(default_value = "train.hvd")]
    pub file: PathBuf,
    /// Run only this step and the steps it needs.
    #[arg(long, value_name = "NAME")]
    pub step: Option<String>,
    /// With `--step`: run that step alone, not the steps it needs (they ran before, and what they made is where the
    /// step reads it); it always runs, its inputs unchecked, and is not recorded for skipping.
    #[arg(long, requires = "step")]
    pub no_deps: bool,
    /// Number of workers for every distributed step (overrides `workers`). With the `spark` engine, `-N` runs N
    /// local processes on the driver instead (the local engine), as HorovodRunner's `np < 0` does.
    #[arg(long, short = 'n', value_name = "N", allow_negative_numbers = true)]
    pub workers: Option<i32>,
    /// Print the plan (steps, env, commands, worker layout) and run nothing.
    #[arg(long)]
    pub dry_run: bool,
    /// Rerun steps even when their inputs are unchanged.
    #[arg(long)]
    pub force: bool,
    /// Show only these ranks' output on the console, e.g. `0,1` (the per-rank log files keep everything).
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    pub ranks: Option<Vec<u32>>,
    /// Write the workers' timeline (Chrome trace) to FILE (sets `HVD_TIMELINE`).
    #[arg(long, value_name = "FILE")]
    pub timeline: Option<PathBuf>,
    /// Seconds between SIGTERM and SIGKILL when stopping workers (0 to 86400).
    #[arg(long, value_name = "SECONDS", default_value_t = 10.0)]
    pub grace: f64,
    /// Fail a distributed step when not all ranks joined the rendezvous within SECONDS, 1 to 86400 (off by default:
    /// plain scripts never join).
    #[arg(long, value_name = "SECONDS")]
    pub start_timeout: Option<f64>,
    /// Start a step again, up to N times, when one of its ranks fails (overrides every step's `restarts`; 0: the
    /// first failure ends the run).
    #[arg(long, value_name = "N")]
    pub max_restarts: Option<u32>,
    /// Make every distributed step elastic: it goes on while at least N of its workers are alive (overrides
    /// `workers = { min }`; docs/running.md, Elastic steps).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub min_workers: Option<u32>,
    /// The workers every distributed step starts with (as `--workers`, which it overrides; an elastic step's
    /// `max`).
    #[arg(long, value_name = "N")]
    pub max_workers: Option<u32>,
    /// Seconds a new round of an elastic step waits for its live workers to rejoin after a loss (from the first
    /// that rejoined; one that does not is left out and stopped), and an elastic step below its minimum waits for
    /// replacements or discovered slots before it fails (1 to 86400, default 60; overrides
    /// `workers = { elastic_timeout }`).
    #[arg(long, value_name = "SECONDS")]
    pub elastic_timeout: Option<f64>,
    /// An elastic step's hosts come from this program (Horovod's contract: it prints `host:slots` lines), run at the
    /// start and every second; new slots start new workers, which join at a commit, and workers on slots it no
    /// longer lists leave at their next commit (local and ssh engines; overrides `workers = { discovery }`).
    #[arg(long, value_name = "PROGRAM")]
    pub host_discovery_script: Option<PathBuf>,
    /// With host discovery: the program may print a host name alone (no `:slots`), which gets N slots
    /// (horovodrun's `--slots-per-host`; overrides `workers = { slots_per_host }`); a `host:slots` line keeps its own.
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub slots_per_host: Option<u32>,
    /// How long a host on which an elastic step lost 2 workers is blacklisted: MIN seconds the first time, doubled
    /// each time again, at most MAX, with a random part of up to a quarter that keeps it within MIN..MAX (1 to 3600;
    /// default 60 600; horovodrun's flag of the same name; overrides `workers = { cooldown }`).
    #[arg(long, num_args = 2, value_names = ["MIN", "MAX"])]
    pub blacklist_cooldown_range: Option<Vec<u64>>,
    /// Where the steps' workers keep `hvd.elastic` checkpoints (`state.checkpoint()`) and resume from: a directory
    /// or `s3://bucket/prefix`, with a subdirectory per step when the file has several (overrides the steps'
    /// `checkpoints`; docs/running.md, Checkpoints).
    #[arg(long, value_name = "DIR")]
    pub checkpoints: Option<PathBuf>,
    /// Run in this already-built environment directory (its `bin/` first on PATH) instead of building the env.
    #[arg(long, value_name = "DIR", conflicts_with = "no_build")]
    pub env_dir: Option<PathBuf>,
    /// Do not lock or build the env: run the steps with the current PATH.
    #[arg(long)]
    pub no_build: bool,
    /// Keep the run's state (step records, logs, manifests) in DIR instead of `.hvd/` next to the file (for a
    /// project directory that is read-only: a Kubernetes launcher pod reads the file from a ConfigMap).
    #[arg(long, value_name = "DIR")]
    pub state_dir: Option<PathBuf>,
    /// The engine for distributed steps: `local`, `mpi`, `ssh`, `slurm`, `spark` or `kubernetes` (overrides
    /// `cluster { engine }`; docs/engines.md).
    #[arg(long, value_name = "ENGINE")]
    pub engine: Option<EngineKind>,
    /// Which MPI the `mpi` engine uses: `openmpi` or `mpich` (default: detected from `mpirun --version`).
    #[arg(long, value_name = "FLAVOUR")]
    pub mpi: Option<String>,
    /// Hosts for the `ssh` and `mpi` engines, e.g. `h1:4,h2:4` (`host:slots`; overrides `cluster { hosts }`).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        conflicts_with = "hostfile"
    )]
    pub hosts: Option<Vec<String>>,
    /// A hostfile for the `ssh` and `mpi` engines: `host slots=N` lines.
    #[arg(long, value_name = "FILE")]
    pub hostfile: Option<PathBuf>,
    /// The mpirun program for the `mpi` engine (default: found on PATH).
    #[arg(long, value_name = "PROGRAM")]
    pub mpirun: Option<PathBuf>,
    #[command(flatten)]
    pub spark: Box<SparkArgs>,
    /// ssh port for the `ssh` engine (default: ssh's own, from its config).
    #[arg(long, value_name = "PORT")]
    pub ssh_port: Option<u16>,
    /// ssh identity (private key) file for the `ssh` engine.
    #[arg(long, value_name = "FILE")]
    pub ssh_identity: Option<PathBuf>,
    /// ssh config file for the `ssh` engine (`ssh -F FILE`).
    #[arg(long, value_name = "FILE")]
    pub ssh_config: Option<PathBuf>,
    /// Network interface the `ssh` engine's rendezvous binds and the workers use (NCCL_SOCKET_IFNAME,
    /// GLOO_SOCKET_IFNAME); default: the interface that reaches the first host here, and on each host the one that
    /// reaches this machine.
    #[arg(long, value_name = "IFACE")]
    pub network_interface: Option<String>,
    /// With the `ssh` engine: copy the env's store paths to hosts that lack them (tar over ssh) instead of failing.
    #[arg(long)]
    pub ssh_copy_env: bool,
    /// With `--engine slurm` outside an allocation: submit the batch jobs, print their ids and return without
    /// following them.
    #[arg(long)]
    pub detach: bool,
    #[command(flatten)]
    pub lock: super::build::LockMode,
    #[command(flatten)]
    pub caches: super::substitute::CacheOptions,
}

/// `hvd run` options of the `spark` engine (boxed: they are rarely given).
#[derive(Debug, Args)]
pub struct SparkArgs {
    /// The Spark master URL for the `spark` engine, e.g. `local-cluster[2,1,1024]`, `spark://host:7077`
    /// (default: `cluster { settings = { master } }`, else `local[N]`).
    #[arg(long, value_name = "URL")]
    pub spark_master: Option<String>,
    /// The Python (with pyspark) that runs the `spark` engine's driver and tasks (default: `settings.python`, else
    /// the env's Python when it has pyspark, else `python3` on PATH).
    #[arg(long, value_name = "PROGRAM")]
    pub spark_python: Option<PathBuf>,
}

/// `hvd worker-env -- CMD...` (hidden): the worker shim. Reads the rank from the variables of whoever started this
/// process (OpenMPI, MPICH, Slurm, an Indexed Kubernetes Job) and execs CMD with the worker contract set.
#[derive(Debug, Args)]
pub struct WorkerEnvArgs {
    /// Run CMD as a child and, when it fails, end this process with SIGKILL (after saying which rank failed with
    /// which code): MPICH's mpiexec ends the whole job only when a rank dies of a signal, not on an exit code.
    #[arg(long)]
    pub kill_on_failure: bool,
    /// Run CMD as a child and pass its output on one whole line per write, so that mpirun never tags half a line
    /// (the mpi engine sets it).
    #[arg(long)]
    pub whole_lines: bool,
    /// Before anything else, make this env (a store path) valid here from `--cache` (trusting `--trusted-key`),
    /// verified, as `hvd cache pull` does, and run CMD in it (`VIRTUAL_ENV`, its `bin` first on PATH): a pod whose
    /// image has only `hvd` and glibc (Kubernetes).
    #[arg(long, value_name = "ENV")]
    pub pull: Option<PathBuf>,
    /// A binary cache for `--pull` (repeatable).
    #[arg(long = "cache", value_name = "URL", requires = "pull")]
    pub caches: Vec<String>,
    /// A public key (`NAME:BASE64`) whose signatures `--pull` trusts (repeatable).
    #[arg(long = "trusted-key", value_name = "NAME:BASE64", requires = "pull")]
    pub trusted_keys: Vec<String>,
    /// A step that runs once: no rank variables, only `--pull`, then exec CMD. Without CMD, only the pull (an MPIJob
    /// worker's init container).
    #[arg(long)]
    pub once: bool,
    /// The store directory is this pod's own (an MPIJob worker's volume). With `--once` and no CMD (the init
    /// container): a failed pull writes its reason into the store directory (`.hvd-pull-failed`) and exits 0, so
    /// that the pod starts instead of holding the job forever. Otherwise (each rank's shim): such a note is refused
    /// with its reason before anything runs, which fails mpirun and so the job.
    #[arg(long, requires = "pull")]
    pub pull_failure_note: bool,
    /// The command and its arguments.
    #[arg(trailing_var_arg = true, required_unless_present = "once", num_args = 1.., value_name = "CMD")]
    pub command: Vec<std::ffi::OsString>,
}

pub fn worker_env(args: WorkerEnvArgs) -> CommandResult {
    use hvd_launcher::engines::shim;
    use std::os::unix::process::CommandExt as _;
    let env = |name: &str| std::env::var(name).ok();
    let usage = |e: &(dyn std::error::Error + 'static)| {
        Failure::from_error_in(Status::Usage, "hvd worker-env", e)
    };
    // The env first (a pod that starts from a bare image): before a rank serves or joins anything. Its temporary
    // root keeps it from `hvd gc` for as long as the worker (or anything that inherits the root's descriptor) runs.
    let init_container = args.once && args.command.is_empty();
    let note = args.pull_failure_note;
    let pulled = match &args.pull {
        // `--once --pull ENV` alone: the pull of an init container, whose worker starts in another one.
        Some(env_path) if init_container => {
            let pulled = pull_env(env_path, &args.caches, &args.trusted_keys, note)
                .and_then(|pulled| check_here(&pulled.env));
            return match pulled {
                Err(failure) if note => note_pull_failure(env_path, &failure),
                pulled => pulled.map(|()| Status::Success),
            };
        }
        Some(env_path) => {
            let pulled = match note {
                true => refuse_noted_failure(env_path),
                false => Ok(()),
            }
            .and_then(|()| pull_env(env_path, &args.caches, &args.trusted_keys, false));
            match pulled {
                Ok(pulled) => Some(pulled),
                // MPICH's mpiexec ends the job only when a rank dies of a signal.
                Err(failure) if args.kill_on_failure => {
                    note!("{:?}", failure.report);
                    shim::die_by_signal();
                    return Err(failure);
                }
                Err(failure) => return Err(failure),
            }
        }
        None => None,
    };
    if args.once {
        let Some((program, rest)) = args.command.split_first() else {
            return Err(Failure::usage(
                "hvd worker-env: give the command after `--`",
            ));
        };
        let mut command = std::process::Command::new(program);
        command.args(rest).envs(pulled_vars(&pulled));
        let err = command.exec();
        return Err(Failure::from_error_in(
            Status::Failure,
            format_args!(
                "hvd worker-env: failed to start `{}`",
                program.to_string_lossy()
            ),
            &err,
        ));
    }
    let (slot, _) = shim::slot_from_env(&env).map_err(|e| usage(&e))?;
    // On a node the launcher does not reach itself: the env's wheels must run on this node's glibc.
    let venv = args
        .pull
        .as_ref()
        .map(|p| p.display().to_string())
        .or_else(|| env("VIRTUAL_ENV"));
    if let Some(venv) = venv {
        check_here(std::path::Path::new(&venv))?;
    }
    // Rank 0 of a job without a launcher-side rendezvous (Kubernetes) serves it while its worker runs.
    let server = shim::serve_if_rank_zero(&env, &slot).map_err(|e| usage(&e))?;
    let rendezvous = shim::resolve_rendezvous(&env)
        .map_err(|e| Failure::from_error_in(Status::Failure, "hvd worker-env", &e))?;
    let get = |name: &str| match name {
        crate::env_vars::HVD_RENDEZVOUS => rendezvous.clone(),
        _ => env(name),
    };
    let vars = shim::shim_env(&get).map_err(|e| usage(&e))?;
    let Some((program, rest)) = args.command.split_first() else {
        return Err(Failure::usage(
            "hvd worker-env: give the command after `--`",
        ));
    };
    let rank = vars
        .iter()
        .rev()
        .find(|(k, _)| k == crate::env_vars::HVD_RANK)
        .map(|(_, v)| v.clone())
        .unwrap_or_default();
    let mut command = std::process::Command::new(program);
    command.args(rest).envs(vars).envs(pulled_vars(&pulled));
    let start_failed = |err: std::io::Error| {
        Failure::from_error_in(
            Status::Failure,
            format_args!(
                "hvd worker-env: failed to start `{}`",
                program.to_string_lossy()
            ),
            &err,
        )
    };
    // A serving rank 0, --kill-on-failure and --whole-lines keep the shim as the worker's parent; else it execs.
    if server.is_none() && !args.kill_on_failure && !args.whole_lines {
        return Err(start_failed(command.exec()));
    }
    if args.whole_lines {
        command
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped());
    }
    let mut child = shim::spawn_forwarding_signals(&mut command).map_err(start_failed)?;
    // The copies end when the worker and everything it started close the pipes; a background process that keeps
    // them open must not keep the shim (and mpirun) waiting, so after the worker's exit they get a second to finish.
    let (done, finished) = std::sync::mpsc::channel();
    let mut pumps = 0;
    let outputs: [(Option<Box<dyn std::io::Read + Send>>, i32); 2] = [
        (child.stdout.take().map(|o| Box::new(o) as _), 1),
        (child.stderr.take().map(|e| Box::new(e) as _), 2),
    ];
    for (from, fd) in outputs {
        if let Some(from) = from {
            let done = done.clone();
            pumps += 1;
            std::thread::spawn(move || {
                let _ = shim::copy_whole_lines(from, fd);
                let _ = done.send(());
            });
        }
    }
    let status = child.wait().map_err(start_failed)?;
    let deadline = std::time::Instant::now() + Duration::from_secs(1);
    for _ in 0..pumps {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if finished.recv_timeout(left).is_err() {
            break;
        }
    }
    if let Some(mut server) = server {
        server.shutdown();
    }
    if !status.success() && args.kill_on_failure {
        // One write: MPICH's -prepend-rank prefixes every chunk it reads.
        let line = format!("hvd worker-env: rank {rank} failed ({status}); ending the job\n");
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
        shim::die_by_signal();
    }
    use std::os::unix::process::ExitStatusExt as _;
    let code = status
        .code()
        .or_else(|| status.signal().map(|s| 128 + s))
        .unwrap_or(1);
    Ok(match u8::try_from(code) {
        Ok(0) => Status::Success,
        Ok(code) => Status::Worker(code),
        Err(_) => Status::Failure,
    })
}

/// An env `hvd worker-env --pull` made valid here: the variables that put the worker in it, and the temporary gc
/// root that keeps it (with its closure) from `hvd gc` while the worker runs.
struct PulledEnv {
    env: std::path::PathBuf,
    vars: Vec<(String, String)>,
    root: hvd_builder::gc::TempRoot,
}

/// The variables of `pulled` (none without a pull), after letting its root's descriptor survive `exec`: the worker,
/// and every child that inherits the descriptor, holds the root once this process is gone.
fn pulled_vars(pulled: &Option<PulledEnv>) -> Vec<(String, String)> {
    let Some(pulled) = pulled else {
        return Vec::new();
    };
    if let Err(err) = pulled.root.keep_across_exec() {
        // Still rooted while this process lives (a shim that stays the worker's parent); say what is lost.
        eprintln!("hvd worker-env: warning: {err}; the env is not rooted once this shim is gone");
    }
    pulled.vars.clone()
}

// The note `hvd worker-env --pull-failure-note` leaves in a pod's store directory when its init container could not
// get the env (the init container's shell guard writes one too when the pull dies without it).
use hvd_launcher::engines::k8s::PULL_FAILURE_NOTE;

/// The most of a note that is written or read (the tail of the pull's output is where its reason is).
const PULL_FAILURE_NOTE_MAX: usize = 8 * 1024;

/// An init container's failed pull (`failure`): its reason goes into `<store>/.hvd-pull-failed` (written whole, by
/// rename) for the ranks' shims to refuse, and the init container ends with success so that the pod starts (an
/// MPIJob's launcher is created only once every worker pod is ready; a pod stuck in its init container would hold
/// the other workers forever).
fn note_pull_failure(env: &std::path::Path, failure: &Failure) -> CommandResult {
    let reason: Vec<String> = failure.report.chain().map(|e| e.to_string()).collect();
    let reason = reason.join(": ");
    let reason = reason.strip_prefix("hvd worker-env: ").unwrap_or(&reason);
    note!("{:?}", failure.report);
    let store = env.parent().unwrap_or(std::path::Path::new("/"));
    let path = store.join(PULL_FAILURE_NOTE);
    let temporary = store.join(format!("{PULL_FAILURE_NOTE}.{}", std::process::id()));
    // An init container's pid is often the same on every start: a temporary file (or link) a killed one left is
    // removed, and the new one is created, never followed or overwritten.
    let written = std::fs::create_dir_all(store)
        .and_then(|()| match std::fs::remove_file(&temporary) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(err),
            _ => Ok(()),
        })
        .and_then(|()| {
            std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .open(&temporary)
        })
        .and_then(|mut file| file.write_all(cut_note(reason, PULL_FAILURE_NOTE_MAX).as_bytes()))
        .and_then(|()| std::fs::rename(&temporary, &path));
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    match written {
        Ok(()) => {
            note!(
                "hvd worker-env: the reason is in {}; this pod's ranks refuse to start with it, which ends the job",
                path.display()
            );
            Ok(Status::Success)
        }
        // No note, no refusal: fail as a plain pull does.
        Err(err) => Err(Failure::from_error_in(
            Status::Failure,
            format_args!("hvd worker-env: writing {}", path.display()),
            &err,
        )),
    }
}

/// A rank's shim in a pod whose init container could not get `env`: refused with the note's reason (hostile text:
/// its first [`PULL_FAILURE_NOTE_MAX`] bytes, control characters shown as `?`).
fn refuse_noted_failure(env: &std::path::Path) -> Result<(), Failure> {
    use hvd_launcher::untrusted::{Small, read_small};
    let path = env
        .parent()
        .unwrap_or(std::path::Path::new("/"))
        .join(PULL_FAILURE_NOTE);
    // Not through a link, not waiting on a FIFO, and only a regular file is read.
    let reason = match read_small(&path, PULL_FAILURE_NOTE_MAX as u64, true) {
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(err) if err.raw_os_error() == Some(libc::ELOOP) => {
            "the note is a symbolic link, not a file".to_owned()
        }
        Err(err) => format!("the note cannot be read: {err}"),
        Ok(Small::NotAFile) => "the note is not a file".to_owned(),
        Ok(Small::Read { bytes, .. }) => String::from_utf8_lossy(&bytes)
            .chars()
            .map(|c| match c {
                '\n' => c,
                c if c.is_control() => '?',
                c => c,
            })
            .collect::<String>()
            .trim()
            .to_owned(),
    };
    Err(Failure::new(
        Status::Failure,
        miette::miette!(
            "hvd worker-env: this pod's init container could not get the env {} (its note {}): {reason}; no rank \
             started, the job ends",
            env.display(),
            path.display()
        ),
    ))
}

/// `text` in at most `max` bytes: whole if it fits, else its first line (what failed, where: itself cut to half of
/// `max`) and the end of the rest (the pull's own last words), with a line saying that the middle was cut.
fn cut_note(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    const CUT: &str = "\n[...]\n";
    if text.len() <= max {
        return text.into();
    }
    let (head, rest) = text.split_once('\n').unwrap_or((text, ""));
    let mut end = head.len().min(max / 2);
    while !head.is_char_boundary(end) {
        end -= 1;
    }
    let head = &head[..end];
    format!(
        "{head}{CUT}{}",
        tail(rest, max.saturating_sub(head.len() + CUT.len()))
    )
    .into()
}

/// The last `max` bytes of `text` (at a character boundary).
fn tail(text: &str, max: usize) -> &str {
    let mut start = text.len().saturating_sub(max);
    while !text.is_char_boundary(start) {
        start += 1;
    }
    &text[start..]
}

/// Checks that the env's wheels and interpreter run on this node (glibc, host libraries).
fn check_here(env: &std::path::Path) -> Result<(), Failure> {
    let here = format!("node `{}`", hvd_launcher::env::local_hostname());
    hvd_launcher::closure::check_env_here(env, &here)
        .map_err(|e| Failure::from_error_in(Status::Failure, "hvd worker-env", &e))
}

/// `hvd worker-env --pull ENV`: runs `hvd cache pull` (this binary) for the env's store path into its own store
/// directory, with the given caches and keys, and roots it ([`PulledEnv`]). A node that cannot get it fails here,
/// naming itself and the env, before any rank runs. The store's builders lock (shared) is taken before the pull and
/// released only once the temporary root exists, so an `hvd gc` on this node (exclusive) runs before the pull or
/// after the root, never in between (where nothing roots the pulled paths).
/// `keep_reason`: the pull's own output (its reason) is also kept in the failure's message (for a note), and an
/// earlier note in the store directory is removed first (under the lock).
fn pull_env(
    env: &std::path::Path,
    caches: &[String],
    trusted_keys: &[String],
    keep_reason: bool,
) -> Result<PulledEnv, Failure> {
    // A pod's name (what `kubectl get pods` shows), else the kernel's.
    let node = std::env::var("HOSTNAME").unwrap_or_else(|_| hvd_launcher::env::local_hostname());
    let (Some(store_dir), Some(name)) = (
        env.parent().and_then(|s| s.to_str()),
        env.file_name().and_then(|n| n.to_str()),
    ) else {
        return Err(Failure::usage(format!(
            "hvd worker-env: `--pull {}` is not a store path (`<store>/<hash>-<name>-<version>`)",
            env.display()
        )));
    };
    if caches.is_empty() || trusted_keys.is_empty() {
        return Err(Failure::usage(
            "hvd worker-env: `--pull` needs `--cache URL` and `--trusted-key KEY` (nothing in a cache is trusted \
             without a key)",
        ));
    }
    let program = std::env::current_exe().map_err(|e| {
        Failure::from_error_in(Status::Failure, "hvd worker-env: this program's path", &e)
    })?;
    let argv = hvd_launcher::engines::pull_command(
        &program.to_string_lossy(),
        store_dir,
        name,
        caches,
        trusted_keys,
    )
    .map_err(|e| Failure::from_error(Status::Usage, &e))?;
    let store_failure = |e: &(dyn std::error::Error + 'static)| {
        Failure::from_error_in(
            Status::Failure,
            format_args!("hvd worker-env: node `{node}`: the store {store_dir}"),
            e,
        )
    };
    let store = hvd_builder::Store::open(store_dir).map_err(|e| store_failure(&e))?;
    let builders = store.lock_builders().map_err(|e| store_failure(&e))?;
    if keep_reason {
        // A note an earlier init container left in a reused store (a hostPath, a restarted pod) goes before this
        // pull: kept, it would refuse every later rank even once the env is here.
        let stale = std::path::Path::new(store_dir).join(PULL_FAILURE_NOTE);
        match std::fs::remove_file(&stale) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => {
                return Err(Failure::from_error_in(
                    Status::Failure,
                    format_args!(
                        "hvd worker-env: node `{node}`: removing the earlier note {}",
                        stale.display()
                    ),
                    &err,
                ));
            }
            _ => {}
        }
    }
    let mut pull = std::process::Command::new(&argv[0]);
    pull.args(&argv[1..])
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null());
    if keep_reason {
        pull.stderr(std::process::Stdio::piped());
    }
    let start_failed = |e: std::io::Error| {
        Failure::from_error_in(Status::Failure, "hvd worker-env: `hvd cache pull`", &e)
    };
    let mut child = pull.spawn().map_err(start_failed)?;
    // Its output still goes to stderr as it comes; a copy of it is kept.
    let output = child.stderr.take().map(|mut from| {
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            let mut buffer = [0u8; 8192];
            while let Ok(n @ 1..) = std::io::Read::read(&mut from, &mut buffer) {
                let _ = std::io::stderr().lock().write_all(&buffer[..n]);
                kept.extend_from_slice(&buffer[..n]);
                let over = kept.len().saturating_sub(PULL_FAILURE_NOTE_MAX);
                kept.drain(..over);
            }
            // The note is read inside another report: without the frame of this one.
            String::from_utf8_lossy(&kept)
                .lines()
                .map(|l| l.trim_start_matches([' ', '│']))
                .collect::<Vec<_>>()
                .join("\n")
        })
    });
    let status = child.wait().map_err(start_failed)?;
    let said = output.and_then(|t| t.join().ok()).unwrap_or_default();
    if !status.success() {
        let why = match said.trim() {
            "" => "`hvd cache pull` said why above".to_owned(),
            said => format!("`hvd cache pull` said:\n{said}"),
        };
        return Err(Failure::new(
            Status::Failure,
            miette::miette!(
                "hvd worker-env: node `{node}` could not get the env {name} from the caches ({}); no worker \
                 started. {why}",
                caches
                    .iter()
                    .map(|url| hvd_builder::cache::backend::redact(url))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    let root = hvd_builder::gc::TempRoot::create(&store, &[&store.root().join(name)])
        .map_err(|e| store_failure(&e))?;
    drop(builders);
    let path = std::env::var("PATH").unwrap_or_default();
    Ok(PulledEnv {
        env: env.to_path_buf(),
        vars: vec![
            ("VIRTUAL_ENV".to_owned(), env.display().to_string()),
            ("PATH".to_owned(), format!("{}/bin:{path}", env.display())),
        ],
        root,
    })
}

/// `--NAME SECONDS` within `low..=high` seconds; anything else (past the clock, NaN, negative) is a usage error naming
/// the flag, the value and the range, never a duration that panics where it is added to an `Instant`.
fn seconds_within(name: &str, value: f64, (low, high): (u64, u64)) -> Result<Duration, Failure> {
    hvd_collective::time::seconds_in(value, low as f64, high as f64).ok_or_else(|| {
        let day = if high == hvd_collective::time::DAY_SECONDS {
            " (a day)"
        } else {
            ""
        };
        Failure::usage(format!(
            "`--{name} {value}` is out of range: give from {low} to {high} seconds{day}"
        ))
    })
}

/// `--grace SECONDS`: from 0 (SIGKILL at once) to a day; longer is a typo, and the ssh and Slurm wrappers count it in
/// tenths of a second in shell arithmetic.
const GRACE_SECONDS: (u64, u64) = (0, hvd_collective::time::DAY_SECONDS);

/// `--start-timeout SECONDS`: from 1 s (shorter, no rank gets to the rendezvous) to a day (longer is a typo; the ssh
/// engine's host checks and copies get the same limit).
const START_TIMEOUT_SECONDS: (u64, u64) = (1, hvd_collective::time::DAY_SECONDS);

/// `--elastic-timeout SECONDS`: within [`ELASTIC_TIMEOUT_SECONDS`](hvd_env_vars::ELASTIC_TIMEOUT_SECONDS), the range
/// a file's `elastic_timeout` and the workers' `HVD_ELASTIC_TIMEOUT` take. Shorter, a new round would leave out every
/// worker but the first to rejoin; longer than a day is a typo (and past what the workers take).
fn elastic_timeout(value: f64) -> Result<Duration, Failure> {
    seconds_within(
        "elastic-timeout",
        value,
        hvd_env_vars::ELASTIC_TIMEOUT_SECONDS,
    )
}

/// `--checkpoints DIR`: a directory (made absolute against the current directory), `file:///abs/dir`, or
/// `s3://bucket/prefix` as it is. Any other URL is refused: an `http(s)://` cache is read-only, and a location a run
/// cannot write would have every run start over from the same checkpoint.
fn checkpoints_arg(dir: &std::path::Path) -> Result<PathBuf, Failure> {
    let text = dir.to_string_lossy();
    let refused = |why: &str| {
        Failure::usage(format!(
            "`--checkpoints {text}`: {why}; give a directory (shared storage on several hosts), `file:///abs/dir` or \
             `s3://bucket/prefix`"
        ))
    };
    match text.split_once("://") {
        Some(("s3", rest)) if rest.split('/').next().is_some_and(|b| !b.is_empty()) => {
            Ok(dir.to_path_buf())
        }
        Some(("s3", _)) => Err(refused("an `s3://` URL needs a bucket")),
        Some(("file", path)) if path.starts_with('/') => Ok(PathBuf::from(path)),
        Some(("file", _)) => Err(refused("a `file://` URL needs an absolute path")),
        Some((scheme, _))
            if !scheme.is_empty()
                && scheme
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.')) =>
        {
            Err(refused(
                "hvd cannot keep checkpoints at such a URL (an `http(s)://` cache is read-only: a run could not \
                 write its checkpoints there, and every run would start over from the same one; to start from a \
                 published checkpoint, download it into the checkpoint directory)",
            ))
        }
        _ => Ok(std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf())),
    }
}

/// `verbose`: how many times `-v` was given (passed on to a step's launcher elsewhere).
pub fn run(args: RunArgs, verbose: u8) -> CommandResult {
    // The env is built first (lock if needed, build, keep the `.hvd/env` root), unless told otherwise; a dry run
    // builds nothing.
    // `_temp_root` keeps the env alive against `hvd gc` until the run ends.
    let (project, env_dir, env_hash, _temp_root) =
        if args.env_dir.is_some() || args.no_build || args.dry_run {
            let project = hvd_lang::load_file(&args.file)
                .map_err(|d| Failure::new(Status::Usage, miette::Report::new(d)))?;
            (project, args.env_dir.clone(), None, None)
        } else {
            let ready = super::build::ensure_env_with(&args.file, args.lock, false, &args.caches)?;
            let env_hash = ready.lock.env_hash.clone();
            (
                ready.project,
                Some(ready.build.env),
                Some(env_hash),
                Some(ready.temp_root),
            )
        };
    let options = options(&args, &project, (env_dir, env_hash), verbose)?;
    // `prepare` chooses the engine (an MPI-only Horovod runs under mpirun, noted) or refuses a mismatch.
    let run = hvd_launcher::prepare(&project, &options).map_err(|e| not_prepared(&e))?;
    for text in run.notes() {
        note!("hvd: note: {text}");
    }
    if args.dry_run {
        print!("{}", run.render());
        if let hvd_launcher::Run::Supervised(plan) = &run
            && plan.env_dir.is_none()
            && !args.no_build
        {
            println!(
                "\n(the env is locked and built before the steps run; `--no-build` skips that)"
            );
        }
        return Ok(Status::Success);
    }
    run.check()
        .map_err(|e| Failure::from_error(Status::Usage, &e))?;
    let console = Console::new(args.ranks.clone().map(|r| r.into_iter().collect()));
    let interrupts = Interrupts::install();
    let report = run
        .execute(&options, &|event| console.show(event), interrupts)
        .map_err(|e| Failure::from_error(Status::Failure, &e))?;
    finish(report)
}

/// A run that could not be prepared: a usage error, but for a file that could not be written (an unwritable
/// `.hvd/`), which is a failure.
fn not_prepared(e: &hvd_launcher::LaunchError) -> Failure {
    let status = match e {
        hvd_launcher::LaunchError::Io { .. }
        | hvd_launcher::LaunchError::CreateDir { .. }
        | hvd_launcher::LaunchError::Write { .. } => Status::Failure,
        _ => Status::Usage,
    };
    Failure::from_error(status, e)
}

/// The launcher's options from the command line (and, for `--workers -N`, the engine the project names); `verbose`:
/// how many times `-v` was given.
fn options(
    args: &RunArgs,
    project: &hvd_lang::model::Project,
    (env_dir, env_hash): (Option<PathBuf>, Option<String>),
    verbose: u8,
) -> Result<RunOptions, Failure> {
    // `--workers -N` (HorovodRunner's `np < 0`): with the spark engine, N processes on this machine, the driver.
    let mut engine = args.engine;
    let workers = match args.workers {
        Some(n) if n < 0 => {
            let named = args
                .engine
                .or_else(|| project.cluster.as_ref().and_then(|c| c.engine));
            if named != Some(EngineKind::Spark) {
                return Err(Failure::usage(format!(
                    "`--workers {n}`: a negative number (N local processes on the driver) is for the spark engine; \
                     give a positive number"
                )));
            }
            note!(
                "hvd: --workers {n}: {} local processes on the driver (local engine) instead of Spark tasks",
                n.unsigned_abs()
            );
            engine = Some(EngineKind::Local);
            Some(n.unsigned_abs())
        }
        n => n.map(i32::unsigned_abs),
    };
    // What nodes pull the env from: the caches, only with trusted keys (without one nothing in a cache is trusted,
    // so a node's pull could only fail; the nodes then use the env where it is, as `hvd build` skips such caches).
    // Keys matter only with caches: a bad HVD_TRUSTED_KEYS without any cache stops nothing, as in `hvd build`.
    let mut caches = args.caches.urls(Some(project));
    let trusted_keys = if caches.is_empty() {
        Vec::new()
    } else {
        args.caches.trusted_key_texts()?
    };
    if trusted_keys.is_empty() {
        caches.clear();
    }
    Ok(RunOptions {
        step: args.step.clone(),
        no_deps: args.no_deps,
        workers,
        force: args.force,
        env_dir,
        env_hash,
        timeline: args.timeline.clone(),
        grace: seconds_within("grace", args.grace, GRACE_SECONDS)?,
        start_timeout: args
            .start_timeout
            .map(|s| seconds_within("start-timeout", s, START_TIMEOUT_SECONDS))
            .transpose()?,
        max_restarts: args.max_restarts,
        min_workers: args.min_workers,
        max_workers: args.max_workers,
        elastic_timeout: args.elastic_timeout.map(elastic_timeout).transpose()?,
        host_discovery_script: match &args.host_discovery_script {
            None => None,
            Some(script) => {
                let path = std::path::absolute(script).unwrap_or_else(|_| script.clone());
                if !path.is_file() {
                    return Err(Failure::usage(format!(
                        "`--host-discovery-script {}`: no such file (give the path of an executable that prints \
                         `host:slots` lines)",
                        script.display()
                    )));
                }
                Some(path)
            }
        },
        slots_per_host: match args.slots_per_host {
            // Names alone need a program that prints them: the flag's, or a step's in the file.
            Some(_)
                if args.host_discovery_script.is_none()
                    && project.steps.iter().all(|s| s.elastic.discovery.is_none()) =>
            {
                return Err(Failure::usage(
                    "`--slots-per-host` is for host discovery: give `--host-discovery-script PROGRAM` too, or \
                     `discovery` in an elastic step's `workers = { .. }`"
                        .to_owned(),
                ));
            }
            n => n,
        },
        blacklist_cooldown: match args.blacklist_cooldown_range.as_deref() {
            None => None,
            Some(&[min, max]) => Some(
                hvd_launcher::discovery::Cooldown::from_seconds(min, max)
                    .map_err(Failure::usage)?,
            ),
            Some(other) => {
                return Err(Failure::usage(format!(
                    "`--blacklist-cooldown-range` takes two numbers of seconds (MIN MAX), not {other:?}"
                )));
            }
        },
        checkpoints: match &args.checkpoints {
            Some(dir) if dir.as_os_str().is_empty() => {
                return Err(Failure::usage(
                    "`--checkpoints` needs a directory".to_owned(),
                ));
            }
            Some(dir) => Some(checkpoints_arg(dir)?),
            None => None,
        },
        state_dir: args
            .state_dir
            .as_ref()
            .map(|d| std::path::absolute(d).unwrap_or_else(|_| d.clone())),
        caches,
        trusted_keys,
        engine,
        mpi: args.mpi.clone(),
        mpirun: args.mpirun.clone(),
        shim: std::env::current_exe().ok(),
        spark: hvd_launcher::options::SparkOptions {
            master: args.spark.spark_master.clone(),
            python: args.spark.spark_python.clone(),
        },
        hosts: match &args.hostfile {
            Some(file) => {
                let text = std::fs::read_to_string(file).map_err(|e| {
                    Failure::from_error_in(
                        Status::Usage,
                        format_args!("failed to read `{}`", file.display()),
                        &e,
                    )
                })?;
                Some(
                    hvd_launcher::engines::parse_hostfile(&text)
                        .map_err(|e| Failure::from_error_in(Status::Usage, file.display(), &e))?,
                )
            }
            None => args.hosts.clone(),
        },
        ssh: hvd_launcher::options::SshOptions {
            port: args.ssh_port,
            identity: args.ssh_identity.clone(),
            config: args.ssh_config.clone(),
            network_interface: args.network_interface.clone(),
            copy_env: args.ssh_copy_env,
        },
        detach: args.detach,
        verbose,
    })
}

/// The outcome of a run, whatever engine ran it (the plan's engines, sbatch, kubectl).
fn finish(report: hvd_launcher::RunReport) -> CommandResult {
    if report.detached {
        return Ok(Status::Success);
    }
    for (step, slots) in &report.preempted {
        let ranks: Vec<String> = slots.iter().map(u32::to_string).collect();
        note!(
            "hvd: step `{step}`: rank {} preempted (SIGTERM): committed, handed over and left; not a failure",
            ranks.join(", ")
        );
    }
    match report.failure {
        None => {
            for (step, restarts) in &report.restarts {
                note!(
                    "hvd: step `{step}` succeeded after {}",
                    restarts_text(*restarts)
                );
            }
            note!(
                "hvd: done: {} step(s) ran, {} skipped; logs in {}",
                report.ran.len(),
                report.skipped.len(),
                report.log_dir.display()
            );
            Ok(Status::Success)
        }
        Some(failure) => {
            let mut text = summary(&failure);
            if let Some(restarts) = report.restarts.get(&failure.step) {
                text.push_str(&format!(
                    "\nstep `{}` failed on each of its {} attempts ({}); the first attempt's logs are in {}, \
                     restart n's under restart.<n>/ there",
                    failure.step,
                    restarts + 1,
                    restarts_text(*restarts),
                    report.log_dir.join(&failure.step).display()
                ));
            }
            Err(Failure::new(
                Status::Worker(failure.exit_code),
                miette::miette!("{text}"),
            ))
        }
    }
}

/// `1 restart`, `2 restarts`.
fn restarts_text(restarts: u32) -> String {
    match restarts {
        1 => "1 restart".to_owned(),
        n => format!("{n} restarts"),
    }
}

fn summary(failure: &FailureSummary) -> String {
    let mut out = match &failure.cause {
        Cause::Worker { rank, host, exit } => {
            format!(
                "step `{}` failed: rank {rank} on {host} ended first ({exit})",
                failure.step
            )
        }
        Cause::Timeout { after } => format!(
            "step `{}` ran past its timeout of {} s",
            failure.step,
            after.as_secs_f64()
        ),
        Cause::StartTimeout { missing, after } => format!(
            "step `{}`: ranks {missing:?} did not join the rendezvous within {} s",
            failure.step,
            after.as_secs_f64()
        ),
        Cause::Interrupted { signal } => {
            format!(
                "step `{}` interrupted ({})",
                failure.step,
                hvd_launcher::process::signal_name(*signal)
            )
        }
        Cause::BelowMinimum {
            rank,
            host,
            exit,
            left,
            min,
        } => format!(
            "step `{}` failed: {left} of its workers are left, fewer than its minimum of {min} (elastic); the last \
             one lost was rank {rank} on {host} ({exit})",
            failure.step
        ),
        Cause::StartCap { cap } => format!(
            "step `{}` failed: it tried to start {cap} new workers (replacements, discovered slots) in one attempt, \
             its cap (8 per slot of the step's maximum), and would try more: its workers are lost, or fail to start, \
             too often",
            failure.step
        ),
        Cause::Launcher { job, exit } => format!(
            "step `{}` failed: its launcher (`hvd run` in {job}) ended ({exit})",
            failure.step
        ),
    };
    // Whose stderr the tail is.
    let whose = match &failure.cause {
        Cause::Worker { rank, .. } | Cause::BelowMinimum { rank, .. } => {
            Some(format!("rank {rank}"))
        }
        _ => None,
    };
    if let Cause::Launcher { .. } = &failure.cause {
        // Where its report is, and how its job ended.
        for line in &failure.stderr_tail {
            out.push_str(&format!("\n{line}"));
        }
    }
    if let Some(whose) = whose {
        if failure.stderr_tail.is_empty() {
            out.push_str(&format!("\n({whose} wrote nothing to stderr)"));
        } else {
            out.push_str(&format!(
                "\nlast {} line(s) of {whose}'s stderr:",
                failure.stderr_tail.len()
            ));
            for line in &failure.stderr_tail {
                out.push_str(&format!("\n  | {line}"));
            }
        }
    }
    out.push_str(&format!("\nper-rank logs: {}", failure.log_dir.display()));
    out
}

/// Renders events: worker lines with a `[step host:rank]` prefix, coloured by rank on a terminal.
struct Console {
    ranks: Option<BTreeSet<u32>>,
    colour_out: bool,
    colour_err: bool,
}

impl Console {
    fn new(ranks: Option<BTreeSet<u32>>) -> Self {
        let colour = std::env::var_os(crate::env_vars::NO_COLOR).is_none();
        Console {
            ranks,
            colour_out: colour && std::io::stdout().is_terminal(),
            colour_err: colour && std::io::stderr().is_terminal(),
        }
    }

    fn show(&self, event: Event) {
        match event {
            Event::Line {
                step,
                host,
                rank,
                stream,
                text,
            } => {
                if self.ranks.as_ref().is_some_and(|r| !r.contains(&rank)) {
                    return;
                }
                let colour = match stream {
                    Stream::Stdout => self.colour_out,
                    Stream::Stderr => self.colour_err,
                };
                let prefix = if colour {
                    // Six readable ANSI colours, cycling by rank.
                    let code = 31 + (rank % 6);
                    format!("\x1b[{code}m[{step} {host}:{rank}]\x1b[0m")
                } else {
                    format!("[{step} {host}:{rank}]")
                };
                // A closed stdout (`| head`) must not kill the run; ignore write errors.
                match stream {
                    Stream::Stdout => {
                        let _ = writeln!(std::io::stdout().lock(), "{prefix} {text}");
                    }
                    Stream::Stderr => {
                        let _ = writeln!(std::io::stderr().lock(), "{prefix} {text}");
                    }
                }
            }
            Event::StepStarted {
                step,
                workers,
                rendezvous,
            } => match (workers, rendezvous) {
                (Some(n), Some(addr)) => {
                    note!("hvd: step `{step}` on {n} worker(s), rendezvous {addr}")
                }
                _ => note!("hvd: step `{step}`"),
            },
            Event::StepSkipped { step } => {
                note!("hvd: step `{step}` skipped: inputs unchanged (--force reruns it)")
            }
            Event::StepFinished { step, elapsed } => {
                note!("hvd: step `{step}` done in {:.1} s", elapsed.as_secs_f64());
            }
            Event::Stopping { reason } => note!("hvd: {reason}"),
            Event::Note { text } => note!("hvd: {text}"),
            Event::Detached {
                job_ids,
                output_dir,
            } => {
                let _ = writeln!(std::io::stdout().lock(), "{}", job_ids.join(" "));
                note!(
                    "hvd: not following; output goes to {} (`squeue -j {}`)",
                    output_dir.display(),
                    job_ids.join(",")
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A note over the limit keeps its first line (what failed, on which node) and the end of the pull's output.
    #[test]
    fn a_long_note_keeps_its_first_line_and_the_end() {
        let head = "node `app-train-worker-1` could not get the env x from the caches";
        let text = format!("{head}\n{}\nthe last word", "é middle\n".repeat(2000));
        let cut = cut_note(&text, PULL_FAILURE_NOTE_MAX);
        assert!(cut.len() <= PULL_FAILURE_NOTE_MAX, "{}", cut.len());
        assert!(cut.starts_with(&format!("{head}\n[...]\n")), "{cut}");
        assert!(cut.ends_with("é middle\n\nthe last word"), "{cut}");
        assert_eq!(cut_note("short\nnote", 10), "short\nnote");
        // One line over the limit: its first half, then its end.
        let line = "ab".repeat(PULL_FAILURE_NOTE_MAX);
        let cut = cut_note(&line, PULL_FAILURE_NOTE_MAX);
        assert!(cut.len() <= PULL_FAILURE_NOTE_MAX, "{}", cut.len());
        assert!(cut.starts_with(&line[..PULL_FAILURE_NOTE_MAX / 2]), "{cut}");
    }
}
