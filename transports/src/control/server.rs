//! The control server: serves one connection from a peer. It runs the
//! handshake (hello, then a first proven token, under one deadline; nothing
//! else is served before), binds the connection to its session, answers
//! `Auth`, `Fence` and `Forget` itself, and dispatches `Write`/`Read` to the
//! TCP data path (`crate::tcp::serve`) and `QpConnect` to the registered
//! [`QpPlane`](crate::control::QpPlane).

use std::cell::Cell;
use std::io;
use std::rc::Rc;
use std::time::Instant;
use tracing::Instrument;

use quiesce_runtime::net::TcpStream;
use quiesce_runtime::time::timeout;
use quiesce_runtime::timeline::{self, Step};

use crate::control::auth::{random_bytes, SessionKey};
use crate::control::frame::{read_header, read_payload, send_frame, send_now, send_unsent};
use crate::control::idle::IdleLimit;
use crate::control::prove::RefusedWork;
use crate::control::read_ahead::ReadAhead;
use crate::control::target::Target;
use crate::control::wire::{
    Header, Hello, HelloAck, Opcode, QpAccept, QpConnect, QpWire, Status, MAX_HANDSHAKE_PAYLOAD,
    QP_CONNECT_PAYLOAD,
};
use crate::tcp::own_ids::OwnIdMap;

/// Why a connection was closed by the target.
#[derive(Debug)]
pub(crate) enum Closed {
    Io(io::Error),
    /// The peer broke the protocol (a bad frame, a request before its
    /// proof, ...): logged as a warning.
    Protocol(String),
    /// The peer said nothing in time: the handshake's deadline passed, or
    /// an authenticated connection stayed idle past its limit. A client
    /// may do either without fault (one whose proof was refused keeps its
    /// connection until the deadline): logged at info.
    TimedOut(String),
}

impl From<io::Error> for Closed {
    fn from(e: io::Error) -> Self {
        Closed::Io(e)
    }
}

pub(crate) struct ServedConn<'a> {
    pub(crate) engine: &'a Target,
    pub(crate) s: &'a TcpStream,
    pub(crate) session: u64,
    /// How the connection enters its session once it authenticates.
    pub(crate) entry: SessionEntry,
    /// This connection's nonce (the target's), which an initiator attaching
    /// for the local transport shows in its memory.
    pub(crate) nonce: [u8; 16],
    pub(crate) peer_nonce: [u8; 16],
    /// Segments whose token this connection proved, with the grant epoch
    /// current when it did (see `revoke.rs`).
    pub(crate) authorised: OwnIdMap<u64>,
    /// What the RDMA plane serves this connection (its protection domain,
    /// queue pair and keys), from its first `QpConnect`.
    served: crate::control::ServedSlot,
    pub(crate) census: Census<'a>,
    /// The canceller of the last write's receive, re-armed for the next.
    pub(crate) canceller: Option<quiesce_runtime::Canceller>,
    /// The last write's landing cell, reused when no parked receive holds it.
    pub(crate) landing: Option<std::rc::Rc<crate::tcp::serve::LandingCell>>,
    /// The initiator's process, once the connection attached to it (the
    /// local transport).
    pub(crate) local: Option<crate::local::serve::Attached>,
    /// It sent a `LocalAttach` (one is answered per connection).
    pub(crate) attach_tried: bool,
    /// The mailbox the attached initiator shares with us, if any: small
    /// requests and their answers in shared memory.
    pub(crate) inbox: Option<crate::local::inbox::Inbox>,
    /// What was received ahead of the frame being served: every read of
    /// the connection after its handshake goes through it.
    pub(crate) rx: ReadAhead,
    /// How long it may stay silent, between frames and inside one.
    pub(crate) idle: IdleLimit,
    /// HMACs spent on its refused `First` proofs (each may cost one per
    /// segment): past its budget (`prove.rs`) the connection is closed.
    pub(crate) refused_firsts: RefusedWork,
}

/// How a connection enters its session.
pub(crate) enum SessionEntry {
    /// It asked for a new session (or one the target no longer has): the
    /// target chose `session` and this key, and creates the session when
    /// the connection authenticates.
    Create(SessionKey),
    /// It asked to join a live session: its first `Auth` must prove the
    /// session's key.
    Join,
    /// It is in the session.
    Member,
}

