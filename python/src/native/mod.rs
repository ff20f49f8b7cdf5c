//! The native API's Rust half (`quiesce.Engine` wraps `NativeEngine`):
//! named segments lent from buffer-protocol objects, batches of reads and
//! writes over them, outcomes for blocking callers and, through a
//! delivery thread, for asyncio.
//!
//! Python memory is held ([`Held`]) from the moment a task takes it until
//! the batch's outcome says nothing can touch it — on the caller's stack for
//! a blocking run, in [`Core::flights`] for a submitted one, in
//! [`Core::tickets`] after completion-unknown — and is released only on a
//! thread attached to Python: the engine's thread never owns a `Held`.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{SyncEngine, SyncError, SyncOutcome};
use quiesce_batch::{BatchOptions, FailurePolicy, RemoteState, TaskStatus, SYNC_UNKNOWN};
use quiesce_directory::{Directory, DirectoryError, NodeRecord, SegmentRecord};
use quiesce_transports::rdma::RdmaConfig;
use quiesce_transports::{EngineConfig, Token};

use crate::node::{
    listen_addr, local_mode, lock, seconds, secret, spin, stale_entry, tcp_congestion,
};

pub(crate) mod batch;
pub(crate) mod error;
mod pin;
mod tickets;

use batch::{Moves, NativeBatch};
use error::{from_sync, invalid, raise};
use pin::{Access, Held};

/// What Python gets for an outcome: (code, [(status, reason, bytes,
/// attempts, remote)], remote_confirmed, ticket).
type Report = (
    i32,
    Vec<(String, Option<String>, u64, u32, String)>,
    bool,
    Option<u64>,
);

/// An outcome on its way to the delivery thread.
type Delivery = (u64, SyncOutcome<RawBuf>);

/// A submitted batch without a delivered outcome.
struct Flight {
    held: Vec<Held>,
    /// Called with the report (or `None`: the engine closed first).
    callback: Py<PyAny>,
}

/// How the engine ended (set by `close`, read by the delivery thread).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ending {
    Running,
    /// Stopped after every operation was reaped: held memory may go.
    Drained,
    /// Stopped with operations maybe in flight: held memory is kept for good.
    Undrained,
}

struct Core {
    /// `None` once closed.
    engine: RwLock<Option<SyncEngine>>,
    secret: Vec<u8>,
    flights: Mutex<HashMap<u64, Flight>>,
    /// Memory of batches whose completion is unknown, by ticket.
    tickets: Mutex<HashMap<u64, Vec<Held>>>,
    /// Outcomes of tickets drained by `wait_for_quiescence` or `pending`,
    /// for the `CompletionUnknown.wait` that asks later (oldest first, at
    /// most [`tickets::ANSWERS_KEPT`]).
    answered: Mutex<VecDeque<(u64, Report)>>,
    /// Lent segments' memory, by address.
    lent: Mutex<HashMap<u64, Lending>>,
    /// Where submitted batches' outcomes go (started with the first).
    deliveries: Mutex<Option<mpsc::Sender<Delivery>>>,
    ending: Mutex<Ending>,
    /// Held by the one `close` that stops the engine (a second waits for it).
    closing: Mutex<()>,
    next: AtomicU64,
    /// Where peers are found and this engine is published (P2P: nowhere);
    /// `None` once closed (dropping it takes the entries with it).
    directory: RwLock<Option<Directory>>,
    /// This engine's node name in the directory.
    node: String,
    /// Lent segments' names, by address (to withdraw them).
    names: Mutex<HashMap<u64, (u64, String)>>,
}

/// How long `NativeEngine::new` waits for the directory to hold its entry.
const PUBLISH_WAIT: Duration = Duration::from_secs(10);

/// The exception for a directory error: a name it does not hold is an
/// unknown peer; a directory that cannot be reached, its own kind.
fn from_directory(py: Python<'_>, e: &DirectoryError) -> PyErr {
    let kind = match e {
        DirectoryError::NotFound(_) => "UnknownPeer",
        DirectoryError::BadName(_) | DirectoryError::BadUrl { .. } => "InvalidInput",
        _ => "DirectoryUnavailable",
    };
    raise(py, kind, &e.to_string())
}

