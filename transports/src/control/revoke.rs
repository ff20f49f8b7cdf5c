//! Target-side revoke: the owner of a segment takes a range back.
//!
//! Every segment has a *grant epoch*. A connection that proves the segment's
//! token holds the epoch its proof named with a receipt this target issued
//! (else 0; never less than it held): a receipt of an epoch is sent only
//! after the revoke that made it, so a proof naming it was sent after that
//! revoke too — where the epoch current when the target *reads* a proof
//! says nothing of when it was sent (PROTOCOL.md §5.1). `revoke(range)`
//! advances the epoch and records `(range, epoch)`; from then on a write into
//! that range is refused (`Status::Revoked`) unless its connection holds
//! that epoch or a later one — "issued under the new grant". Writes of older
//! grants that are landing in the range right now have their receive
//! cancelled, and `revoke` resolves only once each of them has stopped (its
//! receive reaped). So once it resolves, no byte of any write accepted,
//! queued in a socket or sent before the call lands in the range any more,
//! whoever sent it — including a peer that vanished or is partitioned: its
//! bytes still in the target's socket buffers are refused when read.
//! Segments may overlap, so [`Segment::revoke`] does this on every segment
//! that holds part of the range's memory.
//!
//! Over RDMA the NIC writes without the target's CPU, so a segment served
//! there is also *re-keyed*: its memory region in every connection's
//! protection domain is deregistered, after which the NIC refuses every old
//! remote key (a write in flight with one stops at the next packet). A
//! connection granted the revoke's epoch gets a new region, and its key, at
//! its next `QpConnect`; older grants get none. So a revoke of any
//! range re-keys the whole segment for RDMA peers.

use std::cell::{Cell, RefCell};
use std::task::{Poll, Waker};

use quiesce_runtime::Canceller;

use crate::segment::Segment;
use slab::Slab;

/// At most this many revoked ranges are kept per segment; past it they are
/// merged into one covering range (revoking more, never less).
const MAX_REVOKED: usize = 64;

/// Why a revoke did not resolve: refused (`OutOfBounds`: nothing was
/// revoked), or done but for an RDMA key that may still work (`KeysLive`).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum RevokeError {
    /// The range is empty, or not inside the segment.
    #[error("revoke of {start}..{end} outside a segment of {len} bytes")]
    OutOfBounds {
        /// Start of the range.
        start: u64,
        /// End of the range.
        end: u64,
        /// The segment's length.
        len: u64,
    },
    /// RDMA: a memory region of the segment could not be deregistered, nor
    /// the queue pair it was served on reset: the NIC may still take writes
    /// with a key handed out before the revoke. TCP and local writes of
    /// older grants are refused and quiesced all the same.
    #[error("an RDMA key of segment {segment} could not be killed: writes with it may still land")]
    KeysLive {
        /// The segment.
        segment: u64,
    },
}

struct Landing {
    start: u64,
    end: u64,
    /// The grant epoch of the connection the write came on.
    epoch: u64,
    canceller: Option<Canceller>,
}

/// A segment's grants: its epoch, revoked ranges and landing writes.
#[derive(Default)]
pub(crate) struct Grants {
    epoch: Cell<u64>,
    /// `(start, end, epoch)`: writes into `start..end` of grants older than
    /// `epoch` are refused.
    revoked: RefCell<Vec<(u64, u64, u64)>>,
    landing: RefCell<Slab<Landing>>,
    waiters: RefCell<Vec<Waker>>,
    /// RDMA: deregisters the segment's memory regions (every remote key of
    /// it dies).
    rekey: RefCell<Option<Rekey>>,
}

/// See [`Grants::set_rekey`]: false if a key may still work.
pub(crate) type Rekey = Box<dyn Fn() -> bool>;

/// A write landing in a segment; dropping it (once its receive is reaped:
/// the op's window holds it) tells revoke waiters.
pub(crate) struct LandingGuard {
    seg: Segment,
    key: usize,
}

impl LandingGuard {
    /// Registers a write of grant `epoch` into `seg[offset..offset + len]`
    /// that is about to land.
    pub(crate) fn begin(seg: &Segment, offset: u64, len: u64, epoch: u64) -> LandingGuard {
        let key = seg.inner.grants.landing.borrow_mut().insert(Landing {
            start: offset,
            end: offset.saturating_add(len),
            epoch,
            canceller: None,
        });
        LandingGuard {
            seg: seg.clone(),
            key,
        }
    }

