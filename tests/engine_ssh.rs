//! End-to-end tests of the `ssh` engine with the built binary: two network namespaces are the hosts (10.77.0.2 and
//! 10.77.0.3, each running its own sshd on port 2222 with a key made here), a third is the launcher's machine
//! (10.77.0.1, a bridge to both; `common::nshosts`). `hvd run --engine ssh` runs inside the launcher's namespace.
//!
//! These tests need root, `ip` (iproute2), `sshd`, `ssh` and `ssh-keygen` (scripts/install-deps installs them); where
//! one is missing they fail, saying so. Every test has its own namespaces, so they run in parallel; the namespaces
//! and daemons are removed when the test ends, also when it fails.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;

use common::nshosts::{HOSTS, Hosts, LAUNCHER_ADDR, SSH_PORT, libc_kill, tool};
use common::{HVD, project, text};

/// A project whose step `train` runs `run` (a shell command line without double quotes) on four ranks.
fn four_ranks(run: &str) -> tempfile::TempDir {
    assert!(!run.contains('"'), "{run}");
    project(&format!(
        "step train {{\n  run = \"{run}\"\n  workers = 4\n}}"
    ))
}

/// The job's four ranks with their hosts, by slot: ranks 0-1 on the first host, 2-3 on the second.
fn by_slot() -> impl Iterator<Item = (u32, &'static str)> {
    (0..4u32).map(|rank| (rank, HOSTS[(rank / 2) as usize]))
}

/// What `ar.py` ([`common::write_allreduce_py`]) prints after its allreduce.
const ALLREDUCE_REPORT_PY: &str = r#"sys.stdout.write(f"allreduce rank={r} size={n} sum={float(out[0])} ok={ok} host={os.environ['HVD_HOSTNAME']} "
                 f"local={os.environ['HVD_LOCAL_RANK']}/{os.environ['HVD_LOCAL_SIZE']} "
                 f"cross={os.environ['HVD_CROSS_RANK']}/{os.environ['HVD_CROSS_SIZE']} "
                 f"nccl={os.environ.get('NCCL_SOCKET_IFNAME')}\n")
# Horovod's gloo rendezvous (no token) answers the job's hosts.
import urllib.request
gloo = f"http://{os.environ['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{os.environ['HOROVOD_GLOO_RENDEZVOUS_PORT']}/test/k{r}"
put = urllib.request.urlopen(urllib.request.Request(gloo, data=b"v", method="PUT")).status
sys.stdout.write(f"gloo rank={r} put={put} get={urllib.request.urlopen(gloo).read().decode()}\n")
sys.stdout.flush()
sys.exit(0 if ok else 1)
"#;

/// A project whose one step runs the Python `hvd` package's allreduce on 4 ranks and checks the sum.
fn allreduce_project() -> tempfile::TempDir {
    let (python, package, lib) = common::allreduce_runtime();
    let dir = project(&format!(
        "step train {{\n  run = \"{python} ar.py\"\n  workers = 4\n  {}\n}}",
        common::allreduce_step_env(&package, &lib)
    ));
    common::write_allreduce_py(dir.path(), ALLREDUCE_REPORT_PY);
    dir
}