/// How long one wait holds the engine's read lock (a `close` waits for it).
const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Held memory, one buffer or a batch's.
trait Release {
    fn release(self, py: Python<'_>);
}

impl Release for Held {
    fn release(self, py: Python<'_>) {
        Held::release(self, py)
    }
}

/// A lent segment's memory, and which lending of its address it is.
struct Lending {
    segment: u64,
    held: Held,
}

impl Release for Lending {
    fn release(self, py: Python<'_>) {
        self.held.release(py)
    }
}

impl Release for Vec<Held> {
    fn release(self, py: Python<'_>) {
        self.into_iter().for_each(|h| h.release(py))
    }
}

/// The engine behind `quiesce.Engine`.
#[pyclass(module = "quiesce._native", frozen)]
pub struct NativeEngine {
    core: Arc<Core>,
}

/// A batch's options and its tasks, taken out to run: borrowed only for
/// that, so that another thread's use of it while it runs is a typed error
/// (it has run already), not pyo3's 'Already borrowed'.
fn take(
    py: Python<'_>,
    batch: &Bound<'_, NativeBatch>,
    policy: &str,
    deadline: f64,
) -> PyResult<(BatchOptions, (Moves, Vec<Held>))> {
    let mut b = batch
        .try_borrow_mut()
        .map_err(|_| invalid(py, "this batch is being changed by another thread"))?;
    let opts = options(py, policy, deadline, b.__len__())?;
    Ok((opts, b.take(py)?))
}

/// A batch's options: `policy`, `deadline` (seconds), and room for its
/// `tasks` (a batch holds what its caller adds: a KV cache's blocks times
/// its layers pass the native default of 4,096).
fn options(py: Python<'_>, policy: &str, deadline: f64, tasks: usize) -> PyResult<BatchOptions> {
    let policy = match policy {
        "fail_fast" => FailurePolicy::FailFast,
        "drain" => FailurePolicy::Drain,
        other => {
            return Err(invalid(
                py,
                &format!("policy {other:?}: use \"fail_fast\" or \"drain\""),
            ))
        }
    };
    let deadline = Duration::try_from_secs_f64(deadline)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| invalid(py, "the deadline must be a positive number of seconds"))?;
    let opts = BatchOptions::default().policy(policy).deadline(deadline);
    Ok(opts.room_for(tasks))
}

fn report(out: &SyncOutcome<RawBuf>) -> Report {
    let tasks = out
        .tasks
        .iter()
        .map(|t| {
            let (status, reason) = match &t.status {
                TaskStatus::Completed => ("completed", None),
                TaskStatus::Failed(e) => ("failed", Some(e.to_string())),
                TaskStatus::Fenced => ("fenced", None),
            };
            let remote = match t.remote {
                RemoteState::Answered => "answered",
                RemoteState::Fenced => "fenced",
                RemoteState::Unconfirmed => "unconfirmed",
            };
            (status.into(), reason, t.bytes, t.attempts, remote.into())
        })
        .collect();
    (out.code, tasks, out.remote_confirmed, out.ticket)
}

impl Core {
    /// Where `peer` listens: a literal `ip:port` as it is; else, with an
    /// etcd directory, the node it names there (and `true`: the node found
    /// there must be that node); else (or if the directory has no such
    /// node) the system resolver's `host:port`. `Err(None)`: it does not
    /// resolve.
    fn peer(&self, peer: &str) -> Result<(SocketAddr, bool), Option<DirectoryError>> {
        if let Ok(a) = peer.parse::<SocketAddr>() {
            return Ok((a, false));
        }
        let by_system = || {
            let a = peer.to_socket_addrs().ok().and_then(|mut a| a.next());
            a.map(|a| (a, false))
        };
        let by_name = self.directory(|d| match d {
            Directory::Etcd(_) => d.resolve(peer).map(|r| Some(r.addr)),
            Directory::P2p => Ok(None),
        });
        match by_name {
            Ok(Some(a)) => Ok((a, true)),
            Ok(None) => by_system().ok_or(None),
            // Not a node the directory holds: a `host:port` still resolves.
            Err(e @ DirectoryError::NotFound(_)) => by_system().ok_or(Some(e)),
            Err(e) => Err(Some(e)),
        }
    }

