//! One owned buffer split into disjoint parts that several operations use at
//! once (the slices of a striped transfer). The buffer comes back whole only
//! when every part is gone, i.e. when every operation that used a part has
//! returned it — which is the quiescence of the transfer.

use std::cell::UnsafeCell;
use std::rc::Rc;

use quiesce_runtime::{IoBuf, IoBufMut, JoinError, JoinHandle};

use crate::error::TransferError;

struct Inner<B> {
    buf: UnsafeCell<B>,
    ptr: *mut u8,
    len: usize,
}

/// The owner's handle: hands out parts, and gives the buffer back.
pub(crate) struct SplitBuf<B> {
    inner: Rc<Inner<B>>,
}

impl<B: IoBuf> SplitBuf<B> {
    /// Shares a source buffer; parts cover its initialised bytes.
    pub(crate) fn source(buf: B) -> SplitBuf<B> {
        let (ptr, len) = (buf.stable_ptr() as *mut u8, buf.bytes_init());
        SplitBuf {
            inner: Rc::new(Inner {
                buf: UnsafeCell::new(buf),
                ptr,
                len,
            }),
        }
    }

    /// A part `offset..offset + len`. The caller hands out disjoint parts.
    pub(crate) fn part(&self, offset: usize, len: usize) -> Part<B> {
        assert!(
            offset.checked_add(len).is_some_and(|e| e <= self.inner.len),
            "part out of range"
        );
        Part {
            inner: self.inner.clone(),
            offset,
            len,
        }
    }

    /// The buffer, once no part is alive; otherwise `self` back.
    pub(crate) fn try_into_inner(self) -> Result<B, SplitBuf<B>> {
        match Rc::try_unwrap(self.inner) {
            Ok(inner) => Ok(inner.buf.into_inner()),
            Err(inner) => Err(SplitBuf { inner }),
        }
    }
}

impl<B: IoBufMut> SplitBuf<B> {
    /// Shares a destination buffer; parts cover its whole capacity.
    pub(crate) fn destination(mut buf: B) -> SplitBuf<B> {
        let (ptr, len) = (buf.stable_mut_ptr(), buf.bytes_total());
        SplitBuf {
            inner: Rc::new(Inner {
                buf: UnsafeCell::new(buf),
                ptr,
                len,
            }),
        }
    }
}

/// A disjoint range of a shared buffer, lent to one operation.
pub(crate) struct Part<B> {
    inner: Rc<Inner<B>>,
    offset: usize,
    len: usize,
}

