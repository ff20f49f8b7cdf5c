//! Owned buffers that can be lent to the kernel.
//!
//! An operation takes its buffer by value and gives it back with the result
//! ([`BufResult`]). While the operation is in flight nobody else can reach the
//! buffer, and if the operation's future is dropped early the driver keeps the
//! buffer until the kernel has let go of it. The traits below are what a
//! buffer type promises so that this is sound.

use std::ops::{Bound, RangeBounds};

/// The result of an operation on an owned buffer: the I/O result and the buffer back.
pub type BufResult<T, B> = (std::io::Result<T>, B);

/// A buffer the kernel may read while an operation is in flight.
///
/// # Safety
///
/// `stable_ptr` must point to `bytes_init()` initialised bytes that stay valid
/// and at the same address for as long as the value lives, even when the value
/// itself is moved (the bytes live on the heap or in static memory).
pub unsafe trait IoBuf: Unpin + 'static {
    /// Address of the first byte.
    fn stable_ptr(&self) -> *const u8;
    /// Number of initialised bytes, the ones a write sends.
    fn bytes_init(&self) -> usize;
    /// Capacity: the number of bytes a read may fill.
    fn bytes_total(&self) -> usize;

    /// A view of `range` of this buffer that owns the buffer.
    ///
    /// # Panics
    /// If the range is outside `bytes_total()`.
    fn slice(self, range: impl RangeBounds<usize>) -> Slice<Self>
    where
        Self: Sized,
    {
        let begin = match range.start_bound() {
            Bound::Included(&n) => n,
            Bound::Excluded(&n) => n + 1,
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(&n) => n + 1,
            Bound::Excluded(&n) => n,
            Bound::Unbounded => self.bytes_total(),
        };
        assert!(
            begin <= end && end <= self.bytes_total(),
            "slice {begin}..{end} out of range"
        );
        Slice {
            buf: self,
            begin,
            end,
        }
    }
}

/// A buffer the kernel may write while an operation is in flight.
///
/// # Safety
///
/// As for [`IoBuf`], and `stable_mut_ptr` must be valid for writes of
/// `bytes_total()` bytes.
pub unsafe trait IoBufMut: IoBuf {
    /// Address of the first byte, for writing.
    fn stable_mut_ptr(&mut self) -> *mut u8;
    /// Marks the first `pos` bytes initialised (never shrinks).
    ///
    /// # Safety
    /// The first `pos` bytes must have been written.
    unsafe fn set_init(&mut self, pos: usize);
}

// SAFETY: a Vec's heap storage does not move when the Vec is moved; `len`
// bytes are initialised and `capacity` bytes are allocated.
unsafe impl IoBuf for Vec<u8> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.capacity()
    }
}

// SAFETY: as above; `set_len` is only raised to bytes the kernel wrote.
unsafe impl IoBufMut for Vec<u8> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, pos: usize) {
        if self.len() < pos {
            // SAFETY: the caller guarantees the first `pos` bytes were written,
            // and pos <= capacity because the op was bounded by bytes_total.
            unsafe { self.set_len(pos) };
        }
    }
}

// SAFETY: a boxed slice is a fixed heap allocation, fully initialised.
unsafe impl IoBuf for Box<[u8]> {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

// SAFETY: every byte of a boxed slice is always initialised.
unsafe impl IoBufMut for Box<[u8]> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

// SAFETY: static memory never moves and is never freed.
unsafe impl IoBuf for &'static [u8] {
    fn stable_ptr(&self) -> *const u8 {
        self.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.len()
    }
    fn bytes_total(&self) -> usize {
        self.len()
    }
}

/// A range of an owned buffer; the range is what an operation reads or fills.
#[derive(Debug)]
pub struct Slice<B> {
    buf: B,
    begin: usize,
    end: usize,
}

impl<B: IoBuf> Slice<B> {
    /// Start of the range within the buffer.
    pub fn begin(&self) -> usize {
        self.begin
    }
    /// End of the range within the buffer.
    pub fn end(&self) -> usize {
        self.end
    }
    /// The whole underlying buffer.
    pub fn get_ref(&self) -> &B {
        &self.buf
    }
    /// Gives the underlying buffer back.
    pub fn into_inner(self) -> B {
        self.buf
    }
}

// SAFETY: the range lies within the inner buffer's stable allocation.
unsafe impl<B: IoBuf> IoBuf for Slice<B> {
    fn stable_ptr(&self) -> *const u8 {
        self.buf.stable_ptr().wrapping_add(self.begin)
    }
    fn bytes_init(&self) -> usize {
        self.buf.bytes_init().clamp(self.begin, self.end) - self.begin
    }
    fn bytes_total(&self) -> usize {
        self.end - self.begin
    }
}

// SAFETY: as above; set_init is translated to the inner buffer's offsets.
unsafe impl<B: IoBufMut> IoBufMut for Slice<B> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.buf.stable_mut_ptr().wrapping_add(self.begin)
    }
    unsafe fn set_init(&mut self, pos: usize) {
        // The inner buffer's initialised bytes are a prefix: the slice's bytes
        // extend it only if that prefix already reaches `begin`. Otherwise the
        // bytes between would be marked without ever having been written.
        if self.buf.bytes_init() >= self.begin {
            // SAFETY: bytes up to `begin` are initialised (just checked) and the
            // caller guarantees the slice's first `pos` bytes were written.
            unsafe { self.buf.set_init(self.begin + pos) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slice_ranges() {
        let v = vec![1u8, 2, 3, 4, 5];
        let s = v.slice(1..3);
        assert_eq!(s.bytes_total(), 2);
        assert_eq!(s.bytes_init(), 2);
        let v = s.into_inner();
        let s = v.slice(3..);
        assert_eq!(s.bytes_total(), 2);
    }

    #[test]
    fn vec_capacity_is_total() {
        let v: Vec<u8> = Vec::with_capacity(64);
        assert_eq!(v.bytes_init(), 0);
        assert!(v.bytes_total() >= 64);
    }
}
