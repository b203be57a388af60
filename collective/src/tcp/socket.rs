//! The sockets under the tcp transport: listening, connecting from the address this rank published, and finding
//! a network interface's address.

use std::io;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Binds a listener on `ip` (port chosen by the kernel) for [`TcpTransport::connect`](super::TcpTransport::connect).
pub fn listen(ip: IpAddr) -> Result<TcpListener> {
    TcpListener::bind((ip, 0)).map_err(|e| Error::io(format!("listen on `{ip}`"), e))
}

/// Connects to `to` from `source` (the port chosen by the kernel), so that the peer sees the address this rank
/// published; from whatever address the kernel picks when `source` cannot be bound (unspecified, another family,
/// loopback towards a remote peer).
pub fn connect_from(
    source: Option<IpAddr>,
    to: &SocketAddr,
    timeout: Duration,
) -> io::Result<TcpStream> {
    let usable = source.filter(|s| {
        !s.is_unspecified()
            && s.is_ipv4() == to.is_ipv4()
            && s.is_loopback() == to.ip().is_loopback()
    });
    let Some(fd) = usable.and_then(|s| bound_socket(s).ok()) else {
        return TcpStream::connect_timeout(to, timeout);
    };
    let (sa, len) = sockaddr(*to);
    // SAFETY: `sa` holds a socket address of `len` bytes; `fd` is an open socket.
    if unsafe { libc::connect(fd.as_raw_fd(), (&raw const sa).cast(), len) } != 0 {
        let e = io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EINPROGRESS) {
            return Err(e);
        }
        let deadline = crate::time::saturating_add(Instant::now(), timeout);
        loop {
            let mut pfd = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLOUT,
                revents: 0,
            };
            let ms = deadline
                .saturating_duration_since(Instant::now())
                .as_millis()
                .min(i32::MAX as u128) as i32;
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r > 0 {
                break;
            }
            let e = io::Error::last_os_error();
            if r < 0 && e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            if r < 0 {
                return Err(e);
            }
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "connection timed out",
            ));
        }
    }
    let stream = TcpStream::from(fd);
    if let Some(e) = stream.take_error()? {
        return Err(e);
    }
    stream.set_nonblocking(false)?;
    Ok(stream)
}

/// A non-blocking TCP socket bound to `ip` (any port).
fn bound_socket(ip: IpAddr) -> io::Result<OwnedFd> {
    let family = if ip.is_ipv4() {
        libc::AF_INET
    } else {
        libc::AF_INET6
    };
    // SAFETY: plain socket(2) call.
    let raw = unsafe {
        libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK,
            0,
        )
    };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `raw` is a fresh descriptor owned by nothing else.
    let fd = unsafe { OwnedFd::from_raw_fd(raw) };
    // The port is chosen at connect, per destination, not at bind (saves ephemeral ports); best effort.
    let on: libc::c_int = 1;
    // SAFETY: `on` is a c_int of the given size; the option only changes when the port is chosen.
    unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::IPPROTO_IP,
            libc::IP_BIND_ADDRESS_NO_PORT,
            (&raw const on).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    let (sa, len) = sockaddr(SocketAddr::new(ip, 0));
    // SAFETY: `sa` holds a socket address of `len` bytes.
    if unsafe { libc::bind(fd.as_raw_fd(), (&raw const sa).cast(), len) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(fd)
}

/// `a` as a C socket address and its length.
fn sockaddr(a: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain data; all zeros is a valid (empty) value.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match a {
        SocketAddr::V4(v4) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: v4.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from(*v4.ip()).to_be(),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is large and aligned enough for any socket address.
            unsafe { std::ptr::write((&raw mut ss).cast::<libc::sockaddr_in>(), sin) };
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(v6) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: v6.port().to_be(),
                sin6_flowinfo: v6.flowinfo(),
                sin6_addr: libc::in6_addr {
                    s6_addr: v6.ip().octets(),
                },
                sin6_scope_id: v6.scope_id(),
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&raw mut ss).cast::<libc::sockaddr_in6>(), sin6) };
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

/// The first IPv4 (else IPv6) address of network interface `name`.
pub fn interface_address(name: &str) -> Result<IpAddr> {
    let mut list: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs writes a list head into `list`, freed below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut list) } != 0 {
        return Err(Error::io(
            "list network interfaces",
            io::Error::last_os_error(),
        ));
    }
    let mut found: Vec<IpAddr> = Vec::new();
    let mut names: Vec<String> = Vec::new();
    let mut cur = list;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list returned by getifaddrs, alive until freeifaddrs.
        let ifa = unsafe { &*cur };
        // SAFETY: ifa_name is a NUL-terminated string owned by the list.
        let ifname = unsafe { std::ffi::CStr::from_ptr(ifa.ifa_name) }
            .to_string_lossy()
            .into_owned();
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points at a sockaddr whose family says which struct it is.
            let family = i32::from(unsafe { (*ifa.ifa_addr).sa_family });
            if ifname == name && family == libc::AF_INET {
                // SAFETY: the family is AF_INET, so this is a sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                found.insert(
                    0,
                    IpAddr::from(u32::from_be(sin.sin_addr.s_addr).to_be_bytes()),
                );
            } else if ifname == name && family == libc::AF_INET6 {
                // SAFETY: the family is AF_INET6, so this is a sockaddr_in6.
                let sin6 = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in6) };
                found.push(IpAddr::from(sin6.sin6_addr.s6_addr));
            }
        }
        if !names.contains(&ifname) {
            names.push(ifname);
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `list` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(list) };
    found.first().copied().ok_or_else(|| {
        Error::Bootstrap(format!(
            "network interface `{name}` has no address (interfaces: {})",
            names.join(", ")
        ))
    })
}
