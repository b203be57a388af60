//! Joining a job: who am I (rank, size, host) from the environment, and a key-value exchange of addresses through
//! the launcher's rendezvous server (or a shared directory) to connect the ranks.
//!
//! Rank and size come from the launcher's variables, read by [`crate::launch_env`] (the same reader as
//! `hvd worker-env`'s, one precedence: the launcher that started this process wins). Hosts are grouped by
//! `HVD_HOSTNAME` (else the machine's host name), so local and cross ranks are derived, not trusted.
//!
//! Exchange (scope `hvd`, in the namespace of this join's [`Round`](crate::rendezvous::Round), `r<n>.`): every rank
//! PUTs `addr.<rank>` = `v1 <hostname> <ip:port>` and reads everyone's; the lowest rank of each host creates the
//! host's shared memory segment (named with the round) and PUTs its name at `shm.<host index>`.
//!
//! The exchange goes through the [`rendezvous`](crate::rendezvous); who this rank is comes from
//! [`JobEnv`].

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::time::{Duration, Instant};

use crate::communicator::Communicator;
use crate::config::{Thresholds, timeout_from_env};
use crate::env_vars;
use crate::error::{Error, Result};
use crate::hierarchical::MixedTransport;
use crate::p2p::P2pCommunicator;
use crate::rendezvous::{Backoff, connect_any};
use crate::shm::{ShmSegment, ShmTransport, ring_bytes_from_env};
use crate::tcp::{JobKey, TcpTransport, interface_address, listen};
use crate::types::{Topology, host_indices};

pub use crate::job::JobEnv;
pub use crate::rendezvous::{KeyValueClient, Rendezvous};

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
    let choice: BackendChoice = std::env::var(env_vars::HVD_COLLECTIVE_BACKEND)
        .unwrap_or_default()
        .parse()?;
    let job = JobEnv::from_env()?;
    let timeout = timeout_from_env()?;
    if std::env::var(env_vars::HVD_ELASTIC).is_ok_and(|v| v.trim() == "1") {
        return connect_elastic(&job, choice, timeout);
    }
    connect(&job, choice, timeout)
}

/// Joins the next round of an elastic job (`HVD_ELASTIC=1`): `job.rank` is this worker's slot; its rank and the
/// round's size come from the launcher's server ([`KeyValueClient::elastic_join`]), and the round's keys are in the
/// server's round namespace. The server waits for the round up to the start-up timeout.
fn connect_elastic(
    job: &JobEnv,
    choice: BackendChoice,
    timeout: Duration,
) -> Result<Box<dyn Communicator>> {
    if matches!(choice, BackendChoice::Mpi | BackendChoice::Nccl) {
        return Err(Error::Bootstrap(format!(
            "an elastic job (`{}=1`) runs on hvd's own transports (shm, tcp, hierarchical), not on the {choice:?} \
             backend, whose job is fixed when it starts",
            env_vars::HVD_ELASTIC
        )));
    }
    let Some(rendezvous) = &job.rendezvous else {
        return Err(Error::Bootstrap(format!(
            "an elastic job needs the launcher's rendezvous server (`{}`)",
            env_vars::HVD_RENDEZVOUS
        )));
    };
    let client = rendezvous.client(job.rank).with_retry_for(timeout);
    let heartbeat = crate::liveness::timeout_from(
        std::env::var(env_vars::HVD_HEARTBEAT_TIMEOUT)
            .ok()
            .as_deref(),
    )?;
    let window = elastic_window_from_env()?;
    let seat = client.elastic_join(elastic_join_wait(timeout, window))?;
    tracing::debug!(slot = job.rank, round = %seat.round, rank = seat.rank, size = seat.size, "elastic round");
    // Before the round's communicator is built: a member of it found silent fails this process's waits for it from now
    // on, the start-up's (the address exchange at the rendezvous, tcp handshakes, shared memory attach) and the
    // collectives' (hvd's tcp and shm transports).
    crate::liveness::enter_round(seat.round.number(), seat.size);
    // Each heartbeat is one try, its connection and its answer awaited one interval at most: the next heartbeat, on
    // its fixed cadence, is its retry, and a slow one never holds back those after it for long.
    let beats = client.clone().with_retry_for(Duration::ZERO);
    crate::liveness::start(
        heartbeat,
        crate::liveness::orphaned_after(window, heartbeat),
        move |every| beats.elastic_beat(every),
    );
    let member = JobEnv {
        rank: seat.rank,
        size: seat.size,
        ..job.clone()
    };
    connect_in(
        &member,
        choice,
        timeout,
        rendezvous,
        client.in_round(seat.round),
        None,
    )
}

