//! Multishot `recv` into a pool of provided buffers.
//!
//! On io_uring the pool is a provided-buffer ring (`IORING_REGISTER_PBUF_RING`)
//! and one `RECV` SQE with `IORING_RECV_MULTISHOT` yields a CQE per message,
//! each naming the buffer the kernel picked. On epoll the pool is a free list
//! and each readiness edge runs `recv` into a free buffer. Either way a
//! received [`PooledBuf`] goes back to the pool when it is dropped.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::io;
use std::ops::Deref;
use std::os::fd::RawFd;
use std::rc::Rc;
use std::sync::atomic::{AtomicU16, Ordering};
use std::task::{Context as TaskCx, Poll};

use io_uring::{cqueue, opcode, types};

use super::{cvt, sealed, Operation};
use crate::context::{self, Context};
use crate::driver::lifecycle::{cqe_result, Lifecycle};
use crate::driver::shared_fd::SharedFd;
use crate::driver::{Driver, Interest};

enum PoolKind {
    /// Registered with io_uring as buffer group `bgid`.
    Ring {
        ring: *mut types::BufRingEntry,
        ring_layout: Layout,
        bgid: u16,
        tail: Cell<u16>,
        /// The runtime whose ring the pool is registered with.
        cx: Rc<Context>,
    },
    /// epoll: ids of free buffers.
    List(RefCell<Vec<u16>>),
}

struct PoolInner {
    mem: *mut u8,
    mem_layout: Layout,
    buf_len: usize,
    count: u16,
    kind: PoolKind,
}

/// A pool of equally sized receive buffers for [`RecvMulti`].
///
/// Cheap to clone (it is reference counted). Its memory is freed when the
/// last clone, the last [`PooledBuf`] and the last operation using it are gone.
#[derive(Clone)]
pub struct BufPool {
    inner: Rc<PoolInner>,
}

impl BufPool {
    /// Creates a pool of `count` buffers of `buf_len` bytes on the current
    /// runtime. `count` must be a power of two, at most 32768.
    pub fn new(count: u16, buf_len: usize) -> io::Result<BufPool> {
        if count == 0 || !count.is_power_of_two() || count > 32768 || buf_len == 0 {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "BufPool needs a power-of-two count <= 32768 and a non-zero buffer length",
            ));
        }
        let total = buf_len
            .checked_mul(count as usize)
            .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "BufPool too large"))?;
        let mem_layout = Layout::from_size_align(total, 4096).map_err(io::Error::other)?;
        // SAFETY: the layout has a non-zero size.
        let mem = unsafe { alloc_zeroed(mem_layout) };
        if mem.is_null() {
            return Err(io::ErrorKind::OutOfMemory.into());
        }
        let cx = context::current();
        let kind = (|| -> io::Result<PoolKind> {
            match &mut *cx.driver.borrow_mut() {
                Driver::Uring(u) => {
                    let ring_layout = Layout::from_size_align(
                        count as usize * std::mem::size_of::<types::BufRingEntry>(),
                        4096,
                    )
                    .map_err(io::Error::other)?;
                    // SAFETY: non-zero size.
                    let ring = unsafe { alloc_zeroed(ring_layout) } as *mut types::BufRingEntry;
                    if ring.is_null() {
                        return Err(io::ErrorKind::OutOfMemory.into());
                    }
                    match u.register_buf_ring(ring, count) {
                        Ok(bgid) => Ok(PoolKind::Ring {
                            ring,
                            ring_layout,
                            bgid,
                            tail: Cell::new(0),
                            cx: cx.clone(),
                        }),
                        Err(e) => {
                            // SAFETY: allocated above with this layout, never shared.
                            unsafe { dealloc(ring.cast(), ring_layout) };
                            Err(e)
                        }
                    }
                }
                Driver::Poll(_) => Ok(PoolKind::List(RefCell::new(Vec::with_capacity(
                    count as usize,
                )))),
            }
        })();
        let kind = match kind {
            Ok(k) => k,
            Err(e) => {
                // SAFETY: allocated above with this layout, never shared.
                unsafe { dealloc(mem, mem_layout) };
                return Err(e);
            }
        };
        let inner = PoolInner {
            mem,
            mem_layout,
            buf_len,
            count,
            kind,
        };
        for bid in 0..count {
            inner.recycle(bid);
        }
        Ok(BufPool {
            inner: Rc::new(inner),
        })
    }

    /// Length of each buffer.
    pub fn buf_len(&self) -> usize {
        self.inner.buf_len
    }

    /// Number of buffers.
    pub fn count(&self) -> u16 {
        self.inner.count
    }
}

impl PoolInner {
    fn buf_ptr(&self, bid: u16) -> *mut u8 {
        self.mem.wrapping_add(bid as usize * self.buf_len)
    }

