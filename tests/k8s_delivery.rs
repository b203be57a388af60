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
    let p = pushed_job(
        root.path(),
        &outside.path().join("cache"),
        "cluster {\n  engine = \"kubernetes\"\n  image = \"example/bare:1\"\n  settings = { mpi = \"openmpi\" }\n}\n\
         step train {\n  run = \"python job.py\"\n  workers = 2\n}\n",
    );
    let store = root.path().join("store");
    let url = format!("file://{}", p.cache.display());
    let key = p.public_key.display().to_string();
    let k8s = root.path().join("k8s");
    let out = common::hvd_with_store(
        root.path(),
        &store,
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
    let (mpijob, secret) = (read("app-train.mpijob.json"), read("app.secret.json"));
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
    assert_eq!(
        strings(&init["command"]),
        [
            &["hvd".to_owned(), "worker-env".into(), "--once".into()],
            &pull[..],
            &[note]
        ]
        .concat()
    );
    assert_eq!(init["image"], "example/bare:1");
    let store_dir = p.env.parent().unwrap().display().to_string();
    let mount = serde_json::json!([{ "name": "hvd-store", "mountPath": store_dir }]);
    assert_eq!(init["volumeMounts"], mount);
    assert_eq!(worker_pod["containers"][0]["volumeMounts"], mount);
    assert_eq!(
        worker_pod["volumes"],
        serde_json::json!([{ "name": "hvd-store", "emptyDir": {} }])
    );

    // The pods' store is empty (the built one moved aside), at the same directory; `hvd` is on the image's PATH.
    std::fs::rename(&store, root.path().join("built-store")).unwrap();
    let bin = root.path().join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::os::unix::fs::symlink(common::HVD, bin.join("hvd")).unwrap();
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

    // The launcher's mpirun (its exact command and env; root here needs OpenMPI's consent, as in such images).
    let launcher_env = |port: u16| {
        let mut vars = mpijob_env(launcher, &secret, "app-train-launcher", &bin, port);
        vars.extend([
            ("OMPI_ALLOW_RUN_AS_ROOT".into(), "1".into()),
            ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM".into(), "1".into()),
        ]);
        vars
    };
    if have_openmpi() {
        let out = run_container(&mpirun, &launcher_env(common::free_port()), &p.project);
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
    if have_openmpi() {
        let out = run_container(&mpirun, &launcher_env(common::free_port()), &p.project);
        let (stdout, stderr) = text(&out);
        assert!(!out.status.success(), "{stdout}\n{stderr}");
        // mpirun tags every line a rank writes (`[1,R]<stderr>:`).
        let untagged: String = stderr
            .lines()
            .map(|l| l.split_once("<stderr>:").map_or(l, |(_, rest)| rest))
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            common::unwrapped(&untagged).contains(&common::unwrapped(
                "this pod's init container could not get the env"
            )),
            "{stderr}"
        );
        assert_refused(&untagged, "app-train-worker-1", &helper);
        assert!(!stdout.contains("job rank"), "a rank ran: {stdout}");
        assert!(!p.env.exists(), "a rank's shim pulled despite the note");
    }
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
