//! Dropping an op, a task or a runtime while the kernel holds a buffer:
//! the buffer outlives the kernel's last completion for it.

mod common;

use std::time::Duration;

use common::*;
use quiesce_runtime::{spawn_local, stats, yield_now, Runtime};

#[test]
fn dropping_a_pending_recv_parks_its_buffer_until_the_cqe() {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async move {
        let (_a, b) = pair().await;
        let (buf, log) = Tracked::new(4096, 0);
        let mut op = b.read(buf);
        assert!(poll_once(&mut op).is_pending());
        settle().await; // the SQE is in the kernel now
        let before = stats();
        drop(op);
        if uring {
            assert!(
                !log.borrow().dropped,
                "buffer freed while the kernel still holds it"
            );
            assert_eq!(stats().ops_parked, before.ops_parked + 1);
            settle().await;
            let l = log.borrow();
            assert!(l.dropped, "parked buffer never released");
            let at = l.stats_at_drop.expect("dropped inside the runtime");
            assert!(
                at.completions > before.completions,
                "released before its CQE was reaped"
            );
            assert_eq!(at.parked_released, before.parked_released + 1);
        } else {
            // epoll: nothing is in the kernel between polls.
            assert!(log.borrow().dropped);
        }
    });
}

#[test]
fn dropping_an_unsubmitted_op_still_waits_for_its_cqe() {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async move {
        let (_a, b) = pair().await;
        let (buf, log) = Tracked::new(64, 0);
        let before = stats();
        drop(b.read(buf)); // created (SQE pushed) and dropped before any park
        if uring {
            assert!(!log.borrow().dropped);
            settle().await;
            let at = log.borrow().stats_at_drop.expect("released in the runtime");
            assert!(at.completions > before.completions);
        } else {
            assert!(log.borrow().dropped);
        }
    });
}

#[test]
fn dropping_a_send_zc_waits_for_the_notification() {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async move {
        let (a, b) = pair().await;
        // 8 MiB to a peer that does not read: the send fills the socket buffers and waits.
        let (buf, log) = Tracked::new(8 << 20, 5);
        let mut op = a.send_zc(buf);
        let first = poll_once(&mut op);
        if uring {
            assert!(first.is_pending());
        }
        drop(first); // epoll: a plain send may finish at once (partially)
        settle().await;
        let before = stats();
        drop(op);
        if uring {
            assert!(
                !log.borrow().dropped,
                "zero-copy buffer freed while in flight"
            );
        }
        // Drain the peer so every skb referencing the pages is consumed.
        let mut sink = vec![0u8; 1 << 20];
        loop {
            let read =
                quiesce_runtime::time::timeout(Duration::from_millis(200), b.read(sink)).await;
            match read {
                Ok((Ok(n), s)) if n > 0 => sink = s,
                _ => break,
            }
        }
        settle().await;
        let l = log.borrow();
        assert!(l.dropped, "parked zero-copy buffer never released");
        if uring {
            let at = l.stats_at_drop.unwrap();
            assert_eq!(at.parked_released, before.parked_released + 1);
            assert!(
                at.zc_notifications > before.zc_notifications
                    || at.completions > before.completions
            );
        }
    });
}

#[test]
fn aborting_a_task_parks_its_in_flight_op() {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async move {
        let (a, b) = pair().await;
        let (buf, log) = Tracked::new(1024, 0);
        let h = spawn_local(async move {
            let (r, _buf) = b.read(buf).await;
            r
        });
        settle().await;
        h.abort();
        assert!(h.await.is_err());
        if uring {
            assert!(
                !log.borrow().dropped || log.borrow().stats_at_drop.unwrap().parked_released > 0
            );
        }
        settle().await;
        assert!(log.borrow().dropped);
        drop(a);
    });
}

#[test]
fn dropping_the_runtime_drains_every_in_flight_op() {
    let rt = rt();
    let uring = is_uring(&rt);
    let mut logs = Vec::new();
    let mut peers = Vec::new();
    for _ in 0..8 {
        let (buf, log) = Tracked::new(2048, 0);
        logs.push(log);
        let (a, b) = rt.block_on(pair());
        peers.push(a);
        rt.spawn_local(async move {
            let _ = b.read(buf).await;
            unreachable!("nobody writes");
        });
    }
    rt.block_on(async {
        yield_now().await;
        settle().await;
    });
    assert!(logs.iter().all(|l| !l.borrow().dropped));
    drop(rt);
    for l in &logs {
        let l = l.borrow();
        assert!(l.dropped, "buffer leaked by shutdown");
        if uring {
            assert!(
                l.stats_at_drop.unwrap().parked_released > 0,
                "freed before its CQE"
            );
        }
    }
    drop(peers);
}

