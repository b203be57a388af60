//! The slurm engine's elastic steps inside an allocation: each rank is a job step of its own (one `srun` per rank,
//! on the node the allocation's layout gives it), so a lost rank ends its own step and not the others'.
//!
//! A rank's command is `setsid --fork --wait setpriv --pdeathsig KILL srun --ntasks=1 --nodes=1 --nodelist=NODE
//! --exact --mem=0 ... /bin/sh -c REPORTER hvd-rank WRAPPER ...`, with the ssh engine's remote wrapper
//! ([`ssh::WRAPPER`]) under [`REPORTER`] as the task: a nonce and the job token travel on stdin (srun forwards it to
//! the task), stopping the rank is writing the signal's name there, and the wrapper kills what the rank's command
//! left. The reporter ends the task's stderr with the rank's exit status and the nonce: srun exits 0 after "Node
//! failure" too, and only that report tells a finished rank from one whose node was lost.
//!
//! srun runs in a session of its own with a parent-death signal: when the supervisor kills the rank's process group (SIGKILL after the grace period), `setsid` dies, the
//! kernel kills srun, and srun's own shepherd process, left alive in srun's session, cancels the job step, which
//! kills the task on its node. (Had srun and its shepherd died together, the task and its step would run on.)

use std::net::{IpAddr, Ipv4Addr};
use std::process::Command;
use std::time::Duration;

use crate::LaunchError;
use crate::engine::{Plan, PlannedStep, RankCommand, RankStart};
use crate::engines::net::{resolve_host, route_source};
use crate::engines::ssh::{INTERFACE_VARS, RemoteRankEnv, WRAPPER, started_rank_env, stdin_vars};
use crate::env::{Slot, WorkerLayout};

/// The task of a rank's srun (`sh -c REPORTER hvd-rank WRAPPER ARGS...`): reads the nonce from the first line of
/// stdin (into a variable the rank's command never sees: `n`, `w` and `c` are unset first, since srun passes the
/// launcher's environment and `read` into an exported variable keeps it exported), runs the remote wrapper with
/// the rest of stdin and ARGS, then ends its stderr with `hvd-rank-status NONCE CODE` and exits with CODE. srun exits 0 after a node failure
/// (Slurm 22.05); without this report, such a rank is lost, not finished (`supervisor/reported.rs`).
pub const REPORTER: &str = concat!(
    r#"unset n w c; IFS= read -r n || { echo hvd: no nonce on stdin >&2; exit 125; }; w=$1; shift; "#,
    r#"/bin/sh -c "$w" hvd-rank "$@"; c=$?; printf "hvd-rank-status %s %s\n" "$n" "$c" >&2; exit "$c""#
);

/// What an elastic step needs from the allocation: where its ranks go and where their rendezvous listens.
#[derive(Debug, Clone)]
pub struct Allocation {
    /// The allocation's nodes and how many tasks each has (`SLURM_JOB_NODELIST`, expanded by `scontrol show
    /// hostnames`, with `SLURM_TASKS_PER_NODE`), in the allocation's order.
    pub nodes: Vec<(String, u32)>,
    /// The address the rendezvous server binds: loopback when every node is this machine, else the local address
    /// whose route reaches the first other node.
    pub bind_ip: IpAddr,
    /// The nodes' addresses (and `bind_ip`): the only peers answered on the token-less endpoints.
    pub peers: Vec<IpAddr>,
    /// Tenths of a second the rank's wrapper waits after the stop signal before SIGKILL (the launcher's `--grace`).
    pub grace_ticks: u128,
}

