//! The target side: serves one connection from a peer.
//!
//! Every request is checked before memory is touched — segment exists, peer
//! proved its token on this connection, the right is granted, `offset +
//! length` lies inside the segment without overflow, `0 < length ≤ max` — and
//! a rejected write's payload is read into scratch memory, never into the
//! segment. Writes land straight in the segment (one receive into the
//! destination range, no copy) and are acknowledged after the last byte.

use std::cell::Cell;
use std::collections::HashMap;
use std::io;
use std::rc::Rc;
use std::time::Instant;

use quiesce_runtime::net::TcpStream;
use quiesce_runtime::time::timeout;

use crate::auth::{random_bytes, SessionKey};
use crate::engine::EngineInner;
use crate::memory::Window;
use crate::rdma::served::ServedQp;
use crate::revoke::LandingGuard;
use crate::segment::{Rights, Segment};
use crate::stream::{discard, read_header, read_payload, send_frame};
use crate::wire::{
    AuthAck, AuthRequest, Header, Hello, HelloAck, Opcode, QpAccept, QpConnect, QpWire, SegmentRef,
    Status, MAX_HANDSHAKE_PAYLOAD, MAX_QP_PAYLOAD,
};

/// Reads up to this size are answered with header and data in one send.
const INLINE_READ: u64 = 16 * 1024;

/// A write landing in a segment, as the fence table and the segment's grants
/// know it.
struct Landing {
    fence: crate::fence::WriteGuard,
    grant: LandingGuard,
}

/// Why a connection was closed by the target.
#[derive(Debug)]
enum Closed {
    Io(io::Error),
    Protocol(String),
}

impl From<io::Error> for Closed {
    fn from(e: io::Error) -> Self {
        Closed::Io(e)
    }
}

struct ServedConn<'a> {
    engine: &'a EngineInner,
    s: &'a TcpStream,
    session: u64,
    /// How the connection enters its session once it authenticates.
    entry: SessionEntry,
    nonce: [u8; 16],
    peer_nonce: [u8; 16],
    /// Segments whose token this connection proved, with the grant epoch
    /// current when it did (see `revoke.rs`).
    authorised: HashMap<u64, u64>,
    /// The RDMA queue pair this connection set up (control connections).
    served: Option<crate::rdma::served::ServedQp>,
    census: Census<'a>,
}

/// How a connection enters its session.
enum SessionEntry {
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
struct Census<'a> {
    counters: &'a crate::engine::Counters,
    authenticated: bool,
    flag: Rc<Cell<bool>>,
}

