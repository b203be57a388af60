//! The test Slurm 22.05 (FACTS.md): munged, slurmctld and slurmd in a temporary directory with their own ports, run
//! as root. [`Slurm::start`] is one node, this machine; [`Slurm::start_two_nodes`] is two nodes as network namespaces
//! (nshosts' launcher machine and hosts): slurmctld and every client (salloc, sbatch, squeue, `hvd run`) in the
//! launcher's namespace, one slurmd per host namespace under a UTS namespace of its own with the node's host name
//! (slurmd finds its `NodeName` line by host name: `slurmd -N` needs a multiple-slurmd build), a mount namespace in
//! which /etc/hosts names the nodes (hvd resolves node names), and optionally tmpfs over paths that are then private
//! to the node (its store). munged runs in the root namespace; its socket is a path every namespace sees.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use super::nshosts::{self, HOSTS, LAUNCHER_ADDR};
use super::{HVD, text};

/// The two nodes' names (their host names in their UTS namespaces), at [`nshosts::HOSTS`]' addresses.
pub const NODES: [&str; 2] = ["hvdn1", "hvdn2"];

/// A running test Slurm; the daemons (and, with two nodes, everything in their namespaces) are killed when it is
/// dropped.
pub struct Slurm {
    pub dir: tempfile::TempDir,
    /// munged, slurmctld, and slurmd on one node.
    daemons: Vec<Child>,
    /// With two nodes: the launcher's namespace, then the nodes'.
    pub namespaces: Vec<String>,
    /// With two nodes: each node's slurmd (`None` once the node is lost).
    slurmds: Vec<Option<Child>>,
}

impl Drop for Slurm {
    fn drop(&mut self) {
        for child in self.slurmds.iter_mut().flatten() {
            let _ = child.kill();
            let _ = child.wait();
        }
        for child in self.daemons.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
        nshosts::remove_namespaces(&self.namespaces);
    }
}

/// Whether `program` is on PATH (saying so when not).
pub fn have(program: &str) -> bool {
    let found = Command::new("sh")
        .args(["-c", &format!("command -v {program}")])
        .output()
        .is_ok_and(|o| o.status.success());
    if !found {
        eprintln!("skipped: `{program}` is not installed");
    }
    found
}

/// Whether Slurm, munge and `extra` are installed and this is root (saying what is missing when not).
fn prerequisites(extra: &[&str]) -> bool {
    let slurm = [
        "munged",
        "mungekey",
        "slurmctld",
        "slurmd",
        "salloc",
        "sinfo",
    ];
    for program in slurm.iter().chain(extra) {
        // iproute2's `ip` may be in an sbin directory a CI PATH lacks (nshosts finds it there).
        let found = if extra.contains(program) {
            nshosts::find_program(program).is_some()
        } else {
            have(program)
        };
        if !found {
            eprintln!(
                "skipped: the test Slurm needs `{program}` (scripts/install-deps installs Slurm, munge and iproute2)"
            );
            return false;
        }
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { nshosts::libc_geteuid() } != 0 {
        eprintln!("skipped: the test Slurm runs its daemons as root");
        return false;
    }
    true
}

/// `args` as a background daemon in a session of its own, with the config; stderr into `log/NAME.err`.
fn daemon(dir: &Path, name: &str, args: &[&str]) -> Child {
    Command::new("setsid")
        .args(args)
        .env("SLURM_CONF", dir.join("slurm.conf"))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join(format!("log/{name}.err"))).unwrap())
        .spawn()
        .unwrap()
}

