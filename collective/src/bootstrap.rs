//! Joining a job: who am I (rank, size, host) from the environment, and a key-value exchange of addresses through
//! the launcher's rendezvous server (or a shared directory) to connect the ranks.
//!
//! Rank and size come from the launcher's variables, read by [`crate::launch_env`] (the same reader as
//! `hvd worker-env`'s, one precedence: the launcher that started this process wins). Hosts are grouped by
//! `HVD_HOSTNAME` (else the machine's host name), so local and cross ranks are derived, not trusted.
//!
//! Exchange (scope `hvd`): every rank PUTs `addr.<rank>` = `v1 <hostname> <ip:port>` and reads everyone's; the
//! lowest rank of each host creates the host's shared memory segment and PUTs its name at `shm.<host index>`.
//!
//! A `file:DIR` rendezvous keeps each key in `DIR/hvd/<key>`. DIR (and `DIR/hvd`) must belong to the user and be
//! writable by nobody else, or the job refuses it (another user could plant the job's key or a rank's address);
//! `DIR/hvd` is created 0700, and every file is written 0600 under a fresh temporary name (`O_EXCL`) and renamed
//! into place. Each file starts with a line `hvd-rendezvous v1 job=<id>`: the job id is `HVD_JOB_ID`, else srun's
//! `SLURM_JOB_ID.SLURM_STEP_ID`, else empty; a rank with a job id treats a file of another job id as absent (a
//! stale `addr.N` or `tcp.key` of an earlier job in the same directory) and, when its wait ends, names it.
//!
//! The HTTP client retries a busy server (503) and failed connections with exponential backoff and jitter, bounded by
//! the start-up timeout: a server briefly full of other connections delays a rank, it does not fail it.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::communicator::Communicator;
use crate::config::{EnvVars, Thresholds, timeout_from_env};
use crate::error::{Error, Result};
use crate::hierarchical::MixedTransport;
use crate::p2p::{P2pCommunicator, topology_from_hosts};
use crate::shm::{ShmSegment, ShmTransport, ring_bytes_from_env};
use crate::tcp::{JobKey, TcpTransport, interface_address, listen};

const SCOPE: &str = "hvd";
/// How long a client retries a busy or unreachable server unless told otherwise ([`KeyValueClient::with_retry_for`]).
const DEFAULT_RETRY_FOR: Duration = Duration::from_secs(30);
/// First pause before a retry; it doubles up to [`MAX_BACKOFF`], and each pause is drawn from its upper half.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// The first line of every file of a `file:` rendezvous, followed by the job id.
const FILE_HEADER: &str = "hvd-rendezvous v1 job=";
/// The variable that names the job for a `file:` rendezvous (see the module documentation).
pub const JOB_ID_VAR: &str = "HVD_JOB_ID";

/// Where ranks exchange their addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Rendezvous {
    /// The launcher's HTTP key-value server at `address` (`host:port`).
    Http {
        address: String,
        token: Option<String>,
    },
    /// A directory every rank can read and write (`HVD_RENDEZVOUS=file:DIR`), e.g. on a shared file system.
    Directory(PathBuf),
}

impl Rendezvous {
    /// Parses `HVD_RENDEZVOUS` (`host:port` or `file:DIR`).
    pub fn parse(value: &str, token: Option<String>) -> Result<Rendezvous> {
        let v = value.trim();
        if let Some(dir) = v.strip_prefix("file:") {
            return Ok(Rendezvous::Directory(PathBuf::from(dir)));
        }
        let v = v.strip_prefix("http://").unwrap_or(v).trim_end_matches('/');
        if v.rsplit_once(':')
            .is_none_or(|(h, p)| h.is_empty() || p.parse::<u16>().is_err())
        {
            return Err(Error::Bootstrap(format!(
                "`{}={value}` is neither `host:port` nor `file:DIR`",
                EnvVars::RENDEZVOUS
            )));
        }
        Ok(Rendezvous::Http {
            address: v.to_string(),
            token,
        })
    }

    /// A client for this rendezvous acting as `rank`.
    pub fn client(&self, rank: usize) -> KeyValueClient {
        let job = std::env::var(JOB_ID_VAR)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .or_else(|| {
                let id = std::env::var("SLURM_JOB_ID").ok()?;
                let step = std::env::var("SLURM_STEP_ID").unwrap_or_default();
                Some(format!("{id}.{step}"))
            });
        KeyValueClient {
            rendezvous: self.clone(),
            rank,
            retry_for: DEFAULT_RETRY_FOR,
            job: job.as_deref().map(job_id),
        }
    }
}

