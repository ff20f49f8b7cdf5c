//! Segments: local memory registered for remote access.

use std::cell::RefCell;
use std::rc::{Rc, Weak};

use bitflags::bitflags;

use crate::control::auth::Token;
use crate::control::revoke::{Grants, RevokeError};
use crate::memory::{AlignedBuf, ExposedMemory, ForeignMemory};

bitflags! {
    /// What a peer that proved a segment's token may do to it.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
    pub struct Rights: u8 {
        /// Remote reads (the peer reads this memory).
        const READ = 1;
        /// Remote writes (the peer writes this memory).
        const WRITE = 2;
    }
}

/// Memory a segment can expose.
pub enum SegmentMemory {
    /// A vector's bytes (its length, not its capacity).
    Vec(Vec<u8>),
    /// A page-aligned buffer.
    Aligned(AlignedBuf),
    /// Memory the caller owns (see [`ForeignMemory`]).
    Foreign(ForeignMemory),
}

impl From<ForeignMemory> for SegmentMemory {
    fn from(f: ForeignMemory) -> Self {
        SegmentMemory::Foreign(f)
    }
}

impl From<Vec<u8>> for SegmentMemory {
    fn from(v: Vec<u8>) -> Self {
        SegmentMemory::Vec(v)
    }
}

impl From<Box<[u8]>> for SegmentMemory {
    fn from(b: Box<[u8]>) -> Self {
        SegmentMemory::Vec(b.into_vec())
    }
}

impl From<AlignedBuf> for SegmentMemory {
    fn from(b: AlignedBuf) -> Self {
        SegmentMemory::Aligned(b)
    }
}

pub(crate) struct SegmentInner {
    pub(crate) id: u64,
    pub(crate) name: String,
    pub(crate) rights: Rights,
    pub(crate) token: Token,
    pub(crate) mem: Rc<ExposedMemory>,
    pub(crate) grants: Grants,
    /// What else serves the segment (RDMA: its memory regions) and must
    /// stop when the engine deregisters it, however it is asked to.
    pub(crate) withdraw: RefCell<Option<Box<dyn FnOnce()>>>,
    /// Every segment of its engine: a revoke reaches those that overlap it.
    exposed: Rc<ExposedSegments>,
}

/// Every segment of one engine that peers may still reach: the registered
/// ones, and deregistered ones that writes still land in (their landing
/// guards hold them). Segments may overlap — a range registered, then one
/// inside it — so a revoke of memory reaches each segment that holds part
/// of it ([`Segment::revoke`]).
#[derive(Default)]
pub(crate) struct ExposedSegments(RefCell<Vec<Weak<SegmentInner>>>);

impl ExposedSegments {
    fn add(&self, s: &Rc<SegmentInner>) {
        let mut all = self.0.borrow_mut();
        all.retain(|w| w.strong_count() > 0);
        all.push(Rc::downgrade(s));
    }

    /// Those whose memory overlaps the addresses `lo..hi`.
    fn overlapping(&self, lo: u64, hi: u64) -> Vec<Segment> {
        self.0
            .borrow()
            .iter()
            .filter_map(Weak::upgrade)
            .map(|inner| Segment { inner })
            .filter(|s| s.base() < hi && lo < s.base().saturating_add(s.len()))
            .collect()
    }
}

/// A registered segment (the target's side). Cheap to clone.
///
/// Remote peers write into its memory while this handle exists, so local
/// access is by copy ([`read_at`](Self::read_at), [`write_at`](Self::write_at)).
#[derive(Clone)]
pub struct Segment {
    pub(crate) inner: Rc<SegmentInner>,
}

impl Segment {
    pub(crate) fn new(
        id: u64,
        name: String,
        mem: SegmentMemory,
        rights: Rights,
        token: Token,
        exposed: &Rc<ExposedSegments>,
    ) -> Segment {
        let mem = match mem {
            SegmentMemory::Vec(v) => ExposedMemory::from_vec(v),
            SegmentMemory::Aligned(b) => ExposedMemory::from_aligned(b),
            SegmentMemory::Foreign(f) => ExposedMemory::from_foreign(f),
        };
        let inner = Rc::new(SegmentInner {
            id,
            name,
            rights,
            token,
            mem: Rc::new(mem),
            grants: Grants::default(),
            withdraw: Default::default(),
            exposed: exposed.clone(),
        });
        exposed.add(&inner);
        Segment { inner }
    }

    /// The id peers address it by.
    pub fn id(&self) -> u64 {
        self.inner.id
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Its length.
    pub fn len(&self) -> u64 {
        self.inner.mem.len() as u64
    }

    /// The virtual address of its first byte in this process: what peers
    /// that address remote memory by address (Mooncake's API) name it by.
    pub fn base(&self) -> u64 {
        self.inner.mem.raw().0 as u64
    }

    /// True for an empty segment.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What peers may do.
    pub fn rights(&self) -> Rights {
        self.inner.rights
    }

    /// The secret to hand to authorised peers.
    pub fn token(&self) -> Token {
        self.inner.token
    }

    /// Checks `offset..offset + len` against the segment, without overflow.
    pub(crate) fn check_range(&self, offset: u64, len: u64) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len())
    }

    /// Takes `range` back from every peer: resolves once no byte of any
    /// write accepted, queued in a socket or sent before the call can land
    /// in it any more, from any peer (a vanished or partitioned one too),
    /// through this segment or any other of the engine that overlaps the
    /// range's memory (each is revoked over its part of it). Writes into
    /// the range land again only from connections that prove a token after
    /// the call (an initiator's `Peer::open`, or any new connection); older
    /// ones are refused with `Revoked`. See `revoke.rs` for how.
    pub async fn revoke(&self, range: std::ops::Range<u64>) -> Result<(), RevokeError> {
        let (start, end) = (range.start, range.end);
        if start >= end || end > self.len() {
            return Err(RevokeError::OutOfBounds {
                start,
                end,
                len: self.len(),
            });
        }
        let (lo, hi) = (self.base() + start, self.base() + end);
        // Every part revoked first, then waited for: no part's old writes
        // land on while another's are waited for.
        let parts: Vec<_> = self
            .inner
            .exposed
            .overlapping(lo, hi)
            .into_iter()
            .map(|s| {
                let from = lo.max(s.base()) - s.base();
                let to = hi.min(s.base() + s.len()) - s.base();
                let (epoch, keys_dead) = s.inner.grants.begin_revoke(from, to);
                (s, from, to, epoch, keys_dead)
            })
            .collect();
        for (s, from, to, epoch, _) in &parts {
            s.inner.grants.quiesced(*from, *to, *epoch).await;
        }
        match parts.iter().find(|p| !p.4) {
            Some((s, ..)) => Err(RevokeError::KeysLive { segment: s.id() }),
            None => Ok(()),
        }
    }

    /// Copies bytes out. `false` (and nothing copied) if out of range.
    pub fn read_at(&self, offset: u64, dst: &mut [u8]) -> bool {
        if !self.check_range(offset, dst.len() as u64) {
            return false;
        }
        self.inner.mem.copy_out(offset as usize, dst);
        true
    }

    /// Copies bytes in. `false` (and nothing copied) if out of range.
    pub fn write_at(&self, offset: u64, src: &[u8]) -> bool {
        if !self.check_range(offset, src.len() as u64) {
            return false;
        }
        self.inner.mem.copy_in(offset as usize, src);
        true
    }
}

impl std::fmt::Debug for Segment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segment")
            .field("id", &self.id())
            .field("name", &self.name())
            .field("len", &self.len())
            .field("rights", &self.rights())
            .finish()
    }
}
