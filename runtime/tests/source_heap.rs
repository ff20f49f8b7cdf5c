//! A completion source whose fd fires allocates nothing per firing: a
//! doorbell rung once per request (the local transport's mailbox, an RDMA
//! completion channel) must not cost the reactor an allocation each time.

use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::{Poll, Waker};

use quiesce_runtime::heap::{CountingAlloc, Heap};
use quiesce_runtime::shm::Doorbell;
use quiesce_runtime::source::{register, CompletionSource};
use quiesce_runtime::Runtime;

#[global_allocator]
static HEAP: CountingAlloc = CountingAlloc;

/// Counts its doorbell's rings, waking the task that waits for one.
struct Rung {
    bell: Rc<Doorbell>,
    rings: Rc<Cell<u64>>,
    waiter: Rc<RefCell<Option<Waker>>>,
}

impl CompletionSource for Rung {
    fn poll(&mut self) -> usize {
        0
    }
    fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.bell.fd())
    }
    fn notified(&mut self) {
        self.bell.quiet();
        self.rings.set(self.rings.get() + 1);
        let w = self.waiter.borrow_mut().take();
        if let Some(w) = w {
            w.wake();
        }
    }
}

#[test]
fn a_source_whose_fd_fires_allocates_nothing_per_firing() {
    // One test in this binary: no other thread allocates meanwhile.
    let rt = Runtime::new().unwrap();
    rt.block_on(async {
        let (bell, other) = Doorbell::pair().unwrap();
        let (bell, watched) = (Rc::new(bell), Rc::new(Doorbell::open(other).unwrap()));
        let rings = Rc::new(Cell::new(0));
        let waiter = Rc::new(RefCell::new(None::<Waker>));
        let _h = register(Rung {
            bell: watched,
            rings: rings.clone(),
            waiter: waiter.clone(),
        });
        let rounds = |n: u64| {
            let (bell, rings, waiter) = (bell.clone(), rings.clone(), waiter.clone());
            async move {
                for _ in 0..n {
                    let want = rings.get() + 1;
                    bell.ring();
                    std::future::poll_fn(|cx| {
                        if rings.get() >= want {
                            return Poll::Ready(());
                        }
                        *waiter.borrow_mut() = Some(cx.waker().clone());
                        Poll::Pending
                    })
                    .await;
                }
            }
        };
        rounds(10).await;
        let before = Heap::now().allocations;
        rounds(200).await;
        let made = Heap::now().allocations - before;
        assert!(
            made < 20,
            "{made} allocations for 200 firings of a source's fd"
        );
    });
}
