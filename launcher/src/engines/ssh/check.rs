//! Checking the hosts before a run of the ssh engine: ssh reaches each one, the project directory is there (else its
//! files go to a work directory there), and so is the env, by content hash with every store path it references
//! (pulled from the caches, or copied with `--ssh-copy-env`), and the host's glibc is as new as the env's wheels
//! need, all hosts at once.

use std::path::Path;
use std::process::{Command, Stdio};

use super::deliver::WorkFiles;
use super::remote::{bounded_output, host_text, timed_out};
use super::{SshSetup, engine_error};
use crate::LaunchError;
use crate::closure::{EnvIdentity, is_store_path_name, printable};
use crate::engines::shell::{self, quote};

impl SshSetup {
    /// Checks every host before anything starts, all at once: ssh reaches it, the project directory exists there
    /// (else the project's files, `inputs` of the distributed steps or the whole directory, go to a work directory
    /// there, where its ranks then run), and so does the env (`env_dir`): for a store path, with the same content
    /// hash and every store path it references, pulled from the caches or copied when it is not.
    pub fn check_hosts(
        &self,
        dir: &Path,
        env_dir: Option<&Path>,
        inputs: &[String],
    ) -> Result<(), LaunchError> {
        self.check_hosts_refusing(dir, env_dir, inputs, &|_| None)
    }

    /// [`SshSetup::check_hosts`], where `refuse_no_dir(host)` says why a host without the project directory must
    /// not run the ranks: such a host is refused as soon as its check says so, before any file is sent or the env
    /// delivered there.
    pub fn check_hosts_refusing(
        &self,
        dir: &Path,
        env_dir: Option<&Path>,
        inputs: &[String],
        refuse_no_dir: &(dyn Fn(&str) -> Option<String> + Sync),
    ) -> Result<(), LaunchError> {
        let local = env_dir.map(EnvIdentity::local).transpose()?.flatten();
        let delivering = local.is_some() && (self.copy_env || !self.caches.is_empty());
        let probe = Probe {
            store: delivering
                .then(|| local.as_ref().map(|l| l.store.as_path()))
                .flatten(),
            hvd: (local.is_some() && !self.caches.is_empty()).then_some(self.hvd.as_deref()),
        };
        let markers = super::deliver::project_markers(dir, inputs);
        let script = check_script(dir, &markers, env_dir, local.as_ref(), &probe);
        // The project's files, read (and hashed) once, when the first host lacks the directory.
        let work = &WorkSource {
            inputs,
            files: std::sync::OnceLock::new(),
            refuse_no_dir,
        };
        let results: Vec<Result<(), String>> = std::thread::scope(|scope| {
            let handles: Vec<_> = self
                .hosts
                .iter()
                .map(|(host, _)| {
                    let script = &script;
                    let local = local.as_ref();
                    scope.spawn(move || self.check_host(host, script, dir, env_dir, local, work))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .unwrap_or_else(|_| Err("the host check panicked".into()))
                })
                .collect()
        });
        let errors: Vec<String> = results.into_iter().filter_map(Result::err).collect();
        if errors.is_empty() {
            Ok(())
        } else {
            Err(engine_error(errors.join("\n")))
        }
    }

    fn check_host(
        &self,
        host: &str,
        script: &str,
        dir: &Path,
        env_dir: Option<&Path>,
        local: Option<&EnvIdentity>,
        work: &WorkSource<'_>,
    ) -> Result<(), String> {
        let report = self.run_check(host, script, local)?;
        if report.no_dir
            && let Some(refusal) = (work.refuse_no_dir)(host)
        {
            return Err(refusal);
        }
        // With caches, each rank there starts through this `hvd`'s `worker-env --once --pull` (which roots the env);
        // an older `hvd` without those flags would fail every rank with its argument parser's error.
        if !self.caches.is_empty()
            && !report.no_store
            && let Some(hvd) = report.hvd.as_ref().filter(|_| report.hvd_old)
        {
            if let Some((rc, said)) = &report.hvd_failed {
                return Err(format!(
                    "the hvd on host `{host}` ({hvd}) did not run: `{hvd} worker-env --help` there ended with exit \
                     status {rc}{} and said {said}; with caches, the host pulls the env and starts each rank through \
                     it: repair or reinstall it there (this hvd: {}), or run without caches (`--ssh-copy-env`)",
                    if rc == "124" {
                        " (no answer within 10 s)"
                    } else {
                        ""
                    },
                    self.hvd
                        .as_deref()
                        .map_or("the launcher's version".into(), |p| p.display().to_string())
                ));
            }
            return Err(format!(
                "the hvd on host `{host}` ({hvd}) is an older build without `hvd worker-env --once --pull`: with \
                 caches, the host pulls the env and starts each rank through it (which holds the env against `hvd \
                 gc` there while the rank runs); install this hvd ({}) on that host, at the same path or first on \
                 its PATH, or run without caches (`--ssh-copy-env`)",
                self.hvd
                    .as_deref()
                    .map_or("the launcher's version".into(), |p| p.display().to_string())
            ));
        }
        // Not where the store cannot be written (no lock or root can be taken there).
        if !self.caches.is_empty()
            && !report.no_store
            && let Some(hvd) = &report.hvd
        {
            self.pulling_hvds
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .insert(host.to_owned(), hvd.clone());
        }
        let deliverable = report.differs.is_none() && !report.env_problems().is_empty();
        if deliverable
            && local.is_some()
            && (self.copy_env || !self.caches.is_empty())
            && report.no_store
        {
            let store = local
                .map(|l| l.store.display().to_string())
                .unwrap_or_default();
            return Err(format!(
                "the store directory {store} does not exist on host `{host}` and cannot be created there: a store \
                 path is valid only at the directory it was built in (it holds absolute links into it), so the \
                 store path prefix must be equal on every host; give every host a writable {store}, or build \
                 the env in a store directory every host has (e.g. /opt/hvd/store; docs/store.md)"
            ));
        }
        let report = match (env_dir, local) {
            // A host without `hvd` gets the copy instead when `--ssh-copy-env` is given too.
            (Some(_), Some(identity))
                if deliverable
                    && !self.caches.is_empty()
                    && (report.hvd.is_some() || !self.copy_env) =>
            {
                let Some(hvd) = &report.hvd else {
                    return Err(format!(
                        "hvd is not installed on host `{host}` (neither {} nor `hvd` on its PATH): each host pulls the \
                         env from the caches with `hvd cache pull`; install hvd there (at that path or on PATH), or \
                         run without caches and let hvd copy the env (`--ssh-copy-env`)",
                        self.hvd
                            .as_deref()
                            .map_or("the launcher's path".into(), |p| p.display().to_string())
                    ));
                };
                tracing::info!(host, "pulling the env from the caches");
                self.pull_and_check(
                    host,
                    hvd,
                    &identity.store.join(&identity.name),
                    script,
                    local,
                )?
            }
            (Some(_), Some(identity)) if deliverable && self.copy_env => {
                // Only the launcher's own names are copied: what the host said is missing selected them from the
                // closure computed here (`run_check` refused any other name).
                let mut names: Vec<&str> = report.missing.iter().map(String::as_str).collect();
                if report.no_env || report.content_hash.is_none() {
                    names.push(&identity.name);
                }
                tracing::info!(host, paths = names.len(), "copying the env's store paths");
                self.copy_store_paths(host, &identity.store, &names)?;
                self.run_check(host, script, local)?
            }
            _ => report,
        };
        let mut problems = Vec::new();
        if report.no_dir {
            // The ranks there run in a work directory with the project's files.
            match work
                .files
                .get_or_init(|| WorkFiles::collect(dir, work.inputs))
                .as_ref().map_err(String::clone).and_then(|w| self.send_work(host, w)) {
                Ok(work_dir) => {
                    tracing::info!(host, dir = %work_dir.display(), "the project's files are in a work directory");
                    self.work_dirs
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .insert(host.to_owned(), work_dir);
                }
                Err(e) => problems.push(format!(
                    "the project directory {} does not exist on host `{host}` (or lacks the project's top-level \
                     files there), and its files could not be copied to a work directory there: {e}",
                    dir.display()
                )),
            }
        }
        if let Some(env) = env_dir {
            let what_to_do = "the ssh engine runs every rank in the same env (store path) on every host: share \
                              the store at the same path, build the project on that host (`hvd build FILE`), or \
                              let hvd copy it (`--ssh-copy-env`)";
            if report.no_env {
                problems.push(format!(
                    "the env {} is missing on host `{host}`; {what_to_do}",
                    env.display()
                ));
            } else if let Some(local) = local {
                match (&report.content_hash, &report.differs) {
                    (_, Some(hash)) => problems.push(format!(
                        "the env {} differs on host `{host}` (content hash {} there, {} here): a store path \
                         never changes, so one of them is damaged; delete it there and copy it again \
                         (`--ssh-copy-env`) or rebuild it",
                        env.display(),
                        printable(hash),
                        local.content_hash
                    )),
                    (Some(_), None) => {}
                    (None, None) => problems.push(format!(
                        "the env {} on host `{host}` is not a complete store path (no readable .hvd-path.json); \
                         {what_to_do}",
                        env.display()
                    )),
                }
                if !report.missing.is_empty() {
                    problems.push(format!(
                        "store paths the env needs are missing on host `{host}`: {}; {what_to_do}",
                        report.missing.join(", ")
                    ));
                }
            }
            if let Some(problem) = local
                .and_then(|identity| identity.glibc.as_ref())
                .and_then(|need| need.problem(report.glibc, &format!("host `{host}`")))
            {
                problems.push(problem);
            }
            if let Some(problem) = local.and_then(|identity| report.library_problem(identity, host))
            {
                problems.push(problem);
            }
            if report.no_python && !report.no_env {
                problems.push(format!(
                    "the env's Python ({}/bin/python, a link to the interpreter it was built with) does not run on \
                     host `{host}`: install the same Python at the same path there",
                    env.display()
                ));
            }
        }
        if problems.is_empty() {
            Ok(())
        } else {
            Err(problems.join("\n"))
        }
    }

