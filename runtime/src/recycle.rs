//! Boxed futures whose heap blocks are reused by the next future of the
//! same size on the same thread.
//!
//! A batch's driver future lives in a box of its own for the batch's whole
//! life: 1.7 KiB for a one-task TCP write, past the largest block glibc's
//! per-thread cache (tcache, ≤ 1,032 bytes) keeps, so every batch paid a
//! `malloc` and a `free` through the arena's bins — ~360 instructions of a
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
//! * A thread keeps blocks of at most 8 layouts, at most 128 of each and
//!   256 KiB in all, none larger than 16 KiB; a layout whose blocks are all
//!   in use again gives its place to a new one. A block dropped while the
//!   thread's locals are torn down goes back to the allocator. (A
//!   [`RecycledFuture`] is `!Send`: it is dropped on the thread that made
//!   it.)
//!
//! A batch of many tasks boxes each transfer's future too (~1.2 KiB for a
//! TCP write) and spawns a task per transfer: with 64 of them alive at once
//! glibc's tcache (7 blocks a size) overflows even for small sizes, so the
//! executor's tasks and the futures in them are recycled as well.

use std::alloc::{alloc, dealloc, handle_alloc_error, Layout};
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::task::{Context, Poll};

/// Most layouts a thread keeps blocks of.
const CLASSES: usize = 8;
/// Most blocks of one layout a thread keeps: a 64-task batch's worth of
/// two kinds (a spawned transfer's harness and the future in it may share a
/// layout).
const PER_CLASS: usize = 128;
/// Most bytes a thread keeps in all.
const KEPT_BYTES: usize = 256 << 10;
/// The largest block a thread keeps (larger ones go back at once).
const MAX_BLOCK: usize = 16 << 10;

/// A thread's free blocks, by layout.
struct FreeBlocks {
    classes: Vec<(Layout, Vec<NonNull<u8>>)>,
    bytes: usize,
}

impl FreeBlocks {
    fn take(&mut self, layout: Layout) -> Option<NonNull<u8>> {
        let (_, blocks) = self.classes.iter_mut().find(|(l, _)| *l == layout)?;
        let b = blocks.pop()?;
        self.bytes -= layout.size();
        Some(b)
    }

    /// Keeps `block` if there is room; hands it back otherwise.
    fn keep(&mut self, layout: Layout, block: NonNull<u8>) -> Result<(), NonNull<u8>> {
        if layout.size() > MAX_BLOCK || self.bytes + layout.size() > KEPT_BYTES {
            return Err(block);
        }
        let i = match self.classes.iter().position(|(l, _)| *l == layout) {
            Some(i) => i,
            None if self.classes.len() < CLASSES => {
                self.classes.push((layout, Vec::new()));
                self.classes.len() - 1
            }
            // A layout no longer in use gives its place up: the classes
            // follow what the thread allocates now, not what it did first.
            None => match self.classes.iter().position(|(_, b)| b.is_empty()) {
                Some(i) => {
                    self.classes[i].0 = layout;
                    i
                }
                None => return Err(block),
            },
        };
        let blocks = &mut self.classes[i].1;
        if blocks.len() >= PER_CLASS {
            return Err(block);
        }
        blocks.push(block);
        self.bytes += layout.size();
        Ok(())
    }
}

impl Drop for FreeBlocks {
    fn drop(&mut self) {
        for (layout, blocks) in self.classes.drain(..) {
            for block in blocks {
                // SAFETY: a kept block was allocated with `layout` and nothing
                // else owns it (module invariant).
                unsafe { dealloc(block.as_ptr(), layout) };
            }
        }
    }
}

