//! The batch driver: launches tasks, fences on failure or deadline, waits
//! for quiescence, retries, and publishes the outcome.
//!
//! ```text
//!             launch                 every task terminal
//!  Running ───────────▶ waiting ────────────────────────────▶ Quiesced ──▶ retry? ──▶ Running
//!                │  FailFast failure, deadline, or dropped       ▲
//!                ▼                                                │ every task terminal
//!             Fencing: remote fence to each peer ─ grace/2 ─▶ local teardown (abort)
//!                │                                                │
//!                └──────────── grace over ──▶ CompletionUnknown (ticket) ──┘
//! ```
//! Between local quiescence and the outcome (or a retry), tasks that ended
//! without their target's answer are confirmed by an acknowledged fence of
//! the wire batch at their peer, waited for until the grace ends; the rest
//! are reported [`RemoteState::Unconfirmed`], and then, if one of them is a
//! write, nothing is retried (nothing of a read lands at its target).
//! Invariant: a task's buffer is back in its slot only when its transfer
//! future resolved, which the transport promises happens only once the
//! transfer quiesced; the outcome is built only from full slots.

use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use quiesce_runtime::time::{sleep_until, Sleep};
use quiesce_runtime::timeline::{self, Step};
use quiesce_runtime::{spawn_local, JoinError};
use quiesce_transports::TransferError;
use smallvec::{smallvec, SmallVec};
use tracing::Instrument;

mod fencing;
mod task;

use self::fencing::Fences;
pub(crate) use self::task::{
    Boxed, InFlight, Launch, Reads, Start, Task, TaskState, Tasks, TransferFuture, Transferred,
    Writes,
};
use crate::options::{BatchOptions, FailurePolicy};
use crate::outcome::{Handoff, Quiesced, TaskStatus};
use crate::transport::Transport;

/// Batches up to this many tasks poll their transfers inline.
const INLINE_TASKS: usize = 16;

/// Why the driver woke.
enum Event {
    Progress,
    Deadline,
    SoftLimit,
    HardLimit,
    Abandoned,
}

pub(crate) struct Driver<T: Transport, B> {
    pub(crate) transport: T,
    pub(crate) opts: BatchOptions,
    pub(crate) tasks: Tasks<T, B>,
    pub(crate) shared: Rc<Handoff<B>>,
    pub(crate) id: u64,
    started: Instant,
    deadline: Option<Instant>,
    fence_started: Option<Instant>,
    fence_time: Option<Duration>,
    /// When the current fence's grace ends.
    hard_at: Option<Instant>,
    /// Remote fences of the current wire batch, by peer (made on the first
    /// fence: a batch that never fences allocates no map).
    fences: Option<Fences<T::Peer>>,
    soft: Option<Sleep>,
    hard: Option<Sleep>,
    deadline_sleep: Option<Sleep>,
}

/// Polls the first task's transfer held in the driver's state; empties the
/// slot once it resolved.
fn poll_held<B, F: Future<Output = Transferred<B>>>(
    mut slot: Pin<&mut Option<F>>,
    cx: &mut Context<'_>,
) -> Poll<Transferred<B>> {
    let fut = slot
        .as_mut()
        .as_pin_mut()
        .expect("a held transfer is in the driver's slot");
    let out = std::task::ready!(fut.poll(cx));
    slot.set(None);
    Poll::Ready(out)
}

fn next_wire_batch() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static NEXT: AtomicU64 = AtomicU64::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

