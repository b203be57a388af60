//! The slurm engine outside an allocation: every step of the plan is one batch job ([`slurm::batch_steps`]),
//! submitted held with `sbatch --parsable --hold` and released once an earlier job's files with its id are out of its
//! way (`make_way`), chained with `--dependency=afterok:ID[:ID...]` (and
//! `--kill-on-invalid-dep=yes`, so Slurm itself ends the dependents of a failed job when nobody follows them).
//! [`follow`] then polls `scontrol -o show job ID` (no accounting needed), tails each job's output files as they grow
//! (srun's `--label` gives the rank of each line), and when a job fails cancels every other unfinished job
//! (`scancel`), so nothing is left pending with `DependencyNeverSatisfied`. The failing rank's own exit code is read
//! from srun's message (`task R: Exited with exit code N`): srun itself exits 143 when it ended the other tasks.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::io::Write as _;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine::{Engine, Local, Plan, WholeRunEngine};
use crate::engines::slurm::{self, BatchStep};
use crate::options::RunOptions;
use crate::report::{Cause, Event, EventSink, FailureSummary, RunReport, Stream};
use crate::report::{STDERR_TAIL_LINES, TIMEOUT_EXIT_CODE, WorkerExit};
use crate::{Interrupts, LaunchError, state};

mod tail;
use tail::Tail;

/// How often job states and output files are looked at.
const POLL: Duration = Duration::from_millis(250);
/// Failed `scontrol` calls in a row (about 30 s of polls) before hvd gives up following the jobs.
const QUERY_RETRIES: u32 = 120;

/// A submitted step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SubmittedJob {
    pub step: String,
    pub job_id: String,
    /// The job ids it depends on (`afterok`).
    pub after: Vec<String>,
}

/// What [`submit`] did.
#[derive(Debug, Clone, Default)]
pub struct Submission {
    pub jobs: Vec<SubmittedJob>,
    /// Steps not submitted because their inputs are unchanged since their last success (see docs/running.md).
    pub skipped: Vec<String>,
    /// Output hashes of the skipped steps (the upstream of steps that run).
    skipped_outputs: BTreeMap<String, String>,
    /// Files an earlier job with a new job's id left (Slurm numbered its jobs from 1 again), and where they went.
    pub moved: Vec<(PathBuf, PathBuf)>,
}

fn run_tool(command: &mut Command, what: &str) -> Result<std::process::Output, LaunchError> {
    command.output().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            LaunchError::Engine(format!(
                "`{what}` is not on PATH: the slurm engine outside an allocation needs Slurm's client commands \
                 (sbatch, scontrol, scancel; Debian/Ubuntu package `slurm-client`) configured for the cluster"
            ))
        } else {
            LaunchError::Engine(format!("failed to run `{what}`: {e}"))
        }
    })
}

/// The plan the batch jobs are written from: steps, order and variables as the local engine would run them.
pub fn plan(project: &hvd_lang::model::Project, options: &RunOptions) -> Result<Plan, LaunchError> {
    crate::graph::plan(project, options, Arc::new(Local))
}

/// The slurm engine outside an allocation: the batch jobs of every step, submitted and followed.
pub struct Sbatch {
    plan: Plan,
    steps: Vec<BatchStep>,
    options: RunOptions,
}

/// Writes the batch scripts of `project` (submitted when the run starts).
pub fn start(
    project: &hvd_lang::model::Project,
    options: &RunOptions,
) -> Result<Engine, LaunchError> {
    let shim = options.shim.clone().unwrap_or_else(|| PathBuf::from("hvd"));
    let plan = plan(project, options)?;
    if let Some(step) = plan
        .steps
        .iter()
        .find(|s| s.min_workers.is_some() && s.elastic.discovery.is_some())
    {
        return Err(LaunchError::Engine(format!(
            "step `{}` is elastic with host discovery, which the slurm engine does not run: an elastic step's hosts \
             are its job's nodes, where lost workers are replaced without it; leave `--host-discovery-script` (or \
             `discovery`) out, or run the step on the local or ssh engine",
            step.name
        )));
    }
    let steps = slurm::batch_steps(project, &plan, options, &shim)?;
    Ok(Engine::Whole(Box::new(Sbatch {
        plan,
        steps,
        options: options.clone(),
    })))
}

impl WholeRunEngine for Sbatch {
    fn render(&self) -> String {
        submit_script(&self.plan, &self.steps)
    }

    fn check(&self) -> Result<(), LaunchError> {
        check_tools()
    }

    fn runs_elastic_steps(&self) -> bool {
        true
    }

    /// Submits every step; with `--detach` returns then (the jobs run on without hvd), else follows them.
    fn run(
        &self,
        events: &dyn EventSink,
        interrupts: Interrupts,
    ) -> Result<RunReport, LaunchError> {
        let submission = submit(&self.plan, &self.steps, &self.options)?;
        for (file, to) in &submission.moved {
            events.event(Event::Note {
                text: format!(
                    "{} was an earlier job's (Slurm numbers its jobs from 1 again): moved to {}",
                    file.display(),
                    to.display()
                ),
            });
        }
        for job in &submission.jobs {
            let after = if job.after.is_empty() {
                String::new()
            } else {
                format!(" (after {})", job.after.join(", "))
            };
            events.event(Event::Note {
                text: format!(
                    "step `{}` submitted as slurm job {}{after}",
                    job.step, job.job_id
                ),
            });
        }
        if !self.options.detach {
            return follow(
                &self.plan,
                &self.steps,
                &submission,
                &self.options,
                events,
                interrupts,
            );
        }
        for step in &submission.skipped {
            events.event(Event::StepSkipped { step: step.clone() });
        }
        events.event(Event::Detached {
            job_ids: submission.jobs.iter().map(|j| j.job_id.clone()).collect(),
            output_dir: slurm::output_dir(&self.plan),
        });
        Ok(RunReport {
            ran: submission.jobs.iter().map(|j| j.step.clone()).collect(),
            skipped: submission.skipped.clone(),
            detached: true,
            ..RunReport::new(String::new(), slurm::output_dir(&self.plan))
        })
    }
}

