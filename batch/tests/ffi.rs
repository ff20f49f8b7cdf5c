//! The C ABI driven from Rust: a stop while another C thread waits in a
//! transfer call, and bad input that must be refused with -1 or NULL, not
//! crash or be taken.

use std::ffi::CString;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use quiesce_batch::ffi::{
    quiesce_batch_transfer_sync_write, quiesce_engine_start, quiesce_engine_stop,
    quiesce_last_error, quiesce_last_remote_confirmed, quiesce_open, quiesce_transfer_sync_read,
    quiesce_transfer_sync_write, QuiesceEngine, QuiesceTask,
};
use quiesce_batch::{SYNC_FAILED, SYNC_OK, SYNC_UNKNOWN, SYNC_UNKNOWN_HANDLE};

mod common;

use common::Target;

/// The engine pointer, to hand to another thread (the C API is thread-safe).
#[derive(Clone, Copy)]
struct Handle(*mut QuiesceEngine);
// SAFETY: the C API may be called from any thread on one engine.
unsafe impl Send for Handle {}

fn open(e: Handle, t: &Target) -> u32 {
    let addr = CString::new(t.addr.to_string()).unwrap();
    let name = CString::new("kv").unwrap();
    let token = CString::new(t.kv.to_string()).unwrap();
    let mut h = 0u32;
    // SAFETY: a live engine, NUL-terminated strings, a writable handle.
    let rc = unsafe { quiesce_open(e.0, addr.as_ptr(), name.as_ptr(), token.as_ptr(), &mut h) };
    assert_eq!(rc, SYNC_OK);
    h
}

/// `quiesce_engine_stop` while another C thread waits in a transfer call:
/// the header promises that batches still in flight are cancelled, and that
/// no call returns 0 or -1 before its batch quiesced. The cut-off call
/// answers -1 only once the stop's drain reaped everything of its batch,
/// and -2 when it did not (then the stop answers -2 too); and the handle
/// stays valid for it until it has returned.
///
/// A 4 MiB read (past the caller's lane: it runs on the engine's thread)
/// from a stalled target is in flight when another thread stops the engine.
/// Whatever the read answers, -1 must mean that nothing touches its buffer
/// any more: the bytes the caller writes there afterwards stay, also once
/// the target thawed and served what it had been asked.
#[test]
fn a_call_cut_off_by_the_engines_stop_answers_minus_one_only_once_nothing_touches_its_buffer() {
    const LEN: usize = 4 << 20;
    for round in 0..3 {
        let t = Target::start();
        // SAFETY: a null node name is allowed.
        let e = Handle(unsafe { quiesce_engine_start(std::ptr::null()) });
        assert!(!e.0.is_null());
        let seg = open(e, &t);
        let pattern = vec![0x5a; LEN];
        // SAFETY: a live engine and a readable buffer of LEN bytes.
        let rc = unsafe {
            quiesce_transfer_sync_write(
                e.0,
                seg,
                0,
                pattern.as_ptr().cast(),
                LEN as u64,
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        };
        assert_eq!(rc, SYNC_OK, "round {round}");
        t.stall(Duration::from_millis(1500));
        let code = AtomicI32::new(i32::MIN);
        let answered = &code;
        let stopped = std::thread::scope(|s| {
            let reader = s.spawn(move || {
                let e = e; // the whole handle, not its pointer field
                let mut buf = vec![0u8; LEN];
                // SAFETY: a live engine (the stop waits for this call) and a
                // writable buffer of LEN bytes; no deadline.
                let rc = unsafe {
                    quiesce_transfer_sync_read(
                        e.0,
                        seg,
                        0,
                        buf.as_mut_ptr().cast(),
                        LEN as u64,
                        std::ptr::null(),
                        std::ptr::null_mut(),
                    )
                };
                answered.store(rc, Ordering::SeqCst);
                if rc == SYNC_FAILED {
                    // The caller's memory again: it writes its own bytes.
                    buf.fill(0xee);
                    std::thread::sleep(Duration::from_millis(2500)); // the target thaws
                    assert!(
                        buf.iter().all(|&b| b == 0xee),
                        "round {round}: the read's bytes landed after it answered -1"
                    );
                } else {
                    // -2: the buffer must never be reused; keep it for good.
                    std::mem::forget(buf);
                }
            });
            std::thread::sleep(Duration::from_millis(200));
            let t0 = Instant::now();
            // SAFETY: the engine came from quiesce_engine_start; the reader's
            // call is in flight, which the stop cancels.
            let stopped = unsafe { quiesce_engine_stop(e.0) };
            eprintln!("round {round}: stop {stopped} after {:?}", t0.elapsed());
            reader.join().unwrap();
            stopped
        });
        let code = code.load(Ordering::SeqCst);
        assert!(
            code == SYNC_FAILED || code == SYNC_UNKNOWN,
            "round {round}: the cut-off read answered {code}"
        );
        if stopped == SYNC_UNKNOWN {
            assert_eq!(
                code, SYNC_UNKNOWN,
                "round {round}: the stop's drain left operations live, yet the read answered -1"
            );
        }
        std::thread::sleep(Duration::from_millis(1000));
    }
}

/// A write cut off by the engine's stop was never fenced at its target:
/// bytes it had queued in the socket still land there after it answered
/// -1. `quiesce_last_remote_confirmed()` must then say 0, not what the
/// thread's previous batch (confirmed) left.
#[test]
fn a_write_cut_off_by_the_stop_is_not_confirmed_at_its_target() {
    // More tasks than a caller lane takes (it runs on the engine's thread),
    // few bytes: all in the socket's buffers while the target stalls, so
    // the batch waits only for the answers, which the stop cancels.
    const TASKS: usize = 17;
    const LEN: usize = 4096;
    let t = Target::start();
    // SAFETY: a null node name is allowed.
    let e = Handle(unsafe { quiesce_engine_start(std::ptr::null()) });
    assert!(!e.0.is_null());
    let seg = open(e, &t);
    let mut bufs = vec![[0x5au8; LEN]; TASKS];
    let code = std::thread::scope(|s| {
        let writer = s.spawn(move || {
            let e = e; // the whole handle, not its pointer field
            let tasks: Vec<QuiesceTask> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| QuiesceTask {
                    segment: seg,
                    offset: (i * LEN) as u64,
                    buf: b.as_mut_ptr().cast(),
                    len: LEN as u64,
                })
                .collect();
            let write = || {
                // SAFETY: a live engine (the stop waits for this call) and
                // TASKS readable buffers of LEN bytes; no deadline.
                unsafe {
                    quiesce_batch_transfer_sync_write(
                        e.0,
                        tasks.as_ptr(),
                        TASKS,
                        std::ptr::null(),
                        std::ptr::null_mut(),
                    )
                }
            };
            assert_eq!(write(), SYNC_OK);
            assert_eq!(quiesce_last_remote_confirmed(), 1);
            t.stall(Duration::from_millis(1500));
            let rc = write();
            (rc, quiesce_last_remote_confirmed())
        });
        std::thread::sleep(Duration::from_millis(300));
        // SAFETY: the engine came from quiesce_engine_start; the writer's
        // call is in flight, which the stop cancels.
        let stopped = unsafe { quiesce_engine_stop(e.0) };
        eprintln!("stop answered {stopped}");
        writer.join().unwrap()
    });
    std::thread::sleep(Duration::from_millis(1500)); // the target thaws
    let (rc, confirmed) = code;
    assert_eq!(rc, SYNC_FAILED, "the cut-off write (drained at the stop)");
    assert_eq!(
        confirmed, 0,
        "a cut-off write answered -1 'confirmed at its target'"
    );
}

