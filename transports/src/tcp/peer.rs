//! A remote engine as seen by the initiator: its connections, its segments,
//! and transfers sliced over and striped across the connections.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::Duration;

use quiesce_runtime::time::timeout;
use quiesce_runtime::{spawn_local, IoBuf, IoBufMut};

use quiesce_runtime::process::PeerProcess;

use crate::control::auth::Token;
use crate::control::wire::Opcode;
use crate::control::wire::{Descriptor, SegmentRef, Status};
use crate::error::TransferError;
use crate::local::conn::attach_data;
use crate::local::loan::{lend, Request};
use crate::local::mailbox::SLOT_DATA;
use crate::lock::SetupGate;
use crate::tcp::conn::{Conn, ConnParams, LocalFences, SessionBinding, INLINE_PAYLOAD};
use crate::tcp::split::{bytes_of, init_bytes, join_slices, set_filled, slices, Part, SplitBuf};

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
    pub(crate) local: crate::LocalMode,
    /// Offer attached connections a mailbox for small requests.
    pub(crate) mailbox: bool,
}

pub(crate) struct PeerInner {
    addr: SocketAddr,
    params: PeerParams,
    conns: RefCell<Vec<Option<Rc<Conn>>>>,
    node: String,
    /// The session the target bound this peer's connections to.
    session: SessionBinding,
    /// Tokens proven so far, replayed (by id) on every new connection.
    opened: RefCell<BTreeMap<u64, Token>>,
    rr: Cell<usize>,
    /// Serialises reconnects, so concurrent slices open one connection, and
    /// fails those that waited behind a failed one with its error.
    reconnect: SetupGate,
    fenced: LocalFences,
    /// The target's process, once a data connection attached to it (the
    /// local transport).
    target: RefCell<Option<Rc<PeerProcess>>>,
}