#[test]
fn a_future_outliving_its_runtime_gets_its_buffer_back() {
    let rt = Runtime::new().unwrap();
    let (a, b) = rt.block_on(pair());
    let (buf, log) = Tracked::new(16, 0);
    // Created inside the runtime (io_uring ops submit at creation), awaited never.
    #[allow(clippy::async_yields_async)]
    let mut op = rt.block_on(async { b.read(buf) });
    let _ = rt.block_on(async { poll_once(&mut op) });
    drop(rt); // drains: the op's CQE (cancelled) is reaped here
    drop(op);
    assert!(log.borrow().dropped);
    drop((a, b));
}

#[test]
fn shutdown_drains_and_says_so() {
    let rt = rt();
    let (buf, log) = Tracked::new(2048, 0);
    let (a, b) = rt.block_on(pair());
    rt.spawn_local(async move {
        let _ = b.read(buf).await;
        unreachable!("nobody writes");
    });
    rt.block_on(settle());
    assert!(!log.borrow().dropped);
    assert_eq!(rt.shutdown(), Ok(()), "every op reaped");
    assert!(log.borrow().dropped, "the buffer came back with the drain");
    drop(a);
}

/// `close()` of a socket its runtime no longer drives (shut down, the
/// close refused) still closes the descriptor: it leaked, and the peer
/// never saw the end of the stream.
#[test]
fn a_close_its_runtime_refuses_still_closes_the_fd() {
    use std::io::Read;
    let rt = Runtime::new().unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    let s = rt
        .block_on(quiesce_runtime::net::TcpStream::connect(addr))
        .unwrap();
    let (mut peer, _) = listener.accept().unwrap();
    assert_eq!(rt.shutdown(), Ok(()));
    let rt2 = Runtime::new().unwrap();
    assert!(
        rt2.block_on(s.close()).is_err(),
        "refused: its runtime is gone"
    );
    // (Whether the number is still open says nothing: tests running
    // alongside reuse it.) The peer sees the end of the stream.
    peer.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let mut b = [0u8; 1];
    assert_eq!(peer.read(&mut b).ok(), Some(0), "the descriptor leaked");
}

/// A waker whose `clone` panics: the driver clones the waker it stores, so
/// polling an op with it panics inside the op's poll.
fn waker_that_panics_when_cloned() -> std::task::Waker {
    use std::task::{RawWaker, RawWakerVTable, Waker};
    fn clone(_: *const ()) -> RawWaker {
        panic!("a waker that cannot be cloned")
    }
    fn ignore(_: *const ()) {}
    static VTABLE: RawWakerVTable = RawWakerVTable::new(clone, ignore, ignore, ignore);
    // SAFETY: every function of the vtable ignores the (null) data pointer.
    unsafe { Waker::from_raw(RawWaker::new(std::ptr::null(), &VTABLE)) }
}

#[test]
fn a_panic_inside_an_ops_poll_leaves_its_buffer_to_the_kernel() {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async move {
        let (_a, b) = pair().await;
        let (buf, log) = Tracked::new(4096, 0);
        let mut op = b.read(buf);
        settle().await; // the SQE is in the kernel now
        let waker = waker_that_panics_when_cloned();
        let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let mut cx = std::task::Context::from_waker(&waker);
            std::future::Future::poll(std::pin::Pin::new(&mut op), &mut cx)
        }));
        assert!(polled.is_err(), "the waker's clone panics");
        if uring {
            assert!(
                !log.borrow().dropped,
                "a panic in poll freed a buffer the kernel still holds"
            );
        }
        drop(op);
        settle().await;
        assert!(log.borrow().dropped, "the buffer never came back");
    });
}

/// Two receives, on two connections, whose completions come in one reap
/// (io_uring) or one readiness wait (epoll): the first's waker panics. The
/// task awaiting the second is still woken: the driver had taken both off
/// the ring (the event list) before waking the first, and dropped the rest
/// with the panic — a task never woken, an op never completed (io_uring),
/// its buffer never back.
#[test]
fn a_waker_that_panics_loses_no_other_completion() {
    let rt = rt();
    let ((a, b), (c, d)) = rt.block_on(async { (pair().await, pair().await) });
    let mut first = Box::pin(a.read(vec![0u8; 1]));
    rt.block_on(std::future::poll_fn(|_| {
        let w = waker_that_panics_when_woken();
        let mut panicky = std::task::Context::from_waker(&w);
        assert!(std::future::Future::poll(first.as_mut(), &mut panicky).is_pending());
        std::task::Poll::Ready(())
    }));
    let woken = std::rc::Rc::new(std::cell::Cell::new(false));
    let w = woken.clone();
    let _second = rt.spawn_local(async move {
        let (r, _) = c.read(vec![0u8; 1]).await;
        w.set(r.is_ok());
    });
    // Both receives wait in the kernel (in the driver) now; a byte each
    // completes them, the first first.
    rt.block_on(quiesce_runtime::time::sleep(Duration::from_millis(20)));
    for s in [&b, &d] {
        let fd = std::os::fd::AsRawFd::as_raw_fd(&**s);
        // SAFETY: `fd` is an open socket of the pair; the byte is a live array.
        assert_eq!(unsafe { libc::write(fd, b"x".as_ptr().cast(), 1) }, 1);
    }
    let turned = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        rt.block_on(quiesce_runtime::time::sleep(Duration::from_millis(50)))
    }));
    assert!(turned.is_err(), "the waker's panic comes out of the turn");
    rt.block_on(quiesce_runtime::time::sleep(Duration::from_millis(100)));
    assert!(
        woken.get(),
        "the task of the receive completed with the panicking one was never woken"
    );
    drop(first);
}

