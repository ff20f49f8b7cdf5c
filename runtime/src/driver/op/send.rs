//! `send(2)` of an owned buffer.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types};

use super::{cvt, sealed, unless_blocked, Operation};
use crate::buf::{BufResult, IoBuf};
use crate::driver::shared_fd::{PendingSend, SharedFd};
use crate::driver::Interest;

/// Sends of at most this many bytes try the socket before the ring.
pub(crate) const TRY_FIRST_MAX: usize = 16 * 1024;

/// Sends the initialised bytes of `buf` on a connected socket.
///
/// On io_uring a small send (≤ 16 KiB) that is the only send on its socket
/// first tries a non-blocking `send(2)`: the kernel copies the bytes before
/// the call returns, so nothing holds the buffer afterwards, and the request
/// is on the wire without waiting for the next park and without a completion
/// to reap. Only if the socket buffer is full does it go through the ring.
pub struct Send<B> {
    fd: PendingSend,
    buf: B,
}

impl<B: IoBuf> Send<B> {
    pub(crate) fn new(fd: SharedFd, buf: B) -> Self {
        Send {
            fd: fd.pending_send(),
            buf,
        }
    }
}

impl<B> sealed::Sealed for Send<B> {}

impl<B: IoBuf> Operation for Send<B> {
    type Output = BufResult<usize, B>;
    const MOVES_BYTES: bool = true;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        let len = self.buf.bytes_init().min(u32::MAX as usize) as u32;
        opcode::Send::new(types::Fd(self.fd.fd().raw()), self.buf.stable_ptr(), len)
            .flags(libc::MSG_NOSIGNAL)
            .build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        (res.map(|n| n as usize), self.buf)
    }

    fn try_first(&mut self) -> Option<io::Result<u32>> {
        // Alone: no earlier send on the socket is queued or in flight, so
        // going first cannot reorder the stream.
        if self.buf.bytes_init() > TRY_FIRST_MAX || !self.fd.alone() {
            return None;
        }
        unless_blocked(self.poll_try())
    }

    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        Some((self.fd.fd().raw(), Interest::Write))
    }

    fn poll_try(&mut self) -> io::Result<u32> {
        let len = self.buf.bytes_init().min(u32::MAX as usize);
        // SAFETY: the buffer's first `len` bytes are initialised and live in `self`.
        cvt(unsafe {
            libc::send(
                self.fd.fd().raw(),
                self.buf.stable_ptr().cast(),
                len,
                libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT,
            )
        })
    }
}
