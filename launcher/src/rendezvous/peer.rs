//! Which local user owns the other end of a TCP connection, and whether an address is this machine's. The kernel
//! gives `SO_PEERCRED` only for Unix sockets; for TCP the peer's own socket is found by the connection's two addresses
//! (its local address is our peer address, its remote address our side) in this network namespace, and its owner read
//! from the kernel: first by an exact `sock_diag` netlink query (one hash lookup, like `ss` does), else from the `uid`
//! and `inode` columns of `/proc/net/tcp` and `/proc/net/tcp6`. The tables are only a fallback: generating them walks
//! every socket, TIME_WAIT ones included, which took 17 ms per request on a machine with 16 000 of them (measured
//! with the rendezvous bench).
//!
//! Only a socket that a process still holds says who owns the connection. A socket its process closed (an orphan in
//! FIN_WAIT, or a TIME_WAIT mini-socket) has no inode, and the kernel lists it with uid 0 (root's): read as an owner,
//! it would let anyone pass as root by closing before the server looked. Such entries, and sockets in states that
//! are no connection's end, count as not found.

use std::io::{self, BufRead};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::Duration;

/// TCP states (include/net/tcp_states.h) in which a socket is the live end of a connection: ESTABLISHED (1),
/// FIN_WAIT1 (4), FIN_WAIT2 (5), CLOSE_WAIT (8), LAST_ACK (9), CLOSING (11). Not SYN_SENT/SYN_RECV (not connected
/// yet), TIME_WAIT (6) and NEW_SYN_RECV (12) (kernel mini-sockets listed with uid 0), CLOSE (7), LISTEN (10).
const CONNECTED: [u8; 6] = [1, 4, 5, 8, 9, 11];
/// Our own end's states in which its addresses still name this connection (it was not reset or closed).
const OWN_END_CONNECTED: [u8; 2] = [1, 8];

/// What the kernel says about the peer's end of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PeerEnd {
    /// A socket on this machine that a process of this uid holds.
    Owned(u32),
    /// On this machine but nobody's: the peer's socket is listed but no process holds it (closed: an orphan, a
    /// FIN_WAIT2 or TIME_WAIT mini-socket), or the connection was reset before it could be looked up.
    Unowned,
    /// No socket in this network namespace has the peer's address while the connection is up: the peer is on
    /// another machine (or in another network namespace), or on this one only if its address says so.
    Elsewhere,
}

/// The peer's end of `stream`, a connection this server accepted. Call it right after accepting: a client's socket
/// exists, connected, at least until it has sent its request. Our own end's state is read after the lookup: while it
/// is still connected the two addresses named this connection when the peer's socket was looked up, and a peer
/// found nowhere was not reset; once it is not, nothing found can be trusted.
pub(crate) fn connection_peer(stream: &TcpStream) -> PeerEnd {
    let (Ok(peer), Ok(ours)) = (stream.peer_addr(), stream.local_addr()) else {
        return PeerEnd::Unowned;
    };
    let end = find_end(peer, ours);
    if !tcp_state(stream).is_some_and(|s| OWN_END_CONNECTED.contains(&s)) {
        return PeerEnd::Unowned;
    }
    match end {
        Some(end) if end.held() => PeerEnd::Owned(end.uid),
        Some(_) => PeerEnd::Unowned,
        None => PeerEnd::Elsewhere,
    }
}

/// The TCP state of our own socket (the first byte of `struct tcp_info`).
fn tcp_state(stream: &TcpStream) -> Option<u8> {
    let mut info = [0u8; 8];
    let mut len = info.len() as libc::socklen_t;
    // SAFETY: info is writable for len bytes; the kernel writes at most len bytes and updates len.
    let got = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            info.as_mut_ptr().cast(),
            &raw mut len,
        )
    };
    (got == 0 && len >= 1).then_some(info[0])
}

/// The socket the kernel lists in this network namespace whose own address is `peer` and whose remote address is
/// `server_side`, held or not (a held one when it is listed twice, as IPv4 and as IPv4-mapped IPv6).
fn find_end(peer: SocketAddr, server_side: SocketAddr) -> Option<SocketEnd> {
    match diag_find(peer, server_side) {
        Ok(found) => found,
        Err(e) => {
            tracing::debug!(error = %e, "sock_diag lookup failed; reading /proc/net/tcp instead");
            let mut found = None;
            for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
                match find_in_table(table, peer, server_side) {
                    Some(end) if end.held() => return Some(end),
                    Some(end) => found = found.or(Some(end)),
                    None => {}
                }
            }
            found
        }
    }
}

