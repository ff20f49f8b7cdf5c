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
//! Keys are chosen by peers, so the index keeps std's randomly keyed
//! SipHash-1-3, computed over the key's two words
//! ([`BatchHash`](crate::control::batch_hash::BatchHash)); a
//! landing write's guard holds its entry's slot and its key's hash, and
//! the table remembers the last key it hashed, so a write hashes once: when
//! its request is checked (`is_fenced`), not again when it registers or when
//! its guard removes the entry (DESIGN §11, target data path).

use std::cell::{Cell, RefCell};
use std::collections::{HashMap, HashSet};
use std::rc::Rc;
use std::task::{Poll, Waker};

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use quiesce_runtime::Canceller;

use crate::control::batch_hash::BatchHash;
use slab::Slab;

type Key = (u64, u64);

#[derive(Default)]
struct BatchState {
    fenced: bool,
    /// Landing writes, each with the canceller of its current receive.
    writes: Slab<Option<Canceller>>,
    waiters: Vec<Waker>,
    /// Connections that may still carry frames of the batch (fenced only;
    /// each once).
    carriers: Vec<usize>,
}

impl BatchState {
    /// Whether the entry still says something.
    fn needed(&self) -> bool {
        !self.writes.is_empty() || (self.fenced && !self.carriers.is_empty())
    }

    /// Connection `conn` carries nothing more of the batch; whether it was
    /// a carrier.
    fn uncarry(&mut self, conn: usize) -> bool {
        let i = self.carriers.iter().position(|&c| c == conn);
        i.map(|i| self.carriers.swap_remove(i)).is_some()
    }
}

/// One entry of the index: a key, its hash (kept, so that neither growing
/// the index nor a guard's removal hashes it again) and its slot in
/// `states`.
struct Indexed {
    hash: u64,
    key: Key,
    slot: usize,
}

/// The entries and their index. Invariant: `index` and `states` name the
/// same entries — every slot of `states` is in `index` once, under its
/// key and that key's hash by `keys` — and an entry with a landing write
/// stays in place, so a [`WriteGuard`]'s slot names its entry for as long
/// as the guard lives.
#[derive(Default)]
struct Entries {
    index: HashTable<Indexed>,
    /// Randomly keyed SipHash-1-3, as a `HashMap` would use.
    keys: BatchHash,
    /// The last key hashed and its hash: a write's request asks whether its
    /// batch is fenced and then registers with it, one hash for both.
    last: Cell<Option<(Key, u64)>>,
    states: Slab<BatchState>,
    /// The fenced batches of each session: what a connection's close, a
    /// session's end and a cap check look at, rather than every entry.
    fenced: HashMap<u64, HashSet<u64>>,
    /// Carriers held by all entries: what they cost besides their number
    /// (up to a session's cap of connections each), capped with it.
    carried: usize,
}

/// Carriers the table holds at most, per entry its cap allows: a fenced
/// batch of a session of a few connections, on average.
const CARRIERS_PER_ENTRY: usize = 4;

impl Entries {
    fn hash(&self, key: &Key) -> u64 {
        match self.last.get() {
            Some((k, h)) if k == *key => h,
            _ => {
                let h = self.keys.hash(key.0, key.1);
                self.last.set(Some((*key, h)));
                h
            }
        }
    }

    fn slot(&self, key: &Key) -> Option<usize> {
        self.index
            .find(self.hash(key), |e| e.key == *key)
            .map(|e| e.slot)
    }

    fn get(&self, key: &Key) -> Option<&BatchState> {
        self.slot(key).map(|i| &self.states[i])
    }

    fn get_mut(&mut self, key: &Key) -> Option<&mut BatchState> {
        self.slot(key).map(|i| &mut self.states[i])
    }

    /// Removes the entry of `key` (whose hash is `hash`), at `slot`.
    fn remove(&mut self, hash: u64, key: &Key, slot: usize) -> BatchState {
        if let Ok(o) = self.index.find_entry(hash, |e| e.key == *key) {
            o.remove();
        }
        let st = self.states.remove(slot);
        self.carried -= st.carriers.len();
        if st.fenced {
            if let Some(batches) = self.fenced.get_mut(&key.0) {
                batches.remove(&key.1);
                if batches.is_empty() {
                    self.fenced.remove(&key.0);
                }
            }
        }
        st
    }

    /// Marks the entry at `slot` fenced; false if it was already.
    fn mark_fenced(&mut self, key: Key, slot: usize) -> bool {
        let st = &mut self.states[slot];
        if st.fenced {
            return false;
        }
        st.fenced = true;
        self.fenced.entry(key.0).or_default().insert(key.1);
        true
    }

    /// Removes each fenced batch of `session` whose entry `keep` (which
    /// may change it) says nothing more, and gives back the room a burst
    /// left behind.
    fn sweep_fenced(&mut self, session: u64, mut keep: impl FnMut(&mut BatchState) -> bool) {
        let Some(batches) = self.fenced.get(&session) else {
            // Room left by entries that went otherwise (`Forget`) goes back
            // here too, as when every close walked the table.
            self.shrink();
            return;
        };
        let batches: Vec<u64> = batches.iter().copied().collect();
        for batch in batches {
            let key = (session, batch);
            let hash = self.keys.hash(key.0, key.1);
            let Some(slot) = self.index.find(hash, |e| e.key == key).map(|e| e.slot) else {
                continue;
            };
            let st = &mut self.states[slot];
            let before = st.carriers.len();
            let kept = keep(st);
            self.carried -= before - self.states[slot].carriers.len();
            if !kept {
                self.remove(hash, &key, slot);
            }
        }
        self.shrink();
    }

