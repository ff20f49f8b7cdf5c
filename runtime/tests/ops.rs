//! Every operation, on whichever driver `QUIESCE_DRIVER` picks.

mod common;

use std::io::{Read, Write};
use std::os::fd::OwnedFd;
use std::time::{Duration, Instant};

use common::*;
use quiesce_runtime::fd::Fd;
use quiesce_runtime::net::{TcpListener, TcpStream};
use quiesce_runtime::{spawn_local, stats, time, IoBuf};

#[test]
fn accept_connect_send_recv() {
    rt().block_on(async {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let client = spawn_local(async move {
            let s = TcpStream::connect(addr).await.unwrap();
            let (r, _) = s.write(b"ping".to_vec()).await;
            assert_eq!(r.unwrap(), 4);
            let (r, buf) = s.read(vec![0u8; 4]).await;
            assert_eq!(r.unwrap(), 4);
            buf
        });
        let (s, peer) = l.accept().await.unwrap();
        assert!(peer.ip().is_loopback());
        let (r, buf) = s.read(Vec::with_capacity(16)).await;
        assert_eq!(r.unwrap(), 4);
        assert_eq!(buf, b"ping");
        let (r, _) = s.write(b"pong".to_vec()).await;
        r.unwrap();
        assert_eq!(client.await.unwrap(), b"pong");
    });
}

#[test]
fn write_all_and_read_exact_move_4_mib_intact() {
    rt().block_on(async {
        let (a, b) = pair().await;
        let data = pattern(4 << 20, 7);
        let expect = data.clone();
        let w = spawn_local(async move { a.write_all(data).await.0.unwrap() });
        let (r, got) = b.read_exact(vec![0u8; 4 << 20]).await;
        r.unwrap();
        w.await.unwrap();
        assert!(got == expect, "payload corrupted");
    });
}

#[test]
fn send_zc_returns_the_buffer_after_the_notification() {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async move {
        let (a, b) = pair().await;
        let before = stats().zc_notifications;
        let reader = spawn_local(async move { b.read_exact(vec![0u8; 256 << 10]).await });
        let (r, buf) = a.write_all_zc(pattern(256 << 10, 3)).await;
        r.unwrap();
        if uring {
            // The op may only resolve once the kernel let go of the pages.
            assert!(
                stats().zc_notifications > before,
                "SEND_ZC resolved before its notification"
            );
        }
        let (r, got) = reader.await.unwrap();
        r.unwrap();
        assert_eq!(got, buf);
    });
}

#[test]
fn read_and_write_on_a_pipe() {
    rt().block_on(async {
        let (r, w) = std::io::pipe().unwrap();
        let r = Fd::new(OwnedFd::from(r)).unwrap();
        let w = Fd::new(OwnedFd::from(w)).unwrap();
        let reader = spawn_local(async move {
            let (res, buf) = r.read(vec![0u8; 32]).await;
            let n = res.unwrap();
            buf[..n].to_vec()
        });
        let (res, _) = w.write(b"through the pipe".to_vec()).await;
        assert_eq!(res.unwrap(), 16);
        assert_eq!(reader.await.unwrap(), b"through the pipe");
    });
}

