//! `recv(2)` into an owned buffer.

use std::io;
use std::os::fd::RawFd;

use io_uring::{opcode, types};

use super::{sealed, unless_blocked, Operation};
use crate::buf::{BufResult, IoBufMut};
use crate::driver::shared_fd::{PendingRecv, SharedFd};
use crate::driver::socket::recv_dontwait;
use crate::driver::Interest;

/// Receives into `buf` from its first byte up to `bytes_total()`; on success
/// the first `n` bytes are marked initialised.
///
/// On io_uring a receive of bytes expected to be in the socket already (a
/// payload right after its header: `TcpStream::read_exact_expected`) first
/// tries a non-blocking `recv(2)` when it is created: the bytes are copied
/// before the call returns, and the op is born finished without waiting for
/// the next park. Nothing there (`EAGAIN`): through the ring.
pub struct Recv<B> {
    /// Counted among the fd's receivers while the op exists.
    fd: PendingRecv,
    buf: B,
    try_first: bool,
}

impl<B: IoBufMut> Recv<B> {
    pub(crate) fn new(fd: SharedFd, buf: B) -> Self {
        Recv {
            fd: fd.pending_recv(),
            buf,
            try_first: false,
        }
    }

    /// A receive of bytes expected to be in the socket already (see the type).
    pub(crate) fn expecting(fd: SharedFd, buf: B) -> Self {
        Recv {
            fd: fd.pending_recv(),
            buf,
            try_first: true,
        }
    }

    fn target(&mut self) -> (*mut u8, usize) {
        (
            self.buf.stable_mut_ptr(),
            self.buf.bytes_total().min(u32::MAX as usize),
        )
    }
}

impl<B> sealed::Sealed for Recv<B> {}

impl<B: IoBufMut> Operation for Recv<B> {
    type Output = BufResult<usize, B>;
    const MOVES_BYTES: bool = true;

    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        let (ptr, len) = self.target();
        opcode::Recv::new(types::Fd(self.fd.fd().raw()), ptr, len as u32).build()
    }

    fn complete(mut self, res: io::Result<u32>, _flags: u32) -> Self::Output {
        if let Ok(n) = res {
            // SAFETY: the kernel wrote the first `n` bytes.
            unsafe { self.buf.set_init(n as usize) };
        }
        (res.map(|n| n as usize), self.buf)
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
        let (ptr, len) = self.target();
        // SAFETY: `ptr..ptr+len` is writable capacity of the owned buffer.
        unsafe { recv_dontwait(self.fd.fd().raw(), ptr, len) }
    }
}
