//! The io_uring backend.
//!
//! Operations live in a slab; `user_data` is `generation << 32 | key`, so a
//! late cancel or CQE can never hit a slot that was reused. SQEs are pushed
//! as operations are created and flushed in one `io_uring_enter` at park; a
//! full submission queue is submitted early and pushing carries on.

use std::io;
use std::mem::ManuallyDrop;
use std::os::fd::RawFd;
use std::task::Waker;
use std::time::{Duration, Instant};

use io_uring::{cqueue, opcode, squeue, types, IoUring};
use slab::Slab;

use super::lifecycle::{cqe_result, Lifecycle, Parked};
use super::ParkEvents;
use crate::executor::Wakes;
use crate::stats::Counters;

/// `user_data` of async-cancel SQEs (their CQEs are ignored).
const CANCEL_TOKEN: u64 = 1 << 63;
/// `user_data` of the multishot poll on the runtime's eventfd.
const WAKE_TOKEN: u64 = (1 << 63) | 1;
/// Tag of completion-source fd polls: `SOURCE_TAG | source token`.
const SOURCE_TAG: u64 = 1 << 62;
/// `IORING_ENTER_GETEVENTS` (the crate keeps its `sys` module private).
const ENTER_GETEVENTS: u32 = 1;
/// `IORING_ENTER_SQ_WAKEUP`: wakes an SQPOLL thread that fell asleep.
const ENTER_SQ_WAKEUP: u32 = 2;

/// Ring set-up knobs (see `Builder`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RingConfig {
    pub(crate) entries: u32,
    pub(crate) cq_entries: Option<u32>,
    pub(crate) sqpoll_idle: Option<Duration>,
    pub(crate) single_issuer: bool,
    pub(crate) defer_taskrun: bool,
    pub(crate) coop_taskrun: bool,
}

struct Slot {
    gen: u32,
    life: Lifecycle,
}

/// An io_uring instance and the operations in flight on it.
pub(crate) struct Uring {
    /// Dropped with the driver, unless `leaked` (a drain timed out).
    ring: ManuallyDrop<IoUring>,
    leaked: bool,
    ops: Slab<Slot>,
    /// SQEs pushed since the last submit.
    unsubmitted: u32,
    defer_taskrun: bool,
    /// A kernel thread polls the SQ (`IORING_SETUP_SQPOLL`).
    sqpoll: bool,
    wake_fd: RawFd,
    wake_armed: bool,
    pub(crate) events: ParkEvents,
    /// Completions being dispatched (kept for its capacity).
    reaped: Vec<cqueue::Entry>,
    /// The process the ring was made in: a forked child's copy of the ring
    /// is the parent's ring, and nothing is pushed into it or submitted.
    lineage: crate::fork::Lineage,
    /// Its runtime is shutting down (`drain`): a waker that panics is
    /// logged, not raised, or the drain would stop short (and a runtime
    /// dropped while unwinding abort the process).
    draining: bool,
}

/// What the reactor does after `io_uring_enter(2)` failed with `errno`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum EnterFailed {
    /// Interrupted (`EINTR`), or a wait's own timeout ran out (`ETIME`):
    /// the submissions went.
    Submitted,
    /// The kernel cannot take them now: `EBUSY` (the CQ is full) and, per
    /// the man page's "wait for some completions and try again", `EAGAIN`
    /// and `ENOMEM` (out of memory or resources). They stay queued for the
    /// next turn. These two killed the reactor (memory pressure panicked
    /// its `block_on`).
    Retry,
    /// Anything else: the ring is unusable.
    Fatal,
}

/// The error of a driver used in a forked child of the process that made it.
pub(crate) fn forked() -> io::Error {
    io::Error::other("a forked child's copy of its parent's ring or epoll instance")
}

fn enter_failed(errno: Option<i32>) -> EnterFailed {
    match errno {
        Some(libc::EINTR | libc::ETIME) => EnterFailed::Submitted,
        Some(libc::EBUSY | libc::EAGAIN | libc::ENOMEM) => EnterFailed::Retry,
        _ => EnterFailed::Fatal,
    }
}

