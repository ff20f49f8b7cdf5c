//! The crates' `tracing` events into Python's `logging`, without a Rust
//! thread ever waiting for the GIL.
//!
//! Installed when the module loads (unless the process has a `tracing`
//! subscriber already): events pass a filter — `QUIESCE_LOG` in
//! `tracing-subscriber`'s `Targets` syntax (`warn`, `info`,
//! `quiesce_batch=debug,warn`), default `warn`, changed at run time by
//! `quiesce.set_log_filter` or, with neither, by the `quiesce` loggers'
//! levels (`quiesce._logs`) — are formatted with their spans' fields, and
//! queued here. A daemon thread of the Python package (`quiesce._logs`)
//! waits for them with the GIL released and hands each to
//! `logging.getLogger("quiesce.<crate>.<module>")`. An engine thread that
//! logs while a Python thread holds the GIL and waits for that engine (a
//! blocking call that has not released it) would deadlock if it took the
//! GIL itself; here it only takes the queue's lock.
//!
//! The queue keeps [`CAPACITY`] records; past that the oldest go, and the
//! next batch handed to Python starts with a warning that counts them. Once
//! the package's exit hook ran ([`close_log_records`]), records go straight to stderr:
//! the interpreter is shutting down, and an engine dropped then still logs.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::io::Write;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, OnceLock, TryLockError};
use std::time::Duration;

use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use tracing::{Level, Metadata};
use tracing_subscriber::filter::Targets;
use tracing_subscriber::fmt::MakeWriter;
use tracing_subscriber::prelude::*;
use tracing_subscriber::{reload, Registry};

use crate::node::lock;
pub(crate) use quiesce_batch::logs::{DEFAULT_FILTER, LOG_ENV};

/// Records held for Python at most.
const CAPACITY: usize = 4096;

/// One formatted event: Python's level number, logger name and message.
type Record = (u32, String, String);

struct Queue {
    state: Mutex<QueueState>,
    ready: Condvar,
}

struct QueueState {
    records: VecDeque<Record>,
    /// Records dropped (the oldest) since Python last took some.
    dropped: u64,
    /// The package's exit hook ran: nobody takes records any more.
    closed: bool,
}

static QUEUE: Queue = Queue {
    state: Mutex::new(QueueState {
        records: VecDeque::new(),
        dropped: 0,
        closed: false,
    }),
    ready: Condvar::new(),
};

/// The installed filter, to change it; unset if another subscriber owns
/// the process's events.
static FILTER: OnceLock<reload::Handle<Targets, Registry>> = OnceLock::new();

/// Installs the subscriber (once per process; a no-op if one is set).
pub(crate) fn install() {
    let (filter, bad) = quiesce_batch::logs::env_filter();
    let (filter, handle) = reload::Layer::new(filter);
    // Python's records carry the time, level and logger name.
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(ToQueue)
        .with_ansi(false)
        .without_time()
        .with_level(false)
        .with_target(false);
    if tracing_subscriber::registry()
        .with(filter)
        .with(fmt)
        .try_init()
        .is_ok()
    {
        let _ = FILTER.set(handle);
    }
    if let Some(why) = bad {
        tracing::warn!("{why}");
    }
}

/// Python's level number for a `tracing` level (TRACE below DEBUG).
fn python_level(level: &Level) -> u32 {
    match *level {
        Level::ERROR => 40,
        Level::WARN => 30,
        Level::INFO => 20,
        Level::DEBUG => 10,
        Level::TRACE => 5,
    }
}

/// `quiesce_batch::run::fencing` → `quiesce.batch.run.fencing`; this
/// extension's `_native::node` → `quiesce.python.node`.
fn logger_name(target: &str) -> String {
    let (krate, path) = target.split_once("::").unwrap_or((target, ""));
    let krate = match krate {
        "_native" => "python",
        k => k.strip_prefix("quiesce_").unwrap_or(k),
    };
    let mut name = format!("quiesce.{krate}");
    for part in path.split("::").filter(|p| !p.is_empty()) {
        name.push('.');
        name.push_str(part);
    }
    name
}

/// The fmt layer's writer: one per event.
struct ToQueue;

impl<'a> MakeWriter<'a> for ToQueue {
    type Writer = RecordWriter;

