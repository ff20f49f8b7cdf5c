//! The initiator side of one connection: handshake, control requests, and
//! the reader task that matches responses to them (the data requests are
//! in `request.rs`).
//!
//! Frames of one request (header, then payload) are sent under the
//! connection's send lock so they never interleave. Each request gets an id,
//! carried in the frame's `task` field, that the target echoes. A request
//! completes when its own send has finished **and** its response arrived —
//! or the connection died, which the reader reports only after its own
//! receive (possibly into a read's destination) has been reaped.

use std::cell::{Cell, RefCell};
use std::net::{Shutdown, SocketAddr};
use std::rc::Rc;

use quiesce_runtime::net::TcpStream;
use quiesce_runtime::spawn_local;
use quiesce_runtime::time::timeout;

use crate::control::auth::{random_bytes, SessionKey};
use crate::control::frame::{read_header, read_payload, send_frame};
use crate::control::wire::{
    GrantReceipt, Header, Hello, HelloAck, Opcode, QpAccept, QpConnect, MAX_HANDSHAKE_PAYLOAD,
    VERSION,
};
use crate::error::TransferError;
use crate::lock::{AsyncLock, LockGuard};
use crate::tcp::responses::{read_loop, slot, wait, Reply, State};

/// Holds the send half; if dropped before the frame was fully sent (its
/// future was dropped mid-send), framing is lost and the connection dies.
pub(crate) struct SendGuard<'a> {
    conn: &'a Conn,
    pub(crate) complete: bool,
    _lock: LockGuard<'a>,
}

impl Drop for SendGuard<'_> {
    fn drop(&mut self) {
        if !self.complete {
            self.conn.kill("a request was abandoned mid-send");
        }
    }
}

impl Conn {
    pub(crate) async fn send_guard(&self) -> SendGuard<'_> {
        let lock = self.send_lock.lock().await;
        SendGuard {
            conn: self,
            complete: false,
            _lock: lock,
        }
    }
}

/// One initiator connection.
pub(crate) struct Conn {
    pub(crate) stream: TcpStream,
    send_lock: AsyncLock,
    pub(super) state: RefCell<State>,
    next_id: Cell<u64>,
    pub(crate) hello: HelloAck,
    pub(crate) nonce: [u8; 16],
    /// The session the target put the connection in.
    pub(crate) session: u64,
    /// The proof of the session's key that a joining connection sends with
    /// its first `Auth` (zeros for the connection that created it).
    pub(super) join: [u8; 32],
    /// Answered requests' result slots, for the next requests (see
    /// [`Conn::reply`]).
    pub(super) replies: RefCell<Vec<Reply<Result<u64, TransferError>>>>,
    /// Run once when the connection ends (RDMA: reset the queue pair set up
    /// on it, whose peer may be gone with it).
    pub(super) on_close: RefCell<Vec<Box<dyn FnOnce()>>>,
    /// Attached to the target's process: data moves by cross-memory
    /// attach (`crate::local`).
    pub(crate) local: Cell<bool>,
    /// The mailbox its small requests go through, once the target took it
    /// (`crate::local::mailbox`).
    pub(crate) outbox: std::cell::OnceCell<crate::local::outbox::Outbox>,
    /// Batches this initiator has fenced at the peer: their slices that
    /// have not started are answered `Fenced` locally, without being sent.
    pub(super) fenced: LocalFences,
    /// The newest grant receipt the target gave this connection, per
    /// segment id: what its next proof of the segment asks for. (Ids the
    /// target chose: a `HashMap` with std's keyed hasher, not an
    /// `OwnIdMap`.)
    pub(super) grants: RefCell<std::collections::HashMap<u64, GrantReceipt>>,
    /// The grant the target gave this connection, per segment id: the
    /// newest receipt a proof it accepted named (a connection never loses a
    /// grant). Writes of a handle opened under an older grant are not sent
    /// here ([`Conn::granted_above`]).
    pub(super) granted: RefCell<std::collections::HashMap<u64, GrantReceipt>>,
    /// The newest epoch in `granted` (0: none above the first): most
    /// connections never see a revoke, and their writes check only this.
    pub(super) granted_max: Cell<u64>,
    /// Answers heard so far to requests this connection sent (frames for
    /// no request not counted): what a wait bounded by the target's silence
    /// (`Peer::auth_within`) watches.
    answers: Cell<u64>,
}

