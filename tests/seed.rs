//! The seed scenario over real TCP with the target in its own process, and
//! its variants: the read mirror, a deadline with the target stopped, a
//! dropped batch, FailFast against Drain. TCP explicitly (the local
//! transport is off): `seed_local.rs` runs them over cross-memory attach.

use std::path::Path;
use std::time::Duration;

use quiesce::batch::{
    Batch, BatchOptions, FailurePolicy, Outcome, Quiesced, RemoteRange, RemoteState, TaskStatus,
    Tcp,
};
use quiesce::runtime::{spawn_local, time, Runtime};
use quiesce::scenario::{
    count_remote, one_write, read_round, seed_batch, seed_options, write_round, Bufs, Kind, Remote,
    POST_OUTCOME,
};
use quiesce::stale::stale_bytes_round;
use quiesce::target_child::TargetChild;
use quiesce::transports::{
    AlignedBuf, Engine, EngineConfig, LocalMode, RemoteSegment, TransferError,
};

const BIG: usize = 64 << 20;

type Target = TargetChild;

fn spawn_target() -> Target {
    TargetChild::spawn(Path::new(env!("CARGO_BIN_EXE_quiesce")), BIG, false).unwrap()
}

async fn remote(t: &Target, refuse: &str) -> (Engine, Remote<RemoteSegment>) {
    let e = Engine::bind(EngineConfig {
        local: LocalMode::Off,
        ..EngineConfig::default()
    })
    .unwrap();
    let peer = e.connect(t.addr).await.unwrap();
    assert!(!peer.is_local());
    let r = Remote {
        kv: peer.open("kv", t.tokens["kv"]).await.unwrap(),
        refuse: peer.open(refuse, t.tokens[refuse]).await.unwrap(),
    };
    (e, r)
}

fn bufs(size: usize) -> Bufs<AlignedBuf> {
    Bufs {
        big: AlignedBuf::new(size),
        probe: AlignedBuf::new(4096),
        scratch: AlignedBuf::new(8 << 20),
    }
}

#[test]
fn seed_scenario_50_rounds_no_post_outcome_byte_lands() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let mut bufs = bufs(BIG);
        let mut corrupted = 0;
        for round in 0..50 {
            let (res, b) =
                write_round(&r, bufs, round, seed_options(), Duration::from_millis(10)).await;
            bufs = b;
            assert_ne!(
                res.kind,
                Kind::Completed,
                "the refused write must fail the batch"
            );
            corrupted += (res.corrupted_bytes > 0) as u32;
        }
        assert_eq!(corrupted, 0, "corrupted: {corrupted}/50");
    });
}

#[test]
fn read_mirror_no_remote_byte_lands_after_the_outcome() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "wo").await;
        let mut bufs = bufs(BIG);
        for round in 0..10 {
            let (res, b) = read_round(&r, bufs, seed_options(), Duration::from_millis(10)).await;
            bufs = b;
            assert_ne!(res.kind, Kind::Completed);
            assert_eq!(
                res.corrupted_bytes, 0,
                "remote data landed after the outcome in round {round}"
            );
        }
    });
}

#[test]
fn deadline_with_the_target_stopped_then_resumed() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let opts = BatchOptions::default()
            .policy(FailurePolicy::FailFast)
            .deadline(Duration::from_millis(30))
            .fence_grace(Duration::from_millis(200));
        let batch = one_write(&r, AlignedBuf::from_slice(&vec![7u8; BIG]), opts);
        let sub = batch.submit();
        time::sleep(Duration::from_millis(3)).await;
        t.signal(libc::SIGSTOP).unwrap();
        let outcome = sub.await;
        let code = outcome.sync_code();
        assert!(
            code == -1 || code == -2,
            "a stopped target cannot complete the batch: {code}"
        );
        let q = outcome.quiesced().await;
        assert!(!q.all_completed());
        let mut src = q.into_buffers().next_back().unwrap();
        src.fill(POST_OUTCOME);
        t.signal(libc::SIGCONT).unwrap();
        time::sleep(Duration::from_millis(100)).await;
        assert_eq!(
            count_remote(&r.kv, BIG as u64, POST_OUTCOME, AlignedBuf::new(8 << 20))
                .await
                .0,
            0,
            "a post-outcome byte landed"
        );
    });
}

#[test]
fn a_dropped_batch_drains_in_the_background() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let mut batch = Batch::new(Tcp, BatchOptions::default());
        batch
            .write(
                AlignedBuf::from_slice(&vec![5u8; BIG]),
                RemoteRange::new(&r.kv, 0, BIG as u64),
            )
            .ok()
            .unwrap();
        let sub = batch.submit();
        let h = spawn_local(sub);
        time::sleep(Duration::from_millis(2)).await;
        h.abort(); // drops the in-flight batch
        assert!(h.await.is_err());
        // It fences and drains on its own; the engine stays usable.
        time::sleep(Duration::from_millis(50)).await;
        let before = quiesce::runtime::stats();
        let mut b = Batch::new(Tcp, BatchOptions::default());
        b.write(vec![1u8; 4096], RemoteRange::new(&r.kv, 0, 4096))
            .ok()
            .unwrap();
        let q = b.submit().await.quiesced().await;
        assert!(q.all_completed());
        assert!(quiesce::runtime::stats().completions > before.completions);
    });
}

