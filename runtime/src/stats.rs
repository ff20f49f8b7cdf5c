//! Counters a runtime keeps about itself, for metrics and for tests that must
//! prove an ordering (a buffer released only after its completion was reaped).

use std::cell::Cell;

use crate::context;

/// Per-runtime counters, updated on the runtime's own thread.
#[derive(Default)]
pub(crate) struct Counters {
    gen: Cell<u32>,
    pub(crate) tasks_spawned: Cell<u64>,
    pub(crate) polls: Cell<u64>,
    pub(crate) ticks: Cell<u64>,
    pub(crate) parks: Cell<u64>,
    pub(crate) ops_submitted: Cell<u64>,
    pub(crate) completions: Cell<u64>,
    pub(crate) zc_notifications: Cell<u64>,
    pub(crate) cancels_posted: Cell<u64>,
    pub(crate) ops_parked: Cell<u64>,
    pub(crate) parked_released: Cell<u64>,
    pub(crate) submit_full: Cell<u64>,
    pub(crate) enter_starved: Cell<u64>,
    pub(crate) crowded: Cell<u64>,
}

impl Counters {
    /// A fresh generation number (never 0) for a slab key.
    pub(crate) fn next_gen(&self) -> u32 {
        let g = self.gen.get().wrapping_add(1) & 0x3fff_ffff;
        let g = if g == 0 { 1 } else { g };
        self.gen.set(g);
        g
    }

    pub(crate) fn bump(c: &Cell<u64>) {
        c.set(c.get() + 1);
    }
}

/// A snapshot of the current runtime's counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Stats {
    /// Tasks spawned with `spawn_local`.
    pub tasks_spawned: u64,
    /// Task polls.
    pub polls: u64,
    /// Reactor loop iterations.
    pub ticks: u64,
    /// Times the reactor blocked waiting for events.
    pub parks: u64,
    /// Operations submitted to the driver.
    pub ops_submitted: u64,
    /// Completions reaped (io_uring CQEs, including zero-copy notifications;
    /// on epoll, operations that finished).
    pub completions: u64,
    /// Zero-copy send notifications reaped (io_uring only).
    pub zc_notifications: u64,
    /// Async cancels posted for operations.
    pub cancels_posted: u64,
    /// Operations whose future was dropped while the kernel still held their buffers.
    pub ops_parked: u64,
    /// Parked operations whose buffers were released after their last completion.
    pub parked_released: u64,
    /// Times the submission queue was full and was submitted early.
    pub submit_full: u64,
    /// Times `io_uring_enter` could not take the submissions for want of
    /// memory, resources or CQ room, and the reactor retried at its next
    /// turn (after a millisecond when nothing had completed).
    pub enter_starved: u64,
    /// Times the spinning reactor's thread moved itself to another core
    /// because another thread kept taking its core ([`offer_core`](crate::offer_core)).
    pub crowded: u64,
    /// Operations in flight now (submitted, not yet fully completed).
    pub in_flight: u64,
}

/// Returns the counters of the runtime running on this thread.
///
/// # Panics
/// Outside a runtime.
pub fn stats() -> Stats {
    try_stats().expect("quiesce: stats() needs a runtime")
}

/// The counters of the runtime running on this thread, if any.
pub fn try_stats() -> Option<Stats> {
    context::try_with(|cx| {
        let cx = cx?;
        let c = &cx.counters;
        Some(Stats {
            tasks_spawned: c.tasks_spawned.get(),
            polls: c.polls.get(),
            ticks: c.ticks.get(),
            parks: c.parks.get(),
            ops_submitted: c.ops_submitted.get(),
            completions: c.completions.get(),
            zc_notifications: c.zc_notifications.get(),
            cancels_posted: c.cancels_posted.get(),
            ops_parked: c.ops_parked.get(),
            parked_released: c.parked_released.get(),
            submit_full: c.submit_full.get(),
            enter_starved: c.enter_starved.get(),
            crowded: c.crowded.get(),
            in_flight: cx
                .driver
                .try_borrow()
                .map(|d| d.in_flight() as u64)
                .unwrap_or(0),
        })
    })
}
