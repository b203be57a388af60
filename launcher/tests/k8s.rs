//! `hvd export k8s` manifests: golden files (tests/data/golden/, rewrite with `HVD_UPDATE_GOLDEN=1`) and a structural
//! check against the openAPIV3Schema of the JobSet (v1alpha2) and MPIJob (v2beta1) CRDs, kept as test data
//! (tests/data/*.schema.json: the CRDs' schemas converted to JSON with `description` fields removed).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use hvd_lang::model::{Cluster, Env, Project, Resources, Step};
use hvd_launcher::engines::k8s::{Delivery, Flavour, export, export_with};
use serde_json::Value;

fn data(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(name)
}

fn schema(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(data(name)).unwrap()).unwrap()
}

/// Checks `doc` against a structural schema: types, required fields, enums, maxItems, and no fields the schema
/// does not know (the API server would prune them silently). Returns every problem with its JSON path.
fn validate(schema: &Value, doc: &Value, path: &str, problems: &mut Vec<String>) {
    let int_or_string = schema["x-kubernetes-int-or-string"] == Value::Bool(true);
    if let Some(ty) = schema["type"].as_str() {
        let ok = match ty {
            "object" => doc.is_object(),
            "array" => doc.is_array(),
            "string" => doc.is_string() || (int_or_string && doc.is_i64()),
            "integer" => doc.is_i64() || doc.is_u64() || (int_or_string && doc.is_string()),
            "number" => doc.is_number(),
            "boolean" => doc.is_boolean(),
            _ => true,
        };
        if !ok {
            problems.push(format!("{path}: expected {ty}, found {doc}"));
            return;
        }
    }
    if let Some(values) = schema["enum"].as_array()
        && !values.contains(doc)
    {
        problems.push(format!("{path}: {doc} is not one of {values:?}"));
    }
    match doc {
        Value::Object(map) => {
            for field in schema["required"].as_array().into_iter().flatten() {
                let field = field.as_str().unwrap_or_default();
                if !map.contains_key(field) {
                    problems.push(format!("{path}: missing required field `{field}`"));
                }
            }
            let preserve = schema["x-kubernetes-preserve-unknown-fields"] == Value::Bool(true);
            for (key, value) in map {
                let sub = format!("{path}.{key}");
                if let Some(prop) = schema["properties"].get(key) {
                    validate(prop, value, &sub, problems);
                } else if schema["additionalProperties"].is_object() {
                    validate(&schema["additionalProperties"], value, &sub, problems);
                } else if !preserve && schema.get("properties").is_some() {
                    problems.push(format!("{sub}: unknown field"));
                }
            }
        }
        Value::Array(items) => {
            if let Some(max) = schema["maxItems"].as_u64()
                && items.len() as u64 > max
            {
                problems.push(format!("{path}: {} items, at most {max}", items.len()));
            }
            for (i, item) in items.iter().enumerate() {
                validate(&schema["items"], item, &format!("{path}[{i}]"), problems);
            }
        }
        _ => {}
    }
}

fn problems(schema_file: &str, doc: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    validate(&schema(schema_file), doc, "$", &mut problems);
    problems
}

fn step(name: &str, run: &str, workers: Option<u32>, needs: &[&str]) -> Step {
    Step {
        needs: needs.iter().map(|n| (*n).to_owned()).collect(),
        workers,
        env: BTreeMap::from([("STEP".to_string(), name.to_string())]),
        ..Step::new(name, run)
    }
}

fn project(cluster: Option<Cluster>) -> Project {
    Project {
        name: "My_Project".into(),
        file: "train.hvd".into(),
        env: Env {
            python: "3.11".into(),
            index: None,
            toolchain: None,
            packages: vec![],
            variables: BTreeMap::from([("LR".into(), "0.1".into())]),
        },
        resources: Resources {
            gpus: 1,
            cpus: Some(4),
            mem: Some(8 << 30),
        },
        steps: vec![
            step("prepare", "python prep.py", None, &[]),
            step("train", "python train.py", Some(2), &["prepare"]),
            step("eval", "python eval.py", Some(2), &["train", "prepare"]),
        ],
        cluster,
    }
}

