//! The C ABI (`include/quiesce.h`): blocking calls that return 0, -1, -2, or
//! -3 for an unknown handle or ticket.
//!
//! The caller's memory is described by raw pointers. The contract: from the
//! call until it returns 0 or -1 — or, after -2, until `quiesce_ticket_wait`
//! or `quiesce_ticket_poll` returns 0 or -1 for its ticket — the memory must
//! stay valid and must not be freed, reused or touched. After 0 or -1 nothing
//! touches it any more.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::net::ToSocketAddrs;
use std::time::Duration;

use quiesce_runtime::{IoBuf, IoBufMut};
use quiesce_transports::Token;

use crate::sync::{Direction, MemoryAccess, SyncError, SyncOutcome, SyncTask};
use crate::{BatchOptions, FailurePolicy, SYNC_FAILED, SYNC_UNKNOWN_HANDLE};

mod handle;

use self::handle::Hold;
pub use self::handle::{quiesce_engine_start, quiesce_engine_stop, QuiesceEngine};

/// A caller-owned memory range lent to a batch.
pub struct RawBuf {
    ptr: *mut u8,
    len: usize,
}

impl RawBuf {
    /// Describes `ptr..ptr + len`.
    ///
    /// # Safety
    ///
    /// The range must stay valid for reads and writes, and untouched by
    /// anyone else, for as long as a batch holds the buffer: until its
    /// outcome is 0 or -1 (after -2, until the ticket drains).
    pub unsafe fn new(ptr: *mut u8, len: usize) -> RawBuf {
        RawBuf { ptr, len }
    }
}

// SAFETY: the C caller promised the memory stays valid and untouched while
// the batch holds it; moving the description between threads is harmless.
unsafe impl Send for RawBuf {}

// SAFETY: valid for `len` bytes for as long as the batch holds it (the
// caller's contract); a raw range does not move.
unsafe impl IoBuf for RawBuf {
    fn stable_ptr(&self) -> *const u8 {
        self.ptr
    }
    fn bytes_init(&self) -> usize {
        self.len
    }
    fn bytes_total(&self) -> usize {
        self.len
    }
}

