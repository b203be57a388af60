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
            "no route from this machine to {peer} ({e}): choose the interface with `--network-interface`"
        ))
    };
    let socket = UdpSocket::bind(bind).map_err(no_route)?;
    socket.connect((peer, 9)).map_err(no_route)?;
    Ok(socket.local_addr().map_err(no_route)?.ip())
}

/// The IPv4 address of network interface `name` on this machine.
pub fn interface_ipv4(name: &str) -> Result<IpAddr, LaunchError> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `list`, freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(LaunchError::Io {
            path: "getifaddrs".into(),
            source: std::io::Error::last_os_error(),
        });
    }
    let mut found = None;
    let mut names: Vec<String> = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list returned by getifaddrs, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let ifname = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        let family = if ifa.ifa_addr.is_null() {
            None
        } else {
            // SAFETY: ifa_addr is not null: it points at a sockaddr whose family says which struct it is.
            Some(i32::from(unsafe { (*ifa.ifa_addr).sa_family }))
        };
        if found.is_none() && ifname == name && family == Some(libc::AF_INET) {
            // SAFETY: the family is AF_INET, so this is a sockaddr_in.
            let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
            found = Some(IpAddr::from(
                u32::from_be(sin.sin_addr.s_addr).to_be_bytes(),
            ));
        }
        if !names.contains(&ifname) {
            names.push(ifname);
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    found.ok_or_else(|| {
        LaunchError::Engine(format!(
            "network interface `{name}` has no IPv4 address on this machine (interfaces: {})",
            names.join(", ")
        ))
    })
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
}
