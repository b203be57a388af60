//! The rendezvous key-value server the launcher hosts for every job (protocol: docs/rendezvous.md).
//!
//! Plain HTTP/1.1 over std threads: one accept thread, one short-lived thread per connection, one request per
//! connection (`Connection: close`). Two families of endpoints share the store:
//!
//! - `/kv/<scope>/<key>` (hvd's own clients): needs `Authorization: Bearer <job token>`; `GET` may long-poll with
//!   `?wait_ms=N`; every authenticated request's `X-Hvd-Rank` marks that rank as joined.
//! - `/<scope>/<key>` (Horovod's gloo `HTTPStore`): no token (the client cannot send one), so it is only answered for
//!   peers whose address is one of the job's hosts.
//!
//! The server must survive any peer: requests are size-bounded, reads time out, and nothing a peer sends can panic
//! it (malformed input gets a 4xx and the connection is closed).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Largest request head (request line + headers) accepted.
pub const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Largest value accepted in one PUT.
pub const MAX_VALUE_BYTES: usize = 64 * 1024 * 1024;
/// Largest total of all stored values; a PUT past it gets 507.
pub const MAX_STORE_BYTES: usize = 1024 * 1024 * 1024;
/// Longest long-poll a client may ask for with `wait_ms`.
pub const MAX_WAIT: Duration = Duration::from_secs(600);
/// Connections served at once; further ones get 503 and are closed.
pub const MAX_CONNECTIONS: usize = 2048;
/// Bytes of request bodies being received at once, over all connections; past it new bodies get 503.
pub const MAX_INFLIGHT_BODY_BYTES: usize = 512 * 1024 * 1024;
/// How long one read from a peer may block before the request is abandoned.
const READ_TIMEOUT: Duration = Duration::from_secs(10);
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);

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
    store: Mutex<Store>,
    changed: Condvar,
    stopping: AtomicBool,
    connections: AtomicUsize,
    inflight_body_bytes: AtomicUsize,
    gloo_requests: AtomicU64,
}

#[derive(Default)]
struct Store {
    values: HashMap<(String, String), Vec<u8>>,
    bytes: usize,
    joined: BTreeSet<u32>,
    /// Horovod's fixed gloo scopes (`global`, `local_<host>`, `cross_<local rank>`) and how many ranks use each: a
    /// scope is cleared once that many ranks have DELETEd their key in it (Horovod's own server does the same).
    gloo_scope_sizes: BTreeMap<String, usize>,
    gloo_finished: BTreeMap<String, BTreeSet<String>>,
}

impl Store {
    fn put(&mut self, scope: &str, key: &str, value: Vec<u8>) -> Result<(), ()> {
        let old = self
            .values
            .get(&(scope.to_owned(), key.to_owned()))
            .map_or(0, Vec::len);
        let new_total = self.bytes - old + value.len();
        if new_total > MAX_STORE_BYTES {
            return Err(());
        }
        self.bytes = new_total;
        self.values
            .insert((scope.to_owned(), key.to_owned()), value);
        Ok(())
    }

    fn delete(&mut self, scope: &str, key: &str) {
        if let Some(old) = self.values.remove(&(scope.to_owned(), key.to_owned())) {
            self.bytes -= old.len();
        }
    }

    fn clear_scope(&mut self, scope: &str) {
        let doomed: Vec<_> = self
            .values
            .keys()
            .filter(|(s, _)| s == scope)
            .cloned()
            .collect();
        for (s, k) in doomed {
            self.delete(&s, &k);
        }
    }
}

