//! A segment of a peer that this initiator has opened, and its data path:
//! small writes copied into one frame (or the mailbox), larger transfers
//! cut into slices and striped over the peer's data connections.

use std::cell::Cell;
use std::ops::Deref;
use std::rc::Rc;

use quiesce_runtime::{spawn_local, IoBuf, IoBufMut};

use crate::control::wire::{Descriptor, GrantReceipt, Opcode};
use crate::error::TransferError;
use crate::local::loan::{lend, Request};
use crate::local::mailbox::SLOT_DATA;
use crate::tcp::conn::{Conn, SegmentGrant};
use crate::tcp::peer::Peer;
use crate::tcp::request::INLINE_PAYLOAD;
use crate::tcp::split::{bytes_of, init_bytes, join_slices, set_filled, slices, Part, SplitBuf};

/// A segment of a peer that this initiator has opened.
///
/// A handle writes under the grant of the open that made it (its clones
/// too): once the target revoked a range and this initiator opened the
/// segment again — taking the revoke's grant on its connections — an older
/// handle's writes are refused `Revoked` without being sent, wherever they
/// would land, since they may have been made before the revoke
/// (PROTOCOL.md §5.1). Write through the handle the new open returned.
#[derive(Clone)]
pub struct RemoteSegment {
    pub(crate) peer: Peer,
    /// One open's: shared by the handle's clones (one per transfer), and
    /// kept two words wide (a small write's state holds a copy).
    pub(crate) desc: Rc<Proven>,
}

/// One open of a segment: what the target described, and the grant epoch
/// the open was given (its handles' writes go out under no newer one);
/// with the segment's state every open of it shares ([`ProvenSegment`]).
pub(crate) struct Proven {
    desc: Descriptor,
    /// Set once, when the open that made it finished proving.
    ceiling: Cell<u64>,
    segment: Rc<ProvenSegment>,
}

/// What every open of one segment (this id, this memory) on a peer shares:
/// whether it is still the segment of that id there — a restarted target's
/// new process counts ids from 1 again: its segment of an old id is other
/// memory, and the peer, finding another segment under the id on a
/// reconnect (or an open), marks this one gone, and nothing of its handles
/// may reach the new one — and the newest grant an open of it was given.
pub(crate) struct ProvenSegment {
    current: Cell<bool>,
    /// What a reconnect proves, and no newer (a new connection must not
    /// carry writes made before a revoke under the grant the revoke made).
    opened: Cell<GrantReceipt>,
}

impl Proven {
    /// The first open of a segment.
    pub(crate) fn new(desc: Descriptor) -> Proven {
        Proven {
            desc,
            ceiling: Cell::new(0),
            segment: Rc::new(ProvenSegment {
                current: Cell::new(true),
                opened: Cell::new(GrantReceipt::NONE),
            }),
        }
    }

    /// Another open of the segment this one opened.
    pub(crate) fn again(&self, desc: Descriptor) -> Proven {
        Proven {
            desc,
            ceiling: Cell::new(0),
            segment: self.segment.clone(),
        }
    }

    /// Whether `other` opened the same segment as this one.
    pub(crate) fn same_opening_of(&self, other: &Proven) -> bool {
        Rc::ptr_eq(&self.segment, &other.segment)
    }

    /// The newest grant an open of the segment was given.
    pub(crate) fn opened_grant(&self) -> GrantReceipt {
        self.segment.opened.get()
    }

    /// An open was given grant `g`.
    pub(crate) fn opened_with(&self, g: GrantReceipt) {
        if g.epoch > self.segment.opened.get().epoch {
            self.segment.opened.set(g);
        }
    }

    /// This open is done: its handles write under the newest grant an open
    /// of the segment was given by now.
    pub(crate) fn seal(&self) {
        self.ceiling.set(self.opened_grant().epoch);
    }

    /// Another segment has this one's id at the peer now.
    pub(crate) fn forget(&self) {
        self.segment.current.set(false);
    }

    fn current(&self) -> bool {
        self.segment.current.get()
    }
}

impl Deref for Proven {
    type Target = Descriptor;