/// Whether `ip` is an address of this machine (in this network namespace): any loopback address (all of
/// 127.0.0.0/8, `::1`), or one the kernel delivers locally, asked fresh each time. The kernel's own answer is a route
/// lookup (`RTM_GETROUTE`, like `ip route get`: type `local`), which also knows local ranges that no interface
/// carries and costs one table lookup however many interfaces there are (15-19 us measured); when it cannot be
/// asked, the interfaces' addresses (`getifaddrs`, which lists them all: 62 us with 4 interfaces, more with hundreds
/// of veths). When neither works the answer is yes, so that a connection whose owner is unknown is refused rather
/// than trusted.
pub(crate) fn is_this_machine(ip: IpAddr) -> bool {
    let ip = canonical(ip);
    if ip.is_loopback() || ip.is_unspecified() {
        return true;
    }
    let routed = route_is_local(ip).or_else(|e| {
        tracing::debug!(error = %e, "route lookup failed; reading the interfaces' addresses instead");
        interface_addresses().map(|addresses| addresses.contains(&ip))
    });
    routed.unwrap_or_else(|e| {
        tracing::warn!(error = %e, "cannot tell whether {ip} is this machine's; treating it as one");
        true
    })
}

/// `RTM_GETROUTE`, `RTM_NEWROUTE`, `RTA_DST` and `RTN_LOCAL` from linux/rtnetlink.h.
const RTM_NEWROUTE: u16 = 24;
const RTM_GETROUTE: u16 = 26;
const RTA_DST: u16 = 1;
const RTN_LOCAL: u8 = 2;
/// Size of `struct rtmsg`, and the offset of `rtm_type` in it.
const RTMSG_LEN: usize = 12;
const RTMSG_TYPE: usize = 7;

/// Asks the kernel how it routes a packet to `ip`: true when it delivers it locally.
fn route_is_local(ip: IpAddr) -> io::Result<bool> {
    let socket = netlink_socket(libc::NETLINK_ROUTE)?;
    let (family, bytes): (u8, Vec<u8>) = match ip {
        IpAddr::V4(v4) => (libc::AF_INET as u8, v4.octets().to_vec()),
        IpAddr::V6(v6) => (libc::AF_INET6 as u8, v6.octets().to_vec()),
    };
    let attr_len = 4 + bytes.len();
    let total = NLMSG_HEADER + RTMSG_LEN + attr_len;
    let mut m = vec![0u8; total];
    m[0..4].copy_from_slice(&(total as u32).to_ne_bytes());
    m[4..6].copy_from_slice(&RTM_GETROUTE.to_ne_bytes());
    m[6..8].copy_from_slice(&(libc::NLM_F_REQUEST as u16).to_ne_bytes());
    m[8..12].copy_from_slice(&1u32.to_ne_bytes());
    let r = &mut m[NLMSG_HEADER..];
    r[0] = family;
    // rtm_dst_len: the whole address; everything else (tables, scope, type, flags) 0.
    r[1] = (bytes.len() * 8) as u8;
    let a = &mut r[RTMSG_LEN..];
    a[0..2].copy_from_slice(&(attr_len as u16).to_ne_bytes());
    a[2..4].copy_from_slice(&RTA_DST.to_ne_bytes());
    a[4..].copy_from_slice(&bytes);
    let answer = netlink_exchange(&socket, &m)?;
    parse_route_answer(&answer)
}

