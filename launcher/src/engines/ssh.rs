//! The `ssh` engine: every rank of a distributed step is one `ssh HOST -- exec /bin/sh -c WRAPPER hvd-rank DIR TICKS
//! IP /bin/sh -c COMMAND`, its variables on its stdin after the job token, started and supervised by the local engine exactly like a local worker (log
//! prefixes, per-rank logs, fail-fast, signals).
//!
//! Ranks fill the hosts' slots in order (`h1:2,h2:2`: ranks 0-1 on h1, 2-3 on h2), like mpirun's by-slot mapping.
//! The rendezvous server binds an address the hosts can reach: the IPv4 address of `--network-interface`, else the
//! local address whose route reaches the first host.
//!
//! The remote wrapper (a POSIX `sh` one-liner, [`WRAPPER`]; the command line: [`SshSetup::wrapper`]):
//! 1. reads the job token from the first line of its stdin and the rank's variables from the lines after it, up to
//!    an empty line ([`stdin_vars`]), so that neither appears on a command line, `cd`s to the project directory (on a host without it: the work directory the host check made there with the project's
//!    files, `ssh/deliver.rs`), and (without `--network-interface`) finds the interface that reaches the rendezvous;
//! 2. starts the step's command in a session of its own with SIGINT and SIGQUIT at their defaults: `env
//!    --default-signal=INT,QUIT setsid /bin/sh -c X` (`env`'s option where supported) with the variables in its
//!    environment (one `_hvd_v`), whose shell exports them and execs `/bin/sh -c COMMAND`;
//! 3. starts a watcher in another session that reads the rest of stdin: it skips `ALIVE` lines (the launcher writes
//!    one every `HVD_REMOTE_KEEPALIVE` seconds, so that no idle timeout on the way cuts a silent rank's stream:
//!    `supervisor/keepalive.rs`); a line `TERM`/`INT`/`KILL` or end of file
//!    (the launcher closed it, ssh died, the connection dropped) sends that signal (TERM on end of file) to the
//!    command's process group, then SIGKILL after the grace period; a line `PREEMPT TICKS` (an elastic worker asked to
//!    hand over at its next commit) sends SIGTERM to the rank: each process of the group that is not a shell and
//!    whose parent is a shell of the group or outside it (so past the `/bin/sh -c` leader, which then ends with the
//!    rank's own status, and past a `bash` script's, which may wait for its child before it runs a trap), not to the
//!    rank's own children (a torch DataLoader's workers die of a SIGTERM, and their death would fail the rank before
//!    it commits); the group when there is no such process; then SIGKILL to the group after TICKS tenths of a second;
//! 4. waits for the command, kills both sessions' leftovers and every process that still carries the rank's
//!    `HVD_RUN_STEP` and `HVD_RANK` in its environment (escaped with `setsid`), and exits with the command's code,
//!    which ssh passes on.
//!
//! So stopping a remote rank is: write the signal's name to its ssh's stdin and close it; ssh then exits once the
//! remote processes are gone, and nothing is left behind on the host.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hvd_lang::model::Project;

use crate::LaunchError;
use crate::engine::{Engine, Plan, PlannedStep, RankCommand, RankStart, SupervisedEngine};
use crate::engines::net::{interface_ipv4, resolve_host, route_source};
use crate::engines::shell::{self, quote};
use crate::env::{RendezvousInfo, Slot, WorkerLayout};
use crate::options::RunOptions;

mod check;
mod checkpoints;
mod deliver;
mod remote;

/// Everything the ssh engine needs for every distributed step of a plan.
#[derive(Debug, Clone)]
pub struct SshSetup {
    /// `(host, slots)` in rank order.
    pub hosts: Vec<(String, u32)>,
    /// The ssh program and its options, without the host.
    pub ssh: Vec<String>,
    /// The address the rendezvous server binds: reachable from every host.
    pub bind_ip: IpAddr,
    /// `--network-interface` when given (passed to the workers as is); `None`: each host finds its own.
    pub interface: Option<String>,
    /// The job's hosts' addresses: the only peers answered on the token-less (Horovod gloo) endpoints.
    pub host_addrs: Vec<IpAddr>,
    /// Seconds between the stop signal and SIGKILL on the hosts (the launcher's `--grace`).
    pub grace: Duration,
    /// Copy the env's store paths to hosts that lack them (tar over ssh) before the check fails.
    pub copy_env: bool,
    /// Binary caches each host pulls the env's closure from (`hvd cache pull` there), with the trusted keys
    /// (`NAME:BASE64`); empty: no pulling.
    pub caches: Vec<String>,
    pub trusted_keys: Vec<String>,
    /// The launcher's own `hvd` binary: the path tried first on a host that pulls the env (then `hvd` on its PATH).
    pub hvd: Option<PathBuf>,
    /// Hosts without the project directory -> the work directory with the project's files there, where their ranks
    /// run (filled by the host check).
    pub work_dirs: Arc<Mutex<BTreeMap<String, PathBuf>>>,
    /// Hosts that get the env from the caches -> their `hvd` (filled by the host check): each rank there starts
    /// through `hvd worker-env --once --pull`, which roots the env against an `hvd gc` on that host until it ends.
    pub pulling_hvds: Arc<Mutex<BTreeMap<String, String>>>,
    /// How long each phase before the ranks start may take on a host; past it the ssh is killed and the run fails.
    pub deadlines: Deadlines,
    /// How a rank's remote command reaches its host: ssh, or `kubectl exec` into a pod.
    pub transport: Transport,
    /// Where every rank runs on its host instead of the project directory (a pod's: `.`, the container's working
    /// directory, where the image has the project's files).
    pub rank_dir: Option<PathBuf>,
}

/// How the launcher starts a command on a host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transport {
    /// `SSH OPTIONS HOST -- REMOTE` ([`SshSetup::ssh`]); the host's login shell runs `REMOTE`.
    Ssh,
    /// `kubectl exec -i [-n NAMESPACE] POD -c CONTAINER -- /bin/sh -c REMOTE`: the kubernetes engine in a launcher
    /// pod, whose hosts are the step's worker pods (`engines/k8s_pods.rs`). kubectl passes stdin on (the token
    /// line, then the stop lines) and exits with the command's status.
    KubectlExec {
        namespace: Option<String>,
        container: String,
    },
}

/// The longest each ssh phase before the ranks start may take on one host (the host check, copying the project's
/// files or the env, pulling the env from the caches): `--start-timeout` when given, else a default; pulling gets at
/// least an hour (an env can be gigabytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Deadlines {
    pub check: Duration,
    pub copy: Duration,
    pub pull: Duration,
}

impl Deadlines {
    pub const CHECK: Duration = Duration::from_secs(120);
    pub const COPY: Duration = Duration::from_secs(1800);
    pub const PULL: Duration = Duration::from_secs(3600);

    pub fn new(start_timeout: Option<Duration>) -> Deadlines {
        Deadlines {
            check: start_timeout.unwrap_or(Self::CHECK),
            copy: start_timeout.unwrap_or(Self::COPY),
            pull: start_timeout.map_or(Self::PULL, |t| t.max(Self::PULL)),
        }
    }
}

