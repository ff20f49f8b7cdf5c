//! The target's end of a mailbox ([`super::mailbox`]): `LocalMailbox`, and
//! serving the requests the initiator publishes there.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::io;
use std::rc::Rc;
use std::sync::atomic::Ordering;
use std::task::{Poll, Waker};
use std::time::Instant;

use quiesce_runtime::source::{register, CompletionSource, SourceHandle};

use crate::control::frame::send_frame;
use crate::control::server::{reject, status_frame, Closed, ServedConn};
use crate::control::wire::{Header, Opcode, Status};
use crate::local::mailbox::{Kind, Mailbox, Word, MAILBOX_PAYLOAD, SLOTS, SLOT_DATA};
use crate::memory::Window;
use crate::segment::Rights;

/// A mailbox this connection serves.
pub(crate) struct Inbox {
    mb: Rc<Mailbox>,
    /// Requests served: this side's own count, never read back from the
    /// mapping (the reactor's look compares with it too).
    served: Rc<Cell<u64>>,
    /// The serve loop, while it waits for a frame.
    waiter: Rc<RefCell<Option<Waker>>>,
    _source: SourceHandle,
}

/// The reactor's look at the mailbox: wakes the serve loop when requests
/// are published, asks the initiator to ring before the reactor blocks.
struct Arrivals {
    mb: Rc<Mailbox>,
    /// The inbox's own count: the mapping's `served` is the initiator's to
    /// write, and one moved past `submitted` would wake the serve loop at
    /// every turn for nothing.
    served: Rc<Cell<u64>>,
    waiter: Rc<RefCell<Option<Waker>>>,
}

impl Arrivals {
    /// Wakes the serve loop if it waits and requests are there.
    fn look(&self) -> usize {
        if self.waiter.borrow().is_none() || self.mb.submitted() == self.served.get() {
            return 0;
        }
        let waiter = self.waiter.borrow_mut().take();
        if let Some(w) = waiter {
            w.wake();
        }
        1
    }
}

impl CompletionSource for Arrivals {
    fn poll(&mut self) -> usize {
        self.mb.awake();
        self.look()
    }

    fn notify_fd(&self) -> Option<std::os::fd::RawFd> {
        Some(self.mb.bell_fd())
    }

    fn arm(&mut self) -> usize {
        self.mb.sleep();
        self.look()
    }

    fn notified(&mut self) {
        self.mb.quiet();
        if self.mb.gone() {
            // The serve loop closes the connection.
            if let Some(w) = self.waiter.borrow_mut().take() {
                w.wake();
            }
        }
    }

    fn hung_up(&self) -> bool {
        self.mb.gone()
    }
}

