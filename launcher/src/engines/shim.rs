//! The worker shim: maps the rank variables of whoever started the process (OpenMPI, MVAPICH2, MPICH/Hydra, Slurm,
//! an Indexed Kubernetes Job / JobSet, a Spark barrier task of the spark engine; read by
//! [`hvd_collective::launch_env`]) to the worker contract (`HVD_*`, Horovod's and torch's variables), using the same
//! builder as the local engine ([`crate::env::worker_env`]). `hvd worker-env -- CMD` applies it and execs CMD.

use std::collections::BTreeMap;

use crate::env::{RendezvousInfo, Slot, worker_env};

/// Variable that carries `resources.gpus` to the shim (it sets `CUDA_VISIBLE_DEVICES` from the local rank).
pub const GPUS_VAR: &str = "HVD_GPUS_PER_WORKER";

pub use hvd_collective::launch_env::{LaunchEnvError, LaunchSource as RankSource};

/// Why the shim cannot tell which rank it is.
#[derive(Debug, thiserror::Error)]
pub enum ShimError {
    /// No rank variables, a non-number, or rank >= size (the message names the variables).
    #[error(transparent)]
    Rank(#[from] LaunchEnvError),
    #[error("`HVD_RENDEZVOUS` is `{0}`, not host:port")]
    BadRendezvous(String),
    /// `SLURM_STEP_NODELIST` is set but not a host list (escaped value).
    #[error(
        "`{var}` is `{0}`, not a Slurm node list (host names and `[1-3]` ranges, separated by commas): rank 0's node \
         (torch's `MASTER_ADDR`) cannot be told; run the task under srun as Slurm sets it",
        var = crate::env_vars::SLURM_STEP_NODELIST
    )]
    BadNodeList(String),
}

