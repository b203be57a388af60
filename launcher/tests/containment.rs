//! Process containment, acting as a job that tries to outlive its step and its launcher: `setsid` daemons,
//! children started with a cleared environment (`env -i`), double forks. Real processes, found in `/proc`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use hvd_lang::model::{Project, Step};
use hvd_launcher::{Interrupts, RunOptions, execute, plan};

mod common;

fn project(dir: &Path, run: &str) -> Project {
    common::project(dir, "containment", vec![common::step("escape", run)])
}

/// Steps `(name, run, needs)`, each with `ESCAPE_TAG` set to `tag` in its environment.
fn project_of(dir: &Path, tag: &str, steps: &[(&str, &str, &[&str])]) -> Project {
    let mut project = project(dir, "");
    project.steps = steps
        .iter()
        .map(|(name, run, needs)| Step {
            needs: needs.iter().map(|n| (*n).to_string()).collect(),
            env: BTreeMap::from([("ESCAPE_TAG".to_string(), tag.to_string())]),
            ..common::step(name, run)
        })
        .collect();
    project
}

fn run_project(project: &Project) {
    let options = RunOptions {
        grace: Duration::from_secs(2),
        ..RunOptions::default()
    };
    let plan = plan(project, &options).unwrap();
    let report = execute(&plan, &options, &|_| {}, Interrupts::none()).unwrap();
    assert!(report.failure.is_none(), "{:?}", report.failure);
}

/// A step that starts escapees whose command lines hold `tag` (a fractional `sleep` duration nobody else uses),
/// touches `ready`, and (with `linger`) stays until killed.
fn escaping_step(tag: &str, ready: &Path, linger: bool) -> String {
    format!(
        "setsid sleep {tag} >/dev/null 2>&1 & \
         env -i /bin/sh -c 'sleep {tag}; :' >/dev/null 2>&1 & \
         setsid env -i /bin/sh -c '(sleep {tag} &) ; sleep {tag}' >/dev/null 2>&1 & \
         sleep 0.3; touch '{ready}'; {rest}",
        ready = ready.display(),
        rest = if linger { "sleep 300" } else { "echo started" }
    )
}

/// Pids whose command line contains `tag`.
fn holders(tag: &str) -> Vec<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
        .filter_map(|e| {
            let pid: u32 = e.file_name().to_string_lossy().parse().ok()?;
            let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
            let text = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            // A zombie has an empty command line and is already dead.
            text.contains(tag).then_some(pid)
        })
        .collect()
}

/// Pids of `sleep <tag>` processes (not the step's shell, whose command line holds the tag too).
fn sleepers(tag: &str) -> Vec<u32> {
    holders(tag)
        .into_iter()
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/cmdline"))
                .is_ok_and(|c| c.starts_with(format!("sleep\0{tag}").as_bytes()))
        })
        .collect()
}

