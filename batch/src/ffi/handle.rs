//! A C engine handle's life: started, held by each call in it, stopped
//! once, and its engine dropped with the last hold. The handle itself is
//! never freed.

use std::cell::UnsafeCell;
use std::ffi::c_char;
use std::mem::ManuallyDrop;
use std::ops::Deref;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::time::Duration;

use quiesce_transports::EngineConfig;

use super::{fail, set_error, text};
use crate::sync::{HostRanges, SyncEngine};
use crate::SYNC_UNKNOWN_HANDLE;

/// An engine handle for C. Its engine goes with the last hold on it (the
/// handle's own and its calls'); the handle itself is never freed, so that
/// a call racing the stop finds it stopped instead of reading freed
/// memory. No reference to the whole handle is ever made: threads reach
/// its counts through `counts`, and its engine only through a `Hold`.
pub struct QuiesceEngine {
    /// Dropped in place by the last hold.
    live: UnsafeCell<ManuallyDrop<EngineParts>>,
    /// The handle's own hold until `quiesce_engine_stop`, and one for each
    /// call in it now; [`STOPPED`] once the last was given back and the
    /// engine dropped. A call that a stop cut off still has its engine
    /// while it answers.
    users: AtomicUsize,
    /// Set by the first stop before it stops the engine: a call that
    /// begins afterwards answers -3.
    stopping: AtomicBool,
    /// The first stop's answer ([`UNANSWERED`] until it has one), which a
    /// later stop answers too.
    stop_code: AtomicI32,
}

/// What a handle's engine is, dropped with its last hold.
pub(super) struct EngineParts {
    pub(super) engine: SyncEngine,
    /// The check that each task's buffer is memory this process may read
    /// and write (not a device pointer) before the engine touches it.
    pub(super) host: HostRanges,
}

/// `users` of a handle whose engine is gone (and above: calls that found
/// it so).
const STOPPED: usize = usize::MAX / 2;

/// `stop_code` before the first stop has its answer.
const UNANSWERED: i32 = i32::MIN;

/// The fields of handle `e` that any thread may touch, at any time.
fn counts<'a>(e: NonNull<QuiesceEngine>) -> (&'a AtomicUsize, &'a AtomicBool, &'a AtomicI32) {
    let e = e.as_ptr();
    // SAFETY: handles are never freed, and these fields are only used
    // atomically; each reference covers its own field only.
    unsafe { (&(*e).users, &(*e).stopping, &(*e).stop_code) }
}

/// A call's hold on an engine handle (see `QuiesceEngine::users`).
pub(super) struct Hold(NonNull<QuiesceEngine>);

impl Hold {
    /// `None` for null, or for a handle that a stop has begun to stop.
    ///
    /// # Safety
    /// `e` is null or a handle from `quiesce_engine_start`.
    pub(super) unsafe fn new(e: *mut QuiesceEngine) -> Option<Hold> {
        let p = NonNull::new(e)?;
        let (users, stopping, _) = counts(p);
        if users.fetch_add(1, Ordering::AcqRel) >= STOPPED {
            // Its engine went with the last hold; nothing else is touched.
            return None;
        }
        if stopping.load(Ordering::Acquire) {
            // Begun after the stop: refused (and maybe the last hold).
            let_go(p);
            return None;
        }
        Some(Hold(p))
    }
}

impl Deref for Hold {
    type Target = EngineParts;

    fn deref(&self) -> &EngineParts {
        // SAFETY: held: the engine is dropped only by the last hold, after
        // this one is given back; nothing takes it mutably before.
        unsafe { &*(*self.0.as_ptr()).live.get() }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        let_go(self.0);
    }
}