fn last_error() -> String {
    // SAFETY: a NUL-terminated string valid until this thread's next call.
    unsafe { std::ffi::CStr::from_ptr(quiesce_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// A node name that is not UTF-8 is refused (NULL and a message), not
/// turned into another name: two such names would become one node.
#[test]
fn a_node_name_that_is_not_utf8_is_refused() {
    let name = CString::new(b"n\xff".to_vec()).unwrap();
    // SAFETY: a NUL-terminated string.
    let e = unsafe { quiesce_engine_start(name.as_ptr()) };
    if !e.is_null() {
        // SAFETY: just started.
        unsafe { quiesce_engine_stop(e) };
        panic!("an engine named by bytes that are not UTF-8 started");
    }
    assert!(last_error().contains("UTF-8"), "{}", last_error());
}

/// A task count past what an array can hold (a negative `int` passed as
/// `size_t`) is refused with -1 before the array is read.
#[test]
fn a_task_count_no_array_can_hold_is_refused() {
    // SAFETY: a null node name is allowed.
    let e = unsafe { quiesce_engine_start(std::ptr::null()) };
    assert!(!e.is_null());
    let buf = [0u8; 16];
    let task = QuiesceTask {
        segment: 0,
        offset: 0,
        buf: buf.as_ptr() as *mut _,
        len: 16,
    };
    for n in [usize::MAX, usize::MAX / 2, isize::MAX as usize] {
        // SAFETY: a live engine; `n` is what is under test (refused before
        // the array is read).
        let rc = unsafe {
            quiesce_batch_transfer_sync_write(e, &task, n, std::ptr::null(), std::ptr::null_mut())
        };
        assert_eq!(rc, SYNC_FAILED, "n = {n}");
        assert!(last_error().contains("too many tasks"), "{}", last_error());
    }
    // SAFETY: started above, no call in flight.
    assert_eq!(unsafe { quiesce_engine_stop(e) }, SYNC_OK);
}

/// After the stop, the handle still answers: a call on it is -3, and a
/// second stop answers what the first did (its engine went with the stop;
/// the handle is never freed, so a call racing the stop reads no freed
/// memory).
#[test]
fn calls_after_the_stop_answer_minus_three() {
    // SAFETY: a null node name is allowed.
    let e = unsafe { quiesce_engine_start(std::ptr::null()) };
    assert!(!e.is_null());
    // SAFETY: started above, no call in flight.
    assert_eq!(unsafe { quiesce_engine_stop(e) }, SYNC_OK);
    let buf = [0u8; 16];
    // SAFETY: a stopped handle, which stays valid; a readable buffer.
    let rc = unsafe {
        quiesce_transfer_sync_write(
            e,
            0,
            0,
            buf.as_ptr().cast(),
            16,
            std::ptr::null(),
            std::ptr::null_mut(),
        )
    };
    assert_eq!(rc, SYNC_UNKNOWN_HANDLE, "{}", last_error());
    // SAFETY: as above.
    assert_eq!(unsafe { quiesce_engine_stop(e) }, SYNC_OK);
}

/// A call that begins after the stop answers -3, also while a call that
/// began before it still holds the engine: here one waiting on its caller
/// lane (a lane batch is not the engine thread's to cut off), which keeps
/// the engine alive past the stop. A second stop answers what the first
/// did.
#[test]
fn a_call_after_the_stop_answers_minus_three_while_another_still_runs() {
    let t = Target::start();
    // SAFETY: a null node name is allowed.
    let e = Handle(unsafe { quiesce_engine_start(std::ptr::null()) });
    let seg = open(e, &t);
    let small = vec![7u8; 4096];
    let write = |e: Handle| {
        // SAFETY: a handle from quiesce_engine_start (stopped or not) and a
        // readable buffer; no deadline.
        unsafe {
            quiesce_transfer_sync_write(
                e.0,
                seg,
                0,
                small.as_ptr().cast(),
                4096,
                std::ptr::null(),
                std::ptr::null_mut(),
            )
        }
    };
    assert_eq!(write(e), SYNC_OK, "the caller's lane is up");
    t.stall(Duration::from_millis(1500));
    std::thread::scope(|s| {
        let before = s.spawn(move || write(e));
        std::thread::sleep(Duration::from_millis(200));
        // SAFETY: the handle is live; a call is in flight.
        assert_eq!(unsafe { quiesce_engine_stop(e.0) }, SYNC_OK);
        let t0 = Instant::now();
        assert_eq!(write(e), SYNC_UNKNOWN_HANDLE, "a call after the stop ran");
        assert!(
            t0.elapsed() < Duration::from_millis(500),
            "{:?}",
            t0.elapsed()
        );
        // SAFETY: as above.
        assert_eq!(
            unsafe { quiesce_engine_stop(e.0) },
            SYNC_OK,
            "the first stop's answer"
        );
        assert_eq!(before.join().unwrap(), SYNC_OK, "the call before the stop");
    });
}

/// In a forked child, waiting on (or polling) a ticket answers -2: the
/// parent's engine may still touch the ticket's memory, which a MAP_SHARED
/// mapping shares with the child. It answered -1, "nothing touches it",
/// like the child's other calls.
#[test]
fn a_forked_childs_ticket_wait_answers_unknown() {
    use quiesce_batch::ffi::{quiesce_ticket_poll, quiesce_ticket_wait};
    // SAFETY: a null node name is allowed.
    let e = unsafe { quiesce_engine_start(std::ptr::null()) };
    assert!(!e.is_null());
    // SAFETY (child): it calls the C entry points and `_exit`s; `alarm`
    // kills it if a call blocks.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0, "fork failed");
    if pid == 0 {
        // SAFETY: `e` is the child's copy of the live handle.
        unsafe {
            libc::alarm(5);
            let waited = quiesce_ticket_wait(e, 1, 10);
            let polled = quiesce_ticket_poll(e, 1);
            libc::_exit(if (waited, polled) == (SYNC_UNKNOWN, SYNC_UNKNOWN) {
                0
            } else {
                1
            });
        }
    }
    let mut status = 0;
    // SAFETY: waits for the child this test forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    assert!(libc::WIFEXITED(status), "the child's call blocked");
    assert_eq!(
        libc::WEXITSTATUS(status),
        0,
        "a forked child's ticket wait did not answer -2"
    );
    // SAFETY: the engine is live; nothing else uses it.
    assert_eq!(unsafe { quiesce_engine_stop(e) }, SYNC_OK);
}
