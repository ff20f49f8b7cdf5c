//! A spinning reactor that shares its core with another thread moves to
//! another core.
//!
//! A runtime that spins ([`Builder::spin`](crate::Builder::spin)) offers
//! its core to other threads between polls (`sched_yield`). When another
//! runnable thread shares that core — most often the very peer it polls
//! for, another process's reactor spinning too — every yield hands the core
//! over, and the two take turns on one core while another core may sit
//! idle. The kernel leaves such a pair in place for milliseconds to tens of
//! milliseconds: both threads are cache-hot, so the balancer does not move
//! them, and a wake-up does not either (with every core this busy the
//! scheduler skips its search for an idle core) — docs/BENCHMARKS.md,
//! "2026-12-04, night: two spinners on one core". A yield that gives the core
//! away takes several times as long as one that finds nobody waiting;
//! after a run of those (16 to 143 in a row, drawn anew each time, so two
//! crowded spinners seldom both move at once) the thread moves itself:
//! its affinity without this core, then its own affinity back — the
//! kernel does not move it back.
//!
//! Never for a thread allowed on one core (a pinned shard, `taskset`):
//! there, taking turns through `sched_yield` is the fastest hand-over
//! there is. At most once per [`QUIET`] — doubled, up to [`QUIET_MAX`],
//! while moves keep finding a crowded core (every core busy, or both
//! spinners moved to the same one).
//!
//! The same timing says when to yield at all: while the last yield found
//! nobody waiting, a spinner offers its core at every [`ALONE_EVERY`]th
//! poll only — a yield is a syscall during which nothing is polled (a
//! local 4 KiB write from Python, p50 2.4–2.5 → 2.1–2.2 µs) — and at every
//! poll once one gave the core away, so a peer on the same core (one
//! allowed core) is handed it as soon as before.

use std::cell::Cell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::context;
use crate::stats::Counters;

/// Yields in a row that each gave the core away before the thread moves:
/// at least this many, plus a number drawn below [`SPREAD`] — two crowded
/// spinners count in step (each yields while the other runs), and a move
/// takes ~0.1 ms, so equal counts would move both, to the same core.
const CROWDED_YIELDS: u32 = 16;
const SPREAD: u64 = 128;
/// A yield that took more than this many times the fastest one seen gave
/// the core to another thread (alone ~0.19 µs on the project's VM; handing
/// the core to another spinner and getting it back ~1.0 µs).
const SLOWER: u64 = 3;
/// While its last yield found nobody waiting, a spinner yields at every
/// this many polls only; while the last gave the core away (a thread waits
/// for it: on one allowed core, often the peer), at every poll.
const ALONE_EVERY: u32 = 8;
/// After a move, how long before another.
const QUIET: Duration = Duration::from_millis(1);
/// The longest wait between moves when they keep finding a crowded core.
const QUIET_MAX: Duration = Duration::from_secs(1);

/// The fastest `sched_yield` any thread of this process has timed, in ns:
/// what a yield costs when nobody else wants the core.
static FASTEST_YIELD_NS: AtomicU64 = AtomicU64::new(u64::MAX);

/// One runtime's view of whether its core is shared.
pub(crate) struct Crowding {
    /// Consecutive yields that gave the core away.
    in_a_row: Cell<u32>,
    /// How many of them make the thread move (drawn after each move).
    threshold: Cell<u32>,
    /// The last move, and the wait before the next.
    moved: Cell<Option<(Instant, Duration)>>,
    /// xorshift state for the threshold.
    seed: Cell<u64>,
}

impl Default for Crowding {
    fn default() -> Self {
        // Two spinners (threads, processes) draw different thresholds.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as u64);
        let seed = ((std::process::id() as u64) << 32) ^ nanos ^ thread_number() | 1;
        let c = Crowding {
            in_a_row: Cell::new(0),
            threshold: Cell::new(CROWDED_YIELDS),
            moved: Cell::new(None),
            seed: Cell::new(seed),
        };
        c.draw_threshold();
        c
    }
}