#[test]
fn the_allreduce_worker_runs_on_two_hosts_over_ssh() {
    let hosts = Hosts::start("a");
    let dir = allreduce_project();
    let out = hosts.hvd_run(dir.path(), &[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    // By slot: ranks 0-1 on the first host, 2-3 on the second; each host finds the interface that reaches the
    // launcher (`hvd0` in every namespace here).
    for (rank, host) in by_slot() {
        let want = format!(
            "[train {host}:{rank}] allreduce rank={rank} size=4 sum=10.0 ok=True host={host} local={}/2 cross={}/2 \
             nccl=hvd0",
            rank % 2,
            rank / 2
        );
        assert!(
            stdout.contains(&want),
            "missing `{want}`:\n{stdout}\n{stderr}"
        );
        let gloo = format!("[train {host}:{rank}] gloo rank={rank} put=200 get=v");
        assert!(
            stdout.contains(&gloo),
            "missing `{gloo}`:\n{stdout}\n{stderr}"
        );
    }
    assert!(
        stderr.contains(&format!("rendezvous {LAUNCHER_ADDR}:")),
        "{stderr}"
    );
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}

/// A secret in the step's `env` reaches every remote rank as it is, and while the ranks run no process's command line
/// shows it, on this machine or the hosts (the attacker: another user of either, reading `ps`); the same for every
/// rank variable. Before, each was a `NAME=VALUE` word of the ssh command line and of the host's wrapper.
#[test]
fn a_secret_in_env_reaches_the_remote_ranks_and_no_command_line() {
    let hosts = Hosts::start("e");
    // (Looked for without its quote, which a shell-quoted word would show as `'\''`.)
    let marker = format!("secret-{}-x", std::process::id());
    let secret = format!("{marker}'y");
    let dir = project(&format!(
        "step train {{\n  run = \"printf %s $SECRET_X > got.$HVD_RANK; printf %s $HVD_SIZE > size.$HVD_RANK; \
         sleep 1\"\n  workers = 4\n  env = {{ SECRET_X = \"{secret}\" }}\n}}"
    ));
    let (out, leaks) =
        common::run_reading_command_lines(hosts.hvd_command(dir.path(), &["--no-build"]), &marker);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        leaks.is_empty(),
        "the secret is on command lines: {leaks:#?}"
    );
    for rank in 0..4 {
        let got = |name: &str| std::fs::read_to_string(dir.path().join(format!("{name}.{rank}")));
        assert_eq!(got("got").unwrap(), secret, "rank {rank}");
        assert_eq!(got("size").unwrap(), "4", "rank {rank}");
    }
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}

/// A rank that prints nothing for longer than an idle timeout on its way keeps running: here each host's sshd closes a
/// command's session after 2 s without data either way (`ChannelTimeout`), as a kubelet closes an idle `kubectl exec`
/// stream (`--streaming-connection-idle-timeout`, 5 min on hardened clusters) or a load balancer an idle connection.
/// `hvd run` writes a keepalive line to every remote rank's stdin every `HVD_REMOTE_KEEPALIVE` seconds, which the
/// host's wrapper skips. With none (`0`), the same run loses its ranks: the timeout on the way is real.
#[test]
fn a_silent_rank_outlives_an_idle_timeout_on_its_way() {
    let hosts = Hosts::start_idle_timeout("k", 2);
    let dir = four_ranks("sleep 5; echo finished > done.$HVD_RANK");
    let run = |keepalive: &str| {
        hosts
            .hvd_command(dir.path(), &["--no-build", "--grace", "2"])
            .env("HVD_REMOTE_KEEPALIVE", keepalive)
            .output()
            .unwrap()
    };
    let out = run("0.5");
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..4 {
        let done = std::fs::read_to_string(dir.path().join(format!("done.{rank}")));
        assert_eq!(done.unwrap(), "finished\n", "rank {rank}");
        std::fs::remove_file(dir.path().join(format!("done.{rank}"))).unwrap();
    }
    let out = run("0");
    let (stdout, stderr) = text(&out);
    // sshd closed the session: ssh ends with 255.
    assert!(
        !out.status.success() && stderr.contains("ended first (exit code 255)"),
        "{stdout}\n{stderr}"
    );
    assert!(
        (0..4).all(|rank| !dir.path().join(format!("done.{rank}")).exists()),
        "a rank finished although its session was closed:\n{stderr}"
    );
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}

const FAILS: &str = r#"if [ $HVD_RANK = 2 ]; then i=0; while [ $(ls started.* 2>/dev/null | wc -l) -lt 3 ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done; echo boom-$HVD_RANK >&2; exit 3; fi; [ $HVD_RANK = 0 ] && setsid sleep 60 & touch started.$HVD_RANK; sleep 30 & wait"#;

#[test]
fn one_failing_rank_stops_every_host_and_leaves_nothing_behind() {
    let hosts = Hosts::start("b");
    let dir = four_ranks(FAILS);
    // Hosts by ssh config alias (h1 -> 10.77.0.2, h2 -> 10.77.0.3), from a hostfile.
    let hostfile = dir.path().join("hosts");
    std::fs::write(&hostfile, "# two hosts\nh1 slots=2\nh2 slots=2\n").unwrap();
    let out = hosts.hvd_run(dir.path(), &["--hostfile", hostfile.to_str().unwrap()]);
    common::assert_exit_saying(&out, 3, "rank 2 on h2 ended first (exit code 3)");
    let (_, stderr) = text(&out);
    assert!(stderr.contains("boom-2"), "{stderr}");
    // Every other rank had started its `sleep 30` (rank 2 waited for them) and was stopped.
    for rank in [0, 1, 3] {
        assert!(
            dir.path().join(format!("started.{rank}")).exists(),
            "rank {rank} never started:\n{stderr}"
        );
    }
    // hvd waits for ssh, and ssh for the remote wrapper: nothing of the job is left on either host, not even rank 0's
    // `setsid sleep 60`, which left the rank's session.
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
    // A host where the project directory does not exist fails before anything starts, saying what to do.
    let other = four_ranks(FAILS);
    let no_env = hosts.dir.path().join("no-such-env");
    let out = hosts
        .hvd_command(other.path(), &["--env-dir", &no_env.display().to_string()])
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains(&format!("no-such-env is missing on host `{}`", HOSTS[0]))
            && stderr.contains(&format!("no-such-env is missing on host `{}`", HOSTS[1])),
        "{stderr}"
    );
    assert!(stderr.contains("share the store"), "{stderr}");
}

