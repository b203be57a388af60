//! One module per engine, each behind one of the two traits of [`crate::engine`], and what they share: host lists,
//! the variables passed on to ranks an engine starts itself, and reading the rank tags of their output. An engine
//! that starts the ranks itself (mpirun, srun, a Spark driver) is one supervised process per distributed step,
//! whose ranks get the worker contract from the shim ([`shim`], `hvd worker-env -- CMD`). Which module runs which
//! engine name is decided in one place, `run.rs`.

use crate::LaunchError;

pub mod k8s;
pub mod k8s_pods;
pub mod kubectl;
pub mod mpi;
pub mod net;
pub mod sbatch;
pub mod shell;
pub mod shim;
pub mod slurm;
pub mod slurm_steps;
pub mod spark;
pub mod ssh;

/// The flags of a run that shape a step, for an `hvd run --step S --no-deps` of its own (a slurm batch job's, a
/// Kubernetes launcher pod's): `--workers`, `--max-workers`, `--min-workers`, `--max-restarts`, `--grace`,
/// `--start-timeout`, `--elastic-timeout` and `--blacklist-cooldown-range`, as given (the file says the rest), and
/// `-v` as often as it was given (up to 3).
pub(crate) fn step_flags(options: &crate::options::RunOptions) -> Vec<String> {
    let mut flags: Vec<String> = [
        ("workers", options.workers),
        ("max-workers", options.max_workers),
        ("min-workers", options.min_workers),
        ("max-restarts", options.max_restarts),
    ]
    .into_iter()
    .filter_map(|(flag, n)| Some(format!("--{flag}={}", n?)))
    .collect();
    let seconds = |d: std::time::Duration| d.as_secs_f64().to_string();
    flags.push(format!("--grace={}", seconds(options.grace)));
    if let Some(t) = options.start_timeout {
        flags.push(format!("--start-timeout={}", seconds(t)));
    }
    if let Some(t) = options.elastic_timeout {
        flags.push(format!("--elastic-timeout={}", seconds(t)));
    }
    if let Some(c) = &options.blacklist_cooldown {
        flags.extend([
            "--blacklist-cooldown-range".into(),
            c.min.as_secs().to_string(),
            c.max.as_secs().to_string(),
        ]);
    }
    // At most trace's (`-vvv`): more says nothing more, and the count is the user's.
    flags.extend((0..options.verbose.min(3)).map(|_| "-v".to_owned()));
    flags
}

/// A worker's line as `hvd run` writes it without colour: `[STEP HOST:RANK] TEXT` -> (step, host, rank, text) (the
/// launcher of a step in a batch job, or in a launcher pod).
pub(crate) fn console_line(line: &str) -> Option<(&str, &str, u32, &str)> {
    let (inside, text) = line.strip_prefix('[')?.split_once("] ")?;
    let (step, at) = inside.split_once(' ')?;
    let (host, rank) = at.rsplit_once(':')?;
    Some((step, host, rank.parse().ok()?, text))
}

/// The command a node runs before its ranks start to get the plan's env from the binary caches into its own store
/// (`hvd cache pull --store STORE ENV --cache=URL... --trusted-key=KEY...`, into the env's store directory: a store
/// path is valid only at the directory it was built for). `None` when there is no env, its name is not a store
/// path's, or no cache is given. The env need not be here: a login node that only submits may lack it.
///
/// The command line ends up in batch scripts, the scheduler's records and every node's process list, so a cache
/// URL carrying credentials (`https://user:token@...`, `?token=...`) is refused: credentials come from the environment (S3's
/// `AWS_*`, which `sbatch` exports), never from a written command.
pub fn pull_argv(
    plan: &crate::Plan,
    shim: &std::path::Path,
) -> Result<Option<Vec<String>>, LaunchError> {
    pull_argv_for(
        plan.env_dir.as_deref(),
        &plan.caches,
        &plan.trusted_keys,
        shim,
    )
}

/// [`pull_argv`] from the env, caches and keys themselves (an engine that reads them from the run's options).
pub fn pull_argv_for(
    env: Option<&std::path::Path>,
    caches: &[String],
    trusted_keys: &[String],
    shim: &std::path::Path,
) -> Result<Option<Vec<String>>, LaunchError> {
    let Some(env) = env else {
        return Ok(None);
    };
    let (Some(store), Some(name)) = (env.parent(), env.file_name().and_then(|n| n.to_str())) else {
        return Ok(None);
    };
    if caches.is_empty() || !crate::closure::is_store_path_name(name) {
        return Ok(None);
    }
    let (Some(store), Some(shim)) = (store.to_str(), shim.to_str()) else {
        return Err(LaunchError::Engine(format!(
            "the env's store directory {} or the hvd binary {} is not UTF-8; a batch script cannot name it",
            store.display(),
            shim.display()
        )));
    };
    pull_command(shim, store, name, caches, trusted_keys).map(Some)
}