impl Allocation {
    /// Reads the allocation this process runs in from its `SLURM_*` variables (hostile input: a value that is not
    /// what Slurm writes is an error naming the variable).
    pub fn from_env(grace: Duration) -> Result<Self, LaunchError> {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.trim().is_empty());
        let list = var(crate::env_vars::SLURM_JOB_NODELIST).ok_or_else(|| {
            LaunchError::Engine(format!(
                "an elastic step on the slurm engine needs the allocation's nodes, but `{}` is not set: run `hvd \
                 run` inside the allocation (salloc, or an sbatch script)",
                crate::env_vars::SLURM_JOB_NODELIST
            ))
        })?;
        let tasks = var(crate::env_vars::SLURM_TASKS_PER_NODE).ok_or_else(|| {
            LaunchError::Engine(format!(
                "an elastic step on the slurm engine needs `{}` (how many tasks each node of the allocation has), \
                 which is not set",
                crate::env_vars::SLURM_TASKS_PER_NODE
            ))
        })?;
        let list = node_list(&list)?;
        let out = Command::new("scontrol")
            .args(["show", "hostnames", list])
            .output()
            .map_err(|e| {
                LaunchError::Engine(format!(
                    "cannot run `scontrol show hostnames` for the allocation's nodes ({e}); is Slurm's scontrol on \
                     PATH?"
                ))
            })?;
        if !out.status.success() {
            return Err(LaunchError::Engine(format!(
                "`scontrol show hostnames {list}` failed: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let names = node_names(&String::from_utf8_lossy(&out.stdout))?;
        let counts = tasks_per_node(&tasks)?;
        if counts.len() != names.len() {
            return Err(LaunchError::Engine(format!(
                "`{}` is `{tasks}` ({} nodes) but `{}` names {} nodes",
                crate::env_vars::SLURM_TASKS_PER_NODE,
                counts.len(),
                crate::env_vars::SLURM_JOB_NODELIST,
                names.len()
            )));
        }
        let nodes: Vec<(String, u32)> = names.into_iter().zip(counts).collect();
        let mut remote = Vec::new();
        for (name, _) in &nodes {
            if !is_this_machine(name) {
                remote.push(resolve_host(name)?);
            }
        }
        let bind_ip = match remote.first() {
            None => IpAddr::V4(Ipv4Addr::LOCALHOST),
            Some(peer) => route_source(*peer)?,
        };
        let mut peers = remote;
        if !peers.contains(&bind_ip) {
            peers.push(bind_ip);
        }
        Ok(Allocation {
            nodes,
            bind_ip,
            peers,
            grace_ticks: (grace.as_millis() / 100).max(1),
        })
    }

    /// `workers` ranks over the nodes, each node's tasks in order (block distribution, as one srun places them).
    /// More ranks than tasks wrap around the nodes: [`Allocation::check_workers`] refuses such a step first.
    pub fn layout(&self, workers: u32) -> WorkerLayout {
        WorkerLayout::spread(&self.nodes, workers)
    }

    /// How many tasks the allocation has (the sum of `SLURM_TASKS_PER_NODE`).
    pub fn tasks(&self) -> u64 {
        self.nodes.iter().map(|(_, n)| u64::from(*n)).sum()
    }

    /// Refuses elastic step `step` on `workers` ranks when the allocation has fewer tasks: a rank is an `srun
    /// --exact` of one task, and one past the allocation's tasks would wait for a free one ("Requested nodes are
    /// busy") while the others time out at a rendezvous that never forms.
    pub fn check_workers(&self, step: &str, workers: u32) -> Result<(), LaunchError> {
        let tasks = self.tasks();
        if u64::from(workers) > tasks {
            return Err(LaunchError::Engine(format!(
                "elastic step `{step}` has {workers} workers, but the allocation has {tasks} tasks (`{}` is `{}`): \
                 each rank is a job step of one task, and one past the allocation's tasks would never start; ask \
                 salloc/sbatch for at least {workers} tasks, or run fewer workers (`--max-workers`)",
                crate::env_vars::SLURM_TASKS_PER_NODE,
                self.tasks_per_node_text()
            )));
        }
        Ok(())
    }

    /// The allocation's tasks per node in `SLURM_TASKS_PER_NODE`'s form (`2(x3),1`).
    fn tasks_per_node_text(&self) -> String {
        let mut parts: Vec<(u32, u32)> = Vec::new();
        for (_, n) in &self.nodes {
            match parts.last_mut() {
                Some((m, repeat)) if m == n => *repeat += 1,
                _ => parts.push((*n, 1)),
            }
        }
        parts
            .iter()
            .map(|(n, repeat)| match repeat {
                1 => n.to_string(),
                _ => format!("{n}(x{repeat})"),
            })
            .collect::<Vec<_>>()
            .join(",")
    }
}

/// `SLURM_JOB_NODELIST` when it is a Slurm host list (`n[1-3,5],gpu-07.cluster`: names, bracketed ranges, commas)
/// that cannot be read as an option of `scontrol`; anything else is refused naming the variable.
pub fn node_list(value: &str) -> Result<&str, LaunchError> {
    let value = value.trim();
    if !(value.len() <= 1 << 16 && host_list_text(value)) {
        return Err(LaunchError::Engine(format!(
            "`{}` is `{}`, not a Slurm node list (host names and `[1-3]` ranges, separated by commas); run `hvd run` \
             inside the allocation as Slurm sets it",
            crate::env_vars::SLURM_JOB_NODELIST,
            value.escape_default()
        )));
    }
    Ok(value)
}

/// Whether `value` has only what a Slurm host list has (names, brackets, commas) and cannot be read as an option: not
/// empty, not beginning with `-`, `,` or `[`. Brackets are not matched here.
pub fn host_list_text(value: &str) -> bool {
    !value.is_empty()
        && !value.starts_with(['-', ',', '['])
        && value.bytes().all(|b| {
            b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'[' | b']' | b',')
        })
}

/// The node names `scontrol show hostnames` printed, one a line; a name with characters no host name has is refused.
pub fn node_names(text: &str) -> Result<Vec<String>, LaunchError> {
    let names: Vec<String> = text
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect();
    if let Some(bad) = names.iter().find(|n| {
        n.starts_with('-')
            || !n
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_'))
    }) {
        return Err(LaunchError::Engine(format!(
            "the allocation's node list names `{}`, which is not a host name",
            bad.escape_default()
        )));
    }
    if names.is_empty() {
        return Err(LaunchError::Engine(
            "the allocation's node list (`scontrol show hostnames`) is empty".into(),
        ));
    }
    Ok(names)
}

/// `SLURM_TASKS_PER_NODE` (`2(x3),1`: two tasks on each of three nodes, then one) as one count per node.
pub fn tasks_per_node(value: &str) -> Result<Vec<u32>, LaunchError> {
    let bad = || {
        LaunchError::Engine(format!(
            "`{}` is `{}`, not Slurm's `N` / `N(xM)` list",
            crate::env_vars::SLURM_TASKS_PER_NODE,
            value.escape_default()
        ))
    };
    let mut counts = Vec::new();
    for part in value.trim().split(',') {
        let (n, repeat) = match part.split_once("(x") {
            Some((n, rest)) => (n, rest.strip_suffix(')').ok_or_else(bad)?),
            None => (part, "1"),
        };
        let n: u32 = n.parse().map_err(|_| bad())?;
        let repeat: u32 = repeat.parse().map_err(|_| bad())?;
        // More nodes than any allocation has is not a list Slurm wrote.
        if repeat == 0 || counts.len() + repeat as usize > 1 << 16 {
            return Err(bad());
        }
        counts.extend(std::iter::repeat_n(n, repeat as usize));
    }
    Ok(counts)
}

/// Whether node `name` is the machine `hvd run` runs on (its host name, or a name that resolves to an address of
/// this machine).
fn is_this_machine(name: &str) -> bool {
    let here = crate::env::local_hostname();
    if name == here || here.split('.').next() == Some(name) {
        return true;
    }
    resolve_host(name)
        .is_ok_and(|ip| ip.is_loopback() || std::net::TcpListener::bind((ip, 0)).is_ok())
}

/// How one rank of an elastic step is started (see the module docs).
#[derive(Debug, Clone)]
pub struct RankSrun<'a> {
    pub allocation: &'a Allocation,
    pub cpus_per_task: Option<u32>,
    pub gpus_per_task: u32,
    /// The hvd binary on the nodes: with binary caches, each rank starts through its `worker-env --once --pull`,
    /// which finds the env in the node's store (pulling it if gone) and roots it while the rank runs.
    pub shim: &'a std::path::Path,
}

impl RankSrun<'_> {
    /// The rank's variables on its node: the local engine's (the same contract, [`crate::env::worker_env`]) with
    /// `MASTER_PORT` and the step marker ([`remote_rank_env`]), without the token (it travels on stdin), with
    /// `MASTER_ADDR` rank 0's node, the interface variables left to the wrapper (it finds the interface that reaches
    /// the rendezvous) and, when Slurm gives each rank its GPUs (`--gpus-per-task`), `CUDA_VISIBLE_DEVICES` left to
    /// Slurm.
    pub fn vars(&self, env: RemoteRankEnv<'_>) -> Vec<(String, String)> {
        let mut vars: std::collections::BTreeMap<String, String> = env.vars.into_iter().collect();
        vars.remove("HVD_JOB_TOKEN");
        vars.insert(
            crate::env_vars::MASTER_ADDR.into(),
            env.rank0_host.to_owned(),
        );
        for name in INTERFACE_VARS {
            vars.remove(name);
        }
        if self.gpus_per_task > 0 {
            vars.remove("CUDA_VISIBLE_DEVICES");
        }
        vars.into_iter().collect()
    }

