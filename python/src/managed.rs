//! Managed buffers (`allocate_managed_buffer`): page-aligned memory the
//! binding allocates, registers for peers, and frees only once nothing
//! holds it; `write_bytes_to_buffer` / `read_bytes_from_buffer` copy in and
//! out of them, and refuse addresses outside every one of them.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::collections::BTreeMap;
use std::sync::Mutex;

use crate::node::lock;

const ALIGN: usize = 4096;

/// The managed buffers alive now, by address.
#[derive(Default)]
pub(crate) struct ManagedBuffers {
    live: Mutex<BTreeMap<usize, usize>>,
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
        lock(&self.live).insert(p as usize, len);
        Some(p as usize)
    }

    /// Frees the buffer allocated at `addr` with `len` bytes; the caller
    /// made sure nothing holds it. False if there is no such buffer.
    pub(crate) fn free(&self, addr: usize, len: usize) -> bool {
        let mut live = lock(&self.live);
        if live.get(&addr) != Some(&len) {
            return false;
        }
        live.remove(&addr);
        let layout = Layout::from_size_align(len, ALIGN).expect("allocated with this layout");
        // SAFETY: `addr` came from `alloc_zeroed` with this layout (the map
        // says so) and is removed from the map, so it is freed once.
        unsafe { dealloc(addr as *mut u8, layout) };
        true
    }

    /// Whether `addr..addr + len` lies inside one managed buffer.
    pub(crate) fn holds(&self, addr: usize, len: usize) -> bool {
        let live = lock(&self.live);
        live.range(..=addr)
            .next_back()
            .is_some_and(|(&start, &n)| addr.checked_add(len).is_some_and(|end| end <= start + n))
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
        for (addr, len) in live {
            let layout = Layout::from_size_align(len, ALIGN).expect("allocated with this layout");
            // SAFETY: allocated with this layout and never freed (it was
            // still in the map).
            unsafe { dealloc(addr as *mut u8, layout) };
        }
    }
}
