//! A remote engine as seen by the initiator: its connections (reopened when
//! they die, tokens re-proven) and the segments it opens there
//! ([`RemoteSegment`](crate::tcp::segment::RemoteSegment) moves the data).

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use quiesce_runtime::spawn_local;
use quiesce_runtime::time::timeout;

use quiesce_runtime::process::PeerProcess;

use crate::control::auth::Token;
use crate::control::wire::{GrantReceipt, SegmentRef, Status};
use crate::error::TransferError;
use crate::local::conn::attach_data;
use crate::lock::SetupGate;
use crate::tcp::conn::{shut_down, Conn, ConnParams, LocalFences, SessionBinding, SESSION_ENDED};
use crate::tcp::segment::Proven;

/// How an initiator talks to peers.
#[derive(Debug, Clone)]
pub(crate) struct PeerParams {
    pub(crate) node: String,
    pub(crate) shards: u16,
    pub(crate) connections: usize,
    pub(crate) slice_size: usize,
    pub(crate) zc_threshold: Option<usize>,
    pub(crate) connect_timeout: Duration,
    pub(crate) stall_timeout: Option<Duration>,
    /// [`EngineConfig::tcp_congestion`](crate::EngineConfig::tcp_congestion).
    pub(crate) tcp_congestion: Option<String>,
    pub(crate) local: crate::LocalMode,
    /// Offer attached connections a mailbox for small requests.
    pub(crate) mailbox: bool,
}

pub(crate) struct PeerInner {
    pub(super) addr: SocketAddr,
    pub(crate) params: PeerParams,
    pub(super) conns: RefCell<Vec<Option<Rc<Conn>>>>,
    node: String,
    /// The session the target bound this peer's connections to.
    session: SessionBinding,
    /// Tokens proven so far, with what the target described, replayed
    /// (by id) on every new connection.
    pub(super) opened: RefCell<BTreeMap<u64, Opened>>,
    /// Round-robin turn over the data connections.
    pub(crate) rr: Cell<usize>,
    /// Serialises reconnects, so concurrent slices open one connection, and
    /// fails those that waited behind a failed one with its error.
    reconnect: SetupGate,
    fenced: LocalFences,
    /// The target's process, once a data connection attached to it (the
    /// local transport).
    target: RefCell<Option<Rc<PeerProcess>>>,
    /// Set when the engine shuts down ([`Peer::close`]): no connection
    /// opens after it, not even one whose `connect` was under way.
    closed: Cell<bool>,
    /// Set when a reconnect found another node at the address: this peer
    /// is gone, and the engine connects anew for the one there now.
    replaced: Cell<bool>,
}

/// A connected remote engine. Cheap to clone.
#[derive(Clone)]
pub struct Peer {
    pub(crate) inner: Rc<PeerInner>,
}

impl Peer {
    /// Connects the control connection. The data connections follow once a
    /// segment is opened (the target serves nothing before a token is
    /// proven); connections that die are reopened lazily.
    pub(crate) async fn connect(
        addr: SocketAddr,
        params: PeerParams,
    ) -> Result<Peer, TransferError> {
        let fenced = LocalFences::default();
        let session = SessionBinding::default();
        let open = Cell::new(false);
        let first = Conn::connect(addr, &conn_params(&params, &fenced, &session, &open)).await?;
        // Slot 0 is the control connection (hello, auth, fences): a fence
        // never queues behind slices' payloads. Slots 1..=n carry data.
        // `connections == 0`: a control connection only (RDMA's control plane).
        let node = first.hello.node.clone();
        let mut conns = vec![Some(first)];
        conns.resize(params.connections + 1, None);
        Ok(Peer {
            inner: Rc::new(PeerInner {
                addr,
                params,
                conns: RefCell::new(conns),
                node,
                session,
                opened: RefCell::default(),
                rr: Cell::new(0),
                reconnect: SetupGate::default(),
                fenced,
                target: RefCell::default(),
                closed: Cell::new(false),
                replaced: Cell::new(false),
            }),
        })
    }

    /// The peer's node name (its first hello's).
    pub fn node(&self) -> &str {
        &self.inner.node
    }

    /// Whether a reconnect found another node at this peer's address: this
    /// peer is gone for good (its segments were proven to the node that
    /// left), and the engine's `connect` gives a new one for the node there.
    pub fn is_replaced(&self) -> bool {
        self.inner.replaced.get()
    }

    /// Reconnects the control connection if it is down, so that a hello
    /// says who answers at the address now ([`is_replaced`](Self::is_replaced)).
    pub async fn check_in(&self) -> Result<(), TransferError> {
        self.control().await.map(|_| ())
    }

