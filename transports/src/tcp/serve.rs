//! The target's TCP data path: `Write` and `Read` frames on a connection
//! the control server accepted and authenticated.
//!
//! Every request is checked before memory is touched — length, fence,
//! proven token, segment, right, `offset + length` inside the segment
//! without overflow — and a rejected write's payload is dropped unread
//! (`frame::discard`), never landed in the segment. What was read ahead
//! with a write's header (a small write's whole payload:
//! `control/read_ahead.rs`) is copied into the segment; the rest lands
//! straight in it (receives into the destination range, no copy).
//! Acknowledged after the last byte.

use std::io;
use std::rc::Rc;

use quiesce_runtime::timeline::{self, Step};

use crate::control::frame::{frame_filled, send_frame_buffer};
use crate::control::revoke::LandingGuard;
use crate::control::server::{reject, status_frame, Closed, ServedConn};
use crate::control::wire::{Header, Opcode, Status};
use crate::memory::Window;
use crate::segment::{Rights, Segment};

/// Reads up to this size are answered with header and data in one send.
const INLINE_READ: u64 = 16 * 1024;

/// A write landing in a segment, as the fence table and the segment's grants
/// know it.
struct Landing {
    fence: crate::control::fence::WriteGuard,
    grant: LandingGuard,
}

/// Where a write's [`Landing`] lives while it lands: each receive's window
/// holds the cell, so a receive parked because the write's future was
/// dropped keeps the registrations until it is reaped. A write that finishes
/// empties the cell itself, and the connection reuses it for the next write
/// when no parked receive holds it any more.
#[derive(Default)]
pub(crate) struct LandingCell(std::cell::RefCell<Option<Landing>>);

impl LandingCell {
    fn with<R>(&self, f: impl FnOnce(&Landing) -> R) -> R {
        f(self
            .0
            .borrow()
            .as_ref()
            .expect("a landing write is in its cell"))
    }
}

/// The status of a request a revoke or a fence cut after `landed` bytes.
pub(crate) fn cut_short(revoked: bool, landed: u64) -> Status {
    match (revoked, landed) {
        (true, _) => Status::Revoked,
        (false, 0) => Status::Fenced,
        (false, _) => Status::FencedPartial,
    }
}

