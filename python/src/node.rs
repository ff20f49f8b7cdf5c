//! An initialised engine behind the Python `TransferEngine`: the sync
//! engine, the token every peer derives from the shared secret, the peer
//! segments opened so far, and the batches still out (asynchronous ones,
//! and those that returned -2).

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fnv::FnvHashMap;
use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{
    Direction, HostRanges, OpenedSegment, SyncEngine, SyncError, SyncOutcome, SyncTask, SyncTasks,
};
use quiesce_batch::{
    BatchOptions, FailurePolicy, TaskReport, TaskStatus, SYNC_FAILED, SYNC_OK, SYNC_UNKNOWN,
};
use quiesce_directory::{Directory, NodeRecord, SegmentRecord};
use quiesce_runtime::time::{deadline_in, LONGEST_WAIT};
use quiesce_transports::rdma::RdmaConfig;
use quiesce_transports::{EngineConfig, LocalMode, Token};
use smallvec::SmallVec;

use crate::managed::{ManagedBuffers, Uses};

/// The environment variable holding the cluster's shared secret (at least
/// 16 bytes; the same on every peer).
pub const SECRET_ENV: &str = "QUIESCE_SECRET";
/// Set to `1` to run without a secret: any peer that can connect may read
/// and write every registered range. Only on a trusted network.
pub const OPEN_CLUSTER_ENV: &str = "QUIESCE_OPEN_CLUSTER";
/// What an open cluster derives its token from (public by design).
const OPEN_CLUSTER_SECRET: &[u8] = b"quiesce open cluster: whoever connects may read and write";
/// The label every range's token is derived under: Mooncake's callers never
/// see segment names, so all of a node's ranges share one token.
const TOKEN_LABEL: &str = "mooncake-node";

/// How long `initialize` waits for the metadata server to hold this node.
const PUBLISH_WAIT: Duration = Duration::from_secs(10);

/// Logs why a call failed (a warning: Mooncake logs and returns -1 too).
pub(crate) fn complain(what: &str) -> i32 {
    tracing::warn!("{what}");
    SYNC_FAILED
}

/// A mutex whose poisoning is harmless here: no holder panics mid-update.
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// What an engine moves bytes over.
pub(crate) enum Fabric {
    /// TCP.
    Tcp,
    /// RDMA verbs on `device` (`None`: the first with an active port).
    Rdma {
        /// The device's name.
        device: Option<String>,
    },
}

/// An asynchronous batch: its outcome's channel (taken out by the one call
/// that waits on it), and what it used.
struct Outstanding {
    /// `None` while a status call waits on it (the batch runs on, as far as
    /// any other call is told).
    outcome: Option<mpsc::Receiver<SyncOutcome<RawBuf>>>,
    target: String,
    peer: SocketAddr,
    used: SmallVec<[u32; 4]>,
    uses: Uses,
}

/// A batch that answered -2: its ticket, and the managed buffers it holds
/// until it drains.
struct Pinned {
    ticket: u64,
    uses: Uses,
}

/// How an asynchronous batch stands.
pub(crate) enum Progress {
    /// Still running.
    Running,
    /// Done with this code (0, -1, or -2 with its ticket kept pending).
    Done(i32),
    /// No such batch: never submitted. (One whose outcome a call reported
    /// answers that code again, or -2 once it is forgotten.)
    Unknown,
}

/// What one call's tasks became.
struct Prepared {
    peer: SocketAddr,
    /// Paired with their direction as the sync engine takes them (no
    /// second vector to pair them there).
    tasks: SyncTasks<RawBuf>,
    /// The bytes they move.
    bytes: u64,
    /// The segments the tasks use (inline for a few: no allocation).
    used: SmallVec<[u32; 4]>,
    /// The managed buffers its local buffers lie in.
    uses: Uses,
}

pub(crate) struct Node {
    /// `None` only while dropping.
    engine: Option<SyncEngine>,
    /// Where peers are found (`P2PHANDSHAKE`: by their `host:port`; etcd:
    /// by name, and this node publishes itself and its ranges there).
    directory: Directory,
    /// This node's name in the directory (`local_hostname`).
    name: String,
    pub(crate) token: Token,
    /// Buffers `allocate_managed_buffer` made; freed after the engine
    /// stopped, or leaked if its drain failed.
    pub(crate) managed: ManagedBuffers,
    options: BatchOptions,
    /// How long a sync call that would answer -2 waits for its batch to
    /// drain first ([`QUIESCE_WAIT_UNKNOWN`]).
    wait_unknown: Duration,
    /// The local memory found readable and writable so far.
    host: HostRanges,
    /// Peer segments opened so far, by peer. (FNV: both maps are looked up
    /// on every transfer, by keys this process chose, where SipHash's
    /// flood resistance buys nothing and costs ~200 instructions a lookup.)
    opened: Mutex<FnvHashMap<SocketAddr, PeerSegments>>,
    /// P2P session names resolved so far.
    peers: Mutex<FnvHashMap<String, SocketAddr>>,
    /// Batches that returned -2: their memory stays pinned.
    pending: Mutex<Vec<Pinned>>,
    /// Batches that returned -2 with nothing to wait on (the engine's
    /// thread died first): pinned for good, and counted as not drained.
    lost: AtomicU64,
    /// Held by the one `quiesce_pending` that waits.
    waiting: Mutex<()>,
    /// Asynchronous batches without a reported outcome, by id.
    outstanding: Mutex<HashMap<u64, Outstanding>>,
    /// The codes of the last [`REPORTS_KEPT`] batches whose outcome a
    /// status call reported (and took out of `outstanding`), oldest first.
    /// Locked before `outstanding` where both are.
    reported: Mutex<VecDeque<(u64, i32)>>,
    next_id: AtomicU64,
}

