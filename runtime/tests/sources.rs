//! Completion sources: busy-polled and fd-notified, with drain-after-arm.

mod common;

use std::cell::{Cell, RefCell};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Poll, Waker};
use std::time::Duration;

use common::*;
use quiesce_runtime::source::{register, CompletionSource};
use quiesce_runtime::time::sleep;

/// A fake completion queue: other threads push completions and (when armed)
/// write the eventfd, like an RDMA CQ with its completion channel.
struct FakeCq {
    shared: Arc<Shared>,
    /// Completions reaped, and the task waiting for them.
    reaped: Rc<Cell<u64>>,
    waiter: Rc<RefCell<Option<Waker>>>,
    arms: Rc<Cell<u64>>,
    notifies: Rc<Cell<u64>>,
}

struct Shared {
    pending: AtomicU64,
    armed: std::sync::atomic::AtomicBool,
    efd: OwnedFd,
}

impl Shared {
    fn push(&self) {
        self.pending.fetch_add(1, Ordering::SeqCst);
        if self.armed.swap(false, Ordering::SeqCst) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes to an eventfd we own.
            unsafe { libc::write(self.efd.as_raw_fd(), one.as_ptr().cast(), 8) };
        }
    }
}

impl FakeCq {
    fn drain(&mut self) -> usize {
        let n = self.shared.pending.swap(0, Ordering::SeqCst);
        if n > 0 {
            self.reaped.set(self.reaped.get() + n);
            if let Some(w) = self.waiter.borrow_mut().take() {
                w.wake();
            }
        }
        n as usize
    }
}

impl CompletionSource for FakeCq {
    fn poll(&mut self) -> usize {
        self.drain()
    }
    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.shared.efd.as_raw_fd())
    }
    fn arm(&mut self) -> usize {
        self.arms.set(self.arms.get() + 1);
        self.shared.armed.store(true, Ordering::SeqCst);
        self.drain() // drain after arm
    }
    fn notified(&mut self) {
        self.notifies.set(self.notifies.get() + 1);
        let mut v = [0u8; 8];
        // SAFETY: reads 8 bytes from our non-blocking eventfd into a live buffer.
        unsafe { libc::read(self.shared.efd.as_raw_fd(), v.as_mut_ptr().cast(), 8) };
    }
}

fn fake_cq() -> (FakeCq, Arc<Shared>) {
    // SAFETY: eventfd takes no pointers; checked below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a fresh fd nothing else owns.
    let efd = unsafe { OwnedFd::from_raw_fd(fd) };
    let shared = Arc::new(Shared {
        pending: AtomicU64::new(0),
        armed: false.into(),
        efd,
    });
    let cq = FakeCq {
        shared: shared.clone(),
        reaped: Rc::default(),
        waiter: Rc::default(),
        arms: Rc::default(),
        notifies: Rc::default(),
    };
    (cq, shared)
}

async fn wait_for(reaped: &Rc<Cell<u64>>, waiter: &Rc<RefCell<Option<Waker>>>, n: u64) {
    std::future::poll_fn(|cx| {
        if reaped.get() >= n {
            Poll::Ready(())
        } else {
            *waiter.borrow_mut() = Some(cx.waker().clone());
            Poll::Pending
        }
    })
    .await
}

#[test]
fn an_fd_source_wakes_a_parked_reactor() {
    let rt = rt();
    rt.block_on(async {
        let (cq, shared) = fake_cq();
        let (reaped, waiter, notifies) =
            (cq.reaped.clone(), cq.waiter.clone(), cq.notifies.clone());
        let _h = register(cq);
        let t = std::thread::spawn(move || {
            for _ in 0..5 {
                std::thread::sleep(Duration::from_millis(10));
                shared.push();
            }
        });
        // No timers, no I/O: only the source's fd can end each park.
        wait_for(&reaped, &waiter, 5).await;
        t.join().unwrap();
        assert!(notifies.get() >= 1);
    });
}