/// Times [`Conn::auth`] proves a segment again for a newer grant: a revoke
/// between two proofs makes one more; past this (revokes back to back) the
/// connection keeps the grant it has, and its writes into the newly
/// revoked range are refused.
pub(super) const REGRANTS: usize = 3;

/// The segment a write goes to, and the grant epoch of the handle it was
/// made through (`RemoteSegment`'s): checked against the connection's
/// grant under its send lock ([`Conn::refuses_write`]).
#[derive(Clone, Copy, Debug)]
pub(crate) struct SegmentGrant {
    pub(crate) id: u64,
    pub(crate) ceiling: u64,
}

/// Batches fenced by this initiator, shared by a peer's connections.
pub(crate) type LocalFences = Rc<RefCell<super::own_ids::OwnIdSet>>;

/// The session a peer's connections share: chosen by the target for the
/// first connection, joined (by proving its key) by the others.
pub(crate) type SessionBinding = Rc<Cell<Option<(u64, SessionKey)>>>;

/// Connection settings.
pub(crate) struct ConnParams<'a> {
    pub(crate) node: &'a str,
    pub(crate) shards: u16,
    pub(crate) session: SessionBinding,
    /// A control connection may start a session at the target (the one
    /// asked for is gone there); a data connection only joins its peer's:
    /// a peer's connections in two sessions would be fenced apart.
    pub(crate) may_start_session: bool,
    pub(crate) connect_timeout: std::time::Duration,
    /// `TCP_USER_TIMEOUT` ([`EngineConfig::stall_timeout`]).
    ///
    /// [`EngineConfig::stall_timeout`]: crate::EngineConfig::stall_timeout
    pub(crate) stall_timeout: Option<std::time::Duration>,
    /// [`EngineConfig::tcp_congestion`](crate::EngineConfig::tcp_congestion).
    pub(crate) tcp_congestion: Option<&'a str>,
    pub(crate) fenced: LocalFences,
    /// Set once the peer closed (its engine shut down): a connect that
    /// completes after it says nothing and resets.
    pub(crate) closed: &'a std::cell::Cell<bool>,
}

/// Why a data connection was refused: the session it asked to join ended
/// at the target (only a control connection starts a new one).
pub(crate) const SESSION_ENDED: &str = "the peer's session ended at the target";

/// Why a shut-down engine's peer opens no connection.
pub(crate) fn shut_down() -> TransferError {
    TransferError::ConnectionLost("the engine shut down".into())
}