/// Whether `name` can be a variable name for the shell (`export NAME=VALUE` in the remote wrapper).
pub(crate) fn valid_var_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// A remote rank's variables as its wrapper ([`WRAPPER`]) reads them from stdin after the job token: a line
/// `NAME=VALUE` each, with `\` and newline in the value written `\\` and `\n` (the wrapper decodes them with
/// `printf %b`), then an empty line. Never on a command line: every local user of a host reads the arguments of its
/// processes (`/proc/PID/cmdline`, `ps`), Slurm may keep a step's command line, and `kubectl exec` sends its command
/// in the request's URL (proxy and audit logs), while the step's `env` may hold a secret. `what` names the engine
/// in the error for a name that is not a variable's (letters, digits, `_`) or a value with a NUL byte.
pub fn stdin_vars(vars: &[(String, String)], what: &str) -> Result<String, LaunchError> {
    let mut block = String::new();
    for (k, v) in vars {
        if !valid_var_name(k) {
            return Err(engine_error(format!(
                "variable `{k}` is not a valid environment variable name for {what} (letters, digits, `_`)"
            )));
        }
        if k.starts_with("_hvd_") || SHELL_OWNED.contains(&k.as_str()) {
            return Err(engine_error(format!(
                "variable `{k}` cannot be given to a rank on {what}: the host's shell owns it (names starting with \
                 `_hvd_` are the rank wrapper's own; {} are read-only or computed in bash); rename it",
                SHELL_OWNED.join(", ")
            )));
        }
        if v.contains('\0') {
            return Err(engine_error(format!(
                "variable `{k}` holds a NUL byte, which no environment variable can hold"
            )));
        }
        block.push_str(k);
        block.push('=');
        for c in v.chars() {
            match c {
                '\\' => block.push_str("\\\\"),
                '\n' => block.push_str("\\n"),
                c => block.push(c),
            }
        }
        block.push('\n');
    }
    block.push('\n');
    if block.len() > STDIN_VARS_MAX {
        return Err(engine_error(format!(
            "the variables of a rank on {what} take {} KiB, more than the {} KiB that go to a remote rank (on its \
             stdin, before its transport reads it); pass large values through a file",
            block.len().div_ceil(1024),
            STDIN_VARS_MAX / 1024
        )));
    }
    Ok(block)
}

/// Refuses, before anything runs, a variable name in the `env` of an elastic step of `plan` that no remote rank can
/// take ([`stdin_vars`]; engines whose elastic steps' ranks are remote: slurm in an allocation, spark, a launcher
/// pod).
pub(crate) fn check_elastic_env_names(plan: &Plan, what: &str) -> Result<(), LaunchError> {
    for step in plan.steps.iter().filter(|s| s.min_workers.is_some()) {
        check_var_names(step.env.keys(), what)
            .map_err(|e| engine_error(format!("step `{}`: {e}", step.name)))?;
    }
    Ok(())
}

/// Refuses a variable name no remote rank can take ([`stdin_vars`]).
pub(crate) fn check_var_names<'a>(
    names: impl Iterator<Item = &'a String>,
    what: &str,
) -> Result<(), LaunchError> {
    let names: Vec<(String, String)> = names.map(|k| (k.clone(), String::new())).collect();
    stdin_vars(&names, what).map(drop)
}

/// The most bytes of variables ([`stdin_vars`]) a remote rank gets: they are written into its stdin pipe before
/// anything reads it (ssh may still be connecting, srun waiting for resources), so they must fit the pipe's buffer
/// (64 KiB on Linux) with the token line, or starting the rank would block the supervisor.
const STDIN_VARS_MAX: usize = 48 << 10;

/// Variables the POSIX shell that runs a remote rank's wrapper owns: bash (the `/bin/sh` of some clusters) refuses to
/// export the read-only ones and computes the others, and `OPTIND` must be a number in any shell.
const SHELL_OWNED: [&str; 30] = [
    "BASHOPTS",
    "BASHPID",
    "BASH_ALIASES",
    "BASH_ARGC",
    "BASH_ARGV",
    "BASH_ARGV0",
    "BASH_CMDS",
    "BASH_COMMAND",
    "BASH_LINENO",
    "BASH_MONOSECONDS",
    "BASH_SOURCE",
    "BASH_SUBSHELL",
    "BASH_TRAPSIG",
    "BASH_VERSINFO",
    "DIRSTACK",
    "EPOCHREALTIME",
    "EPOCHSECONDS",
    "EUID",
    "FUNCNAME",
    "GROUPS",
    "HISTCMD",
    "LINENO",
    "OPTIND",
    "PPID",
    "RANDOM",
    "SECONDS",
    "SHELLOPTS",
    "SRANDOM",
    "UID",
    "_",
];

/// What `--dry-run` shows for a remote rank: `LABEL: ARGV` and, on a line of its own, what its stdin carries after
/// the job token ([`stdin_vars`]); or why it could not start (`what` names the engine, as in [`stdin_vars`]).
pub fn dry_run_lines(
    label: &str,
    argv: Result<Vec<String>, LaunchError>,
    vars: &[(String, String)],
    what: &str,
) -> Vec<String> {
    match stdin_vars(vars, what).and(argv) {
        Ok(argv) => {
            let words: Vec<String> = vars.iter().map(|(k, v)| format!("{k}={v}")).collect();
            vec![
                format!("{label}: {}", shell::line(&argv)),
                format!("stdin: the job token, then {}", shell::line(&words)),
            ]
        }
        Err(e) => vec![format!("(cannot run: {e})")],
    }
}

/// The variables of a rank on another node before its engine adapts them ([`SshSetup::rank_vars`],
/// `RankSrun::vars`), from [`remote_rank_env`].
pub struct RemoteRankEnv<'a> {
    pub vars: Vec<(String, String)>,
    /// The host of the step's rank 0 (`MASTER_ADDR` on the rank's node).
    pub rank0_host: &'a str,
}

/// The variables of rank `slot` of `step` on another node: the local engine's (the same contract,
/// [`crate::env::worker_env`]) plus `MASTER_PORT` and the step marker (shared by the ssh and slurm engines).
pub fn remote_rank_env<'a>(
    plan: &Plan,
    step: &'a PlannedStep,
    slot: &'a Slot,
    rendezvous: &RendezvousInfo,
    master_port: &str,
    marker: &str,
) -> RemoteRankEnv<'a> {
    let mut vars = crate::env::worker_env(
        &step.env,
        slot,
        Some(rendezvous),
        plan.gpus_per_worker,
        plan.env_dir.as_deref(),
    );
    vars.push((crate::env_vars::MASTER_PORT.into(), master_port.to_owned()));
    vars.push((crate::env::STEP_MARKER_VAR.into(), marker.to_owned()));
    let rank0_host = step.layout.slots.first().unwrap_or(slot).host.as_str();
    RemoteRankEnv { vars, rank0_host }
}

/// [`remote_rank_env`] of a rank being started (its `MASTER_PORT` and step marker from `rank`).
pub fn started_rank_env<'a>(
    rank: &RankStart<'a>,
    rendezvous: &RendezvousInfo,
) -> RemoteRankEnv<'a> {
    remote_rank_env(
        rank.plan,
        rank.step,
        rank.slot,
        rendezvous,
        &rank.master_port.to_string(),
        rank.marker,
    )
}

/// [`remote_rank_env`] for `hvd run --dry-run`, the rendezvous on `ip`: the ports and the run id, chosen when the
/// step starts, are shown as `<port>`, `<master-port>` and `<run id>`.
pub fn dry_run_rank_env<'a>(
    plan: &Plan,
    step: &'a PlannedStep,
    slot: &'a Slot,
    ip: IpAddr,
) -> RemoteRankEnv<'a> {
    let rendezvous = RendezvousInfo {
        addr: SocketAddr::new(ip, 0),
        token: String::new(),
    };
    let marker = format!("<run id>/{}", step.name);
    let mut env = remote_rank_env(plan, step, slot, &rendezvous, "<master-port>", &marker);
    for (k, v) in &mut env.vars {
        match k.as_str() {
            "HVD_RENDEZVOUS" => *v = format!("{ip}:<port>"),
            "HOROVOD_GLOO_RENDEZVOUS_PORT" => *v = "<port>".into(),
            _ => {}
        }
    }
    env
}

/// Variables that name the network interface the workers use (hvd's collective, NCCL, gloo, Horovod).
pub const INTERFACE_VARS: [&str; 5] = [
    "HVD_NETWORK_INTERFACE",
    "HVD_TCP_INTERFACE",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "HOROVOD_GLOO_IFACE",
];

