//! Host discovery for elastic steps (`--host-discovery-script`, Horovod's contract): runs the user's script under a
//! deadline, reads the `host:slots` lines it prints (or bare host names, given `--slots-per-host`), and keeps the
//! blacklist of hosts whose workers failed, with its cooldown range (`--blacklist-cooldown-range`).
//!
//! The script is the user's, but what it prints (and whether it ends) is not trusted: a script that fails, hangs past
//! the deadline (its process group is killed) or prints a line that is not `host:slots` (nor, with slots per host, a
//! host name) yields a [`DiscoveryError`] naming the script and the line, and the caller keeps the hosts it has.

use std::collections::BTreeMap;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

/// How often a running step's script is run again.
pub const INTERVAL: Duration = Duration::from_secs(1);
/// The most output read from one run; more is an error.
const MAX_OUTPUT: usize = 64 * 1024;
/// The longest line shown in a warning.
const SHOWN: usize = 120;
/// Failures of a host's workers that blacklist it, and the default cooldown range ([`Cooldown`]): 60 s the first
/// time, doubled each time it is blacklisted again, at most 10 min (before [`Cooldown::jittered`]).
pub const BLACKLIST_FAILURES: u32 = 2;
pub const FIRST_COOLDOWN: Duration = Duration::from_secs(60);
pub const MAX_COOLDOWN: Duration = Duration::from_secs(600);
/// The bounds of `--blacklist-cooldown-range` (and the file's `workers = { cooldown }`) in seconds (Horovod's: at
/// least 1 s, at most an hour).
pub const COOLDOWN_BOUNDS: (u64, u64) = hvd_lang::model::COOLDOWN_SECONDS;
/// The random part of a cooldown: up to this fraction (1/JITTER_PART) of it ([`Cooldown::jittered`]).
pub const JITTER_PART: u32 = 4;

/// How long a blacklisted host stays out (`--blacklist-cooldown-range MIN MAX`, Horovod's flag; the file's
/// `workers = { cooldown = [MIN, MAX] }`): `min` the first time, doubled each time the host is blacklisted again, at
/// most `max`, with a random part ([`Cooldown::jittered`]) so that hosts blacklisted together do not all come back at
/// the same instant; never shorter than `min` nor longer than `max`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Cooldown {
    pub min: Duration,
    pub max: Duration,
}

impl Default for Cooldown {
    fn default() -> Self {
        Cooldown {
            min: FIRST_COOLDOWN,
            max: MAX_COOLDOWN,
        }
    }
}

impl Cooldown {
    /// The range `min`..`max` seconds, checked: whole seconds within [`COOLDOWN_BOUNDS`], `min` at most `max`.
    pub fn from_seconds(min: u64, max: u64) -> Result<Cooldown, String> {
        let (low, high) = COOLDOWN_BOUNDS;
        if min < low || max > high {
            return Err(format!(
                "`--blacklist-cooldown-range {min} {max}`: each bound is a number of seconds from {low} to {high}"
            ));
        }
        if min > max {
            return Err(format!(
                "`--blacklist-cooldown-range {min} {max}`: the first number (the shortest cooldown) is above the \
                 second (the longest)"
            ));
        }
        Ok(Cooldown {
            min: Duration::from_secs(min),
            max: Duration::from_secs(max),
        })
    }

    /// The cooldown of a host's `times`-th blacklisting after its first (0: the first), before its random part.
    fn nth(&self, times: u32) -> Duration {
        self.min.saturating_mul(1 << times.min(16)).min(self.max)
    }

