//! Kubernetes without an env in the image: `hvd export k8s --cache URL --trusted-key KEY` writes a JobSet whose pods
//! run `hvd worker-env --pull ENV ...`, which substitutes the env's closure from the cache at pod start. Tested as
//! the other Kubernetes tests are (tests/cli_engines.rs): no cluster; pod-like processes with exactly the env their
//! container defines (values as written, the token from the Secret, the pod IP for `status.podIP`), an empty store at
//! the env's store directory, and a PATH without any Python package of the env.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{HVD, text};

/// The JobSet and Secret of an export, and one replicated job's container.
struct Exported {
    jobset: serde_json::Value,
    secret: serde_json::Value,
}

impl Exported {
    fn read(dir: &Path) -> Exported {
        let read = |name: &str| -> serde_json::Value {
            serde_json::from_str(&std::fs::read_to_string(dir.join(name)).unwrap()).unwrap()
        };
        Exported {
            jobset: read("app.jobset.json"),
            secret: read("app.secret.json"),
        }
    }

    fn container(&self, job: &str) -> &serde_json::Value {
        self.jobset["spec"]["replicatedJobs"]
            .as_array()
            .unwrap()
            .iter()
            .find(|j| j["name"] == job)
            .map(|j| &j["template"]["spec"]["template"]["spec"]["containers"][0])
            .unwrap_or_else(|| panic!("no replicated job {job}"))
    }