impl Conn {
    /// Connects and says hello; starts the reader.
    pub(crate) async fn connect(
        addr: SocketAddr,
        p: &ConnParams<'_>,
    ) -> Result<Rc<Conn>, TransferError> {
        let hs = |reason: String| TransferError::handshake(addr, reason);
        let stream = timeout(p.connect_timeout, TcpStream::connect(addr))
            .await
            .map_err(|_| TransferError::ConnectTimeout)?
            .map_err(|e| hs(e.to_string()))?;
        if p.closed.get() {
            // Not a byte for the target: the close resets, nothing queued.
            let _ = stream.set_linger(Some(std::time::Duration::ZERO));
            return Err(shut_down());
        }
        stream.set_nodelay(true).map_err(|e| hs(e.to_string()))?;
        stream
            .set_user_timeout(p.stall_timeout)
            .map_err(|e| hs(e.to_string()))?;
        // A target that falls silent while nothing sent is unacknowledged
        // (a read waiting for its data) is found out as stalled too.
        stream
            .set_keepalive(p.stall_timeout)
            .map_err(|e| hs(e.to_string()))?;
        if let Some(name) = p.tcp_congestion {
            stream.set_congestion(name).map_err(|e| hs(e.to_string()))?;
        }
        let mut nonce = [0u8; 16];
        random_bytes(&mut nonce);
        let asked = p.session.get();
        let hello = Hello {
            version_min: VERSION,
            version_max: VERSION,
            session: asked.map_or(0, |(s, _)| s),
            shards: p.shards,
            nonce,
            node: p.node.to_string(),
        }
        .encode()?;
        send_frame(
            &stream,
            &Header {
                length: hello.len() as u64,
                ..Header::new(Opcode::Hello)
            },
            &hello,
        )
        .await
        .map_err(|e| hs(e.to_string()))?;
        let payload = timeout(p.connect_timeout, async {
            let h = match read_header(&stream).await.map_err(|e| hs(e.to_string()))? {
                Some(Ok(h))
                    if h.op == Opcode::HelloAck && h.length as usize <= MAX_HANDSHAKE_PAYLOAD =>
                {
                    h
                }
                Some(Ok(h)) => {
                    return Err(hs(format!("unexpected {:?} (status {})", h.op, h.flags)))
                }
                Some(Err(e)) => return Err(hs(e.to_string())),
                None => return Err(hs("closed during the handshake".into())),
            };
            read_payload(&stream, h.length as usize)
                .await
                .map_err(|e| hs(e.to_string()))
        })
        .await
        .map_err(|_| hs("no hello ack in time".into()))??;
        let hello = HelloAck::decode(&payload)?;
        // A key means a new session (the one asked for, if any, is gone at
        // the target): the peer's later connections join this one.
        let join = if hello.session_key != [0; 16] {
            if !p.may_start_session {
                // Closed before any proof: the target starts no session.
                let _ = stream.set_linger(Some(std::time::Duration::ZERO));
                return Err(hs(SESSION_ENDED.into()));
            }
            p.session
                .set(Some((hello.session, SessionKey(hello.session_key))));
            [0; 32]
        } else {
            match asked {
                Some((s, key)) if s == hello.session => key.prove(&hello.nonce, &nonce, s),
                _ => {
                    return Err(hs(
                        "the target put the connection in a session it did not ask for".into(),
                    ))
                }
            }
        };
        let session = hello.session;
        let conn = Rc::new(Conn {
            stream,
            send_lock: AsyncLock::default(),
            state: RefCell::default(),
            next_id: Cell::new(1),
            hello,
            nonce,
            session,
            join,
            fenced: p.fenced.clone(),
            replies: RefCell::default(),
            on_close: RefCell::default(),
            local: Cell::new(false),
            outbox: std::cell::OnceCell::new(),
            grants: RefCell::default(),
            granted: RefCell::default(),
            granted_max: Cell::new(0),
            answers: Cell::new(0),
        });
        // The reader holds the connection until the socket ends (kill/abort
        // shut it down), then fails whatever is pending.
        spawn_local(read_loop(conn.clone()));
        Ok(conn)
    }

    /// Counts an answer to one of this connection's requests.
    pub(super) fn answered(&self) {
        self.answers.set(self.answers.get().wrapping_add(1));
    }

    /// Answers heard so far ([`answered`](Self::answered)).
    pub(super) fn answers(&self) -> u64 {
        self.answers.get()
    }

    pub(crate) fn is_dead(&self) -> bool {
        self.state.borrow().dead.is_some()
    }

    /// Why the connection ended: this side's own reason if it killed the
    /// connection first (its receive then ends too), else `seen`.
    pub(super) fn death_reason(&self, seen: &str) -> String {
        match &self.state.borrow().dead {
            Some(own) => own.clone(),
            None => seen.to_string(),
        }
    }

    pub(crate) fn lost(&self) -> TransferError {
        TransferError::ConnectionLost(self.state.borrow().dead.clone().unwrap_or_default())
    }

    /// Marks the connection dead and shuts the socket, so every op on it ends.
    pub(crate) fn kill(&self, why: &str) {
        if !self.mark_dead(why) {
            return;
        }
        tracing::debug!(why, "initiator connection killed");
        let _ = self.stream.shutdown(Shutdown::Both);
    }

    /// Kills the connection with an RST, for fences that tear down: the
    /// socket is disconnected at once (an RST, both queues dropped, zero-copy
    /// pages released), whoever holds it — a zero-copy send waiting for its
    /// notification from a silent peer included — and every op on it ends.
    /// The zero linger covers a socket the disconnect could not reset; the
    /// peer's table forgets the connection, so the fd closes once the reader
    /// and the requests let go.
    pub(crate) fn abort(&self) {
        let _ = self.stream.set_linger(Some(std::time::Duration::ZERO));
        self.mark_dead("aborted by this initiator");
        if let Err(e) = self.stream.reset() {
            tracing::debug!(error = %e, "disconnect failed; shutting down instead");
            let _ = self.stream.shutdown(Shutdown::Both);
        }
    }