    /// The cooldown of a host's `times`-th blacklisting, with `random` (any `u64`, uniform) for its random part:
    /// `d` = [`Cooldown::nth`] lengthened by `random`'s share of `d` / [`JITTER_PART`]; a length past `max` is taken
    /// off `max` instead (reflected there: a host at `max` comes back from 3/4 `max` to `max`), and none is below
    /// `min`. So every cooldown is from `min` to `max`, `min == max` is exact, and `random` = 0 gives `d` itself.
    /// (Horovod adds up to one `min` and then cuts at its upper limit, where hosts meet again.)
    pub fn jittered(&self, times: u32, random: u64) -> Duration {
        let d = self.nth(times);
        let spread = d.as_nanos() / u128::from(JITTER_PART);
        // random / 2^64 of the spread: below the spread, never past it.
        let extra = (spread * u128::from(random)) >> 64;
        let longer = d.as_nanos() + extra;
        let max = self.max.as_nanos();
        let nanos = match longer > max {
            true => max.saturating_sub(longer - max),
            false => longer,
        };
        Duration::from_nanos(u64::try_from(nanos).unwrap_or(u64::MAX))
            .max(self.min)
            .min(self.max)
    }
}

/// A random `u64` from the OS (`getrandom(2)`); should that fail, the hash of nothing under a new
/// [`RandomState`](std::collections::hash_map::RandomState): its keys are the randomness (seeded once per thread by
/// the standard library, then stepped on each `new`, so two calls differ), which is random enough for spreading
/// cooldowns.
pub fn os_random() -> u64 {
    let mut b = [0u8; 8];
    // SAFETY: `b` is a valid buffer of `b.len()` bytes for the kernel to fill.
    let r = unsafe { libc::getrandom(b.as_mut_ptr().cast(), b.len(), 0) };
    if usize::try_from(r).is_ok_and(|n| n == b.len()) {
        return u64::from_ne_bytes(b);
    }
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

/// One line of the script's output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostSlots {
    pub host: String,
    pub slots: u32,
}

/// Why one run of the script gave no hosts.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    #[error("host discovery script `{script}` could not be started")]
    Start {
        script: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("host discovery script `{script}` did not finish within {} s (killed)", .timeout.as_secs_f64())]
    Timeout { script: PathBuf, timeout: Duration },
    #[error("host discovery script `{script}` failed ({status}){}", stderr_text(.stderr))]
    Failed {
        script: PathBuf,
        status: String,
        stderr: String,
    },
    #[error(
        "host discovery script `{script}` printed line {line} {text:?}, which is not `host:slots`{}",
        match .bare { true => " or a host name", false => "" }
    )]
    BadLine {
        script: PathBuf,
        line: usize,
        text: String,
        /// Whether bare host names were taken too (`--slots-per-host`).
        bare: bool,
    },
    #[error("host discovery script `{script}` printed more than {} KiB", MAX_OUTPUT / 1024)]
    TooLong { script: PathBuf },
    /// Exit 0 with no `host:slots` line: taken for a failed run (a script that lost its source of hosts), not for
    /// "no hosts any more", which would remove every worker above the minimum.
    #[error("host discovery script `{script}` printed no `host:slots` line")]
    NoHosts { script: PathBuf },
}

fn stderr_text(stderr: &str) -> String {
    match stderr.trim() {
        "" => String::new(),
        s => format!(": {}", clip(s.lines().last().unwrap_or(s))),
    }
}

fn clip(s: &str) -> String {
    match s.char_indices().nth(SHOWN) {
        Some((at, _)) => format!("{}...", &s[..at]),
        None => s.to_owned(),
    }
}

