//! The tcp transport's handshake against attackers on real sockets: an impostor claiming a rank, a peer with the
//! wrong token, a replayed handshake, a stalled connection, and an (authenticated) peer announcing absurd frame
//! lengths. The attacker speaks the wire protocol by hand (described in `hvd_collective::tcp`).

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use hvd_collective::bootstrap::{self, BackendChoice, JobEnv};
use hvd_collective::p2p::P2pCommunicator;
use hvd_collective::tcp::{JobKey, TcpTransport, connect_from, listen};
use hvd_collective::transport::{RecvOp, exchange};
use hvd_collective::{Communicator, DType, Error, ReduceOp};

const MAGIC: u32 = 0x3144_5648;
const DATA: u32 = 1;
const HELLO: u32 = 4;
const CHALLENGE: u32 = 5;
const PROOF: u32 = 6;
const CONTEXT: &[u8] = b"hvd tcp handshake v1\0";
const HELLO_LEN: usize = 56;
const CHALLENGE_LEN: usize = 80;
const PROOF_LEN: usize = 48;

fn frame(kind: u32, value: u64) -> Vec<u8> {
    let mut b = MAGIC.to_ne_bytes().to_vec();
    b.extend(kind.to_ne_bytes());
    b.extend(value.to_ne_bytes());
    b
}

fn nonce() -> [u8; 32] {
    let mut n = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut n))
        .expect("read /dev/urandom");
    n
}

fn hello(rank: u64, size: u64, nonce: &[u8; 32]) -> Vec<u8> {
    let mut b = frame(HELLO, rank);
    b.extend(size.to_ne_bytes());
    b.extend(nonce);
    b
}

fn proof(key: &JobKey, side: &[u8], n_c: &[u8], n_a: &[u8], c: u64, a: u64, size: u64) -> [u8; 32] {
    key.mac(&[
        CONTEXT,
        side,
        n_c,
        n_a,
        &c.to_le_bytes(),
        &a.to_le_bytes(),
        &size.to_le_bytes(),
    ])
}

/// Plays the dialling side of the handshake as rank `c` towards rank `a` at `addr`, proving knowledge of `key`;
/// returns the authenticated stream.
fn join_as(addr: SocketAddr, c: u64, a: u64, size: u64, key: &JobKey) -> TcpStream {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let n_c = nonce();
    s.write_all(&hello(c, size, &n_c)).unwrap();
    let mut ch = [0u8; CHALLENGE_LEN];
    s.read_exact(&mut ch).expect("the acceptor's challenge");
    assert_eq!(
        ch[..16],
        frame(CHALLENGE, a)[..],
        "a CHALLENGE from rank {a}"
    );
    let n_a = &ch[16..48];
    assert_eq!(
        ch[48..],
        proof(key, b"A", &n_c, n_a, c, a, size),
        "the acceptor proves the key"
    );
    let mut p = frame(PROOF, c);
    p.extend(proof(key, b"C", &n_c, n_a, c, a, size));
    s.write_all(&p).unwrap();
    s
}

/// Waits until the peer drops `s` (EOF or reset); panics if it keeps the connection open for 20 s.
fn assert_dropped(s: &mut TcpStream, who: &str) {
    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
    let mut sink = [0u8; 256];
    loop {
        match s.read(&mut sink) {
            Ok(0) => return,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return,
            Err(e) => panic!("{who} was not dropped: {e}"),
        }
    }
}

