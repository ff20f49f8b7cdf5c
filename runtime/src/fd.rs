//! Operations on any file descriptor: pipes, eventfds, files.

use std::fs::OpenOptions;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::os::unix::fs::OpenOptionsExt;

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
    /// Adopts `fd` on the current runtime (on epoll a pollable one's open
    /// file description becomes non-blocking: see
    /// [`Fd::reopen_for_reading`] for one shared with other processes).
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

    /// Adopts, for reading, a private open of what `fd` refers to (through
    /// `/proc/self/fd`) where it is a pipe or a terminal: for a descriptor
    /// this process shares with others, such as its standard input, whose
    /// open file description may be a user's terminal or a parent's pipe.
    /// [`Fd::new`] on epoll switches the description it is given to
    /// non-blocking, for every process that holds it (a shell's next read
    /// then fails `EAGAIN`); a private open keeps that to this process.
    /// Anything else is adopted as a duplicate, description shared: a
    /// regular file keeps its shared offset (and is never switched), as do
    /// a socket (which cannot be opened again) and `/dev/ptmx` (whose open
    /// makes a new terminal); so is a terminal this user may not open
    /// (another user's), with a warning on epoll.
    ///
    /// # Panics
    /// Outside a runtime.
    pub fn reopen_for_reading(fd: BorrowedFd<'_>) -> io::Result<Fd> {
        use std::os::unix::fs::FileTypeExt;
        let dup = fd.try_clone_to_owned()?;
        let kind = std::fs::File::from(dup.try_clone()?)
            .metadata()?
            .file_type();
        let path = format!("/proc/self/fd/{}", fd.as_raw_fd());
        let reopens = kind.is_fifo()
            || (kind.is_char_device()
                && std::fs::read_link(&path).is_ok_and(|p| p != std::path::Path::new("/dev/ptmx")));
        if !reopens {
            return Fd::new(dup);
        }
        // Non-blocking to open: a pipe whose writers are gone would wait
        // for one (then back to blocking: io_uring waits for readiness
        // itself, and answers EAGAIN on a non-blocking file). O_NOCTTY: a
        // session leader with no controlling terminal would take this one.
        let own = match OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_NONBLOCK | libc::O_NOCTTY)
            .open(&path)
        {
            Ok(file) => {
                set_nonblocking(&file, false)?;
                OwnedFd::from(file)
            }
            Err(e) => {
                if current_is_epoll() {
                    tracing::warn!(
                        "{path} cannot be opened again ({e}): reading it on epoll makes it \
                         non-blocking for every process that shares it"
                    );
                }
                dup
            }
        };
        Fd::new(own)
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
