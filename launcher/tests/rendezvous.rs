//! The rendezvous server over real TCP, with a hand-written HTTP client like the workers' one.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Duration;

use hvd_launcher::rendezvous::{MAX_HEAD_BYTES, MAX_VALUE_BYTES, RendezvousServer};

const TOKEN: &str = "0123456789abcdef";

fn server() -> RendezvousServer {
    RendezvousServer::start(
        "127.0.0.1:0".parse().unwrap(),
        TOKEN,
        vec!["127.0.0.1".parse().unwrap()],
    )
    .unwrap()
}

/// Sends raw bytes, returns (status, body).
fn raw(addr: SocketAddr, request: &[u8]) -> (u16, Vec<u8>) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    // The server may answer (and close) before reading everything we send; ignore write errors.
    let _ = stream.write_all(request);
    let mut response = Vec::new();
    let _ = stream.read_to_end(&mut response);
    parse_response(&response)
}

fn parse_response(response: &[u8]) -> (u16, Vec<u8>) {
    let text = String::from_utf8_lossy(response);
    let status: u16 = text
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad response {text:?}"));
    let end = response.windows(4).position(|w| w == b"\r\n\r\n").unwrap() + 4;
    let head = &text[..end];
    let length: usize = head
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .strip_prefix("content-length:")
                .map(|v| v.trim().parse().unwrap())
        })
        .expect("content-length always present");
    assert_eq!(
        response.len() - end,
        length,
        "body length matches content-length"
    );
    (status, response[end..].to_vec())
}

fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    token: Option<&str>,
    rank: Option<u32>,
    body: &[u8],
) -> (u16, Vec<u8>) {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: {}\r\nConnection: close\r\n",
        body.len()
    );
    if let Some(token) = token {
        req.push_str(&format!("Authorization: Bearer {token}\r\n"));
    }
    if let Some(rank) = rank {
        req.push_str(&format!("X-Hvd-Rank: {rank}\r\n"));
    }
    req.push_str("\r\n");
    let mut bytes = req.into_bytes();
    bytes.extend_from_slice(body);
    raw(addr, &bytes)
}

#[test]
fn put_get_delete_round_trip_and_joined_ranks() {
    let server = server();
    let addr = server.addr();
    assert_ne!(addr.port(), 0);
    assert_eq!(
        request(
            addr,
            "PUT",
            "/kv/hvd/addr.0",
            Some(TOKEN),
            Some(0),
            b"10.0.0.1:1234\x00\xff"
        )
        .0,
        200
    );
    let (status, body) = request(addr, "GET", "/kv/hvd/addr.0", Some(TOKEN), Some(3), b"");
    assert_eq!(
        (status, body.as_slice()),
        (200, &b"10.0.0.1:1234\x00\xff"[..])
    );
    assert_eq!(
        server.joined_ranks().into_iter().collect::<Vec<_>>(),
        vec![0, 3]
    );
    assert_eq!(
        request(addr, "DELETE", "/kv/hvd/addr.0", Some(TOKEN), None, b"").0,
        200
    );
    assert_eq!(
        request(addr, "GET", "/kv/hvd/addr.0", Some(TOKEN), None, b"").0,
        404
    );
}

#[test]
fn wrong_or_missing_token_is_403_and_does_not_join() {
    let server = server();
    let addr = server.addr();
    let (status, body) = request(addr, "PUT", "/kv/hvd/k", Some("nope"), Some(1), b"x");
    assert_eq!(status, 403);
    assert_eq!(
        body.iter().filter(|&&b| b == b'\n').count(),
        1,
        "one-line body"
    );
    assert_eq!(request(addr, "GET", "/kv/hvd/k", None, Some(1), b"").0, 403);
    assert!(server.joined_ranks().is_empty());
    assert_eq!(
        request(addr, "GET", "/kv/hvd/k", Some(TOKEN), None, b"").0,
        404,
        "nothing was stored"
    );
}

#[test]
fn long_poll_waits_for_a_put() {
    let server = server();
    let addr = server.addr();
    let waiter = std::thread::spawn(move || {
        request(
            addr,
            "GET",
            "/kv/s/late?wait_ms=20000",
            Some(TOKEN),
            Some(1),
            b"",
        )
    });
    // Let the GET arrive first, then PUT: the waiting GET must get the value, not a 404.
    while !server.joined_ranks().contains(&1) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(
        request(addr, "PUT", "/kv/s/late", Some(TOKEN), Some(0), b"hello").0,
        200
    );
    assert_eq!(waiter.join().unwrap(), (200, b"hello".to_vec()));
}