fn cluster(settings: &[(&str, &str)]) -> Option<Cluster> {
    Some(Cluster {
        engine: Some(hvd_lang::model::EngineKind::Kubernetes),
        image: Some("registry.example/hvd-train:1".into()),
        namespace: Some("ml".into()),
        settings: {
            let mut typed = hvd_lang::model::EngineSettings::default();
            for (k, v) in settings {
                typed.set(k, hvd_lang::model::SettingValue::Str(v)).unwrap();
            }
            typed
        },
        ..Cluster::default()
    })
}

fn golden(name: &str, doc: &Value) {
    let text = serde_json::to_string_pretty(doc).unwrap() + "\n";
    let path = data("golden").join(name);
    if std::env::var_os("HVD_UPDATE_GOLDEN").is_some() {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, &text).unwrap();
    }
    let expected = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e} (HVD_UPDATE_GOLDEN=1 writes it)", path.display()));
    assert_eq!(
        text,
        expected,
        "{} differs (HVD_UPDATE_GOLDEN=1 rewrites it)",
        path.display()
    );
}

#[test]
fn jobset_follows_the_step_graph_and_fits_the_crd() {
    let out = export(&project(cluster(&[])), Flavour::JobSet).unwrap();
    assert_eq!(out.manifests.len(), 2);
    assert_eq!(out.manifests[0].file, "my-project.secret.json");
    let doc = &out.manifests[1].content;
    assert_eq!(out.manifests[1].file, "my-project.jobset.json");
    let jobs = doc["spec"]["replicatedJobs"].as_array().unwrap();
    let names: Vec<&str> = jobs.iter().map(|j| j["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["prepare", "train", "eval"]);
    assert_eq!(jobs[2]["dependsOn"][0]["name"], "prepare");
    assert_eq!(jobs[2]["dependsOn"][1]["name"], "train");
    assert_eq!(jobs[1]["template"]["spec"]["completions"], 2);
    let problems = problems("jobset.x-k8s.io_jobsets.v1alpha2.schema.json", doc);
    assert!(problems.is_empty(), "{problems:#?}");
    golden("my-project.jobset.json", doc);
}

#[test]
fn mpijob_per_distributed_step_fits_the_crd() {
    let out = export(&project(cluster(&[("mpi", "mpich")])), Flavour::MpiJob).unwrap();
    let files: Vec<&str> = out.manifests.iter().map(|m| m.file.as_str()).collect();
    assert_eq!(
        files,
        [
            "my-project.secret.json",
            "my-project-train.mpijob.json",
            "my-project-eval.mpijob.json"
        ]
    );
    assert!(
        out.notes.iter().any(|n| n.contains("`prepare` runs once")),
        "{:?}",
        out.notes
    );
    for m in &out.manifests[1..] {
        let problems = problems("kubeflow.org_mpijobs.v2beta1.schema.json", &m.content);
        assert!(problems.is_empty(), "{}: {problems:#?}", m.file);
    }
    let train = &out.manifests[1].content;
    assert_eq!(train["spec"]["mpiImplementation"], "MPICH");
    golden("my-project-train.mpijob.json", train);
}

/// With caches and a key, each MPIJob's worker pods pull the env in an init container into a store volume both
/// containers mount, the launcher waits for ready workers and every rank's shim gets the same pull; the manifests fit
/// the CRD. A cache URL with credentials is refused (a manifest is read by whoever can list pods).
#[test]
fn mpijob_workers_pull_the_env_in_an_init_container_and_fit_the_crd() {
    let env = "/opt/hvd/store/0123456789abcdef0123456789abcdef-my-project-env";
    let delivery = |cache: &str| Delivery {
        env: env.into(),
        caches: vec![cache.into()],
        trusted_keys: vec!["k1:AAAA".into()],
    };
    let project = project(cluster(&[("mpi", "openmpi")]));
    let out = export_with(
        &project,
        Flavour::MpiJob,
        Some(&delivery("s3://bucket/cache")),
    )
    .unwrap();
    assert!(
        !out.notes.iter().any(|n| n.contains("pull")),
        "{:?}",
        out.notes
    );
    for m in &out.manifests[1..] {
        let problems = problems("kubeflow.org_mpijobs.v2beta1.schema.json", &m.content);
        assert!(problems.is_empty(), "{}: {problems:#?}", m.file);
        let worker = &m.content["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"];
        // The pull runs under the init container's sh guard (`/bin/sh -c GUARD NAME NOTE ENV hvd ...`), which notes
        // a pull that died without its own note.
        let command = &worker["initContainers"][0]["command"];
        assert_eq!(command[0], "/bin/sh");
        assert_eq!(command[5], env);
        assert_eq!(
            command.as_array().unwrap()[6..10],
            [
                "hvd".into(),
                "worker-env".into(),
                "--once".into(),
                Value::String(format!("--pull={env}"))
            ]
        );
    }
    golden(
        "my-project-train.pulling.mpijob.json",
        &out.manifests[1].content,
    );
    let err = export_with(
        &project,
        Flavour::MpiJob,
        Some(&delivery("https://user:s3cr3t@cache.example/c")),
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("carries credentials") && !err.contains("s3cr3t"),
        "{err}"
    );
}

/// The text of a project file the elastic tests export (the model they export is built here; the launcher pods get
/// this text).
const PROJECT_FILE: &str = "env {\n  python = \"3.11\"\n}\nstep train {\n  run = \"python train.py\"\n  \
                            workers = { min = 1, max = 2 }\n}\n";

/// An elastic step (`train`, 1 to 2 workers) with caches: a launcher pod (the .hvd file from a ConfigMap, an
/// account that may list pods and exec into them, nothing more) and worker pods that pull the env and wait; the
/// JobSet completes once every other job did, and the whole fits the CRD.
#[test]
fn an_elastic_step_is_a_launcher_pod_and_waiting_worker_pods_and_fits_the_crd() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("train.hvd");
    std::fs::write(&file, PROJECT_FILE).unwrap();
    let mut project = project(cluster(&[]));
    project.file = file;
    project.steps[1].min_workers = Some(1);
    let env = "/opt/hvd/store/0123456789abcdef0123456789abcdef-my-project-env";
    let delivery = Delivery {
        env: env.into(),
        caches: vec!["s3://bucket/cache".into()],
        trusted_keys: vec!["k1:AAAA".into()],
    };
    let out = hvd_launcher::engines::k8s::export_running(
        &project,
        Flavour::JobSet,
        Some(&delivery),
        &["--elastic-timeout=7".into()],
    )
    .unwrap();
    let kinds: Vec<&str> = out
        .manifests
        .iter()
        .map(|m| m.content["kind"].as_str().unwrap())
        .collect();
    assert_eq!(
        kinds,
        [
            "Secret",
            "ConfigMap",
            "ServiceAccount",
            "Role",
            "RoleBinding",
            "JobSet"
        ]
    );
    assert_eq!(
        out.manifests[1].content["data"],
        serde_json::json!({ "f0": PROJECT_FILE })
    );
    // The launcher's account: pods, read, and exec into them; nothing else.
    assert_eq!(
        out.manifests[3].content["rules"],
        serde_json::json!([
            { "apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"] },
            { "apiGroups": [""], "resources": ["pods/exec"], "verbs": ["create", "get"] },
        ])
    );
    assert_eq!(
        out.manifests[4].content["subjects"][0],
        serde_json::json!({ "kind": "ServiceAccount", "name": "my-project-hvd-launcher", "namespace": "ml" })
    );
    let doc = &out.manifests[5].content;
    let problems = problems("jobset.x-k8s.io_jobsets.v1alpha2.schema.json", doc);
    assert!(problems.is_empty(), "{problems:#?}");
    let jobs = doc["spec"]["replicatedJobs"].as_array().unwrap();
    let names: Vec<&str> = jobs.iter().map(|j| j["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["prepare", "train", "train-workers", "eval"]);
    assert_eq!(
        doc["spec"]["successPolicy"]["targetReplicatedJobs"],
        serde_json::json!(["prepare", "train", "eval"])
    );
    // Both wait for what the step needs; `eval` needs the launcher (the step), not the worker pods.
    for job in &jobs[1..3] {
        assert_eq!(job["dependsOn"][0]["name"], "prepare", "{job}");
    }
    assert_eq!(jobs[3]["dependsOn"][1]["name"], "train");
    let launcher = &jobs[1]["template"]["spec"]["template"]["spec"];
    assert_eq!(launcher["serviceAccountName"], "my-project-hvd-launcher");
    assert_eq!(
        launcher["volumes"][0]["configMap"]["items"],
        serde_json::json!([{ "key": "f0", "path": "train.hvd" }])
    );
    let command: Vec<&str> = launcher["containers"][0]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    let want_env = format!("--env-dir={env}");
    assert_eq!(
        command,
        [
            "hvd",
            "run",
            "/var/run/hvd/project/train.hvd",
            "--step=train",
            "--no-deps",
            "--force",
            "--engine=kubernetes",
            "--state-dir=/var/run/hvd/state",
            want_env.as_str(),
            "--cache=s3://bucket/cache",
            "--trusted-key=k1:AAAA",
            "--elastic-timeout=7",
        ]
    );
    // The launcher needs no GPU (the step's resources are its workers'), but it asks for some memory and CPU, and no
    // autoscaler may move it: losing it starts the step over.
    assert_eq!(
        launcher["containers"][0]["resources"],
        serde_json::json!({ "requests": { "cpu": "100m", "memory": "224Mi" } })
    );
    assert_eq!(
        jobs[1]["template"]["spec"]["template"]["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"],
        "true"
    );
    // A launcher that fails fails the step (and the JobSet); one disrupted (evicted, its node drained or lost) is
    // started again, not counted.
    let disruption = serde_json::json!({
        "action": "Ignore",
        "onPodConditions": [{ "type": "DisruptionTarget", "status": "True" }],
    });
    assert_eq!(jobs[1]["template"]["spec"]["backoffLimit"], 0);
    assert_eq!(
        jobs[1]["template"]["spec"]["podFailurePolicy"]["rules"],
        serde_json::json!([disruption])
    );
    let workers = &jobs[2]["template"]["spec"];
    assert_eq!(workers["parallelism"], 2);
    // A lost or evicted worker pod is started again (an eviction not counted), and one that the launcher ends with 0
    // once the step is over ends the Job and the other pods; the pods have time to hand their ranks over.
    assert_eq!(workers["backoffLimit"], i32::MAX);
    assert_eq!(workers["podFailurePolicy"]["rules"][0], disruption);
    assert_eq!(
        workers["successPolicy"],
        serde_json::json!({ "rules": [{ "succeededCount": 1 }] })
    );
    assert_eq!(
        workers["template"]["spec"]["terminationGracePeriodSeconds"],
        45
    );
    let worker = &workers["template"]["spec"]["containers"][0];
    assert_eq!(worker["resources"]["limits"]["nvidia.com/gpu"], "1");
    let idle = worker["command"].as_array().unwrap();
    assert_eq!(
        idle[..4],
        ["hvd", "worker-env", "--once", &format!("--pull={env}")]
    );
    assert_eq!(
        idle[idle.len() - 5..],
        [
            "/bin/sh",
            "-c",
            hvd_launcher::engines::k8s::elastic::IDLE,
            "hvd-idle",
            "40"
        ]
    );
    golden("my-project.elastic.jobset.json", doc);
}

/// What an elastic step cannot be in a JobSet is refused at export, naming the step: a discovery program of its own,
/// checkpoints in a directory (each pod's own file system), and another step named as its worker pods' job.
#[test]
fn an_elastic_step_without_a_place_in_a_jobset_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("train.hvd");
    std::fs::write(&file, PROJECT_FILE).unwrap();
    let elastic = |edit: &dyn Fn(&mut Project)| {
        let mut project = project(cluster(&[]));
        project.file = file.clone();
        project.steps[1].min_workers = Some(1);
        edit(&mut project);
        export(&project, Flavour::JobSet)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    let err = elastic(&|p| p.steps[1].elastic.discovery = Some("discover.sh".into()));
    assert!(
        err.contains(
            "step `train` is elastic with host discovery, which the kubernetes engine does not run"
        ),
        "{err}"
    );
    let err = elastic(&|p| p.steps[1].checkpoints = Some("ckpt/".into()));
    assert!(
        err.contains("step `train` keeps its checkpoints in `ckpt/`: on Kubernetes that is each worker pod's own"),
        "{err}"
    );
    assert_eq!(
        elastic(&|p| p.steps[1].checkpoints = Some("s3://b/p".into())),
        ""
    );
    // A variable its ranks' shell owns could not be exported into them in the worker pods.
    let err = elastic(&|p| {
        p.steps[1].env.insert("PPID".into(), "1".into());
    });
    assert!(
        err.contains(
            "step `train`: variable `PPID` cannot be given to a rank on the kubernetes engine"
        ),
        "{err}"
    );
    // A file the .hvd file imports from outside its directory cannot go with it.
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("lib.hvd"), "let x = 1\n").unwrap();
    std::fs::write(
        &file,
        format!(
            "import \"{}\" as lib\n{PROJECT_FILE}",
            outside.path().join("lib.hvd").display()
        ),
    )
    .unwrap();
    let err = elastic(&|_| {});
    assert!(
        err.contains("which is outside its directory") && err.contains("lib.hvd"),
        "{err}"
    );
    std::fs::write(&file, PROJECT_FILE).unwrap();
    let err = elastic(&|p| p.steps[2].name = "train-workers".into());
    assert!(
        err.contains(
            "step `train-workers` has the name of elastic step `train`'s worker pods' job"
        ),
        "{err}"
    );
}

#[test]
fn the_validator_catches_what_the_api_server_would_reject() {
    let out = export(&project(cluster(&[])), Flavour::JobSet).unwrap();
    let mut doc = out.manifests[1].content.clone();
    doc["spec"]["replicatedJobs"][2]["dependsOn"][0]["status"] = "Done".into();
    doc["spec"]["replicatedJobs"][1]["replicas"] = "two".into();
    doc["spec"]["replicatedJobs"][0]
        .as_object_mut()
        .unwrap()
        .remove("template");
    doc["spec"]["nonsense"] = true.into();
    let problems = problems("jobset.x-k8s.io_jobsets.v1alpha2.schema.json", &doc);
    assert_eq!(problems.len(), 4, "{problems:#?}");
}

#[test]
fn missing_image_is_a_clear_error() {
    let mut c = cluster(&[]);
    if let Some(c) = c.as_mut() {
        c.image = None;
    }
    let err = export(&project(c), Flavour::JobSet).unwrap_err();
    assert!(
        err.to_string()
            .contains("set `image` in the `cluster` block"),
        "{err}"
    );
}

/// The token Secret's token, checked to be 32 lowercase hex digits.
fn token_of(secret: &Value) -> String {
    assert_eq!(secret["kind"], "Secret", "{secret:#}");
    let token = secret["stringData"]["token"].as_str().unwrap().to_owned();
    assert!(
        token.len() == 32 && token.bytes().all(|b| b.is_ascii_hexdigit()),
        "{token}"
    );
    token
}

/// Every container of `doc` (a JobSet or an MPIJob) with its path.
fn containers(doc: &Value) -> Vec<(String, &Value)> {
    let mut out = Vec::new();
    fn walk<'a>(v: &'a Value, path: String, out: &mut Vec<(String, &'a Value)>) {
        match v {
            Value::Object(map) => {
                for (k, v) in map {
                    if k == "containers" {
                        for (i, c) in v.as_array().into_iter().flatten().enumerate() {
                            out.push((format!("{path}.containers[{i}]"), c));
                        }
                    } else {
                        walk(v, format!("{path}.{k}"), out);
                    }
                }
            }
            Value::Array(items) => {
                for (i, item) in items.iter().enumerate() {
                    walk(item, format!("{path}[{i}]"), out);
                }
            }
            _ => {}
        }
    }
    walk(doc, "$".into(), &mut out);
    out
}

fn env_entry<'a>(container: &'a Value, name: &str) -> Option<&'a Value> {
    container["env"]
        .as_array()?
        .iter()
        .find(|e| e["name"] == name)
}

