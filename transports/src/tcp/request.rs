//! An initiator connection's data requests: writes (their bytes copied
//! into the frame, or lent to the send) and reads, each registered for its
//! answer under the send lock, right before its frame.

use std::rc::Rc;

use quiesce_runtime::{IoBuf, IoBufMut};

use crate::control::frame::send_frame;
use crate::control::wire::{Header, Opcode};
use crate::error::TransferError;
use crate::tcp::conn::{Conn, SegmentGrant, SendGuard};
use crate::tcp::responses::{slot, wait, Pending, Reply};
use crate::tcp::split::{bytes_of, Erased, Part};

/// Payloads up to this size travel in the same send as their header.
pub(crate) const INLINE_PAYLOAD: usize = 16 * 1024;

/// What a write frame carries.
enum Payload<'a, B> {
    /// Bytes copied into the frame (small writes).
    Copied(&'a [u8]),
    /// A part of the caller's buffer, lent to the send; `true`: `SEND_ZC`.
    Lent(Part<B>, bool),
}

impl<B> Payload<'_, B> {
    fn len(&self) -> usize {
        match self {
            Payload::Copied(d) => d.len(),
            Payload::Lent(p, _) => p.len(),
        }
    }

    fn into_part(self) -> Option<Part<B>> {
        match self {
            Payload::Copied(_) => None,
            Payload::Lent(p, _) => Some(p),
        }
    }
}

impl Conn {
    /// Writes `part` to `to[offset..]`; the part comes back with the result.
    pub(crate) async fn write<B: IoBuf>(
        &self,
        batch: u64,
        to: SegmentGrant,
        offset: u64,
        part: Part<B>,
        zc: bool,
    ) -> (Result<u64, TransferError>, Part<B>) {
        let (res, part) = self
            .write_payload(batch, to, offset, Payload::Lent(part, zc))
            .await;
        (res, part.expect("a lent part comes back"))
    }

    /// Writes `data` (at most [`INLINE_PAYLOAD`] bytes) to `to[offset..]`,
    /// copied into the frame with its header: nothing of the caller's buffer
    /// is lent to the kernel, so nothing needs to share it.
    pub(crate) async fn write_copied(
        &self,
        batch: u64,
        to: SegmentGrant,
        offset: u64,
        data: &[u8],
    ) -> Result<u64, TransferError> {
        debug_assert!(data.len() <= INLINE_PAYLOAD);
        self.write_payload::<Vec<u8>>(batch, to, offset, Payload::Copied(data))
            .await
            .0
    }

    async fn write_payload<B: IoBuf>(
        &self,
        batch: u64,
        to: SegmentGrant,
        offset: u64,
        payload: Payload<'_, B>,
    ) -> (Result<u64, TransferError>, Option<Part<B>>) {
        let mut g = self.send_guard().await;
        if self.refuses_write(&mut g, to) {
            return (
                Err(TransferError::Revoked { landed: 0 }),
                payload.into_part(),
            );
        }
        let id = self.new_id();
        let result = self.reply();
        let h = Header {
            batch,
            task: id,
            segment: to.id,
            offset,
            length: payload.len() as u64,
            ..Header::new(Opcode::Write)
        };
        // Registered under the send lock, as a read's: a write given up
        // while it waits for the lock leaves no entry behind.
        let pending = Pending::Write {
            len: Some(payload.len() as u64),
            result: result.clone(),
        };
        if self.register(id, pending).is_err() {
            g.complete = true;
            return (Err(self.lost()), payload.into_part());
        }
        if self.fenced_locally(&mut g, id, batch) {
            return (Err(TransferError::Fenced), payload.into_part());
        }
        let (sent, part) = match payload {
            Payload::Copied(data) => (send_frame(&self.stream, &h, data).await, None),
            // Small: header and payload in one send.
            Payload::Lent(part, _) if part.len() <= INLINE_PAYLOAD => (
                send_frame(&self.stream, &h, bytes_of(&part)).await,
                Some(part),
            ),
            Payload::Lent(part, zc) => {
                let (res, part) = self.send_lent(&h, part, zc).await;
                (res, Some(part))
            }
        };
        g.complete = sent.is_ok();
        drop(g);
        if let Err(e) = sent {
            self.state.borrow_mut().pending.remove(&id);
            self.kill(&e.to_string());
            return (Err(self.lost()), part);
        }
        (self.answer(result).await, part)
    }

    /// A result slot for a request: an answered one's, or a new one.
    pub(crate) fn reply(&self) -> Reply<Result<u64, TransferError>> {
        self.replies.borrow_mut().pop().unwrap_or_else(slot)
    }

    /// Waits for the answer in `result`, then keeps the slot for the next
    /// request if nothing else holds it (the reader dropped its copy when it
    /// filled it).
    pub(crate) async fn answer(
        &self,
        result: Reply<Result<u64, TransferError>>,
    ) -> Result<u64, TransferError> {
        let r = wait(&result).await;
        self.recycle(result);
        r
    }

    /// Keeps an answered request's slot for the next request if nothing
    /// else holds it (the reader dropped its copy when it filled it).
    pub(crate) fn recycle(&self, result: Reply<Result<u64, TransferError>>) {
        if Rc::strong_count(&result) == 1 {
            result.borrow_mut().clear();
            let mut spare = self.replies.borrow_mut();
            if spare.len() < 64 {
                spare.push(result);
            }
        }
    }

    /// Reads `segment[offset..offset + part.len()]` into `part`.
    pub(crate) async fn read<B: IoBufMut>(
        &self,
        batch: u64,
        segment: u64,
        offset: u64,
        part: Part<B>,
    ) -> Result<u64, TransferError> {
        let id = self.new_id();
        let result = self.reply();
        let len = part.len() as u64;
        let h = Header {
            batch,
            task: id,
            segment,
            offset,
            length: len,
            ..Header::new(Opcode::Read)
        };
        let mut g = self.send_guard().await;
        // Registered under the send lock, right before the frame: until
        // then no answer can name it (one that did came from a target
        // answering what it was never asked).
        if self.fenced.borrow().contains(&batch) {
            g.complete = true;
            return Err(TransferError::Fenced);
        }
        if self
            .register(
                id,
                Pending::Read {
                    dst: Some(Erased::new(part)),
                    result: result.clone(),
                },
            )
            .is_err()
        {
            g.complete = true;
            return Err(self.lost());
        }
        let sent = send_frame(&self.stream, &h, &[]).await;
        g.complete = sent.is_ok();
        drop(g);
        if let Err(e) = sent {
            // Dropping the pending entry drops the destination part — unless
            // the reader took it (an answer to a frame not fully sent): then
            // the part comes back with the result, which the kill fills.
            let ours = self.state.borrow_mut().pending.remove(&id).is_some();
            self.kill(&e.to_string());
            if !ours {
                let _ = self.answer(result).await;
            }
            return Err(self.lost());
        }
        self.answer(result).await
    }

    /// True if `batch` was fenced by this initiator: request `id` is then
    /// dropped unsent (the send guard is released cleanly).
    pub(crate) fn fenced_locally(&self, g: &mut SendGuard<'_>, id: u64, batch: u64) -> bool {
        if !self.fenced.borrow().contains(&batch) {
            return false;
        }
        g.complete = true;
        self.state.borrow_mut().pending.remove(&id);
        true
    }

    pub(crate) fn register(&self, id: u64, p: Pending) -> Result<(), ()> {
        let mut st = self.state.borrow_mut();
        if st.dead.is_some() {
            return Err(());
        }
        st.pending.insert(id, p);
        Ok(())
    }
}
