//! `Runtime`: one executor plus one reactor per thread (built by
//! [`Builder`](crate::Builder), in `builder.rs`).

use std::future::Future;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context as TaskCx, Poll, Waker};
use std::time::{Duration, Instant};

use crate::builder::{BuildError, Builder};
use crate::context::{self, Context};
use crate::driver::{Driver, DriverKind};
use crate::executor::{self, JoinHandle, TaskWaker, MAIN_TASK, OP_BUDGET};
use crate::source;
use crate::stats::Counters;
use crate::time;

/// Tasks polled per tick before the reactor gets a turn.
const TASKS_PER_TICK: usize = 128;

/// A single-threaded runtime: executor, reactor, timers and completion sources.
///
/// Dropping it cancels every operation still in flight and waits until the
/// kernel has returned all of their buffers (see [`Builder::drain_timeout`]).
pub struct Runtime {
    cx: Rc<Context>,
    /// The waker of [`block_on`](Self::block_on)'s future, made once: a
    /// call whose future kept no clone of it reuses it (no allocation per
    /// call).
    main: Arc<TaskWaker>,
    drain_timeout: Duration,
    /// `close` ran (by `shutdown`, then not again by `Drop`).
    shut: bool,
}

impl Runtime {
    /// The runtime [`Builder::build`] made of `cx` and the main waker.
    pub(crate) fn from_parts(
        cx: Rc<Context>,
        main: Arc<TaskWaker>,
        drain_timeout: Duration,
    ) -> Self {
        Runtime {
            cx,
            main,
            drain_timeout,
            shut: false,
        }
    }

    /// A runtime with the default [`Builder`].
    pub fn new() -> Result<Runtime, BuildError> {
        Builder::new().build()
    }

    /// A builder to configure one.
    pub fn builder() -> Builder {
        Builder::new()
    }

    /// The backend in use.
    pub fn driver_kind(&self) -> DriverKind {
        self.cx.driver.borrow().kind()
    }

    /// Spawns a task on this runtime (it runs during `block_on`).
    pub fn spawn_local<F>(&self, fut: F) -> JoinHandle<F::Output>
    where
        F: Future + 'static,
        F::Output: 'static,
    {
        let _enter = context::enter(self.cx.clone());
        executor::spawn_local(fut)
    }

    /// Runs `fut` to completion on this thread, running spawned tasks and the
    /// reactor meanwhile.
    ///
    /// # Panics
    /// If called from inside another runtime's `block_on` on this thread.
    pub fn block_on<F: Future>(&self, fut: F) -> F::Output {
        assert!(
            context::current_id() == 0,
            "quiesce: block_on called from inside a runtime"
        );
        assert!(
            !self.cx.lineage.forked(),
            "quiesce: a runtime run in a forked child of the process that made it (its ring is the parent's)"
        );
        let _enter = context::enter(self.cx.clone());
        let cx = &*self.cx;
        let mut fut = std::pin::pin!(fut);
        // A clone kept by an earlier call's future would wake this one's:
        // harmless (a spurious poll), but a fresh waker keeps each call's
        // wake-ups its own.
        let main = match Arc::strong_count(&self.main) {
            1 => self.main.clone(),
            _ => TaskWaker::new(MAIN_TASK, cx.unparker.clone()),
        };
        let waker = Waker::from(main.clone());
        main.queued.store(true, Ordering::Relaxed);
        *cx.main_task.borrow_mut() = Some(main.clone());
        cx.ready.borrow_mut().push_back(MAIN_TASK);
        loop {
            cx.unparker.drain_into(&mut cx.ready.borrow_mut());
            for _ in 0..TASKS_PER_TICK {
                let Some(id) = cx.ready.borrow_mut().pop_front() else {
                    break;
                };
                if id == MAIN_TASK {
                    main.queued.store(false, Ordering::Release);
                    cx.budget.set(OP_BUDGET);
                    let polling = executor::begin_poll(cx, MAIN_TASK);
                    let polled = fut.as_mut().poll(&mut TaskCx::from_waker(&waker));
                    drop(polling);
                    if let Poll::Ready(v) = polled {
                        // So that the next call finds `main` unshared.
                        cx.main_task.borrow_mut().take();
                        return v;
                    }
                } else {
                    executor::run_task(cx, id);
                }
            }
            turn(cx);
        }
    }
}

