//! Executor: block_on, spawn_local, JoinHandle, cross-thread wakers, budget.

mod common;

use std::cell::Cell;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use quiesce_runtime::{spawn_local, yield_now, DriverKind, JoinError, Runtime};

#[test]
fn block_on_returns_the_value() {
    assert_eq!(rt().block_on(async { 7 }), 7);
}

#[test]
fn driver_follows_quiesce_driver_env() {
    let rt = rt();
    match std::env::var("QUIESCE_DRIVER").as_deref() {
        Ok("io_uring") => assert_eq!(rt.driver_kind(), DriverKind::IoUring),
        Ok("epoll") => assert_eq!(rt.driver_kind(), DriverKind::Epoll),
        _ => assert_ne!(rt.driver_kind(), DriverKind::Auto),
    }
    let forced = Runtime::builder()
        .driver(DriverKind::Epoll)
        .build()
        .unwrap();
    assert_eq!(forced.driver_kind(), DriverKind::Epoll);
}

#[test]
fn spawned_tasks_run_and_join() {
    let out = rt().block_on(async {
        let handles: Vec<_> = (0..100u64)
            .map(|i| spawn_local(async move { i * 2 }))
            .collect();
        let mut sum = 0;
        for h in handles {
            sum += h.await.unwrap();
        }
        sum
    });
    assert_eq!(out, (0..100u64).map(|i| i * 2).sum());
}

#[test]
fn abort_cancels_a_task_and_drops_its_future() {
    let dropped = Rc::new(Cell::new(false));
    struct OnDrop(Rc<Cell<bool>>);
    impl Drop for OnDrop {
        fn drop(&mut self) {
            self.0.set(true);
        }
    }
    let d = dropped.clone();
    let res = rt().block_on(async move {
        let h = spawn_local(async move {
            let _guard = OnDrop(d);
            quiesce_runtime::time::sleep(Duration::from_secs(3600)).await;
        });
        yield_now().await;
        h.abort();
        h.await
    });
    assert!(matches!(res, Err(JoinError::Cancelled)));
    assert!(dropped.get());
}

#[test]
fn a_panicking_task_reports_through_its_handle() {
    let res = rt().block_on(async { spawn_local(async { panic!("boom") }).await });
    match res {
        Err(JoinError::Panicked(p)) => assert_eq!(p.downcast_ref::<&str>(), Some(&"boom")),
        other => panic!("expected a panic, got {:?}", other.map(|_: ()| ())),
    }
}

#[test]
fn wakers_work_from_other_threads_while_parked() {
    let rt = rt();
    let flag = Arc::new(AtomicBool::new(false));
    let f2 = flag.clone();
    let woke = rt.block_on(async move {
        std::future::poll_fn(|cx| {
            if f2.load(Ordering::SeqCst) {
                return std::task::Poll::Ready(true);
            }
            let (w, f) = (cx.waker().clone(), f2.clone());
            if !f.swap(false, Ordering::SeqCst) {
                std::thread::spawn(move || {
                    // The runtime is parked with no timer: only this wake can end the wait.
                    std::thread::sleep(Duration::from_millis(50));
                    f.store(true, Ordering::SeqCst);
                    w.wake();
                });
            }
            std::task::Poll::Pending
        })
        .await
    });
    assert!(woke && flag.load(Ordering::SeqCst));
}

#[test]
fn a_busy_task_cannot_starve_io() {
    // One task yields in a loop until I/O completes; the I/O must still get through.
    let rt = rt();
    rt.block_on(async {
        let (a, b) = pair().await;
        let done = Rc::new(Cell::new(false));
        let d = done.clone();
        let spinner = spawn_local(async move {
            let mut spins = 0u64;
            while !d.get() {
                spins += 1;
                yield_now().await;
            }
            spins
        });
        let reader = spawn_local(async move {
            let (r, buf) = b.read(vec![0u8; 16]).await;
            assert_eq!(r.unwrap(), 5);
            assert_eq!(&buf[..5], b"hello");
            done.set(true);
        });
        let (r, _) = a.write_all(b"hello".to_vec()).await;
        r.unwrap();
        reader.await.unwrap();
        assert!(spinner.await.unwrap() > 0);
    });
}

