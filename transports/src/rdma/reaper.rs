//! The shard's completion queue and every work request's life, from queued
//! to reaped.
//!
//! A transfer becomes a [`Slot`] (slab key + generation = the `wr_id` of
//! each of its work requests) and one work request per slice. A small
//! transfer to an idle link (nothing posted, nothing queued) is posted at
//! once; otherwise its requests wait in their [`Link`]'s queue until the
//! next doorbell: the reactor polls the [`Reaper`] every tick (and right
//! before it blocks), and each poll rings each link's doorbell once, with
//! everything queued since, then reaps the completion queue. A slot resolves
//! when its last request is known done — never earlier, whatever failed — so
//! its buffer comes back only once the NIC is done with it. Only the last of
//! a transfer's requests in one doorbell asks for a completion; the link's
//! [`Ledger`] says which requests each reaped completion vouches for.
//! Link states: see [`link`](super::link).

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use quiesce_runtime::source::CompletionSource;
use slab::Slab;

use super::ledger::Ledger;
use super::link::{Link, LinkState};
use super::verbs::{Completion, Cq, WorkRequest, SIGNALLED};
use crate::error::TransferError;

/// `ibv_wc_status` values this module names.
const WC_SUCCESS: u32 = 0;
const WC_LOC_PROT_ERR: u32 = 4;
const WC_WR_FLUSH_ERR: u32 = 5;
const WC_REM_INV_REQ_ERR: u32 = 9;
const WC_REM_ACCESS_ERR: u32 = 10;
const WC_REM_OP_ERR: u32 = 11;
const WC_RETRY_EXC_ERR: u32 = 12;
const WC_RNR_RETRY_EXC_ERR: u32 = 13;

struct Slot {
    gen: u32,
    batch: u64,
    /// Queued or posted requests not yet known done.
    outstanding: u32,
    bytes: u64,
    /// Bytes of its requests known to have landed: those of groups whose
    /// signalled request completed successfully.
    landed: u64,
    error: Option<TransferError>,
    waker: Option<Waker>,
    link: Rc<Link>,
    /// What must outlive the NIC's use: the local memory registration.
    _keep: Option<Rc<dyn Any>>,
    /// The buffer of a transfer whose future was dropped in flight; freed
    /// when the last request is reaped.
    orphan: Option<Box<dyn Any>>,
}

/// The largest transfer posted at once on an idle link (see
/// [`Reaper::submit`]); larger ones wait for the next tick's doorbell.
const IMMEDIATE_MAX: u64 = 64 * 1024;

/// One transfer handed to [`Reaper::submit`].
pub(crate) struct Submission<I, B> {
    /// Its work requests (`wr_id` is filled in).
    pub(crate) wrs: I,
    /// How many `wrs` yields.
    pub(crate) count: u32,
    /// The batch it belongs to (for fences).
    pub(crate) batch: u64,
    /// Bytes it moves, reported on success.
    pub(crate) bytes: u64,
    /// What must outlive the NIC's use of the buffer (its registration).
    pub(crate) keep: Option<Rc<dyn Any>>,
    /// The buffer, handed back when every request is reaped.
    pub(crate) buf: B,
}

/// Counters, for tests and `quiesce bench`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RdmaStats {
    /// Work requests posted.
    pub posted: u64,
    /// Completions reaped (flushes included). Fewer than `completed`: only
    /// the last request of a transfer in a doorbell asks for one on success.
    pub reaped: u64,
    /// Posted work requests known done: reaped, or vouched for by a later
    /// request's completion on the same queue pair. Equals `posted` once
    /// nothing is in flight.
    pub completed: u64,
    /// `ibv_post_send` calls (doorbells).
    pub doorbells: u64,
    /// Of those, doorbells rung by a small submission on an idle link, at
    /// once rather than at the next tick.
    pub immediate: u64,
    /// Transfers whose requests are not all reaped.
    pub in_flight: u64,
    /// Memory regions registered now (local and segments).
    pub memory_regions: u64,
    /// Queue pairs this engine serves peers now (target side): one per
    /// control connection at most, none after a fence of its session.
    pub served_queue_pairs: u64,
}

