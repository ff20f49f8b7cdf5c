//! Building and submitting a batch.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Waker};
use std::time::Instant;

use quiesce_runtime::{IoBuf, IoBufMut};

use crate::options::BatchOptions;
use crate::outcome::{DriverFuture, Handoff, Submitted};
use crate::run::{Boxed, Driver, Reads, Start, Task, TaskState, Tasks, TransferFuture, Writes};
use crate::transport::Transport;

/// Why a task was not added. The buffer comes back untouched.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct Rejected<B> {
    /// Why.
    pub reason: BatchError,
    /// The buffer, as it was given.
    pub buf: B,
}

/// Bad input to a batch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BatchError {
    /// The batch already holds `max` tasks.
    #[error("batch is full ({max} tasks)")]
    TooLarge {
        /// The limit.
        max: usize,
    },
    /// The buffer's length does not match the remote range.
    #[error("buffer has {buf} bytes but the range has {range}")]
    LengthMismatch {
        /// Bytes in (or room in) the buffer.
        buf: u64,
        /// Bytes in the range.
        range: u64,
    },
    /// A zero-length task.
    #[error("zero-length task")]
    Empty,
}

/// A batch being built: tasks own their buffers from the moment they are added.
///
/// ```compile_fail
/// # use quiesce_batch::*;
/// # fn f(mut b: Batch<Tcp, Vec<u8>>, r: RemoteRange) {
/// let src = vec![0u8; 4096];
/// b.write(src, r).unwrap();
/// src[0] = 1; // the batch owns it now
/// # }
/// ```
pub struct Batch<T: Transport, B> {
    transport: T,
    opts: BatchOptions,
    tasks: Tasks<T, B>,
    id: u64,
    /// How [`submit`](Self::submit) starts the driver, chosen as tasks are
    /// added: a one-task batch's driver keeps that task's transfer future in
    /// its own state ([`Writes`] or [`Reads`]: no allocation per transfer);
    /// a larger batch's are boxed ([`Boxed`]).
    start: fn(Batch<T, B>) -> Submitted<B>,
    /// When the batch counts as submitted, if its caller read the clock
    /// already ([`started_at`](Self::started_at)); else `submit` reads it.
    since: Option<Instant>,
}

fn launch_write<T: Transport, B: IoBuf>(
    t: &T,
    target: &T::Target,
    buf: B,
    wire: u64,
) -> TransferFuture<B> {
    TransferFuture::new_with(|| t.write(target, buf, wire))
}

fn launch_read<T: Transport, B: IoBufMut>(
    t: &T,
    target: &T::Target,
    buf: B,
    wire: u64,
) -> TransferFuture<B> {
    TransferFuture::new_with(|| t.read(target, buf, wire))
}

impl<T: Transport, B: IoBuf> Batch<T, B> {
    /// An empty batch on `transport`.
    pub fn new(transport: T, opts: BatchOptions) -> Self {
        use std::sync::atomic::{AtomicU64, Ordering};
        static IDS: AtomicU64 = AtomicU64::new(1);
        Batch {
            transport,
            opts,
            tasks: Tasks::new(),
            id: IDS.fetch_add(1, Ordering::Relaxed),
            start: Self::submit_with::<Boxed>,
            since: None,
        }
    }

    /// Counts the batch as submitted at `at`, a clock reading its caller
    /// took already (a caller lane's, at the start of the call): its
    /// deadline and [`Quiesced::elapsed`](crate::Quiesced::elapsed) count
    /// from then, and `submit` reads no clock. `at` must not be later than
    /// the submit, so the deadline is never longer than asked.
    pub(crate) fn started_at(&mut self, at: Instant) {
        self.since = Some(at);
    }

    /// This batch's id (in logs).
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Tasks so far.
    pub fn len(&self) -> usize {
        self.tasks.len()
    }

    /// True if no task was added.
    pub fn is_empty(&self) -> bool {
        self.tasks.is_empty()
    }

    fn check(&self, buf_len: u64, target: &T::Target, exact: bool) -> Result<(), BatchError> {
        if self.tasks.len() >= self.opts.max_tasks {
            return Err(BatchError::TooLarge {
                max: self.opts.max_tasks,
            });
        }
        let range = self.transport.len(target);
        if range == 0 {
            return Err(BatchError::Empty);
        }
        if (exact && buf_len != range) || buf_len < range {
            return Err(BatchError::LengthMismatch {
                buf: buf_len,
                range,
            });
        }
        Ok(())
    }

    /// Adds a write of `src`'s initialised bytes to `to`. Returns the task's index.
    pub fn write(&mut self, src: B, to: T::Target) -> Result<usize, Rejected<B>> {
        if let Err(reason) = self.check(src.bytes_init() as u64, &to, true) {
            return Err(Rejected { reason, buf: src });
        }
        let i = self.push(launch_write::<T, B>, true, to, src);
        if i == 0 {
            self.start = Self::submit_with::<Writes>;
        }
        Ok(i)
    }

    fn push(
        &mut self,
        launch: crate::run::Launch<T, B>,
        writes: bool,
        target: T::Target,
        buf: B,
    ) -> usize {
        if self.tasks.len() == 1 {
            self.start = Self::submit_with::<Boxed>;
        }
        self.tasks.push(Task {
            launch,
            writes,
            target,
            buf: Some(buf),
            state: TaskState::Queued,
            bytes: 0,
            attempts: 0,
            remote: crate::RemoteState::Answered,
        });
        self.tasks.len() - 1
    }

    /// Submits the batch: transfers start now. The future resolves to the
    /// [`Outcome`](crate::Outcome) once every task has quiesced (or the fence
    /// ran out of grace).
    pub fn submit(self) -> Submitted<B> {
        (self.start)(self)
    }

    /// Submits with the first task's transfer started by `K`.
    fn submit_with<K: Start<T, B> + 'static>(self) -> Submitted<B> {
        let shared = Handoff::new_shared();
        let driver = Driver::new(
            self.transport,
            self.opts,
            self.tasks,
            shared.clone(),
            self.id,
            self.since.unwrap_or_else(Instant::now),
        );
        // The future holds the first transfer's state too (1.7 KiB for a
        // small TCP write): past glibc's per-thread cache, so its block is
        // recycled rather than allocated per batch, and built in it.
        let mut driver = DriverFuture::new_with(|| driver.run::<K>());
        // Start the transfers now, with the waker of the task submitting
        // (the one that will most likely await it). Outside a task, or if
        // another task polls the `Submitted` first, that first poll polls
        // the driver again, which registers the right waker.
        let submitting = quiesce_runtime::TaskPoll::current();
        let waker = submitting.as_ref().map_or(Waker::noop(), |p| p.waker());
        let finished = Pin::new(&mut driver)
            .poll(&mut Context::from_waker(waker))
            .is_ready();
        Submitted {
            shared,
            recycle: Handoff::recycle,
            done: false,
            submitting,
            driver: (!finished).then_some(driver),
            runtime: quiesce_runtime::Handle::try_current(),
            detach: crate::outcome::detach::<B>,
        }
    }
}

impl<T: Transport, B: IoBufMut> Batch<T, B> {
    /// Adds a read of `from` into the first bytes of `dst`. Returns the task's index.
    pub fn read(&mut self, dst: B, from: T::Target) -> Result<usize, Rejected<B>> {
        if let Err(reason) = self.check(dst.bytes_total() as u64, &from, false) {
            return Err(Rejected { reason, buf: dst });
        }
        let i = self.push(launch_read::<T, B>, false, from, dst);
        if i == 0 {
            self.start = Self::submit_with::<Reads>;
        }
        Ok(i)
    }
}
