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

/// A small send may go straight to the socket (io_uring, `Send`), but never
/// past an earlier send on the same socket that is still queued: the second
/// op is created while the first one's SQE (a send too large to try first)
/// waits for the next park.
#[test]
fn a_small_send_never_overtakes_an_earlier_one() {
    rt().block_on(async {
        let (client, mut server) = loopback_pair();
        let s = TcpStream::from_std(client).unwrap();
        for round in 0..20 {
            let len = (64 << 10) + round;
            let first = s.write(vec![b'a'; len]);
            let second = s.write(vec![b'b'; 10]);
            let (r1, _) = first.await;
            let (r2, _) = second.await;
            assert_eq!(r1.unwrap(), len);
            assert_eq!(r2.unwrap(), 10);
            let mut got = vec![0u8; len + 10];
            server.read_exact(&mut got).unwrap();
            let first_b = got.iter().position(|&c| c == b'b').unwrap();
            assert_eq!(first_b, len, "round {round}: the later send landed first");
        }
    });
}

/// A small send alone on its socket finishes without the ring on io_uring:
/// no SQE, and its buffer is back at the first poll.
#[test]
fn a_small_send_alone_skips_the_ring() {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async {
        let (client, mut server) = loopback_pair();
        let s = TcpStream::from_std(client).unwrap();
        let before = stats().ops_submitted;
        let (r, _) = s.write(vec![7u8; 4096]).await;
        assert_eq!(r.unwrap(), 4096);
        if uring {
            assert_eq!(
                stats().ops_submitted,
                before,
                "a 4 KiB send went through the ring"
            );
        }
        let mut got = vec![0u8; 4096];
        server.read_exact(&mut got).unwrap();
        assert!(got.iter().all(|&c| c == 7));
    });
}

/// A send that skips the driver (`try_send_vectored`) never overtakes a
/// send operation that exists on the socket: while one does it answers
/// `WouldBlock` and sends nothing.
#[test]
fn a_send_now_waits_behind_a_queued_send() {
    rt().block_on(async {
        let (client, mut server) = loopback_pair();
        let s = TcpStream::from_std(client).unwrap();
        let len = 64 << 10;
        let first = s.write(vec![b'a'; len]);
        let now = s.try_send_vectored(&[std::io::IoSlice::new(b"bb")]);
        assert_eq!(
            now.map_err(|e| e.kind()),
            Err(std::io::ErrorKind::WouldBlock),
            "a send skipped a queued one"
        );
        let (r, _) = first.await;
        let n = r.unwrap();
        assert_eq!(
            s.try_send_vectored(&[std::io::IoSlice::new(b"bb")])
                .unwrap(),
            2
        );
        let mut got = vec![0u8; n + 2];
        server.read_exact(&mut got).unwrap();
        assert!(got[..n].iter().all(|&c| c == b'a'));
        assert_eq!(&got[n..], b"bb");
    });
}

/// `try_send_vectored` sends what the socket takes, in order across its
/// slices, and says how much: against a peer that does not read, the
/// counts add up to exactly the bytes that arrive once it does.
#[test]
fn a_send_now_reports_what_the_socket_took() {
    rt().block_on(async {
        let (client, mut server) = loopback_pair();
        let s = TcpStream::from_std(client).unwrap();
        let head = pattern(40, 1);
        let body = pattern(16 << 10, 2);
        let mut expected = Vec::new();
        let mut partial = false;
        for _ in 0..10_000 {
            let n = match s
                .try_send_vectored(&[std::io::IoSlice::new(&head), std::io::IoSlice::new(&body)])
            {
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
                Err(e) => panic!("{e}"),
            };
            let whole: Vec<u8> = head.iter().chain(&body).copied().collect();
            expected.extend_from_slice(&whole[..n]);
            partial |= n < whole.len();
            if n < whole.len() {
                break;
            }
        }
        assert!(partial || !expected.is_empty(), "nothing was sent");
        let mut got = vec![0u8; expected.len()];
        server.read_exact(&mut got).unwrap();
        assert!(
            got == expected,
            "the stream does not hold what was reported sent"
        );
        server.set_nonblocking(true).unwrap();
        let mut more = [0u8; 1];
        assert!(
            server.read(&mut more).is_err(),
            "more arrived than was reported sent"
        );
    });
}

/// Bytes already in the socket are received at once by
/// `read_exact_expected` (no SQE on io_uring); bytes that come later still
/// arrive, through the ring.
#[test]
fn an_expected_receive_takes_what_is_there_and_waits_for_the_rest() {
    let rt = rt();
    let uring = is_uring(&rt);
    rt.block_on(async {
        let (client, mut server) = loopback_pair();
        let s = TcpStream::from_std(client).unwrap();
        server.write_all(&pattern(4096, 3)).unwrap();
        // Let the bytes reach the receiving socket.
        time::sleep(Duration::from_millis(20)).await;
        let before = stats().ops_submitted;
        let (r, got) = s.read_exact_expected(vec![0u8; 4096]).await;
        r.unwrap();
        assert!(got == pattern(4096, 3), "wrong bytes");
        if uring {
            assert_eq!(
                stats().ops_submitted,
                before,
                "bytes already there went through the ring"
            );
        }
        // Nothing there yet: the receive waits, then gets them.
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(50));
            server.write_all(&pattern(8192, 4)).unwrap();
            server
        });
        let (r, got) = s.read_exact_expected(vec![0u8; 8192]).await;
        r.unwrap();
        assert!(got == pattern(8192, 4), "wrong late bytes");
        drop(late.join().unwrap());
    });
}