/// A client of the rendezvous key-value store (scope `hvd`).
#[derive(Debug, Clone)]
pub struct KeyValueClient {
    rendezvous: Rendezvous,
    rank: usize,
    /// How long one request is retried through 503 answers and failed connections.
    retry_for: Duration,
    /// The job id written into, and checked in, the files of a `file:` rendezvous.
    job: Option<String>,
}

struct HttpResponse {
    status: u16,
    body: Vec<u8>,
    /// How many times the request was retried before this answer.
    retries: u32,
}

impl KeyValueClient {
    /// Retries each request through a busy (503) or unreachable server for up to `retry_for` (give it the job's
    /// start-up timeout).
    pub fn with_retry_for(mut self, retry_for: Duration) -> KeyValueClient {
        self.retry_for = retry_for;
        self
    }

    /// Names the job for a `file:` rendezvous (instead of `HVD_JOB_ID`): files of another job id are ignored.
    pub fn with_job(mut self, job: Option<&str>) -> KeyValueClient {
        self.job = job.map(job_id);
        self
    }

    /// Stores `value` under `key` ([A-Za-z0-9._-]).
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        check_key(key)?;
        match &self.rendezvous {
            Rendezvous::Http { address, .. } => {
                let r = self.http(
                    "PUT",
                    &format!("/kv/{SCOPE}/{key}"),
                    value,
                    Duration::from_secs(30),
                )?;
                if r.status != 200 {
                    return Err(self.refused(address, "PUT", key, &r));
                }
                Ok(())
            }
            Rendezvous::Directory(dir) => {
                let dir = private_scope(dir)?;
                let mut content =
                    format!("{FILE_HEADER}{}\n", self.job.as_deref().unwrap_or("")).into_bytes();
                content.extend_from_slice(value);
                write_private(&dir, key, &content)
            }
        }
    }

    /// Reads `key`, waiting up to `timeout` for another rank to store it.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        check_key(key)?;
        let deadline = Instant::now() + timeout;
        let mut stale: Option<(PathBuf, String)> = None;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match &self.rendezvous {
                Rendezvous::Http { address, .. } => {
                    let wait = left.min(Duration::from_secs(60));
                    let path = format!("/kv/{SCOPE}/{key}?wait_ms={}", wait.as_millis());
                    let r = self.http("GET", &path, &[], wait + Duration::from_secs(15))?;
                    match r.status {
                        200 => return Ok(r.body),
                        404 => {}
                        _ => return Err(self.refused(address, "GET", key, &r)),
                    }
                }
                Rendezvous::Directory(dir) => {
                    let path = private_scope(dir)?.join(key);
                    match std::fs::read(&path) {
                        Ok(v) => match self.own_value(&path, v)? {
                            Ok(v) => return Ok(v),
                            Err(other) => stale = Some((path, other)),
                        },
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => return Err(Error::io(format!("read `{}`", path.display()), e)),
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
            }
            if Instant::now() >= deadline {
                if let Some((path, other)) = stale {
                    return Err(Error::Bootstrap(format!(
                        "`{}` is from another job (job id `{other}`, this job is `{}`): a stale file of an earlier \
                         job, or two jobs share the rendezvous directory; remove it or give each job its own \
                         directory",
                        path.display(),
                        self.job.as_deref().unwrap_or("")
                    )));
                }
                return Err(Error::Bootstrap(format!(
                    "no rank stored `{key}` at the rendezvous within {timeout:?}; did every rank start?"
                )));
            }
        }
    }

    /// The value of a rendezvous file read from `path`: `Ok(Ok(value))` when it is this job's (any job's when this
    /// rank has no job id), `Ok(Err(job))` when another job wrote it.
    fn own_value(
        &self,
        path: &Path,
        content: Vec<u8>,
    ) -> Result<std::result::Result<Vec<u8>, String>> {
        let bad = || {
            Error::Bootstrap(format!(
                "`{}` is not an hvd rendezvous file (no `{FILE_HEADER}` line); remove it or use a fresh directory",
                path.display()
            ))
        };
        let nl = content.iter().position(|b| *b == b'\n').ok_or_else(bad)?;
        let line = std::str::from_utf8(&content[..nl]).map_err(|_| bad())?;
        let job = line.strip_prefix(FILE_HEADER).ok_or_else(bad)?;
        match &self.job {
            Some(mine) if mine != job => Ok(Err(job.to_string())),
            _ => Ok(Ok(content[nl + 1..].to_vec())),
        }
    }

    fn refused(&self, address: &str, method: &str, key: &str, r: &HttpResponse) -> Error {
        let body = String::from_utf8_lossy(&r.body).trim().to_string();
        let hint = match r.status {
            403 => " (check `HVD_JOB_TOKEN`)".to_string(),
            503 => format!(
                " (still busy after {} retries over {:?})",
                r.retries, self.retry_for
            ),
            _ => String::new(),
        };
        Error::Rendezvous {
            address: address.to_string(),
            detail: format!("{method} `{key}` answered {} {body}{hint}", r.status),
        }
    }

    /// One HTTP/1.1 request, retried on a fresh connection while the server answers 503 or the connection fails,
    /// with exponential backoff and jitter, for up to `retry_for`. Every request is idempotent (PUT of the same bytes,
    /// GET, DELETE), so a retry after a lost answer is harmless.
    fn http(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
        read_timeout: Duration,
    ) -> Result<HttpResponse> {
        let deadline = Instant::now() + self.retry_for;
        let mut backoff = Backoff::new();
        loop {
            let outcome = self.http_once(method, path, body, read_timeout);
            let retryable = match &outcome {
                Ok(r) => r.status == 503,
                Err(_) => true,
            };
            let pause = backoff.next_pause();
            if !retryable || Instant::now() + pause > deadline {
                let retries = backoff.retries;
                return outcome
                    .map(|r| HttpResponse { retries, ..r })
                    .map_err(|e| match e {
                        Error::Rendezvous { address, detail } if retries > 0 => Error::Rendezvous {
                            address,
                            detail: format!(
                                "{detail} (after {} retries over {:?})",
                                retries, self.retry_for
                            ),
                        },
                        e => e,
                    });
            }
            match &outcome {
                Ok(_) => tracing::debug!(method, path, ?pause, "rendezvous busy (503); retrying"),
                Err(e) => {
                    tracing::debug!(method, path, ?pause, error = %e, "rendezvous request failed; retrying")
                }
            }
            std::thread::sleep(pause);
            backoff.retries += 1;
        }
    }

    /// One HTTP/1.1 request on a fresh connection (`Connection: close`).
    fn http_once(
        &self,
        method: &str,
        path: &str,
        body: &[u8],
        read_timeout: Duration,
    ) -> Result<HttpResponse> {
        let Rendezvous::Http { address, token } = &self.rendezvous else {
            return Err(Error::Bootstrap("not an HTTP rendezvous".into()));
        };
        let err = |d: String| Error::Rendezvous {
            address: address.clone(),
            detail: d,
        };
        let stream = connect_any(address).map_err(|e| err(format!("connect: {e}")))?;
        stream
            .set_read_timeout(Some(read_timeout))
            .map_err(|e| err(format!("configure socket: {e}")))?;
        stream
            .set_write_timeout(Some(Duration::from_secs(30)))
            .map_err(|e| err(format!("configure socket: {e}")))?;
        let mut head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {address}\r\nX-Hvd-Rank: {}\r\nX-Hvd-Join: {}\r\n",
            self.rank,
            join_identity()
        );
        if let Some(t) = token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        head.push_str(&format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        ));
        let mut s = &stream;
        let sent = s
            .write_all(head.as_bytes())
            .and_then(|()| s.write_all(body));
        let mut raw = Vec::new();
        let read = s.read_to_end(&mut raw);
        // A server may answer before it has read everything (a 503 when full, a 403) and close: its answer, when it
        // arrived, says more than the failed send.
        if let Some(r) = parse_response(&raw) {
            return Ok(r);
        }
        sent.map_err(|e| err(format!("send: {e}")))?;
        read.map_err(|e| err(format!("read the answer: {e}")))?;
        Err(err(format!("malformed answer to {method} {path}")))
    }
}