/// A new temporary directory with munged started on a fresh key (its socket `munge/sock`), and the directories
/// the daemons write.
fn start_munged(daemons: &mut Vec<Child>) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for sub in ["state", "spool", "run", "log", "munge"] {
        std::fs::create_dir_all(d.join(sub)).unwrap();
    }
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(d, std::fs::Permissions::from_mode(0o755)).unwrap();
    std::fs::set_permissions(d.join("munge"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let key = d.join("munge/key");
    let ok = Command::new("mungekey")
        .arg("-c")
        .arg("-k")
        .arg(&key)
        .output()
        .unwrap();
    assert!(ok.status.success(), "{}", text(&ok).1);
    let p = d.display();
    daemons.push(daemon(
        d,
        "munged",
        &[
            "munged",
            "-F",
            &format!("--socket={p}/munge/sock"),
            &format!("--key-file={}", key.display()),
            &format!("--pid-file={p}/run/munged.pid"),
            &format!("--seed-file={p}/munge/seed"),
            &format!("--log-file={p}/log/munged.log"),
        ],
    ));
    super::wait_for_path(&d.join("munge/sock"), Duration::from_secs(10));
    dir
}

/// slurm.conf in `dir`: the settings of FACTS.md, the controller `controller`, `nodes` (NodeName lines) and the
/// slurmd files (`node_files`: `Slurmd...=` lines).
fn write_conf(dir: &Path, controller: &str, nodes: &str, node_files: &str) {
    let p = dir.display();
    let conf = format!(
        "ClusterName=hvdtest\nSlurmctldHost={controller}\nAuthType=auth/munge\nAuthInfo=socket={p}/munge/sock\n\
         CredType=cred/munge\nSlurmUser=root\nSlurmdUser=root\nProctrackType=proctrack/linuxproc\n\
         TaskPlugin=task/none\nJobAcctGatherType=jobacct_gather/none\n\
         AccountingStorageType=accounting_storage/none\nSelectType=select/cons_tres\n\
         SelectTypeParameters=CR_Core\nMpiDefault=none\nMailProg=/bin/true\nReturnToService=2\n\
         SlurmctldPort={}\nSlurmdPort={}\nStateSaveLocation={p}/state\nSlurmctldPidFile={p}/run/slurmctld.pid\n\
         SlurmctldLogFile={p}/log/slurmctld.log\n{node_files}{nodes}\n\
         PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP\n",
        super::free_port(),
        super::free_port(),
    );
    std::fs::write(dir.join("slurm.conf"), conf).unwrap();
}

impl Slurm {
    pub fn conf(&self) -> PathBuf {
        self.dir.path().join("slurm.conf")
    }

    /// A single-node Slurm on this machine. `None` (saying why) where Slurm is not installed or this is not root.
    pub fn start() -> Option<Slurm> {
        if !prerequisites(&[]) {
            return None;
        }
        let mut daemons = Vec::new();
        let dir = start_munged(&mut daemons);
        let d = dir.path().to_path_buf();
        let node = Command::new("slurmd").arg("-C").output().unwrap();
        let node = text(&node).0.lines().next().unwrap_or_default().to_owned();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        let p = d.display();
        write_conf(
            &d,
            host.trim(),
            &node,
            &format!(
                "SlurmdSpoolDir={p}/spool\nSlurmdPidFile={p}/run/slurmd.pid\nSlurmdLogFile={p}/log/slurmd.log\n"
            ),
        );
        let mut slurm = Slurm {
            dir,
            daemons,
            namespaces: Vec::new(),
            slurmds: Vec::new(),
        };
        slurm
            .daemons
            .push(daemon(&d, "slurmctld", &["slurmctld", "-D", "-i"]));
        slurm.daemons.push(daemon(&d, "slurmd", &["slurmd", "-D"]));
        slurm.wait_idle(1);
        Some(slurm)
    }

    /// Two nodes ([`NODES`]) of 2 CPUs each, as network namespaces named `hvd<tag><pid>-{l,h1,h2}`; `private[i]`
    /// are paths covered by an empty tmpfs on node `i` (what the node writes there is its own; what the launcher's
    /// machine keeps there the node does not see). `None` (saying why) where Slurm, iproute2 or util-linux's
    /// nsenter/unshare is missing, or this is not root.
    pub fn start_two_nodes(tag: &str, private: [&[&Path]; 2]) -> Option<Slurm> {
        if !prerequisites(&["ip", "nsenter", "unshare"]) {
            return None;
        }
        let mut daemons = Vec::new();
        let dir = start_munged(&mut daemons);
        let mut slurm = Slurm {
            dir,
            daemons,
            namespaces: Vec::new(),
            slurmds: Vec::new(),
        };
        nshosts::add_namespaces(
            &format!("hvd{tag}{}", std::process::id()),
            &mut slurm.namespaces,
        );
        let d = slurm.dir.path().to_path_buf();
        let p = d.display();
        let mut hosts = format!("127.0.0.1 localhost\n::1 localhost\n{LAUNCHER_ADDR} hvdctl\n");
        let mut nodes = String::new();
        for (name, addr) in NODES.iter().zip(HOSTS) {
            hosts.push_str(&format!("{addr} {name}\n"));
            nodes.push_str(&format!(
                "NodeName={name} NodeAddr={addr} NodeHostname={name} CPUs=2 State=UNKNOWN\n"
            ));
            std::fs::create_dir_all(d.join(format!("spool-{name}"))).unwrap();
        }
        std::fs::write(d.join("hosts"), hosts).unwrap();
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap();
        // The controller's host name is this machine's (slurmctld checks it), its address the launcher's.
        write_conf(
            &d,
            &format!("{}({LAUNCHER_ADDR})", host.trim()),
            nodes.trim_end(),
            &format!(
                "SlurmdParameters=config_overrides\nSlurmdSpoolDir={p}/spool-%n\n\
                 SlurmdPidFile={p}/run/slurmd-%n.pid\nSlurmdLogFile={p}/log/slurmd-%n.log\n"
            ),
        );
        let net = |ns: &str| format!("--net=/run/netns/{ns}");
        let launcher = net(&slurm.namespaces[0]);
        slurm.daemons.push(daemon(
            &d,
            "slurmctld",
            &["nsenter", &launcher, "slurmctld", "-D", "-i"],
        ));
        for (i, name) in NODES.iter().enumerate() {
            // nsenter enters the network namespace alone: `ip netns exec` would mount a new /sys without the
            // cgroup hierarchies slurmd's cgroup plugin needs ("No filesystem mounted on /sys/fs/cgroup").
            let ns = net(&slurm.namespaces[i + 1]);
            let hosts = d.join("hosts").display().to_string();
            let mut args = vec![
                "nsenter",
                &ns,
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "/bin/sh",
                "-c",
                "n=$0; h=$1; shift; for p; do mount -t tmpfs hvd-node \"$p\" || exit 1; done; \
                 hostname \"$n\" && mount --bind \"$h\" /etc/hosts && exec slurmd -D",
                name,
                &hosts,
            ];
            let paths: Vec<String> = private[i].iter().map(|p| p.display().to_string()).collect();
            args.extend(paths.iter().map(String::as_str));
            slurm
                .slurmds
                .push(Some(daemon(&d, &format!("slurmd-{name}"), &args)));
        }
        slurm.wait_idle(2);
        Some(slurm)
    }

    /// Waits (up to 20 s) until `sinfo` lists `nodes` idle nodes.
    fn wait_idle(&self, nodes: usize) {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            let out = self
                .command("sinfo")
                .args(["-h", "-N", "-o", "%t"])
                .output()
                .unwrap();
            if text(&out).0.lines().filter(|l| l.trim() == "idle").count() == nodes {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the test Slurm did not become idle ({}); logs in {}",
                text(&out).0.trim(),
                self.dir.path().display()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// `program` with `SLURM_CONF`; with two nodes in the launcher's namespace, where /etc/hosts names the nodes.
    pub fn command(&self, program: &str) -> Command {
        let mut command = match self.namespaces.first() {
            None => Command::new(program),
            Some(launcher) => {
                let mut command = Command::new("nsenter");
                command
                    .arg(format!("--net=/run/netns/{launcher}"))
                    .args(nshosts::PRIVATE_MOUNTS_SH)
                    .arg("mount --bind \"$0\" /etc/hosts && exec \"$@\"")
                    .arg(self.dir.path().join("hosts"))
                    .arg(program);
                command
            }
        };
        command.env("SLURM_CONF", self.conf());
        command
    }

    /// `salloc -n2 --overcommit hvd run FILE --no-build --engine slurm`.
    pub fn run(&self, dir: &Path) -> Output {
        self.command("salloc")
            .args(["-n2", "--overcommit", HVD, "run"])
            .arg(dir.join("train.hvd"))
            .args(["--no-build", "--engine", "slurm", "--grace", "2"])
            .env("NO_COLOR", "1")
            .output()
            .unwrap()
    }

    /// `hvd run FILE --no-build --engine slurm ARGS` from outside any allocation (no `SLURM_*` but `SLURM_CONF`).
    pub fn submit(&self, dir: &Path, args: &[&str]) -> Output {
        let mut all = vec!["--no-build"];
        all.extend(args);
        self.submit_with(dir, &all)
    }

    /// [`Slurm::submit`] with `args` alone after `--engine slurm` (e.g. `--env-dir ENV` instead of `--no-build`).
    pub fn submit_with(&self, dir: &Path, args: &[&str]) -> Output {
        self.submit_command(dir, args).output().unwrap()
    }

    /// `hvd run FILE --engine slurm ARGS` from outside any allocation (no `SLURM_*` but `SLURM_CONF`).
    fn submit_command(&self, dir: &Path, args: &[&str]) -> Command {
        let mut command = self.command(HVD);
        command
            .arg("run")
            .arg(dir.join("train.hvd"))
            .args(["--engine", "slurm"])
            .args(args)
            .env("NO_COLOR", "1");
        for (name, _) in std::env::vars_os() {
            if name.to_string_lossy().starts_with("SLURM_") {
                command.env_remove(name);
            }
        }
        command.env("SLURM_CONF", self.conf());
        command
    }

    /// [`Slurm::submit`] with `--grace 2` started, its output piped (the batch jobs, followed).
    pub fn spawn_submit(&self, dir: &Path) -> Child {
        self.submit_command(dir, &["--no-build", "--grace", "2"])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// `scontrol -o show job ID`.
    pub fn job(&self, id: &str) -> String {
        let out = self
            .command("scontrol")
            .args(["-o", "show", "job", id])
            .output()
            .unwrap();
        text(&out).0
    }

    /// Asserts that Slurm says job `id` is in `state` (`COMPLETED`, `CANCELLED`, ...).
    pub fn assert_state(&self, id: &str, state: &str) {
        let job = self.job(id);
        assert!(job.contains(&format!("JobState={state}")), "{id}: {job}");
    }

    /// The jobs `squeue` still lists (pending, running or completing): `ID STATE REASON` lines.
    pub fn queued(&self) -> String {
        let out = self
            .command("squeue")
            .args(["-h", "-o", "%i %T %r"])
            .output()
            .unwrap();
        text(&out).0.trim().to_owned()
    }

    /// `salloc SALLOC sh -c 'hvd run FILE --no-build --engine slurm --grace 2'`, started; once hvd ends, the job's
    /// remaining steps (`squeue -s`) on `nodes` (all when empty) are written to `steps.txt` in `dir`, from inside the
    /// allocation, after waiting up to 30 s for them to go (a cancelled step is listed while Slurm completes it), and
    /// then every step still listed to `all-steps.txt` (`ID NAME NODES`).
    pub fn spawn_elastic_with(&self, dir: &Path, salloc: &[&str], nodes: &str) -> Child {
        let on = if nodes.is_empty() {
            String::new()
        } else {
            format!("-w {nodes}")
        };
        let script = format!(
            "{HVD} run {} --no-build --engine slurm --grace 2; s=$?; i=0; while [ $i -lt 150 ] && [ -n \
             \"$(squeue -h -s -j \"$SLURM_JOB_ID\" {on})\" ]; do i=$((i + 1)); sleep 0.2; done; \
             squeue -h -s -j \"$SLURM_JOB_ID\" {on} -o '%i %j' > {d}/steps.txt; \
             squeue -h -s -j \"$SLURM_JOB_ID\" -o '%i %j %N' > {d}/all-steps.txt; exit $s",
            dir.join("train.hvd").display(),
            d = dir.display()
        );
        self.command("salloc")
            .args(salloc)
            .args(["sh", "-c", &script])
            .env("NO_COLOR", "1")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// [`Slurm::spawn_elastic_with`] on 4 tasks of the one node (`salloc -n4 --overcommit`).
    pub fn spawn_elastic(&self, dir: &Path) -> Child {
        self.spawn_elastic_with(dir, &["-n4", "--overcommit"], "")
    }

    /// Node `i` (0 or 1, of two) is lost: everything in its namespace, its slurmd, the job steps' slurmstepd and the
    /// tasks, is killed at once (SIGKILL).
    pub fn lose_node(&mut self, i: usize) {
        nshosts::signal_all(&nshosts::netns_pids(&self.namespaces[i + 1]), 9);
        if let Some(mut slurmd) = self.slurmds[i].take() {
            let _ = slurmd.wait();
        }
    }

    /// Node `i` (0 or 1, of two) freezes: everything in its namespace, its slurmd, the job steps' slurmstepd and the
    /// tasks, is stopped (SIGSTOP): alive to the kernel, answering nobody; Slurm is not told. [`Slurm::lose_node`]
    /// ends them.
    pub fn freeze_node(&self, i: usize) {
        nshosts::signal_all(&nshosts::netns_pids(&self.namespaces[i + 1]), 19);
    }

    /// Node `i`, frozen, goes on (SIGCONT to everything in its namespace).
    pub fn thaw_node(&self, i: usize) {
        nshosts::signal_all(&nshosts::netns_pids(&self.namespaces[i + 1]), 18);
    }

    /// What runs in the nodes' namespaces besides their slurmd (`NS: PID COMMAND LINE` each).
    pub fn leftovers(&self) -> Vec<String> {
        let slurmds: Vec<u32> = self.slurmds.iter().flatten().map(Child::id).collect();
        let mut left = Vec::new();
        for ns in self.namespaces.iter().skip(1) {
            for pid in nshosts::netns_pids(ns) {
                if !slurmds.contains(&pid) {
                    left.push(format!("{ns}: {pid} {}", nshosts::cmdline(pid)));
                }
            }
        }
        left
    }

    /// The daemons' logs (slurmctld's and each slurmd's), for a failure message.
    pub fn logs(&self) -> String {
        let mut all = String::new();
        let Ok(entries) = std::fs::read_dir(self.dir.path().join("log")) else {
            return all;
        };
        for entry in entries.flatten() {
            let text = std::fs::read_to_string(entry.path()).unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(30).collect();
            all.push_str(&format!("== {}\n", entry.path().display()));
            for line in tail.into_iter().rev() {
                all.push_str(line);
                all.push('\n');
            }
        }
        all
    }
}

/// The `hvd.elastic` training script of tests/cli_elastic.rs (its `TRAIN`, read from that file so that every elastic
/// test runs the same script): `ELASTIC_STEPS` committed steps of allreduces; `ELASTIC_KILL` (`slot:step`) SIGKILLs a
/// worker when it begins a step, `ELASTIC_HANG` (`slot:step`) has one sleep there; each worker prints its re-forms
/// and what it finished with.
pub fn elastic_train_py() -> &'static str {
    let source = include_str!("../cli_elastic.rs");
    let start = "const TRAIN: &str = r#\"";
    let from = source
        .find(start)
        .expect("tests/cli_elastic.rs has `const TRAIN`")
        + start.len();
    let len = source[from..].find("\"#;").expect("`TRAIN` ends");
    &source[from..from + len]
}

/// A 4-worker elastic step (`{ min = 2, max = 4 }`) of [`elastic_train_py`] with `env` (`, NAME = "VALUE"...`).
pub fn elastic_project(steps: u32, env: &str, marker: &str) -> tempfile::TempDir {
    super::train_project(
        "{ min = 2, max = 4 }",
        &format!(", ELASTIC_STEPS = \"{steps}\", HVD_TEST_MARKER = \"{marker}\"{env}"),
        "",
        elastic_train_py(),
    )
}

/// Asserts that each `(slot, rank)` of `members` finished as that rank of a job of `members.len()`, all at the same
/// step (at least `steps`) with every step counted once and the same weights; that slot 2 (the lost one) did not
/// finish, no worker process and no job step is left, and no job is queued.
pub fn assert_finished_together(
    slurm: &Slurm,
    dir: &Path,
    out: &Output,
    (members, steps): (&[(u32, u32)], u32),
    marker: &str,
) {
    assert_trained_together(out, (members, steps));
    assert_nothing_left_in_slurm(slurm, dir, marker);
}

/// The first half of [`assert_finished_together`]: how the members finished.
pub fn assert_trained_together(out: &Output, (members, steps): (&[(u32, u32)], u32)) {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let step = super::assert_finished_together(&stdout, &stderr, members);
    assert!(step >= steps, "{stdout}");
    assert!(!stdout.contains("slot 2 finished"), "{stdout}");
}

/// The second half of [`assert_finished_together`]: no worker process with `marker`, no job step in `steps.txt`
/// (of [`Slurm::spawn_elastic_with`]) and, once the allocation has gone, no job.
pub fn assert_nothing_left_in_slurm(slurm: &Slurm, dir: &Path, marker: &str) {
    super::assert_nothing_left(marker);
    let steps_left = std::fs::read_to_string(dir.join("steps.txt")).unwrap();
    assert_eq!(steps_left.trim(), "", "job steps left in the allocation");
    slurm.assert_queue_empties();
}

impl Slurm {
    /// Asserts that `squeue` lists no job within 30 s (an allocation is listed, COMPLETING, for a moment after salloc
    /// returns).
    pub fn assert_queue_empties(&self) {
        let queued =
            super::wait_until_empty(Duration::from_secs(30), Duration::from_millis(100), || {
                Some(self.queued())
                    .filter(|q| !q.is_empty())
                    .into_iter()
                    .collect()
            });
        assert!(queued.is_empty(), "{queued:?}");
    }
}
