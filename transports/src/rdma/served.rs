//! The device-level state a shard shares between its roles ([`Node`]), and
//! the target's side of a queue pair ([`ServedQp`]): created when a peer's
//! `QpConnect` arrives on a control connection, moved to the error state by
//! that connection's fences, destroyed with the connection.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;

use super::reaper::SharedReaper;
use super::verbs::{Access, Context, Mr, Pd, Qp, QpEndpoint};
use super::RdmaError;
use crate::control::wire::{QpWire, RemoteKey};
use crate::memory::ExposedMemory;

/// A segment's memory region; deregistered (first) before its memory may go.
pub(crate) struct SegmentMr {
    pub(crate) mr: Mr,
    pub(crate) _mem: Rc<ExposedMemory>,
    pub(crate) count: Rc<Cell<u64>>,
}

impl Drop for SegmentMr {
    fn drop(&mut self) {
        self.count.set(self.count.get() - 1);
    }
}

/// One device, its protection domain and the shard's completion queue.
pub(crate) struct Node {
    pub(crate) ctx: Rc<Context>,
    pub(crate) pd: Rc<Pd>,
    pub(crate) gid: [u8; 16],
    pub(crate) gid_index: u8,
    pub(crate) depth: u32,
    pub(crate) reaper: SharedReaper,
    /// Segment id → its memory region (target side).
    pub(crate) segments: RefCell<HashMap<u64, Rc<SegmentMr>>>,
    /// Memory regions registered now.
    pub(crate) mrs: Rc<Cell<u64>>,
    /// Itself, for the queue pairs it serves to hold.
    pub(crate) this: std::rc::Weak<Node>,
}

impl Node {
    /// This node's endpoint for a new queue pair.
    pub(crate) fn endpoint(&self, qp: &Qp) -> QpEndpoint {
        QpEndpoint {
            qpn: qp.qpn(),
            psn: crate::control::auth::random_u64() as u32 & 0xff_ffff,
            gid: self.gid,
            lid: self.ctx.lid,
            mtu: self.ctx.active_mtu,
        }
    }

    /// A new RC queue pair on the shard's completion queue.
    pub(crate) fn new_qp(&self) -> Result<Qp, RdmaError> {
        let cq = self.reaper.borrow().cq().object();
        Qp::new(&self.pd, cq, self.depth)
    }

    /// The keys of `segments` (those with a memory region).
    pub(crate) fn keys(&self, segments: impl Iterator<Item = u64>) -> Vec<RemoteKey> {
        let mrs = self.segments.borrow();
        segments
            .filter_map(|id| {
                mrs.get(&id).map(|s| RemoteKey {
                    segment: id,
                    addr: s.mr.addr(),
                    rkey: s.mr.rkey(),
                })
            })
            .collect()
    }

    /// Registers a segment's memory with access from its rights.
    pub(crate) fn register_segment(
        &self,
        id: u64,
        mem: Rc<ExposedMemory>,
        access: Access,
    ) -> Result<(), RdmaError> {
        let (ptr, len) = mem.raw();
        if len == 0 {
            return Ok(());
        }
        // SAFETY: the region keeps `mem` alive (`_mem`) and is dropped before it.
        let mr = unsafe { Mr::register(&self.pd, ptr, len, access)? };
        self.mrs.set(self.mrs.get() + 1);
        self.segments.borrow_mut().insert(
            id,
            Rc::new(SegmentMr {
                mr,
                _mem: mem,
                count: self.mrs.clone(),
            }),
        );
        Ok(())
    }
}

/// The target's queue pair for one control connection.
pub(crate) struct ServedQp {
    qp: Qp,
    _node: Rc<Node>,
}

impl ServedQp {
    /// Creates a queue pair connected to the initiator's `remote`; returns it
    /// with the endpoint to answer.
    pub(crate) fn accept(
        node: &Rc<Node>,
        remote: &QpWire,
    ) -> Result<(ServedQp, QpWire), RdmaError> {
        let qp = node.new_qp()?;
        let local = node.endpoint(&qp);
        qp.connect(
            &local,
            remote,
            node.gid_index,
            Access {
                remote_write: true,
                remote_read: true,
            },
        )?;
        Ok((
            ServedQp {
                qp,
                _node: node.clone(),
            },
            local,
        ))
    }

    /// The queue pair's number.
    pub(crate) fn qpn(&self) -> u32 {
        self.qp.qpn()
    }

    /// Fence: the responder accepts no further packet once this returns.
    pub(crate) fn fence(&self) {
        if let Err(e) = self.qp.set_error() {
            tracing::warn!(error = %e, "fencing a served queue pair failed");
        }
    }
}

/// The RDMA plane of the control server: `QpConnect` sets up a served queue
/// pair and reports the segments' keys.
impl crate::control::QpPlane for Node {
    fn accept(
        &self,
        remote: &QpWire,
    ) -> Result<(Box<dyn crate::control::ServedLink>, QpWire), String> {
        let node = self.this.upgrade().ok_or("the RDMA device is gone")?;
        let (qp, wire) = ServedQp::accept(&node, remote).map_err(|e| e.to_string())?;
        Ok((Box::new(qp), wire))
    }

    fn keys(&self, segments: &mut dyn Iterator<Item = u64>) -> Vec<RemoteKey> {
        Node::keys(self, segments)
    }
}

impl crate::control::ServedLink for ServedQp {
    fn number(&self) -> u32 {
        self.qpn()
    }

    fn fence(&self) {
        ServedQp::fence(self)
    }
}

impl Drop for ServedQp {
    fn drop(&mut self) {
        self.fence();
    }
}
