//! Kubernetes without an env in the image: `hvd export k8s --cache URL --trusted-key KEY` writes a JobSet whose pods
//! run `hvd worker-env --pull ENV ...`, which substitutes the env's closure from the cache at pod start. Tested as
//! the other Kubernetes tests are (tests/cli_engines.rs): no cluster; pod-like processes with exactly the env their
//! container defines (values as written, the token from the Secret, the pod IP for `status.podIP`), an empty store at
//! the env's store directory, and a PATH without any Python package of the env.

mod common;

use std::path::{Path, PathBuf};
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
        let mut vars = Vec::new();
        for entry in self.container(job)["env"].as_array().unwrap() {
            let name = entry["name"].as_str().unwrap().to_owned();
            let value = if let Some(v) = entry["value"].as_str() {
                v.to_owned()
            } else if let Some(r) = entry["valueFrom"]["secretKeyRef"].as_object() {
                assert_eq!(r["name"], self.secret["metadata"]["name"], "{entry}");
                let key = r["key"].as_str().unwrap();
                self.secret["stringData"][key].as_str().unwrap().to_owned()
            } else if entry["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP" {
                pod_ip.clone()
            } else {
                panic!("a variable this test cannot provide: {entry}");
            };
            let value = match name.as_str() {
                "HVD_RENDEZVOUS" => format!("127.0.0.2:{port}"),
                "MASTER_ADDR" => "127.0.0.2".into(),
                _ => value,
            };
            vars.push((name, value));
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

fn assert_ok(out: &Output, what: &str) -> String {
    let (stdout, stderr) = text(out);
    assert!(out.status.success(), "{what}: {stdout}\n{stderr}");
    stdout
}

#[test]
fn jobset_pods_pull_the_env_at_start_and_a_tampered_cache_stops_them_before_the_worker() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = common::pushed_fixture_env(
        root.path(),
        &outside.path().join("cache"),
        "cluster {\n  engine = \"kubernetes\"\n  image = \"example/bare:1\"\n}\n\
         step prep {\n  run = \"greet > prep.out\"\n}\n\
         step train {\n  run = \"python job.py\"\n  workers = 2\n  needs = [\"prep\"]\n}\n",
    );
    std::fs::write(
        p.project.join("job.py"),
        "import os, hvd, helper\nhvd.init()\nhvd.barrier()\n\
         print(f\"job rank={hvd.rank()} size={hvd.size()} word={helper.WORD} venv={os.environ['VIRTUAL_ENV']}\")\n",
    )
    .unwrap();
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
    std::fs::remove_dir_all(&store).unwrap_or_else(|_| {
        // The store's paths are read-only: make them writable to remove them.
        let _ = Command::new("chmod")
            .args(["-R", "u+w"])
            .arg(&store)
            .status();
        std::fs::remove_dir_all(&store).unwrap();
    });
    let helper = std::fs::read_dir(root.path().join("built-store"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .find(|n| n.ends_with("-helper-1.0"))
        .unwrap();
    use hvd_builder::cache::record::{Record, archive_key, record_key};
    let record = Record::parse(&std::fs::read(p.cache.join(record_key(&helper))).unwrap()).unwrap();
    let archive: PathBuf = p.cache.join(archive_key(&record.archive.sha256));
    let mut bytes = std::fs::read(&archive).unwrap();
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x20;
    std::fs::write(&archive, &bytes).unwrap();
    let out = exported
        .start("train", 0, common::free_port(), &p.project)
        .wait_with_output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stdout}\n{stderr}");
    let words = common::unwrapped(&stderr);
    for part in [
        "node `app-train-0-0` could not get the env".to_owned(),
        format!("refusing {helper}"),
    ] {
        assert!(
            words.contains(&common::unwrapped(&part)),
            "{part}: {stderr}"
        );
    }
    assert!(!stdout.contains("job rank"), "the worker ran: {stdout}");
}
