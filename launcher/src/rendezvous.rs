//! The rendezvous key-value server the launcher hosts for every job (protocol: docs/rendezvous.md).
//!
//! Plain HTTP/1.1 over std threads: one accept thread, one short-lived thread per connection, one request per
//! connection (`Connection: close`). Two families of endpoints share the store:
//!
//! - `/kv/<scope>/<key>` (hvd's own clients): needs `Authorization: Bearer <job token>`; `GET` may long-poll with
//!   `?wait_ms=N`; an authenticated request's `X-Hvd-Rank` marks that rank as joined (a rank of the job, once).
//! - `/<scope>/<key>` (Horovod's gloo `HTTPStore`): no token (the client cannot send one), so it is only answered for
//!   peers on the job's hosts, and from an address of this machine only for connections that a process of the job's
//!   own user holds, as found when the connection was accepted.
//!
//! The server must survive any peer, authorized or not:
//! - a connection that has not yet proven itself (its request head is still arriving) holds a slot that newer
//!   connections may take: when a peer address or the whole server is at its connection limit, the oldest
//!   unproven connection is closed to make room, so idle or trickling sockets cannot lock the ranks out;
//! - the head must arrive within a short deadline and the body within another; an unauthorized request is answered
//!   and closed at once, without reading its body;
//! - memory for a body grows with the bytes received, charged to a server-wide budget, never from `Content-Length`;
//! - malformed input gets a 4xx; a panic in a connection's handler closes that connection and nothing else.
//!
//! A third family, `/elastic/v1/` (token-checked like `/kv/`), runs an elastic step's membership ([`elastic`]):
//! `POST join` hands out the rounds, `POST leave` takes a preempted worker out (only from the process that joined as
//! that slot: its `X-Hvd-Join`), `GET round` tells members whether new workers wait to join, `POST beat` is a
//! worker's heartbeat ([`beat`]: a worker silent past the heartbeat timeout is frozen, and lost).
//!
//! The wire format lives in [`http`], the stored state in [`store`], the socket-owner lookup in [`peer`].

mod beat;
mod elastic;
mod http;
mod peer;
mod store;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{self, Read};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use self::http::{BodyBudget, HttpError, Request};
use self::peer::{PeerEnd, canonical};
use self::store::Store;

pub use self::elastic::Silence;

/// Largest request head (request line + headers + the blank line) accepted.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Largest value accepted in one PUT.
pub const MAX_VALUE_BYTES: usize = 64 * 1024 * 1024;
/// Largest total of everything stored (values, keys and scopes); a PUT past it gets 507.
pub const MAX_STORE_BYTES: usize = 1024 * 1024 * 1024;
/// Longest long-poll a client may ask for with `wait_ms`.
pub const MAX_WAIT: Duration = Duration::from_secs(600);
/// Connections served at once.
pub const MAX_CONNECTIONS: usize = 4096;
/// Connections served at once from one peer address.
pub const MAX_CONNECTIONS_PER_PEER: usize = 1024;
/// Bytes of request bodies held at once, over all connections; past it a body gets 503.
pub const MAX_INFLIGHT_BODY_BYTES: usize = 512 * 1024 * 1024;
/// How long a peer has to send its whole request head.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(10);
/// How long an authorized peer has to send its whole body.
pub const BODY_DEADLINE: Duration = Duration::from_secs(60);
/// Ranks accepted in `X-Hvd-Rank` while the job's size is not known.
pub const MAX_RANKS: u32 = 1 << 20;
/// Longest deadline [`Limits`] may set.
const MAX_DEADLINE: Duration = Duration::from_secs(3600);
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// Stack of a connection thread: the handler keeps its buffers on the heap.
const CONNECTION_STACK: usize = 256 * 1024;

/// The server's limits and deadlines. [`Limits::default`] is what jobs get; tests shrink them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Limits {
    pub max_head_bytes: usize,
    pub max_value_bytes: usize,
    pub max_store_bytes: usize,
    pub max_connections: usize,
    pub max_connections_per_peer: usize,
    pub max_inflight_body_bytes: usize,
    pub head_deadline: Duration,
    pub body_deadline: Duration,
    pub max_ranks: u32,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_head_bytes: MAX_HEAD_BYTES,
            max_value_bytes: MAX_VALUE_BYTES,
            max_store_bytes: MAX_STORE_BYTES,
            max_connections: MAX_CONNECTIONS,
            max_connections_per_peer: MAX_CONNECTIONS_PER_PEER,
            max_inflight_body_bytes: MAX_INFLIGHT_BODY_BYTES,
            head_deadline: HEAD_DEADLINE,
            body_deadline: BODY_DEADLINE,
            max_ranks: MAX_RANKS,
        }
    }
}

/// A snapshot of the server's own accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stats {
    /// Connections being served now.
    pub connections: usize,
    /// Unproven connections closed to make room for newer ones.
    pub evicted: u64,
    /// Connections refused with 503 because every slot was held by authorized requests.
    pub refused: u64,
    /// Request body bytes held in memory now, and the most ever held at once.
    pub body_bytes_reserved: usize,
    pub peak_body_bytes_reserved: usize,
    /// Bytes charged to the store (values, keys and scopes).
    pub store_bytes: usize,
    /// Connection handlers that panicked (each closed its connection; the server kept serving).
    pub panics: u64,
}