/// The shard's CQ and the slots of its work requests.
pub(crate) struct Reaper {
    // Field order matters on drop: slots (and the QPs they keep) go before the CQ.
    slots: Slab<Slot>,
    dirty: Vec<Rc<Link>>,
    next_gen: u32,
    scratch: Vec<Completion>,
    /// Reused list of the requests one doorbell posts.
    to_post: Vec<WorkRequest>,
    /// Posted requests not yet known done, over all links: each may still
    /// bring a completion (errors always do), so never more than the CQ
    /// holds, or it would overflow.
    in_cq: u32,
    stats: RdmaStats,
    pub(crate) mrs: Rc<Cell<u64>>,
    cq: Cq,
}

pub(crate) type SharedReaper = Rc<RefCell<Reaper>>;

impl Reaper {
    pub(crate) fn new(cq: Cq, mrs: Rc<Cell<u64>>) -> Reaper {
        Reaper {
            slots: Slab::new(),
            dirty: Vec::new(),
            next_gen: 1,
            scratch: Vec::with_capacity(32),
            to_post: Vec::new(),
            in_cq: 0,
            stats: RdmaStats::default(),
            mrs,
            cq,
        }
    }

    pub(crate) fn cq(&self) -> &Cq {
        &self.cq
    }

    pub(crate) fn stats(&self) -> RdmaStats {
        RdmaStats {
            in_flight: self.slots.len() as u64,
            memory_regions: self.mrs.get(),
            ..self.stats
        }
    }

    /// Queues `sub`'s requests on `link` as one transfer (their `wr_id`s
    /// are filled in); returns the future that resolves once all are reaped.
    pub(crate) fn submit<I, B>(
        this: &SharedReaper,
        link: &Rc<Link>,
        sub: Submission<I, B>,
    ) -> Transfer<B>
    where
        I: Iterator<Item = WorkRequest>,
        B: 'static,
    {
        let mut r = this.borrow_mut();
        let gen = r.next_gen;
        // 31 bits: the top bit of a wr_id is the ledger's SIGNALLED mark.
        r.next_gen = (r.next_gen.wrapping_add(1) & 0x7fff_ffff).max(1);
        let key = r.slots.insert(Slot {
            gen,
            batch: sub.batch,
            outstanding: sub.count,
            bytes: sub.bytes,
            landed: 0,
            error: None,
            waker: None,
            link: link.clone(),
            _keep: sub.keep,
            orphan: None,
        });
        let wr_id = (gen as u64) << 32 | key as u64;
        // A small transfer (one request of at most IMMEDIATE_MAX bytes) to
        // an idle link (nothing in its send queue, nothing queued) rings at
        // once instead of at the next tick: a lone small transfer saves the
        // wait. Anything else joins the next doorbell, as many requests as
        // completions have made room for: a busy link keeps batching, and a
        // large post (which Soft-RoCE processes in the posting thread) never
        // runs inside the submitting task's poll.
        let idle = sub.count == 1
            && sub.bytes <= IMMEDIATE_MAX
            && link.outstanding.get() == 0
            && link.queued.borrow().is_empty();
        link.queued
            .borrow_mut()
            .extend(sub.wrs.map(|w| WorkRequest { wr_id, ..w }));
        if idle {
            let rung = r.stats.doorbells;
            r.ring(link);
            r.stats.immediate += r.stats.doorbells - rung;
        }
        if !link.queued.borrow().is_empty() && !link.in_dirty.replace(true) {
            r.dirty.push(link.clone());
        }
        Transfer {
            reaper: this.clone(),
            key,
            gen,
            buf: Some(sub.buf),
        }
    }

    /// Rings each dirty link's doorbell once.
    fn doorbells(&mut self) {
        let mut i = 0;
        while i < self.dirty.len() {
            let link = self.dirty[i].clone();
            self.ring(&link);
            if link.queued.borrow().is_empty() {
                link.in_dirty.set(false);
                self.dirty.swap_remove(i);
            } else {
                i += 1;
            }
        }
    }

