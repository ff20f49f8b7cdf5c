//! `IORING_OP_POLL_ADD`: wait until an fd is ready.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types};

use super::{cvt, sealed, Operation};
use crate::driver::shared_fd::SharedFd;
use crate::driver::Interest;

/// Waits until `fd` reports any of the `poll(2)` events in `mask`.
pub struct PollAdd {
    fd: SharedFd,
    mask: u32,
}

impl PollAdd {
    pub(crate) fn new(fd: SharedFd, mask: u32) -> Self {
        PollAdd { fd, mask }
    }
}

impl sealed::Sealed for PollAdd {}

impl Operation for PollAdd {
    /// The events that fired (`POLLIN`, `POLLOUT`, `POLLHUP`, …).
    type Output = io::Result<u32>;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        opcode::PollAdd::new(types::Fd(self.fd.raw()), self.mask).build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        res
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        let write = self.mask & libc::POLLOUT as u32 != 0;
        let read = self.mask & libc::POLLIN as u32 != 0;
        let interest = match (read, write) {
            (true, true) => Interest::Either,
            (false, true) => Interest::Write,
            // Readable, or only what any wait reports (hang-up, error).
            _ => Interest::Read,
        };
        Some((self.fd.raw(), interest))
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        let mut p = libc::pollfd {
            fd: self.fd.raw(),
            events: self.mask as i16,
            revents: 0,
        };
        // SAFETY: one live pollfd; zero timeout never blocks.
        cvt(unsafe { libc::poll(&mut p, 1, 0) } as isize)?;
        if p.revents == 0 {
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            Ok(p.revents as u16 as u32)
        }
    }
}