// SAFETY: as above; the caller lends the range for writing by reads.
unsafe impl IoBufMut for RawBuf {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// One task of a C batch.
#[repr(C)]
pub struct QuiesceTask {
    /// Handle from `quiesce_open`.
    pub segment: u32,
    /// Offset in the remote segment.
    pub offset: u64,
    /// Local memory.
    pub buf: *mut c_void,
    /// Bytes.
    pub len: u64,
}

/// Batch options for C; a null pointer means the defaults.
#[repr(C)]
pub struct QuiesceOptions {
    /// 0: no deadline.
    pub deadline_ms: u64,
    /// Fence grace; 0 means the default (200 ms) unless `flags` has
    /// [`QUIESCE_OPT_GRACE`].
    pub fence_grace_ms: u64,
    /// Non-zero: fail fast.
    pub fail_fast: i32,
    /// Extra attempts for failed tasks, after quiescence.
    pub retries: u32,
    /// `QUIESCE_OPT_*` bits (0 in a zeroed struct: every default).
    pub flags: u32,
}

/// `QuiesceOptions::flags`: `fence_grace_ms` is used as given, 0 included
/// (no grace: the outcome is -2 at once if the fence has not finished).
pub const QUIESCE_OPT_GRACE: u32 = 1;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
    /// Whether the last batch (or ticket) of this thread that reached 0 or -1
    /// had every target's confirmation.
    static LAST_REMOTE_CONFIRMED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn set_error(msg: impl std::fmt::Display) -> i32 {
    fail(SYNC_FAILED, msg)
}

/// Records `msg` as this thread's last error and returns `code`.
fn fail(code: i32, msg: impl std::fmt::Display) -> i32 {
    let s = CString::new(msg.to_string().replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = s);
    code
}

/// The code of a call that failed before anything started: its own code for
/// an unknown handle or ticket, -1 (nothing touches the memory) otherwise.
fn sync_error(err: SyncError) -> i32 {
    match err {
        SyncError::UnknownSegment(_) | SyncError::UnknownTicket(_) => {
            fail(SYNC_UNKNOWN_HANDLE, err)
        }
        // A call the engine's stop cut off, whose drain left operations
        // live: its memory may still be touched.
        SyncError::Undrained(_) => fail(crate::SYNC_UNKNOWN, err),
        err => set_error(err),
    }
}

/// 1 if the last transfer call or ticket of this thread that returned 0 or
/// -1 had every target confirm that nothing more of the batch lands there;
/// 0 if not (a -1 write may still deliver bytes into its target ranges until
/// they are revoked or fenced again; a call the engine's stop cut off says
/// 0). A call refused before anything started leaves it as it was. The
/// caller's memory is safe either way.
#[no_mangle]
pub extern "C" fn quiesce_last_remote_confirmed() -> i32 {
    LAST_REMOTE_CONFIRMED.with(|c| c.get()) as i32
}

/// The last error message of this thread ("" if none). Valid until the next
/// call on this thread.
#[no_mangle]
pub extern "C" fn quiesce_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Sends quiesce's log events (warnings: a fence out of grace, a target
/// that did not confirm, a leaked batch) to stderr, filtered by `filter` —
/// `tracing-subscriber` `Targets` directives such as `"warn"` or
/// `"info,quiesce_transports=debug"` — or, if null, by `QUIESCE_LOG`
/// (default `warn`). 0, or -1 if the filter does not parse or the process
/// has a `tracing` subscriber already (`quiesce_last_error` says which).
///
/// # Safety
/// `filter` is null or a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn quiesce_log_to_stderr(filter: *const c_char) -> i32 {
    let installed = if filter.is_null() {
        crate::logs::init()
    } else {
        // SAFETY: the caller passes a NUL-terminated string.
        let f = unsafe { CStr::from_ptr(filter) }.to_string_lossy();
        match f.parse() {
            Ok(t) => crate::logs::to_stderr(t),
            Err(e) => return set_error(format!("{f:?} is not a log filter: {e}")),
        }
    };
    if !installed {
        return set_error("a tracing subscriber is installed already");
    }
    0
}

/// # Safety
/// `p` is null or NUL-terminated.
unsafe fn text<'a>(p: *const c_char, what: &str) -> Result<&'a str, i32> {
    if p.is_null() {
        return Err(set_error(format!("{what} is null")));
    }
    // SAFETY: the caller passes a NUL-terminated string.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| set_error(format!("{what} is not UTF-8")))
}

/// Connects to `addr` ("host:port": an address, or a name that resolves,
/// its addresses tried in turn), proves `token` (32 hex digits) for
/// segment `name`, and stores a handle in `*handle_out`. 0 or -1.
///
/// # Safety
/// `e` is a live engine; strings are NUL-terminated; `handle_out` is writable.
#[no_mangle]
pub unsafe extern "C" fn quiesce_open(
    e: *mut QuiesceEngine,
    addr: *const c_char,
    name: *const c_char,
    token: *const c_char,
    handle_out: *mut u32,
) -> i32 {
    // SAFETY: the caller passes a live engine or null.
    let Some(engine) = (unsafe { Hold::new(e) }) else {
        return fail(SYNC_UNKNOWN_HANDLE, "null or stopped engine");
    };
    // SAFETY: the caller passes NUL-terminated strings (or null, refused).
    let texts = unsafe { (text(addr, "addr"), text(name, "name"), text(token, "token")) };
    let (Ok(addr), Ok(name), Ok(token)) = texts else {
        return set_error("a null or non-UTF-8 argument");
    };
    let Ok(token) = token.parse::<Token>() else {
        return set_error("token is not 32 hex digits");
    };
    // A name resolves as `getaddrinfo` resolves it; its addresses are tried
    // in that order (`localhost` may be ::1 first, a target 127.0.0.1).
    let Ok(addrs) = addr.to_socket_addrs() else {
        return set_error(format!(
            "addr {addr:?} is not host:port, or does not resolve"
        ));
    };
    let mut opened = Err(crate::sync::SyncError::Setup(format!(
        "{addr:?} resolves to nothing"
    )));
    for a in addrs {
        opened = engine.engine.open(a, name, token);
        if opened.is_ok() {
            break;
        }
    }
    match opened {
        Ok(h) => {
            if !handle_out.is_null() {
                // SAFETY: the caller passes a writable u32.
                unsafe { *handle_out = h };
            }
            0
        }
        Err(err) => set_error(err),
    }
}