    fn make_writer(&'a self) -> RecordWriter {
        RecordWriter {
            level: 20,
            logger: "quiesce".into(),
            text: Vec::new(),
        }
    }

    fn make_writer_for(&'a self, meta: &Metadata<'_>) -> RecordWriter {
        RecordWriter {
            level: python_level(meta.level()),
            logger: logger_name(meta.target()),
            text: Vec::new(),
        }
    }
}

/// Collects one formatted event; queues it when dropped.
struct RecordWriter {
    level: u32,
    logger: String,
    text: Vec<u8>,
}

impl Write for RecordWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.text.extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for RecordWriter {
    fn drop(&mut self) {
        let text = String::from_utf8_lossy(&self.text);
        let message = text.trim_end();
        if !message.is_empty() {
            push((
                self.level,
                std::mem::take(&mut self.logger),
                message.to_owned(),
            ));
        }
    }
}

/// The queue's lock is held for a fork ([`hold_log_records_for_fork`]),
/// across Python code that may wait for the GIL.
static HELD_FOR_FORK_NOW: AtomicBool = AtomicBool::new(false);
/// Records dropped because the lock was held for a fork.
static DROPPED_IN_FORK: AtomicU64 = AtomicU64::new(0);

/// The queue's lock for [`push`], which may run on a thread that holds the
/// GIL (a call's complaint): `None` — the record to be dropped — while the
/// lock is held for a fork, since the fork's holder may be waiting for the
/// GIL. Its other holders keep it for a few instructions.
fn lock_to_push() -> Option<MutexGuard<'static, QueueState>> {
    loop {
        match QUEUE.state.try_lock() {
            Ok(q) => return Some(q),
            Err(TryLockError::Poisoned(e)) => return Some(e.into_inner()),
            Err(TryLockError::WouldBlock) if HELD_FOR_FORK_NOW.load(Ordering::Acquire) => {
                return None
            }
            Err(TryLockError::WouldBlock) => std::thread::yield_now(),
        }
    }
}

fn push(record: Record) {
    let Some(mut q) = lock_to_push() else {
        DROPPED_IN_FORK.fetch_add(1, Ordering::Relaxed);
        return;
    };
    q.dropped += DROPPED_IN_FORK.swap(0, Ordering::Relaxed);
    if q.closed {
        drop(q);
        let (_, logger, message) = record;
        // Not `eprintln!`, which panics if stderr is gone (a closed pipe).
        let _ = writeln!(std::io::stderr(), "{logger}: {message}");
        return;
    }
    if q.records.len() >= CAPACITY {
        q.records.pop_front();
        q.dropped += 1;
    }
    q.records.push_back(record);
    drop(q);
    QUEUE.ready.notify_one();
}

/// Takes the queued records, waiting up to `wait` for the first (`None`:
/// until there is one or the queue closes), and whether the queue is
/// closed. A count of dropped records comes first, as a warning.
///
/// Only ever called with the GIL released: the lock is held across Python
/// code by [`hold_log_records_for_fork`], where the GIL passes to other
/// threads, so a thread waiting for it with the GIL held would hang the
/// process.
fn take(wait: Option<Duration>) -> (Vec<Record>, bool) {
    let mut q = lock(&QUEUE.state);
    q.dropped += DROPPED_IN_FORK.swap(0, Ordering::Relaxed);
    let until = wait.map(quiesce_runtime::time::deadline_in);
    while q.records.is_empty() && q.dropped == 0 && !q.closed {
        q = match until {
            None => QUEUE.ready.wait(q).unwrap_or_else(|e| e.into_inner()),
            Some(t) => {
                let left = t.saturating_duration_since(std::time::Instant::now());
                if left.is_zero() {
                    break;
                }
                QUEUE
                    .ready
                    .wait_timeout(q, left)
                    .unwrap_or_else(|e| e.into_inner())
                    .0
            }
        };
    }
    let mut out = Vec::with_capacity(q.records.len() + 1);
    if q.dropped > 0 {
        let n = std::mem::take(&mut q.dropped);
        out.push((
            30,
            "quiesce".to_owned(),
            format!(
                "{n} log records dropped: more than {CAPACITY} waited for Python's logging, \
                 or they came while a fork held the queue"
            ),
        ));
    }
    out.extend(q.records.drain(..));
    (out, q.closed)
}

