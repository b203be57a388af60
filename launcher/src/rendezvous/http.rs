//! The wire side of the rendezvous server: one HTTP/1.1 request read from a peer within a deadline and byte limits,
//! and the answer written back. Nothing here trusts the peer: the head is read up to exactly its limit, a body is
//! allocated only as its bytes arrive (never from `Content-Length`), and each read waits at most until the deadline.

use std::borrow::Cow;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// A parsed request head.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) method: String,
    pub(crate) path: String,
    pub(crate) query: String,
    pub(crate) content_length: usize,
    pub(crate) authorization: Option<String>,
    pub(crate) rank: Option<String>,
    pub(crate) join: Option<String>,
}

/// An error answer: status and a one-line reason.
#[derive(Debug)]
pub(crate) struct HttpError(pub(crate) u16, pub(crate) Cow<'static, str>);

impl HttpError {
    pub(crate) fn new(status: u16, reason: &'static str) -> HttpError {
        HttpError(status, Cow::Borrowed(reason))
    }
}

/// Reads once into `buf`, waiting no later than `deadline`.
fn read_before(stream: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> io::Result<usize> {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        // A zero timeout would mean "block forever"; `left` is not zero here.
        stream.set_read_timeout(Some(left))?;
        match stream.read(buf) {
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            other => return other,
        }
    }
}

fn read_error(e: &io::Error, what: &'static str) -> HttpError {
    match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => HttpError(408, Cow::Borrowed(what)),
        _ => HttpError::new(400, "connection failed mid-request"),
    }
}

/// Reads the request head (request line and headers, at most `max_head` bytes including the blank line) before
/// `deadline`. Returns the request and the body bytes that came with it; nothing past `max_head` bytes is read.
pub(crate) fn read_head(
    stream: &mut TcpStream,
    max_head: usize,
    deadline: Instant,
) -> Result<(Request, Vec<u8>), HttpError> {
    let mut buf = Vec::with_capacity(max_head.min(2048));
    let mut chunk = [0u8; 4096];
    let head_end = loop {
        if let Some(pos) = find_head_end(&buf) {
            break pos;
        }
        let room = max_head - buf.len();
        if room == 0 {
            return Err(HttpError::new(431, "request head too large"));
        }
        let want = room.min(chunk.len());
        match read_before(stream, &mut chunk[..want], deadline) {
            Ok(0) => return Err(HttpError::new(400, "connection closed mid-request")),
            Ok(n) => buf.extend_from_slice(&chunk[..n]),
            Err(e) => return Err(read_error(&e, "timed out reading the request head")),
        }
    };
    let request = parse_head(&buf[..head_end])?;
    Ok((request, buf[head_end + 4..].to_vec()))
}

fn find_head_end(buf: &[u8]) -> Option<usize> {
    buf.windows(4).position(|w| w == b"\r\n\r\n")
}

fn parse_head(head: &[u8]) -> Result<Request, HttpError> {
    let head =
        std::str::from_utf8(head).map_err(|_| HttpError::new(400, "request head is not UTF-8"))?;
    let mut lines = head.split("\r\n");
    let request_line = lines.next().unwrap_or_default();
    let mut parts = request_line.split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(HttpError::new(400, "malformed request line"));
    };
    if !version.starts_with("HTTP/1.") {
        return Err(HttpError::new(400, "only HTTP/1.x is spoken here"));
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
        join: None,
    };
    let mut saw_length = false;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            return Err(HttpError::new(400, "malformed header line"));
        };
        let value = value.trim();
        if name.eq_ignore_ascii_case("content-length") {
            if saw_length {
                return Err(HttpError::new(400, "more than one content-length"));
            }
            saw_length = true;
            request.content_length = value
                .parse()
                .map_err(|_| HttpError::new(400, "bad content-length"))?;
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            return Err(HttpError::new(
                411,
                "send a content-length, not a transfer-encoding",
            ));
        } else if name.eq_ignore_ascii_case("authorization") {
            request.authorization = Some(value.to_owned());
        } else if name.eq_ignore_ascii_case("x-hvd-rank") {
            request.rank = Some(value.to_owned());
        } else if name.eq_ignore_ascii_case("x-hvd-join") {
            request.join = Some(value.to_owned());
        }
    }
    Ok(request)
}

/// Request body bytes held in memory over all connections, against a limit.
#[derive(Debug)]
pub(crate) struct BodyBudget {
    reserved: AtomicUsize,
    peak: AtomicUsize,
    limit: usize,
}

impl BodyBudget {
    pub(crate) fn new(limit: usize) -> BodyBudget {
        BodyBudget {
            reserved: AtomicUsize::new(0),
            peak: AtomicUsize::new(0),
            limit,
        }
    }

    pub(crate) fn reserved(&self) -> usize {
        self.reserved.load(Ordering::SeqCst)
    }

    pub(crate) fn peak(&self) -> usize {
        self.peak.load(Ordering::SeqCst)
    }
}

/// One body's share of the [`BodyBudget`]; given back when dropped.
pub(crate) struct Reservation<'a> {
    budget: &'a BodyBudget,
    held: usize,
}

impl Reservation<'_> {
    /// Raises this body's share to `bytes`; false when that would pass the budget's limit.
    fn grow_to(&mut self, bytes: usize) -> bool {
        if bytes <= self.held {
            return true;
        }
        let extra = bytes - self.held;
        let before = self.budget.reserved.fetch_add(extra, Ordering::SeqCst);
        if before.saturating_add(extra) > self.budget.limit {
            self.budget.reserved.fetch_sub(extra, Ordering::SeqCst);
            return false;
        }
        self.held = bytes;
        self.budget.peak.fetch_max(before + extra, Ordering::SeqCst);
        true
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        self.budget.reserved.fetch_sub(self.held, Ordering::SeqCst);
    }
}

