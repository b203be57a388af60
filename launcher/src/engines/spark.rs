//! The `spark` engine: a distributed step is one barrier-mode Spark job with one task per worker (like Databricks'
//! HorovodRunner). The launcher supervises a small Python driver program ([`DRIVER_SOURCE`], written under the state
//! directory before the first step starts) like mpirun: it starts a SparkSession on the master, runs
//! `parallelize(range(N), N).barrier().mapPartitions(task)`, and each task runs `hvd worker-env -- /bin/sh -c
//! COMMAND` with its rank, local rank and host from `BarrierTaskContext` in `HVD_SPARK_*` (read by the shim). The
//! ranks' output comes back to the driver over TCP and is printed as `[R] line` (the tag `hvd run` reads); the first
//! failing rank ends the job with `hvd spark: rank R failed (exit status: N)` and its code. With binary caches, each
//! task first runs `hvd cache pull` on its executor and the ranks start only once every executor has the env, each
//! through `hvd worker-env --pull` (which finds the env and roots it against `hvd gc` while the rank runs).
//!
//! An elastic step cannot be one barrier job (Spark fails a barrier stage whole when one task fails). Its ranks are
//! started one by one, as the ssh engine's are: each rank (and each replacement) is a relay process on this machine,
//! `PYTHON DRIVER --relay SOCKET --slot SLOT -- WRAPPER...`, which has the step's relay server (the driver's `--serve`
//! mode, one SparkContext for the step, started before it and stopped after it) run the ssh engine's remote wrapper as
//! a Spark job of one task on an executor Spark picks. The wrapper gets the rank's stdin through the relay (the job
//! token and the rank's variables, then the launcher's stop and hand-over requests) and the executor's address as the rank's host; the relay passes the rank's
//! output back and exits with its status (255 when Spark lost the task). A lost rank's replacement is a new job,
//! wherever Spark has a free task slot.

use std::path::{Path, PathBuf};

use hvd_lang::model::Project;

use std::collections::BTreeMap;
use std::io::BufRead as _;
use std::net::IpAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::LaunchError;
use crate::engine::{Engine, Plan, PlannedStep, RankCommand, RankStart, SupervisedEngine};
use crate::env::WorkerLayout;
use crate::options::RunOptions;

/// The driver program, run with a Python that has pyspark.
pub const DRIVER_SOURCE: &str = include_str!("spark_driver.py");
/// Its file name under `<state dir>/spark/`.
pub const DRIVER_FILE: &str = "hvd_spark_driver.py";

/// The host of a master URL with one (`spark://h:7077`, `spark://h1:7077,h2:7077`, `k8s://https://h:6443`).
fn master_host(master: &str) -> Option<&str> {
    let (_, rest) = master.split_once("://")?;
    let rest = rest.split_once("://").map_or(rest, |(_, r)| r);
    let first = rest.split([',', '/']).next()?;
    let host = first.rsplit_once(':').map_or(first, |(h, _)| h);
    (!host.is_empty()).then_some(host)
}

/// What every spark step of a plan shares.
#[derive(Debug, Clone)]
pub struct SparkSetup {
    /// The master URL; `None`: `local[N]` for a step on N workers.
    pub master: Option<String>,
    pub python: PathBuf,
    /// The hvd binary (its `worker-env` subcommand is the shim).
    pub shim: PathBuf,
    /// Where the driver program is written and Spark's work folders go (`runs/<run>/<step>/spark`).
    pub state_dir: PathBuf,
    /// `spark.*` entries of `cluster { settings }`, passed to the driver and the relay server in `HVD_SPARK_CONF`
    /// (a JSON object), not on their command lines, which every local user can read.
    pub conf: Vec<(String, String)>,
    /// `settings.slots_timeout`: seconds the driver waits for executors with enough task slots (default 120, 300
    /// for `local-cluster`).
    pub slots_timeout: Option<u32>,
    /// Where a step's rendezvous binds when the executors run on other machines ([`SparkSetup::rendezvous_bind`]);
    /// `None`: 127.0.0.1.
    pub bind: Option<IpAddr>,
    /// `cache pull --store=STORE ENV --cache=URL... --trusted-key=KEY...` (the arguments after the hvd binary):
    /// what every task runs on its executor before any rank starts, when caches and the env are given
    /// ([`super::pull_argv`]).
    pub pull: Option<Vec<String>>,
    /// `--grace` in tenths of a second: how long a relayed rank's wrapper waits between SIGTERM and SIGKILL.
    pub grace_ticks: u128,
    /// The relay servers of the elastic steps running now (module docs).
    pub relay: Arc<Relay>,
}

