//! Blocking use from code that has no async runtime: a [`SyncEngine`] runs a
//! runtime and a transfer engine on its own thread; calls block until the
//! batch has an outcome and return the C-compatible code. Small TCP batches
//! run on a *lane* of the calling thread instead (its own runtime and
//! connections, on copies of the caller's bytes: see the `lane` module and
//! [`SyncEngine::caller_lanes`]), which spares them two thread hand-offs.
//!
//! | code | meaning | the buffers |
//! |---:|---|---|
//! | 0 | every task completed | back with the caller |
//! | -1 | the batch failed | back with the caller; nothing touches them |
//! | -2 | completion unknown | still held: do not free or reuse; wait or poll the ticket |
//!
//! The code speaks of the caller's memory. Whether the *targets* confirmed
//! that nothing more of a failed batch lands is
//! [`SyncOutcome::remote_confirmed`]: a -1 write whose targets did not
//! confirm may still deliver bytes into the target ranges (revoke them at
//! the target, or fence again, before trusting them); a -1 read is safe
//! either way, its destination being the caller's buffer.
//!
//! Errors before anything starts are [`SyncError`]s (the C ABI: -3 for an
//! unknown handle or ticket, -1 otherwise). A panic in the engine while a
//! call waits for its batch aborts the process rather than answer (tested:
//! `batch/tests/sync_api.rs`, a destination whose `set_init` panics); one in
//! a batch whose -2 ticket is out is caught and leaves that ticket at -2,
//! its memory pinned, until the engine stops (then -1 if the stop's drain
//! reaped every operation: [`SyncEngine::poll`]) — never a 0 or -1 on a
//! guess.

use std::any::Any;
use std::cell::RefCell;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::rc::Rc;
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use quiesce_runtime::fork::Lineage;
use quiesce_runtime::shard::{channel, Sender};
use quiesce_runtime::{spawn_local, IoBufMut, Runtime};
use quiesce_transports::rdma::RdmaConfig;
use quiesce_transports::{Engine, EngineConfig, Token, TransferError};
use smallvec::SmallVec;

use crate::{BatchOptions, TaskReport};

mod call;
mod end;
mod fabric;
mod host;
mod lane;
mod memory;
mod tickets;

use call::{launch, recv_spinning};
use end::ThreadEnd;
use fabric::{Fabric, Lent, Opened, SegmentBy, Setup};
use lane::{LaneKey, Lanes};

pub use lane::{LANE_MAX_BYTES, LANE_MAX_TASKS};

pub(crate) use call::AbortOnUnwind;
pub use call::DEFAULT_SPIN;
pub use host::{HostRanges, MemoryAccess};
pub use memory::OpenedSegment;

/// Which direction a sync batch moves data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    /// Local buffers → remote segments.
    Write,
    /// Remote segments → local buffers.
    Read,
}

/// One task of a sync batch: a buffer and where it goes (or comes from).
#[derive(Debug)]
pub struct SyncTask<B> {
    /// A handle from [`SyncEngine::open`].
    pub segment: u32,
    /// Offset in the segment.
    pub offset: u64,
    /// The buffer; its whole length moves.
    pub buf: B,
}

/// The tasks of a sync batch, each with its direction: inline for one task
/// (a `Vec` converts with `.into()`), so a one-task call allocates nothing
/// for them.
pub type SyncTasks<B> = SmallVec<[(Direction, SyncTask<B>); 1]>;

/// The result of a sync call.
#[derive(Debug)]
pub struct SyncOutcome<B> {
    /// 0, -1 or -2.
    pub code: i32,
    /// The buffers (task order) for 0 and -1; `None` for -2, and for a
    /// ticket answered after the engine stopped ([`SyncEngine::poll`]).
    /// Inline for one task, as are the reports.
    pub buffers: Option<SmallVec<[B; 1]>>,
    /// Per-task reports for 0 and -1 (none for a ticket answered after the
    /// engine stopped).
    pub tasks: SmallVec<[TaskReport; 1]>,
    /// For -2: wait on or poll this id.
    pub ticket: Option<u64>,
    /// For 0 and -1: whether every target confirmed that nothing more of the
    /// batch lands ([`Quiesced::remote_confirmed`](crate::Quiesced::remote_confirmed)). The code is about the
    /// caller's memory; this is about the targets'.
    pub remote_confirmed: bool,
}

