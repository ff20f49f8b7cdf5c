//! The engine: one per shard. It serves its registered segments to peers
//! (the target role) and opens peers for transfers (the initiator role).

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::io;
use std::net::SocketAddr;
use std::rc::Rc;
use std::time::{Duration, Instant};

use quiesce_runtime::net::{TcpListener, TcpStream};
use quiesce_runtime::JoinHandle;

use crate::auth::{random_u64, SessionKey};
use crate::error::TransferError;
use crate::fence::FenceTable;
use crate::peer::{Peer, PeerParams};
use crate::segment::{Rights, Segment, SegmentMemory};
use crate::wire::Descriptor;

/// Engine settings.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// This node's name, sent in hellos.
    pub node: String,
    /// Address to listen on (`127.0.0.1:0` picks a free port).
    pub listen: SocketAddr,
    /// Shard count advertised to peers.
    pub shards: u16,
    /// Connections opened to each peer; slices are striped over them.
    pub connections_per_peer: usize,
    /// Transfers are split into slices of at most this many bytes.
    pub slice_size: usize,
    /// Largest payload the target accepts in one frame.
    pub max_frame: u64,
    /// Payloads of at least this many bytes are sent with `SEND_ZC`.
    pub zc_threshold: Option<usize>,
    /// Connect and handshake timeout (initiator).
    pub connect_timeout: Duration,
    /// How long a new connection may take to finish its handshake — say
    /// hello and prove a first token (target).
    pub handshake_timeout: Duration,
    /// An authenticated connection that sends nothing for this long is
    /// closed (target); the initiator reconnects when it next needs it.
    pub idle_timeout: Option<Duration>,
    /// Connections that have not authenticated yet; a new one evicts the
    /// oldest (target).
    pub max_unauthenticated: usize,
    /// Connections open in all; at the cap a new one evicts the oldest
    /// unauthenticated connection, or is refused (target).
    pub max_connections: usize,
    /// Fenced batches a session may hold in the target's fence table (each
    /// until every connection that could carry it said `Forget` or closed);
    /// past it the target closes the session's connections, which releases
    /// them all (target).
    pub max_fenced_per_session: usize,
    /// Demonstrations only, never in production: acknowledge fences without
    /// applying them, so a fenced batch's bytes keep landing (what a target
    /// without fences does). `quiesce demo` uses it to show that quiesce's
    /// outcomes rest on the initiator's own quiescence, not only on the fence.
    pub ignore_fences: bool,
}

impl Default for EngineConfig {
    fn default() -> Self {
        EngineConfig {
            node: "quiesce".into(),
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            shards: 1,
            connections_per_peer: 2,
            slice_size: 1 << 20,
            max_frame: 16 << 20,
            zc_threshold: None,
            connect_timeout: Duration::from_secs(5),
            handshake_timeout: Duration::from_secs(5),
            idle_timeout: Some(Duration::from_secs(600)),
            max_unauthenticated: 256,
            max_connections: 4096,
            max_fenced_per_session: 4096,
            ignore_fences: false,
        }
    }
}

/// Why a segment cannot be registered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RegisterError {
    /// Names are 1 to 255 bytes.
    #[error("segment names are 1 to 255 bytes")]
    BadName,
    /// Another segment has this name.
    #[error("a segment named {0:?} is already registered")]
    Duplicate(String),
    /// Rights must not be empty.
    #[error("a segment needs at least one right")]
    NoRights,
    /// The memory could not be registered with the RDMA device.
    #[error("memory registration failed: {0}")]
    Memory(String),
}

/// What the target side has done, for metrics and tests.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EngineStats {
    /// Payload bytes that landed in segments.
    pub bytes_landed: u64,
    /// Requests refused (any status but Ok).
    pub rejected: u64,
    /// Connections accepted.
    pub accepted: u64,
    /// Served connections open now.
    pub connections: u64,
    /// Of those, connections that have not proven any token yet.
    pub unauthenticated: u64,
    /// Initiator sessions with a served connection now.
    pub sessions: u64,
    /// `(session, batch)` entries in the fence table now.
    pub fence_entries: u64,
    /// Connections closed at once because every slot was authenticated.
    pub refused: u64,
}