/// The relay server of each elastic step running now, by step name (started by [`SupervisedEngine::begin_step`],
/// stopped by [`SupervisedEngine::end_step`]): a SparkContext of its own, so steps that run at the same time do not
/// share task slots, and none is held while another step's barrier job needs the cluster.
#[derive(Debug, Default)]
pub struct Relay {
    servers: Mutex<BTreeMap<String, RelayServer>>,
}

impl Relay {
    fn servers(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, RelayServer>> {
        self.servers
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The driver in `--serve` mode, listening on a socket in a private temporary directory (a socket's path is short).
/// Dropped at the run's end: its stdin closed (it stops Spark), then its process group killed after 20 s.
#[derive(Debug)]
struct RelayServer {
    child: Child,
    dir: tempfile::TempDir,
}

impl RelayServer {
    fn socket(&self) -> PathBuf {
        self.dir.path().join("relay.sock")
    }
}

impl Drop for RelayServer {
    fn drop(&mut self) {
        drop(self.child.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(20);
        while Instant::now() < deadline {
            if !matches!(self.child.try_wait(), Ok(None)) {
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        crate::process::signal_group(self.child.id(), libc::SIGKILL);
        let _ = self.child.wait();
    }
}

/// The `spark` engine: a distributed step is one barrier-mode Spark job run by the driver program.
pub fn start(project: &Project, options: &RunOptions) -> Result<Engine, LaunchError> {
    let state_dir = crate::graph::state_dir(project, options);
    let mut setup = SparkSetup::new(project, options, &state_dir)?;
    // Refused here (a cache URL with credentials), so a dry run says so too.
    setup.pull = super::pull_argv_for(
        options.env_dir.as_deref(),
        &options.caches,
        &options.trusted_keys,
        &setup.shim,
    )?
    .map(|argv| argv[1..].to_vec());
    let network_interface = options.ssh.network_interface.clone().or_else(|| {
        project
            .cluster
            .as_ref()
            .and_then(|c| c.settings.network_interface.clone())
    });
    setup.bind = setup.rendezvous_bind(network_interface.as_deref())?;
    setup.grace_ticks = (options.grace.as_millis() / 100).max(1);
    Ok(Engine::Supervised(Arc::new(setup)))
}

impl SupervisedEngine for SparkSetup {
    fn name(&self) -> &'static str {
        "spark engine, one barrier task per rank, placed by Spark"
    }

    fn layout(&self, workers: Option<u32>) -> WorkerLayout {
        // A spark step's ranks have the executors' host (127.0.0.1 under a local master).
        let host = match workers {
            Some(_) => self.local_host().map(str::to_owned),
            None => None,
        };
        let host = host.unwrap_or_else(crate::env::local_hostname);
        WorkerLayout::local(&host, workers.unwrap_or(1))
    }

    fn prepare(&self, plan: &Plan) -> Result<(), LaunchError> {
        super::ssh::check_elastic_env_names(plan, "the spark engine")?;
        write_driver(&self.driver_path())
    }

    /// An elastic step's relay server, which its ranks run through; its log is `relay.log` in the step's log
    /// directory.
    fn begin_step(
        &self,
        _plan: &Plan,
        step: &PlannedStep,
        log_dir: &Path,
        stopping: &dyn Fn() -> bool,
    ) -> Result<(), LaunchError> {
        match (step.min_workers, step.workers) {
            (Some(_), Some(workers)) => self.start_relay(&step.name, workers, log_dir, stopping),
            _ => Ok(()),
        }
    }

    /// Stops the step's relay server (Spark with it), if it has one.
    fn end_step(&self, step: &PlannedStep, _interrupted: bool) {
        let server = self.relay.servers().remove(&step.name);
        drop(server);
    }

    fn rendezvous(&self) -> (IpAddr, Vec<IpAddr>) {
        let ip = self
            .bind
            .unwrap_or(IpAddr::V4(std::net::Ipv4Addr::LOCALHOST));
        (ip, vec![ip])
    }

    /// One barrier job of every rank; none for an elastic step, whose ranks are relayed one by one.
    fn launcher(&self, plan: &Plan, step: &PlannedStep, workers: u32) -> Option<Vec<String>> {
        if step.min_workers.is_some() {
            return None;
        }
        let export = super::exported_vars(&step.env, plan.env_dir.is_some());
        Some(self.argv(workers, &export, &step.command))
    }

    /// Every rank has one pretend host (Spark places it): a loss says nothing of a host.
    fn charges_hosts(&self) -> bool {
        false
    }

    /// A lost rank of an elastic step is replaced by a new relayed rank: a new job, where Spark has a free slot.
    fn replaces_workers(&self) -> bool {
        true
    }

    /// A relayed rank of an elastic step (module docs): stopped through its stdin, like an ssh rank.
    fn rank_command(&self, rank: &RankStart<'_>) -> Result<RankCommand, LaunchError> {
        let socket = self
            .relay
            .servers()
            .get(&rank.step.name)
            .map(RelayServer::socket);
        let Some(rendezvous) = rank.rendezvous else {
            return Ok(RankCommand::local(rank));
        };
        let Some(socket) = socket else {
            return Err(LaunchError::Engine(format!(
                "step `{}`: the spark relay server its ranks run through is not running (the step was not \
                 begun as an elastic step)",
                rank.step.name
            )));
        };
        let env = super::ssh::started_rank_env(rank, rendezvous);
        let after_token = super::ssh::stdin_vars(&relay_vars(&env.vars), "the spark engine")?;
        let argv = self.relay_argv(
            rank.plan,
            rank.step,
            rank.slot.rank,
            rendezvous.addr.ip(),
            &socket.display().to_string(),
        );
        Ok(RankCommand::remote_argv(&argv, after_token, false))
    }

    fn launcher_label(&self) -> &'static str {
        "spark:"
    }

    /// The Spark settings (`spark.authenticate.secret` may be one) as `HVD_SPARK_CONF`, off the command line.
    fn launcher_env(&self, shown: bool) -> Vec<(String, String)> {
        if shown && self.conf.is_empty() {
            return Vec::new();
        }
        // Always set (`{}` without settings): a value from the user's shell is not the file's. Shown with the
        // values of keys Spark itself redacts masked.
        let conf: serde_json::Map<String, serde_json::Value> = self
            .conf
            .iter()
            .map(|(k, v)| {
                let v = match shown && looks_secret(k) {
                    true => "***",
                    false => v.as_str(),
                };
                (k.clone(), serde_json::Value::String(v.to_owned()))
            })
            .collect();
        vec![(
            crate::env_vars::HVD_SPARK_CONF.to_owned(),
            serde_json::Value::Object(conf).to_string(),
        )]
    }

    /// A rank of an elastic step: its relay's command line (the server's socket is made when the run starts).
    fn dry_run_rank(
        &self,
        plan: &Plan,
        step: &PlannedStep,
        slot: &crate::env::Slot,
    ) -> Vec<String> {
        if step.min_workers.is_none() {
            return Vec::new();
        }
        let ip = self.rendezvous().0;
        let env = super::ssh::dry_run_rank_env(plan, step, slot, ip);
        let argv = self.relay_argv(plan, step, slot.rank, ip, "<relay socket>");
        let vars = relay_vars(&env.vars);
        super::ssh::dry_run_lines("spark relay", Ok(argv), &vars, "the spark engine")
    }
}

fn on_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// Whether the env at `dir` has pyspark installed (a `lib/python*/site-packages/pyspark` folder).
fn env_has_pyspark(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir.join("lib")) else {
        return false;
    };
    entries.flatten().any(|e| {
        e.file_name().to_string_lossy().starts_with("python")
            && e.path().join("site-packages").join("pyspark").is_dir()
    })
}

impl SparkSetup {
    /// Reads the master and the Python: `--spark-master` / `--spark-python`, else `settings.master` /
    /// `settings.python` of the cluster block; the Python defaults to the env's when it has pyspark, else `python3`
    /// on PATH.
    pub fn new(
        project: &Project,
        options: &RunOptions,
        state_dir: &Path,
    ) -> Result<Self, LaunchError> {
        let settings = project
            .cluster
            .as_ref()
            .map(|c| c.settings.clone())
            .unwrap_or_default();
        let python = match options
            .spark
            .python
            .clone()
            .or(settings.python)
        {
            Some(p) if p.components().count() > 1 => p,
            Some(p) => on_path(&p.to_string_lossy()).ok_or_else(|| {
                LaunchError::Engine(format!(
                    "the spark engine's Python `{}` is not on PATH",
                    p.display()
                ))
            })?,
            None => match options.env_dir.as_deref().filter(|d| env_has_pyspark(d)) {
                Some(env) => env.join("bin").join("python"),
                None => on_path("python3").ok_or_else(|| {
                    LaunchError::Engine(
                        "the spark engine needs a Python with pyspark: `python3` is not on PATH; pass \
                         `--spark-python PROGRAM`"
                            .into(),
                    )
                })?,
            },
        };
        let shim = options.shim.clone().ok_or_else(|| {
            LaunchError::Engine(
                "the spark engine needs the hvd binary for its worker shim (RunOptions::shim)"
                    .into(),
            )
        })?;
        let conf = settings.spark_conf.into_iter().collect();
        let slots_timeout = settings.slots_timeout;
        Ok(SparkSetup {
            slots_timeout,
            grace_ticks: 1,
            relay: Arc::default(),
            master: options.spark.master.clone().or(settings.master),
            python,
            shim,
            state_dir: state_dir.to_path_buf(),
            conf,
            bind: None,
            pull: None,
        })
    }

    /// The host every rank has under a local master (`local[N]`, `local-cluster[...]`): the executors' address,
    /// 127.0.0.1 (the driver binds there). `None` for a cluster, where Spark places the tasks.
    pub fn local_host(&self) -> Option<&'static str> {
        match &self.master {
            Some(m) if !m.starts_with("local") => None,
            _ => Some("127.0.0.1"),
        }
    }

    /// The address the rendezvous binds for a cluster master (executors on other machines must reach it): the IPv4
    /// address of `network_interface` when given, else the local address whose route reaches the master's host
    /// (`spark://HOST:PORT`, `mesos://...`, `k8s://https://HOST:PORT`); `None` under a local master or when the
    /// master names no host (`yarn`: give `--network-interface`).
    pub fn rendezvous_bind(
        &self,
        network_interface: Option<&str>,
    ) -> Result<Option<std::net::IpAddr>, crate::LaunchError> {
        if self.local_host().is_some() {
            return Ok(None);
        }
        if let Some(name) = network_interface {
            return super::net::interface_ipv4(name).map(Some);
        }
        let Some(host) = self.master.as_deref().and_then(master_host) else {
            return Ok(None);
        };
        let ip = super::net::resolve_host(host)?;
        super::net::route_source(ip).map(Some)
    }

    /// Starts the relay server (module docs) of elastic step `step` of up to `workers` ranks (without a master:
    /// `local[workers]`), and waits until it listens, at most the slots timeout (default 120 s, 300 s for
    /// `local-cluster`) and 30 s, or until `stopping` (a Ctrl-C: the server is stopped, and no rank starts). Its
    /// messages go to `relay.log` in `log_dir`, its Spark folders to `spark` there.
    fn start_relay(
        &self,
        step: &str,
        workers: u32,
        log_dir: &Path,
        stopping: &dyn Fn() -> bool,
    ) -> Result<(), LaunchError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| LaunchError::Io { path, source }
        };
        let dir = tempfile::Builder::new()
            .prefix("hvd-spark-")
            .tempdir()
            .map_err(io(&std::env::temp_dir()))?;
        fs_err::create_dir_all(log_dir).map_err(io(log_dir))?;
        let log_path = log_dir.join("relay.log");
        let log = fs_err::File::create(&log_path).map_err(io(&log_path))?;
        let master = self
            .master
            .clone()
            .unwrap_or_else(|| format!("local[{workers}]"));
        let mut command = Command::new(&self.python);
        command
            .arg(self.driver_path())
            .arg("--serve")
            .arg(dir.path().join("relay.sock"))
            .args(["--master", &master, "--workers", &workers.to_string()])
            .arg("--state-dir")
            .arg(&self.state_dir)
            .arg("--home")
            .arg(log_dir.join("spark"))
            // Where the settings' file goes (only this user reads it; removed with the socket's folder).
            .arg("--private-dir")
            .arg(dir.path());
        if let Some(t) = self.slots_timeout {
            command.args(["--slots-timeout", &t.to_string()]);
        }
        command
            .envs(self.launcher_env(false))
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log.into_parts().0);
        crate::process::configure_worker(&mut command);
        let mut child = command.spawn().map_err(|e| {
            LaunchError::Engine(format!(
                "cannot start the spark relay server with `{}`: {e}",
                self.python.display()
            ))
        })?;
        let stdout = child.stdout.take();
        let (ready, said) = std::sync::mpsc::channel();
        // `ready` once it listens; anything else it (or its JVM) prints there is read and dropped, before and after.
        std::thread::spawn(move || {
            let Some(stdout) = stdout else {
                let _ = ready.send(false);
                return;
            };
            let mut told = false;
            let mut reader = std::io::BufReader::new(stdout);
            let mut line = Vec::new();
            while reader.read_until(b'\n', &mut line).is_ok_and(|n| n > 0) {
                if !told && line == b"ready\n" {
                    told = true;
                    let _ = ready.send(true);
                }
                line.clear();
            }
            if !told {
                let _ = ready.send(false);
            }
        });
        let default = match master.starts_with("local-cluster") {
            true => 300,
            false => 120,
        };
        let within = Duration::from_secs(u64::from(self.slots_timeout.unwrap_or(default)) + 30);
        let started = RelayServer { child, dir };
        let deadline = Instant::now() + within;
        let outcome = loop {
            let now = Instant::now();
            if now >= deadline {
                break Err(std::sync::mpsc::RecvTimeoutError::Timeout);
            }
            if stopping() {
                // Spark's start can take minutes: a Ctrl-C meanwhile stops it (the run says why).
                crate::process::signal_group(started.child.id(), libc::SIGKILL);
                return Ok(());
            }
            match said.recv_timeout((deadline - now).min(Duration::from_millis(100))) {
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                outcome => break outcome,
            }
        };
        match outcome {
            Ok(true) => {
                self.relay.servers().insert(step.to_owned(), started);
                Ok(())
            }
            outcome => {
                // Not listening: it may be inside Spark's start, not reading its stdin; ended at once.
                crate::process::signal_group(started.child.id(), libc::SIGKILL);
                drop(started);
                let why = match outcome {
                    Err(_) => format!("did not start within {} s", within.as_secs()),
                    _ => "ended before it listened".to_owned(),
                };
                let tail = std::fs::read_to_string(&log_path).unwrap_or_default();
                let tail: Vec<&str> = tail.lines().rev().take(12).collect();
                Err(LaunchError::Engine(format!(
                    "the spark relay server (for the elastic steps' ranks, master `{master}`) {why}; its last \
                     lines ({}):\n{}",
                    log_path.display(),
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                )))
            }
        }
    }

