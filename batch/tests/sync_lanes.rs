//! Caller lanes: small sync batches run on the calling thread, on copies of
//! the caller's bytes — so whatever the batch's outcome, nothing touches the
//! caller's buffers once the call has returned.

use std::time::Duration;

use quiesce_batch::sync::{Direction, SyncEngine, SyncError, SyncTask, LANE_MAX_BYTES};
use quiesce_batch::{BatchOptions, FailurePolicy, TaskStatus, SYNC_FAILED, SYNC_OK};
use quiesce_transports::{EngineConfig, TransferError};

mod common;
#[path = "sync_lanes/restart.rs"]
mod restart;

use common::{Target, KV};

fn task(segment: u32, offset: u64, buf: Vec<u8>) -> SyncTask<Vec<u8>> {
    SyncTask {
        segment,
        offset,
        buf,
    }
}

fn write(e: &SyncEngine, seg: u32, at: u64, buf: Vec<u8>) -> i32 {
    e.batch(
        Direction::Write,
        vec![task(seg, at, buf)],
        BatchOptions::default(),
    )
    .unwrap()
    .code
}

/// Small batches run on the caller's thread: its lane is a session of its
/// own at the target; with lanes off, every batch goes through the engine's.
#[test]
fn small_batches_run_on_a_lane_of_the_calling_thread() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    assert_eq!(t.wait_sessions(1), 1, "the engine's own session");

    e.caller_lanes(false);
    assert_eq!(write(&e, kv, 0, vec![1u8; 4096]), SYNC_OK);
    assert_eq!(
        t.wait_sessions(1),
        1,
        "lanes off: no session but the engine's"
    );

    e.caller_lanes(true);
    assert_eq!(write(&e, kv, 0, vec![2u8; 4096]), SYNC_OK);
    assert_eq!(t.wait_sessions(2), 2, "the calling thread's lane");
    assert!(t.peek(0, 4096).iter().all(|&b| b == 2));
    // Too big for a lane: the engine's thread, no new session.
    let big = LANE_MAX_BYTES + 1;
    assert_eq!(write(&e, kv, 0, vec![3u8; big]), SYNC_OK);
    assert!(t.peek(0, big).iter().all(|&b| b == 3));

    // Each thread has its lane, and it goes when its thread exits.
    let all_wrote = std::sync::Barrier::new(5);
    let checked = std::sync::Barrier::new(5);
    std::thread::scope(|s| {
        for i in 0..4u8 {
            let (e, all_wrote, checked) = (&e, &all_wrote, &checked);
            s.spawn(move || {
                for _ in 0..50 {
                    let at = u64::from(i) << 16;
                    assert_eq!(write(e, kv, at, vec![10 + i; 8192]), SYNC_OK);
                }
                all_wrote.wait();
                checked.wait();
            });
        }
        all_wrote.wait();
        assert_eq!(
            t.wait_sessions(6),
            6,
            "the engine's, this thread's and 4 more"
        );
        checked.wait();
    });
    assert_eq!(
        t.wait_sessions(2),
        2,
        "the 4 threads' lanes closed as they exited"
    );
    for i in 0..4u8 {
        assert!(t
            .peek(u64::from(i) << 16, 8192)
            .iter()
            .all(|&b| b == 10 + i));
    }

    // Stopping the engine drops this thread's lane at once.
    e.stop().unwrap();
    assert_eq!(
        t.wait_sessions(0),
        0,
        "this thread's lane closed with its engine"
    );
}