    /// Records why the connection died; false if it already had.
    fn mark_dead(&self, why: &str) -> bool {
        let mut st = self.state.borrow_mut();
        if st.dead.is_some() {
            return false;
        }
        st.dead = Some(why.to_string());
        true
    }

    pub(crate) fn new_id(&self) -> u64 {
        let id = self.next_id.get();
        self.next_id.set(id + 1);
        id
    }

    /// Hooks waiting for the connection to end.
    pub(crate) fn close_hooks(&self) -> usize {
        self.on_close.borrow().len()
    }

    /// Kills the connection and runs its close hooks now, as its reader
    /// does when it ends: for a test fault, the close read in one piece
    /// with the answer before it.
    pub(crate) fn close_now(&self, why: &str) {
        self.kill(why);
        let hooks = std::mem::take(&mut *self.on_close.borrow_mut());
        hooks.into_iter().for_each(|f| f());
    }

    /// Runs `f` when the connection ends (at once if it has).
    pub(crate) fn on_close(&self, f: impl FnOnce() + 'static) {
        if self.is_dead() {
            f();
        } else {
            self.on_close.borrow_mut().push(Box::new(f));
        }
    }

    /// Sends an RDMA queue pair (or asks for keys only); returns the
    /// target's queue pair and the keys of the segments proven here. A
    /// target that does not answer within `limit` (the stall limit: a
    /// frozen process, whose kernel still acks) gets the connection
    /// killed, and the call fails as `ConnectionLost` instead of waiting
    /// for good: it runs outside any batch (an open), or holds every
    /// transfer to the peer behind it (a link's set-up). Not the connect
    /// timeout: before it answers, the target registers the memory of
    /// every segment proven on the connection in the connection's
    /// protection domain, seconds for a large one. `None`: no limit.
    pub(crate) async fn qp_connect(
        &self,
        req: QpConnect,
        limit: Option<std::time::Duration>,
    ) -> Result<QpAccept, TransferError> {
        let Some(limit) = limit else {
            return self.qp_connect_unbounded(req).await;
        };
        match timeout(limit, self.qp_connect_unbounded(req)).await {
            Ok(r) => r,
            Err(_) => {
                self.kill("no QpAccept within the stall limit");
                Err(TransferError::ConnectionLost(format!(
                    "no answer to a queue pair exchange within {limit:?}"
                )))
            }
        }
    }

    async fn qp_connect_unbounded(&self, req: QpConnect) -> Result<QpAccept, TransferError> {
        let payload = req.encode();
        let result = slot();
        // Queued under the send lock, as `auth`'s.
        let mut g = self.send_guard().await;
        {
            let mut st = self.state.borrow_mut();
            if st.dead.is_some() {
                drop(st);
                g.complete = true;
                return Err(self.lost());
            }
            st.qp_accepts.push_back(result.clone());
        }
        let r = send_frame(
            &self.stream,
            &Header {
                length: payload.len() as u64,
                ..Header::new(Opcode::QpConnect)
            },
            &payload,
        )
        .await;
        g.complete = r.is_ok();
        drop(g);
        wait(&result).await
    }

    /// Asks the target to fence `batch`; resolves on its `FenceAck`, with the
    /// QPN of the RDMA queue pair it reset (0 if none).
    pub(crate) async fn fence(&self, batch: u64) -> Result<u64, TransferError> {
        let result = slot();
        {
            let mut st = self.state.borrow_mut();
            if st.dead.is_some() {
                drop(st);
                return Err(self.lost());
            }
            st.fences.entry(batch).or_default().push(result.clone());
        }
        let mut g = self.send_guard().await;
        let r = send_frame(
            &self.stream,
            &Header {
                batch,
                ..Header::new(Opcode::Fence)
            },
            &[],
        )
        .await;
        g.complete = r.is_ok();
        drop(g);
        wait(&result).await
    }

    /// Tells the target that nothing more of `batch` will be sent on this
    /// connection (no answer). Every earlier frame of it is ahead in the
    /// stream.
    pub(crate) async fn forget(&self, batch: u64) {
        if self.is_dead() {
            return;
        }
        let mut g = self.send_guard().await;
        let r = send_frame(
            &self.stream,
            &Header {
                batch,
                ..Header::new(Opcode::Forget)
            },
            &[],
        )
        .await;
        g.complete = r.is_ok();
    }
}