/// The remote wrapper (`sh -c WRAPPER hvd-rank DIR TICKS IP [THROUGH...] /bin/sh -c COMMAND`): reads the token and
/// the rank's variables from stdin ([`stdin_vars`]; its own names are unset first, as srun passes the launcher's
/// environment), `cd`s, finds the interface that reaches IP (when given; the one that holds IP when IP is the host's
/// own, which the kernel routes through `lo`), starts the command in a session of its own with SIGINT/SIGQUIT at
/// their defaults (restored before `setsid`) and the variables exported (by the new session's shell `X`, decoded with
/// `printf %b`, so that none reaches the wrapper's own shell: `IFS`, `PATH`; the session and the signals' defaults
/// come before the exports, so a stop read early finds them), and a watcher (`$W`, in another session) that skips
/// `ALIVE` lines (the launcher's keepalives) and stops the command's process group when stdin says so or
/// ends (TICKS tenths of a second before SIGKILL; `PREEMPT N`: SIGTERM past a `/bin/sh` leader, N tenths before
/// SIGKILL). When the command has ended it kills what is left of both sessions, and every process whose environment
/// still carries the rank's `HVD_RUN_STEP` and `HVD_RANK` (what left the command's session: `setsid`, daemons; GNU
/// grep's `-z`). It has no single quotes, so it stays readable when quoted twice (`--dry-run`).
pub const WRAPPER: &str = concat!(
    r#"unset t l v m r a i d S E W X w g c p _hvd_v; "#,
    r#"IFS= read -r HVD_JOB_TOKEN || { echo hvd: no job token on stdin >&2; exit 125; }; export HVD_JOB_TOKEN; "#,
    r#"l=$(printf "\nx"); l=${l%x}; v=; m=; r=; while :; do IFS= read -r a || "#,
    r#"{ echo hvd: the variables of the rank on stdin ended early >&2; exit 125; }; [ -n "$a" ] || break; "#,
    r#"case $a in [A-Za-z_]*=*) ;; *) a=;; esac; case ${a%%=*} in ""|*[!A-Za-z0-9_]*) "#,
    r#"echo hvd: a line on stdin is not NAME=VALUE >&2; exit 125;; esac; "#,
    r#"case $a in HVD_RUN_STEP=*) [ -n "$m" ] || m=$a;; HVD_RANK=*) [ -n "$r" ] || r=$a;; esac; v=$v$a$l; done; "#,
    r#"cd "$1" || exit 125; t=$2; if [ -n "$3" ]; then "#,
    r#"i=$(ip -o route get "$3" 2>/dev/null | sed -n "s/.* dev \([^ ]*\).*/\1/p"); "#,
    r#"[ "$i" = lo ] && i=$(ip -o addr show to "$3" 2>/dev/null | sed -n "1s/^[0-9]*: *\([^ @]*\).*/\1/p"); "#,
    r#"if [ -n "$i" ]; then "#,
    r#"export HVD_NETWORK_INTERFACE="$i" HVD_TCP_INTERFACE="$i" NCCL_SOCKET_IFNAME="$i" GLOO_SOCKET_IFNAME="$i" "#,
    r#"HOROVOD_GLOO_IFACE="$i"; fi; fi; shift 3; "#,
    r#"d=; env --default-signal=INT true 2>/dev/null && d=--default-signal=INT,QUIT; "#,
    r#"S=$(command -v setsid) || S=setsid; E=$(command -v env) || E=env; "#,
    r#"X="_hvd_l=\$1; shift; IFS=\$_hvd_l; set -f; for _hvd_a in \$_hvd_v; do "#,
    r#"_hvd_k=\${_hvd_a%%=*}; _hvd_a=\${_hvd_a#*=}; case \$_hvd_a in *\\\\*) "#,
    r#"_hvd_a=\$(printf \"%bx\" \"\$_hvd_a\"); _hvd_a=\${_hvd_a%x};; esac; export \"\$_hvd_k=\$_hvd_a\"; done; "#,
    r#"unset _hvd_v _hvd_a _hvd_k _hvd_l; exec \"\$@\""; "#,
    r#"W="g=\$1; n=\$2; while IFS= read -r s && [ \"\$s\" = ALIVE ]; do :; done; case \$s in INT|TERM|KILL|PREEMPT|PREEMPT\ *) ;; *) s=TERM;; esac; "#,
    r#"while ! kill -0 -\$g 2>/dev/null; do kill -0 \$g 2>/dev/null || exit 0; sleep 0.05; done; "#,
    r#"if [ \"\${s%% *}\" = PREEMPT ]; then x=\${s#PREEMPT}; x=\${x# }; "#,
    r#"case \$x in \"\"|*[!0-9]*) ;; *) n=\$x;; esac; "#,
    r#"k=; for f in /proc/[0-9]*/stat; do p=\${f#/proc/}; p=\${p%/stat}; "#,
    r#"l=; read -r l < \$f 2>/dev/null || continue; l=\${l##*) }; set -- \$l; [ \"\$3\" = \"\$g\" ] || continue; q=\$2; "#,
    r#"case \$(readlink /proc/\$p/exe 2>/dev/null) in */sh|*/dash|*/bash|*/ash|*/ksh|*/mksh|*/zsh|*/busybox) continue;; esac; "#,
    r#"l=; read -r l < /proc/\$q/stat 2>/dev/null; l=\${l##*) }; set -- \$l; "#,
    r#"if [ \"\$3\" = \"\$g\" ]; then case \$(readlink /proc/\$q/exe 2>/dev/null) in "#,
    r#"*/sh|*/dash|*/bash|*/ash|*/ksh|*/mksh|*/zsh|*/busybox) ;; *) continue;; esac; fi; "#,
    r#"kill -TERM \$p 2>/dev/null && k=1; done; [ -n \"\$k\" ] || kill -TERM -\$g 2>/dev/null || exit 0; "#,
    r#"else kill -\$s -\$g 2>/dev/null || exit 0; fi; "#,
    r#"i=0; while kill -0 -\$g 2>/dev/null; do i=\$((i+1)); if [ \$i -gt \$n ]; then kill -KILL -\$g 2>/dev/null; "#,
    r#"exit 0; fi; sleep 0.1; done"; "#,
    r#"exec 3<&0 </dev/null; _hvd_v=$v "$E" ${d:+"$d"} "$S" /bin/sh -c "$X" hvd-rank "$l" "$@" 3<&- & w=$!; "#,
    r#"setsid /bin/sh -c "$W" hvd-watch "$w" "$t" <&3 >/dev/null 2>&1 3<&- & g=$!; exec 3<&-; "#,
    r#"wait "$w"; c=$?; kill -KILL "-$g" "-$w" 2>/dev/null; "#,
    r#"if [ -n "$m" ] && [ -n "$r" ]; then for p in $(grep -lzxF "$r" $(grep -lzxF "$m" /proc/[0-9]*/environ "#,
    r#"2>/dev/null) </dev/null 2>/dev/null); do p=${p%/environ}; kill -KILL "${p#/proc/}" 2>/dev/null; done; fi; "#,
    r#"exit "$c""#
);

/// The `ssh` engine: each rank of a distributed step is one ssh to its host.
pub fn start(project: &Project, options: &RunOptions) -> Result<Engine, LaunchError> {
    Ok(Engine::Supervised(Arc::new(SshSetup::new(
        project, options,
    )?)))
}

