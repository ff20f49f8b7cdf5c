//! Shards: one runtime per thread, pinned to a core, with channels between
//! them and a graceful shutdown that drains every runtime.
//!
//! ```no_run
//! use quiesce_runtime::shard::Shards;
//! let shards = Shards::builder().count(2).spawn(|shard| async move {
//!     shard.shutdown_requested().await;
//!     shard.index()
//! }).unwrap();
//! let results = shards.shutdown();
//! assert_eq!(results.len(), 2);
//! ```

use std::collections::VecDeque;
use std::future::Future;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Poll, Waker};
use std::thread;

use slab::Slab;

use crate::builder::{BuildError, Builder};
use crate::driver::socket::pin_to_core;

/// Pins the calling thread to CPU `core` (threads it starts afterwards, and
/// processes it spawns, inherit that), as shards do with
/// [`ShardBuilder::pin`](ShardBuilder::pin).
pub fn pin_current_thread(core: usize) -> io::Result<()> {
    pin_to_core(core)
}

/// A one-way flag with the wakers of every wait for it, settable from any
/// thread.
#[derive(Default)]
struct Signal {
    set: AtomicBool,
    /// One per pending [`SignalWait`], which takes its own back when it
    /// ends or is dropped.
    wakers: Mutex<Slab<Waker>>,
}

impl Signal {
    fn raise(&self) {
        self.set.store(true, Ordering::SeqCst);
        let wakers = std::mem::take(&mut *self.wakers.lock().unwrap_or_else(|e| e.into_inner()));
        wakers.into_iter().for_each(|(_, w)| w.wake());
    }

    fn wait(&self) -> SignalWait<'_> {
        SignalWait {
            signal: self,
            key: None,
        }
    }
}

/// A wait for a [`Signal`]: its waker is in the signal's list while it is
/// pending, and only then.
struct SignalWait<'a> {
    signal: &'a Signal,
    key: Option<usize>,
}

impl SignalWait<'_> {
    fn forget(&mut self) {
        if let Some(k) = self.key.take() {
            let mut wakers = self.signal.wakers.lock().unwrap_or_else(|e| e.into_inner());
            // (Gone if the raise took them all.)
            wakers.try_remove(k);
        }
    }
}

impl Future for SignalWait<'_> {
    type Output = ();

    fn poll(mut self: std::pin::Pin<&mut Self>, tcx: &mut std::task::Context<'_>) -> Poll<()> {
        let set = |w: &SignalWait<'_>| w.signal.set.load(Ordering::SeqCst);
        if !set(&self) {
            let this = &mut *self;
            let mut wakers = this.signal.wakers.lock().unwrap_or_else(|e| e.into_inner());
            match this.key.and_then(|k| wakers.get_mut(k)) {
                Some(w) if w.will_wake(tcx.waker()) => {}
                Some(w) => *w = tcx.waker().clone(),
                None => this.key = Some(wakers.insert(tcx.waker().clone())),
            }
            drop(wakers);
            // Raised meanwhile: its waker may have gone with the raise's take.
            if !set(this) {
                return Poll::Pending;
            }
        }
        self.forget();
        Poll::Ready(())
    }
}

impl Drop for SignalWait<'_> {
    fn drop(&mut self) {
        self.forget();
    }
}

/// What a shard's root future knows about its shard.
pub struct ShardContext {
    index: usize,
    count: usize,
    core: Option<usize>,
    shutdown: Arc<Signal>,
}

impl ShardContext {
    /// This shard's index, `0..count`.
    pub fn index(&self) -> usize {
        self.index
    }

    /// How many shards were started.
    pub fn count(&self) -> usize {
        self.count
    }

    /// The core this shard's thread is pinned to, if pinned.
    pub fn core(&self) -> Option<usize> {
        self.core
    }

    /// Resolves once [`Shards::shutdown`] was called. The root future should
    /// then stop its work and return; the runtime drains as it drops.
    pub async fn shutdown_requested(&self) {
        self.shutdown.wait().await
    }

