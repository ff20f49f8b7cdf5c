//! The sync API and the C ABI (a C program built by this test), against a
//! target engine on another thread.

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

use quiesce_batch::sync::{Direction, SyncEngine, SyncError, SyncOutcome, SyncTask};
use quiesce_batch::{BatchOptions, FailurePolicy, SYNC_FAILED, SYNC_OK, SYNC_UNKNOWN};
use quiesce_transports::EngineConfig;

mod common;

use common::Target;

#[test]
fn sync_codes_0_minus_1_and_minus_2_with_a_ticket() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let ro = e.open(t.addr, "ro", t.ro).unwrap();

    let out = e
        .batch(
            Direction::Write,
            vec![SyncTask {
                segment: kv,
                offset: 0,
                buf: vec![9u8; 1 << 20],
            }],
            BatchOptions::default(),
        )
        .unwrap();
    assert_eq!(out.code, SYNC_OK);
    let out = e
        .batch(
            Direction::Read,
            vec![SyncTask {
                segment: kv,
                offset: 0,
                buf: vec![0u8; 1 << 20],
            }],
            BatchOptions::default(),
        )
        .unwrap();
    assert_eq!(out.code, SYNC_OK);
    assert!(out.buffers.unwrap()[0].iter().all(|&b| b == 9));

    let tasks = vec![
        SyncTask {
            segment: ro,
            offset: 0,
            buf: vec![1u8; 4096],
        },
        SyncTask {
            segment: kv,
            offset: 0,
            buf: vec![2u8; 1 << 20],
        },
    ];
    let out = e
        .batch(
            Direction::Write,
            tasks,
            BatchOptions::default().policy(FailurePolicy::FailFast),
        )
        .unwrap();
    assert_eq!(out.code, SYNC_FAILED);
    assert_eq!(
        out.buffers.as_ref().map(|b| b.len()),
        Some(2),
        "-1 hands every buffer back"
    );

    // A frozen target and no grace: the outcome is unknown, with a ticket.
    let out = frozen_write(&e, &t, kv, 3);
    assert_eq!(out.code, SYNC_UNKNOWN);
    assert!(out.buffers.is_none(), "-2 keeps the buffers");
    let ticket = out.ticket.unwrap();
    let drained = e
        .wait::<Vec<u8>>(ticket, Duration::from_secs(10))
        .unwrap()
        .expect("drains once the target thaws");
    assert_ne!(drained.code, SYNC_UNKNOWN);
    assert_eq!(drained.buffers.unwrap().len(), 1);
    assert!(
        e.poll::<Vec<u8>>(ticket).is_err(),
        "a collected ticket is gone"
    );

    // Stopping with a -2 batch still out: stop cancels it and returns only
    // once its operations are reaped, and says so.
    let out = frozen_write(&e, &t, kv, 4);
    assert_eq!(out.code, SYNC_UNKNOWN);
    assert_eq!(e.stop(), Ok(()), "stop drains the outstanding batch");
}

/// A ticket names one batch in the process, not one per engine: waiting on
/// it with another engine is an unknown ticket, never that engine's own
/// batch of the same number (whose memory the caller would then reuse
/// while the first batch still held it).
#[test]
fn a_ticket_of_one_engine_is_unknown_to_another() {
    let (ta, tb) = (Target::start(), Target::start());
    let a = SyncEngine::start(EngineConfig::default()).unwrap();
    let b = SyncEngine::start(EngineConfig::default()).unwrap();
    let frozen_write = |e: &SyncEngine, t: &Target| {
        let kv = e.open(t.addr, "kv", t.kv).unwrap();
        let out = frozen_write(e, t, kv, 7);
        assert_eq!(out.code, SYNC_UNKNOWN);
        out.ticket.unwrap()
    };
    let ticket_a = frozen_write(&a, &ta);
    let ticket_b = frozen_write(&b, &tb);
    assert_ne!(ticket_a, ticket_b, "two batches under one ticket number");
    assert!(
        b.wait::<Vec<u8>>(ticket_a, Duration::ZERO).is_err(),
        "engine b answered engine a's ticket"
    );
    for (e, t) in [(&a, ticket_a), (&b, ticket_b)] {
        let out = e.wait::<Vec<u8>>(t, Duration::from_secs(10)).unwrap();
        assert!(out.is_some_and(|o| o.code != SYNC_UNKNOWN));
    }
}

/// Writes 4 MiB of `fill` to `kv` at `t`, frozen for 300 ms, with a 20 ms
/// deadline and no grace: the outcome is unknown, with a ticket.
fn frozen_write(e: &SyncEngine, t: &Target, kv: u32, fill: u8) -> SyncOutcome<Vec<u8>> {
    t.stall(Duration::from_millis(300));
    let opts = BatchOptions::default()
        .deadline(Duration::from_millis(20))
        .fence_grace(Duration::ZERO);
    let task = SyncTask {
        segment: kv,
        offset: 0,
        buf: vec![fill; 4 << 20],
    };
    e.batch(Direction::Write, vec![task], opts).unwrap()
}

