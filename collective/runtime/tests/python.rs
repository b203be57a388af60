//! The `hvd` Python package end to end: 2-4 real Python processes per test, bootstrapped through the launcher's
//! rendezvous server exactly as `hvd run` does, driving `libhvd_runtime.so` through ctypes. Needs `python3` with
//! numpy (`scripts/install-deps` installs it); `HVD_TEST_PYTHON` picks another interpreter.

use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use hvd_launcher::rendezvous::RendezvousServer;

struct RankResult {
    status: ExitStatus,
    stdout: String,
    stderr: String,
}

fn library() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let deps = exe.parent().expect("deps directory");
    let candidates = [
        deps.join("libhvd_runtime.so"),
        deps.join("../libhvd_runtime.so"),
    ];
    candidates
        .iter()
        .filter(|p| p.is_file())
        .max_by_key(|p| p.metadata().and_then(|m| m.modified()).ok())
        .cloned()
        .unwrap_or_else(|| panic!("libhvd_runtime.so not found next to {}", exe.display()))
}

fn script(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/python")
        .join(name)
}

/// Runs `script` on `size` ranks and returns every rank's exit status and output (ranks are killed after 90 s).
fn run(size: usize, name: &str, env: &[(&str, &str)]) -> Vec<RankResult> {
    let python = std::env::var("HVD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    run_with(&python, size, name, env)
}

/// [`run`] with a given interpreter.
fn run_with(python: &str, size: usize, name: &str, env: &[(&str, &str)]) -> Vec<RankResult> {
    let token = "0123456789abcdef";
    let server = RendezvousServer::start_on_loopback(token).expect("start the rendezvous server");
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python");
    let lib = library();
    let dir = tempfile::tempdir().unwrap();
    let mut children = Vec::new();
    for rank in 0..size {
        let out = dir.path().join(format!("{rank}.out"));
        let err = dir.path().join(format!("{rank}.err"));
        let mut cmd = Command::new(python);
        cmd.arg(script(name))
            .env("PYTHONPATH", &package)
            .env("HVD_LIBRARY", &lib)
            .env("HVD_RANK", rank.to_string())
            .env("HVD_SIZE", size.to_string())
            .env("HVD_LOCAL_RANK", rank.to_string())
            .env("HVD_LOCAL_SIZE", size.to_string())
            .env("HVD_CROSS_RANK", "0")
            .env("HVD_CROSS_SIZE", "1")
            .env("HVD_HOSTNAME", "localhost")
            .env("HVD_RENDEZVOUS", server.addr().to_string())
            .env("HVD_JOB_TOKEN", token)
            .env("PYTHONUNBUFFERED", "1")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap());
        for (k, v) in env {
            cmd.env(k, v);
        }
        let child = cmd
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start `{python}`: {e}; set HVD_TEST_PYTHON"));
        children.push((child, out, err));
    }
    let deadline = Instant::now() + Duration::from_secs(90);
    children
        .into_iter()
        .map(|(mut child, out, err)| {
            let status = loop {
                if let Some(s) = child.try_wait().unwrap() {
                    break s;
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    break child.wait().unwrap();
                }
                std::thread::sleep(Duration::from_millis(20));
            };
            RankResult {
                status,
                stdout: std::fs::read_to_string(out).unwrap_or_default(),
                stderr: std::fs::read_to_string(err).unwrap_or_default(),
            }
        })
        .collect()
}

fn assert_all_ok(results: &[RankResult], what: &str) {
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.status.success(),
            "{what}: rank {rank} failed ({}):\n--- stdout\n{}\n--- stderr\n{}",
            r.status,
            r.stdout,
            r.stderr
        );
        assert!(
            r.stdout.contains(&format!("rank {rank}")),
            "{what}: rank {rank} printed no result: {}",
            r.stdout
        );
    }
}

#[test]
fn every_op_dtype_and_shape_matches_numpy_on_2_3_and_4_ranks() {
    for size in [2, 3, 4] {
        assert_all_ok(&run(size, "ops.py", &[]), &format!("ops on {size} ranks"));
    }
}