fn wait_gone(tag: &str, within: Duration) -> Vec<u32> {
    let deadline = Instant::now() + within;
    loop {
        let left = holders(tag);
        if left.is_empty() || Instant::now() > deadline {
            return left;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn wait_for(path: &Path) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while !path.exists() {
        assert!(
            Instant::now() < deadline,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// The tests run one at a time: a launcher start cleans the groups of dead launchers, which would race with a
/// test that wants to see them first.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// This test binary running only the hidden test `name` (which runs the launcher), with `var` naming `dir`.
fn helper(name: &str, var: &str, dir: &Path) -> Command {
    let mut command = Command::new(std::env::current_exe().unwrap());
    command.args(["--exact", name, "--nocapture"]).env(var, dir);
    command
}

/// Kills whatever still holds `tag` once the launcher that gave `output` is gone (so a failing assertion leaks
/// nothing), asserts that the launcher succeeded, and returns the pids that were left.
fn leftovers_of_success(tag: &str, output: &std::process::Output) -> Vec<u32> {
    let after = holders(tag);
    for pid in &after {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    assert!(
        output.status.success(),
        "the launcher failed: {}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    after
}

fn unique_tag(n: u32) -> String {
    // `sleep` takes fractional seconds: 3000.<pid><n> is a duration no other process uses.
    format!("3000.{}{n}", std::process::id())
}

fn cgroups_here() -> bool {
    hvd_launcher::process::RunCgroup::create().is_ok()
}

#[test]
fn escapees_with_a_cleared_environment_end_with_the_step() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let tag = unique_tag(1);
    let ready = dir.path().join("ready");
    run_project(&project(dir.path(), &escaping_step(&tag, &ready, false)));
    assert!(ready.exists());
    // With cgroups where this machine has them, else the subreaper fallback.
    let left = wait_gone(&tag, Duration::from_secs(1));
    for pid in &left {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    assert_eq!(left, Vec::<u32>::new(), "escaped processes left running");
}

/// Runs only when re-executed by the SIGKILL tests: a launcher whose step starts escapees and lingers.
#[test]
fn launcher_helper() {
    let Some(dir) = std::env::var_os("HVD_TEST_CONTAIN_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let tag = std::fs::read_to_string(dir.join("tag")).unwrap();
    run_project(&project(
        &dir,
        &escaping_step(&tag, &dir.join("ready"), true),
    ));
}

fn start_helper(dir: &Path, tag: &str) -> std::process::Child {
    use std::os::unix::process::CommandExt;
    std::fs::write(dir.join("tag"), tag).unwrap();
    let child = helper("launcher_helper", "HVD_TEST_CONTAIN_DIR", dir)
        // Its own process group: the SIGKILL tests can kill the launcher together with its watchdog.
        .process_group(0)
        .spawn()
        .unwrap();
    wait_for(&dir.join("ready"));
    child
}

#[test]
fn a_sigkilled_launcher_takes_every_escapee_with_it() {
    let _serial = serial();
    if !cgroups_here() {
        eprintln!(
            "no cgroups here; without them escapees outlive a SIGKILLed launcher (documented)"
        );
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let tag = unique_tag(2);
    let mut launcher = start_helper(dir.path(), &tag);
    assert!(holders(&tag).len() >= 4, "{:?}", holders(&tag));
    launcher.kill().unwrap(); // SIGKILL: no cleanup code of the launcher runs
    launcher.wait().unwrap();
    let left = wait_gone(&tag, Duration::from_secs(5));
    assert_eq!(left, Vec::<u32>::new(), "escapees outlived the launcher");
}

#[test]
fn escapees_of_a_launcher_killed_with_its_watchdog_end_at_the_next_start() {
    let _serial = serial();
    if !cgroups_here() {
        eprintln!("no cgroups here; skipping");
        return;
    }
    // Every launcher start ends the runs its dead predecessors left in its own cgroup's parent: a launcher that
    // another test starts meanwhile would end these escapees before the start below could show that it does.
    let _private = PrivateCgroup::enter();
    let dir = tempfile::tempdir().unwrap();
    let tag = unique_tag(3);
    let mut launcher = start_helper(dir.path(), &tag);
    let group = launcher.id() as i32;
    // SIGKILL to the launcher's whole process group: the launcher and its watchdog die at once.
    assert_eq!(kill_group(group), 0);
    launcher.wait().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let survivors = holders(&tag);
    assert!(
        !survivors.is_empty(),
        "expected the setsid escapees to survive until the next start"
    );
    // The next launcher start cleans up what its dead predecessor left.
    let _next = hvd_launcher::process::RunCgroup::create().unwrap();
    let left = wait_gone(&tag, Duration::from_secs(5));
    assert_eq!(
        left,
        Vec::<u32>::new(),
        "the next start left escapees running"
    );
}

/// This test process in a cgroup of its own below the one it was in (launchers started here, and the helper
/// launcher it starts, then sweep only that one); moved back and removed on drop.
struct PrivateCgroup {
    own: PathBuf,
    private: PathBuf,
}

impl PrivateCgroup {
    fn enter() -> PrivateCgroup {
        let own = hvd_launcher::process::own_cgroup_v2().unwrap();
        let private = own.join(format!("hvd-test-private-{}", std::process::id()));
        std::fs::create_dir(&private).unwrap();
        std::fs::write(private.join("cgroup.procs"), std::process::id().to_string()).unwrap();
        PrivateCgroup { own, private }
    }
}

impl Drop for PrivateCgroup {
    fn drop(&mut self) {
        let _ = std::fs::write(
            self.own.join("cgroup.procs"),
            std::process::id().to_string(),
        );
        let _ = std::fs::remove_dir(&self.private);
    }
}

fn kill_group(pgid: i32) -> i32 {
    Command::new("kill")
        .args(["-9", "--", &format!("-{pgid}")])
        .status()
        .map(|s| if s.success() { 0 } else { 1 })
        .unwrap_or(1)
}

/// Runs only when re-executed by `the_watchdog_tracks_more_than_4096_groups`: watches 5000 group ids that can never
/// exist (above `pid_max`), then a real group, and waits to be killed.
#[test]
fn watchdog_helper() {
    use std::os::unix::process::CommandExt;
    let Some(dir) = std::env::var_os("HVD_TEST_WATCHDOG_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let pid_max: i64 = std::fs::read_to_string("/proc/sys/kernel/pid_max")
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let watchdog = hvd_launcher::process::Watchdog::start().unwrap();
    for i in 0..5000 {
        watchdog.watch(u32::try_from(pid_max + 1 + i).unwrap());
    }
    let victim = Command::new("sleep")
        .arg("300")
        .process_group(0)
        .spawn()
        .unwrap();
    watchdog.watch(victim.id());
    std::fs::write(dir.join("victim.part"), victim.id().to_string()).unwrap();
    std::fs::rename(dir.join("victim.part"), dir.join("victim")).unwrap();
    std::thread::sleep(Duration::from_secs(300));
    // Not reached: the test kills this process (and the watchdog then `victim`).
    let mut victim = victim;
    let _ = victim.kill();
    let _ = victim.wait();
}

fn alive(pid: u32) -> bool {
    // A zombie (killed, not yet reaped by whoever adopted it) counts as dead.
    std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|stat| {
            stat.rsplit_once(')')
                .map(|(_, rest)| !rest.trim_start().starts_with('Z'))
        })
        .unwrap_or(false)
}

#[test]
fn the_watchdog_tracks_more_than_4096_groups() {
    let dir = tempfile::tempdir().unwrap();
    let mut launcher = helper("watchdog_helper", "HVD_TEST_WATCHDOG_DIR", dir.path())
        .spawn()
        .unwrap();
    let file = dir.path().join("victim");
    wait_for(&file);
    std::thread::sleep(Duration::from_millis(100));
    let victim: u32 = std::fs::read_to_string(&file).unwrap().parse().unwrap();
    assert!(alive(victim));
    launcher.kill().unwrap();
    launcher.wait().unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while alive(victim) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    let survived = alive(victim);
    if survived {
        let _ = Command::new("kill")
            .args(["-9", &victim.to_string()])
            .status();
    }
    assert!(!survived, "the 5001st watched group outlived the launcher");
}

/// A shell loop writing to `file` every process (pid and command line) running `sleep $ESCAPE_TAG`; its own
/// command line holds the variable's name, not its value, so it never lists itself.
fn list_escapees(file: &str) -> String {
    format!(
        "for p in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); \
         case \"$c\" in *\"sleep $ESCAPE_TAG\"*) echo \"${{p#/proc/}} $c\";; esac; done > {file}"
    )
}

/// Runs only when re-executed by the fallback tests, with `HVD_CGROUPS=off`: a run whose step `escape` starts the
/// escapee written in `escape` and ends; then step `check` lists what of it is left.
#[test]
fn fallback_helper() {
    let Some(dir) = std::env::var_os("HVD_TEST_FALLBACK_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let tag = std::fs::read_to_string(dir.join("tag")).unwrap();
    let escape = std::fs::read_to_string(dir.join("escape")).unwrap();
    let started = dir.join("started");
    let left = dir.join("left");
    let escape = format!(
        "{escape} sleep 0.3; {}",
        list_escapees(&format!("'{}'", started.display()))
    );
    let check = list_escapees(&format!("'{}'", left.display()));
    run_project(&project_of(
        &dir,
        &tag,
        &[("escape", &escape, &[]), ("check", &check, &["escape"])],
    ));
}

/// Runs `escape` (shell, started in the background by the step, which then ends) in a launcher without cgroups,
/// and asserts that the escapee ran and had ended before the next step started.
fn escapee_ends_with_its_step_without_cgroups(escape: &str, n: u32) {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let tag = unique_tag(n);
    std::fs::write(dir.path().join("tag"), &tag).unwrap();
    std::fs::write(dir.path().join("escape"), escape.replace("TAG", &tag)).unwrap();
    let output = helper("fallback_helper", "HVD_TEST_FALLBACK_DIR", dir.path())
        .env("HVD_CGROUPS", "off")
        .output()
        .unwrap();
    // Whatever is left after the launcher is gone is cleaned up before asserting, so a failure leaks nothing.
    let after = leftovers_of_success(&tag, &output);
    let started = std::fs::read_to_string(dir.path().join("started")).unwrap();
    let left = std::fs::read_to_string(dir.path().join("left")).unwrap();
    // The step's own shell is listed too (its command line holds the tag): a `sleep` must be.
    assert!(
        started.lines().any(|l| l
            .split_once(' ')
            .is_some_and(|(_, c)| c.starts_with("sleep "))),
        "the escapee never ran: `{escape}` ({started})"
    );
    assert_eq!(
        left.trim(),
        "",
        "escapees of step `escape` still ran when the next step started (ran: {started})"
    );
    assert_eq!(after, Vec::<u32>::new(), "escapees outlived the run");
}

/// A `setsid` daemon: a new session, re-parented to the launcher when its worker exits.
#[test]
fn without_cgroups_a_setsid_escapee_ends_with_its_step() {
    escapee_ends_with_its_step_without_cgroups("setsid sleep TAG >/dev/null 2>&1 &", 11);
}

/// A child with a cleared environment (no `HVD_RUN_STEP`) that leaves its worker's process group (bash job
/// control puts it in a group of its own) and is orphaned when its shell exits.
#[test]
fn without_cgroups_an_env_i_escapee_ends_with_its_step() {
    escapee_ends_with_its_step_without_cgroups(
        "env -i /bin/bash -c 'set -m; sleep TAG >/dev/null 2>&1 &' >/dev/null 2>&1 &",
        12,
    );
}

/// Both: a new session and a cleared environment, double-forked so it is an orphan with no marker at all; and its
/// parent shell keeps a child of its own, found only through the ppid chain.
#[test]
fn without_cgroups_a_setsid_env_i_double_forked_escapee_ends_with_its_step() {
    escapee_ends_with_its_step_without_cgroups(
        "setsid env -i /bin/sh -c '(sleep TAG &); sleep TAG' >/dev/null 2>&1 &",
        13,
    );
}

/// Runs only when re-executed by `without_cgroups_a_sigkilled_launchers_watchdog_kills_what_it_can_find`: a launcher
/// (`HVD_CGROUPS=off`) whose step starts three escapees, touches `ready` and lingers.
#[test]
fn fallback_launcher_helper() {
    let Some(dir) = std::env::var_os("HVD_TEST_FALLBACK_KILL_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let tag = std::fs::read_to_string(dir.join("tag")).unwrap();
    let run = format!(
        "setsid sleep {tag}1 >/dev/null 2>&1 & \
         env -i /bin/bash -c 'set -m; sleep {tag}2 >/dev/null 2>&1 &' >/dev/null 2>&1 & \
         setsid env -i /bin/sh -c '(sleep {tag}3 &)' >/dev/null 2>&1 & \
         sleep 0.3; touch '{ready}'; sleep 300",
        ready = dir.join("ready").display()
    );
    run_project(&project(&dir, &run));
}

/// Without cgroups, a launcher killed with SIGKILL: its watchdog kills the workers' groups, what stayed in a
/// worker's session (here a bash job-control group with a cleared environment) and what carries the run's step
/// marker (a `setsid` daemon). A process that both left the session and cleared its environment is out of its reach
/// (documented in docs/running.md); it is cleaned up here.
#[test]
fn without_cgroups_a_sigkilled_launchers_watchdog_kills_what_it_can_find() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let tag = unique_tag(21);
    std::fs::write(dir.path().join("tag"), &tag).unwrap();
    let mut launcher = helper(
        "fallback_launcher_helper",
        "HVD_TEST_FALLBACK_KILL_DIR",
        dir.path(),
    )
    .env("HVD_CGROUPS", "off")
    .stdout(std::process::Stdio::null())
    .spawn()
    .unwrap();
    wait_for(&dir.path().join("ready"));
    let (marked, session, both) = (format!("{tag}1"), format!("{tag}2"), format!("{tag}3"));
    let before = [sleepers(&marked), sleepers(&session), sleepers(&both)];
    launcher.kill().unwrap(); // SIGKILL: no cleanup code of the launcher runs; its watchdog lives on
    launcher.wait().unwrap();
    let left_marked = wait_gone(&marked, Duration::from_secs(5));
    let left_session = wait_gone(&session, Duration::from_secs(5));
    let survivors = holders(&both);
    for pid in left_marked.iter().chain(&left_session).chain(&survivors) {
        let _ = Command::new("kill").args(["-9", &pid.to_string()]).status();
    }
    assert!(
        before.iter().all(|pids| !pids.is_empty()),
        "not every escapee started: {before:?}"
    );
    assert_eq!(
        left_marked,
        Vec::<u32>::new(),
        "a setsid daemon with the step's marker outlived the launcher"
    );
    assert_eq!(
        left_session,
        Vec::<u32>::new(),
        "a process in a worker's session outlived the launcher"
    );
    eprintln!(
        "setsid + env -i escapee after the launcher's SIGKILL (out of reach without cgroups): {survivors:?}"
    );
}

/// A value of `HVD_CGROUPS` that is neither `off` nor `auto` stops the run with an error naming the variable.
#[test]
fn an_unknown_hvd_cgroups_value_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("tag"), unique_tag(22)).unwrap();
    std::fs::write(dir.path().join("escape"), "true;").unwrap();
    let output = helper("fallback_helper", "HVD_TEST_FALLBACK_DIR", dir.path())
        .env("HVD_CGROUPS", "no")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("HVD_CGROUPS=\\\"no\\\" is not understood"),
        "{stderr}"
    );
    assert!(!dir.path().join("started").exists(), "a step ran");
}

/// A shell loop writing to `file` the `sleep` processes whose argument is `$ESCAPE_TAG` followed by `suffix`.
fn list_sleeps(suffix: &str, file: &str) -> String {
    format!(
        "for p in /proc/[0-9]*; do c=$(tr '\\0' ' ' < $p/cmdline 2>/dev/null); \
         case \"$c\" in \"sleep ${{ESCAPE_TAG}}{suffix} \") echo \"${{p#/proc/}}\";; esac; done > {file}"
    )
}

/// Runs only when re-executed by `without_cgroups_one_steps_cleanup_spares_a_running_steps_escapees`.
#[test]
fn parallel_helper() {
    let Some(dir) = std::env::var_os("HVD_TEST_PARALLEL_DIR") else {
        return;
    };
    let dir = PathBuf::from(dir);
    let tag = std::fs::read_to_string(dir.join("tag")).unwrap();
    let file = |name: &str| format!("'{}'", dir.join(name).display());
    // `a` leaves a marked orphan (1) and an unmarked one (3), and ends once `b` has left its own (2, 4).
    let a = format!(
        "(setsid sleep ${{ESCAPE_TAG}}1 >/dev/null 2>&1 &); \
         (setsid env -i /bin/sh -c \"(sleep ${{ESCAPE_TAG}}3 &)\" >/dev/null 2>&1 &); \
         sleep 0.3; {own1}; while [ ! -e {ready} ]; do sleep 0.02; done",
        own1 = list_sleeps("1", &file("a1-before")),
        ready = file("b-ready")
    );
    // `b` waits until `a`'s marked orphan is gone (`a` has ended), then lists what it sees of its own.
    let b = format!(
        "(setsid sleep ${{ESCAPE_TAG}}2 >/dev/null 2>&1 &); \
         (setsid env -i /bin/sh -c \"(sleep ${{ESCAPE_TAG}}4 &)\" >/dev/null 2>&1 &); \
         sleep 0.3; {own2}; {own4}; touch {ready}; i=0; \
         while [ $i -lt 1500 ]; do {a1}; [ -s {a1_file} ] || break; sleep 0.02; i=$((i+1)); done; \
         {own2_after}; {own4_after}",
        own2 = list_sleeps("2", &file("b2-before")),
        own4 = list_sleeps("4", &file("b4-before")),
        ready = file("b-ready"),
        a1 = list_sleeps("1", &file("a1-left")),
        a1_file = file("a1-left"),
        own2_after = list_sleeps("2", &file("b2-after")),
        own4_after = list_sleeps("4", &file("b4-after")),
    );
    let check = list_escapees(&file("left"));
    run_project(&project_of(
        &dir,
        &tag,
        &[
            ("a", &a, &[]),
            ("b", &b, &[]),
            ("check", &check, &["a", "b"]),
        ],
    ));
}

/// Without cgroups, two steps at once: when `a` ends, its orphan that carries its marker is killed, while `b`'s
/// orphans (one with `b`'s marker, one with no marker at all) keep running; when `b` ends, alone, everything left
/// (`a`'s unmarked orphan too) is killed before `check` starts.
#[test]
fn without_cgroups_one_steps_cleanup_spares_a_running_steps_escapees() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let tag = unique_tag(31);
    std::fs::write(dir.path().join("tag"), &tag).unwrap();
    let output = helper("parallel_helper", "HVD_TEST_PARALLEL_DIR", dir.path())
        .env("HVD_CGROUPS", "off")
        .output()
        .unwrap();
    let after = leftovers_of_success(&tag, &output);
    let read = |name: &str| {
        std::fs::read_to_string(dir.path().join(name))
            .unwrap()
            .trim()
            .to_owned()
    };
    for started in ["a1-before", "b2-before", "b4-before"] {
        assert!(!read(started).is_empty(), "no escapee in {started}");
    }
    assert_eq!(read("a1-left"), "", "`a`'s marked orphan outlived `a`");
    assert_eq!(
        read("b2-after"),
        read("b2-before"),
        "`a`'s end killed `b`'s marked orphan"
    );
    assert_eq!(
        read("b4-after"),
        read("b4-before"),
        "`a`'s end killed `b`'s unmarked orphan"
    );
    assert_eq!(read("left"), "", "orphans outlived the last step");
    assert_eq!(after, Vec::<u32>::new(), "escapees outlived the run");
}
