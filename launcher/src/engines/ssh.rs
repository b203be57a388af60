//! The `ssh` engine: every rank of a distributed step is one `ssh HOST -- exec /bin/sh -c WRAPPER hvd-rank DIR TICKS
//! IP NAME=VALUE... /bin/sh -c COMMAND`, started and supervised by the local engine exactly like a local worker (log
//! prefixes, per-rank logs, fail-fast, signals).
//!
//! Ranks fill the hosts' slots in order (`h1:2,h2:2`: ranks 0-1 on h1, 2-3 on h2), like mpirun's by-slot mapping.
//! The rendezvous server binds an address the hosts can reach: the IPv4 address of `--network-interface`, else the
//! local address whose route reaches the first host.
//!
//! The remote wrapper (a POSIX `sh` one-liner, [`WRAPPER`]; the command line: [`SshSetup::wrapper`]):
//! 1. reads the job token from the first line of its stdin (so it never appears on a command line), `cd`s to the
//!    project directory, and (without `--network-interface`) finds the interface that reaches the rendezvous;
//! 2. starts the step's command with `setsid env VARS /bin/sh -c COMMAND` in a session of its own, with SIGINT and
//!    SIGQUIT at their defaults (`env --default-signal`, where supported);
//! 3. starts a watcher in another session that reads the rest of stdin: a line `TERM`/`INT`/`KILL` or end of file
//!    (the launcher closed it, ssh died, the connection dropped) sends that signal (TERM on end of file) to the
//!    command's process group, then SIGKILL after the grace period;
//! 4. waits for the command, kills both sessions' leftovers and every process that still carries the rank's
//!    `HVD_RUN_STEP` and `HVD_RANK` in its environment (escaped with `setsid`), and exits with the command's code,
//!    which ssh passes on.
//!
//! So stopping a remote rank is: write the signal's name to its ssh's stdin and close it; ssh then exits once the
//! remote processes are gone, and nothing is left behind on the host.

use std::collections::{BTreeMap, BTreeSet};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use hvd_lang::model::Project;

use crate::LaunchError;
use crate::engines::shell::{self, quote};
use crate::env::{RendezvousInfo, Slot};

/// What `hvd run` was told about ssh (`--ssh-port`, `--ssh-identity`, `--ssh-config`, `--network-interface`; each
/// falls back to `cluster { settings { ssh_port, ssh_identity, ssh_config, network_interface } }`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SshOptions {
    pub port: Option<u16>,
    pub identity: Option<PathBuf>,
    pub config: Option<PathBuf>,
    pub network_interface: Option<String>,
    /// Copy the env's store paths to hosts that lack them (`--ssh-copy-env`, `settings.copy_env = "true"`).
    pub copy_env: bool,
}

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
}