    fn deref(&self) -> &Descriptor {
        &self.desc
    }
}

/// A transfer of `len` bytes at `offset` of a segment of `seg_len` bytes:
/// not empty, and inside without overflow.
pub(crate) fn check_range(offset: u64, len: u64, seg_len: u64) -> Result<(), TransferError> {
    if len == 0 {
        return Err(TransferError::BadLength("zero-length transfer"));
    }
    if offset.checked_add(len).is_none_or(|e| e > seg_len) {
        return Err(TransferError::OutOfBounds {
            offset,
            len,
            seg_len,
        });
    }
    Ok(())
}

/// A read's checks: [`check_range`], and a destination of `dst_total` bytes
/// that holds the range.
pub(crate) fn check_read(
    offset: u64,
    len: u64,
    seg_len: u64,
    dst_total: usize,
) -> Result<(), TransferError> {
    check_range(offset, len, seg_len)?;
    if len > dst_total as u64 {
        return Err(TransferError::BadLength(
            "destination smaller than the range",
        ));
    }
    Ok(())
}

/// The descriptor accessors of a remote segment handle (a `desc:
/// Rc<Descriptor>` field): TCP's and RDMA's alike.
macro_rules! descriptor_accessors {
    () => {
        /// The segment's id at the peer.
        pub fn id(&self) -> u64 {
            self.desc.id
        }

        /// Its length.
        pub fn len(&self) -> u64 {
            self.desc.len
        }

        /// True for an empty segment.
        pub fn is_empty(&self) -> bool {
            self.desc.len == 0
        }

        /// Its name.
        pub fn name(&self) -> &str {
            &self.desc.name
        }

        /// The target's virtual address of its first byte: the offset of a
        /// peer address `a` in it is `a - base()`.
        pub fn base(&self) -> u64 {
            self.desc.base
        }

        /// What the peer advertised. The target enforces it: in its request
        /// checks over TCP, with its memory region's access flags (its NIC)
        /// over RDMA.
        pub fn rights(&self) -> crate::segment::Rights {
            self.desc.rights
        }
    };
}
pub(crate) use descriptor_accessors;

impl RemoteSegment {
    descriptor_accessors!();

    /// What the target told about it when it was opened.
    pub(crate) fn descriptor(&self) -> &Descriptor {
        &self.desc
    }

    /// `conn`, on which to send a request of this segment — unless the
    /// segment is gone at the peer ([`Proven`]): a connection to a restarted
    /// target may have the segment of this id proven, and it is not this one.
    /// Asked once the connection is in hand, since opening it re-proves.
    /// (A write checks the connection's grant against its handle's under the
    /// connection's send lock: [`Conn::granted_above`].)
    fn on(&self, conn: Rc<Conn>) -> Result<Rc<Conn>, TransferError> {
        match self.desc.current() {
            true => Ok(conn),
            false => Err(TransferError::NoSuchSegment(self.desc.id)),
        }
    }

    /// The grant epoch of the open that made this handle: its writes go out
    /// under no newer grant of the segment (see the type's docs). A newer
    /// open of the segment may have a newer one.
    pub fn grant_epoch(&self) -> u64 {
        self.desc.ceiling.get()
    }

    /// True once the target no longer has this opening's segment (a
    /// restarted target refused it when a connection proved it again):
    /// every transfer fails `NoSuchSegment`, and only opening it again
    /// gives a handle that works.
    pub fn is_gone(&self) -> bool {
        !self.desc.current()
    }