/// Counts a served connection in the engine's stats while it lives, and
/// whether it has proven a token yet. The accept loop shares `flag`: it
/// evicts the oldest connections that have not authenticated when there are
/// too many.
pub(crate) struct Census<'a> {
    counters: &'a crate::control::target::Counters,
    authenticated: bool,
    flag: Rc<Cell<bool>>,
}

impl<'a> Census<'a> {
    fn new(counters: &'a crate::control::target::Counters, flag: Rc<Cell<bool>>) -> Census<'a> {
        counters.connections.set(counters.connections.get() + 1);
        counters
            .unauthenticated
            .set(counters.unauthenticated.get() + 1);
        Census {
            counters,
            authenticated: false,
            flag,
        }
    }

    pub(crate) fn authenticated(&mut self) {
        if !std::mem::replace(&mut self.authenticated, true) {
            self.flag.set(true);
            let u = &self.counters.unauthenticated;
            u.set(u.get() - 1);
        }
    }
}

impl Drop for Census<'_> {
    fn drop(&mut self) {
        let c = self.counters;
        c.connections.set(c.connections.get() - 1);
        if !self.authenticated {
            c.unauthenticated.set(c.unauthenticated.get() - 1);
        }
    }
}

/// Serves `s` until the peer leaves or breaks the protocol.
pub(crate) async fn serve(engine: Rc<Target>, s: TcpStream, authenticated: Rc<Cell<bool>>) {
    let census = Census::new(&engine.counters, authenticated);
    let peer = s.peer_addr().ok();
    // Entered at each poll, never held across an await (where the events
    // of the thread's other connections would land in it).
    let span = tracing::debug_span!("target_conn", ?peer);
    let s = Rc::new(s);
    let served = serve_inner(&engine, &s, census)
        .instrument(span.clone())
        .await;
    let _e = span.enter(); // no await below
    match served {
        Ok(()) => tracing::debug!("peer closed the connection"),
        Err(Closed::Io(e)) => tracing::debug!(error = %e, "connection ended"),
        Err(Closed::Protocol(why)) => {
            let limit = &engine.peer_logs.broke_protocol;
            if let Some(suppressed) = limit.admit() {
                tracing::warn!(
                    peer = %peer_name(peer),
                    why,
                    suppressed,
                    "{}",
                    limit.what()
                );
            }
        }
        Err(Closed::TimedOut(why)) => {
            let limit = &engine.peer_logs.timed_out;
            if let Some(suppressed) = limit.admit() {
                tracing::info!(
                    peer = %peer_name(peer),
                    why,
                    suppressed,
                    "{}",
                    limit.what()
                );
            }
        }
    }
}

/// A peer's address for a log line (`?` if the socket no longer has one).
pub(crate) fn peer_name(peer: Option<std::net::SocketAddr>) -> String {
    peer.map_or_else(|| "?".into(), |a| a.to_string())
}

pub(crate) async fn reject(s: &TcpStream, h: &Header, st: Status, why: String) -> Closed {
    let _ = send_frame(s, &status_frame(h, st, 0), &[]).await;
    Closed::Protocol(why)
}

pub(crate) fn status_frame(h: &Header, st: Status, applied: u64) -> Header {
    Header {
        op: Opcode::Status,
        flags: st as u8,
        length: applied,
        ..*h
    }
}

