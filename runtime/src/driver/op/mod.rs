//! One file per operation. Each is a plain struct holding the fd and the
//! owned buffers; [`Operation`] says how to run it on either backend.
//!
//! Memory the kernel reads or writes during an operation (buffers, socket
//! addresses, timespecs) lives on the heap inside the struct, so moving the
//! struct — into the driver when its future is dropped — never moves it.

mod accept;
mod close;
mod connect;
mod discard;
mod poll_add;
mod recv;
mod rw;
mod send;
mod send_zc;
mod timeout;

pub use accept::Accept;
pub use close::Close;
pub use connect::Connect;
pub use discard::Discard;
pub use poll_add::PollAdd;
pub use recv::Recv;
pub use rw::{ReadAt, WriteAt};
pub use send::Send;
pub use send_zc::SendZc;
pub use timeout::Timeout;

use std::io;
use std::os::fd::RawFd;

use super::Interest;

mod sealed {
    pub trait Sealed {}
}

/// An operation the driver can run. Sealed: the crate's own op structs only.
pub trait Operation: sealed::Sealed + Unpin + 'static {
    /// What awaiting the operation yields (usually the result and the buffers).
    type Output;

    /// epoll: the result counts bytes moved, charged to the tick's byte budget.
    #[doc(hidden)]
    const MOVES_BYTES: bool = false;

    /// io_uring: the submission entry (the driver sets `user_data`).
    #[doc(hidden)]
    fn uring_entry(&mut self) -> io_uring::squeue::Entry;

    /// Builds the output from the result, on either backend. `flags` are the
    /// result CQE's flags (0 on epoll).
    #[doc(hidden)]
    fn complete(self, res: io::Result<u32>, flags: u32) -> Self::Output;

    /// epoll: the fd and readiness to wait for when `poll_try` would block.
    #[doc(hidden)]
    fn poll_fd(&self) -> Option<(RawFd, Interest)>;

    /// epoll: runs the syscall without blocking.
    #[doc(hidden)]
    fn poll_try(&mut self) -> io::Result<u32>;

    /// io_uring: the result of finishing at once without the ring, tried
    /// before submitting (`None`: submit). Only for an op the kernel is done
    /// with when the call returns.
    #[doc(hidden)]
    fn try_first(&mut self) -> Option<io::Result<u32>> {
        None
    }

    /// io_uring: sees each CQE that arrives after the future was dropped.
    #[doc(hidden)]
    fn parked_cqe(&mut self, _res: i32, _flags: u32) {}
}

/// A non-blocking try's result as [`Operation::try_first`] gives it:
/// `None` (through the ring) if the call would have blocked.
pub(crate) fn unless_blocked(res: io::Result<u32>) -> Option<io::Result<u32>> {
    match res {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => None,
        res => Some(res),
    }
}

/// Turns a `-1`-style libc return into an `io::Result`.
pub(crate) fn cvt(ret: isize) -> io::Result<u32> {
    if ret < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(ret as u32)
    }
}
