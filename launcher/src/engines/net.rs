//! Addresses the engines bind and connect to: a host's address, the local address whose route reaches a peer, and
//! an interface's IPv4 address (the ssh and spark engines' rendezvous).

use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs, UdpSocket};

use crate::LaunchError;

/// The address of host name `name` (an IP address as is), IPv4 preferred, from the system resolver.
pub fn resolve_host(name: &str) -> Result<IpAddr, LaunchError> {
    if let Ok(ip) = name.parse::<IpAddr>() {
        return Ok(ip);
    }
    let addrs: Vec<SocketAddr> = (name, 22)
        .to_socket_addrs()
        .map_err(|e| LaunchError::Engine(format!("cannot resolve host `{name}`: {e}")))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .map(SocketAddr::ip)
        .ok_or_else(|| LaunchError::Engine(format!("host `{name}` has no address")))
}

/// The local address whose route reaches `peer` (a UDP socket's connect sends nothing).
pub fn route_source(peer: IpAddr) -> Result<IpAddr, LaunchError> {
    if peer.is_loopback() {
        return Ok(IpAddr::V4(Ipv4Addr::LOCALHOST));
    }
    let bind: SocketAddr = match peer {
        IpAddr::V4(_) => (Ipv4Addr::UNSPECIFIED, 0).into(),
        IpAddr::V6(_) => (std::net::Ipv6Addr::UNSPECIFIED, 0).into(),
    };
    let no_route = |e: std::io::Error| {
        LaunchError::Engine(format!(
            "no route from this machine to {peer} ({e}): check this machine's network (the ssh and spark engines \
             can be given the interface with `--network-interface`)"
        ))
    };
    let socket = UdpSocket::bind(bind).map_err(no_route)?;
    socket.connect((peer, 9)).map_err(no_route)?;
    Ok(socket.local_addr().map_err(no_route)?.ip())
}

/// The IPv4 address of network interface `name`, found as the workers' bootstrap finds it
/// ([`hvd_collective::tcp::interface_address`]).
pub fn interface_ipv4(name: &str) -> Result<IpAddr, LaunchError> {
    let interface = |source| LaunchError::Interface {
        name: name.to_owned(),
        source,
    };
    match hvd_collective::tcp::interface_address(name).map_err(interface)? {
        ip @ IpAddr::V4(_) => Ok(ip),
        IpAddr::V6(_) => Err(LaunchError::Engine(format!(
            "network interface `{name}` has no IPv4 address on this machine"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn route_source_finds_loopback() {
        assert_eq!(
            route_source("127.0.0.1".parse().unwrap()).unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert_eq!(
            interface_ipv4("lo").unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        assert!(interface_ipv4("no-such-if0").is_err());
    }

    #[test]
    fn interfaces_are_found_by_name_and_a_missing_one_is_named() {
        assert_eq!(
            interface_ipv4("lo").unwrap(),
            IpAddr::V4(Ipv4Addr::LOCALHOST)
        );
        let err = interface_ipv4("hvd-no-such-if").unwrap_err();
        assert!(err.to_string().contains("`hvd-no-such-if`"), "{err}");
        let cause = std::error::Error::source(&err).map(ToString::to_string);
        assert!(
            cause.is_some_and(|c| c.contains("interfaces: ") && c.contains("lo")),
            "{err:?}"
        );
    }
}