    /// `PYTHON DRIVER --relay SOCKET --slot SLOT -- /bin/sh -c WRAPPER hvd-rank DIR TICKS IP [PULL...] /bin/sh -c
    /// COMMAND`: the ssh engine's remote wrapper (the rank's variables, less its host, which the task sets to its
    /// executor's address, go on the relay's stdin: [`relay_vars`]; with caches, the shim gets the env onto the
    /// executor first). `SLOT` names the rank in the relay server's log.
    fn relay_argv(
        &self,
        plan: &Plan,
        step: &PlannedStep,
        slot: u32,
        rendezvous: IpAddr,
        socket: &str,
    ) -> Vec<String> {
        let mut argv = vec![
            self.python.display().to_string(),
            self.driver_path().display().to_string(),
            "--relay".into(),
            socket.to_owned(),
            "--slot".into(),
            slot.to_string(),
            "--".into(),
            "/bin/sh".into(),
            "-c".into(),
            super::ssh::WRAPPER.into(),
            "hvd-rank".into(),
            plan.project_dir.display().to_string(),
            self.grace_ticks.to_string(),
            rendezvous.to_string(),
        ];
        if let (Some(pull), Some(env_dir)) = (&self.pull, plan.env_dir.as_deref()) {
            let mut full = vec![self.shim.display().to_string()];
            full.extend(pull.iter().cloned());
            argv.extend(super::worker_pull_argv(
                &full,
                &env_dir.display().to_string(),
                true,
            ));
            argv.push("--".into());
        }
        argv.extend(["/bin/sh".into(), "-c".into(), step.command.clone()]);
        argv
    }

