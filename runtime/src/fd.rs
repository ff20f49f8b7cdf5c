//! Operations on any file descriptor: pipes, eventfds, files.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::buf::{IoBuf, IoBufMut};
use crate::context;
use crate::driver::op::{Operation, PollAdd, ReadAt, WriteAt};
use crate::driver::shared_fd::SharedFd;
use crate::driver::socket::{current_is_epoll, is_pollable, set_nonblocking};
use crate::driver::Op;

/// An owned descriptor driven by the runtime it was adopted on.
///
/// On epoll, pollable fds (pipes, sockets, eventfds) are switched to
/// non-blocking mode; regular files are read and written directly. As for
/// streams, every op holds the shared fd: it is closed only when the `Fd` and
/// the last op on it are gone.
pub struct Fd {
    fd: SharedFd,
    pollable: bool,
}

impl Fd {
    /// Adopts `fd` on the current runtime.
    ///
    /// # Panics
    /// Outside a runtime.
    pub fn new(fd: OwnedFd) -> io::Result<Fd> {
        let pollable = is_pollable(&fd)?;
        if pollable && current_is_epoll() {
            set_nonblocking(&fd, true)?;
        }
        Ok(Fd {
            fd: SharedFd::new(fd, context::current()),
            pollable,
        })
    }

    fn op<T: Operation>(&self, spec: T) -> Op<T> {
        Op::on(self.fd.context().clone(), spec)
    }

    /// Reads at the current position.
    pub fn read<B: IoBufMut>(&self, buf: B) -> Op<ReadAt<B>> {
        self.op(ReadAt::new(self.fd.clone(), buf, None, self.pollable))
    }

    /// Reads at `offset` (`pread`).
    pub fn read_at<B: IoBufMut>(&self, buf: B, offset: u64) -> Op<ReadAt<B>> {
        self.op(ReadAt::new(
            self.fd.clone(),
            buf,
            Some(offset),
            self.pollable,
        ))
    }

    /// Writes at the current position.
    pub fn write<B: IoBuf>(&self, buf: B) -> Op<WriteAt<B>> {
        self.op(WriteAt::new(self.fd.clone(), buf, None, self.pollable))
    }

    /// Writes at `offset` (`pwrite`).
    pub fn write_at<B: IoBuf>(&self, buf: B, offset: u64) -> Op<WriteAt<B>> {
        self.op(WriteAt::new(
            self.fd.clone(),
            buf,
            Some(offset),
            self.pollable,
        ))
    }

    /// Waits for `poll(2)` events in `mask` (`IORING_OP_POLL_ADD`).
    pub fn poll(&self, mask: u32) -> Op<PollAdd> {
        self.op(PollAdd::new(self.fd.clone(), mask))
    }

    /// Closes the fd: through the driver (`IORING_OP_CLOSE`) when no op holds
    /// it, otherwise when the last op on it has been reaped.
    pub async fn close(self) -> io::Result<()> {
        self.fd.close().await
    }
}

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.fd.raw()
    }
}
