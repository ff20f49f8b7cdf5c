//! A counting global allocator, for binaries that report heap use (the
//! `quiesce` command's `bench` and `soak`, and its `target`'s `heap`
//! command): allocations, frees and bytes live, counted with relaxed atomics
//! around the system allocator. Library code never installs it; a binary
//! opts in with
//!
//! ```ignore
//! #[global_allocator]
//! static HEAP: quiesce_runtime::heap::CountingAlloc = quiesce_runtime::heap::CountingAlloc;
//! ```
//!
//! Without it installed, [`Heap::now`] reads zeros.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

static ALLOCATIONS: AtomicU64 = AtomicU64::new(0);
static FREES: AtomicU64 = AtomicU64::new(0);
static ALLOCATED: AtomicU64 = AtomicU64::new(0);
static FREED: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting.
pub struct CountingAlloc;

// SAFETY: every call is forwarded unchanged to `System`, which upholds
// `GlobalAlloc`'s contract; the counters only observe.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for `alloc` is `System.alloc`'s.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            ALLOCATIONS.fetch_add(1, Relaxed);
            ALLOCATED.fetch_add(layout.size() as u64, Relaxed);
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as for `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            ALLOCATIONS.fetch_add(1, Relaxed);
            ALLOCATED.fetch_add(layout.size() as u64, Relaxed);
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        FREES.fetch_add(1, Relaxed);
        FREED.fetch_add(layout.size() as u64, Relaxed);
        // SAFETY: `ptr` came from this allocator (so from `System`) with
        // `layout`: the caller's contract.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for `realloc` is `System.realloc`'s.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            // A move counts as a free and an allocation.
            ALLOCATIONS.fetch_add(1, Relaxed);
            FREES.fetch_add(1, Relaxed);
            ALLOCATED.fetch_add(new_size as u64, Relaxed);
            FREED.fetch_add(layout.size() as u64, Relaxed);
        }
        p
    }
}

/// Heap counters of the whole process since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Heap {
    /// Allocations made (a `realloc` counts as one, and as one free).
    pub allocations: u64,
    /// Allocations freed.
    pub frees: u64,
    /// Bytes allocated and not freed now.
    pub live_bytes: i64,
}

impl Heap {
    /// The counters now (zeros unless [`CountingAlloc`] is the global
    /// allocator).
    pub fn now() -> Heap {
        // Freed first: a concurrent allocate-then-free never reads negative.
        let freed = FREED.load(Relaxed);
        let frees = FREES.load(Relaxed);
        Heap {
            allocations: ALLOCATIONS.load(Relaxed),
            frees,
            live_bytes: ALLOCATED.load(Relaxed) as i64 - freed as i64,
        }
    }

    /// Allocations not freed now.
    pub fn live(&self) -> i64 {
        self.allocations as i64 - self.frees as i64
    }
}
