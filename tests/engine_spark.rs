//! End-to-end tests of the `spark` engine with the built binary: a barrier job of 2 tasks in pyspark's
//! `local-cluster[2,1,1024]` (a master, 2 workers and 2 executor JVMs on this machine, Java 17) runs the Python `hvd`
//! package's allreduce on every rank; one rank failing ends the job with its code and leaves no process behind;
//! executors with empty stores pull the env from a binary cache before any rank starts; and `--dry-run` shows the
//! driver command. pyspark and Java come from scripts/install-deps: without them these tests fail, saying so. A Spark
//! start costs 10-25 s (more on a busy machine), so there are three Spark jobs in all. The cache test mounts a tmpfs
//! in a mount namespace of its own (root, as the namespace-host tests).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::Duration;

mod common;

use common::{HVD, project, text};
const MASTER: &str = "local-cluster[2,1,1024]";

/// The Python with pyspark and numpy, and Java: both are required (scripts/install-deps installs them).
fn spark_python() -> PathBuf {
    let out = Command::new("python3")
        .args([
            "-c",
            "import sys, numpy, pyspark; print(sys.executable); print(pyspark.__version__)",
        ])
        .output();
    let python = match out {
        Ok(o) if o.status.success() => text(&o).0.lines().next().unwrap_or_default().to_owned(),
        Ok(o) => panic!(
            "python3 cannot import pyspark and numpy; run scripts/install-deps (it pip-installs both):\n{}",
            text(&o).1
        ),
        Err(e) => panic!("python3 is not runnable ({e}); run scripts/install-deps"),
    };
    let java = Command::new("java").arg("-version").output();
    assert!(
        java.is_ok_and(|o| o.status.success()),
        "`java -version` fails: Spark needs Java 17; run scripts/install-deps (it installs openjdk-17-jre-headless)"
    );
    PathBuf::from(python)
}

/// `hvd run DIR/train.hvd --no-build --grace 2 --engine spark --spark-python PYTHON ARGS...`; every process of the run
/// carries `HVD_TEST_MARK=<mark>`.
fn spark_command(dir: &Path, python: &Path, mark: &str, args: &[&str]) -> Command {
    let mut command = Command::new(HVD);
    command
        .arg("run")
        .arg(dir.join("train.hvd"))
        .args(["--no-build", "--grace", "2", "--engine", "spark"])
        .arg("--spark-python")
        .arg(python)
        .args(args)
        .env("NO_COLOR", "1")
        .env("HVD_TEST_MARK", mark);
    command
}

/// [`spark_command`] on the local cluster, run to its end.
fn hvd_run_spark(dir: &Path, python: &Path, mark: &str, extra: &[&str]) -> Output {
    let args: Vec<&str> = ["--spark-master", MASTER]
        .into_iter()
        .chain(extra.iter().copied())
        .collect();
    spark_command(dir, python, mark, &args).output().unwrap()
}

/// `cluster { settings }` with a Spark setting whose value is `secret` (one Spark ignores), appended to `dir`'s file.
fn with_secret_setting(dir: &Path, secret: &str, more: &str) {
    common::append_to_project(
        dir,
        &format!(
            "cluster {{\n  settings = {{ \"spark.hvd.test.secret\" = \"{secret}\"{more} }}\n}}"
        ),
    );
}

/// Processes (pid, command line) whose environment has `HVD_TEST_MARK=<mark>`.
fn marked(mark: &str) -> Vec<(u32, String)> {
    common::processes_with_env(&format!("HVD_TEST_MARK={mark}"))
}

/// Nothing of the run is left once `hvd run` has returned (a process killed a moment ago may need a little while
/// to be gone from /proc).
fn assert_nothing_left(mark: &str) {
    let left =
        common::wait_until_empty(Duration::from_secs(10), Duration::from_millis(200), || {
            marked(mark)
        });
    assert!(
        left.is_empty(),
        "processes of the run outlived `hvd run`:\n{left:#?}"
    );
}

/// What `ar.py` ([`common::write_allreduce_py`]) prints after its allreduce.
const ALLREDUCE_REPORT_PY: &str = r#"where = f"local={os.environ['HVD_LOCAL_RANK']}/{os.environ['HVD_LOCAL_SIZE']} host={os.environ['HVD_HOSTNAME']}"
sys.stdout.write(f"allreduce rank={r} size={n} sum={float(out[0])} ok={ok} {where}\n")
sys.stdout.flush()
sys.exit(0 if ok else 1)
"#;

