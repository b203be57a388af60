//! Which local user owns the other end of a TCP connection. The kernel gives `SO_PEERCRED` only for Unix sockets;
//! for TCP the peer's own socket is found by the connection's two addresses (its local address is our peer address,
//! its remote address our side) in this network namespace, and its owner read from the kernel: first by an exact
//! `sock_diag` netlink query (one hash lookup, like `ss` does), else from the `uid` column of `/proc/net/tcp` and
//! `/proc/net/tcp6`. The tables are only a fallback: generating them walks every socket, TIME_WAIT ones included,
//! which took 17 ms per request on a machine with 16 000 of them (measured with the rendezvous bench).

use std::io::{self, BufRead};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// Socket states whose `uid` is not the owner: TIME_WAIT (6) and NEW_SYN_RECV (12) are kernel mini-sockets listed
/// with uid 0, LISTEN (10) is never a connection's end.
const NOT_AN_OWNED_END: [u8; 3] = [0x06, 0x0A, 0x0C];

/// The uid owning the socket whose local address is `peer` and whose remote address is `server_side`, when that
/// socket lives on this machine in this network namespace. `None` for a peer on another machine, or one whose socket
/// is gone.
pub(crate) fn local_socket_owner(peer: SocketAddr, server_side: SocketAddr) -> Option<u32> {
    match diag_owner(peer, server_side) {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(error = %e, "sock_diag lookup failed; reading /proc/net/tcp instead");
            ["/proc/net/tcp", "/proc/net/tcp6"]
                .into_iter()
                .find_map(|table| find_in_table(table, peer, server_side))
        }
    }
}

/// `SOCK_DIAG_BY_FAMILY` from linux/sock_diag.h.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// Sizes from linux/netlink.h and linux/inet_diag.h.
const NLMSG_HEADER: usize = 16;
const INET_DIAG_REQ_V2: usize = 56;
/// Offsets in `struct inet_diag_msg`: `idiag_state` and `idiag_uid`.
const MSG_STATE: usize = 1;
const MSG_UID: usize = 64;
const MSG_LEN: usize = 72;

/// Asks the kernel for the one socket with these addresses: as an IPv4 socket, then as an IPv6 one (a dual-stack
/// client reaching an IPv4 server has an IPv6 socket with mapped addresses). `Err` when netlink cannot be used.
fn diag_owner(peer: SocketAddr, server_side: SocketAddr) -> io::Result<Option<u32>> {
    let socket = diag_socket()?;
    let (p, s) = (canonical(peer.ip()), canonical(server_side.ip()));
    let mut tries: Vec<(u8, [u8; 16], [u8; 16])> = Vec::with_capacity(2);
    if let (IpAddr::V4(p4), IpAddr::V4(s4)) = (p, s) {
        tries.push((libc::AF_INET as u8, v4_bytes(p4), v4_bytes(s4)));
    }
    tries.push((libc::AF_INET6 as u8, v6_of(p).octets(), v6_of(s).octets()));
    for (seq, (family, src, dst)) in tries.into_iter().enumerate() {
        let request = diag_request(
            seq as u32 + 1,
            family,
            src,
            peer.port(),
            dst,
            server_side.port(),
        );
        if let Some((state, uid)) = diag_query(&socket, &request)?
            && !NOT_AN_OWNED_END.contains(&state)
        {
            return Ok(Some(uid));
        }
    }
    Ok(None)
}

fn v4_bytes(ip: Ipv4Addr) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..4].copy_from_slice(&ip.octets());
    b
}

fn v6_of(ip: IpAddr) -> Ipv6Addr {
    match ip {
        IpAddr::V4(v4) => v4.to_ipv6_mapped(),
        IpAddr::V6(v6) => v6,
    }
}

fn diag_socket() -> io::Result<OwnedFd> {
    // SAFETY: socket() has no memory preconditions; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            libc::NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor this function owns.
    let socket = unsafe { OwnedFd::from_raw_fd(fd) };
    // The kernel answers at once; the timeout only guards against a kernel that never does.
    let timeout = Duration::from_secs(2);
    let tv = libc::timeval {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_usec: 0,
    };
    // SAFETY: tv is a valid timeval for the length given.
    let set = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&raw const tv).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if set != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(socket)
}

