//! This side of an RDMA transfer: the device node, the local memory
//! registrations transfers post from, and the completion queue's place in
//! the reactor. The engine and its peers share it.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::rc::Rc;

use quiesce_runtime::source::SourceHandle;

use super::served::Node;
use super::verbs::Mr;
use crate::memory::{ExposedMemory, Region};

/// What keeps a local registration's memory alive (held, never read).
#[allow(dead_code)]
pub(crate) enum Backing {
    /// A region the engine's user allocated.
    Region(Region),
    /// The memory of a segment this engine serves (caller memory lent to it
    /// is handed back only once this is gone too).
    Segment(Rc<ExposedMemory>),
}

/// A local memory region registered with the engine.
pub(crate) struct LocalMr {
    pub(crate) mr: Mr,
    /// Taken only when its deregistration failed, to keep it for good.
    pub(crate) backing: Option<Backing>,
    pub(crate) count: Rc<Cell<u64>>,
}

impl Drop for LocalMr {
    fn drop(&mut self) {
        self.count.set(self.count.get() - 1);
        if let Err(e) = self.mr.deregister() {
            // The device may still reach the memory: it never goes back.
            tracing::error!(error = %e, "a local region stays registered; keeping its memory for good");
            std::mem::forget(self.backing.take());
        }
    }
}

/// What this shard's RDMA transfers use: the device, the local memory
/// registrations, and the completion queue's place in the reactor. Peers
/// hold it (never the engine, whose peer table holds them: no `Rc` cycle),
/// so it lives while anything can still post.
pub(crate) struct LocalSide {
    pub(crate) node: Rc<Node>,
    pub(crate) slice_size: usize,
    pub(crate) locals: RefCell<BTreeMap<u64, Rc<LocalMr>>>,
    pub(crate) _source: SourceHandle,
}

impl LocalSide {
    /// A registration covering `addr..addr + len`, if any: the nearest
    /// below `addr` that reaches far enough — registrations may overlap (a
    /// range registered inside a larger one), and the nearest start may
    /// belong to a smaller one that ends first.
    pub(crate) fn local(&self, addr: u64, len: u64) -> Option<Rc<LocalMr>> {
        let end = addr.checked_add(len)?;
        let locals = self.locals.borrow();
        locals
            .range(..=addr)
            .rev()
            .find(|(&start, mr)| end <= start + mr.mr.len() as u64)
            .map(|(_, mr)| mr.clone())
    }
}