/// `hvd run --no-build --dry-run --engine ssh <args>` of the project in `dir`.
fn ssh_dry_run(dir: &Path, args: &[&str]) -> Command {
    let mut command = common::hvd_run_command(dir);
    command
        .args(["--no-build", "--dry-run", "--engine", "ssh"])
        .args(args);
    command
}

#[test]
fn dry_run_prints_the_ssh_commands() {
    // No namespaces needed: hosts given as addresses and `--network-interface lo` make the output independent of
    // this machine's network.
    let dir = project(
        "step prep {\n  run = \"echo prep\"\n}\nstep train {\n  run = \"python train.py --lr 0.1\"\n  workers = 3\n  needs = [\"prep\"]\n  env = { X = \"it's x\" }\n}",
    );
    let (stdout, _) = common::succeeded(
        ssh_dry_run(
            dir.path(),
            &[
                "--hosts",
                // A host named twice is one host with both entries' slots.
                "10.77.0.2:1,10.77.0.3:2,10.77.0.2:1",
                "--ssh-port",
                "2222",
                "--ssh-identity",
                "/keys/id",
                "--network-interface",
                "lo",
            ],
        )
        .env("PATH", "/usr/bin:/bin")
        .env("OMP_NUM_THREADS", "1"),
    );
    let got = stdout.replace(&dir.path().display().to_string(), "@DIR@");
    common::assert_golden("ssh-dry-run.txt", &got);
    // Each ssh line is one valid shell command line, and the job token is on none of them.
    let lines: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("ssh: "))
        .collect();
    assert_eq!(lines.len(), 3, "{stdout}");
    // The variables are on the line after each (what the rank's stdin carries), never on the ssh command line.
    let stdins: Vec<&str> = stdout
        .lines()
        .filter_map(|l| l.trim_start().strip_prefix("stdin: the job token, then "))
        .collect();
    assert_eq!(stdins.len(), 3, "{stdout}");
    assert!(
        stdins.iter().all(|l| l.ends_with(" 'X=it'\\''s x'")),
        "{stdout}"
    );
    for line in lines {
        assert!(
            !line.contains("X=it") && !line.contains("HVD_SIZE=3"),
            "{line}"
        );
        let check = Command::new("sh")
            .args(["-n", "-c", line])
            .output()
            .unwrap();
        assert!(check.status.success(), "{line}\n{}", text(&check).1);
        assert!(line.starts_with(
            "ssh -T -o BatchMode=yes -o ConnectTimeout=30 -o ServerAliveInterval=15 -o \
             ServerAliveCountMax=4 -p 2222 -i /keys/id 10.77.0."
        ));
    }
    // Every variable is exported by the host's wrapper: a name a shell cannot take is refused before anything runs.
    let bad =
        project("step train {\n  run = \"true\"\n  workers = 2\n  env = { \"A-B\" = \"1\" }\n}");
    let out = ssh_dry_run(bad.path(), &["--hosts", "127.0.0.1:2"])
        .output()
        .unwrap();
    common::assert_exit_saying(&out, 2, "variable `A-B` is not a valid");
    // Without hosts: a usage error that says how to give them.
    let out = ssh_dry_run(dir.path(), &[]).output().unwrap();
    common::assert_exit_saying(&out, 2, "--hosts h1:4,h2:4");
}

