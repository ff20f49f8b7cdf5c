//! Single-threaded task executor: `spawn_local`, `JoinHandle`, wakers that
//! work from any thread, and the cooperative budget.

use std::any::Any;
use std::cell::RefCell;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskCx, Poll, Wake, Waker};

use crate::context;
use crate::driver::Unparker;
use crate::recycle::RecycledFuture;

/// Task id of the future given to `block_on`.
pub(crate) const MAIN_TASK: u64 = u64::MAX;

/// Operations a task may complete in one poll before it must yield.
pub(crate) const OP_BUDGET: u32 = 128;

/// A spawned task: its future, and the waker that queues it again.
pub(crate) struct Task {
    pub(crate) gen: u32,
    /// Boxed in recycled blocks (the harness, and the user's future inside
    /// it): a batch of 64 tasks spawns a task per transfer, which would
    /// overflow glibc's per-thread cache (7 blocks a size) every batch.
    pub(crate) fut: Option<RecycledFuture>,
    pub(crate) waker: Arc<TaskWaker>,
}

/// Wakes one task, from this thread or any other.
pub(crate) struct TaskWaker {
    pub(crate) id: u64,
    /// Set while the task sits in a ready queue, so it is queued once.
    pub(crate) queued: AtomicBool,
    pub(crate) unparker: Arc<Unparker>,
}

impl TaskWaker {
    pub(crate) fn new(id: u64, unparker: Arc<Unparker>) -> Arc<Self> {
        Arc::new(TaskWaker {
            id,
            queued: AtomicBool::new(false),
            unparker,
        })
    }
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }

    fn wake_by_ref(self: &Arc<Self>) {
        if self.queued.swap(true, Ordering::AcqRel) {
            return;
        }
        if context::current_id() == self.unparker.runtime_id {
            context::with(|cx| cx.ready.borrow_mut().push_back(self.id));
        } else {
            self.unparker.wake_remote(self.id);
        }
    }
}

/// Why a task produced no value.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// The task was aborted through its `JoinHandle`, or its runtime shut down.
    #[error("task was cancelled")]
    Cancelled,
    /// The task panicked; the payload is the panic's.
    #[error("task panicked")]
    Panicked(Box<dyn Any + Send + 'static>),
}

struct JoinState<T> {
    output: Option<Result<T, JoinError>>,
    /// The output was set (it stays so once the handle took it).
    finished: bool,
    waiter: Option<Waker>,
    aborted: bool,
    /// The task's own waker, to get it polled (and dropped) on abort.
    task_waker: Option<Waker>,
}

/// Owned permission to await a spawned task's output or abort it.
///
/// Dropping the handle detaches the task: it runs on to completion.
pub struct JoinHandle<T> {
    state: Rc<RefCell<JoinState<T>>>,
}

impl<T> JoinHandle<T> {
    /// Asks the task to stop. Its future is dropped at its next poll, which
    /// parks any operation it had in flight in the driver until the kernel is
    /// done with the operation's buffers. Awaiting the handle then gives
    /// `Err(JoinError::Cancelled)` unless the task had already finished.
    pub fn abort(&self) {
        let mut st = self.state.borrow_mut();
        st.aborted = true;
        if let Some(w) = st.task_waker.take() {
            w.wake();
        }
    }

    /// True once the task has produced its output (or was cancelled).
    pub fn is_finished(&self) -> bool {
        self.state.borrow().finished
    }
}

impl<T> Future for JoinHandle<T> {
    type Output = Result<T, JoinError>;

