//! The note an MPIJob worker's init container leaves in its pod's store volume when it could not get the env
//! (`hvd worker-env --once --pull ENV --pull-failure-note`, `<store>/.hvd-pull-failed`) and the ranks' shims that
//! refuse with it (`hvd worker-env --pull ENV --pull-failure-note -- CMD`), run directly (no mpirun): the volume is
//! the pod's, but what is in it is read as hostile text, and a reused volume's old note must not block a pull that
//! works.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{HVD, text};

const NOTE: &str = ".hvd-pull-failed";
/// What the init container writes as the note's first line (its pod, the env).
const HEAD: &str = "node `app-train-worker-1` could not get the env";

/// A store directory under `dir` and an env's store path in it (not there: the shim refuses before any pull).
fn store_and_env(dir: &Path) -> (PathBuf, PathBuf) {
    let store = dir.join("store");
    std::fs::create_dir_all(&store).unwrap();
    let env = store.join("0123456789abcdef0123456789abcdef-app-env-1.0");
    (store, env)
}

/// Runs `hvd ARGS`; a run that has not ended after a minute (a shim blocked on the note) is killed and fails the
/// test instead of hanging it.
fn hvd_bounded(args: &[&str], vars: &[(&str, &str)]) -> Output {
    let mut child = Command::new(HVD)
        .args(args)
        .envs(vars.iter().copied())
        .env("HOSTNAME", "app-train-worker-1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(60) {
            child.kill().unwrap();
            let out = child.wait_with_output().unwrap();
            panic!("hvd {args:?} hangs: {}", text(&out).1);
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

/// A rank's shim for `env` (no cache is reached: it refuses first where there is a note).
fn shim(env: &Path) -> Output {
    let env = env.display().to_string();
    hvd_bounded(
        &[
            "worker-env",
            "--pull",
            &env,
            "--cache",
            "file:///nowhere",
            "--trusted-key",
            "k:AAAA",
            "--pull-failure-note",
            "--",
            "true",
        ],
        &[],
    )
}

/// `out` failed, saying that the init container could not get `env`, and `why`.
fn assert_refused(out: &Output, env: &Path, why: &str) -> String {
    let (stdout, stderr) = text(out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let words = common::unwrapped(&stderr);
    for part in [
        format!(
            "this pod's init container could not get the env {}",
            env.display()
        ),
        why.to_owned(),
    ] {
        assert!(
            words.contains(&common::unwrapped(&part)),
            "{part}: {stderr}"
        );
    }
    stderr
}

/// A note with terminal controls (ESC, CR, a C1 CSI) is shown with each replaced: what a worker pod's volume holds
/// cannot drive the terminal of whoever reads the launcher's log.
#[test]
fn a_notes_control_characters_are_replaced() {
    let dir = tempfile::tempdir().unwrap();
    let (store, env) = store_and_env(dir.path());
    std::fs::write(
        store.join(NOTE),
        format!("{HEAD} x\n\u{1b}[2Jcleared\rover\u{9b}31mred\u{7}"),
    )
    .unwrap();
    let stderr = assert_refused(&shim(&env), &env, "?[2Jcleared?over?31mred?");
    assert!(
        !stderr.contains(['\u{1b}', '\r', '\u{9b}', '\u{7}']),
        "{stderr:?}"
    );
    assert!(
        common::unwrapped(&stderr).contains(&common::unwrapped(HEAD)),
        "{stderr}"
    );
}

/// A note that is not a plain file is refused as such, and nothing behind it is read or waited for: a link (to a
/// file whose text must not appear), a FIFO with no writer (opening or reading it must not block the shim) and a
/// directory.
#[test]
fn a_note_that_is_a_link_a_fifo_or_a_directory_is_refused_without_reading_it() {
    let dir = tempfile::tempdir().unwrap();
    let (store, env) = store_and_env(dir.path());
    let note = store.join(NOTE);
    let secret = dir.path().join("secret");
    std::fs::write(&secret, "the secret text").unwrap();
    std::os::unix::fs::symlink(&secret, &note).unwrap();
    let stderr = assert_refused(&shim(&env), &env, "the note is a symbolic link, not a file");
    assert!(!stderr.contains("secret text"), "{stderr}");

    std::fs::remove_file(&note).unwrap();
    let made = Command::new("mkfifo").arg(&note).status().unwrap();
    assert!(made.success());
    assert_refused(&shim(&env), &env, "the note is not a file");

    std::fs::remove_file(&note).unwrap();
    std::fs::create_dir(&note).unwrap();
    assert_refused(&shim(&env), &env, "the note is not a file");
}

/// A note larger than the 8 KiB a shim reads: its opening line (which pod, which env) is still shown, the rest cut.
#[test]
fn a_note_over_the_limit_is_cut_keeping_its_first_line() {
    let dir = tempfile::tempdir().unwrap();
    let (store, env) = store_and_env(dir.path());
    let body = "hvd cache pull: a line of its output\n".repeat(1000);
    std::fs::write(store.join(NOTE), format!("{HEAD} x\n{body}THE-LAST-LINE\n")).unwrap();
    let stderr = assert_refused(&shim(&env), &env, HEAD);
    assert!(
        !common::unwrapped(&stderr).contains("THE-LAST-LINE"),
        "not cut"
    );
    assert!(stderr.len() < 16 * 1024, "{} bytes", stderr.len());
}

/// An init container whose store holds a directory where the note goes: it cannot clear or write the note, so it
/// fails (as a pull without a note does) naming the path, and leaves no temporary file behind.
#[test]
fn an_init_container_that_cannot_write_its_note_fails_and_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let (store, env) = store_and_env(dir.path());
    std::fs::create_dir(store.join(NOTE)).unwrap();
    std::fs::write(store.join(NOTE).join("inside"), "x").unwrap();
    let env_arg = env.display().to_string();
    let out = hvd_bounded(
        &[
            "worker-env",
            "--once",
            "--pull",
            &env_arg,
            "--cache",
            "file:///nowhere",
            "--trusted-key",
            "k:AAAA",
            "--pull-failure-note",
        ],
        &[],
    );
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stdout}\n{stderr}");
    let words = common::unwrapped(&stderr);
    assert!(
        words.contains(&common::unwrapped(&format!(
            "writing {}",
            store.join(NOTE).display()
        ))),
        "{stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(&store)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{NOTE}.")))
        .collect();
    assert!(left.is_empty(), "{left:?}");
}