    /// Runs the check script on `host` and reads its answer, at most [`CHECK_ANSWER_LIMIT`] bytes of it. The host is
    /// not trusted: a store path it reports missing must be one of the env's closure as computed here (`local`), and
    /// is kept as the launcher's own name; any other name fails the check of this host, naming it.
    fn run_check(
        &self,
        host: &str,
        script: &str,
        local: Option<&EnvIdentity>,
    ) -> Result<CheckReport, String> {
        self.read_check(
            host,
            &format!("exec /bin/sh -c {}", quote(script)),
            local,
            None,
        )
    }

    /// [`SshSetup::run_check`] of the remote command `remote`, which runs the check script; `pulling`: the env's
    /// name when `remote` first pulls it (`hvd worker-env --once --pull ... -- /bin/sh -c SCRIPT`, with the pull's
    /// deadline), so a failure without the check's answer is the pull's, said with its own last lines.
    pub(super) fn read_check(
        &self,
        host: &str,
        remote: &str,
        local: Option<&EnvIdentity>,
        pulling: Option<&str>,
    ) -> Result<CheckReport, String> {
        let argv = self.argv(host, remote);
        let deadline = match pulling {
            Some(_) => self.deadlines.pull,
            None => self.deadlines.check,
        };
        let out = bounded_output(
            Command::new(&argv[0]).args(&argv[1..]),
            None,
            CHECK_ANSWER_LIMIT,
            deadline,
        )
        .map_err(|e| format!("failed to run `{}`: {e}", argv[0]))?;
        if out.timed_out {
            let phase = match pulling {
                Some(_) => {
                    "pulling the env from the caches (`hvd worker-env --pull`) and checking it"
                }
                None => "the host check",
            };
            return Err(timed_out(host, phase, deadline));
        }
        if out.stdout_overflow {
            return Err(format!(
                "host `{host}` answered the env check with more than {} bytes; hvd stopped reading and copies \
                 nothing to it: check that host (its login shell or `.bashrc` prints too much, or it is not the \
                 machine it should be)",
                CHECK_ANSWER_LIMIT
            ));
        }
        let stdout = String::from_utf8_lossy(&out.stdout);
        if let Some(name) = pulling
            && !stdout.contains("hvd-check:done")
        {
            // The last lines say why (progress and warnings come first).
            return Err(format!(
                "host `{host}` could not get the env {name} from the caches (`hvd worker-env --pull` there, {}):\n    \
                 {}",
                out.status,
                host_text(&out.stderr)
            ));
        }
        if !stdout.contains("hvd-check:done") {
            return Err(format!(
                "cannot run commands on host `{host}` over ssh ({}): {}\n  (check `{} {host} true`; the ssh engine \
                 needs key-based login without prompts: BatchMode)",
                out.status,
                host_text(&out.stderr),
                shell::line(&self.ssh)
            ));
        }
        let has = |line: &str| stdout.lines().any(|l| l == line);
        let content_hash = stdout
            .split_once("hvd-check:path-json\n")
            .and_then(|(_, rest)| rest.split_once("\nhvd-check:end"))
            .and_then(|(json, _)| serde_json::from_str::<serde_json::Value>(json).ok())
            .and_then(|v| v["content_hash"].as_str().map(str::to_owned));
        let expected = stdout
            .lines()
            .find_map(|l| l.strip_prefix("hvd-check:expect "))
            .map(str::to_owned);
        let mut missing: Vec<String> = Vec::new();
        let mut foreign: Vec<String> = Vec::new();
        for name in stdout
            .lines()
            .filter_map(|l| l.strip_prefix("hvd-check:missing "))
        {
            match local.and_then(|identity| identity.closure.get(name)) {
                Some(own) => {
                    if !missing.contains(own) {
                        missing.push(own.clone());
                    }
                }
                None => foreign.push(printable(name)),
            }
        }
        if !foreign.is_empty() {
            foreign.truncate(5);
            return Err(format!(
                "host `{host}` answered the env check with store paths that are not in the env's closure: {}; \
                 hvd ran and copied nothing on its word. The host is misconfigured or compromised: check it \
                 before using it again",
                foreign.join(", ")
            ));
        }
        Ok(CheckReport {
            no_dir: has("hvd-check:no-dir"),
            no_env: has("hvd-check:no-env"),
            no_python: has("hvd-check:no-python"),
            differs: content_hash
                .clone()
                .filter(|h| expected.as_ref().is_some_and(|e| e != h)),
            content_hash,
            missing,
            glibc: stdout
                .lines()
                .find_map(|l| l.strip_prefix("hvd-check:glibc glibc "))
                .and_then(crate::glibc::parse_version),
            no_store: has("hvd-check:no-store"),
            ld_conf: stdout
                .lines()
                .filter_map(|l| l.strip_prefix("hvd-check:ld-conf "))
                .map(str::to_owned)
                .collect(),
            libraries: stdout
                .lines()
                .filter_map(|l| l.strip_prefix("hvd-check:lib "))
                .map(std::path::PathBuf::from)
                .collect(),
            hvd_old: has("hvd-check:hvd-old"),
            hvd_failed: stdout
                .lines()
                .find_map(|l| l.strip_prefix("hvd-check:hvd-rc "))
                .map(|rc| {
                    let said = stdout
                        .lines()
                        .find_map(|l| l.strip_prefix("hvd-check:hvd-said "))
                        .unwrap_or_default();
                    let rc = rc.trim();
                    let rc = rc
                        .parse::<u8>()
                        .map_or_else(|_| printable(rc), |n| n.to_string());
                    (rc, printable(said.trim()))
                }),
            // The host names the program it runs itself; only an absolute, printable path is taken.
            hvd: stdout
                .lines()
                .find_map(|l| l.strip_prefix("hvd-check:hvd "))
                .filter(|p| p.starts_with('/') && !p.chars().any(char::is_control))
                .map(str::to_owned),
        })
    }