impl Crowding {
    /// Times a few yields, once per process, before the first spin: the
    /// baseline a crowded yield is told from (a runtime is usually built
    /// before its peers crowd it; every uncrowded yield later lowers it).
    pub(crate) fn calibrate() {
        if FASTEST_YIELD_NS.load(Ordering::Relaxed) != u64::MAX {
            return;
        }
        for _ in 0..8 {
            timed_yield(Instant::now());
        }
    }

    /// Between two polls of a spin (`polls` so far): yields the core,
    /// timed from `since` (a clock reading the caller just took: one fewer
    /// per poll) — at every poll while the last yield gave the core away,
    /// else at every [`ALONE_EVERY`]th — and moves the thread to another
    /// core after a run of yields that each gave it away (module docs).
    pub(crate) fn offer(&self, since: Instant, polls: u32, counters: &Counters) {
        // Nobody took the core at the last yield: offer it at every eighth
        // poll only (a `sched_yield` is a syscall, ~0.19 µs during which
        // nothing is polled).
        if self.in_a_row.get() == 0 && !polls.is_multiple_of(ALONE_EVERY) {
            return;
        }
        let (took, now) = timed_yield(since);
        if took
            <= FASTEST_YIELD_NS
                .load(Ordering::Relaxed)
                .saturating_mul(SLOWER)
        {
            self.in_a_row.set(0);
            return;
        }
        let n = self.in_a_row.get() + 1;
        self.in_a_row.set(n);
        if n < self.threshold.get() {
            return;
        }
        self.in_a_row.set(0);
        self.draw_threshold();
        let quiet = match self.moved.get() {
            Some((at, quiet)) if now < at + quiet => return,
            // Moving did not help for long: every core is this busy.
            Some((at, quiet)) if now < at + 4 * quiet => (quiet * 2).min(QUIET_MAX),
            _ => QUIET,
        };
        self.moved.set(Some((now, quiet)));
        match crate::driver::socket::move_off_current_core() {
            Ok(true) => Counters::bump(&counters.crowded),
            Ok(false) => {}
            Err(e) => tracing::debug!(error = %e, "could not move off a shared core"),
        }
    }

    fn draw_threshold(&self) {
        let mut x = self.seed.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        self.seed.set(x);
        self.threshold.set(CROWDED_YIELDS + (x % SPREAD) as u32);
    }
}

/// A number that differs between the threads of a process.
fn thread_number() -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    std::thread::current().id().hash(&mut h);
    h.finish()
}

/// One `sched_yield`, timed from `start`; lowers the process's fastest.
/// Returns how long it took (ns) and when it returned.
fn timed_yield(start: Instant) -> (u64, Instant) {
    std::thread::yield_now();
    let now = Instant::now();
    let took = u64::try_from(now.duration_since(start).as_nanos()).unwrap_or(u64::MAX);
    // No yield takes no time: 0 is a bad reading (a `since` after the
    // yield began), and as the fastest it would make every yield crowded.
    if took > 0 && took < FASTEST_YIELD_NS.load(Ordering::Relaxed) {
        FASTEST_YIELD_NS.store(took, Ordering::Relaxed);
    }
    (took, now)
}

/// Offers this thread's core to other threads (`sched_yield`), for a task
/// that polls something itself while its runtime spins (a socket), as the
/// runtime's own spin does between polls: at every poll while another
/// thread wants the core, else at every eighth; and, like it, moves the
/// thread to another core when every yield hands this one to another
/// thread (see the module docs). `now` is a clock reading the caller just
/// took (its spin's time check), `polls` how many polls it made so far.
/// Outside a runtime it only yields.
pub fn offer_core(now: Instant, polls: u32) {
    context::try_with(|cx| match cx {
        Some(cx) => cx.crowding.offer(now, polls, &cx.counters),
        None => std::thread::yield_now(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A reading that says a yield took no time (a `since` after the
    /// yield began, a coarse clock) must not become the process's fastest:
    /// 0 × SLOWER would make every later yield look crowded.
    #[test]
    fn a_yield_that_seems_to_take_no_time_is_not_the_fastest() {
        let (took, _) = timed_yield(Instant::now() + std::time::Duration::from_millis(5));
        assert_eq!(took, 0);
        assert!(FASTEST_YIELD_NS.load(Ordering::Relaxed) > 0);
    }
}
