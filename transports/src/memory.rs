//! Memory that transfers read and write: page-aligned buffers, regions
//! leased in blocks (how KV arenas are used), segment memory exposed to
//! peers, and windows into it that the driver can lend to the kernel.
//!
//! Its `unsafe` code (beside [`crate::tcp::split`]'s and the RDMA verbs' and
//! memory registrations') is raw allocations whose bytes may be written by
//! the kernel (and so by remote peers) while other handles exist.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::ops::{Deref, DerefMut, Range};
use std::ptr::NonNull;
use std::rc::Rc;

use quiesce_runtime::{IoBuf, IoBufMut};

const PAGE: usize = 4096;

/// A zeroed, page-aligned heap buffer.
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
}

impl AlignedBuf {
    /// Allocates `len` zeroed bytes aligned to 4 KiB (`len` may be 0).
    pub fn new(len: usize) -> AlignedBuf {
        if len == 0 {
            return AlignedBuf {
                ptr: NonNull::dangling(),
                len,
            };
        }
        let layout = Layout::from_size_align(len, PAGE).expect("buffer size overflows");
        // SAFETY: the layout has a non-zero size.
        let ptr = unsafe { alloc_zeroed(layout) };
        AlignedBuf {
            ptr: NonNull::new(ptr).unwrap_or_else(|| std::alloc::handle_alloc_error(layout)),
            len,
        }
    }

    /// A page-aligned copy of `bytes`.
    pub fn from_slice(bytes: &[u8]) -> AlignedBuf {
        let mut b = AlignedBuf::new(bytes.len());
        b.copy_from_slice(bytes);
        b
    }

