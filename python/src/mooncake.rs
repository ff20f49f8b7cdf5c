//! The Mooncake-compatible `TransferEngine`: the names, argument order and
//! return conventions of Mooncake's Python binding
//! (`mooncake-integration/transfer_engine/transfer_engine_py.cpp`), for the
//! subset vLLM's and SGLang's connectors call, on quiesce's contract.
//!
//! Addressing is Mooncake's: a target registers ranges of its memory
//! (`register_memory(addr, capacity)`), each a segment; an initiator names
//! remote memory by the target's virtual addresses and its session name
//! `"host:rpc_port"`. Access is proven with a token every peer derives from
//! a secret the cluster shares (environment variable [`SECRET_ENV`]); an
//! explicit opt-in ([`OPEN_CLUSTER_ENV`]) runs an open cluster on a trusted
//! network instead.

use std::collections::HashMap;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{Direction, OpenedAt, SyncEngine, SyncTask};
use quiesce_batch::{BatchOptions, FailurePolicy, TaskStatus, SYNC_FAILED, SYNC_OK, SYNC_UNKNOWN};
use quiesce_transports::{EngineConfig, Token};

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
/// How long `unregister_memory` waits for nothing to hold the range.
const RECLAIM_WAIT: Duration = Duration::from_secs(30);

/// An initialised engine.
struct Node {
    engine: SyncEngine,
    token: Token,
    options: BatchOptions,
    /// Peer segments opened so far, by peer.
    opened: Mutex<HashMap<SocketAddr, Vec<OpenedAt>>>,
    /// Session names resolved so far.
    peers: Mutex<HashMap<String, SocketAddr>>,
    /// Tickets of batches that returned -2: their memory stays pinned.
    pending: Mutex<Vec<u64>>,
}

/// Mooncake's `TransferEngine`, whose codes keep quiesce's contract.
///
/// `0`: completed. `-1`: failed, and nothing touches the caller's memory any
/// more (sources and destinations may be reused at once). `-2`: completion
/// unknown (a target stopped answering while the batch was being cut): the
/// memory stays pinned — do not free or reuse it until
/// `wait_for_quiescence()` returns 0. Callers that test `ret == 0` (vLLM) or
/// `ret < 0` (SGLang) treat -2 as a failure, as they should.
#[pyclass(module = "quiesce._native")]
pub struct TransferEngine {
    node: RwLock<Option<Arc<Node>>>,
}

fn complain(what: &str) -> i32 {
    eprintln!("quiesce: {what}");
    SYNC_FAILED
}

fn secret() -> Result<Vec<u8>, String> {
    if let Some(s) = std::env::var_os(SECRET_ENV) {
        let s = s.into_encoded_bytes();
        if s.len() < 16 {
            return Err(format!("{SECRET_ENV} must hold at least 16 bytes"));
        }
        return Ok(s);
    }
    if std::env::var(OPEN_CLUSTER_ENV).is_ok_and(|v| v == "1") {
        eprintln!("quiesce: {OPEN_CLUSTER_ENV}=1: any peer that can connect may read and write registered memory");
        return Ok(OPEN_CLUSTER_SECRET.to_vec());
    }
    Err(format!(
        "remote access needs a shared secret: set {SECRET_ENV} (16+ bytes, the same on every \
         peer), or {OPEN_CLUSTER_ENV}=1 to let any peer that can connect read and write (trusted \
         networks only)"
    ))
}

/// Fail-fast, as Mooncake returns at a batch's first failure — but after
/// fencing the rest, so the -1 is safe. Mooncake's `MC_TRANSFER_TIMEOUT`
/// (seconds, at least 5; 30 by default) is each batch's deadline.
fn options() -> BatchOptions {
    let secs = std::env::var("MC_TRANSFER_TIMEOUT")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .map_or(30, |s| s.max(5));
    BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_secs(secs))
}

