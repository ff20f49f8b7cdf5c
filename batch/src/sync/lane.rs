//! Caller lanes: a small sync batch runs on the calling thread.
//!
//! A [`SyncEngine`](super::SyncEngine) call hands its batch to the engine's
//! thread and waits for the answer: two cross-thread hand-offs per call,
//! and on a machine with few cores a third busy thread (the caller's spin)
//! beside the engine's and the peer's. For a 4 KiB write that is most of
//! the round trip. A **lane** is a runtime and an initiator-only engine of
//! the calling thread's own (made on its first small batch, kept in a
//! thread-local), on which small TCP batches run in place: the caller's
//! thread submits, spins on its own ring and reaps its own answer.
//!
//! A lane never lends the caller's memory to anything: a write's bytes are
//! copied into a buffer of the lane's before the batch starts, and a read
//! lands in one and is copied out when its task completed. The batch runs
//! on those copies under the whole contract (fences, deadline, remote
//! confirmation). So when the call returns, nothing can touch the caller's
//! buffers, whatever the batch's outcome: a batch whose own completion is
//! unknown (its fence did not finish in time) keeps only the lane's copies,
//! and the call answers -1 with the target unconfirmed — true for the
//! caller's memory, and honest about the target's — and each task as it
//! stood when the unknown was decided ([`Ticket::settled`](crate::Ticket::settled)):
//! a write that had completed is `Completed`, everything else `Fenced`
//! (a read's bytes never reach the caller's buffer then). Such a batch drains on the lane's runtime the next time that
//! thread runs a batch, or when the lane is dropped.
//!
//! Lanes take TCP batches of at most [`LANE_MAX_TASKS`] tasks and
//! [`LANE_MAX_BYTES`] bytes, from threads outside any quiesce runtime; a
//! lane opens its own connection to each peer (its own session at the
//! target) and proves the same token for the same segment, which must still
//! have the id the engine opened — anything else runs on the engine's
//! thread as before. A lane lives until its thread exits or, after its
//! engine stopped, until the thread's next lane call.

use std::cell::RefCell;
use std::mem::ManuallyDrop;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use quiesce_runtime::fork::Lineage;
use quiesce_runtime::{Handle, IoBuf, IoBufMut, Runtime, Slice};
use quiesce_transports::{Engine, EngineConfig, Token};
use smallvec::SmallVec;

use super::{Direction, SyncError, SyncOutcome, SyncTask, SyncTasks};
use crate::transport::Range;
use crate::{Batch, BatchOptions, Outcome, RemoteState, TaskReport, TaskStatus, Tcp};

mod open;

use self::open::LaneSegment;

/// Most tasks a lane takes in one batch.
pub const LANE_MAX_TASKS: usize = 16;
/// Most bytes (all tasks together) a lane takes in one batch: it copies
/// them, so past this the engine's zero-copy path is the cheaper one.
pub const LANE_MAX_BYTES: usize = 256 << 10;
/// Most lanes (calling threads) one engine has at once; calls from further
/// threads run on the engine's thread.
const MAX_LANES: usize = 64;
/// A lane whose last call began this long ago takes a reactor turn before
/// its next batch.
const AWAY: Duration = Duration::from_millis(1);
/// Spare copy buffers a lane keeps between calls, and the largest one it
/// keeps: at most 1 MiB of spares per lane (a 4 KiB batch reuses them; a
/// rare 256 KiB one allocates its copy).
const SPARE_BUFFERS: usize = 16;
const SPARE_MAX: usize = 64 << 10;