#[derive(Default)]
pub(crate) struct Counters {
    pub(crate) bytes_landed: Cell<u64>,
    pub(crate) rejected: Cell<u64>,
    pub(crate) accepted: Cell<u64>,
    pub(crate) connections: Cell<u64>,
    pub(crate) unauthenticated: Cell<u64>,
    pub(crate) refused: Cell<u64>,
}

pub(crate) struct EngineInner {
    pub(crate) config: EngineConfig,
    local_addr: SocketAddr,
    segments: RefCell<BTreeMap<u64, Segment>>,
    next_segment: Cell<u64>,
    pub(crate) fences: FenceTable,
    /// Live target-side connections per initiator session.
    /// Live sessions (those with an authenticated connection, or that had
    /// one within a handshake timeout).
    sessions: RefCell<HashMap<u64, Session>>,
    /// Sessions whose last connection closed, with when they expire.
    lingering: RefCell<std::collections::VecDeque<(Instant, u64)>>,
    next_conn: Cell<usize>,
    peers: RefCell<HashMap<SocketAddr, Peer>>,
    tasks: RefCell<Vec<JoinHandle<()>>>,
    admission: Rc<RefCell<crate::accept::Admission>>,
    pub(crate) counters: Counters,
    /// The shard's RDMA device, when an `RdmaEngine` wraps this engine.
    pub(crate) rdma: RefCell<Option<Rc<crate::rdma::served::Node>>>,
}

/// A transfer engine on the current shard. Cheap to clone. When the last
/// clone is dropped the engine shuts down as [`shutdown`](Self::shutdown)
/// does (its own tasks hold the engine's state, never a handle, so nothing
/// keeps it up behind the caller's back).
#[derive(Clone)]
pub struct Engine {
    inner: Rc<EngineInner>,
    _last: Rc<LastHandle>,
}

/// Shuts the engine down when the last [`Engine`] handle goes.
struct LastHandle(std::rc::Weak<EngineInner>);

impl Drop for LastHandle {
    fn drop(&mut self) {
        if let Some(inner) = self.0.upgrade() {
            inner.shutdown();
        }
    }
}