/// Failure to start the server.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    #[error("failed to bind the rendezvous server to `{addr}`")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: io::Error,
    },
    #[error("failed to start the rendezvous server's accept thread")]
    Spawn(#[source] io::Error),
    #[error("job token must be non-empty printable ASCII without spaces")]
    BadToken,
    #[error("rendezvous limits must all be positive, and deadlines at most an hour: {0:?}")]
    BadLimits(Box<Limits>),
}

/// A running rendezvous server. Dropping it shuts it down (as does [`RendezvousServer::shutdown`]).
pub struct RendezvousServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for RendezvousServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RendezvousServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

struct Shared {
    token: String,
    allowed_hosts: Vec<IpAddr>,
    /// The user the job runs as: gloo requests from this machine must come from its sockets.
    job_uid: u32,
    limits: Limits,
    store: Mutex<Store>,
    changed: Condvar,
    stopping: AtomicBool,
    connections: Mutex<Connections>,
    bodies: BodyBudget,
    gloo_requests: AtomicU64,
    evicted: AtomicU64,
    refused: AtomicU64,
    panics: AtomicU64,
}

/// The connections being served, oldest first, and how many each peer address holds.
#[derive(Default)]
struct Connections {
    next_id: u64,
    live: BTreeMap<u64, Connection>,
    per_peer: HashMap<IpAddr, usize>,
}

struct Connection {
    peer: IpAddr,
    /// A second handle on the socket, to close it from the accept thread.
    socket: TcpStream,
    /// Passed its authorization check (token, or gloo peer check): no longer evictable.
    authorized: bool,
}

impl Connections {
    /// Admits a connection from `peer`, closing the oldest unauthorized ones to make room when a limit is reached.
    /// Returns its id and how many were closed, or `None` when every slot in the way is authorized.
    fn admit(&mut self, peer: IpAddr, socket: TcpStream, limits: &Limits) -> Option<(u64, u64)> {
        let mut evicted = 0;
        if self.per_peer.get(&peer).copied().unwrap_or(0) >= limits.max_connections_per_peer {
            if !self.evict_oldest(|c| !c.authorized && c.peer == peer) {
                return None;
            }
            evicted += 1;
        }
        if self.live.len() >= limits.max_connections {
            if !self.evict_oldest(|c| !c.authorized) {
                return None;
            }
            evicted += 1;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.live.insert(
            id,
            Connection {
                peer,
                socket,
                authorized: false,
            },
        );
        *self.per_peer.entry(peer).or_insert(0) += 1;
        Some((id, evicted))
    }

    fn evict_oldest(&mut self, pick: impl Fn(&Connection) -> bool) -> bool {
        let Some(id) = self.live.iter().find(|(_, c)| pick(c)).map(|(id, _)| *id) else {
            return false;
        };
        if let Some(c) = self.remove(id) {
            // Wakes the connection's thread from its read; it then finds itself gone and ends.
            let _ = c.socket.shutdown(Shutdown::Both);
        }
        true
    }

    fn remove(&mut self, id: u64) -> Option<Connection> {
        let c = self.live.remove(&id)?;
        if let Some(n) = self.per_peer.get_mut(&c.peer) {
            *n -= 1;
            if *n == 0 {
                self.per_peer.remove(&c.peer);
            }
        }
        Some(c)
    }

    /// Marks a connection authorized; false when it was already closed to make room.
    fn authorize(&mut self, id: u64) -> bool {
        self.live
            .get_mut(&id)
            .map(|c| c.authorized = true)
            .is_some()
    }
}

impl RendezvousServer {
    /// Binds `bind` (use port 0 for a free port) and starts serving with the default [`Limits`]. `token` guards the
    /// `/kv/` endpoints; `allowed_hosts` are the addresses whose token-less (Horovod gloo) requests are answered
    /// (loopback peers count as allowed when `allowed_hosts` contains any loopback address). Token-less requests
    /// from this machine are answered only when the job's own user (this process's) owns the connection.
    pub fn start(
        bind: SocketAddr,
        token: &str,
        allowed_hosts: Vec<IpAddr>,
    ) -> Result<Self, RendezvousError> {
        Self::start_with_limits(bind, token, allowed_hosts, Limits::default())
    }

    /// [`RendezvousServer::start`] on a free port of 127.0.0.1 that answers token-less requests from this machine
    /// only: what a job whose ranks all run here needs (`hvd bench`, tests).
    pub fn start_on_loopback(token: &str) -> Result<Self, RendezvousError> {
        let loopback = std::net::Ipv4Addr::LOCALHOST;
        Self::start((loopback, 0).into(), token, vec![loopback.into()])
    }

    /// [`RendezvousServer::start`] with other limits and deadlines.
    pub fn start_with_limits(
        bind: SocketAddr,
        token: &str,
        allowed_hosts: Vec<IpAddr>,
        limits: Limits,
    ) -> Result<Self, RendezvousError> {
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(RendezvousError::BadToken);
        }
        let positive = [
            limits.max_head_bytes,
            limits.max_store_bytes,
            limits.max_connections,
            limits.max_connections_per_peer,
            limits.max_inflight_body_bytes,
            limits.max_ranks as usize,
        ];
        let deadlines = [limits.head_deadline, limits.body_deadline];
        if positive.contains(&0) || deadlines.iter().any(|d| d.is_zero() || *d > MAX_DEADLINE) {
            return Err(RendezvousError::BadLimits(Box::new(limits)));
        }
        let listener = TcpListener::bind(bind)
            .map_err(|source| RendezvousError::Bind { addr: bind, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| RendezvousError::Bind { addr: bind, source })?;
        let shared = Arc::new(Shared {
            token: token.to_owned(),
            allowed_hosts,
            // SAFETY: geteuid has no preconditions and cannot fail.
            job_uid: unsafe { libc::geteuid() },
            store: Mutex::new(Store::new(limits.max_store_bytes, limits.max_ranks)),
            bodies: BodyBudget::new(limits.max_inflight_body_bytes),
            limits,
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            connections: Mutex::new(Connections::default()),
            gloo_requests: AtomicU64::new(0),
            evicted: AtomicU64::new(0),
            refused: AtomicU64::new(0),
            panics: AtomicU64::new(0),
        });
        let accept_shared = Arc::clone(&shared);
        let accept = std::thread::Builder::new()
            .name("hvd-rendezvous".into())
            .spawn(move || accept_loop(&listener, &accept_shared))
            .map_err(RendezvousError::Spawn)?;
        tracing::debug!(%addr, "rendezvous server listening");
        Ok(RendezvousServer {
            addr,
            shared,
            accept: Some(accept),
        })
    }