    fn poll(self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<Self::Output> {
        let mut st = self.state.borrow_mut();
        match st.output.take() {
            Some(out) => Poll::Ready(out),
            None => {
                st.waiter = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

/// The future actually stored for a task: runs the user's future, and
/// publishes its output to the `JoinHandle`.
struct Harness<T> {
    fut: Option<RecycledFuture<T>>,
    state: Rc<RefCell<JoinState<T>>>,
}

impl<T> Harness<T> {
    /// Drops the future (which parks any op it still holds), then hands
    /// `out` to the handle — or the drop's panic, if it panicked: a panic
    /// there is the task's, as one in a poll is, and never leaves the turn.
    fn finish(&mut self, out: Result<T, JoinError>) {
        let fut = self.fut.take();
        let out = match (
            std::panic::catch_unwind(AssertUnwindSafe(|| drop(fut))),
            out,
        ) {
            // (A poll's panic first, if both.)
            (Err(payload), Ok(_) | Err(JoinError::Cancelled)) => Err(JoinError::Panicked(payload)),
            (_, out) => out,
        };
        let mut st = self.state.borrow_mut();
        if let Err(JoinError::Panicked(_)) = &out {
            tracing::error!("a quiesce task panicked");
        }
        st.output = Some(out);
        st.finished = true;
        st.task_waker = None;
        if let Some(w) = st.waiter.take() {
            drop(st);
            w.wake();
        }
    }
}

impl<T> Future for Harness<T> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut TaskCx<'_>) -> Poll<()> {
        // Harness is Unpin: the user future is boxed (recycled block).
        let this = self.get_mut();
        let aborted = {
            let mut st = this.state.borrow_mut();
            if !st.aborted {
                st.task_waker = Some(cx.waker().clone());
            }
            st.aborted
        };
        if aborted {
            // (`finish` drops the future first: that parks its in-flight ops.)
            this.finish(Err(JoinError::Cancelled));
            return Poll::Ready(());
        }
        let Some(fut) = this.fut.as_mut() else {
            return Poll::Ready(());
        };
        match std::panic::catch_unwind(AssertUnwindSafe(|| Pin::new(fut).poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => {
                this.finish(Ok(v));
                Poll::Ready(())
            }
            Err(payload) => {
                this.finish(Err(JoinError::Panicked(payload)));
                Poll::Ready(())
            }
        }
    }
}

impl<T> Drop for Harness<T> {
    fn drop(&mut self) {
        if self.fut.is_some() {
            // Dropped by a shutting-down runtime before it finished: as an
            // abort, the future's own drop may panic, and that panic is the
            // task's (its handle's answer). Out of here it would cut the
            // shutdown short before its drain, or abort a runtime dropped
            // while unwinding. So would a panic of the handle's waiter's
            // waker (anyone's code, woken by `finish`): not the task's, it
            // is logged, as the drain's wakers' are.
            let finish = AssertUnwindSafe(|| self.finish(Err(JoinError::Cancelled)));
            if std::panic::catch_unwind(finish).is_err() {
                tracing::error!("a task handle's waker panicked while a runtime shut down");
            }
        }
    }
}

/// [`spawn_local`] that hands the future back instead of panicking when the
/// thread has no runtime (or it is being torn down), or when its runtime
/// shut down: closed to new tasks, it would never poll nor drop one.
pub fn try_spawn_local<F>(fut: F) -> Result<JoinHandle<F::Output>, F>
where
    F: Future + 'static,
    F::Output: 'static,
{
    if context::try_with(|cx| cx.is_none_or(|cx| cx.closed.get())) {
        return Err(fut);
    }
    Ok(spawn_local(fut))
}

/// Spawns a `!Send` future on the runtime of the current thread.
///
/// # Panics
/// Outside a runtime.
pub fn spawn_local<F>(fut: F) -> JoinHandle<F::Output>
where
    F: Future + 'static,
    F::Output: 'static,
{
    context::with(|cx| spawn_on(cx, fut))
}

fn spawn_on<F>(cx: &context::Context, fut: F) -> JoinHandle<F::Output>
where
    F: Future + 'static,
    F::Output: 'static,
{
    let state = Rc::new(RefCell::new(JoinState {
        output: None,
        finished: false,
        waiter: None,
        aborted: false,
        task_waker: None,
    }));
    let harness = Harness {
        fut: Some(RecycledFuture::new(fut)),
        state: state.clone(),
    };
    let mut tasks = cx.tasks.borrow_mut();
    let entry = tasks.vacant_entry();
    let key = entry.key();
    let gen = cx.counters.next_gen();
    let id = task_id(key, gen);
    let spare = cx.spare_wakers.borrow_mut().pop();
    let waker = match spare {
        Some(mut w) => {
            let tw = Arc::get_mut(&mut w).expect("a spare waker is held by nothing else");
            tw.id = id;
            w
        }
        None => TaskWaker::new(id, cx.unparker.clone()),
    };
    waker.queued.store(true, Ordering::Relaxed);
    entry.insert(Task {
        gen,
        fut: Some(RecycledFuture::new(harness)),
        waker,
    });
    cx.ready.borrow_mut().push_back(id);
    cx.counters
        .tasks_spawned
        .set(cx.counters.tasks_spawned.get() + 1);
    JoinHandle { state }
}

/// A handle to one runtime, for work that must go on *there* wherever the
/// code holding it later runs (a batch dropped inside another runtime's
/// `block_on` keeps fencing on its own).
#[derive(Clone)]
pub struct Handle {
    cx: Rc<context::Context>,
}

impl Handle {
    /// The runtime running on this thread, if any.
    pub fn try_current() -> Option<Handle> {
        context::try_with(|cx| cx.map(|cx| Handle { cx: cx.clone() }))
    }

    /// Spawns `fut` on this handle's runtime, from anywhere on its thread.
    /// Hands the future back once that runtime has shut down.
    pub fn spawn_local<F>(&self, fut: F) -> Result<JoinHandle<F::Output>, F>
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        if self.cx.closed.get() {
            return Err(fut);
        }
        Ok(spawn_on(&self.cx, fut))
    }
}

/// Polls the task with id `id` once, if it still exists.
pub(crate) fn run_task(cx: &context::Context, id: u64) {
    let (key, gen) = task_slot(id);
    let (mut fut, waker) = {
        let mut tasks = cx.tasks.borrow_mut();
        match tasks.get_mut(key) {
            Some(t) if t.gen == gen => match t.fut.take() {
                Some(f) => (f, t.waker.clone()),
                None => return,
            },
            _ => return,
        }
    };
    waker.queued.store(false, Ordering::Release);
    let w = Waker::from(waker);
    let mut tcx = TaskCx::from_waker(&w);
    cx.budget.set(OP_BUDGET);
    let polling = begin_poll(cx, id);
    let done = Pin::new(&mut fut).poll(&mut tcx).is_ready();
    drop(polling);
    cx.counters.polls.set(cx.counters.polls.get() + 1);
    if done {
        let t = cx.tasks.borrow_mut().remove(key);
        drop(fut);
        drop(w);
        keep_waker(cx, t.waker);
    } else if let Some(t) = cx.tasks.borrow_mut().get_mut(key) {
        t.fut = Some(fut);
    }
}

/// A spawned task's id: its generation over its slot in the task slab, so
/// a stale id (a wake for a task that finished) never reaches the slot's
/// next task.
fn task_id(key: usize, gen: u32) -> u64 {
    (u64::from(gen) << 32) | key as u64
}

/// The slot and generation of a spawned task's id.
fn task_slot(id: u64) -> (usize, u32) {
    ((id & 0xffff_ffff) as usize, (id >> 32) as u32)
}

/// Marks the start of a poll of task `id` (see [`TaskPoll`]); the poll
/// ends when the guard is dropped, unwinding included.
pub(crate) fn begin_poll(cx: &context::Context, id: u64) -> Polling<'_> {
    cx.poll_seq.set(cx.poll_seq.get().wrapping_add(1));
    cx.polling.set(Some(id));
    Polling(cx)
}

/// A task poll in progress; clears `Context::polling` when dropped.
pub(crate) struct Polling<'a>(&'a context::Context);

impl Drop for Polling<'_> {
    fn drop(&mut self) {
        self.0.polling.set(None);
    }
}