    /// The peer it lives on.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// Cuts `0..len` of `shared` into slices, runs `slice(conn, offset, part)`
    /// for each on the data connections round-robin (each slice a task of its
    /// own, so it finishes even if the caller's future is dropped; a single
    /// slice runs in place), and folds the results once every slice has answered.
    async fn stripe<B, F, Fut>(
        &self,
        shared: &SplitBuf<B>,
        len: u64,
        write: bool,
        slice: F,
    ) -> Result<u64, TransferError>
    where
        B: IoBuf,
        F: Fn(Rc<Conn>, u64, Part<B>) -> Fut + Clone + 'static,
        Fut: std::future::Future<Output = Result<u64, TransferError>> + 'static,
    {
        let inner = &self.peer.inner;
        let n = inner.params.connections.max(1);
        // Attached: the target copies a request in chunks of its own, so a
        // slice needs no bound of a frame's and fewer round trips are better.
        let slice_size = match self.peer.is_local() {
            true => inner.params.slice_size.max(crate::local::SLICE),
            false => inner.params.slice_size,
        };
        if len <= slice_size as u64 {
            // One slice: run it in place. If this future is dropped mid-send,
            // the connection's send guard kills the connection (framing is
            // lost) and the parked op keeps the part alive until reaped.
            let conn = self.next_conn().await?;
            return slice(conn, 0, shared.part(0, len as usize)).await;
        }
        let handles: Vec<_> = slices(len, slice_size)
            .map(|(off, l)| {
                let i = inner.rr.get();
                inner.rr.set(i.wrapping_add(1));
                let part = shared.part(off as usize, l as usize);
                let (seg, slice) = (self.clone(), slice.clone());
                spawn_local(async move {
                    let conn = seg.on(seg.peer.conn(1 + i % n).await?)?;
                    slice(conn, off, part).await
                })
            })
            .collect();
        join_slices(handles, write).await
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), TransferError> {
        check_range(offset, len, self.desc.len)
    }

    /// A local request for `len` bytes at `offset`, at `at` in this process.
    fn request(&self, op: Opcode, batch: u64, offset: u64, at: *const u8, len: u64) -> Request {
        Request {
            op,
            batch,
            to: self.grant(),
            offset,
            addr: at as u64,
            len,
        }
    }

    /// Where this handle's writes go, and under which grant at most.
    fn grant(&self) -> SegmentGrant {
        SegmentGrant {
            id: self.desc.id,
            ceiling: self.desc.ceiling.get(),
        }
    }

    /// The next data connection, round-robin.
    async fn next_conn(&self) -> Result<Rc<Conn>, TransferError> {
        match self.next_live_conn() {
            Ok(c) => self.on(c),
            Err(i) => self.on(self.peer.conn(i).await?),
        }
    }

    /// The next data connection, round-robin, if it is up; else its index,
    /// for [`Peer::conn`] to open it. A small transfer's path: no future to
    /// build when the connection is there.
    fn next_live_conn(&self) -> Result<Rc<Conn>, usize> {
        let inner = &self.peer.inner;
        let i = inner.rr.get();
        inner.rr.set(i.wrapping_add(1));
        let i = 1 + i % inner.params.connections.max(1);
        self.peer.live(i).ok_or(i)
    }

    /// Writes the initialised bytes of `src` to `offset`, sliced and striped
    /// over the peer's connections. Resolves when every slice has its answer
    /// and every local operation has returned its part of `src`.
    pub async fn write<B: IoBuf>(
        &self,
        offset: u64,
        src: B,
        batch: u64,
    ) -> (Result<u64, TransferError>, B) {
        let len = src.bytes_init() as u64;
        if len <= INLINE_PAYLOAD as u64 {
            return self.write_small(offset, src, batch).await;
        }
        if let Err(e) = self.check(offset, len) {
            return (Err(e), src);
        }
        self.write_striped(offset, src, len, batch).await
    }

    /// [`write`](Self::write) for a future kept unboxed (a one-task batch's
    /// driver holds it in its own state): a write of more than 16 KiB (what
    /// goes in one frame) is boxed here, so that the small path's state
    /// alone sizes the driver (the striped path's is twice it).
    pub async fn write_held<B: IoBuf>(
        &self,
        offset: u64,
        src: B,
        batch: u64,
    ) -> (Result<u64, TransferError>, B) {
        if src.bytes_init() <= INLINE_PAYLOAD {
            return self.write_small(offset, src, batch).await;
        }
        Box::pin(self.write(offset, src, batch)).await
    }

