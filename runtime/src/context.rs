//! The thread-local handle to the runtime that is running on this thread.
//!
//! Spawning, timers and new operations reach the runtime through this
//! context. What outlives the moment it was created in — an op, a stream's
//! fd, a buffer pool, a completion source's handle — keeps an `Rc` of its own
//! runtime's context instead ([`current`]), so where it is later polled or
//! dropped never matters. One runtime is entered per thread at a time.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use slab::Slab;

use crate::driver::{Driver, Unparker};
use crate::executor::Task;
use crate::source::Sources;
use crate::stats::Counters;
use crate::time::Timers;

/// Per-runtime state shared by everything on the runtime's thread.
pub(crate) struct Context {
    /// Unique id of this runtime (tells a local wake from a remote one).
    pub(crate) id: usize,
    pub(crate) driver: RefCell<Driver>,
    /// Tasks ready to be polled, by task id.
    pub(crate) ready: RefCell<VecDeque<u64>>,
    pub(crate) tasks: RefCell<Slab<Task>>,
    /// Wakers of finished tasks that nothing else held, for the next spawns
    /// (a 64-task batch spawns 64 tasks: one `Arc` fewer each).
    pub(crate) spare_wakers: RefCell<Vec<Arc<crate::executor::TaskWaker>>>,
    /// The task whose poll is in progress (`TaskPoll`), and how many task
    /// polls this runtime has begun (so a poll in progress is known by its
    /// number).
    pub(crate) polling: Cell<Option<u64>>,
    pub(crate) poll_seq: Cell<u64>,
    /// `block_on`'s own task's waker, while `block_on` runs.
    pub(crate) main_task: RefCell<Option<Arc<crate::executor::TaskWaker>>>,
    pub(crate) timers: RefCell<Timers>,
    pub(crate) sources: RefCell<Sources>,
    /// Cross-thread wake plumbing.
    pub(crate) unparker: Arc<Unparker>,
    pub(crate) counters: Counters,
    /// Operations left in the current task's cooperative budget.
    pub(crate) budget: Cell<u32>,
    /// Tasks that yielded (or spent their budget): woken after the next
    /// reactor turn, so they run after I/O completions, not before.
    pub(crate) deferred: RefCell<Vec<std::task::Waker>>,
    /// Bytes moved by epoll ops since the last reactor turn (`TICK_BYTES`).
    pub(crate) tick_bytes: Cell<usize>,
    /// How long the reactor busy-polls before it blocks ([`Builder::spin`]).
    ///
    /// [`Builder::spin`]: crate::Builder::spin
    pub(crate) spin: Duration,
    /// Whether the spin shares its core with another thread (crowding.rs).
    pub(crate) crowding: crate::crowding::Crowding,
    /// Set when the `Runtime` shuts down: nothing runs tasks or reaps ops any
    /// more, so new ones are refused.
    pub(crate) closed: Cell<bool>,
    /// Values leaked by [`strand`](crate::strand) on this runtime: counted
    /// in its shutdown's undrained total, as live operations are.
    pub(crate) stranded: Cell<usize>,
    /// The process the runtime was made in: in a forked child its ring (or
    /// epoll instance) is the parent's, never to be touched.
    pub(crate) lineage: crate::fork::Lineage,
    /// Cancels requested while the driver was busy (a waker run while it
    /// reaps): posted at the start of the next turn.
    pub(crate) late_cancels: RefCell<Vec<u64>>,
}

thread_local! {
    static CURRENT: RefCell<Option<Rc<Context>>> = const { RefCell::new(None) };
    /// Id of the runtime entered on this thread (0: none); read by wakers.
    static CURRENT_ID: Cell<usize> = const { Cell::new(0) };
}

/// Runs `f` with the current runtime's context, or `None` outside any runtime
/// (or while the thread's locals are torn down).
///
/// The slot is borrowed mutably only by [`enter`] and its guard, never while a
/// task or an op runs, so nested calls share the borrow (no `Rc` clone).
pub(crate) fn try_with<R>(f: impl FnOnce(Option<&Rc<Context>>) -> R) -> R {
    let mut f = Some(f);
    match CURRENT.try_with(|c| (f.take().expect("called once"))(c.borrow().as_ref())) {
        Ok(r) => r,
        Err(_) => (f.take().expect("not called"))(None),
    }
}

/// Runs `f` with the current runtime's context.
///
/// # Panics
/// Outside a runtime: I/O, timers and `spawn_local` need one.
pub(crate) fn with<R>(f: impl FnOnce(&Rc<Context>) -> R) -> R {
    try_with(|cx| {
        f(cx.expect("quiesce: this needs a runtime; call it from inside Runtime::block_on"))
    })
}

/// A handle to the current runtime, for resources that must reach their own
/// runtime wherever they are later polled or dropped.
///
/// # Panics
/// Outside a runtime.
pub(crate) fn current() -> Rc<Context> {
    with(Rc::clone)
}

/// Id of the runtime entered on this thread, 0 when none.
pub(crate) fn current_id() -> usize {
    CURRENT_ID.try_with(Cell::get).unwrap_or(0)
}

/// False once this thread's thread-locals are being destroyed.
pub(crate) fn thread_alive() -> bool {
    CURRENT.try_with(|_| ()).is_ok() && CURRENT_ID.try_with(|_| ()).is_ok()
}

/// Restores the previous context when dropped.
pub(crate) struct Enter {
    prev: Option<Rc<Context>>,
    prev_id: usize,
}

/// Makes `cx` the current context until the guard drops.
pub(crate) fn enter(cx: Rc<Context>) -> Enter {
    let id = cx.id;
    let prev = CURRENT.with(|c| c.borrow_mut().replace(cx));
    let prev_id = CURRENT_ID.with(|c| c.replace(id));
    Enter { prev, prev_id }
}

impl Drop for Enter {
    fn drop(&mut self) {
        let prev = self.prev.take();
        CURRENT.with(|c| *c.borrow_mut() = prev);
        CURRENT_ID.with(|c| c.set(self.prev_id));
    }
}