    /// The argv of one rank (see the module docs; its variables, [`RankSrun::vars`], go on its stdin), `rendezvous`
    /// the address the wrapper finds the interface for.
    pub fn argv(
        &self,
        plan: &Plan,
        step: &PlannedStep,
        slot: &Slot,
        rendezvous: IpAddr,
        pull: &[String],
    ) -> Vec<String> {
        let mut argv: Vec<String> = [
            "setsid",
            "--fork",
            "--wait",
            "setpriv",
            "--pdeathsig",
            "KILL",
            "srun",
        ]
        .iter()
        .map(|s| (*s).to_owned())
        .collect();
        argv.extend([
            "--ntasks=1".to_owned(),
            "--nodes=1".into(),
            format!("--nodelist={}", slot.host),
            // Only what one task asks for (so ranks on a node get distinct GPUs), and memory shared within the job.
            "--exact".into(),
            "--mem=0".into(),
            "--kill-on-bad-exit=1".into(),
            format!("--job-name={}.{}", step.name, slot.rank),
        ]);
        if let Some(c) = self.cpus_per_task {
            argv.push(format!("--cpus-per-task={c}"));
        }
        if self.gpus_per_task > 0 {
            argv.push(format!("--gpus-per-task={}", self.gpus_per_task));
        }
        argv.extend([
            "/bin/sh".to_owned(),
            "-c".into(),
            REPORTER.into(),
            "hvd-rank".into(),
            WRAPPER.into(),
            plan.project_dir.display().to_string(),
            self.allocation.grace_ticks.to_string(),
            rendezvous.to_string(),
        ]);
        argv.extend(pull.iter().cloned());
        argv.extend(["/bin/sh".into(), "-c".into(), step.command.clone()]);
        argv
    }

