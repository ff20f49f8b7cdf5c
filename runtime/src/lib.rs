//! quiesce's runtime: a single-threaded executor and reactor per core.
//!
//! * **Executor** — [`Runtime::block_on`], [`spawn_local`] of `!Send`
//!   futures, [`JoinHandle`]s that await or abort, wakers that work from any
//!   thread, and a cooperative budget so a busy task cannot starve I/O.
//! * **Drivers** — io_uring ([`DriverKind::IoUring`]) with operations as
//!   futures over owned buffers, or epoll ([`DriverKind::Epoll`]) with the same
//!   API over readiness; [`DriverKind::Auto`] probes and falls back.
//!   Dropping an operation early **parks its buffer in the driver** until the
//!   kernel's last completion for it is reaped.
//! * **Timers** — [`time::sleep`], [`time::sleep_until`], [`time::timeout`].
//! * **Completion sources** — [`source::register`] plugs a transport's own
//!   completion queue (RDMA) into the reactor, busy-polled or fd-notified.
//! * **Other processes** — [`process::PeerProcess`]: cross-memory attach
//!   to a process of this host, and whether it has exited;
//!   [`shm::SharedMemory`] and [`shm::Doorbell`]: memory shared with it,
//!   and the eventfds that wake it.
//! * **Recycled futures** — [`recycle::RecycledFuture`]: a boxed future
//!   whose heap block the thread's next future of its size reuses.
//! * **Shards** — [`shard::Shards`]: N pinned runtimes, channels between them,
//!   graceful shutdown that drains every runtime.
//!
//! ```
//! use quiesce_runtime::{Runtime, time};
//! let rt = Runtime::new().unwrap();
//! let v = rt.block_on(async {
//!     let h = quiesce_runtime::spawn_local(async { 40 + 2 });
//!     time::sleep(std::time::Duration::from_millis(1)).await;
//!     h.await.unwrap()
//! });
//! assert_eq!(v, 42);
//! ```
#![deny(missing_docs)]
#![warn(unsafe_op_in_unsafe_fn)]

pub mod buf;
mod builder;
mod closer;
mod context;
mod crowding;
pub mod driver;
mod executor;
pub mod fd;
pub mod fork;
pub mod heap;
pub mod net;
pub mod process;
pub mod recycle;
mod runtime;
pub mod shard;
pub mod shm;
pub mod source;
mod stats;
pub mod time;
pub mod timeline;

pub use buf::{BufResult, IoBuf, IoBufMut, Slice};
pub use builder::{BuildError, Builder};
pub use crowding::offer_core;
pub use driver::{Canceller, DriverKind, Op};
pub use executor::{
    spawn_local, try_spawn_local, yield_now, Handle, JoinError, JoinHandle, TaskPoll,
};
pub use runtime::{spin_time, strand, tasks_ready, Runtime, Undrained};
pub use stats::{stats, try_stats, Stats};

/// False once this thread's thread-locals are being torn down (the thread
/// is exiting): no runtime can be entered on it any more, and a runtime
/// dropped now leaks what its ops hold rather than free it.
pub fn thread_alive() -> bool {
    context::thread_alive()
}