    /// Runs `f` on the directory, or says it is closed.
    fn directory<R>(
        &self,
        f: impl FnOnce(&Directory) -> Result<R, DirectoryError>,
    ) -> Result<R, DirectoryError> {
        let d = self.directory.read().unwrap_or_else(|e| e.into_inner());
        f(d.as_ref().ok_or(DirectoryError::Closed)?)
    }

    /// Whether the engine was closed, asked without the GIL: a close
    /// waiting for a blocking call holds the engine's lock's writer place,
    /// and a reader waits behind it.
    fn closed(&self, py: Python<'_>) -> bool {
        py.detach(|| {
            self.engine
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .is_none()
        })
    }

    /// `EngineClosed` for a call about memory the engine held (a ticket's,
    /// a lent range's): whether the close left it held for good.
    fn engine_closed(&self, py: Python<'_>) -> PyErr {
        // After the close that stopped it has said how it ended (it holds
        // `closing` throughout; without the GIL, which it may wait for).
        let held = py.detach(|| {
            let _closed = lock(&self.closing);
            *lock(&self.ending) == Ending::Undrained
        });
        error::engine_closed(py, held)
    }

    /// Runs `f` on the engine, or says it is closed.
    fn with<R>(&self, f: impl FnOnce(&SyncEngine) -> Result<R, SyncError>) -> Result<R, SyncError> {
        let engine = self.engine.read().unwrap_or_else(|e| e.into_inner());
        f(engine.as_ref().ok_or(SyncError::Stopped)?)
    }

    /// Settles `held` by its batch's outcome: kept under the ticket for -2,
    /// released for 0 and -1. A -2 without a ticket (the engine gives every
    /// one a ticket) has nothing to say when it drains: its memory is kept
    /// for good, never released on a guess.
    fn settle(&self, py: Python<'_>, out: &SyncOutcome<RawBuf>, held: Vec<Held>) {
        match (out.code, out.ticket) {
            (SYNC_UNKNOWN, Some(t)) => self.keep(py, &self.tickets, t, held),
            // Dropped unreleased: kept for good.
            (SYNC_UNKNOWN, None) => drop(held),
            _ => held.into_iter().for_each(|h| h.release(py)),
        }
    }

    /// Puts `held` in `map` under `key` — unless the engine has closed, whose
    /// `close` emptied the maps already: then it is released if the engine
    /// drained, and kept for good if it did not.
    fn keep<H: Release>(&self, py: Python<'_>, map: &Mutex<HashMap<u64, H>>, key: u64, held: H) {
        // The map's lock first: `close` sets the ending before it empties
        // the maps, so an entry put in while it reads `Running` is emptied.
        let (left, replaced) = {
            let mut map = lock(map);
            match *lock(&self.ending) {
                // A value it replaces is one the engine let go of already:
                // a lending at this address the engine took back (it lends
                // an address once at a time), whose reclaim call has not
                // removed it yet (and, seeing another lending, will not).
                Ending::Running => (None, map.insert(key, held)),
                ending => (Some((ending, held)), None),
            }
        };
        // Released with no lock held: letting go of an object may run
        // Python code (a finaliser) that calls back into this engine.
        // (Undrained: dropped unreleased, kept for good.)
        if let Some(old) = replaced {
            old.release(py);
        }
        if let Some((Ending::Drained, held)) = left {
            held.release(py);
        }
    }