    fn command(&self, job: &str) -> Vec<String> {
        self.container(job)["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_owned())
            .collect()
    }

    /// The container's env as a pod with index `index` and IP `127.0.0.(2 + index)` gets it (the rendezvous and
    /// MASTER_ADDR, pod names, become rank 0's IP and `port`), plus what Kubernetes and a bare image add.
    fn pod_env(&self, job: &str, index: u32, port: u16) -> Vec<(String, String)> {
        let pod_ip = format!("127.0.0.{}", 2 + index);
        let mut vars = common::container_env(self.container(job), &self.secret, Some(&pod_ip));
        for (name, value) in &mut vars {
            match name.as_str() {
                "HVD_RENDEZVOUS" => *value = format!("127.0.0.2:{port}"),
                "MASTER_ADDR" => *value = "127.0.0.2".into(),
                _ => {}
            }
        }
        vars.extend([
            ("JOB_COMPLETION_INDEX".into(), index.to_string()),
            ("HOSTNAME".into(), format!("app-{job}-0-{index}")),
            // A bare image's PATH: no Python package of the env on it.
            ("PATH".into(), "/usr/bin:/bin".into()),
            ("HVD_RENDEZVOUS_WAIT".into(), "30".into()),
        ]);
        vars
    }

    /// Starts the pod `job`/`index` as a process in `dir`.
    fn start(&self, job: &str, index: u32, port: u16, dir: &Path) -> std::process::Child {
        let command = self.command(job);
        assert_eq!(command[0], "hvd");
        Command::new(HVD)
            .args(&command[1..])
            .current_dir(dir)
            .env_clear()
            .envs(self.pod_env(job, index, port))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

/// [`common::pushed_fixture_env`] of the project `hvd_file` whose steps may run `job.py`: a barrier over every rank,
/// then a line with what the rank sees (its rank, the env's `helper.WORD` and its `VIRTUAL_ENV`).
fn pushed_job(root: &Path, cache: &Path, hvd_file: &str) -> common::PushedEnv {
    let p = common::pushed_fixture_env(root, cache, hvd_file);
    std::fs::write(
        p.project.join("job.py"),
        "import os, hvd, helper\nhvd.init()\nhvd.barrier()\n\
         print(f\"job rank={hvd.rank()} size={hvd.size()} word={helper.WORD} venv={os.environ['VIRTUAL_ENV']}\")\n",
    )
    .unwrap();
    p
}

fn assert_ok(out: &Output, what: &str) -> String {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "{what}: {stdout}\n{stderr}");
    stdout
}

#[test]
fn jobset_pods_pull_the_env_at_start_and_a_tampered_cache_stops_them_before_the_worker() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = pushed_job(
        root.path(),
        &outside.path().join("cache"),
        "cluster {\n  engine = \"kubernetes\"\n  image = \"example/bare:1\"\n}\n\
         step prep {\n  run = \"greet > prep.out\"\n}\n\
         step train {\n  run = \"python job.py\"\n  workers = 2\n  needs = [\"prep\"]\n}\n",
    );
    let store = root.path().join("store");
    let url = format!("file://{}", p.cache.display());
    let key = p.public_key.display().to_string();
    let k8s = root.path().join("k8s");
    let with_cache = |args: &[&str]| {
        let mut command = common::hvd_with_store(root.path(), &store, args);
        command
            .args(["--cache", &url, "--trusted-key", &key])
            .env_remove("HVD_CACHES")
            .env_remove("HVD_TRUSTED_KEYS");
        command
    };
    let out = with_cache(&[
        "export",
        "k8s",
        "app/train.hvd",
        "--locked",
        "--out",
        &k8s.display().to_string(),
    ])
    .output()
    .unwrap();
    assert_ok(&out, "export");
    let exported = Exported::read(&k8s);
    // The manifest names the env, the cache and the key (its public text, not a file the pod lacks).
    let key_text = std::fs::read_to_string(&p.public_key).unwrap();
    let pull = [
        format!("--pull={}", p.env.display()),
        format!("--cache={url}"),
        format!("--trusted-key={}", key_text.trim()),
    ];
    assert_eq!(
        exported.command("train")[..5],
        ["hvd", "worker-env", &pull[0], &pull[1], &pull[2]]
    );
    assert_eq!(
        exported.command("prep")[..6],
        ["hvd", "worker-env", "--once", &pull[0], &pull[1], &pull[2]]
    );
    assert_eq!(exported.container("train")["image"], "example/bare:1");

    // `hvd run --engine kubernetes` writes the same pull into the JobSet it applies (a stand-in kubectl that
    // reaches no cluster stops the run once the manifests are written).
    let bin = root.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::write(
        bin.join("kubectl"),
        "#!/bin/sh\necho 'no cluster here' >&2\nexit 1\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(bin.join("kubectl"), std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = with_cache(&["run", "app/train.hvd", "--locked"])
        .env(
            "PATH",
            format!(
                "{}:{}",
                bin.display(),
                std::env::var("PATH").unwrap_or_default()
            ),
        )
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(
        !out.status.success() && stderr.contains("no cluster here"),
        "{stderr}"
    );
    let applied = Exported::read(&p.project.join(".hvd/k8s"));
    assert_eq!(
        applied.command("train")[..5],
        ["hvd", "worker-env", &pull[0], &pull[1], &pull[2]]
    );

    // The pods' store is empty (the built one moved aside), at the same directory.
    std::fs::rename(&store, root.path().join("built-store")).unwrap();
    let port = common::free_port();
    let prep = exported
        .start("prep", 0, port, &p.project)
        .wait_with_output()
        .unwrap();
    assert_ok(&prep, "prep");
    assert_eq!(
        std::fs::read_to_string(p.project.join("prep.out")).unwrap(),
        "hello from greet\n"
    );
    // Rank 1 starts first; both pull (the same store: each path under its lock), then meet at rank 0's rendezvous.
    let rank1 = exported.start("train", 1, port, &p.project);
    let rank0 = exported.start("train", 0, port, &p.project);
    for (rank, child) in [(0, rank0), (1, rank1)] {
        let stdout = assert_ok(&child.wait_with_output().unwrap(), &format!("rank {rank}"));
        assert!(
            stdout.contains(&format!(
                "job rank={rank} size=2 word=hello venv={}",
                p.env.display()
            )),
            "rank {rank}: {stdout}"
        );
    }

    // A tampered archive of `helper` in the cache: a pod with an empty store fails naming itself and the path, and
    // its worker never starts.
    remove_store(&store);
    let helper =
        common::tamper_cached_archive(&root.path().join("built-store"), &p.cache, "-helper-1.0");
    let out = exported
        .start("train", 0, common::free_port(), &p.project)
        .wait_with_output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    assert_refused(&stderr, "app-train-0-0", &helper);
    assert!(!stdout.contains("job rank"), "the worker ran: {stdout}");
}

/// Removes a store whose paths are read-only (made writable first).
fn remove_store(store: &Path) {
    if std::fs::remove_dir_all(store).is_err() {
        let _ = Command::new("chmod")
            .args(["-R", "u+w"])
            .arg(store)
            .status();
        std::fs::remove_dir_all(store).unwrap();
    }
}

/// `stderr` says that node `node` could not get the env because the archive of `path` was refused.
fn assert_refused(stderr: &str, node: &str, path: &str) {
    let words = common::unwrapped(stderr);
    for part in [
        format!("node `{node}` could not get the env"),
        format!("refusing {path}"),
    ] {
        assert!(
            words.contains(&common::unwrapped(&part)),
            "{part}: {stderr}"
        );
    }
}

/// The environment a container of an MPIJob defines (values as written, the token from the Secret), plus what
/// Kubernetes and a bare image add (`HOSTNAME`, a `PATH` with `hvd` from `bin` and no Python package of the env),
/// with rank 0's rendezvous at `127.0.0.1:port`.
fn mpijob_env(
    container: &serde_json::Value,
    secret: &serde_json::Value,
    host: &str,
    bin: &Path,
    port: u16,
) -> Vec<(String, String)> {
    let mut vars = common::container_env(container, secret, None);
    for (name, value) in &mut vars {
        if name == "HVD_RENDEZVOUS" {
            *value = format!("127.0.0.1:{port}");
        }
    }
    vars.extend([
        ("HOSTNAME".into(), host.into()),
        ("PATH".into(), format!("{}:/usr/bin:/bin", bin.display())),
        ("HVD_RENDEZVOUS_WAIT".into(), "30".into()),
    ]);
    vars
}

fn strings(value: &serde_json::Value) -> Vec<String> {
    value
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c.as_str().unwrap().to_owned())
        .collect()
}

/// Runs `command` (a container's, `hvd` or `mpirun` first, found on `vars`' PATH) in `dir` with exactly `vars`.
fn run_container(command: &[String], vars: &[(String, String)], dir: &Path) -> Output {
    let path = &vars.iter().find(|(k, _)| k == "PATH").unwrap().1;
    let program = path
        .split(':')
        .map(|d| Path::new(d).join(&command[0]))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("`{}` is not on {path}", command[0]));
    Command::new(program)
        .args(&command[1..])
        .current_dir(dir)
        .env_clear()
        .envs(vars.iter().cloned())
        .output()
        .unwrap()
}

