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

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::{Duration, Instant};

use pyo3::prelude::*;
use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{SyncEngine, SyncError, SyncOutcome};
use quiesce_batch::{BatchOptions, FailurePolicy, RemoteState, TaskStatus};
use quiesce_directory::{check_name, Directory, DirectoryError, NodeRecord, SegmentRecord};
use quiesce_transports::rdma::RdmaConfig;
use quiesce_transports::{EngineConfig, Token};

use crate::node::{
    listen_addr, local_mode, lock, seconds, secret, spin, stale_entry, tcp_congestion,
};

pub(crate) mod batch;
mod engine_state;
pub(crate) mod error;
mod in_use;
mod pin;
mod tickets;

use batch::{Moves, NativeBatch};
use engine_state::{Core, Delivery, Ending, Flight, Lending, Release, Report, WAIT_SLICE};
use error::{from_sync, invalid, raise};
use in_use::InUse;
use pin::{Access, Held};
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
                in_use: Arc::default(),
                deliveries: Mutex::default(),
                ending: Mutex::new(Ending::Running),
                closing: Mutex::default(),
                next: AtomicU64::new(1),
                directory: RwLock::new(Some(directory)),
                node,
                names: Mutex::default(),
                lineage: quiesce_runtime::fork::Lineage::here(),
            }),
        })
    }

    /// Where peers connect ("ip:port").
    #[getter]
    fn address(&self, py: Python<'_>) -> PyResult<String> {
        self.not_forked(py)?;
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
        self.not_forked(py)?;
        // A name no directory holds (it would be lent and served, its
        // publication failing in a log line): refused before anything.
        check_name(name).map_err(|e| from_directory(py, &e))?;
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
                lock(&self.core.names).insert(id, name.to_string());
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
        self.not_forked(py)?;
        // The lending this takes back: once the engine let go of it, the
        // address may be lent again (by another thread) before the entries
        // below are removed, and those are not this call's to remove.
        let (lent, len) = match lock(&self.core.lent).get(&address) {
            Some(l) => (Some(l.segment), l.held.len as u64),
            None => (None, 0),
        };
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
        // This engine's own batches first: one that reads into the buffer
        // (or writes from it) can touch it after every peer let go, so the
        // engine's answer alone is not enough.
        if !self.own_batches_done(py, address, len, deadline) {
            return Ok(false);
        }
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
        // A batch of this engine that started on the buffer while the
        // engine took it back: the lending stays (a later call, finding it
        // taken back, waits for that batch first).
        let back = back && self.own_batches_done(py, address, len, deadline);
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
            let name = segment.and_then(|id| Some((id, lock(&self.core.names).remove(&id)?)));
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
        self.not_forked(py)?;
        let (addr, named) = py.detach(|| self.core.peer(peer)).map_err(|e| match e {
            // The directory goes with the engine's close.
            Some(DirectoryError::Closed) => self.core.engine_closed(py),
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
        self.not_forked(py)?;
        let (opts, (tasks, mut held)) = take(py, batch, policy, deadline)?;
        InUse::claim(&self.core.in_use, &mut held);
        let r = py.detach(|| self.core.with(|e| e.run(tasks, opts)));
        match r {
            Ok(out) => {
                self.core.settle(py, &out, held);
                let answer = report(&out);
                // Kept on the batch too: a KeyboardInterrupt raised as this
                // returns loses the value, and a -2's ticket is the only
                // handle on its pinned buffers. (Not borrowed now: `take`
                // emptied it, and `add` of a batch that ran returns at once.)
                if let Ok(mut b) = batch.try_borrow_mut() {
                    b.ran = Some(answer.clone());
                }
                Ok(answer)
            }
            // Cut off by a stop whose drain left operations live (not
            // reachable while `close` waits for the calls in flight): the
            // memory may still be touched, and is kept for good.
            Err(e @ SyncError::Undrained(_)) => {
                drop(held);
                Err(from_sync(py, &e))
            }
            // Nothing started, or the engine stopped, after its runtime
            // reaped every operation: the memory is free to go.
            Err(e) => {
                held.into_iter().for_each(|h| h.release(py));
                Err(from_sync(py, &e))
            }
        }
    }

    /// Starts `batch` and returns at once; `callback(report, False)` runs
    /// on a delivery thread once it has an outcome (`callback(None,
    /// held_for_good)`: the engine closed first).
    fn submit(
        &self,
        py: Python<'_>,
        batch: &Bound<'_, NativeBatch>,
        policy: &str,
        deadline: f64,
        callback: Py<PyAny>,
    ) -> PyResult<()> {
        self.not_forked(py)?;
        let (opts, (tasks, mut held)) = take(py, batch, policy, deadline)?;
        InUse::claim(&self.core.in_use, &mut held);
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
            self.core.with_now(|e| {
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
        self.not_forked(py)?;
        self.core
            .wait(py, ticket, Instant::now() + seconds(timeout))
    }

    /// Tickets whose batches have not drained yet (those that did are
    /// settled now, their memory let go).
    fn pending(&self, py: Python<'_>) -> PyResult<Vec<u64>> {
        self.not_forked(py)?;
        self.core.quiesce(py, Instant::now())
    }

    /// Waits up to `timeout` s for every submitted batch's outcome and
    /// every batch whose completion is unknown to drain, letting their
    /// memory go as each does; whether none is left.
    fn wait_for_quiescence(&self, py: Python<'_>, timeout: f64) -> PyResult<bool> {
        self.not_forked(py)?;
        self.core.quiesce_all(py, Instant::now() + seconds(timeout))
    }

    /// Stops the engine (blocking calls finish first; batches in flight are
    /// cancelled and reaped). False: it could not drain, and the memory it
    /// held stays held for good. In a forked child (whose copy of the
    /// engine has no thread: the parent's runs on) it returns False at
    /// once and takes nothing back.
    fn close(&self, py: Python<'_>) -> bool {
        self.core.close(py)
    }
}

impl NativeEngine {
    /// `Forked` in a forked child of the process the engine started in,
    /// asked before any lock: one a parent's thread held at the fork (the
    /// engine's, with a `close` waiting for it; a map's) is never released
    /// in the child, and the call parked on it for good.
    fn not_forked(&self, py: Python<'_>) -> PyResult<()> {
        match self.core.lineage.forked() {
            true => Err(from_sync(py, &SyncError::Forked)),
            false => Ok(()),
        }
    }

    /// Waits until no batch of this engine holds a byte of `address..+len`
    /// ([`InUse`]), settling meanwhile the tickets of batches of unknown
    /// completion that drained (their memory, and its claim, goes with
    /// them: else a revoke waited out its timeout until the caller
    /// collected them); false at `deadline`.
    fn own_batches_done(&self, py: Python<'_>, address: u64, len: u64, deadline: Instant) -> bool {
        loop {
            if !self.core.in_use.overlaps(address, len) {
                return true;
            }
            // (Errors only for a closed engine, whose close took them all.)
            let _ = self.core.quiesce(py, Instant::now());
            if !self.core.in_use.overlaps(address, len) {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            py.detach(|| std::thread::sleep(left.min(Duration::from_millis(1))));
        }
    }

    /// The delivery thread's sender, starting the thread with the first.
    fn deliveries(&self, py: Python<'_>) -> PyResult<mpsc::Sender<Delivery>> {
        // Without the GIL throughout: a thread holding the GIL must never
        // wait for this mutex's holder.
        let r = py.detach(|| -> Result<mpsc::Sender<Delivery>, Option<String>> {
            let mut d = lock(&self.core.deliveries);
            if let Some(tx) = d.as_ref() {
                return Ok(tx.clone());
            }
            // Whether the engine is open, without waiting behind a close
            // (submit runs on an asyncio loop's thread): one underway
            // counts as closed.
            if self.core.with_now(|_| Ok(())).is_err() {
                return Err(None);
            }
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