/// `try_read` takes what the socket holds without the driver, says
/// `WouldBlock` when it holds nothing, never takes bytes while a receive
/// operation on the socket exists (that one is first in the stream), and
/// reads 0 at EOF.
#[test]
fn try_read_takes_what_is_there_and_never_overtakes_a_receive() {
    rt().block_on(async {
        let (client, mut server) = loopback_pair();
        let s = TcpStream::from_std(client).unwrap();
        let mut buf = [0u8; 16];
        let empty = s.try_read(&mut buf).unwrap_err();
        assert_eq!(empty.kind(), std::io::ErrorKind::WouldBlock);
        server.write_all(b"abc").unwrap();
        time::sleep(Duration::from_millis(20)).await;
        assert_eq!(s.try_read(&mut buf).unwrap(), 3);
        assert_eq!(&buf[..3], b"abc");
        // A receive exists (on io_uring armed in the kernel by the park):
        // it gets the next bytes, try_read gets none.
        let op = s.read(vec![0u8; 4]);
        time::sleep(Duration::from_millis(20)).await;
        server.write_all(b"defg").unwrap();
        // No park: the bytes wait in the socket (the ring's receive runs
        // at the next one).
        std::thread::sleep(Duration::from_millis(20));
        let ahead = s.try_read(&mut buf).unwrap_err();
        assert_eq!(ahead.kind(), std::io::ErrorKind::WouldBlock);
        let (r, got) = op.await;
        assert_eq!(r.unwrap(), 4);
        assert_eq!(&got, b"defg");
        drop(server);
        time::sleep(Duration::from_millis(20)).await;
        assert_eq!(s.try_read(&mut buf).unwrap(), 0, "EOF");
    });
}

/// `discard` drops exactly the bytes it reports, never more than asked,
/// without a buffer: what follows them is the stream's next bytes. It
/// waits for bytes not there yet (through the ring on io_uring), and reads
/// 0 at EOF.
#[test]
fn discard_drops_what_it_counts_and_leaves_the_rest() {
    rt().block_on(async {
        let (client, mut server) = loopback_pair();
        let s = TcpStream::from_std(client).unwrap();
        let data = pattern(3 << 20, 7);
        let writer = std::thread::spawn(move || {
            // 3 MiB, more than the socket buffers hold: the discards below
            // find some of it there and wait for the rest.
            server.write_all(&data).unwrap();
            server
        });
        // Drop all but the last 1000 bytes, in asks of various sizes, the
        // first expected to be there, the rest waited for.
        let mut left = (3 << 20) - 1000;
        let mut ask = 100_000;
        let mut expected = true;
        while left > 0 {
            let want = ask.min(left);
            let n = s
                .discard(want, std::mem::take(&mut expected))
                .await
                .unwrap();
            assert!(n > 0 && n <= want, "dropped {n} of {want} asked");
            left -= n;
            ask = ask * 3 / 2;
        }
        let mut server = writer.join().unwrap();
        // The next bytes are the ones after those dropped.
        let (r, rest) = s.read_exact(vec![0u8; 1000]).await;
        r.unwrap();
        assert!(
            rest == pattern(3 << 20, 7)[(3 << 20) - 1000..],
            "wrong bytes after the discard"
        );
        // Nothing there: it waits for the next bytes, then drops them.
        let late = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            server.write_all(&[1, 2, 3]).unwrap();
            server
        });
        assert_eq!(s.discard(10, false).await.unwrap(), 3);
        drop(late.join().unwrap());
        assert_eq!(s.discard(10, true).await.unwrap(), 0, "EOF");
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

/// A receive that tries the socket first (`read_expected`, `discard`
/// expecting bytes) does so only with no earlier receive on the socket:
/// one queued before it is first in the stream.
#[test]
fn a_receive_that_tries_first_never_overtakes_an_earlier_one() {
    rt().block_on(async {
        let (client, mut server) = loopback_pair();
        let s = TcpStream::from_std(client).unwrap();
        server.write_all(b"abcdefghijkl").unwrap();
        time::sleep(Duration::from_millis(20)).await;
        let a = s.read(vec![0u8; 4]);
        let b = s.read_expected(vec![0u8; 4]);
        let c = s.discard(4, true);
        let ((ra, a), (rb, b), rc) = (a.await, b.await, c.await);
        assert_eq!((ra.unwrap(), rb.unwrap(), rc.unwrap()), (4, 4, 4));
        assert_eq!(
            (&a[..], &b[..]),
            (&b"abcd"[..], &b"efgh"[..]),
            "the stream was reordered"
        );
    });
}
