//! A descriptor shared by its owner and every operation on it.
//!
//! A stream (or an [`Fd`](crate::fd::Fd)) and each op started on it hold a
//! [`SharedFd`]; the descriptor is closed when the last of them is gone. An op
//! parked in the driver after its future was dropped keeps its `SharedFd`
//! until its final CQE is reaped, so the fd number cannot be reused by a new
//! file while a queued or in-flight SQE still names it.
//!
//! The `SharedFd` also holds the runtime the fd was adopted by: on epoll the
//! registration is removed from *that* runtime's poller when the fd closes,
//! wherever the last holder is dropped.

use std::cell::Cell;
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::rc::Rc;

use super::op::Close;
use super::{Driver, Op};
use crate::context::Context;

struct FdCell {
    /// `None` once handed to a `Close` op by [`SharedFd::try_unwrap`].
    fd: Option<OwnedFd>,
    cx: Rc<Context>,
    /// Send operations on the fd that exist now (queued, in flight, parked,
    /// or about to complete): a send may go straight to the kernel, ahead of
    /// the ring, only when it is the only one — never past an earlier one.
    senders: Cell<usize>,
    /// Receive operations on the fd that exist now: a receive that skips the
    /// ring ([`TcpStream::try_read`](crate::net::TcpStream::try_read)) may
    /// run only when there is none, or the two would split the stream.
    receivers: Cell<usize>,
}

/// An operation's place in its fd's count of senders (`RECV = false`) or
/// receivers (`RECV = true`) while the operation exists (see
/// [`SharedFd::pending_send`], [`SharedFd::pending_recv`]); it holds the fd
/// too.
pub(crate) struct Pending<const RECV: bool>(SharedFd);

/// A send operation's place among its fd's senders.
pub(crate) type PendingSend = Pending<false>;
/// A receive operation's place among its fd's receivers.
pub(crate) type PendingRecv = Pending<true>;

impl<const RECV: bool> Pending<RECV> {
    /// The fd.
    pub(crate) fn fd(&self) -> &SharedFd {
        &self.0
    }

    fn count(&self) -> &Cell<usize> {
        (self.0).0.count(RECV)
    }

    /// Whether this is the only send (receive) operation on the fd: nothing
    /// queued or in flight can be overtaken.
    pub(crate) fn alone(&self) -> bool {
        self.count().get() == 1
    }
}

impl<const RECV: bool> Drop for Pending<RECV> {
    fn drop(&mut self) {
        let n = self.count();
        n.set(n.get() - 1);
    }
}

impl FdCell {
    /// The count of receivers (`recv`) or senders.
    fn count(&self, recv: bool) -> &Cell<usize> {
        match recv {
            true => &self.receivers,
            false => &self.senders,
        }
    }
}

/// Reference-counted ownership of one descriptor (see the module docs).
#[derive(Clone)]
pub(crate) struct SharedFd(Rc<FdCell>);

impl SharedFd {
    /// Adopts `fd` on runtime `cx`.
    pub(crate) fn new(fd: OwnedFd, cx: Rc<Context>) -> SharedFd {
        SharedFd(Rc::new(FdCell {
            fd: Some(fd),
            cx,
            senders: Cell::new(0),
            receivers: Cell::new(0),
        }))
    }

    /// Whether a send operation on the fd exists (queued, in flight, parked
    /// or about to complete): a send that skips the driver now would
    /// overtake it.
    pub(crate) fn sends_pending(&self) -> bool {
        self.0.senders.get() > 0
    }

    /// Counts a send operation on the fd for as long as the guard lives.
    pub(crate) fn pending_send(&self) -> PendingSend {
        self.pending()
    }

    /// Whether a receive operation on the fd exists (queued, in flight,
    /// parked or about to complete).
    pub(crate) fn recvs_pending(&self) -> bool {
        self.0.receivers.get() > 0
    }

    /// Counts a receive operation on the fd for as long as the guard lives.
    pub(crate) fn pending_recv(&self) -> PendingRecv {
        self.pending()
    }

    fn pending<const RECV: bool>(&self) -> Pending<RECV> {
        let n = self.0.count(RECV);
        n.set(n.get() + 1);
        Pending(self.clone())
    }

    /// The descriptor number, valid while this `SharedFd` lives.
    pub(crate) fn raw(&self) -> RawFd {
        self.0
            .fd
            .as_ref()
            .expect("the fd is present while shared")
            .as_raw_fd()
    }

    /// The runtime the fd was adopted by.
    pub(crate) fn context(&self) -> &Rc<Context> {
        &self.0.cx
    }

    /// Gives up this holder's share. When it was the only one (no op can still
    /// name the fd), the fd is closed through the driver (`IORING_OP_CLOSE`)
    /// and its error reported; otherwise it closes when the last op on it has
    /// been reaped.
    pub(crate) async fn close(self) -> io::Result<()> {
        match Rc::try_unwrap(self.0) {
            Ok(mut cell) => {
                let fd = cell.fd.take().expect("the fd is present while shared");
                forget(&cell.cx, fd.as_raw_fd());
                Op::on(cell.cx.clone(), Close::new(fd)).await
            }
            Err(_shared) => Ok(()),
        }
    }
}

impl Drop for FdCell {
    fn drop(&mut self) {
        if let Some(fd) = self.fd.take() {
            forget(&self.cx, fd.as_raw_fd());
            // Closed here: no op holds the fd any more.
            drop(fd);
        }
    }
}

/// Removes `fd` from the epoll registrations of runtime `cx` (io_uring keeps none).
fn forget(cx: &Context, fd: RawFd) {
    match cx.driver.try_borrow_mut() {
        Ok(mut d) => {
            if let Driver::Poll(p) = &mut *d {
                p.forget(fd);
            }
        }
        Err(_) => tracing::error!(
            fd,
            "an fd closed while its driver was busy; epoll may keep a stale entry"
        ),
    }
}