const INTERRUPTED: &str = r#"trap 'echo got-int-$HVD_RANK-$NCCL_SOCKET_IFNAME-$GLOO_SOCKET_IFNAME; exit 5' INT; touch started.$HVD_RANK; sleep 30 & wait"#;

#[test]
fn ctrl_c_reaches_every_remote_rank_as_sigint() {
    let hosts = Hosts::start("c");
    let dir = four_ranks(INTERRUPTED);
    let child = hosts
        .hvd_command(
            dir.path(),
            &[
                "--no-build",
                "--grace",
                "5",
                // Chosen, not detected: the same name on every host (as with horovodrun).
                "--network-interface",
                "hvd0",
            ],
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // `ip netns exec` execs hvd: the child is hvd itself.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !(0..4).all(|r| dir.path().join(format!("started.{r}")).exists()) {
        assert!(Instant::now() < deadline, "the ranks did not start");
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill with integer arguments, to the hvd process this test started.
    unsafe { libc_kill(child.id() as i32, 2) };
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(130), "{stdout}\n{stderr}");
    // Each rank's shell got SIGINT (its trap ran), not SIGTERM or SIGKILL.
    for (rank, host) in by_slot() {
        assert!(
            stdout.contains(&format!("[train {host}:{rank}] got-int-{rank}-hvd0-hvd0")),
            "rank {rank}:\n{stdout}\n{stderr}"
        );
    }
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}

/// Writes a store path `name` (a `bin/` and its `.hvd-path.json`) into `store`.
fn store_path(store: &Path, name: &str, references: &[&str]) -> PathBuf {
    let path = store.join(name);
    std::fs::create_dir_all(path.join("bin")).unwrap();
    let json = serde_json::json!({"schema": 1, "content_hash": format!("c-{name}"), "references": references});
    std::fs::write(path.join(".hvd-path.json"), json.to_string()).unwrap();
    path
}

#[test]
fn a_compromised_host_cannot_run_commands_here_or_obtain_other_store_paths() {
    // The second host's sshd answers every login with this script: the env check (the command that ends with
    // `echo hvd-check:done`) gets `answer`, anything else (a copy) is recorded and its input kept.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let script = d.join("compromised.sh");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nd={d}\ncase \"$SSH_ORIGINAL_COMMAND\" in\n  *hvd-check:done*) cat \"$d/answer\";;\n  \
             *) echo \"$SSH_ORIGINAL_COMMAND\" >> \"$d/other-commands\"; cat > \"$d/received\";;\nesac\n",
            d = d.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    let hosts = Hosts::start_with("d", Some(script.to_str().unwrap()));
    // A store with an env, the package it needs, and a path outside its closure.
    let store = d.join("store");
    let env_name = "0123456789abcdef0123456789abcdef-t-1.0";
    let package = "11111111111111111111111111111111-x-2.0";
    let other = "22222222222222222222222222222222-secret-1.0";
    let env = store_path(&store, env_name, &[package]);
    store_path(&store, package, &[]);
    store_path(&store, other, &[]);
    let pwned = d.join("pwned");
    let project = four_ranks("true");
    for hostile in [
        format!(
            "--checkpoint=1 --checkpoint-action=exec=touch {}",
            pwned.display()
        ),
        "--checkpoint-action=exec=sh".to_owned(),
        "../../etc".to_owned(),
        other.to_owned(),
    ] {
        std::fs::write(
            d.join("answer"),
            format!("hvd-check:no-env\nhvd-check:missing {package}\nhvd-check:missing {hostile}\nhvd-check:done\n"),
        )
        .unwrap();
        let out = Command::new(tool("ip"))
            .args(["netns", "exec", &hosts.namespaces[0], HVD, "run"])
            .arg(project.path().join("train.hvd"))
            .args(["--engine", "ssh", "--ssh-copy-env", "--ssh-port", SSH_PORT])
            .args(["--hosts", &format!("{}:2,{}:2", HOSTS[0], HOSTS[1])])
            .arg("--ssh-config")
            .arg(hosts.dir.path().join("ssh_config"))
            .arg("--ssh-identity")
            .arg(hosts.dir.path().join("id"))
            .arg("--env-dir")
            .arg(&env)
            .env("NO_COLOR", "1")
            .output()
            .unwrap();
        let (stdout, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{hostile}: {stdout}\n{stderr}");
        // The report is wrapped to the terminal's width: compare its words.
        let words = common::flat_stderr(&out);
        assert!(
            words.contains(&format!(
                "host `{}` answered the env check with store paths that are not in the env's closure",
                HOSTS[1]
            )),
            "{hostile}: {stderr}"
        );
        // The honest host is not blamed; nothing ran here, nothing was sent, no rank started anywhere.
        assert!(!words.contains(&format!("host `{}`", HOSTS[0])), "{stderr}");
        assert!(
            !pwned.exists(),
            "{hostile}: the host ran a command on the launcher's machine"
        );
        assert!(
            !d.join("received").exists(),
            "{hostile}: something was sent to the host"
        );
        assert!(
            !d.join("other-commands").exists(),
            "{hostile}: a rank or copy was started"
        );
    }
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}