    /// Posts as much of `link`'s queue as its send queue and the CQ have
    /// room for, in one `ibv_post_send`; on a link that is no longer
    /// `Ready`, fails the queued requests without posting them.
    fn ring(&mut self, link: &Rc<Link>) {
        let mut queued = link.queued.borrow_mut();
        if link.state() != LinkState::Ready {
            let never_posted: Vec<WorkRequest> = queued.drain(..).collect();
            drop(queued);
            for w in never_posted {
                let e = link.flushed_error(self.slot_batch(w.wr_id), false);
                self.retire(w.wr_id, 1, 0, Some(e));
            }
            return;
        }
        let cq_room = self.cq.capacity().saturating_sub(self.in_cq);
        let room = link
            .depth
            .saturating_sub(link.outstanding.get())
            .min(cq_room) as usize;
        let n = room.min(queued.len());
        if n == 0 {
            return;
        }
        let mut wrs = std::mem::take(&mut self.to_post);
        wrs.clear();
        wrs.extend(queued.drain(..n));
        drop(queued);
        Ledger::mark(&mut wrs);
        self.stats.doorbells += 1;
        match link.qp.post(&wrs) {
            Ok(()) => {
                link.ledger.borrow_mut().posted(&wrs, n);
                link.outstanding.set(link.outstanding.get() + n as u32);
                self.in_cq += n as u32;
                self.stats.posted += n as u64;
            }
            Err((posted, e)) => {
                tracing::warn!(error = %e, posted, "post_send failed; resetting the queue pair");
                link.ledger.borrow_mut().posted(&wrs, posted);
                link.outstanding.set(link.outstanding.get() + posted as u32);
                self.in_cq += posted as u32;
                self.stats.posted += posted as u64;
                link.state.set(LinkState::Failed);
                let _ = link.qp.set_error();
                self.close_cut(link);
                // The NIC refused these: nothing of them was sent.
                for w in &wrs[posted..] {
                    self.retire(w.wr_id, 1, 0, Some(TransferError::NotSent(e.to_string())));
                }
            }
        }
        self.to_post = wrs;
    }

    /// After a refused post on `link`, now in the error state: posts the
    /// marker that retires the cut group it left, if any (see the ledger's
    /// docs), where the send queue's spare entry and the CQ have room.
    /// Without it the group is retired by counting its flushes.
    fn close_cut(&mut self, link: &Rc<Link>) {
        let Some(wr_id) = link.ledger.borrow().cut() else {
            return;
        };
        if self.in_cq >= self.cq.capacity() || link.outstanding.get() > link.depth {
            tracing::warn!(
                wr_id,
                "no room for a cut group's marker; counting its flushes"
            );
            return;
        }
        let marker = WorkRequest {
            wr_id: wr_id | SIGNALLED,
            read: false,
            local: 0,
            len: 0,
            lkey: 0,
            remote: 0,
            rkey: 0,
            inline: false,
        };
        match link.qp.post(&[marker]) {
            Ok(()) => {
                link.ledger.borrow_mut().close_cut();
                link.outstanding.set(link.outstanding.get() + 1);
                self.in_cq += 1;
            }
            Err((_, e)) => {
                tracing::warn!(error = %e, wr_id, "a cut group's marker was refused; counting its flushes")
            }
        }
    }

    fn slot_batch(&self, wr_id: u64) -> u64 {
        self.slots.get(wr_id as u32 as usize).map_or(0, |s| s.batch)
    }