/// `PROGRAM cache pull --store=STORE NAME --cache=URL... --trusted-key=KEY...`: what a node runs to get store path
/// `NAME` (with its closure) from the caches, verified, into `STORE`. A cache URL with credentials is refused (see
/// [`pull_argv`]); the keys are `NAME:BASE64` texts, which are public.
pub fn pull_command(
    program: &str,
    store: &str,
    name: &str,
    caches: &[String],
    trusted_keys: &[String],
) -> Result<Vec<String>, LaunchError> {
    let mut argv = vec![
        program.to_owned(),
        "cache".to_owned(),
        "pull".to_owned(),
        format!("--store={store}"),
        name.to_owned(),
    ];
    for url in caches {
        if has_credentials(url) {
            return Err(LaunchError::Engine(format!(
                "the cache `{}` carries credentials in its URL (user info, or a query string such as a token or \
                 a presigned signature); hvd does not write them into batch scripts, manifests or command lines: \
                 give the URL without them and the credentials through the environment (for S3 the AWS \
                 variables, which sbatch exports)",
                redact(url)
            )));
        }
        argv.push(format!("--cache={url}"));
    }
    for key in trusted_keys {
        argv.push(format!("--trusted-key={key}"));
    }
    Ok(argv)
}

/// `PROGRAM worker-env [--once] --pull=ENV --cache=URL... --trusted-key=KEY...`, from a node's pull command `pull`
/// ([`pull_command`] or [`pull_argv`], for the env `env`): the shim pulls the env (or finds it, pulled already) and
/// keeps a temporary gc root on it across `exec`, so an `hvd gc` on the node cannot remove it before or while the
/// command after it (`-- CMD`, the caller's) runs. `once`: a command that is not a rank (no rank variables).
pub fn worker_pull_argv(pull: &[String], env: &str, once: bool) -> Vec<String> {
    let mut argv = vec![
        pull.first().cloned().unwrap_or_default(),
        "worker-env".to_owned(),
    ];
    if once {
        argv.push("--once".to_owned());
    }
    argv.push(format!("--pull={env}"));
    // After `PROGRAM cache pull --store=STORE NAME`: the caches and keys.
    argv.extend(pull.iter().skip(5).cloned());
    argv
}

/// Whether `url` may carry a secret: a user-info part (`scheme://user[:secret]@host...`), or a query string or
/// fragment (`?token=...`, a presigned `?X-Amz-Signature=...`), which a cache URL never needs (hvd appends object
/// names to it).
fn has_credentials(url: &str) -> bool {
    url.split_once("://")
        .map(|(_, rest)| {
            rest.contains(['?', '#'])
                || rest
                    .split(['/', '?', '#'])
                    .next()
                    .unwrap_or("")
                    .contains('@')
        })
        .unwrap_or(false)
}

/// `url` with its user-info part replaced by `***` and its query string or fragment by `?***`.
fn redact(url: &str) -> String {
    match url.split_once("://") {
        Some((scheme, rest)) if has_credentials(url) => {
            let (rest, query) = match rest.find(['?', '#']) {
                Some(at) => (&rest[..at], "?***"),
                None => (rest, ""),
            };
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            match authority.rsplit_once('@') {
                Some((_, host)) => format!("{scheme}://***@{host}{path}{query}"),
                None => format!("{scheme}://{rest}{query}"),
            }
        }
        _ => url.to_owned(),
    }
}

/// Parses `host:slots` (slots default 1).
pub fn parse_host(entry: &str) -> Result<(String, u32), LaunchError> {
    let bad = || {
        LaunchError::Engine(format!(
            "host `{entry}` is not `NAME` or `NAME:SLOTS` with SLOTS a positive number"
        ))
    };
    match entry.rsplit_once(':') {
        None if !entry.is_empty() => Ok((entry.to_owned(), 1)),
        None => Err(bad()),
        Some((host, slots)) => {
            let slots: u32 = slots.parse().map_err(|_| bad())?;
            if host.is_empty() || slots == 0 {
                return Err(bad());
            }
            Ok((host.to_owned(), slots))
        }
    }
}

/// The hosts of the mpi and ssh engines: `--hosts`/`--hostfile` (`RunOptions::hosts`), else `cluster { hosts }`.
pub fn hosts(
    project: &hvd_lang::model::Project,
    options: &crate::options::RunOptions,
) -> Result<Vec<(String, u32)>, LaunchError> {
    let entries = match &options.hosts {
        Some(hosts) => hosts.as_slice(),
        None => project.cluster.as_ref().map_or(&[][..], |c| &c.hosts[..]),
    };
    entries.iter().map(|h| parse_host(h)).collect()
}

