//! The lifecycle of one operation, and the future that drives it.
//!
//! On io_uring an operation is a slot in the driver's slab, keyed by the
//! CQE's `user_data` (slab key + generation). The slot's [`Lifecycle`] says who
//! owns the operation's buffers at each moment; the rule it enforces is the
//! crate's first promise: **a buffer is released only after the kernel's last
//! completion for it has been reaped** — the CQE, and for `SEND_ZC` the
//! zero-copy notification that follows it.
//!
//! On epoll nothing is ever in the kernel's hands between polls: the syscall
//! either completes during `poll` or returns `EWOULDBLOCK`, so dropping the
//! future releases its buffers at once.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::io;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context as TaskCx, Poll, Waker};

use super::op::Operation;
use super::Driver;
use crate::context::Context;

/// Where an io_uring operation is, and who owns its buffers.
pub(crate) enum Lifecycle {
    /// The SQE is queued or in the kernel and no task has polled the op yet.
    /// The `Op` future owns the buffers; the kernel may use them.
    Submitted,
    /// As `Submitted`, and a task waits: the waker is woken on the final CQE.
    Waiting(Waker),
    /// The `Op` future was dropped before its final CQE. The driver owns the
    /// buffers (boxed here) and an async cancel has been posted; the box is
    /// released when the final CQE is reaped, never before.
    Ignored(Box<dyn Parked>),
    /// The result CQE arrived. While `more` is set the kernel still holds the
    /// buffers (a `SEND_ZC` notification is outstanding) and the op is not done.
    Completed {
        res: i32,
        flags: u32,
        more: bool,
        waker: Option<Waker>,
    },
}

impl Lifecycle {
    /// True while the kernel may still produce completions for this op.
    pub(crate) fn is_live(&self) -> bool {
        match self {
            Lifecycle::Submitted | Lifecycle::Waiting(_) | Lifecycle::Ignored(_) => true,
            Lifecycle::Completed { more, .. } => *more,
        }
    }
}

/// An operation whose future is gone, parked in the driver until it drains.
pub(crate) trait Parked {
    /// Sees every CQE that arrives while parked (an accept closes the fd it
    /// got for nobody).
    fn cqe(&mut self, res: i32, flags: u32);
}

impl<T: Operation> Parked for T {
    fn cqe(&mut self, res: i32, flags: u32) {
        self.parked_cqe(res, flags)
    }
}

/// Converts a CQE result into an `io::Result`.
pub(crate) fn cqe_result(res: i32) -> io::Result<u32> {
    if res < 0 {
        Err(io::Error::from_raw_os_error(-res))
    } else {
        Ok(res as u32)
    }
}

/// Shared between an [`Op`] and its [`Canceller`]s.
struct CancelState {
    requested: Cell<bool>,
    /// io_uring `user_data` once submitted (0: not submitted there).
    token: Cell<u64>,
    /// The op's own runtime.
    cx: Rc<Context>,
    waker: RefCell<Option<Waker>>,
}

/// Cancels an operation in flight without giving up its future.
///
/// The future then completes — with `ECANCELED`, or with its real result if
/// the operation won the race — and only then returns its buffers. This is
/// what a fence uses: cancel, then await, and the buffers are quiescent.
#[derive(Clone)]
pub struct Canceller {
    state: Rc<CancelState>,
}

impl Canceller {
    /// Requests cancellation (io_uring: posts an async cancel to the op's own
    /// ring; epoll: the waiting op completes with `ECANCELED` at its next
    /// poll). Idempotent; callable from anywhere on the op's thread.
    pub fn cancel(&self) {
        let st = &self.state;
        if st.requested.replace(true) {
            return;
        }
        let token = st.token.get();
        if token != 0 {
            let cx = &st.cx;
            match cx.driver.try_borrow_mut() {
                Ok(mut d) => {
                    if let Driver::Uring(u) = &mut *d {
                        u.cancel(token, &cx.counters);
                    }
                }
                // A waker run while the driver reaps: posted at the start
                // of the next turn (a cancel of an op done by then is
                // ignored).
                Err(_) => cx.late_cancels.borrow_mut().push(token),
            }
        }
        if let Some(w) = st.waker.borrow_mut().take() {
            w.wake();
        }
    }
}

enum State<T> {
    /// Not yet started (epoll backend; io_uring ops start at creation).
    Idle(T),
    /// Created after its runtime shut down: never submitted; it completes
    /// with an error at its first poll.
    Refused(T),
    /// Submitted to the op's io_uring, slot `token`.
    Uring { token: u64, spec: T },
    /// io_uring: finished at creation without the ring
    /// ([`Operation::try_first`]); the kernel holds nothing of it.
    Finished { spec: T, res: io::Result<u32> },
    /// The future completed.
    Done,
}