/// One poll of one task, in progress on this thread: lets code that runs
/// inside it learn the task's waker, and later whether that same poll is
/// still going on with nothing having woken the task since it began.
///
/// A future that polls inner futures eagerly when it is *made* (a batch
/// starts its transfers in `submit`) can poll them with the task's own
/// waker; if its first poll comes while [`unwoken`](Self::unwoken) holds,
/// nothing they wait for can have happened (any event would have woken the
/// task), so polling them again would only find them pending.
pub struct TaskPoll {
    seq: u64,
    task: Arc<TaskWaker>,
    waker: Waker,
}

impl TaskPoll {
    /// The task poll in progress on this thread, if a task of a quiesce
    /// runtime (or `block_on`'s own future) is being polled.
    pub fn current() -> Option<TaskPoll> {
        context::try_with(|cx| {
            let cx = cx?;
            let id = cx.polling.get()?;
            let task = if id == MAIN_TASK {
                cx.main_task.borrow().clone()?
            } else {
                let (key, gen) = task_slot(id);
                let tasks = cx.tasks.borrow();
                let t = tasks.get(key).filter(|t| t.gen == gen)?;
                t.waker.clone()
            };
            Some(TaskPoll {
                seq: cx.poll_seq.get(),
                waker: Waker::from(task.clone()),
                task,
            })
        })
    }

    /// The polled task's waker.
    pub fn waker(&self) -> &Waker {
        &self.waker
    }

    /// True if `w` wakes this poll's task. (Not `Waker::will_wake`: two
    /// wakers made from the same task's handle in different codegen units
    /// may carry different vtable addresses.)
    pub fn wakes(&self, w: &Waker) -> bool {
        std::ptr::eq(w.data(), Arc::as_ptr(&self.task).cast())
    }

    /// True while the same poll of the same task goes on and nothing has
    /// woken the task since that poll began.
    pub fn unwoken(&self) -> bool {
        // Same runtime (task ids and poll numbers are per runtime), same
        // poll, same task.
        let same_poll = context::try_with(|cx| {
            cx.is_some_and(|cx| {
                cx.id == self.task.unparker.runtime_id
                    && cx.poll_seq.get() == self.seq
                    && cx.polling.get() == Some(self.task.id)
            })
        });
        same_poll && !self.task.queued.load(Ordering::Acquire)
    }
}

