//! Shards: pinned runtimes, cross-shard channels, shutdown that drains.

mod common;

use std::rc::Rc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use quiesce_runtime::shard::{channel, Shards};
use quiesce_runtime::{spawn_local, stats, Stats};

#[test]
fn shards_run_on_their_own_threads_and_cores() {
    let shards = Shards::builder()
        .count(2)
        .spawn(|shard| async move {
            shard.shutdown_requested().await;
            (
                shard.index(),
                shard.core(),
                std::thread::current().name().map(str::to_owned),
            )
        })
        .unwrap();
    assert_eq!(shards.len(), 2);
    let out: Vec<_> = shards.shutdown().into_iter().map(Result::unwrap).collect();
    for (i, (index, core, name)) in out.into_iter().enumerate() {
        assert_eq!(index, i);
        assert!(core.is_some());
        assert_eq!(name.as_deref(), Some(format!("quiesce-shard-{i}").as_str()));
    }
}

#[test]
fn a_message_wakes_a_parked_shard() {
    let (tx, rx) = channel::<u64>();
    let rx = Arc::new(Mutex::new(Some(rx)));
    let txs = Arc::new(Mutex::new(Some(tx)));
    let shards = Shards::builder()
        .count(2)
        .spawn(move |shard| {
            let rx = rx.clone();
            let txs = txs.clone();
            async move {
                if shard.index() == 1 {
                    let mut rx = rx.lock().unwrap().take().unwrap();
                    let mut sum = 0;
                    // Parked with nothing else to do: only the sender's wake gets it going.
                    while let Some(v) = rx.recv().await {
                        sum += v;
                    }
                    sum
                } else {
                    let tx = txs.lock().unwrap().take().unwrap();
                    for v in 1..=10 {
                        quiesce_runtime::time::sleep(Duration::from_millis(2)).await;
                        tx.send(v).unwrap();
                    }
                    drop(tx);
                    shard.shutdown_requested().await;
                    0
                }
            }
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(100));
    let out: Vec<u64> = shards.shutdown().into_iter().map(Result::unwrap).collect();
    assert_eq!(out, vec![0, 55]);
}

#[test]
fn shutdown_cancels_and_reaps_every_in_flight_op() {
    let out: Arc<Mutex<Vec<Option<Stats>>>> = Arc::default();
    let o2 = out.clone();
    let shards = Shards::builder()
        .count(2)
        .spawn(move |shard| {
            let out = o2.clone();
            async move {
                let (a, b) = pair().await;
                let uring = stats().ops_submitted > 0;
                for _ in 0..4 {
                    let b = Rc::clone(&b);
                    let buf = Tracked::reporting(4096, out.clone());
                    spawn_local(async move {
                        let _ = b.read(buf).await;
                        unreachable!("nobody writes");
                    });
                }
                settle().await;
                shard.shutdown_requested().await;
                drop(a);
                uring
            }
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let uring: Vec<bool> = shards.shutdown().into_iter().map(Result::unwrap).collect();
    let out = out.lock().unwrap();
    assert_eq!(
        out.len(),
        8,
        "every buffer released exactly once, none leaked"
    );
    if uring.iter().all(|u| *u) {
        for s in out.iter() {
            let s = s.expect("released inside its runtime, during the drain");
            assert!(
                s.parked_released > 0,
                "released before its cancelled CQE was reaped"
            );
        }
    }
}

/// Shards dropped without `shutdown` (an early return, a panic in the
/// caller) still get asked to stop, so their threads and rings end.
#[test]
fn dropped_shards_are_asked_to_stop() {
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    let tx = Mutex::new(tx);
    let shards = Shards::builder()
        .count(2)
        .pin(false)
        .spawn(move |shard| {
            let tx = tx.lock().unwrap().clone();
            async move {
                shard.shutdown_requested().await;
                tx.send(shard.index()).unwrap();
            }
        })
        .unwrap();
    drop(shards);
    let mut stopped: Vec<usize> = (0..2)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(5))
                .expect("a shard never stopped")
        })
        .collect();
    stopped.sort();
    assert_eq!(stopped, [0, 1]);
}