/// A project whose env (fixture wheels `greet` and `helper`, and hvd's worker runtime) is built into `root/store`
/// from a local index and pushed, signed, into the directory cache `cache`; its step runs `job.py` (a file of the
/// project) on 4 ranks: a barrier over every rank, then a line with what the rank sees (after `greet`; with
/// [`Delivered::running_first`], after another command).
struct Delivered {
    project: PathBuf,
    env: PathBuf,
    cache: PathBuf,
    public_key: PathBuf,
}

impl Delivered {
    fn new(root: &Path, cache: &Path) -> Delivered {
        Self::running_first(root, cache, "true")
    }

    /// [`Delivered::new`] whose ranks run `first` (a shell command without double quotes) before anything else.
    fn running_first(root: &Path, cache: &Path, first: &str) -> Delivered {
        assert!(!first.contains('"'), "{first}");
        let pushed = common::pushed_fixture_env(
            root,
            cache,
            &format!(
                "step train {{\n  run = \"{first} && greet && python job.py\"\n  workers = 4\n}}\n"
            ),
        );
        std::fs::write(
            pushed.project.join("job.py"),
            "import os, hvd, helper\nhvd.init()\nhvd.barrier()\n\
             print(f\"job rank={hvd.rank()} size={hvd.size()} word={helper.WORD} cwd={os.getcwd()}\", flush=True)\n",
        )
        .unwrap();
        Delivered {
            project: pushed.project,
            env: pushed.env,
            cache: pushed.cache,
            public_key: pushed.public_key,
        }
    }

    /// `hvd run` of the project on the hosts with the env at `--env-dir` and `args`.
    fn run(&self, hosts: &Hosts, args: &[&str]) -> Output {
        let env = self.env.display().to_string();
        let mut all = vec!["--grace", "2", "--env-dir", &env];
        all.extend(args);
        let started = std::time::Instant::now();
        let out = hosts
            .hvd_command(&self.project, &all)
            .env_remove("HVD_CACHES")
            .env_remove("HVD_TRUSTED_KEYS")
            .output()
            .unwrap();
        // For the log only (a measurement, never asserted): the whole run, hosts' delivery included.
        eprintln!("hvd run {args:?}: {:.1} s", started.elapsed().as_secs_f64());
        out
    }

    /// [`Delivered::run`] with the cache at `url` and the env's signing key trusted.
    fn run_from_cache(&self, hosts: &Hosts, url: &str) -> Output {
        let key = self.public_key.display().to_string();
        self.run(hosts, &["--cache", url, "--trusted-key", &key])
    }

    /// [`Delivered::run_from_cache`] with the cache directory as a `file://` URL.
    fn run_from_file_cache(&self, hosts: &Hosts) -> Output {
        self.run_from_cache(hosts, &format!("file://{}", self.cache.display()))
    }