/// How many reported codes a node remembers for status calls that come
/// after another call reported the batch.
const REPORTS_KEPT: usize = 4096;

/// The cluster's shared secret: `explicit` (16+ bytes), an open cluster's
/// public one if `open_cluster`, else from the environment.
pub(crate) fn secret(explicit: Option<&[u8]>, open_cluster: bool) -> Result<Vec<u8>, String> {
    if let Some(s) = explicit {
        if s.len() < 16 {
            return Err("the secret must hold at least 16 bytes".into());
        }
        return Ok(s.to_vec());
    }
    if open_cluster {
        tracing::warn!(
            "open cluster: any peer that can connect may read and write registered memory"
        );
        return Ok(OPEN_CLUSTER_SECRET.to_vec());
    }
    if let Some(s) = std::env::var_os(SECRET_ENV) {
        let s = s.into_encoded_bytes();
        if s.len() < 16 {
            return Err(format!("{SECRET_ENV} must hold at least 16 bytes"));
        }
        return Ok(s);
    }
    if std::env::var(OPEN_CLUSTER_ENV).is_ok_and(|v| v == "1") {
        return secret(None, true);
    }
    Err(format!(
        "remote access needs a shared secret: set {SECRET_ENV} (16+ bytes, the same on every \
         peer), or {OPEN_CLUSTER_ENV}=1 to let any peer that can connect read and write (trusted \
         networks only)"
    ))
}

/// Whether peers on this host are reached by cross-memory attach:
/// `QUIESCE_LOCAL` = `auto` (the default), `off` (TCP only, both roles) or
/// `required` (fail a connection that cannot attach).
pub(crate) fn local_mode() -> LocalMode {
    match std::env::var("QUIESCE_LOCAL").as_deref() {
        Ok("off") => LocalMode::Off,
        Ok("required") => LocalMode::Required,
        Ok("auto") | Err(_) => LocalMode::Auto,
        Ok(other) => {
            tracing::warn!("QUIESCE_LOCAL={other:?} is not auto, off or required; using auto");
            LocalMode::Auto
        }
    }
}

/// The TCP congestion control of the engine's connections
/// (`EngineConfig::tcp_congestion`): `QUIESCE_TCP_CONGESTION` (`cubic`,
/// `reno`, `bbr`, …), checked here so a name the kernel lacks is reported
/// with the variable that gave it; unset or empty, the system's default.
pub(crate) fn tcp_congestion() -> Result<Option<String>, String> {
    match std::env::var("QUIESCE_TCP_CONGESTION") {
        Ok(name) if !name.is_empty() => {
            quiesce_runtime::net::check_tcp_congestion(&name)
                .map_err(|e| format!("QUIESCE_TCP_CONGESTION: {e}"))?;
            Ok(Some(name))
        }
        _ => Ok(None),
    }
}

/// The segments opened at one peer address, and the node name they were
/// opened for (checked there, with an etcd directory, before opening).
#[derive(Default)]
struct PeerSegments {
    node: String,
    segments: Vec<OpenedSegment>,
}

impl PeerSegments {
    /// The segments, now kept for `node` (checked at the address just now):
    /// those kept for another node there are its, not this one's.
    fn of(&mut self, node: &str) -> &mut Vec<OpenedSegment> {
        if self.node != node {
            self.node = node.to_string();
            self.segments.clear();
        }
        &mut self.segments
    }
}

/// A timeout of `timeout` seconds from Python: none if not positive (or
/// NaN), inf and huge values [`LONGEST_WAIT`].
/// Whether `name`, found at `addr` in the directory, is not the node that
/// answers there (the entry is stale, the address another node's now):
/// why, if so. Asked before opening there; a peer's later reconnects
/// refuse a node of another name on their own.
pub(crate) fn stale_entry(
    engine: &SyncEngine,
    name: &str,
    addr: SocketAddr,
) -> Result<Option<String>, SyncError> {
    let there = engine.peer_node(addr)?;
    Ok((there != name)
        .then(|| format!("{name:?} is not at {addr} (node {there:?} is): a stale directory entry")))
}

