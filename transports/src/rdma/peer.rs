//! A remote RDMA engine as seen by the initiator: one TCP control
//! connection, one RC queue pair (rebuilt lazily after an error or a fence),
//! and the remote keys of the segments opened on it.

use std::cell::Cell;
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::{Rc, Weak};

use quiesce_runtime::{IoBuf, IoBufMut};

use super::link::{Link, LinkState};
use super::local::LocalSide;
use super::reaper::{Reaper, Submission};
use super::verbs::{Access, WorkRequest};
use crate::control::auth::Token;
use crate::control::wire::{Descriptor, QpAccept, QpConnect, QpWire, RemoteKey};
use crate::error::TransferError;
use crate::lock::SetupGate;
use crate::tcp::conn::Conn;
use crate::tcp::peer::Peer;
use crate::tcp::segment::{check_range, check_read, descriptor_accessors};
use crate::tcp::split::set_filled;
use crate::tcp::split::slices;

struct PeerState {
    local: Rc<LocalSide>,
    tcp: Peer,
    link: RefCell<Option<Rc<Link>>>,
    /// Per segment id, the key the current control connection was given
    /// and the grant epoch that connection held for it then: a handle
    /// opened under an older grant does not post with it (see
    /// [`RemoteSegment`](crate::RemoteSegment)'s grant).
    keys: RefCell<HashMap<u64, (RemoteKey, u64)>>,
    /// Serialises link set-up; who waited behind a failed one fails with it.
    setup: SetupGate,
    /// The control connection whose end resets this peer's link (a hook
    /// registered once per connection; the `Weak` keeps its address from
    /// naming a later connection).
    hooked: RefCell<Weak<Conn>>,
    /// Queue pairs of the target's that a fence reset before their link
    /// was installed (its ack read first), with the control connection the
    /// ack came on and the fenced batch: the link set up on one, on that
    /// connection, is retired as it is installed. The last [`RACED_KEPT`].
    raced: RefCell<Vec<Raced>>,
}

/// Raced resets a peer remembers.
const RACED_KEPT: usize = 8;

/// A reset a fence's ack named before its link was installed.
struct Raced {
    remote_qpn: u32,
    /// The control connection (weak: its address names no later one).
    conn: Weak<Conn>,
    batch: u64,
}

/// What the next link set-up of this thread does right after the target's
/// `QpAccept`, before the link is installed ([`after_next_qp_accept`]).
#[doc(hidden)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AfterAccept {
    /// The control connection ends and its close hooks run: its close was
    /// read in one piece with the `QpAccept`, and the target has dropped
    /// the queue pair it had just accepted.
    CloseControl,
    /// A fence of this batch is acknowledged: its ack was read with the
    /// `QpAccept` and handled first.
    Fence(u64),
}

thread_local! {
    static AFTER_ACCEPT: Cell<Option<AfterAccept>> = const { Cell::new(None) };
}

/// Makes this thread's next queue pair set-up do `what` between the
/// target's `QpAccept` and installing the link: a fault for tests of
/// orders the network may deliver. Never call it outside a test.
#[doc(hidden)]
pub fn after_next_qp_accept(what: AfterAccept) {
    AFTER_ACCEPT.with(|a| a.set(Some(what)));
}

/// A connected remote RDMA engine. Cheap to clone.
#[derive(Clone)]
pub struct RdmaPeer {
    inner: Rc<PeerState>,
}

impl RdmaPeer {
    pub(crate) fn new(local: Rc<LocalSide>, tcp: Peer) -> RdmaPeer {
        RdmaPeer {
            inner: Rc::new(PeerState {
                local,
                tcp,
                link: RefCell::default(),
                keys: RefCell::default(),
                setup: SetupGate::default(),
                hooked: RefCell::default(),
                raced: RefCell::default(),
            }),
        }
    }

    /// The peer's control address.
    pub fn addr(&self) -> SocketAddr {
        self.inner.tcp.addr()
    }

    /// What tells this peer apart from every other one alive in the
    /// process (as [`Peer::identity`](crate::Peer::identity)).
    pub fn identity(&self) -> usize {
        Rc::as_ptr(&self.inner) as usize
    }

    /// The peer's node name.
    pub fn node(&self) -> &str {
        self.inner.tcp.node()
    }