#[test]
fn read_at_and_write_at_on_a_file() {
    let path = std::env::temp_dir().join(format!("quiesce-rw-{}", std::process::id()));
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(true)
        .open(&path)
        .unwrap();
    rt().block_on(async {
        let f = Fd::new(OwnedFd::from(file)).unwrap();
        f.write_at(b"0123456789".to_vec(), 0).await.0.unwrap();
        f.write_at(b"abc".to_vec(), 4).await.0.unwrap();
        let (r, buf) = f.read_at(vec![0u8; 10], 0).await;
        assert_eq!(r.unwrap(), 10);
        assert_eq!(&buf, b"0123abc789");
        let (r, buf) = f.read_at(vec![0u8; 4], 8).await;
        assert_eq!(r.unwrap(), 2);
        assert_eq!(&buf[..2], b"89");
        // Past i64::MAX is no offset (pread's EINVAL); io_uring must not
        // read it as -1, "the file's position".
        for off in [u64::MAX, 1 << 63] {
            let (r, _) = f.read_at(vec![0u8; 4], off).await;
            assert_eq!(
                r.unwrap_err().raw_os_error(),
                Some(libc::EINVAL),
                "read at {off:#x}"
            );
            let (r, _) = f.write_at(b"zz".to_vec(), off).await;
            assert_eq!(
                r.unwrap_err().raw_os_error(),
                Some(libc::EINVAL),
                "write at {off:#x}"
            );
        }
        f.close().await.unwrap();
    });
    let mut s = String::new();
    std::fs::File::open(&path)
        .unwrap()
        .read_to_string(&mut s)
        .unwrap();
    assert_eq!(s, "0123abc789");
    std::fs::remove_file(path).unwrap();
}

#[test]
fn poll_add_waits_for_readability() {
    rt().block_on(async {
        let (a, b) = pair().await;
        let waiter = spawn_local(async move {
            let ev = b.readable().await.unwrap();
            assert!(ev & libc::POLLIN as u32 != 0);
        });
        time::sleep(Duration::from_millis(10)).await;
        assert!(!waiter.is_finished(), "readable before any byte was sent");
        a.write_all(b"x".to_vec()).await.0.unwrap();
        waiter.await.unwrap();
    });
}

/// A poll for readable *or* writable wakes on either, on both drivers: on
/// epoll it waited as a reader only, so a full pipe's write end becoming
/// writable never woke it.
#[test]
fn poll_for_either_wakes_once_writable() {
    use std::os::fd::AsRawFd;
    for kind in [
        quiesce_runtime::DriverKind::IoUring,
        quiesce_runtime::DriverKind::Epoll,
    ] {
        let Ok(rt) = quiesce_runtime::Runtime::builder().driver(kind).build() else {
            // (CI's kernel has io_uring: a skip there would pass unseen.)
            assert!(
                std::env::var("CI").is_err(),
                "CI=true but no {kind:?} runtime"
            );
            continue;
        };
        rt.block_on(async {
            let (mut r, mut w) = std::io::pipe().unwrap();
            for end in [r.as_raw_fd(), w.as_raw_fd()] {
                // SAFETY: F_SETFL on a pipe end this test owns.
                unsafe { libc::fcntl(end, libc::F_SETFL, libc::O_NONBLOCK) };
            }
            while w.write(&[1u8; 65536]).is_ok() {}
            let w = Fd::new(OwnedFd::from(w)).unwrap();
            let either = (libc::POLLIN | libc::POLLOUT) as u32;
            let waiter = spawn_local(async move { w.poll(either).await });
            time::sleep(Duration::from_millis(10)).await;
            assert!(!waiter.is_finished(), "{kind:?}: writable while full");
            let mut sink = vec![0u8; 65536];
            while r.read(&mut sink).is_ok_and(|n| n > 0) {}
            let ev = time::timeout(Duration::from_secs(1), waiter)
                .await
                .unwrap_or_else(|_| panic!("{kind:?}: not woken once writable"))
                .unwrap()
                .unwrap();
            assert!(ev & libc::POLLOUT as u32 != 0, "{kind:?}: {ev:#x}");
        });
    }
}

#[test]
fn kernel_timeout_op_fires() {
    rt().block_on(async {
        let t0 = Instant::now();
        time::kernel_sleep(Duration::from_millis(30)).await.unwrap();
        assert!(t0.elapsed() >= Duration::from_millis(30));
    });
}

#[test]
fn many_kernel_timeouts_complete_together() {
    rt().block_on(async {
        let t0 = Instant::now();
        let hs: Vec<_> = (0..64)
            .map(|i| spawn_local(time::kernel_sleep(Duration::from_millis(5 + i % 5))))
            .collect();
        for h in hs {
            h.await.unwrap().unwrap();
        }
        assert!(t0.elapsed() >= Duration::from_millis(9));
    });
}