#[test]
fn drain_after_arm_finds_completions_that_raced_the_arm() {
    let rt = rt();
    rt.block_on(async {
        let (cq, shared) = fake_cq();
        let (reaped, waiter, arms) = (cq.reaped.clone(), cq.waiter.clone(), cq.arms.clone());
        let _h = register(cq);
        // A completion lands while the source is not armed: no eventfd write.
        shared.push();
        assert!(!shared.armed.load(Ordering::SeqCst));
        wait_for(&reaped, &waiter, 1).await;
        assert_eq!(reaped.get(), 1);
        let _ = arms;
    });
}

/// A busy-polled source (no fd) that counts its polls.
struct Spin(Rc<Cell<u64>>);
impl CompletionSource for Spin {
    fn poll(&mut self) -> usize {
        self.0.set(self.0.get() + 1);
        0
    }
}

#[test]
fn a_busy_source_is_polled_every_tick_and_deregisters_on_drop() {
    let rt = rt();
    rt.block_on(async {
        let polls = Rc::new(Cell::new(0));
        let h = register(Spin(polls.clone()));
        sleep(Duration::from_millis(20)).await;
        let n = polls.get();
        assert!(n > 10, "busy source polled only {n} times");
        drop(h);
        sleep(Duration::from_millis(5)).await;
        let after = polls.get();
        sleep(Duration::from_millis(5)).await;
        assert_eq!(polls.get(), after, "polled after deregistration");
    });
}

/// The kernel stops taking a submission queue's entries at the first one it
/// cannot prepare (here a timeout of `Duration::MAX`: a negative timespec)
/// and leaves the rest queued. A reactor that never blocks — it has a busy
/// source — must still submit them: the timeout queued after the refused
/// one fires.
#[test]
fn entries_queued_after_one_the_kernel_refuses_are_still_submitted() {
    use quiesce_runtime::time::{kernel_sleep, timeout};
    let rt = rt();
    rt.block_on(async {
        let _busy = register(Spin(Rc::new(Cell::new(0))));
        sleep(Duration::from_millis(5)).await;
        let refused = kernel_sleep(Duration::MAX);
        let fires = kernel_sleep(Duration::from_millis(1));
        let r = timeout(Duration::from_secs(2), fires).await;
        assert!(
            matches!(r, Ok(Ok(_))),
            "the later timeout never fired: {r:?}"
        );
        let _ = refused.await;
    });
}

/// A source dropped after its fd fired and before the reactor armed it
/// again stops waking the reactor. On epoll the fd stayed registered
/// (the firing cleared the source's "watching" mark, and the drop
/// unregisters only a watched fd): every later write to it woke the
/// reactor, for as long as anyone held the fd open.
#[test]
fn a_source_dropped_after_it_fired_no_longer_wakes_the_reactor() {
    let rt = rt();
    let (cq, shared) = fake_cq();
    let (reaped, waiter) = (cq.reaped.clone(), cq.waiter.clone());
    rt.block_on(async {
        let h = register(cq);
        let s = shared.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            s.push();
        });
        wait_for(&reaped, &waiter, 1).await;
        drop(h);
        t.join().unwrap();
    });
    let before = rt.block_on(async { quiesce_runtime::stats().ticks });
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let (s, st) = (shared.clone(), stop.clone());
    let writer = std::thread::spawn(move || {
        while !st.load(Ordering::SeqCst) {
            let one = 1u64.to_ne_bytes();
            // SAFETY: writes 8 bytes to the eventfd `s` keeps open.
            unsafe { libc::write(s.efd.as_raw_fd(), one.as_ptr().cast(), 8) };
            std::thread::sleep(Duration::from_millis(1));
        }
    });
    rt.block_on(sleep(Duration::from_millis(200)));
    stop.store(true, Ordering::SeqCst);
    writer.join().unwrap();
    let ticks = rt.block_on(async { quiesce_runtime::stats().ticks }) - before;
    assert!(
        ticks < 50,
        "{ticks} reactor turns in 200 ms of a dropped source's fd firing"
    );
}

/// A source whose fd hung up: one end of a socket pair whose other end is
/// closed, readable for good. It says so after its notification.
struct HungUp {
    fd: OwnedFd,
    gone: bool,
}

