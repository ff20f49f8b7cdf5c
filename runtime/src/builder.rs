//! [`Builder`]: configures a [`Runtime`] (driver, ring, drain, spin) and
//! builds it on the current thread; [`BuildError`] says why it could not.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::rc::Rc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use slab::Slab;

use crate::context::Context;
use crate::crowding::Crowding;
use crate::driver::iour::{RingConfig, Uring};
use crate::driver::poll::Poller;
use crate::driver::{Driver, DriverKind, Unparker};
use crate::executor::{TaskWaker, MAIN_TASK, OP_BUDGET};
use crate::runtime::Runtime;
use crate::source::Sources;
use crate::stats::Counters;
use crate::time::Timers;

static NEXT_RUNTIME_ID: AtomicUsize = AtomicUsize::new(1);

/// Why a runtime could not be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// io_uring was required but is not available; the reason says why.
    #[error("io_uring is unavailable: {reason}")]
    IoUringUnavailable {
        /// What the probe concluded (seccomp, missing kernel support, memlock…).
        reason: &'static str,
        /// The error of the `io_uring_setup` call.
        #[source]
        source: io::Error,
    },
    /// `QUIESCE_DRIVER` holds something other than `io_uring`, `epoll` or `auto`.
    #[error("QUIESCE_DRIVER={0:?} is not one of io_uring, epoll, auto")]
    BadDriverEnv(String),
    /// Creating the eventfd or the epoll instance failed.
    #[error("runtime set-up failed: {0}")]
    Io(#[from] io::Error),
}

/// Explains an `io_uring_setup` failure.
fn uring_reason(e: &io::Error) -> &'static str {
    match e.raw_os_error() {
        Some(libc::EPERM) => "blocked: a seccomp filter (containers) or kernel.io_uring_disabled forbids io_uring_setup",
        Some(libc::ENOSYS) => "the kernel was built without io_uring",
        Some(libc::ENOMEM) => "not enough locked memory for the rings: raise RLIMIT_MEMLOCK (ulimit -l) or use fewer entries",
        Some(libc::EINVAL) => "the kernel rejected the ring set-up flags (too old for SQPOLL/DEFER_TASKRUN?)",
        _ if e.kind() == io::ErrorKind::Unsupported => "the kernel's io_uring lacks required features (needs 5.11+)",
        _ => "io_uring_setup failed",
    }
}

/// Configures and builds a [`Runtime`].
#[derive(Debug, Clone)]
pub struct Builder {
    driver: Option<DriverKind>,
    ring: RingConfig,
    drain_timeout: Duration,
    spin: Duration,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            driver: None,
            ring: RingConfig {
                entries: 256,
                cq_entries: None,
                sqpoll_idle: None,
                single_issuer: true,
                defer_taskrun: false,
                coop_taskrun: true,
            },
            drain_timeout: Duration::from_secs(10),
            spin: Duration::ZERO,
        }
    }
}

impl Builder {
    /// A builder with the defaults: `QUIESCE_DRIVER` or auto, 256 SQ entries,
    /// single issuer and cooperative task running.
    pub fn new() -> Builder {
        Builder::default()
    }

    /// Forces a backend (overrides `QUIESCE_DRIVER`).
    pub fn driver(mut self, kind: DriverKind) -> Self {
        self.driver = Some(kind);
        self
    }

    /// Submission queue entries (rounded up to a power of two by the kernel).
    pub fn entries(mut self, n: u32) -> Self {
        self.ring.entries = n.max(1);
        self
    }

    /// Completion queue entries (default: twice the SQ).
    pub fn cq_entries(mut self, n: u32) -> Self {
        self.ring.cq_entries = Some(n);
        self
    }

    /// A kernel thread polls the SQ, idling after `idle` (`IORING_SETUP_SQPOLL`).
    pub fn sqpoll(mut self, idle: Duration) -> Self {
        self.ring.sqpoll_idle = Some(idle);
        self
    }

