//! How a lane gets its own opening of each engine segment handle: as the
//! engine opened it (same peer, node, token, segment id and memory), within
//! a share of the batch's deadline, and again when the peer lost it.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use quiesce_runtime::time::timeout;
use quiesce_transports::{Engine, RemoteSegment};
use smallvec::SmallVec;

use super::{Lane, LaneKey};
use crate::sync::{Direction, SyncTask};

/// Opening a lane's segment may take this share (1/n) of the batch's
/// deadline at most: the rest is the batch's, on the lane or not.
const OPEN_SHARE: u32 = 4;
/// After an open ran out of time, how long batches on that handle go to
/// the engine's thread before the lane tries again.
const OPEN_BACKOFF: Duration = Duration::from_secs(1);

/// One of the engine's segment handles, as a lane sees it.
#[derive(Clone)]
pub(super) enum LaneSegment {
    /// Opened here, as the engine opened it.
    Open(RemoteSegment),
    /// The name or address is another segment by now (the engine's handle
    /// names one that is gone): its batches run on the engine's thread.
    Another,
    /// Opening it failed or did not finish in time: batches run on the
    /// engine's thread until then, when the lane tries again.
    Slow(Instant),
}

impl Lane {
    /// This lane's segment for every task (opening those it has not yet,
    /// as `keys` says the engine opened them), or `None` if one cannot be
    /// opened here as the engine opened it, or not in time. Opening may
    /// take [`OPEN_SHARE`] of the batch's deadline at most, over all the
    /// segments of the call, leaving the rest for the batch; an open is
    /// started only with half of that left, and one that runs out is not
    /// tried again for [`OPEN_BACKOFF`]. Also the time spent opening (the
    /// clock is not read when every segment was open already).
    pub(super) fn segments<B>(
        &mut self,
        tasks: &[(Direction, SyncTask<B>)],
        keys: &Mutex<Vec<Option<LaneKey>>>,
        deadline: Option<Duration>,
        now: Instant,
    ) -> (Option<SmallVec<[RemoteSegment; 4]>>, Duration) {
        let mut out = SmallVec::with_capacity(tasks.len());
        // Time spent opening, read from the clock only when one is opened.
        let mut spent = Duration::ZERO;
        // What opening may take, over every segment this call opens.
        let budget = deadline.map(|d| d / OPEN_SHARE);
        for (_, t) in tasks {
            let known = self.opened.get(t.segment as usize).cloned().flatten();
            let seg = match known {
                Some(LaneSegment::Open(s)) if !s.is_gone() => s,
                Some(LaneSegment::Another) => return (None, spent),
                Some(LaneSegment::Slow(until)) if now < until => return (None, spent),
                // Never opened here, or not for a while, or gone at the
                // peer (a restarted target): opened as the engine has it
                // now, as its thread would (a lane that kept a gone
                // opening failed for good where the engine recovered).
                Some(LaneSegment::Slow(_) | LaneSegment::Open(_)) | None => {
                    let left = budget.map(|b| b.saturating_sub(spent));
                    if let (Some(l), Some(b)) = (left, budget) {
                        if l.is_zero() || l < b / 2 {
                            // Mostly spent: the engine's thread runs it
                            // (this segment is tried on a later call, with
                            // at least half the budget).
                            return (None, spent);
                        }
                    }
                    let started = Instant::now();
                    let state = self.open_here(t.segment, keys, left);
                    spent += started.elapsed();
                    match state {
                        Some(LaneSegment::Open(s)) => s,
                        _ => return (None, spent),
                    }
                }
            };
            out.push(seg);
        }
        // Connections the peer closed while this thread was away are seen
        // before the batch picks one (a turn of the reactor). Back to back,
        // nothing is older than what the last call reaped on its way out.
        if now >= self.away_at {
            self.rt.block_on(quiesce_runtime::yield_now());
        }
        (Some(out), spent)
    }

    /// Drops this lane's openings older than the engine's (by grant epoch):
    /// the engine opened the segment again after the target revoked a range
    /// of it, and the lane opens it again at its next use, taking the new
    /// grant too.
    pub(super) fn forget_older_openings(&mut self, keys: &Mutex<Vec<Option<LaneKey>>>) {
        let keys = keys.lock().unwrap_or_else(|e| e.into_inner());
        for (h, known) in self.opened.iter_mut().enumerate() {
            let newer = |s: &RemoteSegment| {
                keys.get(h)
                    .and_then(Option::as_ref)
                    .is_some_and(|k| k.grant > s.grant_epoch())
            };
            if matches!(known, Some(LaneSegment::Open(s)) if newer(s)) {
                *known = None;
            }
        }
    }

    /// Opens the engine's handle `handle` on this lane as `keys` says the
    /// engine opened it, and records how that went; `None` if it is not a
    /// TCP handle of this engine (the engine's thread answers it).
    /// `left`: how long it may take (`None`: as long as it takes; else at
    /// least half the call's budget), past which it is slow.
    fn open_here(
        &mut self,
        handle: u32,
        keys: &Mutex<Vec<Option<LaneKey>>>,
        left: Option<Duration>,
    ) -> Option<LaneSegment> {
        let key = {
            let all = keys.lock().unwrap_or_else(|e| e.into_inner());
            all.get(handle as usize).cloned().flatten()?
        };
        let net = self.net.clone()?;
        let opening = open(&net, &key);
        let opened = match left {
            Some(d) => self.rt.block_on(timeout(d, opening)).ok(),
            None => Some(self.rt.block_on(opening)),
        };
        let state = match opened {
            Some(Ok(s)) => LaneSegment::Open(s),
            Some(Err(LaneOpen::Another)) => LaneSegment::Another,
            // Not reached, refused, or not in time: tried again later (the
            // engine keeps this handle when it opens the segment again).
            Some(Err(LaneOpen::Failed)) | None => LaneSegment::Slow(Instant::now() + OPEN_BACKOFF),
        };
        let h = handle as usize;
        if self.opened.len() <= h {
            self.opened.resize(h + 1, None);
        }
        self.opened[h] = Some(state.clone());
        Some(state)
    }
}

/// Why a lane could not open a segment as the engine did.
enum LaneOpen {
    /// The peer was not reached, or refused (perhaps for now).
    Failed,
    /// The name or address is another segment by now: never the engine's.
    Another,
}

/// Opens the segment `key` names on the lane's engine.
async fn open(net: &Engine, key: &LaneKey) -> Result<RemoteSegment, LaneOpen> {
    let peer = net.connect(key.peer).await.map_err(|_| LaneOpen::Failed)?;
    let seg = match &key.name {
        Some(n) => peer.open(n, key.token).await,
        None => peer.open_at(key.base, key.token).await,
    }
    .map_err(|_| LaneOpen::Failed)?;
    // The node is checked once the open went through: a peer this lane
    // cached for a node that went fails the open (its reconnect finds it
    // replaced, and the lane tries afresh later) rather than read as
    // another node's segment for good.
    if peer.node() == key.node && (seg.id(), seg.base(), seg.len()) == (key.id, key.base, key.len) {
        Ok(seg)
    } else {
        Err(LaneOpen::Another)
    }
}