#[test]
fn different_submission_orders_with_fusion_on_and_off() {
    assert_all_ok(&run(3, "ordering.py", &[]), "ordering, fusion on");
    assert_all_ok(
        &run(3, "ordering.py", &[("HVD_FUSION_THRESHOLD", "0")]),
        "ordering, fusion off",
    );
    assert_all_ok(
        &run(2, "ordering.py", &[("HVD_CACHE_CAPACITY", "0")]),
        "ordering, no response cache",
    );
    assert_all_ok(
        &run(3, "ordering.py", &[("HVD_COLLECTIVE_BACKEND", "tcp")]),
        "ordering over tcp",
    );
}

#[test]
fn grouped_allreduce_takes_one_call_and_one_wait_for_many_tensors() {
    assert_all_ok(&run(3, "grouped.py", &[]), "grouped, fusion on");
    assert_all_ok(
        &run(2, "grouped.py", &[("HVD_FUSION_THRESHOLD", "0")]),
        "grouped, fusion off",
    );
}

#[test]
fn bfloat16_numpy_arrays_as_ml_dtypes_and_as_wrapped_bits() {
    assert_all_ok(&run(2, "bf16.py", &[]), "bf16");
}

#[test]
fn framework_helpers_without_their_framework_raise_a_clear_import_error() {
    let python = std::env::var("HVD_TEST_PYTHON").unwrap_or_else(|_| "python3".into());
    let package = Path::new(env!("CARGO_MANIFEST_DIR")).join("../python");
    for (module, framework, says) in [
        ("hvd.torch", "torch", "hvd.torch needs PyTorch"),
        ("hvd.jax", "jax", "hvd.jax needs"),
        ("hvd.tensorflow", "tensorflow", "hvd.tensorflow needs"),
    ] {
        // Where the framework is installed the import must simply work; elsewhere the error must say what to do.
        let code = format!(
            "import importlib.util, sys\n\
             has = importlib.util.find_spec('{framework}') is not None\n\
             try:\n    import {module}\n    print('imported' if has else 'imported without {framework}')\n\
             except ImportError as e:\n    print('ImportError:', e)\n"
        );
        let out = Command::new(&python)
            .args(["-c", &code])
            .env("PYTHONPATH", &package)
            .output()
            .expect("run python");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "{module}: {out:?}");
        assert!(
            stdout.trim() == "imported" || stdout.contains(says),
            "{module}: {stdout}"
        );
    }
}

#[test]
fn timeline_is_valid_chrome_trace_json_with_every_phase() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("timeline.json");
    // Rank 0 writes the timeline, as with Horovod.
    let results = run(
        2,
        "ordering.py",
        &[("HVD_TIMELINE", path.to_str().unwrap())],
    );
    assert_all_ok(&results, "ordering with a timeline");
    let text = std::fs::read_to_string(&path).unwrap();
    let events: serde_json::Value =
        serde_json::from_str(&text).expect("the timeline is valid JSON");
    let names: std::collections::BTreeSet<&str> = events
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|e| [e["name"].as_str(), e["args"]["name"].as_str()])
        .flatten()
        .collect();
    // The collective itself is named after the backend: SHM_ALLREDUCE on one host.
    assert!(
        names
            .iter()
            .any(|n| n.ends_with("_ALLREDUCE") && !n.starts_with("NEGOTIATE")),
        "{names:?}"
    );
    for phase in [
        "NEGOTIATE_ALLREDUCE",
        "ALLREDUCE",
        "QUEUE",
        "MEMCPY_IN_FUSION_BUFFER",
        "MEMCPY_OUT_FUSION_BUFFER",
        "CYCLE_START",
        "grad.7",
    ] {
        assert!(
            names.contains(phase),
            "no `{phase}` in the timeline; names: {names:?}"
        );
    }
    // A fused group has one lane; unnamed operations share one lane per kind, not one per call.
    assert!(
        names.contains("grouped.0 .. grouped.4 (5 tensors)"),
        "{names:?}"
    );
    assert!(
        names.contains("barrier (unnamed)") && names.contains("allreduce (unnamed)"),
        "{names:?}"
    );
    assert!(!names.iter().any(|n| n.contains("noname")), "{names:?}");
    // Phases are complete events nested in their operation on the tensor's lane.
    let events = events.as_array().unwrap();
    let lane = events
        .iter()
        .find(|e| e["ph"] == "M" && e["args"]["name"] == "grad.7")
        .map(|e| e["tid"].clone())
        .expect("a lane for grad.7");
    let spans = |name: &str| -> Vec<(u64, u64)> {
        events
            .iter()
            .filter(|e| e["tid"] == lane && e["ph"] == "X" && e["name"] == name)
            .map(|e| {
                let ts = e["ts"].as_u64().unwrap();
                (ts, ts + e["dur"].as_u64().unwrap())
            })
            .collect()
    };
    let ops = spans("ALLREDUCE");
    let copies = spans("MEMCPY_IN_FUSION_BUFFER");
    assert!(!ops.is_empty() && !copies.is_empty(), "{ops:?} {copies:?}");
    for (start, end) in copies {
        assert!(
            ops.iter().any(|(s, e)| *s <= start && end <= *e),
            "MEMCPY_IN_FUSION_BUFFER {start}..{end} outside every ALLREDUCE of grad.7: {ops:?}"
        );
    }
}