/// How a lane opens a segment the engine opened: the same peer, token and
/// name (or address), and it must be the same segment.
#[derive(Clone)]
pub(crate) struct LaneKey {
    pub(crate) peer: SocketAddr,
    /// The node the engine opened it at: a lane's own connection takes
    /// whichever node answers at `peer`, which may be another by now.
    pub(crate) node: String,
    pub(crate) token: Token,
    /// Opened by name; `None`: by the address of its first byte.
    pub(crate) name: Option<String>,
    /// The segment's id at the peer.
    pub(crate) id: u64,
    /// Its memory there (a restarted peer's segment may have its id, not
    /// its memory).
    pub(crate) base: u64,
    pub(crate) len: u64,
    /// The grant epoch of the engine's opening
    /// ([`RemoteSegment::grant_epoch`](quiesce_transports::RemoteSegment::grant_epoch)):
    /// a lane whose own opening is older opens the segment again, as the
    /// engine did after the target revoked a range of it (else the lane's
    /// writes into that range were refused for good).
    pub(crate) grant: u64,
}

/// What an engine shares with the lanes of the threads that call it.
pub(crate) struct Lanes {
    /// Tells this engine's lanes from other engines' in a thread's list.
    id: u64,
    /// The engine's settings (TCP), for the lanes' initiator engines.
    config: Option<EngineConfig>,
    spin: Duration,
    /// By segment handle: how a lane opens it (`None`: not on TCP).
    pub(crate) keys: Mutex<Vec<Option<LaneKey>>>,
    /// Counts the keys recorded with a newer grant than the one before:
    /// a lane that has not seen the count looks for openings to renew.
    regrants: AtomicU64,
    /// Set when lanes may take batches (see `SyncEngine::caller_lanes`).
    on: AtomicBool,
    /// Set once the engine stopped: its lanes are dropped.
    stopped: Arc<AtomicBool>,
    /// Lanes alive now.
    live: Arc<AtomicUsize>,
}

static NEXT_ENGINE: AtomicUsize = AtomicUsize::new(1);

thread_local! {
    /// This thread's lanes, one per engine it ran small batches on.
    static LANES: RefCell<Vec<Lane>> = const { RefCell::new(Vec::new()) };
}

impl Lanes {
    /// Lanes for an engine with these TCP settings (`None`: another fabric,
    /// no lanes).
    pub(crate) fn new(config: Option<EngineConfig>, spin: Duration) -> Lanes {
        let on =
            config.is_some() && std::env::var("QUIESCE_CALLER_LANES").map_or(true, |v| v != "0");
        Lanes {
            id: NEXT_ENGINE.fetch_add(1, Ordering::Relaxed) as u64,
            config,
            spin,
            keys: Mutex::default(),
            regrants: AtomicU64::new(0),
            on: AtomicBool::new(on),
            stopped: Arc::default(),
            live: Arc::default(),
        }
    }

    /// Turns lanes on or off (never on for a fabric other than TCP).
    pub(crate) fn set(&self, on: bool) {
        self.on
            .store(on && self.config.is_some(), Ordering::Relaxed);
    }

    /// Records how lanes open segment handle `handle`.
    pub(crate) fn record(&self, handle: u32, key: Option<LaneKey>) {
        let mut keys = self.keys.lock().unwrap_or_else(|e| e.into_inner());
        let h = handle as usize;
        if keys.len() <= h {
            keys.resize(h + 1, None);
        }
        let older = |k: &LaneKey| keys[h].as_ref().is_some_and(|o| o.grant < k.grant);
        if key.as_ref().is_some_and(older) {
            self.regrants.fetch_add(1, Ordering::Release);
        }
        keys[h] = key;
    }