/// Gives back one hold on `e`; the last one drops its engine. The move to
/// [`STOPPED`] is made only from exactly one hold, so no call can take a
/// hold between the last one's release and the drop.
fn let_go(e: NonNull<QuiesceEngine>) {
    let (users, _, _) = counts(e);
    let mut n = users.load(Ordering::Acquire);
    loop {
        let to = if n == 1 { STOPPED } else { n - 1 };
        match users.compare_exchange(n, to, Ordering::AcqRel, Ordering::Acquire) {
            Ok(_) if to == STOPPED => break,
            Ok(_) => return,
            Err(now) => n = now,
        }
    }
    // The last hold: none is left and none can be taken (a new one finds
    // `STOPPED`), so nothing refers to the engine.
    // SAFETY: so this is the only reference to `live`, and it is made
    // through the raw pointer and the `UnsafeCell` alone.
    unsafe { ManuallyDrop::drop(&mut *(*e.as_ptr()).live.get()) };
}

/// Starts an engine named `node` (null: the default name, "quiesce").
/// Null on failure.
///
/// # Safety
/// `node` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn quiesce_engine_start(node: *const c_char) -> *mut QuiesceEngine {
    let mut cfg = EngineConfig::default();
    if !node.is_null() {
        // SAFETY: the caller passes a NUL-terminated string. Not UTF-8 is
        // refused, not replaced: two such names would become one node.
        match unsafe { text(node, "node") } {
            Ok(name) => cfg.node = name.to_string(),
            Err(_) => return std::ptr::null_mut(),
        }
    }
    match SyncEngine::start(cfg) {
        Ok(engine) => Box::into_raw(Box::new(QuiesceEngine {
            live: UnsafeCell::new(ManuallyDrop::new(EngineParts {
                engine,
                host: HostRanges::new(),
            })),
            users: AtomicUsize::new(1),
            stopping: AtomicBool::new(false),
            stop_code: AtomicI32::new(UNANSWERED),
        })),
        Err(e) => {
            set_error(e);
            std::ptr::null_mut()
        }
    }
}

/// Stops an engine: batches still in flight are cancelled, and it returns
/// only once every operation on memory lent to the engine has been reaped:
/// 0. -2 if the drain timed out: some memory lent to this engine may still
/// be touched, and none of it may ever be freed or reused. -3 for null.
/// A call in flight on another thread answers -1 if the drain reaped its
/// batch, -2 if it did not; the engine goes once it has returned. A call
/// that begins after the stop began answers -3, and a second stop what
/// the first did (once it has): the handle is never freed.
///
/// # Safety
/// `e` came from `quiesce_engine_start`.
#[no_mangle]
pub unsafe extern "C" fn quiesce_engine_stop(e: *mut QuiesceEngine) -> i32 {
    let Some(p) = NonNull::new(e) else {
        return fail(SYNC_UNKNOWN_HANDLE, "null engine");
    };
    let (_, stopping, stop_code) = counts(p);
    if stopping.swap(true, Ordering::AcqRel) {
        // Another stop has it: its answer, once its drain has one (a -2
        // must reach this caller too, who may otherwise free memory).
        loop {
            match stop_code.load(Ordering::Acquire) {
                UNANSWERED => std::thread::sleep(Duration::from_millis(1)),
                crate::SYNC_OK => return crate::SYNC_OK,
                code => return fail(code, "the engine was stopped by another call"),
            }
        }
    }
    // SAFETY: the handle's own hold is given back only below, by this first
    // stop: the engine is there.
    let parts = unsafe { &*(*p.as_ptr()).live.get() };
    let code = match parts.engine.halt() {
        Ok(()) => crate::SYNC_OK,
        // A forked child's copy: nothing in this process touches its memory
        // (the parent's engine runs on, on the parent's).
        Err(err @ crate::sync::SyncError::Forked) => fail(crate::SYNC_FAILED, err),
        Err(err) => fail(crate::SYNC_UNKNOWN, err),
    };
    stop_code.store(code, Ordering::Release);
    // The handle's own hold; the engine goes with the last call's.
    let_go(p);
    code
}
