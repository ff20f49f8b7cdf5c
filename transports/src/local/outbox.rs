//! The initiator's end of a mailbox ([`super::mailbox`]): publishing small
//! requests into its slots, and the reactor source that settles them when
//! the target's answers appear.

use std::cell::{Cell, RefCell};
use std::rc::{Rc, Weak};
use std::sync::atomic::Ordering;
use std::task::{Poll, Waker};

use quiesce_runtime::shm::SharedMemory;
use quiesce_runtime::source::{register, CompletionSource, SourceHandle};
use quiesce_runtime::IoBufMut;

use crate::control::wire::Status;
use crate::error::TransferError;
use crate::local::mailbox::{Kind, Mailbox, Word, SLOTS, SLOT_DATA};
use crate::tcp::conn::{Conn, SegmentGrant};
use crate::tcp::responses::Pending;
use crate::tcp::split::{Erased, Part};

/// The ring as this side keeps it.
struct Ring {
    mb: Mailbox,
    /// Requests published.
    submitted: Cell<u64>,
    /// Answers taken.
    seen: Cell<u64>,
    /// Each slot's request id and segment, as published (the target's copy
    /// of them is not read back).
    tasks: RefCell<[(u64, u64); SLOTS as usize]>,
    /// Requests waiting for a free slot.
    room: RefCell<Vec<Waker>>,
}

impl Ring {
    fn full(&self) -> bool {
        self.submitted.get() - self.seen.get() >= SLOTS
    }

    fn wake_all(&self) {
        let ws = std::mem::take(&mut *self.room.borrow_mut());
        ws.into_iter().for_each(Waker::wake);
    }
}

/// A mailbox this connection publishes its small requests in.
pub(crate) struct Outbox {
    ring: Rc<Ring>,
    _source: SourceHandle,
}

/// The reactor's look at the answers.
struct Answers {
    ring: Rc<Ring>,
    conn: Weak<Conn>,
}

impl Answers {
    fn take(&self) -> usize {
        let ring = &self.ring;
        let (seen, submitted, served) = (ring.seen.get(), ring.submitted.get(), ring.mb.served());
        if served == seen {
            return 0;
        }
        let Some(conn) = self.conn.upgrade() else {
            return 0;
        };
        if served.wrapping_sub(seen) > submitted - seen {
            conn.kill("the target answered mailbox requests never made");
            return 0;
        }
        for seq in seen..served {
            let (id, segment) = ring.tasks.borrow()[(seq % SLOTS) as usize];
            let st = ring.mb.word(seq, Word::Status).load(Ordering::Relaxed);
            let applied = ring.mb.word(seq, Word::Applied).load(Ordering::Relaxed);
            let Some(st) = u8::try_from(st).ok().and_then(Status::from_u8) else {
                conn.kill("a mailbox answer with an unknown status");
                return 0;
            };
            let (mem, at) = ring.mb.data(seq);
            conn.settle(id, segment, st, applied, |dst| copy_out(mem, at, dst));
        }
        ring.seen.set(served);
        ring.wake_all();
        (served - seen) as usize
    }
}

/// A read's bytes, from its slot into its destination.
fn copy_out(mem: &SharedMemory, at: usize, dst: &mut Erased) {
    let n = dst.len();
    mem.copy_into(at, dst, n);
}

impl CompletionSource for Answers {
    fn poll(&mut self) -> usize {
        self.ring.mb.awake();
        self.take()
    }

    fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.ring.mb.bell_fd())
    }

    fn arm(&mut self) -> usize {
        self.ring.mb.sleep();
        self.take()
    }

    fn notified(&mut self) {
        self.ring.mb.quiet();
        if self.ring.mb.gone() {
            // The target will never ring again: its answers would wait for
            // the deadline. (A dead target's socket ends too.)
            if let Some(conn) = self.conn.upgrade() {
                conn.kill("the target closed its end of the mailbox's doorbell");
            }
        }
    }

    fn hung_up(&self) -> bool {
        self.ring.mb.gone()
    }
}

