//! Batches whose completion is unknown: their memory stays held, by
//! ticket, until the engine says the batch drained — asked by the
//! `CompletionUnknown` itself (`wait`), or for every ticket at once
//! (`Engine.wait_for_quiescence`, which first waits for the outcomes of
//! submitted batches, and `Engine.pending`). Each drained outcome is kept
//! (the engine answers a ticket once) for any `wait` that asks later: one
//! after a sweep, or after a wait whose caller was interrupted.

use std::time::{Duration, Instant};

use pyo3::prelude::*;
use quiesce_batch::ffi::RawBuf;

use quiesce_batch::sync::SyncError;

use super::error::from_sync;
use super::{report, Core, Ending, Report, WAIT_SLICE};
use crate::node::lock;

/// Drained outcomes kept for a later `wait`: past this many, the oldest
/// goes (its `CompletionUnknown`, if still alive, answers from its own
/// copy only if it waited itself).
pub(super) const ANSWERS_KEPT: usize = 4096;

impl Core {
    /// The outcome of `ticket` if it drained already: kept, not taken,
    /// so that a wait whose caller never got it (a `KeyboardInterrupt` as
    /// the call returned) finds it again.
    pub(super) fn answer(&self, ticket: u64) -> Option<Report> {
        let answered = lock(&self.answered);
        let (_, r) = answered.iter().find(|(t, _)| *t == ticket)?;
        Some(r.clone())
    }

    /// Waits until `deadline` for `ticket`'s batch to drain: its outcome,
    /// or None if it has not. A sweep on another thread (`quiesce`) may be
    /// answered the ticket first (the engine answers a ticket once): its
    /// outcome is then taken from the kept answers. The outcome stays kept
    /// (the last [`ANSWERS_KEPT`] are) for the next wait of the same ticket.
    pub(super) fn wait(
        &self,
        py: Python<'_>,
        ticket: u64,
        deadline: Instant,
    ) -> PyResult<Option<Report>> {
        loop {
            if let Some(r) = self.answer(ticket) {
                return Ok(Some(r));
            }
            match self.reap(py, ticket, deadline) {
                // Answered to a sweep, which keeps the outcome before it
                // lets go of the ticket: here soon, unless it is gone.
                Err(SyncError::UnknownTicket(_)) if lock(&self.tickets).contains_key(&ticket) => {
                    if Instant::now() >= deadline {
                        return Ok(None);
                    }
                    py.detach(|| std::thread::sleep(Duration::from_micros(200)));
                }
                Err(SyncError::UnknownTicket(_)) if self.answered_has(ticket) => {}
                // Neither out nor kept: not this engine's, or a sweep
                // collected it and more than ANSWERS_KEPT others drained
                // since.
                Err(SyncError::UnknownTicket(_)) => {
                    return Err(super::error::invalid(
                        py,
                        &format!(
                            "ticket {ticket}: not out, and its outcome not among the last \
                             {ANSWERS_KEPT} kept (a ticket of this engine whose batch drained and \
                             a sweep, pending() or wait_for_quiescence(), let its buffers go)"
                        ),
                    ))
                }
                Err(SyncError::Stopped) => return Err(self.engine_closed(py)),
                r => return r.map_err(|e| from_sync(py, &e)),
            }
        }
    }

    fn answered_has(&self, ticket: u64) -> bool {
        lock(&self.answered).iter().any(|(t, _)| *t == ticket)
    }

    /// Waits until `deadline` for `ticket`'s batch to drain; settles its
    /// memory (lets it go) once it did, first keeping the outcome among
    /// the answers (for the ticket's own `wait`, a sweep's or a later one).
    fn reap(
        &self,
        py: Python<'_>,
        ticket: u64,
        deadline: Instant,
    ) -> Result<Option<Report>, SyncError> {
        let out = py.detach(|| loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let began = Instant::now();
            match self.with(|e| e.wait::<RawBuf>(ticket, left.min(WAIT_SLICE))) {
                Ok(None) if !left.is_zero() => {
                    // Answered at once (an engine whose thread died never
                    // drains anything): wait, do not spin on its lock.
                    if began.elapsed() < Duration::from_millis(1) {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                r => return r,
            }
        })?;
        Ok(out.map(|out| {
            let r = report(&out);
            {
                let mut answered = lock(&self.answered);
                if answered.len() == ANSWERS_KEPT {
                    answered.pop_front();
                }
                answered.push_back((ticket, r.clone()));
            }
            let held = lock(&self.tickets).remove(&ticket);
            if let Some(held) = held {
                self.settle(py, &out, held);
            }
            r
        }))
    }

    /// Waits until `deadline` for every submitted batch's outcome to be
    /// delivered (a -2 among them becomes a ticket), then for every ticket
    /// to drain, then for every blocking `run` on other threads to have
    /// its outcome (their buffers are claimed in [`InUse`] until then:
    /// without it, this said True while another thread's run still moved
    /// its buffers); whether none of them is left.
    ///
    /// [`InUse`]: super::in_use::InUse
    pub(super) fn quiesce_all(&self, py: Python<'_>, deadline: Instant) -> PyResult<bool> {
        if !self.closed(py) {
            py.detach(|| {
                while !lock(&self.flights).is_empty() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
            let left = self.quiesce(py, deadline)?;
            // (Runs release their buffers with the GIL: waited for without;
            // a close ends the wait: what it could not drain stays claimed
            // for good, and its ending says so below.)
            py.detach(|| {
                while !self.in_use.is_empty()
                    && Instant::now() < deadline
                    && *lock(&self.ending) == Ending::Running
                {
                    std::thread::sleep(Duration::from_millis(1));
                }
            });
            // (A close meanwhile emptied the tickets and flights, drained
            // or not: its ending says which.)
            if !self.closed(py) {
                return Ok(left.is_empty()
                    && lock(&self.flights).is_empty()
                    && self.in_use.is_empty());
            }
        }
        // Closed: what it could not drain stays held for good. The flights
        // it left are let go (or kept) by the delivery thread, which needs
        // the GIL: waited for without it, or this said True while their
        // buffers were still held.
        py.detach(|| {
            while !lock(&self.flights).is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        let drained = *lock(&self.ending) == Ending::Drained;
        // Drained: the runs it cut off let go of their buffers as they
        // answer (with the GIL).
        py.detach(|| {
            while drained && !self.in_use.is_empty() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        });
        Ok(drained
            && lock(&self.tickets).is_empty()
            && lock(&self.flights).is_empty()
            && self.in_use.is_empty())
    }

    /// Reaps every ticket until `deadline` (each at least once), keeping
    /// the outcomes of those that drained; the tickets still undrained.
    pub(super) fn quiesce(&self, py: Python<'_>, deadline: Instant) -> PyResult<Vec<u64>> {
        let tickets: Vec<u64> = lock(&self.tickets).keys().copied().collect();
        if self.closed(py) {
            // Closed: nothing drains any more, and what is held stays held.
            return Ok(tickets);
        }
        let mut left = Vec::new();
        for t in tickets {
            match self.reap(py, t, deadline) {
                Ok(Some(_)) => {}
                Ok(None) => left.push(t),
                // The ticket's own `wait` on another thread was answered
                // it: not this sweep's; nor one a close took meanwhile.
                Err(SyncError::UnknownTicket(_)) => {}
                Err(SyncError::Stopped) if self.closed(py) => {}
                Err(e) => return Err(from_sync(py, &e)),
            }
        }
        Ok(left)
    }
}