#[test]
fn a_task_whose_ops_complete_at_once_still_yields() {
    // On epoll a recv on a socket with plenty of data completes during poll;
    // the op budget must force a yield so a timer still fires meanwhile.
    let rt = rt();
    rt.block_on(async {
        let (a, b) = pair().await;
        let (r, _) = a.write_all(vec![1u8; 1 << 20]).await;
        r.unwrap();
        let ticked = Rc::new(Cell::new(0u32));
        let t = ticked.clone();
        let timer = spawn_local(async move {
            for _ in 0..3 {
                yield_now().await;
                t.set(t.get() + 1);
            }
        });
        let mut got = 0;
        let mut buf = vec![0u8; 64];
        while got < 1 << 20 {
            let (r, b2) = b.read(buf).await;
            buf = b2;
            got += r.unwrap();
        }
        timer.await.unwrap();
        assert_eq!(ticked.get(), 3);
    });
}

#[test]
fn join_handle_of_a_finished_task_is_ready() {
    rt().block_on(async {
        let h = spawn_local(async { 5 });
        yield_now().await;
        yield_now().await;
        assert!(h.is_finished());
        assert_eq!(h.await.unwrap(), 5);
    });
}

/// A finished task stays finished once its output was taken (a poll of
/// the handle took it, and `is_finished` answered false again).
#[test]
fn a_task_whose_output_was_taken_is_still_finished() {
    rt().block_on(async {
        let mut h = spawn_local(async { 5 });
        assert_eq!((&mut h).await.unwrap(), 5);
        assert!(h.is_finished());
    });
}

#[test]
fn a_yielding_task_runs_once_per_reactor_turn() {
    // A task that yields in a loop must not be re-polled over and over before
    // the reactor runs: yield_now defers it past the next turn.
    let rt = rt();
    rt.block_on(async {
        let (a, b) = pair().await;
        let polls = Rc::new(Cell::new(0u64));
        let p = polls.clone();
        let spinner = spawn_local(async move {
            loop {
                p.set(p.get() + 1);
                yield_now().await;
            }
        });
        let echo = spawn_local(async move {
            for _ in 0..20 {
                let (r, buf) = b.read_exact(vec![0u8; 8]).await;
                r.unwrap();
                b.write_all(buf).await.0.unwrap();
            }
        });
        let before = polls.get();
        for i in 0..20u8 {
            a.write_all(vec![i; 8]).await.0.unwrap();
            let (r, _) = a.read_exact(vec![0u8; 8]).await;
            r.unwrap();
        }
        echo.await.unwrap();
        let per_round_trip = (polls.get() - before) / 20;
        assert!(
            per_round_trip <= 16,
            "spinner polled {per_round_trip} times per round trip"
        );
        spinner.abort();
    });
}

#[test]
fn a_finished_task_kept_waker_never_polls_a_later_task() {
    use std::cell::RefCell;
    use std::task::{Poll, Waker};
    rt().block_on(async {
        // A finishes with a clone of its waker kept outside it.
        let kept: Rc<RefCell<Option<Waker>>> = Rc::default();
        let k = kept.clone();
        spawn_local(std::future::poll_fn(move |cx| {
            *k.borrow_mut() = Some(cx.waker().clone());
            Poll::Ready(())
        }))
        .await
        .unwrap();
        // B is spawned after it, and pends forever.
        let polls = Rc::new(Cell::new(0u32));
        let p = polls.clone();
        let b = spawn_local(std::future::poll_fn(move |_| {
            p.set(p.get() + 1);
            Poll::<()>::Pending
        }));
        yield_now().await;
        yield_now().await;
        assert_eq!(polls.get(), 1, "B polled once, at its spawn");
        // Waking A's old waker must not reach B.
        kept.borrow_mut().take().unwrap().wake();
        yield_now().await;
        yield_now().await;
        assert_eq!(polls.get(), 1, "A's waker polled B");
        b.abort();
    });
}