    /// As [`Peer::is_replaced`](crate::Peer::is_replaced).
    pub fn is_replaced(&self) -> bool {
        self.inner.tcp.is_replaced()
    }

    /// As [`Peer::check_in`](crate::Peer::check_in).
    pub async fn check_in(&self) -> Result<(), TransferError> {
        self.inner.tcp.check_in().await
    }

    /// Proves `token` for segment `name` and fetches its remote key.
    pub async fn open(&self, name: &str, token: Token) -> Result<RdmaSegment, TransferError> {
        let seg = self.inner.tcp.open(name, token).await?;
        self.keyed(seg).await
    }

    /// Proves `token` for the segment holding the target's address `addr`
    /// ([`Peer::open_at`]) and fetches its remote key.
    ///
    /// [`Peer::open_at`]: crate::Peer::open_at
    pub async fn open_at(&self, addr: u64, token: Token) -> Result<RdmaSegment, TransferError> {
        let seg = self.inner.tcp.open_at(addr, token).await?;
        self.keyed(seg).await
    }

    /// Proves `token` for the segment the target registered first among
    /// those live now that it opens ([`Peer::open_first`]) and fetches its
    /// remote key.
    ///
    /// [`Peer::open_first`]: crate::Peer::open_first
    pub async fn open_first(&self, token: Token) -> Result<RdmaSegment, TransferError> {
        let seg = self.inner.tcp.open_first(token).await?;
        self.keyed(seg).await
    }

    /// The RDMA handle of a segment just proven on the control connection.
    async fn keyed(&self, seg: crate::RemoteSegment) -> Result<RdmaSegment, TransferError> {
        let desc = Rc::new(seg.descriptor().clone());
        {
            // Keys only: the queue pair (if any) stays as it is. Fetched on
            // every open: after the target's revoke the segment has a new key,
            // handed out only to a grant proven since (the one just proven).
            let conn = self.inner.tcp.control().await?;
            let accept = conn
                .qp_connect(
                    QpConnect {
                        qp: QpWire::default(),
                    },
                    self.inner.tcp.stall_timeout(),
                )
                .await?;
            check_status(accept.status, self.addr())?;
            self.inner
                .keys
                .borrow_mut()
                .extend(granted_keys(&accept, &conn));
        }
        self.key(desc.id).ok_or_else(|| {
            TransferError::handshake(
                self.addr(),
                format!(
                    "segment {:?} has no RDMA memory region at the target",
                    desc.name
                ),
            )
        })?;
        Ok(RdmaSegment {
            peer: self.clone(),
            desc,
            forged: None,
            ceiling: seg.grant_epoch(),
        })
    }

    /// The key this peer's current control connection was given for
    /// segment `id` (keys belong to the connection's protection domain at
    /// the target: a new connection gets new ones).
    fn key(&self, id: u64) -> Option<RemoteKey> {
        self.granted_key(id).map(|(k, _)| k)
    }

    /// [`key`](Self::key), and the grant epoch it was given under.
    fn granted_key(&self, id: u64) -> Option<(RemoteKey, u64)> {
        self.inner.keys.borrow().get(&id).copied()
    }

    /// The live link, or a new one (new queue pair, exchanged on the
    /// control connection) if there is none, it failed, or the control
    /// connection it was set up on died.
    async fn link(&self) -> Result<Rc<Link>, TransferError> {
        if let Some(l) = self.usable_link() {
            return Ok(l);
        }
        self.inner
            .setup
            .run(|| self.usable_link(), || self.new_link())
            .await
    }

