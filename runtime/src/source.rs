//! Completion sources: how a transport plugs its own completion queue (an
//! RDMA CQ) into the reactor.
//!
//! Every tick the reactor calls [`CompletionSource::poll`] on each source.
//! Before it blocks, it calls [`CompletionSource::arm`] on each source that
//! has a notification fd, then waits on those fds together with io_uring or
//! epoll. The contract that makes this lossless is **drain after arm**: `arm`
//! requests a notification (`ibv_req_notify_cq`) and only then polls the
//! queue once more, returning what it found. A completion that arrived
//! between the last `poll` and the arm is found by that drain (and the
//! reactor does not block); one that arrives after the arm triggers the fd.
//! When the fd fires, [`CompletionSource::notified`] consumes the event
//! (`ibv_get_cq_event` + `ibv_ack_cq_events`) and the next tick polls.
//!
//! A source without a notification fd is busy-polled: while it is registered
//! the reactor never blocks (the usual mode for low-latency RDMA).

use std::cell::Cell;
use std::os::fd::RawFd;
use std::rc::Rc;

use slab::Slab;

use crate::context::{self, Context};

/// A queue of completions that the reactor polls.
pub trait CompletionSource: 'static {
    /// Reaps ready completions without blocking (waking their tasks). Returns
    /// how many were reaped.
    fn poll(&mut self) -> usize;

    /// The fd that becomes readable when an armed source has news; `None`
    /// makes the source busy-polled.
    fn notify_fd(&self) -> Option<RawFd> {
        None
    }

    /// Called right before the reactor blocks: request a notification, then
    /// drain once more. Returns how many completions that drain reaped (the
    /// reactor then does not block).
    fn arm(&mut self) -> usize {
        0
    }

    /// Called when `notify_fd` became readable: consume the event so the fd
    /// is quiet again (on epoll it is edge-triggered: consume it fully).
    fn notified(&mut self) {}

    /// True once `notify_fd` hung up: readable for good (its other end is
    /// gone), it can never bring news again. Asked after each
    /// [`notified`](Self::notified); from then on the fd is not watched
    /// (a watch would fire at every turn, and the reactor never block):
    /// the source is still polled at each turn the reactor takes, but
    /// nothing of it wakes the reactor any more.
    fn hung_up(&self) -> bool {
        false
    }
}

struct Entry {
    gen: u32,
    /// Taken out while the source runs, so a source may register others.
    src: Option<Box<dyn CompletionSource>>,
    fd: Option<RawFd>,
    watching: bool,
    /// Its fd hung up ([`CompletionSource::hung_up`]): never watched again.
    hung_up: bool,
}

/// Sources of one runtime.
#[derive(Default)]
pub(crate) struct Sources {
    slab: Slab<Entry>,
    busy: usize,
}

/// Keeps a source registered; dropping it deregisters the source (and drops it).
///
/// The handle holds its runtime: dropped anywhere on the thread, it removes
/// the source from that runtime.
pub struct SourceHandle {
    token: u64,
    cx: Rc<Context>,
}

/// Registers `src` with the current runtime.
///
/// # Panics
/// Outside a runtime.
pub fn register<S: CompletionSource>(src: S) -> SourceHandle {
    let cx = context::current();
    let token = {
        let fd = src.notify_fd();
        let mut s = cx.sources.borrow_mut();
        let gen = cx.counters.next_gen();
        let key = s.slab.insert(Entry {
            gen,
            src: Some(Box::new(src)),
            fd,
            watching: false,
            hung_up: false,
        });
        if fd.is_none() {
            s.busy += 1;
        }
        (u64::from(gen) << 32) | key as u64
    };
    SourceHandle { token, cx }
}

impl Drop for SourceHandle {
    fn drop(&mut self) {
        let cx = &self.cx;
        let removed = (|| {
            let key = (self.token & 0xffff_ffff) as usize;
            let entry = {
                let mut s = cx.sources.borrow_mut();
                match s.slab.get(key) {
                    Some(e) if e.gen == (self.token >> 32) as u32 => {}
                    _ => return None,
                }
                let e = s.slab.remove(key);
                if e.fd.is_none() {
                    s.busy -= 1;
                }
                e
            };
            if let (true, Some(fd)) = (entry.watching, entry.fd) {
                match cx.driver.try_borrow_mut() {
                    Ok(mut d) => d.unwatch_source(fd, self.token, &cx.counters),
                    Err(_) => tracing::error!(
                        "a source dropped while its driver is busy; its fd stays watched"
                    ),
                }
            }
            Some(entry)
        })();
        drop(removed);
    }
}