    /// The engine stops: its lanes go (this thread's now, unless it is
    /// inside a runtime, which cannot drive a lane's; others' at their
    /// thread's next lane call).
    pub(crate) fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
        if Handle::try_current().is_some() {
            return;
        }
        let _ = LANES.try_with(|l| {
            if let Ok(mut l) = l.try_borrow_mut() {
                l.retain(|lane| !lane.stopped.load(Ordering::Acquire));
            }
        });
    }

    /// Runs `tasks` on this thread's lane if they qualify; gives them back
    /// untouched if they must run on the engine's thread, with the options
    /// to run them with there (the deadline less the time the lane took to
    /// find out it cannot open a segment).
    pub(crate) fn run<B: IoBufMut>(
        &self,
        tasks: SyncTasks<B>,
        opts: BatchOptions,
    ) -> Result<Result<SyncOutcome<B>, SyncError>, Fallback<B>> {
        if !self.on.load(Ordering::Relaxed) || !qualifies(&tasks) {
            return Err((tasks, opts));
        }
        // Inside a runtime the thread is that runtime's: no second one here.
        // (Asked first, so the runtime's thread-locals outlive the lanes'.)
        if Handle::try_current().is_some() {
            return Err((tasks, opts));
        }
        // A thread that is exiting has no lanes any more.
        if LANES.try_with(|_| ()).is_err() {
            return Err((tasks, opts));
        }
        LANES.with(|lanes| {
            let Ok(mut lanes) = lanes.try_borrow_mut() else {
                return Err((tasks, opts));
            };
            lanes.retain(|l| !l.stopped.load(Ordering::Acquire));
            // A stopped engine's batches go to its thread, which answers
            // `Stopped`: no new lane for them (its old one went just now).
            if self.stopped.load(Ordering::Acquire) {
                return Err((tasks, opts));
            }
            let at = match lanes.iter().position(|l| l.engine == self.id) {
                Some(i) => i,
                None => match self.lane() {
                    Some(l) => {
                        lanes.push(l);
                        lanes.len() - 1
                    }
                    None => return Err((tasks, opts)),
                },
            };
            let regrants = self.regrants.load(Ordering::Acquire);
            lanes[at].run(tasks, &self.keys, regrants, opts)
        })
    }

    /// A new lane for this engine on this thread, unless it has enough.
    fn lane(&self) -> Option<Lane> {
        let config = self.config.clone()?;
        if self.live.fetch_add(1, Ordering::AcqRel) >= MAX_LANES {
            self.live.fetch_sub(1, Ordering::AcqRel);
            return None;
        }
        let live = LiveLane(self.live.clone());
        let rt = match Runtime::builder().entries(64).spin(self.spin).build() {
            Ok(rt) => rt,
            Err(e) => {
                tracing::warn!(error = %e, "no caller lane: its runtime could not start");
                return None;
            }
        };
        let config = EngineConfig {
            connections_per_peer: 1,
            ..config
        };
        let engine = match rt.block_on(async { Engine::initiator(config) }) {
            Ok(e) => e,
            Err(e) => {
                tracing::warn!(error = %e, "no caller lane: its engine could not start");
                return None;
            }
        };
        Some(Lane {
            engine: self.id,
            stopped: self.stopped.clone(),
            net: Some(engine),
            opened: Vec::new(),
            spare: Vec::new(),
            away_at: Instant::now() + AWAY,
            rt: ManuallyDrop::new(rt),
            lineage: Lineage::here(),
            _live: live,
            regrants_seen: self.regrants.load(Ordering::Acquire),
        })
    }
}

/// A batch a lane gives back to the engine's thread, with its options.
pub(crate) type Fallback<B> = (SyncTasks<B>, BatchOptions);

/// Small enough for a lane, and every write's bytes initialised.
fn qualifies<B: IoBufMut>(tasks: &[(Direction, SyncTask<B>)]) -> bool {
    let mut bytes = 0usize;
    tasks.len() <= LANE_MAX_TASKS
        && tasks.iter().all(|(dir, t)| {
            let n = t.buf.bytes_total();
            bytes = bytes.saturating_add(n);
            n > 0 && (*dir == Direction::Read || t.buf.bytes_init() == n)
        })
        && bytes <= LANE_MAX_BYTES
}

/// Counts a lane as alive until it is dropped.
struct LiveLane(Arc<AtomicUsize>);

impl Drop for LiveLane {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}

