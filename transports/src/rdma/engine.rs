//! The RDMA engine of one shard: device, protection domain, completion
//! queue, registered memory, and its peers.

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::{Rc, Weak};
use std::time::Duration;

use quiesce_runtime::source::register;

use super::local::{Backing, LocalMr, LocalSide};
use super::peer::RdmaPeer;
use super::reaper::{Reaper, SharedReaper, Source};
use super::served::{KeysKilled, Node};
use super::verbs::{Access, Context, Cq, Mr, Pd};
use super::{RdmaError, RdmaStats};
use crate::config::EngineConfig;
use crate::engine::{Engine, RegisterError};
use crate::error::TransferError;
use crate::lock::Connecting;
use crate::memory::Region;
use crate::segment::{Rights, Segment, SegmentMemory};
use crate::tcp::conn::shut_down;
use crate::Token;

/// RDMA engine settings.
#[derive(Debug, Clone)]
pub struct RdmaConfig {
    /// The TCP control plane (listen address, node name, timeouts).
    pub control: EngineConfig,
    /// Device to use (`None`: the first with an active port).
    pub device: Option<String>,
    /// GID index to send from (`None`: the first RoCE v2 IPv4-mapped GID,
    /// else index 0).
    pub gid_index: Option<u32>,
    /// Busy-poll the completion queue every tick instead of sleeping on its
    /// completion channel (lower latency, one core spinning).
    pub busy_poll: bool,
    /// Work requests in flight per queue pair.
    pub queue_depth: u32,
    /// Entries of the shard's completion queue (`None`: 4 × `queue_depth`,
    /// at least 64). Requests in flight over all queue pairs never exceed
    /// it: the rest wait for completions to make room.
    pub cq_depth: Option<u32>,
    /// Transfers are cut into work requests of at most this many bytes.
    pub slice_size: usize,
}

impl Default for RdmaConfig {
    fn default() -> Self {
        RdmaConfig {
            control: EngineConfig::default(),
            device: None,
            gid_index: None,
            busy_poll: false,
            queue_depth: 256,
            cq_depth: None,
            slice_size: 1 << 20,
        }
    }
}

/// A [`Region`] registered for RDMA. Dropping it deregisters the region once
/// no transfer in flight uses it (each holds the registration until reaped).
pub struct LocalMemory {
    local: Weak<LocalSide>,
    start: u64,
}

impl Drop for LocalMemory {
    fn drop(&mut self) {
        if let Some(l) = self.local.upgrade() {
            l.locals.borrow_mut().remove(&self.start);
        }
    }
}

pub(crate) struct RdmaInner {
    tcp: Engine,
    local: Rc<LocalSide>,
    peers: RefCell<HashMap<SocketAddr, RdmaPeer>>,
    /// Connects in flight, by address (one peer per address, as over TCP).
    connecting: Connecting,
    /// `shutdown()` ran: no peer connects after it.
    shut: Cell<bool>,
}

/// An RDMA transfer engine on the current shard. Cheap to clone.
#[derive(Clone)]
pub struct RdmaEngine {
    inner: Rc<RdmaInner>,
}

impl RdmaEngine {
    /// Opens the device, starts the TCP control plane and registers the
    /// completion queue with the current runtime.
    pub fn bind(config: RdmaConfig) -> Result<RdmaEngine, RdmaError> {
        let ctx = Context::open(config.device.as_deref())?;
        let (gid_index, gid) = pick_gid(&ctx, config.gid_index)?;
        let max_msg = (ctx.max_msg as usize).max(1);
        let pd = Pd::new(&ctx)?;
        let cq_depth = config
            .cq_depth
            .unwrap_or(4 * config.queue_depth.max(16))
            .clamp(1, i32::MAX as u32);
        let cq = Cq::new(&ctx, cq_depth as i32)?;
        let fd = cq.fd();
        let mrs = Rc::new(Cell::new(0));
        let reaper: SharedReaper = Rc::new(RefCell::new(Reaper::new(cq, mrs.clone())));
        let source = register(Source {
            reaper: reaper.clone(),
            busy_poll: config.busy_poll,
            fd,
        });
        let node = Node::new(
            ctx,
            pd,
            gid,
            gid_index,
            config.queue_depth.max(1),
            reaper,
            mrs,
        );
        let tcp = Engine::bind(config.control.clone()).map_err(RdmaError::Control)?;
        tcp.set_qp_plane(node.clone());
        tracing::debug!(device = node.ctx.name(), gid_index, "RDMA engine up");
        Ok(RdmaEngine {
            inner: Rc::new(RdmaInner {
                tcp,
                local: Rc::new(LocalSide {
                    node,
                    slice_size: config.slice_size.clamp(1, max_msg),
                    locals: RefCell::default(),
                    _source: source,
                }),
                peers: RefCell::default(),
                connecting: Connecting::default(),
                shut: Cell::new(false),
            }),
        })
    }