fn listeners(n: usize) -> (Vec<TcpListener>, Vec<SocketAddr>) {
    let ls: Vec<TcpListener> = (0..n)
        .map(|_| listen(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap())
        .collect();
    let addrs = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    (ls, addrs)
}

fn f32s(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

/// Allreduce on two connected transports (one thread each); returns each rank's result.
fn allreduce_pair(t0: TcpTransport, t1: TcpTransport) -> Vec<Vec<f32>> {
    let timeout = Duration::from_secs(20);
    std::thread::scope(|s| {
        [t0, t1]
            .into_iter()
            .enumerate()
            .map(|(r, t)| {
                s.spawn(move || {
                    let mut c = P2pCommunicator::new(t, "tcp", vec![0, 1], timeout);
                    let mut x = f32s(&vec![r as f32 + 1.0; 100_003]);
                    c.allreduce_in_place(&mut x, DType::F32, ReduceOp::Sum)
                        .expect("allreduce");
                    x.chunks_exact(4)
                        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
                        .collect::<Vec<f32>>()
                })
            })
            .collect::<Vec<_>>()
            .into_iter()
            .map(|h| h.join().unwrap())
            .collect()
    })
}

#[test]
fn the_mac_is_hmac_sha256() {
    // RFC 4231 test cases 1, 2 and 6 (a key longer than the block).
    let hex = |m: [u8; 32]| m.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let k1 = JobKey::new(&[0x0b; 20]).unwrap();
    assert_eq!(
        hex(k1.mac(&[b"Hi ", b"There"])),
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7"
    );
    let k2 = JobKey::new(b"Jefe").unwrap();
    assert_eq!(
        hex(k2.mac(&[b"what do ya want for nothing?"])),
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
    );
    let k6 = JobKey::new(&[0xaa; 131]).unwrap();
    assert_eq!(
        hex(k6.mac(&[b"Test Using Larger Than Block-Size Key - Hash Key First"])),
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54"
    );
    assert!(JobKey::new(b"").is_err(), "an empty key is refused");
    assert_eq!(format!("{k2:?}"), "JobKey(..)", "the key is never printed");
}

/// Impostors reach rank 0 before the real rank 1: one greets as rank 1 and then stalls, one greets as rank 1 and
/// answers the challenge with a guess. Rank 0 drops the guesser, does not wait on the staller, and the real rank 1
/// joins; the allreduce is right.
#[test]
fn an_impostor_greeting_as_rank_1_is_refused_and_the_real_rank_joins() {
    let key = JobKey::new(b"the job token").unwrap();
    let (ls, addrs) = listeners(2);
    // Shorter than the per-connection handshake limit: a rank 0 that waited on the staller would time out.
    let connect = Duration::from_secs(8);
    let mut staller = TcpStream::connect(addrs[0]).unwrap();
    staller.write_all(&hello(1, 2, &nonce())).unwrap();
    let mut guesser = TcpStream::connect(addrs[0]).unwrap();
    let n_c = nonce();
    guesser.write_all(&hello(1, 2, &n_c)).unwrap();
    let (t0, t1) = std::thread::scope(|s| {
        let r0 = s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &key, connect));
        let mut ch = [0u8; CHALLENGE_LEN];
        guesser
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        guesser
            .read_exact(&mut ch)
            .expect("rank 0 challenges a well-formed greeting");
        let wrong = JobKey::new(b"a guessed token").unwrap();
        let mut p = frame(PROOF, 1);
        p.extend(proof(&wrong, b"C", &n_c, &ch[16..48], 1, 0, 2));
        guesser.write_all(&p).unwrap();
        assert_dropped(&mut guesser, "the guessing impostor");
        let r1 = s.spawn(|| TcpTransport::connect(1, &ls[1], &addrs, &key, connect));
        (r0.join().unwrap(), r1.join().unwrap())
    });
    let t0 = t0.expect("rank 0 connects to the real rank 1");
    let t1 = t1.expect("the real rank 1 connects");
    for (r, got) in allreduce_pair(t0, t1).iter().enumerate() {
        assert!(got.iter().all(|v| *v == 3.0), "rank {r} got a wrong sum");
    }
    drop(staller);
}

/// Greetings that are not a joining rank (garbage, a rank outside the job, the acceptor's own rank, a lower rank, the
/// wrong job size) are each dropped, and a flood of silent connections (more than may wait at once) does not keep
/// the real ranks out.
#[test]
fn bad_greetings_and_a_flood_do_not_keep_the_real_rank_out() {
    let key = JobKey::new(b"the job token").unwrap();
    let (ls, addrs) = listeners(3);
    let flood: Vec<TcpStream> = (0..100)
        .map(|_| TcpStream::connect(addrs[1]).unwrap())
        .collect();
    let (t1, t2) = std::thread::scope(|s| {
        let r1 =
            s.spawn(|| TcpTransport::connect(1, &ls[1], &addrs, &key, Duration::from_secs(20)));
        // Rank 1 waits for rank 0 (started last) and meanwhile accepts: the flood and the bad greetings come first.
        let bad: [Vec<u8>; 6] = [
            vec![0x41; HELLO_LEN],
            hello(7, 3, &nonce()),
            hello(u64::MAX, 3, &nonce()),
            hello(1, 3, &nonce()),
            hello(0, 3, &nonce()),
            hello(2, 4, &nonce()),
        ];
        for (i, greeting) in bad.iter().enumerate() {
            let mut c = TcpStream::connect(addrs[1]).unwrap();
            c.write_all(greeting).unwrap();
            assert_dropped(&mut c, &format!("bad greeting {i}"));
        }
        let r2 =
            s.spawn(|| TcpTransport::connect(2, &ls[2], &addrs, &key, Duration::from_secs(20)));
        let r0 =
            s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &key, Duration::from_secs(20)));
        let t0 = r0.join().unwrap().expect("rank 0");
        drop(t0);
        (r1.join().unwrap(), r2.join().unwrap())
    });
    t1.expect("rank 1 joins despite the flood");
    t2.expect("rank 2 joins");
    drop(flood);
}