impl RendezvousServer {
    /// Binds `bind` (use port 0 for a free port) and starts serving. `token` guards the `/kv/` endpoints;
    /// `allowed_hosts` are the addresses whose token-less (Horovod gloo) requests are answered. Loopback peers are
    /// always allowed for gloo requests when `allowed_hosts` contains any loopback address.
    pub fn start(
        bind: SocketAddr,
        token: &str,
        allowed_hosts: Vec<IpAddr>,
    ) -> Result<Self, RendezvousError> {
        if token.is_empty() || !token.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(RendezvousError::BadToken);
        }
        let listener = TcpListener::bind(bind)
            .map_err(|source| RendezvousError::Bind { addr: bind, source })?;
        let addr = listener
            .local_addr()
            .map_err(|source| RendezvousError::Bind { addr: bind, source })?;
        let shared = Arc::new(Shared {
            token: token.to_owned(),
            allowed_hosts,
            store: Mutex::new(Store::default()),
            changed: Condvar::new(),
            stopping: AtomicBool::new(false),
            connections: AtomicUsize::new(0),
            inflight_body_bytes: AtomicUsize::new(0),
            gloo_requests: AtomicU64::new(0),
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
        self.shared.lock().joined.clone()
    }

    /// Number of token-less (Horovod gloo) requests answered so far.
    pub fn gloo_requests(&self) -> u64 {
        self.shared.gloo_requests.load(Ordering::Relaxed)
    }

    /// Waits until `size` distinct ranks (0..size) have joined, or `timeout` passes. Returns the ranks joined.
    pub fn wait_joined(&self, size: u32, timeout: Duration) -> BTreeSet<u32> {
        let deadline = Instant::now() + timeout;
        let mut store = self.shared.lock();
        loop {
            if (0..size).all(|r| store.joined.contains(&r)) {
                return store.joined.clone();
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() || self.shared.stopping.load(Ordering::SeqCst) {
                return store.joined.clone();
            }
            store = match self.shared.changed.wait_timeout(store, left) {
                Ok((guard, _)) => guard,
                Err(poisoned) => poisoned.into_inner().0,
            };
        }
    }

    /// Declares Horovod's gloo scopes for a job layout: `global` with `size` ranks, `local_<host>` with each host's
    /// rank count, `cross_<local rank>` with the number of hosts that have that local rank.
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
        store.gloo_scope_sizes = sizes;
        store.gloo_finished.clear();
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
    }
}

impl Drop for RendezvousServer {
    fn drop(&mut self) {
        self.shutdown();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Store> {
        // A panic while holding the lock cannot leave the store inconsistent in a way that matters more than
        // stopping the job would; keep serving.
        self.store
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
        if shared.connections.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
            shared.connections.fetch_sub(1, Ordering::SeqCst);
            let mut stream = stream;
            let _ = stream.set_write_timeout(Some(Duration::from_millis(200)));
            let _ = respond(&mut stream, 503, b"too many connections\n");
            continue;
        }
        let conn_shared = Arc::clone(shared);
        let spawned = std::thread::Builder::new()
            .name("hvd-rendezvous-conn".into())
            .spawn(move || {
                serve_connection(stream, &conn_shared);
                conn_shared.connections.fetch_sub(1, Ordering::SeqCst);
            });
        if spawned.is_err() {
            shared.connections.fetch_sub(1, Ordering::SeqCst);
        }
    }
}

/// A parsed request.
struct Request {
    method: String,
    path: String,
    query: String,
    content_length: usize,
    authorization: Option<String>,
    rank: Option<String>,
}

/// An HTTP error response: status and one-line reason.
struct HttpError(u16, &'static str);

fn serve_connection(mut stream: TcpStream, shared: &Shared) {
    let _ = stream.set_read_timeout(Some(READ_TIMEOUT));
    let _ = stream.set_write_timeout(Some(WRITE_TIMEOUT));
    let _ = stream.set_nodelay(true);
    let peer = stream.peer_addr().ok().map(|a| a.ip());
    let (status, body) = match handle(&mut stream, shared, peer) {
        Ok((status, body)) => (status, body),
        Err(HttpError(status, reason)) => (status, format!("{reason}\n").into_bytes()),
    };
    let _ = respond(&mut stream, status, &body);
    let _ = stream.shutdown(Shutdown::Write);
    if status >= 400 {
        // Lingering close: unread input at close() makes the kernel send a reset, which can destroy the response
        // before the peer reads it. Drain a bounded amount briefly first.
        let _ = stream.set_read_timeout(Some(Duration::from_millis(100)));
        let mut sink = [0u8; 8192];
        let mut drained = 0usize;
        while drained < 1024 * 1024 {
            match stream.read(&mut sink) {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    }
}

fn respond(stream: &mut TcpStream, status: u16, body: &[u8]) -> io::Result<()> {
    let reason = match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        507 => "Insufficient Storage",
        _ => "Error",
    };
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut out = Vec::with_capacity(head.len() + body.len());
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(body);
    stream.write_all(&out)?;
    stream.flush()
}

fn handle(
    stream: &mut TcpStream,
    shared: &Shared,
    peer: Option<IpAddr>,
) -> Result<(u16, Vec<u8>), HttpError> {
    let (request, mut leftover) = read_head(stream)?;
    if request.content_length > MAX_VALUE_BYTES {
        return Err(HttpError(413, "value too large"));
    }
    // Refuse before reading a body, so an unauthorized peer cannot make the launcher buffer anything.
    let segments: Vec<&str> = request.path.split('/').collect();
    match segments.as_slice() {
        ["", "kv", _, _] => check_token(shared, &request)?,
        ["", _, _] => check_peer(shared, peer)?,
        _ => return Err(HttpError(404, "unknown path: use /kv/<scope>/<key>")),
    }
    // Bodies being read at once are bounded too (many connections each sending a large value).
    let reserved = shared
        .inflight_body_bytes
        .fetch_add(request.content_length, Ordering::SeqCst);
    let _release = Release(&shared.inflight_body_bytes, request.content_length);
    if reserved + request.content_length > MAX_INFLIGHT_BODY_BYTES {
        return Err(HttpError(503, "rendezvous server busy; retry"));
    }
    // Read the body (a GET/DELETE body is read and ignored so the peer is not reset mid-send).
    if leftover.len() > request.content_length {
        return Err(HttpError(400, "more bytes than content-length"));
    }
    let mut body = std::mem::take(&mut leftover);
    let have = body.len();
    body.resize(request.content_length, 0);
    read_exact_body(stream, &mut body, have)?;

    match segments.as_slice() {
        ["", "kv", scope, key] => handle_kv(shared, &request, scope, key, body),
        ["", scope, key] => handle_gloo(shared, &request, peer, scope, key, body),
        _ => Err(HttpError(404, "unknown path: use /kv/<scope>/<key>")),
    }
}

/// Gives back reserved in-flight body bytes when dropped.
struct Release<'a>(&'a AtomicUsize, usize);

impl Drop for Release<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(self.1, Ordering::SeqCst);
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
        Err(HttpError(
            403,
            "missing or wrong job token (header `Authorization: Bearer $HVD_JOB_TOKEN`)",
        ))
    }
}