/// One thread's runtime and initiator for one engine's small batches.
struct Lane {
    /// The engine's id ([`Lanes::id`]).
    engine: u64,
    stopped: Arc<AtomicBool>,
    /// The lane's initiator; `None` only while dropping.
    net: Option<Engine>,
    /// What this lane knows of each of the engine's handles, by handle
    /// (the engine numbers them densely from 0, as `Lanes::keys` does).
    opened: Vec<Option<LaneSegment>>,
    /// Copy buffers kept for the next call.
    spare: Vec<Vec<u8>>,
    /// From when a call counts as the first after the thread was away:
    /// [`AWAY`] after the last call began (its clock reading, reused).
    away_at: Instant,
    /// Dropped after the engine, and never in a forked child (see `Drop`).
    rt: ManuallyDrop<Runtime>,
    /// The process the lane was made in.
    lineage: Lineage,
    _live: LiveLane,
    /// [`Lanes::regrants`] when this lane last looked for older openings.
    regrants_seen: u64,
}

/// A task's copy, and where its bytes go back to.
type Copied = Slice<Vec<u8>>;

impl Lane {
    fn run<B: IoBufMut>(
        &mut self,
        tasks: SyncTasks<B>,
        keys: &Mutex<Vec<Option<LaneKey>>>,
        regrants: u64,
        opts: BatchOptions,
    ) -> Result<Result<SyncOutcome<B>, SyncError>, Fallback<B>> {
        if regrants != self.regrants_seen {
            self.regrants_seen = regrants;
            self.forget_older_openings(keys);
        }
        // The call's one clock reading: whether the thread was away, and
        // when the batch counts as submitted (unless opening took time).
        let now = Instant::now();
        let (segs, spent) = self.segments(&tasks, keys, opts.deadline, now);
        // What the lane spent opening counts against the deadline, here or
        // on the engine's thread.
        let opts = BatchOptions {
            deadline: opts.deadline.map(|d| d.saturating_sub(spent)),
            ..opts
        };
        let Some(segs) = segs else {
            return Err((tasks, opts));
        };
        let mut batch = Batch::new(Tcp, opts);
        if spent.is_zero() {
            batch.started_at(now);
        }
        let mut dirs: SmallVec<[Direction; 4]> = SmallVec::with_capacity(tasks.len());
        let mut originals: SmallVec<[B; 1]> = SmallVec::with_capacity(tasks.len());
        for ((dir, t), seg) in tasks.into_iter().zip(&segs) {
            let n = t.buf.bytes_total();
            let mut copy = self.spare.pop().unwrap_or_default();
            copy.clear();
            let range = Range::new(seg, t.offset, n as u64);
            let added = match dir {
                Direction::Write => {
                    // All `n` bytes are initialised (`qualifies`), and nothing
                    // else reaches the buffer while this call holds it.
                    // SAFETY: `IoBuf` promises `bytes_init()` initialised bytes at `stable_ptr()`.
                    let src = unsafe { std::slice::from_raw_parts(t.buf.stable_ptr(), n) };
                    copy.extend_from_slice(src);
                    batch.write(copy.slice(0..n), range)
                }
                Direction::Read => {
                    copy.reserve(n);
                    batch.read(copy.slice(0..n), range)
                }
            };
            if let Err(r) = added {
                // Nothing started; the engine's thread refuses it alike.
                return Ok(Err(SyncError::Batch(r.reason)));
            }
            dirs.push(dir);
            originals.push(t.buf);
        }
        // Submitting starts the transfers: inside the lane's runtime.
        let outcome = self.rt.block_on(async move { batch.submit().await });
        if !matches!(&outcome, Outcome::Quiesced(q) if q.all_completed()) {
            // A fenced batch left work queued (its forget): one more turn
            // sends it now, not at the thread's next call or its exit.
            self.rt.block_on(quiesce_runtime::yield_now());
        }
        self.away_at = now + AWAY;
        Ok(Ok(match outcome {
            Outcome::Quiesced(q) => {
                let code = q.sync_code();
                let remote_confirmed = q.remote_confirmed();
                let (mut tasks, copies) = q.into_inline_parts();
                for (((dir, report), copy), orig) in dirs
                    .iter()
                    .zip(&mut tasks)
                    .zip(&copies)
                    .zip(originals.iter_mut())
                {
                    match (dir, &report.status) {
                        (Direction::Read, TaskStatus::Completed) => copy_out(copy, orig),
                        // Not copied out: none of its bytes reached the
                        // caller's buffer.
                        (Direction::Read, _) => report.bytes = 0,
                        (Direction::Write, _) => {}
                    }
                }
                self.keep_spares(copies);
                SyncOutcome {
                    code,
                    buffers: Some(originals),
                    tasks,
                    ticket: None,
                    remote_confirmed,
                }
            }
            Outcome::CompletionUnknown(ticket) => {
                // Only the copies are held: the batch drains on this lane
                // later; the caller's buffers were never lent. Each task is
                // reported as it stood then: a write that had completed did,
                // and the rest are fenced — a read's bytes, even complete,
                // stay in the copy the ticket keeps.
                let tasks = dirs
                    .iter()
                    .zip(ticket.settled())
                    .map(|(dir, settled)| match (dir, settled) {
                        (Direction::Write, Some(report)) => report,
                        (Direction::Read, Some(report))
                            if report.status != TaskStatus::Completed =>
                        {
                            TaskReport { bytes: 0, ..report }
                        }
                        (_, Some(report)) => TaskReport {
                            status: TaskStatus::Fenced,
                            bytes: 0,
                            ..report
                        },
                        (_, None) => TaskReport {
                            status: TaskStatus::Fenced,
                            bytes: 0,
                            attempts: 1,
                            remote: RemoteState::Unconfirmed,
                        },
                    })
                    .collect();
                drop(ticket);
                SyncOutcome {
                    code: crate::SYNC_FAILED,
                    buffers: Some(originals),
                    tasks,
                    ticket: None,
                    remote_confirmed: false,
                }
            }
        }))
    }