#[test]
fn a_full_submission_queue_is_submitted_not_fatal() {
    let rt = quiesce_runtime::Runtime::builder()
        .entries(4)
        .build()
        .unwrap();
    let uring = is_uring(&rt);
    rt.block_on(async move {
        let ops: Vec<_> = (0..64)
            .map(|_| time::kernel_sleep(Duration::from_millis(1)))
            .collect();
        for op in ops {
            op.await.unwrap();
        }
        if uring {
            assert!(stats().submit_full > 0);
        }
    });
}

#[test]
fn canceller_cancels_a_pending_recv_and_returns_the_buffer() {
    rt().block_on(async {
        let (_a, b) = pair().await;
        let slot = std::rc::Rc::new(std::cell::RefCell::new(None));
        let s2 = slot.clone();
        let h = spawn_local(async move {
            let mut op = b.read(vec![0u8; 128]);
            *s2.borrow_mut() = Some(op.canceller());
            op.await
        });
        settle().await;
        slot.borrow().as_ref().expect("task started").cancel();
        let (r, buf) = h.await.unwrap();
        assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::ECANCELED));
        assert_eq!(buf.bytes_total(), 128);
    });
}

#[test]
fn close_op_closes_the_socket() {
    rt().block_on(async {
        let (a, b) = pair().await;
        a.close().await.unwrap();
        let (r, _) = b.read(vec![0u8; 8]).await;
        assert_eq!(r.unwrap(), 0, "peer sees EOF after close");
    });
}

#[test]
fn connect_to_a_closed_port_is_refused() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap()
    };
    rt().block_on(async move {
        let err = TcpStream::connect(port)
            .await
            .err()
            .expect("connect must fail");
        assert_eq!(err.kind(), std::io::ErrorKind::ConnectionRefused);
    });
}

#[test]
fn interop_with_std_sockets() {
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut b = [0u8; 3];
        s.read_exact(&mut b).unwrap();
        s.write_all(&b).unwrap();
    });
    rt().block_on(async move {
        let s = TcpStream::connect(addr).await.unwrap();
        s.set_nodelay(true).unwrap();
        s.write_all(b"abc".to_vec()).await.0.unwrap();
        let (r, buf) = s.read_exact(vec![0u8; 3]).await;
        r.unwrap();
        assert_eq!(&buf, b"abc");
    });
    t.join().unwrap();
}

#[test]
fn ring_knobs_build_working_runtimes() {
    use quiesce_runtime::Runtime;
    let builders = [
        Runtime::builder().defer_taskrun(true),
        Runtime::builder()
            .sqpoll(Duration::from_millis(20))
            .single_issuer(false),
        Runtime::builder()
            .entries(8)
            .cq_entries(64)
            .coop_taskrun(false),
    ];
    for b in builders {
        let rt = b.build().expect("builds");
        rt.block_on(async {
            let (a, b) = pair().await;
            for i in 0..50u8 {
                a.write_all(vec![i; 100]).await.0.unwrap();
                let (r, buf) = b.read_exact(vec![0u8; 100]).await;
                r.unwrap();
                assert_eq!(buf, vec![i; 100]);
            }
            time::sleep(Duration::from_millis(2)).await;
        });
    }
}

#[test]
fn a_read_into_a_slice_past_the_initialised_prefix_marks_nothing_it_did_not_write() {
    rt().block_on(async {
        let (a, b) = pair().await;
        a.write_all(b"12345678".to_vec()).await.0.unwrap();
        let v: Vec<u8> = Vec::with_capacity(64);
        let (res, slice) = b.read(v.slice(8..16)).await;
        assert_eq!(res.unwrap(), 8);
        let v = slice.into_inner();
        // Bytes 0..8 were never written: a Vec can only mark a prefix, so
        // nothing may be marked initialised.
        assert_eq!(v.len(), 0, "bytes before the slice were marked initialised");
        // A slice that starts inside the initialised prefix extends it.
        a.write_all(b"abcd".to_vec()).await.0.unwrap();
        let mut v = Vec::with_capacity(8);
        v.extend_from_slice(b"xx");
        let (res, slice) = b.read(v.slice(2..6)).await;
        assert_eq!(res.unwrap(), 4);
        assert_eq!(slice.into_inner(), b"xxabcd");
    });
}

