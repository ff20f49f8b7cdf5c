//! Managed buffers (`allocate_managed_buffer`): page-aligned memory the
//! binding allocates, registers for peers, and frees only once nothing
//! holds it — no peer (its registration reclaimed) and no batch of this
//! engine (each batch counts the managed buffers its local ranges lie in,
//! as [`Uses`], until its outcome is final: after a -2, until it drained);
//! `write_bytes_to_buffer` / `read_bytes_from_buffer` copy in and out of
//! them, and refuse addresses outside every one of them.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;

use smallvec::SmallVec;

use crate::node::lock;

const ALIGN: usize = 4096;

/// One managed buffer.
struct Managed {
    len: usize,
    /// Batches whose local ranges lie in it and whose outcome is not final.
    uses: usize,
}

/// The managed buffers alive now, by address.
#[derive(Default)]
pub(crate) struct ManagedBuffers {
    live: Mutex<BTreeMap<usize, Managed>>,
    /// How many are live: a batch of the caller's own memory, with none
    /// allocated, counts its uses without the lock.
    count: AtomicUsize,
}

/// The managed buffers one batch uses (by address, each once): taken when
/// the batch is prepared, given back with [`ManagedBuffers::release`] once
/// nothing of the batch can touch them. Empty (and allocation-free) for a
/// batch of the caller's own memory.
#[derive(Default)]
#[must_use = "uses must be given back, or the buffers can never be freed"]
pub(crate) struct Uses(SmallVec<[usize; 2]>);

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
        lock(&self.live).insert(p as usize, Managed { len, uses: 0 });
        self.count.fetch_add(1, Ordering::Release);
        Some(p as usize)
    }

    /// Frees the buffer allocated at `addr` with `len` bytes, unless a
    /// batch still uses it; the caller made sure no peer holds it.
    pub(crate) fn free(&self, addr: usize, len: usize) -> Free {
        let mut live = lock(&self.live);
        match live.get(&addr) {
            Some(m) if m.len != len => return Free::NoSuchBuffer,
            Some(m) if m.uses > 0 => return Free::InUse,
            Some(_) => {}
            None => return Free::NoSuchBuffer,
        }
        live.remove(&addr);
        self.count.fetch_sub(1, Ordering::Release);
        let layout = Layout::from_size_align(len, ALIGN).expect("allocated with this layout");
        // SAFETY: `addr` came from `alloc_zeroed` with this layout (the map
        // says so) and is removed from the map, so it is freed once; no
        // batch uses it (checked under the same lock).
        unsafe { dealloc(addr as *mut u8, layout) };
        Free::Done
    }

    /// Whether a managed buffer of exactly `len` bytes starts at `addr`.
    pub(crate) fn is_buffer(&self, addr: usize, len: usize) -> bool {
        lock(&self.live).get(&addr).is_some_and(|m| m.len == len)
    }

    /// Whether a batch whose outcome is not final uses the buffer at `addr`.
    pub(crate) fn in_use(&self, addr: usize) -> bool {
        lock(&self.live).get(&addr).is_some_and(|m| m.uses > 0)
    }

    /// Counts a batch's use of the managed buffers its local buffers (by
    /// address) lie in.
    #[inline]
    pub(crate) fn take_uses(&self, buffers: impl Iterator<Item = usize>) -> Uses {
        // A buffer a batch uses was allocated before the batch was made (its
        // address came back from `allocate`): none live, none used.
        if self.count.load(Ordering::Acquire) == 0 {
            return Uses::default();
        }
        self.count_uses(buffers)
    }

    fn count_uses(&self, buffers: impl Iterator<Item = usize>) -> Uses {
        let mut live = lock(&self.live);
        let mut uses = Uses::default();
        for addr in buffers {
            // The buffer the range starts in (a range crossing its end was
            // refused by the host check: the next page is not its).
            let Some((&start, m)) = live.range_mut(..=addr).next_back() else {
                continue;
            };
            if addr - start < m.len && !uses.0.contains(&start) {
                m.uses += 1;
                uses.0.push(start);
            }
        }
        uses
    }

    /// Gives a batch's uses back: its outcome is final (0 or -1), or its
    /// -2 drained.
    #[inline]
    pub(crate) fn release(&self, uses: Uses) {
        if !uses.0.is_empty() {
            self.give_back(uses);
        }
    }

    fn give_back(&self, uses: Uses) {
        let mut live = lock(&self.live);
        for start in uses.0 {
            if let Some(m) = live.get_mut(&start) {
                m.uses -= 1;
            }
        }
    }

    /// Whether `addr..addr + len` lies inside one managed buffer.
    pub(crate) fn holds(&self, addr: usize, len: usize) -> bool {
        let live = lock(&self.live);
        live.range(..=addr).next_back().is_some_and(|(&start, m)| {
            addr.checked_add(len)
                .is_some_and(|end| end <= start + m.len)
        })
    }

    /// Copies `data` to `addr` (inside a managed buffer: checked).
    pub(crate) fn write(&self, addr: usize, data: &[u8]) -> bool {
        if !self.holds(addr, data.len()) {
            return false;
        }
        // SAFETY: the range lies inside a live managed buffer (checked), and
        // `data` is a separate Python bytes object.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), addr as *mut u8, data.len()) };
        true
    }

    /// The `len` bytes at `addr` (inside a managed buffer: checked).
    pub(crate) fn read(&self, addr: usize, len: usize) -> Option<Vec<u8>> {
        if !self.holds(addr, len) {
            return None;
        }
        let mut out = vec![0u8; len];
        // SAFETY: the range lies inside a live managed buffer (checked).
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len) };
        Some(out)
    }
}

impl Drop for ManagedBuffers {
    fn drop(&mut self) {
        // Dropped with the engine, after its thread stopped and drained: no
        // peer or transfer holds these any more.
        let live = std::mem::take(&mut *lock(&self.live));
        for (addr, Managed { len, .. }) in live {
            let layout = Layout::from_size_align(len, ALIGN).expect("allocated with this layout");
            // SAFETY: allocated with this layout and never freed (it was
            // still in the map).
            unsafe { dealloc(addr as *mut u8, layout) };
        }
    }
}