    fn keep_spares(&mut self, copies: impl IntoIterator<Item = Copied>) {
        for c in copies {
            let c = c.into_inner();
            if self.spare.len() < SPARE_BUFFERS && c.capacity() <= SPARE_MAX {
                self.spare.push(c);
            }
        }
    }
}

/// Copies a completed read's bytes into the caller's buffer.
fn copy_out<B: IoBufMut>(copy: &Copied, to: &mut B) {
    let n = copy.bytes_init().min(to.bytes_total());
    // The copy holds `n` initialised bytes at its `stable_ptr`; `to` is held
    // by this call alone, and the two never overlap (the copy is the lane's).
    // SAFETY: `to` promises `bytes_total()` (>= n) writable bytes at `stable_mut_ptr`.
    unsafe {
        std::ptr::copy_nonoverlapping(copy.stable_ptr(), to.stable_mut_ptr(), n);
        to.set_init(n);
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        let net = self.net.take();
        if self.lineage.forked() {
            // A forked child's copy of its parent's lane (its thread's
            // destructors run at the child's exit): the sockets and the
            // io_uring ring are the parent's too. Closing the peers would
            // shut the parent's connections, and dropping the runtime would
            // drain the parent's ring: all left as they are.
            std::mem::forget(net);
            std::mem::forget(std::mem::take(&mut self.opened));
            return;
        }
        // Closing the peers needs the runtime; a thread whose runtime
        // thread-locals are gone leaks the lot (the runtime says so), which
        // holds only the lane's own copies.
        // The segments first, with the peers they hold, on the runtime.
        let opened = std::mem::take(&mut self.opened);
        if quiesce_runtime::thread_alive() {
            self.rt.block_on(async move {
                drop(opened);
                drop(net)
            });
        } else {
            std::mem::forget((opened, net));
        }
        // Nothing uses the lane once it is being dropped.
        // SAFETY: dropped once, here, after the engine that ran on it.
        unsafe { ManuallyDrop::drop(&mut self.rt) };
    }
}