/// Reads the slot of this process from `get` (the environment) with the one reader of launchers' rank variables,
/// [`hvd_collective::launch_env::slot_from_lookup`] (the bootstrap of every worker uses it too, so both agree; its
/// documentation gives the precedence and why). The host is `HVD_SPARK_HOST`, else `HVD_HOSTNAME`, else
/// `SLURMD_NODENAME`, else `HOSTNAME`, else the kernel's.
pub fn slot_from_env(
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<(Slot, RankSource), ShimError> {
    let s = hvd_collective::launch_env::slot_from_lookup(get)?;
    let host = get("HVD_SPARK_HOST")
        .or_else(|| get("HVD_HOSTNAME"))
        .or_else(|| get("SLURMD_NODENAME"))
        .or_else(|| get("HOSTNAME"))
        .unwrap_or_else(crate::env::local_hostname);
    Ok((
        Slot {
            rank: s.rank,
            size: s.size,
            host,
            local_rank: s.local_rank,
            local_size: s.local_size,
            cross_rank: s.cross_rank,
            cross_size: s.cross_size,
        },
        s.source,
    ))
}

/// The variables the shim sets for this process: the same list the local engine gives a worker (rendezvous from
/// `HVD_RENDEZVOUS`/`HVD_JOB_TOKEN` when present; without one only the rank variables are set).
pub fn shim_env(get: &dyn Fn(&str) -> Option<String>) -> Result<Vec<(String, String)>, ShimError> {
    let (slot, source) = slot_from_env(get)?;
    let gpus = get(GPUS_VAR)
        .and_then(|g| g.trim().parse::<u32>().ok())
        .unwrap_or(0);
    let rendezvous = match get("HVD_RENDEZVOUS") {
        Some(addr) => Some(RendezvousInfo {
            addr: addr
                .parse()
                .map_err(|_| ShimError::BadRendezvous(addr.clone()))?,
            token: get("HVD_JOB_TOKEN").unwrap_or_default(),
        }),
        None => None,
    };
    let mut vars = worker_env(&BTreeMap::new(), &slot, rendezvous.as_ref(), gpus, None);
    if rendezvous.is_none() {
        vars.extend(crate::env::rank_env(&slot));
    }
    // Under srun with a rendezvous off loopback (the launcher's, on another machine than some ranks): torch's env://
    // meets at rank 0's node, the step's first (block or cyclic placement), not at the launcher. Without the step's
    // node list, or under `--distribution=arbitrary` (rank 0 may be on any node), `MASTER_ADDR` stays the
    // rendezvous's address; a node list that is not one is an error.
    let arbitrary = get(crate::env_vars::SLURM_DISTRIBUTION)
        .is_some_and(|d| d.trim().split([':', ',']).next() == Some("arbitrary"));
    if source == RankSource::Slurm
        && rendezvous.is_some_and(|r| !r.addr.ip().is_loopback())
        && !arbitrary
        && let Some(list) =
            get(crate::env_vars::SLURM_STEP_NODELIST).filter(|l| !l.trim().is_empty())
    {
        let node = crate::engines::slurm::first_node(&list)
            .ok_or_else(|| ShimError::BadNodeList(shown(&list)))?;
        vars.push((crate::env_vars::MASTER_ADDR.into(), node));
    }
    Ok(vars)
}

/// A value from outside as an error shows it: escaped, and cut after its first 200 characters (`...` then), so that
/// a huge list does not become a huge message on every rank.
fn shown(value: &str) -> String {
    const MAX: usize = 200;
    let mut text: String = value
        .chars()
        .take(MAX)
        .collect::<String>()
        .escape_default()
        .to_string();
    if value.chars().nth(MAX).is_some() {
        text.push_str("...");
    }
    text
}

/// Set (to `1`) on every rank of a job whose launcher serves no rendezvous (a Kubernetes JobSet): rank 0's shim then
/// serves it itself on `HVD_RENDEZVOUS`'s port, for as long as its worker runs.
pub const SERVE_VAR: &str = "HVD_RENDEZVOUS_SERVE";
/// How long (seconds) the shim waits for `HVD_RENDEZVOUS` to resolve and accept connections (default 300 when rank
/// 0 serves it, else 0: under a launcher the server is up before any worker starts).
pub const WAIT_VAR: &str = "HVD_RENDEZVOUS_WAIT";

/// The pod's own IP (`status.podIP` through the downward API, set by the manifests of `hvd export k8s`): the one
/// address rank 0's shim serves the rendezvous on.
pub const POD_IP_VAR: &str = "HVD_POD_IP";

/// Errors of the shim's own rendezvous handling.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("`{SERVE_VAR}` is set but `HVD_RENDEZVOUS` is not `host:port` (it is {0:?})")]
    NoAddress(Option<String>),
    #[error("`HVD_JOB_TOKEN` is missing or empty; rank 0 needs it to serve the rendezvous")]
    NoToken,
    #[error(
        "`{WAIT_VAR}` is `{0}`, not a number of seconds from 0 to {day} (a day)",
        day = hvd_collective::time::DAY_SECONDS
    )]
    BadWait(String),
    #[error(
        "`{POD_IP_VAR}` is `{0}`, not the pod's IP address (the manifest sets it from `status.podIP`); rank 0 \
         serves the rendezvous on that address only, never on all of them"
    )]
    BadPodIp(String),
    #[error(
        "rank 0 has no address to serve the rendezvous on: `{POD_IP_VAR}` is not set and `{address}` did not \
         resolve to an address of this machine ({detail}); set `{POD_IP_VAR}` from `status.podIP`"
    )]
    NoBindAddress { address: String, detail: String },
    #[error(transparent)]
    Server(#[from] crate::rendezvous::RendezvousError),
    #[error(
        "the rendezvous `{address}` did not {what} within {waited:?}: {detail}; is rank 0 running, and does its \
         name resolve from here?"
    )]
    Unreachable {
        address: String,
        what: &'static str,
        waited: std::time::Duration,
        detail: String,
    },
}

