//! The workers' rendezvous client against the real launcher server while the test attacks the server: idle sockets
//! and slow heads fill its connection slots, or authorized long-polls hold every slot so it answers 503. Ranks with
//! the token must still exchange their addresses (issue 16 item 7).

use std::io::Write;
use std::net::TcpStream;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use hvd_collective::bootstrap::Rendezvous;
use hvd_launcher::rendezvous::{Limits, RendezvousServer};

const TOKEN: &str = "0123456789abcdef0123456789abcdef";
const RANKS: usize = 4;

fn server(limits: Limits) -> RendezvousServer {
    let s = RendezvousServer::start_with_limits(
        "127.0.0.1:0".parse().unwrap(),
        TOKEN,
        vec!["127.0.0.1".parse().unwrap()],
        limits,
    )
    .unwrap();
    s.set_job_size(RANKS as u32);
    s
}

/// Every rank PUTs its address and reads everyone's, as the bootstrap does; returns what rank 0 read.
fn exchange(address: String) -> Vec<Vec<u8>> {
    let ranks: Vec<_> = (0..RANKS)
        .map(|rank| {
            let address = address.clone();
            std::thread::spawn(move || {
                let kv = Rendezvous::Http {
                    address,
                    token: Some(TOKEN.into()),
                }
                .client(rank)
                .with_retry_for(Duration::from_secs(120));
                kv.put(&format!("addr.{rank}"), format!("rank {rank}").as_bytes())
                    .unwrap();
                (0..RANKS)
                    .map(|r| {
                        kv.get(&format!("addr.{r}"), Duration::from_secs(120))
                            .unwrap()
                    })
                    .collect::<Vec<_>>()
            })
        })
        .collect();
    let mut all: Vec<_> = ranks.into_iter().map(|t| t.join().unwrap()).collect();
    all.swap_remove(0)
}

#[test]
fn ranks_join_while_idle_and_slow_sockets_flood_the_server() {
    let server = server(Limits {
        max_connections: 32,
        max_connections_per_peer: 16,
        head_deadline: Duration::from_secs(2),
        ..Limits::default()
    });
    let addr = server.addr();
    let stop = Arc::new(AtomicBool::new(false));
    let flood = {
        let stop = Arc::clone(&stop);
        std::thread::spawn(move || {
            let mut open = std::collections::VecDeque::new();
            let mut n = 0u64;
            while !stop.load(Ordering::SeqCst) {
                if let Ok(mut s) = TcpStream::connect(addr) {
                    // Every other socket sends the start of a head and stalls (slowloris); the rest stay silent.
                    if n.is_multiple_of(2) {
                        let _ = s.write_all(b"GET /kv/hvd/addr.0 HTTP/1.1\r\n");
                    }
                    open.push_back(s);
                }
                n += 1;
                if open.len() > 64 {
                    open.pop_front();
                }
                std::thread::sleep(Duration::from_millis(2));
            }
        })
    };
    while server.stats().evicted < 50 {
        std::thread::sleep(Duration::from_millis(10));
    }
    let read = exchange(addr.to_string());
    assert_eq!(
        read,
        (0..RANKS)
            .map(|r| format!("rank {r}").into_bytes())
            .collect::<Vec<_>>()
    );
    assert_eq!(
        server.joined_ranks().into_iter().collect::<Vec<_>>(),
        vec![0, 1, 2, 3]
    );
    stop.store(true, Ordering::SeqCst);
    flood.join().unwrap();
}

#[test]
fn ranks_retry_through_503_until_slots_free_up() {
    // As many slots as ranks, each rank holding at most one connection at a time.
    let server = server(Limits {
        max_connections: RANKS,
        max_connections_per_peer: RANKS,
        ..Limits::default()
    });
    let address = server.addr().to_string();
    // Authorized long-polls take every slot for a while: new connections get 503 until they end.
    let holders: Vec<_> = (0..RANKS)
        .map(|_| {
            let address = address.clone();
            std::thread::spawn(move || {
                let kv = Rendezvous::Http {
                    address,
                    token: Some(TOKEN.into()),
                }
                .client(0);
                // Never stored: the long-poll runs its full wait, then the client sees a timeout error.
                let _ = kv.get("never", Duration::from_millis(1500));
            })
        })
        .collect();
    while server.stats().connections < RANKS {
        std::thread::sleep(Duration::from_millis(5));
    }
    let read = exchange(address);
    assert_eq!(read.len(), RANKS);
    assert!(
        server.stats().refused > 0,
        "the server was full and answered 503: {:?}",
        server.stats()
    );
    for h in holders {
        h.join().unwrap();
    }
}
