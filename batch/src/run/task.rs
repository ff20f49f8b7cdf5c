//! A batch's tasks: their state, the transfer each one runs, and how the
//! first task's transfer is started.

use std::future::Future;

use quiesce_runtime::{IoBuf, IoBufMut, JoinHandle};
use quiesce_transports::TransferError;
use smallvec::SmallVec;

use crate::outcome::{RemoteState, TaskReport, TaskStatus};
use crate::transport::Transport;

/// What a transfer resolves to: its result and its buffer.
pub(crate) type Transferred<B> = (Result<u64, TransferError>, B);

/// A boxed transfer of a batch of several tasks, in a block that the
/// thread's next transfer of the same shape reuses.
pub(crate) type TransferFuture<B> = quiesce_runtime::recycle::RecycledFuture<Transferred<B>>;

/// Starts one transfer (a write or a read, chosen when the task was added).
pub(crate) type Launch<T, B> = fn(&T, &<T as Transport>::Target, B, u64) -> TransferFuture<B>;

pub(crate) enum TaskState<B> {
    Queued,
    InFlight(InFlight<B>),
    Done(TaskStatus),
}

/// A transfer in flight.
pub(crate) enum InFlight<B> {
    /// The first task's: its future lives in the driver's own state (started
    /// by the batch's [`Start`]), so a one-task batch allocates nothing per
    /// transfer.
    Held,
    /// Polled by the driver itself: small batches pay no task per transfer.
    Inline(TransferFuture<B>),
    /// A task of its own: in a large batch a wake-up polls one transfer, not all.
    Spawned(JoinHandle<Transferred<B>>),
}

/// A batch's tasks: one is held inline (no allocation for a one-task batch).
pub(crate) type Tasks<T, B> = SmallVec<[Task<T, B>; 1]>;

/// Starts the first task's transfer, whose future the driver keeps in its
/// own state: [`Writes`] and [`Reads`] call the transport directly, so the
/// future is not boxed; [`Boxed`] goes through the task's [`Launch`], for
/// batches of more than one task, whose directions may differ.
pub(crate) trait Start<T: Transport, B> {
    fn start(
        transport: &T,
        task: &Task<T, B>,
        buf: B,
        wire: u64,
    ) -> impl Future<Output = Transferred<B>> + 'static;
}

/// The first task's transfer through its boxed [`Launch`].
pub(crate) struct Boxed;
/// The first (only) task is a write.
pub(crate) struct Writes;
/// The first (only) task is a read.
pub(crate) struct Reads;

impl<T: Transport, B: 'static> Start<T, B> for Boxed {
    fn start(
        transport: &T,
        task: &Task<T, B>,
        buf: B,
        wire: u64,
    ) -> impl Future<Output = Transferred<B>> + 'static {
        (task.launch)(transport, &task.target, buf, wire)
    }
}

impl<T: Transport, B: IoBuf> Start<T, B> for Writes {
    fn start(
        transport: &T,
        task: &Task<T, B>,
        buf: B,
        wire: u64,
    ) -> impl Future<Output = Transferred<B>> + 'static {
        transport.write_held(&task.target, buf, wire)
    }
}

impl<T: Transport, B: IoBufMut> Start<T, B> for Reads {
    fn start(
        transport: &T,
        task: &Task<T, B>,
        buf: B,
        wire: u64,
    ) -> impl Future<Output = Transferred<B>> + 'static {
        transport.read(&task.target, buf, wire)
    }
}

pub(crate) struct Task<T: Transport, B> {
    pub(crate) launch: Launch<T, B>,
    /// A write: bytes of it may land at the target after a cut. A read's
    /// only destination is the caller's buffer, quiescent once its
    /// transfer resolved: unconfirmed, it does not hold back a retry.
    pub(crate) writes: bool,
    pub(crate) target: T::Target,
    /// `Some` while the batch holds the buffer: before launch, after return.
    pub(crate) buf: Option<B>,
    pub(crate) state: TaskState<B>,
    pub(crate) bytes: u64,
    pub(crate) attempts: u32,
    /// What the target confirmed about the last attempt.
    pub(crate) remote: RemoteState,
}

impl<T: Transport, B> Task<T, B> {
    /// Makes the task terminal with its transfer's result; the buffer is
    /// back.
    pub(super) fn record(&mut self, res: Result<u64, TransferError>, buf: B) {
        self.buf = Some(buf);
        self.remote = match &res {
            Err(e) if !e.settles_remote() => RemoteState::Unconfirmed,
            _ => RemoteState::Answered,
        };
        let (status, bytes) = match res {
            Ok(n) => (TaskStatus::Completed, n),
            // Flushed (RDMA, posted): fenced, and unconfirmed (it does
            // not settle the remote) until a fence is acknowledged.
            Err(TransferError::Fenced | TransferError::Flushed) => (TaskStatus::Fenced, 0),
            Err(TransferError::FencedPartial { landed }) => (TaskStatus::Fenced, landed),
            Err(e) => {
                let landed = e.landed().unwrap_or(0);
                (TaskStatus::Failed(e), landed)
            }
        };
        self.bytes = bytes;
        self.state = TaskState::Done(status);
    }

    /// The task's report if it is terminal ([`Ticket::settled`](crate::Ticket::settled)).
    pub(super) fn settled(&self) -> Option<TaskReport> {
        let TaskState::Done(status) = &self.state else {
            return None;
        };
        Some(TaskReport {
            status: status.clone(),
            bytes: self.bytes,
            attempts: self.attempts,
            remote: self.remote,
        })
    }

    /// A terminal task's report and buffer.
    pub(super) fn into_report(self) -> (TaskReport, B) {
        let TaskState::Done(status) = self.state else {
            unreachable!("finish before quiescence")
        };
        let report = TaskReport {
            status,
            bytes: self.bytes,
            attempts: self.attempts,
            remote: self.remote,
        };
        (
            report,
            self.buf.expect("every terminal task holds its buffer"),
        )
    }
}