impl<'a> Census<'a> {
    fn new(counters: &'a crate::engine::Counters, flag: Rc<Cell<bool>>) -> Census<'a> {
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

    fn authenticated(&mut self) {
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
pub(crate) async fn serve(engine: Rc<EngineInner>, s: TcpStream, authenticated: Rc<Cell<bool>>) {
    let census = Census::new(&engine.counters, authenticated);
    let peer = s.peer_addr().ok();
    let span = tracing::debug_span!("target_conn", ?peer);
    let _e = span.enter();
    let s = Rc::new(s);
    match serve_inner(&engine, &s, census).await {
        Ok(()) => tracing::debug!("peer closed the connection"),
        Err(Closed::Io(e)) => tracing::debug!(error = %e, "connection ended"),
        Err(Closed::Protocol(why)) => {
            tracing::warn!(why, "closing a connection that broke the protocol")
        }
    }
}

async fn reject(s: &TcpStream, h: &Header, st: Status, why: String) -> Closed {
    let _ = send_frame(s, &status_frame(h, st, 0), &[]).await;
    Closed::Protocol(why)
}

fn status_frame(h: &Header, st: Status, applied: u64) -> Header {
    Header {
        op: Opcode::Status,
        flags: st as u8,
        length: applied,
        ..*h
    }
}

async fn handshake<'a>(
    engine: &'a EngineInner,
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
        authorised: HashMap::new(),
        served: None,
        census,
    })
}

/// The key proofs for unknown segment ids are checked against, so that a
/// refusal costs the same whether the segment exists or not.
fn unknown_segment_token() -> crate::auth::Token {
    thread_local! {
        static T: crate::auth::Token = crate::auth::Token::random();
    }
    T.with(|t| *t)
}

/// Reads the next frame of an authenticated connection, closing it once it
/// has been idle for the engine's idle timeout.
async fn idle<T>(
    engine: &EngineInner,
    f: impl std::future::Future<Output = io::Result<T>>,
) -> Result<T, Closed> {
    match engine.config.idle_timeout {
        Some(d) => timeout(d, f)
            .await
            .map_err(|_| Closed::Protocol(format!("idle for {d:?}")))?
            .map_err(Closed::Io),
        None => f.await.map_err(Closed::Io),
    }
}

/// Runs `f` within what is left of the handshake deadline.
async fn by<T>(
    deadline: Instant,
    f: impl std::future::Future<Output = Result<T, Closed>>,
) -> Result<T, Closed> {
    timeout(deadline.saturating_duration_since(Instant::now()), f)
        .await
        .map_err(|_| Closed::Protocol("handshake not finished in time".into()))?
}

async fn serve_inner(
    engine: &EngineInner,
    stream: &Rc<TcpStream>,
    census: Census<'_>,
) -> Result<(), Closed> {
    let s: &TcpStream = stream;
    // The whole handshake — hello, and proving a first token — has one
    // deadline; a peer that stalls anywhere in it is closed.
    let deadline = Instant::now() + engine.config.handshake_timeout;
    let mut c = by(deadline, handshake(engine, s, census)).await?;

    while !c.census.authenticated {
        let h = match by(deadline, async { Ok(read_header(s).await?) }).await? {
            None => return Ok(()),
            Some(Ok(h)) => h,
            Some(Err(e)) => {
                return Err(reject(
                    s,
                    &Header::new(Opcode::Status),
                    Status::BadFrame,
                    e.to_string(),
                )
                .await)
            }
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
    let Some(session) = engine.session_guard(c.session, key, stream) else {
        return Err(Closed::Protocol(
            "the session it joined ended during its handshake".into(),
        ));
    };
    loop {
        let h = match idle(engine, read_header(s)).await? {
            None => return Ok(()),
            Some(Ok(h)) => h,
            Some(Err(e)) => {
                return Err(reject(
                    s,
                    &Header::new(Opcode::Status),
                    Status::BadFrame,
                    e.to_string(),
                )
                .await)
            }
        };
        match h.op {
            Opcode::Auth => c.auth(&h).await?,
            Opcode::Write => c.write(&h).await?,
            Opcode::Read => c.read(&h).await?,
            Opcode::QpConnect => c.qp_connect(&h).await?,
            Opcode::Fence => {
                // RDMA: the responder accepts no further packet of any batch
                // on this queue pair; the initiator builds a new one.
                // The ack names the queue pair reset (its QPN in `offset`,
                // 0 if none), so the initiator resets the link it belongs to.
                let reset_qpn = match engine.config.ignore_fences {
                    true => 0,
                    false => c.served.take().map_or(0, |qp| {
                        qp.fence();
                        qp.qpn() as u64
                    }),
                };
                if !engine.config.ignore_fences {
                    let carriers = engine.session_conns(c.session);
                    engine.fences.fence(c.session, h.batch, carriers);
                    engine.fences.quiet(c.session, h.batch).await;
                }
                send_frame(
                    s,
                    &Header {
                        op: Opcode::FenceAck,
                        length: 0,
                        offset: reset_qpn,
                        ..h
                    },
                    &[],
                )
                .await?;
                let held = engine.fences.fenced_in(c.session);
                if held > engine.config.max_fenced_per_session {
                    // Safe to release only by closing what could still carry
                    // those batches: every connection of the session.
                    tracing::warn!(
                        held,
                        "a session holds too many fenced batches; closing its connections"
                    );
                    engine.close_session(c.session);
                }
            }
            Opcode::Forget => engine.fences.forget(c.session, h.batch, session.conn),
            op => return Err(reject(s, &h, Status::BadFrame, format!("unexpected {op:?}")).await),
        }
    }
}

impl ServedConn<'_> {
    /// Sets up (or, for `qpn == 0`, only reports keys of) an RDMA queue pair.
    async fn qp_connect(&mut self, h: &Header) -> Result<(), Closed> {
        if h.length as usize > MAX_QP_PAYLOAD {
            return Err(reject(self.s, h, Status::BadFrame, "qp payload too large".into()).await);
        }
        let req = match QpConnect::decode(&read_payload(self.s, h.length as usize).await?) {
            Ok(r) => r,
            Err(e) => return Err(reject(self.s, h, Status::BadFrame, e.to_string()).await),
        };
        let node = self.engine.rdma.borrow().clone();
        let mut answer = QpAccept {
            status: 1,
            qp: QpWire::default(),
            keys: Vec::new(),
        };
        if let Some(node) = node {
            answer.status = 0;
            if req.qp.qpn != 0 {
                // A new queue pair replaces (and first resets) the old one.
                self.served = None;
                match ServedQp::accept(&node, &req.qp) {
                    Ok((qp, wire)) => {
                        self.served = Some(qp);
                        answer.qp = wire;
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot serve a queue pair");
                        answer.status = 2;
                    }
                }
            }
            // Keys only for grants no revoke has overtaken (RDMA keys are per
            // segment): after a revoke the peer proves the token again.
            let engine = self.engine;
            answer.keys = node.keys(self.authorised.iter().filter_map(|(&id, &epoch)| {
                let seg = engine.segment(id)?;
                (!seg.inner.grants.revoked_since(epoch)).then_some(id)
            }));
        }
        let payload = match answer.encode() {
            Ok(p) => p,
            Err(e) => return Err(reject(self.s, h, Status::BadFrame, e.to_string()).await),
        };
        send_frame(
            self.s,
            &Header {
                op: Opcode::QpAccept,
                length: payload.len() as u64,
                ..*h
            },
            &payload,
        )
        .await?;
        Ok(())
    }

    async fn auth(&mut self, h: &Header) -> Result<(), Closed> {
        if h.length as usize > MAX_HANDSHAKE_PAYLOAD {
            return Err(reject(self.s, h, Status::BadFrame, "auth payload too large".into()).await);
        }
        let req = match AuthRequest::decode(&read_payload(self.s, h.length as usize).await?) {
            Ok(r) => r,
            Err(e) => return Err(reject(self.s, h, Status::BadFrame, e.to_string()).await),
        };
        // Joining a live session takes its key: checked on the first Auth,
        // before any proof counts.
        if matches!(self.entry, SessionEntry::Join) {
            let ok = self
                .engine
                .session_key(self.session)
                .is_some_and(|k| k.verify(&req.join, &self.nonce, &self.peer_nonce, self.session));
            if !ok {
                return Err(reject(
                    self.s,
                    h,
                    Status::Forbidden,
                    "no proof of the session's key".into(),
                )
                .await);
            }
        }
        let results = req
            .proofs
            .iter()
            .map(|(seg_ref, proof)| {
                let seg = match seg_ref {
                    SegmentRef::Id(id) => self.engine.segment(*id),
                    SegmentRef::Name(n) => self.engine.segment_named(n),
                };
                let verify = |t: &crate::auth::Token| {
                    t.verify(proof, &self.nonce, &self.peer_nonce, self.session, seg_ref)
                };
                match seg {
                    Some(seg) if verify(&seg.token()) => {
                        self.authorised.insert(seg.id(), seg.inner.grants.current());
                        self.census.authenticated();
                        (Status::Ok, Some(self.engine.descriptor(&seg)))
                    }
                    Some(_) => (Status::Forbidden, None),
                    // The same answer, after the same work, as a wrong
                    // proof: a refusal does not say whether it exists.
                    None => {
                        let _ = verify(&unknown_segment_token());
                        (Status::Forbidden, None)
                    }
                }
            })
            .collect();
        let payload = match (AuthAck { results }).encode() {
            Ok(p) => p,
            Err(e) => return Err(Closed::Protocol(e.to_string())),
        };
        send_frame(
            self.s,
            &Header {
                op: Opcode::AuthAck,
                length: payload.len() as u64,
                ..*h
            },
            &payload,
        )
        .await?;
        Ok(())
    }

    /// The segment and this connection's grant epoch, if the request may
    /// touch it: length within `1..=max`, batch not fenced, segment known,
    /// token proven, right granted, range inside the segment without
    /// overflow, and (writes) not revoked since the token was proven.
    fn check(&self, h: &Header, need: Rights) -> Result<(Segment, u64), Status> {
        if h.length == 0 || h.length > self.engine.config.max_frame {
            return Err(Status::BadFrame);
        }
        if self.engine.fences.is_fenced(self.session, h.batch) {
            return Err(Status::Fenced);
        }
        // Forbidden before NoSuchSegment: only a peer that proved the
        // segment's token learns that it is gone.
        let Some(&epoch) = self.authorised.get(&h.segment) else {
            return Err(Status::Forbidden);
        };
        let seg = self
            .engine
            .segment(h.segment)
            .ok_or(Status::NoSuchSegment)?;
        if !seg.rights().contains(need) {
            return Err(Status::Forbidden);
        }
        if !seg.check_range(h.offset, h.length) {
            return Err(Status::OutOfBounds);
        }
        if need.contains(Rights::WRITE) && seg.inner.grants.is_revoked(h.offset, h.length, epoch) {
            return Err(Status::Revoked);
        }
        Ok((seg, epoch))
    }

    /// Answers a refused request; a refused write's payload goes to scratch.
    async fn refuse(&self, h: &Header, st: Status, payload: u64) -> Result<(), Closed> {
        discard(self.s, payload).await?;
        let c = &self.engine.counters.rejected;
        c.set(c.get() + 1);
        send_frame(self.s, &status_frame(h, st, 0), &[]).await?;
        Ok(())
    }

    async fn write(&mut self, h: &Header) -> Result<(), Closed> {
        if h.length > self.engine.config.max_frame {
            // The payload cannot be trusted to be there: framing is lost.
            return Err(reject(
                self.s,
                h,
                Status::BadFrame,
                format!("write of {} bytes", h.length),
            )
            .await);
        }
        let (seg, epoch) = match self.check(h, Rights::WRITE) {
            Ok(ok) => ok,
            Err(st) => return self.refuse(h, st, h.length).await,
        };
        // The fence's and the revoke's registrations of this write end only
        // when its last receive is reaped: each receive's window holds them,
        // so a receive parked because this future was dropped keeps them too.
        let landing = Rc::new(Landing {
            fence: self.engine.fences.begin_write(self.session, h.batch),
            grant: LandingGuard::begin(&seg, h.offset, h.length, epoch),
        });
        let (len, mut landed) = (h.length, 0u64);
        while landed < len && !landing.fence.fenced() && !landing.grant.revoked() {
            let window = Window::new(
                seg.inner.mem.clone(),
                (h.offset + landed) as usize,
                (len - landed) as usize,
            )
            .keeping(landing.clone());
            let mut op = self.s.read(window);
            let canceller = op.canceller();
            landing.fence.set_canceller(Some(canceller.clone()));
            landing.grant.set_canceller(Some(canceller));
            let (res, _window) = op.await;
            landing.fence.set_canceller(None);
            landing.grant.set_canceller(None);
            match res {
                Ok(0) => return Err(Closed::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => landed += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ECANCELED) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        let revoked = landed < len && landing.grant.revoked();
        // The receive is reaped: a fence or revoke waiting for this write may
        // resolve.
        drop(landing);
        let st = if landed == len {
            Status::Ok
        } else {
            // Fenced or revoked mid-way: the rest goes to scratch memory, not
            // the segment.
            discard(self.s, len - landed).await?;
            match (revoked, landed) {
                (true, _) => Status::Revoked,
                (false, 0) => Status::Fenced,
                (false, _) => Status::FencedPartial,
            }
        };
        let c = &self.engine.counters;
        c.bytes_landed.set(c.bytes_landed.get() + landed);
        send_frame(self.s, &status_frame(h, st, landed), &[]).await?;
        Ok(())
    }

    async fn read(&mut self, h: &Header) -> Result<(), Closed> {
        let seg = match self.check(h, Rights::READ) {
            Ok((seg, _)) => seg,
            Err(st) => return self.refuse(h, st, 0).await,
        };
        let head = Header {
            op: Opcode::ReadData,
            ..*h
        };
        if h.length <= INLINE_READ {
            // Small: header and data in one send, one reactor turn.
            let mut data = vec![0u8; h.length as usize];
            seg.read_at(h.offset, &mut data);
            send_frame(self.s, &head, &data).await?;
            return Ok(());
        }
        send_frame(self.s, &head, &[]).await?;
        let window = Window::new(seg.inner.mem.clone(), h.offset as usize, h.length as usize);
        let zc = self
            .engine
            .config
            .zc_threshold
            .is_some_and(|t| h.length >= t as u64);
        let (res, _) = if zc {
            self.s.write_all_zc(window).await
        } else {
            self.s.write_all(window).await
        };
        res?;
        Ok(())
    }
}