/// Parses the script's output: one `host:slots` per line (blank lines skipped; the host may not be empty or hold
/// white space, the slots are ASCII digits). With `slots_per_host` (`--slots-per-host`, Horovod's `--slots`) a line
/// may also be a host name alone, which gets that many slots. An IPv6 address is written in brackets (`[::1]`,
/// `[::1]:2`): a host name with `:` once the slots are split off, an empty one, or unbalanced brackets, is refused
/// naming the line. Output without
/// any such line is an error ([`DiscoveryError::NoHosts`]).
pub fn parse(
    script: &Path,
    output: &str,
    slots_per_host: Option<u32>,
) -> Result<Vec<HostSlots>, DiscoveryError> {
    let mut hosts = Vec::new();
    for (i, raw) in output.lines().enumerate() {
        let line = raw.trim();
        if line.is_empty() {
            continue;
        }
        let bad = || DiscoveryError::BadLine {
            script: script.to_path_buf(),
            line: i + 1,
            text: clip(raw),
            bare: slots_per_host.is_some(),
        };
        let bare = !line.contains(':') || (line.starts_with('[') && line.ends_with(']'));
        let (host, slots) = match (bare, slots_per_host) {
            (true, Some(n)) => (line, n.to_string()),
            _ => line
                .rsplit_once(':')
                .map(|(h, s)| (h, s.to_owned()))
                .ok_or_else(bad)?,
        };
        let digits = !slots.is_empty() && slots.bytes().all(|b| b.is_ascii_digit());
        // An IPv6 address only in brackets, balanced: an unbracketed host holding `:` once the slots are split
        // off (`fe80::1` taken as `fe80:` with 1 slot) is no host.
        let host = match host.strip_prefix('[') {
            Some(inner) => inner.strip_suffix(']'),
            None if host.contains(':') || host.contains(']') => None,
            None => Some(host),
        };
        let host = host.filter(|h| {
            !h.is_empty()
                && h.chars()
                    .all(|c| !c.is_whitespace() && !c.is_control() && !matches!(c, '/' | '[' | ']'))
        });
        let (slots, host) = match (digits, host) {
            (true, Some(host)) => (slots.parse::<u32>().map_err(|_| bad())?, host),
            _ => return Err(bad()),
        };
        hosts.push(HostSlots {
            host: host.to_owned(),
            slots,
        });
    }
    if hosts.is_empty() {
        return Err(DiscoveryError::NoHosts {
            script: script.to_path_buf(),
        });
    }
    Ok(hosts)
}

/// A discovery program: `path` with `args`, named `label` in what hvd says about it (a script: its path, no
/// arguments; an engine's own, e.g. the kubernetes engine's `kubectl get pods ...` in a launcher pod).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Program {
    pub path: PathBuf,
    pub args: Vec<String>,
    pub label: PathBuf,
}

impl Program {
    /// The user's script: run as it is, named by its path.
    pub fn script(path: &Path) -> Program {
        Program {
            path: path.to_path_buf(),
            args: Vec::new(),
            label: path.to_path_buf(),
        }
    }
}

/// Runs `script` once in `dir` (its own process group, no stdin) and parses what it prints ([`parse`], with
/// `slots_per_host`); past `timeout` its process group is killed.
pub fn run_script(
    script: &Path,
    dir: &Path,
    timeout: Duration,
    slots_per_host: Option<u32>,
) -> Result<Vec<HostSlots>, DiscoveryError> {
    run_program(&Program::script(script), dir, timeout, slots_per_host)
}

