//! `Builder::spin`: the reactor busy-polls before it blocks, so work that
//! arrives meanwhile is taken without a park (and its wake-up); idle, it
//! still blocks.

mod common;

use std::time::{Duration, Instant};

use common::*;
use quiesce_runtime::net::{TcpListener, TcpStream};
use quiesce_runtime::shard::{channel, Receiver};
use quiesce_runtime::{stats, time, Runtime};

/// A channel whose only value another thread sends 5 ms from now.
fn sent_from_another_thread(v: u32) -> (Receiver<u32>, std::thread::JoinHandle<()>) {
    let (tx, rx) = channel::<u32>();
    let th = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(5));
        tx.send(v).unwrap();
    });
    (rx, th)
}

fn spinning(d: Duration) -> Runtime {
    Runtime::builder().spin(d).build().expect("runtime")
}

#[test]
fn a_wake_from_another_thread_while_spinning_needs_no_park() {
    let rt = spinning(Duration::from_secs(2));
    rt.block_on(async {
        let before = stats().parks;
        let (mut rx, th) = sent_from_another_thread(7);
        assert_eq!(rx.recv().await, Some(7));
        assert_eq!(
            stats().parks,
            before,
            "the reactor parked although it spins"
        );
        th.join().unwrap();
    });
}

#[test]
fn a_completion_while_spinning_needs_no_park() {
    let rt = spinning(Duration::from_secs(2));
    rt.block_on(async {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let th = std::thread::spawn(move || {
            use std::io::Write;
            let mut s = std::net::TcpStream::connect(addr).unwrap();
            std::thread::sleep(Duration::from_millis(5));
            s.write_all(b"ping").unwrap();
            std::thread::sleep(Duration::from_millis(50));
        });
        let (s, _) = l.accept().await.unwrap();
        let before = stats().parks;
        let (r, buf) = s.read(vec![0u8; 4]).await;
        assert_eq!(r.unwrap(), 4);
        assert_eq!(&buf, b"ping");
        assert_eq!(
            stats().parks,
            before,
            "the reactor parked although it spins"
        );
        drop::<TcpStream>(s);
        th.join().unwrap();
    });
}

#[test]
fn an_idle_spinning_runtime_still_blocks_and_its_timers_fire() {
    let idle = spinning(Duration::from_millis(1));
    idle.block_on(async {
        let before = stats().parks;
        let t0 = Instant::now();
        time::sleep(Duration::from_millis(50)).await;
        assert!(t0.elapsed() >= Duration::from_millis(50));
        assert!(stats().parks > before, "an idle runtime never blocked");
    });
    // Without spin, the same wake costs a park.
    rt().block_on(async {
        let before = stats().parks;
        let (mut rx, th) = sent_from_another_thread(7);
        assert_eq!(rx.recv().await, Some(7));
        assert!(stats().parks > before);
        th.join().unwrap();
    });
}

/// The spin uses part of the wait for the nearest timer, and the park after
/// it waits only for the rest: a 100 ms sleep on a runtime spinning 200 ms
/// fires after about 100 ms, not 200 (spin to the deadline, then park for
/// the whole timeout again).
#[test]
fn a_timer_is_not_late_by_the_spin() {
    spinning(Duration::from_millis(200)).block_on(async {
        let t0 = Instant::now();
        time::sleep(Duration::from_millis(100)).await;
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(100));
        assert!(took < Duration::from_millis(180), "fired after {took:?}");
    });
}

/// A source that counts the times the reactor armed it, and has work once
/// `ready` is set.
struct Counted {
    bell: quiesce_runtime::shm::Doorbell,
    /// Its other end, kept open (a doorbell whose other end is gone stays
    /// readable).
    _other: std::os::fd::OwnedFd,
    ready: std::sync::Arc<std::sync::atomic::AtomicBool>,
    arms: std::rc::Rc<std::cell::Cell<u32>>,
    waker: std::rc::Rc<std::cell::RefCell<Option<std::task::Waker>>>,
}

impl quiesce_runtime::source::CompletionSource for Counted {
    fn poll(&mut self) -> usize {
        use std::sync::atomic::Ordering;
        if !self.ready.swap(false, Ordering::AcqRel) {
            return 0;
        }
        if let Some(w) = self.waker.borrow_mut().take() {
            w.wake();
        }
        1
    }
    fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.bell.fd())
    }
    fn arm(&mut self) -> usize {
        self.arms.set(self.arms.get() + 1);
        self.poll()
    }
    fn notified(&mut self) {
        self.bell.quiet();
    }
}

/// Arming asks the source's peer for a notification (a doorbell it must
/// ring, a CQ event): a reactor that finds the work while it spins must not
/// have asked for one.
#[test]
fn a_spinning_reactor_arms_its_sources_only_when_it_blocks() {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    spinning(Duration::from_secs(2)).block_on(async {
        let ready = Arc::new(AtomicBool::new(false));
        let arms = std::rc::Rc::new(std::cell::Cell::new(0));
        let waker = std::rc::Rc::new(std::cell::RefCell::new(None));
        let (bell, other) = quiesce_runtime::shm::Doorbell::pair().unwrap();
        let _h = quiesce_runtime::source::register(Counted {
            bell,
            _other: other,
            ready: ready.clone(),
            arms: arms.clone(),
            waker: waker.clone(),
        });
        let set = ready.clone();
        let th = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(5));
            set.store(true, Ordering::Release);
        });
        let mut woken = false;
        std::future::poll_fn(|cx| {
            if woken {
                return std::task::Poll::Ready(());
            }
            woken = true;
            *waker.borrow_mut() = Some(cx.waker().clone());
            std::task::Poll::Pending
        })
        .await;
        th.join().unwrap();
        assert_eq!(arms.get(), 0, "armed while spinning");
    });
}

/// With `sqpoll`, a kernel thread takes the submissions, and once idle it
/// sleeps until an `io_uring_enter` wakes it (`IORING_ENTER_SQ_WAKEUP`). A
/// spinning reactor parks with a zero timeout; that park entered without
/// the flag, so what was queued after the thread fell asleep waited for
/// the spin to end.
#[test]
fn a_spinning_reactor_wakes_a_sleeping_sqpoll_thread() {
    let rt = match Runtime::builder()
        .sqpoll(Duration::from_millis(1))
        .spin(Duration::from_secs(5))
        .build()
    {
        Ok(rt) if is_uring(&rt) => rt,
        // The epoll driver chosen (QUIESCE_DRIVER=epoll), or no io_uring
        // (or no SQPOLL) here: nothing to check — but CI's kernel has
        // both, and a skip of its io_uring run would pass unseen.
        _ => {
            let epoll = std::env::var("QUIESCE_DRIVER").is_ok_and(|d| d == "epoll");
            assert!(
                epoll || std::env::var("CI").is_err(),
                "CI=true but no SQPOLL ring"
            );
            return;
        }
    };
    let took = rt.block_on(async {
        let (a, b) = pair().await;
        // The SQ thread idles past its 1 ms and sleeps.
        time::sleep(Duration::from_millis(30)).await;
        let t0 = Instant::now();
        let (r, _) = a.write_all(vec![7u8; 64]).await;
        r.unwrap();
        let (r, buf) = b.read(vec![0u8; 64]).await;
        assert_eq!(r.unwrap(), 64);
        assert_eq!(buf[0], 7);
        t0.elapsed()
    });
    assert!(
        took < Duration::from_secs(2),
        "queued until the spin ended: {took:?}"
    );
}