/// An accept whose connection came in but that is dropped before it is
/// polled again closes the connection it got for nobody: the client sees
/// the end of the stream, not a socket held open for good.
#[test]
fn an_accept_dropped_after_its_connection_came_closes_it() {
    use std::future::Future;
    rt().block_on(async {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let mut accept = Box::pin(l.accept());
        std::future::poll_fn(|cx| {
            let _ = accept.as_mut().poll(cx);
            std::task::Poll::Ready(())
        })
        .await;
        let mut c = std::net::TcpStream::connect(addr).unwrap();
        // The reactor takes the connection; nobody polls the accept again.
        time::sleep(Duration::from_millis(50)).await;
        drop(accept);
        drop(l);
        c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
        let r = c.read(&mut [0u8; 1]);
        assert!(
            matches!(&r, Ok(0))
                || matches!(&r, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "the accepted connection was left open: {r:?}"
        );
    });
}

/// Ops dropped while they waited on an fd that never became ready leave
/// a bounded residue: three thousand short-lived tasks that each waited on
/// an idle listener and gave up (a timeout) do not keep three thousand
/// wakers on it (epoll: each waiter's waker stayed on the fd until an edge
/// came, so the list, and `in_flight`, grew without bound; now at most
/// 1,024 are kept per direction, io_uring cancels and reaps them).
#[test]
fn waiters_that_gave_up_on_an_idle_fd_do_not_pile_up() {
    rt().block_on(async {
        let l = std::rc::Rc::new(TcpListener::bind("127.0.0.1:0").unwrap());
        let tasks: Vec<_> = (0..3000)
            .map(|_| {
                let l = l.clone();
                spawn_local(async move {
                    let r = time::timeout(Duration::from_millis(1), l.accept()).await;
                    assert!(r.is_err(), "nobody connected");
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        time::sleep(Duration::from_millis(20)).await;
        let left = stats().in_flight;
        assert!(
            left <= 1024,
            "{left} ops still counted in flight on an idle listener"
        );
    });
}

/// `SO_LINGER` set past an `int` of seconds lingers as long as the kernel
/// can, never not at all: a `LONGEST_WAIT` (2^32 s) was cut to 0, which
/// turns a close into a reset that drops unsent data.
#[test]
fn a_linger_past_an_int_of_seconds_is_the_longest_not_zero() {
    use std::os::fd::AsRawFd;
    let rt = rt();
    rt.block_on(async {
        let (a, _b) = pair().await;
        let read_back = |a: &quiesce_runtime::net::TcpStream| {
            let mut l = libc::linger {
                l_onoff: 0,
                l_linger: 0,
            };
            let mut n = std::mem::size_of::<libc::linger>() as libc::socklen_t;
            // SAFETY: `l` and `n` are live and `n` is `l`'s size.
            let r = unsafe {
                libc::getsockopt(
                    a.as_raw_fd(),
                    libc::SOL_SOCKET,
                    libc::SO_LINGER,
                    (&mut l as *mut libc::linger).cast(),
                    &mut n,
                )
            };
            assert_eq!(r, 0);
            (l.l_onoff, l.l_linger)
        };
        a.set_linger(Some(Duration::from_secs(7))).unwrap();
        assert_eq!(read_back(&a), (1, 7));
        for long in [
            quiesce_runtime::time::LONGEST_WAIT,
            Duration::from_secs((1 << 32) + 5),
        ] {
            a.set_linger(Some(long)).unwrap();
            assert_eq!(read_back(&a), (1, i32::MAX), "{long:?}");
        }
        a.set_linger(None).unwrap();
        assert_eq!(read_back(&a).0, 0);
    });
}
