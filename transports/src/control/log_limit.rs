//! One warning per interval for what a peer can make happen at will.
//!
//! A target warns when a connection breaks the protocol, stalls its
//! handshake, or finds no free slot: events a remote peer chooses, as often
//! as it likes. Logged each time, a flood of bad connections would be a
//! flood of log lines (and of the disk behind them). Each kind is logged at
//! most once per [`PEER_WARNING_EVERY`]; the rest are counted, and when the
//! interval ends a line says how many were not logged (`suppressed`) — by a
//! task that waits for the interval's end, so a burst that nothing follows
//! is reported too. The target's counters count every one.

use std::cell::Cell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use quiesce_runtime::time::sleep_until;
use quiesce_runtime::try_spawn_local;

/// At most one warning of a kind per this long.
pub(crate) const PEER_WARNING_EVERY: Duration = Duration::from_secs(1);

/// The target's limited kinds: a connection closed for breaking the
/// protocol, closed for going quiet (handshake deadline, idle limit; at
/// info), refused for want of a slot, and a refused proof.
pub(crate) struct PeerLogs {
    pub(crate) broke_protocol: LogLimit,
    pub(crate) timed_out: LogLimit,
    pub(crate) no_slot: LogLimit,
    pub(crate) refused_proof: LogLimit,
}

impl Default for PeerLogs {
    fn default() -> PeerLogs {
        let every = PEER_WARNING_EVERY;
        PeerLogs {
            broke_protocol: LogLimit::new(
                every,
                Severity::Warn,
                "closing a connection that broke the protocol",
            ),
            timed_out: LogLimit::new(
                every,
                Severity::Info,
                "closing a connection that went quiet",
            ),
            no_slot: LogLimit::new(
                every,
                Severity::Warn,
                "refusing a connection: every connection slot is authenticated",
            ),
            refused_proof: LogLimit::new(
                every,
                Severity::Warn,
                "refused a peer's proof: a wrong token (a different secret?) or no such segment",
            ),
        }
    }
}

/// The level a kind is logged at.
#[derive(Clone, Copy)]
pub(crate) enum Severity {
    Info,
    Warn,
}

/// The state of one kind of warning.
pub(crate) struct LogLimit {
    window: Rc<Window>,
    severity: Severity,
    /// What the kind's lines say (the count's line too).
    what: &'static str,
}

/// The current interval of a kind; shared with the task that reports its
/// count when it ends.
struct Window {
    every: Duration,
    /// Before this, the kind is counted, not logged.
    quiet_until: Cell<Option<Instant>>,
    suppressed: Cell<u64>,
    /// A task waits for the interval's end to report the count.
    reporting: Cell<bool>,
}

impl LogLimit {
    pub(crate) fn new(every: Duration, severity: Severity, what: &'static str) -> LogLimit {
        LogLimit {
            window: Rc::new(Window {
                every,
                quiet_until: Cell::new(None),
                suppressed: Cell::new(0),
                reporting: Cell::new(false),
            }),
            severity,
            what,
        }
    }

    /// `Some(n)`: log this one, and say that `n` more happened since the
    /// last one logged. `None`: counted, not logged; the count is logged
    /// when the interval ends if no line of this kind took it first.
    pub(crate) fn admit(&self) -> Option<u64> {
        let admitted = self.window.admit_at(Instant::now());
        if admitted.is_none() && !self.window.reporting.replace(true) {
            self.report_at_end();
        }
        admitted
    }

    /// The kind's text, for the caller's line.
    pub(crate) fn what(&self) -> &'static str {
        self.what
    }

    /// Spawns the task that logs the count once the interval (as it stands
    /// then: a line admitted meanwhile starts a new one) has ended.
    fn report_at_end(&self) {
        let window = self.window.clone();
        let (severity, what) = (self.severity, self.what);
        let report = async move {
            while let Some(until) = window.quiet_until.get() {
                if Instant::now() >= until {
                    break;
                }
                sleep_until(until).await;
            }
            window.reporting.set(false);
            let n = window.suppressed.replace(0);
            if n == 0 {
                return;
            }
            let secs = window.every.as_secs_f64();
            match severity {
                Severity::Info => tracing::info!(
                    suppressed = n,
                    "{what}: {n} more in the last {secs} s, not logged one by one"
                ),
                Severity::Warn => tracing::warn!(
                    suppressed = n,
                    "{what}: {n} more in the last {secs} s, not logged one by one"
                ),
            }
        };
        // Outside a runtime (never, for the target's tasks) the count waits
        // for the kind's next line, as it would have before.
        if try_spawn_local(report).is_err() {
            self.window.reporting.set(false);
        }
    }
}

impl Window {
    fn admit_at(&self, now: Instant) -> Option<u64> {
        if self.quiet_until.get().is_some_and(|t| now < t) {
            self.suppressed.set(self.suppressed.get() + 1);
            return None;
        }
        self.quiet_until.set(Some(now + self.every));
        Some(self.suppressed.replace(0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_per_interval_then_the_count_of_the_rest() {
        let l = LogLimit::new(Duration::from_secs(1), Severity::Warn, "test");
        let l = &l.window;
        let t = Instant::now();
        assert_eq!(l.admit_at(t), Some(0));
        for i in 1..=9 {
            assert_eq!(l.admit_at(t + Duration::from_millis(100 * i)), None);
        }
        assert_eq!(l.admit_at(t + Duration::from_secs(1)), Some(9));
        assert_eq!(l.admit_at(t + Duration::from_millis(1500)), None);
        assert_eq!(l.admit_at(t + Duration::from_secs(3)), Some(1));
    }
}
