//! Tickets of batches whose completion was unknown (-2): waited on and
//! polled from the caller's thread, answered by the engine's; and what a
//! ticket answers once the engine's thread has ended (`end::ThreadEnd`).

use std::thread;
use std::time::{Duration, Instant};

use quiesce_runtime::IoBufMut;
use smallvec::SmallVec;

use super::call::finish;
use super::{SyncEngine, SyncError, SyncOutcome};
use crate::Ticket;

impl SyncEngine {
    /// Waits up to `timeout` for ticket `id`'s batch to drain. `Ok(None)`
    /// if it has not (the code stays -2).
    pub fn wait<B: IoBufMut + Send>(
        &self,
        id: u64,
        timeout: Duration,
    ) -> Result<Option<SyncOutcome<B>>, SyncError> {
        let deadline = quiesce_runtime::time::deadline_in(timeout);
        loop {
            let polled = match self.poll_ticket::<B>(id) {
                // The engine stopped: its answer once the drain is known
                // (see `poll`).
                Err(SyncError::Stopped) => loop {
                    // Known before the look: then the look saw the record.
                    let settled = self.end.settled(|| self.finished());
                    let out = self.after_stop(id)?;
                    if out.is_some() || settled || Instant::now() >= deadline {
                        return Ok(out);
                    }
                    thread::sleep(Duration::from_millis(1));
                },
                r => r?,
            };
            match polled {
                Some(o) => return Ok(Some(o)),
                None if Instant::now() >= deadline => return Ok(None),
                None => thread::sleep(Duration::from_micros(200)),
            }
        }
    }

    /// The outcome of ticket `id` if its batch has drained.
    ///
    /// Once the engine's thread is gone: -1, once, for a ticket that was
    /// out when the engine stopped and whose drain reaped every operation
    /// (nothing touches its memory; its buffers, reports and whatever its
    /// targets confirmed went with the thread: `remote_confirmed` is
    /// false); `Ok(None)` while the stop's drain runs (it never waits for
    /// it; [`wait`](Self::wait) does, up to its timeout), and for good where
    /// whether the batch drained is not known — the drain ran out of time
    /// and left operations live, or the thread died — so the code stays -2,
    /// the memory pinned.
    pub fn poll<B: IoBufMut + Send>(&self, id: u64) -> Result<Option<SyncOutcome<B>>, SyncError> {
        match self.poll_ticket(id) {
            Err(SyncError::Stopped) => self.after_stop(id),
            r => r,
        }
    }

    fn after_stop<B>(&self, id: u64) -> Result<Option<SyncOutcome<B>>, SyncError> {
        let reaped = self.end.orphaned(id)?;
        Ok(reaped.then(|| SyncOutcome {
            code: crate::SYNC_FAILED,
            buffers: None,
            tasks: SmallVec::new(),
            ticket: None,
            remote_confirmed: false,
        }))
    }

    fn poll_ticket<B: IoBufMut + Send>(
        &self,
        id: u64,
    ) -> Result<Option<SyncOutcome<B>>, SyncError> {
        self.call(move |st, tx| {
            let mut tickets = st.tickets.borrow_mut();
            let Some(ticket) = tickets.remove(&id) else {
                let _ = tx.send(Err(SyncError::UnknownTicket(id)));
                return;
            };
            let ticket = match ticket.downcast::<Ticket<B>>() {
                Ok(t) => *t,
                Err(other) => {
                    tickets.insert(id, other);
                    let _ = tx.send(Err(SyncError::UnknownTicket(id)));
                    return;
                }
            };
            // Only a drained ticket is taken: one whose batch panicked
            // (the panic was logged) never drains, and stays -2 with its
            // memory pinned rather than unwinding the engine's thread.
            if !ticket.is_quiesced() {
                tickets.insert(id, Box::new(ticket));
                let _ = tx.send(Ok(None));
                return;
            }
            match ticket.try_take() {
                Ok(q) => {
                    let _ = tx.send(Ok(Some(finish(q))));
                }
                Err(t) => {
                    tickets.insert(id, Box::new(t));
                    let _ = tx.send(Ok(None));
                }
            }
        })?
    }
}