/// Whether `mpirun` on PATH is OpenMPI's (the MPIJob's `mpiImplementation` here); says so when not.
fn have_openmpi() -> bool {
    let found = Command::new("mpirun")
        .arg("--version")
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains("Open MPI"));
    if !found {
        eprintln!("skipped the launcher's mpirun: `mpirun` is not OpenMPI's");
    }
    found
}

/// `hvd export k8s --flavour mpijob` of `p`'s project (its env in `root/store`) with `p`'s cache and key: the MPIJob
/// of step `train` and the token Secret.
fn export_mpijob(root: &Path, p: &common::PushedEnv) -> (serde_json::Value, serde_json::Value) {
    let url = format!("file://{}", p.cache.display());
    let key = p.public_key.display().to_string();
    let k8s = root.join("k8s");
    let out = common::hvd_with_store(
        root,
        &root.join("store"),
        &["export", "k8s", "app/train.hvd", "--locked"],
    )
    .args(["--flavour", "mpijob", "--out", &k8s.display().to_string()])
    .args(["--cache", &url, "--trusted-key", &key])
    .env_remove("HVD_CACHES")
    .env_remove("HVD_TRUSTED_KEYS")
    .output()
    .unwrap();
    let (_, stderr) = text(&out);
    assert_ok(&out, "export");
    assert!(!stderr.contains("do not pull"), "{stderr}");
    let read = |name: &str| -> serde_json::Value {
        serde_json::from_str(&std::fs::read_to_string(k8s.join(name)).unwrap()).unwrap()
    };
    (read("app-train.mpijob.json"), read("app.secret.json"))
}

/// A project with one 2-worker step `train` for an MPIJob (OpenMPI).
const MPIJOB_PROJECT: &str = "cluster {\n  engine = \"kubernetes\"\n  image = \"example/bare:1\"\n  settings = { mpi = \"openmpi\" }\n}\n\
                              step train {\n  run = \"python job.py\"\n  workers = 2\n}\n";