    /// Sets a new link up (under the setup gate).
    async fn new_link(&self) -> Result<Rc<Link>, TransferError> {
        let conn = self.inner.tcp.control().await?;
        let node = &self.inner.local.node;
        let qp = node
            .new_qp(&node.pd)
            .map_err(|e| TransferError::ConnectionLost(e.to_string()))?;
        let local = node.endpoint(&qp);
        let limit = self.inner.tcp.stall_timeout();
        let accept = conn.qp_connect(QpConnect { qp: local }, limit).await?;
        match AFTER_ACCEPT.with(Cell::take) {
            Some(AfterAccept::CloseControl) => {
                conn.close_now("a test fault: closed after QpAccept");
                // Time for the target to see the close and drop the queue
                // pair, as one that closed (or died) after answering has.
                let until = std::time::Instant::now() + std::time::Duration::from_millis(300);
                while std::time::Instant::now() < until {
                    quiesce_runtime::time::sleep(std::time::Duration::from_millis(5)).await;
                }
            }
            Some(AfterAccept::Fence(batch)) => {
                let _ = Box::pin(self.fence(batch)).await;
            }
            None => {}
        }
        check_status(accept.status, self.addr())?;
        let remote = accept.qp;
        qp.connect(&local, &remote, node.gid_index, Access::LOCAL)
            .map_err(|e| TransferError::ConnectionLost(e.to_string()))?;
        // The whole set this connection may use: keys from an older
        // connection (another protection domain) or revoked since are dead,
        // and posting one would only put the new queue pair in error.
        *self.inner.keys.borrow_mut() = granted_keys(&accept, &conn).collect();
        let link = Rc::new(Link::new(
            qp,
            node.depth,
            Rc::as_ptr(&conn) as usize,
            remote.qpn,
        ));
        if let Some(old) = self.inner.link.replace(Some(link.clone())) {
            old.fence(None);
        }
        // The target's queue pair dies with the control connection: reset
        // ours at once instead of waiting for the NIC's retries to run out.
        // One hook per connection resets whichever link is on it then (an
        // older one was fenced when it was replaced).
        let this = Rc::downgrade(&conn);
        if !self.inner.hooked.borrow().ptr_eq(&this) {
            *self.inner.hooked.borrow_mut() = this;
            let (peer, at) = (Rc::downgrade(&self.inner), link.conn);
            conn.on_close(move || {
                let Some(peer) = peer.upgrade() else {
                    return;
                };
                let current = peer.link.borrow().clone();
                if let Some(l) = current.filter(|l| l.conn == at) {
                    l.lost();
                }
            });
        }
        // The connection ended while this link was set up, and its hook
        // ran already (on the link before, one per connection): the target's
        // queue pair went with it.
        if conn.is_dead() {
            link.lost();
        }
        // A fence acknowledged before this link was installed reset the
        // target's queue pair it points at.
        let mut raced = self.inner.raced.borrow_mut();
        if let Some(i) = raced
            .iter()
            .position(|r| r.remote_qpn == remote.qpn && r.conn.as_ptr() == Rc::as_ptr(&conn))
        {
            let r = raced.swap_remove(i);
            link.fence(Some(r.batch));
        }
        drop(raced);
        tracing::debug!(peer = %self.addr(), qpn = local.qpn, remote_qpn = remote.qpn, "queue pair connected");
        Ok(link)
    }

    fn usable_link(&self) -> Option<Rc<Link>> {
        let link = self.inner.link.borrow().clone()?;
        let conn = self.inner.tcp.live_control()?;
        (link.state() == LinkState::Ready && Rc::as_ptr(&conn) as usize == link.conn)
            .then_some(link)
    }

    /// Hooks waiting for the live control connection to end (0 with
    /// none): one per peer, however many queue pairs it built on it. For
    /// tests; nothing else needs it.
    #[doc(hidden)]
    pub fn control_close_hooks(&self) -> usize {
        self.inner.tcp.live_control().map_or(0, |c| c.close_hooks())
    }

    /// [`Peer::strand_control`](crate::Peer::strand_control). For tests.
    #[doc(hidden)]
    pub fn strand_control(&self) {
        self.inner.tcp.strand_control();
    }

    /// Moves the current link's queue pair to the error state behind the
    /// link's back, as the device's asynchronous fatal error would: what is
    /// posted on it comes back flushed, with no error of its own. For
    /// tests; nothing else needs it.
    #[doc(hidden)]
    pub fn break_queue_pair(&self) {
        if let Some(l) = self.inner.link.borrow().as_ref() {
            let _ = l.qp.set_error();
        }
    }