/// The round window of an elastic step from `HVD_ELASTIC_TIMEOUT` (seconds, fractions allowed; set by `hvd run` from
/// `--elastic-timeout` or the step's `workers = { elastic_timeout }`); `None` when unset.
fn elastic_window_from_env() -> Result<Option<Duration>> {
    match std::env::var(env_vars::HVD_ELASTIC_TIMEOUT) {
        Ok(v) => elastic_window(&v).map(Some),
        Err(_) => Ok(None),
    }
}

/// `HVD_ELASTIC_TIMEOUT`'s value: seconds within [`ELASTIC_TIMEOUT_SECONDS`](hvd_env_vars::ELASTIC_TIMEOUT_SECONDS),
/// the range the file and the flag are checked against, so what `hvd run` sets is always taken.
fn elastic_window(v: &str) -> Result<Duration> {
    let (low, high) = hvd_env_vars::ELASTIC_TIMEOUT_SECONDS;
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| (low as f64..=high as f64).contains(s))
        .map(Duration::from_secs_f64)
        .ok_or_else(|| {
            Error::Bootstrap(format!(
                "`{}={v}` is not a number of seconds from {low} to at most {high} (`hvd run` sets it from \
                 `--elastic-timeout` or the step's `workers = {{ elastic_timeout }}`, both checked against that range)",
                env_vars::HVD_ELASTIC_TIMEOUT
            ))
        })
}

/// How long an elastic join waits for its round: at least the operation `timeout`, and when the server's round
/// `window` is known, that window plus a margin (the operation timeout, at least 10 s) for a survivor that noticed
/// the loss later than the first one, whose request started the window. Shorter, a survivor would give up while the
/// server still waits for a hung peer, and the whole step would fail instead of dropping that peer.
fn elastic_join_wait(timeout: Duration, window: Option<Duration>) -> Duration {
    match window {
        None => timeout,
        Some(window) => timeout.max(window.saturating_add(timeout.max(Duration::from_secs(10)))),
    }
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
            env_vars::HVD_RENDEZVOUS,
            job.size,
            env_vars::HVD_RENDEZVOUS
        )));
    };
    let kv = rendezvous
        .client(job.rank)
        .with_retry_for(timeout)
        .next_round();
    connect_in(job, choice, timeout, rendezvous, kv, None)
}

/// Joins a group of the job's ranks among themselves while the job runs (a process set): `job` is this process as
/// it joined the job (its slot identifies it to the rendezvous), `member` its position among the group's ranks and
/// `size` their number; `tag` names this join of the group, the same on every member and unique in the job's
/// round. The keys live in the job's current round under `tag`, so they meet neither the job's nor another
/// group's. The backend comes from `HVD_COLLECTIVE_BACKEND` (auto: as for the job, from the members' hosts); the
/// mpi and nccl backends, whose communicator is fixed when the job starts, are refused.
pub fn connect_group(
    job: &JobEnv,
    member: usize,
    size: usize,
    tag: &str,
) -> Result<Box<dyn Communicator>> {
    let choice: BackendChoice = std::env::var(env_vars::HVD_COLLECTIVE_BACKEND)
        .unwrap_or_default()
        .parse()?;
    if matches!(choice, BackendChoice::Mpi | BackendChoice::Nccl) {
        return Err(Error::Bootstrap(format!(
            "a group of the job's ranks (a process set) runs on hvd's own transports (shm, tcp, hierarchical), \
             not on the {choice:?} backend"
        )));
    }
    let Some(rendezvous) = &job.rendezvous else {
        return Err(Error::Bootstrap(format!(
            "a group of the job's ranks needs the job's rendezvous (`{}`)",
            env_vars::HVD_RENDEZVOUS
        )));
    };
    let timeout = timeout_from_env()?;
    let kv = rendezvous
        .client(job.rank)
        .with_retry_for(timeout)
        .in_group(tag)?;
    let member = JobEnv {
        rank: member,
        size,
        ..job.clone()
    };
    // The handshake proves the group's key, not the job's: a rank of another group of the same size (or of an
    // earlier join of this one) holding the job's token is refused.
    connect_in(&member, choice, timeout, rendezvous, kv, Some(tag))
}