    /// Hands buffer `bid` back to the kernel (ring) or the free list.
    fn recycle(&self, bid: u16) {
        match &self.kind {
            PoolKind::List(free) => free.borrow_mut().push(bid),
            PoolKind::Ring { ring, tail, .. } => {
                let t = tail.get();
                let idx = (t & (self.count - 1)) as usize;
                // idx < count, so the entry lies inside the ring allocation; only this
                // thread writes entries, and the kernel reads them only after the tail
                // store below publishes them.
                // SAFETY: as just said: in bounds, not shared until published.
                unsafe {
                    let e = &mut *ring.add(idx);
                    e.set_addr(self.buf_ptr(bid) as u64);
                    e.set_len(self.buf_len as u32);
                    e.set_bid(bid);
                }
                let t = t.wrapping_add(1);
                tail.set(t);
                // The tail field overlays entry 0's reserved field, inside the ring;
                // AtomicU16 has u16's layout. Release publishes the entry.
                // SAFETY: as just said: in bounds and of the right layout.
                unsafe {
                    (*(types::BufRingEntry::tail(*ring) as *const AtomicU16))
                        .store(t, Ordering::Release)
                };
            }
        }
    }
}

impl Drop for PoolInner {
    fn drop(&mut self) {
        if let PoolKind::Ring {
            ring,
            ring_layout,
            bgid,
            cx,
            ..
        } = &self.kind
        {
            // The pool holds its runtime's context, so the ring is still there.
            let unregistered = match cx.driver.try_borrow_mut() {
                Ok(mut d) => match &mut *d {
                    Driver::Uring(u) => u.unregister_buf_ring(*bgid).is_ok(),
                    Driver::Poll(_) => false,
                },
                Err(_) => false,
            };
            if !unregistered {
                tracing::warn!(
                    bgid,
                    "could not unregister a buffer ring; leaking its memory"
                );
                return;
            }
            // SAFETY: allocated in `new` with this layout; the kernel no longer uses it.
            unsafe { dealloc(ring.cast(), *ring_layout) };
        }
        // SAFETY: allocated in `new` with this layout; every PooledBuf and op that
        // referenced it held this Rc, so none is left.
        unsafe { dealloc(self.mem, self.mem_layout) };
    }
}

/// One received message, in a buffer borrowed from a [`BufPool`]. Derefs to
/// the received bytes; dropping it returns the buffer to the pool.
pub struct PooledBuf {
    pool: Rc<PoolInner>,
    bid: u16,
    len: usize,
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the kernel (or recv) wrote `len` bytes into buffer `bid`, which this
        // value owns until it drops.
        unsafe { std::slice::from_raw_parts(self.pool.buf_ptr(self.bid), self.len) }
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        self.pool.recycle(self.bid);
    }
}

impl std::fmt::Debug for PooledBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PooledBuf")
            .field("bid", &self.bid)
            .field("len", &self.len)
            .finish()
    }
}

/// The parked form of a multishot recv: recycles buffers of late CQEs.
struct MultiSpec {
    fd: SharedFd,
    pool: Rc<PoolInner>,
}

impl sealed::Sealed for MultiSpec {}

impl Operation for MultiSpec {
    type Output = ();
    fn uring_entry(&mut self) -> io_uring::squeue::Entry {
        let bgid = match &self.pool.kind {
            PoolKind::Ring { bgid, .. } => *bgid,
            PoolKind::List(_) => unreachable!("a free-list pool on io_uring"),
        };
        opcode::RecvMulti::new(types::Fd(self.fd.raw()), bgid).build()
    }
    fn complete(self, _res: io::Result<u32>, _flags: u32) {}
    fn poll_fd(&self) -> Option<(RawFd, Interest)> {
        Some((self.fd.raw(), Interest::Read))
    }
    fn poll_try(&mut self) -> io::Result<u32> {
        Err(io::ErrorKind::Unsupported.into())
    }
    fn parked_cqe(&mut self, _res: i32, flags: u32) {
        if let Some(bid) = cqueue::buffer_select(flags) {
            self.pool.recycle(bid);
        }
    }
}

/// A stream of received messages from one multishot recv.
///
/// Like an [`Op`](crate::Op) it belongs to the runtime of its socket: polled
/// or dropped anywhere, it talks to that runtime's driver, and it holds the
/// socket's fd until its final CQE.
pub struct RecvMulti {
    /// The socket's runtime.
    cx: Rc<Context>,
    spec: Option<MultiSpec>,
    /// io_uring slot of the armed op, until its final CQE has been reaped.
    armed: Option<u64>,
    /// EOF or a final error was returned.
    finished: bool,
}

impl RecvMulti {
    pub(crate) fn new(fd: SharedFd, pool: &BufPool) -> Self {
        let mut s = RecvMulti {
            cx: fd.context().clone(),
            spec: Some(MultiSpec {
                fd,
                pool: pool.inner.clone(),
            }),
            armed: None,
            finished: false,
        };
        if s.is_ring() && !s.cx.closed.get() {
            s.arm();
        }
        s
    }