/// Exponential backoff with jitter: pauses of 10 ms, 20 ms, ... up to 1 s, each drawn from the upper half of its step
/// so that ranks retrying together spread out.
struct Backoff {
    step: Duration,
    state: u64,
    retries: u32,
}

impl Backoff {
    fn new() -> Backoff {
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
            ^ (u64::from(std::process::id()) << 32);
        Backoff {
            step: FIRST_BACKOFF,
            state: seed | 1,
            retries: 0,
        }
    }

    fn next_pause(&mut self) -> Duration {
        // xorshift64: enough to decorrelate ranks, not a secret.
        self.state ^= self.state << 13;
        self.state ^= self.state >> 7;
        self.state ^= self.state << 17;
        let half = self.step / 2;
        let jitter = half.mul_f64((self.state >> 11) as f64 / (1u64 << 53) as f64);
        let pause = half + jitter;
        self.step = (self.step * 2).min(MAX_BACKOFF);
        pause
    }
}

/// This process's `X-Hvd-Join` identity: random, fixed for the process's life, so that the server lets this process
/// (and no other) act as its rank.
fn join_identity() -> &'static str {
    static IDENTITY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    IDENTITY.get_or_init(|| {
        let mut bytes = [0u8; 12];
        let filled = std::fs::File::open("/dev/urandom")
            .and_then(|mut f| f.read_exact(&mut bytes))
            .is_ok();
        if !filled {
            // Still unique per process and start time, which is all the server needs to tell processes apart.
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            bytes[..4].copy_from_slice(&std::process::id().to_le_bytes());
            bytes[4..].copy_from_slice(&(nanos as u64).to_le_bytes());
        }
        bytes.iter().map(|b| format!("{b:02x}")).collect()
    })
}