fn options(o: *const QuiesceOptions) -> BatchOptions {
    let mut opts = BatchOptions::default();
    // SAFETY: null or a valid options struct (the caller's contract).
    if let Some(o) = unsafe { o.as_ref() } {
        if o.deadline_ms > 0 {
            opts = opts.deadline(Duration::from_millis(o.deadline_ms));
        }
        if o.fence_grace_ms > 0 || o.flags & QUIESCE_OPT_GRACE != 0 {
            opts = opts.fence_grace(Duration::from_millis(o.fence_grace_ms));
        }
        if o.fail_fast != 0 {
            opts = opts.policy(FailurePolicy::FailFast);
        }
        opts.retry.attempts = o.retries;
    }
    opts
}

fn answer(out: Result<SyncOutcome<RawBuf>, crate::sync::SyncError>, ticket_out: *mut u64) -> i32 {
    match out {
        Ok(o) => {
            if o.ticket.is_none() {
                LAST_REMOTE_CONFIRMED.with(|c| c.set(o.remote_confirmed));
            }
            if let (Some(t), false) = (o.ticket, ticket_out.is_null()) {
                // SAFETY: the caller passes a writable u64.
                unsafe { *ticket_out = t };
            }
            if let Some(bad) = o
                .tasks
                .iter()
                .find(|t| t.status != crate::TaskStatus::Completed)
            {
                set_error(format!("{:?}", bad.status));
            }
            o.code
        }
        Err(err) => {
            // A batch the engine's stop cut off (-1 once its drain reaped
            // it) was never fenced at its targets: what it queued in a
            // socket still lands. (Any other error came before anything
            // was sent, and is not a -1 the flag speaks of, or -3.)
            if matches!(err, SyncError::Stopped) {
                LAST_REMOTE_CONFIRMED.with(|c| c.set(false));
            }
            sync_error(err)
        }
    }
}

/// # Safety
/// See [`quiesce_batch_transfer_sync_write`].
unsafe fn batch(
    e: *mut QuiesceEngine,
    dir: Direction,
    tasks: *const QuiesceTask,
    n: usize,
    opts: *const QuiesceOptions,
    ticket_out: *mut u64,
) -> i32 {
    // SAFETY: the caller passes a live engine or null.
    let Some(engine) = (unsafe { Hold::new(e) }) else {
        return fail(SYNC_UNKNOWN_HANDLE, "null or stopped engine");
    };
    if tasks.is_null() || n == 0 {
        return set_error("no tasks");
    }
    // No array holds more (a negative count passed as `size_t`): reading
    // one would be undefined.
    if n > isize::MAX as usize / std::mem::size_of::<QuiesceTask>() {
        return set_error(format!("too many tasks: {n}"));
    }
    // SAFETY: the caller passes `n` readable tasks.
    let tasks = unsafe { std::slice::from_raw_parts(tasks, n) };
    if tasks.iter().any(|t| t.buf.is_null() || t.len == 0) {
        return set_error("a task has a null buffer or zero length");
    }
    // Before the buffer check's lock: in a forked child, one that a
    // parent's thread held at the fork is never released.
    if let Err(err) = engine.engine.not_forked() {
        return sync_error(err);
    }
    // Before anything copies from a buffer or into it (a small batch's
    // bytes are copied on this thread): a device pointer killed the process.
    // A write's source need only be readable (a read-only file mapping).
    let ranges = tasks.iter().map(|t| (t.buf as u64, t.len));
    let (access, may) = match dir {
        Direction::Write => (MemoryAccess::Read, "read"),
        Direction::Read => (MemoryAccess::ReadWrite, "read and write"),
    };
    if let Some((addr, len)) = engine.host.first_without(ranges, access) {
        return set_error(format!(
            "the buffer at {addr:#x} ({len} bytes) is not memory this process may {may} (device memory?)"
        ));
    }
    let tasks = tasks.iter().map(|t| SyncTask {
        segment: t.segment,
        offset: t.offset,
        buf: RawBuf {
            ptr: t.buf.cast(),
            len: t.len as usize,
        },
    });
    // The caller's array is the batch's bound, not the Rust API's default
    // limit (a KV cache's blocks times its layers pass 4,096).
    let opts = options(opts).room_for(n);
    answer(engine.engine.batch(dir, tasks, opts), ticket_out)
}

