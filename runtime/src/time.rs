//! Timers: `sleep`, `sleep_until`, `timeout`. The nearest deadline bounds how
//! long the reactor parks.
//!
//! Timers live in a per-runtime ordered map (no syscall per timer). For a
//! timer armed in the kernel itself — `IORING_OP_TIMEOUT`, or a `timerfd` on
//! epoll — use [`kernel_sleep`].

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context as TaskCx, Poll, Waker};
use std::time::{Duration, Instant};

use crate::context;
use crate::driver::op::Timeout as TimeoutOp;
use crate::driver::Op;

/// Pending timers of one runtime.
#[derive(Default)]
pub(crate) struct Timers {
    map: BTreeMap<(Instant, u64), Waker>,
    next_id: u64,
}

impl Timers {
    pub(crate) fn next_deadline(&self) -> Option<Instant> {
        self.map.keys().next().map(|k| k.0)
    }

    /// Removes every timer due at `now`; returns their wakers.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<Waker> {
        let mut out = Vec::new();
        while let Some(entry) = self.map.first_entry() {
            if entry.key().0 > now {
                break;
            }
            out.push(entry.remove());
        }
        out
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

/// Fires due timers of the current runtime.
pub(crate) fn fire_due(cx: &context::Context) {
    let due = {
        let mut t = cx.timers.borrow_mut();
        if t.is_empty() {
            return;
        }
        t.expire(Instant::now())
    };
    due.into_iter().for_each(Waker::wake);
}

/// Future of [`sleep`] / [`sleep_until`].
#[must_use = "a Sleep does nothing unless awaited"]
pub struct Sleep {
    deadline: Instant,
    /// Where the waker is registered: the runtime it was first polled on, and
    /// the key in its timer map.
    key: Option<(Rc<context::Context>, (Instant, u64))>,
}

impl Sleep {
    /// When this sleep ends.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    /// Moves the deadline (re-arms an expired sleep).
    pub fn reset(&mut self, deadline: Instant) {
        self.unregister();
        self.deadline = deadline;
    }

    fn unregister(&mut self) {
        if let Some((cx, key)) = self.key.take() {
            cx.timers.borrow_mut().map.remove(&key);
        }
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, tcx: &mut TaskCx<'_>) -> Poll<()> {
        if Instant::now() >= self.deadline {
            self.unregister();
            return Poll::Ready(());
        }
        let deadline = self.deadline;
        let (cx, key) = match self.key.take() {
            Some((cx, k)) => (cx, Some(k)),
            // Registered with the runtime it is first polled on, and kept there.
            None => (context::current(), None),
        };
        let new_key = {
            let mut t = cx.timers.borrow_mut();
            match key {
                Some(k) if t.map.contains_key(&k) => {
                    let w = t.map.get_mut(&k).expect("present");
                    if !w.will_wake(tcx.waker()) {
                        *w = tcx.waker().clone();
                    }
                    k
                }
                _ => {
                    t.next_id += 1;
                    let k = (deadline, t.next_id);
                    t.map.insert(k, tcx.waker().clone());
                    k
                }
            }
        };
        self.key = Some((cx, new_key));
        Poll::Pending
    }
}

impl std::fmt::Debug for Sleep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sleep")
            .field("deadline", &self.deadline)
            .field("registered", &self.key.is_some())
            .finish()
    }
}

impl Drop for Sleep {
    fn drop(&mut self) {
        self.unregister();
    }
}

/// Waits until `deadline`.
pub fn sleep_until(deadline: Instant) -> Sleep {
    Sleep {
        deadline,
        key: None,
    }
}

/// Waits for `duration`.
pub fn sleep(duration: Duration) -> Sleep {
    sleep_until(Instant::now() + duration)
}

/// The deadline of a [`timeout`] passed first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("deadline elapsed")]
pub struct Elapsed;

/// Future of [`timeout`].
#[must_use = "a Timeout does nothing unless awaited"]
pub struct Timeout<F> {
    fut: Pin<Box<F>>,
    sleep: Sleep,
}

impl<F: Future> Future for Timeout<F> {
    type Output = Result<F::Output, Elapsed>;

    fn poll(mut self: Pin<&mut Self>, tcx: &mut TaskCx<'_>) -> Poll<Self::Output> {
        if let Poll::Ready(v) = self.fut.as_mut().poll(tcx) {
            return Poll::Ready(Ok(v));
        }
        match Pin::new(&mut self.sleep).poll(tcx) {
            Poll::Ready(()) => Poll::Ready(Err(Elapsed)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Runs `fut` until it completes or `duration` passes. On `Elapsed` the
/// future is dropped (which parks any operation it had in flight).
pub fn timeout<F: Future>(duration: Duration, fut: F) -> Timeout<F> {
    Timeout {
        fut: Box::pin(fut),
        sleep: sleep(duration),
    }
}

/// Sleeps on a timer armed in the kernel: `IORING_OP_TIMEOUT` on io_uring,
/// a `timerfd` on epoll. Costs a syscall (or an SQE); prefer [`sleep`].
pub fn kernel_sleep(duration: Duration) -> Op<TimeoutOp> {
    let cx = context::current();
    Op::on(cx.clone(), TimeoutOp::new(duration, cx))
}