#[test]
fn the_job_token_is_a_fresh_secret_the_ranks_reference_never_a_label() {
    for flavour in [Flavour::JobSet, Flavour::MpiJob] {
        let project = project(cluster(&[]));
        let out = export(&project, flavour).unwrap();
        let secret = &out.manifests[0].content;
        let token = token_of(secret);
        assert_eq!(secret["metadata"]["name"], "my-project-hvd-token");
        assert_eq!(secret["metadata"]["namespace"], "ml");
        assert_eq!(secret["type"], "Opaque");
        // Two exports: two tokens (from the kernel's random source).
        let again = export(&project, flavour).unwrap();
        assert_ne!(token_of(&again.manifests[0].content), token, "{flavour:?}");
        for manifest in &out.manifests[1..] {
            let text = serde_json::to_string(&manifest.content).unwrap();
            // The token is in no label, annotation, argument or value: only in the Secret.
            assert!(!text.contains(&token), "{}: {text}", manifest.file);
            assert!(
                !text.contains("controller-uid"),
                "{}: {text}",
                manifest.file
            );
            assert!(!text.contains("annotations"), "{}: {text}", manifest.file);
            let mut referencing = 0;
            for (path, container) in containers(&manifest.content) {
                // Every JobSet rank learns its pod's address from the downward API: rank 0 serves only there. An
                // MPIJob's ranks do not see it (mpirun's ssh), and MPICH would pass the launcher's on: none there.
                match flavour {
                    Flavour::JobSet => {
                        let pod_ip = env_entry(container, "HVD_POD_IP").expect(&path);
                        assert_eq!(
                            pod_ip["valueFrom"]["fieldRef"]["fieldPath"], "status.podIP",
                            "{path}"
                        );
                    }
                    Flavour::MpiJob => {
                        assert!(env_entry(container, "HVD_POD_IP").is_none(), "{path}")
                    }
                }
                if let Some(entry) = env_entry(container, "HVD_JOB_TOKEN") {
                    assert!(entry.get("value").is_none(), "{path}: {entry}");
                    assert_eq!(
                        entry["valueFrom"]["secretKeyRef"],
                        serde_json::json!({ "name": "my-project-hvd-token", "key": "token" }),
                        "{path}"
                    );
                    referencing += 1;
                }
                let command = container["command"].as_array().cloned().unwrap_or_default();
                if command.iter().any(|c| c == "worker-env") {
                    assert!(env_entry(container, "HVD_JOB_TOKEN").is_some(), "{path}");
                }
            }
            assert!(
                referencing > 0,
                "{}: no container gets the token",
                manifest.file
            );
        }
    }
    // Golden, without the random token.
    let out = export(&project(cluster(&[])), Flavour::JobSet).unwrap();
    let mut secret = out.manifests[0].content.clone();
    secret["stringData"]["token"] = "<32 random hex digits>".into();
    golden("my-project.secret.json", &secret);
}