#[test]
fn spark_barrier_job_runs_the_allreduce_worker_on_every_rank() {
    let python = spark_python();
    let (_, package, lib) = common::allreduce_runtime();
    let dir = project(&format!(
        "step train {{\n  run = \"echo probe=$HVD_CONF_PROBE; {} ar.py\"\n  workers = 2\n  {}\n}}",
        python.display(),
        common::allreduce_step_env(&package, &lib)
    ));
    common::write_allreduce_py(dir.path(), ALLREDUCE_REPORT_PY);
    let mark = format!("allreduce-{}", std::process::id());
    // The file's Spark settings reach Spark (the executors get `HVD_CONF_PROBE`, which the ranks inherit), and a
    // secret among them is on no command line while the job runs.
    let secret = format!("spark-secret-{mark}");
    with_secret_setting(
        dir.path(),
        &secret,
        ", \"spark.executorEnv.HVD_CONF_PROBE\" = \"reached\"",
    );
    let (out, leaks) = common::run_reading_command_lines(
        spark_command(dir.path(), &python, &mark, &["--spark-master", MASTER]),
        &secret,
    );
    assert!(
        leaks.is_empty(),
        "the secret is on command lines: {leaks:#?}"
    );
    assert_eq!(
        text(&out).0.matches("] probe=reached\n").count(),
        2,
        "{}",
        text(&out).0
    );
    // Each line is attributed to its rank; the local layout comes from the barrier tasks' addresses (both
    // executors are on 127.0.0.1).
    common::assert_every_rank_says(&out, 2, |rank| {
        format!(
            ":{rank}] allreduce rank={rank} size=2 sum=3.0 ok=True local={rank}/2 host=127.0.0.1"
        )
    });
    // Spark's executor logs go with the run's logs, not into the pyspark package.
    let runs = dir.path().join(".hvd/runs");
    let run = std::fs::read_dir(&runs).unwrap().flatten().next().unwrap();
    assert!(
        run.path().join("train/spark/work").is_dir(),
        "no executor work folder under {}",
        run.path().display()
    );
    assert_nothing_left(&mark);
}

#[test]
fn a_failing_rank_ends_the_spark_job_with_its_code() {
    let python = spark_python();
    let dir = project(
        r#"step train {
  run = "if [ $HVD_RANK = 1 ]; then echo boom-$HVD_RANK >&2; exit 3; fi; sleep 60"
  workers = 2
}"#,
    );
    let mark = format!("fails-{}", std::process::id());
    let out = hvd_run_spark(dir.path(), &python, &mark, &[]);
    let (stdout, stderr) = text(&out);
    // The driver names the first failing rank and exits with its code; hvd passes both on.
    assert_eq!(out.status.code(), Some(3), "{stdout}\n{stderr}");
    assert!(stderr.contains("rank 1 on "), "{stderr}");
    assert!(stderr.contains(":1] boom-1"), "{stderr}");
    // Rank 0's `sleep 60`, the executors and the Python workers are all gone.
    assert_nothing_left(&mark);
}

