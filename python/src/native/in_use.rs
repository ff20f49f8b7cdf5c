//! The memory this engine's own batches hold now. A lent segment's revoke
//! says the buffer is the caller's again only once no peer *and* no batch
//! of this engine can touch it: a batch may read into a view of a lent
//! buffer, or write from one, and a revoke that waited only for peers
//! handed the buffer back while that batch could still land in it or read
//! it.

use crate::node::lock;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use super::pin::Held;

/// The address ranges held by batches in flight, each under its own claim.
#[derive(Default)]
pub(crate) struct InUse {
    ranges: Mutex<HashMap<u64, (u64, u64)>>,
    next: AtomicU64,
}

/// A batch buffer's entry in [`InUse`]: removed only when the buffer is
/// released ([`Held::release`]). A `Held` dropped unreleased — its batch
/// could not drain — keeps its entry, as it keeps its memory: for good.
pub(crate) struct Claim {
    registry: Arc<InUse>,
    id: u64,
}

impl InUse {
    /// Claims the memory of each of `held` (a batch's buffers, about to run).
    pub(crate) fn claim(registry: &Arc<InUse>, held: &mut [Held]) {
        let mut ranges = lock(&registry.ranges);
        for h in held {
            let id = registry.next.fetch_add(1, Ordering::Relaxed);
            ranges.insert(id, (h.addr as u64, h.len as u64));
            h.claim(Claim {
                registry: registry.clone(),
                id,
            });
        }
    }

    /// Whether no batch holds any memory now.
    pub(crate) fn is_empty(&self) -> bool {
        lock(&self.ranges).is_empty()
    }

    /// Whether a batch in flight holds a byte of `addr..addr + len`.
    pub(crate) fn overlaps(&self, addr: u64, len: u64) -> bool {
        let end = addr.saturating_add(len);
        lock(&self.ranges)
            .values()
            .any(|&(a, l)| a < end && addr < a.saturating_add(l))
    }
}

impl Claim {
    /// The buffer was released: its memory is no batch's any more.
    pub(crate) fn end(self) {
        lock(&self.registry.ranges).remove(&self.id);
    }
}