/// Writes every task's buffer to its remote range as one batch.
/// 0: all completed; -1: failed, nothing touches the buffers; -2: unknown,
/// keep the buffers untouched and wait on `*ticket_out`.
///
/// # Safety
/// `e` is a live engine; `tasks` points to `n` tasks whose buffers stay
/// valid and untouched per the module contract; `opts` is null or valid;
/// `ticket_out` is null or writable.
#[no_mangle]
pub unsafe extern "C" fn quiesce_batch_transfer_sync_write(
    e: *mut QuiesceEngine,
    tasks: *const QuiesceTask,
    n: usize,
    opts: *const QuiesceOptions,
    ticket_out: *mut u64,
) -> i32 {
    // SAFETY: forwarded caller guarantees.
    unsafe { batch(e, Direction::Write, tasks, n, opts, ticket_out) }
}

/// Reads every task's remote range into its buffer as one batch. Codes as
/// for the write.
///
/// # Safety
/// As for [`quiesce_batch_transfer_sync_write`].
#[no_mangle]
pub unsafe extern "C" fn quiesce_batch_transfer_sync_read(
    e: *mut QuiesceEngine,
    tasks: *const QuiesceTask,
    n: usize,
    opts: *const QuiesceOptions,
    ticket_out: *mut u64,
) -> i32 {
    // SAFETY: forwarded caller guarantees.
    unsafe { batch(e, Direction::Read, tasks, n, opts, ticket_out) }
}

/// One write (a batch of one task).
///
/// # Safety
/// As for [`quiesce_batch_transfer_sync_write`], with `src` valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn quiesce_transfer_sync_write(
    e: *mut QuiesceEngine,
    segment: u32,
    offset: u64,
    src: *const c_void,
    len: u64,
    opts: *const QuiesceOptions,
    ticket_out: *mut u64,
) -> i32 {
    let t = QuiesceTask {
        segment,
        offset,
        buf: src.cast_mut(),
        len,
    };
    // SAFETY: forwarded caller guarantees; one task.
    unsafe { batch(e, Direction::Write, &t, 1, opts, ticket_out) }
}

/// One read (a batch of one task).
///
/// # Safety
/// As for [`quiesce_batch_transfer_sync_write`], with `dst` writable for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn quiesce_transfer_sync_read(
    e: *mut QuiesceEngine,
    segment: u32,
    offset: u64,
    dst: *mut c_void,
    len: u64,
    opts: *const QuiesceOptions,
    ticket_out: *mut u64,
) -> i32 {
    let t = QuiesceTask {
        segment,
        offset,
        buf: dst,
        len,
    };
    // SAFETY: forwarded caller guarantees; one task.
    unsafe { batch(e, Direction::Read, &t, 1, opts, ticket_out) }
}

/// Waits up to `timeout_ms` for a ticket's batch to drain: 0 or -1 once it
/// has (the buffers are free again), -2 if it still has not.
///
/// # Safety
/// `e` is a live engine.
#[no_mangle]
pub unsafe extern "C" fn quiesce_ticket_wait(
    e: *mut QuiesceEngine,
    ticket: u64,
    timeout_ms: u64,
) -> i32 {
    // SAFETY: the caller passes a live engine or null.
    let Some(engine) = (unsafe { Hold::new(e) }) else {
        return fail(SYNC_UNKNOWN_HANDLE, "null or stopped engine");
    };
    match engine
        .engine
        .wait::<RawBuf>(ticket, Duration::from_millis(timeout_ms))
    {
        Ok(Some(o)) => {
            LAST_REMOTE_CONFIRMED.with(|c| c.set(o.remote_confirmed));
            o.code
        }
        Ok(None) => crate::SYNC_UNKNOWN,
        // A forked child cannot know how its parent's batch stands, and
        // the ticket's memory may be shared with the parent (MAP_SHARED),
        // whose engine can still touch it: -1 ("nothing touches it") would
        // be a guess.
        Err(err @ SyncError::Forked) => fail(crate::SYNC_UNKNOWN, err),
        Err(err) => sync_error(err),
    }
}