type Job = Box<dyn FnOnce(&State) + Send>;

/// The handle of each segment opened, by what makes two openings the same
/// segment (the peer's address and node name — another node may answer
/// there later —, the segment's id there, its base and its length), for
/// each token it was opened with.
type Handles = HashMap<(SocketAddr, String, u64, u64, u64), Vec<(Token, u32)>>;

/// What the engine thread keeps. Shared with the tasks it spawns.
#[derive(Clone)]
struct State {
    /// The TCP engine (on RDMA, the control plane's).
    engine: Engine,
    fabric: Fabric,
    segments: Rc<RefCell<Vec<Opened>>>,
    /// The handle of each segment opened so far, by what makes it the same
    /// segment: its peer, its id there and its extent (a peer that restarts
    /// numbers its segments anew), and the token it was opened with.
    handles: Rc<RefCell<Handles>>,
    /// Caller memory lent as segments ([`SyncEngine::lend`]), by address.
    lent: Rc<RefCell<HashMap<u64, Lent>>>,
    /// Tickets of batches whose completion is unknown, by id.
    tickets: Rc<RefCell<HashMap<u64, Box<dyn Any>>>>,
    /// Shared with the callers' lanes: how they open each handle.
    lanes: Arc<Lanes>,
}

impl State {
    /// Keeps a segment opened at `peer` with `token` (by `name`, or by
    /// address); batches name it by the returned handle. A segment opened
    /// before keeps its handle (the fresh opening replaces the old one), so
    /// opening again after a failure, or on every
    /// `get_first_buffer_address`, does not grow the table.
    fn keep(
        &self,
        seg: Opened,
        peer: SocketAddr,
        token: Token,
        name: Option<String>,
    ) -> OpenedSegment {
        let (base, len) = seg.extent();
        let id = match &seg {
            Opened::Tcp(s) => s.id(),
            Opened::Rdma(s) => s.id(),
        };
        let node = seg.node().to_string();
        let key = match &seg {
            Opened::Tcp(s) => Some(LaneKey {
                peer,
                node: node.clone(),
                token,
                name,
                id,
                base,
                len,
                grant: s.grant_epoch(),
            }),
            Opened::Rdma(_) => None,
        };
        let mut segs = self.segments.borrow_mut();
        let mut handles = self.handles.borrow_mut();
        let same = handles.entry((peer, node, id, base, len)).or_default();
        let segment = match same.iter().find(|(t, _)| *t == token) {
            Some(&(_, h)) => {
                segs[h as usize] = seg;
                h
            }
            None => {
                segs.push(seg);
                let h = segs.len() as u32 - 1;
                same.push((token, h));
                h
            }
        };
        self.lanes.record(segment, key);
        OpenedSegment { segment, base, len }
    }
}

/// A transfer engine on its own thread, for blocking callers.
pub struct SyncEngine {
    jobs: Option<Sender<Job>>,
    /// Where the engine listens.
    addr: SocketAddr,
    /// How long a caller spins for an answer before it sleeps.
    spin: Duration,
    /// Each lent range (by address) and where it stands.
    released: std::sync::Mutex<HashMap<u64, memory::Lending>>,
    /// The engine's thread.
    thread: Option<thread::JoinHandle<()>>,
    /// A stop from any thread, and the thread's record of how its
    /// runtime's shutdown went (ops still live after it).
    end: Arc<ThreadEnd>,
    /// Small batches run on their callers' threads ([`lane`]).
    lanes: Arc<Lanes>,
    /// The process it started in: a forked child has not its thread.
    lineage: Lineage,
}