    /// `IORING_SETUP_SINGLE_ISSUER` (default on: one thread submits).
    pub fn single_issuer(mut self, on: bool) -> Self {
        self.ring.single_issuer = on;
        self
    }

    /// `IORING_SETUP_DEFER_TASKRUN`: completions run only when the reactor
    /// asks for them (implies single issuer). Default off.
    pub fn defer_taskrun(mut self, on: bool) -> Self {
        self.ring.defer_taskrun = on;
        self
    }

    /// `IORING_SETUP_COOP_TASKRUN` (default on).
    pub fn coop_taskrun(mut self, on: bool) -> Self {
        self.ring.coop_taskrun = on;
        self
    }

    /// How long dropping the runtime waits for cancelled operations to reap
    /// before it leaks their buffers rather than free them early.
    pub fn drain_timeout(mut self, d: Duration) -> Self {
        self.drain_timeout = d;
        self
    }

    /// Busy-polls for up to `d` (completions, completion sources, wakes from
    /// other threads) before the reactor blocks; zero (the default) never
    /// spins. A blocked reactor costs a wake-up when work arrives — a few µs
    /// on bare metal, tens on some VMs — so a runtime that serves one
    /// latency-bound caller spins, at the price of up to `d` of CPU each
    /// time it goes idle. While it spins, a wake from another thread is a
    /// queue push without an eventfd write.
    pub fn spin(mut self, d: Duration) -> Self {
        self.spin = d;
        self
    }

    /// Builds the runtime on the current thread.
    pub fn build(&self) -> Result<Runtime, BuildError> {
        let kind = match self.driver {
            Some(k) => k,
            None => DriverKind::from_env()?.unwrap_or(DriverKind::Auto),
        };
        let id = NEXT_RUNTIME_ID.fetch_add(1, Ordering::Relaxed);
        let unparker = std::sync::Arc::new(Unparker::new(id)?);
        let driver = match kind {
            DriverKind::Epoll => Driver::Poll(Poller::new(unparker.fd())?),
            DriverKind::IoUring => match Uring::new(&self.ring, unparker.fd()) {
                Ok(u) => Driver::Uring(u),
                Err(e) => {
                    return Err(BuildError::IoUringUnavailable {
                        reason: uring_reason(&e),
                        source: e,
                    })
                }
            },
            DriverKind::Auto => match Uring::new(&self.ring, unparker.fd()) {
                Ok(u) => Driver::Uring(u),
                Err(e) => {
                    tracing::warn!(error = %e, reason = uring_reason(&e), "io_uring unavailable; falling back to epoll");
                    Driver::Poll(Poller::new(unparker.fd())?)
                }
            },
        };
        tracing::debug!(runtime = id, driver = %driver.kind(), "runtime built");
        if !self.spin.is_zero() {
            Crowding::calibrate();
        }
        let cx = Context {
            id,
            driver: RefCell::new(driver),
            ready: RefCell::new(VecDeque::with_capacity(64)),
            tasks: RefCell::new(Slab::new()),
            spare_wakers: RefCell::new(Vec::new()),
            polling: Cell::new(None),
            poll_seq: Cell::new(0),
            main_task: RefCell::new(None),
            timers: RefCell::new(Timers::default()),
            sources: RefCell::new(Sources::default()),
            unparker,
            counters: Counters::default(),
            budget: Cell::new(OP_BUDGET),
            deferred: RefCell::new(Vec::new()),
            tick_bytes: Cell::new(0),
            stranded: Cell::new(0),
            spin: self.spin,
            crowding: Crowding::default(),
            closed: Cell::new(false),
            lineage: crate::fork::Lineage::here(),
            late_cancels: RefCell::default(),
        };
        let main = TaskWaker::new(MAIN_TASK, cx.unparker.clone());
        Ok(Runtime::from_parts(Rc::new(cx), main, self.drain_timeout))
    }
}