    fn grants(&self) -> &Grants {
        &self.seg.inner.grants
    }

    /// Records the canceller of the receive now in flight.
    pub(crate) fn set_canceller(&self, c: Option<Canceller>) {
        if let Some(l) = self.grants().landing.borrow_mut().get_mut(self.key) {
            l.canceller = c;
        }
    }

    /// True if the write must stop: its range was revoked since its grant.
    pub(crate) fn revoked(&self) -> bool {
        let grants = self.grants();
        let (start, end, epoch) = {
            let landing = grants.landing.borrow();
            let l = &landing[self.key];
            (l.start, l.end, l.epoch)
        };
        grants.is_revoked(start, end - start, epoch)
    }
}

impl Drop for LandingGuard {
    fn drop(&mut self) {
        let grants = self.grants();
        grants.landing.borrow_mut().remove(self.key);
        let waiters = std::mem::take(&mut *grants.waiters.borrow_mut());
        waiters.into_iter().for_each(Waker::wake);
    }
}

fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.1 && b.0 < a.1
}

impl Grants {
    /// The segment's epoch now: what a receipt sent now names.
    pub(crate) fn current(&self) -> u64 {
        self.epoch.get()
    }

    /// Makes revokes kill the segment's RDMA keys with `f`.
    pub(crate) fn set_rekey(&self, f: Rekey) {
        *self.rekey.borrow_mut() = Some(f);
    }

    /// True if any range was revoked after grant `epoch` (RDMA keys are
    /// per segment, so such a grant gets no key).
    pub(crate) fn revoked_since(&self, epoch: u64) -> bool {
        epoch < self.epoch.get()
    }

    /// True if a write of grant `epoch` into `offset..offset + len` is refused.
    pub(crate) fn is_revoked(&self, offset: u64, len: u64, epoch: u64) -> bool {
        let w = (offset, offset.saturating_add(len));
        self.revoked
            .borrow()
            .iter()
            .any(|&(s, e, ep)| ep > epoch && overlaps(w, (s, e)))
    }

    /// Revokes `start..end` (checked by the caller): from now on writes of
    /// older grants into it are refused, and those landing in it are
    /// cancelled. Returns the new epoch, for [`quiesced`](Self::quiesced),
    /// and whether every RDMA key of the segment is dead (false: the NIC
    /// may still take writes with one, and the revoke must not say it
    /// resolved).
    pub(crate) fn begin_revoke(&self, start: u64, end: u64) -> (u64, bool) {
        let keys_dead = self.rekey.borrow().as_ref().is_none_or(|rekey| rekey());
        let epoch = self.epoch.get() + 1;
        self.epoch.set(epoch);
        {
            let mut r = self.revoked.borrow_mut();
            r.push((start, end, epoch));
            if r.len() > MAX_REVOKED {
                let s = r.iter().map(|x| x.0).min().unwrap_or(start);
                let e = r.iter().map(|x| x.1).max().unwrap_or(end);
                *r = vec![(s, e, epoch)];
            }
        }
        let cancellers: Vec<Canceller> = self
            .landing
            .borrow()
            .iter()
            .filter(|(_, l)| older(l, start, end, epoch))
            .filter_map(|(_, l)| l.canceller.clone())
            .collect();
        // Outside the borrow: cancelling may wake tasks.
        cancellers.iter().for_each(Canceller::cancel);
        (epoch, keys_dead)
    }

    /// Resolves once no write of a grant older than `epoch` is landing in
    /// `start..end` (and, over RDMA, the old remote key is dead).
    pub(crate) async fn quiesced(&self, start: u64, end: u64, epoch: u64) {
        std::future::poll_fn(|cx| {
            if self
                .landing
                .borrow()
                .iter()
                .any(|(_, l)| older(l, start, end, epoch))
            {
                self.waiters.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            } else {
                Poll::Ready(())
            }
        })
        .await
    }
}

/// A write of a grant older than `epoch` landing in `start..end`.
fn older(l: &Landing, start: u64, end: u64, epoch: u64) -> bool {
    l.epoch < epoch && overlaps((l.start, l.end), (start, end))
}