async fn handshake<'a>(
    engine: &'a Target,
    s: &'a TcpStream,
    census: Census<'a>,
) -> Result<ServedConn<'a>, Closed> {
    // Bounded by the caller's handshake deadline.
    let h = match read_header(s).await? {
        None => return Err(Closed::Io(io::ErrorKind::UnexpectedEof.into())),
        Some(Err(e)) => {
            return Err(reject(
                s,
                &Header::new(Opcode::Status),
                Status::BadFrame,
                e.to_string(),
            )
            .await)
        }
        Some(Ok(h)) => h,
    };
    if h.op != Opcode::Hello || h.length as usize > MAX_HANDSHAKE_PAYLOAD {
        return Err(reject(
            s,
            &h,
            Status::BadFrame,
            format!("expected a hello, got {:?}", h.op),
        )
        .await);
    }
    let hello = match Hello::decode(&read_payload(s, h.length as usize).await?) {
        Ok(hello) => hello,
        Err(e) => return Err(reject(s, &h, Status::BadFrame, e.to_string()).await),
    };
    let Some(version) = hello.negotiate() else {
        return Err(reject(s, &h, Status::BadFrame, "no common protocol version".into()).await);
    };
    let mut nonce = [0u8; 16];
    random_bytes(&mut nonce);
    // The target binds sessions: a hello may only ask to join one that is
    // live here (and must then prove its key); otherwise the target chooses
    // a new id and key. Nothing is stored until the connection authenticates.
    let (session, entry, session_key) =
        if hello.session != 0 && engine.session_key(hello.session).is_some() {
            (hello.session, SessionEntry::Join, [0u8; 16])
        } else {
            let key = SessionKey::random();
            (engine.new_session_id(), SessionEntry::Create(key), key.0)
        };
    let ack = HelloAck {
        version,
        shards: engine.config.shards,
        nonce,
        node: engine.config.node.clone(),
        session,
        session_key,
    };
    let payload = ack.encode().map_err(|e| Closed::Protocol(e.to_string()))?;
    send_frame(
        s,
        &Header {
            length: payload.len() as u64,
            ..Header::new(Opcode::HelloAck)
        },
        &payload,
    )
    .await?;
    tracing::debug!(node = hello.node, session, "peer said hello");
    Ok(ServedConn {
        engine,
        s,
        session,
        entry,
        nonce,
        peer_nonce: hello.nonce,
        authorised: OwnIdMap::default(),
        served: Default::default(),
        census,
        canceller: None,
        landing: None,
        local: None,
        attach_tried: false,
        inbox: None,
        rx: ReadAhead::default(),
        idle: IdleLimit::new(engine.config.idle_timeout),
        refused_firsts: RefusedWork::default(),
    })
}

/// The header read (`None`: the peer closed), or the connection closed with
/// `BadFrame` for a malformed one.
async fn next_header<E: std::fmt::Display>(
    s: &TcpStream,
    read: Option<Result<Header, E>>,
) -> Result<Option<Header>, Closed> {
    match read {
        None => Ok(None),
        Some(Ok(h)) => Ok(Some(h)),
        Some(Err(e)) => Err(reject(
            s,
            &Header::new(Opcode::Status),
            Status::BadFrame,
            e.to_string(),
        )
        .await),
    }
}

/// Runs `f` within what is left of the handshake deadline.
async fn by<T>(
    deadline: Instant,
    f: impl std::future::Future<Output = Result<T, Closed>>,
) -> Result<T, Closed> {
    timeout(deadline.saturating_duration_since(Instant::now()), f)
        .await
        .map_err(|_| Closed::TimedOut("handshake not finished in time".into()))?
}