    /// The control plane's address (peers connect here).
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.tcp.local_addr()
    }

    /// The device in use.
    pub fn device(&self) -> &str {
        self.inner.local.node.ctx.name()
    }

    /// The GID index sent from.
    pub fn gid_index(&self) -> u8 {
        self.inner.local.node.gid_index
    }

    /// The TCP engine underneath (its segments are served over TCP too).
    pub fn control(&self) -> &Engine {
        &self.inner.tcp
    }

    /// Registers memory for remote access. Each control connection that
    /// proves its token gets a memory region of its own for it, in that
    /// connection's protection domain, with access flags that follow
    /// `rights`: the target's NIC enforces both who and what.
    pub fn register(
        &self,
        name: &str,
        mem: impl Into<SegmentMemory>,
        rights: Rights,
    ) -> Result<Segment, RegisterError> {
        let seg = self.inner.tcp.register(name, mem, rights)?;
        Ok(self.serve(seg, rights))
    }

    /// [`register`](Self::register) with a caller-chosen token (one derived
    /// from a secret the cluster shares: [`Token::derive`]).
    pub fn register_with_token(
        &self,
        name: &str,
        mem: impl Into<SegmentMemory>,
        rights: Rights,
        token: Token,
    ) -> Result<Segment, RegisterError> {
        let seg = self
            .inner
            .tcp
            .register_with_token(name, mem, rights, token)?;
        Ok(self.serve(seg, rights))
    }

    /// Serves `seg` over RDMA as well.
    fn serve(&self, seg: Segment, rights: Rights) -> Segment {
        let access = Access {
            remote_write: rights.contains(Rights::WRITE),
            remote_read: rights.contains(Rights::READ),
        };
        let node = &self.inner.local.node;
        node.serve_segment(seg.id(), seg.inner.mem.clone(), access);
        // A revoke deregisters the segment's regions in every domain, so the
        // NIC refuses every key handed out before it; a connection proving
        // the token again gets a new region (a new key).
        let (node, id) = (Rc::downgrade(node), seg.id());
        let rekeyed = node.clone();
        let target = Rc::downgrade(self.inner.tcp.target());
        let withdrawn = target.clone();
        seg.inner.grants.set_rekey(Box::new(move || {
            let Some(node) = rekeyed.upgrade() else {
                return true;
            };
            let killed = node.kill_keys(id);
            close_poisoned(&target, killed);
            killed != KeysKilled::NotAll
        }));
        // Deregistered however it is asked (here, or through `control()`):
        // its regions go with it.
        *seg.inner.withdraw.borrow_mut() = Some(Box::new(move || {
            if let Some(node) = node.upgrade() {
                close_poisoned(&withdrawn, node.withdraw(id));
            }
        }));
        seg
    }

    /// Stops serving segment `id` and deregisters its memory regions: from
    /// now on the target's NIC refuses every access with its keys.
    pub fn deregister(&self, id: u64) -> bool {
        self.inner.tcp.deregister(id)
    }

    /// Registers `region` for local use: leases of it can be written from
    /// and read into.
    pub fn register_region(&self, region: &Region) -> Result<LocalMemory, RdmaError> {
        let (ptr, len) = region.raw();
        self.register_local(ptr, len, Backing::Region(region.clone()))
    }

    /// Registers the memory of `seg`, a segment this engine serves, for
    /// local use too: buffers inside it can be written from and read into
    /// (as Mooncake-style callers post from memory they registered for
    /// peers). The registration keeps the segment's memory alive.
    pub fn register_segment_locally(&self, seg: &Segment) -> Result<LocalMemory, RdmaError> {
        let mem = seg.inner.mem.clone();
        let (ptr, len) = mem.raw();
        self.register_local(ptr, len, Backing::Segment(mem))
    }

    fn register_local(
        &self,
        ptr: *mut u8,
        len: usize,
        backing: Backing,
    ) -> Result<LocalMemory, RdmaError> {
        let start = ptr as u64;
        if self.inner.local.locals.borrow().contains_key(&start) {
            return Err(RdmaError::AlreadyRegistered);
        }
        // SAFETY: `backing` keeps the memory alive, and the registration
        // (holding it) is dropped before it.
        let mr = unsafe { Mr::register(&self.inner.local.node.pd, ptr, len, Access::LOCAL)? };
        let count = self.inner.local.node.mrs.clone();
        count.set(count.get() + 1);
        self.inner.local.locals.borrow_mut().insert(
            start,
            Rc::new(LocalMr {
                mr,
                backing: Some(backing),
                count,
            }),
        );
        Ok(LocalMemory {
            local: Rc::downgrade(&self.inner.local),
            start,
        })
    }

    /// Connects to the engine at `addr` (or returns the existing peer,
    /// unless another node answers there now: [`RdmaPeer::is_replaced`]).
    pub async fn connect(&self, addr: SocketAddr) -> Result<RdmaPeer, TransferError> {
        let inner = &self.inner;
        if inner.shut.get() {
            return Err(shut_down());
        }
        let known = || {
            inner
                .peers
                .borrow()
                .get(&addr)
                .filter(|p| !p.is_replaced())
                .cloned()
        };
        inner
            .connecting
            .run(addr, known, || async {
                let tcp = inner.tcp.connect_control(addr).await?;
                let peer = RdmaPeer::new(inner.local.clone(), tcp);
                // Shut down during the handshake: shutdown() did not see it.
                if inner.shut.get() {
                    peer.close();
                    return Err(shut_down());
                }
                inner.peers.borrow_mut().insert(addr, peer.clone());
                Ok(peer)
            })
            .await
    }

    /// Work request counters.
    pub fn stats(&self) -> RdmaStats {
        let node = &self.inner.local.node;
        RdmaStats {
            served_queue_pairs: node.served_qps.get(),
            ..node.reaper.borrow().stats()
        }
    }

    /// Tears down: every peer closed (its queue pair to the error state; a
    /// segment opened through it posts nothing after this, and no peer
    /// connects), the completion queue reaped until no request is
    /// outstanding (at most `limit`), then the control plane closed.
    /// Returns whether everything drained.
    pub fn shutdown(&self, limit: Duration) -> bool {
        self.inner.shut.set(true);
        for p in self.inner.peers.borrow_mut().drain() {
            p.1.close();
        }
        let drained = self.inner.local.node.reaper.borrow_mut().drain_all(limit);
        self.inner.tcp.shutdown();
        drained
    }
}