/// Whether `name` can be a variable name for `env NAME=VALUE` and the shell.
fn valid_var_name(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

/// Variables that name the network interface the workers use (hvd's collective, NCCL, gloo, Horovod).
pub const INTERFACE_VARS: [&str; 5] = [
    "HVD_NETWORK_INTERFACE",
    "HVD_TCP_INTERFACE",
    "NCCL_SOCKET_IFNAME",
    "GLOO_SOCKET_IFNAME",
    "HOROVOD_GLOO_IFACE",
];

/// The remote wrapper (`sh -c WRAPPER hvd-rank DIR TICKS IP NAME=VALUE... /bin/sh -c COMMAND`): reads the token,
/// `cd`s, finds the interface that reaches IP (when given), starts the command in a session of its own with
/// SIGINT/SIGQUIT at their defaults, and a watcher (`$W`, in another session) that stops the command's process group
/// when stdin says so or ends (TICKS tenths of a second before SIGKILL). When the command has ended it kills what is
/// left of both sessions, and every process whose environment still carries the rank's `HVD_RUN_STEP` and `HVD_RANK`
/// (what left the command's session: `setsid`, daemons; GNU grep's `-z`). It has no single quotes, so it stays
/// readable when quoted twice (`--dry-run`).
pub const WRAPPER: &str = concat!(
    r#"IFS= read -r HVD_JOB_TOKEN || { echo hvd: no job token on stdin >&2; exit 125; }; export HVD_JOB_TOKEN; "#,
    r#"cd "$1" || exit 125; t=$2; if [ -n "$3" ]; then "#,
    r#"i=$(ip -o route get "$3" 2>/dev/null | sed -n "s/.* dev \([^ ]*\).*/\1/p"); if [ -n "$i" ]; then "#,
    r#"export HVD_NETWORK_INTERFACE="$i" HVD_TCP_INTERFACE="$i" NCCL_SOCKET_IFNAME="$i" GLOO_SOCKET_IFNAME="$i" "#,
    r#"HOROVOD_GLOO_IFACE="$i"; fi; fi; shift 3; m=; r=; for a; do case $a in "#,
    r#"HVD_RUN_STEP=*) [ -n "$m" ] || m=$a;; HVD_RANK=*) [ -n "$r" ] || r=$a;; esac; done; "#,
    r#"d=; env --default-signal=INT true 2>/dev/null && d=--default-signal=INT,QUIT; "#,
    r#"W="IFS= read -r s; case \$s in INT|TERM|KILL) ;; *) s=TERM;; esac; kill -\$s -\$1 2>/dev/null || exit 0; "#,
    r#"i=0; while kill -0 -\$1 2>/dev/null; do i=\$((i+1)); if [ \$i -gt \$2 ]; then kill -KILL -\$1 2>/dev/null; "#,
    r#"exit 0; fi; sleep 0.1; done"; "#,
    r#"exec 3<&0 </dev/null; setsid env $d "$@" 3<&- & w=$!; "#,
    r#"setsid /bin/sh -c "$W" hvd-watch "$w" "$t" <&3 >/dev/null 2>&1 3<&- & g=$!; exec 3<&-; "#,
    r#"wait "$w"; c=$?; kill -KILL "-$g" "-$w" 2>/dev/null; "#,
    r#"if [ -n "$m" ] && [ -n "$r" ]; then for p in $(grep -lzxF "$r" $(grep -lzxF "$m" /proc/[0-9]*/environ "#,
    r#"2>/dev/null) </dev/null 2>/dev/null); do p=${p%/environ}; kill -KILL "${p#/proc/}" 2>/dev/null; done; fi; "#,
    r#"exit "$c""#
);

fn engine_error(message: String) -> LaunchError {
    LaunchError::Engine(message)
}

impl SshSetup {
    /// Reads hosts and options for the ssh engine: `--hosts`/`--hostfile` (else `cluster { hosts }`), resolves every
    /// host (through `ssh -G`, so ssh config aliases work) and chooses the rendezvous address.
    pub fn new(project: &Project, options: &crate::RunOptions) -> Result<Self, LaunchError> {
        let settings = project.cluster.as_ref().map(|c| &c.settings);
        let setting = |k: &str| settings.and_then(|s| s.get(k)).cloned();
        let hosts: Vec<(String, u32)> = match &options.hosts {
            Some(hosts) => hosts
                .iter()
                .map(|h| super::parse_host(h))
                .collect::<Result<_, _>>()?,
            None => project
                .cluster
                .as_ref()
                .map(|c| c.hosts.iter().map(|h| super::parse_host(h)).collect())
                .transpose()?
                .unwrap_or_default(),
        };
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
        if let Some((bad, _)) = hosts
            .iter()
            .find(|(h, _)| h.starts_with('-') || h.bytes().any(|b| b.is_ascii_whitespace()))
        {
            return Err(engine_error(format!(
                "host `{bad}` is not a host name for ssh (it starts with `-` or contains white space)"
            )));
        }
        // Every variable reaches a remote rank as `env NAME=VALUE`: refuse a bad name before anything starts.
        let names = project
            .env
            .variables
            .keys()
            .chain(project.steps.iter().flat_map(|s| s.env.keys()));
        for name in names {
            if !valid_var_name(name) {
                return Err(engine_error(format!(
                    "variable `{name}` is not a valid environment variable name for the ssh engine (letters, \
                     digits, `_`)"
                )));
            }
        }
        let ssh_options = &options.ssh;
        let port = match (ssh_options.port, setting("ssh_port")) {
            (Some(p), _) => Some(p),
            (None, Some(p)) => Some(p.trim().parse::<u16>().map_err(|_| {
                engine_error(format!(
                    "cluster setting `ssh_port = \"{p}\"` is not a port number"
                ))
            })?),
            (None, None) => None,
        };
        let identity = ssh_options
            .identity
            .clone()
            .or_else(|| setting("ssh_identity").map(PathBuf::from));
        let config = ssh_options
            .config
            .clone()
            .or_else(|| setting("ssh_config").map(PathBuf::from));
        let interface = ssh_options
            .network_interface
            .clone()
            .or_else(|| setting("network_interface"));
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
            copy_env: ssh_options.copy_env
                || setting("copy_env").is_some_and(|v| matches!(v.trim(), "true" | "yes" | "1")),
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

    /// The variables a remote rank gets on its command line, from the local engine's `vars` (the same contract):
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
    /// WRAPPER hvd-rank DIR TICKS IP NAME=VALUE... /bin/sh -c COMMAND`. The wrapper is the same for every rank; `IP`
    /// (the rendezvous address, to find the interface that reaches it) is empty with `--network-interface`. `vars` as
    /// from [`SshSetup::remote_vars`].
    pub fn wrapper(
        &self,
        vars: &[(String, String)],
        command: &str,
        dir: &Path,
        rendezvous_ip: IpAddr,
    ) -> Result<String, LaunchError> {
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
        for (k, v) in vars {
            if !valid_var_name(k) {
                return Err(engine_error(format!(
                    "variable `{k}` is not a valid environment variable name for the ssh engine (letters, digits, `_`)"
                )));
            }
            s.push(' ');
            s.push_str(&quote(&format!("{k}={v}")));
        }
        s.push_str(" /bin/sh -c ");
        s.push_str(&quote(command));
        Ok(s)
    }

    /// The full ssh command line for `host`: `ssh OPTIONS HOST -- REMOTE` (`REMOTE` as the host's login shell gets
    /// it).
    pub fn argv(&self, host: &str, remote: &str) -> Vec<String> {
        let mut argv = self.ssh.clone();
        argv.extend([host.to_owned(), "--".into(), remote.to_owned()]);
        argv
    }

    /// The variables of rank `slot` of `step` on its host: the local engine's (the same contract,
    /// [`crate::env::worker_env`]) plus `MASTER_PORT` and the step marker, through [`SshSetup::remote_vars`].
    pub fn rank_vars(
        &self,
        plan: &crate::Plan,
        step: &crate::PlannedStep,
        slot: &Slot,
        rendezvous: &RendezvousInfo,
        master_port: &str,
        marker: &str,
    ) -> Vec<(String, String)> {
        let mut vars = crate::env::worker_env(
            &step.env,
            slot,
            Some(rendezvous),
            plan.gpus_per_worker,
            plan.env_dir.as_deref(),
        );
        vars.push(("MASTER_PORT".into(), master_port.to_owned()));
        vars.push((crate::engine::STEP_MARKER_VAR.into(), marker.to_owned()));
        let rank0 = step
            .layout
            .slots
            .first()
            .map_or(slot.host.as_str(), |s| s.host.as_str());
        self.remote_vars(&vars, rank0)
    }

    /// The ssh command line of rank `slot` of `step`, with [`SshSetup::rank_vars`].
    pub fn rank_argv(
        &self,
        plan: &crate::Plan,
        step: &crate::PlannedStep,
        slot: &Slot,
        rendezvous: &RendezvousInfo,
        master_port: &str,
        marker: &str,
    ) -> Result<Vec<String>, LaunchError> {
        let vars = self.rank_vars(plan, step, slot, rendezvous, master_port, marker);
        let remote = self.wrapper(
            &vars,
            &step.command,
            &plan.project_dir,
            rendezvous.addr.ip(),
        )?;
        Ok(self.argv(&slot.host, &remote))
    }

    /// The line `hvd run --dry-run` shows for rank `slot` of `step`: the ports and the run id, chosen when the step
    /// starts, are shown as `<port>`, `<master-port>` and `<run id>`.
    pub fn dry_run_line(
        &self,
        plan: &crate::Plan,
        step: &crate::PlannedStep,
        slot: &Slot,
    ) -> String {
        let rendezvous = RendezvousInfo {
            addr: SocketAddr::new(self.bind_ip, 0),
            token: String::new(),
        };
        let marker = format!("<run id>/{}", step.name);
        let mut vars = self.rank_vars(plan, step, slot, &rendezvous, "<master-port>", &marker);
        for (k, v) in &mut vars {
            match k.as_str() {
                "HVD_RENDEZVOUS" => *v = format!("{}:<port>", self.bind_ip),
                "HOROVOD_GLOO_RENDEZVOUS_PORT" => *v = "<port>".into(),
                _ => {}
            }
        }
        match self.wrapper(&vars, &step.command, &plan.project_dir, self.bind_ip) {
            Ok(remote) => shell::line(&self.argv(&slot.host, &remote)),
            Err(e) => format!("(cannot run: {e})"),
        }
    }

    /// Checks every host before anything starts, all at once: ssh reaches it, the project directory exists there,
    /// and so does the env (`env_dir`): for a store path, with the same content hash and every store path it
    /// references.
    pub fn check_hosts(&self, dir: &Path, env_dir: Option<&Path>) -> Result<(), LaunchError> {
        let local = env_dir.map(EnvIdentity::local).transpose()?.flatten();
        let script = check_script(dir, env_dir, local.as_ref());
        let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .hosts
                .iter()
                .map(|(host, _)| {
                    let script = &script;
                    let local = local.as_ref();
                    scope.spawn(move || self.check_host(host, script, dir, env_dir, local))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("the host check panicked".into()))
                })
                .collect()
        });
        let errors: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(engine_error(errors.join("\n")))
        }
    }

    fn check_host(
        &self,
        host: &str,
        script: &str,
        dir: &Path,
        env_dir: Option<&Path>,
        local: Option<&EnvIdentity>,
    ) -> Result<(), String> {
        let report = self.run_check(host, script, local)?;
        let copyable =
            self.copy_env && report.differs.is_none() && !report.env_problems().is_empty();
        let report = match (env_dir, local) {
            (Some(_), Some(identity)) if copyable => {
                // Only the launcher's own names are copied: what the host said is missing selected them from the
                // closure computed here (`run_check` refused any other name).
                let mut names: Vec<&str> = report.missing.iter().map(String::as_str).collect();
                if report.no_env || report.content_hash.is_none() {
                    names.push(&identity.name);
                }
                tracing::info!(host, paths = names.len(), "copying the env's store paths");
                self.copy_store_paths(host, &identity.store, &names)?;
                self.run_check(host, script, local)?
            }
            _ => report,
        };
        let mut problems = Vec::new();
        if report.no_dir {
            problems.push(format!(
                "the project directory {} does not exist on host `{host}`: the ssh engine runs every rank in the \
                 same directory on every host (share it, e.g. over NFS, or copy the project there)",
                dir.display()
            ));
        }
        if let Some(env) = env_dir {
            let what_to_do = "the ssh engine runs every rank in the same env (store path) on every host: share \
                              the store at the same path, build the project on that host (`hvd build FILE`), or \
                              let hvd copy it (`--ssh-copy-env`)";
            if report.no_env {
                problems.push(format!(
                    "the env {} is missing on host `{host}`; {what_to_do}",
                    env.display()
                ));
            } else if let Some(local) = local {
                match (&report.content_hash, &report.differs) {
                    (_, Some(hash)) => problems.push(format!(
                        "the env {} differs on host `{host}` (content hash {} there, {} here): a store path \
                         never changes, so one of them is damaged; delete it there and copy it again \
                         (`--ssh-copy-env`) or rebuild it",
                        env.display(),
                        printable(hash),
                        local.content_hash
                    )),
                    (Some(_), None) => {}
                    (None, None) => problems.push(format!(
                        "the env {} on host `{host}` is not a complete store path (no readable .hvd-path.json); \
                         {what_to_do}",
                        env.display()
                    )),
                }
                if !report.missing.is_empty() {
                    problems.push(format!(
                        "store paths the env needs are missing on host `{host}`: {}; {what_to_do}",
                        report.missing.join(", ")
                    ));
                }
            }
            if report.no_python && !report.no_env {
                problems.push(format!(
                    "the env's Python ({}/bin/python, a link to the interpreter it was built with) does not run on \
                     host `{host}`: install the same Python at the same path there",
                    env.display()
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("\n"))
        }
    }

    /// Runs the check script on `host` and reads its answer, at most [`CHECK_ANSWER_LIMIT`] bytes of it. The host is
    /// not trusted: a store path it reports missing must be one of the env's closure as computed here (`local`), and
    /// is kept as the launcher's own name; any other name fails the check of this host, naming it.
    fn run_check(
        &self,
        host: &str,
        script: &str,
        local: Option<&EnvIdentity>,
    ) -> Result<CheckReport, String> {
        let argv = self.argv(host, &format!("exec /bin/sh -c {}", quote(script)));
        let out = bounded_output(Command::new(&argv[0]).args(&argv[1..]), CHECK_ANSWER_LIMIT)
            .map_err(|e| format!("failed to run `{}`: {e}", argv[0]))?;
        if out.stdout_overflow {
            return Err(format!(
                "host `{host}` answered the env check with more than {} bytes; hvd stopped reading and copies \
                 nothing to it: check that host (its login shell or `.bashrc` prints too much, or it is not the \
                 machine it should be)",
                CHECK_ANSWER_LIMIT
            ));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !stdout.contains("hvd-check:done") {
            let stderr = String::from_utf8_lossy(&out.stderr);
            return Err(format!(
                "cannot run commands on host `{host}` over ssh ({}): {}\n  (check `{} {host} true`; the ssh engine \
                 needs key-based login without prompts: BatchMode)",
                out.status,
                stderr.trim(),
                shell::line(&self.ssh)
            ));
        }
        let has = |line: &str| stdout.lines().any(|l| l == line);
        let content_hash = stdout
            .split_once("hvd-check:path-json\n")
            .and_then(|(_, rest)| rest.split_once("\nhvd-check:end"))
            .and_then(|(json, _)| serde_json::from_str::<serde_json::Value>(json).ok())
            .and_then(|v| v["content_hash"].as_str().map(str::to_owned));
        let expected = stdout
            .lines()
            .find_map(|l| l.strip_prefix("hvd-check:expect "))
            .map(str::to_owned);
        let mut missing: Vec<String> = Vec::new();
        let mut foreign: Vec<String> = Vec::new();
        for name in stdout
            .lines()
            .filter_map(|l| l.strip_prefix("hvd-check:missing "))
        {
            match local.and_then(|identity| identity.closure.get(name)) {
                Some(own) => {
                    if !missing.contains(own) {
                        missing.push(own.clone());
                    }
                }
                None => foreign.push(printable(name)),
            }
        }
        if !foreign.is_empty() {
            foreign.truncate(5);
            return Err(format!(
                "host `{host}` answered the env check with store paths that are not in the env's closure: {}; \
                 hvd ran and copied nothing on its word. The host is misconfigured or compromised: check it \
                 before using it again",
                foreign.join(", ")
            ));
        }
        Ok(CheckReport {
            no_dir: has("hvd-check:no-dir"),
            no_env: has("hvd-check:no-env"),
            no_python: has("hvd-check:no-python"),
            differs: content_hash
                .clone()
                .filter(|h| expected.as_ref().is_some_and(|e| e != h)),
            content_hash,
            missing,
        })
    }

    /// Copies store paths `names` from `store` here to the same store on `host` (`tar | ssh host tar`), each moved
    /// into place whole (from `.tmp/` in that store), and only where the host does not have it yet.
    ///
    /// `names` are the launcher's own (the env and its closure, [`EnvIdentity`]); each is checked against the store
    /// path grammar again here, and `tar` gets them after `--`, relative to the store (`-C STORE`), so no name can be
    /// read as an option or reach outside the store.
    fn copy_store_paths(&self, host: &str, store: &Path, names: &[&str]) -> Result<(), String> {
        if names.is_empty() {
            return Ok(());
        }
        if let Some(bad) = names.iter().find(|n| !is_store_path_name(n)) {
            return Err(format!(
                "refusing to copy `{}` to host `{host}`: not a store path name",
                printable(bad)
            ));
        }
        let s = quote(&store.display().to_string());
        let list = names.iter().map(|n| quote(n)).collect::<Vec<_>>().join(" ");
        let script = format!(
            "set -e; t={s}/.tmp/hvd-ssh-copy.$$; mkdir -p \"$t\"; tar -C \"$t\" -xf -; for n in {list}; do \
             [ -e {s}/\"$n\" ] || mv \"$t/$n\" {s}/\"$n\"; done; chmod -R u+w \"$t\"; rm -rf \"$t\""
        );
        let mut tar = Command::new("tar")
            .arg("-C")
            .arg(store)
            .arg("-cf")
            .arg("-")
            .arg("--")
            .args(names)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("failed to run tar: {e}"))?;
        let Some(archive) = tar.stdout.take() else {
            return Err("tar has no output pipe".into());
        };
        let argv = self.argv(host, &format!("exec /bin/sh -c {}", quote(&script)));
        let out = Command::new(&argv[0])
            .args(&argv[1..])
            .stdin(archive)
            .output()
            .map_err(|e| format!("failed to run `{}`: {e}", argv[0]));
        let tar_out = tar.wait_with_output().map_err(|e| format!("tar: {e}"))?;
        let out = out?;
        if !tar_out.status.success() || !out.status.success() {
            return Err(format!(
                "copying the env to host `{host}` failed: {}{}",
                String::from_utf8_lossy(&tar_out.stderr).trim(),
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(())
    }
}

/// What a host said to the check script.
#[derive(Debug, Clone, Default)]
struct CheckReport {
    no_dir: bool,
    no_env: bool,
    no_python: bool,
    /// The env's content hash there.
    content_hash: Option<String>,
    /// `Some(hash there)` when it is not the one here.
    differs: Option<String>,
    /// Store paths the env references that are missing there.
    missing: Vec<String>,
}

impl CheckReport {
    fn env_problems(&self) -> Vec<&'static str> {
        let mut p = Vec::new();
        if self.no_env || self.content_hash.is_none() {
            p.push("env");
        }
        if !self.missing.is_empty() {
            p.push("references");
        }
        p
    }
}

/// What identifies a built env: its store path name, its content hash and its closure (the store paths it
/// references, and theirs, from each one's `.hvd-path.json` here).
#[derive(Debug, Clone)]
struct EnvIdentity {
    /// The env's own store path name.
    name: String,
    content_hash: String,
    store: PathBuf,
    /// Every store path the env needs, the env excluded; each name checked with [`is_store_path_name`].
    closure: BTreeSet<String>,
}

/// The most a host's answer to the env check may be (stdout; stderr is cut there too): a few lines per store path of
/// the closure and the env's `.hvd-path.json`, far below this.
pub const CHECK_ANSWER_LIMIT: usize = 4 << 20;

/// Whether `name` is a store path name: `<32 lowercase hex digits>-<name>-<version>` (see builder's
/// `Derivation::path_name`), the rest made of ASCII letters, digits and `-._+`, without `..`. So it has no `/`, does
/// not start with `-` and is never `.` or `..`: safe as an argument and as a path below the store.
pub fn is_store_path_name(name: &str) -> bool {
    let Some((hash, rest)) = name.split_once('-') else {
        return false;
    };
    hash.len() == 32
        && hash.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
        && !rest.is_empty()
        && rest
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-._+".contains(&b))
        && !rest.contains("..")
}

/// `text` as a message may show it: at most 100 characters, control characters escaped.
fn printable(text: &str) -> String {
    let mut out: String = text
        .chars()
        .take(100)
        .flat_map(char::escape_debug)
        .collect();
    if text.chars().nth(100).is_some() {
        out.push_str("...");
    }
    format!("`{out}`")
}

/// What [`bounded_output`] read.
struct BoundedOutput {
    status: std::process::ExitStatus,
    stdout: Vec<u8>,
    stderr: Vec<u8>,
    /// stdout had more than the limit (the rest was read and dropped).
    stdout_overflow: bool,
}

/// Runs `command` with stdin closed and keeps at most `limit` bytes of each of its stdout and stderr, reading and
/// dropping the rest (so the child never blocks on a full pipe).
fn bounded_output(command: &mut Command, limit: usize) -> std::io::Result<BoundedOutput> {
    fn keep(mut from: impl std::io::Read, limit: usize) -> (Vec<u8>, bool) {
        let mut kept = Vec::new();
        let mut buf = [0u8; 16 << 10];
        let mut overflow = false;
        loop {
            match from.read(&mut buf) {
                Ok(0) | Err(_) => return (kept, overflow),
                Ok(n) => {
                    let room = limit.saturating_sub(kept.len());
                    kept.extend_from_slice(&buf[..n.min(room)]);
                    overflow |= n > room;
                }
            }
        }
    }
    let mut child = command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()?;
    let stdout = child.stdout.take();
    let stderr = child.stderr.take();
    let ((stdout, stdout_overflow), (stderr, _)) = std::thread::scope(|scope| {
        let err = scope.spawn(move || stderr.map_or((Vec::new(), false), |e| keep(e, limit)));
        let out = stdout.map_or((Vec::new(), false), |o| keep(o, limit));
        (out, err.join().unwrap_or((Vec::new(), false)))
    });
    Ok(BoundedOutput {
        status: child.wait()?,
        stdout,
        stderr,
        stdout_overflow,
    })
}

impl EnvIdentity {
    /// `None` inside: the env is not a store path (`--env-dir` of a plain venv), so only its presence is checked.
    fn local(env: &Path) -> Result<Option<EnvIdentity>, LaunchError> {
        let file = env.join(".hvd-path.json");
        let text = match fs_err::read_to_string(&file) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => return Err(LaunchError::Io { path: file, source }),
        };
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            engine_error(format!(
                "{} is not valid JSON ({e}); rebuild the env with `hvd build`",
                file.display()
            ))
        })?;
        let Some(content_hash) = value["content_hash"].as_str() else {
            return Err(engine_error(format!(
                "{} has no `content_hash`; rebuild the env with `hvd build`",
                file.display()
            )));
        };
        let name = env
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        if !is_store_path_name(&name) {
            return Err(engine_error(format!(
                "{} has a `.hvd-path.json` but its name is not a store path name (`<hash>-<name>-<version>`); \
                 use the env hvd built (`hvd build`)",
                env.display()
            )));
        }
        let store = env.parent().unwrap_or(Path::new("/")).to_path_buf();
        let closure = closure(&store, &name, &value)?;
        Ok(Some(EnvIdentity {
            name,
            content_hash: content_hash.to_owned(),
            store,
            closure,
        }))
    }
}