/// One reactor turn: poll sources, park (bounded by the nearest deadline,
/// or not at all when work is pending or a timer is due), dispatch what
/// arrived, fire due timers.
fn turn(cx: &Context) {
    assert!(
        !cx.lineage.forked(),
        "quiesce: a runtime run in a forked child of the process that made it (its ring is the parent's)"
    );
    Counters::bump(&cx.counters.ticks);
    cx.tick_bytes.set(0);
    if !cx.late_cancels.borrow().is_empty() {
        crate::driver::post_late_cancels(cx);
    }
    let reaped = source::poll_all(cx);
    // Timers are fired once a turn, after the park (below): one due now
    // makes `until_next_timer` zero, so the park does not block, and it
    // fires in this turn all the same; a clock reading fewer.
    // (Events the driver took outside a park — a submit that found the
    // completion queue full reaps it — are this turn's too: blocking
    // would leave a source's readiness for the next wake-up.)
    let busy = reaped > 0
        || !cx.ready.borrow().is_empty()
        || !cx.deferred.borrow().is_empty()
        || cx.sources.borrow().busy()
        || cx.driver.borrow().has_events();
    let mut timeout = if busy {
        Some(Duration::ZERO)
    } else {
        until_next_timer(cx)
    };
    // Set when the spin's last poll of the driver found what it waits for:
    // those events are the park's, and polling again is a syscall for
    // nothing on the path of every message a spinning reactor receives.
    let mut polled = false;
    if timeout != Some(Duration::ZERO) && !cx.spin.is_zero() {
        timeout = match spin(cx, timeout) {
            Spun::Polled => {
                polled = true;
                Some(Duration::ZERO)
            }
            Spun::Work => Some(Duration::ZERO),
            // The spin used part of the wait: the nearest timer is that much
            // closer now.
            Spun::Idle => until_next_timer(cx),
        };
    }
    // Sources are armed only right before the reactor blocks, after any
    // spin: an armed source asks its peer for a notification (an RDMA CQ
    // event, a doorbell rung by another process), which a spinning
    // reactor does not need.
    if timeout != Some(Duration::ZERO) {
        match source::arm_all(cx) {
            Ok(0) => {}
            Ok(_) => timeout = Some(Duration::ZERO),
            Err(e) => {
                tracing::error!(error = %e, "could not watch a completion source's fd; busy-polling");
                timeout = Some(Duration::ZERO);
            }
        }
    }
    let parking = timeout != Some(Duration::ZERO);
    if parking && !cx.unparker.prepare_park() {
        timeout = Some(Duration::ZERO);
    }
    let res = match polled {
        true => Ok(()),
        false => cx.driver.borrow_mut().park(timeout, &cx.counters),
    };
    if parking {
        cx.unparker.unpark_done();
    }
    if let Err(e) = res {
        panic!("quiesce: the reactor's wait failed: {e}");
    }
    let events = cx.driver.borrow_mut().take_events();
    if events.woken {
        cx.unparker.drain_eventfd();
    }
    // Buffers of parked ops whose last completion was just reaped.
    drop(events.released);
    let mut ready = events.sources_ready;
    for token in ready.drain(..) {
        source::notified(cx, token);
    }
    // The emptied list goes back to the driver, so a source's fd firing
    // allocates nothing (it fires once per park of a doorbell's reactor).
    cx.driver.borrow_mut().keep_source_list(ready);
    time::fire_due(cx);
    // Yielded tasks run after what this turn woke.
    let mut deferred = std::mem::take(&mut *cx.deferred.borrow_mut());
    let mut wakes = crate::executor::Wakes::default();
    deferred.drain(..).for_each(|w| wakes.wake(w));
    // Waking defers nothing (a yielded task defers itself when it runs, after
    // this turn): the emptied list goes back with its capacity, so a task
    // that yields every turn allocates nothing.
    let mut list = cx.deferred.borrow_mut();
    if list.is_empty() {
        *list = deferred;
    }
    drop(list);
    wakes.finish();
}

