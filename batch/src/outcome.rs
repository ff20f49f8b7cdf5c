//! What a batch resolves to. An outcome exists only once every task is
//! terminal and no kernel, NIC or peer can touch the buffers; the buffers
//! come back inside it, each exactly once, in the order the tasks were added.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::panic::{catch_unwind, resume_unwind, AssertUnwindSafe};
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use quiesce_transports::TransferError;
use smallvec::SmallVec;

mod ticket;

pub use self::ticket::Ticket;

/// How one task ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TaskStatus {
    /// Every byte moved.
    Completed,
    /// The task failed on its own; the error says why.
    Failed(TransferError),
    /// The batch fenced the task before it completed (part of a write may
    /// have landed: see [`TaskReport::bytes`]).
    Fenced,
}

/// What the target side has confirmed about a task's last attempt.
///
/// The caller's buffer is quiescent in every case (that is what an outcome
/// is). This says whether the *target's* memory is too: whether any byte of
/// the task that was sent can still land there.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RemoteState {
    /// The target answered every request of the task (it completed, or the
    /// target refused it), or nothing was sent: nothing more of it lands.
    Answered,
    /// The target acknowledged a fence of the task's wire batch: nothing more
    /// of it lands.
    Fenced,
    /// Only a local teardown happened (the connection was lost or torn down,
    /// and no fence was acknowledged in time). For a write, bytes already
    /// sent may still land in the target range — after this outcome, and
    /// over newer writes — until the target revokes the range or a later
    /// fence is confirmed. A read's destination is the caller's buffer, which
    /// is safe either way.
    Unconfirmed,
}

/// One task's result.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TaskReport {
    /// How it ended.
    pub status: TaskStatus,
    /// Bytes moved. For a fenced (or revoked) write, or one the target could
    /// not finish reaching (local transport, `Unreachable`; for a read so
    /// cut, the bytes it had pushed): the bytes that landed before the cut,
    /// summed over the transfer's slices — not necessarily
    /// a prefix of the range, since slices land in parallel, as the target
    /// answered them. For a task that failed without its target's answer
    /// (a lost connection, a deadline): 0, and any part of the range may
    /// hold its bytes — also when `remote` says a fence confirmed that
    /// nothing *more* lands ([`RemoteState::Fenced`]), which says nothing of
    /// what landed before it; with [`RemoteState::Unconfirmed`] the range
    /// may still receive them.
    pub bytes: u64,
    /// Attempts made (1 unless retried).
    pub attempts: u32,
    /// Whether the target confirmed that nothing more of the task lands.
    pub remote: RemoteState,
}

/// The quiescent result of a batch: reports and the buffers.
#[derive(Debug)]
pub struct Quiesced<B> {
    /// Held inline for a one-task batch, as are the buffers: a small batch's
    /// outcome allocates nothing.
    pub(crate) tasks: SmallVec<[TaskReport; 1]>,
    pub(crate) buffers: SmallVec<[B; 1]>,
    /// Nanoseconds, [`NO_FENCE`] for none; and from submit to quiescence.
    /// Two `u64`s rather than `Option<Duration>` and `Duration`: 16 bytes
    /// fewer, so a one-task outcome fits in 128 and its moves (a dozen
    /// per batch, from the driver to the caller) are inline stores, not
    /// `memcpy` calls.
    pub(crate) fence_ns: u64,
    pub(crate) elapsed_ns: u64,
}

/// [`Quiesced::fence_ns`] of a batch that did not fence.
pub(crate) const NO_FENCE: u64 = u64::MAX;

/// A duration as [`Quiesced`] keeps it (saturating at ~584 years).
pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(NO_FENCE - 1)
}

impl<B> Quiesced<B> {
    /// One report per task, in the order the tasks were added.
    pub fn tasks(&self) -> &[TaskReport] {
        &self.tasks
    }

    /// True if every task completed.
    pub fn all_completed(&self) -> bool {
        self.tasks.iter().all(|t| t.status == TaskStatus::Completed)
    }

    /// True if the target side confirmed, for every task, that nothing more
    /// of the batch lands ([`RemoteState::Answered`] or
    /// [`RemoteState::Fenced`]). False means some write's bytes may still
    /// land at its target: revoke the range there, or fence again, before
    /// relying on the target's memory.
    pub fn remote_confirmed(&self) -> bool {
        self.tasks
            .iter()
            .all(|t| t.remote != RemoteState::Unconfirmed)
    }

    /// The buffers, in task order. Nothing else can touch them.
    pub fn buffers(&self) -> &[B] {
        &self.buffers
    }