    /// Copies store paths `names` from `store` here to the same store on `host` (`tar | ssh host tar`), each moved
    /// into place whole (from `.tmp/` in that store), and only where the host does not have it yet. The archive
    /// carries the sha256 of every regular file (`sha256sum`, made here), which the host checks (`sha256sum -c`) before
    /// any path is moved into place: a copy that arrived damaged leaves nothing.
    ///
    /// `names` are the launcher's own (the env and its closure, [`EnvIdentity`]); each is checked against the store
    /// path grammar again here, and `tar` gets them after `--`, relative to the store (`-C STORE`), so no name can be
    /// read as an option or reach outside the store.
    fn copy_store_paths(&self, host: &str, store: &Path, names: &[&str]) -> Result<(), String> {
        if names.is_empty() {
            return Ok(());
        }
        if let Some(bad) = names.iter().find(|n| !is_store_path_name(n)) {
            return Err(format!(
                "refusing to copy `{}` to host `{host}`: not a store path name",
                printable(bad)
            ));
        }
        let s = quote(&store.display().to_string());
        let list = names.iter().map(|n| quote(n)).collect::<Vec<_>>().join(" ");
        let script = format!(
            "set -e; t={s}/.tmp/hvd-ssh-copy.$$; mkdir -p \"$t\"; tar -C \"$t\" -xf -; \
             if ! (cd \"$t\" && find . -mindepth 1 ! -path ./{CHECKSUMS} ! -path ./{ENTRIES} \
             -printf '%y %P -> %l\\0' | LC_ALL=C sort -z | cmp -s - {ENTRIES}); then chmod -R u+w \"$t\"; \
             rm -rf \"$t\"; echo 'hvd: the copied store paths hold entries (files, links, directories) that are \
             not in the list sent with them: nothing was installed' >&2; exit 1; fi; \
             if ! (cd \"$t\" && sha256sum --quiet --strict -c {CHECKSUMS} >&2); then chmod -R u+w \"$t\"; \
             rm -rf \"$t\"; echo 'hvd: the copied store paths do not match their sha256 (see above): nothing was \
             installed' >&2; exit 1; fi; for n in {list}; do \
             [ -e {s}/\"$n\" ] || mv \"$t/$n\" {s}/\"$n\"; done; chmod -R u+w \"$t\"; rm -rf \"$t\""
        );
        let checksums = Checksums::of(store, names)?;
        let mut tar = Command::new("tar")
            .arg("-cf")
            .arg("-")
            .arg("-C")
            .arg(checksums.dir.path())
            .arg(CHECKSUMS)
            .arg(ENTRIES)
            .arg("-C")
            .arg(store)
            .arg("--")
            .args(names)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("failed to run tar: {e}"))?;
        let Some(archive) = tar.stdout.take() else {
            return Err("tar has no output pipe".into());
        };
        let out = self.unpack_on(host, &script, archive, &mut tar);
        drop(checksums);
        let tar_out = tar.wait_with_output().map_err(|e| format!("tar: {e}"))?;
        let out = out?;
        if out.timed_out {
            return Err(timed_out(host, "copying the env", self.deadlines.copy));
        }
        if !tar_out.status.success() || !out.status.success() {
            return Err(format!(
                "copying the env to host `{host}` failed: {}{}",
                host_text(&tar_out.stderr),
                host_text(&out.stderr)
            ));
        }
        Ok(())
    }
}

/// The project's files for hosts without the project directory: the steps' `inputs`, read and hashed once, by the
/// first host that needs them.
struct WorkSource<'a> {
    inputs: &'a [String],
    files: std::sync::OnceLock<Result<WorkFiles, String>>,
    /// Why a host without the project directory must not run the ranks ([`SshSetup::check_hosts_refusing`]).
    refuse_no_dir: &'a (dyn Fn(&str) -> Option<String> + Sync),
}

/// The name of the checksum list in a copy's archive (not a store path name, so never one of the copied paths).
const CHECKSUMS: &str = "hvd-copy.sha256";

/// The name of the entry list in a copy's archive: every file, link (with its target) and directory of the copied
/// store paths (`find -printf '%y %P -> %l\0'`, sorted bytewise), which the host compares with what it unpacked.
const ENTRIES: &str = "hvd-copy.entries";

/// The sha256 of every regular file of some store paths, as `sha256sum` writes them (`HASH  NAME/PATH`), and the list
/// of all their entries ([`ENTRIES`]), in a private temporary directory (random name, mode 0700, removed on drop).
struct Checksums {
    dir: tempfile::TempDir,
}

impl Checksums {
    fn of(store: &Path, names: &[&str]) -> Result<Checksums, String> {
        let dir = tempfile::Builder::new()
            .prefix("hvd-ssh-copy-")
            .tempdir()
            .map_err(|e| format!("failed to create a temporary directory: {e}"))?;
        let checksums = Checksums { dir };
        let entries = std::fs::File::create_new(checksums.dir.path().join(ENTRIES))
            .map_err(|e| format!("failed to create the entry list: {e}"))?;
        over_store_paths(
            store,
            names,
            "find \"$@\" -printf '%y %p -> %l\\0' | LC_ALL=C sort -z",
            entries,
            ("find", "list"),
        )?;
        let file = std::fs::File::create_new(checksums.dir.path().join(CHECKSUMS))
            .map_err(|e| format!("failed to create the checksum list: {e}"))?;
        over_store_paths(
            store,
            names,
            "find \"$@\" -type f -print0 | xargs -0r sha256sum --",
            file,
            ("sha256sum", "hash"),
        )?;
        Ok(checksums)
    }
}

/// Runs `script` in `store` with the store path `names` as its arguments, its stdout into `out`; `(tool, verb)` name
/// the failures ("failed to run {tool}", "failed to {verb} the store paths to copy").
fn over_store_paths(
    store: &Path,
    names: &[&str],
    script: &str,
    out: std::fs::File,
    (tool, verb): (&str, &str),
) -> Result<(), String> {
    // Names are store path names (checked): never an option of `find`.
    let done = Command::new("/bin/sh")
        .arg("-c")
        .arg(format!("cd \"$0\" && {script}"))
        .arg(store)
        .args(names)
        .stdin(Stdio::null())
        .stdout(out)
        .stderr(Stdio::piped())
        .output()
        .map_err(|e| format!("failed to run {tool}: {e}"))?;
    if !done.status.success() {
        return Err(format!(
            "failed to {verb} the store paths to copy: {}",
            String::from_utf8_lossy(&done.stderr).trim()
        ));
    }
    Ok(())
}

/// What a host said to the check script.
#[derive(Debug, Clone, Default)]
pub(super) struct CheckReport {
    no_dir: bool,
    no_env: bool,
    no_python: bool,
    /// The env's content hash there.
    content_hash: Option<String>,
    /// `Some(hash there)` when it is not the one here.
    differs: Option<String>,
    /// Store paths the env references that are missing there.
    missing: Vec<String>,
    /// The host's glibc (`getconf GNU_LIBC_VERSION`); `None` when it has none or did not say.
    glibc: Option<(u64, u64)>,
    /// The env's store directory is not there and cannot be made (asked only when the env is to be delivered).
    no_store: bool,
    /// The `hvd` program there (asked only when the env is to be pulled from caches).
    hvd: Option<String>,
    /// That `hvd`'s `worker-env --help` names no `--once` or no `--pull`: an older build that cannot start ranks.
    hvd_old: bool,
    /// That `hvd worker-env --help` did not run at all: it ended with a failure and no usage text (its exit status
    /// and the first line it wrote, as [`printable`] shows it).
    hvd_failed: Option<(String, String)>,
    /// The lines of the dynamic linker's configuration there (asked only when the env's interpreter needs host
    /// libraries).
    ld_conf: Vec<String>,
    /// Where the host has the libraries the env's interpreter needs: `<dir>/<soname>` for every directory that the
    /// configuration names or the linker searches by default and that holds one.
    libraries: std::collections::BTreeSet<std::path::PathBuf>,
}

/// What the check script asks a host besides the env: whether the store directory is there or can be made, and
/// where its `hvd` is (the launcher's own path first, then `hvd` on its PATH).
struct Probe<'a> {
    store: Option<&'a Path>,
    hvd: Option<Option<&'a Path>>,
}

impl CheckReport {
    /// The problem with the host libraries the env's interpreter needs on this host, by the same rule as on this
    /// machine ([`crate::glibc::library_dirs_from`], [`crate::glibc::host_library_problem`]): a library the
    /// executable or libpython needs and no directory the host's dynamic linker searches has fails the start; one
    /// only extension modules need is a warning.
    fn library_problem(&self, identity: &EnvIdentity, host: &str) -> Option<String> {
        if identity.host_libraries.is_empty() {
            return None;
        }
        let dirs = crate::glibc::library_dirs_from(self.ld_conf.iter().map(String::as_str));
        let missing = crate::glibc::missing_among(&identity.host_libraries, &dirs, |path| {
            self.libraries.contains(path)
        });
        crate::glibc::host_library_problem(&missing, &format!("host `{host}`"))
    }

    fn env_problems(&self) -> Vec<&'static str> {
        let mut p = Vec::new();
        if self.no_env || self.content_hash.is_none() {
            p.push("env");
        }
        if !self.missing.is_empty() {
            p.push("references");
        }
        p
    }
}

/// The most a host's answer to the env check may be (stdout; stderr is cut there too): a few lines per store path of
/// the closure and the env's `.hvd-path.json`, far below this.
pub const CHECK_ANSWER_LIMIT: usize = 4 << 20;