/// When `HVD_RENDEZVOUS_SERVE=1` and this is rank 0: starts the rendezvous server at `HVD_RENDEZVOUS`'s port on the
/// pod's own address only, guarded by `HVD_JOB_TOKEN` (Horovod's token-less gloo endpoints answer nobody). The
/// address is `HVD_POD_IP` (the manifests set it from `status.podIP`); without it, what `HVD_RENDEZVOUS`'s host
/// name resolves to (the pod's own name under its headless service; retried for `HVD_RENDEZVOUS_WAIT`, as a pod's
/// name is published a moment after it starts), which must be an address of this machine. Never the unspecified
/// address: other networks the pod is on (a host-network or multi-homed pod) do not reach the rendezvous.
pub fn serve_if_rank_zero(
    get: &dyn Fn(&str) -> Option<String>,
    slot: &Slot,
) -> Result<Option<crate::rendezvous::RendezvousServer>, ServeError> {
    if get(SERVE_VAR).as_deref() != Some("1") || slot.rank != 0 {
        return Ok(None);
    }
    let address = get("HVD_RENDEZVOUS");
    let port = address
        .as_deref()
        .and_then(|a| a.rsplit_once(':'))
        .and_then(|(_, p)| p.parse::<u16>().ok())
        .filter(|p| *p != 0)
        .ok_or_else(|| ServeError::NoAddress(address.clone()))?;
    let token = get("HVD_JOB_TOKEN")
        .filter(|t| !t.is_empty())
        .ok_or(ServeError::NoToken)?;
    let ip = match get(POD_IP_VAR) {
        Some(value) => value
            .trim()
            .parse::<std::net::IpAddr>()
            .ok()
            .filter(|ip| !ip.is_unspecified() && !ip.is_multicast())
            .ok_or(ServeError::BadPodIp(value))?,
        None => own_address(address.as_deref().unwrap_or_default(), wait(get, 300.0)?)?,
    };
    let bind = std::net::SocketAddr::new(ip, port);
    let server = crate::rendezvous::RendezvousServer::start(bind, &token, Vec::new())?;
    // Only ranks of this job may be marked as joined (not any number below 2^20).
    server.set_job_size(slot.size);
    Ok(Some(server))
}

/// How long to wait for the rendezvous: `HVD_RENDEZVOUS_WAIT` seconds (at most a day), else `default`.
fn wait(
    get: &dyn Fn(&str) -> Option<String>,
    default: f64,
) -> Result<std::time::Duration, ServeError> {
    match get(WAIT_VAR) {
        None => Ok(std::time::Duration::from_secs_f64(default)),
        Some(v) => {
            let day = hvd_collective::time::DAY_SECONDS as f64;
            hvd_collective::time::parse_seconds_in(&v, 0.0, day).ok_or(ServeError::BadWait(v))
        }
    }
}