/// The pods' store is empty (the built one moved aside to `root/built-store`), at the same directory, and `hvd` is on
/// the image's PATH: the directory `root/bin` returned.
fn empty_pod_store(root: &Path) -> std::path::PathBuf {
    std::fs::rename(root.join("store"), root.join("built-store")).unwrap();
    let bin = root.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(common::HVD, bin.join("hvd")).unwrap();
    bin
}

/// The environment of the MPIJob's launcher container (its rendezvous port `port`); root here needs OpenMPI's
/// consent, as in such images.
fn launcher_env(
    launcher: &serde_json::Value,
    secret: &serde_json::Value,
    bin: &Path,
    port: u16,
) -> Vec<(String, String)> {
    let mut vars = mpijob_env(launcher, secret, "app-train-launcher", bin, port);
    vars.extend([
        ("OMPI_ALLOW_RUN_AS_ROOT".into(), "1".into()),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM".into(), "1".into()),
    ]);
    vars
}

/// `hvd export k8s --flavour mpijob` with a cache: each worker pod pulls the env in an init container into a volume
/// mounted at the store directory in both of its containers, the launcher waits for ready workers, and each rank's
/// shim gets the same pull. Pod-like processes with exactly the containers' commands and env: the init containers
/// pull into an empty store, then the launcher's mpirun starts the ranks, which run the env's Python (a package only
/// the env has) and meet at rank 0's rendezvous. With a tampered archive the init container fails naming its pod
/// and the path, nothing of the env is installed, and even a launcher started anyway runs no rank's command.
#[test]
fn mpijob_workers_pull_the_env_before_mpirun_and_a_tampered_cache_stops_every_rank() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = pushed_job(root.path(), &outside.path().join("cache"), MPIJOB_PROJECT);
    let store = root.path().join("store");
    let url = format!("file://{}", p.cache.display());
    let (mpijob, secret) = export_mpijob(root.path(), &p);
    let key_text = std::fs::read_to_string(&p.public_key).unwrap();
    let pull = [
        format!("--pull={}", p.env.display()),
        format!("--cache={url}"),
        format!("--trusted-key={}", key_text.trim()),
    ];
    let spec = &mpijob["spec"];
    assert_eq!(spec["launcherCreationPolicy"], "WaitForWorkersReady");
    let launcher = &spec["mpiReplicaSpecs"]["Launcher"]["template"]["spec"]["containers"][0];
    let worker_pod = &spec["mpiReplicaSpecs"]["Worker"]["template"]["spec"];
    let init = &worker_pod["initContainers"][0];
    let mpirun = strings(&launcher["command"]);
    let shim = mpirun.iter().position(|a| a == "worker-env").unwrap();
    let note = "--pull-failure-note".to_owned();
    assert_eq!(
        mpirun[shim + 1..shim + 6],
        [&pull[..], &[note.clone(), "--whole-lines".to_owned()]].concat()
    );
    // The pull runs under the shell guard, which notes a pull that died without a note itself.
    let store_dir = p.env.parent().unwrap().display().to_string();
    let init_command = strings(&init["command"]);
    assert_eq!(init_command[..2], ["/bin/sh", "-c"]);
    assert_eq!(
        init_command[3..],
        [
            &[
                "hvd-pull".to_owned(),
                format!("{store_dir}/.hvd-pull-failed"),
                p.env.display().to_string(),
                "hvd".to_owned(),
                "worker-env".into(),
                "--once".into()
            ],
            &pull[..],
            &[note]
        ]
        .concat()
    );
    assert_eq!(init["image"], "example/bare:1");
    let mount = serde_json::json!([{ "name": "hvd-store", "mountPath": store_dir }]);
    assert_eq!(init["volumeMounts"], mount);
    assert_eq!(worker_pod["containers"][0]["volumeMounts"], mount);
    assert_eq!(
        worker_pod["volumes"],
        serde_json::json!([{ "name": "hvd-store", "emptyDir": {} }])
    );

    let bin = empty_pod_store(root.path());
    let init_env =
        |pod: u32| mpijob_env(init, &secret, &format!("app-train-worker-{pod}"), &bin, 9);
    let pulls: Vec<_> = (0..2)
        .map(|pod| {
            let (command, vars, dir) =
                (strings(&init["command"]), init_env(pod), p.project.clone());
            std::thread::spawn(move || run_container(&command, &vars, &dir))
        })
        .collect();
    for (pod, pull) in pulls.into_iter().enumerate() {
        assert_ok(
            &pull.join().unwrap(),
            &format!("worker {pod}'s init container"),
        );
    }
    assert!(
        p.env.join("bin/python").exists(),
        "the init containers did not pull the env"
    );

    // The launcher's mpirun (its exact command and env).
    let launcher_vars = |port: u16| launcher_env(launcher, &secret, &bin, port);
    if have_openmpi() {
        let out = run_container(&mpirun, &launcher_vars(common::free_port()), &p.project);
        let stdout = assert_ok(&out, "the launcher's mpirun");
        for rank in 0..2 {
            let line = format!("job rank={rank} size=2 word=hello venv={}", p.env.display());
            assert!(stdout.contains(&line), "rank {rank}: {stdout}");
        }
    }

    // A tampered archive of `helper`: the init container of a pod with an empty store says why naming the pod and
    // the path, leaves no env, and ends with success (a pod stuck in its init container would hold the MPIJob and
    // the other workers forever: the launcher is created only once every worker is ready) with the reason noted in
    // the store volume.
    remove_store(&store);
    let helper =
        common::tamper_cached_archive(&root.path().join("built-store"), &p.cache, "-helper-1.0");
    let out = run_container(&strings(&init["command"]), &init_env(1), &p.project);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    assert_refused(&stderr, "app-train-worker-1", &helper);
    assert!(
        !p.env.exists() && !store.join(&helper).exists(),
        "half-installed"
    );
    let noted = std::fs::read_to_string(store.join(".hvd-pull-failed")).unwrap();
    assert_refused(&noted, "app-train-worker-1", &helper);
    // The launcher (its workers now ready): each rank's shim refuses with the note's reason, naming the pod and the
    // path, before any pull or rank; mpirun fails, so the launcher Job (and the MPIJob) fails with the reason.
    let why = format!("refusing {helper}");
    assert_every_rank_refuses(
        &mpirun,
        &launcher_vars(common::free_port()),
        &p.project,
        &why,
    );
    assert!(!p.env.exists(), "a rank's shim pulled despite the note");
}