/// [`run_script`] for any [`Program`]; errors name its label.
pub fn run_program(
    program: &Program,
    dir: &Path,
    timeout: Duration,
    slots_per_host: Option<u32>,
) -> Result<Vec<HostSlots>, DiscoveryError> {
    let script = program.label.as_path();
    let mut child = Command::new(&program.path)
        .args(&program.args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .spawn()
        .map_err(|source| DiscoveryError::Start {
            script: script.to_path_buf(),
            source,
        })?;
    let read = |pipe: Option<Box<dyn Read + Send>>| {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut out = Vec::new();
            if let Some(pipe) = pipe {
                let _ = pipe.take(MAX_OUTPUT as u64 + 1).read_to_end(&mut out);
            }
            let _ = tx.send(out);
        });
        rx
    };
    let stdout = read(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let stderr = read(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let deadline = crate::options::saturating_add(Instant::now(), timeout);
    let pgid = child.id() as i32;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Some(status),
            Ok(None) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(10)),
            _ => break None,
        }
    };
    // What the script left in its group (a background `sleep` holding the pipe) goes with it.
    // SAFETY: kill has no memory preconditions; the group is the script's own (process_group(0)).
    unsafe { libc::kill(-pgid, libc::SIGKILL) };
    let Some(status) = status else {
        let _ = child.wait();
        return Err(DiscoveryError::Timeout {
            script: script.to_path_buf(),
            timeout,
        });
    };
    let grace = Duration::from_secs(1);
    let out = stdout.recv_timeout(grace).unwrap_or_default();
    let err = stderr.recv_timeout(grace).unwrap_or_default();
    // Too much output first: the reader stopped, so the script may have died of SIGPIPE.
    if out.len() > MAX_OUTPUT {
        return Err(DiscoveryError::TooLong {
            script: script.to_path_buf(),
        });
    }
    if !status.success() {
        return Err(DiscoveryError::Failed {
            script: script.to_path_buf(),
            status: status.to_string(),
            stderr: String::from_utf8_lossy(&err).into_owned(),
        });
    }
    parse(script, &String::from_utf8_lossy(&out), slots_per_host)
}

/// The script of a running step: run every [`INTERVAL`] on a thread of its own, so a slow run never holds up the
/// supervisor; [`Discovery::poll`] hands out each finished run.
#[derive(Debug)]
pub struct Discovery {
    program: Program,
    dir: PathBuf,
    timeout: Duration,
    next: Instant,
    running: Option<mpsc::Receiver<Result<Vec<HostSlots>, DiscoveryError>>>,
}

impl Discovery {
    pub fn new(script: PathBuf, dir: PathBuf, timeout: Duration) -> Discovery {
        Self::of(Program::script(&script), dir, timeout)
    }

    /// The discovery of any [`Program`] (an engine's own).
    pub fn of(program: Program, dir: PathBuf, timeout: Duration) -> Discovery {
        Discovery {
            program,
            dir,
            timeout,
            next: Instant::now() + INTERVAL,
            running: None,
        }
    }

    /// How hvd names the program (a script's path).
    pub fn script(&self) -> &Path {
        &self.program.label
    }

    /// Runs the script now, on this thread; bare host names get `slots_per_host` ([`parse`]).
    pub fn run_now(&self, slots_per_host: Option<u32>) -> Result<Vec<HostSlots>, DiscoveryError> {
        run_program(&self.program, &self.dir, self.timeout, slots_per_host)
    }

    /// Starts a run when one is due; returns the result of a run that finished since the last call. Bare host names
    /// get `slots_per_host` ([`parse`]).
    pub fn poll(
        &mut self,
        slots_per_host: Option<u32>,
    ) -> Option<Result<Vec<HostSlots>, DiscoveryError>> {
        if let Some(rx) = &self.running {
            return match rx.try_recv() {
                Ok(result) => {
                    self.running = None;
                    self.next = Instant::now() + INTERVAL;
                    Some(result)
                }
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => {
                    self.running = None;
                    self.next = Instant::now() + INTERVAL;
                    None
                }
            };
        }
        if Instant::now() >= self.next {
            let (tx, rx) = mpsc::channel();
            let (program, dir, timeout) = (self.program.clone(), self.dir.clone(), self.timeout);
            let spawned = std::thread::Builder::new()
                .name("hvd-discovery".into())
                .spawn(move || {
                    let _ = tx.send(run_program(&program, &dir, timeout, slots_per_host));
                });
            match spawned {
                Ok(_) => self.running = Some(rx),
                Err(_) => self.next = Instant::now() + INTERVAL,
            }
        }
        None
    }
}

/// Whether `host` names this machine (the local engine runs every worker here).
pub fn is_this_machine(host: &str, hostname: &str) -> bool {
    let host = host.trim_end_matches('.');
    host.eq_ignore_ascii_case("localhost")
        || host == "127.0.0.1"
        || host == "::1"
        || host.eq_ignore_ascii_case(hostname)
}