fn listen_addr(local_hostname: &str) -> Result<SocketAddr, String> {
    let (host, port) = match local_hostname.rsplit_once(':') {
        Some((h, p)) if !h.contains(':') || h.starts_with('[') => (
            h.trim_start_matches('[').trim_end_matches(']'),
            p.parse::<u16>()
                .map_err(|_| format!("bad port in {local_hostname:?}"))?,
        ),
        _ => (local_hostname, 0),
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

impl TransferEngine {
    fn node(&self) -> Option<Arc<Node>> {
        self.node.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn start(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
    ) -> i32 {
        if self.node().is_some() {
            return complain("initialize: already initialised");
        }
        if metadata_server != "P2PHANDSHAKE" {
            return complain(&format!(
                "initialize: metadata server {metadata_server:?}: only \"P2PHANDSHAKE\" is supported"
            ));
        }
        if protocol != "tcp" {
            return complain(&format!(
                "initialize: protocol {protocol:?}: only \"tcp\" is supported from Python"
            ));
        }
        let token = match secret() {
            Ok(s) => Token::derive(&s, TOKEN_LABEL),
            Err(e) => return complain(&format!("initialize: {e}")),
        };
        let listen = match listen_addr(local_hostname) {
            Ok(a) => a,
            Err(e) => return complain(&format!("initialize: {e}")),
        };
        let config = EngineConfig {
            node: local_hostname.to_string(),
            listen,
            ..Default::default()
        };
        let engine = match py.detach(|| SyncEngine::start(config)) {
            Ok(e) => e,
            Err(e) => return complain(&format!("initialize: {e}")),
        };
        *self.node.write().unwrap_or_else(|e| e.into_inner()) = Some(Arc::new(Node {
            engine,
            token,
            options: options(),
            opened: Mutex::default(),
            peers: Mutex::default(),
            pending: Mutex::default(),
        }));
        SYNC_OK
    }

    /// A batch of `dir` tasks to `target`: code as documented on the class.
    fn transfer(
        &self,
        py: Python<'_>,
        target: &str,
        dir: Direction,
        buffers: Vec<usize>,
        peer_addresses: Vec<usize>,
        lengths: Vec<usize>,
    ) -> i32 {
        let Some(node) = self.node() else {
            return complain("transfer: the engine is not initialised");
        };
        if buffers.len() != peer_addresses.len() || buffers.len() != lengths.len() {
            return complain("transfer: buffers, peer addresses and lengths differ in count");
        }
        if buffers.is_empty() {
            return complain("transfer: no buffers");
        }
        if let Some(i) = (0..buffers.len()).find(|&i| buffers[i] == 0 || lengths[i] == 0) {
            return complain(&format!(
                "transfer: task {i} has a null buffer or zero length"
            ));
        }
        let target = target.to_string();
        py.detach(move || node.run(&target, dir, buffers, peer_addresses, lengths))
    }
}

impl Node {
    fn peer(&self, target: &str) -> Result<SocketAddr, String> {
        if let Some(a) = self
            .peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(target)
        {
            return Ok(*a);
        }
        let addr = target
            .to_socket_addrs()
            .map_err(|e| format!("session {target:?}: {e}"))?
            .next()
            .ok_or_else(|| format!("session {target:?} resolves to no address"))?;
        self.peers
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(target.to_string(), addr);
        Ok(addr)
    }

    /// The opened segment holding `addr..addr + len` at `peer` (opening it
    /// by address if this engine has not yet).
    fn segment(&self, peer: SocketAddr, addr: u64, len: u64) -> Result<OpenedAt, String> {
        let holds = |s: &OpenedAt| addr >= s.base && addr - s.base < s.len;
        let cached = self
            .opened
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&peer)
            .and_then(|v| v.iter().find(|s| holds(s)).copied());
        let seg = match cached {
            Some(s) => s,
            None => {
                let s = self.engine.open_at(peer, addr, self.token).map_err(|e| {
                    format!("{peer}: no registered memory at {addr:#x} open to this secret ({e})")
                })?;
                self.opened
                    .lock()
                    .unwrap_or_else(|e| e.into_inner())
                    .entry(peer)
                    .or_default()
                    .push(s);
                s
            }
        };
        if (addr - seg.base)
            .checked_add(len)
            .is_none_or(|end| end > seg.len)
        {
            return Err(format!(
                "{peer}: {len} bytes at {addr:#x} cross the end of the registered range at {:#x} ({} bytes)",
                seg.base, seg.len
            ));
        }
        Ok(seg)
    }

    fn run(
        &self,
        target: &str,
        dir: Direction,
        buffers: Vec<usize>,
        peer_addresses: Vec<usize>,
        lengths: Vec<usize>,
    ) -> i32 {
        let peer = match self.peer(target) {
            Ok(p) => p,
            Err(e) => return complain(&format!("transfer: {e}")),
        };
        let mut tasks = Vec::with_capacity(buffers.len());
        let mut used = Vec::with_capacity(buffers.len());
        for ((&buf, &at), &len) in buffers.iter().zip(&peer_addresses).zip(&lengths) {
            let seg = match self.segment(peer, at as u64, len as u64) {
                Ok(s) => s,
                Err(e) => return complain(&format!("transfer: {e}")),
            };
            used.push(seg.segment);
            tasks.push(SyncTask {
                segment: seg.segment,
                offset: at as u64 - seg.base,
                // SAFETY: Mooncake's contract, which this API keeps: the
                // caller's buffer stays valid and untouched until the call
                // returns 0 or -1, or, after -2, until wait_for_quiescence()
                // says the batch drained.
                buf: unsafe { RawBuf::new(buf as *mut u8, len) },
            });
        }
        match self.engine.batch(dir, tasks, self.options) {
            Ok(out) if out.code == SYNC_UNKNOWN => {
                if let Some(t) = out.ticket {
                    self.pending
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .push(t);
                }
                SYNC_UNKNOWN
            }
            Ok(out) => {
                if out.code != SYNC_OK {
                    // The peer may have re-registered its memory: open anew next time.
                    if let Some(v) = self
                        .opened
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_mut(&peer)
                    {
                        v.retain(|s| !used.contains(&s.segment));
                    }
                    let why: Vec<String> = out
                        .tasks
                        .iter()
                        .filter_map(|t| match &t.status {
                            TaskStatus::Failed(e) => Some(e.to_string()),
                            TaskStatus::Fenced => Some("fenced".into()),
                            TaskStatus::Completed => None,
                        })
                        .collect();
                    eprintln!("quiesce: transfer to {target} failed: {}", why.join("; "));
                }
                out.code
            }
            Err(e) => complain(&format!("transfer: {e}")),
        }
    }
}

#[pymethods]
impl TransferEngine {
    /// An engine that does nothing until `initialize`.
    #[new]
    fn new() -> Self {
        TransferEngine {
            node: RwLock::new(None),
        }
    }

    /// Starts the engine: listens on `local_hostname` (`"host"` picks a free
    /// port, `"host:port"` that one) for peers. `metadata_server` must be
    /// `"P2PHANDSHAKE"` and `protocol` `"tcp"`; `device_name` is ignored.
    /// Needs the cluster's secret in `QUIESCE_SECRET` (or
    /// `QUIESCE_OPEN_CLUSTER=1`). 0 on success, -1 otherwise (the reason on
    /// stderr).
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name))]
    fn initialize(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
    ) -> i32 {
        let _ = device_name;
        self.start(py, local_hostname, metadata_server, protocol)
    }

    /// `initialize` with Mooncake's explicit `metadata_type`, which must be
    /// `"P2PHANDSHAKE"` here as `metadata_server` must.
    #[pyo3(signature = (local_hostname, metadata_server, protocol, device_name, metadata_type))]
    fn initialize_ext(
        &self,
        py: Python<'_>,
        local_hostname: &str,
        metadata_server: &str,
        protocol: &str,
        device_name: &str,
        metadata_type: &str,
    ) -> i32 {
        let _ = device_name;
        if metadata_type != "P2PHANDSHAKE" && metadata_server != "P2PHANDSHAKE" {
            return complain(&format!(
                "initialize_ext: metadata type {metadata_type:?}: only \"P2PHANDSHAKE\" is supported"
            ));
        }
        self.start(py, local_hostname, metadata_server, protocol)
    }

    /// The port peers reach this engine on (its session name is
    /// `"host:port"`); -1 before `initialize`.
    fn get_rpc_port(&self) -> i32 {
        self.node()
            .map_or(SYNC_FAILED, |n| n.engine.local_addr().port() as i32)
    }

    /// Lets authenticated peers read and write `addr..addr + capacity`,
    /// which must stay valid until `unregister_memory(addr)` returns 0.
    fn register_memory(&self, addr: usize, capacity: usize) -> i32 {
        let Some(node) = self.node() else {
            return complain("register_memory: the engine is not initialised");
        };
        if addr == 0 || capacity == 0 {
            return complain("register_memory: null address or zero capacity");
        }
        // SAFETY: the caller lends the range until unregister_memory
        // returns 0 (Mooncake's contract for registered memory).
        let r = unsafe {
            node.engine.lend(
                &format!("{addr:#x}"),
                addr as u64,
                capacity as u64,
                node.token,
            )
        };
        match r {
            Ok(_) => SYNC_OK,
            Err(e) => complain(&format!("register_memory {addr:#x}: {e}")),
        }
    }

    /// Takes `addr`'s range back: writes landing in it are cut and none
    /// issued before lands later. 0: nothing touches it any more; -1: not
    /// registered; -2: something still held it after 30 s (do not free it;
    /// call again).
    fn unregister_memory(&self, py: Python<'_>, addr: usize) -> i32 {
        let Some(node) = self.node() else {
            return complain("unregister_memory: the engine is not initialised");
        };
        match py.detach(|| node.engine.reclaim(addr as u64, RECLAIM_WAIT)) {
            Ok(true) => SYNC_OK,
            Ok(false) => SYNC_UNKNOWN,
            Err(e) => complain(&format!("unregister_memory {addr:#x}: {e}")),
        }
    }

    /// `register_memory` for each pair; 0 if every one succeeded, else the
    /// first failure's code (the others stay registered).
    fn batch_register_memory(&self, addrs: Vec<usize>, capacities: Vec<usize>) -> i32 {
        if addrs.len() != capacities.len() {
            return complain("batch_register_memory: addresses and capacities differ in count");
        }
        let codes: Vec<i32> = addrs
            .iter()
            .zip(&capacities)
            .map(|(&a, &c)| self.register_memory(a, c))
            .collect();
        codes.into_iter().find(|&c| c != SYNC_OK).unwrap_or(SYNC_OK)
    }

    /// `unregister_memory` for each address; 0 if every one succeeded, else
    /// the worst code (-2 before -1).
    fn batch_unregister_memory(&self, py: Python<'_>, addrs: Vec<usize>) -> i32 {
        let codes: Vec<i32> = addrs
            .iter()
            .map(|&a| self.unregister_memory(py, a))
            .collect();
        codes.into_iter().min().unwrap_or(SYNC_OK)
    }

    /// Writes `length` bytes at `buffer` to `peer_buffer_address` at the
    /// peer whose session name is `target_hostname` (`"host:port"`).
    fn transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: usize,
        peer_buffer_address: usize,
        length: usize,
    ) -> i32 {
        self.transfer(
            py,
            target_hostname,
            Direction::Write,
            vec![buffer],
            vec![peer_buffer_address],
            vec![length],
        )
    }

    /// Reads `length` bytes at the peer's `peer_buffer_address` into
    /// `buffer`.
    fn transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffer: usize,
        peer_buffer_address: usize,
        length: usize,
    ) -> i32 {
        self.transfer(
            py,
            target_hostname,
            Direction::Read,
            vec![buffer],
            vec![peer_buffer_address],
            vec![length],
        )
    }

    /// One batch of writes: it resolves only once every write in it has
    /// quiesced, whatever its code.
    fn batch_transfer_sync_write(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<usize>,
        peer_buffer_addresses: Vec<usize>,
        lengths: Vec<usize>,
    ) -> i32 {
        self.transfer(
            py,
            target_hostname,
            Direction::Write,
            buffers,
            peer_buffer_addresses,
            lengths,
        )
    }

    /// One batch of reads.
    fn batch_transfer_sync_read(
        &self,
        py: Python<'_>,
        target_hostname: &str,
        buffers: Vec<usize>,
        peer_buffer_addresses: Vec<usize>,
        lengths: Vec<usize>,
    ) -> i32 {
        self.transfer(
            py,
            target_hostname,
            Direction::Read,
            buffers,
            peer_buffer_addresses,
            lengths,
        )
    }

    /// Waits up to `timeout` seconds for the batches that returned -2 to
    /// drain; returns how many have not (0: no memory of any is pinned any
    /// more).
    #[pyo3(signature = (timeout = 30.0))]
    fn wait_for_quiescence(&self, py: Python<'_>, timeout: f64) -> usize {
        let Some(node) = self.node() else { return 0 };
        py.detach(|| {
            let deadline = Instant::now() + Duration::from_secs_f64(timeout.max(0.0));
            // Taken out while waiting, so transfers returning -2 meanwhile
            // are not held up; those stay for the next call.
            let mut mine =
                std::mem::take(&mut *node.pending.lock().unwrap_or_else(|e| e.into_inner()));
            mine.retain(|&t| {
                let left = deadline.saturating_duration_since(Instant::now());
                !matches!(node.engine.wait::<RawBuf>(t, left), Ok(Some(_)) | Err(_))
            });
            let mut pending = node.pending.lock().unwrap_or_else(|e| e.into_inner());
            pending.extend(mine);
            pending.len()
        })
    }
}