    /// Fences `batch`: the local queue pair to the error state (nothing more
    /// leaves, posted requests flush), then the target's (nothing more
    /// lands); resolves once the target confirmed.
    pub async fn fence(&self, batch: u64) -> Result<(), TransferError> {
        if let Some(l) = self.inner.link.borrow().as_ref() {
            l.fence(Some(batch));
        }
        let reset = self.inner.tcp.fence_qp(batch).await?;
        // A queue pair set up while the fence was on its way (a transfer was
        // connecting) was reset by the target too: retire the link that
        // points at it, or its requests would wait for a dead responder.
        let current = self.inner.link.borrow().clone();
        match current {
            Some(l) if reset != 0 && l.remote_qpn as u64 == reset => l.fence(Some(batch)),
            // One still being set up (its accept not handled yet) is
            // retired as it is installed.
            _ if reset != 0 => {
                let conn = self.inner.tcp.live_control();
                let mut raced = self.inner.raced.borrow_mut();
                // Those of earlier connections can name no link any more.
                raced.retain(|r| {
                    conn.as_ref()
                        .is_some_and(|c| r.conn.as_ptr() == Rc::as_ptr(c))
                });
                if raced.len() == RACED_KEPT {
                    raced.remove(0);
                }
                if let Some(c) = conn {
                    raced.push(Raced {
                        remote_qpn: reset as u32,
                        conn: Rc::downgrade(&c),
                        batch,
                    });
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// `batch` is finished here (see [`Peer::retire`]).
    pub fn retire(&self, batch: u64) {
        self.inner.tcp.retire(batch);
    }

    /// Moves the queue pair to the error state (its requests fail once
    /// their flushes are reaped) and resets the control connection, so a
    /// transfer still setting its queue pair up, or a fence waiting for its
    /// ack, ends at once instead of waiting for a target that may never
    /// answer. The next transfer reconnects and builds a new queue pair.
    pub fn abort(&self) {
        if let Some(l) = self.inner.link.borrow().as_ref() {
            l.fence(None);
        }
        self.inner.tcp.abort();
    }

    /// Closes the peer (its engine shuts down): the link to the error
    /// state, as [`abort`](Self::abort), and no connection — so no link,
    /// and no request — opens after it.
    pub(crate) fn close(&self) {
        if let Some(l) = self.inner.link.borrow().as_ref() {
            l.fence(None);
        }
        self.inner.tcp.close();
    }

    async fn post<B: 'static>(
        &self,
        segment: &RdmaSegment,
        offset: u64,
        local: (u64, u64),
        read: bool,
        batch: u64,
        buf: B,
    ) -> (Result<u64, TransferError>, B) {
        let (addr, len) = local;
        let Some(mr) = self.inner.local.local(addr, len) else {
            return (Err(TransferError::Unregistered { addr, len }), buf);
        };
        if self.inner.tcp.is_fenced(batch) {
            return (Err(TransferError::Fenced), buf);
        }
        let link = match self.link().await {
            Ok(l) => l,
            Err(e) => return (Err(e), buf),
        };
        // The batch may have been fenced while the link was being set up.
        if self.inner.tcp.is_fenced(batch) {
            return (Err(TransferError::Fenced), buf);
        }
        // Looked up after the link: a link set up on a new control
        // connection brought that connection's keys. (From here to the
        // post nothing waits: a newer key taken meanwhile is not used.)
        let granted = match segment.forged {
            Some(k) => Some((k, 0)),
            None => self.granted_key(segment.desc.id),
        };
        // A key of a grant newer than the handle's: the target re-keyed the
        // segment for a revoke made after the handle's open, and this write
        // may have been made before it (the older key was deregistered).
        if let Some((_, epoch)) = granted.filter(|&(_, e)| !read && e > segment.ceiling) {
            tracing::debug!(
                epoch,
                ceiling = segment.ceiling,
                "a write of an older handle"
            );
            return (Err(TransferError::Revoked { landed: 0 }), buf);
        }
        let Some((key, _)) = granted else {
            return (
                Err(TransferError::RemoteAccess(format!(
                    "no remote key for segment {:?} on this connection: open it again",
                    segment.desc.name
                ))),
                buf,
            );
        };
        // A key for other memory than the segment opened: the target
        // restarted, and its segment of this id is another (ids count per
        // process). Nothing of this handle may land there.
        if segment.forged.is_none() && key.addr != segment.desc.base {
            return (Err(TransferError::NoSuchSegment(segment.desc.id)), buf);
        }
        // The key's address is the target's word: one that would wrap with
        // the offset names no memory of it.
        let Some(remote) = key
            .addr
            .checked_add(offset)
            .filter(|r| r.checked_add(len).is_some())
        else {
            return (
                Err(TransferError::RemoteAccess(format!(
                    "segment {:?}: the target's key address {:#x} overflows at offset {offset}",
                    segment.desc.name, key.addr
                ))),
                buf,
            );
        };
        let lkey = mr.mr.lkey();
        let slice = self.inner.local.slice_size;
        let count = len.div_ceil(slice as u64) as u32;
        let wrs = slices(len, slice).map(|(off, l)| WorkRequest {
            wr_id: 0,
            read,
            local: addr + off,
            len: l as u32,
            lkey,
            remote: remote + off,
            rkey: key.rkey,
            inline: !read,
        });
        let reaper = &self.inner.local.node.reaper;
        let sub = Submission {
            wrs,
            count,
            batch,
            bytes: len,
            keep: Some(mr),
            buf,
        };
        Reaper::submit(reaper, &link, sub).await
    }
}

/// `accept`'s keys by segment id, each with the grant epoch `conn` (the
/// control connection it came on) held for its segment.
fn granted_keys<'a>(
    accept: &'a QpAccept,
    conn: &'a Conn,
) -> impl Iterator<Item = (u64, (RemoteKey, u64))> + 'a {
    accept
        .keys
        .iter()
        .map(|k| (k.segment, (*k, conn.granted(k.segment).epoch)))
}

fn check_status(status: u8, peer: SocketAddr) -> Result<(), TransferError> {
    let reason = match status {
        0 => return Ok(()),
        1 => "the target has no RDMA device",
        _ => "the target could not set up a queue pair",
    };
    Err(TransferError::handshake(peer, reason))
}

/// A segment of an RDMA peer that this initiator has opened.
#[derive(Clone)]
pub struct RdmaSegment {
    peer: RdmaPeer,
    /// Shared: a segment handle is cloned per transfer.
    desc: Rc<Descriptor>,
    /// A key to post with instead of the connection's (tests of the
    /// target's enforcement only; see [`RdmaSegment::with_remote_key`]).
    forged: Option<RemoteKey>,
    /// The grant epoch of the open that made this handle (as TCP's
    /// [`RemoteSegment`](crate::RemoteSegment)): its writes never post
    /// with a key of a newer grant.
    ceiling: u64,
}

impl RdmaSegment {
    descriptor_accessors!();

