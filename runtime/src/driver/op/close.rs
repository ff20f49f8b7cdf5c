//! `close(2)`.

use std::io;
use std::os::fd::{IntoRawFd, OwnedFd, RawFd};

use io_uring::{opcode, types};

use super::{cvt, sealed, Operation};
use crate::driver::Interest;

/// Closes a descriptor (the caller gives up ownership). Owned until it is
/// handed to the kernel (`IORING_OP_CLOSE` submitted, or `close(2)` called):
/// a close that never runs — refused by a runtime that shut down, or an
/// epoll op dropped before its turn — closes it as it drops.
pub struct Close {
    fd: Option<OwnedFd>,
}

impl Close {
    pub(crate) fn new(fd: OwnedFd) -> Self {
        Close { fd: Some(fd) }
    }
}

impl sealed::Sealed for Close {}

impl Operation for Close {
    type Output = io::Result<()>;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        // Built once, right before it is submitted: the kernel closes it now.
        let fd = self.fd.take().expect("a close is submitted once");
        opcode::Close::new(types::Fd(fd.into_raw_fd())).build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        res.map(drop)
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        None
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        let Some(fd) = self.fd.take() else {
            return Ok(0);
        };
        // SAFETY: the descriptor was ours (taken out above): closed exactly
        // once, here.
        cvt(unsafe { libc::close(fd.into_raw_fd()) } as isize)
    }
}