impl std::fmt::Debug for TaskPoll {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TaskPoll")
            .field("task", &self.task.id)
            .field("seq", &self.seq)
            .finish()
    }
}

/// Most spare wakers a runtime keeps.
const SPARE_WAKERS: usize = 64;

/// Keeps a finished task's waker for the next spawn if nothing else holds
/// it (no clone of it is left anywhere, so no wake can reach its next task
/// by mistake); drops it otherwise.
fn keep_waker(cx: &context::Context, mut waker: Arc<TaskWaker>) {
    if Arc::get_mut(&mut waker).is_none() {
        return;
    }
    let mut spare = cx.spare_wakers.borrow_mut();
    if spare.len() < SPARE_WAKERS {
        spare.push(waker);
    }
}

/// Bytes the epoll backend's ops may move per reactor tick, over all tasks.
///
/// On epoll an op's syscall runs inside the task's poll, so without a bound
/// one tick could push a 64 MiB write into a fast socket before the reactor
/// looks at anything — the target's refusal of a sibling task included, which
/// made FailFast ineffective. Once the tick has moved this much, byte-moving
/// ops wait for the next turn (the reactor polls, whatever it woke runs
/// first). io_uring needs no bound: its completions come through the reactor.
pub(crate) const TICK_BYTES: usize = 256 << 10;

/// Charges `n` moved bytes to this tick's byte budget.
pub(crate) fn charge_bytes(n: usize) {
    context::try_with(|cx| {
        if let Some(cx) = cx {
            cx.tick_bytes.set(cx.tick_bytes.get() + n);
        }
    })
}

/// Spends one unit of the running task's cooperative budget; an op that
/// moves bytes (`moves_bytes`) also waits once this tick's byte budget is
/// spent ([`TICK_BYTES`]). One look at the runtime's context for both.
///
/// Returns `Pending` (the task deferred past the next reactor turn) when
/// either is spent, so a task whose operations keep completing at once
/// still lets the reactor run. `moved`: bytes the op moved already (one
/// that finished before its first poll), charged with the unit when it
/// is Ready (an op that moves them later charges them then:
/// [`charge_bytes`]).
pub(crate) fn op_budget(tcx: &mut TaskCx<'_>, moves_bytes: bool, moved: usize) -> Poll<()> {
    // The budget is the polling task's: that of the runtime running now (none
    // outside a runtime, where nothing needs sharing).
    context::try_with(|cx| {
        let Some(cx) = cx else {
            return Poll::Ready(());
        };
        let b = cx.budget.get();
        if b == 0 || (moves_bytes && cx.tick_bytes.get() >= TICK_BYTES) {
            cx.deferred.borrow_mut().push(tcx.waker().clone());
            Poll::Pending
        } else {
            cx.budget.set(b - 1);
            if moved > 0 {
                cx.tick_bytes.set(cx.tick_bytes.get() + moved);
            }
            Poll::Ready(())
        }
    })
}

/// Yields to the scheduler: the task runs again after the reactor's next
/// turn, so I/O completions and other ready tasks go first.
pub async fn yield_now() {
    struct YieldNow(bool);
    impl Future for YieldNow {
        type Output = ();
        fn poll(mut self: Pin<&mut Self>, tcx: &mut TaskCx<'_>) -> Poll<()> {
            if self.0 {
                return Poll::Ready(());
            }
            self.0 = true;
            match context::try_with(|cx| {
                cx.map(|cx| cx.deferred.borrow_mut().push(tcx.waker().clone()))
            }) {
                Some(()) => {}
                None => tcx.waker().wake_by_ref(),
            }
            Poll::Pending
        }
    }
    YieldNow(false).await
}

/// Wakes wakers taken off a driver's or the timers' lists — every one,
/// even past one that panics (a waker is anyone's code): the rest were
/// taken off too, and would never be woken. The first panic goes on once
/// all were ([`finish`](Self::finish)).
#[derive(Default)]
pub(crate) struct Wakes(Option<Box<dyn std::any::Any + Send>>);

impl Wakes {
    pub(crate) fn wake(&mut self, w: Waker) {
        if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| w.wake())) {
            self.0.get_or_insert(p);
        }
    }

    /// Goes on with the first panic, if a waker panicked.
    pub(crate) fn finish(self) {
        if let Some(p) = self.0 {
            std::panic::resume_unwind(p);
        }
    }

    /// As [`finish`](Self::finish), where going on with a panic would
    /// abort the process (a runtime's drop): logs it instead.
    pub(crate) fn finish_in_drop(self) {
        if self.0.is_some() {
            tracing::error!("a waker panicked while a runtime shut down");
        }
    }
}