impl SupervisedEngine for SshSetup {
    fn name(&self) -> &'static str {
        "ssh engine"
    }

    fn layout(&self, workers: Option<u32>) -> WorkerLayout {
        match workers {
            Some(n) => WorkerLayout::spread(&self.hosts, n),
            None => WorkerLayout::local(&crate::env::local_hostname(), 1),
        }
    }

    fn prepare(&self, plan: &Plan) -> Result<(), LaunchError> {
        self.check_hosts_refusing(
            &plan.project_dir,
            plan.env_dir.as_deref(),
            &work_inputs(plan),
            &|host| self.unshared_checkpoints(plan, None, host),
        )
    }

    fn remote_hosts(&self) -> bool {
        true
    }

    /// A host that host discovery names: one of the run's hosts was checked before the run; any other gets the same
    /// host check and delivery now (a name ssh would read as an option, or that a shell would split, is refused).
    /// Only the growing step's checkpoints decide whether a host without the project directory is refused.
    fn reach_host(&self, plan: &Plan, step: &PlannedStep, host: &str) -> Result<(), LaunchError> {
        if self.hosts.iter().any(|(h, _)| h == host) {
            return Ok(());
        }
        check_discovered_name(host)?;
        let one = SshSetup {
            hosts: vec![(host.to_owned(), 1)],
            ..self.clone()
        };
        one.check_hosts_refusing(
            &plan.project_dir,
            plan.env_dir.as_deref(),
            &work_inputs(plan),
            &|host| one.unshared_checkpoints(plan, Some(&step.name), host),
        )
    }

    /// `ssh HOST -- true` (the run's ssh options), killed past `within`.
    fn probe_host(&self, host: &str, within: Duration) -> Option<bool> {
        let argv = self.argv(host, "true");
        let mut ssh = Command::new(&argv[0]);
        ssh.args(&argv[1..]);
        // ssh's own failures (refused, unreachable, no route) say the host was not reached, as its silence does.
        Some(exits_within(&mut ssh, within).unwrap_or(false))
    }

    fn rendezvous(&self) -> (IpAddr, Vec<IpAddr>) {
        (self.bind_ip, self.allowed_peers())
    }

    /// `ssh HOST WRAPPER...`: the rank's variables travel on its stdin after the token ([`stdin_vars`]); the local
    /// ssh process must not carry the rank's (the host's wrapper kills leftovers by them, and a host may be this
    /// machine).
    fn rank_command(&self, rank: &RankStart<'_>) -> Result<RankCommand, LaunchError> {
        let Some(rendezvous) = rank.rendezvous else {
            return Ok(RankCommand::local(rank));
        };
        let (plan, step, slot) = (rank.plan, rank.step, rank.slot);
        let vars = self.rank_vars(started_rank_env(rank, rendezvous));
        let after_token = stdin_vars(&vars, "the ssh engine")?;
        let hvd = self.pulling_hvd(&slot.host);
        let argv = self.rank_argv(plan, step, slot, rendezvous.addr.ip(), hvd.as_deref())?;
        Ok(RankCommand::remote_argv(&argv, after_token, false))
    }

    fn dry_run_rank(&self, plan: &Plan, step: &PlannedStep, slot: &Slot) -> Vec<String> {
        self.dry_run_lines(plan, step, slot)
    }
}

/// How `command` (stdin closed, output dropped) ended within `within`: `Some(true)` exit 0, `Some(false)` another
/// exit, `None` killed at the deadline (or not started).
pub(crate) fn exits_within(command: &mut Command, within: Duration) -> Option<bool> {
    let out = remote::bounded_output(command, None, 4096, within).ok()?;
    (!out.timed_out).then_some(out.status.success())
}

fn engine_error(message: String) -> LaunchError {
    LaunchError::Engine(message)
}

/// Refuses a host name that ssh would read as an option (`-oProxyCommand=...` runs a command here) or that a shell
/// would split.
fn check_host_name(host: &str) -> Result<(), LaunchError> {
    match host.starts_with('-') || host.bytes().any(|b| b.is_ascii_whitespace()) {
        true => Err(engine_error(format!(
            "host `{host}` is not a host name for ssh (it starts with `-` or contains white space)"
        ))),
        false => Ok(()),
    }
}

/// Refuses a host name from host discovery (hostile input) that is not a plain host name or address: ASCII letters,
/// digits, `.`, `-`, `_` and `:` (IPv6), not starting with `-`. ssh would read `-...` as an option, and a shell
/// character could reach a shell through the user's ssh config (`ProxyCommand ... %h`).
fn check_discovered_name(host: &str) -> Result<(), LaunchError> {
    if host.is_empty() {
        return Err(engine_error(
            "host discovery named an empty host; a host name is needed".to_owned(),
        ));
    }
    check_host_name(host)?;
    match host
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_' | b':'))
    {
        true => Ok(()),
        false => Err(engine_error(format!(
            "host `{host}` is not a host name for ssh (letters, digits, `.`, `-`, `_` and `:` only)"
        ))),
    }
}

/// The files the distributed steps of `plan` need on a host without the project directory: their `inputs`, or all
/// of it (empty) when one of them declares none.
fn work_inputs(plan: &Plan) -> Vec<String> {
    let distributed = plan.steps.iter().filter(|s| s.workers.is_some());
    if distributed.clone().any(|s| s.inputs.is_empty()) {
        Vec::new()
    } else {
        distributed.flat_map(|s| s.inputs.iter().cloned()).collect()
    }
}

impl SshSetup {
    /// Reads hosts and options for the ssh engine: `--hosts`/`--hostfile` (else `cluster { hosts }`), resolves every
    /// host (through `ssh -G`, so ssh config aliases work) and chooses the rendezvous address.
    pub fn new(project: &Project, options: &RunOptions) -> Result<Self, LaunchError> {
        let settings = project
            .cluster
            .as_ref()
            .map(|c| c.settings.clone())
            .unwrap_or_default();
        let hosts = super::hosts(project, options)?;
        // A host named twice is one host with the slots of both entries (as mpirun reads a hostfile).
        let mut merged: Vec<(String, u32)> = Vec::new();
        for (host, slots) in hosts {
            match merged.iter_mut().find(|(h, _)| *h == host) {
                Some((_, n)) => *n = n.saturating_add(slots),
                None => merged.push((host, slots)),
            }
        }
        let hosts = merged;
        if hosts.is_empty() {
            return Err(engine_error(
                "the ssh engine needs hosts: `--hosts h1:4,h2:4`, `--hostfile FILE` (`host slots=N` lines) or \
                 `cluster { hosts = [\"h1:4\", \"h2:4\"] }`"
                    .into(),
            ));
        }
        for (host, _) in &hosts {
            check_host_name(host)?;
        }
        // Every variable reaches a remote rank as `export NAME=VALUE` in its wrapper: refuse a name it cannot take
        // before anything starts.
        let names = project.env.variables.keys();
        check_var_names(
            names.chain(project.steps.iter().flat_map(|s| s.env.keys())),
            "the ssh engine",
        )?;
        let ssh_options = &options.ssh;
        let port = ssh_options.port.or(settings.ssh_port);
        let identity = ssh_options.identity.clone().or(settings.ssh_identity);
        let config = ssh_options.config.clone().or(settings.ssh_config);
        let interface = ssh_options
            .network_interface
            .clone()
            .or(settings.network_interface);
        let ssh = ssh_argv(port, identity.as_deref(), config.as_deref());
        let mut host_addrs = Vec::new();
        for (host, _) in &hosts {
            let addr = resolve(&ssh, host)?;
            if !host_addrs.contains(&addr) {
                host_addrs.push(addr);
            }
        }
        let bind_ip = match &interface {
            Some(name) => interface_ipv4(name)?,
            None => route_source(host_addrs[0])?,
        };
        Ok(SshSetup {
            hosts,
            ssh,
            bind_ip,
            interface,
            host_addrs,
            grace: options.grace,
            copy_env: ssh_options.copy_env || settings.copy_env == Some(true),
            caches: options.caches.clone(),
            trusted_keys: options.trusted_keys.clone(),
            hvd: options.shim.clone(),
            work_dirs: Arc::default(),
            pulling_hvds: Arc::default(),
            deadlines: Deadlines::new(options.start_timeout),
            transport: Transport::Ssh,
            rank_dir: None,
        })
    }

    /// Peers answered on the rendezvous server's token-less endpoints: the hosts, and this machine's own address.
    pub fn allowed_peers(&self) -> Vec<IpAddr> {
        let mut peers = self.host_addrs.clone();
        if !peers.contains(&self.bind_ip) {
            peers.push(self.bind_ip);
        }
        peers
    }

    /// The variables a remote rank gets on its stdin ([`stdin_vars`]), from the local engine's `vars` (the same contract):
    /// the token is left out (it travels on stdin), `MASTER_ADDR` is rank 0's host, and the interface variables
    /// name `--network-interface` (or are left to the wrapper's detection). `PATH` is passed on as mpirun's `-x
    /// PATH` would.
    pub fn remote_vars(
        &self,
        vars: &[(String, String)],
        rank0_host: &str,
    ) -> Vec<(String, String)> {
        let mut out: BTreeMap<String, String> = BTreeMap::new();
        if let Ok(path) = std::env::var("PATH") {
            out.insert("PATH".into(), path);
        }
        for (k, v) in vars {
            out.insert(k.clone(), v.clone());
        }
        out.remove("HVD_JOB_TOKEN");
        if out.contains_key("MASTER_ADDR") {
            out.insert("MASTER_ADDR".into(), rank0_host.to_owned());
        }
        for name in INTERFACE_VARS {
            out.remove(name);
        }
        if let Some(iface) = &self.interface {
            for name in INTERFACE_VARS {
                out.insert(name.into(), iface.clone());
            }
        }
        out.into_iter().collect()
    }

