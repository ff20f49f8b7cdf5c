//! Managed buffers (`allocate_managed_buffer`): page-aligned memory the
//! binding allocates, registers for peers, and frees only once nothing
//! holds it — no peer (its registration reclaimed) and no batch of this
//! engine (each batch counts the managed buffers its local ranges lie in,
//! as [`Uses`], until its outcome is final: after a -2, until it drained)
//! and no registration lies in it (`register_memory` of a range inside it,
//! counted until `unregister_memory` took that range back: peers may write
//! there until then); `write_bytes_to_buffer` / `read_bytes_from_buffer`
//! copy in and out of them, and refuse addresses outside every one of them.
//!
//! Registrations of any memory are counted the same way: each batch counts
//! the registered ranges its local ranges overlap, so `unregister_memory`
//! answers 0 only once no batch of this engine still reads or writes the
//! range either (not only no peer), and refuses new batches from it while
//! it waits. A batch may start before the registration of its memory: the
//! batches in flight are known too (a [`Flight`] with their ranges; with
//! nothing registered at all, only their number, taken without the lock),
//! and a new registration counts those it overlaps — or, for uncounted
//! ones, waits for all of them to end before it can be taken back.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::Duration;

use slab::Slab;
use smallvec::SmallVec;

use crate::node::lock;

const ALIGN: usize = 4096;

/// One managed buffer.
struct Managed {
    len: usize,
    /// Batches whose local ranges lie in it and whose outcome is not final.
    uses: usize,
    /// `free_managed_buffer` is taking it back: no registration may start
    /// in it.
    freeing: bool,
}

/// One registration (`register_memory`).
struct Lent {
    len: usize,
    /// The managed buffers (their addresses) it overlaps. Peers may write
    /// into a buffer while any registration overlaps it.
    buffers: SmallVec<[usize; 1]>,
    /// Batches whose local ranges overlap it and whose outcome is not final.
    uses: usize,
    /// `unregister_memory` calls taking it back now: while any does, no
    /// batch may start using it.
    closing: u32,
    /// Tells it from a later registration at the same address, which a
    /// batch's uses of this one must not count down.
    generation: u64,
    /// Made while batches that counted nothing were in flight (see
    /// [`ManagedBuffers::unaccounted`]): unused only once none is.
    after_unaccounted: bool,
}

/// A batch in flight that counted its uses: its local ranges, and the
/// registrations made after it started that overlap them (which it
/// counts as uses of its own until it ends).
#[derive(Default)]
struct Flight {
    ranges: SmallVec<[(usize, usize); 2]>,
    late: SmallVec<[(usize, u64); 1]>,
}

/// The managed buffers alive now, and the registrations.
#[derive(Default)]
struct Live {
    buffers: BTreeMap<usize, Managed>,
    /// By a registration's address.
    lendings: BTreeMap<usize, Lent>,
    /// The longest registration ever made: one that overlaps an address
    /// starts less than this far below it.
    longest: usize,
    /// Registrations made so far.
    generations: u64,
    /// The batches in flight that counted their uses, by key ([`Uses`]):
    /// a slab, as each batch inserts and removes one.
    flights: Slab<Flight>,
    /// Threads in [`ManagedBuffers::wait_unused`]: a batch that gives its
    /// uses back notifies `unused` only if any waits (a notify is a futex
    /// syscall, every time, waiter or not).
    waiting_unused: usize,
}

impl Live {
    /// The registrations that overlap the buffer at `buffer`, by address.
    fn lent_in(&self, buffer: usize) -> impl Iterator<Item = usize> + '_ {
        self.lendings
            .iter()
            .filter(move |(_, l)| l.buffers.contains(&buffer))
            .map(|(&at, _)| at)
    }

    /// The registrations that overlap `addr..end`, by address.
    fn lent_over(&self, addr: usize, end: usize) -> impl Iterator<Item = usize> + '_ {
        let floor = addr.saturating_sub(self.longest);
        self.lendings
            .range(floor..end)
            .filter(move |(&at, l)| at.saturating_add(l.len) > addr)
            .map(|(&at, _)| at)
    }
}