#[test]
fn long_poll_times_out_with_404() {
    let server = server();
    assert_eq!(
        request(
            server.addr(),
            "GET",
            "/kv/s/never?wait_ms=50",
            Some(TOKEN),
            None,
            b""
        )
        .0,
        404
    );
}

#[test]
fn wait_joined_sees_all_ranks() {
    let server = server();
    let addr = server.addr();
    let clients: Vec<_> = (0..4)
        .map(|r| {
            std::thread::spawn(move || {
                request(
                    addr,
                    "PUT",
                    &format!("/kv/hvd/addr.{r}"),
                    Some(TOKEN),
                    Some(r),
                    b"a",
                )
            })
        })
        .collect();
    let joined = server.wait_joined(4, Duration::from_secs(20));
    assert_eq!(joined.into_iter().collect::<Vec<_>>(), vec![0, 1, 2, 3]);
    for c in clients {
        assert_eq!(c.join().unwrap().0, 200);
    }
    assert_eq!(
        server.wait_joined(5, Duration::from_millis(10)).len(),
        4,
        "rank 4 never joined"
    );
}

#[test]
fn gloo_endpoints_answer_without_token_from_job_hosts() {
    let server = server();
    let addr = server.addr();
    assert_eq!(
        request(addr, "GET", "/global/rank_0", None, None, b"").0,
        404
    );
    assert_eq!(
        request(addr, "PUT", "/global/rank_0", None, None, b"addr0").0,
        200
    );
    assert_eq!(
        request(addr, "GET", "/global/rank_0", None, None, b""),
        (200, b"addr0".to_vec())
    );
    // Absolute-form request targets work too.
    assert_eq!(
        request(
            addr,
            "GET",
            &format!("http://{addr}/global/rank_0"),
            None,
            None,
            b""
        )
        .0,
        200
    );
    // Gloo scopes and /kv/ scopes do not mix.
    assert_eq!(
        request(addr, "GET", "/kv/global/rank_0", Some(TOKEN), None, b"").0,
        404
    );
    assert_eq!(server.gloo_requests(), 4);
}

#[test]
fn gloo_scope_is_cleared_when_every_rank_deleted() {
    let server = server();
    let addr = server.addr();
    server.set_gloo_layout(&[("localhost".into(), 2)]);
    request(addr, "PUT", "/global/rank_0", None, None, b"a");
    request(addr, "PUT", "/global/rank_1", None, None, b"b");
    request(addr, "PUT", "/adhoc/x", None, None, b"c");
    assert_eq!(request(addr, "DELETE", "/global/0", None, None, b"").0, 200);
    assert_eq!(
        request(addr, "GET", "/global/rank_0", None, None, b"").0,
        200,
        "one of two ranks finished"
    );
    assert_eq!(request(addr, "DELETE", "/global/1", None, None, b"").0, 200);
    assert_eq!(
        request(addr, "GET", "/global/rank_1", None, None, b"").0,
        404,
        "cleared after both"
    );
    assert_eq!(request(addr, "DELETE", "/adhoc/x", None, None, b"").0, 200);
    assert_eq!(
        request(addr, "GET", "/adhoc/x", None, None, b"").0,
        404,
        "ad-hoc scope deletes the key"
    );
}

#[test]
fn gloo_endpoints_refuse_other_hosts() {
    let server = RendezvousServer::start(
        "127.0.0.1:0".parse().unwrap(),
        TOKEN,
        vec!["10.1.2.3".parse().unwrap()],
    )
    .unwrap();
    assert_eq!(
        request(server.addr(), "PUT", "/global/rank_0", None, None, b"a").0,
        403
    );
    // The token endpoints do not depend on the peer address.
    assert_eq!(
        request(server.addr(), "PUT", "/kv/hvd/a", Some(TOKEN), None, b"a").0,
        200
    );
}

