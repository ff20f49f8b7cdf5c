//! The target's fence table: which batches are fenced, and which writes of
//! each batch are landing right now.
//!
//! A fence for `(session, batch)` marks the batch fenced (new writes of it are
//! discarded), cancels the receive op of every write of it that is landing,
//! and completes once each of those writes has stopped — its op reaped, so no
//! byte of it can land any more. Only then does the target send `FenceAck`.
//!
//! A fenced batch's entry must outlive every frame of the batch still on its
//! way: its *carriers* are the session's connections open when it was
//! fenced. A carrier stops being one when it sends `Forget` for the batch
//! (the initiator's batch is finished: TCP's order puts every earlier frame
//! of it ahead) or closes. The entry goes once it has no carriers and no
//! landing writes, so the table holds only batches that can still receive
//! frames.

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::task::{Poll, Waker};

use quiesce_runtime::Canceller;
use slab::Slab;

type Key = (u64, u64);

#[derive(Default)]
struct BatchState {
    fenced: bool,
    /// Landing writes, each with the canceller of its current receive.
    writes: Slab<Option<Canceller>>,
    waiters: Vec<Waker>,
    /// Connections that may still carry frames of the batch (fenced only).
    carriers: HashSet<usize>,
}

impl BatchState {
    /// Whether the entry still says something.
    fn needed(&self) -> bool {
        !self.writes.is_empty() || (self.fenced && !self.carriers.is_empty())
    }
}

/// Fence state of every (session, batch) this target has seen lately.
#[derive(Default, Clone)]
pub(crate) struct FenceTable {
    inner: Rc<RefCell<HashMap<Key, BatchState>>>,
    /// Emptied write slabs of removed entries: every batch makes an entry,
    /// and a recycled slab spares its first write an allocation.
    spare: Rc<RefCell<Vec<Slab<Option<Canceller>>>>>,
}

/// Spare slabs kept at most.
const SPARE_SLABS: usize = 64;

impl FenceTable {
    pub(crate) fn is_fenced(&self, session: u64, batch: u64) -> bool {
        self.inner
            .borrow()
            .get(&(session, batch))
            .is_some_and(|b| b.fenced)
    }

    /// Registers a write of `batch` that is about to land.
    pub(crate) fn begin_write(&self, session: u64, batch: u64) -> WriteGuard {
        let slot = self
            .inner
            .borrow_mut()
            .entry((session, batch))
            .or_insert_with(|| BatchState {
                writes: self.spare.borrow_mut().pop().unwrap_or_default(),
                ..BatchState::default()
            })
            .writes
            .insert(None);
        WriteGuard {
            table: self.clone(),
            key: (session, batch),
            slot,
        }
    }

    /// Fences `batch` and cancels its landing writes; then await
    /// [`quiet`](Self::quiet). `carriers`: the session's open connections.
    pub(crate) fn fence(
        &self,
        session: u64,
        batch: u64,
        carriers: impl IntoIterator<Item = usize>,
    ) {
        let cancellers: Vec<Canceller> = {
            let mut t = self.inner.borrow_mut();
            let st = t.entry((session, batch)).or_default();
            if !st.fenced {
                st.fenced = true;
                st.carriers = carriers.into_iter().collect();
            }
            st.writes.iter().filter_map(|(_, c)| c.clone()).collect()
        };
        // Cancel outside the borrow: cancelling may wake tasks.
        cancellers.iter().for_each(Canceller::cancel);
    }

    /// Resolves once no write of `batch` is landing.
    pub(crate) async fn quiet(&self, session: u64, batch: u64) {
        std::future::poll_fn(|cx| {
            let mut t = self.inner.borrow_mut();
            match t.get_mut(&(session, batch)) {
                Some(st) if !st.writes.is_empty() => {
                    st.waiters.push(cx.waker().clone());
                    Poll::Pending
                }
                _ => Poll::Ready(()),
            }
        })
        .await
    }

    /// Connection `conn` will carry nothing more of `batch`.
    pub(crate) fn forget(&self, session: u64, batch: u64, conn: usize) {
        let mut t = self.inner.borrow_mut();
        if let Some(st) = t.get_mut(&(session, batch)) {
            st.carriers.remove(&conn);
            if !st.needed() {
                t.remove(&(session, batch));
            }
        }
    }

    /// Connection `conn` of `session` closed: it carries nothing any more.
    pub(crate) fn closed(&self, session: u64, conn: usize) {
        self.inner.borrow_mut().retain(|(s, _), st| {
            if *s == session {
                st.carriers.remove(&conn);
            }
            *s != session || st.needed()
        });
    }

    /// Fenced entries of `session` now.
    pub(crate) fn fenced_in(&self, session: u64) -> usize {
        self.inner
            .borrow()
            .iter()
            .filter(|((s, _), st)| *s == session && st.fenced)
            .count()
    }

    /// Entries now (fenced batches and batches with landing writes).
    pub(crate) fn len(&self) -> usize {
        self.inner.borrow().len()
    }

    /// Forgets a session whose connections are all gone.
    pub(crate) fn end_session(&self, session: u64) {
        self.inner
            .borrow_mut()
            .retain(|(s, _), st| *s != session || !st.writes.is_empty());
    }
}

/// A landing write; dropping it tells fence waiters it has stopped.
pub(crate) struct WriteGuard {
    table: FenceTable,
    key: Key,
    slot: usize,
}

impl WriteGuard {
    pub(crate) fn fenced(&self) -> bool {
        self.table
            .inner
            .borrow()
            .get(&self.key)
            .is_some_and(|b| b.fenced)
    }

    /// Records the canceller of the receive now in flight.
    pub(crate) fn set_canceller(&self, c: Option<Canceller>) {
        if let Some(st) = self.table.inner.borrow_mut().get_mut(&self.key) {
            st.writes[self.slot] = c;
        }
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        let waiters = {
            let mut t = self.table.inner.borrow_mut();
            let Some(st) = t.get_mut(&self.key) else {
                return;
            };
            st.writes.remove(self.slot);
            let w = if st.writes.is_empty() {
                std::mem::take(&mut st.waiters)
            } else {
                Vec::new()
            };
            if !st.needed() {
                if let Some(st) = t.remove(&self.key) {
                    let mut spare = self.table.spare.borrow_mut();
                    if spare.len() < SPARE_SLABS {
                        spare.push(st.writes);
                    }
                }
            }
            w
        };
        waiters.into_iter().for_each(Waker::wake);
    }
}
