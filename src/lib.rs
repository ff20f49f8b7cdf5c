//! quiesce: a thread-per-core transfer runtime whose batches resolve only once
//! every transfer in them has quiesced.
//!
//! This facade re-exports the member crates: [`runtime`] (executor, io_uring
//! and epoll drivers, timers, completion sources, shards), [`transports`]
//! (segments, peers, the TCP and RDMA engines), [`batch`] (batches, outcomes,
//! fences, the sync and C APIs) and [`directory`] (finding nodes and segments
//! by name: P2P or etcd).
#![deny(missing_docs)]

pub mod cluster;
pub mod scenario;
pub mod stale;
pub mod target_child;

pub use quiesce_batch as batch;
pub use quiesce_batch::logs;
pub use quiesce_directory as directory;
pub use quiesce_runtime as runtime;
pub use quiesce_runtime::{spawn_local, Runtime};
pub use quiesce_transports as transports;