/// After keys were killed: if a region stayed registered, the connections
/// of the domains it poisoned are shut, so their initiators learn now
/// rather than wait on a queue pair that is gone.
fn close_poisoned(target: &Weak<crate::control::target::Target>, killed: KeysKilled) {
    if killed != KeysKilled::Deregistered {
        if let Some(t) = target.upgrade() {
            t.close_poisoned();
        }
    }
}

/// The GID to send from: the configured index, else the first RoCE v2
/// IPv4-mapped one, else (InfiniBand) index 0.
fn pick_gid(ctx: &Context, want: Option<u32>) -> Result<(u8, [u8; 16]), RdmaError> {
    if let Some(i) = want {
        return match ctx.gid(i) {
            Some((g, _)) => Ok((i as u8, g)),
            None => Err(RdmaError::NoGid {
                device: ctx.name().into(),
                why: format!("GID index {i} is empty"),
            }),
        };
    }
    for i in 0..ctx.gid_table_len.min(256) {
        if let Some((g, true)) = ctx.gid(i) {
            return Ok((i as u8, g));
        }
    }
    if !ctx.ethernet {
        return Ok((0, ctx.gid(0).map(|g| g.0).unwrap_or([0; 16])));
    }
    Err(RdmaError::NoGid {
        device: ctx.name().into(),
        why: "no RoCE v2 IPv4-mapped GID (is an IPv4 address set on the netdev?)".into(),
    })
}