/// Reads and writes of every size a lane takes, mixed in one batch, land
/// and come back byte for byte.
#[test]
fn lane_reads_and_writes_move_every_byte() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let sizes = [1usize, 7, 4096, 16 << 10, (16 << 10) + 1, 64 << 10, 100_000];
    let mut at = 0u64;
    for &n in &sizes {
        let data: Vec<u8> = (0..n).map(|i| (i * 31 + n) as u8).collect();
        assert_eq!(write(&e, kv, at, data.clone()), SYNC_OK, "{n} bytes");
        assert_eq!(t.peek(at, n), data, "{n} bytes landed");
        let out = e
            .batch(
                Direction::Read,
                vec![task(kv, at, vec![0u8; n])],
                BatchOptions::default(),
            )
            .unwrap();
        assert_eq!(out.code, SYNC_OK);
        assert_eq!(out.buffers.unwrap()[0], data, "{n} bytes read back");
        at += n as u64;
    }
    // A write and a read in one batch.
    let out = e
        .run(
            vec![
                (Direction::Write, task(kv, 1 << 20, vec![0xab; 4096])),
                (Direction::Read, task(kv, 0, vec![0u8; 4096])),
            ],
            BatchOptions::default(),
        )
        .unwrap();
    assert_eq!(out.code, SYNC_OK);
    let bufs = out.buffers.unwrap();
    assert_eq!(bufs[1], t.peek(0, 4096));
    assert!(t.peek(1 << 20, 4096).iter().all(|&b| b == 0xab));
    assert_eq!(t.wait_sessions(2), 2, "all of it on this thread's lane");
}

/// Bad input gets the same answer on a lane as on the engine's thread, and
/// nothing lands.
#[test]
fn a_lane_refuses_what_the_engine_refuses() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let past_end = || vec![task(kv, KV as u64 - 100, vec![7u8; 4096])];
    let on_lane = e
        .batch(Direction::Write, past_end(), BatchOptions::default())
        .unwrap();
    e.caller_lanes(false);
    let on_engine = e
        .batch(Direction::Write, past_end(), BatchOptions::default())
        .unwrap();
    assert_eq!(on_lane.code, SYNC_FAILED);
    assert_eq!(on_lane.tasks, on_engine.tasks, "the same report either way");
    assert!(
        matches!(
            on_lane.tasks[0].status,
            TaskStatus::Failed(TransferError::OutOfBounds { .. })
        ),
        "{:?}",
        on_lane.tasks
    );
    assert!(t.peek(KV as u64 - 100, 100).iter().all(|&b| b == 0));
    assert_eq!(t.wait_sessions(2), 2, "the first ran on a lane");
    e.caller_lanes(true);
    let out = e.batch(
        Direction::Write,
        vec![task(99, 0, vec![1u8; 16])],
        BatchOptions::default(),
    );
    assert!(matches!(out, Err(SyncError::UnknownSegment(99))), "{out:?}");
}

/// A lane read whose answer comes only after its deadline (a frozen
/// target, no grace): the call answers -1, remote unconfirmed, and hands
/// the buffer back — and the late answer, reaped by the thread's next lane
/// call, lands in the lane's copy, never in the caller's buffer.
#[test]
fn a_lane_read_cut_at_its_deadline_never_writes_the_callers_buffer_afterwards() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    assert_eq!(write(&e, kv, 0, vec![0x11; 64 << 10]), SYNC_OK);
    let cut = BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_millis(20))
        .fence_grace(Duration::ZERO);
    for round in 0..3 {
        t.stall(Duration::from_millis(300));
        let out = e
            .batch(Direction::Read, vec![task(kv, 0, vec![0u8; 64 << 10])], cut)
            .unwrap();
        assert_eq!(
            out.code, SYNC_FAILED,
            "round {round}: a lane never answers -2"
        );
        assert!(
            !out.remote_confirmed,
            "round {round}: the frozen target confirmed nothing"
        );
        assert!(out.tasks.iter().all(|r| r.status != TaskStatus::Completed));
        let mut mine = out
            .buffers
            .expect("-1 hands the buffer back")
            .pop()
            .unwrap();
        // The caller's buffer is its own again: it writes a pattern there.
        mine.fill(0xee);
        std::thread::sleep(Duration::from_millis(400)); // the target thaws and answers
                                                        // This thread's next lane call reaps whatever arrived meanwhile.
        assert_eq!(write(&e, kv, 1 << 20, vec![1u8; 4096]), SYNC_OK);
        assert!(
            mine.iter().all(|&b| b == 0xee),
            "round {round}: the late answer wrote the caller's buffer after -1"
        );
    }
}

