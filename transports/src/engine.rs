//! The engine: one per shard. It serves its registered segments to peers
//! (the target role) and opens peers for transfers (the initiator role).

use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::rc::Rc;

use quiesce_runtime::net::TcpListener;

use crate::config::EngineConfig;
use crate::control::auth::{GrantKey, Token};
use crate::control::fence::FenceTable;
use crate::control::log_limit::PeerLogs;
use crate::control::target::{Counters, Target};
use crate::error::TransferError;
use crate::lock::Connecting;
use crate::segment::{Rights, Segment, SegmentMemory};
use crate::tcp::peer::{Peer, PeerParams};

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
    /// Requests served from attached initiators' mailboxes (shared memory)
    /// rather than read from a socket.
    pub mailbox_requests: u64,
    /// Token proofs checked against a segment's token (one HMAC each): what
    /// authenticating peers, honest or not, cost this target.
    pub proof_checks: u64,
}

/// A transfer engine on the current shard. Cheap to clone. When the last
/// clone is dropped the engine shuts down as [`shutdown`](Self::shutdown)
/// does (its own tasks hold the engine's state, never a handle, so nothing
/// keeps it up behind the caller's back).
#[derive(Clone)]
pub struct Engine {
    inner: Rc<Target>,
    /// The peers this engine opened (the initiator role).
    peers: Rc<RefCell<HashMap<SocketAddr, Peer>>>,
    /// Connects in flight, by address (one peer per address).
    connecting: Rc<Connecting>,
    _last: Rc<LastHandle>,
}

/// Shuts the engine down when the last [`Engine`] handle goes.
struct LastHandle {
    target: std::rc::Weak<Target>,
    peers: std::rc::Weak<RefCell<HashMap<SocketAddr, Peer>>>,
}

impl Drop for LastHandle {
    fn drop(&mut self) {
        if let Some(t) = self.target.upgrade() {
            t.shutdown();
        }
        if let Some(p) = self.peers.upgrade() {
            close_peers(&p);
        }
    }
}

/// Refuses settings no engine can run with.
fn check(config: &EngineConfig) -> io::Result<()> {
    if config.connections_per_peer == 0 {
        // Slices go on the data connections: at least one.
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "connections_per_peer must be at least 1",
        ));
    }
    if config.slice_size == 0 || config.slice_size as u64 > config.max_frame {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "slice_size must be in 1..=max_frame",
        ));
    }
    if config.node.len() > MAX_NODE_NAME {
        // It travels in every hello: each connection would fail.
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("node name longer than {MAX_NODE_NAME} bytes"),
        ));
    }
    if let Some(name) = &config.tcp_congestion {
        quiesce_runtime::net::check_tcp_congestion(name)?;
    }
    Ok(())
}

/// The longest node name a hello carries, in bytes.
const MAX_NODE_NAME: usize = 255;

/// Closes every peer (the engine shuts down).
fn close_peers(peers: &RefCell<HashMap<SocketAddr, Peer>>) {
    let peers: Vec<Peer> = peers.borrow_mut().drain().map(|p| p.1).collect();
    peers.iter().for_each(Peer::close);
}

impl Engine {
    /// Listens on `config.listen` and starts serving. Call inside a runtime.
    pub fn bind(config: EngineConfig) -> io::Result<Engine> {
        check(&config)?;
        let listener = TcpListener::bind(config.listen)?;
        if let Some(name) = &config.tcp_congestion {
            // Accepted connections start with the listener's.
            listener.set_congestion(name)?;
        }
        let engine = Engine::with_target(config, listener.local_addr()?);
        let inner = &engine.inner;
        let accept = crate::control::accept::accept_loop(
            listener,
            Rc::downgrade(inner),
            inner.admission.clone(),
        );
        inner.tasks.borrow_mut().push(accept);
        Ok(engine)
    }

    /// An engine for the initiator role only: it opens peers and serves
    /// nothing — it listens nowhere, so no peer can reach a segment of it.
    /// Its [`local_addr`](Self::local_addr) is `config.listen`, unbound.
    /// Call inside a runtime.
    pub fn initiator(config: EngineConfig) -> io::Result<Engine> {
        check(&config)?;
        let at = config.listen;
        Ok(Engine::with_target(config, at))
    }

    fn with_target(config: EngineConfig, local_addr: SocketAddr) -> Engine {
        let inner = Rc::new(Target {
            local_addr,
            config,
            segments: RefCell::default(),
            exposed: Rc::default(),
            next_segment: Cell::new(1),
            fences: FenceTable::default(),
            sessions: RefCell::default(),
            next_conn: Cell::new(1),
            lingering: RefCell::default(),
            tasks: RefCell::default(),
            admission: Rc::default(),
            counters: Counters::default(),
            qp_plane: RefCell::default(),
            peer_logs: PeerLogs::default(),
            grant_key: GrantKey::random(),
            refused_proofs: RefCell::default(),
        });
        let peers = Rc::new(RefCell::new(HashMap::new()));
        Engine {
            _last: Rc::new(LastHandle {
                target: Rc::downgrade(&inner),
                peers: Rc::downgrade(&peers),
            }),
            inner,
            peers,
            connecting: Rc::default(),
        }
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
        self.register_with_token(name, mem, rights, Token::random())
    }