    /// [`Delivered::run_from_cache`] with the cache served over HTTP from the launcher's namespace
    /// ([`serve_in_launcher_namespace`]), which the hosts pull from; the server is stopped when the run ends.
    fn run_from_http_cache(&self, hosts: &Hosts) -> Output {
        let (mut server, url) = serve_in_launcher_namespace(hosts, &self.cache);
        let out = self.run_from_cache(hosts, &url);
        let _ = server.kill();
        let _ = server.wait();
        out
    }

    /// Asserts that the run failed (exit code 1) before any rank ran, its stderr naming each host with
    /// `per_host(host)` and saying `also`.
    fn assert_stopped_before_any_rank(out: &Output, per_host: impl Fn(&str) -> String, also: &str) {
        let (stdout, stderr) = text(out);
        assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
        let words = common::unwrapped(&stderr);
        for host in HOSTS {
            assert!(
                words.contains(&common::unwrapped(&per_host(host))),
                "{stderr}"
            );
        }
        assert!(words.contains(&common::unwrapped(also)), "{stderr}");
        assert!(!stdout.contains("[train"), "a rank ran:\n{stdout}");
    }

    /// Asserts that every rank ran on its host in a work directory (not the project directory, which the hosts
    /// lack), with the env's packages and console script.
    fn assert_ran_everywhere(&self, out: &Output) {
        let (stdout, stderr) = text(out);
        assert!(out.status.success(), "{stdout}\n{stderr}");
        for (rank, host) in by_slot() {
            let line = stdout
                .lines()
                .find(|l| {
                    l.starts_with(&format!(
                        "[train {host}:{rank}] job rank={rank} size=4 word=hello cwd="
                    ))
                })
                .unwrap_or_else(|| {
                    panic!("rank {rank} on {host} did not report:\n{stdout}\n{stderr}")
                });
            assert!(line.contains("/home-cache/hvd/work/"), "{line}");
            assert!(
                stdout.contains(&format!("[train {host}:{rank}] hello from greet")),
                "{stdout}"
            );
        }
    }
}

/// Serves `dir` over HTTP from the launcher's namespace (a static server, `python3 -m http.server`) on
/// `10.77.0.1:8077`; the hosts reach it, the test's own namespace does not.
fn serve_in_launcher_namespace(hosts: &Hosts, dir: &Path) -> (Child, String) {
    let mut child = Command::new(tool("ip"))
        .args([
            "netns",
            "exec",
            &hosts.namespaces[0],
            "python3",
            "-u",
            "-m",
            "http.server",
        ])
        .args(["8077", "--bind", LAUNCHER_ADDR, "--directory"])
        .arg(dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut first = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.as_mut().unwrap()),
        &mut first,
    )
    .unwrap();
    assert!(first.contains("Serving HTTP"), "{first}");
    (child, format!("http://{LAUNCHER_ADDR}:8077"))
}

#[test]
fn hosts_with_empty_private_stores_pull_the_env_from_an_http_cache_and_run_in_a_work_dir() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = Delivered::new(root.path(), &outside.path().join("cache"));
    let hosts = Hosts::start_private("e", root.path());
    let out = p.run_from_http_cache(&hosts);
    p.assert_ran_everywhere(&out);
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}

#[test]
fn a_tampered_cache_stops_the_run_before_any_rank_and_a_direct_copy_runs_without_one() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = Delivered::new(root.path(), &outside.path().join("cache"));
    let hosts = Hosts::start_private("f", root.path());
    // One flipped byte in the archive of `helper`, which the env needs.
    let helper = common::tamper_cached_archive(&root.path().join("store"), &p.cache, "-helper-1.0");
    Delivered::assert_stopped_before_any_rank(
        &p.run_from_file_cache(&hosts),
        |host| format!("host `{host}` could not get the env"),
        &format!("refusing {helper}"),
    );
    // Without a cache, the launcher copies the env's paths over ssh; the hosts verify and run.
    let out = p.run(&hosts, &["--ssh-copy-env"]);
    p.assert_ran_everywhere(&out);
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}