/// The remote half of [`SshSetup::check_hosts`]: prints `hvd-check:` lines and ends with `hvd-check:done`.
///
/// The project directory counts as there when it holds every name of `markers` (an empty directory made at the
/// project's path, by a checkpoint for example, does not).
fn check_script(
    dir: &Path,
    markers: &[String],
    env: Option<&Path>,
    local: Option<&EnvIdentity>,
    probe: &Probe<'_>,
) -> String {
    let q = |p: &Path| quote(&p.display().to_string());
    let tests: String = markers
        .iter()
        .map(|m| format!("{{ [ -e {m} ] || [ -L {m} ]; }} && ", m = quote(m)))
        .collect();
    let mut s = format!(
        "if cd {} 2>/dev/null && {tests}:; then :; else echo hvd-check:no-dir; fi; ",
        q(dir)
    );
    if let Some(store) = probe.store {
        s.push_str(&format!(
            "mkdir -p {s} 2>/dev/null; [ -d {s} ] && [ -w {s} ] || echo hvd-check:no-store; ",
            // `STORE/.`: the same directory, written so that a test's stand-in for ssh can map it per host.
            s = q(&store.join("."))
        ));
    }
    if let Some(hvd) = probe.hvd {
        // Looked up from `/`, not the project directory, and only an absolute path is taken: a relative PATH entry
        // (`.`) must not let a project's `./hvd` start every rank. Its `worker-env --help` (for at most 10 s where
        // the host has `timeout`) says whether it has the flags the ranks start with; one that ends with a failure
        // and no usage text did not run at all (`hvd-rc`, with the first line it wrote).
        let own = hvd.map(&q).unwrap_or_default();
        s.push_str(&format!(
            "for h in {own} hvd; do p=$(cd / && command -v \"$h\" 2>/dev/null) && case $p in /*) [ -x \"$p\" ] && \
             {{ echo \"hvd-check:hvd $p\"; t=; command -v timeout >/dev/null 2>&1 && t='timeout 10'; \
             u=$( ($t \"$p\" worker-env --help 2>&1 </dev/null; echo \"hvd-check:rc $?\") | head -c 65536); \
             case $u in *--once*) case $u in *--pull*) ;; *) echo hvd-check:hvd-old;; esac;; \
             *) echo hvd-check:hvd-old;; esac; \
             case $u in *Usage*|*'hvd-check:rc 0') ;; *'hvd-check:rc '*) \
             echo \"hvd-check:hvd-rc ${{u##*hvd-check:rc }}\"; \
             printf '%s\\n' \"${{u%hvd-check:rc *}}\" | head -n 1 | sed 's/^/hvd-check:hvd-said /';; esac; \
             break; }};; esac; done; "
        ));
    }
    if let Some(env) = env {
        s.push_str(&format!(
            "test -d {}/bin || echo hvd-check:no-env; ",
            q(env)
        ));
        if env.join("bin/python").exists() {
            s.push_str(&format!(
                "test -x {}/bin/python || echo hvd-check:no-python; ",
                q(env)
            ));
        }
        if let Some(identity) = local {
            s.push_str(&format!(
                "echo {}; echo hvd-check:path-json; cat {}/.hvd-path.json 2>/dev/null; echo; echo hvd-check:end; ",
                quote(&format!("hvd-check:expect {}", identity.content_hash)),
                q(env)
            ));
            if identity.glibc.is_some() {
                s.push_str("echo \"hvd-check:glibc $(getconf GNU_LIBC_VERSION 2>/dev/null)\"; ");
            }
            s.push_str(&library_probe(identity));
            for name in &identity.closure {
                let path = identity.store.join(name);
                s.push_str(&format!(
                    "test -f {}/.hvd-path.json || echo {}; ",
                    q(&path),
                    quote(&format!("hvd-check:missing {name}"))
                ));
            }
        }
    }
    s.push_str("echo hvd-check:done");
    s
}