/// A lane write cut at its deadline answers -1 with the buffer (not -2),
/// the target unconfirmed (the cut write's own bytes may still land there):
/// the caller's bytes were copied before anything was sent, so what the
/// caller writes into its buffer afterwards never reaches the target.
#[test]
fn a_lane_write_cut_at_its_deadline_hands_the_buffer_back_and_what_the_caller_writes_there_never_lands(
) {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let cut = BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_millis(20))
        .fence_grace(Duration::ZERO);
    let n = LANE_MAX_BYTES;
    assert_eq!(write(&e, kv, 0, vec![0x30; n]), SYNC_OK, "the lane is up");
    for round in 0..3u8 {
        t.stall(Duration::from_millis(300));
        let t0 = std::time::Instant::now();
        let out = e
            .batch(
                Direction::Write,
                vec![task(kv, 0, vec![0x40 + round; n])],
                cut,
            )
            .unwrap();
        eprintln!("round {round}: {:?} {:?}", t0.elapsed(), out.tasks);
        assert_eq!(out.code, SYNC_FAILED, "round {round}");
        assert!(!out.remote_confirmed, "round {round}");
        let mut mine = out.buffers.unwrap().pop().unwrap();
        mine.fill(0xee);
        std::thread::sleep(Duration::from_millis(400));
        assert_eq!(write(&e, kv, 1 << 20, vec![1u8; 4096]), SYNC_OK);
        let landed = t.peek(0, n);
        assert!(
            !landed.contains(&0xee),
            "round {round}: bytes the caller wrote after -1 reached the target"
        );
    }
}

/// From inside a quiesce runtime there is no lane (the thread is that
/// runtime's): the engine's thread runs the batch.
#[test]
fn inside_a_runtime_the_engine_runs_the_batch() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let rt = quiesce_runtime::Runtime::new().unwrap();
    let code = rt.block_on(async { write(&e, kv, 0, vec![5u8; 4096]) });
    assert_eq!(code, SYNC_OK);
    assert_eq!(t.wait_sessions(1), 1, "no lane was made");
    assert!(t.peek(0, 4096).iter().all(|&b| b == 5));
}

/// A thread's first small batch opens its lane's connection: a peer that
/// does not answer then must not stretch the caller's deadline — the open
/// may take a quarter of it, and the engine's thread runs the batch with
/// what is left — and the lane does not try again for a while, so the
/// next calls keep their whole deadline on the engine's thread; then it
/// does, and opens.
#[test]
fn opening_a_lane_to_a_frozen_peer_keeps_the_deadline() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let opts = BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_millis(400))
        .fence_grace(Duration::from_millis(100));
    t.stall(Duration::from_millis(400));
    let started = std::time::Instant::now();
    let out = e
        .batch(Direction::Write, vec![task(kv, 0, vec![9u8; 4096])], opts)
        .unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(800),
        "deadline 400 ms + grace 100 ms, answered after {took:?} ({})",
        out.code
    );
    // Within the lane's back-off: the engine's thread, no lane session.
    let out = e
        .batch(Direction::Write, vec![task(kv, 0, vec![8u8; 4096])], opts)
        .unwrap();
    assert_eq!(out.code, SYNC_OK, "the target is awake again");
    assert_eq!(t.wait_sessions(1), 1, "no lane yet");
    std::thread::sleep(Duration::from_millis(1200));
    assert_eq!(write(&e, kv, 0, vec![7u8; 4096]), SYNC_OK);
    assert_eq!(t.wait_sessions(2), 2, "after the back-off the lane opens");
}

/// A thread whose last lane batch was fenced (a refused write beside a
/// valid one) exits cleanly: the lane's leftover work (the fence's forget)
/// does not run into thread-locals already torn down, and the lane's
/// session closes with the thread.
#[test]
fn a_thread_exits_cleanly_after_a_fenced_lane_batch() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    // A task's panic is caught by its runtime: count them (any test of this
    // binary that panics counts too, and fails on its own anyway).
    static PANICS: AtomicUsize = AtomicUsize::new(0);
    let hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        hook(info);
    }));
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    let ro = e.open(t.addr, "ro", t.ro).unwrap();
    for round in 0..3 {
        std::thread::scope(|s| {
            s.spawn(|| {
                let out = e
                    .batch(
                        Direction::Write,
                        vec![
                            task(ro, 0, vec![1u8; 4096]),
                            task(kv, 0, vec![2u8; 128 << 10]),
                        ],
                        BatchOptions::default().policy(FailurePolicy::FailFast),
                    )
                    .unwrap();
                assert_eq!(out.code, SYNC_FAILED, "round {round}: ro refuses writes");
                assert_eq!(t.wait_sessions(2), 2, "round {round}: it ran on a lane");
            });
        });
        assert_eq!(
            t.wait_sessions(1),
            1,
            "round {round}: the lane closed with its thread"
        );
        assert_eq!(
            PANICS.load(Ordering::SeqCst),
            0,
            "round {round}: a panic at the thread's exit"
        );
    }
}