    /// Where the driver program lives.
    pub fn driver_path(&self) -> PathBuf {
        self.state_dir.join("spark").join(DRIVER_FILE)
    }

    /// The driver command line of a distributed step on `np` workers passing on the variables named in `export`.
    pub fn argv(&self, np: u32, export: &[String], command: &str) -> Vec<String> {
        let master = self
            .master
            .clone()
            .unwrap_or_else(|| format!("local[{np}]"));
        let mut argv = vec![
            self.python.display().to_string(),
            self.driver_path().display().to_string(),
            "--master".into(),
            master,
            "--workers".into(),
            np.to_string(),
            "--shim".into(),
            self.shim.display().to_string(),
            "--state-dir".into(),
            self.state_dir.display().to_string(),
            "--export".into(),
            export.join(","),
        ];
        if let Some(t) = self.slots_timeout {
            argv.extend(["--slots-timeout".into(), t.to_string()]);
        }
        if let Some(pull) = &self.pull {
            // One argument, split by the driver like a shell would (no secret in it: `pull_argv` refuses those).
            argv.extend(["--pull".into(), super::shell::line(pull)]);
        }
        argv.extend(["--".into(), "/bin/sh".into(), "-c".into(), command.into()]);
        argv
    }
}

/// Whether a Spark setting's value is one to mask when shown: its key matches Spark's own
/// `spark.redaction.regex` default, `(?i)secret|password|token|access[.]?key`.
fn looks_secret(key: &str) -> bool {
    let key = key.to_ascii_lowercase();
    ["secret", "password", "token", "accesskey", "access.key"]
        .iter()
        .any(|word| key.contains(word))
}

