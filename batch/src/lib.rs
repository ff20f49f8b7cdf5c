//! quiesce batches: transfers that resolve only on quiescence.
//!
//! A [`Batch`] owns the buffers of its tasks from the moment they are added.
//! [`Batch::submit`] starts every transfer and gives a future that resolves to
//! an [`Outcome`] only once every task is terminal **and** no kernel, NIC or
//! peer can touch the buffers — then the buffers come back, each exactly once.
//! A failure (with [`FailurePolicy::FailFast`]) or the deadline **fences** the
//! rest: a remote fence, then, if that has not brought every task home by half
//! the grace, a local teardown of the peers' connections. If the fence cannot
//! finish within the grace, the outcome is [`Outcome::CompletionUnknown`]: a
//! [`Ticket`] that keeps the buffers until the batch drains.
//!
//! ```compile_fail
//! # use quiesce_batch::*;
//! # async fn f(t: Ticket<Vec<u8>>) {
//! let bufs = t.buffers; // a ticket never hands out buffers before quiescence
//! # }
//! ```
#![deny(missing_docs)]

mod batch;
pub mod ffi;
pub mod logs;
mod options;
mod outcome;
mod run;
pub mod sim;
pub mod sync;
mod transport;

pub use batch::{Batch, BatchError, Rejected};
pub use options::{BatchOptions, FailurePolicy, RetryPolicy, LONGEST_WAIT};
pub use outcome::{
    Buffers, Outcome, Quiesced, RemoteState, Submitted, TaskReport, TaskStatus, Ticket,
};
pub use transport::{
    FencePeer, Key, OneSided, PeerKey, Range, Rdma, RdmaPeerKey, RdmaRange, RemoteRange, Segments,
    Tcp, Transport,
};

/// Sync code: every task completed.
pub const SYNC_OK: i32 = 0;
/// Sync code: the batch failed, and nothing touches the buffers any more.
pub const SYNC_FAILED: i32 = -1;
/// Sync code: completion unknown; do not free or reuse the buffers.
pub const SYNC_UNKNOWN: i32 = -2;
/// C-compatible code: an unknown handle (a null engine, a segment handle never
/// opened, a ticket never issued or already collected). Nothing was started.
pub const SYNC_UNKNOWN_HANDLE: i32 = -3;