/// A reused store volume (a hostPath, a re-run init container) with an earlier init container's note: a pull that
/// works now removes it, so the ranks' shims start instead of refusing with the old reason.
#[test]
fn a_stale_note_is_removed_by_an_init_pull_that_works() {
    let root = tempfile::tempdir().unwrap();
    let outside = tempfile::tempdir().unwrap();
    let p = common::pushed_fixture_env(root.path(), &outside.path().join("cache"), "");
    // The pod's store is empty (the built one moved aside), at the same directory, with an old note in it.
    let store = p.env.parent().unwrap().to_path_buf();
    std::fs::rename(&store, root.path().join("built-store")).unwrap();
    std::fs::create_dir_all(&store).unwrap();
    std::fs::write(store.join(NOTE), format!("{HEAD} (an earlier pod)\n")).unwrap();
    let key = std::fs::read_to_string(&p.public_key).unwrap();
    let (env, cache) = (
        p.env.display().to_string(),
        format!("file://{}", p.cache.display()),
    );
    let pull = |extra: &[&str]| {
        let args = [
            &[
                "worker-env",
                "--once",
                "--pull",
                &env,
                "--cache",
                &cache,
                "--trusted-key",
                key.trim(),
                "--pull-failure-note",
            ][..],
            extra,
        ]
        .concat();
        hvd_bounded(&args, &[("HVD_STORE", &store.display().to_string())])
    };
    let out = pull(&[]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(p.env.join("bin/python").exists(), "not pulled: {stderr}");
    assert!(!store.join(NOTE).exists(), "the old note is still there");
    // A rank's shim (a step that runs once) starts its command.
    let out = pull(&["--", "sh", "-c", "echo started"]);
    let (stdout, stderr) = text(&out);
    assert!(
        out.status.success() && stdout.contains("started"),
        "{stdout}\n{stderr}"
    );
}
