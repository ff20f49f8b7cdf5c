//! Boxed futures whose heap blocks are reused by the next future of the
//! same size on the same thread.
//!
//! A batch's driver future lives in a box of its own for the batch's whole
//! life: 1.7 KiB for a one-task TCP write, past the largest block glibc's
//! per-thread cache (tcache, ≤ 1,032 bytes) keeps, so every batch paid a
//! `malloc` and a `free` through the arena's bins — ~400 instructions of a
//! 4 KiB write's ~6,800 (docs/BENCHMARKS.md). A [`RecycledFuture`] puts its
//! block on its thread's short free list when it is dropped, and the next
//! one of the same layout takes it back: a batch after the first allocates
//! nothing for its driver.
//!
//! Invariants:
//! * A block on a free list is owned by nothing else and was allocated by
//!   the global allocator with exactly the layout recorded beside it.
//! * A [`RecycledFuture`] owns its block and the live future in it from
//!   [`new`](RecycledFuture::new) until its drop, which drops the future in
//!   place, then frees or keeps the block. The future never moves (the
//!   handle is a pointer), so polling it pinned is sound.
//! * A free list holds at most [`FREE_BLOCKS`] blocks of at most
//!   [`MAX_BLOCK`] bytes; a block dropped on another thread, or while the
//!   thread's locals are torn down, goes back to the allocator.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::task::{Context, Poll};

/// Most blocks a thread keeps for reuse.
const FREE_BLOCKS: usize = 8;
/// The largest block a thread keeps (larger ones go back at once).
const MAX_BLOCK: usize = 16 << 10;

/// A thread's free blocks, by layout.
struct FreeBlocks {
    blocks: Vec<(Layout, NonNull<u8>)>,
}

impl FreeBlocks {
    fn take(&mut self, layout: Layout) -> Option<NonNull<u8>> {
        let i = self.blocks.iter().position(|(l, _)| *l == layout)?;
        Some(self.blocks.swap_remove(i).1)
    }

    /// Keeps `block` if there is room; hands it back otherwise.
    fn keep(&mut self, layout: Layout, block: NonNull<u8>) -> Result<(), NonNull<u8>> {
        if self.blocks.len() >= FREE_BLOCKS || layout.size() > MAX_BLOCK {
            return Err(block);
        }
        if self.blocks.capacity() == 0 {
            self.blocks.reserve_exact(FREE_BLOCKS);
        }
        self.blocks.push((layout, block));
        Ok(())
    }
}

impl Drop for FreeBlocks {
    fn drop(&mut self) {
        for (layout, block) in self.blocks.drain(..) {
            // SAFETY: a kept block was allocated with `layout` and nothing
            // else owns it (module invariant).
            unsafe { dealloc(block.as_ptr(), layout) };
        }
    }
}

thread_local! {
    static FREE: RefCell<FreeBlocks> = const { RefCell::new(FreeBlocks { blocks: Vec::new() }) };
}

/// A block of `layout` (non-zero size): a kept one, or a new one.
fn block(layout: Layout) -> NonNull<u8> {
    let kept = FREE
        .try_with(|f| f.try_borrow_mut().ok()?.take(layout))
        .ok()
        .flatten();
    kept.unwrap_or_else(|| {
        // SAFETY: `layout` has a non-zero size (checked by the caller).
        let p = unsafe { alloc(layout) };
        NonNull::new(p).unwrap_or_else(|| handle_alloc_error(layout))
    })
}

/// Keeps `block` for the next future of the same layout, or frees it.
fn release(layout: Layout, block: NonNull<u8>) {
    let back = FREE
        .try_with(|f| match f.try_borrow_mut() {
            Ok(mut f) => f.keep(layout, block),
            Err(_) => Err(block),
        })
        .unwrap_or(Err(block));
    if let Err(block) = back {
        // SAFETY: `block` was allocated with `layout` and is owned by the
        // caller, which no longer uses it.
        unsafe { dealloc(block.as_ptr(), layout) };
    }
}

/// A `!Send` boxed future (`Pin<Box<dyn Future<Output = ()>>>`) whose heap
/// block is reused by the thread's next future of the same layout.
pub struct RecycledFuture {
    fut: NonNull<dyn Future<Output = ()>>,
}