/// The future of one operation over owned buffers.
///
/// An `Op` belongs to the runtime it was created on: it holds a handle to
/// that runtime's driver, and the fd it works on (a shared fd, closed only
/// when the last op on it is gone). Polled or dropped anywhere on the thread
/// — inside its runtime's `block_on`, outside any, inside another runtime's,
/// after its runtime was dropped — it always talks to its own driver.
///
/// On io_uring the operation is submitted when the `Op` is created (the SQE
/// is flushed at the next park, together with every other pushed SQE) —
/// unless it can finish at once without the ring (a small send alone on its
/// socket, see `Send`), which it then does, there. On epoll it starts at the
/// first poll.
///
/// Dropping the `Op` early never frees a buffer the kernel may touch: on
/// io_uring the op is parked in its driver with an async cancel posted, and
/// its buffers (and its fd) are released only once its final CQE (for
/// `SEND_ZC`, the notification) has been reaped. On epoll nothing is in the
/// kernel's hands between polls, so the buffers are released at once.
///
/// Dropping the runtime cancels and reaps every op it has in flight (see
/// `Builder::drain_timeout`); an `Op` that outlives it then completes with
/// the result of that drain. If the drain timed out, a still-live op stays
/// pending for ever and its buffers are leaked, never freed.
#[must_use = "an operation does nothing useful unless awaited"]
pub struct Op<T: Operation> {
    cx: Rc<Context>,
    state: State<T>,
    cancel: Option<Rc<CancelState>>,
}

impl<T: Operation> Op<T> {
    /// Starts `spec` on runtime `cx` (the runtime of the fd it works on).
    pub(crate) fn on(cx: Rc<Context>, mut spec: T) -> Self {
        let state = match &mut *cx.driver.borrow_mut() {
            // Nothing would ever reap it (in a forked child: its ring is
            // the parent's).
            _ if cx.closed.get() || cx.lineage.forked() => State::Refused(spec),
            Driver::Uring(u) => match spec.try_first() {
                Some(res) => State::Finished { spec, res },
                None => {
                    let token = u.submit(spec.uring_entry(), Lifecycle::Submitted, &cx.counters);
                    State::Uring { token, spec }
                }
            },
            Driver::Poll(_) => State::Idle(spec),
        };
        Op {
            cx,
            state,
            cancel: None,
        }
    }

    /// A handle that cancels this operation while it is in flight.
    pub fn canceller(&mut self) -> Canceller {
        let cx = &self.cx;
        let st = self
            .cancel
            .get_or_insert_with(|| {
                Rc::new(CancelState {
                    requested: Cell::new(false),
                    token: Cell::new(0),
                    cx: cx.clone(),
                    waker: RefCell::new(None),
                })
            })
            .clone();
        if let State::Uring { token, .. } = &self.state {
            st.token.set(*token);
        }
        Canceller { state: st }
    }

    /// [`canceller`](Self::canceller), re-armed from `c` — the canceller of
    /// an earlier op of this runtime, which must have completed — instead of
    /// a new one: a loop of ops (the receives of a target's writes) shares
    /// one allocation. A request made on `c` for the earlier op is
    /// forgotten. A `c` of another runtime is not reused.
    pub fn canceller_reusing(&mut self, c: &Canceller) -> Canceller {
        if self.cancel.is_none() && Rc::ptr_eq(&c.state.cx, &self.cx) {
            c.state.requested.set(false);
            c.state.token.set(0);
            c.state.waker.borrow_mut().take();
            self.cancel = Some(c.state.clone());
        }
        self.canceller()
    }

    fn cancel_requested(&self) -> bool {
        self.cancel.as_ref().is_some_and(|c| c.requested.get())
    }
}

impl<T: Operation> Future for Op<T> {
    type Output = T::Output;

