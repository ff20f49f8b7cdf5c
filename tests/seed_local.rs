//! The seed scenario and its variants over the local transport (the target
//! copies from and to this process by cross-memory attach), with the target
//! in its own process: the contract as over TCP, and one thing more — a
//! buffer the target could still reach never comes back while it is
//! stopped.

use std::path::Path;
use std::time::{Duration, Instant};

use quiesce::batch::{
    Batch, BatchOptions, FailurePolicy, Outcome, RemoteRange, RemoteState, TaskStatus, Tcp,
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

fn spawn_target() -> TargetChild {
    TargetChild::spawn(Path::new(env!("CARGO_BIN_EXE_quiesce")), BIG, false).unwrap()
}

async fn remote(t: &TargetChild, refuse: &str) -> (Engine, Remote<RemoteSegment>) {
    let e = Engine::bind(EngineConfig {
        local: LocalMode::Required,
        ..EngineConfig::default()
    })
    .unwrap();
    let peer = e.connect(t.addr).await.unwrap();
    let r = Remote {
        kv: peer.open("kv", t.tokens["kv"]).await.unwrap(),
        refuse: peer.open(refuse, t.tokens[refuse]).await.unwrap(),
    };
    assert!(peer.is_local(), "a target on this host is attached");
    (e, r)
}

fn bufs() -> Bufs<AlignedBuf> {
    Bufs {
        big: AlignedBuf::new(BIG),
        probe: AlignedBuf::new(4096),
        scratch: AlignedBuf::new(8 << 20),
    }
}

#[test]
fn seed_scenario_20_rounds_no_post_outcome_byte_lands() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let mut bufs = bufs();
        let mut corrupted = 0;
        for round in 0..20 {
            let (res, b) =
                write_round(&r, bufs, round, seed_options(), Duration::from_millis(10)).await;
            bufs = b;
            assert_ne!(
                res.kind,
                Kind::Completed,
                "the refused write fails the batch"
            );
            corrupted += (res.corrupted_bytes > 0) as u32;
        }
        assert_eq!(corrupted, 0, "corrupted: {corrupted}/20");
    });
}

#[test]
fn read_mirror_no_remote_byte_lands_after_the_outcome() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "wo").await;
        let mut bufs = bufs();
        for round in 0..5 {
            let (res, b) = read_round(&r, bufs, seed_options(), Duration::from_millis(10)).await;
            bufs = b;
            assert_ne!(res.kind, Kind::Completed);
            assert_eq!(res.corrupted_bytes, 0, "round {round}");
        }
    });
}

/// A deadline with the target stopped: the outcome comes on time, but it
/// cannot hand the buffer back — the stopped target would copy it when it
/// wakes — so it is completion unknown, and its ticket drains only after
/// the target resumed and let go.
#[test]
fn a_deadline_with_the_target_stopped_keeps_the_buffer_until_it_let_go() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let opts = BatchOptions::default()
            .policy(FailurePolicy::FailFast)
            .deadline(Duration::from_millis(30))
            .fence_grace(Duration::from_millis(200));
        // On a loaded machine this thread can lose the CPU for longer than
        // the target takes to copy all 64 MiB; a round that completed before
        // the stop tested nothing, so it goes again with an earlier stop.
        let mut round = 0;
        let outcome = loop {
            assert!(round < 8, "every write finished before the target stopped");
            let batch = one_write(&r, AlignedBuf::from_slice(&vec![7u8; BIG]), opts);
            let sub = batch.submit();
            time::sleep(Duration::from_micros(3000 >> round)).await;
            t.signal(libc::SIGSTOP).unwrap();
            let started = Instant::now();
            let outcome = sub.await;
            assert!(
                started.elapsed() < Duration::from_secs(2),
                "an outcome on time"
            );
            if outcome.sync_code() != 0 {
                break outcome;
            }
            t.signal(libc::SIGCONT).unwrap();
            round += 1;
        };
        let code = outcome.sync_code();
        assert!(
            code == -1 || code == -2,
            "a stopped target cannot complete: {code}"
        );
        let ticket = spawn_local(outcome.quiesced());
        time::sleep(Duration::from_millis(500)).await;
        assert!(
            !ticket.is_finished(),
            "the buffer came back while the stopped target could still copy it"
        );
        t.signal(libc::SIGCONT).unwrap();
        let q = ticket.await.unwrap();
        assert!(!q.all_completed());
        let mut src = q.into_buffers().next_back().unwrap();
        src.fill(POST_OUTCOME);
        time::sleep(Duration::from_millis(100)).await;
        let (late, _) =
            count_remote(&r.kv, BIG as u64, POST_OUTCOME, AlignedBuf::new(8 << 20)).await;
        assert_eq!(late, 0, "a post-outcome byte landed");
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
            assert!(
                matches!(
                    q.tasks()[0].status,
                    TaskStatus::Failed(TransferError::Forbidden(_))
                ),
                "{:?}",
                q.tasks()[0]
            );
            assert!(q.remote_confirmed(), "{:?}", q.tasks());
            match policy {
                FailurePolicy::FailFast => {
                    // Fenced between two of the target's chunks: whatever
                    // landed before is reported, nothing after.
                    assert!(q.fence_time().is_some());
                    assert_eq!(q.tasks()[1].status, TaskStatus::Fenced, "{:?}", q.tasks());
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
fn a_retry_goes_out_only_after_the_target_let_go_of_the_torn_down_attempt() {
    let t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let opts = BatchOptions::default()
            .retry(1, Duration::from_millis(1))
            .fence_grace(Duration::from_millis(150));
        let batch = one_write(&r, vec![6u8; BIG], opts);
        let sub = spawn_local(batch.submit());
        time::sleep(Duration::from_millis(3)).await;
        r.kv.peer().abort();
        let q = sub.await.unwrap().quiesced().await;
        let task = &q.tasks()[0];
        assert_eq!(task.status, TaskStatus::Completed, "{task:?}");
        assert_ne!(task.remote, RemoteState::Unconfirmed, "{task:?}");
        assert!(q.remote_confirmed());
        assert!(q.buffers()[0].iter().all(|&b| b == 6));
    });
}

#[test]
fn revoke_leaves_no_stale_byte_of_an_unconfirmed_batch() {
    let mut t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        for round in 0..5 {
            let r = stale_bytes_round(&mut t, BIG, true, LocalMode::Required)
                .await
                .unwrap();
            assert!(
                !r.a_confirmed,
                "round {round}: a stopped target confirmed nothing"
            );
            assert_eq!(r.stale_bytes, 0, "round {round}: stale bytes after revoke");
        }
    });
}

#[test]
fn a_killed_target_gives_an_outcome_never_a_hang() {
    let mut t = spawn_target();
    Runtime::new().unwrap().block_on(async {
        let (_e, r) = remote(&t, "ro").await;
        let mut batch = Batch::new(Tcp, BatchOptions::default());
        batch
            .write(vec![9u8; BIG], RemoteRange::new(&r.kv, 0, BIG as u64))
            .ok()
            .unwrap();
        let sub = batch.submit();
        time::sleep(Duration::from_millis(2)).await;
        t.kill();
        let outcome = time::timeout(Duration::from_secs(5), sub)
            .await
            .expect("an outcome, never a hang");
        let q = time::timeout(Duration::from_secs(5), outcome.quiesced())
            .await
            .expect("a dead target holds nothing");
        assert_eq!(q.buffers().len(), 1, "the buffer comes back");
    });
}
