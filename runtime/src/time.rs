//! Timers: `sleep`, `sleep_until`, `timeout`. The nearest deadline bounds how
//! long the reactor parks.
//!
//! Timers live in a per-runtime slab with a min-heap of deadlines (no
//! syscall per timer, and no allocation per timer once the runtime is warm:
//! a batch arms and cancels its deadline every time). For a timer armed in
//! the kernel itself — `IORING_OP_TIMEOUT`, or a `timerfd` on epoll — use
//! [`kernel_sleep`].

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context as TaskCx, Poll, Waker};
use std::time::{Duration, Instant};

use slab::Slab;

use crate::context;
use crate::driver::op::Timeout as TimeoutOp;
use crate::driver::Op;

/// A registered timer: where its waker sits and which registration it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct TimerKey {
    slot: usize,
    /// Tells this registration from a later one in the same slot.
    gen: u64,
}

struct Armed {
    gen: u64,
    waker: Waker,
}

/// Pending timers of one runtime.
///
/// Invariant: every armed slot has exactly one heap entry with its
/// generation; heap entries whose slot was cancelled (or re-used) are
/// stale and skipped, and dropped when they reach the top or when stale
/// entries outnumber armed ones (a rebuild).
#[derive(Default)]
pub(crate) struct Timers {
    armed: Slab<Armed>,
    heap: BinaryHeap<Reverse<(Instant, u64, usize)>>,
    next_gen: u64,
}

impl Timers {
    fn arm(&mut self, deadline: Instant, waker: Waker) -> TimerKey {
        self.next_gen += 1;
        let gen = self.next_gen;
        let slot = self.armed.insert(Armed { gen, waker });
        self.heap.push(Reverse((deadline, gen, slot)));
        TimerKey { slot, gen }
    }

    fn is_armed(&self, key: TimerKey) -> bool {
        self.armed.get(key.slot).is_some_and(|a| a.gen == key.gen)
    }

    fn cancel(&mut self, key: TimerKey) {
        if self.is_armed(key) {
            self.armed.remove(key.slot);
            // Cancelled timers leave stale heap entries behind: rebuild
            // once they outnumber the armed ones.
            if self.heap.len() > 2 * self.armed.len() + 64 {
                let armed = &self.armed;
                self.heap.retain(|Reverse((_, gen, slot))| {
                    armed.get(*slot).is_some_and(|a| a.gen == *gen)
                });
            }
        }
    }

    /// Removes every timer; returns their wakers (the runtime shut down:
    /// their sleeps move to the runtime that polls them next).
    pub(crate) fn take_all(&mut self) -> Vec<Waker> {
        self.heap.clear();
        self.armed.drain().map(|a| a.waker).collect()
    }

    /// Drops stale entries from the top of the heap.
    fn prune(&mut self) {
        while let Some(Reverse((_, gen, slot))) = self.heap.peek() {
            if self.armed.get(*slot).is_some_and(|a| a.gen == *gen) {
                return;
            }
            self.heap.pop();
        }
    }

    pub(crate) fn next_deadline(&mut self) -> Option<Instant> {
        self.prune();
        self.heap.peek().map(|Reverse((at, _, _))| *at)
    }

    /// Removes every timer due at `now`; returns their wakers.
    pub(crate) fn expire(&mut self, now: Instant) -> Vec<Waker> {
        let mut out = Vec::new();
        loop {
            self.prune();
            match self.heap.peek() {
                Some(Reverse((at, _, slot))) if *at <= now => {
                    let slot = *slot;
                    self.heap.pop();
                    out.push(self.armed.remove(slot).waker);
                }
                _ => return out,
            }
        }
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.armed.is_empty()
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
    let mut wakes = crate::executor::Wakes::default();
    due.into_iter().for_each(|w| wakes.wake(w));
    wakes.finish();
}

/// Future of [`sleep`] / [`sleep_until`].
#[must_use = "a Sleep does nothing unless awaited"]
pub struct Sleep {
    deadline: Instant,
    /// Where the waker is registered: the runtime it was first polled on, and
    /// the key in its timers.
    key: Option<(Rc<context::Context>, TimerKey)>,
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
            cx.timers.borrow_mut().cancel(key);
        }
    }
}

