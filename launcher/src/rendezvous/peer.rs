//! Which local user owns the other end of a TCP connection. The kernel gives `SO_PEERCRED` only for Unix sockets;
//! for TCP the peer's own socket is listed in `/proc/net/tcp` and `/proc/net/tcp6` (this network namespace's tables)
//! with its owner in the `uid` column, found by matching the connection's two addresses.

use std::io::BufRead;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

/// Socket states whose `uid` column is not the owner: TIME_WAIT (6) and NEW_SYN_RECV (12) are kernel mini-sockets
/// listed with uid 0, LISTEN (10) is never a connection's end.
const NOT_AN_OWNED_END: [u8; 3] = [0x06, 0x0A, 0x0C];

/// The uid owning the socket whose local address is `peer` and whose remote address is `server_side`, when that
/// socket lives on this machine in this network namespace. `None` for a peer on another machine, or one whose socket
/// is gone.
pub(crate) fn local_socket_owner(peer: SocketAddr, server_side: SocketAddr) -> Option<u32> {
    ["/proc/net/tcp", "/proc/net/tcp6"]
        .into_iter()
        .find_map(|table| find_in_table(table, peer, server_side))
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
        assert_eq!(peer, client.local_addr().unwrap());
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(
            local_socket_owner(peer, server.local_addr().unwrap()),
            Some(me)
        );
        // Ports that belong to no connection are not found.
        let nobody: SocketAddr = "127.0.0.1:1".parse().unwrap();
        assert_eq!(
            local_socket_owner(nobody, server.local_addr().unwrap()),
            None
        );
    }
}
