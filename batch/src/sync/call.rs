//! One call's round trip between its caller and the engine's thread: the
//! engine's thread submits the call's batch and answers with its outcome
//! ([`launch`]); the caller waits for that answer, spinning first
//! ([`recv_spinning`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use quiesce_runtime::spawn_local;
use quiesce_runtime::IoBufMut;
use smallvec::SmallVec;

use super::{State, SyncError, SyncOutcome, SyncTasks};
use crate::{BatchOptions, Outcome, Quiesced, SYNC_UNKNOWN};

/// The next ticket's number: one sequence for the whole process, so that
/// a ticket waited on with another engine than its own is unknown there,
/// never that engine's batch of the same number.
static NEXT_TICKET: AtomicU64 = AtomicU64::new(1);

/// How long [`SyncEngine::start`](super::SyncEngine::start)'s engine and its callers spin before they
/// block: about one round trip on loopback, so a blocking caller issuing
/// small batches back to back never waits for a wake-up.
pub const DEFAULT_SPIN: Duration = Duration::from_micros(50);

/// Receives on `rx`, polling for up to `spin` before it blocks; `None` once
/// every sender is gone, or the engine's thread ended (`finished`) with
/// nothing sent.
pub(super) fn recv_spinning<R>(
    rx: &mpsc::Receiver<R>,
    spin: Duration,
    finished: impl Fn() -> bool,
) -> Option<R> {
    if !spin.is_zero() {
        let start = Instant::now();
        loop {
            match rx.try_recv() {
                Ok(v) => return Some(v),
                Err(mpsc::TryRecvError::Disconnected) => return None,
                Err(mpsc::TryRecvError::Empty) if start.elapsed() >= spin => break,
                Err(mpsc::TryRecvError::Empty) => thread::yield_now(),
            }
        }
    }
    // Never past the engine thread's end: a job queued while the thread
    // was dying (its queue still open) is never run, and its reply sender
    // lives on in the queue, so the channel never says it is gone.
    loop {
        match rx.recv_timeout(THREAD_CHECK) {
            Ok(v) => return Some(v),
            Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            Err(mpsc::RecvTimeoutError::Timeout) if finished() => return rx.try_recv().ok(),
            Err(mpsc::RecvTimeoutError::Timeout) => {}
        }
    }
}

/// How often a caller waiting for the engine's answer looks whether the
/// engine's thread is still there.
const THREAD_CHECK: Duration = Duration::from_millis(50);

/// Builds and submits a batch on the engine thread; `done` gets its outcome
/// (from a task: the caller's answer must not wait on this job).
pub(super) fn launch<B: IoBufMut + Send>(
    st: &State,
    tasks: SyncTasks<B>,
    opts: BatchOptions,
    called: Instant,
    done: impl FnOnce(SyncOutcome<B>) + 'static,
) -> Result<(), SyncError> {
    // The guard is armed before the batch's first poll (inside `submit`):
    // a panic from there on would drop the reply and the caller would read
    // -1 while the batch may still hold its memory. It moves into the task:
    // a panic elsewhere on this thread before the task's first poll drops
    // the task, and with it this guard, while unwinding.
    let (sub, pinned) = st.fabric.submit(tasks, opts, called, |h| {
        st.segments.borrow().get(h as usize).cloned()
    })?;
    let st = st.clone();
    spawn_local(async move {
        let _pinned = pinned;
        let out = match sub.await {
            Outcome::Quiesced(q) => finish(q),
            Outcome::CompletionUnknown(t) => {
                let id = NEXT_TICKET.fetch_add(1, Ordering::Relaxed);
                st.tickets.borrow_mut().insert(id, Box::new(t));
                SyncOutcome {
                    code: SYNC_UNKNOWN,
                    buffers: None,
                    tasks: SmallVec::new(),
                    ticket: Some(id),
                    remote_confirmed: false,
                }
            }
        };
        done(out);
    });
    Ok(())
}

/// Aborts the process if dropped while unwinding: for code whose caller must
/// never see an answer (0 or -1) that a panic made up.
pub(crate) struct AbortOnUnwind(pub(crate) &'static str);

impl Drop for AbortOnUnwind {
    fn drop(&mut self) {
        if thread::panicking() {
            eprintln!(
                "quiesce: panic in {}; aborting rather than return memory that may still be in use",
                self.0
            );
            std::process::abort();
        }
    }
}

pub(super) fn finish<B>(q: Quiesced<B>) -> SyncOutcome<B> {
    let code = q.sync_code();
    let remote_confirmed = q.remote_confirmed();
    let (tasks, buffers) = q.into_inline_parts();
    SyncOutcome {
        code,
        buffers: Some(buffers),
        tasks,
        ticket: None,
        remote_confirmed,
    }
}