/// Checks that Slurm's client commands are on PATH; the error says what to install.
pub fn check_tools() -> Result<(), LaunchError> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    let missing: Vec<&str> = ["sbatch", "scontrol", "scancel"]
        .into_iter()
        .filter(|tool| !std::env::split_paths(&path).any(|dir| dir.join(tool).is_file()))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(LaunchError::Engine(format!(
        "{} not on PATH: the slurm engine outside an allocation submits batch jobs with Slurm's client commands \
         (sbatch, scontrol, scancel; Debian/Ubuntu package `slurm-client`, configured for the cluster); \
         `--dry-run` prints the submission without them",
        missing.join(", ")
    )))
}

/// Reads the job id from `sbatch --parsable` output (`ID` or `ID;CLUSTER`).
pub fn parse_job_id(stdout: &str) -> Option<String> {
    let id = stdout.trim().split(';').next()?.trim();
    (!id.is_empty() && id.bytes().all(|b| b.is_ascii_digit())).then(|| id.to_owned())
}

/// The scripts a dry run prints: a shell script that submits every step with the sbatch flags hvd uses, less
/// `--hold` (hvd holds each job until an earlier job's files with its id are out of the way, then releases it).
pub fn submit_script(plan: &Plan, steps: &[BatchStep]) -> String {
    let var = |step: &str| {
        format!(
            "JOB_{}",
            step.to_ascii_uppercase()
                .replace(|c: char| !c.is_ascii_alphanumeric(), "_")
        )
    };
    let mut out = String::from("#!/bin/sh\n");
    out.push_str(
        "# hvd: slurm engine outside an allocation: `hvd run` submits these batch scripts and follows them; \
         `sh` this to submit them by hand\nset -e\n",
    );
    out.push_str(&format!(
        "mkdir -p {}\n",
        crate::engines::shell::quote(&slurm::output_dir(plan).display().to_string())
    ));
    for step in steps {
        let dependency = if step.needs.is_empty() {
            String::new()
        } else {
            format!(
                " --dependency=afterok:{}",
                step.needs
                    .iter()
                    .map(|n| format!("${{{}}}", var(n)))
                    .collect::<Vec<_>>()
                    .join(":")
            )
        };
        // The script is a quoted here-document (`<<'D'`: nothing in it is expanded) whose delimiter is not a line of
        // the script, whatever the step's `run` says: a fixed `EOF` would end it early at a `run` line `EOF`, and the
        // rest would run in the submitting shell.
        let delimiter = heredoc_delimiter(&step.script);
        let script = &step.script;
        let newline = if script.ends_with('\n') { "" } else { "\n" };
        out.push_str(&format!(
            "\n{}=$(sbatch --parsable --kill-on-invalid-dep=yes{dependency} <<'{delimiter}'\n{script}{newline}\
             {delimiter}\n)\n",
            var(&step.name),
        ));
    }
    out
}

/// A here-document delimiter for `text`: `HVD_BATCH_SCRIPT_END`, lengthened (`_`) until no line of `text` equals
/// it, so that the document always ends exactly at the end of `text`. (Not derived from the text's hash: the printed
/// submission stays the same for the same steps wherever the project lies.)
pub fn heredoc_delimiter(text: &str) -> String {
    let mut delimiter = String::from("HVD_BATCH_SCRIPT_END");
    while text.lines().any(|line| line == delimiter) {
        delimiter.push('_');
    }
    delimiter
}

/// Submits every step in plan order, each after the jobs of the steps it needs. Steps whose inputs are unchanged
/// (as with the local engine) are not submitted, unless `options.force`; a step that needs a skipped step does not
/// wait for it. When a submission fails, the jobs already submitted are cancelled.
pub fn submit(
    plan: &Plan,
    steps: &[BatchStep],
    options: &RunOptions,
) -> Result<Submission, LaunchError> {
    private_output_dir(plan)?;
    let mut submission = Submission::default();
    let mut ids: BTreeMap<&str, String> = BTreeMap::new();
    for step in steps {
        let planned = plan.steps.iter().find(|s| s.name == step.name);
        // Only a step whose upstream is known (all skipped, or none) can be checked before anything runs.
        if let Some(planned) = planned
            && !options.force
            && !options.no_deps
            && (!planned.inputs.is_empty() || !planned.outputs.is_empty())
            && step
                .needs
                .iter()
                .all(|n| submission.skipped_outputs.contains_key(n))
            && let Some(outputs_hash) =
                unchanged(plan, options, planned, &submission.skipped_outputs)
        {
            submission.skipped.push(step.name.clone());
            submission
                .skipped_outputs
                .insert(step.name.clone(), outputs_hash);
            continue;
        }
        let after: Vec<String> = step
            .needs
            .iter()
            .filter_map(|n| ids.get(n.as_str()).cloned())
            .collect();
        // Held until an earlier job's output files with its id are out of the way (see `make_way`).
        let mut command = Command::new("sbatch");
        command
            .arg("--parsable")
            .arg("--hold")
            .arg("--kill-on-invalid-dep=yes")
            .current_dir(&plan.project_dir);
        if !after.is_empty() {
            command.arg(format!("--dependency=afterok:{}", after.join(":")));
        }
        let result = sbatch(&mut command, &step.script).and_then(|out| {
            parse_job_id(&out).ok_or_else(|| {
                LaunchError::Engine(format!(
                    "`sbatch --parsable` for step `{}` printed `{}`, not a job id",
                    step.name,
                    out.trim()
                ))
            })
        });
        let result = result.and_then(|id| {
            let released = make_way(plan, &step.name, &id).and_then(|moved| match release(&id) {
                Ok(()) => Ok(moved),
                Err(e) => Err(with_moved(e, &moved)),
            });
            match released {
                Ok(moved) => {
                    submission.moved.extend(moved);
                    Ok(id)
                }
                Err(e) => {
                    cancel([id.as_str()]);
                    Err(e)
                }
            }
        });
        match result {
            Ok(id) => {
                ids.insert(&step.name, id.clone());
                submission.jobs.push(SubmittedJob {
                    step: step.name.clone(),
                    job_id: id,
                    after,
                });
            }
            Err(e) => {
                cancel(submission.jobs.iter().map(|j| j.job_id.as_str()));
                return Err(match e {
                    LaunchError::Engine(msg) => {
                        LaunchError::Engine(format!("submitting step `{}`: {msg}", step.name))
                    }
                    other => other,
                });
            }
        }
    }
    Ok(submission)
}