/// Where cargo put the cdylib: next to this test binary (target/<profile>/deps)
/// in a test build, or one level up when it was built as a final artifact.
fn cdylib_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let deps = exe.parent().unwrap().to_path_buf();
    let up = deps.parent().unwrap().to_path_buf();
    [deps, up]
        .into_iter()
        .find(|d| d.join("libquiesce_batch.so").exists())
        .expect("libquiesce_batch.so next to the test binary or one level up")
}

#[test]
fn the_c_abi_from_a_c_program() {
    let dir = cdylib_dir();
    assert!(
        dir.join("libquiesce_batch.so").exists(),
        "cdylib not built in {}",
        dir.display()
    );
    let out = std::env::temp_dir().join(format!("quiesce-abi-test-{}", std::process::id()));
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(cc)
        .arg(root.join("tests/c/abi_test.c"))
        .arg("-I")
        .arg(root.join("../include"))
        .arg("-L")
        .arg(&dir)
        .arg("-lquiesce_batch")
        .arg(format!("-Wl,-rpath,{}", dir.display()))
        .args(["-Wall", "-Werror", "-o"])
        .arg(&out)
        .status()
        .expect("a C compiler (cc)");
    assert!(status.success(), "the C test program failed to build");
    let t = Target::start();
    // The library it was linked against (its RUNPATH), not whichever one
    // cargo's LD_LIBRARY_PATH for tests finds first (an older copy in
    // target/debug once made this run a stale build).
    let run = Command::new(&out)
        .env_remove("LD_LIBRARY_PATH")
        .arg(t.addr.to_string())
        .arg(t.kv.to_string())
        .arg(t.ro.to_string())
        .output()
        .unwrap();
    let _ = std::fs::remove_file(&out);
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "C program failed ({}): {stdout}{}",
        run.status,
        String::from_utf8_lossy(&run.stderr)
    );
    assert!(stdout.contains("c abi: ok"));
    // quiesce_log_to_stderr("info"): every batch's outcome, in its span.
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        stderr.lines().any(|l| l.contains(" INFO ")
            && l.contains("batch{id=")
            && l.contains("batch quiesced")),
        "no INFO events from the C program on stderr:\n{stderr}"
    );
}

/// A read destination whose `set_init` panics: called by the transport in
/// the engine thread once the bytes have landed, so it panics there while
/// the batch holds the memory.
struct PanicsWhenFilled(Vec<u8>);

// SAFETY: delegates to a Vec, whose heap storage never moves.
unsafe impl quiesce_runtime::IoBuf for PanicsWhenFilled {
    fn stable_ptr(&self) -> *const u8 {
        self.0.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.0.len()
    }
    fn bytes_total(&self) -> usize {
        self.0.len()
    }
}

// SAFETY: as above.
unsafe impl quiesce_runtime::IoBufMut for PanicsWhenFilled {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {
        panic!("injected: a panic in the engine thread mid-batch");
    }
}

/// Where a [`PanicsOffItsThread`] buffer panics.
#[derive(Clone, Copy, PartialEq)]
enum PanicIn {
    /// `bytes_total`: the engine's thread dies building the batch.
    Building,
    /// `stable_ptr`: the batch's first poll sends from it, after `build`,
    /// with the batch's first operations started.
    Sending,
}

/// A buffer that panics on any thread but the one that made it, in the
/// call [`PanicIn`] names.
struct PanicsOffItsThread(Vec<u8>, std::thread::ThreadId, PanicIn);

impl PanicsOffItsThread {
    fn new(bytes: Vec<u8>, when: PanicIn) -> Self {
        PanicsOffItsThread(bytes, std::thread::current().id(), when)
    }

    fn check(&self, when: PanicIn) {
        if self.2 == when {
            assert_eq!(
                std::thread::current().id(),
                self.1,
                "injected: a panic in the engine thread"
            );
        }
    }
}

// SAFETY: delegates to a Vec, whose heap storage never moves.
unsafe impl quiesce_runtime::IoBuf for PanicsOffItsThread {
    fn stable_ptr(&self) -> *const u8 {
        self.check(PanicIn::Sending);
        self.0.as_ptr()
    }
    fn bytes_init(&self) -> usize {
        self.0.len()
    }
    fn bytes_total(&self) -> usize {
        self.check(PanicIn::Building);
        self.0.len()
    }
}

