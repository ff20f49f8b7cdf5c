//! Timers: sleep, sleep_until, timeout; the nearest deadline bounds the park.

mod common;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::{Duration, Instant};

use common::*;
use quiesce_runtime::shard::channel;
use quiesce_runtime::time::{sleep, sleep_until, timeout, Elapsed};
use quiesce_runtime::{spawn_local, stats};

#[test]
fn sleep_lasts_at_least_its_duration() {
    rt().block_on(async {
        let t0 = Instant::now();
        sleep(Duration::from_millis(25)).await;
        assert!(t0.elapsed() >= Duration::from_millis(25));
    });
}

#[test]
fn timers_fire_in_deadline_order() {
    let order = Rc::new(RefCell::new(Vec::new()));
    let o = order.clone();
    rt().block_on(async move {
        let now = Instant::now();
        let hs: Vec<_> = [30u64, 10, 20, 0]
            .into_iter()
            .map(|ms| {
                let o = o.clone();
                spawn_local(async move {
                    sleep_until(now + Duration::from_millis(ms)).await;
                    o.borrow_mut().push(ms);
                })
            })
            .collect();
        for h in hs {
            h.await.unwrap();
        }
    });
    assert_eq!(*order.borrow(), vec![0, 10, 20, 30]);
}

#[test]
fn timeout_elapses_and_drops_the_future() {
    rt().block_on(async {
        let (_a, b) = pair().await;
        let r = timeout(Duration::from_millis(20), b.read(vec![0u8; 8])).await;
        assert!(matches!(r, Err(Elapsed)));
        let r = timeout(Duration::from_secs(5), async { 3 }).await;
        assert_eq!(r, Ok(3));
    });
}

#[test]
fn the_reactor_parks_until_the_nearest_deadline_only() {
    rt().block_on(async {
        let parks0 = stats().parks;
        let t0 = Instant::now();
        sleep(Duration::from_millis(50)).await;
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(50));
        // It blocked (rather than spinning) and woke by itself.
        let parks = stats().parks - parks0;
        assert!((1..20).contains(&parks), "parks: {parks}");
    });
}

#[test]
fn dropped_sleeps_unregister() {
    rt().block_on(async {
        for _ in 0..100 {
            let s = sleep(Duration::from_secs(3600));
            drop(s);
        }
        let mut s = sleep(Duration::from_secs(3600));
        s.reset(Instant::now() + Duration::from_millis(5));
        s.await;
    });
}

/// A timer whose waker panics when it fires takes no other timer due in
/// the same turn with it: the runtime had taken them all off its heap
/// before waking the first, and the rest were never woken — a deadline
/// that never came.
#[test]
fn a_waker_that_panics_loses_no_other_due_timer() {
    let rt = rt();
    let at = Instant::now() + Duration::from_millis(20);
    let fired = Rc::new(std::cell::Cell::new(false));
    let mut first = Box::pin(sleep_until(at));
    rt.block_on(async {
        let w = waker_that_panics_when_woken();
        let mut cx = std::task::Context::from_waker(&w);
        assert!(std::future::Future::poll(first.as_mut(), &mut cx).is_pending());
    });
    let f = fired.clone();
    let _later = rt.spawn_local(async move {
        sleep_until(at).await;
        f.set(true);
    });
    let woke = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(sleep(Duration::from_millis(100)))
    }));
    assert!(woke.is_err(), "the waker's panic comes out of the turn");
    rt.block_on(sleep(Duration::from_millis(50)));
    assert!(fired.get(), "the other timer due with it never fired");
    drop(first);
}

/// A sleep first polled on a runtime that is gone since still ends, on the
/// runtime that polls it now: it stayed registered with the dead one's
/// timers, which nothing fires any more, and waited for ever — as a batch's
/// deadline would. (An op outliving its runtime completes, DESIGN §4.4.)
#[test]
fn a_sleep_outliving_its_runtime_ends_on_the_next() {
    let mut s = Box::pin(sleep(Duration::from_millis(10)));
    let first = rt();
    first.block_on(std::future::poll_fn(|cx| {
        assert!(std::future::Future::poll(s.as_mut(), cx).is_pending());
        std::task::Poll::Ready(())
    }));
    drop(first);
    let done = rt().block_on(timeout(Duration::from_millis(500), s));
    assert!(done.is_ok(), "the sleep never ended on the next runtime");
}

/// A task of another runtime waiting on a sleep registered with a runtime
/// that then shuts down is woken by that shutdown, and its sleep ends on
/// its own runtime: the dead runtime's timers are never fired, and only a
/// fresh poll moved the sleep.
#[test]
fn a_task_waiting_on_a_sleep_of_a_runtime_that_shuts_down_is_woken() {
    let (first, second) = (rt(), rt());
    let mut s = Box::pin(sleep(Duration::from_millis(50)));
    first.block_on(std::future::poll_fn(|cx| {
        assert!(std::future::Future::poll(s.as_mut(), cx).is_pending());
        std::task::Poll::Ready(())
    }));
    let done = Rc::new(std::cell::Cell::new(false));
    let d = done.clone();
    let _waiting = second.spawn_local(async move {
        s.await;
        d.set(true);
    });
    // The task polled the sleep: its waker is in the first runtime's timers.
    second.block_on(sleep(Duration::from_millis(10)));
    drop(first);
    second.block_on(sleep(Duration::from_millis(200)));
    assert!(
        done.get(),
        "the task waiting on the dead runtime's sleep was never woken"
    );
}

/// A deadline centuries away (`now + 1000 years`, a common "never") is a
/// wait like any other. The io_uring reactor handed the whole span to
/// io_uring_enter, which adds it to the clock in nanoseconds: past ~292
/// years that sum leaves ktime's range, and a kernel that does not saturate
/// it times out at once, every park. With only that timer armed and the
/// task woken from another thread 100 ms later, the wait must take a
/// handful of turns, not hundreds of thousands.
#[test]
fn a_deadline_centuries_away_does_not_spin_the_reactor() {
    rt().block_on(async {
        let never = Instant::now() + Duration::from_secs(1000 * 365 * 86_400);
        let far = spawn_local(sleep_until(never));
        let (tx, mut rx) = channel::<()>();
        let waker = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(100));
            tx.send(()).expect("the receiver waits");
        });
        let before = stats().ticks;
        rx.recv().await.expect("sent");
        let turns = stats().ticks - before;
        waker.join().unwrap();
        assert!(turns < 50, "{turns} reactor turns in 100 ms");
        far.abort();
    });
}