    /// True once shutdown was requested.
    pub fn is_shutting_down(&self) -> bool {
        self.shutdown.set.load(Ordering::SeqCst)
    }
}

/// Starts shards.
#[derive(Clone)]
pub struct ShardBuilder {
    count: usize,
    pin: bool,
    runtime: Builder,
    name: String,
}

/// Running shards; [`shutdown`](Shards::shutdown) stops and joins them.
/// Dropped without it (an early return, a panic in the caller), they are
/// asked to stop and left to end on their own, each draining its runtime.
pub struct Shards<R> {
    threads: Vec<thread::JoinHandle<Result<R, BuildError>>>,
    signals: Vec<Arc<Signal>>,
}

impl Shards<()> {
    /// A builder: one shard per available core, pinned.
    pub fn builder() -> ShardBuilder {
        let count = thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        ShardBuilder {
            count,
            pin: true,
            runtime: Builder::new(),
            name: "quiesce-shard".into(),
        }
    }
}

impl ShardBuilder {
    /// Number of shards.
    pub fn count(mut self, n: usize) -> Self {
        self.count = n.max(1);
        self
    }

    /// Pin each shard's thread to one core (default on): shard i takes the
    /// i-th core of the process's affinity mask, wrapping around.
    pub fn pin(mut self, on: bool) -> Self {
        self.pin = on;
        self
    }

    /// Runtime configuration for every shard.
    pub fn runtime(mut self, b: Builder) -> Self {
        self.runtime = b;
        self
    }

    /// Thread name prefix.
    pub fn name(mut self, prefix: impl Into<String>) -> Self {
        self.name = prefix.into();
        self
    }

    /// Starts the shards, each running `root(ctx)` on its own runtime. The
    /// call returns once every runtime is built (or the first error).
    pub fn spawn<F, Fut, R>(self, root: F) -> io::Result<Shards<R>>
    where
        F: Fn(ShardContext) -> Fut + Send + Sync + 'static,
        Fut: Future<Output = R> + 'static,
        R: Send + 'static,
    {
        let root = Arc::new(root);
        let cores = if self.pin {
            crate::driver::socket::allowed_cores()?
        } else {
            Vec::new()
        };
        let started = Arc::new((
            Mutex::new(Vec::<Option<String>>::new()),
            std::sync::Condvar::new(),
        ));
        let mut threads = Vec::with_capacity(self.count);
        let mut signals = Vec::with_capacity(self.count);
        for index in 0..self.count {
            let signal = Arc::new(Signal::default());
            signals.push(signal.clone());
            let core = (!cores.is_empty()).then(|| cores[index % cores.len()]);
            let (root, builder, started, count) = (
                root.clone(),
                self.runtime.clone(),
                started.clone(),
                self.count,
            );
            let t = thread::Builder::new().name(format!("{}-{index}", self.name)).spawn(move || {
                let report = |r: Option<String>| {
                    started.0.lock().unwrap_or_else(|e| e.into_inner()).push(r);
                    started.1.notify_all();
                };
                if let Some(c) = core {
                    if let Err(e) = pin_to_core(c) {
                        tracing::warn!(shard = index, core = c, error = %e, "could not pin shard");
                    }
                }
                let rt = match builder.build() {
                    Ok(rt) => rt,
                    Err(e) => {
                        report(Some(e.to_string()));
                        return Err(e);
                    }
                };
                report(None);
                let _span = tracing::debug_span!("shard", index).entered();
                let ctx = ShardContext { index, count, core, shutdown: signal };
                let out = rt.block_on(root(ctx));
                // Drains every in-flight op before the thread ends; one that
                // could not is the caller's to know (memory it lent stays).
                rt.shutdown().map_err(std::io::Error::other)?;
                Ok(out)
            });
            match t {
                Ok(t) => threads.push(t),
                Err(e) => {
                    // The shards already started would wait for a shutdown
                    // nobody can ask for: ask, and join them.
                    signals.pop();
                    Shards { threads, signals }.shutdown();
                    return Err(e);
                }
            }
        }
        let (lock, cv) = &*started;
        let mut reports = lock.lock().unwrap_or_else(|e| e.into_inner());
        while reports.len() < self.count {
            reports = cv.wait(reports).unwrap_or_else(|e| e.into_inner());
        }
        if let Some(err) = reports.iter().flatten().next().cloned() {
            drop(reports);
            let shards = Shards { threads, signals };
            shards.shutdown();
            return Err(io::Error::other(format!(
                "a shard's runtime failed to build: {err}"
            )));
        }
        Ok(Shards { threads, signals })
    }
}