/// How long the current thread's runtime busy-polls before it blocks
/// ([`Builder::spin`]); zero outside a runtime.
pub fn spin_time() -> Duration {
    context::try_with(|cx| cx.map_or(Duration::ZERO, |cx| cx.spin))
}

/// Whether another task of the current thread's runtime is ready to run
/// in this turn (woken and not yet polled); false outside a runtime. A task
/// that polls something itself (a socket, while the runtime spins) lets
/// such tasks run before it spends a syscall: what they do with what it
/// just handed them is usually what its peer waits for.
pub fn tasks_ready() -> bool {
    context::try_with(|cx| cx.is_some_and(|cx| !cx.ready.borrow().is_empty()))
}

/// How long until the nearest timer is due (`None`: no timer), at most
/// [`time::LONGEST_WAIT`]: `sleep_until` takes any `Instant`, and a park of
/// centuries is past what some kernels' io_uring_enter can add to its clock
/// (it would time out at once, every turn).
fn until_next_timer(cx: &Context) -> Option<Duration> {
    cx.timers.borrow_mut().next_deadline().map(|d| {
        d.saturating_duration_since(Instant::now())
            .min(time::LONGEST_WAIT)
    })
}

/// How a spin ended.
enum Spun {
    /// Its last poll of the driver reaped a completion that woke a task, or
    /// events for the turn (a wake, a source's fd): the turn takes them
    /// without polling the driver again.
    Polled,
    /// Work arrived another way (a wake from another thread, a completion
    /// source with work), or the poll failed (the park reports it): the
    /// turn polls the driver without blocking.
    Work,
    /// Nothing arrived within the spin time.
    Idle,
}

/// Busy-polls for up to the runtime's spin time (never past `timeout`, the
/// nearest timer), until something arrives — a completion that woke a task,
/// a completion source with work, a wake from another thread — so the turn
/// must not block.
fn spin(cx: &Context, timeout: Option<Duration>) -> Spun {
    let limit = timeout.map_or(cx.spin, |t| t.min(cx.spin));
    let start = Instant::now();
    let mut polls = 0;
    loop {
        if cx.unparker.has_remote() || source::poll_all(cx) > 0 {
            return Spun::Work;
        }
        let polled = cx
            .driver
            .borrow_mut()
            .park(Some(Duration::ZERO), &cx.counters);
        // An error is the blocking park's to report.
        if polled.is_err() {
            return Spun::Work;
        }
        if !cx.ready.borrow().is_empty() || cx.driver.borrow().has_events() {
            return Spun::Polled;
        }
        let now = Instant::now();
        if now.duration_since(start) >= limit {
            return Spun::Idle;
        }
        // Two cores may hold more runnable threads than this one (one that
        // keeps taking this core makes this thread move: crowding.rs).
        polls += 1;
        cx.crowding.offer(now, polls, &cx.counters);
    }
}

/// Leaks `value`, which memory outside this process's operations may still
/// reach (a buffer lent to a peer's process), because its holder goes away
/// before that ended (its task dropped, as a shutdown drops every task).
/// The current runtime counts it: its [`shutdown`](Runtime::shutdown)
/// answers [`Undrained`], as for an operation still in the kernel's hands,
/// so that nobody frees memory the value points into either. Outside a
/// runtime it is only leaked.
pub fn strand<T>(value: T) {
    std::mem::forget(value);
    context::try_with(|cx| {
        if let Some(cx) = cx {
            cx.stranded.set(cx.stranded.get() + 1);
        }
    });
}