    fn arm(&mut self) -> u64 {
        let entry = self
            .spec
            .as_mut()
            .expect("spec present until drop")
            .uring_entry();
        let cx = &self.cx;
        let token = match &mut *cx.driver.borrow_mut() {
            Driver::Uring(u) => u.submit(
                entry,
                Lifecycle::Multi {
                    queue: VecDeque::new(),
                    waker: None,
                    done: false,
                },
                &cx.counters,
            ),
            Driver::Poll(_) => unreachable!("a ring pool on epoll"),
        };
        self.armed = Some(token);
        token
    }

    /// The next message: `Some(Ok(buf))`, `Some(Err(e))` (`ENOBUFS` when the
    /// pool is empty: drop some buffers and call again), or `None` at EOF.
    pub async fn next(&mut self) -> Option<io::Result<PooledBuf>> {
        std::future::poll_fn(|tcx| self.poll_next(tcx)).await
    }

    /// Polls for the next message; see [`next`](Self::next).
    pub fn poll_next(&mut self, tcx: &mut TaskCx<'_>) -> Poll<Option<io::Result<PooledBuf>>> {
        if self.finished {
            return Poll::Ready(None);
        }
        if !self.is_ring() {
            return self.poll_list(tcx);
        }
        let token = match self.armed {
            Some(t) => t,
            // Nothing would ever reap it.
            None if self.cx.closed.get() => {
                self.finished = true;
                return Poll::Ready(Some(Err(io::Error::other(
                    "the stream's runtime has shut down",
                ))));
            }
            None => self.arm(),
        };
        let got = match &mut *self.cx.driver.borrow_mut() {
            Driver::Uring(u) => u.poll_multi(token, tcx.waker()),
            Driver::Poll(_) => unreachable!("a ring pool on epoll"),
        };
        let Some((res, flags, last)) = got else {
            return Poll::Pending;
        };
        if last {
            self.armed = None;
        }
        let pool = self.spec.as_ref().expect("spec").pool.clone();
        match (cqe_result(res), cqueue::buffer_select(flags)) {
            (Ok(n), Some(bid)) if n > 0 => Poll::Ready(Some(Ok(PooledBuf {
                pool,
                bid,
                len: n as usize,
            }))),
            (Ok(_), bid) => {
                // EOF: the peer closed its side.
                if let Some(bid) = bid {
                    pool.recycle(bid);
                }
                self.finished = true;
                self.cancel();
                Poll::Ready(None)
            }
            (Err(e), bid) => {
                if let Some(bid) = bid {
                    pool.recycle(bid);
                }
                if last && e.raw_os_error() != Some(libc::ENOBUFS) {
                    self.finished = true;
                }
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    fn is_ring(&self) -> bool {
        self.spec
            .as_ref()
            .is_some_and(|s| matches!(s.pool.kind, PoolKind::Ring { .. }))
    }

    fn poll_list(&mut self, tcx: &mut TaskCx<'_>) -> Poll<Option<io::Result<PooledBuf>>> {
        if crate::executor::poll_budget(tcx).is_pending() {
            return Poll::Pending;
        }
        let spec = self.spec.as_ref().expect("spec");
        let PoolKind::List(free) = &spec.pool.kind else {
            unreachable!()
        };
        let Some(bid) = free.borrow_mut().pop() else {
            return Poll::Ready(Some(Err(io::Error::from_raw_os_error(libc::ENOBUFS))));
        };
        let ptr = spec.pool.buf_ptr(bid);
        // SAFETY: buffer `bid` was free, so nothing else references its bytes.
        let r = cvt(unsafe {
            libc::recv(
                spec.fd.raw(),
                ptr.cast(),
                spec.pool.buf_len,
                libc::MSG_DONTWAIT,
            )
        });
        match r {
            Ok(0) => {
                spec.pool.recycle(bid);
                self.finished = true;
                Poll::Ready(None)
            }
            Ok(n) => Poll::Ready(Some(Ok(PooledBuf {
                pool: spec.pool.clone(),
                bid,
                len: n as usize,
            }))),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                spec.pool.recycle(bid);
                let fd = spec.fd.raw();
                let reg = match &mut *self.cx.driver.borrow_mut() {
                    Driver::Poll(p) => p.wait(fd, Interest::Read, tcx.waker()),
                    Driver::Uring(_) => unreachable!("a free-list pool on io_uring"),
                };
                match reg {
                    Ok(()) => Poll::Pending,
                    Err(e) => Poll::Ready(Some(Err(e))),
                }
            }
            Err(e) => {
                spec.pool.recycle(bid);
                Poll::Ready(Some(Err(e)))
            }
        }
    }

    /// Stops the stream: cancels the multishot op; buffers of messages not yet
    /// taken go back to the pool.
    pub fn cancel(&mut self) {
        if let Some(token) = self.armed {
            let cx = &self.cx;
            if let Driver::Uring(u) = &mut *cx.driver.borrow_mut() {
                u.cancel(token, &cx.counters);
            }
        }
    }
}

impl Drop for RecvMulti {
    fn drop(&mut self) {
        let spec = self.spec.take().expect("spec");
        let Some(token) = self.armed else { return };
        crate::driver::lifecycle::park(&self.cx, token, Box::new(spec));
    }
}
