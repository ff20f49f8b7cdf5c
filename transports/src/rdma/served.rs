//! The device-level state a shard shares between its roles ([`Node`]), and
//! the target's side of one control connection's RDMA ([`ServedDomain`]).
//!
//! Rights at the NIC: every control connection that asks for RDMA gets a
//! protection domain of its own. Its queue pairs live there, and so do the
//! memory regions of the segments that connection proved — registered on
//! the first `QpConnect` after the proof. A NIC checks that an rkey's region
//! and the queue pair it arrives on share a protection domain, so a key is
//! worth nothing on another peer's queue pair, and nothing with remote
//! access lives in the node's own domain (where this shard's initiator
//! queue pairs and local regions are). A revoke deregisters the segment's
//! region in every domain: the NIC refuses every key handed out before it.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::{Rc, Weak};

use super::reaper::SharedReaper;
use super::verbs::{Access, Context, Mr, Pd, Qp, QpEndpoint};
use super::RdmaError;
use crate::control::wire::{QpWire, RemoteKey};
use crate::memory::ExposedMemory;

/// A segment's memory region in one domain; deregistered (first) before its
/// memory may go.
pub(crate) struct SegmentMr {
    pub(crate) mr: Mr,
    pub(crate) _mem: Rc<ExposedMemory>,
    pub(crate) count: Rc<Cell<u64>>,
    /// Deregistered (or tried to be) already.
    gone: bool,
}

impl SegmentMr {
    /// Deregisters it, once. On an error its key may still work on the
    /// domain's queue pairs, and its memory never goes back to its owner.
    fn deregister(&mut self) -> Result<(), RdmaError> {
        if std::mem::replace(&mut self.gone, true) {
            return Ok(());
        }
        self.count.set(self.count.get() - 1);
        self.mr.deregister().inspect_err(|e| {
            tracing::error!(error = %e, "a segment's region stays registered; keeping its memory for good");
            std::mem::forget(self._mem.clone());
        })
    }
}

impl Drop for SegmentMr {
    fn drop(&mut self) {
        let _ = self.deregister();
    }
}

/// A segment the node serves over RDMA: its memory and the remote access
/// its rights allow.
pub(crate) struct ServedSegment {
    mem: Rc<ExposedMemory>,
    access: Access,
}

/// What the node reaches of one served domain: its regions, its queue
/// pair, and whether a region of it outlived a revoke.
#[derive(Default)]
struct DomainState {
    /// Dropped first (fields drop in order): the queue pair, then the
    /// regions.
    qp: RefCell<Option<Qp>>,
    /// The regions, by segment id.
    mrs: RefCell<HashMap<u64, SegmentMr>>,
    /// A region that a revoke had to kill could not be deregistered: its
    /// key works on any queue pair of this domain, so none is connected in
    /// it again (the initiator gets a new control connection, and domain).
    poisoned: Cell<bool>,
    /// A queue pair of it could be neither reset nor destroyed: it may
    /// still accept requests under any key registered here, so a region
    /// that will not deregister leaves its key working (`KeysKilled::NotAll`).
    stuck_qp: Cell<bool>,
}

thread_local! {
    /// Served queue pair resets this thread fails on purpose
    /// ([`fail_next_served_resets`]).
    static FAILING_SERVED_RESETS: Cell<u32> = const { Cell::new(0) };
}

/// Makes this thread's next `n` resets of a served queue pair (a fence's)
/// fail as a device that refuses both to move it to the error state and to
/// destroy it would, the queue pair staying connected for good: a fault for
/// tests of what a fence confirms when it cannot stop a queue pair. Never
/// call it outside a test.
#[doc(hidden)]
pub fn fail_next_served_resets(n: u32) {
    FAILING_SERVED_RESETS.with(|f| f.set(n));
}

/// Whether this reset is one [`fail_next_served_resets`] fails.
fn failing_served_reset() -> bool {
    FAILING_SERVED_RESETS.with(|f| {
        let n = f.get();
        f.set(n.saturating_sub(1));
        n > 0
    })
}

