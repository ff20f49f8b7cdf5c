//! What a batch needs from a transport, and the answer of the one-sided
//! transports (TCP and RDMA verbs).

use std::future::Future;
use std::hash::{Hash, Hasher};
use std::marker::PhantomData;
use std::net::SocketAddr;

use quiesce_runtime::{IoBuf, IoBufMut};
use quiesce_transports::rdma::{RdmaPeer, RdmaSegment};
use quiesce_transports::{Peer, RemoteSegment, TransferError};

/// A transport a batch can drive. Its transfer futures must resolve only
/// once the transfer has quiesced: the buffer they hand back is touched by
/// no kernel, NIC or peer any more.
pub trait Transport: Clone + 'static {
    /// Where a task's bytes go (write) or come from (read), with the length.
    type Target: Clone + 'static;
    /// The fence domain a target belongs to.
    type Peer: Clone + Eq + Hash + 'static;

    /// The peer serving `target`.
    fn peer(&self, target: &Self::Target) -> Self::Peer;

    /// Bytes the task moves.
    fn len(&self, target: &Self::Target) -> u64;

    /// Writes the initialised bytes of `src` to `target`.
    fn write<B: IoBuf>(
        &self,
        target: &Self::Target,
        src: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static;

    /// [`write`](Self::write) for a future the batch's driver keeps in its
    /// own state (a one-task batch's, which is not boxed on its own): a
    /// transport may box there what a small write does not need, so that
    /// the driver's allocation stays small. Where the future is boxed
    /// anyway (a task of a larger batch), [`write`](Self::write) is used.
    fn write_held<B: IoBuf>(
        &self,
        target: &Self::Target,
        src: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        self.write(target, src, batch)
    }

    /// Reads `target` into the first bytes of `dst`.
    fn read<B: IoBufMut>(
        &self,
        target: &Self::Target,
        dst: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static;

    /// Remote fence: resolves once `peer` will apply no further byte of `batch`.
    fn fence(
        &self,
        peer: &Self::Peer,
        batch: u64,
    ) -> impl Future<Output = Result<(), TransferError>> + 'static;

    /// Local teardown: make every in-flight operation towards `peer` end
    /// (their futures still resolve only once reaped).
    fn abort(&self, peer: &Self::Peer);

    /// Called once per peer an attempt fenced, when every transfer of wire
    /// batch `batch` has ended and none will start: the transport may
    /// forget the batch (and tell the peer it can).
    fn retire(&self, peer: &Self::Peer, batch: u64) {
        let _ = (peer, batch);
    }
}

/// A segment handle of a one-sided transport (TCP's [`RemoteSegment`],
/// RDMA's [`RdmaSegment`]): what [`Segments`] needs to drive it.
pub trait OneSided: Clone + 'static {
    /// The peer serving it.
    type Peer: FencePeer;
    /// The peer.
    fn peer(&self) -> &Self::Peer;
    /// Writes the initialised bytes of `src` at `offset`.
    fn write_at<B: IoBuf>(
        &self,
        offset: u64,
        src: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)>;
    /// [`write_at`](Self::write_at) for a future kept unboxed in the
    /// driver's state ([`Transport::write_held`]).
    fn write_held_at<B: IoBuf>(
        &self,
        offset: u64,
        src: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> {
        self.write_at(offset, src, batch)
    }
    /// Reads `len` bytes at `offset` into `dst`.
    fn read_at<B: IoBufMut>(
        &self,
        offset: u64,
        len: u64,
        dst: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)>;
}

/// A peer that can be fenced and torn down.
pub trait FencePeer: Clone + 'static {
    /// Its address.
    fn addr(&self) -> SocketAddr;
    /// Its identity: equal for two handles of one peer, different for two
    /// peers alive at once (two engines' peers at one address included).
    fn identity(&self) -> usize;
    /// Remote fence of `batch`.
    fn fence(&self, batch: u64) -> impl Future<Output = Result<(), TransferError>>;
    /// Local teardown.
    fn abort(&self);
    /// The batch is finished towards this peer.
    fn retire(&self, batch: u64);
}

macro_rules! one_sided {
    ($seg:ty, $peer:ty $(, held: $held:ident)?) => {
        impl OneSided for $seg {
            type Peer = $peer;
            fn peer(&self) -> &$peer {
                <$seg>::peer(self)
            }
            fn write_at<B: IoBuf>(
                &self,
                offset: u64,
                src: B,
                batch: u64,
            ) -> impl Future<Output = (Result<u64, TransferError>, B)> {
                <$seg>::write(self, offset, src, batch)
            }
            $(fn write_held_at<B: IoBuf>(
                &self,
                offset: u64,
                src: B,
                batch: u64,
            ) -> impl Future<Output = (Result<u64, TransferError>, B)> {
                <$seg>::$held(self, offset, src, batch)
            })?
            fn read_at<B: IoBufMut>(
                &self,
                offset: u64,
                len: u64,
                dst: B,
                batch: u64,
            ) -> impl Future<Output = (Result<u64, TransferError>, B)> {
                <$seg>::read(self, offset, len, dst, batch)
            }
        }

        impl FencePeer for $peer {
            fn addr(&self) -> SocketAddr {
                <$peer>::addr(self)
            }
            fn identity(&self) -> usize {
                <$peer>::identity(self)
            }
            fn fence(&self, batch: u64) -> impl Future<Output = Result<(), TransferError>> {
                <$peer>::fence(self, batch)
            }
            fn abort(&self) {
                <$peer>::abort(self)
            }
            fn retire(&self, batch: u64) {
                <$peer>::retire(self, batch)
            }
        }
    };
}