/// Why a registration may not start ([`ManagedBuffers::lending`]).
#[derive(Debug, PartialEq)]
pub(crate) enum NotLendable {
    /// The managed buffer at this address is being freed.
    BeingFreed(usize),
    /// A registration at this very address has not been taken back.
    AlreadyLent,
    /// The range runs past the end of the address space.
    PastTheAddressSpace,
}

/// Why [`ManagedBuffers::begin_free`] refused.
#[derive(Debug, PartialEq)]
pub(crate) enum Held {
    NoSuchBuffer,
    /// A registration other than the buffer's own lies in it (its address).
    LentAt(usize),
    /// A batch whose outcome is not final uses it.
    InUse,
    /// Another call is freeing it.
    Freeing,
}

/// The managed buffers alive now, by address, and the registrations.
#[derive(Default)]
pub(crate) struct ManagedBuffers {
    live: Mutex<Live>,
    /// Notified when a registration's uses fall.
    unused: Condvar,
    /// How many buffers and registrations are live: with none, a batch
    /// counts its uses without the lock.
    count: AtomicUsize,
    /// Batches in flight that started with none live, and so counted
    /// nothing: their memory is not known, so a registration made while
    /// any is in flight is unused only once none is. None starts while a
    /// registration lives (`count` is not 0), so this only falls then.
    /// With `count`, a store-then-load pair on each side (sequentially
    /// consistent): a batch and a registration that start at once do not
    /// both miss the other. One lost with its uses (a -2 with nothing to
    /// wait on) stays counted for good, and every registration made after
    /// it then stays in use: that batch's memory is not known, and it may
    /// still be touched.
    unaccounted: AtomicUsize,
}

/// The managed buffers and registrations one batch uses (by address, each
/// once): taken when the batch is prepared, given back with
/// [`ManagedBuffers::release`] once nothing of the batch can touch them.
/// Empty (and allocation-free) for a batch of unregistered memory.
#[derive(Default)]
#[must_use = "uses must be given back, or the buffers can never be freed"]
pub(crate) struct Uses {
    buffers: SmallVec<[usize; 2]>,
    /// (address, generation)
    lendings: SmallVec<[(usize, u64); 2]>,
    /// Its [`Flight`]'s key, if it counted its uses.
    flight: Option<usize>,
    /// Counted in [`ManagedBuffers::unaccounted`] instead.
    unaccounted: bool,
}

/// What [`ManagedBuffers::free`] did.
#[derive(Debug, PartialEq)]
pub(crate) enum Free {
    Done,
    /// No managed buffer of that address and length.
    NoSuchBuffer,
    /// A batch whose outcome is not final uses it; it stays allocated.
    InUse,
}

impl ManagedBuffers {
    /// A zeroed, page-aligned buffer of `len` bytes (`None`: `len` is 0 or
    /// the allocation failed).
    pub(crate) fn allocate(&self, len: usize) -> Option<usize> {
        let layout = Layout::from_size_align(len, ALIGN)
            .ok()
            .filter(|_| len > 0)?;
        // SAFETY: the layout has a non-zero size (checked above).
        let p = unsafe { alloc_zeroed(layout) };
        if p.is_null() {
            return None;
        }
        lock(&self.live).buffers.insert(
            p as usize,
            Managed {
                len,
                uses: 0,
                freeing: false,
            },
        );
        self.count.fetch_add(1, Ordering::SeqCst);
        Some(p as usize)
    }