    /// The peer.
    pub fn peer(&self) -> &RdmaPeer {
        &self.peer
    }

    /// The remote key transfers on this segment use now: the one the
    /// target gave this peer's control connection (None before the first
    /// one after a reconnect).
    pub fn remote_key(&self) -> Option<RemoteKey> {
        self.forged.or_else(|| self.peer.key(self.desc.id))
    }

    /// This segment with `key` posted verbatim instead of the one the target
    /// gave: how a hostile peer would use an rkey it learned elsewhere. For
    /// tests that the target's NIC refuses it; nothing else needs it.
    #[doc(hidden)]
    pub fn with_remote_key(&self, key: RemoteKey) -> RdmaSegment {
        RdmaSegment {
            forged: Some(key),
            ..self.clone()
        }
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), TransferError> {
        check_range(offset, len, self.desc.len)
    }

    /// RDMA-writes the initialised bytes of `src` (which must lie in a
    /// registered region) to `offset`. Resolves once every work request is
    /// reaped.
    pub async fn write<B: IoBuf>(
        &self,
        offset: u64,
        src: B,
        batch: u64,
    ) -> (Result<u64, TransferError>, B) {
        let len = src.bytes_init() as u64;
        if let Err(e) = self.check(offset, len) {
            return (Err(e), src);
        }
        let addr = src.stable_ptr() as u64;
        self.peer
            .post(self, offset, (addr, len), false, batch, src)
            .await
    }

    /// RDMA-reads `len` bytes at `offset` into `dst[..len]`.
    pub async fn read<B: IoBufMut>(
        &self,
        offset: u64,
        len: u64,
        mut dst: B,
        batch: u64,
    ) -> (Result<u64, TransferError>, B) {
        if let Err(e) = check_read(offset, len, self.desc.len, dst.bytes_total()) {
            return (Err(e), dst);
        }
        let addr = dst.stable_mut_ptr() as u64;
        let (res, mut dst) = self
            .peer
            .post(self, offset, (addr, len), true, batch, dst)
            .await;
        if res.is_ok() {
            set_filled(&mut dst, len as usize);
        }
        (res, dst)
    }
}
