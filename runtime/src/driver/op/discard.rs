//! `recv(2)` with `MSG_TRUNC` on a TCP socket: drops the stream's next bytes
//! without copying them anywhere.
//!
//! tcp(7): with `MSG_TRUNC` "the received bytes of data are discarded,
//! rather than passed back in a caller-supplied buffer". So the op lends no
//! memory to the kernel — its address is null — and skipping a cut write's
//! megabyte costs the kernel's bookkeeping of the packets, not a copy.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types};

use super::{cvt, sealed, unless_blocked, Operation};
use crate::driver::shared_fd::{PendingRecv, SharedFd};
use crate::driver::Interest;

/// Drops up to `len` of the socket's next bytes (at least one, unless at
/// EOF); resolves to how many it dropped, `0` at EOF. Like a receive, it
/// first tries at once when the bytes are expected to be there already.
pub struct Discard {
    /// Counted among the fd's receivers while the op exists: a direct
    /// receive must not take bytes ahead of it.
    fd: PendingRecv,
    len: u32,
    try_first: bool,
}

impl Discard {
    pub(crate) fn new(fd: SharedFd, len: usize, try_first: bool) -> Self {
        Discard {
            fd: fd.pending_recv(),
            len: len.min(u32::MAX as usize) as u32,
            try_first,
        }
    }
}

impl sealed::Sealed for Discard {}

impl Operation for Discard {
    type Output = io::Result<usize>;
    // Nothing is copied: the tick's byte budget is for copies.
    const MOVES_BYTES: bool = false;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        opcode::Recv::new(
            types::Fd(self.fd.fd().raw()),
            std::ptr::null_mut(),
            self.len,
        )
        .flags(libc::MSG_TRUNC)
        .build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        res.map(|n| n as usize)
    }

    fn try_first(&mut self) -> Option<io::Result<u32>> {
        // Alone: no earlier receive on the socket is queued or in flight,
        // so going first cannot reorder the stream.
        if !self.try_first || !self.fd.alone() {
            return None;
        }
        unless_blocked(self.poll_try())
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        Some((self.fd.fd().raw(), Interest::Read))
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        // SAFETY: with MSG_TRUNC a TCP socket writes nothing to the buffer
        // (tcp(7)), so a null one of any length is never touched.
        cvt(unsafe {
            libc::recv(
                self.fd.fd().raw(),
                std::ptr::null_mut(),
                self.len as usize,
                libc::MSG_TRUNC | libc::MSG_DONTWAIT,
            )
        })
    }
}