/// The part of the check script that reports what [`CheckReport::library_problem`] decides on: the lines of the
/// host's dynamic linker configuration (`hvd-check:ld-conf LINE`), and `hvd-check:lib DIR/SONAME` for each library
/// the env's interpreter needs that is in a directory named there (any absolute word: a superset of what
/// [`crate::glibc::library_dirs_from`] takes) or searched by default. Empty when the interpreter needs none.
fn library_probe(identity: &EnvIdentity) -> String {
    let mut sonames: Vec<&str> = identity
        .host_libraries
        .iter()
        .map(|l| l.soname.as_str())
        .collect();
    sonames.sort_unstable();
    sonames.dedup();
    if sonames.is_empty() {
        return String::new();
    }
    let sonames: Vec<String> = sonames.into_iter().map(quote).collect();
    let defaults: Vec<String> = crate::glibc::default_library_dirs()
        .iter()
        .map(|d| quote(&d.display().to_string()))
        .collect();
    format!(
        "c=$(cat {conf} {conf_dir}/*.conf 2>/dev/null | head -c 1048576); \
         [ -n \"$c\" ] && printf '%s\\n' \"$c\" | sed 's/^/hvd-check:ld-conf /'; \
         (set -f; for d in $c {defaults}; do case $d in /*) for s in {sonames}; do \
         [ -e \"$d/$s\" ] && printf 'hvd-check:lib %s/%s\\n' \"$d\" \"$s\"; done;; esac; done); ",
        conf = quote(crate::glibc::LD_SO_CONF),
        conf_dir = quote(crate::glibc::LD_SO_CONF_DIR),
        defaults = defaults.join(" "),
        sonames = sonames.join(" "),
    )
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::path::PathBuf;

    use super::*;
    use crate::engines::ssh::tests::setup;
    use std::os::unix::fs::PermissionsExt as _;

    /// Writes the script `text` at `path`, executable.
    fn executable(path: PathBuf, text: impl AsRef<[u8]>) -> PathBuf {
        std::fs::write(&path, text).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        path
    }

    /// A stand-in for ssh that runs the remote command here, with `/store/` read as `/store-HOST/` so that every
    /// "host" has a store of its own; host `down` is unreachable.
    fn fake_ssh(dir: &Path) -> PathBuf {
        executable(
            dir.join("fake-ssh"),
            "#!/bin/sh\nwhile [ \"$1\" != -- ]; do host=$1; shift; done; shift\n\
             [ \"$host\" = down ] && { echo 'ssh: connect to host down port 22: Connection refused' >&2; exit 255; }\n\
             exec /bin/sh -c \"$(printf '%s' \"$*\" | sed \"s#/store/#/store-$host/#g\")\"\n",
        )
    }

    /// A stand-in ssh (`d/elsewhere-ssh`) for a host that sees the project at `<proj>-host` and keeps its cache in
    /// `d/cache`; with `path_first`, the host's commands are looked up there first.
    fn elsewhere_ssh(d: &Path, proj: &Path, path_first: Option<&Path>) -> PathBuf {
        let path = path_first
            .map(|bin| format!("export PATH={}:$PATH\n", quote(&bin.display().to_string())))
            .unwrap_or_default();
        executable(
            d.join("elsewhere-ssh"),
            format!(
                "#!/bin/sh\nwhile [ \"$1\" != -- ]; do shift; done; shift\nexport XDG_CACHE_HOME={cache}\n\
                 {path}exec /bin/sh -c \"$(printf '%s' \"$*\" | sed \"s#{p}#{p}-host#g\")\"\n",
                cache = quote(&d.join("cache").display().to_string()),
                p = proj.display()
            ),
        )
    }

    /// Checks host `a` through `ssh` for the project `proj`: the work directory it was given, if the project was sent.
    fn delivered_work_dir(ssh: &Path, proj: &Path) -> Option<PathBuf> {
        let mut s = setup(Some("lo"));
        s.ssh = vec![ssh.display().to_string()];
        s.hosts = vec![("a".into(), 1)];
        s.check_hosts(proj, None, &[]).unwrap();
        let dirs = s.work_dirs.lock().unwrap().clone();
        dirs.get("a").cloned()
    }

    /// An env to copy: `d/store` holds env `E1` and its one package `P1`; host `c`'s store (`d/store-c`) is empty.
    fn copy_source(d: &Path) -> PathBuf {
        let env = store_path(&d.join("store"), E1, "c1", &[P1]);
        store_path(&d.join("store"), P1, "cx", &[]);
        std::fs::create_dir_all(d.join("store-c")).unwrap();
        env
    }

    /// Writes a store path `NAME` with its `.hvd-path.json` into `store`.
    fn store_path(store: &Path, name: &str, content_hash: &str, references: &[&str]) -> PathBuf {
        let path = store.join(name);
        std::fs::create_dir_all(path.join("bin")).unwrap();
        let json = serde_json::json!({"schema": 1, "content_hash": content_hash, "references": references});
        std::fs::write(path.join(".hvd-path.json"), json.to_string()).unwrap();
        path
    }

    /// Store path names for the tests: an env, a package it references, and one only that package references.
    const E1: &str = "0123456789abcdef0123456789abcdef-t-1.0";
    const P1: &str = "11111111111111111111111111111111-x-2.0";
    const P2: &str = "22222222222222222222222222222222-y-3.0";

    #[test]
    fn hosts_are_checked_for_the_env_by_content_hash() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let env = store_path(&d.join("store"), E1, "c1", &[P1]);
        store_path(&d.join("store"), P1, "cx", &[P2]);
        store_path(&d.join("store"), P2, "cy", &[]);
        // Host a has the same env, b a different one without its packages, c none.
        store_path(&d.join("store-a"), E1, "c1", &[P1]);
        store_path(&d.join("store-a"), P1, "cx", &[P2]);
        store_path(&d.join("store-a"), P2, "cy", &[]);
        store_path(&d.join("store-b"), E1, "c2", &[P1]);
        std::fs::create_dir_all(d.join("store-c")).unwrap();
        let mut s = setup(Some("lo"));
        s.ssh = vec![fake_ssh(d).display().to_string()];
        s.hosts = vec![("a".into(), 1)];
        s.check_hosts(d, Some(&env), &[]).unwrap();
        s.hosts = vec![
            ("a".into(), 1),
            ("b".into(), 1),
            ("c".into(), 1),
            ("down".into(), 1),
        ];
        let err = s.check_hosts(d, Some(&env), &[]).unwrap_err().to_string();
        assert!(!err.contains("host `a`"), "{err}");
        assert!(
            err.contains("differs on host `b` (content hash `c2` there, c1 here)"),
            "{err}"
        );
        // The whole closure is checked: P2 is referenced by P1 only.
        assert!(
            err.contains(&format!("missing on host `b`: {P1}, {P2}")),
            "{err}"
        );
        assert!(
            err.contains(&format!("{E1} is missing on host `c`")),
            "{err}"
        );
        assert!(err.contains("share the store at the same path"), "{err}");
        assert!(err.contains("cannot run commands on host `down`"), "{err}");
        assert!(err.contains("Connection refused"), "{err}");
        // With copying on, what is missing is copied (whole store paths, the whole closure); a differing env is
        // never overwritten.
        s.copy_env = true;
        s.hosts = vec![("c".into(), 1)];
        s.check_hosts(d, Some(&env), &[]).unwrap();
        for name in [E1, P1, P2] {
            assert!(d.join(format!("store-c/{name}/.hvd-path.json")).is_file());
        }
        assert_eq!(
            std::fs::read_dir(d.join("store-c/.tmp")).unwrap().count(),
            0
        );
        s.hosts = vec![("b".into(), 1)];
        let err = s.check_hosts(d, Some(&env), &[]).unwrap_err().to_string();
        assert!(err.contains("differs on host `b`"), "{err}");
        assert!(
            !d.join(format!("store-b/{P1}")).exists(),
            "nothing is copied to a host whose env differs: {err}"
        );
        // The project directory must exist on every host too.
        s.hosts = vec![("a".into(), 1)];
        let err = s
            .check_hosts(&d.join("store/gone"), None, &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("does not exist on host `a`"), "{err}");
    }

    /// With caches, a host pulls the env with its own `hvd`: a host without one, or whose store directory is not
    /// there and cannot be made (the prefix must be the same everywhere), fails the start naming the host and why.
    #[test]
    fn a_host_without_hvd_or_the_store_directory_cannot_pull_and_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let env = store_path(&d.join("store"), E1, "c1", &[]);
        std::fs::create_dir_all(d.join("store-c")).unwrap();
        // Host d's store directory is a file: `mkdir -p` fails there.
        std::fs::write(d.join("store-d"), "not a directory").unwrap();
        let mut s = setup(Some("lo"));
        s.ssh = vec![fake_ssh(d).display().to_string()];
        s.caches = vec!["file:///nowhere".into()];
        s.trusted_keys = vec!["k:AAAA".into()];
        s.hvd = Some(d.join("no-such-hvd"));
        s.hosts = vec![("c".into(), 1), ("d".into(), 1)];
        let err = s.check_hosts(d, Some(&env), &[]).unwrap_err().to_string();
        assert!(err.contains("hvd is not installed on host `c`"), "{err}");
        assert!(err.contains("no-such-hvd"), "{err}");
        assert!(
            err.contains("does not exist on host `d` and cannot be created there")
                && err.contains("store path prefix must be equal on every host"),
            "{err}"
        );
        // With `--ssh-copy-env` too, a host without hvd gets the env copied instead.
        s.copy_env = true;
        s.hosts = vec![("c".into(), 1)];
        s.check_hosts(d, Some(&env), &[]).unwrap();
        assert!(d.join(format!("store-c/{E1}/.hvd-path.json")).is_file());
    }

    /// A stand-in ssh (`d/path-ssh`) as [`fake_ssh`] whose host's PATH is `path` (`:` separated) then the usual.
    fn path_ssh(d: &Path, path: &str) -> PathBuf {
        executable(
            d.join("path-ssh"),
            format!(
                "#!/bin/sh\nwhile [ \"$1\" != -- ]; do host=$1; shift; done; shift\nexport PATH={}:$PATH\n\
                 exec /bin/sh -c \"$(printf '%s' \"$*\" | sed \"s#/store/#/store-$host/#g\")\"\n",
                quote(path)
            ),
        )
    }

    /// A stand-in `hvd` at `path` whose `worker-env --help` prints `help`; any other use writes `path.ran`.
    fn stub_hvd(path: PathBuf, help: &str) -> PathBuf {
        executable(
            path.clone(),
            format!(
                "#!/bin/sh\nif [ \"$1 $2\" = 'worker-env --help' ]; then printf '%s\\n' {}; exit 0; fi\n\
                 echo \"$@\" >> \"$0.ran\"; echo \"error: unexpected argument '--once' found\" >&2; exit 2\n",
                quote(help)
            ),
        )
    }

    /// With caches, each rank on a host starts through the host's `hvd worker-env --once --pull`, even where the env
    /// is there already: a host whose `hvd` (the launcher's path missing there, found on its PATH) is an older build
    /// without those flags fails the check, naming the host, that hvd and what to do, instead of every rank failing
    /// on an unknown argument; one that has them is taken. A project's own `./hvd`, found through a relative PATH
    /// entry (`.`) from the project directory, is never taken or run; the real one after it is.
    #[test]
    fn a_host_whose_hvd_cannot_start_ranks_fails_the_check_and_a_projects_hvd_is_never_taken() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let env = store_path(&d.join("store"), E1, "c1", &[]);
        store_path(&d.join("store-a"), E1, "c1", &[]);
        let project = d.join("project");
        std::fs::create_dir_all(&project).unwrap();
        let (old, new) = (d.join("old-bin"), d.join("new-bin"));
        std::fs::create_dir_all(&old).unwrap();
        std::fs::create_dir_all(&new).unwrap();
        let old_hvd = stub_hvd(
            old.join("hvd"),
            "Usage: hvd worker-env [OPTIONS] [CMD]...\n      --kill-on-failure\n      --whole-lines",
        );
        let new_hvd = stub_hvd(
            new.join("hvd"),
            "Usage: hvd worker-env [OPTIONS] [CMD]...\n      --pull <ENV>\n      --once",
        );
        let planted = stub_hvd(project.join("hvd"), "      --pull <ENV>\n      --once");
        let mut s = setup(Some("lo"));
        s.caches = vec!["file:///nowhere".into()];
        s.trusted_keys = vec!["k:AAAA".into()];
        s.hvd = Some(d.join("no-such-hvd"));
        s.hosts = vec![("a".into(), 1)];
        s.ssh = vec![
            path_ssh(d, &old.display().to_string())
                .display()
                .to_string(),
        ];
        let err = s
            .check_hosts(&project, Some(&env), &[])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!(
                "the hvd on host `a` ({}) is an older build without `hvd worker-env --once --pull`",
                old_hvd.display()
            )) && err.contains("install this hvd")
                && err.contains("no-such-hvd"),
            "{err}"
        );
        assert!(s.pulling_hvds.lock().unwrap().is_empty());
        // `.` first on the host's PATH, then a current hvd: that one starts the ranks, the project's is never run.
        s.ssh = vec![
            path_ssh(d, &format!(".:{}", new.display()))
                .display()
                .to_string(),
        ];
        s.check_hosts(&project, Some(&env), &[]).unwrap();
        assert_eq!(
            s.pulling_hvds.lock().unwrap().get("a"),
            Some(&new_hvd.display().to_string())
        );
        assert!(!planted.with_extension("ran").exists());
        assert!(!d.join("project/hvd.ran").exists());
        assert!(!d.join("new-bin/hvd.ran").exists());
    }

    /// A host whose `hvd` does not run at all (a broken interpreter line, a crash that writes control characters,
    /// one that never answers) fails the check with that hvd's exit status and first line (escaped), not as an
    /// older build; one that hangs is stopped by the host's `timeout` (exit status 124).
    #[test]
    fn a_host_whose_hvd_does_not_run_fails_the_check_with_its_exit_status_and_first_line() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let env = store_path(&d.join("store"), E1, "c1", &[]);
        store_path(&d.join("store-a"), E1, "c1", &[]);
        let project = d.join("project");
        std::fs::create_dir_all(&project).unwrap();
        let mut s = setup(Some("lo"));
        s.caches = vec!["file:///nowhere".into()];
        s.trusted_keys = vec!["k:AAAA".into()];
        s.hvd = Some(d.join("no-such-hvd"));
        s.hosts = vec![("a".into(), 1)];
        for (script, rc, said) in [
            ("#!/no/such/interpreter\n", "127", "bin-127/hvd"),
            (
                "#!/bin/sh\nprintf '\\033[31mboom\\rbang\\n' >&2; exit 3\n",
                "3",
                "`\\u{1b}[31mboom\\rbang`",
            ),
            (
                "#!/bin/sh\nexec sleep 30\n",
                "124 (no answer within 10 s)",
                "``",
            ),
        ] {
            // A directory of its own for each (a file being written is not run while another test forks).
            let bin = d.join(format!("bin-{}", rc.split(' ').next().unwrap()));
            std::fs::create_dir_all(&bin).unwrap();
            let hvd = executable(bin.join("hvd"), script);
            s.ssh = vec![
                path_ssh(d, &bin.display().to_string())
                    .display()
                    .to_string(),
            ];
            let err = s
                .check_hosts(&project, Some(&env), &[])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!(
                    "the hvd on host `a` ({}) did not run: `{0} worker-env --help` there ended with exit status \
                     {rc}",
                    hvd.display()
                )) && err.split_once(" and said ").is_some_and(|(_, after)| after.contains(said))
                    && !err.contains("older build"),
                "{err}"
            );
            assert!(!err.chars().any(char::is_control), "{err:?}");
            assert!(s.pulling_hvds.lock().unwrap().is_empty());
        }
    }

    /// A compromised host answers the env check as it likes: its `ssh` here is a script that prints the answer in
    /// `answer` for the check, and for a copy keeps the archive it is sent in `received.tar`.
    fn hostile_ssh(dir: &Path) -> PathBuf {
        executable(
            dir.join("hostile-ssh"),
            format!(
                "#!/bin/sh\nd={}\ncase \"$*\" in\n  *hvd-check:done*) cat \"$d/answer\";;\n  \
                 *) cat > \"$d/received.tar\";;\nesac\n",
                quote(&dir.display().to_string())
            ),
        )
    }

    #[test]
    fn a_hostile_host_cannot_choose_what_is_copied_or_run() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let store = d.join("store");
        let env = store_path(&store, E1, "c1", &[P1]);
        store_path(&store, P1, "cx", &[]);
        // Not in the env's closure, but in the same store: a host must not obtain it.
        store_path(&store, P2, "secret", &[]);
        let mut s = setup(Some("lo"));
        s.ssh = vec![hostile_ssh(d).display().to_string()];
        s.hosts = vec![("evil".into(), 1)];
        s.copy_env = true;
        let pwned = d.join("pwned");
        let check = |missing: &[&str]| {
            let mut answer = String::from("hvd-check:no-env\n");
            for m in missing {
                answer.push_str(&format!("hvd-check:missing {m}\n"));
            }
            answer.push_str("hvd-check:done\n");
            std::fs::write(d.join("answer"), answer).unwrap();
            let _ = std::fs::remove_file(d.join("received.tar"));
            s.check_hosts(d, Some(&env), &[]).unwrap_err().to_string()
        };
        let hostile = [
            format!(
                "--checkpoint=1 --checkpoint-action=exec=touch {}",
                pwned.display()
            ),
            "--checkpoint-action=exec=sh".to_owned(),
            "-T/etc/passwd".to_owned(),
            "../../etc".to_owned(),
            "/etc/passwd".to_owned(),
            format!("{P1}/../../etc"),
            P2.to_owned(),
            format!("{P1} {P2}"),
        ];
        for name in &hostile {
            let err = check(&[P1, name]);
            assert!(
                err.contains("host `evil` answered the env check with store paths that are not in the env's closure"),
                "{name}: {err}"
            );
            assert!(
                !d.join("received.tar").exists(),
                "{name}: something was sent to the host"
            );
            assert!(!pwned.exists(), "{name}: the host ran a command here");
        }
        // An answer without end: refused at the limit, nothing sent.
        std::fs::write(
            d.join("answer"),
            format!("hvd-check:missing {P1}\n").repeat(CHECK_ANSWER_LIMIT / 40 + 10),
        )
        .unwrap();
        let err = s.check_hosts(d, Some(&env), &[]).unwrap_err().to_string();
        assert!(
            err.contains("host `evil` answered the env check with more than"),
            "{err}"
        );
        assert!(!d.join("received.tar").exists());
        // Names of the closure select what is sent, and only those: the archive holds the env and P1, never P2.
        let err = check(&[P1, P1]);
        assert!(err.contains("is missing on host `evil`"), "{err}");
        let listing = Command::new("tar")
            .arg("-tf")
            .arg(d.join("received.tar"))
            .output()
            .unwrap();
        let listing = String::from_utf8_lossy(&listing.stdout);
        let tops: BTreeSet<&str> = listing
            .lines()
            .map(|l| l.split('/').next().unwrap_or(l))
            .collect();
        assert_eq!(
            tops,
            BTreeSet::from([CHECKSUMS, ENTRIES, E1, P1]),
            "{listing}"
        );
        // The copy itself refuses a name that is not a store path name, whoever gives it.
        let err = s
            .copy_store_paths("evil", &store, &["--checkpoint-action=exec=true"])
            .unwrap_err();
        assert!(err.contains("not a store path name"), "{err}");
    }

    /// A copy that arrives damaged (a stand-in ssh changes a file of the archive on the way) is refused by the
    /// host's checksum check: nothing is moved into its store, and the error names the host.
    #[test]
    fn a_copy_damaged_on_the_way_installs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let env = copy_source(d);
        let ssh = executable(
            d.join("damaging-ssh"),
            "#!/bin/sh\nwhile [ \"$1\" != -- ]; do host=$1; shift; done; shift\n\
             cmd=$(printf '%s' \"$*\" | sed \"s#/store/#/store-$host/#g\")\n\
             case \"$cmd\" in *hvd-copy.sha256*) t=$(mktemp -d); tar -C \"$t\" -xf -; \
             for f in \"$t\"/*/.hvd-path.json; do chmod -R u+w \"$t\"; echo damaged >> \"$f\"; done; \
             tar -C \"$t\" -cf - . | /bin/sh -c \"$cmd\"; c=$?; rm -rf \"$t\"; exit $c;; esac\n\
             exec /bin/sh -c \"$cmd\"\n",
        );
        let mut s = setup(Some("lo"));
        s.ssh = vec![ssh.display().to_string()];
        s.copy_env = true;
        s.hosts = vec![("c".into(), 1)];
        let err = s.check_hosts(d, Some(&env), &[]).unwrap_err().to_string();
        assert!(err.contains("copying the env to host `c` failed"), "{err}");
        assert!(err.contains("do not match their sha256"), "{err}");
        for name in [E1, P1] {
            assert!(
                !d.join("store-c").join(name).exists(),
                "{name} was installed"
            );
        }
        assert_eq!(
            std::fs::read_dir(d.join("store-c/.tmp")).unwrap().count(),
            0
        );
    }

    /// Whatever rewrites the copy on its way: a file or a link added to a store path (with the checksum list, which
    /// covers only the files it names, left as it was) installs nothing.
    #[test]
    fn entries_added_to_a_copy_on_the_way_install_nothing() {
        for (what, tamper) in [
            ("a file", "echo planted > \"$t/$n/bin/extra\""),
            ("a link", "ln -s /etc/shadow \"$t/$n/bin/shadow\""),
        ] {
            let dir = tempfile::tempdir().unwrap();
            let d = dir.path();
            let env = copy_source(d);
            let ssh = executable(
                d.join("tampering-ssh"),
                format!(
                    "#!/bin/sh\nwhile [ \"$1\" != -- ]; do host=$1; shift; done; shift\n\
                     cmd=$(printf '%s' \"$*\" | sed \"s#/store/#/store-$host/#g\")\n\
                     case \"$cmd\" in *hvd-copy.sha256*) t=$(mktemp -d); tar -C \"$t\" -xf -; chmod -R u+w \"$t\"; \
                     for n in $(cd \"$t\" && ls -d *-*); do {tamper}; done; \
                     tar -C \"$t\" -cf - . | /bin/sh -c \"$cmd\"; c=$?; rm -rf \"$t\"; exit $c;; esac\n\
                     exec /bin/sh -c \"$cmd\"\n"
                ),
            );
            let mut s = setup(Some("lo"));
            s.ssh = vec![ssh.display().to_string()];
            s.copy_env = true;
            s.hosts = vec![("c".into(), 1)];
            let err = s.check_hosts(d, Some(&env), &[]).unwrap_err().to_string();
            assert!(
                err.contains("not in the list sent with them"),
                "{what}: {err}"
            );
            for name in [E1, P1] {
                assert!(
                    !d.join("store-c").join(name).exists(),
                    "{what}: {name} was installed"
                );
            }
        }
        // Untouched, the same copy installs (the lists made here and there agree).
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let env = copy_source(d);
        std::os::unix::fs::symlink("../bin", env.join("lib")).unwrap();
        std::fs::write(env.join("bin/python"), "x").unwrap();
        let mut s = setup(Some("lo"));
        s.ssh = vec![fake_ssh(d).display().to_string()];
        s.copy_env = true;
        s.hosts = vec![("c".into(), 1)];
        let _ = s.check_hosts(d, Some(&env), &[]);
        assert!(d.join("store-c").join(E1).join("bin/python").exists());
        assert!(d.join("store-c").join(P1).join(".hvd-path.json").exists());
    }

    /// A host sees the project at `<dir>-host` (missing at first) and keeps its cache in `<dir>-cache`: each run
    /// gets a fresh directory made from the read-only cached copy, so outputs never leak into the next run, and an
    /// empty directory at the project's path (a checkpoint's makedirs) is not taken for the project.
    #[test]
    fn each_run_gets_a_fresh_work_dir_and_an_empty_project_path_is_not_the_project() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let proj = d.join("proj");
        std::fs::create_dir_all(proj.join("src")).unwrap();
        std::fs::write(proj.join("train.py"), "print(1)").unwrap();
        std::fs::write(proj.join("src/a.py"), "a").unwrap();
        let ssh = elsewhere_ssh(d, &proj, None);
        let run = || delivered_work_dir(&ssh, &proj);
        let first = run().expect("delivered");
        assert!(first.starts_with(d.join("cache/hvd/work")), "{first:?}");
        assert_eq!(
            std::fs::read_to_string(first.join("src/a.py")).unwrap(),
            "a"
        );
        // Read-only (mode bits: the tests may run as root, whom they do not stop).
        let mode = std::fs::metadata(first.join("train.py"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o222, 0, "the cached copy is writable: {mode:o}");
        std::fs::write(first.join("out.txt"), "run 1").unwrap();
        let second = run().expect("delivered");
        assert_ne!(first, second);
        assert!(
            !second.join("out.txt").exists(),
            "run 1's output is in run 2's directory"
        );
        assert_eq!(
            std::fs::read_to_string(second.join("train.py")).unwrap(),
            "print(1)"
        );
        // The cached copy changed on the host (a rank running as root wrote through a hard link, a file was added):
        // it is not trusted by its name, but replaced by the files sent.
        let name = first.file_name().unwrap().to_string_lossy().into_owned();
        let cached = first.with_file_name(name.split_once(".run.").unwrap().0);
        assert!(cached.join(".hvd-work").is_file(), "{cached:?}");
        let changed = cached.join("src/a.py");
        std::fs::set_permissions(&changed, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::write(&changed, "tampered").unwrap();
        std::fs::write(cached.join("src/extra.py"), "x").unwrap();
        let third = run().expect("delivered");
        assert_eq!(
            std::fs::read_to_string(third.join("src/a.py")).unwrap(),
            "a"
        );
        assert!(!third.join("src/extra.py").exists());
        assert_eq!(std::fs::read_to_string(&changed).unwrap(), "a");
        assert!(!cached.join("src/extra.py").exists());
        // An executable bit that differs is a change too.
        std::fs::set_permissions(
            cached.join("train.py"),
            std::fs::Permissions::from_mode(0o555),
        )
        .unwrap();
        let fourth = run().expect("delivered");
        let mode = std::fs::metadata(fourth.join("train.py"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o111,
            0,
            "the stale executable bit was kept: {mode:o}"
        );
        // A stale copy that is a symbolic link (to another tree: a running run's hard links, say) is removed as a
        // link: the tree it points at keeps its files, read-only.
        let victim = d.join("victim");
        std::fs::create_dir_all(victim.join("sub")).unwrap();
        for name in ["sub/v.txt", ".hvd-work"] {
            std::fs::write(victim.join(name), "v").unwrap();
            std::fs::set_permissions(victim.join(name), std::fs::Permissions::from_mode(0o444))
                .unwrap();
        }
        std::fs::remove_dir_all(&cached).unwrap();
        std::os::unix::fs::symlink(&victim, &cached).unwrap();
        let fifth = run().expect("delivered");
        assert_eq!(
            std::fs::read_to_string(fifth.join("train.py")).unwrap(),
            "print(1)"
        );
        assert!(!cached.is_symlink() && cached.join("train.py").is_file());
        let mode = std::fs::metadata(victim.join("sub/v.txt"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(
            mode & 0o222,
            0,
            "the linked tree's file was made writable: {mode:o}"
        );
        // A directory made at the project's path on the host is not the project...
        std::fs::create_dir_all(d.join("proj-host/checkpoints")).unwrap();
        assert!(
            run().is_some(),
            "an empty project path was taken for the project"
        );
        // ...one with the project's files is.
        std::fs::write(d.join("proj-host/train.py"), "print(1)").unwrap();
        assert!(run().is_none(), "the host's project directory was not used");
    }

    /// A host whose `find` has no `-printf` (busybox) cannot list names, kinds and executable bits: its cached copy
    /// is replaced on every run, not kept because two empty listings are equal.
    #[test]
    fn a_host_whose_find_has_no_printf_gets_its_cached_copy_replaced() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let proj = d.join("proj");
        std::fs::create_dir_all(&proj).unwrap();
        std::fs::write(proj.join("train.py"), "print(1)").unwrap();
        std::fs::create_dir_all(d.join("bin")).unwrap();
        executable(
            d.join("bin/find"),
            "#!/bin/sh\nfor a in \"$@\"; do [ \"$a\" = -printf ] && { echo 'find: unrecognized: -printf' >&2; \
             exit 1; }; done\nexec /usr/bin/find \"$@\"\n",
        );
        let ssh = elsewhere_ssh(d, &proj, Some(&d.join("bin")));
        let run = || delivered_work_dir(&ssh, &proj).expect("delivered");
        let first = run();
        let name = first.file_name().unwrap().to_string_lossy().into_owned();
        let cached = first.with_file_name(name.split_once(".run.").unwrap().0);
        // An executable bit `diff` does not see: only the listing would.
        std::fs::set_permissions(
            cached.join("train.py"),
            std::fs::Permissions::from_mode(0o555),
        )
        .unwrap();
        let second = run();
        let mode = std::fs::metadata(second.join("train.py"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o111, 0, "the changed copy was kept: {mode:o}");
    }

    #[test]
    fn a_host_that_stalls_is_stopped_at_the_deadline_naming_the_phase() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        // Authenticates, then answers nothing and never exits.
        let ssh = executable(d.join("stalling-ssh"), "#!/bin/sh\nexec sleep 600\n");
        let mut s = setup(Some("lo"));
        s.ssh = vec![ssh.display().to_string()];
        s.hosts = vec![("slow".into(), 1)];
        s.deadlines.check = std::time::Duration::from_secs(1);
        let err = s.check_hosts(d, None, &[]).unwrap_err().to_string();
        assert!(
            err.contains("the host check on host `slow` did not finish within 1 s"),
            "{err}"
        );
        // Copying the project's files to a host that stalls while reading them stops too.
        std::fs::write(
            &ssh,
            "#!/bin/sh\ncase \"$*\" in *hvd-check:done*) echo hvd-check:no-dir; echo hvd-check:done;; \
             *) exec sleep 600;; esac\n",
        )
        .unwrap();
        s.deadlines.copy = std::time::Duration::from_secs(1);
        std::fs::write(d.join("train.py"), "print(1)").unwrap();
        let err = s.check_hosts(d, None, &[]).unwrap_err().to_string();
        assert!(
            err.contains("copying the project's files on host `slow` did not finish within 1 s"),
            "{err}"
        );
    }

    #[test]
    fn what_a_host_writes_to_stderr_cannot_drive_the_terminal() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let ssh = executable(
            d.join("noisy-ssh"),
            "#!/bin/sh\nprintf 'denied\\033[2J\\033]0;owned\\007\\rfake ok\\n' >&2; exit 255\n",
        );
        let mut s = setup(Some("lo"));
        s.ssh = vec![ssh.display().to_string()];
        s.hosts = vec![("h".into(), 1)];
        let err = s.check_hosts(d, None, &[]).unwrap_err().to_string();
        assert!(!err.chars().any(|c| c.is_control() && c != '\n'), "{err:?}");
        assert!(err.contains("denied\\u{1b}[2J"), "{err}");
        assert!(err.contains("\\rfake ok"), "{err}");
    }

    /// Writes wheel store path `name` built from `wheel` (its `.hvd-path.json` as the builder writes one).
    fn wheel_path(store: &Path, name: &str, wheel: &str) {
        let path = store.join(name);
        std::fs::create_dir_all(&path).unwrap();
        let json = serde_json::json!({"schema": 1, "content_hash": "cw", "references": [],
            "derivation": {"kind": "wheel", "inputs": {"artifact.filename": wheel}}});
        std::fs::write(path.join(".hvd-path.json"), json.to_string()).unwrap();
    }

    #[test]
    fn a_host_whose_glibc_is_older_than_a_wheel_needs_is_refused_naming_both() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let mut s = setup(Some("lo"));
        s.ssh = vec![fake_ssh(d).display().to_string()];
        s.hosts = vec![("a".into(), 1)];
        for (store, needs) in [
            ("store", "manylinux_2_999_x86_64"),
            ("store-a", "manylinux_2_999_x86_64"),
        ] {
            store_path(&d.join(store), E1, "c1", &[P1]);
            wheel_path(
                &d.join(store),
                P1,
                &format!("x-2.0-cp311-cp311-{needs}.whl"),
            );
        }
        let env = d.join("store").join(E1);
        let err = s.check_hosts(d, Some(&env), &[]).unwrap_err().to_string();
        assert!(err.contains("host `a` has glibc 2."), "{err}");
        assert!(
            err.contains("wheel `x-2.0-cp311-cp311-manylinux_2_999_x86_64.whl` needs glibc 2.999"),
            "{err}"
        );
        // The same env with a wheel of the oldest manylinux passes; the local engine checks this machine alike.
        for store in ["store", "store-a"] {
            std::fs::remove_dir_all(d.join(store).join(P1)).unwrap();
            wheel_path(
                &d.join(store),
                P1,
                "x-2.0-cp311-cp311-manylinux1_x86_64.whl",
            );
        }
        s.check_hosts(d, Some(&env), &[]).unwrap();
        let identity = EnvIdentity::local(&env).unwrap().unwrap();
        assert_eq!(identity.glibc.unwrap().version, (2, 5));
    }

    /// A stand-in for ssh like [`fake_ssh`] that also reads `/etc/ld.so.conf` (and `.d/`) as `etc-HOST/ld.so.conf`:
    /// each host has a dynamic linker configuration of its own.
    fn fake_ssh_with_ld_conf(dir: &Path) -> PathBuf {
        executable(
            dir.join("fake-ssh-ld"),
            format!(
                "#!/bin/sh\nwhile [ \"$1\" != -- ]; do host=$1; shift; done; shift\n\
                 exec /bin/sh -c \"$(printf '%s' \"$*\" | sed -e \"s#/store/#/store-$host/#g\" \
                 -e \"s#/etc/ld.so.conf#{}/etc-$host/ld.so.conf#g\")\"\n",
                dir.display()
            ),
        )
    }

    /// Host libraries are checked on each host by the rule of this machine's check (`closure::check_env_here`), on
    /// the host's own linker configuration: a library the interpreter's executable needs that a host lacks fails
    /// the start naming the host and the library; one only an extension module needs does not.
    #[test]
    fn a_host_without_a_library_the_interpreter_needs_is_refused_naming_both() {
        const PY: &str = "33333333333333333333333333333333-python-3.11.7";
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        let libs = d.join("libs");
        std::fs::create_dir_all(&libs).unwrap();
        std::fs::write(libs.join("libhvd-only-on-a.so.1"), "").unwrap();
        // Host a's linker searches `libs/`, b's does not (its configuration names a directory without it).
        for (host, conf) in [("a", libs.clone()), ("b", d.join("empty"))] {
            std::fs::create_dir_all(d.join(format!("etc-{host}/ld.so.conf.d"))).unwrap();
            std::fs::write(
                d.join(format!("etc-{host}/ld.so.conf")),
                "include /etc/ld.so.conf.d/*.conf\n",
            )
            .unwrap();
            std::fs::write(
                d.join(format!("etc-{host}/ld.so.conf.d/test.conf")),
                format!("# for the test\n{}\n", conf.display()),
            )
            .unwrap();
        }
        let write_env = |libraries: &str| {
            for store in ["store", "store-a", "store-b"] {
                let store = d.join(store);
                let _ = std::fs::remove_dir_all(&store);
                store_path(&store, E1, "c1", &[PY]);
                let python = store.join(PY);
                std::fs::create_dir_all(python.join("lib")).unwrap();
                let json = serde_json::json!({"schema": 1, "content_hash": "cp", "references": [],
                    "derivation": {"kind": "interpreter", "inputs": {}}});
                std::fs::write(python.join(".hvd-path.json"), json.to_string()).unwrap();
                std::fs::write(python.join("lib/hvd-host-libraries"), libraries).unwrap();
            }
            d.join("store").join(E1)
        };
        let mut s = setup(Some("lo"));
        s.ssh = vec![fake_ssh_with_ld_conf(d).display().to_string()];
        s.hosts = vec![("a".into(), 1), ("b".into(), 1)];
        let env =
            write_env("libhvd-only-on-a.so.1 bin/python3.11\nlibm.so.6 lib/libpython3.11.so.1.0\n");
        let err = s.check_hosts(d, Some(&env), &[]).unwrap_err().to_string();
        assert!(
            err.contains("host `b` lacks the shared library `libhvd-only-on-a.so.1`"),
            "{err}"
        );
        assert!(err.contains(PY) && err.contains("bin/python3.11"), "{err}");
        assert!(!err.contains("host `a`"), "host a's linker finds it: {err}");
        assert!(!err.contains("libm.so.6"), "every host has libm: {err}");
        // Only an extension module needs it: a warning, both hosts pass; so does a host that has it.
        let env = write_env("libhvd-only-on-a.so.1 lib/python3.11/lib-dynload/_x.so\n");
        s.check_hosts(d, Some(&env), &[]).unwrap();
        s.hosts = vec![("a".into(), 1)];
        let env = write_env("libhvd-only-on-a.so.1 bin/python3.11\n");
        s.check_hosts(d, Some(&env), &[]).unwrap();
    }

    #[test]
    fn store_path_names_follow_the_grammar() {
        for good in [E1, P1, "0123456789abcdef0123456789abcdef-torch-2.1.0+cpu"] {
            assert!(is_store_path_name(good), "{good}");
        }
        for bad in [
            "",
            "..",
            "e1-t-env",
            "-0123456789abcdef0123456789abcdef-t-1",
            "0123456789ABCDEF0123456789abcdef-t-1",
            "0123456789abcdef0123456789abcdef-",
            "0123456789abcdef0123456789abcdef-a/b",
            "0123456789abcdef0123456789abcdef-..",
            "0123456789abcdef0123456789abcdef-a b",
            "0123456789abcdef0123456789abcdef-a\nb",
        ] {
            assert!(!is_store_path_name(bad), "{bad:?}");
        }
        // A damaged `.hvd-path.json` here is a clear error, not a name sent anywhere.
        let dir = tempfile::tempdir().unwrap();
        let env = store_path(dir.path(), E1, "c1", &["../../etc"]);
        let err = EnvIdentity::local(&env).unwrap_err().to_string();
        assert!(err.contains("not a store path name"), "{err}");
        let env = store_path(dir.path(), P1, "c1", &[P2]);
        let err = EnvIdentity::local(&env).unwrap_err().to_string();
        assert!(
            err.contains(&format!("store path {P2}, which the env needs")),
            "{err}"
        );
    }
}
