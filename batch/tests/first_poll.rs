//! `submit` polls the driver once with the submitting task's waker, and
//! the `Submitted`'s first poll skips polling it again only while nothing
//! can have happened since (the same poll of the same task, not woken, the
//! same waker). Awaited later, or through a waker of its own, the batch
//! must still be polled and resolve.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll, Wake, Waker};
use std::time::Duration;

use quiesce_batch::sim::{Sim, SimBuf, SimConfig, SimTarget};
use quiesce_batch::{Batch, BatchOptions, Outcome, Submitted};
use quiesce_runtime::time::{sleep, timeout};
use quiesce_runtime::Runtime;

/// Transfers that always complete, after 1 to 6 reactor turns.
fn sim() -> Sim {
    Sim::new(7, SimConfig::reliable(6))
}

fn one_write(sim: &Sim, id: usize) -> Submitted<SimBuf> {
    let mut batch = Batch::new(sim.clone(), BatchOptions::default());
    batch
        .write(SimBuf::new(id, 64), SimTarget { peer: 0, len: 64 })
        .ok()
        .unwrap();
    batch.submit()
}

/// Awaits `sub` (5 s at most) and checks that its write completed.
async fn completes(sub: impl Future<Output = Outcome<SimBuf>>) {
    let q = timeout(Duration::from_secs(5), sub)
        .await
        .expect("the batch resolved")
        .quiesced()
        .await;
    assert!(q.all_completed(), "{:?}", q.tasks());
}

#[test]
fn a_batch_awaited_after_its_task_slept_still_resolves() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let sim = sim();
        for id in 0..20 {
            let sub = one_write(&sim, id);
            // The task is woken (the transfers' turns) and polled again
            // while the batch is not awaited.
            sleep(Duration::from_millis(5)).await;
            completes(sub).await;
        }
    });
}

/// Polls its future only when the future's own waker fired (as
/// `FuturesUnordered` does), or on the first poll.
struct OwnWaker<F> {
    fut: Pin<Box<F>>,
    flag: Arc<Flag>,
    first: bool,
}

struct Flag {
    fired: AtomicBool,
    parent: Mutex<Option<Waker>>,
}

impl Wake for Flag {
    fn wake(self: Arc<Self>) {
        self.fired.store(true, Ordering::Release);
        if let Some(w) = self.parent.lock().unwrap().take() {
            w.wake();
        }
    }
}

impl<F: Future> Future for OwnWaker<F> {
    type Output = F::Output;
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        *self.flag.parent.lock().unwrap() = Some(cx.waker().clone());
        let first = std::mem::replace(&mut self.first, false);
        if !first && !self.flag.fired.swap(false, Ordering::AcqRel) {
            return Poll::Pending;
        }
        let w = Waker::from(self.flag.clone());
        self.fut.as_mut().poll(&mut Context::from_waker(&w))
    }
}

#[test]
fn a_batch_polled_at_once_through_a_waker_of_its_own_still_resolves() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let sim = sim();
        for id in 0..20 {
            let sub = OwnWaker {
                fut: Box::pin(one_write(&sim, id)),
                flag: Arc::new(Flag {
                    fired: AtomicBool::new(false),
                    parent: Mutex::new(None),
                }),
                first: true,
            };
            completes(sub).await;
        }
    });
}

#[test]
fn a_batch_awaited_at_once_resolves_and_spawned_ones_too() {
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let sim = sim();
        for id in 0..20 {
            completes(one_write(&sim, id)).await;
            // Submitted in one task, awaited in another.
            let sub = one_write(&sim, 100 + id);
            let h = quiesce_runtime::spawn_local(async move {
                timeout(Duration::from_secs(5), sub).await.is_ok()
            });
            assert!(h.await.unwrap(), "the batch resolved in the other task");
        }
    });
}