/// Hosts whose workers failed repeatedly, each out of use until its cooldown ends (Horovod's blacklist, with a
/// cooldown that doubles each time a host is blacklisted again, within its [`Cooldown`] range). Every name of this
/// machine (`localhost`, `127.0.0.1`, `::1`, its hostname in any case) is one host: failures are recorded under the
/// worker's host and asked about under the script's spelling.
#[derive(Debug)]
pub struct Blacklist {
    hostname: String,
    cooldown: Cooldown,
    /// Where a cooldown's random part comes from ([`os_random`]; tests give their own).
    random: fn() -> u64,
    hosts: BTreeMap<String, HostRecord>,
    /// Losses are not charged to hosts ([`Blacklist::off`]).
    off: bool,
}

impl Default for Blacklist {
    fn default() -> Self {
        Blacklist::new("")
    }
}

#[derive(Debug, Default)]
struct HostRecord {
    failures: u32,
    times: u32,
    until: Option<Instant>,
}

impl Blacklist {
    /// An empty blacklist on the machine named `hostname`.
    pub fn new(hostname: &str) -> Blacklist {
        Blacklist {
            hostname: hostname.to_owned(),
            cooldown: Cooldown::default(),
            random: os_random,
            hosts: BTreeMap::new(),
            off: false,
        }
    }

    /// This blacklist charging nothing and blocking no host: for an engine whose hosts, as the launcher knows them,
    /// are not where its ranks ran (spark: Spark places each rank, so every rank has one pretend host).
    pub fn off(self) -> Blacklist {
        Blacklist { off: true, ..self }
    }

    /// This blacklist with its cooldowns' random part from `random` instead of the OS ([`Cooldown::jittered`]).
    pub fn with_random(self, random: fn() -> u64) -> Blacklist {
        Blacklist { random, ..self }
    }

    /// This blacklist with the cooldown range `cooldown` (the default: [`Cooldown::default`]).
    pub fn with_cooldown(self, cooldown: Cooldown) -> Blacklist {
        Blacklist { cooldown, ..self }
    }

    /// The one key of `host`: this machine's hostname for any of its names, else the name in lower case.
    fn key(&self, host: &str) -> String {
        match is_this_machine(host, &self.hostname) {
            true => self.hostname.to_ascii_lowercase(),
            false => host.trim_end_matches('.').to_ascii_lowercase(),
        }
    }

    /// A worker on `host` was lost. Returns the cooldown (with its random part) when this blacklists the host.
    pub fn failed(&mut self, host: &str, now: Instant) -> Option<Duration> {
        if self.off {
            return None;
        }
        let key = self.key(host);
        let record = self.hosts.entry(key).or_default();
        record.failures += 1;
        if record.failures < BLACKLIST_FAILURES {
            return None;
        }
        record.failures = 0;
        let cooldown = self.cooldown.jittered(record.times, (self.random)());
        record.times += 1;
        record.until = Some(now + cooldown);
        Some(cooldown)
    }