thread_local! {
    static FREE: RefCell<FreeBlocks> = const {
        RefCell::new(FreeBlocks { classes: Vec::new(), bytes: 0 })
    };
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

/// A `!Send` boxed future (`Pin<Box<dyn Future<Output = T>>>`) whose heap
/// block is reused by the thread's next future of the same layout.
pub struct RecycledFuture<T = ()> {
    fut: NonNull<dyn Future<Output = T>>,
}

impl<T> RecycledFuture<T> {
    /// Moves `fut` into a block of its size (a reused one if the thread has
    /// one).
    pub fn new<F: Future<Output = T> + 'static>(fut: F) -> RecycledFuture<T> {
        Self::new_with(|| fut)
    }

    /// Makes the future with `make` straight in its block: the block is
    /// taken first, so a large future (an `async` block's whole state) is
    /// built in place rather than on the stack and copied.
    #[inline(always)]
    pub fn new_with<F: Future<Output = T> + 'static>(
        make: impl FnOnce() -> F,
    ) -> RecycledFuture<T> {
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

    fn pinned(&mut self) -> Pin<&mut (dyn Future<Output = T> + 'static)> {
        // SAFETY: the future is live and owned by `self` (`&mut self` is the
        // only access), and it never moves before its drop in place.
        unsafe { Pin::new_unchecked(self.fut.as_mut()) }
    }
}

impl<T> Future for RecycledFuture<T> {
    type Output = T;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        self.pinned().poll(cx)
    }
}

impl<T> Drop for RecycledFuture<T> {
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

impl<T> std::fmt::Debug for RecycledFuture<T> {
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

    fn addr<T>(f: &RecycledFuture<T>) -> usize {
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
        let live: Vec<_> = (0..PER_CLASS + 4)
            .map(|_| make::<2048>(&polls, &drops))
            .collect();
        let mut seen: Vec<usize> = live.iter().map(addr).collect();
        seen.sort_unstable();
        seen.dedup();
        assert_eq!(
            seen.len(),
            PER_CLASS + 4,
            "every live future has its own block"
        );
        drop(live);
        assert_eq!(drops.get() as usize, PER_CLASS + 5);
        FREE.with(|f| {
            let f = f.borrow();
            assert!(f.classes.iter().all(|(_, b)| b.len() <= PER_CLASS));
            assert!(f.bytes <= KEPT_BYTES);
        });
    }

    #[test]
    fn an_emptied_class_gives_its_place_to_a_new_layout() {
        let mut f = FreeBlocks {
            classes: Vec::new(),
            bytes: 0,
        };
        // Fill every class with one block, then empty the first.
        let layouts: Vec<Layout> = (1..=CLASSES)
            .map(|i| Layout::from_size_align(i * 64, 8).unwrap())
            .collect();
        for &l in &layouts {
            f.keep(l, block(l)).unwrap();
        }
        let extra = Layout::from_size_align(4096, 8).unwrap();
        let b = block(extra);
        let b = f.keep(extra, b).expect_err("no class is free");
        // SAFETY: `b` came back unkept; it was allocated with `extra`.
        unsafe { dealloc(b.as_ptr(), extra) };
        let first = f.take(layouts[0]).unwrap();
        // SAFETY: taken from the list, allocated with `layouts[0]`.
        unsafe { dealloc(first.as_ptr(), layouts[0]) };
        let b = block(extra);
        f.keep(extra, b)
            .expect("the emptied class takes the new layout");
        assert_eq!(f.take(extra), Some(b));
        assert_eq!(f.take(layouts[0]), None);
        // SAFETY: taken from the list, allocated with `extra`.
        unsafe { dealloc(b.as_ptr(), extra) };
        drop(f);
    }

    struct Done;
    impl Future for Done {
        type Output = ();
        fn poll(self: Pin<&mut Self>, _: &mut Context<'_>) -> Poll<()> {
            Poll::Ready(())
        }
    }

    #[test]
    fn the_output_comes_out_of_the_block() {
        let mut f = RecycledFuture::new(async { vec![1u8, 2, 3] });
        let Poll::Ready(v) = Pin::new(&mut f).poll(&mut Context::from_waker(Waker::noop())) else {
            panic!("an async block without awaits is ready at once");
        };
        assert_eq!(v, [1, 2, 3]);
    }

    #[test]
    fn zero_sized_futures_allocate_nothing() {
        let mut f = RecycledFuture::new(Done);
        assert!(Pin::new(&mut f)
            .poll(&mut Context::from_waker(Waker::noop()))
            .is_ready());
    }
}