/// The names in the `references` of a `.hvd-path.json` (`info`, of store path `of`), each checked.
fn references_of(of: &str, info: &serde_json::Value) -> Result<Vec<String>, LaunchError> {
    let mut out = Vec::new();
    for reference in info["references"].as_array().into_iter().flatten() {
        match reference.as_str() {
            Some(r) if is_store_path_name(r) => out.push(r.to_owned()),
            _ => {
                return Err(engine_error(format!(
                    "store path {of} lists {} as a reference, which is not a store path name; its                      `.hvd-path.json` is damaged: rebuild the env with `hvd build --rebuild`",
                    printable(&reference.to_string())
                )));
            }
        }
    }
    Ok(out)
}

/// Every store path that env `name` (whose `.hvd-path.json` is `info`) needs, read here: its references, theirs, and
/// so on. The env itself is not in it.
fn closure(
    store: &Path,
    name: &str,
    info: &serde_json::Value,
) -> Result<BTreeSet<String>, LaunchError> {
    let mut closure = BTreeSet::new();
    let mut queue: Vec<String> = references_of(name, info)?;
    while let Some(next) = queue.pop() {
        if next == name || !closure.insert(next.clone()) {
            continue;
        }
        let file = store.join(&next).join(".hvd-path.json");
        let text = fs_err::read_to_string(&file).map_err(|e| {
            engine_error(format!(
                "store path {next}, which the env needs, is not valid here ({e}); rebuild the env with \
                 `hvd build`"
            ))
        })?;
        let value: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            engine_error(format!(
                "{} is not valid JSON ({e}); rebuild the env with `hvd build --rebuild`",
                file.display()
            ))
        })?;
        queue.extend(references_of(&next, &value)?);
    }
    Ok(closure)
}

