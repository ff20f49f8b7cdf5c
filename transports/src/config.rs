//! Engine settings, shared by the control plane and the data paths.

use std::net::SocketAddr;
use std::time::Duration;

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
    /// Connect and handshake timeout (initiator); it bounds each segment
    /// open's auth round trip on the control connection too.
    pub connect_timeout: Duration,
    /// How long a new connection may take to finish its handshake — say
    /// hello and prove a first token (target).
    pub handshake_timeout: Duration,
    /// An authenticated connection that sends nothing for this long is
    /// closed (target); the initiator reconnects when it next needs it. Not
    /// between frames on a connection that serves an RDMA queue pair (its
    /// traffic is one-sided): TCP keep-alive finds a peer gone there.
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
    /// Fenced batches the whole fence table may hold, all sessions
    /// together (a peer may open many); a session that fences past it has
    /// its connections closed (target).
    pub max_fenced_entries: usize,
    /// Connections one session may have open (target); each may hold a
    /// served RDMA queue pair, so this caps those per peer too.
    pub max_connections_per_session: usize,
    /// A connection whose sent data stays unacknowledged this long — a peer
    /// behind a partition, dead, or stopped with its receive window full —
    /// is dropped by the kernel (`TCP_USER_TIMEOUT`, both roles): its
    /// transfers fail as the connection lost (retryable once the target
    /// confirms), and a target's reads stop holding segment memory. So a
    /// target paused longer than this (SIGSTOP, a debugger, a VM migration)
    /// with data pending fails even a batch without a deadline — -1, the
    /// target unconfirmed, since it cannot answer a fence — where it would
    /// otherwise complete after the pause. `None` (or zero): the system's
    /// retransmission limits (many minutes).
    pub stall_timeout: Option<Duration>,
    /// The kernel's congestion control for this engine's TCP connections,
    /// both roles (`TCP_CONGESTION`: `"cubic"`, `"reno"`, `"bbr"`, … — one
    /// the kernel has, and for an unprivileged process one listed in
    /// `net.ipv4.tcp_allowed_congestion_control`; checked when the engine
    /// is made). `None`: the system's default
    /// (`net.ipv4.tcp_congestion_control`). Where that default paces —
    /// BBR does, inside TCP when the device has no `fq` qdisc — a
    /// connection sends at the bandwidth it estimated from its own past
    /// traffic, and on loopback that estimate can stay far below what the
    /// path carries: docs/BENCHMARKS.md measured a 64 × 64 KiB batch over
    /// one such connection at a third of the speed it has under `cubic`.
    pub tcp_congestion: Option<String>,
    /// Demonstrations only, never in production: acknowledge fences without
    /// applying them, so a fenced batch's bytes keep landing (what a target
    /// without fences does). `quiesce demo` uses it to show that quiesce's
    /// outcomes rest on the initiator's own quiescence, not only on the fence.
    pub ignore_fences: bool,
    /// Whether a peer on this host is reached by cross-memory attach (the
    /// local transport, `crate::local`) instead of moving bytes over TCP.
    pub local: LocalMode,
    /// Initiator, local transport: an attached connection's small requests
    /// (writes and reads of up to 64 KiB) go through a mailbox in memory
    /// shared with the target (`crate::local::mailbox`) rather than the
    /// socket, so neither side needs a syscall for them while its reactor
    /// spins. On by default; a target that cannot take the mailbox leaves
    /// them on the socket.
    pub mailbox: bool,
}

/// Whether peers on this host are reached by cross-memory attach.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LocalMode {
    /// Attach to a peer on this host (a loopback or local address) when both
    /// sides allow it and prove who they are; TCP otherwise.
    #[default]
    Auto,
    /// TCP only, in both roles: this engine neither attaches to peers nor
    /// lets peers attach to it.
    Off,
    /// Initiator: attach or fail the connection (tests, benchmarks). A
    /// target serves attach requests as with `Auto`.
    Required,
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
            max_fenced_entries: 1 << 18,
            max_connections_per_session: 64,
            stall_timeout: Some(Duration::from_secs(30)),
            tcp_congestion: None,
            ignore_fences: false,
            local: LocalMode::Auto,
            mailbox: true,
        }
    }
}