/// Joins `job` through `kv`, a client already in the round's namespace; `group` is the tag of a group's join,
/// whose tcp handshakes then prove a key of that join ([`JobKey::for_group`]).
fn connect_in(
    job: &JobEnv,
    choice: BackendChoice,
    timeout: Duration,
    rendezvous: &Rendezvous,
    kv: KeyValueClient,
    group: Option<&str>,
) -> Result<Box<dyn Communicator>> {
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
    let hosts = host_indices(&names);
    let topo = Topology::from_hosts(job.rank, &hosts);
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
            let key = group_key(JobKey::for_job(rendezvous, &kv, job.rank, timeout)?, group);
            let t = TcpTransport::connect(job.rank, &listener, &addrs, &key, timeout)?;
            boxed(P2pCommunicator::new(t, "tcp", hosts, timeout), th)
        }
        BackendChoice::Shm => {
            let (seg, local, global, name) = host_segment(&kv, job.rank, &hosts, timeout)?;
            let mut t = ShmTransport::attach_mapped(seg, local, global)?;
            t.wait_attached(timeout)?;
            if let Some(name) = name {
                ShmSegment::unlink(&name);
            }
            boxed(P2pCommunicator::new(t, "shm", hosts, timeout), th)
        }
        _ => {
            let (seg, _, _, name) = host_segment(&kv, job.rank, &hosts, timeout)?;
            let key = group_key(JobKey::for_job(rendezvous, &kv, job.rank, timeout)?, group);
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

fn group_key(key: JobKey, group: Option<&str>) -> JobKey {
    match group {
        Some(tag) => key.for_group(tag),
        None => key,
    }
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
        let round = kv.round().map(|r| format!("-{r}")).unwrap_or_default();
        let name = format!("hvd-{}{round}-{nanos:x}", std::process::id());
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
    if let Ok(a) = std::env::var(env_vars::HVD_TCP_ADDRESS) {
        return a.trim().parse().map_err(|_| {
            Error::Bootstrap(format!(
                "`{}={a}` is not an IP address",
                env_vars::HVD_TCP_ADDRESS
            ))
        });
    }
    if let Ok(name) = std::env::var(env_vars::HVD_TCP_INTERFACE) {
        return interface_address(name.trim());
    }
    match rendezvous {
        Rendezvous::Directory(_) => Ok(IpAddr::V4(Ipv4Addr::LOCALHOST)),
        Rendezvous::Http { address, .. } => {
            // The server may not be accepting yet (a rank 0 that serves it starting up): retry like every request.
            let deadline = crate::time::saturating_add(Instant::now(), timeout);
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

    #[test]
    fn an_elastic_join_outwaits_the_servers_round_window() {
        let s = Duration::from_secs;
        // Without a window: the operation timeout, as before.
        assert_eq!(elastic_join_wait(s(30), None), s(30));
        // The launcher's default window (60 s) above the default operation timeout (30 s): the window and a margin.
        assert_eq!(elastic_join_wait(s(30), Some(s(60))), s(90));
        // A 1 s operation timeout still outwaits a 3 s window by at least 10 s.
        assert_eq!(elastic_join_wait(s(1), Some(s(3))), s(13));
        assert!(elastic_join_wait(s(120), Some(s(1))) >= s(120));
    }

    /// What `hvd run` sets is taken (the file's and the flag's range); anything else is refused saying the range,
    /// not taken as a window no file or flag could give.
    #[test]
    fn the_round_window_is_taken_within_the_files_and_the_flags_range() {
        let (low, high) = hvd_env_vars::ELASTIC_TIMEOUT_SECONDS;
        assert_eq!((low, high), (1, 86_400));
        for (v, want) in [
            ("1", Duration::from_secs(1)),
            ("1.5", Duration::from_millis(1500)),
            (" 60 ", Duration::from_secs(60)),
            ("86400", Duration::from_secs(86_400)),
        ] {
            assert_eq!(elastic_window(v).unwrap(), want, "{v}");
        }
        for v in [
            "0", "0.5", "86400.5", "1e9", "1e19", "inf", "NaN", "-5", "", "60s",
        ] {
            let e = elastic_window(v).unwrap_err().to_string();
            assert!(
                e.contains(&format!(
                    "`HVD_ELASTIC_TIMEOUT={v}` is not a number of seconds from 1 to at most 86400"
                )),
                "{v}: {e}"
            );
        }
    }
}