    /// The address the server listens on (with the real port when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Ranks that have made at least one authenticated request (`X-Hvd-Rank`).
    pub fn joined_ranks(&self) -> BTreeSet<u32> {
        self.shared.lock().joined()
    }

    /// Number of token-less (Horovod gloo) requests answered so far.
    pub fn gloo_requests(&self) -> u64 {
        self.shared.gloo_requests.load(Ordering::Relaxed)
    }

    /// The server's own accounting: connections, evictions, body bytes held, store bytes.
    pub fn stats(&self) -> Stats {
        let connections = self.shared.connections().live.len();
        Stats {
            connections,
            evicted: self.shared.evicted.load(Ordering::SeqCst),
            refused: self.shared.refused.load(Ordering::SeqCst),
            body_bytes_reserved: self.shared.bodies.reserved(),
            peak_body_bytes_reserved: self.shared.bodies.peak(),
            store_bytes: self.shared.lock().bytes(),
            panics: self.shared.panics.load(Ordering::SeqCst),
        }
    }

    /// The value a peer stored at `/kv/<scope>/<key>`, when it is at most `max` bytes: `Some(Err(len))` for a longer
    /// one (not copied), `None` when there is none. What a peer stores is untrusted: the caller validates it.
    pub fn value(&self, scope: &str, key: &str, max: usize) -> Option<Result<Vec<u8>, usize>> {
        let store = self.shared.lock();
        let value = store.get(scope, key)?;
        Some(if value.len() <= max {
            Ok(value.clone())
        } else {
            Err(value.len())
        })
    }

    /// Declares the job's size: `X-Hvd-Rank` must then name a rank below it.
    pub fn set_job_size(&self, size: u32) {
        self.shared.lock().set_size(size);
    }