    /// What goes before a rank's command with binary caches: `hvd worker-env --once --pull=ENV --cache=...
    /// --trusted-key=... --` (empty without caches or keys); a cache URL with credentials is refused.
    pub fn pull(&self, plan: &Plan) -> Result<Vec<String>, LaunchError> {
        Ok(
            match (crate::engines::pull_argv(plan, self.shim)?, &plan.env_dir) {
                (Some(pull), Some(env)) => {
                    let mut argv =
                        crate::engines::worker_pull_argv(&pull, &env.display().to_string(), true);
                    argv.push("--".into());
                    argv
                }
                _ => Vec::new(),
            },
        )
    }

    /// The rank's process: its srun, stopped through its stdin like an ssh rank ([`RankCommand::remote`]).
    pub fn command(&self, rank: &RankStart<'_>) -> Result<RankCommand, LaunchError> {
        let Some(rendezvous) = rank.rendezvous else {
            return Ok(RankCommand::local(rank));
        };
        let vars = self.vars(started_rank_env(rank, rendezvous));
        let after_token = stdin_vars(&vars, "the slurm engine")?;
        let pull = self.pull(rank.plan)?;
        let argv = self.argv(rank.plan, rank.step, rank.slot, rendezvous.addr.ip(), &pull);
        Ok(RankCommand::remote_argv(&argv, after_token, true))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engines::ssh::remote_rank_env;
    use crate::env::RendezvousInfo;

    #[test]
    fn tasks_per_node_expands_slurms_repeats_and_refuses_anything_else() {
        assert_eq!(tasks_per_node("4").unwrap(), vec![4]);
        assert_eq!(tasks_per_node("2(x3),1").unwrap(), vec![2, 2, 2, 1]);
        for bad in ["", "2(x3", "x", "2(x0)", "2(x99999999)", "-1", "2,,1"] {
            let err = tasks_per_node(bad).unwrap_err().to_string();
            assert!(err.contains("SLURM_TASKS_PER_NODE"), "{bad}: {err}");
        }
    }

    #[test]
    fn node_list_is_a_slurm_host_list_and_never_an_option() {
        for good in ["n1", "n[1-3,5],gpu-07.cluster", "127.0.0.[1-2]", "a_b"] {
            assert_eq!(node_list(good).unwrap(), good);
        }
        for bad in [
            "",
            "-oProxyCommand=x",
            "--help",
            " -x",
            "n1 n2",
            "n1;rm",
            "n$(id)",
            ",n1",
            "[1-2]",
            "n1\n-x",
        ] {
            let err = node_list(bad).unwrap_err().to_string();
            assert!(err.contains("SLURM_JOB_NODELIST"), "{bad:?}: {err}");
        }
    }

    #[test]
    fn a_step_with_more_workers_than_the_allocations_tasks_is_refused() {
        let allocation = Allocation {
            nodes: vec![("n1".into(), 2), ("n2".into(), 2), ("n3".into(), 1)],
            bind_ip: "10.0.0.1".parse().unwrap(),
            peers: vec![],
            grace_ticks: 20,
        };
        assert_eq!(allocation.tasks(), 5);
        allocation.check_workers("train", 5).unwrap();
        let err = allocation
            .check_workers("train", 6)
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("elastic step `train` has 6 workers, but the allocation has 5 tasks")
                && err.contains("`SLURM_TASKS_PER_NODE` is `2(x2),1`"),
            "{err}"
        );
    }