impl ServedConn<'_> {
    /// `LocalMailbox`: takes the initiator's mailbox and serves it from now
    /// on; answers `Status` `Ok`, or `Forbidden` (the connection is not
    /// attached, has a mailbox, or the files are not what they must be).
    pub(crate) async fn open_mailbox(&mut self, h: &Header) -> Result<(), Closed> {
        if h.length != MAILBOX_PAYLOAD as u64 {
            return Err(reject(self.s, h, Status::BadFrame, "bad mailbox payload".into()).await);
        }
        let p = self
            .idle
            .within(self.rx.payload(self.s, MAILBOX_PAYLOAD))
            .await??;
        let opened = match (&self.local, &self.inbox) {
            (Some(a), None) => Mailbox::open(a.process(), &p).map_err(|e| e.to_string()),
            (None, _) => Err("the connection is not attached".into()),
            (Some(_), Some(_)) => Err("the connection has a mailbox".into()),
        };
        let st = match opened {
            Ok(mb) => {
                let (mb, waiter) = (Rc::new(mb), Rc::new(RefCell::new(None)));
                // (Read from the mapping once, here.)
                let served = Rc::new(Cell::new(mb.served()));
                self.inbox = Some(Inbox {
                    mb: mb.clone(),
                    served: served.clone(),
                    _source: register(Arrivals {
                        mb,
                        served,
                        waiter: waiter.clone(),
                    }),
                    waiter,
                });
                Status::Ok
            }
            Err(why) => {
                tracing::debug!(why, "refused a mailbox");
                Status::Forbidden
            }
        };
        send_frame(self.s, &status_frame(h, st, 0), &[]).await?;
        Ok(())
    }

    /// Serves up to [`SLOTS`] requests published in the mailbox; returns how
    /// many. Call before acting on any frame read from the socket: the
    /// requests published before it was sent go first.
    pub(crate) fn serve_inbox(&self) -> Result<u64, Closed> {
        let Some(inbox) = &self.inbox else {
            return Ok(0);
        };
        let mb = &inbox.mb;
        if mb.gone() {
            // How an initiator's engine ends, dropped or its process gone:
            // its doorbell's end may close before its socket does. Nothing
            // more is served either way; a normal end, not a protocol break.
            return Err(Closed::Io(std::io::Error::new(
                std::io::ErrorKind::ConnectionAborted,
                "the initiator's doorbell is gone (its end closed, or files sent through it)",
            )));
        }
        let (start, end) = (inbox.served.get(), mb.submitted());
        let waiting = end.wrapping_sub(start);
        if waiting > SLOTS {
            return Err(Closed::Protocol(format!(
                "{waiting} mailbox requests published into {SLOTS} slots"
            )));
        }
        for seq in start..end {
            let (st, applied) = self.serve_slot(mb, seq);
            mb.word(seq, Word::Status)
                .store(st as u64, Ordering::Relaxed);
            mb.word(seq, Word::Applied)
                .store(applied, Ordering::Relaxed);
            if st != Status::Ok {
                let c = &self.engine.counters.rejected;
                c.set(c.get() + 1);
            }
        }
        if end != start {
            let c = &self.engine.counters.mailbox_requests;
            c.set(c.get() + waiting);
            inbox.served.set(end);
            mb.set_served(end);
            mb.wake();
        }
        Ok(waiting)
    }

    /// One request: the checks of a TCP `Write` or `Read`, then the copy.
    /// Nothing suspends in between, and fences and revokes run on this
    /// thread: no fence or revoke can find this copy half done, so it needs
    /// no registration with either.
    fn serve_slot(&self, mb: &Mailbox, seq: u64) -> (Status, u64) {
        let word = |w| mb.word(seq, w).load(Ordering::Relaxed);
        let (kind, length) = (Kind::from_word(word(Word::Kind)), word(Word::Length));
        let Some(kind) = kind.filter(|_| length as usize <= SLOT_DATA) else {
            return (Status::BadFrame, 0);
        };
        let h = Header {
            batch: word(Word::Batch),
            task: word(Word::Task),
            segment: word(Word::Segment),
            offset: word(Word::Offset),
            length,
            ..Header::new(match kind {
                Kind::Write => Opcode::Write,
                Kind::Read => Opcode::Read,
            })
        };
        let need = match kind {
            Kind::Write => Rights::WRITE,
            Kind::Read => Rights::READ,
        };
        let seg = match self.check(&h, need) {
            Ok((seg, _)) => seg,
            Err(st) => return (st, 0),
        };
        let mut window = Window::new(seg.inner.mem.clone(), h.offset as usize, length as usize);
        let (mem, at) = mb.data(seq);
        match kind {
            Kind::Write => {
                mem.copy_into(at, &mut window, length as usize);
                let c = &self.engine.counters;
                c.bytes_landed.set(c.bytes_landed.get() + length);
            }
            Kind::Read => mem.copy_from(at, &window),
        }
        (Status::Ok, length)
    }

    /// Waits for the next frame header from `read`, serving the mailbox
    /// meanwhile; an idle timeout counts the mailbox's requests as activity.
    pub(crate) async fn next_frame<T>(
        &mut self,
        read: impl Future<Output = io::Result<T>>,
    ) -> Result<T, Closed> {
        let mut read = std::pin::pin!(read);
        let idle = self.engine.config.idle_timeout;
        let mut limit = idle.map(quiesce_runtime::time::sleep);
        let mut active = false;
        std::future::poll_fn(|cx| {
            if let Poll::Ready(r) = read.as_mut().poll(cx) {
                return Poll::Ready(r.map_err(Closed::Io));
            }
            if let Some(inbox) = &self.inbox {
                *inbox.waiter.borrow_mut() = Some(cx.waker().clone());
            }
            match self.serve_inbox() {
                Err(e) => return Poll::Ready(Err(e)),
                Ok(0) => {}
                Ok(_) => {
                    active = true;
                    // More may be published meanwhile: look again after
                    // the reactor's next turn, not in a loop here.
                    cx.waker().wake_by_ref();
                }
            }
            if let (Some(l), Some(d)) = (limit.as_mut(), idle) {
                if std::pin::Pin::new(&mut *l).poll(cx).is_ready() {
                    if !std::mem::take(&mut active) {
                        return Poll::Ready(Err(Closed::TimedOut(format!("idle for {d:?}"))));
                    }
                    l.reset(Instant::now() + d);
                    let _ = std::pin::Pin::new(&mut *l).poll(cx);
                }
            }
            Poll::Pending
        })
        .await
    }
}