    /// The buffers, mutably.
    pub fn buffers_mut(&mut self) -> &mut [B] {
        &mut self.buffers
    }

    /// Takes the buffers, in task order (`.collect()` them for a `Vec`; a
    /// one-task batch's comes out without an allocation).
    pub fn into_buffers(self) -> Buffers<B> {
        Buffers(self.buffers.into_iter())
    }

    /// Takes the reports and the buffers, both in task order.
    pub fn into_parts(self) -> (Vec<TaskReport>, Vec<B>) {
        (self.tasks.into_vec(), self.buffers.into_vec())
    }

    /// [`into_parts`](Self::into_parts) as held: inline for one task.
    pub(crate) fn into_inline_parts(self) -> (SmallVec<[TaskReport; 1]>, SmallVec<[B; 1]>) {
        (self.tasks, self.buffers)
    }

    /// How long the fence took (from starting it to quiescence), if the
    /// batch fenced its transfers: the first such fence, for a batch that
    /// was retried after it (a fence sent afterwards only to confirm what
    /// the targets hold is not counted).
    pub fn fence_time(&self) -> Option<Duration> {
        (self.fence_ns != NO_FENCE).then(|| Duration::from_nanos(self.fence_ns))
    }

    /// From submit to quiescence.
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(self.elapsed_ns)
    }

    /// The C-compatible code: 0 if every task completed, -1 otherwise (and
    /// nothing touches the buffers any more; whether the targets confirmed
    /// is [`remote_confirmed`](Self::remote_confirmed)).
    pub fn sync_code(&self) -> i32 {
        if self.all_completed() {
            crate::SYNC_OK
        } else {
            crate::SYNC_FAILED
        }
    }
}

/// The buffers of a quiesced batch, in task order: an iterator that owns
/// them ([`Quiesced::into_buffers`]).
pub struct Buffers<B>(smallvec::IntoIter<[B; 1]>);

impl<B> Iterator for Buffers<B> {
    type Item = B;

    fn next(&mut self) -> Option<B> {
        self.0.next()
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        self.0.size_hint()
    }
}

impl<B> DoubleEndedIterator for Buffers<B> {
    fn next_back(&mut self) -> Option<B> {
        self.0.next_back()
    }
}

impl<B> ExactSizeIterator for Buffers<B> {}

impl<B> std::iter::FusedIterator for Buffers<B> {}

impl<B: std::fmt::Debug> std::fmt::Debug for Buffers<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("Buffers").field(&self.0.as_slice()).finish()
    }
}

/// A batch's outcome.
#[derive(Debug)]
pub enum Outcome<B> {
    /// Every task is terminal and the buffers are back.
    Quiesced(Quiesced<B>),
    /// The fence did not finish within deadline + grace. The ticket keeps
    /// the buffers until the batch drains; await it (or poll it) for them.
    CompletionUnknown(Ticket<B>),
}

impl<B> Outcome<B> {
    /// 0 (all completed), -1 (failed, buffers quiescent) or -2 (unknown).
    pub fn sync_code(&self) -> i32 {
        match self {
            Outcome::Quiesced(q) => q.sync_code(),
            Outcome::CompletionUnknown(_) => crate::SYNC_UNKNOWN,
        }
    }

    /// The quiescent result, waiting on the ticket if there is one.
    pub async fn quiesced(self) -> Quiesced<B> {
        match self {
            Outcome::Quiesced(q) => q,
            Outcome::CompletionUnknown(t) => t.wait().await,
        }
    }
}

/// Where the driver publishes results for the `Submitted` future and a ticket.
pub(crate) struct Handoff<B> {
    pub(crate) final_result: RefCell<Option<Quiesced<B>>>,
    pub(crate) finished: Cell<bool>,
    /// The driver decided `CompletionUnknown`.
    pub(crate) unknown: Cell<bool>,
    /// When it did: each task's report if it was terminal then (see
    /// [`Ticket::settled`]). Empty until then.
    pub(crate) settled: RefCell<Vec<Option<TaskReport>>>,
    /// Nobody will collect the result: drop the buffers once drained.
    pub(crate) abandoned: Cell<bool>,
    pub(crate) waiter: RefCell<Option<Waker>>,
    pub(crate) driver: RefCell<Option<Waker>>,
    /// The panic of a transfer of this batch after its driver went on as a
    /// task of its own: the result the ticket raises instead of draining.
    panic: RefCell<Option<Box<dyn Any + Send>>>,
}