impl<T: Transport, B: 'static> Driver<T, B> {
    pub(crate) fn new(
        transport: T,
        opts: BatchOptions,
        tasks: Tasks<T, B>,
        shared: Rc<Handoff<B>>,
        id: u64,
        started: Instant,
    ) -> Self {
        // Every sum of an Instant and these below holds.
        let opts = opts.bounded();
        Driver {
            transport,
            deadline: opts.deadline.map(|d| started + d),
            opts,
            tasks,
            shared,
            id,
            started,
            fence_started: None,
            fence_time: None,
            hard_at: None,
            fences: None,
            soft: None,
            hard: None,
            deadline_sleep: None,
        }
    }

    /// Drives the batch to its outcome; `K` starts the first task's
    /// transfer, whose future lives here, pinned in this future's state.
    ///
    /// A plain `fn` returning an `async move` block rather than an `async
    /// fn`: an `async fn`'s `mut self` is moved into a second copy of the
    /// driver inside its future (both kept, ~450 bytes), where the block
    /// uses the one it captured.
    #[allow(clippy::manual_async_fn)] // on purpose: see above
    pub(crate) fn run<K: Start<T, B>>(mut self) -> impl Future<Output = ()> {
        async move {
            // Entered at each poll and left at each suspension: never held
            // across an await, where another batch's events would land in
            // it. It wraps `drive` before its first poll, while that future
            // is only a reference (wrapping the whole block moved ~270
            // instructions' worth of state per batch), and only when enabled
            // (a disabled span's enter and exit at each poll cost ~100).
            let span = tracing::info_span!(
                "batch",
                id = self.id,
                tasks = self.tasks.len(),
                bytes = self
                    .tasks
                    .iter()
                    .map(|t| self.transport.len(&t.target))
                    .sum::<u64>()
            );
            match span.is_disabled() {
                // The common case (info off for this crate): nothing to enter.
                true => self.drive::<K>().await,
                false => self.drive::<K>().instrument(span).await,
            }
        }
    }

    /// [`run`](Self::run)'s body.
    async fn drive<K: Start<T, B>>(&mut self) {
        self.deadline_sleep = self.deadline.map(sleep_until);
        if self.expired_unstarted().await {
            self.publish();
            return;
        }
        let mut first = std::pin::pin!(None);
        let mut wire = next_wire_batch();
        // A one-task batch's first attempt waits for its transfer
        // without the general wait's events: a success is the outcome
        // at once; anything else (a failure, abandonment, the deadline)
        // goes on in the general wait, as if it had waited there.
        let mut lean = self.tasks.len() == 1;
        loop {
            if let Some(buf) = self.take_queued_first() {
                first.set(Some(K::start(&self.transport, &self.tasks[0], buf, wire)));
            }
            self.launch(wire);
            timeline::mark(Step::BatchLaunched);
            if std::mem::take(&mut lean) {
                if let Some((res, buf)) = self.first_result(first.as_mut()).await {
                    let failed = res.is_err();
                    self.tasks[0].record(res, buf);
                    if !failed {
                        // Completed, answered, never fenced: nothing
                        // to confirm, retire or retry.
                        timeline::mark(Step::BatchQuiesced);
                        break;
                    }
                    self.on_progress(wire);
                }
            }
            self.wait_quiescent(wire, first.as_mut()).await;
            if self.unconfirmed().next().is_some() {
                // Rare (a lost connection): boxed, so that its state does
                // not sit in every batch's future.
                Box::pin(self.confirm_remote(wire)).await;
            }
            // Nothing of this wire batch moves any more: the peers it fenced
            // (the only ones that keep state for it) may forget it. No
            // allocation on the common path, a batch that never fenced.
            if let Some(fences) = &self.fences {
                self.retire(fences, wire);
            }
            if !self.may_retry() || !self.retry().await {
                break;
            }
            wire = next_wire_batch();
        }
        self.publish();
    }

    /// True if the deadline passed before anything started (the call that
    /// submitted the batch waited, on a busy engine thread, past it): then
    /// every task ends fenced with nothing sent, which needs no fence. The
    /// deadline's first poll reads the clock the driver reads anyway.
    async fn expired_unstarted(&mut self) -> bool {
        let Some(s) = self.deadline_sleep.as_mut() else {
            return false;
        };
        let expired = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *s).poll(cx).is_ready()));
        if !expired.await {
            return false;
        }
        tracing::info!(
            batch = self.id,
            "the deadline passed before the batch started: nothing sent"
        );
        self.deadline_sleep = None;
        for t in &mut self.tasks {
            let buf = t.buf.take().expect("a queued task holds its buffer");
            t.record(Err(TransferError::Fenced), buf);
        }
        true
    }

    /// Builds the outcome from the terminal tasks and hands it over (or,
    /// for an abandoned batch, releases the buffers).
    fn publish(&mut self) {
        let q = self.finish();
        let outcome = if q.all_completed() {
            "completed"
        } else {
            "failed"
        };
        tracing::info!(
            outcome,
            unknown_first = self.shared.unknown.get(),
            fence_us = q.fence_time().map(|d| d.as_micros() as u64),
            elapsed_us = q.elapsed().as_micros() as u64,
            "batch quiesced"
        );
        self.shared.finished.set(true);
        if self.shared.abandoned.get() {
            tracing::info!("abandoned batch drained; releasing its buffers");
            drop(q);
        } else {
            *self.shared.final_result.borrow_mut() = Some(q);
            self.shared.wake_waiter();
        }
    }

    /// Marks the first task in flight if it is queued, and hands out its
    /// buffer for [`Start::start`].
    fn take_queued_first(&mut self) -> Option<B> {
        let t = self.tasks.first_mut()?;
        if !matches!(t.state, TaskState::Queued) {
            return None;
        }
        t.attempts = t.attempts.saturating_add(1);
        t.state = TaskState::InFlight(InFlight::Held);
        Some(t.buf.take().expect("a queued task holds its buffer"))
    }

    /// Starts every other queued task's transfer.
    fn launch(&mut self, wire: u64) {
        if self.tasks.len() < 2 {
            return;
        }
        let inline = self.tasks.len() <= INLINE_TASKS;
        for t in self.tasks.iter_mut().skip(1) {
            if !matches!(t.state, TaskState::Queued) {
                continue;
            }
            let buf = t.buf.take().expect("a queued task holds its buffer");
            let fut = (t.launch)(&self.transport, &t.target, buf, wire);
            // Either way the transfer future owns its buffer until it
            // resolves; if the driver is dropped (runtime shutdown), a dropped
            // transfer parks its ops in the reactor until they are reaped.
            let f = if inline {
                InFlight::Inline(fut)
            } else {
                InFlight::Spawned(spawn_local(fut))
            };
            t.attempts = t.attempts.saturating_add(1);
            t.state = TaskState::InFlight(f);
        }
    }

    fn all_terminal(&self) -> bool {
        self.tasks
            .iter()
            .all(|t| matches!(t.state, TaskState::Done(_)))
    }

    fn fencing(&self) -> bool {
        self.fence_started.is_some()
    }

    /// The first task's transfer's result, or `None` once another event
    /// came (abandonment or the deadline: no fence has started yet), which
    /// the general wait then takes, the transfer still in flight. A one-task
    /// batch's wait: the general one's events in its order, without its
    /// bookkeeping.
    fn first_result<'a, F: Future<Output = Transferred<B>>>(
        &'a mut self,
        mut first: Pin<&'a mut Option<F>>,
    ) -> impl Future<Output = Option<Transferred<B>>> + 'a {
        std::future::poll_fn(move |cx| {
            if let Poll::Ready(out) = poll_held(first.as_mut(), cx) {
                return Poll::Ready(Some(out));
            }
            self.poll_other_events(cx).map(|_| None)
        })
    }

    /// After transfers finished: a FailFast batch with a failed task fences
    /// what is still in flight (if anything is: a batch whose last
    /// transfer failed has nothing to fence, and reports no fence).
    fn on_progress(&mut self, wire: u64) {
        let failed = self
            .tasks
            .iter()
            .any(|t| matches!(t.state, TaskState::Done(TaskStatus::Failed(_))));
        if failed
            && self.opts.policy == FailurePolicy::FailFast
            && !self.fencing()
            && !self.all_terminal()
        {
            self.start_fence(wire, Instant::now() + self.opts.fence_grace, "task failed");
        }
    }

    /// Waits until every task is terminal, fencing on FailFast failures,
    /// the deadline, or abandonment.
    async fn wait_quiescent<F: Future<Output = Transferred<B>>>(
        &mut self,
        wire: u64,
        mut first: Pin<&mut Option<F>>,
    ) {
        while !self.all_terminal() {
            match self.next_event(first.as_mut()).await {
                Event::Progress => self.on_progress(wire),
                Event::Deadline => {
                    self.deadline_sleep = None;
                    if !self.fencing() {
                        let hard =
                            self.deadline.unwrap_or_else(Instant::now) + self.opts.fence_grace;
                        self.start_fence(wire, hard, "deadline");
                    }
                }
                Event::Abandoned => {
                    if !self.fencing() {
                        self.start_fence(wire, Instant::now() + self.opts.fence_grace, "dropped");
                    }
                }
                Event::SoftLimit => {
                    self.soft = None;
                    tracing::warn!(
                        batch = self.id,
                        "remote fence not done at half grace; tearing down connections"
                    );
                    for p in self.inflight_peers() {
                        self.transport.abort(&p);
                    }
                }
                Event::HardLimit => {
                    self.hard = None;
                    if !self.shared.unknown.get() {
                        tracing::warn!(
                            batch = self.id,
                            "fence not finished within grace: CompletionUnknown"
                        );
                        *self.shared.settled.borrow_mut() =
                            self.tasks.iter().map(Task::settled).collect();
                        self.shared.unknown.set(true);
                        self.shared.wake_waiter();
                    }
                }
            }
        }
        timeline::mark(Step::BatchQuiesced);
        if let Some(s) = self.fence_started {
            self.fence_time.get_or_insert(s.elapsed());
        }
    }

    /// Records finished transfers; otherwise waits for one, or a timer.
    async fn next_event<F: Future<Output = Transferred<B>>>(
        &mut self,
        mut first: Pin<&mut Option<F>>,
    ) -> Event {
        std::future::poll_fn(|cx| {
            let mut progress = false;
            for t in self.tasks.iter_mut() {
                let TaskState::InFlight(f) = &mut t.state else {
                    continue;
                };
                let (res, buf) = match f {
                    InFlight::Held => match poll_held(first.as_mut(), cx) {
                        Poll::Ready(out) => out,
                        Poll::Pending => continue,
                    },
                    InFlight::Inline(fut) => match Pin::new(fut).poll(cx) {
                        Poll::Ready(out) => out,
                        Poll::Pending => continue,
                    },
                    InFlight::Spawned(h) => match Pin::new(h).poll(cx) {
                        Poll::Ready(Ok(out)) => out,
                        Poll::Pending => continue,
                        // A transport that panics has lost track of a buffer:
                        // there is no outcome to give, only the panic.
                        Poll::Ready(Err(JoinError::Panicked(p))) => std::panic::resume_unwind(p),
                        Poll::Ready(Err(JoinError::Cancelled)) => {
                            unreachable!("transfers are never aborted")
                        }
                    },
                };
                t.record(res, buf);
                progress = true;
            }
            if progress {
                return Poll::Ready(Event::Progress);
            }
            self.poll_other_events(cx)
        })
        .await
    }

    /// The events other than a transfer's end, in the order the driver
    /// takes them (abandonment, the deadline, the fence's half and whole
    /// grace); with none, the driver's waker is registered.
    fn poll_other_events(&mut self, cx: &mut Context<'_>) -> Poll<Event> {
        if self.shared.abandoned.get() && !self.fencing() {
            return Poll::Ready(Event::Abandoned);
        }
        if let Some(s) = self.deadline_sleep.as_mut() {
            if Pin::new(s).poll(cx).is_ready() {
                return Poll::Ready(Event::Deadline);
            }
        }
        if let Some(s) = self.soft.as_mut() {
            if Pin::new(s).poll(cx).is_ready() {
                return Poll::Ready(Event::SoftLimit);
            }
        }
        if let Some(s) = self.hard.as_mut() {
            if Pin::new(s).poll(cx).is_ready() {
                return Poll::Ready(Event::HardLimit);
            }
        }
        *self.shared.driver.borrow_mut() = Some(cx.waker().clone());
        Poll::Pending
    }

    /// False if no task failed (the common case): nothing to retry, and no
    /// [`retry`](Self::retry) future to build.
    fn may_retry(&self) -> bool {
        !self
            .tasks
            .iter()
            .all(|t| matches!(t.state, TaskState::Done(TaskStatus::Completed)))
    }

    /// After quiescence: re-queue failed tasks if the policy allows it.
    async fn retry(&mut self) -> bool {
        let attempt = self.tasks.iter().map(|t| t.attempts).max().unwrap_or(0);
        if attempt > self.opts.retry.attempts
            || self.shared.abandoned.get()
            || self.shared.unknown.get()
        {
            return false;
        }
        // A retry rewrites what the old attempt may still deliver: only once
        // every target confirmed that nothing more of it lands. (Nothing of
        // a read lands at its target: its destination is the caller's
        // buffer, quiescent once its transfer resolved.)
        if self.unconfirmed().any(|t| t.writes) {
            tracing::warn!(
                batch = self.id,
                "not retrying: a target did not confirm the failed attempt"
            );
            return false;
        }
        if self.deadline.is_some_and(|d| Instant::now() >= d) {
            return false;
        }
        let mut any = false;
        for t in &self.tasks {
            match &t.state {
                TaskState::Done(TaskStatus::Completed) => {}
                TaskState::Done(TaskStatus::Fenced) => any = true,
                TaskState::Done(TaskStatus::Failed(e)) if e.is_retryable() => any = true,
                // A refusal (bounds, rights, …) will not change on retry.
                _ => return false,
            }
        }
        if !any {
            return false;
        }
        let backoff = self
            .opts
            .retry
            .backoff
            .saturating_mul(2u32.saturating_pow(attempt.saturating_sub(1)));
        tracing::info!(attempt, ?backoff, "retrying failed tasks after quiescence");
        // The backoff ends early at the deadline or when the caller drops
        // the batch; neither may be followed by a new attempt.
        let end = Instant::now() + backoff;
        let mut nap = sleep_until(self.deadline.map_or(end, |d| d.min(end)));
        std::future::poll_fn(|cx| {
            if self.shared.abandoned.get() || Pin::new(&mut nap).poll(cx).is_ready() {
                return Poll::Ready(());
            }
            *self.shared.driver.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        })
        .await;
        if self.shared.abandoned.get() || self.deadline.is_some_and(|d| Instant::now() >= d) {
            tracing::info!("not retrying: the deadline passed or the batch was dropped");
            return false;
        }
        for t in &mut self.tasks {
            if !matches!(t.state, TaskState::Done(TaskStatus::Completed)) {
                t.state = TaskState::Queued;
            }
        }
        // A new attempt gets fresh fence timers and fences.
        self.fence_started = None;
        self.soft = None;
        self.hard = None;
        self.hard_at = None;
        self.fences = None;
        true
    }

    fn finish(&mut self) -> Quiesced<B> {
        let (tasks, buffers) = match self.tasks.len() {
            // A one-task batch (most small transfers): its report and buffer
            // go inline, without the general path's loop and growth checks.
            1 => {
                let t = self.tasks.pop().expect("one task");
                let (report, buf) = t.into_report();
                (smallvec![report], smallvec![buf])
            }
            n => {
                let mut tasks = SmallVec::with_capacity(n);
                let mut buffers = SmallVec::with_capacity(n);
                for t in self.tasks.drain(..) {
                    let (report, buf) = t.into_report();
                    tasks.push(report);
                    buffers.push(buf);
                }
                (tasks, buffers)
            }
        };
        Quiesced {
            tasks,
            buffers,
            fence_ns: self
                .fence_time
                .map_or(crate::outcome::NO_FENCE, crate::outcome::nanos),
            elapsed_ns: crate::outcome::nanos(self.started.elapsed()),
        }
    }
}