impl<B> Part<B> {
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

// SAFETY: the range lies in the buffer's stable allocation, kept alive by the Rc.
unsafe impl<B: IoBuf> IoBuf for Part<B> {
    fn stable_ptr(&self) -> *const u8 {
        self.inner.ptr.wrapping_add(self.offset)
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: parts of one buffer are disjoint, so each is the only writer of its
// range; the owner cannot reach the buffer until every part is dropped.
unsafe impl<B: IoBufMut> IoBufMut for Part<B> {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.inner.ptr.wrapping_add(self.offset)
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// The initialised bytes of a part (to copy a small payload next to its header).
/// The initialised bytes of a whole buffer.
pub(crate) fn init_bytes<B: IoBuf>(b: &B) -> &[u8] {
    // SAFETY: `IoBuf`'s contract: `stable_ptr` points at `bytes_init`
    // initialised bytes that stay valid while `b` is borrowed; only read here.
    unsafe { std::slice::from_raw_parts(b.stable_ptr(), b.bytes_init()) }
}

pub(crate) fn bytes_of<B: IoBuf>(p: &Part<B>) -> &[u8] {
    // SAFETY: the part's range is initialised source memory (parts of a source
    // cover `bytes_init`), alive while `p` is borrowed, and only read here.
    unsafe { std::slice::from_raw_parts(p.stable_ptr(), p.len) }
}

/// A destination part with its buffer type erased, for a response reader
/// that does not know the caller's buffer type.
pub(crate) struct Erased {
    ptr: *mut u8,
    len: usize,
    /// The part's hold on its buffer: the part's own `Rc`, its type erased
    /// by unsizing — no allocation per read, where a boxed part took one
    /// (a `Part` is its `Rc` and a range, and has no `Drop` of its own).
    _buf: Rc<dyn std::any::Any>,
}

impl Erased {
    pub(crate) fn new<B: IoBufMut>(mut part: Part<B>) -> Erased {
        let (ptr, len) = (part.stable_mut_ptr(), part.len);
        Erased {
            ptr,
            len,
            _buf: part.inner,
        }
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Copies `src` to `at` in the destination (the range is asserted).
    pub(crate) fn copy_in(&mut self, at: usize, src: &[u8]) {
        assert!(at.checked_add(src.len()).is_some_and(|e| e <= self.len));
        // SAFETY: `at..at + src.len()` lies in the part (asserted), whose
        // buffer `_buf` keeps alive; this `Erased` is its only writer.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), self.ptr.add(at), src.len()) };
    }
}

// SAFETY: points into the part's allocation, which `_buf` keeps alive.
unsafe impl IoBuf for Erased {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: the erased part is the only writer of its (disjoint) range.
unsafe impl IoBufMut for Erased {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// Marks the first `n` bytes of a reassembled destination initialised.
pub(crate) fn set_filled<B: IoBufMut>(buf: &mut B, n: usize) {
    // SAFETY: callers pass the count of bytes that every part's read wrote,
    // which cover `0..n` contiguously.
    unsafe { buf.set_init(n) }
}

/// `(offset, len)` slices of `0..len`.
pub(crate) fn slices(len: u64, slice: usize) -> impl Iterator<Item = (u64, u64)> {
    let slice = slice.max(1) as u64;
    (0..len.div_ceil(slice)).map(move |i| (i * slice, slice.min(len - i * slice)))
}

/// Folds slice results: bytes that landed, and the first error (`write`:
/// the slices wrote to the target).
pub(crate) async fn join_slices(
    handles: Vec<JoinHandle<Result<u64, TransferError>>>,
    write: bool,
) -> Result<u64, TransferError> {
    let mut total = 0;
    let mut first_err = None;
    for h in handles {
        match h.await {
            // (Each answer counts at most its slice: checked as it came.)
            Ok(Ok(n)) => total += n,
            Ok(Err(e)) => {
                total += e.landed().unwrap_or(0);
                keep_worst(&mut first_err, e);
            }
            // A slice that panicked lost track of its part: there is no
            // result to give, only the panic (as a panicking transfer is
            // the batch's). An error here would be retried.
            Err(JoinError::Panicked(p)) => std::panic::resume_unwind(p),
            // Its runtime shut down: the slice was dropped with its ops
            // parked there.
            Err(e @ JoinError::Cancelled) => {
                keep_worst(&mut first_err, TransferError::ConnectionLost(e.to_string()))
            }
        }
    }
    // A fenced or revoked transfer reports every byte that landed, over all
    // of its slices (the slices land in parallel: not necessarily a prefix).
    match first_err {
        None => Ok(total),
        Some(TransferError::Fenced | TransferError::FencedPartial { .. }) if total > 0 => {
            Err(TransferError::FencedPartial { landed: total })
        }
        Some(TransferError::Revoked { .. }) => Err(TransferError::Revoked { landed: total }),
        Some(TransferError::Unreachable { .. }) => {
            Err(TransferError::Unreachable { landed: total })
        }
        // The segment went away (revoked and withdrawn) between a write's
        // slices: those before it landed whole, those after found it gone.
        // That is a revoke after `total` bytes, not a write that never
        // landed. (A read so cut keeps its "no such segment".)
        Some(TransferError::NoSuchSegment(_)) if write && total > 0 => {
            Err(TransferError::Revoked { landed: total })
        }
        Some(e) => Err(e),
    }
}

/// Keeps the first error, unless a later one left the target unsettled
/// (a lost connection): the transfer's error must say so. Among settled
/// errors a revoke (or a target that could not reach this process's
/// memory) wins: slices sent after it find the segment gone, and their "no
/// such segment" would hide that bytes landed before the cut.
fn keep_worst(kept: &mut Option<TransferError>, e: TransferError) {
    let rank = |e: &TransferError| match e {
        _ if !e.settles_remote() => 2,
        // Each counts bytes that landed (a "no such segment" after it would
        // turn them into a revoke that never was).
        TransferError::Revoked { .. } | TransferError::Unreachable { .. } => 1,
        _ => 0,
    };
    if kept.as_ref().is_none_or(|k| rank(&e) > rank(k)) {
        *kept = Some(e);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quiesce_runtime::{spawn_local, Runtime};

    /// A slice that panicked lost track of its part: the panic is the
    /// transfer's result, as a panicking transfer's is the batch's — not a
    /// retryable `ConnectionLost` that the batch would send again.
    #[test]
    fn a_slice_that_panicked_is_that_panic() {
        let rt = Runtime::new().unwrap();
        let joined = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rt.block_on(async {
                let whole = spawn_local(async { Ok(4) });
                let panics = spawn_local(async {
                    if std::hint::black_box(true) {
                        panic!("a slice that panics");
                    }
                    Ok(4)
                });
                join_slices(vec![whole, panics], true).await
            })
        }));
        match joined {
            Ok(r) => panic!("the slice's panic became {r:?}"),
            Err(p) => assert_eq!(p.downcast_ref::<&str>(), Some(&"a slice that panics")),
        }
    }
}
