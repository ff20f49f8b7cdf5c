//! What a native engine shares with its delivery thread and its tickets:
//! the sync engine, the Python memory held for batches in flight and for
//! those whose completion is unknown, lent segments, and how the engine
//! ended.

use std::collections::{HashMap, VecDeque};
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::AtomicU64;
use std::sync::{mpsc, Arc, Mutex, RwLock};
use std::time::Duration;

use pyo3::prelude::*;
use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{SyncEngine, SyncError, SyncOutcome};
use quiesce_batch::SYNC_UNKNOWN;
use quiesce_directory::{prefer_ipv4, Directory, DirectoryError};

use crate::node::lock;

use super::error;
use super::in_use::InUse;
use super::pin::Held;
use super::report;

/// What Python gets for an outcome: (code, [(status, reason, bytes,
/// attempts, remote)], remote_confirmed, ticket).
pub(super) type Report = (
    i32,
    Vec<(String, Option<String>, u64, u32, String)>,
    bool,
    Option<u64>,
);

/// An outcome on its way to the delivery thread.
pub(super) type Delivery = (u64, SyncOutcome<RawBuf>);

/// A submitted batch without a delivered outcome.
pub(super) struct Flight {
    pub(super) held: Vec<Held>,
    /// Called with the report (or `None`: the engine closed first).
    pub(super) callback: Py<PyAny>,
}

/// How the engine ended (set by `close`, read by the delivery thread).
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Ending {
    Running,
    /// Stopped after every operation was reaped: held memory may go.
    Drained,
    /// Stopped with operations maybe in flight: held memory is kept for good.
    Undrained,
}

pub(super) struct Core {
    /// `None` once closed.
    pub(super) engine: RwLock<Option<SyncEngine>>,
    pub(super) secret: Vec<u8>,
    pub(super) flights: Mutex<HashMap<u64, Flight>>,
    /// Memory of batches whose completion is unknown, by ticket.
    pub(super) tickets: Mutex<HashMap<u64, Vec<Held>>>,
    /// Outcomes of tickets drained by `wait_for_quiescence` or `pending`,
    /// for the `CompletionUnknown.wait` that asks later (oldest first, at
    /// most [`tickets::ANSWERS_KEPT`]).
    pub(super) answered: Mutex<VecDeque<(u64, Report)>>,
    /// Lent segments' memory, by address.
    pub(super) lent: Mutex<HashMap<u64, Lending>>,
    /// The memory this engine's batches hold now (a revoke waits for it).
    pub(super) in_use: Arc<InUse>,
    /// Where submitted batches' outcomes go (started with the first).
    pub(super) deliveries: Mutex<Option<mpsc::Sender<Delivery>>>,
    pub(super) ending: Mutex<Ending>,
    /// Held by the one `close` that stops the engine (a second waits for it).
    pub(super) closing: Mutex<()>,
    pub(super) next: AtomicU64,
    /// Where peers are found and this engine is published (P2P: nowhere);
    /// `None` once closed (dropping it takes the entries with it).
    pub(super) directory: RwLock<Option<Directory>>,
    /// This engine's node name in the directory.
    pub(super) node: String,
    /// Lent segments' names, by segment id (to withdraw them): by address,
    /// a lending of the address made while a revoke of the last one ended
    /// replaced its entry, and that revoke left its record published.
    pub(super) names: Mutex<HashMap<u64, String>>,
    /// The process the engine started in: a forked child's copy takes none
    /// of its locks to close (a parent's thread may have held one at the
    /// fork, and no thread of the child ever releases it).
    pub(super) lineage: quiesce_runtime::fork::Lineage,
}

/// How long one wait holds the engine's read lock (a `close` waits for it).
pub(super) const WAIT_SLICE: Duration = Duration::from_millis(100);