    /// The peer's address.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// What tells this peer apart from every other one alive in the
    /// process (the address of its shared state): every handle of one peer
    /// has the same, and two peers differ — even two engines' peers at one
    /// address, which are two sessions at the target, fenced apart.
    pub fn identity(&self) -> usize {
        Rc::as_ptr(&self.inner) as usize
    }

    /// Connection `i` if it is up — and, a data connection, in the session
    /// the control connection is in now (one in another would not be
    /// covered by its fences).
    pub(crate) fn live(&self, i: usize) -> Option<Rc<Conn>> {
        let bound = || self.inner.session.get().map(|(s, _)| s);
        self.inner.conns.borrow()[i]
            .clone()
            .filter(|c| !c.is_dead() && (i == 0 || Some(c.session) == bound()))
    }

    /// Connection `i`, reconnecting (and re-proving tokens) if it died —
    /// unless the engine shut down: then `ConnectionLost`.
    pub(crate) async fn conn(&self, i: usize) -> Result<Rc<Conn>, TransferError> {
        if let Some(c) = self.live(i) {
            return Ok(c);
        }
        if self.inner.closed.get() {
            return Err(shut_down());
        }
        // Rare: boxed, so the handshake's state is not part of every
        // transfer's future (a one-task batch holds that future inline).
        Box::pin(async {
            // A data connection joins the control connection's session:
            // that one first (it starts a new session if the old one ended).
            if i > 0 {
                self.conn(0).await?;
            }
            self.inner
                .reconnect
                .run(|| self.live(i), || self.reconnect(i))
                .await
        })
        .await
    }

    /// Opens connection `i` again (through the reconnect gate).
    async fn reconnect(&self, i: usize) -> Result<Rc<Conn>, TransferError> {
        let mut p = conn_params(
            &self.inner.params,
            &self.inner.fenced,
            &self.inner.session,
            &self.inner.closed,
        );
        p.may_start_session = i == 0;
        let c = Conn::connect(self.inner.addr, &p)
            .await
            .map_err(|e| match e {
                // For a transfer, a failed reconnect is a lost peer.
                TransferError::Handshake(h) => {
                    if h.reason == SESSION_ENDED {
                        // The control connection was of it too, its end not
                        // read yet: the next transfer starts over from a new one.
                        if let Some(c) = self.live(0) {
                            c.kill(SESSION_ENDED);
                        }
                    }
                    TransferError::ConnectionLost(h.reason)
                }
                e => e,
            })?;
        // Until it is installed nothing else can reach it: a reconnect
        // given up from here on (its transfer dropped, an error) closes it.
        let mut unfinished = Unfinished(Some(c.clone()));
        // Another node now answers at the address (the peer restarted under
        // another name, or a stale directory entry's address was taken):
        // what was proven was proven to the node that is gone.
        if c.hello.node != self.inner.node {
            self.inner.replaced.set(true);
            c.kill("another node answers at the peer's address");
            return Err(TransferError::ConnectionLost(format!(
                "{} is now node {:?}, not {:?}",
                self.inner.addr, c.hello.node, self.inner.node
            )));
        }
        // Proven before the attach (the target serves nothing else to an
        // unproven connection), and again after it: an open that found no
        // live connection here waits for this one, so whatever was opened
        // meanwhile is proven here too before it is installed.
        let mut proven = HashMap::new();
        self.prove_opened(&c, &mut proven).await?;
        if i > 0 {
            let p = &self.inner.params;
            attach_data(&c, p, &self.inner.target).await?;
        }
        self.prove_opened(&c, &mut proven).await?;
        // Shut down during the handshake: close() did not see this one.
        if self.inner.closed.get() {
            c.abort();
            return Err(shut_down());
        }
        unfinished.0 = None;
        self.inner.conns.borrow_mut()[i] = Some(c.clone());
        Ok(c)
    }

