//! An async mutex for one thread's tasks (no data inside: it orders
//! critical sections such as "send one frame"; not fair: a release wakes
//! every waiter and whichever polls first, or a newcomer, takes it — nothing
//! relies on the order, only on one holder at a time), and the gate built on it
//! that serialises setting something up — a connection, a queue pair.

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::net::SocketAddr;
use std::rc::Rc;
use std::task::{Poll, Waker};

use crate::error::TransferError;

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
        // future was dropped must not swallow the hand-over). Uncontended
        // (every small transfer's send), there is none: the queue is not
        // taken apart and dropped for nothing.
        if self.lock.waiters.borrow().is_empty() {
            return;
        }
        let waiters = std::mem::take(&mut *self.lock.waiters.borrow_mut());
        waiters.into_iter().for_each(Waker::wake);
    }
}

/// Serialises attempts to set something up, and hands a failed attempt's
/// error to everyone who waited behind it: they asked while it was being
/// tried, so its answer is theirs. Without that, N transfers to a peer that
/// stopped answering fail one connect timeout after another, N in a row.
#[derive(Default)]
pub(crate) struct SetupGate {
    lock: AsyncLock,
    /// Attempts finished.
    attempts: Cell<u64>,
    /// The last attempt's error, if it failed.
    failure: RefCell<Option<TransferError>>,
}

impl SetupGate {
    /// Once the gate is ours: what `ready` finds set up already, else the
    /// error of an attempt that finished failing while we waited, else the
    /// result of a new `attempt`.
    pub(crate) async fn run<T, F>(
        &self,
        ready: impl Fn() -> Option<T>,
        attempt: impl FnOnce() -> F,
    ) -> Result<T, TransferError>
    where
        F: Future<Output = Result<T, TransferError>>,
    {
        let seen = self.attempts.get();
        let _g = self.lock.lock().await;
        if let Some(t) = ready() {
            return Ok(t);
        }
        if self.attempts.get() != seen {
            if let Some(e) = self.failure.borrow().clone() {
                return Err(e);
            }
        }
        let res = attempt().await;
        self.attempts.set(self.attempts.get() + 1);
        *self.failure.borrow_mut() = res.as_ref().err().cloned();
        res
    }
}

/// Connects in flight, by peer address: a second connect to an address
/// waits for the first (and takes its peer, or its error) rather than
/// making a second peer — a second session at the target, fenced apart
/// from the first, while the batch layer knows a peer by its address.
#[derive(Default)]
pub(crate) struct Connecting(RefCell<HashMap<SocketAddr, Rc<SetupGate>>>);

impl Connecting {
    /// `known()` if set up already, else the result of `attempt` through
    /// `addr`'s gate (see [`SetupGate::run`]).
    pub(crate) async fn run<T, F>(
        &self,
        addr: SocketAddr,
        known: impl Fn() -> Option<T>,
        attempt: impl FnOnce() -> F,
    ) -> Result<T, TransferError>
    where
        F: Future<Output = Result<T, TransferError>>,
    {
        if let Some(t) = known() {
            return Ok(t);
        }
        let gate = self.0.borrow_mut().entry(addr).or_default().clone();
        let r = gate.run(known, attempt).await;
        // The last one through the gate takes it away.
        let mut gates = self.0.borrow_mut();
        if gates.get(&addr).is_some_and(|g| Rc::ptr_eq(g, &gate)) && Rc::strong_count(&gate) == 2 {
            gates.remove(&addr);
        }
        r
    }
}
