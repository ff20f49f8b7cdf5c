//! How the engine's thread ends, as its callers see it. A stop from any
//! thread ([`SyncEngine::halt`](super::SyncEngine::halt)) ends the job loop
//! after the job it runs, and the thread's last act records how its
//! runtime's drain went. A call cut off by the stop (its batch dropped with
//! its task, the reply never sent) waits for that record before it answers:
//! -1 is true only if the drain reaped everything, so with operations left
//! live the call answers as the stop does ([`SyncError::Undrained`]).

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Condvar, Mutex};
use std::thread;
use std::time::Duration;

use super::{State, SyncEngine, SyncError};

/// The engine thread's end: asked for, and how it went.
#[derive(Default)]
pub(super) struct ThreadEnd {
    /// Set by a stop: the job loop ends after the job it runs.
    stopping: AtomicBool,
    /// Operations still live after the drain (`usize::MAX`: not known),
    /// once the thread has ended.
    live: Mutex<Option<usize>>,
    recorded: Condvar,
    /// The tickets still out when the job loop ended (`None`: it never
    /// got there, the thread died in a job).
    orphans: Mutex<Option<HashSet<u64>>>,
}

/// How often a wait for the record looks whether the thread died without
/// making one.
const CHECK: Duration = Duration::from_millis(50);

impl ThreadEnd {
    /// Whether a stop asked the job loop to end.
    pub(super) fn stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Asks the job loop to end (after its next job: the caller sends one).
    pub(super) fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// The thread's last act: `live` operations were left after the drain.
    pub(super) fn record(&self, live: usize) {
        *self.live.lock().unwrap_or_else(|e| e.into_inner()) = Some(live);
        self.recorded.notify_all();
    }

    /// Waits for the thread's record; `usize::MAX` if it died without one
    /// (`gone` says whether it has ended).
    pub(super) fn wait(&self, gone: impl Fn() -> bool) -> usize {
        let mut live = self.live.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            if let Some(n) = *live {
                return n;
            }
            if gone() {
                // Recorded just before it ended, or never.
                return live.unwrap_or(usize::MAX);
            }
            live = self
                .recorded
                .wait_timeout(live, CHECK)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// The job loop ended with tickets `ids` still out (their batches are
    /// dropped with the runtime, which then drains).
    pub(super) fn orphan(&self, ids: HashSet<u64>) {
        *self.orphans.lock().unwrap_or_else(|e| e.into_inner()) = Some(ids);
    }

    /// Ticket `id` asked for after the engine's thread ended: `true` (once)
    /// if it was out when the loop ended and the drain then reaped every
    /// operation — nothing touches its memory, and nothing confirmed its
    /// targets; `false` while whether it drained is not known (operations
    /// left live, or the thread died in a job), so it stays -2.
    /// Never waits: while the drain runs, `false`.
    pub(super) fn orphaned(&self, id: u64) -> Result<bool, SyncError> {
        let mut orphans = self.orphans.lock().unwrap_or_else(|e| e.into_inner());
        match orphans.as_mut() {
            None => Ok(false),
            Some(ids) if !ids.contains(&id) => Err(SyncError::UnknownTicket(id)),
            Some(ids) if self.reaped_all() => {
                ids.remove(&id);
                Ok(true)
            }
            Some(_) => Ok(false),
        }
    }

    /// Whether the thread recorded a drain that reaped every operation
    /// (not waiting for the record).
    fn reaped_all(&self) -> bool {
        *self.live.lock().unwrap_or_else(|e| e.into_inner()) == Some(0)
    }

    /// Whether how the thread ended is known: its record is in, or it ended
    /// without one.
    pub(super) fn settled(&self, gone: impl Fn() -> bool) -> bool {
        self.live
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_some()
            || gone()
    }

    /// How the drain went, as a stop answers it.
    fn drained(&self, gone: impl Fn() -> bool) -> Result<(), SyncError> {
        match self.wait(gone) {
            0 => Ok(()),
            live => Err(SyncError::Undrained(live)),
        }
    }

    /// What a call cut off by the engine's end answers: `Stopped` (-1) if
    /// the drain reaped every operation, else `Undrained` (-2).
    pub(super) fn cut_off(&self, gone: impl Fn() -> bool) -> SyncError {
        self.drained(gone).err().unwrap_or(SyncError::Stopped)
    }
}

impl SyncEngine {
    /// Stops the engine and returns once every operation on memory lent to
    /// it has been reaped (batches still in flight are cancelled). `Err`
    /// says the drain timed out: some operations may still touch memory
    /// lent to this engine, which must then never be freed or reused.
    pub fn stop(mut self) -> Result<(), SyncError> {
        self.join()
    }

    /// Stops the engine from a shared reference, while other threads may
    /// be in its calls: batches still in flight are cancelled, and it
    /// returns once the engine's thread has drained, as [`stop`](Self::stop)
    /// does. A call it cuts off answers `Stopped` only if the drain reaped
    /// every operation, else `Undrained`, as this does. (Dropping the
    /// engine afterwards only joins the ended thread.)
    pub fn halt(&self) -> Result<(), SyncError> {
        self.not_forked()?;
        self.lanes.stop();
        self.end.stop();
        if let Some(jobs) = &self.jobs {
            // Wakes the loop, which ends after this job.
            let _ = jobs.send(Box::new(|_: &State| {}));
        }
        self.end.drained(|| self.finished())
    }

    fn join(&mut self) -> Result<(), SyncError> {
        if self.lineage.forked() {
            // Nothing to join here, and nothing of it this process's to
            // close (a sender's wake-up would ring the parent's runtime):
            // left as it is.
            std::mem::forget(self.jobs.take());
            std::mem::forget(self.thread.take());
            std::mem::forget(self.lanes.clone());
            return Err(SyncError::Forked);
        }
        self.lanes.stop();
        // Closing the job channel stops the loop; the runtime then drains.
        drop(self.jobs.take());
        match self.thread.take().map(thread::JoinHandle::join) {
            None => Ok(()),
            // Ended: its record, or (it died before making one) nothing
            // says it reaped.
            Some(_) => self.end.drained(|| true),
        }
    }
}

impl Drop for SyncEngine {
    fn drop(&mut self) {
        match self.join() {
            // A forked child's copy: the parent's engine runs on.
            Ok(()) | Err(SyncError::Forked) => {}
            Err(e) => tracing::error!(error = %e, "sync engine stopped without draining"),
        }
    }
}