#[test]
fn timelines_start_and_stop_at_run_time() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().to_str().unwrap();
    assert_all_ok(
        &run(2, "timeline_runtime.py", &[("HVD_TEST_OUT", out)]),
        "start_timeline / stop_timeline",
    );
}

#[test]
fn large_tensors_bypassing_the_fusion_buffer_are_reduced() {
    assert_all_ok(&run(2, "big.py", &[]), "large tensors");
}

/// `hvd.empty` arrays allreduced between 2 processes take the single copy over shared buffers (the debug log says
/// so on every rank), exactly, and are freed with their last view (shared_empty.py).
#[test]
fn shared_arrays_from_hvd_empty_are_read_by_peers_directly() {
    let results = run(2, "shared_empty.py", &[("HVD_LOG_LEVEL", "debug")]);
    assert_all_ok(&results, "hvd.empty");
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.stderr
                .contains("large allreduces read peers' shared buffers"),
            "rank {rank} did not take the single copy:\n{}",
            r.stderr
        );
    }
}

#[test]
fn dlpack_tensors_are_read_through_their_capsule() {
    assert_all_ok(&run(2, "dlpack.py", &[]), "dlpack");
}

#[test]
fn join_with_uneven_data_on_3_and_4_ranks() {
    for size in [3, 4] {
        assert_all_ok(&run(size, "join.py", &[]), &format!("join on {size} ranks"));
    }
}

#[test]
fn every_operation_runs_while_a_rank_has_joined() {
    for size in [2, 3] {
        assert_all_ok(
            &run(size, "join_ops.py", &[]),
            &format!("operations with a joined rank on {size} ranks"),
        );
    }
}

#[test]
fn mismatched_shapes_dtypes_and_roots_fail_on_every_rank() {
    assert_all_ok(&run(3, "mismatch.py", &[]), "mismatch");
}

#[test]
fn a_stalled_rank_is_named_by_the_stall_inspector() {
    let results = run(2, "stall.py", &[("HVD_STALL_CHECK_TIME", "1")]);
    assert_all_ok(&results, "stall");
    assert!(
        results[0]
            .stderr
            .contains("rank 1 has not submitted [late.tensor]"),
        "no stall warning naming rank 1 on rank 0:\n{}",
        results[0].stderr
    );
}

