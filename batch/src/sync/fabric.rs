//! What a sync engine's batches run on: TCP, or RDMA verbs (whose control
//! plane is TCP). One engine runs on one fabric; everything that differs
//! between the two — opening a peer's segment, lending caller memory,
//! building a batch, stopping — is here.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use quiesce_runtime::IoBufMut;
use quiesce_transports::rdma::{LocalMemory, RdmaConfig, RdmaEngine, RdmaSegment};
use quiesce_transports::{
    Engine, EngineConfig, ForeignMemory, RemoteSegment, Rights, Segment, Token, TransferError,
};

use super::{AbortOnUnwind, Direction, SyncError, SyncTasks};
use crate::transport::{OneSided, Range, Segments};
use crate::{Batch, BatchOptions, Rdma, Submitted, Tcp};

/// How long stopping an RDMA engine waits for its posted requests to flush.
const RDMA_DRAIN: Duration = Duration::from_secs(10);

/// What [`SyncEngine`](super::SyncEngine) binds on its thread.
pub(crate) enum Setup {
    Tcp(EngineConfig),
    Rdma(RdmaConfig),
}

/// The fabric a running sync engine uses.
#[derive(Clone)]
pub(crate) enum Fabric {
    Tcp,
    Rdma(RdmaEngine),
}

/// A peer's segment, opened on the engine's fabric.
#[derive(Clone)]
pub(crate) enum Opened {
    Tcp(RemoteSegment),
    Rdma(RdmaSegment),
}

impl Opened {
    /// The name of the node it was opened at (the peer's first hello's).
    pub(crate) fn node(&self) -> &str {
        match self {
            Opened::Tcp(s) => s.peer().node(),
            Opened::Rdma(s) => s.peer().node(),
        }
    }

    /// The peer's address of its first byte, and its length.
    pub(crate) fn extent(&self) -> (u64, u64) {
        match self {
            Opened::Tcp(s) => (s.base(), s.len()),
            Opened::Rdma(s) => (s.base(), s.len()),
        }
    }
}

/// How a peer's segment is named when it is opened.
pub(crate) enum SegmentBy {
    Name(String),
    Address(u64),
    First,
}

/// Caller memory lent to the engine: the segment serving it, and on RDMA
/// its local registration (so batches can post from it too).
pub(crate) struct Lent {
    pub(crate) seg: Segment,
    pub(crate) local: Option<LocalMemory>,
}

impl Setup {
    /// The TCP engine's settings (`None` on RDMA).
    pub(crate) fn tcp_config(&self) -> Option<EngineConfig> {
        match self {
            Setup::Tcp(cfg) => Some(cfg.clone()),
            Setup::Rdma(_) => None,
        }
    }

    /// Binds the engine (on the engine's thread, inside its runtime).
    pub(crate) fn bind(self) -> Result<(Engine, Fabric), String> {
        match self {
            Setup::Tcp(cfg) => Ok((Engine::bind(cfg).map_err(|e| e.to_string())?, Fabric::Tcp)),
            Setup::Rdma(cfg) => {
                let r = RdmaEngine::bind(cfg).map_err(|e| e.to_string())?;
                Ok((r.control().clone(), Fabric::Rdma(r)))
            }
        }
    }
}

impl Fabric {
    /// Connects to `addr` (or finds the peer connected there, its control
    /// connection reconnected if it is down) and names the node its hello
    /// gave — the one answering there now: a peer that found another node
    /// at its address is replaced by a new one.
    pub(crate) async fn node(
        &self,
        engine: &Engine,
        addr: SocketAddr,
    ) -> Result<String, TransferError> {
        Ok(match self {
            Fabric::Tcp => {
                let p = engine.connect(addr).await?;
                let p = match p.check_in().await {
                    Err(_) if p.is_replaced() => engine.connect(addr).await?,
                    r => r.map(|_| p)?,
                };
                p.node().to_string()
            }
            Fabric::Rdma(r) => {
                let p = r.connect(addr).await?;
                let p = match p.check_in().await {
                    Err(_) if p.is_replaced() => r.connect(addr).await?,
                    r => r.map(|_| p)?,
                };
                p.node().to_string()
            }
        })
    }