    /// The remote command for one rank (see the module docs), quoted for the host's login shell: `exec /bin/sh -c
    /// WRAPPER hvd-rank DIR TICKS IP /bin/sh -c COMMAND`. The wrapper is the same for every rank; `IP` (the
    /// rendezvous address, to find the interface that reaches it) is empty with `--network-interface`. The rank's
    /// variables ([`SshSetup::remote_vars`]) go on its stdin ([`stdin_vars`]).
    pub fn wrapper(&self, command: &str, dir: &Path, rendezvous_ip: IpAddr) -> String {
        self.wrapper_through(&[], command, dir, rendezvous_ip)
    }

    /// [`SshSetup::wrapper`] with `through` (words of a program that execs the rest, `hvd worker-env --once
    /// --pull=ENV ... --`) before `/bin/sh -c COMMAND`.
    pub fn wrapper_through(
        &self,
        through: &[String],
        command: &str,
        dir: &Path,
        rendezvous_ip: IpAddr,
    ) -> String {
        let detect = match self.interface {
            None => rendezvous_ip.to_string(),
            Some(_) => String::new(),
        };
        let mut s = format!(
            "exec /bin/sh -c {} hvd-rank {} {} {}",
            quote(WRAPPER),
            quote(&dir.display().to_string()),
            (self.grace.as_millis() / 100).max(1),
            quote(&detect)
        );
        for word in through {
            s.push(' ');
            s.push_str(&quote(word));
        }
        s.push_str(" /bin/sh -c ");
        s.push_str(&quote(command));
        s
    }

    /// The full command line for `host`: `ssh OPTIONS HOST -- REMOTE` (`REMOTE` as the host's login shell gets it),
    /// or through `kubectl exec` ([`Transport::KubectlExec`]).
    pub fn argv(&self, host: &str, remote: &str) -> Vec<String> {
        match &self.transport {
            Transport::Ssh => {
                let mut argv = self.ssh.clone();
                argv.extend([host.to_owned(), "--".into(), remote.to_owned()]);
                argv
            }
            Transport::KubectlExec {
                namespace,
                container,
            } => {
                let mut argv: Vec<String> = vec!["kubectl".into(), "exec".into(), "-i".into()];
                if let Some(ns) = namespace {
                    argv.extend(["-n".into(), ns.clone()]);
                }
                argv.extend([
                    host.to_owned(),
                    "-c".into(),
                    container.clone(),
                    "--".into(),
                    "/bin/sh".into(),
                    "-c".into(),
                    remote.to_owned(),
                ]);
                argv
            }
        }
    }

    /// The variables of a rank on its host ([`remote_rank_env`]), through [`SshSetup::remote_vars`].
    pub fn rank_vars(&self, env: RemoteRankEnv<'_>) -> Vec<(String, String)> {
        self.remote_vars(&env.vars, env.rank0_host)
    }

    /// The `hvd` whose `worker-env --pull` starts the ranks on `host` (see [`SshSetup::pulling_hvds`]).
    fn pulling_hvd(&self, host: &str) -> Option<String> {
        self.pulling_hvds
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(host)
            .cloned()
    }

    /// The ssh command line of rank `slot` of `step` (its variables go on its stdin: [`stdin_vars`]), started with
    /// `hvd`, the host's `hvd` that pulls ([`SshSetup::pulling_hvd`]; `None`: the rank starts without a pull);
    /// `rendezvous` is the address the wrapper finds the interface for.
    pub fn rank_argv(
        &self,
        plan: &Plan,
        step: &PlannedStep,
        slot: &Slot,
        rendezvous: IpAddr,
        hvd: Option<&str>,
    ) -> Result<Vec<String>, LaunchError> {
        let work_dir = self
            .work_dirs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .get(&slot.host)
            .cloned();
        let dir = self
            .rank_dir
            .as_deref()
            .or(work_dir.as_deref())
            .unwrap_or(&plan.project_dir);
        let through = match hvd {
            Some(hvd) => self.pull_through(plan.env_dir.as_deref(), hvd)?,
            None => Vec::new(),
        };
        let remote = self.wrapper_through(&through, &step.command, dir, rendezvous);
        Ok(self.argv(&slot.host, &remote))
    }

    /// `HVD worker-env --once --pull=ENV --cache=URL... --trusted-key=KEY... --` for a host that gets the env from the
    /// caches (its `hvd` is `hvd`): a rank's shim finds the env the host check pulled (or pulls it again, verified,
    /// when an `hvd gc` there removed it since) and holds a temporary gc root on it until the rank has ended. Empty
    /// without caches or an env that is not a store path.
    pub(crate) fn pull_through(
        &self,
        env: Option<&Path>,
        hvd: &str,
    ) -> Result<Vec<String>, LaunchError> {
        let pull = super::pull_argv_for(env, &self.caches, &self.trusted_keys, Path::new(hvd))?;
        Ok(match (pull, env) {
            (Some(pull), Some(env)) => {
                let mut argv = super::worker_pull_argv(&pull, &env.display().to_string(), true);
                argv.push("--".into());
                argv
            }
            _ => Vec::new(),
        })
    }

    /// The lines `hvd run --dry-run` shows for rank `slot` of `step` ([`dry_run_lines`]): the ports and the run id,
    /// chosen when the step starts, are shown as `<port>`, `<master-port>` and `<run id>`.
    pub fn dry_run_lines(&self, plan: &Plan, step: &PlannedStep, slot: &Slot) -> Vec<String> {
        let vars = self.rank_vars(dry_run_rank_env(plan, step, slot, self.bind_ip));
        // With caches, the host check (not run for a dry run) pulls the env with the host's `hvd`: the launcher's
        // path there, else `hvd` on its PATH.
        let hvd = self.pulling_hvd(&slot.host).or_else(|| {
            (!self.caches.is_empty()).then(|| {
                self.hvd
                    .as_deref()
                    .map_or("hvd".into(), |p| p.display().to_string())
            })
        });
        let argv = self.rank_argv(plan, step, slot, self.bind_ip, hvd.as_deref());
        dry_run_lines("ssh", argv, &vars, "the ssh engine")
    }
}

/// `ssh` with the options every connection uses: never prompt (BatchMode), no terminal, a connect timeout, and a
/// connection whose peer stops answering for a minute is dropped (ServerAlive).
const SSH: [&str; 10] = [
    "ssh",
    "-T",
    "-o",
    "BatchMode=yes",
    "-o",
    "ConnectTimeout=30",
    "-o",
    "ServerAliveInterval=15",
    "-o",
    "ServerAliveCountMax=4",
];

/// [`SSH`] with the user's `-F`, `-p` and `-i`, where given.
fn ssh_argv(port: Option<u16>, identity: Option<&Path>, config: Option<&Path>) -> Vec<String> {
    let mut argv: Vec<String> = SSH.iter().map(|s| (*s).to_owned()).collect();
    if let Some(config) = config {
        argv.extend(["-F".into(), config.display().to_string()]);
    }
    if let Some(port) = port {
        argv.extend(["-p".into(), port.to_string()]);
    }
    if let Some(identity) = identity {
        argv.extend(["-i".into(), identity.display().to_string()]);
    }
    argv
}