/// The remote half of [`SshSetup::check_hosts`]: prints `hvd-check:` lines and ends with `hvd-check:done`.
fn check_script(dir: &Path, env: Option<&Path>, local: Option<&EnvIdentity>) -> String {
    let q = |p: &Path| quote(&p.display().to_string());
    let mut s = format!("cd {} 2>/dev/null || echo hvd-check:no-dir; ", q(dir));
    if let Some(env) = env {
        s.push_str(&format!(
            "test -d {}/bin || echo hvd-check:no-env; ",
            q(env)
        ));
        if env.join("bin/python").exists() {
            s.push_str(&format!(
                "test -x {}/bin/python || echo hvd-check:no-python; ",
                q(env)
            ));
        }
        if let Some(identity) = local {
            s.push_str(&format!(
                "echo {}; echo hvd-check:path-json; cat {}/.hvd-path.json 2>/dev/null; echo; echo hvd-check:end; ",
                quote(&format!("hvd-check:expect {}", identity.content_hash)),
                q(env)
            ));
            for name in &identity.closure {
                let path = identity.store.join(name);
                s.push_str(&format!(
                    "test -f {}/.hvd-path.json || echo {}; ",
                    q(&path),
                    quote(&format!("hvd-check:missing {name}"))
                ));
            }
        }
    }
    s.push_str("echo hvd-check:done");
    s
}