impl Engine {
    /// Listens on `config.listen` and starts serving. Call inside a runtime.
    pub fn bind(config: EngineConfig) -> io::Result<Engine> {
        if config.slice_size == 0 || config.slice_size as u64 > config.max_frame {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "slice_size must be in 1..=max_frame",
            ));
        }
        let listener = TcpListener::bind(config.listen)?;
        let inner = Rc::new(EngineInner {
            local_addr: listener.local_addr()?,
            config,
            segments: RefCell::default(),
            next_segment: Cell::new(1),
            fences: FenceTable::default(),
            sessions: RefCell::default(),
            next_conn: Cell::new(1),
            lingering: RefCell::default(),
            peers: RefCell::default(),
            tasks: RefCell::default(),
            admission: Rc::default(),
            counters: Counters::default(),
            rdma: RefCell::default(),
        });
        let accept =
            crate::accept::accept_loop(listener, Rc::downgrade(&inner), inner.admission.clone());
        inner.tasks.borrow_mut().push(accept);
        Ok(Engine {
            _last: Rc::new(LastHandle(Rc::downgrade(&inner))),
            inner,
        })
    }

    /// The address peers connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.inner.local_addr
    }

    /// Registers memory for remote access; the returned segment's token is
    /// what authorised peers need.
    pub fn register(
        &self,
        name: &str,
        mem: impl Into<SegmentMemory>,
        rights: Rights,
    ) -> Result<Segment, RegisterError> {
        if name.is_empty() || name.len() > 255 {
            return Err(RegisterError::BadName);
        }
        if rights.is_empty() {
            return Err(RegisterError::NoRights);
        }
        let mut segs = self.inner.segments.borrow_mut();
        if segs.values().any(|s| s.name() == name) {
            return Err(RegisterError::Duplicate(name.into()));
        }
        let id = self.inner.next_segment.get();
        self.inner.next_segment.set(id + 1);
        let seg = Segment::new(id, name.into(), mem.into(), rights);
        segs.insert(id, seg.clone());
        Ok(seg)
    }

    /// Stops serving segment `id`. Writes landing now finish into its
    /// memory, which stays alive until they do.
    pub fn deregister(&self, id: u64) -> bool {
        self.inner.segments.borrow_mut().remove(&id).is_some()
    }

    /// Connects to the engine at `addr` (or returns the existing peer).
    pub async fn connect(&self, addr: SocketAddr) -> Result<Peer, TransferError> {
        if let Some(p) = self.inner.peers.borrow().get(&addr) {
            return Ok(p.clone());
        }
        let peer = Peer::connect(
            addr,
            self.peer_params(self.inner.config.connections_per_peer),
        )
        .await?;
        self.inner.peers.borrow_mut().insert(addr, peer.clone());
        Ok(peer)
    }

    /// A peer with only its control connection (the RDMA engine's control
    /// plane); not shared with [`connect`](Self::connect).
    pub(crate) async fn connect_control(&self, addr: SocketAddr) -> Result<Peer, TransferError> {
        Peer::connect(addr, self.peer_params(0)).await
    }

    fn peer_params(&self, connections: usize) -> PeerParams {
        let c = &self.inner.config;
        PeerParams {
            node: c.node.clone(),
            shards: c.shards,
            connections,
            slice_size: c.slice_size,
            zc_threshold: c.zc_threshold,
            connect_timeout: c.connect_timeout,
        }
    }

    /// Serves RDMA queue pairs and keys from `node` (set by `RdmaEngine`).
    pub(crate) fn set_rdma(&self, node: Rc<crate::rdma::served::Node>) {
        *self.inner.rdma.borrow_mut() = Some(node);
    }

    /// Target-side counters.
    pub fn stats(&self) -> EngineStats {
        let c = &self.inner.counters;
        EngineStats {
            bytes_landed: c.bytes_landed.get(),
            rejected: c.rejected.get(),
            accepted: c.accepted.get(),
            connections: c.connections.get(),
            unauthenticated: c.unauthenticated.get(),
            sessions: self
                .inner
                .sessions
                .borrow()
                .values()
                .filter(|s| !s.conns.is_empty())
                .count() as u64,
            fence_entries: self.inner.fences.len() as u64,
            refused: c.refused.get(),
        }
    }

    /// Stops accepting, drops served connections (their in-flight ops park
    /// until reaped) and closes connections to peers.
    pub fn shutdown(&self) {
        self.inner.shutdown();
    }
}

impl EngineInner {
    fn shutdown(&self) {
        // Taken out first: aborting drops futures, which may touch the engine.
        let tasks: Vec<JoinHandle<()>> = self.tasks.borrow_mut().drain(..).collect();
        tasks.iter().for_each(JoinHandle::abort);
        self.admission.borrow_mut().abort_all();
        let peers: Vec<Peer> = self.peers.borrow_mut().drain().map(|p| p.1).collect();
        peers.iter().for_each(Peer::close);
    }

    pub(crate) fn segment(&self, id: u64) -> Option<Segment> {
        self.segments.borrow().get(&id).cloned()
    }

    /// The segment registered as `name`.
    pub(crate) fn segment_named(&self, name: &str) -> Option<Segment> {
        self.segments
            .borrow()
            .values()
            .find(|s| s.name() == name)
            .cloned()
    }