/// `quiesce_ticket_wait` without waiting.
///
/// # Safety
/// `e` is a live engine.
#[no_mangle]
pub unsafe extern "C" fn quiesce_ticket_poll(e: *mut QuiesceEngine, ticket: u64) -> i32 {
    // SAFETY: forwarded caller guarantee.
    unsafe { quiesce_ticket_wait(e, ticket, 0) }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn opts(fence_grace_ms: u64, flags: u32) -> BatchOptions {
        options(&QuiesceOptions {
            deadline_ms: 0,
            fence_grace_ms,
            fail_fast: 0,
            retries: 0,
            flags,
        })
    }

    /// A forked child's transfer call answers -1 even though, at the fork,
    /// another thread of the parent was inside the buffer check (whose
    /// lock no thread of the child will ever release). It waited on that
    /// lock for good: the check ran before the fork was noticed.
    #[test]
    fn a_forked_child_answers_minus_one_though_the_host_check_was_held_at_the_fork() {
        // SAFETY: a null node name is allowed.
        let e = unsafe { quiesce_engine_start(std::ptr::null()) };
        assert!(!e.is_null());
        let mut buf = vec![7u8; 4096];
        // Another thread sits inside the check (its lock held) while this
        // one forks.
        let (inside, release) = (std::sync::mpsc::channel(), std::sync::mpsc::channel::<()>());
        let handle = e as usize;
        let holder = std::thread::spawn(move || {
            // SAFETY: the engine is live until the stop below, after this
            // thread ends.
            let held = unsafe { Hold::new(handle as *mut QuiesceEngine) }.expect("a live engine");
            held.host.while_held(|| {
                inside.0.send(()).unwrap();
                release.1.recv().unwrap();
            });
        });
        inside.1.recv().unwrap();
        // SAFETY (child): it calls the C entry point and `_exit`s; `alarm`
        // kills it if that call blocks.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork failed");
        if pid == 0 {
            // SAFETY: in the child: `e` is its copy of the live handle;
            // `buf` holds 4,096 bytes.
            unsafe {
                libc::alarm(5);
                let code = quiesce_transfer_sync_write(
                    e,
                    1,
                    0,
                    buf.as_mut_ptr().cast(),
                    4096,
                    std::ptr::null(),
                    std::ptr::null_mut(),
                );
                libc::_exit(if code == crate::SYNC_FAILED { 0 } else { 1 });
            }
        }
        release.0.send(()).unwrap();
        holder.join().unwrap();
        let mut status = 0;
        // SAFETY: waits for the child this test forked.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status),
            "the child's transfer call blocked (killed by signal {})",
            libc::WTERMSIG(status)
        );
        assert_eq!(
            libc::WEXITSTATUS(status),
            0,
            "the child's call did not answer -1"
        );
        // SAFETY: the engine is live; nothing else uses it.
        assert_eq!(unsafe { quiesce_engine_stop(e) }, 0);
    }

    #[test]
    fn every_grace_the_rust_api_has_can_be_said_in_c() {
        let default = BatchOptions::default().fence_grace;
        assert_eq!(
            opts(0, 0).fence_grace,
            default,
            "a zeroed struct keeps the default"
        );
        assert_eq!(opts(0, QUIESCE_OPT_GRACE).fence_grace, Duration::ZERO);
        assert_eq!(opts(7, 0).fence_grace, Duration::from_millis(7));
        assert_eq!(options(std::ptr::null()).fence_grace, default);
    }
}