    /// Whether `host` is out of use at `now`.
    pub fn blocked(&self, host: &str, now: Instant) -> bool {
        self.hosts
            .get(&self.key(host))
            .and_then(|r| r.until)
            .is_some_and(|until| now < until)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A blacklist that is off charges no loss and blocks no host, however many there are.
    #[test]
    fn a_blacklist_that_is_off_blocks_nothing() {
        let now = Instant::now();
        let mut off = Blacklist::new("here").off();
        let mut on = Blacklist::new("here");
        let mut said = None;
        for _ in 0..BLACKLIST_FAILURES * 3 {
            assert_eq!(off.failed("h", now), None);
            said = said.or(on.failed("h", now));
        }
        assert!(!off.blocked("h", now));
        assert!(said.is_some() && on.blocked("h", now));
    }

    fn script() -> PathBuf {
        PathBuf::from("discover.sh")
    }

    #[test]
    fn host_slots_lines_are_parsed_and_anything_else_is_named() {
        let hosts = parse(&script(), "localhost:2\n\n  node-1:4  \n[::1]:1\n", None).unwrap();
        assert_eq!(
            hosts,
            vec![
                HostSlots {
                    host: "localhost".into(),
                    slots: 2
                },
                HostSlots {
                    host: "node-1".into(),
                    slots: 4
                },
                HostSlots {
                    host: "::1".into(),
                    slots: 1
                },
            ]
        );
        for bad in [
            "localhost",
            "localhost:",
            ":3",
            "localhost:two",
            "local host:2",
            "localhost:-1",
            "localhost:99999999999",
            "localhost:²",
            "[]:3",
            "[::1:3",
            "::1]:3",
            "[a]b]:3",
            "fe80::1:3",
        ] {
            let e = parse(&script(), &format!("a:1\n{bad}\n"), None).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains("discover.sh") && text.contains("line 2") && text.contains(bad),
                "{text}"
            );
        }
        // No host at all is a failed run, not "every host is gone".
        for empty in ["", "\n", "  \n\n"] {
            let e = parse(&script(), empty, None).unwrap_err();
            assert!(matches!(e, DiscoveryError::NoHosts { .. }), "{e:?}");
            assert!(
                e.to_string().contains("printed no `host:slots` line"),
                "{e}"
            );
        }
    }

