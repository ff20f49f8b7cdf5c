//! Operations on any file descriptor: pipes, eventfds, files.

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};

use crate::buf::{IoBuf, IoBufMut};
use crate::driver::op::{Close, PollAdd, ReadAt, WriteAt};
use crate::driver::socket::{current_is_epoll, forget_fd, is_pollable, set_nonblocking};
use crate::driver::Op;

/// An owned descriptor driven by the runtime.
///
/// On epoll, pollable fds (pipes, sockets, eventfds) are switched to
/// non-blocking mode; regular files are read and written directly.
pub struct Fd {
    fd: Option<OwnedFd>,
    pollable: bool,
    epoll: bool,
}

impl Fd {
    /// Adopts `fd` on the current runtime.
    pub fn new(fd: OwnedFd) -> io::Result<Fd> {
        let epoll = current_is_epoll();
        let pollable = is_pollable(&fd)?;
        if epoll && pollable {
            set_nonblocking(&fd, true)?;
        }
        Ok(Fd {
            fd: Some(fd),
            pollable,
            epoll,
        })
    }

    fn raw(&self) -> RawFd {
        self.fd
            .as_ref()
            .expect("fd present until close")
            .as_raw_fd()
    }

    /// Reads at the current position.
    pub fn read<B: IoBufMut>(&self, buf: B) -> Op<'_, ReadAt<B>> {
        Op::new(ReadAt::new(self.raw(), buf, None, self.pollable))
    }

    /// Reads at `offset` (`pread`).
    pub fn read_at<B: IoBufMut>(&self, buf: B, offset: u64) -> Op<'_, ReadAt<B>> {
        Op::new(ReadAt::new(self.raw(), buf, Some(offset), self.pollable))
    }

    /// Writes at the current position.
    pub fn write<B: IoBuf>(&self, buf: B) -> Op<'_, WriteAt<B>> {
        Op::new(WriteAt::new(self.raw(), buf, None, self.pollable))
    }

    /// Writes at `offset` (`pwrite`).
    pub fn write_at<B: IoBuf>(&self, buf: B, offset: u64) -> Op<'_, WriteAt<B>> {
        Op::new(WriteAt::new(self.raw(), buf, Some(offset), self.pollable))
    }

    /// Waits for `poll(2)` events in `mask` (`IORING_OP_POLL_ADD`).
    pub fn poll(&self, mask: u32) -> Op<'_, PollAdd> {
        Op::new(PollAdd::new(self.raw(), mask))
    }

    /// Closes the fd through the driver (`IORING_OP_CLOSE`).
    pub async fn close(mut self) -> io::Result<()> {
        let fd = self.fd.take().expect("fd present until close");
        if self.epoll {
            forget_fd(fd.as_raw_fd());
        }
        Op::<Close>::new(Close::new(fd)).await
    }
}

impl AsRawFd for Fd {
    fn as_raw_fd(&self) -> RawFd {
        self.raw()
    }
}

impl Drop for Fd {
    fn drop(&mut self) {
        if let (true, Some(fd)) = (self.epoll, &self.fd) {
            forget_fd(fd.as_raw_fd());
        }
    }
}