/// The address of `host`: an IP address as is, else the `hostname` ssh would connect to (`ssh -G`, which applies
/// the ssh config without connecting) resolved by the system resolver.
fn resolve(ssh: &[String], host: &str) -> Result<IpAddr, LaunchError> {
    if let Ok(ip) = host.parse::<IpAddr>() {
        return Ok(ip);
    }
    let mut name = host.to_owned();
    if let Ok(out) = Command::new(&ssh[0])
        .args(&ssh[1..])
        .arg("-G")
        .arg(host)
        .stdin(Stdio::null())
        .output()
        && out.status.success()
        && let Some(h) = String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("hostname "))
    {
        name = h.trim().to_owned();
    }
    resolve_host(&name).map_err(|e| {
        if name == host {
            e
        } else {
            engine_error(format!("{e} (ssh connects to `{name}` for host `{host}`)"))
        }
    })
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use std::io::Write as _;
    use std::net::Ipv4Addr;

    pub(crate) fn setup(interface: Option<&str>) -> SshSetup {
        SshSetup {
            hosts: vec![("h1".into(), 2), ("h2".into(), 2)],
            ssh: ssh_argv(
                Some(2222),
                Some(Path::new("/k/id")),
                Some(Path::new("/k/cfg")),
            ),
            bind_ip: "10.0.0.1".parse().unwrap(),
            interface: interface.map(str::to_owned),
            host_addrs: vec!["10.0.0.2".parse().unwrap(), "10.0.0.3".parse().unwrap()],
            grace: Duration::from_secs(2),
            copy_env: false,
            caches: Vec::new(),
            trusted_keys: Vec::new(),
            hvd: None,
            work_dirs: Arc::default(),
            pulling_hvds: Arc::default(),
            deadlines: Deadlines::new(None),
            transport: Transport::Ssh,
            rank_dir: None,
        }
    }

    #[test]
    fn the_ssh_command_line_carries_options_host_and_wrapper() {
        let s = setup(Some("eth1"));
        let vars = vec![
            ("HVD_RANK".to_string(), "3".to_string()),
            ("HVD_JOB_TOKEN".to_string(), "secret".to_string()),
            ("MASTER_ADDR".to_string(), "10.0.0.1".to_string()),
            ("NCCL_SOCKET_IFNAME".to_string(), "lo".to_string()),
            ("X".to_string(), "a b".to_string()),
        ];
        let remote = s.remote_vars(&vars, "h1");
        let get = |k: &str| remote.iter().find(|(n, _)| n == k).map(|(_, v)| v.as_str());
        assert_eq!(get("HVD_JOB_TOKEN"), None, "the token travels on stdin");
        assert_eq!(get("MASTER_ADDR"), Some("h1"));
        assert_eq!(get("NCCL_SOCKET_IFNAME"), Some("eth1"));
        assert_eq!(get("GLOO_SOCKET_IFNAME"), Some("eth1"));
        let wrapper = s.wrapper("python t.py", Path::new("/p q"), s.bind_ip);
        assert!(
            wrapper.contains(" hvd-rank '/p q' 20 '' /bin/sh -c "),
            "{wrapper}"
        );
        // The variables go on stdin after the token, never on the command line.
        let stdin = stdin_vars(&remote, "the ssh engine").unwrap();
        assert!(stdin.lines().any(|l| l == "X=a b"), "{stdin}");
        assert!(stdin.ends_with("\n\n"), "{stdin}");
        assert!(
            !wrapper.contains("X=a b") && !wrapper.contains("MASTER_ADDR"),
            "{wrapper}"
        );
        assert!(!wrapper.contains("secret") && !stdin.contains("secret"));
        let argv = s.argv("h2", &wrapper);
        // The options' words themselves are checked where they are printed (tests/engine_ssh.rs, a dry run).
        assert_eq!(argv[..10], SSH);
        assert_eq!(argv[10..16], ["-F", "/k/cfg", "-p", "2222", "-i", "/k/id"]);
        assert_eq!(argv[16..18], ["h2", "--"]);
        assert_eq!(argv[18], wrapper);
        assert!(wrapper.ends_with(" /bin/sh -c 'python t.py'"), "{wrapper}");
        assert!(!WRAPPER.contains('\''));
        // Without an interface, each host finds the one that reaches the rendezvous.
        let s = setup(None);
        let remote = s.remote_vars(&vars, "h1");
        assert!(
            remote
                .iter()
                .all(|(k, _)| !INTERFACE_VARS.contains(&k.as_str()))
        );
        let wrapper = s.wrapper("true", Path::new("/p"), s.bind_ip);
        assert!(wrapper.contains(" hvd-rank /p 20 10.0.0.1 "), "{wrapper}");
        let bad = vec![("A-B".to_string(), "1".to_string())];
        let err = stdin_vars(&bad, "the ssh engine").unwrap_err().to_string();
        assert!(
            err.contains("`A-B` is not a valid environment variable name for the ssh engine"),
            "{err}"
        );
        let nul = vec![("A".to_string(), "x\0y".to_string())];
        assert!(stdin_vars(&nul, "the ssh engine").is_err());
        // Names the host's shell owns (read-only or computed in bash) or the wrapper's own, and too much to send.
        for name in ["UID", "PPID", "RANDOM", "OPTIND", "_hvd_v"] {
            let err = stdin_vars(&[(name.to_string(), "1".to_string())], "the ssh engine")
                .unwrap_err()
                .to_string();
            assert!(err.contains(&format!("`{name}` cannot be given")), "{err}");
        }
        let big = vec![("BIG".to_string(), "x".repeat(STDIN_VARS_MAX))];
        let err = stdin_vars(&big, "the ssh engine").unwrap_err().to_string();
        assert!(err.contains("pass large values through a file"), "{err}");
    }

    /// With caches, a rank on a host that pulls starts through that host's `hvd worker-env --once --pull` (which
    /// roots the env until the rank ends); the words come before `/bin/sh -c COMMAND` and exec it.
    #[test]
    fn a_pulling_hosts_ranks_start_through_the_shims_pull() {
        let mut s = setup(Some("lo"));
        let env = Path::new("/s/0123456789abcdef0123456789abcdef-t-env");
        assert_eq!(
            s.pull_through(Some(env), "/opt/hvd").unwrap(),
            Vec::<String>::new()
        );
        s.caches = vec!["file:///c d".into()];
        s.trusted_keys = vec!["k:AAAA".into()];
        assert_eq!(
            s.pull_through(Some(env), "/opt/hvd").unwrap(),
            [
                "/opt/hvd",
                "worker-env",
                "--once",
                "--pull=/s/0123456789abcdef0123456789abcdef-t-env",
                "--cache=file:///c d",
                "--trusted-key=k:AAAA",
                "--"
            ]
        );
        // Not a store path (an env hvd did not build): nothing to pull.
        assert!(
            s.pull_through(Some(Path::new("/envs/e1")), "/opt/hvd")
                .unwrap()
                .is_empty()
        );
        s.caches = vec!["https://u:secret@c.example/p".into()];
        assert!(s.pull_through(Some(env), "/opt/hvd").is_err());
        let dir = tempfile::tempdir().unwrap();
        let through = ["/usr/bin/env".to_owned(), "THROUGH=it ran".to_owned()];
        let wrapper = s.wrapper_through(&through, "echo \"$THROUGH\"", dir.path(), s.bind_ip);
        assert!(
            wrapper.ends_with(" /usr/bin/env 'THROUGH=it ran' /bin/sh -c 'echo \"$THROUGH\"'"),
            "{wrapper}"
        );
        let mut child = spawn_wrapper(&wrapper);
        let mut input = child.stdin.take().unwrap();
        input.write_all(b"tok\n\n").unwrap();
        // Open while the rank runs, as ssh's stdin is (its end would stop the rank).
        let out = child.wait_with_output().unwrap();
        drop(input);
        assert_eq!(String::from_utf8_lossy(&out.stdout), "it ran\n");
    }

    /// Starts the wrapper here as ssh would start it on a host, with stdin and stdout piped.
    fn spawn_wrapper(wrapper: &str) -> std::process::Child {
        Command::new("/bin/sh")
            .arg("-c")
            .arg(wrapper)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// The stdin a rank's ssh gets from the launcher: the token line, then `vars` ([`stdin_vars`]).
    fn token_and(token: &str, vars: &[(String, String)]) -> Vec<u8> {
        format!("{token}\n{}", stdin_vars(vars, "the ssh engine").unwrap()).into_bytes()
    }

    /// Feeds a started wrapper the token and `vars` and waits for its rank's first line, `ready`; returns the rank's
    /// stdin (its end would stop the rank) and the rest of its stdout.
    fn until_ready(
        child: &mut std::process::Child,
        vars: &[(String, String)],
    ) -> (
        std::process::ChildStdin,
        std::io::BufReader<std::process::ChildStdout>,
    ) {
        use std::io::BufRead;
        let mut input = child.stdin.take().unwrap();
        input.write_all(&token_and("tok", vars)).unwrap();
        let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        assert_eq!(line, "ready\n");
        (input, out)
    }

    /// Runs the wrapper locally as ssh would run it remotely, feeding `stdin`; returns (code, stdout).
    fn run_wrapper(s: &SshSetup, command: &str, stdin: &[u8]) -> (Option<i32>, String) {
        let dir = tempfile::tempdir().unwrap();
        let wrapper = s.wrapper(command, dir.path(), s.bind_ip);
        let mut child = spawn_wrapper(&wrapper);
        let mut input = child.stdin.take().unwrap();
        input.write_all(stdin).unwrap();
        if stdin.is_empty() {
            drop(input);
            let out = child.wait_with_output().unwrap();
            return (
                out.status.code(),
                String::from_utf8_lossy(&out.stdout).into_owned(),
            );
        }
        // stdin stays open while the command runs, as ssh's does: its end would stop the command.
        let out = child.wait_with_output().unwrap();
        drop(input);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
        )
    }

    /// `PREEMPT TICKS` on stdin: SIGTERM reaches the rank past the `/bin/sh -c` leader, which outlives it and ends
    /// with the rank's own status (a hand-over, exit 0), instead of dying first with the whole group.
    #[test]
    fn a_preempt_line_terms_the_rank_past_its_shell_and_lets_it_hand_over() {
        let s = setup(Some("lo"));
        let dir = tempfile::tempdir().unwrap();
        let vars = s.remote_vars(&[], "h1");
        // A compound command: the leader is sh; the rank (a Python process, as hvd.elastic's) hands over on SIGTERM.
        let command = "python3 -c 'import signal, sys, time\n\
                       signal.signal(signal.SIGTERM, lambda *a: (print(\"handed-over\", flush=True), sys.exit(0)))\n\
                       print(\"ready\", flush=True)\ntime.sleep(60)'; c=$?; echo leader-after $c; exit $c";
        let wrapper = s.wrapper(command, dir.path(), s.bind_ip);
        let mut child = spawn_wrapper(&wrapper);
        let (mut input, mut out) = until_ready(&mut child, &vars);
        crate::engine::send_preempt(&mut input, Duration::from_secs(5));
        let mut rest = String::new();
        std::io::Read::read_to_string(&mut out, &mut rest).unwrap();
        let status = child.wait().unwrap();
        drop(input);
        assert!(rest.contains("handed-over\nleader-after 0\n"), "{rest}");
        assert_eq!(status.code(), Some(0), "{rest}");
    }

    #[test]
    fn the_wrapper_passes_token_variables_and_exit_code() {
        let s = setup(Some("lo"));
        let vars = s.remote_vars(&[("Y".to_string(), "it's y".to_string())], "h1");
        let (code, out) = run_wrapper(
            &s,
            "echo \"$HVD_JOB_TOKEN|$Y|$NCCL_SOCKET_IFNAME|$(pwd)\"; grep SigIgn /proc/$$/status; exit 7",
            &token_and("tok", &vars),
        );
        assert_eq!(code, Some(7), "{out}");
        let mut lines = out.lines();
        let first = lines.next().unwrap();
        assert!(first.starts_with("tok|it's y|lo|/"), "{out}");
        // SIGINT and SIGQUIT are not ignored (they would be for a plain `&` job), so Ctrl-C reaches Python.
        let ignored = lines.next().unwrap().trim_start_matches("SigIgn:").trim();
        let mask = u64::from_str_radix(ignored, 16).unwrap();
        assert_eq!(mask & 0b110, 0, "{out}");
        // No token line, or stdin ending before the variables do: a clear error, and the command never runs.
        let (code, _) = run_wrapper(&s, "true", b"");
        assert_eq!(code, Some(125));
        for bad in [
            &b"tok\nnot a variable\n\n"[..],
            b"tok\nA-B=1\n\n",
            b"tok\n=1\n\n",
        ] {
            let (code, out) = run_wrapper(&s, "echo ran", bad);
            assert_eq!((code, out.as_str()), (Some(125), ""));
        }
        let dir = tempfile::tempdir().unwrap();
        let mut child = spawn_wrapper(&s.wrapper("echo ran", dir.path(), s.bind_ip));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(b"tok\nA=1\n")
            .unwrap();
        let out = child.wait_with_output().unwrap();
        assert_eq!((out.status.code(), &out.stdout[..]), (Some(125), &b""[..]));
    }

    /// Values reach the rank byte for byte whatever they hold (quotes, backslashes and what `printf %b` would read
    /// as escapes, newlines, globs, `$(...)`), a user's `IFS` and `PATH` change nothing in the wrapper, and while the
    /// rank runs no process's command line (what `ps` shows every local user) holds any value: the attacker is
    /// another user of the host reading `/proc/*/cmdline`.
    #[test]
    fn the_ranks_variables_reach_it_exactly_and_no_command_line_shows_them() {
        let s = setup(Some("lo"));
        let dir = tempfile::tempdir().unwrap();
        let secret = "s3cr3t-4f1d9c";
        let odd =
            format!("{secret} it's \\ \\n \\c \\0101 %s %b\nline two\n\n*  $(id) `id` \"q\"\t\\");
        let mut vars = vec![
            ("ODD".to_string(), odd.clone()),
            ("IFS".to_string(), ":/".to_string()),
            ("PATH".to_string(), format!("/nonexistent-{secret}")),
            ("HVD_RANK".to_string(), "0".to_string()),
            (
                "HVD_RUN_STEP".to_string(),
                format!("run/{}", std::process::id()),
            ),
            ("zz".to_string(), "last".to_string()),
        ];
        // Names the wrapper's own shells use (`d=-i` given to `env` would empty the rank's environment).
        for n in ["a", "k", "v", "l", "S", "E", "d", "X", "W"] {
            let value = if n == "d" {
                "-i".into()
            } else {
                format!("user-{n}")
            };
            vars.push((n.to_string(), value));
        }
        // The rank writes the values to files, says so, and waits for stdin's stop line.
        let command = "/usr/bin/printf %s \"$ODD\" > odd; \
                       printf %s\\| \"$a\" \"$k\" \"$v\" \"$l\" \"$S\" \"$E\" \"$d\" \"$X\" \"$W\" \"$zz\" \"${t-unset}\" \"${_hvd_l-unset}\" \"${_hvd_v-unset}\" > own; \
                       echo ready; exec /bin/sleep 60";
        let wrapper = s.wrapper(command, dir.path(), s.bind_ip);
        // srun passes the launcher's environment: an exported name the wrapper uses must not reach the rank.
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(&wrapper)
            .env("t", "inherited")
            .env("_hvd_l", "inherited")
            .env("_hvd_v", "inherited")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let (mut input, _out) = until_ready(&mut child, &vars);
        let shown: Vec<(String, String)> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .bytes()
                    .all(|b| b.is_ascii_digit())
            })
            .filter_map(|e| {
                let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
                let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                text.contains(secret)
                    .then(|| (e.file_name().to_string_lossy().into_owned(), text))
            })
            .collect();
        crate::engine::send_stop(&mut input, libc::SIGTERM);
        drop(input);
        child.wait().unwrap();
        assert!(shown.is_empty(), "command lines showing a value: {shown:?}");
        assert_eq!(
            std::fs::read_to_string(dir.path().join("odd")).unwrap(),
            odd
        );
        assert_eq!(
            std::fs::read_to_string(dir.path().join("own")).unwrap(),
            "user-a|user-k|user-v|user-l|user-S|user-E|-i|user-X|user-W|last|unset|unset|unset|"
        );
    }

    /// `ALIVE` lines (the launcher's keepalives) are skipped: a rank fed them runs to its end and exits with its own
    /// status; a stop behind them still stops it.
    #[test]
    fn keepalive_lines_leave_the_rank_running() {
        let s = setup(Some("lo"));
        let (code, out) = run_wrapper(
            &s,
            "sleep 1; echo finished",
            b"tok\n\nALIVE\nALIVE\nALIVE\n",
        );
        assert_eq!((code, out.trim()), (Some(0), "finished"));
        let (code, out) = run_wrapper(&s, "sleep 3; echo survived", b"tok\n\nALIVE\nALIVE\nTERM\n");
        assert_eq!((code, out.trim()), (Some(143), ""));
    }

    /// A stop already in the pipe behind the variables (Ctrl-C or a failing rank while ssh was still connecting) stops
    /// the rank with that very signal: the watcher may read it before the command's session exists, and waits for it
    /// instead of giving up; SIGINT is at its default from before the session (a background job starts with it
    /// ignored), so Ctrl-C ends the rank at once rather than SIGKILL after the grace period (20 tenths here).
    #[test]
    fn a_stop_right_behind_the_variables_stops_the_rank() {
        let s = setup(Some("lo"));
        let dir = tempfile::tempdir().unwrap();
        let vars: Vec<(String, String)> = (0..30)
            .map(|i| (format!("V{i}"), format!("C:\\data\\{i}")))
            .collect();
        let wrapper = s.wrapper("sleep 3; echo survived", dir.path(), s.bind_ip);
        for (round, (stop, code)) in [("TERM", 143), ("INT", 130)]
            .iter()
            .cycle()
            .take(12)
            .enumerate()
        {
            let mut child = spawn_wrapper(&wrapper);
            let mut input = child.stdin.take().unwrap();
            let mut all = token_and("tok", &vars);
            all.extend_from_slice(format!("{stop}\n").as_bytes());
            input.write_all(&all).unwrap();
            let out = child.wait_with_output().unwrap();
            drop(input);
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                !stdout.contains("survived"),
                "round {round} ({stop}): the rank outlived its stop"
            );
            assert_eq!(out.status.code(), Some(*code), "round {round} ({stop})");
        }
    }

    #[test]
    fn closing_stdin_stops_the_command_and_everything_it_started() {
        let s = setup(Some("lo"));
        let dir = tempfile::tempdir().unwrap();
        let pidfile = dir.path().join("pids");
        // The command starts a grandchild in its group, then would run for a minute.
        let command = format!(
            "sleep 60 & echo $! > {p}; echo $$ >> {p}; echo started; wait",
            p = pidfile.display()
        );
        let wrapper = s.wrapper(&command, dir.path(), s.bind_ip);
        let mut child = spawn_wrapper(&wrapper);
        let mut input = child.stdin.take().unwrap();
        input.write_all(b"tok\n\n").unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let mut buf = [0u8; 8];
        let n = std::io::Read::read(&mut stdout, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"started\n");
        crate::engine::send_stop(&mut input, libc::SIGTERM);
        drop(input);
        let status = child.wait().unwrap();
        // sh died of SIGTERM: the wrapper reports 128 + 15.
        assert_eq!(status.code(), Some(143));
        let pids = std::fs::read_to_string(&pidfile).unwrap();
        // SIGKILL was sent before the wrapper exited; dying takes the kernel a moment (bounded wait).
        let gone = |pid: &str| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .map_or(true, |s| s.contains(") Z ") || s.contains(") X "))
        };
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        for pid in pids.split_whitespace() {
            while !gone(pid) && std::time::Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(10));
            }
            assert!(gone(pid), "process {pid} outlived the wrapper");
        }
    }

    #[test]
    fn the_cluster_block_configures_the_engine_and_flags_win() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.hvd");
        std::fs::write(
            &file,
            "project \"t\"\nenv {\n  python = \"3.11\"\n  packages = []\n}\ncluster {\n  engine = \"ssh\"\n  \
             hosts = [\"127.0.0.1:1\", \"localhost:2\"]\n  settings = { ssh_port = \"2222\", ssh_config = \"/c\", \
             network_interface = \"lo\", copy_env = \"true\" }\n}\nstep once {\n  run = \"true\"\n}\n\
             step train {\n  run = \"echo hi\"\n  workers = 3\n}\n",
        )
        .unwrap();
        let project = hvd_lang::load_file(&file).unwrap();
        let plan = crate::plan(&project, &RunOptions::default()).unwrap();
        let ssh = SshSetup::new(&project, &RunOptions::default()).unwrap();
        assert_eq!(
            ssh.hosts,
            [("127.0.0.1".to_string(), 1), ("localhost".to_string(), 2)]
        );
        assert_eq!(ssh.bind_ip, IpAddr::V4(Ipv4Addr::LOCALHOST));
        assert!(ssh.copy_env);
        assert!(
            ssh.ssh.windows(2).any(|w| w == ["-p", "2222"]),
            "{:?}",
            ssh.ssh
        );
        assert!(
            ssh.ssh.windows(2).any(|w| w == ["-F", "/c"]),
            "{:?}",
            ssh.ssh
        );
        // By slot; the step that runs once runs here.
        let train = &plan.steps[1];
        let hosts: Vec<&str> = train.layout.slots.iter().map(|s| s.host.as_str()).collect();
        assert_eq!(hosts, ["127.0.0.1", "localhost", "localhost"]);
        assert_eq!(plan.steps[0].layout.slots.len(), 1);
        let rendered = plan.render();
        assert!(
            rendered.contains("ssh engine, rendezvous on 127.0.0.1"),
            "{rendered}"
        );
        assert_eq!(
            rendered.matches("       ssh: ssh ").count(),
            3,
            "{rendered}"
        );
        // Flags win over the file.
        let options = crate::RunOptions {
            hosts: Some(vec!["127.0.0.1:4".into()]),
            ssh: crate::options::SshOptions {
                port: Some(22),
                ..Default::default()
            },
            ..crate::RunOptions::default()
        };
        let ssh = SshSetup::new(&project, &options).unwrap();
        assert_eq!(ssh.hosts, [("127.0.0.1".to_string(), 4)]);
        assert!(
            ssh.ssh.windows(2).any(|w| w == ["-p", "22"]),
            "{:?}",
            ssh.ssh
        );
    }

    /// What host discovery prints is hostile: only plain host names and addresses are taken.
    #[test]
    fn discovered_host_names_are_plain_names_or_addresses() {
        for ok in ["node-1", "node_2.example", "10.0.0.2", "fe80::1", "H3"] {
            assert!(check_discovered_name(ok).is_ok(), "{ok}");
        }
        for bad in [
            "-oProxyCommand=touch${IFS}x",
            "h;touch${IFS}x",
            "h$(id)",
            "`id`",
            "user@h",
            "h%h",
            "a\tb",
            "-F",
        ] {
            let e = check_discovered_name(bad).unwrap_err().to_string();
            assert!(e.contains("is not a host name for ssh"), "{bad}: {e}");
        }
        let e = check_discovered_name("").unwrap_err().to_string();
        assert!(e.contains("an empty host"), "{e}");
    }

    /// A host name that ssh would read as an option (`-oProxyCommand=...` runs a command here) or that a shell would
    /// split is refused before anything runs.
    #[test]
    fn host_names_that_ssh_would_read_as_options_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("train.hvd");
        std::fs::write(
            &file,
            "project \"t\"\nenv {\n  python = \"3.11\"\n  packages = []\n}\ncluster {\n  engine = \"ssh\"\n}\n\
             step train {\n  run = \"true\"\n  workers = 2\n}\n",
        )
        .unwrap();
        let project = hvd_lang::load_file(&file).unwrap();
        let pwned = dir.path().join("pwned");
        for host in [
            format!("-oProxyCommand=touch {}", pwned.display()),
            "-F/etc/passwd".to_owned(),
            "a b".to_owned(),
            "a\tb".to_owned(),
        ] {
            let options = crate::RunOptions {
                hosts: Some(vec![host.clone()]),
                ..crate::RunOptions::default()
            };
            let err = crate::plan(&project, &options).unwrap_err().to_string();
            assert!(err.contains("is not a host name for ssh"), "{host}: {err}");
            assert!(!pwned.exists(), "{host}");
        }
    }
}
