//! `close(2)`.

use std::io;
use std::os::fd::{IntoRawFd, OwnedFd, RawFd};

use io_uring::{opcode, types};

use super::{cvt, sealed, Operation};
use crate::driver::Interest;

/// Closes a descriptor (the caller gives up ownership).
pub struct Close {
    fd: RawFd,
}

impl Close {
    pub(crate) fn new(fd: OwnedFd) -> Self {
        Close {
            fd: fd.into_raw_fd(),
        }
    }
}

impl sealed::Sealed for Close {}

impl Operation for Close {
    type Output = io::Result<()>;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        opcode::Close::new(types::Fd(self.fd)).build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        res.map(drop)
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        None
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        // SAFETY: we own the descriptor; it is closed exactly once.
        cvt(unsafe { libc::close(self.fd) } as isize)
    }
}