// SAFETY: as above.
unsafe impl quiesce_runtime::IoBufMut for PanicsOffItsThread {
    fn stable_mut_ptr(&mut self) -> *mut u8 {
        self.0.as_mut_ptr()
    }
    unsafe fn set_init(&mut self, _pos: usize) {}
}

/// A -2 ticket of an engine whose thread died stays -2: whether its batch
/// drained (the dying runtime's drain may have run out of time and left its
/// operations live) is not known, so it is never reported as settled (the
/// C ABI turned the error into -1, "nothing touches your memory").
#[test]
fn a_ticket_outliving_its_engine_thread_stays_unknown() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    e.caller_lanes(false);
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let out = frozen_write(&e, &t, kv, 5);
    assert_eq!(out.code, SYNC_UNKNOWN);
    let ticket = out.ticket.unwrap();
    let task = SyncTask {
        segment: kv,
        offset: 0,
        buf: PanicsOffItsThread::new(vec![0u8; 4096], PanicIn::Building),
    };
    let dead = e.batch(Direction::Write, vec![task], BatchOptions::default());
    assert!(dead.is_err(), "the engine's thread is gone");
    let polled = e.poll::<Vec<u8>>(ticket).map(|o| o.map(|o| o.code));
    assert_eq!(polled, Ok(None), "a dead engine's ticket was settled");
    let t0 = std::time::Instant::now();
    let waited = e.wait::<Vec<u8>>(ticket, Duration::from_secs(5));
    assert_eq!(waited.map(|o| o.map(|o| o.code)), Ok(None));
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    std::thread::sleep(Duration::from_millis(400));
}

/// A -2 ticket still out when the engine stops cleanly (its drain reaped
/// every operation) answers -1 once: nothing touches its memory any more,
/// and nothing confirmed the target (its outcome, had it drained, went with
/// the engine's thread). It stayed -2 for good, and a caller that polls
/// tickets to free memory (Python's managed buffers) held it for ever. A
/// ticket the engine never issued is unknown, as before the stop.
#[test]
fn a_ticket_out_at_a_clean_stop_answers_minus_one_once() {
    let t = Target::start();
    // Over TCP: the stop cancels the socket's operations and reaps them (a
    // loan to a frozen target on this host stays the target's to end, and
    // the stop reports it undrained).
    let e = SyncEngine::start(EngineConfig {
        local: quiesce_transports::LocalMode::Off,
        ..EngineConfig::default()
    })
    .unwrap();
    e.caller_lanes(false);
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let out = frozen_write(&e, &t, kv, 6);
    assert_eq!(out.code, SYNC_UNKNOWN);
    let ticket = out.ticket.unwrap();
    assert_eq!(e.halt(), Ok(()), "the stop reaped every operation");
    let o = e
        .wait::<Vec<u8>>(ticket, Duration::from_secs(1))
        .unwrap()
        .expect("still -2 after a stop that reaped everything");
    assert_eq!(o.code, SYNC_FAILED);
    assert!(!o.remote_confirmed, "nothing confirmed the target");
    assert!(o.buffers.is_none(), "the buffers went with the engine");
    assert!(
        matches!(e.poll::<Vec<u8>>(ticket), Err(SyncError::UnknownTicket(_))),
        "answered twice"
    );
    assert!(matches!(
        e.poll::<Vec<u8>>(ticket + 1_000_000),
        Err(SyncError::UnknownTicket(_))
    ));
}

const PANIC_CHILD: &str = "QUIESCE_TEST_PANIC_CHILD";

/// The child half of [`a_panic_in_the_engine_thread_aborts_never_answers`]:
/// does nothing unless the parent set [`PANIC_CHILD`].
#[test]
fn panic_child() {
    answer_one(PANIC_CHILD, Direction::Read, || {
        PanicsWhenFilled(vec![0u8; 1 << 20])
    });
}

const PANIC_FIRST_POLL: &str = "QUIESCE_TEST_PANIC_FIRST_POLL";

/// The child half of [`a_panic_in_a_batchs_first_poll_aborts_never_answers`].
#[test]
fn panic_first_poll_child() {
    answer_one(PANIC_FIRST_POLL, Direction::Write, || {
        PanicsOffItsThread::new(vec![1u8; 1 << 20], PanicIn::Sending)
    });
}

/// A child half: nothing unless the parent set `env`; else one batch of
/// `dir` moving `buf()` (1 MiB: on the engine's thread, past any lane) to
/// the target's `kv`, and its answer printed — any answer at all is the
/// failure: the C ABI would turn an error into -1 ("nothing touches your
/// memory") on a guess.
fn answer_one<B: quiesce_runtime::IoBufMut + Send>(
    env: &str,
    dir: Direction,
    buf: impl FnOnce() -> B,
) {
    if std::env::var_os(env).is_none() {
        return;
    }
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    e.caller_lanes(false);
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let task = SyncTask {
        segment: kv,
        offset: 0,
        buf: buf(),
    };
    let r = e.batch(dir, vec![task], BatchOptions::default());
    println!("ANSWERED: {:?}", r.map(|o| o.code));
}