fn parse_route_answer(answer: &[u8]) -> io::Result<bool> {
    let malformed = || io::Error::other("malformed route answer");
    let kind = answer
        .get(4..6)
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        .ok_or_else(malformed)?;
    if kind == libc::NLMSG_ERROR as u16 {
        let errno = answer
            .get(NLMSG_HEADER..NLMSG_HEADER + 4)
            .map(|b| i32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
            .ok_or_else(malformed)?;
        return match -errno {
            // No route there (unreachable, prohibited): certainly not delivered here.
            libc::ENETUNREACH | libc::EHOSTUNREACH | libc::EACCES | libc::ENETDOWN => Ok(false),
            0 => Err(malformed()),
            e => Err(io::Error::from_raw_os_error(e)),
        };
    }
    if kind != RTM_NEWROUTE {
        return Err(malformed());
    }
    answer
        .get(NLMSG_HEADER + RTMSG_TYPE)
        .map(|t| *t == RTN_LOCAL)
        .ok_or_else(malformed)
}

/// Every address on this machine's interfaces (IPv4 and IPv6, any state).
fn interface_addresses() -> io::Result<Vec<IpAddr>> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: list is a valid out pointer; on success the kernel-built list is freed below.
    if unsafe { libc::getifaddrs(&raw mut list) } != 0 {
        return Err(io::Error::last_os_error());
    }
    let mut addresses = Vec::new();
    let mut next = list;
    while !next.is_null() {
        // SAFETY: next is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*next };
        next = ifa.ifa_next;
        if ifa.ifa_addr.is_null() {
            continue;
        }
        // SAFETY: ifa_addr points to a sockaddr whose family tells its real type and size.
        let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
        if family == libc::AF_INET {
            // SAFETY: an AF_INET address is a sockaddr_in.
            let v4 = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
            addresses.push(IpAddr::V4(Ipv4Addr::from(v4.sin_addr.s_addr.to_ne_bytes())));
        } else if family == libc::AF_INET6 {
            // SAFETY: an AF_INET6 address is a sockaddr_in6.
            let v6 = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
            addresses.push(canonical(IpAddr::V6(Ipv6Addr::from(v6.sin6_addr.s6_addr))));
        }
    }
    // SAFETY: list came from getifaddrs and is freed once; no reference into it outlives this call.
    unsafe { libc::freeifaddrs(list) };
    Ok(addresses)
}

/// `SOCK_DIAG_BY_FAMILY` from linux/sock_diag.h.
const SOCK_DIAG_BY_FAMILY: u16 = 20;
/// Sizes from linux/netlink.h and linux/inet_diag.h.
const NLMSG_HEADER: usize = 16;
const INET_DIAG_REQ_V2: usize = 56;
/// Offsets in `struct inet_diag_msg`: `idiag_state`, `idiag_uid` and `idiag_inode`.
const MSG_STATE: usize = 1;
const MSG_UID: usize = 64;
const MSG_INODE: usize = 68;
const MSG_LEN: usize = 72;

/// Asks the kernel for the one socket with these addresses: as an IPv4 socket, then as an IPv6 one (a dual-stack
/// client reaching an IPv4 server has an IPv6 socket with mapped addresses). `Err` when netlink cannot be used.
fn diag_find(peer: SocketAddr, server_side: SocketAddr) -> io::Result<Option<SocketEnd>> {
    let socket = diag_socket()?;
    let (p, s) = (canonical(peer.ip()), canonical(server_side.ip()));
    let mut tries: Vec<(u8, [u8; 16], [u8; 16])> = Vec::with_capacity(2);
    if let (IpAddr::V4(p4), IpAddr::V4(s4)) = (p, s) {
        tries.push((libc::AF_INET as u8, v4_bytes(p4), v4_bytes(s4)));
    }
    tries.push((libc::AF_INET6 as u8, v6_of(p).octets(), v6_of(s).octets()));
    let mut found = None;
    for (seq, (family, src, dst)) in tries.into_iter().enumerate() {
        let request = diag_request(
            seq as u32 + 1,
            family,
            src,
            peer.port(),
            dst,
            server_side.port(),
        );
        match diag_query(&socket, &request)? {
            Some(end) if end.held() => return Ok(Some(end)),
            Some(end) => found = found.or(Some(end)),
            None => {}
        }
    }
    Ok(found)
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
    netlink_socket(libc::NETLINK_SOCK_DIAG)
}

fn netlink_socket(protocol: i32) -> io::Result<OwnedFd> {
    // SAFETY: socket() has no memory preconditions; the result is checked before use.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            protocol,
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

/// What the kernel lists for one socket.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct SocketEnd {
    state: u8,
    uid: u32,
    inode: u32,
}

impl SocketEnd {
    /// A connection's end that a process holds: only then is `uid` its owner.
    fn held(&self) -> bool {
        CONNECTED.contains(&self.state) && self.inode != 0
    }
}

/// Sends one request and reads its answer: the socket, or `None` when the kernel has no such socket.
fn diag_query(socket: &OwnedFd, request: &[u8]) -> io::Result<Option<SocketEnd>> {
    parse_diag_answer(&netlink_exchange(socket, request)?)
}