impl ServedConn<'_> {
    /// The segment and this connection's grant epoch, if the request may
    /// touch it: length within `1..=max`, batch not fenced, segment known,
    /// token proven, right granted, range inside the segment without
    /// overflow, and (writes) not revoked since the token was proven.
    pub(crate) fn check(&self, h: &Header, need: Rights) -> Result<(Segment, u64), Status> {
        // A local request carries no payload: only the segment bounds it.
        let local = matches!(h.op, Opcode::WriteLocal | Opcode::ReadLocal);
        if h.length == 0 || (!local && h.length > self.engine.config.max_frame) {
            return Err(Status::BadFrame);
        }
        if self.engine.fences.is_fenced(self.session, h.batch) {
            return Err(Status::Fenced);
        }
        // Forbidden before NoSuchSegment: only a peer that proved the
        // segment's token learns that it is gone.
        let Some(&epoch) = self.authorised.get(&h.segment) else {
            return Err(Status::Forbidden);
        };
        let seg = self
            .engine
            .segment(h.segment)
            .ok_or(Status::NoSuchSegment)?;
        if !seg.rights().contains(need) {
            return Err(Status::Forbidden);
        }
        if !seg.check_range(h.offset, h.length) {
            return Err(Status::OutOfBounds);
        }
        if need.contains(Rights::WRITE) && seg.inner.grants.is_revoked(h.offset, h.length, epoch) {
            return Err(Status::Revoked);
        }
        Ok((seg, epoch))
    }

    /// Answers a refused request; a refused write's payload is dropped.
    pub(crate) async fn refuse(
        &mut self,
        h: &Header,
        st: Status,
        payload: u64,
    ) -> Result<(), Closed> {
        // Each receive bounded by the idle limit (one that stops closes it).
        self.rx
            .discard(self.s, payload, Some(&mut self.idle))
            .await?;
        let c = &self.engine.counters.rejected;
        c.set(c.get() + 1);
        self.send(&status_frame(h, st, 0), &[]).await?;
        timeline::mark(Step::RefusalSent);
        Ok(())
    }

    pub(crate) async fn write(&mut self, h: &Header) -> Result<(), Closed> {
        if h.length > self.engine.config.max_frame {
            // The payload cannot be trusted to be there: framing is lost.
            return Err(reject(
                self.s,
                h,
                Status::BadFrame,
                format!("write of {} bytes", h.length),
            )
            .await);
        }
        let (seg, epoch) = match self.check(h, Rights::WRITE) {
            Ok(ok) => ok,
            Err(st) => return self.refuse(h, st, h.length).await,
        };
        // The fence's and the revoke's registrations of this write end only
        // when its last receive is reaped: each receive's window holds them,
        // so a receive parked because this future was dropped keeps them too.
        let landing = match self.landing.take() {
            Some(cell) if Rc::strong_count(&cell) == 1 => cell,
            _ => Rc::new(LandingCell::default()),
        };
        *landing.0.borrow_mut() = Some(Landing {
            fence: self.engine.fences.begin_write(self.session, h.batch),
            grant: LandingGuard::begin(&seg, h.offset, h.length, epoch),
        });
        let (len, mut landed) = (h.length, 0u64);
        let mut first_receive = true;
        while landed < len && !landing.with(|l| l.fence.fenced() || l.grant.revoked()) {
            // What was read ahead with the header lands first, copied while
            // the registrations are held (nothing else runs meanwhile).
            let ahead = self.rx.take((len - landed) as usize);
            if !ahead.is_empty() {
                seg.inner.mem.copy_in((h.offset + landed) as usize, ahead);
                landed += ahead.len() as u64;
                continue;
            }
            let window = Window::new(
                seg.inner.mem.clone(),
                (h.offset + landed) as usize,
                (len - landed) as usize,
            )
            .keeping(landing.clone());
            // The payload follows its header: its first receive tries the
            // socket at once (a small write lands in the turn that read the
            // header, not after another park); the rest takes the ring.
            let mut op = match std::mem::take(&mut first_receive) {
                true => self.s.read_expected(window),
                false => self.s.read(window),
            };
            let canceller = match &self.canceller {
                Some(c) => op.canceller_reusing(c),
                None => self.canceller.insert(op.canceller()).clone(),
            };
            landing.with(|l| {
                l.fence.set_canceller(Some(canceller.clone()));
                l.grant.set_canceller(Some(canceller));
            });
            // A payload that stops coming closes the connection after the
            // idle limit (the parked receive keeps the registrations).
            let received = self.idle.within(op).await;
            landing.with(|l| {
                l.fence.set_canceller(None);
                l.grant.set_canceller(None);
            });
            let (res, _window) = received?;
            match res {
                Ok(0) => return Err(Closed::Io(io::ErrorKind::UnexpectedEof.into())),
                Ok(n) => landed += n as u64,
                Err(e) if e.raw_os_error() == Some(libc::ECANCELED) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        let revoked = landed < len && landing.with(|l| l.grant.revoked());
        // The receive is reaped: a fence or revoke waiting for this write may
        // resolve. The segment goes too: the rest of a cut write is dropped,
        // and a stalled sender must not keep the memory (caller-owned
        // memory comes back only when no handle to it is left).
        drop(landing.0.borrow_mut().take());
        self.landing = Some(landing);
        drop(seg);
        let st = if landed == len {
            Status::Ok
        } else {
            // Fenced or revoked mid-way: the rest is dropped, not landed.
            self.rx
                .discard(self.s, len - landed, Some(&mut self.idle))
                .await?;
            cut_short(revoked, landed)
        };
        let c = &self.engine.counters;
        c.bytes_landed.set(c.bytes_landed.get() + landed);
        self.send(&status_frame(h, st, landed), &[]).await?;
        Ok(())
    }

    pub(crate) async fn read(&mut self, h: &Header) -> Result<(), Closed> {
        let seg = match self.check(h, Rights::READ) {
            Ok((seg, _)) => seg,
            Err(st) => return self.refuse(h, st, 0).await,
        };
        let head = Header {
            op: Opcode::ReadData,
            ..*h
        };
        if h.length <= INLINE_READ {
            // Small: header and data in one send, one reactor turn, the data
            // copied from the segment straight into the frame (checked
            // above); the segment let go before the send waits.
            let frame = frame_filled(&head, h.length as usize, |b| {
                seg.read_at(h.offset, b);
            });
            drop(seg);
            return self.sent(send_frame_buffer(self.s, frame)).await;
        }
        self.send(&head, &[]).await?;
        // The window holds the segment's memory until the send ends (or the
        // idle limit cuts it).
        let window = Window::new(seg.inner.mem.clone(), h.offset as usize, h.length as usize);
        drop(seg);
        let zc = self
            .engine
            .config
            .zc_threshold
            .is_some_and(|t| h.length >= t as u64);
        let s = self.s;
        self.sent(async move {
            let (res, _) = match zc {
                true => s.write_all_zc(window).await,
                false => s.write_all(window).await,
            };
            res
        })
        .await
    }
}