    /// The delivery thread: hands each submitted batch's outcome to its
    /// callback; once the engine closed, answers the rest with `None` and
    /// whether their buffers stay held for good (the engine did not drain).
    fn deliver(self: Arc<Core>, rx: mpsc::Receiver<Delivery>) {
        while let Ok((key, out)) = rx.recv() {
            let delivered = Python::try_attach(|py| {
                let Some(f) = lock(&self.flights).remove(&key) else {
                    return;
                };
                self.settle(py, &out, f.held);
                if let Err(e) = f.callback.call1(py, (Some(report(&out)), false)) {
                    e.write_unraisable(py, Some(f.callback.bind(py)));
                }
            });
            if delivered.is_none() {
                // The interpreter is shutting down: nobody is left to tell.
                return;
            }
        }
        // Every sender is gone: the engine stopped, and no outcome is coming.
        let ending = *lock(&self.ending);
        Python::try_attach(|py| {
            let flights: Vec<Flight> = lock(&self.flights).drain().map(|(_, f)| f).collect();
            for f in flights {
                let held_for_good = ending != Ending::Drained;
                if held_for_good {
                    std::mem::forget(f.held);
                } else {
                    f.held.into_iter().for_each(|h| h.release(py));
                }
                if let Err(e) = f.callback.call1(py, (None::<Report>, held_for_good)) {
                    e.write_unraisable(py, Some(f.callback.bind(py)));
                }
            }
        });
    }

    /// Stops the engine; releases held memory if it drained, else keeps it
    /// for good. False: it did not drain. Blocking calls on other threads
    /// finish first (each within its deadline or wait slice); a second
    /// `close` waits for the first and answers the same.
    fn close(&self, py: Python<'_>) -> bool {
        // Without the GIL: blocking calls on other threads hold the engine's
        // read lock until they finish, and may need the GIL to do so.
        let stopped = py.detach(|| {
            let _only = lock(&self.closing);
            let engine = self
                .engine
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .take();
            let Some(engine) = engine else {
                return Err(*lock(&self.ending) == Ending::Drained);
            };
            let drained = engine.stop().is_ok();
            *lock(&self.ending) = if drained {
                Ending::Drained
            } else {
                Ending::Undrained
            };
            // The delivery thread answers the flights left once this goes.
            drop(lock(&self.deliveries).take());
            // This node's entries go with its directory (the lease is revoked).
            drop(
                self.directory
                    .write()
                    .unwrap_or_else(|e| e.into_inner())
                    .take(),
            );
            let mut held: Vec<Held> = lock(&self.tickets).drain().flat_map(|(_, h)| h).collect();
            held.extend(lock(&self.lent).drain().map(|(_, l)| l.held));
            Ok((drained, held))
        });
        match stopped {
            Ok((drained, held)) => {
                if drained {
                    held.into_iter().for_each(|h| h.release(py));
                }
                // Else dropped unreleased: kept for good.
                drained
            }
            // Closed already (by the call this one waited for).
            Err(drained) => drained,
        }
    }
}