    /// With `--slots-per-host N` a line may be a host name alone, which gets N slots; a `host:slots` line keeps its
    /// own count (Horovod's rule). Without it a bare name is refused as before, and so is, with it, a line that is
    /// neither.
    #[test]
    fn bare_host_names_get_the_slots_per_host_and_are_refused_without_it() {
        let out = "node-1\nnode-2:3\n\n[::1]\n[fe80::1]:2\n";
        let hosts = parse(&script(), out, Some(4)).unwrap();
        let got: Vec<(&str, u32)> = hosts.iter().map(|h| (h.host.as_str(), h.slots)).collect();
        assert_eq!(
            got,
            [("node-1", 4), ("node-2", 3), ("::1", 4), ("fe80::1", 2)]
        );
        let e = parse(&script(), out, None).unwrap_err().to_string();
        assert!(
            e.contains("line 1 \"node-1\", which is not `host:slots`") && !e.contains("host name"),
            "{e}"
        );
        for bad in [
            "local host",
            "node/1",
            "node-1:",
            "node-1:x",
            ":3",
            "a\u{7}b",
            "[",
            "]",
            "[]",
            "[[]]",
            "fe80::1",
            "[fe80::1",
        ] {
            let e = parse(&script(), &format!("a\n{bad}\n"), Some(2))
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("line 2") && e.contains("which is not `host:slots` or a host name"),
                "{bad}: {e}"
            );
        }
        assert!(matches!(
            parse(&script(), "\n \n", Some(2)),
            Err(DiscoveryError::NoHosts { .. })
        ));
    }

    #[test]
    fn a_script_that_fails_hangs_or_floods_is_an_error_naming_it() {
        let dir = tempfile::tempdir().unwrap();
        let write = |name: &str, body: &str| {
            use std::os::unix::fs::PermissionsExt;
            let path = dir.path().join(name);
            std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).unwrap();
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
            path
        };
        let t = Duration::from_secs(5);
        let ok = write("ok.sh", "echo localhost:3");
        assert_eq!(run_script(&ok, dir.path(), t, None).unwrap()[0].slots, 3);
        let failing = write("fail.sh", "echo no hosts today >&2; exit 1");
        let e = run_script(&failing, dir.path(), t, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("fail.sh") && e.contains("exit status: 1") && e.contains("no hosts today"),
            "{e}"
        );
        // It hangs, holding its output pipe open through a child: killed with its group at the deadline.
        let hang = write("hang.sh", "echo localhost:1; sleep 600 & wait");
        let e = run_script(&hang, dir.path(), Duration::from_millis(300), None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("hang.sh") && e.contains("did not finish"), "{e}");
        let flood = write("flood.sh", "yes localhost:1 | head -c 200000");
        let e = run_script(&flood, dir.path(), t, None)
            .unwrap_err()
            .to_string();
        assert!(e.contains("flood.sh") && e.contains("more than"), "{e}");
        let missing = dir.path().join("missing.sh");
        let e = run_script(&missing, dir.path(), t, None)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("missing.sh") && e.contains("could not be started"),
            "{e}"
        );
    }

    /// A random part of 0: the cooldowns are exactly the schedule before it ([`Cooldown::jittered`]).
    fn no_jitter() -> u64 {
        0
    }

    #[test]
    fn a_host_that_fails_repeatedly_is_blacklisted_for_a_growing_cooldown() {
        let t = Instant::now();
        let mut b = Blacklist::default().with_random(no_jitter);
        assert_eq!(b.failed("a", t), None);
        assert!(!b.blocked("a", t));
        assert_eq!(b.failed("a", t), Some(FIRST_COOLDOWN));
        assert!(b.blocked("a", t) && !b.blocked("b", t));
        assert!(!b.blocked("a", t + FIRST_COOLDOWN));
        b.failed("a", t);
        assert_eq!(b.failed("a", t), Some(FIRST_COOLDOWN * 2));
        for _ in 0..20 {
            b.failed("a", t);
        }
        assert_eq!(b.failed("a", t).or(b.failed("a", t)), Some(MAX_COOLDOWN));
    }

    /// `--blacklist-cooldown-range MIN MAX`: MIN the first time, doubled at each blacklisting after it, never past
    /// MAX; the host is out exactly until then (times given, no clock read; a random part of 0).
    #[test]
    fn a_cooldown_range_sets_the_first_cooldown_and_bounds_its_growth() {
        let range = Cooldown::from_seconds(5, 30).unwrap();
        let t = Instant::now();
        let mut b = Blacklist::new("box")
            .with_cooldown(range)
            .with_random(no_jitter);
        let secs = Duration::from_secs;
        let mut got = Vec::new();
        for _ in 0..5 {
            assert_eq!(b.failed("n1", t), None);
            got.push(b.failed("n1", t).unwrap());
        }
        assert_eq!(got, [secs(5), secs(10), secs(20), secs(30), secs(30)]);
        assert!(b.blocked("n1", t + secs(29)) && !b.blocked("n1", t + secs(30)));
        // The same range at both ends: a fixed cooldown, whatever the random part.
        let mut fixed = Blacklist::new("box").with_cooldown(Cooldown::from_seconds(7, 7).unwrap());
        for _ in 0..3 {
            fixed.failed("n1", t);
            assert_eq!(fixed.failed("n1", t), Some(secs(7)));
        }
        // The default is the fixed policy of old: 60 s, doubled, at most 10 min.
        assert_eq!(
            Cooldown::default(),
            Cooldown::from_seconds(60, 600).unwrap()
        );
        for (min, max, why) in [
            (0, 10, "from 1 to 3600"),
            (1, 3601, "from 1 to 3600"),
            (20, 10, "is above the second"),
        ] {
            let e = Cooldown::from_seconds(min, max).unwrap_err();
            assert!(
                e.contains(&format!("`--blacklist-cooldown-range {min} {max}`")) && e.contains(why),
                "{e}"
            );
        }
    }

    /// The random part of a cooldown, for random values from 0 to the largest: every cooldown is from MIN to MAX;
    /// below MAX it is the schedule's `d` lengthened by less than `d`/4; where that would pass MAX it is reflected
    /// there (at least 3/4 MAX); 0 gives `d`; MIN = MAX is exact; a larger random value never gives a shorter
    /// cooldown below the reflection.
    #[test]
    fn a_cooldowns_random_part_stays_within_its_range() {
        let secs = Duration::from_secs;
        let randoms = [
            0,
            1,
            1 << 32,
            u64::MAX / 3,
            u64::MAX / 2,
            u64::MAX - 1,
            u64::MAX,
        ];
        for (min, max) in [
            (60, 600),
            (5, 30),
            (7, 7),
            (1, 3600),
            (1, 1),
            (500, 600),
            (3599, 3600),
        ] {
            let range = Cooldown::from_seconds(min, max).unwrap();
            for times in 0..20 {
                let d = range.nth(times);
                let mut last = Duration::ZERO;
                for random in randoms {
                    let c = range.jittered(times, random);
                    let at = format!("{min}..{max}, blacklisting {times}, random {random}: {c:?}");
                    assert!(c >= secs(min) && c <= secs(max), "{at}");
                    if random == 0 {
                        assert_eq!(c, d, "{at}");
                    }
                    if d + d / JITTER_PART <= secs(max) {
                        assert!(
                            c >= d && c < d + d / JITTER_PART + Duration::from_nanos(1),
                            "{at}"
                        );
                        assert!(c >= last, "{at}");
                        last = c;
                    } else {
                        assert!(c >= secs(max) * 3 / 4, "{at}");
                    }
                    if min == max {
                        assert_eq!(c, secs(min), "{at}");
                    }
                }
            }
        }
        // The first cooldown of the default range: 60 s, and close to 75 s with the largest random value.
        let first = Cooldown::default().jittered(0, u64::MAX);
        assert!(first > secs(74) && first < secs(75), "{first:?}");
        // At the cap (600 s) the random part shortens it instead, by less than a quarter.
        let capped = Cooldown::default().jittered(10, u64::MAX);
        assert!(capped > secs(450) && capped < secs(451), "{capped:?}");
        // Hosts blacklisted at the same moment with different random values come back at different instants.
        assert_ne!(
            Cooldown::default().jittered(0, u64::MAX / 3),
            Cooldown::default().jittered(0, u64::MAX / 2)
        );
    }

    /// The blacklist takes its random part from its source: the OS by default, what a test gives here.
    #[test]
    fn the_blacklist_lengthens_a_cooldown_by_its_random_part() {
        let t = Instant::now();
        let mut b = Blacklist::new("box").with_random(|| u64::MAX / 2);
        b.failed("n1", t);
        let cooldown = b.failed("n1", t).unwrap();
        assert_eq!(cooldown, Cooldown::default().jittered(0, u64::MAX / 2));
        assert!(cooldown > FIRST_COOLDOWN);
        assert!(b.blocked("n1", t + FIRST_COOLDOWN) && !b.blocked("n1", t + cooldown));
        // The OS's: 8 draws are not all the same.
        let draws: Vec<u64> = (0..8).map(|_| os_random()).collect();
        assert!(draws.iter().any(|d| *d != draws[0]), "{draws:?}");
    }

    #[test]
    fn failures_recorded_under_the_hostname_block_every_name_of_this_machine() {
        let t = Instant::now();
        let mut b = Blacklist::new("Box").with_random(no_jitter);
        b.failed("Box", t);
        assert_eq!(b.failed("box", t), Some(FIRST_COOLDOWN));
        for name in ["localhost", "LOCALHOST", "127.0.0.1", "::1", "box", "BOX."] {
            assert!(b.blocked(name, t), "{name}");
        }
        assert!(!b.blocked("other", t));
        b.failed("Node-1", t);
        b.failed("node-1.", t);
        assert!(b.blocked("NODE-1", t));
    }

    #[test]
    fn this_machine_goes_by_several_names() {
        for name in ["localhost", "LOCALHOST", "127.0.0.1", "::1", "box", "box."] {
            assert!(is_this_machine(name, "box"), "{name}");
        }
        assert!(!is_this_machine("other", "box"));
    }
}
