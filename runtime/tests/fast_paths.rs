//! Sends and receives that skip the ring — a small send straight to the
//! socket, a receive that tries the socket first, `try_read`, `discard` —
//! and the stream order they keep against ops still queued, on whichever
//! driver `QUIESCE_DRIVER` picks.

mod common;

use std::io::{Read, Write};
use std::time::Duration;

use common::*;
use quiesce_runtime::net::TcpStream;
use quiesce_runtime::{stats, time};

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

/// Receives that finish at once (their bytes are in the socket already)
/// still spend the task's budget: a run of them lets the reactor turn and
/// other tasks run between them, on io_uring as on epoll — else a reader
/// kept busy by a fast sender holds the thread (no timers, no other
/// connections) for the whole transfer.
#[test]
fn receives_that_finish_at_once_still_let_other_tasks_run() {
    use std::cell::Cell;
    use std::os::fd::AsRawFd;
    use std::rc::Rc;
    const READ: usize = 1024;
    const QUEUED: usize = 160 * READ; // more reads than one poll's budget
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let want: libc::c_int = 1 << 20;
    for opt in [libc::SO_RCVBUF, libc::SO_RCVBUFFORCE] {
        // SAFETY: a valid socket and a c_int option value (FORCE may be
        // refused without CAP_NET_ADMIN; RCVBUF's cap then holds enough).
        unsafe {
            libc::setsockopt(
                l.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&want as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    let mut client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (server, _) = l.accept().unwrap();
    client.write_all(&vec![7u8; QUEUED]).unwrap();
    let queued = || {
        let mut n: libc::c_int = 0;
        // SAFETY: FIONREAD writes one c_int through the pointer.
        assert_eq!(
            unsafe { libc::ioctl(server.as_raw_fd(), libc::FIONREAD, &mut n) },
            0
        );
        n as usize
    };
    let t0 = std::time::Instant::now();
    while queued() < QUEUED {
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "only {} of {QUEUED} bytes reached the receiver",
            queued()
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    rt().block_on(async move {
        let s = TcpStream::from_std(server).unwrap();
        let ticks = Rc::new(Cell::new(0u64));
        let t = ticks.clone();
        let ticker = quiesce_runtime::spawn_local(async move {
            loop {
                t.set(t.get() + 1);
                quiesce_runtime::yield_now().await;
            }
        });
        quiesce_runtime::yield_now().await; // the ticker is running
        let before = ticks.get();
        let mut buf = vec![0u8; READ];
        for _ in 0..QUEUED / READ {
            let (r, b) = s.read_expected(buf).await;
            assert_eq!(r.unwrap(), READ);
            buf = b;
        }
        assert!(
            ticks.get() > before,
            "{} receives ran without another task running",
            QUEUED / READ
        );
        ticker.abort();
    });
}
