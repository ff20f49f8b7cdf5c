//! A finished batch's hand-off (where its driver publishes the outcome) is
//! kept for the thread's next batch, so a small batch allocates nothing for
//! it. Only one that nothing else holds may be reused: a batch dropped in
//! flight goes on in the reactor with its hand-off, and a
//! `CompletionUnknown` ticket holds its own. Were either reused, a later
//! batch would receive the earlier batch's buffers, or its wake-ups.

use std::time::Duration;

use quiesce_batch::sim::{Sim, SimBuf, SimConfig, SimTarget};
use quiesce_batch::{Batch, BatchOptions, Outcome};
use quiesce_runtime::time::{sleep, timeout};
use quiesce_runtime::Runtime;

/// Transfers that always complete, after 1 to 6 reactor turns.
fn sim() -> Sim {
    Sim::new(11, SimConfig::reliable(6))
}

fn batch(sim: &Sim, ids: &[usize], opts: BatchOptions) -> Batch<Sim, SimBuf> {
    let mut b = Batch::new(sim.clone(), opts);
    for &id in ids {
        b.write(SimBuf::new(id, 64), SimTarget { peer: 0, len: 64 })
            .ok()
            .unwrap();
    }
    b
}

/// Every awaited batch gets back exactly its own buffers, while batches
/// dropped in flight (still running, with their hand-offs) and finished
/// ones (whose hand-offs are reused) come and go between them.
#[test]
fn each_batch_gets_its_own_buffers_while_hand_offs_are_reused() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let sim = sim();
        let mut next = 0;
        for round in 0..60 {
            // One dropped in flight: its driver goes on in the reactor and
            // publishes into its own hand-off once it drains.
            let ids: Vec<usize> = (next..next + 1 + round % 3).collect();
            next += ids.len();
            drop(batch(&sim, &ids, BatchOptions::default()).submit());
            // One awaited: its buffers, and only its, come back.
            let ids: Vec<usize> = (next..next + 1 + round % 2).collect();
            next += ids.len();
            let sub = batch(&sim, &ids, BatchOptions::default()).submit();
            let q = timeout(Duration::from_secs(5), async { sub.await.quiesced().await })
                .await
                .expect("the batch resolved");
            assert!(q.all_completed(), "{:?}", q.tasks());
            let back: Vec<usize> = q.into_buffers().map(|b| b.id).collect();
            assert_eq!(back, ids, "round {round}: another batch's buffers");
        }
        // The dropped batches drain in the reactor.
        sleep(Duration::from_millis(50)).await;
    });
}

/// A ticket's hand-off stays the ticket's: batches that finish while it is
/// held do not take it, and waiting on it yields its own batch's buffers.
#[test]
fn a_ticket_keeps_its_hand_off_while_later_batches_finish() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        // Transfers that ignore fences, run for up to 2,000 turns and are
        // slow to come back when aborted: past a 1 ms deadline and a 1 ms
        // grace, the outcome is a ticket.
        let cfg = SimConfig {
            stuck_fence: 100,
            deaf: 100,
            sticky: 100,
            ..SimConfig::reliable(2000)
        };
        let stuck = Sim::new(3, cfg);
        let opts = BatchOptions::default()
            .deadline(Duration::from_millis(1))
            .fence_grace(Duration::from_millis(1));
        let mut tickets = Vec::new();
        for id in 1000..1008 {
            if let Outcome::CompletionUnknown(t) = batch(&stuck, &[id], opts).submit().await {
                tickets.push((id, t));
            }
        }
        assert!(!tickets.is_empty(), "no batch outlived its grace");
        let sim = sim();
        for id in 0..40 {
            let q = batch(&sim, &[id], BatchOptions::default())
                .submit()
                .await
                .quiesced()
                .await;
            assert_eq!(q.into_buffers().map(|b| b.id).collect::<Vec<_>>(), [id]);
        }
        for (id, t) in tickets {
            let q = timeout(Duration::from_secs(10), t.wait())
                .await
                .expect("the stuck batch drained");
            assert_eq!(q.into_buffers().map(|b| b.id).collect::<Vec<_>>(), [id]);
        }
    });
}
