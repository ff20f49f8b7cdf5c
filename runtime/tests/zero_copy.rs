//! A `SEND_ZC` whose bytes the kernel took but the peer has not
//! acknowledged: its result CQE is in, its notification is not, and the
//! kernel still references the buffer's pages. These tests hold that state
//! for as long as they like (the peer's receive window is closed, so the
//! queued bytes can be neither sent nor acknowledged) and check that the
//! buffer comes back — or, dropped, is freed — only after the notification.
//! A driver that resolved the op at its result CQE, or released a parked
//! one at any CQE, fails them deterministically.
//!
//! On epoll a `send_zc` is a plain send: the kernel copies the bytes, so it
//! resolves at once and holds nothing; the tests check that instead.

mod common;

use std::cell::Cell;
use std::io::IoSlice;
use std::os::fd::AsRawFd;
use std::rc::Rc;
use std::time::Duration;

use common::*;
use quiesce_runtime::net::TcpStream;
use quiesce_runtime::time::{sleep, timeout};
use quiesce_runtime::{spawn_local, stats};

/// How long the tests watch a held send: far longer than a reap takes.
const HELD: Duration = Duration::from_millis(300);

fn set_buf(s: &impl AsRawFd, opt: libc::c_int, bytes: libc::c_int) {
    // SAFETY: a valid socket fd and a c_int option value of the right size.
    let rc = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            opt,
            (&bytes as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "setsockopt: {}", std::io::Error::last_os_error());
}

/// Bytes in `s`'s send queue, sent-but-unacknowledged and unsent alike.
fn queued(s: &TcpStream) -> usize {
    let mut n: libc::c_int = 0;
    // SAFETY: SIOCOUTQ writes one c_int through the pointer.
    let rc = unsafe { libc::ioctl(s.as_raw_fd(), libc::TIOCOUTQ, &mut n) };
    assert_eq!(rc, 0, "SIOCOUTQ: {}", std::io::Error::last_os_error());
    n as usize
}

/// Closes `b`'s receive window against `a` (`b` never reads), then gives
/// `a`'s send buffer room again: a send now queues at once and stays
/// queued until `b` reads. Returns how many bytes `a` sent to get there.
async fn stall(a: &TcpStream, b: &TcpStream) -> usize {
    set_buf(b, libc::SO_RCVBUF, 4096);
    set_buf(a, libc::SO_SNDBUF, 16 << 10);
    let chunk = vec![0x11u8; 64 << 10];
    let mut sent = 0;
    // Full when a one-byte send still finds no room after the reactor
    // turned (what was in flight has been acknowledged into b by then).
    for _ in 0..100 {
        loop {
            match a.try_send_vectored(&[IoSlice::new(&chunk)]) {
                Ok(n) => sent += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("filling the socket: {e}"),
            }
        }
        settle().await;
        match a.try_send_vectored(&[IoSlice::new(&chunk[..1])]) {
            Ok(n) => sent += n,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                set_buf(a, libc::SO_SNDBUF, 1 << 20);
                return sent;
            }
            Err(e) => panic!("filling the socket: {e}"),
        }
    }
    panic!("the peer's receive window never closed ({sent} bytes sent)");
}

/// Reads `len` bytes from `b`.
async fn drain(b: &TcpStream, len: usize) -> Vec<u8> {
    let mut got = Vec::with_capacity(len);
    let mut buf = vec![0u8; 256 << 10];
    while got.len() < len {
        let (r, back) = timeout(Duration::from_secs(10), b.read(buf))
            .await
            .expect("the sender's bytes never came");
        let n = r.unwrap();
        assert!(n > 0, "the stream ended early");
        got.extend_from_slice(&back[..n]);
        buf = back;
    }
    got
}

#[test]
fn a_send_zc_resolves_only_after_the_kernel_let_go_of_its_buffer() {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async move {
        let (a, b) = pair().await;
        let a = Rc::new(a);
        let filled = stall(&a, &b).await;
        let before = queued(&a);
        let done = Rc::new(Cell::new(false));
        let (d, sender) = (done.clone(), a.clone());
        let send = spawn_local(async move {
            let r = sender.send_zc(pattern(4096, 9)).await;
            d.set(true);
            r
        });
        sleep(HELD).await;
        // The kernel took the bytes (so the result CQE was posted) …
        assert_eq!(
            queued(&a),
            before + 4096,
            "the send did not queue its bytes"
        );
        if uring {
            // … but references the pages until the peer acknowledges them.
            assert!(
                !done.get(),
                "SEND_ZC resolved while the kernel still held its buffer"
            );
        } else {
            assert!(done.get(), "a plain send waited with room in the socket");
        }
        let got = drain(&b, filled + 4096).await;
        let (r, buf) = timeout(Duration::from_secs(10), send)
            .await
            .expect("the notification never came")
            .unwrap();
        assert_eq!(r.unwrap(), 4096);
        assert_eq!(buf, pattern(4096, 9));
        assert_eq!(&got[filled..], &buf[..]);
    });
}

/// Drops the op `after` its result CQE was reaped (or before) and checks
/// the buffer outlives the notification.
fn dropped_send_zc_is_freed_only_after_the_notification(reaped_first: bool) {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async move {
        let (a, b) = pair().await;
        let filled = stall(&a, &b).await;
        let before = queued(&a);
        let (buf, log) = Tracked::new(4096, 5);
        let mut op = a.send_zc(buf);
        let first = poll_once(&mut op);
        if uring {
            assert!(first.is_pending());
        }
        drop(first);
        if reaped_first {
            settle().await; // the result CQE (F_MORE) is reaped now
        }
        let parked = stats();
        drop(op);
        sleep(HELD).await;
        assert_eq!(
            queued(&a),
            before + 4096,
            "the send did not queue its bytes"
        );
        if uring {
            assert!(
                !log.borrow().dropped,
                "zero-copy buffer freed while the kernel still held it"
            );
            assert_eq!(stats().ops_parked, parked.ops_parked + 1);
        }
        drain(&b, filled + 4096).await;
        for _ in 0..250 {
            if log.borrow().dropped {
                break;
            }
            settle().await;
        }
        let l = log.borrow();
        assert!(l.dropped, "parked zero-copy buffer never released");
        if uring {
            let at = l.stats_at_drop.expect("released inside the runtime");
            assert_eq!(at.parked_released, parked.parked_released + 1);
            assert!(at.zc_notifications > parked.zc_notifications);
        }
    });
}

#[test]
fn a_send_zc_dropped_after_its_result_frees_its_buffer_only_after_the_notification() {
    dropped_send_zc_is_freed_only_after_the_notification(true);
}

#[test]
fn a_send_zc_dropped_in_flight_frees_its_buffer_only_after_the_notification() {
    dropped_send_zc_is_freed_only_after_the_notification(false);
}