/// Creates the jobs' output directory (`.hvd/slurm`, mode 0700) and makes it private ([`make_private`]): the jobs'
/// output files and file rendezvous (keys) are there.
fn private_output_dir(plan: &Plan) -> Result<(), LaunchError> {
    use std::os::unix::fs::DirBuilderExt as _;
    let dir = slurm::output_dir(plan);
    let create = || std::fs::DirBuilder::new().mode(0o700).create(&dir);
    let mut made = create();
    // The run dir above it is made only where it is missing: one that is a file is named as the cause below.
    if made
        .as_ref()
        .is_err_and(|e| e.kind() == std::io::ErrorKind::NotFound)
    {
        let parent = dir.parent().unwrap_or(&plan.state_dir);
        fs_err::create_dir_all(parent).map_err(|source| LaunchError::Io {
            path: parent.to_owned(),
            source,
        })?;
        made = create();
    }
    let created = match made {
        Ok(()) => true,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => false,
        Err(source) => return Err(LaunchError::Io { path: dir, source }),
    };
    make_private(&dir, created)
}

/// `dir` (hvd's own `.hvd/slurm`; `created`: this run just created it) when it is the user's: writable by group or
/// others, it is set to 0700. Another user's is refused, naming the owner and what to do: one hvd just created that
/// belongs to another user means its file system maps this user to another (an NFS export's root_squash).
fn make_private(dir: &std::path::Path, created: bool) -> Result<(), LaunchError> {
    use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
    let m = std::fs::metadata(dir).map_err(|source| LaunchError::Io {
        path: dir.to_owned(),
        source,
    })?;
    // SAFETY: geteuid has no preconditions.
    if m.uid() == unsafe { libc::geteuid() } && m.mode() & 0o022 != 0 {
        std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(
            |source| LaunchError::Io {
                path: dir.to_owned(),
                source,
            },
        )?;
    }
    let not_yours = if created {
        "hvd has just created it, so its file system gives this user's new files to another user (an NFS export \
         with root_squash maps root to nobody): keep the project on a local file system"
    } else {
        "remove it (or the project's `.hvd`) so that hvd creates it as yours; if it then belongs to another user \
         again, its file system maps this user to another (an NFS export with root_squash maps root to nobody): \
         keep the project on a local file system"
    };
    crate::untrusted::check_private_dir(
        dir,
        "the jobs' output files or their rendezvous keys",
        not_yours,
    )
    .map_err(|e| LaunchError::Engine(format!("the slurm engine's output directory: {e}")))
}

/// The output file (`ext`: `out`, `err`) of job `id` of `step`, as its script names it (`--output`/`--error`).
pub fn output_file(plan: &Plan, step: &str, id: &str, ext: &str) -> PathBuf {
    let project = crate::engines::k8s::dns_label(&plan.project);
    slurm::output_dir(plan).join(format!("{project}-{step}-{id}.{ext}"))
}

/// Moves the output files an earlier job with the id `id` left (a Slurm that numbers its jobs from 1 again: a new
/// cluster, or its state cleared) to `NAME.stale-<run id>`, before the held job `id` can start, so that following it
/// never reads the earlier job's lines; returns what it moved where. The job's file rendezvous directory
/// (`rdv-<id>`), if an earlier job left one, is removed: it holds an earlier job's keys. An error after a file was
/// moved says where it went ([`with_moved`]).
fn make_way(plan: &Plan, step: &str, id: &str) -> Result<Vec<(PathBuf, PathBuf)>, LaunchError> {
    let mut moved = Vec::new();
    match clear_way(plan, step, id, &mut moved) {
        Ok(()) => Ok(moved),
        Err(e) => Err(with_moved(e, &moved)),
    }
}

/// `e`, and where the files already moved aside went (they stay there), when any were; the error's causes are kept
/// in the message.
fn with_moved(e: LaunchError, moved: &[(PathBuf, PathBuf)]) -> LaunchError {
    if moved.is_empty() {
        return e;
    }
    let mut text = match e {
        LaunchError::Engine(msg) => msg,
        other => {
            let mut text = other.to_string();
            let mut cause = std::error::Error::source(&other);
            while let Some(c) = cause {
                text.push_str(&format!(": {c}"));
                cause = c.source();
            }
            text
        }
    };
    let went: Vec<String> = moved
        .iter()
        .map(|(file, to)| format!("{} to {}", file.display(), to.display()))
        .collect();
    text.push_str(&format!(
        "; an earlier job's output files were moved aside first: {}",
        went.join(", ")
    ));
    LaunchError::Engine(text)
}

/// [`make_way`]'s work; `moved` gets each file as it is moved.
fn clear_way(
    plan: &Plan,
    step: &str,
    id: &str,
    moved: &mut Vec<(PathBuf, PathBuf)>,
) -> Result<(), LaunchError> {
    let stale = crate::report::new_run_id();
    for ext in ["out", "err"] {
        let file = output_file(plan, step, id, ext);
        match std::fs::symlink_metadata(&file) {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
            Err(source) => return Err(LaunchError::Io { path: file, source }),
        }
        let mut to = file.clone().into_os_string();
        to.push(format!(".stale-{stale}"));
        let to = PathBuf::from(to);
        fs_err::rename(&file, &to).map_err(|source| LaunchError::Io {
            path: file.clone(),
            source,
        })?;
        moved.push((file, to));
    }
    let rdv = slurm::output_dir(plan).join(format!("rdv-{id}"));
    // Whatever is there goes, a link or a file as itself (never followed: the job's rendezvous would follow it).
    let removed = match std::fs::symlink_metadata(&rdv) {
        Ok(m) if m.is_dir() => std::fs::remove_dir_all(&rdv),
        Ok(_) => std::fs::remove_file(&rdv),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(e) => Err(e),
    };
    removed.map_err(|source| LaunchError::Io { path: rdv, source })
}