/// The first address `address` (`host:port`, rank 0's own name) resolves to that is an address of this machine
/// (a socket can be bound to it), retrying for `wait`.
fn own_address(address: &str, wait: std::time::Duration) -> Result<std::net::IpAddr, ServeError> {
    use std::net::ToSocketAddrs as _;
    let start = std::time::Instant::now();
    let mut pause = std::time::Duration::from_millis(50);
    loop {
        let detail = match address.to_socket_addrs() {
            Err(e) => e.to_string(),
            Ok(addrs) => {
                let mut detail = "the name has no address".to_owned();
                for a in addrs {
                    if a.ip().is_unspecified() {
                        detail = format!("it resolves to the unspecified address {}", a.ip());
                        continue;
                    }
                    match std::net::TcpListener::bind((a.ip(), 0)) {
                        Ok(_) => return Ok(a.ip()),
                        Err(e) => detail = format!("{}: {e}", a.ip()),
                    }
                }
                detail
            }
        };
        if start.elapsed() >= wait {
            return Err(ServeError::NoBindAddress {
                address: address.to_owned(),
                detail,
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(std::time::Duration::from_secs(2));
    }
}

/// `HVD_RENDEZVOUS` as an address the worker can use: a `host:port` whose host is a name (a pod's DNS name), or any
/// address rank 0 serves (`HVD_RENDEZVOUS_SERVE=1`), is resolved, retrying until it resolves and accepts a
/// connection or `HVD_RENDEZVOUS_WAIT` runs out. `None` when unset or a `file:` rendezvous.
pub fn resolve_rendezvous(
    get: &dyn Fn(&str) -> Option<String>,
) -> Result<Option<String>, ServeError> {
    use std::net::{TcpStream, ToSocketAddrs};
    use std::time::{Duration, Instant};
    let Some(address) = get("HVD_RENDEZVOUS") else {
        return Ok(None);
    };
    let served_by_rank_zero = get(SERVE_VAR).as_deref() == Some("1");
    // An address served by a launcher is up before any worker starts; one rank 0 serves may not be yet, whether
    // named or not.
    if address.starts_with("file:")
        || (address.parse::<std::net::SocketAddr>().is_ok() && !served_by_rank_zero)
    {
        return Ok(Some(address));
    }
    let default = if served_by_rank_zero { 300.0 } else { 0.0 };
    let wait = wait(get, default)?;
    let start = Instant::now();
    let mut pause = Duration::from_millis(50);
    loop {
        let attempt = match address.to_socket_addrs() {
            Err(e) => Err(("resolve", e.to_string())),
            Ok(addrs) => {
                let addrs: Vec<_> = addrs.collect();
                let mut last = ("resolve", "the name has no address".to_owned());
                let mut found = None;
                for a in addrs {
                    match TcpStream::connect_timeout(&a, Duration::from_secs(5)) {
                        Ok(_) => {
                            found = Some(a);
                            break;
                        }
                        Err(e) => last = ("accept connections", e.to_string()),
                    }
                }
                found.ok_or(last)
            }
        };
        match attempt {
            Ok(addr) => return Ok(Some(addr.to_string())),
            Err((what, detail)) if start.elapsed() >= wait => {
                return Err(ServeError::Unreachable {
                    address,
                    what,
                    waited: start.elapsed(),
                    detail,
                });
            }
            Err(_) => {
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_secs(2));
            }
        }
    }
}

static FORWARD_TO: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(0);

extern "C" fn forward_signal(signal: libc::c_int) {
    let pid = FORWARD_TO.load(std::sync::atomic::Ordering::SeqCst);
    if pid > 0 {
        // SAFETY: kill(2) is async-signal-safe and has no memory-safety preconditions.
        unsafe {
            libc::kill(pid, signal);
        }
    }
}

/// Starts `command` as a child, passing SIGTERM, SIGINT and SIGHUP on to it (the shim stays alive while it serves
/// the rendezvous or reassembles lines; as a container's PID 1 it must hand the pod's SIGTERM to the worker).
pub fn spawn_forwarding_signals(
    command: &mut std::process::Command,
) -> std::io::Result<std::process::Child> {
    use std::os::unix::process::CommandExt as _;
    // SAFETY: prctl is async-signal-safe and touches no memory of the parent; the closure allocates nothing.
    unsafe {
        // The worker must not outlive a shim killed with SIGKILL (mpirun's last resort), which it cannot forward.
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = command.spawn()?;
    FORWARD_TO.store(
        i32::try_from(child.id()).unwrap_or(0),
        std::sync::atomic::Ordering::SeqCst,
    );
    for signal in [libc::SIGTERM, libc::SIGINT, libc::SIGHUP] {
        // SAFETY: the handler only loads an atomic and calls kill(2), both async-signal-safe.
        unsafe {
            libc::signal(signal, forward_signal as *const () as libc::sighandler_t);
        }
    }
    Ok(child)
}

/// Copies `from` to this process's file descriptor `fd` (1 or 2) one whole line per `write(2)`, so that mpirun,
/// which tags what it reads from a rank, never sees half a line: a program that writes a line's text and its newline
/// separately (Python's `print` with `PYTHONUNBUFFERED=1`) would otherwise get its newline tagged as a line of its own.
pub fn copy_whole_lines(from: impl std::io::Read, fd: std::os::fd::RawFd) -> std::io::Result<()> {
    use std::io::{BufRead as _, Write as _};
    // SAFETY: the standard descriptors stay open for the life of the process; the clone is our own.
    let mut out = std::fs::File::from(
        unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) }.try_clone_to_owned()?,
    );
    let mut reader = std::io::BufReader::with_capacity(64 << 10, from);
    let mut line = Vec::new();
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line)? == 0 {
            return Ok(());
        }
        out.write_all(&line)?;
    }
}

