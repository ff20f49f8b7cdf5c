//! The reactor's backends and the operation futures that run on them.
//!
//! Two backends sit behind one API: `iour` submits operations to io_uring
//! and reaps their completions; `poll` runs the same operations as
//! non-blocking syscalls when `epoll` (through `mio`) says the fd is ready.
//! An [`Op`] is the future of one operation; its lifecycle, and what happens
//! to its buffers when it is dropped early, is documented on [`Op`].

pub(crate) mod iour;
pub(crate) mod lifecycle;
pub mod op;
pub(crate) mod poll;
pub(crate) mod shared_fd;
pub(crate) mod socket;
pub(crate) mod wake;

use std::fmt;
use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

pub(crate) use lifecycle::post_late_cancels;
pub use lifecycle::{Canceller, Op};
pub(crate) use wake::Unparker;

/// Which backend a runtime uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DriverKind {
    /// io_uring when the kernel allows it, else epoll (with a warning saying why).
    #[default]
    Auto,
    /// io_uring only: building the runtime fails if it is unavailable.
    IoUring,
    /// epoll (via mio) with non-blocking syscalls.
    Epoll,
}

impl DriverKind {
    /// Reads `QUIESCE_DRIVER` (`io_uring`, `epoll` or `auto`); `None` when unset.
    pub fn from_env() -> Result<Option<DriverKind>, crate::BuildError> {
        match std::env::var("QUIESCE_DRIVER") {
            Err(_) => Ok(None),
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "auto" => Ok(Some(DriverKind::Auto)),
                "io_uring" | "io-uring" | "iouring" | "uring" => Ok(Some(DriverKind::IoUring)),
                "epoll" | "poll" | "mio" => Ok(Some(DriverKind::Epoll)),
                _ => Err(crate::BuildError::BadDriverEnv(v)),
            },
        }
    }
}

impl fmt::Display for DriverKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DriverKind::Auto => "auto",
            DriverKind::IoUring => "io_uring",
            DriverKind::Epoll => "epoll",
        })
    }
}

/// Readiness an operation waits for on the epoll backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interest {
    /// Readable (or closed for reading).
    Read,
    /// Writable (or closed for writing).
    Write,
    /// Either (a `poll` for both).
    Either,
}

/// What a park reported besides operation completions.
#[derive(Default)]
pub(crate) struct ParkEvents {
    /// The cross-thread eventfd fired.
    pub(crate) woken: bool,
    /// Completion-source tokens whose fd became readable.
    pub(crate) sources_ready: Vec<u64>,
    /// Parked operations whose last completion arrived: dropped by the
    /// runtime once the driver is no longer borrowed.
    pub(crate) released: Vec<Box<dyn lifecycle::Parked>>,
}

/// The backend of one runtime.
// One per runtime, in place: boxing the larger variant would put a pointer
// chase in front of every op's poll.
#[allow(clippy::large_enum_variant)]
pub(crate) enum Driver {
    Uring(iour::Uring),
    Poll(poll::Poller),
}

impl Driver {
    pub(crate) fn kind(&self) -> DriverKind {
        match self {
            Driver::Uring(_) => DriverKind::IoUring,
            Driver::Poll(_) => DriverKind::Epoll,
        }
    }

    /// Operations whose buffers the kernel may still hold.
    pub(crate) fn in_flight(&self) -> usize {
        match self {
            Driver::Uring(u) => u.in_flight(),
            Driver::Poll(p) => p.waiting(),
        }
    }

    /// Flushes submissions and waits up to `timeout` (`None`: until an event)
    /// for completions, which wake their tasks.
    pub(crate) fn park(
        &mut self,
        timeout: Option<Duration>,
        counters: &crate::stats::Counters,
    ) -> io::Result<()> {
        match self {
            Driver::Uring(u) => u.park(timeout, counters),
            Driver::Poll(p) => p.park(timeout, counters),
        }
    }

    /// Whether a park reported anything besides operation completions.
    pub(crate) fn has_events(&self) -> bool {
        let e = match self {
            Driver::Uring(u) => &u.events,
            Driver::Poll(p) => &p.events,
        };
        e.woken || !e.sources_ready.is_empty() || !e.released.is_empty()
    }

    pub(crate) fn take_events(&mut self) -> ParkEvents {
        match self {
            Driver::Uring(u) => std::mem::take(&mut u.events),
            Driver::Poll(p) => std::mem::take(&mut p.events),
        }
    }

    /// Takes back the (emptied) list of ready sources that
    /// [`take_events`](Self::take_events) handed out, to fill again
    /// without allocating.
    pub(crate) fn keep_source_list(&mut self, list: Vec<u64>) {
        debug_assert!(list.is_empty());
        let events = match self {
            Driver::Uring(u) => &mut u.events,
            Driver::Poll(p) => &mut p.events,
        };
        if events.sources_ready.capacity() == 0 {
            events.sources_ready = list;
        }
    }

    /// Watches `fd` for readability on behalf of completion source `token`
    /// (one shot: re-armed by the source loop after each report).
    pub(crate) fn watch_source(
        &mut self,
        fd: RawFd,
        token: u64,
        counters: &crate::stats::Counters,
    ) -> io::Result<()> {
        match self {
            Driver::Uring(u) => {
                u.watch_source(fd, token, counters);
                Ok(())
            }
            Driver::Poll(p) => p.watch_source(fd, token),
        }
    }

    /// Stops watching a source's fd.
    pub(crate) fn unwatch_source(
        &mut self,
        fd: RawFd,
        token: u64,
        counters: &crate::stats::Counters,
    ) {
        match self {
            Driver::Uring(u) => u.unwatch_source(token, counters),
            Driver::Poll(p) => p.unwatch_source(fd),
        }
    }
}