impl Future for Sleep {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, tcx: &mut TaskCx<'_>) -> Poll<()> {
        // Registered with a runtime that is gone (nothing fires its timers
        // any more): registered anew with the one polling it now.
        if self.key.as_ref().is_some_and(|(cx, _)| cx.closed.get()) {
            self.unregister();
        }
        // Registered and still armed: the reactor has not fired it (firing
        // disarms it), so it wakes this task when due; no clock read.
        if let Some((cx, k)) = &self.key {
            let mut t = cx.timers.borrow_mut();
            if t.is_armed(*k) {
                let w = &mut t.armed[k.slot].waker;
                if !w.will_wake(tcx.waker()) {
                    *w = tcx.waker().clone();
                }
                return Poll::Pending;
            }
        }
        if Instant::now() >= self.deadline {
            self.unregister();
            return Poll::Ready(());
        }
        let deadline = self.deadline;
        let (cx, key) = match self.key.take() {
            Some((cx, k)) => (cx, Some(k)),
            // Registered with the runtime it is first polled on, and kept
            // there while that one runs.
            None => (context::current(), None),
        };
        let new_key = {
            let mut t = cx.timers.borrow_mut();
            match key {
                Some(k) if t.is_armed(k) => {
                    let w = &mut t.armed[k.slot].waker;
                    if !w.will_wake(tcx.waker()) {
                        *w = tcx.waker().clone();
                    }
                    k
                }
                _ => t.arm(deadline, tcx.waker().clone()),
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

/// Waits for `duration` (at most [`LONGEST_WAIT`]).
pub fn sleep(duration: Duration) -> Sleep {
    sleep_until(deadline_in(duration))
}

/// The longest wait anything here keeps (~136 years): no program outlives
/// it, and an `Instant` holds it, where `Duration::MAX` past now (or a C
/// caller's `UINT64_MAX` milliseconds, or Python's `1e19` seconds)
/// overflows one.
pub const LONGEST_WAIT: Duration = Duration::from_secs(1 << 32);

/// `duration` from now, capped at [`LONGEST_WAIT`]: a deadline for any
/// wait a caller asks for, however long.
pub fn deadline_in(duration: Duration) -> Instant {
    Instant::now() + duration.min(LONGEST_WAIT)
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

#[cfg(test)]
mod tests {
    use super::*;

    fn noop() -> Waker {
        Waker::noop().clone()
    }

    #[test]
    fn timers_fire_in_deadline_order_and_cancelled_ones_never() {
        let mut t = Timers::default();
        let t0 = Instant::now();
        let late = t.arm(t0 + Duration::from_millis(30), noop());
        let early = t.arm(t0 + Duration::from_millis(10), noop());
        let gone = t.arm(t0 + Duration::from_millis(5), noop());
        t.cancel(gone);
        assert!(!t.is_armed(gone));
        assert_eq!(t.next_deadline(), Some(t0 + Duration::from_millis(10)));
        assert_eq!(t.expire(t0 + Duration::from_millis(20)).len(), 1);
        assert!(!t.is_armed(early) && t.is_armed(late));
        // The freed slot is used again: the old registration's key is not
        // this one, and cancelling it touches nothing.
        let again = t.arm(t0 + Duration::from_millis(40), noop());
        assert!(again.slot == gone.slot || again.slot == early.slot);
        t.cancel(gone);
        t.cancel(early);
        assert!(t.is_armed(again) && t.is_armed(late));
        assert_eq!(t.expire(t0 + Duration::from_secs(1)).len(), 2);
        assert!(t.is_empty());
        assert_eq!(t.next_deadline(), None);
    }

    #[test]
    fn cancelled_timers_do_not_pile_up() {
        let mut t = Timers::default();
        let far = Instant::now() + Duration::from_secs(3600);
        let keep = t.arm(far, noop());
        for _ in 0..100_000 {
            let k = t.arm(far, noop());
            t.cancel(k);
        }
        assert!(
            t.heap.len() <= 2 * t.armed.len() + 65,
            "{} heap entries",
            t.heap.len()
        );
        assert!(t.is_armed(keep));
        assert_eq!(t.next_deadline(), Some(far));
    }
}