impl Uring {
    pub(crate) fn new(cfg: &RingConfig, wake_fd: RawFd) -> io::Result<Uring> {
        let mut b = IoUring::builder();
        if let Some(cq) = cfg.cq_entries {
            b.setup_cqsize(cq);
        }
        if let Some(idle) = cfg.sqpoll_idle {
            b.setup_sqpoll(idle.as_millis().min(u32::MAX as u128) as u32);
        }
        if cfg.single_issuer || cfg.defer_taskrun {
            b.setup_single_issuer();
        }
        if cfg.defer_taskrun {
            if cfg.sqpoll_idle.is_some() {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    "DEFER_TASKRUN cannot be combined with SQPOLL",
                ));
            }
            b.setup_defer_taskrun();
        }
        // The kernel refuses COOP_TASKRUN and DEFER_TASKRUN with SQPOLL: the
        // SQ thread runs completions itself.
        if cfg.coop_taskrun && cfg.sqpoll_idle.is_none() {
            // With COOP_TASKRUN the kernel no longer interrupts us to post
            // completions; TASKRUN_FLAG tells us when it has some waiting.
            b.setup_coop_taskrun().setup_taskrun_flag();
        }
        b.setup_clamp();
        let ring = b.build(cfg.entries)?;
        if !ring.params().is_feature_nodrop() || !ring.params().is_feature_ext_arg() {
            return Err(io::Error::new(
                io::ErrorKind::Unsupported,
                "io_uring lacks IORING_FEAT_NODROP or IORING_FEAT_EXT_ARG (kernel older than 5.11)",
            ));
        }
        // As many op slots as the ring the kernel gave (it clamps what was
        // asked for): more ops grow the slab.
        let slots = ring.params().sq_entries() as usize;
        Ok(Uring {
            ring: ManuallyDrop::new(ring),
            leaked: false,
            ops: Slab::with_capacity(slots),
            unsubmitted: 0,
            defer_taskrun: cfg.defer_taskrun,
            sqpoll: cfg.sqpoll_idle.is_some(),
            wake_fd,
            wake_armed: false,
            events: ParkEvents::default(),
            reaped: Vec::with_capacity(256),
            lineage: crate::fork::Lineage::here(),
            draining: false,
        })
    }

    /// Operations the kernel may still produce completions for.
    pub(crate) fn in_flight(&self) -> usize {
        self.ops.iter().filter(|(_, s)| s.life.is_live()).count()
    }

    /// Entries still in the submission queue after an enter: the kernel
    /// stops taking them at the first it cannot prepare (its error CQE
    /// posted) and leaves the rest, which the next enter must submit. (An
    /// SQPOLL thread takes them itself: none are ours to submit.)
    fn queued(&mut self) -> u32 {
        match self.sqpoll {
            true => 0,
            false => self.ring.submission().len() as u32,
        }
    }

    /// Queues an SQE, submitting early if the queue is full.
    fn push(&mut self, entry: &squeue::Entry, counters: &Counters) {
        if self.lineage.forked() {
            // The parent's submission queue: an entry here would be
            // submitted by the parent, in the parent's address space.
            return;
        }
        loop {
            // Every pointer in the entry refers to memory owned by the op's struct
            // (heap), which the op future or the driver's Ignored slot keeps alive
            // until the op's final CQE is reaped.
            // SAFETY: as just said, the entry's memory outlives the operation.
            let pushed = unsafe { self.ring.submission().push(entry) };
            if pushed.is_ok() {
                self.unsubmitted += 1;
                return;
            }
            Counters::bump(&counters.submit_full);
            match self.ring.submit() {
                Ok(_) => self.unsubmitted = self.queued(),
                Err(e) => match enter_failed(e.raw_os_error()) {
                    EnterFailed::Submitted => {}
                    EnterFailed::Retry => self.starved(counters),
                    // Retrying would spin for ever (a forked child's copy of
                    // the ring, a dead SQPOLL thread): the entry is not
                    // queued, and its op is leaked at shutdown.
                    EnterFailed::Fatal => panic!("quiesce: io_uring submit failed: {e}"),
                },
            }
        }
    }

    /// Submits an operation; returns its token.
    pub(crate) fn submit(
        &mut self,
        entry: squeue::Entry,
        life: Lifecycle,
        counters: &Counters,
    ) -> u64 {
        let gen = counters.next_gen();
        let key = self.ops.insert(Slot { gen, life });
        let token = (u64::from(gen) << 32) | key as u64;
        self.push(&entry.user_data(token), counters);
        Counters::bump(&counters.ops_submitted);
        token
    }

    fn slot(&mut self, token: u64) -> Option<&mut Slot> {
        let key = (token & 0xffff_ffff) as usize;
        let gen = (token >> 32) as u32;
        self.ops.get_mut(key).filter(|s| s.gen == gen)
    }

    fn remove(&mut self, token: u64) {
        self.ops.remove((token & 0xffff_ffff) as usize);
    }

    /// Polls a one-shot op: its result and flags once it is fully done.
    pub(crate) fn poll_op(&mut self, token: u64, waker: &Waker) -> Option<(io::Result<u32>, u32)> {
        let slot = self.slot(token).expect("polled op has a slot");
        match &mut slot.life {
            Lifecycle::Completed {
                res,
                flags,
                more: false,
                ..
            } => {
                let out = (cqe_result(*res), *flags);
                self.remove(token);
                Some(out)
            }
            Lifecycle::Completed { waker: w, .. } => {
                *w = Some(waker.clone());
                None
            }
            life @ (Lifecycle::Submitted | Lifecycle::Waiting(_)) => {
                if !matches!(life, Lifecycle::Waiting(w) if w.will_wake(waker)) {
                    *life = Lifecycle::Waiting(waker.clone());
                }
                None
            }
            Lifecycle::Ignored(_) => {
                unreachable!("poll_op on a parked op")
            }
        }
    }

    /// The op's future was dropped. If the kernel is done with it, the op is
    /// handed back to be dropped by the caller; otherwise it is parked and
    /// cancelled.
    pub(crate) fn park_op(
        &mut self,
        token: u64,
        mut op: Box<dyn Parked>,
        counters: &Counters,
    ) -> Option<Box<dyn Parked>> {
        let slot = self.slot(token).expect("dropped op has a slot");
        let needs_cancel = match &mut slot.life {
            // Its result came and nobody took it: the op sees it as a
            // parked one would (an accept closes the fd it got for nobody).
            Lifecycle::Completed {
                more: false,
                res,
                flags,
                ..
            } => {
                op.cqe(*res, *flags);
                self.remove(token);
                return Some(op);
            }
            // Only the zero-copy notification is outstanding: nothing to cancel.
            Lifecycle::Completed {
                more: true,
                res,
                flags,
                ..
            } => {
                op.cqe(*res, *flags);
                false
            }
            Lifecycle::Submitted | Lifecycle::Waiting(_) => true,
            Lifecycle::Ignored(_) => unreachable!("an op parked twice"),
        };
        slot.life = Lifecycle::Ignored(op);
        Counters::bump(&counters.ops_parked);
        if needs_cancel {
            self.cancel(token, counters);
        }
        None
    }

    /// Posts an async cancel for `token` if it is still live.
    pub(crate) fn cancel(&mut self, token: u64, counters: &Counters) {
        let live = self.slot(token).is_some_and(|s| match &s.life {
            Lifecycle::Completed { .. } => false,
            l => l.is_live(),
        });
        if live {
            self.push(
                &opcode::AsyncCancel::new(token)
                    .build()
                    .user_data(CANCEL_TOKEN),
                counters,
            );
            Counters::bump(&counters.cancels_posted);
        }
    }

    /// Watches a completion source's fd (one-shot poll).
    pub(crate) fn watch_source(&mut self, fd: RawFd, token: u64, counters: &Counters) {
        let e = opcode::PollAdd::new(types::Fd(fd), libc::POLLIN as u32).build();
        self.push(&e.user_data(SOURCE_TAG | token), counters);
    }

    pub(crate) fn unwatch_source(&mut self, token: u64, counters: &Counters) {
        let e = opcode::PollRemove::new(SOURCE_TAG | token).build();
        self.push(&e.user_data(CANCEL_TOKEN), counters);
    }

    /// Flushes SQEs, waits up to `timeout` for a completion, reaps all.
    pub(crate) fn park(
        &mut self,
        timeout: Option<Duration>,
        counters: &Counters,
    ) -> io::Result<()> {
        if self.lineage.forked() {
            return Err(forked());
        }
        if !self.wake_armed {
            let e = opcode::PollAdd::new(types::Fd(self.wake_fd), libc::POLLIN as u32)
                .multi(true)
                .build();
            self.push(&e.user_data(WAKE_TOKEN), counters);
            self.wake_armed = true;
        }
        let res = match timeout {
            Some(d) if d.is_zero() => {
                let sqpoll = self.sqpoll;
                let (pending_work, wake_sq) = {
                    let sq = self.ring.submission();
                    // (Read after the SQ tail was written: `need_wakeup`
                    // fences, so a thread falling asleep meanwhile is seen.)
                    // Only for entries it has not taken: an idle spinning
                    // reactor must not keep waking it.
                    let queued = sqpoll && !sq.is_empty();
                    (sq.taskrun() || sq.cq_overflow(), queued && sq.need_wakeup())
                };
                if self.unsubmitted == 0 && !pending_work && !self.defer_taskrun && !wake_sq {
                    // Nothing to submit and no deferred completions: just read the CQ.
                    Ok(0)
                } else {
                    // An SQPOLL thread that fell asleep takes what is queued
                    // only once woken; the blocking parks below wake it
                    // through the crate, this one must say so itself.
                    let flags = ENTER_GETEVENTS | if wake_sq { ENTER_SQ_WAKEUP } else { 0 };
                    // SAFETY: no signal mask or argument pointers are passed.
                    unsafe {
                        self.ring.submitter().enter::<libc::sigset_t>(
                            self.unsubmitted,
                            0,
                            flags,
                            None,
                        )
                    }
                }
            }
            Some(d) => {
                Counters::bump(&counters.parks);
                let ts = types::Timespec::from(d);
                let args = types::SubmitArgs::new().timespec(&ts);
                self.ring.submitter().submit_with_args(1, &args)
            }
            None => {
                Counters::bump(&counters.parks);
                self.ring.submit_and_wait(1)
            }
        };
        match res {
            Ok(_) => self.unsubmitted = self.queued(),
            Err(e) => match enter_failed(e.raw_os_error()) {
                EnterFailed::Submitted => self.unsubmitted = self.queued(),
                EnterFailed::Retry => {
                    self.starved(counters);
                    return Ok(());
                }
                EnterFailed::Fatal => return Err(e),
            },
        }
        self.reap(counters);
        Ok(())
    }

    /// The kernel could not take the submissions now ([`EnterFailed::Retry`]):
    /// reaps what completed, and with nothing to reap waits a millisecond
    /// (memory or the CQ's room comes back as others finish), so that the
    /// next turn's retry does not spin.
    fn starved(&mut self, counters: &Counters) {
        Counters::bump(&counters.enter_starved);
        if self.ring.completion().is_empty() {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        self.reap(counters);
    }

    /// Reaps every CQE in the completion queue.
    fn reap(&mut self, counters: &Counters) {
        loop {
            let mut cq = self.ring.completion();
            cq.sync();
            if cq.is_empty() {
                return;
            }
            // Copied out (the queue borrows the ring that dispatch needs)
            // into a vector kept across turns: reaping allocates nothing.
            let mut batch = std::mem::take(&mut self.reaped);
            batch.clear();
            batch.extend(cq.by_ref().take(256));
            drop(cq);
            // (Off the ring: a completion not dispatched now never comes again.)
            let mut wakes = crate::executor::Wakes::default();
            for cqe in &batch {
                self.dispatch(
                    cqe.user_data(),
                    cqe.result(),
                    cqe.flags(),
                    counters,
                    &mut wakes,
                );
            }
            self.reaped = batch;
            match self.draining {
                true => wakes.finish_in_drop(),
                false => wakes.finish(),
            }
        }
    }

    fn dispatch(&mut self, ud: u64, res: i32, flags: u32, counters: &Counters, wakes: &mut Wakes) {
        Counters::bump(&counters.completions);
        if ud == CANCEL_TOKEN {
            return;
        }
        if ud == WAKE_TOKEN {
            self.events.woken = true;
            if !cqueue::more(flags) {
                self.wake_armed = false;
            }
            return;
        }
        if ud & SOURCE_TAG != 0 && ud & CANCEL_TOKEN == 0 {
            if res != -libc::ECANCELED {
                self.events.sources_ready.push(ud & !SOURCE_TAG);
            }
            return;
        }
        let last = !cqueue::more(flags);
        let notif = cqueue::notif(flags);
        if notif {
            Counters::bump(&counters.zc_notifications);
        }
        let Some(slot) = self.slot(ud) else {
            tracing::warn!(user_data = ud, "CQE for an unknown operation");
            return;
        };
        match &mut slot.life {
            life @ (Lifecycle::Submitted | Lifecycle::Waiting(_)) => {
                let waker = match std::mem::replace(life, Lifecycle::Submitted) {
                    Lifecycle::Waiting(w) => Some(w),
                    _ => None,
                };
                if last {
                    *life = Lifecycle::Completed {
                        res,
                        flags,
                        more: false,
                        waker: None,
                    };
                    if let Some(w) = waker {
                        wakes.wake(w);
                    }
                } else {
                    *life = Lifecycle::Completed {
                        res,
                        flags,
                        more: true,
                        waker,
                    };
                }
            }
            Lifecycle::Completed { more, waker, .. } => {
                // The zero-copy notification: the kernel has let go of the buffer.
                if last {
                    *more = false;
                    if let Some(w) = waker.take() {
                        wakes.wake(w);
                    }
                }
            }
            Lifecycle::Ignored(op) => {
                op.cqe(res, flags);
                if last {
                    let slot = self.ops.remove((ud & 0xffff_ffff) as usize);
                    if let Lifecycle::Ignored(op) = slot.life {
                        self.events.released.push(op);
                    }
                    Counters::bump(&counters.parked_released);
                }
            }
        }
    }

    /// Cancels everything and reaps until no operation is live, or until
    /// `limit` passes. Returns how many operations were still live then.
    pub(crate) fn drain(&mut self, limit: Duration, counters: &Counters) -> usize {
        self.draining = true;
        let tokens: Vec<u64> = self
            .ops
            .iter()
            .filter(|(_, s)| s.life.is_live())
            .map(|(k, s)| (u64::from(s.gen) << 32) | k as u64)
            .collect();
        for t in tokens {
            self.cancel(t, counters);
        }
        let start = Instant::now();
        loop {
            let live = self.in_flight();
            if live == 0 {
                return 0;
            }
            let left = limit.saturating_sub(start.elapsed());
            if left.is_zero() {
                return live;
            }
            if let Err(e) = self.park(Some(left.min(Duration::from_millis(50))), counters) {
                tracing::error!(error = %e, "io_uring wait failed while draining");
                return self.in_flight();
            }
        }
    }

    /// Leaks the ring and every parked op when the driver is dropped (after a
    /// failed drain): the kernel may still write into their buffers, and
    /// closing the ring would let its teardown race with memory handed back to
    /// the allocator. Ops whose futures are still alive keep their slots and
    /// stay pending.
    pub(crate) fn set_leak(&mut self) {
        self.leaked = true;
    }
}

impl Drop for Uring {
    fn drop(&mut self) {
        if self.leaked {
            std::mem::forget(std::mem::take(&mut self.ops));
        } else {
            // SAFETY: dropped exactly once, here; nothing uses the ring afterwards.
            unsafe { ManuallyDrop::drop(&mut self.ring) };
        }
    }
}

#[cfg(test)]
mod tests;