/// The processes whose parent is `pid` (from `/proc/*/stat`: the field after the name, which may hold anything).
fn children(pid: u32) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|child| {
            std::fs::read_to_string(format!("/proc/{child}/stat")).is_ok_and(|stat| {
                stat.rsplit_once(") ")
                    .and_then(|(_, rest)| rest.split(' ').nth(1)?.parse::<u32>().ok())
                    == Some(pid)
            })
        })
        .collect()
}

/// Every rank's shim (the launcher's `hvd worker-env ...` with the rank's OpenMPI variables, run directly so that no
/// rank can be stopped by mpirun before it says why) refuses with the init container's note, which names the pod and
/// `why`; then the launcher's mpirun, where it is OpenMPI's, fails with the same reason and no rank ran.
fn assert_every_rank_refuses(mpirun: &[String], vars: &[(String, String)], dir: &Path, why: &str) {
    let shim = mpirun.iter().position(|a| a == "worker-env").unwrap() - 1;
    let says = |text: &str| {
        let words = common::unwrapped(text);
        [
            "this pod's init container could not get the env",
            "node `app-train-worker-1` could not get the env",
            why,
        ]
        .iter()
        .all(|part| words.contains(&common::unwrapped(part)))
    };
    for rank in ["0", "1"] {
        let mut rank_vars = vars.to_vec();
        rank_vars.extend(
            [
                ("OMPI_COMM_WORLD_RANK", rank),
                ("OMPI_COMM_WORLD_SIZE", "2"),
                ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ]
            .map(|(k, v)| (k.to_owned(), v.to_owned())),
        );
        let out = run_container(&mpirun[shim..], &rank_vars, dir);
        let (stdout, stderr) = text(&out);
        assert_eq!(
            out.status.code(),
            Some(1),
            "rank {rank}: {stdout}\n{stderr}"
        );
        assert!(says(&stderr), "rank {rank}: {stderr}");
        assert!(!stdout.contains("job rank"), "rank {rank} ran: {stdout}");
    }
    if have_openmpi() {
        let out = run_container(mpirun, vars, dir);
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{stdout}\n{stderr}");
        let untagged: String = stderr
            .lines()
            .map(|l| l.split_once("<stderr>:").map_or(l, |(_, rest)| rest))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(says(&untagged), "{stderr}");
        assert!(!stdout.contains("job rank"), "a rank ran: {stdout}");
    }
}