/// Sends one netlink request to the kernel and returns its answer (the first 4 KiB of it; the fields read here are
/// at its start).
fn netlink_exchange(socket: &OwnedFd, request: &[u8]) -> io::Result<Vec<u8>> {
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
    let mut answer = vec![0u8; 4096];
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
    answer.truncate(got as usize);
    Ok(answer)
}

fn parse_diag_answer(answer: &[u8]) -> io::Result<Option<SocketEnd>> {
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
    Ok(Some(SocketEnd {
        state: answer[NLMSG_HEADER + MSG_STATE],
        uid: u32_at(NLMSG_HEADER + MSG_UID).ok_or_else(malformed)?,
        inode: u32_at(NLMSG_HEADER + MSG_INODE).ok_or_else(malformed)?,
    }))
}

fn find_in_table(path: &str, peer: SocketAddr, server_side: SocketAddr) -> Option<SocketEnd> {
    let file = std::fs::File::open(path).ok()?;
    // Read line by line and stop at a held match: under a flood of connections the table is long.
    let mut found = None;
    for line in std::io::BufReader::new(file).lines().skip(1) {
        let Ok(line) = line else { break };
        if let Some(entry) = parse_line(&line)
            && same(entry.local, peer)
            && same(entry.remote, server_side)
        {
            if entry.end.held() {
                return Some(entry.end);
            }
            found = found.or(Some(entry.end));
        }
    }
    found
}

