//! A failed attempt's aftermath: a retry's backoff watches the deadline
//! and the caller dropping the batch, so no new attempt goes out once
//! either happened; and a failure with nothing left in flight fences
//! nothing.

use std::time::Duration;

use quiesce_batch::sim::{Sim, SimConfig, SimTarget};
use quiesce_batch::{Batch, BatchOptions, FailurePolicy, Outcome};
use quiesce_runtime::time::sleep;
use quiesce_runtime::{spawn_local, Runtime};

/// Every transfer fails as a lost connection (retryable), fences confirm.
fn failing() -> Sim {
    let cfg = SimConfig {
        retryable_fail: 100,
        ..SimConfig::reliable(2)
    };
    Sim::new(7, cfg)
}

fn one_write(sim: &Sim, opts: BatchOptions) -> Batch<Sim, Vec<u8>> {
    let mut b = Batch::new(sim.clone(), opts);
    b.write(vec![0u8; 64], SimTarget { peer: 0, len: 64 })
        .ok()
        .unwrap();
    b
}

#[test]
fn a_deadline_passing_during_a_backoff_sends_no_retry() {
    Runtime::new().unwrap().block_on(async {
        let sim = failing();
        let opts = BatchOptions::default()
            .deadline(Duration::from_millis(100))
            .fence_grace(Duration::from_millis(20))
            .retry(3, Duration::from_millis(300));
        let out = one_write(&sim, opts).submit().await;
        assert_eq!(
            sim.log().starts.len(),
            1,
            "a retry went out past the deadline"
        );
        // The failed attempt was fenced and confirmed: a clean -1, not the
        // unknown that a fence started past its whole grace ends in.
        match out {
            Outcome::Quiesced(q) => assert_eq!(q.sync_code(), -1),
            Outcome::CompletionUnknown(_) => panic!("the first attempt was confirmed"),
        }
    });
}

#[test]
fn a_batch_dropped_during_a_backoff_sends_no_retry() {
    Runtime::new().unwrap().block_on(async {
        let sim = failing();
        let opts = BatchOptions::default().retry(3, Duration::from_millis(200));
        let sub = one_write(&sim, opts).submit();
        let waiting = spawn_local(async move {
            let _ = sub.await;
        });
        // The attempt fails within a few turns; the backoff is under way.
        sleep(Duration::from_millis(50)).await;
        assert_eq!(sim.log().starts.len(), 1);
        waiting.abort();
        sleep(Duration::from_millis(400)).await;
        assert_eq!(sim.log().starts.len(), 1, "a dropped batch sent a retry");
        assert_eq!(sim.log().in_flight, 0);
    });
}

#[test]
fn a_failure_with_nothing_in_flight_fences_nothing() {
    Runtime::new().unwrap().block_on(async {
        let cfg = SimConfig {
            refused: 100,
            ..SimConfig::reliable(2)
        };
        let sim = Sim::new(7, cfg);
        let opts = BatchOptions::default().policy(FailurePolicy::FailFast);
        match one_write(&sim, opts).submit().await {
            Outcome::Quiesced(q) => {
                assert_eq!(q.sync_code(), -1);
                assert_eq!(q.fence_time(), None, "no transfer was left to fence");
            }
            Outcome::CompletionUnknown(_) => panic!("nothing was in flight"),
        }
    });
}

/// A read cut without its target's answer (a lost connection, a peer whose
/// fences never finish) left nothing that can land at the target: its
/// destination is the caller's buffer, back once the transfer quiesced.
/// It is retried once the fence's grace is over; a write so cut is not
/// retried (its bytes may still land). The read was never retried.
#[test]
fn a_read_cut_without_its_targets_answer_is_retried() {
    Runtime::new().unwrap().block_on(async {
        let cfg = SimConfig {
            retryable_fail: 50,
            stuck_fence: 100,
            ..SimConfig::reliable(2)
        };
        let opts = BatchOptions::default()
            .fence_grace(Duration::from_millis(20))
            .retry(8, Duration::from_millis(1));
        let sim = Sim::new(2, cfg);
        let mut b = Batch::new(sim.clone(), opts);
        b.read(vec![0u8; 64], SimTarget { peer: 0, len: 64 })
            .ok()
            .unwrap();
        let Outcome::Quiesced(q) = b.submit().await else {
            panic!("a read's buffer is the caller's once it quiesced");
        };
        // (This seed's first read is cut.)
        assert!(sim.log().starts.len() > 1, "not retried: {:?}", q.tasks());
        assert!(q.all_completed(), "{:?}", q.tasks());
        // The write mirror: cut so, it is not retried.
        let sim = Sim::new(2, cfg);
        let out = one_write(&sim, opts).submit().await;
        assert_eq!(
            sim.log().starts.len(),
            1,
            "a write retried over its residue"
        );
        assert_ne!(out.sync_code(), 0);
    });
}
