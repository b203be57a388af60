//! The rendezvous: a key-value exchange through the launcher's HTTP server (or a shared directory) by which the
//! ranks of a job find one another.
//!
//! A `file:DIR` rendezvous keeps each key in `DIR/hvd/<key>`. DIR (and `DIR/hvd`) must belong to the user and be
//! writable by nobody else, or the job refuses it (another user could plant the job's key or a rank's address);
//! `DIR/hvd` is created 0700, and every file is written 0600 under a fresh temporary name (`O_EXCL`) and renamed
//! into place. Each file starts with a line `hvd-rendezvous v1 job=<id>`: the job id is `HVD_JOB_ID`, else srun's
//! `SLURM_JOB_ID.SLURM_STEP_ID`, else empty; a rank with a job id treats a file of another job id as absent (a
//! stale `addr.N` or `tcp.key` of an earlier job in the same directory) and, when its wait ends, names it.
//!
//! Keys of a bootstrap live in a [`Round`]'s namespace (`r<n>.<key>`, see [`KeyValueClient::next_round`]): a rank
//! that joins the job again after leaving it (`hvd.init()` after `hvd.shutdown()`) never reads an earlier round's
//! address.
//!
//! The HTTP client retries a busy server (503) and failed connections with exponential backoff and jitter, bounded by
//! the start-up timeout: a server briefly full of other connections delays a rank, it does not fail it.

use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::env_vars;
use crate::error::{Error, Result};

mod round;
pub use round::Round;

/// An elastic job's round as the launcher's server hands it to one worker (`POST /elastic/v1/join`): the round
/// and this worker's rank and the round's size, the same on every member.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ElasticSeat {
    pub round: Round,
    pub rank: usize,
    pub size: usize,
}

const SCOPE: &str = "hvd";
/// How long a client retries a busy or unreachable server unless told otherwise ([`KeyValueClient::with_retry_for`]).
const DEFAULT_RETRY_FOR: Duration = Duration::from_secs(30);
/// First pause before a retry; it doubles up to [`MAX_BACKOFF`], and each pause is drawn from its upper half.
const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_secs(1);
/// The first line of every file of a `file:` rendezvous, followed by the job id.
const FILE_HEADER: &str = "hvd-rendezvous v1 job=";