impl CompletionSource for HungUp {
    fn poll(&mut self) -> usize {
        0
    }
    fn notify_fd(&self) -> Option<RawFd> {
        Some(self.fd.as_raw_fd())
    }
    fn notified(&mut self) {
        let mut v = [0u8; 8];
        // SAFETY: reads at most 8 bytes into a live buffer, without blocking.
        let n = unsafe {
            libc::recv(
                self.fd.as_raw_fd(),
                v.as_mut_ptr().cast(),
                8,
                libc::MSG_DONTWAIT,
            )
        };
        self.gone |= n == 0;
    }
    fn hung_up(&self) -> bool {
        self.gone
    }
}

/// A source whose fd hung up (its other end gone: readable for good) is no
/// longer watched once it says so. io_uring's one-shot poll was armed again
/// at every turn and fired at once: the reactor never blocked again, one
/// core at 100 % for as long as the source lived.
#[test]
fn a_source_whose_fd_hung_up_no_longer_wakes_the_reactor() {
    let rt = rt();
    let mut fds = [0; 2];
    let kind = libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC;
    // SAFETY: writes two fds into a live array of two, or returns -1.
    assert_eq!(
        unsafe { libc::socketpair(libc::AF_UNIX, kind, 0, fds.as_mut_ptr()) },
        0
    );
    // SAFETY: socketpair returned two new descriptors nothing else owns.
    let (mine, theirs) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    drop(theirs);
    rt.block_on(async {
        let _h = register(HungUp {
            fd: mine,
            gone: false,
        });
        sleep(Duration::from_millis(20)).await;
        let before = quiesce_runtime::stats().ticks;
        sleep(Duration::from_millis(200)).await;
        let ticks = quiesce_runtime::stats().ticks - before;
        assert!(
            ticks < 50,
            "{ticks} reactor turns in 200 ms beside a hung-up source"
        );
    });
}

/// A source that, when polled, replaces itself: drops its own handle and
/// registers `next` (which the table puts in the slot it freed).
struct Replacing {
    handle: Rc<RefCell<Option<quiesce_runtime::source::SourceHandle>>>,
    next: Option<Spin>,
}

impl CompletionSource for Replacing {
    fn poll(&mut self) -> usize {
        if let Some(next) = self.next.take() {
            drop(self.handle.borrow_mut().take());
            *self.handle.borrow_mut() = Some(register(next));
        }
        0
    }
}

/// A source dropped while it runs, its slot taken at once by a new source,
/// does not come back over the new one: the new one is polled. The table
/// put the running source back into whatever entry held its key, dropping
/// the new source and polling the dead one in its place.
#[test]
fn a_source_replaced_while_it_runs_leaves_its_successor_in_place() {
    let rt = rt();
    rt.block_on(async {
        let polls = Rc::new(Cell::new(0));
        let handle = Rc::new(RefCell::new(None));
        let first = register(Replacing {
            handle: handle.clone(),
            next: Some(Spin(polls.clone())),
        });
        *handle.borrow_mut() = Some(first);
        sleep(Duration::from_millis(20)).await;
        assert!(
            polls.get() > 0,
            "the source registered in a running source's place was never polled"
        );
        drop(handle.borrow_mut().take());
    });
}

/// A source that, when dropped, tries to spawn a task and says whether the
/// runtime took it.
struct SpawnsOnDrop(Rc<Cell<Option<bool>>>);

impl CompletionSource for SpawnsOnDrop {
    fn poll(&mut self) -> usize {
        0
    }
}

impl Drop for SpawnsOnDrop {
    fn drop(&mut self) {
        let taken = quiesce_runtime::try_spawn_local(async {}).is_ok();
        self.0.set(Some(taken));
    }
}

/// A runtime that shuts down drops its sources after it closed to new
/// tasks: a spawn from one is refused (the future comes back), not taken
/// into a task that nothing would ever poll or drop.
#[test]
fn a_closed_runtime_refuses_a_spawn_from_a_source_it_drops() {
    let rt = rt();
    let taken = Rc::new(Cell::new(None));
    let t = taken.clone();
    let h = rt.block_on(async move { register(SpawnsOnDrop(t)) });
    std::mem::forget(h);
    drop(rt);
    assert_eq!(
        taken.get(),
        Some(false),
        "the closed runtime took the spawn"
    );
}