async fn serve_inner(
    engine: &Target,
    stream: &Rc<TcpStream>,
    census: Census<'_>,
) -> Result<(), Closed> {
    let s: &TcpStream = stream;
    // The whole handshake — hello, and proving a first token — has one
    // deadline; a peer that stalls anywhere in it is closed.
    let deadline = Instant::now() + engine.config.handshake_timeout;
    let mut c = by(deadline, handshake(engine, s, census)).await?;

    while !c.census.authenticated {
        let mut rx = std::mem::take(&mut c.rx);
        let read = by(deadline, async { Ok(rx.header(s).await?) }).await;
        c.rx = rx;
        let Some(h) = next_header(s, read?).await? else {
            return Ok(());
        };
        if h.op != Opcode::Auth {
            // Authentication first: nothing else is served (or stored).
            return Err(reject(
                s,
                &h,
                Status::Forbidden,
                format!("{:?} before any token was proven", h.op),
            )
            .await);
        }
        by(deadline, c.auth(&h)).await?;
    }
    let key = match std::mem::replace(&mut c.entry, SessionEntry::Member) {
        SessionEntry::Create(k) => Some(k),
        _ => None,
    };
    let session = match engine.session_guard(c.session, key, stream, &c.served) {
        Ok(g) => g,
        Err(why) => {
            return Err(reject(
                s,
                &Header::new(Opcode::Status),
                Status::Forbidden,
                why.into(),
            )
            .await)
        }
    };
    loop {
        // Out of `c` while it reads: `next_frame` serves the mailbox meanwhile.
        let mut rx = std::mem::take(&mut c.rx);
        let read = match c.inbox.is_some() {
            true => c.next_frame(rx.header(s)).await,
            false => c.idle.wait(rx.header(s)).await,
        };
        c.rx = rx;
        let Some(h) = next_header(s, read?).await? else {
            return Ok(());
        };
        // The mailbox's requests published before this frame was sent go
        // first: the two are one stream (local/mailbox.rs).
        c.serve_inbox()?;
        // No payload: a length would have its bytes read as the next frames.
        if matches!(h.op, Opcode::Fence | Opcode::Forget) && h.length != 0 {
            let why = format!("{:?} carries no payload", h.op);
            return Err(reject(s, &h, Status::BadFrame, why).await);
        }
        match h.op {
            Opcode::Auth => c.auth(&h).await?,
            Opcode::Write => c.write(&h).await?,
            Opcode::Read => c.read(&h).await?,
            Opcode::QpConnect => c.qp_connect(&h).await?,
            Opcode::LocalAttach => c.attach_local(&h).await?,
            Opcode::LocalMailbox => c.open_mailbox(&h).await?,
            Opcode::WriteLocal => c.write_local(&h).await?,
            Opcode::ReadLocal => c.read_local(&h).await?,
            Opcode::Fence => {
                timeline::mark(Step::FenceReceived);
                // RDMA: the responder accepts no further packet of any batch
                // on this queue pair, nor on those of the session's other
                // connections; the initiator builds a new one. The ack names
                // the queue pair reset on this connection (its QPN in
                // `offset`, 0 if none), so the initiator resets the link it
                // belongs to.
                let reset = match engine.config.ignore_fences {
                    true => Ok(0),
                    false => {
                        let mut served = c.served.borrow_mut();
                        let own = served.as_mut().map_or(Ok(0), |link| link.reset());
                        drop(served);
                        // The session's other queue pairs, whatever this one did.
                        let others = engine.reset_served(c.session);
                        own.and_then(|qpn| others.map(|()| qpn as u64))
                    }
                };
                if !engine.config.ignore_fences {
                    let carriers = engine.session_conns(c.session);
                    engine.fences.fence(c.session, h.batch, carriers);
                    engine.fences.quiet(c.session, h.batch).await;
                    timeline::mark(Step::FenceQuiet);
                }
                // A queue pair that may still accept requests: no ack (the
                // initiator reports the target unconfirmed), and the
                // connections of the poisoned links close, which
                // deregisters their domains' regions.
                let reset_qpn = match reset {
                    Ok(qpn) => qpn,
                    Err(why) => {
                        tracing::error!(batch = h.batch, "{why}; the fence is not confirmed");
                        engine.close_poisoned();
                        return Err(Closed::Io(io::Error::other(why)));
                    }
                };
                let ack = Header {
                    op: Opcode::FenceAck,
                    length: 0,
                    offset: reset_qpn,
                    ..h
                };
                c.send(&ack, &[]).await?;
                // Released only by closing what could still carry those
                // batches: every connection of the session that holds them.
                let cfg = &engine.config;
                let over = engine.fences.session_over_cap(
                    c.session,
                    cfg.max_fenced_per_session,
                    cfg.max_fenced_entries,
                );
                if let Some((session, held, why)) = over {
                    tracing::warn!(
                        held,
                        "{why}; closing the connections of the session holding them"
                    );
                    engine.close_session(session);
                }
            }
            Opcode::Forget => engine.fences.forget(c.session, h.batch, session.conn),
            op => return Err(reject(s, &h, Status::BadFrame, format!("unexpected {op:?}")).await),
        }
    }
}