/// Errors of the sync API that happen before any transfer starts.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SyncError {
    /// The engine's thread is gone.
    #[error("the engine has stopped")]
    Stopped,
    /// No segment was opened under this handle.
    #[error("unknown segment handle {0}")]
    UnknownSegment(u32),
    /// No ticket has this id (or it was already collected).
    #[error("unknown ticket {0}")]
    UnknownTicket(u64),
    /// A transport error (connecting, opening).
    #[error(transparent)]
    Transfer(#[from] TransferError),
    /// The batch rejected a task.
    #[error(transparent)]
    Batch(#[from] crate::BatchError),
    /// Setting up the engine failed.
    #[error("engine set-up failed: {0}")]
    Setup(String),
    /// Stopping the engine left operations in flight after the drain
    /// (`usize::MAX`: unknown): memory lent to it must never be freed.
    #[error("{0} operations still in flight after the engine stopped")]
    Undrained(usize),
    /// No memory was lent at this address.
    #[error("no memory lent at {0:#x}")]
    NotLent(u64),
    /// The range is not memory this process may read and write (device
    /// memory — a CUDA pointer is a reserved, inaccessible range here —,
    /// read-only memory, or a range past its mapping): lent, it would crash
    /// this process or the peers' writes would fail in it.
    #[error(
        "{addr:#x}..+{len} is not memory this process can read and write \
         (device memory? quiesce moves host memory)"
    )]
    NotHostMemory {
        /// The range's start.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// The address is lent already, or not yet reclaimed to the end.
    #[error("memory at {0:#x} is lent already (or not yet reclaimed)")]
    StillLent(u64),
    /// This process is a fork of the one the engine started in, whose
    /// thread (and io_uring rings) are not this process's to use: nothing
    /// started. Start an engine in this process.
    #[error("the engine belongs to the process this one was forked from; start a new one here")]
    Forked,
    /// The engine refused to register the memory.
    #[error(transparent)]
    Register(#[from] quiesce_transports::RegisterError),
    /// A revoke of the lent range did not resolve (see
    /// [`RevokeError`](quiesce_transports::RevokeError)).
    #[error(transparent)]
    Revoke(#[from] quiesce_transports::RevokeError),
}

impl SyncEngine {
    /// Starts the engine thread, spinning [`DEFAULT_SPIN`] before it or a
    /// caller blocks.
    pub fn start(cfg: EngineConfig) -> Result<SyncEngine, SyncError> {
        SyncEngine::start_spinning(cfg, DEFAULT_SPIN)
    }

    /// Starts the engine thread. `spin`: how long the engine's reactor
    /// busy-polls before it blocks ([`Builder::spin`]), and a caller waiting
    /// for an answer before it sleeps; zero never spins.
    ///
    /// [`Builder::spin`]: quiesce_runtime::Builder::spin
    pub fn start_spinning(cfg: EngineConfig, spin: Duration) -> Result<SyncEngine, SyncError> {
        SyncEngine::start_on(Setup::Tcp(cfg), spin)
    }

    /// Starts the engine thread on RDMA verbs (`cfg.device`, or the first
    /// device with an active port), spinning as
    /// [`start_spinning`](Self::start_spinning) does. Peers are reached and
    /// segments served over RDMA (the control plane on TCP); buffers of its
    /// batches must lie in memory lent to it ([`lend`](Self::lend)), which
    /// it registers with the device — others fail their task
    /// (`TransferError::Unregistered`) before anything is posted.
    pub fn start_rdma(cfg: RdmaConfig, spin: Duration) -> Result<SyncEngine, SyncError> {
        SyncEngine::start_on(Setup::Rdma(cfg), spin)
    }

    fn start_on(setup: Setup, spin: Duration) -> Result<SyncEngine, SyncError> {
        let lanes = Arc::new(Lanes::new(setup.tcp_config(), spin));
        let lanes_st = lanes.clone();
        let end = Arc::new(ThreadEnd::default());
        let end_st = end.clone();
        let (jobs, mut rx) = channel::<Job>();
        let (ready_tx, ready_rx) = mpsc::channel();
        let thread = thread::Builder::new()
            .name("quiesce-sync".into())
            .spawn(move || {
                let rt = match Runtime::builder().spin(spin).build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e.to_string()));
                        end_st.record(0);
                        return;
                    }
                };
                let end_loop = end_st.clone();
                let drained = rt.block_on(async move {
                    let (engine, fabric) = match setup.bind() {
                        Ok(e) => e,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return true;
                        }
                    };
                    let _ = ready_tx.send(Ok(engine.local_addr()));
                    let st = State {
                        engine,
                        fabric,
                        segments: Rc::default(),
                        handles: Rc::default(),
                        lent: Rc::default(),
                        tickets: Rc::default(),
                        lanes: lanes_st,
                    };
                    // A job's sender wakes this runtime from the caller's thread.
                    while let Some(job) = rx.recv().await {
                        job(&st);
                        if end_loop.stopping() {
                            break;
                        }
                    }
                    end_loop.orphan(st.tickets.borrow().keys().copied().collect());
                    st.fabric.shutdown(&st.engine)
                });
                // Batches still in flight are dropped with their tasks: every
                // op on caller memory is cancelled and reaped here.
                let live = match rt.shutdown() {
                    Err(u) => u.live,
                    // RDMA requests still posted: how many is not known.
                    Ok(()) if !drained => usize::MAX,
                    Ok(()) => 0,
                };
                end_st.record(live);
            })
            .map_err(|e| SyncError::Setup(e.to_string()))?;
        match ready_rx.recv() {
            Ok(Ok(addr)) => Ok(SyncEngine {
                jobs: Some(jobs),
                addr,
                spin,
                released: Default::default(),
                thread: Some(thread),
                end,
                lanes,
                lineage: Lineage::here(),
            }),
            Ok(Err(e)) => Err(SyncError::Setup(e)),
            Err(_) => Err(SyncError::Stopped),
        }
    }

    /// `Forked` in a forked child of the process the engine started in.
    /// Checked before any lock: one that a parent's thread held at the
    /// fork stays held in the child for good.
    pub fn not_forked(&self) -> Result<(), SyncError> {
        match self.lineage.forked() {
            true => Err(SyncError::Forked),
            false => Ok(()),
        }
    }

    /// Runs `f` on the engine thread; it answers through the sender (maybe
    /// later, from a task it spawns). Blocks until it does.
    fn call<R: Send + 'static>(
        &self,
        f: impl FnOnce(&State, mpsc::Sender<R>) + Send + 'static,
    ) -> Result<R, SyncError> {
        self.not_forked()?;
        let (tx, rx) = mpsc::channel();
        let jobs = self.jobs.as_ref().ok_or(SyncError::Stopped)?;
        jobs.send(Box::new(move |st: &State| f(st, tx)))
            .map_err(|_| SyncError::Stopped)?;
        recv_spinning(&rx, self.spin, || self.finished()).ok_or(SyncError::Stopped)
    }

    /// Whether the engine's thread has ended.
    fn finished(&self) -> bool {
        self.thread.as_ref().is_none_or(|t| t.is_finished())
    }

    /// Connects to `addr` and proves `token` for segment `name`; returns a handle.
    pub fn open(&self, addr: SocketAddr, name: &str, token: Token) -> Result<u32, SyncError> {
        self.open_named(addr, name, token).map(|s| s.segment)
    }

    /// Like [`open`](Self::open), and says where the segment lies in the
    /// peer's memory and how long it is.
    pub fn open_named(
        &self,
        addr: SocketAddr,
        name: &str,
        token: Token,
    ) -> Result<OpenedSegment, SyncError> {
        let name = name.to_string();
        self.call(move |st, tx| {
            let st = st.clone();
            spawn_local(async move {
                let by = SegmentBy::Name(name.clone());
                let r = async {
                    let seg = st.fabric.open(&st.engine, addr, by, token).await?;
                    Ok(st.keep(seg, addr, token, Some(name)))
                };
                let _ = tx.send(r.await);
            });
        })?
    }

    /// Lets small TCP batches of [`run`](Self::run) and
    /// [`batch`](Self::batch) run on the calling thread (on by default;
    /// `QUIESCE_CALLER_LANES=0` turns it off for every engine). See the
    /// `lane` module: a lane copies the caller's bytes, so nothing but the
    /// call itself ever touches the caller's buffers.
    pub fn caller_lanes(&self, on: bool) {
        self.lanes.set(on);
    }

    /// Runs a batch of `dir` tasks and blocks until its outcome.
    pub fn batch<B: IoBufMut + Send>(
        &self,
        dir: Direction,
        tasks: impl IntoIterator<Item = SyncTask<B>>,
        opts: BatchOptions,
    ) -> Result<SyncOutcome<B>, SyncError> {
        self.run(
            tasks
                .into_iter()
                .map(|t| (dir, t))
                .collect::<SyncTasks<B>>(),
            opts,
        )
    }

    /// Runs a batch whose tasks each move their own way, and blocks until
    /// its outcome.
    pub fn run<B: IoBufMut + Send>(
        &self,
        tasks: impl Into<SyncTasks<B>>,
        opts: BatchOptions,
    ) -> Result<SyncOutcome<B>, SyncError> {
        // (A lane's rings are shared with the parent too.)
        self.not_forked()?;
        let (tasks, opts) = match self.lanes.run(tasks.into(), opts) {
            Ok(answer) => return answer,
            Err(back) => back,
        };
        let called = Instant::now();
        let answer = self.call(move |st, tx| {
            let reply = tx.clone();
            if let Err(e) = launch(st, tasks, opts, called, move |out| {
                let _ = reply.send(Ok(out));
            }) {
                let _ = tx.send(Err(e));
            }
        });
        match answer {
            // Cut off by the engine's end: its batch, if it started, was
            // dropped with its task, and is reaped only by the drain.
            Err(SyncError::Stopped) => Err(self.end.cut_off(|| self.finished())),
            other => other?,
        }
    }

    /// Starts a batch of `dir` tasks and returns at once; its outcome comes
    /// on the returned channel once it has one (0 or -1 with the buffers,
    /// or -2 with a ticket for [`wait`](Self::wait)). A task the batch
    /// rejects fails the call, and nothing starts.
    pub fn submit<B: IoBufMut + Send>(
        &self,
        dir: Direction,
        tasks: impl IntoIterator<Item = SyncTask<B>>,
        opts: BatchOptions,
    ) -> Result<mpsc::Receiver<SyncOutcome<B>>, SyncError> {
        self.submit_each(
            tasks
                .into_iter()
                .map(|t| (dir, t))
                .collect::<SyncTasks<B>>(),
            opts,
        )
    }

    /// [`submit`](Self::submit) of a batch whose tasks each move their own
    /// way.
    pub fn submit_each<B: IoBufMut + Send>(
        &self,
        tasks: impl Into<SyncTasks<B>>,
        opts: BatchOptions,
    ) -> Result<mpsc::Receiver<SyncOutcome<B>>, SyncError> {
        let (out_tx, out_rx) = mpsc::channel();
        self.submit_with(tasks, opts, move |out| {
            let _ = out_tx.send(out);
        })?;
        Ok(out_rx)
    }

    /// Starts a batch whose tasks each move their own way and returns at
    /// once; `done` gets its outcome, on the engine's thread (so it must
    /// only hand it on, never block). A task the batch rejects fails the
    /// call, nothing starts, and `done` is dropped uncalled.
    pub fn submit_with<B: IoBufMut + Send>(
        &self,
        tasks: impl Into<SyncTasks<B>>,
        opts: BatchOptions,
        done: impl FnOnce(SyncOutcome<B>) + Send + 'static,
    ) -> Result<(), SyncError> {
        let tasks = tasks.into();
        let called = Instant::now();
        self.call(move |st, tx| {
            let _ = tx.send(launch(st, tasks, opts, called, done));
        })?
    }
}
