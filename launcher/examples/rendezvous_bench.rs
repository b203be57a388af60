//! Rendezvous start-up cost: a local job of N workers (`bench/launch/hvd_worker.c`, built with `cc`) that each PUT
//! their address and long-poll every other rank's, against a fresh server per run, as `hvd run` does. Prints the
//! median and fastest wall time from spawning the workers to the last exit. Then the latency of single requests:
//! a token `/kv/` GET and a token-less gloo GET (which also looks up the connection's owner in `/proc/net/tcp`). A
//! benchmark, not a test: machines are noisy, compare medians taken in the same session.
//!
//!   cargo run --release -p hvd-launcher --example rendezvous_bench -- [WORKERS=4] [REPEATS=50]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use hvd_launcher::rendezvous::{RendezvousServer, new_token};

fn main() {
    let mut args = std::env::args().skip(1);
    let workers: u32 = args
        .next()
        .map_or(4, |a| a.parse().expect("WORKERS is a number"));
    let repeats: usize = args
        .next()
        .map_or(50, |a| a.parse().expect("REPEATS is a number"));
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = std::env::temp_dir().join(format!("hvd-rendezvous-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("create the bench directory");
    let worker = dir.join("hvd_worker");
    let built = Command::new("cc")
        .args(["-O2", "-o"])
        .arg(&worker)
        .arg(root.join("bench/launch/hvd_worker.c"))
        .status()
        .expect("run cc");
    assert!(built.success(), "cc failed");
    let mut times = Vec::with_capacity(repeats);
    for _ in 0..repeats {
        let (token, server) = local_server();
        server.set_gloo_layout(&[("localhost".into(), workers)]);
        let started = Instant::now();
        let children: Vec<_> = (0..workers)
            .map(|rank| {
                Command::new(&worker)
                    .env("HVD_RENDEZVOUS", server.addr().to_string())
                    .env("HVD_JOB_TOKEN", &token)
                    .env("HVD_RANK", rank.to_string())
                    .env("HVD_SIZE", workers.to_string())
                    .spawn()
                    .expect("start a worker")
            })
            .collect();
        for mut c in children {
            assert!(
                c.wait().expect("wait for a worker").success(),
                "a worker failed"
            );
        }
        times.push(started.elapsed());
    }
    let _ = std::fs::remove_dir_all(&dir);
    times.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    println!(
        "workers={workers} repeats={repeats}: median {:.2} ms, fastest {:.2} ms",
        ms(times[times.len() / 2]),
        ms(times[0])
    );
    let (token, server) = local_server();
    let kv = format!(
        "GET /kv/bench/k HTTP/1.1\r\nAuthorization: Bearer {token}\r\nContent-Length: 0\r\n\r\n"
    );
    let gloo = "GET /global/k HTTP/1.1\r\nContent-Length: 0\r\n\r\n";
    for (name, request) in [("kv GET", kv.as_str()), ("gloo GET", gloo)] {
        let mut each: Vec<Duration> = (0..2000)
            .map(|_| time_request(server.addr(), request.as_bytes()))
            .collect();
        each.sort();
        println!(
            "{name}: median {:.1} us per request (2000 sequential)",
            each[each.len() / 2].as_secs_f64() * 1e6
        );
    }
}

/// A fresh server on a free loopback port that admits loopback peers, with its new token.
fn local_server() -> (String, RendezvousServer) {
    let token = new_token().expect("read /dev/urandom");
    let server = RendezvousServer::start_on_loopback(&token).expect("start the server");
    (token, server)
}

/// One request on a fresh connection, answer read to the end.
fn time_request(addr: SocketAddr, request: &[u8]) -> Duration {
    let started = Instant::now();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(request).expect("send");
    let mut answer = Vec::new();
    s.read_to_end(&mut answer).expect("read");
    assert!(
        answer.starts_with(b"HTTP/1.1 404"),
        "{}",
        String::from_utf8_lossy(&answer)
    );
    started.elapsed()
}