/// `ssh` with the options every connection uses: never prompt (BatchMode), no terminal, a connect timeout.
fn ssh_argv(port: Option<u16>, identity: Option<&Path>, config: Option<&Path>) -> Vec<String> {
    let mut argv: Vec<String> = [
        "ssh",
        "-T",
        "-o",
        "BatchMode=yes",
        "-o",
        "ConnectTimeout=30",
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
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

/// The address of host name `name` (an IP address as is), IPv4 preferred, from the system resolver.
pub fn resolve_host(name: &str) -> Result<IpAddr, LaunchError> {
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(ip);
    }
    let addrs: Vec<SocketAddr> = (name, 22)
        .to_socket_addrs()
        .map_err(|e| engine_error(format!("cannot resolve host `{name}`: {e}")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .map(SocketAddr::ip)
        .ok_or_else(|| engine_error(format!("host `{name}` has no address")))
}

/// The local address whose route reaches `peer` (a UDP socket's connect sends nothing).
pub fn route_source(peer: IpAddr) -> Result<IpAddr, LaunchError> {
    if peer.is_loopback() {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    let bind: SocketAddr = match peer {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let no_route = |e: std::io::Error| {
        engine_error(format!(
            "no route from this machine to {peer} ({e}): choose the interface with `--network-interface`"
        ))
    };
    let socket = UdpSocket::bind(bind).map_err(no_route)?;
    socket.connect((peer, 9)).map_err(no_route)?;
    Ok(socket.local_addr().map_err(no_route)?.ip())
}

/// The IPv4 address of network interface `name` on this machine.
pub fn interface_ipv4(name: &str) -> Result<IpAddr, LaunchError> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `list`, freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(LaunchError::Io {
            path: "getifaddrs".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    let mut found = None;
    let mut names: Vec<String> = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list returned by getifaddrs, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let ifname = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        let family = if ifa.ifa_addr.is_null() {
            None
        } else {
            // SAFETY: ifa_addr is not null: it points at a sockaddr whose family says which struct it is.
            Some(i32::from(unsafe { (*ifa.ifa_addr).sa_family }))
        };
        if found.is_none() && ifname == name && family == Some(libc::AF_INET) {
            // SAFETY: the family is AF_INET, so this is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            found = Some(IpAddr::from(
                u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
            ));
        }
        if !names.contains(&ifname) {
            names.push(ifname);
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    found.ok_or_else(|| {
        engine_error(format!(
            "network interface `{name}` has no IPv4 address on this machine (interfaces: {})",
            names.join(", ")
        ))
    })
}

/// Tells a remote rank's wrapper to stop: writes the signal's name (`TERM`, `INT`, `KILL`) as one line to its ssh's
/// stdin; the caller then closes it (end of file alone means TERM).
pub fn send_stop(stdin: &mut impl std::io::Write, signal: i32) {
    let name = crate::process::signal_name(signal);
    let name = name.strip_prefix("SIG").unwrap_or(&name);
    let _ = writeln!(stdin, "{name}");
    let _ = stdin.flush();
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write as _;

    fn setup(interface: Option<&str>) -> SshSetup {
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
        let wrapper = s
            .wrapper(&remote, "python t.py", Path::new("/p q"), s.bind_ip)
            .unwrap();
        assert!(wrapper.contains(" hvd-rank '/p q' 20 '' "), "{wrapper}");
        assert!(wrapper.contains(" 'X=a b' "), "{wrapper}");
        assert!(!wrapper.contains("secret"));
        let argv = s.argv("h2", &wrapper);
        assert_eq!(
            argv[..12],
            [
                "ssh",
                "-T",
                "-o",
                "BatchMode=yes",
                "-o",
                "ConnectTimeout=30",
                "-F",
                "/k/cfg",
                "-p",
                "2222",
                "-i",
                "/k/id"
            ]
        );
        assert_eq!(argv[12..14], ["h2", "--"]);
        assert_eq!(argv[14], wrapper);
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
        let wrapper = s
            .wrapper(&remote, "true", Path::new("/p"), s.bind_ip)
            .unwrap();
        assert!(wrapper.contains(" hvd-rank /p 20 10.0.0.1 "), "{wrapper}");
        let bad = vec![("A-B".to_string(), "1".to_string())];
        assert!(s.wrapper(&bad, "true", Path::new("/p"), s.bind_ip).is_err());
    }

    /// Runs the wrapper locally as ssh would run it remotely, feeding `stdin`; returns (code, stdout).
    fn run_wrapper(s: &SshSetup, command: &str, stdin: &[u8]) -> (Option<i32>, String) {
        let dir = tempfile::tempdir().unwrap();
        let vars = s.remote_vars(&[("Y".to_string(), "it's y".to_string())], "h1");
        let wrapper = s.wrapper(&vars, command, dir.path(), s.bind_ip).unwrap();
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(&wrapper)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
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

    #[test]
    fn the_wrapper_passes_token_variables_and_exit_code() {
        let s = setup(Some("lo"));
        let (code, out) = run_wrapper(
            &s,
            "echo \"$HVD_JOB_TOKEN|$Y|$NCCL_SOCKET_IFNAME|$(pwd)\"; grep SigIgn /proc/$$/status; exit 7",
            b"tok\n",
        );
        assert_eq!(code, Some(7), "{out}");
        let mut lines = out.lines();
        let first = lines.next().unwrap();
        assert!(first.starts_with("tok|it's y|lo|/"), "{out}");
        // SIGINT and SIGQUIT are not ignored (they would be for a plain `&` job), so Ctrl-C reaches Python.
        let ignored = lines.next().unwrap().trim_start_matches("SigIgn:").trim();
        let mask = u64::from_str_radix(ignored, 16).unwrap();
        assert_eq!(mask & 0b110, 0, "{out}");
        // No token line: a clear error.
        let (code, _) = run_wrapper(&s, "true", b"");
        assert_eq!(code, Some(125));
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
        let wrapper = s.wrapper(&[], &command, dir.path(), s.bind_ip).unwrap();
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(&wrapper)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut input = child.stdin.take().unwrap();
        input.write_all(b"tok\n").unwrap();
        let mut stdout = child.stdout.take().unwrap();
        let mut buf = [0u8; 8];
        let n = std::io::Read::read(&mut stdout, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"started\n");
        send_stop(&mut input, libc::SIGTERM);
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

    /// A stand-in for ssh that runs the remote command here, with `/store/` read as `/store-HOST/` so that every
    /// "host" has a store of its own; host `down` is unreachable.
    fn fake_ssh(dir: &Path) -> PathBuf {
        let path = dir.join("fake-ssh");
        std::fs::write(
            &path,
            "#!/bin/sh\nwhile [ \"$1\" != -- ]; do host=$1; shift; done; shift\n\
             [ \"$host\" = down ] && { echo 'ssh: connect to host down port 22: Connection refused' >&2; exit 255; }\n\
             exec /bin/sh -c \"$(printf '%s' \"$*\" | sed \"s#/store/#/store-$host/#g\")\"\n",
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// Writes a store path `NAME` with its `.hvd-path.json` into `store`.
    fn store_path(store: &Path, name: &str, content_hash: &str, references: &[&str]) -> PathBuf {
        let path = store.join(name);
        std::fs::create_dir_all(path.join("bin")).unwrap();
        let json = serde_json::json!({"schema": 1, "content_hash": content_hash, "references": references});
        std::fs::write(path.join(".hvd-path.json"), json.to_string()).unwrap();
        path
    }

    /// Store path names for the tests: an env, a package it references, and one only that package references.
    const E1: &str = "0123456789abcdef0123456789abcdef-t-1.0";
    const P1: &str = "11111111111111111111111111111111-x-2.0";
    const P2: &str = "22222222222222222222222222222222-y-3.0";

    #[test]
    fn hosts_are_checked_for_the_env_by_content_hash() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let env = store_path(&d.join("store"), E1, "c1", &[P1]);
        store_path(&d.join("store"), P1, "cx", &[P2]);
        store_path(&d.join("store"), P2, "cy", &[]);
        // Host a has the same env, b a different one without its packages, c none.
        store_path(&d.join("store-a"), E1, "c1", &[P1]);
        store_path(&d.join("store-a"), P1, "cx", &[P2]);
        store_path(&d.join("store-a"), P2, "cy", &[]);
        store_path(&d.join("store-b"), E1, "c2", &[P1]);
        std::fs::create_dir_all(d.join("store-c")).unwrap();
        let mut s = setup(Some("lo"));
        s.ssh = vec![fake_ssh(d).display().to_string()];
        s.hosts = vec![("a".into(), 1)];
        s.check_hosts(d, Some(&env)).unwrap();
        s.hosts = vec![
            ("a".into(), 1),
            ("b".into(), 1),
            ("c".into(), 1),
            ("down".into(), 1),
        ];
        let err = s.check_hosts(d, Some(&env)).unwrap_err().to_string();
        assert!(!err.contains("host `a`"), "{err}");
        assert!(
            err.contains("differs on host `b` (content hash `c2` there, c1 here)"),
            "{err}"
        );
        // The whole closure is checked: P2 is referenced by P1 only.
        assert!(
            err.contains(&format!("missing on host `b`: {P1}, {P2}")),
            "{err}"
        );
        assert!(
            err.contains(&format!("{E1} is missing on host `c`")),
            "{err}"
        );
        assert!(err.contains("share the store at the same path"), "{err}");
        assert!(err.contains("cannot run commands on host `down`"), "{err}");
        assert!(err.contains("Connection refused"), "{err}");
        // With copying on, what is missing is copied (whole store paths, the whole closure); a differing env is
        // never overwritten.
        s.copy_env = true;
        s.hosts = vec![("c".into(), 1)];
        s.check_hosts(d, Some(&env)).unwrap();
        for name in [E1, P1, P2] {
            assert!(d.join(format!("store-c/{name}/.hvd-path.json")).is_file());
        }
        assert_eq!(
            std::fs::read_dir(d.join("store-c/.tmp")).unwrap().count(),
            0
        );
        s.hosts = vec![("b".into(), 1)];
        let err = s.check_hosts(d, Some(&env)).unwrap_err().to_string();
        assert!(err.contains("differs on host `b`"), "{err}");
        assert!(
            !d.join(format!("store-b/{P1}")).exists(),
            "nothing is copied to a host whose env differs: {err}"
        );
        // The project directory must exist on every host too.
        s.hosts = vec![("a".into(), 1)];
        let err = s
            .check_hosts(&d.join("store/gone"), None)
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist on host `a`"), "{err}");
    }

    /// A compromised host answers the env check as it likes: its `ssh` here is a script that prints the answer in
    /// `answer` for the check, and for a copy keeps the archive it is sent in `received.tar`.
    fn hostile_ssh(dir: &Path) -> PathBuf {
        let path = dir.join("hostile-ssh");
        std::fs::write(
            &path,
            format!(
                "#!/bin/sh\nd={}\ncase \"$*\" in\n  *hvd-check:done*) cat \"$d/answer\";;\n  \
                 *) cat > \"$d/received.tar\";;\nesac\n",
                quote(&dir.display().to_string())
            ),
        )
        .unwrap();
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    #[test]
    fn a_hostile_host_cannot_choose_what_is_copied_or_run() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let store = d.join("store");
        let env = store_path(&store, E1, "c1", &[P1]);
        store_path(&store, P1, "cx", &[]);
        // Not in the env's closure, but in the same store: a host must not obtain it.
        store_path(&store, P2, "secret", &[]);
        let mut s = setup(Some("lo"));
        s.ssh = vec![hostile_ssh(d).display().to_string()];
        s.hosts = vec![("evil".into(), 1)];
        s.copy_env = true;
        let pwned = d.join("pwned");
        let check = |missing: &[&str]| {
            let mut answer = String::from("hvd-check:no-env\n");
            for m in missing {
                answer.push_str(&format!("hvd-check:missing {m}\n"));
            }
            answer.push_str("hvd-check:done\n");
            std::fs::write(d.join("answer"), answer).unwrap();
            let _ = std::fs::remove_file(d.join("received.tar"));
            s.check_hosts(d, Some(&env)).unwrap_err().to_string()
        };
        let hostile = [
            format!(
                "--checkpoint=1 --checkpoint-action=exec=touch {}",
                pwned.display()
            ),
            "--checkpoint-action=exec=sh".to_owned(),
            "-T/etc/passwd".to_owned(),
            "../../etc".to_owned(),
            "/etc/passwd".to_owned(),
            format!("{P1}/../../etc"),
            P2.to_owned(),
            format!("{P1} {P2}"),
        ];
        for name in &hostile {
            let err = check(&[P1, name]);
            assert!(
                err.contains("host `evil` answered the env check with store paths that are not in the env's closure"),
                "{name}: {err}"
            );
            assert!(
                !d.join("received.tar").exists(),
                "{name}: something was sent to the host"
            );
            assert!(!pwned.exists(), "{name}: the host ran a command here");
        }
        // An answer without end: refused at the limit, nothing sent.
        std::fs::write(
            d.join("answer"),
            format!("hvd-check:missing {P1}\n").repeat(CHECK_ANSWER_LIMIT / 40 + 10),
        )
        .unwrap();
        let err = s.check_hosts(d, Some(&env)).unwrap_err().to_string();
        assert!(
            err.contains("host `evil` answered the env check with more than"),
            "{err}"
        );
        assert!(!d.join("received.tar").exists());
        // Names of the closure select what is sent, and only those: the archive holds the env and P1, never P2.
        let err = check(&[P1, P1]);
        assert!(err.contains("is missing on host `evil`"), "{err}");
        let listing = Command::new("tar")
            .arg("-tf")
            .arg(d.join("received.tar"))
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&listing.stdout);
        let tops: BTreeSet<&str> = listing
            .lines()
            .map(|l| l.split('/').next().unwrap_or(l))
            .collect();
        assert_eq!(tops, BTreeSet::from([E1, P1]), "{listing}");
        // The copy itself refuses a name that is not a store path name, whoever gives it.
        let err = s
            .copy_store_paths("evil", &store, &["--checkpoint-action=exec=true"])
            .unwrap_err();
        assert!(err.contains("not a store path name"), "{err}");
    }

    #[test]
    fn store_path_names_follow_the_grammar() {
        for good in [E1, P1, "0123456789abcdef0123456789abcdef-torch-2.1.0+cpu"] {
            assert!(is_store_path_name(good), "{good}");
        }
        for bad in [
            "",
            "..",
            "e1-t-env",
            "-0123456789abcdef0123456789abcdef-t-1",
            "0123456789ABCDEF0123456789abcdef-t-1",
            "0123456789abcdef0123456789abcdef-",
            "0123456789abcdef0123456789abcdef-a/b",
            "0123456789abcdef0123456789abcdef-..",
            "0123456789abcdef0123456789abcdef-a b",
            "0123456789abcdef0123456789abcdef-a\nb",
        ] {
            assert!(!is_store_path_name(bad), "{bad:?}");
        }
        // A damaged `.hvd-path.json` here is a clear error, not a name sent anywhere.
        let dir = tempfile::tempdir().unwrap();
        let env = store_path(dir.path(), E1, "c1", &["../../etc"]);
        let err = EnvIdentity::local(&env).unwrap_err().to_string();
        assert!(err.contains("not a store path name"), "{err}");
        let env = store_path(dir.path(), P1, "c1", &[P2]);
        let err = EnvIdentity::local(&env).unwrap_err().to_string();
        assert!(
            err.contains(&format!("store path {P2}, which the env needs")),
            "{err}"
        );
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
        let plan = crate::plan(&project, &crate::RunOptions::default()).unwrap();
        let ssh = plan.ssh.as_deref().unwrap();
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
            ssh: SshOptions {
                port: Some(22),
                ..SshOptions::default()
            },
            ..crate::RunOptions::default()
        };
        let plan = crate::plan(&project, &options).unwrap();
        let ssh = plan.ssh.as_deref().unwrap();
        assert_eq!(ssh.hosts, [("127.0.0.1".to_string(), 4)]);
        assert!(
            ssh.ssh.windows(2).any(|w| w == ["-p", "22"]),
            "{:?}",
            ssh.ssh
        );
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

    #[test]
    fn route_source_finds_loopback() {
        assert_eq!(
            route_source("127.0.0.1".parse().unwrap()).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(
            interface_ipv4("lo").unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert!(interface_ipv4("no-such-if0").is_err());
    }
}