struct Entry {
    local: SocketAddr,
    remote: SocketAddr,
    end: SocketEnd,
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
    let _timeout = fields.next()?;
    let inode = fields.next()?.parse().ok()?;
    Some(Entry {
        local,
        remote,
        end: SocketEnd { state, uid, inode },
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
        assert_eq!(
            e.end,
            SocketEnd {
                state: 1,
                uid: 1000,
                inode: 12345
            }
        );
        assert!(e.end.held());
        // TIME_WAIT and orphaned sockets are listed with uid 0 and no inode: nobody's.
        let tw = "   2: 0100007F:1F90 0200007F:C351 06 00000000:00000000 03:00000F9C 00000000     0        0 0 3";
        assert!(!parse_line(tw).unwrap().end.held());
        let orphan = "   3: 0100007F:1F90 0200007F:C352 05 00000000:00000000 00:00000000 00000000     0        0 0 1";
        assert!(!parse_line(orphan).unwrap().end.held());
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
        assert_eq!(connection_peer(&server), PeerEnd::Owned(me));
        // Both ways of looking agree.
        let end = diag_find(peer, ours).unwrap().unwrap();
        assert!(end.held() && end.uid == me, "{end:?}");
        let tables = ["/proc/net/tcp", "/proc/net/tcp6"]
            .into_iter()
            .find_map(|t| find_in_table(t, peer, ours));
        assert_eq!(tables, Some(end));
        // Ports that belong to no connection are not found.
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(diag_find(nobody, ours).unwrap(), None);
        assert_eq!(find_end(nobody, ours), None);
        drop(client);
        // IPv6, where the machine has it.
        if let Ok(listener) = TcpListener::bind("[::1]:0") {
            let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
            let (server, peer) = listener.accept().unwrap();
            let end = diag_find(peer, server.local_addr().unwrap()).unwrap();
            assert!(end.is_some_and(|e| e.held() && e.uid == me), "{end:?}");
            assert_eq!(connection_peer(&server), PeerEnd::Owned(me));
            drop(client);
        }
    }

    /// A client end closed by its process (an orphan, later a FIN_WAIT2 mini-socket listed with uid 0 and no inode) or
    /// reset has no owner; one only shut for writing is still held and keeps its owner.
    #[test]
    fn closed_or_reset_ends_have_no_owner() {
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let accept = || {
            let (server, peer) = listener.accept().unwrap();
            let ours = server.local_addr().unwrap();
            (server, peer, ours)
        };
        // Half-closed by a process that still holds it: FIN_WAIT2 with an inode.
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, peer, ours) = accept();
        client.shutdown(std::net::Shutdown::Write).unwrap();
        wait_for(|| tcp_state(&server) == Some(8));
        assert_eq!(connection_peer(&server), PeerEnd::Owned(me));
        // Closed after its FIN was acknowledged: the client's end becomes a FIN_WAIT2 mini-socket that the kernel
        // lists with uid 0 (root's, the job's uid when the launcher runs as root) and no inode: nobody's.
        drop(client);
        wait_for(|| raw_end(peer, ours).is_some_and(|e| e.state == 5 && e.inode == 0));
        assert_eq!(
            raw_end(peer, ours),
            Some(SocketEnd {
                state: 5,
                uid: 0,
                inode: 0
            })
        );
        assert_eq!(connection_peer(&server), PeerEnd::Unowned);
        drop(server);
        // Closed at once, before anything was acknowledged: an orphan in FIN_WAIT1, also without an inode.
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, peer, ours) = accept();
        drop(client);
        let orphan = raw_end(peer, ours);
        assert!(
            orphan.is_some_and(|e| e.inode == 0 && !e.held()),
            "{orphan:?}"
        );
        assert_eq!(connection_peer(&server), PeerEnd::Unowned);
        drop(server);
        // Reset (SO_LINGER 0): the client's socket is gone and our end is closed.
        let client = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (server, peer, ours) = accept();
        reset(client);
        wait_for(|| tcp_state(&server) == Some(7));
        assert_eq!(raw_end(peer, ours), None);
        assert_eq!(connection_peer(&server), PeerEnd::Unowned);
    }

    /// The socket the kernel lists for these addresses, held or not.
    fn raw_end(peer: SocketAddr, ours: SocketAddr) -> Option<SocketEnd> {
        let socket = diag_socket().unwrap();
        let request = diag_request(
            1,
            libc::AF_INET as u8,
            v4_bytes(match peer.ip() {
                IpAddr::V4(v4) => v4,
                IpAddr::V6(_) => unreachable!("an IPv4 test"),
            }),
            peer.port(),
            v4_bytes(match ours.ip() {
                IpAddr::V4(v4) => v4,
                IpAddr::V6(_) => unreachable!("an IPv4 test"),
            }),
            ours.port(),
        );
        diag_query(&socket, &request).unwrap()
    }

    /// Closes `stream` with a reset instead of a FIN.
    fn reset(stream: TcpStream) {
        let linger = libc::linger {
            l_onoff: 1,
            l_linger: 0,
        };
        // SAFETY: linger is a valid struct linger for the length given.
        let set = unsafe {
            libc::setsockopt(
                stream.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_LINGER,
                (&raw const linger).cast(),
                std::mem::size_of::<libc::linger>() as libc::socklen_t,
            )
        };
        assert_eq!(set, 0);
        drop(stream);
    }

    fn wait_for(done: impl Fn() -> bool) {
        let until = std::time::Instant::now() + Duration::from_secs(30);
        while !done() {
            assert!(std::time::Instant::now() < until, "condition never held");
            std::thread::sleep(Duration::from_millis(2));
        }
    }

    #[test]
    fn this_machines_addresses() {
        let interfaces = interface_addresses().unwrap();
        assert!(
            interfaces.contains(&IpAddr::from([127, 0, 0, 1])),
            "{interfaces:?}"
        );
        for ip in &interfaces {
            assert!(is_this_machine(*ip), "{ip}");
        }
        // All of 127/8 is this machine, also as IPv4-mapped IPv6.
        for ip in ["127.0.0.2", "127.255.0.9", "::1", "::ffff:127.0.0.3"] {
            assert!(is_this_machine(ip.parse().unwrap()), "{ip}");
        }
        // Documentation addresses (TEST-NET-3, 2001:db8::/32) are on no interface here.
        for ip in ["203.0.113.77", "2001:db8::77", "::ffff:203.0.113.77"] {
            assert!(!is_this_machine(ip.parse().unwrap()), "{ip}");
        }
        // The kernel's route lookup and the interface list agree on every interface address and on those.
        for ip in &interfaces {
            assert!(route_is_local(*ip).unwrap(), "{ip}");
        }
        for ip in ["127.0.0.1", "127.0.0.2", "::1"] {
            assert!(route_is_local(ip.parse().unwrap()).unwrap(), "{ip}");
        }
        for ip in ["203.0.113.77", "2001:db8::77"] {
            assert!(!route_is_local(ip.parse().unwrap()).unwrap(), "{ip}");
        }
        assert!(parse_route_answer(b"").is_err());
        let mut unreachable = [0u8; 20];
        unreachable[4..6].copy_from_slice(&(libc::NLMSG_ERROR as u16).to_ne_bytes());
        unreachable[16..20].copy_from_slice(&(-libc::ENETUNREACH).to_ne_bytes());
        assert!(!parse_route_answer(&unreachable).unwrap());
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
