//! Zero-copy `send` (`IORING_OP_SEND_ZC`).
//!
//! The kernel posts two CQEs: the result (with `IORING_CQE_F_MORE`), then a
//! notification (`IORING_CQE_F_NOTIF`) once the NIC or loopback no longer
//! references the pages. The future resolves, and the buffer comes back, only
//! after the notification. On epoll this is a plain copying `send`.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types};

use super::{cvt, sealed, Operation};
use crate::buf::{BufResult, IoBuf};
use crate::driver::shared_fd::{PendingSend, SharedFd};
use crate::driver::Interest;

/// Sends `buf` without copying it into the socket buffer (io_uring).
pub struct SendZc<B> {
    /// Counted with the socket's other sends, so a small plain send never
    /// overtakes it (see `Send`).
    fd: PendingSend,
    buf: B,
}

impl<B: IoBuf> SendZc<B> {
    pub(crate) fn new(fd: SharedFd, buf: B) -> Self {
        SendZc {
            fd: fd.pending_send(),
            buf,
        }
    }
}

impl<B> sealed::Sealed for SendZc<B> {}

impl<B: IoBuf> Operation for SendZc<B> {
    type Output = BufResult<usize, B>;
    const MOVES_BYTES: bool = true;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        let len = self.buf.bytes_init().min(u32::MAX as usize) as u32;
        opcode::SendZc::new(types::Fd(self.fd.fd().raw()), self.buf.stable_ptr(), len)
            .flags(libc::MSG_NOSIGNAL)
            .build()
    }

    fn complete(self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        (res.map(|n| n as usize), self.buf)
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