/// Waits for the crates' log records with the GIL released: a list of
/// `(level, logger_name, message)` — empty if `timeout` seconds passed
/// first (`None` waits without a limit) — or `None` once the queue closed
/// and nothing is left in it.
#[pyfunction]
#[pyo3(signature = (timeout=None))]
pub(crate) fn next_log_records(
    py: Python<'_>,
    timeout: Option<f64>,
) -> PyResult<Option<Vec<Record>>> {
    let wait = match timeout {
        None => None,
        // An infinite or huge one waits without a limit.
        Some(t) if t >= 0.0 => Duration::try_from_secs_f64(t).ok(),
        Some(t) => return Err(PyValueError::new_err(format!("timeout {t} is not ≥ 0"))),
    };
    let (records, closed) = py.detach(|| take(wait));
    Ok((!(closed && records.is_empty())).then_some(records))
}

/// Closes the queue: a waiting `next_log_records` returns, and later records
/// go to stderr. Returns what was still queued.
#[pyfunction]
pub(crate) fn close_log_records(py: Python<'_>) -> Vec<Record> {
    // With the GIL released, as every other wait for the queue's lock
    // ([`take`]).
    let (out, _) = py.detach(|| {
        lock(&QUEUE.state).closed = true;
        take(Some(Duration::ZERO))
    });
    QUEUE.ready.notify_all();
    out
}

thread_local! {
    /// The queue's lock, held by the thread that forks from just before the
    /// fork to just after (see [`hold_log_records_for_fork`]).
    static HELD_FOR_FORK: RefCell<Option<MutexGuard<'static, QueueState>>> =
        const { RefCell::new(None) };
}

/// Takes the queue's lock before `os.fork()`, so that no engine thread
/// holds it when the process is copied: the child has none of those
/// threads, and a lock copied held would stay held in it for ever (its log
/// thread hung at the first record). Taken with the GIL held: the lock's
/// other holders (an engine thread queuing a record, the log thread taking
/// them with the GIL released) never wait for the GIL while they hold it,
/// and nothing waits for the lock with the GIL held while a fork holds it
/// (the hooks between this and the release run Python code, where the GIL
/// passes on): a record pushed meanwhile, from any thread, is dropped and
/// counted ([`push`]). Another thread forking at the same time waits for
/// the lock here with the GIL released, so that the first can finish its
/// fork (it hung both, waiting with the GIL held).
#[pyfunction]
pub(crate) fn hold_log_records_for_fork(py: Python<'_>) {
    let guard = loop {
        match QUEUE.state.try_lock() {
            Ok(g) => break g,
            Err(TryLockError::Poisoned(e)) => break e.into_inner(),
            Err(TryLockError::WouldBlock) => {
                py.detach(|| std::thread::sleep(Duration::from_micros(50)))
            }
        }
    };
    HELD_FOR_FORK_NOW.store(true, Ordering::Release);
    HELD_FOR_FORK.with(|h| *h.borrow_mut() = Some(guard));
}

/// Releases the lock [`hold_log_records_for_fork`] took, after the fork
/// (or its failure). In the child the queue is emptied — the parent logs
/// what it held — and open again for the child's own log thread.
#[pyfunction]
pub(crate) fn release_log_records_after_fork(child: bool) {
    let Some(mut q) = HELD_FOR_FORK.with(|h| h.borrow_mut().take()) else {
        return;
    };
    HELD_FOR_FORK_NOW.store(false, Ordering::Release);
    if child {
        q.records.clear();
        q.dropped = 0;
        DROPPED_IN_FORK.store(0, Ordering::Relaxed);
        q.closed = false;
    }
}

/// Sets which events are produced (`Targets` directives, as `QUIESCE_LOG`).
#[pyfunction]
pub(crate) fn set_log_filter(directives: &str) -> PyResult<()> {
    let filter: Targets = directives
        .parse()
        .map_err(|e| PyValueError::new_err(format!("{directives:?} is not a filter: {e}")))?;
    let handle = FILTER.get().ok_or_else(|| {
        PyRuntimeError::new_err("another tracing subscriber handles this process's events")
    })?;
    handle
        .reload(filter)
        .map_err(|e| PyRuntimeError::new_err(e.to_string()))
}