    /// Waits until `size` distinct ranks (0..size) have joined, or `timeout` passes. Returns the ranks joined.
    pub fn wait_joined(&self, size: u32, timeout: Duration) -> BTreeSet<u32> {
        let deadline = crate::options::saturating_add(Instant::now(), timeout);
        let mut store = self.shared.lock();
        loop {
            let joined = store.joined();
            if (0..size).all(|r| joined.contains(&r)) {
                return joined;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.shared.stopping.load(Ordering::SeqCst) {
                return joined;
            }
            store = match self.shared.changed.wait_timeout(store, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    /// Declares the job layout: its size (as [`RendezvousServer::set_job_size`]) and Horovod's gloo scopes, `global`
    /// with every rank, `local_<host>` with each host's rank count, `cross_<local rank>` with the number of hosts
    /// that have that local rank.
    pub fn set_gloo_layout(&self, hosts: &[(String, u32)]) {
        let mut sizes = BTreeMap::new();
        let size: u32 = hosts.iter().map(|(_, n)| n).sum();
        sizes.insert("global".to_owned(), size as usize);
        for (host, n) in hosts {
            *sizes.entry(format!("local_{host}")).or_insert(0) += *n as usize;
            for local in 0..*n {
                *sizes.entry(format!("cross_{local}")).or_insert(0) += 1;
            }
        }
        let mut store = self.shared.lock();
        store.set_size(size);
        store.set_gloo_layout(sizes);
    }

    /// Makes the job elastic: `workers` started workers (slots 0..workers) join rounds through `/elastic/v1/join`;
    /// a round waits `window` (from the first request) for the live workers that have not asked yet.
    pub fn set_elastic(&self, workers: u32, window: Duration) {
        let mut membership = elastic::Membership::new(workers, window);
        membership.set_loopback(self.addr.ip().is_loopback());
        self.shared.lock().elastic = Some(membership);
        self.shared.changed.notify_all();
    }

    /// An elastic job gets one more worker (started by the launcher, e.g. for a slot host discovery found): returns
    /// its slot, the next after every slot so far (a replacement for a lost worker may be past the step's size: the
    /// job's ranks then reach to it, as every slot so far is below it). It joins the round after the members' next
    /// re-form. `None`: the job is not elastic.
    pub fn add_elastic_worker(&self) -> Option<u32> {
        let mut store = self.shared.lock();
        let slot = store.elastic.as_mut()?.add_worker();
        store.set_size(slot + 1);
        self.shared.changed.notify_all();
        Some(slot)
    }

    /// An elastic job's rounds form with at least `min` members: below it the workers that asked wait for more (the
    /// launcher starts replacements, or stops the step). No-op when not elastic.
    pub fn set_elastic_minimum(&self, min: u32) {
        if let Some(membership) = self.shared.lock().elastic.as_mut() {
            membership.set_minimum(min);
        }
        self.shared.changed.notify_all();
    }

    /// Worker `slot` of an elastic job ended well: when it was a member of a round its training is over, and no
    /// worker that was never a member joins any more (it is answered 410). Returns whether the training is over;
    /// false when not elastic.
    pub fn finish_elastic(&self, slot: u32) -> bool {
        let mut store = self.shared.lock();
        let finished = store
            .elastic
            .as_mut()
            .is_some_and(|m| m.finish(slot, Instant::now()));
        self.shared.changed.notify_all();
        finished
    }

    /// Once an elastic job's training is over ([`RendezvousServer::finish_elastic`]): its live workers that were
    /// never members of a round, whether they asked to join or not (the launcher stops them). Empty before.
    pub fn elastic_never_members(&self) -> BTreeSet<u32> {
        let store = self.shared.lock();
        store
            .elastic
            .as_ref()
            .map(|m| m.never_members())
            .unwrap_or_default()
    }

    /// An elastic job's live workers (started, not ended, not left, not left out); 0 when not elastic.
    pub fn elastic_alive(&self) -> usize {
        let store = self.shared.lock();
        store.elastic.as_ref().map_or(0, |m| m.alive())
    }

    /// An elastic job's live workers that were members of a round (not the new ones still starting or waiting to
    /// join); 0 when not elastic.
    pub fn elastic_alive_members(&self) -> usize {
        let store = self.shared.lock();
        store.elastic.as_ref().map_or(0, |m| m.alive_members())
    }

    /// An elastic job's workers that left on their own (`/elastic/v1/leave`: preempted after their last commit), and
    /// how many workers were alive right after each left.
    pub fn elastic_left(&self) -> BTreeMap<u32, usize> {
        let store = self.shared.lock();
        store
            .elastic
            .as_ref()
            .map(|m| m.left().clone())
            .unwrap_or_default()
    }

    /// Worker `slot` of an elastic job ended: rounds no longer wait for it. Returns how many workers are alive.
    pub fn worker_gone(&self, slot: u32) -> usize {
        let mut store = self.shared.lock();
        let Some(membership) = store.elastic.as_mut() else {
            return 0;
        };
        membership.gone(slot, Instant::now());
        let alive = membership.alive();
        self.shared.changed.notify_all();
        alive
    }

    /// An elastic job's live workers that a round formed without (they did not ask in time): stop them.
    pub fn elastic_dropped(&self) -> BTreeSet<u32> {
        let store = self.shared.lock();
        store
            .elastic
            .as_ref()
            .map(|m| m.dropped().clone())
            .unwrap_or_default()
    }

    /// The launcher stops an elastic job (before it signals the workers): `GET /elastic/v1/round` says so, and a
    /// worker's SIGTERM handler ends it at once instead of handing over at its next commit. No-op when not elastic.
    pub fn stop_elastic(&self) {
        if let Some(membership) = self.shared.lock().elastic.as_mut() {
            membership.stop();
        }
    }

    /// After the launcher signalled the workers of an elastic job it stops ([`RendezvousServer::stop_elastic`]
    /// first): a worker waiting for a round is answered at once that none forms (410), so that it gets back to its
    /// signal handler instead of waiting out its join. After the signal, so that the handler runs first. No-op when
    /// not elastic.
    pub fn close_elastic_joins(&self) {
        if let Some(membership) = self.shared.lock().elastic.as_mut() {
            membership.close();
        }
        self.shared.changed.notify_all();
    }

    /// An elastic job's latest round and its size (0, 0 before the first, and when the job is not elastic).
    pub fn elastic_round(&self) -> (u64, u32) {
        let store = self.shared.lock();
        store.elastic.as_ref().map_or((0, 0), |m| m.latest())
    }

    /// Stops accepting, wakes every long-poll, and waits for the accept thread. Idempotent.
    pub fn shutdown(&mut self) {
        if self.shared.stopping.swap(true, Ordering::SeqCst) {
            return;
        }
        self.shared.changed.notify_all();
        // Wake the blocking accept with a connection of our own.
        let wake = match self.addr.ip() {
            ip if ip.is_unspecified() => {
                let local: IpAddr = if ip.is_ipv4() {
                    [127, 0, 0, 1].into()
                } else {
                    std::net::Ipv6Addr::LOCALHOST.into()
                };
                SocketAddr::new(local, self.addr.port())
            }
            _ => self.addr,
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
        if let Some(handle) = self.accept.take() {
            let _ = handle.join();
        }
        // Connections still reading a request head are of no use now.
        let mut connections = self.shared.connections();
        while connections.evict_oldest(|c| !c.authorized) {}
    }
}

impl Drop for RendezvousServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        // Handlers do not panic while holding the lock (and a panicking handler only loses its own connection), so a
        // poisoned store is still consistent; keep serving.
        self.store
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn connections(&self) -> MutexGuard<'_, Connections> {
        self.connections
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn accept_loop(listener: &TcpListener, shared: &Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stopping.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = conn else {
            // EMFILE and friends: back off briefly rather than spin.
            std::thread::sleep(Duration::from_millis(10));
            continue;
        };
        let (Ok(peer), Ok(socket)) = (stream.peer_addr(), stream.try_clone()) else {
            continue;
        };
        let admitted = shared
            .connections()
            .admit(canonical(peer.ip()), socket, &shared.limits);
        let Some((id, evicted)) = admitted else {
            shared.refused.fetch_add(1, Ordering::SeqCst);
            refuse_busy(stream);
            continue;
        };
        if evicted > 0 {
            shared.evicted.fetch_add(evicted, Ordering::SeqCst);
            tracing::debug!(%peer, evicted, "rendezvous at its connection limit; closed the oldest unauthorized");
        }
        let conn_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name("hvd-rendezvous-conn".into())
            .stack_size(CONNECTION_STACK)
            .spawn(move || run_connection(stream, peer, id, &conn_shared));
        if spawned.is_err() {
            shared.connections().remove(id);
        }
    }
}

/// Answers 503 without blocking the accept thread on a peer that does not read.
fn refuse_busy(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(true);
    let _ = http::respond(&mut stream, 503, b"rendezvous server busy; retry\n");
}

/// One connection's thread: serves it, turns a panic into a closed connection, and frees its slot.
fn run_connection(stream: TcpStream, peer: SocketAddr, id: u64, shared: &Arc<Shared>) {
    guarded(shared, id, peer, || {
        serve_connection(stream, peer, id, shared)
    });
}

/// Runs one connection's work: a panic closes the connection (its socket is dropped with the closure) and is
/// counted; the slot is freed either way.
fn guarded(shared: &Shared, id: u64, peer: SocketAddr, serve: impl FnOnce()) {
    let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(serve));
    if served.is_err() {
        shared.panics.fetch_add(1, Ordering::SeqCst);
        tracing::error!(%peer, "a rendezvous connection handler panicked; closed that connection");
    }
    shared.connections().remove(id);
}

/// What a handled request answers.
struct Answer {
    status: u16,
    body: Vec<u8>,
    /// The peer passed its authorization check: wait briefly for the rest of what it sends before closing.
    authorized: bool,
}

fn serve_connection(mut stream: TcpStream, peer: SocketAddr, id: u64, shared: &Shared) {
    // Who holds the peer's end, looked up now, before anything is read: a client's socket is connected at least
    // until its request is sent, while by the time the request has arrived the client may have reset or closed it.
    // Only for peers whose token-less requests could be answered at all.
    let owner = gloo_host_allowed(shared, peer.ip()).then(|| peer::connection_peer(&stream));
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = stream.set_nodelay(true);
    let mut authorized = false;
    let answer = match handle(&mut stream, peer, owner, id, shared, &mut authorized) {
        Ok((status, body)) => Answer {
            status,
            body,
            authorized,
        },
        Err(HttpError(status, reason)) => Answer {
            status,
            body: format!("{reason}\n").into_bytes(),
            authorized,
        },
    };
    let _ = http::respond(&mut stream, answer.status, &answer.body);
    let _ = stream.shutdown(Shutdown::Write);
    if answer.status >= 400 {
        // Unread input at close() makes the kernel send a reset, which can destroy the answer before the peer reads
        // it. An unauthorized peer gets only what already arrived drained; an authorized one a short linger.
        if answer.authorized {
            http::linger(&mut stream, Duration::from_millis(200), 1024 * 1024);
        } else {
            http::drain_buffered(&mut stream, 64 * 1024);
        }
    }
}

fn handle(
    stream: &mut TcpStream,
    peer: SocketAddr,
    owner: Option<PeerEnd>,
    id: u64,
    shared: &Shared,
    authorized: &mut bool,
) -> Result<(u16, Vec<u8>), HttpError> {
    let limits = &shared.limits;
    let head_deadline = Instant::now() + limits.head_deadline;
    let (request, leftover) = http::read_head(stream, limits.max_head_bytes, head_deadline)?;
    if request.content_length > limits.max_value_bytes {
        return Err(HttpError::new(413, "value too large"));
    }
    // Authorize from the head alone, so an unauthorized peer cannot make the launcher read or buffer anything.
    let segments: Vec<&str> = request.path.split('/').collect();
    match segments.as_slice() {
        ["", "kv", _, _] | ["", "elastic", "v1", "join" | "leave" | "round" | "beat"] => {
            check_token(shared, &request)?
        }
        ["", _, _] => check_gloo_peer(shared, peer, owner)?,
        _ => return Err(HttpError::new(404, "unknown path: use /kv/<scope>/<key>")),
    }
    // A heartbeat has no body: one announced is refused before anything of it is read.
    if matches!(segments.as_slice(), ["", "elastic", "v1", "beat"]) && request.content_length != 0 {
        return Err(HttpError::new(
            413,
            "a heartbeat has no body: send content-length 0",
        ));
    }
    // From here the connection holds its slot: newer connections cannot close it to make room.
    if !shared.connections().authorize(id) {
        return Err(HttpError::new(503, "rendezvous server busy; retry"));
    }
    *authorized = true;
    let body_deadline = Instant::now() + limits.body_deadline;
    let body = http::read_body(
        stream,
        request.content_length,
        leftover,
        &shared.bodies,
        body_deadline,
        request.method == "PUT",
    )?;
    match segments.as_slice() {
        ["", "kv", scope, key] => on_kv(shared, &request, [scope, key], body.bytes),
        ["", "elastic", "v1", "join"] => on_elastic_join(shared, &request),
        ["", "elastic", "v1", "leave"] => on_elastic_leave(shared, &request),
        ["", "elastic", "v1", "round"] => on_elastic_round(shared, &request),
        ["", "elastic", "v1", "beat"] => beat::on_elastic_beat(shared, &request),
        ["", scope, key] => on_gloo(shared, &request, [scope, key], body.bytes),
        _ => Err(HttpError::new(404, "unknown path: use /kv/<scope>/<key>")),
    }
}

fn check_token(shared: &Shared, request: &Request) -> Result<(), HttpError> {
    let authorized = request
        .authorization
        .as_deref()
        .and_then(|v| v.strip_prefix("Bearer "))
        .is_some_and(|t| token_matches(&shared.token, t.trim()));
    if authorized {
        Ok(())
    } else {
        Err(HttpError::new(
            403,
            "missing or wrong job token (header `Authorization: Bearer $HVD_JOB_TOKEN`)",
        ))
    }
}

/// Whether token-less requests from `ip` may be answered at all: it is one of the job's hosts (any loopback address
/// counts when the hosts include one).
fn gloo_host_allowed(shared: &Shared, ip: IpAddr) -> bool {
    let ip = canonical(ip);
    shared.allowed_hosts.iter().any(|h| canonical(*h) == ip)
        || (ip.is_loopback()
            && shared
                .allowed_hosts
                .iter()
                .any(|h| canonical(*h).is_loopback()))
}

/// Token-less requests: the peer must be one of the job's hosts, and a connection from this machine must be held by
/// a process of the job's user. `owner` is what [`peer::connection_peer`] found when the connection was accepted
/// (`None`: not looked up, as the host is not allowed). A connection from this machine whose end no process held
/// then (reset, closed, orphaned) is refused, and so is one found nowhere whose address is this machine's.
fn check_gloo_peer(
    shared: &Shared,
    peer: SocketAddr,
    owner: Option<PeerEnd>,
) -> Result<(), HttpError> {
    let ip = canonical(peer.ip());
    let (true, Some(owner)) = (gloo_host_allowed(shared, ip), owner) else {
        return Err(HttpError::new(
            403,
            "token-less requests are only answered for the job's own hosts",
        ));
    };
    let nobody = || {
        HttpError(
            403,
            format!(
                "token-less request from {ip} on a connection that, when accepted, no process on this machine \
                 held (reset or closed before the answer): refused, as it cannot be the job's user's"
            )
            .into(),
        )
    };
    match owner {
        PeerEnd::Owned(uid) if uid == shared.job_uid => Ok(()),
        PeerEnd::Owned(uid) => Err(HttpError(
            403,
            format!(
                "token-less requests from this machine are only answered for the job's own user (uid {}), not \
                 uid {uid}",
                shared.job_uid
            )
            .into(),
        )),
        PeerEnd::Unowned => Err(nobody()),
        PeerEnd::Elsewhere if peer::is_this_machine(ip) => Err(nobody()),
        // The peer's socket is not on this machine: a job host, by address.
        PeerEnd::Elsewhere => Ok(()),
    }
}

fn valid_kv_segment(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 256
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

fn valid_gloo_segment(s: &str) -> bool {
    !s.is_empty() && s.len() <= 512 && s.bytes().all(|b| b.is_ascii_graphic())
}

/// An `X-Hvd-Join` identity: what a client process sends so that its rank cannot be claimed by another process.
fn valid_join(s: &str) -> bool {
    (1..=64).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'))
}

/// Constant-time comparison, so the token cannot be guessed byte by byte from response times.
fn token_matches(expected: &str, given: &str) -> bool {
    hvd_collective::tcp::constant_time_eq(expected.as_bytes(), given.as_bytes())
}

/// A handler's answer: a status and a body, or an error.
type Reply = Result<(u16, Vec<u8>), HttpError>;

fn store_error(e: &store::StoreError) -> HttpError {
    HttpError(e.status(), e.reason().into())
}

fn on_kv(shared: &Shared, request: &Request, [scope, key]: [&str; 2], body: Vec<u8>) -> Reply {
    if !valid_kv_segment(scope) || !valid_kv_segment(key) {
        return Err(HttpError::new(
            400,
            "scope and key must be 1-256 characters of [A-Za-z0-9._-]",
        ));
    }
    let rank = match request.rank.as_deref() {
        Some(r) => Some(
            r.parse::<u32>()
                .map_err(|_| HttpError::new(400, "x-hvd-rank must be a non-negative integer"))?,
        ),
        None => None,
    };
    let join = request.join.as_deref();
    if join.is_some_and(|j| !valid_join(j)) {
        return Err(HttpError::new(
            400,
            "x-hvd-join must be 1-64 characters of [A-Za-z0-9._-]",
        ));
    }
    let mut store = shared.lock();
    if let Some(rank) = rank
        && store.join(rank, join).map_err(|e| store_error(&e))?
    {
        shared.changed.notify_all();
    }
    match request.method.as_str() {
        "PUT" => {
            store.put(scope, key, body).map_err(|e| store_error(&e))?;
            shared.changed.notify_all();
            Ok((200, Vec::new()))
        }
        "GET" => {
            let wait = parse_wait(&request.query)?;
            let deadline = crate::options::saturating_add(Instant::now(), wait);
            loop {
                if let Some(value) = store.get(scope, key) {
                    return Ok((200, value.clone()));
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || shared.stopping.load(Ordering::SeqCst) {
                    return Err(HttpError::new(404, "no such key"));
                }
                store = match shared.changed.wait_timeout(store, left) {
                    Ok((guard, _)) => guard,
                    Err(poisoned) => poisoned.into_inner().0,
                };
            }
        }
        "DELETE" => {
            store.delete(scope, key);
            Ok((200, Vec::new()))
        }
        _ => Err(HttpError::new(405, "method must be GET, PUT or DELETE")),
    }
}

/// The worker (`X-Hvd-Rank`: its slot) asks for the round after `?after=<n>` (the last one it was a member of; 0 or
/// absent: none), waiting up to `wait_ms` for it to form; `beats=1`: it sends heartbeats once it is a member, so the
/// launcher counts it heard when its round forms. 200 `v1 <round> <rank> <size>`; 404: not formed yet, ask again;
/// 410: the round formed without this worker; 409: the step is not elastic.
fn on_elastic_join(shared: &Shared, request: &Request) -> Reply {
    if request.method != "POST" {
        return Err(HttpError::new(405, "method must be POST"));
    }
    let slot: u32 = request
        .rank
        .as_deref()
        .ok_or_else(|| HttpError::new(400, "an elastic join needs x-hvd-rank"))?
        .parse()
        .map_err(|_| HttpError::new(400, "x-hvd-rank must be a non-negative integer"))?;
    let join = request.join.as_deref();
    if join.is_some_and(|j| !valid_join(j)) {
        return Err(HttpError::new(
            400,
            "x-hvd-join must be 1-64 characters of [A-Za-z0-9._-]",
        ));
    }
    let (mut after, mut beats) = (0u64, false);
    for pair in request.query.split('&') {
        if let Some(value) = pair.strip_prefix("after=") {
            after = value
                .parse()
                .map_err(|_| HttpError::new(400, "after must be a non-negative integer"))?;
        } else if let Some(value) = pair.strip_prefix("beats=") {
            beats = match value {
                "1" => true,
                "0" => false,
                _ => return Err(HttpError::new(400, "beats must be 0 or 1")),
            };
        }
    }
    let deadline = crate::options::saturating_add(Instant::now(), parse_wait(&request.query)?);
    let mut store = shared.lock();
    // Before the slot is bound to this identity: a join to a step that is not elastic takes no seat.
    if store.elastic.is_none() {
        return Err(HttpError::new(409, "this step is not elastic"));
    }
    if store.join(slot, join).map_err(|e| store_error(&e))? {
        shared.changed.notify_all();
    }
    loop {
        let now = Instant::now();
        let Some(membership) = store.elastic.as_mut() else {
            return Err(HttpError::new(409, "this step is not elastic"));
        };
        if membership.closed() {
            return Err(HttpError::new(
                410,
                "the launcher is stopping this elastic step: no round forms any more",
            ));
        }
        let before = membership.latest().0;
        // Only a worker with a join identity beats (a heartbeat needs it): a slot that joined without one is never
        // armed, so nobody else can have it judged silent.
        if beats && join.is_some() {
            membership.will_beat(slot);
        }
        let answer = membership
            .join(slot, after, now)
            .map_err(|e| HttpError(400, e.reason().into()))?;
        if membership.latest().0 != before {
            shared.changed.notify_all();
        }
        let until = match answer {
            elastic::Joined::Member {
                generation,
                rank,
                size,
            } => return Ok((200, format!("v1 {generation} {rank} {size}\n").into_bytes())),
            elastic::Joined::LeftOut { generation } => {
                return Err(HttpError(
                    410,
                    format!(
                        "round {generation} of this elastic step formed without worker {slot} (it did not ask \
                         to join in time, or it was counted as gone)"
                    )
                    .into(),
                ));
            }
            elastic::Joined::Wait { until } => until,
        };
        let wake = until.map_or(deadline, |u| u.min(deadline));
        if now >= deadline || shared.stopping.load(Ordering::SeqCst) {
            return Err(HttpError::new(
                404,
                "the round has not formed yet; ask again",
            ));
        }
        store = match shared
            .changed
            .wait_timeout(store, wake.saturating_duration_since(now))
        {
            Ok((guard, _)) => guard,
            Err(poisoned) => poisoned.into_inner().0,
        };
    }
}

/// Runs `f` on the elastic step's membership for the slot (`X-Hvd-Rank`) of a request that only the process that
/// joined as that slot may make (`what`: "leave", "heartbeat"), with the store locked: 405 unless POST; 400 for a
/// missing or malformed rank or `X-Hvd-Join`; 409 when the step is not elastic; 403 unless `X-Hvd-Join` is the
/// identity the slot joined with (a slot that never joined, whether or not it is one of the step's, or another
/// worker's slot); `f`'s error is 410 when the worker is not alive (ended, left, left out, found silent), else 400.
fn as_elastic_worker<T>(
    shared: &Shared,
    request: &Request,
    what: &str,
    f: impl FnOnce(u32, &mut elastic::Membership) -> Result<T, elastic::MembershipError>,
) -> Result<T, HttpError> {
    if request.method != "POST" {
        return Err(HttpError::new(405, "method must be POST"));
    }
    let slot: u32 = request
        .rank
        .as_deref()
        .ok_or_else(|| HttpError(400, format!("an elastic {what} needs x-hvd-rank").into()))?
        .parse()
        .map_err(|_| HttpError::new(400, "x-hvd-rank must be a non-negative integer"))?;
    let join = request.join.as_deref().filter(|j| valid_join(j)).ok_or_else(|| {
        HttpError(
            400,
            format!(
                "an elastic {what} needs x-hvd-join (1-64 characters of [A-Za-z0-9._-]): the identity the worker \
                 joined with"
            )
            .into(),
        )
    })?;
    let mut store = shared.lock();
    let joined_here = store.identity(slot) == Some(Some(join));
    let Some(membership) = store.elastic.as_mut() else {
        return Err(HttpError::new(409, "this step is not elastic"));
    };
    if !joined_here {
        return Err(HttpError(
            403,
            format!(
                "worker {slot} did not join from this process (no join as that slot with this x-hvd-join): only a \
                 worker may send a {what} request, and only as its own slot"
            )
            .into(),
        ));
    }
    f(slot, membership).map_err(|e| match e {
        elastic::MembershipError::NotAlive { .. } | elastic::MembershipError::Stopping { .. } => {
            HttpError(410, e.reason().into())
        }
        _ => HttpError(400, e.reason().into()),
    })
}

/// The worker (`X-Hvd-Rank`: its slot) leaves the elastic step on its own (preempted, after its last commit): rounds
/// stop waiting for it and the launcher reports it as preempted. Only the process that joined as that slot may: the
/// request must carry the same `X-Hvd-Join` identity (403 otherwise, and for a slot that never joined). 200
/// `v1 <workers left alive>`; 410: the worker is not alive (ended, left, left out), or the launcher is stopping the
/// step (no hand-over then: the worker ends with the step); 409: the step is not elastic.
fn on_elastic_leave(shared: &Shared, request: &Request) -> Reply {
    let alive = as_elastic_worker(shared, request, "leave", |slot, membership| {
        membership.leave(slot, Instant::now())
    })?;
    shared.changed.notify_all();
    Ok((200, format!("v1 {alive}\n").into_bytes()))
}

/// The latest round of an elastic step, for its members to check at a commit: 200
/// `v1 <round> <size> <waiting> <stopping>`, `waiting` being the new workers (host discovery) asking to join the next
/// round, `stopping` 1 once the launcher stops the step (a worker's SIGTERM handler asks: a stop, not a preemption).
fn on_elastic_round(shared: &Shared, request: &Request) -> Reply {
    if request.method != "GET" {
        return Err(HttpError::new(405, "method must be GET"));
    }
    let store = shared.lock();
    let Some(membership) = store.elastic.as_ref() else {
        return Err(HttpError::new(409, "this step is not elastic"));
    };
    let (round, size, waiting) = membership.status();
    let stopping = u8::from(membership.stopping());
    Ok((
        200,
        format!("v1 {round} {size} {waiting} {stopping}\n").into_bytes(),
    ))
}

fn parse_wait(query: &str) -> Result<Duration, HttpError> {
    for pair in query.split('&') {
        if let Some(value) = pair.strip_prefix("wait_ms=") {
            let ms: u64 = value
                .parse()
                .map_err(|_| HttpError::new(400, "wait_ms must be a non-negative integer"))?;
            return Ok(Duration::from_millis(ms).min(MAX_WAIT));
        }
    }
    Ok(Duration::ZERO)
}

fn on_gloo(shared: &Shared, request: &Request, [scope, key]: [&str; 2], body: Vec<u8>) -> Reply {
    if !valid_gloo_segment(scope) || !valid_gloo_segment(key) {
        return Err(HttpError::new(400, "bad scope or key"));
    }
    shared.gloo_requests.fetch_add(1, Ordering::Relaxed);
    // Gloo scopes live in their own namespace so they never collide with `/kv/` scopes.
    let stored_scope = format!("gloo:{scope}");
    let mut store = shared.lock();
    match request.method.as_str() {
        "PUT" => {
            store
                .put(&stored_scope, key, body)
                .map_err(|e| store_error(&e))?;
            shared.changed.notify_all();
            Ok((200, Vec::new()))
        }
        "GET" => match store.get(&stored_scope, key) {
            Some(value) => Ok((200, value.clone())),
            None => Err(HttpError::new(404, "no such key")),
        },
        "DELETE" => {
            store
                .gloo_delete(scope, &stored_scope, key)
                .map_err(|e| store_error(&e))?;
            Ok((200, Vec::new()))
        }
        _ => Err(HttpError::new(405, "method must be GET, PUT or DELETE")),
    }
}

/// A fresh job token: 32 hex characters from the kernel's random source.
pub fn new_token() -> io::Result<String> {
    let mut bytes = [0u8; 16];
    fs_err::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    /// No peer input is known to panic a handler; this shows what happens if one ever does: that connection is
    /// closed, its slot freed, and the server (its store lock poisoned by the panic) keeps answering.
    #[test]
    fn a_panicking_handler_closes_its_connection_and_the_server_keeps_serving() {
        let server = RendezvousServer::start_on_loopback("token").unwrap();
        let shared = &server.shared;
        let client = TcpStream::connect(server.addr()).unwrap();
        // Wait for the server to take the connection, then run a panicking handler in its place.
        let id = loop {
            if let Some(id) = shared.connections().live.keys().next().copied() {
                break id;
            }
            std::thread::sleep(Duration::from_millis(5));
        };
        let peer = client.local_addr().unwrap();
        guarded(shared, id, peer, || {
            let _store = shared.lock();
            panic!("handler bug");
        });
        assert_eq!(server.stats().panics, 1);
        assert!(!shared.connections().live.contains_key(&id), "slot freed");
        // The server still serves, with the poisoned store lock.
        let mut s = TcpStream::connect(server.addr()).unwrap();
        s.write_all(
            b"PUT /kv/a/b HTTP/1.1\r\nAuthorization: Bearer token\r\nContent-Length: 1\r\n\r\nx",
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        assert!(out.starts_with("HTTP/1.1 200"), "{out}");
        assert_eq!(server.stats().store_bytes, 3);
        drop(client);
    }
}