/// A received body and the budget it holds until dropped.
pub(crate) struct Body<'a> {
    pub(crate) bytes: Vec<u8>,
    _reservation: Reservation<'a>,
}

/// Reads a body of `length` bytes (`leftover` already came with the head) before `deadline`. With `keep` false the
/// bytes are read and dropped (a GET or DELETE that carries a body). Memory grows only with bytes received, at most
/// doubling, and every byte allocated is charged to `budget` first: past its limit the answer is 503.
pub(crate) fn read_body<'a>(
    stream: &mut TcpStream,
    length: usize,
    leftover: Vec<u8>,
    budget: &'a BodyBudget,
    deadline: Instant,
    keep: bool,
) -> Result<Body<'a>, HttpError> {
    if leftover.len() > length {
        return Err(HttpError::new(400, "more bytes than content-length"));
    }
    let mut reservation = Reservation { budget, held: 0 };
    let mut received = leftover.len();
    let mut bytes = Vec::new();
    if keep {
        append(&mut bytes, &leftover, length, &mut reservation)?;
    }
    drop(leftover);
    let mut chunk = [0u8; 16 * 1024];
    while received < length {
        let want = (length - received).min(chunk.len());
        match read_before(stream, &mut chunk[..want], deadline) {
            Ok(0) => {
                return Err(HttpError::new(
                    400,
                    "connection closed before the body was complete",
                ));
            }
            Ok(n) => {
                received += n;
                if keep {
                    append(&mut bytes, &chunk[..n], length, &mut reservation)?;
                }
            }
            Err(e) => return Err(read_error(&e, "timed out reading the body")),
        }
    }
    Ok(Body {
        bytes,
        _reservation: reservation,
    })
}

fn append(
    bytes: &mut Vec<u8>,
    new: &[u8],
    length: usize,
    reservation: &mut Reservation<'_>,
) -> Result<(), HttpError> {
    let need = bytes.len() + new.len();
    if need > bytes.capacity() {
        let capacity = need
            .max(bytes.capacity() * 2)
            .max(4096)
            .min(length)
            .max(need);
        if !reservation.grow_to(capacity) {
            return Err(HttpError::new(503, "rendezvous server busy; retry"));
        }
        bytes
            .try_reserve_exact(capacity - bytes.len())
            .map_err(|_| HttpError::new(503, "rendezvous server out of memory; retry"))?;
    }
    bytes.extend_from_slice(new);
    Ok(())
}

fn status_text(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        408 => "Request Timeout",
        409 => "Conflict",
        411 => "Length Required",
        413 => "Payload Too Large",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        507 => "Insufficient Storage",
        _ => "Error",
    }
}

/// Writes a complete answer (`Content-Length`, `Connection: close`).
pub(crate) fn respond(stream: &mut TcpStream, status: u16, body: &[u8]) -> io::Result<()> {
    let head = format!(
        "HTTP/1.1 {status} {}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        status_text(status),
        body.len()
    );
    let mut out = Vec::with_capacity(head.len() + body.len());
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(body);
    stream.write_all(&out)?;
    stream.flush()
}

/// Reads and drops what the peer already sent, without waiting for more, so that closing does not reset the
/// connection under an answer the peer has not read yet. An unauthorized peer gets no more than this: it cannot keep
/// the connection open by trickling bytes.
pub(crate) fn drain_buffered(stream: &mut TcpStream, max: usize) {
    if stream.set_nonblocking(true).is_err() {
        return;
    }
    let mut sink = [0u8; 8192];
    let mut drained = 0;
    while drained < max {
        match stream.read(&mut sink) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

/// Lingers up to `for_at_most` for the rest of an authorized peer's request before closing (same reason as
/// [`drain_buffered`]); bounded in bytes and time.
pub(crate) fn linger(stream: &mut TcpStream, for_at_most: Duration, max: usize) {
    let deadline = Instant::now() + for_at_most;
    let mut sink = [0u8; 8192];
    let mut drained = 0;
    while drained < max {
        match read_before(stream, &mut sink, deadline) {
            Ok(0) | Err(_) => break,
            Ok(n) => drained += n,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn head_parsing_refuses_ambiguity() {
        let ok =
            parse_head(b"GET /kv/a/b?wait_ms=5 HTTP/1.1\r\nX-Hvd-Join: n1\r\nContent-Length: 3")
                .unwrap();
        assert_eq!(
            (ok.path.as_str(), ok.query.as_str(), ok.content_length),
            ("/kv/a/b", "wait_ms=5", 3)
        );
        assert_eq!(ok.join.as_deref(), Some("n1"));
        let twice = parse_head(b"PUT /a/b HTTP/1.1\r\nContent-Length: 3\r\nContent-Length: 3");
        assert_eq!(twice.unwrap_err().0, 400);
        assert_eq!(parse_head(b"PUT /a/b HTTP/2").unwrap_err().0, 400);
        assert_eq!(parse_head(b"\xff\xfe").unwrap_err().0, 400);
    }

    #[test]
    fn the_budget_refuses_past_its_limit_and_gives_back_on_drop() {
        let budget = BodyBudget::new(100);
        let mut a = Reservation {
            budget: &budget,
            held: 0,
        };
        assert!(a.grow_to(60));
        {
            let mut b = Reservation {
                budget: &budget,
                held: 0,
            };
            assert!(!b.grow_to(41));
            assert!(b.grow_to(40));
            assert_eq!(budget.reserved(), 100);
        }
        assert_eq!(budget.reserved(), 60);
        drop(a);
        assert_eq!((budget.reserved(), budget.peak()), (0, 100));
    }
}
