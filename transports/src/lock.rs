//! A FIFO async mutex for one thread's tasks (no data inside: it orders
//! critical sections such as "send one frame" or "reconnect slot i").

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::task::{Poll, Waker};

/// The lock.
#[derive(Default)]
pub(crate) struct AsyncLock {
    locked: Cell<bool>,
    waiters: RefCell<VecDeque<Waker>>,
}

/// Held until dropped.
pub(crate) struct LockGuard<'a> {
    lock: &'a AsyncLock,
}

impl AsyncLock {
    pub(crate) async fn lock(&self) -> LockGuard<'_> {
        std::future::poll_fn(|cx| {
            if !self.locked.get() {
                self.locked.set(true);
                Poll::Ready(())
            } else {
                self.waiters.borrow_mut().push_back(cx.waker().clone());
                Poll::Pending
            }
        })
        .await;
        LockGuard { lock: self }
    }
}

impl Drop for LockGuard<'_> {
    fn drop(&mut self) {
        self.lock.locked.set(false);
        // Wake every waiter: one wins, the rest queue again (a waiter whose
        // future was dropped must not swallow the hand-over).
        let waiters = std::mem::take(&mut *self.lock.waiters.borrow_mut());
        waiters.into_iter().for_each(Waker::wake);
    }
}