    /// Proves on `c` every opened segment not in `proven` yet (by id, as
    /// opened: one opened anew under an id proven meanwhile is proven
    /// again, and so is one whose open was given a newer grant meanwhile —
    /// else an open racing this reconnect got the connection it installs
    /// under the older grant, and the new handle's writes into a revoked
    /// range were refused there), until a look finds none new. Bounded like the rest of the handshake: a target
    /// that answers the hello and then never the auth must not hold the
    /// transfer (and the caller's buffer) for ever. Segments the target
    /// refuses (deregistered since, or it restarted) are forgotten: their
    /// transfers fail as refused, the rest go on.
    async fn prove_opened(
        &self,
        c: &Conn,
        proven: &mut HashMap<u64, (Opened, u64)>,
    ) -> Result<(), TransferError> {
        loop {
            let more: Vec<(u64, Opened)> = self
                .inner
                .opened
                .borrow()
                .iter()
                .filter(|(id, o)| {
                    !proven.get(id).is_some_and(|(p, epoch)| {
                        p.same(o) && *epoch >= o.desc.opened_grant().epoch
                    })
                })
                .map(|(k, v)| (*k, v.clone()))
                .collect();
            if more.is_empty() {
                return Ok(());
            }
            proven.extend(
                more.iter()
                    .map(|(id, o)| (*id, (o.clone(), o.desc.opened_grant().epoch))),
            );
            let limit = self.inner.params.connect_timeout;
            let refused = match timeout(limit, reprove(c, &more)).await {
                Ok(Ok(refused)) => refused,
                Ok(Err(e)) => {
                    c.kill("authentication failed on reconnect");
                    return Err(e);
                }
                Err(_) => {
                    c.kill("no auth ack within the connect timeout");
                    return Err(TransferError::ConnectionLost(format!(
                        "reconnecting to {}: no auth ack within {limit:?}",
                        self.inner.addr
                    )));
                }
            };
            if !refused.is_empty() {
                let mut opened = self.inner.opened.borrow_mut();
                for id in &refused {
                    // (Unless an open replaced it while this proved.)
                    let asked = more.iter().find(|(i, _)| i == id).map(|(_, o)| o);
                    if let Some(o) = opened.get(id).filter(|o| asked.is_some_and(|a| a.same(o))) {
                        o.desc.forget();
                        opened.remove(id);
                    }
                }
                tracing::info!(
                    target = %self.inner.addr,
                    ?refused,
                    "segments the target no longer serves to this peer"
                );
                // (All of them refused: the connection goes on unproven,
                // and the open that comes next proves its token on it.)
            }
        }
    }

    /// The target's process, if a connection attached to it.
    pub(crate) fn target_process(&self) -> Option<Rc<PeerProcess>> {
        self.inner.target.borrow().clone()
    }

    /// How long connecting (and a handshake step) may take.
    pub(crate) fn connect_timeout(&self) -> Duration {
        self.inner.params.connect_timeout
    }

    /// How long the target may stay silent on a request it must answer
    /// ([`EngineConfig::stall_timeout`](crate::EngineConfig::stall_timeout);
    /// `None`: no limit).
    pub(crate) fn stall_timeout(&self) -> Option<Duration> {
        self.inner.params.stall_timeout.filter(|d| !d.is_zero())
    }

    /// True if data connection traffic to this peer moves by cross-memory
    /// attach.
    pub fn is_local(&self) -> bool {
        self.inner.target.borrow().is_some()
    }

    /// The control connection, reconnected (tokens re-proven) if it died.
    pub(crate) async fn control(&self) -> Result<Rc<Conn>, TransferError> {
        self.conn(0).await
    }

    /// Whether `batch` was fenced towards this peer (its later requests are
    /// refused locally, never sent).
    pub(crate) fn is_fenced(&self, batch: u64) -> bool {
        self.inner.fenced.borrow().contains(&batch)
    }

    /// Batches fenced towards this peer that are not retired yet: for
    /// tests and monitoring.
    pub fn fenced_batches(&self) -> usize {
        self.inner.fenced.borrow().len()
    }

    /// The control connection if it is alive.
    /// Leaves the control connection open but unused, as the target sees
    /// it when the initiator's reset was lost in a partition: the next
    /// request opens a new one in the same session. For tests: the old one
    /// is leaked, open.
    #[doc(hidden)]
    pub fn strand_control(&self) {
        if let Some(c) = self.inner.conns.borrow_mut()[0].take() {
            std::mem::forget(c);
        }
    }

    pub(crate) fn live_control(&self) -> Option<Rc<Conn>> {
        self.live(0)
    }

    /// Asks the peer to apply no further byte of `batch`; resolves once it
    /// confirmed. Covers every connection of this session to the peer. The
    /// request travels on the control connection, ahead of queued payloads.
    pub async fn fence(&self, batch: u64) -> Result<(), TransferError> {
        self.fence_qp(batch).await.map(|_| ())
    }

    /// [`fence`](Self::fence), returning the QPN of the RDMA queue pair the
    /// target reset with it (0 if none).
    pub(crate) async fn fence_qp(&self, batch: u64) -> Result<u64, TransferError> {
        // Slices of the batch that have not started are not sent at all.
        self.inner.fenced.borrow_mut().insert(batch);
        self.conn(0).await?.fence(batch).await
    }