#[test]
fn dry_run_shows_the_spark_driver_and_negative_workers_run_locally() {
    let dir = project("step train {\n  run = \"echo rank=$HVD_RANK/$HVD_SIZE\"\n  workers = 2\n}");
    let out = common::hvd_run_command(dir.path())
        .args(["--no-build", "--dry-run", "--engine", "spark"])
        .args([
            "--spark-master",
            MASTER,
            "--spark-python",
            "/usr/bin/python3",
        ])
        .args(["--workers", "3"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(&format!(
            "spark:   /usr/bin/python3 {}/.hvd/spark/hvd_spark_driver.py --master 'local-cluster[2,1,1024]' \
             --workers 3 --shim {HVD}",
            dir.path().display()
        )),
        "{stdout}"
    );
    assert!(
        stdout.contains("-- /bin/sh -c 'echo rank=$HVD_RANK/$HVD_SIZE'"),
        "{stdout}"
    );
    assert!(stdout.contains("workers: 3 (spark engine"), "{stdout}");
    // Under a local master every rank is on 127.0.0.1, the executors' address.
    assert!(
        stdout.contains("rank 2 on 127.0.0.1 (local rank 2/3, cross rank 0/1)"),
        "{stdout}"
    );
    // A dry run writes nothing.
    assert!(!dir.path().join(".hvd").exists());
    // The same from the file: `cluster { engine = "spark"  settings = { ... } }`, `spark.*` settings in `HVD_SPARK_CONF`, shown before the command.
    let from_file = project(
        "cluster {\n  engine = \"spark\"\n  settings = { master = \"local[3]\", python = \"/usr/bin/python3\", \
         slots_timeout = \"30\", \"spark.executor.memory\" = \"2g\" }\n}\nstep train {\n  run = \"true\"\n  workers = 3\n}",
    );
    let out = Command::new(HVD)
        .arg("run")
        .arg(from_file.path().join("train.hvd"))
        .args(["--no-build", "--dry-run"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stdout.contains(" --master 'local[3]' --workers 3 ")
            && stdout.contains(" --slots-timeout 30 -- /bin/sh -c true")
            && stdout.contains(
                "spark:   HVD_SPARK_CONF='{\"spark.executor.memory\":\"2g\"}' /usr/bin/python3 "
            ),
        "{stdout}"
    );
    // `--workers -2`: HorovodRunner's local mode, 2 processes on this machine with the local engine (no Spark).
    let out = common::hvd_run_command(dir.path())
        .args(["--no-build", "--engine", "spark", "--workers", "-2"])
        .env("NO_COLOR", "1")
        .output()
        .unwrap();
    common::assert_every_rank_says(&out, 2, |rank| format!(":{rank}] rank={rank}/2"));
    let stderr = text(&out).1;
    assert!(
        stderr.contains("2 local processes on the driver"),
        "{stderr}"
    );
    // ... which is for the spark engine only.
    let out = common::hvd_run_command(dir.path())
        .args(["--no-build", "--dry-run", "--workers", "-2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", text(&out).1);
}

/// A script that runs `python3 ARGS` in a mount namespace of its own with an empty tmpfs over `store`: as
/// `PYSPARK_PYTHON`, each executor's Python workers (and so its tasks and ranks) see a node-local store that starts
/// empty, at the same directory as the launcher's.
fn python_with_an_empty_store(dir: &Path, python: &Path, store: &Path) -> PathBuf {
    bare_node_python(dir, python, store, "")
}

/// [`python_with_an_empty_store`], plus `extra` (a shell command) run in the namespace after the mount.
fn bare_node_python(dir: &Path, python: &Path, store: &Path, extra: &str) -> PathBuf {
    let script = dir.join("python-on-a-bare-node");
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nexec unshare --mount --propagation private /bin/sh -c \
             'mount -t tmpfs -o mode=0755 executor-store \"$0\" && {extra} exec \"$@\"' '{}' '{}' \"$@\"\n",
            store.display(),
            python.display()
        ),
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
    script
}

/// The fixture env ([`common::pushed_fixture_env`], the store `root/store`) of a project whose step `train` runs
/// `python job.py` (the test writes it) on 2 ranks, pushed to the cache `outside/cache`.
fn pushed_two_ranks(root: &Path, outside: &Path) -> common::PushedEnv {
    common::pushed_fixture_env(
        root,
        &outside.join("cache"),
        "step train {\n  run = \"python job.py\"\n  workers = 2\n}\n",
    )
}

/// The cache of `p` as a `file://` URL.
fn cache_url(p: &common::PushedEnv) -> String {
    format!("file://{}", p.cache.display())
}

/// `hvd ARGS` on the spark engine (local cluster, `python`) with the store `root/store` and the cache of `p`
/// ([`cache_url`]) trusted by its key, as a user gives them (none from the environment).
fn with_cache(root: &Path, python: &Path, p: &common::PushedEnv, args: &[&str]) -> Command {
    let mut command = common::hvd_with_store(root, &root.join("store"), args);
    command
        .args(["--engine", "spark", "--spark-master", MASTER])
        .arg("--spark-python")
        .arg(python)
        .args(["--cache", &cache_url(p), "--trusted-key"])
        .arg(&p.public_key)
        .env_remove("HVD_CACHES")
        .env_remove("HVD_TRUSTED_KEYS")
        .env("NO_COLOR", "1");
    command
}

#[test]
fn executors_with_empty_stores_pull_the_env_before_any_rank_and_a_tampered_archive_is_refused() {
    let python = spark_python();
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = pushed_two_ranks(root.path(), outside.path());
    let store = root.path().join("store");
    // Only the launcher's store has this file: a rank that sees it is not on a bare node.
    std::fs::write(store.join("launcher-only"), "").unwrap();
    std::fs::write(
        p.project.join("job.py"),
        format!(
            "import os, hvd, helper\nhvd.init()\nhvd.barrier()\n\
             print(f\"job rank={{hvd.rank()}} size={{hvd.size()}} word={{helper.WORD}} \
             launcher-store={{os.path.exists('{}')}} env={{os.environ['VIRTUAL_ENV']}}\")\n",
            store.join("launcher-only").display()
        ),
    )
    .unwrap();
    let url = cache_url(&p);
    let with_cache = |args: &[&str]| with_cache(root.path(), &python, &p, args);
    let mark = format!("pull-{}", std::process::id());
    let out = with_cache(&["run", "app/train.hvd", "--locked", "--grace", "2"])
        .env(
            "PYSPARK_PYTHON",
            python_with_an_empty_store(root.path(), &python, &store),
        )
        .env("HVD_TEST_MARK", &mark)
        .output()
        .unwrap();
    // Each executor pulled the env into its own empty store; the ranks ran in it.
    common::assert_every_rank_says(&out, 2, |rank| {
        format!(
            ":{rank}] job rank={rank} size=2 word=hello launcher-store=False env={}",
            p.env.display()
        )
    });
    assert_nothing_left(&mark);

    // The driver's command line names the env, the cache and the key's public text, nothing secret.
    let env_arg = p.env.display().to_string();
    let out = with_cache(&["run", "app/train.hvd", "--dry-run", "--env-dir", &env_arg])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let driver = stdout
        .lines()
        .find_map(|l| l.trim().strip_prefix("spark:"))
        .unwrap_or_else(|| panic!("no driver line: {stdout}"))
        .trim()
        .to_owned();
    let name = p.env.file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        driver.contains(&format!(
            "--pull 'cache pull --store={} {name} --cache={url} --trusted-key=fixture:",
            store.display()
        )),
        "{driver}"
    );

    // A tampered archive of `helper` in the cache: what a task runs first on its executor (the driver's own
    // `pull_env` with the `--pull` it was given) fails naming the path, into an empty store at the same directory.
    let helper = common::tamper_cached_archive(&store, &p.cache, "-helper-1.0");
    std::fs::rename(&store, root.path().join("built-store")).unwrap();
    let check = r#"
import importlib.util, shlex, sys
spec = importlib.util.spec_from_file_location("d", sys.argv[1])
d = importlib.util.module_from_spec(spec)
spec.loader.exec_module(d)
args = d.parse_args(shlex.split(sys.argv[2])[2:])
failure = d.pull_env(args.shim, args.pull, None)
assert failure is not None, "the pull of a tampered archive succeeded"
code, tail = failure
print(code)
for line in tail:
    print(line.decode())
"#;
    let driver_file = root.path().join("driver.py");
    std::fs::write(&driver_file, hvd_launcher::engines::spark::DRIVER_SOURCE).unwrap();
    let out = Command::new(&python)
        .args(["-c", check])
        .arg(&driver_file)
        .arg(&driver)
        .env("HVD_STORE", &store)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(
        common::unwrapped(&stdout).contains(&format!("refusing{helper}")),
        "{stdout}"
    );
    // Nothing half-installed: no env, no helper.
    for path in [&name, &helper] {
        assert!(!store.join(path).exists(), "{path} is in the store");
    }
}

/// One executor cannot get the env inside the running job: the first executor to start its Python sees a copy of
/// the cache with a flipped byte in `helper`'s archive (bind-mounted over the cache in its mount namespace), the
/// other the good cache. The run fails with the driver's message naming the executor (its address and host), the
/// rank of its task, the env and the pull's reason (`refusing <helper>`), and no rank's command starts anywhere.
#[test]
fn one_executor_whose_pull_fails_inside_the_job_ends_it_naming_the_executor_before_any_rank() {
    let python = spark_python();
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = pushed_two_ranks(root.path(), outside.path());
    let store = root.path().join("store");
    std::fs::write(
        p.project.join("job.py"),
        "import os\nopen(f\"rank-started-{os.getpid()}\", \"w\").close()\nprint(\"job rank started\")\n",
    )
    .unwrap();
    // The tampered copy of the cache, and the marker the first executor's Python takes.
    let tampered = outside.path().join("tampered-cache");
    let copied = Command::new("cp")
        .arg("-a")
        .arg(&p.cache)
        .arg(&tampered)
        .status()
        .unwrap();
    assert!(copied.success());
    let helper = common::tamper_cached_archive(&store, &tampered, "-helper-1.0");
    let first = root.path().join("first-executor");
    let python_wrapper = bare_node_python(
        root.path(),
        &python,
        &store,
        &format!(
            "if mkdir {} 2>/dev/null; then mount --bind {} {}; fi &&",
            first.display(),
            tampered.display(),
            p.cache.display()
        ),
    );
    let mark = format!("pull-fails-{}", std::process::id());
    let out = with_cache(
        root.path(),
        &python,
        &p,
        &["run", "app/train.hvd", "--locked", "--grace", "2"],
    )
    .env("PYSPARK_PYTHON", &python_wrapper)
    .env("HVD_TEST_MARK", &mark)
    .output()
    .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(
        first.is_dir(),
        "no executor took the tampered cache: {stderr}"
    );
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    // The pull's own lines, as the ranks' output on stderr: `[train HOST:R] ...`, tag left out.
    let untagged: String = stderr
        .lines()
        .map(|l| match l.strip_prefix("[train ") {
            Some(tagged) => tagged.split_once(']').map_or(l, |(_, rest)| rest),
            None => l,
        })
        .collect();
    let words = common::unwrapped(&untagged);
    let name = p.env.file_name().unwrap().to_string_lossy().into_owned();
    // `executor 127.0.0.1:PORT (HOST) (the task of rank R) could not get the env NAME`.
    let said = common::unwrapped(&stderr);
    let at = said
        .find(&common::unwrapped("hvd spark: executor 127.0.0.1:"))
        .unwrap_or_else(|| panic!("no executor named: {stderr}"));
    let rest = &said[at..];
    assert!(
        rest.contains(&common::unwrapped(&format!(
            "({}) (the task of rank",
            hvd_launcher::env::local_hostname()
        ))) && rest.contains(&common::unwrapped(&format!("could not get the env {name}"))),
        "{stderr}"
    );
    assert!(
        words.contains(&common::unwrapped(&format!("refusing {helper}"))),
        "{stderr}"
    );
    // No rank's command ran, on either executor.
    assert!(!stdout.contains("job rank started"), "{stdout}");
    let started: Vec<_> = std::fs::read_dir(&p.project)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("rank-started"))
        .collect();
    assert!(started.is_empty(), "ranks ran: {started:?}");
    assert_nothing_left(&mark);
}