impl ServedConn<'_> {
    /// Awaits `send`, a frame to the peer, within the idle limit: a peer
    /// that stops taking the target's answers (its window shut, or opened
    /// too slowly to take one frame in about the limit) is closed like one
    /// gone silent, instead of holding the connection (and a read's
    /// segment memory, which a deregister waits for) for as long as its
    /// kernel acks. A send the socket takes at once never looks at the
    /// timer.
    pub(crate) async fn sent(
        &mut self,
        send: impl std::future::Future<Output = io::Result<()>>,
    ) -> Result<(), Closed> {
        self.idle.within(send).await?.map_err(Closed::Io)
    }

    /// Sends the frame of `h` and `payload` as [`send_frame`] does, what the
    /// socket does not take at once within the idle limit ([`sent`]): the
    /// common case, a socket with room, costs no more than `send_frame`.
    ///
    /// [`sent`]: Self::sent
    pub(crate) async fn send(&mut self, h: &Header, payload: &[u8]) -> Result<(), Closed> {
        let head = h.encode();
        let sent = send_now(self.s, &head, payload)?;
        if sent == head.len() + payload.len() {
            return Ok(());
        }
        // A full socket (rare): boxed, as in `send_frame`.
        let s = self.s;
        self.sent(Box::pin(send_unsent(s, &head, payload, sent)))
            .await
    }

    /// The frame's payload, of at most `max` bytes, decoded by `decode`;
    /// one too large or malformed is `BadFrame`, and the connection closed.
    pub(crate) async fn decoded<T, E: std::fmt::Display>(
        &mut self,
        h: &Header,
        max: usize,
        decode: impl FnOnce(&[u8]) -> Result<T, E>,
    ) -> Result<T, Closed> {
        if h.length as usize > max {
            let why = format!("{:?} payload too large", h.op);
            return Err(reject(self.s, h, Status::BadFrame, why).await);
        }
        let payload = self
            .idle
            .within(self.rx.payload(self.s, h.length as usize))
            .await??;
        match decode(&payload) {
            Ok(r) => Ok(r),
            Err(e) => Err(reject(self.s, h, Status::BadFrame, e.to_string()).await),
        }
    }

    /// The connection now serves a queue pair: its silence between frames
    /// is no longer idleness (`IdleLimit::lift_between_frames`), and TCP
    /// keep-alive — probes after half the stall limit (else the idle
    /// limit) — finds its peer if it goes without a FIN.
    fn serves_a_queue_pair(&mut self) {
        let c = &self.engine.config;
        let nonzero = |d: Option<std::time::Duration>| d.filter(|d| !d.is_zero());
        // Neither limit set: no idle limit to lift.
        let Some(probes) = nonzero(c.stall_timeout).or(nonzero(c.idle_timeout)) else {
            return;
        };
        if let Err(e) = self.s.set_keepalive(Some(probes)) {
            tracing::warn!(error = %e, "cannot turn TCP keep-alive on; the idle limit stays");
            return;
        }
        self.idle.lift_between_frames();
    }

    /// Sets up (or, for `qpn == 0`, only reports keys of) an RDMA queue pair.
    async fn qp_connect(&mut self, h: &Header) -> Result<(), Closed> {
        let req = self
            .decoded(h, QP_CONNECT_PAYLOAD, QpConnect::decode)
            .await?;
        let plane = self.engine.qp_plane.borrow().clone();
        let mut answer = QpAccept {
            status: 1,
            qp: QpWire::default(),
            keys: Vec::new(),
        };
        // Borrowed in this synchronous block only: a fence on another
        // connection of the session resets it meanwhile.
        {
            let mut served = self.served.borrow_mut();
            if let Some(plane) = plane {
                answer.status = 0;
                if served.is_none() {
                    match plane.open_link() {
                        Ok(link) => *served = Some(link),
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot serve RDMA to a connection");
                            answer.status = 2;
                        }
                    }
                }
            }
            if served.as_ref().is_some_and(|l| l.poisoned()) {
                drop(served);
                tracing::warn!(
                    "closing a connection whose RDMA domain holds a key a revoke could not kill"
                );
                // Shut now: the socket outlives this task in what the
                // session keeps of it, and the initiator waits for an answer.
                let _ = self.s.shutdown(std::net::Shutdown::Both);
                return Err(Closed::Io(io::Error::other(
                    "a revoked key lives on in this connection's RDMA domain",
                )));
            }
            if let Some(link) = served.as_mut().filter(|_| answer.status == 0) {
                if req.qp.qpn != 0 {
                    match link.connect(&req.qp) {
                        Ok(wire) => answer.qp = wire,
                        Err(e) => {
                            tracing::warn!(error = %e, "cannot serve a queue pair");
                            answer.status = 2;
                        }
                    }
                }
                // Keys only for grants no revoke has overtaken (a revoke kills
                // the segment's keys): after one the peer proves the token again.
                let engine = self.engine;
                answer.keys = link.keys(&mut self.authorised.iter().filter_map(|(&id, &epoch)| {
                    let seg = engine.segment(id)?;
                    (!seg.inner.grants.revoked_since(epoch)).then_some(id)
                }));
            }
        }
        if answer.qp.qpn != 0 {
            self.serves_a_queue_pair();
        }
        if crate::rdma::served::stalled_qp_accept() {
            quiesce_runtime::time::sleep(std::time::Duration::from_secs(3600)).await;
        }
        let payload = match answer.encode() {
            Ok(p) => p,
            Err(e) => return Err(reject(self.s, h, Status::BadFrame, e.to_string()).await),
        };
        let head = Header {
            op: Opcode::QpAccept,
            length: payload.len() as u64,
            ..*h
        };
        self.send(&head, &payload).await?;
        Ok(())
    }
}