    fn raw(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `new` with exactly this layout.
            unsafe {
                dealloc(
                    self.ptr.as_ptr(),
                    Layout::from_size_align_unchecked(self.len, PAGE),
                )
            };
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes live at `ptr` while self lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` is exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

// SAFETY: a fixed heap allocation that does not move with the value.
unsafe impl IoBuf for AlignedBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: every byte is initialised (zeroed at allocation).
unsafe impl IoBufMut for AlignedBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

/// Why a lease cannot be taken.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LeaseError {
    /// The range is outside the region (or empty).
    #[error("range {start}..{end} is outside the region of {len} bytes")]
    OutOfBounds {
        /// Start of the range asked for.
        start: usize,
        /// End of the range asked for.
        end: usize,
        /// The region's length.
        len: usize,
    },
    /// The range overlaps a block that is leased now.
    #[error("range {start}..{end} overlaps a leased block")]
    Overlap {
        /// Start of the range asked for.
        start: usize,
        /// End of the range asked for.
        end: usize,
    },
}

struct RegionInner {
    mem: AlignedBuf,
    /// start → end of each live lease.
    leased: RefCell<BTreeMap<usize, usize>>,
}

/// A large page-aligned pool from which blocks are leased for transfers.
///
/// Two live leases never overlap, so each lease is exclusive access to its
/// block; a lease moved into a transfer comes back with the outcome.
#[derive(Clone)]
pub struct Region {
    inner: Rc<RegionInner>,
}

impl Region {
    /// A zeroed region of `len` bytes.
    pub fn new(len: usize) -> Region {
        Region {
            inner: Rc::new(RegionInner {
                mem: AlignedBuf::new(len),
                leased: RefCell::default(),
            }),
        }
    }

    /// The region's length.
    pub fn len(&self) -> usize {
        self.inner.mem.len
    }

    /// True for a zero-length region.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Start and length, for memory registration.
    pub(crate) fn raw(&self) -> (*mut u8, usize) {
        (self.inner.mem.raw(), self.len())
    }

    /// Leases `range` exclusively.
    pub fn lease(&self, range: Range<usize>) -> Result<Lease, LeaseError> {
        let (start, end) = (range.start, range.end);
        if start >= end || end > self.len() {
            return Err(LeaseError::OutOfBounds {
                start,
                end,
                len: self.len(),
            });
        }
        let mut leased = self.inner.leased.borrow_mut();
        let before = leased.range(..end).next_back();
        if before.is_some_and(|(_, &e)| e > start) {
            return Err(LeaseError::Overlap { start, end });
        }
        leased.insert(start, end);
        Ok(Lease {
            region: self.inner.clone(),
            start,
            end,
        })
    }
}

/// An exclusive block of a [`Region`]; returned to it when dropped.
pub struct Lease {
    region: Rc<RegionInner>,
    start: usize,
    end: usize,
}

impl Lease {
    /// Where the block starts in its region.
    pub fn offset(&self) -> usize {
        self.start
    }
    fn ptr(&self) -> *mut u8 {
        self.region.mem.raw().wrapping_add(self.start)
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.region.leased.borrow_mut().remove(&self.start);
    }
}

impl Deref for Lease {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the block lies inside the region, which this lease keeps alive,
        // and no other live lease overlaps it.
        unsafe { std::slice::from_raw_parts(self.ptr(), self.end - self.start) }
    }
}

impl DerefMut for Lease {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above; the lease is the block's only handle.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(), self.end - self.start) }
    }
}

// SAFETY: the block is inside a heap allocation kept alive by the Rc.
unsafe impl IoBuf for Lease {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr()
    }
    fn bytes_init(&self) -> usize {
        self.end - self.start
    }
    fn bytes_total(&self) -> usize {
        self.end - self.start
    }
}

// SAFETY: the block is exclusive to this lease and always initialised.
unsafe impl IoBufMut for Lease {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// Memory the caller owns and lends to an engine as a segment: a Python
/// buffer, a tensor's storage, memory of another allocator. The engine
/// reaches it through raw pointers, as any segment's memory. When nothing
/// can touch it any more — the segment deregistered and its handles
/// dropped, every write landing in it and every read sending from it
/// reaped, every RDMA memory region of it deregistered — `on_release` runs,
/// on the engine's thread: from then on the memory is the caller's again.
/// To stop writes that are landing first, revoke the whole segment
/// ([`Segment::revoke`](crate::Segment::revoke)) before deregistering it.
pub struct ForeignMemory {
    ptr: *mut u8,
    len: usize,
    on_release: Option<Box<dyn FnOnce()>>,
}

impl ForeignMemory {
    /// Lends `ptr..ptr + len`.
    ///
    /// # Safety
    ///
    /// The range must be valid for reads and writes (and non-null if
    /// `len > 0`) until `on_release` has run, and nothing but the engine may
    /// write it meanwhile. The caller may read it, racing remote writes
    /// (some mix of old and new bytes).
    pub unsafe fn new(
        ptr: *mut u8,
        len: usize,
        on_release: impl FnOnce() + 'static,
    ) -> ForeignMemory {
        ForeignMemory {
            ptr,
            len,
            on_release: Some(Box::new(on_release)),
        }
    }
}

impl Drop for ForeignMemory {
    fn drop(&mut self) {
        if let Some(f) = self.on_release.take() {
            f();
        }
    }
}

/// Memory exposed to peers: remote writes land in it while local handles
/// exist, so it is only ever reached through raw pointers and copies.
pub(crate) struct ExposedMemory {
    ptr: *mut u8,
    len: usize,
    _owner: Box<dyn std::any::Any>,
}

impl ExposedMemory {
    pub(crate) fn from_vec(mut v: Vec<u8>) -> ExposedMemory {
        let (ptr, len) = (v.as_mut_ptr(), v.len());
        ExposedMemory {
            ptr,
            len,
            _owner: Box::new(v),
        }
    }

    pub(crate) fn from_foreign(f: ForeignMemory) -> ExposedMemory {
        let (ptr, len) = (f.ptr, f.len);
        ExposedMemory {
            ptr,
            len,
            _owner: Box::new(f),
        }
    }

    pub(crate) fn from_aligned(b: AlignedBuf) -> ExposedMemory {
        let (ptr, len) = (b.raw(), b.len);
        ExposedMemory {
            ptr,
            len,
            _owner: Box::new(b),
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Start and length, for memory registration.
    pub(crate) fn raw(&self) -> (*mut u8, usize) {
        (self.ptr, self.len)
    }

    /// Copies `dst.len()` bytes from `offset`. The caller checked bounds.
    pub(crate) fn copy_out(&self, offset: usize, dst: &mut [u8]) {
        assert!(offset.checked_add(dst.len()).is_some_and(|e| e <= self.len));
        // SAFETY: the range is inside the allocation (asserted); a concurrent
        // remote write may race, which yields some mix of old and new bytes.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(offset), dst.as_mut_ptr(), dst.len()) };
    }

    /// Copies `src` to `offset`. The caller checked bounds.
    pub(crate) fn copy_in(&self, offset: usize, src: &[u8]) {
        assert!(offset.checked_add(src.len()).is_some_and(|e| e <= self.len));
        // SAFETY: the range is inside the allocation (asserted).
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(offset), src.len()) };
    }
}

/// A range of exposed memory lent to one operation; keeps the memory alive.
pub(crate) struct Window {
    mem: Rc<ExposedMemory>,
    offset: usize,
    len: usize,
    /// Held as long as the op holds the window — a parked op until its final
    /// CQE — so registrations of a landing write end only once it is reaped.
    _keep: Option<Rc<dyn std::any::Any>>,
}

impl Window {
    /// The caller has validated `offset + len <= mem.len()`.
    pub(crate) fn new(mem: Rc<ExposedMemory>, offset: usize, len: usize) -> Window {
        assert!(offset.checked_add(len).is_some_and(|e| e <= mem.len()));
        Window {
            mem,
            offset,
            len,
            _keep: None,
        }
    }

    /// The window also keeps `keep` alive while an op holds it.
    pub(crate) fn keeping(mut self, keep: Rc<dyn std::any::Any>) -> Window {
        self._keep = Some(keep);
        self
    }
}

// SAFETY: the range lies inside the allocation that the Rc keeps alive.
unsafe impl IoBuf for Window {
    fn stable_ptr(&self) -> *const u8 {
        self.mem.ptr.wrapping_add(self.offset)
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; exposed memory is written through raw pointers only.
unsafe impl IoBufMut for Window {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.mem.ptr.wrapping_add(self.offset)
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leases_are_exclusive_and_return_on_drop() {
        let r = Region::new(1 << 20);
        let a = r.lease(0..4096).unwrap();
        assert!(matches!(
            r.lease(4000..5000),
            Err(LeaseError::Overlap { .. })
        ));
        let b = r.lease(4096..8192).unwrap();
        assert!(matches!(
            r.lease(0..(2 << 20)),
            Err(LeaseError::OutOfBounds { .. })
        ));
        assert!(matches!(r.lease(5..5), Err(LeaseError::OutOfBounds { .. })));
        drop(a);
        let mut a2 = r.lease(0..4096).unwrap();
        a2[0] = 1;
        assert_eq!(b.offset(), 4096);
        assert_eq!(a2.as_ptr() as usize % 4096, 0);
    }
}