impl Sources {
    /// True when a busy-polled source forbids blocking.
    pub(crate) fn busy(&self) -> bool {
        self.busy > 0
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.slab.is_empty()
    }

    /// Every key is below this (walking `0..bound` allocates nothing, unlike
    /// collecting the keys: this runs every tick).
    fn key_bound(&self) -> usize {
        self.slab.capacity()
    }
}

/// Runs `f` on source `key` with the source taken out of the table. It goes
/// back only into its own entry: one `f` dropped (its handle) is dropped
/// here, even if a source registered meanwhile took the same key.
fn with_source<R>(
    cx: &Context,
    key: usize,
    f: impl FnOnce(&mut dyn CompletionSource) -> R,
) -> Option<R> {
    let (mut src, gen) = {
        let mut s = cx.sources.borrow_mut();
        let e = s.slab.get_mut(key)?;
        (e.src.take()?, e.gen)
    };
    let r = f(&mut *src);
    let back = match cx.sources.borrow_mut().slab.get_mut(key) {
        Some(e) if e.gen == gen => {
            e.src = Some(src);
            None
        }
        _ => Some(src),
    };
    // Outside the borrow: dropping a source may deregister others.
    drop(back);
    Some(r)
}

/// Polls every source; returns the completions reaped.
pub(crate) fn poll_all(cx: &Context) -> usize {
    if cx.sources.borrow().is_empty() {
        return 0;
    }
    let bound = cx.sources.borrow().key_bound();
    (0..bound)
        .filter_map(|k| with_source(cx, k, |s| s.poll()))
        .sum()
}

/// Arms every source with an fd and makes sure the driver watches the fd.
/// Returns the completions found by the drain after arm.
pub(crate) fn arm_all(cx: &Context) -> std::io::Result<usize> {
    if cx.sources.borrow().is_empty() {
        return Ok(0);
    }
    let found = Cell::new(0);
    let bound = cx.sources.borrow().key_bound();
    for key in 0..bound {
        let Some((fd, gen)) = cx
            .sources
            .borrow()
            .slab
            .get(key)
            .and_then(|e| Some((e.fd.filter(|_| !e.hung_up)?, e.gen)))
        else {
            continue;
        };
        found.set(found.get() + with_source(cx, key, |s| s.arm()).unwrap_or(0));
        // (Dropped while it armed: its entry is gone, or another's.)
        let watching = match cx.sources.borrow().slab.get(key) {
            Some(e) if e.gen == gen => e.watching,
            _ => continue,
        };
        if !watching {
            let token = (u64::from(gen) << 32) | key as u64;
            cx.driver
                .borrow_mut()
                .watch_source(fd, token, &cx.counters)?;
            cx.sources.borrow_mut().slab[key].watching = true;
        }
    }
    Ok(found.get())
}

/// The driver reported source `token`'s fd readable.
pub(crate) fn notified(cx: &Context, token: u64) {
    let key = (token & 0xffff_ffff) as usize;
    // io_uring polls are one-shot: the fd is no longer watched. An epoll
    // registration stays (re-arming it is idempotent), and a source dropped
    // before the next arm must still take it away, or its fd goes on
    // waking the reactor.
    let one_shot = matches!(*cx.driver.borrow(), crate::driver::Driver::Uring(_));
    {
        let mut s = cx.sources.borrow_mut();
        match s.slab.get_mut(key) {
            Some(e) if e.gen == (token >> 32) as u32 => {
                if one_shot {
                    e.watching = false;
                }
            }
            _ => return,
        }
    }
    let hung_up = with_source(cx, key, |s| {
        s.notified();
        s.hung_up()
    });
    if hung_up != Some(true) {
        return;
    }
    let fd = {
        let mut s = cx.sources.borrow_mut();
        let Some(e) = s
            .slab
            .get_mut(key)
            .filter(|e| e.gen == (token >> 32) as u32)
        else {
            return;
        };
        e.hung_up = true;
        e.fd.filter(|_| std::mem::replace(&mut e.watching, false))
    };
    // Watched still (epoll): taken away, or it fires at every event.
    if let Some(fd) = fd {
        match cx.driver.try_borrow_mut() {
            Ok(mut d) => d.unwatch_source(fd, token, &cx.counters),
            Err(_) => tracing::error!("a hung-up source's fd stays watched: its driver is busy"),
        }
    }
}