fn check_peer(shared: &Shared, peer: Option<IpAddr>) -> Result<(), HttpError> {
    let allowed = peer.is_some_and(|ip| {
        let ip = canonical(ip);
        shared.allowed_hosts.iter().any(|h| canonical(*h) == ip)
            || (ip.is_loopback()
                && shared
                    .allowed_hosts
                    .iter()
                    .any(|h| canonical(*h).is_loopback()))
    });
    if allowed {
        Ok(())
    } else {
        Err(HttpError(
            403,
            "token-less requests are only answered for the job's own hosts",
        ))
    }
}

fn read_exact_body(
    stream: &mut TcpStream,
    body: &mut [u8],
    mut have: usize,
) -> Result<(), HttpError> {
    let deadline = Instant::now() + MAX_WAIT;
    while have < body.len() {
        match stream.read(&mut body[have..]) {
            Ok(0) => {
                return Err(HttpError(
                    400,
                    "connection closed before the body was complete",
                ));
            }
            Ok(n) => have += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Err(HttpError(408, "timed out reading the body")),
        }
        if Instant::now() > deadline {
            return Err(HttpError(408, "timed out reading the body"));
        }
    }
    Ok(())
}

/// Reads the request head; returns the request and any body bytes read past it.
fn read_head(stream: &mut TcpStream) -> Result<(Request, Vec<u8>), HttpError> {
    let mut buf = Vec::with_capacity(1024);
    let mut chunk = [0u8; 4096];
    let deadline = Instant::now() + READ_TIMEOUT * 3;
    let head_end = loop {
        if let Some(pos) = find_head_end(&buf) {
            break pos;
        }
        if buf.len() > MAX_HEAD_BYTES {
            return Err(HttpError(431, "request head too large"));
        }
        if Instant::now() > deadline {
            return Err(HttpError(408, "timed out reading the request"));
        }
        match stream.read(&mut chunk) {
            Ok(0) => return Err(HttpError(400, "connection closed mid-request")),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(_) => return Err(HttpError(408, "timed out reading the request")),
        }
    };
    let head = std::str::from_utf8(&buf[..head_end])
        .map_err(|_| HttpError(400, "request head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError(400, "malformed request line"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError(400, "only HTTP/1.x is spoken here"));
    }
    // Absolute-form targets (`http://host:port/path`) are allowed by HTTP/1.1; some clients send them.
    let target = match target.strip_prefix("http://") {
        Some(rest) => rest.find('/').map_or("/", |i| &rest[i..]),
        None => target,
    };
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut request = Request {
        method: method.to_owned(),
        path: path.to_owned(),
        query: query.to_owned(),
        content_length: 0,
        authorization: None,
        rank: None,
    };
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(HttpError(400, "malformed header line"));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            request.content_length = value
                .parse()
                .map_err(|_| HttpError(400, "bad content-length"))?;
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError(
                411,
                "send a content-length, not a transfer-encoding",
            ));
        } else if name.eq_ignore_ascii_case("authorization") {
            request.authorization = Some(value.to_owned());
        } else if name.eq_ignore_ascii_case("x-hvd-rank") {
            request.rank = Some(value.to_owned());
        }
    }
    let leftover = buf[head_end + 4..].to_vec();
    Ok((request, leftover))
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
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