/// The variables a relayed rank gets on its wrapper's command line, from the worker contract `vars`: not the job
/// token (it travels on stdin: a command line is readable by every local user, on the executor too), not its host
/// (the task sets `HVD_HOSTNAME` to its executor's address), and not the interface variables (the wrapper finds the
/// interface that reaches the rendezvous on its executor); `PATH` is this machine's unless the env's is given, as
/// the barrier job exports it.
fn relay_vars(vars: &[(String, String)]) -> Vec<(String, String)> {
    let mut out: std::collections::BTreeMap<String, String> = std::collections::BTreeMap::new();
    if let Ok(path) = std::env::var("PATH") {
        out.insert("PATH".into(), path);
    }
    out.extend(vars.iter().cloned());
    for name in ["HVD_JOB_TOKEN", "HVD_HOSTNAME", "HOROVOD_HOSTNAME"]
        .into_iter()
        .chain(super::ssh::INTERFACE_VARS)
    {
        out.remove(name);
    }
    out.into_iter().collect()
}

/// Writes [`DRIVER_SOURCE`] to `path` unless it is there already.
pub fn write_driver(path: &Path) -> Result<(), LaunchError> {
    if std::fs::read_to_string(path).is_ok_and(|text| text == DRIVER_SOURCE) {
        return Ok(());
    }
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| LaunchError::Io { path, source }
    };
    if let Some(dir) = path.parent() {
        fs_err::create_dir_all(dir).map_err(io(dir))?;
    }
    // Write then rename: a run starting at the same time never sees half a file.
    let tmp = path.with_extension(format!("py.{}", std::process::id()));
    fs_err::write(&tmp, DRIVER_SOURCE).map_err(io(&tmp))?;
    fs_err::rename(&tmp, path).map_err(io(path))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::shell;

    #[test]
    fn the_rendezvous_binds_where_the_master_is_reached() {
        assert_eq!(master_host("spark://h:7077"), Some("h"));
        assert_eq!(master_host("spark://h1:7077,h2:7077"), Some("h1"));
        assert_eq!(
            master_host("k8s://https://api.example:6443"),
            Some("api.example")
        );
        assert_eq!(master_host("yarn"), None);
        assert_eq!(
            setup(Some("local-cluster[2,1,1024]"))
                .rendezvous_bind(None)
                .unwrap(),
            None
        );
        assert_eq!(
            setup(Some("spark://127.0.0.1:7077"))
                .rendezvous_bind(None)
                .unwrap(),
            Some(std::net::Ipv4Addr::LOCALHOST.into())
        );
        assert_eq!(
            setup(Some("yarn")).rendezvous_bind(Some("lo")).unwrap(),
            Some(std::net::Ipv4Addr::LOCALHOST.into())
        );
        assert!(
            setup(Some("spark://h:1"))
                .rendezvous_bind(Some("no-such-if0"))
                .is_err()
        );
    }

    fn setup(master: Option<&str>) -> SparkSetup {
        SparkSetup {
            master: master.map(str::to_owned),
            python: "/usr/bin/python3".into(),
            shim: "/bin/hvd".into(),
            state_dir: "/p/.hvd".into(),
            conf: vec![("spark.executor.memory".into(), "2g".into())],
            slots_timeout: None,
            bind: None,
            pull: None,
            grace_ticks: 1,
            relay: Arc::default(),
        }
    }

    #[test]
    fn driver_command_line() {
        let env = std::collections::BTreeMap::from([("X".to_string(), "1".to_string())]);
        let export = crate::engines::exported_vars(&env, false);
        let argv = setup(Some("local-cluster[2,1,1024]")).argv(2, &export, "python t.py");
        assert_eq!(
            shell::line(&argv),
            "/usr/bin/python3 /p/.hvd/spark/hvd_spark_driver.py --master 'local-cluster[2,1,1024]' --workers 2 \
             --shim /bin/hvd --state-dir /p/.hvd --export \
             PATH,PYTHONUNBUFFERED,HVD_RENDEZVOUS,HVD_JOB_TOKEN,MASTER_PORT,HVD_GPUS_PER_WORKER,HVD_RUN_STEP,X \
             -- /bin/sh -c 'python t.py'"
        );
        // The settings go in the launcher's environment, off its command line; a dry run masks what looks secret.
        let mut secret = setup(None);
        secret
            .conf
            .push(("spark.authenticate.secret".into(), "s3cr3t".into()));
        let conf = |setup: &SparkSetup, shown| setup.launcher_env(shown);
        assert_eq!(
            conf(&secret, false),
            [(
                "HVD_SPARK_CONF".to_owned(),
                r#"{"spark.authenticate.secret":"s3cr3t","spark.executor.memory":"2g"}"#.to_owned()
            )]
        );
        assert_eq!(
            conf(&secret, true)[0].1,
            r#"{"spark.authenticate.secret":"***","spark.executor.memory":"2g"}"#
        );
        // Without settings an empty object, so that one from the user's shell is not taken; a dry run shows none.
        secret.conf.clear();
        assert_eq!(conf(&secret, false)[0].1, "{}");
        assert!(conf(&secret, true).is_empty());
        // Without a master: local mode with one task slot per worker.
        let argv = setup(None).argv(3, &crate::engines::exported_vars(&env, true), "true");
        assert_eq!(argv[3], "local[3]");
        assert!(argv[11].ends_with(",VIRTUAL_ENV,X"), "{}", argv[11]);
    }

    #[test]
    fn with_caches_every_task_pulls_the_env_and_credentials_are_refused() {
        let env = std::path::Path::new("/s/0123456789abcdef0123456789abcdef-t-env");
        let keys = ["k1:AAAA".to_owned()];
        let pull = |cache: &str| {
            crate::engines::pull_argv_for(
                Some(env),
                &[cache.to_owned()],
                &keys,
                "/bin/hvd".as_ref(),
            )
        };
        let setup = SparkSetup {
            pull: pull("file:///c d").unwrap().map(|argv| argv[1..].to_vec()),
            ..setup(Some("local[2]"))
        };
        let argv = setup.argv(2, &[], "true");
        assert_eq!(
            shell::line(&argv[12..14]),
            "--pull 'cache pull --store=/s 0123456789abcdef0123456789abcdef-t-env '\\''--cache=file:///c d'\\'' \
             --trusted-key=k1:AAAA'"
        );
        // A URL with user info or a token is never written into the driver's command line.
        for url in ["https://u:secret@h/c", "s3://b/p?X-Amz-Signature=secret"] {
            let e = pull(url).unwrap_err().to_string();
            assert!(e.contains("credentials") && !e.contains("secret"), "{e}");
        }
        // Without caches there is nothing to pull.
        assert!(
            crate::engines::pull_argv_for(Some(env), &[], &keys, "/bin/hvd".as_ref())
                .unwrap()
                .is_none()
        );
    }

    /// Runs the Python `check` with the driver imported as `d` (by python3: no pyspark needed, it is imported only
    /// inside functions), asserts that it succeeded, and returns its stdout with `ok` printed after it.
    fn driver_check(check: &str) -> String {
        let dir = tempfile::tempdir().unwrap();
        let driver = dir.path().join(DRIVER_FILE);
        write_driver(&driver).unwrap();
        let program = format!(
            "import importlib.util, sys\nspec = importlib.util.spec_from_file_location(\"d\", sys.argv[1])\n\
             d = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(d)\n{check}\nprint(\"ok\")\n"
        );
        let out = std::process::Command::new("python3")
            .args(["-c", &program])
            .arg(&driver)
            .output()
            .expect("python3 runs");
        let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
    }

    /// The driver's pure helpers.
    #[test]
    fn driver_helpers_split_lines_and_derive_the_layout() {
        let check = r#"
assert d.split_lines(b"", False, b"a\nb\r\nc\rd") == ([b"a", b"b", b"c"], b"d", False)
lines, rest, cr = d.split_lines(b"x", False, b"y\r")
assert (lines, rest, cr) == ([b"xy"], b"", True), (lines, rest, cr)
assert d.split_lines(b"", True, b"\nz\n") == ([b"z"], b"", False)
assert d.layout(["a", "b", "a", "c"]) == [(0, 2, 0, 3), (0, 1, 1, 3), (1, 2, 0, 3), (0, 1, 2, 3)]
assert [d.known_slots(m) for m in ["local", "local[3]", "local-cluster[2,2,1024]", "spark://h:7077"]] == [1, 3, 4, None]
a = d.parse_args(["--master", "m", "--workers", "2", "--shim", "/h", "--state-dir", "/s", "--pull",
                  "cache pull '--cache=file:///c d' --trusted-key=k:A", "--", "true"])
assert a.pull == ["cache", "pull", "--cache=file:///c d", "--trusted-key=k:A"], a.pull
assert d.pull_env("/bin/true", [], None) is None
code, tail = d.pull_env("/bin/sh", ["-c", "echo fine; echo refusing x-helper >&2; exit 3"], None)
assert (code, tail) == (3, [b"refusing x-helper"]), (code, tail)
d.ENV_CONF = '{"spark.x": "1", "spark.y": "a=b"}'
assert d.env_conf() == {"spark.x": "1", "spark.y": "a=b"}, d.env_conf()
d.ENV_CONF = None
assert d.env_conf() == {}
import os, stat, tempfile
t = tempfile.mkdtemp()
target = os.path.join(t, "target")
open(target, "w").write("keep")
path = os.path.join(t, "p.properties")
os.symlink(target, path)
d.write_properties(path, {"spark.a b=c": " lead\\x\nnext", "spark.k": "v=w:x#y"})
assert open(target).read() == "keep"
assert not os.path.islink(path) and stat.S_IMODE(os.stat(path).st_mode) == 0o600
text = open(path).read()
assert text == "spark.a\\ b\\=c=\\ lead\\\\x\\nnext\nspark.k=v=w:x#y\n", repr(text)
"#;
        assert_eq!(driver_check(check), "ok\n");
    }

    /// A relayed rank's command line carries no token, host or interface (each comes from elsewhere).
    #[test]
    fn a_relayed_rank_gets_no_token_host_or_interface_on_its_command_line() {
        let vars: Vec<(String, String)> = [
            ("HVD_JOB_TOKEN", "secret"),
            ("HVD_HOSTNAME", "127.0.0.1"),
            ("HOROVOD_HOSTNAME", "127.0.0.1"),
            ("NCCL_SOCKET_IFNAME", "lo"),
            ("HOROVOD_GLOO_IFACE", "lo"),
            ("HVD_RANK", "3"),
            ("PATH", "/env/bin:/usr/bin"),
        ]
        .iter()
        .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
        .collect();
        let out = relay_vars(&vars);
        assert_eq!(
            out,
            [("HVD_RANK", "3"), ("PATH", "/env/bin:/usr/bin")]
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
        );
    }

    /// The relay server's task port takes a connection only with the server's token and the number of a job waiting
    /// for its task, said within its time: an attacker's connection (no token, a wrong one, a flood of bytes without
    /// a newline, a line that never ends, a number no job waits for, a second one for a task already there) is closed
    /// and never taken for a task's; the real one is. A task's output without newlines is cut into 64 KiB lines, and
    /// a failed job is told in Spark's words.
    #[test]
    fn the_relay_servers_task_port_takes_only_token_holders() {
        let check = r#"
import socket, threading, time
ports = d.TaskPorts("127.0.0.1", "s3cret")
d.HELLO_WITHIN = 1.0
ports.expect(1)
def closed(first, addr=None):
    c = socket.create_connection(addr or ports.addr)
    c.sendall(first)
    c.settimeout(5)
    try:
        return c.recv(1) == b""
    except ConnectionResetError:
        return True
# No token, a wrong one, a bad frame, too long a line, one that never ends (closed after HELLO_WITHIN), a task
# number no job waits for (with the token).
for first in [b"T 1 wrong\n", b"T 1\n", b"X 1 s3cret\n", b"T one s3cret\n", b"T 1 s3cre\n", b"A" * 300,
              b"T 1 s3c", b"T 2 s3cret\n", b"T 99999999999999999999 s3cret\n"]:
    assert closed(first), first
assert ports.wait(1, lambda: True) is None, "an attacker's connection was taken for task 1"
ports.expect(7)
c = socket.create_connection(ports.addr)
c.sendall(b"T 7 s3cret\n")
got = ports.wait(7, lambda: False)
assert got is not None
# A second connection for task 7 (taken already) is refused.
assert closed(b"T 7 s3cret\n")
# The barrier job's output port hears the same way: an attacker's line is not printed, a task's frames are, and a
# frame cut off (no newline) is dropped.
col = d.Collector("127.0.0.1", "t0ken")
assert closed(b"T 0 wrong\nO 0 forged\n", col.addr)
t = socket.create_connection(col.addr)
t.sendall(b"T 0 t0ken\nO 0 hello\nX 0 3\nO 0 cut")
t.close()
deadline = time.time() + 5
while col.failed is None and time.time() < deadline:
    time.sleep(0.01)
assert col.failed == (0, 3), col.failed
col.drain(5)
lines, rest, _ = d.split_lines(b"", False, b"x" * (d.LINE_MAX * 2 + 5))
assert [len(l) for l in lines] == [d.LINE_MAX, d.LINE_MAX] and rest == b"xxxxx", (len(lines), len(rest))
why = d.job_failure("An error occurred while calling z:o.collectAndServe.\n: org.apache.spark.SparkException: Job aborted due to stage failure: Lost task 0.0: ExecutorLostFailure\n\tat x")
assert why == "Job aborted due to stage failure: Lost task 0.0: ExecutorLostFailure", why
assert d.job_failure(None) == "the task ended without the rank's status"
nested = d.job_failure("An error occurred.\n: org.apache.spark.SparkException: Job aborted due to stage failure: Lost task 0.0 (executor 2): org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)")
assert nested == "Job aborted due to stage failure: Lost task 0.0 (executor 2): org.apache.spark.SparkException: Python worker exited unexpectedly (crashed)", nested
"#;
        assert_eq!(driver_check(check), "[0] hello\nok\n");
    }

    #[test]
    fn the_driver_is_written_once() {
        let dir = tempfile::tempdir().unwrap();
        let setup = SparkSetup {
            state_dir: dir.path().to_path_buf(),
            ..setup(None)
        };
        write_driver(&setup.driver_path()).unwrap();
        assert_eq!(
            std::fs::read_to_string(setup.driver_path()).unwrap(),
            DRIVER_SOURCE
        );
        write_driver(&setup.driver_path()).unwrap();
        assert_eq!(
            std::fs::read_dir(dir.path().join("spark")).unwrap().count(),
            1
        );
    }
}