/// Stopping an engine from inside a runtime, on a thread that has a lane
/// of it: the lane cannot be driven there, so it is left for the thread's
/// next lane call, and the stop drains as always.
#[test]
fn stopping_an_engine_inside_a_runtime_leaves_its_lane_for_later() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    assert_eq!(write(&e, kv, 0, vec![1u8; 4096]), SYNC_OK);
    assert_eq!(t.wait_sessions(2), 2, "the engine's and this thread's lane");
    let rt = quiesce_runtime::Runtime::new().unwrap();
    assert_eq!(rt.block_on(async { e.stop() }), Ok(()));
    drop(rt);
    // The next lane call (another engine's) drops the stopped engine's lane.
    let e2 = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv2 = e2.open(t.addr, "kv", t.kv).unwrap();
    assert_eq!(write(&e2, kv2, 0, vec![2u8; 4096]), SYNC_OK);
    assert_eq!(t.wait_sessions(2), 2, "e2's engine and lane; e's lane gone");
}

/// A lane's opening takes a quarter of the batch's deadline at most, over
/// all the segments it opens — not a quarter for each: ten peers that each
/// answer an open just inside a quarter held a first lane call for ten
/// quarters, and its batch then ran with no deadline left.
#[test]
fn a_lane_opening_many_segments_keeps_the_deadline() {
    const PEERS: u64 = 10;
    let targets: Vec<Target> = (0..PEERS).map(|_| Target::start()).collect();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let handles: Vec<u32> = targets
        .iter()
        .map(|t| e.open(t.addr, "kv", t.kv).unwrap())
        .collect();
    let opts = BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_millis(400))
        .fence_grace(Duration::from_millis(100));
    // Peer k wakes (k + 1) × 80 ms after the call starts: each lane open,
    // one after the other, waits about 80 ms — inside a quarter of the
    // deadline. (`stall` returns 20 ms after it froze the peer: the call
    // starts PEERS × 20 ms after the first froze.)
    for (k, t) in targets.iter().enumerate() {
        let k = k as u64;
        t.stall(Duration::from_millis(PEERS * 20 + 80 * (k + 1) - 20 * k));
    }
    let tasks: Vec<_> = handles
        .iter()
        .map(|&h| task(h, 0, vec![5u8; 4096]))
        .collect();
    let started = std::time::Instant::now();
    let out = e.batch(Direction::Write, tasks, opts).unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_millis(700),
        "deadline 400 ms + grace 100 ms, answered after {took:?} ({})",
        out.code
    );
}

/// A forked child shares its parent's lane: its sockets and its io_uring
/// ring. The child's exit runs the thread's lane destructor, which must
/// leave them alone: it closed the lane's connections under the parent (its
/// session at the target ended) and drained the parent's ring.
#[test]
fn a_forked_childs_exit_leaves_the_parents_lane_alone() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    assert_eq!(write(&e, kv, 0, vec![1u8; 4096]), SYNC_OK);
    assert_eq!(t.wait_sessions(2), 2, "the engine's session and the lane's");
    // The child only exits, running this thread's destructors, as a forked
    // Python worker's exit does.
    // SAFETY: a plain fork; the child calls only `exit`.
    let pid = unsafe { libc::fork() };
    assert!(pid >= 0);
    if pid == 0 {
        // SAFETY: ends the child; its exit runs thread-local destructors.
        unsafe { libc::exit(0) };
    }
    let mut status = 0;
    // SAFETY: waits for the child this test forked.
    assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(t.stats().sessions, 2, "the child closed the parent's lane");
    assert_eq!(write(&e, kv, 0, vec![2u8; 4096]), SYNC_OK);
    assert!(t.peek(0, 4096).iter().all(|&b| b == 2));
}