/// An MPIJob worker's init container whose pull dies without writing its note (killed by SIGKILL, as the OOM killer
/// does; an `hvd` in the image that is not executable) still ends with 0, so the pod starts instead of holding the
/// MPIJob pending forever, and its shell guard's note names the pod and the exit status: every rank's shim refuses
/// with it. Pod-like processes with the init container's exact command and env; the pull is held at the store's gc
/// lock (as `hvd gc` holds it) until it is killed.
#[test]
fn mpijob_init_containers_that_die_without_a_note_still_end_the_job() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = pushed_job(root.path(), &outside.path().join("cache"), MPIJOB_PROJECT);
    let (mpijob, secret) = export_mpijob(root.path(), &p);
    let spec = &mpijob["spec"]["mpiReplicaSpecs"];
    let init = &spec["Worker"]["template"]["spec"]["initContainers"][0];
    let launcher = &spec["Launcher"]["template"]["spec"]["containers"][0];
    let (init_command, mpirun) = (strings(&init["command"]), strings(&launcher["command"]));
    let bin = empty_pod_store(root.path());
    let store = root.path().join("store");
    std::fs::create_dir_all(store.join(".locks")).unwrap();
    let init_env = mpijob_env(init, &secret, "app-train-worker-1", &bin, 9);
    let launcher_vars = launcher_env(launcher, &secret, &bin, common::free_port());
    let note = store.join(".hvd-pull-failed");
    let noted = |why: &str| {
        let text = std::fs::read_to_string(&note).unwrap();
        let head = format!(
            "node `app-train-worker-1` could not get the env {}: ",
            p.env.display()
        );
        assert!(text.starts_with(&head) && text.contains(why), "{text}");
    };

    // SIGKILL: the pull waits for the gc lock this test holds, and is killed there.
    let lock = std::fs::File::create(store.join(".locks/gc.lock")).unwrap();
    use std::os::fd::AsRawFd as _;
    // SAFETY: flock on a descriptor this test owns (closed when `lock` drops, which releases it).
    assert_eq!(unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) }, 0);
    let program = Path::new(&init_command[0]);
    let mut pod = Command::new(program)
        .args(&init_command[1..])
        .current_dir(&p.project)
        .env_clear()
        .envs(init_env.iter().cloned())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let hvd = std::fs::canonicalize(common::HVD).unwrap();
    // Bounded: a guard that never started the pull (or started something else) ends the test, not hangs it.
    let until = std::time::Instant::now() + std::time::Duration::from_secs(120);
    let pull = loop {
        let seen = children(pod.id());
        let pull = seen.iter().copied().find(|child| {
            std::fs::read_link(format!("/proc/{child}/exe")).is_ok_and(|exe| exe == hvd)
        });
        if let Some(pull) = pull {
            break pull;
        }
        assert!(
            pod.try_wait().unwrap().is_none(),
            "{:?}",
            pod.wait_with_output()
        );
        if std::time::Instant::now() >= until {
            let exes: Vec<_> = seen
                .iter()
                .map(|child| (child, std::fs::read_link(format!("/proc/{child}/exe"))))
                .collect();
            for &child in &seen {
                // SAFETY: kill with integer arguments, to a child of the init container this test started (were
                // they left, the container's output pipes would stay open and the wait below would not end).
                unsafe { libc::kill(child as i32, libc::SIGKILL) };
            }
            let _ = pod.kill();
            panic!(
                "no pull (`{}`) among the init container's children after 120 s: {exes:?}; the container: {:?}",
                hvd.display(),
                pod.wait_with_output()
            );
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let pull = i32::try_from(pull).unwrap();
    // SAFETY: kill with integer arguments, to the pull the init container this test started runs as its child.
    assert_eq!(unsafe { libc::kill(pull, libc::SIGKILL) }, 0);
    let out = pod.wait_with_output().unwrap();
    drop(lock);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    noted("exit status 137: killed (OOM or SIGKILL)");
    assert!(!p.env.exists(), "half-installed");
    assert_every_rank_refuses(
        &mpirun,
        &launcher_vars,
        &p.project,
        "exit status 137: killed (OOM or SIGKILL)",
    );

    // An `hvd` that is not executable: the init container's shell cannot start it.
    std::fs::remove_file(&note).unwrap();
    std::fs::remove_file(bin.join("hvd")).unwrap();
    std::fs::write(bin.join("hvd"), "not a program\n").unwrap();
    let out = run_container(&init_command, &init_env, &p.project);
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(0), "{stdout}\n{stderr}");
    // (dash ends 127 for a file on PATH that it cannot execute, bash 126: both say that hvd could not be run.)
    noted("hvd could not be run");
    // In an image whose `hvd` cannot run, the launcher's mpirun cannot start the ranks' shims either: it fails.
    if have_openmpi() {
        let out = run_container(&mpirun, &launcher_vars, &p.project);
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{stdout}\n{stderr}");
        assert!(!stdout.contains("job rank"), "a rank ran: {stdout}");
    }
    // Ranks whose `hvd` runs (an ssh login's PATH may differ from the container's) refuse with the note.
    std::fs::remove_file(bin.join("hvd")).unwrap();
    std::os::unix::fs::symlink(common::HVD, bin.join("hvd")).unwrap();
    assert_every_rank_refuses(&mpirun, &launcher_vars, &p.project, "hvd could not be run");
}

