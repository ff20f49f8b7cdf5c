//! `send(2)` of an owned buffer.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types};

use super::{cvt, sealed, Operation};
use crate::buf::{BufResult, IoBuf};
use crate::driver::shared_fd::SharedFd;
use crate::driver::Interest;

/// Sends the initialised bytes of `buf` on a connected socket.
pub struct Send<B> {
    fd: SharedFd,
    buf: B,
}

impl<B: IoBuf> Send<B> {
    pub(crate) fn new(fd: SharedFd, buf: B) -> Self {
        Send { fd, buf }
    }
}

impl<B> sealed::Sealed for Send<B> {}

impl<B: IoBuf> Operation for Send<B> {
    type Output = BufResult<usize, B>;
    const MOVES_BYTES: bool = true;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        let len = self.buf.bytes_init().min(u32::MAX as usize) as u32;
        opcode::Send::new(types::Fd(self.fd.raw()), self.buf.stable_ptr(), len)
            .flags(libc::MSG_NOSIGNAL)
            .build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        (res.map(|n| n as usize), self.buf)
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        Some((self.fd.raw(), Interest::Write))
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        let len = self.buf.bytes_init().min(u32::MAX as usize);
        // SAFETY: the buffer's first `len` bytes are initialised and live in `self`.
        cvt(unsafe {
            libc::send(
                self.fd.raw(),
                self.buf.stable_ptr().cast(),
                len,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        })
    }
}