/// An `hvd gc` running in a loop on every host (in its own mount namespace, on its private store) through the whole
/// run cannot remove the env the run pulled there before its ranks use it: the host check pulls and checks the env
/// under the root of `hvd worker-env --once --pull`, and each rank starts through the same pull (which finds the
/// env, or pulls it again when gc removed it after the check) and holds that root until it ends; every rank waits
/// until gc has run twice more on both hosts after it started, then runs `greet` and imports from the env. Once the
/// run has ended, nothing roots the env there and gc removes it (without the ranks' roots it would have gone).
#[test]
fn envs_pulled_on_the_hosts_survive_gc_running_there_in_a_loop_until_their_ranks_end() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let counters = outside.path().join("gc-runs");
    std::fs::create_dir(&counters).unwrap();
    let wait = common::gc_wait_script(&[&counters.join("1"), &counters.join("2")], 2);
    let p = Delivered::running_first(root.path(), &outside.path().join("cache"), &wait);
    let hosts = Hosts::start_private("g", root.path());
    let store = root.path().join("store");
    // `hvd gc` on host `i` (1 or 2): in its sshd's mount namespace, where `root` is that host's own tmpfs.
    let gc_on = |i: usize| {
        let (pid, store) = (hosts.sshds[i - 1].1, store.clone());
        move || {
            let mut command = Command::new(tool("nsenter"));
            command
                .arg(format!("--target={pid}"))
                .args(["--mount", "--", HVD, "gc"])
                .env("HVD_STORE", &store)
                .current_dir("/");
            command
        }
    };
    let mut loops: Vec<common::GcLoop> = (1..=2)
        .map(|i| common::GcLoop::start(gc_on(i), Some(counters.join(i.to_string()))))
        .collect();
    for looping in &mut loops {
        looping.wait_runs(1);
    }
    let out = p.run_from_http_cache(&hosts);
    for looping in loops {
        looping.stop();
    }
    p.assert_ran_everywhere(&out);
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
    // The ranks have ended: their roots are stale, and gc takes the env on each host.
    for i in 1..=2 {
        let out = gc_on(i)().output().unwrap();
        assert!(out.status.success(), "{}", text(&out).1);
        let exists = Command::new(tool("nsenter"))
            .arg(format!("--target={}", hosts.sshds[i - 1].1))
            .args(["--mount", "--", "test", "-e"])
            .arg(&p.env)
            .status()
            .unwrap();
        assert!(
            !exists.success(),
            "gc kept an env nothing roots on host {i}"
        );
    }
}

/// With caches, each rank starts through the host's `hvd worker-env --once --pull` even where the env is there: on
/// hosts that have the env (copied by a first run) and whose `hvd` is an older build without those flags (the
/// launcher's path hidden there, a stand-in `hvd` first on root's PATH, in each host's own mount namespace), the host
/// check fails naming the host, that hvd and what to do, and no rank starts (not every rank failing on an unknown
/// argument).
#[test]
fn hosts_whose_hvd_lacks_worker_env_pull_fail_the_check_naming_it() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = Delivered::new(root.path(), &outside.path().join("cache"));
    let hosts = Hosts::start_private("o", root.path());
    let launcher_dir = Path::new(HVD).parent().unwrap().display().to_string();
    let stub = "#!/bin/sh\nif [ \"$1 $2\" = 'worker-env --help' ]; then echo 'Usage: hvd worker-env [OPTIONS] \
                [CMD]...'; exit 0; fi\necho \"error: unexpected argument '--once' found\" >&2; exit 2\n";
    for (_, pid) in &hosts.sshds {
        let plant = format!(
            "mount -t tmpfs hvd-old /usr/local/sbin && printf '%s' \"$0\" > /usr/local/sbin/hvd && \
             chmod 755 /usr/local/sbin/hvd && mount -t tmpfs hvd-hidden {}",
            launcher_dir
        );
        let out = Command::new(tool("nsenter"))
            .arg(format!("--target={pid}"))
            .args(["--mount", "--", "/bin/sh", "-c", &plant, stub])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out).1);
    }
    // The env is there already (copied over ssh, which needs no hvd on the hosts).
    p.assert_ran_everywhere(&p.run(&hosts, &["--ssh-copy-env"]));
    Delivered::assert_stopped_before_any_rank(
        &p.run_from_file_cache(&hosts),
        |host| {
            format!(
                "the hvd on host `{host}` (/usr/local/sbin/hvd) is an older build without `hvd worker-env --once \
                 --pull`"
            )
        },
        "install this hvd",
    );
    assert_eq!(hosts.wait_clean(), Vec::<String>::new());
}
