//! Ops, streams and fds belong to the runtime that created them, wherever
//! they are polled or dropped: never inferred from the thread's current
//! runtime, and an fd stays open while any op on it may still run.

mod common;

use std::io::Seek;
use std::os::fd::{AsRawFd, OwnedFd};
use std::rc::Rc;
use std::time::Duration;

use common::*;
use quiesce_runtime::fd::Fd;
use quiesce_runtime::net::TcpStream;
use quiesce_runtime::time::timeout;
use quiesce_runtime::{DriverKind, Runtime};

#[test]
fn an_op_dropped_outside_block_on_stays_parked_in_its_own_runtime() {
    let rt = rt();
    let uring = is_uring(&rt);
    let (_a, b) = rt.block_on(pair());
    let (buf, log) = Tracked::new(4096, 0);
    #[allow(clippy::async_yields_async)]
    let op = rt.block_on(async { b.read(buf) }); // the SQE is queued
    drop(op); // outside any block_on, its runtime alive
    if uring {
        assert!(
            !log.borrow().dropped,
            "buffer freed while its SQE was queued for the kernel"
        );
    }
    rt.block_on(settle());
    let l = log.borrow();
    assert!(l.dropped, "parked buffer never released");
    if uring {
        let at = l.stats_at_drop.expect("released by its own runtime");
        assert_eq!(at.parked_released, 1, "released before its CQE");
    }
}

#[test]
fn an_op_dropped_inside_another_runtimes_block_on_parks_in_its_own() {
    let rt = rt();
    let other = Runtime::new().unwrap();
    let uring = is_uring(&rt);
    let (_a, b) = rt.block_on(pair());
    let (buf, log) = Tracked::new(4096, 0);
    #[allow(clippy::async_yields_async)]
    let mut op = rt.block_on(async { b.read(buf) });
    rt.block_on(async { assert!(poll_once(&mut op).is_pending()) });
    rt.block_on(settle()); // in the kernel now
    other.block_on(async move { drop(op) });
    if uring {
        assert!(
            !log.borrow().dropped,
            "buffer freed by another runtime while the kernel held it"
        );
    }
    rt.block_on(settle());
    assert!(log.borrow().dropped, "parked buffer never released");
}

#[test]
fn an_op_polled_outside_its_runtime_waits_for_its_own_completion() {
    let rt = rt();
    let other = Runtime::new().unwrap();
    let (a, b) = rt.block_on(pair());
    #[allow(clippy::async_yields_async)]
    let mut op = rt.block_on(async { b.read(vec![0u8; 16]) });
    // Neither outside any runtime nor inside another one may this op complete:
    // the kernel still holds its buffer.
    assert!(
        poll_once(&mut op).is_pending(),
        "completed outside its runtime"
    );
    other.block_on(async {
        assert!(
            poll_once(&mut op).is_pending(),
            "completed in another runtime"
        )
    });
    let (res, buf) = rt.block_on(async {
        a.write_all(b"hello".to_vec()).await.0.unwrap();
        op.await
    });
    assert_eq!(res.unwrap(), 5);
    assert_eq!(&buf[..5], b"hello");
}

#[test]
fn a_closed_fd_number_reused_in_the_same_tick_is_never_touched_by_a_stale_op() {
    let path = std::env::temp_dir().join(format!("quiesce-fd-reuse-{}", std::process::id()));
    std::fs::write(&path, b"the new file's bytes").unwrap();
    let rt = rt();
    let (pos, stale, reused) = rt.block_on(async {
        let (r, _w) = std::io::pipe().unwrap();
        let r = Fd::new(OwnedFd::from(r)).unwrap();
        let stale = r.as_raw_fd();
        let op = r.read(vec![0u8; 64]); // queued, not yet flushed
        drop(op); // parked, its cancel queued behind it
        drop(r); // the fd number is free unless the parked op still holds it
        let mut file = std::fs::File::open(&path).unwrap();
        let reused = file.as_raw_fd();
        settle().await; // the ring flushes what was queued
        (file.stream_position().unwrap(), stale, reused)
    });
    drop(rt);
    std::fs::remove_file(&path).unwrap();
    assert_eq!(
        pos, 0,
        "a stale read on fd {stale} consumed {pos} bytes of a new file (fd {reused})"
    );
}

#[test]
fn epoll_forgets_an_fd_closed_outside_block_on() {
    let rt = Runtime::builder()
        .driver(DriverKind::Epoll)
        .build()
        .unwrap();
    let (a, b) = rt.block_on(pair());
    let stale = b.as_raw_fd();
    // Registers b's fd with the poller.
    rt.block_on(async {
        assert!(timeout(Duration::from_millis(5), b.read(vec![0u8; 8]))
            .await
            .is_err());
    });
    drop(b); // closed outside the runtime
    drop(a);
    // A new socket takes the same fd number; it must still be woken.
    for round in 0..2 {
        let done = rt.block_on(async {
            timeout(Duration::from_secs(2), async {
                let (c, d) = pair().await;
                let d = if c.as_raw_fd() == stale || d.as_raw_fd() == stale {
                    d // the kernel reused the number by itself
                } else {
                    // `stale` is closed: its stream and the previous round's socket
                    // are gone, and neither new socket has it.
                    // SAFETY: so dup2 only makes it a second descriptor of `d`'s socket.
                    assert_eq!(unsafe { libc::dup2(d.as_raw_fd(), stale) }, stale);
                    drop(d);
                    // SAFETY: dup2 just made `stale` a descriptor that nothing else owns.
                    let owned = unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(stale) };
                    Rc::new(TcpStream::from_std(std::net::TcpStream::from(owned)).unwrap())
                };
                c.write_all(b"ping".to_vec()).await.0.unwrap();
                let (res, buf) = d.read(vec![0u8; 4]).await;
                assert_eq!(res.unwrap(), 4);
                assert_eq!(&buf, b"ping");
                (c.as_raw_fd(), d.as_raw_fd())
            })
            .await
        });
        assert!(
            done.is_ok(),
            "round {round}: a socket reusing fd {stale} was never woken"
        );
    }
}

#[test]
fn an_op_started_after_its_runtime_shut_down_fails_instead_of_hanging() {
    let rt = rt();
    let (a, b) = rt.block_on(pair());
    drop(rt);
    let other = Runtime::new().unwrap();
    let (res, buf) = other.block_on(async {
        quiesce_runtime::time::timeout(Duration::from_secs(1), b.read(vec![0u8; 8]))
            .await
            .expect("an op of a closed runtime must not hang")
    });
    assert!(res.is_err(), "{res:?}");
    assert_eq!(buf.len(), 8);
    drop(a);
}