thread_local! {
    static STALLED_QP_ACCEPTS: Cell<u32> = const { Cell::new(0) };
}

/// Makes this thread's target leave its next `n` answers to a `QpConnect`
/// unsent for an hour, as a frozen target process would: a fault for tests
/// of what an initiator waiting for one does. Never call it outside a test.
#[doc(hidden)]
pub fn stall_next_qp_accepts(n: u32) {
    STALLED_QP_ACCEPTS.with(|f| f.set(n));
}

/// Whether this answer is one [`stall_next_qp_accepts`] holds back.
pub(crate) fn stalled_qp_accept() -> bool {
    STALLED_QP_ACCEPTS.with(|f| {
        let n = f.get();
        f.set(n.saturating_sub(1));
        n > 0
    })
}

/// What [`Node::kill_keys`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum KeysKilled {
    /// Every region deregistered: the NIC refuses the old keys.
    Deregistered,
    /// Some region stayed registered: its domain's queue pair was reset and
    /// the domain poisoned; its control connection must be closed.
    Poisoned,
    /// A queue pair serving a live key could not even be reset.
    NotAll,
}

impl DomainState {
    /// Resets and destroys its queue pair, if any: once this returns `Ok`
    /// (with the queue pair's number, 0 if there was none) nothing lands
    /// through it. `Err`: the device would neither reset nor destroy it, so
    /// it may still accept requests under any key registered here; the
    /// domain is poisoned and the queue pair stays counted in `served`.
    fn stop_qp(&self, served: &Cell<u64>) -> Result<u32, String> {
        if self.stuck_qp.get() {
            // Taken out by the reset that failed, and connected still: no
            // later fence of the session is confirmed either.
            return Err("a queue pair of this domain could be neither reset nor destroyed".into());
        }
        let Some(qp) = self.qp.borrow_mut().take() else {
            return Ok(0);
        };
        let qpn = qp.qpn();
        let refused = failing_served_reset();
        let reset = match refused {
            true => Err(RdmaError::Verbs(
                "modify_qp(ERR)",
                std::io::Error::from_raw_os_error(libc::EIO),
            )),
            false => qp.set_error(),
        };
        let gone = match reset {
            // Dropped: destroyed.
            Ok(()) => Ok(()),
            Err(e) => {
                tracing::warn!(error = %e, qpn, "a served queue pair would not reset; destroying it");
                match refused {
                    true => {
                        qp.leak();
                        Err(RdmaError::Verbs(
                            "ibv_destroy_qp",
                            std::io::Error::from_raw_os_error(libc::EBUSY),
                        ))
                    }
                    false => qp.destroy(),
                }
            }
        };
        if let Err(e) = gone {
            self.stuck_qp.set(true);
            self.poisoned.set(true);
            tracing::error!(error = %e, qpn, "a served queue pair could be neither reset nor destroyed");
            return Err(format!(
                "queue pair {qpn} could be neither reset nor destroyed: {e}"
            ));
        }
        served.set(served.get() - 1);
        Ok(qpn)
    }
}

/// One device, the shard's own protection domain and completion queue.
pub(crate) struct Node {
    pub(crate) ctx: Rc<Context>,
    /// This shard's initiator queue pairs and local regions (no remote
    /// access is ever registered here).
    pub(crate) pd: Rc<Pd>,
    pub(crate) gid: [u8; 16],
    pub(crate) gid_index: u8,
    pub(crate) depth: u32,
    pub(crate) reaper: SharedReaper,
    /// Segment id → what is served (target side).
    pub(crate) segments: RefCell<HashMap<u64, ServedSegment>>,
    /// The served connections' domains, by serial: a revoke reaches them.
    domains: RefCell<HashMap<u64, Weak<DomainState>>>,
    next_domain: Cell<u64>,
    /// Memory regions registered now.
    pub(crate) mrs: Rc<Cell<u64>>,
    /// Queue pairs served now (a [`ServedDomain`]'s, until reset; one the
    /// device would neither reset nor destroy stays counted for good).
    pub(crate) served_qps: Cell<u64>,
    /// A served queue pair that could be neither reset nor destroyed serves
    /// a region that would not deregister: its key may work for good, after
    /// its domain's record is gone, so every revoke says `NotAll`.
    keys_live: Cell<bool>,
    /// Itself, for the domains it serves to hold.
    pub(crate) this: Weak<Node>,
}