#[test]
fn the_stall_shutdown_time_turns_a_stall_into_errors_on_every_rank() {
    let results = run(
        2,
        "stall_shutdown.py",
        &[
            ("HVD_STALL_CHECK_TIME", "0.5"),
            ("HVD_STALL_SHUTDOWN_TIME", "1.5"),
        ],
    );
    for (rank, r) in results.iter().enumerate() {
        assert!(
            r.status.success() && r.stdout.contains(&format!("GOT_ERROR rank {rank}")),
            "rank {rank}: {}\n{}\n{}",
            r.status,
            r.stdout,
            r.stderr
        );
    }
    assert!(
        results[0].stdout.contains("HVD_STALL_SHUTDOWN_TIME"),
        "{}",
        results[0].stdout
    );
}

#[test]
fn a_killed_rank_turns_into_an_error_on_the_others() {
    let results = run(3, "killed.py", &[("HVD_COLLECTIVE_TIMEOUT", "10")]);
    assert!(!results[1].status.success(), "rank 1 was supposed to die");
    for rank in [0, 2] {
        let r = &results[rank];
        assert!(
            r.status.success() && r.stdout.contains("GOT_ERROR PeerLostError lost rank 1:"),
            "rank {rank}: {}\n{}\n{}",
            r.status,
            r.stdout,
            r.stderr
        );
        assert!(
            r.stdout.contains("LATER PeerLostError lost rank 1"),
            "rank {rank}'s later operation does not fail with the same lost peer: {}",
            r.stdout
        );
    }
}

#[test]
fn data_parallel_numpy_training_keeps_parameters_identical() {
    for size in [2, 4] {
        assert_all_ok(
            &run(size, "train.py", &[]),
            &format!("training on {size} ranks"),
        );
    }
}

/// The interpreter of an opt-in test, from `variable`; running the test without it set is an error, not a pass.
fn opt_in_python(variable: &str, what: &str) -> String {
    std::env::var(variable).unwrap_or_else(|_| {
        panic!("this opt-in test needs {what}: set {variable} to a python that has it (e.g. a venv's bin/python)")
    })
}

#[test]
#[ignore = "opt-in: needs torch; HVD_TEST_TORCH=/path/to/python"]
fn torch_distributed_optimizer_keeps_parameters_identical() {
    let python = opt_in_python("HVD_TEST_TORCH", "torch");
    assert_all_ok(
        &run_with(&python, 2, "torch_train.py", &[]),
        "hvd.torch on 2 ranks",
    );
    // The torch environment also has ml_dtypes: bfloat16 numpy arrays there too.
    assert_all_ok(
        &run_with(&python, 2, "bf16.py", &[]),
        "bf16 with torch's python",
    );
}

/// DistributedOptimizer without torch's post-accumulate-grad hooks (torch <= 2.0; hidden on a newer torch): the hooks
/// on the gradient accumulators submit each gradient during backward, step after step (`torch_accumulate_hook.py`).
#[test]
#[ignore = "opt-in: needs torch; HVD_TEST_TORCH=/path/to/python"]
fn torch_distributed_optimizer_works_without_post_accumulate_grad_hooks() {
    let python = opt_in_python("HVD_TEST_TORCH", "torch");
    assert_all_ok(
        &run_with(&python, 2, "torch_accumulate_hook.py", &[]),
        "accumulator hooks on 2 ranks",
    );
}

/// Horovod's torch API (`horovod.torch`, docs/horovod.md): alltoall's received splits, truncating integer scaling,
/// int16, grouped allgather and reducescatter, duplicate names (per process set), Adasum refused, gradients, three
/// init/shutdown rounds; on 2 and 3 ranks.
#[test]
#[ignore = "opt-in: needs torch; HVD_TEST_TORCH=/path/to/python"]
fn horovod_torch_collectives_behave_as_horovods() {
    let python = opt_in_python("HVD_TEST_TORCH", "torch");
    for size in [2, 3] {
        assert_all_ok(
            &run_with(&python, size, "horovod_torch.py", &[]),
            &format!("horovod.torch on {size} ranks"),
        );
    }
}