/// An op waiting when its runtime shut down, polled later on another,
/// completes with an error — on epoll as on io_uring (whose drain cancels
/// it). On epoll it registered its waker with the dead runtime's poller
/// and waited for ever, even once its data came.
#[test]
fn an_op_outliving_its_runtime_completes_on_either_driver() {
    let first = rt();
    let (a, b) = first.block_on(pair());
    let mut op = Box::pin(a.read(vec![0u8; 16]));
    first.block_on(std::future::poll_fn(|cx| {
        assert!(std::future::Future::poll(op.as_mut(), cx).is_pending());
        std::task::Poll::Ready(())
    }));
    drop(first);
    let fd = std::os::fd::AsRawFd::as_raw_fd(&*b);
    let done = rt().block_on(async move {
        // The data comes after the op was polled here.
        let _late = spawn_local(async move {
            quiesce_runtime::time::sleep(Duration::from_millis(50)).await;
            // SAFETY: `fd` is the pair's open socket (`b` lives on); the
            // bytes are a live array.
            assert_eq!(unsafe { libc::write(fd, b"late".as_ptr().cast(), 4) }, 4);
        });
        quiesce_runtime::time::timeout(Duration::from_secs(1), op).await
    });
    drop(b);
    let (res, _buf) = done.expect("the op never completed on the next runtime");
    assert!(res.is_err(), "its runtime is gone: {res:?}");
}

/// A task of another runtime waiting on an op of a runtime that then shuts
/// down is woken and its op ends: io_uring's drain completes it cancelled;
/// on epoll the waker sat in the dead runtime's poller, and only a fresh
/// poll ended the op.
#[test]
fn a_task_waiting_on_an_op_of_a_runtime_that_shuts_down_is_woken() {
    let (first, second) = (rt(), rt());
    let (a, _b) = first.block_on(pair());
    let op = a.read(vec![0u8; 16]);
    let done = std::rc::Rc::new(std::cell::Cell::new(false));
    let d = done.clone();
    let _waiting = second.spawn_local(async move {
        let (r, _) = op.await;
        d.set(r.is_err());
    });
    // The task polled the op: it waits in the first runtime's driver.
    second.block_on(quiesce_runtime::time::sleep(Duration::from_millis(20)));
    drop(first);
    second.block_on(quiesce_runtime::time::sleep(Duration::from_millis(200)));
    assert!(
        done.get(),
        "the task waiting on the dead runtime's op was never woken"
    );
}

thread_local! {
    /// What [`CancelsOnWake`] cancels.
    static TO_CANCEL: std::cell::RefCell<Option<quiesce_runtime::Canceller>> =
        const { std::cell::RefCell::new(None) };
}

/// A waker that cancels another op when woken (as a select-like combinator
/// cancels its sibling when one side completes).
struct CancelsOnWake;

impl std::task::Wake for CancelsOnWake {
    fn wake(self: std::sync::Arc<Self>) {
        TO_CANCEL.with(|c| {
            if let Some(c) = c.borrow().as_ref() {
                c.cancel();
            }
        });
    }
}

/// A cancel requested from a waker that the reactor runs while it reaps
/// (its driver borrowed) still reaches the op. It was dropped with an
/// error log, and as the request stayed marked every later cancel was a
/// no-op too: a receive on an idle socket never ended.
#[test]
fn a_cancel_requested_while_the_driver_reaps_is_not_lost() {
    rt().block_on(async {
        let (a_tx, a) = pair().await;
        let (_b_tx, b) = pair().await;
        let mut idle = b.read(vec![0u8; 8]);
        TO_CANCEL.with(|c| *c.borrow_mut() = Some(idle.canceller()));
        let idle = spawn_local(async move { idle.await.0.map_err(|e| e.raw_os_error()) });
        let woken = std::task::Waker::from(std::sync::Arc::new(CancelsOnWake));
        let mut first = std::pin::pin!(a.read(vec![0u8; 8]));
        let mut cx = std::task::Context::from_waker(&woken);
        assert!(std::future::Future::poll(first.as_mut(), &mut cx).is_pending());
        settle().await;
        let (w, _) = a_tx.write(vec![1u8]).await;
        assert_eq!(w.unwrap(), 1);
        let out = quiesce_runtime::time::timeout(Duration::from_secs(2), idle).await;
        let r = out.expect("the cancel was lost: the idle receive never ended");
        assert_eq!(r.unwrap(), Err(Some(libc::ECANCELED)));
        let (r, _) = first.await;
        assert_eq!(r.unwrap(), 1);
        TO_CANCEL.with(|c| c.borrow_mut().take());
    });
}