/// A connected remote engine. Cheap to clone.
#[derive(Clone)]
pub struct Peer {
    inner: Rc<PeerInner>,
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
        let first = Conn::connect(addr, &conn_params(&params, &fenced, &session)).await?;
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
            }),
        })
    }

    /// The peer's node name.
    pub fn node(&self) -> &str {
        &self.inner.node
    }

    /// The peer's address.
    pub fn addr(&self) -> SocketAddr {
        self.inner.addr
    }

    /// Opens the segment named `name` by proving `token` (on the control
    /// connection, then on every data connection, which are connected now
    /// if they are not). The target refuses a wrong token and an unknown
    /// name alike ([`TransferError::OpenRefused`]).
    pub async fn open(&self, name: &str, token: Token) -> Result<RemoteSegment, TransferError> {
        let seg = SegmentRef::Name(name.to_string());
        self.open_ref(seg, token, |d| d.name == name, || name.to_string())
            .await
    }

    /// Opens the segment that holds the target's virtual address `addr`
    /// (Mooncake-style addressing: callers name remote memory by the peer's
    /// addresses), proving `token` for it. Its descriptor's `base` maps
    /// addresses to offsets. Refused like [`open`](Self::open) when no
    /// segment holds the address or the token is wrong.
    pub async fn open_at(&self, addr: u64, token: Token) -> Result<RemoteSegment, TransferError> {
        let holds = |d: &Descriptor| addr.checked_sub(d.base).is_some_and(|o| o < d.len);
        self.open_ref(SegmentRef::Address(addr), token, holds, || {
            format!("the segment at {addr:#x}")
        })
        .await
    }

    /// Opens the segment the target registered first among those live now
    /// that `token` opens (Mooncake's `get_first_buffer_address`). Refused
    /// like [`open`](Self::open) when `token` opens none.
    pub async fn open_first(&self, token: Token) -> Result<RemoteSegment, TransferError> {
        self.open_ref(
            SegmentRef::First,
            token,
            |_| true,
            || "the first registered segment".to_string(),
        )
        .await
    }

    async fn open_ref(
        &self,
        seg: SegmentRef,
        token: Token,
        is_it: impl Fn(&Descriptor) -> bool,
        what: impl Fn() -> String,
    ) -> Result<RemoteSegment, TransferError> {
        let control = self.control().await?;
        let ack = control.auth(&[(seg, token)]).await?;
        let desc = match ack.results.as_slice() {
            [(Status::Ok, Some(d))] if is_it(d) => d.clone(),
            [(Status::Ok, _)] => {
                return Err(TransferError::BadFrame(
                    "an AuthAck without the opened segment's descriptor".into(),
                ))
            }
            _ => return Err(TransferError::OpenRefused(what())),
        };
        self.inner.opened.borrow_mut().insert(desc.id, token);
        let n = self.inner.conns.borrow().len();
        for i in 1..n {
            match self.live(i) {
                Some(c) => {
                    let ack = c.auth(&[(SegmentRef::Id(desc.id), token)]).await?;
                    check_auth(&[desc.id], &ack.results)?;
                }
                // A new connection proves every opened token, this one too.
                None => {
                    self.conn(i).await?;
                }
            }
        }
        Ok(RemoteSegment {
            peer: self.clone(),
            desc: Rc::new(desc),
        })
    }

    fn live(&self, i: usize) -> Option<Rc<Conn>> {
        self.inner.conns.borrow()[i]
            .clone()
            .filter(|c| !c.is_dead())
    }

    /// Connection `i`, reconnecting (and re-proving tokens) if it died.
    async fn conn(&self, i: usize) -> Result<Rc<Conn>, TransferError> {
        if let Some(c) = self.live(i) {
            return Ok(c);
        }
        // Rare: boxed, so the handshake's state is not part of every
        // transfer's future (a one-task batch holds that future inline).
        Box::pin(
            self.inner
                .reconnect
                .run(|| self.live(i), || self.reconnect(i)),
        )
        .await
    }

    /// Opens connection `i` again (through the reconnect gate).
    async fn reconnect(&self, i: usize) -> Result<Rc<Conn>, TransferError> {
        let c = Conn::connect(
            self.inner.addr,
            &conn_params(&self.inner.params, &self.inner.fenced, &self.inner.session),
        )
        .await
        .map_err(|e| match e {
            // For a transfer, a failed reconnect is a lost peer.
            TransferError::Handshake { reason, .. } => TransferError::ConnectionLost(reason),
            e => e,
        })?;
        let tokens: Vec<(SegmentRef, Token)> = self
            .inner
            .opened
            .borrow()
            .iter()
            .map(|(k, v)| (SegmentRef::Id(*k), *v))
            .collect();
        if !tokens.is_empty() {
            // Bounded like the rest of the handshake: a target that answers
            // the hello and then never the auth must not hold the transfer
            // (and the caller's buffer) for ever.
            let ack = match timeout(self.inner.params.connect_timeout, c.auth(&tokens)).await {
                Ok(ack) => ack,
                Err(_) => {
                    c.kill("no auth ack within the connect timeout");
                    return Err(TransferError::ConnectionLost(format!(
                        "reconnecting to {}: no auth ack within {:?}",
                        self.inner.addr, self.inner.params.connect_timeout
                    )));
                }
            };
            let ids: Vec<u64> = tokens
                .iter()
                .filter_map(|(r, _)| match r {
                    SegmentRef::Id(id) => Some(*id),
                    SegmentRef::Name(_) | SegmentRef::Address(_) | SegmentRef::First => None,
                })
                .collect();
            if let Err(e) = ack.and_then(|ack| check_auth(&ids, &ack.results)) {
                c.kill("authentication failed on reconnect");
                return Err(e);
            }
        }
        if i > 0 {
            let p = &self.inner.params;
            attach_data(&c, p, &self.inner.target).await?;
        }
        self.inner.conns.borrow_mut()[i] = Some(c.clone());
        Ok(c)
    }

    /// The target's process, if a connection attached to it.
    pub(crate) fn target_process(&self) -> Option<Rc<PeerProcess>> {
        self.inner.target.borrow().clone()
    }

    /// How long connecting (and a handshake step) may take.
    pub(crate) fn connect_timeout(&self) -> Duration {
        self.inner.params.connect_timeout
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

    /// Closes every connection (used when the engine shuts down).
    pub(crate) fn close(&self) {
        for c in self.inner.conns.borrow().iter().flatten() {
            c.kill("engine shut down");
        }
    }
}

fn conn_params<'a>(
    p: &'a PeerParams,
    fenced: &LocalFences,
    session: &SessionBinding,
) -> ConnParams<'a> {
    ConnParams {
        node: &p.node,
        shards: p.shards,
        session: session.clone(),
        connect_timeout: p.connect_timeout,
        stall_timeout: p.stall_timeout,
        fenced: fenced.clone(),
    }
}

fn check_auth(ids: &[u64], results: &[(Status, Option<Descriptor>)]) -> Result<(), TransferError> {
    if results.len() != ids.len() {
        return Err(TransferError::BadFrame(
            "an AuthAck with the wrong count".into(),
        ));
    }
    for (id, (st, _)) in ids.iter().zip(results) {
        if *st != Status::Ok {
            return Err(TransferError::Forbidden(*id));
        }
    }
    Ok(())
}