/// `nlmsghdr` + `inet_diag_req_v2` for an exact lookup (no dump flag): the socket whose own address is `src:sport`
/// and whose remote address is `dst:dport`.
fn diag_request(
    seq: u32,
    family: u8,
    src: [u8; 16],
    sport: u16,
    dst: [u8; 16],
    dport: u16,
) -> [u8; NLMSG_HEADER + INET_DIAG_REQ_V2] {
    let mut m = [0u8; NLMSG_HEADER + INET_DIAG_REQ_V2];
    m[0..4].copy_from_slice(&((NLMSG_HEADER + INET_DIAG_REQ_V2) as u32).to_ne_bytes());
    m[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    m[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    m[8..12].copy_from_slice(&seq.to_ne_bytes());
    let r = &mut m[NLMSG_HEADER..];
    r[0] = family;
    r[1] = libc::IPPROTO_TCP as u8;
    // r[2] idiag_ext, r[3] pad: 0. idiag_states: every state.
    r[4..8].copy_from_slice(&u32::MAX.to_ne_bytes());
    // struct inet_diag_sockid: ports and addresses in network byte order, interface 0, no cookie.
    r[8..10].copy_from_slice(&sport.to_be_bytes());
    r[10..12].copy_from_slice(&dport.to_be_bytes());
    r[12..28].copy_from_slice(&src);
    r[28..44].copy_from_slice(&dst);
    r[48..56].copy_from_slice(&[0xff; 8]);
    m
}

/// Sends one request and reads its answer: the socket's (state, uid), or `None` when the kernel has no such socket.
fn diag_query(socket: &OwnedFd, request: &[u8]) -> io::Result<Option<(u8, u32)>> {
    // SAFETY: an all-zero sockaddr_nl is valid; family set below; pid 0 addresses the kernel.
    let mut kernel: libc::sockaddr_nl = unsafe { std::mem::zeroed() };
    kernel.nl_family = libc::AF_NETLINK as libc::sa_family_t;
    // SAFETY: request and kernel are valid for the lengths given.
    let sent = unsafe {
        libc::sendto(
            socket.as_raw_fd(),
            request.as_ptr().cast(),
            request.len(),
            0,
            (&raw const kernel).cast(),
            std::mem::size_of::<libc::sockaddr_nl>() as libc::socklen_t,
        )
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut answer = [0u8; 1024];
    // SAFETY: answer is writable for its length.
    let got = unsafe {
        libc::recv(
            socket.as_raw_fd(),
            answer.as_mut_ptr().cast(),
            answer.len(),
            0,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    parse_diag_answer(&answer[..got as usize])
}

fn parse_diag_answer(answer: &[u8]) -> io::Result<Option<(u8, u32)>> {
    let malformed = || io::Error::other("malformed sock_diag answer");
    let u32_at = |at: usize| -> Option<u32> {
        Some(u32::from_ne_bytes(answer.get(at..at + 4)?.try_into().ok()?))
    };
    let kind = answer
        .get(4..6)
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        .ok_or_else(malformed)?;
    if kind == libc::NLMSG_ERROR as u16 {
        let errno = u32_at(NLMSG_HEADER).ok_or_else(malformed)? as i32;
        return match -errno {
            libc::ENOENT => Ok(None),
            0 => Err(malformed()),
            e => Err(io::Error::from_raw_os_error(e)),
        };
    }
    if kind != SOCK_DIAG_BY_FAMILY || answer.len() < NLMSG_HEADER + MSG_LEN {
        return Err(malformed());
    }
    let state = answer[NLMSG_HEADER + MSG_STATE];
    let uid = u32_at(NLMSG_HEADER + MSG_UID).ok_or_else(malformed)?;
    Ok(Some((state, uid)))
}

fn find_in_table(path: &str, peer: SocketAddr, server_side: SocketAddr) -> Option<u32> {
    let file = std::fs::File::open(path).ok()?;
    // Read line by line and stop at the match: under a flood of connections the table is long.
    for line in std::io::BufReader::new(file).lines().skip(1) {
        let line = line.ok()?;
        if let Some(entry) = parse_line(&line)
            && same(entry.local, peer)
            && same(entry.remote, server_side)
            && !NOT_AN_OWNED_END.contains(&entry.state)
        {
            return Some(entry.uid);
        }
    }
    None
}

struct Entry {
    local: SocketAddr,
    remote: SocketAddr,
    state: u8,
    uid: u32,
}

/// One line: `sl local_address rem_address st tx_queue:rx_queue tr:tm->when retrnsmt uid timeout inode ...`.
fn parse_line(line: &str) -> Option<Entry> {
    let mut fields = line.split_whitespace();
    let _slot = fields.next()?;
    let local = parse_address(fields.next()?)?;
    let remote = parse_address(fields.next()?)?;
    let state = u8::from_str_radix(fields.next()?, 16).ok()?;
    let _queues = fields.next()?;
    let _timer = fields.next()?;
    let _retransmits = fields.next()?;
    let uid = fields.next()?.parse().ok()?;
    Some(Entry {
        local,
        remote,
        state,
        uid,
    })
}

/// `0100007F:1F90` (IPv4) or 32 hex digits `:port` (IPv6): the address as 32-bit words printed in host byte order.
fn parse_address(field: &str) -> Option<SocketAddr> {
    let (ip, port) = field.split_once(':')?;
    if !ip.is_ascii() {
        return None;
    }
    let port = u16::from_str_radix(port, 16).ok()?;
    let word = |i: usize| -> Option<[u8; 4]> {
        Some(
            u32::from_str_radix(ip.get(i * 8..i * 8 + 8)?, 16)
                .ok()?
                .to_ne_bytes(),
        )
    };
    let ip = match ip.len() {
        8 => IpAddr::V4(Ipv4Addr::from(word(0)?)),
        32 => {
            let mut bytes = [0u8; 16];
            for i in 0..4 {
                bytes[i * 4..i * 4 + 4].copy_from_slice(&word(i)?);
            }
            IpAddr::V6(Ipv6Addr::from(bytes))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

/// Equal addresses, an IPv4-mapped IPv6 address being equal to its IPv4 form.
fn same(a: SocketAddr, b: SocketAddr) -> bool {
    a.port() == b.port() && canonical(a.ip()) == canonical(b.ip())
}

/// IPv4-mapped IPv6 addresses compare equal to their IPv4 form.
pub(crate) fn canonical(ip: IpAddr) -> IpAddr {
    match ip {
        IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(IpAddr::V6(v6), IpAddr::V4),
        v4 => v4,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{TcpListener, TcpStream};

    #[test]
    fn parses_the_kernel_format() {
        let v4 = "   1: 0100007F:1F90 0200007F:C350 01 00000000:00000000 00:00000000 00000000  1000        0 12345 1";
        let e = parse_line(v4).unwrap();
        if cfg!(target_endian = "little") {
            assert_eq!(e.local, "127.0.0.1:8080".parse().unwrap());
            assert_eq!(e.remote, "127.0.0.2:50000".parse().unwrap());
        }
        assert_eq!((e.state, e.uid), (1, 1000));
        assert!(parse_line("garbage").is_none());
        assert!(parse_address("0100007Ä:1F90").is_none());
        assert!(parse_address("0100007:1F90").is_none());
    }

    #[test]
    fn finds_the_owner_of_a_loopback_connection() {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, peer) = listener.accept().unwrap();
        let ours = server.local_addr().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(local_socket_owner(peer, ours), Some(me));
        // Both ways of looking agree.
        assert_eq!(diag_owner(peer, ours).unwrap(), Some(me));
        let tables = ["/proc/net/tcp", "/proc/net/tcp6"]
            .into_iter()
            .find_map(|t| find_in_table(t, peer, ours));
        assert_eq!(tables, Some(me));
        // Ports that belong to no connection are not found.
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(diag_owner(nobody, ours).unwrap(), None);
        assert_eq!(local_socket_owner(nobody, ours), None);
        drop(client);
        // IPv6, where the machine has it.
        if let Ok(listener) = TcpListener::bind("[::1]:0") {
            let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (server, peer) = listener.accept().unwrap();
            assert_eq!(
                diag_owner(peer, server.local_addr().unwrap()).unwrap(),
                Some(me)
            );
            drop(client);
        }
    }

    #[test]
    fn netlink_answers_are_checked() {
        assert!(parse_diag_answer(b"short").is_err());
        let mut enoent = [0u8; 20];
        enoent[4..6].copy_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        enoent[16..20].copy_from_slice(&(-libc::ENOENT).to_ne_bytes());
        assert_eq!(parse_diag_answer(&enoent).unwrap(), None);
        let mut truncated = [0u8; 40];
        truncated[4..6].copy_from_slice(&SOCK_DIAG_BY_FAMILY.to_ne_bytes());
        assert!(parse_diag_answer(&truncated).is_err());
    }
}