/// An op polled with a waker that panics when woken, left in flight when
/// its runtime shuts down: the drain reaps its cancelled completion and
/// wakes that waker, and the shutdown still completes and says it drained.
/// The panic came out of `shutdown` (and would have aborted a runtime
/// dropped while unwinding), the drain cut short.
#[test]
fn a_waker_that_panics_during_the_shutdown_drain_does_not_escape_it() {
    let rt = rt();
    let (_a, b) = rt.block_on(pair());
    let mut op = Box::pin(b.read(vec![0u8; 8]));
    let w = waker_that_panics_when_woken();
    let mut cx = std::task::Context::from_waker(&w);
    assert!(std::future::Future::poll(op.as_mut(), &mut cx).is_pending());
    rt.block_on(settle());
    let shut = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.shutdown()));
    assert!(
        matches!(shut, Ok(Ok(()))),
        "the shutdown did not complete: {shut:?}"
    );
    drop(op);
}

/// A task whose future panics when dropped, still pending when its runtime
/// shuts down, beside a receive in flight: the shutdown completes, drains
/// the receive and says so, and the task's handle gets the panic. The
/// panic came out of `shutdown` before the drain (and would have aborted a
/// runtime dropped while unwinding), leaving the receive's ring running.
#[test]
fn a_task_that_panics_when_the_shutdown_drops_it_does_not_cut_the_drain() {
    let rt = rt();
    let (_a, b) = rt.block_on(pair());
    let mut op = Box::pin(b.read(vec![0u8; 8]));
    let w = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(w);
    assert!(std::future::Future::poll(op.as_mut(), &mut cx).is_pending());
    let mut handle = rt.spawn_local(PanicsOnDrop { pending: true });
    rt.block_on(yield_now());
    let shut = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.shutdown()));
    assert!(
        matches!(shut, Ok(Ok(()))),
        "the shutdown did not complete: {shut:?}"
    );
    // The receive was cancelled and reaped by the drain.
    match std::future::Future::poll(op.as_mut(), &mut cx) {
        std::task::Poll::Ready((r, _)) => assert!(r.is_err(), "{r:?}"),
        std::task::Poll::Pending => panic!("the receive was left in flight"),
    }
    // The handle says how the task ended.
    match std::future::Future::poll(std::pin::Pin::new(&mut handle), &mut cx) {
        std::task::Poll::Ready(Err(quiesce_runtime::JoinError::Panicked(p))) => {
            assert_eq!(p.downcast_ref::<&str>(), Some(&PANICS_ON_DROP))
        }
        other => panic!(
            "the handle answered {:?}",
            other.map(|r| r.map_err(|e| format!("{e:?}")))
        ),
    }
}

/// A pending task whose handle was polled with a waker that panics when
/// woken, beside a receive in flight: the shutdown drops the task, wakes
/// that waiter — whose panic is its own, not the task's — and still drains
/// the receive and says so. The panic came out of `shutdown` before the
/// drain, leaving the receive's ring running and its buffer unreaped.
#[test]
fn a_task_handle_whose_waker_panics_does_not_cut_the_shutdown_drain() {
    let rt = rt();
    let (_a, b) = rt.block_on(pair());
    let mut op = Box::pin(b.read(vec![0u8; 8]));
    let noop = std::task::Waker::noop();
    let mut cx = std::task::Context::from_waker(noop);
    assert!(std::future::Future::poll(op.as_mut(), &mut cx).is_pending());
    let mut handle = rt.spawn_local(std::future::pending::<()>());
    rt.block_on(yield_now());
    let w = waker_that_panics_when_woken();
    let mut panicky = std::task::Context::from_waker(&w);
    assert!(std::future::Future::poll(std::pin::Pin::new(&mut handle), &mut panicky).is_pending());
    let shut = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.shutdown()));
    assert!(
        matches!(shut, Ok(Ok(()))),
        "the shutdown did not complete: {shut:?}"
    );
    match std::future::Future::poll(op.as_mut(), &mut cx) {
        std::task::Poll::Ready((r, _)) => assert!(r.is_err(), "{r:?}"),
        std::task::Poll::Pending => panic!("the receive was left in flight"),
    }
}