    /// A registration of `addr..addr + len` is about to start: counted in
    /// every managed buffer it overlaps — refused if one is being freed.
    /// Undone by [`lent_back`](Self::lent_back) (the registration failed,
    /// or was taken back to the end).
    pub(crate) fn lending(&self, addr: usize, len: usize) -> Result<(), NotLendable> {
        // Refused before it is recorded: `longest` would keep its length
        // (every later scan starting at address 0), and `at + len` of the
        // record overflow in a scan meanwhile.
        let end = addr
            .checked_add(len)
            .ok_or(NotLendable::PastTheAddressSpace)?;
        let mut live = lock(&self.live);
        if live.lendings.contains_key(&addr) {
            return Err(NotLendable::AlreadyLent);
        }
        // Buffers never overlap one another: walking down from `end`, the
        // first that ends at or before `addr` ends the overlapping ones.
        let buffers: SmallVec<[usize; 1]> = live
            .buffers
            .range(..end)
            .rev()
            .take_while(|(&start, m)| start + m.len > addr)
            .map(|(&start, _)| start)
            .collect();
        if let Some(&start) = buffers.iter().find(|s| live.buffers[s].freeing) {
            return Err(NotLendable::BeingFreed(start));
        }
        live.longest = live.longest.max(len);
        live.generations += 1;
        let generation = live.generations;
        // Batches in flight from this memory already use it.
        let mut uses = 0;
        for (_, f) in live.flights.iter_mut() {
            if f.ranges
                .iter()
                .any(|&(a, l)| a < end && addr < a.saturating_add(l))
            {
                f.late.push((addr, generation));
                uses += 1;
            }
        }
        // Before looking for uncounted batches (see `unaccounted`).
        self.count.fetch_add(1, Ordering::SeqCst);
        let after_unaccounted = self.unaccounted.load(Ordering::SeqCst) > 0;
        let lent = Lent {
            len,
            buffers,
            uses,
            closing: 0,
            generation,
            after_unaccounted,
        };
        live.lendings.insert(addr, lent);
        Ok(())
    }