    /// Connects to `addr` and opens the segment `by` names, proving `token`.
    pub(crate) async fn open(
        &self,
        engine: &Engine,
        addr: SocketAddr,
        by: SegmentBy,
        token: Token,
    ) -> Result<Opened, TransferError> {
        Ok(match self {
            Fabric::Tcp => {
                let p = engine.connect(addr).await?;
                Opened::Tcp(match by {
                    SegmentBy::Name(n) => p.open(&n, token).await?,
                    SegmentBy::Address(a) => p.open_at(a, token).await?,
                    SegmentBy::First => p.open_first(token).await?,
                })
            }
            Fabric::Rdma(r) => {
                let p = r.connect(addr).await?;
                Opened::Rdma(match by {
                    SegmentBy::Name(n) => p.open(&n, token).await?,
                    SegmentBy::Address(a) => p.open_at(a, token).await?,
                    SegmentBy::First => p.open_first(token).await?,
                })
            }
        })
    }

    /// Lends `mem` to peers as segment `name` (read and write), and on RDMA
    /// registers it for local use as well.
    pub(crate) fn lend(
        &self,
        engine: &Engine,
        name: &str,
        mem: ForeignMemory,
        token: Token,
    ) -> Result<Lent, SyncError> {
        let rights = Rights::READ | Rights::WRITE;
        match self {
            Fabric::Tcp => Ok(Lent {
                seg: engine.register_with_token(name, mem, rights, token)?,
                local: None,
            }),
            Fabric::Rdma(r) => {
                let seg = r.register_with_token(name, mem, rights, token)?;
                match r.register_segment_locally(&seg) {
                    Ok(local) => Ok(Lent {
                        seg,
                        local: Some(local),
                    }),
                    Err(e) => {
                        r.deregister(seg.id());
                        Err(SyncError::Setup(format!("local registration: {e}")))
                    }
                }
            }
        }
    }

    /// Stops serving segment `id` (on RDMA, its memory regions go too).
    pub(crate) fn deregister(&self, engine: &Engine, id: u64) {
        match self {
            Fabric::Tcp => engine.deregister(id),
            Fabric::Rdma(r) => r.deregister(id),
        };
    }

    /// Stops the transports; false if RDMA requests were still posted after
    /// the drain (memory they use must never be freed).
    pub(crate) fn shutdown(&self, engine: &Engine) -> bool {
        match self {
            Fabric::Tcp => {
                engine.shutdown();
                true
            }
            Fabric::Rdma(r) => r.shutdown(RDMA_DRAIN),
        }
    }

    /// A batch of `tasks` on this fabric, submitted; `segment` looks up a
    /// task's segment handle.
    pub(crate) fn submit<B: IoBufMut + Send>(
        &self,
        tasks: SyncTasks<B>,
        opts: BatchOptions,
        called: Instant,
        segment: impl Fn(u32) -> Option<Opened>,
    ) -> Result<(Submitted<B>, AbortOnUnwind), SyncError> {
        match self {
            Fabric::Tcp => build(Tcp, tasks, opts, called, |h| match segment(h)? {
                Opened::Tcp(s) => Some(s),
                Opened::Rdma(_) => None,
            }),
            Fabric::Rdma(_) => build(Rdma, tasks, opts, called, |h| match segment(h)? {
                Opened::Rdma(s) => Some(s),
                Opened::Tcp(_) => None,
            }),
        }
    }
}

fn build<S: OneSided, B: IoBufMut>(
    transport: Segments<S>,
    tasks: SyncTasks<B>,
    opts: BatchOptions,
    called: Instant,
    segment: impl Fn(u32) -> Option<S>,
) -> Result<(Submitted<B>, AbortOnUnwind), SyncError> {
    let mut batch = Batch::new(transport, opts);
    // The deadline counts from the caller's call, not from when this
    // thread got to it (after other jobs, or a blocking `lend`).
    batch.started_at(called);
    for (dir, t) in tasks {
        let Some(seg) = segment(t.segment) else {
            return Err(SyncError::UnknownSegment(t.segment));
        };
        let range = Range::new(&seg, t.offset, t.buf.bytes_total() as u64);
        let added = match dir {
            Direction::Write => batch.write(t.buf, range),
            Direction::Read => batch.read(t.buf, range),
        };
        if let Err(r) = added {
            return Err(SyncError::Batch(r.reason));
        }
    }
    // Submitting polls the batch in place, which starts its first
    // operations: a panic from here on would drop the caller's reply while
    // they may hold its memory (one before it started nothing).
    let pinned = AbortOnUnwind("a batch holding the caller's memory");
    Ok((batch.submit(), pinned))
}