pub(crate) fn seconds(timeout: f64) -> Duration {
    if timeout.is_nan() || timeout <= 0.0 {
        return Duration::ZERO;
    }
    Duration::try_from_secs_f64(timeout)
        .unwrap_or(LONGEST_WAIT)
        .min(LONGEST_WAIT)
}

/// The variable that makes a sync call wait for a batch whose completion is
/// unknown before it answers.
pub(crate) const QUIESCE_WAIT_UNKNOWN: &str = "QUIESCE_WAIT_UNKNOWN";

/// How long a sync call that would answer -2 (or `get_batch_transfer_status`
/// on such a batch) first waits for its batch to drain:
/// [`QUIESCE_WAIT_UNKNOWN`] seconds, 0 (answer -2 at once) if unset.
/// vLLM and SGLang take -2 for a failure and reuse the memory at once,
/// never calling `wait_for_quiescence()`; with a wait, the call answers the
/// drained outcome instead, after which nothing touches the memory.
fn wait_unknown() -> Duration {
    let Ok(v) = std::env::var(QUIESCE_WAIT_UNKNOWN) else {
        return Duration::ZERO;
    };
    match v
        .trim()
        .parse::<f64>()
        .ok()
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
    {
        Some(d) => d,
        None => {
            tracing::warn!("{QUIESCE_WAIT_UNKNOWN}={v:?} is not a number of seconds; not waiting");
            Duration::ZERO
        }
    }
}

/// How long the engine and its callers busy-poll before they block:
/// `QUIESCE_SPIN_US` microseconds (0: never), else the sync engine's default.
pub(crate) fn spin() -> Duration {
    std::env::var("QUIESCE_SPIN_US")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(quiesce_batch::sync::DEFAULT_SPIN, Duration::from_micros)
}

/// Fail-fast, as Mooncake returns at a batch's first failure — but after
/// fencing the rest, so the -1 is safe. Mooncake's `MC_TRANSFER_TIMEOUT`
/// (seconds, 5 to 1800; 30 by default) is each batch's deadline, plus its
/// size ([`Node::options_for`]), so every batch of less than ~1.8 TB has an
/// outcome within `get_batch_transfer_status`'s hour.
fn options() -> BatchOptions {
    let secs = std::env::var("MC_TRANSFER_TIMEOUT")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(30, |s| s.clamp(5, 1800));
    BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_secs(secs))
}

pub(crate) fn listen_addr(local_hostname: &str) -> Result<SocketAddr, String> {
    let bad_port = || format!("bad port in {local_hostname:?}");
    // "[v6]:port", "[v6]", "host:port", "host", or a bare IPv6 address.
    let (host, port) = if let Some(rest) = local_hostname.strip_prefix('[') {
        let (host, after) = rest
            .split_once(']')
            .ok_or_else(|| format!("no ']' in {local_hostname:?}"))?;
        let port = match after {
            "" => 0,
            p => p
                .strip_prefix(':')
                .and_then(|p| p.parse::<u16>().ok())
                .ok_or_else(bad_port)?,
        };
        (host, port)
    } else {
        match local_hostname.rsplit_once(':') {
            Some((h, p)) if !h.contains(':') => (h, p.parse::<u16>().map_err(|_| bad_port())?),
            _ => (local_hostname, 0),
        }
    };
    let addrs: Vec<SocketAddr> = (host, port)
        .to_socket_addrs()
        .map_err(|e| format!("cannot resolve {host:?}: {e}"))?
        .collect();
    addrs
        .iter()
        .find(|a| a.is_ipv4())
        .or(addrs.first())
        .copied()
        .ok_or_else(|| format!("{host:?} resolves to no address"))
}

