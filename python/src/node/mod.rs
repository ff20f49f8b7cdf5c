//! An initialised engine behind the Python `TransferEngine`: the sync
//! engine, the token every peer derives from the shared secret, the peer
//! segments opened so far, and the batches still out (asynchronous ones,
//! and those that returned -2).

mod outstanding;
mod prepare;
mod published;
mod settings;

use std::collections::{HashMap, VecDeque};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use fnv::FnvHashMap;
use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{
    Direction, HostRanges, OpenedSegment, SyncEngine, SyncError, SyncOutcome,
};
use quiesce_batch::{BatchOptions, TaskReport, TaskStatus, SYNC_FAILED, SYNC_OK, SYNC_UNKNOWN};
use quiesce_directory::{Directory, NodeRecord};
use quiesce_transports::rdma::RdmaConfig;
use quiesce_transports::{EngineConfig, Token};

use crate::managed::ManagedBuffers;

use self::outstanding::{Outstanding, Pinned};
use self::settings::{options, wait_unknown, PUBLISH_WAIT, QUIESCE_WAIT_UNKNOWN, TOKEN_LABEL};

pub(crate) use outstanding::Progress;
pub(crate) use settings::{
    listen_addr, local_mode, seconds, secret, spin, tcp_congestion, OPEN_CLUSTER_ENV, SECRET_ENV,
};

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
    /// The node first found at each P2P session name: a P2P name is where
    /// a node was found, and another node found there later (the first
    /// gone, its address another's) is not that session.
    p2p_nodes: Mutex<FnvHashMap<String, String>>,
    /// The registration id published for each registered address (etcd):
    /// a withdraw names it, so that it never deletes the record of a newer
    /// registration at the same address.
    published_ids: Mutex<FnvHashMap<u64, u64>>,
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
        let listen = listen_addr(local_hostname)?;
        // The entry tells peers where to connect: 0.0.0.0 would send each
        // to its own host.
        if matches!(directory, Directory::Etcd(_)) && listen.ip().is_unspecified() {
            return Err(format!(
                "with a metadata server, listen on an address peers can reach, not {local_hostname:?}: \
                 it is what the directory tells them"
            ));
        }
        let config = EngineConfig {
            node: local_hostname.to_string(),
            listen,
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
            p2p_nodes: Mutex::default(),
            published_ids: Mutex::default(),
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

    /// That `target` is the node at `peer`: with an etcd directory, the
    /// node its entry names ([`stale_entry`]); for P2P, the node first found
    /// at that session name.
    fn check_node(&self, target: &str, peer: SocketAddr) -> Result<(), String> {
        if matches!(self.directory, Directory::P2p) {
            let there = self
                .engine()
                .peer_node(peer)
                .map_err(|e| format!("session {target:?} at {peer}: {e}"))?;
            let mut nodes = lock(&self.p2p_nodes);
            let first = nodes
                .entry(target.to_string())
                .or_insert_with(|| there.clone());
            return match *first == there {
                true => Ok(()),
                false => Err(format!(
                    "session {target:?} was node {first:?}, and {peer} is now node {there:?}"
                )),
            };
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
            self.managed.release(p.uses);
            return SYNC_OK;
        }
        let opts = self.options_for(&p);
        match self.engine().run(p.tasks, opts) {
            Ok(out) => {
                let out = self.drained_within(out, self.wait_unknown);
                self.settle(target, p.peer, &p.used, p.uses, out)
            }
            // Cut off by the engine's stop, whose drain left operations
            // live: the memory may still be touched, and stays pinned.
            Err(e @ SyncError::Undrained(_)) => {
                self.lose(p.uses);
                complain(&format!("transfer: {e}"));
                SYNC_UNKNOWN
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
            // Not yet, or the engine's thread is gone (a stop that reaped
            // everything answers -1 above; one that did not, or a thread
            // that died, leaves -2).
            Ok(None) | Err(_) => out,
        }
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
                warn_undrained();
            }
        }
    }
}

/// Tells Python, with a `RuntimeWarning`, that a drop-in engine was dropped
/// with transfers its stop could not drain: Mooncake's API has no close()
/// whose code could say -2, and a log line alone is easy to miss. A warning
/// that the filters turn into an error is reported as unraisable: a drop
/// cannot raise.
///
/// The drop may run while an exception unwinds (the engine a temporary on
/// the interpreter's stack, freed with the exception already set): that
/// exception is set aside around the warning and put back, or the warning
/// machinery would run with it pending and the unwinding would go on with
/// none (`..._while_an_exception_unwinds_keeps_that_exception`: the
/// interpreter crashed).
fn warn_undrained() {
    use std::ptr::null_mut;

    const MSG: &std::ffi::CStr = c"quiesce: a TransferEngine was dropped with transfers it could \
        not drain: the memory they used may still be read or written by a peer (one stopped \
        on this host); never free or reuse it. Read every batch's status and wait for \
        wait_for_quiescence() to return 0 before dropping an engine.";
    pyo3::Python::try_attach(|py| {
        let (mut kind, mut value, mut trace) = (null_mut(), null_mut(), null_mut());
        // SAFETY: attached (`py`); moves the pending exception, if any, into
        // these three owned references (null when there is none) and clears
        // it. The older API on purpose: present on every version this builds
        // for, where its successor needs 3.12.
        #[allow(deprecated)]
        unsafe {
            pyo3::ffi::PyErr_Fetch(&mut kind, &mut value, &mut trace)
        };
        let category = py.get_type::<pyo3::exceptions::PyRuntimeWarning>();
        if let Err(e) = pyo3::PyErr::warn(py, &category, MSG, 1) {
            e.write_unraisable(py, None);
        }
        // SAFETY: attached; hands the three references taken above back as
        // the pending exception (none if they are null), as they were.
        #[allow(deprecated)]
        unsafe {
            pyo3::ffi::PyErr_Restore(kind, value, trace)
        };
    });
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