impl<B> Default for Handoff<B> {
    fn default() -> Self {
        Handoff {
            final_result: RefCell::new(None),
            finished: Cell::new(false),
            unknown: Cell::new(false),
            settled: RefCell::new(Vec::new()),
            abandoned: Cell::new(false),
            waiter: RefCell::new(None),
            driver: RefCell::new(None),
            panic: RefCell::new(None),
        }
    }
}

thread_local! {
    /// Hand-offs of finished batches that nothing held any more, for the
    /// thread's next batches (of any buffer type: found by downcast). A
    /// one-task batch's hand-off is its only allocation otherwise: ~130
    /// instructions of `malloc` and `free` per small transfer.
    static SPARE_HANDOFFS: RefCell<Vec<Rc<dyn Any>>> = const { RefCell::new(Vec::new()) };
}

/// Most spare hand-offs a thread keeps (a few buffer types at once).
const SPARE_HANDOFFS_MAX: usize = 4;

impl<B: 'static> Handoff<B> {
    /// A hand-off for a new batch: a spare one of this buffer type if the
    /// thread has one (see [`Handoff::recycle`]), else a new one.
    pub(crate) fn new_shared() -> Rc<Self> {
        SPARE_HANDOFFS
            .try_with(|spare| {
                let mut spare = spare.try_borrow_mut().ok()?;
                let i = spare.iter().rposition(|h| (**h).is::<Self>())?;
                spare.swap_remove(i).downcast::<Self>().ok()
            })
            .ok()
            .flatten()
            .unwrap_or_else(|| Rc::new(Handoff::default()))
    }

    /// Keeps `h` as a spare if nothing else holds it (no driver, no ticket,
    /// no weak reference) and its batch finished with its result taken: it
    /// is as new once reset. Anything else is left alone, so a spare is
    /// only ever reset state — no buffer, no waker.
    pub(crate) fn recycle(h: &mut Rc<Self>) {
        let Some(state) = Rc::get_mut(h) else {
            return;
        };
        if !state.finished.get() || state.unknown.get() || state.final_result.get_mut().is_some() {
            return;
        }
        state.finished.set(false);
        state.abandoned.set(false);
        state.settled.get_mut().clear();
        *state.waiter.get_mut() = None;
        *state.driver.get_mut() = None;
        let _ = SPARE_HANDOFFS.try_with(|spare| {
            if let Ok(mut spare) = spare.try_borrow_mut() {
                if spare.len() < SPARE_HANDOFFS_MAX {
                    spare.push(h.clone());
                }
            }
        });
    }
}

impl<B> Handoff<B> {
    pub(crate) fn wake_waiter(&self) {
        // Taken first: a waker that polls its task at once finds the cell
        // free.
        let w = self.waiter.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    pub(crate) fn wake_driver(&self) {
        let w = self.driver.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }

    fn abandon(&self) {
        if !self.finished.get() {
            self.abandoned.set(true);
            self.wake_driver();
        } else if let Some(q) = self.final_result.borrow_mut().take() {
            drop(q);
        }
    }
}

/// The future of a submitted batch.
///
/// Dropping it before it resolves is safe: the batch fences what is in
/// flight and stays parked in the reactor until it drains; then its buffers
/// are released (with a `tracing` event).
#[must_use = "a submitted batch resolves only when awaited (dropping it fences it)"]
pub struct Submitted<B> {
    pub(crate) shared: Rc<Handoff<B>>,
    /// [`Handoff::recycle`] for this buffer type (which `submit` knows to
    /// be `'static`), run when a finished batch's future is dropped.
    pub(crate) recycle: fn(&mut Rc<Handoff<B>>),
    pub(crate) done: bool,
    /// The task poll in which `submit` polled the driver (with that task's
    /// waker); taken by the first poll of this future.
    pub(crate) submitting: Option<quiesce_runtime::TaskPoll>,
    /// The batch driver, polled in place by this future (no task of its
    /// own, no cross-task wake per batch). It moves into a task of its own
    /// when the batch must go on without this future: when it is dropped in
    /// flight, or resolves to `CompletionUnknown`. `None` once finished.
    pub(crate) driver: Option<DriverFuture>,
    /// The runtime the batch was submitted on, where its driver goes on.
    pub(crate) runtime: Option<quiesce_runtime::Handle>,
    /// [`detach`] for this buffer type (which `submit` knows to be
    /// `'static`).
    pub(crate) detach: Detach<B>,
}

/// How a [`Submitted`] lets its driver go on without it.
pub(crate) type Detach<B> = fn(Option<&quiesce_runtime::Handle>, DriverFuture, &Rc<Handoff<B>>);

/// The batch driver's future: boxed, in a block that the thread's next
/// batch of the same shape reuses (no `malloc`/`free` per batch).
pub(crate) type DriverFuture = quiesce_runtime::recycle::RecycledFuture;

/// Lets `driver` run on, as a task of the runtime the batch was submitted
/// on, without the `Submitted` that polled it (wherever that is dropped).
/// Once that runtime is gone nothing can drive it: it is leaked, with
/// whatever it holds, rather than freeing buffers a NIC or the kernel may
/// still touch. A transfer that panics there ends the task and goes to
/// the batch's ticket (see [`Ticket::wait`]), or to the log if nothing
/// holds one.
pub(crate) fn detach<B: 'static>(
    runtime: Option<&quiesce_runtime::Handle>,
    driver: DriverFuture,
    shared: &Rc<Handoff<B>>,
) {
    let left = match runtime {
        Some(rt) => rt
            .spawn_local(Detached {
                driver,
                shared: shared.clone(),
            })
            .err()
            .map(|d| d.driver),
        None => Some(driver),
    };
    if let Some(d) = left {
        tracing::error!("batch dropped in flight after its runtime shut down: leaking its buffers");
        std::mem::forget(d);
    }
}