/// An elastic step on Spark (issue #19): its ranks are relayed one by one, each a Spark job of one task on the relay
/// server's SparkContext (`local[3]` without a master: one task slot per worker). Slot 1 SIGKILLs itself at step 3:
/// its task ends, its relay exits with the rank's status, the launcher counts it lost, and a replacement (slot 3, a
/// new job in the freed slot) joins the two survivors at a commit; slot 2 does the same at step 5, and slot 4 replaces
/// it (two losses on the one pretend host every Spark rank has do not blacklist it). The job of 3 finishes with every
/// committed step counted once, the relay server's log names the five jobs and how each ended, and nothing of the run
/// (Spark included) is left.
#[test]
fn an_elastic_step_on_spark_replaces_a_lost_rank_with_a_new_job() {
    let python = spark_python();
    let mark = format!("spark-elastic-{}", std::process::id());
    // A secret among the file's Spark settings, and in the step's `env` (the ranks' variables travel on the relays'
    // stdin), is on no command line (the relay server's, the relays', the wrappers') meanwhile.
    let secret = format!("spark-secret-{mark}");
    let dir = common::elastic::project(
        "{ min = 2, max = 3 }",
        6,
        &format!(", ELASTIC_UNTIL = \"3\", ELASTIC_KILL = \"1:3,2:5\", SECRET_X = \"{secret}\""),
    );
    with_secret_setting(dir.path(), &secret, "");
    let (out, leaks) =
        common::run_reading_command_lines(spark_command(dir.path(), &python, &mark, &[]), &secret);
    assert!(
        leaks.is_empty(),
        "the secret is on command lines: {leaks:#?}"
    );
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let says = |part: &str| common::unwrapped(&stderr).contains(&common::unwrapped(part));
    assert!(
        says("rank 1 of step `train` was lost"),
        "{stdout}\n{stderr}"
    );
    assert!(says("in place of a lost worker"), "{stdout}\n{stderr}");
    assert!(
        stdout.contains("] slot 3 starts as rank "),
        "{stdout}\n{stderr}"
    );
    assert!(
        says("rank 2 of step `train` was lost"),
        "{stdout}\n{stderr}"
    );
    assert!(!says("blacklisted"), "{stdout}\n{stderr}");
    let lines = common::elastic::finished(&stdout, &[0, 3, 4], 3);
    let step: u32 = lines[0].split_whitespace().nth(1).unwrap().parse().unwrap();
    assert!(step > 3, "{}", lines[0]);
    for line in &lines {
        assert_eq!(
            *line,
            common::elastic::counted_once(step),
            "{stdout}\n{stderr}"
        );
    }
    assert!(!stdout.contains("slot 5 "), "{stdout}");
    // Each rank was a Spark job of the relay server's: five (the replacements' included), and how each ended.
    let log = relay_log(dir.path());
    for (slot, code) in [(0, 0), (1, 137), (2, 137), (3, 0), (4, 0)] {
        assert!(
            log.contains(&format!(": slot {slot} exited with {code}\n")),
            "{log}"
        );
    }
    assert_eq!(log.matches(" exited with ").count(), 5, "{log}");
    assert_nothing_left(&mark);
}