#[test]
fn a_task_poll_is_unwoken_only_in_its_own_poll_of_its_own_runtime() {
    use quiesce_runtime::TaskPoll;
    let (a, b) = (rt(), rt());
    let p = a.block_on(async {
        let p = TaskPoll::current().expect("inside block_on's poll");
        assert!(p.unwoken(), "nothing woke the task yet");
        assert!(
            p.wakes(&std::future::poll_fn(|cx| std::task::Poll::Ready(cx.waker().clone())).await)
        );
        p
    });
    assert!(!p.unwoken(), "outside any poll");
    // Another runtime's first poll has the same task id and poll number.
    b.block_on(async { assert!(!p.unwoken(), "a poll of another runtime") });
    a.block_on(async {
        let p = TaskPoll::current().unwrap();
        yield_now().await;
        assert!(!p.unwoken(), "a later poll of the same task");
        let q = TaskPoll::current().unwrap();
        let w = std::future::poll_fn(|cx| std::task::Poll::Ready(cx.waker().clone())).await;
        w.wake_by_ref();
        assert!(!q.unwoken(), "the task was woken during this poll");
    });
}

/// `tasks_ready`: whether another task of this runtime waits to run now —
/// what a task that polls a socket itself checks before spending a syscall
/// (the read-ahead's polling reader).
#[test]
fn tasks_ready_says_whether_another_task_waits_to_run() {
    use quiesce_runtime::tasks_ready;
    use std::cell::RefCell;
    use std::task::{Poll, Waker};

    assert!(!tasks_ready(), "outside a runtime");
    rt().block_on(async {
        assert!(!tasks_ready(), "nothing spawned");
        let h = spawn_local(async { tasks_ready() });
        assert!(tasks_ready(), "a spawned task waits for its first poll");
        // Main waits for it, so while it runs nothing else is queued.
        assert!(!h.await.unwrap(), "only the running task");

        // A task woken by this one is ready until it runs.
        let parked: Rc<RefCell<Option<Waker>>> = Rc::default();
        let woken = Rc::new(Cell::new(false));
        let (p, w) = (parked.clone(), woken.clone());
        let h = spawn_local(std::future::poll_fn(move |cx| {
            if w.get() {
                return Poll::Ready(());
            }
            *p.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }));
        while parked.borrow().is_none() {
            yield_now().await;
        }
        assert!(!tasks_ready(), "the other task is parked");
        woken.set(true);
        parked.take().unwrap().wake();
        assert!(tasks_ready(), "woken, not yet polled");
        h.await.unwrap();
        assert!(!tasks_ready(), "it ran to the end");
    });
}

/// A task whose future panics as it is dropped (after it finished, or when
/// aborted) reports that panic through its handle, as one that panics in a
/// poll does. The drop ran outside the poll's guard: the panic left the
/// runtime's turn (out of `block_on`), and the handle waited for good.
#[test]
fn a_task_whose_future_panics_when_dropped_reports_through_its_handle() {
    for abort in [false, true] {
        let rt = Runtime::new().unwrap();
        let turned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            rt.block_on(async {
                let h = spawn_local(PanicsOnDrop { pending: abort });
                yield_now().await;
                if abort {
                    h.abort();
                }
                quiesce_runtime::time::timeout(Duration::from_secs(1), h).await
            })
        }));
        match turned {
            Ok(Ok(Err(JoinError::Panicked(p)))) => {
                assert_eq!(p.downcast_ref::<&str>(), Some(&PANICS_ON_DROP))
            }
            Ok(other) => panic!("abort {abort}: the handle answered {other:?}"),
            Err(_) => panic!("abort {abort}: the drop's panic left the runtime's turn"),
        }
    }
}