#[test]
fn pinning_to_a_core_past_the_cpu_set_is_an_error() {
    let e = quiesce_runtime::shard::pin_current_thread(1 << 16).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::InvalidInput);
}

/// A shard whose runtime could not drain (an operation, or memory it holds
/// for the kernel or a peer, still live at its end) answers an error from
/// `shutdown`, so its caller never frees memory lent to it on a guess. Its
/// runtime's verdict was dropped and `shutdown` answered its output.
#[test]
fn a_shard_that_could_not_drain_says_so() {
    let shards = Shards::builder()
        .count(1)
        .pin(false)
        .spawn(|shard| async move {
            quiesce_runtime::strand(vec![0u8; 64]);
            shard.shutdown_requested().await;
        })
        .unwrap();
    let out = shards.shutdown();
    let err = out[0].as_ref().expect_err("an undrained shard answered Ok");
    let why = err.downcast_ref::<String>().expect("a message");
    assert!(why.contains("still in flight"), "{why}");
}

/// Every task waiting for the shutdown request is woken by it, not only
/// the one that asked last: a root that shares its `ShardContext` with the
/// tasks it started, and waits for them, ends. (One waker was kept, each
/// wait replacing the one before, and the shutdown hung in `join`.)
#[test]
fn a_shutdown_request_wakes_every_task_waiting_for_it() {
    let (tx, rx) = std::sync::mpsc::channel::<usize>();
    let tx = Mutex::new(tx);
    let shards = Shards::builder()
        .count(1)
        .pin(false)
        .spawn(move |shard| {
            let tx = tx.lock().unwrap().clone();
            async move {
                let shard = Rc::new(shard);
                let waiting: Vec<_> = (0..3)
                    .map(|_| {
                        let shard = shard.clone();
                        spawn_local(async move { shard.shutdown_requested().await })
                    })
                    .collect();
                for w in waiting {
                    w.await.unwrap();
                }
                tx.send(shard.index()).unwrap();
            }
        })
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    let asking = std::thread::spawn(move || shards.shutdown().len());
    assert_eq!(
        rx.recv_timeout(Duration::from_secs(5)),
        Ok(0),
        "the root never saw every task end"
    );
    assert_eq!(asking.join().unwrap(), 1);
}

/// A value is either refused by `send` (it comes back) or queued before the
/// receiver went, and a receiver that goes drops what it left queued at
/// once: nothing waits for the last sender to be dropped (a reply channel
/// inside a queued request would otherwise keep its requester waiting).
#[test]
fn a_dropped_receiver_drops_what_it_left_queued_and_refuses_the_rest() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    struct Counted(Arc<AtomicUsize>);
    impl Drop for Counted {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    // Left queued: dropped with the receiver, the sender still alive.
    let dropped = Arc::new(AtomicUsize::new(0));
    let (tx, rx) = channel::<Counted>();
    tx.send(Counted(dropped.clone()))
        .ok()
        .expect("the receiver is alive");
    drop(rx);
    assert_eq!(
        dropped.load(Ordering::SeqCst),
        1,
        "a value left queued outlived its receiver"
    );
    let back = tx.send(Counted(dropped.clone()));
    assert!(back.is_err(), "a send after the receiver went was taken");
    drop(back);
    assert_eq!(dropped.load(Ordering::SeqCst), 2);

    // Racing the drop: once the receiver's drop returned, every value
    // `send` took is dropped, while its sender lives on.
    for _ in 0..200 {
        let dropped = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = channel::<Counted>();
        let d = dropped.clone();
        let sender = std::thread::spawn(move || {
            let mut taken = 0;
            loop {
                match tx.send(Counted(d.clone())) {
                    Ok(()) => taken += 1,
                    Err(refused) => {
                        drop(refused);
                        return (taken, tx);
                    }
                }
            }
        });
        std::thread::yield_now();
        drop(rx);
        let (taken, tx) = sender.join().unwrap();
        // The first refusal is counted too.
        assert_eq!(
            dropped.load(Ordering::SeqCst),
            taken + 1,
            "a value taken by send outlived the receiver"
        );
        drop(tx);
    }
}
