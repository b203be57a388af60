//! Adapter from `hvd-collective`'s communicators to the engine's [`Transport`], and joining the job from the
//! environment.

use hvd_collective::{Communicator, DType};

use std::io::{Read, Write};
use std::net::{IpAddr, SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use hvd_collective::p2p::P2pCommunicator;
use hvd_collective::tcp::{TcpTransport, listen};

use crate::transport::{LocalTransport, Topology, Transport, TransportError, TransportResult};
use crate::types::{DataType, Reduction};

/// The engine's view of a `hvd-collective` communicator. Counts the engine gives in bytes travel as `u8` elements.
pub struct CollectiveTransport {
    comm: Box<dyn Communicator>,
    name: String,
}

impl CollectiveTransport {
    pub fn new(comm: Box<dyn Communicator>) -> CollectiveTransport {
        let name = comm.backend().to_uppercase();
        CollectiveTransport { comm, name }
    }
}

fn dtype(d: DataType) -> DType {
    match d {
        DataType::U8 => DType::U8,
        DataType::I8 => DType::I8,
        DataType::I32 => DType::I32,
        DataType::I64 => DType::I64,
        DataType::F16 => DType::F16,
        DataType::F32 => DType::F32,
        DataType::F64 => DType::F64,
        DataType::Bf16 => DType::BF16,
    }
}

fn op(r: Reduction) -> hvd_collective::ReduceOp {
    match r {
        Reduction::Sum => hvd_collective::ReduceOp::Sum,
        Reduction::Min => hvd_collective::ReduceOp::Min,
        Reduction::Max => hvd_collective::ReduceOp::Max,
        Reduction::Product => hvd_collective::ReduceOp::Product,
    }
}

fn err(e: hvd_collective::Error) -> TransportError {
    TransportError(e.to_string())
}

impl Transport for CollectiveTransport {
    fn name(&self) -> &str {
        &self.name
    }

    fn topology(&self) -> Topology {
        let t = self.comm.topology();
        Topology {
            rank: t.rank,
            size: t.size,
            local_rank: t.local_rank,
            local_size: t.local_size,
            cross_rank: t.cross_rank,
            cross_size: t.cross_size,
        }
    }

    fn allreduce(
        &mut self,
        buf: &mut [u8],
        d: DataType,
        reduction: Reduction,
    ) -> TransportResult<()> {
        self.comm
            .allreduce_in_place(buf, dtype(d), op(reduction))
            .map_err(err)
    }

    fn allgatherv(
        &mut self,
        send: &[u8],
        recv_counts: &[usize],
        recv: &mut [u8],
    ) -> TransportResult<()> {
        self.comm
            .allgatherv(send, recv, recv_counts, DType::U8)
            .map_err(err)
    }

    fn broadcast(&mut self, buf: &mut [u8], root: usize) -> TransportResult<()> {
        self.comm.broadcast(buf, DType::U8, root).map_err(err)
    }

    fn alltoallv(
        &mut self,
        send: &[u8],
        send_counts: &[usize],
        recv: &mut [u8],
        recv_counts: &[usize],
    ) -> TransportResult<()> {
        self.comm
            .alltoallv(send, send_counts, recv, recv_counts, DType::U8)
            .map_err(err)
    }

    fn barrier(&mut self) -> TransportResult<()> {
        self.comm.barrier().map_err(err)
    }

    fn reducescatter(
        &mut self,
        buf: &mut [u8],
        block_elems: &[usize],
        out: &mut [u8],
        d: DataType,
        reduction: Reduction,
    ) -> TransportResult<()> {
        self.comm
            .reducescatter(buf, out, block_elems, dtype(d), op(reduction))
            .map_err(err)
    }
}

/// Variables that mean "this process is one rank of a larger job".
const JOB_VARIABLES: [&str; 4] = [
    "HVD_SIZE",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_SIZE",
    "SLURM_NTASKS",
];

/// Joins the job described by the environment; a process started without any job variables (or with size 1) is a
/// job of one rank.
pub fn connect_from_env() -> Result<Box<dyn Transport>, String> {
    let size = JOB_VARIABLES
        .iter()
        .find_map(|v| std::env::var(v).ok().filter(|s| !s.is_empty()));
    match size.as_deref().map(str::trim) {
        None | Some("1") => {
            let t = LocalTransport::group(1, Duration::from_secs(1)).pop().ok_or("no transport")?;
            Ok(Box::new(t))
        }
        Some(_) if std::env::var("HVD_RENDEZVOUS").is_ok() => {
            let comm = rendezvous_tcp().map_err(|e| format!("failed to join the job: {e}"))?;
            Ok(Box::new(CollectiveTransport::new(comm)))
        }
        Some(_) => Err("this process is one rank of a multi-rank job, but `HVD_RENDEZVOUS` is not set; start it \
             with `hvd run` (MPI and Slurm bootstraps come with `hvd-collective`'s bootstrap)"
            .into()),
    }
}

fn env_var(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("`{name}` is not set (it is set by `hvd run`)"))
}

fn env_number(name: &str) -> Result<usize, String> {
    let v = env_var(name)?;
    v.trim()
        .parse()
        .map_err(|_| format!("`{name}`=`{v}` is not a number"))
}