/// Constant-time comparison, so the token cannot be guessed byte by byte from response times.
fn token_matches(expected: &str, given: &str) -> bool {
    let (a, b) = (expected.as_bytes(), given.as_bytes());
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn handle_kv(
    shared: &Shared,
    request: &Request,
    scope: &str,
    key: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), HttpError> {
    check_token(shared, request)?;
    if !valid_kv_segment(scope) || !valid_kv_segment(key) {
        return Err(HttpError(
            400,
            "scope and key must be 1-256 characters of [A-Za-z0-9._-]",
        ));
    }
    let rank = match request.rank.as_deref() {
        Some(r) => Some(
            r.parse::<u32>()
                .map_err(|_| HttpError(400, "x-hvd-rank must be a non-negative integer"))?,
        ),
        None => None,
    };
    let mut store = shared.lock();
    if let Some(rank) = rank
        && store.joined.insert(rank)
    {
        shared.changed.notify_all();
    }
    match request.method.as_str() {
        "PUT" => {
            store
                .put(scope, key, body)
                .map_err(|()| HttpError(507, "rendezvous store is full"))?;
            shared.changed.notify_all();
            Ok((200, Vec::new()))
        }
        "GET" => {
            let wait = parse_wait(&request.query)?;
            let deadline = Instant::now() + wait;
            let id = (scope.to_owned(), key.to_owned());
            loop {
                if let Some(value) = store.values.get(&id) {
                    return Ok((200, value.clone()));
                }
                let left = deadline.saturating_duration_since(Instant::now());
                if left.is_zero() || shared.stopping.load(Ordering::SeqCst) {
                    return Err(HttpError(404, "no such key"));
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
        _ => Err(HttpError(405, "method must be GET, PUT or DELETE")),
    }
}

fn parse_wait(query: &str) -> Result<Duration, HttpError> {
    for pair in query.split('&') {
        if let Some(value) = pair.strip_prefix("wait_ms=") {
            let ms: u64 = value
                .parse()
                .map_err(|_| HttpError(400, "wait_ms must be a non-negative integer"))?;
            return Ok(Duration::from_millis(ms).min(MAX_WAIT));
        }
    }
    Ok(Duration::ZERO)
}

fn handle_gloo(
    shared: &Shared,
    request: &Request,
    peer: Option<IpAddr>,
    scope: &str,
    key: &str,
    body: Vec<u8>,
) -> Result<(u16, Vec<u8>), HttpError> {
    check_peer(shared, peer)?;
    if !valid_gloo_segment(scope) || !valid_gloo_segment(key) {
        return Err(HttpError(400, "bad scope or key"));
    }
    shared.gloo_requests.fetch_add(1, Ordering::Relaxed);
    // Gloo scopes live in their own namespace so they never collide with `/kv/` scopes.
    let scope = format!("gloo:{scope}");
    let mut store = shared.lock();
    match request.method.as_str() {
        "PUT" => {
            store
                .put(&scope, key, body)
                .map_err(|()| HttpError(507, "rendezvous store is full"))?;
            shared.changed.notify_all();
            Ok((200, Vec::new()))
        }
        "GET" => match store.values.get(&(scope, key.to_owned())) {
            Some(value) => Ok((200, value.clone())),
            None => Err(HttpError(404, "no such key")),
        },
        "DELETE" => {
            let plain = &scope["gloo:".len()..];
            if let Some(&size) = store.gloo_scope_sizes.get(plain) {
                // A rank DELETEs its own rank number when it finished with the scope; the scope is cleared once
                // every rank of it has done so, so the next rendezvous in it starts clean.
                let finished = store.gloo_finished.entry(plain.to_owned()).or_default();
                finished.insert(key.to_owned());
                if finished.len() >= size {
                    store.gloo_finished.remove(plain);
                    store.clear_scope(&scope);
                }
            } else {
                store.delete(&scope, key);
            }
            Ok((200, Vec::new()))
        }
        _ => Err(HttpError(405, "method must be GET, PUT or DELETE")),
    }
}

/// IPv4-mapped IPv6 addresses compare equal to their IPv4 form.
fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

/// A fresh job token: 32 hex characters from the kernel's random source.
pub fn new_token() -> io::Result<String> {
    let mut bytes = [0u8; 16];
    fs_err::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}