impl Runtime {
    /// Shuts the runtime down as dropping it does (tasks dropped, every op
    /// cancelled and reaped), and says how it went: `Err(live)` when `live`
    /// operations were still in the kernel's hands after `drain_timeout` —
    /// their buffers are leaked, never freed, and memory lent to them must
    /// not be freed by anyone either.
    pub fn shutdown(mut self) -> Result<(), Undrained> {
        match self.close() {
            0 => Ok(()),
            live => Err(Undrained { live }),
        }
    }

    /// The work of `Drop`, once; returns the ops still live after the drain.
    fn close(&mut self) -> usize {
        if std::mem::replace(&mut self.shut, true) {
            return 0;
        }
        if self.cx.lineage.forked() {
            // A forked child's copy: its ring and epoll instance are the
            // parent's kernel objects (a cancel pushed, a completion reaped
            // or an fd taken out of the interest list here would be done to
            // the parent's operations), and its operations are the
            // parent's. Nothing of it is touched: leaked as it is.
            self.cx.closed.set(true);
            std::mem::forget(self.cx.clone());
            return self.cx.driver.try_borrow().map_or(0, |d| d.in_flight());
        }
        if !context::thread_alive() {
            self.cx.closed.set(true);
            // A runtime kept in a thread-local, dropped while the thread exits:
            // without its context no op can be drained, so nothing is freed.
            // Keeping the context alive leaks every buffer the kernel may hold.
            std::mem::forget(self.cx.clone());
            return self.cx.driver.try_borrow().map_or(0, |d| d.in_flight());
        }
        let outer = context::current_id();
        let _enter = (outer != self.cx.id).then(|| context::enter(self.cx.clone()));
        let cx = &*self.cx;
        // Dropping the tasks drops their op futures, which parks the ops and
        // posts their cancels. A task's drop may wake or spawn others: repeat.
        // Until they are all gone the runtime still takes spawns (a batch
        // dropped here moves its driver into a task, dropped by the next
        // round); then it is closed to new tasks and ops.
        loop {
            let tasks: Vec<_> = cx.tasks.borrow_mut().drain().collect();
            if tasks.is_empty() {
                break;
            }
            drop(tasks);
        }
        cx.closed.set(true);
        let sources = std::mem::take(&mut *cx.sources.borrow_mut());
        drop(sources);
        // Memory a peer's process may still reach, whose holders the tasks'
        // drop stranded (`strand`): leaked, and owed like a live op.
        let stranded = cx.stranded.get();
        if stranded > 0 {
            tracing::error!(
                stranded,
                "buffers lent to another process were not let go before the shutdown; leaking them"
            );
        }
        // Whoever waits on its timers or (epoll) its poller — tasks of other
        // runtimes holding its sleeps and ops — is woken: nothing would
        // otherwise, and at their next poll they end or move on.
        let mut waiting = cx.timers.borrow_mut().take_all();
        let mut d = cx.driver.borrow_mut();
        let Driver::Uring(u) = &mut *d else {
            if let Driver::Poll(p) = &mut *d {
                waiting.extend(p.take_waiters());
            }
            drop(d);
            let mut wakes = crate::executor::Wakes::default();
            waiting.into_iter().for_each(|w| wakes.wake(w));
            wakes.finish_in_drop();
            return stranded;
        };
        let live = u.drain(self.drain_timeout, &cx.counters);
        let released = std::mem::take(&mut u.events.released);
        if live > 0 {
            tracing::error!(
                live,
                "io_uring operations did not complete after cancellation; leaking their buffers and the ring"
            );
            u.set_leak();
        }
        drop(d);
        drop(released);
        let mut wakes = crate::executor::Wakes::default();
        waiting.into_iter().for_each(|w| wakes.wake(w));
        wakes.finish_in_drop();
        stranded + live
    }
}

/// A runtime shut down with operations still in the kernel's hands.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{live} operations were still in flight after the drain; their memory is leaked")]
pub struct Undrained {
    /// Operations still live.
    pub live: usize,
}

impl Drop for Runtime {
    fn drop(&mut self) {
        self.close();
    }
}