impl Node {
    /// Starts an engine listening on `local_hostname`; with an `etcd://`
    /// `metadata` URL, publishes it there as `local_hostname` and waits
    /// until etcd holds the entry.
    pub(crate) fn start(
        local_hostname: &str,
        metadata: &str,
        fabric: Fabric,
    ) -> Result<Node, String> {
        let directory = Directory::open(metadata).map_err(|e| e.to_string())?;
        let fabric_name = match fabric {
            Fabric::Tcp => "tcp",
            Fabric::Rdma { .. } => "rdma",
        };
        let token = Token::derive(&secret(None, false)?, TOKEN_LABEL);
        let config = EngineConfig {
            node: local_hostname.to_string(),
            listen: listen_addr(local_hostname)?,
            local: local_mode(),
            tcp_congestion: tcp_congestion()?,
            ..Default::default()
        };
        let engine = match fabric {
            Fabric::Tcp => SyncEngine::start_spinning(config, spin()),
            Fabric::Rdma { device } => SyncEngine::start_rdma(
                RdmaConfig {
                    control: config,
                    device,
                    ..Default::default()
                },
                spin(),
            ),
        }
        .map_err(|e| e.to_string())?;
        let publish = directory
            .publish_node(&NodeRecord {
                node: local_hostname.to_string(),
                addr: engine.local_addr(),
                fabric: fabric_name.into(),
            })
            .and_then(|()| directory.flush(PUBLISH_WAIT));
        if let Err(e) = publish {
            drop(engine);
            return Err(format!("metadata server {metadata:?}: {e}"));
        }
        Ok(Node {
            engine: Some(engine),
            directory,
            name: local_hostname.to_string(),
            token,
            managed: ManagedBuffers::default(),
            options: options(),
            wait_unknown: wait_unknown(),
            host: HostRanges::new(),
            opened: Mutex::default(),
            peers: Mutex::default(),
            pending: Mutex::default(),
            lost: AtomicU64::new(0),
            waiting: Mutex::default(),
            outstanding: Mutex::default(),
            reported: Mutex::default(),
            next_id: AtomicU64::new(1),
        })
    }

    /// The sync engine.
    pub(crate) fn engine(&self) -> &SyncEngine {
        self.engine
            .as_ref()
            .expect("the engine lives as long as its node")
    }

    /// Publishes a registered range (etcd; nothing to do for P2P). Never
    /// blocks: the directory writes it from its helper thread.
    pub(crate) fn published(&self, id: u64, addr: u64, len: u64) {
        let rec = SegmentRecord {
            node: self.name.clone(),
            name: format!("{addr:#x}"),
            id,
            base: addr,
            len,
            read: true,
            write: true,
        };
        if let Err(e) = self.directory.publish_segment(&rec) {
            tracing::warn!(error = %e, "register_memory: not published");
        }
    }

    /// Withdraws a range taken back (etcd; nothing to do for P2P).
    pub(crate) fn withdrawn(&self, addr: u64) {
        let _ = self
            .directory
            .withdraw_segment(&self.name, &format!("{addr:#x}"), None);
    }

    /// The address of session `target`: the name itself for P2P, its
    /// entry in the directory for etcd.
    pub(crate) fn peer(&self, target: &str) -> Result<SocketAddr, String> {
        if let Some(a) = lock(&self.peers).get(target) {
            return Ok(*a);
        }
        let addr = self
            .directory
            .resolve(target)
            .map_err(|e| format!("session {target:?}: {e}"))?
            .addr;
        // P2P names are addresses and never change; an etcd name's entry
        // can, and the directory's watched mirror is its cache.
        if matches!(self.directory, Directory::P2p) {
            lock(&self.peers).insert(target.to_string(), addr);
        }
        Ok(addr)
    }