one_sided!(RemoteSegment, Peer, held: write_held);
one_sided!(RdmaSegment, RdmaPeer);

/// A range of a remote segment.
#[derive(Clone)]
pub struct Range<S> {
    /// The segment.
    pub segment: S,
    /// Offset within it.
    pub offset: u64,
    /// Length.
    pub len: u64,
}

impl<S: Clone> Range<S> {
    /// `segment[offset..offset + len]`.
    pub fn new(segment: &S, offset: u64, len: u64) -> Range<S> {
        Range {
            segment: segment.clone(),
            offset,
            len,
        }
    }
}

/// A range of a TCP segment.
pub type RemoteRange = Range<RemoteSegment>;
/// A range of an RDMA segment.
pub type RdmaRange = Range<RdmaSegment>;

/// A peer compared by identity ([`FencePeer::identity`]), for fence
/// bookkeeping: a fence goes to a session, and two peers at one address
/// (two engines) are two sessions — fenced, and confirmed, each on its own.
#[derive(Clone)]
pub struct Key<P>(pub P);

impl<P: FencePeer> PartialEq for Key<P> {
    fn eq(&self, other: &Self) -> bool {
        self.0.identity() == other.0.identity()
    }
}

impl<P: FencePeer> Eq for Key<P> {}

impl<P: FencePeer> Hash for Key<P> {
    fn hash<H: Hasher>(&self, h: &mut H) {
        self.0.identity().hash(h)
    }
}

/// A TCP peer as a fence key.
pub type PeerKey = Key<Peer>;
/// An RDMA peer as a fence key.
pub type RdmaPeerKey = Key<RdmaPeer>;

/// The transport of one-sided segments `S`.
pub struct Segments<S>(PhantomData<fn() -> S>);

impl<S> Clone for Segments<S> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<S> Copy for Segments<S> {}

impl<S> Default for Segments<S> {
    fn default() -> Self {
        Segments(PhantomData)
    }
}

impl<S> std::fmt::Debug for Segments<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(std::any::type_name::<S>())
    }
}

/// The TCP transport of `quiesce-transports`.
pub type Tcp = Segments<RemoteSegment>;
/// The TCP transport (the value).
#[allow(non_upper_case_globals)]
pub const Tcp: Tcp = Segments(PhantomData);

/// The RDMA verbs transport of `quiesce-transports`: buffers must lie in a
/// region registered with the initiator's `RdmaEngine`.
pub type Rdma = Segments<RdmaSegment>;
/// The RDMA transport (the value).
#[allow(non_upper_case_globals)]
pub const Rdma: Rdma = Segments(PhantomData);

impl<S: OneSided> Transport for Segments<S> {
    type Target = Range<S>;
    type Peer = Key<S::Peer>;

    fn peer(&self, t: &Range<S>) -> Key<S::Peer> {
        Key(t.segment.peer().clone())
    }

    fn len(&self, t: &Range<S>) -> u64 {
        t.len
    }

    fn write<B: IoBuf>(
        &self,
        t: &Range<S>,
        src: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        let t = t.clone();
        async move { t.segment.write_at(t.offset, src, batch).await }
    }

    fn write_held<B: IoBuf>(
        &self,
        t: &Range<S>,
        src: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        let t = t.clone();
        async move { t.segment.write_held_at(t.offset, src, batch).await }
    }

    fn read<B: IoBufMut>(
        &self,
        t: &Range<S>,
        dst: B,
        batch: u64,
    ) -> impl Future<Output = (Result<u64, TransferError>, B)> + 'static {
        let t = t.clone();
        async move { t.segment.read_at(t.offset, t.len, dst, batch).await }
    }

    fn fence(
        &self,
        peer: &Key<S::Peer>,
        batch: u64,
    ) -> impl Future<Output = Result<(), TransferError>> + 'static {
        let p = peer.0.clone();
        async move { p.fence(batch).await }
    }

    fn abort(&self, peer: &Key<S::Peer>) {
        peer.0.abort()
    }

    fn retire(&self, peer: &Key<S::Peer>, batch: u64) {
        peer.0.retire(batch)
    }
}