/// `--dry-run` of an elastic step on the spark engine shows each rank's relay (no barrier driver): the server's socket
/// as `<relay socket>`, the ssh engine's wrapper with the rank's variables, but no token (it goes on stdin) and no
/// host or interface, which the executor's task and the wrapper find.
#[test]
fn dry_run_of_an_elastic_step_shows_each_ranks_relay() {
    let dir = project("step train {\n  run = \"echo hi\"\n  workers = { min = 1, max = 2 }\n}");
    let out = common::hvd_run_command(dir.path())
        .args(["--no-build", "--dry-run", "--engine", "spark"])
        .args(["--spark-python", "/usr/bin/python3"])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let relay = |slot: u32| {
        format!(
            "spark relay: /usr/bin/python3 {}/.hvd/spark/hvd_spark_driver.py --relay '<relay socket>' --slot {slot} \
             -- /bin/sh -c ",
            dir.path().display()
        )
    };
    assert_eq!(stdout.matches(&relay(0)).count(), 1, "{stdout}");
    assert_eq!(stdout.matches(&relay(1)).count(), 1, "{stdout}");
    let relay = "spark relay: ";
    // The rank's variables go on the relay's stdin (shown on a line of their own), never on its command line.
    assert!(
        stdout
            .lines()
            .filter(|l| l.contains(relay))
            .all(|l| !l.contains("HVD_SIZE=") && !l.contains("PATH=")),
        "{stdout}"
    );
    assert!(
        stdout.lines().any(
            |l| l.trim_start().starts_with("stdin: the job token, then ")
                && l.contains(" HVD_RANK=1 ")
        ),
        "{stdout}"
    );
    // The job token travels on the relay's stdin, never on a command line; the host and interface are the executor's.
    for absent in [
        "HVD_JOB_TOKEN=",
        "HVD_HOSTNAME=",
        " NCCL_SOCKET_IFNAME=lo",
        "spark:   ",
    ] {
        assert!(!stdout.contains(absent), "{absent}: {stdout}");
    }
    assert!(stdout.contains(" /bin/sh -c 'echo hi'\n"), "{stdout}");
}