impl Node {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        ctx: Rc<Context>,
        pd: Rc<Pd>,
        gid: [u8; 16],
        gid_index: u8,
        depth: u32,
        reaper: SharedReaper,
        mrs: Rc<Cell<u64>>,
    ) -> Rc<Node> {
        Rc::new_cyclic(|this| Node {
            ctx,
            pd,
            gid,
            gid_index,
            depth,
            reaper,
            segments: RefCell::default(),
            domains: RefCell::default(),
            next_domain: Cell::new(0),
            mrs,
            served_qps: Cell::new(0),
            keys_live: Cell::new(false),
            this: this.clone(),
        })
    }

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

    /// A new RC queue pair in `pd` on the shard's completion queue.
    pub(crate) fn new_qp(&self, pd: &Rc<Pd>) -> Result<Qp, RdmaError> {
        let cq = self.reaper.borrow().cq().object();
        Qp::new(pd, cq, self.depth)
    }

    /// Serves segment `id`'s memory with `access` (regions are registered
    /// per domain, when a connection that proved it asks for keys).
    pub(crate) fn serve_segment(&self, id: u64, mem: Rc<ExposedMemory>, access: Access) {
        if mem.raw().1 != 0 {
            self.segments
                .borrow_mut()
                .insert(id, ServedSegment { mem, access });
        }
    }

    /// Deregisters segment `id`'s region in every domain: the NIC refuses
    /// every key of it handed out so far. Where a region cannot be
    /// deregistered, its domain's queue pair is reset and the domain
    /// poisoned (no queue pair is connected in it again, and its control
    /// connection is to be closed: [`ServedLink::poisoned`]), so the key
    /// works on none.
    ///
    /// [`ServedLink::poisoned`]: crate::control::ServedLink::poisoned
    pub(crate) fn kill_keys(&self, id: u64) -> KeysKilled {
        let domains: Vec<Rc<DomainState>> = self
            .domains
            .borrow()
            .values()
            .filter_map(Weak::upgrade)
            .collect();
        let mut killed = match self.keys_live.get() {
            true => KeysKilled::NotAll,
            false => KeysKilled::Deregistered,
        };
        for d in domains {
            // Out of the borrow first.
            let Some(mut region) = d.mrs.borrow_mut().remove(&id) else {
                continue;
            };
            if region.deregister().is_ok() {
                continue;
            }
            d.poisoned.set(true);
            if killed == KeysKilled::Deregistered {
                killed = KeysKilled::Poisoned;
            }
            // A queue pair a fence could not stop serves the key still
            // (`stop_qp` says so too).
            if d.stop_qp(&self.served_qps).is_err() {
                tracing::error!(
                    segment = id,
                    "a revoked key's queue pair could not be stopped"
                );
                self.keys_live.set(true);
                killed = KeysKilled::NotAll;
            }
        }
        killed
    }

    /// Stops serving segment `id` over RDMA: its regions are deregistered
    /// (as [`kill_keys`](Self::kill_keys), whose answer this passes on).
    pub(crate) fn withdraw(&self, id: u64) -> KeysKilled {
        self.segments.borrow_mut().remove(&id);
        self.kill_keys(id)
    }
}

/// The target's RDMA for one control connection: its protection domain, the
/// regions of the segments it proved, and its current queue pair.
pub(crate) struct ServedDomain {
    /// Dropped first (fields drop in order): the queue pair and the
    /// regions, then the domain they are in.
    state: Rc<DomainState>,
    pd: Rc<Pd>,
    serial: u64,
    node: Rc<Node>,
}