/// Where ranks exchange their addresses.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
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
                env_vars::HVD_RENDEZVOUS
            )));
        }
        Ok(Rendezvous::Http {
            address: v.to_string(),
            token,
        })
    }

    /// A client for this rendezvous acting as `rank`.
    pub fn client(&self, rank: usize) -> KeyValueClient {
        let job = std::env::var(env_vars::HVD_JOB_ID)
            .ok()
            .filter(|v| !v.trim().is_empty())
            .or_else(|| {
                let id = std::env::var(env_vars::SLURM_JOB_ID).ok()?;
                let step = std::env::var(env_vars::SLURM_STEP_ID).unwrap_or_default();
                Some(format!("{id}.{step}"))
            });
        KeyValueClient {
            rendezvous: self.clone(),
            rank,
            retry_for: DEFAULT_RETRY_FOR,
            job: job.as_deref().map(job_id),
            round: None,
            group: None,
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
    /// The round whose namespace the keys are in ([`KeyValueClient::next_round`]); none: keys as given.
    round: Option<Round>,
    /// A namespace inside the round ([`KeyValueClient::in_group`]): a process set's own join.
    group: Option<String>,
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

    /// Begins this process's next [`Round`] as this client's rank of this rendezvous (the first, or the one after
    /// the rank's previous join): the returned client's keys are that round's. The keys the rank stored two rounds
    /// ago are deleted first (best effort; no rank can still read them, see [`Round`]), so the store keeps at most
    /// two rounds' keys per rank.
    pub fn next_round(self) -> KeyValueClient {
        let (round, done) = round::begin(&self.rendezvous, self.rank);
        self.entering(round, done)
    }

    /// Begins round `round` as the launcher's server gave it ([`KeyValueClient::elastic_join`]) instead of counting
    /// this process's joins; deletes what the rank stored two joins ago, as [`KeyValueClient::next_round`] does.
    pub fn in_round(self, round: Round) -> KeyValueClient {
        let done = round::begin_at(&self.rendezvous, self.rank, round);
        self.entering(round, done)
    }

    /// This client in the round this process is in as its rank (the latest it began), with its keys under `tag`
    /// inside it: a group of the job's ranks (a process set) joining among themselves while the job runs, whose keys
    /// meet neither the job's nor another group's (`tag` is unique in the round). The keys are deleted with the
    /// round's, two rounds later.
    pub fn in_group(self, tag: &str) -> Result<KeyValueClient> {
        check_key(tag)?;
        let round = round::latest(&self.rendezvous, self.rank);
        Ok(KeyValueClient {
            round,
            group: Some(tag.to_string()),
            ..self
        })
    }

    /// This client keyed by `round`, after deleting the keys `done` of an earlier round (best effort).
    fn entering(self, round: Round, done: Vec<String>) -> KeyValueClient {
        let raw = KeyValueClient {
            round: None,
            ..self.clone()
        };
        for key in done {
            if let Err(e) = raw.delete(&key) {
                tracing::debug!(key, error = %e, "could not delete a key of an earlier round");
            }
        }
        KeyValueClient {
            round: Some(round),
            ..self
        }
    }

    /// Asks the launcher's server of an elastic step for this worker's seat in the next round (the one after the
    /// last this process was a member of), waiting up to `timeout` for the round to form: it forms once every live
    /// worker has asked. This client's rank is the worker's slot (the `HVD_RANK` it was started with); the seat's
    /// rank is its rank in the round.
    pub fn elastic_join(&self, timeout: Duration) -> Result<ElasticSeat> {
        let Rendezvous::Http { address, .. } = &self.rendezvous else {
            return Err(Error::Bootstrap(format!(
                "an elastic job needs the launcher's rendezvous server, not `{}=file:...`",
                env_vars::HVD_RENDEZVOUS
            )));
        };
        let after = round::latest(&self.rendezvous, self.rank).map_or(0, Round::number);
        let deadline = crate::time::saturating_add(Instant::now(), timeout);
        loop {
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .min(Duration::from_secs(60));
            // `beats=1`: this process beats once it has its seat (`bootstrap`), so the launcher counts it heard when
            // the round forms, and finds it silent should it freeze before its first heartbeat.
            let path = format!(
                "/elastic/v1/join?after={after}&wait_ms={}&beats=1",
                wait.as_millis()
            );
            let r = self.http("POST", &path, &[], wait + Duration::from_secs(15))?;
            match r.status {
                200 => {
                    let text = String::from_utf8_lossy(&r.body);
                    let mut parts = text.split_whitespace();
                    let seat = match (parts.next(), parts.next(), parts.next(), parts.next()) {
                        (Some("v1"), Some(round), Some(rank), Some(size)) => {
                            match (
                                round.parse::<u64>(),
                                rank.parse::<usize>(),
                                size.parse::<usize>(),
                            ) {
                                (Ok(round), Ok(rank), Ok(size)) if round > after && rank < size => {
                                    Some(ElasticSeat {
                                        round: Round::new(round),
                                        rank,
                                        size,
                                    })
                                }
                                _ => None,
                            }
                        }
                        _ => None,
                    };
                    return seat.ok_or_else(|| Error::Rendezvous {
                        address: address.clone(),
                        detail: format!(
                            "the elastic join after round {after} was answered `{}`, not `v1 <round> <rank> <size>` \
                             of a later round",
                            text.trim()
                        ),
                    });
                }
                404 if Instant::now() < deadline => {}
                404 => {
                    return Err(Error::Bootstrap(format!(
                        "no round of the elastic job formed within {timeout:?} after round {after}: some live \
                         worker did not ask to join (every worker must call init again after a peer is lost)"
                    )));
                }
                _ => return Err(self.refused(address, "POST", "/elastic/v1/join", &r)),
            }
        }
    }

    /// Tells the launcher's server of an elastic step that this worker leaves on its own (preempted, after its last
    /// commit): the next round does not wait for it, and the launcher reports it as preempted rather than lost. The
    /// server takes it only from the process that joined as this slot (this process's `X-Hvd-Join`). Returns how
    /// many workers are left alive.
    pub fn elastic_leave(&self) -> Result<usize> {
        let Rendezvous::Http { address, .. } = &self.rendezvous else {
            return Err(Error::Bootstrap(format!(
                "an elastic job needs the launcher's rendezvous server, not `{}=file:...`",
                env_vars::HVD_RENDEZVOUS
            )));
        };
        let r = self.http("POST", "/elastic/v1/leave", &[], Duration::from_secs(15))?;
        if r.status != 200 {
            return Err(self.refused(address, "POST", "/elastic/v1/leave", &r));
        }
        let text = String::from_utf8_lossy(&r.body);
        match text.split_whitespace().collect::<Vec<_>>().as_slice() {
            ["v1", alive] => alive.parse().ok(),
            _ => None,
        }
        .ok_or_else(|| Error::Rendezvous {
            address: address.clone(),
            detail: format!(
                "the elastic leave was answered `{}`, not `v1 <workers left>`",
                text.trim()
            ),
        })
    }

    /// Tells the launcher's server of an elastic step that this worker is alive (its heartbeat, [`crate::liveness`]),
    /// waiting up to `timeout` to connect and again for the answer (a heartbeat late by more is worth less than the
    /// next one). `Some((round, lost))`: the latest round, and the rank in it of a
    /// member the launcher found silent; `None`: the server no longer counts this worker (410: it ended, was left out
    /// or found silent), so there is nothing to beat for.
    pub fn elastic_beat(&self, timeout: Duration) -> crate::liveness::BeatAnswer {
        let Rendezvous::Http { address, .. } = &self.rendezvous else {
            return Ok(None);
        };
        let r = self.http_request(Request {
            method: "POST",
            path: "/elastic/v1/beat",
            body: &[],
            read_timeout: timeout,
            connect_timeout: timeout,
            // A hostile or broken server cannot hold the heartbeat thread past its interval, nor fill its memory.
            within: Some((timeout, BEAT_ANSWER_LIMIT)),
        })?;
        match r.status {
            200 => {}
            410 => return Ok(None),
            _ => return Err(self.refused(address, "POST", "/elastic/v1/beat", &r)),
        }
        let text = String::from_utf8_lossy(&r.body);
        crate::liveness::parse_answer(&text)
            .map(Some)
            .ok_or_else(|| Error::Rendezvous {
                address: address.clone(),
                detail: format!(
                    "the elastic heartbeat was answered `{}`, not `v1 <round> <lost rank or -> <timeout ms or ->`",
                    text.trim()
                ),
            })
    }

    /// The round this client's keys belong to, if any.
    pub fn round(&self) -> Option<Round> {
        self.round
    }

    /// `key` as stored: in this client's round's namespace.
    fn scoped(&self, key: &str) -> Result<String> {
        check_key(key)?;
        let key = match &self.group {
            Some(group) => format!("{group}.{key}"),
            None => key.to_string(),
        };
        Ok(match self.round {
            Some(round) => round.key(&key),
            None => key,
        })
    }

    /// Stores `value` under `key` ([A-Za-z0-9._-]).
    pub fn put(&self, key: &str, value: &[u8]) -> Result<()> {
        let key = &self.scoped(key)?;
        if let Some(round) = self.round {
            round::stored(&self.rendezvous, self.rank, round, key);
        }
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

    /// Deletes `key` (also when absent).
    pub fn delete(&self, key: &str) -> Result<()> {
        let key = &self.scoped(key)?;
        match &self.rendezvous {
            Rendezvous::Http { address, .. } => {
                let path = format!("/kv/{SCOPE}/{key}");
                let r = self.http("DELETE", &path, &[], Duration::from_secs(30))?;
                if r.status != 200 {
                    return Err(self.refused(address, "DELETE", key, &r));
                }
                Ok(())
            }
            Rendezvous::Directory(dir) => {
                let path = private_scope(dir)?.join(key);
                match std::fs::remove_file(&path) {
                    Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                        Err(Error::io(format!("remove `{}`", path.display()), e))
                    }
                    _ => Ok(()),
                }
            }
        }
    }

    /// Reads `key`, waiting up to `timeout` for another rank to store it.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let key = &self.scoped(key)?;
        let deadline = crate::time::saturating_add(Instant::now(), timeout);
        let mut stale: Option<(PathBuf, String)> = None;
        // A member of an elastic round waits in short polls: a peer the launcher finds silent meanwhile (it froze
        // before storing its key) fails the wait within a second, not after `timeout`.
        let poll = match crate::liveness::in_round() {
            true => Duration::from_secs(1),
            false => Duration::from_secs(60),
        };
        loop {
            crate::liveness::check()?;
            let left = deadline.saturating_duration_since(Instant::now());
            match &self.rendezvous {
                Rendezvous::Http { address, .. } => {
                    let wait = left.min(poll);
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
                let rejoin = match self.round {
                    Some(round) if round > Round::FIRST => format!(
                        " This is join {} of the job by this rank: every rank must call init (and shutdown) the \
                         same number of times.",
                        round.number()
                    ),
                    _ => String::new(),
                };
                return Err(Error::Bootstrap(format!(
                    "no rank stored `{key}` at the rendezvous within {timeout:?}; did every rank start?{rejoin}"
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
        self.http_request(Request {
            method,
            path,
            body,
            read_timeout,
            connect_timeout: CONNECT_TIMEOUT,
            within: None,
        })
    }

    /// [`KeyValueClient::http`] of a request with its own timeouts.
    fn http_request(&self, request: Request<'_>) -> Result<HttpResponse> {
        let (method, path) = (request.method, request.path);
        let deadline = crate::time::saturating_add(Instant::now(), self.retry_for);
        let mut backoff = Backoff::new();
        loop {
            let outcome = self.http_once(request);
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
    fn http_once(&self, request: Request<'_>) -> Result<HttpResponse> {
        let Rendezvous::Http { address, token } = &self.rendezvous else {
            return Err(Error::Bootstrap("not an HTTP rendezvous".into()));
        };
        let err = |d: String| Error::Rendezvous {
            address: address.clone(),
            detail: d,
        };
        let deadline = request
            .within
            .map(|(overall, _)| crate::time::saturating_add(Instant::now(), overall));
        // What is left of the request's overall time (`Err` once it is spent), at most `each`.
        let spent = || {
            err(format!(
                "no complete answer to {} {} within {:?}",
                request.method,
                request.path,
                request.within.map_or(Duration::ZERO, |w| w.0)
            ))
        };
        let left = |each: Duration| match deadline {
            None => Ok(each),
            Some(d) => match d.checked_duration_since(Instant::now()) {
                Some(left) if !left.is_zero() => Ok(left.min(each)),
                _ => Err(spent()),
            },
        };
        let stream = connect_within(address, request.connect_timeout, deadline)
            .map_err(|e| err(format!("connect: {e}")))?;
        stream
            .set_read_timeout(Some(left(request.read_timeout)?))
            .map_err(|e| err(format!("configure socket: {e}")))?;
        stream
            .set_write_timeout(Some(left(Duration::from_secs(30))?))
            .map_err(|e| err(format!("configure socket: {e}")))?;
        let mut head = format!(
            "{} {} HTTP/1.1\r\nHost: {address}\r\nX-Hvd-Rank: {}\r\nX-Hvd-Join: {}\r\n",
            request.method,
            request.path,
            self.rank,
            join_identity()
        );
        if let Some(t) = token {
            head.push_str(&format!("Authorization: Bearer {t}\r\n"));
        }
        head.push_str(&format!(
            "Content-Length: {}\r\nConnection: close\r\n\r\n",
            request.body.len()
        ));
        let mut s = &stream;
        let sent = s
            .write_all(head.as_bytes())
            .and_then(|()| s.write_all(request.body));
        let mut raw = Vec::new();
        let mut out_of_time = false;
        let read = match request.within {
            None => s.read_to_end(&mut raw).map(drop),
            Some((_, limit)) => {
                // Read in pieces, each within what is left of the overall time, at most `limit` bytes in all.
                let mut piece = [0u8; 1024];
                loop {
                    let each = left(request.read_timeout)?;
                    stream
                        .set_read_timeout(Some(each))
                        .map_err(|e| err(format!("configure socket: {e}")))?;
                    match s.read(&mut piece) {
                        Ok(0) => break Ok(()),
                        Ok(n) if raw.len() + n > limit => {
                            return Err(err(format!(
                                "the answer to {} {} is longer than {limit} bytes",
                                request.method, request.path
                            )));
                        }
                        Ok(n) => raw.extend_from_slice(&piece[..n]),
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        // The read had what was left of the overall time: that time is spent (the socket's timer
                        // may fire a little before the deadline's clock says so).
                        Err(e)
                            if each < request.read_timeout
                                && matches!(
                                    e.kind(),
                                    std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                                ) =>
                        {
                            out_of_time = true;
                            break Err(e);
                        }
                        Err(e) => break Err(e),
                    }
                }
            }
        };
        // A server may answer before it has read everything (a 503 when full, a 403) and close: its answer, when it
        // arrived, says more than the failed send.
        if let Some(r) = parse_response(&raw) {
            return Ok(r);
        }
        sent.map_err(|e| err(format!("send: {e}")))?;
        read.map_err(|e| match out_of_time {
            true => spent(),
            false => err(format!("read the answer: {e}")),
        })?;
        Err(err(format!(
            "malformed answer to {} {}",
            request.method, request.path
        )))
    }
}

/// One request of [`KeyValueClient::http`]: each try sends it again.
#[derive(Debug, Clone, Copy)]
struct Request<'a> {
    method: &'a str,
    path: &'a str,
    body: &'a [u8],
    read_timeout: Duration,
    /// How long each address the server's resolves to is tried ([`CONNECT_TIMEOUT`] but for heartbeats).
    connect_timeout: Duration,
    /// For a heartbeat: the whole exchange (sending, and reading the answer) ends within this time, and an answer
    /// longer than this many bytes is refused. `None`: only the per-read timeout and no limit (a value's size).
    within: Option<(Duration, usize)>,
}

/// The most bytes of a heartbeat's answer read (its head and `v1 <round> <lost> <timeout>`: a few dozen).
const BEAT_ANSWER_LIMIT: usize = 4096;

/// How long a connection to the server is tried, per address.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Exponential backoff with jitter: pauses of 10 ms, 20 ms, ... up to 1 s, each drawn from the upper half of its step
/// so that ranks retrying together spread out.
pub(crate) struct Backoff {
    step: Duration,
    state: u64,
    retries: u32,
}

impl Backoff {
    pub(crate) fn new() -> Backoff {
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

    pub(crate) fn next_pause(&mut self) -> Duration {
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

pub(crate) fn connect_any(address: &str) -> std::io::Result<TcpStream> {
    connect_within(address, CONNECT_TIMEOUT, None)
}

/// [`connect_any`], trying each address for up to `timeout`, and all of them before `deadline` when one is given.
fn connect_within(
    address: &str,
    timeout: Duration,
    deadline: Option<Instant>,
) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::other("the address resolves to nothing");
    for a in address.to_socket_addrs()? {
        let each = match deadline.map(|d| d.saturating_duration_since(Instant::now())) {
            None => timeout,
            Some(left) if left.is_zero() => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "out of time",
                ));
            }
            Some(left) => left.min(timeout),
        };
        match TcpStream::connect_timeout(&a, each) {
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

/// How [`check_private_dir`] names a directory and what it tells the user.
#[derive(Debug, Clone, Copy)]
pub struct PrivateDir<'a> {
    /// Said before the directory's path (e.g. `the rendezvous directory `), or empty.
    pub name: &'a str,
    /// What another user could plant in it.
    pub plant: &'a str,
    /// What to do when the directory is another user's.
    pub not_yours: &'a str,
    /// Said after "run `chmod go-w DIR`" when it is writable by others (e.g. ` or use ...`), or empty.
    pub or_else: &'a str,
}

/// Why [`check_private_dir`] refused a directory.
#[derive(Debug)]
pub enum NotPrivate {
    /// Its metadata could not be read.
    Unreadable(std::io::Error),
    /// It is another user's, or writable by its group or others: the message says which and what to do.
    Refused(String),
}

/// Refuses a directory hvd keeps what others must not plant in unless it is this user's and not writable by group
/// or others (the file rendezvous's directories; the launcher's private directories, `hvd_launcher::untrusted`).
pub fn check_private_dir(dir: &Path, says: PrivateDir<'_>) -> std::result::Result<(), NotPrivate> {
    let PrivateDir {
        name,
        plant,
        not_yours,
        or_else,
    } = says;
    let m = std::fs::metadata(dir).map_err(NotPrivate::Unreadable)?;
    // SAFETY: geteuid has no preconditions.
    let me = unsafe { libc::geteuid() };
    let d = dir.display();
    if m.uid() != me {
        return Err(NotPrivate::Refused(format!(
            "{name}`{d}` belongs to uid {}, not to this user (uid {me}): its owner could plant {plant}; {not_yours}",
            m.uid()
        )));
    }
    let mode = m.permissions().mode();
    if mode & 0o022 != 0 {
        return Err(NotPrivate::Refused(format!(
            "{name}`{d}` is writable by its group or others (mode {:o}): another user could plant {plant}; run \
             `chmod go-w {d}`{or_else}",
            mode & 0o7777
        )));
    }
    Ok(())
}

/// Refuses a rendezvous directory another user could write into (or that is not the user's own).
fn check_rendezvous_dir(dir: &Path) -> Result<()> {
    let says = PrivateDir {
        name: "the rendezvous directory ",
        plant: "the job's key or a rank's address",
        not_yours: "use a directory of your own (e.g. from `mktemp -d`)",
        or_else: " or use a directory from `mktemp -d`",
    };
    check_private_dir(dir, says).map_err(|e| match e {
        NotPrivate::Unreadable(e) => Error::io(
            format!("read the rendezvous directory `{}`", dir.display()),
            e,
        ),
        NotPrivate::Refused(message) => Error::Bootstrap(message),
    })
}

/// `DIR/hvd` of a `file:` rendezvous, created 0700 when missing; DIR and it checked with [`check_rendezvous_dir`].
fn private_scope(dir: &Path) -> Result<PathBuf> {
    // A missing DIR is created (0700 like every directory created on the way).
    if let Err(e) = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
    {
        return Err(Error::io(format!("create `{}`", dir.display()), e));
    }
    check_rendezvous_dir(dir)?;
    let scope = dir.join(SCOPE);
    match std::fs::DirBuilder::new().mode(0o700).create(&scope) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(Error::io(format!("create `{}`", scope.display()), e)),
    }
    check_rendezvous_dir(&scope)?;
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A group's keys (a process set's join) live in the job's current round under the group's tag: the same key
    /// of the job and of the group are two values.
    #[test]
    fn a_group_keys_its_values_inside_the_round_apart_from_the_job() {
        let dir = tempfile::tempdir().unwrap();
        let rdv = Rendezvous::Directory(dir.path().join("rdv"));
        let job = rdv.client(0).next_round();
        let round = job.round().unwrap();
        job.put("addr.0", b"job").unwrap();
        let group = rdv.client(0).in_group("ps1-ab").unwrap();
        assert_eq!(group.round(), Some(round));
        group.put("addr.0", b"group").unwrap();
        let t = Duration::from_millis(100);
        assert_eq!(job.get("addr.0", t).unwrap(), b"job");
        assert_eq!(group.get("addr.0", t).unwrap(), b"group");
        let raw = rdv.client(0);
        assert_eq!(
            raw.get(&format!("{round}.ps1-ab.addr.0"), t).unwrap(),
            b"group"
        );
        assert!(rdv.client(0).in_group("bad/tag").is_err());
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

    /// A hostile rendezvous answering a heartbeat with `answer` (its head and body) `step` bytes at a time, `pause`
    /// apart, until the client hangs up; then returns what the client's beat gave.
    fn beat_against(answer: Vec<u8>, step: usize, pause: Duration) -> crate::liveness::BeatAnswer {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let kv = client_of(&listener, Duration::ZERO);
        let server = std::thread::spawn(move || {
            let (mut s, _) = listener.accept().unwrap();
            let mut head = Vec::new();
            let mut byte = [0u8; 1];
            while !head.ends_with(b"\r\n\r\n") && s.read(&mut byte).is_ok_and(|n| n == 1) {
                head.push(byte[0]);
            }
            for piece in answer.chunks(step) {
                if s.write_all(piece).is_err() {
                    break;
                }
                std::thread::sleep(pause);
            }
        });
        let got = kv.elastic_beat(Duration::from_millis(500));
        drop(kv);
        server.join().unwrap();
        got
    }

    /// A heartbeat's answer is read within the beat's interval: a server dripping a valid answer slowly (each read
    /// well within the per-read timeout) fails the beat instead of holding the heartbeat thread.
    #[test]
    fn a_dripping_rendezvous_fails_the_beat_within_its_interval() {
        let mut answer = b"HTTP/1.1 200 OK\r\n".to_vec();
        answer.extend(std::iter::repeat_n(b'X', 150));
        answer.extend(b": y\r\nContent-Length: 8\r\n\r\nv1 1 - -");
        let e = beat_against(answer, 1, Duration::from_millis(50)).unwrap_err();
        assert!(e.to_string().contains("no complete answer"), "{e}");
    }

    /// A heartbeat's answer is at most a few KiB: an endless one is refused, not read into memory.
    #[test]
    fn an_endless_beat_answer_is_refused() {
        let mut answer = b"HTTP/1.1 200 OK\r\n\r\nv1 1 - -".to_vec();
        answer.extend(std::iter::repeat_n(b' ', 8 << 20));
        let e = beat_against(answer, 64 << 10, Duration::ZERO).unwrap_err();
        assert!(e.to_string().contains("longer than 4096 bytes"), "{e}");
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