    /// The name ranges kept at an address are kept for: the node name
    /// checked there (etcd); none for P2P, whose names are addresses (two
    /// spellings of one address are one node).
    fn checked_name<'a>(&self, target: &'a str) -> &'a str {
        match self.directory {
            Directory::P2p => "",
            _ => target,
        }
    }

    /// With an etcd directory, that `target` (found there at `peer`) is the
    /// node at `peer` ([`stale_entry`]).
    fn check_node(&self, target: &str, peer: SocketAddr) -> Result<(), String> {
        if matches!(self.directory, Directory::P2p) {
            return Ok(());
        }
        match stale_entry(self.engine(), target, peer) {
            Ok(None) => Ok(()),
            Ok(Some(why)) => Err(format!("session {why}")),
            Err(e) => Err(format!("session {target:?} at {peer}: {e}")),
        }
    }

    /// The opened segment holding `addr..addr + len` at `peer`, `target`'s
    /// address (opening it by address if this engine has not yet).
    fn segment(
        &self,
        target: &str,
        peer: SocketAddr,
        addr: u64,
        len: u64,
    ) -> Result<OpenedSegment, String> {
        // A kept range that holds the whole transfer. One that holds only
        // its start may have been withdrawn and registered again larger,
        // or lie inside a larger one: the target picks (by address, the
        // range reaching furthest).
        let fits = |s: &OpenedSegment| {
            addr.checked_sub(s.base)
                .and_then(|o| o.checked_add(len))
                .is_some_and(|end| end <= s.len)
        };
        // Kept for the node found at `peer` then: with an etcd directory a
        // stale entry of another name may give the same address.
        let cached = lock(&self.opened)
            .get(&peer)
            .filter(|p| p.node == self.checked_name(target))
            .and_then(|p| p.segments.iter().find(|s| fits(s)).copied());
        let seg = match cached {
            Some(s) => s,
            None => {
                self.check_node(target, peer)?;
                let s = self.engine().open_at(peer, addr, self.token).map_err(|e| {
                    format!("{peer}: no registered memory at {addr:#x} open to this secret ({e})")
                })?;
                // (Another thread may have opened it meanwhile: the engine
                // gave it the same handle.)
                let mut opened = lock(&self.opened);
                let known = opened
                    .entry(peer)
                    .or_default()
                    .of(self.checked_name(target));
                if !known.contains(&s) {
                    known.push(s);
                }
                s
            }
        };
        if !fits(&seg) {
            return Err(format!(
                "{peer}: {len} bytes at {addr:#x} cross the end of the registered range at {:#x} ({} bytes)",
                seg.base, seg.len
            ));
        }
        Ok(seg)
    }

    /// The address of the first range `target` registered among those it
    /// serves now (opening it, and keeping it for later transfers).
    pub(crate) fn first_buffer(&self, target: &str) -> Result<u64, String> {
        let peer = self.peer(target)?;
        self.check_node(target, peer)?;
        let s = self
            .engine()
            .open_first(peer, self.token)
            .map_err(|e| format!("{target}: no registered memory open to this secret ({e})"))?;
        let mut opened = lock(&self.opened);
        let known = opened
            .entry(peer)
            .or_default()
            .of(self.checked_name(target));
        if !known
            .iter()
            .any(|k| k.segment == s.segment || k.base == s.base)
        {
            known.push(s);
        }
        Ok(s.base)
    }

    fn prepare(
        &self,
        target: &str,
        dir: Direction,
        buffers: &[usize],
        peer_addresses: &[usize],
        lengths: &[usize],
    ) -> Result<Prepared, String> {
        if buffers.len() != peer_addresses.len() || buffers.len() != lengths.len() {
            return Err("buffers, peer addresses and lengths differ in count".into());
        }
        // A zero-length entry moves nothing: Mooncake completes it as a
        // no-op, and SGLang sends them (a model's state item of 0 bytes, with
        // whatever pointer it has, among its others). A call with nothing
        // else is bad input. A call with no entries at all is not: Mooncake
        // answers 0 for it, and a caller that lists the blocks left to send
        // makes one (its tasks are empty, and `run`/`submit` complete it).
        if !lengths.is_empty() && lengths.iter().all(|&l| l == 0) {
            return Err("zero length: every task is empty".into());
        }
        if let Some(i) = (0..buffers.len()).find(|&i| buffers[i] == 0 && lengths[i] != 0) {
            return Err(format!("task {i} has a null buffer"));
        }
        // The caller's word is Mooncake's contract, but a GPU pointer (SGLang
        // goes on to transfer from its KV caches after their registration
        // failed) would crash this process in the first copy.
        let locals = buffers.iter().zip(lengths).filter(|(_, &l)| l != 0);
        if let Some((b, l)) = self
            .host
            .first_bad(locals.map(|(&b, &l)| (b as u64, l as u64)))
        {
            return Err(format!(
                "local buffer {b:#x}..+{l} is not memory this process can read and write \
                 (device memory? quiesce moves host memory)"
            ));
        }
        let peer = self.peer(target)?;
        let mut tasks = SyncTasks::with_capacity(buffers.len());
        let mut used = SmallVec::with_capacity(buffers.len());
        let entries = buffers.iter().zip(peer_addresses).zip(lengths);
        for ((&buf, &at), &len) in entries.filter(|(_, &len)| len != 0) {
            let seg = self.segment(target, peer, at as u64, len as u64)?;
            used.push(seg.segment);
            let task = SyncTask {
                segment: seg.segment,
                offset: at as u64 - seg.base,
                // SAFETY: Mooncake's contract, which this API keeps: the
                // caller's buffer stays valid and untouched until the call
                // returns 0 or -1, or, after -2, until wait_for_quiescence()
                // says the batch drained.
                buf: unsafe { RawBuf::new(buf as *mut u8, len) },
            };
            tasks.push((dir, task));
        }
        let bytes = lengths.iter().map(|&l| l as u64).sum();
        // Last: nothing after it fails, so the uses always reach an outcome.
        let locals = buffers.iter().zip(lengths).filter(|(_, &l)| l != 0);
        let uses = self
            .managed
            .take_uses(locals.map(|(&b, &l)| (b, l)))
            .map_err(|at| {
                format!("the range registered at {at:#x} is being unregistered: no batch may start from it")
            })?;
        Ok(Prepared {
            peer,
            tasks,
            used,
            bytes,
            uses,
        })
    }

    /// The options of a call's batch: room for all of its tasks. Mooncake
    /// takes a batch of any length, and vLLM and SGLang pass one entry per
    /// KV block and layer — past the native limit (4,096) on long prompts.
    /// The caller's own lists bound it; it holds up to about 2 KiB per
    /// entry while it runs (262,144 entries of 256 bytes, initiator and
    /// target in one process: 0.75 s and ~500 MiB over the buffers).
    ///
    /// Its deadline grows with its size as Mooncake's does:
    /// `MC_TRANSFER_TIMEOUT` plus a nanosecond per byte (a second per GB),
    /// so a whole rank's weights read at start-up are not cut at 30 s.
    fn options_for(&self, p: &Prepared) -> BatchOptions {
        let mut opts = self.options.room_for(p.tasks.len());
        opts.deadline = opts.deadline.map(|d| d + Duration::from_nanos(p.bytes));
        opts
    }

    /// A batch of `dir` tasks to `target`, blocking until its outcome: 0,
    /// -1, or -2 (its ticket kept pending).
    pub(crate) fn run(
        &self,
        target: &str,
        dir: Direction,
        buffers: &[usize],
        peer_addresses: &[usize],
        lengths: &[usize],
    ) -> i32 {
        let p = match self.prepare(target, dir, buffers, peer_addresses, lengths) {
            Ok(p) => p,
            Err(e) => return complain(&format!("transfer: {e}")),
        };
        if p.tasks.is_empty() {
            return SYNC_OK;
        }
        let opts = self.options_for(&p);
        match self.engine().run(p.tasks, opts) {
            Ok(out) => {
                let out = self.drained_within(out, self.wait_unknown);
                self.settle(target, p.peer, &p.used, p.uses, out)
            }
            Err(e) => {
                // Never started, or the engine stopped after reaping every
                // operation.
                self.managed.release(p.uses);
                complain(&format!("transfer: {e}"))
            }
        }
    }

    /// A -2 outcome waited on for up to `limit`: the drained outcome (0 or
    /// -1, nothing touching the memory) if it drained in time, else `out`
    /// (its ticket goes to `pending`). Anything else as it is.
    fn drained_within(&self, out: SyncOutcome<RawBuf>, limit: Duration) -> SyncOutcome<RawBuf> {
        let (SYNC_UNKNOWN, Some(ticket)) = (out.code, out.ticket) else {
            return out;
        };
        if limit.is_zero() {
            return out;
        }
        match self.engine().wait::<RawBuf>(ticket, limit) {
            Ok(Some(drained)) => {
                tracing::info!(
                    code = drained.code,
                    "a batch whose completion was unknown drained within {QUIESCE_WAIT_UNKNOWN}"
                );
                drained
            }
            // Not yet, or the engine stopped (after reaping every
            // operation: then the ticket is gone and -2 would pin nothing,
            // but nothing says whether it completed either).
            Ok(None) | Err(_) => out,
        }
    }

    /// Starts a batch and returns its id at once (0: it could not start).
    pub(crate) fn submit(
        &self,
        target: &str,
        dir: Direction,
        buffers: &[usize],
        peer_addresses: &[usize],
        lengths: &[usize],
    ) -> u64 {
        let p = match self.prepare(target, dir, buffers, peer_addresses, lengths) {
            Ok(p) => p,
            Err(e) => {
                complain(&format!("transfer: {e}"));
                return 0;
            }
        };
        let opts = self.options_for(&p);
        let started = if p.tasks.is_empty() {
            // Nothing to move: its outcome is ready.
            let (tx, rx) = mpsc::channel();
            let _ = tx.send(SyncOutcome {
                code: SYNC_OK,
                buffers: Some(SmallVec::new()),
                tasks: SmallVec::new(),
                ticket: None,
                remote_confirmed: true,
            });
            Ok(rx)
        } else {
            self.engine().submit_each(p.tasks, opts)
        };
        match started {
            Ok(outcome) => {
                let id = self.next_id.fetch_add(1, Ordering::Relaxed);
                let o = Outstanding {
                    outcome: Some(outcome),
                    target: target.to_string(),
                    peer: p.peer,
                    used: p.used,
                    uses: p.uses,
                };
                lock(&self.outstanding).insert(id, o);
                id
            }
            Err(e) => {
                self.managed.release(p.uses);
                complain(&format!("transfer: {e}"));
                0
            }
        }
    }

    /// How asynchronous batch `id` stands, waiting for it up to `wait`. A
    /// batch whose outcome this reports is forgotten.
    pub(crate) fn progress(&self, id: u64, wait: Duration) -> Progress {
        let (rx, target, peer, used) = {
            let mut all = lock(&self.outstanding);
            let Some(o) = all.get_mut(&id) else {
                drop(all);
                return self.reported(id);
            };
            // Another call is waiting on it: running, as far as this one knows.
            let Some(rx) = o.outcome.take() else {
                return Progress::Running;
            };
            (rx, o.target.clone(), o.peer, o.used.clone())
        };
        match rx.recv_timeout(wait) {
            Ok(out) => {
                // A caller that waits (get_batch_transfer_status) waits out
                // a -2 as a sync call does; one that polls does not. The
                // batch stays listed meanwhile, running to any other call.
                let out = self.drained_within(out, self.wait_unknown.min(wait));
                // Held until the code is recorded: a call that finds the
                // batch gone from `outstanding` waits for its code here.
                let mut reported = lock(&self.reported);
                let uses = lock(&self.outstanding).remove(&id).map(|o| o.uses);
                let code = self.settle(&target, peer, &used, uses.unwrap_or_default(), out);
                Self::record(&mut reported, id, code);
                Progress::Done(code)
            }
            Err(mpsc::RecvTimeoutError::Timeout) => {
                if let Some(o) = lock(&self.outstanding).get_mut(&id) {
                    o.outcome = Some(rx);
                }
                Progress::Running
            }
            // The engine's thread died (a live node's engine stops only
            // with the node) before the batch had an outcome: whether its
            // operations were reaped is not known (the dying runtime's
            // drain may have run out of time), so it is -2 for good and its
            // managed buffers stay pinned.
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                let mut reported = lock(&self.reported);
                if let Some(o) = lock(&self.outstanding).remove(&id) {
                    self.lose(o.uses);
                }
                Self::record(&mut reported, id, SYNC_UNKNOWN);
                tracing::error!(
                    "transfer: the engine's thread died before the batch had an outcome; \
                     its memory stays pinned"
                );
                Progress::Done(SYNC_UNKNOWN)
            }
        }
    }

    /// How batch `id`, not outstanding, stands: never issued, `Unknown`;
    /// reported already, that code again; reported so long ago that its
    /// code is forgotten, -2 — -1 would say its memory is free while it may
    /// be pinned (`wait_for_quiescence()` says when nothing is).
    fn reported(&self, id: u64) -> Progress {
        let reported = lock(&self.reported);
        if let Some(&(_, code)) = reported.iter().rev().find(|(r, _)| *r == id) {
            return Progress::Done(code);
        }
        match id != 0 && id < self.next_id.load(Ordering::Relaxed) {
            true => Progress::Done(SYNC_UNKNOWN),
            false => Progress::Unknown,
        }
    }

    fn record(reported: &mut VecDeque<(u64, i32)>, id: u64, code: i32) {
        if reported.len() == REPORTS_KEPT {
            reported.pop_front();
        }
        reported.push_back((id, code));
    }

    /// Waits for every batch in `ids`: 0 if all completed, else the worst
    /// code (-2 before -1). Unknown ids count as -1.
    pub(crate) fn wait_all(&self, ids: &[u64], timeout: Duration) -> i32 {
        let deadline = deadline_in(timeout);
        let mut worst = SYNC_OK;
        for &id in ids {
            loop {
                let left = deadline.saturating_duration_since(Instant::now());
                match self.progress(id, left.max(Duration::from_millis(1))) {
                    Progress::Done(c) => {
                        worst = worst.min(c);
                        break;
                    }
                    Progress::Unknown => {
                        worst = worst.min(complain(&format!("no batch {id}")));
                        break;
                    }
                    Progress::Running if Instant::now() >= deadline => {
                        // Still running past the wait (only if another call
                        // waits on it too, or its deadline is beyond the
                        // wait): its memory is not back, and the batch stays
                        // listed for the next status call.
                        return SYNC_UNKNOWN;
                    }
                    // Another call holds its channel: look again shortly.
                    Progress::Running => std::thread::sleep(Duration::from_micros(200)),
                }
            }
        }
        worst
    }

    /// The code of an outcome; keeps a -2's ticket, and forgets the segments
    /// a failed batch used (the peer may have re-registered its memory).
    fn settle(
        &self,
        target: &str,
        peer: SocketAddr,
        used: &[u32],
        uses: Uses,
        out: SyncOutcome<RawBuf>,
    ) -> i32 {
        if out.code == SYNC_UNKNOWN {
            match out.ticket {
                Some(ticket) => lock(&self.pending).push(Pinned { ticket, uses }),
                // (The engine gives every -2 a ticket.) Without one nothing
                // says when it drains: its managed buffers stay pinned.
                None => self.lose(uses),
            }
            return SYNC_UNKNOWN;
        }
        self.managed.release(uses);
        if out.code != SYNC_OK {
            if let Some(p) = lock(&self.opened).get_mut(&peer) {
                p.segments.retain(|s| !used.contains(&s.segment));
            }
            tracing::warn!("transfer to {target} failed: {}", failures(&out.tasks));
        }
        out.code
    }

    /// `unregister_memory(addr)`: once no batch of this engine uses the
    /// range any more (new ones refused meanwhile; one that answered -2
    /// counts until it drained, which this collects), takes it back from
    /// every peer. `Ok(false)`: something still held it after `wait`.
    pub(crate) fn unregister(&self, addr: usize, wait: Duration) -> Result<bool, SyncError> {
        let until = deadline_in(wait);
        self.managed.begin_unregister(addr);
        let slice = Duration::from_millis(20);
        while !self.managed.wait_unused(addr, slice) {
            if Instant::now() >= until {
                self.managed.end_unregister(addr, false);
                return Ok(false);
            }
            self.quiesce_pending(slice);
            self.release_finished();
        }
        let left = until.saturating_duration_since(Instant::now());
        let r = self.engine().reclaim(addr as u64, left);
        self.managed.end_unregister(addr, matches!(r, Ok(true)));
        r
    }

    /// Gives back the uses of the asynchronous batches that finished (0 or
    /// -1) but whose status nobody has read yet; their outcomes stay for
    /// the status call. (A -2 keeps its uses until it drained.)
    pub(crate) fn release_finished(&self) {
        let mut all = lock(&self.outstanding);
        for o in all.values_mut() {
            let Some(rx) = o.outcome.as_ref() else {
                continue;
            };
            let Ok(out) = rx.try_recv() else {
                continue;
            };
            if out.code != SYNC_UNKNOWN {
                self.managed.release(std::mem::take(&mut o.uses));
            }
            // Put back for the status call.
            let (tx, rx) = mpsc::channel();
            let _ = tx.send(out);
            o.outcome = Some(rx);
        }
    }

    /// Waits up to `timeout` for the batches that returned -2 to drain;
    /// returns how many have not. One caller waits at a time; another meanwhile
    /// gets the count at once (its tickets stay listed until they drained, so
    /// nobody is told 0 while one is out).
    pub(crate) fn quiesce_pending(&self, timeout: Duration) -> usize {
        // (A waiter that panicked left nothing half-done: the lock orders
        // waiters, it guards no data.)
        let _only = match self.waiting.try_lock() {
            Ok(g) => g,
            Err(std::sync::TryLockError::Poisoned(g)) => g.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return self.not_drained(),
        };
        let deadline = deadline_in(timeout);
        let tickets: Vec<u64> = lock(&self.pending).iter().map(|p| p.ticket).collect();
        for t in tickets {
            let left = deadline.saturating_duration_since(Instant::now());
            // Drained? (A ticket of an engine whose thread died never is:
            // `Ok(None)`.)
            if let Ok(Some(_)) = self.engine().wait::<RawBuf>(t, left) {
                let mut pending = lock(&self.pending);
                if let Some(i) = pending.iter().position(|p| p.ticket == t) {
                    self.managed.release(pending.swap_remove(i).uses);
                }
            }
        }
        self.not_drained()
    }

    /// Batches whose memory is still pinned: those waiting to drain, and
    /// those that never will.
    fn not_drained(&self) -> usize {
        lock(&self.pending).len() + self.lost.load(Ordering::Relaxed) as usize
    }

    /// A -2 batch with nothing to wait on: its managed buffers stay pinned
    /// (`uses` is never given back) and `wait_for_quiescence` counts it.
    fn lose(&self, uses: Uses) {
        // Dropped, not released: its buffers' counts stay up.
        drop(uses);
        self.lost.fetch_add(1, Ordering::Relaxed);
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        let Some(engine) = self.engine.take() else {
            return;
        };
        match engine.stop() {
            Ok(()) => {}
            // A forked child's copy of the parent's engine: its buffers are
            // the parent's business (a child's copies, left as they are).
            Err(SyncError::Forked) => std::mem::forget(std::mem::take(&mut self.managed)),
            Err(e) => {
                // Something may still touch the managed buffers: never free them.
                tracing::error!("{e}; leaking the managed buffers rather than free memory in use");
                std::mem::forget(std::mem::take(&mut self.managed));
            }
        }
    }
}

/// Most distinct reasons a failed batch's warning names.
const REASONS_SHOWN: usize = 8;

/// A failed batch's tasks for one log line: how many failed, and each
/// reason once with its count (a batch can have hundreds of thousands).
fn failures(tasks: &[TaskReport]) -> String {
    let mut reasons: Vec<(String, usize)> = Vec::new();
    let mut failed = 0;
    for t in tasks {
        let why = match &t.status {
            TaskStatus::Failed(e) => e.to_string(),
            TaskStatus::Fenced => "fenced".to_string(),
            TaskStatus::Completed => continue,
        };
        failed += 1;
        match reasons.iter_mut().find(|(r, _)| *r == why) {
            Some((_, n)) => *n += 1,
            None => reasons.push((why, 1)),
        }
    }
    let mut line = format!("{failed} of {} tasks", tasks.len());
    for (i, (why, n)) in reasons.iter().enumerate() {
        if i == REASONS_SHOWN {
            line.push_str(&format!("; {} more reasons", reasons.len() - i));
            break;
        }
        line.push_str(&format!("; {why} (×{n})"));
    }
    line
}