/// Connects a TCP full mesh through the launcher's rendezvous server (the contract in docs/rendezvous.md): each
/// rank PUTs `ip:port hostname` at `/kv/hvd/addr.<rank>` and long-polls the others'.
///
/// This is the runtime's own bootstrap until `hvd-collective` ships one; it only uses that crate's public TCP
/// transport and point-to-point communicator.
fn rendezvous_tcp() -> Result<Box<dyn hvd_collective::Communicator>, String> {
    let rank = env_number("HVD_RANK")?;
    let size = env_number("HVD_SIZE")?;
    if rank >= size {
        return Err(format!("`HVD_RANK`={rank} is not below `HVD_SIZE`={size}"));
    }
    let server = env_var("HVD_RENDEZVOUS")?;
    let token = env_var("HVD_JOB_TOKEN")?;
    let host = std::env::var("HVD_HOSTNAME").unwrap_or_else(|_| "localhost".into());
    let timeout =
        match std::env::var("HVD_COLLECTIVE_TIMEOUT") {
            Ok(v) => Duration::from_secs_f64(v.trim().parse::<f64>().map_err(|_| {
                format!("`HVD_COLLECTIVE_TIMEOUT`=`{v}` is not a number of seconds")
            })?),
            Err(_) => Duration::from_secs(30),
        };
    let client = Kv {
        server: server.clone(),
        token,
        rank,
    };
    // Listen on the address this host uses to reach the rendezvous server: it is reachable by the other ranks.
    let probe = TcpStream::connect(&server)
        .map_err(|e| format!("cannot reach the rendezvous server `{server}`: {e}"))?;
    let ip: IpAddr = probe.local_addr().map_err(|e| e.to_string())?.ip();
    drop(probe);
    let listener = listen(ip).map_err(|e| e.to_string())?;
    let me = listener.local_addr().map_err(|e| e.to_string())?;
    client.put(&format!("addr.{rank}"), format!("{me} {host}").as_bytes())?;
    let deadline = Instant::now() + timeout.max(Duration::from_secs(60));
    let mut addrs = Vec::with_capacity(size);
    let mut hostnames = Vec::with_capacity(size);
    for r in 0..size {
        let value = client.get_wait(&format!("addr.{r}"), deadline)?;
        let text =
            String::from_utf8(value).map_err(|_| format!("rank {r}'s address is not text"))?;
        let (addr, host) = text.split_once(' ').unwrap_or((text.as_str(), ""));
        addrs.push(
            addr.parse::<SocketAddr>()
                .map_err(|_| format!("rank {r} published a bad address `{addr}`"))?,
        );
        hostnames.push(host.to_string());
    }
    let mut distinct: Vec<&String> = Vec::new();
    let hosts: Vec<usize> = hostnames
        .iter()
        .map(|h| match distinct.iter().position(|d| *d == h) {
            Some(i) => i,
            None => {
                distinct.push(h);
                distinct.len() - 1
            }
        })
        .collect();
    let transport =
        TcpTransport::connect(rank, &listener, &addrs, timeout).map_err(|e| e.to_string())?;
    Ok(Box::new(P2pCommunicator::new(
        transport, "tcp", hosts, timeout,
    )))
}

/// The few requests of the rendezvous protocol the bootstrap needs (HTTP/1.1, one request per connection).
struct Kv {
    server: String,
    token: String,
    rank: usize,
}

impl Kv {
    fn request(&self, method: &str, path: &str, body: &[u8]) -> Result<(u16, Vec<u8>), String> {
        let fail = |e: std::io::Error| {
            format!(
                "rendezvous request {method} {path} to `{}` failed: {e}",
                self.server
            )
        };
        let mut s = TcpStream::connect(&self.server).map_err(fail)?;
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nAuthorization: Bearer {}\r\nX-Hvd-Rank: {}\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            self.server,
            self.token,
            self.rank,
            body.len()
        );
        s.write_all(head.as_bytes()).map_err(fail)?;
        s.write_all(body).map_err(fail)?;
        let mut response = Vec::new();
        s.read_to_end(&mut response).map_err(fail)?;
        let split = response
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .ok_or_else(|| {
                format!(
                    "malformed response from the rendezvous server `{}`",
                    self.server
                )
            })?;
        let status = std::str::from_utf8(&response[..split])
            .ok()
            .and_then(|h| h.split_whitespace().nth(1))
            .and_then(|c| c.parse().ok())
            .ok_or_else(|| {
                format!(
                    "malformed status line from the rendezvous server `{}`",
                    self.server
                )
            })?;
        Ok((status, response[split + 4..].to_vec()))
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
        match self.request("PUT", &format!("/kv/hvd/{key}"), value)? {
            (200, _) => Ok(()),
            (403, body) => Err(format!(
                "the rendezvous server refused the job token: {}",
                String::from_utf8_lossy(&body).trim()
            )),
            (code, body) => Err(format!(
                "rendezvous PUT {key} failed with {code}: {}",
                String::from_utf8_lossy(&body)
            )),
        }
    }

    fn get_wait(&self, key: &str, deadline: Instant) -> Result<Vec<u8>, String> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!(
                    "timed out waiting for `{key}` at the rendezvous server (did every rank start?)"
                ));
            }
            let wait_ms = left.as_millis().min(5_000);
            match self.request("GET", &format!("/kv/hvd/{key}?wait_ms={wait_ms}"), &[])? {
                (200, body) => return Ok(body),
                (404, _) => continue,
                (code, body) => {
                    return Err(format!(
                        "rendezvous GET {key} failed with {code}: {}",
                        String::from_utf8_lossy(&body)
                    ));
                }
            }
        }
    }
}