    /// `batch` is finished here: every transfer of it towards this peer has
    /// ended, and none will start. If it was fenced, the target is told on
    /// every connection (`Forget`), so it can drop the batch's fence entry
    /// once no connection can still carry a frame of it; the local mark goes.
    pub fn retire(&self, batch: u64) {
        if !self.inner.fenced.borrow_mut().remove(&batch) {
            return;
        }
        let conns: Vec<Rc<Conn>> = (0..self.inner.conns.borrow().len())
            .filter_map(|i| self.live(i))
            .collect();
        if conns.is_empty() {
            return;
        }
        spawn_local(async move {
            for c in conns {
                c.forget(batch).await;
            }
        });
    }

    /// Tears every connection down with an RST; their requests fail once
    /// their operations are reaped. Later transfers reconnect.
    pub fn abort(&self) {
        for slot in self.inner.conns.borrow_mut().iter_mut() {
            // Forgotten here, so the socket closes (with its RST) as soon as
            // the reader and the requests on it have let go.
            if let Some(c) = slot.take() {
                c.abort();
            }
        }
    }

    /// Closes every connection (used when the engine shuts down); none
    /// opens after it.
    pub(crate) fn close(&self) {
        self.inner.closed.set(true);
        for c in self.inner.conns.borrow().iter().flatten() {
            c.kill("engine shut down");
        }
    }
}

fn conn_params<'a>(
    p: &'a PeerParams,
    fenced: &LocalFences,
    session: &SessionBinding,
    closed: &'a Cell<bool>,
) -> ConnParams<'a> {
    ConnParams {
        closed,
        node: &p.node,
        shards: p.shards,
        session: session.clone(),
        may_start_session: true,
        connect_timeout: p.connect_timeout,
        stall_timeout: p.stall_timeout,
        tcp_congestion: p.tcp_congestion.as_deref(),
        fenced: fenced.clone(),
    }
}

/// The most proofs a reconnect sends in one `Auth`: the answer carries a
/// descriptor per proof (up to ~315 bytes with a long name and its grant
/// receipt), and an `AuthAck` is at most 256 KiB, a request at most 4,096
/// proofs (and 256 KiB: 65 bytes a proof by id).
const REPROVE_CHUNK: usize = 512;

/// A segment opened on a peer: the token that proved it and what the target
/// described.
#[derive(Clone)]
pub(super) struct Opened {
    pub(super) token: Token,
    pub(super) desc: Rc<Proven>,
}

impl Opened {
    /// The same entry: an open may keep the description and bring another
    /// token, which a connection must be proven with too.
    fn same(&self, other: &Opened) -> bool {
        self.desc.same_opening_of(&other.desc) && self.token == other.token
    }
}

/// Proves `tokens` (segment id, what opened it) on a new connection, in
/// requests of [`REPROVE_CHUNK`]; the ids the target refused — or answered
/// with another segment than the one opened: the peer restarted, and its new
/// process's segment has the old one's id (ids count per process) but not
/// its memory, so a write at the old offsets would land where nobody asked.
async fn reprove(c: &Conn, tokens: &[(u64, Opened)]) -> Result<Vec<u64>, TransferError> {
    let mut refused = Vec::new();
    for chunk in tokens.chunks(REPROVE_CHUNK) {
        // The grant each was opened under, and no newer: a transfer made
        // before a revoke may be what reconnects (PROTOCOL.md §5.1).
        let proofs: Vec<(SegmentRef, Token, GrantReceipt)> = chunk
            .iter()
            .map(|(id, o)| (SegmentRef::Id(*id), o.token, o.desc.opened_grant()))
            .collect();
        let ack = c.auth_as_opened(&proofs).await?;
        if ack.results.len() != chunk.len() {
            return Err(TransferError::BadFrame(
                "an AuthAck with the wrong count".into(),
            ));
        }
        let answers = chunk.iter().zip(&ack.results);
        refused.extend(
            answers
                .filter(|((_, o), (st, d))| {
                    *st != Status::Ok || !d.as_ref().is_some_and(|d| o.desc.same_segment(d))
                })
                .map(|((id, _), _)| *id),
        );
    }
    Ok(refused)
}

/// A connection a reconnect made and has not installed: closed if the
/// reconnect ends any other way.
struct Unfinished(Option<Rc<Conn>>);

impl Drop for Unfinished {
    fn drop(&mut self) {
        if let Some(c) = self.0.take() {
            c.kill("the reconnect was given up");
        }
    }
}