impl Outbox {
    /// Starts watching `mb`'s answers for `conn` (on the current runtime).
    pub(crate) fn new(mb: Mailbox, conn: &Rc<Conn>) -> Outbox {
        // Both counts start at zero, as this side made the memory: the
        // target has had it since it took the offer, and whatever it wrote
        // into the counters is no count of ours (a served count ahead of
        // the requests made the first one overflow, or wait for a slot for
        // ever). Its later served counts are checked against ours.
        let ring = Rc::new(Ring {
            submitted: Cell::new(0),
            seen: Cell::new(0),
            mb,
            tasks: RefCell::new([(0, 0); SLOTS as usize]),
            room: RefCell::default(),
        });
        // Requests waiting for a slot learn of the connection's end.
        let r = ring.clone();
        conn.on_close(move || r.wake_all());
        Outbox {
            _source: register(Answers {
                ring: ring.clone(),
                conn: Rc::downgrade(conn),
            }),
            ring,
        }
    }
}

/// A request for a slot.
struct Post<'a> {
    kind: Kind,
    batch: u64,
    /// The segment, and (a write's) its handle's grant epoch.
    to: SegmentGrant,
    offset: u64,
    /// A write's bytes.
    data: &'a [u8],
    len: u64,
}

impl Conn {
    /// True once small requests go through a mailbox.
    pub(crate) fn has_outbox(&self) -> bool {
        self.outbox.get().is_some()
    }

    /// Writes `data` (at most [`SLOT_DATA`] bytes) to `to[offset..]`
    /// through the mailbox: copied into a slot, so nothing of the caller's
    /// buffer is reachable by the target.
    pub(crate) async fn write_mailbox(
        &self,
        batch: u64,
        to: SegmentGrant,
        offset: u64,
        data: &[u8],
    ) -> Result<u64, TransferError> {
        let post = Post {
            kind: Kind::Write,
            batch,
            to,
            offset,
            data,
            len: data.len() as u64,
        };
        self.post(post, None).await
    }

    /// Reads `segment[offset..offset + part.len()]` (at most [`SLOT_DATA`]
    /// bytes) into `part` through the mailbox: the target copies into a
    /// slot, this side from there into `part`.
    pub(crate) async fn read_mailbox<B: IoBufMut>(
        &self,
        batch: u64,
        segment: u64,
        offset: u64,
        part: Part<B>,
    ) -> Result<u64, TransferError> {
        let post = Post {
            kind: Kind::Read,
            batch,
            to: SegmentGrant {
                id: segment,
                ceiling: 0,
            },
            offset,
            data: &[],
            len: part.len() as u64,
        };
        self.post(post, Some(Erased::new(part))).await
    }

    async fn post(&self, p: Post<'_>, dst: Option<Erased>) -> Result<u64, TransferError> {
        debug_assert!(p.len as usize <= SLOT_DATA);
        let ring = &self.outbox.get().expect("a mailbox").ring;
        // Room first, then the send lock: a full ring must not hold back
        // this connection's fences.
        let mut g = loop {
            std::future::poll_fn(|cx| {
                if !ring.full() || self.is_dead() {
                    return Poll::Ready(());
                }
                ring.room.borrow_mut().push(cx.waker().clone());
                Poll::Pending
            })
            .await;
            let mut g = self.send_guard().await;
            if !ring.full() || self.is_dead() {
                break g;
            }
            g.complete = true;
        };
        if p.kind == Kind::Write && self.refuses_write(&mut g, p.to) {
            return Err(TransferError::Revoked { landed: 0 });
        }
        let id = self.new_id();
        let result = self.reply();
        let pending = match dst {
            None => Pending::Write {
                len: Some(p.len),
                result: result.clone(),
            },
            Some(dst) => Pending::Read {
                dst: Some(dst),
                result: result.clone(),
            },
        };
        if self.register(id, pending).is_err() {
            g.complete = true;
            return Err(self.lost());
        }
        if self.fenced_locally(&mut g, id, p.batch) {
            return Err(TransferError::Fenced);
        }
        // Published under the send lock: in the connection's order.
        let seq = ring.submitted.get();
        let mb = &ring.mb;
        for (w, v) in [
            (Word::Kind, p.kind as u64),
            (Word::Task, id),
            (Word::Batch, p.batch),
            (Word::Segment, p.to.id),
            (Word::Offset, p.offset),
            (Word::Length, p.len),
        ] {
            mb.word(seq, w).store(v, Ordering::Relaxed);
        }
        if p.kind == Kind::Write {
            let (mem, at) = mb.data(seq);
            mem.copy_from_slice(at, p.data);
        }
        ring.tasks.borrow_mut()[(seq % SLOTS) as usize] = (id, p.to.id);
        ring.submitted.set(seq + 1);
        mb.set_submitted(seq + 1);
        mb.wake();
        g.complete = true;
        drop(g);
        self.answer(result).await
    }
}