impl<R> Shards<R> {
    /// Number of shards.
    pub fn len(&self) -> usize {
        self.threads.len()
    }

    /// True when there are no shards.
    pub fn is_empty(&self) -> bool {
        self.threads.is_empty()
    }

    /// Requests shutdown of every shard without waiting.
    pub fn request_shutdown(&self) {
        self.signals.iter().for_each(|s| s.raise());
    }

    /// Requests shutdown, then joins every shard. Each runtime has cancelled
    /// and reaped its in-flight operations before its thread ended. Returns
    /// each shard's output in index order: `Err` if it panicked, failed to
    /// build, or could not drain ([`Undrained`](crate::Undrained), its
    /// message: operations still in flight — memory lent to them must never
    /// be freed).
    pub fn shutdown(mut self) -> Vec<thread::Result<R>> {
        self.request_shutdown();
        std::mem::take(&mut self.threads)
            .into_iter()
            .map(|t| match t.join() {
                Ok(Ok(r)) => Ok(r),
                Ok(Err(e)) => Err(Box::new(e.to_string()) as Box<dyn std::any::Any + Send>),
                Err(p) => Err(p),
            })
            .collect()
    }
}

impl<R> Drop for Shards<R> {
    fn drop(&mut self) {
        // Joining here could hang an unwinding caller on a root that never
        // watches for shutdown: ask, and let the threads end.
        self.request_shutdown();
    }
}

struct Chan<T> {
    queue: Mutex<Queue<T>>,
    waker: Mutex<Option<Waker>>,
    senders: AtomicUsize,
}