/// A rank whose token differs is refused by the accepting rank, and itself refuses the acceptor's proof: both fail
/// with errors that say so, neither joins.
#[test]
fn a_peer_with_a_wrong_token_is_refused() {
    let key = JobKey::new(b"the job token").unwrap();
    let other = JobKey::new(b"another job's token").unwrap();
    let (ls, addrs) = listeners(2);
    let connect = Duration::from_secs(3);
    let (r0, r1) = std::thread::scope(|s| {
        let r0 = s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &key, connect));
        let r1 = s.spawn(|| TcpTransport::connect(1, &ls[1], &addrs, &other, connect));
        (r0.join().unwrap(), r1.join().unwrap())
    });
    let e0 = r0.err().expect("rank 0 must not accept the wrong token");
    let e1 = r1.err().expect("rank 1 must not accept rank 0's proof");
    let (m0, m1) = (e0.to_string(), e1.to_string());
    assert!(
        matches!(e0, Error::Bootstrap(_)) && m0.contains("refused") && m0.contains("HVD_JOB_TOKEN"),
        "{m0}"
    );
    assert!(
        m1.contains("rank 0")
            && m1.contains("not a rank of this job")
            && m1.contains("HVD_JOB_TOKEN"),
        "{m1}"
    );
}

/// Forwards one connection from `proxy` to `to`, recording what the dialling side sent.
fn recording_proxy(proxy: TcpListener, to: SocketAddr, log: Arc<Mutex<Vec<u8>>>) {
    std::thread::spawn(move || {
        let (mut client, _) = proxy.accept().unwrap();
        let mut server = TcpStream::connect(to).unwrap();
        let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut s2, &mut c2);
            let _ = c2.shutdown(std::net::Shutdown::Write);
        });
        let mut buf = [0u8; 4096];
        loop {
            match client.read(&mut buf) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    log.lock().unwrap().extend_from_slice(&buf[..n]);
                    if server.write_all(&buf[..n]).is_err() {
                        break;
                    }
                }
            }
        }
        let _ = server.shutdown(std::net::Shutdown::Write);
    });
}

/// An eavesdropper records rank 1's side of a real handshake and replays it against a later connect of the same
/// job (same token): the acceptor's fresh nonce makes the recorded proof worthless; the real rank 1 still joins.
#[test]
fn a_replayed_handshake_is_refused() {
    let key = JobKey::new(b"the job token").unwrap();
    let connect = Duration::from_secs(10);
    // A first connect, rank 1 reaching rank 0 through a recording proxy.
    let (ls, addrs) = listeners(2);
    let proxy = listen(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    let via = vec![proxy.local_addr().unwrap(), addrs[1]];
    let log = Arc::new(Mutex::new(Vec::new()));
    recording_proxy(proxy, addrs[0], log.clone());
    let (t0, t1) = std::thread::scope(|s| {
        let r0 = s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &key, connect));
        let r1 = s.spawn(|| TcpTransport::connect(1, &ls[1], &via, &key, connect));
        (r0.join().unwrap().unwrap(), r1.join().unwrap().unwrap())
    });
    for got in allreduce_pair(t0, t1) {
        assert!(got.iter().all(|v| *v == 3.0));
    }
    let recorded: Vec<u8> = log.lock().unwrap()[..HELLO_LEN + PROOF_LEN].to_vec();
    assert_eq!(recorded[..16], frame(HELLO, 1)[..]);
    assert_eq!(recorded[HELLO_LEN..HELLO_LEN + 16], frame(PROOF, 1)[..]);

    // The same job connects again; the recording is replayed before the real rank 1 arrives.
    let (ls, addrs) = listeners(2);
    let (t0, t1) = std::thread::scope(|s| {
        let r0 = s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &key, connect));
        let mut replay = TcpStream::connect(addrs[0]).unwrap();
        replay.write_all(&recorded[..HELLO_LEN]).unwrap();
        let mut ch = [0u8; CHALLENGE_LEN];
        replay
            .set_read_timeout(Some(Duration::from_secs(20)))
            .unwrap();
        replay.read_exact(&mut ch).expect("a challenge");
        replay.write_all(&recorded[HELLO_LEN..]).unwrap();
        assert_dropped(&mut replay, "the replayed handshake");
        let r1 = s.spawn(|| TcpTransport::connect(1, &ls[1], &addrs, &key, connect));
        (r0.join().unwrap(), r1.join().unwrap())
    });
    let (t0, t1) = (t0.expect("rank 0"), t1.expect("rank 1"));
    for got in allreduce_pair(t0, t1) {
        assert!(got.iter().all(|v| *v == 3.0));
    }
}