    /// The registration at `addr` failed or was taken back to the end.
    pub(crate) fn lent_back(&self, addr: usize) {
        if lock(&self.live).lendings.remove(&addr).is_some() {
            self.count.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// `unregister_memory(addr)` starts: no batch may start using the
    /// registration at `addr` until [`end_unregister`](Self::end_unregister).
    pub(crate) fn begin_unregister(&self, addr: usize) {
        if let Some(l) = lock(&self.live).lendings.get_mut(&addr) {
            l.closing += 1;
        }
    }

    /// Waits up to `wait` for no batch of this engine to use the
    /// registration at `addr` (true; also if there is none). Uncounted
    /// batches ending notify nobody (they take no lock): a registration
    /// that waits for them finds them gone at its next call, so callers
    /// wait in short slices.
    pub(crate) fn wait_unused(&self, addr: usize, wait: Duration) -> bool {
        let until = quiesce_runtime::time::deadline_in(wait);
        let mut live = lock(&self.live);
        loop {
            let unaccounted = self.unaccounted.load(Ordering::SeqCst);
            match live.lendings.get_mut(&addr) {
                None => return true,
                Some(l) if l.uses == 0 && (!l.after_unaccounted || unaccounted == 0) => {
                    // None starts while `l` lives: none will again.
                    l.after_unaccounted = false;
                    return true;
                }
                Some(_) => {}
            }
            let left = until.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return false;
            }
            live.waiting_unused += 1;
            live = self
                .unused
                .wait_timeout(live, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
            live.waiting_unused -= 1;
        }
    }

    /// `unregister_memory(addr)` ends: the registration was taken back to
    /// the end (`taken_back`), or stays, usable again.
    pub(crate) fn end_unregister(&self, addr: usize, taken_back: bool) {
        if taken_back {
            self.lent_back(addr);
        } else if let Some(l) = lock(&self.live).lendings.get_mut(&addr) {
            l.closing = l.closing.saturating_sub(1);
        }
    }

    /// `free_managed_buffer(addr, len)` starts: refused while a batch uses
    /// the buffer or a registration other than its own (at `addr`) lies in
    /// it; else no registration may start in it until
    /// [`free`](Self::free) or [`end_free`](Self::end_free).
    pub(crate) fn begin_free(&self, addr: usize, len: usize) -> Result<(), Held> {
        let mut live = lock(&self.live);
        let other = live.lent_in(addr).find(|&at| at != addr);
        let Some(m) = live.buffers.get_mut(&addr).filter(|m| m.len == len) else {
            return Err(Held::NoSuchBuffer);
        };
        if m.freeing {
            return Err(Held::Freeing);
        }
        if m.uses > 0 {
            return Err(Held::InUse);
        }
        if let Some(at) = other {
            return Err(Held::LentAt(at));
        }
        m.freeing = true;
        Ok(())
    }

    /// A [`begin_free`](Self::begin_free) that did not end in a free.
    pub(crate) fn end_free(&self, addr: usize) {
        if let Some(m) = lock(&self.live).buffers.get_mut(&addr) {
            m.freeing = false;
        }
    }

    /// Frees the buffer allocated at `addr` with `len` bytes, unless a
    /// batch still uses it or a registration still lies in it; the caller
    /// took its own registration back.
    pub(crate) fn free(&self, addr: usize, len: usize) -> Free {
        let mut live = lock(&self.live);
        let lent = live.lent_in(addr).next().is_some();
        match live.buffers.get(&addr) {
            Some(m) if m.len != len => return Free::NoSuchBuffer,
            Some(m) if m.uses > 0 || lent => return Free::InUse,
            Some(_) => {}
            None => return Free::NoSuchBuffer,
        }
        live.buffers.remove(&addr);
        self.count.fetch_sub(1, Ordering::SeqCst);
        let layout = Layout::from_size_align(len, ALIGN).expect("allocated with this layout");
        // SAFETY: `addr` came from `alloc_zeroed` with this layout (the map
        // says so) and is removed from the map, so it is freed once; no
        // batch uses it (checked under the same lock).
        unsafe { dealloc(addr as *mut u8, layout) };
        Free::Done
    }

    /// Counts a batch's use of the managed buffers its local ranges
    /// (`(address, length)`) lie in and of the registrations they overlap;
    /// refused (the address of the registration, or of the buffer) if one
    /// of those is being unregistered, or a buffer freed.
    #[inline]
    pub(crate) fn take_uses(
        &self,
        locals: impl Iterator<Item = (usize, usize)>,
    ) -> Result<Uses, usize> {
        let mut locals = locals.peekable();
        if locals.peek().is_none() {
            // Nothing to count, nor to wait for.
            return Ok(Uses::default());
        }
        if self.count.load(Ordering::SeqCst) == 0 {
            // Counted before looking again (see `unaccounted`).
            self.unaccounted.fetch_add(1, Ordering::SeqCst);
            if self.count.load(Ordering::SeqCst) == 0 {
                return Ok(Uses {
                    unaccounted: true,
                    ..Uses::default()
                });
            }
            self.unaccounted.fetch_sub(1, Ordering::SeqCst);
        }
        self.count_uses(locals)
    }

    fn count_uses(&self, locals: impl Iterator<Item = (usize, usize)>) -> Result<Uses, usize> {
        let mut live = lock(&self.live);
        let mut uses = Uses::default();
        let mut flight = Flight::default();
        for (addr, len) in locals {
            flight.ranges.push((addr, len));
            let end = addr.saturating_add(len);
            // Every buffer the range overlaps, not only the one it starts
            // in: the host check asks only that the memory be mapped, and
            // the bytes just before an allocation are (its chunk's header),
            // so a range may start outside a buffer and run into one.
            // Buffers do not overlap: walking down from the last one that
            // starts before `end`, the first that ends at or before `addr`
            // ends the walk.
            let mut freeing = None;
            for (&start, m) in live.buffers.range_mut(..end).rev() {
                if start + m.len <= addr {
                    break;
                }
                // Its free has begun (and may have taken its registration
                // back already): a batch from it now would leave the free
                // at -2 with the buffer unregistered.
                if m.freeing {
                    freeing = Some(start);
                    break;
                }
                if !uses.buffers.contains(&start) {
                    m.uses += 1;
                    uses.buffers.push(start);
                }
            }
            if let Some(start) = freeing {
                drop(live);
                self.give_back(uses);
                return Err(start);
            }
            let over: SmallVec<[usize; 2]> = live.lent_over(addr, end).collect();
            for at in over {
                let l = live.lendings.get_mut(&at).expect("just found");
                if l.closing > 0 {
                    drop(live);
                    self.give_back(uses);
                    return Err(at);
                }
                if !uses.lendings.contains(&(at, l.generation)) {
                    l.uses += 1;
                    uses.lendings.push((at, l.generation));
                }
            }
        }
        uses.flight = Some(live.flights.insert(flight));
        Ok(uses)
    }

    /// Gives a batch's uses back: its outcome is final (0 or -1), or its
    /// -2 drained.
    #[inline]
    pub(crate) fn release(&self, uses: Uses) {
        if uses.unaccounted {
            self.unaccounted.fetch_sub(1, Ordering::SeqCst);
        }
        if uses.flight.is_some() {
            self.give_back(uses);
        }
    }

    fn give_back(&self, uses: Uses) {
        let mut live = lock(&self.live);
        for start in uses.buffers {
            if let Some(m) = live.buffers.get_mut(&start) {
                m.uses -= 1;
            }
        }
        let late = uses
            .flight
            .and_then(|k| live.flights.try_remove(k))
            .map(|f| f.late)
            .unwrap_or_default();
        // A registration's uses fall, and an unregister waits for them.
        let wake = (!uses.lendings.is_empty() || !late.is_empty()) && live.waiting_unused > 0;
        for (at, generation) in uses.lendings.into_iter().chain(late) {
            if let Some(l) = live
                .lendings
                .get_mut(&at)
                .filter(|l| l.generation == generation)
            {
                l.uses -= 1;
            }
        }
        drop(live);
        if wake {
            self.unused.notify_all();
        }
    }

    /// Whether `addr..addr + len` lies inside one managed buffer of `live`.
    fn holds(live: &Live, addr: usize, len: usize) -> bool {
        live.buffers
            .range(..=addr)
            .next_back()
            .is_some_and(|(&start, m)| {
                addr.checked_add(len)
                    .is_some_and(|end| end <= start + m.len)
            })
    }

    /// Copies `data` to `addr` (inside a managed buffer: checked). The lock
    /// is held for the copy: a `free` on another thread (free-threaded
    /// Python, or one that released the GIL) waits for it.
    pub(crate) fn write(&self, addr: usize, data: &[u8]) -> bool {
        let live = lock(&self.live);
        if !Self::holds(&live, addr, data.len()) {
            return false;
        }
        // SAFETY: the range lies inside a live managed buffer (checked), which
        // no `free` can take while this lock is held; `data` is a separate
        // Python bytes object.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        true
    }

    /// The `len` bytes at `addr` (inside a managed buffer: checked; the
    /// lock held for the copy, as for [`write`](Self::write)).
    pub(crate) fn read(&self, addr: usize, len: usize) -> Option<Vec<u8>> {
        let live = lock(&self.live);
        if !Self::holds(&live, addr, len) {
            return None;
        }
        let mut out = vec![0u8; len];
        // SAFETY: the range lies inside a live managed buffer (checked), which
        // no `free` can take while this lock is held.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len) };
        Some(out)
    }
}

impl Drop for ManagedBuffers {
    fn drop(&mut self) {
        // Dropped with the engine, after its thread stopped and drained: no
        // peer or transfer holds these any more.
        let live = std::mem::take(&mut lock(&self.live).buffers);
        for (addr, Managed { len, .. }) in live {
            let layout = Layout::from_size_align(len, ALIGN).expect("allocated with this layout");
            // SAFETY: allocated with this layout and never freed (it was
            // still in the map).
            unsafe { dealloc(addr as *mut u8, layout) };
        }
    }
}

#[cfg(test)]
mod tests;