fn connect_any(address: &str) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other("the address resolves to nothing");
    for a in address.to_socket_addrs()? {
        match TcpStream::connect_timeout(&a, Duration::from_secs(10)) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}

fn parse_response(raw: &[u8]) -> Option<HttpResponse> {
    let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
    let head = std::str::from_utf8(&raw[..split]).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split_whitespace().nth(1)?.parse().ok()?;
    let mut body = raw[split + 4..].to_vec();
    for l in lines {
        if let Some((k, v)) = l.split_once(':')
            && k.trim().eq_ignore_ascii_case("content-length")
        {
            let n: usize = v.trim().parse().ok()?;
            if body.len() < n {
                return None;
            }
            body.truncate(n);
        }
    }
    Some(HttpResponse {
        status,
        body,
        retries: 0,
    })
}

/// A job id as written on a rendezvous file's first line: trimmed, control characters (a newline) as `?`.
fn job_id(raw: &str) -> String {
    raw.trim()
        .chars()
        .map(|c| if c.is_control() { '?' } else { c })
        .collect()
}

/// Refuses a rendezvous directory another user could write into (or that is not the user's own).
fn check_private_dir(dir: &Path) -> Result<()> {
    let m = std::fs::metadata(dir).map_err(|e| {
        Error::io(
            format!("read the rendezvous directory `{}`", dir.display()),
            e,
        )
    })?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    if m.uid() != me {
        return Err(Error::Bootstrap(format!(
            "the rendezvous directory `{}` belongs to uid {}, not to this user (uid {me}): its owner could plant the \
             job's key or a rank's address; use a directory of your own (e.g. from `mktemp -d`)",
            dir.display(),
            m.uid()
        )));
    }
    let mode = m.permissions().mode();
    if mode & 0o022 != 0 {
        return Err(Error::Bootstrap(format!(
            "the rendezvous directory `{}` is writable by its group or others (mode {:o}): another user could plant \
             the job's key or a rank's address; run `chmod go-w {}` or use a directory from `mktemp -d`",
            dir.display(),
            mode & 0o7777,
            dir.display()
        )));
    }
    Ok(())
}

/// `DIR/hvd` of a `file:` rendezvous, created 0700 when missing; DIR and it checked with [`check_private_dir`].
fn private_scope(dir: &Path) -> Result<PathBuf> {
    // A missing DIR is created (0700 like every directory created on the way).
    if let Err(e) = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        return Err(Error::io(format!("create `{}`", dir.display()), e));
    }
    check_private_dir(dir)?;
    let scope = dir.join(SCOPE);
    match std::fs::DirBuilder::new().mode(0o700).create(&scope) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(format!("create `{}`", scope.display()), e)),
    }
    check_private_dir(&scope)?;
    Ok(scope)
}

/// Writes `dir/key` atomically with mode 0600: a fresh temporary name opened with `O_EXCL`, then a rename.
fn write_private(dir: &Path, key: &str, content: &[u8]) -> Result<()> {
    static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = dir.join(format!(
        ".{key}.{}.{seq}.{}.tmp",
        std::process::id(),
        join_identity()
    ));
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(|e| Error::io(format!("create `{}`", tmp.display()), e))?;
    let written = f
        .write_all(content)
        .map_err(|e| Error::io(format!("write `{}`", tmp.display()), e));
    drop(f);
    let path = dir.join(key);
    let moved = written.and_then(|()| {
        std::fs::rename(&tmp, &path)
            .map_err(|e| Error::io(format!("rename to `{}`", path.display()), e))
    });
    if moved.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    moved
}

fn check_key(key: &str) -> Result<()> {
    if key.is_empty()
        || !key
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
    {
        return Err(Error::Bootstrap(format!(
            "`{key}` is not a valid rendezvous key ([A-Za-z0-9._-]+)"
        )));
    }
    Ok(())
}