/// A peer that holds the token (a buggy or hostile rank) announces frame lengths no message has: rank 0 neither
/// allocates them nor panics, whether it expects data from that peer (a clear mismatch) or the peer is idle and
/// hangs up (its hang-up check walks the frames with checked arithmetic and names it).
#[test]
fn a_huge_frame_length_neither_allocates_nor_panics() {
    let key = JobKey::new(b"the job token").unwrap();
    let connect = Duration::from_secs(10);
    // Expected data: the operation header arrives with an absurd length.
    let (ls, addrs) = listeners(2);
    let (t0, mut evil) = std::thread::scope(|s| {
        let r0 = s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &key, connect));
        let evil = join_as(addrs[0], 1, 0, 2, &key);
        (
            r0.join()
                .unwrap()
                .expect("rank 0 accepts a peer with the token"),
            evil,
        )
    });
    let mut head = frame(DATA, u64::MAX);
    head.extend([0xee; 64]);
    evil.write_all(&head).unwrap();
    let mut c = P2pCommunicator::new(t0, "tcp", vec![0, 1], Duration::from_secs(10));
    let mut x = f32s(&[1.0]);
    let e = c
        .allreduce_in_place(&mut x, DType::F32, ReduceOp::Sum)
        .expect_err("a frame of 2^64-1 bytes");
    assert!(
        matches!(e, Error::Mismatch { rank: 1, .. })
            && e.to_string().contains("18446744073709551615-byte"),
        "{e}"
    );
    drop(evil);

    // An idle peer: rank 0 waits for rank 1 while rank 2 sends a frame header with an absurd length and hangs up.
    for len in [u64::MAX - 7, 1 << 40] {
        let (ls, addrs) = listeners(3);
        let (mut t0, quiet, mut evil) = std::thread::scope(|s| {
            let r0 = s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &key, connect));
            let quiet = join_as(addrs[0], 1, 0, 3, &key);
            let evil = join_as(addrs[0], 2, 0, 3, &key);
            (r0.join().unwrap().expect("rank 0"), quiet, evil)
        });
        evil.write_all(&frame(DATA, len)).unwrap();
        evil.write_all(&[0xee; 1000]).unwrap();
        evil.shutdown(std::net::Shutdown::Write).unwrap();
        let mut buf = [0u8; 8];
        let e = exchange(
            &mut t0,
            "test",
            Duration::from_secs(10),
            &mut [],
            &mut [RecvOp::new(1, &mut buf, None)],
        )
        .expect_err("rank 2 hung up");
        assert!(
            matches!(e, Error::PeerLost { rank: 2, .. }),
            "length {len}: {e}"
        );
        drop(quiet);
    }
}