#[pymethods]
impl NativeEngine {
    /// Starts an engine listening on `listen` ("host:port"; port 0 picks one).
    #[new]
    #[pyo3(signature = (listen, secret_bytes = None, open_cluster = false, transport = "tcp", device = None, directory = None, node = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        listen: &str,
        secret_bytes: Option<Vec<u8>>,
        open_cluster: bool,
        transport: &str,
        device: Option<String>,
        directory: Option<&str>,
        node: Option<String>,
    ) -> PyResult<NativeEngine> {
        let secret = secret(secret_bytes.as_deref(), open_cluster)
            .map_err(|e| raise(py, "SecretMissing", &e))?;
        let directory = py
            .detach(|| Directory::open(directory.unwrap_or("P2PHANDSHAKE")))
            .map_err(|e| from_directory(py, &e))?;
        let config = EngineConfig {
            // Its hello names it as the directory does, so that a peer that
            // found it there can tell it from another node at a stale
            // entry's address.
            node: node.clone().unwrap_or_else(|| listen.to_string()),
            listen: listen_addr(listen).map_err(|e| invalid(py, &e))?,
            local: local_mode(),
            tcp_congestion: tcp_congestion().map_err(|e| invalid(py, &e))?,
            ..Default::default()
        };
        // An etcd entry must say where peers reach this engine.
        if matches!(directory, Directory::Etcd(_)) && config.listen.ip().is_unspecified() {
            return Err(invalid(
                py,
                &format!(
                    "with a directory, listen on an address peers can reach, not {listen:?}: \
                     it is what the directory tells them"
                ),
            ));
        }
        let engine = match transport {
            "tcp" => py.detach(|| SyncEngine::start_spinning(config, spin())),
            "rdma" => py.detach(|| {
                let cfg = RdmaConfig {
                    control: config,
                    device,
                    ..Default::default()
                };
                SyncEngine::start_rdma(cfg, spin())
            }),
            other => {
                return Err(invalid(
                    py,
                    &format!("transport {other:?}: use \"tcp\" or \"rdma\""),
                ))
            }
        }
        .map_err(|e| from_sync(py, &e))?;
        // Unnamed, the engine is its bound address (unique, unlike a
        // "host:0" it was asked to listen on).
        let node = node.unwrap_or_else(|| engine.local_addr().to_string());
        let published = py.detach(|| {
            directory
                .publish_node(&NodeRecord {
                    node: node.clone(),
                    addr: engine.local_addr(),
                    fabric: transport.into(),
                })
                .and_then(|()| directory.flush(PUBLISH_WAIT))
        });
        if let Err(e) = published {
            py.detach(|| drop(engine));
            return Err(from_directory(py, &e));
        }
        Ok(NativeEngine {
            core: Arc::new(Core {
                engine: RwLock::new(Some(engine)),
                secret,
                flights: Mutex::default(),
                tickets: Mutex::default(),
                answered: Mutex::default(),
                lent: Mutex::default(),
                deliveries: Mutex::default(),
                ending: Mutex::new(Ending::Running),
                closing: Mutex::default(),
                next: AtomicU64::new(1),
                directory: RwLock::new(Some(directory)),
                node,
                names: Mutex::default(),
            }),
        })
    }

    /// Where peers connect ("ip:port").
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<String> {
        // Without the GIL, as every wait for the engine's lock: a `close`
        // waiting for its write lock holds new readers back until the
        // blocking calls in flight finish.
        py.detach(|| self.core.with(|e| Ok(e.local_addr().to_string())))
            .map_err(|e| from_sync(py, &e))
    }

    /// Lends `buffer` to peers as segment `name`; returns (id, address, length).
    fn lend(
        &self,
        py: Python<'_>,
        name: &str,
        buffer: &Bound<'_, PyAny>,
    ) -> PyResult<(u64, u64, u64)> {
        let held = Held::new(buffer, Access::Write)?;
        let (addr, len) = (held.addr as u64, held.len as u64);
        let token = Token::derive(&self.core.secret, name);
        // SAFETY: `held` keeps the memory valid and in place until `reclaim`
        // says the engine let go of it (or the engine drained; one that did
        // not leaks it). That the caller's code does not write it while it
        // is lent is the caller's promise (documented on `Engine.register`).
        let r = py.detach(|| {
            self.core
                .with(|e| unsafe { e.lend(name, addr, len, token) })
        });
        match r {
            Ok(id) => {
                let lending = Lending { segment: id, held };
                self.core.keep(py, &self.core.lent, addr, lending);
                lock(&self.core.names).insert(addr, (id, name.to_string()));
                // Publishing only queues (a helper thread writes etcd).
                let rec = SegmentRecord {
                    node: self.core.node.clone(),
                    name: name.to_string(),
                    id,
                    base: addr,
                    len,
                    read: true,
                    write: true,
                };
                if let Err(e) = py.detach(|| self.core.directory(|d| d.publish_segment(&rec))) {
                    tracing::warn!(error = %e, segment = name, "not published");
                }
                Ok((id, addr, len))
            }
            Err(e) => {
                held.release(py);
                Err(from_sync(py, &e))
            }
        }
    }

    /// Revokes and takes back the segment lent at `address` — segment
    /// `segment` if given: a lending of that address made since is not
    /// this call's, and the call raises — waiting up to `timeout` s: True
    /// once nothing can touch it (its buffer is let go).
    #[pyo3(signature = (address, timeout, segment = None))]
    fn reclaim(
        &self,
        py: Python<'_>,
        address: u64,
        timeout: f64,
        segment: Option<u64>,
    ) -> PyResult<bool> {
        // The lending this takes back: once the engine let go of it, the
        // address may be lent again (by another thread) before the entries
        // below are removed, and those are not this call's to remove.
        let lent = lock(&self.core.lent).get(&address).map(|l| l.segment);
        // Closed (the close took every lending): whether it left the range
        // held for good, not "not lent".
        if lent.is_none() && self.core.closed(py) {
            return Err(self.core.engine_closed(py));
        }
        if segment.is_some() && lent != segment {
            return Err(from_sync(py, &SyncError::NotLent(address)));
        }
        let segment = lent;
        let deadline = Instant::now() + seconds(timeout);
        let back = py
            .detach(|| loop {
                // Another call took this lending back meanwhile (and the
                // address may be lent anew, which is not this call's to
                // take): the engine let go of it — unless a close took it
                // (it sets how it ended before it takes the lendings): then
                // whether the memory is free is the close's to say.
                let gone = || match *lock(&self.core.ending) {
                    Ending::Running => Ok(true),
                    _ => Err(SyncError::Stopped),
                };
                if segment.is_some()
                    && lock(&self.core.lent).get(&address).map(|l| l.segment) != segment
                {
                    return gone();
                }
                let left = deadline.saturating_duration_since(Instant::now());
                let began = Instant::now();
                // By segment where known: the address may be lent anew by
                // another thread, and that lending is not this call's.
                let slice = left.min(WAIT_SLICE);
                let r = self.core.with(|e| match segment {
                    Some(id) => e.reclaim_segment(address, id, slice),
                    None => e.reclaim(address, slice),
                });
                match r {
                    Ok(false) if !left.is_zero() => {
                        // Another call is taking it back and this one was
                        // answered at once: wait, do not spin on the engine.
                        if began.elapsed() < Duration::from_millis(1) {
                            std::thread::sleep(Duration::from_millis(1));
                        }
                    }
                    // That other call took it back: the engine let go.
                    Err(SyncError::NotLent(_)) if segment.is_some() => return gone(),
                    r => return r,
                }
            })
            .map_err(|e| match e {
                SyncError::Stopped => self.core.engine_closed(py),
                e => from_sync(py, &e),
            })?;
        if back {
            let ours = |id: u64| Some(id) == segment;
            let held = {
                let mut lent = lock(&self.core.lent);
                match lent.get(&address) {
                    Some(l) if ours(l.segment) => lent.remove(&address),
                    _ => None,
                }
            };
            if let Some(h) = held {
                h.release(py);
            }
            let name = {
                let mut names = lock(&self.core.names);
                match names.get(&address) {
                    Some((id, _)) if ours(*id) => names.remove(&address),
                    _ => None,
                }
            };
            if let Some((id, n)) = name {
                // By id: the name may be lent again (published anew) by now.
                let _ = py.detach(|| {
                    self.core
                        .directory(|d| d.withdraw_segment(&self.core.node, &n, Some(id)))
                });
            }
        }
        Ok(back)
    }

    /// Opens peer `peer`'s segment `name`; returns (handle, address,
    /// length). `peer`: a node name the directory holds, or `host:port`.
    fn open(&self, py: Python<'_>, peer: &str, name: &str) -> PyResult<(u32, u64, u64)> {
        let (addr, named) = py.detach(|| self.core.peer(peer)).map_err(|e| match e {
            Some(e) => from_directory(py, &e),
            None => raise(py, "UnknownPeer", &format!("cannot resolve peer {peer:?}")),
        })?;
        if named {
            // The entry may be stale, its address another node's now.
            let stale = py
                .detach(|| self.core.with(|e| stale_entry(e, peer, addr)))
                .map_err(|e| from_sync(py, &e))?;
            if let Some(why) = stale {
                return Err(raise(py, "UnknownPeer", &why));
            }
        }
        let token = Token::derive(&self.core.secret, name);
        let s = py
            .detach(|| self.core.with(|e| e.open_named(addr, name, token)))
            .map_err(|e| from_sync(py, &e))?;
        Ok((s.segment, s.base, s.len))
    }

    /// Runs `batch`, blocking (without the GIL) until its outcome.
    fn run(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, NativeBatch>,
        policy: &str,
        deadline: f64,
    ) -> PyResult<Report> {
        let (opts, (tasks, held)) = take(py, batch, policy, deadline)?;
        let r = py.detach(|| self.core.with(|e| e.run(tasks, opts)));
        match r {
            Ok(out) => {
                self.core.settle(py, &out, held);
                Ok(report(&out))
            }
            // Nothing started, or the engine stopped, after its runtime
            // reaped every operation: the memory is free to go.
            Err(e) => {
                held.into_iter().for_each(|h| h.release(py));
                Err(from_sync(py, &e))
            }
        }
    }

    /// Starts `batch` and returns at once; `callback(report)` runs on a
    /// delivery thread once it has an outcome (`callback(None)`: the engine
    /// closed first).
    fn submit(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, NativeBatch>,
        policy: &str,
        deadline: f64,
        callback: Py<PyAny>,
    ) -> PyResult<()> {
        let (opts, (tasks, held)) = take(py, batch, policy, deadline)?;
        // Used up, as by `run`, and nothing started: the buffers are the
        // caller's again.
        let tx = match self.deliveries(py) {
            Ok(tx) => tx,
            Err(e) => {
                held.into_iter().for_each(|h| h.release(py));
                return Err(e);
            }
        };
        let key = self.core.next.fetch_add(1, Ordering::Relaxed);
        lock(&self.core.flights).insert(key, Flight { held, callback });
        let r = py.detach(|| {
            self.core.with(|e| {
                e.submit_with(tasks, opts, move |out| {
                    let _ = tx.send((key, out));
                })
            })
        });
        if let Err(e) = r {
            // Nothing started. If the delivery thread took the flight first
            // (the engine closed meanwhile), it answers the callback: no
            // second answer here.
            let flight = lock(&self.core.flights).remove(&key);
            if let Some(f) = flight {
                f.held.into_iter().for_each(|h| h.release(py));
                return Err(from_sync(py, &e));
            }
        }
        Ok(())
    }

    /// Waits up to `timeout` s for the batch behind `ticket` to drain: its
    /// report, or None if it has not yet.
    fn wait(&self, py: Python<'_>, ticket: u64, timeout: f64) -> PyResult<Option<Report>> {
        self.core
            .wait(py, ticket, Instant::now() + seconds(timeout))
    }

    /// Tickets whose batches have not drained yet (those that did are
    /// settled now, their memory let go).
    fn pending(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.core.quiesce(py, Instant::now())
    }

    /// Waits up to `timeout` s for every submitted batch's outcome and
    /// every batch whose completion is unknown to drain, letting their
    /// memory go as each does; whether none is left.
    fn wait_for_quiescence(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        self.core.quiesce_all(py, Instant::now() + seconds(timeout))
    }

    /// Stops the engine (blocking calls finish first; batches in flight are
    /// cancelled and reaped). False: it could not drain, and the memory it
    /// held stays held for good.
    fn close(&self, py: Python<'_>) -> bool {
        self.core.close(py)
    }
}

