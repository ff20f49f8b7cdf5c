//! quiesce: a thread-per-core transfer runtime whose batches resolve only once
//! every transfer in them has quiesced.
//!
//! This facade re-exports the member crates. [`runtime`] is the executor and
//! reactor (io_uring, epoll fallback, timers, completion sources, shards).
#![deny(missing_docs)]

pub use quiesce_runtime as runtime;
pub use quiesce_runtime::{spawn_local, Runtime};