/// The same for a panic in the batch's first poll, which starts its first
/// operations on the job's own stack (before it is a task): an answer there
/// (the C ABI's -1) could be a guess too, so the process aborts.
#[test]
fn a_panic_in_a_batchs_first_poll_aborts_never_answers() {
    child_aborts("panic_first_poll_child", PANIC_FIRST_POLL);
}

/// A panic in the engine thread while a batch holds the caller's memory
/// must not become an answer (the C ABI's -1 says nothing touches the
/// memory, which a panic cannot know): the process aborts.
#[test]
fn a_panic_in_the_engine_thread_aborts_never_answers() {
    let stderr = child_aborts("panic_child", PANIC_CHILD);
    assert!(
        stderr.contains("aborting rather than return memory"),
        "{stderr}"
    );
}

/// Runs test `child` of this binary with `env` set: it must abort after the
/// injected panic, never print an answer. Its stderr.
fn child_aborts(child: &str, env: &str) -> String {
    use std::os::unix::process::ExitStatusExt;
    let out = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", child, "--nocapture", "--test-threads=1"])
        .env(env, "1")
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    assert!(
        !stdout.contains("ANSWERED"),
        "the caller got an answer after a panic: {stdout}"
    );
    assert_eq!(
        out.status.signal(),
        Some(libc::SIGABRT),
        "the child should abort: {:?}\n{stdout}\n{stderr}",
        out.status
    );
    assert!(
        stderr.contains("injected: a panic in the engine thread"),
        "{stderr}"
    );
    stderr
}

/// A deadline or fence grace too long for an `Instant` (a C caller's
/// `deadline_ms` of `UINT64_MAX`, Python's `deadline=1e19`) is no limit,
/// not a panic: it panicked in the batch's driver (`started + deadline`)
/// and where the fence starts (`now + fence_grace`), on the engine's thread,
/// which aborts the process with a batch in flight.
#[test]
fn deadlines_past_what_an_instant_holds_are_no_limit() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let ro = e.open(t.addr, "ro", t.ro).unwrap();
    let opts = BatchOptions::default()
        .deadline(Duration::MAX)
        .fence_grace(Duration::MAX);
    let one = |segment| SyncTask {
        segment,
        offset: 0,
        buf: vec![5u8; 4096],
    };
    let out = e.batch(Direction::Write, vec![one(kv)], opts).unwrap();
    assert_eq!(out.code, SYNC_OK);
    // A refused task fences the rest, with that grace.
    let out = e
        .batch(Direction::Write, vec![one(ro), one(kv)], opts)
        .unwrap();
    assert_eq!(out.code, SYNC_FAILED);
}

/// A batch's deadline counts from the call, not from when the engine's
/// thread gets to it: a deadline that passed while the call waited behind
/// a busy engine thread fails the batch, and nothing of it starts (it
/// started then, and on a live target completed long after its deadline).
#[test]
fn a_deadline_counts_from_the_call_and_one_past_starts_nothing() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    // Every call through the engine's thread, none on a caller lane.
    e.caller_lanes(false);
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let task = |offset, fill| SyncTask {
        segment: kv,
        offset,
        buf: vec![fill; 4096],
    };
    // A `done` that blocks the engine's thread (which a real one must
    // not): the next call waits behind it for 300 ms.
    let (busy_tx, busy_rx) = std::sync::mpsc::channel();
    e.submit_with(
        vec![(Direction::Write, task(0, 1))],
        BatchOptions::default(),
        move |out| {
            assert_eq!(out.code, SYNC_OK);
            busy_tx.send(()).unwrap();
            std::thread::sleep(Duration::from_millis(300));
        },
    )
    .unwrap();
    busy_rx.recv().unwrap();
    let opts = BatchOptions::default().deadline(Duration::from_millis(50));
    let out = e
        .batch(Direction::Write, vec![task(4096, 2)], opts)
        .unwrap();
    assert_eq!(
        out.code, SYNC_FAILED,
        "the deadline passed before it started"
    );
    assert!(out.remote_confirmed, "nothing was sent");
    assert_eq!((out.tasks[0].bytes, out.tasks[0].attempts), (0, 0));
    // Nothing of it landed.
    let out = e
        .batch(
            Direction::Read,
            vec![task(4096, 7)],
            BatchOptions::default(),
        )
        .unwrap();
    assert_eq!(out.code, SYNC_OK);
    assert!(out.buffers.unwrap()[0].iter().all(|&b| b == 0));
}
