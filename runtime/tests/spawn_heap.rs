//! A warm runtime spawns a task with one allocation, its `JoinHandle`'s
//! shared state: the task's harness and future go into recycled blocks and
//! its waker is a finished task's (a 64-task batch spawns a task per
//! transfer, 64 at a time).
//!
//! Its own `main` (`harness = false`): the heap counters are process-wide,
//! and libtest's main thread allocates while a test runs.

use quiesce_runtime::heap::{CountingAlloc, Heap};
use quiesce_runtime::{spawn_local, yield_now, Runtime};

#[global_allocator]
static HEAP: CountingAlloc = CountingAlloc;

fn main() {
    a_warm_runtime_spawns_a_task_with_one_allocation();
    println!("test a_warm_runtime_spawns_a_task_with_one_allocation ... ok");
    a_task_that_yields_allocates_nothing_once_warm();
    println!("test a_task_that_yields_allocates_nothing_once_warm ... ok");
}

/// `yield_now` defers the task past the next reactor turn (a reader polling
/// its socket while the runtime spins does so once per poll): once warm,
/// the turn's list of deferred wakers is reused, not reallocated.
fn a_task_that_yields_allocates_nothing_once_warm() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        for _ in 0..100 {
            yield_now().await;
        }
        let before = Heap::now().allocations;
        for _ in 0..10_000 {
            yield_now().await;
        }
        let made = Heap::now().allocations - before;
        assert!(made < 10, "{made} allocations in 10,000 yields");
    });
}

/// Spawns `tasks` tasks that each yield twice (so they are polled, woken
/// and polled again through their wakers) and joins them: the sum of their
/// outputs, and the allocations made while spawning them.
async fn round(tasks: u64) -> (u64, u64) {
    let mut handles = Vec::with_capacity(tasks as usize);
    let before = Heap::now().allocations;
    handles.extend((0..tasks).map(|i| {
        spawn_local(async move {
            yield_now().await;
            yield_now().await;
            i
        })
    }));
    let made = Heap::now().allocations - before;
    let mut sum = 0;
    for h in handles {
        sum += h.await.expect("the task ran");
    }
    (sum, made)
}

fn a_warm_runtime_spawns_a_task_with_one_allocation() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        // Cold: the task, its harness, its future and its waker, and the
        // slab's and ready queue's growth.
        let (sum, cold) = round(64).await;
        assert_eq!(sum, 64 * 63 / 2);
        assert!(cold >= 4 * 64, "{cold} allocations for 64 cold spawns");
        // Warm: the free lists and the spare wakers serve them.
        for _ in 0..3 {
            let (sum, made) = round(64).await;
            assert_eq!(
                sum,
                64 * 63 / 2,
                "the tasks ran and woke through reused wakers"
            );
            assert_eq!(
                made, 64,
                "64 spawns on a warm runtime: one allocation each (the JoinHandle's state)"
            );
        }
    });
}