/// A segment of a peer that this initiator has opened.
#[derive(Clone)]
pub struct RemoteSegment {
    peer: Peer,
    /// Shared: a segment handle is cloned per transfer.
    desc: Rc<Descriptor>,
}

/// A transfer of `len` bytes at `offset` of a segment of `seg_len` bytes:
/// not empty, and inside without overflow.
pub(crate) fn check_range(offset: u64, len: u64, seg_len: u64) -> Result<(), TransferError> {
    if len == 0 {
        return Err(TransferError::BadLength("zero-length transfer"));
    }
    if offset.checked_add(len).is_none_or(|e| e > seg_len) {
        return Err(TransferError::OutOfBounds {
            offset,
            len,
            seg_len,
        });
    }
    Ok(())
}

/// The descriptor accessors of a remote segment handle (a `desc:
/// Rc<Descriptor>` field): TCP's and RDMA's alike.
macro_rules! descriptor_accessors {
    () => {
        /// The segment's id at the peer.
        pub fn id(&self) -> u64 {
            self.desc.id
        }

        /// Its length.
        pub fn len(&self) -> u64 {
            self.desc.len
        }

        /// True for an empty segment.
        pub fn is_empty(&self) -> bool {
            self.desc.len == 0
        }

        /// Its name.
        pub fn name(&self) -> &str {
            &self.desc.name
        }

        /// The target's virtual address of its first byte: the offset of a
        /// peer address `a` in it is `a - base()`.
        pub fn base(&self) -> u64 {
            self.desc.base
        }

        /// What the peer advertised. The target enforces it: in its request
        /// checks over TCP, with its memory region's access flags (its NIC)
        /// over RDMA.
        pub fn rights(&self) -> crate::segment::Rights {
            self.desc.rights
        }
    };
}
pub(crate) use descriptor_accessors;

impl RemoteSegment {
    descriptor_accessors!();

    /// What the target told about it when it was opened.
    pub(crate) fn descriptor(&self) -> &Rc<Descriptor> {
        &self.desc
    }

    /// The peer it lives on.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Cuts `0..len` of `shared` into slices, runs `slice(conn, offset, part)`
    /// for each on the data connections round-robin (each slice a task of its
    /// own, so it finishes even if the caller's future is dropped; a single
    /// slice runs in place), and folds the results once every slice has answered.
    async fn stripe<B, F, Fut>(
        &self,
        shared: &SplitBuf<B>,
        len: u64,
        write: bool,
        slice: F,
    ) -> Result<u64, TransferError>
    where
        B: IoBuf,
        F: Fn(Rc<Conn>, u64, Part<B>) -> Fut + Clone + 'static,
        Fut: std::future::Future<Output = Result<u64, TransferError>> + 'static,
    {
        let inner = &self.peer.inner;
        let n = inner.params.connections.max(1);
        // Attached: the target copies a request in chunks of its own, so a
        // slice needs no bound of a frame's and fewer round trips are better.
        let slice_size = match self.peer.is_local() {
            true => inner.params.slice_size.max(crate::local::SLICE),
            false => inner.params.slice_size,
        };
        if len <= slice_size as u64 {
            // One slice: run it in place. If this future is dropped mid-send,
            // the connection's send guard kills the connection (framing is
            // lost) and the parked op keeps the part alive until reaped.
            let conn = self.next_conn().await?;
            return slice(conn, 0, shared.part(0, len as usize)).await;
        }
        let handles: Vec<_> = slices(len, slice_size)
            .map(|(off, l)| {
                let i = inner.rr.get();
                inner.rr.set(i.wrapping_add(1));
                let part = shared.part(off as usize, l as usize);
                let (peer, slice) = (self.peer.clone(), slice.clone());
                spawn_local(async move {
                    let conn = peer.conn(1 + i % n).await?;
                    slice(conn, off, part).await
                })
            })
            .collect();
        join_slices(handles, write).await
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), TransferError> {
        check_range(offset, len, self.desc.len)
    }

    /// A local request for `len` bytes at `offset`, at `at` in this process.
    fn request(&self, op: Opcode, batch: u64, offset: u64, at: *const u8, len: u64) -> Request {
        Request {
            op,
            batch,
            segment: self.desc.id,
            offset,
            addr: at as u64,
            len,
        }
    }

