//! `accept4(2)`.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use io_uring::{opcode, types};

use super::{cvt, sealed, Operation};
use crate::driver::shared_fd::SharedFd;
use crate::driver::Interest;

/// Accepts one connection on a listening socket.
pub struct Accept {
    fd: SharedFd,
    /// Written by the kernel: boxed so it does not move with the op.
    addr: Box<(libc::sockaddr_storage, libc::socklen_t)>,
    /// Extra `SOCK_*` flags for the accepted socket.
    flags: i32,
}

impl Accept {
    pub(crate) fn new(fd: SharedFd, nonblocking: bool) -> Self {
        // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
        let storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        let len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
        let flags = libc::SOCK_CLOEXEC | if nonblocking { libc::SOCK_NONBLOCK } else { 0 };
        Accept {
            fd,
            addr: Box::new((storage, len)),
            flags,
        }
    }
}

impl sealed::Sealed for Accept {}

impl Operation for Accept {
    type Output = io::Result<(OwnedFd, SocketAddr)>;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        let (storage, len) = &mut *self.addr;
        opcode::Accept::new(
            types::Fd(self.fd.raw()),
            (storage as *mut libc::sockaddr_storage).cast(),
            len,
        )
        .flags(self.flags)
        .build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        let fd = res? as RawFd;
        // SAFETY: the kernel returned a fresh descriptor that we now own.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        let addr = sockaddr_to_std(&self.addr.0)?;
        Ok((fd, addr))
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        Some((self.fd.raw(), Interest::Read))
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        let (storage, len) = &mut *self.addr;
        // SAFETY: storage and len are live, writable and correctly sized.
        cvt(unsafe {
            libc::accept4(
                self.fd.raw(),
                (storage as *mut libc::sockaddr_storage).cast(),
                len,
                self.flags,
            )
        } as isize)
    }

    fn parked_cqe(&mut self, res: i32, _flags: u32) {
        if res >= 0 {
            // Nobody waits for this connection any more: close it.
            // SAFETY: the kernel handed us this fd and nothing else owns it.
            drop(unsafe { OwnedFd::from_raw_fd(res) });
        }
    }
}

/// Converts a kernel socket address to `std`'s.
pub(crate) fn sockaddr_to_std(s: &libc::sockaddr_storage) -> io::Result<SocketAddr> {
    match s.ss_family as i32 {
        libc::AF_INET => {
            // SAFETY: the family says this storage holds a sockaddr_in.
            let a: &libc::sockaddr_in = unsafe { &*(s as *const _ as *const libc::sockaddr_in) };
            let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
            Ok(SocketAddr::from((ip, u16::from_be(a.sin_port))))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says this storage holds a sockaddr_in6.
            let a: &libc::sockaddr_in6 = unsafe { &*(s as *const _ as *const libc::sockaddr_in6) };
            let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
            Ok(SocketAddr::V6(std::net::SocketAddrV6::new(
                ip,
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        f => Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("unexpected address family {f}"),
        )),
    }
}

/// Converts `std`'s socket address to the kernel's.
pub(crate) fn std_to_sockaddr(addr: &SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: sockaddr_storage is plain old data; all-zero is valid.
    let mut s: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin = unsafe { &mut *(&mut s as *mut _ as *mut libc::sockaddr_in) };
            sin.sin_family = libc::AF_INET as libc::sa_family_t;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from(*a.ip()).to_be();
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut s as *mut _ as *mut libc::sockaddr_in6) };
            sin6.sin6_family = libc::AF_INET6 as libc::sa_family_t;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_flowinfo = a.flowinfo();
            sin6.sin6_scope_id = a.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (s, len as libc::socklen_t)
}