#[test]
fn fail_fast_fences_the_rest_while_drain_lets_it_finish() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        for policy in [FailurePolicy::FailFast, FailurePolicy::Drain] {
            let batch = seed_batch(
                &r,
                AlignedBuf::from_slice(&[1u8; 4096]),
                AlignedBuf::from_slice(&vec![2u8; BIG]),
                BatchOptions::default().policy(policy),
            );
            let q = match batch.submit().await {
                Outcome::Quiesced(q) => q,
                Outcome::CompletionUnknown(_) => panic!("a live target answers the fence"),
            };
            assert_eq!(q.sync_code(), -1);
            let st = &q.tasks()[0].status;
            assert!(
                matches!(st, TaskStatus::Failed(TransferError::Forbidden(_))),
                "{st:?}"
            );
            match policy {
                // Both drivers see the refusal before the 64 MiB is pushed
                // (epoll bounds the bytes moved per reactor tick).
                FailurePolicy::FailFast => {
                    assert_eq!(q.tasks()[1].status, TaskStatus::Fenced);
                    assert!(q.fence_time().is_some());
                }
                FailurePolicy::Drain => {
                    assert_eq!(q.tasks()[1].status, TaskStatus::Completed);
                    assert_eq!(q.tasks()[1].bytes, BIG as u64);
                    assert!(q.fence_time().is_none());
                }
            }
        }
    });
}

#[test]
fn retries_happen_after_quiescence_and_only_for_failed_tasks() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        // A connection reset mid-batch makes the slices fail retryably.
        let mut batch = Batch::new(
            Tcp,
            BatchOptions::default().retry(3, Duration::from_millis(5)),
        );
        batch
            .write(vec![3u8; 8 << 20], RemoteRange::new(&r.kv, 0, 8 << 20))
            .ok()
            .unwrap();
        batch
            .write(vec![4u8; 4096], RemoteRange::new(&r.kv, 16 << 20, 4096))
            .ok()
            .unwrap();
        let sub = spawn_local(batch.submit());
        time::sleep(Duration::from_micros(300)).await;
        r.kv.peer().abort();
        let q = sub.await.unwrap().quiesced().await;
        assert!(q.all_completed(), "{:?}", q.tasks());
        let buf = &q.buffers()[0];
        assert!(buf.iter().all(|&b| b == 3));
        assert!(q.tasks().iter().all(|t| t.attempts <= 4));
        assert!(
            q.tasks().iter().any(|t| t.attempts > 1),
            "the reset came too late to test a retry"
        );
    });
}

#[test]
fn bad_input_is_a_typed_error_and_loses_nothing() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let mut batch = Batch::new(Tcp, BatchOptions::default().max_tasks(1));
        let e = batch
            .write(vec![1u8; 10], RemoteRange::new(&r.kv, 0, 20))
            .err()
            .unwrap();
        assert_eq!(
            e.reason,
            quiesce::batch::BatchError::LengthMismatch { buf: 10, range: 20 }
        );
        assert_eq!(e.buf, vec![1u8; 10]);
        batch
            .write(vec![1u8; 20], RemoteRange::new(&r.kv, 0, 20))
            .ok()
            .unwrap();
        let e = batch
            .write(vec![2u8; 20], RemoteRange::new(&r.kv, 0, 20))
            .err()
            .unwrap();
        assert_eq!(e.reason, quiesce::batch::BatchError::TooLarge { max: 1 });
        assert_eq!(e.buf, vec![2u8; 20]);
    });
}

#[test]
fn tickets_drain_while_the_target_runs_even_with_a_tiny_grace() {
    // A tiny grace makes the driver tear its own connections down mid-read;
    // every outcome must still come, and every -2 ticket must drain.
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let mut unknown = 0;
        for round in 0..16u64 {
            let opts = BatchOptions::default()
                .policy(FailurePolicy::FailFast)
                .deadline(Duration::from_millis(1 + round % 3))
                .fence_grace(Duration::from_millis(round % 2));
            let mut batch = Batch::new(Tcp, opts);
            batch
                .read(AlignedBuf::new(BIG), RemoteRange::new(&r.kv, 0, BIG as u64))
                .ok()
                .unwrap();
            let outcome = time::timeout(Duration::from_secs(2), batch.submit())
                .await
                .unwrap_or_else(|_| panic!("round {round}: no outcome 2 s past the deadline"));
            let q = match outcome {
                Outcome::Quiesced(q) => q,
                Outcome::CompletionUnknown(ticket) => {
                    unknown += 1;
                    ticket
                        .wait_for(Duration::from_secs(2))
                        .await
                        .unwrap_or_else(|_| {
                            panic!("round {round}: the ticket never drained though the target runs")
                        })
                }
            };
            assert_eq!(q.buffers().len(), 1, "round {round}: the buffer comes back");
        }
        eprintln!("{unknown}/16 rounds were CompletionUnknown; every ticket drained");
    });
}

