//! One warning per interval for what a peer can make happen at will.
//!
//! A target warns when a connection breaks the protocol, stalls its
//! handshake, or finds no free slot: events a remote peer chooses, as often
//! as it likes. Logged each time, a flood of bad connections would be a
//! flood of log lines (and of the disk behind them). Each kind is logged at
//! most once per [`PEER_WARNING_EVERY`]; the next line logged says how many
//! were not (`suppressed`). The target's counters count every one.

use std::cell::Cell;
use std::time::{Duration, Instant};

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
        PeerLogs {
            broke_protocol: LogLimit::new(PEER_WARNING_EVERY),
            timed_out: LogLimit::new(PEER_WARNING_EVERY),
            no_slot: LogLimit::new(PEER_WARNING_EVERY),
            refused_proof: LogLimit::new(PEER_WARNING_EVERY),
        }
    }
}

/// The state of one kind of warning.
pub(crate) struct LogLimit {
    every: Duration,
    /// Before this, the kind is counted, not logged.
    quiet_until: Cell<Option<Instant>>,
    suppressed: Cell<u64>,
}

impl LogLimit {
    pub(crate) const fn new(every: Duration) -> LogLimit {
        LogLimit {
            every,
            quiet_until: Cell::new(None),
            suppressed: Cell::new(0),
        }
    }

    /// `Some(n)`: log this one, and say that `n` more happened since the
    /// last one logged. `None`: counted, not logged.
    pub(crate) fn admit(&self) -> Option<u64> {
        self.admit_at(Instant::now())
    }

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
        let l = LogLimit::new(Duration::from_secs(1));
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