/// Held memory, one buffer or a batch's.
pub(super) trait Release {
    fn release(self, py: Python<'_>);
}

impl Release for Held {
    fn release(self, py: Python<'_>) {
        Held::release(self, py)
    }
}

/// A lent segment's memory, and which lending of its address it is.
pub(super) struct Lending {
    pub(super) segment: u64,
    pub(super) held: Held,
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

impl Core {
    /// Where `peer` listens: a literal `ip:port` as it is; else, with an
    /// etcd directory, the node it names there (and `true`: the node found
    /// there must be that node); else (or if the directory has no such
    /// node) the system resolver's `host:port`. `Err(None)`: it does not
    /// resolve.
    pub(super) fn peer(&self, peer: &str) -> Result<(SocketAddr, bool), Option<DirectoryError>> {
        if let Ok(a) = peer.parse::<SocketAddr>() {
            return Ok((a, false));
        }
        let by_system = || {
            let a = peer.to_socket_addrs().ok().and_then(prefer_ipv4);
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
    pub(super) fn directory<R>(
        &self,
        f: impl FnOnce(&Directory) -> Result<R, DirectoryError>,
    ) -> Result<R, DirectoryError> {
        let d = self.directory.read().unwrap_or_else(|e| e.into_inner());
        f(d.as_ref().ok_or(DirectoryError::Closed)?)
    }

    /// Whether the engine was closed, asked without the GIL: a close
    /// waiting for a blocking call holds the engine's lock's writer place,
    /// and a reader waits behind it.
    pub(super) fn closed(&self, py: Python<'_>) -> bool {
        py.detach(|| {
            self.engine
                .read()
                .unwrap_or_else(|e| e.into_inner())
                .is_none()
        })
    }

    /// `EngineClosed` for a call about memory the engine held (a ticket's,
    /// a lent range's): whether the close left it held for good.
    pub(super) fn engine_closed(&self, py: Python<'_>) -> PyErr {
        // After the close that stopped it has said how it ended (it holds
        // `closing` throughout; without the GIL, which it may wait for).
        let held = py.detach(|| {
            let _closed = lock(&self.closing);
            *lock(&self.ending) == Ending::Undrained
        });
        error::engine_closed(py, held)
    }

    /// Runs `f` on the engine, or says it is closed.
    pub(super) fn with<R>(
        &self,
        f: impl FnOnce(&SyncEngine) -> Result<R, SyncError>,
    ) -> Result<R, SyncError> {
        let engine = self.engine.read().unwrap_or_else(|e| e.into_inner());
        f(engine.as_ref().ok_or(SyncError::Stopped)?)
    }

    /// [`with`](Self::with) for a call that must not block (a submit from
    /// an asyncio loop's thread): a close underway, which holds the engine
    /// or waits for the blocking calls ahead of it (each up to its
    /// deadline), answers `Stopped` at once instead of making the caller
    /// wait behind those calls. Only a close takes the engine's write lock.
    pub(super) fn with_now<R>(
        &self,
        f: impl FnOnce(&SyncEngine) -> Result<R, SyncError>,
    ) -> Result<R, SyncError> {
        let engine = match self.engine.try_read() {
            Ok(engine) => engine,
            Err(std::sync::TryLockError::Poisoned(e)) => e.into_inner(),
            Err(std::sync::TryLockError::WouldBlock) => return Err(SyncError::Stopped),
        };
        f(engine.as_ref().ok_or(SyncError::Stopped)?)
    }

    /// Settles `held` by its batch's outcome: kept under the ticket for -2,
    /// released for 0 and -1. A -2 without a ticket (the engine gives every
    /// one a ticket) has nothing to say when it drains: its memory is kept
    /// for good, never released on a guess.
    pub(super) fn settle(&self, py: Python<'_>, out: &SyncOutcome<RawBuf>, held: Vec<Held>) {
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
    pub(super) fn keep<H: Release>(
        &self,
        py: Python<'_>,
        map: &Mutex<HashMap<u64, H>>,
        key: u64,
        held: H,
    ) {
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
    pub(super) fn deliver(self: Arc<Core>, rx: mpsc::Receiver<Delivery>) {
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
    pub(super) fn close(&self, py: Python<'_>) -> bool {
        if self.lineage.forked() {
            // The child's copies of what the engine held are left as they
            // are (the parent's engine never touches the child's memory).
            return false;
        }
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