    /// The task as srun runs it: the reporter reads the nonce, the wrapper the token and the variables, and the
    /// task's stderr ends with the rank's own exit status and the nonce, which the rank's command never sees.
    #[test]
    fn the_reporter_ends_the_tasks_stderr_with_the_ranks_status() {
        use std::io::Write as _;
        let dir = tempfile::tempdir().unwrap();
        let mut child = Command::new("/bin/sh")
            .args(["-c", REPORTER, "hvd-rank", WRAPPER])
            .arg(dir.path())
            .args(["20", "", "/bin/sh", "-c"])
            .arg("echo \"[$HVD_JOB_TOKEN]\"; env | grep -c -e n0nce -e '^[nwc]='; printf partial >&2; exit 7")
            // srun passes the launcher's environment: exported names the reporter reads into must not carry the
            // nonce (or the reporter's own script) to the rank's command.
            .env("n", "x")
            .env("w", "x")
            .env("c", "x")
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Kept open until the task ends: its end of file is the wrapper's stop signal.
        let mut stdin = child.stdin.take().unwrap();
        // The nonce, the token, then the rank's variables up to an empty line.
        writeln!(stdin, "n0nce\ns3cr3t\nHVD_RANK=1\n").unwrap();
        let out = child.wait_with_output().unwrap();
        drop(stdin);
        assert_eq!(out.status.code(), Some(7));
        assert_eq!(String::from_utf8_lossy(&out.stdout), "[s3cr3t]\n0\n");
        assert_eq!(
            String::from_utf8_lossy(&out.stderr),
            "partialhvd-rank-status n0nce 7\n"
        );
    }

    #[test]
    fn node_names_refuse_what_is_not_a_host_name() {
        assert_eq!(
            node_names("n1\nn2.cluster\n\n").unwrap(),
            vec!["n1".to_owned(), "n2.cluster".to_owned()]
        );
        for bad in ["-oProxyCommand=x\n", "n1\nn 2\n", "a\u{1b}[2J\n", "\n"] {
            assert!(node_names(bad).is_err(), "{bad:?}");
        }
    }