    /// What a peer that proved `s`'s token learns about it.
    pub(crate) fn descriptor(&self, s: &Segment) -> Descriptor {
        Descriptor {
            id: s.id(),
            name: s.name().into(),
            len: s.len(),
            rights: s.rights(),
            endpoints: vec![self.local_addr],
        }
    }

    /// The key of `session` if it is live here.
    pub(crate) fn session_key(&self, session: u64) -> Option<SessionKey> {
        self.expire_sessions();
        self.sessions.borrow().get(&session).map(|s| s.key)
    }

    /// Forgets sessions that have had no connection for a handshake timeout.
    fn expire_sessions(&self) {
        let now = Instant::now();
        let mut lingering = self.lingering.borrow_mut();
        let mut sessions = self.sessions.borrow_mut();
        while let Some(&(until, id)) = lingering.front() {
            if until > now {
                break;
            }
            lingering.pop_front();
            if sessions.get(&id).is_some_and(|s| s.conns.is_empty()) {
                sessions.remove(&id);
            }
        }
    }

    /// A fresh session id: random, never 0, not live.
    pub(crate) fn new_session_id(&self) -> u64 {
        loop {
            let id = random_u64();
            if id != 0 && !self.sessions.borrow().contains_key(&id) {
                return id;
            }
        }
    }

    /// Registers connection `s` in `session` until the guard drops: creating
    /// the session with `key`, or joining it (`None`); `None` if the session
    /// to join ended meanwhile.
    pub(crate) fn session_guard(
        &self,
        session: u64,
        key: Option<SessionKey>,
        s: &Rc<TcpStream>,
    ) -> Option<SessionGuard<'_>> {
        let conn = self.next_conn.get();
        self.next_conn.set(conn + 1);
        let mut sessions = self.sessions.borrow_mut();
        let entry = match key {
            Some(key) => sessions.entry(session).or_insert_with(|| Session {
                key,
                conns: HashMap::new(),
            }),
            None => sessions.get_mut(&session)?,
        };
        entry.conns.insert(conn, Rc::downgrade(s));
        Some(SessionGuard {
            engine: self,
            session,
            conn,
        })
    }

    /// The open connections of `session`.
    pub(crate) fn session_conns(&self, session: u64) -> Vec<usize> {
        self.sessions
            .borrow()
            .get(&session)
            .map_or_else(Vec::new, |s| s.conns.keys().copied().collect())
    }

    /// Closes every connection of `session` (it holds too much state): once
    /// they are gone nothing of it can arrive, and its entries go.
    pub(crate) fn close_session(&self, session: u64) {
        let conns: Vec<Rc<TcpStream>> = self
            .sessions
            .borrow()
            .get(&session)
            .map_or_else(Vec::new, |c| {
                c.conns.values().filter_map(|w| w.upgrade()).collect()
            });
        for s in conns {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }
    }
}

/// A session the target bound: its key and its open connections (id → the
/// socket, to close them all when the session holds too much state).
pub(crate) struct Session {
    key: SessionKey,
    conns: HashMap<usize, std::rc::Weak<TcpStream>>,
}

/// A served connection's place in its session.
pub(crate) struct SessionGuard<'a> {
    engine: &'a EngineInner,
    session: u64,
    /// The connection's id (a carrier in the fence table).
    pub(crate) conn: usize,
}

impl Drop for SessionGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.engine.sessions.borrow_mut();
        let Some(entry) = s.get_mut(&self.session) else {
            return;
        };
        entry.conns.remove(&self.conn);
        let last = entry.conns.is_empty();
        drop(s);
        self.engine.fences.closed(self.session, self.conn);
        if last {
            // The session's fence state goes now; its id and key linger for
            // a handshake timeout, so a peer reconnecting after a teardown
            // (its last connection closing here just before) still joins.
            self.engine.fences.end_session(self.session);
            let until = Instant::now() + self.engine.config.handshake_timeout;
            self.engine
                .lingering
                .borrow_mut()
                .push_back((until, self.session));
        }
    }
}
