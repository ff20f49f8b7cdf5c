//! Dropping a batch's future in flight fences it: the transfers it leaves
//! running are cut short by the fence (or, past half its grace, by tearing
//! down their peers' connections) and drain in the reactor, rather than run
//! on to their natural end. A one-task batch's first attempt waits for its
//! transfer on a path of its own (`run.rs`), so both shapes are checked.

use std::time::{Duration, Instant};

use quiesce_batch::sim::{Sim, SimBuf, SimConfig, SimTarget};
use quiesce_batch::{Batch, BatchOptions};
use quiesce_runtime::{yield_now, Runtime};

#[test]
fn a_batch_dropped_in_flight_is_fenced_not_left_running() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        for tasks in [1, 3] {
            // Transfers of up to 50 million reactor turns (minutes), and
            // fences as slow: only the teardown at half the 20 ms grace
            // can end them in time.
            let sim = Sim::new(5, SimConfig::reliable(50_000_000));
            let opts = BatchOptions::default().fence_grace(Duration::from_millis(20));
            let mut batch = Batch::new(sim.clone(), opts);
            for id in 0..tasks {
                batch
                    .write(SimBuf::new(id, 64), SimTarget { peer: 0, len: 64 })
                    .ok()
                    .unwrap();
            }
            let sub = batch.submit();
            for _ in 0..3 {
                yield_now().await;
            }
            assert_eq!(sim.log().in_flight, tasks, "the transfers are running");
            drop(sub);
            let t0 = Instant::now();
            while sim.log().in_flight > 0 {
                assert!(
                    t0.elapsed() < Duration::from_secs(2),
                    "{tasks} task(s): a dropped batch's transfers ran on unfenced"
                );
                yield_now().await;
            }
            // Ended by the teardown (without their target's answer), not by
            // running to completion.
            assert_eq!(sim.log().residue.len(), tasks, "{tasks} task(s)");
            assert_eq!(sim.log().access_after_return, 0);
        }
    });
}