/// Releases held job `id` (`scontrol release`).
fn release(id: &str) -> Result<(), LaunchError> {
    let out = Command::new("scontrol")
        .args(["release", id])
        .stdin(Stdio::null())
        .output()
        .map_err(|e| LaunchError::Engine(format!("cannot run `scontrol release {id}`: {e}")))?;
    if !out.status.success() {
        return Err(LaunchError::Engine(format!(
            "`scontrol release {id}` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(())
}

/// `Some(outputs hash)` when the step's last success had the same input hash and its outputs are unchanged.
fn unchanged(
    plan: &Plan,
    options: &RunOptions,
    step: &crate::PlannedStep,
    upstream: &BTreeMap<String, String>,
) -> Option<String> {
    let input_hash = state::input_hash(
        step,
        &plan.project_dir,
        options.env_hash.as_deref(),
        upstream,
    )
    .ok()?;
    let record = state::load(&plan.state_dir, &step.name)?;
    if record.input_hash != input_hash
        || !step
            .outputs
            .iter()
            .all(|o| plan.project_dir.join(o).exists())
    {
        return None;
    }
    let outputs_hash = state::hash_paths(&plan.project_dir, &step.outputs).ok()?;
    (outputs_hash == record.outputs_hash).then_some(outputs_hash)
}

fn sbatch(command: &mut Command, script: &str) -> Result<String, LaunchError> {
    command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = command.spawn().map_err(|e| {
        if e.kind() == std::io::ErrorKind::NotFound {
            LaunchError::Engine(
                "`sbatch` is not on PATH: the slurm engine outside an allocation needs Slurm's client commands \
                 (sbatch, scontrol, scancel; Debian/Ubuntu package `slurm-client`) configured for the cluster"
                    .into(),
            )
        } else {
            LaunchError::Engine(format!("failed to run `sbatch`: {e}"))
        }
    })?;
    if let Some(mut stdin) = child.stdin.take() {
        // A failed write shows up as sbatch's own error below.
        let _ = stdin.write_all(script.as_bytes());
    }
    let out = child
        .wait_with_output()
        .map_err(|e| LaunchError::Engine(format!("failed to wait for `sbatch`: {e}")))?;
    if !out.status.success() {
        return Err(LaunchError::Engine(format!(
            "`sbatch` failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `scancel` the given jobs (errors ignored: a job that already ended cannot be cancelled, which is fine).
pub fn cancel<'a>(ids: impl IntoIterator<Item = &'a str>) {
    let ids: Vec<&str> = ids.into_iter().collect();
    if ids.is_empty() {
        return;
    }
    match Command::new("scancel")
        .args(&ids)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
    {
        Ok(_) => {}
        Err(e) => tracing::warn!("could not run scancel {ids:?}: {e}"),
    }
}

/// The value of `key` in one line of `scontrol -o show job` (`Key=value` words).
pub fn field<'a>(line: &'a str, key: &str) -> Option<&'a str> {
    let pattern = format!("{key}=");
    let mut from = 0;
    while let Some(at) = line[from..].find(&pattern) {
        let start = from + at;
        if start == 0 || line.as_bytes()[start - 1] == b' ' {
            let rest = &line[start + pattern.len()..];
            return Some(rest.split(' ').next().unwrap_or(""));
        }
        from = start + pattern.len();
    }
    None
}

/// A job as `scontrol` reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobStatus {
    pub state: String,
    pub reason: String,
    /// `ExitCode=N:S`: the batch script's exit code and the signal that ended it.
    pub exit: (i32, i32),
    pub node_list: String,
}

impl JobStatus {
    /// Parses one line of `scontrol -o show job ID`.
    pub fn parse(line: &str) -> Option<JobStatus> {
        let state = field(line, "JobState")?.to_owned();
        let exit = field(line, "ExitCode")
            .and_then(|e| e.split_once(':'))
            .and_then(|(c, s)| Some((c.parse().ok()?, s.parse().ok()?)))
            .unwrap_or((0, 0));
        Some(JobStatus {
            state,
            reason: field(line, "Reason").unwrap_or("").to_owned(),
            exit,
            node_list: field(line, "NodeList").unwrap_or("").to_owned(),
        })
    }

    /// Whether the job has ended for good (its output files are complete).
    pub fn finished(&self) -> bool {
        matches!(
            self.state.as_str(),
            "COMPLETED"
                | "FAILED"
                | "CANCELLED"
                | "TIMEOUT"
                | "NODE_FAIL"
                | "OUT_OF_MEMORY"
                | "PREEMPTED"
                | "BOOT_FAIL"
                | "DEADLINE"
        )
    }

    /// Whether the job has started (its output files may exist): it has nodes and is past PENDING (a job cancelled
    /// while pending has none).
    pub fn started(&self) -> bool {
        !matches!(self.state.as_str(), "PENDING" | "CONFIGURING")
            && !self.node_list.is_empty()
            && self.node_list != "(null)"
    }

    fn worker_exit(&self) -> WorkerExit {
        match self.exit {
            (_, s) if s != 0 => WorkerExit::Signal(s),
            (0, _) => WorkerExit::Code(1),
            (c, _) => WorkerExit::Code(c),
        }
    }
}

/// `None` when Slurm no longer knows the job.
fn query(id: &str) -> Result<Option<JobStatus>, LaunchError> {
    let out = run_tool(
        Command::new("scontrol").args(["-o", "show", "job", id]),
        "scontrol",
    )?;
    let text = String::from_utf8_lossy(&out.stdout);
    if !out.status.success() {
        let err = String::from_utf8_lossy(&out.stderr);
        if err.contains("Invalid job id") {
            return Ok(None);
        }
        return Err(LaunchError::Engine(format!(
            "`scontrol show job {id}` failed: {}",
            err.trim()
        )));
    }
    Ok(text.lines().find_map(JobStatus::parse))
}

fn hostnames(node_list: &str) -> Vec<String> {
    if node_list.is_empty() || node_list == "(null)" {
        return Vec::new();
    }
    match Command::new("scontrol")
        .args(["show", "hostnames", node_list])
        .output()
    {
        Ok(out) if out.status.success() => String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect(),
        _ => vec![node_list.to_owned()],
    }
}

/// A job being followed.
struct Followed<'a> {
    step: &'a BatchStep,
    job: &'a SubmittedJob,
    status: Option<JobStatus>,
    started: Option<Instant>,
    hosts: Vec<String>,
    tails: [Tail; 2],
    /// The last lines of the job's stderr: (rank from srun's label, the line as written).
    stderr_tail: VecDeque<(Option<u32>, String)>,
    done: bool,
    /// The last pending reason shown.
    reason: String,
    /// `<run dir>/<step>`: per-rank copies of the lines (`rank.<n>/{stdout,stderr}`), as the local engine keeps.
    rank_dir: PathBuf,
    /// The per-rank files open now (at most [`OPEN_RANK_FILES`]), and every one made in this run (reopened to append).
    rank_files: BTreeMap<(u32, bool), fs_err::File>,
    made: BTreeSet<(u32, bool)>,
    /// Who wrote the last line of stdout and of stderr: a piece that continues a line cut at the length limit is
    /// theirs, whatever it starts with (else a rank could write a line up to the cut and then another rank's label).
    last_writer: [Option<Writer>; 2],
    /// A supervised step's launcher said something of its own (a note): its failure report, if any, went by.
    said: bool,
}

/// Per-rank log files a followed job keeps open at once (a job of more ranks reopens them to append).
const OPEN_RANK_FILES: usize = 64;

/// Who wrote a line of a job's output.
#[derive(Debug, Clone)]
enum Writer {
    Rank {
        host: Arc<str>,
        rank: u32,
    },
    /// A supervised step's launcher (`hvd run` in the job) itself: its notes and failure report.
    Launcher,
}

impl<'a> Followed<'a> {
    /// Job `job` of `step`, whose output files are `files` (stdout, stderr), keeping per-rank copies in `rank_dir`.
    fn new(
        step: &'a BatchStep,
        job: &'a SubmittedJob,
        files: [PathBuf; 2],
        rank_dir: PathBuf,
    ) -> Self {
        let [out, err] = files;
        Followed {
            step,
            job,
            status: None,
            started: None,
            hosts: Vec::new(),
            tails: [
                Tail::new(out, Stream::Stdout),
                Tail::new(err, Stream::Stderr),
            ],
            stderr_tail: VecDeque::new(),
            done: false,
            reason: String::new(),
            rank_dir,
            rank_files: BTreeMap::new(),
            made: BTreeSet::new(),
            last_writer: [None, None],
            said: false,
        }
    }

    fn host(&self, rank: u32) -> String {
        let node = (rank / self.step.tasks_per_node.max(1)) as usize;
        self.hosts
            .get(node)
            .or_else(|| self.hosts.first())
            .cloned()
            .unwrap_or_else(|| "?".into())
    }

    /// Appends a line to the rank's log file (errors ignored: the job's own output files are complete anyway).
    fn keep(&mut self, rank: u32, stream: Stream, text: &str) {
        let err = stream == Stream::Stderr;
        let key = (rank, err);
        if !self.rank_files.contains_key(&key) {
            if self.rank_files.len() >= OPEN_RANK_FILES {
                self.rank_files.clear();
            }
            let dir = self.rank_dir.join(format!("rank.{rank}"));
            let path = dir.join(if err { "stderr" } else { "stdout" });
            let made = self.made.contains(&key);
            let file = fs_err::create_dir_all(&dir).and_then(|()| {
                fs_err::OpenOptions::new()
                    .create(true)
                    .append(made)
                    .write(true)
                    .truncate(!made)
                    .open(&path)
            });
            match file {
                Ok(file) => {
                    self.made.insert(key);
                    self.rank_files.insert(key, file);
                }
                Err(e) => {
                    tracing::warn!("{e}");
                    return;
                }
            }
        }
        if let Some(file) = self.rank_files.get_mut(&key) {
            let _ = writeln!(file, "{text}");
        }
    }

    /// Who wrote `line` (not a continued piece) and its text: a supervised step's launcher writes a rank's line as its
    /// console does (`[STEP HOST:RANK] TEXT`) and anything else as its own; srun labels a rank's line (`R: TEXT`),
    /// and a line without a label (srun's own, a step that runs once) is rank 0's.
    fn writer(&self, line: &str) -> (Writer, String) {
        if self.step.supervised {
            return match super::console_line(line).filter(|(step, ..)| *step == self.step.name) {
                Some((_, host, rank, text)) => (
                    Writer::Rank {
                        host: Arc::from(host),
                        rank,
                    },
                    text.to_owned(),
                ),
                None => (
                    Writer::Launcher,
                    line.strip_prefix("hvd: ").unwrap_or(line).to_owned(),
                ),
            };
        }
        let tagged = self.step.workers.is_some();
        let (rank, text) = match tagged.then(|| crate::engines::untag(line)).flatten() {
            Some((r, _, rest)) => (r, rest.to_owned()),
            None => (0, line.to_owned()),
        };
        let host = Arc::from(self.host(rank).as_str());
        (Writer::Rank { host, rank }, text)
    }

    fn drain(&mut self, last: bool, events: &dyn EventSink) {
        let step: Arc<str> = Arc::from(self.step.name.as_str());
        let mut lines: Vec<(Stream, String, bool)> = Vec::new();
        for tail in &mut self.tails {
            let refused = tail.read(last, &mut |stream, line, continued| {
                lines.push((
                    stream,
                    String::from_utf8_lossy(line).into_owned(),
                    continued,
                ));
            });
            if let Some(text) = refused {
                events.event(Event::Note { text });
            }
        }
        for (stream, line, continued) in lines {
            let index = usize::from(stream == Stream::Stderr);
            let (writer, text) = match (continued, &self.last_writer[index]) {
                (true, Some(writer)) => (writer.clone(), line.clone()),
                _ => self.writer(&line),
            };
            self.last_writer[index] = Some(writer.clone());
            if stream == Stream::Stderr {
                if self.stderr_tail.len() == 4 * STDERR_TAIL_LINES {
                    self.stderr_tail.pop_front();
                }
                // srun's label (none on srun's own lines); a continued piece is its line's.
                let rank = if self.step.supervised || self.step.workers.is_none() {
                    None
                } else if continued {
                    self.stderr_tail.back().and_then(|(r, _)| *r)
                } else {
                    crate::engines::untag(&line).map(|(r, ..)| r)
                };
                self.stderr_tail.push_back((rank, line));
            }
            match writer {
                Writer::Rank { host, rank } => {
                    self.keep(rank, stream, &text);
                    events.event(Event::Line {
                        step: step.clone(),
                        host,
                        rank,
                        stream,
                        text,
                    });
                }
                Writer::Launcher if text.trim().is_empty() => {}
                Writer::Launcher => {
                    self.said = true;
                    events.event(Event::Note { text });
                }
            }
        }
    }
}

/// Follows the submitted jobs to their end: output lines and step events go to `events`; when a job fails (or on
/// SIGINT/SIGTERM through `interrupts`) every unfinished job is cancelled. Returns the run's report (the failure's
/// exit code is the failing rank's own).
pub fn follow(
    plan: &Plan,
    steps: &[BatchStep],
    submission: &Submission,
    options: &RunOptions,
    events: &dyn EventSink,
    interrupts: Interrupts,
) -> Result<RunReport, LaunchError> {
    let run_id = crate::report::new_run_id();
    let run_dir = plan.state_dir.join("runs").join(&run_id);
    let mut jobs: Vec<Followed<'_>> = Vec::new();
    for job in &submission.jobs {
        let Some(step) = steps.iter().find(|s| s.name == job.step) else {
            continue;
        };
        let file = |ext: &str| output_file(plan, &step.name, &job.job_id, ext);
        jobs.push(Followed::new(
            step,
            job,
            [file("out"), file("err")],
            run_dir.join(&step.name),
        ));
    }
    for step in &submission.skipped {
        events.event(Event::StepSkipped { step: step.clone() });
    }
    let mut report = RunReport {
        skipped: submission.skipped.clone(),
        ..RunReport::new(run_id, run_dir.clone())
    };
    let mut outputs = submission.skipped_outputs.clone();
    let mut cancelled = false;
    let mut vanished: BTreeSet<usize> = BTreeSet::new();
    let mut errors = 0u32;
    loop {
        let (interrupted, signal) = interrupts.get();
        if interrupted >= 1 && !cancelled {
            cancelled = true;
            events.event(Event::Stopping {
                reason: format!(
                    "got {}: cancelling the slurm jobs (again to stop waiting for them)",
                    crate::process::signal_name(signal)
                ),
            });
            cancel(
                jobs.iter()
                    .filter(|j| !j.done)
                    .map(|j| j.job.job_id.as_str()),
            );
            if report.failure.is_none() {
                report.failure = Some(FailureSummary {
                    step: jobs
                        .iter()
                        .find(|j| !j.done)
                        .map_or_else(|| plan.project.clone(), |j| j.step.name.clone()),
                    cause: Cause::Interrupted { signal },
                    exit_code: u8::try_from(128 + signal).unwrap_or(130),
                    stderr_tail: Vec::new(),
                    log_dir: run_dir.clone(),
                });
            }
        }
        if interrupted >= 2 {
            break;
        }
        for (index, job) in jobs.iter_mut().enumerate().filter(|(_, j)| !j.done) {
            let status = match query(&job.job.job_id) {
                Ok(Some(s)) => {
                    errors = 0;
                    s
                }
                Err(e) => {
                    // scontrol can fail for a moment (slurmctld busy or restarting); give up after a while,
                    // cancelling what was submitted.
                    errors += 1;
                    if errors > QUERY_RETRIES {
                        cancel(submission.jobs.iter().map(|j| j.job_id.as_str()));
                        return Err(e);
                    }
                    continue;
                }
                Ok(None) => {
                    // Slurm forgot the job (MinJobAge passed while hvd was not looking): count it as ended with
                    // what was last seen.
                    vanished.insert(index);
                    let mut last = job.status.clone().unwrap_or(JobStatus {
                        state: "UNKNOWN".into(),
                        reason: String::new(),
                        exit: (1, 0),
                        node_list: String::new(),
                    });
                    if !last.finished() {
                        last.state = "UNKNOWN".into();
                    }
                    last
                }
            };
            // Why a job still waits (resources, a partition limit it can never meet, ...), once per reason.
            if status.state == "PENDING"
                && !matches!(status.reason.as_str(), "" | "None" | "Dependency")
                && status.reason != job.reason
            {
                job.reason.clone_from(&status.reason);
                events.event(Event::Note {
                    text: format!(
                        "step `{}` (slurm job {}) is pending: {}",
                        job.step.name, job.job.job_id, status.reason
                    ),
                });
            }
            if status.started() && job.started.is_none() {
                job.started = Some(Instant::now());
                job.hosts = hostnames(&status.node_list);
                report.ran.push(job.step.name.clone());
                events.event(Event::StepStarted {
                    step: job.step.name.clone(),
                    workers: job.step.workers,
                    rendezvous: None,
                });
            }
            let finished = status.finished() || vanished.contains(&index);
            job.status = Some(status);
            if job.started.is_some() {
                job.drain(finished, events);
            }
            if finished {
                job.done = true;
            }
        }
        // Outcomes, in plan order.
        let mut failed_now = false;
        for job in jobs.iter_mut().filter(|j| j.done && j.status.is_some()) {
            let Some(status) = job.status.take() else {
                continue;
            };
            if status.state == "COMPLETED" && status.exit == (0, 0) {
                events.event(Event::StepFinished {
                    step: job.step.name.clone(),
                    elapsed: job.started.map_or(Duration::ZERO, |s| s.elapsed()),
                });
                record_success(plan, options, &job.step.name, &mut outputs);
                continue;
            }
            if report.failure.is_some() || cancelled {
                continue;
            }
            failed_now = true;
            report.failure = Some(failure_of(job, &status));
        }
        if failed_now && !cancelled {
            cancelled = true;
            let others: Vec<&str> = jobs
                .iter()
                .filter(|j| !j.done)
                .map(|j| j.job.job_id.as_str())
                .collect();
            if let Some(f) = &report.failure
                && !others.is_empty()
            {
                events.event(Event::Stopping {
                    reason: format!(
                        "step `{}` failed; cancelling {} other slurm job(s)",
                        f.step,
                        others.len()
                    ),
                });
            }
            cancel(others);
        }
        if jobs.iter().all(|j| j.done) {
            break;
        }
        std::thread::sleep(POLL);
    }
    Ok(report)
}

/// Records a success for skipping next time (steps that declare inputs or outputs), and its output hash for the
/// steps after it.
fn record_success(
    plan: &Plan,
    options: &RunOptions,
    step: &str,
    outputs: &mut BTreeMap<String, String>,
) {
    let Some(planned) = plan.steps.iter().find(|s| s.name == step) else {
        return;
    };
    let outputs_hash = state::hash_paths(&plan.project_dir, &planned.outputs).unwrap_or_default();
    // `--no-deps`: the steps it needs are not in its hash, so no record (as the local supervisor's `skip_check`).
    if !options.no_deps && (!planned.inputs.is_empty() || !planned.outputs.is_empty()) {
        match state::input_hash(
            planned,
            &plan.project_dir,
            options.env_hash.as_deref(),
            outputs,
        ) {
            Ok(input_hash) => {
                let record = state::StepRecord {
                    input_hash,
                    outputs_hash: outputs_hash.clone(),
                };
                if let Err(e) = state::store(&plan.state_dir, step, &record) {
                    tracing::warn!("could not record step `{step}`: {e}");
                }
            }
            Err(e) => tracing::warn!("could not hash the inputs of step `{step}`: {e}"),
        }
    }
    outputs.insert(step.to_owned(), outputs_hash);
}

/// The failure summary of a job that did not complete: the failing rank and its own code from srun's message,
/// else rank 0 with the batch script's code.
fn failure_of(job: &Followed<'_>, status: &JobStatus) -> FailureSummary {
    if job.step.supervised && status.state != "TIMEOUT" {
        return launcher_failure(job, status);
    }
    let raw: Vec<String> = job.stderr_tail.iter().map(|(_, l)| l.clone()).collect();
    let (rank, exit) = match crate::engines::failing_rank(&raw) {
        Some((rank, code)) if job.step.workers.is_some() => (rank, WorkerExit::Code(code)),
        _ => (0, status.worker_exit()),
    };
    let mut tail: Vec<String> = job
        .stderr_tail
        .iter()
        .filter(|(r, _)| r.is_none_or(|r| r == rank))
        .map(|(r, l)| match r {
            Some(_) => crate::engines::untag(l).map_or(l.clone(), |(_, _, t)| t.to_owned()),
            None => l.clone(),
        })
        .collect();
    let keep = tail.len().saturating_sub(STDERR_TAIL_LINES - 1);
    tail.drain(..keep);
    tail.push(job_end(job, status));
    let (cause, exit_code) = match (status.state.as_str(), job.step.timeout) {
        ("TIMEOUT", Some(after)) => (Cause::Timeout { after }, TIMEOUT_EXIT_CODE),
        _ => (
            Cause::Worker {
                rank,
                host: job.host(rank),
                exit,
            },
            exit.code(),
        ),
    };
    FailureSummary {
        step: job.step.name.clone(),
        cause,
        exit_code,
        stderr_tail: tail,
        log_dir: job.rank_dir.clone(),
    }
}

/// `(slurm job ID of step `STEP`: STATE (REASON), ExitCode=N:S)`.
fn job_end(job: &Followed<'_>, status: &JobStatus) -> String {
    format!(
        "(slurm job {} of step `{}`: {}{}, ExitCode={}:{})",
        job.job.job_id,
        job.step.name,
        status.state,
        if status.reason.is_empty() || status.reason == "None" {
            String::new()
        } else {
            format!(" ({})", status.reason)
        },
        status.exit.0,
        status.exit.1
    )
}

/// The failure of a supervised step's job: how the job ended (the launcher's own report, when it made one, went
/// by as notes just before, and stays in the job's stderr file); the exit code is the launcher's, which is its failing rank's.
fn launcher_failure(job: &Followed<'_>, status: &JobStatus) -> FailureSummary {
    let said = match job.said {
        true => "its report is above, and in",
        false => "it said nothing of its own; the job's output is in",
    };
    let tail = vec![
        format!("{said} {}", job.tails[1].path().display()),
        job_end(job, status),
    ];
    let exit = status.worker_exit();
    FailureSummary {
        step: job.step.name.clone(),
        cause: Cause::Launcher {
            job: format!("slurm job {}", job.job.job_id),
            exit,
        },
        exit_code: exit.code(),
        stderr_tail: tail,
        log_dir: job.rank_dir.clone(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank writes a line up to the length limit (or up to a lone `\r`, after which srun writes no label) and then
    /// what looks like another rank's line (or a note of the launcher's): the piece after the cut is still its own,
    /// under both ways of labelling lines (a supervised step's launcher's `[STEP HOST:RANK]`, srun's `R: `); lines of
    /// ever new rank numbers keep only a bounded number of files open, and every line reaches its rank's file.
    #[test]
    fn a_rank_cannot_write_another_ranks_lines_past_the_length_limit() {
        let dir = tempfile::tempdir().unwrap();
        let long = "x".repeat(64 * 1024);
        for (supervised, prefix, body, forged) in [
            (true, "[train h1:1] ", long.as_str(), "[train h2:7] forged"),
            (true, "[train h1:1] ", long.as_str(), "hvd: forged note"),
            (false, "1: ", long.as_str(), "7: forged"),
            (false, "1: ", "x\r", "7: forged"),
        ] {
            let step = BatchStep {
                name: "train".into(),
                needs: Vec::new(),
                workers: Some(8),
                tasks_per_node: 8,
                timeout: None,
                script: String::new(),
                supervised,
            };
            let job = SubmittedJob {
                step: "train".into(),
                job_id: "1".into(),
                after: Vec::new(),
            };
            let out = dir.path().join("job.out");
            // The launcher (or srun) writes the rank's label, then 64 KiB of its text and the forged part: the
            // label makes the line longer than the limit, so the forged part comes after a cut.
            let mut text = format!("{prefix}{body}{forged}\n");
            for rank in 0..200 {
                text.push_str(&format!("{}\n", prefix.replace('1', &rank.to_string())));
            }
            std::fs::write(&out, text).unwrap();
            let rank_dir = dir.path().join(format!(
                "ranks-{supervised}-{}-{}",
                forged.len(),
                body.len()
            ));
            let mut followed = Followed::new(
                &step,
                &job,
                [out, dir.path().join("job.err")],
                rank_dir.clone(),
            );
            followed.hosts = vec!["h1".into()];
            let events: std::sync::Mutex<Vec<Event>> = std::sync::Mutex::default();
            followed.drain(true, &|e| events.lock().unwrap().push(e));
            assert!(followed.rank_files.len() <= OPEN_RANK_FILES);
            let events = events.into_inner().unwrap();
            let mut by_rank: BTreeMap<u32, Vec<String>> = BTreeMap::new();
            for event in events {
                match event {
                    Event::Line { rank, text, .. } => by_rank.entry(rank).or_default().push(text),
                    other => panic!("{forged}: not a rank's line: {other:?}"),
                }
            }
            let ones = &by_rank[&1];
            assert!(
                ones.iter().any(|t| t.ends_with(forged)),
                "{forged}: {ones:?}"
            );
            assert!(
                !by_rank
                    .values()
                    .flatten()
                    .any(|t| t == "forged" || t == "forged note"),
                "{forged}: {by_rank:?}"
            );
            // Every rank's file has its lines, rank 1's the cut line too.
            let kept = std::fs::read_to_string(rank_dir.join("rank.1/stdout")).unwrap();
            assert!(
                kept.contains(forged) && kept.lines().count() == 3,
                "{forged}: {kept:?}"
            );
            assert!(rank_dir.join("rank.199/stdout").exists());
        }
    }

    #[test]
    fn scontrol_lines_and_sbatch_ids_are_read() {
        let line = "JobId=4 JobName=t-train UserId=root(0) JobState=FAILED Reason=NonZeroExitCode \
                    Dependency=(null) ExitCode=143:0 RunTime=00:00:03 NodeList=vm BatchHost=vm ReqNodeList=(null)";
        let status = JobStatus::parse(line).unwrap();
        assert_eq!(status.state, "FAILED");
        assert_eq!(status.reason, "NonZeroExitCode");
        assert_eq!(status.exit, (143, 0));
        assert_eq!(status.node_list, "vm");
        assert!(status.finished() && status.started());
        let pending =
            JobStatus::parse("JobId=5 JobState=PENDING Reason=Dependency ExitCode=0:0 NodeList=")
                .unwrap();
        assert!(!pending.finished() && !pending.started());
        assert_eq!(pending.node_list, "");
        assert_eq!(field("ReqNodeList=a NodeList=b", "NodeList"), Some("b"));
        assert_eq!(JobStatus::parse("garbage"), None);
        let killed = JobStatus::parse("JobState=CANCELLED ExitCode=0:15").unwrap();
        assert_eq!(killed.worker_exit(), WorkerExit::Signal(15));
        assert_eq!(parse_job_id("42\n"), Some("42".into()));
        assert_eq!(parse_job_id("42;cluster\n"), Some("42".into()));
        assert_eq!(parse_job_id("Submitted batch job 42"), None);
        assert_eq!(parse_job_id(""), None);
    }

    /// The user's own output directory left writable by others is made 0700; another user's is refused, naming its
    /// owner, and one hvd just created (a file system that maps root to another user) says so.
    #[test]
    fn the_output_directory_is_made_private_or_refused() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("slurm");
        std::fs::create_dir(&out).unwrap();
        std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).unwrap();
        make_private(&out, false).unwrap();
        let mode = std::fs::metadata(&out).unwrap().permissions().mode();
        assert_eq!(mode & 0o7777, 0o700);
        // Another user's: as root, one given to uid 65534 (nobody, as root_squash maps root); else `/`, root's.
        // SAFETY: geteuid has no preconditions.
        let theirs = if unsafe { libc::geteuid() } == 0 {
            std::os::unix::fs::chown(&out, Some(65534), None).unwrap();
            std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o777)).unwrap();
            out.clone()
        } else {
            PathBuf::from("/")
        };
        let owner = std::os::unix::fs::MetadataExt::uid(&std::fs::metadata(&theirs).unwrap());
        for created in [false, true] {
            let err = make_private(&theirs, created).unwrap_err().to_string();
            assert!(
                err.contains(&format!("`{}` belongs to uid {owner}", theirs.display()))
                    && err.contains("root_squash")
                    && err.contains("remove it") != created,
                "{err}"
            );
        }
        let mode = std::fs::metadata(&theirs).unwrap().permissions().mode();
        assert_ne!(
            mode & 0o7777,
            0o700,
            "another user's directory is left as it is"
        );
    }

    /// A failure after an earlier job's files were moved aside (removing its `rdv-<id>`, releasing the job) says
    /// where they went, and keeps its cause; without any moved, the error is as it was.
    #[test]
    fn an_error_after_files_were_moved_aside_says_where_they_went() {
        let moved = vec![(
            PathBuf::from("/o/p-a-1.out"),
            PathBuf::from("/o/p-a-1.out.stale-r1"),
        )];
        let io = || LaunchError::Io {
            path: "/o/rdv-1".into(),
            source: std::io::Error::from_raw_os_error(libc::EBUSY),
        };
        let text = with_moved(io(), &moved).to_string();
        let busy = std::io::Error::from_raw_os_error(libc::EBUSY).to_string();
        for part in ["/o/rdv-1", &busy, "/o/p-a-1.out to /o/p-a-1.out.stale-r1"] {
            assert!(text.contains(part), "{part}: {text}");
        }
        let text = with_moved(LaunchError::Engine("release failed".into()), &moved).to_string();
        assert!(
            text.starts_with("release failed;") && text.contains("p-a-1.out.stale-r1"),
            "{text}"
        );
        assert!(matches!(with_moved(io(), &[]), LaunchError::Io { .. }));
    }
}