    /// `requests` requests of `wr_id` are done (known done on the NIC, or
    /// failed before posting); 0 only records `error`.
    fn retire(&mut self, wr_id: u64, requests: u32, landed: u64, error: Option<TransferError>) {
        let key = wr_id as u32 as usize;
        let Some(slot) = self
            .slots
            .get_mut(key)
            .filter(|s| s.gen == ((wr_id & !SIGNALLED) >> 32) as u32)
        else {
            tracing::error!(wr_id, "completion for an unknown work request");
            return;
        };
        slot.landed += landed;
        // The first error, unless a later one leaves the target unsettled
        // (a posted request flushed or lost): the transfer must say so.
        match (&slot.error, error) {
            (None, e) => slot.error = e,
            (Some(kept), Some(e)) if kept.settles_remote() && !e.settles_remote() => {
                slot.error = Some(e)
            }
            _ => {}
        }
        if requests == 0 {
            return;
        }
        slot.outstanding -= requests;
        if slot.outstanding == 0 {
            if slot.orphan.is_some() {
                self.slots.remove(key);
            } else if let Some(w) = slot.waker.take() {
                w.wake();
            }
        }
    }

    /// Reaps the CQ until it is empty; returns how many completions.
    fn reap(&mut self) -> usize {
        let mut total = 0;
        loop {
            let mut wcs = std::mem::take(&mut self.scratch);
            let n = self.cq.poll(&mut wcs);
            for wc in &wcs {
                self.complete(wc);
            }
            self.scratch = wcs;
            total += n;
            if n < 32 {
                return total;
            }
        }
    }

    fn complete(&mut self, wc: &Completion) {
        self.stats.reaped += 1;
        let key = wc.wr_id as u32 as usize;
        let Some(slot) = self.slots.get(key) else {
            tracing::error!(wr_id = wc.wr_id, "completion for an unknown slot");
            return;
        };
        let link = slot.link.clone();
        let Some(done) = link
            .ledger
            .borrow_mut()
            .complete(wc.wr_id, wc.status == WC_SUCCESS)
        else {
            tracing::error!(
                wr_id = wc.wr_id,
                status = wc.status,
                "completion out of its queue pair's order"
            );
            return;
        };
        // The requests it vouches for leave the send queue, and the CQ
        // room they held is free again.
        link.outstanding
            .set(link.outstanding.get().saturating_sub(done.entries));
        self.in_cq = self.in_cq.saturating_sub(done.entries);
        self.stats.completed += u64::from(done.requests);
        let error = match wc.status {
            WC_SUCCESS => None,
            WC_WR_FLUSH_ERR => {
                // A flush on a link still `Ready`: something other than
                // this side's fence or a failed completion (the device's
                // asynchronous fatal error) moved its queue pair to the
                // error state. It serves nothing more: the next transfer
                // builds a new one.
                if link.state() == LinkState::Ready {
                    link.state.set(LinkState::Failed);
                }
                Some(link.flushed_error(slot.batch, true))
            }
            st => {
                if link.state() == LinkState::Ready {
                    link.state.set(LinkState::Failed);
                }
                tracing::debug!(status = st, qpn = wc.qpn, "work request failed");
                Some(status_error(st))
            }
        };
        let landed = if error.is_none() { done.bytes } else { 0 };
        self.retire(done.wr_id, done.requests, landed, error);
    }