/// hvd.torch's DistributedOptimizer with sparse gradients (`torch_sparse.py`): allgathered or `sparse_as_dense`,
/// Average and Sum, a rank without a gradient, two passes, SparseAdam, refusals; `_parameter_names`; on 2 and 3 ranks.
#[test]
#[ignore = "opt-in: needs torch; HVD_TEST_TORCH=/path/to/python"]
fn torch_sparse_gradients_reduce_as_horovods() {
    let python = opt_in_python("HVD_TEST_TORCH", "torch");
    for size in [2, 3] {
        assert_all_ok(
            &run_with(&python, size, "torch_sparse.py", &[]),
            &format!("sparse gradients on {size} ranks"),
        );
    }
}

/// `SyncBatchNorm` (`torch_sync_batch_norm.py`): output, running statistics and gradients equal torch's BatchNorm
/// over every rank's batch (uneven and empty batches, 2-D to 4-D, no affine, cumulative average, eval, a process
/// set); on 2 and 3 ranks.
#[test]
#[ignore = "opt-in: needs torch; HVD_TEST_TORCH=/path/to/python"]
fn torch_sync_batch_norm_normalizes_over_every_ranks_batch() {
    let python = opt_in_python("HVD_TEST_TORCH", "torch");
    for size in [2, 3] {
        assert_all_ok(
            &run_with(&python, size, "torch_sync_batch_norm.py", &[]),
            &format!("SyncBatchNorm on {size} ranks"),
        );
    }
}

/// `hvd.torch.elastic.TorchState`'s checkpoints with real torch (`torch_checkpoint.py`, torch >= 2.6): a model and
/// an optimizer with momentum checkpointed, loaded on rank 0 into fresh ones and synced; a `torch.pt` that would run
/// code, a garbage one and another model's refused, all or nothing.
#[test]
#[ignore = "opt-in: needs torch; HVD_TEST_TORCH=/path/to/python"]
fn torch_state_checkpoints_load_into_a_fresh_model_and_refuse_hostile_files() {
    let python = opt_in_python("HVD_TEST_TORCH", "torch");
    let dir = tempfile::tempdir().unwrap();
    let checkpoints = dir.path().join("checkpoints");
    std::fs::create_dir(&checkpoints).unwrap();
    assert_all_ok(
        &run_with(
            &python,
            2,
            "torch_checkpoint.py",
            &[("HVD_CHECKPOINT_DIR", checkpoints.to_str().unwrap())],
        ),
        "TorchState checkpoints on 2 ranks",
    );
    let pwned = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("pwned")
        })
        .count();
    assert_eq!(pwned, 0, "the hostile torch.pt ran its code");
}

/// hvd.torch's per-tensor allreduces through the package's batch, as numpy arrays go (`torch_batched.py`):
/// `allreduce_async_`, small `allreduce_async` and DistributedOptimizer's gradient hooks submit without a library call
/// per tensor, with results equal to the call per tensor's (many dtypes, shapes and ops), in place; what the batch does
/// not take keeps the call per tensor; a tensor dropped, or given other memory with `set_`, while its operation is in
/// flight keeps its memory until the operation completes, also across `shutdown()`/`init()`; 2000 raising signal
/// handlers during submissions leave no lock held. On 2 and 3 ranks, with the batch timer off (every operation
/// completes through the sends of waits, polls and submissions), fusion off and tcp.
#[test]
#[ignore = "opt-in: needs torch; HVD_TEST_TORCH=/path/to/python"]
fn torch_per_tensor_allreduces_go_through_the_batch() {
    let python = opt_in_python("HVD_TEST_TORCH", "torch");
    for (size, extra) in [
        (2, None),
        (2, Some(("HVD_BATCHED_TIMER", "off"))),
        (3, Some(("HVD_FUSION_THRESHOLD", "0"))),
        (3, Some(("HVD_COLLECTIVE_BACKEND", "tcp"))),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let mut env = vec![("HVD_BATCHED_DIR", dir.path().to_str().unwrap())];
        env.extend(extra);
        assert_all_ok(
            &run_with(&python, size, "torch_batched.py", &env),
            &format!("torch batched, {size} ranks, {extra:?}"),
        );
    }
}