    /// [`register`](Self::register) with a token of the caller's: one
    /// derived from a secret the cluster shares ([`Token::derive`]), so
    /// peers that hold the secret can prove it without being handed the
    /// token.
    pub fn register_with_token(
        &self,
        name: &str,
        mem: impl Into<SegmentMemory>,
        rights: Rights,
        token: Token,
    ) -> Result<Segment, RegisterError> {
        if name.is_empty() || name.len() > 255 {
            return Err(RegisterError::BadName);
        }
        if rights.is_empty() {
            return Err(RegisterError::NoRights);
        }
        let mut segs = self.inner.segments.borrow_mut();
        if segs.has_name(name) {
            return Err(RegisterError::Duplicate(name.into()));
        }
        let id = self.inner.next_segment.get();
        self.inner.next_segment.set(id + 1);
        let seg = Segment::new(
            id,
            name.into(),
            mem.into(),
            rights,
            token,
            &self.inner.exposed,
        );
        segs.insert(seg.clone());
        Ok(seg)
    }

    /// Stops serving segment `id` — over TCP, and over RDMA when an
    /// `RdmaEngine` serves it (its memory regions go: the NIC refuses its
    /// keys). Writes landing now finish into its memory, which stays alive
    /// until they do.
    pub fn deregister(&self, id: u64) -> bool {
        let Some(seg) = self.inner.segments.borrow_mut().remove(id) else {
            return false;
        };
        let withdraw = seg.inner.withdraw.borrow_mut().take();
        if let Some(f) = withdraw {
            f();
        }
        true
    }

    /// The target side underneath.
    pub(crate) fn target(&self) -> &Rc<Target> {
        &self.inner
    }

    /// Connects to the engine at `addr` (or returns the existing peer,
    /// unless another node answers there now: [`Peer::is_replaced`]).
    pub async fn connect(&self, addr: SocketAddr) -> Result<Peer, TransferError> {
        let known = || {
            self.peers
                .borrow()
                .get(&addr)
                .filter(|p| !p.is_replaced())
                .cloned()
        };
        self.connecting
            .run(addr, known, || async {
                let params = self.peer_params(self.inner.config.connections_per_peer);
                let peer = Peer::connect(addr, params).await?;
                self.peers.borrow_mut().insert(addr, peer.clone());
                Ok(peer)
            })
            .await
    }

    /// Says hello to `addr` on a connection of its own and names the node
    /// that answered: whether a peer is alive, which an accepted connection
    /// alone does not say (the kernel accepts for a stopped process too).
    /// Nothing is proven on it, and it is closed before this returns.
    pub async fn probe(&self, addr: SocketAddr) -> Result<String, TransferError> {
        let p = self.connect_control(addr).await?;
        let node = p.node().to_string();
        p.close();
        Ok(node)
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
            stall_timeout: c.stall_timeout,
            tcp_congestion: c.tcp_congestion.clone(),
            local: c.local,
            mailbox: c.mailbox,
        }
    }

    /// Answers `QpConnect` through `plane` (set by `RdmaEngine`).
    pub(crate) fn set_qp_plane(&self, plane: Rc<dyn crate::control::QpPlane>) {
        *self.inner.qp_plane.borrow_mut() = Some(plane);
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
            sessions: self.inner.live_sessions() as u64,
            fence_entries: self.inner.fences.len() as u64,
            refused: c.refused.get(),
            mailbox_requests: c.mailbox_requests.get(),
            proof_checks: c.proof_checks.get(),
        }
    }

    /// Stops accepting, drops served connections (their in-flight ops park
    /// until reaped) and closes connections to peers.
    pub fn shutdown(&self) {
        self.inner.shutdown();
        close_peers(&self.peers);
    }
}

#[cfg(test)]
mod tests {
    use quiesce_runtime::Runtime;

    use crate::{Engine, EngineConfig};

    /// An algorithm this kernel has other than the system's default (`reno`
    /// is always built in), so that a setting that did nothing is seen.
    fn not_the_default() -> String {
        let read = |p: &str| std::fs::read_to_string(p).unwrap().trim().to_string();
        let default = read("/proc/sys/net/ipv4/tcp_congestion_control");
        read("/proc/sys/net/ipv4/tcp_available_congestion_control")
            .split_whitespace()
            .find(|n| *n != default)
            .expect("a second congestion-control algorithm")
            .to_string()
    }

    /// Both roles: the initiator's connections, and the target's ends of
    /// them (accepted from its listener).
    #[test]
    fn both_ends_of_a_peers_connections_run_the_configured_congestion_control() {
        let other = not_the_default();
        let config = EngineConfig {
            tcp_congestion: Some(other.clone()),
            ..EngineConfig::default()
        };
        Runtime::new().unwrap().block_on(async {
            let target = Engine::bind(config.clone()).unwrap();
            let initiator = Engine::initiator(config).unwrap();
            let seg = target
                .register("kv", vec![0u8; 4096], crate::Rights::WRITE)
                .unwrap();
            let peer = initiator.connect(target.local_addr()).await.unwrap();
            // A write authenticates the data connection too.
            let kv = peer.open("kv", seg.token()).await.unwrap();
            assert_eq!(kv.write(0, vec![7u8; 64], 1).await.0.unwrap(), 64);
            let control = peer.conn(0).await.unwrap();
            let data = peer.conn(1).await.unwrap();
            for c in [control, data] {
                assert_eq!(c.stream.congestion().unwrap(), other, "initiator");
            }
            let served = target.inner.session_streams();
            assert!(served.len() >= 2, "the target's ends of both");
            for s in served {
                assert_eq!(s.congestion().unwrap(), other, "target");
            }
        });
    }
}