/// Ends this process with SIGKILL/// Ends this process with SIGKILL (`hvd worker-env --kill-on-failure`: MPICH's mpiexec ends the job when a rank
/// dies of a signal, not when it exits with a code).
pub fn die_by_signal() {
    // SAFETY: kill(2) on our own pid with a valid signal number has no memory-safety preconditions.
    unsafe {
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let map: BTreeMap<String, String> = pairs
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        move |name| map.get(name).cloned()
    }

    fn last<'a>(vars: &'a [(String, String)], name: &str) -> Option<&'a str> {
        vars.iter()
            .rev()
            .find(|(k, _)| k == name)
            .map(|(_, v)| v.as_str())
    }

    #[test]
    fn openmpi_ranks_map_to_the_contract() {
        let get = env(&[
            ("OMPI_COMM_WORLD_RANK", "3"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            ("HVD_RENDEZVOUS", "127.0.0.1:7000"),
            ("HVD_JOB_TOKEN", "abc"),
            (GPUS_VAR, "1"),
        ]);
        let vars = shim_env(&get).unwrap();
        assert_eq!(last(&vars, "HVD_RANK"), Some("3"));
        assert_eq!(last(&vars, "HVD_LOCAL_RANK"), Some("1"));
        assert_eq!(last(&vars, "HVD_CROSS_RANK"), Some("1"));
        assert_eq!(last(&vars, "HVD_CROSS_SIZE"), Some("2"));
        assert_eq!(last(&vars, "WORLD_SIZE"), Some("4"));
        assert_eq!(last(&vars, "HOROVOD_GLOO_RENDEZVOUS_PORT"), Some("7000"));
        assert_eq!(last(&vars, "CUDA_VISIBLE_DEVICES"), Some("1"));
    }

    /// Under srun with the launcher's rendezvous on a network address, `MASTER_ADDR` is the step's first node (rank
    /// 0's) and no `lo` interface is named; on loopback (every rank on this machine) it stays the rendezvous's.
    #[test]
    fn slurm_ranks_meet_torch_at_the_steps_first_node() {
        let base = [
            ("SLURM_PROCID", "2"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NNODES", "2"),
            ("SLURM_STEP_NODELIST", "gpu[07-08]"),
            ("HVD_JOB_TOKEN", "abc"),
        ];
        let with = |rendezvous: &'static str| {
            let mut vars = base.to_vec();
            vars.push(("HVD_RENDEZVOUS", rendezvous));
            shim_env(&env(&vars)).unwrap()
        };
        let vars = with("10.0.0.9:7000");
        assert_eq!(last(&vars, "MASTER_ADDR"), Some("gpu07"));
        assert_eq!(
            last(&vars, "HOROVOD_GLOO_RENDEZVOUS_ADDR"),
            Some("10.0.0.9")
        );
        assert_eq!(last(&vars, "NCCL_SOCKET_IFNAME"), None);
        assert_eq!(last(&vars, "HOROVOD_GLOO_IFACE"), None);
        let vars = with("127.0.0.1:7000");
        assert_eq!(last(&vars, "MASTER_ADDR"), Some("127.0.0.1"));
        assert_eq!(last(&vars, "NCCL_SOCKET_IFNAME"), Some("lo"));
    }

    /// A step node list that is not one is an error naming it (escaped), never a silent fallback to the launcher's
    /// address; without one, or under `--distribution=arbitrary` (rank 0 may be on any node), `MASTER_ADDR` stays the
    /// rendezvous's address.
    #[test]
    fn a_bad_step_node_list_is_an_error_and_arbitrary_placement_claims_no_node() {
        let base = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NNODES", "2"),
            ("HVD_JOB_TOKEN", "abc"),
            ("HVD_RENDEZVOUS", "10.0.0.9:7000"),
        ];
        let with = |more: &[(&'static str, &'static str)]| {
            let mut vars = base.to_vec();
            vars.extend_from_slice(more);
            shim_env(&env(&vars))
        };
        for bad in ["n[1-3", "n[", "n[abc]", "gpu[]", "n1\u{1b}[2J"] {
            let err = with(&[("SLURM_STEP_NODELIST", bad)])
                .unwrap_err()
                .to_string();
            assert!(
                err.contains(&format!(
                    "`SLURM_STEP_NODELIST` is `{}`",
                    bad.escape_default()
                )),
                "{err}"
            );
        }
        // A huge bad list is shown cut to its first 200 characters.
        let huge: &'static str = format!("{}]", "n1,".repeat(30_000)).leak();
        let err = with(&[("SLURM_STEP_NODELIST", huge)])
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("`SLURM_STEP_NODELIST` is `{}...`", &huge[..200]))
                && err.len() < 1000,
            "{err}"
        );
        let vars = with(&[]).unwrap();
        assert_eq!(last(&vars, "MASTER_ADDR"), Some("10.0.0.9"));
        for distribution in ["arbitrary", "arbitrary,pack"] {
            let vars = with(&[
                ("SLURM_STEP_NODELIST", "gpu[07-08]"),
                ("SLURM_DISTRIBUTION", distribution),
            ])
            .unwrap();
            assert_eq!(
                last(&vars, "MASTER_ADDR"),
                Some("10.0.0.9"),
                "{distribution}"
            );
        }
        let vars = with(&[
            ("SLURM_STEP_NODELIST", "gpu[07-08]"),
            ("SLURM_DISTRIBUTION", "cyclic"),
        ])
        .unwrap();
        assert_eq!(last(&vars, "MASTER_ADDR"), Some("gpu07"));
    }

    #[test]
    fn mpich_slurm_and_kubernetes_are_read() {
        let (slot, source) = slot_from_env(&env(&[
            ("PMI_RANK", "1"),
            ("PMI_SIZE", "2"),
            ("MPI_LOCALNRANKS", "2"),
        ]))
        .unwrap();
        assert_eq!(
            (source, slot.rank, slot.size, slot.local_size),
            (RankSource::Pmi, 1, 2, 2)
        );
        let (slot, source) = slot_from_env(&env(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "2"),
            ("SLURM_NNODES", "4"),
        ]))
        .unwrap();
        assert_eq!(source, RankSource::Slurm);
        assert_eq!(
            (
                slot.local_rank,
                slot.local_size,
                slot.cross_rank,
                slot.cross_size
            ),
            (1, 2, 2, 4)
        );
        let vars = shim_env(&env(&[("JOB_COMPLETION_INDEX", "2"), ("HVD_SIZE", "3")])).unwrap();
        assert_eq!(last(&vars, "HVD_RANK"), Some("2"));
        assert_eq!(last(&vars, "RANK"), Some("2"));
        assert_eq!(last(&vars, "HOROVOD_SIZE"), Some("3"));
    }

    #[test]
    fn spark_tasks_win_over_the_inherited_contract() {
        let vars = shim_env(&env(&[
            ("HVD_SPARK_RANK", "1"),
            ("HVD_SPARK_SIZE", "4"),
            ("HVD_SPARK_LOCAL_RANK", "1"),
            ("HVD_SPARK_LOCAL_SIZE", "2"),
            ("HVD_SPARK_CROSS_RANK", "0"),
            ("HVD_SPARK_CROSS_SIZE", "2"),
            ("HVD_SPARK_HOST", "10.0.0.5"),
            ("HVD_RANK", "0"),
            ("HVD_SIZE", "4"),
            ("HVD_HOSTNAME", "driver"),
            ("HVD_RENDEZVOUS", "127.0.0.1:7000"),
            ("HVD_JOB_TOKEN", "abc"),
        ]))
        .unwrap();
        assert_eq!(last(&vars, "HVD_RANK"), Some("1"));
        assert_eq!(last(&vars, "LOCAL_RANK"), Some("1"));
        assert_eq!(last(&vars, "HVD_CROSS_SIZE"), Some("2"));
        assert_eq!(last(&vars, "HVD_HOSTNAME"), Some("10.0.0.5"));
        assert_eq!(last(&vars, "HVD_RENDEZVOUS"), Some("127.0.0.1:7000"));
    }

    /// A free port on `ip`.
    fn free_port(ip: &str) -> u16 {
        std::net::TcpListener::bind((ip, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port()
    }

    #[test]
    fn rank_zero_serves_the_rendezvous_on_the_pod_ip_only() {
        let rank0 = |vars: &[(&str, &str)]| {
            let (slot, _) = slot_from_env(&env(vars)).unwrap();
            serve_if_rank_zero(&env(vars), &slot)
        };
        // The pod IP is 127.0.0.2 (a loopback address, so no other interface is needed): the server listens there and
        // nowhere else, so 127.0.0.1 (the "other network") is refused.
        let port = free_port("127.0.0.2");
        let rendezvous = format!("127.0.0.2:{port}");
        let base = [
            ("JOB_COMPLETION_INDEX", "0"),
            ("HVD_SIZE", "2"),
            ("HVD_RENDEZVOUS", rendezvous.as_str()),
            (SERVE_VAR, "1"),
            ("HVD_JOB_TOKEN", "t0k3n"),
        ];
        let mut vars = base.to_vec();
        vars.push((POD_IP_VAR, "127.0.0.2"));
        let server = rank0(&vars).unwrap().expect("rank 0 serves");
        assert_eq!(server.addr(), format!("127.0.0.2:{port}").parse().unwrap());
        assert!(std::net::TcpStream::connect(("127.0.0.2", port)).is_ok());
        // The server knows the job's size (HVD_SIZE = 2): rank 1 may join, rank 2 is no rank of this job.
        let join = |rank: u32| {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(("127.0.0.2", port)).unwrap();
            let head = format!(
                "GET /kv/hvd/k HTTP/1.1\r\nAuthorization: Bearer t0k3n\r\nX-Hvd-Rank: {rank}\r\n\
                 Content-Length: 0\r\n\r\n"
            );
            s.write_all(head.as_bytes()).unwrap();
            let mut answer = String::new();
            s.read_to_string(&mut answer).unwrap();
            answer
        };
        assert!(join(1).starts_with("HTTP/1.1 404"), "rank 1 joins");
        let answer = join(2);
        assert!(
            answer.starts_with("HTTP/1.1 400") && answer.contains("ranks are 0..2"),
            "{answer}"
        );
        assert_eq!(
            server.joined_ranks().into_iter().collect::<Vec<_>>(),
            vec![1]
        );
        let other = std::net::TcpStream::connect(("127.0.0.1", port));
        assert!(other.is_err(), "the rendezvous answered on 127.0.0.1");
        drop(server);
        // Rank 1 serves nothing.
        let mut vars1 = vars.clone();
        vars1[0] = ("JOB_COMPLETION_INDEX", "1");
        assert!(rank0(&vars1).unwrap().is_none());
        // The unspecified address, or no address, is refused, naming the variable.
        for bad in ["0.0.0.0", "::", "pod-ip", ""] {
            let mut vars = base.to_vec();
            vars.push((POD_IP_VAR, bad));
            let Err(err) = rank0(&vars) else {
                panic!("{bad}: served")
            };
            let err = err.to_string();
            assert!(err.contains("`HVD_POD_IP` is"), "{bad}: {err}");
        }
        // Without the pod IP: the address rank 0's own name resolves to (here `localhost`), loopback only.
        let port = free_port("127.0.0.1");
        let rendezvous = format!("localhost:{port}");
        let mut vars = base.to_vec();
        vars[2] = ("HVD_RENDEZVOUS", rendezvous.as_str());
        let server = rank0(&vars).unwrap().expect("rank 0 serves");
        assert!(server.addr().ip().is_loopback(), "{}", server.addr());
        drop(server);
        // A name that is not this machine's: a clear error after HVD_RENDEZVOUS_WAIT, never all addresses.
        let mut vars = base.to_vec();
        vars[2] = ("HVD_RENDEZVOUS", "192.0.2.1:29400");
        vars.push((WAIT_VAR, "0"));
        let Err(err) = rank0(&vars) else {
            panic!("served on an address that is not this machine's")
        };
        let err = err.to_string();
        assert!(
            err.contains("no address to serve the rendezvous on") && err.contains("192.0.2.1"),
            "{err}"
        );
    }

    /// The launch-environment fixtures of `hvd-collective` (the bootstrap's reader runs the same table): through the
    /// shim's public path, each gives the worker contract's six numbers, or the error.
    #[test]
    fn shared_launch_fixtures_through_the_shim() {
        use hvd_collective::launch_env::fixtures;
        let cases = fixtures::parse(include_str!(
            "../../../collective/tests/data/launch_env.txt"
        ));
        assert!(cases.len() >= 10);
        for case in &cases {
            let got = shim_env(&|k: &str| case.get(k));
            match (case.expect.strip_prefix("error "), got) {
                (Some(part), Err(e)) => {
                    assert!(e.to_string().contains(part), "{}: {e}", case.name)
                }
                (None, Ok(vars)) => {
                    let want: Vec<&str> = case.expect.split(' ').skip(1).collect();
                    let have: Vec<&str> = [
                        "HVD_RANK",
                        "HVD_SIZE",
                        "HVD_LOCAL_RANK",
                        "HVD_LOCAL_SIZE",
                        "HVD_CROSS_RANK",
                        "HVD_CROSS_SIZE",
                    ]
                    .iter()
                    .map(|n| last(&vars, n).unwrap_or("(unset)"))
                    .collect();
                    assert_eq!(have, want, "{}", case.name);
                }
                (_, got) => panic!("{}: expected `{}`, got {got:?}", case.name, case.expect),
            }
            if let Ok((_, source)) = slot_from_env(&|k: &str| case.get(k)) {
                assert!(case.expect.starts_with(source.key()), "{}", case.name);
            }
        }
    }

    #[test]
    fn bad_values_are_clear_errors() {
        assert!(matches!(
            slot_from_env(&env(&[])),
            Err(ShimError::Rank(LaunchEnvError::NoRank))
        ));
        let err = slot_from_env(&env(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")])).unwrap_err();
        assert!(err.to_string().contains("`PMI_RANK` is `x`"), "{err}");
        let err = slot_from_env(&env(&[("PMI_RANK", "2"), ("PMI_SIZE", "2")])).unwrap_err();
        assert!(
            matches!(err, ShimError::Rank(LaunchEnvError::RankOutOfRange { .. })),
            "{err}"
        );
    }

    /// `HVD_RENDEZVOUS_WAIT` past a day (`1e19` was taken: a wait of 300 billion years), negative, infinite or not a
    /// number is refused by name; a day and a fraction are taken.
    #[test]
    fn the_rendezvous_wait_is_a_bounded_number_of_seconds() {
        for bad in ["1e19", "1e20", "86401", "-1", "NaN", "inf", "soon"] {
            let err = wait(&env(&[(WAIT_VAR, bad)]), 300.0).unwrap_err();
            assert!(
                err.to_string().contains(&format!(
                    "`HVD_RENDEZVOUS_WAIT` is `{bad}`, not a number of seconds from 0 to 86400"
                )),
                "{err}"
            );
        }
        let wait_of = |v: &str| wait(&env(&[(WAIT_VAR, v)]), 300.0).unwrap();
        assert_eq!(wait_of("86400"), std::time::Duration::from_secs(86_400));
        assert_eq!(wait_of(" 0.5 "), std::time::Duration::from_millis(500));
        assert_eq!(
            wait(&env(&[]), 300.0).unwrap(),
            std::time::Duration::from_secs(300)
        );
    }
}