/// The framework-free part of `KerasState`'s and `TensorFlowState`'s checkpoints (`checkpoint_variables.py`): variable
/// values in `model.npz`-style files come back only when they fit the state's variables; pickled, compressed, foreign
/// and gapped archives are refused without running anything; an altered `model.npz` is skipped for an older checkpoint.
#[test]
fn variable_checkpoint_files_load_only_when_they_fit_the_state() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoints = dir.path().join("checkpoints");
    std::fs::create_dir(&checkpoints).unwrap();
    assert_all_ok(
        &run(
            1,
            "checkpoint_variables.py",
            &[("HVD_CHECKPOINT_DIR", checkpoints.to_str().unwrap())],
        ),
        "variable checkpoint files",
    );
    let pwned = std::fs::read_dir(dir.path())
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("pwned")
        })
        .count();
    assert_eq!(pwned, 0, "the pickled object array ran its code");
}

/// The major version of the Keras that `python`'s `tf.keras` is (2, or 3 on TensorFlow >= 2.16 without
/// `TF_USE_LEGACY_KERAS`).
fn tf_keras_major(python: &str) -> u32 {
    let out = Command::new(python)
        .args([
            "-c",
            "import tensorflow as tf; print(tf.keras.__version__.split('.')[0])",
        ])
        .env("TF_CPP_MIN_LOG_LEVEL", "2")
        .env("CUDA_VISIBLE_DEVICES", "")
        .stdin(Stdio::null())
        .output()
        .expect("run the tensorflow python");
    let stdout = String::from_utf8_lossy(&out.stdout);
    match stdout.trim() {
        "2" => 2,
        "3" => 3,
        other => panic!(
            "{python}: tf.keras is neither Keras 2 nor 3 ({other:?}, {}):\n{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// `KerasState.checkpoint()` across a killed job (`keras_checkpoint.py`), with Adam, with SGD with momentum and, on
/// Keras 2, with a legacy SGD with momentum (Keras 3 has no legacy optimizers): the first job checkpoints at commit
/// 3, trains on and is killed (SIGKILL, every rank); a second job with fresh models resumes through
/// `hvd.elastic.run` with the checkpoint's weights and optimizer variables exactly, and training on gives the first
/// job's weights. `TensorFlowState`'s checkpoints too.
#[test]
#[ignore = "opt-in: needs tensorflow; HVD_TEST_TENSORFLOW=/path/to/python"]
fn keras_state_checkpoints_resume_a_killed_job_with_equal_weights() {
    use std::os::unix::process::ExitStatusExt;

    let python = opt_in_python("HVD_TEST_TENSORFLOW", "tensorflow");
    let optimizers: &[&str] = match tf_keras_major(&python) {
        2 => &["adam", "sgd", "legacy"],
        _ => &["adam", "sgd"],
    };
    for &optimizer in optimizers {
        let dir = tempfile::tempdir().unwrap();
        let checkpoints = dir.path().join("checkpoints");
        let expect = dir.path().join("expect.npz");
        let env = |phase| {
            vec![
                (
                    "HVD_CHECKPOINT_DIR",
                    checkpoints.to_str().unwrap().to_string(),
                ),
                ("HVD_TEST_EXPECT", expect.to_str().unwrap().to_string()),
                ("HVD_TEST_PHASE", String::from(phase)),
                ("HVD_TEST_OPTIMIZER", optimizer.to_string()),
                ("TF_CPP_MIN_LOG_LEVEL", "2".to_string()),
                ("CUDA_VISIBLE_DEVICES", String::new()),
            ]
        };
        let first = env("first");
        let first: Vec<(&str, &str)> = first.iter().map(|(k, v)| (*k, v.as_str())).collect();
        for (rank, r) in run_with(&python, 2, "keras_checkpoint.py", &first)
            .iter()
            .enumerate()
        {
            assert_eq!(
                r.status.signal(),
                Some(9),
                "{optimizer}: rank {rank} of the first job was not killed as planned ({}):\n{}\n{}",
                r.status,
                r.stdout,
                r.stderr
            );
        }
        let ckpt = checkpoints.join("ckpt-000000000003");
        for file in ["MANIFEST.json", "model.npz", "optimizer.npz", "state.json"] {
            assert!(
                ckpt.join(file).is_file(),
                "{optimizer}: the first job left no {}",
                ckpt.join(file).display()
            );
        }
        let resume = env("resume");
        let resume: Vec<(&str, &str)> = resume.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let results = run_with(&python, 2, "keras_checkpoint.py", &resume);
        assert_all_ok(&results, &format!("{optimizer}: the resumed job"));
        assert!(
            results[0]
                .stderr
                .contains("resumed from checkpoint at commit 3"),
            "{optimizer}: rank 0 did not say it resumed: {}",
            results[0].stderr
        );
    }
}

#[test]
#[ignore = "opt-in: needs jax; HVD_TEST_JAX=/path/to/python"]
fn jax_pytrees_train_with_identical_parameters() {
    let python = opt_in_python("HVD_TEST_JAX", "jax");
    assert_all_ok(
        &run_with(&python, 2, "jax_train.py", &[]),
        "hvd.jax on 2 ranks",
    );
}

#[test]
#[ignore = "opt-in: needs tensorflow; HVD_TEST_TENSORFLOW=/path/to/python"]
fn tensorflow_gradient_tape_trains_with_identical_variables() {
    let python = opt_in_python("HVD_TEST_TENSORFLOW", "tensorflow");
    assert_all_ok(
        &run_with(
            &python,
            2,
            "tf_train.py",
            &[("TF_CPP_MIN_LOG_LEVEL", "2"), ("CUDA_VISIBLE_DEVICES", "")],
        ),
        "hvd.tensorflow on 2 ranks",
    );
}

/// Horovod's Keras API (`horovod.tensorflow.keras`, docs/horovod.md "Keras"): collectives of Keras values, the
/// DistributedOptimizer's reduced gradients (dense, sparse, fp16, predivide, Sum), `model.fit` with the callbacks and
/// local aggregation leaving every rank the same weights, `load_model`, `KerasState`. Keras 2 or 3.
#[test]
#[ignore = "opt-in: needs tensorflow; HVD_TEST_TENSORFLOW=/path/to/python"]
fn horovod_keras_trains_with_identical_weights() {
    let python = opt_in_python("HVD_TEST_TENSORFLOW", "tensorflow");
    assert_all_ok(
        &run_with(
            &python,
            2,
            "keras_train.py",
            &[("TF_CPP_MIN_LOG_LEVEL", "2"), ("CUDA_VISIBLE_DEVICES", "")],
        ),
        "horovod.tensorflow.keras on 2 ranks",
    );
}

/// The numpy side of hvd.tensorflow's ops (no framework): Horovod's dtypes (int16, uint16, bool) through every op,
/// 16-bit sums that wrap, integer averages and scale factors that truncate, mixed-dtype lists, received splits,
/// reducescatter blocks, and bad requests refused alike on every rank.
#[test]
fn tensorflow_numpy_side_keeps_horovods_dtypes_and_integer_semantics() {
    assert_all_ok(&run(2, "tf_numpy.py", &[]), "hvd._tf_numpy on 2 ranks");
}

#[test]
#[ignore = "opt-in: needs tensorflow; HVD_TEST_TENSORFLOW=/path/to/python"]
fn tensorflow_collectives_in_graph_mode_and_eager() {
    let python = opt_in_python("HVD_TEST_TENSORFLOW", "tensorflow");
    assert_all_ok(
        &run_with(
            &python,
            2,
            "tf_graph.py",
            &[("TF_CPP_MIN_LOG_LEVEL", "2"), ("CUDA_VISIBLE_DEVICES", "")],
        ),
        "hvd.tensorflow graph mode on 2 ranks",
    );
}

/// Horovod's build and job introspection answers what this runtime is: the compiled backends (also before init),
/// no Gloo/CUDA/ROCm/DDL/oneCCL, MPI not enabled over shm/tcp/hierarchical (and mpi_threads_supported refusing,
/// as Horovod does), and is_homogeneous from every rank's local size: 2 ranks on one host, 2 hosts of 1, and
/// hosts of 1 + 2 ranks (where the host of 2 cannot tell on its own).
#[test]
fn build_and_job_introspection_answers_what_the_runtime_is() {
    let built = |b: bool| if b { "1" } else { "0" };
    let mpi = built(hvd_collective::BUILT_WITH_MPI);
    let nccl = built(hvd_collective::BUILT_WITH_NCCL);
    for (size, hosts, homogeneous) in [(2, "", "1"), (2, "a,b", "1"), (3, "a,b,b", "0")] {
        let mut env = vec![
            ("HVD_TEST_MPI_BUILT", mpi),
            ("HVD_TEST_NCCL_BUILT", nccl),
            ("HVD_TEST_HOMOGENEOUS", homogeneous),
        ];
        if !hosts.is_empty() {
            env.push(("HVD_TEST_HOSTS", hosts));
        }
        assert_all_ok(
            &run(size, "introspection.py", &env),
            &format!("introspection on hosts {hosts:?}"),
        );
    }
}

/// Horovod's test suites call `hvd.init()` in setUp and `hvd.shutdown()` in tearDown around every test, one process
/// per rank: five rounds of init, allreduce, shutdown in the same processes must each join a fresh job, on 2 and 3
/// ranks, over shm and over tcp (each round meets under its own rendezvous keys, never an earlier round's address or
/// segment).
#[test]
fn init_after_shutdown_joins_again_five_times_over_shm_and_tcp() {
    for size in [2, 3] {
        for backend in ["shm", "tcp"] {
            assert_all_ok(
                &run(size, "reinit.py", &[("HVD_COLLECTIVE_BACKEND", backend)]),
                &format!("five init/shutdown rounds of {size} ranks over {backend}"),
            );
        }
    }
}

/// Per-tensor `allreduce_async_` of numpy arrays goes through the package's batch (`hvd/_batch.py`): many tensors
/// submitted and waited in orders of each rank's own, batches sent at different points by different ranks, an
/// operation another rank blocks on while this one blocks in an operation outside the batch, polled handles,
/// errors that reach their own tensor's handle, dropped handles. Without the timer every case must complete through
/// the sends that waits, polls and other submissions make; with it, a lone operation must complete while its rank
/// waits outside hvd.
#[test]
fn batched_per_tensor_allreduces_complete_wherever_each_rank_sends_its_batch() {
    for (size, timer, extra) in [
        (2, "on", None),
        (3, "on", Some(("HVD_FUSION_THRESHOLD", "0"))),
        (2, "off", None),
        (3, "off", Some(("HVD_COLLECTIVE_BACKEND", "tcp"))),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let dir_text = dir.path().to_str().unwrap();
        let mut env = vec![("HVD_BATCHED_TIMER", timer), ("HVD_BATCHED_DIR", dir_text)];
        env.extend(extra);
        assert_all_ok(
            &run(size, "batched.py", &env),
            &format!("batched, {size} ranks, timer {timer}, {extra:?}"),
        );
    }
}

/// Process sets on 4 ranks (`process_sets.py`), over shm and tcp: sets {0,1} and {1,2,3} (rank 1 in both, one thread
/// each) allreduce, allgather, broadcast, alltoall, reducescatter and barrier at the same time with different
/// values, each member getting its set's result; non-members, roots outside the set, duplicate, outside and
/// existing sets refused with a ValueError; a mismatch in one set fails there alone; remove, re-add, and sets again
/// after shutdown and init.
#[test]
fn process_sets_run_their_collectives_among_their_members() {
    for backend in ["shm", "tcp"] {
        assert_all_ok(
            &run(4, "process_sets.py", &[("HVD_COLLECTIVE_BACKEND", backend)]),
            &format!("process sets over {backend}"),
        );
    }
}