/// Without a token (a `file:` rendezvous) rank 0 draws a random key and shares it through the rendezvous; the
/// ranks join through the real bootstrap, and a greeting without the key is still refused.
#[test]
fn without_a_token_the_key_comes_from_the_rendezvous() {
    let dir = tempfile::tempdir().unwrap();
    let rendezvous = format!("file:{}", dir.path().display());
    let job = |r: usize| {
        let vars = [
            ("HVD_RANK", r.to_string()),
            ("HVD_SIZE", "2".to_string()),
            ("HVD_HOSTNAME", format!("host{r}")),
            ("HVD_RENDEZVOUS", rendezvous.clone()),
        ];
        JobEnv::from_lookup(move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.clone()))
            .unwrap()
    };
    let results: Vec<Result<Vec<u8>, Error>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..2)
            .map(|r| {
                let j = job(r);
                s.spawn(move || {
                    let mut c =
                        bootstrap::connect(&j, BackendChoice::Tcp, Duration::from_secs(20))?;
                    assert_eq!(c.backend(), "tcp");
                    let mut x = f32s(&[r as f32 + 1.0; 5]);
                    c.allreduce_in_place(&mut x, DType::F32, ReduceOp::Sum)?;
                    Ok(x)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for r in results {
        assert_eq!(
            r.expect("join through the file rendezvous"),
            f32s(&[3.0; 5])
        );
    }
    // The first join of this process: round 1's namespace.
    let path = dir
        .path()
        .join("hvd")
        .join(hvd_collective::rendezvous::Round::FIRST.key("tcp.key"));
    let content = std::fs::read_to_string(&path).expect("rank 0 published a key");
    let key = content
        .strip_prefix("hvd-rendezvous v1 job=\n")
        .expect("a rendezvous file header");
    assert!(key.len() == 64 && key.bytes().all(|b| b.is_ascii_hexdigit()));
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&path).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "the key file is the user's only");
}

/// Whatever answers at rank 0's address without ever speaking (here a listener nobody accepts on) keeps rank 1
/// only until its connect timeout, which then names rank 0.
#[test]
fn a_silent_acceptor_times_out_naming_it() {
    let key = JobKey::new(b"the job token").unwrap();
    let (ls, addrs) = listeners(2);
    let e = TcpTransport::connect(1, &ls[1], &addrs, &key, Duration::from_secs(2))
        .err()
        .expect("rank 0 never answers");
    assert!(
        matches!(&e, Error::Timeout { op: "connect", ranks, .. } if ranks == &[0]),
        "{e}"
    );
}

/// Forwards every connection to `proxy` on to `to` from `source` until `done`, holding the first answer from `to`
/// (the handshake's challenge) back for `delay`: a distant rank, a long round trip.
fn slow_proxy(
    proxy: &TcpListener,
    to: SocketAddr,
    source: IpAddr,
    delay: Duration,
    done: &std::sync::atomic::AtomicBool,
) {
    use std::sync::atomic::Ordering;
    proxy.set_nonblocking(true).unwrap();
    std::thread::scope(|s| {
        while !done.load(Ordering::Relaxed) {
            let Ok((mut client, _)) = proxy.accept() else {
                std::thread::sleep(Duration::from_millis(2));
                continue;
            };
            client.set_nonblocking(false).unwrap();
            let Ok(mut server) = connect_from(Some(source), &to, Duration::from_secs(2)) else {
                continue;
            };
            let (mut c2, mut s2) = (client.try_clone().unwrap(), server.try_clone().unwrap());
            for c in [&client, &server, &c2, &s2] {
                c.set_read_timeout(Some(Duration::from_millis(100)))
                    .unwrap();
            }
            s.spawn(move || {
                let mut buf = [0u8; 4096];
                let mut first = true;
                while !done.load(Ordering::Relaxed) {
                    match s2.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            if std::mem::take(&mut first) {
                                std::thread::sleep(delay);
                            }
                            if c2.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                        Err(_) => break,
                    }
                }
                let _ = c2.shutdown(std::net::Shutdown::Both);
            });
            s.spawn(move || {
                let mut buf = [0u8; 4096];
                while !done.load(Ordering::Relaxed) {
                    match client.read(&mut buf) {
                        Ok(0) => break,
                        Ok(n) => {
                            if server.write_all(&buf[..n]).is_err() {
                                break;
                            }
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
                        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => {}
                        Err(_) => break,
                    }
                }
                let _ = server.shutdown(std::net::Shutdown::Both);
            });
        }
    });
}

/// A flood of unauthenticated connections from one address (127.0.0.1): silent ones and (most) ones that greet as
/// rank 1 and never prove it, hundreds waiting at a time, new ones arriving far faster than the real rank 1's round
/// trip (it is distant: its connections pass a proxy that holds rank 0's answers back for 300 ms, and come from the
/// address rank 1 published, 127.0.0.2). Rank 0 makes room by dropping the flood's own connections, never the real
/// rank 1's: it joins within its connect timeout (which the flood outlasts), and the allreduce is right.
#[test]
fn a_flood_from_one_address_does_not_evict_the_real_rank() {
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let key = JobKey::new(b"the job token").unwrap();
    let ip = IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2));
    let flood_ip = IpAddr::V4(Ipv4Addr::LOCALHOST);
    let ls: Vec<TcpListener> = (0..2).map(|_| listen(ip).unwrap()).collect();
    let addrs: Vec<SocketAddr> = ls.iter().map(|l| l.local_addr().unwrap()).collect();
    let proxy = listen(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 3))).unwrap();
    let via = vec![proxy.local_addr().unwrap(), addrs[1]];
    // Bounded: at most this many connections in all, at most 400 a second per thread, for at most this long (past
    // the job's connect timeout).
    const FLOOD_MAX: usize = 12_000;
    const HELD_MAX: usize = 300;
    let flood_for = Duration::from_secs(14);
    let connect = Duration::from_secs(10);
    let done = AtomicBool::new(false);
    let proxy_done = AtomicBool::new(false);
    let opened = AtomicUsize::new(0);
    let wrong_source = AtomicBool::new(false);
    let sums = std::thread::scope(|s| {
        for t in 0..2u64 {
            let (done, opened, wrong_source, target) = (&done, &opened, &wrong_source, addrs[0]);
            s.spawn(move || {
                let start = std::time::Instant::now();
                let mut held = std::collections::VecDeque::new();
                let mut i = 0u64;
                while !done.load(Ordering::Relaxed)
                    && start.elapsed() < flood_for
                    && opened.fetch_add(1, Ordering::Relaxed) < FLOOD_MAX
                {
                    i += 1;
                    std::thread::sleep(Duration::from_micros(2500));
                    let Ok(mut c) = connect_from(Some(flood_ip), &target, Duration::from_secs(1))
                    else {
                        continue;
                    };
                    if c.local_addr().map(|a| a.ip()).ok() != Some(flood_ip) {
                        wrong_source.store(true, Ordering::Relaxed);
                    }
                    if !(i + t).is_multiple_of(4) {
                        let _ = c.write_all(&hello(1, 2, &[7; 32]));
                    }
                    held.push_back(c);
                    if held.len() > HELD_MAX {
                        held.pop_front();
                    }
                }
            });
        }
        s.spawn(|| {
            slow_proxy(
                &proxy,
                addrs[0],
                ip,
                Duration::from_millis(300),
                &proxy_done,
            )
        });
        let r0 = s.spawn(|| TcpTransport::connect(0, &ls[0], &addrs, &key, connect));
        let r1 = s.spawn(|| TcpTransport::connect(1, &ls[1], &via, &key, connect));
        let got = (r0.join().unwrap(), r1.join().unwrap());
        done.store(true, Ordering::Relaxed);
        // The allreduce passes the (slow) proxy too.
        let sums = match got {
            (Ok(t0), Ok(t1)) => Ok(allreduce_pair(t0, t1)),
            (r0, r1) => Err(format!("rank 0 {:?}, rank 1 {:?}", r0.err(), r1.err())),
        };
        proxy_done.store(true, Ordering::Relaxed);
        sums
    });
    assert!(
        !wrong_source.load(Ordering::Relaxed),
        "the flood must come from {flood_ip}"
    );
    match sums {
        Ok(sums) => {
            for (r, got) in sums.iter().enumerate() {
                assert!(got.iter().all(|v| *v == 3.0), "rank {r} got a wrong sum");
            }
        }
        Err(why) => panic!("the real rank 1 must join despite the flood: {why}"),
    }
}

/// A dialling rank's connection comes from the address it published (its listener's), not from whatever the kernel
/// would pick (for 127.0.0.1 that is 127.0.0.1): that is what lets the acceptor keep it apart from a flood.
#[test]
fn a_dialling_rank_connects_from_its_published_address() {
    let key = JobKey::new(b"the job token").unwrap();
    let fake0 = listen(IpAddr::V4(Ipv4Addr::LOCALHOST)).unwrap();
    let l1 = listen(IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2))).unwrap();
    let addrs = vec![fake0.local_addr().unwrap(), l1.local_addr().unwrap()];
    let from = std::thread::scope(|s| {
        let r1 = s.spawn(|| TcpTransport::connect(1, &l1, &addrs, &key, Duration::from_secs(2)));
        let (mut c, from) = fake0.accept().unwrap();
        let mut greeting = [0u8; HELLO_LEN];
        c.read_exact(&mut greeting).unwrap();
        assert_eq!(greeting[..16], frame(HELLO, 1)[..]);
        assert!(r1.join().unwrap().is_err(), "the fake rank 0 never answers");
        from
    });
    assert_eq!(from.ip(), IpAddr::V4(Ipv4Addr::new(127, 0, 0, 2)));
}