    fn poll(mut self: Pin<&mut Self>, tcx: &mut TaskCx<'_>) -> Poll<T::Output> {
        let this = &mut *self;
        // A live io_uring op stays in `state` until its final CQE is taken:
        // should anything below panic (the waker's clone, the driver), the
        // unwinding drop parks it instead of freeing what the kernel holds.
        if let State::Uring { token, .. } = this.state {
            let done = match &mut *this.cx.driver.borrow_mut() {
                Driver::Uring(u) => u.poll_op(token, tcx.waker()),
                Driver::Poll(_) => unreachable!("an io_uring op on an epoll runtime"),
            };
            let Some((res, flags)) = done else {
                return Poll::Pending;
            };
            let State::Uring { spec, .. } = std::mem::replace(&mut this.state, State::Done) else {
                unreachable!("checked above")
            };
            return Poll::Ready(spec.complete(res, flags));
        }
        match std::mem::replace(&mut this.state, State::Done) {
            State::Uring { .. } => unreachable!("handled above"),
            State::Idle(mut spec) => {
                if this.cancel_requested() {
                    return Poll::Ready(spec.complete(Err(canceled()), 0));
                }
                // Its runtime is gone: nothing would wake it (an io_uring op
                // was cancelled by that runtime's drain; this one ends alike).
                // Or this is a forked child's copy of it: its fd is the
                // parent's too, whose bytes a receive here would take.
                if this.cx.closed.get() || this.cx.lineage.forked() {
                    return Poll::Ready(spec.complete(Err(runtime_gone()), 0));
                }
                if crate::executor::op_budget(tcx, T::MOVES_BYTES, 0).is_pending() {
                    this.state = State::Idle(spec);
                    return Poll::Pending;
                }
                match spec.poll_try() {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                        let (fd, interest) =
                            spec.poll_fd().expect("WouldBlock from an op without an fd");
                        let reg = match &mut *this.cx.driver.borrow_mut() {
                            Driver::Poll(p) => p.wait(fd, interest, tcx.waker()),
                            Driver::Uring(_) => unreachable!("an epoll op on an io_uring runtime"),
                        };
                        if let Err(e) = reg {
                            return Poll::Ready(spec.complete(Err(e), 0));
                        }
                        if let Some(c) = &this.cancel {
                            *c.waker.borrow_mut() = Some(tcx.waker().clone());
                        }
                        this.state = State::Idle(spec);
                        Poll::Pending
                    }
                    res => {
                        crate::stats::Counters::bump(&this.cx.counters.completions);
                        if let (true, Ok(n)) = (T::MOVES_BYTES, &res) {
                            crate::executor::charge_bytes(*n as usize);
                        }
                        Poll::Ready(spec.complete(res, 0))
                    }
                }
            }
            State::Finished { spec, res } => {
                // Done without the ring, it still spends the task's budget,
                // as an epoll op does before its syscall: else a reader whose
                // sender keeps the socket full finishes receive after
                // receive in one poll, and no timer, fence or other task
                // runs until the whole transfer is in.
                let moved = match (T::MOVES_BYTES, &res) {
                    (true, Ok(n)) => *n as usize,
                    _ => 0,
                };
                if crate::executor::op_budget(tcx, T::MOVES_BYTES, moved).is_pending() {
                    this.state = State::Finished { spec, res };
                    return Poll::Pending;
                }
                crate::stats::Counters::bump(&this.cx.counters.completions);
                Poll::Ready(spec.complete(res, 0))
            }
            State::Refused(spec) => Poll::Ready(spec.complete(Err(runtime_gone()), 0)),
            State::Done => panic!("Op polled after it completed"),
        }
    }
}

/// The error of an op whose runtime has shut down.
fn runtime_gone() -> io::Error {
    io::Error::other("the op's runtime has shut down")
}

impl<T: Operation> Drop for Op<T> {
    fn drop(&mut self) {
        let State::Uring { token, spec } = std::mem::replace(&mut self.state, State::Done) else {
            return;
        };
        park(&self.cx, token, Box::new(spec));
    }
}

/// Posts the cancels requested while `cx`'s driver was busy.
pub(crate) fn post_late_cancels(cx: &Context) {
    let tokens = std::mem::take(&mut *cx.late_cancels.borrow_mut());
    if let Driver::Uring(u) = &mut *cx.driver.borrow_mut() {
        for token in tokens {
            u.cancel(token, &cx.counters);
        }
    }
}

/// Parks an io_uring op whose future (or stream) is gone in its own driver
/// `cx` until its final CQE. If that driver is busy (never expected), the op
/// is leaked: never free what the kernel may touch.
pub(crate) fn park(cx: &Context, token: u64, op: Box<dyn Parked>) {
    let leftover = match cx.driver.try_borrow_mut() {
        Ok(mut d) => match &mut *d {
            Driver::Uring(u) => u.park_op(token, op, &cx.counters),
            Driver::Poll(_) => unreachable!("an io_uring op on an epoll runtime"),
        },
        Err(_) => {
            tracing::error!("an op dropped while its driver is busy; leaking its buffers");
            std::mem::forget(op);
            None
        }
    };
    // Dropped here, with the driver no longer borrowed.
    drop(leftover);
}

pub(crate) fn canceled() -> io::Error {
    io::Error::from_raw_os_error(libc::ECANCELED)
}