impl NativeEngine {
    /// The delivery thread's sender, starting the thread with the first.
    fn deliveries(&self, py: Python<'_>) -> PyResult<mpsc::Sender<Delivery>> {
        // Without the GIL throughout: the engine's read lock may wait (a
        // `close` waiting to write holds new readers back), and a thread
        // holding the GIL must never wait for this mutex's holder.
        let r = py.detach(|| -> Result<mpsc::Sender<Delivery>, Option<String>> {
            let mut d = lock(&self.core.deliveries);
            if let Some(tx) = d.as_ref() {
                return Ok(tx.clone());
            }
            let engine = self.core.engine.read().unwrap_or_else(|e| e.into_inner());
            if engine.is_none() {
                return Err(None);
            }
            drop(engine);
            let (tx, rx) = mpsc::channel();
            let core = self.core.clone();
            std::thread::Builder::new()
                .name("quiesce-deliver".into())
                .spawn(move || core.deliver(rx))
                .map_err(|e| Some(e.to_string()))?;
            *d = Some(tx.clone());
            Ok(tx)
        });
        r.map_err(|e| match e {
            None => from_sync(py, &SyncError::Stopped),
            Some(e) => raise(py, "QuiesceError", &format!("delivery thread: {e}")),
        })
    }
}

impl Drop for NativeEngine {
    fn drop(&mut self) {
        // At interpreter shutdown there is no Python to release memory to:
        // the process is ending, and the engine's thread with it.
        Python::try_attach(|py| self.core.close(py));
    }
}