    /// The rank's srun runs in its own session with a parent-death signal, on its node, with one task's resources;
    /// the wrapper gets the directory, the grace and the rendezvous address; the token is not on the command line.
    #[test]
    fn a_rank_is_one_srun_on_its_node_under_the_remote_wrapper() {
        let allocation = Allocation {
            nodes: vec![("n1".into(), 2), ("n2".into(), 2)],
            bind_ip: "10.0.0.1".parse().unwrap(),
            peers: vec![],
            grace_ticks: 20,
        };
        let layout = allocation.layout(3);
        assert_eq!(
            layout
                .slots
                .iter()
                .map(|s| (s.host.as_str(), s.local_rank))
                .collect::<Vec<_>>(),
            [("n1", 0), ("n1", 1), ("n2", 0)]
        );
        let srun = RankSrun {
            allocation: &allocation,
            cpus_per_task: Some(2),
            gpus_per_task: 1,
            shim: std::path::Path::new("/bin/hvd"),
        };
        let step = PlannedStep {
            name: "train".into(),
            command: "python t.py".into(),
            needs: vec![],
            workers: Some(3),
            layout: layout.clone(),
            env: Default::default(),
            inputs: vec![],
            outputs: vec![],
            timeout: None,
            restarts: 0,
            min_workers: Some(2),
            elastic: Default::default(),
        };
        let plan = Plan {
            project: "p".into(),
            project_dir: "/work/p".into(),
            state_dir: "/work/p/.hvd".into(),
            steps: vec![step.clone()],
            gpus_per_worker: 1,
            env_dir: None,
            caches: vec![],
            trusted_keys: vec![],
            engine: std::sync::Arc::new(crate::engine::Local),
            notes: vec![],
        };
        let rendezvous = RendezvousInfo {
            addr: "10.0.0.1:5000".parse().unwrap(),
            token: "s3cr3t".into(),
        };
        let slot = &layout.slots[2];
        let vars = srun.vars(remote_rank_env(
            &plan,
            &step,
            slot,
            &rendezvous,
            "6000",
            "run/train/0",
        ));
        let argv = srun.argv(
            &plan,
            &step,
            slot,
            rendezvous.addr.ip(),
            &srun.pull(&plan).unwrap(),
        );
        let stdin = stdin_vars(&vars, "the slurm engine").unwrap();
        // A name the host's shell owns is refused before anything runs, naming the step.
        crate::engines::ssh::check_elastic_env_names(&plan, "the slurm engine").unwrap();
        let mut owned = step.clone();
        owned.env.insert("UID".into(), "0".into());
        let bad = Plan {
            steps: vec![owned],
            ..plan.clone()
        };
        let err = crate::engines::ssh::check_elastic_env_names(&bad, "the slurm engine")
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(
                "step `train`: variable `UID` cannot be given to a rank on the slurm engine"
            ),
            "{err}"
        );
        let line = crate::engines::shell::line(&argv);
        assert!(
            line.starts_with(
                "setsid --fork --wait setpriv --pdeathsig KILL srun --ntasks=1 --nodes=1 --nodelist=n2 --exact \
                 --mem=0 --kill-on-bad-exit=1 --job-name=train.2 --cpus-per-task=2 --gpus-per-task=1 /bin/sh -c "
            ),
            "{line}"
        );
        let wrapper_args = &argv[argv.iter().position(|a| a == "hvd-rank").unwrap()..];
        assert_eq!(argv[argv.len() - wrapper_args.len() - 1], REPORTER);
        assert_eq!(wrapper_args[1], WRAPPER);
        assert_eq!(wrapper_args[2..5], ["/work/p", "20", "10.0.0.1"]);
        assert_eq!(argv[argv.len() - 3..], ["/bin/sh", "-c", "python t.py"]);
        for want in [
            "HVD_RANK=2",
            "HVD_RENDEZVOUS=10.0.0.1:5000",
            "MASTER_ADDR=n1",
            "MASTER_PORT=6000",
            "HVD_RUN_STEP=run/train/0",
        ] {
            // On the rank's stdin, never on its command line (`ps` on the node, Slurm's record of the step).
            assert!(stdin.lines().any(|l| l == want), "{want}: {stdin}");
            assert!(!argv.iter().any(|a| a.contains(want)), "{want}: {line}");
        }
        assert!(
            !line.contains("s3cr3t") && !stdin.contains("s3cr3t"),
            "{line}"
        );
        // With binary caches the rank starts through the shim, which gets the env into the node's store and roots
        // it while the rank runs; a cache URL with credentials is refused.
        let env = "/store/0123456789abcdef0123456789abcdef-t-env";
        let cached = Plan {
            env_dir: Some(env.into()),
            caches: vec!["file:///c".into()],
            trusted_keys: vec!["k:AAAA".into()],
            ..plan.clone()
        };
        let pull = srun.pull(&cached).unwrap();
        let argv = srun.argv(&cached, &step, slot, rendezvous.addr.ip(), &pull);
        let at = argv.len() - 10;
        assert_eq!(
            argv[at..],
            [
                "/bin/hvd",
                "worker-env",
                "--once",
                &format!("--pull={env}"),
                "--cache=file:///c",
                "--trusted-key=k:AAAA",
                "--",
                "/bin/sh",
                "-c",
                "python t.py"
            ],
            "{:?}",
            &argv[at..]
        );
        let leaky = Plan {
            caches: vec!["https://user:token@cache.example/c".into()],
            ..cached.clone()
        };
        assert!(srun.pull(&leaky).is_err());
        for left_out in [
            "CUDA_VISIBLE_DEVICES=",
            "NCCL_SOCKET_IFNAME=",
            "HVD_JOB_TOKEN=",
        ] {
            assert!(
                !argv.iter().any(|a| a.starts_with(left_out)),
                "{left_out}: {line}"
            );
        }
    }
}