    /// Moves every link with requests in flight to the error state and reaps
    /// until none is left, for at most `limit`. Returns whether all drained.
    pub(crate) fn drain_all(&mut self, limit: Duration) -> bool {
        let links: Vec<Rc<Link>> = self.slots.iter().map(|(_, s)| s.link.clone()).collect();
        for l in &links {
            l.fence(None);
        }
        drop(links);
        let t0 = Instant::now();
        loop {
            self.doorbells();
            self.reap();
            if self.slots.iter().all(|(_, s)| s.outstanding == 0) {
                return true;
            }
            if t0.elapsed() > limit {
                return false;
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}

fn status_error(st: u32) -> TransferError {
    match st {
        WC_REM_ACCESS_ERR => {
            TransferError::RemoteAccess("remote access error (rkey, bounds or access flags)".into())
        }
        WC_REM_INV_REQ_ERR => {
            TransferError::RemoteAccess("remote invalid request (length or bounds)".into())
        }
        WC_REM_OP_ERR => TransferError::RemoteAccess("remote operation error".into()),
        WC_LOC_PROT_ERR => TransferError::Unregistered { addr: 0, len: 0 },
        WC_RETRY_EXC_ERR | WC_RNR_RETRY_EXC_ERR => {
            TransferError::ConnectionLost("peer unreachable: transport retries exhausted".into())
        }
        st => TransferError::ConnectionLost(format!("work completion status {st}")),
    }
}

impl Drop for Reaper {
    fn drop(&mut self) {
        // Futures hold the reaper, so every slot left is an orphan whose
        // buffer the NIC may still touch: reset the QPs and reap first.
        if self.slots.is_empty() {
            return;
        }
        if !self.drain_all(Duration::from_secs(5)) {
            tracing::error!(
                left = self.slots.len(),
                "RDMA requests did not drain in 5 s; leaking their buffers rather than freeing memory a NIC may touch"
            );
            for s in self.slots.drain() {
                std::mem::forget(s);
            }
        }
    }
}

/// The reaper as the reactor's completion source.
pub(crate) struct Source {
    pub(crate) reaper: SharedReaper,
    pub(crate) busy_poll: bool,
    pub(crate) fd: RawFd,
}

impl CompletionSource for Source {
    fn poll(&mut self) -> usize {
        let mut r = self.reaper.borrow_mut();
        r.doorbells();
        r.reap()
    }

    fn notify_fd(&self) -> Option<RawFd> {
        (!self.busy_poll).then_some(self.fd)
    }

    fn arm(&mut self) -> usize {
        let mut r = self.reaper.borrow_mut();
        r.doorbells();
        r.cq.arm();
        // Drain after arm: a completion that landed before the arm is
        // found here instead of being waited for.
        r.reap()
    }

    fn notified(&mut self) {
        self.reaper.borrow_mut().cq.consume_events();
    }
}

/// A transfer in flight; resolves once every request of it is reaped.
/// Dropped early, it leaves its buffer in the reaper until then.
pub(crate) struct Transfer<B: 'static> {
    reaper: SharedReaper,
    key: usize,
    gen: u32,
    buf: Option<B>,
}

impl<B: 'static> Future for Transfer<B> {
    type Output = (Result<u64, TransferError>, B);

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.get_mut();
        let mut r = this.reaper.borrow_mut();
        let slot = &mut r.slots[this.key];
        debug_assert_eq!(slot.gen, this.gen);
        if slot.outstanding > 0 {
            slot.waker = Some(cx.waker().clone());
            return Poll::Pending;
        }
        let slot = r.slots.remove(this.key);
        drop(r);
        let buf = this.buf.take().expect("Transfer polled after completion");
        Poll::Ready((result(slot), buf))
    }
}

/// A resolved transfer's result. Its first error may be its unposted
/// rest's — `Fenced` or `NotSent`, which say nothing of it landed — while
/// the groups posted before landed: then it says what landed (fenced, as a
/// TCP write cut by a fence: `FencedPartial`), or, the link lost, leaves
/// the target unconfirmed rather than settled with nothing.
fn result(slot: Slot) -> Result<u64, TransferError> {
    match (slot.error, slot.landed) {
        (None, _) => Ok(slot.bytes),
        (Some(TransferError::Fenced), landed) if landed > 0 => {
            Err(TransferError::FencedPartial { landed })
        }
        (Some(TransferError::NotSent(why)), landed) if landed > 0 => Err(
            TransferError::ConnectionLost(format!("{why}, after {landed} bytes of it landed")),
        ),
        (Some(e), _) => Err(e),
    }
}

impl<B: 'static> Unpin for Transfer<B> {}

impl<B: 'static> Drop for Transfer<B> {
    fn drop(&mut self) {
        let Some(buf) = self.buf.take() else { return };
        let mut r = self.reaper.borrow_mut();
        let slot = &mut r.slots[self.key];
        if slot.outstanding == 0 {
            r.slots.remove(self.key);
        } else {
            slot.orphan = Some(Box::new(buf));
            slot.waker = None;
        }
    }
}