/// Reads a hostfile: `host slots=N` lines (`host` alone: 1 slot; `#` comments and blank lines ignored), as
/// `host:N` entries.
pub fn parse_hostfile(text: &str) -> Result<Vec<String>, LaunchError> {
    let mut hosts = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or_default().trim();
        if line.is_empty() {
            continue;
        }
        let mut words = line.split_whitespace();
        let host = words.next().unwrap_or_default();
        let mut slots = 1u32;
        for word in words {
            let n = word
                .strip_prefix("slots=")
                .and_then(|n| n.parse::<u32>().ok())
                .filter(|n| *n > 0)
                .ok_or_else(|| {
                    LaunchError::Engine(format!(
                        "hostfile line {}: `{word}` is not `slots=N` with N a positive number",
                        i + 1
                    ))
                })?;
            slots = n;
        }
        hosts.push(format!("{host}:{slots}"));
    }
    Ok(hosts)
}

/// The variables an engine that starts the ranks itself (mpirun, a Spark driver) passes on to them: what the shim
/// needs to build the worker contract, the env's, and the step's own `env`.
pub fn exported_vars(
    env: &std::collections::BTreeMap<String, String>,
    has_env_dir: bool,
) -> Vec<String> {
    let mut export: Vec<String> = [
        "PATH",
        "PYTHONUNBUFFERED",
        "HVD_RENDEZVOUS",
        "HVD_JOB_TOKEN",
        "MASTER_PORT",
        shim::GPUS_VAR,
        crate::env::STEP_MARKER_VAR,
    ]
    .iter()
    .map(|s| (*s).to_owned())
    .collect();
    if has_env_dir {
        export.push("VIRTUAL_ENV".into());
    }
    for k in env.keys() {
        if !export.contains(k) {
            export.push(k.clone());
        }
    }
    export
}

/// Reads the rank tag mpirun or srun puts in front of a line: OpenMPI's `--tag-output` (`[1,R]<stdout>:text`),
/// MPICH's `-prepend-rank` (`[R] text`), srun's `--label` (`R: text`, the rank right-aligned). Returns the rank, the
/// stream named in the tag (OpenMPI) and the rest of the line.
pub fn untag(line: &str) -> Option<(u32, Option<crate::Stream>, &str)> {
    if let Some(rest) = line.strip_prefix('[') {
        let (inside, after) = rest.split_once(']')?;
        let rank = match inside.split_once(',') {
            Some((job, rank)) if job.bytes().all(|b| b.is_ascii_digit()) => rank,
            Some(_) => return None,
            None => inside,
        };
        let rank: u32 = rank.parse().ok()?;
        for (tag, stream) in [
            ("<stdout>:", crate::Stream::Stdout),
            ("<stderr>:", crate::Stream::Stderr),
        ] {
            if let Some(text) = after.strip_prefix(tag) {
                return Some((rank, Some(stream), text));
            }
        }
        return Some((rank, None, after.strip_prefix(' ').unwrap_or(after)));
    }
    let trimmed = line.trim_start_matches(' ');
    let (rank, text) = trimmed.split_once(": ")?;
    if rank.is_empty() || !rank.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    Some((rank.parse().ok()?, None, text))
}

/// The first failing rank and its exit code, from what mpirun, srun or the shim said on stderr: OpenMPI's
/// `Process name: [[J,1],R]` followed by `Exit code: N`, srun's `task R: Exited with exit code N`, the shim's
/// `hvd worker-env: rank R failed (exit status: N)`. A rank's own output can say the same (the launcher labels the
/// shim's lines as the rank's), so an exit code 0 is never taken: a failed step must not end `hvd run` with 0.
pub fn failing_rank(stderr: &[String]) -> Option<(u32, i32)> {
    failing_rank_said(stderr).filter(|&(_, code)| code != 0)
}

