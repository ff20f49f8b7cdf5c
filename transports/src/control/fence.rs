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
//!
//! Keys are chosen by peers, so the index keeps std's keyed SipHash; a
//! landing write's guard holds its entry's slot instead of its key, so only
//! finding an entry and removing it hash (DESIGN §11, target data path).

use std::cell::RefCell;
use std::collections::hash_map::Entry;
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

/// The entries and their index. Invariant: `index` and `states` name the
/// same entries — every slot of `states` is in `index` once, under its
/// key — and an entry with a landing write stays in place, so a
/// [`WriteGuard`]'s slot names its entry for as long as the guard lives.
#[derive(Default)]
struct Entries {
    index: HashMap<Key, usize>,
    states: Slab<BatchState>,
}

impl Entries {
    fn get(&self, key: &Key) -> Option<&BatchState> {
        self.index.get(key).map(|&i| &self.states[i])
    }

    fn get_mut(&mut self, key: &Key) -> Option<&mut BatchState> {
        self.index.get(key).map(|&i| &mut self.states[i])
    }

    /// Removes the entry of `key`, at `slot`.
    fn remove(&mut self, key: &Key, slot: usize) -> BatchState {
        self.index.remove(key);
        self.states.remove(slot)
    }

    /// The entry of `key`, made by `new` if there is none.
    fn slot_or_insert_with(&mut self, key: Key, new: impl FnOnce() -> BatchState) -> usize {
        match self.index.entry(key) {
            Entry::Occupied(o) => *o.get(),
            Entry::Vacant(v) => *v.insert(self.states.insert(new())),
        }
    }

    /// Keeps the entries for which `keep` says so.
    fn retain(&mut self, mut keep: impl FnMut(&Key, &mut BatchState) -> bool) {
        let states = &mut self.states;
        self.index.retain(|key, &mut i| {
            let kept = keep(key, &mut states[i]);
            if !kept {
                states.remove(i);
            }
            kept
        });
    }
}

/// Fence state of every (session, batch) this target has seen lately.
#[derive(Default, Clone)]
pub(crate) struct FenceTable {
    inner: Rc<RefCell<Entries>>,
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
        let key = (session, batch);
        let mut t = self.inner.borrow_mut();
        let entry = t.slot_or_insert_with(key, || BatchState {
            writes: self.spare.borrow_mut().pop().unwrap_or_default(),
            ..BatchState::default()
        });
        let slot = t.states[entry].writes.insert(None);
        WriteGuard {
            table: self.clone(),
            key,
            entry,
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
            let entry = t.slot_or_insert_with((session, batch), BatchState::default);
            let st = &mut t.states[entry];
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
        let Entries { index, states } = &mut *t;
        if let Entry::Occupied(o) = index.entry((session, batch)) {
            let st = &mut states[*o.get()];
            st.carriers.remove(&conn);
            if !st.needed() {
                states.remove(o.remove());
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
        let t = self.inner.borrow();
        t.index
            .iter()
            .filter(|((s, _), &i)| *s == session && t.states[i].fenced)
            .count()
    }

    /// Entries now (fenced batches and batches with landing writes).
    pub(crate) fn len(&self) -> usize {
        self.inner.borrow().index.len()
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
    /// Its entry's slot in the table (see [`Entries`]).
    entry: usize,
    slot: usize,
}

impl WriteGuard {
    pub(crate) fn fenced(&self) -> bool {
        self.table.inner.borrow().states[self.entry].fenced
    }

    /// Records the canceller of the receive now in flight.
    pub(crate) fn set_canceller(&self, c: Option<Canceller>) {
        self.table.inner.borrow_mut().states[self.entry].writes[self.slot] = c;
    }
}

impl Drop for WriteGuard {
    fn drop(&mut self) {
        let waiters = {
            let mut t = self.table.inner.borrow_mut();
            let st = &mut t.states[self.entry];
            st.writes.remove(self.slot);
            let w = if st.writes.is_empty() {
                std::mem::take(&mut st.waiters)
            } else {
                Vec::new()
            };
            if !st.needed() {
                let st = t.remove(&self.key, self.entry);
                let mut spare = self.table.spare.borrow_mut();
                if spare.len() < SPARE_SLABS {
                    spare.push(st.writes);
                }
            }
            w
        };
        waiters.into_iter().for_each(Waker::wake);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A guard's slot names its own entry while other entries come and go
    /// (their slots are reused), and entries leave once they say nothing.
    #[test]
    fn a_guard_keeps_its_entry_while_others_come_and_go() {
        let t = FenceTable::default();
        let g1 = t.begin_write(1, 1);
        t.fence(1, 2, [7]);
        t.forget(1, 2, 7);
        assert_eq!(t.len(), 1, "a fenced batch without carriers goes");
        let g3 = t.begin_write(1, 3); // takes the slot (1, 2) left
        assert!(!g1.fenced() && !g3.fenced());
        t.fence(1, 1, [7]);
        assert!(g1.fenced() && !g3.fenced(), "the fence found its own batch");
        assert!(t.is_fenced(1, 1) && !t.is_fenced(1, 3));
        drop(g3);
        assert_eq!(t.len(), 1, "an unfenced batch goes with its last write");
        drop(g1);
        assert_eq!(
            t.fenced_in(1),
            1,
            "a fenced batch stays while it has carriers"
        );
        t.closed(1, 7);
        assert_eq!(t.len(), 0);
    }
}