#[test]
fn bad_peers_get_errors_and_the_server_keeps_serving() {
    let server = server();
    let addr = server.addr();
    // An idle connection that never sends anything must not block others.
    let _idle = TcpStream::connect(addr).unwrap();
    assert_eq!(raw(addr, b"garbage\r\n\r\n").0, 400);
    assert_eq!(
        raw(addr, b"GET /kv/a/b HTTP/1.1\r\nno colon here\r\n\r\n").0,
        400
    );
    let mut huge = b"GET /kv/a/b HTTP/1.1\r\nX-Filler: ".to_vec();
    huge.resize(MAX_HEAD_BYTES + 10_000, b'a');
    assert_eq!(raw(addr, &huge).0, 431);
    let big = format!(
        "PUT /kv/a/b HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: {}\r\n\r\n",
        MAX_VALUE_BYTES + 1
    );
    assert_eq!(raw(addr, big.as_bytes()).0, 413);
    assert_eq!(
        raw(addr, b"PUT /kv/a/b HTTP/1.1\r\nContent-Length: -1\r\n\r\n").0,
        400
    );
    assert_eq!(
        raw(
            addr,
            b"PUT /kv/a/b HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        .0,
        411
    );
    assert_eq!(
        request(addr, "GET", "/kv/bad%2F/b", Some(TOKEN), None, b"").0,
        400
    );
    assert_eq!(
        request(addr, "GET", "/kv/a/b?wait_ms=x", Some(TOKEN), None, b"").0,
        400
    );
    assert_eq!(
        request(addr, "GET", "/kv/a/b", Some(TOKEN), None, b"").0,
        404
    );
    assert_eq!(
        request(addr, "POST", "/kv/a/b", Some(TOKEN), None, b"").0,
        405
    );
    assert_eq!(request(addr, "GET", "/a/b/c/d", None, None, b"").0, 404);
    assert_eq!(
        request(addr, "GET", "/kv/a/b", Some(TOKEN), Some(0), b"").0,
        404
    );
    assert_eq!(
        request(addr, "GET", "/kv/a/b", Some(TOKEN), None, b"").0,
        404
    );
    // A body cut short by the peer closing.
    {
        let mut s = TcpStream::connect(addr).unwrap();
        s.write_all(format!("PUT /kv/a/b HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 100\r\n\r\nshort").as_bytes())
            .unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let mut out = Vec::new();
        let _ = s.read_to_end(&mut out);
        assert_eq!(parse_response(&out).0, 400);
    }
    assert_eq!(
        request(addr, "PUT", "/kv/a/b", Some(TOKEN), None, b"still fine").0,
        200
    );
    assert_eq!(
        request(addr, "GET", "/kv/a/b", Some(TOKEN), None, b"").1,
        b"still fine"
    );
}

#[test]
fn body_split_across_writes_is_assembled() {
    let server = server();
    let addr = server.addr();
    let mut s = TcpStream::connect(addr).unwrap();
    s.write_all(format!("PUT /kv/a/split HTTP/1.1\r\nAuthorization: Bearer {TOKEN}\r\nContent-Length: 10\r\n\r\n01234").as_bytes())
        .unwrap();
    s.flush().unwrap();
    std::thread::sleep(Duration::from_millis(20));
    s.write_all(b"56789").unwrap();
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    assert_eq!(parse_response(&out).0, 200);
    assert_eq!(
        request(addr, "GET", "/kv/a/split", Some(TOKEN), None, b"").1,
        b"0123456789"
    );
}

#[test]
fn shutdown_wakes_long_polls_and_frees_the_port() {
    let mut server = server();
    let addr = server.addr();
    let waiter = std::thread::spawn(move || {
        request(
            addr,
            "GET",
            "/kv/s/k?wait_ms=600000",
            Some(TOKEN),
            Some(0),
            b"",
        )
    });
    while server.joined_ranks().is_empty() {
        std::thread::sleep(Duration::from_millis(5));
    }
    server.shutdown();
    assert_eq!(waiter.join().unwrap().0, 404);
    server.shutdown();
    assert!(TcpStream::connect(addr).is_err(), "listener closed");
}

#[test]
fn bad_token_is_refused_at_start() {
    assert!(RendezvousServer::start("127.0.0.1:0".parse().unwrap(), "", vec![]).is_err());
    assert!(RendezvousServer::start("127.0.0.1:0".parse().unwrap(), "has space", vec![]).is_err());
}

#[test]
fn unauthorized_requests_are_refused_before_their_body_is_read() {
    let server = RendezvousServer::start(
        "127.0.0.1:0".parse().unwrap(),
        TOKEN,
        vec!["10.1.2.3".parse().unwrap()],
    )
    .unwrap();
    // Announce a large body and send none of it: the answer must not wait for it.
    let head =
        "PUT /kv/a/b HTTP/1.1\r\nAuthorization: Bearer wrong\r\nContent-Length: 1000000\r\n\r\n";
    assert_eq!(raw(server.addr(), head.as_bytes()).0, 403);
    let head = "PUT /global/rank_0 HTTP/1.1\r\nContent-Length: 1000000\r\n\r\n";
    assert_eq!(
        raw(server.addr(), head.as_bytes()).0,
        403,
        "gloo request from a foreign host"
    );
}