fn failing_rank_said(stderr: &[String]) -> Option<(u32, i32)> {
    let number = |s: &str| -> Option<i64> {
        let digits: String = s
            .trim_start()
            .chars()
            .take_while(|c| c.is_ascii_digit())
            .collect();
        digits.parse().ok()
    };
    let mut openmpi_rank: Option<u32> = None;
    for line in stderr {
        let line = untag(line).map_or(line.as_str(), |(_, _, rest)| rest);
        if let Some((_, rest)) = line
            .split_once("hvd worker-env: rank ")
            .or_else(|| line.split_once("hvd spark: rank "))
            && let Some((rank, code)) = rest.split_once(" failed (exit status: ")
        {
            return Some((
                rank.trim().parse().ok()?,
                i32::try_from(number(code)?).ok()?,
            ));
        }
        if let Some((_, rest)) = line.split_once(": task ")
            && let Some((rank, code)) = rest.split_once(": Exited with exit code ")
        {
            return Some((
                rank.trim().parse().ok()?,
                i32::try_from(number(code)?).ok()?,
            ));
        }
        if let Some((_, rest)) = line.split_once("Process name: [[") {
            openmpi_rank = rest
                .split_once("],")
                .and_then(|(_, r)| number(r))
                .and_then(|r| u32::try_from(r).ok());
        }
        if let Some(rank) = openmpi_rank
            && let Some((_, code)) = line.split_once("Exit code:")
        {
            return Some((rank, i32::try_from(number(code)?).ok()?));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Stream;

    #[test]
    fn the_failing_rank_is_read_from_each_launcher() {
        let lines = |text: &str| text.lines().map(str::to_owned).collect::<Vec<_>>();
        let openmpi =
            lines("[1,1]<stderr>:boom\n  Process name: [[13393,1],1]\n  Exit code:    3\n----");
        assert_eq!(failing_rank(&openmpi), Some((1, 3)));
        let srun = lines(
            "1: boom\nsrun: error: vm: task 1: Exited with exit code 3\nsrun: error: vm: task 0: Terminated",
        );
        assert_eq!(failing_rank(&srun), Some((1, 3)));
        let mpich =
            lines("[1] boom\n[1] hvd worker-env: rank 1 failed (exit status: 7); ending the job");
        assert_eq!(failing_rank(&mpich), Some((1, 7)));
        // A rank that prints srun's message with code 0 before failing does not make the failure a success.
        let forged = lines(
            "0: srun: error: vm: task 0: Exited with exit code 0\nsrun: error: vm: task 0: Terminated",
        );
        assert_eq!(failing_rank(&forged), None);
        let spark = lines("[1] hvd spark: rank 1 failed (exit status: 3); ending the job");
        assert_eq!(failing_rank(&spark), Some((1, 3)));
        assert_eq!(failing_rank(&lines("something else")), None);
    }

    #[test]
    fn hosts_and_hostfiles_are_read() {
        assert_eq!(parse_host("a:4").unwrap(), ("a".to_string(), 4));
        assert_eq!(parse_host("b").unwrap(), ("b".to_string(), 1));
        assert!(
            parse_host("c:0").is_err() && parse_host("c:x").is_err() && parse_host(":2").is_err()
        );
        assert_eq!(
            parse_hostfile("# hosts\nh1 slots=4\n\nh2\n").unwrap(),
            ["h1:4", "h2:1"]
        );
        let err = parse_hostfile("h1 slots=four").unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
    }

    /// Secrets a cache URL can carry (user info, a token or presigned signature in the query string) never reach a
    /// command line, batch script or manifest, nor the error that refuses them.
    #[test]
    fn cache_urls_with_user_info_or_a_query_string_are_refused_without_showing_it() {
        let pull = |url: &str| pull_command("hvd", "/s", "n", &[url.to_owned()], &[]);
        for (url, shown) in [
            (
                "https://me:s3cr3t@cache.example/p",
                "https://***@cache.example/p",
            ),
            (
                "https://cache.example/p?token=s3cr3t",
                "https://cache.example/p?***",
            ),
            (
                "https://b.s3.example/c?X-Amz-Algorithm=A&X-Amz-Signature=s3cr3t",
                "https://b.s3.example/c?***",
            ),
            ("s3://bucket/c#s3cr3t", "s3://bucket/c?***"),
            ("http://u@h:1/a@b?x=s3cr3t", "http://***@h:1/a@b?***"),
        ] {
            let err = pull(url).unwrap_err().to_string();
            assert!(err.contains("carries credentials"), "{url}: {err}");
            assert!(err.contains(shown), "{url}: {err}");
            assert!(!err.contains("s3cr3t"), "{url}: {err}");
        }
        for url in [
            "https://cache.example/a@b",
            "s3://bucket/c",
            "/dir/a?b",
            "file:///c",
        ] {
            let argv = pull(url).unwrap();
            assert_eq!(argv.last().unwrap(), &format!("--cache={url}"));
        }
    }

    #[test]
    fn tags_of_mpirun_and_srun_are_read() {
        assert_eq!(
            untag("[1,3]<stderr>:boom"),
            Some((3, Some(Stream::Stderr), "boom"))
        );
        assert_eq!(untag("[2] hello [x]"), Some((2, None, "hello [x]")));
        assert_eq!(untag(" 1: a: b"), Some((1, None, "a: b")));
        assert_eq!(untag("plain line"), None);
        assert_eq!(untag("[warn] something"), None);
        assert_eq!(untag("srun: error: vm: task 1"), None);
    }
}