/// An executor lost mid-run (Spark's form of a lost host): three executors of one task slot each
/// (`local-cluster[3,1,1024]`), two ranks (minimum 1) on two of them. While slot 0 waits at step 4, slot 1's machine
/// is lost: its executor JVM, the processes between it and the rank, and the rank are killed at once. The relay says
/// Spark lost the task (status 255), the launcher counts rank 1 lost, slot 0 goes on alone, and the replacement (slot
/// 2, a new job, on the spare executor) joins it at a commit; both finish with every committed step counted once, and
/// nothing is left.
#[test]
fn an_elastic_step_on_spark_goes_on_when_an_executor_is_lost() {
    lose_slot_1s_executor(true);
}

/// The same with only slot 1's executor JVM and pyspark's daemon killed: the task's Python worker, the wrapper and
/// the rank live on, and nothing but the job's failure tells the relay server. It ends the task's connection at once,
/// the wrapper's stdin ends and it stops the rank (before slot 0 goes on), the relay exits 255, and the rest is as
/// above. (Before, the relay waited on the connection for ever, and the rank with it.)
#[test]
fn an_executor_lost_under_a_live_rank_has_the_rank_stopped() {
    lose_slot_1s_executor(false);
}

/// Runs the step of the two tests above, losing slot 1's executor while slot 0 waits at step 4: its whole machine
/// (`whole`), or its JVM and pyspark's daemon only (then slot 0 goes on once the relay server has given slot 1 up and
/// slot 1's processes are gone).
fn lose_slot_1s_executor(whole: bool) {
    let python = spark_python();
    let dir = common::elastic::project(
        "{ min = 1, max = 2 }",
        8,
        ", ELASTIC_PAUSE = \"4\", ELASTIC_UNTIL = \"2\"",
    );
    let d = dir.path();
    let mark = format!("spark-executor-lost-{whole}-{}", std::process::id());
    let mut child = spark_command(
        d,
        &python,
        &mark,
        &["--spark-master", "local-cluster[3,1,1024]"],
    )
    .stdout(std::process::Stdio::piped())
    .stderr(std::process::Stdio::piped())
    .spawn()
    .unwrap();
    let fail = |child: std::process::Child, why: &str| -> ! {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
        let out = child.wait_with_output().unwrap();
        let (stdout, stderr) = text(&out);
        panic!("{why}:\n{stdout}\n{stderr}");
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(300);
    while !d.join("paused").exists() {
        if std::time::Instant::now() > deadline || child.try_wait().unwrap().is_some() {
            fail(child, "slot 0 did not reach the pause");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let rank1 = || -> Vec<u32> {
        marked(&mark)
            .into_iter()
            .map(|(pid, _)| pid)
            .filter(|pid| {
                std::fs::read(format!("/proc/{pid}/environ"))
                    .is_ok_and(|e| e.split(|b| *b == 0).any(|v| v == b"HVD_RANK=1"))
            })
            .collect()
    };
    let ranks = rank1();
    // From the rank up: ..., the wrapper, the task's Python worker, pyspark's daemon, the executor JVM.
    let Some(chain) = ranks.iter().find_map(|pid| up_to_java(*pid)) else {
        fail(child, "no executor JVM above slot 1's rank");
    };
    let killed: Vec<u32> = match whole {
        true => chain.iter().chain(&ranks).copied().collect(),
        false => chain[chain.len().saturating_sub(2)..].to_vec(),
    };
    // All at once, as a machine (or a JVM and its daemon) dies: stopped first, so that none of them acts on another's
    // death between two kills (the task's Python worker, killed after the wrapper, reported the wrapper's 137 now
    // and then on a loaded machine, where Spark should have lost the task).
    for signal in ["-STOP", "-KILL"] {
        let _ = Command::new("kill")
            .arg(signal)
            .args(killed.iter().map(u32::to_string))
            .status();
    }
    if !whole {
        let deadline = std::time::Instant::now() + Duration::from_secs(120);
        while !relay_log(d).contains(": slot 1 lost: ") || !rank1().is_empty() {
            if std::time::Instant::now() > deadline || child.try_wait().unwrap().is_some() {
                fail(child, "slot 1's rank outlived its lost executor");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    std::fs::write(d.join("go"), "").unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(240);
    while child.try_wait().unwrap().is_none() {
        if std::time::Instant::now() > deadline {
            fail(child, "`hvd run` did not end within 240 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let says = |part: &str| common::unwrapped(&stderr).contains(&common::unwrapped(part));
    assert!(
        says("rank 1 of step `train` was lost (exit code 255)"),
        "{stdout}\n{stderr}"
    );
    assert!(
        says("Spark lost the task of this rank"),
        "{stdout}\n{stderr}"
    );
    assert!(
        stdout.contains("] slot 2 starts as rank "),
        "{stdout}\n{stderr}"
    );
    let lines = common::elastic::finished(&stdout, &[0, 2], 2);
    let step: u32 = lines[0].split_whitespace().nth(1).unwrap().parse().unwrap();
    for line in &lines {
        assert_eq!(
            *line,
            common::elastic::counted_once(step),
            "{stdout}\n{stderr}"
        );
    }
    let log = relay_log(d);
    // Why, in Spark's words (the job's stage failure, not py4j's name of the Java call).
    assert!(
        log.contains(": slot 1 lost: Job aborted due to stage failure"),
        "{log}"
    );
    assert_nothing_left(&mark);
}

/// The relay server's log of the run's step `train` (the project's only run): `.hvd/runs/<run>/train/relay.log`.
fn relay_log(project: &Path) -> String {
    let runs: Vec<_> = std::fs::read_dir(project.join(".hvd/runs"))
        .unwrap()
        .flatten()
        .collect();
    assert_eq!(runs.len(), 1, "{runs:?}");
    std::fs::read_to_string(runs[0].path().join("train/relay.log")).unwrap()
}

/// `pid` and its ancestors up to the nearest `java` process (included), or `None` when there is none.
fn up_to_java(mut pid: u32) -> Option<Vec<u32>> {
    let mut chain = Vec::new();
    for _ in 0..16 {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let (comm, rest) = stat.split_once(" (")?.1.rsplit_once(") ")?;
        chain.push(pid);
        if comm == "java" {
            return Some(chain);
        }
        pid = rest.split_whitespace().nth(1)?.parse().ok()?;
        if pid <= 1 {
            return None;
        }
    }
    None
}

/// Starts `command`, sends it SIGINT once `ready` (within 120 s, else panics saying `not_ready`), and waits for it.
fn interrupt_once(mut command: Command, ready: impl Fn() -> bool, not_ready: &str) -> Output {
    let child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    while !ready() {
        assert!(std::time::Instant::now() < deadline, "{not_ready}");
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    child.wait_with_output().unwrap()
}

/// Ctrl-C on `hvd run` of an elastic step on Spark reaches each relayed rank as SIGINT (through its relay's stdin and
/// the wrapper on the executor: its trap runs), the run ends with 130, and nothing is left, the relay server's Spark
/// included. Before that, a Ctrl-C while the relay server starts (Spark's start can take minutes) stops it there: the
/// run ends with 130 before the server listens, and no rank starts.
#[test]
fn ctrl_c_reaches_every_relayed_rank_as_sigint() {
    let python = spark_python();
    let dir = project(
        "step train {\n  run = \"trap 'echo got-int-$HVD_RANK; exit 5' INT; touch started.$HVD_RANK; sleep 30 & wait\"\n  \
         workers = { min = 1, max = 2 }\n}",
    );
    let mark = format!("spark-interrupt-{}", std::process::id());
    let log = || -> Option<std::path::PathBuf> {
        let run = std::fs::read_dir(dir.path().join(".hvd/runs"))
            .ok()?
            .flatten()
            .next()?;
        Some(run.path().join("train/relay.log")).filter(|l| l.exists())
    };
    let out = interrupt_once(
        spark_command(dir.path(), &python, &mark, &[]),
        || log().is_some(),
        "the relay server did not start",
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(130), "{stdout}\n{stderr}");
    let said = std::fs::read_to_string(log().unwrap()).unwrap();
    assert!(
        !said.contains("listening"),
        "the launcher waited for the server: {said}"
    );
    assert!(!dir.path().join("started.0").exists() && !dir.path().join("started.1").exists());
    assert_nothing_left(&mark);
    std::fs::remove_dir_all(dir.path().join(".hvd/runs")).unwrap();
    let out = interrupt_once(
        spark_command(dir.path(), &python, &mark, &[]),
        || (0..2).all(|r| dir.path().join(format!("started.{r}")).exists()),
        "the ranks did not start",
    );
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(130), "{stdout}\n{stderr}");
    for rank in 0..2 {
        assert!(
            stdout.contains(&format!("] got-int-{rank}\n")),
            "rank {rank}:\n{stdout}\n{stderr}"
        );
    }
    assert_nothing_left(&mark);
}

/// A rank stopped while its job still waits for a task slot never starts: under `local[1]` one rank's job queues
/// behind the other's; on Ctrl-C the launcher stops both through their relays, the server sees the queued rank's relay
/// close and cancels its job ("stopped before its task started"), its command never runs, and nothing is left.
#[test]
fn a_rank_stopped_while_its_job_waits_for_a_slot_never_starts() {
    let python = spark_python();
    let dir = project(
        "step train {\n  run = \"touch started.$HVD_RANK; sleep 30 & wait\"\n  workers = { min = 1, max = 2 }\n}",
    );
    let mark = format!("spark-queued-{}", std::process::id());
    let child = spark_command(dir.path(), &python, &mark, &["--spark-master", "local[1]"])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Whichever job Spark gives the one slot first runs; the other waits.
    let started = |r: u32| dir.path().join(format!("started.{r}")).exists();
    let deadline = std::time::Instant::now() + Duration::from_secs(120);
    let first = loop {
        if let Some(r) = (0..2).find(|r| started(*r)) {
            break r;
        }
        assert!(std::time::Instant::now() < deadline, "no rank started");
        std::thread::sleep(Duration::from_millis(20));
    };
    let queued = 1 - first;
    // The other's job is queued by now (the relays start together); give it a moment to be submitted.
    std::thread::sleep(Duration::from_secs(1));
    let _ = Command::new("kill")
        .args(["-INT", &child.id().to_string()])
        .status();
    let out = child.wait_with_output().unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(130), "{stdout}\n{stderr}");
    let log = relay_log(dir.path());
    assert!(
        log.contains(&format!(
            ": slot {queued} stopped before its task started\n"
        )),
        "{log}"
    );
    assert!(!started(queued), "{log}");
    assert_nothing_left(&mark);
}

/// Preemption on Spark (an executor's process evicted arrives as SIGTERM): slot 1 of 3 (minimum 2) gets SIGTERM at
/// step 3; hvd.elastic finishes the step, commits, hands over and leaves, its relay exits 0, and the launcher reports it
/// preempted, not lost; the other two re-form at that commit and finish with every committed step counted once.
#[test]
fn a_preempted_relayed_rank_hands_over_and_leaves() {
    let python = spark_python();
    let dir = common::elastic::project("{ min = 2, max = 3 }", 8, ", ELASTIC_TERM = \"1:3\"");
    let mark = format!("spark-preempt-{}", std::process::id());
    let out = spark_command(dir.path(), &python, &mark, &[])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let says = |part: &str| common::unwrapped(&stderr).contains(&common::unwrapped(part));
    assert!(
        says(
            "rank 1 of step `train` was preempted: it committed, handed over and left; 2 of its 3 workers go on"
        ),
        "{stdout}\n{stderr}"
    );
    assert!(!says("was lost"), "{stdout}\n{stderr}");
    let lines = common::elastic::finished(&stdout, &[0, 2], 2);
    for line in &lines {
        assert_eq!(
            *line,
            common::elastic::counted_once(8),
            "{stdout}\n{stderr}"
        );
    }
    let log = relay_log(dir.path());
    assert!(log.contains(": slot 1 exited with 0\n"), "{log}");
    assert_nothing_left(&mark);
}