/// What the environment says about this rank's place in the job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobEnv {
    pub rank: usize,
    pub size: usize,
    /// Groups ranks into hosts.
    pub hostname: String,
    pub rendezvous: Option<Rendezvous>,
    /// Which variables gave rank and size: a [`crate::launch_env::LaunchSource::key`] (`hvd`, `openmpi`, `pmi`,
    /// `slurm`, ...).
    pub source: &'static str,
}

impl JobEnv {
    /// Reads the process environment.
    pub fn from_env() -> Result<JobEnv> {
        Self::from_lookup(|k| std::env::var(k).ok())
    }

    /// Reads variables through `var` (for tests and embedders).
    pub fn from_lookup(var: impl Fn(&str) -> Option<String>) -> Result<JobEnv> {
        let slot = crate::launch_env::slot_from_lookup(&var)
            .map_err(|e| Error::Bootstrap(e.to_string()))?;
        let (source, rank, size) = (slot.source.key(), slot.rank as usize, slot.size as usize);
        let hostname = match var(EnvVars::HOSTNAME).filter(|h| !h.is_empty()) {
            Some(h) => h,
            None => machine_hostname()?,
        };
        let rendezvous = match var(EnvVars::RENDEZVOUS).filter(|v| !v.is_empty()) {
            Some(v) => Some(Rendezvous::parse(
                &v,
                var(EnvVars::JOB_TOKEN).filter(|t| !t.is_empty()),
            )?),
            None => None,
        };
        Ok(JobEnv {
            rank,
            size,
            hostname,
            rendezvous,
            source,
        })
    }
}

fn machine_hostname() -> Result<String> {
    let mut buf = [0u8; 256];
    // SAFETY: buf is writable for its length; gethostname NUL-terminates within it on success.
    if unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) } != 0 {
        return Err(Error::io(
            "read the host name",
            std::io::Error::last_os_error(),
        ));
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    Ok(String::from_utf8_lossy(&buf[..end]).into_owned())
}

/// Which communicator to build.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    /// shm on one host, tcp when every host has one rank, hierarchical otherwise.
    Auto,
    Shm,
    Tcp,
    Hierarchical,
    Mpi,
    Nccl,
}

impl std::str::FromStr for BackendChoice {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim() {
            "" | "auto" => BackendChoice::Auto,
            "shm" => BackendChoice::Shm,
            "tcp" => BackendChoice::Tcp,
            "hierarchical" => BackendChoice::Hierarchical,
            "mpi" => BackendChoice::Mpi,
            "nccl" => BackendChoice::Nccl,
            other => {
                return Err(Error::Bootstrap(format!(
                    "unknown backend `{other}` (expected auto, shm, tcp, hierarchical, mpi or nccl)"
                )));
            }
        })
    }
}

/// Joins the job described by the environment with the backend from `HVD_COLLECTIVE_BACKEND` (default auto).
/// This is what a worker calls once at start.
pub fn from_env() -> Result<Box<dyn Communicator>> {
    let choice: BackendChoice = std::env::var(EnvVars::BACKEND)
        .unwrap_or_default()
        .parse()?;
    let job = JobEnv::from_env()?;
    connect(&job, choice, timeout_from_env()?)
}