impl<T> Chan<T> {
    /// The waiting receiver's waker, taken: the lock is released before
    /// the caller wakes or drops it.
    fn take_waker(&self) -> Option<Waker> {
        self.waker.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

/// The values in flight, and whether the receiver is gone — one lock, so a
/// value is either refused or queued before the receiver went (which then
/// drops it), never queued after.
struct Queue<T> {
    values: VecDeque<T>,
    closed: bool,
}

/// Sends to a shard from any thread.
pub struct Sender<T> {
    chan: Arc<Chan<T>>,
}

/// Receives on one shard; the sender's wake reaches it across threads.
pub struct Receiver<T> {
    chan: Arc<Chan<T>>,
}

/// An unbounded channel between shards (or any threads).
pub fn channel<T: Send>() -> (Sender<T>, Receiver<T>) {
    let chan = Arc::new(Chan {
        queue: Mutex::new(Queue {
            values: VecDeque::new(),
            closed: false,
        }),
        waker: Mutex::new(None),
        senders: AtomicUsize::new(1),
    });
    (Sender { chan: chan.clone() }, Receiver { chan })
}

/// The receiver is gone; the value comes back.
#[derive(Debug, thiserror::Error)]
#[error("the receiving shard is gone")]
pub struct SendError<T>(pub T);

impl<T> Sender<T> {
    /// Queues `value` and wakes the receiver; once the receiver is gone,
    /// the value comes back.
    pub fn send(&self, value: T) -> Result<(), SendError<T>> {
        {
            let mut q = self.chan.queue.lock().unwrap_or_else(|e| e.into_inner());
            if q.closed {
                return Err(SendError(value));
            }
            q.values.push_back(value);
        }
        self.wake();
        Ok(())
    }

    fn wake(&self) {
        // Taken, then woken outside the lock (a wake may write the parked
        // runtime's eventfd; a waker may do anything).
        if let Some(w) = self.chan.take_waker() {
            w.wake();
        }
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.chan.senders.fetch_add(1, Ordering::SeqCst);
        Sender {
            chan: self.chan.clone(),
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        if self.chan.senders.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.wake();
        }
    }
}

impl<T> Receiver<T> {
    /// The next value; `None` once every sender is gone and the queue is empty.
    pub async fn recv(&mut self) -> Option<T> {
        std::future::poll_fn(|tcx| {
            if let Some(v) = self.try_recv() {
                return Poll::Ready(Some(v));
            }
            // Store the waker before checking again: a send or the last
            // sender's drop that lands in between then finds it.
            *self.chan.waker.lock().unwrap_or_else(|e| e.into_inner()) = Some(tcx.waker().clone());
            if let Some(v) = self.try_recv() {
                return Poll::Ready(Some(v));
            }
            if self.chan.senders.load(Ordering::SeqCst) == 0 {
                return Poll::Ready(self.try_recv());
            }
            Poll::Pending
        })
        .await
    }

    /// A value if one is queued.
    pub fn try_recv(&mut self) -> Option<T> {
        self.chan
            .queue
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .values
            .pop_front()
    }
}

impl<T> Drop for Receiver<T> {
    /// Refuses every later send, and drops what was left queued now, not
    /// when the last sender goes: a request's reply channel in it ends its
    /// requester's wait.
    fn drop(&mut self) {
        let left = {
            let mut q = self.chan.queue.lock().unwrap_or_else(|e| e.into_inner());
            q.closed = true;
            std::mem::take(&mut q.values)
        };
        // Nothing will wait here again: a sender that lives on must not
        // keep this task's waker (and its runtime's wake-up fd) alive.
        let waker = self.chan.take_waker();
        // Outside the locks: a value's drop may send on this channel.
        drop(waker);
        drop(left);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    /// A wait that ends, or is given up (a task that stopped waiting on a
    /// timeout), takes its waker back: tasks that come and go in a shard
    /// that lives long leave nothing behind (one waker each was kept until
    /// the shutdown).
    #[test]
    fn a_wait_given_up_leaves_no_waker_behind() {
        let s = std::rc::Rc::new(Signal::default());
        let rt = crate::Runtime::new().unwrap();
        rt.block_on(async {
            let tasks: Vec<_> = (0..100)
                .map(|_| {
                    let s = s.clone();
                    crate::spawn_local(async move {
                        let waited = crate::time::timeout(Duration::from_millis(1), s.wait());
                        assert!(waited.await.is_err(), "not raised");
                    })
                })
                .collect();
            for t in tasks {
                t.await.unwrap();
            }
        });
        assert_eq!(s.wakers.lock().unwrap().len(), 0);
        // One still waiting is woken by the raise.
        let waiting = rt.spawn_local({
            let s = s.clone();
            async move { s.wait().await }
        });
        rt.block_on(crate::yield_now());
        s.raise();
        rt.block_on(crate::time::timeout(Duration::from_secs(1), waiting))
            .expect("the raise woke the waiter")
            .unwrap();
    }

    /// A receiver that goes takes the waker its last wait left: a sender
    /// that lives on (another shard's) kept it — and through it the gone
    /// runtime's wake-up eventfd — until the last sender went.
    #[test]
    fn a_receiver_that_goes_leaves_no_waker_behind() {
        struct Counted;
        impl std::task::Wake for Counted {
            fn wake(self: std::sync::Arc<Self>) {}
        }
        let counted = Arc::new(Counted);
        let waker = Waker::from(counted.clone());
        let (tx, mut rx) = channel::<u8>();
        {
            let mut wait = std::pin::pin!(rx.recv());
            let mut cx = std::task::Context::from_waker(&waker);
            assert!(wait.as_mut().poll(&mut cx).is_pending());
        }
        drop(waker);
        assert_eq!(
            Arc::strong_count(&counted),
            2,
            "the channel holds the wait's waker"
        );
        drop(rx);
        assert_eq!(
            Arc::strong_count(&counted),
            1,
            "the receiver went, its waker stayed"
        );
        assert!(tx.send(1).is_err());
    }
}