impl RecycledFuture {
    /// Moves `fut` into a block of its size (a reused one if the thread has
    /// one).
    pub fn new<F: Future<Output = ()> + 'static>(fut: F) -> RecycledFuture {
        Self::new_with(|| fut)
    }

    /// Makes the future with `make` straight in its block: the block is
    /// taken first, so a large future (an `async` block's whole state) is
    /// built in place rather than on the stack and copied.
    #[inline(always)]
    pub fn new_with<F: Future<Output = ()> + 'static>(make: impl FnOnce() -> F) -> RecycledFuture {
        let layout = Layout::new::<F>();
        let p = if layout.size() == 0 {
            // Nothing to allocate: a dangling, aligned pointer is a valid
            // place for a zero-sized value.
            NonNull::<F>::dangling()
        } else {
            block(layout).cast::<F>()
        };
        // SAFETY: `p` is a block of `F`'s layout that nothing else owns (or
        // dangling for a zero-sized `F`, whose write touches no memory).
        unsafe { p.as_ptr().write(make()) };
        RecycledFuture { fut: p }
    }

    fn pinned(&mut self) -> Pin<&mut (dyn Future<Output = ()> + 'static)> {
        // SAFETY: the future is live and owned by `self` (`&mut self` is the
        // only access), and it never moves before its drop in place.
        unsafe { Pin::new_unchecked(self.fut.as_mut()) }
    }
}

impl Future for RecycledFuture {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        self.pinned().poll(cx)
    }
}

impl Drop for RecycledFuture {
    fn drop(&mut self) {
        // SAFETY: the future is live and owned by `self`; its layout is read
        // before it is dropped.
        let layout = unsafe { Layout::for_value(self.fut.as_ref()) };
        // SAFETY: dropped once, in place, where it was pinned; the block is
        // not touched through `self.fut` afterwards.
        unsafe { std::ptr::drop_in_place(self.fut.as_ptr()) };
        if layout.size() != 0 {
            release(layout, self.fut.cast::<u8>());
        }
    }
}

impl std::fmt::Debug for RecycledFuture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RecycledFuture")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;
    use std::task::Waker;

    /// A future of `N` bytes that counts its polls and drops.
    struct Sized<const N: usize> {
        _pad: [u8; N],
        polls: Rc<Cell<u32>>,
        drops: Rc<Cell<u32>>,
    }

    impl<const N: usize> Future for Sized<N> {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            self.polls.set(self.polls.get() + 1);
            Poll::Ready(())
        }
    }

    impl<const N: usize> Drop for Sized<N> {
        fn drop(&mut self) {
            self.drops.set(self.drops.get() + 1);
        }
    }

    fn make<const N: usize>(polls: &Rc<Cell<u32>>, drops: &Rc<Cell<u32>>) -> RecycledFuture {
        RecycledFuture::new(Sized::<N> {
            _pad: [0; N],
            polls: polls.clone(),
            drops: drops.clone(),
        })
    }

    fn addr(f: &RecycledFuture) -> usize {
        f.fut.cast::<u8>().as_ptr() as usize
    }

    #[test]
    fn a_dropped_block_serves_the_next_future_of_its_layout_only() {
        let (polls, drops) = (Rc::default(), Rc::default());
        let mut a = make::<1760>(&polls, &drops);
        assert!(Pin::new(&mut a)
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready());
        let first = addr(&a);
        drop(a);
        assert_eq!(
            (polls.get(), drops.get()),
            (1, 1),
            "polled and dropped in place"
        );
        // Another layout does not take it; the same layout does.
        let b = make::<900>(&polls, &drops);
        assert_ne!(addr(&b), first);
        let c = make::<1760>(&polls, &drops);
        assert_eq!(addr(&c), first, "the block was reused");
        drop((b, c));
        assert_eq!(drops.get(), 3);
    }

    #[test]
    fn a_live_block_is_never_handed_out() {
        let (polls, drops) = (Rc::default(), Rc::default());
        // A free block of the layout first: it may serve one of them only.
        drop(make::<2048>(&polls, &drops));
        let live: Vec<_> = (0..FREE_BLOCKS + 4)
            .map(|_| make::<2048>(&polls, &drops))
            .collect();
        let mut seen: Vec<usize> = live.iter().map(addr).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(
            seen.len(),
            FREE_BLOCKS + 4,
            "every live future has its own block"
        );
        drop(live);
        assert_eq!(drops.get() as usize, FREE_BLOCKS + 5);
        FREE.with(|f| assert!(f.borrow().blocks.len() <= FREE_BLOCKS));
    }

    struct Done;
    impl Future for Done {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            Poll::Ready(())
        }
    }

    #[test]
    fn zero_sized_futures_allocate_nothing() {
        let mut f = RecycledFuture::new(Done);
        assert!(Pin::new(&mut f)
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready());
    }
}