/// Joins `job` with `choice`; `timeout` bounds the start-up and becomes the operation timeout.
pub fn connect(
    job: &JobEnv,
    choice: BackendChoice,
    timeout: Duration,
) -> Result<Box<dyn Communicator>> {
    match choice {
        BackendChoice::Mpi => return crate::mpi_backend::connect(),
        BackendChoice::Nccl => return crate::nccl::connect_from_env(job, timeout),
        _ => {}
    }
    let Some(rendezvous) = &job.rendezvous else {
        return Err(Error::Bootstrap(format!(
            "`{}` is not set: the {} ranks need a rendezvous to find each other (run under `hvd run`, set \
             `{}=file:DIR` to a shared directory, or use the mpi backend under mpirun)",
            EnvVars::RENDEZVOUS,
            job.size,
            EnvVars::RENDEZVOUS
        )));
    };
    let kv = rendezvous.client(job.rank).with_retry_for(timeout);
    let ip = listen_ip(rendezvous, timeout)?;
    let listener = listen(ip)?;
    let addr = listener
        .local_addr()
        .map_err(|e| Error::io("read the listener's address", e))?;
    if job.hostname.contains(char::is_whitespace) {
        return Err(Error::Bootstrap(format!(
            "host name `{}` contains white space",
            job.hostname
        )));
    }
    kv.put(
        &format!("addr.{}", job.rank),
        format!("v1 {} {addr}", job.hostname).as_bytes(),
    )?;
    let mut names = Vec::with_capacity(job.size);
    let mut addrs = Vec::with_capacity(job.size);
    for r in 0..job.size {
        let v = kv.get(&format!("addr.{r}"), timeout)?;
        let text = String::from_utf8_lossy(&v);
        let mut parts = text.split_whitespace();
        let (Some("v1"), Some(host), Some(a)) = (parts.next(), parts.next(), parts.next()) else {
            return Err(Error::Bootstrap(format!(
                "rank {r} published a malformed address `{text}`"
            )));
        };
        let a: SocketAddr = a
            .parse()
            .map_err(|_| Error::Bootstrap(format!("rank {r} published a bad address `{a}`")))?;
        names.push(host.to_string());
        addrs.push(a);
    }
    let mut order: Vec<&String> = Vec::new();
    for n in &names {
        if !order.contains(&n) {
            order.push(n);
        }
    }
    let hosts: Vec<usize> = names
        .iter()
        .map(|n| order.iter().position(|o| *o == n).unwrap_or(0))
        .collect();
    let topo = topology_from_hosts(job.rank, &hosts);
    let choice = match choice {
        BackendChoice::Auto if topo.cross_size == 1 => BackendChoice::Shm,
        BackendChoice::Auto
            if hosts
                .iter()
                .all(|h| hosts.iter().filter(|x| *x == h).count() == 1) =>
        {
            BackendChoice::Tcp
        }
        BackendChoice::Auto => BackendChoice::Hierarchical,
        c => c,
    };
    if choice == BackendChoice::Shm && topo.cross_size > 1 {
        return Err(Error::Bootstrap(format!(
            "the shm backend needs all ranks on one host, but they span {} hosts",
            topo.cross_size
        )));
    }
    let th = Thresholds::from_env();
    let comm: Box<dyn Communicator> = match choice {
        BackendChoice::Tcp => {
            let key = JobKey::for_job(rendezvous, &kv, job.rank, timeout)?;
            let t = TcpTransport::connect(job.rank, &listener, &addrs, &key, timeout)?;
            boxed(P2pCommunicator::new(t, "tcp", hosts, timeout), th)
        }
        BackendChoice::Shm => {
            let (seg, local, global, name) = host_segment(&kv, job.rank, &hosts, timeout)?;
            let t = ShmTransport::attach_mapped(seg, local, global)?;
            t.wait_attached(timeout)?;
            if let Some(name) = name {
                ShmSegment::unlink(&name);
            }
            boxed(P2pCommunicator::new(t, "shm", hosts, timeout), th)
        }
        _ => {
            let (seg, _, _, name) = host_segment(&kv, job.rank, &hosts, timeout)?;
            let key = JobKey::for_job(rendezvous, &kv, job.rank, timeout)?;
            let t =
                MixedTransport::connect(job.rank, &hosts, seg, &listener, &addrs, &key, timeout)?;
            if let Some(name) = name {
                ShmSegment::unlink(&name);
            }
            boxed(P2pCommunicator::new(t, "hierarchical", hosts, timeout), th)
        }
    };
    tracing::debug!(rank = job.rank, backend = comm.backend(), "joined the job");
    Ok(comm)
}

fn boxed<T: crate::transport::Transport + 'static>(
    mut c: P2pCommunicator<T>,
    th: Thresholds,
) -> Box<dyn Communicator> {
    c.set_thresholds(th);
    Box::new(c)
}

/// This host's segment: created by its lowest rank (which also returns the name to unlink once all attached),
/// opened by the others. Returns (segment, local index, global ranks of the host, name to unlink).
fn host_segment(
    kv: &KeyValueClient,
    rank: usize,
    hosts: &[usize],
    timeout: Duration,
) -> Result<(ShmSegment, usize, Vec<usize>, Option<String>)> {
    let global: Vec<usize> = (0..hosts.len())
        .filter(|r| hosts[*r] == hosts[rank])
        .collect();
    let local = global.iter().position(|r| *r == rank).unwrap_or(0);
    let key = format!("shm.{}", hosts[rank]);
    if local == 0 {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let name = format!("hvd-{}-{nanos:x}", std::process::id());
        let seg = ShmSegment::create(&name, global.len(), ring_bytes_from_env())?;
        kv.put(&key, name.as_bytes())?;
        Ok((seg, local, global, Some(name)))
    } else {
        let name = String::from_utf8_lossy(&kv.get(&key, timeout)?).into_owned();
        let seg = ShmSegment::open(&name, timeout)?;
        if seg.ranks() != global.len() {
            return Err(Error::Bootstrap(format!(
                "shared memory segment `{name}` is for {} ranks, this host has {}",
                seg.ranks(),
                global.len()
            )));
        }
        Ok((seg, local, global, None))
    }
}