    /// A write of at most [`INLINE_PAYLOAD`] bytes, checked here: copied
    /// into the frame (or the mailbox), so nothing of `src` is lent and
    /// nothing needs to share it (no `SplitBuf`).
    async fn write_small<B: IoBuf>(
        &self,
        offset: u64,
        src: B,
        batch: u64,
    ) -> (Result<u64, TransferError>, B) {
        let len = src.bytes_init() as u64;
        if let Err(e) = self.check(offset, len) {
            return (Err(e), src);
        }
        let conn = match self.next_live_conn() {
            Ok(c) => self.on(c),
            Err(i) => match self.peer.conn(i).await {
                Ok(c) => self.on(c),
                Err(e) => Err(e),
            },
        };
        let conn = match conn {
            Ok(c) => c,
            Err(e) => return (Err(e), src),
        };
        if conn.has_outbox() {
            let res = conn
                .write_mailbox(batch, self.grant(), offset, init_bytes(&src))
                .await;
            return (res, src);
        }
        if conn.is_local() {
            let req = self.request(Opcode::WriteLocal, batch, offset, src.stable_ptr(), len);
            // Boxed (the local transport without a mailbox): its state
            // stays out of the small TCP write's future.
            return Box::pin(lend(&self.peer, conn, req, src)).await;
        }
        let res = conn
            .write_copied(batch, self.grant(), offset, init_bytes(&src))
            .await;
        (res, src)
    }

    /// A checked [`write`](Self::write) of more than [`INLINE_PAYLOAD`]
    /// bytes: sliced and striped over the data connections.
    async fn write_striped<B: IoBuf>(
        &self,
        offset: u64,
        src: B,
        len: u64,
        batch: u64,
    ) -> (Result<u64, TransferError>, B) {
        let shared = SplitBuf::source(src);
        let p = &self.peer.inner.params;
        let zc_threshold = p.zc_threshold;
        let seg = self.grant();
        let this = self.clone();
        let res = self
            .stripe(&shared, len, true, move |conn, off, part| {
                let this = this.clone();
                async move {
                    if conn.has_outbox() && part.len() <= SLOT_DATA {
                        let data = bytes_of(&part);
                        return conn.write_mailbox(batch, seg, offset + off, data).await;
                    }
                    if conn.is_local() {
                        let at = part.stable_ptr();
                        let n = part.len() as u64;
                        let req = this.request(Opcode::WriteLocal, batch, offset + off, at, n);
                        return lend(&this.peer, conn, req, part).await.0;
                    }
                    let zc = zc_threshold.is_some_and(|t| part.len() >= t);
                    conn.write(batch, seg, offset + off, part, zc).await.0
                }
            })
            .await;
        match shared.try_into_inner() {
            Ok(src) => (res, src),
            Err(_) => unreachable!("every slice returned its part"),
        }
    }

    /// Reads `len` bytes at `offset` into `dst[..len]` (`len <=
    /// dst.bytes_total()`), sliced and striped like [`write`](Self::write).
    pub async fn read<B: IoBufMut>(
        &self,
        offset: u64,
        len: u64,
        dst: B,
        batch: u64,
    ) -> (Result<u64, TransferError>, B) {
        if let Err(e) = check_read(offset, len, self.desc.len, dst.bytes_total()) {
            return (Err(e), dst);
        }
        let shared = SplitBuf::destination(dst);
        let seg = self.desc.id;
        let this = self.clone();
        let res = self
            .stripe(&shared, len, false, move |conn, off, mut part| {
                let this = this.clone();
                async move {
                    if conn.has_outbox() && part.len() <= SLOT_DATA {
                        return conn.read_mailbox(batch, seg, offset + off, part).await;
                    }
                    if conn.is_local() {
                        let at = part.stable_mut_ptr();
                        let n = part.len() as u64;
                        let req = this.request(Opcode::ReadLocal, batch, offset + off, at, n);
                        return lend(&this.peer, conn, req, part).await.0;
                    }
                    conn.read(batch, seg, offset + off, part).await
                }
            })
            .await;
        let mut dst = match shared.try_into_inner() {
            Ok(dst) => dst,
            Err(_) => unreachable!("every slice returned its part"),
        };
        if res.is_ok() {
            set_filled(&mut dst, len as usize);
        }
        (res, dst)
    }
}