impl ServedDomain {
    fn open(node: &Rc<Node>) -> Result<ServedDomain, RdmaError> {
        let pd = Pd::new(&node.ctx)?;
        let serial = node.next_domain.get();
        node.next_domain.set(serial + 1);
        let state = Rc::new(DomainState::default());
        node.domains
            .borrow_mut()
            .insert(serial, Rc::downgrade(&state));
        Ok(ServedDomain {
            state,
            pd,
            serial,
            node: node.clone(),
        })
    }

    /// The key of segment `id` in this domain, registering its region first
    /// if this is the first ask.
    fn key(&self, id: u64) -> Result<Option<RemoteKey>, RdmaError> {
        let key = |s: &SegmentMr| RemoteKey {
            segment: id,
            addr: s.mr.addr(),
            rkey: s.mr.rkey(),
        };
        if self.state.poisoned.get() {
            return Ok(None);
        }
        let mut mrs = self.state.mrs.borrow_mut();
        if let Some(s) = mrs.get(&id) {
            return Ok(Some(key(s)));
        }
        let segments = self.node.segments.borrow();
        let Some(seg) = segments.get(&id) else {
            return Ok(None);
        };
        let (ptr, len) = seg.mem.raw();
        // The region keeps the memory alive (`_mem`); it goes with its domain,
        // or when a revoke or a deregistration removes it.
        // SAFETY: the region is dropped before the memory it holds alive.
        let mr = unsafe { Mr::register(&self.pd, ptr, len, seg.access)? };
        self.node.mrs.set(self.node.mrs.get() + 1);
        let region = SegmentMr {
            mr,
            _mem: seg.mem.clone(),
            count: self.node.mrs.clone(),
            gone: false,
        };
        let k = key(&region);
        mrs.insert(id, region);
        Ok(Some(k))
    }
}

impl crate::control::ServedLink for ServedDomain {
    fn connect(&mut self, remote: &QpWire) -> Result<QpWire, String> {
        self.reset()?;
        if self.state.poisoned.get() {
            return Err(
                "a revoked region of this connection's domain could not be deregistered".into(),
            );
        }
        let qp = self.node.new_qp(&self.pd).map_err(|e| e.to_string())?;
        let local = self.node.endpoint(&qp);
        let access = Access {
            remote_write: true,
            remote_read: true,
        };
        qp.connect(&local, remote, self.node.gid_index, access)
            .map_err(|e| e.to_string())?;
        *self.state.qp.borrow_mut() = Some(qp);
        self.node.served_qps.set(self.node.served_qps.get() + 1);
        Ok(local)
    }

    fn keys(&mut self, segments: &mut dyn Iterator<Item = u64>) -> Vec<RemoteKey> {
        segments
            .filter_map(|id| {
                self.key(id)
                    .map_err(|e| tracing::warn!(segment = id, error = %e, "cannot register"))
                    .ok()
                    .flatten()
            })
            .collect()
    }

    fn reset(&mut self) -> Result<u32, String> {
        self.state.stop_qp(&self.node.served_qps)
    }

    fn poisoned(&self) -> bool {
        self.state.poisoned.get()
    }
}

impl Drop for ServedDomain {
    fn drop(&mut self) {
        let _ = crate::control::ServedLink::reset(self);
        // A queue pair that would not go stays connected: a region of this
        // domain that will not deregister keeps its key working through it,
        // which the node keeps (deregistered here, to know) as the domain's
        // record goes.
        if self.state.stuck_qp.get() {
            let regions: Vec<SegmentMr> = self
                .state
                .mrs
                .borrow_mut()
                .drain()
                .map(|(_, r)| r)
                .collect();
            for mut r in regions {
                if r.deregister().is_err() {
                    self.node.keys_live.set(true);
                }
            }
        }
        self.node.domains.borrow_mut().remove(&self.serial);
    }
}

/// The RDMA plane of the control server: each control connection that asks
/// gets its own domain.
impl crate::control::QpPlane for Node {
    fn open_link(&self) -> Result<Box<dyn crate::control::ServedLink>, String> {
        let node = self.this.upgrade().ok_or("the RDMA device is gone")?;
        let domain = ServedDomain::open(&node).map_err(|e| e.to_string())?;
        Ok(Box::new(domain))
    }
}