/// The address to listen on: `HVD_TCP_ADDRESS`, else `HVD_TCP_INTERFACE`'s, else the local address that reaches the
/// rendezvous server (loopback for a directory rendezvous).
fn listen_ip(rendezvous: &Rendezvous, timeout: Duration) -> Result<IpAddr> {
    if let Ok(a) = std::env::var(EnvVars::TCP_ADDRESS) {
        return a.trim().parse().map_err(|_| {
            Error::Bootstrap(format!(
                "`{}={a}` is not an IP address",
                EnvVars::TCP_ADDRESS
            ))
        });
    }
    if let Ok(name) = std::env::var(EnvVars::TCP_INTERFACE) {
        return interface_address(name.trim());
    }
    match rendezvous {
        Rendezvous::Directory(_) => Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        Rendezvous::Http { address, .. } => {
            // The server may not be accepting yet (a rank 0 that serves it starting up): retry like every request.
            let deadline = Instant::now() + timeout;
            let mut backoff = Backoff::new();
            let s = loop {
                match connect_any(address) {
                    Ok(s) => break s,
                    Err(e) => {
                        let pause = backoff.next_pause();
                        if Instant::now() + pause > deadline {
                            return Err(Error::Rendezvous {
                                address: address.clone(),
                                detail: format!("connect: {e} (retried for {timeout:?})"),
                            });
                        }
                        std::thread::sleep(pause);
                    }
                }
            };
            s.local_addr()
                .map(|a| a.ip())
                .map_err(|e| Error::io("read the local address", e))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: std::collections::HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |k| m.get(k).cloned()
    }

    #[test]
    fn rank_families_in_order() {
        let j = JobEnv::from_lookup(env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("HVD_HOSTNAME", "a"),
        ]))
        .unwrap();
        assert_eq!(
            (j.rank, j.size, j.source, j.hostname.as_str()),
            (1, 4, "openmpi", "a")
        );
        let j = JobEnv::from_lookup(env(&[
            ("SLURM_PROCID", "3"),
            ("SLURM_NTASKS", "8"),
            ("HVD_HOSTNAME", "a"),
        ]))
        .unwrap();
        assert_eq!((j.rank, j.size, j.source), (3, 8, "slurm"));
        let j = JobEnv::from_lookup(env(&[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("HVD_HOSTNAME", "h"),
            ("HVD_RENDEZVOUS", "127.0.0.1:9"),
            ("HVD_JOB_TOKEN", "abc"),
        ]))
        .unwrap();
        assert_eq!(j.source, "pmi");
        assert_eq!(
            j.rendezvous,
            Some(Rendezvous::Http {
                address: "127.0.0.1:9".into(),
                token: Some("abc".into())
            })
        );
    }

    /// The launch-environment fixtures shared with `hvd-launcher`'s shim give the same rank, size and source here.
    #[test]
    fn shared_launch_fixtures_give_the_same_rank() {
        use crate::launch_env::fixtures;
        let cases = fixtures::parse(include_str!("../tests/data/launch_env.txt"));
        assert!(cases.len() >= 10);
        for case in &cases {
            let got = JobEnv::from_lookup(|k| {
                case.get(k)
                    .or_else(|| (k == "HVD_HOSTNAME").then(|| "h".into()))
            });
            match (case.expect.strip_prefix("error "), got) {
                (Some(part), Err(e)) => assert!(e.to_string().contains(part), "{}: {e}", case.name),
                (None, Ok(j)) => {
                    let want: Vec<&str> = case.expect.split(' ').take(3).collect();
                    assert_eq!(
                        [j.source.to_owned(), j.rank.to_string(), j.size.to_string()],
                        [want[0], want[1], want[2]],
                        "{}",
                        case.name
                    );
                }
                (_, got) => panic!("{}: expected `{}`, got {got:?}", case.name, case.expect),
            }
        }
    }

    #[test]
    fn bad_environment_is_explained() {
        let e = JobEnv::from_lookup(env(&[("HVD_RANK", "4"), ("HVD_SIZE", "4")])).unwrap_err();
        assert!(
            e.to_string()
                .contains("`HVD_RANK=4` is not a rank of `HVD_SIZE=4`"),
            "{e}"
        );
        let e = JobEnv::from_lookup(env(&[("HVD_RANK", "x"), ("HVD_SIZE", "4")])).unwrap_err();
        assert!(e.to_string().contains("not a whole number"), "{e}");
        let e = JobEnv::from_lookup(env(&[])).unwrap_err();
        assert!(e.to_string().contains("hvd run"), "{e}");
        let e = Rendezvous::parse("nonsense", None).unwrap_err();
        assert!(e.to_string().contains("file:DIR"), "{e}");
    }

    #[test]
    fn response_parsing() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\n\r\nabcdef").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"abc"[..]));
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\n\r\nabc").is_none());
        assert!(parse_response(b"garbage").is_none());
    }

    /// A real HTTP server on 127.0.0.1 that answers 503 to its first `busy` requests and 200 after; records each
    /// request head.
    fn busy_server(
        listener: std::net::TcpListener,
        busy: usize,
    ) -> std::thread::JoinHandle<Vec<String>> {
        std::thread::spawn(move || {
            let mut heads = Vec::new();
            for conn in listener.incoming() {
                let Ok(mut s) = conn else { break };
                let mut raw = Vec::new();
                let mut byte = [0u8; 1];
                while !raw.ends_with(b"\r\n\r\n") && s.read(&mut byte).is_ok_and(|n| n == 1) {
                    raw.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&raw).into_owned();
                let length: usize = head
                    .lines()
                    .find_map(|l| l.strip_prefix("Content-Length: "))
                    .map_or(0, |v| v.trim().parse().unwrap());
                let mut body = vec![0u8; length];
                s.read_exact(&mut body).unwrap();
                let answer: &[u8] = if heads.len() < busy {
                    b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 5\r\n\r\nbusy\n"
                } else {
                    b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n"
                };
                heads.push(head);
                s.write_all(answer).unwrap();
                if heads.len() > busy {
                    break;
                }
            }
            heads
        })
    }

    fn client_of(listener: &std::net::TcpListener, retry_for: Duration) -> KeyValueClient {
        Rendezvous::Http {
            address: listener.local_addr().unwrap().to_string(),
            token: Some("t".into()),
        }
        .client(2)
        .with_retry_for(retry_for)
    }

    #[test]
    fn a_busy_rendezvous_is_retried_until_it_answers() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let kv = client_of(&listener, Duration::from_secs(60));
        let server = busy_server(listener, 5);
        kv.put("addr.2", b"x").unwrap();
        let heads = server.join().unwrap();
        assert_eq!(heads.len(), 6, "five 503s, then the answer");
        // Every try is the same rank from the same process.
        let join = |h: &String| {
            h.lines()
                .find(|l| l.starts_with("X-Hvd-Join: "))
                .map(str::to_owned)
        };
        assert!(join(&heads[0]).is_some());
        assert!(
            heads
                .iter()
                .all(|h| join(h) == join(&heads[0]) && h.contains("X-Hvd-Rank: 2\r\n"))
        );
    }

    #[test]
    fn a_rendezvous_busy_past_the_timeout_fails_naming_the_503() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let kv = client_of(&listener, Duration::from_millis(300));
        let _server = busy_server(listener, usize::MAX);
        let e = kv.put("addr.2", b"x").unwrap_err().to_string();
        assert!(e.contains("answered 503 busy"), "{e}");
        let retries: u32 = e
            .split("still busy after ")
            .nth(1)
            .and_then(|rest| rest.split(' ').next())
            .and_then(|n| n.parse().ok())
            .unwrap_or_else(|| panic!("{e}"));
        assert!(retries >= 2, "{e}");
    }

    #[test]
    fn a_rendezvous_not_yet_listening_is_retried() {
        // A free port that nothing listens on yet: connections are refused until the server starts.
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let kv = Rendezvous::Http {
            address: format!("127.0.0.1:{port}"),
            token: None,
        }
        .client(0)
        .with_retry_for(Duration::from_secs(60));
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(200));
            busy_server(std::net::TcpListener::bind(("127.0.0.1", port)).unwrap(), 0)
                .join()
                .unwrap()
        });
        kv.put("k", b"v").unwrap();
        assert_eq!(late.join().unwrap().len(), 1);
        // And a server that never comes fails once the retry window is over, naming the address.
        let kv = Rendezvous::Http {
            address: format!("127.0.0.1:{port}"),
            token: None,
        }
        .client(0)
        .with_retry_for(Duration::from_millis(200));
        let e = kv.put("k", b"v").unwrap_err().to_string();
        assert!(
            e.contains(&format!("127.0.0.1:{port}")) && e.contains("retries"),
            "{e}"
        );
    }
}