    /// The entry of `key` (whose hash is `hash`), made by `new` if there is
    /// none.
    fn slot_or_insert_with(
        &mut self,
        hash: u64,
        key: Key,
        new: impl FnOnce() -> BatchState,
    ) -> usize {
        match self.index.entry(hash, |e| e.key == key, |e| e.hash) {
            Entry::Occupied(o) => o.get().slot,
            Entry::Vacant(v) => {
                let slot = self.states.insert(new());
                v.insert(Indexed { hash, key, slot });
                slot
            }
        }
    }

    /// Gives back room once entries use under a quarter of it. The index
    /// rehashes into a smaller table; `states` keeps every slot a guard
    /// may name, so it gives back only its tail (all of it when empty).
    fn shrink(&mut self) {
        let room = |cap: usize, len: usize| cap > 4 * len + 64;
        if room(self.index.capacity(), self.index.len()) {
            self.index.shrink_to_fit(|e| e.hash);
        }
        if room(self.states.capacity(), self.states.len()) {
            if self.states.is_empty() {
                self.states = Slab::new();
            } else {
                self.states.shrink_to_fit();
            }
        }
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
        let hash = t.hash(&key);
        let entry = t.slot_or_insert_with(hash, key, || BatchState {
            writes: self.spare.borrow_mut().pop().unwrap_or_default(),
            ..BatchState::default()
        });
        let slot = t.states[entry].writes.insert(None);
        WriteGuard {
            table: self.clone(),
            hash,
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
            let key = (session, batch);
            let hash = t.hash(&key);
            let entry = t.slot_or_insert_with(hash, key, BatchState::default);
            if t.mark_fenced(key, entry) {
                let mut held: Vec<usize> = carriers.into_iter().collect();
                held.sort_unstable();
                held.dedup();
                t.carried += held.len();
                t.states[entry].carriers = held;
            }
            let st = &t.states[entry];
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
        let key = (session, batch);
        let hash = t.hash(&key);
        let Some(slot) = t.index.find(hash, |e| e.key == key).map(|e| e.slot) else {
            return;
        };
        let st = &mut t.states[slot];
        if st.uncarry(conn) {
            t.carried -= 1;
        }
        if !t.states[slot].needed() {
            t.remove(hash, &key, slot);
        }
    }

    /// Connection `conn` of `session` closed: it carries nothing any more.
    /// (Only fenced entries have carriers.)
    pub(crate) fn closed(&self, session: u64, conn: usize) {
        self.inner.borrow_mut().sweep_fenced(session, |st| {
            st.uncarry(conn);
            st.needed()
        });
    }

    /// Fenced entries of `session` now.
    fn fenced_in(&self, session: u64) -> usize {
        self.inner
            .borrow()
            .fenced
            .get(&session)
            .map_or(0, HashSet::len)
    }

    /// After a fence of `session`: the session that holds too many fenced
    /// batches, how many, and why — `session` past `per_session`, or, past
    /// `total` entries for the whole table (a peer may open many sessions)
    /// or [`CARRIERS_PER_ENTRY`] times as many carriers, the session
    /// holding the most. (No session holds more than the whole table: the
    /// per-session scan runs only when it is larger than `per_session`.)
    pub(crate) fn session_over_cap(
        &self,
        session: u64,
        per_session: usize,
        total: usize,
    ) -> Option<(u64, usize, &'static str)> {
        let all = self.len();
        let carried = self.inner.borrow().carried;
        if all > total || carried > total.saturating_mul(CARRIERS_PER_ENTRY) {
            let (s, held) = self.largest_session()?;
            return Some((s, held, "the fence table is full"));
        }
        if all <= per_session {
            return None;
        }
        let held = self.fenced_in(session);
        (held > per_session).then_some((session, held, "a session holds too many fenced batches"))
    }

    /// The session with the most fenced entries, and how many.
    fn largest_session(&self) -> Option<(u64, usize)> {
        self.inner
            .borrow()
            .fenced
            .iter()
            .map(|(&s, batches)| (s, batches.len()))
            .max_by_key(|&(s, n)| (n, std::cmp::Reverse(s)))
    }

    /// Entries now (fenced batches and batches with landing writes).
    pub(crate) fn len(&self) -> usize {
        self.inner.borrow().index.len()
    }

    /// Forgets a session whose connections are all gone. (An entry that
    /// is not fenced goes with its last landing write.)
    pub(crate) fn end_session(&self, session: u64) {
        self.inner
            .borrow_mut()
            .sweep_fenced(session, |st| !st.writes.is_empty());
    }
}

/// A landing write; dropping it tells fence waiters it has stopped.
pub(crate) struct WriteGuard {
    table: FenceTable,
    /// Its entry's key and that key's hash.
    hash: u64,
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
                let st = t.remove(self.hash, &self.key, self.entry);
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
mod tests;