/// A batch driver running as a task of its own, which hands a panic of one
/// of its transfers to the batch's [`Ticket`] rather than to the executor.
struct Detached<B> {
    driver: DriverFuture,
    shared: Rc<Handoff<B>>,
}

impl<B> Future for Detached<B> {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        match catch_unwind(AssertUnwindSafe(|| Pin::new(&mut this.driver).poll(cx))) {
            Ok(done) => done,
            Err(panic) => {
                // Its state was dropped on the way out (the operations it
                // held parked in their reactor); what it had not sent is
                // lost, and the target was never fenced: the batch can
                // never drain.
                tracing::error!("a transfer panicked in a batch going on without its `Submitted`: the batch is lost");
                if !this.shared.abandoned.get() {
                    *this.shared.panic.borrow_mut() = Some(panic);
                    this.shared.wake_waiter();
                }
                Poll::Ready(())
            }
        }
    }
}

impl<B> Future for Submitted<B> {
    type Output = Outcome<B>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Outcome<B>> {
        // Polled again, it would hand out a second ticket (the drop of
        // either abandons the batch) or take the drained result from under
        // the first; after a panic it passed on, it would wait for good.
        assert!(!self.done, "`Submitted` polled after it resolved");
        // Right after `submit`, in the same poll of the same task, with
        // nothing having woken it since: the driver, polled at submit with
        // this task's waker, can have made no progress, and its wakers are
        // this task's already. (Awaited later, or elsewhere, it is polled.)
        let unchanged = self
            .submitting
            .take()
            .is_some_and(|p| p.unwoken() && p.wakes(cx.waker()));
        if let (false, Some(d)) = (unchanged, self.driver.as_mut()) {
            // A transfer that panicked lost track of a buffer: the panic is
            // the batch's only result. The driver it unwound through is
            // finished (its state dropped on the way out, the ops it held
            // parked in their reactor): kept, it would be set running again
            // when this future is dropped, and panic a second time there.
            match catch_unwind(AssertUnwindSafe(|| Pin::new(d).poll(cx))) {
                Ok(Poll::Ready(())) => self.driver = None,
                Ok(Poll::Pending) => {}
                Err(panic) => {
                    // Resolved: the panic is its result (a later poll would
                    // find no driver to wait for, and perhaps a ticket that
                    // could never resolve).
                    self.driver = None;
                    self.done = true;
                    resume_unwind(panic);
                }
            }
        }
        let sh = self.shared.clone();
        if let Some(q) = sh.final_result.borrow_mut().take() {
            self.done = true;
            return Poll::Ready(Outcome::Quiesced(q));
        }
        if sh.unknown.get() {
            self.done = true;
            if let Some(d) = self.driver.take() {
                (self.detach)(self.runtime.as_ref(), d, &self.shared);
            }
            return Poll::Ready(Outcome::CompletionUnknown(Ticket {
                shared: sh.clone(),
                taken: false,
            }));
        }
        if self.driver.is_none() {
            *sh.waiter.borrow_mut() = Some(cx.waker().clone());
        }
        Poll::Pending
    }
}

impl<B> Drop for Submitted<B> {
    fn drop(&mut self) {
        if self.done {
            (self.recycle)(&mut self.shared);
        } else {
            tracing::debug!("in-flight batch dropped: fencing it and parking it until it drains");
            self.shared.abandon();
            if let Some(d) = self.driver.take() {
                (self.detach)(self.runtime.as_ref(), d, &self.shared);
            }
        }
    }
}