/// A lane batch whose completion became unknown answers -1 (the lane held
/// only copies), and reports each task as it stood when that was decided:
/// a write to a healthy target that had completed is `Completed` with its
/// bytes, not `Fenced` like the one a frozen target left in flight.
#[test]
fn a_lane_batch_cut_by_an_unknown_fence_reports_the_tasks_that_completed() {
    let healthy = Target::start();
    let frozen = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let a = e.open(healthy.addr, "kv", healthy.kv).unwrap();
    let b = e.open(frozen.addr, "kv", frozen.kv).unwrap();
    let cut = BatchOptions::default()
        .policy(FailurePolicy::FailFast)
        .deadline(Duration::from_millis(50))
        .fence_grace(Duration::ZERO);
    assert_eq!(write(&e, a, 0, vec![1u8; 4096]), SYNC_OK, "the lane is up");
    assert_eq!(write(&e, b, 0, vec![1u8; 4096]), SYNC_OK);
    for round in 0..3 {
        frozen.stall(Duration::from_millis(300));
        let out = e
            .batch(
                Direction::Write,
                vec![task(a, 0, vec![2u8; 4096]), task(b, 0, vec![3u8; 4096])],
                cut,
            )
            .unwrap();
        assert_eq!(out.code, SYNC_FAILED, "round {round}");
        assert!(!out.remote_confirmed, "round {round}");
        assert_eq!(
            (&out.tasks[0].status, out.tasks[0].bytes),
            (&TaskStatus::Completed, 4096),
            "round {round}: the healthy target's write completed before the cut"
        );
        assert_eq!(
            out.tasks[1].status,
            TaskStatus::Fenced,
            "round {round}: the frozen target's write was in flight"
        );
        assert_eq!(healthy.peek(0, 4096), vec![2u8; 4096], "round {round}");
        std::thread::sleep(Duration::from_millis(350)); // the frozen target thaws
    }
}

/// A halted engine runs nothing more, whatever a batch's size: a small one
/// got no new lane (the halt dropped this thread's, and the next call built
/// another and wrote through it) but `Stopped`, as a large one does.
#[test]
fn a_halted_engine_runs_no_small_batch_on_a_new_lane() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    assert_eq!(write(&e, kv, 0, vec![1u8; 4096]), SYNC_OK);
    assert_eq!(e.halt(), Ok(()));
    for (size, byte) in [(4096, 2u8), (LANE_MAX_BYTES + 1, 3u8)] {
        let r = e.batch(
            Direction::Write,
            vec![task(kv, 0, vec![byte; size])],
            BatchOptions::default(),
        );
        assert!(
            matches!(r, Err(SyncError::Stopped)),
            "{size} bytes after the halt: {r:?}"
        );
    }
    assert!(t.peek(0, 4096).iter().all(|&b| b == 1), "a write landed");
    assert_eq!(t.wait_sessions(0), 0, "a lane lives on after the halt");
}

/// A range the target revoked: the lane's writes into it are refused, as
/// the engine thread's are, until the caller opens the segment again —
/// then the lane opens it again too, and they land. (The lane kept its
/// opening, and the grant from before the revoke, for good: every later
/// small write into the range failed, while a large one, on the engine's
/// thread, landed.)
#[test]
fn a_lane_writes_a_revoked_range_again_once_the_segment_is_opened_again() {
    let t = Target::start();
    let e = SyncEngine::start(EngineConfig::default()).unwrap();
    let kv = e.open(t.addr, "kv", t.kv).unwrap();
    assert_eq!(write(&e, kv, 0, vec![1u8; 4096]), SYNC_OK);
    assert_eq!(t.wait_sessions(2), 2, "the write ran on this thread's lane");
    t.revoke(0..4096);
    assert_eq!(write(&e, kv, 0, vec![2u8; 4096]), SYNC_FAILED);
    assert!(
        t.peek(0, 4096).iter().all(|&b| b == 1),
        "a revoked write landed"
    );
    assert_eq!(e.open(t.addr, "kv", t.kv).unwrap(), kv, "the same handle");
    assert_eq!(write(&e, kv, 0, vec![3u8; 4096]), SYNC_OK);
    assert!(t.peek(0, 4096).iter().all(|&b| b == 3));
    // Large (the engine's thread) alike.
    let big = LANE_MAX_BYTES + 1;
    assert_eq!(write(&e, kv, 0, vec![4u8; big]), SYNC_OK);
    e.stop().unwrap();
}