/// A Drain batch of one 64 MiB write, one retry allowed; its connections are
/// torn down mid-write (no fence), with the target stopped or running.
///
/// On a loaded machine this thread can lose the CPU for longer than the
/// whole write takes; a stopped round whose write finished before the stop
/// tested nothing, so it goes again with an earlier stop.
async fn torn_down_write(t: &Target, r: &Remote<RemoteSegment>, stop: bool) -> Quiesced<Vec<u8>> {
    for round in 0..8 {
        let opts = BatchOptions::default()
            .retry(1, Duration::from_millis(1))
            .fence_grace(Duration::from_millis(150));
        let batch = one_write(r, vec![6u8; BIG], opts);
        let sub = spawn_local(batch.submit());
        time::sleep(Duration::from_micros(3000 >> round)).await;
        if stop {
            t.signal(libc::SIGSTOP).unwrap();
        }
        r.kv.peer().abort();
        let q = sub.await.unwrap().quiesced().await;
        if stop {
            t.signal(libc::SIGCONT).unwrap();
            if q.tasks()[0].status == TaskStatus::Completed && q.tasks()[0].attempts == 1 {
                continue;
            }
        }
        return q;
    }
    panic!("every write finished before the target stopped");
}

#[test]
fn a_retry_goes_out_only_after_the_target_confirmed_the_torn_down_attempt() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        // Stopped: the fence after the teardown cannot be acknowledged, so
        // the old attempt's bytes may still land — no retry, and the report says so.
        let q = torn_down_write(&t, &r, true).await;
        let task = &q.tasks()[0];
        assert!(
            matches!(
                task.status,
                TaskStatus::Failed(TransferError::ConnectionLost(_))
            ),
            "{task:?}"
        );
        assert_eq!(task.remote, RemoteState::Unconfirmed, "{task:?}");
        assert!(!q.remote_confirmed());
        assert_eq!(
            task.attempts, 1,
            "retried over an unconfirmed attempt: {task:?}"
        );
        // Running: the fence is acknowledged, the retry goes out and completes.
        let q = torn_down_write(&t, &r, false).await;
        let task = &q.tasks()[0];
        assert_eq!(task.status, TaskStatus::Completed, "{task:?}");
        assert!(q.remote_confirmed());
        if task.attempts > 1 {
            assert!(q.buffers()[0].iter().all(|&b| b == 6));
        }
    });
}

#[test]
fn revoke_leaves_no_stale_byte_of_an_unconfirmed_batch() {
    let mut t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let mut stale_rounds = 0;
        for round in 0..20 {
            let r = stale_bytes_round(&mut t, BIG, true, LocalMode::Off)
                .await
                .unwrap();
            let (confirmed, stale) = (r.a_confirmed, r.stale_bytes);
            assert!(
                !confirmed,
                "round {round}: a stopped target confirmed nothing"
            );
            stale_rounds += (stale > 0) as u32;
            assert_eq!(
                stale, 0,
                "round {round}: {stale} bytes of A landed after revoke"
            );
        }
        assert_eq!(stale_rounds, 0);
    });
}

#[test]
fn without_revoke_the_outcome_says_the_target_did_not_confirm() {
    let mut t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        for round in 0..3 {
            let r = stale_bytes_round(&mut t, BIG, false, LocalMode::Off)
                .await
                .unwrap();
            let (confirmed, stale) = (r.a_confirmed, r.stale_bytes);
            assert!(
                !confirmed,
                "round {round}: claims confirmation from a stopped target"
            );
            eprintln!("round {round}: {stale} of A's bytes over B's without revoke");
        }
    });
}

#[test]
fn a_fence_lost_with_the_teardown_is_sent_again_and_confirms() {
    // Stopped past half the grace, the target's control connection is torn
    // down with the rest and the first fence fails; it resumes before the
    // grace ends, so a fence sent again is acknowledged.
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let opts = BatchOptions::default()
            .policy(FailurePolicy::FailFast)
            .deadline(Duration::from_millis(10))
            .fence_grace(Duration::from_millis(400));
        let batch = one_write(&r, vec![8u8; BIG], opts);
        let sub = batch.submit();
        time::sleep(Duration::from_millis(3)).await;
        t.signal(libc::SIGSTOP).unwrap();
        let pid = t.pid();
        let resume = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            // SAFETY: kill(2) takes no pointers.
            unsafe { libc::kill(pid, libc::SIGCONT) };
        });
        let q = sub.await;
        resume.join().unwrap();
        let q = q.quiesced().await;
        assert!(!q.all_completed());
        assert!(
            q.remote_confirmed(),
            "the fence sent again after the teardown was not acknowledged: {:?}",
            q.tasks()
        );
    });
}
