//! `connect(2)`.

use std::io;
use std::net::SocketAddr;
use std::os::fd::RawFd;

use io_uring::{opcode, types};

use super::accept::std_to_sockaddr;
use super::{cvt, sealed, Operation};
use crate::driver::shared_fd::SharedFd;
use crate::driver::Interest;

/// Connects a socket to a remote address.
pub struct Connect {
    fd: SharedFd,
    /// Read by the kernel: boxed so it does not move with the op.
    addr: Box<(libc::sockaddr_storage, libc::socklen_t)>,
}

impl Connect {
    pub(crate) fn new(fd: SharedFd, addr: &SocketAddr) -> Self {
        Connect {
            fd,
            addr: Box::new(std_to_sockaddr(addr)),
        }
    }
}

impl sealed::Sealed for Connect {}

impl Operation for Connect {
    type Output = io::Result<()>;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        let (storage, len) = &*self.addr;
        opcode::Connect::new(
            types::Fd(self.fd.raw()),
            (storage as *const libc::sockaddr_storage).cast(),
            *len,
        )
        .build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        res.map(drop)
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        Some((self.fd.raw(), Interest::Write))
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        let (storage, len) = &*self.addr;
        // SAFETY: the address is live and `len` bytes long.
        let r = cvt(unsafe {
            libc::connect(
                self.fd.raw(),
                (storage as *const libc::sockaddr_storage).cast(),
                *len,
            )
        } as isize);
        match r {
            // A repeated connect reports the outcome of the first one.
            Err(e) if e.raw_os_error() == Some(libc::EISCONN) => Ok(0),
            Err(e)
                if matches!(
                    e.raw_os_error(),
                    Some(libc::EINPROGRESS) | Some(libc::EALREADY)
                ) =>
            {
                Err(io::ErrorKind::WouldBlock.into())
            }
            r => r,
        }
    }
}