/// `hvd worker-env --pull` roots the env it pulled until its worker has ended: `hvd gc` running in a loop on the
/// node while the shim pulls into an empty store and starts the rank (which waits until gc has run twice more after
/// it started) never removes the env, and the rank imports from it; once the rank has ended, gc removes the env
/// (nothing else roots it: without the shim's temporary root it would have gone).
#[test]
fn a_pulled_env_survives_gc_running_in_a_loop_until_its_worker_ends() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = common::pushed_fixture_env(root.path(), &outside.path().join("cache"), "");
    let store = root.path().join("store");
    std::fs::rename(&store, root.path().join("built-store")).unwrap();
    std::fs::create_dir_all(&store).unwrap();
    let key_text = std::fs::read_to_string(&p.public_key).unwrap();
    let gc = {
        let (dir, store) = (root.path().to_path_buf(), store.clone());
        move || common::hvd_with_store(&dir, &store, &["gc"])
    };
    let work = root.path().join("work");
    std::fs::create_dir_all(&work).unwrap();
    let mut looping = common::GcLoop::start(gc.clone(), None);
    // gc has run before the pull starts.
    looping.wait_runs(1);
    let child = Command::new(HVD)
        .arg("worker-env")
        .arg(format!("--pull={}", p.env.display()))
        .arg(format!("--cache=file://{}", p.cache.display()))
        .arg(format!("--trusted-key={}", key_text.trim()))
        .args(["--", "/bin/sh", "-c"])
        .arg(
            "touch started; while [ ! -e go ]; do sleep 0.05; done; \
             exec python -c 'import helper, sys; print(\"word=\" + helper.WORD, sys.prefix)'",
        )
        .current_dir(&work)
        .env_clear()
        .envs([
            ("PATH", "/usr/bin:/bin"),
            ("OMPI_COMM_WORLD_RANK", "0"),
            ("OMPI_COMM_WORLD_SIZE", "1"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "0"),
            ("HVD_RENDEZVOUS", "127.0.0.1:9"),
            ("HVD_JOB_TOKEN", "t"),
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    common::wait_for_path(&work.join("started"), std::time::Duration::from_secs(120));
    // Two whole gc runs between the rank's start and its use of the env.
    let seen = looping.runs();
    looping.wait_runs(seen + 2);
    std::fs::write(work.join("go"), "").unwrap();
    let shim = child.wait_with_output().unwrap();
    looping.stop();
    let stdout = assert_ok(&shim, "the rank");
    assert!(
        stdout.contains(&format!("word=hello {}", p.env.display())),
        "{stdout}"
    );
    // The rank has ended: its root is stale, and gc (the loop's last run, or this one) takes the env.
    assert_ok(&gc().output().unwrap(), "hvd gc");
    assert!(!p.env.exists(), "gc kept an env nothing roots");
}
