//! The batches a node has out: asynchronous ones until a status call
//! reports them (and the codes it reported, for the calls after it), and
//! those that answered -2, whose memory stays pinned until they drain.

use std::collections::VecDeque;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::sync::mpsc;
use std::time::{Duration, Instant};

use quiesce_batch::ffi::RawBuf;
use quiesce_batch::sync::{Direction, SyncError, SyncOutcome};
use quiesce_batch::{SYNC_OK, SYNC_UNKNOWN};
use quiesce_runtime::time::deadline_in;
use smallvec::SmallVec;

use crate::managed::Uses;

use super::{complain, failures, lock, Node};

/// An asynchronous batch: its outcome's channel (taken out by the one call
/// that waits on it), and what it used.
pub(super) struct Outstanding {
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
pub(super) struct Pinned {
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

/// How many reported codes a node remembers for status calls that come
/// after another call reported the batch.
pub(super) const REPORTS_KEPT: usize = 4096;

impl Node {
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
    pub(super) fn settle(
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
    /// the status call. A -2 keeps its uses until it drained: one that has
    /// drained by now gives them back too, and its drained outcome (0 or
    /// -1) replaces the -2 for the status call, as a status call that waited
    /// it out would report (its ticket is answered once).
    pub(crate) fn release_finished(&self) {
        let mut all = lock(&self.outstanding);
        for o in all.values_mut() {
            let Some(rx) = o.outcome.as_ref() else {
                continue;
            };
            let Ok(mut out) = rx.try_recv() else {
                continue;
            };
            if let (SYNC_UNKNOWN, Some(ticket)) = (out.code, out.ticket) {
                if let Ok(Some(drained)) = self.engine().poll::<RawBuf>(ticket) {
                    out = drained;
                }
            }
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
    /// returns how many have not. One caller reaps at a time; another
    /// meanwhile waits for its turn, up to its own timeout, and is done as
    /// soon as nothing is left (the tickets stay listed until they drained,
    /// so nobody is told 0 while one is out). It answered the count at once,
    /// without waiting.
    pub(crate) fn quiesce_pending(&self, timeout: Duration) -> usize {
        let deadline = deadline_in(timeout);
        // (A waiter that panicked left nothing half-done: the lock orders
        // waiters, it guards no data.)
        let _only = loop {
            match self.waiting.try_lock() {
                Ok(g) => break g,
                Err(std::sync::TryLockError::Poisoned(g)) => break g.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {
                    if self.not_drained() == 0 || Instant::now() >= deadline {
                        return self.not_drained();
                    }
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        };
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
    pub(super) fn lose(&self, uses: Uses) {
        // Dropped, not released: its buffers' counts stay up.
        drop(uses);
        self.lost.fetch_add(1, Ordering::Relaxed);
    }
}