    /// The next data connection, round-robin.
    async fn next_conn(&self) -> Result<Rc<Conn>, TransferError> {
        let inner = &self.peer.inner;
        let i = inner.rr.get();
        inner.rr.set(i.wrapping_add(1));
        self.peer
            .conn(1 + i % inner.params.connections.max(1))
            .await
    }

    /// Writes the initialised bytes of `src` to `offset`, sliced and striped
    /// over the peer's connections. Resolves when every slice has its answer
    /// and every local operation has returned its part of `src`.
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
        if len <= INLINE_PAYLOAD as u64 {
            // Copied into the frame: nothing of `src` is lent, so nothing
            // needs to share it (no `SplitBuf`).
            let conn = match self.next_conn().await {
                Ok(c) => c,
                Err(e) => return (Err(e), src),
            };
            if conn.has_outbox() {
                let res = conn
                    .write_mailbox(batch, self.desc.id, offset, init_bytes(&src))
                    .await;
                return (res, src);
            }
            if conn.is_local() {
                let req = self.request(Opcode::WriteLocal, batch, offset, src.stable_ptr(), len);
                // Boxed (the local transport without a mailbox): its state
                // stays out of the small TCP write's future.
                return Box::pin(lend(&self.peer, conn, req, src)).await;
            }
            let res = conn
                .write_copied(batch, self.desc.id, offset, init_bytes(&src))
                .await;
            return (res, src);
        }
        // Larger writes are boxed: a one-task batch holds its transfer's
        // future inline, and the striped path's state is twice the small
        // path's (one allocation beside a send of more than 16 KiB).
        Box::pin(self.write_striped(offset, src, len, batch)).await
    }

    /// [`write`](Self::write) of more than [`INLINE_PAYLOAD`] bytes: sliced
    /// and striped over the data connections.
    async fn write_striped<B: IoBuf>(
        &self,
        offset: u64,
        src: B,
        len: u64,
        batch: u64,
    ) -> (Result<u64, TransferError>, B) {
        let shared = SplitBuf::source(src);
        let p = &self.peer.inner.params;
        let zc_threshold = p.zc_threshold;
        let seg = self.desc.id;
        let this = self.clone();
        let res = self
            .stripe(&shared, len, true, move |conn, off, part| {
                let this = this.clone();
                async move {
                    if conn.has_outbox() && part.len() <= SLOT_DATA {
                        let data = bytes_of(&part);
                        return conn.write_mailbox(batch, seg, offset + off, data).await;
                    }
                    if conn.is_local() {
                        let at = part.stable_ptr();
                        let n = part.len() as u64;
                        let req = this.request(Opcode::WriteLocal, batch, offset + off, at, n);
                        return lend(&this.peer, conn, req, part).await.0;
                    }
                    let zc = zc_threshold.is_some_and(|t| part.len() >= t);
                    conn.write(batch, seg, offset + off, part, zc).await.0
                }
            })
            .await;
        match shared.try_into_inner() {
            Ok(src) => (res, src),
            Err(_) => unreachable!("every slice returned its part"),
        }
    }

    /// Reads `len` bytes at `offset` into `dst[..len]` (`len <=
    /// dst.bytes_total()`), sliced and striped like [`write`](Self::write).
    pub async fn read<B: IoBufMut>(
        &self,
        offset: u64,
        len: u64,
        dst: B,
        batch: u64,
    ) -> (Result<u64, TransferError>, B) {
        if let Err(e) = self.check(offset, len) {
            return (Err(e), dst);
        }
        if len > dst.bytes_total() as u64 {
            return (
                Err(TransferError::BadLength(
                    "destination smaller than the range",
                )),
                dst,
            );
        }
        let shared = SplitBuf::destination(dst);
        let seg = self.desc.id;
        let this = self.clone();
        let res = self
            .stripe(&shared, len, false, move |conn, off, mut part| {
                let this = this.clone();
                async move {
                    if conn.has_outbox() && part.len() <= SLOT_DATA {
                        return conn.read_mailbox(batch, seg, offset + off, part).await;
                    }
                    if conn.is_local() {
                        let at = part.stable_mut_ptr();
                        let n = part.len() as u64;
                        let req = this.request(Opcode::ReadLocal, batch, offset + off, at, n);
                        return lend(&this.peer, conn, req, part).await.0;
                    }
                    conn.read(batch, seg, offset + off, part).await
                }
            })
            .await;
        let mut dst = match shared.try_into_inner() {
            Ok(dst) => dst,
            Err(_) => unreachable!("every slice returned its part"),
        };
        if res.is_ok() {
            set_filled(&mut dst, len as usize);
        }
        (res, dst)
    }
}
